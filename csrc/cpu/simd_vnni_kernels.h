/* simd_vnni_kernels.h: the q8 dot kernels with vpdpbusd, written once and included by
 * simd_vnni.c for each encoding of the instruction (not a header of its own). The includer
 * defines QC_VNNI_TARGET (the target attribute), QC_DPBUSD(acc, u, s) (vpdpbusd: acc plus, in
 * each 32-bit lane, the four products of unsigned bytes u by signed bytes s) and QC_VNNI(name)
 * (the name of this instantiation's copy), and the AVX2 helpers.
 *
 * Each kernel is simd_avx2.c's of the same name with `dot_us(u, s)` (vpmaddubsw + vpmaddwd by
 * ones) replaced by QC_DPBUSD(0, u, s), the same integer in each lane; every float operation is
 * the same, in the same order (see simd_vnni.c). Keep the two in step.
 */

#define QC_VNNI_FN static __attribute__((target(QC_VNNI_TARGET)))
#define QC_VNNI_INLINE static inline __attribute__((target(QC_VNNI_TARGET), always_inline))

#define QC_VNNI_DISPATCH(kernel)                                                                \
    QC_VNNI_FN void QC_VNNI(kernel##_dot)(const void *row, const qc_q8_block *x, int64_t xs,   \
                                          int n_tok, int64_t nb, float *out) {                  \
        switch (n_tok) {                                                                        \
        case 1: QC_VNNI(kernel##_rows)(row, x, xs, 1, nb, out); break;                          \
        case 2: QC_VNNI(kernel##_rows)(row, x, xs, 2, nb, out); break;                          \
        case 3: QC_VNNI(kernel##_rows)(row, x, xs, 3, nb, out); break;                          \
        case 4: QC_VNNI(kernel##_rows)(row, x, xs, 4, nb, out); break;                          \
        case 5: QC_VNNI(kernel##_rows)(row, x, xs, 5, nb, out); break;                          \
        case 6: QC_VNNI(kernel##_rows)(row, x, xs, 6, nb, out); break;                          \
        case 7: QC_VNNI(kernel##_rows)(row, x, xs, 7, nb, out); break;                          \
        default: QC_VNNI(kernel##_rows)(row, x, xs, 8, nb, out); break;                         \
        }                                                                                       \
    }

/* Q8_0: x = d * q */
QC_VNNI_INLINE void QC_VNNI(q8_0_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
                                       int64_t nb, float *out) {
    __m256 acc[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = (const uint8_t *)row + b * (int64_t)sizeof(qc_block_q8_0);
        if (nt == 1) prefetch_ahead(wb, 1);
        const __m256 dw = half_bcast(FIELD(wb, qc_block_q8_0, d));
        const __m256i q = load32(FIELD(wb, qc_block_q8_0, qs));
        const __m256i uq = _mm256_sign_epi8(q, q);
        QC_TOKENS for (int t = 0; t < nt; t++) {
            const qc_q8_block *xb = x + t * xs + b;
            const __m256i p = QC_DPBUSD(_mm256_setzero_si256(), uq, _mm256_sign_epi8(load32(xb->qs), q));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale(dw, xb), acc[t]);
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]);
}
QC_VNNI_DISPATCH(q8_0)

/* Q4_0: x = d * (q - 8), q 0..15 */
QC_VNNI_INLINE void QC_VNNI(q4_0_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
                                       int64_t nb, float *out) {
    __m256 acc[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = (const uint8_t *)row + b * (int64_t)sizeof(qc_block_q4_0);
        if (nt == 1) prefetch_ahead(wb, 1);
        const __m256 dw = half_bcast(FIELD(wb, qc_block_q4_0, d));
        const __m256i q = _mm256_sub_epi8(nibbles32(FIELD(wb, qc_block_q4_0, qs)), _mm256_set1_epi8(8));
        const __m256i uq = _mm256_sign_epi8(q, q);
        QC_TOKENS for (int t = 0; t < nt; t++) {
            const qc_q8_block *xb = x + t * xs + b;
            const __m256i p = QC_DPBUSD(_mm256_setzero_si256(), uq, _mm256_sign_epi8(load32(xb->qs), q));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale(dw, xb), acc[t]);
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]);
}
QC_VNNI_DISPATCH(q4_0)

/* Q5_0: x = d * (q - 16), q = nibble | bit << 4 (q - 16 built as in simd_avx2.c) */
QC_VNNI_INLINE void QC_VNNI(q5_0_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
                                       int64_t nb, float *out) {
    __m256 acc[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = (const uint8_t *)row + b * (int64_t)sizeof(qc_block_q5_0);
        if (nt == 1) prefetch_ahead(wb, 1);
        const __m256 dw = half_bcast(FIELD(wb, qc_block_q5_0, d));
        const __m256i hi = _mm256_andnot_si256(bits32(FIELD(wb, qc_block_q5_0, qh)), _mm256_set1_epi8((char)0xf0));
        const __m256i q = _mm256_or_si256(nibbles32(FIELD(wb, qc_block_q5_0, qs)), hi);
        const __m256i uq = _mm256_sign_epi8(q, q);
        QC_TOKENS for (int t = 0; t < nt; t++) {
            const qc_q8_block *xb = x + t * xs + b;
            const __m256i p = QC_DPBUSD(_mm256_setzero_si256(), uq, _mm256_sign_epi8(load32(xb->qs), q));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale(dw, xb), acc[t]);
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]);
}
QC_VNNI_DISPATCH(q5_0)

/* Q4_K: x = d * sc * q - dmin * m per sub-block of 32, q 0..15 (unsigned: no sign trick) */
QC_VNNI_INLINE void QC_VNNI(q4_K_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
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
                const __m256i plo = QC_DPBUSD(_mm256_setzero_si256(), lo, load32(xb[0].qs));
                const __m256i phi = QC_DPBUSD(_mm256_setzero_si256(), hi, load32(xb[1].qs));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), scale(dlo, &xb[0]), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), scale(dhi, &xb[1]), acc[t]);
                mins[t] = fmaf(mlo, xb[0].s, mins[t]);
                mins[t] = fmaf(mhi, xb[1].s, mins[t]);
            }
        }
    }
    QC_TOKENS for (int t = 0; t < nt; t++) out[t] = hsum_ps(acc[t]) - mins[t];
}
QC_VNNI_DISPATCH(q4_K)

/* Q6_K: x = d * sc * (q - 32) per sub-block of 16, q 0..63 (unpacked as in simd_avx2.c). The
 * two halves of an activation block have their own scale, which AVX2 applies in integers
 * (vpmaddwd by sc_a x8, sc_b x8: lane = sc * four products). vpdpbusd gives the four products
 * p; the scale is then applied in float: (float)p * (float)sc is exact (|p| <= 4 * 32 * 128,
 * |sc| <= 128: the product is an integer below 2^24), so it is the value AVX2 converts, except
 * that a zero may come out as -0.0 where AVX2 has +0.0. That changes nothing: the FMA adds it
 * (times a scale) to an accumulator that starts at +0.0 and so never becomes -0.0 (x + -0.0 is
 * x, +0.0 + -0.0 is +0.0), and 0 times an infinite or NaN scale is the same NaN either way. */
QC_VNNI_INLINE void QC_VNNI(q6_K_rows)(const void *row, const qc_q8_block *x, int64_t xs, int nt,
                                       int64_t nb, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
    __m256 acc[QC_Q8_MAX_TOKENS];
    QC_TOKENS for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *wb = (const uint8_t *)row + sb * (int64_t)sizeof(qc_block_q6_K);
        if (nt == 1) prefetch_ahead(wb, (int)sizeof(qc_block_q6_K));
        const uint8_t *ql = FIELD(wb, qc_block_q6_K, ql), *qhp = FIELD(wb, qc_block_q6_K, qh);
        const int8_t *scales = (const int8_t *)FIELD(wb, qc_block_q6_K, scales);
        const __m256 d = _mm256_set1_ps(half_at(FIELD(wb, qc_block_q6_K, d)));
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = load32(ql + 64 * h), ql1 = load32(ql + 64 * h + 32);
            const __m256i qh = load32(qhp + 32 * h);
            __m256i g[4];
            g[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
            g[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
            g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
            g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
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
QC_VNNI_DISPATCH(q6_K)

#undef QC_VNNI_FN
#undef QC_VNNI_INLINE
#undef QC_VNNI_DISPATCH
