/* attention.cu: causal GQA attention over the KV cache in fp32 arithmetic: the exact path (an
 * F32 cache, and every eval that captures scores or probabilities, over either cache type). An
 * F16 cache's other evals go to flash_attention.cu's tensor-core kernels.
 *
 * Query t, head h attends keys 0..pos[t] of KV head h / (n_head / n_head_kv) with scale
 * 1/sqrt(head_dim). One block per (head, token); the block's threads form groups of G lanes
 * (G a power of two, about head_dim / 4), each group takes keys j = g, g + groups, ... and keeps
 * an online softmax (running max m, sum l, and its share of the output acc) in registers: lane k
 * of a group holds dimensions k, k + G, ... (at most QC_ATT_MAXD of them). At the end the
 * groups' (m, l, acc) are merged through shared memory.
 *
 * The loop bound pos[t] is read from device memory and the grid depends only on (n_head, n),
 * never on the position: a decode step can be captured once as a CUDA graph and replayed.
 *
 * scores/probs (when not NULL, for capture): [n_head][n][n_kv]; each group writes the scaled
 * score of its keys, -inf past pos[t]; after the merge the block rereads its own scores (made
 * visible by __syncthreads) and writes exp(s - M) / L, 0 where masked.
 *
 * Short evals without scores (a decode step) split each head's keys over QC_ATT_SPLITS blocks
 * instead (qc_attention.cuh): the split kernel merges the splits through global memory, the
 * cluster kernel (sm_90) through the shared memory of one thread-block cluster. Both give the
 * same bits, as does the persistent decode kernel's attention.
 */
#include "qc_attention.cuh"

#include <cooperative_groups.h>
namespace cg = cooperative_groups;

/* Threads per block: decode and short evals (n <= QC_GEMV_MAX_TOKENS) have only n_head * n
 * blocks, so each gets many key groups; long prefills have blocks enough. The choice depends on
 * the token count only, never on the position (graph capture of the decode step). */
#define QC_ATT_THREADS_SHORT 1024
#define QC_ATT_THREADS_LONG 256
template <int G, typename KV>
__global__ void __launch_bounds__(QC_ATT_THREADS_SHORT)
qc_attention_kernel(const float *__restrict__ q, const KV *__restrict__ k_cache,
                    const KV *__restrict__ v_cache, const int32_t *__restrict__ pos, int n,
                    int n_kv, int n_head, int n_head_kv, int head_dim, float scale,
                    float *__restrict__ out, float *scores, float *probs) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, t = blockIdx.y;
    const int kvh = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * head_dim;
    const int lane = threadIdx.x % G, group = threadIdx.x / G, groups = blockDim.x / G;
    /* the G lanes of this group, as a shuffle mask within the warp */
    const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << ((threadIdx.x & 31) & ~(G - 1));
    qc_grid_start();
    const int last = pos[t];     /* keys 0..last */

    float qr[QC_ATT_MAXD], acc[QC_ATT_MAXD];
    const float *qv = q + ((int64_t)t * n_head + h) * head_dim;
    qc_att_load_q<G>(qv, head_dim, lane, qr, acc);
    float m = -INFINITY, l = 0.0f;
    float *srow = scores ? scores + ((int64_t)h * n + t) * n_kv : nullptr;
    qc_att_keys<G, KV>(qr, k_cache + (int64_t)kvh * head_dim, v_cache + (int64_t)kvh * head_dim,
                       kv_dim, head_dim, scale, group, groups, last, gmask, lane, srow, n_kv, m, l, acc);

    const float M = qc_att_publish<G>(smem, group, groups, lane, head_dim, m, l, acc);
    const float L = qc_att_merged(smem, groups, head_dim, M, -1);
    const float inv_L = L > 0.0f ? 1.0f / L : 0.0f;
    float *o = out + ((int64_t)t * n_head + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        o[d] = qc_att_merged(smem, groups, head_dim, M, d) * inv_L;
    if (srow) {
        float *prow = probs ? probs + ((int64_t)h * n + t) * n_kv : nullptr;
        for (int j = threadIdx.x; j < n_kv; j += blockDim.x) {
            if (j <= last) {
                if (prow) prow[j] = expf(srow[j] - M) * inv_L;
            } else {
                srow[j] = -INFINITY;
                if (prow) prow[j] = 0.0f;
            }
        }
    } else if (probs) {
        /* probs without scores: recompute the scores (rare; capture asks for both) */
        float *prow = probs + ((int64_t)h * n + t) * n_kv;
        for (int j = threadIdx.x; j < n_kv; j += blockDim.x) {
            if (j <= last) {
                const KV *kr = k_cache + (int64_t)j * kv_dim + (int64_t)kvh * head_dim;
                float s = 0.0f;
                for (int d = 0; d < head_dim; d++) s = fmaf(qv[d], qc_kv_get(kr + d), s);
                prow[j] = expf(s * scale - M) * inv_L;
            } else {
                prow[j] = 0.0f;
            }
        }
    }
}

/* HD: head_dim known when compiled (the 4 G of Qwen2's 64 and 128), else 0. Every helper is
 * inlined, so each `d < head_dim` of a lane's dimensions folds away, and with it the branch
 * around each load of q, K and V, where the warp waited for the loaded value (one L2 round trip
 * after another). The arithmetic is the same. */
template <int G, typename KV, int HD>
__global__ void __launch_bounds__(QC_ATT_SPLIT_THREADS)
qc_attention_split_kernel(const float *__restrict__ q, const KV *__restrict__ k_cache,
                          const KV *__restrict__ v_cache, const int32_t *__restrict__ pos,
                          int n_head, int n_head_kv, int head_dim_arg, float scale,
                          float *__restrict__ part, unsigned int *__restrict__ done,
                          float *__restrict__ out, int8_t *__restrict__ out_qs, float2 *__restrict__ out_ds) {
    const int head_dim = HD ? HD : head_dim_arg;
    extern __shared__ float smem[];
    __shared__ float weight[32];
    __shared__ int last_block;
    const int t = blockIdx.z;
    /* before the wait (qc_grid_start's rule): the position, and L2 asked for this block's keys */
    const int last = pos[t];
    qc_att_prefetch_keys<G, KV>(k_cache, v_cache, last, blockIdx.x, blockIdx.y, QC_ATT_SPLITS, n_head, n_head_kv,
                                head_dim, (int)threadIdx.x);
    qc_grid_start();
    /* (the grid's y is QC_ATT_SPLITS: a constant, the merge's loops over the splits unroll) */
    qc_att_split_block<G, KV, true>(q, k_cache, v_cache, last, blockIdx.x, blockIdx.y, QC_ATT_SPLITS, t, n_head,
                                    n_head_kv, head_dim, scale, part, done, out, out_qs, out_ds, smem, weight,
                                    &last_block);
}

/* The same splits merged in the shared memory of a thread-block cluster (qc_attention.cuh,
 * "split-K in thread-block clusters", says how and why): one cluster per (head, token). */
template <int G, typename KV, int HD>
__global__ void __launch_bounds__(QC_ATT_SPLIT_THREADS * QC_ATT_CLUSTER_SPLITS)
qc_attention_cluster_kernel(const float *__restrict__ q, const KV *__restrict__ k_cache,
                            const KV *__restrict__ v_cache, const int32_t *__restrict__ pos, int n_head,
                            int n_head_kv, float scale, float *__restrict__ out, int8_t *__restrict__ out_qs,
                            float2 *__restrict__ out_ds, int hold) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ float smem[];
    __shared__ float weight[32];
    constexpr int pub_floats = (QC_ATT_SPLIT_THREADS / G) * (2 + HD);
    const int h = blockIdx.x, t = blockIdx.z;
    const int sub = threadIdx.x / QC_ATT_SPLIT_THREADS, tid = threadIdx.x % QC_ATT_SPLIT_THREADS;
    const int split = blockIdx.y * QC_ATT_CLUSTER_SPLITS + sub;
    const unsigned rank = cg::this_cluster().block_rank();   /* = blockIdx.y: the cluster spans the grid's y */
    float *parts = smem + QC_ATT_CLUSTER_SPLITS * pub_floats;   /* every split's partial, split by split */
    /* barrier phase 1, arrival: this block has started (another block may write into block 0's
     * shared memory only once block 0 runs, so every block waits for phase 1 before it does) */
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    const int last = pos[t];
    /* the keys below every position of the eval (its tokens' new keys are at them) */
    int before = hold ? last : 0;
    for (int u = 0; u < (int)gridDim.z; u++) before = min(before, pos[u]);
    qc_att_held<KV, QC_ATT_HELD> held;
    qc_att_held_load<G, KV, QC_ATT_HELD>(held, k_cache, v_cache, before, h, split, QC_ATT_SPLITS, n_head, n_head_kv,
                                         HD, tid);
    qc_att_prefetch_keys<G, KV>(k_cache, v_cache, last, h, split, QC_ATT_SPLITS, n_head, n_head_kv, HD, tid,
                                hold ? QC_ATT_HELD : 0);
    qc_grid_start();
    qc_att_split_partial<G, KV, true, QC_ATT_HELD>(q, k_cache, v_cache, last, h, split, QC_ATT_SPLITS, t, n_head,
                                                   n_head_kv, HD, scale, parts + split * (HD + 2),
                                                   smem + sub * pub_floats, tid, &held);
    __syncthreads();   /* this block's partials complete */
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    qc_att_cluster_merge<HD>(parts, rank, (int64_t)t * n_head + h, out, out_qs, out_ds, weight);
#endif
}

template <typename KV>
static void launch_cluster(int G, int head_dim, dim3 grid, const qc_cuda *cu, const float *q, const KV *k_cache,
                           const KV *v_cache, const int32_t *pos, int n_head, int n_head_kv, float scale, float *out,
                           int8_t *out_qs, float2 *out_ds) {
    /* the grid's y: QC_ATT_CLUSTER blocks of QC_ATT_CLUSTER_SPLITS splits */
    const dim3 block(QC_ATT_SPLIT_THREADS * QC_ATT_CLUSTER_SPLITS), cluster(1, QC_ATT_CLUSTER, 1);
    grid.y = QC_ATT_CLUSTER;
    const size_t smem = qc_att_cluster_floats(G, head_dim) * sizeof(float);
#define QC_CLUSTER_ARGS_ q, k_cache, v_cache, pos, n_head, n_head_kv, scale, out, out_qs, out_ds, cu->att_hold
    constexpr int G64 = qc_att_group_lanes(64), G128 = qc_att_group_lanes(128);
    if (head_dim == 64) qc_launch_ex(cu, qc_attention_cluster_kernel<G64, KV, 64>, grid, block, smem, cluster, QC_CLUSTER_ARGS_);
    else qc_launch_ex(cu, qc_attention_cluster_kernel<G128, KV, 128>, grid, block, smem, cluster, QC_CLUSTER_ARGS_);
#undef QC_CLUSTER_ARGS_
}

/* The split-K kernel of a short eval, for a cache of KV. */
template <typename KV>
static void launch_split(int G, dim3 grid, size_t smem, const qc_cuda *cu, const float *q, const KV *k_cache,
                         const KV *v_cache, const int32_t *pos, int n_head, int n_head_kv, int head_dim,
                         float scale, float *part, unsigned int *done, float *out, int8_t *out_qs,
                         float2 *out_ds) {
    const dim3 block(QC_ATT_SPLIT_THREADS);
#define QC_SPLIT_ARGS_ q, k_cache, v_cache, pos, n_head, n_head_kv, head_dim, scale, part, done, out, out_qs, out_ds
    constexpr int G64 = qc_att_group_lanes(64), G128 = qc_att_group_lanes(128);
    if (G == G64 && head_dim == 64) {
        qc_launch(cu, qc_attention_split_kernel<G64, KV, 64>, grid, block, smem, QC_SPLIT_ARGS_);
        return;
    }
    if (G == G128 && head_dim == 128) {
        qc_launch(cu, qc_attention_split_kernel<G128, KV, 128>, grid, block, smem, QC_SPLIT_ARGS_);
        return;
    }
    switch (G) {
#define QC_SPLIT_CASE_(g) \
    case g: qc_launch(cu, qc_attention_split_kernel<g, KV, 0>, grid, block, smem, QC_SPLIT_ARGS_); break;
        QC_SPLIT_CASE_(1) QC_SPLIT_CASE_(2) QC_SPLIT_CASE_(4) QC_SPLIT_CASE_(8) QC_SPLIT_CASE_(16)
        QC_SPLIT_CASE_(32)
#undef QC_SPLIT_CASE_
    }
#undef QC_SPLIT_ARGS_
}

/* The exact kernel, one block per (head, token), for a cache of KV. */
template <typename KV>
static void launch_exact(int G, dim3 grid, int threads, size_t smem, const qc_cuda *cu, const float *q,
                         const KV *k_cache, const KV *v_cache, const int32_t *pos, int n, int n_kv,
                         int n_head, int n_head_kv, int head_dim, float scale, float *out,
                         float *scores, float *probs) {
    switch (G) {
#define QC_CASE_(g)                                                                              \
    case g:                                                                                      \
        qc_launch(cu, qc_attention_kernel<g, KV>, grid, dim3(threads), smem, q, k_cache, v_cache, \
                  pos, n, n_kv, n_head, n_head_kv, head_dim, scale, out, scores, probs);         \
        break;
        QC_CASE_(1) QC_CASE_(2) QC_CASE_(4) QC_CASE_(8) QC_CASE_(16) QC_CASE_(32)
#undef QC_CASE_
    }
}

/* Without captured scores: whether an eval goes to the tensor-core flash kernels. */
static int takes_flash(qc_backend *be, int kv_type, int n, int n_kv, int head_dim) {
    return kv_type == QC_KV_F16 && qc_cuda_flash_head_dim(head_dim) &&
           (n > QC_GEMV_MAX_TOKENS || (qc_cuda_of(be)->flash_decode && qc_kv_bucket(n_kv)));
}

int qc_cuda_attention_splits(qc_backend *be, int kv_type, int n, int n_kv, int n_head, int head_dim) {
    return !takes_flash(be, kv_type, n, n_kv, head_dim) && qc_att_split_fits(n, n_head, head_dim);
}

int qc_cuda_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos, int n,
                      int n_kv, int n_head, int n_head_kv, int head_dim, float *out, float *scores,
                      float *probs) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n <= 0) return 0;
    if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0)
        return qc_cuda_value_error(be, "attention: n_head %d is not a multiple of n_head_kv %d", n_head, n_head_kv);
    if (head_dim <= 0 || head_dim > 32 * QC_ATT_MAXD)
        return qc_cuda_value_error(be, "attention: head_dim %d is not in 1..%d", head_dim, 32 * QC_ATT_MAXD);
    if (cache.type != QC_KV_F32 && cache.type != QC_KV_F16)
        return qc_cuda_value_error(be, "attention: unknown KV cache type %d", cache.type);
    /* out is rewritten: q8x no longer holds its 8-bit form, unless the split kernel leaves it */
    cu->q8x_of = NULL;
    /* an F16 cache without captured scores: the tensor-core kernels (flash_attention.cu) */
    const int64_t q_dim = (int64_t)n_head * head_dim;
    /* one token's output also leaves its 8-bit form in q8x (cu->q8x_of), quantized with
     * qc_quantize_q8_kernel's bits by the kernel that writes it (the split kernels' merge, the
     * flash decode's): the o projection's matmul_add reads it there instead of launching the
     * quantization */
    const int with_q8 = n == 1 && cu->gemv_q8 && head_dim % 32 == 0 && q_dim <= QC_Q8X_MAX_COLS;
    int8_t *out_qs = with_q8 ? (int8_t *)cu->q8x : nullptr;
    float2 *out_ds = with_q8 ? qc_q8x_ds_at(cu->q8x, 1, q_dim) : nullptr;
    if (!scores && !probs && takes_flash(be, cache.type, n, n_kv, head_dim)) {
        const int q8_left = qc_cuda_flash_attention(be, q, cache, pos, n, n_head, n_head_kv, head_dim, out, out_qs,
                                                    out_ds);
        if (q8_left < 0) return -1;
        if (q8_left) {
            cu->q8x_of = out;
            cu->q8x_cols = q_dim;
            cu->q8x_of_at = cu->q8x;
        }
        return 0;
    }
    if (n > 65535) return qc_cuda_value_error(be, "attention: %d queries in one call (at most 65535)", n);
    const int G = qc_att_group_lanes(head_dim);
    const float scale = 1.0f / sqrtf((float)head_dim);
    if (!scores && !probs && qc_att_split_fits(n, n_head, head_dim)) {
        /* a decode step over an F32 cache (or an F16 one of a head_dim flash does not take):
         * split-K over the keys */
        const int groups = QC_ATT_SPLIT_THREADS / G;
        const size_t smem = (size_t)groups * (size_t)(2 + head_dim) * sizeof(float);
        const dim3 grid((unsigned)n_head, QC_ATT_SPLITS, (unsigned)n);
        /* (the merge quantizes from registers: qc_att_merge_splits) */
        if (cu->clusters && qc_att_cluster_takes(G, head_dim)) {
            if (cache.type == QC_KV_F16)
                launch_cluster<__half>(G, head_dim, grid, cu, q, (const __half *)cache.k, (const __half *)cache.v, pos,
                                       n_head, n_head_kv, scale, out, out_qs, out_ds);
            else
                launch_cluster<float>(G, head_dim, grid, cu, q, (const float *)cache.k, (const float *)cache.v, pos,
                                      n_head, n_head_kv, scale, out, out_qs, out_ds);
        } else if (cache.type == QC_KV_F16)
            launch_split<__half>(G, grid, smem, cu, q, (const __half *)cache.k, (const __half *)cache.v, pos, n_head,
                                 n_head_kv, head_dim, scale, cu->attn_part, cu->attn_done, out, out_qs, out_ds);
        else
            launch_split<float>(G, grid, smem, cu, q, (const float *)cache.k, (const float *)cache.v, pos, n_head,
                                n_head_kv, head_dim, scale, cu->attn_part, cu->attn_done, out, out_qs, out_ds);
        if (QC_LAUNCHED(be, "qc_attention_split_kernel or qc_attention_cluster_kernel") < 0) return -1;
        if (with_q8) {
            cu->q8x_of = out;
            cu->q8x_cols = q_dim;
            cu->q8x_of_at = cu->q8x;
        }
        return 0;
    }
    const int threads = n <= QC_GEMV_MAX_TOKENS ? QC_ATT_THREADS_SHORT : QC_ATT_THREADS_LONG;
    const int groups = threads / G;
    const size_t smem = (size_t)groups * (size_t)(2 + head_dim) * sizeof(float);
    const dim3 grid((unsigned)n_head, (unsigned)n);
    if (cache.type == QC_KV_F16)
        launch_exact<__half>(G, grid, threads, smem, cu, q, (const __half *)cache.k,
                             (const __half *)cache.v, pos, n, n_kv, n_head, n_head_kv, head_dim, scale,
                             out, scores, probs);
    else
        launch_exact<float>(G, grid, threads, smem, cu, q, (const float *)cache.k,
                            (const float *)cache.v, pos, n, n_kv, n_head, n_head_kv, head_dim, scale,
                            out, scores, probs);
    return QC_LAUNCHED(be, "qc_attention_kernel");
}
