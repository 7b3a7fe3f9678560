/* simd_vnni_kernels.h: the q8 dot kernels with vpdpbusd, included by simd_vnni.c for each
 * encoding of the instruction (not a header of its own). The includer defines QC_VNNI_TARGET
 * (the target attribute), QC_DPBUSD(acc, u, s) (vpdpbusd: acc plus, in each 32-bit lane, the
 * four products of unsigned bytes u by signed bytes s) and QC_VNNI(name) (the name of this
 * instantiation's copy), after simd_x86.h.
 *
 * Q8_0, Q4_0, Q5_0 and Q4_K are simd_q8_kernels.h's, the AVX2 set's own source, with vpdpbusd
 * as the integer dot; Q6_K, whose AVX2 kernel applies its scales inside vpmaddwd, is written here.
 */

#define QC_Q8_TARGET QC_VNNI_TARGET
#define QC_Q8_DOT(u, s) QC_DPBUSD(_mm256_setzero_si256(), u, s)
#define QC_Q8(name) QC_VNNI(name)
#include "simd_q8_kernels.h"

/* Q6_K: x = d * sc * (q - 32) per sub-block of 16, q 0..63 (unpacked as in simd_avx2.c). The
 * two halves of an activation block have their own scale, which AVX2 applies in integers
 * (vpmaddwd by sc_a x8, sc_b x8: lane = sc * four products). vpdpbusd gives the four products
 * p; the scale is then applied in float: (float)p * (float)sc is exact (|p| <= 4 * 32 * 128,
 * |sc| <= 128: the product is an integer below 2^24), so it is the value AVX2 converts, except
 * that a zero may come out as -0.0 where AVX2 has +0.0. That changes nothing: the FMA adds it
 * (times a scale) to an accumulator that starts at +0.0 and so never becomes -0.0 (x + -0.0 is
 * x, +0.0 + -0.0 is +0.0), and 0 times an infinite or NaN scale is the same NaN either way. */
QC_Q8_INLINE void QC_VNNI(q6_K_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
                                       int64_t nb, float *out) {
    const __m256i off = _mm256_set1_epi8(32);
    __m256 acc[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *wb = (const uint8_t *)row + sb * (int64_t)sizeof(qc_block_q6_K);
        if (nt == 1) prefetch_ahead(wb, (int)sizeof(qc_block_q6_K));
        const uint8_t *ql = FIELD(wb, qc_block_q6_K, ql), *qhp = FIELD(wb, qc_block_q6_K, qh);
        const int8_t *scales = (const int8_t *)FIELD(wb, qc_block_q6_K, scales);
        const __m256 d = _mm256_set1_ps(half_at(FIELD(wb, qc_block_q6_K, d)));
        for (int h = 0; h < 2; h++) {
            __m256i g[4];
            q6_K_groups(ql + 64 * h, qhp + 32 * h, g);
            for (int k = 0; k < 4; k++) {
                const __m256i q = _mm256_sub_epi8(g[k], off);
                const __m256i uq = _mm256_sign_epi8(q, q);
                const int8_t *sc = scales + 8 * h + 2 * k;
                /* sc[0] in the low 128 bits (elements 0..15), sc[1] in the high ones */
                const __m256 fsc = _mm256_set_m128(_mm_set1_ps((float)sc[1]), _mm_set1_ps((float)sc[0]));
                QC_TOKENS for (int t = 0; t < nt; t++) {
                    const qc_q8_block *xb = x + t * xs + sb * 8 + 4 * h + k;
                    const __m256i p = QC_DPBUSD(_mm256_setzero_si256(), uq, _mm256_sign_epi8(load32(xb->qs), q));
                    const __m256 ps = _mm256_mul_ps(_mm256_cvtepi32_ps(p), fsc);
                    acc[t] = _mm256_fmadd_ps(ps, scale(d, xb), acc[t]);
                }
            }
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]);
}
QC_Q8_DISPATCH(q6_K)

#undef QC_Q8_TARGET
#undef QC_Q8_DOT
#undef QC_Q8
#undef QC_Q8_FN
#undef QC_Q8_INLINE
#undef QC_Q8_DISPATCH
