/* pool.h — a fixed set of worker threads and a bounded queue of tasks.
 *
 * The RPC server runs its handlers here and the router the steps of its
 * requests: a bounded number of threads however many calls are open, and a
 * queue of fixed size, so that "no room" is an answer at submission
 * (TD_ERR_EXHAUSTED), never a task dropped later. Submitting allocates
 * nothing. Tasks run in submission order on whichever thread is free.
 *
 * Threads: any thread may submit; destroy belongs to the owner and must not
 * run on one of the pool's own threads. */
#ifndef TD_POOL_H
#define TD_POOL_H

#include <stddef.h>

#include "common/status.h"

typedef struct td_pool td_pool_t;
typedef void (*td_pool_fn)(void *arg);

/* threads workers, at most queue tasks waiting (both >= 1); name for logs. */
td_status_t td_pool_create(const char *name, int threads, size_t queue, td_pool_t **out);
/* Queues fn(arg); TD_ERR_EXHAUSTED when the queue is full, TD_ERR_CANCELLED
 * once the pool is being destroyed. */
td_status_t td_pool_submit(td_pool_t *p, td_pool_fn fn, void *arg);
/* Tasks queued or running now. */
size_t td_pool_busy(td_pool_t *p);
int td_pool_threads(const td_pool_t *p);
/* Refuses new tasks, runs the queued ones, joins the threads. */
void td_pool_destroy(td_pool_t *p);

#endif
