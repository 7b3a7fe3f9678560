/* cpu_pool.c: fork-join over persistent pthreads.
 *
 * A decode step of Qwen2.5-0.5B runs ~170 parallel loops of 20-500 µs each. Waking a thread
 * through a condition variable costs 25-45 µs on the machines we measured (6 ms per token), so
 * workers first spin on the claim word for a while (QC_POOL_SPIN polls, ~130 µs) and
 * only then sleep; the caller likewise spins for the loop's items to finish. Between steps (or
 * when Python is idle) the workers sleep and use no CPU.
 *
 * Every loop is a number of items, and any thread takes the next item as it comes free: the
 * caller does not wait for a worker that never got to the loop. On shared cores a worker is
 * often descheduled for a whole time slice (milliseconds); with "every worker runs its slice"
 * the caller waited for it at each of the ~170 loops, here it takes the items itself and waits
 * only for items already running.
 *
 * The claim protocol. `claim` holds the loop's generation (high 32 bits) and its next item (low
 * 32 bits). A thread claims item i of generation g by a compare-and-swap of (g, i) to (g, i + 1)
 * after reading the loop's description (fn, ctx, n, items): the swap succeeds only while that
 * loop is unfinished (item i not yet taken), and the caller rewrites the description only after
 * the loop finished and after it has set claim to (g, CLOSED), so a description read before a
 * successful claim is the claimed loop's (every access seq_cst). A thread that fails simply
 * reads claim again. Results are published by the increment of `done` after each item, which
 * the caller reads before returning.
 *
 * Sleeping: a worker increments `sleepers` then re-reads claim under the mutex, the caller
 * stores claim then reads `sleepers`, both seq_cst (Dekker), so no wake-up is lost.
 */
#include "cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

/* Polls of the claim word before a worker sleeps: each poll waits a `pause` (31 ns on the
 * Zen 3 dev machine, so ~130 µs), longer than the serial gaps inside a decode step. */
#define QC_POOL_SPIN 4096

/* The low half of claim while the caller rewrites the description: no item is that large. */
#define QC_POOL_CLOSED 0xffffffffu

struct qc_pool {
    int n_threads;
    pthread_t *workers;            /* [n_threads - 1] */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t start_cv;
    _Atomic uint64_t claim;        /* generation << 32 | next item */
    _Atomic int64_t done;          /* items of the current loop finished */
    _Atomic int sleepers;          /* workers blocked (or about to block) on start_cv */
    _Atomic int stop;
    /* the current loop: item i is [n * i / items, n * (i + 1) / items) */
    _Atomic(qc_pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int64_t items;
};

typedef struct {
    qc_pool *pool;
    int index;                     /* 1..n_threads-1; the caller is 0 */
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Take and run items of generation gen until none is left (or the loop is no longer gen). */
static void run_items(qc_pool *p, uint32_t gen, int index) {
    for (;;) {
        uint64_t w = atomic_load(&p->claim);
        if ((uint32_t)(w >> 32) != gen) return;
        const qc_pool_fn fn = atomic_load(&p->fn);
        void *ctx = atomic_load(&p->ctx);
        const int64_t n = atomic_load(&p->n), items = atomic_load(&p->items);
        const uint32_t i = (uint32_t)w;
        if ((int64_t)i >= items) return;   /* all taken (or CLOSED) */
        if (!atomic_compare_exchange_weak(&p->claim, &w, w + 1)) continue;
        const int64_t begin = n * (int64_t)i / items, end = n * ((int64_t)i + 1) / items;
        if (begin < end) fn(ctx, begin, end, index);
        atomic_fetch_add(&p->done, 1);
    }
}

static void *worker_main(void *arg_) {
    worker_arg *arg = arg_;
    qc_pool *p = arg->pool;
    int index = arg->index;
    free(arg);
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen = (uint32_t)(atomic_load(&p->claim) >> 32);
        for (int spin = 0; gen == seen && spin < QC_POOL_SPIN && !atomic_load(&p->stop); spin++) {
            cpu_relax();
            gen = (uint32_t)(atomic_load(&p->claim) >> 32);
        }
        if (gen == seen) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((gen = (uint32_t)(atomic_load(&p->claim) >> 32)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->start_cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = gen;
        run_items(p, gen, index);
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
    atomic_init(&p->claim, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->fn, NULL);
    atomic_init(&p->ctx, NULL);
    atomic_init(&p->n, 0);
    atomic_init(&p->items, 0);
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

/* One loop of `items` items over [0, n) (see the claim protocol above). */
static void pool_run(qc_pool *p, int64_t n, int64_t items, qc_pool_fn fn, void *ctx) {
    const uint64_t w = atomic_load(&p->claim);
    const uint32_t gen = (uint32_t)(w >> 32) + 1;
    /* close the finished loop: no claim of it can succeed after this store */
    atomic_store(&p->claim, (w & ~(uint64_t)0xffffffffu) | QC_POOL_CLOSED);
    atomic_store(&p->fn, fn);
    atomic_store(&p->ctx, ctx);
    atomic_store(&p->n, n);
    atomic_store(&p->items, items);
    atomic_store(&p->done, 0);
    atomic_store(&p->claim, (uint64_t)gen << 32);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->start_cv);
        pthread_mutex_unlock(&p->mu);
    }

    run_items(p, gen, 0);

    /* every item is taken: wait for those still running; yield now and then in case one of
     * their threads was descheduled (other processes share the cores) */
    for (int spin = 0; atomic_load(&p->done) < items; spin++) {
        cpu_relax();
        if (spin % 1024 == 1023) sched_yield();
    }
}

void qc_pool_run(qc_pool *p, int64_t n, qc_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        fn(ctx, 0, n, 0);
        return;
    }
    /* one contiguous slice per thread; a slice's bounds never depend on which thread runs it */
    pool_run(p, n, n < p->n_threads ? n : p->n_threads, fn, ctx);
}

void qc_pool_run_chunks(qc_pool *p, int64_t n, qc_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, i + 1, 0);
        return;
    }
    if (n >= (int64_t)QC_POOL_CLOSED) {   /* more items than the claim word counts: slices */
        pool_run(p, n, (int64_t)QC_POOL_CLOSED - 1, fn, ctx);
        return;
    }
    pool_run(p, n, n, fn, ctx);
}
