/* rmsnorm.cu: out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, in fp32.
 *
 * One block per row, a thread per chain of rmsnorm's numbers (qc_cuda.cuh): the row's sum of
 * squares is a block reduction (qc_norm_warp_sum, then one value per warp through shared memory,
 * added in warp order) and the scale is qc_rms_scale's. */
#include "qc_cuda.cuh"

/* PER > 0: the row has at most PER * QC_NORM_ROW_THREADS values, and each thread loads all of its
 * x and w values into registers before the first fmaf, so its loads are in flight together: a
 * decode step's norm is a chain of latencies, not a pass over bytes (the loop below, one load
 * after another, took 9 us for a 3584-value row on the H100). PER = 0: any dim, the loop. The
 * sums and products are the same in both, in the same order. */
template <int PER>
__global__ void __launch_bounds__(QC_NORM_ROW_THREADS)
qc_rmsnorm_kernel(const float *__restrict__ x, const float *__restrict__ w, int dim, float eps,
                  float *__restrict__ out) {
    __shared__ float warp_sums[QC_NORM_ROW_THREADS / 32];
    __shared__ float scale_s;
    qc_grid_start();
    const float *xr = x + (int64_t)blockIdx.x * dim;
    float *o = out + (int64_t)blockIdx.x * dim;
    const int tid = threadIdx.x;
    float xv[PER > 0 ? PER : 1], wv[PER > 0 ? PER : 1];
    float ss = 0.0f;
    if constexpr (PER > 0) {
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int i = tid + k * QC_NORM_ROW_THREADS;
            xv[k] = i < dim ? xr[i] : 0.0f;
            wv[k] = i < dim ? __ldg(w + i) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < PER; k++)
            if (tid + k * QC_NORM_ROW_THREADS < dim) ss = fmaf(xv[k], xv[k], ss);
    } else {
        for (int i = tid; i < dim; i += QC_NORM_ROW_THREADS) ss = fmaf(xr[i], xr[i], ss);
    }
    ss = qc_norm_warp_sum(ss);
    if ((tid & 31) == 0) warp_sums[tid >> 5] = ss;
    __syncthreads();
    if (tid == 0) scale_s = qc_norm_scale_of_warps(warp_sums, dim, eps);
    __syncthreads();
    const float scale = scale_s;
    /* out may alias x: each element is read before its own write, and the sum is complete */
    if constexpr (PER > 0) {
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int i = tid + k * QC_NORM_ROW_THREADS;
            if (i < dim) o[i] = xv[k] * scale * wv[k];
        }
    } else {
        for (int i = tid; i < dim; i += QC_NORM_ROW_THREADS) o[i] = xr[i] * scale * w[i];
    }
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
    const dim3 grid((unsigned)n), block(QC_NORM_ROW_THREADS);
    if (dim <= 8 * QC_NORM_ROW_THREADS) qc_launch(cu, qc_rmsnorm_kernel<8>, grid, block, 0, x, w, dim, eps, out);
    else if (dim <= 16 * QC_NORM_ROW_THREADS) qc_launch(cu, qc_rmsnorm_kernel<16>, grid, block, 0, x, w, dim, eps, out);
    else if (dim <= 32 * QC_NORM_ROW_THREADS) qc_launch(cu, qc_rmsnorm_kernel<32>, grid, block, 0, x, w, dim, eps, out);
    else qc_launch(cu, qc_rmsnorm_kernel<0>, grid, block, 0, x, w, dim, eps, out);
    return QC_LAUNCHED(be, "qc_rmsnorm_kernel");
}
