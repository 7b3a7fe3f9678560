/* rope.cu: NEOX rotary embedding in place: for i < head_dim/2 the pair (i, i + head_dim/2) of
 * every head of token t is rotated by the angle pos[t] * theta^(-2i/head_dim). And
 * rope_kv_store: the rotation of q and k and the KV-cache write of the rotated k and of v, in
 * one launch.
 *
 * Both kernels rotate with qc_rope_angle and qc_rope_apply (qc_rope.cuh: double precision,
 * explicitly rounded), whose composition the persistent decode kernel calls as qc_rope_rotate,
 * so every path gives rope's bits. Positions come from
 * device memory (graph-ready). */
#include "qc_cuda.cuh"
#include "qc_rope.cuh"

/* Rotate the pair (v[i], v[i + half]) of one head vector in place by the angle whose (cos,
 * sin) is cs (qc_rope_angle); returns the rotated pair. */
__device__ __forceinline__ float2 qc_rope_pair(float *v, int i, int half, double2 cs) {
    const float2 rot = qc_rope_apply(v[i], v[i + half], cs);
    v[i] = rot.x;
    v[i + half] = rot.y;
    return rot;
}

__global__ void qc_rope_kernel(float *__restrict__ x, const int32_t *__restrict__ pos, int n,
                               int n_heads, int head_dim, double theta) {
    qc_grid_start();
    const int half = head_dim / 2;
    const int64_t total = (int64_t)n * n_heads * half;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const int64_t th = idx / half;          /* token * n_heads + head */
        const int t = (int)(th / n_heads);
        qc_rope_pair(x + th * head_dim, i, half, qc_rope_angle(i, head_dim, pos[t], theta));
    }
}

int qc_cuda_rope(qc_backend *be, float *x, const int32_t *pos, int n, int n_heads, int head_dim,
                 float theta) {
    qc_cuda *cu = qc_cuda_of(be);
    if (head_dim % 2 != 0) return qc_cuda_value_error(be, "rope: head_dim %d is odd", head_dim);
    const int64_t total = (int64_t)n * n_heads * (head_dim / 2);
    if (total <= 0) return 0;
    qc_launch(cu, qc_rope_kernel, dim3(qc_grid_for(total, 256, 65535)), dim3(256), 0, x, pos, n, n_heads,
              head_dim, (double)theta);
    return QC_LAUNCHED(be, "qc_rope_kernel");
}

/* Per token, items [0, (n_head + n_head_kv) * half) are the pairs of q's heads and then k's
 * (a k pair also goes to k_cache), and the next kv_dim items copy v into v_cache; the cache
 * stores them as KV (qc_kv_put). */
template <typename KV>
__global__ void qc_rope_kv_store_kernel(float *__restrict__ q, float *__restrict__ k,
                                        const float *__restrict__ v,
                                        const int32_t *__restrict__ pos, int n, int n_head,
                                        int n_head_kv, int head_dim, double theta,
                                        KV *__restrict__ k_cache, KV *__restrict__ v_cache) {
    const int half = head_dim / 2;
    const int64_t kv_dim = (int64_t)n_head_kv * head_dim;
    const int64_t pairs = (int64_t)(n_head + n_head_kv) * half;
    const int64_t per_token = pairs + kv_dim;
    const int64_t total = (int64_t)n * per_token;
    const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    /* the angle of this thread's first pair (a decode step has one item a thread), before the
     * wait: it needs only the position, which the host uploads (qc_grid_start's rule) */
    double2 cs_first = make_double2(1.0, 0.0);
    if (first < total && first % per_token < pairs)
        cs_first = qc_rope_angle((int)(first % per_token % half), head_dim, pos[first / per_token], theta);
    qc_grid_start();
    for (int64_t idx = first; idx < total; idx += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(idx / per_token);
        const int64_t item = idx % per_token;
        const int64_t row = (int64_t)pos[t] * kv_dim;   /* this token's cache row */
        if (item < pairs) {
            const int h = (int)(item / half), i = (int)(item % half);
            const double2 cs = idx == first ? cs_first : qc_rope_angle(i, head_dim, pos[t], theta);
            if (h < n_head) {
                qc_rope_pair(q + ((int64_t)t * n_head + h) * head_dim, i, half, cs);
            } else {
                const int64_t off = (int64_t)(h - n_head) * head_dim;   /* KV head within the row */
                const float2 rot = qc_rope_pair(k + t * kv_dim + off, i, half, cs);
                qc_kv_put(k_cache + row + off + i, rot.x);
                qc_kv_put(k_cache + row + off + i + half, rot.y);
            }
        } else {
            const int64_t e = item - pairs;
            qc_kv_put(v_cache + row + e, v[t * kv_dim + e]);
        }
    }
}

int qc_cuda_rope_kv_store(qc_backend *be, float *q, float *k, const float *v, const int32_t *pos,
                          int n, int n_head, int n_head_kv, int head_dim, float theta,
                          qc_kv_cache cache) {
    qc_cuda *cu = qc_cuda_of(be);
    if (head_dim % 2 != 0 || head_dim <= 0 || n_head <= 0 || n_head_kv <= 0)
        return qc_cuda_value_error(be, "rope_kv_store: bad shape heads=%d kv_heads=%d head_dim=%d", n_head,
                                   n_head_kv, head_dim);
    const int64_t total = (int64_t)n * ((int64_t)(n_head + n_head_kv) * (head_dim / 2) + (int64_t)n_head_kv * head_dim);
    if (total <= 0) return 0;
    const unsigned grid = qc_grid_for(total, 256, 65535);
    if (cache.type == QC_KV_F16)
        qc_launch(cu, qc_rope_kv_store_kernel<__half>, dim3(grid), dim3(256), 0, q, k, v, pos, n, n_head,
                  n_head_kv, head_dim, (double)theta, (__half *)cache.k, (__half *)cache.v);
    else if (cache.type == QC_KV_F32)
        qc_launch(cu, qc_rope_kv_store_kernel<float>, dim3(grid), dim3(256), 0, q, k, v, pos, n, n_head,
                  n_head_kv, head_dim, (double)theta, (float *)cache.k, (float *)cache.v);
    else
        return qc_cuda_value_error(be, "rope_kv_store: unknown KV cache type %d", cache.type);
    return QC_LAUNCHED(be, "qc_rope_kv_store_kernel");
}
