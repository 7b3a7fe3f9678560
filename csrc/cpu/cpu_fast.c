/* cpu_fast.c: the CPU ops with the fast kernels of cpu_simd.h (chosen at run time): the same
 * contracts as cpu_ops.c, which stays the readable reference, computed the way llama.cpp does.
 *
 *  - matmul, matmul_add, matmul_multi, matmul_swiglu: x is quantized to 8-bit blocks once
 *    per call (qc_q8_block), and every weight row with a q8 kernel (Q4_0, Q5_0, Q8_0, Q4_K,
 *    Q6_K) is multiplied in integers, up to QC_Q8_MAX_TOKENS tokens per unpacking of the row.
 *    F32 and F16 rows keep float x (FMA). Other types: the row is dequantized into the thread's
 *    scratch (quants.c, bit-exact) and multiplied in float by the F32 kernel.
 *    The value of out[t][r] is computed by the same operations whatever n is and whichever
 *    thread computes it, so prefill == decode and the fused ops == their unfused sequences,
 *    bit for bit, as in the reference; the bias, then the residual, are added as in cpu_ops.c.
 *  - rmsnorm: the float64 sum of squares in 8 SIMD lanes, then cpu_ops.c's float32 scaling.
 *  - swiglu (and the fused one): silu(g) * u with an 8-wide exp (~2 ulp, cpu_simd.h).
 *  - argmax: SIMD maximum, then the first index equal to it (the reference's answer).
 *  - attention: each (head, query) row's scores, softmax and weighted values in float32, 8
 *    lanes (cpu_simd.h); the reference takes float64 exponentials and sums. A row's value does
 *    not depend on the other rows of the call, so prefill still equals decode bit for bit.
 *  - sample: a greedy draw without a repetition penalty by the argmax kernel.
 * embed, rope, kv_store, add and the other draws are cpu_ops.c's.
 */
#include "cpu_backend.h"

#include <math.h>
#include <string.h>

#include "quants.h"
#include "sampler.h"

static qc_cpu_state *state(qc_backend *be) { return be->impl; }

/* Loops over fewer elements than this run on the calling thread (as in cpu_ops.c). */
#define QC_FAST_PARALLEL_MIN 32768

/* Rows of matmul_swiglu whose gate values wait in act while the up values fill the thread's
 * scratch, before silu(g) * u is applied to them (the scratch holds n x this many floats). */
#define QC_SWIGLU_CHUNK 64

/* Rows of a prefill's tile (see part_dots): 64 rows of 896 Q5_0 values are 39 KiB. */
#define QC_ROW_TILE 64

/* Weight bytes of a decode step's item of work (see fast_run): ~15 µs of one core's time. */
#define QC_DECODE_ITEM_BYTES (256 * 1024)

/* ---------------------------------------------------------------------------------------- */
/* rmsnorm                                                                                     */

typedef struct {
    const qc_simd_kernels *k;
    const float *x, *w;
    int dim;
    float eps;
    float *out;
} norm_job;

static void norm_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    const norm_job *j = ctx;
    (void)worker;
    for (int64_t t = begin; t < end; t++) {
        const float *x = j->x + (size_t)t * (size_t)j->dim;
        float *o = j->out + (size_t)t * (size_t)j->dim;
        const float mean = (float)(j->k->sumsq(x, j->dim) / j->dim);
        const float scale = 1.0f / sqrtf(mean + j->eps);
        for (int i = 0; i < j->dim; i++) o[i] = (x[i] * scale) * j->w[i];
    }
}

int qc_cpu_fast_rmsnorm(qc_backend *be, const float *x, const float *w, int n, int dim, float eps,
                        float *out) {
    if (n < 0 || dim <= 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "rmsnorm: bad shape n=%d dim=%d", n, dim);
    norm_job job = {state(be)->simd, x, w, dim, eps, out};
    if ((int64_t)n * dim < QC_FAST_PARALLEL_MIN) norm_rows(&job, 0, n, 0);
    else qc_pool_run(state(be)->pool, n, norm_rows, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* x in 8 bits                                                                                 */

typedef struct {
    const qc_simd_kernels *k;
    const float *x;
    int64_t cols;
    qc_q8_block *xq;
} quant_job;

static void quant_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    const quant_job *j = ctx;
    (void)worker;
    for (int64_t t = begin; t < end; t++)
        j->k->quantize(j->x + t * j->cols, j->cols, j->xq + t * (j->cols / QC_Q8_BLOCK));
}

/* x[n][cols] quantized into the backend's q8 buffer; NULL with be->err set. */
static const qc_q8_block *quantize_x(qc_backend *be, const float *x, int n, int64_t cols) {
    qc_q8_block *xq = qc_cpu_q8_buffer(be, (size_t)n * (size_t)(cols / QC_Q8_BLOCK));
    if (xq == NULL) return NULL;
    quant_job job = {state(be)->simd, x, cols, xq};
    if ((int64_t)n * cols < 4 * QC_FAST_PARALLEL_MIN) quant_rows(&job, 0, n, 0);
    else qc_pool_run(state(be)->pool, n, quant_rows, &job);
    return xq;
}

/* ---------------------------------------------------------------------------------------- */
/* the matmul family                                                                            */

/* How one weight's rows are multiplied. */
typedef enum { ROWS_Q8, ROWS_FLOAT, ROWS_DEQUANT } rows_kind;

typedef struct {
    const qc_weight *w;
    int64_t row_bytes;
    const float *bias;        /* (rows) or NULL */
    const float *residual;    /* (n, rows) or NULL; may alias out */
    float *out;               /* (n, rows) */
    rows_kind kind;
    qc_q8_dot_fn q8;          /* ROWS_Q8 */
    qc_f_dot_fn fdot;         /* ROWS_FLOAT, and F32 for ROWS_DEQUANT */
} fast_part;

typedef struct {
    qc_backend *be;
    const float *x;           /* (n, cols) */
    const qc_q8_block *xq;    /* (n, cols / 32) when a part is ROWS_Q8 */
    int64_t cols;
    int n;
    int n_parts;
    fast_part part[QC_MATMUL_MULTI_MAX];
    int64_t chunk_rows;       /* rows per item of the pool's loop */
    int64_t chunks[QC_MATMUL_MULTI_MAX];   /* items of each part */
    /* matmul_swiglu: part 0 is the gate, part 1 the up projection, out is act */
    int swiglu;
} fast_job;

static int64_t check_weight(qc_backend *be, const qc_weight *w, int64_t cols, int n, const char *op) {
    const qc_type_traits *tr = qc_type_get(w->type);
    const int64_t row_bytes = qc_row_bytes(w->type, w->cols);
    if (tr == NULL || tr->dequantize == NULL || row_bytes < 0 || w->rows < 0 || n < 0 ||
        (cols >= 0 && w->cols != cols))
        return qc_fail(&be->err, QC_ERR_VALUE, "%s: unsupported weight (type %s, %lld x %lld) or n = %d",
                       op, tr ? tr->name : "?", (long long)w->rows, (long long)w->cols, n);
    return row_bytes;
}

static fast_part make_part(const qc_simd_kernels *k, const qc_weight *w, int64_t row_bytes,
                           const float *bias, const float *residual, float *out) {
    fast_part p = {w, row_bytes, bias, residual, out, ROWS_DEQUANT, NULL, k->f_dot[QC_TYPE_F32]};
    if (w->type < 64 && k->q8_dot[w->type] && w->cols % QC_Q8_BLOCK == 0) {
        p.kind = ROWS_Q8;
        p.q8 = k->q8_dot[w->type];
    } else if (w->type < 64 && k->f_dot[w->type]) {
        p.kind = ROWS_FLOAT;
        p.fdot = k->f_dot[w->type];
    }
    return p;
}

/* out[t][r] from the dot product: + bias, then + residual (cpu_ops.c's matmul_value) */
static inline float part_value(const fast_part *p, int t, int64_t r, float dot) {
    const float v = dot + (p->bias ? p->bias[r] : 0.0f);
    return p->residual ? p->residual[(size_t)t * (size_t)p->w->rows + (size_t)r] + v : v;
}

/* dot products of rows [begin, end) of p with every token into dst[t * dst_stride + r - begin] */
static void part_dots(const fast_job *j, const fast_part *p, int64_t begin, int64_t end,
                      float *dst, int64_t dst_stride, int worker) {
    const uint8_t *base = p->w->data;
    const int64_t cols = j->cols, nb = cols / QC_Q8_BLOCK;
    if (p->kind == ROWS_Q8) {
        /* A tile of rows stays in L2 while every group of tokens (in L1) passes over it, and
         * each token's results for the tile are contiguous in dst. */
        for (int64_t r0 = begin; r0 < end; r0 += QC_ROW_TILE) {
            const int64_t r1 = end - r0 < QC_ROW_TILE ? end : r0 + QC_ROW_TILE;
            for (int t0 = 0; t0 < j->n; t0 += QC_Q8_MAX_TOKENS) {
                const int nt = j->n - t0 < QC_Q8_MAX_TOKENS ? j->n - t0 : QC_Q8_MAX_TOKENS;
                const qc_q8_block *xt = j->xq + (size_t)t0 * (size_t)nb;
                float *d = dst + (size_t)t0 * (size_t)dst_stride;
                for (int64_t r = r0; r < r1; r++) {
                    float v[QC_Q8_MAX_TOKENS];
                    p->q8(base + (size_t)r * (size_t)p->row_bytes, xt, nb, nt, nb, v);
                    for (int t = 0; t < nt; t++) d[(size_t)t * (size_t)dst_stride + (size_t)(r - begin)] = v[t];
                }
            }
        }
        return;
    }
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *row = base + (size_t)r * (size_t)p->row_bytes;
        float *d = dst + (r - begin);
        {
            const void *wr = row;   /* the kernels read it bytewise: it may be misaligned */
            if (p->kind == ROWS_DEQUANT) {
                /* type and width were checked by check_weight: this cannot fail */
                float *tmp = state(j->be)->scratch[worker];
                qc_dequantize(p->w->type, row, tmp, 1, cols, NULL);
                wr = tmp;
            }
            for (int t = 0; t < j->n; t++)
                d[(size_t)t * (size_t)dst_stride] = p->fdot(wr, j->x + (size_t)t * (size_t)cols, cols);
        }
    }
}

/* Rows [begin, end) of one part: the dots straight into out, then bias and residual. */
static void part_rows(const fast_job *j, const fast_part *p, int64_t begin, int64_t end, int worker) {
    const int64_t rows = p->w->rows;
    if (p->residual == NULL && p->bias == NULL) {
        part_dots(j, p, begin, end, p->out + begin, rows, worker);
        for (int t = 0; t < j->n; t++)
            for (int64_t r = begin; r < end; r++) p->out[(size_t)t * (size_t)rows + (size_t)r] += 0.0f;
        return;
    }
    /* the residual may alias out: dots go to the thread's scratch first, a tile of rows at a
     * time (one row at a time made a prefill stream every token's activations from L3 once per
     * row: ffn_down's are 3 MiB at 512 tokens) */
    float *tmp = state(j->be)->scratch[worker] + j->cols;
    for (int64_t r0 = begin; r0 < end; r0 += QC_ROW_TILE) {
        const int64_t r1 = end - r0 < QC_ROW_TILE ? end : r0 + QC_ROW_TILE, span = r1 - r0;
        part_dots(j, p, r0, r1, tmp, span, worker);
        for (int t = 0; t < j->n; t++)
            for (int64_t r = r0; r < r1; r++)
                p->out[(size_t)t * (size_t)rows + (size_t)r] =
                    part_value(p, t, r, tmp[(size_t)t * (size_t)span + (size_t)(r - r0)]);
    }
}

/* Rows [begin, end) of gate and up: g into act, u into the scratch, QC_SWIGLU_CHUNK rows at a
 * time, then act = silu(g) * u by the swiglu op's kernel. g + 0.0f and u + 0.0f are matmul's
 * values without a bias, so act equals matmul, matmul, swiglu bit for bit. */
static void swiglu_rows(const fast_job *j, int64_t begin, int64_t end, int worker) {
    const fast_part *g = &j->part[0], *u = &j->part[1];
    const int64_t rows = g->w->rows;
    float *ubuf = state(j->be)->scratch[worker] + j->cols;
    for (int64_t r0 = begin; r0 < end; r0 += QC_SWIGLU_CHUNK) {
        const int64_t r1 = end - r0 < QC_SWIGLU_CHUNK ? end : r0 + QC_SWIGLU_CHUNK, span = r1 - r0;
        part_dots(j, g, r0, r1, g->out + r0, rows, worker);
        part_dots(j, u, r0, r1, ubuf, span, worker);
        for (int t = 0; t < j->n; t++) {
            float *a = g->out + (size_t)t * (size_t)rows + (size_t)r0;
            float *ub = ubuf + (size_t)t * (size_t)span;
            for (int64_t i = 0; i < span; i++) {
                a[i] += 0.0f;
                ub[i] += 0.0f;
            }
            state(j->be)->simd->silu_mul(a, ub, span, a);
        }
    }
}

/* Items [begin, end) of the pool's loop: item c is chunk_rows rows of one part (the parts'
 * chunks one after the other), or of gate and up together for matmul_swiglu. Threads take items
 * as they come free (qc_pool_run_chunks); a row's value never depends on which thread computes
 * it, so the split is free to change from run to run. */
static void fast_chunks(void *ctx, int64_t begin, int64_t end, int worker) {
    const fast_job *j = ctx;
    for (int64_t c = begin; c < end; c++) {
        int64_t k = c;
        int i = 0;
        while (k >= j->chunks[i]) k -= j->chunks[i++];
        const int64_t rows = j->part[i].w->rows;
        const int64_t lo = k * j->chunk_rows, hi = lo + j->chunk_rows < rows ? lo + j->chunk_rows : rows;
        if (j->swiglu) swiglu_rows(j, lo, hi, worker);
        else part_rows(j, &j->part[i], lo, hi, worker);
    }
}

/* Run a job whose parts are filled in: x (normalised by the caller) to 8 bits if a part needs
 * it, the scratch for dequantized rows and partial results, then the rows. */
static int fast_run(qc_backend *be, fast_job *job) {
    int64_t rows = 0;
    int need_q8 = 0;
    for (int i = 0; i < job->n_parts; i++) {
        rows += job->part[i].w->rows;
        need_q8 |= job->part[i].kind == ROWS_Q8;
    }
    if (job->n == 0 || rows == 0) return 0;
    /* scratch: a dequantized row (cols), then the partial results of a tile: n x QC_ROW_TILE,
     * or n x QC_SWIGLU_CHUNK */
    const size_t extra = (size_t)job->n * (job->swiglu ? QC_SWIGLU_CHUNK : QC_ROW_TILE);
    if (qc_cpu_scratch(be, (size_t)job->cols + extra) < 0) return -1;
    if (need_q8 && (job->xq = quantize_x(be, job->x, job->n, job->cols)) == NULL) return -1;
    /* prefill: a tile of QC_ROW_TILE rows, whose weights stay in L2 (part_dots); decode: about
     * QC_DECODE_ITEM_BYTES of weights per item, so that the items' claims (an atomic on a line
     * both cores write) cost little beside their work (the lm_head: 594 items instead of 4748
     * of 32 rows), but at least 8 items per thread (an attention projection of 896 rows is 28
     * items of 32), so that a thread slowed down by another process is made up for */
    if (job->swiglu) job->chunk_rows = QC_SWIGLU_CHUNK;
    else if (job->n > 1) job->chunk_rows = QC_ROW_TILE;
    else {
        int64_t row_bytes = 1;
        for (int i = 0; i < job->n_parts; i++)
            if (job->part[i].row_bytes > row_bytes) row_bytes = job->part[i].row_bytes;
        int64_t r = QC_DECODE_ITEM_BYTES / row_bytes;
        const int64_t cap = rows / (8 * (int64_t)qc_pool_threads(state(be)->pool));
        if (r > cap) r = cap;
        job->chunk_rows = r < 32 ? 32 : r / 32 * 32;
    }
    int64_t items = 0;
    for (int i = 0; i < (job->swiglu ? 1 : job->n_parts); i++)
        items += job->chunks[i] = (job->part[i].w->rows + job->chunk_rows - 1) / job->chunk_rows;
    if (rows * job->cols * job->n < QC_FAST_PARALLEL_MIN) fast_chunks(job, 0, items, 0);
    else qc_pool_run_chunks(state(be)->pool, items, fast_chunks, job);
    return 0;
}

/* The fused ops' norm into the backend's normed buffer (cpu_ops.c's normed_input, with the
 * fast rmsnorm). */
static const float *normed_input(qc_backend *be, const float *x, const float *norm_w, int n,
                                 int64_t cols, float eps) {
    if (norm_w == NULL || n == 0) return x;
    float *xn = qc_cpu_normed_buffer(be, (size_t)n * (size_t)cols);
    if (xn == NULL || qc_cpu_fast_rmsnorm(be, x, norm_w, n, (int)cols, eps, xn) < 0) return NULL;
    return xn;
}

int qc_cpu_fast_matmul(qc_backend *be, const qc_weight *w, const float *bias, const float *x, int n,
                       float *out) {
    const int64_t row_bytes = check_weight(be, w, -1, n, "matmul");
    if (row_bytes < 0) return -1;
    fast_job job = {.be = be, .x = x, .cols = w->cols, .n = n, .n_parts = 1};
    job.part[0] = make_part(state(be)->simd, w, row_bytes, bias, NULL, out);
    return fast_run(be, &job);
}

int qc_cpu_fast_matmul_add(qc_backend *be, const qc_weight *w, const float *x, int n,
                           const float *residual, float *out, int x_from_last_op,
                           const float *norm_next) {
    (void)x_from_last_op;   /* CUDA hints: the CPU keeps no 8-bit copy between ops */
    (void)norm_next;
    const int64_t row_bytes = check_weight(be, w, -1, n, "matmul_add");
    if (row_bytes < 0) return -1;
    fast_job job = {.be = be, .x = x, .cols = w->cols, .n = n, .n_parts = 1};
    job.part[0] = make_part(state(be)->simd, w, row_bytes, NULL, residual, out);
    return fast_run(be, &job);
}

int qc_cpu_fast_matmul_multi(qc_backend *be, const qc_matmul_part *parts, int n_parts,
                             const float *x, int n, const float *norm_w, float eps) {
    if (n_parts < 1 || n_parts > QC_MATMUL_MULTI_MAX)
        return qc_fail(&be->err, QC_ERR_VALUE, "matmul_multi: %d weights (1..%d)", n_parts,
                       QC_MATMUL_MULTI_MAX);
    fast_job job = {.be = be, .x = x, .cols = parts[0].w->cols, .n = n, .n_parts = n_parts};
    for (int i = 0; i < n_parts; i++) {
        const int64_t row_bytes = check_weight(be, parts[i].w, parts[0].w->cols, n, "matmul_multi");
        if (row_bytes < 0) return -1;
        job.part[i] = make_part(state(be)->simd, parts[i].w, row_bytes, parts[i].bias, NULL, parts[i].out);
    }
    if ((job.x = normed_input(be, x, norm_w, n, job.cols, eps)) == NULL) return -1;
    return fast_run(be, &job);
}

int qc_cpu_fast_matmul_swiglu(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up,
                              const float *x, int n, const float *norm_w, float eps, float *act) {
    const int64_t gate_row_bytes = check_weight(be, w_gate, -1, n, "matmul_swiglu");
    if (gate_row_bytes < 0) return -1;
    const int64_t up_row_bytes = check_weight(be, w_up, w_gate->cols, n, "matmul_swiglu");
    if (up_row_bytes < 0) return -1;
    if (w_up->rows != w_gate->rows)
        return qc_fail(&be->err, QC_ERR_VALUE, "matmul_swiglu: gate has %lld rows, up %lld",
                       (long long)w_gate->rows, (long long)w_up->rows);
    fast_job job = {.be = be, .x = x, .cols = w_gate->cols, .n = n, .n_parts = 2, .swiglu = 1};
    job.part[0] = make_part(state(be)->simd, w_gate, gate_row_bytes, NULL, NULL, act);
    job.part[1] = make_part(state(be)->simd, w_up, up_row_bytes, NULL, NULL, NULL);
    if ((job.x = normed_input(be, x, norm_w, n, job.cols, eps)) == NULL) return -1;
    return fast_run(be, &job);
}

/* ---------------------------------------------------------------------------------------- */
/* attention                                                                                   */

/* Attention below this many multiply-adds (query rows x keys x head_dim x heads) runs on the
 * calling thread: 14 heads of 64 over 73 keys, ~15 µs of work on one Zen 3 core. */
#define QC_FAST_ATTN_PARALLEL_MIN (1 << 16)

typedef struct {
    qc_backend *be;
    const float *q;
    qc_kv_cache cache;
    const int32_t *pos;
    int n, n_kv, n_head, n_head_kv, head_dim;
    float *out, *scores, *probs;
} attn_job;

/* Items are (head, query) rows, head-major (cpu_ops.c's order): scores, softmax and the weighted
 * values of one row by the kernels of cpu_simd.h, in the thread's scratch. */
static void attn_rows(void *ctx, int64_t begin, int64_t end, int worker) {
    const attn_job *j = ctx;
    const qc_simd_kernels *k = state(j->be)->simd;
    const int hd = j->head_dim, group = j->n_head / j->n_head_kv, f16 = j->cache.type == QC_KV_F16;
    const int64_t kv_dim = (int64_t)j->n_head_kv * hd;
    const size_t esize = qc_kv_type_size(j->cache.type);
    const float scale = 1.0f / sqrtf((float)hd);
    float *s = state(j->be)->scratch[worker];
    for (int64_t item = begin; item < end; item++) {
        const int h = (int)(item / j->n), t = (int)(item % j->n);
        const int keys = j->pos[t] + 1;                 /* causal: keys 0..pos[t] */
        const size_t head_at = (size_t)(h / group) * (size_t)hd * esize;   /* GQA: KV head h/group */
        const float *qv = j->q + ((size_t)t * j->n_head + h) * (size_t)hd;
        const size_t off = ((size_t)h * j->n + t) * (size_t)j->n_kv;
        k->attn_scores(qv, (const uint8_t *)j->cache.k + head_at, f16, kv_dim, keys, hd, scale, s);
        if (j->scores) {
            memcpy(j->scores + off, s, sizeof(float) * (size_t)keys);
            for (int c = keys; c < j->n_kv; c++) j->scores[off + c] = -INFINITY;
        }
        k->softmax(s, keys);
        if (j->probs) {
            memcpy(j->probs + off, s, sizeof(float) * (size_t)keys);
            for (int c = keys; c < j->n_kv; c++) j->probs[off + c] = 0.0f;
        }
        k->attn_values(s, (const uint8_t *)j->cache.v + head_at, f16, kv_dim, keys, hd,
                       j->out + ((size_t)t * j->n_head + h) * (size_t)hd);
    }
}

int qc_cpu_fast_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos, int n,
                          int n_kv, int n_head, int n_head_kv, int head_dim, float *out, float *scores,
                          float *probs) {
    /* What the kernels do not take (and every bad argument) goes to the reference op, which
     * checks the arguments and says what is wrong. */
    int ok = n > 0 && n_kv > 0 && head_dim > 0 && head_dim % 8 == 0 && n_head_kv > 0 && n_head > 0 &&
             n_head % n_head_kv == 0 && (cache.type == QC_KV_F32 || cache.type == QC_KV_F16);
    for (int t = 0; ok && t < n; t++) ok = pos[t] >= 0 && pos[t] < n_kv;
    if (!ok)
        return qc_cpu_attention(be, q, cache, pos, n, n_kv, n_head, n_head_kv, head_dim, out, scores, probs);
    if (qc_cpu_scratch(be, (size_t)n_kv) < 0) return -1;
    attn_job job = {be, q, cache, pos, n, n_kv, n_head, n_head_kv, head_dim, out, scores, probs};
    const int64_t items = (int64_t)n_head * n;
    int64_t work = 0;   /* multiply-adds: the causal rows' keys, times head_dim, times heads */
    for (int t = 0; t < n; t++) work += (int64_t)(pos[t] + 1) * head_dim * n_head;
    if (work < QC_FAST_ATTN_PARALLEL_MIN) attn_rows(&job, 0, items, 0);
    else qc_pool_run_chunks(state(be)->pool, items, attn_rows, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* swiglu, argmax                                                                              */

typedef struct {
    const qc_simd_kernels *k;
    const float *a, *b;
    float *out;
} ew_job;

static void swiglu_range(void *ctx, int64_t begin, int64_t end, int worker) {
    const ew_job *j = ctx;
    (void)worker;
    j->k->silu_mul(j->a + begin, j->b + begin, end - begin, j->out + begin);
}

int qc_cpu_fast_swiglu(qc_backend *be, const float *gate, const float *up, int64_t count, float *out) {
    if (count < 0) return qc_fail(&be->err, QC_ERR_VALUE, "swiglu: count %lld", (long long)count);
    ew_job job = {state(be)->simd, gate, up, out};
    if (count < QC_FAST_PARALLEL_MIN) swiglu_range(&job, 0, count, 0);
    else qc_pool_run(state(be)->pool, count, swiglu_range, &job);
    return 0;
}

/* A greedy draw without a repetition penalty is the argmax (sampler.c: the first largest logit,
 * NaN never chosen, the RNG untouched); every other draw, and a row with no finite or +inf
 * maximum (the sampler's -1), is the reference op's. The reference copies and scans the logits
 * in plain C (~0.3 ms for Qwen's 151,936 per decode step). */
int qc_cpu_fast_sample(qc_backend *be, const float *logits, int64_t n_vocab, const void *state_mem,
                       void *work, void *result_mem) {
    const qc_sample_state *st = state_mem;
    if (n_vocab > 0 && n_vocab <= INT32_MAX && st->temperature <= 0.0f &&
        (st->repeat_penalty == 1.0f || st->n_history <= 0)) {
        const int64_t best = state(be)->simd->argmax(logits, n_vocab);
        if (logits[best] == logits[best] && logits[best] != -INFINITY) {
            qc_sample_result *res = result_mem;
            res->token = (int32_t)best;
            res->rng = st->rng;
            res->pad = 0;
            return 0;
        }
    }
    return qc_cpu_sample(be, logits, n_vocab, state_mem, work, result_mem);
}

int qc_cpu_fast_argmax(qc_backend *be, const float *x, int n, int64_t cols, int32_t *out) {
    if (n < 0 || cols <= 0 || cols > INT32_MAX)
        return qc_fail(&be->err, QC_ERR_VALUE, "argmax: bad shape n=%d cols=%lld", n, (long long)cols);
    for (int t = 0; t < n; t++)
        out[t] = (int32_t)state(be)->simd->argmax(x + (size_t)t * (size_t)cols, cols);
    return 0;
}
