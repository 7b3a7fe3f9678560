/* py_devarray.c: qwencuda._core.DeviceArray, a captured tensor kept in GPU memory (Session.eval
 * with capture_device=True), which torch and CuPy read in place through DLPack or the CUDA Array
 * Interface, and .numpy() copies to the host.
 *
 * Ownership: the object owns one buffer of a CUDA device (from the backend's alloc) and frees it
 * by the device ordinal alone (qc_cuda_buffer_free), so it outlives the model and session that
 * filled it. A consumer that views it holds a reference to it: the DLManagedTensor of __dlpack__
 * holds one, which its deleter releases; consumers of __cuda_array_interface__ keep the object
 * itself (torch and CuPy do). The buffer is freed with the last reference.
 *
 * Streams: the buffer is complete when the object exists (the eval that filled it waited for its
 * work before returning), so a consumer's stream has nothing to wait for: __dlpack__ ignores the
 * stream it is given, and the interface says "stream": None.
 */
#include "py_common.h"

#include <stdlib.h>
#include <string.h>

#include "session.h"
#ifdef QC_HAVE_CUDA
#include "../../kernels/qc_cuda_api.h"
#endif

/* ---------------------------------------------------------------------------------------- */
/* DLPack v0.8 (dlpack.h), written from its public layout: only what this file fills. The
 * producer hands a DLManagedTensor in a capsule named "dltensor"; the consumer renames the
 * capsule "used_dltensor" and calls the deleter when it no longer needs the memory. */

typedef enum { kDLCUDA = 2 } DLDeviceType;            /* (kDLCPU = 1, kDLCUDAHost = 3, ...) */

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;                                  /* the CUDA ordinal */
} DLDevice;

typedef enum { kDLInt = 0, kDLFloat = 2 } DLDataTypeCode;   /* (kDLUInt = 1, kDLBfloat = 4, ...) */

typedef struct {
    uint8_t code;                                       /* DLDataTypeCode */
    uint8_t bits;                                       /* 32 */
    uint16_t lanes;                                     /* 1: not a vector type */
} DLDataType;

typedef struct {
    void *data;                                         /* device pointer */
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;                                     /* (ndim) */
    int64_t *strides;                                   /* (ndim) in elements (NULL: row-major) */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;                                  /* here: the DeviceArray (a reference) */
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

_Static_assert(sizeof(DLDevice) == 8 && sizeof(DLDataType) == 4, "DLPack layout");
_Static_assert(sizeof(void *) != 8 || sizeof(DLTensor) == 48, "DLPack layout (64-bit)");

/* ---------------------------------------------------------------------------------------- */
/* the object */

typedef struct {
    PyObject_HEAD
    void *data;               /* device buffer of nbytes, owned */
    int device;               /* CUDA ordinal */
    int ndim;                 /* 1..3 */
    int64_t shape[3];
    int dtype;                /* QC_DTYPE_F32 or QC_DTYPE_I32 */
    size_t nbytes;
} DevArrayObject;

static PyTypeObject *DevArray_type = NULL;

/* DeviceArrays alive and their bytes (the GIL guards both): device_arrays_alive() shows a leak. */
static Py_ssize_t n_alive = 0;
static size_t bytes_alive = 0;

PyObject *qc_py_devarray_take(qc_tensor_out *t) {
    DevArrayObject *a = PyObject_New(DevArrayObject, DevArray_type);
    if (a == NULL) return NULL;
    size_t count = 1;
    a->ndim = t->ndim;
    for (int i = 0; i < 3; i++) {
        a->shape[i] = i < t->ndim ? t->shape[i] : 0;
        if (i < t->ndim) count *= (size_t)t->shape[i];
    }
    a->dtype = t->dtype;
    a->nbytes = count * 4;   /* float32 and int32 */
    a->device = t->device;
    a->data = t->data;
    t->data = NULL;          /* the object frees it from now on */
    n_alive++;
    bytes_alive += a->nbytes;
    return (PyObject *)a;
}

static void DevArray_dealloc(DevArrayObject *a) {
    PyTypeObject *tp = Py_TYPE(a);
    if (a->data) {
        void *data = a->data;
        const int device = a->device;
        a->data = NULL;
        n_alive--;
        bytes_alive -= a->nbytes;
#ifdef QC_HAVE_CUDA
        /* cudaFree waits for the device's queued work: without the GIL */
        Py_BEGIN_ALLOW_THREADS
        qc_cuda_buffer_free(device, data);
        Py_END_ALLOW_THREADS
#else
        (void)data; (void)device;   /* (only CUDA builds make these objects) */
#endif
    }
    tp->tp_free((PyObject *)a);
    Py_DECREF(tp);
}

static int npy_type(const DevArrayObject *a) { return a->dtype == QC_DTYPE_I32 ? NPY_INT32 : NPY_FLOAT32; }

static PyObject *shape_tuple(const DevArrayObject *a) {
    PyObject *t = PyTuple_New(a->ndim);
    if (t == NULL) return NULL;
    for (int i = 0; i < a->ndim; i++) {
        PyObject *d = PyLong_FromLongLong((long long)a->shape[i]);
        if (d == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, d);
    }
    return t;
}

/* numpy() -> a host copy (np.ndarray of the same shape and dtype). */
static PyObject *DevArray_numpy(DevArrayObject *a, PyObject *noargs) {
    (void)noargs;
    npy_intp dims[3] = {(npy_intp)a->shape[0], (npy_intp)a->shape[1], (npy_intp)a->shape[2]};
    PyObject *out = PyArray_SimpleNew(a->ndim, dims, npy_type(a));
    if (out == NULL) return NULL;
#ifdef QC_HAVE_CUDA
    void *dst = PyArray_DATA((PyArrayObject *)out);
    qc_error err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qc_cuda_buffer_download(a->device, dst, a->data, a->nbytes, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(out);
        return qc_py_raise(&err);
    }
#endif
    return out;
}

/* __array__(dtype=None, copy=None): np.asarray(x) is x.numpy() (a copy, never a view). */
static PyObject *DevArray_array(DevArrayObject *a, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"dtype", "copy", NULL};
    PyObject *dtype = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:__array__", kwlist, &dtype, &copy)) return NULL;
    if (copy != Py_None) {
        const int yes = PyObject_IsTrue(copy);
        if (yes < 0) return NULL;
        if (!yes) {
            PyErr_SetString(PyExc_ValueError, "a DeviceArray is GPU memory: NumPy can only get a copy of it "
                                              "(copy=False cannot be honoured)");
            return NULL;
        }
    }
    PyObject *out = DevArray_numpy(a, NULL);
    if (out == NULL || dtype == Py_None) return out;
    PyObject *cast = PyObject_CallMethod(out, "astype", "O", dtype);
    Py_DECREF(out);
    return cast;
}

/* ---- DLPack ---- */

/* The consumer is done with the memory: release the DeviceArray's reference. Consumers call
 * this from any thread, with or without the GIL; once the interpreter is gone the process is
 * ending and there is nothing to release. */
static void dl_deleter(DLManagedTensor *mt) {
    if (mt == NULL) return;
    if (Py_IsInitialized()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF((PyObject *)mt->manager_ctx);
        PyGILState_Release(gil);
    }
    free(mt);
}

/* A capsule that no consumer took (still "dltensor") releases its tensor itself. */
static void dl_capsule_free(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return;   /* "used_dltensor": the consumer's deleter call */
    DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
    mt->deleter(mt);
}

/* __dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None) -> a "dltensor" capsule
 * (DLPack 0.8, what the array API lets a producer give whatever max_version asks). stream: None
 * or an int; no wait is needed on any (see the top). dl_device: None or this array's device;
 * copy: None or False (the capsule is a view). */
static PyObject *DevArray_dlpack(DevArrayObject *a, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$OOO:__dlpack__", kwlist, &stream, &max_version,
                                     &dl_device, &copy))
        return NULL;
    (void)max_version;
    if (stream != Py_None && !PyLong_Check(stream)) {
        PyErr_Format(PyExc_TypeError, "__dlpack__: stream must be None or an int, got %s", Py_TYPE(stream)->tp_name);
        return NULL;
    }
    if (dl_device != Py_None) {
        int type = 0, id = -1;
        if (!PyArg_ParseTuple(dl_device, "ii:dl_device", &type, &id)) return NULL;
        if (type != kDLCUDA || id != a->device) {
            PyErr_Format(PyExc_BufferError, "__dlpack__: this array is on cuda:%d (DLPack device (%d, %d)), "
                         "not (%d, %d); copy it with .numpy() or in the consumer", a->device, kDLCUDA, a->device,
                         type, id);
            return NULL;
        }
    }
    if (copy != Py_None) {
        const int yes = PyObject_IsTrue(copy);
        if (yes < 0) return NULL;
        if (yes) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: copy=True is not supported: the capsule is a view "
                                               "(copy in the consumer, or to the host with .numpy())");
            return NULL;
        }
    }
    /* the tensor, then its shape and strides, in one allocation freed by the deleter */
    DLManagedTensor *mt = malloc(sizeof *mt + 2 * (size_t)a->ndim * sizeof(int64_t));
    if (mt == NULL) return PyErr_NoMemory();
    int64_t *shape = (int64_t *)(mt + 1), *strides = shape + a->ndim, step = 1;
    for (int i = a->ndim - 1; i >= 0; i--) {
        shape[i] = a->shape[i];
        strides[i] = step;
        step *= a->shape[i];
    }
    memset(&mt->dl_tensor, 0, sizeof mt->dl_tensor);
    mt->dl_tensor.data = a->data;
    mt->dl_tensor.device.device_type = kDLCUDA;
    mt->dl_tensor.device.device_id = a->device;
    mt->dl_tensor.ndim = a->ndim;
    mt->dl_tensor.dtype.code = a->dtype == QC_DTYPE_I32 ? kDLInt : kDLFloat;
    mt->dl_tensor.dtype.bits = 32;
    mt->dl_tensor.dtype.lanes = 1;
    mt->dl_tensor.shape = shape;
    mt->dl_tensor.strides = strides;
    mt->dl_tensor.byte_offset = 0;
    Py_INCREF(a);   /* the consumer's reference, released by dl_deleter */
    mt->manager_ctx = a;
    mt->deleter = dl_deleter;
    PyObject *cap = PyCapsule_New(mt, "dltensor", dl_capsule_free);
    if (cap == NULL) dl_deleter(mt);
    return cap;
}

/* __dlpack_device__() -> (kDLCUDA, ordinal) */
static PyObject *DevArray_dlpack_device(DevArrayObject *a, PyObject *noargs) {
    (void)noargs;
    return Py_BuildValue("(ii)", (int)kDLCUDA, a->device);
}

/* ---- attributes ---- */

static PyObject *DevArray_get_shape(DevArrayObject *a, void *closure) {
    (void)closure;
    return shape_tuple(a);
}

static PyObject *DevArray_get_ndim(DevArrayObject *a, void *closure) {
    (void)closure;
    return PyLong_FromLong(a->ndim);
}

static PyObject *DevArray_get_dtype(DevArrayObject *a, void *closure) {
    (void)closure;
    return (PyObject *)PyArray_DescrFromType(npy_type(a));
}

static PyObject *DevArray_get_nbytes(DevArrayObject *a, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(a->nbytes);
}

static PyObject *DevArray_get_device(DevArrayObject *a, void *closure) {
    (void)closure;
    return PyUnicode_FromFormat("cuda:%d", a->device);
}

/* The CUDA Array Interface, version 3: row-major (strides None), writable, ready on any stream. */
static PyObject *DevArray_get_cai(DevArrayObject *a, void *closure) {
    (void)closure;
    PyObject *shape = shape_tuple(a);
    if (shape == NULL) return NULL;
    return Py_BuildValue("{s:N,s:s,s:(NO),s:i,s:O,s:O}", "shape", shape, "typestr",
                         a->dtype == QC_DTYPE_I32 ? "<i4" : "<f4", "data", PyLong_FromVoidPtr(a->data), Py_False,
                         "version", 3, "strides", Py_None, "stream", Py_None);
}

static PyObject *DevArray_repr(DevArrayObject *a) {
    char shape[96];
    int at = 0;
    for (int i = 0; i < a->ndim; i++)
        at += snprintf(shape + at, sizeof shape - (size_t)at, "%s%lld", i ? ", " : "", (long long)a->shape[i]);
    return PyUnicode_FromFormat("<qwencuda.DeviceArray %s (%s%s) on cuda:%d>",
                                a->dtype == QC_DTYPE_I32 ? "int32" : "float32", shape, a->ndim == 1 ? "," : "",
                                a->device);
}

static PyMethodDef DevArray_methods[] = {
    {"numpy", (PyCFunction)DevArray_numpy, METH_NOARGS, "numpy() -> np.ndarray: a copy in host memory."},
    {"__array__", (PyCFunction)(void (*)(void))DevArray_array, METH_VARARGS | METH_KEYWORDS,
     "__array__(dtype=None, copy=None): np.asarray(x) copies to the host, as x.numpy() does."},
    {"__dlpack__", (PyCFunction)(void (*)(void))DevArray_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None) -> a DLPack capsule: "
     "torch.from_dlpack(x), cupy.from_dlpack(x) view the GPU buffer without a copy."},
    {"__dlpack_device__", (PyCFunction)DevArray_dlpack_device, METH_NOARGS,
     "__dlpack_device__() -> (2, ordinal): kDLCUDA and the CUDA device."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef DevArray_getset[] = {
    {"shape", (getter)DevArray_get_shape, NULL, "the shape, a tuple (as the NumPy capture's)", NULL},
    {"ndim", (getter)DevArray_get_ndim, NULL, "number of dimensions", NULL},
    {"dtype", (getter)DevArray_get_dtype, NULL, "np.dtype: float32, or int32 for argmax", NULL},
    {"nbytes", (getter)DevArray_get_nbytes, NULL, "bytes of GPU memory the buffer holds", NULL},
    {"device", (getter)DevArray_get_device, NULL, "'cuda:N', the GPU that holds it", NULL},
    {"__cuda_array_interface__", (getter)DevArray_get_cai, NULL,
     "the CUDA Array Interface (version 3): cupy.asarray(x), torch.as_tensor(x, device='cuda')", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot DevArray_slots[] = {
    {Py_tp_dealloc, DevArray_dealloc},
    {Py_tp_repr, DevArray_repr},
    {Py_tp_methods, DevArray_methods},
    {Py_tp_getset, DevArray_getset},
    {Py_tp_doc, "A captured tensor in GPU memory (capture_device='cuda'): shape, dtype, nbytes, device; "
                "DLPack and __cuda_array_interface__ for torch / CuPy (no copy); numpy() copies to the host. "
                "It owns its buffer, freed with the last reference (a consumer's view holds one)."},
    {0, NULL},
};

static PyType_Spec DevArray_spec = {
    "qwencuda._core.DeviceArray", sizeof(DevArrayObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, DevArray_slots,
};

/* device_arrays_alive() -> (count, bytes): DeviceArrays not yet freed, and their GPU bytes. */
static PyObject *device_arrays_alive(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("(nK)", n_alive, (unsigned long long)bytes_alive);
}

static PyMethodDef devarray_functions[] = {
    {"device_arrays_alive", device_arrays_alive, METH_NOARGS,
     "device_arrays_alive() -> (count, bytes): DeviceArrays alive and the GPU memory they hold."},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_devarray(PyObject *m) {
    if (PyModule_AddFunctions(m, devarray_functions) < 0) return -1;
    DevArray_type = (PyTypeObject *)PyType_FromSpec(&DevArray_spec);
    if (DevArray_type == NULL) return -1;
    /* The module keeps a reference; DevArray_type's own lives as long as the process. */
    return PyModule_AddObjectRef(m, "DeviceArray", (PyObject *)DevArray_type);
}
