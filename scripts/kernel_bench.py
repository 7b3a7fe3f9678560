"""Matmul speed per weight type at Qwen2.5-0.5B shapes, through the shipped backend op
(qwencuda.kernels.time_matmul: timed in C, weights already on the device).

    python scripts/kernel_bench.py [--device cuda] [--iters 200] [--shapes 0.5B|7B] [--tokens 1,8,512]

Prints, per type and shape, microseconds per call and the weight-read bandwidth (stored bytes /
time) for decode (n = 1), a short batch (n = 8, the batched GEMV) and prefill (n = 512, cuBLAS),
or the --tokens given.
Weights are random blocks with finite scales: the speed does not depend on the values.
"""
import argparse
import sys

import numpy as np

from qwencuda import kernels as K

SHAPES = {
    "0.5B": {"attn_q / o (896x896)": (896, 896), "ffn_up (4864x896)": (4864, 896),
             "ffn_down (896x4864)": (896, 4864), "lm_head (151936x896)": (151936, 896)},
    "7B": {"attn_k / v (512x3584)": (512, 3584), "attn_q / o (3584x3584)": (3584, 3584),
           "ffn_up (18944x3584)": (18944, 3584), "ffn_down (3584x18944)": (3584, 18944),
           "lm_head (152064x3584)": (152064, 3584)},
}
TYPES = ["F16", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "BF16", "F32", "Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q5_K"]
HALF = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
        "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def weight(type_name, rows, cols, rng):
    info = {t["name"]: t for t in K._core.type_info()}[type_name]
    if cols % info["block_size"]:
        return None
    if type_name == "F32":
        return K.Weight(rng.standard_normal((rows, cols), dtype=np.float32), "F32", (rows, cols))
    if type_name in ("F16", "BF16"):
        raw = rng.standard_normal((rows, cols), dtype=np.float32).astype(np.float16).view(np.uint16)
        return K.Weight(raw, type_name, (rows, cols))
    nb = cols // info["block_size"]
    raw = rng.integers(0, 256, size=(rows, nb, info["type_size"]), dtype=np.uint8)
    for off in HALF[type_name]:
        raw[:, :, off:off + 2] = (rng.standard_normal((rows, nb)) * 0.02).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return K.Weight(raw.reshape(rows, -1), type_name, (rows, cols))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="0.5B", help="the model's matrices")
    ap.add_argument("--tokens", default="1,8,512", help="comma-separated n of each call")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    tokens = [int(n) for n in args.tokens.split(",")]
    print(f"matmul on {args.device}, {args.shapes} shapes: us per call (weight GB/s) for n = "
          + " | ".join(map(str, tokens)))
    for t in args.types.split(","):
        for label, (rows, cols) in SHAPES[args.shapes].items():
            w = weight(t, rows, cols, rng)
            if w is None:
                continue
            cells = []
            for n in tokens:
                x = rng.standard_normal((n, cols), dtype=np.float32)
                iters = args.iters if n <= 8 else max(3, args.iters // 10)
                s = K.time_matmul(w, x, iters=iters, device=args.device)
                cells.append(f"{s * 1e6:9.1f} us ({w.nbytes / s / 1e9:6.0f} GB/s)")
            print(f"  {t:5s} {label:22s} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
