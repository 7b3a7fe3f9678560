// transitional scaffold; the owner replaces it.
#include <cuda_runtime.h>
#include "backend.h"

extern "C" int qc_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
    return n;
}

extern "C" int qc_cuda_backend_create(int device, qc_backend **out, qc_error *err) {
    (void)device;
    *out = NULL;
    return qc_fail(err, QC_ERR_CUDA, "cuda backend not built yet");
}
