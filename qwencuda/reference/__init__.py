"""A pure-NumPy Qwen2 forward pass: the independent oracle of qwencuda.

    ref = qwencuda.reference.load("model.gguf")
    tr = qwencuda.reference.forward(ref, ids)                  # a Trace, source "reference"
    tr = qwencuda.reference.forward(ref, ids, faults=("no_qkv_bias",))
    toks = qwencuda.reference.greedy(ref, ids, 8)

Written independently of the C code: the file is read with the `gguf` package's GGUFReader and
dequantized with `gguf.quants.dequantize` only, never with qwencuda's own parser or kernels.

Precision: weights are held as float32 (dequantized once, cached in the RefModel). Matrix products
with weights (q/k/v/o, gate/up/down, lm_head) are float32 NumPy (BLAS sgemm). RMSNorm statistics,
the RoPE angles, sines and cosines and their application, and the whole attention (scores,
softmax, probs @ V) are computed in float64 and stored as float32. SiLU is float32.

Faults (FAULTS, FIRST_AFFECTED, from qwencuda/reference/faults.py): faults=("name", ...) runs the forward
pass on a FaultySession, whose steps reproduce known engine bugs, so that a dump from a broken
engine can be matched against it (qwencuda.diagnose). This file holds only the correct maths.

Patches (patch=, as qwencuda.patching describes them, the same semantics as the C engine's):
every tensor of a capture name passes through one helper right after it is computed (touch in
_run); a patched one is replaced there by the patch's value, which everything after reads. So q
and k patched before RoPE are rotated, k_rope and v patched enter the KV cache, patched
attn_scores are softmaxed, patched attn_scores / attn_probs are multiplied by the cache's values
(in float64, like the rest of the attention), the lm_head reads the patched output_norm (its rows
that have logits), and argmax is that of the patched logits.
"""
from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .faults import FAULTS, FIRST_AFFECTED, Faults, check as _check_faults
from ..patching import as_hook

__all__ = ["RefConfig", "RefModel", "RefSession", "FaultySession", "FAULTS", "FIRST_AFFECTED",
           "load", "forward", "forward_steps", "greedy", "capture_names", "clear_cache"]


def capture_names(n_layer: int) -> list[str]:
    """Every capture name in forward order: the engine's names (the reference's math is its own;
    the names it files its tensors under are the one list of csrc/engine/session.c)."""
    from ..trace import capture_names as engine_names

    return engine_names(n_layer)


# --------------------------------------------------------------------------------------------
# Model

@dataclass(frozen=True)
class RefConfig:
    arch: str
    n_vocab: int          # from token_embd.weight, not from the tokenizer
    dim: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn_dim: int
    n_ctx_train: int
    rope_theta: float
    norm_eps: float
    tied: bool            # no output.weight: token_embd.weight is the lm_head


@dataclass
class RefModel:
    path: str
    config: RefConfig
    weights: dict                   # name -> float32 ndarray, NumPy shape (out, in) / (n,)
    types: dict                     # name -> GGML type name as stored ("Q5_0", "F32", ...)
    n_written: int                  # regular tokens: ids below the first special/padding token
    metadata: dict = field(default_factory=dict)   # scalar metadata (no token arrays)

    def capture_names(self) -> list[str]:
        return capture_names(self.config.n_layer)

    @property
    def lm_head(self) -> np.ndarray:
        """(n_vocab, dim): output.weight, or token_embd.weight when tied."""
        return self.weights.get("output.weight", self.weights["token_embd.weight"])

    def __repr__(self):
        c = self.config
        return (f"RefModel({os.path.basename(self.path)!r}, n_layer={c.n_layer}, dim={c.dim}, "
                f"n_head={c.n_head}/{c.n_head_kv}, ffn={c.ffn_dim}, n_vocab={c.n_vocab}, tied={c.tied})")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _dequantize(t) -> np.ndarray:
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF ne order -> NumPy order
    data = np.asarray(t.data)
    x = gguf.quants.dequantize(data, t.tensor_type)
    if np.shares_memory(x, data):  # F32 comes back as a view of the file's mmap: copy it
        x = np.array(x, dtype=np.float32, copy=True)
    return x.astype(np.float32, copy=False).reshape(shape)


def load(source, progress=None) -> RefModel:
    """Read a Qwen2 GGUF file (a path, a qwencuda.GGUFFile, or anything with .path) into float32
    NumPy weights with the gguf package's GGUFReader and dequantize. progress: a bar over the
    tensors on stderr (None: only when stderr is a terminal; see qwencuda.progress)."""
    import gguf

    from ..progress import bar

    if isinstance(source, RefModel):
        return source
    path = os.fspath(getattr(source, "path", source))
    r = gguf.GGUFReader(path)
    arch = _field(r, "general.architecture")
    if arch != "qwen2":
        raise ValueError(f"{path}: architecture {arch!r}, the reference runs qwen2 only")

    def meta(key, default=None):
        v = _field(r, f"qwen2.{key}", default)
        if v is None:
            raise ValueError(f"{path}: metadata qwen2.{key} missing")
        return v

    tensors = {t.name: t for t in r.tensors}
    weights, types = {}, {}
    with bar(len(tensors), "reference.load: dequantize", progress, unit="tensor") as b:
        for name, t in tensors.items():
            weights[name] = _dequantize(t)
            types[name] = t.tensor_type.name
            b.update(1)
    n_vocab, dim = weights["token_embd.weight"].shape
    n_head, n_head_kv = int(meta("attention.head_count")), int(meta("attention.head_count_kv", 0) or 0)
    n_head_kv = n_head_kv or n_head
    cfg = RefConfig(
        arch=arch, n_vocab=int(n_vocab), dim=int(meta("embedding_length")),
        n_layer=int(meta("block_count")), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=int(meta("embedding_length")) // n_head, ffn_dim=int(meta("feed_forward_length")),
        n_ctx_train=int(meta("context_length", 0) or 0), rope_theta=float(meta("rope.freq_base", 10000.0)),
        norm_eps=float(meta("attention.layer_norm_rms_epsilon")), tied="output.weight" not in tensors)
    if cfg.dim != dim:
        raise ValueError(f"{path}: embedding_length {cfg.dim} but token_embd.weight has dim {dim}")
    types_arr = _field(r, "tokenizer.ggml.token_type")
    n_written = cfg.n_vocab - max(1, cfg.n_vocab // 64)
    if types_arr is not None:
        irregular = [i for i, ty in enumerate(types_arr) if ty != 1]
        if irregular and 0 < irregular[0] < cfg.n_vocab:
            n_written = irregular[0]
    metadata = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml.") and k.endswith(("tokens", "token_type", "merges", "scores")):
            continue
        try:
            metadata[k] = f.contents()
        except Exception:  # pragma: no cover - unreadable field types
            pass
    return RefModel(path=path, config=cfg, weights=weights, types=types, n_written=n_written,
                    metadata=metadata)


_CACHE: dict = {}


def _model(model, progress=None) -> RefModel:
    """A RefModel from a RefModel, path or GGUFFile; paths are cached (one model at a time)."""
    if isinstance(model, RefModel):
        return model
    path = os.path.realpath(os.fspath(getattr(model, "path", model)))
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = load(path, progress=progress)
    return _CACHE[key]


def clear_cache():
    """Drop the model cached by forward()/greedy() called with a path."""
    _CACHE.clear()


# --------------------------------------------------------------------------------------------
# Building blocks

def _rmsnorm(x, w, eps):
    """x (n, dim) * w (dim,) / sqrt(mean(x^2) + eps); statistics in float64."""
    x64 = x.astype(np.float64)
    ms = (x64 * x64).sum(-1, keepdims=True) / x.shape[-1]
    return (x64 / np.sqrt(ms + eps) * w.astype(np.float64)).astype(np.float32)


def _rope(x, pos, theta):
    """x (n, heads, hd) rotated by position pos (n,) in float64: NEOX pairs (i, i + hd/2) with
    angle pos * theta^(-2i/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]          # (n, half)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]       # (n, 1, half)
    x = x.astype(np.float64)
    a, b = x[..., :half], x[..., half:]
    out = np.empty_like(x)
    out[..., :half] = a * cos - b * sin
    out[..., half:] = a * sin + b * cos
    return out.astype(np.float32)


def _softmax(scores):
    """Row softmax over the last axis (float64; -inf entries get probability 0)."""
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


def _matmul(x, w):
    """x (n, in) @ w (out, in).T -> (n, out), float32."""
    return x @ w.T


# --------------------------------------------------------------------------------------------
# Trace

def _make_trace(tensors, logits, argmax, ids, positions, logit_positions):
    from ..trace import Trace

    return Trace(tensors=tensors, logits=logits, argmax=argmax, ids=ids, positions=positions,
                 logit_positions=logit_positions, source="reference")


def _selector(capture, n_layer):
    names = capture_names(n_layer)
    if capture is None:
        return frozenset()
    pats = [capture] if isinstance(capture, str) else list(capture)
    chosen = set()
    for p in pats:
        if not isinstance(p, str):
            raise TypeError(f"capture patterns must be strings, got {type(p).__name__}")
        hit = fnmatch.filter(names, p)
        if not hit:
            raise ValueError(f"capture pattern {p!r} matches no capture name")
        chosen.update(hit)
    return frozenset(chosen)


# --------------------------------------------------------------------------------------------
# Session: KV cache + forward

class RefSession:
    """Incremental forward with a KV cache, like qwencuda's Session: prefill(ids), step(token).
    Each call runs the tokens at positions position .. position + n - 1 and advances position.

    The forward pass is a sequence of steps (methods _positions .. _logits), each the plain
    maths; FaultySession (qwencuda/reference/faults.py) overrides some of them to reproduce engine bugs."""

    def __init__(self, model, max_context=None):
        self.model = _model(model)
        c = self.model.config
        self.max_context = int(max_context or c.n_ctx_train or 4096)
        self.eps = c.norm_eps               # RMSNorm epsilon
        self.theta = c.rope_theta           # RoPE base
        self._k = [np.zeros((0, c.n_head_kv, c.head_dim), np.float32) for _ in range(c.n_layer)]
        self._v = [np.zeros((0, c.n_head_kv, c.head_dim), np.float32) for _ in range(c.n_layer)]
        self.position = 0

    def reset(self):
        self.rewind(self.position)

    def rewind(self, n):
        if not 0 <= n <= self.position:
            raise ValueError(f"cannot rewind {n} tokens at position {self.position}")
        self.position -= n
        self._k = [k[:self.position] for k in self._k]
        self._v = [v[:self.position] for v in self._v]

    def prefill(self, ids, capture=None, logits="last", patch=None):
        return self._run(ids, capture, logits, patch)

    def step(self, token, capture=None, patch=None):
        return self._run([int(token)], capture, "last", patch)

    # ---- the steps ------------------------------------------------------------------------

    def _positions(self, n):
        """(n,) positions of the next n tokens."""
        return np.arange(self.position, self.position + n, dtype=np.int64)

    def _rmsnorm(self, x, w):
        return _rmsnorm(x, w, self.eps)

    def _rope(self, x, pos):
        return _rope(x, pos, self.theta)

    def _matrix(self, name):
        """A projection weight, (out, in)."""
        return self.model.weights[name]

    def _bias(self, name):
        return self.model.weights[name]

    def _kv_head(self):
        """(n_head,): the KV head each query head reads, h // (n_head / n_head_kv)."""
        c = self.model.config
        return np.arange(c.n_head) // (c.n_head // c.n_head_kv)

    # The attention, in three steps so that a patch can change the scores or the probabilities
    # in between: _store (the cache), _scores, softmax, _mix.

    def _store(self, layer, k, v):
        """The new tokens' k (after RoPE) and v (n, Hkv, hd) appended to the layer's KV cache."""
        self._k[layer] = np.concatenate([self._k[layer], k], 0)             # (n_kv, Hkv, hd)
        self._v[layer] = np.concatenate([self._v[layer], v], 0)

    def _scores(self, layer, q, k, pos):
        """q (n, H, hd) at positions pos against the cached keys (this call's k included)
        -> (H, n, n_kv) float64, scaled by 1/sqrt(head_dim), -inf on keys after the query."""
        c = self.model.config
        K = self._k[layer]
        Kh = K[:, self._kv_head(), :].astype(np.float64)                     # (n_kv, H, hd)
        scores = np.einsum("nhd,thd->hnt", q.astype(np.float64), Kh) * (1.0 / math.sqrt(c.head_dim))
        after = np.arange(len(K))[None, :] > pos[:, None]                    # key after query
        return np.where(after[None], -np.inf, scores)

    def _mix(self, layer, probs, v):
        """probs (H, n, n_kv) @ the cached values (this call's v included) -> (n, H, hd) float64."""
        Vh = self._v[layer][:, self._kv_head(), :].astype(np.float64)        # (n_kv, H, hd)
        return np.einsum("hnt,thd->nhd", np.asarray(probs, np.float64), Vh)

    def _lm_head(self):
        return self.model.lm_head

    def _logits(self, lg):
        """The logits rows as the lm_head wrote them."""
        return lg

    # ---- the forward pass -----------------------------------------------------------------

    def _layer(self, L, x, pos, touch):
        """Transformer block L on the residual stream x (n, dim) -> the new residual stream.
        touch(name, value) -> value, or the patch's value for it (see _run)."""
        c, w, p = self.model.config, self.model.weights, f"blk.{L}."
        n = len(x)
        # attention
        h = touch(p + "attn_norm", self._rmsnorm(x, w[p + "attn_norm.weight"]))
        q = _matmul(h, self._matrix(p + "attn_q.weight")) + self._bias(p + "attn_q.bias")
        k = _matmul(h, self._matrix(p + "attn_k.weight")) + self._bias(p + "attn_k.bias")
        v = _matmul(h, self._matrix(p + "attn_v.weight")) + self._bias(p + "attn_v.bias")
        q = touch(p + "q", q.reshape(n, c.n_head, c.head_dim))
        k = touch(p + "k", k.reshape(n, c.n_head_kv, c.head_dim))
        v = touch(p + "v", v.reshape(n, c.n_head_kv, c.head_dim))
        q = touch(p + "q_rope", self._rope(q, pos))
        k = touch(p + "k_rope", self._rope(k, pos))
        self._store(L, k, v)
        scores = touch(p + "attn_scores", self._scores(L, q, k, pos))
        probs = touch(p + "attn_probs", self._softmax(scores))
        ctx = self._mix(L, probs, v)
        attn_out = touch(p + "attn_out", ctx.reshape(n, c.n_head * c.head_dim).astype(np.float32))
        proj = touch(p + "attn_proj", _matmul(attn_out, self._matrix(p + "attn_output.weight")))
        x = touch(p + "resid_mid", x + proj)
        # feed-forward
        h = touch(p + "ffn_norm", self._rmsnorm(x, w[p + "ffn_norm.weight"]))
        gate = touch(p + "gate", _matmul(h, self._matrix(p + "ffn_gate.weight")))
        up = touch(p + "up", _matmul(h, self._matrix(p + "ffn_up.weight")))
        act = touch(p + "ffn_act", _silu(gate) * up)
        down = touch(p + "ffn_out", _matmul(act, self._matrix(p + "ffn_down.weight")))
        return touch(p + "resid_out", x + down)

    def _softmax(self, scores):
        """Row softmax of the scores (H, n, n_kv) -> float64 probabilities."""
        return _softmax(np.asarray(scores, np.float64))

    def _run(self, ids, capture, logits, patch=None):
        m, c = self.model, self.model.config
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("no tokens")
        if ids.min() < 0 or ids.max() >= c.n_vocab:
            raise ValueError(f"token ids must lie in [0, {c.n_vocab})")
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if self.position + n > self.max_context:
            raise ValueError(f"{self.position + n} tokens exceed max_context {self.max_context}")
        want = _selector(capture, c.n_layer)
        patched, hook = as_hook(patch, capture_names(c.n_layer), c.n_head)
        patched = frozenset(patched or ())
        out = {}

        def touch(name, value):
            """The tensor `name` was just computed as value: -> the value the rest of the pass
            reads (the patch's, where patch names it), captured (as float32) when asked for."""
            if name in patched:
                value = hook(name, value)
            if name in want:
                out[name] = np.array(value, dtype=np.float32 if value.dtype == np.float64 else None)
            return value

        pos = self._positions(n)
        x = touch("embed", m.weights["token_embd.weight"][ids].astype(np.float32))   # (n, dim)
        for L in range(c.n_layer):
            x = self._layer(L, x, pos, touch)
        self.position += n
        h = touch("output_norm", self._rmsnorm(x, m.weights["output_norm.weight"]))
        rows = np.arange(n) if logits == "all" else np.array([n - 1])
        lg = touch("logits", self._logits(_matmul(h[rows], self._lm_head()).astype(np.float32)))
        am = touch("argmax", lg.argmax(-1).astype(np.int32))
        return _make_trace(out, lg, am, ids.astype(np.int32), pos.astype(np.int32),
                           pos[rows].astype(np.int32))


class FaultySession(Faults, RefSession):
    """FaultySession(model, faults, max_context=None): a RefSession reproducing known engine bugs
    (names of FAULTS; the steps they change are in qwencuda/reference/faults.py)."""


def _session(model, faults=()):
    """A RefSession, or a FaultySession when faults are named."""
    faults = _check_faults(faults)
    return FaultySession(model, faults) if faults else RefSession(model)


# --------------------------------------------------------------------------------------------
# Entry points

def forward(model, ids, capture="*", logits="all", faults=(), patch=None):
    """One pass over ids from position 0 -> Trace (source "reference").

    model: a RefModel, or a path / qwencuda.GGUFFile (loaded and cached, one at a time).
    capture: glob pattern(s) of capture names ("*" all, None nothing); logits: "all" or "last";
    faults: names of FAULTS to reproduce; patch: {capture name or glob: edit} (qwencuda.patching)."""
    return _session(model, faults).prefill(ids, capture=capture, logits=logits, patch=patch)


def forward_steps(model, ids, n_prefill, capture="*", faults=(), patch=None):
    """Prefill ids[:n_prefill] (logits "last"), then one step per remaining id -> list of Traces
    (1 + len(ids) - n_prefill of them). Reproduces decode-time behaviour (KV cache, positions).
    patch applies to every call (the prefill and each step), with each call's shapes."""
    ids = [int(t) for t in np.asarray(ids).reshape(-1)]
    if not 1 <= n_prefill <= len(ids):
        raise ValueError(f"n_prefill must lie in [1, {len(ids)}]")
    s = _session(model, faults)
    traces = [s.prefill(ids[:n_prefill], capture=capture, logits="last", patch=patch)]
    for t in ids[n_prefill:]:
        traces.append(s.step(t, capture=capture, patch=patch))
    return traces


def greedy(model, ids, n_new, faults=(), stop=()):
    """Greedy decoding: prefill ids, then n_new argmax steps -> the new token ids (stops early
    after emitting a token in stop)."""
    s = _session(model, faults)
    tr = s.prefill(ids, capture=None, logits="last")
    out = []
    stop = set(int(t) for t in stop)
    for i in range(int(n_new)):
        t = int(tr.argmax[-1])
        out.append(t)
        if t in stop or i == n_new - 1:
            break
        tr = s.step(t)
    return out
