/* cpu_ops.c: the ops of backend.h in plain C, the readable twins of the CUDA kernels.
 *
 * Numerics, op by op (py_kernels tests and the CUDA kernels can match these exactly):
 *  - embed      out[i] = qc_dequantize(table row ids[i]): bit-exact with gguf's dequantize.
 *  - rmsnorm    ss = sum x^2 in float64; mean = (float)(ss / dim); scale = 1.0f / sqrtf(mean +
 *               eps) in float32; out = (x * scale) * w in float32. This is ggml's order.
 *  - matmul     out[t][r] = qc_dot_row(W row r, x[t]) + bias[r]: float32 products summed in 32
 *               float32 lanes (quants.c), then + bias in float32. Bit-identical for every n:
 *               token t gets the same bits in a 64-token prefill as in a 1-token decode.
 *  - rope       angle = pos * theta^(-2i/head_dim) and its cos/sin in float64, rounded to
 *               float32; the rotation (x0 c - x1 s, x0 s + x1 c) in float32.
 *  - attention  score = dot(q, k) (float32, lanes as matmul) * (1.0f / sqrtf(head_dim));
 *               p = exp(score - max) in float64, divided by their float64 sum, rounded to
 *               float32; out = sum_k p_k v_k accumulated in float32 in key order.
 *  - swiglu     out = (g / (1.0f + expf(-g))) * up, float32.
 *  - add        out = a + b, float32.
 *  - argmax     first index of the maximum; NaN never wins (a row of NaN gives 0).
 *  - sample     qc_sample_row (sampler.c), the host sampler's own code.
 * Parallel loops (matmul rows, attention heads x queries, large elementwise ops) run on the
 * backend's thread pool with a fixed split, so results do not depend on the thread count.
 */
#include "cpu_backend.h"

#include <math.h>
#include <string.h>

#include "quants.h"
#include "sampler.h"

static qc_cpu_state *state(qc_backend *be) { return be->impl; }

/* Loops over fewer elements than this run on the calling thread: waking the pool costs
 * more than the work. */
#define QC_PARALLEL_MIN 32768

/* Float dot with qc_dot_row's lane order (float32 products in 32 lanes). */
static float dot_f32(const float *a, const float *b, int64_t n) {
    return qc_dot_row(QC_TYPE_F32, a, b, n);
}

/* ---------------------------------------------------------------------------------------- */
/* embed: out[i][:] = dequantized row ids[i] of table                                          */

int qc_cpu_embed(qc_backend *be, const qc_weight *table, const int32_t *ids, int n, float *out) {
    const qc_type_traits *tr = qc_type_get(table->type);
    int64_t row_bytes = qc_row_bytes(table->type, table->cols);
    if (tr == NULL || tr->dequantize == NULL || row_bytes < 0 || n < 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "embed: unsupported table (type %s, %lld columns) "
                       "or n = %d", tr ? tr->name : "?", (long long)table->cols, n);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= table->rows)
            return qc_fail(&be->err, QC_ERR_RANGE, "embed: token id %d at %d is outside [0, %lld)",
                           ids[i], i, (long long)table->rows);
    for (int i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)table->data + (size_t)ids[i] * (size_t)row_bytes;
        if (qc_dequantize(table->type, row, out + (size_t)i * (size_t)table->cols, 1, table->cols,
                          &be->err) < 0)
            return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* rmsnorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w                                      */

typedef struct {
    const float *x, *w;
    int dim;
    float eps;
    float *out;
} rmsnorm_job;

static void rmsnorm_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    rmsnorm_job *j = ctx;
    (void)worker;
    for (int64_t t = begin; t < end; t++) {
        const float *x = j->x + (size_t)t * (size_t)j->dim;
        float *o = j->out + (size_t)t * (size_t)j->dim;
        double ss = 0.0;
        for (int i = 0; i < j->dim; i++) ss += (double)x[i] * (double)x[i];
        const float mean = (float)(ss / j->dim);
        const float scale = 1.0f / sqrtf(mean + j->eps);
        for (int i = 0; i < j->dim; i++) o[i] = (x[i] * scale) * j->w[i];
    }
}

int qc_cpu_rmsnorm(qc_backend *be, const float *x, const float *w, int n, int dim, float eps,
                   float *out) {
    if (n < 0 || dim <= 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "rmsnorm: bad shape n=%d dim=%d", n, dim);
    rmsnorm_job job = {x, w, dim, eps, out};
    if ((int64_t)n * dim < QC_PARALLEL_MIN) rmsnorm_rows(&job, 0, n, 0);
    else qc_pool_run(state(be)->pool, n, rmsnorm_rows, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* matmul: out[n][rows] = x[n][cols] @ W^T (+ bias)                                            */

/* Rows dequantized together for a prefill: each token vector is then read once per tile
 * instead of once per row (a 64-token x of 896 floats is 229 KB, an L2 read per row). */
#define QC_MATMUL_TILE 8

typedef struct {
    qc_backend *be;
    const qc_weight *w;
    const float *bias, *x;
    int n;
    float *out;
    int64_t row_bytes;
} matmul_job;

static void matmul_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    matmul_job *j = ctx;
    const qc_weight *w = j->w;
    const uint8_t *base = w->data;
    const int64_t cols = w->cols, rows = w->rows;
    if (j->n == 1) {
        /* Decode: each stored row is read once, 256 elements at a time (qc_dot_row). */
        for (int64_t r = begin; r < end; r++) {
            const float b = j->bias ? j->bias[r] : 0.0f;
            j->out[r] = qc_dot_row(w->type, base + (size_t)r * (size_t)j->row_bytes, j->x, cols) + b;
        }
        return;
    }
    /* Prefill: dequantize a tile of rows once into this thread's scratch, then one float dot
     * per (token, row). qc_dot_row of a stored row equals the F32 dot of its dequantized
     * values bit for bit, so this gives exactly the decode path's numbers. */
    float *tile = state(j->be)->scratch[worker];
    for (int64_t r0 = begin; r0 < end; r0 += QC_MATMUL_TILE) {
        const int nr = end - r0 < QC_MATMUL_TILE ? (int)(end - r0) : QC_MATMUL_TILE;
        const float *wr = (const float *)(base + (size_t)r0 * (size_t)j->row_bytes);
        if (w->type != QC_TYPE_F32) {
            /* type and width were checked by qc_cpu_matmul: this cannot fail */
            qc_dequantize(w->type, base + (size_t)r0 * (size_t)j->row_bytes, tile, nr, cols, NULL);
            wr = tile;
        }
        for (int t = 0; t < j->n; t++) {
            const float *xt = j->x + (size_t)t * (size_t)cols;
            float *ot = j->out + (size_t)t * (size_t)rows;
            for (int k = 0; k < nr; k++) {
                const float b = j->bias ? j->bias[r0 + k] : 0.0f;
                ot[r0 + k] = dot_f32(wr + (size_t)k * (size_t)cols, xt, cols) + b;
            }
        }
    }
}

int qc_cpu_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                  float *out) {
    const qc_type_traits *tr = qc_type_get(w->type);
    int64_t row_bytes = qc_row_bytes(w->type, w->cols);
    if (tr == NULL || tr->dequantize == NULL || row_bytes < 0 || w->rows < 0 || n < 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "matmul: unsupported weight (type %s, %lld x %lld) "
                       "or n = %d", tr ? tr->name : "?", (long long)w->rows, (long long)w->cols, n);
    if (n == 0 || w->rows == 0) return 0;
    if (n > 1 && w->type != QC_TYPE_F32 &&
        qc_cpu_scratch(be, (size_t)QC_MATMUL_TILE * (size_t)w->cols) < 0)
        return -1;
    matmul_job job = {be, w, bias, x, n, out, row_bytes};
    if (w->rows * w->cols * n < QC_PARALLEL_MIN) matmul_rows(&job, 0, w->rows, 0);
    else qc_pool_run(state(be)->pool, w->rows, matmul_rows, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* rope: NEOX pairs (i, i + head_dim/2), in place                                              */

int qc_cpu_rope(qc_backend *be, float *x, const int32_t *pos, int n, int n_heads, int head_dim,
                float theta) {
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 || head_dim > 4096 ||
        !(theta > 0.0f))
        return qc_fail(&be->err, QC_ERR_VALUE, "rope: bad shape n=%d heads=%d head_dim=%d or "
                       "theta=%g", n, n_heads, head_dim, (double)theta);
    const int half = head_dim / 2;
    double inv_freq[2048];
    for (int i = 0; i < half; i++) inv_freq[i] = pow((double)theta, -2.0 * i / head_dim);
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < half; i++) {
            const double angle = (double)pos[t] * inv_freq[i];
            const float c = (float)cos(angle), s = (float)sin(angle);
            for (int h = 0; h < n_heads; h++) {
                float *v = x + ((size_t)t * n_heads + h) * (size_t)head_dim;
                const float x0 = v[i], x1 = v[i + half];
                v[i] = x0 * c - x1 * s;
                v[i + half] = x0 * s + x1 * c;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* kv_store: cache[pos[t]] = k[t], v[t]                                                         */

int qc_cpu_kv_store(qc_backend *be, const float *k, const float *v, const int32_t *pos, int n,
                    int kv_dim, float *k_cache, float *v_cache) {
    if (n < 0 || kv_dim <= 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "kv_store: bad shape n=%d kv_dim=%d", n, kv_dim);
    for (int t = 0; t < n; t++)
        if (pos[t] < 0)
            return qc_fail(&be->err, QC_ERR_RANGE, "kv_store: negative position %d at %d", pos[t], t);
    /* The caller (session.c) keeps positions below the cache's max_ctx, which we cannot see. */
    const size_t row = sizeof(float) * (size_t)kv_dim;
    for (int t = 0; t < n; t++) {
        memcpy(k_cache + (size_t)pos[t] * (size_t)kv_dim, k + (size_t)t * (size_t)kv_dim, row);
        memcpy(v_cache + (size_t)pos[t] * (size_t)kv_dim, v + (size_t)t * (size_t)kv_dim, row);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* attention: causal GQA over the cache                                                        */

typedef struct {
    qc_backend *be;
    const float *q, *k_cache, *v_cache;
    const int32_t *pos;
    int n, n_kv, n_head, n_head_kv, head_dim;
    float *out, *scores, *probs;
} attn_job;

/* Items are (head, query) pairs, head-major, so a fixed split hands every thread whole heads
 * whose causal work is the same. */
static void attention_items(void *ctx, int64_t begin, int64_t end, int worker) {
    attn_job *j = ctx;
    const int hd = j->head_dim, group = j->n_head / j->n_head_kv, kv_dim = j->n_head_kv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    /* this thread's scratch: e[n_kv] float64 exponentials, then s[n_kv] scores/probabilities */
    double *e = (double *)state(j->be)->scratch[worker];
    float *s = (float *)(e + j->n_kv);
    for (int64_t item = begin; item < end; item++) {
        const int h = (int)(item / j->n), t = (int)(item % j->n);
        const int kvh = h / group;                      /* GQA: query head h reads KV head h/group */
        const int last = j->pos[t];                     /* causal: keys 0..pos[t] */
        const float *qv = j->q + ((size_t)t * j->n_head + h) * (size_t)hd;
        const float *kbase = j->k_cache + (size_t)kvh * hd, *vbase = j->v_cache + (size_t)kvh * hd;
        float maxs = -INFINITY;
        for (int k = 0; k <= last; k++) {
            s[k] = dot_f32(qv, kbase + (size_t)k * kv_dim, hd) * scale;
            if (s[k] > maxs) maxs = s[k];
        }
        const size_t off = ((size_t)h * j->n + t) * (size_t)j->n_kv;
        if (j->scores) {
            memcpy(j->scores + off, s, sizeof(float) * (size_t)(last + 1));
            for (int k = last + 1; k < j->n_kv; k++) j->scores[off + k] = -INFINITY;
        }
        /* Numerically stable softmax: subtract the max, sum the exponentials in float64. */
        double denom = 0.0;
        for (int k = 0; k <= last; k++) {
            e[k] = exp((double)s[k] - (double)maxs);
            denom += e[k];
        }
        for (int k = 0; k <= last; k++) s[k] = (float)(e[k] / denom);
        float *o = j->out + (size_t)t * j->n_head * (size_t)hd + (size_t)h * hd;
        for (int d = 0; d < hd; d++) o[d] = 0.0f;
        for (int k = 0; k <= last; k++) {
            const float p = s[k];
            const float *vv = vbase + (size_t)k * kv_dim;
            for (int d = 0; d < hd; d++) o[d] += p * vv[d];
        }
        if (j->probs) {
            memcpy(j->probs + off, s, sizeof(float) * (size_t)(last + 1));
            for (int k = last + 1; k < j->n_kv; k++) j->probs[off + k] = 0.0f;
        }
    }
}

int qc_cpu_attention(qc_backend *be, const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *pos, int n, int n_kv, int n_head, int n_head_kv, int head_dim,
                     float *out, float *scores, float *probs) {
    if (n < 0 || n_kv < 0 || head_dim <= 0 || n_head_kv <= 0 || n_head <= 0 ||
        n_head % n_head_kv != 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "attention: bad shape n=%d n_kv=%d heads=%d "
                       "kv_heads=%d head_dim=%d", n, n_kv, n_head, n_head_kv, head_dim);
    for (int t = 0; t < n; t++)
        if (pos[t] < 0 || pos[t] >= n_kv)
            return qc_fail(&be->err, QC_ERR_RANGE, "attention: position %d of query %d is outside "
                           "[0, %d)", pos[t], t, n_kv);
    if (n == 0) return 0;
    if (qc_cpu_scratch(be, 3 * (size_t)n_kv) < 0) return -1;
    attn_job job = {be, q, k_cache, v_cache, pos, n, n_kv, n_head, n_head_kv, head_dim,
                    out, scores, probs};
    const int64_t items = (int64_t)n_head * n;
    if (items * n_kv * head_dim < QC_PARALLEL_MIN) attention_items(&job, 0, items, 0);
    else qc_pool_run(state(be)->pool, items, attention_items, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* elementwise                                                                                 */

typedef struct {
    const float *a, *b;
    float *out;
} ew_job;

static void swiglu_range(void *ctx, int64_t begin, int64_t end, int worker) {
    ew_job *j = ctx;
    (void)worker;
    for (int64_t i = begin; i < end; i++) {
        const float g = j->a[i];
        j->out[i] = (g / (1.0f + expf(-g))) * j->b[i];
    }
}

static void add_range(void *ctx, int64_t begin, int64_t end, int worker) {
    ew_job *j = ctx;
    (void)worker;
    for (int64_t i = begin; i < end; i++) j->out[i] = j->a[i] + j->b[i];
}

int qc_cpu_swiglu(qc_backend *be, const float *gate, const float *up, int64_t count, float *out) {
    if (count < 0) return qc_fail(&be->err, QC_ERR_VALUE, "swiglu: count %lld", (long long)count);
    ew_job job = {gate, up, out};
    if (count < QC_PARALLEL_MIN) swiglu_range(&job, 0, count, 0);
    else qc_pool_run(state(be)->pool, count, swiglu_range, &job);
    return 0;
}

int qc_cpu_add(qc_backend *be, const float *a, const float *b, int64_t count, float *out) {
    if (count < 0) return qc_fail(&be->err, QC_ERR_VALUE, "add: count %lld", (long long)count);
    ew_job job = {a, b, out};
    /* memory-bound: one thread is as fast as two below a few hundred thousand values */
    if (count < 8 * QC_PARALLEL_MIN) add_range(&job, 0, count, 0);
    else qc_pool_run(state(be)->pool, count, add_range, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* argmax                                                                                      */

/* The first index of the largest value. NaN never wins: every comparison with NaN is false,
 * and a NaN in the lead is replaced by the next number; a row of only NaN gives 0. */
int qc_cpu_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out) {
    if (n < 0 || cols <= 0 || cols > INT32_MAX)
        return qc_fail(&be->err, QC_ERR_VALUE, "argmax: bad shape n=%d cols=%lld", n, (long long)cols);
    for (int t = 0; t < n; t++) {
        const float *row = x + (size_t)t * (size_t)cols;
        int64_t best = 0;
        for (int64_t i = 1; i < cols; i++)
            if (row[i] > row[best] || (isnan(row[best]) && !isnan(row[i]))) best = i;
        out[t] = (int32_t)best;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* sample: one draw by the host sampler's chain                                                */

int qc_cpu_sample(qc_backend *be, const float *logits, int64_t n_vocab, const void *state_mem,
                  void *work, void *result_mem) {
    if (n_vocab <= 0 || n_vocab > INT32_MAX)
        return qc_fail(&be->err, QC_ERR_VALUE, "sample: %lld logits", (long long)n_vocab);
    qc_sample_result *res = result_mem;
    res->token = qc_sample_row(state_mem, logits, n_vocab, work, &res->rng);
    res->pad = 0;
    return 0;
}
