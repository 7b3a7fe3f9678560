"""Kernel tests that can see every parameter (issue 19 item 4).

The audit found test_rmsnorm feeding inputs of std 3, where eps = 1e-6 and eps = 1e-5 give the
same result to 1e-7: an eps bug passed it. Here every parameter is exercised where it matters, and
each test first shows that it does: the NumPy expectation with the parameter changed (eps x10,
theta x2, the GQA map h % n_head_kv instead of h // group, the attention scale of another head_dim,
a position off by one, the bias left out) differs from the right one by at least 20 times the
tolerance, so a kernel with that bug cannot pass.

  rmsnorm (and the norm folded into matmul_multi / matmul_swiglu): rows of rms 1e-3 .. 3e-3, where
      eps 1e-6 is 10% .. 100% of the mean square;
  rope (and rope_kv_store): theta 1e4, 1e6 and 2e6 at positions up to 32767, where theta x2
      turns every pair's angle by up to radians;
  attention: 4 KV heads, 3 query heads each (heads 0..11 read KV 0,0,0,1,1,1,...), KV heads of
      different scales; head_dim 16 / 64 / 128 (scale 1/sqrt(head_dim)); a chunk at positions
      37.. so that a query reads exactly keys 0..pos;
  matmul: a bias of size tens (Qwen2's q/k biases) next to small products.
"""
import numpy as np
import pytest

from qwencuda import kernels as K

SEE = 20.0     # a wrong parameter must move the expectation by at least SEE x the tolerance


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_sees(right, wrong, tol, what):
    moved = rel(wrong, right)
    assert moved >= SEE * tol, f"the test cannot see {what}: it moves the result by {moved:.1e} only"


# ------------------------------------------------------------------------------------ rmsnorm

def rmsnorm_ref(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def small_rows(shape, seed):
    """Rows of rms 1e-3 .. 3e-3 (mean squares 1e-6 .. 1e-5: the size of eps)."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(1e-3, 3e-3, shape[0])[:, None]
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@pytest.mark.parametrize("shape", [(5, 896), (3, 64), (2, 4864)])
def test_rmsnorm_sees_eps(device, shape, eps):
    x = small_rows(shape, 1)
    w = (1 + 0.1 * np.random.default_rng(2).standard_normal(shape[1])).astype(np.float32)
    tol = 1e-5
    want = rmsnorm_ref(x, w, eps)
    assert_sees(want, rmsnorm_ref(x, w, eps * 10), tol, "eps x10")
    assert_sees(want, rmsnorm_ref(x, w, eps / 10), tol, "eps / 10")
    assert rel(K.rmsnorm(x, w, eps=eps, device=device), want) <= tol


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_fused_norms_see_eps(device, eps):
    """matmul_multi / matmul_swiglu with norm=: x is RMS-normalised with eps first."""
    rng = np.random.default_rng(3)
    x = small_rows((3, 256), 4)
    nw = (1 + 0.1 * rng.standard_normal(256)).astype(np.float32)
    Ws = [rng.standard_normal((r, 256)).astype(np.float32) * 0.05 for r in (64, 32, 32)]
    weights = [K.Weight.from_float(W, "F32") for W in Ws]
    xn = rmsnorm_ref(x, nw, eps)
    tol = 1e-4
    outs = K.matmul_multi(weights, x, None, norm=nw, eps=eps, device=device)
    for W, got in zip(Ws, outs):
        want = xn @ W.T.astype(np.float64)
        assert_sees(want, rmsnorm_ref(x, nw, eps * 10) @ W.T.astype(np.float64), tol, "eps x10")
        assert rel(got, want) <= tol
    g, u = xn @ Ws[1].T.astype(np.float64), xn @ Ws[2].T.astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    got = K.matmul_swiglu(weights[1], weights[2], x, norm=nw, eps=eps, device=device)
    assert rel(got, want) <= tol


# --------------------------------------------------------------------------------------- rope

def rope_ref(x, pos, theta):
    x = x.astype(np.float64)
    half = x.shape[-1] // 2
    ang = np.asarray(pos, np.float64)[:, None] * theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rope_interleaved(x, pos, theta):
    """GPT-J pairs (2i, 2i+1): the wrong pairing for Qwen2."""
    x = x.astype(np.float64)
    hd = x.shape[-1]
    ang = np.asarray(pos, np.float64)[:, None] * theta ** (-np.arange(hd // 2) * 2.0 / hd)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


POSITIONS = np.array([0, 1, 37, 1000, 4095, 32767], np.int32)


@pytest.mark.parametrize("theta", [1e4, 1e6, 2e6])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_sees_theta_positions_and_pairs(device, theta, head_dim):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((len(POSITIONS), 3, head_dim)) * 5).astype(np.float32)
    want = rope_ref(x, POSITIONS, theta)
    tol = 2e-5     # fp32 angles of positions up to 32767 (the reference is float64)
    assert_sees(want, rope_ref(x, POSITIONS, 2 * theta), tol, "theta x2")
    assert_sees(want, rope_ref(x, POSITIONS + 1, theta), tol, "positions + 1")
    assert_sees(want, rope_interleaved(x, POSITIONS, theta), tol, "GPT-J pairs")
    assert rel(K.rope(x, POSITIONS, theta=theta, device=device), want) <= tol


@pytest.mark.parametrize("theta", [1e4, 2e6])
def test_rope_kv_store_sees_theta(device, theta):
    rng = np.random.default_rng(6)
    hd, n_head, n_kv_head, ctx = 64, 6, 2, 4100
    pos = np.array([4090, 4091, 4095], np.int32)
    q = (rng.standard_normal((3, n_head, hd)) * 5).astype(np.float32)
    k = (rng.standard_normal((3, n_kv_head, hd)) * 5).astype(np.float32)
    v = rng.standard_normal((3, n_kv_head, hd)).astype(np.float32)
    kc = np.zeros((ctx, n_kv_head * hd), np.float32)
    vc = np.zeros_like(kc)
    q_rope, k_rope, kc2, vc2 = K.rope_kv_store(q, k, v, pos, kc, vc, theta=theta, device=device)
    tol = 2e-5
    for got, x in ((q_rope, q), (k_rope, k)):
        want = rope_ref(x, pos, theta)
        assert_sees(want, rope_ref(x, pos, 2 * theta), tol, "theta x2")
        assert rel(got, want) <= tol
    assert rel(kc2[pos].reshape(3, n_kv_head, hd), rope_ref(k, pos, theta)) <= tol
    np.testing.assert_array_equal(vc2[pos].reshape(3, n_kv_head, hd), v)
    rest = np.setdiff1d(np.arange(ctx), pos)
    assert not kc2[rest].any() and not vc2[rest].any()


# ---------------------------------------------------------------------------------- attention

def attention_ref(q, kc, vc, pos, n_head_kv, kv_of=None, scale=None, shift=0):
    n, n_head, hd = q.shape
    group = n_head // n_head_kv
    kv_of = kv_of or (lambda h: h // group)
    scale = 1 / np.sqrt(hd) if scale is None else scale
    k = kc.astype(np.float64).reshape(kc.shape[0], n_head_kv, hd)
    v = vc.astype(np.float64).reshape(vc.shape[0], n_head_kv, hd)
    out = np.zeros((n, n_head * hd))
    for t in range(n):
        last = int(pos[t]) + shift
        for h in range(n_head):
            s = k[:last + 1, kv_of(h)] @ q[t, h].astype(np.float64) * scale
            e = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = (e / e.sum()) @ v[:last + 1, kv_of(h)]
    return out


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_attention_sees_gqa_map_scale_and_positions(device, head_dim):
    n_head_kv, group = 4, 3
    n_head = n_head_kv * group
    pos = (37 + np.arange(5)).astype(np.int32)          # a chunk after 37 cached tokens
    ctx = 48
    rng = np.random.default_rng(7)
    q = (rng.standard_normal((len(pos), n_head, head_dim)) * 1.5).astype(np.float32)
    kv_scale = np.repeat(np.array([0.5, 1.0, 2.0, 4.0]), head_dim)   # each KV head its own scale
    kc = (rng.standard_normal((ctx, n_head_kv * head_dim)) * kv_scale).astype(np.float32)
    vc = (rng.standard_normal((ctx, n_head_kv * head_dim)) * kv_scale).astype(np.float32)
    want = attention_ref(q, kc, vc, pos, n_head_kv)
    tol = 1e-5
    assert_sees(want, attention_ref(q, kc, vc, pos, n_head_kv, kv_of=lambda h: h % n_head_kv), tol,
                "the GQA map h % n_head_kv")
    assert_sees(want, attention_ref(q, kc, vc, pos, n_head_kv, scale=1 / np.sqrt(2 * head_dim)), tol,
                "the scale 1/sqrt(2 head_dim)")
    assert_sees(want, attention_ref(q, kc, vc, pos, n_head_kv, scale=1.0), tol, "no scale")
    assert_sees(want, attention_ref(q, kc, vc, pos, n_head_kv, shift=-1), tol, "keys 0..pos-1")
    assert_sees(want, attention_ref(q, kc, vc, pos, n_head_kv, shift=1), tol, "keys 0..pos+1")
    got = K.attention(q, kc, vc, pos, n_head_kv, device=device)
    assert rel(got, want) <= tol


# ------------------------------------------------------------------------------------- matmul

def test_matmul_sees_the_bias(device):
    rng = np.random.default_rng(8)
    W = (rng.standard_normal((96, 128)) * 0.05).astype(np.float32)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    b = (rng.standard_normal(96) * 20).astype(np.float32)          # Qwen2's q/k biases: tens
    want = x.astype(np.float64) @ W.T.astype(np.float64) + b
    tol = 1e-5
    assert_sees(want, want - b, tol, "the bias")
    got = K.matmul(K.Weight.from_float(W, "F32"), x, bias=b, device=device)
    assert rel(got, want) <= tol
