"""The C engine (device="cpu") against the independent NumPy reference (qwencuda.reference),
every captured tensor, on every synthetic config and every weight type.

Tolerances. Both engines read the same dequantized weights (the reference through the `gguf`
package, the engine through csrc/quants.c: both exact up to float32 rounding of d * q) and compute
in float32; they differ only in summation order (the reference uses BLAS sgemm and float64 for
norms, RoPE and attention; the engine float32 loops). One float32 dot product of length K has a
relative error around sqrt(K) * 6e-8 ~ 1e-6; two layers, large q/k biases (scores of a few
hundred, where a float32 ulp is 3e-5) and a sharp softmax multiply that by at most ~100. So:
  RTOL = 1e-4   on ||engine - ref|| / ||ref|| for every tensor
  ATOL = 1e-3   on max|engine - ref| relative to max|ref| (a single outlier element)
The measured worst case is printed with -s (about 1e-6 .. 1e-5), far inside both.
argmax must agree wherever the reference's top-two logits are not a near-tie (gap >= 1e-3).
"""
import numpy as np
import pytest

import qwencuda as qc
from engine_util import compare_traces, model_file

RTOL = 1e-4
ATOL = 1e-3

CONFIGS = ["tiny", "tiny-gqa1", "tiny-gqa7", "tiny-hd64", "tiny-hd128", "tiny-oddvocab"]
TYPES = list(qc.testing.WEIGHT_TYPES)
IDS = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327, 95, 28, 84, 197, 169, 39, 9]


def _check(config, weight_type, tied=None, ids=IDS):
    path = model_file(config, weight_type, tied=tied)
    want = qc.reference.forward(qc.reference.load(path), ids, capture="*", logits="all")
    with qc.Model(path, device="cpu", threads=1) as m:
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
