/* module.c: qwencuda._core, the extension module: exceptions, build_info, and the types and
 * functions of the binding files (py_*.c). */
#define QC_PY_MODULE_MAIN
#include "py_common.h"

#include "backend.h"
#include "../cpu/cpu_simd.h"

PyObject *qc_GGUFError = NULL;
PyObject *qc_ModelError = NULL;
PyObject *qc_CudaError = NULL;

PyObject *qc_py_raise(const qc_error *err) {
    PyObject *type;
    /* a patch callback's own exception is the error to see */
    if (err->kind == QC_ERR_CALLBACK && PyErr_Occurred()) return NULL;
    switch (err->kind) {
    case QC_ERR_GGUF: type = qc_GGUFError; break;
    case QC_ERR_MODEL: type = qc_ModelError; break;
    case QC_ERR_CUDA: type = qc_CudaError; break;
    case QC_ERR_NOMEM: type = PyExc_MemoryError; break;
    case QC_ERR_IO: type = PyExc_OSError; break;
    case QC_ERR_RANGE: type = PyExc_ValueError; break;
    default: type = PyExc_ValueError; break;
    }
    /* Messages quote names and values from files; a byte that is not UTF-8 (or a sequence
     * cut by the message's length limit) must not turn the error into a UnicodeDecodeError. */
    const char *text = err->msg[0] ? err->msg : "qwencuda: unknown error";
    PyObject *msg = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strnlen(text, sizeof err->msg),
                                         "backslashreplace");
    if (msg != NULL) {
        PyErr_SetObject(type, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

static PyObject *build_info(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef QC_HAVE_CUDA
    PyObject *cuda = Py_True;
    const char *archs = QC_CUDA_ARCHS, *cuda_version = QC_CUDA_VERSION;
#else
    PyObject *cuda = Py_False;
    const char *archs = "", *cuda_version = "";
#endif
#if defined(__clang__)
    const char *cc = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *cc = "gcc " __VERSION__;
#else
    const char *cc = "unknown";
#endif
    /* cpu_kernels: what device="cpu" runs here, chosen at run time from cpuid (cpu_simd.h) */
    return Py_BuildValue("{s:O,s:s,s:s,s:s,s:i,s:s}",
                         "cuda", cuda, "cuda_archs", archs, "cuda_version", cuda_version,
                         "c_compiler", cc, "cuda_devices", qc_cuda_device_count(),
                         "cpu_kernels", qc_simd_describe());
}

static PyMethodDef module_methods[] = {
    {"build_info", build_info, METH_NOARGS,
     "build_info() -> dict: whether CUDA was built, its architectures, compiler and CUDA versions, "
     "and the CPU kernels device='cpu' runs (cpu_kernels)."},
    {NULL, NULL, 0, NULL},
};

/* m_size -1 (single-phase init, one module per process), not per-module state: the exception
 * types are read by qc_py_raise from every binding, including the methods of the types of
 * py_gguf.c, py_model.c, py_sampler.c and py_tokenizer.c, which hold no reference to the module;
 * reaching module state from there needs those types made with PyType_FromModuleAndSpec and
 * looked up through PyType_GetModuleByDef in each binding file. Multi-phase init without that
 * would let a second module (a subinterpreter) replace the process-wide exception types. */
static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "qwencuda._core",
    "qwencuda's C core: GGUF reader, block formats, CPU and CUDA engines, tokenizer, sampler.",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

static int add_exception(PyObject *m, PyObject **slot, const char *name, PyObject *base,
                         const char *doc) {
    *slot = PyErr_NewExceptionWithDoc(name, doc, base, NULL);
    if (*slot == NULL) return -1;
    /* The module keeps its own reference; the global one lives as long as the process. */
    if (PyModule_AddObjectRef(m, strrchr(name, '.') + 1, *slot) < 0) return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (add_exception(m, &qc_GGUFError, "qwencuda.GGUFError", PyExc_ValueError,
                      "A GGUF file is malformed, truncated or uses something unsupported.") < 0 ||
        add_exception(m, &qc_ModelError, "qwencuda.ModelError", PyExc_ValueError,
                      "A GGUF file is not a model qwencuda can run (architecture, shapes, types).") < 0 ||
        add_exception(m, &qc_CudaError, "qwencuda.CudaError", PyExc_RuntimeError,
                      "A CUDA or cuBLAS call failed (the message names the call).") < 0 ||
        qc_py_add_gguf(m) < 0 || qc_py_add_quants(m) < 0 || qc_py_add_model(m) < 0 || qc_py_add_devarray(m) < 0 || qc_py_add_sampler(m) < 0 ||
        qc_py_add_tokenizer(m) < 0 || qc_py_add_kernels(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
