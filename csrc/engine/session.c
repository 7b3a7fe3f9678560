/* session.c: the forward pass of Qwen2, written once against the backend ops (backend.h), with a
 * KV cache, positions and capture.
 *
 * A session owns, on the backend: the KV cache of every layer (F32 or F16), scratch activations
 * for up to `chunk` tokens (grown only when a longer eval comes, so a decode step allocates
 * nothing), and the lm_head output of up to QC_HEAD_ROWS rows. An eval longer than `chunk`
 * tokens runs as several forward passes over consecutive chunks: each chunk's keys and values
 * join the cache before the next chunk attends to them, so the result is the same as one pass.
 *
 * Capture copies a named activation to host memory right after the step that produced it, and
 * only when one of the caller's patterns names it; with capture_device, to a buffer of the CUDA
 * device instead (a device-to-device copy), which the caller takes and frees without the
 * backend. A patch (qc_patch_spec) hands the same host copy to the caller's function first and
 * uploads what it returns, so the rest of the forward pass reads the patched value. Every
 * captured tensor is allocated, at its full size, before any work, and the sum is checked against
 * the capture budget first (in GPU memory for device captures), so a capture that cannot fit is
 * refused with MemoryError instead of killing the process.
 * Attention scores and probabilities are recomputed for the captured query rows by the exact
 * attention (fp32 over the cache's values), in blocks of rows, so a long context's attention can
 * be read one row at a time in O(n) memory; the forward pass itself always runs the same
 * attention whether or not anything is captured.
 *
 * The forward pass runs the fused ops of backend.h (q/k/v in one matmul with the attention norm
 * folded in, RoPE with the cache write, residual adds in the matmul epilogues, gate/up with
 * SwiGLU and the feed-forward norm folded in) wherever the eval captures none of the
 * intermediates they skip; elsewhere it runs the unfused sequence, which computes the same
 * numbers, bit for bit but in two places: the CUDA prefill's GEMM epilogue, and the CUDA decode
 * step's feed-forward norm, which the o projection hands to gate/up as x * weight in 8 bits with
 * the norm's scale applied after the dot products (matmul_add's norm_next, backend.h; within the
 * 8-bit activation error, tests/test_kernels.py). Capturing ffn_norm (or patching resid_mid)
 * turns that hand-off off for its layer, whose later tensors then round that way; no other
 * capture changes a number.
 */
#include "session.h"

#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef QC_HAVE_CUDA
#include "../../kernels/qc_cuda_api.h"
#endif

/* ---------------------------------------------------------------------------------------- */
/* capture names (DESIGN.md): four global ones, and per layer, in forward order */

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

int qc_capture_global_count(void) { return CAP_N_GLOBAL; }
const char *qc_capture_global_name(int i) { return i >= 0 && i < CAP_N_GLOBAL ? global_names[i] : NULL; }
int qc_capture_layer_count(void) { return L_N_NAMES; }
const char *qc_capture_layer_name(int i) { return i >= 0 && i < L_N_NAMES ? layer_names[i] : NULL; }

/* ---------------------------------------------------------------------------------------- */
/* the session */

/* Tokens per forward pass by default: long enough for the GEMMs to run at speed, short enough
 * that the scratch stays small (0.5B: 77 KB a token; 7B: 300 KB). */
#define QC_DEFAULT_CHUNK 4096
/* Scratch rows allocated up front: enough for short prompts without growing. */
#define QC_INITIAL_ROWS 32
/* lm_head rows computed at once: bounds the backend's logits buffer (512 x 151936 floats). */
#define QC_HEAD_ROWS 512
/* the kinds of recorded decode step (rec_kind) */
#define QC_REC_KINDS 4
/* Captures and logits below this many bytes fit whatever the default budget (half of the
 * available memory) is. */
#define QC_BUDGET_UNCHECKED ((size_t)64 << 20)
/* Backend memory for one block of captured attention rows (scores and probabilities). */
#define QC_SCORE_BLOCK_BYTES ((size_t)256 << 20)

/* Activations of one chunk, on the backend, for up to `rows` tokens. */
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
    float *y;                 /* (rows, dim) o_proj output, then ffn_down output; in a folded
                                 step, x plus the layer before's sums (qkv_attention's x_out) */
    float *gate;              /* (rows, ffn_dim) */
    float *up;                /* (rows, ffn_dim) */
    float *act;               /* (rows, ffn_dim) silu(gate) * up */
} qc_scratch;

/* The decode step run ahead (backend.h's feed_draw). A generation loop evals one token at a
 * time, each the token the step before drew, at the next position, with the same sampler: then
 * the host need not wait for a step's draw before the GPU starts the next one. After such an
 * eval (`pipelined`: a replayed step that draws on the backend and hands back no logits) the
 * session writes down the eval it expects next; when an eval meets that expectation, the step
 * after it is queued on the device before this eval waits for its own draw: the recording
 * again, whose last op (feed_draw) set the token, position and RNG from the draw in device
 * memory. The next eval, if it is the expected one, finds its step running or done and only
 * collects its draw; any other eval leaves the queued step's work behind it, which it
 * overwrites before it reads (the step wrote the cache row past the position, which no eval
 * reads before writing it again).
 * An eval that does not meet the expectation queues nothing, so a loop that changes what it
 * asks at every step (a growing penalty history, a new token) never pays for a wasted step. */
typedef struct {
    int valid;                /* the expectation below holds the next eval of a pipelined loop */
    int pos;                  /* its position: the last step's plus one */
    int32_t token;            /* its id: the last step's draw */
    void *state;              /* (state_bytes) its sampler state: the last one, the draw's RNG */
    size_t state_bytes, state_cap;
    int queued;               /* the step is queued; its draw comes with ticket */
    int ticket;
} qc_ahead;

/* Captured attention rows of one block: their q, positions, exact outputs, and the scores and
 * probabilities (n_head, rows, n_kv), on the backend. */
typedef struct {
    int rows;                 /* capacity in rows */
    size_t score_cap;         /* capacity of scores and probs, in floats */
    float *q;                 /* (rows, n_head, head_dim) */
    int32_t *pos;             /* (rows) */
    float *out;               /* (rows, n_head * head_dim), unused */
    float *scores, *probs;    /* (score_cap) */
} qc_attn_rows;

struct qc_session {
    qc_model *m;
    qc_backend *be;
    int max_ctx;
    int pos;                  /* tokens in the cache: the next token's position */
    int kv_type;              /* QC_KV_F32 or QC_KV_F16 */
    int chunk;                /* most tokens per forward pass */
    size_t capture_budget;    /* bytes; 0 = half of MemAvailable at each eval */
    int no_fusion;            /* QWENCUDA_NO_FUSION at creation: never the fused ops */
    int no_graphs;            /* QWENCUDA_NO_GRAPHS at creation: every decode step op by op */
    int record_failed;        /* a decode step could not be recorded (and ran op by op) */
    int persistent_decode;    /* QWENCUDA_DECODE=persistent at creation: the one-launch step */
    const char *last_path;    /* how the last eval ran: "ops", "graph" or "persistent" */
    int no_ahead;             /* QWENCUDA_DECODE_AHEAD=0 at creation: no step is run ahead */
    int no_norm_next;         /* QWENCUDA_NORM_AFTER=0 at creation: matmul_add never told norm_next */
    int ran_ahead;            /* the last eval's step had been queued ahead */
    qc_ahead ahead;
    qc_decode_layer *dec_layers;  /* [n_layer]: the weights and caches of decode_step's plan */
    qc_decode_plan dec;       /* decode_step's plan; its buffer pointers are set at each use */
    int dec_takes[2];         /* decode_step_takes per qc_kv_bucket (it depends on nothing else);
                                 -1 until asked */
    qc_kv_cache *kv;          /* [n_layer] (max_ctx, n_head_kv * head_dim) of k (after RoPE), v */
    qc_scratch sc;
    int32_t *host_pos;        /* (sc.rows) positions staged on the host before upload */
    float *logits;            /* (logit_rows, n_vocab) lm_head output */
    int32_t *amax;            /* (logit_rows) */
    int logit_rows;
    qc_attn_rows ar;
    void *decode_rec[2][QC_REC_KINDS];   /* the recorded decode step (backend replay), or NULL,
                                 per qc_kv_bucket of its keys and rec_kind */
    unsigned char rec_draw_fed[2][QC_REC_KINDS];   /* its matmul_draw fed the next step: its draw
                                 reaches the host by draw_ticket (backend.h) */
    int head_draw_fed;        /* the last head_forward's matmul_draw ran and fed the next step */
    /* sampling on the backend (an eval with a sampler), allocated at the first such eval */
    void *sample_state;       /* (sample_state_cap) qc_sample_state and its token ids */
    size_t sample_state_cap;
    void *sample_work;        /* (qc_sample_work_bytes(n_vocab)) */
    void *sample_result;      /* one qc_sample_result */
    /* this eval's captures: slot[name] = index into the result's items, or -1; and patches */
    int *slot;                /* [CAP_N_GLOBAL + n_layer * L_N_NAMES], all -1 unless marked */
    char *patched;            /* [same]: 1 where this eval's patch names the tensor */
    int slots_marked;         /* the last eval captured or patched: slot[], patched[] need clearing */
    /* the down projection folded into the gate/up op (backend.h's swiglu_down) in a decode step
     * that captures and patches nothing (eval_plan's fold_down): fold[l] where the backend took
     * layer l's weights at creation (none unless two layers or more), and their fixed-point
     * sums, a row of dim a layer, in backend memory. A folded layer adds into its row and clears
     * the row of the folded layer before it (fold_before: cyclically, so the first clears the
     * last's of the step before), whose sums the layer after that one (or the head, after the
     * last layer: head_sum) has read: between evals every row is zero but the last folded
     * layer's. Steps that do not fold leave the rows alone. */
    unsigned char *fold;      /* [n_layer] */
    int n_fold;
    int64_t *fold_sums;       /* (n_layer, dim) */
};

/* What one eval does, decided once before any work. */
typedef struct {
    const qc_eval_request *req;
    qc_eval_result *res;
    int n;                    /* tokens */
    int start;                /* position of the first */
    int n_kv;                 /* keys visible to the last token: start + n */
    int head_rows;            /* lm_head rows handed back: n (all_logits) or 1 */
    int want_head;            /* run the output norm and the lm_head at all */
    int do_argmax, do_sample;
    int head_draw;            /* the draw is the lm_head's (matmul_draw): greedy without a penalty,
                                 on a backend that has it, no patch of the logits before it */
    int feeds;                /* the step ends by feeding its draw to the next (qc_ahead) */
    int defer_download;       /* the recorded decode step: logits are downloaded after replay */
    int one_launch;           /* the step's layers and lm_head in one decode_step launch */
    int n_captured;
    int n_patched;
    int n_attn_q;             /* query rows of the captured attn_scores / attn_probs */
    int head_block;           /* lm_head rows computed at once: QC_HEAD_ROWS, or all when patched */
    int fold_down;            /* one token, nothing captured or patched: the layers of s->fold fold
                                 their down projection (swiglu_down) */
} eval_plan;

/* ---------------------------------------------------------------------------------------- */
/* capture */

void qc_capture_free(qc_capture *c) {
    if (c == NULL) return;
    for (int i = 0; i < c->n; i++) {
        qc_tensor_out *t = &c->items[i];
#ifdef QC_HAVE_CUDA
        if (t->on_device) {
            qc_cuda_buffer_free(t->device, t->data);
            continue;
        }
#endif
        free(t->data);   /* (a device item exists only in CUDA builds) */
    }
    free(c->items);
    c->items = NULL;
    c->n = c->cap = 0;
}

static size_t n_names(const qc_session *s) { return CAP_N_GLOBAL + (size_t)s->m->cfg.n_layer * L_N_NAMES; }
static int layer_slot(const qc_session *s, int layer, int which) {
    return s->slot[CAP_N_GLOBAL + (size_t)layer * L_N_NAMES + which];
}
static size_t layer_index(const qc_session *s, int layer, int which) {
    (void)s;
    return CAP_N_GLOBAL + (size_t)layer * L_N_NAMES + (size_t)which;
}
/* The eval captures or patches this tensor: the ops that skip it (fused) must not run. */
static int layer_wants(const qc_session *s, int layer, int which) {
    const size_t i = layer_index(s, layer, which);
    return s->slot[i] >= 0 || s->patched[i];
}
static int layer_patched(const qc_session *s, int layer, int which) { return s->patched[layer_index(s, layer, which)]; }

static void name_of(const qc_session *s, size_t i, char *buf, size_t size) {
    (void)s;
    if (i < CAP_N_GLOBAL) snprintf(buf, size, "%s", global_names[i]);
    else snprintf(buf, size, "blk.%d.%s", (int)((i - CAP_N_GLOBAL) / L_N_NAMES), layer_names[(i - CAP_N_GLOBAL) % L_N_NAMES]);
}

/* The k-th name in forward order (embed, every layer's, output_norm, logits, argmax) as an index
 * of slot[] (the globals first, then the layers'). */
static size_t forward_order(const qc_session *s, size_t k) {
    const size_t layers = n_names(s) - CAP_N_GLOBAL;
    if (k == 0) return CAP_EMBED;
    if (k <= layers) return CAP_N_GLOBAL + k - 1;
    return k - layers;   /* output_norm, logits, argmax */
}

/* Shape of name i in this eval: (d0[, d1[, d2]]); the first dimension is the token (or query)
 * row but for attention scores, whose rows are the second. */
static int shape_of(const qc_session *s, const eval_plan *p, size_t i, int64_t d[3], int *dtype) {
    const qc_config *c = &s->m->cfg;
    *dtype = QC_DTYPE_F32;
    d[0] = p->n;
    d[1] = d[2] = 0;
    if (i < CAP_N_GLOBAL) {
        switch ((int)i) {
        case CAP_EMBED: case CAP_OUTPUT_NORM: d[1] = c->dim; return 2;
        case CAP_LOGITS: d[0] = p->head_rows; d[1] = c->n_vocab; return 2;
        default: d[0] = p->head_rows; *dtype = QC_DTYPE_I32; return 1;   /* argmax */
        }
    }
    switch ((int)((i - CAP_N_GLOBAL) % L_N_NAMES)) {
    case L_Q: case L_Q_ROPE: d[1] = c->n_head; d[2] = c->head_dim; return 3;
    case L_K: case L_V: case L_K_ROPE: d[1] = c->n_head_kv; d[2] = c->head_dim; return 3;
    case L_ATTN_SCORES: case L_ATTN_PROBS: d[0] = c->n_head; d[1] = p->n_attn_q; d[2] = p->n_kv; return 3;
    case L_ATTN_OUT: d[1] = c->n_head * c->head_dim; return 2;
    case L_GATE: case L_UP: case L_FFN_ACT: d[1] = c->ffn_dim; return 2;
    default: d[1] = c->dim; return 2;
    }
}

static size_t bytes_of(int ndim, const int64_t d[3]) {
    size_t count = (size_t)d[0];
    if (ndim > 1) count *= (size_t)d[1];
    if (ndim > 2) count *= (size_t)d[2];
    return count * 4;   /* float32 and int32 */
}

static int matches(const qc_capture_spec *spec, const char *name) {
    for (int i = 0; i < spec->n_patterns; i++)
        if (spec->patterns[i] && fnmatch(spec->patterns[i], name, 0) == 0) return 1;
    return 0;
}

/* Half of the memory the system can give without swapping (MemAvailable), else of free pages. */
static size_t default_budget(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    unsigned long long kb = 0;
    if (f) {
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
        fclose(f);
    }
    if (kb) return (size_t)(kb * 1024ull / 2);
    long pages = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (size_t)pages * (size_t)size / 2 : (size_t)1 << 30;
}

size_t qc_session_capture_budget(const qc_session *s) {
    return s->capture_budget ? s->capture_budget : default_budget();
}
void qc_session_set_capture_budget(qc_session *s, size_t bytes) { s->capture_budget = bytes; }

static double gib(size_t bytes) { return (double)bytes / (double)(1u << 30); }

/* Captures can stay on the device of a CUDA backend only: their buffers are freed without it
 * (qc_cuda_buffer_free), so Python may keep them after the model is closed. */
static int keeps_device_captures(const qc_backend *be) {
#ifdef QC_HAVE_CUDA
    return strcmp(be->name, "cuda") == 0;
#else
    (void)be;
    return 0;
#endif
}

/* The capture budget for device captures, as for host ones (qc_session_check): the caller's, or
 * half of the GPU memory free now, looked up (cudaMemGetInfo) only for more than
 * QC_BUDGET_UNCHECKED. */
static int check_device_budget(const qc_session *s, size_t need, int count, qc_error *err) {
    size_t budget = s->capture_budget, free_now = 0;
    if (budget == 0 && need <= QC_BUDGET_UNCHECKED) return 0;
    if (budget == 0) {
#ifdef QC_HAVE_CUDA
        size_t total = 0;
        if (qc_cuda_mem_info(s->be->device, &free_now, &total, err) < 0) return -1;
#endif
        budget = free_now / 2;
    }
    if (need <= budget) return 0;
    char why[80];
    if (s->capture_budget) snprintf(why, sizeof why, "set by the caller");
    else snprintf(why, sizeof why, "half of the %.2f GiB free on the GPU now", gib(free_now));
    return qc_fail(err, QC_ERR_NOMEM,
                   "this eval's device captures (%d tensors) need %.2f GiB of GPU memory on cuda:%d, over "
                   "the capture budget of %.2f GiB (%s); capture fewer names or layers, choose query rows "
                   "with attn_rows= for attention at long context, capture to host memory "
                   "(capture_device='cpu'), or raise the budget (qwencuda.set_capture_budget)",
                   count, gib(need), s->be->device, gib(budget), why);
}

/* The eval's plan from its request (no checks here: qc_session_check made them). */
static void plan_eval(const qc_session *s, const qc_eval_request *req, qc_eval_result *res, eval_plan *p) {
    memset(p, 0, sizeof *p);
    p->req = req;
    p->res = res;
    p->n = req->n;
    p->start = s->pos;
    p->n_kv = s->pos + req->n;
    p->head_rows = req->all_logits ? req->n : 1;
    p->do_sample = req->sample != NULL;
    p->n_attn_q = req->attn_rows ? req->n_attn_rows : req->n;
    p->head_block = QC_HEAD_ROWS;
}

static int is_argmax(size_t i) { return i == CAP_ARGMAX; }

/* Host bytes this eval's patches take while their function runs (the largest one; and how
 * many names), by the shapes of plan p. */
static size_t patch_bytes(const qc_session *s, const eval_plan *p, int *count) {
    const qc_patch_spec *patch = p->req->patch;
    char name[64];
    int64_t d[3];
    int dtype;
    size_t most = 0;
    *count = 0;
    if (patch == NULL || patch->n_patterns <= 0) return 0;
    const qc_capture_spec as_spec = {patch->patterns, patch->n_patterns};
    for (size_t i = 0; i < n_names(s); i++) {
        name_of(s, i, name, sizeof name);
        if (is_argmax(i) || !matches(&as_spec, name)) continue;
        const size_t b = bytes_of(shape_of(s, p, i, d, &dtype), d);
        if (b > most) most = b;
        (*count)++;
    }
    return most;
}

/* Bytes this eval's captures take (and how many names), by the shapes of plan p. */
static size_t capture_bytes(const qc_session *s, const eval_plan *p, int *count) {
    const qc_capture_spec *spec = p->req->spec;
    char name[64];
    int64_t d[3];
    int dtype;
    size_t total = 0;
    *count = 0;
    if (spec == NULL || spec->n_patterns <= 0) return 0;
    for (size_t i = 0; i < n_names(s); i++) {
        name_of(s, i, name, sizeof name);
        if (!matches(spec, name)) continue;
        total += bytes_of(shape_of(s, p, i, d, &dtype), d);
        (*count)++;
    }
    return total;
}

int qc_session_check(const qc_session *s, const qc_eval_request *req, qc_error *err) {
    const qc_config *c = &s->m->cfg;
    const int n = req->n;
    if (n < 1) return qc_fail(err, QC_ERR_VALUE, "no tokens to evaluate");
    if (n > s->max_ctx - s->pos)
        return qc_fail(err, QC_ERR_RANGE, "context full: %d tokens at position %d exceed max_context %d",
                       n, s->pos, s->max_ctx);
    for (int t = 0; t < n; t++)
        if (req->ids[t] < 0 || req->ids[t] >= c->n_vocab)
            return qc_fail(err, QC_ERR_RANGE, "token id %d at ids[%d] (position %d) is out of range [0, %lld)",
                           (int)req->ids[t], t, s->pos + t, (long long)c->n_vocab);
    if (req->sample && req->sample->n_history < 0)
        return qc_fail(err, QC_ERR_VALUE, "sampler state with %d penalty tokens", (int)req->sample->n_history);
    if (req->patch && req->patch->fn == NULL)
        return qc_fail(err, QC_ERR_VALUE, "a patch without a function");
    if (req->attn_rows) {
        if (req->n_attn_rows < 1)
            return qc_fail(err, QC_ERR_VALUE, "attn_rows selects no query row");
        for (int i = 0; i < req->n_attn_rows; i++) {
            const int r = req->attn_rows[i];
            if (r < 0 || r >= n)
                return qc_fail(err, QC_ERR_RANGE, "attn_rows[%d] = %d is not a query row of this eval [0, %d)", i, r, n);
            if (i > 0 && r <= req->attn_rows[i - 1])
                return qc_fail(err, QC_ERR_VALUE, "attn_rows must be strictly increasing (attn_rows[%d] = %d after %d)",
                               i, r, req->attn_rows[i - 1]);
        }
    }
    if (req->capture_device && !keeps_device_captures(s->be))
        return qc_fail(err, QC_ERR_VALUE, "captures stay on the device only on a CUDA backend, and this "
                       "session runs on %s: capture to host memory (capture_device='cpu')", s->be->name);
    eval_plan p;
    qc_eval_result none;
    int count = 0;
    plan_eval(s, req, &none, &p);
    const size_t captured = capture_bytes(s, &p, &count);
    int n_patched = 0;
    /* a patch of attention rows needs every row of the eval: its output is recomputed */
    const size_t patch_need = patch_bytes(s, &p, &n_patched);
    if (n_patched && req->attn_rows) {
        char name[64];
        const qc_capture_spec as_spec = {req->patch->patterns, req->patch->n_patterns};
        for (int l = 0; l < (int)c->n_layer; l++) {
            for (int w = L_ATTN_SCORES; w <= L_ATTN_PROBS; w++) {
                name_of(s, layer_index(s, l, w), name, sizeof name);
                if (matches(&as_spec, name))
                    return qc_fail(err, QC_ERR_VALUE, "%s is patched: its attention output is recomputed "
                                   "from every query row, so attn_rows cannot choose some", name);
            }
        }
    }
    /* device captures take GPU memory, checked on its own; patches and logits stay host memory */
    if (req->capture_device && check_device_budget(s, captured, count, err) < 0) return -1;
    size_t need = req->capture_device ? 0 : captured;
    if (req->capture_device) count = 0;
    need += patch_need;
    if (req->want_logits) need += (size_t)p.head_rows * ((size_t)c->n_vocab * sizeof(float) + sizeof(int32_t));
    /* the default budget is looked up (a read of /proc/meminfo) only for evals that need more
     * than QC_BUDGET_UNCHECKED: never on the per-token path */
    if (s->capture_budget == 0 && need <= QC_BUDGET_UNCHECKED) return 0;
    const size_t budget = qc_session_capture_budget(s);
    if (need > budget)
        return qc_fail(err, QC_ERR_NOMEM,
                       "this eval's captures (%d tensors), patches and logits need %.2f GiB of host memory, over the "
                       "capture budget of %.2f GiB (%s); capture fewer names or layers, choose query rows "
                       "with attn_rows= for attention at long context, ask for logits='last', or raise the "
                       "budget (qwencuda.set_capture_budget)", count, gib(need), gib(budget),
                       s->capture_budget ? "set by the caller" : "half of the memory available now");
    return 0;
}

/* Allocate every captured tensor of the eval at its full size and mark its slot. */
static int capture_prepare(qc_session *s, eval_plan *p, qc_error *err) {
    const qc_capture_spec *spec = p->req->spec;
    qc_capture *cap = &p->res->capture;
    char name[64];
    int64_t d[3];
    int dtype;
    const qc_patch_spec *patch = p->req->patch;
    /* cleared only after an eval that captured or patched: a decode step walks no name table */
    if (s->slots_marked) {
        for (size_t i = 0; i < n_names(s); i++) s->slot[i] = -1;
        memset(s->patched, 0, n_names(s));
    }
    s->slots_marked = 0;
    if (patch && patch->n_patterns > 0) {
        const qc_capture_spec as_spec = {patch->patterns, patch->n_patterns};
        s->slots_marked = 1;
        for (size_t i = 0; i < n_names(s); i++) {
            name_of(s, i, name, sizeof name);
            if (!is_argmax(i) && matches(&as_spec, name)) {
                s->patched[i] = 1;
                p->n_patched++;
            }
        }
        /* the lm_head's rows in one block, so that a patch of the logits sees all of them */
        if (s->patched[CAP_LOGITS]) p->head_block = p->head_rows;
    }
    if (spec == NULL || spec->n_patterns <= 0) return 0;   /* capture off: no work at all */
    s->slots_marked = 1;
    for (size_t k = 0; k < n_names(s); k++) {
        const size_t i = forward_order(s, k);
        name_of(s, i, name, sizeof name);
        if (!matches(spec, name)) continue;
        const int ndim = shape_of(s, p, i, d, &dtype);
        const size_t bytes = bytes_of(ndim, d);
        if (cap->n == cap->cap) {
            const int grow = cap->cap ? 2 * cap->cap : 32;
            qc_tensor_out *items = realloc(cap->items, (size_t)grow * sizeof *items);
            if (items == NULL) return qc_fail(err, QC_ERR_NOMEM, "capture %s: out of memory", name);
            cap->items = items;
            cap->cap = grow;
        }
        void *data = NULL;
        if (p->req->capture_device) {
            qc_backend *be = s->be;
            if (be->ops->alloc(be, bytes ? bytes : 4, &data) < 0)
                return qc_fail(err, be->err.kind, "capture %s on the device: %s", name, be->err.msg);
        } else if ((data = malloc(bytes ? bytes : 1)) == NULL) {
            return qc_fail(err, QC_ERR_NOMEM, "capture %s: out of memory (%zu bytes)", name, bytes);
        }
        qc_tensor_out *t = &cap->items[cap->n];
        memset(t, 0, sizeof *t);
        snprintf(t->name, sizeof t->name, "%s", name);
        t->ndim = ndim;
        memcpy(t->shape, d, sizeof t->shape);
        t->dtype = dtype;
        t->data = data;
        t->on_device = p->req->capture_device;
        t->device = s->be->device;
        s->slot[i] = cap->n++;
        p->n_captured++;
    }
    return 0;
}

/* Rows [row0, row0 + nrows) of a captured tensor (each `width` values wide) from backend src. */
static int capture_rows(qc_session *s, const eval_plan *p, int slot, const void *src, int64_t row0,
                        int64_t nrows, int64_t width, qc_error *err) {
    qc_backend *be = s->be;
    if (slot < 0 || nrows <= 0) return 0;
    qc_tensor_out *t = &p->res->capture.items[slot];
    char *dst = (char *)t->data + (size_t)row0 * (size_t)width * 4;
    const size_t bytes = (size_t)nrows * (size_t)width * 4;
    const int rc = t->on_device ? be->ops->copy(be, dst, src, bytes) : be->ops->download(be, dst, src, bytes);
    if (rc < 0) return qc_fail(err, be->err.kind, "capture %s: %s", t->name, be->err.msg);
    return 0;
}

/* A whole captured tensor (bytes) computed in host memory (patched attention) into its capture. */
static int capture_host(qc_session *s, const eval_plan *p, int slot, const void *host, size_t bytes,
                        qc_error *err) {
    qc_backend *be = s->be;
    if (slot < 0) return 0;
    qc_tensor_out *t = &p->res->capture.items[slot];
    if (!t->on_device) {
        memcpy(t->data, host, bytes);
    } else if (be->ops->upload(be, t->data, host, bytes) < 0) {
        return qc_fail(err, be->err.kind, "capture %s: %s", t->name, be->err.msg);
    }
    return 0;
}

/* count floats of value at backend dst: one upload of up to 1024, then copies that double the
 * filled part (log2 of count launches). */
static int fill_backend(qc_backend *be, float *dst, size_t count, float value, qc_error *err) {
    float seed[1024];
    const size_t first = count < 1024 ? count : 1024;
    for (size_t i = 0; i < 1024; i++) seed[i] = value;
    /* (an upload from the stack: the backend has taken the bytes when it returns, backend.h) */
    if (be->ops->upload(be, dst, seed, first * sizeof *seed) < 0) goto fail;
    for (size_t done = first; done < count;) {
        const size_t n = count - done < done ? count - done : done;
        if (be->ops->copy(be, dst + done, dst, n * sizeof *dst) < 0) goto fail;
        done += n;
    }
    return 0;
fail:
    return qc_fail(err, be->err.kind, "%s", be->err.msg);
}

/* Rows [b0, b0 + nb) of captured attention, (n_head, nb, n_kv) at backend src, into a device
 * capture (n_head, n_attn_q, p->n_kv) at dst, padded to the eval's keys with pad (-inf or 0):
 * one copy per head when the block sees every key of the eval (one chunk), else the head's rows
 * are filled with pad and each row's n_kv keys copied over them. */
static int attn_rows_to_device(qc_session *s, const eval_plan *p, float *dst, const float *src, int b0,
                               int nb, int n_kv, float pad, qc_error *err) {
    qc_backend *be = s->be;
    const size_t width = (size_t)p->n_kv, keys = (size_t)n_kv;
    for (int h = 0; h < (int)s->m->cfg.n_head; h++) {
        float *d = dst + ((size_t)h * (size_t)p->n_attn_q + (size_t)b0) * width;
        const float *from = src + (size_t)h * (size_t)nb * keys;
        if (keys == width) {
            if (be->ops->copy(be, d, from, (size_t)nb * width * sizeof(float)) < 0) goto backend_fail;
            continue;
        }
        if (fill_backend(be, d, (size_t)nb * width, pad, err) < 0) return -1;
        for (int i = 0; i < nb; i++)
            if (be->ops->copy(be, d + (size_t)i * width, from + (size_t)i * keys, keys * sizeof(float)) < 0)
                goto backend_fail;
    }
    return 0;
backend_fail:
    return qc_fail(err, be->err.kind, "%s", be->err.msg);
}

/* The caller's patch of tensor i (name index), nrows x width floats at backend buf: a host copy
 * goes to the patch function, and what it leaves there back to buf. A patched eval is one chunk,
 * so buf holds the whole tensor. */
static int patch_host(qc_session *s, const eval_plan *p, size_t i, float *host, qc_error *err) {
    const qc_patch_spec *patch = p->req->patch;
    char name[64];
    int64_t d[3];
    int dtype;
    const int ndim = shape_of(s, p, i, d, &dtype);
    name_of(s, i, name, sizeof name);
    if (patch->fn(patch->ctx, name, host, ndim, d) < 0) return qc_fail(err, QC_ERR_CALLBACK, "patch of %s failed", name);
    return 0;
}

static int patch_tensor(qc_session *s, const eval_plan *p, size_t i, float *buf, int64_t nrows,
                        int64_t width, qc_error *err) {
    qc_backend *be = s->be;
    char name[64];
    if (!s->patched[i] || nrows <= 0) return 0;
    const size_t bytes = (size_t)nrows * (size_t)width * sizeof(float);
    name_of(s, i, name, sizeof name);
    float *host = malloc(bytes);
    if (host == NULL) return qc_fail(err, QC_ERR_NOMEM, "patch of %s: out of memory (%zu bytes)", name, bytes);
    int rc = -1;
    if (be->ops->download(be, host, buf, bytes) < 0) {
        qc_fail(err, be->err.kind, "patch of %s: %s", name, be->err.msg);
    } else if (patch_host(s, p, i, host, err) < 0) {
        /* err says which */
    } else if (be->ops->upload(be, buf, host, bytes) < 0) {
        qc_fail(err, be->err.kind, "patch of %s: %s", name, be->err.msg);
    } else {
        rc = 0;
    }
    free(host);
    return rc;
}

/* A per-layer tensor of this chunk's rows (token c0 + i for row i of src), computed: patched
 * when the eval patches it, then captured when it captures it. */
static int observe_layer(qc_session *s, const eval_plan *p, int layer, int which, float *src,
                         int c0, int nc, int64_t width, qc_error *err) {
    if (patch_tensor(s, p, layer_index(s, layer, which), src, nc, width, err) < 0) return -1;
    return capture_rows(s, p, layer_slot(s, layer, which), src, c0, nc, width, err);
}

/* The same for a global tensor (embed, output_norm, logits). */
static int observe(qc_session *s, const eval_plan *p, size_t i, float *src, int64_t row0, int64_t nrows,
                   int64_t width, qc_error *err) {
    if (patch_tensor(s, p, i, src, nrows, width, err) < 0) return -1;
    return capture_rows(s, p, s->slot[i], src, row0, nrows, width, err);
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
    /* a step queued ahead may still be running its recording: let it end first */
    if (s->ahead.queued && s->be->ops->synchronize(s->be) < 0) s->be->err.kind = QC_OK;
    s->ahead.valid = s->ahead.queued = 0;
    for (int b = 0; b < 2; b++) {
        for (int i = 0; i < QC_REC_KINDS; i++) {
            if (s->decode_rec[b][i]) s->be->ops->recording_free(s->be, s->decode_rec[b][i]);
            s->decode_rec[b][i] = NULL;
            s->rec_draw_fed[b][i] = 0;
        }
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

static void attn_rows_free(qc_backend *be, qc_attn_rows *ar) {
    buf_free(be, &ar->q);
    buf_free(be, &ar->pos);
    buf_free(be, &ar->out);
    buf_free(be, &ar->scores);
    buf_free(be, &ar->probs);
    ar->rows = 0;
    ar->score_cap = 0;
}

/* Room for `rows` captured attention rows over n_kv keys (grown, never shrunk; captures only). */
static int ensure_attn_rows(qc_session *s, int rows, int n_kv, qc_error *err) {
    const qc_config *c = &s->m->cfg;
    qc_attn_rows *ar = &s->ar;
    const size_t q_dim = (size_t)(c->n_head * c->head_dim);
    const size_t scores = (size_t)c->n_head * (size_t)rows * (size_t)n_kv;
    if (rows <= ar->rows && scores <= ar->score_cap) return 0;
    const int want_rows = rows > ar->rows ? rows : ar->rows;
    const size_t want_scores = scores > ar->score_cap ? scores : ar->score_cap;
    attn_rows_free(s->be, ar);
    if (buf_alloc(s->be, (size_t)want_rows * q_dim * sizeof(float), &ar->q, err) < 0 ||
        buf_alloc(s->be, (size_t)want_rows * sizeof(int32_t), &ar->pos, err) < 0 ||
        buf_alloc(s->be, (size_t)want_rows * q_dim * sizeof(float), &ar->out, err) < 0 ||
        buf_alloc(s->be, want_scores * sizeof(float), &ar->scores, err) < 0 ||
        buf_alloc(s->be, want_scores * sizeof(float), &ar->probs, err) < 0) {
        attn_rows_free(s->be, ar);
        return -1;
    }
    ar->rows = want_rows;
    ar->score_cap = want_scores;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* build / free */

/* decode_step's plan: the model's weights and the session's caches, fixed for its life; the
 * scratch pointers are set before each use (ensure_rows may move them). */
static void decode_plan_build(qc_session *s) {
    const qc_model *m = s->m;
    const qc_config *c = &m->cfg;
    for (int l = 0; l < (int)c->n_layer; l++) {
        const qc_layer *L = &m->layers[l];
        s->dec_layers[l] = (qc_decode_layer){
            .wq = &L->wq, .wk = &L->wk, .wv = &L->wv, .wo = &L->wo,
            .w_gate = &L->w_gate, .w_up = &L->w_up, .w_down = &L->w_down,
            .bq = L->bq, .bk = L->bk, .bv = L->bv, .attn_norm = L->attn_norm, .ffn_norm = L->ffn_norm,
            .kv = s->kv[l],
        };
    }
    s->dec = (qc_decode_plan){
        .n_layer = (int)c->n_layer, .dim = (int)c->dim, .ffn_dim = (int)c->ffn_dim, .n_head = (int)c->n_head,
        .n_head_kv = (int)c->n_head_kv, .head_dim = (int)c->head_dim, .norm_eps = c->norm_eps,
        .rope_theta = c->rope_theta, .layers = s->dec_layers, .output_norm = m->output_norm, .output = &m->output,
    };
}

static void decode_plan_buffers(qc_session *s) {
    s->dec.pos = s->sc.pos;
    s->dec.x = s->sc.x;
    s->dec.q = s->sc.q;
    s->dec.att = s->sc.att;
    s->dec.act = s->sc.act;
    s->dec.logits = s->logits;
}

/* Which layers fold their down projection (qc_session's fold), asked of the backend once, and
 * their sums, zeros. */
static int fold_plan(qc_session *s, qc_error *err) {
    const qc_model *m = s->m;
    const qc_config *c = &m->cfg;
    qc_backend *be = s->be;
    const int n_layer = (int)c->n_layer;
    s->n_fold = 0;
    if (!be->ops->swiglu_down_prepare || !be->ops->swiglu_down || !be->ops->sum_add || s->no_fusion || n_layer < 3)
        return 0;
    s->fold = calloc((size_t)n_layer, 1);
    if (s->fold == NULL) return qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
    for (int l = 0; l < n_layer; l++) {
        const qc_layer *L = &m->layers[l];
        const int rc = be->ops->swiglu_down_prepare(be, &L->w_gate, &L->w_up, &L->w_down);
        if (rc < 0) return qc_fail(err, be->err.kind, "%s", be->err.msg);
        s->fold[l] = rc == 1;
        s->n_fold += rc == 1;
    }
    if (s->n_fold < 2) {   /* a folded layer clears another's sums */
        memset(s->fold, 0, (size_t)n_layer);
        s->n_fold = 0;
        return 0;
    }
    const size_t bytes = (size_t)n_layer * (size_t)c->dim * sizeof(int64_t);
    void *zeros = calloc(1, bytes);
    if (zeros == NULL) return qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
    int rc = buf_alloc(be, bytes, &s->fold_sums, err);
    if (rc == 0 && be->ops->upload(be, s->fold_sums, zeros, bytes) < 0) rc = qc_fail(err, be->err.kind, "%s", be->err.msg);
    free(zeros);
    return rc;
}

static int64_t *fold_sum(const qc_session *s, int l) { return s->fold_sums + (size_t)l * (size_t)s->m->cfg.dim; }

/* The folded layer before l, cyclically (qc_session's fold). */
static int fold_before(const qc_session *s, int l) {
    const int n_layer = (int)s->m->cfg.n_layer;
    for (int k = 1; k < n_layer; k++)
        if (s->fold[(l - k + n_layer) % n_layer]) return (l - k + n_layer) % n_layer;
    return l;   /* unreachable: n_fold >= 2 */
}

int qc_session_create(qc_model *m, int max_ctx, int kv_type, qc_session **out, qc_error *err) {
    qc_session *s = NULL;
    const qc_config *c = &m->cfg;
    const size_t kv_dim = (size_t)(c->n_head_kv * c->head_dim);
    *out = NULL;
    if (max_ctx < 1) return qc_fail(err, QC_ERR_VALUE, "max_context must be >= 1, got %d", max_ctx);
    if (kv_type != QC_KV_F32 && kv_type != QC_KV_F16)
        return qc_fail(err, QC_ERR_VALUE, "unknown KV cache type %d", kv_type);
    s = calloc(1, sizeof *s);
    if (s == NULL) return qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
    s->m = m;
    s->be = m->be;
    s->max_ctx = max_ctx;
    s->kv_type = kv_type;
    s->chunk = QC_DEFAULT_CHUNK;
    /* QWENCUDA_NO_GRAPHS=1 runs every decode step op by op (to measure or to debug replay) */
    const char *no_graphs = getenv("QWENCUDA_NO_GRAPHS");
    s->no_graphs = no_graphs && *no_graphs && strcmp(no_graphs, "0") != 0;
    /* QWENCUDA_NO_FUSION=1 runs the unfused op sequences everywhere (to measure the fused ops) */
    const char *no_fusion = getenv("QWENCUDA_NO_FUSION");
    s->no_fusion = no_fusion && *no_fusion && strcmp(no_fusion, "0") != 0;
    /* QWENCUDA_DECODE=persistent records a decode step as the backend's one-launch decode_step
     * (CUDA's persistent kernel) where it serves the model. The op-by-op step stays the
     * default: on an H100 it decodes the 0.5B shapes faster (bench/results, 20261123-*-persistent) */
    const char *decode = getenv("QWENCUDA_DECODE");
    s->persistent_decode = decode && strcmp(decode, "persistent") == 0;
    /* QWENCUDA_DECODE_AHEAD=0: no decode step is queued before the last one's draw is seen (to
     * measure what running ahead gains) */
    const char *ahead = getenv("QWENCUDA_DECODE_AHEAD");
    s->no_ahead = ahead && strcmp(ahead, "0") == 0;
    /* QWENCUDA_NORM_AFTER=0: the o projection is not told the feed-forward norm (matmul_add's
     * norm_next), so the gate/up op normalises x itself, with rmsnorm's bits (to compare) */
    const char *norm_after = getenv("QWENCUDA_NORM_AFTER");
    s->no_norm_next = norm_after && strcmp(norm_after, "0") == 0;
    s->last_path = NULL;
    s->dec_takes[0] = s->dec_takes[1] = -1;
    s->kv = calloc((size_t)c->n_layer, sizeof *s->kv);
    s->dec_layers = calloc((size_t)c->n_layer, sizeof *s->dec_layers);
    s->slot = malloc(n_names(s) * sizeof *s->slot);
    s->patched = malloc(n_names(s));
    s->slots_marked = 1;   /* the first eval clears them */
    if (s->kv == NULL || s->slot == NULL || s->patched == NULL || s->dec_layers == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "session: out of memory");
        goto fail;
    }
    const size_t cache_bytes = (size_t)max_ctx * kv_dim * qc_kv_type_size(kv_type);
    for (int64_t l = 0; l < c->n_layer; l++) {
        s->kv[l].type = kv_type;
        if (buf_alloc(s->be, cache_bytes, &s->kv[l].k, err) < 0 ||
            buf_alloc(s->be, cache_bytes, &s->kv[l].v, err) < 0) {
            qc_error why = *err;
            qc_fail(err, why.kind, "KV cache of %d positions (%.2f GiB): %s", max_ctx,
                    gib(2 * cache_bytes * (size_t)c->n_layer), why.msg);
            goto fail;
        }
    }
    decode_plan_build(s);
    if (fold_plan(s, err) < 0) goto fail;
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
    for (int64_t l = 0; s->kv && l < s->m->cfg.n_layer; l++) {
        buf_free(be, &s->kv[l].k);
        buf_free(be, &s->kv[l].v);
    }
    scratch_free(be, &s->sc);
    attn_rows_free(be, &s->ar);
    buf_free(be, &s->logits);
    buf_free(be, &s->amax);
    buf_free(be, &s->sample_state);
    buf_free(be, &s->sample_work);
    buf_free(be, &s->sample_result);
    free(s->ahead.state);
    free(s->host_pos);
    free(s->kv);
    free(s->dec_layers);
    free(s->slot);
    free(s->patched);
    buf_free(be, &s->fold_sums);
    free(s->fold);
    free(s);
}

int qc_session_position(const qc_session *s) { return s->pos; }
const char *qc_session_last_path(const qc_session *s) { return s->last_path; }
int qc_session_ran_ahead(const qc_session *s) { return s->ran_ahead; }
int qc_session_max_context(const qc_session *s) { return s->max_ctx; }
int qc_session_kv_type(const qc_session *s) { return s->kv_type; }
void qc_session_reset(qc_session *s) { s->pos = 0; }
int qc_session_chunk(const qc_session *s) { return s->chunk; }

int qc_session_set_chunk(qc_session *s, int chunk, qc_error *err) {
    if (chunk < 1) return qc_fail(err, QC_ERR_VALUE, "prefill chunk must be >= 1 token, got %d", chunk);
    s->chunk = chunk;
    return 0;
}

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

#define OP(call) do { if ((call) < 0) goto backend_fail; } while (0)
#define CAPTURE(call) do { if ((call) < 0) goto fail; } while (0)

/* attn_scores / attn_probs of layer l for the captured query rows among this chunk's tokens
 * [c0, c0 + nc): their q (after RoPE) and positions are gathered, the exact attention over
 * the cache's first n_kv keys gives scores and probabilities in blocks of rows, and each block
 * lands in its capture rows, padded to the eval's keys (-inf and 0: masked). */
static int capture_attention(qc_session *s, const eval_plan *p, int l, int c0, int nc, int n_kv,
                             qc_error *err) {
    const qc_config *c = &s->m->cfg;
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    const qc_eval_request *req = p->req;
    const int n_head = (int)c->n_head, q_dim = (int)(c->n_head * c->head_dim);
    const int s_slot = layer_slot(s, l, L_ATTN_SCORES), p_slot = layer_slot(s, l, L_ATTN_PROBS);
    float *host = NULL;
    int rc = -1;
    /* the capture rows [k0, k1) that fall in this chunk */
    int k0 = c0, k1 = c0 + nc;
    if (req->attn_rows) {
        k0 = 0;
        while (k0 < req->n_attn_rows && req->attn_rows[k0] < c0) k0++;
        k1 = k0;
        while (k1 < req->n_attn_rows && req->attn_rows[k1] < c0 + nc) k1++;
    }
    if (k1 <= k0) return 0;
    size_t per_row = (size_t)n_head * (size_t)n_kv * sizeof(float);
    int block = (int)(QC_SCORE_BLOCK_BYTES / per_row);
    if (block < 1) block = 1;
    if (block > k1 - k0) block = k1 - k0;
    if (ensure_attn_rows(s, block, n_kv, err) < 0) return -1;
    /* host captures go through a host block; device captures never leave the device */
    if (!req->capture_device && (host = malloc((size_t)block * per_row)) == NULL)
        return qc_fail(err, QC_ERR_NOMEM, "capture of attention rows: out of memory");
    int32_t pos_rows[64];
    for (int b0 = k0; b0 < k1; b0 += block) {
        const int nb = k1 - b0 < block ? k1 - b0 : block;
        /* gather q rows (runs of consecutive tokens in one copy) and upload their positions */
        for (int i = 0; i < nb;) {
            const int tok = req->attn_rows ? req->attn_rows[b0 + i] : b0 + i;
            int run = 1;
            while (i + run < nb && (req->attn_rows ? req->attn_rows[b0 + i + run] : b0 + i + run) == tok + run) run++;
            OP(op->copy(be, s->ar.q + (size_t)i * q_dim, s->sc.q + (size_t)(tok - c0) * q_dim,
                        (size_t)run * q_dim * sizeof(float)));
            i += run;
        }
        for (int i0 = 0; i0 < nb; i0 += 64) {
            const int m = nb - i0 < 64 ? nb - i0 : 64;
            for (int i = 0; i < m; i++)
                pos_rows[i] = p->start + (req->attn_rows ? req->attn_rows[b0 + i0 + i] : b0 + i0 + i);
            OP(op->upload(be, s->ar.pos + i0, pos_rows, (size_t)m * sizeof(int32_t)));
        }
        OP(op->attention(be, s->ar.q, s->kv[l], s->ar.pos, nb, n_kv, n_head, (int)c->n_head_kv,
                         (int)c->head_dim, s->ar.out, s->ar.scores, s->ar.probs));
        /* (n_head, nb, n_kv) on the backend -> rows b0.. of (n_head, n_attn_q, p->n_kv) */
        for (int which = 0; which < 2; which++) {
            const int slot = which ? p_slot : s_slot;
            if (slot < 0) continue;
            const float pad = which ? 0.0f : -INFINITY;
            if (req->capture_device) {
                if (attn_rows_to_device(s, p, p->res->capture.items[slot].data, which ? s->ar.probs : s->ar.scores,
                                        b0, nb, n_kv, pad, err) < 0)
                    goto done;
                continue;
            }
            OP(op->download(be, host, which ? s->ar.probs : s->ar.scores, (size_t)nb * per_row));
            float *dst = p->res->capture.items[slot].data;
            for (int h = 0; h < n_head; h++) {
                for (int i = 0; i < nb; i++) {
                    float *row = dst + ((size_t)h * (size_t)p->n_attn_q + (size_t)(b0 + i)) * (size_t)p->n_kv;
                    memcpy(row, host + ((size_t)h * nb + i) * (size_t)n_kv, (size_t)n_kv * sizeof(float));
                    for (int j = n_kv; j < p->n_kv; j++) row[j] = pad;
                }
            }
        }
    }
    rc = 0;
    goto done;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
done:
    free(host);
    return rc;
}

/* attn_scores / attn_probs of layer l patched (a patched eval is one chunk: rows 0 .. nc - 1):
 * the exact attention gives every row's scores and probabilities; the patch function changes
 * them (the probabilities of patched scores are their softmax, as the reference computes it);
 * they are captured as patched; and each row's attention output is recomputed on the host from
 * the probabilities and the cache's values (float values, double sums) and uploaded over the
 * one the attention op wrote. O(n_head * n * n_kv) host work: patch experiments are short. */
static int patch_attention(qc_session *s, const eval_plan *p, int l, int nc, int n_kv, qc_error *err) {
    const qc_config *c = &s->m->cfg;
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    const qc_kv_cache cache = s->kv[l];
    const int n_head = (int)c->n_head, hd = (int)c->head_dim, group = (int)(c->n_head / c->n_head_kv);
    const size_t q_dim = (size_t)n_head * hd, kv_dim = (size_t)c->n_head_kv * hd;
    const size_t i_scores = layer_index(s, l, L_ATTN_SCORES), i_probs = layer_index(s, l, L_ATTN_PROBS);
    const size_t count = (size_t)n_head * (size_t)nc * (size_t)n_kv, esize = qc_kv_type_size(cache.type);
    float *S = malloc(count * sizeof *S), *P = malloc(count * sizeof *P);
    float *V = malloc((size_t)n_kv * kv_dim * sizeof *V), *att = malloc((size_t)nc * q_dim * sizeof *att);
    void *raw = malloc((size_t)n_kv * kv_dim * esize);
    int rc = -1;
    if (S == NULL || P == NULL || V == NULL || att == NULL || raw == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "patch of blk.%d attention: out of memory", l);
        goto done;
    }
    if (ensure_attn_rows(s, nc, n_kv, err) < 0) goto done;
    OP(op->attention(be, s->sc.q, cache, s->sc.pos, nc, n_kv, n_head, (int)c->n_head_kv, hd, s->ar.out,
                     s->ar.scores, s->ar.probs));
    OP(op->download(be, S, s->ar.scores, count * sizeof *S));
    if (s->patched[i_scores]) {
        if (patch_host(s, p, i_scores, S, err) < 0) goto done;
        for (size_t r = 0; r < count; r += (size_t)n_kv) {   /* softmax of each patched row */
            double most = -INFINITY, sum = 0.0;
            for (int j = 0; j < n_kv; j++) most = S[r + j] > most ? S[r + j] : most;
            for (int j = 0; j < n_kv; j++) sum += exp((double)S[r + j] - most);
            for (int j = 0; j < n_kv; j++) P[r + j] = (float)(exp((double)S[r + j] - most) / sum);
        }
    } else {
        OP(op->download(be, P, s->ar.probs, count * sizeof *P));
    }
    if (s->patched[i_probs] && patch_host(s, p, i_probs, P, err) < 0) goto done;
    /* (computed on the host: a device capture receives an upload) */
    if (capture_host(s, p, s->slot[i_scores], S, count * sizeof *S, err) < 0 ||
        capture_host(s, p, s->slot[i_probs], P, count * sizeof *P, err) < 0)
        goto done;
    /* att[t][h][:] = sum_j P[h][t][j] * v[j][h / group][:] */
    OP(op->download(be, raw, cache.v, (size_t)n_kv * kv_dim * esize));
    for (size_t e = 0; e < (size_t)n_kv * kv_dim; e++)
        V[e] = cache.type == QC_KV_F16 ? qc_fp16_to_fp32(((const uint16_t *)raw)[e]) : ((const float *)raw)[e];
    for (int h = 0; h < n_head; h++) {
        const float *vh = V + (size_t)(h / group) * hd;
        for (int t = 0; t < nc; t++) {
            const float *pr = P + ((size_t)h * nc + t) * (size_t)n_kv;
            for (int d = 0; d < hd; d++) {
                double acc = 0.0;
                for (int j = 0; j < n_kv; j++) acc += (double)pr[j] * vh[(size_t)j * kv_dim + d];
                att[(size_t)t * q_dim + (size_t)h * hd + d] = (float)acc;
            }
        }
    }
    OP(op->upload(be, s->sc.att, att, (size_t)nc * q_dim * sizeof *att));
    rc = 0;
    goto done;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
done:
    free(S);
    free(P);
    free(V);
    free(att);
    free(raw);
    return rc;
}

/* One transformer block over this chunk's nc tokens (eval rows c0..): x += attention(norm(x));
 * x += ffn(norm(x)). The KV cache holds keys 0 .. n_kv - 1 afterwards. */
static int layer_forward(qc_session *s, const eval_plan *p, int l, int c0, int nc, int n_kv,
                         qc_error *err) {
    const qc_model *m = s->m;
    const qc_config *c = &m->cfg;
    const qc_layer *L = &m->layers[l];
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    qc_scratch *sc = &s->sc;
    const int dim = (int)c->dim, ffn = (int)c->ffn_dim, hd = (int)c->head_dim;
    const int n_head = (int)c->n_head, n_head_kv = (int)c->n_head_kv;
    const int q_dim = n_head * hd, kv_dim = n_head_kv * hd;
    const float eps = c->norm_eps;
    /* A fused op runs unless this eval captures an intermediate that it never writes: the norms'
     * outputs, q and k before RoPE, attn_proj, gate and up, ffn_out. Everything else the fused
     * ops leave in the same buffers as the unfused ones, so its capture is unchanged. */
    const int fuse = !s->no_fusion;
    const int fuse_attn_norm = fuse && !layer_wants(s, l, L_ATTN_NORM);
    /* (a patched v or k_rope must reach the cache, which the fused op writes before either is
     * seen) */
    const int fuse_rope = fuse && !layer_wants(s, l, L_Q) && !layer_wants(s, l, L_K) &&
                          !layer_patched(s, l, L_V) && !layer_patched(s, l, L_K_ROPE);
    /* (and the attention with them, unless a patched q must reach it) */
    const int fuse_attention = fuse_rope && !layer_patched(s, l, L_Q_ROPE);
    const int fuse_o = fuse && !layer_wants(s, l, L_ATTN_PROJ);
    const int fuse_gate_up = fuse && !layer_wants(s, l, L_GATE) && !layer_wants(s, l, L_UP);
    const int fuse_ffn_norm = fuse_gate_up && !layer_wants(s, l, L_FFN_NORM);
    const int fuse_down = fuse && !layer_wants(s, l, L_FFN_OUT);
    /* the layer before folded its down projection (below): its output is sums that the attention
     * op adds to x, leaving x + them in y for the o projection's residual */
    const int64_t *x_sum = p->fold_down && l > 0 && s->fold[l - 1] ? fold_sum(s, l - 1) : NULL;
    if (x_sum && !(fuse_attention && fuse_attn_norm && fuse_o)) {
        qc_fail(err, QC_ERR_VALUE, "layer %d: a folded step must fuse its attention", l);   /* (fold_down: never) */
        goto fail;
    }

    /* attention RMSNorm: xn = x / rms(x) * attn_norm (folded into q/k/v when fused) */
    if (!fuse_attn_norm) {
        OP(op->rmsnorm(be, sc->x, L->attn_norm, nc, dim, eps, sc->xn));
        CAPTURE(observe_layer(s, p, l, L_ATTN_NORM, sc->xn, c0, nc, dim, err));
    }

    /* q, k, v = xn @ W^T + b (Qwen2's biases are large: never drop them); then RoPE, NEOX pairs
     * (i, i + head_dim/2), on q and k at their positions, and the rotated k and the v of these
     * tokens into the cache at their positions. Fused, that is one op (which writes the cache
     * before any capture is seen), and with the attention below one op too (its captures of q,
     * k and v see the same buffers) */
    const qc_matmul_part qkv[3] = {{&L->wq, L->bq, sc->q}, {&L->wk, L->bk, sc->k}, {&L->wv, L->bv, sc->v}};
    const float *qkv_x = fuse_attn_norm ? sc->x : sc->xn, *qkv_norm = fuse_attn_norm ? L->attn_norm : NULL;
    if (fuse_rope) {
        OP(fuse_attention ? op->qkv_attention(be, qkv, qkv_x, nc, qkv_norm, eps, sc->pos, n_kv, n_head, n_head_kv, hd,
                                              c->rope_theta, s->kv[l], sc->att, x_sum, sc->y)
                          : op->matmul_qkv_rope(be, qkv, qkv_x, nc, qkv_norm, eps, sc->pos, n_head, n_head_kv, hd,
                                                c->rope_theta, s->kv[l]));
        CAPTURE(observe_layer(s, p, l, L_V, sc->v, c0, nc, kv_dim, err));
        CAPTURE(observe_layer(s, p, l, L_Q_ROPE, sc->q, c0, nc, q_dim, err));
        CAPTURE(observe_layer(s, p, l, L_K_ROPE, sc->k, c0, nc, kv_dim, err));
    } else {
        if (fuse) {
            OP(op->matmul_multi(be, qkv, 3, qkv_x, nc, qkv_norm, eps));
        } else {
            OP(op->matmul(be, &L->wq, L->bq, sc->xn, nc, sc->q));
            OP(op->matmul(be, &L->wk, L->bk, sc->xn, nc, sc->k));
            OP(op->matmul(be, &L->wv, L->bv, sc->xn, nc, sc->v));
        }
        CAPTURE(observe_layer(s, p, l, L_Q, sc->q, c0, nc, q_dim, err));
        CAPTURE(observe_layer(s, p, l, L_K, sc->k, c0, nc, kv_dim, err));
        CAPTURE(observe_layer(s, p, l, L_V, sc->v, c0, nc, kv_dim, err));
        OP(op->rope(be, sc->q, sc->pos, nc, n_head, hd, c->rope_theta));
        OP(op->rope(be, sc->k, sc->pos, nc, n_head_kv, hd, c->rope_theta));
        CAPTURE(observe_layer(s, p, l, L_Q_ROPE, sc->q, c0, nc, q_dim, err));
        CAPTURE(observe_layer(s, p, l, L_K_ROPE, sc->k, c0, nc, kv_dim, err));
        OP(op->kv_store(be, sc->k, sc->v, sc->pos, nc, kv_dim, s->kv[l]));
    }

    /* causal GQA attention: query head h reads KV head h / (n_head / n_head_kv), keys 0..pos */
    if (!fuse_attention)
        OP(op->attention(be, sc->q, s->kv[l], sc->pos, nc, n_kv, n_head, n_head_kv, hd, sc->att, NULL, NULL));
    if (layer_patched(s, l, L_ATTN_SCORES) || layer_patched(s, l, L_ATTN_PROBS))
        CAPTURE(patch_attention(s, p, l, nc, n_kv, err));
    else if (layer_wants(s, l, L_ATTN_SCORES) || layer_wants(s, l, L_ATTN_PROBS))
        CAPTURE(capture_attention(s, p, l, c0, nc, n_kv, err));
    CAPTURE(observe_layer(s, p, l, L_ATTN_OUT, sc->att, c0, nc, q_dim, err));

    /* output projection (no bias) and the residual: x = x + att @ Wo^T; att comes straight from
     * the attention op unless its scores were captured (another attention ran since) or a patch
     * replaced it */
    if (fuse_o) {
        const int att_from_last_op = !layer_wants(s, l, L_ATTN_SCORES) && !layer_wants(s, l, L_ATTN_PROBS) &&
                                     !layer_patched(s, l, L_ATTN_OUT);
        /* while it waits for att, the projection's blocks ask the cache for gate and up (a hint) */
        if (op->read_ahead) {
            /* (and, folded, the down projection: the gate/up op reads it) */
            const qc_weight *const ahead[3] = {&L->w_gate, &L->w_up, &L->w_down};
            OP(op->read_ahead(be, ahead, p->fold_down && s->fold[l] ? 3 : 2));
        }
        /* and the feed-forward norm, which the gate/up op applies to x next: a backend may
         * leave x's normalised 8-bit form for it (unless a patch of resid_mid comes between) */
        const float *norm_next =
            fuse_ffn_norm && !s->no_norm_next && !layer_patched(s, l, L_RESID_MID) ? L->ffn_norm : NULL;
        OP(op->matmul_add(be, &L->wo, sc->att, nc, x_sum ? sc->y : sc->x, sc->x, att_from_last_op, norm_next));
    } else {
        OP(op->matmul(be, &L->wo, NULL, sc->att, nc, sc->y));
        CAPTURE(observe_layer(s, p, l, L_ATTN_PROJ, sc->y, c0, nc, dim, err));
        OP(op->add(be, sc->x, sc->y, (int64_t)nc * dim, sc->x));
    }
    CAPTURE(observe_layer(s, p, l, L_RESID_MID, sc->x, c0, nc, dim, err));

    /* feed-forward RMSNorm (folded into gate/up when fused) */
    if (!fuse_ffn_norm) {
        OP(op->rmsnorm(be, sc->x, L->ffn_norm, nc, dim, eps, sc->xn));
        CAPTURE(observe_layer(s, p, l, L_FFN_NORM, sc->xn, c0, nc, dim, err));
    }

    /* folded (a decode step that captures nothing): gate, up, act and the down projection in one
     * op, whose output, sums, the next layer's attention op adds to x (x_sum above) */
    if (p->fold_down && s->fold[l]) {
        if (op->read_ahead && l + 1 < (int)c->n_layer) {
            const qc_layer *next = &m->layers[l + 1];
            const qc_weight *const ahead[3] = {&next->wq, &next->wk, &next->wv};
            OP(op->read_ahead(be, ahead, 3));
        }
        const int rc = op->swiglu_down(be, &L->w_gate, &L->w_up, &L->w_down, sc->x, L->ffn_norm, eps, sc->act,
                                       fold_sum(s, l), fold_sum(s, fold_before(s, l)));
        if (rc < 0) goto backend_fail;
        if (rc == 0) {
            qc_fail(err, QC_ERR_VALUE, "layer %d: swiglu_down declined the weights it took at creation", l);
            goto fail;
        }
        return 0;   /* (nothing to capture in a folded step) */
    }

    /* gate and up projections, act = silu(gate) * up */
    if (fuse_gate_up) {
        OP(fuse_ffn_norm ? op->matmul_swiglu(be, &L->w_gate, &L->w_up, sc->x, nc, L->ffn_norm, eps, sc->act)
                         : op->matmul_swiglu(be, &L->w_gate, &L->w_up, sc->xn, nc, NULL, 0.0f, sc->act));
    } else {
        OP(op->matmul(be, &L->w_gate, NULL, sc->xn, nc, sc->gate));
        OP(op->matmul(be, &L->w_up, NULL, sc->xn, nc, sc->up));
        CAPTURE(observe_layer(s, p, l, L_GATE, sc->gate, c0, nc, ffn, err));
        CAPTURE(observe_layer(s, p, l, L_UP, sc->up, c0, nc, ffn, err));
        OP(op->swiglu(be, sc->gate, sc->up, (int64_t)nc * ffn, sc->act));
    }
    CAPTURE(observe_layer(s, p, l, L_FFN_ACT, sc->act, c0, nc, ffn, err));

    /* down projection and the residual: x = x + act @ Wdown^T; act comes straight from the fused
     * gate/up op unless a patch replaced it */
    if (fuse_down) {
        const int act_from_last_op = fuse_gate_up && !layer_patched(s, l, L_FFN_ACT);
        /* while it waits for act, the projection's blocks ask the cache for the next layer's q,
         * k and v (a hint): that layer's first kernel then need not ask for them itself, late */
        if (op->read_ahead && l + 1 < (int)c->n_layer) {
            const qc_layer *next = &m->layers[l + 1];
            const qc_weight *const ahead[3] = {&next->wq, &next->wk, &next->wv};
            OP(op->read_ahead(be, ahead, 3));
        }
        OP(op->matmul_add(be, &L->w_down, sc->act, nc, sc->x, sc->x, act_from_last_op, NULL));
    } else {
        OP(op->matmul(be, &L->w_down, NULL, sc->act, nc, sc->y));
        CAPTURE(observe_layer(s, p, l, L_FFN_OUT, sc->y, c0, nc, dim, err));
        OP(op->add(be, sc->x, sc->y, (int64_t)nc * dim, sc->x));
    }
    CAPTURE(observe_layer(s, p, l, L_RESID_OUT, sc->x, c0, nc, dim, err));
    return 0;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
fail:
    return -1;
}

/* The sums that the last layer's folded down projection left for the head (x is then x + them),
 * or NULL where the last layer did not fold in this eval. */
static const int64_t *head_sum(const qc_session *s, const eval_plan *p) {
    const int last = (int)s->m->cfg.n_layer - 1;
    return p->fold_down && !p->one_launch && s->fold[last] ? fold_sum(s, last) : NULL;
}

/* The output norm, the lm_head, the argmax and the draw over this chunk's rows that the eval
 * hands back: every row with all_logits, else the eval's last token (in its last chunk). The
 * lm_head runs QC_HEAD_ROWS rows at a time; logits and argmax go straight to the caller. */
static int head_forward(qc_session *s, const eval_plan *p, int c0, int nc, qc_error *err) {
    const qc_model *m = s->m;
    const qc_config *c = &m->cfg;
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    qc_scratch *sc = &s->sc;
    const qc_eval_request *req = p->req;
    const int dim = (int)c->dim, last_chunk = c0 + nc == p->n;
    const int64_t vocab = c->n_vocab;
    const int want_norm = s->slot[CAP_OUTPUT_NORM] >= 0 || s->patched[CAP_OUTPUT_NORM];
    /* lm_head rows of this chunk: [r0, nc) in chunk rows; out_row0: their first row out */
    const int r0 = req->all_logits ? 0 : (last_chunk ? nc - 1 : nc);
    const int out_row0 = req->all_logits ? c0 : 0;

    /* the last layer folded its down projection: x + its sums is the residual stream (one token) */
    const int64_t *x_sum = head_sum(s, p);

    /* a greedy draw from the one lm_head row may be the lm_head's own, with the output norm
     * folded in (matmul_draw; drawn: it also fed the step after), and the sums */
    int drawn = 0;
    if (!p->one_launch && p->head_draw && last_chunk && nc - r0 == 1 && !want_norm)
        OP(drawn = op->matmul_draw(be, &m->output, sc->x + (size_t)r0 * dim, x_sum, m->output_norm, c->norm_eps,
                                   s->logits, s->sample_state, s->sample_result, p->feeds ? sc->ids : NULL,
                                   p->feeds ? sc->pos : NULL));
    s->head_draw_fed = drawn == 2 && p->feeds;   /* its draw reaches the host by draw_ticket */
    if (x_sum && !drawn) OP(op->sum_add(be, sc->x, x_sum, dim, sc->x));

    /* output RMSNorm: every row when all are needed, else the lm_head's (decode_step ran both) */
    const int first = want_norm ? 0 : r0;
    if (first < nc && !p->one_launch && !drawn)
        OP(op->rmsnorm(be, sc->x + (size_t)first * dim, m->output_norm, nc - first, dim, c->norm_eps,
                       sc->xn + (size_t)first * dim));
    CAPTURE(observe(s, p, CAP_OUTPUT_NORM, sc->xn, c0, nc, dim, err));

    for (int b = r0; b < nc; b += p->head_block) {
        const int rows = nc - b < p->head_block ? nc - b : p->head_block;
        const int out_row = out_row0 + (b - r0);
        /* the eval's draw is from this block's last row */
        const int draws = p->do_sample && last_chunk && b + rows == nc;
        /* lm_head: logits = xn @ output^T (output.weight, or token_embd when tied) */
        if (!p->one_launch && !drawn) OP(op->matmul(be, &m->output, NULL, sc->xn + (size_t)b * dim, rows, s->logits));
        CAPTURE(observe(s, p, CAP_LOGITS, s->logits, out_row, rows, vocab, err));
        /* argmax: the first largest logit of each row */
        if (p->do_argmax) {
            OP(op->argmax(be, s->logits, rows, vocab, s->amax));
            CAPTURE(capture_rows(s, p, s->slot[CAP_ARGMAX], s->amax, out_row, rows, 1, err));
        }
        /* a draw from the eval's last row, by the sampler state uploaded for this eval; a step of
         * a pipelined loop ends by feeding it to the next (qc_ahead) */
        if (draws && !drawn) {
            OP(op->sample(be, s->logits + (size_t)(rows - 1) * (size_t)vocab, vocab, s->sample_state,
                          s->sample_work, s->sample_result));
            if (p->feeds) OP(op->feed_draw(be, s->sample_result, s->sample_state, sc->ids, sc->pos, vocab));
        }
        /* to the caller, unless this is the recorded decode step (downloaded after its replay) */
        if (p->res->logits && !p->defer_download) {
            OP(op->download(be, p->res->logits + (size_t)out_row * (size_t)vocab, s->logits,
                            (size_t)rows * (size_t)vocab * sizeof(float)));
            OP(op->download(be, p->res->argmax + out_row, s->amax, (size_t)rows * sizeof(int32_t)));
        }
    }
    return 0;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
fail:
    return -1;
}

/* The forward pass over the eval's tokens [c0, c0 + nc): embedding, every layer, the head. It
 * only reads and writes backend memory (and copies captured tensors out), so that a decode step
 * can be recorded once and replayed. */
static int forward_chunk(qc_session *s, const eval_plan *p, int c0, int nc, qc_error *err) {
    const qc_model *m = s->m;
    qc_backend *be = s->be;
    qc_scratch *sc = &s->sc;
    const int n_kv = p->start + c0 + nc;   /* keys visible to this chunk's last token */

    /* embed: x = token_embd[ids] */
    OP(be->ops->embed(be, &m->tok_embd, sc->ids, nc, sc->x));
    CAPTURE(observe(s, p, CAP_EMBED, sc->x, c0, nc, m->cfg.dim, err));
    if (p->one_launch) {
        /* every layer, the output norm and the lm_head of this one token, in one launch */
        OP(be->ops->decode_step(be, &s->dec));
    } else {
        for (int l = 0; l < (int)m->cfg.n_layer; l++)
            CAPTURE(layer_forward(s, p, l, c0, nc, n_kv, err));
    }
    if (p->want_head) CAPTURE(head_forward(s, p, c0, nc, err));
    return 0;
backend_fail:
    qc_fail(err, be->err.kind, "%s", be->err.msg);
fail:
    return -1;
}

/* Token ids and positions of the chunk [c0, c0 + nc) to the backend. */
static int upload_chunk(qc_session *s, const eval_plan *p, int c0, int nc, qc_error *err) {
    qc_backend *be = s->be;
    for (int t = 0; t < nc; t++) s->host_pos[t] = p->start + c0 + t;
    if (be->ops->upload(be, s->sc.ids, p->req->ids + c0, (size_t)nc * sizeof(int32_t)) < 0 ||
        be->ops->upload(be, s->sc.pos, s->host_pos, (size_t)nc * sizeof(int32_t)) < 0)
        return qc_fail(err, be->err.kind, "%s", be->err.msg);
    return 0;
}

/* The recording a replayed one-token step over n_kv keys uses:
 * decode_rec[qc_kv_bucket(n_kv)][rec_kind]: 0 the argmax, 1 a draw, 2 both, 3 the lm_head's
 * draw (it is recorded for greedy states only: a replay reads the state uploaded before it). */
static int rec_kind(const eval_plan *p) {
    if (!p->do_sample) return 0;
    return p->do_argmax ? 2 : p->head_draw ? 3 : 1;
}

/* Whether a replayed step (p) is a pipelined one (qc_ahead): it draws on the backend and hands
 * back nothing else (its recording, kind 1 or 3, is only ever used so), on a backend that can
 * feed the draw to the next step. */
static int ahead_feeds(const qc_session *s, const eval_plan *p) {
    return p->do_sample && !p->req->want_logits && !p->do_argmax && s->be->ops->feed_draw && !s->no_ahead;
}

/* A decode step (one token, nothing captured) on a backend that can record: the ops are recorded
 * once per slot and the recording is replayed at every later step, one launch instead of
 * hundreds. Only the uploaded id, position and sampler state differ between replays. Returns 1
 * when it ran the step, 0 when the step must run op by op. */
static int decode_replayed(qc_session *s, const eval_plan *p, qc_error *err) {
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    void **slot = &s->decode_rec[qc_kv_bucket(p->n_kv)][rec_kind(p)];
    if (*slot == NULL) {
        void *rec = NULL;
        if (op->record_begin(be) < 0) {
            s->record_failed = 1;
            return 0;
        }
        /* (a step of a pipelined loop ends by feeding its draw to the next: p->feeds) */
        s->head_draw_fed = 0;
        const int ran = forward_chunk(s, p, 0, 1, err);
        if (op->record_end(be, &rec) < 0 || ran < 0) {
            /* not recordable on this backend after all: op by op from now on, unless the step
             * fails op by op too (then the eval's own error, not the recording, was at fault) */
            op->recording_free(be, rec);
            s->record_failed = 1;
            return 0;
        }
        *slot = rec;
        s->rec_draw_fed[qc_kv_bucket(p->n_kv)][rec_kind(p)] = (unsigned char)s->head_draw_fed;
    }
    if (op->replay(be, *slot) < 0) return qc_fail(err, be->err.kind, "%s", be->err.msg);
    return 1;
}

/* The wait for the draw of the step just queued (at position pos), a replay of the recording
 * decode_rec[bucket][kind]: draw_ticket where its matmul_draw fed the next step (the draw is in
 * the backend's host memory already), else download_start's copy. */
static int draw_download_start(qc_session *s, int bucket, int kind, int pos, int *ticket) {
    qc_backend *be = s->be;
    if (s->rec_draw_fed[bucket][kind] && be->ops->draw_ticket)
        return be->ops->draw_ticket(be, s->sample_result, pos, ticket);
    return be->ops->download_start(be, s->sample_result, sizeof(qc_sample_result), ticket);
}

/* Whether this pipelined eval is the one the last pipelined eval expected (qc_ahead); both
 * replay the recording of kind 1, and the position fixes the bucket of their keys. */
static int ahead_met(const qc_session *s, const eval_plan *p, const qc_eval_request *req, size_t sample_bytes) {
    const qc_ahead *a = &s->ahead;
    return a->valid && p->start == a->pos && req->ids[0] == a->token && sample_bytes == a->state_bytes &&
           memcmp(req->sample, a->state, sample_bytes) == 0;
}

/* What the eval after this pipelined one is expected to be: the drawn token at the next
 * position, and this sampler state with the draw's RNG. Nothing is
 * expected where there is no room in the context, or no memory for the state. */
static void ahead_expect(qc_session *s, const eval_plan *p, const qc_eval_request *req, size_t sample_bytes,
                         const qc_sample_result *drawn) {
    qc_ahead *a = &s->ahead;
    a->valid = 0;
    if (p->start + 1 >= s->max_ctx || drawn->token < 0) return;
    if (sample_bytes > a->state_cap) {
        void *bigger = realloc(a->state, sample_bytes);
        if (bigger == NULL) return;
        a->state = bigger;
        a->state_cap = sample_bytes;
    }
    memcpy(a->state, req->sample, sample_bytes);
    if (drawn->rng != 0) ((qc_sample_state *)a->state)->rng = drawn->rng;   /* qc_sampler_set_rng's rule */
    a->state_bytes = sample_bytes;
    a->pos = p->start + 1;
    a->token = drawn->token;
    a->valid = 1;
}

/* Queue the step after this one (p: a pipelined eval that met the expectation): its token,
 * position and RNG come from this step's draw on the device, where the recording's last op
 * (feed_draw) put them. Nothing is queued where that step would not be a replay of a recording
 * made already, or would pass the context. */
static int ahead_queue(qc_session *s, const eval_plan *p) {
    qc_backend *be = s->be;
    qc_ahead *a = &s->ahead;
    const int bucket = qc_kv_bucket(p->n_kv + 1);
    void *rec = s->decode_rec[bucket][rec_kind(p)];
    if (p->start + 1 >= s->max_ctx || rec == NULL) return 0;
    if (be->ops->replay(be, rec) < 0 || draw_download_start(s, bucket, rec_kind(p), p->start + 1, &a->ticket) < 0)
        return -1;
    a->queued = 1;
    return 0;
}

int qc_session_eval(qc_session *s, const qc_eval_request *req, qc_eval_result *res, qc_error *err) {
    const qc_config *c = &s->m->cfg;
    qc_backend *be = s->be;
    const qc_backend_ops *op = be->ops;
    eval_plan plan, *p = &plan;

    /* Everything that can be wrong with the request is checked before any work. */
    if (qc_session_check(s, req, err) < 0) return -1;
    plan_eval(s, req, res, p);
    if (capture_prepare(s, p, err) < 0) return -1;
    p->want_head = req->want_logits || p->do_sample || s->slot[CAP_OUTPUT_NORM] >= 0 ||
                   s->slot[CAP_LOGITS] >= 0 || s->slot[CAP_ARGMAX] >= 0;
    p->want_head = p->want_head || s->patched[CAP_OUTPUT_NORM] || s->patched[CAP_LOGITS];
    const int replayable = p->n == 1 && p->n_captured == 0 && p->n_patched == 0 && p->want_head && op->replay &&
                           !s->no_graphs && !s->record_failed;
    p->defer_download = replayable;
    p->fold_down = p->n == 1 && p->n_captured == 0 && p->n_patched == 0 && s->n_fold >= 2;
    p->do_argmax = (replayable && !p->do_sample) || req->want_logits || s->slot[CAP_ARGMAX] >= 0;
    p->head_draw = p->do_sample && !p->do_argmax && !s->patched[CAP_LOGITS] && op->matmul_draw &&
                   qc_sample_plain_greedy(req->sample);

    const size_t sample_bytes = p->do_sample ? sizeof *req->sample + (size_t)req->sample->n_history * sizeof(int32_t) : 0;
    /* a patch sees its whole tensor: one forward pass */
    const int chunk = p->n < s->chunk || p->n_patched ? p->n : s->chunk;
    if (ensure_rows(s, chunk, err) < 0) return -1;
    if (p->want_head && ensure_logit_rows(s, p->head_rows < p->head_block ? p->head_rows : p->head_block, err) < 0)
        return -1;
    if (p->do_sample && ensure_sampling(s, sample_bytes, err) < 0) return -1;
    /* a replayed step that draws on the backend and hands back only its draw: the step after it
     * may run ahead (qc_ahead); this one may be running already */
    const int pipelined = replayable && ahead_feeds(s, p);
    p->feeds = pipelined;
    const int met = pipelined && ahead_met(s, p, req, sample_bytes);
    const int queued = met && s->ahead.queued;
    s->ahead.queued = 0;
    s->ran_ahead = queued;
    /* the sampler's RNG and recent tokens, as this draw must see them (a step queued ahead
     * has them: met compared them) */
    if (p->do_sample && !queued && op->upload(be, s->sample_state, req->sample, sample_bytes) < 0) goto backend_fail;

    /* a decode step that the backend runs in one launch (CUDA's persistent kernel), recorded
     * and replayed like the op-by-op step */
    p->one_launch = 0;
    if (replayable && s->persistent_decode && op->decode_step) {
        int *takes = &s->dec_takes[qc_kv_bucket(p->n_kv)];
        decode_plan_buffers(s);
        if (*takes < 0) *takes = op->decode_step_takes(be, &s->dec, p->n_kv);
        p->one_launch = *takes;
    }
    s->last_path = "ops";
    int ticket = -1;   /* the draw's copy, when pipelined */
    if (queued) {   /* the recording of this bucket, replayed by the eval before */
        ticket = s->ahead.ticket;
        s->last_path = p->one_launch ? "persistent" : "graph";
    } else if (replayable) {
        if (upload_chunk(s, p, 0, 1, err) < 0) return -1;
        const int replayed = decode_replayed(s, p, err);
        if (replayed < 0) return -1;
        p->feeds = 0;   /* the step op by op, if not replayed: its inputs are uploaded next time */
        if (!replayed && forward_chunk(s, p, 0, 1, err) < 0) {
            s->record_failed = 0;   /* the step itself failed: a later one may record */
            return -1;
        }
        s->last_path = p->one_launch ? "persistent" : replayed ? "graph" : "ops";
        if (pipelined &&
            (replayed ? draw_download_start(s, qc_kv_bucket(p->n_kv), rec_kind(p), p->start, &ticket)
                      : op->download_start(be, s->sample_result, sizeof res->drawn, &ticket)) < 0)
            goto backend_fail;
        if (req->want_logits &&
            (op->download(be, res->logits, s->logits, (size_t)c->n_vocab * sizeof(float)) < 0 ||
             op->download(be, res->argmax, s->amax, sizeof(int32_t)) < 0))
            goto backend_fail;
    } else {
        for (int c0 = 0; c0 < p->n; c0 += chunk) {
            const int nc = p->n - c0 < chunk ? p->n - c0 : chunk;
            if (upload_chunk(s, p, c0, nc, err) < 0 || forward_chunk(s, p, c0, nc, err) < 0) return -1;
        }
    }

    /* the next step goes on the device before this one's draw is waited for */
    if (pipelined && met && ahead_queue(s, p) < 0) goto backend_fail;
    /* a download waits for the work before it; without one, wait here */
    if (pipelined) {
        if (op->download_finish(be, ticket, &res->drawn, sizeof res->drawn) < 0) goto backend_fail;
        ahead_expect(s, p, req, sample_bytes, &res->drawn);
    } else {
        s->ahead.valid = 0;
        if (p->do_sample && op->download(be, &res->drawn, s->sample_result, sizeof res->drawn) < 0) goto backend_fail;
    }
    if (!p->do_sample && !req->want_logits && op->synchronize(be) < 0) goto backend_fail;
    if (p->do_sample && res->drawn.token < 0) {   /* the eval stays undone: the position does not move */
        s->ahead.valid = s->ahead.queued = 0;
        return qc_fail(err, QC_ERR_VALUE, "no token can be sampled: every logit is NaN or -inf");
    }

    /* the tokens are in the cache now: the next eval starts after them */
    s->pos += p->n;
    return 0;
backend_fail:
    s->ahead.valid = s->ahead.queued = 0;
    qc_fail(err, be->err.kind, "%s", be->err.msg);
    return -1;
}
