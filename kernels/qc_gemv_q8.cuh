/* qc_gemv_q8.cuh: the decode GEMV of the 8-bit formats (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K) on 8-bit
 * activations: integer dot products (dp4a), scaled to float once per block of 32.
 *
 * Why: the float GEMV (qc_gemv.cuh) converts every weight to float before its FMA, about 20
 * instructions per byte of Q4_K; an H100 issues about 9 per byte of HBM bandwidth, so that
 * GEMV ran at a fifth of the bound (0.6 TB/s, bench/results). Here a lane takes 32 or 64
 * elements at a time (a "unit"), unpacks four weights per integer instruction and multiplies
 * them with four activations per dp4a: about 2.5 instructions per byte, and each lane has a
 * whole unit (34..52 bytes) of loads in flight instead of 8 elements.
 *
 * The activations are quantized exactly as the CPU's fast kernels do (csrc/cpu/cpu_simd.h,
 * qc_q8_quantize_ref: per block of 32, d = max|x| / 127, q = x / d rounded to nearest even,
 * s = d * sum(q)), by qc_q8_quantize_block below, into the backend's buffer once per op
 * (matmul.cu: qc_cuda_quantize_q8, or qc_cuda_norm_quantize_q8 after the fused ops' norm, with
 * rmsnorm's bits): the fused ops equal their unfused sequences bit for bit, but for a decode
 * step's feed-forward norm handed over by the o projection (below, "a norm's scale after the
 * dot products"), which rounds within the same error.
 * The error is the CPU's: each x[i] moves by at most max|x_block| / 254 (tests/test_kernels.py
 * checks that bound). Device "cuda:float" (or "cuda:N:float") keeps the float GEMV: the exact
 * path, as "cpu:float" is the CPU's.
 *
 * Layout of quantized activations (qc_q8x): qs, n rows of cols int8 (a row of 32 is 16-byte
 * aligned), and ds, n rows of cols / 32 float2 (d, s).
 */
#ifndef QC_GEMV_Q8_CUH
#define QC_GEMV_Q8_CUH

#include "qc_gemv.cuh"

struct qc_q8x {
    const int8_t *qs;
    const float2 *ds;
    int64_t qs_stride, ds_stride;    /* per token: cols and cols / 32 */
};

/* The 8-bit value of x under the block's 1 / d (id): round to nearest even, clamped to +-127
 * (NaN to 0). */
__device__ __forceinline__ int qc_q8_round(float v, float id) {
    const float r = rintf(__fmul_rn(v, id));
    return r > 127.0f ? 127 : r < -127.0f ? -127 : r == r ? (int)r : 0;
}

/* Lane `lane` of a warp holds v = x[32 b + lane]: qs[lane] and (lane 0) *ds of that block. */
__device__ __forceinline__ void qc_q8_quantize_block(float v, int lane, int8_t *qs, float2 *ds) {
    float amax = fabsf(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const int q = qc_q8_round(v, id);
    int sum = q;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    qs[lane] = (int8_t)q;
    if (lane == 0) *ds = make_float2(d, __fmul_rn(d, (float)sum));
}

/* The same block by 8 lanes (lanes 8g .. 8g + 7 of a warp, `sub` = lane % 8), each holding 4
 * values v = x[32 b + 4 sub ..]: a warp quantizes four blocks at once, with the same bits (the
 * max and the integer sum do not depend on the order). */
__device__ __forceinline__ void qc_q8_quantize_block4(const float (&v)[4], int sub, int8_t *qs, float2 *ds,
                                                      bool keep = true) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off, 8));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    int q[4], sum = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        q[k] = qc_q8_round(v[k], id);
        sum += q[k];
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off, 8);
    if (!keep) return;
    *(char4 *)(qs + 4 * sub) = make_char4((signed char)q[0], (signed char)q[1], (signed char)q[2], (signed char)q[3]);
    if (sub == 0) *ds = make_float2(d, __fmul_rn(d, (float)sum));
}

/* ---- loads ----------------------------------------------------------------------------
 * SH: the weight bytes were copied into shared memory (qc_copy_to_shared, qc_cuda.cuh), read by
 * plain loads; else they are read from global memory through the read-only path (__ldg). The
 * same bytes either way, so the same bits. */
template <bool SH, typename V>
__device__ __forceinline__ V qc_ldw(const V *p) {
    if constexpr (SH) return *p;
    else return __ldg(p);
}

/* v[k] = the little-endian 32-bit words at p + 4k, k < N, for p 2-byte aligned (the 2-aligned
 * formats): aligned word loads and funnel shifts, the last two bytes by a 2-byte load, so no
 * byte outside [p, p + 4N) is read. */
template <int N, bool SH = false>
__device__ __forceinline__ void qc_ld_words(const uint8_t *p, int (&v)[N]) {
    const uint32_t sh = (uint32_t)(uintptr_t)p & 2u;
    const uint32_t *w = (const uint32_t *)(p - sh);
    uint32_t a[N + 1];
#pragma unroll
    for (int k = 0; k < N; k++) a[k] = qc_ldw<SH>(w + k);
    a[N] = sh ? (uint32_t)qc_ldw<SH>((const unsigned short *)(p + 4 * N - 2)) : 0u;
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = (int)__funnelshift_r(a[k], a[k + 1], 8 * sh);
}

template <bool SH = false>
__device__ __forceinline__ float qc_ldh(const uint8_t *p) {
    return __half2float(__ushort_as_half(qc_ldw<SH>((const unsigned short *)p)));
}

/* The 8 words of activation block b of one token (shared or global memory). */
__device__ __forceinline__ void qc_q8_x(const int8_t *qs, int64_t b, int (&x)[8]) {
    const int4 a = *(const int4 *)(qs + 32 * b), c = *(const int4 *)(qs + 32 * b + 16);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = c.x; x[5] = c.y; x[6] = c.z; x[7] = c.w;
}

/* Q4_0, Q5_0 and Q6_K store q = w + B (B = 8, 16, 32), q < 2B. Their dot products take the
 * bytes q as they are (non-negative, so also valid signed bytes) and subtract B * (the sum of x)
 * once: dot(q - B, x) = dot(q, x) - B * dot(1, x), both exact in int, so the same s (and the
 * same bits) as subtracting B from every byte first, which took five operations a word where
 * this takes one dp4a of ones a word. Why: in the 0.5B decode GEMVs the unpacking is much of
 * the dot products (the o projection's on Q8_0 bytes, no unpacking at all, ended 1.55 -> 1.20 us
 * after its release; bench/results/20261125-c5a1fd0-*). Measured (H100, real file, one lease,
 * 3 rounds against the subtraction): 1929.8, 1915.4, 1926.0 -> 1943.7, 1924.7, 1924.8 tok/s at
 * 512 keys, 1690.4, 1678.6, 1693.8 -> 1706.3, 1700.4, 1697.0 at 2560; logits bit-identical. */
#define QC_ONES4 0x01010101

/* bit i of b (i < 4) to bit 4 of byte i: the fifth bit of four Q5_0 weights */
__device__ __forceinline__ int qc_spread4(uint32_t b) { return (int)(((b * 0x00204081u) & 0x01010101u) << 4); }

/* The 32-element formats' last step: acc[j] += d * d_x * dot(w - BIAS, x block b) for the tokens
 * t0 + j < n, w the block's 32 weights as signed bytes (Q8_0; Q4_0 and Q5_0 with their BIAS). */
template <int NT, int BIAS = 0>
__device__ __forceinline__ void qc_q8_dot32(const int (&w)[8], float d, int64_t b, const qc_q8x &x, int n,
                                            int t0, float (&acc)[NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (t0 + j >= n) break;
        int xv[8];
        qc_q8_x(x.qs + (t0 + j) * x.qs_stride, b, xv);
        int s = 0, sx = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            s = __dp4a(w[k], xv[k], s);
            if constexpr (BIAS != 0) sx = __dp4a(QC_ONES4, xv[k], sx);
        }
        if constexpr (BIAS != 0) s -= BIAS * sx;   /* the bytes were q = w + BIAS */
        acc[j] += d * x.ds[(t0 + j) * x.ds_stride + b].x * (float)s;
    }
}

/* ---- one unit: acc[j] += dot(elements [UNIT u, UNIT u + UNIT) of the row, token t0 + j) ----
 * qc_q8_unit<T>::run, for the tokens t0 + j < n; UNIT = 32 (one activation block) or 64. */
template <int T> struct qc_q8_unit;

/* Q8_0 (34 bytes): x = d * q */
template <> struct qc_q8_unit<QC_TYPE_Q8_0> {
    static constexpr int UNIT = 32;
    template <int NT, bool SH = false>
    __device__ static __forceinline__ void run(const uint8_t *row, int64_t u, const qc_q8x &x, int n, int t0, float (&acc)[NT]) {
        const uint8_t *b = row + u * sizeof(qc_block_q8_0);
        int w[8];
        qc_ld_words<8, SH>(b + offsetof(qc_block_q8_0, qs), w);
        const float d = qc_ldh<SH>(b + offsetof(qc_block_q8_0, d));
        qc_q8_dot32<NT>(w, d, u, x, n, t0, acc);
    }
};

/* Q4_0 (18 bytes): x = d * (q - 8); element e < 16 is the low nibble of qs[e], e + 16 the high */
template <> struct qc_q8_unit<QC_TYPE_Q4_0> {
    static constexpr int UNIT = 32;
    template <int NT, bool SH = false>
    __device__ static __forceinline__ void run(const uint8_t *row, int64_t u, const qc_q8x &x, int n, int t0, float (&acc)[NT]) {
        const uint8_t *b = row + u * sizeof(qc_block_q4_0);
        int q[4], w[8];
        qc_ld_words<4, SH>(b + offsetof(qc_block_q4_0, qs), q);
        const float d = qc_ldh<SH>(b + offsetof(qc_block_q4_0, d));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            w[k] = (int)((uint32_t)q[k] & 0x0F0F0F0Fu);
            w[k + 4] = (int)(((uint32_t)q[k] >> 4) & 0x0F0F0F0Fu);
        }
        qc_q8_dot32<NT, 8>(w, d, u, x, n, t0, acc);
    }
};

/* Q5_0 (22 bytes): x = d * (q - 16), bit 4 of element e is bit e of qh.
 * Measured and not kept (H200, real file, three alternating rounds in one lease, 2026-12-03,
 * against ddbb8bd; bench/results/20261203-ddbb8bd-nvidia-h200-ab2.md): a layer's Q5_0 matrices
 * held on the GPU as Q8_0 (the same d, q - 16 as the byte: the same values and the same bits
 * here), since a Q8_0 block takes 9 loads, 8 funnel shifts and 8 dp4a where this one also takes
 * the fifth-bit spreads, masks and a dp4a of ones a word; the gate/up kernel's copies (61 KB a
 * block) allowed by a raised shared-memory limit. 2210.4, 2204.0, 2198.7 tok/s at 512 keys and
 * 1887.6, 1874.4, 1878.3 at 2560, against 2291.8, 2281.6, 2272.8 and 1942.9, 1944.3, 1939.3
 * (-3.5%); with the switch off, even. Read off these figures (not stamped): the 55% more bytes a
 * block of q, k, v, o, gate and up cost more than the instructions saved. */
template <> struct qc_q8_unit<QC_TYPE_Q5_0> {
    static constexpr int UNIT = 32;
    template <int NT, bool SH = false>
    __device__ static __forceinline__ void run(const uint8_t *row, int64_t u, const qc_q8x &x, int n, int t0, float (&acc)[NT]) {
        static_assert(offsetof(qc_block_q5_0, qs) == offsetof(qc_block_q5_0, qh) + 4, "qh, then qs");
        const uint8_t *b = row + u * sizeof(qc_block_q5_0);
        int hq[5], w[8];
        qc_ld_words<5, SH>(b + offsetof(qc_block_q5_0, qh), hq);
        const float d = qc_ldh<SH>(b + offsetof(qc_block_q5_0, d));
        const uint32_t qh = (uint32_t)hq[0];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t q = (uint32_t)hq[k + 1];
            w[k] = (int)((q & 0x0F0F0F0Fu) | qc_spread4((qh >> (4 * k)) & 15u));
            w[k + 4] = (int)(((q >> 4) & 0x0F0F0F0Fu) | qc_spread4((qh >> (16 + 4 * k)) & 15u));
        }
        qc_q8_dot32<NT, 16>(w, d, u, x, n, t0, acc);
    }
};

/* Q4_K (144 bytes, 256 elements): x = d * sc_j * q - dmin * m_j for sub-block j of 32. A unit is
 * the 64 elements of sub-blocks 2g and 2g + 1, whose weights are the low and the high nibbles of
 * the same 32 bytes qs[32g ..]. The block is 16-byte aligned (144 = 9 * 16): vector loads. */
template <> struct qc_q8_unit<QC_TYPE_Q4_K> {
    static constexpr int UNIT = 64;
    /* byte i (< 12) of the scales, held in three words */
    __device__ static __forceinline__ uint32_t sbyte(uint32_t s0, uint32_t s1, uint32_t s2, int i) {
        const uint32_t w = i < 4 ? s0 : i < 8 ? s1 : s2;
        return (w >> (8 * (i & 3))) & 0xFFu;
    }
    /* quants.c's get_scale_min_k4 */
    __device__ static __forceinline__ void scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int j, int &sc, int &m) {
        if (j < 4) {
            sc = (int)(sbyte(s0, s1, s2, j) & 63u);
            m = (int)(sbyte(s0, s1, s2, j + 4) & 63u);
        } else {
            sc = (int)((sbyte(s0, s1, s2, j + 4) & 15u) | (sbyte(s0, s1, s2, j - 4) >> 6) << 4);
            m = (int)((sbyte(s0, s1, s2, j + 4) >> 4) | (sbyte(s0, s1, s2, j) >> 6) << 4);
        }
    }
    template <int NT, bool SH = false>
    __device__ static __forceinline__ void run(const uint8_t *row, int64_t u, const qc_q8x &x, int n, int t0, float (&acc)[NT]) {
        static_assert(sizeof(qc_block_q4_K) % 16 == 0 && offsetof(qc_block_q4_K, qs) == 16, "aligned layout");
        const uint8_t *b = row + (u >> 2) * sizeof(qc_block_q4_K);
        const int g = (int)(u & 3);
        const uint4 h = qc_ldw<SH>((const uint4 *)b);
        const uint4 qa = qc_ldw<SH>((const uint4 *)(b + 16 + 32 * g)), qb = qc_ldw<SH>((const uint4 *)(b + 32 + 32 * g));
        const uint32_t q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const float d = __half2float(__ushort_as_half((unsigned short)(h.x & 0xFFFFu)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(h.x >> 16)));
        int sc0, m0, sc1, m1;
        scale_min(h.y, h.z, h.w, 2 * g, sc0, m0);
        scale_min(h.y, h.z, h.w, 2 * g + 1, sc1, m1);
        int lo[8], hi[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            lo[k] = (int)(q[k] & 0x0F0F0F0Fu);
            hi[k] = (int)((q[k] >> 4) & 0x0F0F0F0Fu);
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (t0 + j >= n) break;
            const int8_t *xq = x.qs + (t0 + j) * x.qs_stride;
            const float2 *xd = x.ds + (t0 + j) * x.ds_stride;
            int x0[8], x1[8];
            qc_q8_x(xq, 2 * u, x0);
            qc_q8_x(xq, 2 * u + 1, x1);
            int s0 = 0, s1 = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                s0 = __dp4a(lo[k], x0[k], s0);
                s1 = __dp4a(hi[k], x1[k], s1);
            }
            const float2 a0 = xd[2 * u], a1 = xd[2 * u + 1];
            acc[j] += d * ((float)(sc0 * s0) * a0.x + (float)(sc1 * s1) * a1.x) -
                      dmin * ((float)m0 * a0.y + (float)m1 * a1.y);
        }
    }
};

/* Q6_K (210 bytes, 256 elements): x = d * sc[e / 16] * (q - 32), q = 4 bits of ql and 2 of qh.
 * Element e = 128 h + 32 t + l takes the nibble t >> 1 of ql[64 h + 32 (t & 1) + l] and bits 2t
 * of qh[32 h + l] (quants.c). A unit is t = t0 and t0 + 2 of one h: the low and the high
 * nibbles of the same 32 ql bytes, two bit pairs of the same 32 qh bytes. */
template <> struct qc_q8_unit<QC_TYPE_Q6_K> {
    static constexpr int UNIT = 64;
    template <int NT, bool SH = false>
    __device__ static __forceinline__ void run(const uint8_t *row, int64_t u, const qc_q8x &x, int n, int t0, float (&acc)[NT]) {
        const uint8_t *b = row + (u >> 2) * sizeof(qc_block_q6_K);
        const int hh = (int)(u >> 1) & 1, tt = (int)(u & 1);
        int ql[8], qh[8];
        qc_ld_words<8, SH>(b + offsetof(qc_block_q6_K, ql) + 64 * hh + 32 * tt, ql);
        qc_ld_words<8, SH>(b + offsetof(qc_block_q6_K, qh) + 32 * hh, qh);
        const uint8_t *sc = b + offsetof(qc_block_q6_K, scales) + 8 * hh + 2 * tt;
        const uint32_t sca = qc_ldw<SH>((const unsigned short *)sc), scb = qc_ldw<SH>((const unsigned short *)(sc + 4));
        const int sc0 = (int)(int8_t)(sca & 0xFFu), sc1 = (int)(int8_t)(sca >> 8);
        const int sc2 = (int)(int8_t)(scb & 0xFFu), sc3 = (int)(int8_t)(scb >> 8);
        const float d = qc_ldh<SH>(b + offsetof(qc_block_q6_K, d));
        int lo[8], hi[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t l4 = (uint32_t)ql[k], h2 = (uint32_t)qh[k];
            lo[k] = (int)((l4 & 0x0F0F0F0Fu) | ((h2 >> (2 * tt)) & 0x03030303u) << 4);   /* q = w + 32 */
            hi[k] = (int)(((l4 >> 4) & 0x0F0F0F0Fu) | ((h2 >> (2 * tt + 4)) & 0x03030303u) << 4);
        }
        const int64_t xb = 8 * (u >> 2) + 4 * hh + tt;    /* activation blocks xb and xb + 2 */
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (t0 + j >= n) break;
            const int8_t *xq = x.qs + (t0 + j) * x.qs_stride;
            const float2 *xd = x.ds + (t0 + j) * x.ds_stride;
            int x0[8], x1[8];
            qc_q8_x(xq, xb, x0);
            qc_q8_x(xq, xb + 2, x1);
            int la = 0, lb = 0, ha = 0, hb = 0, sla = 0, slb = 0, sha = 0, shb = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                la = __dp4a(lo[k], x0[k], la);
                lb = __dp4a(lo[k + 4], x0[k + 4], lb);
                ha = __dp4a(hi[k], x1[k], ha);
                hb = __dp4a(hi[k + 4], x1[k + 4], hb);
                sla = __dp4a(QC_ONES4, x0[k], sla);
                slb = __dp4a(QC_ONES4, x0[k + 4], slb);
                sha = __dp4a(QC_ONES4, x1[k], sha);
                shb = __dp4a(QC_ONES4, x1[k + 4], shb);
            }
            la -= 32 * sla;   /* each sub-block's dot(q - 32, x) */
            lb -= 32 * slb;
            ha -= 32 * sha;
            hb -= 32 * shb;
            acc[j] += d * ((float)(sc0 * la + sc1 * lb) * xd[xb].x + (float)(sc2 * ha + sc3 * hb) * xd[xb + 2].x);
        }
    }
};

/* The types with an 8-bit GEMV: X(type) for each. */
#define QC_Q8_FOR_EACH_TYPE(X) X(QC_TYPE_Q4_0) X(QC_TYPE_Q5_0) X(QC_TYPE_Q8_0) X(QC_TYPE_Q4_K) X(QC_TYPE_Q6_K)
static inline __host__ __device__ bool qc_q8_type(uint32_t t) {
    switch (t) {
#define QC_CASE_(T) case T:
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
        return true;
    default:
        return false;
    }
}

/* ---- rows ------------------------------------------------------------------------------ */

/* acc[j] = the sum over units first, first + stride, ... of the row, token t0 + j: the same
 * value in every lane of the warp (full-warp shuffles: all 32 lanes call it). */
template <int T, int NT, bool SH = false>
__device__ __forceinline__ void qc_gemv_q8_row_slice(const uint8_t *__restrict__ row, int64_t cols,
                                                     const qc_q8x &x, int n, int t0, int64_t first,
                                                     int64_t stride, float (&acc)[NT]) {
    const int64_t units = cols / qc_q8_unit<T>::UNIT;
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;
#pragma unroll 2
    for (int64_t u = first; u < units; u += stride) qc_q8_unit<T>::template run<NT, SH>(row, u, x, n, t0, acc);
    qc_warp_sum(acc);
}

/* Two rows of one type against the same x (matmul_swiglu's gate and up): one loop, both rows'
 * loads in flight; each accumulator gets exactly qc_gemv_q8_row_slice's operations. SH: the rows
 * are a shared-memory copy (qc_ldw). */
template <int T, int NT, bool SH = false>
__device__ __forceinline__ void qc_gemv_q8_row2(const uint8_t *__restrict__ row_a, const uint8_t *__restrict__ row_b,
                                                int64_t cols, const qc_q8x &x, int n, int t0, int lane,
                                                float (&acc_a)[NT], float (&acc_b)[NT]) {
    const int64_t units = cols / qc_q8_unit<T>::UNIT;
#pragma unroll
    for (int j = 0; j < NT; j++) acc_a[j] = acc_b[j] = 0.0f;
    for (int64_t u = lane; u < units; u += 32) {
        qc_q8_unit<T>::template run<NT, SH>(row_a, u, x, n, t0, acc_a);
        qc_q8_unit<T>::template run<NT, SH>(row_b, u, x, n, t0, acc_b);
    }
    qc_warp_sum2(acc_a, acc_b);
}

/* qc_gemv_q8_row_slice of a type known at run time (the same for the whole warp). */
template <int NT>
__device__ __forceinline__ void qc_gemv_q8_slice_any(uint32_t type, const uint8_t *__restrict__ row, int64_t cols,
                                                     const qc_q8x &x, int n, int t0, int64_t first, int64_t stride,
                                                     float (&acc)[NT]) {
    switch (type) {
#define QC_CASE_(T) case T: qc_gemv_q8_row_slice<T, NT>(row, cols, x, n, t0, first, stride, acc); return;
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;   /* unreachable: launchers check qc_q8_type */
}

/* Four rows of one type against the same x, one token (the persistent decode kernel: gate and
 * up of two rows, or four lm_head rows): one loop, four rows' loads in flight; each accumulator
 * gets exactly qc_gemv_q8_row_slice's operations. */
template <int T, bool SH = false>
__device__ __forceinline__ void qc_gemv_q8_row4(const uint8_t *const (&row)[4], int64_t cols, const qc_q8x &x,
                                                int lane, float (&acc)[4]) {
    const int64_t units = cols / qc_q8_unit<T>::UNIT;
    float a[4][1] = {{0.0f}, {0.0f}, {0.0f}, {0.0f}};
    for (int64_t u = lane; u < units; u += 32) {
#pragma unroll
        for (int k = 0; k < 4; k++) qc_q8_unit<T>::template run<1, SH>(row[k], u, x, 1, 0, a[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        qc_warp_sum(a[k]);
        acc[k] = a[k][0];
    }
}

__device__ __forceinline__ void qc_gemv_q8_row4_any(uint32_t type, const uint8_t *const (&row)[4], int64_t cols,
                                                    const qc_q8x &x, int lane, float (&acc)[4]) {
    switch (type) {
#define QC_CASE_(T) case T: qc_gemv_q8_row4<T>(row, cols, x, lane, acc); return;
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
#pragma unroll
    for (int k = 0; k < 4; k++) acc[k] = 0.0f;   /* unreachable */
}

/* Rows row[0 .. nr - 1] (1 <= nr <= 4) against the same x, one token: acc[k] of row k, in every
 * lane. qc_gemv_q8_row4 where there are four, else qc_gemv_q8_row_slice a row: the same bits either
 * way (the lm_head's warps, matmul.cu; the persistent decode kernel's rows, decode_step.cu). SH:
 * the rows are a shared-memory copy (qc_ldw). */
template <int T, bool SH = false>
__device__ __forceinline__ void qc_gemv_q8_rows_upto4(const uint8_t *const (&row)[4], int nr, int64_t cols,
                                                      const qc_q8x &x, int lane, float (&acc)[4]) {
    if (nr == 4) {
        qc_gemv_q8_row4<T, SH>(row, cols, x, lane, acc);
        return;
    }
    /* unrolled: row[k] and acc[k] at constant k stay in registers; a run-time k put both arrays
     * in a 48-byte stack frame, and ncu counted about twice that a thread in L2's writes
     * (matmul.cu, qc_gemv_q8_rows4_kernel) */
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (k >= nr) break;
        float a[1];
        qc_gemv_q8_row_slice<T, 1, SH>(row[k], cols, x, 1, 0, lane, 32, a);
        acc[k] = a[0];
    }
}

__device__ __forceinline__ void qc_gemv_q8_rows_upto4_any(uint32_t type, const uint8_t *const (&row)[4], int nr,
                                                          int64_t cols, const qc_q8x &x, int lane, float (&acc)[4]) {
    switch (type) {
#define QC_CASE_(T) case T: qc_gemv_q8_rows_upto4<T>(row, nr, cols, x, lane, acc); return;
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
#pragma unroll
    for (int k = 0; k < 4; k++) acc[k] = 0.0f;   /* unreachable */
}

/* One warp, one row, of a type known at run time (the same for the whole block). */
template <int NT>
__device__ __forceinline__ void qc_gemv_q8_row_any(uint32_t type, const uint8_t *__restrict__ row, int64_t cols,
                                                   const qc_q8x &x, int n, int t0, int lane, float (&acc)[NT]) {
    qc_gemv_q8_slice_any<NT>(type, row, cols, x, n, t0, lane, 32, acc);
}

/* qc_gemv_q8_row2 of a type known at run time. */
template <int NT>
__device__ __forceinline__ void qc_gemv_q8_row2_any(uint32_t type, const uint8_t *__restrict__ row_a,
                                                    const uint8_t *__restrict__ row_b, int64_t cols, const qc_q8x &x,
                                                    int n, int t0, int lane, float (&acc_a)[NT], float (&acc_b)[NT]) {
    switch (type) {
#define QC_CASE_(T) case T: qc_gemv_q8_row2<T, NT>(row_a, row_b, cols, x, n, t0, lane, acc_a, acc_b); return;
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
#pragma unroll
    for (int j = 0; j < NT; j++) acc_a[j] = acc_b[j] = 0.0f;   /* unreachable */
}

/* One row of a weight whose GEMV is chosen per weight (the fused ops mix types): the 8-bit dot
 * products on xq where q8, else the float ones on xs (x normalised in shared memory, when not
 * NULL) or x. */
template <int NT>
__device__ __forceinline__ void qc_gemv_row_either(bool q8, uint32_t type, const uint8_t *__restrict__ row,
                                                   int64_t cols, const qc_q8x &xq, const float *xs,
                                                   const float *__restrict__ x, int n, int t0, int lane,
                                                   float (&acc)[NT]) {
    if (q8) qc_gemv_q8_row_any<NT>(type, row, cols, xq, n, t0, lane, acc);
    else if (xs) qc_gemv_row_any<NT, true>(type, row, cols, xs, n, t0, lane, acc);
    else qc_gemv_row_any<NT>(type, row, cols, x, n, t0, lane, acc);
}

/* ---- a norm's scale after the dot products ----
 * An 8-bit block of v * c (c > 0 a common factor) has the quants of v's block and c times its
 * d, up to rounding: so an op that normalises x (rmsnorm: x * scale * w) before its 8-bit dot
 * products may instead take the 8-bit form of x * w, quantized by the op that wrote x, and
 * multiply its finished dot products by scale. The writer then needs only its own block of 32
 * values of x, not all of them, and the norm costs no launch (matmul.cu's
 * qc_gemv_q8_add_norm_kernel, read by matmul_swiglu.cu's 32-row kernel). The values differ
 * from normalising first only where a quant rounds the other way: within the 8-bit error of
 * either (qc_q8_quantize_block). ss holds each block's sum of x^2 (qc_norm_block_ss); the
 * scale is rmsnorm's formula over their sum, added in one fixed order, so every block of
 * every launch gets the same value. */
__device__ __forceinline__ float qc_norm_block_ss(float x) {
    return qc_norm_warp_sum(x * x);   /* lane 0's is the one stored */
}
/* In two halves, so that the load of ss (written by a kernel before this one; through L2) is in
 * flight during the dot products: this lane's block sum (cols <= QC_NORM_SS_MAX_COLS: one a
 * lane, and no add that would wait for it; a loop of adds made every warp of the 0.5B gate/up
 * kernel wait an L2 round trip before its dot products, and the step 13% slower: report
 * dbed2c2, addendum), then (every lane of the warp) the scale, the same value in each. */
#define QC_NORM_SS_MAX_COLS (32 * 32)
__device__ __forceinline__ float qc_norm_ss_load(const float *ss, int64_t cols) {
    const int lane = threadIdx.x & 31;
    return lane < cols / 32 ? __ldcg(ss + lane) : 0.0f;
}
__device__ __forceinline__ float qc_norm_scale_of_ss(float part, int64_t cols, float eps) {
    part = __shfl_sync(0xffffffffu, qc_norm_warp_sum(part), 0);
    return qc_rms_scale(part, (float)cols, eps);
}

/* Quantize x (n rows of cols floats, cols a multiple of 32) into the backend's q8 buffer and
 * describe it in *out (matmul.cu). Never allocates: the buffer is made at creation. */
#define QC_Q8X_MAX_COLS 65536
__host__ __device__ static inline size_t qc_q8x_qs_bytes(int n, int64_t cols) { return ((size_t)n * (size_t)cols + 15) / 16 * 16; }
/* The ds of n rows of cols 8-bit activations laid out from base: qs first, then ds. */
__host__ __device__ static inline float2 *qc_q8x_ds_at(void *base, int n, int64_t cols) {
    return (float2 *)((char *)base + qc_q8x_qs_bytes(n, cols));
}
static inline size_t qc_q8x_bytes(int n, int64_t cols) {
    return qc_q8x_qs_bytes(n, cols) + (size_t)n * (size_t)(cols / 32) * sizeof(float2);
}
int qc_cuda_quantize_q8(qc_backend *be, const float *x, int n, int64_t cols, qc_q8x *out);
/* The same for one row normalised first (the fused ops' norm of a decode step: rmsnorm's bits),
 * cols <= QC_NORM_FUSE_MAX_COLS; x_sum (or NULL): the row is x plus these fixed-point sums (a
 * folded down projection's, qc_x_plus_sum), which also go to x_out where it is not NULL (the
 * values qc_cuda_sum_add writes). */
int qc_cuda_norm_quantize_q8(qc_backend *be, const float *x, const int64_t *x_sum, const float *norm_w,
                             int64_t cols, float eps, qc_q8x *out, float *x_out);
/* Whether matmuls of weight type `type` and `cols` columns take the 8-bit GEMV on this backend. */
int qc_cuda_gemv_q8(qc_backend *be, uint32_t type, int64_t cols);

#endif /* QC_GEMV_Q8_CUH */
