/* matmul.cu: out[n][rows] = x[n][cols] @ W^T (+ bias), W stored as in the file; and matmul_add,
 * out = residual + x @ W^T, the same matmul with the residual added in its epilogue.
 *
 * Decode and short batches (n <= QC_GEMV_MAX_TOKENS): a GEMV per block format that reads the
 * stored blocks directly, once per call however many tokens: one warp per output row
 * (qc_gemv.cuh). Accumulation is fp32. The 8-bit formats (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K) first
 * quantize x to 8 bits (qc_cuda_quantize_q8, below) and take integer dot products
 * (qc_gemv_q8.cuh), as llama.cpp and the CPU's fast kernels do.
 *
 * Prefill (n > QC_GEMV_MAX_TOKENS): cuBLAS on tensor cores. F32 weights go to an fp32 GEMM as
 * they are; F16 weights are used in place with x converted to f16; the block formats are decoded
 * tile by tile (a bounded scratch, QC_TILE_ELEMS elements) into f16, BF16 into f32 (its range
 * exceeds f16). fp32 accumulation everywhere. matmul_add runs the GEMMs with beta = 1 onto out
 * holding the residual (copied there first when it is a separate buffer); each tile adds to its
 * own rows only.
 *
 * cuBLAS is column-major: the row-major (rows, cols) W is the column-major (cols, rows) matrix
 * with ld = cols, i.e. W^T; so out = W x is GEMM(OP_T, OP_N, m = rows, n = n_tokens, k = cols,
 * A = W, lda = cols, B = X, ldb = cols, C = Y, ldc = rows). A tile of rows r0.. writes C at
 * out + r0 with the same ldc.
 */
#include "qc_gemv.cuh"
#include "qc_gemv_q8.cuh"
#include "sampler.h"

#include <cuda_fp16.h>

#define QC_TILE_ELEMS (128ll << 20)     /* prefill dequantization tile: 256 MiB as f16 (a 7B matrix whole) */

/* Tokens t0 .. t0 + NT - 1 (those < n) of x against the rows of W: with S = 1 row
 * blockIdx.x * WARPS + warp, one warp each; with S = QC_GEMV_WARPS row blockIdx.x, its parts
 * dealt to the block's warps in turn and the warps' sums added in warp order.
 * out = residual + (x W^T + bias), each term where its pointer is not NULL. residual may alias
 * out (matmul_add on the residual stream): each element is read, then written, by one lane, so
 * neither of the two is __restrict__. Q8: the dot products on 8-bit activations xq
 * (qc_gemv_q8.cuh), else on x. launch_next: the next kernel launches before this one's wait
 * (qc_grid_launch_next; matmul_any says where). */
template <int T, int NT, int S, bool Q8, bool SH = false>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t rows, int64_t cols,
               const float *__restrict__ x, const qc_q8x xq, int n, const float *__restrict__ bias,
               const float *residual, float *out, const qc_l2_ahead ahead, int launch_next) {
    static_assert(S == 1 || S == QC_GEMV_WARPS, "a split row takes the whole block");
    static_assert(!SH || Q8, "the 8-bit GEMV reads a shared copy");
    __shared__ float slice_sum[S > 1 ? S : 1][NT];
    extern __shared__ __align__(16) uint8_t w_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r = S == 1 ? (int64_t)blockIdx.x * QC_GEMV_WARPS + warp : (int64_t)blockIdx.x;
    const int t0 = blockIdx.y * NT;
    const int64_t r_first = S == 1 ? (int64_t)blockIdx.x * QC_GEMV_WARPS : r;
    /* SH: the block's rows copied into shared memory (qc_copy_to_shared), else asked of L2 */
    const uint8_t *W_rows = W + r_first * row_bytes;
    if constexpr (SH) {
        const int64_t nr = rows - r_first < QC_GEMV_WARPS / S ? rows - r_first : QC_GEMV_WARPS / S;
        W_rows = qc_copy_to_shared(w_shared, W_rows, nr * row_bytes);
    } else {
        qc_gemv_prefetch(W, row_bytes, r_first, QC_GEMV_WARPS / S, rows);
    }
    /* the epilogue's operands are loaded at the start, not after the dot products (one L2 round
     * trip less on the way out): the bias before the wait (no kernel writes it), the residual
     * (written by kernels that have finished) right after it */
    const bool writer = lane == 0 && (S == 1 || warp == 0) && r < rows;
    const float b_r = writer && bias ? bias[r] : 0.0f;
    qc_l2_ahead_issue(ahead);
    if (launch_next) qc_grid_launch_next();
    qc_grid_start();
    if constexpr (SH) qc_copy_wait();
    if (r >= rows) return;   /* whole warps (S = 1) or the whole block (S > 1) leave together */
    float res[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) res[j] = writer && residual && t0 + j < n ? residual[(int64_t)(t0 + j) * rows + r] : 0.0f;
    float acc[NT];
    const int64_t first = S == 1 ? lane : lane + 32 * warp;
    if constexpr (Q8) qc_gemv_q8_row_slice<T, NT, SH>(W_rows + (r - r_first) * row_bytes, cols, xq, n, t0, first, 32 * S, acc);
    else qc_gemv_row_slice<T, NT>(W + r * row_bytes, cols, x, n, t0, first, 32 * S, acc);
    if (S > 1) {
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < NT; j++) slice_sum[warp][j] = acc[j];
        }
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            acc[j] = slice_sum[0][j];
#pragma unroll
            for (int w = 1; w < S; w++) acc[j] += slice_sum[w][j];
        }
    }
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (t0 + j < n) {
            const int64_t at = (int64_t)(t0 + j) * rows + r;
            const float v = bias ? acc[j] + b_r : acc[j];
            /* residual + v: the add op's operands, so matmul_add gives matmul-then-add's bits */
            out[at] = residual ? res[j] + v : v;
        }
    }
}

/* One token against long rows (qc_gemv_split: the down projection), RB rows a block, each row
 * computed as qc_gemv_kernel's split path computes it (its QC_GEMV_WARPS warps' slices, the same
 * first element and stride a lane, their sums added in warp order): the same bits, in a grid of
 * rows / RB blocks of RB * QC_GEMV_WARPS warps. The block's rows go into its shared memory before
 * the wait (qc_copy_to_shared, one copy for all RB).
 * Why: the GPU resolves a programmatic dependency across a grid of few blocks faster than across
 * one of many: scripts/sync_floor.cu on the H200 (report 20261202-42e03b5-*, addendum), a chain of
 * empty kernels of 132 blocks 0.76 us a kernel, 224 1.10, 896 (the down projection's one row a
 * block) 1.51, and from 896 blocks to 224 1.20. Measured there (real file, rounds alternating in
 * one lease; the rows a block chosen at creation, 1 = qc_gemv_kernel): 2 rows a block (448 blocks
 * of 256 threads) 2243.8-2248.5 tok/s at 512 keys and 1909.9-1918.2 at 2560 against 2221.1-2223.5
 * and 1895.7-1906.9 for 1; 4 rows (224 of 512) 2226.2-2235.6 and 1901.0-1906.2, even; 8 rows (112
 * of 1024, a whole SM's registers) 2080.4 and 1809.6, -6.5%: the blocks of the kernels before and
 * after it then find no room beside it until it leaves. So RB = QC_SPLIT_ROWS (2), and
 * QWENCUDA_SPLIT_ROWS=0 keeps one row a block, to compare. The grid is one wave where it has at
 * most QC_GEMV_SHARED_BLOCKS_PER_SM / RB blocks an SM (qc_gemv_kernel's rule for its copies,
 * RB times the threads a block), which __launch_bounds__ guarantees in registers, and a block's
 * copy of at most QC_SHARED_COPY_MAX leaves room for them in shared memory (228 KB an SM on
 * sm_90, where the copies are taken: cu->w_shared). */
template <int T, int RB>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS * RB, QC_GEMV_SHARED_BLOCKS_PER_SM / RB)
qc_gemv_q8_split_rows_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t rows, int64_t cols,
                             const qc_q8x xq, const float *__restrict__ bias, const float *residual, float *out,
                             const qc_l2_ahead ahead, int launch_next) {
    __shared__ float slice_sum[RB * QC_GEMV_WARPS];
    extern __shared__ __align__(16) uint8_t w_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k = warp / QC_GEMV_WARPS;   /* this warp's row of the block; warp % QC_GEMV_WARPS its slice */
    const int64_t r_first = (int64_t)blockIdx.x * RB, r = r_first + k;
    const int64_t nr = rows - r_first < RB ? rows - r_first : RB;
    const uint8_t *mine = qc_copy_to_shared(w_shared, W + r_first * row_bytes, nr * row_bytes) + k * row_bytes;
    const bool writer = lane == 0 && warp % QC_GEMV_WARPS == 0 && r < rows;
    const float b_r = writer && bias ? bias[r] : 0.0f;
    qc_l2_ahead_issue(ahead);
    if (launch_next) qc_grid_launch_next();
    qc_grid_start();
    qc_copy_wait();
    const float res = writer && residual ? residual[r] : 0.0f;
    if (r < rows) {   /* whole warps: a partial last block's other warps only reach the barrier */
        float acc[1];
        qc_gemv_q8_row_slice<T, 1, true>(mine, cols, xq, 1, 0, threadIdx.x % (32 * QC_GEMV_WARPS), 32 * QC_GEMV_WARPS,
                                         acc);
        if (lane == 0) slice_sum[warp] = acc[0];
    }
    __syncthreads();
    if (!writer) return;
    float a = slice_sum[warp];
#pragma unroll
    for (int w = 1; w < QC_GEMV_WARPS; w++) a += slice_sum[warp + w];
    const float v = bias ? a + b_r : a;
    out[r] = residual ? res + v : v;
}

/* matmul_add of one token that also leaves out's normalised 8-bit form for the next op
 * (norm_next, backend.h; qc_gemv_q8.cuh, "a norm's scale after the dot products"): 32 rows a
 * block, RW a warp (4: qc_gemv_q8_row4, 2: qc_gemv_q8_row2; each row qc_gemv_q8_row_slice's
 * operations, so out is qc_gemv_kernel's bit for bit whatever RW), then
 * the block's 32 values of out times the norm weight quantized as one block (qs, ds) and their
 * sum of squares (ss). A 32-element 8-bit type (Q4_0, Q5_0, Q8_0: row4's registers), rows a
 * multiple of 32.
 * RW: the o projection's 28 blocks were 8 warps of four rows, each warp about 800 instructions
 * (ncu, report 20261202-8d68ef1) at two warps a scheduler: a chain of dependent instructions
 * that nothing else on the SM hides. Fewer rows a warp, more warps a block: the same work in
 * shorter chains side by side (cu->add_norm_rw: 2, or 4 where QWENCUDA_ADD_NORM_WARP_ROWS=4 at
 * creation). Measured (H200, real file, three alternating rounds in one lease, 2026-12-02):
 * 4 rows 2247.2, 2261.5, 2245.1 tok/s at 512 keys and 1912.4, 1919.7, 1922.0 at 2560; 2 rows
 * 2274.8, 2260.5, 2265.0 and 1917.7, 1917.2, 1926.9; 1 row (1024 threads, 32 registers)
 * 2211.6, 2224.7, 2219.1 and 1896.0, 1904.5, 1904.9 (slower, not kept: qc_gemv_q8_row_slice a
 * warp). test_kernels -k matmul_add passed (468) for each. A second lease (report
 * 20261202-791811a, addendum; three alternating rounds, one build, against 4 rows): 2 rows
 * 2272.5, 2269.9, 2270.5 tok/s at 512 keys and 1936.7, 1941.3, 1938.0 at 2560, against 2248.4,
 * 2254.7, 2252.0 and 1921.8, 1926.4, 1928.1: +0.9%, outside the spread, so two rows are the
 * default. */
#define QC_ADD_NORM_ROWS 32
static constexpr int qc_add_norm_threads(int rw) { return 32 * QC_ADD_NORM_ROWS / rw; }
template <int T, bool SH, int RW>
__global__ void __launch_bounds__(qc_add_norm_threads(RW))
qc_gemv_q8_add_norm_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t cols, const qc_q8x xq,
                           const float *residual, float *out, const float *__restrict__ norm_w, int8_t *qs,
                           float2 *ds, float *ss, const qc_l2_ahead ahead) {
    static_assert(RW == 2 || RW == 4, "two or four rows a warp");
    __shared__ float out_s[QC_ADD_NORM_ROWS];
    extern __shared__ __align__(16) uint8_t w_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.x * QC_ADD_NORM_ROWS;
    const uint8_t *rows = W + r0 * row_bytes;
    if constexpr (SH) rows = qc_copy_to_shared(w_shared, rows, QC_ADD_NORM_ROWS * row_bytes);
    else qc_prefetch_l2(rows, QC_ADD_NORM_ROWS * row_bytes);
    const float w = warp == 0 ? __ldg(norm_w + r0 + lane) : 0.0f;   /* a weight: before the wait */
    qc_l2_ahead_issue(ahead);
    qc_grid_start();
    if constexpr (SH) qc_copy_wait();
    const int64_t i = RW * warp;   /* this warp's rows r0 + i .. r0 + i + RW - 1 */
    const float res = residual[r0 + i + (lane % RW)];   /* lanes 0 .. RW - 1 keep theirs (epilogue) */
    float acc[RW];
    if constexpr (RW == 4) {
        const uint8_t *const four[4] = {rows + i * row_bytes, rows + (i + 1) * row_bytes, rows + (i + 2) * row_bytes,
                                        rows + (i + 3) * row_bytes};
        qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);
    } else {
        float a[1], b[1];
        qc_gemv_q8_row2<T, 1, SH>(rows + i * row_bytes, rows + (i + 1) * row_bytes, cols, xq, 1, 0, lane, a, b);
        acc[0] = a[0];
        acc[1] = b[0];
    }
    if (lane < RW) {
        /* residual + v: the add op's operands, as qc_gemv_kernel */
        float v = acc[0];
#pragma unroll
        for (int k = 1; k < RW; k++) v = lane == k ? acc[k] : v;
        v += res;
        out[r0 + i + lane] = v;
        out_s[i + lane] = v;
    }
    __syncthreads();
    if (warp == 0) {
        const float v = out_s[lane];
        qc_q8_quantize_block(v * w, lane, qs + r0, ds + blockIdx.x);
        const float block_ss = qc_norm_block_ss(v);
        if (lane == 0) ss[blockIdx.x] = block_ss;
    }
}

/* One token against more rows than one wave of qc_gemv_kernel's blocks holds (the lm_head: 151936
 * rows), QC_GEMV_ROWS4 rows a warp (qc_gemv_q8_rows_upto4: each row qc_gemv_q8_row_slice's
 * operations); bias and residual as qc_gemv_kernel adds them; eight warps a block. The same bits as qc_gemv_kernel,
 * in an eighth of its blocks, with four rows' loads in flight a lane. Why: qc_gemv_kernel gives
 * the 0.5B's lm_head 37984 blocks of four rows, about 290 an SM one after another, and streamed
 * its 145 MB at 2.2 TB/s, two thirds of the H100's bound. Measured (H100, real file, same build
 * and lease, QWENCUDA_GEMV_ROWS4=0 against on; bench/results/20261125-1c2416e-*, addendum): the
 * lm_head's share of a stamped step 64.5 -> 52.1 us (2.8 TB/s); decode 1928-1941 -> 1948-1952
 * tok/s at 512 keys, 1695-1706 -> 1712-1715 at 2560, with four warps a block; logits
 * bit-identical. Eight warps a block, in a second lease: 1955-1959 tok/s at 512 keys against
 * 1947-1957 for four and 1924-1943 off.
 * SH (cu->w_shared, where the block's rows fit QC_SHARED_COPY_MAX): the block first copies its
 * rows into shared memory (qc_copy_to_shared: coalesced 16-byte pieces) and its warps read them
 * there, the same bytes, where from global memory a lane loads its 22-byte Q5_0 or 34-byte Q8_0
 * blocks a 32-bit word at a time. Measured (H200, bench/results/20261201-3112744-*, addendum):
 * the synthetic 0.5B's decode (a Q5_0 lm_head) 2115.0, 2116.9 -> 2145.2, 2148.7 tok/s at 512
 * keys in one lease, the real file's (Q8_0) 2077.6-2095.4 -> 2090.9-2097.1, within its noise.
 * The Q8_0 lm_head stayed at 2.8 TB/s, 58% of the H200's bound, either way: ncu found L2 87%
 * busy, and 3.68M sectors written to L2 for 4.52M read, about 96 bytes a thread, what the
 * kernel's 48-byte stack frame then took (qc_gemv_q8_rows_upto4's run-time row index). Unrolled
 * (no frame; H200, bench/results/20261201-c02e922-*, addendum, against 3112744 in the same
 * lease): ncu's L2 writes 3.72M -> 0.06M sectors, DRAM 56% -> 70% busy; kernel_bench's Q8_0
 * lm_head 51.3 -> 37.8 us (3.8 TB/s, 80% of the bound); the real file's decode 2087.5-2097.3 ->
 * 2141.4-2151.9 tok/s at 512 keys, 1791.5-1798.4 -> 1834.1-1837.6 at 2560.
 * Measured and not kept (H200, real file, alternating rounds in one lease, 2026-12-03, against
 * ddbb8bd; bench/results/20261203-ddbb8bd-nvidia-h200-ab2.md): (1) the grid as a stream, three
 * resident blocks an SM each taking every 396th chunk of 32 rows, the next chunk's copy in flight
 * (cp.async groups, two 30.5 KB buffers) while it computes this one, since a block a chunk holds
 * its copy and then its dot products in turn; (2) with it, matmul_draw's output norm in every
 * block (the attention launch's in-block norm) instead of the norm-and-quantize launch before it
 * (4.86 us of a stamped step). Both, same bits: 2276.6, 2275.8, 2273.2 tok/s at 512 keys against
 * 2293.4, 2291.3, 2296.4; (1) alone 2270.0, 2280.6 against 2297.7, 2280.8 (even); (2) alone, a
 * block a chunk (4748 blocks, each normalising), 2187.7, 2179.4 against 2286.0, 2294.4 (-4.5%);
 * (1) and (2) at two blocks an SM 2231.7, 2229.3 against 2294.4, 2290.9. This kernel's 145 MB in
 * 37.4 us (its share of a stamped step of 25ac1c7) is 3.87 TB/s, about 90% of the 4.3 TB/s
 * (bytes read and written) that the device tool's KINDS.md gives for a device-to-device copy on
 * the H200 (not measured here): little is left to stream faster.
 * Measured and not kept (H200, real file, two alternating rounds in one lease, 2026-12-04,
 * against b825938; report 20261204-b825938-nvidia-h200-ab): the lm_head's first bytes kept in L2
 * across steps, so that the step streams fewer of them from HBM: L2 set aside for persisting
 * lines (cudaLimitPersistingL2CacheSize; the H200 sets aside at most 37.5 MB of its 60) and the
 * weight's start named as every launch's access policy window (hitRatio 1, persisting). Decode
 * at 512 keys 2371.0, 2380.3 tok/s with 30 MB kept, 2377.8, 2374.3 with 16, 2353.0, 2356.4 with
 * 37.5, against 2381.5, 2381.8 (base) and 2379.2, 2378.7 (the switch at 0); at 2560 keys 37.5 MB
 * lost 1.8%. ncu (caches not flushed, its default locked clocks) counted 144.68 MB of DRAM reads in
 * this kernel with 30 MB kept and without, and 1.4% L2 hits (17.8% with QWENCUDA_WEIGHTS_SHARED=0,
 * the prefetched lines): no line stayed. A probe of the same calls (30 MB read after 256 MB
 * streamed past it) took 12.7 us with the launch's window against 13.8 without. */
#define QC_GEMV_ROWS4 4
#define QC_ROWS4_WARPS 8                /* warps a block: 32 rows */
#define QC_ROWS4_ROWS (QC_ROWS4_WARPS * QC_GEMV_ROWS4)

/* matmul_draw (backend.h): the four-row kernel's blocks make the greedy draw over the logits
 * they write (DRAW). A block's best (value, first id) becomes one 64-bit key (qc_draw_key), and
 * one atomicMax of it into `best`, whose result no thread waits for; qc_head_draw_finish_kernel,
 * one warp launched after the grid, takes the winner, writes the draw, feeds the next step as
 * feed_draw would (ids, pos), then (feeding, cu->draw_to_host) the draw into the step's slot of
 * mapped host memory (its session's pair: qc_cuda_draw_pair), where draw_ticket waits for it,
 * and puts `best` back to 0 for the next launch.
 * Why: after the lm_head, the sample kernel's pass over the logits and feed_draw's launch held the
 * next step back 15 us of a 480 us step (H200, real file, loop profile of report 3112744:
 * qc_sample_kernel started 15.5 us before the next step's first kernel, feed_draw 10.8).
 * Measured and not kept (H200, real file, report c02e922): the last block to count itself done
 * drawing and feeding, with no second launch. Each block's thread 0 then waited for its atomicMax
 * (the fence before the count) and its count's return before the block could leave, and the
 * lm_head took 47.4 us of the loop's step against 36.9 without them: decode 2130.9-2141.7 tok/s
 * at 512 keys against 2141.4-2151.9 with QWENCUDA_HEAD_DRAW=0.
 * Measured (H200, real file, report 20261201-e14199c, addendum): the loop's step period 467.3 us
 * (470.2 with the count); decode 2135.7-2146.3 -> 2151.7-2161.1 tok/s at 512 keys and
 * 1837.2-1839.8 -> 1843.4-1847.5 at 2560 in one lease, QWENCUDA_HEAD_DRAW=0 against on. With the
 * output norm folded in (matmul_draw's norm_w; report 20261201-321c15f, addendum, against bce06e9
 * in the same lease): 2143.8-2151.7 -> 2153.6-2158.8 tok/s at 512 keys, 1834.4-1838.0 ->
 * 1839.1-1844.5 at 2560. */
struct qc_head_draw {
    unsigned long long *best;          /* cu->draw_best */
    const qc_sample_state *state;      /* its RNG goes into the result (a greedy draw draws none) */
    qc_sample_result *result;
    int32_t *ids, *pos;                /* the next step's token and position, or NULL: no feed */
    qc_sample_result *host;            /* with ids: the result also into host[pos % 2] (draw_ticket: its
                                          session's pair of slots), or NULL */
};

/* (value, id) -> a key whose unsigned order is qc_sample_better's (sample.cu): the larger value,
 * then the smaller id; -0 as +0; NaN (never chosen) 0, below every key of a number. */
__device__ __forceinline__ unsigned long long qc_draw_key(float v, int64_t id) {
    if (v != v) return 0ull;
    unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) == 0) u = 0;                          /* -0 */
    const unsigned order = u & 0x80000000u ? ~u : u | 0x80000000u;   /* floats in unsigned order */
    return (unsigned long long)order << 32 | (unsigned)~(unsigned)id;
}
/* The token of the largest key: -1 where it is 0 or -inf's (sample's "nothing can be chosen"). */
__device__ __forceinline__ int32_t qc_draw_token(unsigned long long key) {
    const unsigned order_of_minus_inf = ~0xff800000u;
    return (unsigned)(key >> 32) <= order_of_minus_inf ? -1 : (int32_t)~(unsigned)key;
}

/* Every thread of the block, once, with its key (0: no logit): the block's largest into best. */
__device__ __forceinline__ void qc_head_draw_block(const qc_head_draw &d, unsigned long long key) {
    __shared__ unsigned long long warp_best[QC_ROWS4_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
        key = other > key ? other : key;
    }
    if (lane == 0) warp_best[warp] = key;
    __syncthreads();
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int w = 1; w < QC_ROWS4_WARPS; w++) key = warp_best[w] > key ? warp_best[w] : key;
    if (key) atomicMax(d.best, key);   /* (its result unused: a reduction nobody waits for) */
}

/* After the lm_head's grid (its atomics done and visible past the wait): the draw, the feed. */
__global__ void qc_head_draw_finish_kernel(const qc_head_draw d) {
    qc_grid_start();
    if (threadIdx.x != 0) return;
    const int32_t token = qc_draw_token(*d.best);
    *d.best = 0;
    d.result->token = token;
    d.result->rng = d.state->rng;
    d.result->pad = 0;
    if (d.ids) {   /* feed_draw's stores (sample.cu); the drawn id is a row, below n_vocab */
        const int32_t pos = d.pos[0];
        d.ids[0] = token >= 0 ? token : 0;
        d.pos[0] = pos + 1;
        if (d.host) {   /* the step's slot in mapped host memory: visible once the launch completes */
            qc_sample_result *h = d.host + (pos & 1);
            h->token = token;
            h->rng = d.state->rng;
            h->pad = 0;
        }
    }
}

/* The 32-element types only (registers: at most 64 a thread, four blocks an SM); Q6_K's four rows
 * spilled even under 128 registers. */
template <int T, bool SH, bool DRAW>
__global__ void __launch_bounds__(32 * QC_ROWS4_WARPS, 32 / QC_ROWS4_WARPS)
qc_gemv_q8_rows4_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t rows, int64_t cols, const qc_q8x xq,
                        const float *__restrict__ bias, const float *residual, float *out, const qc_l2_ahead ahead,
                        const qc_head_draw draw) {
    extern __shared__ __align__(16) uint8_t w_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t block_r0 = (int64_t)blockIdx.x * QC_ROWS4_ROWS;
    const int64_t r0 = block_r0 + (int64_t)warp * QC_GEMV_ROWS4;
    const int nr = rows - r0 < QC_GEMV_ROWS4 ? (int)(rows - r0) : QC_GEMV_ROWS4;   /* < 1: no row */
    /* SH: the block's rows copied into shared memory, else asked of L2 */
    const uint8_t *W_rows = W + block_r0 * row_bytes;
    if constexpr (SH) {
        const int64_t block_rows = rows - block_r0 < QC_ROWS4_ROWS ? rows - block_r0 : QC_ROWS4_ROWS;
        W_rows = qc_copy_to_shared(w_shared, W_rows, block_rows * row_bytes);
    } else {
        qc_gemv_prefetch(W, row_bytes, block_r0, QC_ROWS4_ROWS, rows);
    }
    /* lane k < nr writes row r0 + k: its bias before the wait, its residual after it */
    const float b_r = bias && lane < nr ? bias[r0 + lane] : 0.0f;
    qc_l2_ahead_issue(ahead);
    qc_grid_start();
    if constexpr (SH) qc_copy_wait();
    if (!DRAW && nr < 1) return;   /* whole warps leave together (DRAW: all reach the draw's barrier) */
    unsigned long long key = 0;     /* DRAW: this lane's logit's (qc_draw_key) */
    if (nr >= 1) {
        const float res = residual && lane < nr ? residual[r0 + lane] : 0.0f;
        const uint8_t *const mine = W_rows + (r0 - block_r0) * row_bytes;
        const uint8_t *const four[4] = {mine, mine + row_bytes, mine + 2 * row_bytes, mine + 3 * row_bytes};   /* (those past nr not read) */
        float acc[QC_GEMV_ROWS4] = {0.0f, 0.0f, 0.0f, 0.0f};
        qc_gemv_q8_rows_upto4<T, SH>(four, nr, cols, xq, lane, acc);
        const float a = lane == 0 ? acc[0] : lane == 1 ? acc[1] : lane == 2 ? acc[2] : acc[3];
        const float v = bias ? a + b_r : a;
        const float logit = residual ? res + v : v;
        if (lane < nr) out[r0 + lane] = logit;
        if (DRAW && lane < nr) key = qc_draw_key(logit, r0 + lane);
    }
    if constexpr (DRAW) qc_head_draw_block(draw, key);
}

/* x[n][cols] to 8 bits: one warp per block of 32 (qc_q8_quantize_block). */
__global__ void qc_quantize_q8_kernel(const float *__restrict__ x, int64_t blocks, int8_t *qs, float2 *ds) {
    qc_grid_start();
    const int lane = threadIdx.x & 31;
    const int64_t b = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    qc_q8_quantize_block(x[32 * b + lane], lane, qs + 32 * b, ds + b);
}

/* One row x normalised (rmsnorm's bits: qc_norm_row_scale, then x * scale * w) and quantized:
 * every block computes the row's scale (cheap, and the same bits in each) and normalises and
 * quantizes its QC_GEMV_WARPS blocks of 32, one per warp. Many blocks, so the decode's fused
 * norm costs about a launch, not a pass of every GEMV block over the row. */
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_norm_quantize_q8_kernel(const float *__restrict__ x, const long long *x_sum, const float *__restrict__ norm_w,
                           int cols, float eps, int8_t *qs, float2 *ds, float *x_out) {
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    const int lane = threadIdx.x & 31;
    const int b = blockIdx.x * QC_GEMV_WARPS + (threadIdx.x >> 5);
    const int i = 32 * b + lane;
    const bool mine = b < cols / 32;
    /* the chain is latency: the norm weight (no kernel writes it) is loaded before the wait,
     * and this lane's x value beside the scale's loads, not after the scale */
    const float w = mine ? __ldg(norm_w + i) : 0.0f;
    qc_grid_start();
    const float xi = mine ? qc_x_plus_sum(x, x_sum, i) : 0.0f;
    const float scale = qc_norm_row_scale(x, cols, eps, norm_tmp, x_sum);
    if (mine) qc_q8_quantize_block(xi * scale * w, lane, qs + 32 * b, ds + b);
    if (x_out && mine) x_out[i] = xi;   /* (sum_add's value: qc_x_plus_sum) */
}

int qc_cuda_gemv_q8(qc_backend *be, uint32_t type, int64_t cols) {
    return qc_cuda_of(be)->gemv_q8 && qc_q8_type(type) && cols % 32 == 0 && cols <= QC_Q8X_MAX_COLS;
}

int qc_cuda_quantize_q8(qc_backend *be, const float *x, int n, int64_t cols, qc_q8x *out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n < 1 || n > QC_GEMV_MAX_TOKENS || cols % 32 != 0 || cols > QC_Q8X_MAX_COLS)
        return qc_cuda_value_error(be, "quantize_q8: %d x %lld does not fit the 8-bit buffer", n, (long long)cols);
    int8_t *qs = (int8_t *)cu->q8x;
    float2 *ds = qc_q8x_ds_at(cu->q8x, n, cols);
    const int64_t blocks = (int64_t)n * (cols / 32);
    const int warps = 8;
    qc_launch(cu, qc_quantize_q8_kernel, dim3((unsigned)((blocks + warps - 1) / warps)), dim3(32 * warps), 0, x,
              blocks, qs, ds);
    *out = qc_q8x{qs, ds, cols, cols / 32};
    cu->q8x_of = NULL;
    return QC_LAUNCHED(be, "qc_quantize_q8_kernel");
}

int qc_cuda_norm_quantize_q8(qc_backend *be, const float *x, const int64_t *x_sum, const float *norm_w,
                             int64_t cols, float eps, qc_q8x *out, float *x_out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (cols % 32 != 0 || cols > QC_NORM_FUSE_MAX_COLS)
        return qc_cuda_value_error(be, "norm_quantize_q8: %lld columns", (long long)cols);
    if (x_out && (!x_sum || x_out == x))
        return qc_cuda_value_error(be, "norm_quantize_q8: x_out takes sums and a row apart from x");
    int8_t *qs = (int8_t *)cu->q8x;
    float2 *ds = qc_q8x_ds_at(cu->q8x, 1, cols);
    const unsigned blocks = (unsigned)((cols / 32 + QC_GEMV_WARPS - 1) / QC_GEMV_WARPS);
    qc_launch(cu, qc_norm_quantize_q8_kernel, dim3(blocks), dim3(32 * QC_GEMV_WARPS), 0, x, (const long long *)x_sum,
              norm_w, (int)cols, eps, qs, ds, x_out);
    *out = qc_q8x{qs, ds, cols, cols / 32};
    cu->q8x_of = NULL;
    return QC_LAUNCHED(be, "qc_norm_quantize_q8_kernel");
}

/* Whether a one-token GEMV of w takes the four-row kernel (qc_gemv_q8_rows4_kernel): an 8-bit GEMV
 * type of 32-element units, no split, more rows than one wave of qc_gemv_kernel's blocks (the
 * lm_head), and no next kernel to launch early. launch_gemv_s and matmul_draw both ask it. */
static bool unit_of_32(uint32_t type) {
    switch (type) {
#define QC_CASE_(T) case T: return qc_q8_unit<T>::UNIT == 32;
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return false;
}
static bool rows4_takes(qc_backend *be, const qc_weight *w, int n, int launch_next) {
    const qc_cuda *cu = qc_cuda_of(be);
    const int64_t blocks = (w->rows + QC_GEMV_WARPS - 1) / QC_GEMV_WARPS;
    return n == 1 && cu->gemv_rows4 && qc_cuda_gemv_q8(be, w->type, w->cols) && unit_of_32(w->type) &&
           qc_gemv_split(w->cols) == 1 && blocks > (int64_t)QC_GEMV_SHARED_BLOCKS_PER_SM * cu->sm_count &&
           !launch_next;
}

/* qc_gemv_q8_split_rows_kernel's grid for rows rows, and whether a one-token GEMV of long rows
 * (rb bytes each) takes it: its block's copy fits and its grid is one wave (the copies of a later
 * wave would wait in line). */
static int64_t split_rows_blocks(int64_t rows) { return (rows + QC_SPLIT_ROWS - 1) / QC_SPLIT_ROWS; }
static bool split_rows_takes(const qc_cuda *cu, int64_t rows, int64_t rb) {
    return cu->split_rows && cu->w_shared && qc_shared_copy_bytes(QC_SPLIT_ROWS * rb) <= QC_SHARED_COPY_MAX &&
           split_rows_blocks(rows) <= (int64_t)(QC_GEMV_SHARED_BLOCKS_PER_SM / QC_SPLIT_ROWS) * cu->sm_count;
}

/* draw: matmul_draw's (the four-row kernel's DRAW), or NULL. Returns whether the draw was launched. */
template <int T, int S, bool Q8>
static bool launch_gemv_s(qc_backend *be, const qc_weight *w, const float *bias, const float *x, const qc_q8x &xq,
                          int n, const float *residual, float *out, const qc_l2_ahead &ahead, int launch_next,
                          const qc_head_draw *draw) {
    const qc_cuda *cu = qc_cuda_of(be);
    const int64_t rb = qc_row_bytes_t<T>(w->cols);
    const int64_t rows_per_block = QC_GEMV_WARPS / S;
    const dim3 grid((unsigned)((w->rows + rows_per_block - 1) / rows_per_block), qc_gemv_grid_y(n));
    const dim3 block(32 * QC_GEMV_WARPS);
    const uint8_t *W = (const uint8_t *)w->data;
#define QC_ARGS_ W, rb, w->rows, w->cols, x, xq, n, bias, residual, out, ahead, launch_next
    /* one token, one wave of blocks: each block's rows into its shared memory before the wait */
    const size_t shared = qc_shared_copy_bytes(rows_per_block * rb);
    if constexpr (Q8) {
        const bool one_wave = grid.x <= (unsigned)(QC_GEMV_SHARED_BLOCKS_PER_SM * cu->sm_count);
        if constexpr (S > 1) {
            if (n == 1 && split_rows_takes(cu, w->rows, rb)) {
                const dim3 grid_r((unsigned)split_rows_blocks(w->rows));
                qc_launch(cu, qc_gemv_q8_split_rows_kernel<T, QC_SPLIT_ROWS>, grid_r, dim3(32 * QC_GEMV_WARPS * QC_SPLIT_ROWS),
                          qc_shared_copy_bytes(QC_SPLIT_ROWS * rb), W, rb, w->rows, w->cols, xq, bias, residual, out,
                          ahead, launch_next);
                return false;
            }
        }
        if (n == 1 && cu->w_shared && one_wave && shared <= QC_SHARED_COPY_MAX) {
            qc_launch(cu, qc_gemv_kernel<T, 1, S, true, true>, grid, block, shared, QC_ARGS_);
            return false;
        }
        /* one token, many waves of rows of a warp each (the lm_head): four rows a warp */
        if constexpr (S == 1 && qc_q8_unit<T>::UNIT == 32) {
            if (rows4_takes(be, w, n, launch_next)) {
                const dim3 grid4((unsigned)((w->rows + QC_ROWS4_ROWS - 1) / QC_ROWS4_ROWS)), block4(32 * QC_ROWS4_WARPS);
                const size_t shared4 = qc_shared_copy_bytes(QC_ROWS4_ROWS * rb);
                const bool sh = cu->w_shared && shared4 <= QC_SHARED_COPY_MAX;
#define QC_ARGS4_ W, rb, w->rows, w->cols, xq, bias, residual, out, ahead, draw ? *draw : qc_head_draw{}
                if (draw && sh) qc_launch(cu, qc_gemv_q8_rows4_kernel<T, true, true>, grid4, block4, shared4, QC_ARGS4_);
                else if (draw) qc_launch(cu, qc_gemv_q8_rows4_kernel<T, false, true>, grid4, block4, 0, QC_ARGS4_);
                else if (sh) qc_launch(cu, qc_gemv_q8_rows4_kernel<T, true, false>, grid4, block4, shared4, QC_ARGS4_);
                else qc_launch(cu, qc_gemv_q8_rows4_kernel<T, false, false>, grid4, block4, 0, QC_ARGS4_);
#undef QC_ARGS4_
                return draw != NULL;
            }
        }
    }
    switch (qc_gemv_tokens_per_block(n)) {
    case 1: qc_launch(cu, qc_gemv_kernel<T, 1, S, Q8>, grid, block, 0, QC_ARGS_); break;
    case 2: qc_launch(cu, qc_gemv_kernel<T, 2, S, Q8>, grid, block, 0, QC_ARGS_); break;
    case 4: qc_launch(cu, qc_gemv_kernel<T, 4, S, Q8>, grid, block, 0, QC_ARGS_); break;
    default: qc_launch(cu, qc_gemv_kernel<T, 8, S, Q8>, grid, block, 0, QC_ARGS_); break;
    }
#undef QC_ARGS_
    return false;
}

/* Q8: x quantized in xq (qc_gemv_q8.cuh; the types of QC_Q8_FOR_EACH_TYPE only). */
template <int T, bool Q8>
static bool launch_gemv(qc_backend *be, const qc_weight *w, const float *bias, const float *x, const qc_q8x &xq,
                        int n, const float *residual, float *out, const qc_l2_ahead &ahead, int launch_next,
                        const qc_head_draw *draw) {
    if (qc_gemv_split(w->cols) > 1)
        return launch_gemv_s<T, QC_GEMV_WARPS, Q8>(be, w, bias, x, xq, n, residual, out, ahead, launch_next, draw);
    return launch_gemv_s<T, 1, Q8>(be, w, bias, x, xq, n, residual, out, ahead, launch_next, draw);
}

/* out[n][rows] (ldc = rows, starting at row r0) = X[n][cols] @ A^T for A (m, cols); with
 * accumulate, += instead of = (beta = 1). */
static int gemm(qc_backend *be, const void *A, cudaDataType_t atype, const void *X,
                cudaDataType_t xtype, int64_t m, int64_t cols, int n, float *C, int64_t ldc,
                int accumulate) {
    qc_cuda *cu = qc_cuda_of(be);
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return QC_CUBLAS(be, cublasGemmEx(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, (int)cols,
                                      &one, A, atype, (int)cols, X, xtype, (int)cols, &beta, C,
                                      CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
}

/* out (+)= x @ W^T (+ bias); with accumulate, out already holds the residual. */
static int matmul_cublas(qc_backend *be, const qc_weight *w, const float *bias, const float *x,
                         int n, float *out, int accumulate) {
    qc_cuda *cu = qc_cuda_of(be);
    const int64_t rows = w->rows, cols = w->cols;
    if (rows > INT32_MAX || cols > INT32_MAX)
        return qc_cuda_value_error(be, "matmul: %lld x %lld is too large for cuBLAS", (long long)rows, (long long)cols);

    if (w->type == QC_TYPE_F32) {
        if (gemm(be, w->data, CUDA_R_32F, x, CUDA_R_32F, rows, cols, n, out, rows, accumulate) < 0) return -1;
    } else {
        /* f16 activations for the f16 paths, f32 for BF16 */
        const int half = w->type != QC_TYPE_BF16;
        const void *X = x;
        if (half) {
            if (qc_cuda_scratch(be, &cu->scratch_x, &cu->scratch_x_bytes, (size_t)n * (size_t)cols * sizeof(__half)) < 0 ||
                qc_cuda_to_half(be, x, cu->scratch_x, (int64_t)n * cols) < 0)
                return -1;
            X = cu->scratch_x;
        }
        const cudaDataType_t dt = half ? CUDA_R_16F : CUDA_R_32F;
        if (w->type == QC_TYPE_F16) {
            if (gemm(be, w->data, CUDA_R_16F, X, CUDA_R_16F, rows, cols, n, out, rows, accumulate) < 0) return -1;
        } else {
            /* tiles of a multiple of 128 rows: each tile's output starts at out + r0, and cuBLAS
             * takes its fast (sm_90) kernels only for 16-byte aligned C; an odd r0 sent the
             * 7B-sized GEMMs to a Turing-era kernel at a third of the speed (measured) */
            int64_t tile = QC_TILE_ELEMS / cols / 128 * 128;
            if (tile < 128) tile = 128;
            if (tile > rows) tile = rows;
            const size_t esize = half ? sizeof(__half) : sizeof(float);
            if (qc_cuda_scratch(be, &cu->scratch_w, &cu->scratch_w_bytes, (size_t)tile * (size_t)cols * esize) < 0)
                return -1;
            for (int64_t r0 = 0; r0 < rows; r0 += tile) {
                const int64_t m = rows - r0 < tile ? rows - r0 : tile;
                if (qc_cuda_dequantize_rows(be, w, r0, m, cu->scratch_w, half) < 0 ||
                    gemm(be, cu->scratch_w, dt, X, dt, m, cols, n, out + r0, rows, accumulate) < 0)
                    return -1;
            }
        }
    }
    return bias ? qc_cuda_add_bias(be, out, bias, n, rows) : 0;
}

/* Where matmul_add leaves out's normalised 8-bit form (qc_gemv_q8_add_norm_kernel): one token
 * added to the residual stream (in place, or from the x + sums that a folded down projection's
 * next attention op wrote, session.c), a 32-element 8-bit type, whole blocks of 32 rows and
 * at most QC_NORM_SS_MAX_COLS of them (the session passes norm_next unless QWENCUDA_NORM_AFTER=0
 * made it). The 0.5B decode step loses the feed-forward norm's 24 launches: H100, real file,
 * same-lease A/B against 1d69d31, 1768-1798 -> 1858-1867 tok/s at 512 keys and 1576-1578 ->
 * 1647-1656 at 2560 (bench/results/20261124-dbed2c2-*, addendum). */
static int add_norm_takes(const qc_weight *w, int n, const float *residual) {
    const uint32_t t = w->type;
    return n == 1 && residual && (t == QC_TYPE_Q4_0 || t == QC_TYPE_Q5_0 || t == QC_TYPE_Q8_0) &&
           w->rows % QC_ADD_NORM_ROWS == 0 && w->rows <= QC_NORM_SS_MAX_COLS &&
           qc_shared_copy_bytes(QC_ADD_NORM_ROWS * qc_row_bytes(t, w->cols)) <= QC_SHARED_COPY_MAX;
}

template <int T, int RW>
static void launch_add_norm_rw(const dim3 &grid, size_t shared, const uint8_t *W, int64_t rb, const qc_weight *w,
                               const qc_q8x &xq, const float *residual, float *out, const float *norm_w, int8_t *qs,
                               float2 *ds, const qc_l2_ahead &ahead, const qc_cuda *cu) {
    const dim3 block(qc_add_norm_threads(RW));
    if (shared)
        qc_launch(cu, qc_gemv_q8_add_norm_kernel<T, true, RW>, grid, block, shared, W, rb, w->cols, xq, residual, out,
                  norm_w, qs, ds, cu->norm_ss, ahead);
    else
        qc_launch(cu, qc_gemv_q8_add_norm_kernel<T, false, RW>, grid, block, 0, W, rb, w->cols, xq, residual, out,
                  norm_w, qs, ds, cu->norm_ss, ahead);
}

static void launch_add_norm(const qc_weight *w, const qc_q8x &xq, const float *residual, float *out,
                            const float *norm_w, const qc_l2_ahead &ahead, const qc_cuda *cu) {
    const int64_t rb = qc_row_bytes(w->type, w->cols);
    const dim3 grid((unsigned)(w->rows / QC_ADD_NORM_ROWS));
    int8_t *qs = (int8_t *)cu->q8x_norm;
    float2 *ds = qc_q8x_ds_at(cu->q8x_norm, 1, w->rows);
    const uint8_t *W = (const uint8_t *)w->data;
    const size_t shared = cu->w_shared ? qc_shared_copy_bytes(QC_ADD_NORM_ROWS * rb) : 0;
#define QC_ARGS_ grid, shared, W, rb, w, xq, residual, out, norm_w, qs, ds, ahead, cu
    switch (w->type) {
#define QC_CASE_(T)                                                                                          \
    case T:                                                                                                  \
        if (cu->add_norm_rw == 2) launch_add_norm_rw<T, 2>(QC_ARGS_);                                        \
        else launch_add_norm_rw<T, 4>(QC_ARGS_);                                                             \
        break;
        QC_CASE_(QC_TYPE_Q4_0) QC_CASE_(QC_TYPE_Q5_0) QC_CASE_(QC_TYPE_Q8_0)
#undef QC_CASE_
    }
#undef QC_ARGS_
}

/* matmul (residual NULL) and matmul_add: the GEMV up to QC_GEMV_MAX_TOKENS tokens, else cuBLAS.
 * x_from_last_op: x is the unchanged output of the op just before, whose 8-bit form that op may
 * have left (cu->q8x_of, laid out at cu->q8x_of_at): then the GEMV reads it there, with no
 * quantize launch. */
static int matmul_any(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                      const float *residual, float *out, int x_from_last_op, const float *norm_next,
                      const qc_q8x *xq_made, const qc_head_draw *draw) {
    qc_cuda *cu = qc_cuda_of(be);
    cu->norm_of = NULL;   /* out may be that row; this call leaves a new one or none */
    /* read_ahead's hint is this call's to take (the GEMV's blocks issue it), and only this call's */
    const qc_l2_ahead ahead = cu->ahead;
    cu->ahead = qc_l2_ahead{};
    cu->ahead_issued = n >= 1 && n <= QC_GEMV_MAX_TOKENS && w->rows > 0 ? ahead : qc_l2_ahead{};
    if (n <= 0 || w->rows <= 0) return 0;
    if (!qc_cuda_type_supported(w->type))
        return qc_cuda_value_error(be, "matmul: weight type %u is not supported by the CUDA backend", w->type);
    if (n > QC_GEMV_MAX_TOKENS) {
        if (residual && residual != out &&
            QC_CUDA(be, cudaMemcpyAsync(out, residual, (size_t)n * (size_t)w->rows * sizeof(float),
                                        cudaMemcpyDeviceToDevice, cu->stream)) < 0)
            return -1;
        return matmul_cublas(be, w, bias, x, n, out, residual != NULL);
    }
    const int64_t rows_per_block = QC_GEMV_WARPS / qc_gemv_split(w->cols);
    if ((w->rows + rows_per_block - 1) / rows_per_block > INT32_MAX)
        return qc_cuda_value_error(be, "matmul: %lld rows is too many", (long long)w->rows);
    qc_q8x xq = {};
    if (xq_made && !qc_cuda_gemv_q8(be, w->type, w->cols))
        return qc_cuda_value_error(be, "matmul: an 8-bit x for weight type %u", w->type);
    if (qc_cuda_gemv_q8(be, w->type, w->cols)) {
        const int handed = x_from_last_op && n == 1 && cu->q8x_of == x && cu->q8x_cols == w->cols;
        if (xq_made)
            xq = *xq_made;
        else if (handed)
            xq = qc_q8x{(const int8_t *)cu->q8x_of_at, qc_q8x_ds_at(cu->q8x_of_at, 1, w->cols), w->cols, w->cols / 32};
        else if (qc_cuda_quantize_q8(be, x, n, w->cols, &xq) < 0)
            return -1;
        /* The o projection (x the attention's output, its 8-bit form handed over in q8x) lets the
         * next kernel launch before its own wait: the feed-forward norm, whose few blocks (7 at
         * 0.5B) are then placed while the projection runs and pass their wait as soon as it ends
         * (H100, real file, same-lease A/B against the norm launching gate/up early: 1777-1796 ->
         * 1794-1810 tok/s at 512 keys, 1562-1573 -> 1577-1591 at 2560, bench/results/
         * 20261124-e49438a-*, addendum). qc_gemv_q8_add_norm_kernel, which leaves no norm
         * launch, does not let the gate/up kernel launch early: its 152 blocks were then placed
         * during the attention, whose share of a step rose 108 -> 127 us; same-lease A/B on the
         * real file, 1853-1881 -> 1901-1911 tok/s at 512 keys, 1654-1670 -> 1663-1668 at 2560
         * (bench/results/20261124-dc7e3b6-*, addendum). */
        const int launch_next = handed && cu->q8x_of_at == cu->q8x;
        if (norm_next && add_norm_takes(w, n, residual)) {
            launch_add_norm(w, xq, residual, out, norm_next, ahead, cu);
            if (QC_LAUNCHED(be, "qc_gemv_q8_add_norm_kernel") < 0) return -1;
            cu->norm_of = out;
            cu->norm_of_w = norm_next;
            cu->norm_cols = w->rows;
            return 0;
        }
        bool drew = false;
        switch (w->type) {
#define QC_CASE_(T) case T: drew = launch_gemv<T, true>(be, w, bias, x, xq, n, residual, out, ahead, launch_next, draw); break;
            QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
        }
        if (QC_LAUNCHED(be, "qc_gemv_kernel") < 0) return -1;
        /* matmul_draw asked rows4_takes first: a draw no kernel made would read as no token */
        return draw && !drew ? qc_cuda_value_error(be, "matmul_draw: the four-row kernel did not take it") : 0;
    }
    switch (w->type) {
#define QC_CASE_(T) case T: launch_gemv<T, false>(be, w, bias, x, xq, n, residual, out, ahead, 0, NULL); break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_gemv_kernel");
}

int qc_cuda_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                   float *out) {
    return matmul_any(be, w, bias, x, n, NULL, out, 0, NULL, NULL, NULL);
}

int qc_cuda_matmul_add(qc_backend *be, const qc_weight *w, const float *x, int n,
                       const float *residual, float *out, int x_from_last_op, const float *norm_next) {
    return matmul_any(be, w, NULL, x, n, residual, out, x_from_last_op, norm_next, NULL, NULL);
}

/* matmul_draw (backend.h): the four-row kernel with its draw (qc_head_draw), where it takes w.
 * Measured and not kept (H200, real file, 2026-12-03; report 20261203-bf63cef-*, addendum 2): the
 * lm_head's launch as a plain stream edge, not a programmatic dependent launch (stamps of 25ac1c7
 * put 2.77 us between the output norm's end and its first release, where other grids wait about
 * 0.5): 2346.1 and 2346.5 tok/s at 512 keys against 2352.1 and 2362.2; with the norm's launch
 * plain too, 2347.2 and 2355.0 against 2348.8 and 2361.1. Once the last layer folded (bf63cef)
 * that gap was 0.48 us. */
int qc_cuda_matmul_draw(qc_backend *be, const qc_weight *w, const float *x, const int64_t *x_sum, const float *norm_w,
                        float eps, float *logits, const void *state, void *result, int32_t *ids, int32_t *pos) {
    qc_cuda *cu = qc_cuda_of(be);
    if (x_sum && !norm_w) return qc_cuda_value_error(be, "matmul_draw: x_sum takes the output norm");
    if (!cu->head_draw || !rows4_takes(be, w, 1, 0) || w->rows > INT32_MAX || (norm_w && w->cols > QC_NORM_FUSE_MAX_COLS))
        return 0;
    /* a fed draw also into its session's pair of host slots (draw_ticket), where one is free */
    const int pair = ids && cu->draw_to_host ? qc_cuda_draw_pair(cu, result, 1) : -1;
    const qc_head_draw draw = {cu->draw_best, (const qc_sample_state *)state, (qc_sample_result *)result, ids, pos,
                               pair >= 0 ? (qc_sample_result *)cu->draw_host_dev + 2 * pair : NULL};
    /* the output norm: x (plus x_sum, the last layer's down projection) normalised and quantized
     * in one launch (qc_norm_quantize_q8_kernel: rmsnorm's numbers, then qc_quantize_q8_kernel's),
     * where it took the rmsnorm and the quantize kernels */
    qc_q8x xq = {};
    if (norm_w && qc_cuda_norm_quantize_q8(be, x, x_sum, norm_w, w->cols, eps, &xq, NULL) < 0) return -1;
    if (matmul_any(be, w, NULL, x, 1, NULL, logits, 0, NULL, norm_w ? &xq : NULL, &draw) < 0) return -1;
    if (ids) qc_cuda_forget_rope(cu);   /* it moves the position (feed_draw) */
    qc_launch(cu, qc_head_draw_finish_kernel, dim3(1), dim3(32), 0, draw);
    if (QC_LAUNCHED(be, "qc_head_draw_finish_kernel") < 0) return -1;
    return draw.host ? 2 : 1;
}
