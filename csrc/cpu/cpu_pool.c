/* cpu_pool.c: fork-join over persistent pthreads.
 *
 * A decode step of Qwen2.5-0.5B runs ~170 parallel loops of 50-500 µs each. Waking a thread
 * through a condition variable costs 25-45 µs on the machines we measured (6 ms per token), so
 * workers first spin on an atomic generation counter for a while (QC_POOL_SPIN polls, some
 * tens of µs) and only then sleep; the caller likewise spins for the workers to finish. Between
 * steps (or when Python is idle) the workers sleep and use no CPU.
 *
 * Memory order: the caller writes the job (fn, ctx, n) and then bumps `generation` (seq_cst);
 * a worker that sees the new generation sees the job. Each worker's results are published by
 * its decrement of `pending`, which the caller reads before returning. The sleep/wake handshake
 * is Dekker-style: the caller bumps `generation` then reads `sleepers`, a worker increments
 * `sleepers` then re-reads `generation` under the mutex, both seq_cst, so no wake-up is lost.
 */
#include "cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

/* Polls of the generation counter before a worker sleeps (~20-60 µs). */
#define QC_POOL_SPIN 20000

struct qc_pool {
    int n_threads;
    pthread_t *workers;            /* [n_threads - 1] */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t start_cv;
    _Atomic uint64_t generation;   /* bumped for every loop; workers run once per bump */
    _Atomic int pending;           /* workers still running the current loop */
    _Atomic int sleepers;          /* workers blocked (or about to block) on start_cv */
    _Atomic int stop;
    qc_pool_fn fn;
    void *ctx;
    int64_t n;
    int dynamic;                   /* qc_pool_run_chunks: items handed out one by one */
    _Atomic int64_t next;          /* the next item to hand out */
};

typedef struct {
    qc_pool *pool;
    int index;                     /* 1..n_threads-1; the caller is 0 */
} worker_arg;

/* Thread `index` takes the index-th of n_threads contiguous, nearly equal slices: a fixed
 * split, so that which thread computes what never depends on timing. */
static void run_slice(qc_pool *p, int index) {
    if (p->dynamic) {
        /* Whoever is free takes the next item: a thread slowed down by another process (the
         * cores are shared) does less of the loop instead of holding up everyone. */
        for (int64_t i; (i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < p->n;)
            p->fn(p->ctx, i, i + 1, index);
        return;
    }
    int64_t begin = p->n * index / p->n_threads;
    int64_t end = p->n * (index + 1) / p->n_threads;
    if (begin < end) p->fn(p->ctx, begin, end, index);
}

static void *worker_main(void *arg_) {
    worker_arg *arg = arg_;
    qc_pool *p = arg->pool;
    int index = arg->index;
    free(arg);
    uint64_t seen = 0;
    for (;;) {
        uint64_t gen = atomic_load(&p->generation);
        for (int spin = 0; gen == seen && spin < QC_POOL_SPIN && !atomic_load(&p->stop); spin++)
            gen = atomic_load(&p->generation);
        if (gen == seen) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((gen = atomic_load(&p->generation)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->start_cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = gen;
        run_slice(p, index);
        atomic_fetch_sub(&p->pending, 1);
    }
    return NULL;
}

qc_pool *qc_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    qc_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, 0);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) goto fail;
        for (int i = 1; i < n_threads; i++) {
            worker_arg *arg = malloc(sizeof *arg);
            if (!arg) goto fail;
            arg->pool = p;
            arg->index = i;
            if (pthread_create(&p->workers[i - 1], NULL, worker_main, arg) != 0) {
                free(arg);
                goto fail;
            }
            p->n_started++;
        }
    }
    return p;
fail:
    qc_pool_destroy(p);
    return NULL;
}

void qc_pool_destroy(qc_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start_cv);
    free(p->workers);
    free(p);
}

int qc_pool_threads(const qc_pool *p) { return p->n_threads; }

static void pool_run(qc_pool *p, int64_t n, qc_pool_fn fn, void *ctx, int dynamic) {
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->dynamic = dynamic;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store(&p->pending, p->n_threads - 1);
    atomic_fetch_add(&p->generation, 1);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->start_cv);
        pthread_mutex_unlock(&p->mu);
    }

    run_slice(p, 0);

    /* The slices are equal, so the others finish about now; yield now and then in case a
     * worker was descheduled (other processes share the cores). */
    for (int spin = 0; atomic_load(&p->pending) > 0; spin++)
        if (spin % 1024 == 1023) sched_yield();
}

void qc_pool_run(qc_pool *p, int64_t n, qc_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        fn(ctx, 0, n, 0);
        return;
    }
    pool_run(p, n, fn, ctx, 0);
}

void qc_pool_run_chunks(qc_pool *p, int64_t n, qc_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, i + 1, 0);
        return;
    }
    pool_run(p, n, fn, ctx, 1);
}
