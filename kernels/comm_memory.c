/* comm_memory.c — the collectives of kernels/comm.h for ranks whose buffers
 * each rank's backend reaches (host memory; or ranks sharing one GPU): two
 * rendezvous a call (every buffer is final; every rank has read them all),
 * each with a deadline. Between them, in an all-reduce, rank r adds elements
 * [r n / R, (r + 1) n / R) of every rank's buffer into rank 0's, in rank
 * order, and copies the total to the others'; in a gather, rank 0 copies
 * each rank's part, row by row, into its columns of the whole — with the
 * backend's own add and copy, its queue drained before each rendezvous. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "kernels/comm.h"

typedef struct comm_memory {
    kern_comm_t base;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t arrived, aborted_by;
    uint64_t gen;
    uint32_t deadline_ms;
    float **bufs;
    size_t *ns;
} comm_memory_t;

#define NO_ABORT UINT32_MAX

/* Waits until every rank has arrived at this rendezvous (or one aborted, or the deadline passed); what: the call's
 * name for errors. */
static td_status_t meet(comm_memory_t *c, uint32_t rank, const char *what)
{
    td_status_t rc = TD_OK;
    pthread_mutex_lock(&c->mu);
    const uint64_t gen = c->gen;
    if (c->aborted_by != NO_ABORT) {
        rc = td_error(TD_ERR_UNAVAILABLE, "tp: rank %u stopped; rank %u's %s cannot complete", c->aborted_by, rank,
                      what);
    } else if (++c->arrived == c->base.ranks) {
        c->arrived = 0;
        c->gen++;
        pthread_cond_broadcast(&c->cv);
    } else {
        const struct timespec until = td_wall_deadline(c->deadline_ms / 1000.0);
        int e = 0;
        while (c->gen == gen && c->aborted_by == NO_ABORT && e != ETIMEDOUT)
            e = pthread_cond_timedwait(&c->cv, &c->mu, &until);
        if (c->gen == gen) {
            /* this rank gives up: the others must not wait for it either */
            if (c->aborted_by == NO_ABORT)
                c->aborted_by = rank;
            pthread_cond_broadcast(&c->cv);
            rc = e == ETIMEDOUT ? td_error(TD_ERR_TIMEOUT, "tp: rank %u waited %u ms for the other ranks' %s", rank,
                                           c->deadline_ms, what)
                                : td_error(TD_ERR_UNAVAILABLE, "tp: rank %u stopped; rank %u's %s cannot complete",
                                           c->aborted_by, rank, what);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void memory_abort(kern_comm_t *base, uint32_t rank);

/* A call's first half: rank's buffer and count posted, its queue drained (what came before has written the
 * buffer), every rank met. */
static td_status_t arrive(comm_memory_t *c, uint32_t rank, kern_backend_t *be, const float *buf, size_t n,
                          const char *what)
{
    c->bufs[rank] = (float *)buf;
    c->ns[rank] = n;
    td_status_t rc = be->ops->sync(be);
    if (rc) {
        memory_abort(&c->base, rank);
        return rc;
    }
    return meet(c, rank, what);
}

/* Its second half, after rank's share of the work (rc): the queue drained and every rank met again, so no rank
 * reuses its buffer before the others are done with it; a failure aborts the comm, so none waits for this rank. */
static td_status_t leave(comm_memory_t *c, uint32_t rank, kern_backend_t *be, td_status_t rc, const char *what)
{
    if (!rc)
        rc = be->ops->sync(be);
    if (rc) {
        memory_abort(&c->base, rank);
        return rc;
    }
    return meet(c, rank, what);
}

/* Whether every rank posted n (of unit: values, rows). */
static td_status_t same_n(comm_memory_t *c, uint32_t rank, size_t n, const char *what, const char *unit)
{
    for (uint32_t r = 0; r < c->base.ranks; r++)
        if (c->ns[r] != n)
            return td_error(TD_ERR_INTERNAL, "tp: %s of %zu %s on rank %u, %zu on rank %u", what, n, unit, rank,
                            c->ns[r], r);
    return TD_OK;
}

static td_status_t memory_all_reduce(kern_comm_t *base, uint32_t rank, kern_backend_t *be, float *buf, size_t n)
{
    comm_memory_t *c = (comm_memory_t *)base;
    const uint32_t R = base->ranks;
    td_status_t rc = arrive(c, rank, be, buf, n, "all-reduce");
    if (rc)
        return rc;
    rc = same_n(c, rank, n, "all-reduce", "values");
    const size_t lo = n * rank / R, hi = n * (rank + 1) / R;
    for (uint32_t r = 1; r < R && !rc && hi > lo; r++)
        rc = be->ops->add(be, c->bufs[0] + lo, c->bufs[r] + lo, hi - lo);
    for (uint32_t r = 1; r < R && !rc && hi > lo; r++)
        rc = be->ops->copy(be, c->bufs[r] + lo, c->bufs[0] + lo, (hi - lo) * sizeof(float));
    return leave(c, rank, be, rc, "all-reduce");
}

static td_status_t memory_gather_cols(kern_comm_t *base, uint32_t rank, kern_backend_t *be, const float *part,
                                      uint32_t rows, const uint32_t *cols, float *whole, float *scratch)
{
    (void)scratch; /* rank 0 reads the parts where they are */
    comm_memory_t *c = (comm_memory_t *)base;
    td_status_t rc = arrive(c, rank, be, part, rows, "gather");
    if (rc)
        return rc;
    rc = same_n(c, rank, rows, "a gather", "rows");
    size_t width = 0;
    for (uint32_t r = 0; r < base->ranks; r++)
        width += cols[r];
    for (uint32_t r = 0, off = 0; rank == 0 && r < base->ranks && !rc; off += cols[r], r++)
        for (uint32_t i = 0; i < rows && !rc && cols[r]; i++)
            rc = be->ops->copy(be, whole + i * width + off, c->bufs[r] + (size_t)i * cols[r], cols[r] * sizeof(float));
    return leave(c, rank, be, rc, "gather"); /* no rank reuses its part before rank 0 has read it */
}

static void memory_abort(kern_comm_t *base, uint32_t rank)
{
    comm_memory_t *c = (comm_memory_t *)base;
    pthread_mutex_lock(&c->mu);
    if (c->aborted_by == NO_ABORT)
        c->aborted_by = rank;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void memory_destroy(kern_comm_t *base)
{
    comm_memory_t *c = (comm_memory_t *)base;
    if (!c)
        return;
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->bufs);
    free(c->ns);
    free(c);
}

static const kern_comm_ops_t memory_comm_ops = {
    .name = "memory",
    .all_reduce = memory_all_reduce,
    .gather_cols = memory_gather_cols,
    .abort = memory_abort,
    .destroy = memory_destroy};

td_status_t kern_comm_memory_create(uint32_t ranks, uint32_t deadline_ms, kern_comm_t **out)
{
    if (!ranks)
        return td_error(TD_ERR_INVALID_ARG, "tp: a comm of 0 ranks");
    comm_memory_t *c = calloc(1, sizeof *c);
    if (!c || !(c->bufs = calloc(ranks, sizeof *c->bufs)) || !(c->ns = calloc(ranks, sizeof *c->ns))) {
        if (c)
            free(c->bufs);
        free(c);
        return td_error(TD_ERR_NO_MEMORY, "tp: no memory");
    }
    c->base = (kern_comm_t){.ops = &memory_comm_ops, .ranks = ranks};
    c->aborted_by = NO_ABORT;
    c->deadline_ms = deadline_ms;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    *out = &c->base;
    return TD_OK;
}
