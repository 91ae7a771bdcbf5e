/* planner.h — the planner (DESIGN.md §7): one router at a time, elected
 * through etcd (TD_OPS_PLANNER_KEY under its lease; when it dies or stops,
 * the lease goes and another router's next campaign wins), turns the ops
 * config (common/ops.h, TD_OPS_KEY) into the desired worker counts
 * (TD_OPS_DESIRED_KEY) that the node agents obey.
 *
 * fixed: the model's counts. auto: the total stays; one worker moves from
 * decode to prefill when, over the requests that finished in the last
 * 3 x hold_s seconds and since the last change (8 of them at least), SLO
 * attainment is under the target and more of them missed the TTFT SLO than
 * the TPOT SLO — or the other way — within the bounds. A move needs the
 * same verdict for hold_s seconds running and cooldown_s since the last
 * change (hysteresis: it does not flap). The planner's own router's finished
 * requests are what it measures. It also predicts (router/demand.h): from
 * the requests placed in the window, their prompt tokens and predicted
 * outputs against what the workers' profiles serve, a move toward the split
 * whose busiest role is least busy once the busiest is nearly full, before
 * any SLO is missed; and a move the misses ask for that would overload the
 * role giving the worker up is not made. */
#ifndef RT_PLANNER_H
#define RT_PLANNER_H

#include <jansson.h>

#include "common/rpc.h"
#include "common/status.h"
#include "router/placement.h"
#include "router/stats.h"

typedef struct rt_planner rt_planner_t;

/* What the planner needs of its router; copied (the strings too) except
 * stats and tls, which must outlive it. */
typedef struct rt_planner_cfg {
    const char *id;              /* this router's name in the election (its address) */
    const char *model;           /* the model it plans for (its first served name) */
    const char *alias;           /* the model's own name (GGUF general.name), which an ops entry may use */
    const char *etcd_endpoints;  /* etcd.endpoints */
    uint32_t lease_ttl_s;        /* etcd.lease_ttl_s */
    const td_rpc_tls_t *tls;     /* the cluster's TLS (NULL: plaintext) */
    rt_stats_t *stats;           /* the router's finished and placed requests, for auto */
    rt_table_t *table;           /* its workers' profiles, for auto's predicted demand (NULL: none) */
} rt_planner_cfg_t;

td_status_t rt_planner_start(const rt_planner_cfg_t *cfg, rt_planner_t **out);
/* Resigns (the lease revoked, so another router takes over at once). */
void rt_planner_stop(rt_planner_t *p);
/* Looks again now (after an ops change). */
void rt_planner_poke(rt_planner_t *p);
/* {"leader": bool, "by": ..., "desired": {...}, "verdict": ..., "error": ...} */
json_t *rt_planner_json(rt_planner_t *p);

#endif
