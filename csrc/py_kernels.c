/* py_kernels.c: every op of backend.h (and dequantize) callable on NumPy arrays, on any backend.
 *
 * _core.kernel_<op>(device, ...) creates (once per device, then cached) the backend that
 * qc_backend_create gives for `device`, allocates backend buffers, uploads the inputs, runs the
 * op through be->ops (the very function the forward pass calls), downloads the outputs and frees
 * the buffers. The GIL is released around all backend work; a per-backend lock serialises
 * callers, since a backend serves one caller at a time (backend.h).
 *
 * The Python layer (qwencuda/kernels.py) converts dtypes and shapes; this layer still checks
 * every shape, size and index it relies on, so no call from Python can read or write out of
 * bounds. A weight is the tuple (raw, type, rows, cols): raw is any C-contiguous buffer of the
 * stored bytes (rows * row_bytes(type, cols) of them).
 */
#include "py_common.h"

#include <pythread.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "quants.h"
#include "sampler.h"
#ifdef QC_HAVE_CUDA
#include "../kernels/qc_cuda_api.h"
#endif

/* ---------------------------------------------------------------------------------------- */
/* the backend cache */

#define QC_MAX_KERNEL_BACKENDS 16

typedef struct {
    char name[32];              /* "cpu", "cuda:0", ... */
    qc_backend *be;             /* NULL once released */
    PyThread_type_lock lock;    /* held while an op runs; never freed (see kernel_release) */
} cached_backend;

static cached_backend g_backends[QC_MAX_KERNEL_BACKENDS];

/* "cuda" and "cuda:0" are one device. */
static void normalize_device(const char *device, char *out, size_t size) {
    if (strcmp(device, "cuda") == 0) device = "cuda:0";
    snprintf(out, size, "%s", device);
}

/* The cached backend for device, created on first use (GIL held). NULL with an exception. */
static cached_backend *get_backend(const char *device) {
    char name[32];
    qc_error err = {0};
    qc_backend *be = NULL;
    int free_slot = -1;
    if (strlen(device) >= sizeof name) {
        PyErr_Format(PyExc_ValueError, "unknown device '%s' (expected cpu, cuda or cuda:N)", device);
        return NULL;
    }
    normalize_device(device, name, sizeof name);
    for (int i = 0; i < QC_MAX_KERNEL_BACKENDS; i++) {
        if (g_backends[i].lock && strcmp(g_backends[i].name, name) == 0) {
            if (g_backends[i].be) return &g_backends[i];
            free_slot = i;   /* released earlier: reuse the slot and its lock */
            break;
        }
        if (g_backends[i].lock == NULL && free_slot < 0) free_slot = i;
    }
    if (free_slot < 0) {
        PyErr_SetString(PyExc_RuntimeError, "qwencuda.kernels: too many devices in use");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qc_backend_create(name, 0, &be, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return (cached_backend *)qc_py_raise(&err);
    cached_backend *c = &g_backends[free_slot];
    if (c->lock == NULL) {
        c->lock = PyThread_allocate_lock();
        if (c->lock == NULL) {
            qc_backend_destroy(be);
            PyErr_NoMemory();
            return NULL;
        }
    }
    snprintf(c->name, sizeof c->name, "%s", name);
    c->be = be;
    return c;
}

/* ---------------------------------------------------------------------------------------- */
/* backend buffers of one call: allocated, filled, freed together (no GIL needed) */

#define QC_MAX_CALL_BUFFERS 12

typedef struct {
    qc_backend *be;
    void *ptr[QC_MAX_CALL_BUFFERS];
    int n;
} call_bufs;

static int buf_new(call_bufs *b, size_t bytes, void **out) {
    *out = NULL;
    if (b->n == QC_MAX_CALL_BUFFERS)
        return qc_fail(&b->be->err, QC_ERR_VALUE, "py_kernels: too many buffers in one call");
    if (b->be->ops->alloc(b->be, bytes ? bytes : 4, out) < 0) {
        *out = NULL;
        return -1;
    }
    b->ptr[b->n++] = *out;
    return 0;
}

static int buf_put(call_bufs *b, const void *host, size_t bytes, void **out) {
    if (buf_new(b, bytes, out) < 0) return -1;
    return bytes ? b->be->ops->upload(b->be, *out, host, bytes) : 0;
}

static void bufs_free(call_bufs *b) {
    /* pending work must finish before its buffers go (the CPU backend's free is immediate) */
    b->be->ops->synchronize(b->be);
    for (int i = b->n - 1; i >= 0; i--) b->be->ops->free(b->be, b->ptr[i]);
    b->n = 0;
}

/* ---------------------------------------------------------------------------------------- */
/* argument conversion (GIL held) */

/* A C-contiguous float32 (or int32) array of ndim dimensions (ndim < 0: any), safely cast. */
static PyArrayObject *as_array(PyObject *obj, int typenum, int ndim, const char *what) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, typenum, NPY_ARRAY_IN_ARRAY);
    if (a == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(PyExc_TypeError, "%s: expected a %s array (%S)", what,
                     typenum == NPY_FLOAT32 ? "float32" : "int32", value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    if (ndim >= 0 && PyArray_NDIM(a) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d dimensions, got shape with %d", what, ndim,
                     PyArray_NDIM(a));
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

typedef struct {
    Py_buffer view;
    int have_view;
    qc_weight w;
} weight_arg;

static void weight_arg_release(weight_arg *wa) {
    if (wa->have_view) PyBuffer_Release(&wa->view);
    wa->have_view = 0;
}

/* (raw, type, rows, cols) -> a qc_weight whose host bytes are raw's buffer. */
static int weight_arg_parse(PyObject *tuple, weight_arg *wa) {
    PyObject *raw = NULL;
    unsigned int type = 0;
    long long rows = 0, cols = 0;
    memset(wa, 0, sizeof *wa);
    if (!PyTuple_Check(tuple) || !PyArg_ParseTuple(tuple, "OILL;weight must be (raw, type, rows, cols)",
                                                   &raw, &type, &rows, &cols))
        return -1;
    const qc_type_traits *tr = qc_type_get(type);
    if (tr == NULL || tr->type_size == 0 || tr->dequantize == NULL) {
        PyErr_Format(PyExc_ValueError, "weight type %u is not a type qwencuda can run", type);
        return -1;
    }
    if (rows < 1 || cols < 1) {
        PyErr_Format(PyExc_ValueError, "weight shape (%lld, %lld) must be positive", rows, cols);
        return -1;
    }
    int64_t rb = qc_row_bytes(type, cols);
    if (rb < 0) {
        PyErr_Format(PyExc_ValueError, "weight of type %s: %lld columns is not a multiple of its block size %lld",
                     tr->name, cols, (long long)tr->block_size);
        return -1;
    }
    if (rows > INT64_MAX / rb) {   /* before rows * rb is formed anywhere */
        PyErr_Format(PyExc_ValueError, "weight of type %s and shape (%lld, %lld) needs more than "
                     "%lld bytes", tr->name, rows, cols, (long long)INT64_MAX);
        return -1;
    }
    if (PyObject_GetBuffer(raw, &wa->view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    wa->have_view = 1;
    if ((int64_t)wa->view.len != rows * rb) {
        PyErr_Format(PyExc_ValueError, "weight of type %s and shape (%lld, %lld) needs %lld bytes, raw has %zd",
                     tr->name, rows, cols, (long long)(rows * rb), wa->view.len);
        weight_arg_release(wa);
        return -1;
    }
    wa->w.type = type;
    wa->w.rows = rows;
    wa->w.cols = cols;
    wa->w.nbytes = (size_t)wa->view.len;
    wa->w.host = wa->view.buf;
    wa->w.data = NULL;
    return 0;
}

/* A KV cache argument: a float16 array stays float16 (an F16 cache), anything else becomes a
 * C-contiguous float32 array (F32). *kv_type receives which. */
static PyArrayObject *as_cache(PyObject *obj, const char *what, int *kv_type) {
    const int half = PyArray_Check(obj) && PyArray_TYPE((PyArrayObject *)obj) == NPY_FLOAT16;
    *kv_type = half ? QC_KV_F16 : QC_KV_F32;
    if (!half) return as_array(obj, NPY_FLOAT32, 2, what);
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_FLOAT16, NPY_ARRAY_IN_ARRAY);
    if (a != NULL && PyArray_NDIM(a) != 2) {
        PyErr_Format(PyExc_ValueError, "%s: expected 2 dimensions, got shape with %d", what, PyArray_NDIM(a));
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* The two caches of one call must share their type. */
static int caches_agree(int k_type, int v_type, const char *op) {
    if (k_type == v_type) return 0;
    PyErr_Format(PyExc_TypeError, "%s: k_cache and v_cache must both be float16 or both float32", op);
    return -1;
}

static PyArrayObject *new_array(int typenum, int ndim, const npy_intp *shape) {
    return (PyArrayObject *)PyArray_SimpleNew(ndim, (npy_intp *)shape, typenum);
}

static size_t nbytes_of(PyArrayObject *a) { return (size_t)PyArray_NBYTES(a); }

/* The backend part of one kernel call: fills outputs from inputs through be->ops, using bufs for
 * its backend buffers. Runs without the GIL. 0, or -1 with be->err set. */
typedef int (*backend_work)(qc_backend *be, call_bufs *bufs, void *ctx);

/* Run work on cached backend c with the GIL released and c's lock held. 0, or -1 with *err
 * filled (the caller raises it). The call's buffers are freed here, after the work. */
static int run_on_backend(cached_backend *c, backend_work work, void *ctx, qc_error *err) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(c->lock, WAIT_LOCK);
    if (c->be == NULL) {
        rc = qc_fail(err, QC_ERR_VALUE, "the kernels backend was released meanwhile");
    } else {
        qc_backend *be = c->be;
        call_bufs bufs = {be, {0}, 0};
        be->err.kind = QC_OK;
        be->err.msg[0] = '\0';
        rc = work(be, &bufs, ctx);
        if (rc < 0) *err = be->err;
        bufs_free(&bufs);
    }
    PyThread_release_lock(c->lock);
    Py_END_ALLOW_THREADS
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* one kernel call: inputs uploaded, outputs allocated (or an input's buffer, for in-place ops),
 * the op, outputs downloaded */

#define QC_JOB_MAX 6

typedef struct kernel_job kernel_job;
typedef int (*job_op)(qc_backend *be, kernel_job *j);

struct kernel_job {
    const void *in[QC_JOB_MAX];     /* host inputs, uploaded in order */
    size_t in_bytes[QC_JOB_MAX];
    int n_in;
    void *out[QC_JOB_MAX];          /* host outputs, downloaded after the op (NULL: scratch only) */
    size_t out_bytes[QC_JOB_MAX];
    int out_alias[QC_JOB_MAX];      /* >= 0: the output is (in place) that input's buffer */
    int n_out;
    void *d_in[QC_JOB_MAX], *d_out[QC_JOB_MAX];   /* backend buffers */
    qc_weight *w[QC_MATMUL_MULTI_MAX];   /* loaded before the op and freed after (NULL: none) */
    job_op op;
    int empty;                      /* nothing to compute (zero tokens): skip the backend */
    int i0, i1, i2, i3, i4;         /* op parameters */
    int kv_type;                    /* the caches' qc_kv_type (kv_store, rope_kv_store, attention) */
    int64_t count;
    float f0;
    double seconds;                 /* time_matmul: seconds per call */
};

static int job_in(kernel_job *j, const void *host, size_t bytes) {
    j->in[j->n_in] = host;
    j->in_bytes[j->n_in] = bytes;
    return j->n_in++;
}

static void job_out(kernel_job *j, void *host, size_t bytes, int alias) {
    j->out[j->n_out] = host;
    j->out_bytes[j->n_out] = bytes;
    j->out_alias[j->n_out] = alias;
    j->n_out++;
}

static int job_work(qc_backend *be, call_bufs *bufs, void *ctx) {
    kernel_job *j = ctx;
    int rc = 0;
    if (j->empty) return 0;
    int n_w = 0;                    /* weights whose load was tried: all freed below */
    while (rc == 0 && n_w < QC_MATMUL_MULTI_MAX && j->w[n_w])
        rc = be->ops->weight_load(be, j->w[n_w++]);
    for (int i = 0; i < j->n_in && rc == 0; i++) rc = buf_put(bufs, j->in[i], j->in_bytes[i], &j->d_in[i]);
    for (int i = 0; i < j->n_out && rc == 0; i++) {
        if (j->out_alias[i] >= 0) j->d_out[i] = j->d_in[j->out_alias[i]];
        else rc = buf_new(bufs, j->out_bytes[i], &j->d_out[i]);
    }
    if (rc == 0) rc = j->op(be, j);
    for (int i = 0; i < j->n_out && rc == 0; i++)
        if (j->out[i]) rc = be->ops->download(be, j->out[i], j->d_out[i], j->out_bytes[i]);
    if (n_w) {
        qc_error keep = be->err;
        be->ops->synchronize(be);   /* no queued kernel may still read the weights */
        for (int i = 0; i < n_w; i++) be->ops->weight_free(be, j->w[i]);   /* safe after a failed load */
        be->err = keep;
    }
    return rc < 0 ? -1 : 0;
}

/* Run the job on the cached backend of device; raises on failure. */
static int run_job(cached_backend *c, kernel_job *j) {
    qc_error err = {0};
    if (run_on_backend(c, job_work, j, &err) < 0) {
        qc_py_raise(&err);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* the kernels */

static int op_embed(qc_backend *be, kernel_job *j) {
    return be->ops->embed(be, j->w[0], (const int32_t *)j->d_in[0], j->i0, (float *)j->d_out[0]);
}

/* embed rows ids of a weight table; shared by kernel_embed and kernel_dequantize */
static PyObject *run_embed(cached_backend *c, weight_arg *wa, PyArrayObject *ids) {
    kernel_job j = {0};
    const npy_intp n = PyArray_SIZE(ids);
    const int32_t *idv = (const int32_t *)PyArray_DATA(ids);
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "embed: too many ids");
        return NULL;
    }
    for (npy_intp i = 0; i < n; i++)
        if (idv[i] < 0 || idv[i] >= wa->w.rows) {
            PyErr_Format(PyExc_ValueError, "embed: id %d at index %zd is out of range [0, %lld)", (int)idv[i],
                         (Py_ssize_t)i, (long long)wa->w.rows);
            return NULL;
        }
    npy_intp shape[2] = {n, (npy_intp)wa->w.cols};
    PyArrayObject *out = new_array(NPY_FLOAT32, 2, shape);
    if (out == NULL) return NULL;
    j.op = op_embed;
    j.w[0] = &wa->w;
    j.empty = n == 0;
    j.i0 = (int)n;
    job_in(&j, idv, (size_t)n * sizeof(int32_t));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (run_job(c, &j) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return (PyObject *)out;
}

static PyObject *kernel_embed(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *idobj;
    weight_arg wa;
    PyArrayObject *ids = NULL;
    PyObject *res = NULL;
    cached_backend *c;
    if (!PyArg_ParseTuple(args, "sOO", &device, &wobj, &idobj)) return NULL;
    if (weight_arg_parse(wobj, &wa) < 0) return NULL;
    if ((c = get_backend(device)) == NULL) goto done;
    if ((ids = as_array(idobj, NPY_INT32, 1, "embed ids")) == NULL) goto done;
    res = run_embed(c, &wa, ids);
done:
    Py_XDECREF(ids);
    weight_arg_release(&wa);
    return res;
}

static PyObject *kernel_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj;
    weight_arg wa;
    PyArrayObject *ids = NULL;
    PyObject *res = NULL;
    cached_backend *c;
    npy_intp n;
    if (!PyArg_ParseTuple(args, "sO", &device, &wobj)) return NULL;
    if (weight_arg_parse(wobj, &wa) < 0) return NULL;
    if ((c = get_backend(device)) == NULL) goto done;
    if (wa.w.rows > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "dequantize: too many rows");
        goto done;
    }
    n = (npy_intp)wa.w.rows;
    if ((ids = new_array(NPY_INT32, 1, &n)) == NULL) goto done;
    for (npy_intp i = 0; i < n; i++) ((int32_t *)PyArray_DATA(ids))[i] = (int32_t)i;
    res = run_embed(c, &wa, ids);
done:
    Py_XDECREF(ids);
    weight_arg_release(&wa);
    return res;
}

static int op_matmul(qc_backend *be, kernel_job *j) {
    /* inputs: x, then the bias when there is one */
    const float *bias = j->n_in > 1 ? (const float *)j->d_in[1] : NULL;
    return be->ops->matmul(be, j->w[0], bias, (const float *)j->d_in[0], j->i0, (float *)j->d_out[0]);
}

static PyObject *kernel_matmul(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *bobj = Py_None;
    weight_arg wa;
    PyArrayObject *x = NULL, *bias = NULL, *out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    npy_intp shape[2];
    if (!PyArg_ParseTuple(args, "sOO|O", &device, &wobj, &xobj, &bobj)) return NULL;
    if (weight_arg_parse(wobj, &wa) < 0) return NULL;
    if ((c = get_backend(device)) == NULL) goto fail;
    if ((x = as_array(xobj, NPY_FLOAT32, 2, "matmul x")) == NULL) goto fail;
    if (PyArray_DIM(x, 1) != wa.w.cols) {
        PyErr_Format(PyExc_ValueError, "matmul: x has %zd columns, the weight (%lld, %lld) needs %lld",
                     (Py_ssize_t)PyArray_DIM(x, 1), (long long)wa.w.rows, (long long)wa.w.cols, (long long)wa.w.cols);
        goto fail;
    }
    if (PyArray_DIM(x, 0) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "matmul: too many rows in x");
        goto fail;
    }
    if (bobj != Py_None) {
        if ((bias = as_array(bobj, NPY_FLOAT32, 1, "matmul bias")) == NULL) goto fail;
        if (PyArray_DIM(bias, 0) != wa.w.rows) {
            PyErr_Format(PyExc_ValueError, "matmul: bias has %zd values, the weight has %lld rows",
                         (Py_ssize_t)PyArray_DIM(bias, 0), (long long)wa.w.rows);
            goto fail;
        }
    }
    shape[0] = PyArray_DIM(x, 0);
    shape[1] = (npy_intp)wa.w.rows;
    if ((out = new_array(NPY_FLOAT32, 2, shape)) == NULL) goto fail;
    j.op = op_matmul;
    j.w[0] = &wa.w;
    j.i0 = (int)shape[0];
    j.empty = shape[0] == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    if (bias) job_in(&j, PyArray_DATA(bias), nbytes_of(bias));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(x);
    Py_XDECREF(bias);
    weight_arg_release(&wa);
    return (PyObject *)out;
fail:
    Py_XDECREF(x);
    Py_XDECREF(bias);
    Py_XDECREF(out);
    weight_arg_release(&wa);
    return NULL;
}

/* x as a float32 (n, cols) array for weights of cols columns; NULL with an exception */
static PyArrayObject *matmul_x(PyObject *xobj, int64_t cols, const char *what) {
    PyArrayObject *x = as_array(xobj, NPY_FLOAT32, 2, what);
    if (x == NULL) return NULL;
    if (PyArray_DIM(x, 1) != cols || PyArray_DIM(x, 0) > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: x must be (n, %lld) with n < 2^31, got %zd columns", what,
                     (long long)cols, (Py_ssize_t)PyArray_DIM(x, 1));
        Py_DECREF(x);
        return NULL;
    }
    return x;
}

static int op_matmul_add(qc_backend *be, kernel_job *j) {
    /* inputs: x, residual; output: out (residual's buffer when in place) */
    return be->ops->matmul_add(be, j->w[0], (const float *)j->d_in[0], j->i0, (const float *)j->d_in[1],
                               (float *)j->d_out[0]);
}

static PyObject *kernel_matmul_add(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *robj;
    int in_place;
    weight_arg wa;
    PyArrayObject *x = NULL, *res = NULL, *out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    if (!PyArg_ParseTuple(args, "sOOOp", &device, &wobj, &xobj, &robj, &in_place)) return NULL;
    if (weight_arg_parse(wobj, &wa) < 0) return NULL;
    if ((c = get_backend(device)) == NULL) goto fail;
    if ((x = matmul_x(xobj, wa.w.cols, "matmul_add")) == NULL ||
        (res = as_array(robj, NPY_FLOAT32, 2, "matmul_add residual")) == NULL)
        goto fail;
    if (PyArray_DIM(res, 0) != PyArray_DIM(x, 0) || PyArray_DIM(res, 1) != wa.w.rows) {
        PyErr_Format(PyExc_ValueError, "matmul_add: residual must be (%zd, %lld), got (%zd, %zd)",
                     (Py_ssize_t)PyArray_DIM(x, 0), (long long)wa.w.rows, (Py_ssize_t)PyArray_DIM(res, 0),
                     (Py_ssize_t)PyArray_DIM(res, 1));
        goto fail;
    }
    if ((out = new_array(NPY_FLOAT32, 2, PyArray_DIMS(res))) == NULL) goto fail;
    j.op = op_matmul_add;
    j.w[0] = &wa.w;
    j.i0 = (int)PyArray_DIM(x, 0);
    j.empty = PyArray_DIM(x, 0) == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_in(&j, PyArray_DATA(res), nbytes_of(res));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), in_place ? 1 : -1);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(x);
    Py_DECREF(res);
    weight_arg_release(&wa);
    return (PyObject *)out;
fail:
    Py_XDECREF(x);
    Py_XDECREF(res);
    Py_XDECREF(out);
    weight_arg_release(&wa);
    return NULL;
}

static int op_matmul_multi(qc_backend *be, kernel_job *j) {
    /* inputs: x, then the biases present (i1 = bitmask of the parts that have one); outputs in
     * part order */
    qc_matmul_part parts[QC_MATMUL_MULTI_MAX];
    int next_in = 1;
    for (int i = 0; i < j->n_out; i++) {
        parts[i].w = j->w[i];
        parts[i].bias = (j->i1 >> i) & 1 ? (const float *)j->d_in[next_in++] : NULL;
        parts[i].out = (float *)j->d_out[i];
    }
    /* i2 > 0: the index of the input that is the norm weight (the last one), with eps f0 */
    const float *norm_w = j->i2 > 0 ? (const float *)j->d_in[j->i2] : NULL;
    return be->ops->matmul_multi(be, parts, j->n_out, (const float *)j->d_in[0], j->i0, norm_w, j->f0);
}

/* The optional norm weight of the fused ops: None, or float32 (cols,). NULL with an exception
 * on error; *arr stays NULL for None. */
static int norm_arg(PyObject *obj, int64_t cols, const char *what, PyArrayObject **arr) {
    *arr = NULL;
    if (obj == NULL || obj == Py_None) return 0;
    if ((*arr = as_array(obj, NPY_FLOAT32, 1, what)) == NULL) return -1;
    if (PyArray_DIM(*arr, 0) != cols) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values for rows of %lld", what, (Py_ssize_t)PyArray_DIM(*arr, 0),
                     (long long)cols);
        Py_CLEAR(*arr);
        return -1;
    }
    return 0;
}

static PyObject *kernel_matmul_multi(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wseq, *xobj, *bseq, *nobj = NULL;
    float eps = 0.0f;
    weight_arg wa[QC_MATMUL_MULTI_MAX];
    PyArrayObject *x = NULL, *bias[QC_MATMUL_MULTI_MAX] = {NULL}, *out[QC_MATMUL_MULTI_MAX] = {NULL};
    PyArrayObject *norm = NULL;
    PyObject *res = NULL;
    kernel_job j = {0};
    cached_backend *c;
    int n_parts = 0, n_parsed = 0;
    if (!PyArg_ParseTuple(args, "sO!OO!|Of", &device, &PyTuple_Type, &wseq, &xobj, &PyTuple_Type, &bseq,
                          &nobj, &eps))
        return NULL;
    n_parts = (int)PyTuple_GET_SIZE(wseq);
    if (n_parts < 1 || n_parts > QC_MATMUL_MULTI_MAX || PyTuple_GET_SIZE(bseq) != n_parts) {
        PyErr_Format(PyExc_ValueError, "matmul_multi: 1 to %d weights and as many biases (or None), got %d and %zd",
                     QC_MATMUL_MULTI_MAX, n_parts, PyTuple_GET_SIZE(bseq));
        return NULL;
    }
    for (; n_parsed < n_parts; n_parsed++)
        if (weight_arg_parse(PyTuple_GET_ITEM(wseq, n_parsed), &wa[n_parsed]) < 0) goto done;
    for (int i = 1; i < n_parts; i++)
        if (wa[i].w.cols != wa[0].w.cols) {
            PyErr_Format(PyExc_ValueError, "matmul_multi: weight %d has %lld columns, weight 0 has %lld", i,
                         (long long)wa[i].w.cols, (long long)wa[0].w.cols);
            goto done;
        }
    if ((c = get_backend(device)) == NULL) goto done;
    if ((x = matmul_x(xobj, wa[0].w.cols, "matmul_multi")) == NULL) goto done;
    j.op = op_matmul_multi;
    j.i0 = (int)PyArray_DIM(x, 0);
    j.empty = PyArray_DIM(x, 0) == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    for (int i = 0; i < n_parts; i++) {
        PyObject *b = PyTuple_GET_ITEM(bseq, i);
        npy_intp shape[2] = {PyArray_DIM(x, 0), (npy_intp)wa[i].w.rows};
        j.w[i] = &wa[i].w;
        if (b != Py_None) {
            if ((bias[i] = as_array(b, NPY_FLOAT32, 1, "matmul_multi bias")) == NULL) goto done;
            if (PyArray_DIM(bias[i], 0) != wa[i].w.rows) {
                PyErr_Format(PyExc_ValueError, "matmul_multi: bias %d has %zd values, its weight %lld rows", i,
                             (Py_ssize_t)PyArray_DIM(bias[i], 0), (long long)wa[i].w.rows);
                goto done;
            }
            j.i1 |= 1 << i;
            job_in(&j, PyArray_DATA(bias[i]), nbytes_of(bias[i]));
        }
        if ((out[i] = new_array(NPY_FLOAT32, 2, shape)) == NULL) goto done;
        job_out(&j, PyArray_DATA(out[i]), nbytes_of(out[i]), -1);
    }
    if (norm_arg(nobj, wa[0].w.cols, "matmul_multi norm", &norm) < 0) goto done;
    if (norm) {
        j.i2 = job_in(&j, PyArray_DATA(norm), nbytes_of(norm));
        j.f0 = eps;
    }
    if (run_job(c, &j) < 0) goto done;
    if ((res = PyTuple_New(n_parts)) == NULL) goto done;
    for (int i = 0; i < n_parts; i++) {
        PyTuple_SET_ITEM(res, i, (PyObject *)out[i]);   /* steals the reference */
        out[i] = NULL;
    }
done:
    Py_XDECREF(x);
    Py_XDECREF(norm);
    for (int i = 0; i < QC_MATMUL_MULTI_MAX; i++) {
        Py_XDECREF(bias[i]);
        Py_XDECREF(out[i]);
    }
    for (int i = 0; i < n_parsed; i++) weight_arg_release(&wa[i]);
    return res;
}

static int op_matmul_swiglu(qc_backend *be, kernel_job *j) {
    const float *norm_w = j->n_in > 1 ? (const float *)j->d_in[1] : NULL;
    return be->ops->matmul_swiglu(be, j->w[0], j->w[1], (const float *)j->d_in[0], j->i0, norm_w, j->f0,
                                  (float *)j->d_out[0]);
}

static PyObject *kernel_matmul_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *gobj, *uobj, *xobj, *nobj = NULL;
    float eps = 0.0f;
    weight_arg wg, wu;
    PyArrayObject *x = NULL, *out = NULL, *norm = NULL;
    kernel_job j = {0};
    cached_backend *c;
    npy_intp shape[2];
    if (!PyArg_ParseTuple(args, "sOOO|Of", &device, &gobj, &uobj, &xobj, &nobj, &eps)) return NULL;
    if (weight_arg_parse(gobj, &wg) < 0) return NULL;
    if (weight_arg_parse(uobj, &wu) < 0) {
        weight_arg_release(&wg);
        return NULL;
    }
    if (wg.w.rows != wu.w.rows || wg.w.cols != wu.w.cols) {
        PyErr_Format(PyExc_ValueError, "matmul_swiglu: gate (%lld, %lld) and up (%lld, %lld) differ in shape",
                     (long long)wg.w.rows, (long long)wg.w.cols, (long long)wu.w.rows, (long long)wu.w.cols);
        goto fail;
    }
    if ((c = get_backend(device)) == NULL) goto fail;
    if ((x = matmul_x(xobj, wg.w.cols, "matmul_swiglu")) == NULL) goto fail;
    shape[0] = PyArray_DIM(x, 0);
    shape[1] = (npy_intp)wg.w.rows;
    if ((out = new_array(NPY_FLOAT32, 2, shape)) == NULL) goto fail;
    if (norm_arg(nobj, wg.w.cols, "matmul_swiglu norm", &norm) < 0) goto fail;
    j.op = op_matmul_swiglu;
    j.w[0] = &wg.w;
    j.w[1] = &wu.w;
    j.i0 = (int)shape[0];
    j.f0 = eps;
    j.empty = shape[0] == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    if (norm) job_in(&j, PyArray_DATA(norm), nbytes_of(norm));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(x);
    Py_XDECREF(norm);
    weight_arg_release(&wg);
    weight_arg_release(&wu);
    return (PyObject *)out;
fail:
    Py_XDECREF(x);
    Py_XDECREF(out);
    Py_XDECREF(norm);
    weight_arg_release(&wg);
    weight_arg_release(&wu);
    return NULL;
}

static int op_rmsnorm(qc_backend *be, kernel_job *j) {
    return be->ops->rmsnorm(be, (const float *)j->d_in[0], (const float *)j->d_in[1], j->i0, j->i1, j->f0,
                            (float *)j->d_out[0]);
}

static PyObject *kernel_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *wobj;
    float eps;
    PyArrayObject *x = NULL, *w = NULL, *out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    if (!PyArg_ParseTuple(args, "sOOf", &device, &xobj, &wobj, &eps)) return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((x = as_array(xobj, NPY_FLOAT32, 2, "rmsnorm x")) == NULL ||
        (w = as_array(wobj, NPY_FLOAT32, 1, "rmsnorm weight")) == NULL)
        goto fail;
    if (PyArray_DIM(w, 0) != PyArray_DIM(x, 1)) {
        PyErr_Format(PyExc_ValueError, "rmsnorm: x rows have %zd values, the weight %zd",
                     (Py_ssize_t)PyArray_DIM(x, 1), (Py_ssize_t)PyArray_DIM(w, 0));
        goto fail;
    }
    if (PyArray_DIM(x, 0) > INT32_MAX || PyArray_DIM(x, 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "rmsnorm: x is too large");
        goto fail;
    }
    if ((out = new_array(NPY_FLOAT32, 2, PyArray_DIMS(x))) == NULL) goto fail;
    j.op = op_rmsnorm;
    j.i0 = (int)PyArray_DIM(x, 0);
    j.i1 = (int)PyArray_DIM(x, 1);
    j.f0 = eps;
    j.empty = PyArray_SIZE(x) == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_in(&j, PyArray_DATA(w), nbytes_of(w));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(x);
    Py_DECREF(w);
    return (PyObject *)out;
fail:
    Py_XDECREF(x);
    Py_XDECREF(w);
    Py_XDECREF(out);
    return NULL;
}

static int op_rope(qc_backend *be, kernel_job *j) {
    return be->ops->rope(be, (float *)j->d_in[0], (const int32_t *)j->d_in[1], j->i0, j->i1, j->i2, j->f0);
}

static PyObject *kernel_rope(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *pobj;
    float theta;
    PyArrayObject *x = NULL, *pos = NULL, *out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    if (!PyArg_ParseTuple(args, "sOOf", &device, &xobj, &pobj, &theta)) return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((x = as_array(xobj, NPY_FLOAT32, 3, "rope x (tokens, heads, head_dim)")) == NULL ||
        (pos = as_array(pobj, NPY_INT32, 1, "rope positions")) == NULL)
        goto fail;
    if (PyArray_DIM(pos, 0) != PyArray_DIM(x, 0)) {
        PyErr_Format(PyExc_ValueError, "rope: %zd positions for %zd tokens", (Py_ssize_t)PyArray_DIM(pos, 0),
                     (Py_ssize_t)PyArray_DIM(x, 0));
        goto fail;
    }
    if (PyArray_DIM(x, 2) % 2 != 0) {
        PyErr_Format(PyExc_ValueError, "rope: head_dim %zd must be even", (Py_ssize_t)PyArray_DIM(x, 2));
        goto fail;
    }
    if (PyArray_DIM(x, 0) > INT32_MAX || PyArray_DIM(x, 1) > INT32_MAX || PyArray_DIM(x, 2) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "rope: x is too large");
        goto fail;
    }
    if ((out = new_array(NPY_FLOAT32, 3, PyArray_DIMS(x))) == NULL) goto fail;
    j.op = op_rope;
    j.i0 = (int)PyArray_DIM(x, 0);
    j.i1 = (int)PyArray_DIM(x, 1);
    j.i2 = (int)PyArray_DIM(x, 2);
    j.f0 = theta;
    j.empty = PyArray_SIZE(x) == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_in(&j, PyArray_DATA(pos), nbytes_of(pos));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), 0);   /* in place on x's buffer */
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(x);
    Py_DECREF(pos);
    return (PyObject *)out;
fail:
    Py_XDECREF(x);
    Py_XDECREF(pos);
    Py_XDECREF(out);
    return NULL;
}

/* positions must index rows [0, limit) */
static int check_positions(PyArrayObject *pos, npy_intp limit, const char *what) {
    const int32_t *p = (const int32_t *)PyArray_DATA(pos);
    for (npy_intp i = 0; i < PyArray_SIZE(pos); i++)
        if (p[i] < 0 || p[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "%s: position %d at index %zd is out of range [0, %zd)", what,
                         (int)p[i], (Py_ssize_t)i, (Py_ssize_t)limit);
            return -1;
        }
    return 0;
}

/* The caches of a job: inputs k_index and v_index, of type j->kv_type. */
static qc_kv_cache job_cache(const kernel_job *j, int k_index, int v_index) {
    qc_kv_cache cache = {j->d_in[k_index], j->d_in[v_index], j->kv_type};
    return cache;
}

static int op_kv_store(qc_backend *be, kernel_job *j) {
    if (j->i0 == 0 || j->i1 == 0) return 0;
    return be->ops->kv_store(be, (const float *)j->d_in[0], (const float *)j->d_in[1], (const int32_t *)j->d_in[2],
                             j->i0, j->i1, job_cache(j, 3, 4));
}

static PyObject *kernel_kv_store(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *kobj, *vobj, *pobj, *kcobj, *vcobj;
    PyArrayObject *k = NULL, *v = NULL, *pos = NULL, *kc = NULL, *vc = NULL, *kc_out = NULL, *vc_out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    int v_type = 0;
    if (!PyArg_ParseTuple(args, "sOOOOO", &device, &kobj, &vobj, &pobj, &kcobj, &vcobj)) return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((k = as_array(kobj, NPY_FLOAT32, 2, "kv_store k")) == NULL ||
        (v = as_array(vobj, NPY_FLOAT32, 2, "kv_store v")) == NULL ||
        (pos = as_array(pobj, NPY_INT32, 1, "kv_store positions")) == NULL ||
        (kc = as_cache(kcobj, "kv_store k_cache", &j.kv_type)) == NULL ||
        (vc = as_cache(vcobj, "kv_store v_cache", &v_type)) == NULL ||
        caches_agree(j.kv_type, v_type, "kv_store") < 0)
        goto fail;
    if (!PyArray_SAMESHAPE(k, v) || !PyArray_SAMESHAPE(kc, vc) || PyArray_DIM(k, 1) != PyArray_DIM(kc, 1) ||
        PyArray_DIM(pos, 0) != PyArray_DIM(k, 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "kv_store: k and v must be (n, kv_dim), the caches (max_ctx, kv_dim), positions (n,)");
        goto fail;
    }
    if (check_positions(pos, PyArray_DIM(kc, 0), "kv_store") < 0) goto fail;
    if (PyArray_DIM(k, 0) > INT32_MAX || PyArray_DIM(k, 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "kv_store: k is too large");
        goto fail;
    }
    if ((kc_out = new_array(PyArray_TYPE(kc), 2, PyArray_DIMS(kc))) == NULL ||
        (vc_out = new_array(PyArray_TYPE(vc), 2, PyArray_DIMS(vc))) == NULL)
        goto fail;
    j.op = op_kv_store;
    j.i0 = (int)PyArray_DIM(k, 0);
    j.i1 = (int)PyArray_DIM(k, 1);
    j.empty = PyArray_SIZE(kc) == 0;
    job_in(&j, PyArray_DATA(k), nbytes_of(k));
    job_in(&j, PyArray_DATA(v), nbytes_of(v));
    job_in(&j, PyArray_DATA(pos), nbytes_of(pos));
    job_in(&j, PyArray_DATA(kc), nbytes_of(kc));
    job_in(&j, PyArray_DATA(vc), nbytes_of(vc));
    job_out(&j, PyArray_DATA(kc_out), nbytes_of(kc_out), 3);
    job_out(&j, PyArray_DATA(vc_out), nbytes_of(vc_out), 4);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(k);
    Py_DECREF(v);
    Py_DECREF(pos);
    Py_DECREF(kc);
    Py_DECREF(vc);
    return Py_BuildValue("(NN)", kc_out, vc_out);
fail:
    Py_XDECREF(k);
    Py_XDECREF(v);
    Py_XDECREF(pos);
    Py_XDECREF(kc);
    Py_XDECREF(vc);
    Py_XDECREF(kc_out);
    Py_XDECREF(vc_out);
    return NULL;
}

static int op_rope_kv_store(qc_backend *be, kernel_job *j) {
    /* inputs: q, k, v, pos, k_cache, v_cache (q, k and the caches updated in place);
     * i0 n, i1 n_head, i2 n_head_kv, i3 head_dim, f0 theta */
    return be->ops->rope_kv_store(be, (float *)j->d_in[0], (float *)j->d_in[1], (const float *)j->d_in[2],
                                  (const int32_t *)j->d_in[3], j->i0, j->i1, j->i2, j->i3, j->f0,
                                  job_cache(j, 4, 5));
}

static PyObject *kernel_rope_kv_store(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *qobj, *kobj, *vobj, *pobj, *kcobj, *vcobj;
    float theta;
    PyArrayObject *in[6] = {NULL}, *out[4] = {NULL};
    kernel_job j = {0};
    cached_backend *c;
    int v_type = 0;
    if (!PyArg_ParseTuple(args, "sOOOOOOf", &device, &qobj, &kobj, &vobj, &pobj, &kcobj, &vcobj, &theta))
        return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    PyArrayObject **q = &in[0], **k = &in[1], **v = &in[2], **pos = &in[3], **kc = &in[4], **vc = &in[5];
    if ((*q = as_array(qobj, NPY_FLOAT32, 3, "rope_kv_store q (n, n_head, head_dim)")) == NULL ||
        (*k = as_array(kobj, NPY_FLOAT32, 3, "rope_kv_store k (n, n_head_kv, head_dim)")) == NULL ||
        (*v = as_array(vobj, NPY_FLOAT32, 3, "rope_kv_store v (n, n_head_kv, head_dim)")) == NULL ||
        (*pos = as_array(pobj, NPY_INT32, 1, "rope_kv_store positions")) == NULL ||
        (*kc = as_cache(kcobj, "rope_kv_store k_cache", &j.kv_type)) == NULL ||
        (*vc = as_cache(vcobj, "rope_kv_store v_cache", &v_type)) == NULL ||
        caches_agree(j.kv_type, v_type, "rope_kv_store") < 0)
        goto fail;
    const npy_intp n = PyArray_DIM(*q, 0), n_head = PyArray_DIM(*q, 1), hd = PyArray_DIM(*q, 2);
    const npy_intp n_head_kv = PyArray_DIM(*k, 1);
    if (!PyArray_SAMESHAPE(*k, *v) || PyArray_DIM(*k, 0) != n || PyArray_DIM(*k, 2) != hd ||
        PyArray_DIM(*pos, 0) != n || !PyArray_SAMESHAPE(*kc, *vc) || PyArray_DIM(*kc, 1) != n_head_kv * hd) {
        PyErr_SetString(PyExc_ValueError, "rope_kv_store: q must be (n, n_head, head_dim), k and v (n, n_head_kv, "
                                          "head_dim), positions (n,), the caches (max_ctx, n_head_kv * head_dim)");
        goto fail;
    }
    if (hd % 2 != 0 || n > INT32_MAX || n_head < 1 || n_head > INT32_MAX || n_head_kv < 1 ||
        n_head_kv * hd > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "rope_kv_store: bad shape (head_dim %zd must be even and positive)",
                     (Py_ssize_t)hd);
        goto fail;
    }
    if (check_positions(*pos, PyArray_DIM(*kc, 0), "rope_kv_store") < 0) goto fail;
    if ((out[0] = new_array(NPY_FLOAT32, 3, PyArray_DIMS(*q))) == NULL ||
        (out[1] = new_array(NPY_FLOAT32, 3, PyArray_DIMS(*k))) == NULL ||
        (out[2] = new_array(PyArray_TYPE(*kc), 2, PyArray_DIMS(*kc))) == NULL ||
        (out[3] = new_array(PyArray_TYPE(*vc), 2, PyArray_DIMS(*vc))) == NULL)
        goto fail;
    j.op = op_rope_kv_store;
    j.i0 = (int)n;
    j.i1 = (int)n_head;
    j.i2 = (int)n_head_kv;
    j.i3 = (int)hd;
    j.f0 = theta;
    j.empty = n == 0 || hd == 0;
    for (int i = 0; i < 6; i++) job_in(&j, PyArray_DATA(in[i]), nbytes_of(in[i]));
    job_out(&j, PyArray_DATA(out[0]), nbytes_of(out[0]), 0);   /* rotated q, in place */
    job_out(&j, PyArray_DATA(out[1]), nbytes_of(out[1]), 1);   /* rotated k, in place */
    job_out(&j, PyArray_DATA(out[2]), nbytes_of(out[2]), 4);   /* the caches, updated */
    job_out(&j, PyArray_DATA(out[3]), nbytes_of(out[3]), 5);
    if (run_job(c, &j) < 0) goto fail;
    for (int i = 0; i < 6; i++) Py_DECREF(in[i]);
    return Py_BuildValue("(NNNN)", out[0], out[1], out[2], out[3]);
fail:
    for (int i = 0; i < 6; i++) Py_XDECREF(in[i]);
    for (int i = 0; i < 4; i++) Py_XDECREF(out[i]);
    return NULL;
}

static int op_attention(qc_backend *be, kernel_job *j) {
    /* i0 n, i1 n_kv, i2 n_head, i3 n_head_kv, i4 head_dim; outputs out[, scores, probs] */
    float *scores = j->n_out > 1 ? (float *)j->d_out[1] : NULL;
    float *probs = j->n_out > 2 ? (float *)j->d_out[2] : NULL;
    return be->ops->attention(be, (const float *)j->d_in[0], job_cache(j, 1, 2), (const int32_t *)j->d_in[3],
                              j->i0, j->i1, j->i2, j->i3, j->i4, (float *)j->d_out[0], scores, probs);
}

static PyObject *kernel_attention(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *qobj, *kcobj, *vcobj, *pobj;
    int n_kv, n_head_kv, want_scores;
    PyArrayObject *q = NULL, *kc = NULL, *vc = NULL, *pos = NULL, *out = NULL, *scores = NULL, *probs = NULL;
    kernel_job j = {0};
    cached_backend *c;
    npy_intp n, n_head, hd;
    int v_type = 0;
    if (!PyArg_ParseTuple(args, "sOOOOiip", &device, &qobj, &kcobj, &vcobj, &pobj, &n_kv, &n_head_kv, &want_scores))
        return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((q = as_array(qobj, NPY_FLOAT32, 3, "attention q (tokens, n_head, head_dim)")) == NULL ||
        (kc = as_cache(kcobj, "attention k_cache (max_ctx, n_head_kv * head_dim)", &j.kv_type)) == NULL ||
        (vc = as_cache(vcobj, "attention v_cache", &v_type)) == NULL ||
        caches_agree(j.kv_type, v_type, "attention") < 0 ||
        (pos = as_array(pobj, NPY_INT32, 1, "attention positions")) == NULL)
        goto fail;
    n = PyArray_DIM(q, 0);
    n_head = PyArray_DIM(q, 1);
    hd = PyArray_DIM(q, 2);
    if (n_head_kv < 1 || n_head < 1 || n_head % n_head_kv != 0) {
        PyErr_Format(PyExc_ValueError, "attention: n_head %zd is not a multiple of n_head_kv %d", (Py_ssize_t)n_head,
                     n_head_kv);
        goto fail;
    }
    if (!PyArray_SAMESHAPE(kc, vc) || PyArray_DIM(kc, 1) != n_head_kv * hd) {
        PyErr_Format(PyExc_ValueError, "attention: the caches must both be (max_ctx, %zd) for %d KV heads of %zd",
                     (Py_ssize_t)(n_head_kv * hd), n_head_kv, (Py_ssize_t)hd);
        goto fail;
    }
    if (PyArray_DIM(pos, 0) != n) {
        PyErr_Format(PyExc_ValueError, "attention: %zd positions for %zd queries", (Py_ssize_t)PyArray_DIM(pos, 0),
                     (Py_ssize_t)n);
        goto fail;
    }
    if (n_kv < 1 || n_kv > PyArray_DIM(kc, 0)) {
        PyErr_Format(PyExc_ValueError, "attention: n_kv %d is not in [1, max_ctx = %zd]", n_kv,
                     (Py_ssize_t)PyArray_DIM(kc, 0));
        goto fail;
    }
    if (check_positions(pos, n_kv, "attention (positions must be < n_kv)") < 0) goto fail;
    if (n > INT32_MAX || n_head > INT32_MAX || hd < 1 || hd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "attention: bad q shape");
        goto fail;
    }
    {
        npy_intp oshape[2] = {n, n_head * hd}, sshape[3] = {n_head, n, n_kv};
        if ((out = new_array(NPY_FLOAT32, 2, oshape)) == NULL) goto fail;
        if (want_scores && ((scores = new_array(NPY_FLOAT32, 3, sshape)) == NULL ||
                            (probs = new_array(NPY_FLOAT32, 3, sshape)) == NULL))
            goto fail;
    }
    j.op = op_attention;
    j.i0 = (int)n;
    j.i1 = n_kv;
    j.i2 = (int)n_head;
    j.i3 = n_head_kv;
    j.i4 = (int)hd;
    j.empty = n == 0;
    job_in(&j, PyArray_DATA(q), nbytes_of(q));
    job_in(&j, PyArray_DATA(kc), nbytes_of(kc));
    job_in(&j, PyArray_DATA(vc), nbytes_of(vc));
    job_in(&j, PyArray_DATA(pos), nbytes_of(pos));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (scores) {
        job_out(&j, PyArray_DATA(scores), nbytes_of(scores), -1);
        job_out(&j, PyArray_DATA(probs), nbytes_of(probs), -1);
    }
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(q);
    Py_DECREF(kc);
    Py_DECREF(vc);
    Py_DECREF(pos);
    if (scores) return Py_BuildValue("(NNN)", out, scores, probs);
    return Py_BuildValue("(NOO)", out, Py_None, Py_None);
fail:
    Py_XDECREF(q);
    Py_XDECREF(kc);
    Py_XDECREF(vc);
    Py_XDECREF(pos);
    Py_XDECREF(out);
    Py_XDECREF(scores);
    Py_XDECREF(probs);
    return NULL;
}

static int op_swiglu(qc_backend *be, kernel_job *j) {
    return be->ops->swiglu(be, (const float *)j->d_in[0], (const float *)j->d_in[1], j->count, (float *)j->d_out[0]);
}

static int op_add(qc_backend *be, kernel_job *j) {
    return be->ops->add(be, (const float *)j->d_in[0], (const float *)j->d_in[1], j->count, (float *)j->d_out[0]);
}

/* swiglu and add: elementwise over two float32 arrays of one shape */
static PyObject *binary_op(PyObject *args, job_op op, const char *name) {
    const char *device;
    PyObject *aobj, *bobj;
    PyArrayObject *a = NULL, *b = NULL, *out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    if (!PyArg_ParseTuple(args, "sOO", &device, &aobj, &bobj)) return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((a = as_array(aobj, NPY_FLOAT32, -1, name)) == NULL || (b = as_array(bobj, NPY_FLOAT32, -1, name)) == NULL)
        goto fail;
    if (!PyArray_SAMESHAPE(a, b)) {
        PyErr_Format(PyExc_ValueError, "%s: the two inputs must have the same shape", name);
        goto fail;
    }
    if ((out = new_array(NPY_FLOAT32, PyArray_NDIM(a), PyArray_DIMS(a))) == NULL) goto fail;
    j.op = op;
    j.count = (int64_t)PyArray_SIZE(a);
    j.empty = j.count == 0;
    job_in(&j, PyArray_DATA(a), nbytes_of(a));
    job_in(&j, PyArray_DATA(b), nbytes_of(b));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(a);
    Py_DECREF(b);
    return (PyObject *)out;
fail:
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *kernel_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    return binary_op(args, op_swiglu, "swiglu");
}

static PyObject *kernel_add(PyObject *self, PyObject *args) {
    (void)self;
    return binary_op(args, op_add, "add");
}

static int op_argmax(qc_backend *be, kernel_job *j) {
    return be->ops->argmax(be, (const float *)j->d_in[0], j->i0, j->count, (int32_t *)j->d_out[0]);
}

static PyObject *kernel_argmax(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj;
    PyArrayObject *x = NULL, *out = NULL;
    kernel_job j = {0};
    cached_backend *c;
    npy_intp n;
    if (!PyArg_ParseTuple(args, "sO", &device, &xobj)) return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((x = as_array(xobj, NPY_FLOAT32, 2, "argmax x (rows, cols)")) == NULL) goto fail;
    if (PyArray_DIM(x, 0) > INT32_MAX || PyArray_DIM(x, 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "argmax: x is too large");
        goto fail;
    }
    if (PyArray_DIM(x, 1) < 1 && PyArray_DIM(x, 0) > 0) {
        PyErr_SetString(PyExc_ValueError, "argmax: rows are empty");
        goto fail;
    }
    n = PyArray_DIM(x, 0);
    if ((out = new_array(NPY_INT32, 1, &n)) == NULL) goto fail;
    j.op = op_argmax;
    j.i0 = (int)n;
    j.count = (int64_t)PyArray_DIM(x, 1);
    j.empty = n == 0;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_out(&j, PyArray_DATA(out), nbytes_of(out), -1);
    if (run_job(c, &j) < 0) goto fail;
    Py_DECREF(x);
    return (PyObject *)out;
fail:
    Py_XDECREF(x);
    Py_XDECREF(out);
    return NULL;
}

static int op_sample(qc_backend *be, kernel_job *j) {
    /* inputs: logits, state; outputs: work (scratch), result */
    return be->ops->sample(be, (const float *)j->d_in[0], j->count, j->d_in[1], j->d_out[0], j->d_out[1]);
}

/* kernel_sample(device, logits float32 (n_vocab,), sampler) -> token: the sampler's next draw,
 * made by the backend's sample op from the state the sampler exports; the sampler's RNG then
 * advances exactly as Sampler.sample(logits) would have advanced it. */
static PyObject *kernel_sample(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *sobj;
    PyArrayObject *x = NULL;
    qc_sample_state *state = NULL;
    qc_sample_result drawn = {0, -1, 0};
    kernel_job j = {0};
    cached_backend *c;
    qc_sampler *sp;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "sOO", &device, &xobj, &sobj)) return NULL;
    if ((sp = qc_py_sampler_of(sobj)) == NULL) return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((x = as_array(xobj, NPY_FLOAT32, 1, "sample logits (n_vocab,)")) == NULL) goto done;
    if (PyArray_DIM(x, 0) != qc_sampler_n_vocab(sp)) {
        PyErr_Format(PyExc_ValueError, "sample: %zd logits for a sampler of %lld", (Py_ssize_t)PyArray_DIM(x, 0),
                     (long long)qc_sampler_n_vocab(sp));
        goto done;
    }
    if ((state = malloc(qc_sampler_state_bytes(sp))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t state_bytes = qc_sampler_export(sp, state);
    j.op = op_sample;
    j.count = (int64_t)PyArray_DIM(x, 0);
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_in(&j, state, state_bytes);
    job_out(&j, NULL, qc_sample_work_bytes(j.count), -1);
    job_out(&j, &drawn, sizeof drawn, -1);
    if (run_job(c, &j) < 0) goto done;
    if (drawn.token < 0) {
        PyErr_SetString(PyExc_ValueError, "no token can be sampled: every logit is NaN or -inf");
        goto done;
    }
    qc_sampler_set_rng(sp, drawn.rng);
    res = PyLong_FromLong(drawn.token);
done:
    free(state);
    Py_XDECREF(x);
    return res;
}

/* _kernel_sample_state(device, logits float32 (n_vocab,), rng, temperature, top_k, top_p, min_p,
 * repeat_penalty, history int32 (m,)) -> (token, rng after): the sample op on a state given
 * as is, for tests: unlike a Sampler's export, the history may repeat a token or name ids out
 * of range, which the op must ignore (sampler.h). Parameters are not checked: tests only. */
static PyObject *kernel_sample_state(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *hobj;
    unsigned long long rng;
    float temperature, top_p, min_p, penalty;
    int top_k;
    PyArrayObject *x = NULL, *h = NULL;
    qc_sample_state *state = NULL;
    qc_sample_result drawn = {0, -1, 0};
    kernel_job j = {0};
    cached_backend *c;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "sOKfifffO", &device, &xobj, &rng, &temperature, &top_k, &top_p,
                          &min_p, &penalty, &hobj))
        return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((x = as_array(xobj, NPY_FLOAT32, 1, "sample logits (n_vocab,)")) == NULL) goto done;
    if ((h = as_array(hobj, NPY_INT32, 1, "sample history (m,)")) == NULL) goto done;
    const size_t hist_bytes = (size_t)PyArray_DIM(h, 0) * sizeof(int32_t);
    if (rng == 0 || PyArray_DIM(h, 0) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "_kernel_sample_state: rng must be nonzero, history < 2^31");
        goto done;
    }
    if ((state = malloc(sizeof *state + hist_bytes)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    *state = (qc_sample_state){.rng = rng, .temperature = temperature, .top_p = top_p,
                               .min_p = min_p, .repeat_penalty = penalty, .top_k = top_k,
                               .n_history = (int32_t)PyArray_DIM(h, 0)};
    if (hist_bytes) memcpy(state + 1, PyArray_DATA(h), hist_bytes);
    j.op = op_sample;
    j.count = (int64_t)PyArray_DIM(x, 0);
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_in(&j, state, sizeof *state + hist_bytes);
    job_out(&j, NULL, qc_sample_work_bytes(j.count), -1);
    job_out(&j, &drawn, sizeof drawn, -1);
    if (run_job(c, &j) < 0) goto done;
    res = Py_BuildValue("iK", (int)drawn.token, (unsigned long long)drawn.rng);
done:
    free(state);
    Py_XDECREF(x);
    Py_XDECREF(h);
    return res;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* i1 timed calls after 3 untimed ones, between two synchronizations */
static int op_time_matmul(qc_backend *be, kernel_job *j) {
    for (int i = 0; i < 3; i++)
        if (op_matmul(be, j) < 0) return -1;
    if (be->ops->synchronize(be) < 0) return -1;
    const double t0 = now_seconds();
    for (int i = 0; i < j->i1; i++)
        if (op_matmul(be, j) < 0) return -1;
    if (be->ops->synchronize(be) < 0) return -1;
    j->seconds = (now_seconds() - t0) / j->i1;
    return 0;
}

/* kernel_time_matmul(device, weight, x, iters) -> seconds per matmul call: the shipped op timed
 * on the backend with no Python in between (weights and x already on the device). */
static PyObject *kernel_time_matmul(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj;
    int iters;
    weight_arg wa;
    PyArrayObject *x = NULL;
    kernel_job j = {0};
    cached_backend *c;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "sOOi", &device, &wobj, &xobj, &iters)) return NULL;
    if (weight_arg_parse(wobj, &wa) < 0) return NULL;
    if ((c = get_backend(device)) == NULL) goto done;
    if ((x = as_array(xobj, NPY_FLOAT32, 2, "time_matmul x")) == NULL) goto done;
    if (PyArray_DIM(x, 1) != wa.w.cols || PyArray_DIM(x, 0) < 1 || PyArray_DIM(x, 0) > INT32_MAX || iters < 1) {
        PyErr_SetString(PyExc_ValueError, "time_matmul: x must be (n >= 1, cols) and iters >= 1");
        goto done;
    }
    j.op = op_time_matmul;
    j.w[0] = &wa.w;
    j.i0 = (int)PyArray_DIM(x, 0);
    j.i1 = iters;
    job_in(&j, PyArray_DATA(x), nbytes_of(x));
    job_out(&j, NULL, (size_t)j.i0 * (size_t)wa.w.rows * sizeof(float), -1);
    if (run_job(c, &j) < 0) goto done;
    res = PyFloat_FromDouble(j.seconds);
done:
    Py_XDECREF(x);
    weight_arg_release(&wa);
    return res;
}

/* Destroy the cached backends (all, or the one of `device`): frees their GPU stream, cuBLAS
 * handle and scratch. The next kernel call creates a fresh one. */
static PyObject *kernel_release(PyObject *self, PyObject *args) {
    (void)self;
    const char *device = NULL;
    char name[32] = "";
    if (!PyArg_ParseTuple(args, "|z", &device)) return NULL;
    if (device) normalize_device(device, name, sizeof name);
    for (int i = 0; i < QC_MAX_KERNEL_BACKENDS; i++) {
        cached_backend *c = &g_backends[i];
        if (c->lock == NULL || c->be == NULL || (device && strcmp(c->name, name) != 0)) continue;
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(c->lock, WAIT_LOCK);
        qc_backend_destroy(c->be);
        c->be = NULL;
        PyThread_release_lock(c->lock);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* cuda_mem_info(device=0) -> (free_bytes, total_bytes) of a CUDA device (cudaMemGetInfo). */
static PyObject *cuda_mem_info(PyObject *self, PyObject *args) {
    (void)self;
    int device = 0;
    if (!PyArg_ParseTuple(args, "|i", &device)) return NULL;
#ifdef QC_HAVE_CUDA
    size_t free_b = 0, total_b = 0;
    qc_error err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qc_cuda_mem_info(device, &free_b, &total_b, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return qc_py_raise(&err);
    return Py_BuildValue("(KK)", (unsigned long long)free_b, (unsigned long long)total_b);
#else
    qc_error err;
    qc_fail(&err, QC_ERR_CUDA, "cuda_mem_info: this qwencuda was built without CUDA");
    return qc_py_raise(&err);
#endif
}

static PyMethodDef kernel_methods[] = {
    {"kernel_embed", kernel_embed, METH_VARARGS,
     "kernel_embed(device, (raw, type, rows, cols), ids int32 (n,)) -> float32 (n, cols)"},
    {"kernel_dequantize", kernel_dequantize, METH_VARARGS,
     "kernel_dequantize(device, (raw, type, rows, cols)) -> float32 (rows, cols), through the embed op"},
    {"kernel_matmul", kernel_matmul, METH_VARARGS,
     "kernel_matmul(device, (raw, type, rows, cols), x float32 (n, cols), bias=None) -> float32 (n, rows)"},
    {"kernel_rmsnorm", kernel_rmsnorm, METH_VARARGS,
     "kernel_rmsnorm(device, x float32 (n, dim), w float32 (dim,), eps) -> float32 (n, dim)"},
    {"kernel_rope", kernel_rope, METH_VARARGS,
     "kernel_rope(device, x float32 (n, heads, head_dim), pos int32 (n,), theta) -> rotated copy of x"},
    {"kernel_kv_store", kernel_kv_store, METH_VARARGS,
     "kernel_kv_store(device, k, v (n, kv_dim), pos (n,), k_cache, v_cache (max_ctx, kv_dim)) -> (k_cache, v_cache) updated copies"},
    {"kernel_matmul_add", kernel_matmul_add, METH_VARARGS,
     "kernel_matmul_add(device, (raw, type, rows, cols), x (n, cols), residual (n, rows), in_place) -> "
     "residual + x @ W^T (in_place: the op writes over the residual's backend buffer)"},
    {"kernel_matmul_multi", kernel_matmul_multi, METH_VARARGS,
     "kernel_matmul_multi(device, (weight, ...), x (n, cols), (bias or None, ...)) -> (x @ W_i^T + b_i, ...)"},
    {"kernel_matmul_swiglu", kernel_matmul_swiglu, METH_VARARGS,
     "kernel_matmul_swiglu(device, gate weight, up weight, x (n, cols)) -> silu(x @ Wg^T) * (x @ Wu^T)"},
    {"kernel_rope_kv_store", kernel_rope_kv_store, METH_VARARGS,
     "kernel_rope_kv_store(device, q (n, n_head, hd), k, v (n, n_head_kv, hd), pos (n,), k_cache, v_cache "
     "(max_ctx, n_head_kv*hd), theta) -> (q rotated, k rotated, k_cache, v_cache) updated copies"},
    {"kernel_attention", kernel_attention, METH_VARARGS,
     "kernel_attention(device, q (n, n_head, hd), k_cache, v_cache (max_ctx, n_head_kv*hd), pos (n,), n_kv, "
     "n_head_kv, want_scores) -> (out (n, n_head*hd), scores, probs (n_head, n, n_kv) or None)"},
    {"kernel_swiglu", kernel_swiglu, METH_VARARGS, "kernel_swiglu(device, gate, up) -> silu(gate) * up"},
    {"kernel_add", kernel_add, METH_VARARGS, "kernel_add(device, a, b) -> a + b"},
    {"kernel_argmax", kernel_argmax, METH_VARARGS, "kernel_argmax(device, x float32 (n, cols)) -> int32 (n,)"},
    {"_kernel_sample_state", kernel_sample_state, METH_VARARGS,
     "_kernel_sample_state(device, logits, rng, temperature, top_k, top_p, min_p, repeat_penalty, "
     "history int32) -> (token, rng): the sample op on a raw state (tests)"},
    {"kernel_sample", kernel_sample, METH_VARARGS,
     "kernel_sample(device, logits float32 (n_vocab,), sampler) -> int: the sampler's next draw, on the backend"},
    {"kernel_time_matmul", kernel_time_matmul, METH_VARARGS,
     "kernel_time_matmul(device, (raw, type, rows, cols), x (n, cols), iters) -> seconds per matmul call"},
    {"kernel_release", kernel_release, METH_VARARGS,
     "kernel_release(device=None): destroy the cached kernel backend(s)"},
    {"cuda_mem_info", cuda_mem_info, METH_VARARGS,
     "cuda_mem_info(device=0) -> (free_bytes, total_bytes) of a CUDA device"},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_kernels(PyObject *m) {
    if (PyModule_AddIntConstant(m, "GEMV_MAX_TOKENS", QC_GEMV_MAX_TOKENS) < 0 ||
        PyModule_AddIntConstant(m, "MATMUL_MULTI_MAX", QC_MATMUL_MULTI_MAX) < 0)
        return -1;
    return PyModule_AddFunctions(m, kernel_methods);
}
