/* transitional scaffold; the owner replaces it. */
#include "backend.h"

int qc_cpu_backend_create(int threads, qc_backend **out, qc_error *err) {
    (void)threads;
    *out = NULL;
    return qc_fail(err, QC_ERR_VALUE, "cpu backend not built yet");
}
