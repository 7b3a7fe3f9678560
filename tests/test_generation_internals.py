"""generate()/chat() with capture= and logprobs=k: a Trace and a TokenLogprobs per generated
token, in the result and while streaming, without changing the tokens drawn.

The oracles are independent of qwencuda.generation: the logits of a Session.prefill/step loop
written out by hand (the same engine, so the same float32 rows: the log-probabilities must agree
to float64 rounding), the NumPy reference engine on the same tokens (at the float32 tolerances
of tests/test_engine_vs_reference.py), and a log-softmax computed another way (logaddexp)."""
import os

import numpy as np
import pytest

import qwencuda as qc
from qwencuda import cli
from qwencuda import generation as gen_mod
from qwencuda.generation import TokenLogprobs, generate

from fake_engine import IM_END, N_VOCAB, FakeModel, GreedySampler

PROMPT = "Hello world"
ATTN = "blk.*.attn_probs"


def _logprobs(row):
    """log-softmax in float64 by logaddexp, another route than generation.log_softmax."""
    x = np.asarray(row, dtype=np.float64).reshape(-1)
    return x - np.logaddexp.reduce(x)


def _top(lp, k):
    """The k most likely ids, most likely first, equal values in id order (a full stable sort)."""
    return [int(i) for i in np.argsort(-lp, kind="stable")[:k]]


def _check_token_logprobs(tok, entry, row, token, k):
    """entry is the TokenLogprobs of token drawn from logits row, with k alternatives."""
    lp = _logprobs(row)
    assert isinstance(entry, TokenLogprobs)
    assert entry.token == token and entry.text == tok.decode([token])
    assert entry.logprob == pytest.approx(lp[token], abs=1e-9)
    assert [t for t, _, _ in entry.top] == _top(lp, k)
    for t, text, v in entry.top:
        assert text == tok.decode([t]) and v == pytest.approx(lp[t], abs=1e-9)


def test_log_softmax_in_float64_nan_as_minus_inf():
    row = np.array([1.0, np.nan, 3.0, -np.inf, 3.0], dtype=np.float32)
    lp = gen_mod.log_softmax(row)
    assert lp.dtype == np.float64 and np.isnan(row[1])          # the caller's row untouched
    finite = _logprobs(row[[0, 2, 4]])
    np.testing.assert_allclose(lp[[0, 2, 4]], finite, rtol=0, atol=1e-15)
    assert lp[1] == lp[3] == -np.inf
    big = np.random.default_rng(0).standard_normal(151936).astype(np.float32) * 30
    np.testing.assert_allclose(gen_mod.log_softmax(big), _logprobs(big), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the loop, on a fake engine

@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(gen_mod, "_make_sampler", lambda model, kw: GreedySampler(0, **kw))
    return FakeModel


def test_fake_logprobs_per_token(fake):
    m = fake("abc")
    g = generate(m, "x", logprobs=3)
    assert g.tokens == list(b"abc") + [IM_END] and g.traces is None
    assert len(g.logprobs) == len(g.tokens)          # the eos token has its entry too
    for entry, token in zip(g.logprobs, g.tokens):
        row = np.full(N_VOCAB, -10.0)                # the fake's logits: the scripted token at +10
        row[token] = 10.0
        _check_token_logprobs(m.tokenizer, entry, row, token, 3)
        # the scripted token, then the lowest ids of the tied rest, in id order
        assert [t for t, _, _ in entry.top] == [token, 0, 1]


def test_fake_logprobs_zero_and_off(fake):
    g = generate(fake("ab"), "x", logprobs=0)
    assert [e.top for e in g.logprobs] == [(), (), ()]
    assert generate(fake("ab"), "x").logprobs is None
    g0 = generate(fake("ab"), "x", logprobs=3, max_new_tokens=0)
    assert g0.tokens == [] and g0.logprobs == []


def test_fake_stream_lists_grow_with_the_tokens(fake):
    """At every piece the stream's lists hold one entry per token so far, and they are the
    result's lists; text held back for a stop string is covered too."""
    it = generate(fake("ab<Xcd<END>ef"), "x", logprobs=1, stop="<END>", stream=True)
    assert it.tokens == [] and it.logprobs == [] and it.traces is None
    seen = ""
    for piece in it:
        seen += piece
        assert len(it.logprobs) == len(it.tokens) >= len(seen.encode())
        assert FakeModel("").tokenizer.decode(it.tokens).startswith(seen)
        assert [e.token for e in it.logprobs] == it.tokens
    g = it.result
    assert g.text == "ab<Xcd" and g.stop_reason == "stop"
    assert it.tokens is g.tokens and it.logprobs is g.logprobs


def test_fake_cancelled_stream_keeps_what_was_made(fake):
    it = generate(fake("abcdef"), "x", logprobs=1, stream=True)
    assert next(it) == "a"
    it.close()
    g = it.result
    assert g.stop_reason == "cancelled" and len(g.logprobs) == len(g.tokens) >= 1


def test_fast_path_when_nothing_is_asked(fake):
    """Without capture and logprobs no logits come back and no capture is passed (the session's
    recorded decode step); logprobs alone asks for the last row and nothing else."""
    calls = []

    def spy(session):
        for name in ("prefill", "step"):
            f = getattr(session, name)
            setattr(session, name, lambda *a, _f=f, _n=name, **kw: calls.append((_n, kw)) or _f(*a, **kw))
        return session

    m = fake("abc")
    real_session = m.session
    m.session = lambda **kw: spy(real_session(**kw))
    generate(m, "x")
    assert calls and all(kw["logits"] is None and set(kw) == {"logits", "sampler"} for _, kw in calls)
    calls.clear()
    generate(m, "x", logprobs=2)
    assert all(kw["logits"] == "last" and set(kw) == {"logits", "sampler"} for _, kw in calls)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, N_VOCAB + 1])
def test_bad_logprobs_before_any_work(fake, bad):
    m = fake("a")
    with pytest.raises(ValueError, match="logprobs"):
        generate(m, "x", logprobs=bad)
    with pytest.raises(ValueError, match="logprobs"):
        generate(m, "x", logprobs=bad, stream=True)
    assert m.sessions == []


# ------------------------------------------------------- the real engine, on synthetic models

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(qc.testing.write_model(str(tmp_path_factory.mktemp("internals") / "tiny.gguf"),
                                      config="tiny", weight_type="f32", seed=3))


@pytest.fixture
def tiny(tiny_path, device):
    with qc.Model(tiny_path, device=device) as m:
        yield m


def _by_hand(model, prompt_ids, tokens, capture=None):
    """The Traces of prefill(prompt) and step(t) for each token but the last, written out."""
    with model.session(max_context=len(prompt_ids) + len(tokens)) as s:
        out = [s.prefill(prompt_ids, capture=capture, logits="last")]
        for t in tokens[:-1]:
            out.append(s.step(t, capture=capture, logits="last"))
    return out


def test_logprobs_equal_log_softmax_of_the_steps_logits(tiny):
    g = generate(tiny, PROMPT, max_new_tokens=8, logprobs=5)
    assert len(g.logprobs) == len(g.tokens) >= 1
    for entry, token, tr in zip(g.logprobs, g.tokens, _by_hand(tiny, g.prompt_tokens, g.tokens)):
        _check_token_logprobs(tiny.tokenizer, entry, tr.logits[-1], token, 5)
        # greedy: the token is the argmax, the first alternative
        assert token == int(tr.argmax[-1]) == entry.top[0][0]
        assert entry.logprob == entry.top[0][2] <= 0.0
        assert np.exp([v for _, _, v in entry.top]).sum() <= 1.0 + 1e-12


def test_logprobs_equal_the_captured_logits(tiny):
    g = generate(tiny, PROMPT, max_new_tokens=6, logprobs=3, capture="logits")
    for entry, token, tr in zip(g.logprobs, g.tokens, g.traces):
        _check_token_logprobs(tiny.tokenizer, entry, tr["logits"][-1], token, 3)
        np.testing.assert_array_equal(tr["logits"][-1], tr.logits[-1])


def test_logprobs_against_the_reference_engine(tiny_path):
    """The float32 reference ops against qwencuda.reference fed the same tokens: per token,
    max |engine - ref| of the log-probabilities <= 2 * ATOL * max|ref logits| (ATOL = 1e-3 of
    test_engine_vs_reference.py, doubled because log_softmax subtracts a log-sum-exp that moves
    by at most the logits' own error)."""
    with qc.Model(tiny_path, device="cpu:float", threads=1) as m:
        g = generate(m, PROMPT, max_new_tokens=6, logprobs=4)
    ref = qc.reference.forward_steps(qc.reference.load(tiny_path), g.prompt_tokens + g.tokens[:-1],
                                     len(g.prompt_tokens), capture=None)
    assert len(ref) == len(g.tokens)
    for entry, token, tr in zip(g.logprobs, g.tokens, ref):
        row = tr.logits[-1]
        want = _logprobs(row)
        tol = 2e-3 * np.max(np.abs(row))
        assert abs(entry.logprob - want[token]) <= tol
        for t, _, v in entry.top:
            assert abs(v - want[t]) <= tol
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] >= 1e-3:          # no near-tie: the same first choice
            assert entry.top[0][0] == int(np.argmax(row))


def test_greedy_tokens_unchanged_by_logprobs_and_capture(tiny):
    plain = generate(tiny, PROMPT, max_new_tokens=10)
    for kw in (dict(logprobs=5), dict(capture=ATTN), dict(capture=[ATTN, "logits"], logprobs=0)):
        g = generate(tiny, PROMPT, max_new_tokens=10, **kw)
        assert g.tokens == plain.tokens and g.text == plain.text, kw


def test_greedy_unchanged_by_capturing_everything_on_the_cpu(tiny_path):
    """capture="*" runs the unfused ops, which give the CPU's fused results bit for bit."""
    with qc.Model(tiny_path, device="cpu") as m:
        plain = generate(m, PROMPT, max_new_tokens=8, logprobs=2)
        g = generate(m, PROMPT, max_new_tokens=8, logprobs=2, capture="*")
    assert g.tokens == plain.tokens and g.logprobs == plain.logprobs


def test_sampled_tokens_unchanged_for_the_same_seed(tiny):
    kw = dict(max_new_tokens=12, temperature=1.3, top_k=40, top_p=0.95, seed=11)
    plain = generate(tiny, PROMPT, **kw)
    with_lp = generate(tiny, PROMPT, logprobs=3, **kw)
    with_both = generate(tiny, PROMPT, logprobs=3, capture=ATTN, **kw)
    assert plain.tokens == with_lp.tokens == with_both.tokens
    # the logprobs describe the model's raw distribution, not the sampler's: a drawn token need
    # not be the most likely one, and its logprob is log_softmax of the logits all the same
    for entry, token, tr in zip(with_lp.logprobs, with_lp.tokens,
                                _by_hand(tiny, with_lp.prompt_tokens, with_lp.tokens)):
        _check_token_logprobs(tiny.tokenizer, entry, tr.logits[-1], token, 3)


def test_traces_one_per_token_with_attention_over_the_context(tiny):
    c = tiny.config
    g = generate(tiny, PROMPT, max_new_tokens=6, capture=[ATTN, "blk.0.resid_out"])
    n = len(g.prompt_tokens)
    assert g.logprobs is None and len(g.traces) == len(g.tokens)
    for i, tr in enumerate(g.traces):
        assert list(tr.keys()) == [f"blk.{L}.{name}" for L in range(c.n_layer)
                                   for name in ("attn_probs", "resid_out") if L == 0 or name == "attn_probs"]
        rows = n if i == 0 else 1              # the prefill's trace covers the whole prompt
        np.testing.assert_array_equal(tr.ids, g.prompt_tokens if i == 0 else [g.tokens[i - 1]])
        np.testing.assert_array_equal(tr.positions, np.arange(n + i - rows, n + i))
        assert tr.token == g.tokens[i] and tr.logits is None
        for L in range(c.n_layer):
            p = tr[f"blk.{L}.attn_probs"]
            assert p.shape == (c.n_head, rows, n + i)     # n_kv = prompt_len + i
            np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
        assert tr["blk.0.resid_out"].shape == (rows, c.dim)
    # each trace is what the same pass shows when run by hand
    for tr, want in zip(g.traces, _by_hand(tiny, g.prompt_tokens, g.tokens, capture=ATTN)):
        for name in want.keys():
            np.testing.assert_array_equal(tr[name], want[name])


def test_stream_exposes_the_results_data(tiny):
    kw = dict(max_new_tokens=8, logprobs=3, capture=ATTN)
    it = generate(tiny, PROMPT, stream=True, **kw)
    for _ in it:
        assert len(it.tokens) == len(it.logprobs) == len(it.traces) >= 1
    g = it.result
    assert it.tokens is g.tokens and it.logprobs is g.logprobs and it.traces is g.traces
    whole = generate(tiny, PROMPT, **kw)
    assert whole.tokens == g.tokens and whole.logprobs == g.logprobs
    for a, b in zip(whole.traces, g.traces):
        for name in a.keys():
            np.testing.assert_array_equal(a[name], b[name])


def test_no_tokens_no_traces(tiny):
    g = generate(tiny, PROMPT, max_new_tokens=0, capture=ATTN, logprobs=2)
    assert g.tokens == [] and g.traces == [] and g.logprobs == []


def test_chat_passes_capture_and_logprobs(tiny):
    msgs = [{"role": "user", "content": "Hi"}]
    g = tiny.chat(msgs, max_new_tokens=4, logprobs=2, capture="blk.1.attn_probs")
    want = generate(tiny, "Hi", chat=True, max_new_tokens=4, logprobs=2, capture="blk.1.attn_probs")
    assert g.tokens == want.tokens and g.logprobs == want.logprobs
    assert [t["blk.1.attn_probs"].shape for t in g.traces] == [t["blk.1.attn_probs"].shape for t in want.traces]


def test_bad_capture_and_logprobs_before_any_work(tiny, monkeypatch):
    def no_session(*a, **kw):
        raise AssertionError("a session was made before the arguments were checked")

    monkeypatch.setattr(tiny, "session", no_session)
    n_vocab = tiny.config.n_vocab
    for kw, exc, match in [(dict(capture="blk.*.nope"), ValueError, "matches no capture name"),
                           (dict(capture=["logits", "nope"]), ValueError, "matches no capture name"),
                           (dict(capture=[3]), TypeError, "capture patterns must be str"),
                           (dict(logprobs=-1), ValueError, "int >= 0"),
                           (dict(logprobs=n_vocab + 1), ValueError, "vocabulary")]:
        for stream in (False, True):
            with pytest.raises(exc, match=match):
                generate(tiny, PROMPT, stream=stream, **kw)
            with pytest.raises(exc, match=match):
                tiny.chat([{"role": "user", "content": "Hi"}], stream=stream, **kw)
    monkeypatch.undo()
    g = generate(tiny, PROMPT, max_new_tokens=2, logprobs=n_vocab)   # the whole vocabulary
    assert [len(e.top) for e in g.logprobs] == [n_vocab, n_vocab]
    assert np.exp([v for _, _, v in g.logprobs[0].top]).sum() == pytest.approx(1.0, abs=1e-9)


# ------------------------------------------------------------------------------- patch=

def test_patched_logits_choose_the_tokens(tiny):
    """A patch of the logits reaches the sampler on the device and the logprobs alike."""
    bias = np.zeros(tiny.config.n_vocab, dtype=np.float32)
    bias[77] = 1e4
    g = generate(tiny, PROMPT, max_new_tokens=4, logprobs=2, patch={"logits": qc.Add(bias)})
    assert g.tokens == [77] * 4
    assert all(e.logprob == pytest.approx(0.0, abs=1e-9) and e.top[0][0] == 77 for e in g.logprobs)


def test_patch_in_every_call_equals_a_hand_loop(tiny):
    """A steering vector on every token's residual stream: generate() equals prefill/step with
    the same patch written out, tokens, logprobs and traces."""
    rng = np.random.default_rng(5)
    patch = {"blk.0.resid_out": qc.Add(rng.standard_normal(tiny.config.dim).astype(np.float32) * 2)}
    g = generate(tiny, PROMPT, max_new_tokens=6, logprobs=3, capture="blk.1.attn_probs", patch=patch)
    assert g.tokens != generate(tiny, PROMPT, max_new_tokens=6).tokens   # the patch matters
    with tiny.session(max_context=len(g.prompt_tokens) + 6) as s:
        want = [s.prefill(g.prompt_tokens, capture="blk.1.attn_probs", patch=patch)]
        for t in g.tokens[:-1]:
            want.append(s.step(t, capture="blk.1.attn_probs", patch=patch))
    for entry, token, tr, w in zip(g.logprobs, g.tokens, g.traces, want):
        assert token == int(w.argmax[-1])
        _check_token_logprobs(tiny.tokenizer, entry, w.logits[-1], token, 3)
        np.testing.assert_array_equal(tr["blk.1.attn_probs"], w["blk.1.attn_probs"])


def test_patched_logprobs_against_the_reference(tiny_path):
    """The same patch in the NumPy reference, fed the engine's tokens (tolerance as above)."""
    patch = {"blk.*.attn_probs": qc.ZeroHeads([1])}
    with qc.Model(tiny_path, device="cpu:float", threads=1) as m:
        g = generate(m, PROMPT, max_new_tokens=5, logprobs=4, patch=patch)
    ref = qc.reference.forward_steps(qc.reference.load(tiny_path), g.prompt_tokens + g.tokens[:-1],
                                     len(g.prompt_tokens), capture=None, patch=patch)
    for entry, token, tr in zip(g.logprobs, g.tokens, ref):
        want = _logprobs(tr.logits[-1])
        tol = 2e-3 * np.max(np.abs(tr.logits[-1]))
        assert abs(entry.logprob - want[token]) <= tol
        assert max(abs(v - want[t]) for t, _, v in entry.top) <= tol


def test_bad_patch_before_any_work(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "session", lambda *a, **kw: pytest.fail("a session was made"))
    with pytest.raises(ValueError, match="matches no tensor"):
        generate(tiny, PROMPT, patch={"blk.9.nope": 0.0}, stream=True)
    with pytest.raises(TypeError, match="patch must be a dict"):
        tiny.chat([{"role": "user", "content": "Hi"}], patch=[qc.Scale(2.0)])


# ------------------------------------------------------------------------ the command line

def _cli_generate(path, *extra):
    return cli.main(["generate", "--model", path, "--device", "cpu", "--raw", "-n", "5", "-q",
                     *extra, PROMPT])


def test_cli_prints_logprobs(tiny_path, capsys):
    assert _cli_generate(tiny_path, "--logprobs", "3") == 0
    out = capsys.readouterr().out
    with qc.Model(tiny_path, device="cpu") as m:
        g = generate(m, PROMPT, max_new_tokens=5, logprobs=3)
    text, header, table = out.partition("logprobs: index id token logprob | the top 3")
    assert header and text.rstrip("\n") == g.text.rstrip("\n")
    rows = table.split("\n")[1:-1]
    assert len(rows) == len(g.tokens)
    for i, (line, entry) in enumerate(zip(rows, g.logprobs)):
        head, alts = line.split("  |  ")
        index, token, _text, value = head.split()
        assert (int(index), int(token)) == (i, entry.token)
        assert float(value) == pytest.approx(entry.logprob, abs=5e-5)
        shown = [float(v) for v in alts.split()[1::2]]
        assert shown == pytest.approx([v for _, _, v in entry.top], abs=5e-5)


def test_cli_saves_traces(tiny_path, capsys, tmp_path):
    folder = str(tmp_path / "traces")
    assert _cli_generate(tiny_path, "--capture", "blk.0.attn_probs", "--save-traces", folder) == 0
    with qc.Model(tiny_path, device="cpu") as m:
        g = generate(m, PROMPT, max_new_tokens=5, capture="blk.0.attn_probs")
    files = sorted(os.listdir(folder))
    assert files == [f"token_{i:04d}.npz" for i in range(len(g.tokens))]
    for f, want in zip(files, g.traces):
        tr = qc.Trace.load(os.path.join(folder, f))
        np.testing.assert_array_equal(tr["blk.0.attn_probs"], want["blk.0.attn_probs"])


def test_cli_bad_values_exit_1(tiny_path, capsys):
    assert _cli_generate(tiny_path, "--logprobs", "-1") == 1
    assert "logprobs" in capsys.readouterr().err
    assert _cli_generate(tiny_path, "--capture", "blk.0.nope", "--save-traces", "x") == 1
    assert "matches no capture name" in capsys.readouterr().err
    assert _cli_generate(tiny_path, "--capture", "blk.0.attn_probs") == 1
    assert "--save-traces" in capsys.readouterr().err


# ------------------------------------------------------------------------------ real model

@pytest.mark.realmodel
def test_real_chat_logprobs_and_attention(real_model_path):
    """Three greedy tokens of a chat answer on the real Q4_K_M file: the same tokens with and
    without internals, log-probabilities of the logits a hand-written session loop with the same
    capture gets, the last layer's attention over the whole context. (The same capture: a step
    that captures runs the ops one by one, whose logits a plain step's folded down projection
    (backend.h, swiglu_down) matches to about 1e-3, not to float64 rounding; test_swiglu_down.py
    holds the two paths to each other.)"""
    with qc.Model(real_model_path, device="auto") as m:
        msgs = [{"role": "user", "content": "Reply with just the word: yes"}]
        plain = m.chat(msgs, max_new_tokens=3)
        g = m.chat(msgs, max_new_tokens=3, logprobs=5, capture="blk.23.attn_probs")
        assert g.tokens == plain.tokens
        n = len(g.prompt_tokens)
        for i, (entry, token, tr, want) in enumerate(zip(g.logprobs, g.tokens, g.traces,
                                                         _by_hand(m, g.prompt_tokens, g.tokens,
                                                                  capture="blk.23.attn_probs"))):
            _check_token_logprobs(m.tokenizer, entry, want.logits[-1], token, 5)
            assert tr["blk.23.attn_probs"].shape == (m.config.n_head, n if i == 0 else 1, n + i)
        assert "yes" in g.logprobs[0].text.lower() + g.logprobs[1].text.lower()
