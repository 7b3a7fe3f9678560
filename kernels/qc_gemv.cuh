/* qc_gemv.cuh: the warp-per-row GEMV that every matmul kernel of decode and short batches
 * (n <= QC_GEMV_MAX_TOKENS) is built from: matmul and matmul_add (matmul.cu), matmul_multi
 * (matmul_multi.cu), matmul_swiglu (matmul_swiglu.cu). One function computes the dot products
 * of one stored row with up to NT tokens, so the fused kernels produce exactly the numbers of
 * the plain matmul kernel: the same loads, the same fmaf chain, the same shuffle reduction.
 *
 * Lane l takes parts l, l + 32, ... of the row (8 elements each, qc_dequant.cuh), so a warp
 * sweeps the row's bytes contiguously; up to NT tokens share each decoded part. Accumulation is
 * fp32.
 */
#ifndef QC_GEMV_CUH
#define QC_GEMV_CUH

#include "qc_cuda.cuh"
#include "qc_dequant.cuh"

#define QC_GEMV_WARPS 4                 /* rows per block of the GEMV kernels */

/* Each acc[j] summed over the 32 lanes of the warp, into every lane: the xor shuffles that end
 * every row GEMV (float and 8-bit), so all of them add in one order. */
template <int NT>
__device__ __forceinline__ void qc_warp_sum(float (&acc)[NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
    }
}

/* The same for two rows' accumulators (the two-row GEMVs), their shuffles interleaved. */
template <int NT>
__device__ __forceinline__ void qc_warp_sum2(float (&acc_a)[NT], float (&acc_b)[NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            acc_a[j] += __shfl_xor_sync(0xffffffffu, acc_a[j], off);
            acc_b[j] += __shfl_xor_sync(0xffffffffu, acc_b[j], off);
        }
    }
}

/* x[8p .. 8p+8) of one activation row, zero past cols. */
__device__ __forceinline__ void qc_load_x8(const float *__restrict__ xr, int64_t p, int64_t cols,
                                           float v[8]) {
    const float *r = xr + 8 * p;
    if (8 * p + 8 <= cols && ((uintptr_t)r & 15) == 0) {
        const float4 a = __ldg((const float4 *)r), b = __ldg((const float4 *)(r + 4));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = 8 * p + k < cols ? __ldg(r + k) : 0.0f;
    }
}

/* The same from x in shared memory (a row normalised by the block, qc_norm_row_to_shared). */
__device__ __forceinline__ void qc_load_x8_shared(const float *xr, int64_t p, int64_t cols, float v[8]) {
    const float *r = xr + 8 * p;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = 8 * p + k < cols ? r[k] : 0.0f;
}

/* Widest row that the GEMV kernels normalise in shared memory (decode); wider ones, and evals
 * of several tokens, go through the rmsnorm op into a scratch buffer first. */
#define QC_NORM_FUSE_MAX_COLS 4096
/* x[i] / rms(x) * w[i] of one row of dim values into xs (shared memory), by a block of
 * QC_GEMV_WARPS warps, with rmsnorm's numbers bit for bit (qc_cuda.cuh): its 256 chains are
 * this block's two chains per thread. Every thread calls it. */
/* Its first half: 1 / rms(x), the rmsnorm kernel's value, in every thread; x[i] * scale * w[i]
 * is then element i, bit for bit (qc_norm_quantize_q8_kernel normalises only its own blocks).
 * x is in global memory, read through L2 (__ldcg: never a stale L1 line), or with XS in shared
 * memory (the persistent decode kernel copies it there first). x_sum (global x only): the row is
 * x + the folded down projection's sums (qc_x_plus_sum). */
template <bool XS = false>
__device__ __forceinline__ float qc_norm_row_scale(const float *__restrict__ x, int dim, float eps,
                                                   float *warp_sums, const long long *x_sum = nullptr) {
    static_assert(2 * 32 * QC_GEMV_WARPS == QC_NORM_ROW_THREADS, "two rmsnorm threads per thread");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss[2] = {0.0f, 0.0f};
    if (!XS && dim <= QC_NORM_FUSE_MAX_COLS) {
        /* from global memory, every value's load first, then the chains: the loads are in
         * flight together, not 14 L2 round trips one after another at 3584 values (the
         * norm-and-quantize kernel took 5.8 us a launch at 7B on the H100, report 967daae) */
        constexpr int PER = QC_NORM_FUSE_MAX_COLS / QC_NORM_ROW_THREADS;
        float v[2][PER];
#pragma unroll
        for (int m = 0; m < PER; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int i = tid + h * 32 * QC_GEMV_WARPS + m * QC_NORM_ROW_THREADS;
                v[h][m] = i < dim ? __ldcg(x + i) : 0.0f;
            }
        if (x_sum) {
            /* the sums' loads, all of them, then the adds: with the add beside each load (a
             * branch on x_sum between them), each load waited for the one before, and the output
             * norm's launch took 5.9 us from its release to its end, not 2.0 (H200, step stamps
             * of the real file, 2026-12-03). A loop of its own: loaded in x's loop (interleaved,
             * also all before any add), the kernel took 156 registers, not 119 (ptxas, nvcc 13) */
            long long s[2][PER];
#pragma unroll
            for (int m = 0; m < PER; m++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int i = tid + h * 32 * QC_GEMV_WARPS + m * QC_NORM_ROW_THREADS;
                    s[h][m] = i < dim ? __ldcg(x_sum + i) : 0;
                }
#pragma unroll
            for (int m = 0; m < PER; m++)
#pragma unroll
                for (int h = 0; h < 2; h++) v[h][m] += qc_sum_to_float(s[h][m]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int m = 0; m < PER; m++)
                if (tid + h * 32 * QC_GEMV_WARPS + m * QC_NORM_ROW_THREADS < dim) ss[h] = fmaf(v[h][m], v[h][m], ss[h]);
    } else {
#pragma unroll
        for (int h = 0; h < 2; h++)
            for (int i = tid + h * 32 * QC_GEMV_WARPS; i < dim; i += QC_NORM_ROW_THREADS) {
                float v;
                if constexpr (XS) v = x[i];
                else v = qc_x_plus_sum(x, x_sum, i);
                ss[h] = fmaf(v, v, ss[h]);
            }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        ss[h] = qc_norm_warp_sum(ss[h]);
        if (lane == 0) warp_sums[warp + h * QC_GEMV_WARPS] = ss[h];
    }
    __syncthreads();
    if (tid == 0) warp_sums[QC_NORM_ROW_THREADS / 32] = qc_norm_scale_of_warps(warp_sums, dim, eps);
    __syncthreads();
    return warp_sums[QC_NORM_ROW_THREADS / 32];
}
__device__ __forceinline__ void qc_norm_row_to_shared(const float *__restrict__ x,
                                                      const float *__restrict__ w, int dim,
                                                      float eps, float *xs, float *warp_sums) {
    const float scale = qc_norm_row_scale(x, dim, eps, warp_sums);
    for (int i = threadIdx.x; i < dim; i += 32 * QC_GEMV_WARPS) xs[i] = x[i] * scale * w[i];
    __syncthreads();
}
/* Widest row that the float-GEMV blocks of matmul_multi and matmul_swiglu each normalise for
 * themselves: wider ones are normalised once into a scratch buffer (one more launch). At 7B
 * shapes (3584) each of the 1152 q/k/v blocks and 4736 gate/up blocks redid a 14 KB norm: the
 * q/k/v GEMV of F16 weights ran at 0.9 TB/s (H100, bench/results); at 3B (2048) the 2752
 * gate/up blocks' norm reads came to half the weights' bytes: 3B F16 decoded 266 tok/s with
 * 2048 here, 288 with 1024, 1.5B 476 and 527 (bench/results/20261123-81e1645-...). */
#define QC_NORM_IN_BLOCK_MAX_COLS 1024

/* acc[r][j] = the sum over parts first, first + stride, ... of stored row r (type T) times
 * x[t0 + j], for the tokens t0 + j < n (0 for the others), this lane's share before the warp's
 * reduction; R rows (one, or gate and up) against each x part loaded once. Every float GEMV of
 * decode is this loop; two versions of it give the same sums bit for bit:
 * - qc_gemv_deq_rows, any type: each part decoded by qc_deq8, then multiplied;
 * - qc_gemv_plain_rows, for rows of a plain type (F32, F16, BF16) whose parts are all whole
 *   and 16-byte aligned: each lane's load of its next part goes out before this part is
 *   multiplied, so a warp keeps two parts per row in flight instead of one (of 1, 2 and 4 parts
 *   ahead, 1 was the best or within 3% of it for every F16 shape of 0.5B to 7B on the H100).
 *   The parts, their values (qc_part_decode is qc_deq8's decoding) and each accumulator's fmaf
 *   chain are the same; only when the loads are issued moves. Streaming loads: the weights
 *   are read once a token. On the H100 this took the F16 gate/up GEMV of the 3B and 7B shapes
 *   from 2.1 and 2.7 TB/s to 2.6 and 3.0 (bench/results/20261123-81e1645-nvidia-h100-f16-decode.md). */
template <int NT, bool XS, int R>
__device__ __forceinline__ void qc_gemv_fma_part(const float (&w)[R][8], const float *__restrict__ x,
                                                 int64_t p, int64_t cols, int n, int t0,
                                                 float (&acc)[R][NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (t0 + j < n) {
            float xv[8];
            if (XS) qc_load_x8_shared(x + (int64_t)(t0 + j) * cols, p, cols, xv);
            else qc_load_x8(x + (int64_t)(t0 + j) * cols, p, cols, xv);
#pragma unroll
            for (int k = 0; k < 8; k++)
#pragma unroll
                for (int r = 0; r < R; r++) acc[r][j] = fmaf(w[r][k], xv[k], acc[r][j]);
        }
    }
}
template <int T, int NT, bool XS, int R>
__device__ __forceinline__ void qc_gemv_deq_rows(const uint8_t *const (&row)[R], int64_t cols,
                                                 const float *__restrict__ x, int n, int t0,
                                                 int64_t first, int64_t stride, float (&acc)[R][NT]) {
    const int64_t parts = (cols + 7) / 8;
    for (int64_t p = first; p < parts; p += stride) {
        float w[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) qc_deq8<T>(row[r], p, cols, w[r]);
        qc_gemv_fma_part<NT, XS, R>(w, x, p, cols, n, t0, acc);
    }
}
template <int T, int NT, bool XS, int R>
__device__ __forceinline__ void qc_gemv_plain_rows(const uint8_t *const (&row)[R], int64_t cols,
                                                   const float *__restrict__ x, int n, int t0,
                                                   int64_t first, int64_t stride, float (&acc)[R][NT]) {
    const int64_t parts = cols / 8;
    typename qc_part<T>::raw next[R];
    if (first < parts) {
#pragma unroll
        for (int r = 0; r < R; r++) next[r] = qc_part_ld<T, true>(row[r], first);
    }
    for (int64_t p = first; p < parts; p += stride) {
        float w[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) qc_part_decode<T>(next[r], w[r]);
        if (p + stride < parts) {
#pragma unroll
            for (int r = 0; r < R; r++) next[r] = qc_part_ld<T, true>(row[r], p + stride);
        }
        qc_gemv_fma_part<NT, XS, R>(w, x, p, cols, n, t0, acc);
    }
}
template <int T, int NT, bool XS, int R>
__device__ __forceinline__ void qc_gemv_rows(const uint8_t *const (&row)[R], int64_t cols,
                                             const float *__restrict__ x, int n, int t0,
                                             int64_t first, int64_t stride, float (&acc)[R][NT]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[r][j] = 0.0f;
    if constexpr (qc_part<T>::ok) {
        bool plain = cols % 8 == 0;
#pragma unroll
        for (int r = 0; r < R; r++) plain = plain && ((uintptr_t)row[r] & 15) == 0;
        if (plain) {
            qc_gemv_plain_rows<T, NT, XS, R>(row, cols, x, n, t0, first, stride, acc);
            return;
        }
    }
    qc_gemv_deq_rows<T, NT, XS, R>(row, cols, x, n, t0, first, stride, acc);
}

/* acc[j] = the sum over parts first, first + stride, ... of the stored row (type T) times
 * x[t0 + j], for the tokens t0 + j < n (0 for the others), the same value in every lane. All 32
 * lanes of the warp must call it (full-warp shuffles), with first = lane + 32 * slice. */
template <int T, int NT, bool XS = false>
__device__ __forceinline__ void qc_gemv_row_slice(const uint8_t *__restrict__ row, int64_t cols,
                                                  const float *__restrict__ x, int n, int t0,
                                                  int64_t first, int64_t stride, float (&acc)[NT]) {
    const uint8_t *const rows[1] = {row};
    float acc1[1][NT];
    qc_gemv_rows<T, NT, XS, 1>(rows, cols, x, n, t0, first, stride, acc1);
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = acc1[0][j];
    qc_warp_sum(acc);
}

/* acc[j] = dot(stored row of type T, x[t0 + j]): one warp takes the whole row. XS: x is in
 * shared memory. */
template <int T, int NT, bool XS = false>
__device__ __forceinline__ void qc_gemv_row(const uint8_t *__restrict__ row, int64_t cols,
                                            const float *__restrict__ x, int n, int t0, int lane,
                                            float (&acc)[NT]) {
    qc_gemv_row_slice<T, NT, XS>(row, cols, x, n, t0, lane, 32, acc);
}

/* Long rows are shared by all QC_GEMV_WARPS warps of a block (one row per block): a decode
 * GEMV of an 896 x 4864 matrix (ffn_down) would otherwise run 896 warps, about 7 per SM, too
 * few to keep DRAM busy. Plain matmul and matmul_add use it (matmul.cu); the fused kernels
 * serve rows of dim columns and keep one warp per row. */
#define QC_GEMV_SPLIT_COLS 2048
#define QC_SPLIT_ROWS 2                  /* rows a block of the one-token long-row GEMV (matmul.cu) */
__host__ __device__ static inline int qc_gemv_split(int64_t cols) { return cols >= QC_GEMV_SPLIT_COLS ? QC_GEMV_WARPS : 1; }

/* qc_gemv_row of two rows of one type (matmul_swiglu's gate and up rows) against the same x, in
 * one loop: twice the loads in flight per warp, and each x part loaded once for both. Each
 * accumulator goes through exactly the operations qc_gemv_row gives it. */
template <int T, int NT, bool XS = false>
__device__ __forceinline__ void qc_gemv_row2(const uint8_t *__restrict__ row_a,
                                             const uint8_t *__restrict__ row_b, int64_t cols,
                                             const float *__restrict__ x, int n, int t0, int lane,
                                             float (&acc_a)[NT], float (&acc_b)[NT]) {
    const uint8_t *const rows[2] = {row_a, row_b};
    float acc2[2][NT];
    qc_gemv_rows<T, NT, XS, 2>(rows, cols, x, n, t0, lane, 32, acc2);
#pragma unroll
    for (int j = 0; j < NT; j++) {
        acc_a[j] = acc2[0][j];
        acc_b[j] = acc2[1][j];
    }
    qc_warp_sum2(acc_a, acc_b);
}

/* qc_gemv_row for a type known only at run time. The fused kernels call it where the type is
 * the same for a whole block (one weight per block), so the switch never splits a warp. */
template <int NT, bool XS = false>
__device__ __forceinline__ void qc_gemv_row_any(uint32_t type, const uint8_t *__restrict__ row,
                                                int64_t cols, const float *__restrict__ x, int n,
                                                int t0, int lane, float (&acc)[NT]) {
    switch (type) {
#define QC_CASE_(T) case T: qc_gemv_row<T, NT, XS>(row, cols, x, n, t0, lane, acc); return;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    /* unreachable: the launchers accept only QC_CUDA_FOR_EACH_TYPE */
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;
}

/* Before qc_grid_start (qc_cuda.cuh): ask L2 for the block's rows [r0, r0 + nr) of W (rows of
 * row_bytes bytes; those past `rows` skipped), at most their first QC_GEMV_PREFETCH_BYTES, so
 * that under programmatic dependent launch they stream in while the kernel before still runs.
 * Blocks with blockIdx.y > 0 read the same rows for other tokens and leave it to y = 0. */
#define QC_GEMV_PREFETCH_BYTES 4096
/* Blocks an SM holds at once of a GEMV that copies its rows to shared memory: grids up to this
 * many per SM are one wave, and only those copy (a later wave's copy would wait in line). */
#define QC_GEMV_SHARED_BLOCKS_PER_SM 8
__device__ __forceinline__ void qc_gemv_prefetch(const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t nr,
                                                 int64_t rows) {
    if (blockIdx.y != 0 || r0 >= rows) return;
    if (nr > rows - r0) nr = rows - r0;
    const int64_t bytes = nr * row_bytes;
    qc_prefetch_l2(W + r0 * row_bytes, bytes < QC_GEMV_PREFETCH_BYTES ? bytes : QC_GEMV_PREFETCH_BYTES);
}

/* Tokens per GEMV block (NT) for an eval of n <= QC_GEMV_MAX_TOKENS tokens, and the grid's y
 * extent that covers them. The launchers switch on nt to pick the kernel instantiation. */
static inline int qc_gemv_tokens_per_block(int n) { return n == 1 ? 1 : n == 2 ? 2 : n <= 4 ? 4 : 8; }
static inline unsigned qc_gemv_grid_y(int n) {
    const int nt = qc_gemv_tokens_per_block(n);
    return (unsigned)((n + nt - 1) / nt);
}

#endif /* QC_GEMV_CUH */
