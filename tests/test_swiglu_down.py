"""The down projection folded into the gate/up kernel (backend.h's swiglu_down; kernels/
matmul_swiglu.cu, qc_slices.cuh, down_slices.cu): in a decode step that captures and patches
nothing, each layer adds act @ w_down^T into 64-bit fixed-point sums, which the next layer's
attention op adds to x, and after the last layer the head: the output norm inside matmul_draw where
the step draws greedily on the device, else a sum_add launch before the rmsnorm (session.c,
head_sum). Against the same steps with QWENCUDA_DOWN_FOLD=0 (read when a model's backend is made:
the down projection as its own matmul_add).

Tolerances, and why:
  - a folded step against the unfolded one from the same cache (both sessions prefill the same
    tokens, op by op; each checked step is rewound before the next), as max |a - b| / max |b| of
    the logits a step: at most 1e-3 in the median step and 2e-2 in every one. The slices hold the
    stored rows' values (Q4_K's and Q6_K's scales multiplied out, exact in float) and act's 8-bit
    form is the same, so the down projection's values differ only in the order of their float
    additions and a rounding at 2^-32 (about 1e-7 of them); but a later layer's 8-bit x then
    rounds a quant the other way now and then, which moves that element by 1/254 of its block's
    largest (qc_gemv_q8.cuh): up to 0.8e-2 of these small random models' logits (seen on the H200,
    2026-12-03, Q8_0 and Q4_0), in a few steps of 16. A wrong slice, sum, clear or add is off in
    every step and by far more (a down projection left out or added twice). Steps are not
    chained: the caches would carry those roundings on, as they carry the unfolded path's own.
  - folded against folded (two models; recorded against eager steps; the attention's fallback
    with the sums' add launch against the one launch; the head's two ways, the greedy draw inside
    the lm_head against the logits' argmax): equal bit for bit. The sums are integers, whatever
    order the atomics land in, and the ways of adding them to x compute the same floats.
The kernel on NumPy inputs (qwencuda.kernels.swiglu_down): act equal to matmul_swiglu's bit for
bit (the same kernel and quantization), and the down projection within 1e-5 of the sum of its
terms' magnitudes of matmul's (each of its float additions rounds by at most 2^-24 of such a sum:
about 152 of them at 0.5B) plus the fixed point's 2^-33 a block. All but the last test need the GPU
machine."""
import re

import numpy as np
import pytest

import qwencuda as qc
from qwencuda import kernels as K
from qwencuda import testing

gpu = pytest.mark.gpu

TOL = 1e-3        # the median step (no quant rounded the other way)
ROUNDED = 2e-2    # any step (a quant or two of a later layer's 8-bit x rounded the other way)
# three or more layers (a folded layer clears the one before's sums, and a session folds none unless two),
# shapes whose gate/up take the 32-row kernel; q4_k_m's downs are Q4_K and Q6_K (dim not a
# multiple of 256: gate and up fall back to 32-element types, as in the real 0.5B file)
SHAPES = {
    "hd64x4": dict(n_vocab=400, dim=224, n_layer=4, n_head=14, n_head_kv=2, ffn_dim=512),
    "hd128x3": dict(n_vocab=400, dim=384, n_layer=3, n_head=3, n_head_kv=1, ffn_dim=256),
}
TYPES = ["q8_0", "q5_0", "q4_0", "q4_k_m"]
FOLDED = re.compile(r"q8out_kernel<\d+, (true|false), [1-9]\d*>")


def _model(path, monkeypatch, fold, **env):
    with monkeypatch.context() as mp:
        mp.setenv("QWENCUDA_DOWN_FOLD", "1" if fold else "0")
        for k, v in env.items():
            mp.setenv(k, v)
        return qc.Model(path, device="cuda")


def _session(m, monkeypatch, graphs=True, max_context=96):
    with monkeypatch.context() as mp:
        if not graphs:
            mp.setenv("QWENCUDA_NO_GRAPHS", "1")
        return m.session(max_context=max_context)


def _errors(folded, plain):
    out = []
    for a, b in zip(folded, plain):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        out.append(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-6))
    return np.array(out)


def _close_steps(folded, plain):
    assert len(folded) == len(plain) > 0
    err = _errors(folded, plain)
    assert np.median(err) <= TOL, f"median step error {np.median(err):.3g} > {TOL}: {np.round(err, 5)}"
    assert err.max() <= ROUNDED, f"a step's error {err.max():.3g} > {ROUNDED}: {np.round(err, 5)}"


def _steps(path, monkeypatch, fold, ids, n_prompt, graphs=True, **env):
    """Logits of the steps after an n_prompt-token prefill, one chained after the other."""
    with _model(path, monkeypatch, fold, **env) as m:
        with _session(m, monkeypatch, graphs) as s:
            s.prefill([int(t) for t in ids[:n_prompt]])
            return np.array([s.step(int(t)).logits[0] for t in ids[n_prompt:]])


def _single_steps(path, monkeypatch, fold, ids, n_prompt, max_context=96, before=None):
    """Logits of one step after the n_prompt-token prefill for each later token, each rewound
    before the next, so that every step reads the prefill's cache; before(s): what the session
    does first (then it is reset)."""
    with _model(path, monkeypatch, fold) as m:
        with _session(m, monkeypatch, max_context=max_context) as s:
            if before:
                before(s)
                s.reset()
            s.prefill([int(t) for t in ids[:n_prompt]])
            out = []
            for t in ids[n_prompt:]:
                out.append(s.step(int(t)).logits[0])
                s.rewind(1)
            return out


def _write(tmp_path, shape, weight_type):
    path = str(tmp_path / f"{shape}-{weight_type}.gguf")
    testing.write_model(path, config=SHAPES[shape], weight_type=weight_type)
    return path


@gpu
@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_folded_steps_match_unfolded(tmp_path, monkeypatch, shape, weight_type):
    path = _write(tmp_path, shape, weight_type)
    ids = np.random.default_rng(5).integers(0, 400, size=26)
    _close_steps(_single_steps(path, monkeypatch, True, ids, 10), _single_steps(path, monkeypatch, False, ids, 10))


@gpu
@pytest.mark.parametrize("weight_type", TYPES)
def test_folded_steps_are_the_same_bits_every_way(tmp_path, monkeypatch, weight_type):
    """Two models, recorded and eager steps, and the attention op's fallback (QWENCUDA_QKV_ATTENTION=0:
    the sums added by a launch of their own) give one set of bits."""
    path = _write(tmp_path, "hd64x4", weight_type)
    ids = np.random.default_rng(6).integers(0, 400, size=24)
    ref = _steps(path, monkeypatch, True, ids, 5)
    np.testing.assert_array_equal(_steps(path, monkeypatch, True, ids, 5), ref)
    np.testing.assert_array_equal(_steps(path, monkeypatch, True, ids, 5, graphs=False), ref)
    np.testing.assert_array_equal(_steps(path, monkeypatch, True, ids, 5, QWENCUDA_QKV_ATTENTION="0"), ref)


@gpu
def test_fold_runs_in_plain_steps_only(tmp_path, monkeypatch):
    """A plain decode step runs the folded kernel once for every layer, the last too; a step that
    captures runs none (the op-by-op path, exact captures). Without torch's profiler: skipped."""
    prof = pytest.importorskip("torch.profiler")
    path = _write(tmp_path, "hd64x4", "q4_k_m")
    with _model(path, monkeypatch, True) as m:
        with _session(m, monkeypatch, graphs=False) as s:
            s.prefill([1, 2, 3, 4])

            def folded_launches(fn):
                with prof.profile(activities=[prof.ProfilerActivity.CUDA]) as p:
                    fn()
                return sum(1 for e in p.events() if FOLDED.search(e.name))

            assert folded_launches(lambda: s.step(5)) == SHAPES["hd64x4"]["n_layer"]
            assert folded_launches(lambda: s.step(6, capture=["blk.0.ffn_out"])) == 0


# a vocabulary large enough for the lm_head's four-row kernel and its greedy draw (test_head_draw.py)
BIG_VOCAB = dict(n_vocab=12000, dim=128, n_layer=3, n_head=4, n_head_kv=2, ffn_dim=256)
DRAW_KERNEL = "qc_gemv_q8_rows4_kernel<8, true, true>"   # Q8_0, rows from shared memory, DRAW


@gpu
def test_head_adds_the_last_layers_sums_both_ways(tmp_path, monkeypatch):
    """The last layer's sums reach the head by either path: a greedy loop drawing inside the lm_head
    (matmul_draw's output norm adds them) and steps handing back logits (sum_add, then rmsnorm and
    the lm_head) draw the same tokens, the first largest logit of the same bits; with the profiler,
    the drawing kernel ran in the loop and every layer's folded kernel in both. A head that left
    the sums out would miss the last layer's whole down projection in one path and not the other."""
    from engine_util import cuda_kernel_ran

    path = str(tmp_path / "big-vocab-q8_0.gguf")
    testing.write_model(path, config=BIG_VOCAB, weight_type="q8_0", seed=4)
    with _model(path, monkeypatch, True) as m:
        greedy = qc.Sampler(m.config.n_vocab)
        with _session(m, monkeypatch) as s:
            token = s.prefill([1, 2, 3, 4, 5], logits=None, sampler=greedy).token
            drawn = [token]
            for _ in range(20):
                token = s.step(token, logits=None, sampler=greedy).token
                drawn.append(token)

            def more():
                s.step(drawn[-1], logits=None, sampler=greedy)

            drew = cuda_kernel_ran(more, DRAW_KERNEL)
        with _session(m, monkeypatch) as s:
            logits = s.prefill([1, 2, 3, 4, 5]).logits[-1]
            argmax = [int(np.argmax(logits))]
            for t in drawn[:-1]:
                argmax.append(int(np.argmax(s.step(int(t)).logits[0])))
            folded = cuda_kernel_ran(lambda: s.step(int(drawn[-1])), "q8out_kernel<")
    assert drawn == argmax
    assert drew in (None, True) and folded in (None, True)


@gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_steps_that_capture_between_folded_ones(tmp_path, monkeypatch, graphs):
    """Folded steps among steps that capture or patch (op by op: they leave the sums alone), a
    rewind and a prefill, recorded or eager; then, from a fresh prefill, folded steps that match
    the unfolded ones. A sum left unzeroed by any of it would add a whole down projection to x."""
    path = _write(tmp_path, "hd64x4", "q4_k_m")
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 400, size=40)]
    dim = SHAPES["hd64x4"]["dim"]

    def mixed(s):
        s.prefill(ids[:6])
        for k, t in enumerate(ids[6:30]):
            if k % 7 == 3:
                s.step(t, capture=["blk.1.ffn_out", "blk.2.attn_norm"])
            elif k % 7 == 5:
                s.step(t, patch={"blk.0.ffn_out": qc.Add(np.full(dim, 0.25, np.float32))})
            else:
                s.step(t)
        s.rewind(5)
        s.prefill(ids[30:33])
        s.step(ids[33])

    with monkeypatch.context() as mp:
        if not graphs:
            mp.setenv("QWENCUDA_NO_GRAPHS", "1")
        folded = _single_steps(path, monkeypatch, True, ids, 8, before=mixed)
    _close_steps(folded, _single_steps(path, monkeypatch, False, ids, 8))


@gpu
def test_long_context_fallback_adds_the_sums(tmp_path, monkeypatch):
    """Past QC_KV_SHORT keys the attention op takes flash decode, not its one launch: it adds the
    sums by a launch of their own first; the logits of the unfolded steps."""
    path = _write(tmp_path, "hd64x4", "q5_0")
    ids = np.random.default_rng(8).integers(0, 400, size=3096)
    _close_steps(_single_steps(path, monkeypatch, True, ids, 3090, max_context=3200),
                 _single_steps(path, monkeypatch, False, ids, 3090, max_context=3200))


FFN_TYPES = [("Q5_0", "Q4_K"), ("Q5_0", "Q6_K"), ("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q8_0", "Q5_0")]


@gpu
@pytest.mark.parametrize("shape", [(512, 224), (4864, 896)])
@pytest.mark.parametrize("gate_type,down_type", FFN_TYPES)
def test_kernel_matches_matmul_swiglu_then_matmul(shape, gate_type, down_type):
    ffn, dim = shape
    rng = np.random.default_rng(ffn + dim)
    wg, wu = (K.Weight.from_float(rng.standard_normal((ffn, dim)).astype(np.float32) * 0.1, gate_type) for _ in range(2))
    wd = K.Weight.from_float(rng.standard_normal((dim, ffn)).astype(np.float32) * 0.1, down_type)
    x = rng.standard_normal(dim).astype(np.float32)
    norm = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    act, down = K.swiglu_down(wg, wu, wd, x, norm=norm, device="cuda")
    want_act = K.matmul_swiglu(wg, wu, x[None], norm=norm, device="cuda")[0]
    np.testing.assert_array_equal(act, want_act)
    want = K.matmul(wd, act[None], device="cuda")[0]
    terms = np.abs(act.astype(np.float64)) @ np.abs(K.dequantize(wd).astype(np.float64)).T
    bound = 1e-5 * terms + (ffn // 32) * 2.0 ** -33
    err = np.abs(down.astype(np.float64) - want)
    assert (err <= bound).all(), f"max error {err.max():.3g}, its bound {bound[err.argmax()]:.3g}"
    assert np.abs(down).max() > 0   # (sums that never came back would be zeros, within any bound here)


@gpu
def test_kernel_switched_off_raises(monkeypatch):
    rng = np.random.default_rng(3)
    wg, wu = (K.Weight.from_float(rng.standard_normal((512, 224)).astype(np.float32), "Q5_0") for _ in range(2))
    wd = K.Weight.from_float(rng.standard_normal((224, 512)).astype(np.float32), "Q4_K")
    x = rng.standard_normal(224).astype(np.float32)
    monkeypatch.setenv("QWENCUDA_DOWN_FOLD", "0")
    K.release("cuda")   # the kernels' backend is made again, reading the switch
    try:
        with pytest.raises(ValueError, match="does not fold"):
            K.swiglu_down(wg, wu, wd, x, device="cuda")
    finally:
        monkeypatch.delenv("QWENCUDA_DOWN_FOLD")
        K.release("cuda")
    with pytest.raises(ValueError, match="does not fold"):   # gate and up of a 256-element type
        K.swiglu_down(K.Weight.from_float(rng.standard_normal((512, 256)).astype(np.float32), "Q4_K"),
                      K.Weight.from_float(rng.standard_normal((512, 256)).astype(np.float32), "Q4_K"),
                      K.Weight.from_float(rng.standard_normal((256, 512)).astype(np.float32), "Q4_K"),
                      rng.standard_normal(256).astype(np.float32), device="cuda")


def test_kernel_refuses_what_it_cannot_fold():
    """The CPU backend has no fold; bad shapes and more than one token are refused before any work."""
    rng = np.random.default_rng(4)
    wg, wu = (K.Weight.from_float(rng.standard_normal((64, 32)).astype(np.float32), "Q8_0") for _ in range(2))
    wd = K.Weight.from_float(rng.standard_normal((32, 64)).astype(np.float32), "Q8_0")
    x = rng.standard_normal(32).astype(np.float32)
    with pytest.raises(ValueError, match="does not fold"):
        K.swiglu_down(wg, wu, wd, x, device="cpu")
    with pytest.raises(ValueError, match="feed-forward block"):
        K.swiglu_down(wg, wu, wg, x, device="cpu")
    with pytest.raises(ValueError, match="one token"):
        K.swiglu_down(wg, wu, wd, np.stack([x, x]), device="cpu")
