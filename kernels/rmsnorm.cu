/* rmsnorm.cu: out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, in fp32.
 *
 * One block per row: the row's sum of squares is a block reduction (warp shuffles, then one
 * value per warp through shared memory); the scale is computed as the CPU does,
 * 1 / sqrtf(ss / dim + eps) with IEEE sqrt and division (nvcc's defaults). */
#include "qc_cuda.cuh"

#define QC_NORM_THREADS 256

__global__ void __launch_bounds__(QC_NORM_THREADS)
qc_rmsnorm_kernel(const float *__restrict__ x, const float *__restrict__ w, int dim, float eps,
                  float *__restrict__ out) {
    __shared__ float warp_sums[QC_NORM_THREADS / 32];
    __shared__ float scale_s;
    const float *xr = x + (int64_t)blockIdx.x * dim;
    float *o = out + (int64_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) total += warp_sums[i];
        scale_s = 1.0f / sqrtf(total / (float)dim + eps);
    }
    __syncthreads();
    const float scale = scale_s;
    /* out may alias x: each element is read before its own write, and the sum is complete */
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

int qc_cuda_norm_to_scratch(qc_backend *be, const float *x, const float *norm_w, int n, int64_t cols,
                            float eps, const float **normed) {
    qc_cuda *cu = qc_cuda_of(be);
    if (qc_cuda_scratch(be, &cu->scratch_norm, &cu->scratch_norm_bytes, (size_t)n * (size_t)cols * sizeof(float)) < 0 ||
        qc_cuda_rmsnorm(be, x, norm_w, n, (int)cols, eps, (float *)cu->scratch_norm) < 0)
        return -1;
    *normed = (const float *)cu->scratch_norm;
    return 0;
}

int qc_cuda_rmsnorm(qc_backend *be, const float *x, const float *w, int n, int dim, float eps,
                    float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n <= 0 || dim <= 0) return 0;
    qc_rmsnorm_kernel<<<n, QC_NORM_THREADS, 0, cu->stream>>>(x, w, dim, eps, out);
    return QC_LAUNCHED(be, "qc_rmsnorm_kernel");
}
