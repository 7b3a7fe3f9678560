"""qkv_attention's one launch in a decode step (kernels/qkv_attention.cu: a layer's attention norm,
q, k, v, RoPE, cache write and attention in one kernel, RoPE's angles computed by the step's first
launch and read by the later layers') against the same step with matmul_qkv_rope and attention as
two ops (QWENCUDA_QKV_ATTENTION=0, read when a model's backend is made). The launch computes every
value with the two ops' device functions in their order, so the logits must be equal bit for bit
(tolerance 0): recorded and replayed or eager (QWENCUDA_NO_GRAPHS=1), every weight type with an
8-bit GEMV, head_dim 64 and 128, both cache types, clusters of 8 and 16 blocks
(QWENCUDA_ATT_CLUSTER); greedy and sampled tokens then follow, with the
next step queued on the device (feed_draw moves the position the angles were read for). Needs the
GPU machine."""
import os
import re

import numpy as np
import pytest

import qwencuda as qc
from qwencuda import testing

from engine_util import cuda_kernel_ran

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.gpu

Q8_TYPES = ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k", "q4_k_m"]


def _model(path, monkeypatch, one_launch, cluster=None):
    """The model on CUDA, its backend made with the one launch on or off (and its clusters of
    `cluster` blocks, QWENCUDA_ATT_CLUSTER, where given)."""
    with monkeypatch.context() as mp:
        mp.setenv("QWENCUDA_QKV_ATTENTION", "1" if one_launch else "0")
        if cluster:
            mp.setenv("QWENCUDA_ATT_CLUSTER", cluster)
        return qc.Model(path, device="cuda")


def _logits(path, monkeypatch, ids, n_prompt, kv_type, graphs, cluster=None):
    """Logits of every step after an n_prompt-token prefill, with and without the one launch."""
    out = []
    for one_launch in (True, False):
        with _model(path, monkeypatch, one_launch, cluster) as m:
            with monkeypatch.context() as mp:
                if not graphs:
                    mp.setenv("QWENCUDA_NO_GRAPHS", "1")
                s = m.session(max_context=96, kv_type=kv_type)
            with s:
                s.prefill(ids[:n_prompt])
                rows = [s.step(int(t)).logits[0].copy() for t in ids[n_prompt:]]
                assert s.last_path == ("graph" if graphs else "ops"), s.last_path
        out.append(np.array(rows))
    return out


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("weight_type", Q8_TYPES)
@pytest.mark.parametrize("config", ["tiny-hd64", "tiny-hd128"])
def test_step_equals_the_two_ops(tmp_path, monkeypatch, config, weight_type, kv_type):
    path = str(tmp_path / "m.gguf")
    testing.write_model(path, config=config, weight_type=weight_type)
    ids = np.random.default_rng(11).integers(0, 400, size=40)
    for graphs in (True, False):
        with_launch, two_ops = _logits(path, monkeypatch, ids, 6, kv_type, graphs)
        np.testing.assert_array_equal(with_launch, two_ops)


def _launch_ran(path, monkeypatch, ids, n_prompt, kernel="qc_qkv_attention_kernel", cluster=None):
    """Whether a decode step of the model with the one launch on ran a kernel whose name holds
    `kernel`, as the CUDA profiler (torch.profiler, CUPTI) sees it; None without torch. Eager steps
    (QWENCUDA_NO_GRAPHS=1), so that each kernel shows as itself."""
    with _model(path, monkeypatch, True, cluster) as m:
        with monkeypatch.context() as mp:
            mp.setenv("QWENCUDA_NO_GRAPHS", "1")
            s = m.session(max_context=96)
        with s:
            s.prefill(ids[:n_prompt])
            return cuda_kernel_ran(lambda: s.step(int(ids[n_prompt])), kernel)


# head_dim -> the kernel's template arguments before the cluster size (G lanes a key, the f16 cache);
# G = head_dim / QC_ATT_LANE_DIMS (kernels/qc_attention.cuh, qc_att_group_lanes)
_LANE_DIMS = int(re.search(r"#define QC_ATT_LANE_DIMS (\d+)",
                           open(os.path.join(ROOT, "kernels", "qc_attention.cuh")).read()).group(1))
_KERNEL_OF = {"tiny-hd64": f"qc_qkv_attention_kernel<{64 // _LANE_DIMS}, __half, 64, ",
              "tiny-hd128": f"qc_qkv_attention_kernel<{128 // _LANE_DIMS}, __half, 128, "}


@pytest.mark.parametrize("cluster", ["8", "16"])
@pytest.mark.parametrize("weight_type", ["q5_0", "q4_k"])
@pytest.mark.parametrize("config", ["tiny-hd64", "tiny-hd128"])
def test_both_cluster_sizes(tmp_path, monkeypatch, config, weight_type, cluster):
    """Clusters of 8 blocks of 512 threads and of 16 blocks of 256 (QWENCUDA_ATT_CLUSTER, read when
    the backend is made; both schedulable on the H100 and H200): the same rows per warp and the
    same splits, so the logits equal the two ops' bit for bit, recorded and eager; and the profiler
    sees the launch of that size (where torch is present), not the other."""
    path = str(tmp_path / "m.gguf")
    testing.write_model(path, config=config, weight_type=weight_type)
    ids = np.random.default_rng(13).integers(0, 400, size=24)
    for graphs in (True, False):
        with_launch, two_ops = _logits(path, monkeypatch, ids, 6, "f16", graphs, cluster)
        np.testing.assert_array_equal(with_launch, two_ops)
    other = "16" if cluster == "8" else "8"
    kernel = _KERNEL_OF[config]
    assert _launch_ran(path, monkeypatch, ids, 6, kernel + cluster + ", ", cluster) in (True, None)
    assert _launch_ran(path, monkeypatch, ids, 6, kernel + other + ", ", cluster) in (False, None)


# x's norm in the one launch quantizes four blocks of 32 a warp, 4 * 16 a pass in blocks of 16 warps
# (clusters of 8), 4 * 8 in blocks of 8 (clusters of 16) (qkv_attention.cu, qc_qa_norm_quantize):
# dim 832 (26 blocks: a warp with two blocks past the end) and dim 2176 (68 blocks: a second pass,
# and a third of 8 warps, which load their values and weights after the wait)
NORM_SHAPES = {
    "hd64-dim832": dict(n_vocab=400, dim=832, n_layer=2, n_head=13, n_head_kv=1, ffn_dim=256),
    "hd128-dim2176": dict(n_vocab=400, dim=2176, n_layer=2, n_head=17, n_head_kv=1, ffn_dim=256),
}


@pytest.mark.parametrize("cluster", ["8", "16"])
@pytest.mark.parametrize("weight_type", ["q8_0", "q5_0"])
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_step_equals_the_two_ops_norm_shapes(tmp_path, monkeypatch, shape, weight_type, cluster):
    """The norm's partial warp and later passes, in blocks of either size: the logits equal the two
    ops' bit for bit, and the one launch ran (the profiler, where torch is present: else the
    comparison could not fail)."""
    path = str(tmp_path / "m.gguf")
    testing.write_model(path, config=NORM_SHAPES[shape], weight_type=weight_type)
    ids = np.random.default_rng(12).integers(0, 400, size=24)
    for graphs in (True, False):
        with_launch, two_ops = _logits(path, monkeypatch, ids, 6, "f16", graphs, cluster)
        np.testing.assert_array_equal(with_launch, two_ops)
    assert _launch_ran(path, monkeypatch, ids, 6, "qc_qkv_attention_kernel", cluster) in (True, None)


def test_qwen05b_greedy_and_sampled_tokens(tmp_path, monkeypatch):
    """The real 0.5B shapes (24 layers, 14/2 heads): greedy tokens and the device sampler's draws,
    each next step queued before the host has seen the token."""
    shared = os.environ.get("QWENCUDA_SYNTH_DIR")   # scripts/gpu_check.sh shares the 0.5B files
    path = os.path.join(shared, "qwen05b-q4_k_m.gguf") if shared else str(tmp_path / "m.gguf")
    if not os.path.exists(path):
        part = f"{path}.{os.getpid()}.part"
        testing.write_model(part, config="qwen2.5-0.5b", weight_type="q4_k_m")
        os.replace(part, path)
    prompt = [9707, 11, 1879, 0, 576, 374, 264, 1273]
    runs = []
    for one_launch in (True, False):
        with _model(path, monkeypatch, one_launch) as m:
            toks, drawn = [], []
            with m.session(max_context=128) as s:
                tr = s.prefill(prompt)
                for _ in range(40):
                    toks.append(int(tr.argmax[-1]))
                    tr = s.step(toks[-1])
            sp = qc.Sampler(m.config.n_vocab, temperature=0.9, top_p=0.95, seed=4)
            with m.session(max_context=128) as s:
                tr = s.prefill(prompt, sampler=sp)
                for _ in range(40):
                    drawn.append(tr.token)
                    sp.accept(tr.token)
                    tr = s.step(tr.token, logits=None, sampler=sp)
            runs.append((toks, drawn, tr.token))
    assert runs[0] == runs[1]
