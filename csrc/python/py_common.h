/* py_common.h: what every binding file (py_*.c) shares: the NumPy C API import, the module's
 * exception types, and the one place where a qc_error becomes a Python exception. */
#ifndef QC_PY_COMMON_H
#define QC_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PY_ARRAY_UNIQUE_SYMBOL qc_ARRAY_API
#ifndef QC_PY_MODULE_MAIN
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "common.h"
#include "gguf.h"

/* Exception types, created once at module init (module.c). */
extern PyObject *qc_GGUFError;   /* ValueError subclass */
extern PyObject *qc_ModelError;  /* ValueError subclass */
extern PyObject *qc_CudaError;   /* RuntimeError subclass */

/* The gguf_file behind a qwencuda.GGUFFile object, with *owner set to a new reference that keeps
 * its mapping alive (the caller releases it). NULL with ValueError for a closed file, TypeError
 * for anything else. */
gguf_file *qc_py_gguf_borrow(PyObject *obj, PyObject **owner);

/* The qc_sampler behind a qwencuda._core.Sampler object; NULL with TypeError for anything else.
 * Borrowed: valid while the object is. */
struct qc_sampler;
struct qc_sampler *qc_py_sampler_of(PyObject *obj);

/* A qwencuda._core.DeviceArray that owns the device buffer of a capture kept on the GPU
 * (t->on_device; py_devarray.c); t->data becomes NULL. NULL with an exception set, t unchanged. */
struct qc_tensor_out;
PyObject *qc_py_devarray_take(struct qc_tensor_out *t);

/* Raise the Python exception that matches err->kind; always returns NULL. */
PyObject *qc_py_raise(const qc_error *err);

/* Each binding file adds its types and functions to the module; 0 on success, -1 with an
 * exception set. Called in this order by module.c. */
int qc_py_add_gguf(PyObject *m);       /* py_gguf.c: GGUFFile */
int qc_py_add_quants(PyObject *m);     /* py_quants.c: dequantize, type table */
int qc_py_add_model(PyObject *m);      /* py_model.c: Model, Session */
int qc_py_add_devarray(PyObject *m);   /* py_devarray.c: DeviceArray, device_arrays_alive */
int qc_py_add_sampler(PyObject *m);    /* py_sampler.c: Sampler, sample */
int qc_py_add_tokenizer(PyObject *m);  /* py_tokenizer.c: Tokenizer */
int qc_py_add_kernels(PyObject *m);    /* py_kernels.c: kernel_* functions */

#endif /* QC_PY_COMMON_H */
