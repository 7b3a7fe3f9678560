"""Byte-level GGUF builder for tests: valid and deliberately malformed images.

GGUFWriter (the `gguf` package) is the reference writer for valid files, but it refuses empty
arrays, duplicate names and every kind of corruption; these helpers write any bytes we ask for.
All integers little-endian, as in GGUF v2/v3.
"""
import struct

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
        FLOAT32: "<f", BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def gstr(s, length=None):
    """A GGUF string; `length` overrides the stored length (to corrupt it)."""
    b = s.encode() if isinstance(s, str) else bytes(s)
    return u64(len(b) if length is None else length) + b


def value(vtype, v, sub=None, count=None):
    if vtype == STRING:
        return gstr(v)
    if vtype == ARRAY:
        n = len(v) if count is None else count
        return u32(sub) + u64(n) + b"".join(value(sub, x) for x in v)
    return struct.pack(_FMT[vtype], v)


def kv(key, vtype, v, sub=None, count=None):
    return gstr(key) + u32(vtype) + value(vtype, v, sub, count)


def tensor_info(name, ne, ggml_type, offset, n_dims=None):
    n = len(ne) if n_dims is None else n_dims
    return gstr(name) + u32(n) + b"".join(u64(x) for x in ne) + u32(ggml_type) + u64(offset)


def header(n_tensors, n_kv, version=3, magic=b"GGUF"):
    return magic + u32(version) + u64(n_tensors) + u64(n_kv)


def build(kvs=(), tensors=(), data=b"", version=3, alignment=32, n_kv=None, n_tensors=None,
          magic=b"GGUF"):
    """A whole image: header, kv bytes, tensor-info bytes, padding to `alignment`, data."""
    body = header(len(tensors) if n_tensors is None else n_tensors,
                  len(kvs) if n_kv is None else n_kv, version, magic)
    body += b"".join(kvs) + b"".join(tensors)
    return body + bytes((-len(body)) % alignment) + data
