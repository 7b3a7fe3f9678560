/* py_quants.c: transitional scaffold; the owner replaces it. */
#include "py_common.h"

int qc_py_add_quants(PyObject *m) {
    (void)m;
    return 0;
}
