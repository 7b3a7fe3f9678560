/* qc_slices.cuh: the down projection's columns in slices of 32, the layout in which swiglu_down
 * (backend.h; matmul_swiglu.cu) folds the down projection into the gate/up kernel.
 *
 * Why: a block of that kernel computes 32 values of act (one 8-bit block of 32, qc_gemv_q8.cuh),
 * and those multiply columns 32 b .. 32 b + 31 of every row of w_down: its share of the down
 * projection, a partial sum of each of x's dim values. Stored as the file has them, that share is
 * a piece of every row, strided; here slice b is the entries of rows 0 .. dim - 1 one after
 * another, so that a block copies its share in one contiguous piece (qc_copy_to_shared). An
 * entry is what one row holds of those 32 columns:
 *   Q4_0, Q5_0, Q8_0: the row's block b as stored (its bytes, so the same values);
 *   Q4_K: x = d * q - m with d = the super-block's d times the sub-block's 6-bit scale and m its
 *         dmin times the 6-bit min, both exact in float (11 x 6 bits); q's 4 bits of element e
 *         the low nibble of byte e (e < 16), else the high nibble of byte e - 16 (Q4_0's order);
 *   Q6_K: x = d[e / 16] * (q - 32), d[i] the super-block's d times the 8-bit scale of the
 *         element's 16 (exact: 11 x 8 bits); q's low 4 bits as Q4_K's, its high 2 bits of
 *         element 4k + i (k < 4, i < 4) bits 2k, 2k + 1 of byte i of qh[0] (qh[1]: element
 *         16 + 4k + i), so that a shift and a mask put them beside the nibbles of one word.
 * The same values as the stored rows, so the dot products differ from the down projection's
 * (matmul.cu) only in the order of their float additions. */
#ifndef QC_SLICES_CUH
#define QC_SLICES_CUH

#include "qc_gemv_q8.cuh"

struct qc_slice_q4_K {
    uint32_t qs[4];
    float d, m;
};
struct qc_slice_q6_K {
    uint32_t ql[4];
    uint32_t qh[2];
    float d[2];
};
static_assert(sizeof(qc_slice_q4_K) == 24 && sizeof(qc_slice_q6_K) == 32, "entries of 8-byte multiples");

/* Bytes of one entry of a slice of weight type t (qc_q8_type), 0 where t has no slice layout. */
__host__ __device__ constexpr int64_t qc_slice_entry_bytes(uint32_t t) {
    return t == QC_TYPE_Q4_K   ? (int64_t)sizeof(qc_slice_q4_K)
           : t == QC_TYPE_Q6_K ? (int64_t)sizeof(qc_slice_q6_K)
           : t == QC_TYPE_Q4_0 ? (int64_t)sizeof(qc_block_q4_0)
           : t == QC_TYPE_Q5_0 ? (int64_t)sizeof(qc_block_q5_0)
           : t == QC_TYPE_Q8_0 ? (int64_t)sizeof(qc_block_q8_0)
                               : 0;
}

/* The dot product of entry e (weight type DT) with one 8-bit activation block (qs: 32 bytes,
 * 16-byte aligned; ds: its (d, s)). SH: e is in shared memory, else global (qc_ldw). */
template <int DT, bool SH>
__device__ __forceinline__ float qc_slice_dot(const uint8_t *e, const int8_t *qs, const float2 *ds) {
    if constexpr (DT == QC_TYPE_Q4_K) {
        const uint2 a = qc_ldw<SH>((const uint2 *)e), b = qc_ldw<SH>((const uint2 *)e + 1);
        const float2 dm = qc_ldw<SH>((const float2 *)e + 2);
        const uint32_t q[4] = {a.x, a.y, b.x, b.y};
        int x[8];
        qc_q8_x(qs, 0, x);
        int s = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s = __dp4a((int)(q[k] & 0x0F0F0F0Fu), x[k], s);
            s = __dp4a((int)((q[k] >> 4) & 0x0F0F0F0Fu), x[k + 4], s);
        }
        const float2 a8 = *ds;
        return dm.x * (float)s * a8.x - dm.y * a8.y;
    } else if constexpr (DT == QC_TYPE_Q6_K) {
        const uint4 l = qc_ldw<SH>((const uint4 *)e), hd = qc_ldw<SH>((const uint4 *)e + 1);
        const uint32_t ql[4] = {l.x, l.y, l.z, l.w};
        int x[8];
        qc_q8_x(qs, 0, x);
        int lo = 0, hi = 0, slo = 0, shi = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int wl = (int)((ql[k] & 0x0F0F0F0Fu) | ((hd.x >> (2 * k)) & 0x03030303u) << 4);
            const int wh = (int)(((ql[k] >> 4) & 0x0F0F0F0Fu) | ((hd.y >> (2 * k)) & 0x03030303u) << 4);
            lo = __dp4a(wl, x[k], lo);
            hi = __dp4a(wh, x[k + 4], hi);
            slo = __dp4a(QC_ONES4, x[k], slo);
            shi = __dp4a(QC_ONES4, x[k + 4], shi);
        }
        lo -= 32 * slo;   /* the bytes were q = w + 32 */
        hi -= 32 * shi;
        return (__uint_as_float(hd.z) * (float)lo + __uint_as_float(hd.w) * (float)hi) * ds->x;
    } else {
        /* the stored block: the 8-bit GEMV's own unit, activation block 0 of a one-block x */
        const qc_q8x x1 = {qs, ds, 0, 0};
        float acc[1] = {0.0f};
        qc_q8_unit<DT>::template run<1, SH>(e, 0, x1, 1, 0, acc);
        return acc[0];
    }
}

/* The slices of w_down (dim rows of ffn columns) made by swiglu_down_prepare, or NULL
 * (down_slices.cu). */
const uint8_t *qc_cuda_down_slices(qc_backend *be, const qc_weight *w_down);
/* out = x + the sums (dim values, one token): the residual stream after a folded down projection,
 * for a consumer that does not add them itself (down_slices.cu). */
int qc_cuda_sum_add(qc_backend *be, const float *x, const int64_t *sum, int64_t dim, float *out);

#endif /* QC_SLICES_CUH */
