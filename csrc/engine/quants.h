/* quants.h: GGML tensor types and block formats: the single source of truth shared by the
 * GGUF reader, the CPU backend and the CUDA kernels (this header compiles as C11 and CUDA C++).
 *
 * The enum values ARE the file format (GGUF stores them): never renumber.
 * Each block struct has a static size assert; a comment gives its bits per weight.
 */
#ifndef QC_QUANTS_H
#define QC_QUANTS_H

#include <stdint.h>
#include "common.h"

#ifdef __cplusplus
extern "C" {
#define QC_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define QC_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

typedef enum {
    QC_TYPE_F32 = 0,
    QC_TYPE_F16 = 1,
    QC_TYPE_Q4_0 = 2,
    QC_TYPE_Q4_1 = 3,
    QC_TYPE_Q5_0 = 6,
    QC_TYPE_Q5_1 = 7,
    QC_TYPE_Q8_0 = 8,
    QC_TYPE_Q8_1 = 9,
    QC_TYPE_Q2_K = 10,
    QC_TYPE_Q3_K = 11,
    QC_TYPE_Q4_K = 12,
    QC_TYPE_Q5_K = 13,
    QC_TYPE_Q6_K = 14,
    QC_TYPE_Q8_K = 15,
    QC_TYPE_IQ2_XXS = 16,
    QC_TYPE_IQ2_XS = 17,
    QC_TYPE_IQ3_XXS = 18,
    QC_TYPE_IQ1_S = 19,
    QC_TYPE_IQ4_NL = 20,
    QC_TYPE_IQ3_S = 21,
    QC_TYPE_IQ2_S = 22,
    QC_TYPE_IQ4_XS = 23,
    QC_TYPE_I8 = 24,
    QC_TYPE_I16 = 25,
    QC_TYPE_I32 = 26,
    QC_TYPE_I64 = 27,
    QC_TYPE_F64 = 28,
    QC_TYPE_IQ1_M = 29,
    QC_TYPE_BF16 = 30,
    QC_TYPE_TQ1_0 = 34,
    QC_TYPE_TQ2_0 = 35,
    QC_TYPE_MXFP4 = 39,
    QC_TYPE_NVFP4 = 40,
    QC_TYPE_Q1_0 = 41,
    QC_TYPE_COUNT = 42,   /* one past the largest value this table knows */
} qc_type;

#define QC_QK 32      /* elements per block of the legacy formats */
#define QC_QK_K 256   /* elements per super-block of the K formats */
#define QC_K_SCALE_SIZE 12

typedef uint16_t qc_half;  /* IEEE binary16 bits */

/* 4.5 bpw: x = d * (q - 8), q in 0..15; low nibbles hold elements 0..15, high 16..31 */
typedef struct { qc_half d; uint8_t qs[QC_QK / 2]; } qc_block_q4_0;
QC_STATIC_ASSERT(sizeof(qc_block_q4_0) == 18, "q4_0 size");

/* 5.0 bpw: x = d * q + m */
typedef struct { qc_half d; qc_half m; uint8_t qs[QC_QK / 2]; } qc_block_q4_1;
QC_STATIC_ASSERT(sizeof(qc_block_q4_1) == 20, "q4_1 size");

/* 5.5 bpw: x = d * (q - 16), the 5th bit of element j in bit j of qh */
typedef struct { qc_half d; uint8_t qh[4]; uint8_t qs[QC_QK / 2]; } qc_block_q5_0;
QC_STATIC_ASSERT(sizeof(qc_block_q5_0) == 22, "q5_0 size");

/* 6.0 bpw: x = d * q + m */
typedef struct { qc_half d; qc_half m; uint8_t qh[4]; uint8_t qs[QC_QK / 2]; } qc_block_q5_1;
QC_STATIC_ASSERT(sizeof(qc_block_q5_1) == 24, "q5_1 size");

/* 8.5 bpw: x = d * q */
typedef struct { qc_half d; int8_t qs[QC_QK]; } qc_block_q8_0;
QC_STATIC_ASSERT(sizeof(qc_block_q8_0) == 34, "q8_0 size");

/* 2.625 bpw: 16 sub-blocks of 16, 4-bit scale and 4-bit min per sub-block */
typedef struct {
    uint8_t scales[QC_QK_K / 16];
    uint8_t qs[QC_QK_K / 4];
    qc_half d;
    qc_half dmin;
} qc_block_q2_K;
QC_STATIC_ASSERT(sizeof(qc_block_q2_K) == 84, "q2_K size");

/* 3.4375 bpw: 16 sub-blocks of 16, 6-bit scales, high bit in hmask */
typedef struct {
    uint8_t hmask[QC_QK_K / 8];
    uint8_t qs[QC_QK_K / 4];
    uint8_t scales[12];
    qc_half d;
} qc_block_q3_K;
QC_STATIC_ASSERT(sizeof(qc_block_q3_K) == 110, "q3_K size");

/* 4.5 bpw: 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes */
typedef struct {
    qc_half d;
    qc_half dmin;
    uint8_t scales[QC_K_SCALE_SIZE];
    uint8_t qs[QC_QK_K / 2];
} qc_block_q4_K;
QC_STATIC_ASSERT(sizeof(qc_block_q4_K) == 144, "q4_K size");

/* 5.5 bpw: as q4_K plus a 5th bit in qh */
typedef struct {
    qc_half d;
    qc_half dmin;
    uint8_t scales[QC_K_SCALE_SIZE];
    uint8_t qh[QC_QK_K / 8];
    uint8_t qs[QC_QK_K / 2];
} qc_block_q5_K;
QC_STATIC_ASSERT(sizeof(qc_block_q5_K) == 176, "q5_K size");

/* 6.5625 bpw: 16 sub-blocks of 16, int8 scales, x = d * scale * (q - 32) */
typedef struct {
    uint8_t ql[QC_QK_K / 2];
    uint8_t qh[QC_QK_K / 4];
    int8_t scales[QC_QK_K / 16];
    qc_half d;
} qc_block_q6_K;
QC_STATIC_ASSERT(sizeof(qc_block_q6_K) == 210, "q6_K size");

/* Dequantize n elements (a multiple of the type's block size) from src into dst. */
typedef void (*qc_dequantize_fn)(const void *src, float *dst, int64_t n);

typedef struct {
    const char *name;          /* "Q4_K", as gguf and llama.cpp spell it */
    int64_t block_size;        /* elements per block (1 for plain types) */
    int64_t type_size;         /* bytes per block; 0: unknown / removed type */
    qc_dequantize_fn dequantize;  /* NULL: the reader lists it, the engine cannot run it */
} qc_type_traits;

/* Traits of type t, or NULL when t is not a type value GGUF defines. */
const qc_type_traits *qc_type_get(uint32_t t);

/* The names of the types qwencuda decodes, in type-value order, space-separated
 * ("F32 F16 Q4_0 ... Q6_K BF16"), from the traits table; cut to fit size. */
void qc_supported_type_names(char *buf, size_t size);

/* Bytes of a row of n elements; -1 if n is not a multiple of the block size or t unknown. */
int64_t qc_row_bytes(uint32_t t, int64_t n);

/* Dequantize nrows rows of ncols elements each. Fails (QC_ERR_VALUE) on unsupported types or
 * a ncols that is not a multiple of the block size. */
int qc_dequantize(uint32_t t, const void *src, float *dst, int64_t nrows, int64_t ncols, qc_error *err);

/* Dot product of one stored row (ncols elements of type t) with a float vector x. Used by
 * the CPU backend's matmul: it dequantizes 256 elements at a time into a stack buffer (never a
 * float copy of the row) and equals, bit for bit, the F32 dot of the dequantized row. */
float qc_dot_row(uint32_t t, const void *row, const float *x, int64_t ncols);

#ifdef __cplusplus
}
#endif
#endif /* QC_QUANTS_H */
