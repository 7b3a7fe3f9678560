/* quants.c: the type-traits table, dequantization and the row dot product of every block
 * format qwencuda runs (F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K).
 *
 * Dequantization is bit-exact with the `gguf` Python package (gguf.quants.dequantize): every
 * value is computed in float32 with the same operations in the same order, e.g. Q4_K is
 * (d * sc) * q - (dmin * m), never a fused or re-associated form. The build uses -std=c11,
 * under which gcc does not contract a * b + c into an FMA (-ffp-contract=off), so the rounding
 * is that of separate float32 operations, as in NumPy.
 *
 * qc_dot_row is the inner loop of the CPU matmul. It dequantizes the row 256 elements at a
 * time into a stack buffer (never a float copy of the row) and accumulates w * x in 32 float32
 * lanes that are added pairwise once at the end, so that it equals, bit for bit, the float dot
 * of the dequantized row (see "the row dot product" below). Float, not double, lanes: a
 * Qwen2.5-0.5B row has at most 4864 elements, i.e. ~150 additions per lane, whose rounding
 * (measured worst 7e-8 of sum |w x|) is far below the quantisation error of any block format,
 * and float lanes keep the loop in SIMD registers.
 */
#include "quants.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- */
/* block unpacking shared by dequantize and dot                                               */

/* The unpackers turn the packed bit fields of one block into one unsigned byte per element
 * (the code before its offset is subtracted). They work on 8 bytes at a time in 64-bit words
 * ("SIMD within a register"): every shift below is at most 7 bits and is followed by a mask
 * that keeps whole fields inside each byte, so no bit crosses from one element to the next.
 * Written this way because gcc does not vectorise the equivalent 16-iteration byte loops well
 * (it unrolls them completely first), while the float loops that consume the bytes vectorise
 * cleanly. GGUF is little-endian and so is every host we build for: byte i of a loaded word is
 * element i. */
#define QC_M01 0x0101010101010101ull
#define QC_M03 0x0303030303030303ull
#define QC_M0F 0x0f0f0f0f0f0f0f0full

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store64(uint8_t *p, uint64_t v) {
    memcpy(p, &v, sizeof v);
}

/* Bit i of `bits` (0..255) to 0x10 or 0 in byte i: replicate the byte 8 times, keep bit i in
 * byte i, then add 0x80 - 2^i in byte i so that exactly the set bits carry into bit 7 (no
 * carry leaves a byte), and move bit 7 to bit 4. */
static inline uint64_t spread_bit4(uint32_t bits) {
    uint64_t v = ((uint64_t)(bits & 0xffu) * QC_M01) & 0x8040201008040201ull;
    return ((v + 0x00406070787c7e7full) & 0x8080808080808080ull) >> 3;
}

/* Q4_0 and Q4_1: element j < 16 is the low nibble of qs[j], element j + 16 its high nibble. */
static inline void unpack_nibbles32(const uint8_t *qs, uint8_t q[QC_QK]) {
    for (int k = 0; k < 2; k++) {
        uint64_t w = load64(qs + 8 * k);
        store64(q + 8 * k, w & QC_M0F);
        store64(q + 16 + 8 * k, (w >> 4) & QC_M0F);
    }
}

/* Q5_0 and Q5_1: the nibbles, plus bit j of the little-endian 32-bit qh as bit 4 of
 * element j. */
static inline void unpack_q5(const uint8_t *qh4, const uint8_t *qs, uint8_t q[QC_QK]) {
    for (int k = 0; k < 2; k++) {
        uint64_t w = load64(qs + 8 * k);
        store64(q + 8 * k, (w & QC_M0F) | spread_bit4(qh4[k]));
        store64(q + 16 + 8 * k, ((w >> 4) & QC_M0F) | spread_bit4(qh4[2 + k]));
    }
}

/* Q4_K and Q5_K: 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes:
 * bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same
 * for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high). */
static inline void unpack_k_scales(const uint8_t s[QC_K_SCALE_SIZE], uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
}

/* Q4_K: element 64 g + 32 h + l is nibble h of qs[32 g + l]; sub-block 2 g + h. */
static inline void unpack_q4_K(const qc_block_q4_K *b, uint8_t q[QC_QK_K]) {
    for (int g = 0; g < 4; g++)
        for (int k = 0; k < 4; k++) {
            uint64_t w = load64(b->qs + 32 * g + 8 * k);
            store64(q + 64 * g + 8 * k, w & QC_M0F);
            store64(q + 64 * g + 32 + 8 * k, (w >> 4) & QC_M0F);
        }
}

/* Q5_K: as Q4_K, and bit s of qh[l] is bit 4 of element 32 s + l. */
static inline void unpack_q5_K(const qc_block_q5_K *b, uint8_t q[QC_QK_K]) {
    for (int g = 0; g < 4; g++)
        for (int k = 0; k < 4; k++) {
            uint64_t w = load64(b->qs + 32 * g + 8 * k), h = load64(b->qh + 8 * k);
            store64(q + 64 * g + 8 * k, (w & QC_M0F) | ((h >> (2 * g)) & QC_M01) << 4);
            store64(q + 64 * g + 32 + 8 * k, ((w >> 4) & QC_M0F) | ((h >> (2 * g + 1)) & QC_M01) << 4);
        }
}

/* Q6_K: element 128 h + 32 t + l (t 0..3, l 0..31) has low bits = nibble (t / 2) of
 * ql[64 h + 32 (t % 2) + l] and high bits = bits 2t..2t+1 of qh[32 h + l]; 6-bit codes 0..63
 * (the value is code - 32). */
static inline void unpack_q6_K(const qc_block_q6_K *b, uint8_t q[QC_QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) {
            uint64_t l0 = load64(b->ql + 64 * h + 8 * k), l1 = load64(b->ql + 64 * h + 32 + 8 * k);
            uint64_t hi = load64(b->qh + 32 * h + 8 * k);
            uint8_t *o = q + 128 * h + 8 * k;
            store64(o, (l0 & QC_M0F) | (hi & QC_M03) << 4);
            store64(o + 32, (l1 & QC_M0F) | ((hi >> 2) & QC_M03) << 4);
            store64(o + 64, ((l0 >> 4) & QC_M0F) | ((hi >> 4) & QC_M03) << 4);
            store64(o + 96, ((l1 >> 4) & QC_M0F) | ((hi >> 6) & QC_M03) << 4);
        }
}

/* Q2_K: element 128 h + 32 t + l is bits 2t..2t+1 of qs[32 h + l]; codes 0..3. */
static inline void unpack_q2_K(const qc_block_q2_K *b, uint8_t q[QC_QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) {
            uint64_t w = load64(b->qs + 32 * h + 8 * k);
            for (int t = 0; t < 4; t++) store64(q + 128 * h + 32 * t + 8 * k, (w >> (2 * t)) & QC_M03);
        }
}

/* Q3_K: low 2 bits as Q2_K, bit (4 h + t) of hmask[l] as bit 2: codes 0..7, the value is
 * code - 4 (a CLEAR high bit means "subtract 4"). */
static inline void unpack_q3_K(const qc_block_q3_K *b, uint8_t q[QC_QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) {
            uint64_t w = load64(b->qs + 32 * h + 8 * k), m = load64(b->hmask + 8 * k);
            for (int t = 0; t < 4; t++)
                store64(q + 128 * h + 32 * t + 8 * k,
                        ((w >> (2 * t)) & QC_M03) | ((m >> (4 * h + t)) & QC_M01) << 2);
        }
}

/* Q3_K: 16 signed 6-bit scales (minus 32): low 4 bits from bytes 0-7 (low nibbles give
 * scales 0-7, high nibbles 8-15), high 2 bits from bits 2(j/4).. of byte 8 + j%4. */
static inline void unpack_q3_K_scales(const uint8_t s[12], int8_t sc[16]) {
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? (s[j] & 0x0f) : (s[j - 8] >> 4);
        int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* code generation                                                                           */

/* The hardware prefetcher of the machines we measured (a 2-core VM) does not run far enough
 * ahead of a dequantizing loop: a Q8_0 row sweep reached 2.1 GB/s from DRAM without software
 * prefetch and 8.8 GB/s with a prefetch 4 KiB ahead (bench/dot_bench.c). Prefetching past the
 * end of a row is harmless (it never faults) and in a matmul fetches the next row. */
#define QC_PREFETCH_BYTES 4096
#if defined(__GNUC__)
#define QC_PREFETCH(p) __builtin_prefetch((const char *)(p) + QC_PREFETCH_BYTES)
#else
#define QC_PREFETCH(p) ((void)0)
#endif

/* The extension is built without -march (it must run on any x86-64), so plain -O3 code uses
 * SSE2 only. On x86-64 Linux with gcc the dequantize and dot loops are also compiled for
 * AVX2 (x86-64-v3) and AVX-512 (x86-64-v4) and the best version is picked at load time (an
 * ifunc); the C source is the same. No version contracts a * b + c into an FMA: setup.py
 * compiles with -std=c11, which implies -ffp-contract=off in gcc; a build with -std=gnu11 would
 * break the bit-exactness of dequantize, and tests/test_quants.py would say so. Builds for
 * SSE2, x86-64-v3 and x86-64-v4 were checked to give identical bits for dequantize and dot. */
#if defined(__GNUC__) && __GNUC__ >= 12 && !defined(__clang__) && defined(__x86_64__) && \
    defined(__linux__) && !defined(QC_NO_CLONES)
#define QC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QC_CLONES
#endif

/* ---------------------------------------------------------------------------------------- */
/* dequantize: n elements (a multiple of the block size), float32, gguf's arithmetic order    */

/* Each function writes n floats. The expressions are gguf's, operation for operation (e.g.
 * Q4_K: (d * sc) * q - (dmin * m), Q6_K: (d * scale) * (q - 32)); codes are small integers,
 * so (float)q - 8.0f equals (float)(q - 8) exactly. Loops run over 32 elements with a lane
 * select where the format's sub-blocks hold 16 (gcc completely unrolls 16-iteration loops
 * before its loop vectoriser sees them), and the 32-element formats unpack QC_CHUNK blocks
 * before reading any back (reading a block's bytes right after storing them with narrower
 * stores stalls on store forwarding). */
#define QC_CHUNK 8

static void deq_f32(const void *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

QC_CLONES
static void deq_f16(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i += 32) {
        QC_PREFETCH(s + i);
        const int64_t m = n - i < 32 ? n - i : 32;
        for (int64_t j = i; j < i + m; j++) dst[j] = qc_fp16_to_fp32(s[j]);
    }
}

QC_CLONES
static void deq_bf16(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i += 32) {
        QC_PREFETCH(s + i);
        const int64_t m = n - i < 32 ? n - i : 32;
        for (int64_t j = i; j < i + m; j++) dst[j] = qc_bf16_to_fp32(s[j]);
    }
}

/* Q4_0 and Q5_0: x = d * (q - off); Q4_1 and Q5_1: x = d * q + m. */
#define QC_DEQ_LEGACY(name, block_t, unpack, expr)                                          \
    QC_CLONES                                                                               \
    static void name(const void *src, float *dst, int64_t n) {                              \
        const block_t *b = src;                                                             \
        uint8_t q[QC_CHUNK][QC_QK];                                                         \
        for (int64_t i = 0; i < n / QC_QK; i += QC_CHUNK, b += QC_CHUNK, dst += QC_CHUNK * QC_QK) { \
            const int nb = n / QC_QK - i < QC_CHUNK ? (int)(n / QC_QK - i) : QC_CHUNK;      \
            for (int k = 0; k < nb; k++) {                                                  \
                QC_PREFETCH(b + k);                                                         \
                unpack;                                                                     \
            }                                                                               \
            for (int k = 0; k < nb; k++) {                                                  \
                const float d = qc_fp16_to_fp32(b[k].d);                                      \
                float *o = dst + QC_QK * k;                                                 \
                for (int l = 0; l < QC_QK; l++) o[l] = expr;                                \
            }                                                                               \
        }                                                                                   \
    }

QC_DEQ_LEGACY(deq_q4_0, qc_block_q4_0, unpack_nibbles32(b[k].qs, q[k]),
              d * ((float)q[k][l] - 8.0f))
QC_DEQ_LEGACY(deq_q4_1, qc_block_q4_1, unpack_nibbles32(b[k].qs, q[k]),
              d * (float)q[k][l] + qc_fp16_to_fp32(b[k].m))
QC_DEQ_LEGACY(deq_q5_0, qc_block_q5_0, unpack_q5(b[k].qh, b[k].qs, q[k]),
              d * ((float)q[k][l] - 16.0f))
QC_DEQ_LEGACY(deq_q5_1, qc_block_q5_1, unpack_q5(b[k].qh, b[k].qs, q[k]),
              d * (float)q[k][l] + qc_fp16_to_fp32(b[k].m))

QC_CLONES
static void deq_q8_0(const void *src, float *dst, int64_t n) {
    const qc_block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QC_QK; i++, b++, dst += QC_QK) {
        QC_PREFETCH(b);
        const float d = qc_fp16_to_fp32(b->d);
        for (int l = 0; l < QC_QK; l++) dst[l] = (float)b->qs[l] * d;
    }
}

/* One 32-element group of a format with 16-element sub-blocks: o = s * (q - off) - m, with
 * (s0, m0) for the first 16 elements and (s1, m1) for the last 16. A function (rather than
 * a conditional expression in the loop) so that the scales are computed before the loop. */
static inline void deq_group16(float *restrict o, const uint8_t *restrict q, float off,
                               float s0, float s1, float m0, float m1) {
    for (int l = 0; l < 32; l++) {
        const float s = l < 16 ? s0 : s1, m = l < 16 ? m0 : m1;
        o[l] = s * ((float)q[l] - off) - m;
    }
}

/* Q2_K: x = (d * (scale & 15)) * q - (dmin * (scale >> 4)) */
QC_CLONES
static void deq_q2_K(const void *src, float *dst, int64_t n) {
    const qc_block_q2_K *b = src;
    uint8_t q[QC_QK_K];
    for (int64_t i = 0; i < n / QC_QK_K; i++, b++, dst += QC_QK_K) {
        QC_PREFETCH(b);
        QC_PREFETCH((const uint8_t *)b + 64);
        const float d = qc_fp16_to_fp32(b->d), dmin = qc_fp16_to_fp32(b->dmin);
        unpack_q2_K(b, q);
        for (int g = 0; g < 8; g++) {
            const uint8_t s0 = b->scales[2 * g], s1 = b->scales[2 * g + 1];
            deq_group16(dst + 32 * g, q + 32 * g, 0.0f, d * (float)(s0 & 0x0f), d * (float)(s1 & 0x0f),
                        dmin * (float)(s0 >> 4), dmin * (float)(s1 >> 4));
        }
    }
}

/* Q3_K: x = (d * scale) * (q - 4), scale a signed 6-bit value */
QC_CLONES
static void deq_q3_K(const void *src, float *dst, int64_t n) {
    const qc_block_q3_K *b = src;
    uint8_t q[QC_QK_K];
    int8_t sc[16];
    for (int64_t i = 0; i < n / QC_QK_K; i++, b++, dst += QC_QK_K) {
        QC_PREFETCH(b);
        QC_PREFETCH((const uint8_t *)b + 64);
        const float d = qc_fp16_to_fp32(b->d);
        unpack_q3_K(b, q);
        unpack_q3_K_scales(b->scales, sc);
        for (int g = 0; g < 8; g++)
            deq_group16(dst + 32 * g, q + 32 * g, 4.0f, d * (float)sc[2 * g], d * (float)sc[2 * g + 1],
                        0.0f, 0.0f);
    }
}

/* Q4_K and Q5_K: x = (d * scale) * q - (dmin * min) per 32-element sub-block */
#define QC_DEQ_K(name, block_t, unpack)                                                     \
    QC_CLONES                                                                               \
    static void name(const void *src, float *dst, int64_t n) {                              \
        const block_t *b = src;                                                             \
        uint8_t q[QC_QK_K], sc[8], mn[8];                                                   \
        for (int64_t i = 0; i < n / QC_QK_K; i++, b++, dst += QC_QK_K) {                    \
            QC_PREFETCH(b);                                                                 \
            QC_PREFETCH((const uint8_t *)b + 64);                                           \
            const float d = qc_fp16_to_fp32(b->d), dmin = qc_fp16_to_fp32(b->dmin);             \
            unpack_k_scales(b->scales, sc, mn);                                             \
            unpack(b, q);                                                                   \
            for (int s = 0; s < 8; s++) {                                                   \
                const float ds = d * (float)sc[s], dm = dmin * (float)mn[s];                \
                for (int l = 0; l < 32; l++) dst[32 * s + l] = ds * (float)q[32 * s + l] - dm; \
            }                                                                               \
        }                                                                                   \
    }

QC_DEQ_K(deq_q4_K, qc_block_q4_K, unpack_q4_K)
QC_DEQ_K(deq_q5_K, qc_block_q5_K, unpack_q5_K)

/* Q6_K: x = (d * scale) * (q - 32), scale a signed byte */
QC_CLONES
static void deq_q6_K(const void *src, float *dst, int64_t n) {
    const qc_block_q6_K *b = src;
    uint8_t q[QC_QK_K];
    for (int64_t i = 0; i < n / QC_QK_K; i++, b++, dst += QC_QK_K) {
        QC_PREFETCH(b);
        QC_PREFETCH((const uint8_t *)b + 64);
        QC_PREFETCH((const uint8_t *)b + 128);
        const float d = qc_fp16_to_fp32(b->d);
        unpack_q6_K(b, q);
        for (int g = 0; g < 8; g++)
            deq_group16(dst + 32 * g, q + 32 * g, 32.0f, d * (float)b->scales[2 * g],
                        d * (float)b->scales[2 * g + 1], 0.0f, 0.0f);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* the row dot product                                                                        */

/* qc_dot_row dequantizes QC_DOT_CHUNK elements at a time into a stack buffer (with the
 * functions above, so bit-exactly gguf's values) and accumulates w[i] * x[i] into QC_GROUP
 * float lanes: lane l collects the products of the elements i with i % 32 == l, in order of
 * increasing i, and the lanes are added pairwise at the end. Hence:
 *  - qc_dot_row(t, row, x) == qc_dot_row(F32, dequantized row, x), bit for bit, for every
 *    type: the CPU matmul may dequantize a row once and reuse it for many tokens (prefill)
 *    and still give exactly the numbers that one-token decode gives;
 *  - with x = e_i the result is exactly the dequantized element i (tests check every position);
 *  - the lane update is an elementwise map, which gcc -O3 vectorises without reassociating a
 *    float reduction (it would only do that under -ffast-math).
 * Dequantizing into L1 first is also faster here than multiplying the codes in place: gcc
 * vectorises the simple dequantize loops better than fused code/scale/x loops (measured in
 * bench/dot_bench.c). */
#define QC_GROUP 32
#define QC_DOT_CHUNK 256   /* a multiple of every supported block size */

/* tot[i % 32] += w[i] * x[i] for i < n. */
QC_CLONES
static void accumulate(float *restrict tot, const float *restrict w, const float *restrict x,
                       int64_t n) {
    int64_t i = 0;
    for (; i + QC_GROUP <= n; i += QC_GROUP)
        for (int l = 0; l < QC_GROUP; l++) tot[l] += w[i + l] * x[i + l];
    for (; i < n; i++) tot[i % QC_GROUP] += w[i] * x[i];
}

/* Sum of the 32 lanes in a fixed pairwise order. */
static inline float group_sum(const float t[QC_GROUP]) {
    float a[8];
    for (int k = 0; k < 8; k++) a[k] = (t[k] + t[k + 8]) + (t[k + 16] + t[k + 24]);
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* ---------------------------------------------------------------------------------------- */
/* data at any address                                                                        */

/* GGUF allows general.alignment 1 or 2, and the rows of a Q6_K matrix are 210-byte multiples:
 * stored data can sit at any address. The dequantize functions read block structs, uint16
 * halves and floats in place, which is undefined behaviour (and a fault on some CPUs) at an
 * address that is not a multiple of their alignment. Such data goes through an aligned copy,
 * QC_DOT_CHUNK elements at a time: the same bytes, hence the same results bit for bit; data
 * at a proper address (every file written with the default alignment 32) reads in place. */
QC_STATIC_ASSERT(_Alignof(qc_block_q4_0) <= 2 && _Alignof(qc_block_q4_1) <= 2 &&
                 _Alignof(qc_block_q5_0) <= 2 && _Alignof(qc_block_q5_1) <= 2 &&
                 _Alignof(qc_block_q8_0) <= 2 && _Alignof(qc_block_q2_K) <= 2 &&
                 _Alignof(qc_block_q3_K) <= 2 && _Alignof(qc_block_q4_K) <= 2 &&
                 _Alignof(qc_block_q5_K) <= 2 && _Alignof(qc_block_q6_K) <= 2,
                 "every supported block's widest member is a half: src_aligned checks 2 bytes");

/* Whether the dequantize function of tr may read src in place. */
static inline int src_aligned(const qc_type_traits *tr, const void *src) {
    const uintptr_t align = tr->dequantize == deq_f32 ? _Alignof(float) : _Alignof(qc_half);
    return (uintptr_t)src % align == 0;
}

/* tr->dequantize for src at any address; n a multiple of the block size. */
static void dequantize_any(const qc_type_traits *tr, const void *src, float *dst, int64_t n) {
    if (src_aligned(tr, src)) {
        tr->dequantize(src, dst, n);
        return;
    }
    _Alignas(16) uint8_t tmp[QC_DOT_CHUNK * sizeof(float)];   /* F32 is the widest per element */
    const uint8_t *s = src;
    for (int64_t i = 0; i < n; i += QC_DOT_CHUNK) {
        const int64_t m = n - i < QC_DOT_CHUNK ? n - i : QC_DOT_CHUNK;
        const size_t bytes = (size_t)(m / tr->block_size * tr->type_size);
        memcpy(tmp, s, bytes);
        tr->dequantize(tmp, dst + i, m);
        s += bytes;
    }
}

static float dot_row(const qc_type_traits *tr, const void *row, const float *x, int64_t n) {
    float tot[QC_GROUP] = {0};
    if (tr->dequantize == deq_f32 && src_aligned(tr, row)) {
        /* software prefetch for the float row too (see QC_PREFETCH_BYTES) */
        const float *w = row;
        for (int64_t i = 0; i < n; i += QC_DOT_CHUNK) {
            const int64_t m = n - i < QC_DOT_CHUNK ? n - i : QC_DOT_CHUNK;
            for (int64_t j = 0; j < m; j += 16) QC_PREFETCH(w + i + j);
            accumulate(tot, w + i, x + i, m);
        }
        return group_sum(tot);
    }
    float buf[QC_DOT_CHUNK];
    const uint8_t *src = row;
    const size_t chunk_bytes = (size_t)(QC_DOT_CHUNK / tr->block_size * tr->type_size);
    for (int64_t i = 0; i < n; i += QC_DOT_CHUNK, src += chunk_bytes) {
        const int64_t m = n - i < QC_DOT_CHUNK ? n - i : QC_DOT_CHUNK;
        dequantize_any(tr, src, buf, m);
        accumulate(tot, buf, x + i, m);
    }
    return group_sum(tot);
}

/* ---------------------------------------------------------------------------------------- */
/* the traits table                                                                          */


/* GGUF defines two values past QC_TYPE_COUNT (NVFP4 = 40, Q1_0 = 41, gguf 0.19); the reader
 * can list them although quants.h does not name them yet. */
#define QC_TRAITS_LEN 42

/* Entries with a NULL name are values GGUF never defined. Removed types (Q4_2, Q4_3, the
 * interleaved Q4_0_x_y / IQ4_NL_x_y) keep their name with type_size 0 so a file that uses them
 * gets a precise message. */
static const qc_type_traits traits[QC_TRAITS_LEN] = {
    [QC_TYPE_F32] = {"F32", 1, 4, deq_f32},
    [QC_TYPE_F16] = {"F16", 1, 2, deq_f16},
    [QC_TYPE_Q4_0] = {"Q4_0", QC_QK, sizeof(qc_block_q4_0), deq_q4_0},
    [QC_TYPE_Q4_1] = {"Q4_1", QC_QK, sizeof(qc_block_q4_1), deq_q4_1},
    [4] = {"Q4_2", QC_QK, 0, NULL},
    [5] = {"Q4_3", QC_QK, 0, NULL},
    [QC_TYPE_Q5_0] = {"Q5_0", QC_QK, sizeof(qc_block_q5_0), deq_q5_0},
    [QC_TYPE_Q5_1] = {"Q5_1", QC_QK, sizeof(qc_block_q5_1), deq_q5_1},
    [QC_TYPE_Q8_0] = {"Q8_0", QC_QK, sizeof(qc_block_q8_0), deq_q8_0},
    [QC_TYPE_Q8_1] = {"Q8_1", QC_QK, 4 + 4 + 32, NULL},
    [QC_TYPE_Q2_K] = {"Q2_K", QC_QK_K, sizeof(qc_block_q2_K), deq_q2_K},
    [QC_TYPE_Q3_K] = {"Q3_K", QC_QK_K, sizeof(qc_block_q3_K), deq_q3_K},
    [QC_TYPE_Q4_K] = {"Q4_K", QC_QK_K, sizeof(qc_block_q4_K), deq_q4_K},
    [QC_TYPE_Q5_K] = {"Q5_K", QC_QK_K, sizeof(qc_block_q5_K), deq_q5_K},
    [QC_TYPE_Q6_K] = {"Q6_K", QC_QK_K, sizeof(qc_block_q6_K), deq_q6_K},
    [QC_TYPE_Q8_K] = {"Q8_K", QC_QK_K, 4 + QC_QK_K + QC_QK_K / 8, NULL},
    [QC_TYPE_IQ2_XXS] = {"IQ2_XXS", QC_QK_K, 2 + QC_QK_K / 4, NULL},
    [QC_TYPE_IQ2_XS] = {"IQ2_XS", QC_QK_K, 2 + QC_QK_K / 4 + QC_QK_K / 32, NULL},
    [QC_TYPE_IQ3_XXS] = {"IQ3_XXS", QC_QK_K, 2 + QC_QK_K / 4 + QC_QK_K / 8, NULL},
    [QC_TYPE_IQ1_S] = {"IQ1_S", QC_QK_K, 2 + QC_QK_K / 8 + QC_QK_K / 16, NULL},
    [QC_TYPE_IQ4_NL] = {"IQ4_NL", QC_QK, 2 + QC_QK / 2, NULL},
    [QC_TYPE_IQ3_S] = {"IQ3_S", QC_QK_K, 2 + QC_QK_K / 4 + QC_QK_K / 8 + QC_QK_K / 32 + 4, NULL},
    [QC_TYPE_IQ2_S] = {"IQ2_S", QC_QK_K, 2 + QC_QK_K / 4 + QC_QK_K / 16, NULL},
    [QC_TYPE_IQ4_XS] = {"IQ4_XS", QC_QK_K, 2 + 2 + QC_QK_K / 2 + QC_QK_K / 64, NULL},
    [QC_TYPE_I8] = {"I8", 1, 1, NULL},
    [QC_TYPE_I16] = {"I16", 1, 2, NULL},
    [QC_TYPE_I32] = {"I32", 1, 4, NULL},
    [QC_TYPE_I64] = {"I64", 1, 8, NULL},
    [QC_TYPE_F64] = {"F64", 1, 8, NULL},
    [QC_TYPE_IQ1_M] = {"IQ1_M", QC_QK_K, QC_QK_K / 8 + QC_QK_K / 16 + QC_QK_K / 32, NULL},
    [QC_TYPE_BF16] = {"BF16", 1, 2, deq_bf16},
    [31] = {"Q4_0_4_4", QC_QK, 0, NULL},
    [32] = {"Q4_0_4_8", QC_QK, 0, NULL},
    [33] = {"Q4_0_8_8", QC_QK, 0, NULL},
    [QC_TYPE_TQ1_0] = {"TQ1_0", QC_QK_K, 2 + 4 * 13, NULL},
    [QC_TYPE_TQ2_0] = {"TQ2_0", QC_QK_K, 2 + 64, NULL},
    [36] = {"IQ4_NL_4_4", QC_QK, 0, NULL},
    [37] = {"IQ4_NL_4_8", QC_QK, 0, NULL},
    [38] = {"IQ4_NL_8_8", QC_QK, 0, NULL},
    [QC_TYPE_MXFP4] = {"MXFP4", QC_QK, 1 + QC_QK / 2, NULL},
    [40] = {"NVFP4", 64, 4 + 32, NULL},
    [41] = {"Q1_0", 128, 2 + 16, NULL},
};


const qc_type_traits *qc_type_get(uint32_t t) {
    if (t >= QC_TRAITS_LEN || traits[t].name == NULL) return NULL;
    return &traits[t];
}

void qc_supported_type_names(char *buf, size_t size) {
    size_t len = 0;
    if (size == 0) return;
    buf[0] = '\0';
    for (uint32_t t = 0; t < QC_TYPE_COUNT; t++) {
        const qc_type_traits *tr = qc_type_get(t);
        if (tr == NULL || tr->dequantize == NULL || len >= size) continue;
        len += (size_t)snprintf(buf + len, size - len, len ? " %s" : "%s", tr->name);
    }
}

int64_t qc_row_bytes(uint32_t t, int64_t n) {
    const qc_type_traits *tr = qc_type_get(t);
    if (tr == NULL || tr->type_size == 0 || n < 0 || n % tr->block_size != 0) return -1;
    uint64_t bytes;
    if (qc_mul_u64((uint64_t)(n / tr->block_size), (uint64_t)tr->type_size, &bytes) < 0 ||
        bytes > (uint64_t)INT64_MAX)
        return -1;
    return (int64_t)bytes;
}

int qc_dequantize(uint32_t t, const void *src, float *dst, int64_t nrows, int64_t ncols, qc_error *err) {
    const qc_type_traits *tr = qc_type_get(t);
    if (tr == NULL) return qc_fail(err, QC_ERR_VALUE, "dequantize: unknown type %u", (unsigned)t);
    if (tr->dequantize == NULL)
        return qc_fail(err, QC_ERR_VALUE, "dequantize: type %s is not supported", tr->name);
    if (nrows < 0 || ncols < 0)
        return qc_fail(err, QC_ERR_VALUE, "dequantize: negative shape (%lld, %lld)",
                       (long long)nrows, (long long)ncols);
    if (ncols % tr->block_size != 0)
        return qc_fail(err, QC_ERR_VALUE, "dequantize: %s row of %lld elements is not a multiple "
                       "of the block size %lld", tr->name, (long long)ncols, (long long)tr->block_size);
    uint64_t total;
    if (qc_mul_u64((uint64_t)nrows, (uint64_t)ncols, &total) < 0 || total > (uint64_t)INT64_MAX)
        return qc_fail(err, QC_ERR_VALUE, "dequantize: %lld x %lld elements overflow",
                       (long long)nrows, (long long)ncols);
    /* Rows are stored back to back without padding, so all rows are one run of blocks. */
    if (total > 0) dequantize_any(tr, src, dst, (int64_t)total);
    return 0;
}

float qc_dot_row(uint32_t t, const void *row, const float *x, int64_t ncols) {
    const qc_type_traits *tr = qc_type_get(t);
    if (tr == NULL || tr->dequantize == NULL || ncols < 0 || ncols % tr->block_size != 0) return NAN;
    return dot_row(tr, row, x, ncols);
}
