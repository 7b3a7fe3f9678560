/* embed.cu: rows of a stored weight decoded to floats: the embedding lookup (rows chosen by
 * token ids read from device memory) and the dequantization of a range of rows into f16 or f32
 * (the tile that matmul's cuBLAS path multiplies).
 *
 * Thread blocks of 32 x QC_DQ_ROWS: warp y of a block takes one row, lane x parts 32 j + x of it
 * (8 elements each, qc_dequant.cuh), so a warp reads one K super-block (or 8 small blocks) of
 * stored bytes and writes 256 consecutive outputs. No division: the row and part come from the
 * 2-D grid. Where the buffers allow it (qc_dequant_launch), blocks are read with the loads their
 * alignment permits and each part's 8 outputs are written by one 16-byte store (two for f32);
 * the decoded values are qc_deq8's in every case, so all variants write the same bits. */
#include "qc_cuda.cuh"
#include "qc_dequant.cuh"

#define QC_DQ_ROWS 8 /* rows (warps) per thread block */

/* o[0..n) = w[0..n) (n = the elements left in the row, at most 8); with VEC the caller
 * guarantees n = 8 and o 16-byte aligned. The conversion to f16 rounds to nearest, as a cast.
 * __stwb (an ordinary store) because nvcc split a plain uint4 assignment into four 4-byte ones. */
template <bool VEC>
__device__ __forceinline__ void qc_store8(float *o, const float w[8], int64_t n) {
    if constexpr (VEC) {
        __stwb((float4 *)o, make_float4(w[0], w[1], w[2], w[3]));
        __stwb((float4 *)o + 1, make_float4(w[4], w[5], w[6], w[7]));
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (k < n) o[k] = w[k];
    }
}
template <bool VEC>
__device__ __forceinline__ void qc_store8(__half *o, const float w[8], int64_t n) {
    if constexpr (VEC) {
        uint32_t u[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            u[k] = (uint32_t)__half_as_ushort(__float2half_rn(w[2 * k])) |
                   (uint32_t)__half_as_ushort(__float2half_rn(w[2 * k + 1])) << 16;
        __stwb((uint4 *)o, make_uint4(u[0], u[1], u[2], u[3]));
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (k < n) o[k] = __float2half_rn(w[k]);
    }
}

/* o[:cols] = the stored row at `row`, by the calling warp's lanes from part 32 blockIdx.x + lane,
 * striding the grid's width in parts. */
template <int T, int A, bool VEC, typename OutT>
__device__ __forceinline__ void qc_dequant_row(const uint8_t *__restrict__ row, int64_t cols,
                                               OutT *__restrict__ o) {
    const int64_t parts = (cols + 7) / 8;
    for (int64_t p = blockIdx.x * 32ll + threadIdx.x; p < parts; p += gridDim.x * 32ll) {
        float w[8];
        qc_deq8<T, A>(row, p, cols, w);
        qc_store8<VEC>(o + 8 * p, w, cols - 8 * p);
    }
}

/* out[i][:] = row ids[i] of W (W has cols columns, rows of row_bytes bytes). */
template <int T, int A, bool VEC>
__global__ void qc_embed_kernel(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t cols,
                                const int32_t *__restrict__ ids, int n, float *__restrict__ out) {
    qc_grid_start();
    for (int64_t t = blockIdx.y * (int64_t)QC_DQ_ROWS + threadIdx.y; t < n;
         t += (int64_t)gridDim.y * QC_DQ_ROWS)
        qc_dequant_row<T, A, VEC>(W + (int64_t)ids[t] * row_bytes, cols, out + t * cols);
}

/* dst[r][:] = row (row0 + r) of W, for r < nrows, as OutT (float or __half). */
template <int T, int A, bool VEC, typename OutT>
__global__ void qc_dequant_rows_kernel(const uint8_t *__restrict__ W, int64_t row_bytes,
                                       int64_t cols, int64_t row0, int64_t nrows,
                                       OutT *__restrict__ dst) {
    qc_grid_start();
    for (int64_t r = blockIdx.y * (int64_t)QC_DQ_ROWS + threadIdx.y; r < nrows;
         r += (int64_t)gridDim.y * QC_DQ_ROWS)
        qc_dequant_row<T, A, VEC>(W + (row0 + r) * row_bytes, cols, dst + r * cols);
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

/* The launch shape of both kernels for nrows rows of cols elements: a warp per row, its lanes
 * over the parts; at most about 32 thread blocks per multiprocessor, the warps striding over
 * the rows beyond (a 7B tile of 37376 rows of 3584 takes 14 x 301 blocks, ~16 rows a warp). */
static void dq_shape(const qc_cuda *cu, int64_t cols, int64_t nrows, dim3 *grid, dim3 *block) {
    const unsigned gx = qc_grid_for((cols + 7) / 8, 32, 65535);
    int64_t max_y = (int64_t)cu->sm_count * 32 / gx;
    if (max_y < 1) max_y = 1;
    if (max_y > 65535) max_y = 65535;
    *block = dim3(32, QC_DQ_ROWS);
    *grid = dim3(gx, qc_grid_for(nrows, QC_DQ_ROWS, (int)max_y));
}

/* Whether the fast variant applies: W 16-byte aligned (every block then has qc_blk_align's
 * alignment) and each part's outputs one aligned 16-byte stretch (whole parts, out aligned). */
static int dq_fast(const void *W, int64_t cols, const void *out) {
    return (uintptr_t)W % 16 == 0 && cols % 8 == 0 && (uintptr_t)out % 16 == 0;
}

int qc_cuda_embed(qc_backend *be, const qc_weight *table, const int32_t *ids, int n, float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n <= 0) return 0;
    const int64_t rb = row_bytes_of(table->type, table->cols);
    if (rb < 0) return qc_cuda_value_error(be, "embed: weight type %u is not supported by the CUDA backend", table->type);
    dim3 grid, block;
    dq_shape(cu, table->cols, n, &grid, &block);
    const uint8_t *W = (const uint8_t *)table->data;
    const int fast = dq_fast(W, table->cols, out);
    switch (table->type) {
#define QC_CASE_(T)                                                                              \
    case T:                                                                                      \
        if (fast)                                                                                \
            qc_launch(cu, qc_embed_kernel<T, qc_blk_align<T>(), true>, grid, block, 0, W, rb,    \
                      table->cols, ids, n, out);                                                 \
        else                                                                                     \
            qc_launch(cu, qc_embed_kernel<T, 2, false>, grid, block, 0, W, rb, table->cols, ids, \
                      n, out);                                                                   \
        break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_embed_kernel");
}

/* One launch of qc_dequant_rows_kernel<T, ..., OutT>: the fast variant where dq_fast allows it. */
template <int T, typename OutT>
static void dequant_rows(const qc_cuda *cu, const uint8_t *W, int64_t rb, int64_t cols, int64_t row0,
                         int64_t nrows, OutT *dst) {
    dim3 grid, block;
    dq_shape(cu, cols, nrows, &grid, &block);
    if (dq_fast(W, cols, dst))
        qc_launch(cu, qc_dequant_rows_kernel<T, qc_blk_align<T>(), true, OutT>, grid, block, 0, W, rb,
                  cols, row0, nrows, dst);
    else
        qc_launch(cu, qc_dequant_rows_kernel<T, 2, false, OutT>, grid, block, 0, W, rb, cols, row0,
                  nrows, dst);
}

int qc_cuda_dequantize_rows(qc_backend *be, const qc_weight *w, int64_t row0, int64_t nrows,
                            void *dst, int half_out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (nrows <= 0) return 0;
    const int64_t rb = row_bytes_of(w->type, w->cols);
    if (rb < 0) return qc_cuda_value_error(be, "matmul: weight type %u is not supported by the CUDA backend", w->type);
    const uint8_t *W = (const uint8_t *)w->data;
    switch (w->type) {
#define QC_CASE_(T)                                                                              \
    case T:                                                                                      \
        if (half_out) dequant_rows<T>(cu, W, rb, w->cols, row0, nrows, (__half *)dst);           \
        else dequant_rows<T>(cu, W, rb, w->cols, row0, nrows, (float *)dst);                     \
        break;
        QC_CUDA_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    return QC_LAUNCHED(be, "qc_dequant_rows_kernel");
}
