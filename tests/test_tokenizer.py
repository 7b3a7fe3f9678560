"""qwencuda.Tokenizer against HF `tokenizers`, an independent implementation of the same thing.

The oracle is built here from the very same arrays (vocabulary, token types, merges) the way
Qwen2's tokenizer.json is set up: NFC normalizer, the Qwen2 regex split (Oniguruma), byte-level
BPE, control tokens as special added tokens, user-defined tokens as plain added tokens. Three
vocabularies: qwencuda.testing.make_vocab (English + Python merges), one trained here with HF's
BpeTrainer on the multilingual corpus below (merges inside CJK, emoji, Arabic, whitespace runs;
overlapping special tokens), and the real Qwen2.5-Coder file's (skipped without it).
"""
import concurrent.futures
import json
import os
import random
import sys
import time
import unicodedata

import numpy as np
import pytest

import qwencuda as qc
from qwencuda import testing as qt
from qwencuda import tokenizer as qtok

tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

# The pre-tokenizer of Qwen2's tokenizer.json.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# --------------------------------------------------------------------------------------------
# Corpus: name -> text

CORPUS = {
    "empty": "",
    "prose": ("The quick brown fox jumps over the lazy dog. It was the best of times, it was "
              "the worst of times; Mr. Jones said: \"Hello!\" (and left) -- at 5pm..."),
    "prose_multiline": "First line.\nSecond line, with a comma.\n\nA new paragraph!\n",
    "python": ("import os\n\n\nclass Foo(Bar):\n    def __init__(self, x: int = 3) -> None:\n"
               "        self.x = x  # comment\n        if x > 2:\n            return [i ** 2 for i in range(x)]\n"
               "\n    @property\n    def y(self):\n        return {'a': 1, \"b\": 2}\n"),
    "c": ("#include <stdio.h>\n\nint main(int argc, char **argv) {\n\tfor (int i = 0; i < argc; i++) {\n"
          "\t\tprintf(\"%s\\n\", argv[i]);\n\t}\n\treturn 0;\n}\n"),
    "numbers": "1 12 123 1234567890 3.14159 -42 1,000,000 0x1F 1e-6 v2.0.1 2024-05-17 10:30",
    "digit_run": "9" * 300 + " 0123456789" * 5,
    "other_numbers": "Ⅻ ² ½ ٣٤ ０１２ ① 〇 𝟘𝟙",
    "cjk_chinese": "你好，世界！我们今天学习自然语言处理。",
    "cjk_japanese": "こんにちは世界。カタカナとひらがなと漢字。ｶﾀｶﾅ",
    "cjk_korean": "안녕하세요 세계! 한국어 텍스트입니다.",
    "emoji": "I ❤️ GPUs 👍🏽👍🏿 🇺🇸🇯🇵 🏳️‍🌈 👨‍👩‍👧‍👦 👩🏽‍💻 ✨🔥💯",
    "combining": "e\u0301 a\u0308\u0304 n\u0303o Z\u0351\u0364\u0365a\u0350l\u0353g\u0327o\u0336 \u0301start",
    "nfd_vietnamese": unicodedata.normalize("NFD", "Tiếng Việt có dấu, Ångström, Crème brûlée"),
    "arabic": "مرحبا بالعالم! هذا نص عربي ١٢٣.",
    "hebrew": "שלום עולם, זה טקסט בעברית.",
    "devanagari": "नमस्ते दुनिया। यह हिंदी पाठ है।",
    "mixed_scripts": "hello世界123abc Привет мир Γειά σου κόσμε",
    "whitespace_runs": "a  b   c    d\t\te \t f\u3000g\u00a0h\u2028i\u2029j\x0bk\x0cl\x85m",
    "whitespace_only": "     ",
    "tabs": "\t\tindented\n\t\t\tmore\n\tless\t\n",
    "crlf": "line one\r\nline two\r\n\r\nline four\r\r\n\n  \r\n  x",
    "trailing_spaces": "hello   \nworld  \n   \nend   ",
    "newlines": "\n\n\na\n\nb\n",
    "punctuation": "!!! ??? ... --- *** ((()))[[]]{{}} <=> @#$%^&* ~`|\\ 'quoted' \"dq\" ,.;:",
    "long_word": "a" * 10000,
    "long_mixed_word": "ab" * 2500 + "xyz" * 1666,
    "long_cjk": "漢字" * 2000,
    "long_spaces": " " * 5000 + "x" + " " * 5000,
    "long_punct": "!?" * 3000,
    "contractions": ("DON'T we'LL I'm you're they've he'd it's She'S WE'RE you'VE I'D "
                     "o'clock rock'n'roll ''s 'sun 'llama 'ſ '\u017fx"),
    "apostrophes": "' '' 's 't 're 've 'm 'll 'd 'x ’s",
    "control_chars": "a\x00b\x01c\x7fd\x1b[0m\x1c\x1d\x1e\x1f",
    "odd_unicode": "\ufeffBOM \u200bzero\u200dwidth \u00adsoft \ue000private \U0010fffd \u180e",
    "math": "∑_{i=1}^{n} x_i² ≤ √(a²+b²) ∫₀^∞ e^{-x} dx ≠ ∞ ≈ π",
    "url": "https://example.com/path?q=a+b&x=1#frag user@mail.org",
    "special_text": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "special_adjacent": "<|endoftext|><|im_start|><|im_end|>x<|im_end|>",
    "special_partial": "<|im_sta <|im_start <|im_end| |im_end|> <<|im_end|>> <|im_end|>x",
    "special_user": "<tool_call>{\"name\": \"f\"}</tool_call> <tool <tool_call",
    "special_nfc_edge": "<|im_end|>\u0338 <\u0338 >\u0338",
}

FUZZ_ALPHABET = ("abcXYZ sS'tlrvmdeLD" "0123" "  \t\n\r\u3000\u00a0" ".,!?-_()<>|" "ſé\u0301ß"
                 "你好世" "👍🏽\u200d" "مر" "नम्" "①²")


def random_texts(n, seed, max_len=40):
    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randrange(max_len))) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# The oracle

def hf_split():
    return pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False)


def hf_pretokenize(text):
    return [piece for piece, _ in hf_split().pre_tokenize_str(text)]


def make_oracle(tokens, types, merges, nfc=True):
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    if nfc:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        hf_split(), pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return hf


def oracle_encode(hf, text, allow_special):
    # encode_special_tokens=True: special (control) tokens are plain text, user-defined ones
    # are still matched, as llama.cpp does without parse_special.
    hf.encode_special_tokens = not allow_special
    return hf.encode(text, add_special_tokens=False).ids


def write_tokenizer_gguf(path, tokens, types, merges, bos=None, eos=None, pad=None,
                         template=None, model="gpt2", pre="qwen2"):
    w = gguf.GGUFWriter(os.fspath(path), "qwen2")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    if merges is not None:
        w.add_token_merges(list(merges))
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (pad, w.add_pad_token_id)):
        if value is not None:
            add(value)
    if template is not None:
        w.add_chat_template(template)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    finally:
        w.close()
    return os.fspath(path)


class Vocab:
    """One vocabulary under test: the arrays, qwencuda's tokenizers (NFC and raw) and HF's."""

    def __init__(self, name, tokens, types, merges, path):
        self.name, self.tokens, self.types, self.merges, self.path = name, tokens, types, merges, path
        self.tok = qc.Tokenizer(path)
        self.tok_raw = qc.Tokenizer(path, normalize=None)
        self.hf = make_oracle(tokens, types, merges, nfc=True)
        self.hf_raw = make_oracle(tokens, types, merges, nfc=False)


def trained_vocab():
    """A byte-level BPE vocabulary learned by HF's trainer from CORPUS with the Qwen2 split, plus
    control and user-defined tokens, some overlapping (longest match first)."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        hf_split(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [t for k, t in CORPUS.items() if not k.startswith(("long", "special"))]
    hf.train_from_iterator(texts * 3, trainer)
    model = json.loads(hf.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [NORMAL] * len(tokens)
    for text, ty in (("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                     ("<|im_end|>x", CONTROL), ("<|im", CONTROL), ("<tool_call>", USER_DEFINED),
                     ("</tool_call>", USER_DEFINED), ("<tool", USER_DEFINED)):
        tokens.append(text)
        types.append(ty)
    tokens += ["[PAD0]", "[PAD1]"]
    types += [UNUSED, UNUSED]
    return tokens, types, merges


@pytest.fixture(scope="module")
def synth_vocab(tmp_path_factory):
    tokens, types, merges, special = qt.make_vocab(2000)
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "make_vocab.gguf", tokens, types, merges,
                                bos=special["<|endoftext|>"], eos=special["<|im_end|>"],
                                pad=special["<|endoftext|>"], template=qt.CHAT_TEMPLATE)
    return Vocab("make_vocab", tokens, types, merges, path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tokens, types, merges = trained_vocab()
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "trained.gguf", tokens, types, merges)
    return Vocab("trained", tokens, types, merges, path)


def read_gguf_metadata(path):
    """The metadata of a GGUF file, parsed here from the format's definition: independent of
    qwencuda's reader, and much faster than gguf.GGUFReader on a 151k-token vocabulary."""
    import struct

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
              11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        def unpack(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(unpack("<Q")).decode("utf-8")

        def value(t):
            if t == 8:
                return string()
            if t == 9:
                et, n = unpack("<I"), unpack("<Q")
                if et in scalar:
                    return list(np.frombuffer(f.read(n * struct.calcsize(scalar[et])), dtype=scalar[et]))
                return [value(et) for _ in range(n)]
            return unpack(scalar[t])

        assert f.read(4) == b"GGUF" and unpack("<I") >= 2
        unpack("<Q")
        n_kv = unpack("<Q")
        out = {}
        for _ in range(n_kv):
            key = string()
            out[key] = value(unpack("<I"))
        return out


@pytest.fixture(scope="module")
def real(real_model_path):
    md = read_gguf_metadata(real_model_path)
    tokens = md["tokenizer.ggml.tokens"]
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]
    merges = md["tokenizer.ggml.merges"]
    return Vocab("real", tokens, types, merges, real_model_path)


@pytest.fixture(params=["make_vocab", "trained", pytest.param("real", marks=pytest.mark.realmodel)])
def vocab(request):
    return request.getfixturevalue({"make_vocab": "synth_vocab"}.get(request.param, request.param))


# --------------------------------------------------------------------------------------------
# The pre-tokenizer alone

@pytest.mark.parametrize("name", list(CORPUS))
def test_pretokenize_matches_regex(name):
    text = CORPUS[name]
    assert qtok.pretokenize(text) == hf_pretokenize(text)
    assert qtok.pretokenize(text.encode()) == [p.encode() for p in hf_pretokenize(text)]


def test_pretokenize_fuzz():
    texts = random_texts(3000, seed=1)
    for text in texts:
        assert qtok.pretokenize(text) == hf_pretokenize(text), repr(text)


def test_pretokenize_every_assigned_code_point():
    """Each code point (that this Python's Unicode database assigns; newer ones depend on the
    oracle's Unicode version) in contexts that tell letters, numbers, white space and the rest
    apart: between letters, then before punctuation."""
    cps = [cp for cp in range(sys.maxunicode + 1)
           if not 0xD800 <= cp < 0xE000 and unicodedata.category(chr(cp)) != "Cn"]
    for k in range(0, len(cps), 40000):
        text = "".join(f"a{c}b{c}.\n" for c in map(chr, cps[k:k + 40000]))
        got, want = qtok.pretokenize(text), hf_pretokenize(text)
        if got != want:
            i = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
            pytest.fail(f"first difference at piece {i}: {got[i - 2:i + 3]!r} vs {want[i - 2:i + 3]!r}")
    assert qtok.UNICODE_VERSION.count(".") == 2


# --------------------------------------------------------------------------------------------
# Encoding against the oracle

@pytest.mark.parametrize("allow_special", [False, True])
def test_encode_matches_oracle(vocab, allow_special):
    bad = []
    for name, text in CORPUS.items():
        got = vocab.tok.encode(text, allow_special=allow_special)
        want = oracle_encode(vocab.hf, text, allow_special)
        if got != want:
            bad.append(name)
        got_raw = vocab.tok_raw.encode(text, allow_special=allow_special)
        if got_raw != oracle_encode(vocab.hf_raw, text, allow_special):
            bad.append(name + " (normalize=None)")
    assert not bad, f"{vocab.name}: differs from HF on {bad}"


def test_encode_fuzz(vocab):
    for text in random_texts(400, seed=2):
        assert vocab.tok.encode(text) == oracle_encode(vocab.hf, text, False), repr(text)
        assert vocab.tok_raw.encode(text) == oracle_encode(vocab.hf_raw, text, False), repr(text)


def test_special_tokens(vocab):
    tok = vocab.tok
    specials = {t: i for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.types)) if ty in (CONTROL, USER_DEFINED)}
    assert tok.special_ids == specials
    for text, i in specials.items():
        assert tok.encode(text, allow_special=True) == [i]
        if vocab.types[i] == CONTROL:
            assert i not in tok.encode(text)        # spelled out as plain text
            assert tok.decode(tok.encode(text)) == text
        else:
            assert tok.encode(text) == [i]          # user-defined: always one token
        assert tok.decode([i]) == text


def test_leftmost_longest_special(trained):
    tok, sid = trained.tok, trained.tok.special_ids
    assert tok.encode("<|im_end|>x", allow_special=True) == [sid["<|im_end|>x"]]
    assert tok.encode("a<|im_end|>", allow_special=True)[-1] == sid["<|im_end|>"]
    assert tok.encode("<|im<|im_start|>", allow_special=True) == [sid["<|im"], sid["<|im_start|>"]]
    assert tok.encode("<tool_call>") == [sid["<tool_call>"]]
    assert tok.encode("<toolx")[0] == sid["<tool"]


def test_normalization(vocab):
    text = "cafe\u0301 na\u0131\u0308ve A\u030angstro\u0308m"
    nfc = unicodedata.normalize("NFC", text)
    assert vocab.tok.encode(text) == vocab.tok.encode(nfc) == oracle_encode(vocab.hf, text, False)
    assert vocab.tok_raw.encode(text) == oracle_encode(vocab.hf_raw, text, False)
    assert vocab.tok_raw.encode(text) != vocab.tok.encode(text)
    assert vocab.tok_raw.decode(vocab.tok_raw.encode(text)) == text
    assert vocab.tok.decode(vocab.tok.encode(text)) == nfc
    # whole tokens are found before normalising: '>' + U+0338 would compose to U+226F
    edge = "<|im_end|>\u0338"
    assert vocab.tok.encode(edge, allow_special=True) == oracle_encode(vocab.hf, edge, True)
    assert vocab.tok.encode(edge, allow_special=True)[0] == vocab.tok.special_ids["<|im_end|>"]
    assert vocab.tok.encode(edge) == oracle_encode(vocab.hf, edge, False)


# --------------------------------------------------------------------------------------------
# Decoding

def test_round_trip(vocab):
    for name, text in CORPUS.items():
        for allow in (False, True):
            ids = vocab.tok.encode(text, allow_special=allow)
            want = unicodedata.normalize("NFC", text)
            if allow and name == "special_nfc_edge":   # <|im_end|> is cut out before NFC
                want = "<|im_end|>\u0338 \u226e \u226f"
            assert vocab.tok.decode(ids) == want, name
            assert vocab.tok.decode_bytes(ids) == want.encode(), name
            assert vocab.tok_raw.decode(vocab.tok_raw.encode(text, allow_special=allow)) == text, name


def test_decode_matches_oracle(vocab):
    for name, text in CORPUS.items():
        ids = vocab.tok.encode(text, allow_special=True)
        assert vocab.tok.decode(ids) == vocab.hf.decode(ids, skip_special_tokens=False), name
    rng = random.Random(3)
    ids = [rng.randrange(vocab.tok.n_vocab) for _ in range(2000)]
    assert vocab.tok.decode(ids) == vocab.hf.decode(ids, skip_special_tokens=False)
    # every token of the vocabulary: all at once, and one by one where that is quick
    every = list(range(vocab.tok.n_vocab))
    assert vocab.tok.decode(every) == vocab.hf.decode(every, skip_special_tokens=False)
    if vocab.tok.n_vocab <= 5000:
        for i in every:
            assert vocab.tok.decode([i]) == vocab.hf.decode([i], skip_special_tokens=False), i


def test_token_strings(vocab):
    tok = vocab.tok
    rng = random.Random(4)
    for i in [0, 1, 255, 256, tok.n_vocab - 1] + [rng.randrange(tok.n_vocab) for _ in range(200)]:
        assert tok.token(i) == vocab.tokens[i]
        assert tok.token_type(i) == vocab.types[i]
    assert tok.token(np.int64(5)) == vocab.tokens[5]


def test_stream_decoder(vocab):
    tok = vocab.tok
    for text in ["👨‍👩‍👧‍👦 and 👍🏽!", CORPUS["emoji"], CORPUS["cjk_chinese"], CORPUS["devanagari"],
                 "a" + "\U0010fffd" * 3 + "€"]:
        ids = tok.encode(text)
        d = tok.stream_decoder()
        pieces = [d.push(i) for i in ids]
        rest = d.flush()
        assert "".join(pieces) + rest == text
        assert rest == ""
        assert all("\ufffd" not in p for p in pieces)
        # every piece ends on a character boundary: its bytes decode strictly on their own
        for p in pieces:
            p.encode("utf-8").decode("utf-8", errors="strict")
    # a character split between tokens: something is held back, then released whole
    ids = tok.encode("👨‍👩‍👧‍👦")
    d = tok.stream_decoder()
    out = [d.push(i) for i in ids]
    if len(ids) > 1 and len(tok.decode_bytes(ids[:1])) % 4:
        assert "" in out
    # an unfinished character at the end: flush gives U+FFFD and the decoder starts over
    lead = vocab.tokens.index("\u00e2")     # the byte-level token of byte 0xE2 ('€' starts with it)
    assert tok.decode_bytes([lead]) == b"\xe2"
    d = tok.stream_decoder()
    assert d.push(lead) == ""
    assert d.flush() == "\ufffd"
    assert d.push(tok.encode("x")[0]) == "x"
    assert d.push(lead) == "" and [d.push(i) for i in tok.encode("x")] == ["\ufffdx"]


# --------------------------------------------------------------------------------------------
# API surface and errors

def test_attributes(synth_vocab):
    tok = synth_vocab.tok
    tokens, types, merges, special = qt.make_vocab(2000)
    assert tok.n_vocab == len(tok) == 2000
    assert tok.n_merges == len(merges)
    assert tok.bos_id == special["<|endoftext|>"] and tok.pad_id == special["<|endoftext|>"]
    assert tok.eos_id == special["<|im_end|>"]
    assert tok.special_ids == special
    assert tok.chat_template == qt.CHAT_TEMPLATE
    assert tok.normalize == "nfc" and "2000 tokens" in repr(tok)
    # from a GGUFFile, and from arrays
    with qc.GGUFFile(synth_vocab.path) as f:
        assert qc.Tokenizer(f).encode(CORPUS["python"]) == tok.encode(CORPUS["python"])
    t2 = qc.Tokenizer.from_vocab(tokens, types, merges, eos_id=special["<|im_end|>"])
    assert t2.encode(CORPUS["prose"]) == tok.encode(CORPUS["prose"])
    assert t2.bos_id is None and t2.pad_id is None and t2.eos_id == special["<|im_end|>"]
    assert t2.chat_template is None


def test_absent_ids(trained):
    assert trained.tok.bos_id is None and trained.tok.eos_id is None and trained.tok.pad_id is None
    assert trained.tok.chat_template is None


def test_inputs(synth_vocab):
    tok = synth_vocab.tok
    text = CORPUS["mixed_scripts"]
    want = tok.encode(text)
    assert tok.encode(text.encode()) == want
    assert tok.encode(bytearray(text.encode())) == want
    assert tok.encode(memoryview(text.encode())) == want
    assert synth_vocab.tok_raw.encode(bytearray(text.encode())) == want
    ids = np.array(want, dtype=np.int32)
    assert tok.decode(ids) == tok.decode(want) == tok.decode(tuple(want)) == text
    assert tok.decode(ids.astype(np.uint16)) == text
    assert tok.decode([]) == "" and tok.decode_bytes([]) == b"" and tok.encode("") == []
    with pytest.raises(TypeError):
        tok.encode(12)
    with pytest.raises(TypeError):
        tok.decode(np.zeros(3, dtype=np.float32))


def test_errors(synth_vocab):
    tok = synth_vocab.tok
    for t in (tok, synth_vocab.tok_raw):
        with pytest.raises(ValueError, match="2000"):
            t.decode([1, 2000])
        with pytest.raises(ValueError, match="-1"):
            t.decode_bytes([-1])
        with pytest.raises(ValueError, match="99999999999"):
            t.decode([99999999999])
        with pytest.raises(ValueError, match="123456"):
            t.decode(np.array([5, 123456]))
        with pytest.raises(ValueError, match="2000"):
            t.token(2000)
        with pytest.raises(ValueError) as e:    # UnicodeDecodeError is a ValueError
            t.encode(b"abc\xffdef")
        assert e.value.start == 3 and "position 3" in str(e.value)
        with pytest.raises(ValueError) as e:
            t.encode("ok".encode() + "é".encode()[:1])
        assert e.value.start == 2
        with pytest.raises(ValueError):
            t.encode("lone \ud800 surrogate")
    for bad in (b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80"):
        with pytest.raises(ValueError):
            synth_vocab.tok_raw.encode(b"x" + bad)
    with pytest.raises(ValueError, match="normalize"):
        qc.Tokenizer(synth_vocab.path, normalize="nfkc")
    with pytest.raises(FileNotFoundError):
        qc.Tokenizer("/nonexistent/file.gguf")


def test_bad_files(tmp_path, synth_vocab):
    tokens, types, merges = synth_vocab.tokens, synth_vocab.types, synth_vocab.merges
    p = write_tokenizer_gguf(tmp_path / "llama.gguf", tokens, types, merges, model="llama")
    with pytest.raises(qc.ModelError, match="gpt2"):
        qc.Tokenizer(p)
    p = write_tokenizer_gguf(tmp_path / "pre.gguf", tokens, types, merges, pre="llama-bpe")
    with pytest.raises(qc.ModelError, match="qwen2"):
        qc.Tokenizer(p)
    p = write_tokenizer_gguf(tmp_path / "nomerges.gguf", tokens, types, None)
    with pytest.raises(qc.ModelError, match="merges"):
        qc.Tokenizer(p)
    p = write_tokenizer_gguf(tmp_path / "eos.gguf", tokens, types, merges, eos=len(tokens))
    with pytest.raises(qc.ModelError, match="eos"):
        qc.Tokenizer(p)
    p = write_tokenizer_gguf(tmp_path / "bytes.gguf", tokens[1:], types[1:], merges)
    with pytest.raises(qc.ModelError, match="byte"):
        qc.Tokenizer(p)
    p = write_tokenizer_gguf(tmp_path / "nopre.gguf", tokens, types, merges, pre=None)
    assert qc.Tokenizer(p).encode(CORPUS["prose"]) == synth_vocab.tok.encode(CORPUS["prose"])
    with pytest.raises(qc.ModelError, match="vocabulary"):
        qc.Tokenizer.from_vocab([])


def test_threads(vocab):
    texts = [CORPUS["prose"] * 50, CORPUS["python"] * 50, CORPUS["cjk_chinese"] * 100,
             CORPUS["emoji"] * 50] * 4
    want = [vocab.tok.encode(t) for t in texts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(vocab.tok.encode, texts))
    assert got == want


@pytest.mark.realmodel
def test_real_model_ids(real):
    """A few ids known from Qwen2.5's tokenizer, and the chat template from the file."""
    tok = real.tok
    assert tok.n_vocab == 151936
    assert tok.eos_id == 151645 and tok.special_ids["<|im_start|>"] == 151644
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", allow_special=True) == [151644, 872, 198, 6023, 151645]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert len(tok.special_ids) == 22
    assert tok.token(9707) == "Hello" and tok.token(1879) == "Ġworld"


@pytest.mark.realmodel
def test_speed(real):
    """Printed figures, not assertions: load time and encoding throughput."""
    t0 = time.perf_counter()
    tok = qc.Tokenizer(real.path)
    load = time.perf_counter() - t0
    text = "\n".join(CORPUS[k] for k in ("prose", "python", "c", "numbers", "cjk_chinese", "emoji",
                                         "arabic", "whitespace_runs")) * 400
    nbytes = len(text.encode())
    t0 = time.perf_counter()
    ids = tok.encode(text)
    enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = oracle_encode(real.hf, text, False)
    hf_time = time.perf_counter() - t0
    assert ids == ref
    t0 = time.perf_counter()
    tok.decode(ids)
    dec = time.perf_counter() - t0
    print(f"\ntokenizer: load {load * 1e3:.0f} ms; encode {nbytes / enc / 1e6:.1f} MB/s "
          f"({len(ids)} tokens from {nbytes} bytes; HF {nbytes / hf_time / 1e6:.1f} MB/s); "
          f"decode {len(ids) / dec / 1e6:.1f} M tokens/s")


def test_odd_vocabularies():
    """Tolerated oddities: merges naming missing tokens are skipped, a repeated pair keeps its
    first rank, duplicate strings resolve to the last id (like HF's vocabulary dict), tokens
    that are not byte-level text or not UTF-8 decode to their raw bytes."""
    b2u = qt.bytes_to_unicode()
    base = [b2u[b] for b in range(256)]
    tokens = base + ["ab", "abc", "bc", "Ġa", "zz\u4e00", b"\xff\xfe", "", "<ctl>", "Ġa"]
    types = [NORMAL] * (len(tokens) - 2) + [CONTROL, NORMAL]
    merges = ["a b", "ab c", "b c", "Ġ a", "a b", "q missing", "x y"]   # "xy" is not a token
    tok = qc.Tokenizer.from_vocab(tokens, types, merges)
    assert tok.n_merges == 4
    assert tok.encode("abc") == [tokens.index("abc")]
    assert tok.encode(" a") == [len(tokens) - 1]           # the later of the two "Ġa"
    assert tok.decode_bytes([tokens.index(b"\xff\xfe")]) == b"\xff\xfe"
    assert tok.decode_bytes([tokens.index("zz\u4e00")]) == "zz\u4e00".encode()
    assert tok.decode_bytes([tokens.index("")]) == b""
    assert tok.encode("x<ctl>", allow_special=True) == [tokens.index("x"), tokens.index("<ctl>")]
    assert tok.special_ids == {"<ctl>": tokens.index("<ctl>")}
    with pytest.raises(qc.ModelError, match="merge 1"):
        qc.Tokenizer.from_vocab(tokens, types, ["a b", "abc"])
    with pytest.raises(ValueError, match="token types"):
        qc.Tokenizer.from_vocab(tokens, types[:-1], merges)
