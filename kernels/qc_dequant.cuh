/* qc_dequant.cuh: device-side decoding of every block format, eight elements at a time.
 *
 * The unit of work everywhere on the GPU (embed, dequantize, the GEMV of decode, the f16 tile of
 * prefill) is a "part": elements [8p, 8p + 8) of one stored row. Eight divides every block size
 * (32 and 256), so a part never straddles a block, and for the K formats the 32 parts of a
 * super-block are read by the 32 lanes of one warp: the header is a broadcast and the quant bytes
 * are one contiguous sweep (coalesced).
 *
 * The block structs of quants.h are the layout; the offsets used here are theirs (offsetof).
 * The arithmetic is that of quants.c / gguf.quants.dequantize, operation by operation, with the
 * _rn intrinsics so that nvcc cannot contract d * q - m into an FMA: the decoded values are
 * bit-exact with the CPU and the gguf package (tests/test_kernels.py checks it).
 */
#ifndef QC_DEQUANT_CUH
#define QC_DEQUANT_CUH

#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#include "quants.h"

/* Bytes and elements of one block of each type, for the template code (plain types: 1 element). */
template <int T> struct qc_blk;
template <> struct qc_blk<QC_TYPE_F32>  { static constexpr int QK = 1;       static constexpr int BYTES = 4; };
template <> struct qc_blk<QC_TYPE_F16>  { static constexpr int QK = 1;       static constexpr int BYTES = 2; };
template <> struct qc_blk<QC_TYPE_BF16> { static constexpr int QK = 1;       static constexpr int BYTES = 2; };
template <> struct qc_blk<QC_TYPE_Q4_0> { static constexpr int QK = QC_QK;   static constexpr int BYTES = sizeof(qc_block_q4_0); };
template <> struct qc_blk<QC_TYPE_Q4_1> { static constexpr int QK = QC_QK;   static constexpr int BYTES = sizeof(qc_block_q4_1); };
template <> struct qc_blk<QC_TYPE_Q5_0> { static constexpr int QK = QC_QK;   static constexpr int BYTES = sizeof(qc_block_q5_0); };
template <> struct qc_blk<QC_TYPE_Q5_1> { static constexpr int QK = QC_QK;   static constexpr int BYTES = sizeof(qc_block_q5_1); };
template <> struct qc_blk<QC_TYPE_Q8_0> { static constexpr int QK = QC_QK;   static constexpr int BYTES = sizeof(qc_block_q8_0); };
template <> struct qc_blk<QC_TYPE_Q2_K> { static constexpr int QK = QC_QK_K; static constexpr int BYTES = sizeof(qc_block_q2_K); };
template <> struct qc_blk<QC_TYPE_Q3_K> { static constexpr int QK = QC_QK_K; static constexpr int BYTES = sizeof(qc_block_q3_K); };
template <> struct qc_blk<QC_TYPE_Q4_K> { static constexpr int QK = QC_QK_K; static constexpr int BYTES = sizeof(qc_block_q4_K); };
template <> struct qc_blk<QC_TYPE_Q5_K> { static constexpr int QK = QC_QK_K; static constexpr int BYTES = sizeof(qc_block_q5_K); };
template <> struct qc_blk<QC_TYPE_Q6_K> { static constexpr int QK = QC_QK_K; static constexpr int BYTES = sizeof(qc_block_q6_K); };

/* The types the CUDA backend runs; X(type) for each, for switch-based dispatch. */
#define QC_CUDA_FOR_EACH_TYPE(X)                                                               \
    X(QC_TYPE_F32) X(QC_TYPE_F16) X(QC_TYPE_BF16) X(QC_TYPE_Q4_0) X(QC_TYPE_Q4_1)              \
    X(QC_TYPE_Q5_0) X(QC_TYPE_Q5_1) X(QC_TYPE_Q8_0) X(QC_TYPE_Q2_K) X(QC_TYPE_Q3_K)            \
    X(QC_TYPE_Q4_K) X(QC_TYPE_Q5_K) X(QC_TYPE_Q6_K)

static inline int qc_cuda_type_supported(uint32_t t) {
    switch (t) {
#define QC_CASE_(T) case T:
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
        return 1;
    default:
        return 0;
    }
}

/* ---- loads ---------------------------------------------------------------------------- */

__device__ __forceinline__ float qc_h2f(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
__device__ __forceinline__ float qc_bf2f(uint16_t bits) { return __uint_as_float((uint32_t)bits << 16); }

/* Every block size and field offset is even, so 2-byte loads are always aligned; 4- and 8-byte
 * loads are not in general (a Q8_0 block is 34 bytes), hence 16-bit loads stitched together.
 * A caller that knows more passes A, the alignment of p it guarantees (2, 4, 8 or more), and
 * gets the widest loads A allows; the bytes are the same, only the instructions differ. */
__device__ __forceinline__ uint16_t qc_ld16(const uint8_t *p) { return *(const uint16_t *)p; }
template <int A = 2>
__device__ __forceinline__ uint32_t qc_ld32(const uint8_t *p) {
    if constexpr (A >= 4) {
        return *(const uint32_t *)p;
    } else {
        const uint16_t *s = (const uint16_t *)p;
        return (uint32_t)s[0] | (uint32_t)s[1] << 16;
    }
}
/* Eight bytes at p (A-byte aligned), as bytes. */
template <int A = 2>
__device__ __forceinline__ void qc_ld8(const uint8_t *p, uint8_t q[8]) {
    uint32_t lo, hi;
    if constexpr (A >= 8) {
        const uint2 v = *(const uint2 *)p;
        lo = v.x;
        hi = v.y;
    } else {
        lo = qc_ld32<A>(p);
        hi = qc_ld32<A>(p + 4);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        q[k] = (uint8_t)(lo >> (8 * k));
        q[k + 4] = (uint8_t)(hi >> (8 * k));
    }
}

/* The alignment a caller may promise for every block of type T: the largest power of two (at
 * most 16) dividing the block's size. It holds when the weight's buffer is 16-byte aligned (a
 * cudaMalloc'd one is), since a block starts at buffer + (row * blocks_per_row + k) * BYTES. */
template <int T>
__host__ __device__ constexpr int qc_blk_align() {
    return qc_blk<T>::BYTES % 16 == 0 ? 16 : qc_blk<T>::BYTES % 8 == 0 ? 8
         : qc_blk<T>::BYTES % 4 == 0 ? 4 : 2;
}
__host__ __device__ constexpr int qc_amin(int a, int b) { return a < b ? a : b; }
/* The alignment of block + off + (a multiple of step) for an A-aligned block. */
__host__ __device__ constexpr int qc_al(int A, size_t off, int step) {
    return qc_amin(qc_amin(A, step), off == 0 ? 16 : (int)(off & (~off + 1)));
}

/* ---- decoding of part p of a row: w[0..7] = elements 8p .. 8p+7 --------------------------
 * qc_deq8<T, A>(row, p, cols, w), defined at the end of the file: A is the alignment the caller
 * guarantees for the blocks of the row (2, the default, always holds; qc_blk_align<T>() for a
 * 16-byte aligned buffer); it chooses loads only, never the arithmetic.
 * cols bounds only the plain types (whose rows need not be a multiple of 8); a block format's
 * row is always a whole number of blocks. Elements past cols decode as 0.
 * One overload per type, chosen by a tag (a function template cannot be partially specialised). */
template <int T> struct qc_type_tag {};

/* The plain types' whole, 16-byte aligned parts as raw loads and their decoding, apart, so a
 * GEMV can issue the load of a later part before it decodes this one (qc_gemv.cuh); qc_deq8 of
 * such a part is qc_part_decode(qc_part_ld(...)). qc_part<T>::raw is one part's bytes; ok says T has
 * them (the block formats decode inside qc_deq8 only). */
template <int T> struct qc_part { static constexpr bool ok = false; };
template <> struct qc_part<QC_TYPE_F32>  { static constexpr bool ok = true; struct raw { float4 a, b; }; };
template <> struct qc_part<QC_TYPE_F16>  { static constexpr bool ok = true; typedef uint4 raw; };
template <> struct qc_part<QC_TYPE_BF16> { static constexpr bool ok = true; typedef uint4 raw; };
/* CS: a streaming load (__ldcs, evict first), for weights read once per token by the GEMVs */
template <bool CS, class V> __device__ __forceinline__ V qc_ld_vec(const V *p) {
    if constexpr (CS) return __ldcs(p);
    else return *p;
}
template <int T, bool CS = false>
__device__ __forceinline__ typename qc_part<T>::raw qc_part_ld(const uint8_t *row, int64_t p) {
    if constexpr (T == QC_TYPE_F32) {
        const float4 *r = (const float4 *)row + 2 * p;
        return {qc_ld_vec<CS>(r), qc_ld_vec<CS>(r + 1)};
    } else {
        return qc_ld_vec<CS>((const uint4 *)row + p);
    }
}

template <int T>
__device__ __forceinline__ void qc_part_decode(const typename qc_part<T>::raw v, float w[8]) {
    if constexpr (T == QC_TYPE_F32) {
        w[0] = v.a.x; w[1] = v.a.y; w[2] = v.a.z; w[3] = v.a.w;
        w[4] = v.b.x; w[5] = v.b.y; w[6] = v.b.z; w[7] = v.b.w;
    } else {
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if constexpr (T == QC_TYPE_F16) {
                w[2 * k] = qc_h2f((uint16_t)(u[k] & 0xffff));
                w[2 * k + 1] = qc_h2f((uint16_t)(u[k] >> 16));
            } else {   /* BF16: the high half of an f32 */
                w[2 * k] = __uint_as_float(u[k] << 16);
                w[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
            }
        }
    }
}

template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_F32>, const uint8_t *row, int64_t p, int64_t cols, float w[8]) {
    const float *r = (const float *)row + 8 * p;
    if (8 * p + 8 <= cols && ((uintptr_t)r & 15) == 0) {
        qc_part_decode<QC_TYPE_F32>(qc_part_ld<QC_TYPE_F32>(row, p), w);
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = 8 * p + k < cols ? r[k] : 0.0f;
    }
}

template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_F16>, const uint8_t *row, int64_t p, int64_t cols, float w[8]) {
    const uint16_t *r = (const uint16_t *)row + 8 * p;
    if (8 * p + 8 <= cols && ((uintptr_t)r & 15) == 0) {
        qc_part_decode<QC_TYPE_F16>(qc_part_ld<QC_TYPE_F16>(row, p), w);
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = 8 * p + k < cols ? qc_h2f(r[k]) : 0.0f;
    }
}

template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_BF16>, const uint8_t *row, int64_t p, int64_t cols, float w[8]) {
    const uint16_t *r = (const uint16_t *)row + 8 * p;
    if (8 * p + 8 <= cols && ((uintptr_t)r & 15) == 0) {
        qc_part_decode<QC_TYPE_BF16>(qc_part_ld<QC_TYPE_BF16>(row, p), w);
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = 8 * p + k < cols ? qc_bf2f(r[k]) : 0.0f;
    }
}

/* Q4_0: x = d * (q - 8); element j < 16 is the low nibble of qs[j], j + 16 the high one. */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q4_0>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 2) * sizeof(qc_block_q4_0);
    const int sub = (int)(p & 3);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q4_0, d)));
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q4_0, qs), 8)>(b + offsetof(qc_block_q4_0, qs) + 8 * (sub & 1), q);
    const int shift = (sub >> 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) w[k] = __fmul_rn(d, (float)(((q[k] >> shift) & 15) - 8));
}

/* Q4_1: x = d * q + m */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q4_1>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 2) * sizeof(qc_block_q4_1);
    const int sub = (int)(p & 3);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q4_1, d)));
    const float m = qc_h2f(qc_ld16(b + offsetof(qc_block_q4_1, m)));
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q4_1, qs), 8)>(b + offsetof(qc_block_q4_1, qs) + 8 * (sub & 1), q);
    const int shift = (sub >> 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) w[k] = __fadd_rn(__fmul_rn(d, (float)((q[k] >> shift) & 15)), m);
}

/* Q5_0: x = d * (q - 16), bit 4 of element j is bit j of the little-endian qh. */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q5_0>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 2) * sizeof(qc_block_q5_0);
    const int sub = (int)(p & 3);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q5_0, d)));
    const uint32_t qh = qc_ld32<qc_al(A, offsetof(qc_block_q5_0, qh), 16)>(b + offsetof(qc_block_q5_0, qh));
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q5_0, qs), 8)>(b + offsetof(qc_block_q5_0, qs) + 8 * (sub & 1), q);
    const int shift = (sub >> 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int e = 8 * sub + k;
        const int v = ((q[k] >> shift) & 15) | (int)((qh >> e) & 1u) << 4;
        w[k] = __fmul_rn(d, (float)(v - 16));
    }
}

/* Q5_1: x = d * q + m */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q5_1>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 2) * sizeof(qc_block_q5_1);
    const int sub = (int)(p & 3);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q5_1, d)));
    const float m = qc_h2f(qc_ld16(b + offsetof(qc_block_q5_1, m)));
    const uint32_t qh = qc_ld32<qc_al(A, offsetof(qc_block_q5_1, qh), 16)>(b + offsetof(qc_block_q5_1, qh));
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q5_1, qs), 8)>(b + offsetof(qc_block_q5_1, qs) + 8 * (sub & 1), q);
    const int shift = (sub >> 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int e = 8 * sub + k;
        const int v = ((q[k] >> shift) & 15) | (int)((qh >> e) & 1u) << 4;
        w[k] = __fadd_rn(__fmul_rn(d, (float)v), m);
    }
}

/* Q8_0: x = q * d */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q8_0>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 2) * sizeof(qc_block_q8_0);
    const int sub = (int)(p & 3);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q8_0, d)));
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q8_0, qs), 8)>(b + offsetof(qc_block_q8_0, qs) + 8 * sub, q);
#pragma unroll
    for (int k = 0; k < 8; k++) w[k] = __fmul_rn((float)(int8_t)q[k], d);
}

/* In the K formats with 16-element sub-blocks (Q2_K, Q3_K, Q6_K) element e = 128 h + 32 t + l
 * takes bits 2t.. of byte 32 h + l of qs; a part is 8 consecutive l of one (h, t). */

/* Q2_K: x = (d * (sc & 15)) * q - dmin * (sc >> 4) */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q2_K>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 5) * sizeof(qc_block_q2_K);
    const int e0 = 8 * (int)(p & 31), h = e0 >> 7, t = (e0 >> 5) & 3, l0 = e0 & 31;
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q2_K, d)));
    const float dmin = qc_h2f(qc_ld16(b + offsetof(qc_block_q2_K, dmin)));
    const uint8_t sc = b[offsetof(qc_block_q2_K, scales) + (e0 >> 4)];
    const float dl = __fmul_rn(d, (float)(sc & 15)), ml = __fmul_rn(dmin, (float)(sc >> 4));
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q2_K, qs), 8)>(b + offsetof(qc_block_q2_K, qs) + 32 * h + l0, q);
#pragma unroll
    for (int k = 0; k < 8; k++) w[k] = __fsub_rn(__fmul_rn(dl, (float)((q[k] >> (2 * t)) & 3)), ml);
}

/* Q3_K: x = (d * sc) * q, q = low 2 bits - (hmask bit clear ? 4 : 0), sc a signed 6-bit scale. */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q3_K>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 5) * sizeof(qc_block_q3_K);
    const int e0 = 8 * (int)(p & 31), h = e0 >> 7, t = (e0 >> 5) & 3, l0 = e0 & 31, s = e0 >> 4;
    const uint8_t *S = b + offsetof(qc_block_q3_K, scales);
    const int lo4 = s < 8 ? (S[s] & 15) : (S[s - 8] >> 4);
    const int hi2 = (S[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q3_K, d)));
    const float dl = __fmul_rn(d, (float)((lo4 | hi2 << 4) - 32));
    uint8_t q[8], hm[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q3_K, qs), 8)>(b + offsetof(qc_block_q3_K, qs) + 32 * h + l0, q);
    qc_ld8<qc_al(A, offsetof(qc_block_q3_K, hmask), 8)>(b + offsetof(qc_block_q3_K, hmask) + l0, hm);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int lo = (q[k] >> (2 * t)) & 3;
        const int hi = (hm[k] >> (4 * h + t)) & 1;
        w[k] = __fmul_rn(dl, (float)(lo - (hi ? 0 : 4)));
    }
}

/* Q4_K and Q5_K: 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes. */
__device__ __forceinline__ void qc_k_scale_min(const uint8_t *S, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = S[s] & 63;
        *mn = S[s + 4] & 63;
    } else {
        *sc = (S[s + 4] & 15) | ((S[s - 4] >> 6) << 4);
        *mn = (S[s + 4] >> 4) | ((S[s] >> 6) << 4);
    }
}

/* Q4_K: element 64 g + 32 hh + l is nibble hh of qs[32 g + l]; sub-block s = 2 g + hh;
 * x = (d * sc) * q - dmin * mn. */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q4_K>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 5) * sizeof(qc_block_q4_K);
    const int e0 = 8 * (int)(p & 31), s = e0 >> 5, l0 = e0 & 31;
    int sc, mn;
    qc_k_scale_min(b + offsetof(qc_block_q4_K, scales), s, &sc, &mn);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q4_K, d)));
    const float dmin = qc_h2f(qc_ld16(b + offsetof(qc_block_q4_K, dmin)));
    const float ds = __fmul_rn(d, (float)sc), dm = __fmul_rn(dmin, (float)mn);
    uint8_t q[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q4_K, qs), 8)>(b + offsetof(qc_block_q4_K, qs) + 32 * (s >> 1) + l0, q);
    const int shift = (s & 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) w[k] = __fsub_rn(__fmul_rn(ds, (float)((q[k] >> shift) & 15)), dm);
}

/* Q5_K: as Q4_K, and bit s of qh[l] is bit 4 of element 32 s + l. */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q5_K>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 5) * sizeof(qc_block_q5_K);
    const int e0 = 8 * (int)(p & 31), s = e0 >> 5, l0 = e0 & 31;
    int sc, mn;
    qc_k_scale_min(b + offsetof(qc_block_q5_K, scales), s, &sc, &mn);
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q5_K, d)));
    const float dmin = qc_h2f(qc_ld16(b + offsetof(qc_block_q5_K, dmin)));
    const float ds = __fmul_rn(d, (float)sc), dm = __fmul_rn(dmin, (float)mn);
    uint8_t q[8], qh[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q5_K, qs), 8)>(b + offsetof(qc_block_q5_K, qs) + 32 * (s >> 1) + l0, q);
    qc_ld8<qc_al(A, offsetof(qc_block_q5_K, qh), 8)>(b + offsetof(qc_block_q5_K, qh) + l0, qh);
    const int shift = (s & 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int v = ((q[k] >> shift) & 15) | ((qh[k] >> s) & 1) << 4;
        w[k] = __fsub_rn(__fmul_rn(ds, (float)v), dm);
    }
}

/* Q6_K: element 128 h + 32 t + l: low 4 bits = nibble (t / 2) of ql[64 h + 32 (t % 2) + l],
 * high 2 bits = bits 2t.. of qh[32 h + l]; x = (d * scales[e / 16]) * (q - 32). */
template <int A>
__device__ __forceinline__ void qc_deq8(qc_type_tag<QC_TYPE_Q6_K>, const uint8_t *row, int64_t p, int64_t, float w[8]) {
    const uint8_t *b = row + (p >> 5) * sizeof(qc_block_q6_K);
    const int e0 = 8 * (int)(p & 31), h = e0 >> 7, t = (e0 >> 5) & 3, l0 = e0 & 31;
    const float d = qc_h2f(qc_ld16(b + offsetof(qc_block_q6_K, d)));
    const int8_t sc = (int8_t)b[offsetof(qc_block_q6_K, scales) + (e0 >> 4)];
    const float ds = __fmul_rn(d, (float)sc);
    uint8_t ql[8], qh[8];
    qc_ld8<qc_al(A, offsetof(qc_block_q6_K, ql), 8)>(b + offsetof(qc_block_q6_K, ql) + 64 * h + 32 * (t & 1) + l0, ql);
    qc_ld8<qc_al(A, offsetof(qc_block_q6_K, qh), 8)>(b + offsetof(qc_block_q6_K, qh) + 32 * h + l0, qh);
    const int shift = (t >> 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int v = ((ql[k] >> shift) & 15) | ((qh[k] >> (2 * t)) & 3) << 4;
        w[k] = __fmul_rn(ds, (float)(v - 32));
    }
}

template <int T, int A = 2>
__device__ __forceinline__ void qc_deq8(const uint8_t *row, int64_t p, int64_t cols, float w[8]) {
    qc_deq8<A>(qc_type_tag<T>(), row, p, cols, w);
}

/* Bytes of one stored row of `cols` elements of type T. */
template <int T>
__host__ __device__ constexpr int64_t qc_row_bytes_t(int64_t cols) {
    return cols / qc_blk<T>::QK * qc_blk<T>::BYTES;
}

#endif /* QC_DEQUANT_CUH */
