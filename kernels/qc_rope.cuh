/* qc_rope.cuh: the one rotation of a NEOX RoPE pair, shared by rope.cu (rope, rope_kv_store) and
 * decode_step.cu (the persistent decode kernel rotates q and k as it computes them), so every
 * path gives the same bits.
 *
 * The angle, its sine and cosine and the rotation are computed in double and rounded once to
 * float, like qwencuda.reference: in float the angle alone would be off by up to ~1e-3 rad at
 * position 32k. The products and sums are explicitly rounded: no FMA contraction can differ
 * between the kernels that inline it. */
#ifndef QC_ROPE_CUH
#define QC_ROPE_CUH

#include <stdint.h>

/* (cos, sin) of the angle pos * theta^(-2i/head_dim) of pair i: it needs only the position,
 * so a kernel can compute it before its inputs are ready (rope.cu). */
__device__ __forceinline__ double2 qc_rope_angle(int i, int head_dim, int32_t pos, double theta) {
    const double inv_freq = pow(theta, -2.0 * i / head_dim);
    double s, c;
    sincos((double)pos * inv_freq, &s, &c);
    return make_double2(c, s);
}

/* (a, b) rotated by the angle whose (cos, sin) is cs. */
__device__ __forceinline__ float2 qc_rope_apply(float a_f, float b_f, double2 cs) {
    const double a = a_f, b = b_f, c = cs.x, s = cs.y;
    return make_float2((float)__dsub_rn(__dmul_rn(a, c), __dmul_rn(b, s)),
                       (float)__dadd_rn(__dmul_rn(a, s), __dmul_rn(b, c)));
}

/* (a, b) = (v[i], v[i + head_dim/2]) rotated by the angle pos * theta^(-2i/head_dim). */
__device__ __forceinline__ float2 qc_rope_rotate(float a_f, float b_f, int i, int head_dim, int32_t pos,
                                                 double theta) {
    return qc_rope_apply(a_f, b_f, qc_rope_angle(i, head_dim, pos, theta));
}

#endif /* QC_ROPE_CUH */
