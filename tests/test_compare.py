"""qwencuda.compare: alignment in forward order, the per-tensor numbers, the first divergence of
every known fault, per-tensor bad inputs, readers, the report's forms and the command line."""
import json

import numpy as np
import pytest

import qwencuda
from qwencuda import reference
from qwencuda.debug.compare import (CompareError, CompareReport, assert_matches, compare, compare_arrays,
                              forward_order, main)
from qwencuda.testing import write_model
from qwencuda.trace import Trace

IDS = [3, 17, 42, 99, 7, 250, 11, 64]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    path = write_model(str(tmp_path_factory.mktemp("cmp") / "tiny.gguf"), config="tiny", seed=0)
    return reference.load(path)


@pytest.fixture(scope="module")
def good(ref):
    return reference.forward(ref, IDS)


# --------------------------------------------------------------------------------------------
# Every known fault: the first divergence is the fault's first affected tensor

@pytest.mark.parametrize("fault", sorted(reference.FAULTS))
def test_each_fault_diverges_first_at_its_first_affected_tensor(ref, good, fault):
    bad = reference.forward(ref, IDS, faults=(fault,))
    rep = compare(bad, good)
    assert rep.first_divergence == reference.FIRST_AFFECTED[fault]
    names = rep.names()
    first = names.index(rep.first_divergence)
    assert all(r.passed for r in rep.rows[:first])          # everything before it is right
    assert rep.first_divergence in str(rep)


# The forward order of DESIGN.md, written out here: an expectation independent of the code.
DESIGN_ORDER = ["embed"] + [f"blk.{L}.{n}" for L in range(2) for n in (
    "attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_scores", "attn_probs", "attn_out",
    "attn_proj", "resid_mid", "ffn_norm", "gate", "up", "ffn_act", "ffn_out", "resid_out")] + [
    "output_norm", "logits", "argmax"]


def test_two_engines_that_agree_match_everywhere(ref, good):
    """The C CPU engine's trace against the reference's (two implementations, same file): no
    divergence, every row's numbers are the ones computed here by hand."""
    with qwencuda.Model(ref.path, device="cpu") as m:
        engine = m.forward(IDS, capture="*")
    rep = compare(engine, good)
    assert rep.first_divergence is None and rep.passed
    assert [r.name for r in rep.rows] == DESIGN_ORDER
    for r in rep.rows:
        assert r.status == "ok", r
        if r.name == "argmax":
            continue
        a, b = engine[r.name].astype(np.float64), good[r.name].astype(np.float64)
        fin = np.isfinite(a) & np.isfinite(b)          # attn_scores' masked -inf on both sides
        d = a[fin] - b[fin]
        assert r.max_abs == pytest.approx(float(np.abs(d).max()), rel=1e-6, abs=1e-12)
        assert r.rel == pytest.approx(float(np.linalg.norm(d) / np.linalg.norm(b[fin])), rel=1e-3, abs=1e-12)
    assert any(r.max_abs > 0 for r in rep.rows if r.name != "argmax")   # not the same arrays
    assert "no divergence" in str(rep)


def test_qwencuda_compare_is_callable_in_any_import_order(ref, good):
    import qwencuda.debug.compare  # noqa: F401  (qwencuda.compare is this module, callable)

    bad = reference.forward(ref, IDS, faults=("no_qkv_bias",))
    assert qwencuda.compare(bad, good).first_divergence == "blk.0.q"
    assert qwencuda.compare.compare(bad, good).first_divergence == "blk.0.q"


# --------------------------------------------------------------------------------------------
# Order, alignment, numbers

def test_forward_order_puts_unknown_names_last_in_their_own_order():
    names = ["zeta", "logits", "blk.1.q", "alpha", "blk.0.resid_out", "embed", "blk.0.gate_silu",
             "blk.0.gate", "blk.10.q", "blk.2.q"]
    assert forward_order(names) == ["embed", "blk.0.gate", "blk.0.gate_silu", "blk.0.resid_out",
                                    "blk.1.q", "blk.2.q", "blk.10.q", "logits", "zeta", "alpha"]


def test_tolerance_rule_is_elementwise_atol_plus_rtol_b():
    b = np.array([1.0, 100.0, -2.0, 0.0], np.float64)
    limit = 1e-4 + 1e-3 * np.abs(b)
    r = compare_arrays("x", b + 0.999 * limit, b)
    assert r.passed and r.n_fail == 0
    a = b.copy()
    a[1] += 1.01 * limit[1]
    r = compare_arrays("x", a, b)
    assert r.status == "diverged" and r.n_fail == 1 and r.frac_fail == pytest.approx(0.25)
    assert r.max_abs == pytest.approx(1.01 * limit[1])
    assert r.worst[0][0] == (1,)


def test_relative_error_and_cosine():
    rng = np.random.default_rng(0)
    b = rng.standard_normal((5, 7)).astype(np.float32)
    a = b + 0.1 * rng.standard_normal((5, 7)).astype(np.float32)
    r = compare_arrays("x", a, b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert r.rel == pytest.approx(np.linalg.norm(a64 - b64) / np.linalg.norm(b64))
    assert r.cosine == pytest.approx(np.vdot(a64, b64) / np.linalg.norm(a64) / np.linalg.norm(b64))
    assert r.max_abs == pytest.approx(np.abs(a64 - b64).max())


# --------------------------------------------------------------------------------------------
# Bad inputs: one row each, never an exception for the whole report

def test_missing_on_one_side_is_recorded_not_a_divergence(good):
    mine = {k: v for k, v in good.tensors.items() if k not in ("blk.0.q", "logits")}
    mine["extra_thing"] = np.zeros(3)
    rep = compare(mine, good)
    assert rep["blk.0.q"].status == "missing in a"
    assert rep["extra_thing"].status == "missing in b"
    assert rep.names()[-1] == "extra_thing"
    assert rep.first_divergence is None
    assert "present on one side only" in rep.summary()


def test_nothing_in_common_says_so(good):
    rep = compare({"Qcur-0": good["blk.0.q"]}, good)
    assert rep.first_divergence is None and "nothing compared" in rep.summary()
    assert "name_map" in rep.summary()


def test_shape_mismatch_is_a_divergence_of_that_tensor():
    rep = compare({"embed": np.zeros((4, 8)), "blk.0.q": np.zeros((3, 5))},
                  {"embed": np.zeros((4, 8)), "blk.0.q": np.zeros((4, 7))})
    r = rep["blk.0.q"]
    assert r.status == "shape" and "(3, 5)" in r.note and "(4, 7)" in r.note
    assert rep.first_divergence == "blk.0.q" and rep["embed"].passed


def test_nan_and_inf_are_counted():
    b = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = b.copy()
    a[0, 1] = np.nan
    a[1, 2] = np.inf
    r = compare_arrays("x", a, b)
    assert r.status == "diverged" and r.nan_a == 1 and r.inf_a == 1 and r.n_fail == 2
    assert "NaN/inf" in r.note
    assert np.isfinite(r.max_abs) and r.max_abs == 0.0     # the finite elements agree
    both = compare_arrays("x", a, a.copy())
    assert both.passed and both.nan_a == both.nan_b == 1  # NaN where the other side has NaN


def test_equal_infinities_are_equal_and_masked_scores_compare():
    b = np.array([[[0.5, -np.inf], [0.1, 0.2]]], np.float32)         # (heads, q, k), causal
    assert compare_arrays("blk.0.attn_scores", b.copy(), b).passed
    a = b.copy()
    a[0, 0, 1] = -1e9                                                # a finite mask value
    r = compare_arrays("blk.0.attn_scores", a, b)
    assert r.passed and "finite mask" in r.note
    a[0, 0, 1] = np.inf
    assert compare_arrays("blk.0.attn_scores", a, b).status == "diverged"


def test_ints_against_floats_is_a_dtype_row():
    r = compare_arrays("blk.0.q", np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32))
    assert r.status == "dtype" and "integers against floats" in r.note
    r = compare_arrays("argmax", np.array([3.0, 7.0]), np.array([3, 7], np.int32))
    assert r.passed and "as floats" in r.note
    r = compare_arrays("argmax", np.array([3, 8], np.int32), np.array([3, 7], np.int32))
    assert r.status == "diverged" and r.n_fail == 1 and r.worst == [((1,), 3 + 5, 7)]
    r = compare_arrays("x", np.array(["a", "b"]), np.zeros(2))
    assert r.status == "dtype"
    r = compare_arrays("x", object(), np.zeros(2))
    assert r.status == "dtype" and "not numbers" in r.note


def test_transposed_and_reshaped_are_compared_and_noted():
    rng = np.random.default_rng(1)
    b = rng.standard_normal((5, 12)).astype(np.float32)
    r = compare_arrays("embed", b.T.copy(), b)
    assert r.passed and "transpose" in r.note
    q = rng.standard_normal((5, 4, 3)).astype(np.float32)
    r = compare_arrays("blk.0.q", q.reshape(5, 12), q)                # flat heads
    assert r.passed and "reshaped" in r.note
    r = compare_arrays("logits", q.reshape(5, 12)[None], q.reshape(5, 12))   # a batch axis
    assert r.passed and "leading axis" in r.note
    r = compare_arrays("logits", b[-1:], b)                            # logits="last"
    assert r.passed and "last 1" in r.note


def test_padded_key_columns_are_cropped_only_when_masked():
    rng = np.random.default_rng(2)
    probs = rng.random((2, 3, 3)).astype(np.float32)
    padded = np.concatenate([probs, np.zeros((2, 3, 5), np.float32)], -1)
    r = compare_arrays("blk.0.attn_probs", padded, probs)
    assert r.passed and "padded" in r.note
    # kv_pos_stuck: one key column against a full causal map is a shape error, not a crop
    r = compare_arrays("blk.0.attn_probs", probs[..., :1], probs)
    assert r.status == "shape" and "not masked" in r.note


def test_failing_rows_carry_hints():
    rng = np.random.default_rng(3)
    m = rng.standard_normal((4, 6, 6)).astype(np.float32)
    assert "transpose" in compare_arrays("x", np.swapaxes(m, 1, 2), m).note
    assert "constant factor" in compare_arrays("x", 0.125 * m, m).note
    assert "all zeros" in compare_arrays("x", np.zeros_like(m), m).note
    a = m.copy()
    a[1:] += 1.0
    assert "rows (tokens) 0 match" in compare_arrays("blk.0.q_rope", a, m).note


# --------------------------------------------------------------------------------------------
# Readers and errors

def test_npz_and_folder_inputs(good, tmp_path):
    npz = good.save(str(tmp_path / "run.npz"))
    rep = compare(npz, good)
    assert rep.first_divergence is None and "logits" in rep and "argmax" in rep
    folder = tmp_path / "dumps"
    folder.mkdir()
    for name, arr in good.tensors.items():
        np.save(folder / f"{name}.npy", arr)
    rep = compare(str(folder), npz)
    assert rep.first_divergence is None and len(rep.compared) == len(good.tensors)
    plain = tmp_path / "plain.npz"
    np.savez(plain, **{"blk.0.q": good["blk.0.q"] * 2})
    assert compare(str(plain), good).first_divergence == "blk.0.q"


def test_unreadable_inputs_raise_clear_errors(good, tmp_path):
    with pytest.raises(CompareError, match="no such file"):
        compare(str(tmp_path / "nope.npz"), good)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not numpy")
    with pytest.raises(CompareError, match="cannot read"):
        compare(str(junk), good)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CompareError, match="without .npy"):
        compare(str(tmp_path / "empty"), good)
    with pytest.raises(CompareError):
        compare(42, good)
    with pytest.raises(ValueError, match="unknown name map"):
        compare(good, good, name_map="pytorch-lightning")


# --------------------------------------------------------------------------------------------
# The report's forms

def test_report_is_plain_data(ref, good):
    bad = reference.forward(ref, IDS, faults=("no_qkv_bias",))
    rep = compare(bad, good, names="blk.0.*")
    assert isinstance(rep, CompareReport)
    assert all(n.startswith("blk.0.") for n in rep.names())
    d = rep.to_dict()
    assert d["first_divergence"] == "blk.0.q" and d["rows"][0]["name"] == "blk.0.attn_norm"
    json.dumps(d)
    text = str(rep)
    assert "first divergence: blk.0.q" in text and "DIVERGED" in text
    assert repr(rep).startswith("<CompareReport")


def test_assert_matches_passes_and_fails_with_the_report(good):
    assert_matches(good["blk.0.q"], "blk.0.q", good)
    assert_matches(good["blk.0.q"].reshape(len(IDS), -1), "blk.0.q", good)   # flat heads are fine
    with pytest.raises(AssertionError) as exc:
        assert_matches(good["blk.1.up"] * 1.01, "blk.1.up", good)
    msg = str(exc.value)
    assert "blk.1.up does not match" in msg and "rel err" in msg and "largest errors" in msg
    with pytest.raises(AssertionError, match="not captured"):
        assert_matches(good["blk.0.q"], "blk.9.q", good)
    assert_matches({"blk.0.k": good["blk.0.k"], "embed": good["embed"]}, None, good)


# --------------------------------------------------------------------------------------------
# Command line

def test_main_exit_codes_and_output(ref, good, tmp_path, capsys):
    a = good.save(str(tmp_path / "good.npz"))
    b = reference.forward(ref, IDS, faults=("rope_interleaved",)).save(str(tmp_path / "bad.npz"))
    assert main([a, a]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert main([b, a, "--rtol", "1e-2", "--atol", "1e-3"]) == 1
    out = capsys.readouterr().out
    assert "first divergence: blk.0.q_rope" in out and "rtol=0.01" in out
    assert main([b, a, "--only-diverged"]) == 1
    assert "blk.0.attn_norm" not in capsys.readouterr().out
    assert main([str(tmp_path / "missing.npz"), a]) == 2
    assert "no such file" in capsys.readouterr().err


def test_python_m_qwencuda_compare_dispatches_here(good, tmp_path, capsys):
    cli = pytest.importorskip("qwencuda.cli")
    a = good.save(str(tmp_path / "good.npz"))
    assert cli.main(["compare", a, a]) == 0
    assert "no divergence" in capsys.readouterr().out


def test_trace_fields_take_part(good):
    tr = Trace(tensors={"embed": good["embed"]}, logits=good.logits, ids=IDS)
    rep = compare(tr, good)
    assert rep["logits"].passed and rep["argmax"].passed and rep.first_divergence is None
