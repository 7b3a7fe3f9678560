"""qwencuda.lens: the logit lens (its last layer is the trace's logits), lm_head projections and
the argmax report (runner-up, gap, an argmax buffer that disagrees with the logits)."""
import numpy as np
import pytest

import qwencuda
from qwencuda import lens, reference
from qwencuda.testing import write_model

IDS = [3, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("lens") / "tiny.gguf"), config="tiny-oddvocab", seed=4)


@pytest.fixture(scope="module")
def ref(path):
    return reference.load(path)


@pytest.fixture(scope="module")
def trace(ref):
    return reference.forward(ref, IDS)


def test_last_layer_of_the_lens_is_the_logits(ref, trace):
    res = qwencuda.logit_lens(ref, trace, k=4)
    assert res.layers == ["embed", "blk.0.resid_out", "blk.1.resid_out", "blk.2.resid_out"]
    assert res.top_ids.shape == (4, len(IDS), 4) and res.top_probs.shape == (4, len(IDS), 4)
    expected = np.argsort(-trace.logits, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(res.top_ids[-1], expected)
    np.testing.assert_allclose(res.top_logits[-1], np.take_along_axis(trace.logits, expected, 1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res.target, trace.argmax)
    assert np.all(res.target_rank[-1] == 0)
    assert np.all((res.formed_at >= 0) & (res.formed_at < 4))
    assert np.all(np.diff(res.top_probs, axis=-1) <= 1e-7)          # sorted best first
    assert np.all(res.target_prob <= 1.0)


def test_project(ref, trace):
    np.testing.assert_allclose(lens.project(ref, trace["output_norm"]), trace.logits, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(lens.project(ref, trace["blk.2.resid_out"], norm=True), trace.logits,
                               rtol=1e-4, atol=1e-4)
    one = lens.project(ref, trace["output_norm"][2])
    assert one.shape == (ref.config.n_vocab,)
    with pytest.raises(ValueError, match="dim"):
        lens.project(ref, np.zeros((2, 5)))


def test_lens_from_a_path_with_a_tokenizer_and_a_target(path, trace):
    tokenizers = pytest.importorskip("tokenizers")
    del tokenizers
    from qwencuda.testing import hf_tokenizer

    tok = hf_tokenizer(path)
    res = qwencuda.logit_lens(path, trace, k=2, tokenizer=tok, target=np.zeros(len(IDS), int),
                              include_mid=True)
    assert res.layers[1] == "blk.0.resid_mid" and len(res.layers) == 7
    assert np.all(res.target == 0)
    words = res.tokens("blk.1.resid_out")
    assert len(words) == len(IDS) and len(words[0]) == 2 and all(isinstance(w, str) for w in words[0])
    text = str(res)
    assert "formed at" in text and "blk.2.resid_out" in text


def test_lens_of_a_model_object_and_errors(path, trace):
    class ModelLike:          # anything with .path, like qwencuda.Model
        pass

    m = ModelLike()
    m.path = path
    assert qwencuda.logit_lens(m, {"embed": trace["embed"]}, k=1).layers == ["embed"]
    with pytest.raises(ValueError, match="residual"):
        qwencuda.logit_lens(path, {"blk.0.q": trace["blk.0.q"]})
    with pytest.raises(ValueError, match="target"):
        qwencuda.logit_lens(path, trace, target=[1, 2])


def test_choices_runner_up_and_gap():
    lg = np.array([[0.0, 5.0, 4.5, -1.0],
                   [3.0, 3.0, 1.0, np.nan],          # a tie: the first maximum wins; NaN never
                   [np.nan, 0.1, 0.2, 0.0]], np.float32)
    ch = lens.choices(lg)
    np.testing.assert_array_equal(ch.token, [1, 0, 2])
    np.testing.assert_array_equal(ch.runner_up, [2, 1, 1])
    np.testing.assert_allclose(ch.gap, [0.5, 0.0, 0.1], atol=1e-6)
    text = str(ch)
    assert "near-tie" in text and text.count("\n") == 3
    assert lens.choices(lg[0]).token.tolist() == [1]
    with pytest.raises(ValueError):
        lens.choices(np.zeros((2, 1)))


def test_argmax_report_flags_an_argmax_that_is_not_the_maximum(ref):
    tr = reference.forward(ref, IDS, faults=("argmax_unwritten",))
    rep = lens.argmax_report(tr)
    assert np.all(rep.token >= ref.n_written)          # the stale tail wins, as in the seeds
    assert not rep.disagree.any()
    tr.argmax[:] = 7                                   # an argmax kernel that reads the wrong buffer
    rep = lens.argmax_report(tr)
    assert rep.disagree.all() and "not the logits' maximum" in str(rep)
    np.testing.assert_array_equal(rep.positions, tr.logit_positions)
