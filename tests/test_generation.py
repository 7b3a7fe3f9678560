"""generate(): the decode loop's stop conditions, streaming, UTF-8 safety and determinism.

Two layers: a scripted fake engine (tests/fake_engine.py) stages exact edge cases of the loop
itself; tiny synthetic GGUF models run the same calls through the real engine, tokenizer and
sampler. The real model checks that <|im_end|> ends a chat answer."""
import numpy as np
import pytest

import qwencuda as qc
from qwencuda import generation as gen_mod
from qwencuda.generation import Generation, generate

from fake_engine import IM_END, IM_START, FakeModel, GreedySampler


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(gen_mod, "_make_sampler", lambda model, kw: GreedySampler(0, **kw))

    def make(script):
        return FakeModel(script)

    return make


# ---------------------------------------------------------------- the loop, on a fake engine

def test_stops_at_eos_and_hides_its_text(fake):
    m = fake("hello")
    g = generate(m, "hi")
    assert isinstance(g, Generation)
    assert g.text == "hello" and g.stop_reason == "eos"
    assert g.tokens == list(b"hello") + [IM_END]
    assert g.prompt_tokens == list(b"hi")
    assert m.sessions[-1].closed


def test_im_end_and_endoftext_both_end(fake):
    assert generate(fake(list(b"ab") + [256] + list(b"cd")), "x").text == "ab"


def test_other_special_tokens_are_text(fake):
    g = generate(fake(list(b"a") + [IM_START] + list(b"b")), "x")
    assert g.text == "a<|im_start|>b"


def test_max_new_tokens(fake):
    g = generate(fake("abcdefgh"), "x", max_new_tokens=3)
    assert g.text == "abc" and g.stop_reason == "length" and len(g.tokens) == 3
    g0 = generate(fake("abc"), "x", max_new_tokens=0)
    assert g0.text == "" and g0.tokens == [] and g0.stop_reason == "length"


def test_stop_strings(fake):
    g = generate(fake("one two. three"), "x", stop=[". ", "zzz"])
    assert g.text == "one two" and g.stop_reason == "stop"
    assert generate(fake("abcdef"), "x", stop="cd").text == "ab"
    # the earliest of several stop strings wins
    assert generate(fake("abcdef"), "x", stop=["de", "bc"]).text == "a"


def test_stop_string_never_streamed(fake):
    """Text that turns out to start a stop string is held back, never shown then retracted."""
    it = generate(fake("ab<END>cd"), "x", stop="<END>", stream=True)
    pieces = list(it)
    assert "".join(pieces) == "ab" == it.result.text
    assert not any("<" in p for p in pieces)
    # a false start is released once it can no longer match
    it = generate(fake("a<EN!b"), "x", stop="<END>", stream=True)
    assert "".join(it) == "a<EN!b"


def test_stop_string_made_of_special_text(fake):
    g = generate(fake(list(b"ok") + [IM_START] + list(b"user")), "x", stop="<|im_start|>")
    assert g.text == "ok" and g.stop_reason == "stop"


def test_stream_pieces_concatenate_to_text(fake):
    it = generate(fake("streamed text"), "x", stream=True)
    assert it.result is None
    pieces = list(it)
    assert len(pieces) > 1
    assert "".join(pieces) == it.result.text == "streamed text"
    assert it.result.stop_reason == "eos"


def test_utf8_never_split(fake):
    text = "é世🙂x"                          # 2-, 3- and 4-byte characters, one byte per token
    it = generate(fake(text), "x", stream=True)
    pieces = list(it)
    assert "".join(pieces) == text
    for p in pieces:
        assert "\ufffd" not in p
    assert pieces == ["é", "世", "🙂", "x"]


def test_truncated_utf8_at_the_end_is_flushed(fake):
    g = generate(fake(list("a世".encode())[:-1]), "x")
    assert g.text.startswith("a") and g.stop_reason == "eos"


def test_context_stops_without_exception(fake):
    m = fake("abcdefghijklmnop")
    g = generate(m, "xyz", max_new_tokens=100, max_context=8)
    assert g.stop_reason == "context"
    # positions 3..7 hold a..e; f is sampled from the logits of position 7, then the cache is full
    assert g.text == "abcdef"
    assert m.sessions[-1].position == 8


def test_prompt_that_does_not_fit_fails_before_work(fake):
    m = fake("abc")
    with pytest.raises(ValueError, match="prompt has 10 tokens"):
        generate(m, "0123456789", max_context=8)
    with pytest.raises(ValueError, match="context"):
        generate(m, "x" * 65)                 # the fake model's training context is 64
    with pytest.raises(ValueError):
        generate(m, "0123456789", max_context=8, stream=True)   # eagerly, not on first next()
    assert m.sessions == []


def test_prompt_exactly_the_context(fake):
    g = generate(fake("abc"), "01234567", max_context=8, max_new_tokens=5)
    assert g.text == "a" and g.stop_reason == "context"


def test_default_context_is_sized_to_the_request(fake):
    m = fake("abc")
    generate(m, "01234", max_new_tokens=7)
    assert m.sessions[-1].max_context == 12
    generate(m, "0" * 60, max_new_tokens=100)
    assert m.sessions[-1].max_context == 64   # capped by the training context


def test_bad_arguments(fake):
    m = fake("a")
    for kwargs in [dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=-0.1),
                   dict(top_p=1.5), dict(min_p=2.0), dict(repeat_penalty=0.0), dict(top_k=-3),
                   dict(stop=[""]), dict(system="s"), dict(max_context=0)]:
        with pytest.raises(ValueError):
            generate(m, "x", **kwargs)
    with pytest.raises(ValueError, match="empty"):
        generate(m, "")
    with pytest.raises(ValueError, match="empty"):
        generate(m, [])
    with pytest.raises(ValueError, match="out of range"):
        generate(m, [1, 99999])
    with pytest.raises(ValueError):
        generate(m, [1, 2], chat=True)
    assert m.sessions == []


def test_token_id_prompt(fake):
    g = generate(fake("ok"), [104, 105])
    assert g.prompt_tokens == [104, 105] and g.text == "ok"


def test_allow_special(fake):
    m = fake("a")
    assert generate(m, "<|im_start|>x").prompt_tokens == [IM_START, ord("x")]
    assert generate(m, "<|im_start|>x", allow_special=False).prompt_tokens == list(b"<|im_start|>x")


def test_chat_flag_uses_template(fake):
    g = generate(fake("ok"), "Hi", chat=True, system="Be brief.")
    tok = FakeModel("").tokenizer
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert g.prompt_tokens == tok.encode(expected, allow_special=True)


def test_long_prompt_prefills_in_chunks(fake, monkeypatch, capsys):
    monkeypatch.setattr(gen_mod, "PREFILL_CHUNK", 4)
    m = fake("ok")
    g = generate(m, "0123456789", progress=True)
    assert m.sessions[-1].prefill_calls == [4, 4, 2]
    assert g.text == "ok"


def test_cancelled_stream_closes_session(fake):
    m = fake("abcdefgh")
    it = generate(m, "x", stream=True)
    assert next(it) == "a"
    it.close()
    assert it.result.stop_reason == "cancelled" and it.result.text == "a"
    assert m.sessions[-1].closed


def test_speed_fields(fake):
    g = generate(fake("abc"), "xyz")
    assert g.prefill_tokens_per_s > 0 and g.decode_tokens_per_s > 0
    assert g.timings["prompt_tokens"] == 3 and g.timings["generated_tokens"] == 4
    assert g.timings["total_s"] >= g.timings["prefill_s"]
    assert str(g) == "abc"


def test_eos_token_is_not_stepped(fake):
    m = fake("ab")
    generate(m, "x")
    assert m.stepped == list(b"ab")


# ------------------------------------------------------- the real engine, on synthetic models

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(qc.testing.write_model(str(tmp_path_factory.mktemp("gen") / "tiny.gguf"),
                                   config="tiny", weight_type="f32", seed=3))


@pytest.fixture
def tiny(tiny_path, device):
    with qc.Model(tiny_path, device=device) as m:
        yield m


def test_greedy_is_deterministic(tiny):
    a = generate(tiny, "Hello world", max_new_tokens=12)
    b = generate(tiny, "Hello world", max_new_tokens=12)
    assert a.tokens == b.tokens and a.text == b.text
    assert 1 <= len(a.tokens) <= 12


def test_greedy_equals_argmax_of_forward(tiny):
    """The loop adds nothing: greedy tokens are the argmax of a full forward each time."""
    g = generate(tiny, "Hello world", max_new_tokens=6)
    ids = list(g.prompt_tokens)
    for t in g.tokens:
        tr = tiny.forward(ids, logits="last")
        assert int(np.argmax(tr.logits[-1])) == t
        ids.append(t)


def test_tiny_stream_matches(tiny):
    it = generate(tiny, "Hello world", max_new_tokens=10, stream=True)
    pieces = list(it)
    assert "".join(pieces) == it.result.text
    assert it.result.text == generate(tiny, "Hello world", max_new_tokens=10).text


def test_tiny_sampling_seeded(tiny):
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    assert generate(tiny, "Hello", **kw).tokens == generate(tiny, "Hello", **kw).tokens


def test_tiny_max_tokens_and_context(tiny):
    g = generate(tiny, "Hello", max_new_tokens=5)
    assert len(g.tokens) == 5 or g.stop_reason == "eos"
    n = len(g.prompt_tokens)
    g2 = generate(tiny, "Hello", max_new_tokens=50, max_context=n + 3)
    assert g2.stop_reason in ("context", "eos")
    if g2.stop_reason == "context":
        assert len(g2.tokens) == 4


def test_tiny_stop_string(tiny):
    g = generate(tiny, "Hello", max_new_tokens=12)
    if len(g.text) < 3:
        pytest.skip("the synthetic model produced too little text")
    stop = g.text[1:3]
    g2 = generate(tiny, "Hello", max_new_tokens=12, stop=stop)
    assert g2.stop_reason == "stop"
    assert g2.text == g.text[: g.text.find(stop)]


def test_model_generate_and_chat_methods(tiny):
    assert tiny.generate("Hello", max_new_tokens=4).tokens == generate(tiny, "Hello", max_new_tokens=4).tokens
    msgs = [{"role": "user", "content": "Hello"}]
    assert tiny.chat(msgs, max_new_tokens=4).tokens == generate(tiny, "Hello", chat=True, max_new_tokens=4).tokens


# ------------------------------------------------------------------------------ real model

@pytest.fixture(scope="module")
def real(real_model_path):
    with qc.Model(real_model_path, device="auto") as m:
        yield m


@pytest.mark.realmodel
def test_real_chat_stops_at_im_end(real):
    g = real.chat([{"role": "user", "content": "Reply with just the word: yes"}], max_new_tokens=16)
    assert g.stop_reason == "eos"
    assert g.tokens[-1] == real.tokenizer.special_ids["<|im_end|>"]
    assert "<|im_end|>" not in g.text
    assert "yes" in g.text.lower()


@pytest.mark.realmodel
def test_real_stream_never_splits_characters(real):
    """Rare characters take several byte-level tokens each; the stream must hold the bytes
    back until a character is complete."""
    it = real.chat([{"role": "user", "content": "Repeat exactly: 🧬🪐 ꙮ"}], max_new_tokens=12,
                   stream=True)
    pieces = list(it)
    g = it.result
    assert "".join(pieces) == g.text
    assert not any("\ufffd" in p for p in pieces)
    split = [t for t in g.tokens if "\ufffd" in real.tokenizer.decode([t])]
    assert split, "expected some tokens that are partial UTF-8 characters"
    assert "🧬" in g.text or "🪐" in g.text
