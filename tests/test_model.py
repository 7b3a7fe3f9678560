"""The model loader (config, validation, weights) and the DESIGN.md pitfalls, each checked on
the engine's own captures with NumPy: q/k/v biases, NEOX RoPE pairs and theta from the file,
RMSNorm eps from the file, the GQA head mapping, tied vs untied lm_head (output.weight wins when
present), n_vocab from the embedding; plus the Model API (config, capture names, errors, close).

Tolerances: the checks recompute one step in float64 NumPy from the engine's own float32 input
capture and the float32 weights (the reference loader, i.e. the gguf package); one float32 dot
product of length <= 512 differs from float64 by < 1e-6 relative, so 1e-5 leaves ~10x headroom.
"""
import os

import numpy as np
import pytest

import qwencuda as qc
from engine_util import design_capture_names, model_file, rel_err, scratch_dir

TOL = 1e-5
IDS = [11, 250, 37, 301, 5, 64, 199]


def _weights(path):
    return qc.reference.load(path).weights


def _rope_np(x, pos, theta, neox=True):
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(pos, np.float64)[:, None, None] * inv[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    x = x.astype(np.float64)
    out = np.empty_like(x)
    if neox:
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _write_gguf(path, arch="qwen2", meta=None, tensors=None, tokens=None):
    """A GGUF file from float32 arrays (NumPy shapes) and metadata, with the gguf package."""
    import gguf

    w = gguf.GGUFWriter(os.fspath(path), arch)
    for key, (kind, value) in (meta or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _tiny_parts(theta=1e6, eps=1e-6, n_head_kv=2):
    """Metadata and float32 tensors of the f32 "tiny" model, to be edited by a test."""
    src = model_file("tiny", "f32")
    weights = {k: v.copy() for k, v in _weights(src).items()}
    meta = {
        "qwen2.context_length": ("uint32", 4096), "qwen2.embedding_length": ("uint32", 64),
        "qwen2.block_count": ("uint32", 2), "qwen2.feed_forward_length": ("uint32", 256),
        "qwen2.attention.head_count": ("uint32", 4),
        "qwen2.attention.head_count_kv": ("uint32", n_head_kv),
        "qwen2.rope.freq_base": ("float32", theta),
        "qwen2.attention.layer_norm_rms_epsilon": ("float32", eps),
    }
    return meta, weights


def _custom(name):
    return os.path.join(scratch_dir(), name)


# ---------------------------------------------------------------------------------------------
# config and validation

def test_config_comes_from_the_metadata():
    with qc.Model(model_file("tiny-gqa7", "q8_0"), device="cpu") as m:
        c = m.config
        assert (c.arch, c.n_vocab, c.dim, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.ffn_dim) == \
            ("qwen2", 400, 224, 2, 14, 2, 16, 256)
        assert c.n_ctx_train == 4096 and c.tied is False
        assert c.rope_theta == pytest.approx(1e6) and c.norm_eps == pytest.approx(1e-6)
        with pytest.raises(Exception):
            c.dim = 3                               # frozen
        assert m.device == "cpu" and m.path.endswith(".gguf")
        # the C core's list (through _core) against DESIGN.md's, and against what a forward emits
        assert m.capture_names() == design_capture_names(2)
        assert list(m.forward([1, 2, 3], capture="*").tensors) == design_capture_names(2)
        assert "Q8_0" in m.tensor_types().values()
        assert "224" in repr(m) and "cpu" in repr(m)


def test_capture_names_in_forward_order():
    names = qc.capture_names(1)
    assert names[:5] == ["embed", "blk.0.attn_norm", "blk.0.q", "blk.0.k", "blk.0.v"]
    assert names[-3:] == ["output_norm", "logits", "argmax"]
    assert names.index("blk.0.attn_scores") < names.index("blk.0.attn_probs") < names.index("blk.0.attn_out")


def test_wrong_architecture_is_named():
    meta, weights = _tiny_parts()
    meta = {k.replace("qwen2.", "llama."): v for k, v in meta.items()}
    path = _write_gguf(_custom("llama.gguf"), arch="llama", meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match="llama"):
        qc.Model(path, device="cpu")


def test_architecture_that_is_not_utf8_is_a_model_error():
    meta, weights = _tiny_parts()
    meta = {k.replace("qwen2.", "qwenX."): v for k, v in meta.items()}
    path = _write_gguf(_custom("arch-bytes.gguf"), arch="qwenX", meta=meta, tensors=weights)
    with open(path, "r+b") as fh:
        b = fh.read().replace(b"qwenX", b"qw\xffn\x80")
        fh.seek(0)
        fh.write(b)
    with pytest.raises(qc.ModelError, match=r"architecture 'qw\\xffn\\x80' is not supported"):
        qc.Model(path, device="cpu")


def test_layers_beyond_block_count_are_named():
    meta, weights = _tiny_parts()
    meta["qwen2.block_count"] = ("uint32", 1)
    path = _write_gguf(_custom("blocks1.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"blk\.1\.\w+\.\w+: layer 1 is beyond qwen2\.block_count = 1"):
        qc.Model(path, device="cpu")


def test_a_tensor_the_model_does_not_read_is_named():
    """A renamed output.weight must not make the model tied without a word (llama.cpp refuses too)."""
    meta, weights = _tiny_parts()
    weights["outpup.weight"] = weights.pop("output.weight")
    path = _write_gguf(_custom("renamed-output.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"tensor 'outpup\.weight' is not part of a qwen2 model"):
        qc.Model(path, device="cpu")


@pytest.mark.parametrize("theta", [float("inf"), float("nan"), 1e30, 1e-6, 0.0, -1.0])
def test_implausible_rope_base_is_refused(theta):
    meta, weights = _tiny_parts(theta=theta)
    path = _write_gguf(_custom(f"theta{theta}.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"qwen2\.rope\.freq_base = .*: expected a RoPE base in \[1, 1e\+09\]"):
        qc.Model(path, device="cpu")


def test_missing_rope_base_warns_and_uses_llamacpps_default():
    meta, weights = _tiny_parts()
    del meta["qwen2.rope.freq_base"]
    path = _write_gguf(_custom("notheta.gguf"), meta=meta, tensors=weights)
    with pytest.warns(UserWarning, match=r"qwen2\.rope\.freq_base is missing: using RoPE base 10000"):
        m = qc.Model(path, device="cpu")
    with m:
        assert m.config.rope_theta == 10000.0


def test_transposed_tensor_is_named_with_both_shapes():
    meta, weights = _tiny_parts()
    weights["blk.1.attn_k.weight"] = np.ascontiguousarray(weights["blk.1.attn_k.weight"].T)
    path = _write_gguf(_custom("transposed.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"blk\.1\.attn_k\.weight: expected \(32, 64\) got \(64, 32\)"):
        qc.Model(path, device="cpu")


def test_missing_tensor_is_named():
    meta, weights = _tiny_parts()
    del weights["blk.0.attn_v.bias"]
    path = _write_gguf(_custom("nobias.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"blk\.0\.attn_v\.bias"):
        qc.Model(path, device="cpu")


def test_unsupported_type_is_named():
    meta, weights = _tiny_parts()
    weights["blk.0.ffn_up.weight"] = np.zeros((256, 64), dtype=np.int8)
    path = _write_gguf(_custom("int8.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"blk\.0\.ffn_up\.weight.*I8"):
        qc.Model(path, device="cpu")


@pytest.mark.parametrize("key,value,match", [
    ("qwen2.attention.head_count", ("uint32", 3), "multiple of head_count"),
    ("qwen2.attention.head_count_kv", ("uint32", 3), "multiple of head_count_kv"),
    ("qwen2.attention.layer_norm_rms_epsilon", None, "layer_norm_rms_epsilon"),
    ("qwen2.block_count", None, "block_count"),
])
def test_bad_or_missing_metadata(key, value, match):
    meta, weights = _tiny_parts()
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    path = _write_gguf(_custom(f"meta-{abs(hash((key, value)))}.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=match):
        qc.Model(path, device="cpu")


def test_odd_head_dim_is_refused():
    meta, weights = _tiny_parts()
    meta["qwen2.attention.head_count"] = ("uint32", 64)    # head_dim 1
    meta["qwen2.attention.head_count_kv"] = ("uint32", 64)
    path = _write_gguf(_custom("odd-hd.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match="odd"):
        qc.Model(path, device="cpu")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf file at all")
    with pytest.raises(qc.GGUFError):
        qc.Model(p, device="cpu")
    with pytest.raises(OSError):
        qc.Model(tmp_path / "missing.gguf", device="cpu")


def test_bad_device_and_threads():
    with pytest.raises(ValueError, match="device"):
        qc.Model(model_file("tiny"), device="tpu")
    with pytest.raises(ValueError):
        qc.Model(model_file("tiny"), device="cpu", threads=-2)
    info = qc.build_info()
    if not info["cuda"]:
        with pytest.raises(qc.CudaError):
            qc.Model(model_file("tiny"), device="cuda")
        with qc.Model(model_file("tiny"), device="auto") as m:
            assert m.device == "cpu"


def test_path_none_uses_qwencuda_model(monkeypatch):
    monkeypatch.setenv("QWENCUDA_MODEL", model_file("tiny"))
    with qc.Model(device="cpu") as m:
        assert os.path.samefile(m.path, model_file("tiny"))


def test_forward_argument_errors():
    with qc.Model(model_file("tiny"), device="cpu") as m:
        with pytest.raises(ValueError, match="empty"):
            m.forward([])
        with pytest.raises(ValueError, match=r"token id 400 at ids\[2\] \(position 2\)"):
            m.forward([1, 2, 400])
        with pytest.raises(ValueError, match="matches no capture name.*embed"):
            m.forward([1], capture=["embed", "blk.9.q"])
        with pytest.raises(TypeError):
            m.forward([1], capture=[3])
        tr = m.forward(np.array([1, 2, 3], dtype=np.uint16), logits="last")
        assert tr.logits.shape == (1, 400)
        assert m.forward(5).logits.shape == (1, 400)


# ---------------------------------------------------------------------------------------------
# DESIGN.md pitfalls, each on the engine's captures

@pytest.fixture(scope="module")
def gqa7():
    path = model_file("tiny-gqa7", "f32")
    with qc.Model(path, device="cpu") as m:
        yield m, _weights(path), m.forward(IDS, capture="*", logits="all")


def test_qkv_biases_are_applied(gqa7):
    m, w, tr = gqa7
    c = m.config
    h = tr["blk.0.attn_norm"].astype(np.float64)
    for t, heads in (("q", c.n_head), ("k", c.n_head_kv), ("v", c.n_head_kv)):
        want = h @ w[f"blk.0.attn_{t}.weight"].T + w[f"blk.0.attn_{t}.bias"]
        got = tr[f"blk.0.{t}"].reshape(len(IDS), heads * c.head_dim)
        assert rel_err(got, want) < TOL, t
        # the biases are large: leaving them out would be a gross error
        assert rel_err(h @ w[f"blk.0.attn_{t}.weight"].T, want) > 0.1


def test_rope_uses_neox_pairs_and_the_files_theta(gqa7):
    m, _, tr = gqa7
    pos = np.arange(len(IDS))
    for t in ("q", "k"):
        x = tr[f"blk.1.{t}"]
        want = _rope_np(x, pos, m.config.rope_theta, neox=True)
        assert rel_err(tr[f"blk.1.{t}_rope"], want) < TOL
        assert rel_err(_rope_np(x, pos, m.config.rope_theta, neox=False), want) > 1e-2
        assert rel_err(_rope_np(x, pos, 10000.0, neox=True), want) > 1e-3


def test_rope_theta_and_norm_eps_come_from_the_file():
    meta, weights = _tiny_parts(theta=10000.0, eps=1e-2)
    path = _write_gguf(_custom("theta1e4.gguf"), meta=meta, tensors=weights)
    with qc.Model(path, device="cpu") as m:
        assert m.config.rope_theta == 10000.0 and m.config.norm_eps == pytest.approx(1e-2)
        tr = m.forward(IDS, capture=["embed", "blk.0.attn_norm", "blk.0.q", "blk.0.q_rope"])
    x = tr["embed"].astype(np.float64)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-2) * weights["blk.0.attn_norm.weight"]
    assert rel_err(tr["blk.0.attn_norm"], want) < TOL
    assert rel_err(tr["blk.0.q_rope"], _rope_np(tr["blk.0.q"], np.arange(len(IDS)), 10000.0)) < TOL


def test_gqa_query_head_reads_kv_head_h_div_group(gqa7):
    m, _, tr = gqa7
    c = m.config
    group = c.n_head // c.n_head_kv
    assert group == 7
    q, k, v = tr["blk.0.q_rope"], tr["blk.0.k_rope"], tr["blk.0.v"]
    scores, probs, out = tr["blk.0.attn_scores"], tr["blk.0.attn_probs"], tr["blk.0.attn_out"]
    n = len(IDS)
    mask = np.triu(np.ones((n, n), bool), 1)
    for h in range(c.n_head):
        kv = h // group
        s = q[:, h, :].astype(np.float64) @ k[:, kv, :].T.astype(np.float64) / np.sqrt(c.head_dim)
        s[mask] = -np.inf
        assert rel_err(np.where(mask, 0, scores[h]), np.where(mask, 0, s)) < TOL, h
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        assert rel_err(probs[h], p) < TOL
        o = out[:, h * c.head_dim:(h + 1) * c.head_dim]
        assert rel_err(o, p @ v[:, kv, :]) < TOL
        if h % c.n_head_kv != kv:   # the h % n_head_kv mix-up would read another head
            wrong = q[:, h, :] @ k[:, h % c.n_head_kv, :].T / np.sqrt(c.head_dim)
            assert rel_err(np.where(mask, 0, wrong), np.where(mask, 0, s)) > 1e-2


def test_untied_lm_head_uses_output_weight(gqa7):
    m, w, tr = gqa7
    assert not m.config.tied and "output.weight" in w
    h = tr["output_norm"].astype(np.float64)
    want = h @ w["output.weight"].T
    assert rel_err(tr.logits, want) < TOL
    assert rel_err(h @ w["token_embd.weight"].T, want) > 0.5


def test_tied_lm_head_uses_the_embedding():
    path = model_file("tiny", "q8_0", tied=True)
    w = _weights(path)
    assert "output.weight" not in w
    # the float32 reference ops: device="cpu" rounds the lm_head's input to 8 bits (~5e-3 here)
    with qc.Model(path, device="cpu:float") as m:
        assert m.config.tied
        tr = m.forward(IDS, capture="output_norm")
        assert "tied" in list(m.tensor_types())[1]
    assert rel_err(tr.logits, tr["output_norm"].astype(np.float64) @ w["token_embd.weight"].T) < TOL


def test_output_weight_is_preferred_when_both_exist():
    """A file that carries output.weight equal to nothing like token_embd (e.g. the real Q4_K_M:
    Q8_0 lm_head, Q5_0 embedding): the logits must come from output.weight."""
    meta, weights = _tiny_parts()
    rng = np.random.default_rng(5)
    weights["output.weight"] = (0.02 * rng.standard_normal(weights["token_embd.weight"].shape)).astype(np.float32)
    path = _write_gguf(_custom("own-head.gguf"), meta=meta, tensors=weights)
    with qc.Model(path, device="cpu") as m:
        tr = m.forward(IDS, capture="output_norm")
    h = tr["output_norm"].astype(np.float64)
    assert rel_err(tr.logits, h @ weights["output.weight"].T) < TOL


def test_n_vocab_comes_from_the_embedding_not_the_tokenizer():
    meta, weights = _tiny_parts()
    tokens = [f"t{i}" for i in range(300)]            # the tokenizer knows 300; the embedding 400
    path = _write_gguf(_custom("short-vocab.gguf"), meta=meta, tensors=weights, tokens=tokens)
    with qc.Model(path, device="cpu") as m:
        assert m.config.n_vocab == 400
        tr = m.forward([399, 350])                     # ids past the tokenizer's end are valid
        assert tr.logits.shape == (2, 400)


def test_head_count_kv_defaults_to_head_count():
    meta, weights = _tiny_parts()
    del meta["qwen2.attention.head_count_kv"]
    # with 4 KV heads the k/v weights need 64 rows: the check names the tensor
    path = _write_gguf(_custom("no-kv-count.gguf"), meta=meta, tensors=weights)
    with pytest.raises(qc.ModelError, match=r"attn_k\.weight: expected \(64, 64\) got \(32, 64\)"):
        qc.Model(path, device="cpu")


# ---------------------------------------------------------------------------------------------
# Trace

def test_trace_save_load_and_repr(tmp_path):
    with qc.Model(model_file("tiny"), device="cpu") as m:
        tr = m.forward(IDS[:4], capture=["blk.0.q", "argmax"], logits="all")
    p = tr.save(tmp_path / "run")
    assert p.endswith(".npz")
    back = qc.Trace.load(p)
    assert back.source == "cpu" and list(back.keys()) == ["blk.0.q", "argmax"]
    for f in ("logits", "argmax", "ids", "positions", "logit_positions"):
        np.testing.assert_array_equal(getattr(back, f), getattr(tr, f))
    np.testing.assert_array_equal(back["blk.0.q"], tr["blk.0.q"])
    text = repr(tr)
    assert "blk.0.q" in text and "(4, 4, 16)" in text and "cpu" in text
    with pytest.raises(KeyError, match="not captured"):
        tr["blk.1.q"]
    assert "blk.0.q" in tr and len(tr) == 2 and dict(tr.items()).keys() == tr.keys()


# ---------------------------------------------------------------------------------------------
# bench (figures are reported, never asserted)

def test_bench_commit_outside_a_checkout(monkeypatch):
    """An installed copy has no .git: bench names $QWENCUDA_COMMIT (gpu_check.sh sets it), else
    none."""
    import subprocess

    from qwencuda import bench

    def no_git(*args, **kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setenv("QWENCUDA_COMMIT", "abc1234")
    assert bench._commit() == "abc1234"
    monkeypatch.delenv("QWENCUDA_COMMIT")
    assert bench._commit() is None


def test_run_bench_and_format_bench():
    from qwencuda.bench import format_bench, run_bench

    r = run_bench(model_file("tiny", "q8_0"), "cpu", prompt_tokens=8, gen_tokens=4, repeats=2)
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and len(r["decode_s"]) == 2
    assert r["type_mix"] == {"Q8_0": 16} and r["lm_head_type"] == "Q8_0" and r["device"] == "cpu"
    assert r["machine"]["cpu"] and r["machine"]["gpu"] is None
    text = format_bench(r)
    assert "prefill" in text and "decode" in text and "tok/s" in text and "Q8_0 x16" in text
    # what a decode step reads, from the gguf package's tensor table: the layers, the output norm,
    # the lm_head (token_embd when tied) or else one embedding row; the cache at the mean depth
    import gguf

    reader = gguf.GGUFReader(model_file("tiny", "q8_0"))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    want = sum(v for k, v in sizes.items() if k.startswith("blk.")) + sizes["output_norm.weight"]
    with qc.Model(model_file("tiny", "q8_0")) as m:
        cfg = m.config
    if "output.weight" in sizes:
        want += sizes["output.weight"] + sizes["token_embd.weight"] // cfg.n_vocab
    else:
        want += sizes["token_embd.weight"]
    assert r["decode_weight_bytes"] == want
    keys = 8 + (4 + 1) / 2
    assert r["decode_kv_bytes"] == 2 * cfg.n_layer * keys * cfg.n_head_kv * cfg.head_dim * (2 if r["kv_type"] == "f16" else 4)
    assert r["decode_bandwidth"] == pytest.approx((want + r["decode_kv_bytes"]) * r["decode_tok_s"])
    assert r["peak_bandwidth"] is None and "GB/s" in text   # the CPU has no stated bound
    with pytest.raises(ValueError):
        run_bench(model_file("tiny"), "cpu", prompt_tokens=0)
