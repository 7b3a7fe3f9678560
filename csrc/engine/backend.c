/* backend.c: choose a backend by device string. */
#include "backend.h"
#include "../cpu/cpu_backend.h"

#include <stdlib.h>
#include <string.h>

int qc_backend_create(const char *device, int threads, qc_backend **out, qc_error *err) {
    *out = NULL;
    if (device == NULL || strcmp(device, "cpu") == 0)
        return qc_cpu_backend_create(threads, out, err);
    /* the CPU's float32 reference ops (cpu_ops.c) instead of its fast kernels (cpu_fast.c) */
    if (strcmp(device, "cpu:float") == 0)
        return qc_cpu_backend_create_kernels(threads, 1, out, err);
    if (strncmp(device, "cuda", 4) == 0) {
        int ordinal = 0;
        if (device[4] == ':') {
            char *end = NULL;
            long v = strtol(device + 5, &end, 10);
            if (end == device + 5 || *end != '\0' || v < 0 || v > 1024)
                return qc_fail(err, QC_ERR_VALUE, "device %s: expected cuda or cuda:N", device);
            ordinal = (int)v;
        } else if (device[4] != '\0') {
            return qc_fail(err, QC_ERR_VALUE, "unknown device '%s' (expected cpu, cuda or cuda:N)", device);
        }
        return qc_cuda_backend_create(ordinal, out, err);
    }
    return qc_fail(err, QC_ERR_VALUE, "unknown device '%s' (expected cpu, cuda or cuda:N)", device);
}

void qc_backend_destroy(qc_backend *be) {
    if (be) be->ops->destroy(be);
}

#ifndef QC_HAVE_CUDA
int qc_cuda_backend_create(int device, qc_backend **out, qc_error *err) {
    (void)device;
    *out = NULL;
    return qc_fail(err, QC_ERR_CUDA,
                   "device='cuda': this qwencuda was built without CUDA (nvcc was not found at "
                   "build time, or QWENCUDA_CUDA=0); reinstall with nvcc on PATH or CUDA_HOME set");
}

int qc_cuda_device_count(void) { return 0; }
#endif
