/* embed.cu: rows of a stored weight decoded to floats: the embedding lookup (rows chosen by
 * token ids read from device memory) and the dequantization of a range of rows into f16 or f32
 * (the tile that matmul's cuBLAS path multiplies).
 *
 * One thread per part (8 elements, qc_dequant.cuh) of a row; consecutive threads take
 * consecutive parts of the same row, so a warp reads one stretch of stored bytes. */
#include "qc_cuda.cuh"
#include "qc_dequant.cuh"

/* out[i][:] = row ids[i] of W (W has cols columns, rows of row_bytes bytes). */
template <int T>
__global__ void qc_embed_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t cols,
                                const int32_t *__restrict__ ids, int n, float *__restrict__ out) {
    const int64_t parts = (cols + 7) / 8, total = parts * n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / parts, p = i % parts;
        float w[8];
        qc_deq8<T>(W + (int64_t)ids[t] * row_bytes, p, cols, w);
        float *o = out + t * cols + 8 * p;
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (8 * p + k < cols) o[k] = w[k];
    }
}

/* dst[r][:] = row (row0 + r) of W, for r < nrows, as OutT (float or __half). */
template <int T, typename OutT>
__global__ void qc_dequant_rows_kernel(const uint8_t *__restrict__ W, int64_t row_bytes,
                                       int64_t cols, int64_t row0, int64_t nrows,
                                       OutT *__restrict__ dst) {
    const int64_t parts = (cols + 7) / 8, total = parts * nrows;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / parts, p = i % parts;
        float w[8];
        qc_deq8<T>(W + (row0 + r) * row_bytes, p, cols, w);
        OutT *o = dst + r * cols + 8 * p;
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (8 * p + k < cols) o[k] = (OutT)w[k];
    }
}

static int64_t row_bytes_of(uint32_t type, int64_t cols) {
    switch (type) {
#define QC_CASE_(T) case T: return qc_row_bytes_t<T>(cols);
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    default:
        return -1;
    }
}

int qc_cuda_embed(qc_backend *be, const qc_weight *table, const int32_t *ids, int n, float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n <= 0) return 0;
    const int64_t rb = row_bytes_of(table->type, table->cols);
    if (rb < 0) return qc_cuda_value_error(be, "embed: weight type %u is not supported by the CUDA backend", table->type);
    const int threads = 256;
    const unsigned grid = qc_grid_for((table->cols + 7) / 8 * n, threads, 65535);
    const uint8_t *W = (const uint8_t *)table->data;
    switch (table->type) {
#define QC_CASE_(T)                                                                              \
    case T:                                                                                      \
        qc_embed_kernel<T><<<grid, threads, 0, cu->stream>>>(W, rb, table->cols, ids, n, out);  \
        break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_embed_kernel");
}

int qc_cuda_dequantize_rows(qc_backend *be, const qc_weight *w, int64_t row0, int64_t nrows,
                            void *dst, int half_out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (nrows <= 0) return 0;
    const int64_t rb = row_bytes_of(w->type, w->cols);
    if (rb < 0) return qc_cuda_value_error(be, "matmul: weight type %u is not supported by the CUDA backend", w->type);
    const int threads = 256;
    const unsigned grid = qc_grid_for((w->cols + 7) / 8 * nrows, threads, 4 * 65535);
    const uint8_t *W = (const uint8_t *)w->data;
    switch (w->type) {
#define QC_CASE_(T)                                                                              \
    case T:                                                                                      \
        if (half_out)                                                                            \
            qc_dequant_rows_kernel<T, __half><<<grid, threads, 0, cu->stream>>>(                 \
                W, rb, w->cols, row0, nrows, (__half *)dst);                                     \
        else                                                                                     \
            qc_dequant_rows_kernel<T, float><<<grid, threads, 0, cu->stream>>>(                  \
                W, rb, w->cols, row0, nrows, (float *)dst);                                      \
        break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_dequant_rows_kernel");
}
