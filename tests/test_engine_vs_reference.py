"""The C engine on the CPU against the independent NumPy reference (qwencuda.reference), every
captured tensor, on every synthetic config and every weight type: the float32 reference ops
(device="cpu:float") at float32 tolerances, and the fast kernels (device="cpu", 8-bit
activations where the CPU has AVX2) at the tolerances of that quantization (below).

Tolerances. Both engines read the same dequantized weights (the reference through the `gguf`
package, the engine through csrc/engine/quants.c: both exact up to float32 rounding of d * q) and compute
in float32; they differ only in summation order (the reference uses BLAS sgemm and float64 for
norms, RoPE and attention; the engine float32 loops). One float32 dot product of length K has a
relative error around sqrt(K) * 6e-8 ~ 1e-6; two layers, large q/k biases (scores of a few
hundred, where a float32 ulp is 3e-5) and a sharp softmax multiply that by at most ~100. So:
  RTOL = 1e-4   on ||engine - ref|| / ||ref|| for every tensor
  ATOL = 1e-3   on max|engine - ref| relative to max|ref| (a single outlier element)
The measured worst case is printed with -s (about 1e-6 .. 1e-5), far inside both.
argmax must agree wherever the reference's top-two logits are not a near-tie (gap >= 1e-3).

The fast kernels (csrc/cpu/cpu_simd.h) round every matmul's input to 8 bits per block of 32:
an error uniform in +-max|x_block| / 254, i.e. ~0.6% of the rms of x for Gaussian blocks, hence
~6e-3 relative per matmul. Seven matmuls per layer, two layers and the synthetic models' sharp
softmax compound that to a measured 1.3e-2 .. 1.9e-2 on the logits (max-abs up to 0.22), so:
  Q8_RTOL = 4e-2 on ||engine - ref|| / ||ref|| of the logits, Q8_ATOL = 5e-2 of max|ref| (the
            captures in between are checked by the float run above, and every 8-bit matmul by
            its exact error bound in test_kernels.py)
and argmax must agree wherever the top-two gap is >= 0.5 (twice the worst max-abs error).
"""
import numpy as np
import pytest

import qwencuda as qc
from engine_util import compare_traces, model_file

RTOL = 1e-4
ATOL = 1e-3
Q8_RTOL = 4e-2
Q8_ATOL = 5e-2

CONFIGS = ["tiny", "tiny-gqa1", "tiny-gqa7", "tiny-hd64", "tiny-hd128", "tiny-oddvocab"]
TYPES = list(qc.testing.WEIGHT_TYPES)
IDS = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327, 95, 28, 84, 197, 169, 39, 9]


def _check(config, weight_type, tied=None, ids=IDS):
    path = model_file(config, weight_type, tied=tied)
    want = qc.reference.forward(qc.reference.load(path), ids, capture="*", logits="all")
    with qc.Model(path, device="cpu:float", threads=1) as m:
        got = m.forward(ids, capture="*", logits="all")
    assert list(got.keys()) == list(want.keys()), "capture names or their order differ"
    errs = compare_traces(got, want, RTOL, ATOL)
    r_log = compare_traces({"logits": got.logits}, {"logits": want.logits}, RTOL, ATOL)
    assert got.logits.shape == (len(ids), m.config.n_vocab)
    np.testing.assert_array_equal(got.positions, np.arange(len(ids)))
    np.testing.assert_array_equal(got.ids, ids)
    top2 = np.sort(want.logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= 1e-3
    np.testing.assert_array_equal(got.argmax[clear], want.argmax[clear])
    np.testing.assert_array_equal(got.argmax, np.argmax(got.logits, axis=-1))
    worst = max(errs.items(), key=lambda kv: kv[1][0])
    print(f"{config} {weight_type}: worst {worst[0]} rel {worst[1][0]:.2e} max-abs {worst[1][1]:.2e}; "
          f"logits rel {r_log['logits'][0]:.2e}")


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_every_capture_matches_reference(config, weight_type):
    _check(config, weight_type)


@pytest.mark.parametrize("config", ["tiny", "tiny-gqa7"])
@pytest.mark.parametrize("weight_type", ["f32", "q4_k_m"])
def test_tied_models_match_reference(config, weight_type):
    _check(config, weight_type, tied=True)


def test_single_token_forward_matches_reference():
    _check("tiny", "q8_0", ids=[7])


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("config", ["tiny", "tiny-gqa7", "tiny-hd128"])
def test_fast_kernels_match_reference(config, weight_type):
    """device="cpu" (the 8-bit kernels where the CPU has them): logits and argmax."""
    path = model_file(config, weight_type)
    want = qc.reference.forward(qc.reference.load(path), IDS, logits="all")
    with qc.Model(path, device="cpu", threads=2) as m:
        got = m.forward(IDS, logits="all")
    errs = compare_traces({"logits": got.logits}, {"logits": want.logits}, Q8_RTOL, Q8_ATOL)
    top2 = np.sort(want.logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= 0.5
    np.testing.assert_array_equal(got.argmax[clear], want.argmax[clear])
    print(f"{config} {weight_type} (cpu: {qc.build_info()['cpu_kernels']}): logits rel "
          f"{errs['logits'][0]:.2e} max-abs {errs['logits'][1]:.2e}")
