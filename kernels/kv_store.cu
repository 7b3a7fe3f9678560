/* kv_store.cu: cache.k[pos[t]][:] = k[t][:] and cache.v[pos[t]][:] = v[t][:], rows kv_dim wide,
 * stored as the cache's type (F32, or F16 rounded to nearest even). Positions come from device
 * memory (graph-ready); the caller guarantees pos[t] < max_ctx (the session checks the context
 * before any work). */
#include "qc_cuda.cuh"

template <typename KV>
__global__ void qc_kv_store_kernel(const float *__restrict__ k, const float *__restrict__ v,
                                   const int32_t *__restrict__ pos, int n, int kv_dim,
                                   KV *__restrict__ k_cache, KV *__restrict__ v_cache) {
    qc_grid_start();
    const int64_t total = (int64_t)n * kv_dim;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / kv_dim, j = i % kv_dim;
        const int64_t dst = (int64_t)pos[t] * kv_dim + j;
        qc_kv_put(k_cache + dst, k[i]);
        qc_kv_put(v_cache + dst, v[i]);
    }
}

int qc_cuda_kv_store(qc_backend *be, const float *k, const float *v, const int32_t *pos, int n,
                     int kv_dim, qc_kv_cache cache) {
    qc_cuda *cu = qc_cuda_of(be);
    const int64_t total = (int64_t)n * kv_dim;
    if (total <= 0) return 0;
    const unsigned grid = qc_grid_for(total, 256, 65535);
    if (cache.type == QC_KV_F16)
        qc_launch(cu, qc_kv_store_kernel<__half>, dim3(grid), dim3(256), 0, k, v, pos, n, kv_dim,
                  (__half *)cache.k, (__half *)cache.v);
    else if (cache.type == QC_KV_F32)
        qc_launch(cu, qc_kv_store_kernel<float>, dim3(grid), dim3(256), 0, k, v, pos, n, kv_dim,
                  (float *)cache.k, (float *)cache.v);
    else
        return qc_cuda_value_error(be, "kv_store: unknown KV cache type %d", cache.type);
    return QC_LAUNCHED(be, "qc_kv_store_kernel");
}
