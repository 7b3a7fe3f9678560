"""Known engine bugs, reproduced on the NumPy reference: the bug simulator of qwencuda.diagnose.

    tr = qwencuda.reference.forward(ref, ids, faults=("no_qkv_bias",))   # the usual way in
    s = qwencuda.reference.FaultySession(ref, ("kv_pos_stuck",)); s.prefill(ids); s.step(t)

The reference (qwencuda/reference/__init__.py) is the correct maths only; its session runs the forward
pass as a sequence of named steps (positions, rmsnorm, rope, matrix, bias, kv_head, store,
scores, softmax, mix, lm_head, logits) with the file's eps and theta as attributes. `Faults`
below is a mixin that overrides those steps where a fault asks for it and otherwise defers
to the reference (reference.FaultySession = Faults + RefSession). This module imports NumPy
only, never the reference: the reference imports it.

FAULTS: name -> what the bug does. Each fault changes only what its description says.
FIRST_AFFECTED: name -> the first capture, in forward order, whose values (or shape) it changes
on a prompt of several tokens.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["FAULTS", "FIRST_AFFECTED", "Faults", "check"]

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


def check(faults) -> frozenset:
    """faults (a name or names of FAULTS, or None) -> frozenset; ValueError for an unknown name."""
    if isinstance(faults, str):
        faults = (faults,)
    faults = tuple(faults or ())
    for f in faults:
        if f not in FAULTS:
            raise ValueError(f"unknown fault {f!r}; known: {', '.join(FAULTS)}")
    return frozenset(faults)


# --------------------------------------------------------------------------------------------
# The buggy versions of the reference's maths

def as_column_major(w):
    """The (out, in) buffer read as if it were column-major (out, in): reshape(in, out).T."""
    out, inn = w.shape
    return np.ascontiguousarray(w.reshape(inn, out).T)


def rmsnorm_no_mean(x, w, eps):
    """x * w / sqrt(sum(x^2) + eps): the mean forgotten; statistics in float64."""
    x64 = x.astype(np.float64)
    ss = (x64 * x64).sum(-1, keepdims=True)
    return (x64 / np.sqrt(ss + eps) * w.astype(np.float64)).astype(np.float32)


def rope_interleaved(x, pos, theta):
    """RoPE on GPT-J pairs (2i, 2i+1) with the NEOX angles pos * theta^(-2i/hd), float64."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(hd // 2, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]          # (n, hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]       # (n, 1, hd/2)
    x = x.astype(np.float64)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out.astype(np.float32)


def unwritten(logits, n_written):
    """Columns >= n_written hold stale garbage above every written logit of the row."""
    lg = logits.copy()
    n_stale = lg.shape[1] - n_written
    if n_stale <= 0:
        return lg
    garbage = np.random.default_rng(0x5EED).uniform(1.0, 5.0, n_stale).astype(np.float32)
    lg[:, n_written:] = lg[:, :n_written].max(-1, keepdims=True) + garbage
    return lg


# --------------------------------------------------------------------------------------------
# The steps of reference.RefSession, overridden where a fault asks

class Faults:
    """Mixin before reference.RefSession: Faults(model, faults, max_context=None). Each step
    reproduces the faults that touch it and otherwise runs the reference's own step.
    With kv_pos_stuck the session still counts position, but every token runs at position 0
    (the traces' positions are all 0) and overwrites cache slot 0."""

    def __init__(self, model, faults=(), max_context=None):
        self.faults = check(faults)
        super().__init__(model, max_context=max_context)
        if "rmsnorm_eps_1e-5" in self.faults:
            self.eps = 1e-5
        if "rope_base_1e4" in self.faults:
            self.theta = 10000.0

    def _positions(self, n):
        if "kv_pos_stuck" in self.faults:
            return np.zeros(n, np.int64)
        return super()._positions(n)

    def _rmsnorm(self, x, w):
        if "rmsnorm_no_mean" in self.faults:
            return rmsnorm_no_mean(x, w, self.eps)
        return super()._rmsnorm(x, w)

    def _rope(self, x, pos):
        if "rope_interleaved" in self.faults:
            return rope_interleaved(x, pos, self.theta)
        return super()._rope(x, pos)

    def _matrix(self, name):
        w = super()._matrix(name)
        return as_column_major(w) if "transposed_weights" in self.faults else w

    def _bias(self, name):
        b = super()._bias(name)
        return np.zeros_like(b) if "no_qkv_bias" in self.faults else b

    def _kv_head(self):
        c = self.model.config
        if "gqa_wrong_mapping" in self.faults:
            return np.arange(c.n_head) % c.n_head_kv
        return super()._kv_head()

    # kv_pos_stuck: every token alone at slot 0, so each query sees exactly its own key and value

    def _store(self, layer, k, v):
        if "kv_pos_stuck" not in self.faults:
            return super()._store(layer, k, v)
        c = self.model.config
        ck, cv = self._k[layer], self._v[layer]
        if len(ck) == 0:
            ck = np.zeros((1, c.n_head_kv, c.head_dim), np.float32)
            cv = np.zeros_like(ck)
        ck, cv = ck.copy(), cv.copy()
        ck[0], cv[0] = k[-1], v[-1]
        self._k[layer], self._v[layer] = ck, cv

    def _scores(self, layer, q, k, pos):
        if "kv_pos_stuck" not in self.faults:
            return super()._scores(layer, q, k, pos)
        c = self.model.config
        kh = k[:, self._kv_head(), :].astype(np.float64)                      # (n, H, hd)
        return np.einsum("nhd,nhd->hn", q.astype(np.float64), kh)[:, :, None] * (1.0 / math.sqrt(c.head_dim))

    def _mix(self, layer, probs, v):
        if "kv_pos_stuck" not in self.faults:
            return super()._mix(layer, probs, v)
        vh = v[:, self._kv_head(), :].astype(np.float64)                      # (n, H, hd)
        return np.asarray(probs, np.float64)[:, :, 0].T[:, :, None] * vh

    def _lm_head(self):
        head = super()._lm_head()
        return as_column_major(head) if "lm_head_wrong_ld" in self.faults else head

    def _logits(self, lg):
        lg = super()._logits(lg)
        return unwritten(lg, self.model.n_written) if "argmax_unwritten" in self.faults else lg
