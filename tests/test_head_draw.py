"""The greedy draw inside the lm_head (backend.h's matmul_draw; kernels/matmul.cu, qc_head_draw).

A decode step that draws greedily without a penalty normalises x and quantizes it in one launch,
then runs its lm_head's four-row kernel with the draw in it: each block's best logit goes into one
64-bit key (an atomicMax), and one warp launched after it writes the draw and feeds the next step
(ids, pos) as feed_draw does, where the step otherwise ran rmsnorm, the quantize kernel, the
lm_head, the sample kernel and feed_draw. These tests hold it to what it replaces:
  - the op itself (_core._kernel_matmul_draw) on weights built so that the answer is known: the
    logits bit for bit those of the matmul op (of rmsnorm then matmul, with the norm), the token
    the first largest logit by NumPy's rule and the sample op's, ties across blocks and inside a
    warp going to the first id, NaN rows never chosen, every row NaN drawing -1, the feed's id
    and position;
  - a session's generation loop against one whose backend was made with QWENCUDA_HEAD_DRAW=0 (the
    lm_head, then sample, then feed_draw): the same tokens and positions, with the profiler seeing
    the drawing kernel run in one and not in the other, so that equal tokens cannot come from the
    same path twice. A sampled (temperature) loop must not take it, nor a loop that switches
    samplers replay the greedy recording for a sampling state.
Needs the GPU machine; the op takes weights of 32-element 8-bit types with more rows than one wave
of GEMV blocks (rows4_takes), so the weights below have 9001 and 20000 rows.
"""
import numpy as np
import pytest

import qwencuda as qc
from qwencuda import _core
from qwencuda import kernels as K
from engine_util import cuda_kernel_ran, session_with_env

pytestmark = pytest.mark.gpu

TYPES = ["Q8_0", "Q5_0", "Q4_0"]
BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18}   # a block of 32 starts with its f16 scale d


def _first_argmax(logits):
    """The sample op's greedy rule: the first largest value, NaN never chosen; -1 for none."""
    finite = np.where(np.isnan(logits), -np.inf, logits)
    best = int(np.argmax(finite))
    return -1 if finite[best] == -np.inf else best


def _draw(w, x, rng=12345, feed=None, norm=None, eps=1e-6):
    out = _core._kernel_matmul_draw("cuda", w._arg(), np.ascontiguousarray(x, np.float32), rng, feed, norm, eps)
    assert out is not None, f"matmul_draw did not take {w}"
    return out


def _weight(type_name, rows, cols, seed, copies=()):
    """A random weight whose rows `copies` ((from, to) pairs) are byte copies of others: equal logits."""
    rng = np.random.default_rng(seed)
    w = K.Weight.from_float(rng.standard_normal((rows, cols)).astype(np.float32), type_name)
    raw = w.raw.reshape(rows, -1).copy()
    for src, dst in copies:
        raw[dst] = raw[src]
    return K.Weight(raw, type_name, (rows, cols))


def _nan_rows(w, rows_nan):
    """w with the scale d of every block of rows_nan set to an f16 NaN: those logits are NaN."""
    raw = w.raw.reshape(w.shape[0], -1).copy()
    bb = BLOCK_BYTES[w.type]
    for r in rows_nan:
        for b in range(raw.shape[1] // bb):
            raw[r, b * bb:b * bb + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    return K.Weight(raw, w.type, w.shape)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows,cols", [(9001, 896), (20000, 256)])
def test_op_draws_the_first_largest_logit(type_name, rows, cols):
    rng = np.random.default_rng(rows + cols)
    x = rng.standard_normal(cols).astype(np.float32)
    # the largest row copied: across blocks of 32 rows (the atomicMax's ties) and inside one warp
    probe = K.matmul(_weight(type_name, rows, cols, seed=3), x, device="cuda")
    top = int(np.argmax(probe))
    for copies, first in [((), top),
                          (((top, rows - 1), (top, 40)), min(40, top)),
                          (((top, 4), (top, 5), (top, 7)), min(4, top))]:
        w = _weight(type_name, rows, cols, seed=3, copies=copies)
        logits, token, rng_after, fed = _draw(w, x)
        np.testing.assert_array_equal(logits, K.matmul(w, x, device="cuda"), err_msg=str(w))
        assert token == _first_argmax(logits) == first, (copies, token, first)
        assert token == K.sample(logits, qc.Sampler(rows, temperature=0.0), device="cuda")
        assert rng_after == 12345 and fed is None


@pytest.mark.parametrize("type_name", TYPES)
def test_op_folds_the_output_norm(type_name):
    """With a norm weight the op normalises x itself (one launch for the norm and the 8-bit x):
    the logits of rmsnorm, then matmul, bit for bit, and their first largest."""
    rows, cols, eps = 9001, 896, 1e-6
    rng = np.random.default_rng(8)
    w = _weight(type_name, rows, cols, seed=10)
    for scale in (1.0, 40.0, 1e-3):
        x = (rng.standard_normal(cols) * scale).astype(np.float32)
        nw = (1.0 + 0.5 * rng.standard_normal(cols)).astype(np.float32)
        logits, token, _, fed = _draw(w, x, feed=(9, 3), norm=nw, eps=eps)
        expect = K.matmul(w, K.rmsnorm(x, nw, eps, device="cuda"), device="cuda")
        np.testing.assert_array_equal(logits, expect, err_msg=f"{w} scale {scale}")
        assert token == _first_argmax(expect) and fed == (token, 4)
        # the test can fail: without the norm the logits differ
        assert not np.array_equal(_draw(w, x)[0], expect)


@pytest.mark.parametrize("type_name", TYPES)
def test_op_never_draws_nan(type_name):
    rows, cols = 9001, 256
    x = np.random.default_rng(5).standard_normal(cols).astype(np.float32)
    w = _weight(type_name, rows, cols, seed=9)
    top = int(np.argmax(K.matmul(w, x, device="cuda")))
    nan_rows = [0, 1, 31, 32, 5000, rows - 1, top]   # the largest row too: the next one must win
    logits, token, _, _ = _draw(_nan_rows(w, nan_rows), x)
    assert np.isnan(logits[nan_rows]).all() and not np.isnan(logits[token])
    assert token == _first_argmax(logits) == K.sample(logits, qc.Sampler(rows, temperature=0.0), device="cuda")
    w = _nan_rows(w, nan_rows)
    # every logit NaN: nothing can be chosen, and the feed still gives the next step a valid id
    logits, token, _, fed = _draw(_nan_rows(w, range(rows)), x, feed=(77, 10))
    assert np.isnan(logits).all() and token == -1 and fed == (0, 11)


@pytest.mark.parametrize("type_name", TYPES)
def test_op_feeds_the_next_step(type_name):
    rows, cols = 9001, 896
    x = np.random.default_rng(6).standard_normal(cols).astype(np.float32)
    w = _weight(type_name, rows, cols, seed=12)
    for pos in (0, 41, 32766):
        logits, token, rng_after, fed = _draw(w, x, rng=987654321, feed=(3, pos))
        assert token == _first_argmax(logits) and fed == (token, pos + 1) and rng_after == 987654321
    # equal logits everywhere (a zero x): the first id, in every launch (the key starts again at 0)
    for _ in range(3):
        logits, token, _, _ = _draw(w, np.zeros(cols, np.float32))
        assert (logits == 0).all() and token == 0


def test_op_declines_what_it_does_not_serve():
    """Types of 256-element blocks and rows within one wave keep the lm_head, sample, feed_draw."""
    x = np.ones(256, np.float32)
    assert _core._kernel_matmul_draw("cuda", _weight("Q4_K", 9001, 256, 1)._arg(), x, 1, None) is None
    assert _core._kernel_matmul_draw("cuda", _weight("Q8_0", 512, 256, 1)._arg(), x, 1, None) is None
    assert _core._kernel_matmul_draw("cpu", _weight("Q8_0", 9001, 256, 1)._arg(), x, 1, None) is None


# a small model with a vocabulary large enough for the four-row kernel, its lm_head 8-bit
BIG_VOCAB = dict(n_vocab=12000, dim=128, n_layer=2, n_head=4, n_head_kv=2, ffn_dim=256)
DRAW_KERNEL = "qc_gemv_q8_rows4_kernel<8, true, true>"   # Q8_0, rows from shared memory, DRAW


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    return qc.testing.write_model(str(tmp_path_factory.mktemp("head-draw") / "big-vocab-q8_0.gguf"),
                                  config=BIG_VOCAB, weight_type="q8_0", seed=4)


def _loop(path, monkeypatch, env, sampler, steps=24, probes=None):
    """A prefill and a generation loop (each step the token drawn before) in a model whose backend
    was made under env; the tokens, positions and the last steps' paths: whether the drawing
    kernel and the sample kernel ran in them, or (probes: name -> kernel) each probe's kernel."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with qc.Model(path, device="cuda") as m:
        for name in env:
            monkeypatch.delenv(name)
        samp = qc.Sampler(m.config.n_vocab, **sampler)
        out = []
        with session_with_env(m, monkeypatch, {}, max_context=64) as s:
            token = s.prefill([1, 2, 3, 4, 5], logits=None, sampler=samp).token
            for _ in range(steps):
                token = s.step(token, logits=None, sampler=samp).token
                out.append((token, s.position, s.ran_ahead))

            def more():
                nonlocal token
                for _ in range(4):
                    token = s.step(token, logits=None, sampler=samp).token
                    out.append((token, s.position, s.ran_ahead))

            if probes is not None:
                return out, {name: cuda_kernel_ran(more, kernel) for name, kernel in probes.items()}
            drew = cuda_kernel_ran(more, DRAW_KERNEL)
            sampled = cuda_kernel_ran(more, "qc_sample_kernel")
        return out, drew, sampled


def test_loop_across_samplers(big_vocab_model, monkeypatch):
    """One session's loop switching between a greedy sampler, a sampled one, a greedy one with a
    penalty (a state the lm_head's draw does not serve once it has a history) and a greedy one
    again: each switch picks the recording of its kind (session.c, rec_kind 3 or 1) and never
    replays the lm_head's greedy draw for a state that samples. The same tokens as with
    QWENCUDA_HEAD_DRAW=0, and the sampled stretch is not what greedy steps would have drawn."""
    greedy, sampled = dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=11)
    penalty = dict(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8)

    def run(env, samplers):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with qc.Model(big_vocab_model, device="cuda") as m:
            for name in env:
                monkeypatch.delenv(name)
            out = []
            with m.session(max_context=96) as s:
                token = s.prefill([7, 8, 9], logits=None, sampler=qc.Sampler(m.config.n_vocab)).token
                for params in samplers:
                    samp = qc.Sampler(m.config.n_vocab, **params)
                    for _ in range(12):
                        token = s.step(token, logits=None, sampler=samp).token
                        if "repeat_penalty" in params:
                            samp.accept(token)
                        out.append((token, s.position, s.ran_ahead))
            return out

    got = run({}, [greedy, sampled, penalty, greedy])
    plain = run({"QWENCUDA_HEAD_DRAW": "0"}, [greedy, sampled, penalty, greedy])
    assert [t[:2] for t in got] == [t[:2] for t in plain]
    assert sum(t[2] for t in got[:24]) >= 16   # the greedy and the sampled stretches ran ahead
    all_greedy = run({}, [greedy, greedy])
    assert [t[0] for t in all_greedy[:12]] == [t[0] for t in got[:12]]
    assert [t[0] for t in all_greedy[12:24]] != [t[0] for t in got[12:24]]


@pytest.mark.parametrize("sampler", [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=3)],
                         ids=["greedy", "sampled"])
def test_loop_draws_in_the_lm_head(sampler, big_vocab_model, monkeypatch):
    path = big_vocab_model
    plain, plain_drew, plain_sampled = _loop(path, monkeypatch, {"QWENCUDA_HEAD_DRAW": "0"}, sampler)
    got, drew, sampled = _loop(path, monkeypatch, {}, sampler)
    assert [t[:2] for t in got] == [t[:2] for t in plain]
    assert any(t[2] for t in got[1:]) and any(t[2] for t in plain[1:])   # the loops ran ahead
    greedy = sampler["temperature"] == 0.0
    assert plain_drew in (None, False) and plain_sampled in (None, True)
    assert drew in (None, greedy) and sampled in (None, not greedy)


def test_loop_draw_reaches_the_host_from_the_lm_head(big_vocab_model, monkeypatch):
    """A fed greedy step's draw reaches the host from the lm_head's finish kernel, which also
    stores it into the step's slot of mapped host memory (backend.h's draw_ticket), where
    download_start copied it by a kernel of its own (qc_to_host_kernel, as with
    QWENCUDA_DRAW_TO_HOST=0): the same tokens and positions both ways, both loops running ahead,
    the drawing kernel in both and the copy kernel only in the one that copies."""
    probes = {"drew": DRAW_KERNEL, "copied": "qc_to_host_kernel"}
    greedy = dict(temperature=0.0)
    plain, plain_ran = _loop(big_vocab_model, monkeypatch, {"QWENCUDA_DRAW_TO_HOST": "0"}, greedy, probes=probes)
    got, ran = _loop(big_vocab_model, monkeypatch, {}, greedy, probes=probes)
    assert [t[:2] for t in got] == [t[:2] for t in plain]
    assert [t[1] for t in got] == list(range(6, 6 + len(got)))   # one position a step, none lost
    assert all(t[2] for t in got[2:]) and all(t[2] for t in plain[2:])   # the loops ran ahead
    assert ran["drew"] in (None, True) and plain_ran["drew"] in (None, True)
    assert ran["copied"] in (None, False) and plain_ran["copied"] in (None, True)


def test_two_sessions_in_lockstep_draw_into_their_own_slots(big_vocab_model, monkeypatch):
    """Two greedy loops on one model, one step each in turn, each session's next step queued
    before the other's eval: each session's draws go to its own pair of host slots (draw_ticket;
    two sessions at the same position parity would otherwise overwrite each other's draw before
    it is read), so both draw what they draw alone; and more sessions than pairs
    (QC_DRAW_PAIRS, 8) still draw right, those past it by download_start's copy."""
    greedy = dict(temperature=0.0)
    prompts = [[1, 2, 3, 4, 5], [40, 50, 60, 70, 80]] + [[7 + i, 9, 11, 13, 15] for i in range(8)]
    with qc.Model(big_vocab_model, device="cuda") as m:
        samp = qc.Sampler(m.config.n_vocab, **greedy)

        def alone(prompt, steps):
            with m.session(max_context=64) as s:
                toks = [s.prefill(prompt, logits=None, sampler=samp).token]
                for _ in range(steps):
                    toks.append(s.step(toks[-1], logits=None, sampler=samp).token)
                return toks

        want = [alone(p, 12) for p in prompts]
        sessions = [m.session(max_context=64) for _ in prompts]
        try:
            toks = [[s.prefill(p, logits=None, sampler=samp).token] for s, p in zip(sessions, prompts)]
            ahead = 0
            for _ in range(12):
                for i, s in enumerate(sessions):
                    toks[i].append(s.step(toks[i][-1], logits=None, sampler=samp).token)
                    ahead += s.ran_ahead
        finally:
            for s in sessions:
                s.close()
    assert want[0] != want[1]   # the first two draw apart: a draw read from the other's slot shows
    assert toks == want
    assert ahead >= 10 * len(prompts)   # every loop ran ahead after its first two steps
