/* qkv_attention.cu: the qkv_attention op (backend.h): matmul_qkv_rope, then attention. A decode
 * step (one token, 8-bit GEMV weights, the cluster attention's head_dim and context) runs both in
 * one launch of thread-block clusters: the attention norm, the q, k and v rows, RoPE, the cache
 * write and the split-K attention with its 8-bit output for the o projection.
 *
 * Why: a layer of the op-by-op step ran the norm, the q/k/v GEMV and the attention as three
 * kernels, each ending in a grid-wide wait before the next could read what it wrote (2.1, 3.0
 * and 4.5 us a layer of a real-file 0.5B step on the H100: bench/results/20261124-dc7e3b6-*,
 * addendum). The attention of head h needs only its own q rows and the k and v rows of its KV
 * head: a cluster can compute them itself and pass them through shared memory.
 *
 * How: the cluster attention's grid (attention.cu; qc_attention.cuh, "split-K in thread-block
 * clusters"): a cluster of C blocks per query head h (8, or 16 where the GPU takes them:
 * qc_qa_shape), QC_ATT_SPLITS / C splits a block.
 *   1. Before the wait: the held keys (below the position: earlier evals wrote them), this
 *      warp's weight rows asked of L2 (unless the matmul before, the down projection, asked for
 *      all of q, k and v: read_ahead, session.c), its biases, and in the step's first launch its
 *      RoPE angles.
 *   2. Every block normalises x and quantizes it to 8 bits in its shared memory
 *      (qc_norm_quantize_q8_kernel's bits: rmsnorm's 256 sums, reduced in the same order).
 *   3. The cluster's warps compute the 3 * head_dim rows head h needs, a pair of rows (i and
 *      i + head_dim / 2 of q, k or v) a warp, the q and k pairs rotated (matmul_qkv_rope's dot
 *      products, bias, angle and rotation: the same bits), and store them into every block of
 *      the cluster (distributed shared memory), k and v rounded as the cache holds them. The
 *      n_head / n_head_kv clusters of a KV head each compute its k and v (a few rows more from
 *      L2); the first writes them to the cache and to k and v. Every cluster writes its q.
 *   4. The cluster attention's splits, held keys and merge (qc_att_split_partial, NEW: the new
 *      key from shared memory, still last in its group's order; qc_qa_cluster_merge): the same
 *      bits as the attention op after matmul_qkv_rope.
 * A cluster barrier orders the start (every block runs and has set up its mbarriers before any
 * block stores into it), and two mbarriers the rest: the rows and the partials go to the blocks
 * that read them by st.async stores, which the receiver's mbarrier counts (rows_in: every block's
 * q, k and v; parts_in: block 0's partials), so a receiver waits only for its bytes. Why: ncu's
 * warp-state samples of this launch (H200, real file, 512 keys; report 20261202-8d68ef1-*,
 * addendum) put 15% in membar stalls, at the two cluster barriers with release semantics that
 * ordered the rows and the partials before (each block's remote stores acknowledged before its
 * arrival), and 22% in barrier stalls. Measured there (three alternating rounds against the
 * barriers): 2168.0-2177.3 -> 2222.9-2231.9 tok/s at 512 keys, 1868.3-1875.4 -> 1904.8-1910.1
 * at 2560; the loop's step period 462.3 -> 448.6 us (two leases' gpu_check benches).
 *
 * RoPE's angles: a pair's (cos, sin) in double (qc_rope_angle: a pow and a sincos) took lane 0
 * of a warp about 2 us before its wait; %globaltimer stamps of every block (real file, H100,
 * 512 keys) put the blocks that compute angles 2.0 us behind the others, and every cluster
 * barrier waited for them. They depend on the position only, so the step's first launch
 * computes them (cluster 0's q pairs store them in qc_cuda's rope_cs) and the later layers'
 * launches read them after their wait (qc_cuda's rope_of_pos says whether rope_cs holds this
 * position's; uploads, copies, feed_draw and recordings end it).
 *
 * Measured (H100, real file; bench/results/20261125-f0bdc45-*, addendum), per layer: the first build
 * 10.7 us (the step 1807-1818 tok/s at 512 keys against 1897-1901 for the three kernels); the
 * angles read, not computed: 8.6 us, even with them; the rows' global stores after the second
 * barrier's arrival, not before it (its release waited for them): 1.2 -> 1.0 us between the
 * dot products and the attention, and the step 1924-1925 / 1688-1691 tok/s at 512 / 2560 keys
 * against 1900-1915 / 1657-1670. Slower, not kept: every warp computing the norm's sum itself
 * (no block barrier; 1.7 -> 2.2 us), the weight rows copied into shared memory before the wait
 * (the dot products 1.1 -> 0.8 us, but the copies held the blocks 1.1 us longer before their
 * wait: -4%), 64 registers a thread for two blocks an SM (spills: -16%); three held keys
 * instead of two were even.
 * Later (H100, bench/results/20261125-ab5536d-*, addendum; a stand-in for the real file with its
 * layout and types and random blocks): the blocks placed last, once the down projection's
 * blocks leave their SMs, spent 1.6 us from their entry to their wait, so the release of a
 * launch spread over 1.0-1.3 us and every cluster barrier waited for the last; with the next
 * layer's q, k and v read ahead by the down projection and no row prefetches of their own,
 * 1.3 us, and decode 1927-1938 -> 1955-1965 tok/s at 512 keys, 1688-1699 -> 1702-1719 at 2560.
 * Measured and not kept: the rows copied into shared memory by cp.async before the wait (no
 * load waited for; even), the kernel parameters asked for by four warps at once, a line each
 * (no change in the time to the wait).
 * Later (H200, real file; report 20261202-8d68ef1-*, addendum): the held keys loaded and the keys
 * asked of L2 after the norm, not before the wait, where their addresses wait for the position's
 * load (an L2 or HBM round trip: the step's weights stream through L2 after feed_draw wrote it).
 * The last blocks then reached the wait 0.45 us after the launch's first release, not 0.77, but
 * the rows were exchanged 0.45 us later after it (4.1 us, not 3.6) and the launch's share of a
 * stamped step rose 7.84 -> 8.29 us; decode (with the weight copies' edge bytes of qc_cuda.cuh,
 * also not kept) 2103.3-2111.1 tok/s at 512 keys and 1807.0-1815.1 at 2560, against
 * 2143.1-2151.8 and 1856.4-1863.0 without this change.
 *
 * Measured and not kept (H200, real file, one lease; report 20261202-df1b913-*, addendum): the o
 * projection folded into this launch, to take its kernel and one grid-wide wait out of each layer.
 * Block 0 of a cluster stored its head's 8-bit output into the other blocks (st.async), each block
 * computed dim / C rows of the head's share of att @ Wo^T from its rows of wo (copied into shared
 * memory before the wait) and added them into 64-bit fixed-point sums (round(v * 2^32): integer
 * atomics, the same bits at every run), and the gate/up kernel's blocks added the sums to x and
 * normalised it themselves. Correct (logits within 1e-5 of the exact unfused step, but where an
 * 8-bit quant rounds the other way, as with norm_next), and slower: 2165.5, 2164.1, 2159.7 tok/s at
 * 512 keys and 1887.8, 1890.5, 1881.4 at 2560 against 2302.1, 2294.5, 2292.9 and 1958.1, 1959.4,
 * 1960.2 without it (three alternating rounds); with the gate/up rows read from L2, not copied
 * (QWENCUDA_WEIGHTS_SHARED=0) 2079-2085, clusters of 8 2113-2120, without the gate/up read-ahead
 * 2107-2114. Step stamps (a stamped build, the synthetic 0.5B Q4_K_M, in one lease; per layer,
 * medians of 8 steps) say where it went: the step 455.6 -> 474.8 us; this launch's share 7.26 ->
 * 8.96 us (its blocks' body 5.0 -> 6.4 us, 1.4 us of it the merge, the stores and the o rows
 * after the partials; its last block reached its wait 0.8 us later, after the copies of wo and
 * the read-ahead it issued before the wait); the gate/up kernel's 4.29 -> 5.18 us, the down
 * projection's 2.98 -> 3.50, against the o projection's 2.50 saved.
 * The gate/up blocks were placed only as this launch's blocks left (the last one 0.0-0.4 us
 * after its last end; without the fold, about 1.7 us before its own release, during the o
 * projection), so their weight copies finished 1.0-1.4 us after their release, not 0.06: the o
 * projection's 28 small blocks had been what let the gate/up kernel's 152 load their 6 MB of
 * rows before their wait, and this launch's blocks, which fill an SM's registers two at a time,
 * leave them no room until they end.
 *
 * Elsewhere (several tokens, other weight types, flash decode's long contexts, no clusters,
 * QWENCUDA_QKV_ATTENTION=0 at creation) the op is matmul_qkv_rope, then attention.
 */
#include "qc_attention.cuh"
#include "qc_rope.cuh"
#include "qc_slices.cuh"

#include <cuda/ptx>

#include <stdlib.h>
#include <string.h>

/* A launch's clusters of C blocks, QC_ATT_SPLITS / C splits a block: C = QC_ATT_CLUSTER (8, the
 * portable most, 512 threads a block) or 16 (a non-portable cluster size, 256 threads a block),
 * chosen at the backend's creation (qc_cuda_qkv_attention_init). Either way a cluster has
 * QC_ATT_SPLITS splits and QC_QA_CLUSTER_WARPS warps, so a warp computes the same rows.
 * Why 16: a block of 512 threads at 98 registers needs 50K of an SM's 64K, so a cluster of eight
 * is placed only where eight SMs of a GPC have nearly emptied of the down projection's blocks
 * (report 20261201-e14199c, addendum: the last blocks reach their wait 0.86 us after the first
 * release, and each cluster waits for its last). Half the block fits beside more of them.
 * Measured (H200, real file, three alternating rounds in one lease; report 20261201-1546b11,
 * addendum): QWENCUDA_ATT_CLUSTER=8 against the choice (16 there) 2142.9-2151.3 -> 2174.8-2180.1
 * tok/s at 512 keys, 1840.9-1843.4 -> 1866.5-1877.0 at 2560; 962814b, before it, 2148.5-2166.1 and
 * 1837.9-1846.8. (At 2bcb4b0, as a compile-time 16: 2074.6-2090.8 -> 2087.7-2103.5 and
 * 1791.2-1796.5 -> 1808.7-1816.8; report 20261201-3112744, addendum.) */
#define QC_QA_CLUSTER_WARPS (QC_ATT_SPLITS * QC_ATT_SPLIT_THREADS / 32)
#define QC_QA_CLUSTER_WIDE 16
template <int C>
struct qc_qa_shape {
    static constexpr int splits = QC_ATT_SPLITS / C;   /* a block's */
    static constexpr int threads = QC_ATT_SPLIT_THREADS * splits;
    static constexpr int warps = threads / 32;
    /* an SM's blocks for __launch_bounds__: two of 256 threads (at most 128 registers); none asked
     * for the 512-thread blocks (one an SM either way: the registers ptxas gave them before).
     * Measured and not kept (H200, synthetic 0.5B Q4_K_M, three alternating rounds; report
     * 20261202-b2a36d6, addendum): four (64 registers, 188 bytes spilled), so that a block fits
     * beside three of the down projection's and is placed before they leave: 2005.0, 2014.9,
     * 2003.9 tok/s at 512 keys against 2279.0, 2295.5, 2283.6 (-12%). */
    static constexpr int min_blocks = C == QC_ATT_CLUSTER ? 0 : 2;
    static_assert(QC_ATT_SPLITS % C == 0 && C * warps == QC_QA_CLUSTER_WARPS, "a cluster's splits and warps");
    static_assert(threads >= QC_NORM_ROW_THREADS, "rmsnorm's sums: a thread each");
};

/* q, k or v: its stored rows, bias (or NULL) and output (one token). */
struct qc_qa_w {
    const uint8_t *W;
    const float *bias;
    float *out;
    int64_t row_bytes;
    uint32_t type;
};

struct qc_qa_params {
    qc_qa_w w[3];                     /* q, k, v */
    const float *x, *norm_w;          /* norm_w NULL: x is normalised already */
    const long long *x_sum;           /* NULL, or the fixed-point sums to add to x (swiglu_down) */
    float *x_out;                     /* with x_sum: x plus them, written by block (0, 0) */
    float eps, scale;
    int dim, n_head, n_head_kv, hold;
    double theta;
    double2 *rope_cs;                 /* RoPE's (cos, sin) of each pair at pos (qc_cuda's rope_cs) */
    int rope_read;                    /* 1: read them there; 0: compute them (cluster 0 writes them) */
    int rows_prefetch;                /* 0: the matmul before asked L2 for q, k and v (read_ahead) */
    const int32_t *pos;
    void *k_cache, *v_cache;
    float *out;                       /* (n_head * head_dim) */
    int8_t *out_qs;                   /* its 8-bit form (qc_gemv_q8.cuh) */
    float2 *out_ds;
};

/* Shared memory: q of the head (head_dim floats), the new k and v (head_dim KV each, room for
 * floats), then one region for x (steps 2 and 3: its 8-bit qs and ds) that the
 * attention (step 4) reuses for its groups' publish areas and the cluster's partials (C blocks a
 * cluster). */
static size_t qa_smem_bytes(int G, int head_dim, int64_t dim, int C) {
    const size_t x_bytes = qc_q8x_qs_bytes(1, dim) + (size_t)(dim / 32) * sizeof(float2);
    const size_t att_bytes = qc_att_cluster_floats(G, head_dim, QC_ATT_SPLITS / C) * sizeof(float);
    return 3 * (size_t)head_dim * sizeof(float) + (x_bytes > att_bytes ? x_bytes : att_bytes);
}

/* Ask L2 for the lines of a weight row, by the 32 lanes of a warp. */
__device__ __forceinline__ void qc_qa_prefetch_row(const uint8_t *row, int64_t bytes, int lane) {
    const char *end = (const char *)row + bytes;
    for (const char *c = (const char *)((uintptr_t)row & ~(uintptr_t)127) + 128 * lane; c < end; c += 128 * 32)
        qc_prefetch_line_l2(c);
}

/* x normalised and quantized into this block's shared memory (qs, ds: the 8-bit form): with
 * norm_w, qc_norm_quantize_q8_kernel's values (rmsnorm's numbers, qc_cuda.cuh: the same scale;
 * x times scale times the weight quantized as qc_q8_quantize_block does, eight lanes a block of
 * 32 by qc_q8_quantize_block4); without, qc_quantize_q8_kernel's. w: this lane's four norm
 * weights of the first pass (4 * W blocks of 32, W the block's warps; qc_qa_norm_w4 of
 * qc_qa_norm_block(warp, lane, 0)), loaded before the wait; a later pass (dim > 128 W) loads its
 * own. Ends with the block synchronised.
 * x is not staged in shared memory: every thread loads from L2 the values it sums and the four
 * it quantizes, all at once, and adds the eight warps' sums itself, so two block barriers order
 * it where a copy of x, its sums, one thread's total and the quantization took four. Measured
 * (H100, same lease, the stand-in above): x quantized 1.66 -> 1.44 us after the release, decode
 * 1896-1917 -> 1932-1940 tok/s at 512 keys, 1680-1688 -> 1699-1704 at 2560.
 * The sums' loop below is nvcc's `unroll 4` of a loop of a load and its fma, whose remainder stays
 * rolled: at dim 896 threads 128..255 (three values each) wait three L2 round trips one after
 * another (its SASS at c546881). Measured and not kept (6f9961a: each thread's values loaded in
 * one batch of eight, then its fmas, the same bits): 2257.4, 2255.9, 2257.4 tok/s at 512 keys
 * against 2252.4, 2250.5, 2240.9 in one lease, 2249.0, 2222.3, 2252.7 against 2262.9, 2256.0,
 * 2256.5 in another (H200, real file; report 20261202-2445fcd, addendum): so those round trips
 * are not what the launch waits for (read off these figures; not stamped).
 * Measured and not kept (H200, real file, report 20261202-791811a, addendum): the norm's scale
 * after the dot products (x * w quantized while the sums run, one block barrier instead of two,
 * the scale multiplying the q, k, v sums; matmul_multi.cu's path changed alike, so the two ops
 * kept this launch's bits): 2239.8, 2233.7, 2236.4 tok/s at 512 keys and 1912.7, 1909.1, 1908.4
 * at 2560 against 2232.4, 2239.1, 2242.4 and 1909.1, 1912.1, 1905.7 without it, even: the
 * quantization's wait for the sums is not what the launch waits for either. */
/* The block of 32 of x that lane `lane` of warp `warp` (of W a block) quantizes (with the seven
 * lanes of its group of eight) in pass p, and the lane's four norm weights of block b (zeros past
 * nb blocks or without norm_w). */
template <int W>
__device__ __forceinline__ int qc_qa_norm_block(int warp, int lane, int p) {
    return 4 * warp + 4 * W * p + (lane >> 3);
}
__device__ __forceinline__ void qc_qa_norm_w4(const float *norm_w, int b, int lane, int nb, float (&w)[4]) {
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = norm_w && b < nb ? __ldg(norm_w + 32 * b + 4 * (lane & 7) + k) : 0.0f;
}
/* x_sum (or NULL): x's values are x + qc_sum_to_float(x_sum) (a folded down projection,
 * qc_slices.cuh), the same float in every block; x_out (one block's, with x_sum): where they go. */
__device__ __forceinline__ float4 qc_qa_x4(const float *x, const long long *x_sum, int i) {
    float4 v = __ldcg((const float4 *)(x + i));
    if (x_sum) {
        const longlong2 a = __ldcg((const longlong2 *)(x_sum + i)), b = __ldcg((const longlong2 *)(x_sum + i + 2));
        v.x += qc_sum_to_float(a.x);
        v.y += qc_sum_to_float(a.y);
        v.z += qc_sum_to_float(b.x);
        v.w += qc_sum_to_float(b.y);
    }
    return v;
}
template <int W>
__device__ __forceinline__ void qc_qa_norm_quantize(const float *x, const long long *x_sum, float *x_out,
                                                    const float *norm_w, const float (&w)[4], int dim, float eps,
                                                    int8_t *qs, float2 *ds, float *norm_tmp) {
    constexpr int passes = QC_NORM_FUSE_MAX_COLS / 32 / (4 * W);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane & 7, nb = dim / 32;
    /* the first pass's values, loaded beside the sums' */
    const int b_first = qc_qa_norm_block<W>(warp, lane, 0);
    float4 v = b_first < nb ? qc_qa_x4(x, x_sum, 32 * b_first + 4 * sub) : make_float4(0.f, 0.f, 0.f, 0.f);
    float scale = 1.0f;
    if (norm_w) {
        if (threadIdx.x < QC_NORM_ROW_THREADS) {
            float ss = 0.0f;
            if (x_sum) {
                /* four values' loads of x and of the sums at once, then their fmas in order (the
                 * same chain): with each sum's load beside its add, behind a branch on x_sum, the
                 * loads waited for each other (the output norm's launch, which read the sums that
                 * way, took 5.9 us from its release to its end, not 2.0: matmul.cu) */
                for (int i0 = threadIdx.x; i0 < dim; i0 += 4 * QC_NORM_ROW_THREADS) {
                    float xv[4];
                    long long sv[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const int i = i0 + k * QC_NORM_ROW_THREADS;
                        xv[k] = i < dim ? __ldcg(x + i) : 0.0f;
                        sv[k] = i < dim ? __ldcg(x_sum + i) : 0;
                    }
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const float xi = xv[k] + qc_sum_to_float(sv[k]);
                        if (i0 + k * QC_NORM_ROW_THREADS < dim) ss = fmaf(xi, xi, ss);
                    }
                }
            } else {
#pragma unroll 4
                for (int i = threadIdx.x; i < dim; i += QC_NORM_ROW_THREADS) {
                    const float xi = __ldcg(x + i);
                    ss = fmaf(xi, xi, ss);
                }
            }
            ss = qc_norm_warp_sum(ss);
            if (lane == 0) norm_tmp[warp] = ss;
        }
        __syncthreads();
        scale = qc_norm_scale_of_warps(norm_tmp, dim, eps);
    }
#pragma unroll
    for (int p = 0; p < passes; p++) {
        const int b0 = qc_qa_norm_block<W>(warp, 0, p), b = qc_qa_norm_block<W>(warp, lane, p);   /* (b0: lane 0's) */
        if (b0 >= nb) break;   /* whole warps */
        float wp[4] = {w[0], w[1], w[2], w[3]};
        if (p > 0) {
            v = b < nb ? qc_qa_x4(x, x_sum, 32 * b + 4 * sub) : make_float4(0.f, 0.f, 0.f, 0.f);
            qc_qa_norm_w4(norm_w, b, lane, nb, wp);
        }
        /* (x_out here, not in the sums' loop: a store there, which may alias x, kept each load of
         * that loop behind the one before) */
        if (x_out && b < nb) *(float4 *)(x_out + 32 * b + 4 * sub) = v;
        const float a[4] = {v.x, v.y, v.z, v.w};
        float q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = norm_w ? a[k] * scale * wp[k] : a[k];
        qc_q8_quantize_block4(q, sub, qs + 32 * b, ds + b, b < nb);   /* (lanes past nb: no store) */
    }
    __syncthreads();
}

/* Wait until this block's mbarrier bar has counted every byte it expects (its one phase of the
 * launch), with acquire semantics at cluster scope: the other blocks' st.async stores visible. */
__device__ __forceinline__ void qc_qa_wait_bytes(uint64_t *bar) {
    while (!cuda::ptx::mbarrier_try_wait_parity(cuda::ptx::sem_acquire, cuda::ptx::scope_cluster, bar, 0)) {
    }
}

/* qc_att_cluster_merge with the partials brought to block 0 by st.async stores that its mbarrier
 * parts_in counts (it expects the other blocks' bytes), where that one has every block store them,
 * then a cluster barrier with release semantics: each block's stores had to be acknowledged before
 * it could arrive (a fence), and block 0 waited for the last arrival. The other blocks leave once
 * their stores are issued: nothing reads their shared memory. */
template <int HD, int CS>
__device__ __forceinline__ void qc_qa_cluster_merge(float *parts, unsigned rank, int64_t pair, float *out,
                                                    int8_t *out_qs, float2 *out_ds, float *weight,
                                                    uint64_t *parts_in) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int mine_floats = qc_att_block_parts_floats<HD, CS>();
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    if (rank != 0) {
        float *mine = parts + rank * mine_floats;
        float *to = cluster.map_shared_rank(mine, 0);
        uint64_t *bar = cluster.map_shared_rank(parts_in, 0);
        for (int i = threadIdx.x; i < mine_floats; i += blockDim.x) cuda::ptx::st_async(to + i, mine[i], bar);
        return;
    }
    qc_qa_wait_bytes(parts_in);
    qc_att_cluster_merge_parts<HD>(parts, pair, out, out_qs, out_ds, weight);
#endif
}

/* SUM: x_sum is not NULL (a folded down projection before: swiglu_down, matmul_swiglu.cu): an
 * instantiation of its own, so that the others keep their registers. Why: with the sums' loads in
 * the one instantiation, head_dim 64's took 113 registers a thread where it had 110 (ptxas, nvcc
 * 13), and decode without the fold went 2292.5-2295.9 -> 2211.6 tok/s at 512 keys (H200,
 * synthetic 0.5B Q4_K_M, one lease, 2026-12-03); on its own, 2294.1-2296.6 against the base's
 * 2272.7-2290.2 in another lease. Registers are given a warp in steps of 8 a thread, so 113 takes
 * 120 (read off the figures, not stamped: fewer of these blocks then fit beside the ones before).
 * With the sums' loads batched in the norm (qc_qa_norm_quantize), the SUM instantiation takes 105
 * (nvcc 13) and decode went 2356.2-2363.5 -> 2378.4-2392.6 tok/s at 512 keys, 2013.9-2020.7 ->
 * 2039.9-2048.9 at 2560 (H200, real file, with the output norm's same change; report
 * 20261203-a65eddb-*, addendum). */
template <int G, typename KV, int HD, int C, bool SUM>
__global__ void __launch_bounds__(qc_qa_shape<C>::threads, qc_qa_shape<C>::min_blocks)
qc_qkv_attention_kernel(const __grid_constant__ qc_qa_params P) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using S = qc_qa_shape<C>;
    constexpr int half = HD / 2;
    constexpr int ITEMS = (3 * half + QC_QA_CLUSTER_WARPS - 1) / QC_QA_CLUSTER_WARPS;   /* row pairs a warp */
    constexpr int pub_floats = (QC_ATT_SPLIT_THREADS / G) * (2 + HD);
    extern __shared__ float4 qc_qa_smem[];
    __shared__ float weight[32];
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    /* mbarriers: this block's q, k and v rows stored (step 3); block 0's: the cluster's partials
     * (step 4) */
    __shared__ uint64_t rows_in, parts_in;
    float *qn = (float *)qc_qa_smem;
    float *kn = qn + HD, *vn = qn + 2 * HD;   /* floats of the cache's rounding (qc_kv_rounded) */
    float *region = qn + 3 * HD;
    int8_t *xs_qs = (int8_t *)region;
    float2 *xs_ds = qc_q8x_ds_at(xs_qs, 1, P.dim);
    float *pub = region, *parts = region + S::splits * pub_floats;

    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const unsigned rank = cluster.block_rank();   /* = blockIdx.y: the cluster spans the grid's y */
    const int h = blockIdx.x, group_heads = P.n_head / P.n_head_kv, kvh = h / group_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = threadIdx.x / QC_ATT_SPLIT_THREADS, tid = threadIdx.x % QC_ATT_SPLIT_THREADS;
    const int split = (int)rank * S::splits + sub;
    const bool writes_kv = h % group_heads == 0;   /* the KV head's first cluster */
    const KV *k_cache = (const KV *)P.k_cache, *v_cache = (const KV *)P.v_cache;
    const int kv_dim = P.n_head_kv * HD;

    /* 1. barrier phase 1, arrival: this block has started and its mbarriers are set up (no block
     *    stores into another's shared memory before that one runs); they expect the bytes that
     *    the cluster's st.async stores bring: rows_in a float of each of q, k and v's HD rows
     *    (step 3's 3 * half pairs, two each), block 0's parts_in the other blocks' partials */
    if (threadIdx.x == 0) {
        cuda::ptx::mbarrier_init(&rows_in, 1);
        cuda::ptx::mbarrier_init(&parts_in, 1);
        cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
        (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                                   cuda::ptx::space_shared, &rows_in, 3 * HD * sizeof(float));
        if (rank == 0)
            (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                                       cuda::ptx::space_shared, &parts_in,
                                                       (C - 1) * qc_att_block_parts_floats<HD, S::splits>() * sizeof(float));
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    const int pos = P.pos[0];
    qc_att_held<KV, QC_ATT_HELD> held;
    qc_att_held_load<G, KV, QC_ATT_HELD>(held, k_cache, v_cache, P.hold ? pos : 0, h, split, QC_ATT_SPLITS, P.n_head,
                                         P.n_head_kv, HD, tid);
    qc_att_prefetch_keys<G, KV>(k_cache, v_cache, pos - 1, h, split, QC_ATT_SPLITS, P.n_head, P.n_head_kv, HD, tid,
                                P.hold ? QC_ATT_HELD : 0);
    /* this warp's pairs: item it is pair it % half of q (it < half), k or v (it / half) */
    double2 cs[ITEMS];
    float bias_a[ITEMS], bias_b[ITEMS];
    const uint8_t *row_a[ITEMS], *row_b[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        const int it = (int)rank * S::warps + warp + k * QC_QA_CLUSTER_WARPS, which = it / half, i = it % half;
        cs[k] = make_double2(1.0, 0.0);
        bias_a[k] = bias_b[k] = 0.0f;
        if (it >= 3 * half) continue;
        const qc_qa_w &w = P.w[which];
        const int64_t r = (int64_t)(which == 0 ? h : kvh) * HD + i;
        row_a[k] = w.W + r * w.row_bytes;
        row_b[k] = w.W + (r + half) * w.row_bytes;
        if (P.rows_prefetch) {
            qc_qa_prefetch_row(row_a[k], w.row_bytes, lane);
            qc_qa_prefetch_row(row_b[k], w.row_bytes, lane);
        }
        if (lane == 0) {
            if (w.bias) bias_a[k] = w.bias[r], bias_b[k] = w.bias[r + half];
            if (which < 2 && !P.rope_read) cs[k] = qc_rope_angle(i, HD, pos, P.theta);
        }
    }
    float norm_w[4];   /* the first pass's (qc_qa_norm_quantize) */
    qc_qa_norm_w4(P.norm_w, qc_qa_norm_block<S::warps>(warp, lane, 0), lane, P.dim / 32, norm_w);
    qc_grid_start();
    /* the angles: from the step's first launch (read here, used after the dot products), or
     * computed above by this one, which leaves them for the others */
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        const int it = (int)rank * S::warps + warp + k * QC_QA_CLUSTER_WARPS, which = it / half, i = it % half;
        if (it >= 3 * half || which == 2 || lane != 0) continue;
        if (P.rope_read) cs[k] = __ldcg(P.rope_cs + i);
        else if (h == 0 && which == 0) P.rope_cs[i] = cs[k];
    }

    /* 2. x normalised and quantized, in every block */
    qc_qa_norm_quantize<S::warps>(P.x, SUM ? P.x_sum : NULL, SUM && h == 0 && rank == 0 ? P.x_out : NULL, P.norm_w,
                                  norm_w, P.dim, P.eps, xs_qs, xs_ds, norm_tmp);
    const qc_q8x xs = {xs_qs, xs_ds, P.dim, P.dim / 32};

    /* 3. the rows: both of a pair in one loop (qc_gemv_q8_row2: each row qc_gemv_q8_row_slice's
     *    sums), rotated, stored into every block of the cluster once they all run */
    float ya[ITEMS], yb[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        const int it = (int)rank * S::warps + warp + k * QC_QA_CLUSTER_WARPS, which = it / half;
        ya[k] = yb[k] = 0.0f;
        if (it >= 3 * half) continue;
        const qc_qa_w &w = P.w[which];
        float a[1], b[1];
        qc_gemv_q8_row2_any<1>(w.type, row_a[k], row_b[k], P.dim, xs, 1, 0, lane, a, b);
        ya[k] = w.bias ? a[0] + bias_a[k] : a[0];
        yb[k] = w.bias ? b[0] + bias_b[k] : b[0];
    }
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");   /* phase 1: every block runs */
    float2 y[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        const int it = (int)rank * S::warps + warp + k * QC_QA_CLUSTER_WARPS, which = it / half, i = it % half;
        if (it >= 3 * half) continue;
        y[k] = which < 2 ? qc_rope_apply(ya[k], yb[k], cs[k]) : make_float2(ya[k], yb[k]);   /* lane 0's */
        y[k].x = __shfl_sync(0xffffffffu, y[k].x, 0);
        y[k].y = __shfl_sync(0xffffffffu, y[k].y, 0);
        /* lane b stores into block b, and its rows_in counts the bytes */
        if (lane < C) {
            float *to = cluster.map_shared_rank(which == 0 ? qn : which == 1 ? kn : vn, lane);
            uint64_t *bar = cluster.map_shared_rank(&rows_in, lane);
            cuda::ptx::st_async(to + i, which == 0 ? y[k].x : qc_kv_rounded<KV>(y[k].x), bar);
            cuda::ptx::st_async(to + i + half, which == 0 ? y[k].y : qc_kv_rounded<KV>(y[k].y), bar);
        }
    }
    /* the global stores (later launches read them), then this block's rows: once rows_in has
     * counted all their bytes (acquire: the stores of the cluster's blocks visible) */
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        const int it = (int)rank * S::warps + warp + k * QC_QA_CLUSTER_WARPS, which = it / half, i = it % half;
        if (it >= 3 * half || lane != 0 || (which > 0 && !writes_kv)) continue;
        const int64_t r = (int64_t)(which == 0 ? h : kvh) * HD + i;
        float *out = P.w[which].out;
        out[r] = y[k].x;
        out[r + half] = y[k].y;
        if (which > 0) {
            KV *row = (KV *)(which == 1 ? P.k_cache : P.v_cache) + (int64_t)pos * kv_dim;
            qc_kv_put(row + r, y[k].x);
            qc_kv_put(row + r + half, y[k].y);
        }
    }
    qc_qa_wait_bytes(&rows_in);

    /* 4. the attention: this block's splits, then the cluster's merge in block 0 */
    qc_att_split_partial<G, KV, true, QC_ATT_HELD, true, float>(
        qn, k_cache, v_cache, pos, h, split, QC_ATT_SPLITS, 0, P.n_head, P.n_head_kv, HD, P.scale,
        parts + split * (HD + 2), pub + sub * pub_floats, tid, &held, kn, vn);
    __syncthreads();   /* this block's partials complete */
    qc_qa_cluster_merge<HD, S::splits>(parts, rank, h, P.out, P.out_qs, P.out_ds, weight, &parts_in);
#endif
}

/* The cluster size of a launch for n_head heads (qc_qa_shape): 16 where the backend's creation
 * found the wide clusters schedulable (qc_cuda_qkv_attention_init) and the GPU holds at least as
 * many of them at once as of eight for this grid (never more waves), or QWENCUDA_ATT_CLUSTER asks
 * for 16; else 8. */
static int qa_cluster(const qc_cuda *cu, int head_dim, int kv, int n_head) {
    const int *most = cu->qa_most[head_dim == 128][kv == QC_KV_F32];
    if (most[1] <= 0 || cu->qa_cluster_want == QC_ATT_CLUSTER) return QC_ATT_CLUSTER;
    if (cu->qa_cluster_want == QC_QA_CLUSTER_WIDE) return QC_QA_CLUSTER_WIDE;
    const int narrow = n_head < most[0] ? n_head : most[0];
    return most[0] > 0 && most[1] >= narrow ? QC_QA_CLUSTER_WIDE : QC_ATT_CLUSTER;
}

/* Whether one token's qkv_attention runs the one launch (else the two ops): the cluster
 * attention's case of the attention op, 8-bit GEMV weights of whole heads, x in shared memory. */
static int qa_takes(qc_backend *be, const qc_matmul_part *qkv, int n, int n_kv, int n_head, int n_head_kv,
                    int head_dim, qc_kv_cache cache) {
    qc_cuda *cu = qc_cuda_of(be);
    if (!cu->qkv_attention || !cu->clusters || n != 1 || n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0 ||
        n_head > 65535 || (cache.type != QC_KV_F16 && cache.type != QC_KV_F32))
        return 0;
    const int G = qc_att_group_lanes(head_dim);
    if (!qc_att_cluster_takes(G, head_dim) || !qc_cuda_attention_splits(be, cache.type, 1, n_kv, n_head, head_dim))
        return 0;
    const int64_t dim = qkv[0].w->cols, rows[3] = {(int64_t)n_head * head_dim, (int64_t)n_head_kv * head_dim,
                                                   (int64_t)n_head_kv * head_dim};
    if (dim > QC_NORM_FUSE_MAX_COLS || (int64_t)n_head * head_dim > QC_Q8X_MAX_COLS || head_dim > 2 * QC_ROPE_CS_MAX)
        return 0;
    for (int i = 0; i < 3; i++)
        if (qkv[i].w->rows != rows[i] || qkv[i].w->cols != dim || !qc_cuda_gemv_q8(be, qkv[i].w->type, dim)) return 0;
    return qa_smem_bytes(G, head_dim, dim, qa_cluster(cu, head_dim, cache.type, n_head)) <= QC_SHARED_COPY_MAX;
}

template <typename KV, int C>
static void launch(const qc_cuda *cu, const qc_qa_params &p, int head_dim, size_t smem) {
    const dim3 grid((unsigned)p.n_head, C, 1), block(qc_qa_shape<C>::threads), cluster(1, C, 1);
    constexpr int G64 = qc_att_group_lanes(64), G128 = qc_att_group_lanes(128);
    if (p.x_sum) {
        if (head_dim == 64) qc_launch_ex(cu, qc_qkv_attention_kernel<G64, KV, 64, C, true>, grid, block, smem, cluster, p);
        else qc_launch_ex(cu, qc_qkv_attention_kernel<G128, KV, 128, C, true>, grid, block, smem, cluster, p);
    } else {
        if (head_dim == 64) qc_launch_ex(cu, qc_qkv_attention_kernel<G64, KV, 64, C, false>, grid, block, smem, cluster, p);
        else qc_launch_ex(cu, qc_qkv_attention_kernel<G128, KV, 128, C, false>, grid, block, smem, cluster, p);
    }
}

/* How many clusters of C blocks of qc_qkv_attention_kernel<G, KV, HD, C> the GPU holds at once
 * (*most; 0 where it takes none, or where the query or, for 16, the attribute that allows a
 * non-portable size failed: that size is then never launched). The shared memory of the largest
 * x the launch takes. */
template <int G, typename KV, int HD, int C>
static void qa_most_clusters(int *most) {
    void (*kernel)(const qc_qa_params) = qc_qkv_attention_kernel<G, KV, HD, C, false>;
    *most = 0;
    /* (the SUM instantiation is launched in the same clusters: its attribute too; its registers may
     * be more, so its count is the one taken) */
    if (C > QC_ATT_CLUSTER &&
        (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess ||
         cudaFuncSetAttribute(qc_qkv_attention_kernel<G, KV, HD, C, true>, cudaFuncAttributeNonPortableClusterSizeAllowed,
                              1) != cudaSuccess)) {
        cudaGetLastError();
        return;
    }
    kernel = qc_qkv_attention_kernel<G, KV, HD, C, true>;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 1;
    attr.val.clusterDim.y = C;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(64, C, 1);
    cfg.blockDim = dim3(qc_qa_shape<C>::threads);
    cfg.dynamicSmemBytes = qa_smem_bytes(G, HD, QC_NORM_FUSE_MAX_COLS, C);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(most, kernel, &cfg) != cudaSuccess) {
        cudaGetLastError();
        *most = 0;
    }
}

template <int G, typename KV, int HD>
static void qa_most_both(int (&most)[2]) {
    qa_most_clusters<G, KV, HD, QC_ATT_CLUSTER>(&most[0]);
    qa_most_clusters<G, KV, HD, QC_QA_CLUSTER_WIDE>(&most[1]);
}

void qc_cuda_qkv_attention_init(qc_backend *be) {
    qc_cuda *cu = qc_cuda_of(be);
    const char *want = getenv("QWENCUDA_ATT_CLUSTER");
    cu->qa_cluster_want = want && strcmp(want, "8") == 0 ? QC_ATT_CLUSTER
                          : want && strcmp(want, "16") == 0 ? QC_QA_CLUSTER_WIDE : 0;
    memset(cu->qa_most, 0, sizeof cu->qa_most);
    if (!cu->clusters || !cu->qkv_attention) return;
    constexpr int G64 = qc_att_group_lanes(64), G128 = qc_att_group_lanes(128);
    qa_most_both<G64, __half, 64>(cu->qa_most[0][0]);
    qa_most_both<G64, float, 64>(cu->qa_most[0][1]);
    qa_most_both<G128, __half, 128>(cu->qa_most[1][0]);
    qa_most_both<G128, float, 128>(cu->qa_most[1][1]);
}

int qc_cuda_qkv_attention(qc_backend *be, const qc_matmul_part *qkv, const float *x, int n, const float *norm_w,
                          float eps, const int32_t *pos, int n_kv, int n_head, int n_head_kv, int head_dim,
                          float theta, qc_kv_cache cache, float *out, const int64_t *x_sum, float *x_out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (x_sum && (n != 1 || !norm_w || !x_out || x_out == x))
        return qc_cuda_value_error(be, "qkv_attention: x_sum takes one token, a norm and an x_out apart from x");
    if (!qa_takes(be, qkv, n, n_kv, n_head, n_head_kv, head_dim, cache)) {
        /* (x + the sums: matmul_multi.cu says by which launch) */
        if (qc_cuda_matmul_qkv_rope_sum(be, qkv, x, x_sum, x_out, n, norm_w, eps, pos, n_head, n_head_kv, head_dim,
                                        theta, cache) < 0)
            return -1;
        return qc_cuda_attention(be, qkv[0].out, cache, pos, n, n_kv, n_head, n_head_kv, head_dim, out, NULL, NULL);
    }
    const int64_t dim = qkv[0].w->cols, q_dim = (int64_t)n_head * head_dim;
    qc_qa_params p = {};
    for (int i = 0; i < 3; i++)
        p.w[i] = qc_qa_w{(const uint8_t *)qkv[i].w->data, qkv[i].bias, qkv[i].out, qc_row_bytes(qkv[i].w->type, dim),
                         qkv[i].w->type};
    p.x = x;
    p.x_sum = (const long long *)x_sum;
    p.x_out = x_out;
    p.norm_w = norm_w;
    p.eps = eps;
    p.scale = 1.0f / sqrtf((float)head_dim);
    p.dim = (int)dim;
    p.n_head = n_head;
    p.n_head_kv = n_head_kv;
    p.hold = cu->att_hold;
    p.theta = (double)theta;
    p.rope_cs = cu->rope_cs;
    p.rope_read = cu->rope_of_pos == pos && cu->rope_of_theta == theta && cu->rope_of_head_dim == head_dim;
    p.pos = pos;
    /* the matmul before (the down projection) asked L2 for all three (session.c names them)? */
    int named = 0;
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < QC_READ_AHEAD_MAX; k++)
            named += cu->ahead_issued.p[k] == (const uint8_t *)qkv[i].w->data &&
                     cu->ahead_issued.bytes[k] == (int64_t)qkv[i].w->nbytes;
    cu->ahead_issued = qc_l2_ahead{};
    p.rows_prefetch = named != 3;
    p.k_cache = cache.k;
    p.v_cache = cache.v;
    p.out = out;
    p.out_qs = (int8_t *)cu->q8x;
    p.out_ds = qc_q8x_ds_at(cu->q8x, 1, q_dim);
    const int C = qa_cluster(cu, head_dim, cache.type, n_head);
    const size_t smem = qa_smem_bytes(qc_att_group_lanes(head_dim), head_dim, dim, C);
    if (C == QC_QA_CLUSTER_WIDE) {
        if (cache.type == QC_KV_F16) launch<__half, QC_QA_CLUSTER_WIDE>(cu, p, head_dim, smem);
        else launch<float, QC_QA_CLUSTER_WIDE>(cu, p, head_dim, smem);
    } else {
        if (cache.type == QC_KV_F16) launch<__half, QC_ATT_CLUSTER>(cu, p, head_dim, smem);
        else launch<float, QC_ATT_CLUSTER>(cu, p, head_dim, smem);
    }
    if (QC_LAUNCHED(be, "qc_qkv_attention_kernel") < 0) return -1;
    /* out's 8-bit form is in q8x, as the attention op leaves it (x_from_last_op, backend.h) */
    cu->q8x_of = out;
    cu->q8x_cols = q_dim;
    cu->q8x_of_at = cu->q8x;
    cu->norm_of = NULL;
    cu->rope_of_pos = pos;
    cu->rope_of_theta = theta;
    cu->rope_of_head_dim = head_dim;
    return 0;
}
