/* qc_cuda_api.h: entry points of the CUDA backend beyond backend.h, for the bindings (C).
 * Defined only in CUDA builds (QC_HAVE_CUDA). */
#ifndef QC_CUDA_API_H
#define QC_CUDA_API_H

#include <stddef.h>
#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cudaMemGetInfo of device: free and total bytes (device-wide, all processes). */
int qc_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes, qc_error *err);

/* What bench needs of a device to state its memory-bandwidth bound: the peak memory clock
 * (kHz), the bus width (bits), the multiprocessors and the compute capability. */
typedef struct qc_cuda_props {
    int mem_clock_khz, bus_width_bits, sm_count, major, minor;
} qc_cuda_props;
int qc_cuda_device_props(int device, qc_cuda_props *out, qc_error *err);

/* A buffer of device from the CUDA backend's alloc, freed or read by the device ordinal alone (no
 * backend): a capture kept on the GPU (session.h) lives in Python, maybe after its model closed. */
void qc_cuda_buffer_free(int device, void *ptr);   /* NULL ok; waits for the device's queued work */
int qc_cuda_buffer_download(int device, void *host_dst, const void *src, size_t bytes, qc_error *err);

#ifdef __cplusplus
}
#endif
#endif /* QC_CUDA_API_H */
