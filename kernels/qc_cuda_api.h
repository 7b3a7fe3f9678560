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

#ifdef __cplusplus
}
#endif
#endif /* QC_CUDA_API_H */
