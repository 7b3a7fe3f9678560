"""A working byte-level BPE vocabulary for synthetic files: the GPT-2 byte mapping, the Qwen2
pre-tokenizer (approximated with `re`), a small deterministic BPE trainer over an embedded
English + Python corpus, ChatML specials; and the HF `tokenizers` oracle built from a GGUF."""
from __future__ import annotations

import functools
import os
import re
from collections import Counter

# Tokenizer: GPT-2 byte mapping, Qwen2 pre-tokenizer (approximated with `re`), BPE trainer

CORPUS = '''\
The quick brown fox jumps over the lazy dog. A small model can still be a correct model, and a
correct model is the best tool for finding the bug in a fast one. When the output of an engine
repeats the same token again and again, the fault is often in the attention, the position of the
cache, or the way a matrix is read from memory. Look at every tensor, one layer at a time, and
compare it with the reference. The first tensor that differs is where the search should begin.
We write tests for the tokenizer, the sampler, the kernels and the whole forward pass. Numbers
like 0, 1, 2, 3, 10, 42, 100, 256, 896, 4864 and 151936 appear in configuration files. Please
explain what this function does, and then write a haiku about graphics processing units.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France. Write a short story about a robot who learns to paint the sea at night.
The user asked the assistant a question, and the assistant gave a helpful answer in return.

def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def quick_sort(items):
    if len(items) <= 1:
        return items
    pivot = items[len(items) // 2]
    left = [x for x in items if x < pivot]
    middle = [x for x in items if x == pivot]
    right = [x for x in items if x > pivot]
    return quick_sort(left) + middle + quick_sort(right)


class Matrix:
    def __init__(self, rows, cols):
        self.rows = rows
        self.cols = cols
        self.data = [[0.0] * cols for _ in range(rows)]

    def __getitem__(self, index):
        row, col = index
        return self.data[row][col]

    def transpose(self):
        result = Matrix(self.cols, self.rows)
        for i in range(self.rows):
            for j in range(self.cols):
                result.data[j][i] = self.data[i][j]
        return result


for i in range(10):
    print(f"step {i}: value = {fibonacci(i)}")

import numpy as np
x = np.zeros((4, 4), dtype=np.float32)
y = x @ x.T + 1.0
print("the sum is", y.sum())

int main(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        printf("%s\\n", argv[i]);
    }
    return 0;
}
'''

# Qwen2's pre-tokenizer regex, written for Python's `re` (no \\p{L}/\\p{N}): a letter is
# [^\\W\\d_], a number is \\d, "not letter, not number" is [^\\w] or "_".
_PRETOKENIZE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def pretokenize(text: str) -> list[str]:
    """Split text the way Qwen2's pre-tokenizer does (close approximation for non-ASCII letters)."""
    return _PRETOKENIZE.findall(text)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the order of the first 256 tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train_bpe(text: str, n_merges: int, min_count: int = 2) -> list[tuple[str, str]]:
    """Byte-level BPE training: pre-tokenize, map each word's UTF-8 bytes through the GPT-2 byte
    map, then repeatedly merge the most frequent adjacent pair (ties: the smallest pair in string
    order) until n_merges merges are made or no pair occurs min_count times. A pair whose merged
    string already exists as a token is skipped, so that every merge makes a new token."""
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in pretokenize(text))
    corpus = [(list(w), c) for w, c in sorted(words.items())]
    known = set(b2u.values())
    banned: set[tuple[str, str]] = set()
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for syms, c in corpus:
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += c
        best = None
        for pair, c in pairs.items():
            if c < min_count or pair in banned:
                continue
            if best is None or c > best[1] or (c == best[1] and pair < best[0]):
                best = (pair, c)
        if best is None:
            break
        (a, b), _ = best
        if a + b in known:
            banned.add((a, b))
            continue
        known.add(a + b)
        merges.append((a, b))
        for syms, _c in corpus:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == a and syms[i + 1] == b:
                    syms[i:i + 2] = [a + b]
                i += 1
    return merges


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5
_MAX_MERGES = 1500


@functools.lru_cache(maxsize=8)
def _vocab_cached(n_vocab: int, seed: int):
    # room for 256 bytes + merges + 3 specials; keep a little padding when there is room
    room = n_vocab - 256 - len(SPECIAL_TOKENS)
    if room < 0:
        raise ValueError(f"n_vocab {n_vocab} is too small (needs >= {256 + len(SPECIAL_TOKENS)})")
    n_merges = min(_MAX_MERGES, room - min(8, room // 16))
    merges = train_bpe(CORPUS, n_merges)
    b2u = bytes_to_unicode()
    tokens = list(b2u.values()) + [a + b for a, b in merges]
    types = [TOKEN_NORMAL] * len(tokens)
    special_ids = {}
    for s in SPECIAL_TOKENS:
        special_ids[s] = len(tokens)
        tokens.append(s)
        types.append(TOKEN_CONTROL)
    while len(tokens) < n_vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(TOKEN_UNUSED)
    return tuple(tokens), tuple(types), tuple(f"{a} {b}" for a, b in merges), tuple(special_ids.items())


def make_vocab(n_vocab: int, seed: int = 0):
    """A working byte-level BPE vocabulary of exactly n_vocab entries ->
    (tokens, token_types, merges, special_ids). tokens: the 256 GPT-2 byte tokens (in GPT-2's
    order), then one token per merge, then <|endoftext|>, <|im_start|>, <|im_end|> (type 3,
    control), then "[PAD{i}]" unused tokens (type 5) up to n_vocab. merges: "a b" strings, as in
    tokenizer.ggml.merges. special_ids: dict text -> id. The merges are learned from CORPUS and do
    not depend on seed (kept for API symmetry)."""
    tokens, types, merges, special = _vocab_cached(int(n_vocab), int(seed))
    return list(tokens), list(types), list(merges), dict(special)


# The pre-tokenizer regex of Qwen2's tokenizer.json (needs \\p{..}: HF tokenizers' Onig regex).
QWEN2_PRETOKENIZER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_tokenizer(path_or_reader):
    """An independent oracle: a HF `tokenizers.Tokenizer` built from a GGUF file's vocabulary and
    merges the way Qwen2's tokenizer.json is set up (NFC normalizer, Qwen2 regex split, byte-level
    BPE, control/user-defined tokens as added tokens). Needs the `tokenizers` package."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    r = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else \
        gguf.GGUFReader(os.fspath(getattr(path_or_reader, "path", path_or_reader)))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == 4])
    return tok
