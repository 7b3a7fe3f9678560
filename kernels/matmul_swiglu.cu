/* matmul_swiglu.cu: act[n][rows] = silu(x @ Wg^T) * (x @ Wu^T), the feed-forward's gate and up
 * projections and their SwiGLU, without the gate and up matrices.
 *
 * Decode and short batches (n <= QC_GEMV_MAX_TOKENS): one GEMV launch in which the warp of row
 * r computes row r of w_gate and row r of w_up, and lane 0 writes only act. When the two
 * weights have one type (the usual case) both rows are read in one loop (qc_gemv_row2: twice
 * the loads in flight); when they differ, one after the other, each through a switch on its
 * type that is the same for the whole grid. The dot products are qc_gemv_row's and the SwiGLU is
 * qc_silu_mul, so act equals matmul, matmul, swiglu bit for bit.
 *
 * A norm weight and 8-bit activations (qc_gemv_q8.cuh) are applied as in matmul_multi.cu: a
 * weight with an 8-bit GEMV reads x normalised and quantized once by the launcher, a float one
 * x normalised in shared memory (decode) or in a scratch buffer. One token of a 0.5B-like
 * shape takes qc_gemv_q8_swiglu_q8out_kernel, 32 rows a block, which also leaves act's 8-bit
 * form for the down projection; when the matmul_add before it left x's normalised 8-bit form
 * (norm_next, backend.h), that kernel reads it and applies the norm's scale after its dot
 * products (qc_gemv_q8.cuh), and the norm costs no launch.
 *
 * Prefill (n > QC_GEMV_MAX_TOKENS): those three ops, with gate in act and up in a backend
 * scratch buffer (grown outside the decode path, like matmul's).
 */
#include "qc_gemv.cuh"
#include "qc_gemv_q8.cuh"
#include "qc_slices.cuh"

/* What every gate/up kernel does first: ask L2 for this block's rows of both weights, then wait
 * for its inputs (qc_grid_start). Every thread calls it. */
__device__ __forceinline__ void qc_swiglu_start(const uint8_t *Wg, int64_t gate_row_bytes, const uint8_t *Wu,
                                                int64_t up_row_bytes, int64_t rows) {
    const int64_t r0 = (int64_t)blockIdx.x * QC_GEMV_WARPS;
    qc_gemv_prefetch(Wg, gate_row_bytes, r0, QC_GEMV_WARPS, rows);
    qc_gemv_prefetch(Wu, up_row_bytes, r0, QC_GEMV_WARPS, rows);
    qc_grid_start();
}

/* And last: lane 0 writes act = silu(g) * u of row r for the tokens t0 + j < n. */
template <int NT>
__device__ __forceinline__ void qc_swiglu_store(const float (&g)[NT], const float (&u)[NT], int lane, int t0, int n,
                                                int64_t rows, int64_t r, float *__restrict__ act) {
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < NT; j++)
        if (t0 + j < n) act[(int64_t)(t0 + j) * rows + r] = qc_silu_mul(g[j], u[j]);
}

/* Tokens t0 .. t0 + NT - 1 (those < n) against row blockIdx.x * WARPS + warp of both weights,
 * of one type T. */
template <int T, int NT>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_swiglu_kernel(const uint8_t *__restrict__ Wg, const uint8_t *__restrict__ Wu,
                      int64_t row_bytes, int64_t rows, int64_t cols, const float *__restrict__ x,
                      int n, const float *__restrict__ norm_w, float eps, float *__restrict__ act) {
    __shared__ float xs[NT == 1 ? QC_NORM_FUSE_MAX_COLS : 1];
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * QC_GEMV_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * NT;
    qc_swiglu_start(Wg, row_bytes, Wu, row_bytes, rows);
    if constexpr (NT == 1) {
        if (norm_w) qc_norm_row_to_shared(x, norm_w, (int)cols, eps, xs, norm_tmp);
    }
    if (r >= rows) return;   /* whole warps leave together: the shuffles stay full */
    float g[NT], u[NT];
    if (NT == 1 && norm_w) qc_gemv_row2<T, NT, true>(Wg + r * row_bytes, Wu + r * row_bytes, cols, xs, n, t0, lane, g, u);
    else qc_gemv_row2<T, NT>(Wg + r * row_bytes, Wu + r * row_bytes, cols, x, n, t0, lane, g, u);
    qc_swiglu_store<NT>(g, u, lane, t0, n, rows, r, act);
}

/* The same with 8-bit activations (qc_gemv_q8.cuh; x normalised and quantized by the launcher
 * into xq), for gate and up of one 8-bit type. */
template <int T, int NT>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_q8_swiglu_kernel(const uint8_t *__restrict__ Wg, const uint8_t *__restrict__ Wu,
                         int64_t row_bytes, int64_t rows, int64_t cols, const qc_q8x xq, int n,
                         float *__restrict__ act) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * QC_GEMV_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * NT;
    qc_swiglu_start(Wg, row_bytes, Wu, row_bytes, rows);
    if (r >= rows) return;
    float g[NT], u[NT];
    qc_gemv_q8_row2<T, NT>(Wg + r * row_bytes, Wu + r * row_bytes, cols, xq, n, t0, lane, g, u);
    qc_swiglu_store<NT>(g, u, lane, t0, n, rows, r, act);
}

/* One token, gate and up of one 32-element 8-bit type (Q4_0, Q5_0, Q8_0), QC_SWIGLU_ROWS rows a
 * block: each warp computes two rows of both weights in one loop (qc_gemv_q8_row4: four rows'
 * loads in flight, each with qc_gemv_q8_row_slice's operations, so act is
 * qc_gemv_q8_swiglu_kernel's bit for bit), and the block, holding a whole block of 32 act values,
 * also quantizes it (qc_q8_quantize_block: qc_quantize_q8_kernel's bits) into act_qs, act_ds for
 * the down projection (matmul.cu reads it through cu->q8x_of). Why: that quantize was a launch of
 * its own after every gate/up, a kernel boundary and a pass through L2 a layer; a 0.5B decode
 * step went from 1601-1608 to 1622-1640 tok/s on the H100 (bench/results/20261124-48c3e59-*).
 * Where it is taken (swiglu_q8out_takes): two blocks an SM hold 64 registers a thread, which the
 * 256-element formats exceed (Q4_K, Q6_K spilled), and the grid must be one wave of them: the
 * 1.5B (8960 rows, Q4_K) and 7B (18944) decoded 1.7% and 5.6% slower with it.
 * Measured and not kept (H200, real file, report 20261202-42e03b5-*, addendum): 64 rows a block
 * (76 blocks of 1024 threads, 79 KB of copies), since a dependency across a grid of fewer blocks
 * resolves sooner (matmul.cu, qc_gemv_q8_split_rows_kernel): 2173.1 tok/s at 512 keys and 1842.4
 * at 2560 against 2224.2 and 1907.3 in the same round; a block holding a whole SM's registers
 * leaves no room beside it for the down projection's blocks until it ends.
 * Measured and not kept (H200, real file, three alternating rounds in one lease, 2026-12-03,
 * against 25ac1c7): x's 8-bit form and the norm's block sums staged in shared memory after the
 * wait (each 16-byte piece loaded by one thread of the block, then a block barrier), here and in
 * the o projection's add_norm kernel, since each of the 16 warps of the 152 blocks reads all of x
 * from L2 (step stamps put warp 0's dot products 1.8-2.0 us after the release, its rows already
 * in shared memory): 2179.3, 2176.4, 2182.9 tok/s at 512 keys and 1864.0, 1861.6, 1863.6 at 2560
 * against 2289.7, 2290.0, 2301.3 and 1950.0, 1954.7, 1957.7 (-5%; test_kernels -k "matmul_add or
 * swiglu" and test_fusion passed on it). Read off these figures (not stamped): the warps' own
 * loads of x side by side are not what the dot products wait for, and the added load and barrier
 * cost more than they saved. */
#define QC_SWIGLU_ROWS 32
#define QC_SWIGLU_Q8_THREADS (32 * QC_SWIGLU_ROWS / 2)
#define QC_SWIGLU_Q8_BLOCKS_PER_SM 2
static int swiglu_q8out_takes(const qc_cuda *cu, const qc_weight *w_gate, const qc_weight *w_up, int n) {
    const uint32_t t = w_gate->type;
    return n == 1 && w_up->type == t && (t == QC_TYPE_Q4_0 || t == QC_TYPE_Q5_0 || t == QC_TYPE_Q8_0) &&
           w_gate->rows % QC_SWIGLU_ROWS == 0 && w_gate->rows <= QC_Q8X_MAX_COLS &&
           w_gate->rows / QC_SWIGLU_ROWS <= (int64_t)QC_SWIGLU_Q8_BLOCKS_PER_SM * cu->sm_count;
}
/* DT (a weight type, or 0): the down projection folded in (swiglu_down, backend.h). The block's
 * 32 act values, quantized as above (each warp for itself, in shared memory), times its slice of
 * w_down (qc_slices.cuh: columns 32 b .. 32 b + 31 of its dim rows, copied into shared memory
 * before the wait after the gate and up rows, and waited for only after act) are its share of
 * act @ w_down^T, one partial sum of each of x's dim values, which it adds into sum by integer
 * atomics (qc_sum_of) that no thread waits for; block 0 also zeroes clear. The next layer's
 * attention op adds sum to x (qkv_attention.cu), so the down projection's launch and its
 * grid-wide wait leave the layer.
 * Measured (H200, synthetic 0.5B Q4_K_M, one lease, 2026-12-03; base c19ed0a, rounds
 * alternating): 2333.5, 2341.0, 2334.8 tok/s at 512 keys and 2024.7, 2024.0, 2014.0 at 2560,
 * against 2272.7, 2290.2, 2284.8 and 1945.2, 1948.4, 1941.6 (+2.3%, +3.9%); QWENCUDA_DOWN_FOLD=0
 * 2294.1, 2296.6 and 1953.9, 1952.9 (the base's). The layer's 2.9 us of down projection (step
 * stamps of 25ac1c7) did not all leave with it: a timing-only switch that skipped the slice's dot
 * products and atomics (wrong sums) gave 2403.4 and 2070.5, so the fold's tail costs about 3% and
 * the launch it saves about 5%. Measured and not kept: the tail after one warp's quantization and
 * a second block barrier (the copies waited for there): 2244.9, 2245.4 and 1942.5, 1942.2 against
 * 2292.5, 2292.7 and 1954.9, 1952.1 (another lease, with the attention launch's registers below
 * also raised); the sums in four copies (block b adding into copy b % 4, the consumers adding the
 * four), against atomics contending for one address from 152 blocks: 1, 2 or 4 copies written
 * were even with each other (2185.4-2202.0 tok/s at 512 keys), and the four loads of each
 * consumer made the step 4.5% slower than the base in that lease (2282.9-2298.9). Measured and not
 * kept (H200, real file, 2026-12-03, against a65eddb; report 20261203-a65eddb-*, addendum 2): the
 * slice's copies issued after the wait, since step stamps of bf63cef put this kernel's last
 * arrival at its wait 0.90 us after its first release and its releases 1.38 us apart (the
 * unfolded kernel's blocks of 25ac1c7 had all arrived 0.58 us before it): 2376.6 and 2374.8 tok/s
 * at 512 keys against 2393.5 and 2386.2, but the same build with its switch off ran 2370.2
 * against 2394.9: the switch's kernel parameter and branches cost what the late copies might
 * have gained. */
template <int T, bool SH, int DT>
__global__ void __launch_bounds__(QC_SWIGLU_Q8_THREADS, QC_SWIGLU_Q8_BLOCKS_PER_SM)
qc_gemv_q8_swiglu_q8out_kernel(const uint8_t *__restrict__ Wg, const uint8_t *__restrict__ Wu, int64_t row_bytes,
                               int64_t rows, int64_t cols, const qc_q8x xq, const float *norm_ss, float eps,
                               float *__restrict__ act, int8_t *__restrict__ act_qs, float2 *__restrict__ act_ds,
                               const uint8_t *__restrict__ slices, int64_t dim, long long *sum, long long *clear,
                               const qc_l2_ahead ahead) {
    static_assert(DT == 0 || SH, "the fold copies its slice into shared memory");
    __shared__ float act_s[QC_SWIGLU_ROWS];
    constexpr int warps = QC_SWIGLU_Q8_THREADS / 32;
    __shared__ __align__(16) int8_t act_q_s[DT ? warps : 1][QC_SWIGLU_ROWS];   /* a warp's copy of act's block */
    __shared__ float2 act_d_s[DT ? warps : 1];
    extern __shared__ __align__(16) uint8_t w_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.x * QC_SWIGLU_ROWS;   /* rows is a multiple of QC_SWIGLU_ROWS */
    const int64_t bytes = QC_SWIGLU_ROWS * row_bytes;
    /* SH: the block's gate and up rows copied into shared memory (qc_copy_to_shared), else
     * asked of L2; DT: then its slice of w_down the same way, a copy group of its own */
    const uint8_t *g = Wg + r0 * row_bytes, *u = Wu + r0 * row_bytes;
    constexpr int64_t eb = DT ? qc_slice_entry_bytes(DT) : 0;
    const uint8_t *slice = DT ? slices + (int64_t)blockIdx.x * dim * eb : NULL;
    if constexpr (SH) {
        g = qc_copy_to_shared(w_shared, g, bytes);
        u = qc_copy_to_shared(w_shared + qc_shared_copy_bytes(bytes), u, bytes);
        if constexpr (DT != 0) {
            qc_copy_commit();
            slice = qc_copy_to_shared(w_shared + 2 * qc_shared_copy_bytes(bytes), slice, dim * eb);
            qc_copy_commit();
        }
    } else {
        qc_prefetch_l2(g, bytes);
        qc_prefetch_l2(u, bytes);
    }
    qc_l2_ahead_issue(ahead);
    qc_grid_start();
    if constexpr (SH) {
        if constexpr (DT != 0) qc_copy_wait_but_last();
        else qc_copy_wait();
    }
    if constexpr (DT != 0) {
        if (clear && blockIdx.x == 0)
            for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) clear[i] = 0;
    }
    const int64_t i = 2 * warp;   /* this warp's rows r0 + i and r0 + i + 1 */
    const int64_t r = r0 + i;
    const uint8_t *const four[4] = {g + i * row_bytes, u + i * row_bytes, g + (i + 1) * row_bytes,
                                    u + (i + 1) * row_bytes};
    /* norm_ss: xq is x * norm weight, its norm's scale still to apply (qc_gemv_q8.cuh) */
    const float ss_part = norm_ss ? qc_norm_ss_load(norm_ss, cols) : 0.0f;
    float acc[4];
    qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);
    if (norm_ss) {
        const float scale = qc_norm_scale_of_ss(ss_part, cols, eps);
#pragma unroll
        for (int k = 0; k < 4; k++) acc[k] *= scale;
    }
    /* DT: this thread's copies of the slice (long done: issued before the wait) waited for here,
     * so that the barrier below also orders them */
    if constexpr (DT != 0) qc_copy_wait_own();
    if (lane == 0) {
        act_s[2 * warp] = act[r] = qc_silu_mul(acc[0], acc[1]);
        act_s[2 * warp + 1] = act[r + 1] = qc_silu_mul(acc[2], acc[3]);
    }
    __syncthreads();
    if constexpr (DT == 0) {
        if (warp == 0) qc_q8_quantize_block(act_s[lane], lane, act_qs + r0, act_ds + blockIdx.x);
    } else {
        /* every warp quantizes the block itself (the same bits in each), so that no second block
         * barrier waits for one warp's */
        qc_q8_quantize_block(act_s[lane], lane, act_q_s[warp], &act_d_s[warp]);
        __syncwarp();
        for (int64_t k = threadIdx.x; k < dim; k += blockDim.x)
            atomicAdd((unsigned long long *)(sum + k),
                      qc_sum_of(qc_slice_dot<DT, SH>(slice + k * eb, act_q_s[warp], &act_d_s[warp])));
    }
}

/* A gate and an up weight of different types, one row after the other, each with its own GEMV
 * (qc_gemv_row_either: 8-bit on xq where gate_q8 / up_q8, else float on x, normalised in shared
 * memory with norm_w). */
template <int NT>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_swiglu_mixed_kernel(const uint8_t *__restrict__ Wg, int64_t gate_row_bytes, uint32_t gate_type,
                            int gate_q8, const uint8_t *__restrict__ Wu, int64_t up_row_bytes,
                            uint32_t up_type, int up_q8, int64_t rows, int64_t cols,
                            const float *__restrict__ x, const qc_q8x xq, int n,
                            const float *__restrict__ norm_w, float eps, float *__restrict__ act) {
    __shared__ float xs[NT == 1 ? QC_NORM_FUSE_MAX_COLS : 1];
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * QC_GEMV_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * NT;
    qc_swiglu_start(Wg, gate_row_bytes, Wu, up_row_bytes, rows);
    if constexpr (NT == 1) {
        if (norm_w) qc_norm_row_to_shared(x, norm_w, (int)cols, eps, xs, norm_tmp);
    }
    if (r >= rows) return;
    const float *xsn = NT == 1 && norm_w ? xs : NULL;
    float g[NT], u[NT];
    qc_gemv_row_either<NT>(gate_q8, gate_type, Wg + r * gate_row_bytes, cols, xq, xsn, x, n, t0, lane, g);
    qc_gemv_row_either<NT>(up_q8, up_type, Wu + r * up_row_bytes, cols, xq, xsn, x, n, t0, lane, u);
    qc_swiglu_store<NT>(g, u, lane, t0, n, rows, r, act);
}

template <int T>
static void launch_swiglu_q8(const qc_weight *w_gate, const qc_weight *w_up, const qc_q8x &xq, int n,
                             float *act, dim3 grid, const qc_cuda *cu) {
    const int64_t rb = qc_row_bytes_t<T>(w_gate->cols);
    const uint8_t *Wg = (const uint8_t *)w_gate->data, *Wu = (const uint8_t *)w_up->data;
    const dim3 block(32 * QC_GEMV_WARPS);
    const int64_t rows = w_gate->rows, cols = w_gate->cols;
#define QC_ARGS_ Wg, Wu, rb, rows, cols, xq, n, act
    switch (qc_gemv_tokens_per_block(n)) {
    case 1: qc_launch(cu, qc_gemv_q8_swiglu_kernel<T, 1>, grid, block, 0, QC_ARGS_); break;
    case 2: qc_launch(cu, qc_gemv_q8_swiglu_kernel<T, 2>, grid, block, 0, QC_ARGS_); break;
    case 4: qc_launch(cu, qc_gemv_q8_swiglu_kernel<T, 4>, grid, block, 0, QC_ARGS_); break;
    default: qc_launch(cu, qc_gemv_q8_swiglu_kernel<T, 8>, grid, block, 0, QC_ARGS_); break;
    }
#undef QC_ARGS_
}

template <int T>
static void launch_swiglu(const qc_weight *w_gate, const qc_weight *w_up, const float *x, int n,
                          const float *nw, float eps, float *act, dim3 grid, const qc_cuda *cu) {
    const int64_t rb = qc_row_bytes_t<T>(w_gate->cols);
    const uint8_t *Wg = (const uint8_t *)w_gate->data, *Wu = (const uint8_t *)w_up->data;
    const dim3 block(32 * QC_GEMV_WARPS);
    const int64_t rows = w_gate->rows, cols = w_gate->cols;
#define QC_ARGS_ Wg, Wu, rb, rows, cols, x, n, nw, eps, act
    switch (qc_gemv_tokens_per_block(n)) {
    case 1: qc_launch(cu, qc_gemv_swiglu_kernel<T, 1>, grid, block, 0, QC_ARGS_); break;
    case 2: qc_launch(cu, qc_gemv_swiglu_kernel<T, 2>, grid, block, 0, QC_ARGS_); break;
    case 4: qc_launch(cu, qc_gemv_swiglu_kernel<T, 4>, grid, block, 0, QC_ARGS_); break;
    default: qc_launch(cu, qc_gemv_swiglu_kernel<T, 8>, grid, block, 0, QC_ARGS_); break;
    }
#undef QC_ARGS_
}

static void launch_swiglu_mixed(const qc_weight *w_gate, int gate_q8, const qc_weight *w_up, int up_q8,
                                const float *x, const qc_q8x &xq, int n, const float *nw, float eps,
                                float *act, dim3 grid, const qc_cuda *cu) {
    const int64_t cols = w_gate->cols, rows = w_gate->rows;
    const int64_t grb = qc_row_bytes(w_gate->type, cols), urb = qc_row_bytes(w_up->type, cols);
    const uint8_t *Wg = (const uint8_t *)w_gate->data, *Wu = (const uint8_t *)w_up->data;
    const uint32_t gt = w_gate->type, ut = w_up->type;
    const dim3 block(32 * QC_GEMV_WARPS);
#define QC_ARGS_ Wg, grb, gt, gate_q8, Wu, urb, ut, up_q8, rows, cols, x, xq, n, nw, eps, act
    switch (qc_gemv_tokens_per_block(n)) {
    case 1: qc_launch(cu, qc_gemv_swiglu_mixed_kernel<1>, grid, block, 0, QC_ARGS_); break;
    case 2: qc_launch(cu, qc_gemv_swiglu_mixed_kernel<2>, grid, block, 0, QC_ARGS_); break;
    case 4: qc_launch(cu, qc_gemv_swiglu_mixed_kernel<4>, grid, block, 0, QC_ARGS_); break;
    default: qc_launch(cu, qc_gemv_swiglu_mixed_kernel<8>, grid, block, 0, QC_ARGS_); break;
    }
#undef QC_ARGS_
}

/* The 8-bit x of the 32-row kernel (one token): x's normalised 8-bit form left by the matmul_add
 * before (norm_next; the scale after the dot products, *norm_ss), else x normalised (norm_w) and
 * quantized here. */
static int q8out_input(qc_backend *be, const qc_weight *w_gate, const float *x, const float *norm_of,
                       const float *norm_w, float eps, qc_q8x *xq, const float **norm_ss) {
    const qc_cuda *cu = qc_cuda_of(be);
    *norm_ss = NULL;
    if (norm_w && norm_of == x && cu->norm_of_w == norm_w && cu->norm_cols == w_gate->cols) {
        *xq = qc_q8x{(const int8_t *)cu->q8x_norm, qc_q8x_ds_at(cu->q8x_norm, 1, w_gate->cols), w_gate->cols,
                     w_gate->cols / 32};
        *norm_ss = cu->norm_ss;
        return 0;
    }
    return norm_w ? qc_cuda_norm_quantize_q8(be, x, NULL, norm_w, w_gate->cols, eps, xq, NULL)
                  : qc_cuda_quantize_q8(be, x, 1, w_gate->cols, xq);
}

/* The 32-row kernel's launch: gate and up of type T; DT and w_down: the fold (swiglu_down), or 0. */
struct qc_fold_args {
    const uint8_t *slices;
    int64_t dim;
    long long *sum, *clear;
    qc_l2_ahead ahead;
};
static size_t q8out_shared(const qc_weight *w_gate, const qc_weight *w_down) {
    const int64_t rb = qc_row_bytes(w_gate->type, w_gate->cols);
    size_t bytes = 2 * qc_shared_copy_bytes(QC_SWIGLU_ROWS * rb);
    if (w_down) bytes += qc_shared_copy_bytes(w_down->rows * qc_slice_entry_bytes(w_down->type));
    return bytes;
}
/* the most shared memory the fold's blocks take: two an SM (228 KB on sm_90) */
#define QC_FOLD_SHARED_MAX (100u << 10)
template <int T, int DT>
static void launch_q8out(const qc_cuda *cu, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down,
                         const qc_q8x &xq, const float *norm_ss, float eps, float *act, const qc_fold_args &f) {
    const int64_t rb = qc_row_bytes_t<T>(w_gate->cols), rows = w_gate->rows;
    int8_t *act_qs = (int8_t *)cu->q8x_act;
    float2 *act_ds = qc_q8x_ds_at(cu->q8x_act, 1, rows);
    const uint8_t *Wg = (const uint8_t *)w_gate->data, *Wu = (const uint8_t *)w_up->data;
    const dim3 grid32((unsigned)(rows / QC_SWIGLU_ROWS));
    /* both weights' rows of a block into its shared memory, where they fit (0.5B: 39 KB), and
     * with the fold its slice (0.5B: 21 or 28 KB more) */
    const size_t shared = q8out_shared(w_gate, DT ? w_down : NULL);
#define QC_ARGS_ Wg, Wu, rb, rows, w_gate->cols, xq, norm_ss, eps, act, act_qs, act_ds, f.slices, f.dim, f.sum, f.clear, f.ahead
    if constexpr (DT != 0) {   /* (fold_takes: the copies fit) */
        qc_launch(cu, qc_gemv_q8_swiglu_q8out_kernel<T, true, DT>, grid32, dim3(QC_SWIGLU_Q8_THREADS), shared, QC_ARGS_);
    } else if (cu->w_shared && shared <= QC_SHARED_COPY_MAX) {
        qc_launch(cu, qc_gemv_q8_swiglu_q8out_kernel<T, true, 0>, grid32, dim3(QC_SWIGLU_Q8_THREADS), shared, QC_ARGS_);
    } else {
        qc_launch(cu, qc_gemv_q8_swiglu_q8out_kernel<T, false, 0>, grid32, dim3(QC_SWIGLU_Q8_THREADS), 0, QC_ARGS_);
    }
#undef QC_ARGS_
}

int qc_cuda_matmul_swiglu(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                          const float *x, int n, const float *norm_w, float eps, float *act) {
    qc_cuda *cu = qc_cuda_of(be);
    const float *norm_of = cu->norm_of;   /* the matmul_add before's hand-off is this call's only */
    cu->norm_of = NULL;
    if (!qc_cuda_type_supported(w_gate->type) || !qc_cuda_type_supported(w_up->type) ||
        w_gate->rows != w_up->rows || w_gate->cols != w_up->cols)
        return qc_cuda_value_error(be, "matmul_swiglu: gate (type %u, %lld x %lld) and up (type %u, %lld x %lld) "
                                   "must be supported types of one shape", w_gate->type, (long long)w_gate->rows,
                                   (long long)w_gate->cols, w_up->type, (long long)w_up->rows, (long long)w_up->cols);
    const int64_t rows = w_gate->rows;
    if (n <= 0 || rows <= 0) return 0;
    const int gate_q8 = qc_cuda_gemv_q8(be, w_gate->type, w_gate->cols);
    const int up_q8 = qc_cuda_gemv_q8(be, w_up->type, w_up->cols);
    if (norm_w && (n != 1 || w_gate->cols > QC_NORM_FUSE_MAX_COLS ||
                   (!(gate_q8 && up_q8) && w_gate->cols > QC_NORM_IN_BLOCK_MAX_COLS))) {
        if (qc_cuda_norm_to_scratch(be, x, norm_w, n, w_gate->cols, eps, &x) < 0) return -1;
        norm_w = NULL;
    }
    if (n > QC_GEMV_MAX_TOKENS) {
        const size_t bytes = (size_t)n * (size_t)rows * sizeof(float);
        if (qc_cuda_scratch(be, &cu->scratch_up, &cu->scratch_up_bytes, bytes) < 0 ||
            qc_cuda_matmul(be, w_gate, NULL, x, n, act) < 0 ||
            qc_cuda_matmul(be, w_up, NULL, x, n, (float *)cu->scratch_up) < 0)
            return -1;
        return qc_cuda_swiglu(be, act, (const float *)cu->scratch_up, (int64_t)n * rows, act);
    }
    const int64_t blocks = (rows + QC_GEMV_WARPS - 1) / QC_GEMV_WARPS;
    if (blocks > INT32_MAX)
        return qc_cuda_value_error(be, "matmul_swiglu: %lld rows is too many", (long long)rows);
    const dim3 grid((unsigned)blocks, qc_gemv_grid_y(n));
    /* one token, gate and up of one 32-element 8-bit type, one wave: the 32-row kernel */
    const int q8out = gate_q8 && swiglu_q8out_takes(cu, w_gate, w_up, n);
    /* the 8-bit weights' x, normalised and quantized once here; the blocks normalise in shared
     * memory only for a float-GEMV weight. (The norm used to let the 32-row kernel launch before
     * its own wait, report 550e506; since the gate/up rows are read ahead into L2 (read_ahead),
     * it is the o projection that lets the norm launch early instead: matmul.cu, matmul_any.) */
    if (q8out) {
        qc_q8x xq = {};
        const float *norm_ss = NULL;
        if (q8out_input(be, w_gate, x, norm_of, norm_w, eps, &xq, &norm_ss) < 0) return -1;
        /* one token: act's 8-bit form too, for the down projection (matmul.cu, x_from_last_op) */
        switch (w_gate->type) {
#define QC_CASE_(T) case T: launch_q8out<T, 0>(cu, w_gate, w_up, NULL, xq, norm_ss, eps, act, qc_fold_args{}); break;
            QC_CASE_(QC_TYPE_Q4_0) QC_CASE_(QC_TYPE_Q5_0) QC_CASE_(QC_TYPE_Q8_0)
#undef QC_CASE_
        }
        if (QC_LAUNCHED(be, "qc_gemv_q8_swiglu_q8out_kernel") < 0) return -1;
        cu->q8x_of = act;
        cu->q8x_cols = rows;
        cu->q8x_of_at = cu->q8x_act;
        return 0;
    }
    qc_q8x xq = {};
    if (gate_q8 || up_q8) {
        if ((norm_w ? qc_cuda_norm_quantize_q8(be, x, NULL, norm_w, w_gate->cols, eps, &xq, NULL)
                    : qc_cuda_quantize_q8(be, x, n, w_gate->cols, &xq)) < 0)
            return -1;
        if (gate_q8 && up_q8) norm_w = NULL;
    }
    if (w_gate->type != w_up->type) {
        launch_swiglu_mixed(w_gate, gate_q8, w_up, up_q8, x, xq, n, norm_w, eps, act, grid, cu);
        return QC_LAUNCHED(be, "qc_gemv_swiglu_mixed_kernel");
    }
    if (gate_q8) {
        switch (w_gate->type) {
#define QC_CASE_(T) case T: launch_swiglu_q8<T>(w_gate, w_up, xq, n, act, grid, cu); break;
            QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
        }
        return QC_LAUNCHED(be, "qc_gemv_q8_swiglu_kernel");
    }
    switch (w_gate->type) {
#define QC_CASE_(T) case T: launch_swiglu<T>(w_gate, w_up, x, n, norm_w, eps, act, grid, cu); break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_gemv_swiglu_kernel");
}

/* ---- swiglu_down (backend.h): the 32-row kernel with the down projection folded in ----
 * Taken where the 32-row kernel takes gate and up (one token), w_down is an 8-bit GEMV type with
 * slices (qc_slices.cuh) of w_gate's rows by w_gate's cols, a block's copies fit two blocks an
 * SM (QC_FOLD_SHARED_MAX) and are taken (cu->w_shared), and QWENCUDA_DOWN_FOLD is not "0". */
static int fold_takes(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down) {
    const qc_cuda *cu = qc_cuda_of(be);
    return cu->down_fold && qc_cuda_gemv_q8(be, w_gate->type, w_gate->cols) && w_gate->rows == w_up->rows &&
           w_gate->cols <= QC_NORM_FUSE_MAX_COLS &&
           w_gate->cols == w_up->cols && swiglu_q8out_takes(cu, w_gate, w_up, 1) &&
           qc_cuda_gemv_q8(be, w_down->type, w_down->cols) && qc_slice_entry_bytes(w_down->type) != 0 &&
           w_down->cols == w_gate->rows && w_down->rows == w_gate->cols && cu->w_shared &&
           q8out_shared(w_gate, w_down) <= QC_FOLD_SHARED_MAX;
}

template <int T, int DT>
static int fold_allow_shared(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_down) {
    /* (also at 48 KB or less: the kernel's own shared arrays come on top of it; Q4_0 gate, up and
     * down at 0.5B take 48480 bytes of copies, and their launch failed without this) */
    const size_t shared = q8out_shared(w_gate, w_down);
    return QC_CUDA(be, cudaFuncSetAttribute(qc_gemv_q8_swiglu_q8out_kernel<T, true, DT>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));
}

#define QC_FOLD_GATE_TYPES(X, DT) X(QC_TYPE_Q4_0, DT) X(QC_TYPE_Q5_0, DT) X(QC_TYPE_Q8_0, DT)
#define QC_FOLD_SWITCH(gate_type, down_type, CALL)                                                            \
    switch (down_type) {                                                                                       \
    case QC_TYPE_Q4_0: switch (gate_type) { QC_FOLD_GATE_TYPES(CALL, QC_TYPE_Q4_0) } break;                    \
    case QC_TYPE_Q5_0: switch (gate_type) { QC_FOLD_GATE_TYPES(CALL, QC_TYPE_Q5_0) } break;                    \
    case QC_TYPE_Q8_0: switch (gate_type) { QC_FOLD_GATE_TYPES(CALL, QC_TYPE_Q8_0) } break;                    \
    case QC_TYPE_Q4_K: switch (gate_type) { QC_FOLD_GATE_TYPES(CALL, QC_TYPE_Q4_K) } break;                    \
    case QC_TYPE_Q6_K: switch (gate_type) { QC_FOLD_GATE_TYPES(CALL, QC_TYPE_Q6_K) } break;                    \
    }

int qc_cuda_swiglu_down_prepare(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down) {
    if (!fold_takes(be, w_gate, w_up, w_down)) return 0;
    /* no GPU memory for the slices: that layer is not folded (the op-by-op path needs none) */
    if (qc_cuda_make_down_slices(be, w_down) < 0) return be->err.kind == QC_ERR_NOMEM ? 0 : -1;
    int rc = 0;
#define QC_CALL_(T, DT) case T: rc = fold_allow_shared<T, DT>(be, w_gate, w_down); break;
    QC_FOLD_SWITCH(w_gate->type, w_down->type, QC_CALL_)
#undef QC_CALL_
    return rc < 0 ? -1 : 1;
}

int qc_cuda_swiglu_down(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down,
                        const float *x, const float *norm_w, float eps, float *act, int64_t *sum, int64_t *clear) {
    qc_cuda *cu = qc_cuda_of(be);
    const float *norm_of = cu->norm_of;
    cu->norm_of = NULL;
    const uint8_t *slices = qc_cuda_down_slices(be, w_down);
    if (!fold_takes(be, w_gate, w_up, w_down) || !slices || !sum || sum == clear) return 0;
    qc_q8x xq = {};
    const float *norm_ss = NULL;
    if (q8out_input(be, w_gate, x, norm_of, norm_w, eps, &xq, &norm_ss) < 0) return -1;
    /* read_ahead's hint (the next layer's q, k and v) is this call's to issue, as a matmul's */
    const qc_fold_args f = {slices, w_down->rows, (long long *)sum, (long long *)clear, cu->ahead};
    cu->ahead_issued = cu->ahead;
    cu->ahead = qc_l2_ahead{};
#define QC_CALL_(T, DT) case T: launch_q8out<T, DT>(cu, w_gate, w_up, w_down, xq, norm_ss, eps, act, f); break;
    QC_FOLD_SWITCH(w_gate->type, w_down->type, QC_CALL_)
#undef QC_CALL_
    if (QC_LAUNCHED(be, "qc_gemv_q8_swiglu_q8out_kernel") < 0) return -1;
    cu->q8x_of = NULL;   /* act's 8-bit form stayed in the blocks */
    return 1;
}
