"""Captures that stay on the GPU (capture_device="cuda", issue 13 item 4): qwencuda.DeviceArray.

The GPU tests check that a device capture holds the very bits the host capture of the same eval
holds (same engine, same buffers: a device-to-device copy instead of a download), through
Model.forward, Session.prefill / step (chunked prefill with padded attention rows, patched
attention computed on the host) and generate; that torch reads them in place through DLPack and
the CUDA Array Interface and keeps them alive after the trace and the model are gone; that the
capture budget refuses device captures in GPU memory before anything is allocated; and that
nothing is left allocated (qwencuda's count of live DeviceArrays, and cudaMemGetInfo).

The CPU tests (CI) check the arguments, and the ValueError on the CPU backend.
"""
import gc
import sys

import numpy as np
import pytest

import qwencuda as qc
from qwencuda import _core
from qwencuda.model import _capture_device

from engine_util import model_file

IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 11, 64]
NAMES = ["embed", "blk.0.q_rope", "blk.1.k", "blk.*.attn_scores", "blk.*.attn_probs", "blk.0.gate",
         "blk.1.resid_out", "output_norm", "logits", "argmax"]


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 400, size=n)


def _alive():
    return _core.device_arrays_alive()


# --------------------------------------------------------------------------------------------
# CPU: arguments, and the refusal on the CPU backend


@pytest.fixture(scope="module")
def cpu_model():
    with qc.Model(model_file("tiny", "f32"), device="cpu") as m:
        yield m


@pytest.mark.parametrize("where", ["cuda", "cuda:0"])
def test_cpu_backend_refuses_device_captures(cpu_model, where):
    m = cpu_model
    with pytest.raises(ValueError, match="runs on cpu"):
        m.forward(IDS, capture="logits", capture_device=where)
    with m.session() as s:
        with pytest.raises(ValueError, match="runs on cpu"):
            s.prefill(IDS, capture="logits", capture_device=where)
        with pytest.raises(ValueError, match="runs on cpu"):
            s.step(3, capture="logits", capture_device=where)
        assert s.position == 0
    with pytest.raises(ValueError, match="runs on cpu"):   # at call time, before any work
        m.generate(IDS[:4], max_new_tokens=2, capture="logits", capture_device=where, stream=True)


def test_engine_refuses_device_captures_on_cpu(cpu_model):
    """The C session's own check, under the Python one: ValueError, the session unchanged."""
    with cpu_model.session() as s:
        with pytest.raises(ValueError, match="only on a CUDA backend"):
            s._s.eval(np.array(IDS), "last", ("logits",), None, None, None, True)
        assert s.position == 0
        tr = s.prefill(IDS, capture="logits")
        assert s.position == len(IDS) and isinstance(tr["logits"], np.ndarray)
    assert _alive() == (0, 0)


@pytest.mark.parametrize("bad, err", [("gpu", ValueError), ("cuda:x", ValueError), ("CUDA", ValueError),
                                      (1, TypeError), (True, TypeError), (b"cuda", TypeError)])
def test_capture_device_argument_is_checked(cpu_model, bad, err):
    with pytest.raises(err, match="capture_device"):
        cpu_model.forward(IDS, capture="logits", capture_device=bad)
    with pytest.raises(err, match="capture_device"):
        cpu_model.generate(IDS[:4], max_new_tokens=2, capture="logits", capture_device=bad)


def test_cpu_and_none_are_host_numpy(cpu_model):
    a = cpu_model.forward(IDS, capture=NAMES)
    for where in ("cpu", None):
        b = cpu_model.forward(IDS, capture=NAMES, capture_device=where)
        assert list(b) == list(a)
        for name in a:
            assert isinstance(b[name], np.ndarray)
            np.testing.assert_array_equal(b[name], a[name])


def test_device_must_be_the_models_own():
    assert _capture_device("cuda", "cuda") and _capture_device("cuda:0", "cuda")
    assert _capture_device("cuda:1", "cuda:1") and _capture_device("cuda", "cuda:1") is True
    assert _capture_device("cpu", "cuda") is False and _capture_device(None, "cuda:1") is False
    with pytest.raises(ValueError, match="GPU of the model, cuda:1"):
        _capture_device("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="GPU of the model, cuda"):
        _capture_device("cuda:2", "cuda")


def test_device_array_type():
    assert qc.DeviceArray is _core.DeviceArray
    with pytest.raises(TypeError):
        qc.DeviceArray()


# --------------------------------------------------------------------------------------------
# GPU


@pytest.fixture(scope="module")
def gpu_model():
    # (the module is collected without a GPU too: the model opens only when a GPU test runs)
    with qc.Model(model_file("tiny", "q8_0"), device="cuda") as m:
        yield m


def same_bits(dev, host, what=""):
    """dev is a DeviceArray holding exactly host's bits (float32 -inf / 0 padding included)."""
    assert isinstance(dev, qc.DeviceArray), f"{what}: {type(dev).__name__}"
    assert isinstance(host, np.ndarray), what
    assert dev.shape == host.shape and dev.dtype == host.dtype, f"{what}: {dev.shape} {dev.dtype} vs {host.shape} {host.dtype}"
    got = dev.numpy()
    assert isinstance(got, np.ndarray) and got.shape == host.shape and got.dtype == host.dtype, what
    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(host).view(np.uint32)), f"{what}: bits differ"


def same_traces(dev, host, what):
    assert list(dev.keys()) == list(host.keys()), what
    assert len(host) > 0, what
    for name in host:
        same_bits(dev[name], host[name], f"{what} {name}")


@pytest.mark.gpu
def test_forward_device_equals_host(gpu_model, tmp_path):
    m = gpu_model
    host = m.forward(IDS, capture=NAMES)
    dev = m.forward(IDS, capture=NAMES, capture_device="cuda")
    same_traces(dev, host, "forward")
    # the logits= rows stay host arrays (they are not captures)
    assert isinstance(dev.logits, np.ndarray) and np.array_equal(dev.logits, host.logits)
    # chosen attention rows
    kw = dict(capture=["blk.*.attn_scores", "blk.*.attn_probs"], attn_rows=[0, 4, -1])
    same_traces(m.forward(IDS, capture_device="cuda", **kw), m.forward(IDS, **kw), "attn_rows")
    # the repr describes without copying; save() copies to the host
    assert "on cuda:0" in repr(dev)
    back = qc.Trace.load(dev.save(tmp_path / "dev.npz"))
    for name in host:
        assert np.array_equal(back[name], host[name]), name


@pytest.mark.gpu
def test_chunked_prefill_pads_attention_rows_on_the_device(gpu_model):
    """prefill_chunk 4 over 11 tokens: the early chunks' attention rows are narrower than the
    eval's keys and padded (-inf scores, 0 probabilities) on the device."""
    m = gpu_model
    names = ["blk.*.attn_scores", "blk.*.attn_probs", "blk.0.q_rope", "logits", "argmax"]
    out = []
    for where in ("cpu", "cuda"):
        with m.session(max_context=64) as s:
            s.prefill_chunk = 4
            out.append([s.prefill(IDS, capture=names, logits="all", capture_device=where),
                        s.prefill(IDS[:7], capture=names, attn_rows=[1, 5, -1], capture_device=where)])
    host, dev = out
    for i in range(2):
        same_traces(dev[i], host[i], f"chunked prefill {i}")
    probs = host[0]["blk.0.attn_probs"]
    assert np.isneginf(host[0]["blk.0.attn_scores"][:, 0, 1:]).all() and (probs[:, 0, 1:] == 0).all()


@pytest.mark.gpu
def test_patched_attention_is_uploaded_to_the_device(gpu_model):
    """attn_scores / attn_probs of a patched layer are computed on the host: uploaded."""
    m = gpu_model
    kw = dict(capture=["blk.0.attn_scores", "blk.0.attn_probs", "blk.0.attn_out", "logits"],
              patch={"blk.0.attn_scores": qc.Scale(0.5)})
    same_traces(m.forward(IDS, capture_device="cuda", **kw), m.forward(IDS, **kw), "patched")


@pytest.mark.gpu
def test_prefill_and_steps_device_equal_host(gpu_model):
    m = gpu_model
    traces = {}
    for where in ("cpu", "cuda"):
        with m.session(max_context=64) as s:
            got = [s.prefill(IDS, capture=NAMES, capture_device=where)]
            for tok in (3, 250, 77):
                got.append(s.step(tok, capture=NAMES, capture_device=where))
            traces[where] = got
    for i, (d, h) in enumerate(zip(traces["cuda"], traces["cpu"])):
        same_traces(d, h, f"eval {i}")
        assert d["blk.0.attn_probs"].shape == h["blk.0.attn_probs"].shape


@pytest.mark.gpu
def test_generate_device_traces_equal_host(gpu_model):
    kw = dict(max_new_tokens=5, capture=["blk.*.attn_probs", "blk.1.resid_out", "logits", "argmax"])
    gh = gpu_model.generate(IDS[:6], **kw)
    gd = gpu_model.generate(IDS[:6], capture_device="cuda", **kw)
    assert gd.tokens == gh.tokens and len(gd.traces) == len(gh.traces) == len(gh.tokens) >= 1
    for i, (d, h) in enumerate(zip(gd.traces, gh.traces)):
        same_traces(d, h, f"generate trace {i}")


@pytest.mark.gpu
def test_cuda_array_interface_and_attributes(gpu_model):
    tr = gpu_model.forward(IDS, capture=["blk.0.attn_probs", "argmax"], capture_device="cuda")
    for name, typestr, dtype in (("blk.0.attn_probs", "<f4", np.float32), ("argmax", "<i4", np.int32)):
        x = tr[name]
        cai = x.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["shape"] == x.shape and isinstance(cai["shape"], tuple)
        assert cai["typestr"] == typestr and x.dtype == np.dtype(dtype)
        ptr, read_only = cai["data"]
        assert isinstance(ptr, int) and ptr != 0 and read_only is False
        assert cai["strides"] is None and cai["stream"] is None
        assert x.nbytes == int(np.prod(x.shape)) * 4 and x.ndim == len(x.shape)
        assert x.device == "cuda:0" and x.__dlpack_device__() == (2, 0)
        assert np.array_equal(np.asarray(x), x.numpy())
    c = gpu_model.config
    assert tr["blk.0.attn_probs"].shape == (c.n_head, len(IDS), len(IDS)) and tr["argmax"].shape == (len(IDS),)
    with pytest.raises(ValueError, match="copy"):
        tr["argmax"].__array__(copy=False)


@pytest.mark.gpu
def test_dlpack_capsule_holds_a_reference(gpu_model):
    x = gpu_model.forward(IDS, capture="logits", capture_device="cuda")["logits"]
    refs = sys.getrefcount(x)
    caps = [x.__dlpack__(), x.__dlpack__(stream=1), x.__dlpack__(stream=None, max_version=(1, 0)),
            x.__dlpack__(dl_device=(2, 0), copy=False)]
    assert sys.getrefcount(x) == refs + len(caps)
    assert all(type(c).__name__ == "PyCapsule" for c in caps)
    del caps   # never consumed: each releases its reference
    assert sys.getrefcount(x) == refs
    with pytest.raises(BufferError):
        x.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError):
        x.__dlpack__(copy=True)
    with pytest.raises(TypeError):
        x.__dlpack__(stream="default")
    assert sys.getrefcount(x) == refs


@pytest.mark.gpu
def test_torch_views_device_captures_and_keeps_them_alive(tmp_path):
    torch = pytest.importorskip("torch")
    base = _alive()
    m = qc.Model(model_file("tiny", "q8_0"), device="cuda")
    tr = m.forward(IDS, capture=["blk.0.attn_probs", "argmax", "logits", "blk.1.v"], capture_device="cuda")
    host = {k: v.numpy() for k, v in tr.items()}
    probs, argmax = tr["blk.0.attn_probs"], tr["argmax"]
    t = torch.from_dlpack(probs)
    a = torch.from_dlpack(argmax)
    v = torch.as_tensor(tr["blk.1.v"], device="cuda")   # through __cuda_array_interface__
    assert t.device == torch.device("cuda", 0) and t.dtype == torch.float32 and a.dtype == torch.int32
    assert tuple(t.shape) == probs.shape and t.is_contiguous()
    # views, not copies
    assert t.data_ptr() == probs.__cuda_array_interface__["data"][0]
    assert a.data_ptr() == argmax.__cuda_array_interface__["data"][0]
    assert v.data_ptr() == tr["blk.1.v"].__cuda_array_interface__["data"][0]
    assert _alive()[0] == base[0] + 4
    # the trace, the arrays and the model go: the buffers torch views stay (logits is freed)
    del tr, probs, argmax
    m.close()
    del m
    gc.collect()
    assert _alive()[0] == base[0] + 3
    assert np.array_equal(t.cpu().numpy(), host["blk.0.attn_probs"])
    assert np.array_equal(a.cpu().numpy(), host["argmax"])
    assert np.array_equal(v.cpu().numpy(), host["blk.1.v"])
    # reduced on the GPU: each row of probabilities sums to 1
    assert torch.allclose(t.sum(dim=-1), torch.ones_like(t[..., 0]), atol=1e-5)
    del t, a, v
    gc.collect()
    assert _alive() == base


@pytest.mark.gpu
def test_cupy_views_device_captures():
    cupy = pytest.importorskip("cupy")
    with qc.Model(model_file("tiny", "q8_0"), device="cuda") as m:
        x = m.forward(IDS, capture="logits", capture_device="cuda")["logits"]
        host = x.numpy()
        for y in (cupy.asarray(x), cupy.from_dlpack(x)):
            assert y.data.ptr == x.__cuda_array_interface__["data"][0]
            assert np.array_equal(cupy.asnumpy(y), host)


@pytest.mark.gpu
def test_budget_refuses_device_captures_in_gpu_memory(gpu_model):
    m, c = gpu_model, gpu_model.config
    n = 20
    need = c.n_layer * c.n_head * n * n * 4   # blk.*.attn_probs
    base, free0 = _alive(), qc.kernels.cuda_mem_info(0)[0]
    with m.session(max_context=64) as s:
        s.capture_budget = need - 1     # the host side (the last row of logits) fits it
        with pytest.raises(MemoryError, match=rf"device captures \({c.n_layer} tensors\) need .* GiB of GPU "
                                              r"memory on cuda:0.*set by the caller"):
            s.prefill(_ids(n), capture="blk.*.attn_probs", capture_device="cuda")
        assert s.position == 0 and _alive() == base
        s.capture_budget = need         # exactly the budget: allowed
        tr = s.prefill(_ids(n), capture="blk.*.attn_probs", capture_device="cuda")
        assert sum(x.nbytes for x in tr.values()) == need
    del tr
    # the default: half of the GPU's free memory; this eval needs more than all of it
    free, _ = qc.kernels.cuda_mem_info(0)
    n = int((free / (c.n_layer * c.n_head * 4)) ** 0.5) + 64
    with m.session(max_context=n) as s:
        with pytest.raises(MemoryError, match=r"GiB of GPU memory on cuda:0.*half of the .* GiB free on the GPU"):
            s.prefill(np.zeros(n, dtype=np.int64), capture="blk.*.attn_probs", logits=None,
                      capture_device="cuda")
        assert s.position == 0
    gc.collect()
    assert _alive() == base
    assert qc.kernels.cuda_mem_info(0)[0] >= free0 - (8 << 20)


@pytest.mark.gpu
def test_out_of_gpu_memory_mid_allocation_leaves_nothing(gpu_model):
    """A budget raised past what the GPU has: the first capture is allocated, the second's
    cudaMalloc fails (MemoryError); the first is freed and the session stays usable."""
    m, c = gpu_model, gpu_model.config
    gc.collect()
    free0, _ = qc.kernels.cuda_mem_info(0)
    n = int((0.55 * free0 / (c.n_head * 4)) ** 0.5)   # each layer's attn_probs: 55% of the free memory
    with m.session(max_context=n) as s:
        s.capture_budget = 1 << 50
        with pytest.raises(MemoryError, match="cudaMalloc"):
            s.prefill(np.zeros(n, dtype=np.int64), capture="blk.*.attn_probs", logits=None, capture_device="cuda")
        assert s.position == 0
        tr = s.prefill(IDS, capture="logits", capture_device="cuda")
        assert tr["logits"].shape == (1, c.n_vocab)
    del tr
    gc.collect()
    assert qc.kernels.cuda_mem_info(0)[0] >= free0 - (8 << 20)


@pytest.mark.gpu
def test_many_device_captures_leave_nothing_behind(gpu_model):
    m = gpu_model
    ids = _ids(48)

    def boom(value):
        raise RuntimeError("boom")

    def work():
        tr = m.forward(ids, capture="*", capture_device="cuda", logits=None)
        tr["logits"].numpy()
        cap = tr["blk.0.attn_probs"].__dlpack__()   # a capsule never consumed
        del cap
        with m.session(max_context=64) as s:
            s.prefill_chunk = 16                    # the padded attention rows
            s.prefill(ids, capture="blk.*.attn_*", capture_device="cuda")
            s.step(3, capture="*", capture_device="cuda")
        # an eval that fails after its device captures were allocated
        with pytest.raises(RuntimeError, match="boom"):
            m.forward(ids, capture="*", capture_device="cuda", patch={"blk.1.ffn_out": boom})
        g = m.generate(ids[:5].tolist(), max_new_tokens=3, capture="blk.*.attn_probs", capture_device="cuda")
        assert g.traces

    work()   # first use: scratch sizes, cuBLAS, modules
    gc.collect()
    alive0, free0 = _alive(), qc.kernels.cuda_mem_info(0)[0]
    for _ in range(25):   # about 1 MB of captures each: a leak shows as 25 MB
        work()
    gc.collect()
    assert _alive() == alive0
    free1 = qc.kernels.cuda_mem_info(0)[0]
    assert free1 >= free0 - (8 << 20), f"GPU memory lost over 25 rounds: {(free0 - free1) >> 20} MiB"
