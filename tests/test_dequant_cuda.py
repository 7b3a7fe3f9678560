"""The CUDA dequantization kernels (kernels/embed.cu), value for value against the gguf package's
decoding: qc_dequant_rows_kernel, which writes the tile of weight rows that matmul hands to cuBLAS
for n > GEMV_MAX_TOKENS tokens (f16 for the block formats, f32 for BF16), and qc_embed_kernel
beside it (f32, also behind kernels.dequantize).

qwencuda.kernels has no binding of the tile itself, so it is read back through the matmul: with
x = rows of the identity, row i of x @ W.T is column j_i of W, and a GEMM of a one-hot row is
exact (one product by 1, the others by 0, accumulated in fp32): the result is the tile's value.
The only allowance is for f16 subnormals, should the tensor cores flush them (that would be
cuBLAS, not the kernel): there the value may be 0 instead, within 2^-14.

The shapes reach each branch of the kernels: rows not a multiple of the 8 rows of a thread block;
plain rows of odd length (scalar stores) and of a multiple of 8 (16-byte stores); more row groups
than the grid holds, so that warps stride over rows (70001 rows of one block each: the grid has
at most 32 thread blocks per multiprocessor)."""
import numpy as np
import pytest

from qwencuda import kernels as K
from test_kernels import _BLOCK, KQUANTS, LEGACY, PLAIN, random_weight

pytest.importorskip("gguf")

TILE_TYPES = ["BF16"] + LEGACY + KQUANTS    # the types matmul dequantizes (F32, F16: cuBLAS directly)
MANY_ROWS = 70001


def _qk(type_name):
    return 8 if type_name in PLAIN else _BLOCK[type_name][0]


def _shapes(type_name):
    """(rows, cols, cuda only) for one type."""
    qk = _qk(type_name)
    shapes = [(37, 3 * qk if type_name not in PLAIN else 67, False)]
    if type_name in PLAIN:
        shapes += [(37, 7, False), (37, 64, False)]
    shapes.append((MANY_ROWS, qk, True))
    return shapes


def _compare(got, exp, what, f16):
    """got == exp elementwise (-0 == 0), but for f16 subnormals (see the module docstring)."""
    got = np.asarray(got, dtype=np.float32)
    ok = got == exp
    if f16:
        sub = (exp != 0) & (np.abs(exp) < 2.0 ** -14)
        ok |= sub & (np.abs(got.astype(np.float64) - exp) <= 2.0 ** -14)
    bad = np.argwhere(~ok)
    if bad.size:
        lines = [f"{what}: {len(bad)} of {got.size} values differ; first:"]
        for idx in bad[:5]:
            idx = tuple(idx)
            lines.append(f"  at {idx}: got {got[idx]!r}, expected {exp[idx]!r}")
        pytest.fail("\n".join(lines))


@pytest.mark.parametrize("device", ["cpu:float", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("type_name", TILE_TYPES)
def test_matmul_tile_is_the_decoded_weight(device, type_name):
    """Every element of the prefill tile: x @ W.T with one-hot rows of x is W (f16-rounded where the
    tile is f16). "cpu:float" checks the construction itself (its matmul is exact here too)."""
    for rows, cols, cuda_only in _shapes(type_name):
        if cuda_only and device != "cuda":
            continue
        w, ref = random_weight(type_name, rows, cols, seed=rows + cols)
        n = max(cols, K.GEMV_MAX_TOKENS + 1)            # the cuBLAS path, every column at least once
        js = np.arange(n) % cols
        x = np.zeros((n, cols), np.float32)
        x[np.arange(n), js] = 1.0
        got = K.matmul(w, x, device=device)
        assert got.shape == (n, rows)
        exp = ref.astype(np.float32)[:, js].T
        f16 = device == "cuda" and type_name != "BF16"
        if f16:
            exp = exp.astype(np.float16).astype(np.float32)
        _compare(got, exp, f"{type_name} tile of {rows} x {cols} on {device}", f16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("type_name", PLAIN + LEGACY + KQUANTS)
def test_dequantize_many_rows_and_odd_shapes(device, type_name):
    """kernels.dequantize (the embed op over every row) bit for bit, at the same shapes."""
    for rows, cols, cuda_only in _shapes(type_name):
        if cuda_only and device != "cuda":
            continue
        w, ref = random_weight(type_name, rows, cols, seed=rows + 2 * cols)
        got = K.dequantize(w, device=device)
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        _compare(got, ref.astype(np.float32), f"{type_name} {rows} x {cols} on {device}", False)
        ids = np.array([rows - 1, 0, 3, rows - 1, rows // 2, 1, 2, 5, 8, 13], dtype=np.int32)
        got = K.embed(w, ids, device=device)
        _compare(got, ref.astype(np.float32)[ids], f"{type_name} embed of {rows} x {cols} on {device}", False)
