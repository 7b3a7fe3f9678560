"""A scripted stand-in for Model/Session/Tokenizer/Sampler, for testing the generation loop.

Its tokenizer is byte-level (ids 0..255 are the bytes) plus three special tokens, and its
"model" emits a fixed script of tokens after any prompt, so that every stop condition,
UTF-8 boundary and context edge can be staged exactly. The real engine is tested on
synthetic GGUF models in the same files; this only isolates the loop's own logic."""
import codecs
import re

import numpy as np

ENDOFTEXT, IM_START, IM_END = 256, 257, 258
SPECIAL = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
N_VOCAB = 260


class FakeStreamDecoder:
    def __init__(self, tok):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token):
        return self._dec.decode(self._tok.decode_bytes([token]))

    def flush(self):
        return self._dec.decode(b"", final=True)


class FakeTokenizer:
    eos_id = IM_END
    bos_id = ENDOFTEXT
    pad_id = ENDOFTEXT
    special_ids = dict(SPECIAL)
    chat_template = None
    n_vocab = N_VOCAB

    def encode(self, text, allow_special=False):
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if not allow_special:
            return list(text.encode("utf-8"))
        ids = []
        for part in re.split("(" + "|".join(re.escape(s) for s in SPECIAL) + ")", text):
            ids.extend([SPECIAL[part]] if part in SPECIAL else part.encode("utf-8"))
        return ids

    def decode_bytes(self, ids):
        inv = {v: k for k, v in SPECIAL.items()}
        return b"".join(inv[i].encode() if i in inv else bytes([i]) for i in ids if i < 259)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token(self, i):
        return self.decode_bytes([i]).decode("utf-8", errors="replace")

    def stream_decoder(self):
        return FakeStreamDecoder(self)


class FakeTrace:
    """The scripted next token as logits; with a sampler (as qwencuda's Session draws on the
    device) also as the sampler's draw from them, in .token."""

    def __init__(self, next_token, logits="last", sampler=None):
        row = np.full((1, N_VOCAB), -10.0, dtype=np.float32)
        row[0, next_token] = 10.0
        self.token = None if sampler is None else int(sampler.sample(row[0]))
        self.logits = row if logits is not None else None


class FakeSession:
    def __init__(self, model, max_context):
        self.model, self.max_context, self.position = model, max_context, 0
        self.n_prompt = None
        self.closed = False
        self.prefill_calls = []

    def _next(self):
        k = self.position - self.n_prompt
        script = self.model.script
        return script[k] if k < len(script) else IM_END

    def prefill(self, ids, logits="last", sampler=None):
        assert self.n_prompt is None or self.n_prompt == self.position, "prefill after step"
        if self.position + len(ids) > self.max_context:
            raise ValueError("context full")
        self.prefill_calls.append(len(ids))
        self.position += len(ids)
        self.n_prompt = self.position
        return FakeTrace(self._next(), logits, sampler)

    def step(self, token, logits="last", sampler=None):
        if self.position + 1 > self.max_context:
            raise ValueError("context full")
        self.model.stepped.append(token)
        self.position += 1
        return FakeTrace(self._next(), logits, sampler)

    def close(self):
        self.closed = True


class FakeConfig:
    n_vocab = N_VOCAB
    n_ctx_train = 64


class FakeModel:
    """Emits `script` (a list of ids, or a str whose UTF-8 bytes are the ids) after any prompt,
    then <|im_end|>."""

    def __init__(self, script, n_ctx_train=64):
        self.script = list(script.encode("utf-8")) if isinstance(script, str) else list(script)
        self.tokenizer = FakeTokenizer()
        self.config = FakeConfig()
        self.config.n_ctx_train = n_ctx_train
        self.sessions = []
        self.stepped = []
        self.device = "cpu"
        self.path = "fake.gguf"
        self.closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True

    def session(self, max_context=4096):
        s = FakeSession(self, max_context)
        self.sessions.append(s)
        return s

    def generate(self, *args, **kwargs):   # as Model.generate
        from qwencuda.generation import generate

        return generate(self, *args, **kwargs)


class GreedySampler:
    def __init__(self, n_vocab, **kwargs):
        self.accepted = []

    def sample(self, logits):
        return int(np.argmax(logits))

    def accept(self, token):
        self.accepted.append(token)
