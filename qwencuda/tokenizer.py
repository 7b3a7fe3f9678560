"""Qwen2's tokenizer: byte-level BPE from a GGUF file, in C.

    import qwencuda as qc
    tok = qc.Tokenizer("model.gguf")               # or a qc.GGUFFile
    ids = tok.encode("Hello, world!")               # [9707, 11, 1879, 0]
    tok.decode(ids)                                 # 'Hello, world!'
    tok.encode("<|im_start|>user", allow_special=True)   # [151644, 872]

What happens to a text, in order:
  1. control tokens (<|im_start|>, <|endoftext|>, ...; only with allow_special=True) and
     user-defined tokens (<tool_call>, ...; always, as in HF and llama.cpp) are cut out as whole
     tokens, leftmost first, the longest where several start at one place;
  2. the text between them is normalised to NFC (normalize="nfc", HF's Qwen2 tokenizer) or left
     alone (normalize=None, llama.cpp);
  3. the Qwen2 pre-tokenizer regex splits it into words, and each word's UTF-8 bytes are merged by
     the file's BPE merges, lowest rank first.
Steps 1 and 3 are C (csrc/engine/tokenizer.c), which runs without the GIL.

Decoding gives the bytes of each token (byte-level tokens map back to their bytes, control and
user-defined tokens give their text); `decode` makes text of them with errors="replace", and a
`stream_decoder()` gives text token by token without ever splitting a UTF-8 character.
"""
from __future__ import annotations

import codecs
import os
import unicodedata

from . import _core

__all__ = ["Tokenizer", "StreamDecoder", "pretokenize", "UNICODE_VERSION"]

# The Unicode version of the pre-tokenizer's character classes (csrc/engine/unicode_data.c).
UNICODE_VERSION: str = _core.tokenizer_unicode_version

_NORMAL_FORMS = (None, "nfc")
_SPECIAL_USER, _SPECIAL_ALL, _SPECIAL_NONE = 1, 2, 0


def pretokenize(text):
    """The Qwen2 pre-tokenizer alone: the pieces of text (str -> list[str], bytes -> list[bytes]),
    exactly as the regex of Qwen2's tokenizer.json splits it. No normalisation."""
    return _core._pretokenize(text)


class Tokenizer:
    """The byte-level BPE tokenizer of a Qwen2 GGUF file.

    Tokenizer(path_or_GGUFFile, normalize="nfc"): normalize "nfc" applies Unicode NFC to the text
    before splitting it, as HF's Qwen2 tokenizer does; None leaves the text as it is, as
    llama.cpp does. The two differ only on text that is not already NFC (e.g. "e\\u0301").

    The file's tokenizer.ggml.model must be "gpt2" and its tokenizer.ggml.pre "qwen2" (or absent);
    anything else raises ModelError.
    """

    def __init__(self, source, normalize="nfc"):
        self.normalize = _check_normalize(normalize)
        if isinstance(source, _core._Tokenizer):   # from_vocab
            self._c = source
            self.path = None
            return
        if not isinstance(source, (str, bytes, os.PathLike)) and hasattr(source, "path"):
            source = source.path   # a GGUFFile
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "No such file or directory", os.fsdecode(path))
        self.path = os.fsdecode(path)
        self._c = _core._Tokenizer(path)

    @classmethod
    def from_vocab(cls, tokens, token_types=None, merges=(), *, bos_id=None, eos_id=None,
                   pad_id=None, chat_template=None, normalize="nfc") -> "Tokenizer":
        """A tokenizer from the arrays a GGUF file stores: tokens (byte-level strings; control
        and user-defined tokens as their text), token_types (tokenizer.ggml.token_type values:
        1 normal, 3 control, 4 user-defined, 5 unused; None: all normal), merges ("left right"
        strings, rank = index). qwencuda.testing.make_vocab() returns such arrays."""
        c = _core._Tokenizer.from_vocab(list(tokens), None if token_types is None else list(token_types),
                                        list(merges), bos_id, eos_id, pad_id, chat_template)
        return cls(c, normalize=normalize)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text, allow_special=False) -> list[int]:
        """text (str, or UTF-8 bytes) -> token ids. allow_special: recognise control tokens such
        as <|im_start|> written in the text; otherwise they are spelled out as plain text.
        Bytes that are not UTF-8 raise UnicodeDecodeError (a ValueError) naming the offset."""
        special = _SPECIAL_ALL if allow_special else _SPECIAL_USER
        if self.normalize is None:
            return self._c.encode(text, special)
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8")
        elif not isinstance(text, str):
            raise TypeError(f"text must be str or UTF-8 bytes, not {type(text).__name__}")
        if text.isascii() or unicodedata.is_normalized("NFC", text):
            # A piece of NFC text between whole tokens is NFC too (composition and reordering
            # only look at characters inside the piece), so there is nothing to do.
            return self._c.encode(text, special)
        return self._encode_normalized(text, special)

    def _encode_normalized(self, text, special):
        # Whole tokens are found in the original text, then each piece between them is
        # normalised on its own (HF matches its non-normalised added tokens before normalising).
        ids = []
        for piece in self._c.split_special(text, special):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._c.encode(unicodedata.normalize("NFC", piece), _SPECIAL_NONE))
        return ids

    # -- decoding --------------------------------------------------------------------------

    def decode_bytes(self, ids) -> bytes:
        """ids -> the concatenated bytes of the tokens. An id outside [0, n_vocab) raises
        ValueError naming it."""
        return self._c.decode_bytes(ids)

    def decode(self, ids) -> str:
        """ids -> text; bytes that do not form UTF-8 become U+FFFD."""
        return self._c.decode_bytes(ids).decode("utf-8", errors="replace")

    def token(self, token_id) -> str:
        """The vocabulary string of a token as the file stores it (byte-level: 'Ġworld')."""
        return self._c.token(token_id)

    def token_type(self, token_id) -> int:
        """tokenizer.ggml.token_type of a token: 1 normal, 3 control, 4 user-defined, 5 unused."""
        return self._c.token_type(token_id)

    def stream_decoder(self) -> "StreamDecoder":
        """A decoder for ids that arrive one at a time (see StreamDecoder)."""
        return StreamDecoder(self)

    # -- vocabulary ------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self._c.n_vocab

    def __len__(self) -> int:
        return self._c.n_vocab

    @property
    def n_merges(self) -> int:
        return self._c.n_merges

    @property
    def bos_id(self):
        return self._c.bos_id

    @property
    def eos_id(self):
        return self._c.eos_id

    @property
    def pad_id(self):
        return self._c.pad_id

    @property
    def special_ids(self) -> dict:
        """{text: id} of the control and user-defined tokens."""
        return self._c.special_ids

    @property
    def chat_template(self):
        """The file's tokenizer.chat_template (Jinja2 source), or None."""
        return self._c.chat_template

    def __repr__(self):
        where = f" {self.path!r}" if self.path else ""
        return (f"<qwencuda.Tokenizer{where}: {self.n_vocab} tokens, {self.n_merges} merges, "
                f"{len(self.special_ids)} special, normalize={self.normalize!r}>")


class StreamDecoder:
    """Turns ids into text as they arrive: push(id) returns the text that is complete so far
    (possibly ""), holding back the bytes of a UTF-8 character that a later token finishes;
    flush() returns what is left (an unfinished character becomes U+FFFD) and starts over.
    The pieces joined equal tokenizer.decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer):
        self._c = tokenizer._c
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id) -> str:
        return self._dec.decode(self._c.decode_bytes((token_id,)))

    def flush(self) -> str:
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        return text


def _check_normalize(normalize):
    if isinstance(normalize, str):
        normalize = normalize.lower()
    if normalize not in _NORMAL_FORMS:
        raise ValueError(f"normalize must be 'nfc' or None, not {normalize!r}")
    return normalize
