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
        /* cuda, cuda:N, and either with ":float": the float GEMV everywhere (the exact path)
         * instead of 8-bit activations for the 8-bit formats (kernels/qc_gemv_q8.cuh) */
        const size_t len = strlen(device);
        const int float_gemv = len >= 10 && strcmp(device + len - 6, ":float") == 0;
        const char *rest = device + 4, *stop = device + len - (float_gemv ? 6 : 0);
        int ordinal = 0;
        if (rest < stop && *rest == ':') {
            char *end = NULL;
            long v = strtol(rest + 1, &end, 10);
            if (end == rest + 1 || end != stop || v < 0 || v > 1024)
                return qc_fail(err, QC_ERR_VALUE, "device %s: expected cuda, cuda:N, cuda:float or cuda:N:float", device);
            ordinal = (int)v;
        } else if (rest != stop) {
            return qc_fail(err, QC_ERR_VALUE, "unknown device '%s' (expected cpu, cuda or cuda:N)", device);
        }
        return qc_cuda_backend_create(ordinal, float_gemv, out, err);
    }
    return qc_fail(err, QC_ERR_VALUE, "unknown device '%s' (expected cpu, cuda or cuda:N)", device);
}

void qc_backend_destroy(qc_backend *be) {
    if (be) be->ops->destroy(be);
}

#ifndef QC_HAVE_CUDA
int qc_cuda_backend_create(int device, int float_gemv, qc_backend **out, qc_error *err) {
    (void)device;
    (void)float_gemv;
    *out = NULL;
    return qc_fail(err, QC_ERR_CUDA,
                   "device='cuda': this qwencuda was built without CUDA (nvcc was not found at "
                   "build time, or QWENCUDA_CUDA=0); reinstall with nvcc on PATH or CUDA_HOME set");
}

int qc_cuda_device_count(void) { return 0; }
#endif
