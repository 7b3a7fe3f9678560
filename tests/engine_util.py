"""Helpers shared by the engine tests (test_model, test_session, test_engine_vs_reference,
test_real_model_engine; nvcc for test_step_stamps and test_kernel_resources): synthetic model
files cached per test run, error measures, a trace-vs-trace comparison that names the first
tensor out of tolerance, the CUDA kernels a call ran, and nvcc on a kernel file."""
import atexit
import os
import shutil
import subprocess
import tempfile

import numpy as np

import qwencuda as qc

_DIR = None
_FILES = {}


def model_file(config="tiny", weight_type="f32", tied=None, seed=0):
    """A synthetic Qwen2 GGUF written once per test run (qwencuda.testing.write_model)."""
    global _DIR
    key = (config, weight_type, tied, seed)
    if key not in _FILES:
        if _DIR is None:
            _DIR = tempfile.mkdtemp(prefix="qc-engine-tests-")
            atexit.register(shutil.rmtree, _DIR, True)
        name = f"{config}-{weight_type}-{'t' if tied else ('u' if tied is False else 'd')}-{seed}.gguf"
        _FILES[key] = qc.testing.write_model(os.path.join(_DIR, name), config=config,
                                             weight_type=weight_type, seed=seed, tied=tied)
    return _FILES[key]


def session_with_env(model, monkeypatch, env, **kw):
    """model.session(**kw) created with the environment variables env ({name: value, or None
    for unset}) in place, the switches a session reads at its creation (QWENCUDA_DECODE,
    QWENCUDA_DECODE_AHEAD); each is unset again afterwards."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    s = model.session(**kw)
    for name in env:
        monkeypatch.delenv(name, raising=False)
    return s


def scratch_dir():
    model_file()   # creates the folder
    return _DIR


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| (float64), or ||a - b|| when b is all zeros."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = np.linalg.norm((a - b).ravel())
    den = np.linalg.norm(b.ravel())
    return float(num / den) if den > 0 else float(num)


def max_abs(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def norm_err(a, b) -> float:
    """max |a - b| / max |b| over the finite values; inf unless shapes, NaN/inf positions and
    non-finite values agree (attn_scores: -inf where masked)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        return np.inf
    fin = np.isfinite(b)
    if not np.array_equal(fin, np.isfinite(a)) or not np.array_equal(a[~fin], b[~fin]):
        return np.inf
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(a[fin] - b[fin])) / max(np.max(np.abs(b[fin])), 1e-6))


def finite_part(a):
    """attn_scores hold -inf where masked: compare the finite entries, check the mask apart."""
    return np.where(np.isfinite(a), a, 0.0)


def compare_tensor(name, got, want, rtol, atol_frac):
    """got vs want: same shape and dtype kind; relative error <= rtol and max-abs error <=
    atol_frac * max|want|. Returns (rel, maxabs) for reporting."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
    if name == "argmax" or want.dtype.kind in "iu":
        return 0.0, 0.0
    if name.endswith("attn_scores"):
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{name}: causal mask differs"
        got, want = finite_part(got), finite_part(want)
    r, m = rel_err(got, want), max_abs(got, want)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    assert r <= rtol, f"{name}: relative error {r:.3g} > {rtol:g} (max-abs {m:.3g}, |ref| max {scale:.3g})"
    assert m <= atol_frac * max(scale, 1e-30), \
        f"{name}: max-abs error {m:.3g} > {atol_frac:g} * {scale:.3g} (relative {r:.3g})"
    return r, m


def compare_traces(got, want, rtol, atol_frac, names=None):
    """Every tensor of want (or of names) against got; returns {name: (rel, maxabs)}."""
    out = {}
    for name in names or list(want.keys()):
        assert name in got, f"{name}: not captured by the engine"
        out[name] = compare_tensor(name, got[name], want[name], rtol, atol_frac)
    return out


def near_tie(logits_row, gap=0.2):
    """Whether the two largest logits of a row are within gap of each other."""
    top = np.sort(np.asarray(logits_row, dtype=np.float64))[-2:]
    return float(top[1] - top[0]) < gap


# The capture names of DESIGN.md in forward order, written out here rather than taken from
# qwencuda (whose list now comes from the C core): tests compare the engine's names with this.
DESIGN_LAYER_NAMES = ("attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_scores", "attn_probs",
                      "attn_out", "attn_proj", "resid_mid", "ffn_norm", "gate", "up", "ffn_act",
                      "ffn_out", "resid_out")


def design_capture_names(n_layer):
    return (["embed"] + [f"blk.{L}.{n}" for L in range(n_layer) for n in DESIGN_LAYER_NAMES]
            + ["output_norm", "logits", "argmax"])


def cuda_kernel_ran(fn, kernel):
    """Whether fn() ran a CUDA kernel whose name contains `kernel`, as the CUDA profiler
    (torch.profiler, CUPTI) sees it; None where torch is absent. A test comparing two paths bit
    for bit checks with it that the path it means ran: equal bits alone also pass when it never
    does."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    return any(kernel in e.name for e in prof.events())


def nvcc_path():
    """The nvcc that setup.py's find_cuda takes (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda), or None."""
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    for c in [os.path.join(h, "bin", "nvcc") for h in homes if h] + [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]:
        if c and os.path.exists(c):
            return c
    return None


def nvcc_compile(root, source, out, *flags):
    """nvcc -c of root/kernels/<source> into out for sm_90, with setup.py's language flags and
    include paths and the given ones (optimisation, ptxas's report); the CompletedProcess."""
    return subprocess.run([nvcc_path(), "-c", os.path.join(root, "kernels", source), "-o", str(out), "-std=c++17",
                           "-I", os.path.join(root, "csrc", "engine"), "-I", os.path.join(root, "kernels"),
                           "--expt-relaxed-constexpr", "-DQC_HAVE_CUDA=1", "-arch=sm_90", *flags],
                          capture_output=True, text=True)
