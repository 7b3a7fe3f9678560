/* py_gguf.c: the GGUF reader from Python.
 *
 *   _core._GGUFMap(path)        an open, validated, memory-mapped file (qwencuda/gguf.py wraps
 *                               it as GGUFFile). It owns the gguf_file; every array returned
 *                               by raw() holds a reference to it, so the mapping lives until
 *                               the GGUFFile is closed AND the last view is gone.
 *   _core._gguf_parse_bytes(b)  parse a bytes-like buffer and return a summary dict, or raise
 *                               GGUFError (the fuzz tests drive the parser through it).
 *
 * Strings from the file (keys, values, tensor names) are decoded as UTF-8 with
 * errors="replace": a malformed byte shows as U+FFFD instead of making the whole file
 * unreadable, and the result can always be printed.
 */
#include "py_common.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "quants.h"

/* Parses of bigger buffers and dequantizations of more elements release the GIL. */
#define QC_GGUF_NOGIL_BYTES (1 << 20)
#define QC_GGUF_NOGIL_ELEMENTS (1 << 16)

typedef struct {
    PyObject_HEAD
    gguf_file *f;
} MapObject;

static PyTypeObject *map_type = NULL;

/* ------------------------------------------------------------------------------------------ */
/* values                                                                                       */

static PyObject *decode_str(const char *p, uint64_t len) {
    if (len > (uint64_t)PY_SSIZE_T_MAX) return PyErr_NoMemory();
    return PyUnicode_DecodeUTF8(p, (Py_ssize_t)len, "replace");
}

static uint64_t load_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* One scalar of fixed-size type t stored at p. */
static PyObject *scalar_to_py(uint32_t t, const uint8_t *p) {
    union { uint32_t u; float f; } f32;
    union { uint64_t u; double d; } f64;
    switch (t) {
    case GGUF_TYPE_UINT8: return PyLong_FromUnsignedLong(p[0]);
    case GGUF_TYPE_INT8: return PyLong_FromLong((int8_t)p[0]);
    case GGUF_TYPE_UINT16: return PyLong_FromUnsignedLong((unsigned long)load_le(p, 2));
    case GGUF_TYPE_INT16: return PyLong_FromLong((int16_t)(uint16_t)load_le(p, 2));
    case GGUF_TYPE_UINT32: return PyLong_FromUnsignedLong((unsigned long)load_le(p, 4));
    case GGUF_TYPE_INT32: return PyLong_FromLong((int32_t)(uint32_t)load_le(p, 4));
    case GGUF_TYPE_UINT64: return PyLong_FromUnsignedLongLong(load_le(p, 8));
    case GGUF_TYPE_INT64: return PyLong_FromLongLong((int64_t)load_le(p, 8));
    case GGUF_TYPE_FLOAT32: f32.u = (uint32_t)load_le(p, 4); return PyFloat_FromDouble(f32.f);
    case GGUF_TYPE_FLOAT64: f64.u = load_le(p, 8); return PyFloat_FromDouble(f64.d);
    case GGUF_TYPE_BOOL: return PyBool_FromLong(p[0] != 0);
    default:
        PyErr_Format(PyExc_SystemError, "gguf: no scalar conversion for value type %u", (unsigned)t);
        return NULL;
    }
}

static int scalar_bytes(uint32_t t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    default: return 8;
    }
}

/* The value of a kv as plain Python: int, float, bool, str, or a list of those. */
static PyObject *kv_value(const gguf_kv *kv) {
    if (kv->type == GGUF_TYPE_STRING) return decode_str(kv->str.ptr, kv->str.len);
    if (kv->type != GGUF_TYPE_ARRAY) return scalar_to_py(kv->type, kv->data);
    if (kv->n > (uint64_t)PY_SSIZE_T_MAX) return PyErr_NoMemory();
    PyObject *list = PyList_New((Py_ssize_t)kv->n);
    if (list == NULL) return NULL;
    int size = scalar_bytes(kv->arr_type);
    for (uint64_t i = 0; i < kv->n; i++) {
        PyObject *item = kv->arr_type == GGUF_TYPE_STRING
                             ? decode_str(kv->strs[i].ptr, kv->strs[i].len)
                             : scalar_to_py(kv->arr_type, kv->data + i * (uint64_t)size);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

/* "UINT32", "STRING", "ARRAY[INT32]". */
static PyObject *kv_type(const gguf_kv *kv) {
    if (kv->type == GGUF_TYPE_ARRAY)
        return PyUnicode_FromFormat("ARRAY[%s]", gguf_type_name(kv->arr_type));
    return PyUnicode_FromString(gguf_type_name(kv->type));
}

/* [(key, type, value, offset), ...] in file order. */
static PyObject *kv_list(const gguf_file *f) {
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const gguf_kv *kv = &f->kv[i];
        PyObject *key = decode_str(kv->key.ptr, kv->key.len);
        PyObject *type = kv_type(kv);
        PyObject *value = kv_value(kv);
        PyObject *item = NULL;
        if (key && type && value)
            item = Py_BuildValue("(OOOK)", key, type, value, (unsigned long long)kv->offset);
        Py_XDECREF(key);
        Py_XDECREF(type);
        Py_XDECREF(value);
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return list;
}

/* Shape in NumPy order: GGUF ne reversed. */
static PyObject *numpy_shape(const gguf_tensor *t) {
    PyObject *shape = PyTuple_New(t->n_dims);
    if (shape == NULL) return NULL;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        PyObject *v = PyLong_FromLongLong(t->ne[t->n_dims - 1 - d]);
        if (v == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, d, v);
    }
    return shape;
}

/* [(name, shape, type_name, type_value, absolute_offset, nbytes), ...] in file order. */
static PyObject *tensor_list(const gguf_file *f) {
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        const qc_type_traits *tr = qc_type_get(t->type);   /* the reader checked it */
        PyObject *name = decode_str(t->name, strlen(t->name));
        PyObject *shape = numpy_shape(t);
        PyObject *item = NULL;
        if (name && shape)
            item = Py_BuildValue("(OOsIKK)", name, shape, tr->name, (unsigned)t->type,
                                 (unsigned long long)(f->data_offset + t->offset),
                                 (unsigned long long)t->nbytes);
        Py_XDECREF(name);
        Py_XDECREF(shape);
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return list;
}

/* ------------------------------------------------------------------------------------------ */
/* _GGUFMap                                                                                     */

static PyObject *map_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"path", NULL};
    PyObject *path_bytes = NULL;
    MapObject *self = NULL;
    gguf_file *f = NULL;
    qc_error err = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&:_GGUFMap", kwlist, PyUnicode_FSConverter,
                                     &path_bytes))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_bytes);
    if ((size_t)PyBytes_GET_SIZE(path_bytes) != strlen(path)) {
        PyErr_SetString(PyExc_ValueError, "GGUF path contains a NUL character");
        goto fail;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = gguf_open(path, &f, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    self = (MapObject *)type->tp_alloc(type, 0);
    if (self == NULL) goto fail;
    self->f = f;
    f = NULL;
fail:
    gguf_close(f);
    Py_XDECREF(path_bytes);
    return (PyObject *)self;
}

static void map_dealloc(MapObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    gguf_close(self->f);
    self->f = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int tensor_index(MapObject *self, PyObject *arg, const gguf_tensor **out) {
    Py_ssize_t i = PyNumber_AsSsize_t(arg, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || (uint64_t)i >= self->f->n_tensors) {
        PyErr_Format(PyExc_IndexError, "tensor index %zd out of range (%llu tensors)", i,
                     (unsigned long long)self->f->n_tensors);
        return -1;
    }
    *out = &self->f->tensors[i];
    return 0;
}

/* NumPy dtype of a plain (non-block) type, or -1 for block formats (viewed as uint8 rows). */
static int plain_typenum(uint32_t t) {
    switch (t) {
    case QC_TYPE_F32: return NPY_FLOAT32;
    case QC_TYPE_F16: return NPY_FLOAT16;
    case QC_TYPE_BF16: return NPY_UINT16;
    case QC_TYPE_F64: return NPY_FLOAT64;
    case QC_TYPE_I8: return NPY_INT8;
    case QC_TYPE_I16: return NPY_INT16;
    case QC_TYPE_I32: return NPY_INT32;
    case QC_TYPE_I64: return NPY_INT64;
    default: return -1;
    }
}

static PyObject *map_raw(MapObject *self, PyObject *arg) {
    const gguf_tensor *t;
    if (tensor_index(self, arg, &t) < 0) return NULL;
    npy_intp dims[GGUF_MAX_DIMS];
    int nd = (int)t->n_dims;
    for (int d = 0; d < nd; d++) dims[d] = (npy_intp)t->ne[nd - 1 - d];
    int typenum = plain_typenum(t->type);
    if (typenum < 0) {   /* block format: (rows..., bytes per row) */
        typenum = NPY_UINT8;
        dims[nd - 1] = (npy_intp)qc_row_bytes(t->type, t->ne[0]);
    }
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (descr == NULL) return NULL;
    /* flags 0: read-only; NumPy works out contiguity and alignment itself. */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, (void *)t->data, 0,
                                         NULL);
    if (arr == NULL) return NULL;
    Py_INCREF(self);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, (PyObject *)self) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

static PyObject *map_dequantize(MapObject *self, PyObject *arg) {
    const gguf_tensor *t;
    PyObject *result = NULL;
    void *copy = NULL;
    if (tensor_index(self, arg, &t) < 0) return NULL;
    const qc_type_traits *tr = qc_type_get(t->type);
    if (tr->dequantize == NULL) {
        char names[256];
        qc_supported_type_names(names, sizeof names);
        PyErr_Format(qc_GGUFError, "tensor '%s' has type %s (%u), which qwencuda cannot "
                     "dequantize (it decodes %s)", t->name, tr->name, (unsigned)t->type, names);
        return NULL;
    }
    npy_intp dims[GGUF_MAX_DIMS];
    int nd = (int)t->n_dims;
    for (int d = 0; d < nd; d++) dims[d] = (npy_intp)t->ne[nd - 1 - d];
    result = PyArray_SimpleNew(nd, dims, NPY_FLOAT32);
    if (result == NULL) goto fail;
    const void *src = t->data;
    /* The block structs hold uint16 halves: a file with general.alignment below 8 can put a
     * tensor at an odd address, which the decoders must not read; decode an aligned copy. */
    if (((uintptr_t)src & 7u) != 0 && t->nbytes > 0) {
        copy = malloc((size_t)t->nbytes);
        if (copy == NULL) {
            PyErr_NoMemory();
            Py_CLEAR(result);
            goto fail;
        }
        memcpy(copy, src, (size_t)t->nbytes);
        src = copy;
    }
    /* The reader bounded the product of the nonzero dimensions, so this fits unless ne[0] == 0,
     * and then there is nothing to decode. */
    int64_t ncols = t->ne[0];
    int64_t nrows = ncols == 0 ? 0 : (int64_t)((uint64_t)t->ne[1] * (uint64_t)t->ne[2] *
                                                (uint64_t)t->ne[3]);
    float *dst = PyArray_DATA((PyArrayObject *)result);
    qc_error err = {0};
    int rc;
    if (t->n_elements >= QC_GGUF_NOGIL_ELEMENTS) {
        Py_BEGIN_ALLOW_THREADS
        rc = qc_dequantize(t->type, src, dst, nrows, ncols, &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = qc_dequantize(t->type, src, dst, nrows, ncols, &err);
    }
    if (rc < 0) {
        Py_CLEAR(result);
        qc_py_raise(&err);
    }
fail:
    free(copy);
    return result;
}

static PyObject *map_kv_list(MapObject *self, PyObject *noargs) {
    (void)noargs;
    return kv_list(self->f);
}

static PyObject *map_tensor_list(MapObject *self, PyObject *noargs) {
    (void)noargs;
    return tensor_list(self->f);
}

static PyObject *map_get_path(MapObject *self, void *closure) {
    (void)closure;
    return PyUnicode_DecodeFSDefault(self->f->path);
}

static PyObject *map_get_u64(MapObject *self, void *closure) {
    const gguf_file *f = self->f;
    uint64_t v;
    switch ((intptr_t)closure) {
    case 0: v = f->version; break;
    case 1: v = f->alignment; break;
    case 2: v = f->data_offset; break;
    case 3: v = f->size; break;
    case 4: v = f->n_kv; break;
    default: v = f->n_tensors; break;
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyGetSetDef map_getset[] = {
    {"path", (getter)map_get_path, NULL, "file path", NULL},
    {"version", (getter)map_get_u64, NULL, "GGUF version (2 or 3)", (void *)0},
    {"alignment", (getter)map_get_u64, NULL, "data alignment in bytes", (void *)1},
    {"data_offset", (getter)map_get_u64, NULL, "file offset of the tensor data section", (void *)2},
    {"size", (getter)map_get_u64, NULL, "file size in bytes", (void *)3},
    {"n_kv", (getter)map_get_u64, NULL, "number of metadata key-value pairs", (void *)4},
    {"n_tensors", (getter)map_get_u64, NULL, "number of tensors", (void *)5},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef map_methods[] = {
    {"kv_list", (PyCFunction)map_kv_list, METH_NOARGS,
     "kv_list() -> [(key, type, value, offset), ...] in file order."},
    {"tensor_list", (PyCFunction)map_tensor_list, METH_NOARGS,
     "tensor_list() -> [(name, shape, type_name, type_value, offset, nbytes), ...]; shape in\n"
     "NumPy order, offset absolute in the file."},
    {"raw", (PyCFunction)map_raw, METH_O,
     "raw(index) -> read-only ndarray viewing the stored bytes of tensor `index`."},
    {"dequantize", (PyCFunction)map_dequantize, METH_O,
     "dequantize(index) -> float32 ndarray of tensor `index`."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot map_slots[] = {
    {Py_tp_new, map_new},
    {Py_tp_dealloc, map_dealloc},
    {Py_tp_methods, map_methods},
    {Py_tp_getset, map_getset},
    {Py_tp_doc, "_GGUFMap(path): an open, validated, memory-mapped GGUF file (see GGUFFile)."},
    {0, NULL},
};

static PyType_Spec map_spec = {
    "qwencuda._core._GGUFMap", sizeof(MapObject), 0, Py_TPFLAGS_DEFAULT, map_slots,
};

/* ------------------------------------------------------------------------------------------ */
/* _gguf_parse_bytes                                                                            */

static PyObject *summary(const gguf_file *f) {
    PyObject *d = NULL, *kvs = NULL, *tensors = NULL, *metadata = NULL, *types = NULL;
    PyObject *result = NULL;
    kvs = kv_list(f);
    tensors = tensor_list(f);
    metadata = PyDict_New();
    types = PyDict_New();
    if (kvs == NULL || tensors == NULL || metadata == NULL || types == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(kvs); i++) {
        PyObject *item = PyList_GET_ITEM(kvs, i);
        PyObject *key = PyTuple_GET_ITEM(item, 0);
        if (PyDict_SetItem(types, key, PyTuple_GET_ITEM(item, 1)) < 0 ||
            PyDict_SetItem(metadata, key, PyTuple_GET_ITEM(item, 2)) < 0)
            goto fail;
    }
    d = Py_BuildValue("{s:I,s:K,s:K,s:K,s:K,s:O,s:O,s:O}", "version", (unsigned)f->version,
                      "alignment", (unsigned long long)f->alignment, "data_offset",
                      (unsigned long long)f->data_offset, "n_kv", (unsigned long long)f->n_kv,
                      "n_tensors", (unsigned long long)f->n_tensors, "metadata", metadata,
                      "metadata_types", types, "tensors", tensors);
    if (d == NULL) goto fail;
    result = d;
fail:
    Py_XDECREF(kvs);
    Py_XDECREF(tensors);
    Py_XDECREF(metadata);
    Py_XDECREF(types);
    return result;
}

static PyObject *py_parse_bytes(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    gguf_file *f = NULL;
    qc_error err = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    int rc;
    if (view.len >= QC_GGUF_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        rc = gguf_open_buffer(view.buf, (size_t)view.len, &f, &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = gguf_open_buffer(view.buf, (size_t)view.len, &f, &err);
    }
    if (rc < 0)
        qc_py_raise(&err);
    else
        result = summary(f);
    gguf_close(f);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef gguf_methods[] = {
    {"_gguf_parse_bytes", py_parse_bytes, METH_O,
     "_gguf_parse_bytes(buffer) -> dict: parse a GGUF image held in memory (testing aid).\n"
     "Keys: version, alignment, data_offset, n_kv, n_tensors, metadata, metadata_types,\n"
     "tensors ([(name, shape, type_name, type_value, offset, nbytes)]). Raises GGUFError."},
    {NULL, NULL, 0, NULL},
};

/* For other bindings that accept "a path or a GGUFFile" (Tokenizer, Model): the gguf_file of
 * a qwencuda.GGUFFile (or a _GGUFMap), with *owner a new reference that keeps it mapped.
 * NULL with TypeError for anything else, ValueError for a closed GGUFFile. Proposed for
 * py_common.h; until it is declared there, bindings can declare it themselves. */
gguf_file *qc_py_gguf_borrow(PyObject *obj, PyObject **owner);

gguf_file *qc_py_gguf_borrow(PyObject *obj, PyObject **owner) {
    PyObject *map = NULL;
    *owner = NULL;
    if (map_type != NULL && PyObject_TypeCheck(obj, map_type)) {
        Py_INCREF(obj);
        map = obj;
    } else {
        map = PyObject_GetAttrString(obj, "_map");
        if (map == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
            PyErr_Clear();
        }
        if (map == Py_None) {
            Py_DECREF(map);
            PyErr_SetString(PyExc_ValueError, "the GGUFFile is closed");
            return NULL;
        }
        if (map == NULL || !PyObject_TypeCheck(map, map_type)) {
            Py_XDECREF(map);
            PyErr_Format(PyExc_TypeError, "expected a qwencuda.GGUFFile, not %.100s",
                         Py_TYPE(obj)->tp_name);
            return NULL;
        }
    }
    *owner = map;
    return ((MapObject *)map)->f;
}

static PyObject *py_borrow_info(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *owner;
    gguf_file *f = qc_py_gguf_borrow(arg, &owner);
    if (f == NULL) return NULL;
    PyObject *r = Py_BuildValue("(sKK)", f->path, (unsigned long long)f->n_kv,
                                (unsigned long long)f->n_tensors);
    Py_DECREF(owner);
    return r;
}

static PyMethodDef borrow_methods[] = {
    {"_gguf_borrow_info", py_borrow_info, METH_O,
     "_gguf_borrow_info(GGUFFile) -> (path, n_kv, n_tensors) through qc_py_gguf_borrow (testing aid)."},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_gguf(PyObject *m) {
    map_type = (PyTypeObject *)PyType_FromSpec(&map_spec);
    if (map_type == NULL) return -1;
    if (PyModule_AddObjectRef(m, "_GGUFMap", (PyObject *)map_type) < 0) return -1;
    if (PyModule_AddFunctions(m, borrow_methods) < 0) return -1;
    return PyModule_AddFunctions(m, gguf_methods);
}
