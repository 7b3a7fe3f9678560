"""Prefill and decode speed of a model file (`python -m qwencuda bench`).

    r = run_bench("model.gguf", "cpu", prompt_tokens=128, gen_tokens=32, repeats=3)
    print(format_bench(r))

Each repeat opens a fresh session, fills `depth` tokens into its KV cache (untimed; llama-bench's
-d), prefills prompt_tokens (one call, timed) and then decodes gen_tokens one step at a time
(timed), greedily, through the public Session API as generate() does (minus the tokenizer): every
token is drawn on the device by a greedy Sampler and only its id comes back. Every call returns
only after the device has finished (the token is copied to the host), so wall-clock times are
synchronised. The figures are medians over the repeats, after one warm-up round.
"""
import os
import platform
import statistics
import subprocess
import time

import numpy as np


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda_index(device):
    """The ordinal of a "cuda", "cuda:N" or "cuda:N:float" device."""
    part = device.split(":")[1] if ":" in device else "0"
    return int(part) if part.isdigit() else 0


def _gpu_name(device):
    if not device.startswith("cuda"):
        return None
    index = str(_cuda_index(device))
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown CUDA GPU"


def _commit():
    """The checkout's commit (+dirty), else $QWENCUDA_COMMIT (an installed copy has no .git:
    scripts/gpu_check.sh names the commit it built), else None."""
    here = os.path.dirname(os.path.realpath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            return out.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("QWENCUDA_COMMIT") or None


def _core_info():
    from . import _core

    return _core.build_info()


def _type_mix(types):
    mix = {}
    for t in types.values():
        mix[t] = mix.get(t, 0) + 1
    return dict(sorted(mix.items(), key=lambda kv: (-kv[1], kv[0])))


def decode_bytes_per_token(model_path, kv_type, keys, kv_dim, n_layer):
    """What one decode step must read from memory, in bytes: every weight of the layers, the
    output norm and the lm_head (token_embd when tied), one embedding row, and each layer's
    cached keys and values (`keys` of them, kv_dim wide, 2 or 4 bytes each) -> (weights, kv).
    The bound on tokens/s is a device's memory bandwidth over their sum."""
    from .gguf import GGUFFile

    with GGUFFile(model_path) as f:
        t = f.tensors
        weights = sum(info.nbytes for name, info in t.items() if name.startswith("blk."))
        weights += t["output_norm.weight"].nbytes if "output_norm.weight" in t else 0
        embd = t["token_embd.weight"]
        if "output.weight" in t:
            weights += t["output.weight"].nbytes + embd.nbytes // embd.shape[0]
        else:
            weights += embd.nbytes
    kv = 2 * n_layer * keys * kv_dim * (2 if kv_type == "f16" else 4)
    return weights, kv


def _peak_bandwidth(device):
    """The memory bandwidth bound of a CUDA device in bytes/s (from its peak memory clock and
    bus width), or None."""
    if not str(device).startswith("cuda"):
        return None
    from . import _core

    try:
        peak = _core.cuda_device_info(_cuda_index(device))["peak_bandwidth"]
    except RuntimeError:   # qwencuda.CudaError: a device that does not say; the bench stands
        return None
    return peak if peak > 0 else None


def _one_round(model, ids, gen_tokens, depth=0, kv_type=None, fill=None):
    from .sampling import Sampler

    greedy = Sampler(model.config.n_vocab, temperature=0.0)
    with model.session(max_context=depth + len(ids) + gen_tokens, kv_type=kv_type) as s:
        if depth:
            s.prefill(fill[:depth], logits=None)   # the context before the timed work
        t0 = time.perf_counter()
        token = s.prefill(ids, logits=None, sampler=greedy).token
        t1 = time.perf_counter()
        ahead = 0
        for _ in range(gen_tokens):
            token = s.step(token, logits=None, sampler=greedy).token
            ahead += s.ran_ahead
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, ahead


def run_bench(model_path, device="auto", prompt_tokens=512, gen_tokens=128, repeats=5,
              threads=None, seed=0, depth=0, kv_type=None) -> dict:
    """Measure prefill and decode tokens/s of model_path on device, after depth tokens in the
    cache -> a dict (see format_bench)."""
    from .model import Model

    prompt_tokens, gen_tokens, repeats, depth = int(prompt_tokens), int(gen_tokens), int(repeats), int(depth)
    if prompt_tokens < 1 or gen_tokens < 0 or repeats < 1 or depth < 0:
        raise ValueError("prompt_tokens and repeats must be >= 1, gen_tokens and depth >= 0")
    t_load = time.perf_counter()
    model = Model(model_path, device=device, threads=threads)
    load_s = time.perf_counter() - t_load
    try:
        cfg = model.config
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, min(cfg.n_vocab, 150000), prompt_tokens).tolist()
        fill = rng.integers(0, min(cfg.n_vocab, 150000), depth).tolist()
        _one_round(model, ids[:min(prompt_tokens, 16)], min(gen_tokens, 2), kv_type=kv_type)   # warm-up
        prefill_s, decode_s, ahead = [], [], []
        for _ in range(repeats):
            p, d, a = _one_round(model, ids, gen_tokens, depth, kv_type, fill)
            prefill_s.append(p)
            decode_s.append(d)
            ahead.append(a)
        with model.session(max_context=1, kv_type=kv_type) as s:
            kv = s.kv_type
        types = model.tensor_types()
        p_med, d_med = statistics.median(prefill_s), statistics.median(decode_s)
        decode_tok_s = gen_tokens / d_med if d_med > 0 and gen_tokens else 0.0
        # the decode steps attend to depth + prompt + 1 .. depth + prompt + gen keys: their mean
        w_bytes, kv_bytes = decode_bytes_per_token(model_path, kv, depth + prompt_tokens + (gen_tokens + 1) / 2,
                                                   cfg.n_head_kv * cfg.head_dim, cfg.n_layer)
        peak = _peak_bandwidth(model.device)
        return {
            "model": os.path.basename(model_path),
            "model_path": os.fspath(model_path),
            "model_bytes": os.path.getsize(model_path),
            "type_mix": _type_mix(types),
            "lm_head_type": types.get("output.weight") or types.get("output (token_embd.weight, tied)"),
            "config": {k: getattr(cfg, k) for k in ("n_layer", "dim", "n_head", "n_head_kv", "ffn_dim", "n_vocab")},
            "device": model.device + (":float" if device.endswith(":float") else ""),
            "threads": model._core_model().threads if model.device.startswith("cpu") else None,
            "cpu_kernels": _core_info().get("cpu_kernels") if model.device == "cpu" and not str(device).endswith(":float") else None,
            "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "gpu": _gpu_name(model.device),
                        "python": platform.python_version()},
            "commit": _commit(),
            "prompt_tokens": prompt_tokens,
            "gen_tokens": gen_tokens,
            "depth": depth,
            "kv_type": kv,
            "repeats": repeats,
            "load_s": load_s,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": prompt_tokens / p_med if p_med > 0 else float("inf"),
            "decode_tok_s": decode_tok_s,
            "decode_ran_ahead": min(ahead),   # steps already queued when asked (Session.ran_ahead)
            "decode_weight_bytes": w_bytes,
            "decode_kv_bytes": kv_bytes,
            "decode_bandwidth": (w_bytes + kv_bytes) * decode_tok_s,
            "peak_bandwidth": peak,
        }
    finally:
        model.close()


def format_bench(result) -> str:
    """A readable report of run_bench's result."""
    r = result
    m = r["machine"]
    where = m["gpu"] if m.get("gpu") else f"{m['cpu']} ({r.get('threads') or m['cores']} threads)"
    if r.get("cpu_kernels"):
        where += f"; kernels: {r['cpu_kernels']}"
    mix = ", ".join(f"{t} x{n}" for t, n in r["type_mix"].items())
    spread = lambda xs, n: (f"{n / max(xs):.1f}..{n / min(xs):.1f}" if xs and min(xs) > 0 else "-")
    lines = [
        f"qwencuda bench: {r['model']} ({r['model_bytes'] / 2**20:.0f} MiB) on {r['device']}: {where}",
        f"  commit {r.get('commit') or 'unknown'}; weights: {mix}; lm_head {r.get('lm_head_type')}; "
        f"KV cache {r.get('kv_type', '?')}",
        f"  prefill {r['prompt_tokens']:>5} tokens at depth {r.get('depth', 0):>5}: {r['prefill_tok_s']:8.1f} tok/s "
        f"(median of {r['repeats']}, range {spread(r['prefill_s'], r['prompt_tokens'])})",
        f"  decode  {r['gen_tokens']:>5} tokens at depth {r.get('depth', 0) + r['prompt_tokens']:>5}: "
        f"{r['decode_tok_s']:8.1f} tok/s (median of {r['repeats']}, range {spread(r['decode_s'], r['gen_tokens'])})"
        + (f"; {r['decode_ran_ahead']} steps ran ahead" if r.get("decode_ran_ahead") else ""),
    ]
    if r.get("decode_bandwidth"):
        line = (f"  decode reads {(r['decode_weight_bytes'] + r['decode_kv_bytes']) / 1e6:.1f} MB a token "
                f"({r['decode_weight_bytes'] / 1e6:.1f} MB of weights, {r['decode_kv_bytes'] / 1e6:.1f} MB of KV cache): "
                f"{r['decode_bandwidth'] / 1e9:.0f} GB/s")
        if r.get("peak_bandwidth"):
            bound = r["peak_bandwidth"] / (r["decode_weight_bytes"] + r["decode_kv_bytes"])
            line += (f", {100 * r['decode_bandwidth'] / r['peak_bandwidth']:.1f}% of the device's "
                     f"{r['peak_bandwidth'] / 1e9:.0f} GB/s peak (bound {bound:.0f} tok/s)")
        lines.append(line)
    lines.append(f"  load {r['load_s']:.2f} s")
    return "\n".join(lines)
