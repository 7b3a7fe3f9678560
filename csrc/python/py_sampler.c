/* py_sampler.c: qwencuda._core.Sampler and qwencuda._core.sample over sampler.c. */
#include "py_common.h"

#include <structmember.h>

#include "sampler.h"

typedef struct {
    PyObject_HEAD
    qc_sampler *s;
    qc_sampler_params p;
    long long n_vocab;
} SamplerObject;

/* Defaults of docs/api.md: greedy, every filter off, penalty off. */
static void params_default(qc_sampler_params *p) {
    p->temperature = 0.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->seed = 0;
}

/* seed: an int in [-2^63, 2^64); negative ones wrap modulo 2^64 (seed=-1 is a seed like any
 * other). Beyond that range two different seeds would give the same draws: refused. */
static int parse_seed(PyObject *obj, uint64_t *out) {
    if (obj == NULL) return 0;
    PyObject *v = PyNumber_Index(obj);   /* ints and NumPy integers; floats are a TypeError */
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "seed must be an int, not %s", Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(v, &overflow);
    int rc = 0;
    if (s == -1 && !overflow && PyErr_Occurred()) {
        rc = -1;
    } else if (overflow < 0) {
        PyErr_SetString(PyExc_ValueError, "seed must be in [-2**63, 2**64)");
        rc = -1;
    } else if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_ValueError, "seed must be in [-2**63, 2**64)");
            }
            rc = -1;
        } else {
            *out = (uint64_t)u;
        }
    } else {
        *out = (uint64_t)s;
    }
    Py_DECREF(v);
    return rc;
}

/* logits -> a float32 C-contiguous array of n_vocab values (a new reference). */
static PyArrayObject *logits_row(PyObject *obj, long long n_vocab) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_FLOAT32, 1, 2,
                                                       NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (a == NULL) return NULL;
    if ((PyArray_NDIM(a) == 2 && PyArray_DIM(a, 0) != 1) || PyArray_SIZE(a) != n_vocab) {
        PyErr_Format(PyExc_ValueError, "logits must be one row of %lld values, got %d-D with %lld values",
                     n_vocab, PyArray_NDIM(a), (long long)PyArray_SIZE(a));
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static PyObject *sample_row(qc_sampler *s, PyArrayObject *a) {
    int32_t token = qc_sampler_sample(s, (const float *)PyArray_DATA(a));
    if (token < 0) {
        PyErr_SetString(PyExc_ValueError, "no token can be sampled: every logit is NaN or -inf");
        return NULL;
    }
    return PyLong_FromLong(token);
}

/* ---------------------------------------------------------------------------------------- */
/* Sampler */

static PyObject *Sampler_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_vocab", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                             "repeat_last_n", "seed", NULL};
    qc_sampler_params p;
    long long n_vocab = 0;
    PyObject *seed = NULL;
    qc_error err = {0};
    params_default(&p);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|fifffiO:Sampler", kwlist, &n_vocab,
                                     &p.temperature, &p.top_k, &p.top_p, &p.min_p,
                                     &p.repeat_penalty, &p.repeat_last_n, &seed))
        return NULL;
    if (parse_seed(seed, &p.seed) < 0) return NULL;
    SamplerObject *self = (SamplerObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->p = p;
    self->n_vocab = n_vocab;
    if (qc_sampler_create(&p, n_vocab, &self->s, &err) < 0) {
        Py_DECREF(self);
        return qc_py_raise(&err);
    }
    return (PyObject *)self;
}

static void Sampler_dealloc(SamplerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    qc_sampler_free(self->s);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Sampler_sample(SamplerObject *self, PyObject *logits) {
    PyArrayObject *a = logits_row(logits, self->n_vocab);
    if (a == NULL) return NULL;
    PyObject *r = sample_row(self->s, a);
    Py_DECREF(a);
    return r;
}

static PyObject *Sampler_accept(SamplerObject *self, PyObject *arg) {
    long long t = PyLong_AsLongLong(arg);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (t < 0 || t >= self->n_vocab) {
        PyErr_Format(PyExc_ValueError, "token %lld is out of range [0, %lld)", t, self->n_vocab);
        return NULL;
    }
    qc_error err = {0};
    if (qc_sampler_accept(self->s, (int32_t)t, &err) < 0) return qc_py_raise(&err);
    Py_RETURN_NONE;
}

static PyMethodDef Sampler_methods[] = {
    {"sample", (PyCFunction)Sampler_sample, METH_O,
     "sample(logits) -> int: pick a token from one row of n_vocab logits (not modified)."},
    {"accept", (PyCFunction)Sampler_accept, METH_O,
     "accept(token): record a generated (or prompt) token for the repetition penalty."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Sampler_members[] = {
    {"n_vocab", T_LONGLONG, offsetof(SamplerObject, n_vocab), READONLY, NULL},
    {"temperature", T_FLOAT, offsetof(SamplerObject, p.temperature), READONLY, NULL},
    {"top_k", T_INT, offsetof(SamplerObject, p.top_k), READONLY, NULL},
    {"top_p", T_FLOAT, offsetof(SamplerObject, p.top_p), READONLY, NULL},
    {"min_p", T_FLOAT, offsetof(SamplerObject, p.min_p), READONLY, NULL},
    {"repeat_penalty", T_FLOAT, offsetof(SamplerObject, p.repeat_penalty), READONLY, NULL},
    {"repeat_last_n", T_INT, offsetof(SamplerObject, p.repeat_last_n), READONLY, NULL},
    {"seed", T_ULONGLONG, offsetof(SamplerObject, p.seed), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Sampler_slots[] = {
    {Py_tp_new, Sampler_new},
    {Py_tp_dealloc, Sampler_dealloc},
    {Py_tp_methods, Sampler_methods},
    {Py_tp_members, Sampler_members},
    {Py_tp_doc, "Sampler(n_vocab, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, "
                "repeat_penalty=1.0, repeat_last_n=64, seed=0)\n\n"
                "Token sampling with its own seeded RNG: repetition penalty, top-k, top-p, min-p, "
                "temperature (llama.cpp's order). temperature <= 0 is greedy."},
    {0, NULL},
};

static PyType_Spec Sampler_spec = {
    "qwencuda._core.Sampler", sizeof(SamplerObject), 0, Py_TPFLAGS_DEFAULT, Sampler_slots,
};

/* The type made at module init, to recognise samplers handed to Session.eval. */
static PyObject *g_sampler_type;

qc_sampler *qc_py_sampler_of(PyObject *obj) {
    if (g_sampler_type == NULL || !PyObject_TypeCheck(obj, (PyTypeObject *)g_sampler_type)) {
        PyErr_Format(PyExc_TypeError, "sampler must be a qwencuda Sampler, not %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((SamplerObject *)obj)->s;
}

/* ---------------------------------------------------------------------------------------- */
/* sample(): one draw with a fresh sampler */

static PyObject *py_sample(PyObject *mod, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"logits", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                             "repeat_last_n", "seed", NULL};
    (void)mod;
    qc_sampler_params p;
    PyObject *obj = NULL, *seed = NULL, *r = NULL;
    PyArrayObject *a = NULL;
    qc_sampler *s = NULL;
    qc_error err = {0};
    params_default(&p);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|fifffiO:sample", kwlist, &obj, &p.temperature,
                                     &p.top_k, &p.top_p, &p.min_p, &p.repeat_penalty,
                                     &p.repeat_last_n, &seed))
        return NULL;
    if (parse_seed(seed, &p.seed) < 0) return NULL;
    a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_FLOAT32, 1, 1, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (a == NULL) goto fail;
    if (qc_sampler_create(&p, (int64_t)PyArray_SIZE(a), &s, &err) < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    r = sample_row(s, a);
fail:
    qc_sampler_free(s);
    Py_XDECREF(a);
    return r;
}

static PyMethodDef sampler_functions[] = {
    {"sample", (PyCFunction)(void (*)(void))py_sample, METH_VARARGS | METH_KEYWORDS,
     "sample(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, "
     "repeat_last_n=64, seed=0) -> int: one draw from a 1-D row of logits."},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_sampler(PyObject *m) {
    PyObject *type = PyType_FromSpec(&Sampler_spec);
    if (type == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "Sampler", type);
    if (rc < 0) {
        Py_DECREF(type);
        return -1;
    }
    Py_XSETREF(g_sampler_type, type);   /* kept for the life of the process */
    return PyModule_AddFunctions(m, sampler_functions);
}
