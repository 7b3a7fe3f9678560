"""The NumPy reference engine's patch= (qwencuda.patching's semantics): each kind of edit changes
exactly what it should, checked against the reference run without a patch, against a model with
modified weights, and against the attention maths recomputed here from the captures."""
import dataclasses
import math

import numpy as np
import pytest

from qwencuda import reference
from qwencuda.patching import Add, Replace, Scale, ZeroHeads
from qwencuda.testing import write_model

IDS = [3, 17, 42, 99, 7, 250, 11, 64]
ATTN_MAPS = ("attn_scores", "attn_probs")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference.load(write_model(str(tmp_path_factory.mktemp("patch") / "tiny.gguf"),
                                      config="tiny", seed=0))


@pytest.fixture(scope="module")
def plain(ref):
    return reference.forward(ref, IDS)


def _same(a, b, names=None):
    """Bitwise equality of two traces (tensors, logits, argmax)."""
    names = names or list(a.tensors)
    for n in names:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert np.array_equal(a[n], b[n], equal_nan=True), n
    assert np.array_equal(a.logits, b.logits) and np.array_equal(a.argmax, b.argmax)


def _kind(name):
    return name.rsplit(".", 1)[-1]


def test_scale_one_everywhere_is_no_patch(ref, plain):
    """Every tensor but the attention maps is float32 in the reference: multiplying by 1 and
    writing it back changes no bit. The attention maps are float64 inside the reference and a
    patched one is the float32 capture: the pass after it moves by float32 rounding only."""
    names = [n for n in ref.capture_names() if _kind(n) not in ATTN_MAPS + ("argmax",)]
    _same(reference.forward(ref, IDS, patch={n: Scale(1) for n in names}), plain)
    maps = reference.forward(ref, IDS, patch={"blk.*.attn_scores": Scale(1), "blk.*.attn_probs": Scale(1)})
    for n in plain.tensors:
        if _kind(n) != "argmax":
            a, b = maps[n].astype(np.float64), plain[n].astype(np.float64)
            fin = np.isfinite(b)
            assert np.array_equal(fin, np.isfinite(a)), n
            assert np.linalg.norm(a[fin] - b[fin]) <= 1e-5 * np.linalg.norm(b[fin]), n
    assert np.array_equal(maps.argmax, plain.argmax)


def test_no_patch_and_empty_patch_change_nothing(ref, plain):
    _same(reference.forward(ref, IDS, patch=None), plain)
    _same(reference.forward(ref, IDS, patch={"blk.0.q": lambda v: None}), plain)


@pytest.mark.parametrize("layer", [0, 1])
def test_replacing_resid_out_by_its_own_value_is_no_patch(ref, plain, layer):
    name = f"blk.{layer}.resid_out"
    _same(reference.forward(ref, IDS, patch={name: plain[name].copy()}), plain)


def test_a_callback_sees_exactly_the_capture_in_forward_order(ref, plain):
    names = [n for n in ref.capture_names() if n != "argmax"]
    for name in names:                   # one at a time: a callback on an attention map rounds it
        seen = []
        reference.forward(ref, IDS, patch={name: lambda v: seen.append(v)})
        (v,) = seen
        assert v.dtype == np.float32 and v.shape == plain[name].shape, name
        assert np.array_equal(v, plain[name]), name
    order = []
    reference.forward(ref, IDS, patch={n: (lambda n: lambda v: order.append(n))(n) for n in reversed(names)})
    assert order == names


def test_a_patched_tensor_is_captured_patched_and_later_ones_show_it(ref, plain):
    x = np.random.default_rng(1).standard_normal(plain["blk.1.ffn_act"].shape).astype(np.float32)
    tr = reference.forward(ref, IDS, patch={"blk.1.ffn_act": x})
    assert np.array_equal(tr["blk.1.ffn_act"], x)
    w = ref.weights["blk.1.ffn_down.weight"]
    assert np.array_equal(tr["blk.1.ffn_out"], x @ w.T)
    np.testing.assert_array_equal(tr["blk.1.resid_out"], plain["blk.1.resid_mid"] + x @ w.T)
    for n in ref.capture_names()[:ref.capture_names().index("blk.1.ffn_act")]:
        assert np.array_equal(tr[n], plain[n]), n


def test_add_on_embed_equals_a_modified_embedding_row(ref, plain):
    delta = np.random.default_rng(2).standard_normal(ref.config.dim).astype(np.float32)
    row = IDS.index(42)
    emb = ref.weights["token_embd.weight"].copy()
    emb[42] += delta
    other = dataclasses.replace(ref, weights=dict(ref.weights, **{"token_embd.weight": emb}))
    _same(reference.forward(ref, IDS, patch={"embed": Add(delta, rows=[row])}), reference.forward(other, IDS))


def test_zero_heads_on_attn_probs_zero_those_heads_of_attn_out(ref, plain):
    c = ref.config
    tr = reference.forward(ref, IDS, patch={"blk.0.attn_probs": ZeroHeads([1, 3])})
    assert not tr["blk.0.attn_probs"][[1, 3]].any()
    out = tr["blk.0.attn_out"].reshape(len(IDS), c.n_head, c.head_dim)
    want = plain["blk.0.attn_out"].reshape(len(IDS), c.n_head, c.head_dim)
    assert not out[:, [1, 3]].any()
    np.testing.assert_allclose(out[:, [0, 2]], want[:, [0, 2]], rtol=1e-5, atol=1e-6)
    assert not np.allclose(tr["blk.0.attn_proj"], plain["blk.0.attn_proj"])


def test_zero_heads_rows_and_scale_heads_touch_only_their_region(ref, plain):
    tr = reference.forward(ref, IDS, patch={"blk.0.q": [ZeroHeads([2], rows=[1, 4]), Scale(3, heads=[0])]})
    q, q0 = tr["blk.0.q"], plain["blk.0.q"]
    assert not q[[1, 4]][:, 2].any()
    assert np.array_equal(q[:, 0], q0[:, 0] * np.float32(3))
    keep = np.ones(q.shape[:2], bool)
    keep[:, 0] = False
    keep[[1, 4], 2] = False
    assert np.array_equal(q[keep], q0[keep])


def test_q_and_k_patched_before_rope_are_rotated(ref, plain):
    rng = np.random.default_rng(3)
    q = rng.standard_normal(plain["blk.0.q"].shape).astype(np.float32)
    k = rng.standard_normal(plain["blk.0.k"].shape).astype(np.float32)
    tr = reference.forward(ref, IDS, patch={"blk.0.q": Replace(q), "blk.0.k": k})
    pos = np.arange(len(IDS))
    assert np.array_equal(tr["blk.0.q_rope"], reference._rope(q, pos, ref.config.rope_theta))
    assert np.array_equal(tr["blk.0.k_rope"], reference._rope(k, pos, ref.config.rope_theta))


def _attention(q, K, V, n_head_kv, first_pos=0):
    """scores (H, n, n_kv), probs, attn_out (n, H*hd) in float64 from q (n, H, hd) and the whole
    cache K, V (n_kv, Hkv, hd)."""
    n, H, hd = q.shape
    kv = np.arange(H) // (H // n_head_kv)
    s = np.einsum("nhd,thd->hnt", q.astype(np.float64), K[:, kv].astype(np.float64)) / math.sqrt(hd)
    s = np.where(np.arange(len(K))[None, None, :] > (first_pos + np.arange(n))[None, :, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return s, p, np.einsum("hnt,thd->nhd", p, V[:, kv].astype(np.float64)).reshape(n, H * hd)


def test_patched_scores_are_softmaxed_and_mixed(ref, plain):
    noise = np.random.default_rng(4).standard_normal(plain["blk.1.attn_scores"].shape).astype(np.float32)
    tr = reference.forward(ref, IDS, patch={"blk.1.attn_scores": Add(noise)})
    s = tr["blk.1.attn_scores"]
    assert np.array_equal(s, plain["blk.1.attn_scores"] + noise)       # -inf + x stays masked
    p = np.exp(s.astype(np.float64) - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(tr["blk.1.attn_probs"], p, rtol=1e-6, atol=1e-7)
    _, _, out = _attention(tr["blk.1.q_rope"], tr["blk.1.k_rope"], tr["blk.1.v"], ref.config.n_head_kv)
    want = np.einsum("hnt,thd->nhd", p, tr["blk.1.v"][:, np.arange(4) // 2].astype(np.float64))
    np.testing.assert_allclose(tr["blk.1.attn_out"], want.reshape(out.shape), rtol=1e-5, atol=1e-6)
    assert not np.allclose(tr["blk.1.attn_out"], plain["blk.1.attn_out"])


def test_k_rope_and_v_patched_at_prefill_enter_the_cache(ref):
    c = ref.config
    s0 = reference.RefSession(ref)
    p0 = s0.prefill(IDS[:5], capture="*")
    t0 = s0.step(IDS[5], capture="*")
    s = reference.RefSession(ref)
    p = s.prefill(IDS[:5], capture="*", patch={"blk.0.k_rope": Scale(2, rows=[0]),
                                               "blk.0.v": Scale(-1, rows=[1])})
    assert np.array_equal(p["blk.0.k_rope"][0], p0["blk.0.k_rope"][0] * np.float32(2))
    t = s.step(IDS[5], capture="*")                                   # no patch at this step
    assert np.array_equal(t["blk.0.q_rope"], t0["blk.0.q_rope"])     # the step's own input is unchanged
    K = np.concatenate([p["blk.0.k_rope"], t["blk.0.k_rope"]])
    V = np.concatenate([p["blk.0.v"], t["blk.0.v"]])
    sc, pr, out = _attention(t["blk.0.q_rope"], K, V, c.n_head_kv, first_pos=5)
    np.testing.assert_allclose(t["blk.0.attn_scores"], sc, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(t["blk.0.attn_probs"], pr, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(t["blk.0.attn_out"], out, rtol=1e-5, atol=1e-6)
    assert not np.allclose(t["blk.0.attn_scores"][:, :, 0], t0["blk.0.attn_scores"][:, :, 0])
    assert np.allclose(t["blk.0.attn_scores"][:, :, 2:], t0["blk.0.attn_scores"][:, :, 2:], rtol=1e-6)
    assert not np.allclose(t.logits, t0.logits)


def test_output_norm_patched_feeds_the_lm_head(ref, plain):
    h = np.random.default_rng(5).standard_normal(plain["output_norm"].shape).astype(np.float32)
    lm = ref.weights["output.weight"]
    tr = reference.forward(ref, IDS, logits="last", patch={"output_norm": h})
    assert np.array_equal(tr["output_norm"], h)
    assert np.array_equal(tr.logits, h[-1:] @ lm.T)


def test_logits_patched_decide_the_argmax(ref, plain):
    tr = reference.forward(ref, IDS, logits="last", patch={"logits": Add(1e3, rows=[0])})
    assert tr.logits.shape == (1, ref.config.n_vocab)
    bump = np.zeros(ref.config.n_vocab, np.float32)
    bump[5] = 1e4
    tr = reference.forward(ref, IDS, patch={"logits": Add(bump, rows=[2, 6])})
    assert tr.argmax.tolist() == [a if i not in (2, 6) else 5 for i, a in enumerate(plain.argmax.tolist())]
    assert np.array_equal(tr["logits"], tr.logits) and np.array_equal(tr["argmax"], tr.argmax)


def test_forward_steps_patch_every_call(ref):
    seen = []
    steps = reference.forward_steps(ref, IDS, 5, patch={"blk.1.resid_out": lambda v: seen.append(v.shape)})
    assert len(steps) == 4 and seen == [(5, ref.config.dim)] + [(1, ref.config.dim)] * 3
    base = reference.forward_steps(ref, IDS, 5)
    zero = reference.forward_steps(ref, IDS, 5, patch={"blk.0.attn_probs": ZeroHeads([0])})
    for a, b in zip(zero, base):
        assert not a["blk.0.attn_probs"][0].any() and b["blk.0.attn_probs"][0].any()


@pytest.mark.parametrize("fault", sorted(reference.FAULTS))
def test_faulty_sessions_take_patches_too(ref, fault):
    names = [n for n in ref.capture_names() if _kind(n) not in ATTN_MAPS + ("argmax",)]
    bad = reference.forward(ref, IDS, faults=(fault,))
    _same(reference.forward(ref, IDS, faults=(fault,), patch={n: Scale(1) for n in names}), bad)
    steps = reference.forward_steps(ref, IDS, 6, faults=(fault,), patch={"blk.0.k_rope": ZeroHeads([0])})
    assert all(not t["blk.0.k_rope"][:, 0].any() for t in steps)
    # the zeroed key head gives zero scores (fault or not, every query head on it reads those keys)
    heads_on_kv0 = [h for h in range(ref.config.n_head)
                    if (h % ref.config.n_head_kv if fault == "gqa_wrong_mapping"
                        else h // (ref.config.n_head // ref.config.n_head_kv)) == 0]
    s = steps[-1]["blk.0.attn_scores"][heads_on_kv0]
    assert not np.where(np.isfinite(s), s, 0).any()


def test_bad_patches(ref):
    with pytest.raises(ValueError, match="argmax"):
        reference.forward(ref, IDS, patch={"argmax": 0})
    with pytest.raises(ValueError, match="matches no tensor"):
        reference.forward(ref, IDS, patch={"blk.9.q": Scale(2)})
    with pytest.raises(ValueError, match="shape"):
        reference.forward(ref, IDS, patch={"blk.0.q": np.zeros((3, 3))})
    with pytest.raises(TypeError):
        reference.forward(ref, IDS, patch=[("blk.0.q", 0)])
