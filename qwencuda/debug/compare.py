"""compare: line two sets of tensors up by name and find the first one that diverges.

    rep = qwencuda.compare(my_dumps, qwencuda.reference.forward(ref, ids))
    print(rep)                      # a table, forward order, first divergence on top
    rep.first_divergence            # "blk.0.q_rope" or None
    rep["blk.0.q_rope"].rel         # per-tensor numbers, plain data (rep.rows, rep.to_dict())

The seeds' engineers compared a few printed values by eye, one tensor at a time, and guessed
for days. A correct engine that exposes every tensor turns that into one question with one
answer: which is the FIRST tensor, in forward order, where the two runs disagree? Everything
before it is right, so the bug sits between it and its inputs.

`a` is the run under test, `b` the trusted one: the tolerance is numpy's allclose rule
|a - b| <= atol + rtol * |b|, element by element, and the relative error is ||a-b|| / ||b||.
Each side may be a Trace, a dict of arrays, a list of (name, array) pairs, an .npz file (a saved
Trace or any npz) or a folder of .npy files, named as qwencuda names its captures or translated
through a name map ("hf", "llama.cpp", a dict: qwencuda.namemaps). A problem with one tensor
(missing on one side, a shape that cannot be matched, ints against floats, NaN) becomes that
tensor's row; only an unreadable input or an unknown name map raises.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from . import namemaps
from ..trace import LAYER_NAMES

__all__ = ["compare", "CompareReport", "Row", "CompareError", "assert_matches", "load_tensors",
           "main", "forward_order"]

# Row statuses. "ok" passes; the next four are divergences; "missing" is neither (a dump
# rarely holds every tensor).
OK, DIVERGED, SHAPE, DTYPE, ERROR = "ok", "diverged", "shape", "dtype", "error"
MISSING_A, MISSING_B = "missing in a", "missing in b"
_BAD = (DIVERGED, SHAPE, DTYPE, ERROR)

# An attention score at or below this, where the other side has -inf, is a finite mask value
# (engines use -1e9, -FLT_MAX, -65504): treated as masked, and counted in the note.
_MASK_FLOOR = -1e4


class CompareError(ValueError):
    """An input that cannot be read at all (a missing or unreadable file, a wrong type)."""


@dataclass
class Row:
    """One tensor of the comparison. Numbers are None where they do not apply."""
    name: str
    status: str
    shape_a: tuple | None = None
    shape_b: tuple | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs: float | None = None      # max |a - b| over elements finite on both sides
    rel: float | None = None          # ||a - b|| / ||b||
    cosine: float | None = None       # a.b / (|a| |b|)
    n_fail: int | None = None         # elements out of tolerance (non-finite mismatches included)
    frac_fail: float | None = None
    size: int = 0
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    note: str = ""
    worst: list = field(default_factory=list)   # [(index, a, b)] of the largest errors

    @property
    def passed(self):
        return self.status == OK

    @property
    def diverged(self):
        return self.status in _BAD


def forward_order(names):
    """Sort names: qwencuda captures in forward order (derived ones beside their source), then
    everything else in the order given."""
    per_layer = {}
    for i, sub in enumerate(LAYER_NAMES):
        per_layer[sub] = float(i)
    for sub, (src, _) in namemaps.DERIVED.items():
        per_layer[sub] = per_layer[src] + 0.5
    tail = {"output_norm": 0, "logits": 1, "argmax": 2}
    keyed = []
    for i, name in enumerate(names):
        m = re.match(r"^blk\.(\d+)\.([a-z_]+)$", name)
        if name == "embed":
            key = (0, 0, 0.0, i)
        elif m and m.group(2) in per_layer:
            key = (1, int(m.group(1)), per_layer[m.group(2)], i)
        elif name in tail:
            key = (2, tail[name], 0.0, i)
        else:
            key = (3, 0, 0.0, i)
        keyed.append((key, name))
    return [n for _, n in sorted(keyed)]


# --------------------------------------------------------------------------------------------
# Reading the inputs

def _is_trace(x):
    return hasattr(x, "tensors") and hasattr(x, "logits") and not isinstance(x, Mapping)


def load_tensors(source):
    """Anything compare accepts -> (list of (name, array-like) pairs, info dict with "label" and,
    for Traces and saved Traces, "positions")."""
    info = {"label": None, "positions": None}
    if _is_trace(source):
        pairs = list(source.tensors.items())
        have = {n for n, _ in pairs}
        if "logits" not in have and getattr(source, "logits", None) is not None:
            pairs.append(("logits", source.logits))
        if "argmax" not in have and getattr(source, "argmax", None) is not None:
            pairs.append(("argmax", source.argmax))
        info["label"] = f"Trace({getattr(source, 'source', '?')})"
        info["positions"] = getattr(source, "positions", None)
        return pairs, info
    if isinstance(source, Mapping):
        info["label"] = "dict"
        return [(str(k), v) for k, v in source.items()], info
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        info["label"] = path
        return _read_path(path, info), info
    if isinstance(source, (list, tuple)):
        pairs = []
        for item in source:
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
                raise CompareError("a list input must hold (name, array) pairs")
            pairs.append((item[0], item[1]))
        info["label"] = "list"
        return pairs, info
    raise CompareError(f"cannot compare a {type(source).__name__}: give a Trace, a dict of arrays, "
                       "a list of (name, array) pairs, an .npz file or a folder of .npy files")


def _natural(name):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read_path(path, info):
    if not os.path.exists(path):
        raise CompareError(f"{path}: no such file or folder")
    try:
        if os.path.isdir(path):
            files = sorted((f for f in os.listdir(path) if f.endswith(".npy")), key=_natural)
            if not files:
                raise CompareError(f"{path}: a folder without .npy files")
            return [(f[:-4], np.load(os.path.join(path, f), allow_pickle=False)) for f in files]
        with open(path, "rb") as fh:
            magic = fh.read(6)
        if magic == b"\x93NUMPY":
            return [(os.path.splitext(os.path.basename(path))[0], np.load(path, allow_pickle=False))]
        pairs, meta = [], {}
        with np.load(path, allow_pickle=False) as z:
            for key in z.files:
                if key.startswith("__") and key.endswith("__"):
                    meta[key[2:-2]] = z[key]
                else:
                    pairs.append((key, z[key]))
    except CompareError:
        raise
    except Exception as exc:
        raise CompareError(f"{path}: cannot read tensors ({type(exc).__name__}: {exc})") from None
    have = {n for n, _ in pairs}
    for key in ("logits", "argmax"):          # fields of a saved Trace
        if key in meta and key not in have:
            pairs.append((key, meta[key]))
    info["positions"] = meta.get("positions")
    if "source" in meta:
        info["label"] = f"{path} ({meta['source']})"
    return pairs


# --------------------------------------------------------------------------------------------
# One tensor

def _shape(x):
    return tuple(int(s) for s in x.shape)


def _kind(a):
    k = a.dtype.kind
    return "int" if k in "iub" else "float" if k in "fc" else "other"


def _is_masked_pad(x, name):
    """True when x (a slice of attention columns) holds only masked cells."""
    if name.endswith("attn_probs"):
        return bool(np.all(x == 0))
    return bool(np.all(~np.isfinite(x) | (x <= _MASK_FLOOR)))


def _align(name, a, b):
    """Bring a and b to one shape, or raise ValueError saying why not. -> (a, b, note)."""
    if a.shape == b.shape:
        return a, b, ""
    sa, sb = _shape(a), _shape(b)
    # a leading batch axis of 1 on one side (HF dumps)
    a2, b2 = a, b
    while a2.ndim > b2.ndim and a2.shape[0] == 1:
        a2 = a2[0]
    while b2.ndim > a2.ndim and b2.shape[0] == 1:
        b2 = b2[0]
    if a2.shape == b2.shape:
        return a2, b2, f"leading axis of 1 dropped ({sa} vs {sb})"
    # one side is the transpose of the other (ggml ne order read as a NumPy shape, or a
    # transposed GEMM): compare after transposing and say so
    if a.ndim >= 2 and a.shape == b.shape[::-1]:
        return a.T, b, f"a {sa} is the transpose of b {sb}: compared a.T (ggml ne order? transposed GEMM?)"
    # attention maps whose key axis is padded (llama.cpp pads KV cells) on one side
    if name.endswith(("attn_scores", "attn_probs")) and a.ndim == b.ndim == 3 and a.shape[:2] == b.shape[:2]:
        n = min(a.shape[2], b.shape[2])
        longer, side = (a, "a") if a.shape[2] > b.shape[2] else (b, "b")
        if _is_masked_pad(longer[..., n:], name):
            a, b = a[..., :n], b[..., :n]
            return a, b, f"{side} has {longer.shape[2] - n} padded (masked) key columns: cropped to {n}"
        raise ValueError(f"key axis {sa[2]} vs {sb[2]} and the extra columns of {side} are not "
                         "masked (positions stuck? keys missing from the cache?)")
    # the same elements under another shape: q flat (n, heads*hd) vs (n, heads, hd)
    if a.size == b.size and a.size and a.shape[0] == b.shape[0]:
        return a.reshape(b.shape), b, f"a {sa} reshaped to {sb}"
    # fewer rows on one side: the last rows (llama.cpp computes only the output rows of the
    # last layer; logits="last" keeps one row)
    if a.ndim == b.ndim and a.ndim >= 1 and a.shape[1:] == b.shape[1:] and a.shape[0] != b.shape[0]:
        n = min(a.shape[0], b.shape[0])
        return a[-n:], b[-n:], f"rows {sa[0]} vs {sb[0]}: compared the last {n}"
    if a.size == b.size and a.size:
        return a.reshape(b.shape), b, f"a {sa} reshaped to {sb}"
    raise ValueError(f"shapes {sa} and {sb} do not match")


def _hints(a, b):
    """Cheap explanations of a failing float tensor: zeros, transpose, a constant factor."""
    hints = []
    if a.size and not np.any(a):
        return ["a is all zeros (never written?)"]
    with np.errstate(all="ignore"):
        if a.ndim >= 2 and a.shape[-1] == a.shape[-2] and a.shape[-1] > 1:
            t = np.swapaxes(a, -1, -2)
            if np.all(np.isfinite(t)) and np.allclose(t, b, rtol=1e-3, atol=1e-4 * (np.abs(b).max() or 1)):
                hints.append("a matches the transpose of b")
        if np.all(np.isfinite(a)) and np.all(np.isfinite(b)):
            bb = float(np.vdot(b, b))
            if bb > 0:
                c = float(np.vdot(a, b)) / bb
                resid = np.linalg.norm(a - c * b) / math.sqrt(bb)
                if resid < 1e-3 and abs(c - 1) > 1e-3:
                    hints.append(f"a = {c:.6g} x b (a constant factor)")
    return hints


def _stats(row, a, b, rtol, atol, detail):
    """Fill the numbers of a float row; returns notes."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _stats_unguarded(row, a, b, rtol, atol, detail)


def _worst(score, fail, k=5):
    """Flat indices of the (at most k) largest scores among failing elements, largest first."""
    flat = score.reshape(-1)
    k = min(k, flat.size)
    top = np.argpartition(flat, flat.size - k)[flat.size - k:]
    top = top[np.argsort(flat[top])[::-1]]
    return [int(i) for i in top if fail.flat[i]]


def _stats_unguarded(row, a, b, rtol, atol, detail):
    a = a.astype(np.float64, copy=False)
    b = b.astype(np.float64, copy=False)
    row.nan_a, row.nan_b = int(np.isnan(a).sum()), int(np.isnan(b).sum())
    row.inf_a, row.inf_b = int(np.isinf(a).sum()), int(np.isinf(b).sum())
    finite = np.isfinite(a) & np.isfinite(b)
    same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & np.isinf(b) & (a == b))
    masked = 0
    if row.name.endswith("attn_scores"):
        ma = np.isneginf(b) & np.isfinite(a) & (a <= _MASK_FLOOR)
        mb = np.isneginf(a) & np.isfinite(b) & (b <= _MASK_FLOOR)
        masked = int(ma.sum() + mb.sum())
        same |= ma | mb
        finite &= ~(ma | mb)
    bad = ~(finite | same)                   # NaN or inf against anything else
    diff = np.where(finite, np.abs(a - b), 0.0)
    tol = atol + rtol * np.abs(np.where(finite, b, 0.0))
    fail = bad | (diff > tol)
    row.size = int(a.size)
    row.n_fail = int(fail.sum())
    row.frac_fail = row.n_fail / a.size if a.size else 0.0
    af, bf = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    row.max_abs = float(diff.max()) if a.size else 0.0
    nb, na, nd = float(np.linalg.norm(bf)), float(np.linalg.norm(af)), float(np.linalg.norm(af - bf))
    row.rel = nd / nb if nb > 0 else (0.0 if nd == 0 else math.inf)
    row.cosine = float(np.vdot(af, bf)) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    notes = []
    if masked:
        notes.append(f"{masked} finite mask values (<= {_MASK_FLOOR:g}) taken as -inf")
    if bad.any():
        notes.append(f"{int(bad.sum())} NaN/inf mismatches")
    if row.n_fail and detail:
        for f in _worst(np.where(bad, np.inf, diff), fail):
            idx = tuple(int(i) for i in np.unravel_index(f, a.shape))
            row.worst.append((idx, float(a.flat[f]), float(b.flat[f])))
        notes += _axis0_hint(row.name, fail) + _hints(a, b)
    return notes


def _axis0_hint(name, fail):
    """Which slices along the first axis (tokens; heads for attention maps) are right: a RoPE or
    KV-position bug leaves token 0 intact, a GQA mapping bug some heads."""
    if fail.ndim < 2 or fail.shape[0] < 2:
        return []
    bad_rows = fail.reshape(fail.shape[0], -1).any(1)
    if bad_rows.all() or not bad_rows.any():
        return []
    what = "heads" if name.endswith(("attn_scores", "attn_probs")) else "rows (tokens)"
    good = np.flatnonzero(~bad_rows)
    shown = ", ".join(str(int(i)) for i in good[:8]) + (", ..." if len(good) > 8 else "")
    return [f"{what} {shown} match, {int(bad_rows.sum())} of {len(bad_rows)} differ"]


def compare_arrays(name, a, b, rtol=1e-3, atol=1e-4, detail=True):
    """One Row for the tensors a (under test) and b (trusted); never raises for bad values.
    detail=False skips the worst elements and the hints (for callers that only want numbers)."""
    row = Row(name=name, status=OK)
    try:
        a = np.asarray(a)
        b = np.asarray(b)
    except Exception as exc:
        row.status, row.note = ERROR, f"not an array ({type(exc).__name__}: {exc})"
        return row
    row.shape_a, row.shape_b = _shape(a), _shape(b)
    row.dtype_a, row.dtype_b = str(a.dtype), str(b.dtype)
    ka, kb = _kind(a), _kind(b)
    notes = []
    if "other" in (ka, kb):
        row.status, row.note = DTYPE, f"dtype {a.dtype} vs {b.dtype}: not numbers"
        return row
    if ka == "float" and a.dtype.kind == "c" or kb == "float" and b.dtype.kind == "c":
        row.status, row.note = DTYPE, f"dtype {a.dtype} vs {b.dtype}: complex values"
        return row
    if ka != kb:
        fl = a if ka == "float" else b
        integral = bool(np.all(np.isfinite(fl)) and np.all(fl == np.round(fl)))
        if name.endswith("argmax") and integral:
            a, b = a.astype(np.int64), b.astype(np.int64)
            ka = kb = "int"
            notes.append(f"{'a' if fl is a else 'b'} holds token ids as floats")
        else:
            row.status = DTYPE
            row.note = (f"dtype {row.dtype_a} vs {row.dtype_b}: integers against floats "
                        "(a buffer of ids read as values, or the reverse?)")
            return row
    try:
        a, b, how = _align(name, a, b)
    except ValueError as exc:
        row.status, row.note = SHAPE, str(exc)
        return row
    if how:
        notes.append(how)
    if ka == "int":
        a, b = a.astype(np.int64), b.astype(np.int64)
        neq = a != b
        row.size = int(a.size)
        row.n_fail = int(neq.sum())
        row.frac_fail = row.n_fail / a.size if a.size else 0.0
        row.max_abs = float(np.abs(a - b).max()) if a.size else 0.0
        for f in np.flatnonzero(neq)[:5]:
            idx = tuple(int(i) for i in np.unravel_index(f, a.shape))
            row.worst.append((idx, int(a.flat[f]), int(b.flat[f])))
        if a.size and not np.any(a) and row.n_fail:
            notes.append("a is all zeros (never written?)")
    else:
        notes += _stats(row, a, b, rtol, atol, detail)
    row.status = DIVERGED if row.n_fail else OK
    row.note = "; ".join(notes)
    return row


# --------------------------------------------------------------------------------------------
# The report

@dataclass
class CompareReport:
    """The rows of one comparison in forward order. Plain data: .rows, .first_divergence,
    .to_dict(); str(report) is the table."""
    rows: list
    rtol: float
    atol: float
    label_a: str = "a"
    label_b: str = "b"
    sources: dict = field(default_factory=dict)

    @property
    def first_divergence(self):
        """The first tensor in forward order that diverges (values, shape or dtype), or None."""
        for r in self.rows:
            if r.diverged:
                return r.name
        return None

    @property
    def passed(self):
        return self.first_divergence is None

    @property
    def compared(self):
        return [r for r in self.rows if r.status not in (MISSING_A, MISSING_B)]

    def __getitem__(self, name):
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"{name!r} is not in this report")

    def __contains__(self, name):
        return any(r.name == name for r in self.rows)

    def names(self):
        return [r.name for r in self.rows]

    def to_dict(self):
        return {"rtol": self.rtol, "atol": self.atol, "a": self.label_a, "b": self.label_b,
                "first_divergence": self.first_divergence,
                "rows": [dict(asdict(r), passed=r.passed) for r in self.rows]}

    def summary(self):
        """One line: the first divergence with its numbers, or how many tensors matched."""
        first = self.first_divergence
        n_ok = sum(r.passed for r in self.rows)
        missing = len(self.rows) - len(self.compared)
        tail = f" ({missing} present on one side only)" if missing else ""
        if not self.compared:
            return ("nothing compared: no tensor name is on both sides (another engine's names? "
                    "pass name_map='hf' or 'llama.cpp', or a dict)")
        if first is None:
            return f"no divergence: {n_ok} tensors match within rtol={self.rtol:g} atol={self.atol:g}{tail}"
        r = self[first]
        src = self.sources.get(first)
        what = f"first divergence: {first}" + (f" [{src}]" if src else "")
        if r.status == DIVERGED and r.rel is not None:
            what += (f" (rel {r.rel:.3g}, cos {r.cosine:.4f}, max|a-b| {r.max_abs:.4g}, "
                     f"{100 * r.frac_fail:.1f}% of elements out of tolerance)")
        elif r.status == DIVERGED:
            what += f" ({r.n_fail} of {r.size} differ)"
        else:
            what += f" ({r.status}: {r.note})"
        return what + tail

    def table(self, only=None, limit=None):
        """The rows as text. only="diverged" keeps failing rows; limit caps the row count."""
        rows = self.rows if only is None else [r for r in self.rows if r.diverged]
        if limit is not None:
            rows = rows[:limit]
        width = max([len("tensor")] + [len(r.name) for r in rows])
        head = (f"{'tensor':<{width}}  {'shape':<16} {'max|a-b|':>10} {'rel err':>9} "
                f"{'cosine':>9} {'fail':>7}  status")
        lines = [head, "-" * len(head)]
        for r in rows:
            shape = r.shape_b if r.shape_b is not None else r.shape_a
            shape = "" if shape is None else str(shape).replace(" ", "")
            nums = (_fmt(r.max_abs, "{:10.3g}"), _fmt(r.rel, "{:9.2e}"), _fmt(r.cosine, "{:9.6f}"),
                    _fmt(None if r.frac_fail is None else 100 * r.frac_fail, "{:6.1f}%"))
            status = r.status.upper() if r.diverged else r.status
            note = f"  {r.note}" if r.note else ""
            lines.append(f"{r.name:<{width}}  {shape:<16} {nums[0]:>10} {nums[1]:>9} {nums[2]:>9} "
                         f"{nums[3]:>7}  {status}{note}")
        return "\n".join(lines)

    def __str__(self):
        head = f"compare a={self.label_a} vs b={self.label_b} (rtol={self.rtol:g}, atol={self.atol:g})"
        return "\n".join([head, self.summary(), "", self.table()])

    def __repr__(self):
        return f"<CompareReport {len(self.rows)} tensors, first divergence {self.first_divergence!r}>"


def _fmt(x, spec):
    if x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return spec.format(x).strip()


def _derive(tensors, name):
    """A derived quantity (namemaps.DERIVED) from a capture of the same side, or None."""
    m = re.match(r"^blk\.(\d+)\.([a-z_]+)$", name)
    if not m or m.group(2) not in namemaps.DERIVED:
        return None
    src = f"blk.{m.group(1)}.{namemaps.DERIVED[m.group(2)][0]}"
    if src not in tensors:
        return None
    g = np.asarray(tensors[src], np.float32)
    return g / (np.float32(1) + np.exp(-g))


def _hints_from(pairs):
    """n_layer and head_dim as far as one side's names and shapes tell them."""
    n_layer, head_dim = None, None
    for name, arr in pairs:
        m = re.match(r"^blk\.(\d+)\.", name) or re.match(r"^(?:.*\.)?layers\.(\d+)", name) \
            or re.match(r"^[A-Za-z_]+-(\d+)", name)
        if m:
            n_layer = max(n_layer or 0, int(m.group(1)) + 1)
        if head_dim is None and re.match(r"^blk\.\d+\.(q|k)(_rope)?$", name):
            shape = np.shape(arr)
            if len(shape) == 3:
                head_dim = int(shape[-1])
    return n_layer, head_dim


def compare(a, b, rtol=1e-3, atol=1e-4, name_map=None, names=None) -> CompareReport:
    """Compare a (under test) against b (trusted), tensor by tensor, in forward order.

    a, b: Traces, dicts of arrays, lists of (name, array), .npz paths or folders of .npy files.
    name_map: translate names first: None, "hf", "llama.cpp", a dict {their name: ours} ("{L}"
        for the layer), or a pair (map for a, map for b). qwencuda's own names pass through any
        map, so one map serves a comparison of a foreign dump against a Trace.
    names: compare only these names (glob patterns allowed).
    """
    import fnmatch

    rtol, atol = float(rtol), float(atol)
    maps = tuple(name_map) if isinstance(name_map, (tuple, list)) else (name_map, name_map)
    if len(maps) != 2:
        raise ValueError("name_map as a sequence must be (map for a, map for b)")
    maps = tuple(namemaps.resolve(m) for m in maps)
    pairs_a, info_a = load_tensors(a)
    pairs_b, info_b = load_tensors(b)
    la, ha = _hints_from(pairs_a)
    lb, hb = _hints_from(pairs_b)
    n_layer = lb if maps[1] is None and lb else la if maps[0] is None and la else (lb or la)
    head_dim = hb or ha
    pos_a, pos_b = info_a["positions"], info_b["positions"]
    ta = namemaps.translate(pairs_a, maps[0], n_layer=n_layer if maps[1] is None else None,
                            head_dim=head_dim, positions=pos_b if pos_b is not None else pos_a)
    tb = namemaps.translate(pairs_b, maps[1], n_layer=n_layer if maps[0] is None else None,
                            head_dim=head_dim, positions=pos_a if pos_a is not None else pos_b)
    A, B = dict(ta.tensors), dict(tb.tensors)
    for mine, other, tr in ((A, B, ta), (B, A, tb)):
        for name in list(other):
            if name not in mine:
                d = _derive(mine, name)
                if d is not None:
                    mine[name] = d
                    tr.notes[name] = f"derived here from blk.L.{namemaps.DERIVED[name.split('.')[-1]][0]}"
    order = forward_order(list(dict.fromkeys(list(A) + list(B))))
    if names is not None:
        pats = [names] if isinstance(names, str) else list(names)
        order = [n for n in order if any(fnmatch.fnmatchcase(n, p) for p in pats)]
    rows = []
    for name in order:
        if name not in A:
            rows.append(Row(name=name, status=MISSING_A, shape_b=_safe_shape(B[name])))
            continue
        if name not in B:
            rows.append(Row(name=name, status=MISSING_B, shape_a=_safe_shape(A[name])))
            continue
        row = compare_arrays(name, A[name], B[name], rtol, atol)
        extra = [n for n in (ta.notes.get(name), tb.notes.get(name)) if n]
        if extra:
            row.note = "; ".join(extra + ([row.note] if row.note else []))
        rows.append(row)
    sources = {n: s for n, s in list(tb.sources.items()) + list(ta.sources.items())}
    return CompareReport(rows=rows, rtol=rtol, atol=atol, label_a=info_a["label"] or "a",
                         label_b=info_b["label"] or "b", sources=sources)


def _safe_shape(x):
    try:
        return tuple(int(s) for s in np.shape(x))
    except Exception:
        return None


# --------------------------------------------------------------------------------------------
# assert_matches: the pytest-facing form

def assert_matches(actual, name, trace, rtol=1e-3, atol=1e-4, name_map=None):
    """Assert that actual (an array, or a dict of arrays when name is None) matches the capture
    name of trace (a Trace, a dict, an .npz, ...). On failure the AssertionError carries the
    compare report: the first divergence, the error table, the worst elements and any hint
    (transposed, reshaped, a constant factor), not a bare array mismatch."""
    __tracebackhide__ = True          # pytest shows the caller's line, not this function's
    if name is None:
        if not isinstance(actual, Mapping):
            raise TypeError("assert_matches needs a name unless actual is a dict of arrays")
        mine = dict(actual)
    else:
        mine = {name: actual}
    pairs, info = load_tensors(trace)
    have = dict(namemaps.translate(pairs, name_map).tensors)
    missing = [n for n in mine if n not in have and _derive(have, n) is None]
    if missing:
        raise AssertionError(f"qwencuda: {', '.join(missing)} not captured in the trace "
                             f"(it has: {', '.join(list(have)[:12])}{' ...' if len(have) > 12 else ''})")
    rep = compare(mine, have, rtol=rtol, atol=atol, names=list(mine))
    rep.label_a, rep.label_b = "actual", info["label"] or "trace"
    if rep.passed:
        return rep
    lines = [f"qwencuda: {rep.first_divergence} does not match the trace", rep.summary(), "",
             rep.table()]
    for r in rep.rows:
        if r.worst:
            lines.append(f"largest errors in {r.name} (index: actual vs expected):")
            lines += [f"  {idx}: {x:.7g} vs {y:.7g}" for idx, x, y in r.worst]
    raise AssertionError("\n".join(lines))


# --------------------------------------------------------------------------------------------
# Command line: python -m qwencuda compare A B

def main(argv=None) -> int:
    """`python -m qwencuda compare A B`: print the report; exit 0 when nothing diverges, 1 when
    something does, 2 when an input cannot be read or the arguments are wrong."""
    p = argparse.ArgumentParser(
        prog="python -m qwencuda compare",
        description="Compare two sets of tensor dumps (A under test, B trusted) and name the first "
                    "tensor that diverges. A and B: .npz files (a saved Trace or any npz) or folders "
                    "of .npy files.")
    p.add_argument("a", help="the dumps under test")
    p.add_argument("b", help="the trusted dumps")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--map", choices=namemaps.MAPS, default=None,
                   help="the names of A (and of B, where not qwencuda's) are HF's or llama.cpp's")
    p.add_argument("--only-diverged", action="store_true", help="print only the failing rows")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        rep = compare(args.a, args.b, rtol=args.rtol, atol=args.atol, name_map=args.map)
    except (CompareError, ValueError, TypeError) as exc:
        print(f"qwencuda compare: error: {exc}", file=sys.stderr)
        return 2
    if args.only_diverged:
        print("\n".join([f"compare a={rep.label_a} vs b={rep.label_b} (rtol={rep.rtol:g}, atol={rep.atol:g})",
                         rep.summary(), "", rep.table(only="diverged")]))
    else:
        print(rep)
    return 0 if rep.passed else 1


class _CallableModule(types.ModuleType):
    """`qwencuda.compare` is this module (qwencuda/__init__.py), and it forwards calls:
    `qwencuda.compare(a, b)` and `qwencuda.compare.CompareError` both work."""

    def __call__(self, *args, **kwargs):
        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
