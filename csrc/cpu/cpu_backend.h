/* cpu_backend.h: private to the CPU backend: its state and its ops (backend.h has the contracts). */
#ifndef QC_CPU_BACKEND_H
#define QC_CPU_BACKEND_H

#include "backend.h"
#include "cpu_pool.h"
#include "cpu_simd.h"
#include "cpu_simd.h"

typedef struct {
    qc_pool *pool;
    float **scratch;               /* [n_scratch] per-thread buffers of scratch_floats floats */
    int n_scratch;
    size_t scratch_floats;
    float *normed;                 /* the fused ops' normalised input (qc_cpu_normed_buffer) */
    size_t normed_floats;
    const qc_simd_kernels *simd;   /* the fast kernels (cpu_fast.c), NULL: the reference ops */
    qc_backend_ops ops;            /* be->ops: the reference ops, the fast ones where simd is set */
    qc_q8_block *xq;               /* a matmul's activations in 8 bits (qc_cpu_q8_buffer) */
    size_t xq_blocks;
} qc_cpu_state;

/* Make every thread's scratch buffer hold at least floats_per_thread floats. */
int qc_cpu_scratch(qc_backend *be, size_t floats_per_thread);
/* A buffer of at least floats floats for the fused ops' normalised input, kept across calls
 * (a decode step allocates nothing); NULL with be->err set when out of memory. */
float *qc_cpu_normed_buffer(qc_backend *be, size_t floats);

/* A buffer of at least blocks 8-bit activation blocks, kept across calls; NULL with be->err set. */
qc_q8_block *qc_cpu_q8_buffer(qc_backend *be, size_t blocks);

/* The CPU backend with the reference ops (float_reference != 0: cpu_ops.c, float32 activations)
 * or with the fast ones where this CPU has them (cpu_fast.c; the reference ops elsewhere).
 * qc_cpu_backend_create is this with float_reference from QWENCUDA_CPU_KERNELS ("float": 1). */
int qc_cpu_backend_create_kernels(int threads, int float_reference, qc_backend **out, qc_error *err);

/* A buffer of at least blocks 8-bit activation blocks, kept across calls; NULL with be->err set. */
qc_q8_block *qc_cpu_q8_buffer(qc_backend *be, size_t blocks);

/* The CPU backend with the reference ops (float_reference != 0: cpu_ops.c, float32 activations)
 * or with the fast ones where this CPU has them (cpu_fast.c; the reference ops elsewhere).
 * qc_cpu_backend_create is this with float_reference from QWENCUDA_CPU_KERNELS ("float": 1). */
int qc_cpu_backend_create_kernels(int threads, int float_reference, qc_backend **out, qc_error *err);

int qc_cpu_embed(qc_backend *be, const qc_weight *table, const int32_t *ids, int n, float *out);
int qc_cpu_rmsnorm(qc_backend *be, const float *x, const float *w, int n, int dim, float eps,
                   float *out);
int qc_cpu_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                  float *out);
int qc_cpu_rope(qc_backend *be, float *x, const int32_t *pos, int n, int n_heads, int head_dim,
                float theta);
int qc_cpu_kv_store(qc_backend *be, const float *k, const float *v, const int32_t *pos, int n,
                    int kv_dim, qc_kv_cache cache);
int qc_cpu_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos, int n,
                     int n_kv, int n_head, int n_head_kv, int head_dim, float *out, float *scores,
                     float *probs);
int qc_cpu_swiglu(qc_backend *be, const float *gate, const float *up, int64_t count, float *out);
int qc_cpu_add(qc_backend *be, const float *a, const float *b, int64_t count, float *out);
int qc_cpu_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out);
int qc_cpu_sample(qc_backend *be, const float *logits, int64_t n_vocab, const void *state,
                  void *work, void *result);
int qc_cpu_matmul_add(qc_backend *be, const qc_weight *w, const float *x, int n,
                      const float *residual, float *out);
int qc_cpu_matmul_multi(qc_backend *be, const qc_matmul_part *parts, int n_parts, const float *x,
                        int n, const float *norm_w, float eps);
int qc_cpu_matmul_swiglu(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                         const float *x, int n, const float *norm_w, float eps, float *act);
int qc_cpu_rope_kv_store(qc_backend *be, float *q, float *k, const float *v, const int32_t *pos,
                         int n, int n_head, int n_head_kv, int head_dim, float theta,
                         qc_kv_cache cache);

/* The fast ops (cpu_fast.c): the same contracts, 8-bit activations for the matmuls. */
int qc_cpu_fast_rmsnorm(qc_backend *be, const float *x, const float *w, int n, int dim, float eps,
                        float *out);
int qc_cpu_fast_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                       float *out);
int qc_cpu_fast_matmul_add(qc_backend *be, const qc_weight *w, const float *x, int n,
                           const float *residual, float *out);
int qc_cpu_fast_matmul_multi(qc_backend *be, const qc_matmul_part *parts, int n_parts,
                             const float *x, int n, const float *norm_w, float eps);
int qc_cpu_fast_matmul_swiglu(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                              const float *x, int n, const float *norm_w, float eps, float *act);
int qc_cpu_fast_swiglu(qc_backend *be, const float *gate, const float *up, int64_t count, float *out);
int qc_cpu_fast_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out);

#endif /* QC_CPU_BACKEND_H */
