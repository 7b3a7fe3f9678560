"""Chat templates render exactly as HF transformers renders them.

The expected strings below are what transformers' apply_chat_template(tokenize=False) gives
for Qwen2.5 instruct models, written out by hand: a single differing newline changes the
prompt tokens, and a small model notices."""
import json

import pytest

from qwencuda import chat as chat_mod
from qwencuda.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat

from fake_engine import FakeModel, GreedySampler

SYS = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"

# (messages, add_generation_prompt, expected) for the Qwen2.5 template
QWEN_CASES = [
    ([{"role": "user", "content": "Write a haiku about GPUs"}], True,
     SYS + "<|im_start|>user\nWrite a haiku about GPUs<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": "Hi"}], False,
     SYS + "<|im_start|>user\nHi<|im_end|>\n"),
    ([{"role": "system", "content": "You are a poet."},
      {"role": "user", "content": "Write."},
      {"role": "assistant", "content": "Done."},
      {"role": "user", "content": "Again,\nplease."}], True,
     "<|im_start|>system\nYou are a poet.<|im_end|>\n<|im_start|>user\nWrite.<|im_end|>\n"
     "<|im_start|>assistant\nDone.<|im_end|>\n<|im_start|>user\nAgain,\nplease.<|im_end|>\n"
     "<|im_start|>assistant\n"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], False,
     SYS + "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"),
    # a system message that is not first is an ordinary turn
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], True,
     SYS + "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nlate<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": "  spaces  and ünïcödé 世界 🙂 "}], True,
     SYS + "<|im_start|>user\n  spaces  and ünïcödé 世界 🙂 <|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "x"}], True,
     "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"),
    # tool calling: the assistant's call and the tool's answer
    ([{"role": "user", "content": "Time?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}}]},
      {"role": "tool", "content": "12:00"},
      {"role": "tool", "content": "13:00"}], True,
     SYS + "<|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
     '{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>\n'
     "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n"
     "</tool_response><|im_end|>\n<|im_start|>assistant\n"),
]

TOOLS = [{"type": "function", "function": {"name": "now", "description": "Zeit für tz",
                                            "parameters": {"type": "object"}}}]
TOOLS_EXPECTED = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "now", "description": "Zeit für tz", '
    '"parameters": {"type": "object"}}}\n</tools>\n\nFor each function call, return a json '
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n"
)


def _template_from_file(path):
    """The file's tokenizer.chat_template, as the metadata stores it."""
    import qwencuda as qc

    with qc.GGUFFile(path) as f:
        return f.metadata.get("tokenizer.chat_template")


@pytest.fixture(scope="module")
def real_template(real_model_path):
    t = _template_from_file(real_model_path)
    assert t and "<|im_start|>" in t
    return t


@pytest.mark.realmodel
@pytest.mark.parametrize("messages,agp,expected", QWEN_CASES)
def test_real_template_matches_hf(real_template, messages, agp, expected):
    assert render_chat(real_template, messages, add_generation_prompt=agp) == expected


@pytest.mark.realmodel
def test_render_for_uses_the_files_template(real_model_path, real_template):
    import qwencuda as qc

    tok = qc.Tokenizer(real_model_path)
    assert tok.chat_template == real_template
    messages, agp, expected = QWEN_CASES[0]
    assert chat_mod.render_for(tok, messages, add_generation_prompt=agp) == expected


@pytest.mark.realmodel
def test_real_template_with_tools(real_template):
    out = render_chat(real_template, [{"role": "user", "content": "Time?"}], tools=TOOLS)
    assert out == TOOLS_EXPECTED


@pytest.fixture(scope="module")
def synthetic_template(tmp_path_factory):
    import qwencuda as qc

    path = str(tmp_path_factory.mktemp("chat") / "tiny.gguf")
    qc.testing.write_model(path, config="tiny", weight_type="f32")
    return _template_from_file(path)


@pytest.mark.parametrize("messages,agp,expected", QWEN_CASES[:4])
def test_synthetic_model_carries_qwen_template(synthetic_template, messages, agp, expected):
    assert render_chat(synthetic_template, messages, add_generation_prompt=agp) == expected


def test_chatml_fallback():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, msgs) == expected
    assert render_chat("", msgs) == expected
    assert render_chat(CHATML_TEMPLATE, msgs, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]


def test_trim_and_lstrip_blocks_like_hf():
    t = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
    assert render_chat(t, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"


def test_template_helpers():
    t = ("{{ bos_token }}{{ messages[0] | tojson }}|{{ messages[0].content | tojson(indent=1) }}"
         "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
         "{{ eos_token }}{% if tools is none %}!{% endif %}")
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "z"}]
    out = render_chat(t, msgs, bos_token="<s>", eos_token="</s>")
    assert out == '<s>' + json.dumps(msgs[0], ensure_ascii=False) + '|"é"z</s>!'
    assert len(render_chat("{{ strftime_now('%Y') }}", msgs)) == 4


def test_raise_exception_in_template():
    t = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat(t, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat(t, [{"role": "assistant", "content": "x"}])


def test_broken_templates_name_the_problem():
    with pytest.raises(ChatTemplateError, match="does not parse.*line 1"):
        render_chat("{% for m in messages %}{{ m.content }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat("{{ 1 / 0 }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat("{{ messages[0].content + 5 }}", [{"role": "user", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_sandbox():
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__ }}{{ cycler.__init__.__globals__.os }}",
                    [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("bad", [
    "hello",
    [{"role": "robot", "content": "x"}],
    [{"content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": ["a"]}],
    ["user: hi"],
    [],
    None,
])
def test_bad_messages(bad):
    with pytest.raises(ValueError):
        render_chat(None, bad)


def test_assistant_with_only_tool_calls_is_valid():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    chat_mod.check_messages(msgs)


def test_caller_messages_untouched():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):    # the immutable sandbox refuses to mutate
        render_chat("{% set _ = messages[0].update({'content': 'y'}) %}", msgs)
    assert msgs == [{"role": "user", "content": "x"}]


def test_chat_generates_the_reply(monkeypatch):
    from qwencuda import generation

    monkeypatch.setattr(generation, "_make_sampler", lambda model, kw: GreedySampler(0))
    m = FakeModel("Sure.")
    g = chat_mod.chat(m, [{"role": "user", "content": "Hi"}])
    assert g.text == "Sure." and g.stop_reason == "eos"
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"   # the fake has no template: ChatML
    assert g.prompt_tokens == m.tokenizer.encode(expected, allow_special=True)
    it = chat_mod.chat(m, [{"role": "user", "content": "Hi"}], stream=True)
    assert "".join(it) == "Sure."
    with pytest.raises(ValueError):
        chat_mod.chat(m, [{"role": "wizard", "content": "Hi"}])
