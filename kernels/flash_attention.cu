/* flash_attention.cu: causal GQA attention over an F16 KV cache on tensor cores (FlashAttention-2's
 * loop), for the evals that capture no scores or probabilities.
 *
 * Rows are (token, query head) pairs of one KV head: row r of KV head kvh is token r / G, query
 * head kvh * G + r % G (G = n_head / n_head_kv), so the query heads that share a KV head share
 * every K/V tile a block loads. A block takes 16 * WARPS rows (16 per warp) and walks the key
 * tiles (QC_FA_BC keys each) up to the largest position among its rows; tiles past a row's own
 * position are masked element by element, tiles past every row's are never loaded.
 *
 * Per tile and warp, with mma.sync m16n8k16 (f16 inputs, fp32 accumulation):
 *   S = Q K^T (16 x QC_FA_BC), scaled by log2(e) / sqrt(head_dim), masked (key > pos: -inf);
 *   online softmax per row: m = max(m, rowmax S), P = 2^(S - m), l = l 2^(m_old - m) + rowsum P,
 *   O = O 2^(m_old - m) + P V, where P is rounded to f16 (it is the A operand of the second mma,
 *   taken straight from S's accumulator registers: the two fragment layouts line up).
 * q is fp32 in memory and rounded to f16 as it is staged; K and V tiles come in by cp.async,
 * double-buffered, so the next tile loads while this one is multiplied. Keys past the last
 * position any row needs are zero-filled, never read (no NaN from unwritten cache rows, no
 * read past the cache).
 *
 * Decode and short evals (n <= QC_GEMV_MAX_TOKENS) have few rows: the key tiles are dealt to
 * SPLITS blocks of KW warps (warp w of block z takes tiles z * KW + w, then every SPLITS * KW),
 * each warp with K/V buffers of its own; the block's warps merge through shared memory, and
 * each block writes its rows' partial (m, l, O) to cu->attn_part; the launch after it merges
 * them, a warp a block of 32 outputs (qc_flash_merge_kernel, below; QWENCUDA_FLASH_MERGE=tail:
 * the last block of a row tile to finish (cu->attn_done) merges, as attention.cu's split-K
 * kernel does). SPLITS is a template constant so that the merge's loads of every split's
 * partial are issued together (unrolled), not one L2 round trip after another. The grid depends
 * on the shapes only, never on the positions (read from device memory), so the decode step
 * replays as a CUDA graph.
 *
 * Measured and not kept (H200, real file, one lease, 2026-12-04; report 20261204-2b650a3-*): a
 * decode step past QC_KV_SHORT keys runs seven launches a layer where the one-launch attention's
 * runs three (qkv_attention.cu's fallback: the fold's sum_add, the norm, q/k/v with RoPE, this
 * kernel, the quantization of its output, the o projection, the fold), so (1) the merge here
 * also wrote its output's 8-bit form for the o projection (qc_q8_quantize_block, a warp a block of
 * 32; cu->q8x_of) and (2) the norm's launch added the fold's sums (x_out of
 * qc_cuda_norm_quantize_q8) instead of a sum_add launch before it: 126 launches a step, not 173.
 * The step's time did not move: 650.4 us against 651.6 at 8704 keys (profile_decode.py
 * timeline), this kernel's share of it 233.4 -> 298.8 us where the launches left; decode 1496.9,
 * 1494.3, 1503.0 tok/s at 8704 keys against 1494.1, 1504.1, 1500.4, and 1429.2, 1425.9, 1434.5 at
 * 16896 against 1421.4, 1418.2, 1423.6. What the step waits for at long contexts is this kernel:
 * 64 blocks (2 KV heads x 32 splits) of 128 threads, 9.7 us a layer at 8704 keys and 11.1 at
 * 16896, whose 2.2-4.3 MB of keys and values a layer take HBM about 1 us. Its last block's merge
 * was most of that: qc_flash_merge_kernel's comment. */
#include "qc_cuda.cuh"
#include "qc_gemv_q8.cuh"

#define QC_FA_BC 64                /* keys per tile */
#define QC_FA_PREFILL_WARPS 4      /* 64 rows per block, one warp per 16 rows */
#define QC_FA_DECODE_WARPS 1       /* 16 rows: one token's query heads of a KV head ... */
#define QC_FA_DECODE_KW(D) ((D) == 64 ? 4 : 2)   /* ... and this many warps walking its key tiles */
/* Key splits of a decode step (a compile-time count: the merge's loads unroll). Measured on an
 * H100 (0.5B Q4_K_M, decode tok/s at depth 4097 / 16385, splits x key warps): 128 x 2 666 / 631,
 * 64 x 4 817 / 751, 32 x 4 814..861 / 759..794, 16 x 4 878 / 759, 8 x 4 861 / 684: fewer
 * splits means fewer partials for the last block to merge, too few leave SMs idle.
 * On the H200 (real file, three alternating rounds a variant in one lease against 32 x 4,
 * 2026-12-04; report 20261204-1ebaa91-*-ab): 16 x 4 1499.0-1502.8 tok/s at 8704 keys against
 * 1528.7-1532.1 and 1357.5-1373.5 at 16896 against 1449.3-1455.7 (-2%, -6%); 64 x 4 (its
 * merge staged in shared memory: the note at the merge) 1432.1-1439.4 against 1517.6-1527.3 and
 * 1361.2-1365.9 against 1446.3-1457.6 (-6%, -6%). Neither kept. */
#define QC_FA_SPLITS 32

/* ---- tensor-core and copy primitives (sm_80+) ------------------------------------------- */

/* d (16x8 fp32) += a (16x16 f16, row-major fragment) * b (16x8 f16, column fragment) */
__device__ __forceinline__ void qc_mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 f16 matrices from shared memory, transposed: lane L names row L % 8 of matrix L / 8. */
__device__ __forceinline__ void qc_ldmatrix_x4_trans(uint32_t (&r)[4], const __half *row) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* 16 bytes global -> shared without registers; src_bytes 0 zero-fills (nothing is read). */
__device__ __forceinline__ void qc_cp_async16(void *smem, const void *gmem, int src_bytes) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void qc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void qc_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t qc_pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

/* ---- the kernel ------------------------------------------------------------------------- */

/* A warp's partial softmax state of its two fragment rows ra and rb: row r at base + r * (D + 2)
 * holds (m, l, O[D]); each lane writes the O columns it holds (2c, 2c + 1 of every 8). */
template <int D>
__device__ __forceinline__ void qc_fa_put_rows(float *base, int ra, int rb, int c, float m_a, float m_b,
                                               float l_a, float l_b, const float (&o)[D / 8][4]) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        float *p = base + (int64_t)(half ? rb : ra) * (D + 2);
        if (c == 0) {
            p[0] = half ? m_b : m_a;
            p[1] = half ? l_b : l_a;
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            p[2 + dt * 8 + 2 * c] = o[dt][2 * half];
            p[2 + dt * 8 + 2 * c + 1] = o[dt][2 * half + 1];
        }
    }
}

/* Shared memory: Q (R rows), then per key warp two buffers of K and two of V (QC_FA_BC rows
 * each), every row D + 8 halves: the padding puts the 8 rows an mma fragment reads in 8
 * different bank groups. WARPS warps take 16 rows each (R = 16 * WARPS); KW warps walk the keys
 * (KW > 1 only with WARPS = 1). */
template <int D, int WARPS, int KW>
struct qc_fa_smem {
    static constexpr int R = 16 * WARPS;
    static constexpr int LD = D + 8;
    static constexpr int THREADS = 32 * WARPS * KW;
    static constexpr size_t q_halves = (size_t)R * LD;
    static constexpr size_t tile_halves = (size_t)QC_FA_BC * LD;
    static constexpr size_t warp_halves = 4 * tile_halves;    /* K and V, double-buffered */
    static constexpr size_t bytes = (q_halves + KW * warp_halves) * sizeof(__half);
};

/* EARLY (decode's split blocks): each key warp's first tile, where all its keys are below the
 * position of the block's first token (earlier evals wrote them: qc_cuda.cuh's PDL rule, as
 * qc_attention.cuh's held keys), is asked for before qc_grid_start, so that its HBM round trip
 * runs under the kernel before (q, k and v with RoPE) instead of after the wait. The same tiles
 * in the same buffers: the same bits. Why: past QC_KV_SHORT keys the step waits on this kernel,
 * about 10 us a layer for 2-4 MB of keys and values (report 20261204-2b650a3-*), and at 8704
 * keys a key warp walks one or two tiles, the first of them after the wait.
 * Measured (H200, real file, 1ebaa91 with QWENCUDA_FLASH_EARLY=1 against without, three
 * alternating rounds in one lease, 2026-12-04; report 20261204-1ebaa91-*-ab): 1532.2-1537.9
 * tok/s at 8704 keys against 1521.1-1525.3, 1456.2-1457.8 at 16896 against 1448.8-1454.7
 * (+0.7%, +0.3%): the decode's default since (cu->flash_early; QWENCUDA_FLASH_EARLY=0 at
 * creation, to compare). */
template <int D, int WARPS, int SPLITS, int KW, bool EARLY = false, bool TAIL = false>
__global__ void __launch_bounds__(32 * WARPS * KW)
qc_flash_attention_kernel(const float *__restrict__ q, const __half *__restrict__ k_cache,
                          const __half *__restrict__ v_cache, const int32_t *__restrict__ pos,
                          int n, int n_head, int n_head_kv, float scale_log2,
                          float *__restrict__ out, float *__restrict__ part,
                          unsigned int *__restrict__ done) {
    using L = qc_fa_smem<D, WARPS, KW>;
    constexpr int R = L::R, LD = L::LD, NT = QC_FA_BC / 8, KS = D / 16, DT = D / 8, NTH = L::THREADS;
    static_assert(KW == 1 || (WARPS == 1 && SPLITS > 1), "key warps: one row warp, split blocks");
    extern __shared__ __align__(16) __half fa_smem[];
    __half *Qs = fa_smem;
    const int tid = threadIdx.x, lane = tid & 31;
    /* a row warp (its 16 rows) and a key warp (its tiles and buffers) */
    const int warp = KW == 1 ? tid >> 5 : 0, kw = KW == 1 ? 0 : tid >> 5;
    __half *Ks = Qs + L::q_halves + kw * L::warp_halves;   /* [2][QC_FA_BC][LD] of this key warp */
    __half *Vs = Ks + 2 * L::tile_halves;                  /* [2][QC_FA_BC][LD] */
    __shared__ bool last_block;
    static_assert(!EARLY || (KW > 1 && SPLITS > 1), "EARLY: decode's split blocks");
    if constexpr (!EARLY) qc_grid_start();

    const int g = lane >> 2, c = lane & 3;      /* fragment row group and column pair */
    const int G = n_head / n_head_kv, kv_dim = n_head_kv * D;
    const int total_rows = n * G;
    const int n_rt = gridDim.x, rt = n_rt - 1 - blockIdx.x;   /* the longest row tiles first */
    const int kvh = blockIdx.y, split = blockIdx.z, splits = SPLITS;
    /* the threads that share K/V buffers: the block (KW = 1) or one warp */
    const int ltid = KW == 1 ? tid : lane, lthreads = KW == 1 ? NTH : 32;
    const int row0 = rt * R;

    /* the keys this block needs: 0 .. pos of its last token (positions grow with the token);
     * (positions: uploaded by copies or fed by the step before, readable before the wait) */
    const int kmax = pos[(min(row0 + R, total_rows) - 1) / G];
    const int n_tiles = kmax / QC_FA_BC + 1;
    const __half *kbase = k_cache + (int64_t)kvh * D, *vbase = v_cache + (int64_t)kvh * D;

    /* stage Q (f16): q is the kernel before's, so after the wait (EARLY: below) */
    auto stage_q = [&]() {
        for (int i = tid; i < R * (D / 2); i += NTH) {
            const int rr = i / (D / 2), d = 2 * (i % (D / 2)), r = row0 + rr;
            float2 v = make_float2(0.0f, 0.0f);
            if (r < total_rows) {
                const int t = r / G, h = kvh * G + r % G;
                v = *reinterpret_cast<const float2 *>(q + ((int64_t)t * n_head + h) * D + d);
            }
            *reinterpret_cast<__half2 *>(Qs + rr * LD + d) = __floats2half2_rn(v.x, v.y);
        }
    };
    if constexpr (!EARLY) stage_q();

    /* one tile of K and V into buffer b; keys past kmax are zero-filled */
    auto load_tile = [&](int tile, int b) {
        __half *ks = Ks + b * L::tile_halves, *vs = Vs + b * L::tile_halves;
        for (int i = ltid; i < QC_FA_BC * (D / 8); i += lthreads) {
            const int kr = i / (D / 8), d = 8 * (i % (D / 8)), j = tile * QC_FA_BC + kr;
            const bool ok = j <= kmax;
            const int64_t off = ok ? (int64_t)j * kv_dim + d : 0;
            qc_cp_async16(ks + kr * LD + d, kbase + off, ok ? 16 : 0);
            qc_cp_async16(vs + kr * LD + d, vbase + off, ok ? 16 : 0);
        }
    };

    int tile = split * KW + kw;
    const int stride = SPLITS * KW;
    /* EARLY: the first tile before the wait where every key of it is below the first row's
     * position (no kernel of this eval writes those) */
    const bool first_early = EARLY && tile < n_tiles && (tile + 1) * QC_FA_BC <= pos[row0 / G];
    if (first_early) load_tile(tile, 0);
    if constexpr (EARLY) {
        qc_grid_start();
        stage_q();
    }
    if (!first_early && tile < n_tiles) load_tile(tile, 0);
    qc_cp_async_commit();
    __syncthreads();   /* Q staged */

    /* this warp's Q fragments, and its two rows' limits (-1: no such row, every key masked) */
    uint32_t qa[KS][4];
    const int ra = warp * 16 + g, rb = ra + 8;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const int k0 = ks * 16 + 2 * c;
        qa[ks][0] = *reinterpret_cast<const uint32_t *>(Qs + ra * LD + k0);
        qa[ks][1] = *reinterpret_cast<const uint32_t *>(Qs + rb * LD + k0);
        qa[ks][2] = *reinterpret_cast<const uint32_t *>(Qs + ra * LD + k0 + 8);
        qa[ks][3] = *reinterpret_cast<const uint32_t *>(Qs + rb * LD + k0 + 8);
    }
    const int lim_a = row0 + ra < total_rows ? pos[(row0 + ra) / G] : -1;
    const int lim_b = row0 + rb < total_rows ? pos[(row0 + rb) / G] : -1;

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

    for (int b = 0; tile < n_tiles; tile += stride, b ^= 1) {
        const int next = tile + stride;
        if (next < n_tiles) load_tile(next, b ^ 1);
        qc_cp_async_commit();
        qc_cp_async_wait<1>();   /* this tile's group is complete; the next one may be in flight */
        if (KW == 1) __syncthreads(); else __syncwarp();
        const __half *ks = Ks + b * L::tile_halves, *vs = Vs + b * L::tile_halves;

        /* S = Q K^T */
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                const __half *kp = ks + (nt * 8 + g) * LD + kk * 16 + 2 * c;
                qc_mma_f16(s[nt], qa[kk], *reinterpret_cast<const uint32_t *>(kp),
                           *reinterpret_cast<const uint32_t *>(kp + 8));
            }
        }

        /* scale, mask, row maxima (a row's values sit in the 4 lanes of its quad) */
        float mx_a = -INFINITY, mx_b = -INFINITY;
        const int j0 = tile * QC_FA_BC + 2 * c;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = j0 + nt * 8 + (e & 1);
                const float v = (j <= (e < 2 ? lim_a : lim_b)) ? s[nt][e] * scale_log2 : -INFINITY;
                s[nt][e] = v;
                if (e < 2) mx_a = fmaxf(mx_a, v);
                else mx_b = fmaxf(mx_b, v);
            }
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
        }
        const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        /* a row with no key yet keeps m = -inf; subtracting 0 then gives p = 0, corr = 0 */
        const float base_a = new_a == -INFINITY ? 0.0f : new_a;
        const float base_b = new_b == -INFINITY ? 0.0f : new_b;
        const float corr_a = exp2f(m_a - base_a), corr_b = exp2f(m_b - base_b);
        m_a = new_a;
        m_b = new_b;
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][0] = exp2f(s[nt][0] - base_a);
            s[nt][1] = exp2f(s[nt][1] - base_a);
            s[nt][2] = exp2f(s[nt][2] - base_b);
            s[nt][3] = exp2f(s[nt][3] - base_b);
            sum_a += s[nt][0] + s[nt][1];
            sum_b += s[nt][2] + s[nt][3];
        }
        l_a = l_a * corr_a + sum_a;   /* this lane's share; the quad adds up at the end */
        l_b = l_b * corr_b + sum_b;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= corr_a;
            o[dt][1] *= corr_a;
            o[dt][2] *= corr_b;
            o[dt][3] *= corr_b;
        }

        /* O += P V: P's A fragment for keys 16kk.. is S's accumulators of n-tiles 2kk, 2kk+1 */
#pragma unroll
        for (int kk = 0; kk < QC_FA_BC / 16; kk++) {
            const uint32_t pa[4] = {qc_pack_half2(s[2 * kk][0], s[2 * kk][1]),
                                    qc_pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                    qc_pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    qc_pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int mat = lane >> 3;   /* ldmatrix: matrices (keys +0/+8) x (dims +0/+8) */
            const __half *vrow = vs + (kk * 16 + (mat & 1) * 8 + (lane & 7)) * LD + (mat >> 1) * 8;
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                uint32_t vb[4];
                qc_ldmatrix_x4_trans(vb, vrow + dt * 8);
                qc_mma_f16(o[dt], pa, vb[0], vb[1]);
                qc_mma_f16(o[dt + 1], pa, vb[2], vb[3]);
            }
        }
        /* every thread is done with buffer b before it is refilled */
        if (KW == 1) __syncthreads(); else __syncwarp();
    }
    qc_cp_async_wait<0>();

#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
    }

    if constexpr (KW > 1) {
        /* the key warps' (m, l, O) into key warp 0's registers: each warp leaves its rows in its
         * own (now idle) K buffer, [16][D + 2] floats, at the fragment positions it holds */
        qc_fa_put_rows<D>(reinterpret_cast<float *>(Ks), ra, rb, c, m_a, m_b, l_a, l_b, o);
        __syncthreads();
        if (kw == 0) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int r = half ? rb : ra;
                float M = half ? m_b : m_a;
                for (int w = 1; w < KW; w++)
                    M = fmaxf(M, reinterpret_cast<const float *>(Qs + L::q_halves + w * L::warp_halves)[r * (D + 2)]);
                const float base = M == -INFINITY ? 0.0f : M;
                float scale0 = exp2f((half ? m_b : m_a) - base);
                float lsum = (half ? l_b : l_a) * scale0;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    o[dt][2 * half] *= scale0;
                    o[dt][2 * half + 1] *= scale0;
                }
                for (int w = 1; w < KW; w++) {
                    const float *p = reinterpret_cast<const float *>(Qs + L::q_halves + w * L::warp_halves) + r * (D + 2);
                    const float sw = exp2f(p[0] - base);
                    lsum = fmaf(p[1], sw, lsum);
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        o[dt][2 * half] = fmaf(p[2 + dt * 8 + 2 * c], sw, o[dt][2 * half]);
                        o[dt][2 * half + 1] = fmaf(p[2 + dt * 8 + 2 * c + 1], sw, o[dt][2 * half + 1]);
                    }
                }
                if (half) { m_b = M; l_b = lsum; } else { m_a = M; l_a = lsum; }
            }
        }
    }

    if constexpr (SPLITS == 1) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = row0 + (half ? rb : ra);
            const float l = half ? l_b : l_a;
            if (r >= total_rows || l <= 0.0f) continue;
            const float inv = 1.0f / l;
            float *orow = out + ((int64_t)(r / G) * n_head + kvh * G + r % G) * D;
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                *reinterpret_cast<float2 *>(orow + dt * 8 + 2 * c) =
                    make_float2(o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv);
        }
    } else {
        /* split: publish (m, l, O) of both rows (key warp 0 holds the block's); the merge is
         * the next launch's (qc_flash_merge_kernel), or with TAIL the last block's to count */
        const int64_t pair = (int64_t)kvh * n_rt + rt;
        if (kw == 0)
            qc_fa_put_rows<D>(part + (pair * splits + split) * (int64_t)R * (D + 2), ra, rb, c, m_a, m_b,
                              l_a, l_b, o);
        if constexpr (!TAIL) return;
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            last_block = atomicAdd(&done[pair], 1u) == (unsigned)splits - 1;
            if (last_block) done[pair] = 0;   /* ready for the next launch */
        }
        __syncthreads();
        if (!last_block) return;
        __threadfence();

        /* weights 2^(m_s - M) / L per row and split, in the (now idle) K buffers: LPR lanes per row,
         * each over SPL splits, every load of a lane issued at once.
         * Measured and not kept (H200, real file, three alternating rounds in one lease,
         * 2026-12-04; report 20261204-1ebaa91-*-ab): the row tile's partials staged into the idle
         * K/V buffers first by one round of cp.async (CH rows of every split at a time, even rows
         * so that every 16-byte piece lines up), then both passes from shared memory, the same
         * bits, so that the merge waits one L2 round trip, not three: 1514.7-1520.4 tok/s at 8704
         * keys against 1520.9-1528.7, 1434.7-1439.5 at 16896 against 1440.6-1444.8 (-0.4%). (A guess
         * at why: the block's 59 KB come into one SM either way.) */
        constexpr int LPR = NTH / R, SPL = SPLITS / LPR;
        static_assert(LPR >= 1 && (LPR & (LPR - 1)) == 0 && SPLITS % LPR == 0, "lanes per merged row");
        static_assert(R * SPLITS <= QC_FA_BC * LD, "the merge weights fit in the K buffers");
        const float *all = part + pair * SPLITS * (int64_t)R * (D + 2);
        float *w = reinterpret_cast<float *>(Qs + L::q_halves);   /* [R][SPLITS], over key warp 0's K */
        {
            const int rr = tid / LPR, s0 = (tid % LPR) * SPL;
            float ms[SPL], ls[SPL];
#pragma unroll
            for (int i = 0; i < SPL; i++) {
                ms[i] = __ldcg(all + ((int64_t)(s0 + i) * R + rr) * (D + 2));
                ls[i] = __ldcg(all + ((int64_t)(s0 + i) * R + rr) * (D + 2) + 1);
            }
            float M = -INFINITY;
#pragma unroll
            for (int i = 0; i < SPL; i++) M = fmaxf(M, ms[i]);
#pragma unroll
            for (int off = 1; off < LPR; off <<= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
            float Lsum = 0.0f;
#pragma unroll
            for (int i = 0; i < SPL; i++) {
                ms[i] = ms[i] == -INFINITY ? 0.0f : exp2f(ms[i] - M);
                Lsum = fmaf(ms[i], ls[i], Lsum);
            }
#pragma unroll
            for (int off = 1; off < LPR; off <<= 1) Lsum += __shfl_xor_sync(0xffffffffu, Lsum, off);
            const float inv = Lsum > 0.0f ? 1.0f / Lsum : 0.0f;
#pragma unroll
            for (int i = 0; i < SPL; i++) w[rr * SPLITS + s0 + i] = ms[i] * inv;
        }
        __syncthreads();
        const int valid = min(R, total_rows - row0);
#pragma unroll 2
        for (int i = tid; i < valid * D; i += NTH) {
            const int rr = i / D, d = i % D, r = row0 + rr;
            float acc = 0.0f;
#pragma unroll
            for (int s2 = 0; s2 < SPLITS; s2++)
                acc = fmaf(__ldcg(all + ((int64_t)s2 * R + rr) * (D + 2) + 2 + d), w[rr * SPLITS + s2], acc);
            out[((int64_t)(r / G) * n_head + kvh * G + r % G) * D + d] = acc;
        }
    }
}

/* ---- the merge of a decode's splits ------------------------------------------------------
 * One warp a block of 32 output values (a token's query head, columns 32c .. 32c + 31): lane s
 * loads split s's (m, l) of the row, and every lane its column of every split's O, all at once
 * (one L2 round trip); the weights 2^(m_s - M) / L go round the warp by shuffles. For one token
 * the warp also leaves its block's 8-bit form (qc_q8_quantize_block on the same values:
 * qc_quantize_q8_kernel's bits) for the o projection (cu->q8x_of), so the step launches no
 * quantization after it.
 * Why a launch of its own: step stamps of the flash decode (H200, real file, 8704 keys, 2026-12-04;
 * report 20261204-1ebaa91-*-ab, medians a layer) put its blocks' keys walked 2.2 us after their
 * release, their split counted 4.0 us after it, and the last block's merge (three L2 round
 * trips one after another, one block a KV head) ending 3-4 us after that, 8.8 us from the
 * first release to the last end, while the step waited; the 8-bit quantization launched after
 * it took 0.6 us more. Here 28 warps (0.5B) merge in parallel once the flash blocks end, with
 * no count and no fence.
 * Measured (same lease, three alternating rounds against 1ebaa91): 1771.0-1784.7 tok/s at 8704
 * keys against 1516.0-1524.6 (+17%), 1654.9-1676.2 at 16896 against 1432.2-1447.7 (+16%); 512
 * and 2560 keys (the one-launch attention) even. Stamped, the step 672.6 -> 581.4 us at 8704
 * keys: the flash kernel's share of a layer 9.34 -> 5.22 us, this launch's 2.56 where the
 * quantization's was 2.53. */
#define QC_FA_MERGE_WARPS 4
template <int D, int SPLITS>
__global__ void __launch_bounds__(32 * QC_FA_MERGE_WARPS)
qc_flash_merge_kernel(const float *__restrict__ part, int n, int n_head, int n_head_kv, int n_rt,
                      float *__restrict__ out, int8_t *out_qs, float2 *out_ds) {
    static_assert(SPLITS <= 32 && D % 32 == 0, "a split a lane, a block of 32 columns a warp");
    constexpr int R = 16 * QC_FA_DECODE_WARPS, RS = D + 2, CHUNKS = D / 32;
    qc_grid_start();
    const int lane = threadIdx.x & 31;
    const int64_t b = (int64_t)blockIdx.x * QC_FA_MERGE_WARPS + (threadIdx.x >> 5);   /* out[32 b ..] */
    if (b >= (int64_t)n * n_head * CHUNKS) return;
    const int per_token = n_head * CHUNKS;
    const int t = (int)(b / per_token), h = (int)(b % per_token) / CHUNKS, chunk = (int)(b % CHUNKS);
    const int G = n_head / n_head_kv, kvh = h / G, r = t * G + h % G;
    /* row r % R of row tile r / R of KV head kvh, in split s at rows + s * R * RS */
    const float *rows = part + ((int64_t)(kvh * n_rt + r / R) * SPLITS * R + r % R) * RS;
    const float m = lane < SPLITS ? __ldcg(rows + (int64_t)lane * R * RS) : -INFINITY;
    const float l = lane < SPLITS ? __ldcg(rows + (int64_t)lane * R * RS + 1) : 0.0f;
    float v[SPLITS];
#pragma unroll
    for (int s2 = 0; s2 < SPLITS; s2++) v[s2] = __ldcg(rows + (int64_t)s2 * R * RS + 2 + 32 * chunk + lane);
    float M = m;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    const float w = m == -INFINITY ? 0.0f : exp2f(m - M);
    const float L = qc_norm_warp_sum(w * l);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (int s2 = 0; s2 < SPLITS; s2++) acc = fmaf(v[s2], __shfl_sync(0xffffffffu, w, s2) * inv, acc);
    out[32 * b + lane] = acc;
    if (out_qs) qc_q8_quantize_block(acc, lane, out_qs + 32 * b, out_ds + b);
}

/* ---- launch ----------------------------------------------------------------------------- */

/* Row tiles of R rows of a KV head's n * (n_head / n_head_kv) rows: the grid's x, the merge's
 * and the partials' count. */
static int64_t row_tiles(int n, int n_head, int n_head_kv, int64_t R) {
    return ((int64_t)n * (n_head / n_head_kv) + R - 1) / R;
}

template <int D, int WARPS, int SPLITS, int KW, bool EARLY = false, bool TAIL = false>
static int launch_flash(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos, int n,
                        int n_head, int n_head_kv, float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    using L = qc_fa_smem<D, WARPS, KW>;
    const int64_t n_rt = row_tiles(n, n_head, n_head_kv, L::R);
    if (n_rt > INT32_MAX || n_head_kv > 65535)
        return qc_cuda_value_error(be, "attention: %lld rows per KV head is too many",
                                   (long long)n * (n_head / n_head_kv));
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    const dim3 grid((unsigned)n_rt, (unsigned)n_head_kv, SPLITS);
    qc_launch(cu, qc_flash_attention_kernel<D, WARPS, SPLITS, KW, EARLY, TAIL>, grid, dim3(L::THREADS), L::bytes, q,
              (const __half *)cache.k, (const __half *)cache.v, pos, n, n_head, n_head_kv, scale_log2, out,
              cu->attn_part, cu->attn_done);
    return QC_LAUNCHED(be, "qc_flash_attention_kernel");
}

/* A decode step's split kernel at head_dim D, its first tiles before the wait (EARLY) or after
 * it (cu->flash_early 0), then the merge (qc_flash_merge_kernel, with the 8-bit form where out_qs
 * is not NULL: 1 returned), or the last block's merge (cu->flash_tail: 0 returned). */
template <int D>
static int launch_decode(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos, int n, int n_head,
                         int n_head_kv, float *out, int8_t *out_qs, float2 *out_ds) {
    qc_cuda *cu = qc_cuda_of(be);
    constexpr int KW = QC_FA_DECODE_KW(D), W = QC_FA_DECODE_WARPS, S = QC_FA_SPLITS;
    if (cu->flash_tail)
        return cu->flash_early ? launch_flash<D, W, S, KW, true, true>(be, q, cache, pos, n, n_head, n_head_kv, out)
                               : launch_flash<D, W, S, KW, false, true>(be, q, cache, pos, n, n_head, n_head_kv, out);
    if ((cu->flash_early ? launch_flash<D, W, S, KW, true>(be, q, cache, pos, n, n_head, n_head_kv, out)
                         : launch_flash<D, W, S, KW>(be, q, cache, pos, n, n_head, n_head_kv, out)) < 0)
        return -1;
    const int64_t n_rt = row_tiles(n, n_head, n_head_kv, 16 * W);
    const int64_t warps = (int64_t)n * n_head * (D / 32);
    qc_launch(cu, qc_flash_merge_kernel<D, S>, dim3((unsigned)((warps + QC_FA_MERGE_WARPS - 1) / QC_FA_MERGE_WARPS)),
              dim3(32 * QC_FA_MERGE_WARPS), 0, (const float *)cu->attn_part, n, n_head, n_head_kv, (int)n_rt, out,
              out_qs, out_ds);
    if (QC_LAUNCHED(be, "qc_flash_merge_kernel") < 0) return -1;
    return out_qs != nullptr;
}

/* More than 48 KiB of dynamic shared memory must be allowed per kernel, once, outside any graph
 * capture: at backend creation. */
template <int D, int WARPS, int SPLITS, int KW, bool EARLY = false, bool TAIL = false>
static int allow_smem(qc_backend *be) {
    return QC_CUDA(be, cudaFuncSetAttribute(qc_flash_attention_kernel<D, WARPS, SPLITS, KW, EARLY, TAIL>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)qc_fa_smem<D, WARPS, KW>::bytes));
}

/* every decode variant of head_dim D */
template <int D>
static int allow_decode_smem(qc_backend *be) {
    constexpr int KW = QC_FA_DECODE_KW(D), W = QC_FA_DECODE_WARPS, S = QC_FA_SPLITS;
    if (allow_smem<D, W, S, KW>(be) < 0 || allow_smem<D, W, S, KW, true>(be) < 0) return -1;
    return allow_smem<D, W, S, KW, false, true>(be) < 0 ? -1 : allow_smem<D, W, S, KW, true, true>(be);
}

int qc_cuda_flash_attention_init(qc_backend *be) {
    if (allow_smem<64, QC_FA_PREFILL_WARPS, 1, 1>(be) < 0 || allow_smem<128, QC_FA_PREFILL_WARPS, 1, 1>(be) < 0 ||
        allow_decode_smem<64>(be) < 0 || allow_decode_smem<128>(be) < 0)
        return -1;
    return 0;
}

/* Whether a short eval's partials fit cu->attn_part and its row tiles cu->attn_done (shapes
 * only: graph-safe); else one block walks every key of its rows. */
static int decode_split_fits(int n, int n_head, int n_head_kv, int head_dim) {
    const int64_t R = 16 * QC_FA_DECODE_WARPS, n_rt = row_tiles(n, n_head, n_head_kv, R);
    return (int64_t)n_head_kv * n_rt <= QC_ATT_PAIRS &&
           (int64_t)n_head_kv * n_rt * QC_FA_SPLITS * R * (head_dim + 2) <= QC_ATT_PART_FLOATS;
}

int qc_cuda_flash_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos,
                            int n, int n_head, int n_head_kv, int head_dim, float *out, int8_t *out_qs,
                            float2 *out_ds) {
    if (n <= 0) return 0;
    if (cache.type != QC_KV_F16)
        return qc_cuda_value_error(be, "flash attention reads an F16 cache, not type %d", cache.type);
    if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0)
        return qc_cuda_value_error(be, "attention: n_head %d is not a multiple of n_head_kv %d", n_head, n_head_kv);
    if (head_dim != 64 && head_dim != 128)
        return qc_cuda_value_error(be, "flash attention: head_dim %d is not 64 or 128", head_dim);
    if (n <= QC_GEMV_MAX_TOKENS && decode_split_fits(n, n_head, n_head_kv, head_dim))
        return head_dim == 64 ? launch_decode<64>(be, q, cache, pos, n, n_head, n_head_kv, out, out_qs, out_ds)
                              : launch_decode<128>(be, q, cache, pos, n, n_head, n_head_kv, out, out_qs, out_ds);
    const int r = head_dim == 64 ? launch_flash<64, QC_FA_PREFILL_WARPS, 1, 1>(be, q, cache, pos, n, n_head, n_head_kv, out)
                                 : launch_flash<128, QC_FA_PREFILL_WARPS, 1, 1>(be, q, cache, pos, n, n_head, n_head_kv, out);
    return r < 0 ? -1 : 0;
}
