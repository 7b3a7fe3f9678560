/* model.h: a Qwen2 / Qwen2.5 model: config from GGUF metadata, weights mapped and validated,
 * placed on a backend. */
#ifndef QC_MODEL_H
#define QC_MODEL_H

#include "backend.h"
#include "gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qc_config {
    char arch[32];            /* general.architecture: "qwen2" */
    int64_t n_vocab;          /* rows of token_embd (151936 for Qwen2.5), not the tokenizer's count */
    int64_t dim;              /* qwen2.embedding_length */
    int64_t n_layer;          /* qwen2.block_count */
    int64_t n_head;           /* qwen2.attention.head_count */
    int64_t n_head_kv;        /* qwen2.attention.head_count_kv */
    int64_t head_dim;         /* dim / n_head */
    int64_t ffn_dim;          /* qwen2.feed_forward_length */
    int64_t n_ctx_train;      /* qwen2.context_length */
    float rope_theta;         /* qwen2.rope.freq_base (1e6) */
    float norm_eps;           /* qwen2.attention.layer_norm_rms_epsilon (1e-6) */
    int tied;                 /* 1 when the file has no output.weight: lm_head = token_embd */
} qc_config;

typedef struct qc_layer {
    float *attn_norm;         /* (dim) */
    qc_weight wq;             /* (n_head * head_dim, dim) */
    qc_weight wk;             /* (n_head_kv * head_dim, dim) */
    qc_weight wv;             /* (n_head_kv * head_dim, dim) */
    float *bq, *bk, *bv;      /* q/k/v biases: Qwen2 has them, and they are large */
    qc_weight wo;             /* (dim, n_head * head_dim); no bias */
    float *ffn_norm;          /* (dim) */
    qc_weight w_gate;         /* (ffn_dim, dim) */
    qc_weight w_up;           /* (ffn_dim, dim) */
    qc_weight w_down;         /* (dim, ffn_dim) */
} qc_layer;

/* The tensors of one layer, blk.L.<suffix>, in file order: this one table drives the checks
 * (presence, shape, type), the loading, the freeing and Model.tensor_types(). A shape is given
 * in NumPy order (rows, cols) as multiples of config dimensions. */
typedef enum { QC_LT_MATRIX, QC_LT_NORM, QC_LT_BIAS } qc_layer_tensor_kind;  /* qc_weight | float* | float* */
typedef enum { QC_D_NONE, QC_D_DIM, QC_D_Q, QC_D_KV, QC_D_FFN } qc_dim_id;  /* -, dim, n_head*hd, n_head_kv*hd, ffn */

typedef struct qc_layer_tensor {
    const char *suffix;       /* "attn_q.weight" */
    size_t offset;            /* offsetof(qc_layer, field) */
    qc_layer_tensor_kind kind;
    qc_dim_id rows, cols;     /* vectors: (rows,), cols QC_D_NONE */
} qc_layer_tensor;

extern const qc_layer_tensor qc_layer_tensors[];
extern const size_t qc_n_layer_tensors;

/* The value of a shape entry under config c (0 for QC_D_NONE). */
int64_t qc_dim_value(const qc_config *c, qc_dim_id d);

typedef struct qc_model {
    gguf_file *file;          /* owns the mapping the weights point into */
    qc_config cfg;
    qc_backend *be;
    qc_weight tok_embd;       /* (n_vocab, dim) */
    float *output_norm;       /* (dim) */
    qc_weight output;         /* (n_vocab, dim); when cfg.tied, the same memory as tok_embd */
    qc_layer *layers;         /* [n_layer] */
} qc_model;

/* Read and validate the config (architecture, divisibility, even head_dim, ...). */
int qc_config_from_gguf(const gguf_file *f, qc_config *cfg, qc_error *err);
/* Load path on device ("cpu", "cuda", "cuda:N"); validates every tensor's shape against the
 * config (QC_ERR_MODEL naming the tensor and both shapes). */
int qc_model_load(const char *path, const char *device, int threads, qc_model **out, qc_error *err);
void qc_model_free(qc_model *m);   /* safe on a half-built model, NULL ok */

#ifdef __cplusplus
}
#endif
#endif /* QC_MODEL_H */
