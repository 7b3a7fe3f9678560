/* simd_vnni.c: the q8 dot kernels with vpdpbusd (VNNI), for CPUs that have it: AVX-VNNI (its
 * VEX form; Alder Lake, Sapphire Rapids, Zen 5) or AVX512-VNNI with AVX512VL (its EVEX form
 * on ymm registers; Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4). The other kernels of a
 * VNNI set are the AVX2 set's (simd_avx2.c). As there, per-function target attributes keep
 * the module baseline x86-64: nothing here runs unless cpu_simd.c found the features.
 *
 * vpdpbusd adds to each 32-bit lane the four products of its unsigned bytes u by the signed
 * bytes s, exactly. AVX2's vpmaddubsw + vpmaddwd by ones computes the same four products in
 * the same lane (pairs into int16, never saturating: simd_avx2.c), so each lane holds the same
 * integer, in one instruction instead of two. Everything after it is simd_avx2.c's sequence,
 * operation for operation: the int32 lanes to float, the scale dw * dx of each block, one FMA
 * per block into 8 float lanes, the same horizontal sum at the end. A VNNI set's results are
 * therefore the AVX2 set's bit for bit (tests/test_cpu_vnni.py checks it where a CPU has VNNI,
 * and, with vpdpbusd emulated by its definition, on any AVX2 CPU).
 *
 * Signed weights keep AVX2's sign trick (|w| unsigned, x with w's sign): vpdpbusd is also
 * unsigned by signed, and an offset (w + 128) would change the integers of each lane.
 *
 * The kernels are written once (simd_vnni_kernels.h) and compiled for each encoding; the
 * helpers below are simd_avx2.c's (the same layouts, unpacked the same way), compiled for
 * AVX2 and inlined into both.
 */
#include "cpu_simd.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "quants.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
#include <immintrin.h>

#define QC_BASE_INLINE static inline __attribute__((target("avx2,fma,f16c"), always_inline))
#if defined(__clang__)
#define QC_TOKENS _Pragma("unroll")
#else
#define QC_TOKENS _Pragma("GCC unroll 8")
#endif

QC_BASE_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* a block's field through a byte pointer: blocks may sit at odd addresses (GGUF alignment 1) */
#define FIELD(block, type, field) ((const uint8_t *)(block) + offsetof(type, field))

QC_BASE_INLINE __m256 half_bcast(const uint8_t *p) {
    qc_half h;
    memcpy(&h, p, sizeof h);
    return _mm256_broadcast_ss(&qc_simd_f16_table[h]);
}

QC_BASE_INLINE float half_at(const uint8_t *p) {
    qc_half h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* 16 bytes of packed nibbles to 32 bytes 0..15: low nibbles (elements 0..15) then high ones */
QC_BASE_INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* bit i of the little-endian word at p to byte i: 0xff where set, 0 where clear */
QC_BASE_INLINE __m256i bits32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w), idx);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

QC_BASE_INLINE __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

#define QC_PREFETCH_AHEAD 4096
QC_BASE_INLINE void prefetch_ahead(const uint8_t *block, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)block + QC_PREFETCH_AHEAD + i, _MM_HINT_T0);
}

/* dw * dx in every lane */
QC_BASE_INLINE __m256 scale(__m256 dw, const qc_q8_block *xb) {
    return _mm256_mul_ps(dw, _mm256_broadcast_ss(&xb->d));
}

/* gguf's get_scale_min_k4 */
QC_BASE_INLINE void q4_K_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (uint8_t)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        m[j] = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* the VEX form: AVX-VNNI */
#define QC_VNNI_TARGET "avx2,fma,f16c,avxvnni"
#define QC_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define QC_VNNI(name) name##_avxvnni
#include "simd_vnni_kernels.h"
#undef QC_VNNI_TARGET
#undef QC_DPBUSD
#undef QC_VNNI

/* the EVEX form on ymm registers: AVX512-VNNI + AVX512VL (zmm is never used: no frequency
 * licence, and the float part stays 8 lanes as the AVX2 set's) */
#define QC_VNNI_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define QC_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define QC_VNNI(name) name##_avx512vnni
#include "simd_vnni_kernels.h"
#undef QC_VNNI_TARGET
#undef QC_DPBUSD
#undef QC_VNNI

static qc_simd_kernels vnni_sets[2];

const qc_simd_kernels *qc_simd_vnni_kernels(const qc_simd_kernels *avx2, int avx512) {
    if (avx2 == NULL) return NULL;
    qc_simd_kernels *k = &vnni_sets[avx512 != 0];
    *k = *avx2;
    if (avx512) {
        k->name = "avx2+fma+f16c+avx512vnni";
        k->q8_dot[QC_TYPE_Q4_0] = q4_0_dot_avx512vnni;
        k->q8_dot[QC_TYPE_Q5_0] = q5_0_dot_avx512vnni;
        k->q8_dot[QC_TYPE_Q8_0] = q8_0_dot_avx512vnni;
        k->q8_dot[QC_TYPE_Q4_K] = q4_K_dot_avx512vnni;
        k->q8_dot[QC_TYPE_Q6_K] = q6_K_dot_avx512vnni;
    } else {
        k->name = "avx2+fma+f16c+avxvnni";
        k->q8_dot[QC_TYPE_Q4_0] = q4_0_dot_avxvnni;
        k->q8_dot[QC_TYPE_Q5_0] = q5_0_dot_avxvnni;
        k->q8_dot[QC_TYPE_Q8_0] = q8_0_dot_avxvnni;
        k->q8_dot[QC_TYPE_Q4_K] = q4_K_dot_avxvnni;
        k->q8_dot[QC_TYPE_Q6_K] = q6_K_dot_avxvnni;
    }
    return k;
}

#else

const qc_simd_kernels *qc_simd_vnni_kernels(const qc_simd_kernels *avx2, int avx512) {
    (void)avx2;
    (void)avx512;
    return NULL;
}

#endif
