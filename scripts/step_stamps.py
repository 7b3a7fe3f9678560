"""%globaltimer stamps of every block of every kernel of a decode step, on the GPU.

The timeline (profile_decode.py) gives each kernel's start and end; under programmatic dependent
launch that hides what happens inside a launch: when its blocks were placed, when they reached
their wait (qc_grid_start), when the wait released them, and how long their body took after it.
This tool answers that, for a copy of the tree, without changing the tree itself:

    python scripts/step_stamps.py patch TREE
        rewrites the kernels of TREE (a copy of this repository: never the working tree) so
        that thread 0 of every block records, in a ring in device memory: its entry, its arrival
        at qc_grid_start's wait, its release, its end (a guard object in every __global__
        body), and inner marks 4.. in the decode kernels (below). The backend writes the ring
        to the file $QC_STAMPS when it is destroyed. TREE/stamp_tags.txt names the kernels.
        Build TREE as usual (QWENCUDA_CUDA=1 python setup.py build_ext --inplace).
    python scripts/step_stamps.py decode MODEL [STEPS] [PROMPT]
        with the patched build first on sys.path and QC_STAMPS set: the bench's decode round
        (qwencuda.bench), a PROMPT-token prefill (512; the bench's depth 2048 is 2560 keys) and
        STEPS (64) greedy steps.
    python scripts/step_stamps.py kernels DUMP TAGS [STEPS]
        per kernel of the last STEPS (8) decode steps, medians in us: crit (the next grid's
        first release minus this one's: its share of the step), gap (first release minus the
        grid before's last end), placed (last block's entry minus the first release: > 0 means
        blocks placed after it), ready (last arrival at the wait minus the first release),
        spread (last release minus first), body (median over blocks of end minus release),
        span (last end minus first release), early (first release minus first entry).
    python scripts/step_stamps.py layers DUMP TAGS [STEP]
        one decode step (STEP: -3, the third from last), grid by grid in launch order: entry
        (P0, P1), last arrival at the wait (Y1), releases (R0, R1), ends (Emed, E1), median
        body, and the inner marks' medians after each block's release (m4-R, m5-R, m6-R).

Inner marks: the 8-bit decode GEMVs (matmul.cu, matmul_swiglu.cu) 4 = their weight rows in
shared memory (the lm_head's four-row kernel's too), 5 = the dot products done; qkv_attention.cu
4 = x normalised, 5 = the rows exchanged in the cluster, 6 = the attention's partials done;
flash_attention.cu 4 = the block's keys walked, 5 = its split counted (QWENCUDA_FLASH_MERGE=tail
only: the last block merges after it).

Each translation unit keeps the last 2^19 blocks it launched: at 0.5B, matmul.cu's ~60k a step (the lm_head alone
38k) fill that in ~9 steps, so the kernels report takes the last 8. (2^20 failed to link on the H100 machine.)

Cost: an atomic at each block's entry (its result used only at the end) and eight stores at its
end: the real file's 0.5B decode ran 1756 tok/s stamped against 1913-1921 (H100), so compare
stamped builds with stamped builds. What it found is in bench/results/20261125-c5a1fd0-*.
The cost is not the same for every kernel, so a stamped gain needs the bench's confirmation: a
gate/up kernel in 16-row blocks took a stamped step from 510.5 to 493.7 us, while the bench and
profile_decode.py's timeline (no work added to the kernels) saw it even (report 3ab6c39,
addendum "Probes on aa57892").
"""
import pathlib
import re
import sys

INFRA = r'''
/* ---- step_stamps.py: %globaltimer stamps of every block (a measuring copy of the tree only) ---- */
#include <stdio.h>
#define QC_ST_RING (1u << 19)   /* 512k blocks: matmul.cu launches ~60k a 0.5B step */
#define QC_ST_EV 8
struct qc_st_rec { unsigned tag, block, nblocks, smid; unsigned long long t[QC_ST_EV]; };
static __device__ qc_st_rec qc_st_r[QC_ST_RING];
static __device__ unsigned qc_st_count;
static __shared__ unsigned long long qc_st_ts[QC_ST_EV];
__device__ __forceinline__ unsigned long long qc_st_now() {
    unsigned long long v; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v)); return v;
}
/* events: 0 entry, 1 at the wait, 2 released, 3 end; 4.. inner marks */
__device__ __forceinline__ void qc_st_mark(int ev) {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    qc_st_ts[ev] = qc_st_now();
}
struct qc_st_guard {
    unsigned tag, slot;
    __device__ __forceinline__ qc_st_guard(unsigned t) : tag(t), slot(0) {
        if (threadIdx.x | threadIdx.y | threadIdx.z) return;
        qc_st_ts[0] = qc_st_now();
#pragma unroll
        for (int k = 1; k < QC_ST_EV; k++) qc_st_ts[k] = 0;
        slot = atomicAdd(&qc_st_count, 1u) & (QC_ST_RING - 1);   /* used at the end only: no stall here */
    }
    __device__ __forceinline__ ~qc_st_guard() {
        if (threadIdx.x | threadIdx.y | threadIdx.z) return;
        const unsigned long long now = qc_st_now();
        unsigned sm; asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        qc_st_rec &r = qc_st_r[slot];
        r.tag = tag; r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        r.nblocks = gridDim.x * gridDim.y * gridDim.z; r.smid = sm;
#pragma unroll
        for (int k = 0; k < QC_ST_EV; k++) r.t[k] = k == 3 ? now : qc_st_ts[k];
    }
};
extern "C" int qc_st_register(void (*dump)(FILE *));
static void qc_st_dump_tu(FILE *f) {
    static qc_st_rec r[QC_ST_RING];
    if (cudaMemcpyFromSymbol(r, qc_st_r, sizeof r) != cudaSuccess) return;
    for (unsigned i = 0; i < QC_ST_RING; i++)
        if (r[i].tag) fwrite(&r[i], sizeof r[i], 1, f);
}
static int qc_st_registered_ = qc_st_register(qc_st_dump_tu);
'''

INNER = [
    # (file, text, text with the mark after it, occurrences)
    ("kernels/matmul.cu", "    if constexpr (SH) qc_copy_wait();\n", "    if constexpr (SH) qc_copy_wait();\n    qc_st_mark(4);\n", 3),
    ("kernels/matmul.cu", "    qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);\n",
     "    qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);\n    qc_st_mark(5);\n", 1),
    ("kernels/matmul.cu", "    if (S > 1) {", "    qc_st_mark(5);\n    if (S > 1) {", 1),
    ("kernels/matmul.cu", "    qc_copy_wait();\n    const float res", "    qc_copy_wait();\n    qc_st_mark(4);\n    const float res", 1),
    ("kernels/matmul.cu", "    __syncthreads();\n    if (!writer) return;\n",
     "    __syncthreads();\n    qc_st_mark(5);\n    if (!writer) return;\n", 1),
    ("kernels/matmul_swiglu.cu", "        else qc_copy_wait();\n    }\n", "        else qc_copy_wait();\n    }\n    qc_st_mark(4);\n", 1),
    ("kernels/matmul_swiglu.cu", "    qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);\n",
     "    qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);\n    qc_st_mark(5);\n", 1),
    ("kernels/qkv_attention.cu", "    const qc_q8x xs = {xs_qs, xs_ds, P.dim, P.dim / 32};\n",
     "    const qc_q8x xs = {xs_qs, xs_ds, P.dim, P.dim / 32};\n    qc_st_mark(4);\n", 1),
    ("kernels/qkv_attention.cu", "    qc_qa_wait_bytes(&rows_in);\n", "    qc_qa_wait_bytes(&rows_in);\n    qc_st_mark(5);\n", 1),
    ("kernels/qkv_attention.cu", "    __syncthreads();   /* this block's partials complete */\n",
     "    __syncthreads();   /* this block's partials complete */\n    qc_st_mark(6);\n", 1),
    ("kernels/flash_attention.cu", "    qc_cp_async_wait<0>();\n\n#pragma unroll\n",
     "    qc_cp_async_wait<0>();\n    qc_st_mark(4);\n\n#pragma unroll\n", 1),
    ("kernels/flash_attention.cu", "        if (!last_block) return;\n",
     "        qc_st_mark(5);\n        if (!last_block) return;\n", 1),
]


def _replace(path, old, new, count=1):
    text = path.read_text()
    if text.count(old) != count:
        raise SystemExit(f"step_stamps: {path}: expected {count} of {old.strip()[:60]!r}, found {text.count(old)}"
                         " (the kernels changed: update step_stamps.py)")
    path.write_text(text.replace(old, new))


def _close(src, i):
    """Index of the parenthesis that closes the one at src[i]."""
    depth = 0
    for k in range(i, len(src)):
        depth += {"(": 1, ")": -1}.get(src[k], 0)
        if depth == 0:
            return k
    raise ValueError("unbalanced parentheses")


def patch(tree):
    t = pathlib.Path(tree)
    if (t / ".git").exists():
        raise SystemExit("step_stamps: patch a copy of the tree, not a git checkout")
    _replace(t / "kernels/qc_cuda.cuh", "/* ---- programmatic dependent launch (PDL, sm_90+) ----",
             INFRA + "/* ---- programmatic dependent launch (PDL, sm_90+) ----")
    _replace(t / "kernels/qc_cuda.cuh", '    asm volatile("griddepcontrol.wait;" ::: "memory");\n',
             '    qc_st_mark(1);\n    asm volatile("griddepcontrol.wait;" ::: "memory");\n    qc_st_mark(2);\n')
    tags = []
    for f in sorted((t / "kernels").glob("*.cu")):
        src, out, i = f.read_text(), [], 0
        for m in re.finditer(r"__global__\s", src):
            if m.start() < i:
                continue
            j = m.end()
            k = src.index("(", j)
            while src[j:k].strip().endswith("__launch_bounds__"):
                j = _close(src, k) + 1
                k = src.index("(", j)
            name = src[j:k].split()[-1]
            brace = src.index("{", _close(src, k))
            if ";" in src[_close(src, k):brace]:
                continue   # a declaration
            tags.append(f"{f.name}:{name}")
            out += [src[i:brace + 1], f" qc_st_guard qc_st_g_({len(tags)});"]
            i = brace + 1
        f.write_text("".join(out) + src[i:])
    (t / "stamp_tags.txt").write_text("none\n" + "\n".join(tags) + "\n")
    for path, old, new, count in INNER:
        _replace(t / path, old, new, count)
    _replace(t / "kernels/cuda_backend.cu", "static void cu_destroy(qc_backend *be) {\n",
             "static void (*qc_st_dumps[64])(FILE *);\nstatic int qc_st_ndumps;\n"
             "extern \"C\" int qc_st_register(void (*dump)(FILE *)) {\n"
             "    if (qc_st_ndumps < 64) qc_st_dumps[qc_st_ndumps++] = dump;\n    return 0;\n}\n"
             "static void cu_destroy(qc_backend *be) {\n")
    _replace(t / "kernels/cuda_backend.cu", "            if (cu->stream) cudaStreamSynchronize(cu->stream);\n",
             "            if (cu->stream) cudaStreamSynchronize(cu->stream);\n"
             "            if (getenv(\"QC_STAMPS\")) {\n"
             "                FILE *f = fopen(getenv(\"QC_STAMPS\"), \"wb\");\n"
             "                if (f) { for (int i = 0; i < qc_st_ndumps; i++) qc_st_dumps[i](f); fclose(f); }\n"
             "            }\n")
    print(f"{len(tags)} kernels stamped; names in {t / 'stamp_tags.txt'}")


def decode(model, steps=64, prompt=512, device="cuda"):
    """The bench's decode round (qwencuda.bench): a prompt-token prefill, then steps greedy steps."""
    import qwencuda
    from qwencuda.bench import _one_round
    with qwencuda.Model(model, device=device) as m:
        _one_round(m, [(1000 + 7 * i) % m.config.n_vocab for i in range(prompt)], steps)


def load(dump, tags):
    """The records and the kernel names: (tag, block, nblocks, sm, t[8]) per block, times in ns."""
    import numpy as np
    dt = np.dtype([("tag", "<u4"), ("block", "<u4"), ("nb", "<u4"), ("sm", "<u4"), ("t", "<u8", 8)])
    r = np.fromfile(dump, dt)
    names = [line.split(":")[-1] for line in pathlib.Path(tags).read_text().split("\n")]
    return r, r["t"].astype(np.int64), np.array([names[x] if x < len(names) else "?" for x in r["tag"]])


def grids(r, t, name):
    """Blocks grouped into launches: the same kernel and grid size, entered within 8 us of the
    one before, at most nblocks of them; each grid's times (ns)."""
    import numpy as np
    order = np.lexsort((t[:, 0], r["nb"], r["tag"]))
    groups, cur = [], [order[0]]
    for a, b in zip(order, order[1:]):
        if (r["tag"][a] == r["tag"][b] and r["nb"][a] == r["nb"][b] and t[b, 0] - t[a, 0] < 8000
                and len(cur) < r["nb"][a]):
            cur.append(b)
        else:
            groups.append(cur)
            cur = [b]
    groups.append(cur)
    out = []
    for g in groups:
        tt = t[g]
        waited = tt[:, 2] > 0
        rel = np.where(waited, tt[:, 2], tt[:, 0])
        out.append(dict(name=name[g[0]], nb=int(r["nb"][g[0]]), n=len(g), P0=tt[:, 0].min(), P1=tt[:, 0].max(),
                        Y1=tt[waited, 1].max() if waited.any() else tt[:, 0].max(), R0=rel.min(), R1=rel.max(),
                        Emed=float(np.median(tt[:, 3])), E1=tt[:, 3].max(),
                        body=float(np.median(tt[:, 3] - np.maximum(rel, tt[:, 0]))),
                        marks=[float(np.median(tt[tt[:, m] > 0, m] - rel[tt[:, m] > 0])) if (tt[:, m] > 0).any()
                               else None for m in (4, 5, 6)]))
    return sorted(out, key=lambda d: d["R0"])


def steps_of(G):
    """Index ranges of the decode steps: from one embed launch to the next."""
    starts = [i for i, d in enumerate(G) if d["name"] == "qc_embed_kernel"]
    return list(zip(starts, starts[1:]))


def kernels(dump, tags, nsteps=8):
    import numpy as np
    G = grids(*load(dump, tags))
    spans = steps_of(G)[-nsteps:]
    if not spans:
        raise SystemExit("step_stamps: no decode step in the dump")
    rows = {}
    for a, b in spans:
        seq = G[a:b]
        for i, d in enumerate(seq):
            crit = (seq[i + 1]["R0"] if i + 1 < len(seq) else d["E1"]) - d["R0"]
            gap = d["R0"] - seq[i - 1]["E1"] if i else 0
            rows.setdefault(f"{d['name']}[{d['nb']}]", []).append(
                [crit, gap, d["P1"] - d["R0"], d["Y1"] - d["R0"], d["R1"] - d["R0"], d["body"], d["E1"] - d["R0"],
                 d["R0"] - d["P0"]])
    step_us = [(G[b - 1]["E1"] - G[a]["R0"]) / 1000 for a, b in spans]
    print(f"{len(spans)} steps, median {np.median(step_us):.1f} us from the first release to the last end")
    cols = ("crit", "gap", "placed", "ready", "spread", "body", "span", "early")
    print(f"{'kernel[blocks]':44s} {'count':>5s} " + " ".join(f"{c:>6s}" for c in cols) + "  crit/step")
    for k, v in sorted(rows.items(), key=lambda kv: -sum(x[0] for x in kv[1])):
        a = np.array(v, float) / 1000
        print(f"{k:44s} {len(v):5d} " + " ".join(f"{x:6.2f}" for x in np.median(a, 0))
              + f"  {a[:, 0].sum() / len(spans):8.1f}")


def layers(dump, tags, step=-3):
    G = grids(*load(dump, tags))
    a, b = steps_of(G)[step]
    seq = G[a - 1:b]   # from the launch before the embed (the step before's last)
    t0 = seq[0]["R0"]
    print(f"{'#':>3s} {'kernel':34s} {'blk':>5s} " + " ".join(
        f"{c:>7s}" for c in ("P0", "P1", "Y1", "R0", "R1", "Emed", "E1", "body", "m4-R", "m5-R", "m6-R")))
    for i, d in enumerate(seq):
        v = [d[k] - t0 for k in ("P0", "P1", "Y1", "R0", "R1", "Emed", "E1")] + [d["body"]]
        marks = " ".join("      -" if m is None else f"{m / 1000:7.2f}" for m in d["marks"])
        print(f"{i:3d} {d['name'][:34]:34s} {d['n']:5d} " + " ".join(f"{x / 1000:7.2f}" for x in v) + " " + marks)


if __name__ == "__main__":
    cmd, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if cmd == "patch" and len(args) == 1:
        patch(args[0])
    elif cmd == "decode" and 1 <= len(args) <= 3:
        decode(args[0], *map(int, args[1:]))
    elif cmd == "kernels" and 2 <= len(args) <= 3:
        kernels(args[0], args[1], *map(int, args[2:]))
    elif cmd == "layers" and 2 <= len(args) <= 3:
        layers(args[0], args[1], *map(int, args[2:]))
    else:
        raise SystemExit(__doc__)
