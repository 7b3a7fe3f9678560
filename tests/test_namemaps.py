"""qwencuda.namemaps: HF and llama.cpp dumps (names, layouts, repeated names, raw kq, padded KV,
output rows only) round-trip into qwencuda's captures and line up in compare."""
import numpy as np
import pytest

from qwencuda import namemaps, reference
from qwencuda.debug.compare import compare
from qwencuda.testing import write_model

IDS = [5, 80, 13, 200, 31, 9]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference.load(write_model(str(tmp_path_factory.mktemp("nm") / "tiny.gguf"), seed=2))


@pytest.fixture(scope="module")
def good(ref):
    return reference.forward(ref, IDS)


def _covered(rep):
    return {r.name for r in rep.compared}


def test_hf_round_trip(good):
    dumps = namemaps.to_hf(good)
    assert dumps["model.layers.0.self_attn.q_proj"].shape == (1, len(IDS), 64)   # batch, flat heads
    assert dumps["attentions.1"].shape == (1, 4, len(IDS), len(IDS))
    rep = compare(dumps, good, name_map="hf")
    assert rep.first_divergence is None, str(rep)
    covered = _covered(rep)
    for name in ("embed", "blk.0.attn_norm", "blk.0.q", "blk.0.k", "blk.0.v", "blk.0.attn_probs",
                 "blk.0.attn_out", "blk.0.attn_proj", "blk.0.ffn_norm", "blk.0.ffn_act", "blk.0.gate",
                 "blk.0.gate_silu", "blk.0.up",
                 "blk.0.ffn_out", "blk.1.resid_out", "output_norm", "logits"):
        assert name in covered, name
    # hidden_states[n_layer] is after the final norm: it must land on output_norm
    t = namemaps.translate({f"hidden_states.{i}": dumps[f"hidden_states.{i}"] for i in range(3)}, "hf")
    assert list(t.tensors) == ["embed", "blk.0.resid_out", "output_norm"]
    assert "final norm" in t.notes["output_norm"]


def test_hf_stacked_hidden_states_and_module_prefixes(good):
    stacked = np.stack([good["embed"], good["blk.0.resid_out"], good["output_norm"]])[:, None]
    dumps = {"hidden_states": stacked, "base.model.layers.1.mlp.up_proj": good["blk.1.up"][None]}
    t = namemaps.translate(dumps, "hf", n_layer=2)
    assert set(t.tensors) == {"embed", "blk.0.resid_out", "output_norm", "blk.1.up"}
    assert t.tensors["embed"].shape == good["embed"].shape
    assert t.sources["blk.1.up"] == "base.model.layers.1.mlp.up_proj"


@pytest.mark.parametrize("kv_pad,last_row_only", [(None, False), (256, True)])
def test_llamacpp_round_trip(good, kv_pad, last_row_only):
    dumps = namemaps.to_llamacpp(good, kv_pad=kv_pad, last_row_only=last_row_only)
    names = [n for n, _ in dumps]
    assert names.count("Qcur-0") == 2 and names.count("Vcur-1") == 2
    rep = compare(dumps, good, name_map="llama.cpp")
    assert rep.first_divergence is None, str(rep)
    covered = _covered(rep)
    for name in ("embed", "blk.0.attn_norm", "blk.0.q", "blk.0.q_rope", "blk.0.k_rope", "blk.0.v",
                 "blk.0.attn_scores", "blk.0.attn_probs", "blk.0.attn_out", "blk.0.resid_mid",
                 "blk.0.ffn_act", "blk.1.resid_out", "output_norm", "logits"):
        assert name in covered, name
    if kv_pad:
        assert "padded" in rep["blk.0.attn_probs"].note
    if last_row_only:
        assert "last 1" in rep["logits"].note
    assert rep.sources["blk.0.q_rope"] == "Qcur-0"


def test_llamacpp_dict_tells_rope_by_shape_and_suffix(good):
    q, qr = good["blk.0.q"], good["blk.0.q_rope"]
    t = namemaps.translate({"Qcur-0": qr}, "llama.cpp")                 # 3-D: after RoPE
    assert list(t.tensors) == ["blk.0.q_rope"]
    t = namemaps.translate({"Qcur-0": q.reshape(len(IDS), -1)}, "llama.cpp")
    assert list(t.tensors) == ["blk.0.q"]
    t = namemaps.translate({"Kcur-1#0": good["blk.1.k"].reshape(len(IDS), -1),
                            "Kcur-1#1": good["blk.1.k_rope"]}, "llama.cpp")
    assert list(t.tensors) == ["blk.1.k", "blk.1.k_rope"]


def test_llamacpp_kq_needs_head_dim_or_a_rope_shape(good):
    dumps = dict(namemaps.to_llamacpp(good))      # dict: the rope'd Qcur (the last one) survives
    kq = {"kq-0": dumps["kq-0"]}
    t = namemaps.translate(kq, "llama.cpp")
    assert "kq-0" in t.unknown and "head_dim" in t.notes["kq-0"]
    t = namemaps.translate(kq, "llama.cpp", head_dim=16)
    scores = t.tensors["blk.0.attn_scores"]
    assert compare({"blk.0.attn_scores": scores}, good, names="blk.0.attn_scores").passed
    t = namemaps.translate({"Qcur-0": dumps["Qcur-0"], "kq-0": dumps["kq-0"]}, "llama.cpp")
    assert "blk.0.attn_scores" in t.tensors


def test_a_fault_seen_through_llamacpp_names(ref, good):
    bad = reference.forward(ref, IDS, faults=("rope_base_1e4",))
    rep = compare(namemaps.to_llamacpp(bad), good, name_map="llama.cpp")
    assert rep.first_divergence == "blk.0.q_rope"
    assert "[Qcur-0]" in rep.summary()


def test_from_ggml_reverses_ne():
    data = np.arange(2 * 3 * 4, dtype=np.float32)
    a = namemaps.from_ggml(data.tobytes(), [4, 3, 2, 1])
    assert a.shape == (2, 3, 4) and a[1, 2, 3] == data[1 * 12 + 2 * 4 + 3]
    with pytest.raises(ValueError):
        namemaps.from_ggml(data, [5, 5])


def test_custom_dict_map_with_layer_placeholder(good):
    dumps = {f"layer{L}/attn/q": good[f"blk.{L}.q"] for L in range(2)}
    dumps["final/logits"] = good.logits
    dumps["mystery"] = np.zeros(3)
    t = namemaps.translate(dumps, {"layer{L}/attn/q": "blk.{L}.q", "final/logits": "logits"})
    assert list(t.tensors) == ["blk.0.q", "blk.1.q", "logits", "mystery"]
    assert t.unknown == ["mystery"]
    rep = compare(dumps, good, name_map=({"layer{L}/attn/q": "blk.{L}.q", "final/logits": "logits"}, None))
    assert rep.first_divergence is None and rep.names()[-1] == "mystery"


def test_duplicate_targets_keep_the_first_and_say_so(good):
    t = namemaps.translate([("model.layers.0.self_attn.o_proj", good["blk.0.attn_proj"][None]),
                            ("model.layers.0.self_attn", good["blk.0.attn_proj"][None])], "hf")
    assert t.sources["blk.0.attn_proj"] == "model.layers.0.self_attn.o_proj"
    assert "model.layers.0.self_attn" in t.unknown


def test_unknown_map_names_are_errors():
    with pytest.raises(ValueError, match="hf, llama.cpp"):
        namemaps.resolve("vllm")
    with pytest.raises(TypeError):
        namemaps.resolve(3)
    assert namemaps.resolve("HuggingFace") == "hf" and namemaps.resolve("ggml") == "llama.cpp"


def test_mapping_table_names_every_capture():
    rows = namemaps.mapping_table()
    ours = [r[0] for r in rows]
    assert ours[0] == "embed" and "blk.L.q_rope" in ours and ours[-1] == "argmax"
    row = dict((r[0], r) for r in rows)
    assert row["blk.L.attn_probs"][1] == "attentions[L]"
    assert row["blk.L.attn_probs"][2] == "kq_soft_max-L"
    assert row["blk.L.q_rope"][2].startswith("Qcur-L")
