/* qc_attention.cuh: the pieces of the fp32 attention kernels (attention.cu) that the persistent
 * decode kernel (decode_step.cu) runs too: a group of G lanes' online softmax over its keys, the
 * merge of the groups through shared memory, and a whole block of the split-K decode attention
 * with its cross-block merge. One code for both, so both give the same bits.
 *
 * Loads of q and of the split partials go through L2 (__ldcg): in the persistent kernel other
 * blocks wrote them earlier in the same launch, and a stale L1 line must never be read. */
#ifndef QC_ATTENTION_CUH
#define QC_ATTENTION_CUH

#include "qc_cuda.cuh"
#include "qc_gemv_q8.cuh"

#include <cooperative_groups.h>

#define QC_ATT_MAXD 8        /* dimensions per lane: head_dim <= 8 * 32 = 256 */

/* What one group of G lanes does in both kernels below: lane k holds dimensions k, k + G, ...
 * (at most QC_ATT_MAXD) of the query and of its share of the output. SHARED: qv is in shared
 * memory (qkv_attention.cu computes q in the block), read by plain loads. */
template <int G, bool SHARED = false>
__device__ __forceinline__ void qc_att_load_q(const float *qv, int head_dim, int lane,
                                              float (&qr)[QC_ATT_MAXD], float (&acc)[QC_ATT_MAXD]) {
#pragma unroll
    for (int i = 0; i < QC_ATT_MAXD; i++) {
        const int d = lane + i * G;
        if constexpr (SHARED) qr[i] = d < head_dim ? qv[d] : 0.0f;
        else qr[i] = d < head_dim ? __ldcg(qv + d) : 0.0f;
        acc[i] = 0.0f;
    }
}

/* This lane's dimensions of key j's K and V rows (k and v at that head in key 0's row). */
template <int G, typename KV>
__device__ __forceinline__ void qc_att_load_kv(const KV *k, const KV *v, int j, int kv_dim, int head_dim,
                                               int lane, KV (&kr)[QC_ATT_MAXD], KV (&vr)[QC_ATT_MAXD]) {
    const KV *kj = k + (int64_t)j * kv_dim, *vj = v + (int64_t)j * kv_dim;
#pragma unroll
    for (int i = 0; i < QC_ATT_MAXD; i++) {
        const int d = lane + i * G;
        if (d < head_dim) {
            kr[i] = kj[d];
            vr[i] = vj[d];
        }
    }
}

/* One key j of a group's online softmax: the score of q (qr) against K, then m, l and acc
 * updated with V; kd(i) and vd(i) give this lane's dimension lane + i * G of the key's K and V
 * rows as floats (straight from the cache, or from registers loaded ahead). When srow is not
 * NULL, lane 0 writes the scaled score (j < n_kv). */
template <int G, class KD, class VD>
__device__ __forceinline__ void qc_att_key(const float (&qr)[QC_ATT_MAXD], KD kd, VD vd, int j,
                                           int head_dim, float scale, unsigned gmask, int lane,
                                           float *srow, int n_kv, float &m, float &l,
                                           float (&acc)[QC_ATT_MAXD]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < QC_ATT_MAXD; i++) {
        const int d = lane + i * G;
        if (d < head_dim) s = fmaf(qr[i], kd(i), s);
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
        if (d < head_dim) acc[i] = fmaf(p, vd(i), acc[i] * corr);
    }
    m = m_new;
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
        const KV *kr = k + (int64_t)j * kv_dim + lane, *vr = v + (int64_t)j * kv_dim + lane;
        qc_att_key<G>(qr, [&](int i) { return qc_kv_get(kr + i * G); }, [&](int i) { return qc_kv_get(vr + i * G); },
                      j, head_dim, scale, gmask, lane, srow, n_kv, m, l, acc);
    }
}

/* The same loop with each next key's K and V loaded into registers before this key's
 * arithmetic, so that it is not a chain of load latencies (the split-K decode kernel of a 3B
 * layer took 11 us at 512 keys on the H100 without it); key `first`'s rows are already in
 * k_next, v_next, loaded by the caller (qc_att_split_partial issues them beside q's). The
 * arithmetic is qc_att_keys'; the kernels with fewer registers to spare (the exact one of 1024
 * threads, the persistent decode kernel) take qc_att_keys.
 * Measured and not kept: two keys in flight (a ring of two register slots, the same keys in the
 * same order). Past the keys held before the wait (QC_ATT_HELD: all of them up to 512 keys at
 * head_dim 64) a group walks its keys one L2 round trip each, and 2560 keys cost the real 0.5B
 * file's step 79 us more than 512, where their 1 MB of K and V a layer is 0.2 us of HBM time. Yet
 * two in flight (H200, real file, one lease, report 20261201-1546b11, addendum) gave, beside the
 * 16-block clusters, 2157.2-2167.0 tok/s at 512 keys against 2161.5-2183.2 with one and
 * 1876.7-1887.2 at 2560 against 1875.3-1882.5; beside clusters of 8, 2138.0-2147.9 against
 * 2154.2-2168.4 at 512 keys (962814b) and 1854.1-1858.7 against 1843.7-1852.9 at 2560.
 * Step stamps of 8619ff6 (report 20261201-8619ff6, addendum) put the walk at about 0.33 us a key:
 * qkv_attention's partials are done 7.8-8.0 us after its release at 2560 keys, 5.3 at 512. Also
 * measured and not kept there (three alternating rounds in one lease, against 8619ff6): a lane's
 * four dimensions contiguous (lane k holding 4k .. 4k + 3, not k, k + G, ...), so that a K or V
 * row came in one 8-byte load a lane instead of four of 2 bytes: 2159.8-2170.4 tok/s at 512 keys
 * against 2168.3-2179.0, 1828.6-1836.0 at 2560 against 1867.7-1871.1. Nor is it the arithmetic's
 * chain: a group's keys folded two at a time (373e9a9: both scores' dot products and shuffles
 * side by side, one max and three exps for the pair, a key left over carried to the next loop so
 * that every kernel still paired the same keys; the next two keys' rows loaded ahead) passed the
 * attention's equality tests (826) and gave 2224.3-2228.5 tok/s at 512 keys against
 * 2242.8-2245.7, 1913.9-1919.4 at 2560 against 1914.3-1917.5 (H200, real file, three alternating
 * rounds in one lease; the timeline's qkv_attention share at 2560 keys 254.8 -> 252.8 us a step;
 * report 20261202-2445fcd, addendum). */
template <int G, typename KV>
__device__ __forceinline__ void qc_att_keys_ahead(const float (&qr)[QC_ATT_MAXD], const KV *k, const KV *v,
                                                  int kv_dim, int head_dim, float scale, int first, int stride,
                                                  int last, unsigned gmask, int lane, float &m, float &l,
                                                  float (&acc)[QC_ATT_MAXD], KV (&k_next)[QC_ATT_MAXD],
                                                  KV (&v_next)[QC_ATT_MAXD]) {
    for (int j = first; j <= last; j += stride) {
        KV kr[QC_ATT_MAXD], vr[QC_ATT_MAXD];
#pragma unroll
        for (int i = 0; i < QC_ATT_MAXD; i++) {
            kr[i] = k_next[i];
            vr[i] = v_next[i];
        }
        /* unconditional (past `last`: key `last` again, unused): loaded under a branch, the
         * next key's rows were waited for where it joined, before this key's arithmetic */
        qc_att_load_kv<G, KV>(k, v, j + stride <= last ? j + stride : last, kv_dim, head_dim, lane, k_next, v_next);
        qc_att_key<G>(qr, [&](int i) { return qc_kv_float(kr[i]); }, [&](int i) { return qc_kv_float(vr[i]); },
                      j, head_dim, scale, gmask, lane, nullptr, 0, m, l, acc);
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

/* Lanes per key group, G: the smallest power of two with G * QC_ATT_MAXD >= head_dim, at least
 * head_dim / QC_ATT_LANE_DIMS, so a lane holds about QC_ATT_LANE_DIMS dimensions (4: 64 -> 16 lanes
 * a key, 128 -> 32). Every kernel of this file's attention takes this G, so all give the same bits.
 * Measured and not kept: eight dimensions a lane (8 lanes a key at head_dim 64: twice the groups,
 * half the keys a group, one key held: qkv_attention.cu's 16-block kernel kept its 102 registers),
 * to shorten the walk past the held keys at long contexts. H200, real file, three alternating
 * rounds in one lease (report 20261201-8619ff6, addendum): 2054.3-2057.1 tok/s at 512 keys against
 * 2169.8-2178.9, and 1808.6-1823.3 at 2560 against 1873.8-1879.7: slower at both. */
#define QC_ATT_LANE_DIMS 4
static constexpr int qc_att_group_lanes(int head_dim) {
    int G = 1;
    while (G < 32 && (G * QC_ATT_MAXD < head_dim || QC_ATT_LANE_DIMS * G < head_dim)) G *= 2;
    return G;
}

/* Whether an eval of n tokens takes the split-K kernel: short, and its partials and counters fit
 * the backend's buffers (made at creation, so a recorded step never allocates). */
static inline int qc_att_split_fits(int n, int n_head, int head_dim) {
    const size_t part_floats = (size_t)n * (size_t)n_head * QC_ATT_SPLITS * (size_t)(head_dim + 2);
    return n <= QC_GEMV_MAX_TOKENS && part_floats <= QC_ATT_PART_FLOATS && (int64_t)n * n_head <= QC_ATT_PAIRS;
}

/* out = sum over splits of acc e^(m - M) / sum of l e^(m - M) (split 0 always holds key 0), and
 * its 8-bit blocks (qc_gemv_q8.cuh) into o_qs, o_ds when o_qs is not NULL. part(s, i) is value i
 * of split s's partial (m, l, acc[head_dim]): in global memory, written by other blocks and read
 * through L2 (__ldcg, never a stale L1 line), or in the shared memory of a cluster's blocks. One
 * warp turns the splits' (m, l) into weights e^(m - M) / L (lane s, split s), then every thread
 * sums its dimensions over the splits with those weights: the same operations wherever the
 * partials are, so both split kernels give the same bits. */
template <class Part>
__device__ __forceinline__ void qc_att_merge_splits(Part part, int splits, int head_dim, float *o,
                                                    float *weight, int8_t *o_qs, float2 *o_ds) {
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        /* both loads unconditional (split 0 again past `splits`, unused), so that neither is
         * waited for where a branch joins before the other goes out */
        const int sl = s < splits ? s : 0;
        const float m_s = part(sl, 0), l_s = part(sl, 1);
        const float ms = s < splits ? m_s : -INFINITY;
        const float ls = s < splits ? l_s : 0.0f;
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
    for (int d0 = 0; d0 < head_dim; d0 += blockDim.x) {
        const int d = d0 + threadIdx.x;
        float v = 0.0f;
        if (d < head_dim) {
            for (int s = 0; s < splits; s++) v = fmaf(part(s, 2 + d), weight[s], v);
            o[d] = v;
        }
        /* whole warps (32 divides head_dim): each quantizes its block of 32 from registers */
        if (o_qs && d0 + (int)(threadIdx.x & ~31u) < head_dim)
            qc_q8_quantize_block(v, (int)(threadIdx.x & 31u), o_qs + (d & ~31), o_ds + (d >> 5));
    }
}

/* The share of thread tid's group (tid < QC_ATT_SPLIT_THREADS, the threads of one split) in split
 * `split` of a split-K decode attention over head h: its KV head, and its keys first,
 * first + stride, ... (qc_att_split_partial reads them, qc_att_prefetch_keys asks L2 for them). */
struct qc_att_share {
    int kvh, first, stride;
};
template <int G>
__device__ __forceinline__ qc_att_share qc_att_share_of(int h, int split, int splits, int n_head, int n_head_kv,
                                                        int tid) {
    const int groups = QC_ATT_SPLIT_THREADS / G;
    return {h / (n_head / n_head_kv), split * groups + tid / G, splits * groups};
}

/* Ask L2 for the K and V rows of the keys up to last_key that qc_att_split_partial's thread group
 * will read (the same arguments), before qc_grid_start. A hint only: L2 is where every write
 * lands, so a row the kernel before writes (the new key) is still read as written. */
template <int G, typename KV>
__device__ __forceinline__ void qc_att_prefetch_keys(const KV *k_cache, const KV *v_cache, int last_key, int h,
                                                     int split, int splits, int n_head, int n_head_kv,
                                                     int head_dim, int tid, int skip = 0) {
    const qc_att_share sh = qc_att_share_of<G>(h, split, splits, n_head, n_head_kv, tid);
    const int64_t kv_dim = (int64_t)n_head_kv * head_dim;
    const int row_bytes = head_dim * (int)sizeof(KV), lane = tid % G;
    /* (skip: the first keys, which the caller loads itself, or the eval wrote: then in L2) */
    for (int j = sh.first + skip * sh.stride; j <= last_key; j += sh.stride)
        for (int b = 128 * lane; b < row_bytes; b += 128 * G) {
            qc_prefetch_line_l2((const char *)(k_cache + j * kv_dim + (int64_t)sh.kvh * head_dim) + b);
            qc_prefetch_line_l2((const char *)(v_cache + j * kv_dim + (int64_t)sh.kvh * head_dim) + b);
        }
}

/* A group's first R keys of a split (qc_att_share's first, first + stride, ...) that are below
 * `end`, their K and V rows (this lane's dimensions) loaded into registers before qc_grid_start
 * by qc_att_held_load: keys that no kernel of the eval writes (below every position it computes;
 * attention.cu's cluster kernel says why it may read them then). R = 0: none. */
template <typename KV, int R>
struct qc_att_held {
    KV k[R > 0 ? R : 1][QC_ATT_MAXD], v[R > 0 ? R : 1][QC_ATT_MAXD];
    int end = 0;
};
template <int G, typename KV, int R>
__device__ __forceinline__ void qc_att_held_load(qc_att_held<KV, R> &held, const KV *k_cache, const KV *v_cache,
                                                 int end, int h, int split, int splits, int n_head, int n_head_kv,
                                                 int head_dim, int tid) {
    const qc_att_share sh = qc_att_share_of<G>(h, split, splits, n_head, n_head_kv, tid);
    const int kv_dim = n_head_kv * head_dim;
    held.end = end;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int j = sh.first + r * sh.stride;
        if (j < end)
            qc_att_load_kv<G, KV>(k_cache + (int64_t)sh.kvh * head_dim, v_cache + (int64_t)sh.kvh * head_dim, j, kv_dim,
                                  head_dim, tid % G, held.k[r], held.v[r]);
    }
}

/* Split `split` of (head h, token t) of a split-K decode attention, by QC_ATT_SPLIT_THREADS
 * threads of the block (tid their index among them): its groups' keys split * groups + group,
 * then every splits * groups keys up to last_key, merged into one unnormalised partial
 * (m, l, acc[head_dim]) in mine (global or shared memory). pub: groups * (2 + head_dim) floats
 * of shared memory for this split's groups. Every thread of the block calls it (it synchronises
 * the block). AHEAD: qc_att_keys_ahead, else qc_att_keys. held (R > 0): the group's first keys
 * from registers (qc_att_held_load), the rest from the cache; the same keys in the same order, the
 * same bits.
 * NEW (one token, qkv_attention.cu): q is the head's query in shared memory, and key last_key,
 * which this launch computes and another cluster writes into the cache, comes from new_k and
 * new_v (this KV head's rows in shared memory, as the cache holds them: NKV, or floats of the
 * cache's rounding) instead: it is the last key of the group that takes it, so it is still taken
 * last, with the same arithmetic. */
template <int G, typename KV, bool AHEAD, int R = 0, bool NEW = false, typename NKV = KV>
__device__ __forceinline__ void qc_att_split_partial(const float *q, const KV *k_cache, const KV *v_cache,
                                                     int last_key, int h, int split, int splits, int t,
                                                     int n_head, int n_head_kv, int head_dim, float scale,
                                                     float *mine, float *pub, int tid,
                                                     const qc_att_held<KV, R> *held = nullptr,
                                                     const NKV *new_k = nullptr, const NKV *new_v = nullptr) {
    const qc_att_share sh = qc_att_share_of<G>(h, split, splits, n_head, n_head_kv, tid);
    const int kv_dim = n_head_kv * head_dim;
    const int lane = tid % G, group = tid / G, groups = QC_ATT_SPLIT_THREADS / G;
    const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << ((threadIdx.x & 31) & ~(G - 1));
    const int new_key = last_key;
    if constexpr (NEW) last_key--;   /* from here on: the last key read from the cache */

    const KV *k = k_cache + (int64_t)sh.kvh * head_dim, *v = v_cache + (int64_t)sh.kvh * head_dim;
    /* the held keys are the group's first ones below held->end; the rest start at `rest` */
    int n_held = 0;
#pragma unroll
    for (int r = 0; r < R; r++) n_held += sh.first + r * sh.stride < held->end;
    const int rest = sh.first + n_held * sh.stride;
    float qr[QC_ATT_MAXD], acc[QC_ATT_MAXD];
    if constexpr (NEW) qc_att_load_q<G, true>(q, head_dim, lane, qr, acc);
    else qc_att_load_q<G>(q + ((int64_t)t * n_head + h) * head_dim, head_dim, lane, qr, acc);
    /* AHEAD: the first key after the held ones is loaded beside q, not after the held keys'
     * arithmetic has waited for q: one L2 round trip instead of two before the loop (at 513 to
     * 768 keys every head has groups with a third key, and the new key is one). Unconditional
     * (past last_key: key last_key, unused), as in qc_att_keys_ahead. H100, real file, one
     * lease: 1794-1810 -> 1805-1819 tok/s at 512 keys, even at 2560 (1577-1591 -> 1580-1589);
     * 57 registers a thread instead of 49 (bench/results/20261124-e49438a-*, addendum). */
    KV k_next[QC_ATT_MAXD], v_next[QC_ATT_MAXD];
    if constexpr (AHEAD) {
        /* (NEW at key 0: no key in the cache, nothing to load) */
        if (!NEW || last_key >= 0)
            qc_att_load_kv<G, KV>(k, v, rest <= last_key ? rest : last_key, kv_dim, head_dim, lane, k_next, v_next);
    }
    float m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r < n_held)
            qc_att_key<G>(qr, [&](int i) { return qc_kv_float(held->k[r][i]); },
                          [&](int i) { return qc_kv_float(held->v[r][i]); }, sh.first + r * sh.stride, head_dim,
                          scale, gmask, lane, nullptr, 0, m, l, acc);
    }
    if constexpr (AHEAD)
        qc_att_keys_ahead<G, KV>(qr, k, v, kv_dim, head_dim, scale, rest, sh.stride, last_key, gmask, lane, m, l, acc,
                                 k_next, v_next);
    else
        qc_att_keys<G, KV>(qr, k, v, kv_dim, head_dim, scale, rest, sh.stride, last_key, gmask, lane, nullptr, 0, m, l,
                           acc);
    if constexpr (NEW) {
        if (new_key >= sh.first && (new_key - sh.first) % sh.stride == 0)
            qc_att_key<G>(qr, [&](int i) { return qc_kv_float(new_k[lane + i * G]); },
                          [&](int i) { return qc_kv_float(new_v[lane + i * G]); }, new_key, head_dim, scale, gmask,
                          lane, nullptr, 0, m, l, acc);
    }

    /* a split with no keys (short contexts) leaves m = -inf, l = 0: the merge skips it */
    const float M = qc_att_publish<G>(pub, group, groups, lane, head_dim, m, l, acc);
    if (tid == 0) {
        mine[0] = M;
        mine[1] = qc_att_merged(pub, groups, head_dim, M, -1);
    }
    for (int d = tid; d < head_dim; d += QC_ATT_SPLIT_THREADS) mine[2 + d] = qc_att_merged(pub, groups, head_dim, M, d);
}

/* Block `split` of (head h, token t) of a split-K decode attention, a block of
 * QC_ATT_SPLIT_THREADS threads: its split's partial (qc_att_split_partial) into part. The block
 * that counts last for the pair (done[pair], back to 0 after it) merges the splits' partials into
 * out (and its 8-bit blocks into out_qs, out_ds when out_qs is not NULL). smem: groups *
 * (2 + head_dim) floats; weight: 32 floats; last_block: one int, all in shared memory.
 * attention.cu's split kernel is one call of it where thread-block clusters are not available
 * (its cluster kernel merges in shared memory instead); the persistent decode kernel
 * (decode_step.cu) calls it for each (head, split) its block takes. */
template <int G, typename KV, bool AHEAD = false>
__device__ __forceinline__ void qc_att_split_block(const float *q, const KV *k_cache, const KV *v_cache,
                                                   int last_key, int h, int split, int splits, int t,
                                                   int n_head, int n_head_kv, int head_dim, float scale,
                                                   float *part, unsigned int *done, float *out,
                                                   int8_t *out_qs, float2 *out_ds, float *smem,
                                                   float *weight, int *last_block) {
    const int64_t pair = (int64_t)t * n_head + h;
    float *mine = part + (pair * splits + split) * (head_dim + 2);
    qc_att_split_partial<G, KV, AHEAD>(q, k_cache, v_cache, last_key, h, split, splits, t, n_head, n_head_kv,
                                       head_dim, scale, mine, smem, (int)threadIdx.x);

    /* publish the partial, then count it; the block that counts last merges them all */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        *last_block = atomicAdd(&done[pair], 1u) == (unsigned)splits - 1;
        if (*last_block) done[pair] = 0;   /* ready for the next launch (all splits counted) */
    }
    __syncthreads();
    if (!*last_block) return;
    __threadfence();
    const float *mine0 = part + pair * splits * (head_dim + 2);
    qc_att_merge_splits([&](int s, int i) { return __ldcg(mine0 + s * (head_dim + 2) + i); }, splits, head_dim,
                        out + pair * head_dim, weight, out_qs ? out_qs + pair * head_dim : nullptr,
                        out_ds ? out_ds + pair * head_dim / 32 : nullptr);
}

/* ---- split-K in thread-block clusters (sm_90): attention.cu's cluster kernel, and the
 * attention of qkv_attention.cu ----
 * The splits merged without a round trip through global memory: the QC_ATT_SPLITS splits of a
 * (head, token) are the QC_ATT_CLUSTER blocks of one cluster, QC_ATT_CLUSTER_SPLITS splits a
 * block (QC_ATT_SPLIT_THREADS threads each, computing exactly what the split kernel's blocks do). Each block copies its splits' partials into block
 * 0's shared memory (distributed shared memory), arrives at the cluster barrier and leaves;
 * block 0 waits there for all of them and merges the partials from its own shared memory with
 * qc_att_merge_splits.
 * Why: the split kernel's merge is a chain of L2 round trips (the partial's write and fence,
 * the counter's atomic, the partials' reads) after the keys; a decode step runs it once a
 * layer. An earlier form left each partial in its own block, so block 0 read 32 splits' values
 * across the cluster and every block waited at a second barrier until it had: %globaltimer
 * stamps of a 0.5B step on the H100 put 1.3 us on that merge and 0.6 us on the second barrier
 * (bench/results/20261124-d82da0b-*); this form took the attention's share of a real-file step
 * from 133.5 to 116.9 us (20261124-550e506-*, addendum). Same bits as the split kernel (the
 * persistent decode kernel's): the same partials, merged in the same order.
 * Measured and not kept (H200, real file, bench/results/20261201-e14199c-*, addendum): 16 splits
 * in clusters of 8 blocks of 2 splits, blocks of 256 threads (123 registers) that an SM could
 * take beside more of the down projection's blocks than the 512-thread blocks (98 registers, 53K
 * of its 64K): decode 2017.1-2029.3 tok/s at 512 keys against 2155.6-2161.0, 1579.2-1579.9 at
 * 2560 against 1836.7-1846.5. qkv_attention.cu's launch also takes clusters of 16 blocks of 2 splits
 * (qc_qa_shape: the same 32 splits) where the GPU schedules that non-portable size. */
#define QC_ATT_CLUSTER_SPLITS 4
#define QC_ATT_CLUSTER (QC_ATT_SPLITS / QC_ATT_CLUSTER_SPLITS)   /* 8: the portable most */
static_assert(QC_ATT_SPLITS % QC_ATT_CLUSTER_SPLITS == 0 && QC_ATT_CLUSTER <= 8, "a portable cluster");

/* Floats of the cluster kernel's dynamic shared memory: per split of the block (CS of them), its
 * groups' publish area (qc_att_split_partial's pub), then a partial for every split of the
 * cluster (block b's own at splits CS b .. CS b + CS - 1; block 0 receives them all). */
static inline size_t qc_att_cluster_floats(int G, int head_dim, int CS = QC_ATT_CLUSTER_SPLITS) {
    return (size_t)CS * (size_t)(QC_ATT_SPLIT_THREADS / G) * (2 + head_dim) + (size_t)QC_ATT_SPLITS * (head_dim + 2);
}

/* Keys held in registers before the wait: the K and V rows of the keys before the eval's
 * positions were written by earlier evals, not by any kernel of this one (only its new keys' rows
 * are: the q/k/v kernel just before, or qkv_attention.cu's launch itself), and every kernel before
 * the one before has finished when a kernel launches (qc_grid_start lets the next launch only
 * after its own wait). So each group loads the rows of its first QC_ATT_HELD keys while the kernel
 * before still runs, and after the wait its loop starts with them instead of with a round trip to
 * L2: eight dimensions of K and V a lane (the registers measured below), so two keys at four
 * dimensions a lane (QC_ATT_LANE_DIMS), one at eight; at head_dim 64 two keys of every 256 (32
 * splits of 8 groups), so all of them up to 512 keys. H100, real 0.5B file, one lease
 * (bench/results/20261124-48cb5a4-*, addendum): 2 keys took decode from 1736-1755 to 1763-1769
 * tok/s at 512 keys and 1547-1558 to 1552-1562 at 2560; 4 keys +0.5% at both; 8 keys (93 registers a
 * thread) -3.5%; a copy of the keys into 96 KB of shared memory 1669-1686 tok/s at 512 keys,
 * against 1750 before it in the session's other leases (the blocks placed later). Beside
 * qkv_attention.cu's 16-block clusters (H200, the synthetic 0.5B Q4_K_M, six alternating runs in
 * one lease, report 20261201-1546b11, addendum): 4 keys (123 registers a thread, no spill)
 * 2147.2-2163.0 tok/s at 512 keys against 2167.0-2182.4 with 2, 1874.4-1886.5 at 2560 against
 * 1877.6-1887.2. QWENCUDA_ATTENTION_HOLD=0 holds none, to compare: the same bits. */
#define QC_ATT_HELD (8 / QC_ATT_LANE_DIMS)
static_assert(QC_ATT_HELD >= 1, "a key held at least");

/* Whether the cluster kernels take this head_dim (the two of Qwen2, with their G). */
static inline int qc_att_cluster_takes(int G, int head_dim) {
    return (head_dim == 64 || head_dim == 128) && G == qc_att_group_lanes(head_dim);
}

/* A cluster block's partials in parts: its CS splits' (m, l, acc[HD]), splits CS rank ..
 * CS rank + CS - 1, where qc_att_split_partial left them. */
template <int HD, int CS>
__host__ __device__ constexpr int qc_att_block_parts_floats() {
    return CS * (HD + 2);
}

/* Block 0's merge of every split in its parts into out (and its 8-bit blocks, qc_att_merge_splits)
 * for (token, head) `pair`; weight: 32 floats of shared memory. */
template <int HD>
__device__ __forceinline__ void qc_att_cluster_merge_parts(const float *parts, int64_t pair, float *out,
                                                           int8_t *out_qs, float2 *out_ds, float *weight) {
    qc_att_merge_splits([&](int s, int i) { return parts[s * (HD + 2) + i]; }, QC_ATT_SPLITS, HD, out + pair * HD,
                        weight, out_qs ? out_qs + pair * HD : nullptr, out_ds ? out_ds + pair * HD / 32 : nullptr);
}

/* The end of a cluster's attention, after every block's partials are complete in its own shared
 * memory (parts, split by split) and the cluster's blocks have all started (the caller waited at
 * a cluster barrier since): blocks 1.. copy theirs into block 0's parts and leave; block 0 merges
 * them (qc_att_cluster_merge_parts). Every thread of the block calls it. CS: splits a block.
 * (qkv_attention.cu's qc_qa_cluster_merge brings them by st.async stores instead.) */
template <int HD, int CS = QC_ATT_CLUSTER_SPLITS>
__device__ __forceinline__ void qc_att_cluster_merge(float *parts, unsigned rank, int64_t pair, float *out,
                                                     int8_t *out_qs, float2 *out_ds, float *weight) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int mine_floats = qc_att_block_parts_floats<HD, CS>();
    if (rank != 0) {
        float *mine = parts + rank * mine_floats;
        float *to = cooperative_groups::this_cluster().map_shared_rank(mine, 0);
        for (int i = threadIdx.x; i < mine_floats; i += blockDim.x) to[i] = mine[i];
    }
    /* the partials written and visible to block 0 (release, acquire); nothing reads the other
     * blocks' shared memory, so they leave */
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    if (rank != 0) return;
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    qc_att_cluster_merge_parts<HD>(parts, pair, out, out_qs, out_ds, weight);
#endif
}

#endif /* QC_ATTENTION_CUH */
