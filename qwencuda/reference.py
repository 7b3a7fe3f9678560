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

Faults (FAULTS, FIRST_AFFECTED): faults=("name", ...) makes the reference reproduce a known
engine bug, so that a dump from a broken engine can be matched against it (qwencuda.diagnose).
Each fault changes only what its description says; FIRST_AFFECTED names the first capture, in
forward order, whose values (or shape) it changes on a prompt of several tokens.
"""
from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RefConfig", "RefModel", "RefSession", "FAULTS", "FIRST_AFFECTED", "load", "forward",
           "forward_steps", "greedy", "capture_names", "clear_cache"]

FAULTS = {
    "transposed_weights": "every projection weight (attn_q/k/v/output, ffn_gate/up/down) read with "
                          "the row/column-major mix-up: the (out, in) buffer taken as column-major, "
                          "W_bug = W.reshape(in, out).T, which is exactly W.T for square weights",
    "no_qkv_bias": "the q/k/v biases are never added",
    "kv_pos_stuck": "the KV cache position never advances: every token uses RoPE position 0, is "
                    "written at cache slot 0 and attends only to slot 0 (itself); attn_scores/"
                    "attn_probs have one key column; shows from the second token on",
    "rope_interleaved": "RoPE rotates GPT-J pairs (2i, 2i+1) instead of NEOX pairs (i, i + head_dim/2)",
    "rope_base_1e4": "RoPE uses theta 10000 instead of the file's rope.freq_base",
    "rmsnorm_eps_1e-5": "every RMSNorm uses eps 1e-5 instead of the file's layer_norm_rms_epsilon",
    "rmsnorm_no_mean": "every RMSNorm divides by sqrt(sum of squares + eps) instead of "
                       "sqrt(mean of squares + eps)",
    "gqa_wrong_mapping": "query head h reads KV head h % n_head_kv instead of h // (n_head / "
                         "n_head_kv) (no effect when n_head_kv is 1 or equals n_head)",
    "lm_head_wrong_ld": "the lm_head read with the wrong leading dimension: its (n_vocab, dim) "
                        "buffer reinterpreted as (dim, n_vocab) and transposed back",
    "argmax_unwritten": "the lm_head writes only the regular tokens (ids below the first special or "
                        "padding token); the rest of the logits row holds stale garbage larger "
                        "than every written logit, so argmax picks unwritten memory",
}

FIRST_AFFECTED = {
    "transposed_weights": "blk.0.q",
    "no_qkv_bias": "blk.0.q",
    "kv_pos_stuck": "blk.0.q_rope",
    "rope_interleaved": "blk.0.q_rope",
    "rope_base_1e4": "blk.0.q_rope",
    "rmsnorm_eps_1e-5": "blk.0.attn_norm",
    "rmsnorm_no_mean": "blk.0.attn_norm",
    "gqa_wrong_mapping": "blk.0.attn_scores",
    "lm_head_wrong_ld": "logits",
    "argmax_unwritten": "logits",
}

def capture_names(n_layer: int) -> list[str]:
    """Every capture name in forward order: the engine's names (the reference's math is its own;
    the names it files its tensors under are the one list of csrc/session.c)."""
    from .trace import capture_names as engine_names

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

    from .progress import bar

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
# Building blocks (each with its fault switches)

def _rmsnorm(x, w, eps, no_mean=False):
    """x (n, dim) * w (dim,) / sqrt(mean(x^2) + eps); statistics in float64."""
    x64 = x.astype(np.float64)
    ss = (x64 * x64).sum(-1, keepdims=True)
    ms = ss if no_mean else ss / x.shape[-1]
    return (x64 / np.sqrt(ms + eps) * w.astype(np.float64)).astype(np.float32)


def _rope(x, pos, theta, interleaved=False):
    """x (n, heads, hd) rotated by position pos (n,) in float64. NEOX pairs (i, i + hd/2) with
    angle pos * theta^(-2i/hd); interleaved: GPT-J pairs (2i, 2i+1) with the same angles."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]          # (n, half)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]       # (n, 1, half)
    x = x.astype(np.float64)
    out = np.empty_like(x)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = a * sin + b * cos
    return out.astype(np.float32)


def _as_column_major(w):
    """The (out, in) buffer read as if it were column-major (out, in): reshape(in, out).T."""
    out, inn = w.shape
    return np.ascontiguousarray(w.reshape(inn, out).T)


def _silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


def _matmul(x, w):
    """x (n, in) @ w (out, in).T -> (n, out), float32."""
    return x @ w.T


# --------------------------------------------------------------------------------------------
# Trace

def _make_trace(tensors, logits, argmax, ids, positions, logit_positions):
    from .trace import Trace

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
    With the kv_pos_stuck fault the session still counts position, but every token runs at
    position 0 (the traces' positions are all 0) and overwrites cache slot 0."""

    def __init__(self, model, faults=(), max_context=None):
        self.model = _model(model)
        self.faults = _check_faults(faults)
        c = self.model.config
        self.max_context = int(max_context or c.n_ctx_train or 4096)
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

    def prefill(self, ids, capture=None, logits="last"):
        return self._run(ids, capture, logits)

    def step(self, token, capture=None):
        return self._run([int(token)], capture, "last")

    def _run(self, ids, capture, logits):
        m, c, faults = self.model, self.model.config, self.faults
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("no tokens")
        if ids.min() < 0 or ids.max() >= c.n_vocab:
            raise ValueError(f"token ids must lie in [0, {c.n_vocab})")
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        start = self.position
        if start + n > self.max_context:
            raise ValueError(f"{start + n} tokens exceed max_context {self.max_context}")
        want = _selector(capture, c.n_layer)
        out = {}

        def keep(name, value):
            if name in want:
                out[name] = np.array(value, copy=True)

        stuck = "kv_pos_stuck" in faults
        pos = np.zeros(n, np.int64) if stuck else np.arange(start, start + n, dtype=np.int64)
        eps = 1e-5 if "rmsnorm_eps_1e-5" in faults else c.norm_eps
        no_mean = "rmsnorm_no_mean" in faults
        theta = 10000.0 if "rope_base_1e4" in faults else c.rope_theta
        interleaved = "rope_interleaved" in faults
        group = c.n_head // c.n_head_kv
        heads = np.arange(c.n_head)
        kv_of_head = heads % c.n_head_kv if "gqa_wrong_mapping" in faults else heads // group
        scale = 1.0 / math.sqrt(c.head_dim)

        def W(name):
            w = m.weights[name]
            return _as_column_major(w) if "transposed_weights" in faults else w

        x = m.weights["token_embd.weight"][ids].astype(np.float32)       # (n, dim)
        keep("embed", x)
        for L in range(c.n_layer):
            p = f"blk.{L}."
            h = _rmsnorm(x, m.weights[p + "attn_norm.weight"], eps, no_mean)
            keep(p + "attn_norm", h)
            q, k, v = (_matmul(h, W(p + f"attn_{t}.weight")) for t in "qkv")
            if "no_qkv_bias" not in faults:
                q = q + m.weights[p + "attn_q.bias"]
                k = k + m.weights[p + "attn_k.bias"]
                v = v + m.weights[p + "attn_v.bias"]
            q = q.reshape(n, c.n_head, c.head_dim)
            k = k.reshape(n, c.n_head_kv, c.head_dim)
            v = v.reshape(n, c.n_head_kv, c.head_dim)
            keep(p + "q", q)
            keep(p + "k", k)
            keep(p + "v", v)
            qr = _rope(q, pos, theta, interleaved)
            kr = _rope(k, pos, theta, interleaved)
            keep(p + "q_rope", qr)
            keep(p + "k_rope", kr)

            if stuck:
                # every token alone at slot 0: it sees exactly its own key and value
                kh = kr[:, kv_of_head, :].astype(np.float64)                 # (n, H, hd)
                scores = np.einsum("nhd,nhd->hn", qr.astype(np.float64), kh)[:, :, None] * scale
                probs = np.ones_like(scores)
                ctx = v[:, kv_of_head, :].astype(np.float64)                  # (n, H, hd)
                ck, cv = self._k[L], self._v[L]
                if len(ck) == 0:
                    ck = np.zeros((1, c.n_head_kv, c.head_dim), np.float32)
                    cv = np.zeros_like(ck)
                ck, cv = ck.copy(), cv.copy()
                ck[0], cv[0] = kr[-1], v[-1]
                self._k[L], self._v[L] = ck, cv
            else:
                K = np.concatenate([self._k[L], kr], 0)                       # (n_kv, Hkv, hd)
                V = np.concatenate([self._v[L], v], 0)
                self._k[L], self._v[L] = K, V
                n_kv = len(K)
                Kh = K[:, kv_of_head, :].astype(np.float64)                  # (n_kv, H, hd)
                Vh = V[:, kv_of_head, :].astype(np.float64)
                scores = np.einsum("nhd,thd->hnt", qr.astype(np.float64), Kh) * scale
                mask = np.arange(n_kv)[None, :] > pos[:, None]               # key after query
                scores = np.where(mask[None], -np.inf, scores)
                mx = scores.max(-1, keepdims=True)
                e = np.exp(scores - mx)
                probs = e / e.sum(-1, keepdims=True)
                ctx = np.einsum("hnt,thd->nhd", probs, Vh)
            keep(p + "attn_scores", scores.astype(np.float32))
            keep(p + "attn_probs", probs.astype(np.float32))
            attn_out = ctx.reshape(n, c.n_head * c.head_dim).astype(np.float32)
            keep(p + "attn_out", attn_out)
            proj = _matmul(attn_out, W(p + "attn_output.weight"))
            keep(p + "attn_proj", proj)
            x = x + proj
            keep(p + "resid_mid", x)
            h = _rmsnorm(x, m.weights[p + "ffn_norm.weight"], eps, no_mean)
            keep(p + "ffn_norm", h)
            gate = _matmul(h, W(p + "ffn_gate.weight"))
            up = _matmul(h, W(p + "ffn_up.weight"))
            keep(p + "gate", gate)
            keep(p + "up", up)
            act = _silu(gate) * up
            keep(p + "ffn_act", act)
            down = _matmul(act, W(p + "ffn_down.weight"))
            keep(p + "ffn_out", down)
            x = x + down
            keep(p + "resid_out", x)

        self.position = start + n
        h = _rmsnorm(x, m.weights["output_norm.weight"], eps, no_mean)
        keep("output_norm", h)
        rows = np.arange(n) if logits == "all" else np.array([n - 1])
        head = m.lm_head
        if "lm_head_wrong_ld" in faults:
            head = _as_column_major(head)
        lg = _matmul(h[rows], head).astype(np.float32)
        if "argmax_unwritten" in faults:
            lg = _unwritten(lg, m.n_written)
        am = lg.argmax(-1).astype(np.int32)
        keep("logits", lg)
        keep("argmax", am)
        return _make_trace(out, lg, am, ids.astype(np.int32), pos.astype(np.int32),
                           pos[rows].astype(np.int32))


def _unwritten(logits, n_written):
    """Columns >= n_written hold stale garbage above every written logit of the row."""
    lg = logits.copy()
    n_stale = lg.shape[1] - n_written
    if n_stale <= 0:
        return lg
    garbage = np.random.default_rng(0x5EED).uniform(1.0, 5.0, n_stale).astype(np.float32)
    lg[:, n_written:] = lg[:, :n_written].max(-1, keepdims=True) + garbage
    return lg


def _check_faults(faults):
    if isinstance(faults, str):
        faults = (faults,)
    faults = tuple(faults or ())
    for f in faults:
        if f not in FAULTS:
            raise ValueError(f"unknown fault {f!r}; known: {', '.join(FAULTS)}")
    return frozenset(faults)


# --------------------------------------------------------------------------------------------
# Entry points

def forward(model, ids, capture="*", logits="all", faults=()):
    """One pass over ids from position 0 -> Trace (source "reference").

    model: a RefModel, or a path / qwencuda.GGUFFile (loaded and cached, one at a time).
    capture: glob pattern(s) of capture names ("*" all, None nothing); logits: "all" or "last";
    faults: names of FAULTS to reproduce."""
    return RefSession(model, faults).prefill(ids, capture=capture, logits=logits)


def forward_steps(model, ids, n_prefill, capture="*", faults=()):
    """Prefill ids[:n_prefill] (logits "last"), then one step per remaining id -> list of Traces
    (1 + len(ids) - n_prefill of them). Reproduces decode-time behaviour (KV cache, positions)."""
    ids = [int(t) for t in np.asarray(ids).reshape(-1)]
    if not 1 <= n_prefill <= len(ids):
        raise ValueError(f"n_prefill must lie in [1, {len(ids)}]")
    s = RefSession(model, faults)
    traces = [s.prefill(ids[:n_prefill], capture=capture, logits="last")]
    for t in ids[n_prefill:]:
        traces.append(s.step(t, capture=capture))
    return traces


def greedy(model, ids, n_new, faults=(), stop=()):
    """Greedy decoding: prefill ids, then n_new argmax steps -> the new token ids (stops early
    after emitting a token in stop)."""
    s = RefSession(model, faults)
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
