"""Block formats (csrc/engine/quants.c) against an independent oracle: the `gguf` package
(llama.cpp's own Python reader), gguf.quants.dequantize / quantize and GGML_QUANT_SIZES.

Dequantization must be bit-exact (compared as uint32 bit patterns). The row dot product
qc_dot_row (the CPU matmul's inner loop) is compared with a float64 NumPy dot of the
dequantized row; see test_dot_row_random for the tolerance.
"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402

from qwencuda import _core  # noqa: E402

SUPPORTED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# Byte offsets of the fp16 scale fields inside one block (from the block layouts in quants.h).
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
# (rows, blocks per row): one block, many rows, odd row counts.
SHAPES = [(1, 1), (37, 1), (5, 3), (64, 2), (3, 7)]


def sizes(name):
    return GGML_QUANT_SIZES[T[name]]


def random_raw(name, rows, blocks, rng):
    """Stored bytes of a (rows, blocks * block_size) tensor: random bytes everywhere (every
    code and packed scale pattern occurs) except the fp16 scales, which are finite."""
    bs, ts = sizes(name)
    if name == "F32":
        return rng.standard_normal((rows, blocks * bs)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return (rng.standard_normal((rows, blocks * bs)) * 10).astype(np.float16).view(np.uint8)
    if name == "BF16":  # the top halves of float32 normals (bf16 is a truncated float32)
        x = (rng.standard_normal((rows, blocks * bs)) * 10).astype(np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, blocks, ts), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        # magnitudes over many binades, including fp16 subnormals, zeros and both signs
        h = (rng.standard_normal((rows, blocks)) * 10.0 ** rng.integers(-7, 2, (rows, blocks)))
        raw[:, :, off:off + 2] = h.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * ts)


def assert_bits_equal(got, ref):
    assert got.dtype == np.float32 and got.shape == ref.shape
    ref = np.ascontiguousarray(ref, dtype=np.float32)
    bad = np.flatnonzero(got.view(np.uint32).ravel() != ref.view(np.uint32).ravel())
    assert bad.size == 0, (f"{bad.size} of {ref.size} values differ; first at flat index {bad[0]}: "
                           f"got {got.ravel()[bad[0]]!r}, gguf {ref.ravel()[bad[0]]!r}")


# ---- the traits table ---------------------------------------------------------------------

def test_type_info_matches_gguf_sizes():
    info = {d["value"]: d for d in _core.type_info()}
    for t, (bs, ts) in GGML_QUANT_SIZES.items():
        if t.value not in info:
            pytest.fail(f"type_info lacks {t.name} ({t.value})")
        d = info[t.value]
        assert d["name"] == t.name
        assert (d["block_size"], d["type_size"]) == (bs, ts), t.name
    assert sorted(d["name"] for d in info.values() if d["supported"]) == sorted(SUPPORTED)
    # removed types are listed with type_size 0 and never supported
    for v in (4, 5, 31, 32, 33, 36, 37, 38):
        assert info[v]["type_size"] == 0 and not info[v]["supported"]


# ---- dequantize: bit-exact with gguf ----------------------------------------------------------

@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("rows,blocks", SHAPES)
def test_dequantize_random_bytes(name, rows, blocks):
    rng = np.random.default_rng(hash((name, rows, blocks)) % 2**32)
    raw = random_raw(name, rows, blocks, rng)
    ref = gguf_dequantize(raw, T[name])
    got = _core.dequantize(raw, name, (rows, blocks * sizes(name)[0]))
    assert_bits_equal(got, ref)


@pytest.mark.parametrize("name", LEGACY)
def test_dequantize_gguf_quantized(name):
    """Blocks as a real quantizer writes them (gguf.quants.quantize of Gaussian data)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((9, 160)) * np.exp(rng.standard_normal((9, 1)))).astype(np.float32)
    raw = gguf_quantize(x, T[name])
    ref = gguf_dequantize(raw, T[name])
    assert_bits_equal(_core.dequantize(raw, name, x.shape), ref)
    # and the quantization itself is sane: legacy formats keep ~1-8 bits of precision
    assert np.abs(ref - x).max() <= 0.2 * np.abs(x).max()


def test_f16_every_value():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = _core.dequantize(h, "F16", h.shape)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert_bits_equal(got[~nan], ref[~nan])


def test_bf16_every_value():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert_bits_equal(_core.dequantize(h, "BF16", h.shape), gguf_dequantize(h.view(np.uint8), T.BF16))


def test_dequantize_3d_shape_and_arguments():
    rng = np.random.default_rng(3)
    raw = random_raw("Q6_K", 6, 2, rng)
    ref = gguf_dequantize(raw, T.Q6_K).reshape(2, 3, 512)
    assert_bits_equal(_core.dequantize(raw, "Q6_K", (2, 3, 512)), ref)
    assert_bits_equal(_core.dequantize(raw, 14, [2, 3, 512]), ref)              # int type
    assert_bits_equal(_core.dequantize(raw, T.Q6_K, (2, 3, 512)), ref)          # IntEnum
    assert_bits_equal(_core.dequantize(raw, "q6_k", (2, 3, 512)), ref)          # any case
    assert_bits_equal(_core.dequantize(raw.tobytes(), "Q6_K", (2, 3, 512)), ref)  # bytes
    assert_bits_equal(_core.dequantize(memoryview(raw.tobytes()), "Q6_K", (6, 512)),
                      ref.reshape(6, 512))
    # a non-contiguous row selection and a misaligned buffer are both fine
    assert_bits_equal(_core.dequantize(raw[::2], "Q6_K", (3, 512)), ref.reshape(6, 512)[::2])
    buf = np.zeros(raw.size + 1, np.uint8)
    buf[1:] = raw.ravel()
    assert_bits_equal(_core.dequantize(buf[1:], "Q6_K", (6, 512)), ref.reshape(6, 512))
    # float inputs carry their bytes: an F16 tensor as a float16 array, F32 as float32
    x = rng.standard_normal((4, 6)).astype(np.float16)
    assert_bits_equal(_core.dequantize(x, "F16", (4, 6)), x.astype(np.float32))
    y = rng.standard_normal((4, 6)).astype(np.float32)
    assert_bits_equal(_core.dequantize(y, "F32", 24), y.ravel())
    # empty tensors
    assert _core.dequantize(b"", "Q4_K", (0, 256)).shape == (0, 256)


def test_public_dequantize_if_present():
    import qwencuda

    try:
        dq = qwencuda.dequantize
    except (ImportError, AttributeError):
        pytest.skip("qwencuda.dequantize (qwencuda/gguf.py) not written yet")
    rng = np.random.default_rng(5)
    raw = random_raw("Q4_K", 3, 2, rng)
    assert_bits_equal(np.asarray(dq(raw, "Q4_K", (3, 512))), gguf_dequantize(raw, T.Q4_K))


def test_dequantize_errors():
    raw = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match="needs 576"):
        _core.dequantize(raw, "Q4_K", (4, 256))                  # size mismatch
    with pytest.raises(ValueError, match="multiple of its block size 256"):
        _core.dequantize(raw, "Q4_K", (2, 128))
    with pytest.raises(ValueError, match="unknown tensor type"):
        _core.dequantize(raw, "Q9_K", (2, 256))
    with pytest.raises(ValueError, match="unknown tensor type"):
        _core.dequantize(raw, 99, (2, 256))
    with pytest.raises(ValueError, match="unknown tensor type"):
        _core.dequantize(raw, -1, (2, 256))
    with pytest.raises(ValueError, match="IQ2_XXS .* not supported"):
        _core.dequantize(raw, "IQ2_XXS", (2, 256))
    with pytest.raises(ValueError, match="Q4_2 .* not supported"):
        _core.dequantize(raw, 4, (2, 32))
    with pytest.raises(ValueError, match="negative"):
        _core.dequantize(raw, "Q4_K", (-2, 256))
    with pytest.raises(ValueError, match="dimensions"):
        _core.dequantize(raw, "Q4_K", ())
    with pytest.raises(TypeError):
        _core.dequantize(raw, 1.5, (2, 256))
    with pytest.raises(ValueError, match="contiguous buffer"):
        _core.dequantize(object(), "Q4_K", (2, 256))


# ---- the row dot product ----------------------------------------------------------------------

@pytest.mark.parametrize("name", SUPPORTED)
def test_dot_row_one_hot_is_exact(name):
    """With x = e_i the dot product is exactly the dequantized element i: this pins every
    element position, scale and offset of the dot's own unpacking."""
    rng = np.random.default_rng(11)
    bs = sizes(name)[0]
    n = max(bs, 32) * 2
    raw = random_raw(name, 1, n // bs, rng)
    w = _core.dequantize(raw, name, (1, n))[0]
    got = np.empty(n, np.float32)
    for i in range(n):
        x = np.zeros(n, np.float32)
        x[i] = 1.0
        got[i] = _core._dot_row(raw[0] if raw.ndim == 2 else raw, name, x)
    # equal as values: the other lanes add +0.0, so a -0.0 element may come back as +0.0
    bad = np.flatnonzero(got != w)
    assert bad.size == 0, f"{bad.size} positions differ, first {bad[0]}: {got[bad[0]]} vs {w[bad[0]]}"


# Row widths that each type can hold (a row is whole blocks): 45 only for the plain types, 896
# (the 0.5B width) not for the 256-element K types.
DOT_CASES = [(name, ncols) for name in SUPPORTED for ncols in (45, 256, 896, 4864)
             if ncols % sizes(name)[0] == 0]


@pytest.mark.parametrize("name,ncols", DOT_CASES)
def test_dot_row_random(name, ncols):
    """Tolerance: the dot sums in 32 float32 lanes across the row. Measured worst error over
    1000 random rows: 7e-8 * sum_i |w_i x_i|; we allow 2e-6 * sum_i |w_i x_i| (30x margin),
    still ~100x below a one-element error in a 4864-element row."""
    bs = sizes(name)[0]
    rng = np.random.default_rng(ncols)
    raw = random_raw(name, 4, ncols // bs, rng)
    w = _core.dequantize(raw, name, (4, ncols)).astype(np.float64)
    for r in range(len(w)):
        x = rng.standard_normal(ncols).astype(np.float32)
        ref = float(w[r] @ x.astype(np.float64))
        got = _core._dot_row(raw[r], name, x)
        mag = float(np.abs(w[r]) @ np.abs(x))
        tol = 2e-6 * mag
        assert abs(got - ref) <= tol, (name, r, got, ref, tol)


@pytest.mark.parametrize("name", SUPPORTED)
def test_dot_row_equals_float_dot_of_dequantized_row(name):
    """The contract the CPU matmul relies on: the dot of a stored row is bit for bit the F32
    dot of its dequantized values, so dequantizing a row once for many tokens (prefill) gives
    exactly what one-token decode gives."""
    rng = np.random.default_rng(13)
    bs = sizes(name)[0]
    for ncols in (bs, 512, 4864 if 4864 % bs == 0 else 4608, 45 if bs == 1 else bs * 3):
        raw = random_raw(name, 2, ncols // bs, rng)
        w = _core.dequantize(raw, name, (2, ncols))
        for r in range(2):
            x = rng.standard_normal(ncols).astype(np.float32)
            a = np.float32(_core._dot_row(raw[r], name, x))
            b = np.float32(_core._dot_row(w[r], "F32", x))
            assert a.view(np.uint32) == b.view(np.uint32), (name, ncols, a, b)


def test_dot_row_errors():
    x = np.ones(256, np.float32)
    with pytest.raises(ValueError, match="needs 144"):
        _core._dot_row(np.zeros(100, np.uint8), "Q4_K", x)
    with pytest.raises(ValueError, match="multiple"):
        _core._dot_row(np.zeros(144, np.uint8), "Q4_K", x[:100])
    with pytest.raises(ValueError, match="not supported"):
        _core._dot_row(np.zeros(144, np.uint8), "IQ4_XS", x)
