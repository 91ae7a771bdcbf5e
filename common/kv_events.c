/* kv_events.c — see kv_events.h. */
#define _GNU_SOURCE
#include "common/kv_events.h"

#include <stdlib.h>
#include <sys/random.h>

#include "common/log.h"
#include "common/rpc_pb.h"

#define MAX_EVENTS 65536u /* in one answer */

td_status_t td_kv_events_init(td_kv_events_t *e, uint32_t cap, const char *who)
{
    *e = (td_kv_events_t){.cap = cap};
    if (!(e->ring = calloc(cap, sizeof *e->ring)) || getrandom(&e->epoch, sizeof e->epoch, 0) != sizeof e->epoch) {
        free(e->ring);
        e->ring = NULL;
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory or randomness for the event ring", who);
    }
    e->epoch |= 1; /* never 0: a follower's "none yet" */
    return TD_OK;
}

void td_kv_events_free(td_kv_events_t *e)
{
    free(e->ring);
    e->ring = NULL;
}

void td_kv_events_add(td_kv_events_t *e, Tandem__Internal__V1__KvEvent__Kind kind, td_block_name_t name,
                      uint32_t tier)
{
    e->seq++;
    e->ring[e->seq % e->cap] = (td_kv_event_rec_t){.seq = e->seq, .name = name, .kind = (uint8_t)kind,
                                                   .tier = (uint8_t)tier};
}

td_status_t td_kv_events_answer(const td_kv_events_t *e, const Tandem__Internal__V1__KvEventsRequest *rq,
                                uint8_t **buf, size_t *len)
{
    Tandem__Internal__V1__KvEventsResponse r = TANDEM__INTERNAL__V1__KV_EVENTS_RESPONSE__INIT;
    uint32_t max = rq->max_events ? (rq->max_events < MAX_EVENTS ? rq->max_events : MAX_EVENTS) : 4096;
    r.has_epoch = r.has_gap = r.has_last_seq = 1;
    r.epoch = e->epoch;
    r.last_seq = e->seq;
    uint64_t oldest = e->seq >= e->cap ? e->seq - e->cap + 1 : 1;
    r.gap = rq->epoch != e->epoch || rq->after_seq > e->seq || rq->after_seq + 1 < oldest;
    uint64_t k = r.gap ? 0 : e->seq - rq->after_seq;
    if (k > max)
        k = max;
    Tandem__Internal__V1__KvEvent *ev = NULL, **evp = NULL;
    Tandem__Internal__V1__BlockName *names = NULL;
    if (k && (!(ev = malloc(k * sizeof *ev)) || !(evp = malloc(k * sizeof *evp)) ||
              !(names = malloc(k * sizeof *names))))
        k = 0;
    for (uint64_t i = 0; i < k; i++) {
        const td_kv_event_rec_t *v = &e->ring[(rq->after_seq + 1 + i) % e->cap];
        tandem__internal__v1__kv_event__init(&ev[i]);
        tandem__internal__v1__block_name__init(&names[i]);
        names[i].has_lo = names[i].has_hi = 1;
        names[i].lo = v->name.lo;
        names[i].hi = v->name.hi;
        ev[i].has_seq = ev[i].has_kind = 1;
        ev[i].seq = v->seq;
        ev[i].kind = (Tandem__Internal__V1__KvEvent__Kind)v->kind;
        ev[i].name = &names[i];
        if (v->kind == TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED) {
            ev[i].has_tier = 1;
            ev[i].tier = v->tier;
        }
        evp[i] = &ev[i];
    }
    r.n_events = k;
    r.events = evp;
    *len = tandem__internal__v1__kv_events_response__get_packed_size(&r);
    td_status_t rc = TD_OK;
    if ((*buf = malloc(*len ? *len : 1)))
        tandem__internal__v1__kv_events_response__pack(&r, *buf);
    else
        rc = td_error(TD_ERR_NO_MEMORY, "no memory for an events answer");
    free(ev);
    free(evp);
    free(names);
    return rc;
}

void td_kv_events_serve(td_rpc_call_t *call, const td_kv_events_t *e, pthread_mutex_t *mu, const char *who)
{
    Tandem__Internal__V1__KvEventsRequest *rq = (Tandem__Internal__V1__KvEventsRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__kv_events_request__descriptor);
    if (!rq)
        return;
    uint8_t *buf = NULL;
    size_t len = 0;
    pthread_mutex_lock(mu);
    td_status_t rc = td_kv_events_answer(e, rq, &buf, &len);
    pthread_mutex_unlock(mu);
    tandem__internal__v1__kv_events_request__free_unpacked(rq, NULL);
    if (rc)
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "%s: %s", who, td_last_error());
    else
        td_rpc_call_reply(call, buf, len);
    free(buf);
}

bool td_kv_events_contiguous(const Tandem__Internal__V1__KvEventsResponse *r, uint64_t after_seq)
{
    for (size_t i = 0; i < r->n_events; i++)
        if (!r->events[i]->has_seq || r->events[i]->seq != after_seq + 1 + i || !r->events[i]->name)
            return false;
    return true;
}
