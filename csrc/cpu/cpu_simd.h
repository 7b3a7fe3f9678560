/* cpu_simd.h: the CPU backend's fast kernels, chosen at run time from the CPU's features.
 *
 * The plain C ops (cpu_ops.c, quants.c) are the reference: float32 activations, one float dot
 * per (row, token). The fast ops (cpu_fast.c) compute the same contracts of backend.h the way
 * llama.cpp does on a CPU:
 *  - activations are quantized per block of 32 to 8 bits (qc_q8_block: x ~ d * q, q in
 *    -127..127, round to nearest even, d = max|x| / 127), once per matmul;
 *  - every weight block is multiplied with them in integers (AVX2: vpmaddubsw + vpmaddwd;
 *    where the CPU has VNNI, vpdpbusd: simd_vnni.c) and scaled to float once per block of 32
 *    (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K);
 *  - F32 and F16 weights keep float activations (FMA over 8 lanes; F16 through F16C);
 *  - every other type falls back to the reference's qc_dot_row.
 * The kernels are compiled with per-function target attributes (simd_avx2.c, simd_vnni.c), so
 * the module is still built for baseline x86-64 and runs anywhere; qc_simd_get() picks a set
 * once, from cpuid (or QWENCUDA_CPU_KERNELS, below), and returns NULL where the CPU lacks AVX2
 * (or on other architectures): the backend then runs the reference ops. -DQC_NO_SIMD builds
 * without them (what other architectures get: the portable path).
 *
 * The sets, best first: "avx512vnni" (vpdpbusd in its EVEX form on ymm registers: AVX512-VNNI
 * and AVX512VL, with the OS saving the AVX-512 state), "avxvnni" (its VEX form, AVX-VNNI), then
 * "avx2". The VNNI sets replace the q8 dot kernels but Q6_K's, compiled from the AVX2 set's own
 * source (simd_q8_kernels.h), and give its results bit for bit: their integer sums per 32-bit
 * lane are the same exact integers, and everything in float is the same code (simd_vnni.c). QWENCUDA_CPU_KERNELS, read once,
 * forces one: auto (or unset: the best), avx2, vnni (the best VNNI set), avxvnni, avx512vnni,
 * or float / portable (the reference ops); a value this CPU cannot run, or an unknown one, is
 * an error of every CPU backend created (qc_simd_error).
 *
 * Numerics of the 8-bit path: quantizing x costs a relative error of at most 1/254 of a
 * block's largest |x| per element (typically ~1e-3 of a dot product's scale), the products
 * are exact integers, and the scaled block sums are accumulated in float32 (FMA, 8 lanes,
 * added pairwise at the end). Each (row, token) value is computed by the same instruction
 * sequence whatever the number of tokens of the call, so a prefill gives exactly the bits of
 * token-by-token decoding, and the fused ops equal their unfused sequences bit for bit.
 */
#ifndef QC_CPU_SIMD_H
#define QC_CPU_SIMD_H

#include <stdint.h>

#define QC_Q8_BLOCK 32

/* 32 activations quantized: x[i] ~ d * qs[i]; s = d * sum(qs), exactly what the offsets of
 * Q4_0 / Q5_0 / Q4_K blocks need (their dot products subtract offset * sum x). 40 bytes. */
typedef struct {
    float d;
    float s;
    int8_t qs[QC_Q8_BLOCK];
} qc_q8_block;

/* Tokens that one call of a q8 dot kernel multiplies with one weight row: the row's blocks
 * are unpacked once and used for each token (a prefill's dominant cost is unpacking). */
#define QC_Q8_MAX_TOKENS 8

/* out[t] = dot(row, token t) for t < n_tok (1..QC_Q8_MAX_TOKENS), where token t's blocks are
 * x[t * x_stride .. t * x_stride + n_blocks), n_blocks = row elements / 32. */
typedef void (*qc_q8_dot_fn)(const void *row, const qc_q8_block *x, int64_t x_stride, int n_tok,
                             int64_t n_blocks, float *out);
/* dot(row, x) of a float row type (F32, F16) with float activations, n elements. */
typedef float (*qc_f_dot_fn)(const void *row, const float *x, int64_t n);
/* n values of x (a multiple of 32) to n / 32 blocks. */
typedef void (*qc_q8_quantize_fn)(const float *x, int64_t n, qc_q8_block *out);
/* out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u, n values (out may alias g or u). */
typedef void (*qc_silu_mul_fn)(const float *g, const float *u, int64_t n, float *out);
/* The sum of x[i]^2 in float64 (rmsnorm's sum of squares, in the kernel's lane order). */
typedef double (*qc_sumsq_fn)(const float *x, int64_t n);
/* The index of the first maximum of x[n] (NaN never wins, all-NaN gives 0). */
typedef int64_t (*qc_argmax_fn)(const float *x, int64_t n);

/* Attention over the keys of one KV head for one query (cpu_fast.c's attention). The keys and
 * values are rows `stride` elements apart, float32 or (f16 != 0) IEEE halves; head_dim is a
 * multiple of 8. scores: s[k] = dot(q, key k) * scale, k < n_keys (float32, 8 lanes);
 * softmax: s = exp(s - max) / their sum, in place (float32, the 8-wide exp of silu_mul);
 * values: out[d] = sum_k p[k] * value k [d], accumulated in key order (float32). */
typedef void (*qc_attn_scores_fn)(const float *q, const void *k, int f16, int64_t stride, int n_keys,
                                  int head_dim, float scale, float *s);
typedef void (*qc_softmax_fn)(float *s, int n);
typedef void (*qc_attn_values_fn)(const float *p, const void *v, int f16, int64_t stride, int n_keys,
                                  int head_dim, float *out);

typedef struct {
    const char *name;                      /* "avx2+fma+f16c": what build_info reports */
    qc_q8_quantize_fn quantize;
    qc_q8_dot_fn q8_dot[64];               /* by qc_type; NULL: no 8-bit kernel for the type */
    qc_f_dot_fn f_dot[64];                 /* by qc_type; F32 and F16 */
    qc_silu_mul_fn silu_mul;
    qc_sumsq_fn sumsq;
    qc_argmax_fn argmax;
    qc_attn_scores_fn attn_scores;
    qc_softmax_fn softmax;
    qc_attn_values_fn attn_values;
} qc_simd_kernels;

/* The fast kernels this CPU runs, or NULL (no AVX2 + FMA + F16C, not x86-64, or
 * QWENCUDA_CPU_KERNELS=float / portable / a value in error): detected once (thread-safe). */
const qc_simd_kernels *qc_simd_get(void);

/* Why QWENCUDA_CPU_KERNELS cannot be honoured (an unknown value, or a set this CPU lacks), or
 * NULL: the CPU backend fails to be created with this message (a ValueError in Python). */
const char *qc_simd_error(void);

/* "avx2+fma+f16c, q8 dot products (Q4_0 Q5_0 Q8_0 Q4_K Q6_K), f16/f32 fma" or "portable C
 * (float32 reference)": what the default CPU backend runs on this machine, with
 * "; QWENCUDA_CPU_KERNELS=<value>" when that chose it, or "error: <qc_simd_error()>". */
const char *qc_simd_describe(void);

/* The x86-64 kernels (simd_avx2.c); NULL where the compiler cannot build them. Call only where
 * the CPU has AVX2, FMA and F16C, and once (it fills their fp16 table): qc_simd_get does. */
const qc_simd_kernels *qc_simd_avx2_kernels(void);

/* The VNNI sets (simd_vnni.c): avx2's set (made first: it fills the fp16 table) with its q8
 * dot kernels but Q6_K's replaced by vpdpbusd ones, in its EVEX form (avx512 != 0; call only
 * where the CPU has AVX512-VNNI and AVX512VL and the OS saves the AVX-512 state) or its VEX form
 * (AVX-VNNI). NULL where the compiler cannot build them. Called once, by qc_simd_get. */
const qc_simd_kernels *qc_simd_vnni_kernels(const qc_simd_kernels *avx2, int avx512);

/* Portable C quantization, the specification of the SIMD one (bit-identical). */
void qc_q8_quantize_ref(const float *x, int64_t n, qc_q8_block *out);

#endif /* QC_CPU_SIMD_H */
