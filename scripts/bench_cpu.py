"""qwencuda beside llama.cpp on the CPU, rounds interleaved, for the CPU report in bench/results.

    python scripts/bench_cpu.py --llama-bench PATH [--model FILE] [--threads 2]
        [--work 128/32 512/128] [--rounds 5] [--repeats 3] [--json OUT.json] [--commit C]
        [--llama-depth0]

Each round runs, back to back and for each work P/N: llama-bench (-t T -r R, see below) and
`qwencuda.bench.run_bench(FILE, "cpu", P, N, R, threads=T)` (in this process, a fresh Model
per round), and notes the load average before it, since a shared machine's other work shows in
every figure. Interleaving puts both engines under the same conditions; the medians over the
rounds and each round's ratio are printed as a markdown table.

What is compared: prefill of P tokens, and N decode steps after them. qwencuda's decode follows
its prefill, so llama.cpp's is run after P tokens too (`-p 0 -n N -d P`, a second llama-bench
call); --llama-depth0 compares with llama-bench's plain tg N from an empty cache instead (the
easier work for llama.cpp).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def llama_bench_rows(llama_bench, args):
    """{"pp": tok/s, "tg": tok/s} from llama-bench's JSON records (avg_ts: the mean of its
    repeats; a record with n_gen 0 is a prefill), as scripts/bench_sizes.py reads them."""
    env = dict(os.environ)
    libdir = os.path.dirname(os.path.realpath(llama_bench))
    env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    out = subprocess.run([llama_bench] + args + ["-o", "json"], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-500:]}")
    return {("pp" if r.get("n_gen", 0) == 0 else "tg"): r["avg_ts"] for r in json.loads(out.stdout)}


def llama_run(llama_bench, model, threads, p, n, repeats, same_depth):
    """(prefill tok/s, decode tok/s): pp P and tg N, the decode after P tokens (-d P) where
    same_depth (qwencuda's decode follows its prefill), else from an empty cache."""
    common = ["-m", model, "-t", str(threads), "-r", str(repeats)]
    if same_depth:
        pp = llama_bench_rows(llama_bench, common + ["-p", str(p), "-n", "0"]).get("pp")
        tg = llama_bench_rows(llama_bench, common + ["-p", "0", "-n", str(n), "-d", str(p)]).get("tg")
    else:
        got = llama_bench_rows(llama_bench, common + ["-p", str(p), "-n", str(n)])
        pp, tg = got.get("pp"), got.get("tg")
    if pp is None or tg is None:
        raise RuntimeError("llama-bench printed no pp/tg rows")
    return pp, tg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True, metavar="PATH")
    ap.add_argument("--model", default=None, help="default: qwencuda.default_model_path()")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work", nargs="+", default=["128/32", "512/128"], metavar="P/N")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--llama-depth0", action="store_true",
                    help="llama-bench's plain tg N (from an empty cache) instead of tg N after P tokens (-d P)")
    ap.add_argument("--commit", default=None, help="the commit to name when the source tree is not a git checkout")
    args = ap.parse_args(argv)

    import qwencuda
    from qwencuda.bench import run_bench

    model = args.model or qwencuda.default_model_path()
    work = [tuple(int(v) for v in w.split("/")) for w in args.work]
    rows = []
    for rnd in range(args.rounds):
        for p, n in work:
            load = os.getloadavg()[0]
            lp, ln = llama_run(args.llama_bench, model, args.threads, p, n, args.repeats, not args.llama_depth0)
            r = run_bench(model, "cpu", prompt_tokens=p, gen_tokens=n, repeats=args.repeats, threads=args.threads)
            row = {"round": rnd + 1, "p": p, "n": n, "load": load, "time": time.strftime("%H:%M:%S"),
                   "llama_prefill": lp, "llama_decode": ln,
                   "qc_prefill": r["prefill_tok_s"], "qc_decode": r["decode_tok_s"],
                   "commit": r["commit"] or args.commit, "cpu_kernels": r["cpu_kernels"], "cpu": r["machine"]["cpu"]}
            rows.append(row)
            print(f"round {rnd + 1} {p}/{n} (load {load:.2f}): llama.cpp {lp:.1f} / {ln:.1f}, "
                  f"qwencuda {row['qc_prefill']:.1f} / {row['qc_decode']:.1f} tok/s", file=sys.stderr, flush=True)

    first = rows[0]
    print(f"# qwencuda vs llama.cpp on the CPU: {first['cpu']}, {args.threads} threads")
    print(f"\nmodel {os.path.basename(model)}; qwencuda {first['commit']} ({first['cpu_kernels']}); "
          f"llama-bench {args.llama_bench}; {args.rounds} rounds; per round, qwencuda's median and "
          f"llama-bench's mean of {args.repeats} repeats; the table: medians over the rounds; llama.cpp's "
          f"decode {'from an empty cache' if args.llama_depth0 else 'after the P prompt tokens (-d P), as qwencuda'}\n")
    print("| work | llama.cpp prefill | qwencuda prefill | ratio (per round) | llama.cpp decode | qwencuda decode | ratio (per round) |")
    print("|---|---|---|---|---|---|---|")
    for p, n in work:
        mine = [r for r in rows if r["p"] == p and r["n"] == n]
        med = lambda k: statistics.median(r[k] for r in mine)
        rp = " ".join(f"{r['qc_prefill'] / r['llama_prefill']:.2f}" for r in mine)
        rd = " ".join(f"{r['qc_decode'] / r['llama_decode']:.2f}" for r in mine)
        print(f"| {p}/{n} | {med('llama_prefill'):.1f} | {med('qc_prefill'):.1f} | {rp} | "
              f"{med('llama_decode'):.1f} | {med('qc_decode'):.1f} | {rd} |")
    print("\nrounds (load average before each):")
    for r in rows:
        print(f"- {r['time']} round {r['round']} {r['p']}/{r['n']} load {r['load']:.2f}: llama.cpp "
              f"{r['llama_prefill']:.1f} / {r['llama_decode']:.1f}, qwencuda {r['qc_prefill']:.1f} / "
              f"{r['qc_decode']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
