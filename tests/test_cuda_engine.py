"""The whole model on the CUDA backend against the CPU engine and the NumPy reference.

Tolerances (normalised max error: max |a - b| / max |b| over a captured tensor; attn_scores
must have -inf at the same places, and are compared on their finite values):
  - FP32_TOL for evals of at most 8 tokens (the CUDA matmul reads the stored blocks with fp32
    math, like the CPU) and for F32 / BF16 weights at any length (fp32 cuBLAS);
  - F16_TOL for longer evals with block formats or F16 weights: the CUDA prefill multiplies on
    tensor cores with f16 inputs (2^-11 relative rounding of activations and decoded weights),
    which Qwen2's large q/k biases amplify in the attention scores.
Real-size checks (0.5B shapes: greedy tokens equal to the CPU engine's, or the first difference
is a near-tie) need the GPU machine; so do the memory and error checks.

These are the exact paths: CUDA with an F32 KV cache (kv_type="f32") and its float GEMV
(device "cuda:float"), and the CPU's float32 reference kernels (device "cpu:float"). The 8-bit
GEMV of CUDA's default ("cuda": activations quantized as the CPU's fast kernels do) is checked
against the reference at test_engine_vs_reference.py's 8-bit tolerances
(test_q8_gemv_engine_matches_reference, below). The F16 cache and flash attention (CUDA's default) and the
CPU's 8-bit-activation kernels (its default) have tests of their own with their own tolerances
(test_long_context.py, test_kernels.py).
"""
import os

import gguf
import numpy as np
import pytest

import qwencuda
from qwencuda import kernels as K
from qwencuda import testing

from engine_util import cuda_kernel_ran, norm_err

FP32_TOL = 5e-4
F16_TOL = 5e-2

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """Where synthetic models are written; QWENCUDA_SYNTH_DIR shares them with scripts/gpu_check.sh."""
    d = os.environ.get("QWENCUDA_SYNTH_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        return d
    return str(tmp_path_factory.mktemp("synth"))


def synth(synth_dir, config, weight_type):
    name = "qwen05b" if config == "qwen2.5-0.5b" else config
    path = os.path.join(synth_dir, f"{name}-{weight_type}.gguf")
    if not os.path.exists(path):
        testing.write_model(path + ".part", config=config, weight_type=weight_type)
        os.replace(path + ".part", path)
    return path


def compare_traces(got, ref, tol, what):
    bad = []
    names = [k for k in ref.keys() if k != "argmax"]
    assert names, "nothing captured"
    for name in names:
        assert name in got, f"{what}: {name} missing"
        e = norm_err(got[name], ref[name])
        if not e <= tol:
            bad.append(f"{name}: {e:.3g}")
    e = norm_err(got.logits, ref.logits)
    if not e <= tol:
        bad.append(f"logits: {e:.3g}")
    assert not bad, f"{what}: tensors beyond {tol} (first in forward order): " + ", ".join(bad[:8])


def _ids(n, n_vocab, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).astype(np.int32)


def _tol(weight_type, n):
    return FP32_TOL if (n <= 8 or weight_type in ("f32", "bf16")) else F16_TOL


# --------------------------------------------------------------------------------------------
# three engines, every captured tensor


@pytest.mark.parametrize("n", [5, 20])
@pytest.mark.parametrize("weight_type", testing.WEIGHT_TYPES)
def test_three_engines_tiny(synth_dir, weight_type, n):
    path = synth(synth_dir, "tiny", weight_type)
    ids = _ids(n, 400, seed=n)
    with qwencuda.Model(path, device="cuda:float") as mc, qwencuda.Model(path, device="cpu:float") as mp:
        tc = mc.forward(ids, capture="*", logits="all", kv_type="f32")
        tp = mp.forward(ids, capture="*", logits="all")
    tr = qwencuda.reference.forward(path, ids, capture="*", logits="all")
    tol = _tol(weight_type, n)
    compare_traces(tc, tp, tol, f"cuda vs cpu ({weight_type}, n={n})")
    compare_traces(tc, tr, tol, f"cuda vs reference ({weight_type}, n={n})")
    assert tc["argmax"].dtype == np.int32


# the 8-bit tolerances of tests/test_engine_vs_reference.py (its docstring says why)
Q8_RTOL = 4e-2
Q8_ATOL = 5e-2


@pytest.mark.parametrize("weight_type", ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k", "q4_k_m"])
@pytest.mark.parametrize("config", ["tiny", "tiny-gqa7", "tiny-hd128"])
def test_q8_gemv_engine_matches_reference(synth_dir, config, weight_type):
    """CUDA's default ("cuda": the 8-bit GEMV, kernels/qc_gemv_q8.cuh) evaluated token by token
    (every matmul on 8-bit activations) against the reference: logits within the CPU 8-bit
    path's bounds, argmax equal where the top-two gap is clear; and the float GEMV
    ("cuda:float") on the same steps, which must be closer."""
    path = synth(synth_dir, config, weight_type)
    n_vocab = testing.CONFIGS[config]["n_vocab"]
    ids = _ids(12, n_vocab, seed=11)
    want = qwencuda.reference.forward(path, ids, logits="all").logits
    got = {}
    for dev in ("cuda", "cuda:float"):
        with qwencuda.Model(path, device=dev) as m, m.session(max_context=16, kv_type="f32") as s:
            rows = [s.prefill(ids[:1]).logits[-1]] + [s.step(int(t)).logits[0] for t in ids[1:]]
            got[dev] = np.array(rows)
    rel = np.linalg.norm(got["cuda"] - want) / np.linalg.norm(want)
    absn = norm_err(got["cuda"], want)
    assert rel <= Q8_RTOL and absn <= Q8_ATOL, (config, weight_type, rel, absn)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= 0.5
    np.testing.assert_array_equal(got["cuda"].argmax(-1)[clear], want.argmax(-1)[clear])
    assert norm_err(got["cuda:float"], want) <= FP32_TOL
    # the 8-bit path really ran: its error is that of 8-bit activations, far above fp32's
    assert absn > 10 * norm_err(got["cuda:float"], want), (absn, norm_err(got["cuda:float"], want))


@pytest.mark.parametrize("weight_type", ["f32", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("config", ["tiny-gqa1", "tiny-gqa7", "tiny-hd64", "tiny-hd128", "tiny-oddvocab"])
def test_three_engines_shapes(synth_dir, config, weight_type):
    path = synth(synth_dir, config, weight_type)
    n_vocab = testing.CONFIGS[config]["n_vocab"]
    for n in (3, 12):
        ids = _ids(n, n_vocab, seed=n)
        with qwencuda.Model(path, device="cuda:float") as mc:
            tc = mc.forward(ids, capture="*", logits="all", kv_type="f32")
        with qwencuda.Model(path, device="cpu:float") as mp:
            tp = mp.forward(ids, capture="*", logits="all")
        tr = qwencuda.reference.forward(path, ids, capture="*", logits="all")
        tol = _tol(weight_type, n)
        compare_traces(tc, tp, tol, f"cuda vs cpu ({config} {weight_type} n={n})")
        compare_traces(tc, tr, tol, f"cuda vs reference ({config} {weight_type} n={n})")


@pytest.mark.parametrize("weight_type", ["f16", "q4_k_m"])
def test_decode_steps_match_cpu(synth_dir, weight_type):
    """Prefill then single steps: the KV cache, positions and the n = 1 GEMV path."""
    path = synth(synth_dir, "tiny-gqa7", weight_type)
    ids = _ids(14, 400, seed=3)
    traces = {}
    for dev in ("cuda", "cpu"):
        with qwencuda.Model(path, device=dev + ":float") as m, \
                m.session(max_context=64, kv_type="f32") as s:
            out = [s.prefill(ids[:6], capture="blk.*", logits="last")]
            for t in ids[6:]:
                out.append(s.step(int(t), capture="blk.*"))
            traces[dev] = out
    ref = qwencuda.reference.forward_steps(path, ids, 6, capture="blk.*")
    for i, (a, b, r) in enumerate(zip(traces["cuda"], traces["cpu"], ref)):
        compare_traces(a, b, FP32_TOL, f"step {i} cuda vs cpu")
        compare_traces(a, r, FP32_TOL, f"step {i} cuda vs reference")


@pytest.mark.parametrize("weight_type", ["f32", "q4_k_m"])
def test_replayed_decode_equals_op_by_op(synth_dir, weight_type):
    """A decode step without capture is recorded once as a CUDA graph and replayed; with capture
    it runs op by op. Both must give the same logits at every step, also after a longer
    prefill regrows the scratch buffers (which drops the recording) and after a rewind."""
    path = synth(synth_dir, "tiny-gqa7", weight_type)
    ids = [int(t) for t in _ids(60, 400, seed=5)]
    with qwencuda.Model(path, device="cuda") as m:
        with m.session(max_context=128) as fast, m.session(max_context=128) as plain:
            def both(prefill, steps):
                for s in (fast, plain):
                    s.prefill(prefill)
                for t in steps:
                    a = fast.step(t).logits
                    b = plain.step(t, capture="embed").logits     # capture: no replay
                    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
            both(ids[:4], ids[4:12])             # first step records, the rest replay
            both(ids[12:52], ids[52:56])         # 40-token prefill regrows the scratch
            for s in (fast, plain):
                s.rewind(3)
            both([ids[56]], ids[57:60])


@pytest.mark.parametrize("weight_type", ["f16", "q4_k_m"])
def test_dependent_launches_change_no_bit(synth_dir, weight_type, monkeypatch):
    """On sm_90+ every op kernel is a programmatic dependent launch (kernels/qc_cuda.cuh): it
    starts early and waits on the GPU for its inputs. That moves when work starts, never what it
    computes: prefill and replayed decode steps give the same logits, bit for bit, as a backend
    made with QWENCUDA_PDL=0 (plain launches). A kernel that read its inputs before its wait
    would race and differ."""
    path = synth(synth_dir, "tiny-gqa7", weight_type)
    ids = [int(t) for t in _ids(40, 400, seed=9)]

    def run():
        with qwencuda.Model(path, device="cuda") as m, m.session(max_context=64) as s:
            out = [s.prefill(ids[:30], logits="all").logits]
            out += [s.step(t).logits for t in ids[30:]]
            return out

    monkeypatch.setenv("QWENCUDA_PDL", "0")
    plain = run()
    monkeypatch.delenv("QWENCUDA_PDL")
    for a, b in zip(run(), plain):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("config,weight_type", [("tiny-gqa7", "q4_k_m"), ("tiny-gqa7", "q5_0"), ("tiny-gqa7", "q4_0"),
                                                  ("tiny-hd64", "q8_0"), ("tiny-hd64", "q6_k"), ("tiny-hd128", "q4_k_m")])
def test_weights_in_shared_memory_change_no_bit(synth_dir, config, weight_type, monkeypatch):
    """A decode step's GEMV blocks (one wave of them: q/k/v aside, the o and down projections and
    the 32-row gate/up kernel) copy their weight rows into shared memory before they wait for
    their inputs, and read them there (kernels/qc_cuda.cuh: qc_copy_to_shared). The bytes are the
    same, so the logits must be too, bit for bit, against a backend made with
    QWENCUDA_WEIGHTS_SHARED=0 (rows read from global memory). A copy that missed the head or the
    tail of a block's rows (Q5_0 and Q6_K rows are not 16-byte aligned), or was read before it
    landed, would differ. The copies are taken on sm_90+ only (cu->w_shared): elsewhere both runs
    would read global memory, so the test skips there."""
    if qwencuda.kernels.cuda_device_info(0)["compute_capability"] < (9, 0):
        pytest.skip("the weight copies are taken on sm_90+ only")
    path = synth(synth_dir, config, weight_type)
    ids = [int(t) for t in _ids(24, 400, seed=13)]

    def run():
        with qwencuda.Model(path, device="cuda") as m, m.session(max_context=32) as s:
            s.prefill(ids[:12], logits=None)
            return [s.step(t).logits for t in ids[12:]]

    monkeypatch.setenv("QWENCUDA_WEIGHTS_SHARED", "0")
    plain = run()
    monkeypatch.delenv("QWENCUDA_WEIGHTS_SHARED")
    for a, b in zip(run(), plain):
        np.testing.assert_array_equal(a, b)


def _long_eval_logits(path, ids, n_prompt):
    """Logits of a fresh CUDA model (its backend made now, under the environment's switches): a
    prefill of n_prompt tokens, a 3-token eval (each token with the others' new keys past its own
    position), then a decode step for each id after those."""
    with qwencuda.Model(path, device="cuda") as m, m.session(max_context=n_prompt + 16) as s:
        s.prefill(ids[:n_prompt], logits=None)
        out = [s.prefill(ids[n_prompt:n_prompt + 3], logits="all").logits]
        return out + [s.step(t).logits for t in ids[n_prompt + 3:]]


@pytest.mark.parametrize("config,n_prompt", [("tiny-hd64", 21), ("tiny-hd64", 600), ("tiny-hd128", 1600)])
def test_held_keys_change_no_bit(synth_dir, config, n_prompt, monkeypatch):
    """The decode attention's cluster blocks load the K and V rows of their groups' first keys
    (those before every position of the eval) into registers before they wait for the q/k/v
    kernel, and start their loop with them (kernels/attention.cu: QC_ATT_HELD); later keys, and
    the eval's own new keys, come from the cache. Same keys, same order, so the logits must be
    bit-equal to a backend made with QWENCUDA_ATTENTION_HOLD=0 (every key from the cache). A
    held key that was another key, or one that this eval writes, would differ: a short eval of
    3 tokens (each with the others' new keys past its own position) and steps after it, at 21
    keys (fewer than a group each), 600 (head_dim 64: two or three keys a group, two held) and
    1600 (head_dim 128: 12 or 13 a group, two held). Taken on sm_90+ only (clusters)."""
    if qwencuda.kernels.cuda_device_info(0)["compute_capability"] < (9, 0):
        pytest.skip("the held keys are taken on sm_90+ only")
    path = synth(synth_dir, config, "q8_0")
    ids = [int(t) for t in _ids(n_prompt + 12, 400, seed=29)]

    monkeypatch.setenv("QWENCUDA_ATTENTION_HOLD", "0")
    plain = _long_eval_logits(path, ids, n_prompt)
    monkeypatch.delenv("QWENCUDA_ATTENTION_HOLD")
    for a, b in zip(_long_eval_logits(path, ids, n_prompt), plain):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("hold", ["1", "0"])
@pytest.mark.parametrize("config,n_prompt", [("tiny-hd64", 1500), ("tiny-hd128", 1600)])
def test_cluster_attention_equals_the_split_kernel(synth_dir, config, n_prompt, hold, monkeypatch):
    """The decode attention of the cluster kernels (kernels/attention.cu's, and qkv_attention.cu's
    one launch) against the split kernel that a backend made with QWENCUDA_CLUSTERS=0 runs: the
    same keys a group in the same order with the same arithmetic, the splits merged in the same
    order, so a 3-token eval and the decode steps after it must give the same logits bit for bit.
    Long enough that every group walks a loop after its held keys: 1500 keys (head_dim 64: 5 or 6 a
    group) and 1600 (head_dim 128: 12 or 13 a group), with the first two held before the wait and
    without (QWENCUDA_ATTENTION_HOLD=0: every key through qc_att_keys_ahead). A key taken out of
    turn, or a split merged out of order, would differ here. Taken on sm_90+ only (clusters)."""
    if qwencuda.kernels.cuda_device_info(0)["compute_capability"] < (9, 0):
        pytest.skip("the cluster kernels are taken on sm_90+ only")
    path = synth(synth_dir, config, "q8_0")
    ids = [int(t) for t in _ids(n_prompt + 12, 400, seed=37)]
    monkeypatch.setenv("QWENCUDA_ATTENTION_HOLD", hold)

    monkeypatch.setenv("QWENCUDA_CLUSTERS", "0")
    split = _long_eval_logits(path, ids, n_prompt)
    monkeypatch.delenv("QWENCUDA_CLUSTERS")
    for a, b in zip(_long_eval_logits(path, ids, n_prompt), split):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("config,weight_type", [("tiny-gqa7", "q4_k_m"), ("tiny-hd64", "q8_0"), ("tiny-hd128", "q5_0")])
def test_read_ahead_changes_no_bit(synth_dir, config, weight_type, monkeypatch):
    """The forward pass hints gate and up to the o projection and the next layer's q, k and v to
    the down projection (backend.h, read_ahead), whose blocks ask L2 for them while they wait
    (kernels/matmul.cu, qc_l2_ahead_issue); qkv_attention then leaves out its own row prefetches
    (kernels/qkv_attention.cu). A hint moves bytes into the cache and changes no value, so
    prefill, a 3-token eval and decode steps must give the logits of a backend made with
    QWENCUDA_READ_AHEAD=0 bit for bit. A hint that reached
    the wrong kernel parameter (a pointer or a size in the place of another) would show here;
    that the lines were fetched early shows only in the timing (bench/results, the report of the
    commit)."""
    path = synth(synth_dir, config, weight_type)
    ids = [int(t) for t in _ids(40, 400, seed=31)]

    def run():
        with qwencuda.Model(path, device="cuda") as m, m.session(max_context=48) as s:
            out = [s.prefill(ids[:21], logits="all").logits, s.prefill(ids[21:24], logits="all").logits]
            return out + [s.step(t).logits for t in ids[24:]]

    monkeypatch.setenv("QWENCUDA_READ_AHEAD", "0")
    plain = run()
    monkeypatch.delenv("QWENCUDA_READ_AHEAD")
    for a, b in zip(run(), plain):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"])
def test_split_rows_change_no_bit(type_name, monkeypatch):
    """A one-token matmul of long rows (2048 columns or more: the down projection) computes each
    row with the warps of a block, their slices added in warp order (kernels/matmul.cu), two rows a
    block by default (qc_gemv_q8_split_rows_kernel, both rows copied into shared memory as one
    piece), one with QWENCUDA_SPLIT_ROWS=0 (qc_gemv_kernel). Each row's operations are the same, so
    matmul and matmul_add must give the same bits either way: 896 and 901 rows (a last block of one
    row), 4864 and 2048 columns (Q4_K and Q6_K rows not 16-byte aligned: 2736 and 3990 bytes at
    4864), with a bias and a residual. Where torch is present its profiler must see the two-row
    kernel run by default on sm_90+ (where the weight copies are taken; elsewhere both are one row
    a block) and not with QWENCUDA_SPLIT_ROWS=0."""
    rng = np.random.default_rng(43)
    cases = []
    for rows, cols in [(896, 4864), (901, 2048)]:
        w = K.Weight.from_float(rng.standard_normal((rows, cols)).astype(np.float32), type_name)
        x, bias, res = (rng.standard_normal(shape).astype(np.float32) for shape in (cols, rows, rows))
        cases.append((w, x, bias, res))
    sm90 = qwencuda.kernels.cuda_device_info(0)["compute_capability"] >= (9, 0)
    type_id = int(gguf.GGMLQuantizationType[type_name])

    def run():
        K.release("cuda")   # the kernels' backend is made again, reading the switch
        got = [(K.matmul(w, x, bias=b, device="cuda"), K.matmul_add(w, x, r, device="cuda")) for w, x, b, r in cases]
        w, x, _, _ = cases[0]
        return got, cuda_kernel_ran(lambda: K.matmul(w, x, device="cuda"), f"qc_gemv_q8_split_rows_kernel<{type_id}, 2>")

    monkeypatch.setenv("QWENCUDA_SPLIT_ROWS", "0")
    one, ran = run()
    assert ran in (None, False)
    monkeypatch.delenv("QWENCUDA_SPLIT_ROWS")
    two, ran = run()
    assert ran in (None, sm90)
    for (mm, ma), (pm, pa), (w, _, _, _) in zip(two, one, cases):
        np.testing.assert_array_equal(mm, pm, err_msg=f"matmul {w}")
        np.testing.assert_array_equal(ma, pa, err_msg=f"matmul_add {w}")
    K.release("cuda")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q6_K"])
def test_gemv_rows4_changes_no_bit(type_name, monkeypatch):
    """A one-token matmul of more rows than one wave of GEMV blocks (the lm_head) takes four rows a
    warp (kernels/matmul.cu, qc_gemv_q8_rows4_kernel: qc_gemv_q8_row4, each row with
    qc_gemv_q8_row_slice's operations) for the 32-element types, and on sm_90+ each block first
    copies its 32 rows into shared memory (qc_copy_to_shared; Q5_0 and Q4_0 rows are not 16-byte
    aligned, and the last block has a single row). Its rows must equal, bit for bit, the first
    token's of a two-token matmul (qc_gemv_kernel, two tokens a block: the same operations per
    token), a backend made with QWENCUDA_GEMV_ROWS4=0 and one made with QWENCUDA_WEIGHTS_SHARED=0
    (the four-row kernel reading global memory); matmul_add's too. 9001 rows (a last warp with one
    row, a last block of three warps), 896 (1024 for Q4_K and Q6_K, rows of whole blocks of 256)
    and 256 columns, with a bias. Q4_K and Q6_K keep qc_gemv_kernel: the same checks hold. Equal
    bits alone would pass if a kernel were never taken, so where torch is present its profiler
    (CUPTI) must also see the four-row kernel run, for the 32-element types only and not with
    QWENCUDA_GEMV_ROWS4=0, and its shared-memory instantiation (<type, true>) by default on sm_90+
    but not with QWENCUDA_WEIGHTS_SHARED=0."""
    rng = np.random.default_rng(41)
    cases = []
    for rows, cols in [(9001, 896 if type_name in ("Q8_0", "Q5_0", "Q4_0") else 1024), (9001, 256)]:
        w = K.Weight.from_float(rng.standard_normal((rows, cols)).astype(np.float32), type_name)
        x, bias, res = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, cols), rows, rows))
        cases.append((w, x, bias, res))
    rows4_types = ("Q8_0", "Q5_0", "Q4_0")
    sm90 = qwencuda.kernels.cuda_device_info(0)["compute_capability"] >= (9, 0)
    # the kernel's template arguments as the profiler names them: the GGUF type number, SH
    type_id = int(gguf.GGMLQuantizationType[type_name])

    def run():
        K.release("cuda")   # the kernels' backend is made again, reading the switches
        return [(K.matmul(w, x[0], bias=b, device="cuda"), K.matmul_add(w, x[0], r, device="cuda"))
                for w, x, b, r in cases]

    def ran(kernel):
        """Whether a one-token matmul of the first case ran `kernel` (None: no torch)."""
        w, x, _, _ = cases[0]
        return cuda_kernel_ran(lambda: K.matmul(w, x[0], device="cuda"), kernel)

    monkeypatch.setenv("QWENCUDA_GEMV_ROWS4", "0")
    plain = run()
    assert ran("qc_gemv_q8_rows4_kernel") in (None, False)
    monkeypatch.delenv("QWENCUDA_GEMV_ROWS4")
    monkeypatch.setenv("QWENCUDA_WEIGHTS_SHARED", "0")
    from_global = run()
    assert ran(f"qc_gemv_q8_rows4_kernel<{type_id}, true, false>") in (None, False)
    assert ran(f"qc_gemv_q8_rows4_kernel<{type_id}, false, false>") in (None, type_name in rows4_types)
    monkeypatch.delenv("QWENCUDA_WEIGHTS_SHARED")
    got = run()
    assert ran(f"qc_gemv_q8_rows4_kernel<{type_id}, true, false>") in (None, sm90 and type_name in rows4_types)
    for (mm, ma), (pm, pa), (gm, ga), (w, x, b, r) in zip(got, plain, from_global, cases):
        np.testing.assert_array_equal(mm, pm, err_msg=f"matmul {w}")
        np.testing.assert_array_equal(ma, pa, err_msg=f"matmul_add {w}")
        np.testing.assert_array_equal(mm, gm, err_msg=f"matmul, rows from global memory {w}")
        np.testing.assert_array_equal(ma, ga, err_msg=f"matmul_add, rows from global memory {w}")
        np.testing.assert_array_equal(mm, K.matmul(w, x, bias=b, device="cuda")[0], err_msg=f"two tokens {w}")
    K.release("cuda")


@pytest.mark.parametrize("config", ["tiny-hd64", "tiny-hd128"])
@pytest.mark.parametrize("weight_type", ["q8_0", "q4_k_m"])
def test_attention_hands_its_8bit_output_to_o(synth_dir, config, weight_type):
    """A decode step's split-K attention also writes its output's 8-bit blocks, and the o
    projection reads them instead of quantizing att in a launch of its own (kernels/attention.cu,
    matmul.cu: cu->q8x_of). A capture of the attention scores runs another attention in between,
    so the same steps then quantize att themselves. Both must give the same logits, bit for bit:
    a hand-off that read another layer's blocks, or blocks quantized differently, would not.
    (The bits cannot show that the hand-off ran at all; the decode timeline does: 25 quantize
    launches a 0.5B step instead of 49, bench/results/20261124-ad009bb-*.)"""
    path = synth(synth_dir, config, weight_type)
    ids = [int(t) for t in _ids(24, 400, seed=11)]

    def run(capture):
        with qwencuda.Model(path, device="cuda") as m, m.session(max_context=32) as s:
            s.prefill(ids[:16], logits=None)
            return [s.step(t, capture=capture).logits for t in ids[16:]]

    handed = run(None)
    for a, b in zip(handed, run("blk.*.attn_scores")):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# 0.5B shapes: greedy generation against the CPU engine


def _greedy(path, device, prompt, n_new, max_context=512):
    toks, logits = [], []
    with qwencuda.Model(path, device=device) as m, m.session(max_context=max_context) as s:
        tr = s.prefill(prompt, logits="last")
        for _ in range(n_new):
            t = int(tr.argmax[-1])
            toks.append(t)
            logits.append(tr.logits[-1].copy())
            tr = s.step(t)
    return toks, logits


@pytest.mark.parametrize("weight_type", ["f16", "q8_0", "q4_k_m"])
def test_qwen05b_greedy_matches_cpu(synth_dir, weight_type, record_property):
    """Prefill 128 tokens, then 64 greedy steps: the same tokens as the CPU engine, or the first
    difference is a near-tie of the CPU's own logits (both logits reported)."""
    path = synth(synth_dir, "qwen2.5-0.5b", weight_type)
    prompt = _ids(128, 151936, seed=5)
    tc, lc = _greedy(path, "cuda:float", prompt, 64)
    tp, lp = _greedy(path, "cpu:float", prompt, 64)   # the CPU's float32 reference kernels
    record_property("tokens_equal", tc == tp)      # lands in the junit report of gpu_check.sh
    if tc != tp:
        i = next(k for k in range(len(tc)) if tc[k] != tp[k])
        a, b = tp[i], tc[i]
        gap = float(lp[i][a] - lp[i][b])
        msg = (f"{weight_type}: first difference at step {i}: cpu {a} (cpu logit {lp[i][a]:.5f}, cuda "
               f"{lc[i][a]:.5f}) vs cuda {b} (cpu logit {lp[i][b]:.5f}, cuda {lc[i][b]:.5f}); cpu gap {gap:.5f}")
        print(msg)
        record_property("first_difference", msg)
        assert gap <= 0.05 * max(1.0, float(np.std(lp[i]))), msg
    # logits of the first step agree closely
    assert norm_err(lc[0], lp[0]) <= (FP32_TOL if weight_type == "f32" else F16_TOL)


def test_real_model_greedy_matches_cpu(real_model_path):
    prompt = qwencuda.Model(real_model_path, device="cpu").tokenizer.encode(
        "Write a haiku about GPUs.\n")
    tc, lc = _greedy(real_model_path, "cuda:float", prompt, 32)
    tp, lp = _greedy(real_model_path, "cpu:float", prompt, 32)
    if tc != tp:
        i = next(k for k in range(len(tc)) if tc[k] != tp[k])
        gap = float(lp[i][tp[i]] - lp[i][tc[i]])
        assert gap <= 0.05 * max(1.0, float(np.std(lp[i]))), f"step {i}: cpu {tp[i]} vs cuda {tc[i]}, gap {gap}"


# --------------------------------------------------------------------------------------------
# memory and errors


def test_load_close_20_times_returns_memory(synth_dir):
    path = synth(synth_dir, "tiny-hd128", "f32")   # ~5.5 MB of weights: a leak shows
    ids = _ids(12, 400)

    def cycle():
        with qwencuda.Model(path, device="cuda") as m:
            m.forward(ids, capture="blk.0.*", logits="all")

    cycle()   # first use: CUDA context, cuBLAS workspace, module loading
    free0, _ = qwencuda.kernels.cuda_mem_info(0)
    for _ in range(20):
        cycle()
    free1, _ = qwencuda.kernels.cuda_mem_info(0)
    assert free1 >= free0 - (16 << 20), f"GPU memory lost over 20 load/close cycles: {(free0 - free1) >> 20} MiB"


def test_out_of_memory_is_memory_error_and_recoverable(synth_dir):
    path = synth(synth_dir, "tiny", "q8_0")
    with qwencuda.Model(path, device="cuda") as m:
        with pytest.raises((MemoryError, ValueError)) as ei:
            m.session(max_context=2**31 - 1)          # TiBs of KV cache
        if isinstance(ei.value, MemoryError):
            assert "cudaMalloc" in str(ei.value) and "KV cache" in str(ei.value)
        # the backend is still usable
        tr = m.forward(_ids(4, 400), logits="last")
        assert np.isfinite(tr.logits).all()


def test_bad_device_ordinal(synth_dir):
    path = synth(synth_dir, "tiny", "f32")
    n = qwencuda.build_info()["cuda_devices"]
    with pytest.raises(qwencuda.CudaError, match=f"cuda:{n}"):
        qwencuda.Model(path, device=f"cuda:{n}")
