/* py_kernels.c: every op of backend.h (and dequantize) callable on NumPy arrays, on any backend.
 *
 * _core.kernel_<op>(device, ...) creates (once per device, then cached) the backend that
 * qc_backend_create gives for `device`, allocates backend buffers, uploads the inputs, runs the
 * op through be->ops (the very function the forward pass calls), downloads the outputs and frees
 * the buffers. The GIL is released around all backend work; a per-backend lock serialises
 * callers, since a backend serves one caller at a time (backend.h).
 *
 * Each op has three parts here: <op>_args, its arguments as backend.h names them, each array a
 * job_array (what is uploaded before the op and downloaded after); op_<op>, which calls be->ops
 * with them; and kernel_<op>, the binding that checks the Python arguments and fills them. The
 * call itself (kernel_job, run_job) is the same for every op.
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
#include "../../kernels/qc_cuda_api.h"
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

/* "cuda" and "cuda:0" are one device (and "cuda:float", "cuda:0:float"). */
static void normalize_device(const char *device, char *out, size_t size) {
    if (strcmp(device, "cuda") == 0) device = "cuda:0";
    if (strcmp(device, "cuda:float") == 0) device = "cuda:0:float";
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
/* what a binding holds while it runs (GIL held): the NumPy arrays it converted or made and the
 * buffers of its weights, released together at its one exit */

#define QC_MAX_HELD 16   /* matmul_qkv_rope: x, positions, 2 caches, 3 biases, 6 outputs, norm */

typedef struct {
    Py_buffer view;             /* the stored bytes, kept while the call runs */
    qc_weight w;
} weight_arg;

typedef struct {
    PyArrayObject *arrays[QC_MAX_HELD];
    int n_arrays;
    weight_arg weights[QC_MATMUL_MULTI_MAX];
    int n_weights;
} held;

/* Keeps a (a new reference, or NULL with an exception set) until release_held; returns a. */
static PyArrayObject *hold(held *h, PyArrayObject *a) {
    if (a != NULL && h->n_arrays == QC_MAX_HELD) {
        Py_DECREF(a);
        PyErr_SetString(PyExc_RuntimeError, "py_kernels: too many arrays in one call");
        return NULL;
    }
    if (a != NULL) h->arrays[h->n_arrays++] = a;
    return a;
}

static void release_held(held *h) {
    for (int i = 0; i < h->n_arrays; i++) Py_DECREF(h->arrays[i]);
    for (int i = 0; i < h->n_weights; i++) PyBuffer_Release(&h->weights[i].view);
    h->n_arrays = h->n_weights = 0;
}

/* A held array returned to Python: a reference of its own. */
static PyObject *new_ref(PyArrayObject *a) {
    Py_INCREF(a);
    return (PyObject *)a;
}

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

/* (raw, type, rows, cols) -> a qc_weight whose host bytes are raw's buffer, held in h; NULL
 * with an exception. */
static qc_weight *hold_weight(held *h, PyObject *tuple) {
    PyObject *raw = NULL;
    unsigned int type = 0;
    long long rows = 0, cols = 0;
    if (h->n_weights == QC_MATMUL_MULTI_MAX) {
        PyErr_SetString(PyExc_RuntimeError, "py_kernels: too many weights in one call");
        return NULL;
    }
    weight_arg *wa = &h->weights[h->n_weights];
    if (!PyTuple_Check(tuple)) {
        PyErr_SetString(PyExc_TypeError, "weight must be (raw, type, rows, cols)");
        return NULL;
    }
    if (!PyArg_ParseTuple(tuple, "OILL;weight must be (raw, type, rows, cols)", &raw, &type, &rows, &cols))
        return NULL;
    const qc_type_traits *tr = qc_type_get(type);
    if (tr == NULL || tr->type_size == 0 || tr->dequantize == NULL) {
        PyErr_Format(PyExc_ValueError, "weight type %u is not a type qwencuda can run", type);
        return NULL;
    }
    if (rows < 1 || cols < 1) {
        PyErr_Format(PyExc_ValueError, "weight shape (%lld, %lld) must be positive", rows, cols);
        return NULL;
    }
    int64_t rb = qc_row_bytes(type, cols);
    if (rb < 0) {
        PyErr_Format(PyExc_ValueError, "weight of type %s: %lld columns is not a multiple of its block size %lld",
                     tr->name, cols, (long long)tr->block_size);
        return NULL;
    }
    if (rows > INT64_MAX / rb) {   /* before rows * rb is formed anywhere */
        PyErr_Format(PyExc_ValueError, "weight of type %s and shape (%lld, %lld) needs more than "
                     "%lld bytes", tr->name, rows, cols, (long long)INT64_MAX);
        return NULL;
    }
    if (PyObject_GetBuffer(raw, &wa->view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    h->n_weights++;   /* released by release_held from here on */
    if ((int64_t)wa->view.len != rows * rb) {
        PyErr_Format(PyExc_ValueError, "weight of type %s and shape (%lld, %lld) needs %lld bytes, raw has %zd",
                     tr->name, rows, cols, (long long)(rows * rb), wa->view.len);
        return NULL;
    }
    wa->w = (qc_weight){.type = type, .rows = rows, .cols = cols, .nbytes = (size_t)wa->view.len,
                        .host = wa->view.buf, .data = NULL};
    return &wa->w;
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

/* The optional norm weight of the fused ops: None, or float32 (cols,), held in h. -1 with an
 * exception on error; *arr stays NULL for None. */
static int norm_arg(held *h, PyObject *obj, int64_t cols, const char *what, PyArrayObject **arr) {
    *arr = NULL;
    if (obj == NULL || obj == Py_None) return 0;
    if ((*arr = hold(h, as_array(obj, NPY_FLOAT32, 1, what))) == NULL) return -1;
    if (PyArray_DIM(*arr, 0) != cols) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values for rows of %lld", what, (Py_ssize_t)PyArray_DIM(*arr, 0),
                     (long long)cols);
        return -1;
    }
    return 0;
}

static PyArrayObject *new_array(int typenum, int ndim, const npy_intp *shape) {
    return (PyArrayObject *)PyArray_SimpleNew(ndim, (npy_intp *)shape, typenum);
}

static size_t nbytes_of(PyArrayObject *a) { return (size_t)PyArray_NBYTES(a); }

/* ---------------------------------------------------------------------------------------- */
/* one kernel call on the backend: its arrays put in backend buffers, its weights loaded, the
 * op run on its argument struct, its outputs fetched, everything freed */

/* An array of a call: host bytes uploaded into a backend buffer before the op, and/or downloaded
 * from it after (both: the op works in place on the buffer and the caller receives a copy). */
typedef struct {
    const void *in;             /* uploaded before the op; NULL: not */
    void *out;                  /* downloaded into after the op; NULL: not (scratch) */
    size_t bytes;
    void *dev;                  /* the backend buffer while the op runs; NULL for an array not
                                 * in the job (an absent bias or norm) */
} job_array;

static job_array arr_in(PyArrayObject *a) { return (job_array){PyArray_DATA(a), NULL, nbytes_of(a), NULL}; }
static job_array arr_out(PyArrayObject *a) { return (job_array){NULL, PyArray_DATA(a), nbytes_of(a), NULL}; }
/* a's values in, changed in place by the op, out (a new array of a's shape and type) receives them */
static job_array arr_inout(PyArrayObject *a, PyArrayObject *out) {
    return (job_array){PyArray_DATA(a), PyArray_DATA(out), nbytes_of(a), NULL};
}

#define QC_JOB_MAX 12    /* matmul_qkv_rope: x, positions, 2 caches, 3 biases, 4 outputs, norm */

typedef struct {
    int (*op)(qc_backend *be, void *args);   /* the backend op on the job's <op>_args */
    void *args;
    job_array *arrays[QC_JOB_MAX];           /* the args' arrays in the job (NULL entries: none) */
    qc_weight *w[QC_MATMUL_MULTI_MAX];       /* loaded before the op, freed after (NULL: none) */
    int empty;                               /* nothing to compute (zero tokens): skip the backend */
} kernel_job;

/* The backend part of a call (no GIL): 0, or -1 with be->err set. Frees what it made. */
static int job_work(qc_backend *be, kernel_job *j) {
    int rc = 0, n_w = 0;            /* n_w: weights whose load was tried, all freed below */
    be->err.kind = QC_OK;
    be->err.msg[0] = '\0';
    if (j->empty) return 0;
    while (rc == 0 && n_w < QC_MATMUL_MULTI_MAX && j->w[n_w])
        rc = be->ops->weight_load(be, j->w[n_w++]);
    for (int i = 0; i < QC_JOB_MAX && rc == 0; i++) {
        job_array *a = j->arrays[i];
        if (a == NULL) continue;
        if ((rc = be->ops->alloc(be, a->bytes ? a->bytes : 4, &a->dev)) < 0) a->dev = NULL;
        else if (a->in && a->bytes) rc = be->ops->upload(be, a->dev, a->in, a->bytes);
    }
    if (rc == 0) rc = j->op(be, j->args);
    for (int i = 0; i < QC_JOB_MAX && rc == 0; i++)
        if (j->arrays[i] && j->arrays[i]->out)
            rc = be->ops->download(be, j->arrays[i]->out, j->arrays[i]->dev, j->arrays[i]->bytes);
    qc_error keep = be->err;
    be->ops->synchronize(be);   /* no queued kernel may still use the buffers or the weights */
    for (int i = QC_JOB_MAX - 1; i >= 0; i--)
        if (j->arrays[i]) be->ops->free(be, j->arrays[i]->dev);
    for (int i = 0; i < n_w; i++) be->ops->weight_free(be, j->w[i]);   /* safe after a failed load */
    be->err = keep;
    return rc < 0 ? -1 : 0;
}

/* Run the job on cached backend c with the GIL released and c's lock held (a backend serves one
 * caller at a time); raises on failure. */
static int run_job(cached_backend *c, kernel_job *j) {
    qc_error err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(c->lock, WAIT_LOCK);
    if (c->be == NULL)
        rc = qc_fail(&err, QC_ERR_VALUE, "the kernels backend was released meanwhile");
    else if ((rc = job_work(c->be, j)) < 0)
        err = c->be->err;
    PyThread_release_lock(c->lock);
    Py_END_ALLOW_THREADS
    if (rc < 0) qc_py_raise(&err);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* the ops: for each, its arguments (backend.h's, with arrays as job_arrays), the call of
 * be->ops on them, and the binding that checks the Python arguments and fills them */

typedef struct {
    const qc_weight *table;
    job_array ids, out;
    int n;
} embed_args;

static int op_embed(qc_backend *be, void *p) {
    embed_args *a = p;
    return be->ops->embed(be, a->table, a->ids.dev, a->n, a->out.dev);
}

/* embed rows ids of a weight table (held in h with ids); shared by kernel_embed and
 * kernel_dequantize */
static PyObject *run_embed(cached_backend *c, held *h, qc_weight *table, PyArrayObject *ids) {
    const npy_intp n = PyArray_SIZE(ids);
    const int32_t *idv = (const int32_t *)PyArray_DATA(ids);
    PyArrayObject *out;
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "embed: too many ids");
        return NULL;
    }
    for (npy_intp i = 0; i < n; i++)
        if (idv[i] < 0 || idv[i] >= table->rows) {
            PyErr_Format(PyExc_ValueError, "embed: id %d at index %zd is out of range [0, %lld)", (int)idv[i],
                         (Py_ssize_t)i, (long long)table->rows);
            return NULL;
        }
    npy_intp shape[2] = {n, (npy_intp)table->cols};
    if ((out = hold(h, new_array(NPY_FLOAT32, 2, shape))) == NULL) return NULL;
    embed_args a = {.table = table, .ids = arr_in(ids), .out = arr_out(out), .n = (int)n};
    kernel_job j = {.op = op_embed, .args = &a, .arrays = {&a.ids, &a.out}, .w = {table}, .empty = n == 0};
    return run_job(c, &j) < 0 ? NULL : new_ref(out);
}

static PyObject *kernel_embed(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *idobj, *res = NULL;
    held h = {0};
    qc_weight *w;
    cached_backend *c;
    PyArrayObject *ids;
    if (!PyArg_ParseTuple(args, "sOO", &device, &wobj, &idobj)) return NULL;
    if ((w = hold_weight(&h, wobj)) != NULL && (c = get_backend(device)) != NULL &&
        (ids = hold(&h, as_array(idobj, NPY_INT32, 1, "embed ids"))) != NULL)
        res = run_embed(c, &h, w, ids);
    release_held(&h);
    return res;
}

static PyObject *kernel_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *res = NULL;
    held h = {0};
    qc_weight *w;
    cached_backend *c;
    PyArrayObject *ids;
    npy_intp n;
    if (!PyArg_ParseTuple(args, "sO", &device, &wobj)) return NULL;
    if ((w = hold_weight(&h, wobj)) == NULL || (c = get_backend(device)) == NULL) goto done;
    if (w->rows > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "dequantize: too many rows");
        goto done;
    }
    n = (npy_intp)w->rows;
    if ((ids = hold(&h, new_array(NPY_INT32, 1, &n))) == NULL) goto done;
    for (npy_intp i = 0; i < n; i++) ((int32_t *)PyArray_DATA(ids))[i] = (int32_t)i;
    res = run_embed(c, &h, w, ids);
done:
    release_held(&h);
    return res;
}

typedef struct {
    const qc_weight *w;
    job_array x, bias, out;     /* bias.dev NULL: no bias */
    int n;
} matmul_args;

static int op_matmul(qc_backend *be, void *p) {
    matmul_args *a = p;
    return be->ops->matmul(be, a->w, a->bias.dev, a->x.dev, a->n, a->out.dev);
}

static PyObject *kernel_matmul(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *bobj = Py_None, *res = NULL;
    held h = {0};
    qc_weight *w;
    cached_backend *c;
    PyArrayObject *x, *bias = NULL, *out;
    if (!PyArg_ParseTuple(args, "sOO|O", &device, &wobj, &xobj, &bobj)) return NULL;
    if ((w = hold_weight(&h, wobj)) == NULL || (c = get_backend(device)) == NULL ||
        (x = hold(&h, as_array(xobj, NPY_FLOAT32, 2, "matmul x"))) == NULL)
        goto done;
    if (PyArray_DIM(x, 1) != w->cols) {
        PyErr_Format(PyExc_ValueError, "matmul: x has %zd columns, the weight (%lld, %lld) needs %lld",
                     (Py_ssize_t)PyArray_DIM(x, 1), (long long)w->rows, (long long)w->cols, (long long)w->cols);
        goto done;
    }
    if (PyArray_DIM(x, 0) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "matmul: too many rows in x");
        goto done;
    }
    if (bobj != Py_None) {
        if ((bias = hold(&h, as_array(bobj, NPY_FLOAT32, 1, "matmul bias"))) == NULL) goto done;
        if (PyArray_DIM(bias, 0) != w->rows) {
            PyErr_Format(PyExc_ValueError, "matmul: bias has %zd values, the weight has %lld rows",
                         (Py_ssize_t)PyArray_DIM(bias, 0), (long long)w->rows);
            goto done;
        }
    }
    npy_intp shape[2] = {PyArray_DIM(x, 0), (npy_intp)w->rows};
    if ((out = hold(&h, new_array(NPY_FLOAT32, 2, shape))) == NULL) goto done;
    matmul_args a = {.w = w, .x = arr_in(x), .out = arr_out(out), .n = (int)shape[0]};
    if (bias) a.bias = arr_in(bias);
    kernel_job j = {.op = op_matmul, .args = &a, .arrays = {&a.x, &a.out, bias ? &a.bias : NULL}, .w = {w},
                    .empty = shape[0] == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

typedef struct {
    const qc_weight *w;
    job_array x, residual, out;
    int n;
    int in_place;               /* the op writes over residual's buffer (out is not in the job) */
} matmul_add_args;

static int op_matmul_add(qc_backend *be, void *p) {
    matmul_add_args *a = p;
    return be->ops->matmul_add(be, a->w, a->x.dev, a->n, a->residual.dev,
                               a->in_place ? a->residual.dev : a->out.dev, 0, NULL);
}

static PyObject *kernel_matmul_add(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *robj, *res = NULL;
    int in_place;
    held h = {0};
    qc_weight *w;
    cached_backend *c;
    PyArrayObject *x, *resid, *out;
    if (!PyArg_ParseTuple(args, "sOOOp", &device, &wobj, &xobj, &robj, &in_place)) return NULL;
    if ((w = hold_weight(&h, wobj)) == NULL || (c = get_backend(device)) == NULL ||
        (x = hold(&h, matmul_x(xobj, w->cols, "matmul_add"))) == NULL ||
        (resid = hold(&h, as_array(robj, NPY_FLOAT32, 2, "matmul_add residual"))) == NULL)
        goto done;
    if (PyArray_DIM(resid, 0) != PyArray_DIM(x, 0) || PyArray_DIM(resid, 1) != w->rows) {
        PyErr_Format(PyExc_ValueError, "matmul_add: residual must be (%zd, %lld), got (%zd, %zd)",
                     (Py_ssize_t)PyArray_DIM(x, 0), (long long)w->rows, (Py_ssize_t)PyArray_DIM(resid, 0),
                     (Py_ssize_t)PyArray_DIM(resid, 1));
        goto done;
    }
    if ((out = hold(&h, new_array(NPY_FLOAT32, 2, PyArray_DIMS(resid)))) == NULL) goto done;
    matmul_add_args a = {.w = w, .x = arr_in(x), .n = (int)PyArray_DIM(x, 0), .in_place = in_place};
    a.residual = in_place ? arr_inout(resid, out) : arr_in(resid);
    a.out = arr_out(out);
    kernel_job j = {.op = op_matmul_add, .args = &a, .arrays = {&a.x, &a.residual, in_place ? NULL : &a.out},
                    .w = {w}, .empty = PyArray_DIM(x, 0) == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

typedef struct {
    const qc_weight *w[QC_MATMUL_MULTI_MAX];
    job_array x, bias[QC_MATMUL_MULTI_MAX], out[QC_MATMUL_MULTI_MAX], norm;   /* dev NULL: none */
    int n_parts, n;
    float eps;
} matmul_multi_args;

/* The parts of a matmul_multi call (a->w, a->n_parts, a->x and a->n set): each weight's bias
 * from bseq (None: none) and a new output (n, rows) in out[i], and the norm weight nobj (None or
 * NULL: none), all added to the job j after its first *n_arrays arrays. 0, or -1 with an
 * exception set. matmul_multi and matmul_qkv_rope share it. */
static int multi_outputs(held *h, kernel_job *j, int *n_arrays, matmul_multi_args *a, PyObject *bseq, PyObject *nobj,
                         PyArrayObject **out, const char *op) {
    char what[64];
    for (int i = 0; i < a->n_parts; i++) {
        PyObject *b = PyTuple_GET_ITEM(bseq, i);
        npy_intp shape[2] = {(npy_intp)a->n, (npy_intp)a->w[i]->rows};
        if (b != Py_None) {
            snprintf(what, sizeof what, "%s bias", op);
            PyArrayObject *bias = hold(h, as_array(b, NPY_FLOAT32, 1, what));
            if (bias == NULL) return -1;
            if (PyArray_DIM(bias, 0) != a->w[i]->rows) {
                PyErr_Format(PyExc_ValueError, "%s: bias %d has %zd values, its weight %lld rows", op, i,
                             (Py_ssize_t)PyArray_DIM(bias, 0), (long long)a->w[i]->rows);
                return -1;
            }
            a->bias[i] = arr_in(bias);
            j->arrays[(*n_arrays)++] = &a->bias[i];
        }
        if ((out[i] = hold(h, new_array(NPY_FLOAT32, 2, shape))) == NULL) return -1;
        a->out[i] = arr_out(out[i]);
        j->arrays[(*n_arrays)++] = &a->out[i];
    }
    PyArrayObject *norm;
    snprintf(what, sizeof what, "%s norm", op);
    if (norm_arg(h, nobj, a->w[0]->cols, what, &norm) < 0) return -1;
    if (norm) {
        a->norm = arr_in(norm);
        j->arrays[(*n_arrays)++] = &a->norm;
    }
    return 0;
}

static int op_matmul_multi(qc_backend *be, void *p) {
    matmul_multi_args *a = p;
    qc_matmul_part parts[QC_MATMUL_MULTI_MAX];
    for (int i = 0; i < a->n_parts; i++) parts[i] = (qc_matmul_part){a->w[i], a->bias[i].dev, a->out[i].dev};
    return be->ops->matmul_multi(be, parts, a->n_parts, a->x.dev, a->n, a->norm.dev, a->eps);
}

static PyObject *kernel_matmul_multi(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wseq, *xobj, *bseq, *nobj = NULL, *res = NULL;
    held h = {0};
    matmul_multi_args a = {0};
    kernel_job j = {.op = op_matmul_multi, .args = &a, .arrays = {&a.x}};
    int n_arrays = 1;
    cached_backend *c;
    PyArrayObject *x, *out[QC_MATMUL_MULTI_MAX];
    if (!PyArg_ParseTuple(args, "sO!OO!|Of", &device, &PyTuple_Type, &wseq, &xobj, &PyTuple_Type, &bseq,
                          &nobj, &a.eps))
        return NULL;
    a.n_parts = (int)PyTuple_GET_SIZE(wseq);
    if (a.n_parts < 1 || a.n_parts > QC_MATMUL_MULTI_MAX || PyTuple_GET_SIZE(bseq) != a.n_parts) {
        PyErr_Format(PyExc_ValueError, "matmul_multi: 1 to %d weights and as many biases (or None), got %d and %zd",
                     QC_MATMUL_MULTI_MAX, a.n_parts, PyTuple_GET_SIZE(bseq));
        return NULL;
    }
    for (int i = 0; i < a.n_parts; i++)
        if ((a.w[i] = j.w[i] = hold_weight(&h, PyTuple_GET_ITEM(wseq, i))) == NULL) goto done;
    for (int i = 1; i < a.n_parts; i++)
        if (a.w[i]->cols != a.w[0]->cols) {
            PyErr_Format(PyExc_ValueError, "matmul_multi: weight %d has %lld columns, weight 0 has %lld", i,
                         (long long)a.w[i]->cols, (long long)a.w[0]->cols);
            goto done;
        }
    if ((c = get_backend(device)) == NULL ||
        (x = hold(&h, matmul_x(xobj, a.w[0]->cols, "matmul_multi"))) == NULL)
        goto done;
    a.x = arr_in(x);
    a.n = (int)PyArray_DIM(x, 0);
    j.empty = a.n == 0;
    if (multi_outputs(&h, &j, &n_arrays, &a, bseq, nobj, out, "matmul_multi") < 0) goto done;
    if (run_job(c, &j) < 0 || (res = PyTuple_New(a.n_parts)) == NULL) goto done;
    for (int i = 0; i < a.n_parts; i++) PyTuple_SET_ITEM(res, i, new_ref(out[i]));
done:
    release_held(&h);
    return res;
}

typedef struct {
    matmul_multi_args mm;       /* q, k and v (n_parts 3) */
    job_array pos, k_cache, v_cache;   /* the caches updated in place */
    job_array att;              /* qkv_attention's output (n_kv > 0) */
    int n_head, n_head_kv, head_dim, n_kv;
    float theta;
    int kv_type;
} matmul_qkv_rope_args;

static int op_matmul_qkv_rope(qc_backend *be, void *p) {
    matmul_qkv_rope_args *a = p;
    const matmul_multi_args *m = &a->mm;
    if (m->n == 0) return 0;    /* the caches come back as they went */
    qc_matmul_part parts[3];
    for (int i = 0; i < 3; i++) parts[i] = (qc_matmul_part){m->w[i], m->bias[i].dev, m->out[i].dev};
    qc_kv_cache cache = {a->k_cache.dev, a->v_cache.dev, a->kv_type};
    if (a->n_kv > 0)
        return be->ops->qkv_attention(be, parts, m->x.dev, m->n, m->norm.dev, m->eps, a->pos.dev, a->n_kv, a->n_head,
                                      a->n_head_kv, a->head_dim, a->theta, cache, a->att.dev, NULL, NULL);
    return be->ops->matmul_qkv_rope(be, parts, m->x.dev, m->n, m->norm.dev, m->eps, a->pos.dev, a->n_head,
                                    a->n_head_kv, a->head_dim, a->theta, cache);
}

static PyObject *kernel_matmul_qkv_rope(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wseq, *xobj, *bseq, *pobj, *kcobj, *vcobj, *nobj = NULL, *res = NULL;
    held h = {0};
    matmul_qkv_rope_args a = {.mm = {.n_parts = 3}};
    matmul_multi_args *m = &a.mm;
    kernel_job j = {.op = op_matmul_qkv_rope, .args = &a, .arrays = {&m->x, &a.pos, &a.k_cache, &a.v_cache}};
    int n_arrays = 4, k_type, v_type;
    cached_backend *c;
    PyArrayObject *x, *pos, *kc, *vc, *out[5], *att = NULL;
    if (!PyArg_ParseTuple(args, "sO!OO!OOOif|Ofi", &device, &PyTuple_Type, &wseq, &xobj, &PyTuple_Type, &bseq, &pobj,
                          &kcobj, &vcobj, &a.head_dim, &a.theta, &nobj, &m->eps, &a.n_kv))
        return NULL;
    if (PyTuple_GET_SIZE(wseq) != 3 || PyTuple_GET_SIZE(bseq) != 3) {
        PyErr_SetString(PyExc_ValueError, "matmul_qkv_rope: three weights (q, k, v) and three biases (or None)");
        return NULL;
    }
    for (int i = 0; i < 3; i++)
        if ((m->w[i] = j.w[i] = hold_weight(&h, PyTuple_GET_ITEM(wseq, i))) == NULL) goto done;
    const int64_t hd = a.head_dim, kv_dim = m->w[1]->rows;
    if (hd <= 0 || hd % 2 != 0 || m->w[1]->cols != m->w[0]->cols || m->w[2]->cols != m->w[0]->cols ||
        m->w[0]->rows % hd != 0 || kv_dim % hd != 0 || m->w[2]->rows != kv_dim || m->w[0]->rows / hd > INT32_MAX ||
        kv_dim / hd < 1) {
        PyErr_Format(PyExc_ValueError, "matmul_qkv_rope: q (%lld x %lld), k (%lld x %lld) and v (%lld x %lld) must "
                     "have one column count, whole heads of head_dim %d (even), and k and v one shape",
                     (long long)m->w[0]->rows, (long long)m->w[0]->cols, (long long)m->w[1]->rows,
                     (long long)m->w[1]->cols, (long long)m->w[2]->rows, (long long)m->w[2]->cols, a.head_dim);
        goto done;
    }
    a.n_head = (int)(m->w[0]->rows / hd);
    a.n_head_kv = (int)(kv_dim / hd);
    if ((c = get_backend(device)) == NULL ||
        (x = hold(&h, matmul_x(xobj, m->w[0]->cols, "matmul_qkv_rope"))) == NULL ||
        (pos = hold(&h, as_array(pobj, NPY_INT32, 1, "matmul_qkv_rope positions"))) == NULL ||
        (kc = hold(&h, as_cache(kcobj, "matmul_qkv_rope k_cache", &k_type))) == NULL ||
        (vc = hold(&h, as_cache(vcobj, "matmul_qkv_rope v_cache", &v_type))) == NULL ||
        caches_agree(k_type, v_type, "matmul_qkv_rope") < 0)
        goto done;
    m->n = (int)PyArray_DIM(x, 0);
    if (PyArray_DIM(pos, 0) != m->n || !PyArray_SAMESHAPE(kc, vc) || PyArray_DIM(kc, 1) != kv_dim) {
        PyErr_Format(PyExc_ValueError, "matmul_qkv_rope: positions must be (%d,) and the caches (max_ctx, %lld)", m->n,
                     (long long)kv_dim);
        goto done;
    }
    if (check_positions(pos, PyArray_DIM(kc, 0), "matmul_qkv_rope") < 0) goto done;
    /* n_kv > 0: qkv_attention, its queries attending keys 0 .. pos[t] < n_kv */
    if (a.n_kv < 0 || a.n_kv > PyArray_DIM(kc, 0)) {
        PyErr_Format(PyExc_ValueError, "qkv_attention: n_kv %d is not in [1, max_ctx = %zd]", a.n_kv,
                     (Py_ssize_t)PyArray_DIM(kc, 0));
        goto done;
    }
    if (a.n_kv > 0) {
        npy_intp ashape[2] = {(npy_intp)m->n, (npy_intp)m->w[0]->rows};
        if (check_positions(pos, a.n_kv, "qkv_attention (positions must be < n_kv)") < 0 ||
            (att = hold(&h, new_array(NPY_FLOAT32, 2, ashape))) == NULL)
            goto done;
        a.att = arr_out(att);
        j.arrays[n_arrays++] = &a.att;
    }
    m->x = arr_in(x);
    a.pos = arr_in(pos);
    a.kv_type = k_type;
    j.empty = PyArray_SIZE(kc) == 0;
    if ((out[3] = hold(&h, new_array(PyArray_TYPE(kc), 2, PyArray_DIMS(kc)))) == NULL ||
        (out[4] = hold(&h, new_array(PyArray_TYPE(vc), 2, PyArray_DIMS(vc)))) == NULL)
        goto done;
    a.k_cache = arr_inout(kc, out[3]);
    a.v_cache = arr_inout(vc, out[4]);
    if (multi_outputs(&h, &j, &n_arrays, m, bseq, nobj, out, "matmul_qkv_rope") < 0) goto done;
    if (run_job(c, &j) == 0)
        res = att ? Py_BuildValue("(OOOOOO)", out[0], out[1], out[2], out[3], out[4], att)
                  : Py_BuildValue("(OOOOO)", out[0], out[1], out[2], out[3], out[4]);
done:
    release_held(&h);
    return res;
}

typedef struct {
    const qc_weight *gate, *up;
    job_array x, norm, out;     /* norm.dev NULL: no norm */
    int n;
    float eps;
} matmul_swiglu_args;

static int op_matmul_swiglu(qc_backend *be, void *p) {
    matmul_swiglu_args *a = p;
    return be->ops->matmul_swiglu(be, a->gate, a->up, a->x.dev, a->n, a->norm.dev, a->eps, a->out.dev);
}

static PyObject *kernel_matmul_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *gobj, *uobj, *xobj, *nobj = NULL, *res = NULL;
    float eps = 0.0f;
    held h = {0};
    qc_weight *wg, *wu;
    cached_backend *c;
    PyArrayObject *x, *out, *norm;
    if (!PyArg_ParseTuple(args, "sOOO|Of", &device, &gobj, &uobj, &xobj, &nobj, &eps)) return NULL;
    if ((wg = hold_weight(&h, gobj)) == NULL || (wu = hold_weight(&h, uobj)) == NULL) goto done;
    if (wg->rows != wu->rows || wg->cols != wu->cols) {
        PyErr_Format(PyExc_ValueError, "matmul_swiglu: gate (%lld, %lld) and up (%lld, %lld) differ in shape",
                     (long long)wg->rows, (long long)wg->cols, (long long)wu->rows, (long long)wu->cols);
        goto done;
    }
    if ((c = get_backend(device)) == NULL || (x = hold(&h, matmul_x(xobj, wg->cols, "matmul_swiglu"))) == NULL)
        goto done;
    npy_intp shape[2] = {PyArray_DIM(x, 0), (npy_intp)wg->rows};
    if ((out = hold(&h, new_array(NPY_FLOAT32, 2, shape))) == NULL ||
        norm_arg(&h, nobj, wg->cols, "matmul_swiglu norm", &norm) < 0)
        goto done;
    matmul_swiglu_args a = {.gate = wg, .up = wu, .x = arr_in(x), .out = arr_out(out), .n = (int)shape[0],
                            .eps = eps};
    if (norm) a.norm = arr_in(norm);
    kernel_job j = {.op = op_matmul_swiglu, .args = &a, .arrays = {&a.x, &a.out, norm ? &a.norm : NULL},
                    .w = {wg, wu}, .empty = shape[0] == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

/* The forward pass's o projection and gate/up of one layer: matmul_add told the norm of the
 * matmul_swiglu after it (norm_next), then that op on its output. */
typedef struct {
    const qc_weight *w, *gate, *up;
    job_array x, residual, norm, act;
    int n;
    float eps;
} matmul_add_swiglu_args;

static int op_matmul_add_swiglu(qc_backend *be, void *p) {
    matmul_add_swiglu_args *a = p;
    float *resid = a->residual.dev;
    if (be->ops->matmul_add(be, a->w, a->x.dev, a->n, resid, resid, 0, a->norm.dev) < 0) return -1;
    return be->ops->matmul_swiglu(be, a->gate, a->up, resid, a->n, a->norm.dev, a->eps, a->act.dev);
}

static PyObject *kernel_matmul_add_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *robj, *gobj, *uobj, *nobj, *res = NULL;
    float eps;
    held h = {0};
    qc_weight *w, *wg, *wu;
    cached_backend *c;
    PyArrayObject *x, *resid, *out, *act, *norm;
    if (!PyArg_ParseTuple(args, "sOOOOOOf", &device, &wobj, &xobj, &robj, &gobj, &uobj, &nobj, &eps)) return NULL;
    if ((w = hold_weight(&h, wobj)) == NULL || (wg = hold_weight(&h, gobj)) == NULL ||
        (wu = hold_weight(&h, uobj)) == NULL || (c = get_backend(device)) == NULL ||
        (x = hold(&h, matmul_x(xobj, w->cols, "matmul_add_swiglu"))) == NULL ||
        (resid = hold(&h, as_array(robj, NPY_FLOAT32, 2, "matmul_add_swiglu residual"))) == NULL)
        goto done;
    if (PyArray_DIM(resid, 0) != PyArray_DIM(x, 0) || PyArray_DIM(resid, 1) != w->rows || wg->cols != w->rows ||
        wg->rows != wu->rows || wg->cols != wu->cols) {
        PyErr_Format(PyExc_ValueError, "matmul_add_swiglu: residual (%zd, %zd), gate (%lld, %lld) and up (%lld, %lld) "
                     "do not fit x (%zd, %lld) and a weight of %lld rows",
                     (Py_ssize_t)PyArray_DIM(resid, 0), (Py_ssize_t)PyArray_DIM(resid, 1), (long long)wg->rows,
                     (long long)wg->cols, (long long)wu->rows, (long long)wu->cols, (Py_ssize_t)PyArray_DIM(x, 0),
                     (long long)w->cols, (long long)w->rows);
        goto done;
    }
    npy_intp act_shape[2] = {PyArray_DIM(x, 0), (npy_intp)wg->rows};
    if ((out = hold(&h, new_array(NPY_FLOAT32, 2, PyArray_DIMS(resid)))) == NULL ||
        (act = hold(&h, new_array(NPY_FLOAT32, 2, act_shape))) == NULL ||
        norm_arg(&h, nobj, w->rows, "matmul_add_swiglu norm", &norm) < 0)
        goto done;
    if (norm == NULL) {
        PyErr_SetString(PyExc_ValueError, "matmul_add_swiglu: a norm weight is required");
        goto done;
    }
    matmul_add_swiglu_args a = {.w = w, .gate = wg, .up = wu, .x = arr_in(x), .residual = arr_inout(resid, out),
                                .norm = arr_in(norm), .act = arr_out(act), .n = (int)act_shape[0], .eps = eps};
    kernel_job j = {.op = op_matmul_add_swiglu, .args = &a, .arrays = {&a.x, &a.residual, &a.norm, &a.act},
                    .w = {w, wg, wu}, .empty = act_shape[0] == 0};
    if (run_job(c, &j) == 0) res = Py_BuildValue("(OO)", (PyObject *)out, (PyObject *)act);
done:
    release_held(&h);
    return res;
}

/* swiglu_down (backend.h): the gate/up op of one token with the down projection folded in; its
 * sums come back as they are (64-bit fixed point, qwencuda/kernels.py converts them). */
typedef struct {
    const qc_weight *gate, *up, *down;
    job_array x, norm, act, sum;
    float eps;
} swiglu_down_args;

static int op_swiglu_down(qc_backend *be, void *p) {
    swiglu_down_args *a = p;
    const int takes = be->ops->swiglu_down_prepare ? be->ops->swiglu_down_prepare(be, a->gate, a->up, a->down) : 0;
    if (takes < 0) return -1;
    const int rc = takes ? be->ops->swiglu_down(be, a->gate, a->up, a->down, a->x.dev, a->norm.dev, a->eps, a->act.dev,
                                                (int64_t *)a->sum.dev, NULL)
                         : 0;
    if (rc < 0) return -1;
    if (rc == 0)
        return qc_fail(&be->err, QC_ERR_VALUE, "swiglu_down: the %s backend does not fold these weights (CUDA: gate "
                       "and up of one 32-element 8-bit type, a down weight with the 8-bit GEMV, QWENCUDA_DOWN_FOLD "
                       "not 0)", be->name);
    return 0;
}

static PyObject *kernel_swiglu_down(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *gobj, *uobj, *dobj, *xobj, *nobj, *res = NULL;
    float eps;
    held h = {0};
    qc_weight *wg, *wu, *wd;
    cached_backend *c;
    PyArrayObject *x, *act, *sum, *sum_in, *norm;
    if (!PyArg_ParseTuple(args, "sOOOOOf", &device, &gobj, &uobj, &dobj, &xobj, &nobj, &eps)) return NULL;
    if ((wg = hold_weight(&h, gobj)) == NULL || (wu = hold_weight(&h, uobj)) == NULL ||
        (wd = hold_weight(&h, dobj)) == NULL)
        goto done;
    if (wg->rows != wu->rows || wg->cols != wu->cols || wd->cols != wg->rows || wd->rows != wg->cols) {
        PyErr_Format(PyExc_ValueError, "swiglu_down: gate (%lld, %lld), up (%lld, %lld) and down (%lld, %lld) do not "
                     "make a feed-forward block", (long long)wg->rows, (long long)wg->cols, (long long)wu->rows,
                     (long long)wu->cols, (long long)wd->rows, (long long)wd->cols);
        goto done;
    }
    if ((c = get_backend(device)) == NULL || (x = hold(&h, matmul_x(xobj, wg->cols, "swiglu_down"))) == NULL)
        goto done;
    if (PyArray_DIM(x, 0) != 1) {
        PyErr_Format(PyExc_ValueError, "swiglu_down: one token, not %zd", (Py_ssize_t)PyArray_DIM(x, 0));
        goto done;
    }
    npy_intp act_shape[2] = {1, (npy_intp)wg->rows}, sum_shape[1] = {(npy_intp)wd->rows};
    if ((act = hold(&h, new_array(NPY_FLOAT32, 2, act_shape))) == NULL ||
        (sum_in = hold(&h, (PyArrayObject *)PyArray_ZEROS(1, sum_shape, NPY_INT64, 0))) == NULL ||
        (sum = hold(&h, new_array(NPY_INT64, 1, sum_shape))) == NULL ||
        norm_arg(&h, nobj, wg->cols, "swiglu_down norm", &norm) < 0)
        goto done;
    swiglu_down_args a = {.gate = wg, .up = wu, .down = wd, .x = arr_in(x), .act = arr_out(act),
                          .sum = arr_inout(sum_in, sum), .eps = eps};
    if (norm) a.norm = arr_in(norm);
    kernel_job j = {.op = op_swiglu_down, .args = &a, .arrays = {&a.x, &a.act, &a.sum, norm ? &a.norm : NULL},
                    .w = {wg, wu, wd}};
    if (run_job(c, &j) == 0) res = Py_BuildValue("(OO)", (PyObject *)act, (PyObject *)sum);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array x, w, out;
    int n, dim;
    float eps;
} rmsnorm_args;

static int op_rmsnorm(qc_backend *be, void *p) {
    rmsnorm_args *a = p;
    return be->ops->rmsnorm(be, a->x.dev, a->w.dev, a->n, a->dim, a->eps, a->out.dev);
}

static PyObject *kernel_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *wobj, *res = NULL;
    float eps;
    held h = {0};
    cached_backend *c;
    PyArrayObject *x, *w, *out;
    if (!PyArg_ParseTuple(args, "sOOf", &device, &xobj, &wobj, &eps)) return NULL;
    if ((c = get_backend(device)) == NULL ||
        (x = hold(&h, as_array(xobj, NPY_FLOAT32, 2, "rmsnorm x"))) == NULL ||
        (w = hold(&h, as_array(wobj, NPY_FLOAT32, 1, "rmsnorm weight"))) == NULL)
        goto done;
    if (PyArray_DIM(w, 0) != PyArray_DIM(x, 1)) {
        PyErr_Format(PyExc_ValueError, "rmsnorm: x rows have %zd values, the weight %zd",
                     (Py_ssize_t)PyArray_DIM(x, 1), (Py_ssize_t)PyArray_DIM(w, 0));
        goto done;
    }
    if (PyArray_DIM(x, 0) > INT32_MAX || PyArray_DIM(x, 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "rmsnorm: x is too large");
        goto done;
    }
    if ((out = hold(&h, new_array(NPY_FLOAT32, 2, PyArray_DIMS(x)))) == NULL) goto done;
    rmsnorm_args a = {.x = arr_in(x), .w = arr_in(w), .out = arr_out(out), .n = (int)PyArray_DIM(x, 0),
                      .dim = (int)PyArray_DIM(x, 1), .eps = eps};
    kernel_job j = {.op = op_rmsnorm, .args = &a, .arrays = {&a.x, &a.w, &a.out}, .empty = PyArray_SIZE(x) == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array x, pos;           /* x rotated in place */
    int n, n_heads, head_dim;
    float theta;
} rope_args;

static int op_rope(qc_backend *be, void *p) {
    rope_args *a = p;
    return be->ops->rope(be, a->x.dev, a->pos.dev, a->n, a->n_heads, a->head_dim, a->theta);
}

static PyObject *kernel_rope(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *pobj, *res = NULL;
    float theta;
    held h = {0};
    cached_backend *c;
    PyArrayObject *x, *pos, *out;
    if (!PyArg_ParseTuple(args, "sOOf", &device, &xobj, &pobj, &theta)) return NULL;
    if ((c = get_backend(device)) == NULL ||
        (x = hold(&h, as_array(xobj, NPY_FLOAT32, 3, "rope x (tokens, heads, head_dim)"))) == NULL ||
        (pos = hold(&h, as_array(pobj, NPY_INT32, 1, "rope positions"))) == NULL)
        goto done;
    if (PyArray_DIM(pos, 0) != PyArray_DIM(x, 0)) {
        PyErr_Format(PyExc_ValueError, "rope: %zd positions for %zd tokens", (Py_ssize_t)PyArray_DIM(pos, 0),
                     (Py_ssize_t)PyArray_DIM(x, 0));
        goto done;
    }
    if (PyArray_DIM(x, 2) % 2 != 0) {
        PyErr_Format(PyExc_ValueError, "rope: head_dim %zd must be even", (Py_ssize_t)PyArray_DIM(x, 2));
        goto done;
    }
    if (PyArray_DIM(x, 0) > INT32_MAX || PyArray_DIM(x, 1) > INT32_MAX || PyArray_DIM(x, 2) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "rope: x is too large");
        goto done;
    }
    if ((out = hold(&h, new_array(NPY_FLOAT32, 3, PyArray_DIMS(x)))) == NULL) goto done;
    rope_args a = {.x = arr_inout(x, out), .pos = arr_in(pos), .n = (int)PyArray_DIM(x, 0),
                   .n_heads = (int)PyArray_DIM(x, 1), .head_dim = (int)PyArray_DIM(x, 2), .theta = theta};
    kernel_job j = {.op = op_rope, .args = &a, .arrays = {&a.x, &a.pos}, .empty = PyArray_SIZE(x) == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array k, v, pos, k_cache, v_cache;   /* the caches updated in place */
    int n, kv_dim;
    int kv_type;                /* the caches' qc_kv_type */
} kv_store_args;

static int op_kv_store(qc_backend *be, void *p) {
    kv_store_args *a = p;
    if (a->n == 0 || a->kv_dim == 0) return 0;   /* the caches come back as they went */
    qc_kv_cache cache = {a->k_cache.dev, a->v_cache.dev, a->kv_type};
    return be->ops->kv_store(be, a->k.dev, a->v.dev, a->pos.dev, a->n, a->kv_dim, cache);
}

static PyObject *kernel_kv_store(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *kobj, *vobj, *pobj, *kcobj, *vcobj, *res = NULL;
    int k_type, v_type;
    held h = {0};
    cached_backend *c;
    PyArrayObject *k, *v, *pos, *kc, *vc, *kc_out, *vc_out;
    if (!PyArg_ParseTuple(args, "sOOOOO", &device, &kobj, &vobj, &pobj, &kcobj, &vcobj)) return NULL;
    if ((c = get_backend(device)) == NULL ||
        (k = hold(&h, as_array(kobj, NPY_FLOAT32, 2, "kv_store k"))) == NULL ||
        (v = hold(&h, as_array(vobj, NPY_FLOAT32, 2, "kv_store v"))) == NULL ||
        (pos = hold(&h, as_array(pobj, NPY_INT32, 1, "kv_store positions"))) == NULL ||
        (kc = hold(&h, as_cache(kcobj, "kv_store k_cache", &k_type))) == NULL ||
        (vc = hold(&h, as_cache(vcobj, "kv_store v_cache", &v_type))) == NULL ||
        caches_agree(k_type, v_type, "kv_store") < 0)
        goto done;
    if (!PyArray_SAMESHAPE(k, v) || !PyArray_SAMESHAPE(kc, vc) || PyArray_DIM(k, 1) != PyArray_DIM(kc, 1) ||
        PyArray_DIM(pos, 0) != PyArray_DIM(k, 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "kv_store: k and v must be (n, kv_dim), the caches (max_ctx, kv_dim), positions (n,)");
        goto done;
    }
    if (check_positions(pos, PyArray_DIM(kc, 0), "kv_store") < 0) goto done;
    if (PyArray_DIM(k, 0) > INT32_MAX || PyArray_DIM(k, 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "kv_store: k is too large");
        goto done;
    }
    if ((kc_out = hold(&h, new_array(PyArray_TYPE(kc), 2, PyArray_DIMS(kc)))) == NULL ||
        (vc_out = hold(&h, new_array(PyArray_TYPE(vc), 2, PyArray_DIMS(vc)))) == NULL)
        goto done;
    kv_store_args a = {.k = arr_in(k), .v = arr_in(v), .pos = arr_in(pos), .k_cache = arr_inout(kc, kc_out),
                       .v_cache = arr_inout(vc, vc_out), .n = (int)PyArray_DIM(k, 0),
                       .kv_dim = (int)PyArray_DIM(k, 1), .kv_type = k_type};
    kernel_job j = {.op = op_kv_store, .args = &a, .arrays = {&a.k, &a.v, &a.pos, &a.k_cache, &a.v_cache},
                    .empty = PyArray_SIZE(kc) == 0};
    if (run_job(c, &j) == 0) res = Py_BuildValue("(OO)", kc_out, vc_out);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array q, k, v, pos, k_cache, v_cache;   /* q, k and the caches updated in place */
    int n, n_head, n_head_kv, head_dim;
    float theta;
    int kv_type;                /* the caches' qc_kv_type */
} rope_kv_store_args;

static int op_rope_kv_store(qc_backend *be, void *p) {
    rope_kv_store_args *a = p;
    if (a->n == 0) return 0;    /* the caches come back as they went */
    qc_kv_cache cache = {a->k_cache.dev, a->v_cache.dev, a->kv_type};
    return be->ops->rope_kv_store(be, a->q.dev, a->k.dev, a->v.dev, a->pos.dev, a->n, a->n_head, a->n_head_kv,
                                  a->head_dim, a->theta, cache);
}

static PyObject *kernel_rope_kv_store(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *qobj, *kobj, *vobj, *pobj, *kcobj, *vcobj, *res = NULL;
    float theta;
    int k_type, v_type;
    held h = {0};
    cached_backend *c;
    PyArrayObject *q, *k, *v, *pos, *kc, *vc, *out[4];
    if (!PyArg_ParseTuple(args, "sOOOOOOf", &device, &qobj, &kobj, &vobj, &pobj, &kcobj, &vcobj, &theta))
        return NULL;
    if ((c = get_backend(device)) == NULL ||
        (q = hold(&h, as_array(qobj, NPY_FLOAT32, 3, "rope_kv_store q (n, n_head, head_dim)"))) == NULL ||
        (k = hold(&h, as_array(kobj, NPY_FLOAT32, 3, "rope_kv_store k (n, n_head_kv, head_dim)"))) == NULL ||
        (v = hold(&h, as_array(vobj, NPY_FLOAT32, 3, "rope_kv_store v (n, n_head_kv, head_dim)"))) == NULL ||
        (pos = hold(&h, as_array(pobj, NPY_INT32, 1, "rope_kv_store positions"))) == NULL ||
        (kc = hold(&h, as_cache(kcobj, "rope_kv_store k_cache", &k_type))) == NULL ||
        (vc = hold(&h, as_cache(vcobj, "rope_kv_store v_cache", &v_type))) == NULL ||
        caches_agree(k_type, v_type, "rope_kv_store") < 0)
        goto done;
    const npy_intp n = PyArray_DIM(q, 0), n_head = PyArray_DIM(q, 1), hd = PyArray_DIM(q, 2);
    const npy_intp n_head_kv = PyArray_DIM(k, 1);
    if (!PyArray_SAMESHAPE(k, v) || PyArray_DIM(k, 0) != n || PyArray_DIM(k, 2) != hd ||
        PyArray_DIM(pos, 0) != n || !PyArray_SAMESHAPE(kc, vc) || PyArray_DIM(kc, 1) != n_head_kv * hd) {
        PyErr_SetString(PyExc_ValueError, "rope_kv_store: q must be (n, n_head, head_dim), k and v (n, n_head_kv, "
                                          "head_dim), positions (n,), the caches (max_ctx, n_head_kv * head_dim)");
        goto done;
    }
    if (hd % 2 != 0 || n > INT32_MAX || n_head < 1 || n_head > INT32_MAX || n_head_kv < 1 ||
        n_head_kv * hd > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "rope_kv_store: bad shape (head_dim %zd must be even and positive)",
                     (Py_ssize_t)hd);
        goto done;
    }
    if (check_positions(pos, PyArray_DIM(kc, 0), "rope_kv_store") < 0) goto done;
    if ((out[0] = hold(&h, new_array(NPY_FLOAT32, 3, PyArray_DIMS(q)))) == NULL ||
        (out[1] = hold(&h, new_array(NPY_FLOAT32, 3, PyArray_DIMS(k)))) == NULL ||
        (out[2] = hold(&h, new_array(PyArray_TYPE(kc), 2, PyArray_DIMS(kc)))) == NULL ||
        (out[3] = hold(&h, new_array(PyArray_TYPE(vc), 2, PyArray_DIMS(vc)))) == NULL)
        goto done;
    rope_kv_store_args a = {.q = arr_inout(q, out[0]), .k = arr_inout(k, out[1]), .v = arr_in(v),
                            .pos = arr_in(pos), .k_cache = arr_inout(kc, out[2]), .v_cache = arr_inout(vc, out[3]),
                            .n = (int)n, .n_head = (int)n_head, .n_head_kv = (int)n_head_kv, .head_dim = (int)hd,
                            .theta = theta, .kv_type = k_type};
    kernel_job j = {.op = op_rope_kv_store, .args = &a,
                    .arrays = {&a.q, &a.k, &a.v, &a.pos, &a.k_cache, &a.v_cache}, .empty = PyArray_SIZE(kc) == 0};
    if (run_job(c, &j) == 0) res = Py_BuildValue("(OOOO)", out[0], out[1], out[2], out[3]);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array q, k_cache, v_cache, pos, out, scores, probs;   /* scores, probs: dev NULL when not asked */
    int n, n_kv, n_head, n_head_kv, head_dim;
    int kv_type;                /* the caches' qc_kv_type */
} attention_args;

static int op_attention(qc_backend *be, void *p) {
    attention_args *a = p;
    qc_kv_cache cache = {a->k_cache.dev, a->v_cache.dev, a->kv_type};
    return be->ops->attention(be, a->q.dev, cache, a->pos.dev, a->n, a->n_kv, a->n_head, a->n_head_kv,
                              a->head_dim, a->out.dev, a->scores.dev, a->probs.dev);
}

static PyObject *kernel_attention(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *qobj, *kcobj, *vcobj, *pobj, *res = NULL;
    int n_kv, n_head_kv, want_scores, k_type, v_type;
    held h = {0};
    cached_backend *c;
    PyArrayObject *q, *kc, *vc, *pos, *out, *scores = NULL, *probs = NULL;
    if (!PyArg_ParseTuple(args, "sOOOOiip", &device, &qobj, &kcobj, &vcobj, &pobj, &n_kv, &n_head_kv, &want_scores))
        return NULL;
    if ((c = get_backend(device)) == NULL ||
        (q = hold(&h, as_array(qobj, NPY_FLOAT32, 3, "attention q (tokens, n_head, head_dim)"))) == NULL ||
        (kc = hold(&h, as_cache(kcobj, "attention k_cache (max_ctx, n_head_kv * head_dim)", &k_type))) == NULL ||
        (vc = hold(&h, as_cache(vcobj, "attention v_cache", &v_type))) == NULL ||
        caches_agree(k_type, v_type, "attention") < 0 ||
        (pos = hold(&h, as_array(pobj, NPY_INT32, 1, "attention positions"))) == NULL)
        goto done;
    const npy_intp n = PyArray_DIM(q, 0), n_head = PyArray_DIM(q, 1), hd = PyArray_DIM(q, 2);
    if (n_head_kv < 1 || n_head < 1 || n_head % n_head_kv != 0) {
        PyErr_Format(PyExc_ValueError, "attention: n_head %zd is not a multiple of n_head_kv %d", (Py_ssize_t)n_head,
                     n_head_kv);
        goto done;
    }
    if (!PyArray_SAMESHAPE(kc, vc) || PyArray_DIM(kc, 1) != n_head_kv * hd) {
        PyErr_Format(PyExc_ValueError, "attention: the caches must both be (max_ctx, %zd) for %d KV heads of %zd",
                     (Py_ssize_t)(n_head_kv * hd), n_head_kv, (Py_ssize_t)hd);
        goto done;
    }
    if (PyArray_DIM(pos, 0) != n) {
        PyErr_Format(PyExc_ValueError, "attention: %zd positions for %zd queries", (Py_ssize_t)PyArray_DIM(pos, 0),
                     (Py_ssize_t)n);
        goto done;
    }
    if (n_kv < 1 || n_kv > PyArray_DIM(kc, 0)) {
        PyErr_Format(PyExc_ValueError, "attention: n_kv %d is not in [1, max_ctx = %zd]", n_kv,
                     (Py_ssize_t)PyArray_DIM(kc, 0));
        goto done;
    }
    if (check_positions(pos, n_kv, "attention (positions must be < n_kv)") < 0) goto done;
    if (n > INT32_MAX || n_head > INT32_MAX || hd < 1 || hd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "attention: bad q shape");
        goto done;
    }
    npy_intp oshape[2] = {n, n_head * hd}, sshape[3] = {n_head, n, n_kv};
    if ((out = hold(&h, new_array(NPY_FLOAT32, 2, oshape))) == NULL ||
        (want_scores && ((scores = hold(&h, new_array(NPY_FLOAT32, 3, sshape))) == NULL ||
                         (probs = hold(&h, new_array(NPY_FLOAT32, 3, sshape))) == NULL)))
        goto done;
    attention_args a = {.q = arr_in(q), .k_cache = arr_in(kc), .v_cache = arr_in(vc), .pos = arr_in(pos),
                        .out = arr_out(out), .n = (int)n, .n_kv = n_kv, .n_head = (int)n_head,
                        .n_head_kv = n_head_kv, .head_dim = (int)hd, .kv_type = k_type};
    if (scores) {
        a.scores = arr_out(scores);
        a.probs = arr_out(probs);
    }
    kernel_job j = {.op = op_attention, .args = &a, .empty = n == 0,
                    .arrays = {&a.q, &a.k_cache, &a.v_cache, &a.pos, &a.out, scores ? &a.scores : NULL,
                               scores ? &a.probs : NULL}};
    if (run_job(c, &j) == 0)
        res = Py_BuildValue("(OOO)", out, scores ? (PyObject *)scores : Py_None,
                            probs ? (PyObject *)probs : Py_None);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array a, b, out;
    int64_t count;
} binary_args;

static int op_swiglu(qc_backend *be, void *p) {
    binary_args *a = p;
    return be->ops->swiglu(be, a->a.dev, a->b.dev, a->count, a->out.dev);
}

static int op_add(qc_backend *be, void *p) {
    binary_args *a = p;
    return be->ops->add(be, a->a.dev, a->b.dev, a->count, a->out.dev);
}

/* swiglu and add: elementwise over two float32 arrays of one shape */
static PyObject *binary_op(PyObject *args, int (*op)(qc_backend *, void *), const char *name) {
    const char *device;
    PyObject *aobj, *bobj, *res = NULL;
    held h = {0};
    cached_backend *c;
    PyArrayObject *x, *y, *out;
    if (!PyArg_ParseTuple(args, "sOO", &device, &aobj, &bobj)) return NULL;
    if ((c = get_backend(device)) == NULL || (x = hold(&h, as_array(aobj, NPY_FLOAT32, -1, name))) == NULL ||
        (y = hold(&h, as_array(bobj, NPY_FLOAT32, -1, name))) == NULL)
        goto done;
    if (!PyArray_SAMESHAPE(x, y)) {
        PyErr_Format(PyExc_ValueError, "%s: the two inputs must have the same shape", name);
        goto done;
    }
    if ((out = hold(&h, new_array(NPY_FLOAT32, PyArray_NDIM(x), PyArray_DIMS(x)))) == NULL) goto done;
    binary_args a = {.a = arr_in(x), .b = arr_in(y), .out = arr_out(out), .count = (int64_t)PyArray_SIZE(x)};
    kernel_job j = {.op = op, .args = &a, .arrays = {&a.a, &a.b, &a.out}, .empty = a.count == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

static PyObject *kernel_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    return binary_op(args, op_swiglu, "swiglu");
}

static PyObject *kernel_add(PyObject *self, PyObject *args) {
    (void)self;
    return binary_op(args, op_add, "add");
}

typedef struct {
    job_array x, out;
    int n;
    int64_t cols;
} argmax_args;

static int op_argmax(qc_backend *be, void *p) {
    argmax_args *a = p;
    return be->ops->argmax(be, a->x.dev, a->n, a->cols, a->out.dev);
}

static PyObject *kernel_argmax(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *res = NULL;
    held h = {0};
    cached_backend *c;
    PyArrayObject *x, *out;
    if (!PyArg_ParseTuple(args, "sO", &device, &xobj)) return NULL;
    if ((c = get_backend(device)) == NULL ||
        (x = hold(&h, as_array(xobj, NPY_FLOAT32, 2, "argmax x (rows, cols)"))) == NULL)
        goto done;
    if (PyArray_DIM(x, 0) > INT32_MAX || PyArray_DIM(x, 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "argmax: x is too large");
        goto done;
    }
    if (PyArray_DIM(x, 1) < 1 && PyArray_DIM(x, 0) > 0) {
        PyErr_SetString(PyExc_ValueError, "argmax: rows are empty");
        goto done;
    }
    npy_intp n = PyArray_DIM(x, 0);
    if ((out = hold(&h, new_array(NPY_INT32, 1, &n))) == NULL) goto done;
    argmax_args a = {.x = arr_in(x), .out = arr_out(out), .n = (int)n, .cols = (int64_t)PyArray_DIM(x, 1)};
    kernel_job j = {.op = op_argmax, .args = &a, .arrays = {&a.x, &a.out}, .empty = n == 0};
    if (run_job(c, &j) == 0) res = new_ref(out);
done:
    release_held(&h);
    return res;
}

typedef struct {
    job_array logits, state, work, result;
    int64_t n_vocab;
} sample_args;

static int op_sample(qc_backend *be, void *p) {
    sample_args *a = p;
    return be->ops->sample(be, a->logits.dev, a->n_vocab, a->state.dev, a->work.dev, a->result.dev);
}

/* One draw by the backend's sample op from logits (n_vocab,) and a state of state_bytes (a
 * qc_sample_state and its history) into *drawn; raises on failure. */
static int run_sample(cached_backend *c, PyArrayObject *logits, const qc_sample_state *state, size_t state_bytes,
                      qc_sample_result *drawn) {
    sample_args a = {.logits = arr_in(logits), .n_vocab = (int64_t)PyArray_DIM(logits, 0)};
    a.state = (job_array){state, NULL, state_bytes, NULL};
    a.work = (job_array){NULL, NULL, qc_sample_work_bytes(a.n_vocab), NULL};
    a.result = (job_array){NULL, drawn, sizeof *drawn, NULL};
    kernel_job j = {.op = op_sample, .args = &a, .arrays = {&a.logits, &a.state, &a.work, &a.result}};
    return run_job(c, &j);
}

/* kernel_sample(device, logits float32 (n_vocab,), sampler) -> token: the sampler's next draw,
 * made by the backend's sample op from the state the sampler exports; the sampler's RNG then
 * advances exactly as Sampler.sample(logits) would have advanced it. */
static PyObject *kernel_sample(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *sobj, *res = NULL;
    held h = {0};
    qc_sample_state *state = NULL;
    qc_sample_result drawn = {0, -1, 0};
    cached_backend *c;
    qc_sampler *sp;
    PyArrayObject *x;
    if (!PyArg_ParseTuple(args, "sOO", &device, &xobj, &sobj)) return NULL;
    if ((sp = qc_py_sampler_of(sobj)) == NULL || (c = get_backend(device)) == NULL) return NULL;
    if ((x = hold(&h, as_array(xobj, NPY_FLOAT32, 1, "sample logits (n_vocab,)"))) == NULL) goto done;
    if (PyArray_DIM(x, 0) != qc_sampler_n_vocab(sp)) {
        PyErr_Format(PyExc_ValueError, "sample: %zd logits for a sampler of %lld", (Py_ssize_t)PyArray_DIM(x, 0),
                     (long long)qc_sampler_n_vocab(sp));
        goto done;
    }
    if ((state = malloc(qc_sampler_state_bytes(sp))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (run_sample(c, x, state, qc_sampler_export(sp, state), &drawn) < 0) goto done;
    if (drawn.token < 0) {
        PyErr_SetString(PyExc_ValueError, "no token can be sampled: every logit is NaN or -inf");
        goto done;
    }
    qc_sampler_set_rng(sp, drawn.rng);
    res = PyLong_FromLong(drawn.token);
done:
    free(state);
    release_held(&h);
    return res;
}

/* _kernel_sample_state(device, logits float32 (n_vocab,), rng, temperature, top_k, top_p, min_p,
 * repeat_penalty, history int32 (m,)) -> (token, rng after): the sample op on a state given
 * as is, for tests: unlike a Sampler's export, the history may repeat a token or name ids out
 * of range, which the op must ignore (sampler.h). Parameters are not checked: tests only. */
static PyObject *kernel_sample_state(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *xobj, *hobj, *res = NULL;
    unsigned long long rng;
    float temperature, top_p, min_p, penalty;
    int top_k;
    held h = {0};
    qc_sample_state *state = NULL;
    qc_sample_result drawn = {0, -1, 0};
    cached_backend *c;
    PyArrayObject *x, *hist;
    if (!PyArg_ParseTuple(args, "sOKfifffO", &device, &xobj, &rng, &temperature, &top_k, &top_p,
                          &min_p, &penalty, &hobj))
        return NULL;
    if ((c = get_backend(device)) == NULL) return NULL;
    if ((x = hold(&h, as_array(xobj, NPY_FLOAT32, 1, "sample logits (n_vocab,)"))) == NULL ||
        (hist = hold(&h, as_array(hobj, NPY_INT32, 1, "sample history (m,)"))) == NULL)
        goto done;
    const size_t hist_bytes = (size_t)PyArray_DIM(hist, 0) * sizeof(int32_t);
    if (rng == 0 || PyArray_DIM(hist, 0) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "_kernel_sample_state: rng must be nonzero, history < 2^31");
        goto done;
    }
    if ((state = malloc(sizeof *state + hist_bytes)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    *state = (qc_sample_state){.rng = rng, .temperature = temperature, .top_p = top_p,
                               .min_p = min_p, .repeat_penalty = penalty, .top_k = top_k,
                               .n_history = (int32_t)PyArray_DIM(hist, 0)};
    if (hist_bytes) memcpy(state + 1, PyArray_DATA(hist), hist_bytes);
    if (run_sample(c, x, state, sizeof *state + hist_bytes, &drawn) == 0)
        res = Py_BuildValue("iK", (int)drawn.token, (unsigned long long)drawn.rng);
done:
    free(state);
    release_held(&h);
    return res;
}

typedef struct {
    const qc_weight *w;
    job_array x, norm, logits, state, result, ids, pos;   /* norm.dev NULL: no norm */
    float eps;
    int feed;                   /* pass ids and pos (the next step's feed) */
    int taken;                  /* set by the op: the backend's matmul_draw ran */
} matmul_draw_args;

static int op_matmul_draw(qc_backend *be, void *p) {
    matmul_draw_args *a = p;
    if (be->ops->matmul_draw == NULL) return 0;
    const int rc = be->ops->matmul_draw(be, a->w, a->x.dev, NULL, a->norm.dev, a->eps, a->logits.dev, a->state.dev,
                                        a->result.dev, a->feed ? a->ids.dev : NULL, a->feed ? a->pos.dev : NULL);
    a->taken = rc > 0;
    return rc < 0 ? -1 : 0;
}

/* _kernel_matmul_draw(device, weight, x float32 (cols,), rng, feed (id, pos) or None, norm=None,
 * eps=1e-6) -> None where the backend has no matmul_draw for the weight, else (logits float32
 * (rows,), token, rng after, (id, pos) after the feed or None): the lm_head with its greedy draw
 * (backend.h), x first normalised with norm when given, for tests; the state is greedy without
 * a penalty. */
static PyObject *kernel_matmul_draw(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *fobj, *nobj = Py_None, *res = NULL;
    unsigned long long rng;
    float eps = 1e-6f;
    held h = {0};
    qc_weight *w;
    cached_backend *c;
    PyArrayObject *x, *norm, *logits;
    int32_t feed_ids[1] = {0}, feed_pos[1] = {0}, ids_after[1] = {0}, pos_after[1] = {0};
    if (!PyArg_ParseTuple(args, "sOOKO|Of", &device, &wobj, &xobj, &rng, &fobj, &nobj, &eps)) return NULL;
    if ((w = hold_weight(&h, wobj)) == NULL || (c = get_backend(device)) == NULL ||
        (x = hold(&h, as_array(xobj, NPY_FLOAT32, 1, "matmul_draw x (cols,)"))) == NULL ||
        norm_arg(&h, nobj, w->cols, "matmul_draw norm", &norm) < 0)
        goto done;
    const int feed = fobj != Py_None;
    if (feed && !PyArg_ParseTuple(fobj, "ii;feed must be (id, pos)", &feed_ids[0], &feed_pos[0])) goto done;
    if (PyArray_DIM(x, 0) != w->cols || w->rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "matmul_draw: x has %zd values, the weight (%lld, %lld) needs %lld",
                     (Py_ssize_t)PyArray_DIM(x, 0), (long long)w->rows, (long long)w->cols, (long long)w->cols);
        goto done;
    }
    npy_intp rows = (npy_intp)w->rows;
    if ((logits = hold(&h, new_array(NPY_FLOAT32, 1, &rows))) == NULL) goto done;
    const qc_sample_state state = {.rng = rng, .temperature = 0.0f, .top_p = 1.0f, .repeat_penalty = 1.0f};
    qc_sample_result drawn = {0, -2, 0};
    matmul_draw_args a = {.w = w, .x = arr_in(x), .logits = arr_out(logits), .eps = eps, .feed = feed};
    if (norm) a.norm = arr_in(norm);
    a.state = (job_array){&state, NULL, sizeof state, NULL};
    a.result = (job_array){&drawn, &drawn, sizeof drawn, NULL};
    a.ids = (job_array){feed_ids, ids_after, sizeof feed_ids, NULL};
    a.pos = (job_array){feed_pos, pos_after, sizeof feed_pos, NULL};
    kernel_job j = {.op = op_matmul_draw, .args = &a,
                    .arrays = {&a.x, &a.logits, &a.state, &a.result, &a.ids, &a.pos, norm ? &a.norm : NULL},
                    .w = {w}};
    if (run_job(c, &j) < 0) goto done;
    if (!a.taken) {
        res = Py_None;
        Py_INCREF(res);
    } else if (feed) {
        res = Py_BuildValue("OiK(ii)", (PyObject *)logits, (int)drawn.token, (unsigned long long)drawn.rng,
                            (int)ids_after[0], (int)pos_after[0]);
    } else {
        res = Py_BuildValue("OiKO", (PyObject *)logits, (int)drawn.token, (unsigned long long)drawn.rng, Py_None);
    }
done:
    release_held(&h);
    return res;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    matmul_args mm;
    int iters;
    double seconds;             /* per call, set by the op */
} time_matmul_args;

/* iters timed calls after 3 untimed ones, between two synchronizations */
static int op_time_matmul(qc_backend *be, void *p) {
    time_matmul_args *a = p;
    for (int i = 0; i < 3; i++)
        if (op_matmul(be, &a->mm) < 0) return -1;
    if (be->ops->synchronize(be) < 0) return -1;
    const double t0 = now_seconds();
    for (int i = 0; i < a->iters; i++)
        if (op_matmul(be, &a->mm) < 0) return -1;
    if (be->ops->synchronize(be) < 0) return -1;
    a->seconds = (now_seconds() - t0) / a->iters;
    return 0;
}

/* kernel_time_matmul(device, weight, x, iters) -> seconds per matmul call: the shipped op timed
 * on the backend with no Python in between (weights and x already on the device). */
static PyObject *kernel_time_matmul(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *wobj, *xobj, *res = NULL;
    int iters;
    held h = {0};
    qc_weight *w;
    cached_backend *c;
    PyArrayObject *x;
    if (!PyArg_ParseTuple(args, "sOOi", &device, &wobj, &xobj, &iters)) return NULL;
    if ((w = hold_weight(&h, wobj)) == NULL || (c = get_backend(device)) == NULL ||
        (x = hold(&h, as_array(xobj, NPY_FLOAT32, 2, "time_matmul x"))) == NULL)
        goto done;
    if (PyArray_DIM(x, 1) != w->cols || PyArray_DIM(x, 0) < 1 || PyArray_DIM(x, 0) > INT32_MAX || iters < 1) {
        PyErr_SetString(PyExc_ValueError, "time_matmul: x must be (n >= 1, cols) and iters >= 1");
        goto done;
    }
    time_matmul_args a = {.mm = {.w = w, .x = arr_in(x), .n = (int)PyArray_DIM(x, 0)}, .iters = iters};
    a.mm.out = (job_array){NULL, NULL, (size_t)a.mm.n * (size_t)w->rows * sizeof(float), NULL};   /* not fetched */
    kernel_job j = {.op = op_time_matmul, .args = &a, .arrays = {&a.mm.x, &a.mm.out}, .w = {w}};
    if (run_job(c, &j) == 0) res = PyFloat_FromDouble(a.seconds);
done:
    release_held(&h);
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

/* cuda_device_info(device=0) -> dict: the peak memory clock (kHz), bus width (bits), and from
 * them the peak bandwidth (bytes/s), the multiprocessors and the compute capability. */
static PyObject *cuda_device_info(PyObject *self, PyObject *args) {
    (void)self;
    int device = 0;
    if (!PyArg_ParseTuple(args, "|i", &device)) return NULL;
#ifdef QC_HAVE_CUDA
    qc_cuda_props p = {0};
    qc_error err = {0};
    if (qc_cuda_device_props(device, &p, &err) < 0) return qc_py_raise(&err);
    /* double data rate: two transfers a clock over the whole bus */
    const double peak = 2.0 * (double)p.mem_clock_khz * 1e3 * (double)p.bus_width_bits / 8.0;
    return Py_BuildValue("{s:i,s:i,s:d,s:i,s:(ii)}", "mem_clock_khz", p.mem_clock_khz, "bus_width_bits",
                         p.bus_width_bits, "peak_bandwidth", peak, "sm_count", p.sm_count,
                         "compute_capability", p.major, p.minor);
#else
    qc_error err;
    qc_fail(&err, QC_ERR_CUDA, "cuda_device_info: this qwencuda was built without CUDA");
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
    {"kernel_swiglu_down", kernel_swiglu_down, METH_VARARGS,
     "kernel_swiglu_down(device, gate weight, up weight, down weight, x (1, cols), norm (cols,) or None, eps) -> "
     "(act (1, rows), sums (cols,) int64): the gate/up op with the down projection folded in (backend.h)"},
    {"kernel_matmul_add_swiglu", kernel_matmul_add_swiglu, METH_VARARGS,
     "kernel_matmul_add_swiglu(device, weight, x (n, cols), residual (n, rows), gate weight, up weight, norm (rows,), "
     "eps) -> (residual + x @ W^T, matmul_swiglu of that with norm): matmul_add told the norm next"},
    {"kernel_matmul_qkv_rope", kernel_matmul_qkv_rope, METH_VARARGS,
     "kernel_matmul_qkv_rope(device, (wq, wk, wv), x (n, cols), (bq, bk, bv), pos (n,), k_cache, v_cache, head_dim, "
     "theta[, norm, eps, n_kv]) -> (q, k, v, k_cache, v_cache), and with n_kv > 0 the attention after it "
     "(qkv_attention): (q, k, v, k_cache, v_cache, att)"},
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
    {"_kernel_matmul_draw", kernel_matmul_draw, METH_VARARGS,
     "_kernel_matmul_draw(device, weight, x float32 (cols,), rng, feed (id, pos) or None, norm=None, eps=1e-6) "
     "-> None, or (logits, token, rng, (id, pos) or None): the lm_head with its greedy draw (tests)"},
    {"kernel_sample", kernel_sample, METH_VARARGS,
     "kernel_sample(device, logits float32 (n_vocab,), sampler) -> int: the sampler's next draw, on the backend"},
    {"kernel_time_matmul", kernel_time_matmul, METH_VARARGS,
     "kernel_time_matmul(device, (raw, type, rows, cols), x (n, cols), iters) -> seconds per matmul call"},
    {"kernel_release", kernel_release, METH_VARARGS,
     "kernel_release(device=None): destroy the cached kernel backend(s)"},
    {"cuda_mem_info", cuda_mem_info, METH_VARARGS,
     "cuda_mem_info(device=0) -> (free_bytes, total_bytes) of a CUDA device"},
    {"cuda_device_info", cuda_device_info, METH_VARARGS,
     "cuda_device_info(device=0) -> dict: peak memory clock, bus width and bandwidth, SMs, capability"},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_kernels(PyObject *m) {
    if (PyModule_AddIntConstant(m, "GEMV_MAX_TOKENS", QC_GEMV_MAX_TOKENS) < 0 ||
        PyModule_AddIntConstant(m, "MATMUL_MULTI_MAX", QC_MATMUL_MULTI_MAX) < 0)
        return -1;
    return PyModule_AddFunctions(m, kernel_methods);
}
