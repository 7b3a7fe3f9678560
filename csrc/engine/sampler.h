/* sampler.h: token sampling on a row of logits: greedy, temperature, top-k, top-p, min-p,
 * repetition penalty, with an explicit seeded RNG so that the same seed gives the same tokens.
 *
 * Two layers:
 *  - qc_sample_row: one draw as a pure function of plain data (qc_sample_state: parameters, RNG
 *    state, penalty tokens). The backends' sample op (backend.h) takes the same state in backend
 *    memory: the CPU op calls qc_sample_row, the CUDA op (kernels/sample.cu) runs the same chain
 *    on the device, so a decode step can sample without handing the logits to the host.
 *  - qc_sampler: the stateful object behind qwencuda.Sampler (RNG, the ring of recent tokens for
 *    the penalty, scratch); it exports its state for a backend draw and takes the RNG back. */
#ifndef QC_SAMPLER_H
#define QC_SAMPLER_H

#include <stddef.h>
#include <stdint.h>
#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature;        /* >= 0, finite; 0: greedy (qc_sampler_create checks each field) */
    int top_k;                /* >= 0; 0: off */
    float top_p;              /* [0, 1]; 1: off, 0: the best token only */
    float min_p;              /* <= 0: off */
    float repeat_penalty;     /* 1: off (llama.cpp semantics: divide positive, multiply negative) */
    int repeat_last_n;        /* how many recent tokens the penalty looks at */
    uint64_t seed;
} qc_sampler_params;

/* What one draw reads, as plain data. The penalty's token ids follow this header as n_history
 * int32 values (duplicates and ids out of range are ignored). */
typedef struct {
    uint64_t rng;             /* xorshift64* state before the draw, never 0 */
    float temperature, top_p, min_p, repeat_penalty;
    int32_t top_k;
    int32_t n_history;
} qc_sample_state;

/* What a backend draw writes. */
typedef struct {
    uint64_t rng;             /* the RNG state after the draw (unchanged when nothing was drawn) */
    int32_t token;            /* -1: every logit is NaN or -inf */
    int32_t pad;
} qc_sample_result;

/* Tokens more than this many (temperature-scaled) nats below the best carry less than
 * n_vocab * e^-40 of the mass: both implementations leave them out. */
#define QC_CANDIDATE_NATS 40.0f

static inline const int32_t *qc_sample_history(const qc_sample_state *st) {
    return (const int32_t *)(st + 1);
}

/* Whether a draw by st is the first largest logit, with nothing to apply to the logits first
 * (greedy, and no penalty or no history): the draw that matmul_draw makes (backend.h), and
 * the one the sample kernel splits between its blocks (sample.cu, on the device). */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline int qc_sample_plain_greedy(const qc_sample_state *st) {
    return st->temperature <= 0.0f && (st->repeat_penalty == 1.0f || st->n_history <= 0);
}

/* Scratch bytes qc_sample_row needs for n_vocab logits (the sample op's `work`, too). */
size_t qc_sample_work_bytes(int64_t n_vocab);
/* One draw from logits[n_vocab] (not modified) -> the token, or -1 when every logit is NaN or
 * -inf; *rng_out receives the RNG state after it. work: qc_sample_work_bytes(n_vocab) bytes,
 * 8-byte aligned. The chain and its conventions are described in sampler.c. */
int32_t qc_sample_row(const qc_sample_state *st, const float *logits, int64_t n_vocab, void *work,
                      uint64_t *rng_out);

typedef struct qc_sampler qc_sampler;

int qc_sampler_create(const qc_sampler_params *p, int64_t n_vocab, qc_sampler **out, qc_error *err);
void qc_sampler_free(qc_sampler *s);
int64_t qc_sampler_n_vocab(const qc_sampler *s);
/* Pick a token from logits[n_vocab] (not modified); advances the RNG. */
int32_t qc_sampler_sample(qc_sampler *s, const float *logits);
/* Record a token as generated (or as part of the prompt) for the repetition penalty; -1 only
 * when the history cannot grow (out of memory). */
int qc_sampler_accept(qc_sampler *s, int32_t token, qc_error *err);
/* The state of the next draw (header + the distinct recent tokens): at most
 * qc_sampler_state_bytes(s) bytes into buf; returns the bytes written. */
size_t qc_sampler_state_bytes(const qc_sampler *s);
size_t qc_sampler_export(qc_sampler *s, qc_sample_state *buf);
/* Take the RNG state that a backend draw from an exported state handed back. */
void qc_sampler_set_rng(qc_sampler *s, uint64_t rng);
/* xorshift64* state for a seed (splitmix64 of it, never 0): what a new sampler starts from. */
uint64_t qc_sample_rng_from_seed(uint64_t seed);

#ifdef __cplusplus
}
#endif
#endif /* QC_SAMPLER_H */
