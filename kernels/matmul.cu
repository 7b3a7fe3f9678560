/* matmul.cu: out[n][rows] = x[n][cols] @ W^T (+ bias), W stored as in the file.
 *
 * Decode and short batches (n <= QC_GEMV_MAX_TOKENS): a GEMV per block format that reads the
 * stored blocks directly, once per call however many tokens: one warp per output row, lane l
 * takes parts l, l + 32, ... of the row (8 elements each, qc_dequant.cuh), so a warp sweeps the
 * row's bytes contiguously; up to NT tokens share each decoded part. Accumulation is fp32.
 *
 * Prefill (n > QC_GEMV_MAX_TOKENS): cuBLAS on tensor cores. F32 weights go to an fp32 GEMM as
 * they are; F16 weights are used in place with x converted to f16; the block formats are decoded
 * tile by tile (a bounded scratch, QC_TILE_ELEMS elements) into f16, BF16 into f32 (its range
 * exceeds f16). fp32 accumulation everywhere.
 *
 * cuBLAS is column-major: the row-major (rows, cols) W is the column-major (cols, rows) matrix
 * with ld = cols, i.e. W^T; so out = W x is GEMM(OP_T, OP_N, m = rows, n = n_tokens, k = cols,
 * A = W, lda = cols, B = X, ldb = cols, C = Y, ldc = rows). A tile of rows r0.. writes C at
 * out + r0 with the same ldc.
 */
#include "qc_cuda.cuh"
#include "qc_dequant.cuh"

#include <cuda_fp16.h>

#define QC_GEMV_WARPS 4                 /* rows per block of the GEMV */
#define QC_TILE_ELEMS (16ll << 20)      /* prefill dequantization tile: 32 MiB as f16 */

/* x[8p .. 8p+8) of one activation row, zero past cols. */
__device__ __forceinline__ void qc_load_x8(const float *__restrict__ xr, int64_t p, int64_t cols,
                                           float v[8]) {
    const float *r = xr + 8 * p;
    if (8 * p + 8 <= cols && ((uintptr_t)r & 15) == 0) {
        const float4 a = __ldg((const float4 *)r), b = __ldg((const float4 *)(r + 4));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = 8 * p + k < cols ? __ldg(r + k) : 0.0f;
    }
}

/* Tokens t0 .. t0 + NT - 1 (those < n) of x against row blockIdx.x * WARPS + warp of W. */
template <int T, int NT>
__global__ void __launch_bounds__(32 * QC_GEMV_WARPS)
qc_gemv_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t rows, int64_t cols,
               const float *__restrict__ x, int n, const float *__restrict__ bias,
               float *__restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * QC_GEMV_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * NT;
    if (r >= rows) return;   /* whole warps leave together: the shuffles below stay full */
    const uint8_t *row = W + r * row_bytes;
    const int64_t parts = (cols + 7) / 8;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;

    for (int64_t p = lane; p < parts; p += 32) {
        float w[8];
        qc_deq8<T>(row, p, cols, w);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (t0 + j < n) {
                float xv[8];
                qc_load_x8(x + (int64_t)(t0 + j) * cols, p, cols, xv);
#pragma unroll
                for (int k = 0; k < 8; k++) acc[j] = fmaf(w[k], xv[k], acc[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
        float s = acc[j];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0 && t0 + j < n) out[(int64_t)(t0 + j) * rows + r] = bias ? s + bias[r] : s;
    }
}

template <int T>
static void launch_gemv(const qc_weight *w, const float *bias, const float *x, int n, float *out,
                        cudaStream_t st) {
    const int64_t rb = qc_row_bytes_t<T>(w->cols);
    const unsigned gx = (unsigned)((w->rows + QC_GEMV_WARPS - 1) / QC_GEMV_WARPS);
    const dim3 block(32 * QC_GEMV_WARPS);
    const uint8_t *W = (const uint8_t *)w->data;
    if (n == 1) {
        qc_gemv_kernel<T, 1><<<dim3(gx, 1), block, 0, st>>>(W, rb, w->rows, w->cols, x, n, bias, out);
    } else if (n == 2) {
        qc_gemv_kernel<T, 2><<<dim3(gx, 1), block, 0, st>>>(W, rb, w->rows, w->cols, x, n, bias, out);
    } else if (n <= 4) {
        qc_gemv_kernel<T, 4><<<dim3(gx, 1), block, 0, st>>>(W, rb, w->rows, w->cols, x, n, bias, out);
    } else {
        const unsigned gy = (unsigned)((n + 7) / 8);
        qc_gemv_kernel<T, 8><<<dim3(gx, gy), block, 0, st>>>(W, rb, w->rows, w->cols, x, n, bias, out);
    }
}

/* out[n][rows] (ldc = rows, starting at row r0) = X[n][cols] @ A^T for A (m, cols). */
static int gemm(qc_backend *be, const void *A, cudaDataType_t atype, const void *X,
                cudaDataType_t xtype, int64_t m, int64_t cols, int n, float *C, int64_t ldc) {
    qc_cuda *cu = qc_cuda_of(be);
    const float one = 1.0f, zero = 0.0f;
    return QC_CUBLAS(be, cublasGemmEx(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, (int)cols,
                                      &one, A, atype, (int)cols, X, xtype, (int)cols, &zero, C,
                                      CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
}

static int matmul_cublas(qc_backend *be, const qc_weight *w, const float *bias, const float *x,
                         int n, float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    const int64_t rows = w->rows, cols = w->cols;
    if (rows > INT32_MAX || cols > INT32_MAX)
        return qc_cuda_value_error(be, "matmul: %lld x %lld is too large for cuBLAS", (long long)rows, (long long)cols);

    if (w->type == QC_TYPE_F32) {
        if (gemm(be, w->data, CUDA_R_32F, x, CUDA_R_32F, rows, cols, n, out, rows) < 0) return -1;
    } else {
        /* f16 activations for the f16 paths, f32 for BF16 */
        const int half = w->type != QC_TYPE_BF16;
        const void *X = x;
        if (half) {
            if (qc_cuda_scratch(be, &cu->scratch_x, &cu->scratch_x_bytes, (size_t)n * (size_t)cols * sizeof(__half)) < 0 ||
                qc_cuda_to_half(be, x, cu->scratch_x, (int64_t)n * cols) < 0)
                return -1;
            X = cu->scratch_x;
        }
        const cudaDataType_t dt = half ? CUDA_R_16F : CUDA_R_32F;
        if (w->type == QC_TYPE_F16) {
            if (gemm(be, w->data, CUDA_R_16F, X, CUDA_R_16F, rows, cols, n, out, rows) < 0) return -1;
        } else {
            int64_t tile = QC_TILE_ELEMS / cols;
            if (tile < 1) tile = 1;
            if (tile > rows) tile = rows;
            const size_t esize = half ? sizeof(__half) : sizeof(float);
            if (qc_cuda_scratch(be, &cu->scratch_w, &cu->scratch_w_bytes, (size_t)tile * (size_t)cols * esize) < 0)
                return -1;
            for (int64_t r0 = 0; r0 < rows; r0 += tile) {
                const int64_t m = rows - r0 < tile ? rows - r0 : tile;
                if (qc_cuda_dequantize_rows(be, w, r0, m, cu->scratch_w, half) < 0 ||
                    gemm(be, cu->scratch_w, dt, X, dt, m, cols, n, out + r0, rows) < 0)
                    return -1;
            }
        }
    }
    return bias ? qc_cuda_add_bias(be, out, bias, n, rows) : 0;
}

int qc_cuda_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                   float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n <= 0 || w->rows <= 0) return 0;
    if (!qc_cuda_type_supported(w->type))
        return qc_cuda_value_error(be, "matmul: weight type %u is not supported by the CUDA backend", w->type);
    if (n > QC_GEMV_MAX_TOKENS) return matmul_cublas(be, w, bias, x, n, out);
    if ((w->rows + QC_GEMV_WARPS - 1) / QC_GEMV_WARPS > INT32_MAX)
        return qc_cuda_value_error(be, "matmul: %lld rows is too many", (long long)w->rows);
    switch (w->type) {
#define QC_CASE_(T) case T: launch_gemv<T>(w, bias, x, n, out, cu->stream); break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_gemv_kernel");
}
