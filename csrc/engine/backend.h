/* backend.h: the one interface behind which the CPU (csrc/cpu/) and CUDA (kernels/) engines sit.
 *
 * The forward pass (session.c) is written once, against these ops; each backend implements
 * them. qwencuda.kernels (py_kernels.c) calls the very same ops on NumPy inputs, so a kernel
 * tested from pytest is the kernel the model runs.
 *
 * Conventions for every op:
 *  - pointers are backend memory (CPU: host memory; CUDA: device memory), obtained from
 *    ops->alloc or, for weights, from ops->weight; they are opaque to the forward pass.
 *  - activations are float32, row-major, one row per token: x[n][features].
 *  - ids and positions are int32 arrays in backend memory, so that a decode step can later
 *    run as one CUDA graph with the token and position read from device memory.
 *  - ops are asynchronous on CUDA (one stream per backend); download() waits.
 *  - each op returns 0, or -1 after filling be->err. A backend serves one caller at a time.
 */
#ifndef QC_BACKEND_H
#define QC_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A weight matrix as stored in the file: rows = output features (GGUF ne[1]),
 * cols = input features (GGUF ne[0], the fastest-varying dimension). NumPy view: (rows, cols),
 * and y = W @ x. */
typedef struct qc_weight {
    uint32_t type;            /* qc_type */
    int64_t rows, cols;
    size_t nbytes;
    const void *host;         /* stored bytes, in the file mapping */
    void *data;               /* backend copy (CPU: aliases host) */
} qc_weight;

/* One projection of matmul_multi: out[n][w->rows] = x[n][w->cols] @ W^T (+ bias[w->rows] when
 * bias is not NULL). */
typedef struct qc_matmul_part {
    const qc_weight *w;
    const float *bias;
    float *out;
} qc_matmul_part;

/* Element type of a KV cache: F32 keeps the rotated k and v exactly; F16 (the CUDA default)
 * halves the memory and the bytes attention reads, and feeds the tensor-core flash kernels. */
typedef enum { QC_KV_F32 = 0, QC_KV_F16 = 1 } qc_kv_type;

/* One layer's KV cache: k (after RoPE) and v, each [max_ctx][n_head_kv * head_dim] of `type`,
 * in backend memory. */
typedef struct qc_kv_cache {
    void *k;
    void *v;
    int type;                 /* qc_kv_type */
} qc_kv_cache;

/* Keys up to which a decode step is "short" (bucket 0), beyond it "long" (bucket 1): CUDA decodes
 * short contexts with the split-K kernel (one block per head and split, fewer launches to merge)
 * and long ones with the flash kernel (one K/V read per KV head). Measured on an H100 (0.5B,
 * decode tok/s split / flash): 1025 keys 853 / 858, 2049 759 / 688, 4097 669 / 691,
 * 16385 387 / 643. */
#define QC_KV_SHORT 3072
static inline int qc_kv_bucket(int n_kv) { return n_kv > QC_KV_SHORT; }

/* Bytes of one cache element. */
static inline size_t qc_kv_type_size(int type) { return type == QC_KV_F16 ? 2 : 4; }

/* download_start (below): the largest copy, and how many can be outstanding. */
#define QC_DOWNLOAD_AHEAD_BYTES 64
#define QC_DOWNLOAD_TICKETS 4

/* Most projections one matmul_multi call computes (q, k and v). */
#define QC_MATMUL_MULTI_MAX 3
/* Most weights one read_ahead hint names (gate and up; the next layer's q, k and v). */
#define QC_READ_AHEAD_MAX 3

/* Largest token count that the CUDA backend's matmul serves with the batched GEMV kernels,
 * reading the stored blocks directly; above it, it dequantizes and calls cuBLAS. */
#define QC_GEMV_MAX_TOKENS 8

typedef struct qc_backend qc_backend;

/* ---- the ops: one function type per op states its arguments and its contract; a backend
 * defines qc_<backend>_<op> of that type, and QC_BACKEND_OPS below lists them. ---- */

/* out[i][:] = dequantized row ids[i] of table; table is (rows, cols), out is [n][cols]. */
typedef int qc_op_embed(qc_backend *be, const qc_weight *table, const int32_t *ids, int n,
                        float *out);
/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w: sum of squares in float64, scaling in
 * float32 (ggml's order). */
typedef int qc_op_rmsnorm(qc_backend *be, const float *x, const float *w, int n, int dim,
                          float eps, float *out);
/* out[n][rows] = x[n][cols] @ W^T (+ bias[rows] when bias is not NULL). */
typedef int qc_op_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x,
                         int n, float *out);
/* In place NEOX rotary embedding of x[n][n_heads][head_dim]: for i < head_dim/2 the pair
 * (i, i + head_dim/2) of token t is rotated by pos[t] * theta^(-2i/head_dim). */
typedef int qc_op_rope(qc_backend *be, float *x, const int32_t *pos, int n, int n_heads,
                       int head_dim, float theta);
/* cache.k[pos[t]][:] = k[t][:], likewise v, converted to cache.type; rows are kv_dim wide. */
typedef int qc_op_kv_store(qc_backend *be, const float *k, const float *v, const int32_t *pos,
                           int n, int kv_dim, qc_kv_cache cache);
/* Causal GQA attention over the cache: query t (head h) attends keys 0..pos[t] of KV head
 * h / (n_head / n_head_kv), scale 1/sqrt(head_dim). q is [n][n_head][head_dim], out is
 * [n][n_head * head_dim]. n_kv = pos[n-1] + 1 (the host knows it). scores and probs, when
 * not NULL, receive [n_head][n][n_kv]: scaled scores with -inf where masked, and the
 * softmax (0 where masked); they are computed in fp32 from the cache's values (the exact
 * path). Without them, CUDA runs flash attention on tensor cores over an F16 cache (q and
 * the probabilities rounded to f16, fp32 accumulation); an F32 cache, and the CPU, keep the
 * exact path.
 * A backend may choose its kernel by n_kv's bucket (qc_kv_bucket): a recording replays only
 * for evals in the bucket it was recorded in. */
typedef int qc_op_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos,
                            int n, int n_kv, int n_head, int n_head_kv, int head_dim, float *out,
                            float *scores, float *probs);
/* out = silu(gate) * up, elementwise over count values. */
typedef int qc_op_swiglu(qc_backend *be, const float *gate, const float *up, int64_t count,
                         float *out);
/* out = a + b, elementwise (out may alias a or b). */
typedef int qc_op_add(qc_backend *be, const float *a, const float *b, int64_t count, float *out);
/* out[i] = index of the largest value of row i of x[n][cols] (first one on ties). */
typedef int qc_op_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out);
/* One draw from logits[n_vocab] by the chain of sampler.h (qc_sample_row): state is a
 * qc_sample_state followed by its n_history token ids, work is qc_sample_work_bytes(n_vocab)
 * bytes of scratch, result receives a qc_sample_result; all three in backend memory, so that
 * a recorded decode step samples with whatever state was uploaded before its replay. */
typedef int qc_op_sample(qc_backend *be, const float *logits, int64_t n_vocab, const void *state,
                         void *work, void *result);

/* ---- fused ops: each computes what a sequence of the ops above computes, with the same
 * float operations where the backend can keep them (the CPU always; CUDA up to
 * QC_GEMV_MAX_TOKENS tokens), in one pass instead of several. The forward pass uses them
 * unless a capture asks for an intermediate that they never write. ---- */
/* out[n][rows] = residual[n][rows] + x[n][cols] @ W^T: matmul (no bias), then add.
 * residual may alias out (the residual stream updated in place). x_from_last_op: the caller
 * says that x is the output of the backend op called just before this one (attention, or
 * matmul_swiglu for the down projection), unchanged since: a backend that left x's 8-bit form
 * beside it (CUDA, one token) reads that instead of quantizing x again; the result is the same
 * either way. norm_next: the norm weight with which the next op, a matmul_swiglu called right
 * after this one, normalises out (nothing changing out in between), or NULL: a backend may
 * leave out's normalised 8-bit form for it (CUDA, one token: the feed-forward norm then costs
 * no launch, matmul.cu), which changes no value of out but may change the rounding of that op's
 * act (the norm's scale applied after its dot products: qc_gemv_q8.cuh). */
typedef int qc_op_matmul_add(qc_backend *be, const qc_weight *w, const float *x, int n,
                             const float *residual, float *out, int x_from_last_op, const float *norm_next);
/* matmul of one x by n_parts (1..QC_MATMUL_MULTI_MAX) weights with the same cols, each with
 * its own type, rows, bias and output: q, k and v in one launch. The outputs must not
 * overlap x or each other. norm_w: when not NULL, x is first RMS-normalised with it and
 * eps (rmsnorm, bit for bit; the normalised x is not kept), so the attention norm needs no
 * launch of its own. */
typedef int qc_op_matmul_multi(qc_backend *be, const qc_matmul_part *parts, int n_parts,
                               const float *x, int n, const float *norm_w, float eps);
/* act[n][rows] = silu(x @ Wg^T) * (x @ Wu^T): matmul by w_gate and by w_up (no biases), then
 * swiglu. w_gate and w_up have the same shape (rows, cols); their types may differ.
 * norm_w, eps: as in matmul_multi (the feed-forward norm). */
typedef int qc_op_matmul_swiglu(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                                const float *x, int n, const float *norm_w, float eps, float *act);
/* rope of q[n][n_head][head_dim] and of k[n][n_head_kv][head_dim] in place at pos[t], then
 * kv_store of the rotated k and of v[n][n_head_kv * head_dim] into the caches at pos[t]. */
typedef int qc_op_rope_kv_store(qc_backend *be, float *q, float *k, const float *v,
                                const int32_t *pos, int n, int n_head, int n_head_kv,
                                int head_dim, float theta, qc_kv_cache cache);
/* matmul_multi of x by q, k and v (qkv[0..2]; norm_w and eps as there), then rope_kv_store of
 * their outputs: q and k rotated in place, the rotated k and v in the caches at pos[t]. One op,
 * so that a backend may do it in one pass (CUDA, one token: a block rotates the rows it
 * computed). */
typedef int qc_op_matmul_qkv_rope(qc_backend *be, const qc_matmul_part *qkv, const float *x, int n,
                                  const float *norm_w, float eps, const int32_t *pos, int n_head,
                                  int n_head_kv, int head_dim, float theta, qc_kv_cache cache);

/* matmul_qkv_rope, then attention (without scores) of q over the cache into out: the attention
 * norm, q, k, v, RoPE, the cache write and the attention as one op, so that a backend may run them
 * in one pass (CUDA, one token: each query head's cluster of blocks computes the rows it needs,
 * qkv_attention.cu). q, k, v and the caches hold what matmul_qkv_rope leaves; out what attention
 * writes, bit for bit.
 * x_sum: NULL, or (one token, norm_w given) the fixed-point sums that swiglu_down (below) left for
 * this op: its input is then x + qc_sum_value(x_sum) (the residual stream after the down
 * projection), which it also writes to x_out (not x: x is read while it runs). */
typedef int qc_op_qkv_attention(qc_backend *be, const qc_matmul_part *qkv, const float *x, int n,
                                const float *norm_w, float eps, const int32_t *pos, int n_kv, int n_head,
                                int n_head_kv, int head_dim, float theta, qc_kv_cache cache, float *out,
                                const int64_t *x_sum, float *x_out);

/* The fixed-point sums of swiglu_down: a value v is held as round(v * 2^32) in a 64-bit integer,
 * so that sums added in any order (integer atomics) come out the same at every run. */
static inline float qc_sum_value(int64_t s) { return (float)s * (1.0f / 4294967296.0f); }

/* Every op above, in table order. From this one list come the members of qc_backend_ops and
 * each backend's declarations and table (cpu_backend.h/.c, qc_cuda.cuh, cuda_backend.cu): a
 * new op is its function type above, its name here, and its two implementations. */
#define QC_BACKEND_OPS(X)                                                                       \
    X(embed) X(rmsnorm) X(matmul) X(rope) X(kv_store) X(attention) X(swiglu) X(add) X(argmax) \
    X(sample) X(matmul_add) X(matmul_multi) X(matmul_swiglu) X(rope_kv_store) X(matmul_qkv_rope)   \
    X(qkv_attention)

/* ---- the decode step in one launch (optional: CUDA's persistent decode kernel) ----
 * What a decode step of one token reads and writes, for decode_step below: the weights and
 * caches of every layer, and the activation buffers of the session. */
typedef struct qc_decode_layer {
    const qc_weight *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;
    const float *bq, *bk, *bv;            /* NULL where the file has none */
    const float *attn_norm, *ffn_norm;
    qc_kv_cache kv;
} qc_decode_layer;

typedef struct qc_decode_plan {
    int n_layer, dim, ffn_dim, n_head, n_head_kv, head_dim;
    float norm_eps, rope_theta;
    const qc_decode_layer *layers;        /* [n_layer] */
    const float *output_norm;
    const qc_weight *output;              /* the lm_head */
    const int32_t *pos;                   /* (1) the token's position, in backend memory */
    float *x;                             /* (dim) the embedded token in, the residual stream out */
    float *q, *att;                       /* (n_head * head_dim) scratch */
    float *act;                           /* (ffn_dim) scratch */
    float *logits;                        /* (n_vocab) out */
} qc_decode_plan;

typedef struct qc_backend_ops {
    /* ---- memory ---- */
    int (*alloc)(qc_backend *be, size_t bytes, void **out);
    void (*free)(qc_backend *be, void *ptr);                                      /* NULL ok */
    int (*upload)(qc_backend *be, void *dst, const void *host_src, size_t bytes);
    int (*download)(qc_backend *be, void *host_dst, const void *src, size_t bytes); /* waits */
    int (*copy)(qc_backend *be, void *dst, const void *src, size_t bytes);
    /* Make w->data usable by the ops (CPU: w->data = w->host; CUDA: allocate and upload). */
    int (*weight_load)(qc_backend *be, qc_weight *w);
    void (*weight_free)(qc_backend *be, qc_weight *w);                            /* safe twice */
    int (*synchronize)(qc_backend *be);
    void (*destroy)(qc_backend *be);

    /* ---- the ops: qc_op_embed *embed; ... in QC_BACKEND_OPS order ---- */
#define QC_OP_MEMBER(name) qc_op_##name *name;
    QC_BACKEND_OPS(QC_OP_MEMBER)
#undef QC_OP_MEMBER

    /* ---- optional (NULL where unsupported): record a sequence of ops once, replay it ----
     * Between record_begin and record_end the ops are recorded, not run; replay runs the
     * recording with the argument values it was recorded with (pointers included), so only
     * what the ops read from backend memory (ids, positions) may change between replays. The
     * CUDA backend records a CUDA graph: a decode step becomes one launch instead of ~360. */
    int (*record_begin)(qc_backend *be);
    int (*record_end)(qc_backend *be, void **recording);   /* ends it even after a failed op */
    int (*replay)(qc_backend *be, void *recording);
    void (*recording_free)(qc_backend *be, void *recording); /* NULL ok */

    /* ---- optional (NULL where unsupported): the next decode step, queued before the host has
     * seen this step's token ----
     * feed_draw sets a decode step's inputs from the draw of the step before, in backend
     * memory: ids[0] = the token of `result` (the qc_sample_result that step wrote; an id
     * outside [0, n_vocab) becomes 0, so that no row out of range is read), pos[0] += 1, and
     * the RNG of `state` (the draw's qc_sample_state) = the result's unless that is 0
     * (qc_sampler_set_rng's rule). A recorded step that draws ends with it (session.c), so that
     * replaying the recording again, with no upload, runs the step for the token it drew.
     * download_start queues a copy of bytes (<= QC_DOWNLOAD_AHEAD_BYTES) from src into the
     * backend's own host memory and returns at once with a ticket; download_finish waits for
     * that copy alone, not for the work queued after it, and hands its bytes over. A ticket
     * is good until QC_DOWNLOAD_TICKETS more copies have started. */
    int (*feed_draw)(qc_backend *be, const void *result, void *state, int32_t *ids, int32_t *pos,
                     int64_t n_vocab);
    /* matmul_draw: the lm_head of one row and its greedy draw in one pass, for a state that
     * draws greedily without a penalty (qc_sample_plain_greedy): logits = x @ w^T (matmul, no
     * bias) and result = what sample leaves over them (the first largest logit, NaN never
     * chosen, -1 when every logit is NaN or -inf; the state's RNG), the same logits and result.
     * norm_w: when not NULL, x is first RMS-normalised with it and eps (rmsnorm, bit for bit;
     * the normalised x is not kept), so the output norm needs no launch of its own. x_sum (NULL,
     * or with norm_w): the sums of the last layer's folded down projection (swiglu_down), so that
     * the row is x + qc_sum_value(x_sum), as sum_add would leave it (x itself unchanged). With ids
     * and pos (not NULL) it then does what feed_draw does with that result, and may also put
     * the result where draw_ticket finds it. Returns 2 when it ran and did that, 1 when it ran,
     * 0 where it does not serve w (nothing queued: the caller runs rmsnorm, matmul, sample and
     * feed_draw), -1 on error. */
    int (*matmul_draw)(qc_backend *be, const qc_weight *w, const float *x, const int64_t *x_sum,
                       const float *norm_w, float eps, float *logits, const void *state, void *result,
                       int32_t *ids, int32_t *pos);
    int (*download_start)(qc_backend *be, const void *src, size_t bytes, int *ticket);
    int (*download_finish)(qc_backend *be, int ticket, void *host_dst, size_t bytes);
    /* draw_ticket: download_start of the qc_sample_result that the step just queued drew, where
     * that step is a replay of a recording whose matmul_draw returned 2 (it fed the step after
     * it and put the result into the backend's host memory), pos the queued step's position:
     * only the wait for it is queued, not a copy of its own. The ticket is download_finish's,
     * good until the step two positions on, drawing into the same result, is queued. NULL: the
     * caller takes download_start. */
    int (*draw_ticket)(qc_backend *be, const void *result, int pos, int *ticket);

    /* ---- optional (NULL where unsupported): a decode step's layers and lm_head at once ----
     * decode_step computes what the fused ops compute for one token over n_kv keys (the
     * layers, the output norm and the lm_head: x, both caches and logits), with the same bits,
     * in one launch. decode_step_takes says whether it takes a plan over n_kv keys (1) or the
     * step must run op by op (0: a weight type, a shape or a context it does not serve); the
     * answer depends on n_kv only through qc_kv_bucket, and not on the plan's buffers, so a
     * session asks once per bucket. */
    int (*decode_step_takes)(qc_backend *be, const qc_decode_plan *plan, int n_kv);
    int (*decode_step)(qc_backend *be, const qc_decode_plan *plan);

    /* ---- optional (NULL where unsupported): the down projection inside the gate/up op ----
     * swiglu_down: matmul_swiglu of one token (norm_w as there), then act @ w_down^T, not added
     * to x but into sum (w_down->rows 64-bit fixed-point values, qc_sum_value) that must hold
     * zeros; and clear (another such buffer, or NULL) set to zeros, once every op before has
     * finished with it. The next op that reads x takes x + sum (qkv_attention's x_sum): the layer's
     * down projection then costs no op and no wait of its own. The sums differ from matmul_add's
     * float ones only in the order of their additions (and a rounding at 2^-32).
     * swiglu_down_prepare, outside any recording (it may allocate and launch): 1 where
     * swiglu_down takes these weights (then it never declines them), 0 where it does not, -1 on
     * error. sum_add (with them): out = x + qc_sum_value(sum), n values (out may be x), for a
     * consumer of the sums that does not add them itself (the head without matmul_draw). */
    int (*swiglu_down_prepare)(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                               const qc_weight *w_down);
    int (*swiglu_down)(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down,
                       const float *x, const float *norm_w, float eps, float *act, int64_t *sum, int64_t *clear);
    int (*sum_add)(qc_backend *be, const float *x, const int64_t *sum, int64_t n, float *out);

    /* ---- optional (NULL where unsupported): weights to read ahead ----
     * read_ahead names the n (<= QC_READ_AHEAD_MAX) weights of an op after the next one; the next
     * matmul or matmul_add takes the hint (CUDA, up to QC_GEMV_MAX_TOKENS tokens: its blocks ask
     * L2 for those weights' bytes while they wait for their input) and clears it. A hint: no
     * value changes, and a backend may drop it (CUDA: where the bytes are too many for L2). */
    int (*read_ahead)(qc_backend *be, const qc_weight *const *w, int n);
} qc_backend_ops;

struct qc_backend {
    const qc_backend_ops *ops;
    const char *name;         /* "cpu" or "cuda" */
    int device;               /* CUDA device ordinal; 0 for cpu */
    int threads;              /* CPU worker threads */
    qc_error err;             /* filled by a failing op */
    void *impl;               /* backend-private state */
};

/* device: "cpu", "cpu:float", "cuda", "cuda:N", "cuda:float" or "cuda:N:float" (":float": the
 * float32 kernels everywhere, no 8-bit activations). threads: CPU workers, <= 0 for all cores. */
int qc_backend_create(const char *device, int threads, qc_backend **out, qc_error *err);
void qc_backend_destroy(qc_backend *be);   /* NULL ok */

int qc_cpu_backend_create(int threads, qc_backend **out, qc_error *err);
/* Defined only in CUDA builds (QC_HAVE_CUDA); elsewhere qc_backend_create says so. */
int qc_cuda_backend_create(int device, int float_gemv, qc_backend **out, qc_error *err);
/* Number of visible CUDA devices; 0 in CPU-only builds or without a driver/GPU. */
int qc_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
#endif /* QC_BACKEND_H */
