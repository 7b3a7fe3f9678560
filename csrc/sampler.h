/* sampler.h: token sampling on host logits: greedy, temperature, top-k, top-p, min-p,
 * repetition penalty, with an explicit seeded RNG so that the same seed gives the same tokens. */
#ifndef QC_SAMPLER_H
#define QC_SAMPLER_H

#include <stdint.h>
#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature;        /* <= 0: greedy */
    int top_k;                /* <= 0: off */
    float top_p;              /* >= 1: off */
    float min_p;              /* <= 0: off */
    float repeat_penalty;     /* 1: off (llama.cpp semantics: divide positive, multiply negative) */
    int repeat_last_n;        /* how many recent tokens the penalty looks at */
    uint64_t seed;
} qc_sampler_params;

typedef struct qc_sampler qc_sampler;

int qc_sampler_create(const qc_sampler_params *p, int64_t n_vocab, qc_sampler **out, qc_error *err);
void qc_sampler_free(qc_sampler *s);
/* Pick a token from logits[n_vocab] (not modified). */
int32_t qc_sampler_sample(qc_sampler *s, const float *logits);
/* Record a token as generated (or as part of the prompt) for the repetition penalty. */
void qc_sampler_accept(qc_sampler *s, int32_t token);

#ifdef __cplusplus
}
#endif
#endif /* QC_SAMPLER_H */
