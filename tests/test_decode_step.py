"""The persistent decode kernel (kernels/decode_step.cu: a decode step's layers and lm_head in one
launch) against the op-by-op decode step it replaces.

Both are recorded as CUDA graphs and replayed; QWENCUDA_DECODE=persistent, read when a session
is created, records the kernel (the op-by-op recording is the default). The kernel computes every row, norm, rotation and
attention split with the device functions of the op-by-op kernels, in the same order, so the
logits must be equal bit for bit (tolerance 0), for every weight type with an 8-bit GEMV,
head_dim 64 and 128, both cache types, tied and untied embeddings; greedy and sampled tokens
then follow. Session.last_path says which path ran, so a test cannot pass by comparing the
op-by-op step with itself. The sessions compared run with QWENCUDA_NORM_AFTER=0: the kernel
normalises x before the gate/up dot products, as the op-by-op step does without the o projection's
hand-off (matmul_add's norm_next, which applies the norm's scale after them and may round
differently: tests/test_kernels.py, test_matmul_add_swiglu), and their models' backends with
QWENCUDA_DOWN_FOLD=0: the kernel runs the down projection as the op-by-op step's matmul_add does,
not folded into the gate/up op (swiglu_down, whose sums add in another order:
tests/test_swiglu_down.py). Needs the GPU machine.
"""
import os

import numpy as np
import pytest

import qwencuda as qc
from engine_util import session_with_env
from qwencuda import testing

pytestmark = pytest.mark.gpu

Q8_TYPES = ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k", "q4_k_m"]


@pytest.fixture(autouse=True)
def _unfolded(monkeypatch):
    monkeypatch.setenv("QWENCUDA_DOWN_FOLD", "0")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """Synthetic files; the plain configs in QWENCUDA_SYNTH_DIR when set, as test_cuda_engine.py
    names them there (scripts/gpu_check.sh shares the 0.5B files between the tests)."""
    d = tmp_path_factory.mktemp("decode_step")
    shared = os.environ.get("QWENCUDA_SYNTH_DIR")
    made = {}

    def get(config, weight_type, **over):
        key = (config, weight_type, tuple(sorted(over.items())))
        if key not in made:
            if shared and not over:
                name = "qwen05b" if config == "qwen2.5-0.5b" else config
                path = os.path.join(shared, f"{name}-{weight_type}.gguf")
            else:
                path = str(d / f"{config}-{weight_type}-{len(made)}.gguf")
            if not os.path.exists(path):
                part = f"{path}.{os.getpid()}.part"      # another writer may share the folder
                testing.write_model(part, config=dict(testing.CONFIGS[config], **over),
                                    weight_type=weight_type)
                os.replace(part, path)
            made[key] = path
        return made[key]
    return get


def _session(m, monkeypatch, ops, **kw):
    """A session whose recorded decode step is the persistent kernel, or (ops) op by op."""
    return session_with_env(m, monkeypatch, {"QWENCUDA_DECODE": None if ops else "persistent",
                                             "QWENCUDA_NORM_AFTER": "0"}, **kw)


def _steps(path, monkeypatch, ids, n_prompt, kv_type, max_context=96):
    """Logits of every step after an n_prompt-token prefill, persistent and op by op."""
    out = {}
    with qc.Model(path, device="cuda") as m:
        for ops in (False, True):
            with _session(m, monkeypatch, ops, max_context=max_context, kv_type=kv_type) as s:
                s.prefill(ids[:n_prompt])
                rows, paths = [], set()
                for t in ids[n_prompt:]:
                    rows.append(s.step(int(t)).logits[0].copy())
                    paths.add(s.last_path)
                out[ops] = (np.array(rows), paths)
    return out


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("weight_type", Q8_TYPES)
@pytest.mark.parametrize("config", ["tiny-hd64", "tiny-hd128"])
def test_persistent_step_equals_op_by_op(synth, monkeypatch, config, weight_type, kv_type):
    path = synth(config, weight_type)
    ids = np.random.default_rng(7).integers(0, 400, size=40)
    got = _steps(path, monkeypatch, ids, 6, kv_type)
    assert got[False][1] == {"persistent"}, got[False][1]
    assert got[True][1] == {"graph"}, got[True][1]
    np.testing.assert_array_equal(got[False][0], got[True][0])


@pytest.mark.parametrize("weight_type", ["q8_0", "q4_k_m"])
def test_persistent_tied_and_three_layers(synth, monkeypatch, weight_type):
    """Tied embeddings (the lm_head is token_embd) and an odd layer count."""
    path = synth("tiny-hd64", weight_type, tied=True, n_layer=3)
    ids = np.random.default_rng(8).integers(0, 400, size=30)
    got = _steps(path, monkeypatch, ids, 3, "f16")
    assert got[False][1] == {"persistent"}
    np.testing.assert_array_equal(got[False][0], got[True][0])


@pytest.mark.parametrize("weight_type", ["q8_0", "q5_0"])
def test_persistent_dim_not_a_multiple_of_128(synth, monkeypatch, weight_type):
    """dim 832: 26 blocks of 32, so in the norm's quantize (qc_dec_norm_quantize, eight lanes a
    block) the last warp holds two groups past the end, which must still take part in the
    shuffles and store nothing."""
    path = synth("tiny-hd64", weight_type, dim=832, n_head=13, n_head_kv=1, ffn_dim=256)
    ids = np.random.default_rng(9).integers(0, 400, size=24)
    got = _steps(path, monkeypatch, ids, 6, "f16")
    assert got[False][1] == {"persistent"}, got[False][1]
    np.testing.assert_array_equal(got[False][0], got[True][0])


@pytest.mark.parametrize("weight_type", ["f16", "q4_1", "q5_k"])
def test_other_types_keep_the_op_by_op_graph(synth, monkeypatch, weight_type):
    """Weights without an 8-bit GEMV: the op-by-op recording, even with QWENCUDA_DECODE=persistent."""
    path = synth("tiny-hd64", weight_type)
    ids = np.random.default_rng(9).integers(0, 400, size=12)
    got = _steps(path, monkeypatch, ids, 4, "f16")
    assert got[False][1] == {"graph"} and got[True][1] == {"graph"}


def test_default_and_device_float_keep_the_op_by_op_graph(synth, monkeypatch):
    path = synth("tiny-hd64", "q8_0")
    monkeypatch.delenv("QWENCUDA_DECODE", raising=False)
    with qc.Model(path, device="cuda") as m, m.session(max_context=32) as s:
        s.prefill([1, 2, 3])
        s.step(4)
        assert s.last_path == "graph"
    monkeypatch.setenv("QWENCUDA_DECODE", "persistent")
    with qc.Model(path, device="cuda:float") as m, m.session(max_context=32) as s:
        s.prefill([1, 2, 3])
        s.step(4)
        s.step(5)
        assert s.last_path == "graph"


def test_capture_and_prefill_run_op_by_op(synth, monkeypatch):
    path = synth("tiny-hd64", "q4_k_m")
    monkeypatch.setenv("QWENCUDA_DECODE", "persistent")
    with qc.Model(path, device="cuda") as m, m.session(max_context=32) as s:
        s.prefill([1, 2, 3])
        assert s.last_path == "ops"
        s.step(4)
        s.step(5)
        assert s.last_path == "persistent"
        tr = s.step(6, capture="blk.0.attn_out")
        assert s.last_path == "ops" and "blk.0.attn_out" in tr
        s.step(7)
        assert s.last_path == "persistent"


def test_long_f16_context_hands_over_to_flash_decode(synth, monkeypatch):
    """Past QC_KV_SHORT (3072) keys an F16 cache decodes with the flash kernels, op by op; an
    F32 cache keeps the split-K attention and so the persistent kernel."""
    path = synth("tiny-hd64", "q8_0")
    ids = np.random.default_rng(10).integers(0, 400, size=3080)
    monkeypatch.setenv("QWENCUDA_DECODE", "persistent")
    with qc.Model(path, device="cuda") as m:
        for kv_type, far in (("f16", "graph"), ("f32", "persistent")):
            with m.session(max_context=3100, kv_type=kv_type) as s:
                s.prefill(ids[:3060], logits=None)
                paths = []
                for t in ids[3060:3080]:
                    s.step(int(t))
                    paths.append(s.last_path)
                # step k sees 3061 + k keys: persistent up to 3072, then the far path
                assert paths[:12] == ["persistent"] * 12 and set(paths[12:]) == {far}, paths
    got = _steps(path, monkeypatch, ids, 3060, "f32", max_context=3100)
    np.testing.assert_array_equal(got[False][0], got[True][0])


@pytest.mark.parametrize("weight_type", ["q4_k_m", "q8_0"])
def test_qwen05b_greedy_and_sampled_tokens(synth, monkeypatch, weight_type):
    """The real 0.5B shapes (24 layers, 14/2 heads, ffn 4864, tied 151936-row lm_head): the
    device argmax and the device sampler after the persistent step draw the op-by-op tokens."""
    path = synth("qwen2.5-0.5b", weight_type)
    prompt = [9707, 11, 1879, 0, 576, 374, 264, 1273]
    runs = {}
    with qc.Model(path, device="cuda") as m:
        for ops in (False, True):
            toks, drawn = [], []
            with _session(m, monkeypatch, ops, max_context=128) as s:
                tr = s.prefill(prompt)
                for _ in range(40):
                    toks.append(int(tr.argmax[-1]))
                    tr = s.step(toks[-1])
                assert s.last_path == ("graph" if ops else "persistent")
            sp = qc.Sampler(m.config.n_vocab, temperature=0.9, top_p=0.95, seed=4)
            with _session(m, monkeypatch, ops, max_context=128) as s:
                tr = s.prefill(prompt, sampler=sp)
                for _ in range(40):
                    drawn.append(tr.token)
                    sp.accept(tr.token)
                    tr = s.step(tr.token, logits=None, sampler=sp)
            runs[ops] = (toks, drawn, tr.token)
    assert runs[False] == runs[True]
