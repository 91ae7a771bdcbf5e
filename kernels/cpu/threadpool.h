/* threadpool.h — the CPU backend's compute threads.
 *
 * kern_pool_run(pool, n_tasks, fn, ctx) runs fn(ctx, task, n_tasks) for every
 * task in [0, n_tasks) on the caller plus the pool's workers and returns when
 * all are done. Workers spin briefly after a job (a decode step issues hundreds
 * of small jobs, and a futex wake-up per job would cost more than the job),
 * then sleep on a condition variable: an idle pool uses no CPU. */
#ifndef KERN_CPU_THREADPOOL_H
#define KERN_CPU_THREADPOOL_H

#include <stddef.h>

#include "common/status.h"

typedef struct kern_pool kern_pool_t;
typedef void (*kern_task_fn)(void *ctx, int task, int n_tasks);

/* n_threads counts the caller: 1 means no workers; 0 means one per core. */
td_status_t kern_pool_create(int n_threads, kern_pool_t **out);
void kern_pool_destroy(kern_pool_t *pool);
int kern_pool_threads(const kern_pool_t *pool);
/* Runs every task; tasks are claimed dynamically (an atomic counter). */
void kern_pool_run(kern_pool_t *pool, int n_tasks, kern_task_fn fn, void *ctx);

#endif
