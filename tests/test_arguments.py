"""One rule per argument, checked in one place (issue 14, item 5): the API misuse cases an
outside test found accepted, truncated or failing with someone else's message."""
import numpy as np
import pytest

import qwencuda as qc
from engine_util import model_file


@pytest.mark.parametrize("kw,exc,match", [
    (dict(top_p=1.5), ValueError, r"top_p must be in \[0, 1\]"),
    (dict(top_p=-0.1), ValueError, r"top_p must be in \[0, 1\]"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(repeat_penalty=0.0), ValueError, "repeat_penalty must be > 0"),
    (dict(repeat_last_n=-1), ValueError, "repeat_last_n must be >= 0"),
    (dict(temperature=-1), ValueError, "temperature must be >= 0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be >= 0 and finite"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_k=1.5), TypeError, "integer"),
    (dict(repeat_last_n=1.5), TypeError, "integer"),
    (dict(seed=2**64), ValueError, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(seed=-2**63 - 1), ValueError, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(seed=1.0), TypeError, "seed must be an int"),
])
def test_sampler_rules_are_the_same_everywhere(kw, exc, match):
    """Sampler, sample() and generate() refuse the same values with the same message."""
    with pytest.raises(exc, match=match):
        qc.Sampler(10, **kw)
    with pytest.raises(exc, match=match):
        qc.sample(np.zeros(10, np.float32), **kw)
    with qc.Model(model_file(), device="cpu") as m:
        with pytest.raises(exc, match=match):
            m.generate([1, 2], max_new_tokens=1, **kw)


def test_sampler_edges_that_are_valid():
    assert qc.Sampler(10, seed=2**64 - 1).params["seed"] == 2**64 - 1
    assert qc.Sampler(10, seed=-1).params["seed"] == 2**64 - 1          # wraps, as documented
    assert qc.Sampler(10, seed=np.int64(7)).params["seed"] == 7
    assert qc.Sampler(10, top_p=1.0, top_k=0, temperature=0.0).sample(np.arange(10.0)) == 9


def test_a_huge_penalty_history_costs_nothing_up_front():
    """repeat_last_n=10**9 used to allocate 4 GB at construction; the history now grows with
    the tokens accepted and keeps the last repeat_last_n of them."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    big = qc.Sampler(10, temperature=0.0, repeat_penalty=100.0, repeat_last_n=10**9)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert after - before < 64 * 1024     # KiB: far below the 4 GB it used to take
    small = qc.Sampler(10, temperature=0.0, repeat_penalty=100.0, repeat_last_n=3)
    logits = np.linspace(1.0, 2.0, 10).astype(np.float32)
    for t in [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 20:      # past every growth step of the ring
        big.accept(t)
        small.accept(t)
    # big penalises all ten tokens, so 9 (the best logit) wins again; small only 2, 1, 0
    assert big.sample(logits) == 9 and small.sample(logits) == 9
    for t in [9, 8, 7]:
        small.accept(t)
    assert small.sample(logits) == 6


def test_session_step_and_rewind_take_ints_only():
    with qc.Model(model_file(), device="cpu") as m:
        s = m.session()
        s.prefill([1, 2, 3])
        with pytest.raises(TypeError):
            s.step(1.9)
        with pytest.raises(TypeError):
            m.forward([1.5])
        with pytest.raises(TypeError):
            s.rewind(1.7)
        assert s.position == 3
        s.step(np.int32(4))
        s.rewind(np.int64(2))
        assert s.position == 2
        s.close()


def test_elementwise_kernels_keep_the_shape_and_refuse_an_empty_norm_axis():
    k = qc.kernels
    assert k.swiglu(np.float32(1.0), np.float32(2.0)).shape == ()
    assert k.add(1.0, 2.0).shape == () and float(k.add(1.0, 2.0)) == 3.0
    assert k.add(np.ones((2, 3)), np.ones((2, 3))).shape == (2, 3)
    with pytest.raises(ValueError, match="differ"):
        k.add(np.ones(3), np.ones((1, 3)))
    with pytest.raises(ValueError, match="normalised axis of x \\(3, 0\\) is empty"):
        k.rmsnorm(np.zeros((3, 0), np.float32), np.zeros(0, np.float32))
    assert k.rmsnorm(np.zeros((0, 4), np.float32), np.ones(4, np.float32)).shape == (0, 4)
