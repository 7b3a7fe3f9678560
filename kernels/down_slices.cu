/* down_slices.cu: the down projections' slices of 32 columns (qc_slices.cuh), made once per
 * weight by swiglu_down_prepare and kept beside the stored rows, which the op-by-op path still
 * reads; and the sums' add for a consumer that does not add them itself.
 *
 * The backend keeps them in cu->slices, one entry per weight (found by its device rows), freed
 * with the weight (weight_free) or the backend. They cost the down projection's bytes again on
 * the GPU (Q4_K's 4.5 bits a weight as 6, Q6_K's 6.56 as 8): 91.5 MB for the real 0.5B file's 24
 * layers (12 of each type). */
#include "qc_slices.cuh"

#include <stdlib.h>

/* Entry (b, r) of the slices: what row r of W (type T, stored rows of rb bytes) holds of columns
 * 32 b .. 32 b + 31, at out (its place, (b * rows + r) * entry bytes, the kernel's to choose). */
template <int T>
__device__ void qc_slice_make(const uint8_t *W, int64_t rb, int64_t b, int64_t r, uint8_t *out) {
    const uint8_t *row = W + r * rb;
    if constexpr (T == QC_TYPE_Q4_K) {
        const uint8_t *blk = row + (b / 8) * sizeof(qc_block_q4_K);
        const int j = (int)(b % 8), g = j / 2, high = j & 1;
        const uint32_t *sw = (const uint32_t *)(blk + 4);
        int sc, m;
        qc_q8_unit<QC_TYPE_Q4_K>::scale_min(sw[0], sw[1], sw[2], j, sc, m);
        qc_slice_q4_K e;
        e.d = __half2float(__ushort_as_half(*(const unsigned short *)blk)) * (float)sc;
        e.m = __half2float(__ushort_as_half(*(const unsigned short *)(blk + 2))) * (float)m;
        const uint8_t *qs = blk + 16 + 32 * g;
        uint8_t bytes[16];
        for (int p = 0; p < 16; p++) {
            const int lo = (qs[p] >> (4 * high)) & 15, hi = (qs[p + 16] >> (4 * high)) & 15;
            bytes[p] = (uint8_t)(lo | hi << 4);
        }
        memcpy(e.qs, bytes, 16);
        memcpy(out, &e, sizeof e);
    } else if constexpr (T == QC_TYPE_Q6_K) {
        const qc_block_q6_K *blk = (const qc_block_q6_K *)(row + (b / 8) * sizeof(qc_block_q6_K));
        const int E0 = 32 * (int)(b % 8);
        int q[32];
        for (int e = 0; e < 32; e++) {
            const int E = E0 + e, h = E / 128, t = (E % 128) / 32, l = E % 32;
            const int low = (blk->ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
            const int high = (blk->qh[32 * h + l] >> (2 * t)) & 3;
            q[e] = low | high << 4;
        }
        qc_slice_q6_K s;
        uint8_t ql[16], qh[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int p = 0; p < 16; p++) ql[p] = (uint8_t)((q[p] & 15) | (q[p + 16] & 15) << 4);
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 4; i++) {
                qh[i] |= (uint8_t)((q[4 * k + i] >> 4) << (2 * k));
                qh[4 + i] |= (uint8_t)((q[16 + 4 * k + i] >> 4) << (2 * k));
            }
        memcpy(s.ql, ql, 16);
        memcpy(s.qh, qh, 8);
        unsigned short dh;
        memcpy(&dh, &blk->d, 2);
        const float d = __half2float(__ushort_as_half(dh));
        s.d[0] = d * (float)blk->scales[E0 / 16];
        s.d[1] = d * (float)blk->scales[E0 / 16 + 1];
        memcpy(out, &s, sizeof s);
    } else {
        constexpr int64_t bs = qc_slice_entry_bytes(T);
        const uint8_t *src = row + b * bs;
        for (int i = 0; i < bs; i++) out[i] = src[i];
    }
}

template <int T>
__global__ void qc_slices_kernel(const uint8_t *__restrict__ W, int64_t rb, int64_t rows, int64_t slices,
                                 uint8_t *__restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= slices * rows) return;
    const int64_t b = i / rows, r = i % rows;
    qc_slice_make<T>(W, rb, b, r, out + i * qc_slice_entry_bytes(T));
}

static qc_down_slices *find(qc_cuda *cu, const void *data) {
    for (int i = 0; i < cu->n_slices; i++)
        if (cu->slices[i].of == data) return &cu->slices[i];
    return NULL;
}

const uint8_t *qc_cuda_down_slices(qc_backend *be, const qc_weight *w_down) {
    const qc_down_slices *s = find(qc_cuda_of(be), w_down->data);
    return s ? (const uint8_t *)s->slices : NULL;
}

/* Makes the slices of w_down (once: a second call finds them). 0 or -1. */
int qc_cuda_make_down_slices(qc_backend *be, const qc_weight *w_down) {
    qc_cuda *cu = qc_cuda_of(be);
    if (find(cu, w_down->data)) return 0;
    const int64_t eb = qc_slice_entry_bytes(w_down->type), slices = w_down->cols / 32, rows = w_down->rows;
    if (eb == 0 || w_down->cols % 32 != 0) return qc_cuda_value_error(be, "down slices: weight type %u", w_down->type);
    if (cu->n_slices == cu->cap_slices) {
        const int cap = cu->cap_slices ? 2 * cu->cap_slices : 32;
        qc_down_slices *grown = (qc_down_slices *)realloc(cu->slices, (size_t)cap * sizeof *grown);
        if (!grown) return qc_fail(&be->err, QC_ERR_NOMEM, "down slices: out of memory");
        cu->slices = grown;
        cu->cap_slices = cap;
    }
    void *out = NULL;
    const size_t bytes = (size_t)(slices * rows * eb);
    cudaError_t e = cudaMalloc(&out, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return qc_fail(&be->err, e == cudaErrorMemoryAllocation ? QC_ERR_NOMEM : QC_ERR_CUDA,
                       "cudaMalloc(%zu bytes) for a down projection's slices failed on cuda:%d: %s", bytes, be->device,
                       cudaGetErrorString(e));
    }
    const int64_t rb = qc_row_bytes(w_down->type, w_down->cols), n = slices * rows;
    const unsigned grid = (unsigned)((n + 255) / 256);
    const uint8_t *W = (const uint8_t *)w_down->data;
    switch (w_down->type) {
#define QC_CASE_(T) case T: qc_slices_kernel<T><<<grid, 256, 0, cu->stream>>>(W, rb, rows, slices, (uint8_t *)out); break;
        QC_Q8_FOR_EACH_TYPE(QC_CASE_)
#undef QC_CASE_
    }
    if (QC_LAUNCHED(be, "qc_slices_kernel") < 0 || QC_CUDA(be, cudaStreamSynchronize(cu->stream)) < 0) {
        cudaFree(out);
        return -1;
    }
    cu->slices[cu->n_slices++] = qc_down_slices{w_down->data, out};
    return 0;
}

void qc_cuda_free_down_slices(qc_cuda *cu, const void *data) {
    for (int i = 0; i < cu->n_slices; i++) {
        if (data && cu->slices[i].of != data) continue;
        cudaFree(cu->slices[i].slices);
        cu->slices[i--] = cu->slices[--cu->n_slices];
    }
    if (!data) {
        free(cu->slices);
        cu->slices = NULL;
        cu->n_slices = cu->cap_slices = 0;
    }
}

__global__ void qc_sum_add_kernel(const float *x, const long long *sum, int64_t dim, float *out) {
    qc_grid_start();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < dim) out[i] = qc_x_plus_sum(x, sum, i);
}

int qc_cuda_sum_add(qc_backend *be, const float *x, const int64_t *sum, int64_t dim, float *out) {
    qc_cuda *cu = qc_cuda_of(be);
    qc_launch(cu, qc_sum_add_kernel, dim3((unsigned)((dim + 255) / 256)), dim3(256), 0, x, (const long long *)sum, dim,
              out);
    return QC_LAUNCHED(be, "qc_sum_add_kernel");
}
