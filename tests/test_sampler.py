"""The sampler (csrc/engine/sampler.c through qwencuda.Sampler / qwencuda.sample): greedy, seeds,
the drawn distribution (a chi-square test over many draws with fixed seeds), exact top-k / top-p /
min-p masks on crafted logits, llama.cpp's order (top-p and min-p at temperature 1), the
repetition penalty, non-finite logits and argument errors."""
import numpy as np
import pytest

import qwencuda as qc

# probabilities 0.5, 0.25, 0.15, 0.1 (temperature 1)
P4 = np.array([0.5, 0.25, 0.15, 0.1])
L4 = np.log(P4).astype(np.float32)


def draws(logits, n=20000, seed=1, **kw):
    sp = qc.Sampler(len(logits), seed=seed, **kw)
    return np.bincount([sp.sample(logits) for _ in range(n)], minlength=len(logits))


def chi2(counts, probs):
    """Pearson's statistic over the cells with probability > 0."""
    probs = np.asarray(probs, dtype=np.float64)
    keep = probs > 0
    exp = counts.sum() * probs[keep]
    return float(((counts[keep] - exp) ** 2 / exp).sum())


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# chi-square critical values at p = 0.001: df 1..9
CRIT = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88]


def test_greedy_is_the_first_argmax():
    logits = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    for seed in range(5):
        assert qc.Sampler(4, temperature=0.0, seed=seed).sample(logits) == 1
        assert qc.sample(logits, temperature=0.0, seed=seed) == 1
    assert qc.sample(np.float64([0.5, 0.25])) == 0           # float64 rows are accepted


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(0)
    sp = qc.Sampler(1000, temperature=1.5, top_k=1, seed=3)
    for _ in range(50):
        row = rng.standard_normal(1000).astype(np.float32)
        assert sp.sample(row) == int(np.argmax(row))


def test_same_seed_same_tokens():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((200, 50)).astype(np.float32)
    a = qc.Sampler(50, temperature=1.0, top_p=0.9, seed=42)
    b = qc.Sampler(50, temperature=1.0, top_p=0.9, seed=42)
    c = qc.Sampler(50, temperature=1.0, top_p=0.9, seed=43)
    ta, tb, tc = ([s.sample(r) for r in rows] for s in (a, b, c))
    assert ta == tb and ta != tc
    assert qc.sample(rows[0], temperature=1.0, seed=7) == qc.Sampler(50, temperature=1.0, seed=7).sample(rows[0])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_temperature_distribution(temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], np.float32)
    counts = draws(logits, temperature=temperature, seed=11)
    want = softmax(logits / temperature)
    assert chi2(counts, want) < CRIT[len(logits) - 2]


def test_top_k_mask_and_renormalised_distribution():
    logits = np.array([0.1, 2.0, -0.5, 1.0, 1.5, 0.0], np.float32)
    counts = draws(logits, temperature=1.0, top_k=3, seed=5)
    kept = {1, 3, 4}
    assert set(np.flatnonzero(counts)) == kept
    want = np.where(np.isin(np.arange(6), list(kept)), softmax(logits), 0)
    assert chi2(counts, want / want.sum()) < CRIT[2 - 1]


@pytest.mark.parametrize("top_p,kept", [(0.7, {0, 1}), (0.76, {0, 1, 2}), (0.95, {0, 1, 2, 3}),
                                        (0.4, {0}), (1e-6, {0}), (0.0, {0})])
def test_top_p_mask_is_the_smallest_prefix_reaching_top_p(top_p, kept):
    counts = draws(L4, n=6000, temperature=1.0, top_p=top_p, seed=2)
    assert set(np.flatnonzero(counts)) == kept
    want = np.where(np.isin(np.arange(4), list(kept)), P4, 0)
    if len(kept) > 1:
        assert chi2(counts, want / want.sum()) < CRIT[len(kept) - 2]


@pytest.mark.parametrize("min_p,kept", [(0.4, {0, 1}), (0.25, {0, 1, 2}), (0.1, {0, 1, 2, 3}),
                                        (0.9, {0}), (1.0, {0})])
def test_min_p_mask_is_relative_to_the_best(min_p, kept):
    counts = draws(L4, n=6000, temperature=1.0, min_p=min_p, seed=4)
    assert set(np.flatnonzero(counts)) == kept


def test_filters_see_temperature_1_probabilities():
    """llama.cpp's order: top-p and min-p are decided before the temperature applies."""
    counts = draws(L4, n=4000, temperature=5.0, top_p=0.7, seed=8)
    assert set(np.flatnonzero(counts)) == {0, 1}
    counts = draws(L4, n=4000, temperature=0.2, min_p=0.25, seed=8)
    assert set(np.flatnonzero(counts)) <= {0, 1, 2}
    counts = draws(L4, n=4000, temperature=3.0, min_p=0.4, seed=8)
    assert set(np.flatnonzero(counts)) == {0, 1}
    # with the temperature the survivors' odds sharpen/flatten as softmax(l / T)
    want = softmax(L4[:2] / 3.0)
    assert chi2(counts[:2], want) < CRIT[0]


def test_top_k_then_top_p_combined():
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.2, 0.05])).astype(np.float32)
    # top_k 3 keeps {1, 2, 3}; renormalised 0.444, 0.333, 0.222; top_p 0.7 keeps {1, 2}
    counts = draws(logits, n=4000, temperature=1.0, top_k=3, top_p=0.7, seed=9)
    assert set(np.flatnonzero(counts)) == {1, 2}


def test_top_p_on_a_full_vocabulary_matches_numpy():
    """The nucleus over 151936 logits (partial sorting deepens until the mass is reached)."""
    rng = np.random.default_rng(3)
    n = 151936
    logits = (3.0 * rng.standard_normal(n)).astype(np.float32)
    p = softmax(logits)
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    for top_p in (0.5, 0.9):
        nucleus = set(order[:int(np.searchsorted(cum, top_p)) + 1].tolist())
        sp = qc.Sampler(n, temperature=1.0, top_p=top_p, seed=12)
        got = {sp.sample(logits) for _ in range(300)}
        assert got <= nucleus
        assert len(got) > 10


def test_repetition_penalty_llama_cpp_style():
    logits = np.array([2.0, 1.9, -1.0, -1.1], np.float32)
    sp = qc.Sampler(4, repeat_penalty=1.5)
    assert sp.sample(logits) == 0
    sp.accept(0)                           # 2.0 / 1.5 = 1.33 < 1.9
    assert sp.sample(logits) == 1
    neg = np.array([-1.0, -1.1, -5.0, -6.0], np.float32)
    sp = qc.Sampler(4, repeat_penalty=1.5)
    sp.accept(0)                           # -1.0 * 1.5 = -1.5 < -1.1
    assert sp.sample(neg) == 1
    # once per distinct token, however often it was seen: 2.0 / 1.5 = 1.33 > 1.2
    sp = qc.Sampler(2, repeat_penalty=1.5)
    for _ in range(3):
        sp.accept(0)
    assert sp.sample(np.array([2.0, 1.2], np.float32)) == 0
    # only the last repeat_last_n accepted tokens count
    sp = qc.Sampler(4, repeat_penalty=1.5, repeat_last_n=2)
    sp.accept(0)
    sp.accept(2)
    sp.accept(3)
    assert sp.sample(logits) == 0
    # repeat_last_n 0 and penalty 1 switch it off
    for kw in (dict(repeat_penalty=1.5, repeat_last_n=0), dict(repeat_penalty=1.0)):
        sp = qc.Sampler(4, **kw)
        sp.accept(0)
        assert sp.sample(logits) == 0
    # the caller's row is not modified
    row = logits.copy()
    sp = qc.Sampler(4, repeat_penalty=1.5)
    sp.accept(0)
    sp.sample(row)
    np.testing.assert_array_equal(row, logits)


def test_non_finite_logits():
    nan_first = np.array([np.nan, 1.0, 2.0, np.nan], np.float32)
    assert qc.sample(nan_first) == 2
    for seed in range(20):
        assert qc.sample(nan_first, temperature=1.0, seed=seed) in (1, 2)
    inf = np.array([0.0, np.inf, 5.0, np.inf], np.float32)
    assert qc.sample(inf, temperature=1.0, seed=3) == 1
    with pytest.raises(ValueError, match="NaN or -inf"):
        qc.sample(np.full(4, np.nan, np.float32))
    with pytest.raises(ValueError, match="NaN or -inf"):
        qc.sample(np.full(4, -np.inf, np.float32), temperature=1.0)
    # -inf entries are masked tokens
    counts = draws(np.array([0.0, -np.inf, 0.0], np.float32), n=2000, temperature=1.0)
    assert counts[1] == 0


@pytest.mark.parametrize("kw,match", [
    (dict(top_p=-0.1), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=1.5), "min_p"), (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(repeat_last_n=-1), "repeat_last_n"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        qc.Sampler(10, **kw)


def test_bad_rows_and_tokens():
    sp = qc.Sampler(10, seed=1)
    with pytest.raises(ValueError, match="10 values"):
        sp.sample(np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="10 values"):
        sp.sample(np.zeros((2, 10), np.float32))
    assert sp.sample(np.arange(10, dtype=np.float32)[None, :]) == 9
    with pytest.raises(ValueError, match="out of range"):
        sp.accept(10)
    with pytest.raises(ValueError):
        qc.Sampler(0)
    assert sp.n_vocab == 10 and sp.params["seed"] == 1
    assert "Sampler(n_vocab=10" in repr(sp)
    assert qc.Sampler(3, seed=-1).params["seed"] == 2**64 - 1
