/* matmul_multi.cu: out_i[n][rows_i] = x[n][cols] @ W_i^T (+ bias_i) for up to
 * QC_MATMUL_MULTI_MAX weights of one x (q, k and v), each with its own block format.
 *
 * Decode and short batches (n <= QC_GEMV_MAX_TOKENS): one launch whose blocks cover the
 * weights' rows one after the other: part i owns blocks [first_block_i, first_block_i+1), each
 * part's rows rounded up to whole blocks, so every block (and every warp) works on one weight
 * and the switch on its type (qc_gemv_row_any) never diverges. A Q4_K_M file mixes types here
 * (q and k Q5_0, v Q8_0 or Q6_K). The dot products are qc_gemv_row's, the plain matmul's.
 *
 * With a norm weight, a decode launch (one token, dim <= QC_NORM_IN_BLOCK_MAX_COLS) normalises x
 * in every block's shared memory first (qc_norm_row_to_shared: the rmsnorm kernel's numbers), so
 * the attention norm costs no launch; other evals normalise into a scratch buffer first.
 *
 * A weight with an 8-bit GEMV (qc_gemv_q8.cuh) gets qc_gemv_q8_row_any's dot products, on x
 * normalised and quantized to 8 bits once into the backend's buffer (qc_cuda_norm_quantize_q8,
 * qc_cuda_quantize_q8), as matmul does; the others the float ones.
 *
 * Prefill (n > QC_GEMV_MAX_TOKENS): the matmul op, once per weight (cuBLAS).
 *
 * matmul_qkv_rope: q, k and v as above, then rope_kv_store (rope.cu). A decode step (one token)
 * does both in one launch (qc_gemv_qkv_rope_kernel): each block of q and k holds two whole RoPE
 * pairs, so it rotates its rows itself and writes k and v into the caches; a kernel boundary
 * and a pass through L2 fewer a layer. The dot products are this file's, the rotation
 * rope.cu's (qc_rope_angle, qc_rope_apply): the same bits as the two ops.
 */
#include "qc_gemv.cuh"
#include "qc_gemv_q8.cuh"
#include "qc_rope.cuh"
#include "qc_slices.cuh"

/* One weight of a launch, by value in the kernel's parameters. */
struct qc_gemv_part {
    const uint8_t *W;         /* stored rows */
    const float *bias;        /* (rows) or NULL */
    float *out;               /* (n, rows) */
    int64_t row_bytes, rows;
    uint32_t type;
    int q8;                   /* 8-bit GEMV (qc_cuda_gemv_q8) */
    unsigned first_block;     /* blocks before this part's */
};

struct qc_gemv_parts {
    qc_gemv_part part[QC_MATMUL_MULTI_MAX];
    int n_parts;
    int any_q8;
};

template <int NT, bool ANY_Q8>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_multi_kernel(const qc_gemv_parts parts, int64_t cols, const float *__restrict__ x,
                     const qc_q8x xq, int n, const float *__restrict__ norm_w, float eps) {
    /* one normalised token row (decode); NT > 1 launches never get a norm weight */
    __shared__ float xs[NT == 1 ? QC_NORM_FUSE_MAX_COLS : 1];
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    /* the part of this block: the last whose first block is <= blockIdx.x (an unrolled loop:
     * constant indices, so the parameter array is not copied to local memory) */
    qc_gemv_part p = parts.part[0];
#pragma unroll
    for (int i = 1; i < QC_MATMUL_MULTI_MAX; i++)
        if (i < parts.n_parts && blockIdx.x >= parts.part[i].first_block) p = parts.part[i];
    const int lane = threadIdx.x & 31;
    const int64_t r0 = (int64_t)(blockIdx.x - p.first_block) * QC_GEMV_WARPS;
    const int64_t r = r0 + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * NT;
    qc_gemv_prefetch(p.W, p.row_bytes, r0, QC_GEMV_WARPS, p.rows);
    qc_grid_start();
    if constexpr (NT == 1) {
        if (norm_w) qc_norm_row_to_shared(x, norm_w, (int)cols, eps, xs, norm_tmp);
    }
    if (r >= p.rows) return;   /* whole warps leave together: the shuffles stay full */
    float acc[NT];
    qc_gemv_row_either<NT>(ANY_Q8 && p.q8, p.type, p.W + r * p.row_bytes, cols, xq, NT == 1 && norm_w ? xs : NULL, x,
                           n, t0, lane, acc);
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < NT; j++)
        if (t0 + j < n) p.out[(int64_t)(t0 + j) * p.rows + r] = p.bias ? acc[j] + p.bias[r] : acc[j];
}

/* RoPE and the cache write of a one-token q, k, v launch (qc_gemv_qkv_rope_kernel). */
struct qc_gemv_rope {
    const int32_t *pos;          /* the token's position (device memory) */
    void *k_cache, *v_cache;     /* rows of kv_dim values of the cache's type */
    int64_t kv_dim;
    int head_dim;                /* a multiple of 4: a block holds two pairs */
    double theta;
};

/* Parts q, k, v of one token, then RoPE of q and k and the cache write of the rotated k and of
 * v (rope_kv_store's values). Block j of q or k holds pairs i and i + 1 of head h
 * (i = 2 (j mod head_dim / 4), h = j div (head_dim / 4)): warps 0 and 1 compute rows i and i + 1,
 * warps 2 and 3 their partners i + head_dim / 2 and i + 1 + head_dim / 2, and warps 0 and 1
 * rotate the pairs. The v part's blocks are matmul_multi's.
 * NORM_Q8 (every part 8-bit, one token, cu->qkv_norm): every block normalises x (plus x_sum's
 * sums where not NULL; block 0 leaves x plus them in x_out) and quantizes it into its own shared
 * memory, with qc_norm_quantize_q8_kernel's bits (the same row scale over the same block size,
 * the same products), instead of reading the 8-bit x that launch wrote: a launch fewer a layer,
 * as qkv_attention.cu's blocks do. */
template <bool ANY_Q8, typename KV, bool NORM_Q8 = false>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_qkv_rope_kernel(const qc_gemv_parts parts, int64_t cols, const float *__restrict__ x, const qc_q8x xq,
                        const float *__restrict__ norm_w, float eps, const qc_gemv_rope rope,
                        const long long *x_sum, float *x_out) {
    static_assert(!NORM_Q8 || ANY_Q8, "the in-block 8-bit norm: 8-bit parts");
    static_assert(QC_GEMV_WARPS == 4, "two pairs a block");
    __shared__ __align__(16) float xs[QC_NORM_FUSE_MAX_COLS];   /* (NORM_Q8: the 8-bit x, 16-byte loads) */
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    __shared__ float row_out[QC_GEMV_WARPS];
    int which = 0;   /* 0 q, 1 k, 2 v (an unrolled loop, as in qc_gemv_multi_kernel) */
    qc_gemv_part p = parts.part[0];
#pragma unroll
    for (int i = 1; i < 3; i++)
        if (blockIdx.x >= parts.part[i].first_block) {
            p = parts.part[i];
            which = i;
        }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t j = blockIdx.x - p.first_block;
    const int half = rope.head_dim / 2;
    const int64_t head = j / (half / 2);
    const int i = 2 * (int)(j % (half / 2)) + (warp & 1);   /* this warp's pair in its head */
    const int64_t base = head * rope.head_dim + (i & ~1);   /* the block's first row */
    const int64_t r = which < 2 ? base + (warp & 1) + (warp >> 1) * half : j * QC_GEMV_WARPS + warp;
    /* before the wait: the weights into L2, and the angle (it needs only the position, which the
     * host uploads or the step before feeds: qc_grid_start's rule) */
    if (which < 2) {
        qc_gemv_prefetch(p.W, p.row_bytes, base, 2, p.rows);
        qc_gemv_prefetch(p.W, p.row_bytes, base + half, 2, p.rows);
    } else {
        qc_gemv_prefetch(p.W, p.row_bytes, j * QC_GEMV_WARPS, QC_GEMV_WARPS, p.rows);
    }
    const int32_t pos = rope.pos[0];
    const double2 cs = which < 2 && warp < 2 && lane == 0 ? qc_rope_angle(i, rope.head_dim, pos, rope.theta)
                                                          : make_double2(1.0, 0.0);
    const float b_r = lane == 0 && p.bias && r < p.rows ? p.bias[r] : 0.0f;   /* a weight: before the wait */
    qc_grid_start();
    qc_q8x xq_in = xq;
    if constexpr (NORM_Q8) {
        /* xs as bytes, laid out as qc_q8x (its quants, then the blocks' (d, s)) */
        int8_t *xs_qs = reinterpret_cast<int8_t *>(xs);
        float2 *xs_ds = qc_q8x_ds_at(xs_qs, 1, cols);
        const float scale = qc_norm_row_scale(x, (int)cols, eps, norm_tmp, x_sum);
        for (int b = warp; b < (int)(cols / 32); b += QC_GEMV_WARPS) {
            const int idx = 32 * b + lane;
            const float xi = qc_x_plus_sum(x, x_sum, idx);
            qc_q8_quantize_block(xi * scale * __ldg(norm_w + idx), lane, xs_qs + 32 * b, xs_ds + b);
            if (x_out && blockIdx.x == 0) x_out[idx] = xi;
        }
        __syncthreads();
        xq_in = qc_q8x{xs_qs, xs_ds, cols, cols / 32};
    } else if (norm_w) {
        qc_norm_row_to_shared(x, norm_w, (int)cols, eps, xs, norm_tmp);
    }
    if (r >= p.rows) return;   /* only past v's last row (whole warps): q and k blocks are whole */
    float acc[1];
    qc_gemv_row_either<1>(ANY_Q8 && p.q8, p.type, p.W + r * p.row_bytes, cols, xq_in, !NORM_Q8 && norm_w ? xs : NULL,
                          x, 1, 0, lane, acc);
    const float y = p.bias ? acc[0] + b_r : acc[0];
    if (which == 2) {
        if (lane == 0) {
            p.out[r] = y;
            qc_kv_put((KV *)rope.v_cache + (int64_t)pos * rope.kv_dim + r, y);
        }
        return;
    }
    if (lane == 0) row_out[warp] = y;
    __syncthreads();
    if (warp >= 2 || lane != 0) return;
    const float2 rot = qc_rope_apply(row_out[warp], row_out[warp + 2], cs);
    p.out[r] = rot.x;
    p.out[r + half] = rot.y;
    if (which == 1) {
        KV *k_row = (KV *)rope.k_cache + (int64_t)pos * rope.kv_dim;
        qc_kv_put(k_row + r, rot.x);
        qc_kv_put(k_row + r + half, rot.y);
    }
}

/* ANY_Q8: a launch with no 8-bit part (F16 weights, say) runs a kernel without the 8-bit
 * GEMV's code: 64 registers a thread instead of 78, so 8 blocks per SM instead of 6 and the 1152
 * blocks of the 7B q/k/v GEMV in about one wave (on the H100 that GEMV went from 19 to 15 us a
 * layer, in a build that also changed how far qc_gemv.cuh loads ahead). */
template <bool ANY_Q8>
static void launch_multi(const qc_gemv_parts &launch, dim3 grid, int64_t cols, const float *x, const qc_q8x &xq,
                         int n, const float *norm_w, float eps, const qc_cuda *cu) {
    const dim3 block(32 * QC_GEMV_WARPS);
#define QC_ARGS_ launch, cols, x, xq, n, norm_w, eps
    switch (qc_gemv_tokens_per_block(n)) {
    case 1: qc_launch(cu, qc_gemv_multi_kernel<1, ANY_Q8>, grid, block, 0, QC_ARGS_); break;
    case 2: qc_launch(cu, qc_gemv_multi_kernel<2, ANY_Q8>, grid, block, 0, QC_ARGS_); break;
    case 4: qc_launch(cu, qc_gemv_multi_kernel<4, ANY_Q8>, grid, block, 0, QC_ARGS_); break;
    default: qc_launch(cu, qc_gemv_multi_kernel<8, ANY_Q8>, grid, block, 0, QC_ARGS_); break;
    }
#undef QC_ARGS_
}

/* matmul_multi, and with rope (one token) the q, k, v launch that rotates and stores too. x_sum
 * (or NULL): x is x plus these sums (a folded down projection's), which go to x_out: by a
 * sum_add launch first, or (cu->norm_sums, cu->qkv_norm: experiments) by the norm where the
 * 8-bit parts take one. */
static int multi(qc_backend *be, const qc_matmul_part *parts, int n_parts, const float *x, int n,
                 const float *norm_w, float eps, const qc_gemv_rope *rope, int kv_type, const int64_t *x_sum,
                 float *x_out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n_parts < 1 || n_parts > QC_MATMUL_MULTI_MAX)
        return qc_cuda_value_error(be, "matmul_multi: %d weights (1..%d)", n_parts, QC_MATMUL_MULTI_MAX);
    const int64_t cols = parts[0].w->cols;
    for (int i = 0; i < n_parts; i++) {
        const qc_weight *w = parts[i].w;
        if (!qc_cuda_type_supported(w->type) || w->cols != cols || w->rows < 0)
            return qc_cuda_value_error(be, "matmul_multi: weight %d (type %u, %lld x %lld) is not supported "
                                       "or its columns differ from weight 0's %lld", i, w->type,
                                       (long long)w->rows, (long long)w->cols, (long long)cols);
    }
    if (n <= 0) return 0;
    int all_q8 = 1, any_q8 = 0;
    for (int i = 0; i < n_parts; i++) {
        all_q8 &= qc_cuda_gemv_q8(be, parts[i].w->type, cols);
        any_q8 |= qc_cuda_gemv_q8(be, parts[i].w->type, cols);
    }
    /* the norm of one token, in a launch that quantizes (below), can add the sums */
    const int sums_in_norm = (cu->norm_sums || cu->qkv_norm) && n == 1 && norm_w && any_q8 &&
                             cols <= QC_NORM_FUSE_MAX_COLS && (all_q8 || cols <= QC_NORM_IN_BLOCK_MAX_COLS);
    if (x_sum && !sums_in_norm) {
        if (qc_cuda_sum_add(be, x, x_sum, cols, x_out) < 0) return -1;
        x = x_out;
        x_sum = NULL;
    }
    if (norm_w && (n != 1 || cols > QC_NORM_FUSE_MAX_COLS || (!all_q8 && cols > QC_NORM_IN_BLOCK_MAX_COLS))) {
        if (qc_cuda_norm_to_scratch(be, x, norm_w, n, cols, eps, &x) < 0) return -1;
        norm_w = NULL;
    }
    if (n > QC_GEMV_MAX_TOKENS) {
        for (int i = 0; i < n_parts; i++)
            if (qc_cuda_matmul(be, parts[i].w, parts[i].bias, x, n, parts[i].out) < 0) return -1;
        return 0;
    }

    qc_gemv_parts launch = {};
    int64_t blocks = 0;
    for (int i = 0; i < n_parts; i++) {
        const qc_weight *w = parts[i].w;
        qc_gemv_part *p = &launch.part[i];
        p->W = (const uint8_t *)w->data;
        p->bias = parts[i].bias;
        p->out = parts[i].out;
        p->row_bytes = qc_row_bytes(w->type, w->cols);
        p->rows = w->rows;
        p->type = w->type;
        p->q8 = qc_cuda_gemv_q8(be, w->type, cols);
        launch.any_q8 |= p->q8;
        p->first_block = (unsigned)blocks;
        blocks += (w->rows + QC_GEMV_WARPS - 1) / QC_GEMV_WARPS;
        if (blocks > INT32_MAX)
            return qc_cuda_value_error(be, "matmul_multi: %lld rows is too many", (long long)w->rows);
    }
    launch.n_parts = n_parts;
    if (blocks == 0) return 0;
    const dim3 grid((unsigned)blocks, qc_gemv_grid_y(n));
    /* the 8-bit parts' x, quantized once here (after the norm); the blocks normalise in shared
     * memory only for float parts */
    qc_q8x xq = {};
    /* the q, k, v launch normalises and quantizes x in its blocks (NORM_Q8, cu->qkv_norm) */
    const int norm_in_blocks = cu->qkv_norm && rope && all_q8 && norm_w && n == 1 && cols % 32 == 0 &&
                               cols <= QC_NORM_FUSE_MAX_COLS;
    if (norm_in_blocks) {
        const dim3 block(32 * QC_GEMV_WARPS);
        if (kv_type == QC_KV_F16)
            qc_launch(cu, qc_gemv_qkv_rope_kernel<true, __half, true>, grid, block, 0, launch, cols, x, xq, norm_w, eps,
                      *rope, (const long long *)x_sum, x_sum ? x_out : nullptr);
        else
            qc_launch(cu, qc_gemv_qkv_rope_kernel<true, float, true>, grid, block, 0, launch, cols, x, xq, norm_w, eps,
                      *rope, (const long long *)x_sum, x_sum ? x_out : nullptr);
        cu->q8x_of = NULL;   /* (as after the norm's quantize launch) */
        return QC_LAUNCHED(be, "qc_gemv_qkv_rope_kernel");
    }
    if (launch.any_q8) {
        if ((norm_w ? qc_cuda_norm_quantize_q8(be, x, x_sum, norm_w, cols, eps, &xq, x_sum ? x_out : NULL)
                    : qc_cuda_quantize_q8(be, x, n, cols, &xq)) < 0)
            return -1;
        if (x_sum) x = x_out;   /* (the float parts normalise it in their blocks) */
        if (all_q8) norm_w = NULL;
    }
    if (rope) {
        const dim3 block(32 * QC_GEMV_WARPS);
#define QC_ROPE_LAUNCH_(Q8, KV) \
    qc_launch(cu, qc_gemv_qkv_rope_kernel<Q8, KV>, grid, block, 0, launch, cols, x, xq, norm_w, eps, *rope, \
              (const long long *)nullptr, (float *)nullptr)
        if (kv_type == QC_KV_F16) {
            if (launch.any_q8) QC_ROPE_LAUNCH_(true, __half);
            else QC_ROPE_LAUNCH_(false, __half);
        } else {
            if (launch.any_q8) QC_ROPE_LAUNCH_(true, float);
            else QC_ROPE_LAUNCH_(false, float);
        }
#undef QC_ROPE_LAUNCH_
        return QC_LAUNCHED(be, "qc_gemv_qkv_rope_kernel");
    }
    if (launch.any_q8) launch_multi<true>(launch, grid, cols, x, xq, n, norm_w, eps, cu);
    else launch_multi<false>(launch, grid, cols, x, xq, n, norm_w, eps, cu);
    return QC_LAUNCHED(be, "qc_gemv_multi_kernel");
}

int qc_cuda_matmul_multi(qc_backend *be, const qc_matmul_part *parts, int n_parts, const float *x,
                         int n, const float *norm_w, float eps) {
    return multi(be, parts, n_parts, x, n, norm_w, eps, NULL, 0, NULL, NULL);
}

int qc_cuda_matmul_qkv_rope_sum(qc_backend *be, const qc_matmul_part *qkv, const float *x, const int64_t *x_sum,
                                float *x_out, int n, const float *norm_w, float eps, const int32_t *pos, int n_head,
                                int n_head_kv, int head_dim, float theta, qc_kv_cache cache) {
    /* one launch for one token whose q, k and v rows are whole heads of pairs of pairs */
    const int64_t q_dim = (int64_t)n_head * head_dim, kv_dim = (int64_t)n_head_kv * head_dim;
    if (n == 1 && head_dim > 0 && head_dim % 4 == 0 && n_head > 0 && n_head_kv > 0 && qkv[0].w->rows == q_dim &&
        qkv[1].w->rows == kv_dim && qkv[2].w->rows == kv_dim && (cache.type == QC_KV_F16 || cache.type == QC_KV_F32)) {
        const qc_gemv_rope rope = {pos, cache.k, cache.v, kv_dim, head_dim, (double)theta};
        return multi(be, qkv, 3, x, n, norm_w, eps, &rope, cache.type, x_sum, x_out);
    }
    if (x_sum) {
        if (qc_cuda_sum_add(be, x, x_sum, qkv[0].w->cols, x_out) < 0) return -1;
        x = x_out;
    }
    if (qc_cuda_matmul_multi(be, qkv, 3, x, n, norm_w, eps) < 0) return -1;
    return qc_cuda_rope_kv_store(be, qkv[0].out, qkv[1].out, qkv[2].out, pos, n, n_head, n_head_kv, head_dim, theta,
                                 cache);
}

int qc_cuda_matmul_qkv_rope(qc_backend *be, const qc_matmul_part *qkv, const float *x, int n, const float *norm_w,
                            float eps, const int32_t *pos, int n_head, int n_head_kv, int head_dim, float theta,
                            qc_kv_cache cache) {
    return qc_cuda_matmul_qkv_rope_sum(be, qkv, x, NULL, NULL, n, norm_w, eps, pos, n_head, n_head_kv, head_dim, theta,
                                       cache);
}
