/* session.h: KV cache, positions, and the forward pass with capture. */
#ifndef QC_SESSION_H
#define QC_SESSION_H

#include "model.h"
#include "sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { QC_DTYPE_F32 = 0, QC_DTYPE_I32 = 1 };

/* One captured tensor, copied to host memory. */
typedef struct {
    char name[64];            /* capture name, e.g. "blk.3.q_rope" (DESIGN.md) */
    int ndim;
    int64_t shape[3];
    int dtype;                /* QC_DTYPE_* */
    void *data;               /* malloc'd; whoever takes it sets this to NULL */
} qc_tensor_out;

typedef struct {
    qc_tensor_out *items;
    int n, cap;
} qc_capture;

void qc_capture_free(qc_capture *c);   /* frees every data still owned, and the array */

/* Which tensors to capture: fnmatch(3) glob patterns over capture names. */
typedef struct {
    const char *const *patterns;
    int n_patterns;
} qc_capture_spec;

typedef struct qc_session qc_session;

int qc_session_create(qc_model *m, int max_ctx, qc_session **out, qc_error *err);
void qc_session_free(qc_session *s);   /* NULL ok */
int qc_session_position(const qc_session *s);
int qc_session_max_context(const qc_session *s);
void qc_session_reset(qc_session *s);
int qc_session_rewind(qc_session *s, int n, qc_error *err);

/* Run n tokens at positions position..position+n-1 and advance the position by n.
 * ids are checked against n_vocab and the context is checked against max_ctx before any work
 * (QC_ERR_RANGE; the session is unchanged on error).
 * logits: host [n][n_vocab] when all_logits, else [1][n_vocab] for the last token; may be NULL.
 * argmax: host [n] or [1] likewise; may be NULL.
 * spec/capture: tensors whose names match spec are appended to capture; either may be NULL.
 * sample: when not NULL (a sampler's state, qc_sampler_export), one draw from the last token's
 * logits on the backend (the sample op; inside the recorded decode step on CUDA) into *drawn:
 * the token and the RNG state after it, for qc_sampler_set_rng. No logits reach the host for
 * it. A draw that finds every logit NaN or -inf fails (QC_ERR_VALUE) and leaves the position. */
int qc_session_eval(qc_session *s, const int32_t *ids, int n, int all_logits,
                    const qc_capture_spec *spec, qc_capture *capture,
                    float *logits, int32_t *argmax, const qc_sample_state *sample,
                    qc_sample_result *drawn, qc_error *err);

#ifdef __cplusplus
}
#endif
#endif /* QC_SESSION_H */
