"""qwencuda.synthetic: random well-formed files of the real Qwen2.5 sizes, checked with outside
oracles: the gguf package reads them (tensor table, dequantized values), llama.cpp's own
llama-quantize picks the same Q4_K_M types, the engine agrees with the NumPy reference on them;
and the engine's refusal of a model that does not fit (MemoryError with its size)."""
import hashlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import qwencuda as qc
from qwencuda import synthetic as sy
from engine_util import compare_traces

gguf = pytest.importorskip("gguf")

# test_engine_vs_reference's float32 tolerances (device "cpu:float": both engines in float32)
RTOL = 1e-4
ATOL = 1e-3
IDS = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327, 95]
LLAMA_CPP = os.environ.get("QWENCUDA_LLAMA_CPP_BUILD",
                           "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-cpu/bin")


def _reader(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def _np_shape(t):
    return tuple(int(x) for x in reversed(t.shape))


def test_real_shapes():
    # Qwen2.5 config.json values (hidden_size, layers, heads, kv heads, intermediate, vocab, tied)
    want = {"0.5B": (896, 24, 14, 2, 4864, 151936, True), "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
            "3B": (2048, 36, 16, 2, 11008, 151936, True), "7B": (3584, 28, 28, 4, 18944, 152064, False),
            "14B": (5120, 48, 40, 8, 13824, 152064, False), "32B": (5120, 64, 40, 8, 27648, 152064, False),
            "72B": (8192, 80, 64, 8, 29568, 152064, False)}
    for name, (d, l, h, kv, f, v, tied) in want.items():
        c = sy.resolve_shape(name)
        assert (c["dim"], c["n_layer"], c["n_head"], c["n_head_kv"], c["ffn_dim"], c["n_vocab"], c["tied"]) \
            == (d, l, h, kv, f, v, tied), name
        assert c["head_dim"] == (64 if name == "0.5B" else 128)
    with pytest.raises(ValueError, match="unknown shape"):
        sy.resolve_shape("13B")


def test_sizes_of_published_files():
    # File sizes of the Qwen2.5 GGUFs (Qwen/Qwen2.5-*-Instruct-GGUF, bartowski's): the tensor data
    # comes within 1% of them (the published files are a little larger: their vocabulary metadata).
    for shape, wtype, gb in [("7B", "q4_k_m", 4.68), ("14B", "q4_k_m", 8.99), ("7B", "f16", 15.2),
                             ("72B", "q4_k_m", 47.4)]:
        assert abs(sy.model_bytes(shape, wtype) / 1e9 - gb) / gb < 0.01, (shape, wtype, sy.model_bytes(shape, wtype))


@pytest.mark.parametrize("wtype", list(qc.testing.WEIGHT_TYPES))
@pytest.mark.parametrize("config", ["tiny-hd64", "tiny"])
def test_file_reads_and_matches_plan(tmp_path, config, wtype):
    path = sy.write_random_model(tmp_path / "m.gguf", config, wtype)
    plan = sy.plan_random_model(config, wtype)
    r, tensors = _reader(path)
    assert [t.name for t in r.tensors] == [n for n, _, _ in plan]
    f = qc.GGUFFile(path)
    cfg = qc.testing.resolve_config(config)
    for name, shape, typ in plan:
        t = tensors[name]
        assert _np_shape(t) == shape and t.tensor_type.name == typ, name
        assert f.tensor(name).shape == shape
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float64)
        assert np.isfinite(w).all(), name
        if len(shape) == 2:
            # the std write_model uses, the mean near zero
            want = 0.02 if name.startswith(("token_embd", "output")) else 1 / np.sqrt(shape[1])
            assert 0.75 < w.std() / want < 1.25, (name, typ, w.std(), want)
            assert abs(w.mean()) < 0.1 * want + 3 * want / np.sqrt(w.size), (name, typ, w.mean())
    assert r.fields["general.architecture"].contents() == "qwen2"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == cfg["n_vocab"]
    # the same 1-D tensors as write_model (norms, the large q/k biases)
    ref = qc.testing.write_model(tmp_path / "ref.gguf", config, "f32")
    _, rt = _reader(ref)
    for name, shape, _ in plan:
        if len(shape) == 1:
            np.testing.assert_array_equal(np.asarray(tensors[name].data), np.asarray(rt[name].data))


@pytest.mark.parametrize("wtype", list(qc.testing.WEIGHT_TYPES))
def test_engine_matches_reference(tmp_path, wtype):
    """Finite logits, and the C engine (float32 ops) agrees with the NumPy reference on every
    capture at test_engine_vs_reference's tolerances."""
    path = sy.write_random_model(tmp_path / "m.gguf", "tiny-hd128", wtype, seed=3)
    want = qc.reference.forward(qc.reference.load(path), IDS, capture="*", logits="all")
    with qc.Model(path, device="cpu:float", threads=1) as m:
        got = m.forward(IDS, capture="*", logits="all")
    assert np.isfinite(got.logits).all()
    assert 0.3 < got.logits.std() < 30   # logits of a few units, as the real model's
    compare_traces(got, want, RTOL, ATOL)
    top2 = np.sort(want.logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= 1e-3
    np.testing.assert_array_equal(got.argmax[clear], want.argmax[clear])


@pytest.mark.parametrize("wtype", ["f16", "bf16", "q8_0", "q4_k_m"])
def test_pooled_chunks(tmp_path, monkeypatch, wtype):
    """The large-tensor path (chunks cut from the pool) on a small model: a small pool, several
    chunks per tensor; the file reads, the engine agrees with the reference, a second write is
    the same file, another seed another."""
    monkeypatch.setattr(sy, "_FRESH_BYTES", 0)
    monkeypatch.setattr(sy, "_POOL_BYTES", 1 << 16)
    monkeypatch.setattr(sy, "_CHUNK_BYTES", 5000)
    digests = []
    for i, seed in enumerate([0, 0, 1]):
        path = sy.write_random_model(tmp_path / f"m{i}.gguf", "tiny-hd64", wtype, seed=seed)
        digests.append(hashlib.sha256(open(path, "rb").read()).hexdigest())
    assert digests[0] == digests[1] != digests[2]
    path = str(tmp_path / "m0.gguf")
    _, tensors = _reader(path)
    w = gguf.quants.dequantize(np.asarray(tensors["blk.0.ffn_down.weight"].data),
                               tensors["blk.0.ffn_down.weight"].tensor_type)
    assert 0.75 < w.std() * np.sqrt(512) < 1.25
    want = qc.reference.forward(qc.reference.load(path), IDS, logits="all")
    with qc.Model(path, device="cpu:float", threads=1) as m:
        got = m.forward(IDS, logits="all")
    compare_traces({"logits": got.logits}, {"logits": want.logits}, RTOL, ATOL)


def _use_more_bits_layers(n):
    # llama.cpp's rule, spelled out independently: first and last eighth, every third between
    return {i for i in range(n) if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2}


def test_q4_k_m_mix_of_real_shapes():
    plan = {n: t for n, _, t in sy.plan_random_model("7B", "q4_k_m")}
    assert plan["output.weight"] == "Q6_K" and plan["token_embd.weight"] == "Q4_K"
    six = {i for i in range(28) if plan[f"blk.{i}.attn_v.weight"] == "Q6_K"}
    assert six == {i for i in range(28) if plan[f"blk.{i}.ffn_down.weight"] == "Q6_K"}
    assert six == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27} == _use_more_bits_layers(28)
    assert {t for n, t in plan.items() if re.search(r"(attn_[qko]|attn_output|ffn_gate|ffn_up)\.weight", n)} == {"Q4_K"}
    # the 0.5B: rows of 896 are not whole 256-blocks: llama.cpp's fallbacks (as in the real file)
    plan = {n: t for n, _, t in sy.plan_random_model("0.5B", "q4_k_m")}
    assert plan["token_embd.weight"] == "Q8_0" and "output.weight" not in plan
    assert plan["blk.0.attn_q.weight"] == "Q5_0" and plan["blk.0.attn_v.weight"] == "Q8_0"
    assert plan["blk.0.ffn_down.weight"] == "Q6_K" and plan["blk.4.ffn_down.weight"] == "Q4_K"
    # 72B: ffn 29568 is not whole 256-blocks either
    plan = {n: t for n, _, t in sy.plan_random_model("72B", "q4_k_m")}
    assert plan["blk.0.ffn_down.weight"] == "Q8_0" and plan["blk.11.ffn_down.weight"] == "Q5_0"
    for wtype in ("f16", "q8_0"):
        types = {t for _, s, t in sy.plan_random_model("7B", wtype) if len(s) == 2}
        assert types == {wtype.upper()}


@pytest.mark.skipif(not os.path.exists(os.path.join(LLAMA_CPP, "llama-quantize")),
                    reason="llama.cpp's llama-quantize is not built (QWENCUDA_LLAMA_CPP_BUILD)")
@pytest.mark.parametrize("config", [
    dict(n_vocab=400, dim=256, n_layer=16, n_head=2, n_head_kv=1, ffn_dim=512, tied=False),
    dict(n_vocab=400, dim=256, n_layer=12, n_head=2, n_head_kv=1, ffn_dim=512, tied=True),
    dict(n_vocab=400, dim=64, n_layer=9, n_head=4, n_head_kv=2, ffn_dim=256, tied=False),
    dict(n_vocab=400, dim=64, n_layer=5, n_head=4, n_head_kv=2, ffn_dim=256, tied=True),
])
def test_q4_k_m_mix_equals_llama_quantize(tmp_path, config):
    """llama.cpp's own Q4_K_M quantization of an F16 file picks, tensor by tensor, the types of
    plan_random_model."""
    src = sy.write_random_model(tmp_path / "f16.gguf", config, "f16")
    dst = tmp_path / "q4km.gguf"
    env = dict(os.environ, LD_LIBRARY_PATH=LLAMA_CPP)
    out = subprocess.run([os.path.join(LLAMA_CPP, "llama-quantize"), str(src), str(dst), "Q4_K_M", "1"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    _, tensors = _reader(str(dst))
    got = {n: t.tensor_type.name for n, t in tensors.items()}
    assert got == {n: t for n, _, t in sy.plan_random_model(config, "q4_k_m")}


def test_write_failure_removes_the_file(tmp_path):
    with pytest.raises(ValueError):
        sy.write_random_model(tmp_path / "m.gguf", "tiny", "q4_k_m", vocab=(["a"], [1], [], {}))
    assert not os.path.exists(tmp_path / "m.gguf")


def test_memory_needed():
    m = sy.memory_needed("7B", "f16", n_ctx=32768)
    assert m["kv_cache"] == 2 * 28 * 32768 * 4 * 128 * 2   # K and V, f16
    assert m["weights"] == sy.model_bytes("7B", "f16") and m["total"] == m["weights"] + m["kv_cache"]


# --------------------------------------------------------------------------------------------
# A model that does not fit: MemoryError with its size, nothing left allocated, the process usable

def _cpu_backend_bytes(path):
    """What the CPU backend copies: every 1-D tensor (norms, biases) as float32; the matrices are
    read from the file mapping. From the gguf package's tensor table."""
    r, _ = _reader(path)
    return sum(4 * int(np.prod(t.shape)) for t in r.tensors if len(t.shape) == 1)


def test_memory_limit_refuses_with_the_size(tmp_path, monkeypatch):
    path = sy.write_random_model(tmp_path / "m.gguf", "tiny-gqa7", "q8_0")
    need = _cpu_backend_bytes(path)
    monkeypatch.setenv("QWENCUDA_MEMORY_LIMIT", str(need - 1))
    with pytest.raises(MemoryError, match=rf"need {need} bytes .* on cpu, more than QWENCUDA_MEMORY_LIMIT = {need - 1} bytes"):
        qc.Model(path, device="cpu")
    monkeypatch.setenv("QWENCUDA_MEMORY_LIMIT", str(need))   # exactly enough
    with qc.Model(path, device="cpu") as m:
        assert np.isfinite(m.forward([1, 2, 3]).logits).all()
    for bad in ("abc", "-5", "12x"):
        monkeypatch.setenv("QWENCUDA_MEMORY_LIMIT", bad)
        with pytest.raises(ValueError, match="QWENCUDA_MEMORY_LIMIT"):
            qc.Model(path, device="cpu")


def _cuda_backend_bytes(path):
    """What the CUDA backend places: matrices as stored, 1-D tensors as float32."""
    r, _ = _reader(path)
    return sum(int(t.n_bytes) if len(t.shape) == 2 else 4 * int(np.prod(t.shape)) for t in r.tensors)


@pytest.mark.gpu
def test_cuda_memory_limit_refuses_with_the_size(tmp_path, monkeypatch):
    path = sy.write_random_model(tmp_path / "m.gguf", "tiny-hd128", "q4_k_m")
    need = _cuda_backend_bytes(path)
    monkeypatch.setenv("QWENCUDA_MEMORY_LIMIT", str(need - 1))
    with pytest.raises(MemoryError, match=rf"need {need} bytes .* on cuda:0, more than"):
        qc.Model(path, device="cuda")
    monkeypatch.setenv("QWENCUDA_MEMORY_LIMIT", str(need))
    with qc.Model(path, device="cuda") as m:
        assert np.isfinite(m.forward([1, 2, 3]).logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("QWENCUDA_TEST_OOM") != "1",
                    reason="writes a multi-GB file and fills the GPU: set QWENCUDA_TEST_OOM=1")
def test_cuda_model_larger_than_free_memory(tmp_path):
    """A real out-of-memory: the GPU filled by torch up to less than a 1.5B F16 model's size,
    then the load raises MemoryError naming both sizes, leaves the free memory as it found it,
    and the same model loads and runs once the memory is back."""
    torch = pytest.importorskip("torch")
    path = sy.write_random_model(tmp_path / "m.gguf", "1.5B", "f16")
    need = _cuda_backend_bytes(path)
    free, _ = qc.kernels.cuda_mem_info(0)
    if shutil.disk_usage(tmp_path).free < 1 << 30:
        pytest.skip("no disk space")
    hog = torch.empty(free - need // 2, dtype=torch.uint8, device="cuda:0")
    try:
        before, _ = qc.kernels.cuda_mem_info(0)
        with pytest.raises(MemoryError, match=rf"need {need} bytes .* on cuda:0, which has \d+ bytes"):
            qc.Model(path, device="cuda")
        after, _ = qc.kernels.cuda_mem_info(0)
        assert abs(after - before) < 64 << 20, (before, after)
    finally:
        del hog
        torch.cuda.empty_cache()
    with qc.Model(path, device="cuda") as m:
        assert np.isfinite(m.forward([1, 2, 3]).logits).all()


def test_bench_sizes_script(tmp_path):
    """scripts/bench_sizes.py end to end on the CPU with a test shape (no llama-bench): a table
    row per (shape, type), the files deleted."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_sizes.py")
    out = subprocess.run([sys.executable, script, "--shapes", "tiny-hd64", "--types", "q8_0", "f16",
                          "--device", "cpu", "--prompt-tokens", "8", "--gen-tokens", "2", "--repeats", "1",
                          "--dir", str(tmp_path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [l for l in out.stdout.splitlines() if l.startswith("| tiny-hd64")]
    assert len(rows) == 2 and "Q8_0" in rows[0] and "F16" in rows[1], out.stdout
    assert "prefill" in out.stderr and not [p for p in os.listdir(tmp_path) if p.endswith(".gguf")]


def test_readme_memory_table():
    """README's table of what fits on an 80 GB GPU is memory_needed's (32k context, F16 cache)."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (\d+B) \| ([\d.]+) \| ([\d.]+)[^|]* \| ([\d.]+)[^|]* \| ([\d.]+) \|$", readme, re.M)
    assert [r[0] for r in rows] == ["7B", "14B", "32B", "72B"]
    for shape, *cells in rows:
        got = [sy.memory_needed(shape, t)["total"] / 2**30 for t in ("q4_k_m", "q8_0", "f16")]
        got.append(sy.memory_needed(shape, "f16")["kv_cache"] / 2**30)
        for text, value in zip(cells, got):   # rounded to the digits shown
            decimals = len(text.split(".")[1]) if "." in text else 0
            assert abs(float(text) - value) <= 0.5 * 10.0 ** -decimals + 1e-9, (shape, text, value)
