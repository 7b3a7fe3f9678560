/* sampler.c: pick the next token from a row of logits.
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
 * The RNG (xorshift64*, seeded through splitmix64) lives in the sampler: the same seed and the
 * same logits give the same tokens on every machine.
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Tokens more than this many (temperature-scaled) nats below the best carry less than
 * n_vocab * e^-40 of the mass: they are left out of sorting without changing any result. */
#define QC_CANDIDATE_NATS 40.0f
/* Logit buckets of the top-p filter: the boundary bucket, the only one sorted, stays small. */
#define QC_P_BUCKETS 4096

struct qc_sampler {
    qc_sampler_params p;
    int64_t n_vocab;
    uint64_t rng;             /* xorshift64* state, never 0 */
    int32_t *history;         /* (repeat_last_n) ring of accepted tokens */
    int n_history;            /* entries filled, <= repeat_last_n */
    int head;                 /* next slot to write */
    float *work;              /* (n_vocab) logits after the penalty, NaN -> -inf */
    int32_t *cand;            /* (n_vocab) candidate ids, best first once sorted */
    int32_t *heap;            /* (n_vocab) scratch for partial selection */
    int32_t *order;           /* (n_vocab) top-p: the candidates of the boundary bucket */
    float *weight;            /* (n_vocab) exp((logit - max) / temperature) of the survivors */
    double *bucket_mass;      /* (QC_P_BUCKETS) top-p: probability mass per logit bucket */
    unsigned char *seen;      /* (n_vocab) penalty marks, all 0 between calls */
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
/* build / free */

int qc_sampler_create(const qc_sampler_params *p, int64_t n_vocab, qc_sampler **out, qc_error *err) {
    qc_sampler *s = NULL;
    *out = NULL;
    if (n_vocab < 1 || n_vocab > INT32_MAX)
        return qc_fail(err, QC_ERR_VALUE, "n_vocab must be in [1, 2^31), got %lld", (long long)n_vocab);
    if (isnan(p->temperature)) return qc_fail(err, QC_ERR_VALUE, "temperature is NaN");
    if (isnan(p->top_p) || p->top_p < 0.0f)
        return qc_fail(err, QC_ERR_VALUE, "top_p must be in [0, 1], got %g", (double)p->top_p);
    if (isnan(p->min_p) || p->min_p < 0.0f || p->min_p > 1.0f)
        return qc_fail(err, QC_ERR_VALUE, "min_p must be in [0, 1], got %g", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f) || isinf(p->repeat_penalty))
        return qc_fail(err, QC_ERR_VALUE, "repeat_penalty must be > 0 and finite, got %g",
                       (double)p->repeat_penalty);
    if (p->repeat_last_n < 0)
        return qc_fail(err, QC_ERR_VALUE, "repeat_last_n must be >= 0, got %d", p->repeat_last_n);
    s = calloc(1, sizeof *s);
    if (s == NULL) return qc_fail(err, QC_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    uint64_t seed = p->seed;
    s->rng = splitmix64(&seed);
    if (s->rng == 0) s->rng = 0x9E3779B97F4A7C15ull;
    s->history = malloc((size_t)(p->repeat_last_n > 0 ? p->repeat_last_n : 1) * sizeof *s->history);
    s->work = malloc((size_t)n_vocab * sizeof *s->work);
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->heap = malloc((size_t)n_vocab * sizeof *s->heap);
    s->order = malloc((size_t)n_vocab * sizeof *s->order);
    s->weight = malloc((size_t)n_vocab * sizeof *s->weight);
    s->bucket_mass = malloc(QC_P_BUCKETS * sizeof *s->bucket_mass);
    s->seen = calloc((size_t)n_vocab, 1);
    if (!s->history || !s->work || !s->cand || !s->heap || !s->order || !s->weight || !s->bucket_mass || !s->seen) {
        qc_sampler_free(s);
        return qc_fail(err, QC_ERR_NOMEM, "sampler: out of memory");
    }
    *out = s;
    return 0;
}

void qc_sampler_free(qc_sampler *s) {
    if (s == NULL) return;
    free(s->history);
    free(s->work);
    free(s->cand);
    free(s->heap);
    free(s->order);
    free(s->weight);
    free(s->bucket_mass);
    free(s->seen);
    free(s);
}

void qc_sampler_accept(qc_sampler *s, int32_t token) {
    if (s->p.repeat_last_n <= 0 || token < 0 || token >= s->n_vocab) return;
    s->history[s->head] = token;
    s->head = (s->head + 1) % s->p.repeat_last_n;
    if (s->n_history < s->p.repeat_last_n) s->n_history++;
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
static int64_t top_p_filter(qc_sampler *s, int32_t *cand, int64_t n, float vmax, double top_p) {
    const float *v = s->work;
    double *mass = s->bucket_mass;
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
    int32_t *edge_ids = s->order;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = (int64_t)(((double)vmax - v[cand[i]]) / width);
        if (b >= QC_P_BUCKETS) b = QC_P_BUCKETS - 1;
        if (b < edge) cand[kept++] = cand[i];
        else if (b == edge) edge_ids[n_edge++] = cand[i];
    }
    select_best(v, edge_ids, n_edge, n_edge, s->heap, edge_ids);
    for (int64_t i = 0; i < n_edge; i++) {
        if (kept > 0 && acc >= target) break;
        acc += exp((double)v[edge_ids[i]] - vmax);
        cand[kept++] = edge_ids[i];
    }
    return kept;
}

/* ---------------------------------------------------------------------------------------- */
/* sampling */

int32_t qc_sampler_sample(qc_sampler *s, const float *logits) {
    const int64_t nv = s->n_vocab;
    const qc_sampler_params *p = &s->p;
    float *v = s->work;

    /* non-finite handling: NaN is never chosen */
    for (int64_t i = 0; i < nv; i++) {
        float x = logits[i];
        v[i] = x == x ? x : -INFINITY;
    }

    /* repetition penalty, once per distinct token of the last repeat_last_n accepted:
     * positive logits are divided by the penalty, negative ones multiplied (llama.cpp) */
    if (p->repeat_penalty != 1.0f && s->n_history > 0) {
        for (int i = 0; i < s->n_history; i++) {
            int32_t t = s->history[i];
            if (s->seen[t]) continue;
            s->seen[t] = 1;
            v[t] = v[t] > 0.0f ? v[t] / p->repeat_penalty : v[t] * p->repeat_penalty;
        }
        for (int i = 0; i < s->n_history; i++) s->seen[s->history[i]] = 0;
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
    if (vmax == INFINITY || p->temperature <= 0.0f) return (int32_t)best;   /* greedy / certain */

    /* candidates: every token within reach of the best */
    const float temp = p->temperature;
    const float cut = vmax - QC_CANDIDATE_NATS * (temp > 1.0f ? temp : 1.0f);
    int32_t *cand = s->cand;
    int64_t n = 0;
    for (int64_t i = 0; i < nv; i++)
        if (v[i] >= cut) cand[n++] = (int32_t)i;

    /* top-k: the k best */
    int sorted = 0;
    if (p->top_k > 0 && p->top_k < n) {
        select_best(v, cand, n, p->top_k, s->heap, cand);
        n = p->top_k;
        sorted = 1;
    }

    /* top-p: the smallest set of the best tokens whose softmax (temperature 1) reaches top_p */
    if (p->top_p < 1.0f) {
        if (sorted) {
            double denom = 0.0, cum = 0.0;
            for (int64_t i = 0; i < n; i++) denom += exp((double)v[cand[i]] - vmax);
            int64_t keep = 0;
            while (keep < n && (keep == 0 || cum < p->top_p * denom))
                cum += exp((double)v[cand[keep++]] - vmax);
            n = keep;
        } else {
            n = top_p_filter(s, cand, n, vmax, p->top_p);
        }
    }

    /* min-p: keep p >= min_p * p_max, i.e. logit >= max + log(min_p); the best always stays */
    if (p->min_p > 0.0f) {
        const double floor_v = (double)vmax + log((double)p->min_p);
        int64_t k = 0;
        for (int64_t i = 0; i < n; i++)
            if ((double)v[cand[i]] >= floor_v) cand[k++] = cand[i];
        n = k;
    }

    /* temperature, then one draw from the survivors */
    float *w = s->weight;
    double total = 0.0;
    const float inv_t = 1.0f / temp;
    for (int64_t i = 0; i < n; i++) {
        w[i] = expf((v[cand[i]] - vmax) * inv_t);
        total += w[i];
    }
    double r = rng_uniform(&s->rng) * total, cum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        cum += w[i];
        if (r < cum) return cand[i];
    }
    return cand[n - 1];   /* rounding left r at the very top */
}
