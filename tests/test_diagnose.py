"""qwencuda.diagnose names the known fault behind a set of dumps: every fault of
reference.FAULTS on a tiny model (as Traces, with rounding noise, through llama.cpp names, as
partial dumps), "no known fault" for correct and for unrelated wrong dumps, and a few faults on
the real model."""
import json

import numpy as np
import pytest

import qwencuda
from qwencuda import namemaps, reference
from qwencuda.debug.diagnose import EXPLANATIONS, FIXES, Diagnosis, diagnose, variant
from qwencuda.testing import write_model

IDS = [3, 17, 42, 99, 7, 250, 11, 64]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("diag") / "tiny.gguf"), config="tiny", seed=0)


@pytest.fixture(scope="module")
def ref(path):
    return reference.load(path)


def _noisy(trace, scale=2e-6, seed=0):
    """The same tensors as another engine would round them: tiny relative noise (well inside
    compare's default tolerance)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in trace.tensors.items():
        a = np.asarray(a)
        if a.dtype.kind == "f":
            finite = np.isfinite(a)
            noise = rng.standard_normal(a.shape).astype(np.float32) * scale * np.abs(np.where(finite, a, 0))
            a = np.where(finite, a + noise, a).astype(np.float32)
        out[name] = a
    return out


def test_every_fault_has_an_explanation_and_a_fix():
    for fault in reference.FAULTS:
        assert EXPLANATIONS.get(fault) and FIXES.get(fault), fault


@pytest.mark.parametrize("fault", sorted(reference.FAULTS))
def test_each_fault_is_named(ref, fault):
    dumps = _noisy(reference.forward(ref, IDS, faults=(fault,)))
    d = diagnose(dumps, ref, IDS)
    assert d.fault == fault, str(d)
    assert d.divergence == reference.FIRST_AFFECTED[fault]
    assert d.sentence.startswith(f"your {d.divergence} match")
    assert EXPLANATIONS[fault] in d.sentence and FIXES[fault] in d.sentence
    assert set(d.scores) == set(reference.FAULTS)
    assert d.variants[0].fault == fault and d.variants[0].score >= 0.9
    assert d.scores[fault] == max(d.scores.values())


def test_the_spec_sentence_for_interleaved_rope(ref):
    d = diagnose(reference.forward(ref, IDS, faults=("rope_interleaved",)), ref, IDS)
    assert d.sentence == ("your blk.0.q_rope matches interleaved RoPE pairs (GPT-J style); Qwen2 "
                          "uses NEOX halves: pair i with i + head_dim/2")


@pytest.mark.parametrize("fault", ["no_qkv_bias", "kv_pos_stuck", "gqa_wrong_mapping", "lm_head_wrong_ld"])
def test_faults_through_llamacpp_dumps(path, ref, fault):
    dumps = namemaps.to_llamacpp(reference.forward(ref, IDS, faults=(fault,)), kv_pad=256,
                                 last_row_only=fault != "kv_pos_stuck")
    d = qwencuda.diagnose(dumps, path, IDS, name_map="llama.cpp")
    assert d.fault == fault, str(d)
    assert d.divergence == reference.FIRST_AFFECTED[fault]


def test_partial_dumps_logits_only(ref):
    bad = reference.forward(ref, IDS, faults=("lm_head_wrong_ld",))
    d = diagnose({"logits": bad.logits[-1:]}, ref, IDS)
    assert d.fault == "lm_head_wrong_ld" and d.divergence == "logits"


def test_unwritten_logits_with_other_garbage(ref):
    """A real engine's stale memory is not the reference's: the tail is judged by whether it beats
    the written logits, the written part against the correct run."""
    good = reference.forward(ref, IDS)
    lg = good.logits.copy()
    rng = np.random.default_rng(7)
    lg[:, ref.n_written:] = lg.max() + rng.uniform(5, 9, (lg.shape[0], lg.shape[1] - ref.n_written))
    d = diagnose({"output_norm": good["output_norm"], "logits": lg, "argmax": lg.argmax(1)}, ref, IDS)
    assert d.fault == "argmax_unwritten", str(d)


def test_correct_dumps_have_no_fault(ref):
    d = diagnose(_noisy(reference.forward(ref, IDS)), ref, IDS)
    assert d.fault is None and d.divergence is None and "no divergence" in d.sentence


def test_an_unknown_mistake_is_not_forced_onto_a_known_fault(ref):
    dumps = dict(reference.forward(ref, IDS).tensors)
    dumps["blk.0.v"] = dumps["blk.0.v"][:, ::-1, :].copy()            # KV heads swapped: no fault does that
    d = diagnose(dumps, ref, IDS)
    assert d.fault is None and d.divergence == "blk.0.v"
    assert d.sentence.startswith("no known fault matches") and "blk.0.v" in d.sentence


def test_precision_noise_is_called_noise(ref):
    d = diagnose(_noisy(reference.forward(ref, IDS), scale=3e-3), ref, IDS)
    assert d.fault is None and "precision" in d.sentence


def test_trace_input_brings_its_ids_and_the_diagnosis_is_plain_data(ref):
    bad = reference.forward(ref, IDS, faults=("rmsnorm_no_mean",))
    d = diagnose(bad, ref)
    assert isinstance(d, Diagnosis) and d.fault == "rmsnorm_no_mean" and d.matched
    json.dumps(d.to_dict())
    text = str(d)
    assert "(correct engine)" in text and "rmsnorm_no_mean" in text
    assert d.report.first_divergence == "blk.0.attn_norm"


def test_foreign_names_without_a_map_say_so(ref):
    dumps = namemaps.to_llamacpp(reference.forward(ref, IDS, faults=("no_qkv_bias",)))
    d = diagnose(dumps, ref, IDS)
    assert d.fault is None and "name_map" in d.sentence


def test_bad_arguments(ref):
    with pytest.raises(ValueError, match="token ids"):
        diagnose({"embed": np.zeros((2, 64))}, ref)
    with pytest.raises(ValueError, match="unknown fault"):
        diagnose({"embed": np.zeros((2, 64))}, ref, IDS, faults=["cosmic_rays"])


def test_variant_runs_are_reused(ref):
    a = variant(ref, IDS, "no_qkv_bias")
    assert variant(ref, IDS, "no_qkv_bias") is a
    assert variant(ref, IDS) is not a


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_model_faults(real_model_path):
    """Three faults on Qwen2.5-Coder-0.5B: the dumps come through llama.cpp's names for one of
    them. Only these three variants are tried, to keep the run short."""
    ref = reference._model(real_model_path)
    ids = [40, 1079, 264, 6514, 911]
    faults = ["rope_interleaved", "no_qkv_bias", "lm_head_wrong_ld"]
    for fault in faults:
        bad = variant(ref, ids, fault)
        dumps = namemaps.to_llamacpp(bad) if fault == "no_qkv_bias" else _noisy(bad)
        d = diagnose(dumps, ref, ids, name_map="llama.cpp" if fault == "no_qkv_bias" else None,
                     faults=faults)
        assert d.fault == fault, str(d)
        assert d.divergence == reference.FIRST_AFFECTED[fault]


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_model_bf16_dumps(real_model_path):
    """A bf16-rounded dump of one fault on Qwen2.5-Coder-0.5B: named at the default settings and
    localised by substitution (three variants tried, to keep the run short)."""
    from qwencuda.debug.diagnose import round_to

    ref = reference._model(real_model_path)
    ids = [40, 1079, 264, 6514, 911]
    bad = variant(ref, ids, "rope_interleaved")
    dumps = {n: round_to(v, "bf16") if v.dtype.kind == "f" else v for n, v in bad.tensors.items()}
    d = diagnose(dumps, ref, ids, faults=["rope_interleaved", "rope_base_1e4", "no_qkv_bias"], localise=True)
    assert d.precision == "bf16" and d.fault == "rope_interleaved", str(d)
    assert d.divergence == "blk.0.q_rope" and d.localisation.bad == "blk.0.q_rope"
