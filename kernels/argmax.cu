/* argmax.cu: out[i] = index of the largest value of row i of x[n][cols], the first one on ties.
 * NaNs never win; a row with no comparable value gives 0.
 *
 * One block per row; each thread scans a strided slice keeping its first maximum (its indices
 * increase, so a strict > keeps the first), then (value, index) pairs are reduced with ties
 * going to the smaller index: warp shuffles, then one pair per warp in shared memory.
 * The decode step's argmax runs over one row of ~150k logits on one SM: the scan reads float4s,
 * QC_ARGMAX_UNROLL of them in flight per thread before comparing (a load-compare chain of one
 * float per iteration took 57 us on the H100, the loads' latency end to end). */
#include "qc_cuda.cuh"

#define QC_ARGMAX_THREADS 1024
#define QC_ARGMAX_UNROLL 4

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
    qc_grid_start();
    const float *r = x + (int64_t)blockIdx.x * cols;
    float bv = -INFINITY;
    int64_t bi = -1;
    /* (v, i) in increasing i per thread: a strict > keeps the first maximum */
#define QC_TAKE_(v, i) do { const float v_ = (v); if (v_ == v_ && (bi < 0 || v_ > bv)) { bv = v_; bi = (i); } } while (0)
    int64_t done = 0;
    if (((uintptr_t)r & 15) == 0) {
        /* thread t takes float4s t, t + T, ..., UNROLL loads issued before the compares */
        const float4 *r4 = (const float4 *)r;
        const int64_t n4 = cols / 4, T = blockDim.x;
        int64_t j = threadIdx.x;
        for (; j + (QC_ARGMAX_UNROLL - 1) * T < n4; j += QC_ARGMAX_UNROLL * T) {
            float4 v[QC_ARGMAX_UNROLL];
#pragma unroll
            for (int u = 0; u < QC_ARGMAX_UNROLL; u++) v[u] = __ldg(r4 + j + u * T);
#pragma unroll
            for (int u = 0; u < QC_ARGMAX_UNROLL; u++) {
                const int64_t i = 4 * (j + u * T);
                QC_TAKE_(v[u].x, i); QC_TAKE_(v[u].y, i + 1); QC_TAKE_(v[u].z, i + 2); QC_TAKE_(v[u].w, i + 3);
            }
        }
        for (; j < n4; j += T) {
            const float4 v = __ldg(r4 + j);
            QC_TAKE_(v.x, 4 * j); QC_TAKE_(v.y, 4 * j + 1); QC_TAKE_(v.z, 4 * j + 2); QC_TAKE_(v.w, 4 * j + 3);
        }
        done = 4 * n4;
    }
    /* the tail past the float4s (or a row not 16-byte aligned): indices above every float4's */
    for (int64_t i = done + threadIdx.x; i < cols; i += blockDim.x) QC_TAKE_(r[i], i);
#undef QC_TAKE_
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
    qc_launch(qc_cuda_of(be), qc_argmax_kernel, dim3(n), dim3(QC_ARGMAX_THREADS), 0, x, cols, out);
    return QC_LAUNCHED(be, "qc_argmax_kernel");
}
