"""Trace: what one forward pass produced, as NumPy arrays, and the capture names in forward order.

Every engine (the C CPU backend, the CUDA backend, the NumPy reference) returns a Trace, so that
two runs can be compared name by name:

    tr = model.forward(ids, capture="blk.*.attn_probs")
    tr.logits            # (rows, n_vocab) float32
    tr["blk.0.attn_probs"]
    tr.save("run.npz"); Trace.load("run.npz")
"""
import os

import numpy as np

from . import _core

# A captured tensor kept in GPU memory (capture_device="cuda"): shape, dtype, nbytes, device,
# __dlpack__ / __cuda_array_interface__ for torch and CuPy, numpy() for a host copy
# (csrc/python/py_devarray.c).
DeviceArray = _core.DeviceArray

# Keys of the .npz that hold the Trace's own fields (capture names never start with "__").
_META = ("ids", "positions", "logits", "argmax", "logit_positions", "source", "kv_type")


def capture_names(n_layer) -> list:
    """Every capture name of a model with n_layer layers, in forward order: the engine's own
    list (csrc/engine/session.c), read through _core."""
    n_layer = int(n_layer)
    if n_layer < 0:
        raise ValueError(f"n_layer must be >= 0, got {n_layer}")
    return _core.capture_names(n_layer)


# Per layer, in the order the forward pass produces them (DESIGN.md, docs/api.md).
LAYER_NAMES = tuple(name.split(".", 2)[2] for name in capture_names(1)[1:-3])


def _as_int32(a, what):
    if a is None:
        return None
    a = np.asarray(a)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"Trace {what} must be integers, got {a.dtype}")
    return a.astype(np.int32, copy=False).reshape(-1)


class Trace:
    """The tensors, logits and argmax choices of one forward pass.

    Fields:
      tensors          dict name -> ndarray, in forward order (only what was captured); with
                       capture_device="cuda", name -> DeviceArray (GPU memory)
      logits           (rows, n_vocab) float32, or None when the pass made none
      argmax           (rows,) int32 (the first maximum of each logits row), or None
      ids              (n,) int32, the tokens of the pass
      positions        (n,) int32, their positions in the context
      logit_positions  (rows,) int32, the positions the logits rows belong to
      source           "cpu", "cuda", "reference", ...
      token            the next token drawn by a sampler on the device (Session.prefill/step
                       with sampler=), else None
      kv_type          the KV cache's element type of the session that ran it ("f16", "f32"),
                       or None (the reference, loaded dumps)

    Dict-like: tr[name], name in tr, tr.keys(), tr.items(), len(tr), iter(tr) over the
    captured tensors.
    """

    __slots__ = ("tensors", "logits", "argmax", "ids", "positions", "logit_positions", "source",
                 "token", "kv_type")

    def __init__(self, tensors=None, logits=None, argmax=None, ids=None, positions=None,
                 logit_positions=None, source="unknown", token=None, kv_type=None):
        self.tensors = dict(tensors or {})
        self.logits = None if logits is None else np.asarray(logits, dtype=np.float32)
        if self.logits is not None and self.logits.ndim == 1:
            self.logits = self.logits[None, :]
        if argmax is None and self.logits is not None:
            argmax = np.argmax(self.logits, axis=-1)
        self.argmax = _as_int32(argmax, "argmax")
        self.ids = _as_int32(ids, "ids")
        if positions is None and self.ids is not None:
            positions = np.arange(len(self.ids))
        self.positions = _as_int32(positions, "positions")
        if logit_positions is None and self.logits is not None and self.positions is not None:
            rows = self.logits.shape[0]
            logit_positions = self.positions[len(self.positions) - rows:]
        self.logit_positions = _as_int32(logit_positions, "logit_positions")
        self.source = str(source)
        self.token = None if token is None else int(token)
        self.kv_type = None if kv_type is None else str(kv_type)

    # ---- dict-like access to the captured tensors ----
    def __getitem__(self, name):
        try:
            return self.tensors[name]
        except KeyError:
            have = ", ".join(list(self.tensors)[:8]) or "nothing was captured"
            raise KeyError(f"{name!r} was not captured in this trace (have: {have}"
                           f"{', ...' if len(self.tensors) > 8 else ''})") from None

    def __contains__(self, name):
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def values(self):
        return self.tensors.values()

    def get(self, name, default=None):
        return self.tensors.get(name, default)

    # ---- persistence ----
    def save(self, path):
        """Write the trace to an .npz file (tensors under their names; the fields under
        __ids__, __positions__, __logits__, __argmax__, __logit_positions__, __source__).
        DeviceArrays are copied to the host to be written."""
        arrays = {}
        for name, value in self.tensors.items():
            if name.startswith("__"):
                raise ValueError(f"tensor name {name!r} is reserved")
            arrays[name] = np.asarray(value)
        for key in _META:
            value = getattr(self, key)
            if value is not None:
                arrays[f"__{key}__"] = np.asarray(value)
        path = os.fspath(path)
        np.savez(path, **arrays)
        return path if path.endswith(".npz") else path + ".npz"

    @classmethod
    def load(cls, path):
        """Read a trace written by save()."""
        fields, tensors = {}, {}
        with np.load(os.fspath(path), allow_pickle=False) as z:
            for key in z.files:
                if key.startswith("__") and key.endswith("__") and key[2:-2] in _META:
                    fields[key[2:-2]] = z[key]
                else:
                    tensors[key] = z[key]
        for key in ("source", "kv_type"):
            if key in fields:
                fields[key] = str(fields[key])
        return cls(tensors=tensors, **fields)

    def __repr__(self):
        lines = [f"Trace(source={self.source!r}, tokens={0 if self.ids is None else len(self.ids)}"
                 + ("" if self.logits is None else f", logits={tuple(self.logits.shape)}")
                 + ("" if self.kv_type is None else f", kv_type={self.kv_type!r}") + ")"]
        if self.ids is not None and len(self.ids):
            shown = " ".join(str(int(i)) for i in self.ids[:16])
            lines.append(f"  ids: {shown}{' ...' if len(self.ids) > 16 else ''}"
                         f"  positions {int(self.positions[0])}..{int(self.positions[-1])}")
        if self.argmax is not None and len(self.argmax):
            shown = " ".join(str(int(i)) for i in self.argmax[-8:])
            lines.append(f"  argmax (last {min(8, len(self.argmax))}): {shown}")
        width = max((len(n) for n in self.tensors), default=0)
        for name, value in self.tensors.items():
            where = ""
            if isinstance(value, DeviceArray):   # described, not copied to the host
                where = f"  on {value.device}"
            else:
                value = np.asarray(value)
            lines.append(f"  {name:<{width}}  {str(value.dtype):<7} {tuple(value.shape)}{where}")
        return "\n".join(lines)
