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
 */
#include "qc_cuda.cuh"

/* Threads per block: decode and short evals (n <= QC_GEMV_MAX_TOKENS) have only n_head * n
 * blocks, so each gets many key groups; long prefills have blocks enough. The choice depends on
 * the token count only, never on the position (graph capture of the decode step). */
#define QC_ATT_THREADS_SHORT 1024
#define QC_ATT_THREADS_LONG 256
#define QC_ATT_MAXD 8        /* dimensions per lane: head_dim <= 8 * 32 = 256 */

/* What one group of G lanes does in both kernels below: lane k holds dimensions k, k + G, ...
 * (at most QC_ATT_MAXD) of the query and of its share of the output. */
template <int G>
__device__ __forceinline__ void qc_att_load_q(const float *qv, int head_dim, int lane,
                                              float (&qr)[QC_ATT_MAXD], float (&acc)[QC_ATT_MAXD]) {
#pragma unroll
    for (int i = 0; i < QC_ATT_MAXD; i++) {
        const int d = lane + i * G;
        qr[i] = d < head_dim ? qv[d] : 0.0f;
        acc[i] = 0.0f;
    }
}

/* Online softmax of one group over keys first, first + stride, ... <= last of one KV head
 * (k and v point at that head in key 0's row): running max m, sum l and output acc. When srow is
 * not NULL, lane 0 writes each scaled score below n_kv. */
template <int G, typename KV>
__device__ __forceinline__ void qc_att_keys(const float (&qr)[QC_ATT_MAXD], const KV *k,
                                            const KV *v, int kv_dim, int head_dim, float scale,
                                            int first, int stride, int last, unsigned gmask,
                                            int lane, float *srow, int n_kv, float &m, float &l,
                                            float (&acc)[QC_ATT_MAXD]) {
    for (int j = first; j <= last; j += stride) {
        const KV *kr = k + (int64_t)j * kv_dim;
        const KV *vr = v + (int64_t)j * kv_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < QC_ATT_MAXD; i++) {
            const int d = lane + i * G;
            if (d < head_dim) s = fmaf(qr[i], qc_kv_get(kr + d), s);
        }
#pragma unroll
        for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(gmask, s, off, G);
        s *= scale;
        if (srow && lane == 0 && j < n_kv) srow[j] = s;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);     /* 0 on the first key (m = -inf) */
        const float p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < QC_ATT_MAXD; i++) {
            const int d = lane + i * G;
            if (d < head_dim) acc[i] = fmaf(p, qc_kv_get(vr + d), acc[i] * corr);
        }
        m = m_new;
    }
}

/* Publish every group's (m, l, acc) to shared memory (smem = m[groups], l[groups],
 * acc[groups][head_dim]) and return the block's max M. A group that saw no key has m = -inf and
 * contributes nothing: readers skip it. */
template <int G>
__device__ __forceinline__ float qc_att_publish(float *smem, int group, int groups, int lane,
                                                int head_dim, float m, float l,
                                                const float (&acc)[QC_ATT_MAXD]) {
    float *sm_m = smem, *sm_l = smem + groups, *sm_acc = smem + 2 * groups;
    if (lane == 0) { sm_m[group] = m; sm_l[group] = l; }
#pragma unroll
    for (int i = 0; i < QC_ATT_MAXD; i++) {
        const int d = lane + i * G;
        if (d < head_dim) sm_acc[group * head_dim + d] = acc[i];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int g = 0; g < groups; g++) M = fmaxf(M, sm_m[g]);
    return M;
}

/* Sum over groups of l e^(m - M) (d < 0) or of acc[d] e^(m - M), from shared memory. */
__device__ __forceinline__ float qc_att_merged(const float *smem, int groups, int head_dim,
                                               float M, int d) {
    const float *sm_m = smem, *sm_l = smem + groups, *sm_acc = smem + 2 * groups;
    float v = 0.0f;
    for (int g = 0; g < groups; g++)
        if (sm_m[g] != -INFINITY)
            v += (d < 0 ? sm_l[g] : sm_acc[g * head_dim + d]) * expf(sm_m[g] - M);
    return v;
}

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

/* ---- split-K attention for short evals (decode) -----------------------------------------
 * A decode step has only n_head blocks above, each walking every key: at 513 keys that took
 * 34 us a layer on an H100 (a quarter of the step). Here the keys are spread over
 * QC_ATT_SPLITS blocks per (head, token): block `split` and its groups take keys
 * split * groups + group, then every splits * groups keys; the block merges its groups into one
 * unnormalised partial (m, l, acc[head_dim]). The last block of a (head, token) to finish (a
 * counter per pair, back to 0 after it) merges the splits' partials into the output, so the
 * step needs no second launch. The grid depends on (n_head, n) only, never on the position. */
#define QC_ATT_SPLITS 32
#define QC_ATT_SPLIT_THREADS 128
static_assert(QC_ATT_SPLITS <= 32, "the merge keeps one split per lane");

/* out = sum over splits of acc e^(m - M) / sum of l e^(m - M) (split 0 always holds key 0). One
 * warp turns the splits' (m, l) into weights e^(m - M) / L (lane s, split s), then every thread
 * sums its dimensions over the splits with those weights. The partials were written by other
 * blocks: they are read through L2 (__ldcg), never from a stale L1 line. */
__device__ void qc_att_merge_splits(const float *p, int splits, int head_dim, float *o, float *weight) {
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        const float ms = s < splits ? __ldcg(p + s * (head_dim + 2)) : -INFINITY;
        const float ls = s < splits ? __ldcg(p + s * (head_dim + 2) + 1) : 0.0f;
        float M = ms;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        const float e = ms == -INFINITY ? 0.0f : expf(ms - M);
        float L = ls * e;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
        if (s < splits) weight[s] = e / L;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int s = 0; s < splits; s++) v = fmaf(__ldcg(p + s * (head_dim + 2) + 2 + d), weight[s], v);
        o[d] = v;
    }
}

template <int G, typename KV>
__global__ void __launch_bounds__(QC_ATT_SPLIT_THREADS)
qc_attention_split_kernel(const float *__restrict__ q, const KV *__restrict__ k_cache,
                          const KV *__restrict__ v_cache, const int32_t *__restrict__ pos,
                          int n_head, int n_head_kv, int head_dim, float scale,
                          float *__restrict__ part, unsigned int *__restrict__ done,
                          float *__restrict__ out) {
    extern __shared__ float smem[];
    __shared__ float weight[32];
    __shared__ bool last_block;
    const int h = blockIdx.x, split = blockIdx.y, t = blockIdx.z, splits = gridDim.y;
    const int kvh = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * head_dim;
    const int lane = threadIdx.x % G, group = threadIdx.x / G, groups = blockDim.x / G;
    const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << ((threadIdx.x & 31) & ~(G - 1));

    float qr[QC_ATT_MAXD], acc[QC_ATT_MAXD];
    qc_att_load_q<G>(q + ((int64_t)t * n_head + h) * head_dim, head_dim, lane, qr, acc);
    float m = -INFINITY, l = 0.0f;
    qc_att_keys<G, KV>(qr, k_cache + (int64_t)kvh * head_dim, v_cache + (int64_t)kvh * head_dim,
                   kv_dim, head_dim, scale, split * groups + group, splits * groups, pos[t], gmask,
                   lane, nullptr, 0, m, l, acc);

    /* a split with no keys (short contexts) leaves m = -inf, l = 0: the merge skips it */
    const float M = qc_att_publish<G>(smem, group, groups, lane, head_dim, m, l, acc);
    const int64_t pair = (int64_t)t * n_head + h;
    float *mine = part + (pair * splits + split) * (head_dim + 2);
    if (threadIdx.x == 0) {
        mine[0] = M;
        mine[1] = qc_att_merged(smem, groups, head_dim, M, -1);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        mine[2 + d] = qc_att_merged(smem, groups, head_dim, M, d);

    /* publish the partial, then count it; the block that counts last merges them all */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last_block = atomicAdd(&done[pair], 1u) == (unsigned)splits - 1;
        if (last_block) done[pair] = 0;   /* ready for the next launch (all splits counted) */
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    qc_att_merge_splits(part + pair * splits * (head_dim + 2), splits, head_dim,
                        out + pair * head_dim, weight);
}

/* The split-K kernel of a short eval, for a cache of KV. */
template <typename KV>
static void launch_split(int G, dim3 grid, size_t smem, cudaStream_t st, const float *q, const KV *k_cache,
                         const KV *v_cache, const int32_t *pos, int n_head, int n_head_kv, int head_dim,
                         float scale, float *part, unsigned int *done, float *out) {
    switch (G) {
#define QC_SPLIT_CASE_(g)                                                                         \
    case g:                                                                                       \
        qc_attention_split_kernel<g, KV><<<grid, QC_ATT_SPLIT_THREADS, smem, st>>>(                \
            q, k_cache, v_cache, pos, n_head, n_head_kv, head_dim, scale, part, done, out);       \
        break;
        QC_SPLIT_CASE_(1) QC_SPLIT_CASE_(2) QC_SPLIT_CASE_(4) QC_SPLIT_CASE_(8) QC_SPLIT_CASE_(16)
        QC_SPLIT_CASE_(32)
#undef QC_SPLIT_CASE_
    }
}

/* The exact kernel, one block per (head, token), for a cache of KV. */
template <typename KV>
static void launch_exact(int G, dim3 grid, int threads, size_t smem, cudaStream_t st, const float *q,
                         const KV *k_cache, const KV *v_cache, const int32_t *pos, int n, int n_kv,
                         int n_head, int n_head_kv, int head_dim, float scale, float *out,
                         float *scores, float *probs) {
    switch (G) {
#define QC_CASE_(g)                                                                              \
    case g:                                                                                      \
        qc_attention_kernel<g, KV><<<grid, threads, smem, st>>>(                                 \
            q, k_cache, v_cache, pos, n, n_kv, n_head, n_head_kv, head_dim, scale, out, scores,  \
            probs);                                                                              \
        break;
        QC_CASE_(1) QC_CASE_(2) QC_CASE_(4) QC_CASE_(8) QC_CASE_(16) QC_CASE_(32)
#undef QC_CASE_
    }
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
    /* an F16 cache without captured scores: the tensor-core kernels (flash_attention.cu) */
    if (!scores && !probs && cache.type == QC_KV_F16 && qc_cuda_flash_head_dim(head_dim) &&
        (n > QC_GEMV_MAX_TOKENS || (cu->flash_decode && qc_kv_bucket(n_kv))))
        return qc_cuda_flash_attention(be, q, cache, pos, n, n_head, n_head_kv, head_dim, out);
    if (n > 65535) return qc_cuda_value_error(be, "attention: %d queries in one call (at most 65535)", n);
    /* G: the smallest power of two with G * QC_ATT_MAXD >= head_dim, at least head_dim / 4, so a
     * lane holds about four dimensions (64 -> 16 lanes per key, 128 -> 32) */
    int G = 1;
    while (G < 32 && (G * QC_ATT_MAXD < head_dim || 4 * G < head_dim)) G *= 2;
    const float scale = 1.0f / sqrtf((float)head_dim);
    const size_t part_floats = (size_t)n * (size_t)n_head * QC_ATT_SPLITS * (size_t)(head_dim + 2);
    if (!scores && !probs && n <= QC_GEMV_MAX_TOKENS && part_floats <= QC_ATT_PART_FLOATS &&
        (int64_t)n * n_head <= QC_ATT_PAIRS) {
        /* a decode step over an F32 cache (or an F16 one of a head_dim flash does not take):
         * split-K over the keys */
        const int groups = QC_ATT_SPLIT_THREADS / G;
        const size_t smem = (size_t)groups * (size_t)(2 + head_dim) * sizeof(float);
        const dim3 grid((unsigned)n_head, QC_ATT_SPLITS, (unsigned)n);
        if (cache.type == QC_KV_F16)
            launch_split<__half>(G, grid, smem, cu->stream, q, (const __half *)cache.k, (const __half *)cache.v,
                                 pos, n_head, n_head_kv, head_dim, scale, cu->attn_part, cu->attn_done, out);
        else
            launch_split<float>(G, grid, smem, cu->stream, q, (const float *)cache.k, (const float *)cache.v,
                                pos, n_head, n_head_kv, head_dim, scale, cu->attn_part, cu->attn_done, out);
        return QC_LAUNCHED(be, "qc_attention_split_kernel");
    }
    const int threads = n <= QC_GEMV_MAX_TOKENS ? QC_ATT_THREADS_SHORT : QC_ATT_THREADS_LONG;
    const int groups = threads / G;
    const size_t smem = (size_t)groups * (size_t)(2 + head_dim) * sizeof(float);
    const dim3 grid((unsigned)n_head, (unsigned)n);
    if (cache.type == QC_KV_F16)
        launch_exact<__half>(G, grid, threads, smem, cu->stream, q, (const __half *)cache.k,
                             (const __half *)cache.v, pos, n, n_kv, n_head, n_head_kv, head_dim, scale,
                             out, scores, probs);
    else
        launch_exact<float>(G, grid, threads, smem, cu->stream, q, (const float *)cache.k,
                            (const float *)cache.v, pos, n, n_kv, n_head, n_head_kv, head_dim, scale,
                            out, scores, probs);
    return QC_LAUNCHED(be, "qc_attention_kernel");
}
