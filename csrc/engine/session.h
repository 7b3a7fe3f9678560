/* session.h: KV cache, positions, and the forward pass with capture. */
#ifndef QC_SESSION_H
#define QC_SESSION_H

#include "model.h"
#include "sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { QC_DTYPE_F32 = 0, QC_DTYPE_I32 = 1 };

/* ---- capture names (DESIGN.md): the one list; Python reads it through _core ---- */

/* Global names: embed, output_norm, logits, argmax. */
int qc_capture_global_count(void);
const char *qc_capture_global_name(int i);
/* Per-layer names, in forward order (blk.L.<name>): attn_norm, q, k, v, q_rope, ... resid_out. */
int qc_capture_layer_count(void);
const char *qc_capture_layer_name(int i);

/* One captured tensor, copied to host memory, or with qc_eval_request.capture_device to a buffer
 * of the CUDA device that ran the eval. */
typedef struct qc_tensor_out {
    char name[64];            /* capture name, e.g. "blk.3.q_rope" (DESIGN.md) */
    int ndim;
    int64_t shape[3];
    int dtype;                /* QC_DTYPE_* */
    void *data;               /* whoever takes it sets this to NULL; host: malloc'd; device: from the
                                 backend's alloc, freed by qc_cuda_buffer_free (qc_cuda_api.h),
                                 which needs no backend, so it may outlive the model */
    int on_device;            /* 0: host memory; 1: memory of CUDA device `device` */
    int device;               /* CUDA ordinal when on_device */
} qc_tensor_out;

typedef struct {
    qc_tensor_out *items;
    int n, cap;
} qc_capture;

void qc_capture_free(qc_capture *c);   /* frees every data still owned (host or device), and the array */

/* Which tensors to capture: fnmatch(3) glob patterns over capture names. */
typedef struct {
    const char *const *patterns;
    int n_patterns;
} qc_capture_spec;

/* Interventions (qwencuda.patching): fn receives a host copy of each tensor whose name matches
 * one of the patterns (glob patterns over capture names, as for capture), right after the step
 * that computed it, with its capture shape for this eval; what fn leaves in data replaces the
 * tensor for the rest of the eval (a capture of the name shows it). fn returns 0, or -1 after
 * setting its own error (the eval then fails with QC_ERR_CALLBACK). argmax is never patched.
 * attn_scores patched: the probabilities are the softmax of the patched scores; attn_scores or
 * attn_probs patched: the attention output of every row is recomputed from the probabilities and
 * the cache's values on the host (fp32 values, double sums). k_rope and v patched enter the KV
 * cache. A patched eval runs as one forward pass (no chunks), and never as a recorded replay. */
typedef int (*qc_patch_fn)(void *ctx, const char *name, float *data, int ndim, const int64_t shape[3]);
typedef struct {
    const char *const *patterns;
    int n_patterns;
    qc_patch_fn fn;
    void *ctx;
} qc_patch_spec;

typedef struct qc_session qc_session;

/* kv_type: QC_KV_F32 or QC_KV_F16 (backend.h). */
int qc_session_create(qc_model *m, int max_ctx, int kv_type, qc_session **out, qc_error *err);
void qc_session_free(qc_session *s);   /* NULL ok */
int qc_session_position(const qc_session *s);
int qc_session_max_context(const qc_session *s);
int qc_session_kv_type(const qc_session *s);
/* How the last eval ran: "ops" (op by op), "graph" (a recorded op-by-op decode step replayed) or
 * "persistent" (a recorded decode_step: the layers and lm_head in one launch); NULL before the
 * first. */
const char *qc_session_last_path(const qc_session *s);
/* Whether the last eval's step had been queued on the backend before it was asked for: a step
 * of a generation loop that the step before ran ahead (backend.h's feed_draw); its draw is
 * the same either way. */
int qc_session_ran_ahead(const qc_session *s);
void qc_session_reset(qc_session *s);
int qc_session_rewind(qc_session *s, int n, qc_error *err);

/* Tokens one forward pass computes at most: a longer eval runs in chunks of this many (the
 * scratch activations stay bounded); >= 1. */
int qc_session_chunk(const qc_session *s);
int qc_session_set_chunk(qc_session *s, int chunk, qc_error *err);

/* Bytes of host memory one eval may fill with captures and logits before it is refused with
 * QC_ERR_NOMEM (nothing allocated, nothing run). 0 = the default: half of the memory the system
 * has available at the time of the eval (MemAvailable). The same number bounds, on its own, the
 * GPU memory of captures kept on the device (capture_device), whose default is half of the
 * device's free memory at the time of the eval (cudaMemGetInfo). */
size_t qc_session_capture_budget(const qc_session *s);   /* the budget in force now */
void qc_session_set_capture_budget(qc_session *s, size_t bytes);

/* One eval: n tokens at positions position .. position + n - 1. */
typedef struct {
    const int32_t *ids;
    int n;
    int all_logits;               /* logits and argmax rows: every token (1) or the last (0) */
    int want_logits;              /* the caller takes logits and argmax (qc_eval_result) */
    const qc_capture_spec *spec;  /* tensors whose names match are captured; NULL: none */
    /* query rows (0 .. n-1, strictly increasing) whose attn_scores / attn_probs are captured:
     * those tensors are then (n_head, n_attn_rows, n_kv), O(n) memory per row; NULL: all rows */
    const int32_t *attn_rows;
    int n_attn_rows;
    /* a sampler's state (qc_sampler_export): one draw from the last token's logits on the
     * backend (inside the recorded decode step on CUDA); NULL: no draw */
    const qc_sample_state *sample;
    /* tensors to change mid-forward (see qc_patch_spec); NULL: none, no cost */
    const qc_patch_spec *patch;
    /* 1: captured tensors stay in buffers of the backend's CUDA device (copied device to device;
     * attention rows that a patch computed on the host are uploaded), checked against the
     * capture budget in GPU memory; QC_ERR_VALUE on a backend other than CUDA. 0: host memory */
    int capture_device;
} qc_eval_request;

typedef struct {
    float *logits;                /* host [rows][n_vocab] (rows = n or 1), when want_logits */
    int32_t *argmax;              /* host [rows], when want_logits */
    qc_capture capture;           /* filled by the eval; the caller frees it */
    qc_sample_result drawn;       /* the draw and the RNG after it, when sample */
} qc_eval_result;

/* Everything that can be wrong with req, checked before any allocation or work: ids against
 * n_vocab, the context against max_ctx (QC_ERR_RANGE), attn_rows, the sampler state, and the
 * host memory of its captures and logits (and the GPU memory of device captures) against the
 * capture budget (QC_ERR_NOMEM, with the size). qc_session_eval runs it first; callers may run it before they allocate the logits. */
int qc_session_check(const qc_session *s, const qc_eval_request *req, qc_error *err);

/* Run req and advance the position by n (the session is unchanged on error). A draw that finds
 * every logit NaN or -inf fails (QC_ERR_VALUE) and leaves the position. */
int qc_session_eval(qc_session *s, const qc_eval_request *req, qc_eval_result *res, qc_error *err);

#ifdef __cplusplus
}
#endif
#endif /* QC_SESSION_H */
