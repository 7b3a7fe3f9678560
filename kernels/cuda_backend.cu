/* cuda_backend.cu: the CUDA implementation of backend.h: device selection, one stream and one
 * cuBLAS handle per backend, memory, weights (uploaded as stored: no float copy of the model),
 * and the ops table whose entries are the launchers of the op files (embed.cu, rmsnorm.cu,
 * matmul.cu, matmul_multi.cu, matmul_swiglu.cu, rope.cu, kv_store.cu, attention.cu, flash_attention.cu,
 * elementwise.cu, argmax.cu, sample.cu), and the persistent decode kernel (decode_step.cu).
 *
 * Every CUDA/cuBLAS call goes through QC_CUDA / QC_CUBLAS (qc_cuda.cuh), which name the call,
 * the error and the source line in be->err. Non-sticky errors (out of memory, bad arguments) are
 * cleared, so the backend stays usable after them; a sticky error (an illegal address in a
 * kernel) poisons the CUDA context of the process, as it does for every CUDA program.
 */
#include "qc_cuda.cuh"
#include "qc_slices.cuh"
#include "qc_cuda_api.h"
#include "qc_dequant.cuh"
#include "qc_gemv_q8.cuh"
#include "sampler.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- */
/* errors */

int qc_cuda_fail(qc_backend *be, cudaError_t e, const char *call, const char *file, int line) {
    /* a non-sticky error must not be reported again by the next launch check */
    cudaGetLastError();
    const char *base = strrchr(file, '/');
    return qc_fail(&be->err, QC_ERR_CUDA, "%s failed: %s (%s) [%s:%d]", call, cudaGetErrorString(e),
                   cudaGetErrorName(e), base ? base + 1 : file, line);
}

int qc_cublas_fail(qc_backend *be, cublasStatus_t s, const char *call, const char *file, int line) {
    cudaGetLastError();
    const char *base = strrchr(file, '/');
    return qc_fail(&be->err, QC_ERR_CUDA, "%s failed: %s (%s) [%s:%d]", call, cublasGetStatusString(s),
                   cublasGetStatusName(s), base ? base + 1 : file, line);
}

int qc_cuda_value_error(qc_backend *be, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    be->err.kind = QC_ERR_VALUE;
    vsnprintf(be->err.msg, sizeof be->err.msg, fmt, ap);
    va_end(ap);
    return -1;
}

/* The calling thread's current device must be ours: several backends (cuda:0, cuda:1) can live
 * in one process, and Python may call from any thread. */
static int use_device(qc_backend *be) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == be->device) return 0;
    return QC_CUDA(be, cudaSetDevice(be->device));
}

/* Compiled as every op kernel is (one nvcc line for all .cu files): its PTX version is theirs. */
__global__ void qc_pdl_probe_kernel() {}

/* Whether the device is sm_90 or newer and the code it runs was compiled for sm_90 or newer: a
 * build for older GPUs has no griddepcontrol or cluster instructions in its kernels (running it
 * JIT-compiled on an H100 must not let a kernel start before its inputs are written). */
static int sm90_code(qc_backend *be, int *yes) {
    *yes = 0;
    int major = 0;
    cudaFuncAttributes fa;
    if (QC_CUDA(be, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be->device)) < 0 ||
        QC_CUDA(be, cudaFuncGetAttributes(&fa, qc_pdl_probe_kernel)) < 0)
        return -1;
    *yes = major >= 9 && fa.ptxVersion >= 90;
    return 0;
}

/* An environment switch read at creation: on unless it is "0". */
static int env_on(const char *name) {
    const char *env = getenv(name);
    return !(env && strcmp(env, "0") == 0);
}
/* whether environment variable name is set to value (a switch that is off by default) */
static int env_is(const char *name, const char *value) {
    const char *env = getenv(name);
    return env && strcmp(env, value) == 0;
}

/* ---------------------------------------------------------------------------------------- */
/* memory */

static int cu_alloc(qc_backend *be, size_t bytes, void **out) {
    *out = NULL;
    if (use_device(be) < 0) return -1;
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *out = NULL;
        cudaGetLastError();
        /* out of GPU memory is MemoryError (the caller can free something and go on) */
        return qc_fail(&be->err, e == cudaErrorMemoryAllocation ? QC_ERR_NOMEM : QC_ERR_CUDA,
                       "cudaMalloc(%zu bytes) failed on cuda:%d: %s (%s)", bytes, be->device,
                       cudaGetErrorString(e), cudaGetErrorName(e));
    }
    return 0;
}

static void cu_free(qc_backend *be, void *ptr) {
    if (ptr == NULL) return;
    qc_cuda *cu = qc_cuda_of(be);
    for (int i = 0; i < QC_DRAW_PAIRS; i++)   /* a session's result buffer: its draw slots are free again */
        if (cu->draw_slot_of[i] == ptr) cu->draw_slot_of[i] = NULL;
    if (use_device(be) < 0) return;
    /* cudaFree waits for the device: no queued kernel can still be using ptr */
    if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
}

/* A write of [dst, dst + bytes) over the row whose normalised 8-bit form q8x_norm holds ends it
 * (a capture's copy out of that row does not). */
static void forget_norm_of(qc_cuda *cu, const void *dst, size_t bytes) {
    const char *d = (const char *)dst, *x = (const char *)cu->norm_of;
    if (x && d < x + cu->norm_cols * (int64_t)sizeof(float) && x < d + bytes) cu->norm_of = NULL;
}

static int cu_upload(qc_backend *be, void *dst, const void *host_src, size_t bytes) {
    if (bytes == 0) return 0;
    if (use_device(be) < 0) return -1;
    /* from pageable memory the copy is staged before the call returns, so the caller may reuse
     * host_src at once. dst may be an activation whose 8-bit form q8x held: no longer. */
    qc_cuda_of(be)->q8x_of = NULL;
    forget_norm_of(qc_cuda_of(be), dst, bytes);
    qc_cuda_forget_rope(qc_cuda_of(be));
    return QC_CUDA(be, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, qc_cuda_of(be)->stream));
}

static int cu_download(qc_backend *be, void *host_dst, const void *src, size_t bytes) {
    qc_cuda *cu = qc_cuda_of(be);
    if (use_device(be) < 0) return -1;
    if (bytes && QC_CUDA(be, cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cu->stream)) < 0)
        return -1;
    return QC_CUDA(be, cudaStreamSynchronize(cu->stream));
}

static int cu_copy(qc_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return 0;
    if (use_device(be) < 0) return -1;
    qc_cuda_of(be)->q8x_of = NULL;   /* as in cu_upload */
    forget_norm_of(qc_cuda_of(be), dst, bytes);
    qc_cuda_forget_rope(qc_cuda_of(be));
    return QC_CUDA(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, qc_cuda_of(be)->stream));
}

static int cu_synchronize(qc_backend *be) {
    if (use_device(be) < 0) return -1;
    return QC_CUDA(be, cudaStreamSynchronize(qc_cuda_of(be)->stream));
}

int qc_cuda_scratch(qc_backend *be, void **buf, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return 0;
    /* cudaFree synchronizes the device, so pending users of the old buffer are done */
    if (*buf) cudaFree(*buf);
    *buf = NULL;
    *cap = 0;
    cudaError_t e = cudaMalloc(buf, bytes);
    if (e != cudaSuccess) {
        *buf = NULL;
        cudaGetLastError();
        return qc_fail(&be->err, e == cudaErrorMemoryAllocation ? QC_ERR_NOMEM : QC_ERR_CUDA,
                       "cudaMalloc(%zu bytes) for the matmul scratch failed on cuda:%d: %s (%s)",
                       bytes, be->device, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    *cap = bytes;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* weights: the stored bytes, uploaded as they are */

static int cu_weight_load(qc_backend *be, qc_weight *w) {
    w->data = NULL;
    if (!qc_cuda_type_supported(w->type)) {
        const qc_type_traits *tr = qc_type_get(w->type);
        return qc_fail(&be->err, QC_ERR_VALUE, "weight type %s is not supported by the CUDA backend",
                       tr && tr->name ? tr->name : "(unknown)");
    }
    void *dev = NULL;
    if (cu_alloc(be, w->nbytes, &dev) < 0) return -1;
    if (cu_upload(be, dev, w->host, w->nbytes) < 0) {
        cu_free(be, dev);
        return -1;
    }
    w->data = dev;
    return 0;
}

static void cu_weight_free(qc_backend *be, qc_weight *w) {
    if (w->data) {
        if (use_device(be) == 0) qc_cuda_free_down_slices(qc_cuda_of(be), w->data);
        cu_free(be, w->data);
    }
    w->data = NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* ops: each entry of the table makes the backend's device current, then calls the op's launcher
 * (qc_cuda_<op>, qc_cuda.cuh) with the same arguments: on_device<qc_op_embed>::run<qc_cuda_embed>
 * is the function of type qc_op_embed that does so for embed. */

template <typename Op> struct on_device;
template <typename... Args> struct on_device<int(qc_backend *, Args...)> {
    template <int (*launch)(qc_backend *, Args...)> static int run(qc_backend *be, Args... args) {
        if (use_device(be) < 0) return -1;
        return launch(be, args...);
    }
};

/* ---------------------------------------------------------------------------------------- */
/* recording: a decode step captured once as a CUDA graph and replayed every step */

static int cu_record_begin(qc_backend *be) {
    if (use_device(be) < 0) return -1;
    qc_cuda_forget_rope(qc_cuda_of(be));
    /* thread-local mode: other threads' CUDA calls are neither captured nor forbidden */
    return QC_CUDA(be, cudaStreamBeginCapture(qc_cuda_of(be)->stream, cudaStreamCaptureModeThreadLocal));
}

static int cu_record_end(qc_backend *be, void **recording) {
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    *recording = NULL;
    qc_cuda_forget_rope(qc_cuda_of(be));
    cudaError_t e = cudaStreamEndCapture(qc_cuda_of(be)->stream, &graph);
    if (e != cudaSuccess) {
        if (graph) cudaGraphDestroy(graph);
        return qc_cuda_fail(be, e, "cudaStreamEndCapture", __FILE__, __LINE__);
    }
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) return qc_cuda_fail(be, e, "cudaGraphInstantiate", __FILE__, __LINE__);
    *recording = exec;
    return 0;
}

static int cu_replay(qc_backend *be, void *recording) {
    if (use_device(be) < 0) return -1;
    qc_cuda_forget_rope(qc_cuda_of(be));
    return QC_CUDA(be, cudaGraphLaunch((cudaGraphExec_t)recording, qc_cuda_of(be)->stream));
}

/* download_start (backend.h): src into the next slot of mapped host memory by a one-warp kernel
 * (sample.cu, qc_cuda_to_host), then the slot's event. Why not cudaMemcpyAsync: between two
 * replays of a pipelined decode step the copy engine started 2.6-8.9 us after the step's last
 * kernel and took 1.4 us, and the next replay waited for it; the kernel leaves 1.6 us between
 * the steps (H100, synthetic 0.5B Q4_K_M, CUPTI: 491.6 against 498.7 us a step at 512 keys).
 * QWENCUDA_COPY_KERNEL=0 at creation takes the copy engine, to compare. */
static int cu_download_start(qc_backend *be, const void *src, size_t bytes, int *ticket) {
    qc_cuda *cu = qc_cuda_of(be);
    *ticket = -1;
    if (bytes > QC_DOWNLOAD_AHEAD_BYTES)
        return qc_cuda_value_error(be, "download_start: %zu bytes (at most %d)", bytes, QC_DOWNLOAD_AHEAD_BYTES);
    if (use_device(be) < 0) return -1;
    if (cu->ahead_host == NULL) {
        void *host = NULL;
        void *host_dev = NULL;
        if (QC_CUDA(be, cudaHostAlloc(&host, QC_DOWNLOAD_TICKETS * QC_DOWNLOAD_AHEAD_BYTES, cudaHostAllocMapped)) < 0)
            return -1;
        if (QC_CUDA(be, cudaHostGetDevicePointer(&host_dev, host, 0)) < 0) {
            cudaFreeHost(host);
            return -1;
        }
        for (int i = 0; i < QC_DOWNLOAD_TICKETS; i++) {
            if (QC_CUDA(be, cudaEventCreateWithFlags(&cu->ahead_copied[i], cudaEventDisableTiming)) < 0) {
                while (i-- > 0) cudaEventDestroy(cu->ahead_copied[i]);
                cudaFreeHost(host);
                return -1;
            }
        }
        cu->ahead_host = (uint8_t *)host;
        cu->ahead_host_dev = (uint8_t *)host_dev;
    }
    const int t = (int)(cu->next_ticket % QC_DOWNLOAD_TICKETS);
    const size_t at = (size_t)t * QC_DOWNLOAD_AHEAD_BYTES;
    const int copied = cu->copy_kernel ? qc_cuda_to_host(be, src, cu->ahead_host_dev + at, (int)bytes)
                                       : QC_CUDA(be, cudaMemcpyAsync(cu->ahead_host + at, src, bytes, cudaMemcpyDeviceToHost,
                                                                     cu->stream));
    if (copied < 0 || QC_CUDA(be, cudaEventRecord(cu->ahead_copied[t], cu->stream)) < 0) return -1;
    cu->next_ticket++;
    *ticket = t;
    return 0;
}

static int cu_download_finish(qc_backend *be, int ticket, void *host_dst, size_t bytes) {
    qc_cuda *cu = qc_cuda_of(be);
    if (ticket >= QC_DOWNLOAD_TICKETS && ticket < QC_DOWNLOAD_TICKETS + 2 * QC_DRAW_PAIRS &&
        bytes <= sizeof(qc_sample_result)) {   /* draw_ticket's */
        const int slot = ticket - QC_DOWNLOAD_TICKETS;
        if (use_device(be) < 0 || QC_CUDA(be, cudaEventSynchronize(cu->draw_copied[slot])) < 0) return -1;
        memcpy(host_dst, (const qc_sample_result *)cu->draw_host + slot, bytes);
        return 0;
    }
    if (ticket < 0 || ticket >= QC_DOWNLOAD_TICKETS || cu->ahead_host == NULL || bytes > QC_DOWNLOAD_AHEAD_BYTES)
        return qc_cuda_value_error(be, "download_finish: no copy of %zu bytes has ticket %d", bytes, ticket);
    if (use_device(be) < 0 || QC_CUDA(be, cudaEventSynchronize(cu->ahead_copied[ticket])) < 0) return -1;
    memcpy(host_dst, cu->ahead_host + ticket * QC_DOWNLOAD_AHEAD_BYTES, bytes);
    return 0;
}

int qc_cuda_draw_pair(qc_cuda *cu, const void *result, int assign) {
    int free_pair = -1;
    for (int i = 0; i < QC_DRAW_PAIRS; i++) {
        if (cu->draw_slot_of[i] == result) return i;
        if (free_pair < 0 && cu->draw_slot_of[i] == NULL) free_pair = i;
    }
    if (!assign || free_pair < 0) return -1;
    cu->draw_slot_of[free_pair] = result;
    return free_pair;
}

/* draw_ticket (backend.h): the draw is in its slot once the replay's finish kernel completes
 * (matmul.cu, qc_head_draw_finish_kernel): the slot's event only. Ticket QC_DOWNLOAD_TICKETS + s
 * names slot s (2 pair + pos % 2). Why: the copy kernel was a launch of its own between two steps
 * (report 20261202-2445fcd's loop: qc_to_host_kernel started 2.2 us after the finish kernel ended
 * and ran 1.2 us, and the next step's first kernel 1.6 us after it). */
static int cu_draw_ticket(qc_backend *be, const void *result, int pos, int *ticket) {
    qc_cuda *cu = qc_cuda_of(be);
    const int pair = cu->draw_to_host ? qc_cuda_draw_pair(cu, result, 0) : -1;
    if (pair < 0) return cu_download_start(be, result, sizeof(qc_sample_result), ticket);
    const int slot = 2 * pair + (pos & 1);
    *ticket = -1;
    if (use_device(be) < 0 || QC_CUDA(be, cudaEventRecord(cu->draw_copied[slot], cu->stream)) < 0) return -1;
    *ticket = QC_DOWNLOAD_TICKETS + slot;
    return 0;
}

static void cu_recording_free(qc_backend *be, void *recording) {
    if (recording == NULL || use_device(be) < 0) return;
    if (cudaGraphExecDestroy((cudaGraphExec_t)recording) != cudaSuccess) cudaGetLastError();
}

static int cu_decode_step_takes(qc_backend *be, const qc_decode_plan *plan, int n_kv) {
    if (use_device(be) < 0) {
        be->err.kind = QC_OK;   /* no: the step runs op by op, and reports its own errors */
        return 0;
    }
    return qc_cuda_decode_step_takes(be, plan, n_kv);
}

/* ---------------------------------------------------------------------------------------- */
/* build / destroy */

static void cu_destroy(qc_backend *be) {
    if (be == NULL) return;
    qc_cuda *cu = qc_cuda_of(be);
    if (cu) {
        if (cudaSetDevice(be->device) == cudaSuccess) {
            if (cu->stream) cudaStreamSynchronize(cu->stream);
            if (cu->scratch_w) cudaFree(cu->scratch_w);
            if (cu->scratch_x) cudaFree(cu->scratch_x);
            if (cu->scratch_up) cudaFree(cu->scratch_up);
            if (cu->attn_part) cudaFree(cu->attn_part);
            if (cu->scratch_norm) cudaFree(cu->scratch_norm);
            if (cu->attn_done) cudaFree(cu->attn_done);
            if (cu->q8x) cudaFree(cu->q8x);
            if (cu->norm_ss) cudaFree(cu->norm_ss);
            if (cu->rope_cs) cudaFree(cu->rope_cs);
            if (cu->dec_sync) cudaFree(cu->dec_sync);
            qc_cuda_free_down_slices(cu, NULL);
            if (cu->sample_part) cudaFree(cu->sample_part);
            if (cu->sample_done) cudaFree(cu->sample_done);
            if (cu->draw_best) cudaFree(cu->draw_best);
            if (cu->draw_host) {
                for (int i = 0; i < 2 * QC_DRAW_PAIRS; i++)
                    if (cu->draw_copied[i]) cudaEventDestroy(cu->draw_copied[i]);
                cudaFreeHost(cu->draw_host);
            }
            if (cu->ahead_host) {
                for (int i = 0; i < QC_DOWNLOAD_TICKETS; i++) cudaEventDestroy(cu->ahead_copied[i]);
                cudaFreeHost(cu->ahead_host);
            }
            if (cu->blas) cublasDestroy(cu->blas);
            if (cu->stream) cudaStreamDestroy(cu->stream);
        }
        cudaGetLastError();
        free(cu);
    }
    free(be);
}

/* read_ahead (backend.h): the hint waits in cu->ahead for the next matmul or matmul_add. One that
 * adds up to more than a quarter of L2 is dropped: its lines would evict one another, and the
 * step's activations and keys, before their op reads them.
 * Measured and not kept: the last layer's down projection asking L2 for the lm_head's first
 * quarter of L2 (15 MB on the H200) or its first 6 MB, a hint over the quarter cut instead of
 * dropped (H200, real file, three alternating rounds in one lease): 2257.1, 2254.1, 2248.8 and
 * 2252.3, 2256.2, 2260.7 tok/s at 512 keys against 2257.4, 2255.9, 2257.4 without (report
 * 20261202-2445fcd, addendum). */
static int cu_read_ahead(qc_backend *be, const qc_weight *const *w, int n) {
    qc_cuda *cu = qc_cuda_of(be);
    if (n < 0 || n > QC_READ_AHEAD_MAX) return qc_cuda_value_error(be, "read_ahead: %d weights (0..%d)", n, QC_READ_AHEAD_MAX);
    cu->ahead = qc_l2_ahead{};
    /* a down projection prepared for swiglu_down is read ahead as its slices (down_slices.cu):
     * only a folded step names it (session.c), and that step reads nothing else of it */
    const uint8_t *p[QC_READ_AHEAD_MAX];
    int64_t bytes[QC_READ_AHEAD_MAX], total = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *slices = qc_cuda_down_slices(be, w[i]);
        p[i] = slices ? slices : (const uint8_t *)w[i]->data;
        bytes[i] = slices ? w[i]->rows * w[i]->cols / 32 * qc_slice_entry_bytes(w[i]->type) : (int64_t)w[i]->nbytes;
        total += bytes[i];
    }
    if (!cu->read_ahead || total > (int64_t)cu->l2_bytes / 4) return 0;
    for (int i = 0; i < n; i++) {
        cu->ahead.p[i] = p[i];
        cu->ahead.bytes[i] = bytes[i];
    }
    return 0;
}

/* Filled by name, so that the table follows backend.h whatever the order of its members. */
static qc_backend_ops make_cuda_ops(void) {
    qc_backend_ops ops = {};
    ops.alloc = cu_alloc;
    ops.free = cu_free;
    ops.upload = cu_upload;
    ops.download = cu_download;
    ops.copy = cu_copy;
    ops.weight_load = cu_weight_load;
    ops.weight_free = cu_weight_free;
    ops.synchronize = cu_synchronize;
    ops.destroy = cu_destroy;
#define QC_CUDA_OP(name) ops.name = on_device<qc_op_##name>::run<qc_cuda_##name>;
    QC_BACKEND_OPS(QC_CUDA_OP)
#undef QC_CUDA_OP
    ops.record_begin = cu_record_begin;
    ops.record_end = cu_record_end;
    ops.replay = cu_replay;
    ops.recording_free = cu_recording_free;
    ops.feed_draw = on_device<int(qc_backend *, const void *, void *, int32_t *, int32_t *, int64_t)>::run<qc_cuda_feed_draw>;
    ops.matmul_draw = on_device<int(qc_backend *, const qc_weight *, const float *, const int64_t *, const float *, float,
                                    float *, const void *, void *, int32_t *, int32_t *)>::run<qc_cuda_matmul_draw>;
    ops.download_start = cu_download_start;
    ops.download_finish = cu_download_finish;
    ops.draw_ticket = cu_draw_ticket;
    ops.decode_step_takes = cu_decode_step_takes;
    ops.decode_step = on_device<int(qc_backend *, const qc_decode_plan *)>::run<qc_cuda_decode_step>;
    ops.read_ahead = cu_read_ahead;
    ops.swiglu_down_prepare =
        on_device<int(qc_backend *, const qc_weight *, const qc_weight *, const qc_weight *)>::run<qc_cuda_swiglu_down_prepare>;
    ops.swiglu_down = on_device<int(qc_backend *, const qc_weight *, const qc_weight *, const qc_weight *, const float *,
                                    const float *, float, float *, int64_t *, int64_t *)>::run<qc_cuda_swiglu_down>;
    ops.sum_add = on_device<int(qc_backend *, const float *, const int64_t *, int64_t, float *)>::run<qc_cuda_sum_add>;
    return ops;
}

static const qc_backend_ops cuda_ops = make_cuda_ops();

extern "C" int qc_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" int qc_cuda_backend_create(int device, int float_gemv, qc_backend **out, qc_error *err) {
    qc_backend *be = NULL;
    qc_cuda *cu = NULL;
    int count = 0;
    cudaError_t e;
    cublasStatus_t bs;
    *out = NULL;

    e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return qc_fail(err, QC_ERR_CUDA, "device='cuda:%d': no usable CUDA device (cudaGetDeviceCount: %s, %s)",
                       device, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    if (count == 0) return qc_fail(err, QC_ERR_CUDA, "device='cuda:%d': no CUDA device is visible", device);
    if (device < 0 || device >= count)
        return qc_fail(err, QC_ERR_CUDA, "device='cuda:%d': no such device (%d CUDA device%s visible: cuda:0..cuda:%d)",
                       device, count, count == 1 ? " is" : "s are", count - 1);

    be = (qc_backend *)calloc(1, sizeof *be);
    cu = (qc_cuda *)calloc(1, sizeof *cu);
    if (be == NULL || cu == NULL) {
        free(be);
        free(cu);
        return qc_fail(err, QC_ERR_NOMEM, "cuda backend: out of memory");
    }
    be->ops = &cuda_ops;
    be->name = "cuda";
    be->device = device;
    be->threads = 1;
    be->impl = cu;
    cu->gemv_q8 = !float_gemv;

#define QC_CREATE_CHECK(call)                                                                    \
    if ((e = (call)) != cudaSuccess) {                                                          \
        cudaGetLastError();                                                                      \
        qc_fail(err, QC_ERR_CUDA, "cuda:%d: %s failed: %s (%s)", device, #call,                  \
                cudaGetErrorString(e), cudaGetErrorName(e));                                     \
        goto fail;                                                                               \
    }
    QC_CREATE_CHECK(cudaSetDevice(device));
    QC_CREATE_CHECK(cudaDeviceGetAttribute(&cu->sm_count, cudaDevAttrMultiProcessorCount, device));
    QC_CREATE_CHECK(cudaDeviceGetAttribute(&cu->l2_bytes, cudaDevAttrL2CacheSize, device));
    QC_CREATE_CHECK(cudaStreamCreateWithFlags(&cu->stream, cudaStreamNonBlocking));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->attn_part, QC_ATT_PART_FLOATS * sizeof(float)));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->attn_done, QC_ATT_PAIRS * sizeof(unsigned int)));
    QC_CREATE_CHECK(cudaMemsetAsync(cu->attn_done, 0, QC_ATT_PAIRS * sizeof(unsigned int), cu->stream));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->sample_part, QC_SAMPLE_BLOCKS * sizeof(int2)));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->sample_done, sizeof(unsigned int)));
    QC_CREATE_CHECK(cudaMemsetAsync(cu->sample_done, 0, sizeof(unsigned int), cu->stream));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->draw_best, sizeof(unsigned long long)));
    QC_CREATE_CHECK(cudaMemsetAsync(cu->draw_best, 0, sizeof(unsigned long long), cu->stream));
    /* draw_ticket's slots (qc_cuda.cuh), made here so that no recording makes them */
    QC_CREATE_CHECK(cudaHostAlloc(&cu->draw_host, 2 * QC_DRAW_PAIRS * sizeof(qc_sample_result), cudaHostAllocMapped));
    QC_CREATE_CHECK(cudaHostGetDevicePointer(&cu->draw_host_dev, cu->draw_host, 0));
    for (int i = 0; i < 2 * QC_DRAW_PAIRS; i++)
        QC_CREATE_CHECK(cudaEventCreateWithFlags(&cu->draw_copied[i], cudaEventDisableTiming));
    QC_CREATE_CHECK(cudaMalloc(&cu->q8x, qc_q8x_bytes(QC_GEMV_MAX_TOKENS, QC_Q8X_MAX_COLS)));
    static_assert(QC_GEMV_MAX_TOKENS >= 3, "q8x holds three one-token regions");
    cu->q8x_act = (char *)cu->q8x + qc_q8x_bytes(1, QC_Q8X_MAX_COLS);
    cu->q8x_norm = (char *)cu->q8x + 2 * qc_q8x_bytes(1, QC_Q8X_MAX_COLS);
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->norm_ss, QC_NORM_SS_MAX_COLS / 32 * sizeof(float)));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->rope_cs, QC_ROPE_CS_MAX * sizeof(double2)));
    /* one normalised row for the fused ops of a decode step (QC_NORM_IN_BLOCK_MAX_COLS): made
     * here, so a recorded step never grows it */
    QC_CREATE_CHECK(cudaMalloc(&cu->scratch_norm, QC_Q8X_MAX_COLS * sizeof(float)));
    cu->scratch_norm_bytes = QC_Q8X_MAX_COLS * sizeof(float);
    QC_CREATE_CHECK(cudaDeviceGetAttribute(&cu->coop_launch, cudaDevAttrCooperativeLaunch, device));
    QC_CREATE_CHECK(cudaMalloc((void **)&cu->dec_sync, QC_DEC_SYNC_WORDS * sizeof(unsigned int)));
    QC_CREATE_CHECK(cudaMemsetAsync(cu->dec_sync, 0, QC_DEC_SYNC_WORDS * sizeof(unsigned int), cu->stream));
#undef QC_CREATE_CHECK
    if ((bs = cublasCreate(&cu->blas)) != CUBLAS_STATUS_SUCCESS ||
        (bs = cublasSetStream(cu->blas, cu->stream)) != CUBLAS_STATUS_SUCCESS) {
        qc_fail(err, QC_ERR_CUDA, "cuda:%d: cuBLAS setup failed: %s", device, cublasGetStatusString(bs));
        goto fail;
    }
    {
        cu->flash_decode = !env_is("QWENCUDA_DECODE_ATTENTION", "split");
        cu->flash_early = env_on("QWENCUDA_FLASH_EARLY");
        cu->flash_tail = env_is("QWENCUDA_FLASH_MERGE", "tail");
        cu->norm_sums = env_is("QWENCUDA_NORM_SUMS", "1");
        cu->qkv_norm = env_is("QWENCUDA_QKV_NORM", "1");
        int sm90 = 0;
        if (sm90_code(be, &sm90) < 0) {
            qc_fail(err, be->err.kind, "cuda:%d: %s", device, be->err.msg);
            goto fail;
        }
        /* the op kernels as programmatic dependent launches (qc_cuda.cuh), the attention's and
         * the argmax's thread-block clusters (attention.cu, argmax.cu), and the decode GEMVs'
         * weight copies to shared memory (qc_copy_to_shared), and the attention's keys loaded
         * before its wait (attention.cu, QC_ATT_HELD), and read_ahead's hints (matmul.cu), and
         * qkv_attention's one launch (qkv_attention.cu), and the lm_head's four rows a warp
         * (matmul.cu), and the greedy draw inside it (matmul_draw), and the down projection
         * folded into the gate/up kernel (swiglu_down, matmul_swiglu.cu): QWENCUDA_PDL=0,
         * QWENCUDA_CLUSTERS=0, QWENCUDA_WEIGHTS_SHARED=0, QWENCUDA_ATTENTION_HOLD=0,
         * QWENCUDA_READ_AHEAD=0, QWENCUDA_QKV_ATTENTION=0, QWENCUDA_GEMV_ROWS4=0,
         * QWENCUDA_HEAD_DRAW=0 and QWENCUDA_DOWN_FOLD=0 turn them off; QWENCUDA_COPY_KERNEL=0
         * copies download_start's bytes with cudaMemcpyAsync instead of a kernel,
         * QWENCUDA_DRAW_TO_HOST=0 the draw of a fed step by download_start's copy (draw_ticket) */
        cu->pdl = sm90 && env_on("QWENCUDA_PDL");
        cu->clusters = sm90 && env_on("QWENCUDA_CLUSTERS");
        cu->w_shared = sm90 && env_on("QWENCUDA_WEIGHTS_SHARED");
        cu->att_hold = env_on("QWENCUDA_ATTENTION_HOLD");
        cu->read_ahead = env_on("QWENCUDA_READ_AHEAD");
        cu->qkv_attention = env_on("QWENCUDA_QKV_ATTENTION");
        cu->gemv_rows4 = env_on("QWENCUDA_GEMV_ROWS4");
        cu->split_rows = env_on("QWENCUDA_SPLIT_ROWS");
        cu->head_draw = env_on("QWENCUDA_HEAD_DRAW");
        cu->copy_kernel = env_on("QWENCUDA_COPY_KERNEL");
        cu->draw_to_host = env_on("QWENCUDA_DRAW_TO_HOST");
        cu->down_fold = env_on("QWENCUDA_DOWN_FOLD");
        cu->add_norm_rw = env_is("QWENCUDA_ADD_NORM_WARP_ROWS", "4") ? 4 : 2;
    }
    qc_cuda_qkv_attention_init(be);
    if (qc_cuda_flash_attention_init(be) < 0) {
        qc_fail(err, be->err.kind, "cuda:%d: %s", device, be->err.msg);
        goto fail;
    }
    *out = be;
    return 0;
fail:
    cu_destroy(be);
    return -1;
}

extern "C" int qc_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes, qc_error *err) {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (prev >= 0) cudaSetDevice(prev);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return qc_fail(err, QC_ERR_CUDA, "cudaMemGetInfo on cuda:%d failed: %s (%s)", device,
                       cudaGetErrorString(e), cudaGetErrorName(e));
    }
    return 0;
}

extern "C" int qc_cuda_device_props(int device, qc_cuda_props *out, qc_error *err) {
    const struct { cudaDeviceAttr attr; int *dst; const char *what; } q[] = {
        {cudaDevAttrMemoryClockRate, &out->mem_clock_khz, "memory clock"},
        {cudaDevAttrGlobalMemoryBusWidth, &out->bus_width_bits, "memory bus width"},
        {cudaDevAttrMultiProcessorCount, &out->sm_count, "multiprocessor count"},
        {cudaDevAttrComputeCapabilityMajor, &out->major, "compute capability"},
        {cudaDevAttrComputeCapabilityMinor, &out->minor, "compute capability"},
    };
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        const cudaError_t e = cudaDeviceGetAttribute(q[i].dst, q[i].attr, device);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return qc_fail(err, QC_ERR_CUDA, "cuda:%d: reading its %s failed: %s (%s)", device, q[i].what,
                           cudaGetErrorString(e), cudaGetErrorName(e));
        }
    }
    return 0;
}

/* The calling thread's device becomes `device` for one call and is restored after it: the
 * functions below may run on any Python thread, whose own CUDA work must not move. */
static cudaError_t set_device_saving(int device, int *prev) {
    *prev = -1;
    cudaError_t e = cudaGetDevice(prev);
    if (e != cudaSuccess) return e;
    return *prev == device ? cudaSuccess : cudaSetDevice(device);
}

static void restore_device(int device, int prev) {
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
}

extern "C" void qc_cuda_buffer_free(int device, void *ptr) {
    int prev;
    if (ptr == NULL) return;
    /* cudaFree waits for the device, so a consumer's queued kernel cannot outlive the buffer; a
     * failure here (a context already poisoned) has no one to report to */
    if (set_device_saving(device, &prev) == cudaSuccess) cudaFree(ptr);
    cudaGetLastError();
    restore_device(device, prev);
}

extern "C" int qc_cuda_buffer_download(int device, void *host_dst, const void *src, size_t bytes, qc_error *err) {
    int prev;
    if (bytes == 0) return 0;
    cudaError_t e = set_device_saving(device, &prev);
    /* synchronous, on the legacy default stream: after the work of the default stream (torch's
     * unless told otherwise) that may have written the buffer */
    if (e == cudaSuccess) e = cudaMemcpy(host_dst, src, bytes, cudaMemcpyDeviceToHost);
    restore_device(device, prev);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return qc_fail(err, QC_ERR_CUDA, "cudaMemcpy of %zu bytes from cuda:%d failed: %s (%s)", bytes, device,
                       cudaGetErrorString(e), cudaGetErrorName(e));
    }
    return 0;
}
