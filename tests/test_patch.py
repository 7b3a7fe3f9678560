"""Interventions (patch=): the engine with a patch against the NumPy reference engine with the
same patch (qwencuda.patching gives both the same hook), every captured tensor compared.

Engines and tolerances (normalised max error, max |a - b| / max |b| per tensor; -inf at the same
places):
  - "cpu:float", the CPU's float32 reference kernels: TOL = 1e-3, the bound of
    test_engine_vs_reference.py (measured errors are around 1e-6 .. 1e-5);
  - "cuda" with an F32 KV cache and <= 8 tokens: the exact CUDA path (fp32 GEMVs, fp32
    attention): FP32_TOL = 5e-4 of test_cuda_engine.py; with its default F16 cache (flash
    attention, f16 K/V) F16_TOL = 5e-2, as there.
A patch of attn_scores / attn_probs makes the engine recompute the attention output on the host
(double sums over float values) where the reference uses float64: inside the same bounds.
"""
import numpy as np
import pytest

import qwencuda as qc
from engine_util import model_file, norm_err

TOL = 1e-3
FP32_TOL = 5e-4
F16_TOL = 5e-2
IDS = [3, 141, 59, 265, 358, 97, 93]


def check(got, want, tol, what):
    bad = [f"{n}: {norm_err(got[n], want[n]):.3g}" for n in want.keys()
           if n != "argmax" and not norm_err(got[n], want[n]) <= tol]
    if not norm_err(got.logits, want.logits) <= tol:
        bad.append(f"logits: {norm_err(got.logits, want.logits):.3g}")
    assert not bad, f"{what}: beyond {tol}: " + ", ".join(bad[:8])


ENGINES = [
    pytest.param("cpu:float", "f32", TOL, id="cpu"),
    pytest.param("cuda:float", "f32", FP32_TOL, id="cuda-f32", marks=pytest.mark.gpu),
    pytest.param("cuda:float", "f16", F16_TOL, id="cuda-f16", marks=pytest.mark.gpu),
]


def _vec(n, seed=1):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def scenarios(cfg):
    """name -> patch, one per kind of edit and kind of tensor."""
    dim, n = cfg.dim, len(IDS)
    return {
        "replace-rows": {"blk.0.resid_mid": qc.Replace(_vec(dim), rows=[1, 3])},
        "replace-whole-q": {"blk.0.q": _vec(n * cfg.n_head * cfg.head_dim).reshape(n, cfg.n_head, cfg.head_dim)},
        "steer-every-layer": {"blk.*.resid_mid": qc.Add(0.5 * _vec(dim, 2))},
        "scale-heads": {"blk.1.q": qc.Scale(2.0, heads=[0])},
        "zero-heads-attn-out": {"blk.0.attn_out": qc.ZeroHeads([cfg.n_head - 1])},
        "zero-heads-probs": {"blk.1.attn_probs": qc.ZeroHeads([0], rows=[2, 5])},
        "scores-function": {"blk.0.attn_scores": lambda s: s * 0.5},
        "k-rope-enters-cache": {"blk.0.k_rope": lambda k: k[::-1].copy()},
        "v-scaled": {"blk.1.v": qc.Scale(-1.0)},
        "embed-and-ffn": {"embed": qc.Add(_vec(dim, 3)), "blk.0.gate": qc.Scale(0.5),
                          "blk.1.ffn_act": qc.Scale(0.0, rows=[0])},
        "two-edits-in-order": {"blk.0.resid_out": [qc.Scale(2.0), qc.Add(1.0)]},
        "output-norm-and-logits": {"output_norm": qc.Scale(1.5, rows=[-1]), "logits": qc.Scale(-1.0)},
    }


SCENARIOS = ["replace-rows", "replace-whole-q", "steer-every-layer", "scale-heads", "zero-heads-attn-out",
             "zero-heads-probs", "scores-function", "k-rope-enters-cache", "v-scaled", "embed-and-ffn",
             "two-edits-in-order", "output-norm-and-logits"]


@pytest.fixture(scope="module")
def tiny():
    path = model_file("tiny", "q8_0")
    return path, qc.reference.load(path)


@pytest.mark.parametrize("device,kv_type,tol", ENGINES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_patch_matches_reference(tiny, device, kv_type, tol, scenario):
    path, ref = tiny
    patch = scenarios(ref.config)[scenario]
    want = qc.reference.forward(ref, IDS, capture="*", logits="all", patch=patch)
    plain = qc.reference.forward(ref, IDS, capture=None, logits="all")
    assert norm_err(want.logits, plain.logits) > 1e-3, "the patch must change the result"
    with qc.Model(path, device=device, kv_type=kv_type) as m:
        got = m.forward(IDS, capture="*", logits="all", patch=patch)
    check(got, want, tol, f"{scenario} on {device}/{kv_type}")
    np.testing.assert_array_equal(got.argmax, np.argmax(got.logits, -1))


@pytest.mark.parametrize("device,kv_type,tol", ENGINES)
def test_patch_function_sees_the_captured_tensor(tiny, device, kv_type, tol):
    """A patch function receives exactly what capture= returns for that name (bit for bit on the
    CPU, where the unfused ops a patch needs compute the fused ones' bits; within the engine's
    tolerance on CUDA, whose fused prefill GEMM epilogue rounds differently)."""
    path, _ = tiny
    with qc.Model(path, device=device, kv_type=kv_type) as m:
        names = [n for n in m.capture_names() if n != "argmax"]
        base = m.forward(IDS, capture="*", logits="all")
        for name in names:
            seen = {}

            def spy(v, name=name):
                seen[name] = v.copy()

            tr = m.forward(IDS, capture=name, logits="all", patch={name: spy})
            assert seen[name].dtype == np.float32 and seen[name].shape == base[name].shape, name
            np.testing.assert_array_equal(tr[name], seen[name], err_msg=name)
            if device.startswith("cpu"):
                np.testing.assert_array_equal(seen[name], base[name], err_msg=name)
            else:
                assert norm_err(seen[name], base[name]) <= tol, name


@pytest.mark.parametrize("device,kv_type,tol", ENGINES)
def test_patched_cache_and_patched_step_match_reference(tiny, device, kv_type, tol):
    """k_rope patched in the prefill stays in the cache for the next steps; a step takes its own
    patch; an unpatched step after it is unpatched."""
    path, ref = tiny
    steer = qc.Add(0.25 * _vec(ref.config.dim, 4))
    rs = qc.reference.RefSession(ref)
    want = [rs.prefill(IDS, capture="*", patch={"blk.1.k_rope": qc.Scale(0.5, rows=[0, 1])}),
            rs.step(11, capture="*", patch={"blk.0.resid_out": steer}),
            rs.step(12, capture="*")]
    with qc.Model(path, device=device, kv_type=kv_type) as m, m.session(max_context=16) as s:
        got = [s.prefill(IDS, capture="*", patch={"blk.1.k_rope": qc.Scale(0.5, rows=[0, 1])}),
               s.step(11, capture="*", patch={"blk.0.resid_out": steer}),
               s.step(12, capture="*")]
    for i, (g, w) in enumerate(zip(got, want)):
        check(g, w, tol, f"call {i} on {device}/{kv_type}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_empty_patch_is_no_patch(tiny, device):
    path, _ = tiny
    with qc.Model(path, device=device) as m:
        a = m.forward(IDS, capture="blk.1.*")
        b = m.forward(IDS, capture="blk.1.*", patch={})
    for n in a.keys():
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
    np.testing.assert_array_equal(a.logits, b.logits)


def _boom(v):
    raise ZeroDivisionError("from the patch")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("patch,attn_rows,error,match", [
    ({"argmax": qc.Scale(1.0)}, None, ValueError, "patch 'logits'"),
    ({"blk.7.q": qc.Scale(1.0)}, None, ValueError, "matches no tensor"),
    ({"blk.0.q": "twice"}, None, TypeError, "an edit is"),
    ([("blk.0.q", 1.0)], None, TypeError, "must be a dict"),
    ({"blk.0.q": lambda v: np.zeros(3)}, None, ValueError, "shape"),
    ({"blk.0.q": qc.ZeroHeads([99])}, None, ValueError, "out of range"),
    ({"blk.0.resid_mid": qc.Scale(1.0, heads=[0])}, None, ValueError, "heads= applies"),
    ({"blk.0.attn_probs": qc.Scale(1.0)}, [-1], ValueError, "attn_rows"),
    ({"blk.1.up": _boom}, None, ZeroDivisionError, "from the patch"),
])
def test_bad_patches_raise_and_lose_nothing(tiny, device, patch, attn_rows, error, match):
    path, _ = tiny
    with qc.Model(path, device=device) as m, m.session(max_context=32) as s:
        s.prefill(IDS[:3])
        with pytest.raises(error, match=match):
            s.prefill(IDS[3:], patch=patch, attn_rows=attn_rows)
        assert s.position == 3, "a refused or failed eval leaves the position"
        s.rewind(3)
        after = s.prefill(IDS, logits="all")
        np.testing.assert_array_equal(after.logits, m.forward(IDS, logits="all").logits)


def test_patch_function_cannot_run_the_model(tiny):
    path, _ = tiny
    with qc.Model(path, device="cpu") as m:
        with pytest.raises(RuntimeError, match="cannot run, open or close"):
            m.forward(IDS, patch={"blk.0.q": lambda v: m.forward(IDS)})
        m.forward(IDS)   # still usable
