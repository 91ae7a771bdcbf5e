/* follow.h — the follower that keeps the router's cache index
 * (router/kvindex.h) equal to its sources (DESIGN.md §5): every prefill
 * worker in the table and every kvstore node registered in etcd. Every
 * RT_FOLLOW_PERIOD_S it asks each source for the events after the last it
 * applied; a source's new epoch (it restarted), a gap it reports (the
 * follower fell off its ring), a sequence number out of order, a new source
 * or a router restart makes it take the source's Snapshot instead, so the
 * index heals rather than drifts. A source that left is forgotten. */
#ifndef RT_FOLLOW_H
#define RT_FOLLOW_H

#include <jansson.h>

#include "common/etcd.h"
#include "common/rpc.h"
#include "router/kvindex.h"
#include "router/placement.h"

#define RT_FOLLOW_PERIOD_S 0.1

typedef struct rt_follow rt_follow_t;

/* drop_every: the test hook router.index_drop_events (0: off) — one event
 * in every drop_every received is discarded before it is checked. */
td_status_t rt_follow_start(rt_table_t *t, rt_kvindex_t *ix, td_etcd_t *etcd, const td_rpc_tls_t *tls,
                            uint32_t drop_every, rt_follow_t **out);
void rt_follow_stop(rt_follow_t *f);
/* For Health: the index's size and bound, and per source its id, kind,
 * blocks, digest, epoch, seq, lag (events behind), staleness (seconds since
 * its last answer), snapshots and gaps taken, events the hook dropped. */
json_t *rt_follow_json(rt_follow_t *f);

#endif
