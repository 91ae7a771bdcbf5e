/* pool.c — see pool.h. A ring of (fn, arg) under one mutex; idle threads
 * sleep on a condition variable. */
#define _GNU_SOURCE
#include "common/pool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"

typedef struct task {
    td_pool_fn fn;
    void *arg;
} task_t;

struct td_pool {
    char name[32];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_t *ring;
    size_t cap, head, n, running;
    bool stopping;
    int n_threads;
    pthread_t *threads;
};

static void *pool_thread(void *arg)
{
    td_pool_t *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->n && !p->stopping)
            pthread_cond_wait(&p->cv, &p->mu);
        if (!p->n)
            break; /* stopping and drained */
        task_t t = p->ring[p->head];
        p->head = (p->head + 1) % p->cap;
        p->n--;
        p->running++;
        pthread_mutex_unlock(&p->mu);
        t.fn(t.arg);
        pthread_mutex_lock(&p->mu);
        p->running--;
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

td_status_t td_pool_create(const char *name, int threads, size_t queue, td_pool_t **out)
{
    if (threads < 1 || queue < 1)
        return td_error(TD_ERR_INVALID_ARG, "pool %s: %d threads, queue of %zu: both must be at least 1", name,
                        threads, queue);
    td_pool_t *p = calloc(1, sizeof *p);
    task_t *ring = calloc(queue, sizeof *ring);
    pthread_t *th = calloc((size_t)threads, sizeof *th);
    if (!p || !ring || !th) {
        free(p);
        free(ring);
        free(th);
        return td_error(TD_ERR_NO_MEMORY, "pool %s: no memory", name);
    }
    snprintf(p->name, sizeof p->name, "%s", name);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->ring = ring;
    p->cap = queue;
    p->threads = th;
    for (; p->n_threads < threads; p->n_threads++)
        if (pthread_create(&th[p->n_threads], NULL, pool_thread, p) != 0) {
            int started = p->n_threads;
            td_pool_destroy(p);
            return td_error(TD_ERR_INTERNAL, "pool %s: cannot start thread %d", name, started);
        }
    *out = p;
    return TD_OK;
}

td_status_t td_pool_submit(td_pool_t *p, td_pool_fn fn, void *arg)
{
    pthread_mutex_lock(&p->mu);
    td_status_t rc = p->stopping ? TD_ERR_CANCELLED : p->n == p->cap ? TD_ERR_EXHAUSTED : TD_OK;
    if (!rc) {
        p->ring[(p->head + p->n) % p->cap] = (task_t){fn, arg};
        p->n++;
        pthread_cond_signal(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

size_t td_pool_busy(td_pool_t *p)
{
    pthread_mutex_lock(&p->mu);
    size_t n = p->n + p->running;
    pthread_mutex_unlock(&p->mu);
    return n;
}

int td_pool_threads(const td_pool_t *p) { return p->n_threads; }

void td_pool_destroy(td_pool_t *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->ring);
    free(p->threads);
    free(p);
}
