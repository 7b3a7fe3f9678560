"""Checking hand-written kernels against a correct engine, tensor by tensor.

This is what a user of qwencuda writes: their own RMSNorm and RoPE (here in NumPy; in real life
the kernels of their engine, called on the same inputs), fed with qwencuda's captured inputs of a
layer and checked against qwencuda's captured outputs. The fixtures come from qwencuda's pytest
plugin (installed with qwencuda); run with

    pytest examples/test_my_kernels.py

A mismatch fails with qwencuda's compare report: the tensor's name, relative error, cosine, the
worst elements and hints, instead of a bare "arrays are not equal".
"""
import numpy as np
import pytest

import qwencuda
from qwencuda.debug.compare import assert_matches


# ---- the user's kernels ----------------------------------------------------------------------

def rmsnorm(x, weight, eps):
    """x (n, dim) -> x / sqrt(mean(x^2) + eps) * weight, statistics in float32."""
    x = x.astype(np.float32)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + np.float32(eps)) * weight


def rope(x, positions, theta):
    """x (n, heads, head_dim) rotated NEOX style: dimension i pairs with i + head_dim/2."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    freqs = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)
    angles = np.asarray(positions, np.float64)[:, None] * freqs[None, :]     # (n, half)
    cos = np.cos(angles)[:, None, :]
    sin = np.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)


# ---- the model's hyperparameters and weights, read from the GGUF -----------------------------

@pytest.fixture(scope="module")
def gguf(qwencuda_tiny_model):
    with qwencuda.GGUFFile(qwencuda_tiny_model) as f:
        meta = f.metadata
        yield {
            "n_layer": meta["qwen2.block_count"],
            "eps": meta["qwen2.attention.layer_norm_rms_epsilon"],
            "theta": meta["qwen2.rope.freq_base"],
            "attn_norm": [f.tensor(f"blk.{L}.attn_norm.weight") for L in range(meta["qwen2.block_count"])],
            "ffn_norm": [f.tensor(f"blk.{L}.ffn_norm.weight") for L in range(meta["qwen2.block_count"])],
            "output_norm": f.tensor("output_norm.weight"),
        }


# ---- the checks ------------------------------------------------------------------------------

def test_rmsnorm_before_attention(qwencuda_trace, gguf):
    tr = qwencuda_trace
    for L in range(gguf["n_layer"]):
        x = tr["embed"] if L == 0 else tr[f"blk.{L - 1}.resid_out"]
        assert_matches(rmsnorm(x, gguf["attn_norm"][L], gguf["eps"]), f"blk.{L}.attn_norm", tr,
                       rtol=1e-4, atol=1e-5)


def test_rmsnorm_before_ffn_and_output(qwencuda_trace, gguf):
    tr = qwencuda_trace
    for L in range(gguf["n_layer"]):
        assert_matches(rmsnorm(tr[f"blk.{L}.resid_mid"], gguf["ffn_norm"][L], gguf["eps"]),
                       f"blk.{L}.ffn_norm", tr, rtol=1e-4, atol=1e-5)
    last = tr[f"blk.{gguf['n_layer'] - 1}.resid_out"]
    assert_matches(rmsnorm(last, gguf["output_norm"], gguf["eps"]), "output_norm", tr,
                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["q", "k"])
def test_rope(qwencuda_trace, gguf, which):
    tr = qwencuda_trace
    for L in range(gguf["n_layer"]):
        mine = rope(tr[f"blk.{L}.{which}"], tr.positions, gguf["theta"])
        assert_matches(mine, f"blk.{L}.{which}_rope", tr, rtol=1e-4, atol=1e-4)
