"""Every backend op (csrc/engine/backend.h) on the CPU and CUDA backends, through qwencuda.kernels,
against NumPy float64 references (and the gguf package's dequantize for the block formats).

Tolerances, and why:
  - embed / dequantize: bit-exact with gguf.quants.dequantize (both engines decode with the same
    float32 operations in the same order).
  - matmul, fp32 paths (the CPU engine; CUDA with n <= 8 tokens, which reads the stored blocks;
    CUDA with F32 or BF16 weights at any n): |y - ref| <= 1e-5 * (|W| @ |x|) + 1e-6, i.e.
    relative to the sum of the magnitudes of the products, which is what fp32 rounding scales
    with (a plain relative error is meaningless where the dot product cancels).
  - matmul, CUDA f16 tensor-core path (n > 8 tokens, block formats and F16): activations and
    decoded weights are rounded to f16 (2^-11 relative): 2e-3 * (|W| @ |x|).
  - matmul, the CPU's 8-bit path (device "cpu" on a CPU with AVX2, weights Q4_0 / Q5_0 / Q8_0 /
    Q4_K / Q6_K; csrc/cpu/cpu_simd.h): x is rounded to d * q per block of 32 with
    d = max|x| / 127, so each x[i] moves by at most max|x_block| / 254, and the bound is exactly
    that: sum over blocks of max|x_b| / 254 * sum_b |W|, plus the fp32 term above. "cpu:float"
    is the float32 reference engine and keeps the fp32 bound. The CUDA GEMV of those types
    (n <= 8 tokens) quantizes x the same way (kernels/qc_gemv_q8.cuh) and has the same bound.
  - rmsnorm, rope, swiglu, add, attention: fp32 arithmetic, 1e-5 relative to the magnitude of
    the values involved (stated per test).
Shapes are odd on purpose (1, 3, 17, 130 rows or tokens; non-square weights; tokens on both sides
of the GEMV / cuBLAS switch at 8) so that the cuBLAS row/column-major mapping and every tail path
are exercised.
"""
import numpy as np
import pytest

import qwencuda
from qwencuda import kernels as K

gguf = pytest.importorskip("gguf")

PLAIN = ["F32", "F16", "BF16"]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ALL_TYPES = PLAIN + LEGACY + KQUANTS

# byte offsets of the f16 scale fields of each block (csrc/engine/quants.h), and whether a field is a
# "min" (which may be any sign) or a scale
_HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _default_cols(type_name):
    """A row length valid for the type and not a power of two where the type allows it."""
    if type_name in PLAIN:
        return 67          # odd: the unaligned, scalar tails of the plain types
    if type_name in LEGACY:
        return 96          # 3 blocks
    return 512             # 2 super-blocks


def random_weight(type_name, rows, cols, seed=0):
    """(Weight, float64 dequantized reference). Block formats get random bytes (every bit pattern
    of the codes and packed scales) with finite random f16 scales; the reference decode is the
    gguf package's."""
    rng = np.random.default_rng(seed)
    if type_name == "F32":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return K.Weight(w, "F32", (rows, cols)), w.astype(np.float64)
    if type_name == "F16":
        w = rng.standard_normal((rows, cols)).astype(np.float16)
        return K.Weight(w, "F16", (rows, cols)), w.astype(np.float64)
    if type_name == "BF16":
        bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        ref = (bits.astype(np.uint32) << 16).view(np.float32)
        return K.Weight(bits, "BF16", (rows, cols)), ref.astype(np.float64)
    qk, size = _BLOCK[type_name]
    nb = cols // qk
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    for off in _HALF_FIELDS[type_name]:
        h = (rng.standard_normal((rows, nb)) * 0.02).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(rows, nb, 2)
    raw = raw.reshape(rows, nb * size)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name))
    return K.Weight(raw, type_name, (rows, cols)), np.asarray(ref, dtype=np.float64).reshape(rows, cols)


def check_close(got, ref, scale, rtol, what=""):
    """|got - ref| <= rtol * scale + 1e-6 elementwise, with the first offenders in the message."""
    got = np.asarray(got, dtype=np.float64)
    err = np.abs(got - ref)
    bound = rtol * np.asarray(scale, dtype=np.float64) + 1e-6
    bad = np.argwhere(~(err <= bound))
    if bad.size:
        lines = [f"{what}: {len(bad)} of {err.size} values off (rtol {rtol}); first:"]
        for idx in bad[:5]:
            idx = tuple(idx)
            lines.append(f"  at {idx}: got {got[idx]!r}, ref {ref[idx]!r}, err {err[idx]:.3g}, bound {bound[idx] if np.ndim(bound) else bound:.3g}")
        pytest.fail("\n".join(lines))


def _f16_path(device, type_name, n):
    return device.startswith("cuda") and n > K.GEMV_MAX_TOKENS and type_name not in ("F32", "BF16")


@pytest.fixture(params=["cpu", "cpu:float", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("cuda:float", marks=pytest.mark.gpu)])
def device(request):
    """Every backend: the CPU's fast kernels ("cpu"), its float32 reference ops ("cpu:float"),
    CUDA with its 8-bit GEMV ("cuda") and with the float GEMV everywhere ("cuda:float"); the
    CUDA ones skip without a GPU."""
    return request.param


Q8_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K")


def _q8_path(device, type_name, n):
    """Whether this matmul runs with 8-bit activations: the CPU's fast kernels, and the CUDA GEMV
    of those types (kernels/qc_gemv_q8.cuh: n <= 8 tokens; "cuda:float" keeps fp32)."""
    if device.startswith("cuda"):
        return type_name in Q8_TYPES and n <= K.GEMV_MAX_TOKENS and not device.endswith(":float")
    return (device == "cpu" and type_name in Q8_TYPES
            and "q8 dot products" in qwencuda.build_info()["cpu_kernels"])


def matmul_err(device, type_name, n, x64, wref):
    """The allowed |y - x @ W.T| of a matmul (see the module docstring), shape (n, rows)."""
    scale = np.abs(x64) @ np.abs(wref).T
    if _q8_path(device, type_name, n):
        nb = x64.shape[-1] // 32
        amax = np.abs(x64.reshape(-1, nb, 32)).max(-1)               # (n, blocks)
        wsum = np.abs(wref).reshape(wref.shape[0], nb, 32).sum(-1)   # (rows, blocks)
        return (amax / 254) @ wsum.T * (1 + 1e-4) + 1e-5 * scale
    return (2e-3 if _f16_path(device, type_name, n) else 1e-5) * scale


# --------------------------------------------------------------------------------------------
# dequantize and embed: bit-exact


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_dequantize_bit_exact(device, type_name):
    w, ref = random_weight(type_name, 3, _default_cols(type_name), seed=1)
    got = K.dequantize(w, device=device)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got, ref.astype(np.float32))


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_embed(device, type_name):
    rows = 11
    w, ref = random_weight(type_name, rows, _default_cols(type_name), seed=2)
    ids = np.array([2, 0, 2, rows - 1, 5], dtype=np.int32)
    got = K.embed(w, ids, device=device)
    assert got.shape == (len(ids), ref.shape[1])
    np.testing.assert_array_equal(got, ref[ids].astype(np.float32))


# --------------------------------------------------------------------------------------------
# matmul


@pytest.mark.parametrize("n", [1, 3, 8, 9, 17, 130])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul(device, type_name, n):
    rows, cols = 130, _default_cols(type_name)
    w, wref = random_weight(type_name, rows, cols, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    bias = (rng.standard_normal(rows) * 10).astype(np.float32)   # Qwen2's biases are large
    got = K.matmul(w, x, bias=bias, device=device)
    assert got.shape == (n, rows) and got.dtype == np.float32
    x64 = x.astype(np.float64)
    ref = x64 @ wref.T + bias
    err = matmul_err(device, type_name, n, x64, wref) + 1e-5 * np.abs(bias)
    check_close(got, ref, err, 1.0, f"matmul {type_name} n={n} on {device}")
    # without bias too (the bias is fused into the GEMV and a separate add on cuBLAS)
    got_nb = K.matmul(w, x, device=device)
    check_close(got_nb, ref - bias, err, 1.0, f"matmul {type_name} n={n} no bias on {device}")


@pytest.mark.parametrize("n", [1, 9, 33])
@pytest.mark.parametrize("shape", [(1, 256), (7, 1024), (1000, 32), (33, 4096)])
@pytest.mark.parametrize("type_name", ["F32", "F16", "Q8_0"])
def test_matmul_nonsquare(device, type_name, shape, n):
    """Wide and tall weights: a swapped m/n/k or lda/ldc in the cuBLAS call cannot pass this."""
    rows, cols = shape
    w, wref = random_weight(type_name, rows, cols, seed=5)
    x = np.random.default_rng(6).standard_normal((n, cols)).astype(np.float32)
    got = K.matmul(w, x, device=device)
    x64 = x.astype(np.float64)
    check_close(got, x64 @ wref.T, matmul_err(device, type_name, n, x64, wref), 1.0,
                f"matmul {type_name} {shape} n={n}")


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul_long_rows(device, type_name, n):
    """Rows of 4864 columns (ffn_down of the 0.5B model): the CUDA GEMV deals a long row's
    parts to the four warps of a block and adds their sums; matmul_add takes the same path."""
    rows, cols = 37, 4864
    w, wref = random_weight(type_name, rows, cols, seed=11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    res = rng.standard_normal((n, rows)).astype(np.float32)
    x64 = x.astype(np.float64)
    got = K.matmul(w, x, device=device)
    check_close(got, x64 @ wref.T, matmul_err(device, type_name, n, x64, wref), 1.0,
                f"matmul {type_name} (37, 4864) n={n} on {device}")
    np.testing.assert_array_equal(K.matmul_add(w, x, res, device=device),
                                  K.add(res, got, device=device))


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("n", [1, 3, 9])
@pytest.mark.parametrize("type_name", ["F32", "F16", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_fused_norm_equals_rmsnorm_first(device, type_name, n, wide):
    """matmul_multi / matmul_swiglu with norm= equal rmsnorm followed by the op, bit for bit:
    a CUDA decode launch (n = 1) of float weights up to 1024 columns normalises in every block's
    shared memory with the rmsnorm kernel's own reduction order; wider rows (wide: 3584, the 7B
    dim) and other evals normalise into a scratch buffer first. 8-bit weights normalise and
    quantize once (qc_norm_row_scale, the same order again), at 3584 columns too."""
    cols = 3584 if wide else _default_cols(type_name)
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((n, cols)) * 3).astype(np.float32)
    nw = rng.standard_normal(cols).astype(np.float32)
    eps = 1e-6
    xn = K.rmsnorm(x, nw, eps=eps, device=device)
    ws = [random_weight(type_name, rows, cols, seed=30 + rows)[0] for rows in (19, 5, 7)]
    biases = [rng.standard_normal(w.shape[0]).astype(np.float32) for w in ws]
    got = K.matmul_multi(ws, x, biases, device=device, norm=nw, eps=eps)
    want = K.matmul_multi(ws, xn, biases, device=device)
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)
    wg, wu = ws[0], random_weight(type_name, 19, cols, seed=77)[0]
    np.testing.assert_array_equal(K.matmul_swiglu(wg, wu, x, device=device, norm=nw, eps=eps),
                                  K.matmul_swiglu(wg, wu, xn, device=device))
    with pytest.raises(ValueError, match="norm"):
        K.matmul_multi(ws, x, biases, device=device, norm=nw[:-1])


def test_matmul_vector_and_batch_shapes(device):
    w, wref = random_weight("Q8_0", 5, 64, seed=7)
    x = np.random.default_rng(8).standard_normal(64).astype(np.float32)
    y = K.matmul(w, x, device=device)
    assert y.shape == (5,)
    xb = np.stack([x, 2 * x]).reshape(1, 2, 64)
    yb = K.matmul(w, xb, device=device)
    assert yb.shape == (1, 2, 5)
    np.testing.assert_allclose(yb[0, 0], y, rtol=1e-6, atol=1e-6)


def test_matmul_from_gguf(device, tmp_path):
    """Weights straight from a GGUF file (qwencuda.testing's q4_k_m mix of Q5_0/Q8_0/Q4_K/Q6_K)."""
    from qwencuda.testing import write_model

    path = write_model(str(tmp_path / "tiny.gguf"), config="tiny", weight_type="q4_k_m")
    f = qwencuda.GGUFFile(path)
    rng = np.random.default_rng(9)
    seen = set()
    for name, info in f.tensors.items():
        if len(info.shape) != 2 or name == "token_embd.weight":
            continue
        seen.add(info.type)
        wref = f.tensor(name).astype(np.float64)
        x = rng.standard_normal((3, info.shape[1])).astype(np.float32)
        got = K.matmul((f, name), x, device=device)
        x64 = x.astype(np.float64)
        check_close(got, x64 @ wref.T, matmul_err(device, info.type, 3, x64, wref), 1.0,
                    f"{name} ({info.type})")
    assert len(seen) >= 2


# --------------------------------------------------------------------------------------------
# rmsnorm, rope, kv_store


@pytest.mark.parametrize("shape", [(1, 64), (3, 896), (17, 130), (130, 7), (2, 3584), (1, 5000), (2, 9000)])
def test_rmsnorm(device, shape):
    """Every row length class of the CUDA kernel: up to 8, 16 and 32 values per thread held in
    registers (2048, 4096, 8192), and the loop past that."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(shape[1])).astype(np.float32)
    eps = 1e-6
    got = K.rmsnorm(x, w, eps=eps, device=device)
    x64 = x.astype(np.float64)
    inv = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    ref = x64 * inv * w
    check_close(got, ref, np.abs(ref), 1e-5, f"rmsnorm {shape}")


def rope_ref(x, pos, theta):
    x = x.astype(np.float64)
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("positions", ["prefill", "late", "far"])
def test_rope(device, head_dim, positions):
    pos = {"prefill": np.arange(17), "late": np.array([4095, 130, 7]),
           "far": np.array([32767, 20000])}[positions].astype(np.int32)
    n_heads = 3
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((len(pos), n_heads, head_dim)) * 5).astype(np.float32)
    theta = 1e6
    got = K.rope(x, pos, theta=theta, device=device)
    ref = rope_ref(x, pos, theta)
    # fp32 rounding of the result, relative to the size of the rotated pair
    scale = np.sqrt(np.concatenate([x[..., :head_dim // 2] ** 2 + x[..., head_dim // 2:] ** 2] * 2, axis=-1))
    check_close(got, ref, scale, 1e-5, f"rope hd={head_dim} {positions}")
    assert np.array_equal(x, x)   # the input is not modified
    np.testing.assert_array_equal(K.rope(x, pos, theta=theta, device=device), got)


def test_kv_store(device):
    rng = np.random.default_rng(12)
    ctx, kv_dim, n = 20, 48, 3
    kc = rng.standard_normal((ctx, kv_dim)).astype(np.float32)
    vc = rng.standard_normal((ctx, kv_dim)).astype(np.float32)
    k = rng.standard_normal((n, kv_dim)).astype(np.float32)
    v = rng.standard_normal((n, kv_dim)).astype(np.float32)
    pos = np.array([5, 6, 19], dtype=np.int32)
    kc2, vc2 = K.kv_store(k, v, pos, kc, vc, device=device)
    ek, ev = kc.copy(), vc.copy()
    ek[pos], ev[pos] = k, v
    np.testing.assert_array_equal(kc2, ek)
    np.testing.assert_array_equal(vc2, ev)


# --------------------------------------------------------------------------------------------
# attention


def attention_ref(q, kc, vc, pos, n_head_kv, n_kv):
    n, n_head, hd = q.shape
    group = n_head // n_head_kv
    out = np.zeros((n, n_head * hd))
    scores = np.full((n_head, n, n_kv), -np.inf)
    probs = np.zeros((n_head, n, n_kv))
    k = kc.astype(np.float64).reshape(kc.shape[0], n_head_kv, hd)
    v = vc.astype(np.float64).reshape(vc.shape[0], n_head_kv, hd)
    for t in range(n):
        p = int(pos[t])
        for h in range(n_head):
            kv = h // group
            s = k[:p + 1, kv] @ q[t, h].astype(np.float64) / np.sqrt(hd)
            e = np.exp(s - s.max())
            pr = e / e.sum()
            scores[h, t, :p + 1] = s
            probs[h, t, :p + 1] = pr
            out[t, h * hd:(h + 1) * hd] = pr @ v[:p + 1, kv]
    return out, scores, probs


ATTN_CASES = {
    "prefill": np.arange(17),               # a prompt from position 0
    "decode": np.array([130]),              # one token late in the cache
    "chunk": 40 + np.arange(9),             # a second prefill chunk after 40 cached tokens
    "first": np.array([0]),                 # the very first token: one key
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ratio", [1, 2, 7])
def test_attention(device, ratio, head_dim, case):
    pos = ATTN_CASES[case].astype(np.int32)
    n_head_kv = 2
    n_head = n_head_kv * ratio
    n_kv = int(pos.max()) + 1
    ctx = n_kv + 5
    rng = np.random.default_rng(13)
    q = (rng.standard_normal((len(pos), n_head, head_dim)) * 2).astype(np.float32)
    kc = rng.standard_normal((ctx, n_head_kv * head_dim)).astype(np.float32)
    vc = rng.standard_normal((ctx, n_head_kv * head_dim)).astype(np.float32)
    # rows past the visible keys are never read: NaN there would poison any output that did
    kc[n_kv:] = np.nan
    vc[n_kv:] = np.nan
    out, scores, probs = K.attention(q, kc, vc, pos, n_head_kv, scores=True, device=device)
    ref_out, ref_s, ref_p = attention_ref(q, kc, vc, pos, n_head_kv, n_kv)
    assert out.shape == (len(pos), n_head * head_dim)
    assert scores.shape == probs.shape == (n_head, len(pos), n_kv)
    check_close(out, ref_out, np.max(np.abs(vc[:n_kv])), 1e-5, "attention out")
    masked = np.isinf(ref_s)
    assert np.array_equal(np.isneginf(scores), masked), "scores must be -inf exactly where masked"
    assert np.all(probs[masked] == 0), "probs must be 0 where masked"
    check_close(np.where(masked, 0, scores), np.where(masked, 0, ref_s), np.abs(ref_s[~masked]).max(), 1e-5, "scores")
    check_close(probs, ref_p, 1.0, 1e-5, "probs")
    # without scores the output is the same
    out2 = K.attention(q, kc, vc, pos, n_head_kv, device=device)
    check_close(out2, ref_out, np.max(np.abs(vc[:n_kv])), 1e-5, "attention out (no scores)")


def test_attention_small_head_dim_and_wide_n_kv(device):
    """head_dim 16 (the tiny test models) and n_kv beyond the last position (columns masked)."""
    rng = np.random.default_rng(14)
    pos = np.array([3, 4, 5], dtype=np.int32)
    n_head, n_head_kv, hd, n_kv = 4, 2, 16, 9
    q = rng.standard_normal((3, n_head, hd)).astype(np.float32)
    kc = rng.standard_normal((12, n_head_kv * hd)).astype(np.float32)
    vc = rng.standard_normal((12, n_head_kv * hd)).astype(np.float32)
    out, s, p = K.attention(q, kc, vc, pos, n_head_kv, n_kv=n_kv, scores=True, device=device)
    r_out, r_s, r_p = attention_ref(q, kc, vc, pos, n_head_kv, n_kv)
    check_close(out, r_out, np.abs(vc).max(), 1e-5, "out")
    assert np.array_equal(np.isneginf(s), np.isinf(r_s))
    check_close(p, r_p, 1.0, 1e-5, "probs")


# --------------------------------------------------------------------------------------------
# swiglu, add, argmax


@pytest.mark.parametrize("shape", [(1,), (3, 17), (130, 4864)])
def test_swiglu(device, shape):
    rng = np.random.default_rng(15)
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    got = K.swiglu(g, u, device=device)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    check_close(got, ref, np.abs(ref), 1e-5, "swiglu")
    # extremes stay finite: silu(-100) = -0, silu(100) = 100
    ext = K.swiglu(np.array([-100.0, 100.0, 0.0], np.float32), np.ones(3, np.float32), device=device)
    np.testing.assert_allclose(ext, [0.0, 100.0, 0.0], atol=1e-30)


@pytest.mark.parametrize("shape", [(1,), (3, 17), (130, 896)])
def test_add(device, shape):
    rng = np.random.default_rng(16)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(K.add(a, b, device=device), a + b)


@pytest.mark.parametrize("cols", [1, 7, 1000, 151936])
def test_argmax(device, cols):
    rng = np.random.default_rng(17)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    if cols > 2:
        # ties: the first of equal maxima wins
        x[1, cols // 3] = x[1, cols - 1] = 50.0
        x[2, :] = 1.0
    got = K.argmax(x, device=device)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))
    assert K.argmax(x[0], device=device) == int(np.argmax(x[0]))


# --------------------------------------------------------------------------------------------
# fused ops: against NumPy, and equal to the op sequences they replace
#
# Each fused op computes its sequence's float operations (csrc/engine/backend.h): the tests demand the
# same bits as the unfused ops on the CPU and on the CUDA GEMV path (n <= 8 tokens), where both
# run the same device functions, and for rope_kv_store everywhere. On the cuBLAS path (n > 8)
# matmul_multi and matmul_swiglu make the very cuBLAS calls of matmul, but cuBLAS does not
# promise the same kernel choice for other buffers, and matmul_add adds the residual inside the
# GEMM (beta = 1): there the fused ops are held to the matmul tolerance against NumPy.


def _compatible_types(cols):
    """The weight types whose rows can hold cols values (to mix types in one fused call)."""
    return [t for t in ALL_TYPES if cols % (_BLOCK[t][0] if t in _BLOCK else 1) == 0]


def _other_type(type_name, cols, k):
    types = _compatible_types(cols)
    return types[(types.index(type_name) + k) % len(types)]


def _gemv_path(device, n):
    return device.startswith("cpu") or n <= K.GEMV_MAX_TOKENS


@pytest.mark.parametrize("n", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul_add(device, type_name, n):
    rows, cols = 130, _default_cols(type_name)
    w, wref = random_weight(type_name, rows, cols, seed=30)
    rng = np.random.default_rng(31)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    res = (rng.standard_normal((n, rows)) * 4).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = res + x64 @ wref.T
    err = matmul_err(device, type_name, n, x64, wref) + 1e-5 * np.abs(res)
    for in_place in (True, False):
        got = K.matmul_add(w, x, res, device=device, in_place=in_place)
        assert got.shape == (n, rows) and got.dtype == np.float32
        check_close(got, ref, err, 1.0, f"matmul_add {type_name} n={n} in_place={in_place} on {device}")
        if _gemv_path(device, n):
            np.testing.assert_array_equal(got, K.add(res, K.matmul(w, x, device=device), device=device))
    assert K.matmul_add(w, x[0], res[0], device=device).shape == (rows,)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul_multi(device, type_name, n):
    """Three weights of different types and row counts (130, 17, 5: blocks of 4 rows end
    part-way), biases on two of them; the first weight's type runs through every type."""
    cols = _default_cols(type_name)
    types = [type_name, _other_type(type_name, cols, 1), _other_type(type_name, cols, 2)]
    shapes = [(130, cols), (17, cols), (5, cols)]
    pairs = [random_weight(t, r, c, seed=32 + i) for i, (t, (r, c)) in enumerate(zip(types, shapes))]
    rng = np.random.default_rng(35)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    biases = [(rng.standard_normal(130) * 10).astype(np.float32), None,
              (rng.standard_normal(5) * 10).astype(np.float32)]
    outs = K.matmul_multi([w for w, _ in pairs], x, biases, device=device)
    assert len(outs) == 3
    x64 = x.astype(np.float64)
    for i, ((w, wref), b, got, t) in enumerate(zip(pairs, biases, outs, types)):
        b64 = np.zeros(w.shape[0]) if b is None else b.astype(np.float64)
        assert got.shape == (n, w.shape[0]) and got.dtype == np.float32
        check_close(got, x64 @ wref.T + b64, matmul_err(device, t, n, x64, wref) + 1e-5 * np.abs(b64),
                    1.0, f"matmul_multi part {i} ({t}) n={n} on {device}")
        if _gemv_path(device, n):   # the same numbers as one matmul per weight
            np.testing.assert_array_equal(got, K.matmul(w, x, bias=b, device=device))


def test_matmul_multi_q4_k_m_mix(device, tmp_path):
    """q, k, v of qwencuda.testing's q4_k_m files (the real file's mix), with their biases."""
    from qwencuda.testing import write_model

    path = write_model(str(tmp_path / "m.gguf"), config="tiny-hd64", weight_type="q4_k_m")
    f = qwencuda.GGUFFile(path)
    names = [f"blk.0.attn_{p}.weight" for p in "qkv"]
    ws = [K.Weight.from_gguf(f, nm) for nm in names]
    biases = [f.tensor(nm.replace("weight", "bias")) for nm in names]
    rng = np.random.default_rng(36)
    assert len({w.type for w in ws}) >= 2, [w.type for w in ws]
    for n in (1, 5, 12):
        x = rng.standard_normal((n, ws[0].shape[1])).astype(np.float32)
        outs = K.matmul_multi(ws, x, biases, device=device)
        for w, b, got in zip(ws, biases, outs):
            want = K.matmul(w, x, bias=b, device=device)
            if _gemv_path(device, n):
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("n", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul_swiglu(device, type_name, n):
    rows, cols = 130, _default_cols(type_name)
    rng = np.random.default_rng(37)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x64 = x.astype(np.float64)
    # gate and up of one type, then of two types (a file may mix them)
    for up_type in (type_name, _other_type(type_name, cols, 1)):
        wg, gref = random_weight(type_name, rows, cols, seed=38)
        wu, uref = random_weight(up_type, rows, cols, seed=39)
        got = K.matmul_swiglu(wg, wu, x, device=device)
        assert got.shape == (n, rows) and got.dtype == np.float32
        g, u = x64 @ gref.T, x64 @ uref.T
        sg = 0.5 * (1 + np.tanh(0.5 * g))       # the logistic function, without overflow
        ref = g * sg * u
        # an error e_g in g moves silu(g) by at most 1.1 e_g; an error e_u in u moves act by
        # silu(g) e_u (and both together by 1.1 e_g e_u); silu itself is fp32 (1e-5 |act|)
        e_g, e_u = matmul_err(device, type_name, n, x64, gref), matmul_err(device, up_type, n, x64, uref)
        err = 1.1 * e_g * np.abs(u) + np.abs(g * sg) * e_u + 1.1 * e_g * e_u + 1e-5 * np.abs(ref)
        check_close(got, ref, err, 1.0, f"matmul_swiglu {type_name}/{up_type} n={n} on {device}")
        if _gemv_path(device, n):
            unfused = K.swiglu(K.matmul(wg, x, device=device), K.matmul(wu, x, device=device), device=device)
            np.testing.assert_array_equal(got, unfused)


# the decode step's o projection and gate/up: matmul_add told the norm of the matmul_swiglu next
# (backend.h, norm_next). On CUDA a one-token call of a 32-element 8-bit type hands out's
# normalised 8-bit form over (x * w quantized by the o projection's 32-row blocks, the norm's
# scale applied after the gate/up dot products: kernels/qc_gemv_q8.cuh), so act may round
# differently from matmul_swiglu's but stays within the same 8-bit error; everywhere else the
# pair is the two ops, bit for bit.
_HANDED_OVER = ("Q4_0", "Q5_0", "Q8_0")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("shape", ["small", "0.5b"])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul_add_swiglu(device, type_name, shape, n):
    dim, ffn = (96, 160) if shape == "small" else (896, 4864)
    if type_name in KQUANTS:
        dim = 256 if shape == "small" else 768
    cols = _default_cols(type_name)
    w, _ = random_weight(type_name, dim, cols, seed=40)
    wg, gref = random_weight(type_name, ffn, dim, seed=41)
    wu, uref = random_weight(type_name, ffn, dim, seed=42)
    rng = np.random.default_rng(43)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    res = (rng.standard_normal((n, dim)) * 4).astype(np.float32)
    nw = (1.0 + 0.5 * rng.standard_normal(dim)).astype(np.float32)
    eps = 1e-6
    out, act = K.matmul_add_swiglu(w, x, res, wg, wu, nw, eps=eps, device=device)
    assert out.shape == (n, dim) and act.shape == (n, ffn)
    np.testing.assert_array_equal(out, K.matmul_add(w, x, res, device=device))
    plain = K.matmul_swiglu(wg, wu, out, device=device, norm=nw, eps=eps)
    if not (device == "cuda" and n == 1 and type_name in _HANDED_OVER):
        np.testing.assert_array_equal(act, plain)
        return
    # the float64 reference of norm and gate/up on the op's own out, with test_matmul_swiglu's
    # error terms for the normalised x (the 8-bit error of x * w, times the scale, is that of
    # x * scale * w, block by block)
    o64 = out.astype(np.float64)
    xn = o64 / np.sqrt(np.mean(o64 * o64, axis=-1, keepdims=True) + eps) * nw
    g, u = xn @ gref.T, xn @ uref.T
    sg = 0.5 * (1 + np.tanh(0.5 * g))
    ref = g * sg * u
    e_g, e_u = matmul_err(device, type_name, n, xn, gref), matmul_err(device, type_name, n, xn, uref)
    err = 1.1 * e_g * np.abs(u) + np.abs(g * sg) * e_u + 1.1 * e_g * e_u + 1e-5 * np.abs(ref)
    check_close(act, ref, err, 1.0, f"matmul_add_swiglu {type_name} {shape} on {device}")
    # and the two roundings of the same values: no further apart than both errors
    check_close(act, plain, 2 * err, 1.0, f"matmul_add_swiglu {type_name} {shape} against matmul_swiglu")


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("positions", ["prefill", "late", "decode"])
@pytest.mark.parametrize("ratio", [1, 7])
def test_rope_kv_store(device, head_dim, positions, ratio):
    pos = {"prefill": np.arange(13), "late": np.array([4095, 130, 7]),
           "decode": np.array([1000])}[positions].astype(np.int32)
    n, n_head_kv = len(pos), 2
    n_head = n_head_kv * ratio
    ctx = int(pos.max()) + 3
    rng = np.random.default_rng(40)
    q = (rng.standard_normal((n, n_head, head_dim)) * 5).astype(np.float32)
    k = (rng.standard_normal((n, n_head_kv, head_dim)) * 5).astype(np.float32)
    v = rng.standard_normal((n, n_head_kv, head_dim)).astype(np.float32)
    kc = rng.standard_normal((ctx, n_head_kv * head_dim)).astype(np.float32)
    vc = rng.standard_normal((ctx, n_head_kv * head_dim)).astype(np.float32)
    keep = [a.copy() for a in (q, k, v, kc, vc)]
    q_rot, k_rot, kc2, vc2 = K.rope_kv_store(q, k, v, pos, kc, vc, theta=1e6, device=device)
    for a, b in zip((q, k, v, kc, vc), keep):
        np.testing.assert_array_equal(a, b)          # the inputs are not modified
    half = head_dim // 2

    def pair_scale(x):
        return np.sqrt(np.concatenate([x[..., :half] ** 2 + x[..., half:] ** 2] * 2, axis=-1))

    check_close(q_rot, rope_ref(q, pos, 1e6), pair_scale(q), 1e-5, "rope_kv_store q")
    check_close(k_rot, rope_ref(k, pos, 1e6), pair_scale(k), 1e-5, "rope_kv_store k")
    want_k, want_v = kc.copy(), vc.copy()
    want_k[pos], want_v[pos] = k_rot.reshape(n, -1), v.reshape(n, -1)
    np.testing.assert_array_equal(kc2, want_k)       # rows not at pos untouched
    np.testing.assert_array_equal(vc2, want_v)
    # the same bits as rope, rope, kv_store
    np.testing.assert_array_equal(q_rot, K.rope(q, pos, theta=1e6, device=device))
    np.testing.assert_array_equal(k_rot, K.rope(k, pos, theta=1e6, device=device))


@pytest.mark.parametrize("cache", ["f32", "f16+norm"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("head_dim", [6, 64, 128])
@pytest.mark.parametrize("type_name", ["F16", "Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_qkv_rope(device, type_name, head_dim, n, cache):
    """matmul_qkv_rope equals matmul_multi, then rope_kv_store, bit for bit: q, k and v of three
    types (the q4_k_m mix), 7 query heads a KV head, biases, an F32 or an F16 cache (with the
    attention norm folded in). One token on CUDA is the one-launch kernel whose blocks rotate
    the pairs they computed; head_dim 6 (pairs not in twos) and 3 tokens take the two ops."""
    cols, n_head_kv = 256, 2
    n_head = 7 * n_head_kv
    types = [type_name, _other_type(type_name, cols, 1), _other_type(type_name, cols, 2)]
    rows = [n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim]
    ws = [random_weight(t, r, cols, seed=50 + i)[0] for i, (t, r) in enumerate(zip(types, rows))]
    rng = np.random.default_rng(53)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    biases = [(rng.standard_normal(r) * 10).astype(np.float32) for r in rows]
    norm = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32) if cache.endswith("norm") else None
    dtype = np.float16 if cache.startswith("f16") else np.float32
    pos = np.array([4093, 5, 900][:n], np.int32)
    kc = rng.standard_normal((4100, n_head_kv * head_dim)).astype(dtype)
    vc = rng.standard_normal((4100, n_head_kv * head_dim)).astype(dtype)
    q, k, v, kc2, vc2 = K.matmul_qkv_rope(ws, x, biases, pos, kc, vc, head_dim, theta=1e6, device=device, norm=norm)
    assert q.shape == (n, n_head, head_dim) and k.shape == v.shape == (n, n_head_kv, head_dim)
    assert kc2.dtype == vc2.dtype == dtype
    q0, k0, v0 = K.matmul_multi(ws, x, biases, device=device, norm=norm)
    q1, k1, kc1, vc1 = K.rope_kv_store(q0.reshape(n, n_head, head_dim), k0.reshape(n, n_head_kv, head_dim),
                                       v0.reshape(n, n_head_kv, head_dim), pos, kc, vc, theta=1e6, device=device)
    np.testing.assert_array_equal(q, q1)
    np.testing.assert_array_equal(k, k1)
    np.testing.assert_array_equal(v, v0.reshape(v.shape))
    np.testing.assert_array_equal(kc2, kc1)
    np.testing.assert_array_equal(vc2, vc1)
    # and the rotation is RoPE's: q against the reference on the unrotated q
    check_close(q, rope_ref(q0.reshape(q.shape), pos, 1e6), np.abs(q0).max() + np.zeros(q.shape), 1e-5,
                "matmul_qkv_rope q")


_Q8_GEMV_TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]   # the 8-bit GEMV's (kernels/qc_gemv_q8.cuh)


@pytest.mark.parametrize("cache", ["f32", "f16", "f16+norm"])
@pytest.mark.parametrize("pos", [[0], [300], [2900], [4093], [2900, 5, 300]], ids=lambda p: "pos" + "-".join(map(str, p)))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("type_name", _Q8_GEMV_TYPES + ["F16"])
def test_qkv_attention(device, type_name, head_dim, pos, cache):
    """qkv_attention equals matmul_qkv_rope, then attention, bit for bit: q, k, v, both caches and
    the attention output. One token on CUDA, three 8-bit GEMV types and up to 3072 keys, is the
    one launch whose clusters compute their heads' rows themselves (the new key from shared
    memory, key 0 alone at position 0, a group's held keys and the loop after them at 300 and
    2900); 4093 keys (flash decode), three tokens and F16 weights take the two ops."""
    cols, n_head_kv = 256, 2
    n_head = 7 * n_head_kv
    if type_name in _Q8_GEMV_TYPES:
        k = _Q8_GEMV_TYPES.index(type_name)
        types = [type_name] + [_Q8_GEMV_TYPES[(k + i) % len(_Q8_GEMV_TYPES)] for i in (1, 2)]
    else:
        types = [type_name, _other_type(type_name, cols, 1), _other_type(type_name, cols, 2)]
    rows = [n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim]
    ws = [random_weight(t, r, cols, seed=60 + i)[0] for i, (t, r) in enumerate(zip(types, rows))]
    rng = np.random.default_rng(61)
    n = len(pos)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    biases = [(rng.standard_normal(r) * 3).astype(np.float32) for r in rows]
    norm = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32) if cache.endswith("norm") else None
    dtype = np.float16 if cache.startswith("f16") else np.float32
    pos = np.array(pos, np.int32)
    kc = rng.standard_normal((4100, n_head_kv * head_dim)).astype(dtype)
    vc = rng.standard_normal((4100, n_head_kv * head_dim)).astype(dtype)
    q, k, v, kc2, vc2, att = K.qkv_attention(ws, x, biases, pos, kc, vc, head_dim, theta=1e6, device=device,
                                             norm=norm)
    q1, k1, v1, kc1, vc1 = K.matmul_qkv_rope(ws, x, biases, pos, kc, vc, head_dim, theta=1e6, device=device,
                                             norm=norm)
    att1 = K.attention(q1, kc1, vc1, pos, n_head_kv, device=device)
    for got, want in ((q, q1), (k, k1), (v, v1), (kc2, kc1), (vc2, vc1), (att, att1)):
        np.testing.assert_array_equal(got, want)
    assert att.shape == (n, n_head * head_dim)
    # and the attention reads the new keys: att differs from attending the caches as they were
    assert not np.array_equal(att, K.attention(q1, kc, vc, pos, n_head_kv, device=device))


def test_qkv_attention_argument_errors():
    """qkv_attention's n_kv must cover every position and fit the cache."""
    w = K.Weight(np.ones((8, 32), np.float32), "F32", (8, 32))
    x, kc = np.ones((1, 32), np.float32), np.zeros((6, 8), np.float32)
    with pytest.raises(ValueError, match="n_kv"):
        K.qkv_attention([w, w, w], x, None, [3], kc, kc, head_dim=8, n_kv=3)
    with pytest.raises(ValueError, match="n_kv"):
        K.qkv_attention([w, w, w], x, None, [3], kc, kc, head_dim=8, n_kv=7)
    with pytest.raises(ValueError, match="n_kv"):
        K.qkv_attention([w, w, w], x, None, [3], kc, kc, head_dim=8, n_kv=0)
    q, _, _, _, _, att = K.qkv_attention([w, w, w], x, None, [3], kc, kc, head_dim=8)
    assert att.shape == (1, 8) and q.shape == (1, 1, 8)


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16])
def test_kv_stores_of_no_tokens(device, cache_dtype):
    """Zero tokens store nothing: the caches come back as they went (rope_kv_store returned
    uninitialised caches here once)."""
    rng = np.random.default_rng(41)
    kc = rng.standard_normal((5, 8)).astype(cache_dtype)
    vc = rng.standard_normal((5, 8)).astype(cache_dtype)
    none = np.zeros(0, np.int32)
    kc2, vc2 = K.kv_store(np.zeros((0, 8)), np.zeros((0, 8)), none, kc, vc, device=device)
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)
    q_rot, k_rot, kc2, vc2 = K.rope_kv_store(np.zeros((0, 4, 4)), np.zeros((0, 2, 4)), np.zeros((0, 2, 4)),
                                             none, kc, vc, device=device)
    assert q_rot.shape == (0, 4, 4) and k_rot.shape == (0, 2, 4)
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)
    assert kc2.dtype == vc2.dtype == cache_dtype


def test_fused_argument_errors():
    w, _ = random_weight("Q8_0", 4, 64)
    w2, _ = random_weight("Q8_0", 4, 96)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="residual"):
        K.matmul_add(w, x, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="columns"):
        K.matmul_add(w, np.zeros((2, 63), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="columns differ"):
        K.matmul_multi([w, w2], x)
    with pytest.raises(ValueError, match="1 to 3"):
        K.matmul_multi([w] * 4, x)
    with pytest.raises(ValueError, match="biases"):
        K.matmul_multi([w, w], x, [None])
    with pytest.raises(ValueError, match="bias 1"):
        K.matmul_multi([w, w], x, [None, np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="differ in shape"):
        K.matmul_swiglu(w, w2, x)
    # matmul_add_swiglu: w is (4, 64), so gate and up take 4 columns; a Q8_0 row needs 32
    wg, _ = random_weight("F32", 6, 4)
    res, nw = np.zeros((2, 4), np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="residual"):
        K.matmul_add_swiglu(w, x, np.zeros((2, 5), np.float32), wg, wg, nw)
    with pytest.raises(ValueError, match="gate"):
        K.matmul_add_swiglu(w, x, res, w2, w2, nw)
    with pytest.raises(ValueError, match="norm"):
        K.matmul_add_swiglu(w, x, res, wg, wg, np.ones(5, np.float32))
    with pytest.raises(ValueError, match="norm weight is required"):
        qwencuda._core.kernel_matmul_add_swiglu("cpu", w._arg(), x, res, wg._arg(), wg._arg(), None, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        qwencuda._core.kernel_matmul_add_swiglu("cpu", w._arg(), x, res, w2._arg(), w2._arg(), nw, 1e-6)
    q, kv = np.zeros((1, 4, 8), np.float32), np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match="positions"):
        K.rope_kv_store(q, kv, kv, [3], np.zeros((3, 16), np.float32), np.zeros((3, 16), np.float32))
    with pytest.raises(ValueError, match="caches"):
        K.rope_kv_store(q, kv, kv, [0], np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="even"):
        K.rope_kv_store(np.zeros((1, 4, 5), np.float32), np.zeros((1, 2, 5), np.float32),
                        np.zeros((1, 2, 5), np.float32), [0], np.zeros((3, 10), np.float32),
                        np.zeros((3, 10), np.float32))
    # matmul_qkv_rope: q (4 heads of 8), k and v (2 heads), caches of 3 rows
    wq, _ = random_weight("Q8_0", 32, 64)
    wkv, _ = random_weight("Q8_0", 16, 64)
    cache = np.zeros((3, 16), np.float32)
    with pytest.raises(ValueError, match="whole heads"):
        K.matmul_qkv_rope([wq, wkv, wkv], x[:1], None, [0], cache, cache, head_dim=6)
    with pytest.raises(ValueError, match="bias 2"):
        K.matmul_qkv_rope([wq, wkv, wkv], x[:1], [None, None, np.zeros(3, np.float32)], [0], cache, cache, 8)
    with pytest.raises(ValueError, match="caches"):
        K.matmul_qkv_rope([wq, wkv, wkv], x[:1], None, [0], np.zeros((3, 8), np.float32), cache, 8)
    with pytest.raises(ValueError, match="positions"):
        K.matmul_qkv_rope([wq, wkv, wkv], x[:1], None, [3], cache, cache, 8)
    # the C layer checks on its own what the Python layer checked (kernels.py's docstring)
    args = tuple(w._arg() for w in (wq, wkv, wkv))
    with pytest.raises(ValueError, match="bias 1"):
        qwencuda._core.kernel_matmul_qkv_rope("cpu", args, x[:1], (None, np.zeros(5, np.float32), None),
                                              np.zeros(1, np.int32), cache, cache, 8, 1e6)
    with pytest.raises(ValueError, match="whole heads"):
        qwencuda._core.kernel_matmul_qkv_rope("cpu", args, x[:1], (None,) * 3, np.zeros(1, np.int32), cache, cache,
                                              6, 1e6)
    with pytest.raises(ValueError, match="positions"):
        qwencuda._core.kernel_matmul_qkv_rope("cpu", args, x[:1], (None,) * 3, np.zeros(2, np.int32), cache, cache,
                                              8, 1e6)


# --------------------------------------------------------------------------------------------
# CUDA against the CPU engine, directly


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_cuda_matches_cpu_matmul(type_name):
    w, _ = random_weight(type_name, 130, _default_cols(type_name), seed=18)
    x = np.random.default_rng(19).standard_normal((3, w.shape[1])).astype(np.float32)
    a = K.matmul(w, x, device="cpu:float")   # the float32 reference (the CPU's 8-bit path differs)
    b = K.matmul(w, x, device="cuda:float")
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    if _q8_path("cpu", type_name, 3) and _q8_path("cuda", type_name, 3):
        # both quantize x to the same bytes (csrc/cpu/cpu_simd.h, kernels/qc_gemv_q8.cuh) and sum
        # exact integer products: only the float scaling and summation orders differ
        a8, b8 = K.matmul(w, x, device="cpu"), K.matmul(w, x, device="cuda")
        np.testing.assert_allclose(b8, a8, rtol=1e-4, atol=1e-4 * np.abs(a8).max())


@pytest.mark.gpu
def test_cuda_matches_cpu_attention():
    rng = np.random.default_rng(20)
    pos = np.arange(33, dtype=np.int32)
    q = rng.standard_normal((33, 14, 64)).astype(np.float32)
    kc = rng.standard_normal((40, 128)).astype(np.float32)
    vc = rng.standard_normal((40, 128)).astype(np.float32)
    a = K.attention(q, kc, vc, pos, 2, scores=True, device="cpu")
    b = K.attention(q, kc, vc, pos, 2, scores=True, device="cuda")
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# errors


def test_argument_errors():
    w, _ = random_weight("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="64 columns"):
        K.matmul(w, np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError, match="bias"):
        K.matmul(w, np.zeros(64, np.float32), bias=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="bytes"):
        K.Weight(np.zeros(10, np.uint8), "Q8_0", (4, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        K.Weight(np.zeros(10, np.uint8), "Q8_0", (1, 40))
    with pytest.raises(ValueError, match="unknown weight type"):
        K.Weight(np.zeros(10, np.uint8), "Q9_9", (1, 40))
    with pytest.raises(ValueError, match="ids"):
        K.embed(w, [4])
    with pytest.raises(ValueError):
        K.rmsnorm(np.zeros((2, 5), np.float32), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="even"):
        K.rope(np.zeros((1, 2, 5), np.float32), [0])
    with pytest.raises(ValueError, match="multiple"):
        K.attention(np.zeros((1, 3, 4), np.float32), np.zeros((2, 8), np.float32),
                    np.zeros((2, 8), np.float32), [0], n_head_kv=2)
    with pytest.raises(ValueError, match="n_kv"):
        K.attention(np.zeros((1, 2, 4), np.float32), np.zeros((2, 8), np.float32),
                    np.zeros((2, 8), np.float32), [5], n_head_kv=2)
    with pytest.raises(ValueError, match="positions"):
        K.kv_store(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), [3],
                   np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError):
        K.add(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        K.matmul("not a weight", np.zeros(3, np.float32))


def test_bad_cuda_device_is_a_cuda_error():
    """No GPU (or a CPU-only build): device='cuda' raises CudaError; with GPUs, an ordinal past
    the last one does."""
    info = qwencuda.build_info()
    a = np.ones(3, np.float32)
    if info["cuda"] and info["cuda_devices"] > 0:
        with pytest.raises(qwencuda.CudaError, match=f"cuda:{info['cuda_devices']}"):
            K.add(a, a, device=f"cuda:{info['cuda_devices']}")
    else:
        with pytest.raises(qwencuda.CudaError):
            K.add(a, a, device="cuda")
    with pytest.raises(ValueError, match="unknown device"):
        K.add(a, a, device="tpu")


@pytest.mark.gpu
def test_release_and_recreate():
    a = np.ones(5, np.float32)
    np.testing.assert_array_equal(K.add(a, a, device="cuda"), 2 * a)
    K.release("cuda")
    np.testing.assert_array_equal(K.add(a, a, device="cuda"), 2 * a)
    free, total = K.cuda_mem_info(0)
    assert 0 < free <= total


def test_time_matmul(device):
    """The timing entry point of scripts/kernel_bench.py runs the same op."""
    w, _ = random_weight("Q4_K", 16, 256, seed=21)
    x = np.ones((1, 256), np.float32)
    s = K.time_matmul(w, x, iters=3, device=device)
    assert 0 < s < 10
