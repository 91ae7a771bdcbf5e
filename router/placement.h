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
    int suspect_code;     /* that call's gRPC code and message */
    char suspect_why[192];
    double ewma_ttft_ms, ewma_tpot_ms; /* measured on requests it served (rt_table_observe) */
    bool refused, gone;
    char refused_why[384];
    int refs;
} rt_worker_t;

typedef struct rt_table {
    pthread_mutex_t mu;
    pthread_cond_t changed; /* a worker joined, left or became usable again */
    rt_worker_t **w;
    size_t n, cap;
    td_kv_layout_t expect;
    const td_rpc_tls_t *tls; /* how the router dials workers (mutual TLS; NULL: plaintext) */
} rt_table_t;

/* What a placed request measured, told to the policy afterwards (the
 * predictive placement of a later issue learns its TTFT model from these). */
typedef struct rt_timings {
    double queue_ms, prefill_ms, ttft_ms, tpot_ms, e2e_ms;
    uint32_t prompt_tokens, cached_tokens, output_tokens;
    bool ok;
} rt_timings_t;

/* Placement policy: picks a worker of a role among the usable ones (not
 * refused, not gone, not suspect); NULL when there is none. Called with the
 * table locked; observe (optional, also locked) hears each placed request's
 * timings. */
typedef struct rt_placement_ops {
    const char *name;
    rt_worker_t *(*pick)(rt_table_t *t, rt_role_t role, const int32_t *tokens, size_t n_tokens, double now);
    void (*observe)(rt_table_t *t, rt_worker_t *prefill, rt_worker_t *decode, const rt_timings_t *tm);
} rt_placement_ops_t;

/* Placement's answer: a (prefill, decode) pair, both held (release each
 * with rt_table_done), or a refusal — the gRPC code, the reason, and when a
 * worker of the missing role leaves its suspect time (retry_at; 0 when none
 * will by itself: none registered, or all refused). */
typedef struct rt_placement {
    rt_worker_t *prefill, *decode;
    int code; /* TD_RPC_OK when placed */
    double retry_at;
    char why[320];
} rt_placement_t;

extern const rt_placement_ops_t rt_placement_least_loaded;

void rt_table_init(rt_table_t *t, const td_kv_layout_t *expect, const td_rpc_tls_t *tls);
/* A worker registered or re-registered (value: its JSON record). */
void rt_table_put(rt_table_t *t, const char *key, const char *value);
void rt_table_remove(rt_table_t *t, const char *key);
/* Removes every worker whose key is not among keys[0..n) (after the
 * membership was re-read: those left while nobody watched). */
void rt_table_retain(rt_table_t *t, const char *const *keys, size_t n);
/* Picks and takes a reference (inflight + 1); release with rt_table_done. */
rt_worker_t *rt_table_acquire(rt_table_t *t, const rt_placement_ops_t *p, rt_role_t role, const int32_t *tokens,
                              size_t n_tokens);
/* A pair for a request, or why not (rt_placement_t). */
void rt_table_place(rt_table_t *t, const rt_placement_ops_t *p, const int32_t *tokens, size_t n_tokens,
                    rt_placement_t *out);
/* Releases w; failed (its call's result), when not NULL, makes it suspect
 * (skipped) for suspect_s seconds with that result as the reason. */
void rt_table_done(rt_table_t *t, rt_worker_t *w, const td_rpc_result_t *failed, double suspect_s);
/* Tells the policy what a placed request measured. */
void rt_table_observe(rt_table_t *t, const rt_placement_ops_t *p, rt_worker_t *prefill, rt_worker_t *decode,
                      const rt_timings_t *tm);
/* Waits until the table changes (a worker joins, leaves, or fails) or until
 * (absolute td_now_s time): for a request refused with a retry_at. */
void rt_table_wait(rt_table_t *t, double until);
/* Another reference to w, for a thread that uses its channel outside an
 * acquire/done pair (renewing reservations); drop it with rt_table_unhold. */
void rt_table_hold(rt_table_t *t, rt_worker_t *w);
void rt_table_unhold(rt_table_t *t, rt_worker_t *w);
/* Workers of a role that are registered and not refused (usable or suspect). */
uint32_t rt_table_registered(rt_table_t *t, rt_role_t role);
/* Counts of usable workers per role. */
void rt_table_counts(rt_table_t *t, uint32_t *prefill, uint32_t *decode);

#endif
