/* cpu_backend.h: private to the CPU backend: its state and its ops (backend.h has the contracts). */
#ifndef QC_CPU_BACKEND_H
#define QC_CPU_BACKEND_H

#include "backend.h"
#include "cpu_pool.h"
#include "cpu_simd.h"

typedef struct {
    qc_pool *pool;
    float **scratch;               /* [n_scratch] per-thread buffers of scratch_floats floats */
    int n_scratch;
    size_t scratch_floats;
    float *normed;                 /* the fused ops' normalised input (qc_cpu_normed_buffer) */
    size_t normed_floats;
    const qc_simd_kernels *simd;   /* the fast kernels (cpu_fast.c), NULL: the reference ops */
    qc_backend_ops ops;            /* be->ops: the reference ops, the fast ones where simd is set */
    qc_q8_block *xq;               /* a matmul's activations in 8 bits (qc_cpu_q8_buffer) */
    size_t xq_blocks;
} qc_cpu_state;

/* Make every thread's scratch buffer hold at least floats_per_thread floats. */
int qc_cpu_scratch(qc_backend *be, size_t floats_per_thread);
/* A buffer of at least floats floats for the fused ops' normalised input, kept across calls
 * (a decode step allocates nothing); NULL with be->err set when out of memory. */
float *qc_cpu_normed_buffer(qc_backend *be, size_t floats);

/* A buffer of at least blocks 8-bit activation blocks, kept across calls; NULL with be->err set. */
qc_q8_block *qc_cpu_q8_buffer(qc_backend *be, size_t blocks);

/* The CPU backend with the reference ops (float_reference != 0: cpu_ops.c, float32 activations)
 * or with the fast ones where this CPU has them (cpu_fast.c; the reference ops elsewhere).
 * qc_cpu_backend_create is this with float_reference from QWENCUDA_CPU_KERNELS ("float": 1). */
int qc_cpu_backend_create_kernels(int threads, int float_reference, qc_backend **out, qc_error *err);

/* The reference ops (cpu_ops.c): qc_cpu_embed, qc_cpu_rmsnorm, ... (backend.h has their types). */
#define QC_CPU_DECLARE(name) qc_op_##name qc_cpu_##name;
QC_BACKEND_OPS(QC_CPU_DECLARE)
#undef QC_CPU_DECLARE

/* The ops that have fast kernels (cpu_fast.c: qc_cpu_fast_<op>, the same contracts, 8-bit
 * activations for the matmuls); they replace the reference's where this CPU has the kernels
 * (qc_cpu_state.simd), every other op is shared. */
#define QC_CPU_FAST_OPS(X) \
    X(rmsnorm) X(matmul) X(swiglu) X(argmax) X(matmul_add) X(matmul_multi) X(matmul_swiglu) \
    X(attention) X(sample)
#define QC_CPU_FAST_DECLARE(name) qc_op_##name qc_cpu_fast_##name;
QC_CPU_FAST_OPS(QC_CPU_FAST_DECLARE)
#undef QC_CPU_FAST_DECLARE

#endif /* QC_CPU_BACKEND_H */
