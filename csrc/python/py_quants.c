/* py_quants.c: the block formats from Python.
 *
 *   _core.dequantize(raw, type, shape) -> float32 ndarray of `shape`
 *   _core.type_info() -> [{"value", "name", "block_size", "type_size", "supported"}, ...]
 *   _core._dot_row(raw_row, type, x) -> float   (qc_dot_row, for tests)
 *
 * `raw` is anything exposing the stored bytes through the buffer protocol (a uint8 / float16 /
 * float32 ndarray, bytes, memoryview); its byte count must equal what `shape` needs. `type` is a
 * name as gguf spells it ("Q4_K", any case) or its integer value.
 */
#include "py_common.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "quants.h"

/* Dequantizations of at least this many elements release the GIL (a few tens of µs). */
#define QC_NOGIL_ELEMENTS (1 << 16)

/* Highest type value qc_type_get might know; it returns NULL past its own table. */
#define QC_TYPE_SCAN 64

/* Resolve `type` (str or int) to a type value with traits; -1 with ValueError otherwise. */
static int parse_type(PyObject *obj, uint32_t *out) {
    if (PyUnicode_Check(obj)) {
        const char *name = PyUnicode_AsUTF8(obj);
        if (name == NULL) return -1;
        for (uint32_t t = 0; t < QC_TYPE_SCAN; t++) {
            const qc_type_traits *tr = qc_type_get(t);
            if (tr != NULL && strcasecmp(tr->name, name) == 0) {
                *out = t;
                return 0;
            }
        }
        PyErr_Format(PyExc_ValueError, "unknown tensor type %R (expected a GGML type name such "
                     "as 'Q4_K', or its integer value)", obj);
        return -1;
    }
    if (PyLong_Check(obj)) {   /* includes gguf.GGMLQuantizationType (an IntEnum) */
        long v = PyLong_AsLong(obj);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            v = -1;
        }
        if (v < 0 || v > UINT32_MAX || qc_type_get((uint32_t)v) == NULL) {
            PyErr_Format(PyExc_ValueError, "unknown tensor type value %R", obj);
            return -1;
        }
        *out = (uint32_t)v;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "type must be a str such as 'Q4_K' or an int, not %.100s",
                 Py_TYPE(obj)->tp_name);
    return -1;
}

/* The type must be one we can decode. */
static const qc_type_traits *supported_traits(uint32_t t) {
    const qc_type_traits *tr = qc_type_get(t);
    if (tr->dequantize == NULL) {
        char names[256];
        qc_supported_type_names(names, sizeof names);
        PyErr_Format(PyExc_ValueError, "tensor type %s (%u) is not supported: qwencuda decodes %s",
                     tr->name, (unsigned)t, names);
        return NULL;
    }
    return tr;
}

/* Get a C-contiguous buffer of raw bytes. An ndarray that is not contiguous is copied first
 * (a row slice of a (rows, bytes) array is a legitimate input). *holder keeps what the buffer
 * refers to alive; release with PyBuffer_Release + Py_XDECREF. */
static int get_raw_buffer(PyObject *raw, Py_buffer *view, PyObject **holder) {
    *holder = NULL;
    if (PyArray_Check(raw) && !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)raw)) {
        *holder = (PyObject *)PyArray_GETCONTIGUOUS((PyArrayObject *)raw);
        if (*holder == NULL) return -1;
        raw = *holder;
    }
    if (PyObject_GetBuffer(raw, view, PyBUF_C_CONTIGUOUS) < 0) {
        Py_CLEAR(*holder);
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "raw must be a contiguous buffer of the stored bytes "
                         "(uint8/float ndarray, bytes, memoryview), not %.100s",
                         Py_TYPE(raw)->tp_name);
        }
        return -1;
    }
    return 0;
}

/* The block structs hold uint16 halves: reading them at an odd address is undefined in C,
 * so an odd buffer (e.g. raw[1:]) is decoded from an aligned copy. Returns the pointer to use;
 * *copy is the allocation to free (NULL if none). */
static const void *aligned_bytes(const void *p, size_t n, void **copy) {
    *copy = NULL;
    if (((uintptr_t)p & 7u) == 0) return p;
    *copy = malloc(n ? n : 1);
    if (*copy == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(*copy, p, n);
    return *copy;
}

static int parse_shape(PyObject *obj, npy_intp dims[NPY_MAXDIMS], int *ndim) {
    PyObject *seq = NULL;
    int rc = -1;
    if (PyLong_Check(obj)) {
        dims[0] = PyLong_AsSsize_t(obj);
        if (dims[0] == -1 && PyErr_Occurred()) goto fail;
        *ndim = 1;
    } else {
        seq = PySequence_Fast(obj, "shape must be an int or a sequence of ints");
        if (seq == NULL) goto fail;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n < 1 || n > NPY_MAXDIMS) {
            PyErr_Format(PyExc_ValueError, "shape must have 1 to %d dimensions, got %zd",
                         NPY_MAXDIMS, n);
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            dims[i] = PyNumber_AsSsize_t(item, PyExc_OverflowError);
            if (dims[i] == -1 && PyErr_Occurred()) goto fail;
        }
        *ndim = (int)n;
    }
    for (int i = 0; i < *ndim; i++) {
        if (dims[i] < 0) {
            PyErr_Format(PyExc_ValueError, "shape has a negative dimension (%zd)", (Py_ssize_t)dims[i]);
            goto fail;
        }
    }
    rc = 0;
fail:
    Py_XDECREF(seq);
    return rc;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"raw", "type", "shape", NULL};
    PyObject *raw, *type_obj, *shape_obj;
    PyObject *holder = NULL, *result = NULL;
    Py_buffer view = {0};
    int have_view = 0;
    void *copy = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:dequantize", kwlist, &raw, &type_obj, &shape_obj))
        return NULL;

    uint32_t t;
    npy_intp dims[NPY_MAXDIMS];
    int ndim;
    if (parse_type(type_obj, &t) < 0) goto fail;
    const qc_type_traits *tr = supported_traits(t);
    if (tr == NULL || parse_shape(shape_obj, dims, &ndim) < 0) goto fail;

    int64_t ncols = dims[ndim - 1], nrows = 1;
    if (ncols % tr->block_size != 0) {
        PyErr_Format(PyExc_ValueError, "dequantize: the last dimension (%lld) of a %s tensor must "
                     "be a multiple of its block size %lld", (long long)ncols, tr->name,
                     (long long)tr->block_size);
        goto fail;
    }
    for (int i = 0; i < ndim - 1; i++) {
        uint64_t v;
        if (qc_mul_u64((uint64_t)nrows, (uint64_t)dims[i], &v) < 0 || v > (uint64_t)INT64_MAX) {
            PyErr_SetString(PyExc_ValueError, "dequantize: shape is too large");
            goto fail;
        }
        nrows = (int64_t)v;
    }
    int64_t row_bytes = qc_row_bytes(t, ncols);
    uint64_t need;
    if (row_bytes < 0 || qc_mul_u64((uint64_t)nrows, (uint64_t)row_bytes, &need) < 0 ||
        need > (uint64_t)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_ValueError, "dequantize: shape is too large");
        goto fail;
    }

    if (get_raw_buffer(raw, &view, &holder) < 0) goto fail;
    have_view = 1;
    if ((uint64_t)view.len != need) {
        PyObject *shape_repr = PyObject_Repr(shape_obj);
        PyErr_Format(PyExc_ValueError, "dequantize: raw holds %zd bytes but a %s tensor of shape "
                     "%U needs %llu (%lld bytes per row of %lld)", view.len, tr->name,
                     shape_repr ? shape_repr : Py_None, (unsigned long long)need,
                     (long long)row_bytes, (long long)ncols);
        Py_XDECREF(shape_repr);
        goto fail;
    }
    const void *src = aligned_bytes(view.buf, (size_t)view.len, &copy);
    if (src == NULL) goto fail;

    result = PyArray_SimpleNew(ndim, dims, NPY_FLOAT32);
    if (result == NULL) goto fail;
    float *dst = PyArray_DATA((PyArrayObject *)result);
    qc_error err = {0};
    int rc;
    if (nrows * ncols >= QC_NOGIL_ELEMENTS) {
        Py_BEGIN_ALLOW_THREADS
        rc = qc_dequantize(t, src, dst, nrows, ncols, &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = qc_dequantize(t, src, dst, nrows, ncols, &err);
    }
    if (rc < 0) {
        Py_CLEAR(result);
        qc_py_raise(&err);
    }
fail:
    free(copy);
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(holder);
    return result;
}

static PyObject *py_type_info(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (uint32_t t = 0; t < QC_TYPE_SCAN; t++) {
        const qc_type_traits *tr = qc_type_get(t);
        if (tr == NULL) continue;
        PyObject *d = Py_BuildValue("{s:I,s:s,s:L,s:L,s:O}", "value", (unsigned)t, "name", tr->name,
                                    "block_size", (long long)tr->block_size,
                                    "type_size", (long long)tr->type_size,
                                    "supported", tr->dequantize ? Py_True : Py_False);
        if (d == NULL || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return list;
}

static PyObject *py_dot_row(PyObject *self, PyObject *args) {
    PyObject *raw, *type_obj, *x_obj;
    PyObject *holder = NULL, *x = NULL, *result = NULL;
    Py_buffer view = {0};
    int have_view = 0;
    void *copy = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:_dot_row", &raw, &type_obj, &x_obj)) return NULL;

    uint32_t t;
    if (parse_type(type_obj, &t) < 0) goto fail;
    const qc_type_traits *tr = supported_traits(t);
    if (tr == NULL) goto fail;
    x = PyArray_FROMANY(x_obj, NPY_FLOAT32, 1, 1, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (x == NULL) goto fail;
    int64_t ncols = PyArray_DIM((PyArrayObject *)x, 0);
    int64_t row_bytes = qc_row_bytes(t, ncols);
    if (row_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "_dot_row: %lld elements is not a multiple of the %s block "
                     "size %lld", (long long)ncols, tr->name, (long long)tr->block_size);
        goto fail;
    }
    if (get_raw_buffer(raw, &view, &holder) < 0) goto fail;
    have_view = 1;
    if (view.len != row_bytes) {
        PyErr_Format(PyExc_ValueError, "_dot_row: raw row holds %zd bytes, a %s row of %lld "
                     "elements needs %lld", view.len, tr->name, (long long)ncols, (long long)row_bytes);
        goto fail;
    }
    const void *src = aligned_bytes(view.buf, (size_t)view.len, &copy);
    if (src == NULL) goto fail;
    float v = qc_dot_row(t, src, PyArray_DATA((PyArrayObject *)x), ncols);
    result = PyFloat_FromDouble((double)v);
fail:
    free(copy);
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(holder);
    Py_XDECREF(x);
    return result;
}

static PyMethodDef quants_methods[] = {
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_VARARGS | METH_KEYWORDS,
     "dequantize(raw, type, shape) -> float32 ndarray\n\n"
     "Decode the stored bytes `raw` of a tensor of GGML type `type` ('Q4_K' or its int value)\n"
     "and NumPy `shape` (last dimension = elements per row, a multiple of the block size).\n"
     "Bit-exact with gguf.quants.dequantize."},
    {"type_info", py_type_info, METH_NOARGS,
     "type_info() -> list of dicts: value, name, block_size, type_size (bytes per block; 0 for\n"
     "removed types), supported (qwencuda can decode and run it)."},
    {"_dot_row", py_dot_row, METH_VARARGS,
     "_dot_row(raw_row, type, x) -> float: the CPU matmul's dot product of one stored row with\n"
     "float32 x (testing aid)."},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_quants(PyObject *m) {
    return PyModule_AddFunctions(m, quants_methods);
}
