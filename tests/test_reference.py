"""qwencuda.reference, the NumPy oracle, checked against things outside itself:
(a) HF transformers' Qwen2ForCausalLM with the same weights (where torch is installed),
(b) hand-derivable invariants and the promised effect of every fault,
(c) the real Qwen2.5-Coder-0.5B-Instruct file (QWENCUDA_MODEL)."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from qwencuda import reference as R  # noqa: E402
from qwencuda import testing as qt  # noqa: E402

IDS = [3, 17, 200, 45, 99, 310, 7, 256, 128, 64, 12, 388]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    out = {}
    for cfg in ("tiny", "tiny-gqa7", "tiny-hd128", "tiny-oddvocab", "tiny-gqa1"):
        out[cfg] = qt.write_model(d / f"{cfg}.gguf", cfg)
    out["tiny-tied"] = qt.write_model(d / "tied.gguf", "tiny", tied=True)
    out["tiny-q4_k_m"] = qt.write_model(d / "q4km.gguf", "tiny-hd64", "q4_k_m")
    return out


@pytest.fixture(scope="module")
def models(paths):
    return {k: R.load(p) for k, p in paths.items()}


@pytest.fixture(scope="module")
def tiny(models):
    return models["tiny"]


@pytest.fixture(scope="module")
def base(tiny):
    return R.forward(tiny, IDS)


def _shapes(c, n, rows):
    hd, H, Hk = c.head_dim, c.n_head, c.n_head_kv
    s = {"embed": (n, c.dim), "output_norm": (n, c.dim), "logits": (rows, c.n_vocab), "argmax": (rows,)}
    for L in range(c.n_layer):
        p = f"blk.{L}."
        s.update({p + "attn_norm": (n, c.dim), p + "q": (n, H, hd), p + "q_rope": (n, H, hd),
                  p + "k": (n, Hk, hd), p + "v": (n, Hk, hd), p + "k_rope": (n, Hk, hd),
                  p + "attn_scores": (H, n, n), p + "attn_probs": (H, n, n), p + "attn_out": (n, H * hd),
                  p + "attn_proj": (n, c.dim), p + "resid_mid": (n, c.dim), p + "ffn_norm": (n, c.dim),
                  p + "gate": (n, c.ffn_dim), p + "up": (n, c.ffn_dim), p + "ffn_act": (n, c.ffn_dim),
                  p + "ffn_out": (n, c.dim), p + "resid_out": (n, c.dim)})
    return s


def _first_diff(a, b, names, rtol=1e-5, atol=1e-5):
    for k in names:
        x, y = a[k], b[k]
        if x.shape != y.shape or not np.allclose(x, y, rtol=rtol, atol=atol):
            return k
    return None


# ---------------------------------------------------------------------------------------------
# (b) invariants

@pytest.mark.parametrize("cfg", ["tiny", "tiny-gqa7", "tiny-hd128", "tiny-oddvocab", "tiny-gqa1"])
def test_capture_names_and_shapes(models, cfg):
    m = models[cfg]
    c = m.config
    tr = R.forward(m, IDS[:7])
    want = _shapes(c, 7, 7)
    assert list(tr.keys()) == R.capture_names(c.n_layer)
    try:
        from qwencuda.trace import Trace, capture_names
    except ImportError:
        pass
    else:
        assert isinstance(tr, Trace)
        assert R.capture_names(c.n_layer) == capture_names(c.n_layer)
    assert tr.source == "reference"
    for k, shape in want.items():
        assert tr[k].shape == shape, k
        assert tr[k].dtype == (np.int32 if k == "argmax" else np.float32), k
    assert tr.logits.shape == (7, c.n_vocab)
    assert list(tr.positions) == list(range(7)) and list(tr.ids) == IDS[:7]
    assert list(tr.logit_positions) == list(range(7))
    assert np.isfinite(tr.logits).all()


def test_config_from_metadata(models):
    c = models["tiny-gqa7"].config
    assert (c.n_vocab, c.dim, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.ffn_dim) == \
        (400, 224, 2, 14, 2, 16, 256)
    assert c.rope_theta == 1e6 and c.norm_eps == pytest.approx(1e-6) and not c.tied
    assert models["tiny-tied"].config.tied
    assert models["tiny-oddvocab"].config.n_vocab == 389
    assert models["tiny"].n_written == 256 + len(qt.make_vocab(400)[2])


def test_capture_selection(tiny):
    tr = R.forward(tiny, IDS[:4], capture="blk.*.attn_probs", logits="last")
    assert list(tr.keys()) == ["blk.0.attn_probs", "blk.1.attn_probs"]
    assert tr.logits.shape == (1, 400) and list(tr.logit_positions) == [3]
    tr = R.forward(tiny, IDS[:4], capture=None)
    assert len(tr.keys()) == 0 and tr.logits.shape == (4, 400)
    tr = R.forward(tiny, IDS[:4], capture=["embed", "logits"])
    assert list(tr.keys()) == ["embed", "logits"]
    with pytest.raises(ValueError):
        R.forward(tiny, IDS[:4], capture="blk.*.nothing")
    with pytest.raises(ValueError):
        R.forward(tiny, IDS[:4], logits="first")
    with pytest.raises(ValueError):
        R.forward(tiny, [400])
    with pytest.raises(ValueError):
        R.forward(tiny, [])
    with pytest.raises(ValueError):
        R.forward(tiny, IDS, faults=("no_such_fault",))


def test_attention_probs_sum_to_one_and_causal(base):
    for L in range(2):
        p = base[f"blk.{L}.attn_probs"]
        s = base[f"blk.{L}.attn_scores"]
        np.testing.assert_allclose(p.sum(-1), 1.0, rtol=0, atol=1e-5)
        upper = np.triu(np.ones(p.shape[1:], bool), 1)
        assert np.all(p[:, upper] == 0)
        assert np.all(np.isneginf(s[:, upper]))
        assert np.isfinite(s[:, ~upper]).all()
        assert np.all(p[:, 0, 0] == 1)


def test_scores_are_scaled_dot_products(tiny, base):
    c = tiny.config
    q, k = base["blk.0.q_rope"], base["blk.0.k_rope"]
    group = c.n_head // c.n_head_kv
    for h in range(c.n_head):
        want = q[:, h] @ k[:, h // group].T / np.sqrt(c.head_dim)
        tril = np.tril(np.ones_like(want, bool))
        np.testing.assert_allclose(base["blk.0.attn_scores"][h][tril], want[tril], rtol=1e-4, atol=1e-3)
        out = base["blk.0.attn_probs"][h] @ base["blk.0.v"][:, h // group]
        np.testing.assert_allclose(base["blk.0.attn_out"][:, h * 16:(h + 1) * 16], out, rtol=1e-4, atol=1e-4)


def test_rope_position_zero_is_identity_and_neox_pairs(tiny, base):
    np.testing.assert_array_equal(base["blk.0.q_rope"][0], base["blk.0.q"][0])
    np.testing.assert_array_equal(base["blk.0.k_rope"][0], base["blk.0.k"][0])
    # pair (i, i + hd/2) at position p rotates by p * theta^(-2i/hd); check i = 0 and i = 3
    q, qr, hd = base["blk.0.q"], base["blk.0.q_rope"], 16
    for p in (1, 5, 11):
        for i in (0, 3):
            a = p * 1e6 ** (-2 * i / hd)
            x0, x1 = q[p, :, i].astype(np.float64), q[p, :, i + hd // 2].astype(np.float64)
            np.testing.assert_allclose(qr[p, :, i], x0 * np.cos(a) - x1 * np.sin(a), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(qr[p, :, i + hd // 2], x0 * np.sin(a) + x1 * np.cos(a), rtol=1e-5, atol=1e-5)
    # a rotation keeps the norm of every head
    np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)


def test_rmsnorm(tiny, base):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 64)) * 3).astype(np.float32)
    y = R._rmsnorm(x, np.ones(64, np.float32), 1e-6)
    np.testing.assert_allclose(np.sqrt((y.astype(np.float64) ** 2).mean(-1)), 1.0, rtol=1e-6)
    y2 = R._rmsnorm(x, np.full(64, 2.5, np.float32), 1e-6)
    np.testing.assert_allclose(np.sqrt((y2.astype(np.float64) ** 2).mean(-1)), 2.5, rtol=1e-6)
    # in the model: attn_norm / weight has RMS sqrt(ms / (ms + eps)) (the embeddings are small:
    # ms ~ 4e-4, so eps 1e-6 shows at 1e-3)
    w = tiny.weights["blk.0.attn_norm.weight"]
    unit = base["blk.0.attn_norm"] / w
    ms = (base["embed"].astype(np.float64) ** 2).mean(-1)
    np.testing.assert_allclose(np.sqrt((unit.astype(np.float64) ** 2).mean(-1)), np.sqrt(ms / (ms + 1e-6)), rtol=1e-5)


def test_projections_residuals_and_lm_head(tiny, base):
    W = tiny.weights
    h = base["blk.0.attn_norm"]
    np.testing.assert_allclose(base["blk.0.q"].reshape(len(IDS), -1),
                               h @ W["blk.0.attn_q.weight"].T + W["blk.0.attn_q.bias"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(base["embed"], W["token_embd.weight"][IDS])
    np.testing.assert_allclose(base["blk.0.resid_mid"], base["embed"] + base["blk.0.attn_proj"], rtol=1e-6, atol=1e-6)
    act = base["blk.1.gate"] / (1 + np.exp(-base["blk.1.gate"])) * base["blk.1.up"]
    np.testing.assert_allclose(base["blk.1.ffn_act"], act, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(base["blk.1.resid_out"], base["blk.1.resid_mid"] + base["blk.1.ffn_out"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(base.logits, base["output_norm"] @ W["output.weight"].T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(base.argmax, base.logits.argmax(-1))
    np.testing.assert_array_equal(base["argmax"], base.argmax)


def test_tied_uses_token_embd(models):
    m = models["tiny-tied"]
    assert "output.weight" not in m.weights
    tr = R.forward(m, IDS[:5])
    np.testing.assert_allclose(tr.logits, tr["output_norm"] @ m.weights["token_embd.weight"].T, rtol=1e-4, atol=1e-4)


def test_incremental_matches_full(tiny, base):
    steps = R.forward_steps(tiny, IDS, 5)
    assert len(steps) == 1 + len(IDS) - 5
    np.testing.assert_allclose(steps[0].logits[0], base.logits[4], rtol=1e-4, atol=1e-4)
    for j, tr in enumerate(steps[1:]):
        pos = 5 + j
        assert list(tr.positions) == [pos] and list(tr.logit_positions) == [pos]
        assert tr["blk.1.attn_probs"].shape == (4, 1, pos + 1)
        np.testing.assert_allclose(tr["blk.1.attn_probs"][:, 0], base["blk.1.attn_probs"][:, pos, :pos + 1], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(tr["blk.0.k_rope"][0], base["blk.0.k_rope"][pos], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.logits[0], base.logits[pos], rtol=1e-4, atol=1e-4)
    last = R.forward(tiny, IDS, logits="last")
    np.testing.assert_allclose(last.logits[0], base.logits[-1], rtol=1e-5, atol=1e-5)


def test_session_rewind(tiny, base):
    s = R.RefSession(tiny)
    s.prefill(IDS[:6])
    s.step(IDS[6])
    s.rewind(2)
    assert s.position == 5
    tr = s.step(IDS[5])
    np.testing.assert_allclose(tr.logits[0], base.logits[5], rtol=1e-4, atol=1e-4)
    s.reset()
    assert s.position == 0
    with pytest.raises(ValueError):
        s.rewind(1)


def test_greedy_is_argmax_of_full_passes(tiny):
    out = R.greedy(tiny, IDS[:4], 5)
    assert len(out) == 5
    seq = list(IDS[:4])
    for t in out:
        assert R.forward(tiny, seq, capture=None, logits="last").argmax[0] == t
        seq.append(t)
    assert R.greedy(tiny, IDS[:4], 5, stop=[out[0]]) == out[:1]


def test_forward_accepts_paths_and_gguffile_like(paths, base):
    tr = R.forward(paths["tiny"], IDS)
    np.testing.assert_array_equal(tr.logits, base.logits)

    class F:
        path = paths["tiny"]
    assert R.load(F()).config == R.load(paths["tiny"]).config
    R.clear_cache()


def test_quantized_file_runs(models):
    m = models["tiny-q4_k_m"]
    assert {"Q4_K", "Q6_K"} <= set(m.types.values())
    tr = R.forward(m, IDS[:6])
    assert np.isfinite(tr.logits).all()


# ---------------------------------------------------------------------------------------------
# (b) faults: each changes the output, first at the capture it names, and does what it says

@pytest.mark.parametrize("fault", sorted(R.FAULTS))
def test_fault_changes_output_first_where_it_claims(tiny, base, fault):
    assert fault in R.FIRST_AFFECTED
    tr = R.forward(tiny, IDS, faults=(fault,))
    names = R.capture_names(tiny.config.n_layer)
    assert _first_diff(base, tr, names) == R.FIRST_AFFECTED[fault]
    assert not np.allclose(tr.logits, base.logits, rtol=1e-4, atol=1e-4)


def test_faults_do_what_they_say(tiny, base):
    W, c, n = tiny.weights, tiny.config, len(IDS)
    h = base["blk.0.attn_norm"]

    tr = R.forward(tiny, IDS, faults="no_qkv_bias")
    np.testing.assert_allclose(tr["blk.0.q"].reshape(n, -1), h @ W["blk.0.attn_q.weight"].T, rtol=1e-5, atol=1e-5)

    tr = R.forward(tiny, IDS, faults="transposed_weights")       # square q: exactly W (not W.T)
    np.testing.assert_allclose(tr["blk.0.q"].reshape(n, -1), h @ W["blk.0.attn_q.weight"] + W["blk.0.attn_q.bias"],
                               rtol=1e-5, atol=1e-4)
    wk = W["blk.0.attn_k.weight"]                                 # (32, 64) read column-major
    np.testing.assert_allclose(tr["blk.0.k"].reshape(n, -1), h @ wk.reshape(64, 32) + W["blk.0.attn_k.bias"],
                               rtol=1e-5, atol=1e-4)

    tr = R.forward(tiny, IDS, faults="kv_pos_stuck")
    np.testing.assert_array_equal(tr["blk.0.q_rope"], tr["blk.0.q"])
    assert list(tr.positions) == [0] * n
    assert tr["blk.0.attn_probs"].shape == (c.n_head, n, 1) and np.all(tr["blk.0.attn_probs"] == 1)
    np.testing.assert_allclose(tr["blk.0.attn_out"].reshape(n, c.n_head, -1)[:, 1], tr["blk.0.v"][:, 0], rtol=1e-6)
    np.testing.assert_allclose(tr["blk.0.attn_out"].reshape(n, c.n_head, -1)[:, 3], tr["blk.0.v"][:, 1], rtol=1e-6)
    one = R.forward(tiny, IDS[:1], faults="kv_pos_stuck")         # invisible on the first token
    np.testing.assert_allclose(one.logits[0], base.logits[0], rtol=1e-5, atol=1e-5)
    steps = R.forward_steps(tiny, IDS[:6], 3, faults=("kv_pos_stuck",))
    assert steps[-1]["blk.0.attn_probs"].shape == (c.n_head, 1, 1)

    tr = R.forward(tiny, IDS, faults="rope_interleaved")
    q, qr, p = tr["blk.0.q"].astype(np.float64), tr["blk.0.q_rope"], 4
    np.testing.assert_allclose(qr[p, :, 0], q[p, :, 0] * np.cos(p) - q[p, :, 1] * np.sin(p), rtol=1e-5, atol=1e-5)

    tr = R.forward(tiny, IDS, faults="rope_base_1e4")
    a = 4 * 1e4 ** (-2 * 3 / 16)
    np.testing.assert_allclose(tr["blk.0.q_rope"][4, :, 3], q[4, :, 3] * np.cos(a) - q[4, :, 11] * np.sin(a), rtol=1e-5, atol=1e-5)

    tr = R.forward(tiny, IDS, faults="rmsnorm_no_mean")
    np.testing.assert_allclose(tr["blk.0.attn_norm"], base["blk.0.attn_norm"] / 8.0, rtol=5e-3)

    tr = R.forward(tiny, IDS, faults="rmsnorm_eps_1e-5")
    x = base["embed"].astype(np.float64)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * W["blk.0.attn_norm.weight"]
    np.testing.assert_allclose(tr["blk.0.attn_norm"], want, rtol=1e-5)

    tr = R.forward(tiny, IDS, faults="gqa_wrong_mapping")       # head 1 reads KV head 1, not 0
    np.testing.assert_allclose(tr["blk.0.attn_probs"][1] @ tr["blk.0.v"][:, 1],
                               tr["blk.0.attn_out"][:, 16:32], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(tr["blk.0.attn_scores"][0], base["blk.0.attn_scores"][0])

    tr = R.forward(tiny, IDS, faults="lm_head_wrong_ld")
    np.testing.assert_allclose(tr.logits, base["output_norm"] @ W["output.weight"].reshape(64, 400),
                               rtol=1e-4, atol=1e-4)

    tr = R.forward(tiny, IDS, faults="argmax_unwritten")
    nw = tiny.n_written
    np.testing.assert_array_equal(tr.logits[:, :nw], base.logits[:, :nw])
    assert np.all(tr.argmax >= nw)


def test_gqa_fault_is_silent_without_groups(models):
    m = models["tiny-gqa1"]
    np.testing.assert_array_equal(R.forward(m, IDS[:5], faults="gqa_wrong_mapping").logits,
                                  R.forward(m, IDS[:5]).logits)


# ---------------------------------------------------------------------------------------------
# (a) HF transformers with the same weights

def _hf_model(ref):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    c = ref.config
    cfg = transformers.Qwen2Config(
        vocab_size=c.n_vocab, hidden_size=c.dim, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv,
        max_position_embeddings=max(c.n_ctx_train, 64), rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tied, hidden_act="silu", attention_dropout=0.0, use_sliding_window=False)
    cfg._attn_implementation = "eager"
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == c.rope_theta
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    W = ref.weights
    sd = {"model.embed_tokens.weight": W["token_embd.weight"], "model.norm.weight": W["output_norm.weight"],
          "lm_head.weight": ref.lm_head}
    for L in range(c.n_layer):
        p, g = f"model.layers.{L}.", f"blk.{L}."
        # GGUF (out, in) is torch Linear's (out, in); Qwen2 (NEOX rotate_half) needs no q/k permutation
        for hf, gg in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v")):
            sd[p + hf + ".weight"] = W[g + gg + ".weight"]
            sd[p + hf + ".bias"] = W[g + gg + ".bias"]
        sd[p + "self_attn.o_proj.weight"] = W[g + "attn_output.weight"]
        sd[p + "mlp.gate_proj.weight"] = W[g + "ffn_gate.weight"]
        sd[p + "mlp.up_proj.weight"] = W[g + "ffn_up.weight"]
        sd[p + "mlp.down_proj.weight"] = W[g + "ffn_down.weight"]
        sd[p + "input_layernorm.weight"] = W[g + "attn_norm.weight"]
        sd[p + "post_attention_layernorm.weight"] = W[g + "ffn_norm.weight"]
    own = model.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            assert tuple(own[k].shape) == v.shape, k
            own[k].copy_(torch.from_numpy(np.ascontiguousarray(v)))
    missing = set(own) - set(sd) - {k for k in own if "rotary" in k}
    assert not missing, missing
    return torch, model


def _compare_hf(ref, ids):
    torch, model = _hf_model(ref)
    tr = R.forward(ref, ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    logits = out.logits[0].numpy()
    # Tolerance: both float32 (the reference's attention in float64): 2e-4 of the largest |logit|.
    # Measured: max |difference| 2e-5..4e-5 on the tiny configs (|logits| < 10) and on the real
    # 0.5B Q4_K_M (|logits| < 20), i.e. about 2e-6 of the scale.
    scale = float(np.abs(tr.logits).max())
    np.testing.assert_allclose(logits, tr.logits, rtol=0, atol=2e-4 * scale)
    np.testing.assert_array_equal(logits.argmax(-1), tr.argmax)
    for L in range(ref.config.n_layer - 1):   # hidden_states[L + 1] is layer L's output
        hs = out.hidden_states[L + 1][0].numpy()
        ref_h = tr[f"blk.{L}.resid_out"]
        np.testing.assert_allclose(hs, ref_h, rtol=0, atol=2e-4 * float(np.abs(ref_h).max()))


@pytest.mark.parametrize("cfg", ["tiny", "tiny-gqa7", "tiny-hd128", "tiny-tied", "tiny-q4_k_m"])
def test_matches_hf_transformers(models, cfg, record_property):
    record_property("oracle", "hf_transformers")      # counted in the terminal summary (conftest.py)
    _compare_hf(models[cfg], IDS)


# ---------------------------------------------------------------------------------------------
# (c) the real model

@pytest.fixture(scope="module")
def real(real_reference):
    return real_reference                 # built once per test session (conftest.py)


@pytest.fixture(scope="module")
def real_tok(real_gguf_reader):
    pytest.importorskip("tokenizers")
    return qt.hf_tokenizer(real_gguf_reader)         # the session's GGUFReader (conftest.py)


FIB = "def fibonacci(n):"
FIB_IDS = [750, 75698, 1445, 1648]      # Qwen2.5 ids of FIB (checked with the file's vocab below)


def test_real_config_and_biases(real):
    c = real.config
    assert (c.n_vocab, c.dim, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.ffn_dim) == \
        (151936, 896, 24, 14, 2, 64, 4864)
    assert c.rope_theta == 1e6 and c.norm_eps == pytest.approx(1e-6) and not c.tied
    assert real.n_written == 151643
    assert real.types["output.weight"] == "Q8_0" and real.types["token_embd.weight"] == "Q5_0"
    for n in ("q", "k"):
        assert np.abs(real.weights[f"blk.0.attn_{n}.bias"]).max() > 10


def test_real_fibonacci(real, real_tok):
    assert real_tok.encode(FIB).ids == FIB_IDS
    tr = R.forward(real, FIB_IDS, capture=["output_norm", "blk.0.q", "blk.23.attn_probs"])
    np.testing.assert_allclose(tr.logits[-1], tr["output_norm"][-1] @ real.weights["output.weight"].T,
                               rtol=1e-4, atol=1e-3)
    out = R.greedy(real, FIB_IDS, 6)
    text = real_tok.decode(out)
    assert out[0] == tr.argmax[-1]
    assert text.startswith("\n"), repr(text)           # a newline, then the body
    assert "if" in text or "return" in text, repr(text)


def test_real_fault_breaks_it(real):
    good = R.forward(real, FIB_IDS, capture=None, logits="last").argmax[0]
    bad = R.forward(real, FIB_IDS, capture=None, logits="last", faults=("no_qkv_bias",)).argmax[0]
    assert good == 198 and bad != good


def test_real_matches_hf_transformers(request, record_property):
    record_property("oracle", "hf_transformers")
    pytest.importorskip("torch")                      # before the real model's reference is built
    pytest.importorskip("transformers")
    _compare_hf(request.getfixturevalue("real"), FIB_IDS)
