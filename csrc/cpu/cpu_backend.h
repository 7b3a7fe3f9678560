/* cpu_backend.h: private to the CPU backend: its state and its ops (backend.h has the contracts). */
#ifndef QC_CPU_BACKEND_H
#define QC_CPU_BACKEND_H

#include "backend.h"
#include "cpu_pool.h"

typedef struct {
    qc_pool *pool;
    float **scratch;               /* [n_scratch] per-thread buffers of scratch_floats floats */
    int n_scratch;
    size_t scratch_floats;
    float *normed;                 /* the fused ops' normalised input (qc_cpu_normed_buffer) */
    size_t normed_floats;
} qc_cpu_state;

/* Make every thread's scratch buffer hold at least floats_per_thread floats. */
int qc_cpu_scratch(qc_backend *be, size_t floats_per_thread);
/* A buffer of at least floats floats for the fused ops' normalised input, kept across calls
 * (a decode step allocates nothing); NULL with be->err set when out of memory. */
float *qc_cpu_normed_buffer(qc_backend *be, size_t floats);

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

#endif /* QC_CPU_BACKEND_H */
