/* cpu_simd.c: which fast kernels this CPU runs (detected once from cpuid), and the portable
 * specification of the 8-bit activation format (cpu_simd.h). */
#include "cpu_simd.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
#include <cpuid.h>
#endif

static const qc_simd_kernels *g_kernels;
static char g_describe[160];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void detect(void) {
    const qc_simd_kernels *k = NULL;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
    /* gcc and clang read cpuid (and whether the OS saves the AVX registers, XCR0) once at load;
     * __builtin_cpu_init makes that explicit for code that may run before constructors. F16C
     * is cpuid leaf 1, ecx bit 29, read directly: not every compiler's __builtin_cpu_supports
     * knows it (clang 14 does not). */
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)))
        k = qc_simd_avx2_kernels();
#endif
    g_kernels = k;
    if (k)
        snprintf(g_describe, sizeof g_describe,
                 "%s, q8 dot products (Q4_0 Q5_0 Q8_0 Q4_K Q6_K), f16/f32 fma", k->name);
    else
        snprintf(g_describe, sizeof g_describe, "portable C (float32 reference)");
}

const qc_simd_kernels *qc_simd_get(void) {
    pthread_once(&g_once, detect);
    return g_kernels;
}

const char *qc_simd_describe(void) {
    pthread_once(&g_once, detect);
    return g_describe;
}

/* The 8-bit format, written plainly: d = max|x| / 127, q = x / d rounded to nearest (ties to
 * even, the default rounding mode that vroundps also uses), s = d * sum(q). A block of zeros
 * gives d = 0 and q = 0. Non-finite inputs give unspecified (but defined) codes. */
void qc_q8_quantize_ref(const float *x, int64_t n, qc_q8_block *out) {
    for (int64_t b = 0; b < n / QC_Q8_BLOCK; b++) {
        const float *xb = x + b * QC_Q8_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < QC_Q8_BLOCK; i++)
            if (fabsf(xb[i]) > amax) amax = fabsf(xb[i]);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QC_Q8_BLOCK; i++) {
            const float v = nearbyintf(xb[i] * id);
            const int q = v > 127.0f ? 127 : v < -127.0f ? -127 : v == v ? (int)v : 0;
            out[b].qs[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}
