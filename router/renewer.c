/* renewer.c — see renewer.h. */
#define _GNU_SOURCE
#include "router/renewer.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/rpc_pb.h"
#include "tandem/internal/v1/worker.pb-c.h"

typedef struct rt_held {
    rt_worker_t *d;
    uint64_t id;
    rt_worker_t *p; /* the prefill worker its landing is lent to (NULL: none yet): each renewal extends its lease */
} rt_held_t;

struct rt_renewer {
    rt_table_t *table;
    pthread_mutex_t mu; /* guards held, n_held, stop */
    pthread_cond_t cv;
    rt_held_t held[RT_MAX_HELD];
    size_t n_held;
    bool stop;
    pthread_t thread;
    /* the thread's own */
    rt_held_t snap[RT_MAX_HELD];
    uint64_t ids[RT_MAX_HELD];
    bool sent[RT_MAX_HELD], renewed[RT_MAX_HELD];
    rt_worker_t *ps[RT_MAX_HELD];
    td_rpc_unary_pb_call_t calls[RT_MAX_HELD];
    Tandem__Internal__V1__ExtendLandingRequest ext[RT_MAX_HELD];
};

bool rt_renewer_add(rt_renewer_t *rn, rt_worker_t *d, uint64_t id, rt_worker_t *p)
{
    pthread_mutex_lock(&rn->mu);
    bool ok = rn->n_held < RT_MAX_HELD;
    if (ok)
        rn->held[rn->n_held++] = (rt_held_t){d, id, p};
    pthread_mutex_unlock(&rn->mu);
    return ok;
}

void rt_renewer_remove(rt_renewer_t *rn, rt_worker_t *d, uint64_t id)
{
    pthread_mutex_lock(&rn->mu);
    for (size_t i = 0; i < rn->n_held; i++)
        if (rn->held[i].d == d && rn->held[i].id == id) {
            rn->held[i] = rn->held[--rn->n_held];
            break;
        }
    pthread_mutex_unlock(&rn->mu);
}

/* The landing leases of the reservations renewed until `until` (those the
 * decode worker did not call unknown), one Extend per prefill worker. */
static void extend_landings(rt_renewer_t *rn, size_t n, uint64_t until)
{
    const rt_held_t *snap = rn->snap;
    size_t np = 0, at = 0;
    for (size_t i = 0; i < n; i++) {
        if (!snap[i].p || !rn->renewed[i])
            continue;
        bool seen = false;
        for (size_t k = 0; k < np && !seen; k++)
            seen = rn->ps[k] == snap[i].p;
        if (!seen)
            rn->ps[np++] = snap[i].p;
    }
    for (size_t k = 0; k < np; k++) {
        Tandem__Internal__V1__ExtendLandingRequest *rq = &rn->ext[k];
        tandem__internal__v1__extend_landing_request__init(rq);
        rq->reservation_ids = rn->ids + at;
        for (size_t i = 0; i < n; i++)
            if (snap[i].p == rn->ps[k] && rn->renewed[i])
                rn->ids[at + rq->n_reservation_ids++] = snap[i].id;
        at += rq->n_reservation_ids;
        rq->has_until_unix_ms = 1;
        rq->until_unix_ms = until;
        rn->calls[k] = (td_rpc_unary_pb_call_t){.ch = rn->ps[k]->ch, .method = "/tandem.internal.v1.Prefill/Extend",
                                                .msg = &rq->base,
                                                .desc = &tandem__internal__v1__extend_landing_response__descriptor};
    }
    td_rpc_unary_all_pb(rn->calls, np, 0.5);
    for (size_t k = 0; k < np; k++) {
        if (rn->calls[k].rc)
            TD_DEBUG("router: extending landings on %s: %s", rn->ps[k]->id, rn->calls[k].res.message);
        if (rn->calls[k].reply)
            protobuf_c_message_free_unpacked(rn->calls[k].reply, NULL);
    }
}

/* One Renew to d for the snapshot's reservations on it from i on (marked
 * sent); those it knew are marked renewed. Bounded by 0.5 s, so one slow
 * worker delays the others' renewals by that much at most, well within the
 * lease. */
static void renew_on(rt_renewer_t *rn, size_t i, size_t n)
{
    rt_worker_t *d = rn->snap[i].d;
    size_t k = 0;
    for (size_t j = i; j < n; j++)
        if (rn->snap[j].d == d) {
            rn->ids[k++] = rn->snap[j].id;
            rn->sent[j] = true;
        }
    Tandem__Internal__V1__RenewRequest rq = TANDEM__INTERNAL__V1__RENEW_REQUEST__INIT;
    rq.n_reservation_ids = k;
    rq.reservation_ids = rn->ids;
    rq.has_lease_ms = 1;
    rq.lease_ms = RT_RES_LEASE_MS;
    ProtobufCMessage *out = NULL;
    td_rpc_result_t res;
    if (td_rpc_unary_pb(d->ch, "/tandem.internal.v1.Decode/Renew", &rq.base,
                        &tandem__internal__v1__renew_response__descriptor, 0.5, NULL, &out, &res)) {
        TD_DEBUG("router: renewing %zu reservations on %s: %s", k, d->id, td_last_error());
        td_clear_error();
        return;
    }
    const Tandem__Internal__V1__RenewResponse *rp = (const Tandem__Internal__V1__RenewResponse *)out;
    for (size_t j = i; j < n; j++) {
        if (rn->snap[j].d != d)
            continue;
        rn->renewed[j] = true;
        for (size_t u = 0; u < rp->n_unknown_ids; u++)
            rn->renewed[j] &= rp->unknown_ids[u] != rn->snap[j].id;
    }
    protobuf_c_message_free_unpacked(out, NULL);
}

/* Every RT_RES_RENEW_S: one Renew per decode worker for the reservations held
 * on it, then the landing leases of those renewed extended on their prefill
 * workers to the lease the decode workers were asked for, counted from
 * before the Renew was sent. */
static void *renewer_thread(void *arg)
{
    rt_renewer_t *rn = arg;
    pthread_mutex_lock(&rn->mu);
    while (!rn->stop) {
        struct timespec until = td_wall_deadline(RT_RES_RENEW_S);
        pthread_cond_timedwait(&rn->cv, &rn->mu, &until);
        if (rn->stop)
            break;
        size_t n = rn->n_held;
        memcpy(rn->snap, rn->held, n * sizeof *rn->snap);
        for (size_t i = 0; i < n; i++) { /* the holder may finish meanwhile: keep the records alive */
            rt_table_hold(rn->table, rn->snap[i].d);
            if (rn->snap[i].p)
                rt_table_hold(rn->table, rn->snap[i].p);
            rn->sent[i] = rn->renewed[i] = false;
        }
        pthread_mutex_unlock(&rn->mu);
        uint64_t lease_until = td_unix_ms() + RT_RES_LEASE_MS; /* before any Renew is sent */
        for (size_t i = 0; i < n; i++)
            if (!rn->sent[i])
                renew_on(rn, i, n);
        extend_landings(rn, n, lease_until);
        for (size_t i = 0; i < n; i++) {
            rt_table_unhold(rn->table, rn->snap[i].d);
            if (rn->snap[i].p)
                rt_table_unhold(rn->table, rn->snap[i].p);
        }
        pthread_mutex_lock(&rn->mu);
    }
    pthread_mutex_unlock(&rn->mu);
    return NULL;
}

td_status_t rt_renewer_start(rt_table_t *t, rt_renewer_t **out)
{
    rt_renewer_t *rn = calloc(1, sizeof *rn);
    if (!rn)
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for the reservation renewer");
    rn->table = t;
    pthread_mutex_init(&rn->mu, NULL);
    pthread_cond_init(&rn->cv, NULL);
    if (pthread_create(&rn->thread, NULL, renewer_thread, rn)) {
        pthread_mutex_destroy(&rn->mu);
        pthread_cond_destroy(&rn->cv);
        free(rn);
        return td_error(TD_ERR_INTERNAL, "router: cannot start the reservation renewer");
    }
    *out = rn;
    return TD_OK;
}

void rt_renewer_stop(rt_renewer_t *rn)
{
    if (!rn)
        return;
    pthread_mutex_lock(&rn->mu);
    rn->stop = true;
    pthread_cond_broadcast(&rn->cv);
    pthread_mutex_unlock(&rn->mu);
    pthread_join(rn->thread, NULL);
    pthread_mutex_destroy(&rn->mu);
    pthread_cond_destroy(&rn->cv);
    free(rn);
}
