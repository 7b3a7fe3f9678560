/* qc_cuda.cuh: what every CUDA op file shares: the backend's private state, the one error
 * check for CUDA and cuBLAS calls, and the launchers (one per op) that cuda_backend.cu calls
 * from the backend.h ops table.
 *
 * Conventions of the launchers: they enqueue work on the backend's one stream and never
 * synchronize the host, never allocate (except the prefill scratch of matmul and
 * matmul_swiglu, which grows only when a bigger matrix arrives), and read positions and token
 * ids from device memory, so the decode step can later be captured as one CUDA graph. Each
 * returns 0, or -1 with be->err set.
 */
#ifndef QC_CUDA_CUH
#define QC_CUDA_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <stdint.h>

#include "backend.h"

/* Weights that a kernel asks L2 for while it waits (read_ahead, backend.h): bytes[i] of p[i],
 * split between the kernel's blocks (qc_l2_ahead_issue); 0 bytes where none. */
typedef struct qc_l2_ahead {
    const uint8_t *p[QC_READ_AHEAD_MAX];
    int64_t bytes[QC_READ_AHEAD_MAX];
} qc_l2_ahead;

/* result buffers (sessions) whose fed draws reach the host by draw_ticket at once (qc_cuda) */
#define QC_DRAW_PAIRS 8

/* Backend-private state (be->impl). */
/* A down projection's slices (qc_slices.cuh, down_slices.cu): of the weight whose device rows are
 * `of`. */
typedef struct qc_down_slices {
    const void *of;
    void *slices;
} qc_down_slices;

typedef struct qc_cuda {
    cudaStream_t stream;        /* every op and copy runs on it, in order */
    cublasHandle_t blas;        /* bound to stream */
    int sm_count;               /* multiprocessors, for grid sizing */
    /* prefill scratch for matmul (n > QC_GEMV_MAX_TOKENS): a tile of dequantized weight rows
     * and the activations converted to f16. Grown, never shrunk, outside the decode path. */
    void *scratch_w;
    size_t scratch_w_bytes;
    void *scratch_x;
    size_t scratch_x_bytes;
    /* prefill scratch of matmul_swiglu: the up projection (n, ffn) beside the gate in act */
    void *scratch_up;
    size_t scratch_up_bytes;
    /* split-K attention partials of short evals: (m, l, acc[head_dim]) per token, head and
     * split. Allocated once at creation, so a decode step recorded as a graph never allocates. */
    float *attn_part;
    void *scratch_norm;         /* see qc_cuda_norm_to_scratch */
    size_t scratch_norm_bytes;
    /* one counter per (token, head) of a split-K attention launch: the splits that finished;
     * zero between launches (the last split resets it). Zeroed at creation. */
    unsigned int *attn_done;
    /* decode steps over an F16 cache past QC_KV_SHORT keys run the flash kernel split over the
     * keys (1), or always the fp32 split-K kernel reading f16 (0: QWENCUDA_DECODE_ATTENTION=split
     * at creation, to compare) */
    int flash_decode;
    /* and its blocks load their first tile of keys below the eval's first position before their
     * wait (flash_attention.cu, EARLY), unless QWENCUDA_FLASH_EARLY=0 at creation (to compare) */
    int flash_early;
    /* and the last of its blocks merges the splits (flash_attention.cu, TAIL), not the merge
     * launch after them: QWENCUDA_FLASH_MERGE=tail at creation (to compare) */
    int flash_tail;
    /* qkv_attention's fallback (flash decode past QC_KV_SHORT keys) adds a folded down
     * projection's sums in the norm's quantize launch (qc_cuda_matmul_qkv_rope_sum), not by a
     * sum_add launch before it: QWENCUDA_NORM_SUMS=1 at creation (an experiment, off by default:
     * not yet run on a GPU) */
    int norm_sums;
    /* and its q, k, v launch normalises and quantizes x in each block (matmul_multi.cu, NORM_Q8;
     * the sums too), with no norm launch before it: QWENCUDA_QKV_NORM=1 at creation (an
     * experiment, off by default: not yet run on a GPU) */
    int qkv_norm;
    /* the decode GEMV of the 8-bit formats on 8-bit activations (1, qc_gemv_q8.cuh), or the
     * float GEMV everywhere (0: device "cuda:float"); q8x holds the quantized
     * activations of one matmul (QC_GEMV_MAX_TOKENS x QC_Q8X_MAX_COLS), made at creation */
    int gemv_q8;
    void *q8x;
    /* the one-token activation whose 8-bit form q8x holds (cols values), left there by the op
     * that wrote both (attention's split and cluster kernels; matmul_swiglu's one-token kernel,
     * in q8x_act) for the matmul_add right after it (x_from_last_op), or NULL. Every other
     * writer of q8x (the quantize launchers, the persistent decode kernel), and every upload and
     * copy, sets it to NULL. */
    const float *q8x_of;
    int64_t q8x_cols;
    void *q8x_of_at;            /* where that 8-bit form is laid out (qc_q8x_ds_at): q8x or q8x_act */
    /* the 8-bit form of one act row that matmul_swiglu's one-token kernel leaves for the down
     * projection: the second one-token region of q8x, apart from the gate/up GEMV's own input */
    void *q8x_act;
    /* the normalised 8-bit form of one row that matmul_add's one-token 32-row kernel leaves for
     * the matmul_swiglu right after it (norm_next, backend.h; matmul.cu): norm_of * norm_of_w
     * quantized per block of 32 (laid out at q8x_norm, the third one-token region of q8x), each
     * block's sum of norm_of^2 in norm_ss (QC_NORM_SS_MAX_COLS / 32 floats, made at creation);
     * norm_of NULL when there is none. Every matmul and matmul_add clears it or (norm_next) sets
     * it; an upload or copy over norm_of, and the matmul_swiglu after it, clear it. */
    const float *norm_of, *norm_of_w;
    int64_t norm_cols;
    void *q8x_norm;
    float *norm_ss;
    /* the persistent decode kernel (decode_step.cu): whether the device can launch a
     * cooperative grid, and its counters, zeroed at creation and back to zero after every
     * launch: the grid barrier (QC_DEC_SYNC_BARRIER) and one per block of 32 act values */
    int coop_launch;
    unsigned int *dec_sync;
    /* the greedy draw's partials, one (value bits, index) per block of a sample launch
     * (QC_SAMPLE_BLOCKS), and its counter of finished blocks: zeroed at creation, back to zero
     * after every launch (the last block resets it) */
    int2 *sample_part;
    unsigned int *sample_done;
    /* matmul_draw's draw in the lm_head (matmul.cu, qc_head_draw): the largest key so far,
     * zeroed at creation, back to zero after every draw; QWENCUDA_HEAD_DRAW is not "0" at
     * creation (to compare: the lm_head, sample, feed_draw) */
    unsigned long long *draw_best;
    int head_draw;
    /* every op kernel is launched as a programmatic dependent launch (qc_launch below): the
     * device and the kernels' code are sm_90 or newer, and QWENCUDA_PDL is not "0" at creation */
    int pdl;
    /* thread-block clusters (sm_90) join a decode step's blocks through shared memory instead of
     * global memory: the split-K attention merges its splits so (attention.cu), and the argmax
     * of a long row its slices' bests (argmax.cu). The device and the kernels' code are sm_90
     * or newer, and QWENCUDA_CLUSTERS is not "0" at creation (to compare) */
    int clusters;
    /* decode GEMV blocks copy their weight rows into shared memory before qc_grid_start
     * (qc_copy_to_shared), where a grid is one wave: QWENCUDA_WEIGHTS_SHARED is not "0" at
     * creation (to compare) */
    int w_shared;
    /* the split-K cluster kernel loads its groups' first keys into registers before the wait
     * (attention.cu): QWENCUDA_ATTENTION_HOLD is not "0" at creation (to compare) */
    int att_hold;
    /* a decode step's qkv_attention in one launch (qkv_attention.cu): QWENCUDA_QKV_ATTENTION is
     * not "0" at creation (to compare) */
    int qkv_attention;
    /* its clusters: qa_most[head_dim 128][f32 cache][16 blocks] is how many clusters of 8 (or 16)
     * blocks of that kernel the GPU holds at once, 0 where it takes none (creation,
     * qc_cuda_qkv_attention_init); qa_cluster_want is 8 or 16 where QWENCUDA_ATT_CLUSTER asked
     * for one at creation (to compare; 16 only where it is schedulable), 0 to choose */
    int qa_most[2][2][2];
    int qa_cluster_want;
    /* one-token GEMVs of more than a wave of blocks (the lm_head) with four rows a warp (matmul.cu,
     * qc_gemv_q8_rows4_kernel): QWENCUDA_GEMV_ROWS4 is not "0" at creation (to compare) */
    int gemv_rows4;
    /* one-token GEMVs of long rows (qc_gemv_split: the down projection) with QC_SPLIT_ROWS rows a
     * block (matmul.cu, qc_gemv_q8_split_rows_kernel), not qc_gemv_kernel's one:
     * QWENCUDA_SPLIT_ROWS is not "0" at creation (to compare) */
    int split_rows;
    /* rows a warp of the 32-row matmul_add that leaves the next norm's 8-bit input (matmul.cu,
     * qc_gemv_q8_add_norm_kernel: the o projection): 4 where QWENCUDA_ADD_NORM_WARP_ROWS=4 at
     * creation (to compare), else 2 */
    int add_norm_rw;
    /* RoPE's (cos, sin) of pairs 0 .. head_dim / 2 - 1 at the position in rope_of_pos (device
     * memory), theta rope_of_theta, as that launch left them in rope_cs (QC_ROPE_CS_MAX, made at
     * creation) for the next layers' launches of the step; rope_of_pos NULL when there are none.
     * Every write that may change a position ends it (qc_cuda_forget_rope). */
    double2 *rope_cs;
    const int32_t *rope_of_pos;
    float rope_of_theta;
    int rope_of_head_dim;
    /* read_ahead's hint (backend.h) for the next matmul or matmul_add (it takes it and clears it):
     * QWENCUDA_READ_AHEAD is not "0" at creation (to compare); l2_bytes bounds the hint */
    int read_ahead;
    qc_l2_ahead ahead;
    int l2_bytes;
    /* the hint the last matmul's blocks issued (none where it had none or took cuBLAS), until
     * qkv_attention reads it: the rows it names are in L2 or on their way */
    qc_l2_ahead ahead_issued;
    /* download_start's copies (backend.h): QC_DOWNLOAD_TICKETS slots of pinned host memory,
     * QC_DOWNLOAD_AHEAD_BYTES each, mapped for the device (ahead_host_dev), and the event after
     * each slot's copy; made at the first download_start. The next copy takes slot
     * next_ticket % QC_DOWNLOAD_TICKETS. */
    uint8_t *ahead_host;
    uint8_t *ahead_host_dev;
    cudaEvent_t ahead_copied[QC_DOWNLOAD_TICKETS];
    /* download_start copies by a kernel's stores into the mapped slot (qc_cuda_to_host), not by
     * cudaMemcpyAsync: QWENCUDA_COPY_KERNEL is not "0" at creation (to compare) */
    int copy_kernel;
    unsigned next_ticket;
    /* draw_ticket's (backend.h): matmul_draw's finish kernel, where it feeds the next step, also
     * stores its qc_sample_result into a slot of pinned host memory mapped for the device (made
     * at creation), and draw_ticket records the slot's event after the replay: the draw reaches
     * the host with no copy kernel between two steps. A pair of slots serves one result buffer
     * (one session's: draw_slot_of, given out by qc_cuda_draw_pair and taken back when the
     * buffer is freed), slot pos % 2 its step at position pos, so that neither the step queued
     * ahead nor another session's overwrites a draw not yet read. QWENCUDA_DRAW_TO_HOST=0 at
     * creation leaves it to download_start's copy (to compare). */
    int draw_to_host;
    void *draw_host, *draw_host_dev;                  /* QC_DRAW_PAIRS pairs of qc_sample_result */
    const void *draw_slot_of[QC_DRAW_PAIRS];          /* the result buffer a pair serves, or NULL */
    cudaEvent_t draw_copied[2 * QC_DRAW_PAIRS];
    /* swiglu_down (backend.h; matmul_swiglu.cu): QWENCUDA_DOWN_FOLD is not "0" at creation (to
     * compare), and the slices its weights were prepared with (down_slices.cu) */
    int down_fold;
    qc_down_slices *slices;
    int n_slices, cap_slices;
} qc_cuda;
#define QC_DEC_SYNC_BARRIER 2
#define QC_DEC_SYNC_WORDS (QC_DEC_SYNC_BARRIER + 65536 / 32)

/* Blocks of a sample launch: a greedy draw without a penalty (the common decode) splits its
 * one pass over the logits between them (sample.cu). */
#define QC_SAMPLE_BLOCKS 32

/* Floats of attn_part: 32 splits x 14 heads x (64 + 2) for a 0.5B decode step is 30k; evals that
 * would need more use the one-block-per-head attention kernel. */
#define QC_ATT_PART_FLOATS (1 << 20)
/* (token, head) pairs that attn_done counts for: 8 tokens x 2048 heads */
#define QC_ATT_PAIRS (1 << 14)

static inline qc_cuda *qc_cuda_of(qc_backend *be) { return (qc_cuda *)be->impl; }

/* Pairs rope_cs holds: head_dim <= 2 * QC_ROPE_CS_MAX. */
#define QC_ROPE_CS_MAX 128
/* rope_cs no longer holds the angles of a position: after an upload, a copy, feed_draw, and a
 * recording's start, end and replay (a replayed step moves the position on the device). */
static inline void qc_cuda_forget_rope(qc_cuda *cu) { cu->rope_of_pos = NULL; }

/* Record a failed CUDA call in be->err (kind QC_ERR_CUDA, naming the call, the error and
 * where) and clear the non-sticky error state so that the backend stays usable. Returns -1. */
int qc_cuda_fail(qc_backend *be, cudaError_t e, const char *call, const char *file, int line);
int qc_cublas_fail(qc_backend *be, cublasStatus_t s, const char *call, const char *file, int line);

static inline int qc_cuda_check(qc_backend *be, cudaError_t e, const char *call, const char *file,
                                int line) {
    return e == cudaSuccess ? 0 : qc_cuda_fail(be, e, call, file, line);
}
static inline int qc_cublas_check(qc_backend *be, cublasStatus_t s, const char *call,
                                  const char *file, int line) {
    return s == CUBLAS_STATUS_SUCCESS ? 0 : qc_cublas_fail(be, s, call, file, line);
}
/* QC_CUDA(be, call): 0 when call returned cudaSuccess, else -1 with be->err filled. */
#define QC_CUDA(be, call) qc_cuda_check((be), (call), #call, __FILE__, __LINE__)
#define QC_CUBLAS(be, call) qc_cublas_check((be), (call), #call, __FILE__, __LINE__)
/* After every kernel launch: a bad configuration surfaces here, naming the kernel. */
#define QC_LAUNCHED(be, kernel_name) \
    qc_cuda_check((be), cudaGetLastError(), "launch of " kernel_name, __FILE__, __LINE__)

/* Fill be->err with a non-CUDA error (bad argument, unsupported type); returns -1. */
int qc_cuda_value_error(qc_backend *be, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Grow a device scratch buffer to at least `bytes` (the old contents are not kept). */
int qc_cuda_scratch(qc_backend *be, void **buf, size_t *cap, size_t bytes);

/* ---- launchers: qc_cuda_<op> for each op of QC_BACKEND_OPS, of its type qc_op_<op>
 * (backend.h), in the op's file or its closest relative's (add, swiglu: elementwise.cu;
 * matmul_add: matmul.cu; rope_kv_store: rope.cu); cuda_backend.cu's table calls them on the
 * backend's device. ---- */
#define QC_CUDA_DECLARE(name) qc_op_##name qc_cuda_##name;
QC_BACKEND_OPS(QC_CUDA_DECLARE)
#undef QC_CUDA_DECLARE

/* The tensor-core flash attention over an F16 cache (flash_attention.cu): the attention op
 * without scores or probabilities, for any n (decode splits the keys over blocks). A decode's
 * merge also leaves its output's 8-bit form at out_qs / out_ds (qc_q8x's layout) where they are
 * not NULL, and then returns 1; else 0, or -1 on an error. */
int qc_cuda_flash_attention(qc_backend *be, const float *q, qc_kv_cache cache, const int32_t *pos,
                            int n, int n_head, int n_head_kv, int head_dim, float *out, int8_t *out_qs,
                            float2 *out_ds);
/* matmul_qkv_rope of x plus x_sum's fixed-point sums (a folded down projection's; NULL: none),
 * which also go to x_out (one token: qkv_attention's fallback): added by a sum_add launch
 * before, or by the norm's quantize launch (cu->norm_sums) or the q, k, v launch's blocks
 * (cu->qkv_norm) (matmul_multi.cu). */
int qc_cuda_matmul_qkv_rope_sum(qc_backend *be, const qc_matmul_part *qkv, const float *x, const int64_t *x_sum,
                                float *x_out, int n, const float *norm_w, float eps, const int32_t *pos, int n_head,
                                int n_head_kv, int head_dim, float theta, qc_kv_cache cache);
/* Whether the attention op (without scores) of n tokens over n_kv keys runs the split-K
 * kernel, as the persistent decode kernel does (attention.cu). */
int qc_cuda_attention_splits(qc_backend *be, int kv_type, int n, int n_kv, int n_head, int head_dim);
/* feed_draw (backend.h): the next step's inputs from the draw in result (sample.cu). */
int qc_cuda_feed_draw(qc_backend *be, const void *result, void *state, int32_t *ids, int32_t *pos,
                      int64_t n_vocab);
/* matmul_draw (backend.h): the output norm's 8-bit x, the lm_head's four-row kernel with the greedy
 * draw, then its finish (matmul.cu). */
int qc_cuda_matmul_draw(qc_backend *be, const qc_weight *w, const float *x, const int64_t *x_sum, const float *norm_w,
                        float eps, float *logits, const void *state, void *result, int32_t *ids, int32_t *pos);

/* swiglu_down_prepare and swiglu_down (backend.h; matmul_swiglu.cu), and the slices they read
 * (down_slices.cu): made once per weight (0 or -1), freed with the weight's rows `data`, or all
 * where data is NULL. */
int qc_cuda_swiglu_down_prepare(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down);
int qc_cuda_swiglu_down(qc_backend *be, const qc_weight *w_gate, const qc_weight *w_up, const qc_weight *w_down,
                        const float *x, const float *norm_w, float eps, float *act, int64_t *sum, int64_t *clear);
int qc_cuda_make_down_slices(qc_backend *be, const qc_weight *w_down);
void qc_cuda_free_down_slices(qc_cuda *cu, const void *data);

/* The decode_step and decode_step_takes ops of backend.h (decode_step.cu). */
int qc_cuda_decode_step_takes(qc_backend *be, const qc_decode_plan *plan, int n_kv);
int qc_cuda_decode_step(qc_backend *be, const qc_decode_plan *plan);
/* Once per backend, before any recording: the flash kernels' shared-memory allowance. */
int qc_cuda_flash_attention_init(qc_backend *be);
/* qkv_attention.cu: which cluster sizes its kernel can take on this GPU (qc_cuda's qa_most). */
void qc_cuda_qkv_attention_init(qc_backend *be);
/* Whether qc_cuda_flash_attention takes this head_dim. */
static inline int qc_cuda_flash_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128; }
/* x normalised by rmsnorm into a backend scratch buffer (grown outside the decode path), for
 * the fused ops' norm where their kernels cannot normalise in shared memory. */
int qc_cuda_norm_to_scratch(qc_backend *be, const float *x, const float *norm_w, int n, int64_t cols,
                            float eps, const float **normed);

/* A cache element from float32 (round to nearest even) and back: the one conversion every
 * kernel that writes or reads a KV cache uses. */
__device__ __forceinline__ void qc_kv_put(float *p, float x) { *p = x; }
__device__ __forceinline__ void qc_kv_put(__half *p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ float qc_kv_float(float v) { return v; }
__device__ __forceinline__ float qc_kv_float(__half v) { return __half2float(v); }
template <typename KV> __device__ __forceinline__ float qc_kv_get(const KV *p) { return qc_kv_float(*p); }
/* x as a cache of KV holds it, as a float */
template <typename KV> __device__ __forceinline__ float qc_kv_rounded(float x) {
    KV k;
    qc_kv_put(&k, x);
    return qc_kv_float(k);
}

/* Dequantize rows [row0, row0 + nrows) of w into dst, row-major (nrows, w->cols), as f16
 * (half_out != 0) or f32. Used by matmul's cuBLAS path. */
int qc_cuda_dequantize_rows(qc_backend *be, const qc_weight *w, int64_t row0, int64_t nrows,
                            void *dst, int half_out);
/* dst[i] = bias[i % rows] added to out[n][rows]. */
int qc_cuda_add_bias(qc_backend *be, float *out, const float *bias, int n, int64_t rows);
/* bytes (<= QC_DOWNLOAD_AHEAD_BYTES) of src into host memory mapped for the device (sample.cu) */
int qc_cuda_to_host(qc_backend *be, const void *src, void *host, int bytes);
/* The pair of draw slots that serves result (qc_cuda's draw_slot_of), given out first where
 * assign; -1 where none does (or, assigning, none is free). */
int qc_cuda_draw_pair(qc_cuda *cu, const void *result, int assign);
/* f32 -> f16, count values. */
int qc_cuda_to_half(qc_backend *be, const float *src, void *dst, int64_t count);

/* silu(g) * u = g / (1 + exp(-g)) * u in fp32 (as the reference writes it): the one expression
 * of swiglu and matmul_swiglu. Explicitly rounded operations, so that no FMA contraction with
 * the inlined expf can differ between the two kernels: they agree bit for bit. */
__device__ __forceinline__ float qc_silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

/* ---- rmsnorm's numbers ----
 * Every norm of x (rmsnorm.cu; the fused ops' norms, qc_gemv.cuh's qc_norm_row_scale and
 * qkv_attention.cu's qc_qa_norm_quantize) computes the same value: QC_NORM_ROW_THREADS fmaf
 * chains (chain t over x[t], x[t + 256], ...: each kernel loads them its own way), each warp's
 * chains added by qc_norm_warp_sum, its eight warp sums added in warp order, and the scale
 * 1 / sqrtf(ss / dim + eps) with IEEE sqrt and division (nvcc's defaults), the CPU's formula.
 * So the fused ops and the rmsnorm op agree bit for bit. The norm-after scale (qc_gemv_q8.cuh, "a
 * norm's scale after the dot products") adds blocks' sums in another order, with the same
 * shuffles and formula. */
#define QC_NORM_ROW_THREADS 256
/* v summed over the 32 lanes of a warp (into every lane), in the norms' order: xor 16, 8, .., 1. */
__device__ __forceinline__ float qc_norm_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
/* 1 / rms: the scale of a row of n values (n converted by the caller) whose squares sum to ss. */
__device__ __forceinline__ float qc_rms_scale(float ss, float n, float eps) {
    return 1.0f / sqrtf(ss / n + eps);
}
/* The scale from the eight warp sums (warp_ss[0 .. QC_NORM_ROW_THREADS / 32)), added in order. */
__device__ __forceinline__ float qc_norm_scale_of_warps(const float *warp_ss, int dim, float eps) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < QC_NORM_ROW_THREADS / 32; i++) total += warp_ss[i];
    return qc_rms_scale(total, (float)dim, eps);
}

/* ---- the fixed-point sums of a folded down projection (swiglu_down, backend.h) ----
 * A value into them (qc_sum_value's inverse) and back; x + qc_sum_to_float(sum) is the residual
 * stream that their consumers read (qkv_attention.cu, the output norm of matmul.cu, sum_add). */
__device__ __forceinline__ unsigned long long qc_sum_of(float v) {
    return (unsigned long long)__float2ll_rn(v * 4294967296.0f);
}
__device__ __forceinline__ float qc_sum_to_float(long long s) { return __ll2float_rn(s) * (1.0f / 4294967296.0f); }
/* x[i], plus its sum where x_sum is not NULL: the same float in every consumer */
__device__ __forceinline__ float qc_x_plus_sum(const float *x, const long long *x_sum, int64_t i) {
    float v = __ldcg(x + i);
    if (x_sum) v += qc_sum_to_float(__ldcg(x_sum + i));
    return v;
}

/* ---- programmatic dependent launch (PDL, sm_90+) ----
 * A decode step is ~250 small kernels, each a few microseconds; between two of them the GPU
 * used to drain the first, then launch, schedule and ramp up the second, with no weight in
 * flight. With PDL the next kernel's blocks are scheduled while the current kernel still runs:
 * they prefetch their weights (which no kernel writes) and then wait in qc_grid_start until
 * every earlier kernel has finished and its writes are visible.
 *
 * The rule every kernel follows: each thread calls qc_grid_start() before it reads anything a
 * kernel writes (activations, caches, counters, logits) and before it writes anything, and
 * before it returns, so that no grid can finish before the grid it depends on. Before that call
 * it may only read what no kernel writes: weights, and the token ids and positions, which the
 * host uploads by copies (a copy in the stream completes before any later kernel starts; the
 * PDL edge exists only between two kernels) or feed_draw writes as the last kernel of a recorded
 * decode step (sample.cu) for the step's next replay (a graph launch starts after the whole
 * graph before it has finished); and, in the decode attention (attention.cu's after the q/k/v
 * kernel, qkv_attention.cu's), the KV rows of keys before the eval's positions, which only
 * earlier evals wrote (qc_attention.cuh, QC_ATT_HELD). It may ask L2 for any line (qc_prefetch_line_l2:
 * a hint that returns no value, and L2 is where every write lands), such as the weights
 * (qc_gemv_prefetch) or the KV rows a split attention block will read. qc_grid_start
 * then lets the next kernel launch, so at most two grids of a stream are in flight, except
 * after a kernel that lets it launch before its own wait (qc_grid_launch_next). Without PDL
 * (older GPUs, kernels built for them, QWENCUDA_PDL=0, the cooperative persistent kernel) it
 * costs nothing: the wait of a grid launched without the attribute returns at once. */
__device__ __forceinline__ void qc_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Let the next kernel launch now, before this one's qc_grid_start: for a kernel whose successor
 * needs the time to be placed (the o projection before the feed-forward norm, matmul.cu's
 * matmul_any). Three grids are then in flight; each still waits in qc_grid_start for the one
 * before it, which finishes only after its own wait, so the order of their reads and writes is
 * unchanged. Elsewhere it was slower: after the attention norm, the q/k/v kernel's blocks came
 * 21 us a step earlier but the attention's clusters after it were placed late, -1% at 512 keys
 * and -5% at 2560; in every kernel, -3% at 2560 (bench/results/20261124-d82da0b-*;
 * 20261124-550e506-*, addendum). Measured and not kept (H200, real file, three alternating rounds
 * in one lease, 2026-12-04, report 20261204-2b650a3-nvidia-h200-ab): the folded gate/up kernel
 * launched at the start of the o projection's add_norm kernel, since its blocks still issued their
 * weight copies when the o projection ended (its first release 0.90 us after that end, stamps of
 * bf63cef): 2330.8, 2323.7, 2321.0 tok/s at 512 keys against 2382.3, 2379.2, 2383.4 (its 152
 * blocks then placed beside the attention's); the next layer's attention launched at the start of
 * the fold: 2378.0, 2389.3, 2372.0 (even); both 2292.7-2298.4. */
__device__ __forceinline__ void qc_grid_launch_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* ---- weights into shared memory before the wait ----
 * A decode GEMV block's weight rows depend on no kernel, so under PDL it can move them into its
 * own shared memory while the kernel before still runs, and after qc_grid_start only the
 * activations are an L2 round trip away. Why: %globaltimer stamps of a 0.5B decode step on the
 * H100 (bench/results/20261124-d82da0b-*) put 0.42-0.45 us between one kernel's last block and
 * the next one's release, but 1.4-4.2 us in the GEMV bodies after it, where every block loaded
 * its rows from L2 (the gate/up kernel's 152 blocks move 5.9 MB at once). What it gave there:
 * the gate/up, o and down kernels' share of a real-file step fell 232 -> 193 us, but the
 * norm-and-quantize kernels after them grew 95 -> 120 us, and the step is even with the build
 * before within noise. Folding those norms into the GEMVs was slower both ways tried then (each
 * block of the q/k/v and gate/up kernels normalising for itself, -6%; the o projection's last
 * block normalising for the gate/up kernel, -11%: bench/results/20261124-550e506-*, addendum);
 * what paid was launching the gate/up kernel early, whose copies then ran under the o projection
 * (550e506), later reading its rows ahead into L2 (read_ahead, d903914), and at last the o
 * projection's 32-row blocks handing over the norm's 8-bit input with its scale applied after
 * gate/up (matmul.cu, qc_gemv_q8_add_norm_kernel; dbed2c2).
 * qc_copy_to_shared copies global bytes [src, src + bytes) to shared memory at dst + (src % 16),
 * which it returns (the same 16-byte phase, so 16-byte copies line up; dst is 16-byte aligned
 * with bytes + 16 of room), by the block's threads: cp.async (sm_80+, no register holds the bytes)
 * for the aligned 16-byte pieces, plain loads for the few bytes before and after them. Every
 * thread calls it, and qc_copy_wait before reading the copy.
 * Measured and not kept (H200, real file, report 20261202-8d68ef1-*, addendum): those edge bytes
 * loaded into a register before the wait and stored after it, since a store waits for its load:
 * step stamps had put the Q6_K down projection's last blocks (3990-byte rows, one in eight
 * 16-byte aligned) at their wait up to 2 us after the grid's first release, its Q4_K layers'
 * (aligned rows) within 0.25 us. With the change they came within 0.1-1.5 us and the grid's
 * share of a stamped step fell 3.22 -> 3.02 us, but decode went 2156.2-2165.9 -> 2143.1-2151.8
 * tok/s at 512 keys and 1864.2-1868.8 -> 1856.4-1863.0 at 2560 (three alternating rounds).
 * Measured and not kept (H200, real file, three alternating rounds in one lease, 2026-12-03,
 * against 25ac1c7): the aligned middle as one bulk copy by thread 0 (cp.async.bulk into shared
 * memory, counted by an mbarrier that qc_copy_wait arrives at and waits on), so that the 16-byte
 * pieces of every kernel's copies leave the SMs' load queues to the copy engine: 2229.7, 2221.4,
 * 2228.9 tok/s at 512 keys and 1894.9, 1890.3, 1894.3 at 2560, against 2262.8, 2281.1, 2272.9
 * and 1928.6, 1936.9, 1937.4 (-2%). */
__device__ __forceinline__ const uint8_t *qc_copy_to_shared(uint8_t *dst, const uint8_t *src, int64_t bytes) {
    const uintptr_t s = (uintptr_t)src, lo = (s + 15) & ~(uintptr_t)15, hi = (s + (uintptr_t)bytes) & ~(uintptr_t)15;
    uint8_t *d = dst + (s & 15);
    const uintptr_t a = lo < s + (uintptr_t)bytes ? lo : s + (uintptr_t)bytes, b = hi > a ? hi : a;
    for (uintptr_t p = a + 16 * threadIdx.x; p < b; p += 16 * blockDim.x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(d + (p - s))),
                     "l"((const void *)p));
#else
        *(uint4 *)(d + (p - s)) = *(const uint4 *)p;
#endif
    }
    /* the head [s, a) and the tail [b, s + bytes): under 16 bytes each */
    const int head = (int)(a - s), tail = (int)(s + (uintptr_t)bytes - b);
    if ((int)threadIdx.x < head) d[threadIdx.x] = src[threadIdx.x];
    else if ((int)threadIdx.x < head + tail) d[(b - s) + (threadIdx.x - head)] = src[(b - s) + (threadIdx.x - head)];
    return d;
}
/* Shared memory for a copy of `bytes` (its 16-byte phase and rounding), and the most a kernel
 * takes without raising its limit. */
__host__ __device__ static inline size_t qc_shared_copy_bytes(int64_t bytes) { return (size_t)((bytes + 16 + 15) / 16 * 16); }
#define QC_SHARED_COPY_MAX (48u << 10)
/* After qc_grid_start: this thread's copies done (qc_copy_wait_own), then every thread's (the
 * block's barrier). */
__device__ __forceinline__ void qc_copy_wait_own() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
__device__ __forceinline__ void qc_copy_wait() {
    qc_copy_wait_own();
    __syncthreads();
}

/* Copies in two groups (swiglu_down's gate and up rows, then its slice of w_down): after the
 * first group's qc_copy_to_shared calls and after the second's, qc_copy_commit; after
 * qc_grid_start, qc_copy_wait_but_last for the first group (this thread's, then the block's
 * barrier), and for the second qc_copy_wait, or qc_copy_wait_own (this thread's only) before a
 * block barrier of the kernel's own. */
__device__ __forceinline__ void qc_copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void qc_copy_wait_but_last() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#endif
    __syncthreads();
}

/* Ask L2 for the 128-byte line of p. A hint: no fault, no result, nothing to wait for. */
__device__ __forceinline__ void qc_prefetch_line_l2(const void *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

/* The lines of bytes [p, p + bytes), spread over the block's threads; for weights before
 * qc_grid_start. */
__device__ __forceinline__ void qc_prefetch_l2(const void *p, int64_t bytes) {
    const char *c = (const char *)((uintptr_t)p & ~(uintptr_t)127);
    const char *end = (const char *)p + bytes;
    for (c += 128 * (int64_t)threadIdx.x; c < end; c += 128 * (int64_t)blockDim.x) qc_prefetch_line_l2(c);
}

/* This block's share of the read-ahead weights into L2: a slice of each, whole lines, the grid's
 * blocks together covering them. Before qc_grid_start (weights: no kernel writes them).
 * Why: a 0.5B decode step's gate/up kernel copies its 6 MB of rows into shared memory from the
 * moment it is placed, which is just before the feed-forward norm runs; %globaltimer stamps on
 * the H100 put that norm's release 1.8 us after the o projection ended, where every other kernel
 * waits 0.7 us. The o projection's 224 blocks are placed during the attention, whose loads leave
 * HBM mostly idle: asked then, the rows are in L2 when the copies start. Real file, same-lease
 * A/B in two leases: 1657-1674 -> 1682-1688 tok/s at 512 keys and 1497-1509 -> 1508-1519 at
 * 2560; 1753-1755 -> 1775-1786 and 1551-1557 -> 1564-1573 (bench/results/20261124-d903914-*).
 * The down projection names the next layer's q, k and v the same way (session.c), and the
 * qkv_attention launch then leaves out its warps' own row prefetches (qkv_attention.cu). */
__device__ __forceinline__ void qc_l2_ahead_issue(const qc_l2_ahead &a) {
#pragma unroll
    for (int k = 0; k < QC_READ_AHEAD_MAX; k++) {
        const int64_t share = ((a.bytes[k] + gridDim.x - 1) / gridDim.x + 127) & ~(int64_t)127;
        const int64_t begin = (int64_t)blockIdx.x * share;
        if (blockIdx.y == 0 && begin < a.bytes[k])
            qc_prefetch_l2(a.p[k] + begin, a.bytes[k] - begin < share ? a.bytes[k] - begin : share);
    }
}

/* kernel<<<grid, block, smem, cu->stream>>>(args...), as a programmatic dependent launch where
 * cu->pdl, in thread-block clusters of `cluster` blocks where that is more than one (sm_90: the
 * caller checks cu->clusters); a bad configuration surfaces in QC_LAUNCHED, as it does after
 * <<<>>>. */
template <typename... Params, typename... Args>
static inline void qc_launch_ex(const qc_cuda *cu, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                dim3 cluster, Args &&...args) {
    cudaLaunchAttribute attr[2];
    unsigned n_attr = 0;
    if (cu->pdl) {
        attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
        n_attr++;
    }
    if (cluster.x * cluster.y * cluster.z > 1) {
        attr[n_attr].id = cudaLaunchAttributeClusterDimension;
        attr[n_attr].val.clusterDim.x = cluster.x;
        attr[n_attr].val.clusterDim.y = cluster.y;
        attr[n_attr].val.clusterDim.z = cluster.z;
        n_attr++;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cu->stream;
    cfg.attrs = attr;
    cfg.numAttrs = n_attr;
    (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<Args &&>(args)...);
}

template <typename... Params, typename... Args>
static inline void qc_launch(const qc_cuda *cu, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             Args &&...args) {
    qc_launch_ex(cu, kernel, grid, block, smem, dim3(1, 1, 1), static_cast<Args &&>(args)...);
}

/* Grid size for a grid-stride loop over count items with `threads` per block. */
static inline unsigned qc_grid_for(int64_t count, int threads, int max_blocks) {
    int64_t b = (count + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > max_blocks) b = max_blocks;
    return (unsigned)b;
}

#endif /* QC_CUDA_CUH */
