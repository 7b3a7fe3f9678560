"""The exact set of tokens that top-k, top-p and min-p keep (issue 19 item 3), on the host sampler
(csrc/engine/sampler.c) and on the backend's sample op (qwencuda.kernels.sample: the host code on "cpu",
kernels/sample.cu on "cuda"), against an independent NumPy implementation of each filter in
llama.cpp's order (top-k -> top-p -> min-p on temperature-1 probabilities, then temperature).

How a set is observed: the filters run on temperature-1 probabilities and the temperature only
shapes the final draw, so with temperature 1e4 every survivor is drawn with probability within
0.1% of 1/N and every other token never. After 40 N draws the chance that some survivor was
never drawn is below N e^-40; so the set of drawn tokens IS the kept set, and a filter that keeps
one token too many or too few changes it (the audit's "top-p keeps one more" passed the old tests).

Rows: a small vocabulary and the full 151936 of Qwen2.5, each with a head of strong tokens with
ties at the boundaries (tied values at scattered ids: ties go to the lower id, as documented in
csrc/engine/sampler.c and kernels/sample.cu) and a tail within reach of the candidate cut. Every case
checks first that its boundaries are unambiguous (no cumulative mass within 1e-7 of top_p, no
logit within 1e-5 of the min-p floor), so float rounding cannot decide it.
"""
import numpy as np
import pytest

import qwencuda as qc
from qwencuda import kernels as K

HOT = 1e4          # temperature: survivors drawn uniformly (within 0.1%)

# head values (best first); ties on purpose at 19.5, 18.5, 17.0 and 15.0
HEAD = np.array([20.0, 19.5, 19.5, 19.0, 18.5, 18.5, 18.5, 18.0, 17.0, 17.0, 16.5, 16.0, 15.0,
                 15.0, 15.0, 14.0, 13.0, 12.0, 11.0, 10.0], np.float32)

CASES = [  # (top_k, top_p, min_p)
    (1, 1.0, 0.0),
    (2, 1.0, 0.0),       # 20 and the lower id of the two 19.5s
    (5, 1.0, 0.0),       # ... and one of the three 18.5s: the lowest id
    (9, 1.0, 0.0),       # one of the two 17.0s
    (0, 0.5, 0.0),       # top-p alone: the bucket path over every candidate
    (0, 0.8, 0.0),
    (0, 0.95, 0.0),
    (0, 0.99, 0.0),
    (14, 0.9, 0.0),      # top-k then top-p on the k: the sorted path
    (6, 0.7, 0.0),
    (0, 1.0, 0.05),      # min-p alone
    (0, 1.0, 0.3),
    (0, 0.95, 0.1),      # top-p then min-p
    (12, 0.97, 0.02),    # all three
]


def make_row(n_vocab, seed):
    """HEAD at scattered ids (tied values in both id orders), the rest a tail about 16.5 nats
    below the best: inside the sampler's candidate cut (40 nats x temperature), so every filter
    sees it, and with under 1% of the mass on the full vocabulary."""
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(n_vocab) * 0.5 + 3.5).astype(np.float32)
    ids = rng.choice(n_vocab, size=len(HEAD), replace=False)
    row[ids] = HEAD
    row = np.minimum(row, np.float32(9.9))
    row[ids] = HEAD          # head values exact (the tail capped below the head's last value)
    return row


def expected_set(row, top_k, top_p, min_p):
    """llama.cpp's chain, written from its definitions: sort best first (ties: lower id first);
    top-k keeps the first k; top-p keeps the shortest prefix whose softmax mass over the
    remaining tokens reaches top_p (the token that crosses included); min-p keeps p >= min_p * p_max."""
    v = row.astype(np.float64)
    ids = np.arange(len(v))
    ids = ids[np.lexsort((ids, -v))]
    if 0 < top_k < len(ids):
        ids = ids[:top_k]
    if top_p < 1.0:
        p = np.exp(v[ids] - v[ids[0]])
        cum = np.cumsum(p)
        target = float(np.float32(top_p)) * cum[-1]
        assert np.abs(cum - target).min() > 1e-7 * cum[-1], "ambiguous top-p case"
        ids = ids[:int(np.searchsorted(cum, target, side="left")) + 1]
    if min_p > 0.0:
        floor = v[ids[0]] + np.log(float(np.float32(min_p)))
        assert np.abs(v[ids] - floor).min() > 1e-5, "ambiguous min-p case"
        ids = ids[v[ids] >= floor]
    return {int(i) for i in ids}


def _draws(row, case, path, n, seed=7):
    top_k, top_p, min_p = case
    sp = qc.Sampler(len(row), temperature=HOT, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if path == "host":
        return [sp.sample(row) for _ in range(n)]
    return [K.sample(row, sp, device=path) for _ in range(n)]


def test_the_numpy_filters_on_a_hand_case():
    """The expectation itself, on values worked out by hand."""
    row = np.array([1.0, 3.0, 2.0, 3.0, 0.0, 2.0], np.float32)
    assert expected_set(row, 1, 1.0, 0.0) == {1}                 # tie at 3.0: the lower id
    assert expected_set(row, 3, 1.0, 0.0) == {1, 3, 2}           # tie at 2.0: id 2 before 5
    # softmax of [3, 3, 2, 2, 1, 0] = 0.3424, 0.3424, 0.1259, 0.1259, 0.0463, 0.0170;
    # cumulative 0.3424, 0.6847, 0.8107: the token that crosses top_p is kept
    assert expected_set(row, 0, 0.3, 0.0) == {1}
    assert expected_set(row, 0, 0.65, 0.0) == {1, 3}
    assert expected_set(row, 0, 0.7, 0.0) == {1, 3, 2}          # id 2 before id 5 (both 2.0)
    assert expected_set(row, 2, 0.7, 0.0) == {1, 3}             # top-k first: mass over the two
    assert expected_set(row, 0, 1.0, 0.3) == {1, 3, 2, 5}        # e^-1 = 0.37 >= 0.3 > e^-2
    assert expected_set(row, 2, 1.0, 0.5) == {1, 3}


@pytest.mark.parametrize("path", ["host", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n_vocab", [64, 151936])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-p{c[1]}-m{c[2]}")
def test_kept_set_is_exact(path, n_vocab, case):
    row = make_row(n_vocab, seed=n_vocab)
    want = expected_set(row, *case)
    n = 40 * len(want) + 40
    got = _draws(row, case, path, n)
    assert set(got) == want, (f"{path}: kept {sorted(set(got) - want)} that llama.cpp's chain drops, "
                              f"dropped {sorted(want - set(got))} that it keeps")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c[1] < 1.0 or c[2] > 0], ids=str)
def test_device_draws_equal_host_draws(case):
    """The same sampler state gives the same token on the GPU as on the host, draw by draw, on
    the full vocabulary (at temperature 1: the survivors' weights are far from uniform)."""
    row = make_row(151936, seed=3)
    top_k, top_p, min_p = case
    host = qc.Sampler(len(row), temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=11)
    dev = qc.Sampler(len(row), temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=11)
    a = [host.sample(row) for _ in range(200)]
    b = [K.sample(row, dev, device="cuda") for _ in range(200)]
    assert a == b
    assert set(a) <= expected_set(row, *case)
