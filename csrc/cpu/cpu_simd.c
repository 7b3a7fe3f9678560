/* cpu_simd.c: which fast kernels this CPU runs (detected once from cpuid, or forced by
 * QWENCUDA_CPU_KERNELS), and the portable specification of the 8-bit activation format
 * (cpu_simd.h). */
#include "cpu_simd.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
#include <cpuid.h>
#endif

static const qc_simd_kernels *g_kernels;
static char g_describe[400];
static char g_error[320];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* The kernel sets this CPU can run (and its OS: the registers' state must be saved). */
typedef struct {
    int avx2;         /* AVX2 + FMA + F16C, with the OS saving the ymm state */
    int avxvnni;      /* and AVX-VNNI (vpdpbusd, VEX) */
    int avx512vnni;   /* and AVX512-VNNI + AVX512VL (vpdpbusd, EVEX) with the AVX-512 state saved */
} cpu_features;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
/* cpuid's bits (Intel SDM vol. 2, CPUID; the same on AMD), read directly rather than through
 * __builtin_cpu_supports, which not every compiler knows avxvnni or f16c by. */
static cpu_features detect_features(void) {
    cpu_features f = {0, 0, 0};
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && fma && f16c)) return f;
    /* XCR0: which register state the OS saves on a context switch. Bits 1, 2: xmm and ymm
     * (AVX); bits 5, 6, 7: the opmasks and the upper halves of zmm0-15 and zmm16-31, which every
     * EVEX instruction needs enabled, even on ymm registers. xgetbv exists where OSXSAVE is set. */
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0x06u) != 0x06u || __get_cpuid_max(0, NULL) < 7) return f;
    unsigned max_sub;
    __cpuid_count(7, 0, max_sub, b, c, d);
    f.avx2 = (b >> 5) & 1;
    const int avx512f = (b >> 16) & 1, avx512vl = (b >> 31) & 1, avx512vnni = (c >> 11) & 1;
    f.avx512vnni = f.avx2 && avx512f && avx512vl && avx512vnni && (xlo & 0xe0u) == 0xe0u;
    if (max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        f.avxvnni = f.avx2 && ((a >> 4) & 1);
    }
    return f;
}
#else
static cpu_features detect_features(void) {
    cpu_features f = {0, 0, 0};
    return f;
}
#endif

/* QWENCUDA_CPU_KERNELS's values (cpu_simd.h) */
enum { WANT_AUTO, WANT_REFERENCE, WANT_AVX2, WANT_VNNI, WANT_AVXVNNI, WANT_AVX512VNNI, WANT_UNKNOWN };

static int parse_want(const char *env) {
    static const struct { const char *name; int want; } names[] = {
        {"", WANT_AUTO}, {"auto", WANT_AUTO}, {"float", WANT_REFERENCE}, {"portable", WANT_REFERENCE},
        {"avx2", WANT_AVX2}, {"vnni", WANT_VNNI}, {"avxvnni", WANT_AVXVNNI}, {"avx512vnni", WANT_AVX512VNNI},
    };
    if (env == NULL) return WANT_AUTO;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(env, names[i].name) == 0) return names[i].want;
    return WANT_UNKNOWN;
}

static void detect(void) {
    const char *env = getenv("QWENCUDA_CPU_KERNELS");
    const int want = parse_want(env);
    const cpu_features f = detect_features();
    const qc_simd_kernels *avx2 = f.avx2 ? qc_simd_avx2_kernels() : NULL;
    const qc_simd_kernels *vex = avx2 && f.avxvnni ? qc_simd_vnni_kernels(avx2, 0) : NULL;
    const qc_simd_kernels *evex = avx2 && f.avx512vnni ? qc_simd_vnni_kernels(avx2, 1) : NULL;
    const qc_simd_kernels *best_vnni = evex ? evex : vex;
    const qc_simd_kernels *k = NULL;
    const char *lacks = NULL;   /* what the CPU lacks for the set asked for */
    switch (want) {
    case WANT_AUTO: k = best_vnni ? best_vnni : avx2; break;
    case WANT_REFERENCE: k = NULL; break;
    case WANT_AVX2: k = avx2; lacks = "AVX2, FMA and F16C"; break;
    case WANT_VNNI: k = best_vnni; lacks = "AVX512-VNNI (with AVX512VL) and AVX-VNNI"; break;
    case WANT_AVXVNNI: k = vex; lacks = "AVX-VNNI"; break;
    case WANT_AVX512VNNI: k = evex; lacks = "AVX512-VNNI with AVX512VL"; break;
    default:
        snprintf(g_error, sizeof g_error,
                 "QWENCUDA_CPU_KERNELS='%.40s': expected auto, avx2, vnni, avxvnni, avx512vnni, float "
                 "or portable", env);
        break;
    }
    if (k == NULL && lacks != NULL) {
        const qc_simd_kernels *best = best_vnni ? best_vnni : avx2;
        snprintf(g_error, sizeof g_error,
                 "QWENCUDA_CPU_KERNELS=%s: this CPU (or its OS, or this build) lacks %s; it can run: %s",
                 env, lacks, best ? best->name : "portable C only");
    }
    g_kernels = g_error[0] ? NULL : k;
    if (g_error[0])
        snprintf(g_describe, sizeof g_describe, "error: %s", g_error);
    else if (k)
        snprintf(g_describe, sizeof g_describe, "%s, q8 dot products (Q4_0 Q5_0 Q8_0 Q4_K Q6_K)%s, f16/f32 fma%s%s",
                 k->name, k == avx2 ? "" : " (all but Q6_K by vpdpbusd)", want == WANT_AUTO ? "" : "; QWENCUDA_CPU_KERNELS=",
                 want == WANT_AUTO ? "" : env);
    else
        snprintf(g_describe, sizeof g_describe, "portable C (float32 reference)%s%s",
                 want == WANT_AUTO ? "" : "; QWENCUDA_CPU_KERNELS=", want == WANT_AUTO ? "" : env);
}

const qc_simd_kernels *qc_simd_get(void) {
    pthread_once(&g_once, detect);
    return g_kernels;
}

const char *qc_simd_error(void) {
    pthread_once(&g_once, detect);
    return g_error[0] ? g_error : NULL;
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
