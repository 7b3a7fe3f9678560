"""The GGUF reader (csrc/engine/gguf.c, csrc/python/py_gguf.c, qwencuda/gguf.py).

Oracles from outside the project: files written by gguf.GGUFWriter, read back by
gguf.GGUFReader, and decoded by gguf.quants.dequantize (the `gguf` package is llama.cpp's own
Python implementation of the format). Malformed images come from tests/ggufbytes.py.
"""
import os
import re
import struct
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T, GGUFValueType as V  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402

import qwencuda as qc  # noqa: E402
from qwencuda import _core  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import ggufbytes as gb  # noqa: E402

ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the fp16 scales in one block (block layouts in csrc/engine/quants.h).
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ2_XXS": [0]}
# NumPy shapes of the synthetic tensors: 1-D to 4-D, several rows, several blocks per row.
SHAPES = {"F32": (2, 3, 4, 5), "F16": (3, 7), "BF16": (5, 9)}


def block(name):
    return gguf.GGML_QUANT_SIZES[T[name]]


def shape_of(name):
    if name in SHAPES:
        return SHAPES[name]
    bs = block(name)[0]
    return (2, 3, 2 * bs) if name == "Q8_0" else (3, 2 * bs)


def raw_bytes(name, shape, rng):
    """Stored form of a tensor: the gguf package's quantizer where it has one, otherwise
    random bytes with finite fp16 scales."""
    x = rng.standard_normal(shape).astype(np.float32)
    if name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf_quantize(x, T[name])
    bs, ts = block(name)
    rows = int(np.prod(shape[:-1]))
    nblk = shape[-1] // bs
    raw = rng.integers(0, 256, (rows, nblk, ts), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        raw[:, :, off:off + 2] = rng.uniform(-2, 2, (rows, nblk, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], nblk * ts)


# key -> (GGUFValueType, sub type or None, value as written, value as read back)
def _f32(v):
    return float(np.float32(v))


METADATA = {
    "t.u8": (V.UINT8, None, 200, 200),
    "t.i8": (V.INT8, None, -100, -100),
    "t.u16": (V.UINT16, None, 65000, 65000),
    "t.i16": (V.INT16, None, -32000, -32000),
    "t.u32": (V.UINT32, None, 4_000_000_000, 4_000_000_000),
    "t.i32": (V.INT32, None, -2_000_000_000, -2_000_000_000),
    "t.u64": (V.UINT64, None, 2**64 - 1, 2**64 - 1),
    "t.i64": (V.INT64, None, -(2**63), -(2**63)),
    "t.f32": (V.FLOAT32, None, 0.1, _f32(0.1)),
    "t.f64": (V.FLOAT64, None, 0.1, 0.1),
    "t.bool_true": (V.BOOL, None, True, True),
    "t.bool_false": (V.BOOL, None, False, False),
    "t.str": (V.STRING, None, "héllo wörld ✓", "héllo wörld ✓"),
    "t.a_u8": (V.ARRAY, V.UINT8, [0, 1, 255], [0, 1, 255]),
    "t.a_i8": (V.ARRAY, V.INT8, [-128, 0, 127], [-128, 0, 127]),
    "t.a_u16": (V.ARRAY, V.UINT16, [0, 65535], [0, 65535]),
    "t.a_i16": (V.ARRAY, V.INT16, [-32768, 32767], [-32768, 32767]),
    "t.a_u32": (V.ARRAY, V.UINT32, [0, 2**32 - 1], [0, 2**32 - 1]),
    "t.a_i32": (V.ARRAY, V.INT32, [-(2**31), 2**31 - 1, 7], [-(2**31), 2**31 - 1, 7]),
    "t.a_u64": (V.ARRAY, V.UINT64, [0, 2**64 - 1], [0, 2**64 - 1]),
    "t.a_i64": (V.ARRAY, V.INT64, [-(2**63), 2**63 - 1], [-(2**63), 2**63 - 1]),
    "t.a_f32": (V.ARRAY, V.FLOAT32, [1.5, -0.1, 3e38], [1.5, _f32(-0.1), _f32(3e38)]),
    "t.a_f64": (V.ARRAY, V.FLOAT64, [1e-300, -2.5], [1e-300, -2.5]),
    "t.a_bool": (V.ARRAY, V.BOOL, [True, False, True], [True, False, True]),
    "t.a_str": (V.ARRAY, V.STRING, ["a", "", "ĠĠ ĠĠ", "<|im_end|>"], ["a", "", "ĠĠ ĠĠ", "<|im_end|>"]),
}


def write_synthetic(path, alignment=None, extra_tensors=()):
    """A file with every metadata type and every tensor type. Returns {name: (type, raw)}."""
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vt, sub, val, _) in METADATA.items():
        w.add_key_value(key, val, vt, sub_type=sub)
    tensors = {}
    for name in ALL_TYPES:
        raw = raw_bytes(name, shape_of(name), rng)
        tname = f"t.{name.lower()}"
        if name in ("F32", "F16"):
            w.add_tensor(tname, raw)
        else:
            w.add_tensor(tname, raw, raw_dtype=T[name])
        tensors[tname] = (name, raw)
    for tname, arr, raw_dtype in extra_tensors:
        w.add_tensor(tname, arr, raw_dtype=raw_dtype)
        tensors[tname] = (T(raw_dtype).name if raw_dtype is not None else None, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    return str(path), write_synthetic(path)


def expected_shape(type_name, raw):
    if raw.dtype == np.uint8 and type_name not in (None, "I8"):
        bs, ts = block(type_name)
        return (*raw.shape[:-1], raw.shape[-1] // ts * bs)
    return raw.shape


def parse(b):
    return _core._gguf_parse_bytes(b)


def gguf_error(b):
    with pytest.raises(qc.GGUFError) as exc:
        parse(b)
    return str(exc.value)


# ---------------------------------------------------------------------------------- metadata

def test_metadata_values_and_types(synthetic):
    path, _ = synthetic
    with qc.GGUFFile(path) as f:
        assert f.version == 3 and f.alignment == 32
        assert f.metadata["general.architecture"] == "qwen2"
        assert f.metadata_types["general.architecture"] == "STRING"
        for key, (vt, sub, _, want) in METADATA.items():
            got = f.metadata[key]
            assert got == want and type(got) is type(want), (key, got, want)
            if isinstance(want, list):
                assert all(type(g) is type(w) for g, w in zip(got, want)), key
            type_name = f"ARRAY[{sub.name}]" if vt == V.ARRAY else vt.name
            assert f.metadata_types[key] == type_name
        assert list(f.metadata) == list(f.metadata_types)


def test_metadata_matches_gguf_reader(synthetic):
    """Every key, type and value as the gguf package's own reader sees them."""
    path, _ = synthetic
    reader = gguf.GGUFReader(path)
    with qc.GGUFFile(path) as f:
        keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert keys == list(f.metadata)
        for key in keys:
            field = reader.fields[key]
            types = field.types
            want_type = types[0].name if len(types) == 1 else f"ARRAY[{types[1].name}]"
            assert f.metadata_types[key] == want_type
            ref = field.contents()
            got = f.metadata[key]
            if isinstance(ref, list):
                assert len(got) == len(ref)
                for g, r in zip(got, ref):
                    assert g == r or (isinstance(r, float) and np.float32(r) == np.float32(g)), key
            else:
                assert got == ref or np.float32(got) == np.float32(ref), key


def test_empty_arrays_of_every_type():
    """GGUFWriter refuses empty arrays; the format allows them."""
    kvs = [gb.kv(f"e.{t}", gb.ARRAY, [], sub=t) for t in range(13) if t != gb.ARRAY]
    s = parse(gb.build(kvs))
    assert s["n_kv"] == 12
    assert all(v == [] for v in s["metadata"].values())
    assert s["metadata_types"]["e.8"] == "ARRAY[STRING]"
    assert s["metadata_types"]["e.12"] == "ARRAY[FLOAT64]"


def test_nested_arrays_rejected_clearly():
    msg = gguf_error(gb.build([gb.u64(1) + b"x" + gb.u32(gb.ARRAY) + gb.u32(gb.ARRAY) + gb.u64(0)]))
    assert "at offset 37: key 'x': arrays of arrays are not supported" in msg


def test_invalid_utf8_is_replaced():
    s = parse(gb.build([gb.kv("k", gb.STRING, b"ab\xffc"),
                        gb.kv("l", gb.ARRAY, [b"\xc3", b"ok"], sub=gb.STRING)]))
    assert s["metadata"]["k"] == "ab\ufffdc"
    assert s["metadata"]["l"] == ["\ufffd", "ok"]


def test_summary_matches_file_object(synthetic):
    path, _ = synthetic
    with open(path, "rb") as fh:
        s = parse(fh.read())
    with qc.GGUFFile(path) as f:
        assert s["metadata"] == f.metadata and s["metadata_types"] == f.metadata_types
        assert s["n_tensors"] == len(f.tensors) and s["data_offset"] == f.data_offset
        assert [t[0] for t in s["tensors"]] == list(f.tensors)


# ---------------------------------------------------------------------------------- tensors

def test_tensor_table_matches_gguf_reader(synthetic):
    path, written = synthetic
    reader = gguf.GGUFReader(path)
    with qc.GGUFFile(path) as f:
        assert list(f.tensors) == [t.name for t in reader.tensors] == list(written)
        for rt in reader.tensors:
            info = f.tensors[rt.name]
            assert isinstance(info, qc.gguf.TensorInfo)
            assert info.name == rt.name
            assert info.type == rt.tensor_type.name
            assert info.shape == tuple(int(x) for x in reversed(rt.shape))
            assert info.offset == rt.data_offset and info.offset % f.alignment == 0
            assert info.nbytes == rt.n_bytes
            assert info.offset >= f.data_offset


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_type_reads_back(synthetic, type_name):
    path, written = synthetic
    tname = f"t.{type_name.lower()}"
    _, raw = written[tname]
    with qc.GGUFFile(path) as f:
        info = f.tensors[tname]
        assert info.type == type_name
        assert info.shape == expected_shape(type_name, raw)
        r = f.raw(tname)
        assert not r.flags.writeable
        want_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(type_name, np.uint8)
        assert r.dtype == want_dtype
        # block formats: (rows..., bytes per row); plain types: the tensor's shape
        assert r.shape == (info.shape if type_name in SHAPES else raw.shape)
        assert r.tobytes() == raw.tobytes()
        x = f.tensor(tname)
        ref = gguf_dequantize(raw, T[type_name])
        assert x.dtype == np.float32 and x.shape == info.shape == ref.shape
        assert np.array_equal(x.view(np.uint32), np.ascontiguousarray(ref, np.float32).view(np.uint32))


def test_plain_numeric_tensors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"i8": rng.integers(-128, 128, (3, 4), dtype=np.int8),
              "i16": rng.integers(-3000, 3000, (5,), dtype=np.int16),
              "i32": rng.integers(-10**6, 10**6, (2, 3), dtype=np.int32),
              "i64": rng.integers(-10**6, 10**6, (4, 1), dtype=np.int64),
              "f64": rng.standard_normal((2, 2, 2))}
    w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "x")
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with qc.GGUFFile(tmp_path / "n.gguf") as f:
        for name, a in arrays.items():
            assert f.tensors[name].type == name.upper()
            r = f.raw(name)
            assert r.dtype == a.dtype and r.shape == a.shape and np.array_equal(r, a)
            t = f.tensor(name)
            assert t.dtype == np.float32 and np.array_equal(t, a.astype(np.float32))


def test_unsupported_type_is_readable_but_not_decodable(tmp_path):
    """IQ2_XXS: listed, raw bytes available, tensor() names the type."""
    bs, ts = block("IQ2_XXS")
    raw = np.random.default_rng(0).integers(0, 256, (2, ts), dtype=np.uint8)
    path = tmp_path / "iq.gguf"
    write_synthetic(path, extra_tensors=[("iq", raw, T.IQ2_XXS)])
    with qc.GGUFFile(path) as f:
        assert f.tensors["iq"].type == "IQ2_XXS" and f.tensors["iq"].shape == (2, bs)
        assert f.raw("iq").tobytes() == raw.tobytes()
        with pytest.raises(qc.GGUFError, match="IQ2_XXS"):
            f.tensor("iq")


@pytest.mark.parametrize("alignment", [1, 64])
def test_custom_alignment(tmp_path, alignment):
    """alignment 1 puts tensors at odd addresses: decoding must not depend on alignment."""
    path = tmp_path / "a.gguf"
    written = write_synthetic(path, alignment=alignment)
    with qc.GGUFFile(path) as f:
        assert f.alignment == alignment and f.metadata["general.alignment"] == alignment
        offsets = [t.offset for t in f.tensors.values()]
        if alignment == 1:
            assert any(o % 2 for o in offsets)
        assert all(o % alignment == 0 for o in offsets)
        for tname, (type_name, raw) in written.items():
            ref = gguf_dequantize(raw, T[type_name])
            assert np.array_equal(f.tensor(tname), ref), tname


def test_version_2(synthetic, tmp_path):
    """v2 and v3 share the layout; GGUFWriter writes v3, so patch the version field."""
    path, written = synthetic
    data = bytearray(open(path, "rb").read())
    assert struct.unpack_from("<I", data, 4)[0] == 3
    struct.pack_into("<I", data, 4, 2)
    p2 = tmp_path / "v2.gguf"
    p2.write_bytes(bytes(data))
    with qc.GGUFFile(path) as f3, qc.GGUFFile(p2) as f2:
        assert f2.version == 2
        assert f2.metadata == f3.metadata and f2.tensors == f3.tensors
        for name in written:
            assert np.array_equal(f2.tensor(name), f3.tensor(name))


@pytest.mark.parametrize("version,pattern", [
    (1, "unsupported version 1 "), (0, "unsupported version 0 "), (4, "unsupported version 4 "),
    (0x03000000, "unsupported version 50331648 .*big-endian"),
])
def test_unsupported_versions(synthetic, version, pattern):
    data = bytearray(open(synthetic[0], "rb").read())
    struct.pack_into("<I", data, 4, version)
    with pytest.raises(qc.GGUFError, match=pattern):
        parse(bytes(data))


# ---------------------------------------------------------------------------- object behaviour

def test_views_outlive_close(synthetic):
    path, written = synthetic
    f = qc.GGUFFile(path)
    r = f.raw("t.q4_k")
    info = f.tensors["t.q4_k"]
    f.close()
    assert f.closed
    del f
    import gc
    gc.collect()
    assert r.tobytes() == written["t.q4_k"][1].tobytes()       # the mapping is still there
    assert qc.dequantize(r, "Q4_K", info.shape).shape == info.shape
    with pytest.raises(ValueError):
        r[0, 0] = 1                                              # read-only


def test_closed_file_raises_value_error(synthetic):
    path, _ = synthetic
    with qc.GGUFFile(path) as f:
        assert not f.closed and "291" not in repr(f) and "tensors" in repr(f)
    assert f.closed and "closed" in repr(f)
    for use in (lambda: f.metadata, lambda: f.metadata_types, lambda: f.tensors,
                lambda: f.tensor("t.f32"), lambda: f.raw("t.f32")):
        with pytest.raises(ValueError, match="closed"):
            use()
    f.close()   # twice is fine


def test_c_borrow_for_other_bindings(synthetic):
    """qc_py_gguf_borrow: how a C binding takes the gguf_file of a GGUFFile."""
    f = qc.GGUFFile(synthetic[0])
    assert _core._gguf_borrow_info(f) == (synthetic[0], f._map.n_kv, len(ALL_TYPES))
    assert _core._gguf_borrow_info(f._map)[2] == len(ALL_TYPES)
    with pytest.raises(TypeError, match="GGUFFile"):
        _core._gguf_borrow_info("x.gguf")
    f.close()
    with pytest.raises(ValueError, match="closed"):
        _core._gguf_borrow_info(f)


def test_unknown_tensor_name(synthetic):
    with qc.GGUFFile(synthetic[0]) as f:
        with pytest.raises(KeyError, match="t.q4_k"):
            f.tensor("t.q4_kk")
        assert "t.q4_k" in f and "nope" not in f


def test_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        qc.GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(OSError, match="not a regular file"):
        qc.GGUFFile(tmp_path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(qc.GGUFError, match="empty.gguf: at offset 0: .*size 0"):
        qc.GGUFFile(empty)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(qc.GGUFError, match="not a GGUF file"):
        qc.GGUFFile(bad)
    assert issubclass(qc.GGUFError, ValueError)


def test_pathlike_and_attributes(synthetic):
    import pathlib
    path, _ = synthetic
    with qc.GGUFFile(pathlib.Path(path)) as f:
        assert f.path == path
        assert f.data_offset % f.alignment == 0
        assert f.data_offset <= min(t.offset for t in f.tensors.values())
        assert f.size == os.path.getsize(path)


# ---------------------------------------------------------------------------- malformed files

def test_every_truncation_fails(tmp_path):
    """Every prefix shorter than the end of the last tensor's data is an error; prefixes that
    only cut trailing padding still parse."""
    rng = np.random.default_rng(5)
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_uint32("qwen2.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    w.add_array("xs", [1.5, 2.5])
    w.add_tensor("w", gguf_quantize(rng.standard_normal((2, 32)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("b", rng.standard_normal(3).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = path.read_bytes()
    full = parse(data)
    end = max(off + nbytes for _, _, _, _, off, nbytes in full["tensors"])
    assert end < len(data)
    for n in range(end):
        with pytest.raises(qc.GGUFError, match="runs past end of file|bytes left in the file"):
            parse(data[:n])
    for n in range(end, len(data) + 1):
        assert parse(data[:n])["n_tensors"] == 2


F32, Q4_0 = 0, 2
U64_MAX = 2**64 - 1


def test_huge_key_length():
    msg = gguf_error(gb.build([gb.u64(U64_MAX) + b"k"]))
    assert msg.startswith("at offset 24: ") and "length 18446744073709551615 runs past end of file" in msg


def test_huge_string_value_length():
    msg = gguf_error(gb.build([gb.gstr("k") + gb.u32(gb.STRING) + gb.u64(U64_MAX)]))
    assert "at offset 37: key 'k': string length 18446744073709551615 runs past end of file" in msg


@pytest.mark.parametrize("sub", [gb.UINT8, gb.UINT32, gb.FLOAT64, gb.STRING, gb.BOOL])
@pytest.mark.parametrize("count", [2**62, U64_MAX, 1000])
def test_huge_array_count(sub, count):
    msg = gguf_error(gb.build([gb.kv("arr", gb.ARRAY, [], sub=sub, count=count)]))
    assert "key 'arr'" in msg and f"array of {count}" in msg and "runs past end of file" in msg


def test_bad_string_in_array():
    arr = gb.kv("toks", gb.ARRAY, ["a", "b"], sub=gb.STRING)
    b = gb.build([arr[:-9] + gb.u64(U64_MAX) + b"b"])        # second string's length corrupted
    msg = gguf_error(b)
    assert msg == (f"at offset {24 + len(arr) - 9}: key 'toks': string 1 of 2: length "
                   f"18446744073709551615 runs past end of file (size {len(b)})")


def test_huge_counts():
    assert "tensor count 18446744073709551615" in gguf_error(gb.build(n_tensors=U64_MAX))
    assert "metadata count 18446744073709551615" in gguf_error(gb.build(n_kv=U64_MAX))
    # a count the remaining bytes could hold passes the cap and fails on the bytes
    assert "metadata key length" in gguf_error(gb.header(0, 2) + b"\xff" * 40)


def one_tensor(ne, ggml_type=F32, offset=0, name="w", data=None, alignment=32, kvs=(), n_dims=None):
    if data is None:
        data = bytes(4096)
    return gb.build(list(kvs), [gb.tensor_info(name, ne, ggml_type, offset, n_dims)], data,
                    alignment=alignment)


@pytest.mark.parametrize("ne,pattern", [
    ([2**32, 2**32], "element count .* overflows"),
    ([2**31, 2**31, 4], "element count .* overflows"),
    ([0, 2**62, 2**62], "element count .* overflows"),       # a zero dimension hides nothing
    ([2**63], "dimension 0 is negative"),
    ([4, U64_MAX], "dimension 1 is negative"),
])
def test_bad_dimensions(ne, pattern):
    assert "tensor 'w'" in gguf_error(one_tensor(ne))
    with pytest.raises(qc.GGUFError, match=pattern):
        parse(one_tensor(ne))


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_bad_n_dims(n_dims):
    with pytest.raises(qc.GGUFError, match=f"n_dims {n_dims} is not in 1..4"):
        parse(one_tensor([4], n_dims=n_dims))


def test_data_past_end_of_file():
    b = one_tensor([8, 4], data=bytes(100))
    start = len(b) - 100
    msg = gguf_error(b)
    assert msg == f"tensor 'w': data [{start}, {start + 128}) runs past end of file (size {len(b)})"
    assert "data [" in gguf_error(one_tensor([4], offset=2**40))
    assert "overflows" in gguf_error(one_tensor([4], offset=2**64 - 32))


def test_empty_tensor_at_end_is_fine():
    b = one_tensor([0, 5], data=b"")
    assert parse(b)["tensors"][0][1] == (5, 0)


def test_misaligned_offset():
    msg = gguf_error(one_tensor([4], offset=4))
    assert "tensor 'w'" in msg and "offset 4 is not a multiple of the alignment 32" in msg
    assert parse(one_tensor([4], offset=0, alignment=4, data=bytes(16),
                            kvs=[gb.kv("general.alignment", gb.UINT32, 4)]))["alignment"] == 4
    # aligned but not where the table says the first tensor's data starts (llama.cpp's rule)
    msg = gguf_error(one_tensor([4], offset=4, alignment=4, data=bytes(20),
                                kvs=[gb.kv("general.alignment", gb.UINT32, 4)]))
    assert msg == "tensor 'w': data offset 4, expected 0 (the first tensor's data starts the data section)"


def test_tensor_data_is_back_to_back_in_table_order():
    """llama.cpp's layout rule: an aliasing offset, a gap, a changed size or extra bytes at the
    end is a damaged table, not a file to compute garbage from."""
    Q8_0 = 8
    two = lambda off_b, ne_a=(8,), ta=F32, data=bytes(64), kvs=(), alignment=32: gb.build(
        list(kvs), [gb.tensor_info("a", list(ne_a), ta, 0), gb.tensor_info("b", [8], F32, off_b)],
        data, alignment=alignment)
    assert [t[0] for t in parse(two(32))["tensors"]] == ["a", "b"]
    assert "tensor 'b': data offset 0 overlaps the data of tensor 'a' [0, 32) (expected 32" in gguf_error(two(0))
    assert "tensor 'b': data offset 64 leaves 32 bytes after tensor 'a'" in gguf_error(two(64, data=bytes(96)))
    # a's type changed F32 -> Q8_0 (34 bytes instead of 128): b no longer follows it
    msg = gguf_error(two(128, ne_a=(32,), ta=Q8_0, data=bytes(160)))
    assert "tensor 'b': data offset 128 leaves 64 bytes after tensor 'a'" in msg and "wrong type" in msg
    # a table one tensor short: its data is left over
    short = gb.build([], [gb.tensor_info("a", [8], F32, 0)], bytes(64))
    assert "the data section holds 32 bytes more than the 1 tensors of the table describe" in gguf_error(short)
    # general.alignment lowered without re-padding: the data section would start too early
    kvs = [gb.kv("general.alignment", gb.UINT32, 32)]
    good = two(32, kvs=kvs)
    assert parse(good)["alignment"] == 32
    header_end = len(two(32, kvs=kvs, data=b"", alignment=1))
    assert header_end % 32 != 0    # so alignment 2 moves the data section's start
    at = good.index(b"general.alignment") + len("general.alignment") + 4
    bad = good[:at] + (2).to_bytes(4, "little") + good[at + 4:]
    assert "bytes more than the 2 tensors of the table describe" in gguf_error(bad)
    # the last tensor may lack its padding
    assert len(parse(gb.build([], [gb.tensor_info("a", [4], F32, 0)], bytes(16)))["tensors"]) == 1


@pytest.mark.parametrize("t,pattern", [(99, "unknown tensor type 99"), (2**32 - 1, "unknown tensor type 4294967295"),
                                       (4, "Q4_2 \\(4\\) was removed")])
def test_bad_tensor_type(t, pattern):
    with pytest.raises(qc.GGUFError, match=pattern):
        parse(one_tensor([32], ggml_type=t))


def test_row_not_a_multiple_of_block():
    with pytest.raises(qc.GGUFError, match="row of 33 elements is not a multiple of the Q4_0 block size 32"):
        parse(one_tensor([33, 2], ggml_type=Q4_0))


def test_duplicates():
    b = gb.build([], [gb.tensor_info("a", [4], F32, 0), gb.tensor_info("a", [4], F32, 32)], bytes(64))
    assert "duplicate tensor name 'a'" in gguf_error(b)
    b = gb.build([gb.kv("k", gb.UINT8, 1), gb.kv("k", gb.UINT8, 2)])
    assert "duplicate metadata key 'k' (first at offset 24)" in gguf_error(b)


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**31 + 1])
def test_bad_alignment(alignment):
    msg = gguf_error(gb.build([gb.kv("general.alignment", gb.UINT32, alignment)]))
    assert f"general.alignment {alignment} is not a nonzero power of two" in msg


def test_alignment_of_wrong_type():
    msg = gguf_error(gb.build([gb.kv("general.alignment", gb.UINT64, 32)]))
    assert "general.alignment has type UINT64, expected UINT32" in msg


def test_bad_value_types():
    assert "unknown value type 13" in gguf_error(gb.build([gb.gstr("k") + gb.u32(13) + bytes(8)]))
    assert "unknown array element type 200" in gguf_error(
        gb.build([gb.gstr("k") + gb.u32(gb.ARRAY) + gb.u32(200) + gb.u64(0)]))
    assert "at offset 37: key 'k': bool value 2 is neither 0 nor 1" in gguf_error(
        gb.build([gb.gstr("k") + gb.u32(gb.BOOL) + b"\x02"]))
    assert "at offset 51: key 'k': bool value 255" in gguf_error(
        gb.build([gb.kv("k", gb.ARRAY, [1, 0], sub=gb.BOOL) + b"\xff"]).replace(b"\x02\0\0\0\0\0\0\0\x01\x00", b"\x03\0\0\0\0\0\0\0\x01\x00"))


def test_bad_magic_and_names():
    assert "not a GGUF file (magic 'GGUG'" in gguf_error(gb.build(magic=b"GGUG"))
    assert "contains a NUL byte" in gguf_error(one_tensor([4], name="a\0b"))
    # hostile names are quoted with escapes and cut short in messages
    msg = gguf_error(one_tensor([4], ggml_type=99, name="\x1b[31m" + "x" * 500))
    assert "\\x1b[31m" in msg and "..." in msg and len(msg) < 300


def test_gguf_open_buffer_accepts_bytearray_and_memoryview(synthetic):
    data = open(synthetic[0], "rb").read()
    assert parse(bytearray(data))["n_tensors"] == len(ALL_TYPES)
    assert parse(memoryview(data))["n_tensors"] == len(ALL_TYPES)


# ---------------------------------------------------------------------------- the real model

@pytest.mark.realmodel
def test_real_model(real_model_path, real_gguf_reader):
    from collections import Counter

    with qc.GGUFFile(real_model_path) as f:
        assert len(f.tensors) == 291
        assert Counter(t.type for t in f.tensors.values()) == {
            "Q5_0": 133, "F32": 121, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}
        assert f.tensors["output.weight"].type == "Q8_0"
        emb = f.tensors["token_embd.weight"]
        assert emb.type == "Q5_0" and emb.shape == (151936, 896)
        md = f.metadata
        assert md["general.architecture"] == "qwen2"
        assert md["qwen2.block_count"] == 24 and f.metadata_types["qwen2.block_count"] == "UINT32"
        assert md["qwen2.embedding_length"] == 896
        assert md["qwen2.attention.head_count"] == 14 and md["qwen2.attention.head_count_kv"] == 2
        assert md["qwen2.feed_forward_length"] == 4864
        assert md["qwen2.rope.freq_base"] == 1e6
        assert len(md["tokenizer.ggml.tokens"]) == 151936
        assert f.metadata_types["tokenizer.ggml.merges"] == "ARRAY[STRING]"
        assert md["tokenizer.ggml.tokens"][151645] == "<|im_end|>"
        assert md["tokenizer.ggml.eos_token_id"] == 151645

        # the gguf package agrees on the table and on decoded values
        reader = real_gguf_reader         # gguf.GGUFReader, parsed once per session (conftest.py)
        for rt in reader.tensors:
            info = f.tensors[rt.name]
            assert (info.offset, info.nbytes, info.type) == (rt.data_offset, rt.n_bytes, rt.tensor_type.name)
        for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.3.attn_k.weight",
                     "blk.0.attn_v.weight", "blk.0.attn_q.bias", "blk.5.ffn_gate.weight"):
            rt = next(t for t in reader.tensors if t.name == name)
            ref = gguf_dequantize(np.asarray(rt.data), rt.tensor_type).reshape(f.tensors[name].shape)
            assert np.array_equal(f.tensor(name), ref), name
        q4k = [n for n, t in f.tensors.items() if t.type == "Q4_K"][0]
        rt = next(t for t in reader.tensors if t.name == q4k)
        assert np.array_equal(f.tensor(q4k), gguf_dequantize(np.asarray(rt.data), rt.tensor_type).reshape(f.tensors[q4k].shape))
        raw = f.raw("token_embd.weight")
        assert raw.shape == (151936, 896 // 32 * 22) and raw.dtype == np.uint8


# ---------------------------------------------------------------------------- Qwen2.5-0.5B layout

def test_qwen25_05b_layout(tmp_path):
    """The exact tensor table and metadata of Qwen2.5-0.5B-Instruct at real scale, as
    qwencuda.testing writes it (in the mixed Q4_K_M types, like the real file)."""
    try:
        import qwencuda.testing as qt
    except ImportError:
        pytest.skip("qwencuda.testing is not available yet")
    path = str(tmp_path / "q05.gguf")
    qt.write_model(path, config="qwen2.5-0.5b", weight_type="q4_k_m")
    plan = qt.plan_model("qwen2.5-0.5b", "q4_k_m")
    from collections import Counter

    from qwencuda.debug.inspect import describe

    with qc.GGUFFile(path) as f:
        md = f.metadata
        assert md["general.architecture"] == "qwen2"
        assert md["qwen2.block_count"] == 24 and md["qwen2.embedding_length"] == 896
        assert md["qwen2.feed_forward_length"] == 4864
        assert md["qwen2.attention.head_count"] == 14 and md["qwen2.attention.head_count_kv"] == 2
        assert len(md["tokenizer.ggml.tokens"]) == 151936
        assert f.tensors["token_embd.weight"].shape == (151936, 896)
        for layer in range(24):
            for name, shape in (("attn_q.weight", (896, 896)), ("attn_k.weight", (128, 896)),
                                ("attn_v.weight", (128, 896)), ("attn_output.weight", (896, 896)),
                                ("attn_q.bias", (896,)), ("attn_k.bias", (128,)),
                                ("ffn_gate.weight", (4864, 896)), ("ffn_up.weight", (4864, 896)),
                                ("ffn_down.weight", (896, 4864)), ("ffn_norm.weight", (896,)),
                                ("attn_norm.weight", (896,))):
                assert f.tensors[f"blk.{layer}.{name}"].shape == shape
        # the table is the writer's plan, and the offsets follow GGUFWriter's layout: tensors
        # back to back, each padded to the alignment
        assert [(t.name, t.shape, t.type) for t in f.tensors.values()] == [
            (n, tuple(s), t) for n, s, t in plan]
        offset = f.data_offset
        for t in f.tensors.values():
            bs, ts = block(t.type)
            assert t.nbytes == int(np.prod(t.shape)) // bs * ts
            assert t.offset == offset, t.name
            offset += -(-t.nbytes // f.alignment) * f.alignment
        assert offset == f.size
        types = Counter(t.type for t in f.tensors.values())
        x = f.tensor("blk.0.ffn_down.weight")
        assert x.shape == (896, 4864) and np.isfinite(x).all()
    text = describe(path)
    assert f"totals: {len(plan)} tensors, " in text
    for type_name, n in types.items():
        assert re.search(rf"^  {type_name}\s+{n} tensors", text, re.M), type_name
