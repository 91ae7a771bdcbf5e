/* placement.h — which workers a request goes to (DESIGN.md §5).
 *
 * The router's table of workers, learnt from etcd, and the placement
 * interface over it: a table of functions, so that the predictive,
 * cache-aware placement of a later issue replaces least_loaded without
 * touching the request path. A worker whose KV contract differs from the
 * router's is kept in the table as refused (with the reason, naming both
 * values) and never chosen; one whose call failed is skipped for a while. */
#ifndef RT_PLACEMENT_H
#define RT_PLACEMENT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/kv_contract.h"
#include "common/rpc.h"

typedef enum rt_role { RT_PREFILL, RT_DECODE } rt_role_t;

typedef struct rt_worker {
    char key[256], id[96], addr[160];
    rt_role_t role;
    td_kv_layout_t contract;
    td_rpc_channel_t *ch;
    int inflight;
    double suspect_until; /* skipped until then (a call to it failed) */
    bool refused, gone;
    char refused_why[384];
    int refs;
} rt_worker_t;

typedef struct rt_table {
    pthread_mutex_t mu;
    rt_worker_t **w;
    size_t n, cap;
    td_kv_layout_t expect;
} rt_table_t;

/* Placement policy: picks a worker of a role among the usable ones (not
 * refused, not gone, not suspect); NULL when there is none. Called with the
 * table locked. */
typedef struct rt_placement_ops {
    const char *name;
    rt_worker_t *(*pick)(rt_table_t *t, rt_role_t role, const int32_t *tokens, size_t n_tokens, double now);
} rt_placement_ops_t;

extern const rt_placement_ops_t rt_placement_least_loaded;

void rt_table_init(rt_table_t *t, const td_kv_layout_t *expect);
/* A worker registered or re-registered (value: its JSON record). */
void rt_table_put(rt_table_t *t, const char *key, const char *value);
void rt_table_remove(rt_table_t *t, const char *key);
/* Removes every worker whose key is not among keys[0..n) (after the
 * membership was re-read: those left while nobody watched). */
void rt_table_retain(rt_table_t *t, const char *const *keys, size_t n);
/* Picks and takes a reference (inflight + 1); release with rt_table_done. */
rt_worker_t *rt_table_acquire(rt_table_t *t, const rt_placement_ops_t *p, rt_role_t role, const int32_t *tokens,
                              size_t n_tokens);
/* failed: skip the worker for suspect_s seconds. */
void rt_table_done(rt_table_t *t, rt_worker_t *w, bool failed, double suspect_s);
/* Another reference to w, for a thread that uses its channel outside an
 * acquire/done pair (renewing reservations); drop it with rt_table_unhold. */
void rt_table_hold(rt_table_t *t, rt_worker_t *w);
void rt_table_unhold(rt_table_t *t, rt_worker_t *w);
/* Workers of a role that are registered and not refused (usable or suspect). */
uint32_t rt_table_registered(rt_table_t *t, rt_role_t role);
/* Counts of usable workers per role. */
void rt_table_counts(rt_table_t *t, uint32_t *prefill, uint32_t *decode);

#endif
