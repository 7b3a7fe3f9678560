"""diagnose on half-precision dumps (issue 15 item 3) and causal localisation by substituting the
user's tensors into the correct run (item 2), on the tiny synthetic model.

Dumps of a broken engine are the faulty reference's tensors, made half precision two ways:
  "rounded":   every tensor computed in float32, then rounded to fp16 / bf16 for the dump;
  "computed":  every tensor rounded to fp16 / bf16 as it is computed, and the rest of the pass
               computed from the rounded value (reference patch=), like an engine that stores its
               activations in half precision.
Unknown bugs (GELU for SiLU, a missing residual) are made with reference patches too."""
import numpy as np
import pytest

from qwencuda import namemaps, reference
from qwencuda.debug.diagnose import detect_precision, diagnose, localise, round_to
from qwencuda.patching import Scale
from qwencuda.testing import write_model

IDS = [3, 17, 42, 99, 7, 250, 11, 64]
HALF = ["fp16", "bf16"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference.load(write_model(str(tmp_path_factory.mktemp("prec") / "tiny.gguf"),
                                      config="tiny", seed=0))


def _half(ref, fmt, how, faults=(), patch=None):
    """A faulty reference's dumps in fmt, made `how` ("rounded" or "computed")."""
    patch = dict(patch or {})
    if how == "computed":
        rnd = {n: (lambda v: round_to(v, fmt)) for n in ref.capture_names() if n != "argmax"}
        for n, f in patch.items():          # the bug's own edit first, then the rounding
            rnd[n] = [f, rnd[n]]
        patch = rnd
    tr = reference.forward(ref, IDS, faults=faults, patch=patch or None)
    return {n: round_to(v, fmt) if v.dtype.kind == "f" else v for n, v in tr.tensors.items()}


def _gelu_for_silu(ref):
    """A patch that computes ffn_act = gelu(gate) * up in every layer (tanh GELU)."""
    patch = {}
    for L in range(ref.config.n_layer):
        seen = {}
        patch[f"blk.{L}.gate"] = (lambda seen: lambda v: seen.__setitem__("gate", v))(seen)
        patch[f"blk.{L}.up"] = (lambda seen: lambda v: seen.__setitem__("up", v))(seen)

        def act(v, seen=seen):
            g = seen["gate"].astype(np.float64)
            gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            return (gelu * seen["up"]).astype(np.float32)
        patch[f"blk.{L}.ffn_act"] = act
    return patch


def _no_residual(ref, layer=0):
    """A patch that drops the residual of the attention in one layer: resid_mid = attn_proj."""
    seen = {}
    return {f"blk.{layer}.attn_proj": lambda v: seen.__setitem__("proj", v),
            f"blk.{layer}.resid_mid": lambda v: seen["proj"]}


# --------------------------------------------------------------------------------------------
# the precision of a dump

def test_detect_precision(ref):
    tr = reference.forward(ref, IDS)
    assert detect_precision(tr.tensors) == "fp32"
    for fmt in HALF:
        assert detect_precision({n: round_to(v, fmt) for n, v in tr.tensors.items()}) == fmt
    one = dict(tr.tensors, **{"blk.1.v": round_to(tr["blk.1.v"], "bf16")})
    assert detect_precision(one) == "bf16"                      # the coarsest tensor wins
    assert detect_precision({"blk.0.attn_probs": np.ones((4, 8, 1), np.float32)}) == "fp32"
    assert detect_precision({"embed": tr["embed"].astype(np.float16)}) == "fp16"


def test_round_to_is_round_to_nearest():
    x = np.array([1.0, 1 + 2 ** -9, 1 + 3 * 2 ** -9, -np.inf, 70000.0], np.float32)
    assert round_to(x, "bf16").tolist()[:4] == [1.0, 1.0, 1 + 2 ** -7, -np.inf]
    assert round_to(x, "fp16")[4] == np.inf and round_to(x, "fp32").tolist()[:3] == x.tolist()[:3]
    with pytest.raises(ValueError, match="precision"):
        round_to(x, "fp8")


# --------------------------------------------------------------------------------------------
# item 3: every fault named at the default settings from half-precision dumps

@pytest.mark.parametrize("how", ["rounded", "computed"])
@pytest.mark.parametrize("fmt", HALF)
@pytest.mark.parametrize("fault", sorted(reference.FAULTS))
def test_each_fault_is_named_from_half_precision_dumps(ref, fault, fmt, how):
    d = diagnose(_half(ref, fmt, how, faults=(fault,)), ref, IDS, localise=False)
    assert d.precision == fmt
    assert d.fault == fault, str(d)
    assert d.divergence == reference.FIRST_AFFECTED[fault]
    assert d.sentence.startswith(f"your {d.divergence} match")
    assert d.variants[0].fault == fault


@pytest.mark.parametrize("fault", sorted(reference.FAULTS))
def test_bf16_dumps_through_llamacpp_names(ref, fault):
    """llama.cpp's names and layout: raw kq with 256 padded key cells, the last layer's output
    rows only (all rows for kv_pos_stuck, which shows from the second token on)."""
    tr = reference.forward(ref, IDS, faults=(fault,))
    rounded = {n: round_to(v, "bf16") if v.dtype.kind == "f" else v for n, v in tr.tensors.items()}
    dumps = namemaps.to_llamacpp(rounded, kv_pad=256, last_row_only=fault != "kv_pos_stuck")
    d = diagnose(dumps, ref, IDS, name_map="llama.cpp", localise=True)
    assert d.precision == "bf16" and d.fault == fault, str(d)
    assert d.divergence == d.localisation.bad == reference.FIRST_AFFECTED[fault]


@pytest.mark.parametrize("how", ["rounded", "computed"])
@pytest.mark.parametrize("fmt", HALF)
def test_correct_half_precision_dumps_have_no_divergence(ref, fmt, how):
    d = diagnose(_half(ref, fmt, how), ref, IDS)
    assert d.fault is None and d.divergence is None, str(d)
    assert "no divergence" in d.sentence and fmt in d.sentence
    if fmt == "bf16" or how == "computed":   # these leave the correct run at float32 tolerances
        assert d.report.first_divergence is not None


def _bug(ref, bug):
    if bug == "gelu":
        return _gelu_for_silu(ref)
    if bug == "no_residual":
        return _no_residual(ref)
    return {"blk.0.ffn_act": Scale(1.03)}          # a constant 3 % off: the smallest of the three


@pytest.mark.parametrize("fmt", ["fp32"] + HALF)
@pytest.mark.parametrize("bug, where, size", [("gelu", "blk.0.ffn_act", (0.05, 0.3)),
                                              ("no_residual", "blk.0.resid_mid", (0.01, 0.05)),
                                              ("three_percent", "blk.0.ffn_act", (0.029, 0.031))])
def test_unknown_bugs_of_a_few_percent_are_not_called_precision(ref, fmt, bug, where, size):
    exact = reference.forward(ref, IDS, patch=_bug(ref, bug))
    good = reference.forward(ref, IDS)
    rel = np.linalg.norm(exact[where] - good[where]) / np.linalg.norm(good[where])
    assert size[0] < rel < size[1], rel
    dumps = dict(exact.tensors) if fmt == "fp32" else _half(ref, fmt, "computed", patch=_bug(ref, bug))
    d = diagnose(dumps, ref, IDS)
    assert d.fault is None and d.divergence == where, str(d)
    assert d.sentence.startswith("no known fault matches") and "precision" not in d.sentence
    assert d.localisation is not None and d.localisation.bad == where
    assert d.localisation.sentence in str(d)


def test_float32_noise_within_bf16_rounding_is_still_called_precision(ref):
    rng = np.random.default_rng(0)
    tr = reference.forward(ref, IDS)
    dumps = {n: (v * (1 + 1e-3 * rng.standard_normal(v.shape))).astype(np.float32) if v.dtype.kind == "f" else v
             for n, v in tr.tensors.items()}
    d = diagnose(dumps, ref, IDS)
    assert d.fault is None and "precision?" in d.sentence and "bf16 rounding" in d.sentence


def test_precision_can_be_given(ref):
    dumps = _half(ref, "fp16", "rounded", faults=("rope_interleaved",))
    d = diagnose(dumps, ref, IDS, precision="bf16")
    assert d.precision == "bf16" and d.fault == "rope_interleaved"
    with pytest.raises(ValueError, match="precision"):
        diagnose(dumps, ref, IDS, precision="fp8")


# --------------------------------------------------------------------------------------------
# item 2: causal localisation

def _dumps(ref, fault, fmt, how):
    if fmt == "fp32":
        return dict(reference.forward(ref, IDS, faults=(fault,)).tensors)
    return _half(ref, fmt, how, faults=(fault,))


@pytest.mark.parametrize("fmt, how", [("fp32", None), ("fp16", "rounded"), ("fp16", "computed"),
                                      ("bf16", "rounded"), ("bf16", "computed")])
@pytest.mark.parametrize("fault", sorted(reference.FAULTS))
def test_substitution_finds_the_first_affected_tensor(ref, fault, fmt, how):
    loc = localise(_dumps(ref, fault, fmt, how), ref, IDS)
    first = reference.FIRST_AFFECTED[fault]
    assert loc.bad == first, str(loc)
    names = [n for n in ref.capture_names() if n != "argmax"]
    assert loc.good == names[names.index(first) - 1]
    assert loc.sentence.startswith(f"your engine goes wrong between {loc.good} and {first}")
    rel, tol, _ = loc.probes[first]
    assert rel > tol


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_a_correct_engine_changes_nothing(ref, fmt):
    tr = reference.forward(ref, IDS)
    dumps = {n: round_to(v, fmt) if v.dtype.kind == "f" else v for n, v in tr.tensors.items()}
    loc = localise(dumps, ref, IDS)
    assert loc.bad is None and loc.flagged == [] and "no substitution changes the output" in loc.sentence


def test_partial_dumps_residual_stream_only(ref):
    full = reference.forward(ref, IDS, faults=("no_qkv_bias",))
    keep = ["embed", "blk.0.resid_out", "blk.1.resid_out", "logits"]
    loc = localise({n: full[n] for n in keep}, ref, IDS)
    assert (loc.good, loc.bad) == ("embed", "blk.0.resid_out") and loc.candidates == keep


def test_partial_dumps_one_layer_and_fewer_rows(ref):
    bad = reference.forward(ref, IDS, faults=("rope_interleaved",))
    loc = localise({n: bad[n] for n in bad.tensors if n.startswith("blk.1.")}, ref, IDS)
    assert loc.good is None and loc.bad == "blk.1.attn_norm"       # layer 0's rope reaches it
    assert loc.sentence.startswith("your engine goes wrong before blk.1.attn_norm")
    lm = reference.forward(ref, IDS, faults=("lm_head_wrong_ld",))
    loc = localise({"output_norm": lm["output_norm"], "logits": lm.logits[-1:]}, ref, IDS)
    assert (loc.good, loc.bad) == ("output_norm", "logits")


@pytest.mark.parametrize("fault", ["no_qkv_bias", "rope_interleaved", "gqa_wrong_mapping"])
def test_localise_through_llamacpp_names(ref, fault):
    dumps = namemaps.to_llamacpp(reference.forward(ref, IDS, faults=(fault,)), kv_pad=256,
                                 last_row_only=True)
    loc = localise(dumps, ref, IDS, name_map="llama.cpp")
    assert loc.bad == reference.FIRST_AFFECTED[fault], str(loc)


def test_diagnose_attaches_the_localisation_when_asked(ref):
    dumps = _half(ref, "bf16", "computed", faults=("rope_base_1e4",))
    d = diagnose(dumps, ref, IDS)
    assert d.fault == "rope_base_1e4" and d.localisation is None
    d = diagnose(dumps, ref, IDS, localise=True)
    assert d.localisation.bad == "blk.0.q_rope" and "goes wrong between" in str(d)
    assert d.to_dict()["localisation"]["bad"] == "blk.0.q_rope"
