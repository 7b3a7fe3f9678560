"""GGUF files: metadata, the tensor table, and tensors as NumPy arrays.

    import qwencuda as qc
    with qc.GGUFFile("model.gguf") as f:
        f.metadata["qwen2.block_count"]            # 24
        f.metadata_types["tokenizer.ggml.tokens"]  # "ARRAY[STRING]"
        f.tensors["token_embd.weight"]             # TensorInfo(name, shape, type, offset, nbytes)
        f.tensor("blk.0.attn_q.weight")            # float32, dequantized, NumPy shape
        f.raw("blk.0.attn_q.weight")               # read-only view of the stored bytes

The file is validated when it is opened (every count, length, offset and size is checked
against the file; a problem raises GGUFError naming it and its byte offset) and memory-mapped:
tensor data is never read until asked for, and raw() never copies.

Shapes are in NumPy order: GGUF lists ne[0] (the fastest-varying dimension) first, NumPy last,
so a weight with GGUF ne = [in, out] has shape (out, in) here.

Strings from the file are decoded as UTF-8 with errors="replace": an invalid byte becomes
U+FFFD rather than making the file unreadable, and every value can be printed.
"""
import difflib
import errno
import os
from collections import namedtuple

import numpy as np

from . import _core
from ._core import GGUFError, dequantize  # noqa: F401  (qc.dequantize lives here)

__all__ = ["GGUFFile", "TensorInfo", "GGUFError", "dequantize"]

TensorInfo = namedtuple("TensorInfo", "name shape type offset nbytes")
TensorInfo.__doc__ = """One entry of the tensor table.

name: str; shape: tuple in NumPy order (GGUF ne reversed); type: "Q4_K", "F32", ...;
offset: absolute byte offset of the data in the file; nbytes: stored size in bytes."""

# Plain numeric types that tensor() converts to float32 with NumPy (no block format involved).
_PLAIN_NUMERIC = frozenset({"I8", "I16", "I32", "I64", "F64"})


class GGUFFile:
    """An open GGUF v2/v3 file. Use as a context manager or call close().

    Attributes: path, version, alignment, data_offset, metadata, metadata_types, tensors,
    closed. Methods: tensor(name), raw(name), close().
    """

    def __init__(self, path):
        path = os.fspath(path)
        self.path = os.fsdecode(path)
        try:
            self._map = _core._GGUFMap(path)
        except OSError as exc:
            if not os.path.exists(path):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.path) from None
            raise exc
        m = self._map
        self.version = m.version
        self.alignment = m.alignment
        self.data_offset = m.data_offset
        self.size = m.size
        self._metadata = None
        self._metadata_types = None
        self._tensors = {}
        self._index = {}
        self._types = {}
        for i, (name, shape, type_name, type_value, offset, nbytes) in enumerate(m.tensor_list()):
            self._tensors[name] = TensorInfo(name, shape, type_name, offset, nbytes)
            self._index[name] = i
            self._types[name] = type_value

    # -- state -----------------------------------------------------------------------------

    @property
    def closed(self):
        return self._map is None

    def close(self):
        """Drop this object's hold on the mapping. Arrays from raw() keep theirs: they stay
        valid, and the file is unmapped when the last of them is gone."""
        self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _open_map(self):
        if self._map is None:
            raise ValueError(f"GGUFFile {self.path!r} is closed")
        return self._map

    def __repr__(self):
        if self._map is None:
            return f"<GGUFFile {self.path!r} closed>"
        return (f"<GGUFFile {self.path!r} v{self.version}, {self._map.n_kv} metadata keys, "
                f"{len(self._tensors)} tensors>")

    # -- metadata --------------------------------------------------------------------------

    def _load_metadata(self):
        items = self._open_map().kv_list()
        self._metadata = {key: value for key, _, value, _ in items}
        self._metadata_types = {key: type_name for key, type_name, _, _ in items}

    @property
    def metadata(self):
        """dict key -> int | float | bool | str | list (arrays), in file order."""
        self._open_map()
        if self._metadata is None:
            self._load_metadata()
        return self._metadata

    @property
    def metadata_types(self):
        """dict key -> GGUF value type: "UINT32", "STRING", "ARRAY[INT32]", ..."""
        self._open_map()
        if self._metadata_types is None:
            self._load_metadata()
        return self._metadata_types

    # -- tensors ---------------------------------------------------------------------------

    @property
    def tensors(self):
        """dict name -> TensorInfo(name, shape, type, offset, nbytes), in file order."""
        self._open_map()
        return self._tensors

    def _lookup(self, name):
        m = self._open_map()
        try:
            return m, self._index[name]
        except (KeyError, TypeError):
            pass
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be a str, not {type(name).__name__}")
        close = difflib.get_close_matches(name, list(self._index), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise KeyError(f"no tensor named {name!r} in {self.path} ({len(self._index)} tensors{hint})")

    def raw(self, name):
        """Read-only, zero-copy view of the stored bytes of tensor `name`.

        F32 -> float32, F16 -> float16, BF16 -> uint16 (the bfloat16 bits), I8..I64 and F64 ->
        their dtypes, all with the tensor's shape; block formats -> uint8 of shape
        (rows..., bytes_per_row). The view stays valid after close().
        """
        m, i = self._lookup(name)
        return m.raw(i)

    def tensor(self, name):
        """Tensor `name` as a new float32 array of its NumPy shape (block formats decoded
        bit-exactly like gguf.quants.dequantize). Types qwencuda cannot decode raise GGUFError."""
        m, i = self._lookup(name)
        if self._tensors[name].type in _PLAIN_NUMERIC:
            return m.raw(i).astype(np.float32)
        return m.dequantize(i)

    def __contains__(self, name):
        return name in self._index
