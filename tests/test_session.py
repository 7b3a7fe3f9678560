"""Sessions: the KV cache and positions (prefill + steps == one forward), rewind, reset, errors
that leave the session usable, capture shapes during decode, closing, threads.

Tolerance: the same engine computes the same float32 values either way, except that a batched
prefill and a single-token step may sum in another order inside the backend's matmul and
attention (blocking by rows); 1e-5 relative is ~100 float32 ulps of headroom.
"""
import threading

import numpy as np
import pytest

import qwencuda as qc
from engine_util import design_capture_names, max_abs, model_file, rel_err

TOL = 1e-5
IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 11]


@pytest.fixture(scope="module")
def tiny():
    with qc.Model(model_file("tiny-gqa7", "q8_0"), device="cpu") as m:
        yield m


def _close(a, b, tol=TOL):
    assert rel_err(a, b) <= tol, f"relative error {rel_err(a, b):.3g} (max-abs {max_abs(a, b):.3g})"


def test_prefill_then_steps_equals_one_forward(tiny):
    full = tiny.forward(IDS, capture="*", logits="all")
    s = tiny.session(max_context=32)
    tr = s.prefill(IDS[:4], capture="*", logits="last")
    assert s.position == 4
    _close(tr.logits[0], full.logits[3])
    for p in range(4, len(IDS)):
        tr = s.step(IDS[p], capture="*")
        assert s.position == p + 1
        np.testing.assert_array_equal(tr.positions, [p])
        np.testing.assert_array_equal(tr.logit_positions, [p])
        _close(tr.logits[0], full.logits[p])
        assert tr.argmax[0] == full.argmax[p]
        # every captured tensor of this step is the row p of the full forward
        for name in full.keys():
            want = full[name]
            if name.endswith(("attn_scores", "attn_probs")):
                want = want[:, p:p + 1, :p + 1]          # keys 0..p visible at position p
            else:
                want = want[p:p + 1]
            got = tr[name]
            assert got.shape == want.shape, name
            if name.endswith("attn_scores"):
                got, want = np.nan_to_num(got, neginf=0), np.nan_to_num(want, neginf=0)
            if got.dtype.kind == "f":
                _close(got, want)
            else:
                np.testing.assert_array_equal(got, want)


def test_chunked_prefill_equals_one_prefill(tiny):
    full = tiny.forward(IDS, logits="all")
    s = tiny.session(max_context=16)
    assert s.prefill(IDS[:3], logits=None).logits is None
    tr = s.prefill(IDS[3:7], logits="all")
    np.testing.assert_array_equal(tr.positions, [3, 4, 5, 6])
    np.testing.assert_array_equal(tr.logit_positions, [3, 4, 5, 6])
    _close(tr.logits, full.logits[3:7])
    tr = s.prefill(IDS[7:], logits="last")
    _close(tr.logits[0], full.logits[-1])
    assert s.position == len(IDS)


def test_rewind_then_restep_gives_the_same_logits(tiny):
    s = tiny.session(max_context=16)
    s.prefill(IDS[:6])
    a = s.step(IDS[6]).logits
    b = s.step(IDS[7]).logits
    s.rewind(2)
    assert s.position == 6
    np.testing.assert_array_equal(s.step(IDS[6]).logits, a)
    # a different token at position 7 overwrites the stale cache row
    c = s.step(IDS[8]).logits
    s.rewind(1)
    np.testing.assert_array_equal(s.step(IDS[7]).logits, b)
    assert not np.array_equal(b, c)
    with pytest.raises(ValueError, match="rewind"):
        s.rewind(99)
    with pytest.raises(ValueError, match="rewind"):
        s.rewind(-1)
    s.rewind(0)
    assert s.position == 8


def test_reset_starts_over(tiny):
    s = tiny.session(max_context=16)
    first = s.prefill(IDS[:5], logits="all").logits
    s.step(1)
    s.reset()
    assert s.position == 0
    np.testing.assert_array_equal(s.prefill(IDS[:5], logits="all").logits, first)


def test_last_path_on_the_cpu(tiny, monkeypatch):
    """Session.last_path: None before any eval; the CPU has no recording, so every eval runs op by
    op ("ops"), also with QWENCUDA_DECODE=persistent (a CUDA-only kernel: test_decode_step.py)."""
    monkeypatch.setenv("QWENCUDA_DECODE", "persistent")
    with tiny.session(max_context=16) as s:
        assert s.last_path is None
        s.prefill(IDS[:3])
        assert s.last_path == "ops"
        s.step(4)
        assert s.last_path == "ops"
    with pytest.raises(ValueError, match="closed"):
        s.last_path


def test_kv_position_advances_and_attention_sees_0_to_p(tiny):
    """DESIGN.md pitfall: the position advances after every forward; position p sees 0..p."""
    s = tiny.session(max_context=16)
    s.prefill(IDS[:3])
    for p in range(3, 6):
        tr = s.step(IDS[p], capture=["blk.0.attn_probs", "blk.0.attn_scores", "blk.0.q", "blk.0.q_rope"])
        probs = tr["blk.0.attn_probs"]
        assert probs.shape == (tiny.config.n_head, 1, p + 1)
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.isfinite(tr["blk.0.attn_scores"]))   # nothing masked for the last query
        # q_rope was rotated by angle p: a stuck position (0) would leave q unchanged
        assert not np.allclose(tr["blk.0.q_rope"], tr["blk.0.q"])


def test_session_errors_leave_it_usable(tiny):
    s = tiny.session(max_context=8)
    s.prefill(IDS[:5])
    ref = s.step(IDS[5]).logits
    s.rewind(1)
    with pytest.raises(ValueError, match="context"):
        s.prefill(IDS[:4])                       # 5 + 4 > 8
    assert s.position == 5
    with pytest.raises(ValueError, match=r"token id 400 at ids\[1\] \(position 6\)"):
        s.prefill([1, tiny.config.n_vocab])
    with pytest.raises(ValueError, match="token id -1"):
        s.step(-1)
    with pytest.raises(ValueError, match="empty"):
        s.prefill([])
    with pytest.raises(TypeError):
        s.prefill([1.5, 2.0])
    with pytest.raises(TypeError):
        s.prefill("hello")
    with pytest.raises(ValueError, match="logits"):
        s.prefill([1], logits="first")
    with pytest.raises(ValueError, match="matches no capture name"):
        s.prefill([1], capture="blk.*.nope")
    assert s.position == 5
    np.testing.assert_array_equal(s.step(IDS[5]).logits, ref)
    s.prefill([1, 2])
    assert s.position == 8
    with pytest.raises(ValueError, match="context full"):
        s.step(1)
    assert s.position == 8


def test_default_max_context_and_capture_none_copies_nothing(tiny):
    s = tiny.session()
    assert s.max_context == min(4096, tiny.config.n_ctx_train)
    tr = s.prefill(IDS[:3])
    assert len(tr) == 0 and tr.logits.shape == (1, tiny.config.n_vocab)
    tr = s.step(1, capture=[])
    assert len(tr) == 0


def test_capture_selects_exactly_the_matching_names(tiny):
    tr = tiny.forward(IDS[:4], capture=["blk.1.*_rope", "embed", "argmax"])
    assert list(tr.keys()) == ["embed", "blk.1.q_rope", "blk.1.k_rope", "argmax"]
    c = tiny.config
    assert tr["blk.1.q_rope"].shape == (4, c.n_head, c.head_dim)
    assert tr["blk.1.k_rope"].shape == (4, c.n_head_kv, c.head_dim)
    assert tr["argmax"].dtype == np.int32
    np.testing.assert_array_equal(tr["argmax"], tr.argmax)
    # arrays own their memory: a later forward must not change them
    keep = tr["embed"].copy()
    tiny.forward(IDS[4:8], capture="embed")
    np.testing.assert_array_equal(tr["embed"], keep)
    assert tr["embed"].base is not None and tr["embed"].flags.owndata is False


def test_capture_shapes_follow_the_api(tiny):
    c = tiny.config
    n = 5
    s = tiny.session(max_context=16)
    s.prefill(IDS[:2])
    tr = s.prefill(IDS[2:2 + n], capture="*", logits="all")
    n_kv = 2 + n
    shapes = {
        "embed": (n, c.dim), "output_norm": (n, c.dim), "logits": (n, c.n_vocab), "argmax": (n,),
        "blk.0.attn_norm": (n, c.dim), "blk.0.q": (n, c.n_head, c.head_dim),
        "blk.0.k": (n, c.n_head_kv, c.head_dim), "blk.0.v": (n, c.n_head_kv, c.head_dim),
        "blk.0.q_rope": (n, c.n_head, c.head_dim), "blk.0.k_rope": (n, c.n_head_kv, c.head_dim),
        "blk.0.attn_scores": (c.n_head, n, n_kv), "blk.0.attn_probs": (c.n_head, n, n_kv),
        "blk.0.attn_out": (n, c.n_head * c.head_dim), "blk.0.attn_proj": (n, c.dim),
        "blk.0.resid_mid": (n, c.dim), "blk.0.ffn_norm": (n, c.dim), "blk.0.gate": (n, c.ffn_dim),
        "blk.0.up": (n, c.ffn_dim), "blk.0.ffn_act": (n, c.ffn_dim), "blk.0.ffn_out": (n, c.dim),
        "blk.0.resid_out": (n, c.dim),
    }
    for name, shape in shapes.items():
        assert tr[name].shape == shape, name
    assert list(tr.keys()) == design_capture_names(tiny.config.n_layer)   # emitted in forward order
    sc = tr["blk.0.attn_scores"]
    for i in range(n):   # query at position 2 + i sees keys 0 .. 2 + i
        assert np.all(np.isfinite(sc[:, i, :3 + i])) and np.all(np.isneginf(sc[:, i, 3 + i:]))
        assert np.all(tr["blk.0.attn_probs"][:, i, 3 + i:] == 0)


def test_prefill_longer_than_the_initial_scratch(tiny):
    """Scratch buffers grow for a long prefill (the first allocation holds 32 rows)."""
    ids = (np.arange(80) * 37 % tiny.config.n_vocab).tolist()
    full = tiny.forward(ids, logits="all")
    s = tiny.session(max_context=100)
    s.prefill(ids[:10])
    tr = s.prefill(ids[10:], logits="all")
    _close(tr.logits, full.logits[10:])


def test_closed_sessions_and_models_raise():
    m = qc.Model(model_file("tiny", "f32"), device="cpu")
    s = m.session(max_context=8)
    s.prefill([1, 2])
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.step(1)
    with pytest.raises(ValueError, match="closed"):
        _ = s.position
    s2 = m.session(max_context=8)
    m.close()
    m.close()
    assert m.closed and s2.closed
    with pytest.raises(ValueError, match="closed"):
        s2.prefill([1])
    with pytest.raises(ValueError, match="closed"):
        m.forward([1])
    with pytest.raises(ValueError, match="closed"):
        m.session()
    with qc.Model(model_file("tiny", "f32"), device="cpu") as m2:
        with m2.session(max_context=4) as s3:
            s3.prefill([1])
        assert s3.closed
    assert m2.closed


def test_two_threads_share_one_model(tiny):
    """The model lock serialises the backend: concurrent sessions give the serial results."""
    want = {k: tiny.forward(IDS[k:k + 6], logits="all").logits for k in range(4)}
    got, errors = {}, []

    def work(k):
        try:
            for _ in range(3):
                s = tiny.session(max_context=8)
                tr = s.prefill(IDS[k:k + 3], logits="all")
                rest = [s.step(t).logits for t in IDS[k + 3:k + 6]]
                got[k] = np.concatenate([tr.logits] + rest)
                s.close()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(4):
        _close(got[k], want[k])
