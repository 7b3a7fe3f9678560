/* argmax.cu: out[i] = index of the largest value of row i of x[n][cols], the first one on ties.
 * NaNs never win; a row with no comparable value gives 0.
 *
 * One block per row; each thread scans a strided slice keeping its first maximum (its indices
 * increase, so a strict > keeps the first), then (value, index) pairs are reduced with ties
 * going to the smaller index: warp shuffles, then one pair per warp in shared memory. */
#include "qc_cuda.cuh"

#define QC_ARGMAX_THREADS 1024

/* Is candidate (v, i) better than the current best (bv, bi)? bi < 0 means none yet. */
__device__ __forceinline__ bool qc_better(float v, int64_t i, float bv, int64_t bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}

__global__ void __launch_bounds__(QC_ARGMAX_THREADS)
qc_argmax_kernel(const float *__restrict__ x, int64_t cols, int32_t *__restrict__ out) {
    __shared__ float sv[QC_ARGMAX_THREADS / 32];
    __shared__ int64_t si[QC_ARGMAX_THREADS / 32];
    const float *r = x + (int64_t)blockIdx.x * cols;
    float bv = -INFINITY;
    int64_t bi = -1;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = r[i];
        if (v == v && (bi < 0 || v > bv)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (qc_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = bv; si[threadIdx.x >> 5] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (qc_better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
        out[blockIdx.x] = bi < 0 ? 0 : (int32_t)bi;
    }
}

int qc_cuda_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out) {
    if (n <= 0) return 0;
    if (cols <= 0 || cols > INT32_MAX)
        return qc_cuda_value_error(be, "argmax: %lld columns", (long long)cols);
    qc_argmax_kernel<<<n, QC_ARGMAX_THREADS, 0, qc_cuda_of(be)->stream>>>(x, cols, out);
    return QC_LAUNCHED(be, "qc_argmax_kernel");
}
