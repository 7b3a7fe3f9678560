"""Where a decode step's time goes, kernel by kernel, on the GPU.

    python scripts/profile_decode.py run MODEL [PROMPT_TOKENS] [STEPS]
        prefill, then STEPS decode steps op by op (QWENCUDA_NO_GRAPHS=1, so that a kernel
        profiler sees each launch); meant to run under Nsight Compute:
        ncu --clock-control none --metrics gpu__time_duration.sum --csv \
            python scripts/profile_decode.py run MODEL > ncu.csv
    python scripts/profile_decode.py report ncu.csv
        the last decode step (the kernels after the second-to-last argmax): time per kernel
        name, count, share, and the step's total.
    python scripts/profile_decode.py torch MODEL [PROMPT_TOKENS] [STEPS]
        the same run and report in one process, timed by torch.profiler (CUPTI) where Nsight
        Compute is not installed; needs torch with CUDA.
    python scripts/profile_decode.py timeline MODEL [PROMPT_TOKENS] [STEPS]
        the decode step as it really runs (the recorded CUDA graph, programmatic dependent
        launches and all), from torch.profiler's start and end times: per kernel name, how far
        it moved the step's end (its end minus the latest end before it; what a kernel hides
        under another costs nothing), next to its own duration; their sum is the step's time
        on the GPU. Needs torch with CUDA.
    python scripts/profile_decode.py loop MODEL [PROMPT_TOKENS] [STEPS]
        the generation loop as the bench runs it (greedy draws on the device, each step queued
        before the host has seen the token before), from torch.profiler: the median step period
        (one step's first kernel to the next one's) and how long the GPU ran no kernel between
        two steps, and what ran there (the copies of the draw to the host; the last kernels of a
        step and the first of the next, timed from the next step's first kernel). Needs torch
        with CUDA.
"""
import csv
import os
import statistics
import sys
from collections import defaultdict


def _prompt(m, prompt_tokens):
    """The ids every mode prefills: the same pattern below n_vocab in every run."""
    return [(1000 + 7 * i) % m.config.n_vocab for i in range(prompt_tokens)]


def _cuda_events(fn):
    """(name, start us, end us) of every CUDA event (kernels and copies) of fn(), in start order,
    from torch.profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events]


def _is_copy(name):
    return "memcpy" in name.lower() or "memset" in name.lower()


def run(model, prompt_tokens=512, steps=3, graphs=False):
    if not graphs:
        os.environ["QWENCUDA_NO_GRAPHS"] = "1"
    import qwencuda

    with qwencuda.Model(model, device="cuda") as m, m.session(max_context=prompt_tokens + steps + 1) as s:
        tr = s.prefill(_prompt(m, prompt_tokens))
        token = int(tr.argmax[-1])
        for _ in range(steps):
            token = int(s.step(token).argmax[-1])


def loop_events(model, prompt_tokens=512, steps=40):
    """Every CUDA event (kernels and copies) of `steps` greedy steps of a generation loop, after
    a prompt and 8 steps unprofiled, in start order: (name, start us, end us)."""
    import qwencuda
    from qwencuda.sampling import Sampler

    with qwencuda.Model(model, device="cuda") as m, m.session(max_context=prompt_tokens + steps + 9) as s:
        greedy = Sampler(m.config.n_vocab, temperature=0.0)
        token = s.prefill(_prompt(m, prompt_tokens), logits=None, sampler=greedy).token
        for _ in range(8):
            token = s.step(token, logits=None, sampler=greedy).token

        def steps_run():
            nonlocal token
            for _ in range(steps):
                token = s.step(token, logits=None, sampler=greedy).token
        return _cuda_events(steps_run)


def loop(events):
    """The steps of loop_events: each starts with its embedding's kernel."""
    firsts = [i for i, (name, _, _) in enumerate(events) if "embed" in name]
    if len(firsts) < 3:
        raise SystemExit("need at least three steps (embedding kernels) in the profile")
    periods, idle = [], []
    for a, b in zip(firsts, firsts[1:]):
        last_kernel = max(end for name, _, end in events[a:b] if not _is_copy(name))
        periods.append(events[b][1] - events[a][1])
        idle.append(events[b][1] - last_kernel)
    print(f"{len(periods)} steps: period {statistics.median(periods):.1f} us (median; "
          f"{min(periods):.1f}..{max(periods):.1f}); no kernel running between two steps "
          f"{statistics.median(idle):.1f} us (median; {min(idle):.1f}..{max(idle):.1f})")
    mid = len(firsts) // 2
    a, b = firsts[mid - 1], firsts[mid]
    t0 = events[b][1]
    copies = [(name, start, end) for name, start, end in events[a:b] if _is_copy(name)]
    tail = [ev for ev in events[a:b] if not _is_copy(ev[0])][-3:]
    print("the end of a step and the start of the next (us from the next step's first kernel):")
    for name, start, end in sorted(tail + copies + events[b:b + 2], key=lambda ev: ev[1]):
        print(f"  {name.split('(')[0][:58]:58s} start {start - t0:8.1f}  {end - start:6.1f} us")


def ncu_launches(path):
    """(kernel name, ns) of every launch in an Nsight Compute CSV, in launch order."""
    launches = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]      # ncu prints other lines first
    for row in csv.DictReader(lines):                         # one row per kernel and metric
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(row["Metric Unit"], 1.0)
        launches.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale))
    return launches


def torch_kernels(model, prompt_tokens=512, steps=3, graphs=False):
    """(kernel name, start ns, end ns) of every kernel of run(), in start order, from torch.profiler."""
    events = _cuda_events(lambda: run(model, prompt_tokens, steps, graphs))
    return [(name, start * 1e3, end * 1e3) for name, start, end in events if not _is_copy(name)]


def torch_launches(model, prompt_tokens=512, steps=3):
    """(kernel name, ns) of every launch of run(), in launch order, from torch.profiler."""
    return [(name, end - start) for name, start, end in torch_kernels(model, prompt_tokens, steps)]


def timeline(kernels):
    """The last decode step of a graph run (the kernels after the second-to-last argmax): per
    kernel name, how far it moved the step's end, and its own time."""
    ends = [i for i, (name, _, _) in enumerate(kernels) if "argmax" in name]
    if len(ends) < 2:
        raise SystemExit("need at least two evals (argmax launches) in the profile")
    step = kernels[ends[-2] + 1: ends[-1] + 1]
    frontier = step[0][1]
    by_name = defaultdict(lambda: [0, 0.0, 0.0])
    for name, start, end in step:
        short = name.split("(")[0]
        by_name[short][0] += 1
        by_name[short][1] += max(0.0, end - frontier)   # the gap before it, if any, included
        by_name[short][2] += end - start
        frontier = max(frontier, end)
    wall = frontier - step[0][1]
    busy = sum(v[2] for v in by_name.values())
    print(f"one decode step: {len(step)} kernels, {wall / 1e3:.1f} us from the first start to the last end, "
          f"{busy / 1e3:.1f} us of kernel time")
    print(f"{'kernel':60s} {'count':>5s} {'step us':>9s} {'share':>6s} {'own us':>9s}")
    for name, (count, adv, own) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:60]:60s} {count:5d} {adv / 1e3:9.1f} {100 * adv / wall:5.1f}% {own / 1e3:9.1f}")


def report(launches):
    ends = [i for i, (name, _) in enumerate(launches) if "argmax" in name]
    if len(ends) < 2:
        raise SystemExit("need at least two evals (argmax launches) in the profile")
    step = launches[ends[-2] + 1: ends[-1] + 1]
    total = sum(ns for _, ns in step)
    by_name = defaultdict(lambda: [0, 0.0])
    for name, ns in step:
        short = name.split("(")[0]
        by_name[short][0] += 1
        by_name[short][1] += ns
    print(f"one decode step: {len(step)} kernels, {total / 1e3:.1f} us of kernel time")
    print(f"{'kernel':60s} {'count':>5s} {'us':>9s} {'share':>6s}")
    for name, (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:60]:60s} {count:5d} {ns / 1e3:9.1f} {100 * ns / total:5.1f}%")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], *(int(a) for a in sys.argv[3:5]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "torch":
        report(torch_launches(sys.argv[2], *(int(a) for a in sys.argv[3:5])))
    elif len(sys.argv) >= 3 and sys.argv[1] == "timeline":
        timeline(torch_kernels(sys.argv[2], *(int(a) for a in sys.argv[3:5]), graphs=True))
    elif len(sys.argv) >= 3 and sys.argv[1] == "loop":
        loop(loop_events(sys.argv[2], *(int(a) for a in sys.argv[3:5])))
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        report(ncu_launches(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
