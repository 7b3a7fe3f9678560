"""qwencuda's pytest plugin: its fixtures, the shipped example (examples/test_my_kernels.py), a
deliberately broken variant of it that must fail naming the tensor, and that loading the plugin
costs nothing and fails nothing."""
import importlib.metadata
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "test_my_kernels.py")


def _installed_as_entry_point():
    try:
        eps = importlib.metadata.entry_points(group="pytest11")
    except TypeError:                                  # Python < 3.10
        eps = importlib.metadata.entry_points().get("pytest11", [])
    return any(ep.value == "qwencuda.pytest_plugin" for ep in eps)


# Installed, pytest loads the plugin by itself (and a second registration would be an error);
# from a source checkout it is loaded here and with -p in the inner runs.
INSTALLED = _installed_as_entry_point()
PLUGIN_ARGS = () if INSTALLED else ("-p", "qwencuda.pytest_plugin")
pytest_plugins = ["pytester"] + ([] if INSTALLED else ["qwencuda.pytest_plugin"])

BROKEN_ROPE = '''

def rope(x, positions, theta):
    """The mistake of the seeds: interleaved (GPT-J) pairs (2i, 2i+1) instead of NEOX halves."""
    hd = x.shape[-1]
    freqs = theta ** (-np.arange(hd // 2, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(positions, np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty(x.shape, np.float64)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out.astype(np.float32)
'''


def _example_source():
    with open(EXAMPLE, encoding="utf-8") as f:
        return f.read()


def test_the_example_passes(pytester):
    pytester.makepyfile(test_my_kernels=_example_source())
    result = pytester.runpytest(*PLUGIN_ARGS, "-q")
    result.assert_outcomes(passed=4)


def test_a_broken_rope_fails_naming_the_tensor(pytester):
    pytester.makepyfile(test_my_kernels=_example_source() + BROKEN_ROPE)
    result = pytester.runpytest(*PLUGIN_ARGS, "-q")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "blk.0.q_rope does not match the trace" in out
    assert "blk.0.k_rope does not match the trace" in out
    assert "first divergence: blk.0.q_rope" in out
    assert "rows (tokens) 0 match" in out                  # position 0 is untouched by RoPE
    assert "largest errors in blk.0.q_rope" in out


def test_fixtures(qwencuda_tiny_model, qwencuda_trace):
    import qwencuda
    from engine_util import design_capture_names

    assert os.path.exists(qwencuda_tiny_model)
    with open(qwencuda_tiny_model, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert list(qwencuda_trace.tensors) == design_capture_names(2)   # DESIGN.md's order, written out
    assert len(qwencuda_trace.ids) >= 2
    assert qwencuda_trace.logits.shape == (len(qwencuda_trace.ids), 400)
    assert qwencuda_trace.source in ("cpu", "reference")
    with pytest.raises(ValueError):
        qwencuda_trace["blk.0.q"][0, 0, 0] = 1.0                  # shared by the session: read-only
    ref = qwencuda.reference.forward(qwencuda.reference.load(qwencuda_tiny_model), qwencuda_trace.ids)
    assert qwencuda.compare(qwencuda_trace, ref, rtol=1e-3, atol=1e-3).first_divergence is None


def test_real_model_fixture_skips_on_a_missing_file(pytester, monkeypatch):
    monkeypatch.setenv("QWENCUDA_MODEL", str(pytester.path / "no-such-model.gguf"))
    pytester.makepyfile("""
        def test_needs_it(qwencuda_real_model):
            raise AssertionError("must not run")
    """)
    result = pytester.runpytest(*PLUGIN_ARGS, "-q", "-rs")
    result.assert_outcomes(skipped=1)
    assert "does not exist" in result.stdout.str()


def test_loading_the_plugin_imports_nothing_heavy():
    """The plugin loads in every pytest run of anyone who installs qwencuda: it must not pull in
    the reference engine, gguf, or the debugging modules, and must register without error."""
    code = ("import sys, qwencuda.pytest_plugin as p; "
            "heavy = [m for m in ('gguf', 'qwencuda.reference', 'qwencuda.testing', 'qwencuda.debug.compare', "
            "'qwencuda.debug.diagnose', 'qwencuda.debug.lens', 'qwencuda.model') if m in sys.modules]; "
            "print(heavy); assert not heavy, heavy")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_plugin_with_no_fixture_used_changes_nothing(pytester):
    pytester.makepyfile("""
        def test_plain():
            assert 1 + 1 == 2
    """)
    result = pytester.runpytest(*PLUGIN_ARGS, "-q")
    result.assert_outcomes(passed=1)
