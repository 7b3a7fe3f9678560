"""The fused ops in the forward pass (csrc/engine/session.c): an eval without capture runs matmul_multi,
rope_kv_store, matmul_add and matmul_swiglu; capture="*" asks for every intermediate, so it runs
the unfused sequences (matmul x3, rope x2 + kv_store, matmul + add, matmul x2 + swiglu). Both
must give the same logits, and a capture of any one name must give the same tensor whichever
ops ran around it.

Tolerances, and why:
  - CPU: exact. Every fused op computes its sequence's float operations in the same order
    (csrc/cpu/cpu_ops.c), so fused and unfused evals agree bit for bit.
  - CUDA: max |fused - unfused| <= CUDA_TOL * max |unfused|. The GEMV paths (n <= 8 tokens)
    are bit-identical too, but in two places: matmul_add's cuBLAS path (prefill) adds the
    residual inside the GEMM (beta = 1), which may round differently from a separate add (one
    float32 ulp there, carried through f16 tensor-core inputs and Qwen2's large q/k biases, stays
    far below 1e-3); and a decode step of Q4_0/Q5_0/Q8_0 weights hands the feed-forward norm from
    the o projection to gate/up as x * weight in 8 bits, its scale applied after the dot products
    (matmul_add's norm_next), where a quant may round the other way: within the 8-bit error
    (tests/test_kernels.py, test_matmul_add_swiglu), below 1e-3 of the logits here.
"""
import numpy as np
import pytest

import qwencuda as qc
from engine_util import model_file

CUDA_TOL = 1e-3
IDS = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327, 95, 28, 84, 197, 169, 39, 9, 77]


def _same(a, b, device, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if device == "cpu" or a.dtype.kind in "iu":
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    fin = np.isfinite(b)
    assert np.array_equal(fin, np.isfinite(a)), f"{what}: -inf (masked scores) differ"
    if fin.any():
        err = np.max(np.abs(a[fin].astype(np.float64) - b[fin]))
        scale = max(float(np.max(np.abs(b[fin]))), 1e-6)
        assert err <= CUDA_TOL * scale, f"{what}: max error {err:.3g} > {CUDA_TOL} * {scale:.3g}"


@pytest.mark.parametrize("weight_type", ["f32", "f16", "bf16", "q8_0", "q5_0", "q4_0", "q5_k", "q4_k_m"])
@pytest.mark.parametrize("config", ["tiny-gqa7", "tiny-hd64", "tiny-oddvocab"])
def test_fused_logits_equal_unfused(device, config, weight_type):
    """A session without capture (fused) against one with capture="*" (unfused): a prefill of
    11 tokens (cuBLAS on CUDA), one of 3 (GEMV), then single steps (a replayed CUDA graph
    against op-by-op)."""
    with qc.Model(model_file(config, weight_type), device=device) as m:
        with m.session(max_context=64) as fused, m.session(max_context=64) as plain:
            for chunk in (IDS[:11], IDS[11:14]):
                a = fused.prefill(chunk, logits="all")
                b = plain.prefill(chunk, capture="*", logits="all")
                _same(a.logits, b.logits, device, f"prefill of {len(chunk)}")
            for t in IDS[14:]:
                a = fused.step(t)
                b = plain.step(t, capture="*")
                _same(a.logits, b.logits, device, f"step at {fused.position - 1}")


@pytest.mark.parametrize("n", [6, 12])
def test_each_capture_alone_equals_capture_all(device, n):
    """capture=[name] leaves every other fusion on (and turns off only those that would skip
    name): the tensor and the logits are those of capture="*"."""
    with qc.Model(model_file("tiny-gqa7", "q4_k_m"), device=device) as m:
        ids = IDS[:n]
        full = m.forward(ids, capture="*", logits="all")
        for name in m.capture_names():
            one = m.forward(ids, capture=[name], logits="all")
            assert list(one.keys()) == [name]
            _same(one[name], full[name], device, name)
            _same(one.logits, full.logits, device, f"logits with capture {name}")


def test_no_fusion_switch_gives_the_same_logits(monkeypatch):
    """QWENCUDA_NO_FUSION=1 (read when a session is created) runs the unfused ops without
    capture: the numbers of the fused ones, exactly, on the CPU."""
    with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cpu") as m:
        with m.session(max_context=32) as s:
            want = [s.prefill(IDS[:9], logits="all").logits] + [s.step(t).logits for t in IDS[9:12]]
        monkeypatch.setenv("QWENCUDA_NO_FUSION", "1")
        with m.session(max_context=32) as s:
            got = [s.prefill(IDS[:9], logits="all").logits] + [s.step(t).logits for t in IDS[9:12]]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
