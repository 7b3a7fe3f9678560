/* elementwise.cu: swiglu, add, and the two helpers of matmul's cuBLAS path (bias add and the
 * f32 -> f16 conversion of the activations). Grid-stride loops: the grid does not depend on the
 * count beyond a cap, and in-place use (out aliasing an input) is safe element by element. */
#include "qc_cuda.cuh"

#include <cuda_fp16.h>

#define QC_EW_THREADS 256
#define QC_EW_MAX_BLOCKS 4096

/* out = silu(gate) * up (qc_silu_mul) */
__global__ void qc_swiglu_kernel(const float *gate, const float *up, int64_t count, float *out) {
    qc_grid_start();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = qc_silu_mul(gate[i], up[i]);
}

__global__ void qc_add_kernel(const float *a, const float *b, int64_t count, float *out) {
    qc_grid_start();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

__global__ void qc_add_bias_kernel(float *out, const float *__restrict__ bias, int64_t count,
                                   int64_t rows) {
    qc_grid_start();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] += bias[i % rows];
}

__global__ void qc_to_half_kernel(const float *__restrict__ src, __half *__restrict__ dst,
                                  int64_t count) {
    qc_grid_start();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2half_rn(src[i]);
}

static dim3 ew_grid(int64_t count) { return dim3(qc_grid_for(count, QC_EW_THREADS, QC_EW_MAX_BLOCKS)); }

int qc_cuda_swiglu(qc_backend *be, const float *gate, const float *up, int64_t count, float *out) {
    if (count <= 0) return 0;
    qc_launch(qc_cuda_of(be), qc_swiglu_kernel, ew_grid(count), dim3(QC_EW_THREADS), 0, gate, up, count, out);
    return QC_LAUNCHED(be, "qc_swiglu_kernel");
}

int qc_cuda_add(qc_backend *be, const float *a, const float *b, int64_t count, float *out) {
    if (count <= 0) return 0;
    qc_launch(qc_cuda_of(be), qc_add_kernel, ew_grid(count), dim3(QC_EW_THREADS), 0, a, b, count, out);
    return QC_LAUNCHED(be, "qc_add_kernel");
}

int qc_cuda_add_bias(qc_backend *be, float *out, const float *bias, int n, int64_t rows) {
    const int64_t count = (int64_t)n * rows;
    if (count <= 0) return 0;
    qc_launch(qc_cuda_of(be), qc_add_bias_kernel, ew_grid(count), dim3(QC_EW_THREADS), 0, out, bias, count, rows);
    return QC_LAUNCHED(be, "qc_add_bias_kernel");
}

int qc_cuda_to_half(qc_backend *be, const float *src, void *dst, int64_t count) {
    if (count <= 0) return 0;
    qc_launch(qc_cuda_of(be), qc_to_half_kernel, ew_grid(count), dim3(QC_EW_THREADS), 0, src, (__half *)dst, count);
    return QC_LAUNCHED(be, "qc_to_half_kernel");
}
