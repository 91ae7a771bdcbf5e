/* rpc_int.h — what rpc.c, rpc_server.c and rpc_client.c share; not for
 * users of rpc.h.
 *
 * Every batch started on a call is tagged with an rpc_op_t; the loop
 * threads (rpc.c) take its completion and run op->done. A thread that
 * blocks on a batch waits on an rpc_sync_t. */
#ifndef TD_RPC_INT_H
#define TD_RPC_INT_H

#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/clock.h"
#include "common/rpc.h"

#define MAX_METHODS 16
#define POSTED_PER_METHOD 8
#define MAX_MESSAGE (64 << 20)
#define MAX_LOOPS 4
#define DEFAULT_MAX_CALLS 4096
#define DEFAULT_THREADS 16
#define SCOPE_CALLS 8

typedef enum rpc_tag { TAG_SEND, TAG_RECV, TAG_STATUS, TAG_CLOSE, TAG_WAKE, TAG_FINISH, TAG_COUNT } rpc_tag_t;

/* A batch in flight: done(op, ok) runs on the loop thread. armed: bumped
 * (release) just before the batch starts and read (acquire) by the loop
 * thread, so that what the poster wrote is ordered before done() in the
 * memory model, and ThreadSanitizer sees it (the hand-off inside gRPC is
 * invisible to it). */
typedef struct rpc_op {
    void (*done)(struct rpc_op *op, bool ok);
    unsigned armed;
} rpc_op_t;

static inline rpc_op_t *rpc_op_arm(rpc_op_t *op)
{
    __atomic_fetch_add(&op->armed, 1, __ATOMIC_RELEASE);
    return op;
}

/* ---- the loop threads (rpc.c) */

/* The next loop's completion queue (round robin): a call's batches all go to one. */
grpc_completion_queue *rpc_loop_pick(void);
int rpc_loop_count(void);
grpc_completion_queue *rpc_loop_cq(int i);
/* This thread is a loop thread: callbacks run here and must not block. */
bool rpc_on_loop_thread(void);

/* gRPC's deadline s seconds from now (none past 1e8 s). */
static inline gpr_timespec rpc_deadline_in(double s)
{
    if (!(s < 1e8))
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (s < 0)
        s = 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros((int64_t)(s * 1e6), GPR_TIMESPAN));
}

/* s seconds from now on the clock the condition variables here wait on */
static inline struct timespec rpc_mono_in(double s) { return td_deadline_on(CLOCK_MONOTONIC, s); }

/* ---- what a blocked thread waits on: bits per tag, under mu (rpc.c) */

typedef struct rpc_sync {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned posted, done, ok;
} rpc_sync_t;

void rpc_sync_init(rpc_sync_t *s);
void rpc_sync_destroy(rpc_sync_t *s);
/* With mu held: waits for tag t to complete (consuming it). 1 it went
 * well, -1 it failed, 0 wait_s passed first. */
int rpc_sync_wait_locked(rpc_sync_t *s, rpc_tag_t t, double wait_s);
int rpc_sync_wait(rpc_sync_t *s, rpc_tag_t t, double wait_s);
/* With mu held: records tag t's outcome and wakes the waiters. */
void rpc_sync_complete_locked(rpc_sync_t *s, rpc_tag_t t, bool ok);
/* With mu held: waits until no batch of tag t is in flight. */
void rpc_sync_settle_locked(rpc_sync_t *s, rpc_tag_t t);

/* The message into *buf (capacity *cap, grown when short: no allocation
 * once it is large enough); false without memory. */
bool rpc_buffer_into(grpc_byte_buffer *bb, uint8_t **buf, size_t *cap, size_t *len);
/* TLS is configured (a CA or a certificate). */
bool rpc_tls_on(const td_rpc_tls_t *tls);

/* ---- scopes (rpc.c) */

struct td_rpc_scope {
    pthread_mutex_t mu;
    double deadline; /* td_now_s() clock; INFINITY: none */
    bool cancelled;
    grpc_call *calls[SCOPE_CALLS];
    size_t n;
};

void rpc_scope_init(td_rpc_scope_t *sc, double timeout_s);
/* Registers a call made under sc; cancels it at once when sc is cancelled
 * (or has no room: a scope serves a few calls at a time). */
void rpc_scope_track(td_rpc_scope_t *sc, grpc_call *call);
void rpc_scope_untrack(td_rpc_scope_t *sc, grpc_call *call);

#endif
