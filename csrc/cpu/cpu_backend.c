/* cpu_backend.c: the CPU backend: creation, memory, and the ops table (ops in cpu_ops.c, the
 * thread pool in cpu_pool.c). "Backend memory" is plain host memory, and weights alias the file
 * mapping (no copy). threads <= 0 means one per online core; the pool lives as long as the
 * backend and destroy joins it. */
#include "cpu_backend.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cpu_alloc(qc_backend *be, size_t bytes, void **out) {
    /* 64-byte alignment keeps every row start on a cache line for the vectorised loops. */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    *out = aligned_alloc(64, rounded ? rounded : 64);
    if (*out == NULL)
        return qc_fail(&be->err, QC_ERR_NOMEM, "cpu: cannot allocate %zu bytes", bytes);
    return 0;
}

static void cpu_free(qc_backend *be, void *ptr) {
    (void)be;
    free(ptr);
}

static int cpu_memcpy(qc_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

static int cpu_weight_load(qc_backend *be, qc_weight *w) {
    (void)be;
    w->data = (void *)w->host;
    return 0;
}

static void cpu_weight_free(qc_backend *be, qc_weight *w) {
    (void)be;
    w->data = NULL;
}

static int cpu_synchronize(qc_backend *be) {
    (void)be;
    return 0;
}

static void cpu_destroy(qc_backend *be) {
    if (!be) return;
    qc_cpu_state *st = be->impl;
    if (st) {
        qc_pool_destroy(st->pool);
        for (int i = 0; i < st->n_scratch; i++) free(st->scratch[i]);
        free(st->scratch);
        free(st->normed);
        free(st->xq);
        free(st);
    }
    free(be);
}

int qc_cpu_scratch(qc_backend *be, size_t floats_per_thread) {
    qc_cpu_state *st = be->impl;
    if (floats_per_thread <= st->scratch_floats) return 0;
    /* Grow geometrically, so that a prefill of slowly increasing length reallocates rarely;
     * 64-byte aligned like every activation. The old contents are not needed. */
    size_t want = st->scratch_floats * 2 > floats_per_thread ? st->scratch_floats * 2 : floats_per_thread;
    size_t bytes = (want * sizeof(float) + 63) & ~(size_t)63;
    for (int i = 0; i < st->n_scratch; i++) {
        float *grown = aligned_alloc(64, bytes);
        if (!grown)
            return qc_fail(&be->err, QC_ERR_NOMEM, "cpu: cannot allocate %zu bytes of scratch", bytes);
        free(st->scratch[i]);
        st->scratch[i] = grown;
    }
    st->scratch_floats = want;
    return 0;
}

float *qc_cpu_normed_buffer(qc_backend *be, size_t floats) {
    qc_cpu_state *st = be->impl;
    if (floats > st->normed_floats) {
        float *grown = aligned_alloc(64, (floats * sizeof(float) + 63) & ~(size_t)63);
        if (!grown) {
            qc_fail(&be->err, QC_ERR_NOMEM, "cpu: cannot allocate %zu floats for a normalised input", floats);
            return NULL;
        }
        free(st->normed);
        st->normed = grown;
        st->normed_floats = floats;
    }
    return st->normed;
}

qc_q8_block *qc_cpu_q8_buffer(qc_backend *be, size_t blocks) {
    qc_cpu_state *st = be->impl;
    if (blocks > st->xq_blocks) {
        /* geometric growth, as the scratch: a prefill of slowly increasing length reallocates
         * rarely */
        size_t want = st->xq_blocks * 2 > blocks ? st->xq_blocks * 2 : blocks;
        qc_q8_block *grown = aligned_alloc(64, (want * sizeof(qc_q8_block) + 63) & ~(size_t)63);
        if (!grown) {
            qc_fail(&be->err, QC_ERR_NOMEM, "cpu: cannot allocate %zu blocks of 8-bit activations", want);
            return NULL;
        }
        free(st->xq);
        st->xq = grown;
        st->xq_blocks = want;
    }
    return st->xq;
}

/* The reference ops: plain C, float32 activations (cpu_ops.c). */
static const qc_backend_ops cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .copy = cpu_memcpy,
    .weight_load = cpu_weight_load,
    .weight_free = cpu_weight_free,
    .synchronize = cpu_synchronize,
    .destroy = cpu_destroy,
#define QC_CPU_OP(name) .name = qc_cpu_##name,
    QC_BACKEND_OPS(QC_CPU_OP)
#undef QC_CPU_OP
};

/* The fast ops (cpu_fast.c), where this CPU has the kernels, in place of the reference's:
 * QC_CPU_FAST_OPS (cpu_backend.h). Every other op is shared. */
static void use_fast_ops(qc_backend_ops *ops) {
#define QC_CPU_FAST_OP(name) ops->name = qc_cpu_fast_##name;
    QC_CPU_FAST_OPS(QC_CPU_FAST_OP)
#undef QC_CPU_FAST_OP
}

int qc_cpu_backend_create(int threads, qc_backend **out, qc_error *err) {
    /* QWENCUDA_CPU_KERNELS=float: every CPU backend runs the reference ops (device "cpu:float"
     * asks for them per model) */
    const char *env = getenv("QWENCUDA_CPU_KERNELS");
    return qc_cpu_backend_create_kernels(threads, env != NULL && strcmp(env, "float") == 0, out, err);
}

int qc_cpu_backend_create_kernels(int threads, int float_reference, qc_backend **out, qc_error *err) {
    *out = NULL;
    if (!float_reference && qc_simd_error()) return qc_fail(err, QC_ERR_VALUE, "cpu: %s", qc_simd_error());
    qc_backend *be = calloc(1, sizeof *be);
    qc_cpu_state *st = calloc(1, sizeof *st);
    if (!be || !st) goto nomem;
    st->simd = float_reference ? NULL : qc_simd_get();
    st->ops = cpu_ops;
    if (st->simd) use_fast_ops(&st->ops);
    be->ops = &st->ops;
    be->name = "cpu";
    be->impl = st;
    if (threads <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cores > 0 ? (int)cores : 1;
    }
    if (threads > 256)
        threads = 256;
    be->threads = threads;
    st->pool = qc_pool_create(threads);
    st->scratch = calloc((size_t)threads, sizeof *st->scratch);
    if (!st->pool || !st->scratch) goto nomem;
    st->n_scratch = threads;   /* only now: cpu_destroy frees n_scratch entries */
    *out = be;
    return 0;
nomem:
    if (be) {
        be->impl = st;
        cpu_destroy(be);
    } else {
        free(st);
    }
    return qc_fail(err, QC_ERR_NOMEM, "cpu: cannot create the backend (%d threads)", threads);
}
