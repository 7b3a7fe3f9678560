/* session.c: the forward pass of Qwen2, written once against the backend ops (backend.h), with a
 * KV cache, positions and capture.
 *
 * A session owns, on the backend: the KV cache of every layer, scratch activations for up to
 * `rows` tokens per eval (grown only when a longer prefill comes, so a decode step allocates
 * nothing), and the lm_head output. Capture copies a named activation to host memory right after
 * the step that produced it, and only when one of the caller's patterns names it.
 *
 * The forward pass runs the fused ops of backend.h (q/k/v in one matmul with the attention norm
 * folded in, RoPE with the cache write, residual adds in the matmul epilogues, gate/up with
 * SwiGLU and the feed-forward norm folded in) wherever the eval captures
 * none of the intermediates they skip; elsewhere it runs the unfused sequence, which computes
 * the same numbers (bit for bit but in the CUDA prefill's GEMM epilogue), so a capture does not
 * change what it observes.
 */
#include "session.h"

#include <fnmatch.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

/* Capture names (DESIGN.md): four global ones, and per layer, in forward order. */
enum { CAP_EMBED, CAP_OUTPUT_NORM, CAP_LOGITS, CAP_ARGMAX, CAP_N_GLOBAL };
static const char *const global_names[CAP_N_GLOBAL] = {"embed", "output_norm", "logits", "argmax"};

enum {
    L_ATTN_NORM, L_Q, L_K, L_V, L_Q_ROPE, L_K_ROPE, L_ATTN_SCORES, L_ATTN_PROBS, L_ATTN_OUT,
    L_ATTN_PROJ, L_RESID_MID, L_FFN_NORM, L_GATE, L_UP, L_FFN_ACT, L_FFN_OUT, L_RESID_OUT,
    L_N_NAMES
};
static const char *const layer_names[L_N_NAMES] = {
    "attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_scores", "attn_probs", "attn_out",
    "attn_proj", "resid_mid", "ffn_norm", "gate", "up", "ffn_act", "ffn_out", "resid_out",
};

/* Activations of one eval, on the backend, for up to `rows` tokens. */
typedef struct {
    int rows;                 /* capacity in tokens */
    int32_t *ids;             /* (rows) token ids */
    int32_t *pos;             /* (rows) positions */
    float *x;                 /* (rows, dim) the residual stream */
    float *xn;                /* (rows, dim) RMSNorm output: input of q/k/v, ffn, lm_head */
    float *q;                 /* (rows, n_head, head_dim) */
    float *k;                 /* (rows, n_head_kv, head_dim) */
    float *v;                 /* (rows, n_head_kv, head_dim) */
    float *att;               /* (rows, n_head * head_dim) attention output, heads concatenated */
    float *y;                 /* (rows, dim) o_proj output, then ffn_down output */
    float *gate;              /* (rows, ffn_dim) */
    float *up;                /* (rows, ffn_dim) */
    float *act;               /* (rows, ffn_dim) silu(gate) * up */
} qc_scratch;

struct qc_session {
    qc_model *m;
    qc_backend *be;
    int max_ctx;
    int pos;                  /* tokens in the cache: the next token's position */
    qc_scratch sc;
    int32_t *host_pos;        /* (sc.rows) positions staged on the host before upload */
    float *logits;            /* (logit_rows, n_vocab) lm_head output */
    int32_t *amax;            /* (logit_rows) */
    int logit_rows;
    float *scores;            /* (score_cap) attn_scores when captured: (n_head, n, n_kv) */
    float *probs;             /* (score_cap) attn_probs when captured */
    size_t score_cap;         /* elements */
    float **k_cache;          /* [n_layer] (max_ctx, n_head_kv * head_dim), after RoPE */
    float **v_cache;          /* [n_layer] (max_ctx, n_head_kv * head_dim) */
    void *decode_rec[3];      /* the recorded decode step (backend replay), or NULL: [0] with
                                 the argmax, [1] with a draw, [2] with both */
    int no_replay;            /* recording failed once on this backend: run ops plainly */
    /* sampling on the backend (an eval with a sampler), allocated at the first such eval */
    void *sample_state;       /* (sample_state_cap) qc_sample_state and its token ids */
    size_t sample_state_cap;
    void *sample_work;        /* (qc_sample_work_bytes(n_vocab)) */
    void *sample_result;      /* one qc_sample_result */
    int no_fusion;            /* QWENCUDA_NO_FUSION: never the fused ops (to measure them) */
    unsigned char *want;      /* [CAP_N_GLOBAL + n_layer * L_N_NAMES] capture this eval? */
    int n_wanted;             /* nonzero entries of want */
};

/* ---------------------------------------------------------------------------------------- */
/* capture */

void qc_capture_free(qc_capture *c) {
    if (c == NULL) return;
    for (int i = 0; i < c->n; i++) free(c->items[i].data);
    free(c->items);
    c->items = NULL;
    c->n = c->cap = 0;
}

/* Copy `count` values at backend memory src to a new host buffer appended to c. */
static int capture_put(qc_session *s, qc_capture *c, const char *name, const void *src, int dtype,
                       int ndim, int64_t d0, int64_t d1, int64_t d2, qc_error *err) {
    qc_backend *be = s->be;
    int64_t count = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    size_t bytes = (size_t)count * 4;   /* float32 and int32 */
    void *data = NULL;
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 32;
        qc_tensor_out *items = realloc(c->items, (size_t)cap * sizeof *items);
        if (items == NULL) return qc_fail(err, QC_ERR_NOMEM, "capture %s: out of memory", name);
        c->items = items;
        c->cap = cap;
    }
    data = malloc(bytes ? bytes : 1);
    if (data == NULL) return qc_fail(err, QC_ERR_NOMEM, "capture %s: out of memory (%zu bytes)", name, bytes);
    if (bytes && be->ops->download(be, data, src, bytes) < 0) {
        free(data);
        return qc_fail(err, be->err.kind, "capture %s: %s", name, be->err.msg);
    }
    qc_tensor_out *t = &c->items[c->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim > 1 ? d1 : 0;
    t->shape[2] = ndim > 2 ? d2 : 0;
    t->dtype = dtype;
    t->data = data;
    return 0;
}

/* Whether this eval captures blk.<layer>.<layer_names[which]>. */
static int layer_wants(const qc_session *s, int layer, int which) {
    return s->want[CAP_N_GLOBAL + (size_t)layer * L_N_NAMES + which];
}

/* A per-layer capture, when wanted: blk.L.<name> of shape (d0[, d1[, d2]]). */
static int capture_layer(qc_session *s, qc_capture *c, int layer, int which, const float *src,
                         int ndim, int64_t d0, int64_t d1, int64_t d2, qc_error *err) {
    char name[64];
    if (!layer_wants(s, layer, which)) return 0;
    snprintf(name, sizeof name, "blk.%d.%s", layer, layer_names[which]);
    return capture_put(s, c, name, src, QC_DTYPE_F32, ndim, d0, d1, d2, err);
}

static int capture_global(qc_session *s, qc_capture *c, int which, const void *src, int dtype,
                          int ndim, int64_t d0, int64_t d1, qc_error *err) {
    if (!s->want[which]) return 0;
    return capture_put(s, c, global_names[which], src, dtype, ndim, d0, d1, 0, err);
}

static int matches(const qc_capture_spec *spec, const char *name) {
    for (int i = 0; i < spec->n_patterns; i++)
        if (spec->patterns[i] && fnmatch(spec->patterns[i], name, 0) == 0) return 1;
    return 0;
}

/* Decide once per eval which names are captured; returns how many. */
static int mark_wanted(qc_session *s, const qc_capture_spec *spec) {
    const int n_layer = (int)s->m->cfg.n_layer;
    const size_t n_names = CAP_N_GLOBAL + (size_t)n_layer * L_N_NAMES;
    char name[64];
    int count = 0;
    if (s->n_wanted) memset(s->want, 0, n_names);
    s->n_wanted = 0;
    if (spec == NULL || spec->n_patterns <= 0) return 0;   /* capture off: no work at all */
    for (int g = 0; g < CAP_N_GLOBAL; g++) {
        s->want[g] = (unsigned char)matches(spec, global_names[g]);
        count += s->want[g];
    }
    for (int l = 0; l < n_layer; l++) {
        for (int i = 0; i < L_N_NAMES; i++) {
            snprintf(name, sizeof name, "blk.%d.%s", l, layer_names[i]);
            unsigned char w = (unsigned char)matches(spec, name);
            s->want[CAP_N_GLOBAL + (size_t)l * L_N_NAMES + i] = w;
            count += w;
        }
    }
    s->n_wanted = count;
    return count;
}

static int any_layer_wants(const qc_session *s, int which) {
    for (int l = 0; l < (int)s->m->cfg.n_layer; l++)
        if (layer_wants(s, l, which)) return 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* backend buffers */

static void buf_free(qc_backend *be, void *pp) {
    void **p = pp;
    if (*p) be->ops->free(be, *p);
    *p = NULL;
}

static int buf_alloc(qc_backend *be, size_t bytes, void *pp, qc_error *err) {
    void **p = pp;
    *p = NULL;
    if (be->ops->alloc(be, bytes ? bytes : 4, p) < 0) {
        *p = NULL;
        return qc_fail(err, be->err.kind, "session: %s", be->err.msg);
    }
    return 0;
}

static void scratch_free(qc_backend *be, qc_scratch *sc) {
    buf_free(be, &sc->ids);
    buf_free(be, &sc->pos);
    buf_free(be, &sc->x);
    buf_free(be, &sc->xn);
    buf_free(be, &sc->q);
    buf_free(be, &sc->k);
    buf_free(be, &sc->v);
    buf_free(be, &sc->att);
    buf_free(be, &sc->y);
    buf_free(be, &sc->gate);
    buf_free(be, &sc->up);
    buf_free(be, &sc->act);
    sc->rows = 0;
}

static int scratch_build(qc_backend *be, const qc_config *c, int rows, qc_scratch *sc, qc_error *err) {
    const size_t r = (size_t)rows, f = sizeof(float);
    const size_t q_dim = (size_t)(c->n_head * c->head_dim), kv_dim = (size_t)(c->n_head_kv * c->head_dim);
    memset(sc, 0, sizeof *sc);
    if (buf_alloc(be, r * sizeof(int32_t), &sc->ids, err) < 0 ||
        buf_alloc(be, r * sizeof(int32_t), &sc->pos, err) < 0 ||
        buf_alloc(be, r * (size_t)c->dim * f, &sc->x, err) < 0 ||
        buf_alloc(be, r * (size_t)c->dim * f, &sc->xn, err) < 0 ||
        buf_alloc(be, r * q_dim * f, &sc->q, err) < 0 ||
        buf_alloc(be, r * kv_dim * f, &sc->k, err) < 0 ||
        buf_alloc(be, r * kv_dim * f, &sc->v, err) < 0 ||
        buf_alloc(be, r * q_dim * f, &sc->att, err) < 0 ||
        buf_alloc(be, r * (size_t)c->dim * f, &sc->y, err) < 0 ||
        buf_alloc(be, r * (size_t)c->ffn_dim * f, &sc->gate, err) < 0 ||
        buf_alloc(be, r * (size_t)c->ffn_dim * f, &sc->up, err) < 0 ||
        buf_alloc(be, r * (size_t)c->ffn_dim * f, &sc->act, err) < 0) {
        scratch_free(be, sc);
        return -1;
    }
    sc->rows = rows;
    return 0;
}

/* A recording holds the buffer pointers it was made with: forget it when they change. */
static void drop_recording(qc_session *s) {
    for (int i = 0; i < 3; i++) {
        if (s->decode_rec[i]) s->be->ops->recording_free(s->be, s->decode_rec[i]);
        s->decode_rec[i] = NULL;
    }
}

/* Room for n tokens; on failure the old buffers are kept, so the session stays usable. */
static int ensure_rows(qc_session *s, int n, qc_error *err) {
    qc_scratch bigger;
    int32_t *host_pos = NULL;
    if (n <= s->sc.rows) return 0;
    if (scratch_build(s->be, &s->m->cfg, n, &bigger, err) < 0) return -1;
    host_pos = malloc((size_t)n * sizeof *host_pos);
    if (host_pos == NULL) {
        scratch_free(s->be, &bigger);
        return qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
    }
    drop_recording(s);
    scratch_free(s->be, &s->sc);
    free(s->host_pos);
    s->sc = bigger;
    s->host_pos = host_pos;
    return 0;
}

static int ensure_logit_rows(qc_session *s, int rows, qc_error *err) {
    float *logits = NULL;
    int32_t *amax = NULL;
    if (rows <= s->logit_rows) return 0;
    if (buf_alloc(s->be, (size_t)rows * (size_t)s->m->cfg.n_vocab * sizeof(float), &logits, err) < 0 ||
        buf_alloc(s->be, (size_t)rows * sizeof(int32_t), &amax, err) < 0) {
        buf_free(s->be, &logits);
        return -1;
    }
    drop_recording(s);
    buf_free(s->be, &s->logits);
    buf_free(s->be, &s->amax);
    s->logits = logits;
    s->amax = amax;
    s->logit_rows = rows;
    return 0;
}

/* Room for a sampler's state of state_bytes; the work and result buffers come with the first. */
static int ensure_sampling(qc_session *s, size_t state_bytes, qc_error *err) {
    void *state = NULL;
    if (s->sample_work == NULL) {
        if (buf_alloc(s->be, qc_sample_work_bytes(s->m->cfg.n_vocab), &s->sample_work, err) < 0) return -1;
        if (buf_alloc(s->be, sizeof(qc_sample_result), &s->sample_result, err) < 0) {
            buf_free(s->be, &s->sample_work);
            return -1;
        }
        drop_recording(s);
    }
    if (state_bytes <= s->sample_state_cap) return 0;
    /* room for 64 more penalty tokens, so that a growing history reallocates seldom */
    state_bytes += 64 * sizeof(int32_t);
    if (buf_alloc(s->be, state_bytes, &state, err) < 0) return -1;
    drop_recording(s);
    buf_free(s->be, &s->sample_state);
    s->sample_state = state;
    s->sample_state_cap = state_bytes;
    return 0;
}

static int ensure_scores(qc_session *s, size_t count, qc_error *err) {
    float *scores = NULL, *probs = NULL;
    if (count <= s->score_cap) return 0;
    if (buf_alloc(s->be, count * sizeof(float), &scores, err) < 0 ||
        buf_alloc(s->be, count * sizeof(float), &probs, err) < 0) {
        buf_free(s->be, &scores);
        return -1;
    }
    buf_free(s->be, &s->scores);
    buf_free(s->be, &s->probs);
    s->scores = scores;
    s->probs = probs;
    s->score_cap = count;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* build / free */

/* Scratch rows allocated up front: enough for short prompts without growing. */
#define QC_INITIAL_ROWS 32

int qc_session_create(qc_model *m, int max_ctx, qc_session **out, qc_error *err) {
    qc_session *s = NULL;
    const qc_config *c = &m->cfg;
    const size_t kv_dim = (size_t)(c->n_head_kv * c->head_dim);
    *out = NULL;
    if (max_ctx < 1) return qc_fail(err, QC_ERR_VALUE, "max_context must be >= 1, got %d", max_ctx);
    s = calloc(1, sizeof *s);
    if (s == NULL) return qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
    s->m = m;
    s->be = m->be;
    s->max_ctx = max_ctx;
    /* QWENCUDA_NO_GRAPHS=1 runs every decode step op by op (to measure or to debug replay) */
    const char *no_graphs = getenv("QWENCUDA_NO_GRAPHS");
    s->no_replay = no_graphs && *no_graphs && strcmp(no_graphs, "0") != 0;
    /* QWENCUDA_NO_FUSION=1 runs the unfused op sequences everywhere (to measure the fused ops) */
    const char *no_fusion = getenv("QWENCUDA_NO_FUSION");
    s->no_fusion = no_fusion && *no_fusion && strcmp(no_fusion, "0") != 0;
    s->k_cache = calloc((size_t)c->n_layer, sizeof *s->k_cache);
    s->v_cache = calloc((size_t)c->n_layer, sizeof *s->v_cache);
    s->want = calloc(CAP_N_GLOBAL + (size_t)c->n_layer * L_N_NAMES, 1);
    if (s->k_cache == NULL || s->v_cache == NULL || s->want == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
        goto fail;
    }
    for (int64_t l = 0; l < c->n_layer; l++) {
        if (buf_alloc(s->be, (size_t)max_ctx * kv_dim * sizeof(float), &s->k_cache[l], err) < 0 ||
            buf_alloc(s->be, (size_t)max_ctx * kv_dim * sizeof(float), &s->v_cache[l], err) < 0) {
            qc_error why = *err;
            qc_fail(err, why.kind, "KV cache of %d positions: %s", max_ctx, why.msg);
            goto fail;
        }
    }
    if (ensure_rows(s, max_ctx < QC_INITIAL_ROWS ? max_ctx : QC_INITIAL_ROWS, err) < 0 ||
        ensure_logit_rows(s, 1, err) < 0)
        goto fail;
    *out = s;
    return 0;
fail:
    qc_session_free(s);
    return -1;
}

void qc_session_free(qc_session *s) {
    if (s == NULL) return;
    qc_backend *be = s->be;
    drop_recording(s);
    for (int64_t l = 0; l < s->m->cfg.n_layer; l++) {
        if (s->k_cache) buf_free(be, &s->k_cache[l]);
        if (s->v_cache) buf_free(be, &s->v_cache[l]);
    }
    scratch_free(be, &s->sc);
    buf_free(be, &s->logits);
    buf_free(be, &s->amax);
    buf_free(be, &s->scores);
    buf_free(be, &s->probs);
    buf_free(be, &s->sample_state);
    buf_free(be, &s->sample_work);
    buf_free(be, &s->sample_result);
    free(s->host_pos);
    free(s->k_cache);
    free(s->v_cache);
    free(s->want);
    free(s);
}

int qc_session_position(const qc_session *s) { return s->pos; }
int qc_session_max_context(const qc_session *s) { return s->max_ctx; }
void qc_session_reset(qc_session *s) { s->pos = 0; }

/* Forget the last n tokens: the cache rows past the new position are overwritten before they
 * are read again, so nothing needs clearing. */
int qc_session_rewind(qc_session *s, int n, qc_error *err) {
    if (n < 0 || n > s->pos)
        return qc_fail(err, QC_ERR_VALUE, "cannot rewind %d tokens at position %d", n, s->pos);
    s->pos -= n;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* the forward pass */

/* The forward pass proper: every op from the embedding to the argmax, on the backend. It only
 * reads and writes backend memory (and copies captured tensors out), so that a decode step can
 * be recorded once and replayed. */
static int forward_ops(qc_session *s, int n, int n_kv, int rows, int all_logits, int want_head,
                       int do_argmax, int do_sample, float *scores, float *probs,
                       qc_capture *capture, qc_error *err) {
    const qc_model *m = s->m;
    const qc_config *c = &m->cfg;
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    qc_scratch *sc = &s->sc;
    const int dim = (int)c->dim, ffn = (int)c->ffn_dim, hd = (int)c->head_dim;
    const int n_head = (int)c->n_head, n_head_kv = (int)c->n_head_kv;
    const int q_dim = n_head * hd, kv_dim = n_head_kv * hd;
    const float eps = c->norm_eps;

    /* embed: x = token_embd[ids] */
    if (op->embed(be, &m->tok_embd, sc->ids, n, sc->x) < 0) goto backend_fail;
    if (capture_global(s, capture, CAP_EMBED, sc->x, QC_DTYPE_F32, 2, n, dim, err) < 0) goto fail;

    for (int l = 0; l < (int)c->n_layer; l++) {
        const qc_layer *L = &m->layers[l];
        /* A fused op runs unless this eval captures an intermediate that it never writes:
         * q and k before RoPE, attn_proj, gate and up, ffn_out. Everything else the fused ops
         * leave in the same buffers as the unfused ones, so its capture is unchanged. */
        const int fuse = !s->no_fusion;
        const int fuse_rope = fuse && !layer_wants(s, l, L_Q) && !layer_wants(s, l, L_K);
        const int fuse_o = fuse && !layer_wants(s, l, L_ATTN_PROJ);
        const int fuse_gate_up = fuse && !layer_wants(s, l, L_GATE) && !layer_wants(s, l, L_UP);
        const int fuse_down = fuse && !layer_wants(s, l, L_FFN_OUT);
        /* the norms fold into the projections after them unless their output is captured */
        const int fuse_attn_norm = fuse && !layer_wants(s, l, L_ATTN_NORM);
        const int fuse_ffn_norm = fuse_gate_up && !layer_wants(s, l, L_FFN_NORM);

        /* attention RMSNorm: xn = x / rms(x) * attn_norm */
        if (!fuse_attn_norm) {
            if (op->rmsnorm(be, sc->x, L->attn_norm, n, dim, eps, sc->xn) < 0) goto backend_fail;
            if (capture_layer(s, capture, l, L_ATTN_NORM, sc->xn, 2, n, dim, 0, err) < 0) goto fail;
        }

        /* q, k, v = xn @ W^T + b (Qwen2's biases are large: never drop them), in one pass */
        if (fuse) {
            const qc_matmul_part qkv[3] = {
                {&L->wq, L->bq, sc->q}, {&L->wk, L->bk, sc->k}, {&L->wv, L->bv, sc->v}};
            if ((fuse_attn_norm ? op->matmul_multi(be, qkv, 3, sc->x, n, L->attn_norm, eps)
                                : op->matmul_multi(be, qkv, 3, sc->xn, n, NULL, 0.0f)) < 0)
                goto backend_fail;
        } else if (op->matmul(be, &L->wq, L->bq, sc->xn, n, sc->q) < 0 ||
                   op->matmul(be, &L->wk, L->bk, sc->xn, n, sc->k) < 0 ||
                   op->matmul(be, &L->wv, L->bv, sc->xn, n, sc->v) < 0) {
            goto backend_fail;
        }
        if (capture_layer(s, capture, l, L_Q, sc->q, 3, n, n_head, hd, err) < 0 ||
            capture_layer(s, capture, l, L_K, sc->k, 3, n, n_head_kv, hd, err) < 0 ||
            capture_layer(s, capture, l, L_V, sc->v, 3, n, n_head_kv, hd, err) < 0)
            goto fail;

        /* RoPE, NEOX pairs (i, i + head_dim/2), on q and k at their positions; the rotated k
         * and the v of these tokens go into the cache at their positions */
        if (fuse_rope) {
            if (op->rope_kv_store(be, sc->q, sc->k, sc->v, sc->pos, n, n_head, n_head_kv, hd,
                                  c->rope_theta, s->k_cache[l], s->v_cache[l]) < 0)
                goto backend_fail;
        } else if (op->rope(be, sc->q, sc->pos, n, n_head, hd, c->rope_theta) < 0 ||
                   op->rope(be, sc->k, sc->pos, n, n_head_kv, hd, c->rope_theta) < 0 ||
                   op->kv_store(be, sc->k, sc->v, sc->pos, n, kv_dim, s->k_cache[l], s->v_cache[l]) < 0) {
            goto backend_fail;
        }
        if (capture_layer(s, capture, l, L_Q_ROPE, sc->q, 3, n, n_head, hd, err) < 0 ||
            capture_layer(s, capture, l, L_K_ROPE, sc->k, 3, n, n_head_kv, hd, err) < 0)
            goto fail;

        /* causal GQA attention: query head h reads KV head h / (n_head / n_head_kv), keys 0..pos */
        if (op->attention(be, sc->q, s->k_cache[l], s->v_cache[l], sc->pos, n, n_kv, n_head,
                          n_head_kv, hd, sc->att, scores, probs) < 0)
            goto backend_fail;
        if (capture_layer(s, capture, l, L_ATTN_SCORES, scores, 3, n_head, n, n_kv, err) < 0 ||
            capture_layer(s, capture, l, L_ATTN_PROBS, probs, 3, n_head, n, n_kv, err) < 0 ||
            capture_layer(s, capture, l, L_ATTN_OUT, sc->att, 2, n, q_dim, 0, err) < 0)
            goto fail;

        /* output projection (no bias) and the residual: x = x + att @ Wo^T */
        if (fuse_o) {
            if (op->matmul_add(be, &L->wo, sc->att, n, sc->x, sc->x) < 0) goto backend_fail;
        } else {
            if (op->matmul(be, &L->wo, NULL, sc->att, n, sc->y) < 0) goto backend_fail;
            if (capture_layer(s, capture, l, L_ATTN_PROJ, sc->y, 2, n, dim, 0, err) < 0) goto fail;
            if (op->add(be, sc->x, sc->y, (int64_t)n * dim, sc->x) < 0) goto backend_fail;
        }
        if (capture_layer(s, capture, l, L_RESID_MID, sc->x, 2, n, dim, 0, err) < 0) goto fail;

        /* feed-forward RMSNorm */
        if (!fuse_ffn_norm) {
            if (op->rmsnorm(be, sc->x, L->ffn_norm, n, dim, eps, sc->xn) < 0) goto backend_fail;
            if (capture_layer(s, capture, l, L_FFN_NORM, sc->xn, 2, n, dim, 0, err) < 0) goto fail;
        }

        /* gate and up projections, act = silu(gate) * up */
        if (fuse_gate_up) {
            if ((fuse_ffn_norm ? op->matmul_swiglu(be, &L->w_gate, &L->w_up, sc->x, n, L->ffn_norm, eps, sc->act)
                               : op->matmul_swiglu(be, &L->w_gate, &L->w_up, sc->xn, n, NULL, 0.0f, sc->act)) < 0)
                goto backend_fail;
        } else {
            if (op->matmul(be, &L->w_gate, NULL, sc->xn, n, sc->gate) < 0 ||
                op->matmul(be, &L->w_up, NULL, sc->xn, n, sc->up) < 0)
                goto backend_fail;
            if (capture_layer(s, capture, l, L_GATE, sc->gate, 2, n, ffn, 0, err) < 0 ||
                capture_layer(s, capture, l, L_UP, sc->up, 2, n, ffn, 0, err) < 0)
                goto fail;
            if (op->swiglu(be, sc->gate, sc->up, (int64_t)n * ffn, sc->act) < 0) goto backend_fail;
        }
        if (capture_layer(s, capture, l, L_FFN_ACT, sc->act, 2, n, ffn, 0, err) < 0) goto fail;

        /* down projection and the residual: x = x + act @ Wdown^T */
        if (fuse_down) {
            if (op->matmul_add(be, &L->w_down, sc->act, n, sc->x, sc->x) < 0) goto backend_fail;
        } else {
            if (op->matmul(be, &L->w_down, NULL, sc->act, n, sc->y) < 0) goto backend_fail;
            if (capture_layer(s, capture, l, L_FFN_OUT, sc->y, 2, n, dim, 0, err) < 0) goto fail;
            if (op->add(be, sc->x, sc->y, (int64_t)n * dim, sc->x) < 0) goto backend_fail;
        }
        if (capture_layer(s, capture, l, L_RESID_OUT, sc->x, 2, n, dim, 0, err) < 0) goto fail;
    }

    if (want_head) {
        /* output RMSNorm: every row when they are all needed, else the last one only */
        const int first = (all_logits || s->want[CAP_OUTPUT_NORM]) ? 0 : n - 1;
        const size_t off = (size_t)first * (size_t)dim;
        if (op->rmsnorm(be, sc->x + off, m->output_norm, n - first, dim, eps, sc->xn + off) < 0)
            goto backend_fail;
        if (capture_global(s, capture, CAP_OUTPUT_NORM, sc->xn, QC_DTYPE_F32, 2, n, dim, err) < 0)
            goto fail;

        /* lm_head: logits = xn @ output^T (output.weight, or token_embd when tied), on the
         * rows asked for */
        const float *head_in = sc->xn + (size_t)(n - rows) * (size_t)dim;
        if (op->matmul(be, &m->output, NULL, head_in, rows, s->logits) < 0) goto backend_fail;
        if (capture_global(s, capture, CAP_LOGITS, s->logits, QC_DTYPE_F32, 2, rows, c->n_vocab, err) < 0)
            goto fail;

        /* argmax: the first largest logit of each row */
        if (do_argmax) {
            if (op->argmax(be, s->logits, rows, c->n_vocab, s->amax) < 0) goto backend_fail;
            if (capture_global(s, capture, CAP_ARGMAX, s->amax, QC_DTYPE_I32, 1, rows, 0, err) < 0)
                goto fail;
        }

        /* a draw from the last row, by the sampler state uploaded for this eval */
        if (do_sample && op->sample(be, s->logits + (size_t)(rows - 1) * (size_t)c->n_vocab, c->n_vocab,
                                    s->sample_state, s->sample_work, s->sample_result) < 0)
            goto backend_fail;
    }
    return 0;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
fail:
    return -1;
}

int qc_session_eval(qc_session *s, const int32_t *ids, int n, int all_logits,
                    const qc_capture_spec *spec, qc_capture *capture,
                    float *logits, int32_t *argmax, const qc_sample_state *sample,
                    qc_sample_result *drawn, qc_error *err) {
    const qc_model *m = s->m;
    const qc_config *c = &m->cfg;
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    qc_scratch *sc = &s->sc;
    const int n_head = (int)c->n_head;

    /* Everything that can be wrong with the request is checked before any work. */
    if (n < 1) return qc_fail(err, QC_ERR_VALUE, "no tokens to evaluate");
    if (n > s->max_ctx - s->pos)
        return qc_fail(err, QC_ERR_RANGE, "context full: %d tokens at position %d exceed max_context %d",
                       n, s->pos, s->max_ctx);
    for (int t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= c->n_vocab)
            return qc_fail(err, QC_ERR_RANGE, "token id %d at ids[%d] (position %d) is out of range [0, %lld)",
                           (int)ids[t], t, s->pos + t, (long long)c->n_vocab);
    if (sample && sample->n_history < 0)
        return qc_fail(err, QC_ERR_VALUE, "sampler state with %d penalty tokens", (int)sample->n_history);

    const int n_kv = s->pos + n;                    /* keys visible to the last token */
    const int n_captured = mark_wanted(s, capture ? spec : NULL);
    const int want_scores = n_captured && (any_layer_wants(s, L_ATTN_SCORES) || any_layer_wants(s, L_ATTN_PROBS));
    const int do_sample = sample != NULL;
    const size_t sample_bytes = do_sample ? sizeof *sample + (size_t)sample->n_history * sizeof(int32_t) : 0;
    const int want_head = logits || argmax || do_sample || s->want[CAP_OUTPUT_NORM] ||
                          s->want[CAP_LOGITS] || s->want[CAP_ARGMAX];
    const int rows = all_logits ? n : 1;            /* lm_head rows */
    if (ensure_rows(s, n, err) < 0) return -1;
    if (want_head && ensure_logit_rows(s, rows, err) < 0) return -1;
    if (want_scores && ensure_scores(s, (size_t)n_head * (size_t)n * (size_t)n_kv, err) < 0) return -1;
    if (do_sample && ensure_sampling(s, sample_bytes, err) < 0) return -1;
    float *scores = want_scores ? s->scores : NULL, *probs = want_scores ? s->probs : NULL;

    /* token ids and positions reach the backend once per eval */
    for (int t = 0; t < n; t++) s->host_pos[t] = s->pos + t;
    if (op->upload(be, sc->ids, ids, (size_t)n * sizeof(int32_t)) < 0 ||
        op->upload(be, sc->pos, s->host_pos, (size_t)n * sizeof(int32_t)) < 0)
        goto backend_fail;
    /* the sampler's RNG and recent tokens, as this draw must see them */
    if (do_sample && op->upload(be, s->sample_state, sample, sample_bytes) < 0) goto backend_fail;

    /* A decode step (one token, nothing captured) on a backend that can record: the ops are
     * recorded once and the recording is replayed at every later step, one launch instead of
     * hundreds. Only the uploaded id, position and sampler state differ between replays. */
    const int replayable = n == 1 && n_captured == 0 && want_head && op->replay && !s->no_replay;
    const int do_argmax = (replayable && !do_sample) || argmax || s->want[CAP_ARGMAX];
    void **slot = &s->decode_rec[do_sample ? 1 + do_argmax : 0];
    if (replayable && *slot) {
        if (op->replay(be, *slot) < 0) goto backend_fail;
    } else if (replayable && op->record_begin(be) == 0) {
        void *rec = NULL;
        int ran = forward_ops(s, n, n_kv, rows, all_logits, want_head, do_argmax, do_sample, scores,
                              probs, capture, err);
        if (op->record_end(be, &rec) == 0 && ran == 0) {
            *slot = rec;
            if (op->replay(be, rec) < 0) goto backend_fail;
        } else {
            /* not recordable here after all: run the ops plainly from now on */
            op->recording_free(be, rec);
            s->no_replay = 1;
            if (forward_ops(s, n, n_kv, rows, all_logits, want_head, do_argmax, do_sample, scores,
                            probs, capture, err) < 0)
                return -1;
        }
    } else if (forward_ops(s, n, n_kv, rows, all_logits, want_head, do_argmax, do_sample, scores,
                           probs, capture, err) < 0) {
        return -1;
    }

    /* a download waits for the work before it; without one, wait here */
    const int downloaded = want_head && (argmax || logits || do_sample);
    if (do_sample && op->download(be, drawn, s->sample_result, sizeof *drawn) < 0) goto backend_fail;
    if (want_head) {
        if (argmax && op->download(be, argmax, s->amax, (size_t)rows * sizeof(int32_t)) < 0)
            goto backend_fail;
        if (logits && op->download(be, logits, s->logits,
                                   (size_t)rows * (size_t)c->n_vocab * sizeof(float)) < 0)
            goto backend_fail;
    }
    if (!downloaded && op->synchronize(be) < 0) goto backend_fail;
    if (do_sample && drawn->token < 0)   /* the eval stays undone: the position does not move */
        return qc_fail(err, QC_ERR_VALUE, "no token can be sampled: every logit is NaN or -inf");

    /* the tokens are in the cache now: the next eval starts after them */
    s->pos += n;
    return 0;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
    return -1;
}
