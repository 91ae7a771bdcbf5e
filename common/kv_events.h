/* kv_events.h — the one event log of named KV blocks that every holder of
 * blocks keeps (a kvstore node, a worker's pool) and every follower reads
 * (the router's cache index, tests): KvEvents / KvSnapshot of
 * kvstore.proto (DESIGN.md §4, §5).
 *
 * Events are numbered from 1 per epoch (a random number drawn when the
 * holder starts; never 0, a follower's "none yet"). The last `cap` events
 * are kept in a ring; a follower that asks for events older than the ring,
 * of another epoch, or past the newest is told `gap` and takes a Snapshot.
 * Not locked: the holder serialises add and answer with its own lock. */
#ifndef TD_KV_EVENTS_H
#define TD_KV_EVENTS_H

#include <pthread.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/rpc.h"
#include "common/status.h"
#include "tandem/internal/v1/kvstore.pb-c.h"

typedef struct td_kv_event_rec {
    uint64_t seq;
    td_block_name_t name;
    uint8_t kind, tier;
} td_kv_event_rec_t;

typedef struct td_kv_events {
    td_kv_event_rec_t *ring;
    uint32_t cap;
    uint64_t seq;   /* the newest event's number (0: none yet) */
    uint64_t epoch; /* this run's */
} td_kv_events_t;

/* A ring of cap events and a fresh epoch; who names the holder in errors. */
td_status_t td_kv_events_init(td_kv_events_t *e, uint32_t cap, const char *who);
void td_kv_events_free(td_kv_events_t *e);
/* The next event (number e->seq + 1). kind: a KvEvent kind; tier for STORED. */
void td_kv_events_add(td_kv_events_t *e, Tandem__Internal__V1__KvEvent__Kind kind, td_block_name_t name,
                      uint32_t tier);
/* The answer to rq packed into *buf (malloc'd; the caller replies with it
 * and frees it, outside its lock): gap, or up to rq->max_events (0: 4096;
 * at most 65536) events after rq->after_seq. Without memory: an empty batch
 * (the follower asks again). */
td_status_t td_kv_events_answer(const td_kv_events_t *e, const Tandem__Internal__V1__KvEventsRequest *rq,
                                uint8_t **buf, size_t *len);
/* The whole Events handler: unpacks the call's request, answers it from e
 * under mu (the holder's lock), replies outside it; who names the holder in
 * an error. */
void td_kv_events_serve(td_rpc_call_t *call, const td_kv_events_t *e, pthread_mutex_t *mu, const char *who);
/* A follower's check of an Events answer: the events are numbered
 * after_seq + 1, + 2, ... with nothing missing; false when one is out of
 * order (the follower then takes a snapshot). */
bool td_kv_events_contiguous(const Tandem__Internal__V1__KvEventsResponse *r, uint64_t after_seq);

#endif
