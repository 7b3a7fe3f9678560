"""The decode step run ahead (Session.ran_ahead; session.c's qc_ahead, backend.h's feed_draw).

In a generation loop (step(token, logits=None, sampler=s) with the token the step before drew)
the next step is queued on the GPU before the host has seen that token: its id, position and
RNG state are set on the device from the draw. These tests run scripted sequences of evals
twice on one model, in a session that runs ahead and in one that does not
(QWENCUDA_DECODE_AHEAD=0 at its creation), and require the same tokens and logits bit for bit:
the queued step replays the same recording with the same inputs. Every script also checks
ran_ahead: steps ran ahead where the loop allows it, never in the session that may not, and not
right after an eval that broke the loop, so that no test passes by comparing the plain path
with itself. Needs the GPU machine (the CPU has no recorded steps: test_cpu_never_runs_ahead).
"""
import numpy as np
import pytest

import qwencuda as qc
from engine_util import cuda_kernel_ran, model_file, session_with_env

SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9, top_k=40, top_p=0.95, seed=7),
}

# the environment of a session that runs ahead (the default), and of one that may not
AHEAD = {"QWENCUDA_DECODE_AHEAD": None}
NOT_AHEAD = {"QWENCUDA_DECODE_AHEAD": "0"}


def _run(m, monkeypatch, env, script, sampler="greedy", **kw):
    """Play script in a new session made under env: a list of (action, argument). Returns one
    record per eval: (action, token drawn or None, logits or None, position after, ran_ahead,
    last_path)."""
    out = []
    samp = qc.Sampler(m.config.n_vocab, **SAMPLERS[sampler])
    with session_with_env(m, monkeypatch, env, **kw) as s:
        token = None

        def record(action, tr):
            nonlocal token
            token = tr.token if tr.token is not None else token
            logits = None if tr.logits is None else np.array(tr.logits, copy=True)
            out.append((action, tr.token, logits, s.position, s.ran_ahead, s.last_path))

        for action, arg in script:
            if action == "prefill":        # arg: ids
                record(action, s.prefill(arg, logits=None, sampler=samp))
            elif action == "loop":         # arg: steps, each with the token drawn before
                for _ in range(arg):
                    record(action, s.step(token, logits=None, sampler=samp))
            elif action == "other_token":  # a step with another id than the one drawn
                record(action, s.step((token + 1) % m.config.n_vocab, logits=None, sampler=samp))
            elif action == "logits":       # the drawn token, its logits handed back
                record(action, s.step(token, sampler=samp))
            elif action == "capture":      # the drawn token, an intermediate captured
                record(action, s.step(token, logits=None, sampler=samp, capture="blk.0.attn_out"))
            elif action == "argmax":       # the drawn token, no sampler: the argmax recording
                tr = s.step(token)
                out.append((action, int(tr.argmax[-1]), np.array(tr.logits, copy=True), s.position,
                            s.ran_ahead, s.last_path))
                token = int(tr.argmax[-1])
            elif action == "rewind":       # no eval: a record without ran_ahead
                s.rewind(arg)
                out.append((action, None, None, s.position, None, None))
            elif action == "sampler":      # arg: new settings; no eval
                samp = qc.Sampler(m.config.n_vocab, **arg)
                out.append((action, None, None, s.position, None, None))
            else:
                raise ValueError(action)
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (ra, rb) in enumerate(zip(a, b)):
        assert ra[0] == rb[0] and ra[1] == rb[1] and ra[3] == rb[3], (i, ra[:2], rb[:2], ra[3], rb[3])
        if ra[2] is not None or rb[2] is not None:
            np.testing.assert_array_equal(ra[2], rb[2], err_msg=f"eval {i} ({ra[0]})")


def _ahead_flags(records):
    return [r[4] for r in records]


@pytest.mark.gpu
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("config,weight_type", [("tiny-hd64", "q4_k_m"), ("tiny-hd128", "q8_0"),
                                                ("tiny-gqa7", "f16")])
def test_generation_loop_runs_ahead(monkeypatch, config, weight_type, kv_type, sampler):
    """prefill, then 24 steps each with the token drawn before: the same tokens ahead or not;
    from the third step on every step was already queued (the first sets the expectation, the
    second meets it and queues the third)."""
    script = [("prefill", [3, 17, 99, 250, 7]), ("loop", 24)]
    with qc.Model(model_file(config, weight_type), device="cuda") as m:
        on = _run(m, monkeypatch, AHEAD, script, sampler, max_context=64, kv_type=kv_type)
        off = _run(m, monkeypatch, NOT_AHEAD, script, sampler, max_context=64, kv_type=kv_type)
    _assert_same(on, off)
    assert _ahead_flags(on) == [False, False, False] + [True] * 22
    assert not any(_ahead_flags(off))


@pytest.mark.gpu
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_draw_copied_by_a_kernel_or_the_copy_engine(monkeypatch, sampler):
    """Each step of the loop hands its draw (token and RNG) to the host through download_start:
    a one-warp kernel's stores into mapped host memory (kernels/sample.cu, qc_to_host_kernel), or
    with QWENCUDA_COPY_KERNEL=0 (read when the CUDA backend is made) cudaMemcpyAsync. The same
    tokens either way, and, where torch is present, the kernel seen to run only by default."""
    script = [("prefill", [3, 17, 99, 250, 7]), ("loop", 16)]
    got = {}
    # the lm_head's own copy of a greedy draw (test_head_draw.py) off: every draw by download_start
    monkeypatch.setenv("QWENCUDA_DRAW_TO_HOST", "0")
    for copy_kernel in ("0", None):
        if copy_kernel is None:
            monkeypatch.delenv("QWENCUDA_COPY_KERNEL", raising=False)
        else:
            monkeypatch.setenv("QWENCUDA_COPY_KERNEL", copy_kernel)
        with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cuda") as m:
            records = []
            ran = cuda_kernel_ran(lambda: records.extend(_run(m, monkeypatch, AHEAD, script, sampler,
                                                              max_context=64)), "qc_to_host_kernel")
            got[copy_kernel] = (records, ran)
    _assert_same(got[None][0], got["0"][0])
    assert _ahead_flags(got[None][0]) == [False, False, False] + [True] * 14
    assert got[None][1] in (None, True) and got["0"][1] in (None, False)


@pytest.mark.gpu
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_any_other_eval_leaves_the_queued_step_behind(monkeypatch, sampler):
    """A loop broken by every kind of eval the queued step does not serve (another token, logits
    asked for, a capture, the argmax recording, a rewind, new sampler settings, a prefill):
    each is computed as if nothing had been queued, and the loop runs ahead again after it."""
    breaks = [("other_token", None), ("logits", None), ("capture", None), ("argmax", None),
              ("rewind", 3), ("sampler", dict(temperature=0.5, seed=3)), ("prefill", [11, 12, 13])]
    script = [("prefill", [5, 6, 7, 8])]
    for b in breaks:
        script += [("loop", 4), b]
    script += [("loop", 4)]
    with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cuda") as m:
        on = _run(m, monkeypatch, AHEAD, script, sampler, max_context=96)
        off = _run(m, monkeypatch, NOT_AHEAD, script, sampler, max_context=96)
    _assert_same(on, off)
    assert not any(_ahead_flags(off))
    # after each break: its own eval (if it is one) and the next loop step ran as usual; the
    # rest of each loop of 4 ran ahead
    flags, actions = _ahead_flags(on), [r[0] for r in on]
    for i, a in enumerate(actions):
        if a != "loop":
            assert flags[i] in (False, None), (i, a)
            assert actions[i + 1] == "loop" and flags[i + 1] is False, (i, a)
    assert sum(f is True for f in flags) >= 2 * (len(breaks) + 1)


@pytest.mark.gpu
def test_the_persistent_kernel_runs_ahead(monkeypatch):
    """QWENCUDA_DECODE=persistent: the recorded step is the one-launch decode kernel, fed and
    queued as the op-by-op recording is; its draws equal the op-by-op step's without running
    ahead (the kernel's bits are the op-by-op step's: test_decode_step.py)."""
    script = [("prefill", [3, 17, 99]), ("loop", 16)]
    with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cuda") as m:
        on = _run(m, monkeypatch, dict(AHEAD, QWENCUDA_DECODE="persistent"), script, "sampled", max_context=64)
        off = _run(m, monkeypatch, dict(NOT_AHEAD, QWENCUDA_DECODE=None), script, "sampled", max_context=64)
    _assert_same(on, off)
    assert _ahead_flags(on) == [False] * 3 + [True] * 14
    assert {r[5] for r in on[1:]} == {"persistent"} and {r[5] for r in off[1:]} == {"graph"}


@pytest.mark.gpu
def test_the_step_ahead_stops_at_the_context_end(monkeypatch):
    """A loop up to the last position: no step is queued past it, the tokens are the same, and
    the eval after the last position is refused alike."""
    with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cuda") as m:
        on, off = (_run(m, monkeypatch, env, [("prefill", [1, 2, 3]), ("loop", 10)], max_context=13)
                   for env in (AHEAD, NOT_AHEAD))
        _assert_same(on, off)
        # the last step (position 12) was queued by the one before; it queued nothing
        assert on[-1][3] == 13 and on[-1][4] is True
        with session_with_env(m, monkeypatch, AHEAD, max_context=4) as s:
            samp = qc.Sampler(m.config.n_vocab)
            tok = s.prefill([1, 2], logits=None, sampler=samp).token
            tok = s.step(tok, logits=None, sampler=samp).token
            tok = s.step(tok, logits=None, sampler=samp).token
            with pytest.raises(ValueError, match="context full"):
                s.step(tok, logits=None, sampler=samp)
            assert s.position == 4


@pytest.mark.gpu
def test_the_step_ahead_across_the_long_context_bucket(monkeypatch):
    """Steps that cross QC_KV_SHORT (3072) keys, where the recording changes (the split-K
    attention gives way to the flash kernel): the first step past it is recorded, not queued,
    and the loop runs ahead again after it, with the same tokens."""
    prompt = list(np.random.default_rng(0).integers(0, 400, 3066))
    script = [("prefill", prompt), ("loop", 14)]
    with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cuda") as m:
        on = _run(m, monkeypatch, AHEAD, script, "sampled", max_context=3100)
        off = _run(m, monkeypatch, NOT_AHEAD, script, "sampled", max_context=3100)
    _assert_same(on, off)
    flags = _ahead_flags(on)
    # loop step i (record i) runs at position 3065 + i over 3066 + i keys: step 7, over 3073,
    # is the first of the long bucket, whose recording step 6 could not replay
    assert flags == [False] * 3 + [True] * 4 + [False] + [True] * 7


@pytest.mark.gpu
def test_two_sessions_in_lockstep(monkeypatch):
    """Two generation loops on one model, one step each in turn: each session's step queued
    ahead runs between the other's evals; both draw what they draw alone."""
    with qc.Model(model_file("tiny-hd64", "q4_k_m"), device="cuda") as m:
        alone = [_run(m, monkeypatch, AHEAD, [("prefill", p), ("loop", 12)], "sampled", max_context=32)
                 for p in ([1, 2, 3], [40, 50])]
        samplers = [qc.Sampler(m.config.n_vocab, **SAMPLERS["sampled"]) for _ in range(2)]
        with session_with_env(m, monkeypatch, AHEAD, max_context=32) as a, \
                session_with_env(m, monkeypatch, AHEAD, max_context=32) as b:
            toks = [[a.prefill([1, 2, 3], logits=None, sampler=samplers[0]).token],
                    [b.prefill([40, 50], logits=None, sampler=samplers[1]).token]]
            ahead = []
            for _ in range(12):
                for i, s in enumerate((a, b)):
                    toks[i].append(s.step(toks[i][-1], logits=None, sampler=samplers[i]).token)
                    ahead.append(s.ran_ahead)
    for i in range(2):
        assert toks[i] == [r[1] for r in alone[i]]
    assert sum(ahead) >= 18


def test_cpu_never_runs_ahead():
    """The CPU has no recorded steps: a generation loop runs each step when asked."""
    with qc.Model(model_file("tiny", "q8_0"), device="cpu") as m, m.session(max_context=16) as s:
        samp = qc.Sampler(m.config.n_vocab)
        tok = s.prefill([1, 2, 3], logits=None, sampler=samp).token
        for _ in range(5):
            tok = s.step(tok, logits=None, sampler=samp).token
            assert s.ran_ahead is False
