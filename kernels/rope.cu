/* rope.cu: NEOX rotary embedding in place: for i < head_dim/2 the pair (i, i + head_dim/2) of
 * every head of token t is rotated by the angle pos[t] * theta^(-2i/head_dim).
 *
 * The angle, its sine and cosine and the rotation are computed in double and rounded once to
 * float, like qwencuda.reference: in float the angle alone would be off by up to ~1e-3 rad at
 * position 32k. Positions come from device memory (graph-ready). */
#include "qc_cuda.cuh"

__global__ void qc_rope_kernel(float *__restrict__ x, const int32_t *__restrict__ pos, int n,
                               int n_heads, int head_dim, double theta) {
    const int half = head_dim / 2;
    const int64_t total = (int64_t)n * n_heads * half;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const int64_t th = idx / half;          /* token * n_heads + head */
        const int t = (int)(th / n_heads);
        const double inv_freq = pow(theta, -2.0 * i / head_dim);
        double s, c;
        sincos((double)pos[t] * inv_freq, &s, &c);
        float *v = x + th * head_dim;
        const double a = v[i], b = v[i + half];
        v[i] = (float)(a * c - b * s);
        v[i + half] = (float)(a * s + b * c);
    }
}

int qc_cuda_rope(qc_backend *be, float *x, const int32_t *pos, int n, int n_heads, int head_dim,
                 float theta) {
    qc_cuda *cu = qc_cuda_of(be);
    if (head_dim % 2 != 0) return qc_cuda_value_error(be, "rope: head_dim %d is odd", head_dim);
    const int64_t total = (int64_t)n * n_heads * (head_dim / 2);
    if (total <= 0) return 0;
    qc_rope_kernel<<<qc_grid_for(total, 256, 65535), 256, 0, cu->stream>>>(
        x, pos, n, n_heads, head_dim, (double)theta);
    return QC_LAUNCHED(be, "qc_rope_kernel");
}
