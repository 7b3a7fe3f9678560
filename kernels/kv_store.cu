/* kv_store.cu: k_cache[pos[t]][:] = k[t][:] and v_cache[pos[t]][:] = v[t][:], caches
 * [max_ctx][kv_dim]. Positions come from device memory (graph-ready); the caller guarantees
 * pos[t] < max_ctx (the session checks the context before any work). */
#include "qc_cuda.cuh"

__global__ void qc_kv_store_kernel(const float *__restrict__ k, const float *__restrict__ v,
                                   const int32_t *__restrict__ pos, int n, int kv_dim,
                                   float *__restrict__ k_cache, float *__restrict__ v_cache) {
    const int64_t total = (int64_t)n * kv_dim;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / kv_dim, j = i % kv_dim;
        const int64_t dst = (int64_t)pos[t] * kv_dim + j;
        k_cache[dst] = k[i];
        v_cache[dst] = v[i];
    }
}

int qc_cuda_kv_store(qc_backend *be, const float *k, const float *v, const int32_t *pos, int n,
                     int kv_dim, float *k_cache, float *v_cache) {
    qc_cuda *cu = qc_cuda_of(be);
    const int64_t total = (int64_t)n * kv_dim;
    if (total <= 0) return 0;
    qc_kv_store_kernel<<<qc_grid_for(total, 256, 65535), 256, 0, cu->stream>>>(
        k, v, pos, n, kv_dim, k_cache, v_cache);
    return QC_LAUNCHED(be, "qc_kv_store_kernel");
}
