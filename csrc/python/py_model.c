/* py_model.c: qwencuda._core.Model and qwencuda._core.Session, the low-level objects under
 * qwencuda.model (which adds the documented API: Config, Trace, capture validation).
 *
 * Threads: forward passes run with the GIL released. A model's backend serves one caller at a
 * time, so every C call that touches it (load, session create/free, eval, close) holds the
 * model's lock. That lock is never held while waiting for the GIL, so the two cannot deadlock.
 * A model or session in use by another thread cannot be closed (RuntimeError).
 */
#include "py_common.h"

#include <pythread.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "quants.h"
#include "session.h"
#include "sampler.h"

typedef struct SessionObject SessionObject;

typedef struct {
    PyObject_HEAD
    qc_model *m;                  /* NULL once closed */
    PyThread_type_lock lock;      /* one caller of the backend at a time */
    int busy;                     /* evals in flight on any of its sessions */
    SessionObject *sessions;      /* open sessions (no references: each unlinks itself) */
    PyObject *path;               /* str */
    PyObject *device;             /* str: "cpu", "cuda", "cuda:N" */
} ModelObject;

struct SessionObject {
    PyObject_HEAD
    ModelObject *model;           /* strong reference */
    qc_session *s;                /* NULL once closed */
    int busy;                     /* evals in flight */
    SessionObject *prev, *next;   /* the model's list of open sessions */
};

static PyTypeObject *Session_type = NULL;

/* Set while a patch function (call_patch) runs on this thread, inside an eval that holds its
 * model's lock: an eval, a new session or a close from the patch function would wait for that
 * lock forever, so they are refused instead. */
static _Thread_local int in_patch;

static int refused_in_patch(void) {
    if (!in_patch) return 0;
    PyErr_SetString(PyExc_RuntimeError, "a patch function cannot run, open or close a model or session: "
                                        "the eval that called it holds the model");
    return 1;
}

/* Take the model's lock, letting other Python threads run while waiting for it. */
static void model_lock(ModelObject *mo) {
    if (!PyThread_acquire_lock(mo->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(mo->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
}

static void model_unlock(ModelObject *mo) { PyThread_release_lock(mo->lock); }

/* ---------------------------------------------------------------------------------------- */
/* Session */

static void session_unlink(SessionObject *so) {
    ModelObject *mo = so->model;
    if (so->prev) so->prev->next = so->next;
    else if (mo->sessions == so) mo->sessions = so->next;
    if (so->next) so->next->prev = so->prev;
    so->prev = so->next = NULL;
}

/* Free the C session; the caller holds the model lock. */
static void session_release(SessionObject *so) {
    if (so->s == NULL) return;
    qc_session_free(so->s);
    so->s = NULL;
    session_unlink(so);
}

static int session_usable(SessionObject *so) {
    if (so->s == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        so->model->m ? "the session is closed" : "the session's model is closed");
        return 0;
    }
    return 1;
}

static void Session_dealloc(SessionObject *so) {
    PyTypeObject *tp = Py_TYPE(so);
    if (so->model) {
        if (so->s) {
            model_lock(so->model);
            session_release(so);
            model_unlock(so->model);
        }
        Py_DECREF(so->model);
    }
    tp->tp_free((PyObject *)so);
    Py_DECREF(tp);
}

static void free_capsule(PyObject *cap) {
    free(PyCapsule_GetPointer(cap, "qwencuda.capture"));
}

/* A NumPy array that owns t->data (through a capsule base); t->data becomes NULL. */
static PyObject *capture_array(qc_tensor_out *t) {
    npy_intp dims[3] = {(npy_intp)t->shape[0], (npy_intp)t->shape[1], (npy_intp)t->shape[2]};
    int type = t->dtype == QC_DTYPE_I32 ? NPY_INT32 : NPY_FLOAT32;
    PyObject *cap = PyCapsule_New(t->data, "qwencuda.capture", free_capsule);
    if (cap == NULL) return NULL;
    t->data = NULL;   /* the capsule frees it from now on */
    PyObject *arr = PyArray_SimpleNewFromData(t->ndim, dims, type, PyCapsule_GetPointer(cap, "qwencuda.capture"));
    if (arr == NULL) {
        Py_DECREF(cap);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)arr, cap) < 0) {   /* steals cap, even on failure */
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* ids: a 1-D sequence of ints -> malloc'd int32 (the session checks their range). */
static int32_t *ids_from(PyObject *obj, int *n_out) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT64, 0, 1, NPY_ARRAY_IN_ARRAY);
    int32_t *ids = NULL;
    if (a == NULL) return NULL;
    npy_intp n = PyArray_SIZE(a);
    const int64_t *v = (const int64_t *)PyArray_DATA(a);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "ids is empty: give at least one token id");
        goto done;
    }
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many ids");
        goto done;
    }
    ids = malloc((size_t)n * sizeof *ids);
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* out-of-range ids are the session's to report (qc_session_check); saturate so that an id
     * beyond int32 stays out of range instead of wrapping into it */
    for (npy_intp i = 0; i < n; i++) ids[i] = v[i] < INT32_MIN ? INT32_MIN : v[i] > INT32_MAX ? INT32_MAX : (int32_t)v[i];
    *n_out = (int)n;
done:
    Py_DECREF(a);
    return ids;
}

/* capture: None or a sequence of str -> malloc'd array of UTF-8 pointers into `seq` (kept alive
 * by the caller). */
static int patterns_from(PyObject *capture, PyObject **seq, const char ***pats, int *n) {
    *seq = NULL;
    *pats = NULL;
    *n = 0;
    if (capture == Py_None) return 0;
    if (PyUnicode_Check(capture)) {
        *seq = PyTuple_Pack(1, capture);
    } else {
        *seq = PySequence_Fast(capture, "capture must be None, a str or a sequence of str");
    }
    if (*seq == NULL) return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(*seq);
    *pats = malloc((size_t)(k ? k : 1) * sizeof **pats);
    if (*pats == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(*seq, i);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "capture patterns must be str, got %s", Py_TYPE(item)->tp_name);
            return -1;
        }
        if (((*pats)[i] = PyUnicode_AsUTF8(item)) == NULL) return -1;
    }
    *n = (int)k;
    return 0;
}

/* attn_rows: None or a 1-D sequence of query rows -> malloc'd int32 (checked by the session). */
static int rows_from(PyObject *obj, int32_t **rows, int *n) {
    *rows = NULL;
    *n = 0;
    if (obj == Py_None) return 0;
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT64, 0, 1, NPY_ARRAY_IN_ARRAY);
    if (a == NULL) return -1;
    const npy_intp k = PyArray_SIZE(a);
    const int64_t *v = (const int64_t *)PyArray_DATA(a);
    int rc = -1;
    if (k > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "attn_rows: too many rows");
        goto done;
    }
    if ((*rows = malloc((size_t)(k ? k : 1) * sizeof **rows)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (npy_intp i = 0; i < k; i++) (*rows)[i] = v[i] < INT32_MIN ? INT32_MIN : v[i] > INT32_MAX ? INT32_MAX : (int32_t)v[i];
    *n = (int)k;
    rc = 0;
done:
    Py_DECREF(a);
    return rc;
}

/* The C side of a patch (qc_patch_fn): hook(name, copy of the tensor) -> None (keep it) or the new
 * value, which must have the tensor's shape (qwencuda.patching.as_hook makes sure it does). Runs
 * with the GIL taken back from the eval that released it; a Python exception stays set and the
 * eval fails with QC_ERR_CALLBACK. The hook must not use the model itself (see in_patch). */
static int call_patch(void *ctx, const char *name, float *data, int ndim, const int64_t shape[3]) {
    PyObject *hook = ctx, *arr = NULL, *res = NULL, *out = NULL;
    npy_intp dims[3] = {(npy_intp)shape[0], (npy_intp)shape[1], (npy_intp)shape[2]};
    size_t count = 1;
    int rc = -1;
    PyGILState_STATE gil = PyGILState_Ensure();
    for (int d = 0; d < ndim; d++) count *= (size_t)dims[d];
    if ((arr = PyArray_SimpleNew(ndim, dims, NPY_FLOAT32)) == NULL) goto done;
    memcpy(PyArray_DATA((PyArrayObject *)arr), data, count * sizeof(float));
    in_patch = 1;
    res = PyObject_CallFunction(hook, "sO", name, arr);
    in_patch = 0;
    if (res == NULL) goto done;
    if (res == Py_None) {
        rc = 0;
        goto done;
    }
    out = PyArray_FROMANY(res, NPY_FLOAT32, 0, 0, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (out == NULL) goto done;
    if (PyArray_NDIM((PyArrayObject *)out) != ndim ||
        !PyArray_CompareLists(PyArray_DIMS((PyArrayObject *)out), dims, ndim)) {
        PyErr_Format(PyExc_ValueError, "patch of %s returned an array of the wrong shape", name);
        goto done;
    }
    memcpy(data, PyArray_DATA((PyArrayObject *)out), count * sizeof(float));
    rc = 0;
done:
    Py_XDECREF(arr);
    Py_XDECREF(res);
    Py_XDECREF(out);
    PyGILState_Release(gil);
    return rc;
}

/* eval(ids, logits="last", capture=None, sampler=None, attn_rows=None, patch=None,
 *      capture_device=False) -> (start, logits | None, argmax | None, {name: array}, token | None)
 * logits: "all" (a row per token), "last" (one row) or None (none downloaded; no lm_head at all
 * unless a sampler draws). sampler: a Sampler whose draw from the last row runs on the backend.
 * attn_rows: the query rows (0 .. n-1, increasing) whose attn_scores / attn_probs are captured.
 * patch: None or (names, hook): the tensors named (capture names or globs) go through
 * hook(name, value) -> new value or None (see call_patch).
 * capture_device: True keeps the captured tensors on the CUDA device, as DeviceArray objects
 * (py_devarray.c) instead of NumPy arrays; a ValueError on another backend (the session's check). */
static PyObject *Session_eval(SessionObject *so, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "logits", "capture", "sampler", "attn_rows", "patch", "capture_device", NULL};
    PyObject *ids_obj = NULL, *logits_obj = Py_None, *capture = Py_None, *sampler_obj = Py_None;
    PyObject *rows_obj = Py_None, *patch_obj = Py_None, *patch_names = Py_None, *hook = NULL, *patch_seq = NULL;
    const char **patch_pats = NULL;
    int n_patch = 0;
    qc_sampler *sampler = NULL;
    qc_sample_state *sample = NULL;
    PyObject *seq = NULL, *logits = NULL, *argmax = NULL, *tensors = NULL, *result = NULL;
    const char **pats = NULL;
    int32_t *ids = NULL, *attn_rows = NULL;
    int n = 0, n_pats = 0, n_rows = 0, all_logits = 0, want_logits = 1, rc, start, capture_device = 0;
    qc_eval_result res = {0};
    qc_error err = {0};
    res.drawn.token = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOOOOp:eval", kwlist, &ids_obj, &logits_obj, &capture,
                                     &sampler_obj, &rows_obj, &patch_obj, &capture_device))
        return NULL;
    if (patch_obj != Py_None) {
        if (!PyArg_ParseTuple(patch_obj, "OO:patch", &patch_names, &hook)) return NULL;
        if (!PyCallable_Check(hook)) {
            PyErr_SetString(PyExc_TypeError, "patch: (names, hook) needs a callable hook");
            return NULL;
        }
    }
    if (!session_usable(so)) return NULL;
    if (refused_in_patch()) return NULL;
    const qc_config *cfg = &so->model->m->cfg;
    if (sampler_obj != Py_None) {
        if ((sampler = qc_py_sampler_of(sampler_obj)) == NULL) return NULL;
        if (qc_sampler_n_vocab(sampler) != cfg->n_vocab) {
            PyErr_Format(PyExc_ValueError, "the sampler is for %lld logits, the model has %lld",
                         (long long)qc_sampler_n_vocab(sampler), (long long)cfg->n_vocab);
            return NULL;
        }
    }
    if (logits_obj == Py_None) {
        want_logits = 0;
    } else if (PyUnicode_Check(logits_obj) && PyUnicode_CompareWithASCIIString(logits_obj, "all") == 0) {
        all_logits = 1;
    } else if (!(PyUnicode_Check(logits_obj) && PyUnicode_CompareWithASCIIString(logits_obj, "last") == 0)) {
        PyErr_Format(PyExc_ValueError, "logits must be 'all', 'last' or None, got %R", logits_obj);
        return NULL;
    }
    start = qc_session_position(so->s);
    if ((ids = ids_from(ids_obj, &n)) == NULL) goto fail;
    if (patterns_from(capture, &seq, &pats, &n_pats) < 0) goto fail;
    if (rows_from(rows_obj, &attn_rows, &n_rows) < 0) goto fail;
    if (patch_obj != Py_None && patterns_from(patch_names, &patch_seq, &patch_pats, &n_patch) < 0) goto fail;
    if (sampler) {
        /* exported with the GIL held: the Sampler object is not touched while it is released */
        if ((sample = malloc(qc_sampler_state_bytes(sampler))) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        qc_sampler_export(sampler, sample);
    }
    qc_capture_spec spec = {pats, n_pats};
    qc_patch_spec patch = {patch_pats, n_patch, call_patch, hook};
    qc_eval_request req = {ids, n, all_logits, want_logits, n_pats ? &spec : NULL, attn_rows, n_rows, sample,
                           n_patch ? &patch : NULL, capture_device};
    ModelObject *mo = so->model;
    qc_session *s = so->s;
    /* the budget and every argument before the logits are allocated (a refused eval allocates
     * nothing); the eval checks again under the lock */
    if (qc_session_check(s, &req, &err) < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    if (want_logits) {
        npy_intp ldims[2] = {all_logits ? n : 1, (npy_intp)cfg->n_vocab};
        logits = PyArray_SimpleNew(2, ldims, NPY_FLOAT32);
        argmax = PyArray_SimpleNew(1, ldims, NPY_INT32);
        if (logits == NULL || argmax == NULL) goto fail;
        res.logits = (float *)PyArray_DATA((PyArrayObject *)logits);
        res.argmax = (int32_t *)PyArray_DATA((PyArrayObject *)argmax);
    }
    so->busy++;
    mo->busy++;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(mo->lock, WAIT_LOCK);
    start = qc_session_position(s);   /* under the lock: another thread may have advanced it */
    rc = qc_session_eval(s, &req, &res, &err);
    PyThread_release_lock(mo->lock);
    Py_END_ALLOW_THREADS
    so->busy--;
    mo->busy--;
    if (rc < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    if (sampler) qc_sampler_set_rng(sampler, res.drawn.rng);
    if ((tensors = PyDict_New()) == NULL) goto fail;
    for (int i = 0; i < res.capture.n; i++) {
        qc_tensor_out *t = &res.capture.items[i];
        PyObject *arr = t->on_device ? qc_py_devarray_take(t) : capture_array(t);
        if (arr == NULL) goto fail;
        rc = PyDict_SetItemString(tensors, t->name, arr);
        Py_DECREF(arr);
        if (rc < 0) goto fail;
    }
    if (sampler)
        result = Py_BuildValue("(iOOOi)", start, logits ? logits : Py_None, argmax ? argmax : Py_None,
                               tensors, (int)res.drawn.token);
    else
        result = Py_BuildValue("(iOOOO)", start, logits ? logits : Py_None, argmax ? argmax : Py_None,
                               tensors, Py_None);
fail:
    free(sample);
    qc_capture_free(&res.capture);
    free(ids);
    free(attn_rows);
    free(pats);
    free(patch_pats);
    Py_XDECREF(seq);
    Py_XDECREF(patch_seq);
    Py_XDECREF(logits);
    Py_XDECREF(argmax);
    Py_XDECREF(tensors);
    return result;
}

static PyObject *Session_reset(SessionObject *so, PyObject *noargs) {
    (void)noargs;
    if (!session_usable(so)) return NULL;
    qc_session_reset(so->s);
    Py_RETURN_NONE;
}

static PyObject *Session_rewind(SessionObject *so, PyObject *arg) {
    qc_error err = {0};
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (!session_usable(so)) return NULL;
    if (n < 0 || n > qc_session_position(so->s)) {
        PyErr_Format(PyExc_ValueError, "cannot rewind %ld tokens at position %d (0 <= n <= position)",
                     n, qc_session_position(so->s));
        return NULL;
    }
    if (qc_session_rewind(so->s, (int)n, &err) < 0) return qc_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Session_close(SessionObject *so, PyObject *noargs) {
    (void)noargs;
    if (so->s == NULL) Py_RETURN_NONE;
    if (refused_in_patch()) return NULL;
    if (so->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the session is running in another thread");
        return NULL;
    }
    model_lock(so->model);
    session_release(so);
    model_unlock(so->model);
    Py_RETURN_NONE;
}

static PyObject *Session_get_position(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    return PyLong_FromLong(qc_session_position(so->s));
}

static PyObject *Session_get_max_context(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    return PyLong_FromLong(qc_session_max_context(so->s));
}

static PyObject *Session_get_kv_type(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    return PyUnicode_FromString(qc_session_kv_type(so->s) == QC_KV_F16 ? "f16" : "f32");
}

static PyObject *Session_get_last_path(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    const char *path = qc_session_last_path(so->s);
    if (path == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(path);
}

static PyObject *Session_get_ran_ahead(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    return PyBool_FromLong(qc_session_ran_ahead(so->s));
}

static PyObject *Session_get_chunk(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    return PyLong_FromLong(qc_session_chunk(so->s));
}

static int Session_set_chunk(SessionObject *so, PyObject *value, void *closure) {
    (void)closure;
    qc_error err = {0};
    if (value == NULL || !PyLong_Check(value) || PyBool_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "prefill_chunk must be an int");
        return -1;
    }
    long chunk = PyLong_AsLong(value);
    if (chunk == -1 && PyErr_Occurred()) return -1;
    if (!session_usable(so)) return -1;
    if (chunk > INT32_MAX) chunk = INT32_MAX;
    if (qc_session_set_chunk(so->s, chunk < INT32_MIN ? INT32_MIN : (int)chunk, &err) < 0) {
        qc_py_raise(&err);
        return -1;
    }
    return 0;
}

static PyObject *Session_get_budget(SessionObject *so, void *closure) {
    (void)closure;
    if (!session_usable(so)) return NULL;
    return PyLong_FromSize_t(qc_session_capture_budget(so->s));
}

static int Session_set_budget(SessionObject *so, PyObject *value, void *closure) {
    (void)closure;
    size_t bytes = 0;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "capture_budget cannot be deleted (set None for the default)");
        return -1;
    }
    if (value != Py_None) {
        if (!PyLong_Check(value) || PyBool_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "capture_budget must be a number of bytes (int) or None");
            return -1;
        }
        bytes = PyLong_AsSize_t(value);
        if (bytes == (size_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "capture_budget must be a positive number of bytes");
            return -1;
        }
        if (bytes == 0) {
            PyErr_SetString(PyExc_ValueError, "capture_budget must be positive (None: the default)");
            return -1;
        }
    }
    if (!session_usable(so)) return -1;
    qc_session_set_capture_budget(so->s, bytes);
    return 0;
}

static PyObject *Session_get_closed(SessionObject *so, void *closure) {
    (void)closure;
    return PyBool_FromLong(so->s == NULL);
}

static PyMethodDef Session_methods[] = {
    {"eval", (PyCFunction)(void (*)(void))Session_eval, METH_VARARGS | METH_KEYWORDS,
     "eval(ids, logits='last', capture=None, sampler=None, attn_rows=None, patch=None, capture_device=False) "
     "-> (start, logits, argmax, tensors, token): run ids at the current position and advance it. logits "
     "'all', 'last' or None; capture: glob patterns; sampler: a Sampler that draws the next token on the "
     "backend (token, else None); attn_rows: query rows whose attention scores/probabilities are captured "
     "(None: all); capture_device: True keeps the captures on the CUDA device (DeviceArray)."},
    {"reset", (PyCFunction)Session_reset, METH_NOARGS, "reset(): back to position 0."},
    {"rewind", (PyCFunction)Session_rewind, METH_O, "rewind(n): forget the last n tokens."},
    {"close", (PyCFunction)Session_close, METH_NOARGS, "close(): free the KV cache."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Session_getset[] = {
    {"position", (getter)Session_get_position, NULL, "tokens in the cache (the next position)", NULL},
    {"max_context", (getter)Session_get_max_context, NULL, "positions the KV cache holds", NULL},
    {"closed", (getter)Session_get_closed, NULL, "whether close() was called", NULL},
    {"kv_type", (getter)Session_get_kv_type, NULL, "the KV cache's element type: 'f16' or 'f32'", NULL},
    {"last_path", (getter)Session_get_last_path, NULL,
     "how the last eval ran: 'ops' (op by op), 'graph' (the recorded op-by-op decode step) or 'persistent' "
     "(the recorded one-launch decode step, with QWENCUDA_DECODE=persistent); None before the first", NULL},
    {"ran_ahead", (getter)Session_get_ran_ahead, NULL,
     "whether the last eval's step had been queued on the device before it was asked for (a generation "
     "loop's step, run ahead by the one before)", NULL},
    {"prefill_chunk", (getter)Session_get_chunk, (setter)Session_set_chunk,
     "most tokens per forward pass: longer evals run in chunks of this many", NULL},
    {"capture_budget", (getter)Session_get_budget, (setter)Session_set_budget,
     "bytes of host memory one eval's captures and logits may take, and of GPU memory its device captures "
     "may take (set None: half of MemAvailable, and half of the GPU's free memory)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Session_slots[] = {
    {Py_tp_dealloc, Session_dealloc},
    {Py_tp_methods, Session_methods},
    {Py_tp_getset, Session_getset},
    {Py_tp_doc, "A KV cache and a position over a Model (made by Model.session)."},
    {0, NULL},
};

static PyType_Spec Session_spec = {
    "qwencuda._core.Session", sizeof(SessionObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    Session_slots,
};

/* ---------------------------------------------------------------------------------------- */
/* Model */

static PyObject *Model_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "device", "threads", NULL};
    PyObject *path_obj = NULL, *path_bytes = NULL;
    const char *device = "cpu";
    int threads = 0, rc;
    qc_error err = {0};
    qc_model *m = NULL;
    ModelObject *self = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|si:Model", kwlist, &path_obj, &device, &threads))
        return NULL;
    if (!PyUnicode_FSConverter(path_obj, &path_bytes)) return NULL;
    const char *path = PyBytes_AS_STRING(path_bytes);
    Py_BEGIN_ALLOW_THREADS
    rc = qc_model_load(path, device, threads, &m, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(path_bytes);
        return qc_py_raise(&err);
    }
    self = (ModelObject *)type->tp_alloc(type, 0);
    if (self == NULL) goto fail;
    self->m = m;
    m = NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    self->path = PyUnicode_DecodeFSDefault(path);
    const qc_backend *be = self->m->be;
    self->device = be->device ? PyUnicode_FromFormat("%s:%d", be->name, be->device)
                              : PyUnicode_FromString(be->name);
    if (self->path == NULL || self->device == NULL) goto fail;
    /* llama.cpp also loads such a file (with RoPE base 10000): warn rather than refuse. */
    if (gguf_find_kv(self->m->file, "qwen2.rope.freq_base") == NULL &&
        PyErr_WarnFormat(PyExc_UserWarning, 1, "%U: qwen2.rope.freq_base is missing: using RoPE "
                         "base %d (llama.cpp's default; Qwen2 files carry 1000000)", self->path,
                         (int)self->m->cfg.rope_theta) < 0)
        goto fail;
    Py_DECREF(path_bytes);
    return (PyObject *)self;
fail:
    qc_model_free(m);
    Py_DECREF(path_bytes);
    Py_XDECREF(self);
    return NULL;
}

/* Free the C model and every session still open on it; the caller holds the lock. */
static void model_release(ModelObject *mo) {
    while (mo->sessions) session_release(mo->sessions);
    qc_model_free(mo->m);
    mo->m = NULL;
}

static void Model_dealloc(ModelObject *mo) {
    PyTypeObject *tp = Py_TYPE(mo);
    model_release(mo);   /* no thread can be inside: each session holds a reference */
    if (mo->lock) PyThread_free_lock(mo->lock);
    Py_XDECREF(mo->path);
    Py_XDECREF(mo->device);
    tp->tp_free((PyObject *)mo);
    Py_DECREF(tp);
}

static int model_usable(ModelObject *mo) {
    if (mo->m == NULL) {
        PyErr_SetString(PyExc_ValueError, "the model is closed");
        return 0;
    }
    return 1;
}

static PyObject *Model_close(ModelObject *mo, PyObject *noargs) {
    (void)noargs;
    if (mo->m == NULL) Py_RETURN_NONE;
    if (mo->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the model is running in another thread");
        return NULL;
    }
    model_lock(mo);
    model_release(mo);
    model_unlock(mo);
    Py_RETURN_NONE;
}

/* session(max_context, kv_type="f16" | "f32") */
static PyObject *Model_session(ModelObject *mo, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_context", "kv_type", NULL};
    int max_ctx = 0, rc, kv_type;
    const char *kv_name = "f32";
    qc_session *s = NULL;
    qc_error err = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|s:session", kwlist, &max_ctx, &kv_name)) return NULL;
    if (!model_usable(mo)) return NULL;
    if (strcmp(kv_name, "f32") == 0) {
        kv_type = QC_KV_F32;
    } else if (strcmp(kv_name, "f16") == 0) {
        kv_type = QC_KV_F16;
    } else {
        PyErr_Format(PyExc_ValueError, "kv_type must be 'f16' or 'f32', got '%s'", kv_name);
        return NULL;
    }
    if (refused_in_patch()) return NULL;
    SessionObject *so = PyObject_New(SessionObject, Session_type);
    if (so == NULL) return NULL;
    Py_INCREF(mo);
    so->model = mo;
    so->s = NULL;
    so->busy = 0;
    so->prev = so->next = NULL;
    /* the KV cache can be gigabytes: allocated without the GIL (the model lock is held) */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(mo->lock, WAIT_LOCK);
    rc = qc_session_create(mo->m, max_ctx, kv_type, &s, &err);
    if (rc == 0) {
        so->s = s;
        so->next = mo->sessions;
        if (mo->sessions) mo->sessions->prev = so;
        mo->sessions = so;
    }
    PyThread_release_lock(mo->lock);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(so);
        return qc_py_raise(&err);
    }
    return (PyObject *)so;
}

static PyObject *Model_get_config(ModelObject *mo, void *closure) {
    (void)closure;
    if (!model_usable(mo)) return NULL;
    const qc_config *c = &mo->m->cfg;
    return Py_BuildValue("{s:s,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:d,s:d,s:O}",
                         "arch", c->arch, "n_vocab", (long long)c->n_vocab, "dim", (long long)c->dim,
                         "n_layer", (long long)c->n_layer, "n_head", (long long)c->n_head,
                         "n_head_kv", (long long)c->n_head_kv, "head_dim", (long long)c->head_dim,
                         "ffn_dim", (long long)c->ffn_dim, "n_ctx_train", (long long)c->n_ctx_train,
                         "rope_theta", (double)c->rope_theta, "norm_eps", (double)c->norm_eps,
                         "tied", c->tied ? Py_True : Py_False);
}

static int add_type(PyObject *d, const char *name, uint32_t type) {
    const qc_type_traits *tr = qc_type_get(type);
    PyObject *v = PyUnicode_FromString(tr && tr->name ? tr->name : "?");
    if (v == NULL) return -1;
    int rc = PyDict_SetItemString(d, name, v);
    Py_DECREF(v);
    return rc;
}

/* tensor_types() -> {name: type} of the matrices the engine reads (lm_head as "output"). */
static PyObject *Model_tensor_types(ModelObject *mo, PyObject *noargs) {
    (void)noargs;
    if (!model_usable(mo)) return NULL;
    const qc_model *m = mo->m;
    char name[96];
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (add_type(d, "token_embd.weight", m->tok_embd.type) < 0 ||
        add_type(d, m->cfg.tied ? "output (token_embd.weight, tied)" : "output.weight", m->output.type) < 0)
        goto fail;
    for (int64_t l = 0; l < m->cfg.n_layer; l++) {
        const char *L = (const char *)&m->layers[l];
        for (size_t i = 0; i < qc_n_layer_tensors; i++) {
            const qc_layer_tensor *lt = &qc_layer_tensors[i];
            if (lt->kind != QC_LT_MATRIX) continue;
            snprintf(name, sizeof name, "blk.%lld.%s", (long long)l, lt->suffix);
            if (add_type(d, name, ((const qc_weight *)(L + lt->offset))->type) < 0) goto fail;
        }
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *Model_get_path(ModelObject *mo, void *closure) {
    (void)closure;
    return Py_NewRef(mo->path);
}

static PyObject *Model_get_device(ModelObject *mo, void *closure) {
    (void)closure;
    return Py_NewRef(mo->device);
}

static PyObject *Model_get_threads(ModelObject *mo, void *closure) {
    (void)closure;
    if (!model_usable(mo)) return NULL;
    return PyLong_FromLong(mo->m->be->threads);
}

static PyObject *Model_get_closed(ModelObject *mo, void *closure) {
    (void)closure;
    return PyBool_FromLong(mo->m == NULL);
}

static PyMethodDef Model_methods[] = {
    {"session", (PyCFunction)(void (*)(void))Model_session, METH_VARARGS | METH_KEYWORDS,
     "session(max_context) -> Session: a KV cache of max_context positions."},
    {"tensor_types", (PyCFunction)Model_tensor_types, METH_NOARGS,
     "tensor_types() -> dict: the stored type of every matrix the engine reads."},
    {"close", (PyCFunction)Model_close, METH_NOARGS,
     "close(): free the weights and every session of this model."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Model_getset[] = {
    {"config", (getter)Model_get_config, NULL, "the hyperparameters, as a dict", NULL},
    {"path", (getter)Model_get_path, NULL, "the GGUF file", NULL},
    {"device", (getter)Model_get_device, NULL, "cpu, cuda or cuda:N", NULL},
    {"threads", (getter)Model_get_threads, NULL, "CPU worker threads of the backend", NULL},
    {"closed", (getter)Model_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Model_slots[] = {
    {Py_tp_new, Model_new},
    {Py_tp_dealloc, Model_dealloc},
    {Py_tp_methods, Model_methods},
    {Py_tp_getset, Model_getset},
    {Py_tp_doc, "Model(path, device='cpu', threads=0): a Qwen2 GGUF loaded on a backend "
                "(the low-level object under qwencuda.Model)."},
    {0, NULL},
};

static PyType_Spec Model_spec = {
    "qwencuda._core.Model", sizeof(ModelObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    Model_slots,
};

/* capture_names(n_layer) -> list of str: the C core's own names (session.c), in forward order:
 * embed, blk.0.attn_norm .. blk.<n_layer-1>.resid_out, output_norm, logits, argmax. */
static PyObject *capture_names(PyObject *self, PyObject *arg) {
    (void)self;
    long n_layer = PyLong_AsLong(arg);
    if (n_layer == -1 && PyErr_Occurred()) return NULL;
    if (n_layer < 0 || n_layer > 100000) {
        PyErr_Format(PyExc_ValueError, "n_layer must be in [0, 100000], got %ld", n_layer);
        return NULL;
    }
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    const char *first = qc_capture_global_name(0);   /* embed */
    PyObject *item = PyUnicode_FromString(first);
    if (item == NULL || PyList_Append(names, item) < 0) goto fail;
    Py_DECREF(item);
    for (long l = 0; l < n_layer; l++) {
        for (int i = 0; i < qc_capture_layer_count(); i++) {
            item = PyUnicode_FromFormat("blk.%ld.%s", l, qc_capture_layer_name(i));
            if (item == NULL || PyList_Append(names, item) < 0) goto fail;
            Py_DECREF(item);
        }
    }
    for (int g = 1; g < qc_capture_global_count(); g++) {
        item = PyUnicode_FromString(qc_capture_global_name(g));
        if (item == NULL || PyList_Append(names, item) < 0) goto fail;
        Py_DECREF(item);
    }
    return names;
fail:
    Py_XDECREF(item);
    Py_DECREF(names);
    return NULL;
}

static PyMethodDef model_functions[] = {
    {"capture_names", capture_names, METH_O,
     "capture_names(n_layer) -> list: every capture name of a model of n_layer layers, in forward order."},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_model(PyObject *m) {
    PyObject *model = NULL;
    if (PyModule_AddFunctions(m, model_functions) < 0) return -1;
    Session_type = (PyTypeObject *)PyType_FromSpec(&Session_spec);
    if (Session_type == NULL) return -1;
    /* The module keeps a reference; Session_type's own lives as long as the process. */
    if (PyModule_AddObjectRef(m, "Session", (PyObject *)Session_type) < 0) return -1;
    model = PyType_FromSpec(&Model_spec);
    if (model == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "Model", model);
    Py_DECREF(model);
    return rc;
}
