/* common.h: error reporting and size arithmetic shared by every C layer.
 *
 * Internal C code never raises Python exceptions and never exits: a function that can fail
 * returns 0 on success or -1 on failure, after filling a qc_error. Only the binding layer
 * (py_*.c) turns a qc_error into a Python exception (see py_common.h).
 */
#ifndef QC_COMMON_H
#define QC_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    QC_OK = 0,
    QC_ERR_VALUE,   /* bad argument from the caller: ValueError            */
    QC_ERR_GGUF,    /* malformed / unsupported GGUF file: GGUFError        */
    QC_ERR_MODEL,   /* file is GGUF but not a model we can run: ModelError */
    QC_ERR_CUDA,    /* CUDA / cuBLAS failure: CudaError                    */
    QC_ERR_NOMEM,   /* host allocation failed: MemoryError                 */
    QC_ERR_IO,      /* open/mmap/read failed: OSError                      */
    QC_ERR_RANGE,   /* token id / context overflow: IndexError-ish -> ValueError */
    QC_ERR_CALLBACK,/* a caller's callback failed and set its own error (a Python exception) */
} qc_errkind;

typedef struct qc_error {
    qc_errkind kind;
    char msg[512];
} qc_error;

/* Fill err (if not NULL) and return -1, so callers write `return qc_fail(err, ...)`. */
int qc_fail(qc_error *err, qc_errkind kind, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Overflow-checked arithmetic for sizes that come from files: 0 on success, -1 on overflow. */
static inline int qc_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return -1;
    *out = a * b;
    return 0;
}
static inline int qc_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (b > UINT64_MAX - a) return -1;
    *out = a + b;
    return 0;
}

/* IEEE half / bfloat16 <-> float, bit exact (no hardware half support needed): the one
 * converter pair of the C code (dequantize, the CPU backend's F16 KV cache, the benches). */
static inline float qc_bits_to_fp32(uint32_t u) {
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
}

/* Half to float, equal to NumPy's for every value (NaNs keep their payload), written with masks
 * instead of branches so that loops over it vectorise: normal numbers only need their exponent
 * rebiased (127 - 15 = 112), subnormals are an integer times 2^-24 (exact in float), and
 * exponent 31 maps to 255. */
static inline float qc_fp16_to_fp32(uint16_t h) {
    union { float f; uint32_t u; } sub;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    const uint32_t sub_mask = 0u - (uint32_t)(em < 0x0400u);
    const uint32_t special_mask = 0u - (uint32_t)(em >= 0x7c00u);
    const uint32_t normal = (em << 13) + (112u << 23);
    const uint32_t special = (em << 13) | 0x7f800000u;
    sub.f = (float)(int32_t)em * (1.0f / 16777216.0f);   /* 2^-24 */
    const uint32_t bits = (normal & ~(sub_mask | special_mask)) | (special & special_mask) |
                          (sub.u & sub_mask);
    return qc_bits_to_fp32(bits | sign);
}

/* Float to half, round to nearest even, like NumPy's float16 cast. */
uint16_t qc_fp32_to_fp16(float f);

static inline float qc_bf16_to_fp32(uint16_t h) { return qc_bits_to_fp32((uint32_t)h << 16); }

#ifdef __cplusplus
}
#endif
#endif /* QC_COMMON_H */
