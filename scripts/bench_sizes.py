#!/usr/bin/env python3
"""qwencuda beside llama.cpp at every Qwen2.5 size: the table of issue #16.

    python scripts/bench_sizes.py --llama-bench ~/llama.cpp/build/bin/llama-bench
    python scripts/bench_sizes.py --shapes 7B 14B --types q4_k_m --dir /scratch
    python scripts/bench_sizes.py --shapes tiny-hd64 --types q8_0 --device cpu --prompt-tokens 32 \\
        --gen-tokens 8     # a check of the script itself, on any machine

For each (shape, type) it writes a synthetic file with the real shape (qwencuda.synthetic:
random, well-formed blocks, about a minute for 15 GB), measures qwencuda (qwencuda.bench.run_bench,
what `python -m qwencuda bench` runs: median of --repeats after a warm-up) in a fresh Python
process, then, with --llama-bench, llama-bench on the same file (-ngl 99 -fa 1 -p P -n N -r R
-o json), and deletes the file (--keep keeps it). A model that does not fit in the GPU's memory
is reported as such (qwencuda raises MemoryError; the row says so). Progress goes to stderr; the
markdown table, with the device and both commits, to stdout at the end (and every result as
JSON with --json FILE).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))   # the checkout's qwencuda when run from scripts/

# qwencuda's measurement in a child process: a crash or an out-of-memory there leaves this loop
# (and the GPU's memory) intact. Prints one JSON object.
_CHILD = r"""
import json, sys
from qwencuda import bench
path, device, p, n, r = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
try:
    res = bench.run_bench(path, device, p, n, r)
    print(bench.format_bench(res), file=sys.stderr, flush=True)
except MemoryError as e:
    res = {"error": "does not fit", "message": str(e)}
print(json.dumps(res))
"""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _gb(n):
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def gpu_free_bytes(device):
    """Free memory of the GPU that device names, from nvidia-smi (this process never touches CUDA,
    so that its own context takes nothing from the measurements); None when unknown."""
    if not device.startswith("cuda"):
        return None
    index = device.split(":")[1] if ":" in device else "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits",
                              "-i", index], capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0]) << 20 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _label(shape, wtype, cfg):
    tied = "tied" if cfg["tied"] else "untied"
    return (f"{shape} {wtype.upper()} (dim {cfg['dim']}, {cfg['n_layer']} layers, "
            f"{cfg['n_head']}/{cfg['n_head_kv']} heads, {tied})")


def run_qwencuda(path, args):
    cmd = [sys.executable, "-c", _CHILD, path, args.device, str(args.prompt_tokens),
           str(args.gen_tokens), str(args.repeats)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(_HERE), env.get("PYTHONPATH")) if p)
    if os.environ.get("PYTHONPATH"):   # a private build (scripts/devbuild.sh) comes first
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    if out.returncode != 0:
        return {"error": f"qwencuda failed (exit {out.returncode})"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama(path, args):
    cmd = [args.llama_bench, "-m", path, "-ngl", "99", "-fa", "1", "-p", str(args.prompt_tokens),
           "-n", str(args.gen_tokens), "-r", str(args.repeats), "-o", "json"] + args.llama_args
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-3:]
        return {"error": f"llama-bench failed (exit {out.returncode})", "stderr": tail}
    res = {"raw": json.loads(out.stdout)}
    for r in res["raw"]:
        key = "prefill_tok_s" if r.get("n_gen", 0) == 0 else "decode_tok_s"
        res[key] = r["avg_ts"]
        res["build_commit"] = r.get("build_commit")
        res["gpu_info"] = r.get("gpu_info")
    return res


def _fmt(x):
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 10000 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _ratio(q, l):
    return f"{q / l:.2f}" if q and l else "-"


def table(rows, args):
    p, n = args.prompt_tokens, args.gen_tokens
    lines = [f"| model | llama.cpp prefill {p} | qwencuda | ratio | llama.cpp decode {n} | qwencuda | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        q, l = r.get("qwencuda") or {}, r.get("llama") or {}
        if r.get("skipped"):
            lines.append(f"| {r['label']} | {r['skipped']} | | | | | |")
            continue
        qp, qd = q.get("prefill_tok_s"), q.get("decode_tok_s")
        lp, ld = l.get("prefill_tok_s"), l.get("decode_tok_s")
        qp_s = q.get("error") or _fmt(qp)
        lp_s = l.get("error") or _fmt(lp) if args.llama_bench else "-"
        lines.append(f"| {r['label']}, {_gb(r['bytes'])} | {lp_s} | {qp_s} | {_ratio(qp, lp)} | "
                     f"{_fmt(ld) if args.llama_bench else '-'} | {'' if q.get('error') else _fmt(qd)} | {_ratio(qd, ld)} |")
    return "\n".join(lines)


def header(rows, args):
    q = next((r["qwencuda"] for r in rows if r.get("qwencuda") and "commit" in r["qwencuda"]), {})
    l = next((r["llama"] for r in rows if r.get("llama") and r["llama"].get("build_commit")), {})
    m = q.get("machine") or {}
    dev = m.get("gpu") or f"{m.get('cpu', '?')} ({q.get('threads') or m.get('cores')} threads)"
    commit = q.get("commit") or "at an unknown commit"
    s = (f"Device: {dev} ({args.device}). qwencuda {commit} (qwencuda.bench.run_bench, "
         f"median of {args.repeats}); prefill {args.prompt_tokens}, decode {args.gen_tokens} tokens.")
    if args.llama_bench:
        s += (f" llama.cpp {l.get('build_commit', '?')} (llama-bench -ngl 99 -fa 1 -r {args.repeats}"
              f"{' ' + ' '.join(args.llama_args) if args.llama_args else ''}; mean).")
    return s + " Synthetic files of the real shapes (qwencuda.synthetic.write_random_model)."


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5B", "1.5B", "3B", "7B"],
                    help="names of qwencuda.synthetic.SHAPES (0.5B .. 72B) or of qwencuda.testing.CONFIGS "
                         "(tiny-hd64, ...: a quick check of this script)")
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_k_m"],
                    help="weight types (qwencuda.testing.WEIGHT_TYPES)")
    ap.add_argument("--dir", default="/tmp/qwencuda-bench-sizes", help="where the files are written")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", metavar="PATH", help="llama-bench binary: measure llama.cpp too")
    ap.add_argument("--llama-args", nargs=argparse.REMAINDER, default=[],
                    help="extra llama-bench arguments (last on the command line)")
    ap.add_argument("--files", nargs="+", default=[], metavar="GGUF",
                    help="existing files measured too, first (e.g. the real 0.5B Q4_K_M); never deleted")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--json", metavar="FILE", help="write every result as JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from qwencuda import synthetic, testing

    for t in args.types:
        if t not in testing.WEIGHT_TYPES:
            ap.error(f"unknown type {t!r}; known: {', '.join(testing.WEIGHT_TYPES)}")
    try:
        for s in args.shapes:
            synthetic.resolve_shape(s)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.dir, exist_ok=True)

    rows, todo = [], [(s, t) for s in args.shapes for t in args.types]
    for path in args.files:
        row = {"file": path, "label": f"{os.path.basename(path)} (a real file)", "bytes": os.path.getsize(path)}
        rows.append(row)
        log(f"[file] {path}: qwencuda bench on {args.device}")
        row["qwencuda"] = run_qwencuda(path, args)
        if args.llama_bench:
            log(f"[file] {path}: llama-bench")
            row["llama"] = run_llama(path, args)
    for i, (shape, wtype) in enumerate(todo, 1):
        cfg = synthetic.resolve_shape(shape)
        size = synthetic.model_bytes(shape, wtype)
        row = {"shape": shape, "type": wtype, "label": _label(shape, wtype, cfg), "bytes": size}
        rows.append(row)
        free = shutil.disk_usage(args.dir).free
        gpu_free = gpu_free_bytes(args.device)
        need = synthetic.memory_needed(shape, wtype, args.prompt_tokens + args.gen_tokens)["total"]
        if size + (1 << 28) > free:
            row["skipped"] = f"not written: {_gb(size)} > {_gb(free)} free in {args.dir}"
        elif gpu_free is not None and need + (1 << 30) > gpu_free:
            row["skipped"] = f"does not fit: {_gb(need)} + 1 GB > {_gb(gpu_free)} free on {args.device}"
        if row.get("skipped"):
            log(f"[{i}/{len(todo)}] {shape} {wtype}: {row['skipped']}")
            continue
        path = os.path.join(args.dir, f"qwen2.5-{shape}-{wtype}.gguf")
        try:
            t0 = time.perf_counter()
            log(f"[{i}/{len(todo)}] {shape} {wtype}: writing {_gb(size)} to {path}")
            tenth = [0]

            def progress(done, total):   # every tenth of the file
                if done * 10 // total > tenth[0]:
                    tenth[0] = done * 10 // total
                    log(f"  {done / 1e9:.1f} / {total / 1e9:.1f} GB, {time.perf_counter() - t0:.0f} s")
            synthetic.write_random_model(path, shape, wtype, seed=args.seed, progress=progress)
            row["write_s"] = time.perf_counter() - t0
            log(f"[{i}/{len(todo)}] {shape} {wtype}: written in {row['write_s']:.0f} s; qwencuda bench on {args.device}")
            row["qwencuda"] = run_qwencuda(path, args)
            if args.llama_bench:
                log(f"[{i}/{len(todo)}] {shape} {wtype}: llama-bench")
                row["llama"] = run_llama(path, args)
                l = row["llama"]
                log(f"  llama.cpp: {l.get('error') or ''} prefill {_fmt(l.get('prefill_tok_s'))} tok/s, "
                    f"decode {_fmt(l.get('decode_tok_s'))} tok/s")
        finally:
            if not args.keep and os.path.exists(path):
                os.remove(path)
        if args.json:   # after every row, so that an interrupted run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1, default=str)
    print(header(rows, args))
    print()
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
