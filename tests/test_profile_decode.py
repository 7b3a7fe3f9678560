"""scripts/profile_decode.py: its reports read a profile correctly (made-up events with known
times; the profiles themselves need torch and the GPU: scripts/gpu_check.sh runs them)."""
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import profile_decode  # noqa: E402


def _loop_events(period, last_kernel_end, copy_at, steps=5):
    """Steps of `period` us: the embedding first, kernels to last_kernel_end, then the draw's copy."""
    events = []
    for k in range(steps):
        t = k * period
        events += [("void qc_embed_kernel<6, 2, true>(...)", t, t + 1.5),
                   ("void qc_qkv_attention_kernel<16>(...)", t + 3.0, t + 14.0),
                   ("qc_sample_kernel(...)", t + last_kernel_end - 7.0, t + last_kernel_end - 2.0),
                   ("qc_feed_draw_kernel(...)", t + last_kernel_end - 3.0, t + last_kernel_end),
                   ("Memcpy DtoH (Device -> Pinned)", t + copy_at, t + copy_at + 1.4)]
    return events


def test_loop_period_and_the_idle_time_between_steps(capsys):
    """The idle time runs from a step's last kernel to the next step's first; a copy in between
    is idle time for the kernels (it is what the next step waits for), and is listed."""
    profile_decode.loop(_loop_events(period=500.0, last_kernel_end=487.0, copy_at=493.0))
    out = capsys.readouterr().out
    assert "4 steps: period 500.0 us" in out
    assert "no kernel running between two steps 13.0 us" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("  ")]
    # the step's last three kernels and its copy, then the next step's first two, in start order
    expect = ["qc_qkv_attention_kernel", "qc_sample_kernel", "qc_feed_draw_kernel", "Memcpy DtoH",
              "qc_embed_kernel", "qc_qkv_attention_kernel"]
    assert len(lines) == len(expect) and all(name in ln for name, ln in zip(expect, lines)), lines
    starts = [float(ln.split("start")[1].split()[0]) for ln in lines]
    assert starts == [-497.0, -20.0, -16.0, -7.0, 0.0, 3.0]


def test_loop_needs_three_steps():
    with pytest.raises(SystemExit):
        profile_decode.loop(_loop_events(period=500.0, last_kernel_end=487.0, copy_at=493.0, steps=2))


def test_cuda_events_keeps_the_device_events_in_start_order(monkeypatch):
    """_cuda_events, which the timeline and loop modes read, through a stand-in for torch.profiler
    (the real one needs torch and a GPU): the CUDA events only, kernels and copies, by start."""
    import types

    def event(name, device, start, end):
        return types.SimpleNamespace(name=name, device_type=types.SimpleNamespace(name=device),
                                     time_range=types.SimpleNamespace(start=start, end=end))

    ran = []

    class Profile:
        def __init__(self, activities):
            self.activities = activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [event("b_kernel", "CUDA", 5, 9), event("host op", "CPU", 0, 20),
                    event("Memcpy DtoH", "CUDA", 12, 13), event("a_kernel", "CUDA", 1, 4)]

    fake = types.ModuleType("torch.profiler")
    fake.ProfilerActivity = types.SimpleNamespace(CUDA="cuda")
    fake.profile = Profile
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "torch.profiler", fake)
    got = profile_decode._cuda_events(lambda: ran.append(1))
    assert ran == [1]
    assert got == [("a_kernel", 1.0, 4.0), ("b_kernel", 5.0, 9.0), ("Memcpy DtoH", 12.0, 13.0)]
    assert [n for n, _, _ in got if not profile_decode._is_copy(n)] == ["a_kernel", "b_kernel"]
