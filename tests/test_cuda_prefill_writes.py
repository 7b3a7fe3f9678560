"""Does the CUDA prefill read any part of a GEMM's output before writing it? (issue 19 item 7)

compute-sanitizer initcheck reports "Uninitialized __global__ memory read" in the kernels that
read a prefill GEMM's output (qc_swiglu_kernel, qc_add_kernel, qc_add_bias_kernel) after the
quantized-weight matmul path (n > 8 tokens: tiles decoded to f16 and cuBLAS), and none with F32
weights. Reading kernels/matmul.cu: every tile's GEMM writes rows r0 .. r0 + m - 1 of all n
tokens of out (ldc = rows, beta = 0, or beta = 1 onto the residual copied there first), the tiles
cover 0 .. rows - 1, and add_bias, swiglu and add read exactly n * rows values: nothing is read
that a GEMM did not write. So either initcheck cannot see cuBLAS's stores on that path (the f16
tensor-core kernels of sm_90 store C through the TMA unit; the fp32 SIMT sgemm of the F32 path
stores from registers, which initcheck tracks), or the reading above is wrong.

These tests decide it without the tool: a value that no GEMM writes keeps whatever the buffer
held before. A session's scratch buffers are reused from one eval to the next, so prompt B
evaluated right after prompt A (same length, different tokens) would show A's values wherever B's
outputs were not written; it must instead be bit-identical to B on a fresh session (and on a
fresh model). Run on the GPU machine (skipped without one), for the block formats whose prefill
takes the tiled path, with and without QWENCUDA_NO_FUSION.
scripts/initcheck_gemm_probe.py isolates the tool's side (one matmul per weight type).
"""
import numpy as np
import pytest

import qwencuda as qc
from qwencuda import testing

pytestmark = pytest.mark.gpu

N = 30          # > 8 tokens: the cuBLAS prefill path
CAPTURE = ["blk.*.q", "blk.*.k", "blk.*.v", "blk.*.attn_proj", "blk.*.resid_mid", "blk.*.gate",
           "blk.*.up", "blk.*.ffn_act", "blk.*.ffn_out", "blk.*.resid_out", "output_norm"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill-writes")
    return {wt: testing.write_model(str(d / f"gqa7-{wt}.gguf"), config="tiny-gqa7", weight_type=wt)
            for wt in ("q8_0", "q4_k_m", "f16")}


def _prefill(model, ids, stale=None):
    s = model.session(max_context=64)
    if stale is not None:
        s.prefill(stale, capture=CAPTURE, logits="all")   # fills every scratch buffer with A's values
        s.reset()
    tr = s.prefill(ids, capture=CAPTURE, logits="all")
    s.close()
    return tr


@pytest.mark.parametrize("no_fusion", ["0", "1"])
@pytest.mark.parametrize("weight_type", ["q8_0", "q4_k_m", "f16"])
def test_prefill_after_another_prompt_is_bit_identical(models, weight_type, no_fusion, monkeypatch):
    monkeypatch.setenv("QWENCUDA_NO_FUSION", no_fusion)     # read when a session is created
    rng = np.random.default_rng(5)
    a = [int(t) for t in rng.integers(1, 400, N)]
    b = [int(t) for t in rng.integers(1, 400, N)]
    with qc.Model(models[weight_type], device="cuda") as m:
        fresh = _prefill(m, b)
        after_a = _prefill(m, b, stale=a)
    for name in fresh.keys():
        np.testing.assert_array_equal(after_a[name], fresh[name], err_msg=f"{name}: stale values of "
                                      "the previous prompt, or a nondeterministic GEMM")
    np.testing.assert_array_equal(after_a.logits, fresh.logits)
    with qc.Model(models[weight_type], device="cpu:float") as cpu:   # the float32 reference kernels
        want = cpu.forward(b, capture=CAPTURE, logits="all")
    scale = np.abs(want.logits).max()
    assert np.abs(fresh.logits - want.logits).max() <= 5e-2 * scale       # F16_TOL of test_cuda_engine
