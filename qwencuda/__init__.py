"""qwencuda: a transparent Qwen2/Qwen2.5 GGUF inference engine in C and CUDA.

Every intermediate tensor, attention map, lm_head projection and argmax choice comes back as a
NumPy array, and every kernel can be called on NumPy inputs (qwencuda.kernels).

    import qwencuda as qc
    f = qc.GGUFFile("model.gguf")              # metadata, tensors, f.tensor(name)
    m = qc.Model("model.gguf", device="cuda")  # or "cpu"
    tr = m.forward(ids, capture=["blk.*.attn_probs"])
    tr.logits, tr["blk.0.attn_probs"]

Submodules and names are imported on first use, so `import qwencuda` stays light.
"""


def _load_core():
    """Import the C extension. When Python runs inside a source checkout (`python -m qwencuda`
    from the repository root puts it first on sys.path) the checkout's qwencuda/ has no built
    _core, while `pip install .` put one in site-packages: use that one."""
    import importlib
    import os
    import sys

    try:
        return importlib.import_module("._core", __name__)
    except ImportError as first:
        here = os.path.dirname(os.path.abspath(__file__))
        for entry in sys.path:
            other = os.path.join(os.path.abspath(entry or "."), "qwencuda")
            if other == here or not os.path.isdir(other):
                continue
            if any(n.startswith("_core.") and n.endswith((".so", ".pyd")) for n in os.listdir(other)):
                __path__.append(other)
                return importlib.import_module("._core", __name__)
        raise ImportError(f"qwencuda's C extension is not built: run `pip install .` ({first})") from first


_core = _load_core()
CudaError, GGUFError, ModelError = _core.CudaError, _core.GGUFError, _core.ModelError

__version__ = "0.1.0"

# public name -> (submodule, attribute or None for the submodule itself)
_LAZY = {
    "GGUFFile": ("gguf", "GGUFFile"),
    "dequantize": ("gguf", "dequantize"),
    "Model": ("model", "Model"),
    "Session": ("model", "Session"),
    "set_capture_budget": ("model", "set_capture_budget"),
    "Trace": ("trace", "Trace"),
    "DeviceArray": ("trace", "DeviceArray"),
    "TokenLogprobs": ("generation", "TokenLogprobs"),
    "capture_names": ("trace", "capture_names"),
    "Tokenizer": ("tokenizer", "Tokenizer"),
    "Sampler": ("sampling", "Sampler"),
    "sample": ("sampling", "sample"),
    "compare": ("debug.compare", None),
    "diagnose": ("debug.diagnose", None),
    "localise": ("debug.diagnose", "localise"),
    "logit_lens": ("debug.lens", "logit_lens"),
    "lens": ("debug.lens", None),
    "namemaps": ("debug.namemaps", None),
    "resolve_model_path": ("default_model", "resolve_model_path"),
    "default_model_path": ("default_model", "default_model_path"),
    "kernels": ("kernels", None),
    "reference": ("reference", None),
    "testing": ("testing", None),
    "synthetic": ("testing.synthetic", None),
    "patching": ("patching", None),
    "Replace": ("patching", "Replace"),
    "Add": ("patching", "Add"),
    "Scale": ("patching", "Scale"),
    "ZeroHeads": ("patching", "ZeroHeads"),
}

__all__ = ["CudaError", "GGUFError", "ModelError", "build_info", "__version__", *_LAZY]


def __getattr__(name):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'qwencuda' has no attribute {name!r}") from None
    import importlib

    mod = importlib.import_module(f".{module}", __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def build_info():
    """What this installation was built with: CUDA or not, GPU architectures, compiler and
    CUDA versions, visible CUDA devices."""
    info = dict(_core.build_info())
    info["version"] = __version__
    return info
