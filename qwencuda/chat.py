"""Chat templates: turn a list of messages into the exact prompt text the model was trained on.

A GGUF file carries its chat template (`tokenizer.chat_template`) as Jinja2 source written for
HF transformers, so it is rendered here the way transformers renders it: an immutable sandboxed
Jinja2 environment with trim_blocks and lstrip_blocks, the `loopcontrols` extension, a
`tojson` filter that keeps non-ASCII text, and the globals `raise_exception` and
`strftime_now`; the template sees `messages`, `add_generation_prompt`, `tools`, `documents`
and the special-token strings (`bos_token`, `eos_token`, ...). A prompt that differs from the
training format by a single newline is enough to make a small model ramble, so the tests pin
the rendered strings for the real Qwen2.5 template character by character.

Files without a template get ChatML, the format of every Qwen2/Qwen2.5 instruct model.
"""
import datetime
import functools
import json

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")

# ChatML, for files that carry no template (what transformers used as its default).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template is broken, or refused the messages (its raise_exception)."""


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template does not parse: {exc.message} (template line {exc.lineno})"
        ) from None


def check_messages(messages) -> list:
    """Validate a conversation: a list of {"role", "content"} dicts with known roles.

    Assistant messages may carry `tool_calls` instead of content. Returns plain dict copies
    so that the template cannot see (or change) the caller's objects."""
    if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"message {i} is a {type(msg).__name__}, expected a dict")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; known roles: {', '.join(ROLES)}")
        content = msg.get("content")
        if content is None and not (role == "assistant" and msg.get("tool_calls")):
            raise ValueError(f"message {i} ({role}) has no 'content'")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a str, "
                             f"not {type(content).__name__}")
        out.append(dict(msg))
    if not out:
        raise ValueError("messages is empty")
    return out


def render_chat(template, messages, add_generation_prompt=True, tools=None, documents=None,
                bos_token="", eos_token="", **extra) -> str:
    """Render messages with a Jinja2 chat template as HF transformers would.

    template None (or empty) selects ChatML. Unknown roles and malformed messages raise
    ValueError; a template that fails to parse or render raises ChatTemplateError (a
    ValueError) that names the problem. `extra` reaches the template as variables."""
    msgs = check_messages(messages)
    compiled = _compile(template or CHATML_TEMPLATE)
    try:
        return compiled.render(
            messages=msgs, add_generation_prompt=add_generation_prompt, tools=tools,
            documents=documents, bos_token=bos_token, eos_token=eos_token, **extra,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: "
                                f"{type(exc).__name__}: {exc}") from None
    except Exception as exc:  # any error inside the template is the template's problem
        raise ChatTemplateError(f"the chat template failed to render these messages: "
                                f"{type(exc).__name__}: {exc}") from None


def _token_text(tokenizer, token_id):
    if token_id is None or token_id < 0:
        return ""
    try:
        return tokenizer.token(token_id)
    except (ValueError, IndexError, KeyError):
        return ""


def render_for(tokenizer, messages, add_generation_prompt=True, tools=None) -> str:
    """Render with the template a tokenizer (i.e. a GGUF file) carries, ChatML if none."""
    return render_chat(
        getattr(tokenizer, "chat_template", None), messages,
        add_generation_prompt=add_generation_prompt, tools=tools,
        bos_token=_token_text(tokenizer, getattr(tokenizer, "bos_id", None)),
        eos_token=_token_text(tokenizer, getattr(tokenizer, "eos_id", None)),
    )


def chat(model, messages, tools=None, **gen_kwargs):
    """Answer a conversation: render it with the model's template, then generate the
    assistant's reply with model.generate (stopping at eos / <|im_end|>). Takes generate()'s
    keyword arguments (capture= and logprobs=k included: the reply's traces and
    log-probabilities) and returns what it returns (a Generation, or a stream with stream=True).
    This module never imports qwencuda.generation (which renders templates with it)."""
    if gen_kwargs.get("chat") or gen_kwargs.get("system") is not None:
        raise ValueError("chat() takes the system prompt as a message, not chat=/system=")
    prompt = render_for(model.tokenizer, messages, add_generation_prompt=True, tools=tools)
    gen_kwargs.setdefault("allow_special", True)
    return model.generate(prompt, **gen_kwargs)
