/* cpu_pool.c: fork-join over persistent pthreads. Workers sleep on a condition variable between
 * loops, so a decode step (a few hundred small loops) pays no thread creation. */
#include "cpu_pool.h"

#include <pthread.h>
#include <stdlib.h>

struct qc_pool {
    int n_threads;
    pthread_t *workers;            /* [n_threads - 1] */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    uint64_t generation;           /* bumped for every loop; workers run once per bump */
    int pending;                   /* workers still running the current loop */
    int stop;
    qc_pool_fn fn;
    void *ctx;
    int64_t n;
};

typedef struct {
    qc_pool *pool;
    int index;                     /* 1..n_threads-1; the caller is 0 */
} worker_arg;

static void run_chunk(qc_pool *p, int index) {
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
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->start_cv, &p->mu);
        if (p->stop) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_chunk(p, index);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

qc_pool *qc_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    qc_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
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
    p->stop = 1;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start_cv);
    pthread_cond_destroy(&p->done_cv);
    free(p->workers);
    free(p);
}

int qc_pool_threads(const qc_pool *p) { return p->n_threads; }

void qc_pool_run(qc_pool *p, int64_t n, qc_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->pending = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);

    run_chunk(p, 0);

    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
