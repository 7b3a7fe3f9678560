/* simd_q8_kernels.h: the q8 dot kernels of Q8_0, Q4_0, Q5_0 and Q4_K, written once for every
 * integer dot instruction (not a header of its own: an x86 kernel file includes it once per
 * instruction set, inside its x86-64 section, after simd_x86.h). The includer defines:
 *   QC_Q8_TARGET     the functions' target attribute string;
 *   QC_Q8_DOT(u, s)  eight int32 lanes, each the sum of four products of unsigned bytes u by
 *                    signed bytes s (AVX2: vpmaddubsw + vpmaddwd by ones; VNNI: vpdpbusd);
 *   QC_Q8(name)      this copy's name of a function (q8_0_dot -> q8_0_dot_avxvnni, ...);
 * and undefines them when done. The functions are made by simd_x86.h's QC_Q8_INLINE and
 * QC_Q8_DISPATCH, which an includer may use for kernels of its own (simd_avx2.c's Q6_K).
 * Every instruction set computes the same integer in each lane, and everything after it is this
 * one float sequence, so the sets' results are the same bits (tests/test_cpu_vnni.py).
 *
 * Weight rows by 8-bit activations: one row, n_tok tokens (a compile-time constant in each
 * specialisation, so that the accumulators stay in registers). For every token the sequence
 * of operations is the same whatever n_tok is. */

/* Q8_0, Q4_0, Q5_0 (type: a constant in each caller): x = d * v, v the block's 32 signed values
 * (q32_values); signed, so through the sign trick (|v| unsigned, times x with v's sign). */
QC_Q8_INLINE void QC_Q8(q32_rows)(int type, const void *row, const qc_q8_block *x, int64_t xs,
                                  int nt, int64_t nb, float *out) {
    __m256 acc[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = (const uint8_t *)row + b * (int64_t)q32_block_bytes(type);
        if (nt == 1) prefetch_ahead(wb, 1);
        const __m256 dw = half_bcast(wb);   /* d first in every one of the three */
        const __m256i q = q32_values(type, wb);
        const __m256i uq = _mm256_sign_epi8(q, q);
        QC_TOKENS for (int t = 0; t < nt; t++) {
            const qc_q8_block *xb = x + t * xs + b;
            const __m256i p = QC_Q8_DOT(uq, _mm256_sign_epi8(load32(xb->qs), q));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale(dw, xb), acc[t]);
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]);
}
#define QC_Q32_(kernel, type)                                                                   \
    QC_Q8_INLINE void QC_Q8(kernel##_rows)(const void *row, const qc_q8_block *x, int64_t xs,  \
                                           int nt, int64_t nb, float *out) {                    \
        QC_Q8(q32_rows)(type, row, x, xs, nt, nb, out);                                          \
    }                                                                                           \
    QC_Q8_DISPATCH(kernel)
QC_Q32_(q8_0, QC_TYPE_Q8_0)
QC_Q32_(q4_0, QC_TYPE_Q4_0)
QC_Q32_(q5_0, QC_TYPE_Q5_0)
#undef QC_Q32_

/* Q4_K: super-blocks of 256 = 8 sub-blocks of 32 (one activation block each) with 6-bit
 * scales sc and mins m: x = d * sc * q - dmin * m, q 0..15. Byte l of the j-th 32 bytes of qs
 * holds element 64j + l in its low nibble and 64j + 32 + l in its high one. The dot with one
 * activation block is d*sc * dx * sum(q * qx) - dmin*m * s (s = dx * sum(qx)). */
QC_Q8_INLINE void QC_Q8(q4_K_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
                                   int64_t nb, float *out) {
    __m256 acc[QC_Q8_MAX_TOKENS];
    float mins[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        mins[t] = 0.0f;
    }
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *wb = (const uint8_t *)row + sb * (int64_t)sizeof(qc_block_q4_K);
        if (nt == 1) prefetch_ahead(wb, (int)sizeof(qc_block_q4_K));
        const float d = half_at(FIELD(wb, qc_block_q4_K, d)), dmin = half_at(FIELD(wb, qc_block_q4_K, dmin));
        uint8_t sc[8], m[8];
        q4_K_scales(FIELD(wb, qc_block_q4_K, scales), sc, m);
        for (int j = 0; j < 4; j++) {
            const __m256i raw = load32(FIELD(wb, qc_block_q4_K, qs) + 32 * j);
            const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(0x0f));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0f));
            const __m256 dlo = _mm256_set1_ps(d * (float)sc[2 * j]), dhi = _mm256_set1_ps(d * (float)sc[2 * j + 1]);
            const float mlo = dmin * (float)m[2 * j], mhi = dmin * (float)m[2 * j + 1];
            QC_TOKENS for (int t = 0; t < nt; t++) {
                const qc_q8_block *xb = x + t * xs + sb * 8 + 2 * j;
                const __m256i plo = QC_Q8_DOT(lo, load32(xb[0].qs));
                const __m256i phi = QC_Q8_DOT(hi, load32(xb[1].qs));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), scale(dlo, &xb[0]), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), scale(dhi, &xb[1]), acc[t]);
                mins[t] = fmaf(mlo, xb[0].s, mins[t]);
                mins[t] = fmaf(mhi, xb[1].s, mins[t]);
            }
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]) - mins[t];
}
QC_Q8_DISPATCH(q4_K)

