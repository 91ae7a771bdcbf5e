/* threadpool.c — see threadpool.h.
 *
 * How it works: a job goes into one of two slots, jobs[generation & 1], and is
 * published by storing `claim` = generation << 32 | 0 (release). Workers
 * waiting for a new generation spin on it for up to ~100 µs, then block on the
 * condition variable. A task is claimed by a compare-and-swap on `claim` that
 * also checks the generation, so a slow worker still holding an old job can
 * never claim a task of a new one; tasks are claimed one by one, so uneven
 * tasks balance themselves. The caller works too, then waits (spinning) for
 * `pending`, the count of unfinished tasks, to reach zero. */
#include "kernels/cpu/threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define POOL_SPIN_NS 100000

typedef struct pool_job {
    _Atomic(kern_task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int n_tasks;
} pool_job_t;

struct kern_pool {
    int n_threads;
    pthread_t *workers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t claim; /* generation << 32 | next task */
    _Atomic int pending;
    _Atomic bool stop;
    pool_job_t jobs[2];
    uint32_t generation; /* the caller's own count */
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Claims and runs tasks of generation gen until none are left. */
static void pool_work(kern_pool_t *p, uint32_t gen)
{
    pool_job_t *job = &p->jobs[gen & 1];
    for (;;) {
        uint64_t v = atomic_load_explicit(&p->claim, memory_order_acquire);
        if ((uint32_t)(v >> 32) != gen)
            return;
        int n = atomic_load_explicit(&job->n_tasks, memory_order_relaxed);
        int t = (int)(uint32_t)v;
        if (t >= n)
            return;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        kern_task_fn fn = atomic_load_explicit(&job->fn, memory_order_relaxed);
        fn(atomic_load_explicit(&job->ctx, memory_order_relaxed), t, n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
    }
}

static uint32_t claim_gen(kern_pool_t *p)
{
    return (uint32_t)(atomic_load_explicit(&p->claim, memory_order_acquire) >> 32);
}

static void *pool_main(void *arg)
{
    kern_pool_t *p = arg;
    uint32_t seen = 0;
    for (;;) {
        uint64_t t0 = mono_ns();
        unsigned spins = 0;
        while (claim_gen(p) == seen && !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
            if ((++spins & 255) == 0 && mono_ns() - t0 > POOL_SPIN_NS) { /* the clock is read now and then */
                pthread_mutex_lock(&p->mu);
                while (claim_gen(p) == seen && !atomic_load(&p->stop))
                    pthread_cond_wait(&p->cv, &p->mu);
                pthread_mutex_unlock(&p->mu);
                break;
            }
            cpu_relax();
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = claim_gen(p);
        pool_work(p, seen);
    }
}

td_status_t kern_pool_create(int n_threads, kern_pool_t **out)
{
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    kern_pool_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_error(TD_ERR_NO_MEMORY, "threadpool: no memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return td_error(TD_ERR_NO_MEMORY, "threadpool: no memory");
    }
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&p->workers[i], NULL, pool_main, p) != 0) {
            p->n_threads = i;
            kern_pool_destroy(p);
            return td_error(TD_ERR_INTERNAL, "threadpool: cannot start thread %d", i);
        }
    }
    *out = p;
    return TD_OK;
}

void kern_pool_destroy(kern_pool_t *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++)
        pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->workers);
    free(p);
}

int kern_pool_threads(const kern_pool_t *p) { return p->n_threads; }

void kern_pool_run(kern_pool_t *p, int n_tasks, kern_task_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, n_tasks);
        return;
    }
    uint32_t gen = ++p->generation;
    pool_job_t *job = &p->jobs[gen & 1];
    atomic_store_explicit(&job->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&job->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&job->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&p->pending, n_tasks, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->claim, (uint64_t)gen << 32, memory_order_release);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pool_work(p, gen);
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0)
        cpu_relax();
}
