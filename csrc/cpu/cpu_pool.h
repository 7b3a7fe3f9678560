/* cpu_pool.h: a persistent pool of worker threads for the CPU backend's parallel loops. */
#ifndef QC_CPU_POOL_H
#define QC_CPU_POOL_H

#include <stdint.h>

/* Work on items [begin, end) of a loop; `worker` is 0..n_threads-1 (for per-thread scratch). */
typedef void (*qc_pool_fn)(void *ctx, int64_t begin, int64_t end, int worker);

typedef struct qc_pool qc_pool;

/* n_threads >= 1; the caller's thread counts as one, so n_threads - 1 workers are started. */
qc_pool *qc_pool_create(int n_threads);
void qc_pool_destroy(qc_pool *pool);   /* joins the workers; NULL ok */
int qc_pool_threads(const qc_pool *pool);

/* Split [0, n) into contiguous slices, one per thread (each run by whichever thread is free:
 * a slice's bounds never depend on the thread), run fn on each and wait for all. */
void qc_pool_run(qc_pool *pool, int64_t n, qc_pool_fn fn, void *ctx);

/* Run fn(ctx, i, i + 1, worker) for every i in [0, n), each item taken by whichever thread is
 * free (an atomic counter): for loops whose items do not depend on the thread that runs them
 * (which thread computes an item may change from run to run; its result must not). */
void qc_pool_run_chunks(qc_pool *pool, int64_t n, qc_pool_fn fn, void *ctx);

#endif /* QC_CPU_POOL_H */
