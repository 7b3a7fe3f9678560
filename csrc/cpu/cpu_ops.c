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
 * The fused ops compute these very expressions, so they equal their unfused sequences bit for
 * bit: matmul_add = matmul then add, matmul_multi = one matmul per weight, matmul_swiglu =
 * matmul, matmul, swiglu, rope_kv_store = rope of q, rope of k, kv_store. They save passes over
 * memory and wake-ups of the thread pool (one for q, k and v instead of three).
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
/* matmul, matmul_add, matmul_multi: out[n][rows] = (residual +) x[n][cols] @ W^T (+ bias)     */

/* Rows dequantized together for a prefill: each token vector is then read once per tile
 * instead of once per row (a 64-token x of 896 floats is 229 KB, an L2 read per row). */
#define QC_MATMUL_TILE 8

/* One weight of a matmul job and what its rows produce. */
typedef struct {
    const qc_weight *w;
    int64_t row_bytes;
    const float *bias;        /* (rows) or NULL */
    const float *residual;    /* (n, rows) added last, or NULL; may alias out */
    float *out;               /* (n, rows) */
} matmul_part;

/* A matmul of one x by up to QC_MATMUL_MULTI_MAX weights, in n_slices slices: slice s is the
 * s-th of n_slices equal shares of every part's rows. The pool runs one slice per thread, so q,
 * k and v wake the threads once and each thread gets a share of each weight: balanced even
 * when the types cost differently per row (a Q5_0 row takes longer than a Q8_0 one here). */
typedef struct {
    qc_backend *be;
    const float *x;           /* (n, cols), cols the same for every part */
    int n;
    int n_parts;
    matmul_part part[QC_MATMUL_MULTI_MAX];
    int64_t n_slices;
} matmul_job;

/* The value of out[t][r] from the dot product of row r with x[t]: the products, then the bias,
 * then the residual, the order of matmul followed by add (the fused ops give the same bits). */
static inline float matmul_value(const matmul_part *p, int t, int64_t r, float dot) {
    const float v = dot + (p->bias ? p->bias[r] : 0.0f);
    return p->residual ? p->residual[(size_t)t * (size_t)p->w->rows + (size_t)r] + v : v;
}

/* Rows [begin, end) of one part. */
static void matmul_part_rows(const matmul_job *j, const matmul_part *p, int64_t begin, int64_t end,
                             int worker) {
    const qc_weight *w = p->w;
    const uint8_t *base = w->data;
    const int64_t cols = w->cols, rows = w->rows;
    if (j->n == 1) {
        /* Decode: each stored row is read once, 256 elements at a time (qc_dot_row). */
        for (int64_t r = begin; r < end; r++)
            p->out[r] = matmul_value(p, 0, r, qc_dot_row(w->type, base + (size_t)r * (size_t)p->row_bytes,
                                                         j->x, cols));
        return;
    }
    /* Prefill: dequantize a tile of rows once into this thread's scratch, then one float dot
     * per (token, row). qc_dot_row of a stored row equals the F32 dot of its dequantized
     * values bit for bit, so this gives exactly the decode path's numbers. */
    float *tile = state(j->be)->scratch[worker];
    for (int64_t r0 = begin; r0 < end; r0 += QC_MATMUL_TILE) {
        const int nr = end - r0 < QC_MATMUL_TILE ? (int)(end - r0) : QC_MATMUL_TILE;
        const float *wr = (const float *)(base + (size_t)r0 * (size_t)p->row_bytes);
        if (w->type != QC_TYPE_F32) {
            /* type and width were checked by check_weight: this cannot fail */
            qc_dequantize(w->type, base + (size_t)r0 * (size_t)p->row_bytes, tile, nr, cols, NULL);
            wr = tile;
        }
        for (int t = 0; t < j->n; t++) {
            const float *xt = j->x + (size_t)t * (size_t)cols;
            float *ot = p->out + (size_t)t * (size_t)rows;
            for (int k = 0; k < nr; k++)
                ot[r0 + k] = matmul_value(p, t, r0 + k, dot_f32(wr + (size_t)k * (size_t)cols, xt, cols));
        }
    }
}

/* Slices [begin, end): their rows of every part. */
static void matmul_slices(void *ctx, int64_t begin, int64_t end, int worker) {
    const matmul_job *j = ctx;
    for (int64_t sl = begin; sl < end; sl++) {
        for (int i = 0; i < j->n_parts; i++) {
            const int64_t rows = j->part[i].w->rows;
            const int64_t lo = rows * sl / j->n_slices, hi = rows * (sl + 1) / j->n_slices;
            if (lo < hi) matmul_part_rows(j, &j->part[i], lo, hi, worker);
        }
    }
}

/* A weight the CPU can multiply, with cols columns (cols < 0: any); its row bytes, or -1. */
static int64_t check_weight(qc_backend *be, const qc_weight *w, int64_t cols, int n, const char *op) {
    const qc_type_traits *tr = qc_type_get(w->type);
    const int64_t row_bytes = qc_row_bytes(w->type, w->cols);
    if (tr == NULL || tr->dequantize == NULL || row_bytes < 0 || w->rows < 0 || n < 0 ||
        (cols >= 0 && w->cols != cols))
        return qc_fail(&be->err, QC_ERR_VALUE, "%s: unsupported weight (type %s, %lld x %lld) or n = %d",
                       op, tr ? tr->name : "?", (long long)w->rows, (long long)w->cols, n);
    return row_bytes;
}

/* Run a job whose parts are filled in: per-thread tiles for a prefill, then the rows. */
static int matmul_run(qc_backend *be, matmul_job *job) {
    const int64_t cols = job->part[0].w->cols;
    int64_t rows = 0;
    int need_tile = 0;
    for (int i = 0; i < job->n_parts; i++) {
        rows += job->part[i].w->rows;
        need_tile |= job->part[i].w->type != QC_TYPE_F32;
    }
    if (job->n == 0 || rows == 0) return 0;
    if (job->n > 1 && need_tile && qc_cpu_scratch(be, (size_t)QC_MATMUL_TILE * (size_t)cols) < 0)
        return -1;
    if (rows * cols * job->n < QC_PARALLEL_MIN) {
        job->n_slices = 1;
        matmul_slices(job, 0, 1, 0);
    } else {
        job->n_slices = qc_pool_threads(state(be)->pool);
        qc_pool_run(state(be)->pool, job->n_slices, matmul_slices, job);
    }
    return 0;
}

int qc_cpu_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                  float *out) {
    const int64_t row_bytes = check_weight(be, w, -1, n, "matmul");
    if (row_bytes < 0) return -1;
    matmul_job job = {.be = be, .x = x, .n = n, .n_parts = 1};
    job.part[0] = (matmul_part){w, row_bytes, bias, NULL, out};
    return matmul_run(be, &job);
}

int qc_cpu_matmul_add(qc_backend *be, const qc_weight *w, const float *x, int n,
                      const float *residual, float *out, int x_from_last_op,
                      const float *norm_next) {
    (void)x_from_last_op;   /* CUDA hints: the CPU keeps no 8-bit copy between ops */
    (void)norm_next;
    const int64_t row_bytes = check_weight(be, w, -1, n, "matmul_add");
    if (row_bytes < 0) return -1;
    matmul_job job = {.be = be, .x = x, .n = n, .n_parts = 1};
    job.part[0] = (matmul_part){w, row_bytes, NULL, residual, out};
    return matmul_run(be, &job);
}

/* The fused ops' norm: x normalised by the rmsnorm op into the backend's normed buffer, or x
 * itself without norm_w. NULL with be->err set on failure. */
static const float *normed_input(qc_backend *be, const float *x, const float *norm_w, int n,
                                 int64_t cols, float eps) {
    if (norm_w == NULL || n == 0) return x;
    float *xn = qc_cpu_normed_buffer(be, (size_t)n * (size_t)cols);
    if (xn == NULL || qc_cpu_rmsnorm(be, x, norm_w, n, (int)cols, eps, xn) < 0) return NULL;
    return xn;
}

int qc_cpu_matmul_multi(qc_backend *be, const qc_matmul_part *parts, int n_parts, const float *x,
                        int n, const float *norm_w, float eps) {
    if (n_parts < 1 || n_parts > QC_MATMUL_MULTI_MAX)
        return qc_fail(&be->err, QC_ERR_VALUE, "matmul_multi: %d weights (1..%d)", n_parts,
                       QC_MATMUL_MULTI_MAX);
    matmul_job job = {.be = be, .x = x, .n = n, .n_parts = n_parts};
    for (int i = 0; i < n_parts; i++) {
        const int64_t row_bytes = check_weight(be, parts[i].w, parts[0].w->cols, n, "matmul_multi");
        if (row_bytes < 0) return -1;
        job.part[i] = (matmul_part){parts[i].w, row_bytes, parts[i].bias, NULL, parts[i].out};
    }
    if ((job.x = normed_input(be, x, norm_w, n, parts[0].w->cols, eps)) == NULL) return -1;
    return matmul_run(be, &job);
}

/* ---------------------------------------------------------------------------------------- */
/* matmul_swiglu: act[n][rows] = silu(x @ Wg^T) * (x @ Wu^T)                                   */

/* silu(g) * u, the one expression of swiglu and matmul_swiglu (so they agree bit for bit). */
static inline float silu_mul(float g, float u) { return (g / (1.0f + expf(-g))) * u; }

/* Rows of gate and of up dequantized together for a prefill: half of matmul's tile each, so the
 * two tiles together take the scratch (and the L1 share) of one matmul tile. */
#define QC_SWIGLU_TILE (QC_MATMUL_TILE / 2)

typedef struct {
    qc_backend *be;
    const qc_weight *gate, *up;
    int64_t gate_row_bytes, up_row_bytes;
    const float *x;           /* (n, cols) */
    int n;
    float *act;               /* (n, rows) */
} swiglu_mm_job;

/* Rows [begin, end) of gate and up together: act never needs the gate and up matrices. The
 * products are matmul's (qc_dot_row, or the F32 dot of a dequantized tile) + 0.0f for the
 * missing bias, so act equals matmul, matmul, swiglu bit for bit. */
static void matmul_swiglu_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    const swiglu_mm_job *j = ctx;
    const uint8_t *gbase = j->gate->data, *ubase = j->up->data;
    const int64_t cols = j->gate->cols, rows = j->gate->rows;
    if (j->n == 1) {
        for (int64_t r = begin; r < end; r++) {
            const float g = qc_dot_row(j->gate->type, gbase + (size_t)r * (size_t)j->gate_row_bytes, j->x, cols) + 0.0f;
            const float u = qc_dot_row(j->up->type, ubase + (size_t)r * (size_t)j->up_row_bytes, j->x, cols) + 0.0f;
            j->act[r] = silu_mul(g, u);
        }
        return;
    }
    /* prefill: a tile of gate rows and the same tile of up rows, dequantized once per tile */
    float *gtile = state(j->be)->scratch[worker];
    float *utile = gtile + (size_t)QC_SWIGLU_TILE * (size_t)cols;
    for (int64_t r0 = begin; r0 < end; r0 += QC_SWIGLU_TILE) {
        const int nr = end - r0 < QC_SWIGLU_TILE ? (int)(end - r0) : QC_SWIGLU_TILE;
        const float *gr = (const float *)(gbase + (size_t)r0 * (size_t)j->gate_row_bytes);
        const float *ur = (const float *)(ubase + (size_t)r0 * (size_t)j->up_row_bytes);
        if (j->gate->type != QC_TYPE_F32) {
            qc_dequantize(j->gate->type, gbase + (size_t)r0 * (size_t)j->gate_row_bytes, gtile, nr, cols, NULL);
            gr = gtile;
        }
        if (j->up->type != QC_TYPE_F32) {
            qc_dequantize(j->up->type, ubase + (size_t)r0 * (size_t)j->up_row_bytes, utile, nr, cols, NULL);
            ur = utile;
        }
        for (int t = 0; t < j->n; t++) {
            const float *xt = j->x + (size_t)t * (size_t)cols;
            float *at = j->act + (size_t)t * (size_t)rows;
            for (int k = 0; k < nr; k++) {
                const float g = dot_f32(gr + (size_t)k * (size_t)cols, xt, cols) + 0.0f;
                const float u = dot_f32(ur + (size_t)k * (size_t)cols, xt, cols) + 0.0f;
                at[r0 + k] = silu_mul(g, u);
            }
        }
    }
}

int qc_cpu_matmul_swiglu(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                         const float *x, int n, const float *norm_w, float eps, float *act) {
    const int64_t gate_row_bytes = check_weight(be, w_gate, -1, n, "matmul_swiglu");
    if (gate_row_bytes < 0) return -1;
    const int64_t up_row_bytes = check_weight(be, w_up, w_gate->cols, n, "matmul_swiglu");
    if (up_row_bytes < 0) return -1;
    if (w_up->rows != w_gate->rows)
        return qc_fail(&be->err, QC_ERR_VALUE, "matmul_swiglu: gate has %lld rows, up %lld",
                       (long long)w_gate->rows, (long long)w_up->rows);
    const int64_t rows = w_gate->rows, cols = w_gate->cols;
    if (n == 0 || rows == 0) return 0;
    if (n > 1 && qc_cpu_scratch(be, 2 * (size_t)QC_SWIGLU_TILE * (size_t)cols) < 0) return -1;
    const float *xin = normed_input(be, x, norm_w, n, cols, eps);
    if (xin == NULL) return -1;
    swiglu_mm_job job = {be, w_gate, w_up, gate_row_bytes, up_row_bytes, xin, n, act};
    if (2 * rows * cols * n < QC_PARALLEL_MIN) matmul_swiglu_rows(&job, 0, rows, 0);
    else qc_pool_run(state(be)->pool, rows, matmul_swiglu_rows, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* rope: NEOX pairs (i, i + head_dim/2), in place                                              */

/* head_dim / 2 frequencies of the inv_freq buffers below */
#define QC_ROPE_MAX_HEAD_DIM 4096

static int rope_check(qc_backend *be, int n, int n_heads, int head_dim, float theta, const char *op) {
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 || head_dim > QC_ROPE_MAX_HEAD_DIM ||
        !(theta > 0.0f))
        return qc_fail(&be->err, QC_ERR_VALUE, "%s: bad shape n=%d heads=%d head_dim=%d or "
                       "theta=%g", op, n, n_heads, head_dim, (double)theta);
    return 0;
}

/* Rotate heads [0, n_heads) of one token's x[n_heads][head_dim] by the angles of one position:
 * c[i], s[i] for the pair (i, i + half). */
static void rope_token(float *x, int n_heads, int head_dim, const float *c, const float *s) {
    const int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * (size_t)head_dim;
        for (int i = 0; i < half; i++) {
            const float x0 = v[i], x1 = v[i + half];
            v[i] = x0 * c[i] - x1 * s[i];
            v[i + half] = x0 * s[i] + x1 * c[i];
        }
    }
}

/* cos and sin of pos * theta^(-2i/head_dim), computed in float64 and rounded to float32 */
static void rope_angles(int32_t pos, const double *inv_freq, int half, float *c, float *s) {
    for (int i = 0; i < half; i++) {
        const double angle = (double)pos * inv_freq[i];
        c[i] = (float)cos(angle);
        s[i] = (float)sin(angle);
    }
}

static void rope_inv_freq(float theta, int head_dim, double *inv_freq) {
    for (int i = 0; i < head_dim / 2; i++) inv_freq[i] = pow((double)theta, -2.0 * i / head_dim);
}

int qc_cpu_rope(qc_backend *be, float *x, const int32_t *pos, int n, int n_heads, int head_dim,
                float theta) {
    if (rope_check(be, n, n_heads, head_dim, theta, "rope") < 0) return -1;
    const int half = head_dim / 2;
    double inv_freq[QC_ROPE_MAX_HEAD_DIM / 2];
    float c[QC_ROPE_MAX_HEAD_DIM / 2], s[QC_ROPE_MAX_HEAD_DIM / 2];
    rope_inv_freq(theta, head_dim, inv_freq);
    for (int t = 0; t < n; t++) {
        rope_angles(pos[t], inv_freq, half, c, s);
        rope_token(x + (size_t)t * (size_t)n_heads * (size_t)head_dim, n_heads, head_dim, c, s);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* kv_store: cache[pos[t]] = k[t], v[t]                                                         */

static int positions_check(qc_backend *be, const int32_t *pos, int n, const char *op) {
    for (int t = 0; t < n; t++)
        if (pos[t] < 0)
            return qc_fail(&be->err, QC_ERR_RANGE, "%s: negative position %d at %d", op, pos[t], t);
    return 0;
}

/* Row `row` of one half of a cache (k or v), kv_dim wide, written from float32: F16 caches round
 * to nearest even (the CUDA kernels' __float2half_rn), so both backends store the same bits. */
static void cache_put_row(void *base, int type, int64_t row, const float *src, size_t kv_dim) {
    if (type == QC_KV_F16) {
        uint16_t *dst = (uint16_t *)base + (size_t)row * kv_dim;
        for (size_t i = 0; i < kv_dim; i++) dst[i] = qc_fp32_to_fp16(src[i]);
    } else {
        memcpy((float *)base + (size_t)row * kv_dim, src, kv_dim * sizeof(float));
    }
}

static int cache_check(qc_backend *be, qc_kv_cache cache, const char *op) {
    if (cache.type != QC_KV_F32 && cache.type != QC_KV_F16)
        return qc_fail(&be->err, QC_ERR_VALUE, "%s: unknown KV cache type %d", op, cache.type);
    return 0;
}

int qc_cpu_kv_store(qc_backend *be, const float *k, const float *v, const int32_t *pos, int n,
                    int kv_dim, qc_kv_cache cache) {
    if (n < 0 || kv_dim <= 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "kv_store: bad shape n=%d kv_dim=%d", n, kv_dim);
    if (positions_check(be, pos, n, "kv_store") < 0 || cache_check(be, cache, "kv_store") < 0) return -1;
    /* The caller (session.c) keeps positions below the cache's max_ctx, which we cannot see. */
    for (int t = 0; t < n; t++) {
        cache_put_row(cache.k, cache.type, pos[t], k + (size_t)t * (size_t)kv_dim, (size_t)kv_dim);
        cache_put_row(cache.v, cache.type, pos[t], v + (size_t)t * (size_t)kv_dim, (size_t)kv_dim);
    }
    return 0;
}

/* rope of q and k, then kv_store, token by token: q and k share each token's angles, so the
 * sines and cosines are computed once for both (the same float32 values rope uses). */
int qc_cpu_rope_kv_store(qc_backend *be, float *q, float *k, const float *v, const int32_t *pos,
                         int n, int n_head, int n_head_kv, int head_dim, float theta,
                         qc_kv_cache cache) {
    if (rope_check(be, n, n_head, head_dim, theta, "rope_kv_store") < 0 ||
        rope_check(be, n, n_head_kv, head_dim, theta, "rope_kv_store") < 0 ||
        positions_check(be, pos, n, "rope_kv_store") < 0 || cache_check(be, cache, "rope_kv_store") < 0)
        return -1;
    const int half = head_dim / 2;
    const size_t q_dim = (size_t)n_head * (size_t)head_dim, kv_dim = (size_t)n_head_kv * (size_t)head_dim;
    double inv_freq[QC_ROPE_MAX_HEAD_DIM / 2];
    float c[QC_ROPE_MAX_HEAD_DIM / 2], s[QC_ROPE_MAX_HEAD_DIM / 2];
    rope_inv_freq(theta, head_dim, inv_freq);
    for (int t = 0; t < n; t++) {
        float *kt = k + (size_t)t * kv_dim;
        rope_angles(pos[t], inv_freq, half, c, s);
        rope_token(q + (size_t)t * q_dim, n_head, head_dim, c, s);
        rope_token(kt, n_head_kv, head_dim, c, s);
        cache_put_row(cache.k, cache.type, pos[t], kt, kv_dim);
        cache_put_row(cache.v, cache.type, pos[t], v + (size_t)t * kv_dim, kv_dim);
    }
    return 0;
}

/* matmul_multi, then rope_kv_store (the composite of backend.h: nothing to fuse on the CPU) */
int qc_cpu_matmul_qkv_rope(qc_backend *be, const qc_matmul_part *qkv, const float *x, int n, const float *norm_w,
                           float eps, const int32_t *pos, int n_head, int n_head_kv, int head_dim, float theta,
                           qc_kv_cache cache) {
    /* through the table: the fast ops (cpu_fast.c) replace matmul_multi where this CPU has them */
    if (be->ops->matmul_multi(be, qkv, 3, x, n, norm_w, eps) < 0) return -1;
    return be->ops->rope_kv_store(be, qkv[0].out, qkv[1].out, qkv[2].out, pos, n, n_head, n_head_kv, head_dim,
                                  theta, cache);
}

/* matmul_qkv_rope, then attention (the composite of backend.h) */
int qc_cpu_qkv_attention(qc_backend *be, const qc_matmul_part *qkv, const float *x, int n, const float *norm_w,
                         float eps, const int32_t *pos, int n_kv, int n_head, int n_head_kv, int head_dim,
                         float theta, qc_kv_cache cache, float *out, const int64_t *x_sum, float *x_out) {
    (void)x_out;
    if (x_sum) return qc_fail(&be->err, QC_ERR_VALUE, "qkv_attention: x_sum comes only from swiglu_down, which the CPU has not");
    if (be->ops->matmul_qkv_rope(be, qkv, x, n, norm_w, eps, pos, n_head, n_head_kv, head_dim, theta, cache) < 0)
        return -1;
    return be->ops->attention(be, qkv[0].out, cache, pos, n, n_kv, n_head, n_head_kv, head_dim, out, NULL, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* attention: causal GQA over the cache                                                        */

typedef struct {
    qc_backend *be;
    const float *q;
    qc_kv_cache cache;
    const int32_t *pos;
    int n, n_kv, n_head, n_head_kv, head_dim;
    float *out, *scores, *probs;
} attn_job;

/* KV head kvh of cache row `row` as float32: in place for F32, converted into buf for F16. */
static const float *cache_head(const void *base, int type, int row, int kv_dim, int kvh, int hd,
                               float *buf) {
    const size_t at = (size_t)row * (size_t)kv_dim + (size_t)kvh * (size_t)hd;
    if (type != QC_KV_F16) return (const float *)base + at;
    const uint16_t *h = (const uint16_t *)base + at;
    for (int d = 0; d < hd; d++) buf[d] = qc_fp16_to_fp32(h[d]);
    return buf;
}

/* Items are (head, query) pairs, head-major, so a fixed split hands every thread whole heads
 * whose causal work is the same. */
static void attention_items(void *ctx, int64_t begin, int64_t end, int worker) {
    attn_job *j = ctx;
    const int hd = j->head_dim, group = j->n_head / j->n_head_kv, kv_dim = j->n_head_kv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    /* this thread's scratch: e[n_kv] float64 exponentials, s[n_kv] scores/probabilities, and
     * one key and one value row of an F16 cache as float32 */
    double *e = (double *)state(j->be)->scratch[worker];
    float *s = (float *)(e + j->n_kv);
    float *krow = s + j->n_kv, *vrow = krow + hd;
    for (int64_t item = begin; item < end; item++) {
        const int h = (int)(item / j->n), t = (int)(item % j->n);
        const int kvh = h / group;                      /* GQA: query head h reads KV head h/group */
        const int last = j->pos[t];                     /* causal: keys 0..pos[t] */
        const float *qv = j->q + ((size_t)t * j->n_head + h) * (size_t)hd;
        float maxs = -INFINITY;
        for (int k = 0; k <= last; k++) {
            s[k] = dot_f32(qv, cache_head(j->cache.k, j->cache.type, k, kv_dim, kvh, hd, krow), hd) * scale;
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
            const float *vv = cache_head(j->cache.v, j->cache.type, k, kv_dim, kvh, hd, vrow);
            for (int d = 0; d < hd; d++) o[d] += p * vv[d];
        }
        if (j->probs) {
            memcpy(j->probs + off, s, sizeof(float) * (size_t)(last + 1));
            for (int k = last + 1; k < j->n_kv; k++) j->probs[off + k] = 0.0f;
        }
    }
}

int qc_cpu_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos, int n,
                     int n_kv, int n_head, int n_head_kv, int head_dim, float *out, float *scores,
                     float *probs) {
    if (n < 0 || n_kv < 0 || head_dim <= 0 || n_head_kv <= 0 || n_head <= 0 ||
        n_head % n_head_kv != 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "attention: bad shape n=%d n_kv=%d heads=%d "
                       "kv_heads=%d head_dim=%d", n, n_kv, n_head, n_head_kv, head_dim);
    for (int t = 0; t < n; t++)
        if (pos[t] < 0 || pos[t] >= n_kv)
            return qc_fail(&be->err, QC_ERR_RANGE, "attention: position %d of query %d is outside "
                           "[0, %d)", pos[t], t, n_kv);
    if (cache_check(be, cache, "attention") < 0) return -1;
    if (n == 0) return 0;
    if (qc_cpu_scratch(be, 3 * (size_t)n_kv + 2 * (size_t)head_dim) < 0) return -1;
    attn_job job = {be, q, cache, pos, n, n_kv, n_head, n_head_kv, head_dim, out, scores, probs};
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
        j->out[i] = silu_mul(j->a[i], j->b[i]);
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
