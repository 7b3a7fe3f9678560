/* decode_step.cu: the persistent decode kernel: one launch computes a decode step's every layer
 * and its lm_head (the decode_step op of backend.h), where the op-by-op step takes about ten
 * launches a layer.
 *
 * Why: a 0.5B decode step was 245 kernels of a few microseconds each (bench/results); each ramps
 * up, drains and leaves the GPU idle between, so the step streamed its weights at about 12% of
 * the HBM bound. Here every block of one resident grid (a few blocks per SM, a cooperative
 * launch, so all are resident at once) walks the step's phases in order and waits for the
 * others at a grid barrier between phases that read what another block wrote:
 *
 *   per layer:  1. attention norm (each block, into shared memory), q, k and v rows, RoPE, and
 *                  the k and v of this position into the caches   -- barrier --
 *               2. split-K attention: (head, split) pairs; the last split of a head merges the
 *                  head and quantizes it to 8 bits                -- barrier --
 *               3. o rows + the residual                           -- barrier --
 *               4. ffn norm (each block), gate and up rows, SwiGLU; the warp that completes a
 *                  block of 32 act values quantizes it             -- barrier --
 *               5. down rows + the residual                        -- barrier --
 *   then:       the output norm (each block) and the lm_head rows.
 *
 * The same bits as the fused ops (backend.h): every row is computed by the device functions the
 * GEMV kernels use (qc_gemv_q8.cuh), with the same split of long rows over a block's warps
 * (qc_gemv_split); the norms by qc_norm_row_scale, the 8-bit activations by
 * qc_q8_quantize_block, RoPE by qc_rope_rotate, attention by qc_att_split_block
 * (qc_attention.cuh). A norm computed by every block gives the same bits in each.
 *
 * What it takes (qc_cuda_decode_step_takes): 8-bit GEMV weights only (qc_gemv_q8.cuh's types,
 * not device "cuda:float"), head_dim 64 or 128, and a context where the op-by-op step also runs
 * the split-K attention (an F16 cache up to QC_KV_SHORT keys, where flash decode takes over).
 * Everything else runs op by op, as do steps that capture or patch anything.
 *
 * Not the default (QWENCUDA_DECODE=persistent, session.c): on an H100 the synthetic 0.5B Q4_K_M
 * decode runs at 901-950 tok/s here and 1090-1105 op by op (bench/results, "persistent").
 * Timed per phase, a layer is ~43 us: each phase is a chain of dependent L2 round trips (norm, one or two
 * rows per warp, the act counters, the attention merge) with 16 warps an SM to hide them, plus
 * ~2 us a barrier and the wait for the slowest block (the attention merge, ~10 us). Streaming the
 * weights at the bound would take ~5 us a layer: the gap is latency, not bytes.
 *
 * Memory ordering: a block publishes its writes before it arrives at a barrier (__threadfence,
 * then a release increment) and reads after it through acquire loads; data that other blocks
 * wrote in this launch is never read through the non-coherent path (__ldg): the activations are
 * read with plain or __ldcg loads, only weights with __ldg.
 */
#include "qc_attention.cuh"
#include "qc_gemv_q8.cuh"
#include "qc_rope.cuh"

#include <stdlib.h>
#include <string.h>

#define QC_DEC_MAX_LAYERS 80                /* Qwen2.5-72B has 80 */
#define QC_DEC_THREADS (32 * QC_GEMV_WARPS)
#define QC_DEC_BLOCKS_PER_SM 4              /* __launch_bounds__: at most 128 registers a thread */
#define QC_DEC_PREFETCH_CAP (8ll << 20)     /* largest matrix prefetched a phase ahead (L2: 50 MB) */
static_assert(QC_DEC_THREADS == QC_ATT_SPLIT_THREADS, "a block runs whole split-K attention blocks");
static_assert(QC_DEC_THREADS == QC_NORM_ROW_THREADS / 2, "qc_norm_row_scale's block");
static_assert(QC_DEC_SYNC_WORDS - QC_DEC_SYNC_BARRIER >= QC_Q8X_MAX_COLS / 32, "a counter per block of act");

/* One weight: its stored rows and their type (its shape is the model's). */
struct qc_dec_w {
    const uint8_t *W;
    int64_t row_bytes;
    uint32_t type;
};

struct qc_dec_layer {
    qc_dec_w q, k, v, o, gate, up, down;
    const float *bq, *bk, *bv, *attn_norm, *ffn_norm;
    void *k_cache, *v_cache;
};

/* Everything the kernel reads, by value in its parameters (__grid_constant__: not copied): a
 * recorded step replays them as they were, and only the position comes from device memory. */
struct qc_dec_params {
    int n_layer, dim, q_dim, kv_dim, ffn, n_head, n_head_kv, head_dim;
    float eps, att_scale;
    double theta;
    int64_t n_vocab;
    qc_dec_w output;
    const float *output_norm;
    const int32_t *pos;
    float *x, *q, *att, *act, *logits;
    int8_t *att_qs, *act_qs;                /* 8-bit att (q_dim) and act (ffn), qc_gemv_q8.cuh */
    float2 *att_ds, *act_ds;
    float *attn_part;                       /* split-K partials (qc_cuda) */
    unsigned int *attn_done;                /* split-K counters, one per head (qc_cuda) */
    unsigned int *act_done;                 /* act values written, per block of 32 (qc_cuda) */
    unsigned long long *barrier;            /* arrivals (qc_cuda; qc_grid_sync) */
    qc_dec_layer layer[QC_DEC_MAX_LAYERS];
};
static_assert(sizeof(qc_dec_params) <= 32764, "kernel parameters are at most 32764 bytes");

__device__ __forceinline__ unsigned long long qc_ld_acquire(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

/* The grid barrier: a 64-bit count of arrivals that only grows. A launch's grid is always the
 * same size (QC_DEC_BLOCKS_PER_SM blocks on every SM), so between launches the count is a
 * multiple of it: a block's k-th barrier is passed when the count reaches base + k * blocks,
 * base that multiple (qc_grid_base). One atomic per block and a poll; nothing is reset. */
__device__ __forceinline__ unsigned long long qc_grid_base(const unsigned long long *count) {
    /* fewer than a grid of arrivals can precede this read (this block has not arrived) */
    const unsigned long long v = qc_ld_acquire(count);
    return v - v % gridDim.x;
}

/* Every block waits here until all have arrived; what any block wrote before is then visible to
 * all. target: this block's count to wait for, in a register of thread 0. */
__device__ __forceinline__ void qc_grid_sync(unsigned long long *count, unsigned long long &target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        target += gridDim.x;
        __threadfence();
        atomicAdd(count, 1ull);
        while (qc_ld_acquire(count) < target) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
}

/* The norm weight of the next norm into shared memory (wf), before the barrier that precedes
 * it: a constant, so its loads need not wait for the barrier. */
__device__ __forceinline__ void qc_dec_load_norm_weight(const float *w, int dim, float *wf) {
    for (int i = 4 * threadIdx.x; i < dim; i += 4 * QC_DEC_THREADS) *(float4 *)(wf + i) = __ldg((const float4 *)(w + i));
}

/* x (dim values, written by other blocks) normalised with the weight in wf and quantized into
 * this block's shared memory: qc_norm_quantize_q8_kernel's values, every block for itself. x is
 * first copied to shared memory (xf) in one round of 16-byte loads: each later pass then reads
 * shared memory, not L2 once per pass. Ends with the block synchronised. */
__device__ __forceinline__ void qc_dec_norm_quantize(const float *x, int dim, float eps, float *xf, const float *wf,
                                                     int8_t *qs, float2 *ds, float *norm_tmp) {
    for (int i = 4 * threadIdx.x; i < dim; i += 4 * QC_DEC_THREADS) *(float4 *)(xf + i) = __ldcg((const float4 *)(x + i));
    __syncthreads();
    const float scale = qc_norm_row_scale<true>(xf, dim, eps, norm_tmp);
    for (int i = threadIdx.x; i < dim; i += QC_DEC_THREADS) xf[i] = xf[i] * scale * wf[i];
    __syncthreads();
    /* eight lanes a block of 32: the block's 16 groups take 16 blocks at a time. Whole warps go
     * round the loop (qc_q8_quantize_block4's shuffles take all 32 lanes); a group past the last
     * block (dim / 32 not a multiple of 4) quantizes zeros and stores nothing */
    const int sub = threadIdx.x & 7, nb = dim / 32;
    for (int b0 = 4 * (threadIdx.x >> 5); b0 < nb; b0 += QC_DEC_THREADS / 8) {
        const int b = b0 + ((threadIdx.x & 31) >> 3);
        const float4 v4 = b < nb ? *(const float4 *)(xf + 32 * b + 4 * sub) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float v[4] = {v4.x, v4.y, v4.z, v4.w};
        qc_q8_quantize_block4(v, sub, qs + 32 * b, ds + b, b < nb);
    }
    __syncthreads();
}

/* Ask L2 for bytes [0, bytes) of p, spread over every thread of the grid: the weights of a
 * later phase stream in from HBM while this phase computes and the grid waits at its barriers,
 * so that phase reads L2. Skipped above `cap` bytes (a large model's matrices would only push
 * each other out of L2; their phases are long enough to stream at full rate anyway). */
__device__ __forceinline__ void qc_dec_prefetch(const void *p, int64_t bytes, int64_t cap) {
    if (p == NULL || bytes > cap) return;
    const int64_t stride = (int64_t)gridDim.x * QC_DEC_THREADS * 128;
    for (int64_t off = ((int64_t)blockIdx.x * QC_DEC_THREADS + threadIdx.x) * 128; off < bytes; off += stride)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + off));
}

/* out[r] = (add ? out[r] : 0) + row r of w . x for r < rows: as matmul / matmul_add compute it
 * (matmul.cu): one warp a row, four rows in flight, or for long rows (qc_gemv_split) one block a
 * row with the warps' slices added in warp order. */
__device__ __forceinline__ void qc_dec_rows(const qc_dec_w &w, int64_t rows, int64_t cols, const qc_q8x &x,
                                            float *out, bool add, float *slice_sum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (qc_gemv_split(cols) == 1) {
        /* rows r, r + nwarps, r + 2 nwarps, r + 3 nwarps: four rows' loads in flight */
        const int64_t nwarps = (int64_t)gridDim.x * QC_GEMV_WARPS;
        for (int64_t r = (int64_t)blockIdx.x * QC_GEMV_WARPS + warp; r < rows; r += 4 * nwarps) {
            float acc[4];
            int nr = 1;   /* of the four rows, those below rows */
            while (nr < 4 && r + nr * nwarps < rows) nr++;
            const uint8_t *const four[4] = {w.W + r * w.row_bytes, w.W + (r + nwarps) * w.row_bytes,
                                            w.W + (r + 2 * nwarps) * w.row_bytes, w.W + (r + 3 * nwarps) * w.row_bytes};
            qc_gemv_q8_rows_upto4_any(w.type, four, nr, cols, x, lane, acc);
            if (lane == 0) {
                for (int k = 0; k < nr; k++) {
                    float *o = out + r + k * nwarps;
                    *o = add ? *o + acc[k] : acc[k];
                }
            }
        }
        return;
    }
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float a[1];
        qc_gemv_q8_slice_any<1>(w.type, w.W + r * w.row_bytes, cols, x, 1, 0, lane + 32 * warp, 32 * QC_GEMV_WARPS, a);
        if (lane == 0) slice_sum[warp] = a[0];
        __syncthreads();
        if (threadIdx.x == 0) {
            float s = slice_sum[0];
#pragma unroll
            for (int k = 1; k < QC_GEMV_WARPS; k++) s += slice_sum[k];
            out[r] = add ? out[r] + s : s;
        }
        __syncthreads();
    }
}

template <int G, typename KV>
__global__ void __launch_bounds__(QC_DEC_THREADS, QC_DEC_BLOCKS_PER_SM)
qc_decode_step_kernel(const __grid_constant__ qc_dec_params P) {
    extern __shared__ float4 qc_dec_smem[];
    __shared__ float norm_tmp[QC_NORM_ROW_THREADS / 32 + 1];
    __shared__ float slice_sum[QC_GEMV_WARPS];
    __shared__ float att_weight[32];
    __shared__ int att_last;
    /* x and the norm weight (xf, wf), then x normalised and quantized (xs) in phases 1, 4 and
     * the head; attention's groups in phase 2 */
    float *xf = (float *)qc_dec_smem, *wf = xf + P.dim;
    int8_t *xs_qs = (int8_t *)(wf + P.dim);
    float2 *xs_ds = (float2 *)((char *)xs_qs + qc_q8x_qs_bytes(1, P.dim));
    float *att_smem = (float *)qc_dec_smem;
    const qc_q8x xs = {xs_qs, xs_ds, P.dim, P.dim / 32};
    const qc_q8x att_x = {P.att_qs, P.att_ds, P.q_dim, P.q_dim / 32};
    const qc_q8x act_x = {P.act_qs, P.act_ds, P.ffn, P.ffn / 32};
    const int lane = threadIdx.x & 31;
    const int gwarp = blockIdx.x * QC_GEMV_WARPS + (threadIdx.x >> 5), nwarps = gridDim.x * QC_GEMV_WARPS;
    const int32_t pos = P.pos[0];
    unsigned long long bar_target = threadIdx.x == 0 ? qc_grid_base(P.barrier) : 0;
    const int half = P.head_dim / 2, q_pairs = P.q_dim / 2, pairs = q_pairs + P.kv_dim / 2;

    for (int l = 0; l < P.n_layer; l++) {
        const qc_dec_layer &L = P.layer[l];
        /* while each phase computes, the weights of the next one and the keys and values come
         * into L2 (a phase ahead, so the requests of one phase do not queue behind a whole
         * layer's) */
        qc_dec_prefetch(L.o.W, L.o.row_bytes * P.dim, QC_DEC_PREFETCH_CAP);
        qc_dec_prefetch(L.k_cache, ((int64_t)pos + 1) * P.kv_dim * (int64_t)sizeof(KV), QC_DEC_PREFETCH_CAP);
        qc_dec_prefetch(L.v_cache, ((int64_t)pos + 1) * P.kv_dim * (int64_t)sizeof(KV), QC_DEC_PREFETCH_CAP);
        /* 1. q, k, v = norm(x) W^T + b; a warp takes a RoPE pair (rows i and i + half of a head)
         *    of q or k and rotates it, or a row of v; k and v go into the caches at pos */
        if (l == 0) qc_dec_load_norm_weight(L.attn_norm, P.dim, wf);   /* later layers: in phase 5 */
        qc_dec_norm_quantize(P.x, P.dim, P.eps, xf, wf, xs_qs, xs_ds, norm_tmp);
        KV *k_row = (KV *)L.k_cache + (int64_t)pos * P.kv_dim;
        KV *v_row = (KV *)L.v_cache + (int64_t)pos * P.kv_dim;
        for (int it = gwarp; it < pairs + P.kv_dim; it += nwarps) {
            if (it < pairs) {
                const bool is_q = it < q_pairs;
                const int e = is_q ? it : it - q_pairs, i = e % half;
                const int r = e / half * P.head_dim + i;
                const qc_dec_w &w = is_q ? L.q : L.k;
                const float *bias = is_q ? L.bq : L.bk;
                float a[1], b[1];
                qc_gemv_q8_row2_any<1>(w.type, w.W + r * w.row_bytes, w.W + (r + half) * w.row_bytes, P.dim, xs, 1, 0,
                                       lane, a, b);
                if (lane == 0) {
                    const float2 rot = qc_rope_rotate(bias ? a[0] + bias[r] : a[0], bias ? b[0] + bias[r + half] : b[0],
                                                      i, P.head_dim, pos, P.theta);
                    if (is_q) {
                        P.q[r] = rot.x;
                        P.q[r + half] = rot.y;
                    } else {
                        qc_kv_put(k_row + r, rot.x);
                        qc_kv_put(k_row + r + half, rot.y);
                    }
                }
            } else {
                const int r = it - pairs;
                float a[1];
                qc_gemv_q8_row_any<1>(L.v.type, L.v.W + r * L.v.row_bytes, P.dim, xs, 1, 0, lane, a);
                if (lane == 0) qc_kv_put(v_row + r, L.bv ? a[0] + L.bv[r] : a[0]);
            }
        }
        qc_grid_sync(P.barrier, bar_target);

        /* 2. attention over keys 0..pos: (head, split) blocks; heads first, so a grid smaller
         *    than the pairs still spreads every head */
        qc_dec_prefetch(L.gate.W, L.gate.row_bytes * P.ffn, QC_DEC_PREFETCH_CAP);
        qc_dec_prefetch(L.up.W, L.up.row_bytes * P.ffn, QC_DEC_PREFETCH_CAP);
        for (int it = blockIdx.x; it < P.n_head * QC_ATT_SPLITS; it += gridDim.x) {
            qc_att_split_block<G, KV>(P.q, (const KV *)L.k_cache, (const KV *)L.v_cache, pos, it % P.n_head,
                                      it / P.n_head, QC_ATT_SPLITS, 0, P.n_head, P.n_head_kv, P.head_dim,
                                      P.att_scale, P.attn_part, P.attn_done, P.att, P.att_qs, P.att_ds, att_smem,
                                      att_weight, &att_last);
            __syncthreads();   /* att_smem is the next pair's */
        }
        qc_grid_sync(P.barrier, bar_target);

        /* 3. x += att Wo^T */
        qc_dec_prefetch(L.down.W, L.down.row_bytes * P.dim, QC_DEC_PREFETCH_CAP);
        qc_dec_rows(L.o, P.dim, P.q_dim, att_x, P.x, true, slice_sum);
        qc_dec_load_norm_weight(L.ffn_norm, P.dim, wf);
        qc_grid_sync(P.barrier, bar_target);

        /* 4. act = silu(norm(x) Wg^T) * (norm(x) Wu^T); the warp whose row completes a block of
         *    32 act values (a counter per block, back to 0 after it) quantizes that block */
        qc_dec_norm_quantize(P.x, P.dim, P.eps, xf, wf, xs_qs, xs_ds, norm_tmp);
        if (l + 1 < P.n_layer) {
            const qc_dec_layer &N = P.layer[l + 1];
            qc_dec_prefetch(N.q.W, N.q.row_bytes * P.q_dim, QC_DEC_PREFETCH_CAP);
            qc_dec_prefetch(N.k.W, N.k.row_bytes * P.kv_dim, QC_DEC_PREFETCH_CAP);
            qc_dec_prefetch(N.v.W, N.v.row_bytes * P.kv_dim, QC_DEC_PREFETCH_CAP);
        }
        for (int r0 = gwarp; r0 < P.ffn; r0 += 2 * nwarps) {
            /* rows r0 and r0 + nwarps: both rows' gate and up loads in flight at once */
            const int r1 = r0 + nwarps;
            float g[2], u[2];
            if (L.gate.type == L.up.type && r1 < P.ffn) {
                const uint8_t *const rows[4] = {L.gate.W + r0 * L.gate.row_bytes, L.up.W + r0 * L.up.row_bytes,
                                                L.gate.W + r1 * L.gate.row_bytes, L.up.W + r1 * L.up.row_bytes};
                float acc[4];
                qc_gemv_q8_row4_any(L.gate.type, rows, P.dim, xs, lane, acc);
                g[0] = acc[0], u[0] = acc[1], g[1] = acc[2], u[1] = acc[3];
            } else {
                for (int k = 0; k < 2 && r0 + k * nwarps < P.ffn; k++) {
                    const int r = r0 + k * nwarps;
                    float a[1], b[1];
                    qc_gemv_q8_row_any<1>(L.gate.type, L.gate.W + r * L.gate.row_bytes, P.dim, xs, 1, 0, lane, a);
                    qc_gemv_q8_row_any<1>(L.up.type, L.up.W + r * L.up.row_bytes, P.dim, xs, 1, 0, lane, b);
                    g[k] = a[0], u[k] = b[0];
                }
            }
            /* both rows' act, one fence, both counts in flight together */
            const int rows = r1 < P.ffn ? 2 : 1;
            unsigned int last = 0;
            if (lane == 0) {
                P.act[r0] = qc_silu_mul(g[0], u[0]);
                if (rows == 2) P.act[r1] = qc_silu_mul(g[1], u[1]);
                __threadfence();
                const unsigned int c0 = atomicAdd(&P.act_done[r0 >> 5], 1u);
                const unsigned int c1 = rows == 2 ? atomicAdd(&P.act_done[r1 >> 5], 1u) : 0u;
                if (c0 == 31u) P.act_done[r0 >> 5] = 0, last |= 1u;
                if (rows == 2 && c1 == 31u) P.act_done[r1 >> 5] = 0, last |= 2u;
            }
            last = __shfl_sync(0xffffffffu, last, 0);
            if (last) __threadfence();
            for (int k = 0; k < 2; k++) {
                if (last & (1u << k)) {
                    const int b = (k ? r1 : r0) >> 5;
                    qc_q8_quantize_block(__ldcg(P.act + 32 * b + lane), lane, P.act_qs + 32 * b, P.act_ds + b);
                }
            }
        }
        qc_grid_sync(P.barrier, bar_target);

        /* 5. x += act Wdown^T */
        qc_dec_rows(L.down, P.dim, P.ffn, act_x, P.x, true, slice_sum);
        qc_dec_load_norm_weight(l + 1 < P.n_layer ? P.layer[l + 1].attn_norm : P.output_norm, P.dim, wf);
        qc_grid_sync(P.barrier, bar_target);
    }

    /* the head: logits = norm(x) Wout^T */
    qc_dec_norm_quantize(P.x, P.dim, P.eps, xf, wf, xs_qs, xs_ds, norm_tmp);
    qc_dec_rows(P.output, P.n_vocab, P.dim, xs, P.logits, false, slice_sum);
}

/* ---------------------------------------------------------------------------------------- */
/* the launcher */

/* Shared memory of a block: x, the norm weight and the quantized x of dim values, or attention's
 * groups. */
static size_t dec_smem_bytes(const qc_decode_plan *p) {
    const size_t xq = 2 * (size_t)p->dim * sizeof(float) + qc_q8x_bytes(1, p->dim);
    const int groups = QC_ATT_SPLIT_THREADS / qc_att_group_lanes(p->head_dim);
    const size_t att = (size_t)groups * (size_t)(2 + p->head_dim) * sizeof(float);
    return xq > att ? xq : att;
}

template <int G, typename KV>
static const void *dec_kernel(void) {
    return (const void *)qc_decode_step_kernel<G, KV>;
}

/* The kernel for this plan's head_dim and cache type, or NULL. */
static const void *dec_kernel_for(const qc_decode_plan *p) {
    const int f16 = p->layers[0].kv.type == QC_KV_F16;
    constexpr int G64 = qc_att_group_lanes(64), G128 = qc_att_group_lanes(128);
    if (p->head_dim == 64) return f16 ? dec_kernel<G64, __half>() : dec_kernel<G64, float>();
    if (p->head_dim == 128) return f16 ? dec_kernel<G128, __half>() : dec_kernel<G128, float>();
    return NULL;
}

/* Blocks of the grid: QC_DEC_BLOCKS_PER_SM on every SM, all resident at once (the cooperative
 * launch guarantees it), so the grid barrier never waits on a block never scheduled; 0 where
 * that many do not fit. */
static int dec_grid(qc_backend *be, const qc_decode_plan *p, int *blocks) {
    int per_sm = 0;
    *blocks = 0;
    if (QC_CUDA(be, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dec_kernel_for(p), QC_DEC_THREADS,
                                                                  dec_smem_bytes(p))) < 0)
        return -1;
    /* always the same grid: the barrier's count stays a multiple of it between launches */
    *blocks = per_sm >= QC_DEC_BLOCKS_PER_SM ? QC_DEC_BLOCKS_PER_SM * qc_cuda_of(be)->sm_count : 0;
    return 0;
}

static int q8_weight(qc_backend *be, const qc_weight *w) {
    return qc_cuda_gemv_q8(be, w->type, w->cols);
}

int qc_cuda_decode_step_takes(qc_backend *be, const qc_decode_plan *p, int n_kv) {
    qc_cuda *cu = qc_cuda_of(be);
    const int q_dim = p->n_head * p->head_dim;
    if (!cu->coop_launch || p->n_layer < 1 || p->n_layer > QC_DEC_MAX_LAYERS || p->n_head_kv < 1 ||
        p->n_head % p->n_head_kv != 0 || (p->head_dim != 64 && p->head_dim != 128) ||
        p->dim % 32 != 0 || p->dim > QC_NORM_FUSE_MAX_COLS || p->ffn_dim % 32 != 0 ||
        p->ffn_dim > QC_Q8X_MAX_COLS || q_dim > QC_Q8X_MAX_COLS || !qc_att_split_fits(1, p->n_head, p->head_dim) ||
        !q8_weight(be, p->output))
        return 0;
    const int kv_type = p->layers[0].kv.type;
    if (!qc_cuda_attention_splits(be, kv_type, 1, n_kv, p->n_head, p->head_dim)) return 0;
    for (int l = 0; l < p->n_layer; l++) {
        const qc_decode_layer *L = &p->layers[l];
        if (L->kv.type != kv_type || !q8_weight(be, L->wq) || !q8_weight(be, L->wk) || !q8_weight(be, L->wv) ||
            !q8_weight(be, L->wo) || !q8_weight(be, L->w_gate) || !q8_weight(be, L->w_up) || !q8_weight(be, L->w_down))
            return 0;
    }
    int blocks = 0;
    if (dec_grid(be, p, &blocks) < 0) {
        be->err.kind = QC_OK;   /* not an error of the step: it runs op by op */
        return 0;
    }
    return blocks > 0;
}

static qc_dec_w dec_w(const qc_weight *w) {
    return qc_dec_w{(const uint8_t *)w->data, (int64_t)qc_row_bytes(w->type, w->cols), w->type};
}

int qc_cuda_decode_step(qc_backend *be, const qc_decode_plan *p) {
    qc_cuda *cu = qc_cuda_of(be);
    /* the caller asked decode_step_takes first; these guard the parameter block itself */
    if (p->n_layer < 1 || p->n_layer > QC_DEC_MAX_LAYERS || dec_kernel_for(p) == NULL)
        return qc_cuda_value_error(be, "decode_step: %d layers of head_dim %d are not served", p->n_layer, p->head_dim);
    /* 18 KB at 80 layers: on the heap; the launch copies it */
    qc_dec_params *params = (qc_dec_params *)calloc(1, sizeof *params);
    if (params == NULL) return qc_fail(&be->err, QC_ERR_NOMEM, "decode_step: out of memory");
    qc_dec_params &P = *params;
    P.n_layer = p->n_layer;
    P.dim = p->dim;
    P.q_dim = p->n_head * p->head_dim;
    P.kv_dim = p->n_head_kv * p->head_dim;
    P.ffn = p->ffn_dim;
    P.n_head = p->n_head;
    P.n_head_kv = p->n_head_kv;
    P.head_dim = p->head_dim;
    P.eps = p->norm_eps;
    P.att_scale = 1.0f / sqrtf((float)p->head_dim);
    P.theta = (double)p->rope_theta;
    P.n_vocab = p->output->rows;
    P.output = dec_w(p->output);
    P.output_norm = p->output_norm;
    P.pos = p->pos;
    P.x = p->x;
    P.q = p->q;
    P.att = p->att;
    P.act = p->act;
    P.logits = p->logits;
    /* the 8-bit att and act in the backend's q8 buffer, one after the other (so it no longer
     * holds what an op left there for the next) */
    cu->q8x_of = NULL;
    char *q8 = (char *)cu->q8x;
    P.att_qs = (int8_t *)q8;
    P.att_ds = qc_q8x_ds_at(q8, 1, P.q_dim);
    q8 += qc_q8x_bytes(1, QC_Q8X_MAX_COLS);
    P.act_qs = (int8_t *)q8;
    P.act_ds = qc_q8x_ds_at(q8, 1, P.ffn);
    P.attn_part = cu->attn_part;
    P.attn_done = cu->attn_done;
    P.act_done = cu->dec_sync + QC_DEC_SYNC_BARRIER;
    P.barrier = (unsigned long long *)cu->dec_sync;
    for (int l = 0; l < p->n_layer; l++) {
        const qc_decode_layer *L = &p->layers[l];
        qc_dec_layer *D = &P.layer[l];
        D->q = dec_w(L->wq);
        D->k = dec_w(L->wk);
        D->v = dec_w(L->wv);
        D->o = dec_w(L->wo);
        D->gate = dec_w(L->w_gate);
        D->up = dec_w(L->w_up);
        D->down = dec_w(L->w_down);
        D->bq = L->bq;
        D->bk = L->bk;
        D->bv = L->bv;
        D->attn_norm = L->attn_norm;
        D->ffn_norm = L->ffn_norm;
        D->k_cache = L->kv.k;
        D->v_cache = L->kv.v;
    }
    int blocks = 0;
    if (dec_grid(be, p, &blocks) < 0 || blocks < 1) {
        free(params);
        return blocks < 1 && be->err.kind == QC_OK ? qc_cuda_value_error(be, "decode_step: no block fits on an SM") : -1;
    }
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;   /* every block resident, or the launch fails */
    attr[0].val.cooperative = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3(QC_DEC_THREADS);
    cfg.dynamicSmemBytes = dec_smem_bytes(p);
    cfg.stream = cu->stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    void *args[] = {params};
    const cudaError_t e = cudaLaunchKernelExC(&cfg, dec_kernel_for(p), args);
    free(params);
    return QC_CUDA(be, e);
}
