/* simd_avx2.c: the fast CPU kernels for x86-64 with AVX2, FMA and F16C (Haswell, Zen and
 * later), compiled with per-function target attributes so that the module itself stays
 * baseline x86-64: nothing here runs unless qc_simd_get() found the features (cpu_simd.c).
 * The formats and numerics are described in cpu_simd.h; the weight layouts are quants.h's
 * (and gguf's), unpacked here 32 elements at a time into bytes.
 *
 * The integer dot of 32 weights with 32 activations: vpmaddubsw multiplies unsigned bytes by
 * signed bytes and adds adjacent pairs into int16, vpmaddwd by ones adds pairs again into
 * eight int32. Signed weights go through the sign trick (|w| unsigned, times x with w's sign),
 * as llama.cpp's kernels do. No int16 can saturate: |w| <= 128 and |x| <= 127 give pairs of at
 * most 2 * 128 * 127 = 32512.
 */
#include "cpu_simd.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "quants.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
#include <immintrin.h>

#include "simd_x86.h"

#define QC_AVX2 __attribute__((target("avx2,fma,f16c")))
/* always_inline: a kernel is specialised for each constant token count (1..4) */
#define QC_AVX2_INLINE static inline __attribute__((target("avx2,fma,f16c"), always_inline))

/* ---------------------------------------------------------------------------------------- */
/* activations to 8 bits                                                                     */

QC_AVX2 static void quantize_avx2(const float *x, int64_t n, qc_q8_block *out) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < n / QC_Q8_BLOCK; b++) {
        const float *xb = x + b * QC_Q8_BLOCK;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        /* the expressions of qc_q8_quantize_ref, so that both give the same bits */
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], vid),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        /* packs interleave the 128-bit lanes: the permute puts the 8 dwords back in order */
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(s4);
        _mm256_storeu_si256((__m256i *)out[b].qs, p8);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* weight rows by 8-bit activations: one row, n_tok tokens (a compile-time constant in each
 * specialisation, so that the accumulators stay in registers). For every token the sequence
 * of operations is the same whatever n_tok is. */

#define QC_Q8_TARGET "avx2,fma,f16c"
#define QC_Q8_DOT(u, s) dot_us(u, s)
#define QC_Q8(name) name
#include "simd_q8_kernels.h"

/* Q6_K: super-blocks of 256 = 16 sub-blocks of 16 with int8 scales: x = d * sc * (q - 32),
 * q = 4 low bits from ql and 2 high bits from qh, 0..63. In each half of 128 elements, byte l
 * (l < 32) of ql[0..31] holds elements l (low nibble) and 64 + l (high), ql[32..63] elements
 * 32 + l and 96 + l, and qh[l] their high bits in bit pairs 0, 2, 4, 6 for elements l,
 * 32 + l, 64 + l, 96 + l. Each group of 32 is one activation block whose two halves of 16
 * have their own scale: vpmaddwd by (sc_a x8, sc_b x8) applies both. */
QC_Q8_INLINE void q6_K_rows(const void *row, const qc_q8_block *x, int64_t xs, int nt,
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
                const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
                QC_TOKENS for (int t = 0; t < nt; t++) {
                    const qc_q8_block *xb = x + t * xs + sb * 8 + 4 * h + k;
                    const __m256i p16 = _mm256_maddubs_epi16(uq, _mm256_sign_epi8(load32(xb->qs), q));
                    const __m256i p = _mm256_madd_epi16(p16, scales);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale(d, xb), acc[t]);
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

/* ---------------------------------------------------------------------------------------- */
/* float rows by float activations                                                           */

QC_AVX2 static float f32_dot(const void *row, const float *x, int64_t n) {
    const uint8_t *w = row;   /* floats, possibly at an address that is not a multiple of 4 */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)(w + 4 * i)), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)(w + 4 * i + 32)), _mm256_loadu_ps(x + i + 8), a1);
    }
    float sum = hsum_ps(_mm256_add_ps(a0, a1));
    for (; i < n; i++) {
        float wi;
        memcpy(&wi, w + 4 * i, sizeof wi);
        sum = fmaf(wi, x[i], sum);
    }
    return sum;
}

QC_AVX2 static float f16_dot(const void *row, const float *x, int64_t n) {
    const uint8_t *w = row;   /* halves, possibly at an odd address */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
        const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i + 16)));
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), a1);
    }
    float sum = hsum_ps(_mm256_add_ps(a0, a1));
    for (; i < n; i++) sum = fmaf(half_at(w + 2 * i), x[i], sum);
    return sum;
}

/* ---------------------------------------------------------------------------------------- */
/* elementwise and reductions                                                                 */

/* exp(x) for 8 floats, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts),
 * e^r by its degree-7 polynomial, 2^n put in the exponent. Relative error ~2 ulp; x is clamped
 * to [-87.3, 88.7] (e^x then is at most FLT_MAX and at least a normal float). */
QC_AVX2_INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n in -126..128: 2^n as exponent bits n + 127, split in two factors so that n = 128 (x
     * near 88.7) does not overflow the exponent field */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half_n = _mm256_srai_epi32(ni, 1);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half_n, _mm256_set1_epi32(127)), 23));
    const __m256 f2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half_n), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

QC_AVX2_INLINE __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* Every element, the tail included, goes through the same 8-wide code, so that a value does
 * not depend on where it sits in the array (the fused and unfused swiglu agree bit for bit). */
QC_AVX2 static void silu_mul_avx2(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float gb[8] = {0}, ub[8] = {0}, ob[8];
        memcpy(gb, g + i, sizeof(float) * (size_t)(n - i));
        memcpy(ub, u + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(ob, silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
        memcpy(out + i, ob, sizeof(float) * (size_t)(n - i));
    }
}

/* sum of squares in float64: 8 lanes (two vectors of 4 doubles), then the tail */
QC_AVX2 static double sumsq_avx2(const float *x, int64_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        const __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    const __m256d a = _mm256_add_pd(a0, a1);
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
    for (; i < n; i++) sum += (double)x[i] * (double)x[i];
    return sum;
}

/* First index of the maximum: the maximum first (vmaxps returns its second operand when the
 * first is NaN, so NaN never enters the running maximum), then the first element equal to it. */
QC_AVX2 static int64_t argmax_avx2(const float *x, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(x + i), m8);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float best = _mm_cvtss_f32(m4);
    for (; i < n; i++)
        if (x[i] > best) best = x[i];
    const __m256 b8 = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b8, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0;   /* only NaN */
}

/* ---------------------------------------------------------------------------------------- */
/* attention of one query over one KV head's keys                                            */

/* 8 elements of a cache row: float32, or halves through F16C */
QC_AVX2_INLINE __m256 load_kv8(const void *base, int f16, int64_t at) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
    return _mm256_loadu_ps((const float *)base + at);
}

/* The eight sums of a[0..7]'s lanes, lane k = the sum of a[k]: each by the same additions,
 * ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), whatever its lane. */
QC_AVX2_INLINE __m256 hsum8x8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight keys at a time, one accumulator each, reduced together (hsum8x8): a key's score is the
 * same sequence of operations in any lane, so it does not depend on n_keys. The last group
 * repeats the last key in its unused lanes (never reading past it) and stores only the rest. */
QC_AVX2_INLINE void attn_scores_t(const float *q, const void *k, int f16, int64_t stride, int n_keys,
                                  int hd, float scale, float *s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int k0 = 0; k0 < n_keys; k0 += 8) {
        int64_t row[8];
        for (int j = 0; j < 8; j++) row[j] = (int64_t)(k0 + j < n_keys ? k0 + j : n_keys - 1) * stride;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, load_kv8(k, f16, row[j] + d), acc[j]);
        }
        const __m256 v = _mm256_mul_ps(hsum8x8(acc), vscale);
        if (k0 + 8 <= n_keys) {
            _mm256_storeu_ps(s + k0, v);
        } else {
            float buf[8];
            _mm256_storeu_ps(buf, v);
            for (int j = 0; k0 + j < n_keys; j++) s[k0 + j] = buf[j];
        }
    }
}

/* the F16 and F32 caches each get their own loop (f16 a constant in each) */
QC_AVX2 static void attn_scores_avx2(const float *q, const void *k, int f16, int64_t stride, int n_keys,
                                     int hd, float scale, float *s) {
    if (f16) attn_scores_t(q, k, 1, stride, n_keys, hd, scale, s);
    else attn_scores_t(q, k, 0, stride, n_keys, hd, scale, s);
}

/* s = exp(s - max) / sum: the maximum in 8 lanes, the exponentials and their sum in 8 lanes (the
 * tail through a padded vector, its lanes past n left out of the sum), then the division. */
QC_AVX2 static void softmax_avx2(float *s, int n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(s + i), m8);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float mx = _mm_cvtss_f32(m4);
    for (int j = i; j < n; j++)
        if (s[j] > mx) mx = s[j];
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
        _mm256_storeu_ps(s + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum_ps(sum8);
    if (i < n) {
        float buf[8];
        for (int j = 0; j < 8; j++) buf[j] = i + j < n ? s[i + j] : mx;
        _mm256_storeu_ps(buf, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(buf), vmx)));
        for (int j = 0; i + j < n; j++) {
            s[i + j] = buf[j];
            sum += buf[j];
        }
    }
    const __m256 vsum = _mm256_set1_ps(sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_div_ps(_mm256_loadu_ps(s + i), vsum));
    for (; i < n; i++) s[i] = s[i] / sum;
}

/* out[d0 .. d0 + 8 * W) over every key, W vectors of accumulators held in registers */
QC_AVX2_INLINE void attn_values_cols(const float *p, const void *v, int f16, int64_t stride, int n_keys,
                                     int d0, int w, float *out) {
    __m256 acc[8];
    for (int j = 0; j < w; j++) acc[j] = _mm256_setzero_ps();
    for (int key = 0; key < n_keys; key++) {
        const __m256 pk = _mm256_broadcast_ss(p + key);
        const int64_t row = (int64_t)key * stride + d0;
        for (int j = 0; j < w; j++) acc[j] = _mm256_fmadd_ps(pk, load_kv8(v, f16, row + 8 * j), acc[j]);
    }
    for (int j = 0; j < w; j++) _mm256_storeu_ps(out + d0 + 8 * j, acc[j]);
}

QC_AVX2 static void attn_values_avx2(const float *p, const void *v, int f16, int64_t stride, int n_keys,
                                     int hd, float *out) {
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) {
        if (f16) attn_values_cols(p, v, 1, stride, n_keys, d0, 8, out);
        else attn_values_cols(p, v, 0, stride, n_keys, d0, 8, out);
    }
    for (; d0 < hd; d0 += 8) {
        if (f16) attn_values_cols(p, v, 1, stride, n_keys, d0, 1, out);
        else attn_values_cols(p, v, 0, stride, n_keys, d0, 1, out);
    }
}

static const qc_simd_kernels avx2_kernels = {
    .name = "avx2+fma+f16c",
    .quantize = quantize_avx2,
    .q8_dot = {
        [QC_TYPE_Q4_0] = q4_0_dot,
        [QC_TYPE_Q5_0] = q5_0_dot,
        [QC_TYPE_Q8_0] = q8_0_dot,
        [QC_TYPE_Q4_K] = q4_K_dot,
        [QC_TYPE_Q6_K] = q6_K_dot,
    },
    .f_dot = {
        [QC_TYPE_F32] = f32_dot,
        [QC_TYPE_F16] = f16_dot,
    },
    .silu_mul = silu_mul_avx2,
    .sumsq = sumsq_avx2,
    .argmax = argmax_avx2,
    .attn_scores = attn_scores_avx2,
    .softmax = softmax_avx2,
    .attn_values = attn_values_avx2,
};

float qc_simd_f16_table[65536];

QC_AVX2 static void fill_f16_table(void) {
    for (int i = 0; i < 65536; i++) qc_simd_f16_table[i] = _cvtsh_ss((qc_half)i);
}

/* Called once, by cpu_simd.c's detection (pthread_once), and only where the CPU has AVX2, FMA
 * and F16C: it fills the fp16 table before any kernel runs. */
const qc_simd_kernels *qc_simd_avx2_kernels(void) {
    fill_f16_table();
    return &avx2_kernels;
}

#else

const qc_simd_kernels *qc_simd_avx2_kernels(void) { return NULL; }

#endif
