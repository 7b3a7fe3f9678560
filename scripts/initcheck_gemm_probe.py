#!/usr/bin/env python3
"""Which prefill GEMM stores can compute-sanitizer's initcheck see? (issue 19 item 7)

One CUDA matmul of n > 8 tokens (the cuBLAS prefill path of kernels/matmul.cu) per weight type,
its output copied to the host by the kernels API; the result is checked against NumPy. Run each
type under the tool and count the reports:

    for t in F32 F16 Q8_0 Q4_K; do
        compute-sanitizer --tool initcheck python scripts/initcheck_gemm_probe.py $t 2>&1 |
            grep -c "Uninitialized" ; done

Reading of the outcomes:
  - F32 (fp32 sgemm, no f16 conversion, no tiles): 0 reports expected.
  - F16 (cuBLAS f16 tensor-op GEMM on the weights in place: no dequantization tile involved):
    reports here, with a right result, put the blind spot in cuBLAS's stores (its sm_90 kernels
    write C through the TMA unit), not in qwencuda's tiles or bias add.
  - Q8_0 / Q4_K (tiles decoded by qc_dequant_rows_kernel, then the same GEMM): as F16.
  - the result differs from NumPy, or F16 has 0 reports while Q8_0 has some: a real bug in the
    tiled path (tests/test_cuda_prefill_writes.py should then fail too).
With --bias the output also goes through qc_add_bias_kernel (a device read of the GEMM output).
"""
import sys

import numpy as np

import qwencuda as qc
from qwencuda import kernels as K


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    wtype = (args[0] if args else "Q8_0").upper()
    rng = np.random.default_rng(0)
    rows, cols, n = 896, 896, 30
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    bias = (rng.standard_normal(rows) * 10).astype(np.float32) if "--bias" in sys.argv else None
    W = K.Weight.from_float(w, wtype)
    wq = K.dequantize(W)                     # the stored values, decoded on the CPU
    got = K.matmul(W, x, bias=bias, device="cuda")
    want = x.astype(np.float64) @ wq.T.astype(np.float64) + (0 if bias is None else bias)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"{wtype}: n={n} max error {err:.2e} (f16 activations: ~1e-3 expected)")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
