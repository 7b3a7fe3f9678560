"""patching: change a tensor in the middle of a forward pass, and let the rest of it run on.

    m.forward(ids, patch={"blk.5.attn_out": my_engines_attn_out})        # replace
    m.forward(ids, patch={"blk.*.resid_mid": qc.Add(steering_vector)})    # steer every layer
    m.forward(ids, patch={"blk.3.attn_out": qc.ZeroHeads([0, 5])})        # ablate heads
    m.forward(ids, patch={"blk.0.q_rope": lambda v: v[:, ::-1]})          # any function

A patch names tensors by capture name (globs allowed, as for capture=) and says what to do with
each: an array (replace it), an edit of this module (Replace, Add, Scale, ZeroHeads), a function
that takes the tensor as a NumPy array and returns its new value (or None to keep it), or a list
of these applied in order. The engine calls the edits right where it computed the tensor, and
everything after reads the new value: a capture of the same name shows the patched value, a
capture of a later one shows its effect. The same patch gives the same result in the NumPy
reference engine (qwencuda.reference), which is how the tests check the engine's.

Every tensor of a capture name can be patched but argmax (it is the output: patch the logits).
Shapes are the capture's for this call: (n, dim) for the residual stream, (n, heads, head_dim)
for q / k / v, (n_head, n, n_kv) for attn_scores / attn_probs, (rows, n_vocab) for logits.
Special cases, the same in both engines:
  - attn_scores: the probabilities are the softmax of the patched scores;
  - attn_scores / attn_probs: the attention output is recomputed from the (patched)
    probabilities and the cache's values on the host, in fp32;
  - k_rope and v: the cache holds the patched values, so later tokens see them too.

Cost: none when no patch is given. A patched call copies each patched tensor to the host and
back, runs the unfused ops for tensors the fused ones never write, computes the whole call in one
forward pass (no prefill chunks), and a patched decode step runs op by op instead of replaying
its recorded CUDA graph.
"""
from __future__ import annotations

import fnmatch

import numpy as np

__all__ = ["Edit", "Replace", "Add", "Scale", "ZeroHeads", "as_hook", "UNPATCHABLE"]

UNPATCHABLE = ("argmax",)

# Where the head and token axes of a patchable tensor lie, by its name's last part: (token axis,
# head axis or None). attn_out's heads are its columns in blocks of head_dim.
_HEAD_AXIS = {"q": 1, "k": 1, "v": 1, "q_rope": 1, "k_rope": 1, "attn_out": 1,
              "attn_scores": 0, "attn_probs": 0}
_TOKEN_AXIS = {"attn_scores": 1, "attn_probs": 1}


def _kind(name):
    return name.rsplit(".", 1)[-1]


class Edit:
    """An edit of chosen rows (tokens of this call) and heads of a tensor; None = all of them."""

    def __init__(self, rows=None, heads=None):
        self.rows = None if rows is None else np.atleast_1d(np.asarray(rows, dtype=np.int64))
        self.heads = None if heads is None else np.atleast_1d(np.asarray(heads, dtype=np.int64))

    def _region(self, name, value, n_head):
        """The view of value (a fresh float32 array) that the edit changes, and how to write it
        back: (view, put) with put(new) storing new into value."""
        kind = _kind(name)
        v = value
        if self.heads is not None:
            if kind not in _HEAD_AXIS:
                raise ValueError(f"patch of {name}: heads= applies to q, k, v, q_rope, k_rope, attn_out, "
                                 f"attn_scores and attn_probs only")
            if kind == "attn_out":
                v = v.reshape(v.shape[0], n_head, -1)
            axis = _HEAD_AXIS[kind]
            if self.heads.min(initial=0) < -v.shape[axis] or self.heads.max(initial=0) >= v.shape[axis]:
                raise ValueError(f"patch of {name}: heads {self.heads.tolist()} out of range for "
                                 f"{v.shape[axis]} heads")
        t_axis = _TOKEN_AXIS.get(kind, 0)
        if self.rows is not None and (self.rows.min(initial=0) < -v.shape[t_axis] or
                                      self.rows.max(initial=0) >= v.shape[t_axis]):
            raise ValueError(f"patch of {name}: rows {self.rows.tolist()} out of range for "
                             f"{v.shape[t_axis]} rows")
        # rows and heads lie on axes 0 and 1 (in either order): both chosen -> an outer product
        index = [slice(None)] * v.ndim
        if self.rows is not None:
            index[t_axis] = self.rows
        if self.heads is not None:
            index[_HEAD_AXIS[kind]] = self.heads
        if self.rows is not None and self.heads is not None:
            index[0], index[1] = index[0][:, None], index[1][None, :]
        index = tuple(index)

        def put(new):
            v[index] = new

        return v[index], put

    def apply(self, name, value, n_head):
        view, put = self._region(name, value, n_head)
        put(np.broadcast_to(np.asarray(self._new(view), dtype=np.float32), view.shape))
        return value

    def _new(self, view):
        raise NotImplementedError


class Replace(Edit):
    """The chosen part becomes `value` (broadcast to its shape)."""

    def __init__(self, value, rows=None, heads=None):
        super().__init__(rows, heads)
        self.value = np.asarray(value, dtype=np.float32)

    def _new(self, view):
        return self.value

    def __repr__(self):
        return f"Replace(shape {self.value.shape})"


class Add(Edit):
    """`value` (broadcast) is added to the chosen part: a steering vector of shape (dim,) on the
    residual stream adds to every token."""

    def __init__(self, value, rows=None, heads=None):
        super().__init__(rows, heads)
        self.value = np.asarray(value, dtype=np.float32)

    def _new(self, view):
        return view + self.value

    def __repr__(self):
        return f"Add(shape {self.value.shape})"


class Scale(Edit):
    """The chosen part is multiplied by `factor`."""

    def __init__(self, factor, rows=None, heads=None):
        super().__init__(rows, heads)
        self.factor = np.float32(factor)

    def _new(self, view):
        return view * self.factor

    def __repr__(self):
        return f"Scale({float(self.factor)})"


class ZeroHeads(Edit):
    """The chosen heads (and rows) become 0: head ablation on q, k, v, attn_out, attn_probs..."""

    def __init__(self, heads, rows=None):
        super().__init__(rows, heads)

    def _new(self, view):
        return np.zeros_like(view)

    def __repr__(self):
        return f"ZeroHeads({self.heads.tolist()})"


def _one(edit, name, value, n_head):
    if isinstance(edit, Edit):
        return edit.apply(name, value, n_head)
    if callable(edit):
        new = edit(value)
        if new is None:
            return value
    else:
        new = edit
    new = np.asarray(new, dtype=np.float32)
    if new.shape != value.shape:
        try:
            new = np.broadcast_to(new, value.shape)
        except ValueError:
            raise ValueError(f"patch of {name}: a value of shape {new.shape} for a tensor of shape "
                             f"{value.shape}") from None
    return np.ascontiguousarray(new, dtype=np.float32)


def as_hook(patch, names, n_head):
    """patch (None, or {pattern: edit or list of edits}) -> (patched names, hook), where names
    are the call's capture names in forward order and hook(name, value) -> the new value (a
    float32 C-contiguous array of value's shape) runs every edit of that name in order. (None,
    None) for no patch. Raises ValueError for a pattern that names no patchable tensor, for
    argmax, and for edits that are none of the kinds above."""
    if patch is None:
        return None, None
    if not isinstance(patch, dict):
        raise TypeError(f"patch must be a dict {{capture name or glob: edit}}, got {type(patch).__name__}")
    edits = {}                                   # name -> [edit, ...] in the dict's order
    for pattern, edit in patch.items():
        if not isinstance(pattern, str):
            raise TypeError(f"patch keys are capture names or globs, got {pattern!r}")
        todo = edit if isinstance(edit, (list, tuple)) else [edit]
        for e in todo:
            if not (isinstance(e, Edit) or callable(e) or isinstance(e, (np.ndarray, float, int))):
                raise TypeError(f"patch of {pattern!r}: an edit is an array, a qwencuda edit "
                                f"(Replace, Add, Scale, ZeroHeads) or a function, got {type(e).__name__}")
        hit = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if any(_kind(n) in UNPATCHABLE for n in hit) and all(_kind(n) in UNPATCHABLE for n in hit):
            raise ValueError(f"patch of {pattern!r}: argmax is computed from the logits; patch 'logits'")
        hit = [n for n in hit if _kind(n) not in UNPATCHABLE]
        if not hit:
            raise ValueError(f"patch names {pattern!r}, which matches no tensor of this model "
                             f"(names as in capture=: e.g. 'embed', 'blk.0.q_rope', 'logits')")
        for n in hit:
            edits.setdefault(n, []).extend(todo)
    order = [n for n in names if n in edits]

    def hook(name, value):
        value = np.array(value, dtype=np.float32, copy=True)
        for e in edits[name]:
            value = _one(e, name, value, n_head)
        return np.ascontiguousarray(value, dtype=np.float32)

    return order, hook
