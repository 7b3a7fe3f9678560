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
 * The kernels are the AVX2 set's own source (simd_q8_kernels.h: Q8_0, Q4_0, Q5_0, Q4_K) compiled
 * once more for each encoding, with vpdpbusd as the integer dot. Q6_K keeps the AVX2 kernel.
 */
#include "cpu_simd.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "quants.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(QC_NO_SIMD)
#include <immintrin.h>

#include "simd_x86.h"

/* the VEX form: AVX-VNNI */
#define QC_Q8_TARGET "avx2,fma,f16c,avxvnni"
#define QC_Q8_DOT(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
#define QC_Q8(name) name##_avxvnni
#include "simd_q8_kernels.h"
#undef QC_Q8_TARGET
#undef QC_Q8_DOT
#undef QC_Q8

/* the EVEX form on ymm registers: AVX512-VNNI + AVX512VL (zmm is never used: no frequency
 * licence, and the float part stays 8 lanes as the AVX2 set's) */
#define QC_Q8_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define QC_Q8_DOT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#define QC_Q8(name) name##_avx512vnni
#include "simd_q8_kernels.h"
#undef QC_Q8_TARGET
#undef QC_Q8_DOT
#undef QC_Q8

static qc_simd_kernels vnni_sets[2];

const qc_simd_kernels *qc_simd_vnni_kernels(const qc_simd_kernels *avx2, int avx512) {
    if (avx2 == NULL) return NULL;
    qc_simd_kernels *k = &vnni_sets[avx512 != 0];
    *k = *avx2;
    /* Q6_K keeps the AVX2 kernel: it applies the scales inside vpmaddwd, which vpdpbusd has
     * no room for, so a VNNI Q6_K kernel is no shorter */
#define QC_VNNI_SET_(sfx)                                                                       \
    k->name = "avx2+fma+f16c+" #sfx;                                                            \
    k->q8_dot[QC_TYPE_Q4_0] = q4_0_dot_##sfx;                                                   \
    k->q8_dot[QC_TYPE_Q5_0] = q5_0_dot_##sfx;                                                   \
    k->q8_dot[QC_TYPE_Q8_0] = q8_0_dot_##sfx;                                                   \
    k->q8_dot[QC_TYPE_Q4_K] = q4_K_dot_##sfx;
    if (avx512) {
        QC_VNNI_SET_(avx512vnni)
    } else {
        QC_VNNI_SET_(avxvnni)
    }
#undef QC_VNNI_SET_
    return k;
}

#else

const qc_simd_kernels *qc_simd_vnni_kernels(const qc_simd_kernels *avx2, int avx512) {
    (void)avx2;
    (void)avx512;
    return NULL;
}

#endif
