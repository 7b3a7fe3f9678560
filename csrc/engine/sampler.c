/* sampler.c: pick the next token from a row of logits (the host implementation; the CUDA twin is
 * kernels/sample.cu, which follows this file step by step).
 *
 * The chain is llama.cpp's order: repetition penalty -> top-k -> top-p -> min-p -> temperature
 * -> draw. So top-p and min-p see the probabilities at temperature 1 and the temperature only
 * shapes the final draw among the survivors. temperature <= 0 is greedy: the first maximum of
 * the penalised logits, no randomness.
 *
 * Non-finite logits (documented behaviour): NaN counts as -inf (never chosen). If some logits are
 * +inf, the first of them is chosen. If every logit is NaN or -inf, sample returns -1 (the
 * Python layer raises ValueError).
 *
 * The draw walks the survivors in token-id order, whatever order the filters left them in, so
 * that an implementation that filters by thresholds (the GPU one) draws the same token from the
 * same uniform number.
 *
 * The RNG (xorshift64*, seeded through splitmix64) lives in the sampler: the same seed and the
 * same logits give the same tokens on every machine and on both backends (up to a uniform number
 * landing within rounding of a boundary between two tokens' cumulative weights).
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Logit buckets of the top-p filter: the boundary bucket, the only one sorted, stays small. */
#define QC_P_BUCKETS 4096

/* Scratch of one draw, carved out of the caller's work buffer (qc_sample_work_bytes). */
typedef struct {
    double *bucket_mass;      /* (QC_P_BUCKETS) top-p: probability mass per logit bucket */
    float *v;                 /* (n_vocab) logits after the penalty, NaN -> -inf */
    float *weight;            /* (n_vocab) exp((logit - max) / temperature) of the survivors */
    int32_t *cand;            /* (n_vocab) candidate ids */
    int32_t *heap;            /* (n_vocab) scratch for partial selection */
    int32_t *order;           /* (n_vocab) top-p: the candidates of the boundary bucket */
    unsigned char *seen;      /* (n_vocab) marks: distinct penalty tokens, survivors' id order */
} sample_work;

struct qc_sampler {
    qc_sampler_params p;
    int64_t n_vocab;
    uint64_t rng;             /* xorshift64* state, never 0 */
    int32_t *history;         /* (hist_cap) ring of accepted tokens */
    int hist_cap;             /* entries allocated: grows with the tokens accepted, up to
                               * repeat_last_n (a large repeat_last_n costs nothing up front) */
    int n_history;            /* entries filled, <= hist_cap */
    int head;                 /* next slot to write */
    qc_sample_state *state;   /* (qc_sampler_state_bytes) the next draw's state, exported */
    void *work;               /* (qc_sample_work_bytes) */
};

/* ---------------------------------------------------------------------------------------- */
/* RNG */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rng_next(uint64_t *state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* uniform in [0, 1), 53 bits */
static double rng_uniform(uint64_t *state) {
    return (double)(rng_next(state) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---------------------------------------------------------------------------------------- */
/* ordering: a before b when its logit is larger, the lower id first on ties */

static int better(const float *v, int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

static void sift_down(const float *v, int32_t *h, int64_t n, int64_t i) {
    /* min-heap on `better`: the root is the worst of the kept */
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && better(v, h[w], h[l])) w = l;
        if (r < n && better(v, h[w], h[r])) w = r;
        if (w == i) return;
        int32_t t = h[i]; h[i] = h[w]; h[w] = t;
        i = w;
    }
}

/* The best m of cand[0..n) into out[0..m), best first (m <= n). O(n log m). */
static void select_best(const float *v, const int32_t *cand, int64_t n, int64_t m, int32_t *heap,
                        int32_t *out) {
    if (m <= 0) return;
    for (int64_t i = 0; i < m; i++) heap[i] = cand[i];
    for (int64_t i = m / 2 - 1; i >= 0; i--) sift_down(v, heap, m, i);
    for (int64_t i = m; i < n; i++) {
        if (better(v, cand[i], heap[0])) {
            heap[0] = cand[i];
            sift_down(v, heap, m, 0);
        }
    }
    /* pop the worst repeatedly: fills out from the back */
    for (int64_t k = m; k > 0; k--) {
        out[k - 1] = heap[0];
        heap[0] = heap[k - 1];
        sift_down(v, heap, k - 1, 0);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* top-p without a full sort: the nucleus is a set, so only its boundary needs ordering */

/* Keep the smallest set of the best candidates whose temperature-1 mass reaches top_p.
 * Candidates are spread over QC_P_BUCKETS buckets by logit; whole buckets above the one where
 * the mass crosses top_p are kept as they are, and only the crossing bucket is sorted. This is
 * the sorted-prefix definition (ties broken by the lower id), in O(n) plus a small sort.
 * Returns the new count; cand is rewritten in place (the order of kept tokens is arbitrary). */
static int64_t top_p_filter(const sample_work *w, int32_t *cand, int64_t n, float vmax, double top_p) {
    const float *v = w->v;
    double *mass = w->bucket_mass;
    float vmin = vmax;
    double denom = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float x = v[cand[i]];
        if (x < vmin) vmin = x;
        denom += exp((double)x - vmax);
    }
    const double width = ((double)vmax - vmin) / QC_P_BUCKETS + 1e-30;
    memset(mass, 0, QC_P_BUCKETS * sizeof *mass);
    for (int64_t i = 0; i < n; i++) {
        double x = v[cand[i]];
        int64_t b = (int64_t)(((double)vmax - x) / width);
        mass[b < QC_P_BUCKETS ? b : QC_P_BUCKETS - 1] += exp(x - vmax);
    }
    const double target = top_p * denom;
    double acc = 0.0;
    int64_t edge = 0;
    while (edge < QC_P_BUCKETS - 1 && acc + mass[edge] < target) acc += mass[edge++];
    /* buckets before `edge` are kept whole; the members of `edge` are sorted, best first */
    int64_t kept = 0, n_edge = 0;
    int32_t *edge_ids = w->order;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = (int64_t)(((double)vmax - v[cand[i]]) / width);
        if (b >= QC_P_BUCKETS) b = QC_P_BUCKETS - 1;
        if (b < edge) cand[kept++] = cand[i];
        else if (b == edge) edge_ids[n_edge++] = cand[i];
    }
    select_best(v, edge_ids, n_edge, n_edge, w->heap, edge_ids);
    for (int64_t i = 0; i < n_edge; i++) {
        if (kept > 0 && acc >= target) break;
        acc += exp((double)v[edge_ids[i]] - vmax);
        cand[kept++] = edge_ids[i];
    }
    return kept;
}

/* ---------------------------------------------------------------------------------------- */
/* one draw */

size_t qc_sample_work_bytes(int64_t n_vocab) {
    return QC_P_BUCKETS * sizeof(double) + (size_t)n_vocab * (2 * sizeof(float) + 3 * sizeof(int32_t) + 1);
}

static sample_work carve_work(void *mem, int64_t nv) {
    sample_work w;
    char *p = mem;
    w.bucket_mass = (double *)p; p += QC_P_BUCKETS * sizeof(double);
    w.v = (float *)p; p += (size_t)nv * sizeof(float);
    w.weight = (float *)p; p += (size_t)nv * sizeof(float);
    w.cand = (int32_t *)p; p += (size_t)nv * sizeof(int32_t);
    w.heap = (int32_t *)p; p += (size_t)nv * sizeof(int32_t);
    w.order = (int32_t *)p; p += (size_t)nv * sizeof(int32_t);
    w.seen = (unsigned char *)p;
    return w;
}

static int cmp_id(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Put cand[0..n) back in id order: a sort when few, a sweep of the vocabulary when many. */
static void restore_id_order(const sample_work *w, int32_t *cand, int64_t n, int64_t nv) {
    if (n <= nv / 64) {
        qsort(cand, (size_t)n, sizeof *cand, cmp_id);
        return;
    }
    for (int64_t i = 0; i < n; i++) w->seen[cand[i]] = 1;
    int64_t k = 0;
    for (int64_t id = 0; id < nv; id++) {
        if (w->seen[id]) {
            w->seen[id] = 0;
            cand[k++] = (int32_t)id;
        }
    }
}

int32_t qc_sample_row(const qc_sample_state *st, const float *logits, int64_t nv, void *work,
                      uint64_t *rng_out) {
    const sample_work wk = carve_work(work, nv);
    float *v = wk.v;
    *rng_out = st->rng;
    memset(wk.seen, 0, (size_t)nv);   /* the marks below are set and cleared within one call */

    /* non-finite handling: NaN is never chosen */
    for (int64_t i = 0; i < nv; i++) {
        float x = logits[i];
        v[i] = x == x ? x : -INFINITY;
    }

    /* repetition penalty, once per distinct token: positive logits are divided by the penalty,
     * negative ones multiplied (llama.cpp) */
    const int32_t *hist = qc_sample_history(st);
    if (st->repeat_penalty != 1.0f && st->n_history > 0) {
        for (int i = 0; i < st->n_history; i++) {
            int32_t t = hist[i];
            if (t < 0 || t >= nv || wk.seen[t]) continue;
            wk.seen[t] = 1;
            v[t] = v[t] > 0.0f ? v[t] / st->repeat_penalty : v[t] * st->repeat_penalty;
        }
        for (int i = 0; i < st->n_history; i++)
            if (hist[i] >= 0 && hist[i] < nv) wk.seen[hist[i]] = 0;
    }

    int64_t best = 0;
    float vmax = v[0];
    for (int64_t i = 1; i < nv; i++) {
        if (v[i] > vmax) {
            vmax = v[i];
            best = i;
        }
    }
    if (vmax == -INFINITY) return -1;                 /* nothing can be chosen */
    if (vmax == INFINITY || st->temperature <= 0.0f) return (int32_t)best;   /* greedy / certain */

    /* candidates: every token within reach of the best, in id order */
    const float temp = st->temperature;
    const float cut = vmax - QC_CANDIDATE_NATS * (temp > 1.0f ? temp : 1.0f);
    int32_t *cand = wk.cand;
    int64_t n = 0;
    for (int64_t i = 0; i < nv; i++)
        if (v[i] >= cut) cand[n++] = (int32_t)i;

    /* top-k: the k best */
    int sorted = 0, reordered = 0;
    if (st->top_k > 0 && st->top_k < n) {
        select_best(v, cand, n, st->top_k, wk.heap, cand);
        n = st->top_k;
        sorted = reordered = 1;
    }

    /* top-p: the smallest set of the best tokens whose softmax (temperature 1) reaches top_p */
    if (st->top_p < 1.0f) {
        if (sorted) {
            double denom = 0.0, cum = 0.0;
            for (int64_t i = 0; i < n; i++) denom += exp((double)v[cand[i]] - vmax);
            int64_t keep = 0;
            while (keep < n && (keep == 0 || cum < st->top_p * denom))
                cum += exp((double)v[cand[keep++]] - vmax);
            n = keep;
        } else {
            n = top_p_filter(&wk, cand, n, vmax, st->top_p);
            reordered = 1;
        }
    }

    /* min-p: keep p >= min_p * p_max, i.e. logit >= max + log(min_p); the best always stays */
    if (st->min_p > 0.0f) {
        const double floor_v = (double)vmax + log((double)st->min_p);
        int64_t k = 0;
        for (int64_t i = 0; i < n; i++)
            if ((double)v[cand[i]] >= floor_v) cand[k++] = cand[i];
        n = k;
    }
    if (reordered) restore_id_order(&wk, cand, n, nv);

    /* temperature, then one draw from the survivors, walked in id order */
    float *w = wk.weight;
    double total = 0.0;
    const float inv_t = 1.0f / temp;
    for (int64_t i = 0; i < n; i++) {
        w[i] = expf((v[cand[i]] - vmax) * inv_t);
        total += w[i];
    }
    uint64_t rng = st->rng;
    double r = rng_uniform(&rng) * total, cum = 0.0;
    *rng_out = rng;
    for (int64_t i = 0; i < n; i++) {
        cum += w[i];
        if (r < cum) return cand[i];
    }
    return cand[n - 1];   /* rounding left r at the very top */
}

/* ---------------------------------------------------------------------------------------- */
/* the sampler object */

uint64_t qc_sample_rng_from_seed(uint64_t seed) {
    uint64_t rng = splitmix64(&seed);
    return rng ? rng : 0x9E3779B97F4A7C15ull;
}

size_t qc_sampler_state_bytes(const qc_sampler *s) {
    /* the export holds distinct tokens only: never more than n_vocab */
    int64_t cap = s->p.repeat_last_n > 0 ? s->p.repeat_last_n : 0;
    if (cap > s->n_vocab) cap = s->n_vocab;
    return sizeof(qc_sample_state) + (size_t)cap * sizeof(int32_t);
}

int qc_sampler_create(const qc_sampler_params *p, int64_t n_vocab, qc_sampler **out, qc_error *err) {
    qc_sampler *s = NULL;
    *out = NULL;
    if (n_vocab < 1 || n_vocab > INT32_MAX)
        return qc_fail(err, QC_ERR_VALUE, "n_vocab must be in [1, 2^31), got %lld", (long long)n_vocab);
    /* The one place where the sampling parameters are checked (Sampler, sample(), generate()
     * and the device draw all come through here). */
    if (!(p->temperature >= 0.0f) || isinf(p->temperature))
        return qc_fail(err, QC_ERR_VALUE, "temperature must be >= 0 and finite (0: greedy), got %g",
                       (double)p->temperature);
    if (p->top_k < 0)
        return qc_fail(err, QC_ERR_VALUE, "top_k must be >= 0 (0: off), got %d", p->top_k);
    if (!(p->top_p >= 0.0f && p->top_p <= 1.0f))
        return qc_fail(err, QC_ERR_VALUE, "top_p must be in [0, 1] (1: off; 0 keeps the best token), "
                       "got %g", (double)p->top_p);
    if (isnan(p->min_p) || p->min_p < 0.0f || p->min_p > 1.0f)
        return qc_fail(err, QC_ERR_VALUE, "min_p must be in [0, 1], got %g", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f) || isinf(p->repeat_penalty))
        return qc_fail(err, QC_ERR_VALUE, "repeat_penalty must be > 0 and finite, got %g",
                       (double)p->repeat_penalty);
    if (p->repeat_last_n < 0)
        return qc_fail(err, QC_ERR_VALUE, "repeat_last_n must be >= 0 (0: no penalty history), got %d",
                       p->repeat_last_n);
    s = calloc(1, sizeof *s);
    if (s == NULL) return qc_fail(err, QC_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    s->rng = qc_sample_rng_from_seed(p->seed);
    s->state = malloc(qc_sampler_state_bytes(s));
    s->work = malloc(qc_sample_work_bytes(n_vocab));
    if (!s->state || !s->work) {
        qc_sampler_free(s);
        return qc_fail(err, QC_ERR_NOMEM, "sampler: out of memory");
    }
    /* qc_sampler_export borrows the draw's marks, which are all 0 between calls */
    memset(carve_work(s->work, n_vocab).seen, 0, (size_t)n_vocab);
    *out = s;
    return 0;
}

void qc_sampler_free(qc_sampler *s) {
    if (s == NULL) return;
    free(s->history);
    free(s->state);
    free(s->work);
    free(s);
}

int64_t qc_sampler_n_vocab(const qc_sampler *s) { return s->n_vocab; }

int qc_sampler_accept(qc_sampler *s, int32_t token, qc_error *err) {
    if (s->p.repeat_last_n <= 0 || token < 0 || token >= s->n_vocab) return 0;
    if (s->n_history == s->hist_cap && s->hist_cap < s->p.repeat_last_n) {
        /* Not yet wrapped (head == n_history): growing keeps the order. */
        int64_t cap = s->hist_cap ? 2 * (int64_t)s->hist_cap : 64;
        if (cap > s->p.repeat_last_n) cap = s->p.repeat_last_n;
        int32_t *h = realloc(s->history, (size_t)cap * sizeof *h);
        if (h == NULL)
            return qc_fail(err, QC_ERR_NOMEM, "sampler: out of memory for %lld history tokens",
                           (long long)cap);
        s->history = h;
        s->hist_cap = (int)cap;
    }
    s->history[s->head] = token;
    s->head = (s->head + 1) % s->p.repeat_last_n;
    if (s->n_history < s->p.repeat_last_n) s->n_history++;
    return 0;
}

size_t qc_sampler_export(qc_sampler *s, qc_sample_state *st) {
    int32_t *hist = (int32_t *)(st + 1);
    int n = 0;
    st->rng = s->rng;
    st->temperature = s->p.temperature;
    st->top_p = s->p.top_p;
    st->min_p = s->p.min_p;
    st->repeat_penalty = s->p.repeat_penalty;
    st->top_k = s->p.top_k;
    if (s->p.repeat_penalty != 1.0f) {
        /* distinct tokens only: fewer to upload; marks borrowed from the (idle) draw scratch */
        unsigned char *seen = carve_work(s->work, s->n_vocab).seen;
        for (int i = 0; i < s->n_history; i++) {
            int32_t t = s->history[i];
            if (seen[t]) continue;
            seen[t] = 1;
            hist[n++] = t;
        }
        for (int i = 0; i < n; i++) seen[hist[i]] = 0;
    }
    st->n_history = n;
    return sizeof *st + (size_t)n * sizeof(int32_t);
}

void qc_sampler_set_rng(qc_sampler *s, uint64_t rng) { s->rng = rng ? rng : s->rng; }

int32_t qc_sampler_sample(qc_sampler *s, const float *logits) {
    qc_sampler_export(s, s->state);
    uint64_t rng;
    int32_t token = qc_sample_row(s->state, logits, s->n_vocab, s->work, &rng);
    s->rng = rng;
    return token;
}
