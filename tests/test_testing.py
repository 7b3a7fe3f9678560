"""qwencuda.testing: synthetic Qwen2 GGUF files, checked with the gguf package (an outside oracle)."""
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from qwencuda import testing as qt  # noqa: E402

GT = gguf.GGMLQuantizationType
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LEGACY = ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# relative RMS error budget of each encoding on normal data (2-bit is coarse)
ERR = {"F32": 0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 1e-2, "Q6_K": 3e-2, "Q5_0": 6e-2, "Q5_1": 6e-2,
       "Q5_K": 6e-2, "Q4_0": 0.12, "Q4_1": 0.12, "Q4_K": 0.12, "Q3_K": 0.25, "Q2_K": 0.45}


def _read(path):
    r = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items()}
    tensors = {t.name: t for t in r.tensors}
    return r, fields, tensors


def _deq(t):
    shape = tuple(int(x) for x in reversed(t.shape))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return qt.write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "tiny")


def test_configs_and_types():
    for name in ("tiny", "tiny-gqa1", "tiny-gqa7", "tiny-hd64", "tiny-hd128", "tiny-oddvocab",
                 "qwen2.5-0.5b"):
        assert name in qt.CONFIGS
        cfg = qt.resolve_config(name)
        assert cfg["dim"] == cfg["n_head"] * cfg["head_dim"]
    assert qt.resolve_config("tiny-gqa1")["n_head"] == qt.resolve_config("tiny-gqa1")["n_head_kv"]
    g7 = qt.resolve_config("tiny-gqa7")
    assert g7["n_head"] // g7["n_head_kv"] == 7
    assert qt.resolve_config("tiny-hd128")["head_dim"] == 128
    assert qt.resolve_config("tiny-hd64")["head_dim"] == 64
    assert qt.resolve_config("tiny-oddvocab")["n_vocab"] % 2 == 1
    q = qt.resolve_config("qwen2.5-0.5b")
    assert (q["n_vocab"], q["dim"], q["n_layer"], q["n_head"], q["n_head_kv"], q["ffn_dim"],
            q["n_ctx_train"], q["rope_theta"], q["norm_eps"], q["tied"]) == \
        (151936, 896, 24, 14, 2, 4864, 32768, 1e6, 1e-6, True)
    assert set(qt.WEIGHT_TYPES) >= {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                                    "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m"}


def test_config_validation():
    assert qt.resolve_config({"dim": 128, "n_head": 8})["head_dim"] == 16
    with pytest.raises(ValueError):
        qt.resolve_config("nope")
    with pytest.raises(ValueError):
        qt.resolve_config({"dim": 65})
    with pytest.raises(ValueError):
        qt.resolve_config({"n_head": 4, "n_head_kv": 3})
    with pytest.raises(ValueError):
        qt.resolve_config({"bogus": 1})
    with pytest.raises(TypeError):
        qt.resolve_config(3)
    with pytest.raises(ValueError):
        qt.plan_model("tiny", "q7_0")


def test_layout_like_llama_cpp(tiny):
    r, f, t = _read(tiny)
    cfg = qt.resolve_config("tiny")
    assert f["general.architecture"] == "qwen2"
    assert f["qwen2.context_length"] == cfg["n_ctx_train"]
    assert f["qwen2.embedding_length"] == 64
    assert f["qwen2.block_count"] == 2
    assert f["qwen2.feed_forward_length"] == 256
    assert f["qwen2.attention.head_count"] == 4
    assert f["qwen2.attention.head_count_kv"] == 2
    assert f["qwen2.rope.freq_base"] == pytest.approx(1e6)
    assert f["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    names = ["token_embd.weight"]
    for i in range(2):
        names += [f"blk.{i}.{n}" for n in (
            "attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias",
            "attn_v.weight", "attn_v.bias", "attn_output.weight", "ffn_norm.weight",
            "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
    names += ["output_norm.weight", "output.weight"]
    assert list(t) == names
    # GGUF ne order: ne[0] = in features
    ne = {n: [int(x) for x in t[n].shape] for n in t}
    assert ne["token_embd.weight"] == [64, 400]
    assert ne["blk.0.attn_q.weight"] == [64, 64]
    assert ne["blk.0.attn_k.weight"] == [64, 32]
    assert ne["blk.0.attn_v.bias"] == [32]
    assert ne["blk.0.ffn_gate.weight"] == [64, 256]
    assert ne["blk.0.ffn_down.weight"] == [256, 64]
    assert ne["output.weight"] == [64, 400]
    assert all(t[n].tensor_type == GT.F32 for n in t)


def test_tied_and_untied(tmp_path):
    p = qt.write_model(tmp_path / "t.gguf", "tiny", tied=True)
    _, _, t = _read(p)
    assert "output.weight" not in t and len(t) == 2 + 12 * 2
    plan = qt.plan_model("qwen2.5-0.5b", "q8_0")
    assert len(plan) == 290 and "output.weight" not in dict((n, s) for n, s, _ in plan)
    assert len(qt.plan_model("qwen2.5-0.5b", "q8_0", tied=False)) == 291


def test_biases_large_and_scales(tiny):
    _, _, t = _read(tiny)
    for n in ("q", "k"):
        assert np.abs(_deq(t[f"blk.0.attn_{n}.bias"])).max() > 10
    assert np.abs(_deq(t["blk.0.attn_v.bias"])).max() > 1.5
    # k bias large in the lowest-frequency NEOX pairs (dims hd/2-1 and hd-1 of each head)
    kb = _deq(t["blk.0.attn_k.bias"]).reshape(2, 16)
    assert np.all(np.abs(kb[:, [7, 15]]) >= 20)
    assert _deq(t["token_embd.weight"]).std() == pytest.approx(0.02, rel=0.1)
    assert _deq(t["blk.0.ffn_down.weight"]).std() == pytest.approx(1 / 16, rel=0.1)
    assert _deq(t["blk.0.attn_norm.weight"]).mean() == pytest.approx(1.0, abs=0.1)


def test_deterministic(tmp_path):
    a = qt.write_model(tmp_path / "a.gguf", "tiny", "q4_k_m", seed=3)
    b = qt.write_model(tmp_path / "b.gguf", "tiny", "q4_k_m", seed=3)
    c = qt.write_model(tmp_path / "c.gguf", "tiny", "q4_k_m", seed=4)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert open(a, "rb").read() != open(c, "rb").read()


@pytest.mark.parametrize("type_name", LEGACY + K_TYPES)
def test_quantize_round_trips_through_gguf(type_name):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    x[0] = 0.0                               # an all-zero row: scales 0, values 0
    x[1] = np.linspace(-1, 3, 512)           # an offset row
    q = qt.quantize(x, type_name)
    assert q.dtype == np.uint8
    size = gguf.GGML_QUANT_SIZES[GT[type_name]]
    assert q.shape == (6, 512 // size[0] * size[1])
    y = gguf.quants.dequantize(q, GT[type_name])
    assert np.isfinite(y).all()
    assert np.all(y[0] == 0)
    for row in range(1, 6):
        err = np.sqrt(np.mean((y[row] - x[row]) ** 2) / np.mean(x[row] ** 2))
        assert err < ERR[type_name], (row, err)


def test_k_quant_needs_256():
    with pytest.raises(ValueError):
        qt.quantize(np.zeros((2, 64), np.float32), "Q4_K")


@pytest.mark.parametrize("wt", qt.WEIGHT_TYPES)
def test_every_weight_type_all_k_sizes(tmp_path, wt):
    """tiny-hd64 has every row a multiple of 256: each type appears as asked, and the weights are
    a quantization of the f32 model with the same seed."""
    p = qt.write_model(tmp_path / f"{wt}.gguf", "tiny-hd64", wt)
    plan = qt.plan_model("tiny-hd64", wt)
    _, f, t = _read(p)
    assert [n for n, _, _ in plan] == list(t)
    for name, shape, tname in plan:
        assert t[name].tensor_type.name == tname, name
        if name.endswith(".bias") or "norm" in name:
            assert tname == "F32"
        elif wt != "q4_k_m":
            assert tname == wt.upper()
    ref = {n: qt.writer._values(n, s, qt.resolve_config("tiny-hd64"), 0) for n, s, _ in plan}
    for name, shape, tname in plan:
        y = _deq(t[name])
        assert y.shape == shape
        err = np.sqrt(np.mean((y - ref[name]) ** 2) / np.mean(ref[name] ** 2))
        assert err <= ERR[tname] + 1e-7, (name, tname, err)
    assert f["general.file_type"] == qt._FILE_TYPE[wt]


def test_fallback_like_llama_cpp():
    """dim 64 is no multiple of 256 (like 896): K types fall back per tensor; ffn_down (in = 256)
    keeps the K type."""
    types = {n: t for n, _, t in qt.plan_model("tiny", "q4_k")}
    assert types["blk.0.attn_q.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] == "Q4_K"
    types = {n: t for n, _, t in qt.plan_model("tiny", "q6_k")}
    assert types["output.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "Q6_K"
    types = {n: t for n, _, t in qt.plan_model("tiny", "q2_k")}
    assert types["blk.0.attn_k.weight"] == "Q4_0"
    types = {n: t for n, _, t in qt.plan_model({"dim": 48, "n_head": 3, "n_head_kv": 1}, "q8_0")}
    assert types["blk.0.attn_q.weight"] == "F16"   # 48 is no multiple of 32


def test_q4_k_m_matches_the_real_file_pattern():
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: token_embd Q5_0, output Q8_0, q/k/o/gate/up Q5_0;
    attn_v Q8_0 or Q5_0 and ffn_down Q6_K or Q4_K, by layer."""
    types = {n: t for n, _, t in qt.plan_model("qwen2.5-0.5b", "q4_k_m", tied=False)}
    assert types["token_embd.weight"] == "Q5_0"
    assert types["output.weight"] == "Q8_0"
    more = {0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21}
    for i in range(24):
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{n}.weight"] == "Q5_0"
        assert types[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")


@pytest.fixture(scope="module")
def real_reader(real_gguf_reader):
    return real_gguf_reader               # parsed once per test session (conftest.py)


def test_q4_k_m_against_real_file(real_reader):
    r = real_reader
    real = {t.name: t.tensor_type.name for t in r.tensors}
    plan = {n: t for n, _, t in qt.plan_model("qwen2.5-0.5b", "q4_k_m", tied="output.weight" not in real)}
    assert plan == real


def test_vocab():
    tokens, types, merges, special = qt.make_vocab(400)
    assert len(tokens) == len(types) == 400
    assert len(set(tokens)) == 400
    b2u = qt.bytes_to_unicode()
    assert tokens[:256] == list(b2u.values()) and tokens[0] == "!"
    assert set(special) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    for s, i in special.items():
        assert tokens[i] == s and types[i] == 3
    assert types[:256] == [1] * 256
    n_merges = len(merges)
    assert n_merges > 50
    assert tokens[256:256 + n_merges] == ["".join(m.split(" ")) for m in merges]
    for i in range(256 + n_merges + 3, 400):
        assert tokens[i] == f"[PAD{i}]" and types[i] == 5
    known = set()
    for m in merges:                       # every merge joins tokens that exist before it
        a, b = m.split(" ")
        assert (a in known or a in b2u.values()) and (b in known or b in b2u.values())
        known.add(a + b)
    big = qt.make_vocab(151936)
    assert len(big[0]) == 151936 and big[0][-1] == "[PAD151935]"
    assert qt.make_vocab(400) == (tokens, types, merges, special)
    with pytest.raises(ValueError):
        qt.make_vocab(100)


def test_tokenizer_metadata(tiny):
    _, f, _ = _read(tiny)
    tokens, types, merges, special = qt.make_vocab(400)
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "qwen2"
    assert list(f["tokenizer.ggml.tokens"]) == tokens
    assert list(f["tokenizer.ggml.token_type"]) == types
    assert list(f["tokenizer.ggml.merges"]) == merges
    assert f["tokenizer.ggml.bos_token_id"] == special["<|endoftext|>"]
    assert f["tokenizer.ggml.padding_token_id"] == special["<|endoftext|>"]
    assert f["tokenizer.ggml.eos_token_id"] == special["<|im_end|>"]
    assert f["tokenizer.chat_template"] == qt.CHAT_TEMPLATE


def test_no_tokenizer(tmp_path):
    _, f, _ = _read(qt.write_model(tmp_path / "n.gguf", "tiny", vocab=False))
    assert "tokenizer.ggml.tokens" not in f


def test_pretokenize_and_bpe():
    assert qt.pretokenize("Hello world, it's 42!\n\n  x") == \
        ["Hello", " world", ",", " it", "'s", " ", "4", "2", "!\n\n", " ", " x"]
    m = qt.train_bpe("aaab aaab aab", 10)
    assert m[0] == ("a", "a")
    assert m == qt.train_bpe("aaab aaab aab", 10)


def test_hf_tokenizer_round_trip(tiny):
    pytest.importorskip("tokenizers")
    tok = qt.hf_tokenizer(tiny)
    text = "def fibonacci(n):\n    return n + 1  # héllo, wörld! 12345"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) * 0.8          # the merges do compress
    tokens = qt.make_vocab(400)[0]
    assert "def" in [tokens[i] for i in ids]
    enc = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert enc[0] == tokens.index("<|im_start|>") and enc[-1] == tokens.index("<|im_end|>")


def test_chat_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment()
    out = env.from_string(qt.CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                   "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_is_the_real_one(real_reader):
    assert real_reader.fields["tokenizer.chat_template"].contents() == qt.CHAT_TEMPLATE


def test_configs_write_and_dict_config(tmp_path):
    for name in ("tiny-gqa1", "tiny-gqa7", "tiny-hd128", "tiny-oddvocab"):
        cfg = qt.resolve_config(name)
        _, f, t = _read(qt.write_model(tmp_path / f"{name}.gguf", name, "q8_0"))
        assert [int(x) for x in t["token_embd.weight"].shape] == [cfg["dim"], cfg["n_vocab"]]
        assert f["qwen2.attention.head_count_kv"] == cfg["n_head_kv"]
        assert len(f["tokenizer.ggml.tokens"]) == cfg["n_vocab"]
    p = qt.write_model(tmp_path / "d.gguf", {"n_layer": 1, "n_vocab": 300}, "f16")
    _, f, t = _read(p)
    assert f["qwen2.block_count"] == 1 and "blk.1.attn_q.weight" not in t


@pytest.mark.skipif(not os.environ.get("QWENCUDA_SLOW"), reason="writes a 0.5 GB file; QWENCUDA_SLOW=1")
def test_write_qwen_shapes(tmp_path):
    p = qt.write_model(tmp_path / "q.gguf", "qwen2.5-0.5b", "q8_0")
    _, f, t = _read(p)
    assert len(t) == 290 and len(f["tokenizer.ggml.tokens"]) == 151936
