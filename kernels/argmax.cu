/* argmax.cu: out[i] = index of the largest value of row i of x[n][cols], the first one on ties.
 * NaNs never win; a row with no comparable value gives 0.
 *
 * One block per row, or on sm_90 a cluster of blocks per long row (qc_argmax_cluster_kernel); each
 * thread scans a strided slice keeping its first maximum (its indices increase, so a strict >
 * keeps the first), then (value, index) pairs are reduced with ties going to the smaller index:
 * warp shuffles, then one pair per warp in shared memory.
 * The decode step's argmax runs over one row of ~150k logits on one SM: the scan reads float4s,
 * QC_ARGMAX_UNROLL of them in flight per thread before comparing (a load-compare chain of one
 * float per iteration took 57 us on the H100, the loads' latency end to end). */
#include "qc_cuda.cuh"

#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define QC_ARGMAX_THREADS 1024
#define QC_ARGMAX_UNROLL 4

/* Is candidate (v, i) better than the current best (bv, bi)? bi < 0 means none yet. */
__device__ __forceinline__ bool qc_better(float v, int64_t i, float bv, int64_t bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}

/* The first best (value, index) of r[begin, end) by the block's threads, in thread 0's bv, bi
 * (bi < 0: none comparable). sv, si: one pair per warp of shared memory. */
__device__ __forceinline__ void qc_argmax_block(const float *__restrict__ r, int64_t begin, int64_t end,
                                                float *sv, int64_t *si, float &bv, int64_t &bi) {
    bv = -INFINITY;
    bi = -1;
    /* (v, i) in increasing i per thread: a strict > keeps the first maximum */
#define QC_TAKE_(v, i) do { const float v_ = (v); if (v_ == v_ && (bi < 0 || v_ > bv)) { bv = v_; bi = (i); } } while (0)
    int64_t done = begin;
    if (((uintptr_t)(r + begin) & 15) == 0) {
        /* thread t takes float4s t, t + T, ..., UNROLL loads issued before the compares */
        const float4 *r4 = (const float4 *)(r + begin);
        const int64_t n4 = (end - begin) / 4, T = blockDim.x;
        int64_t j = threadIdx.x;
        for (; j + (QC_ARGMAX_UNROLL - 1) * T < n4; j += QC_ARGMAX_UNROLL * T) {
            float4 v[QC_ARGMAX_UNROLL];
#pragma unroll
            for (int u = 0; u < QC_ARGMAX_UNROLL; u++) v[u] = __ldg(r4 + j + u * T);
#pragma unroll
            for (int u = 0; u < QC_ARGMAX_UNROLL; u++) {
                const int64_t i = begin + 4 * (j + u * T);
                QC_TAKE_(v[u].x, i); QC_TAKE_(v[u].y, i + 1); QC_TAKE_(v[u].z, i + 2); QC_TAKE_(v[u].w, i + 3);
            }
        }
        for (; j < n4; j += T) {
            const float4 v = __ldg(r4 + j);
            const int64_t i = begin + 4 * j;
            QC_TAKE_(v.x, i); QC_TAKE_(v.y, i + 1); QC_TAKE_(v.z, i + 2); QC_TAKE_(v.w, i + 3);
        }
        done = begin + 4 * n4;
    }
    /* the tail past the float4s (or a slice not 16-byte aligned): indices above every float4's */
    for (int64_t i = done + threadIdx.x; i < end; i += blockDim.x) QC_TAKE_(r[i], i);
#undef QC_TAKE_
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (qc_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = bv; si[threadIdx.x >> 5] = bi; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (qc_better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
}

/* One block per row. */
__global__ void __launch_bounds__(QC_ARGMAX_THREADS)
qc_argmax_kernel(const float *__restrict__ x, int64_t cols, int32_t *__restrict__ out) {
    __shared__ float sv[QC_ARGMAX_THREADS / 32];
    __shared__ int64_t si[QC_ARGMAX_THREADS / 32];
    qc_grid_start();
    float bv;
    int64_t bi;
    qc_argmax_block(x + (int64_t)blockIdx.x * cols, 0, cols, sv, si, bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi < 0 ? 0 : (int32_t)bi;
}

/* A long row (the decode step's ~150k logits) split between the QC_ARGMAX_CLUSTER blocks of a
 * thread-block cluster (sm_90; grid (QC_ARGMAX_CLUSTER, n)): block b takes the b-th slice (a
 * multiple of 4 values, so every slice of an aligned row is aligned), and block 0 combines the
 * slices' bests from their shared memory in slice order, so ties still go to the first index.
 * Why: one SM's pass took 12.4-13.0 us of a 0.5B decode step on the H100 (2% of it; timelines in
 * bench/results/20261124-d82da0b-*). */
#define QC_ARGMAX_CLUSTER 8
#define QC_ARGMAX_CLUSTER_MIN_COLS (QC_ARGMAX_CLUSTER * QC_ARGMAX_THREADS * 4)
__global__ void __launch_bounds__(QC_ARGMAX_THREADS)
qc_argmax_cluster_kernel(const float *__restrict__ x, int64_t cols, int32_t *__restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float sv[QC_ARGMAX_THREADS / 32];
    __shared__ int64_t si[QC_ARGMAX_THREADS / 32];
    __shared__ float best_v;
    __shared__ int64_t best_i;
    qc_grid_start();
    const int64_t chunk = (cols + 4 * QC_ARGMAX_CLUSTER - 1) / (4 * QC_ARGMAX_CLUSTER) * 4;
    const int64_t begin = min(cols, (int64_t)blockIdx.x * chunk), end = min(cols, begin + chunk);
    float bv;
    int64_t bi;
    qc_argmax_block(x + (int64_t)blockIdx.y * cols, begin, end, sv, si, bv, bi);
    if (threadIdx.x == 0) { best_v = bv; best_i = bi; }
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();   /* every slice's best in its block's shared memory */
    if (cluster.block_rank() == 0 && threadIdx.x == 0) {
        for (unsigned b = 1; b < QC_ARGMAX_CLUSTER; b++) {
            const float v = *cluster.map_shared_rank(&best_v, b);
            const int64_t i = *cluster.map_shared_rank(&best_i, b);
            if (qc_better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        out[blockIdx.y] = bi < 0 ? 0 : (int32_t)bi;
    }
    cluster.sync();   /* block 0 has read them */
#endif
}

int qc_cuda_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n <= 0) return 0;
    if (cols <= 0 || cols > INT32_MAX)
        return qc_cuda_value_error(be, "argmax: %lld columns", (long long)cols);
    if (cu->clusters && cols >= QC_ARGMAX_CLUSTER_MIN_COLS && n <= 65535) {
        qc_launch_ex(cu, qc_argmax_cluster_kernel, dim3(QC_ARGMAX_CLUSTER, n), dim3(QC_ARGMAX_THREADS), 0,
                     dim3(QC_ARGMAX_CLUSTER, 1, 1), x, cols, out);
        return QC_LAUNCHED(be, "qc_argmax_cluster_kernel");
    }
    qc_launch(cu, qc_argmax_kernel, dim3(n), dim3(QC_ARGMAX_THREADS), 0, x, cols, out);
    return QC_LAUNCHED(be, "qc_argmax_kernel");
}
