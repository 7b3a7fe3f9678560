"""Synthetic Qwen2 GGUF models for tests and benchmarks.

    path = qwencuda.testing.write_model("/tmp/tiny.gguf", config="tiny", weight_type="q8_0")

The files are laid out exactly as llama.cpp's converter lays out a Qwen2 model (metadata keys,
tensor names, GGUF shape convention: a weight with NumPy shape (out, in) has ne = [in, out]),
with a working byte-level BPE vocabulary (256 byte tokens, merges learned by a small
deterministic trainer over an embedded English + Python corpus, ChatML special tokens, padding
up to the config's n_vocab) and the Qwen2.5 chat template. Only the `gguf` package and NumPy are
used; nothing here touches qwencuda's C code.

Weights are random with realistic scales (embedding std 0.02, projections std 1/sqrt(in),
RMSNorm weights near 1, output_norm scaled so that logits have a std of a few units like the real
model) and q/k biases that are LARGE (tens) in a few dimensions per head, like Qwen2.5, so a
dropped bias cannot hide: the k bias in the lowest-frequency RoPE dimensions, as in the real
model, the q bias in two random dimensions per head; the v bias is smaller (one dimension of a
few units per head; the real model's are 0.1 to 3). Every tensor draws from its own RNG stream
seeded by (seed, tensor name), so the same seed gives the same underlying model in every weight
type: a q8_0 file is a quantization of the f32 one.

Quantization: the `gguf` package's vectorised quantizers for BF16 and the legacy formats
(Q4_0 .. Q8_0); the K-quants (Q2_K .. Q6_K), which the package can only dequantize, are encoded
here by a simple min/max quantizer per sub-block (not llama.cpp's optimising search) whose output
round-trips through `gguf.quants.dequantize`. Rows whose length is not a multiple of a type's block
size fall back per tensor the way llama.cpp does (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, legacy -> F16); `plan_model` shows the resulting types. Norms and biases stay F32.

Files of the real Qwen2.5 sizes (0.5B .. 72B) are written at disk speed by
qwencuda.synthetic.write_random_model (random well-formed blocks instead of quantized floats).
"""
from __future__ import annotations

import functools
import os
import re
import zlib
from collections import Counter

import numpy as np

__all__ = [
    "CONFIGS", "WEIGHT_TYPES", "CHAT_TEMPLATE", "CORPUS",
    "write_model", "make_vocab", "plan_model", "resolve_config", "train_bpe", "pretokenize",
    "bytes_to_unicode", "quantize", "hf_tokenizer", "QWEN2_PRETOKENIZER_REGEX",
]

# --------------------------------------------------------------------------------------------
# Configurations

_BASE = dict(n_ctx_train=4096, rope_theta=1_000_000.0, norm_eps=1e-6, tied=False)

CONFIGS: dict[str, dict] = {
    # CI-sized. dim 64 is not a multiple of 256, ffn 256 is: like the real 0.5B (896 / 4864), K-quant
    # types fall back to legacy types everywhere except ffn_down.
    "tiny": dict(_BASE, n_vocab=400, dim=64, n_layer=2, n_head=4, n_head_kv=2, ffn_dim=256),
    # n_head == n_head_kv (plain multi-head attention)
    "tiny-gqa1": dict(_BASE, n_vocab=400, dim=64, n_layer=2, n_head=4, n_head_kv=4, ffn_dim=256),
    # 7 query heads per KV head, 14 heads and 2 KV heads, as in Qwen2.5-0.5B
    "tiny-gqa7": dict(_BASE, n_vocab=400, dim=224, n_layer=2, n_head=14, n_head_kv=2, ffn_dim=256),
    # head_dim 64 (Qwen2.5-0.5B's); every dimension a multiple of 256: all weight types, no fallback
    "tiny-hd64": dict(_BASE, n_vocab=400, dim=256, n_layer=2, n_head=4, n_head_kv=2, ffn_dim=512),
    # head_dim 128 (Qwen2.5-1.5B/7B); also free of fallbacks
    "tiny-hd128": dict(_BASE, n_vocab=400, dim=256, n_layer=2, n_head=2, n_head_kv=1, ffn_dim=512),
    # an odd (prime) vocabulary size, three layers
    "tiny-oddvocab": dict(_BASE, n_vocab=389, dim=64, n_layer=3, n_head=4, n_head_kv=2, ffn_dim=256),
    # the exact shapes of Qwen2.5-0.5B(-Instruct/-Coder), tied embeddings like the original
    "qwen2.5-0.5b": dict(n_vocab=151936, dim=896, n_layer=24, n_head=14, n_head_kv=2, ffn_dim=4864,
                         n_ctx_train=32768, rope_theta=1_000_000.0, norm_eps=1e-6, tied=True),
}

_CONFIG_KEYS = ("n_vocab", "dim", "n_layer", "n_head", "n_head_kv", "ffn_dim", "n_ctx_train",
                "rope_theta", "norm_eps", "tied")

WEIGHT_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m")

# llama.cpp's general.file_type (LLAMA_FTYPE_*) for each weight type
_FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
              "q2_k": 10, "q3_k": 12, "q4_k": 14, "q4_k_m": 15, "q5_k": 17, "q6_k": 18, "bf16": 32}


def resolve_config(config) -> dict:
    """A config name of CONFIGS or a dict (missing keys from "tiny") -> a complete, checked dict
    with head_dim added."""
    if isinstance(config, str):
        try:
            cfg = dict(CONFIGS[config])
        except KeyError:
            raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}") from None
    elif isinstance(config, dict):
        unknown = set(config) - set(_CONFIG_KEYS) - {"head_dim"}
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        cfg = dict(CONFIGS["tiny"], **config)
    else:
        raise TypeError(f"config must be a name or a dict, not {type(config).__name__}")
    for k in ("n_vocab", "dim", "n_layer", "n_head", "n_head_kv", "ffn_dim", "n_ctx_train"):
        cfg[k] = int(cfg[k])
        if cfg[k] <= 0:
            raise ValueError(f"config {k} must be positive, got {cfg[k]}")
    if cfg["dim"] % cfg["n_head"]:
        raise ValueError(f"dim {cfg['dim']} is not a multiple of n_head {cfg['n_head']}")
    if cfg["n_head"] % cfg["n_head_kv"]:
        raise ValueError(f"n_head {cfg['n_head']} is not a multiple of n_head_kv {cfg['n_head_kv']}")
    head_dim = cfg["dim"] // cfg["n_head"]
    if cfg.get("head_dim", head_dim) != head_dim:
        raise ValueError("head_dim must equal dim // n_head in Qwen2")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even (RoPE)")
    cfg["head_dim"] = head_dim
    cfg["rope_theta"] = float(cfg["rope_theta"])
    cfg["norm_eps"] = float(cfg["norm_eps"])
    cfg["tied"] = bool(cfg["tied"])
    if cfg["n_vocab"] < 256 + 3:
        raise ValueError("n_vocab must hold the 256 byte tokens and 3 special tokens")
    return cfg


# --------------------------------------------------------------------------------------------
# Chat template: the Qwen2.5 ChatML template, as stored in tokenizer.chat_template of
# Qwen2.5-Coder-0.5B-Instruct's GGUF (written down once from that file).

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# Quantization

_QK_K = 256


def _qtype(name: str):
    return getattr(_gguf().GGMLQuantizationType, name.upper())


def _gguf():
    import gguf
    return gguf


def _f16(a):
    """Round to float16 and back to float32 (scales stored in fp16)."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _div(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(np.shape(a), np.shape(b)), np.float32),
                     where=(b != 0))


def _asym(blocks, sub, qmax, smax):
    """Per sub-block min/max quantization x ~ d*sc*q - dmin*m with q in 0..qmax, sc, m in 0..smax."""
    xs = blocks.reshape(blocks.shape[0], -1, sub)
    lo = np.minimum(xs.min(-1), 0.0)
    scale = (xs.max(-1) - lo) / qmax
    mn = -lo
    d = _f16(scale.max(-1) / smax)
    dmin = _f16(mn.max(-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, smax)
    m = np.clip(np.rint(_div(mn, dmin[:, None])), 0, smax)
    q = np.clip(np.rint(_div(xs + (dmin[:, None] * m)[..., None], (d[:, None] * sc)[..., None])), 0, qmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _sym(blocks, sub, nneg, smax):
    """Per sub-block symmetric quantization x ~ d*sc*q with q in -nneg..nneg-1, sc in -smax..smax;
    the value of largest magnitude maps to -nneg."""
    xs = blocks.reshape(blocks.shape[0], -1, sub)
    idx = np.abs(xs).argmax(-1)[..., None]
    scale = -np.take_along_axis(xs, idx, -1)[..., 0] / nneg
    d = _f16(np.abs(scale).max(-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -smax, smax)
    q = np.clip(np.rint(_div(xs, (d[:, None] * sc)[..., None])), -nneg, nneg - 1)
    return d, sc.astype(np.int8), q.astype(np.int16)


def _pack_shifted(q, shape, bits):
    """OR the 'bits'-bit fields q (n, groups, k, w) shifted by bits*k -> (n, groups*w) bytes."""
    q = q.reshape(shape).astype(np.uint8)
    out = np.zeros((shape[0], shape[1], shape[3]), np.uint8)
    for k in range(shape[2]):
        out |= q[:, :, k, :] << np.uint8(bits * k)
    return out.reshape(shape[0], -1)


def _pack_scale_min_k4(sc, m):
    """Q4_K/Q5_K's 12-byte packing of eight 6-bit scales and eight 6-bit mins."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _h(d):
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _quant_k(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Encode (n, 256) float32 blocks as K-quant blocks (n, type_size) uint8."""
    n = blocks.shape[0]
    if kind == "Q2_K":  # scales[16] qs[64] d dmin
        d, dmin, sc, m, q = _asym(blocks, 16, 3, 15)
        return np.concatenate([sc | (m << 4), _pack_shifted(q, (n, 2, 4, 32), 2), _h(d), _h(dmin)], 1)
    if kind == "Q3_K":  # hmask[32] qs[64] scales[12] d
        d, sc, q = _sym(blocks, 16, 4, 31)
        u = (q + 4).astype(np.uint8)
        s6 = (sc.astype(np.int16) + 32).astype(np.uint8)
        scales = np.zeros((n, 12), np.uint8)
        scales[:, 0:8] = (s6[:, 0:8] & 0xF) | ((s6[:, 8:16] & 0xF) << 4)
        scales[:, 8:12] = _pack_shifted((s6 >> 4) & 3, (n, 1, 4, 4), 2)
        return np.concatenate([_pack_shifted(u >> 2, (n, 1, 8, 32), 1),
                               _pack_shifted(u & 3, (n, 2, 4, 32), 2), scales, _h(d)], 1)
    if kind == "Q4_K":  # d dmin scales[12] qs[128]
        d, dmin, sc, m, q = _asym(blocks, 32, 15, 63)
        return np.concatenate([_h(d), _h(dmin), _pack_scale_min_k4(sc, m),
                               _pack_shifted(q, (n, 4, 2, 32), 4)], 1)
    if kind == "Q5_K":  # d dmin scales[12] qh[32] qs[128]
        d, dmin, sc, m, q = _asym(blocks, 32, 31, 63)
        return np.concatenate([_h(d), _h(dmin), _pack_scale_min_k4(sc, m),
                               _pack_shifted(q >> 4, (n, 1, 8, 32), 1),
                               _pack_shifted(q & 15, (n, 4, 2, 32), 4)], 1)
    if kind == "Q6_K":  # ql[128] qh[64] scales[16] d
        d, sc, q = _sym(blocks, 16, 32, 127)
        u = (q + 32).astype(np.uint8)
        return np.concatenate([_pack_shifted(u & 15, (n, 2, 2, 64), 4),
                               _pack_shifted(u >> 4, (n, 2, 4, 32), 2),
                               sc.view(np.uint8), _h(d)], 1)
    raise ValueError(kind)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Encode a float32 array (..., row) in a GGML type ("F32", "Q4_K", ...): float32/float16
    arrays for F32/F16, else uint8 (..., bytes_per_row) as GGUFWriter.add_tensor(raw_dtype=) wants."""
    gguf = _gguf()
    type_name = type_name.upper()
    x = np.ascontiguousarray(x, np.float32)
    if type_name == "F32":
        return x
    if type_name == "F16":
        return x.astype(np.float16)
    if type_name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        if x.shape[-1] % _QK_K:
            raise ValueError(f"{type_name} needs rows that are a multiple of {_QK_K}, got {x.shape[-1]}")
        out = _quant_k(x.reshape(-1, _QK_K), type_name)
        return out.reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x, _qtype(type_name))


# --------------------------------------------------------------------------------------------
# Model plan and writer

# llama.cpp's fallback when a row is not a multiple of the block size
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
             "Q4_0": "F16", "Q4_1": "F16", "Q5_0": "F16", "Q5_1": "F16", "Q8_0": "F16", "BF16": "BF16",
             "F16": "F16", "F32": "F32"}

# Q4_K_M: layers whose attn_v and ffn_down get Q6_K instead of Q4_K, as in the real
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M file (24 layers); other depths map onto this pattern.
_Q4KM_MORE_BITS_24 = frozenset({0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21})


def _block_size(type_name):
    return {"F32": 1, "F16": 1, "BF16": 1}.get(type_name, 256 if type_name.endswith("_K") else 32)


def _type_for(name: str, layer: int | None, n_layer: int, weight_type: str, row: int) -> str:
    """GGML type of a 2-D weight in a file of weight_type; row = ne[0] (in features)."""
    if weight_type == "q4_k_m":
        if name == "output.weight":
            t = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and \
                (layer * 24 // n_layer) in _Q4KM_MORE_BITS_24:
            t = "Q6_K"
        else:
            t = "Q4_K"
    else:
        t = weight_type.upper()
    while row % _block_size(t):
        t = _FALLBACK[t]
    return t


def plan_model(config="tiny", weight_type="f32", tied=None) -> list[tuple[str, tuple, str]]:
    """The tensors write_model writes, in file order: (name, NumPy shape, GGML type name)."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r}; known: {', '.join(WEIGHT_TYPES)}")
    cfg = resolve_config(config)
    tied = cfg["tied"] if tied is None else bool(tied)
    V, D, F, L = cfg["n_vocab"], cfg["dim"], cfg["ffn_dim"], cfg["n_layer"]
    kv = cfg["n_head_kv"] * cfg["head_dim"]

    def w(name, shape, layer=None):
        return (name, shape, _type_for(name, layer, L, weight_type, shape[-1]))

    plan = [w("token_embd.weight", (V, D))]
    for i in range(L):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (D,), "F32"),
            w(p + "attn_q.weight", (D, D), i), (p + "attn_q.bias", (D,), "F32"),
            w(p + "attn_k.weight", (kv, D), i), (p + "attn_k.bias", (kv,), "F32"),
            w(p + "attn_v.weight", (kv, D), i), (p + "attn_v.bias", (kv,), "F32"),
            w(p + "attn_output.weight", (D, D), i),
            (p + "ffn_norm.weight", (D,), "F32"),
            w(p + "ffn_gate.weight", (F, D), i),
            w(p + "ffn_up.weight", (F, D), i),
            w(p + "ffn_down.weight", (D, F), i),
        ]
    plan.append(("output_norm.weight", (D,), "F32"))
    if not tied:
        plan.append(w("output.weight", (V, D)))
    return plan


_EMBED_STD = 0.02
_LOGIT_STD = 2.5  # target std of the logits (the real 0.5B: about 3)


def _values(name: str, shape: tuple, cfg: dict, seed: int) -> np.ndarray:
    """The float32 values of one tensor; its own RNG stream, independent of the weight type."""
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])
    hd = cfg["head_dim"]
    kind = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
    if name.endswith(".bias"):
        heads = shape[0] // hd
        b = rng.standard_normal((heads, hd), dtype=np.float32)

        def big(lo, hi, size):  # magnitudes in [lo, hi), random signs
            return (rng.uniform(lo, hi, size) * rng.choice([-1.0, 1.0], size)).astype(np.float32)
        if kind == "attn_k":
            # large in the two lowest-frequency NEOX pairs of every head, like Qwen2.5
            cols = [hd // 2 - 2, hd // 2 - 1, hd - 2, hd - 1]
            b[:, cols] = big(20, 50, (heads, len(cols)))
        elif kind == "attn_q":
            # tens in two random dimensions per head
            for h in range(heads):
                cols = rng.choice(hd, 2, replace=False)
                b[h, cols] = big(10, 25, 2)
        else:
            # v: small, with one dimension of a few units per head (a large constant v bias would
            # add the same vector to every token's residual and drown the token identity)
            b *= np.float32(0.2)
            for h in range(heads):
                b[h, rng.integers(hd)] = big(2, 4, 1)[0]
        return b.reshape(shape)
    if kind in ("attn_norm", "ffn_norm"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if kind == "output_norm":
        scale = _LOGIT_STD / (_EMBED_STD * np.sqrt(cfg["dim"]))
        return (scale * (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))).astype(np.float32)
    if kind in ("token_embd", "output"):
        std = _EMBED_STD
    else:
        std = 1.0 / np.sqrt(shape[-1])
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    return x


def write_metadata(w, cfg: dict, name: str, file_type: int, seed=0, vocab=None, alignment=None):
    """Add the qwen2 metadata of config cfg (resolve_config's dict) and, unless vocab is False,
    the tokenizer and chat template to the gguf.GGUFWriter w (before its header is written).
    file_type: general.file_type (LLAMA_FTYPE_*); seed, vocab, alignment: as in write_model.
    Shared by write_model and qwencuda.synthetic.write_random_model."""
    gguf = _gguf()
    w.add_type("model")
    w.add_name(name)
    w.add_context_length(cfg["n_ctx_train"])
    w.add_embedding_length(cfg["dim"])
    w.add_block_count(cfg["n_layer"])
    w.add_feed_forward_length(cfg["ffn_dim"])
    w.add_head_count(cfg["n_head"])
    w.add_head_count_kv(cfg["n_head_kv"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_file_type(file_type)
    if alignment is not None:
        w.add_custom_alignment(int(alignment))
    if vocab is not False:
        tokens, types, merges, special = make_vocab(cfg["n_vocab"], seed) if vocab is None else vocab
        if len(tokens) != cfg["n_vocab"] or len(types) != len(tokens):
            raise ValueError(f"vocab has {len(tokens)} tokens / {len(types)} types, "
                             f"config n_vocab is {cfg['n_vocab']}")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(list(tokens))
        w.add_token_types(list(types))
        w.add_token_merges(list(merges))
        w.add_eos_token_id(special["<|im_end|>"])
        w.add_pad_token_id(special["<|endoftext|>"])
        w.add_bos_token_id(special["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_model(path, config="tiny", weight_type="f32", seed=0, tied=None, vocab=None, alignment=None):
    """Write a synthetic Qwen2 GGUF file and return its path.

    config: a name of CONFIGS or a dict of config keys (missing ones from "tiny").
    weight_type: one of WEIGHT_TYPES (the type of the 2-D weights; see plan_model for the
        per-tensor result including fallbacks). Norms and biases are F32.
    seed: selects the random weights; the same seed gives the same model in every weight type.
    tied: omit output.weight (token_embd.weight is then the lm_head); None: the config's default
        (False for the tiny configs, True for "qwen2.5-0.5b").
    vocab: None for make_vocab(n_vocab, seed), or a (tokens, token_types, merges, special_ids)
        tuple as make_vocab returns it (tokens must have n_vocab entries; special_ids needs
        "<|endoftext|>" and "<|im_end|>"), or False to write no tokenizer metadata.
    alignment: None for GGUF's default 32, or a power of two written as general.alignment
        (1 or 2 put tensor data at odd addresses: readers must not assume aligned blocks).
    """
    gguf = _gguf()
    cfg = resolve_config(config)
    tied = cfg["tied"] if tied is None else bool(tied)
    plan = plan_model(cfg, weight_type, tied)
    path = os.fspath(path)

    w = gguf.GGUFWriter(path, "qwen2")
    write_metadata(w, cfg, f"qwencuda synthetic {config if isinstance(config, str) else 'custom'} {weight_type}",
                   _FILE_TYPE[weight_type], seed=seed, vocab=vocab, alignment=alignment)

    # tensor infos first, then the data one tensor at a time (the 0.5B shapes never sit in memory
    # all at once)
    sizes = {}
    for name, shape, t in plan:
        qt = _qtype(t)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(shape)) // block * type_size
        sizes[name] = nbytes
        if t == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        elif t == "F16":
            w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block * type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, t in plan:
            data = quantize(_values(name, shape, cfg, seed), t)
            assert data.nbytes == sizes[name], (name, data.nbytes, sizes[name])
            w.write_tensor_data(data)
    finally:
        w.close()
    return path


def assert_matches(actual, name, trace, rtol=1e-3, atol=1e-4):
    """Fail with qwencuda's compare report (first divergence, error table) unless `actual`
    matches `trace[name]`. Lives in qwencuda.compare; re-exported here for test suites."""
    from .compare import assert_matches as _assert_matches

    return _assert_matches(actual, name, trace, rtol=rtol, atol=atol)
