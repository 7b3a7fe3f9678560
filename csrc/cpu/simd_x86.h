/* simd_x86.h: the helpers that both x86 kernel sets (simd_avx2.c and simd_vnni.c) inline: block
 * fields through byte pointers, fp16 scales by table, nibble and bit unpacking into 32 bytes,
 * prefetching, and the horizontal sum. Included only inside those files' x86-64 sections, after
 * <immintrin.h>, quants.h and cpu_simd.h; every function is compiled for AVX2 + FMA + F16C and
 * inlined into kernels whose own targets include those. */
#ifndef QC_SIMD_X86_H
#define QC_SIMD_X86_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define QC_X86_INLINE static inline __attribute__((target("avx2,fma,f16c"), always_inline))

/* The q8 dot kernels' functions (simd_q8_kernels.h, simd_avx2.c's Q6_K), for the instruction set
 * and names that the including file defines as QC_Q8_TARGET and QC_Q8(name) around them: a
 * kernel's rows function is specialised for each constant token count by its dispatch. */
#define QC_Q8_FN static __attribute__((target(QC_Q8_TARGET)))
#define QC_Q8_INLINE static inline __attribute__((target(QC_Q8_TARGET), always_inline))

#define QC_Q8_DISPATCH(kernel)                                                                  \
    QC_Q8_FN void QC_Q8(kernel##_dot)(const void *row, const qc_q8_block *x, int64_t xs,       \
                                      int n_tok, int64_t nb, float *out) {                      \
        switch (n_tok) {                                                                        \
        case 1: QC_Q8(kernel##_rows)(row, x, xs, 1, nb, out); break;                            \
        case 2: QC_Q8(kernel##_rows)(row, x, xs, 2, nb, out); break;                            \
        case 3: QC_Q8(kernel##_rows)(row, x, xs, 3, nb, out); break;                            \
        case 4: QC_Q8(kernel##_rows)(row, x, xs, 4, nb, out); break;                            \
        case 5: QC_Q8(kernel##_rows)(row, x, xs, 5, nb, out); break;                            \
        case 6: QC_Q8(kernel##_rows)(row, x, xs, 6, nb, out); break;                            \
        case 7: QC_Q8(kernel##_rows)(row, x, xs, 7, nb, out); break;                            \
        default: QC_Q8(kernel##_rows)(row, x, xs, 8, nb, out); break;                           \
        }                                                                                       \
    }

/* The loops over a call's tokens (nt <= 8, a constant in each specialisation) unrolled early,
 * so that gcc keeps the accumulators acc[t] in registers: left to its later complete unrolling
 * it also stored every accumulator to the stack at every block (one Zen 3 core, best of 6:
 * Q5_0 prefill 21.9 -> 23.7, Q8_0 27.9 -> 31.9 GMAC/s). */
#if defined(__clang__)
#define QC_TOKENS _Pragma("unroll")
#else
#define QC_TOKENS _Pragma("GCC unroll 8")
#endif

QC_X86_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Blocks are read through byte pointers (field offsets from quants.h's structs), never as
 * structs: GGUF allows alignments of 1 and 2, so a block may sit at an odd address. */
#define FIELD(block, type, field) ((const uint8_t *)(block) + offsetof(type, field))

/* Every fp16 value as float (vcvtph2ps of each, filled by qc_simd_avx2_kernels): the scale of
 * a 32-element block is then two loads (the half, its float broadcast) and no vector
 * instruction, instead of an insert, a conversion and a shuffle. A decode of Q5_0 / Q8_0 rows
 * spends its time unpacking, so this is ~10% (one Zen 3 core, best of 3: Q8_0 12.5 -> 14.0,
 * Q5_0 8.8 -> 9.6 GB/s). The values are those of vcvtph2ps: the results do not change.
 * simd_avx2.c defines it. */
extern float qc_simd_f16_table[65536];

QC_X86_INLINE __m256 half_bcast(const uint8_t *p) {
    qc_half h;
    memcpy(&h, p, sizeof h);
    return _mm256_broadcast_ss(&qc_simd_f16_table[h]);
}

QC_X86_INLINE float half_at(const uint8_t *p) {
    qc_half h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* eight int32 sums of pairs of pairs of u[i] * s[i], u unsigned, s signed */
QC_X86_INLINE __m256i dot_us(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* 16 bytes of packed nibbles to 32 bytes 0..15: low nibbles (elements 0..15) then high ones */
QC_X86_INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Bit i of the 32-bit little-endian word at p to byte i: 0xff where set, 0 where clear.
 * Byte i takes byte i / 8 of the word (vpshufb works in 128-bit lanes, and the word is
 * broadcast to every lane) and keeps bit i % 8. */
QC_X86_INLINE __m256i bits32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w), idx);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

QC_X86_INLINE __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* A decode (one token) streams each weight row once from DRAM: asking for the bytes 4 KiB ahead
 * of the block in hand keeps more lines in flight than the hardware prefetcher alone (on one
 * Zen 3 core, lm_head-sized Q8_0: best of 4 runs 11.1 -> 14.1 GB/s; Q5_0 8.1 -> 8.8 GB/s, as
 * quants.c measured for the reference). Prefill reuses rows from L2 and does not need it.
 * Prefetching past the end of the weights is harmless (it never faults). */
#define QC_PREFETCH_AHEAD 4096
QC_X86_INLINE void prefetch_ahead(const uint8_t *block, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)block + QC_PREFETCH_AHEAD + i, _MM_HINT_T0);
}

/* dw * dx in every lane: dw is broadcast once per weight block and shared by the tokens, dx
 * broadcast straight from memory (a load, no shuffle), one vmulps per (block, token) */
QC_X86_INLINE __m256 scale(__m256 dw, const qc_q8_block *xb) {
    return _mm256_mul_ps(dw, _mm256_broadcast_ss(&xb->d));
}

/* The formats with one fp16 scale d (first in the block) and 32 values a block: Q8_0 (q, signed),
 * Q4_0 (q - 8, q a nibble) and Q5_0 (q - 16, q a nibble and a bit of qh: q - 16 is the nibble
 * with 0xf0 or-ed in where the bit is clear, two's complement of nibble - 16, and the nibble
 * itself where set). type is a constant wherever these are inlined. */
_Static_assert(offsetof(qc_block_q8_0, d) == 0 && offsetof(qc_block_q4_0, d) == 0 &&
               offsetof(qc_block_q5_0, d) == 0, "d first");
QC_X86_INLINE size_t q32_block_bytes(int type) {
    return type == QC_TYPE_Q8_0 ? sizeof(qc_block_q8_0)
         : type == QC_TYPE_Q4_0 ? sizeof(qc_block_q4_0) : sizeof(qc_block_q5_0);
}
QC_X86_INLINE __m256i q32_values(int type, const uint8_t *wb) {
    if (type == QC_TYPE_Q8_0) return load32(FIELD(wb, qc_block_q8_0, qs));
    if (type == QC_TYPE_Q4_0)
        return _mm256_sub_epi8(nibbles32(FIELD(wb, qc_block_q4_0, qs)), _mm256_set1_epi8(8));
    const __m256i hi = _mm256_andnot_si256(bits32(FIELD(wb, qc_block_q5_0, qh)), _mm256_set1_epi8((char)0xf0));
    return _mm256_or_si256(nibbles32(FIELD(wb, qc_block_q5_0, qs)), hi);
}

/* Q4_K's 6-bit scales and mins of the eight sub-blocks (gguf's get_scale_min_k4). */
QC_X86_INLINE void q4_K_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (uint8_t)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        m[j] = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Q6_K's 6-bit quants of one half of a super-block (128 elements: ql, its 64 bytes; qh, its 32)
 * as four groups of 32 bytes 0..63: g[k] holds elements 32 k + l, l < 32 (the layout is
 * described at simd_avx2.c's q6_K_rows). */
QC_X86_INLINE void q6_K_groups(const uint8_t *ql, const uint8_t *qh, __m256i g[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    const __m256i ql0 = load32(ql), ql1 = load32(ql + 32), h = load32(qh);
    g[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
    g[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
    g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
    g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
}

#endif /* QC_SIMD_X86_H */
