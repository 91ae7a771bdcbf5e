/* placement.h — which workers a request goes to (DESIGN.md §5).
 *
 * The router's table of workers, learnt from etcd, and the placement
 * interface over it: a table of functions, so that the predictive,
 * cache-aware placement of a later issue replaces least_loaded without
 * touching the request path. A worker whose KV contract differs from the
 * router's is kept in the table as refused (with the reason, naming both
 * values) and never chosen; one whose call failed is skipped for a while.
 * table.c keeps the table (records in, references, suspicion); placement.c
 * the policies and predictions over it. */
#ifndef RT_PLACEMENT_H
#define RT_PLACEMENT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "common/blockhash.h"
#include "common/kv_contract.h"
#include "common/rng.h"
#include "common/rpc.h"
#include "engine/profile.h"
#include "router/kvindex.h"

typedef enum rt_role { RT_PREFILL, RT_DECODE } rt_role_t;

#define RT_OBS 32 /* the prefill calls a worker's model is refitted from */
/* After etcd was away (the router's own lease lapsed: td_member_away_at),
 * every worker's lease lapsed too and they register again within moments:
 * a request that then finds no worker of a role registered waits this long
 * after the last one left instead of being refused at once. Outside such a
 * spell, no worker is 503 at once. */
#define RT_REJOIN_S 5.0
/* a worker whose connection fails: placement looked at again after this long (a join wakes it sooner) */
#define RT_DOWN_RETRY_S 0.5
#define RT_PRIOS 8 /* distinct priorities a worker's queue tells apart (more share the lowest's slot) */

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
    /* prediction (DESIGN.md §5): the profile it published; the prefill
     * model refitted online (pf_fit, the profile's coefficients until then)
     * from its last RT_OBS calls that found it idle (obs: the model's three
     * regressors and the measured ms), trusted up to a reach of the largest; the decode step's correction
     * (measured / predicted, smoothed); the prefill calls placed on it and
     * not yet answered (prefilling) and their predicted work (work_ms),
     * counted down from work_since (the last placement on an idle worker or
     * the last answer); the prompt blocks it is prefilling (kv_cost); its
     * slot in the cache index (-1: not followed yet) */
    eng_profile_t profile;
    bool has_profile;
    double pf_fit[3], pf_reach; /* pf_reach: the largest call refitted from, in its profile's work (ms) */
    double obs[RT_OBS][4];
    uint32_t n_obs;
    double k_step;
    uint32_t prefilling;
    double work_ms, work_since;
    struct { int32_t priority; uint32_t n; double ms; } by_prio[RT_PRIOS]; /* work_ms by the calls' priorities */
    uint32_t active_blocks;
    int ix_src;
    bool refused, gone;
    bool colocated; /* a decode worker that also serves whole requests (decode.colocated) */
    char devices[400]; /* the physical devices it computes on, comma-separated, from its record ("": not said) */
    uint32_t local_passed; /* idle, within the SLOs, yet passed over for a pair since its last local prefill */
    uint32_t kv_blocks; /* its KV pool's blocks, from its record (0: not said) */
    uint32_t token_budget; /* tokens one engine step takes, from its record (0: not said) */
    uint32_t queue_levels, queue_quantum; /* its engine's mlq order, from its record (levels 0: another order) */
    double out_pred; /* a decode worker's predicted output tokens of the streams placed on it and not ended */
    char refused_why[384];
    int refs;
} rt_worker_t;

#define RT_ERR_RING 4096
#define RT_POLICIES 8 /* policies with state one table keeps */

/* What a request asks of placement: its tokens, its prompt's chain of block
 * names (full blocks), how many tokens it may generate, its SLOs (0: none)
 * and whether a request predicted to miss them is refused at once. */
typedef struct rt_place_req {
    const int32_t *tokens;
    size_t n_tokens;
    const td_block_name_t *chain;
    size_t n_blocks;
    uint32_t max_tokens;
    double ttft_slo_ms, tpot_slo_ms;
    bool early_reject;
    int32_t priority; /* higher first: its queue is the work of equal or higher priority ahead */
    double pred_out;  /* the output tokens predicted for it (router/outlen.h; 0: none): decode load is weighed by them */
    uint32_t n_choices; /* the first of n choices (sampling.n): a pool must hold the prompt and n outputs */
} rt_place_req_t;

/* A placement's prediction for its pair: TTFT = overhead + queue + fetch +
 * prefill (each corrected online), the decode worker's time between tokens
 * once the request joins; the tokens its pool and the store supply. */
typedef struct rt_prediction {
    double ttft_ms, overhead_ms, queue_ms, fetch_ms, prefill_ms, tbt_ms;
    double step_raw_ms; /* the decode profile's step before its correction */
    uint32_t pool_tokens, store_tokens, new_tokens, blocks;
    bool alone; /* the prefill worker had no other call in flight (its time refits its model) */
    double out_tokens; /* the output tokens predicted, counted on the decode worker until rt_table_decode_end */
    int32_t priority; /* its class in the worker's queue (higher first): the request's priority, and on a worker
                       * whose engine runs the mlq order, less the level its new tokens enter at */
    bool valid;
    /* local: prefilled by the (colocated) decode worker itself, in its own steps, though prefill workers are
     * there (conditional disaggregation); stall_ms: what each of its running streams' steps takes longer
     * meanwhile (a chunk of the prompt; for a pair, where the prefill worker computes on a device the decode
     * worker shares, a chunk of the prefill worker's); remote_ttft_ms: the best pair's TTFT it was weighed
     * against */
    bool local;
    double stall_ms, remote_ttft_ms;
} rt_prediction_t;

/* y = fit[0] + fit[1] x by least squares over the last RT_OBS points (the
 * mean while they are too few or all of one x; never a negative slope). */
typedef struct rt_linefit {
    double fit[2];
    double obs[RT_OBS][2];
    uint32_t n;
} rt_linefit_t;

typedef struct rt_table {
    pthread_mutex_t mu;
    pthread_cond_t changed; /* a worker joined, left or became usable again */
    rt_worker_t **w;
    size_t n, cap;
    td_kv_layout_t expect;
    const td_rpc_tls_t *tls; /* how the router dials workers (mutual TLS; NULL: plaintext) */
    /* prediction and its record (under mu) */
    rt_kvindex_t *ix;           /* the cache index (NULL: none) */
    double tier_ms_per_block[RT_IX_TIERS]; /* a block fetched from a store's tier k (rt_table_set_tier_rates) */
    uint32_t aim_ttft_ms, aim_tpot_ms; /* the ops config's SLOs (rt_table_set_slo_aim; 0: none) */
    /* the router's overhead by prompt tokens: a pair's measured TTFT less the
     * prefill call (the reservation, the decode worker taking the KV and
     * sending the first token) */
    rt_linefit_t ov;
    struct { const struct rt_placement_ops *ops; void *state; } policy[RT_POLICIES]; /* policies' own state */
    uint32_t n_policy;
    uint64_t placed[3];         /* by reason: a pool hit, a store hit, cold */
    uint64_t placed_colocated;  /* whole requests on colocated decode workers (placed_local of them by choice) */
    uint64_t placed_local;      /* conditional disaggregation: prefilled locally though prefill workers were there */
    uint64_t rejected_ttft, rejected_tpot;
    float err[RT_ERR_RING];     /* |predicted - measured| / measured TTFT of the last requests */
    uint64_t n_err;
    double left_at[2];          /* when a worker of the role last left the membership */
    const struct td_member *member; /* the router's own membership (td_member_away_at), NULL before it joins */
    td_rng_t rng; /* the decode pick's draws (under mu) */
} rt_table_t;

/* What a placed request measured, told to the policy afterwards (the
 * predictive placement of a later issue learns its TTFT model from these). */
typedef struct rt_timings {
    double queue_ms, prefill_ms, ttft_ms, tpot_ms, e2e_ms;
    /* the first token's time from the start of the attempt that sent it, which pred is for (0: none did; an
     * earlier attempt sent it, or the request ended first): a retried request's TTFT holds its failed attempts */
    double attempt_ttft_ms;
    uint32_t prompt_tokens, cached_tokens, output_tokens;
    bool ok;
    rt_prediction_t pred; /* what placement predicted for it */
    /* what the prefill call pred is for found cached, in all and of it from the store: the worker's count,
     * where pred holds the index's guess */
    uint32_t call_cached, call_store;
} rt_timings_t;

/* What a policy sees of a request: the request (NULL: none, pick any),
 * what the cache index says its chain can be served from (NULL: no index),
 * and whether it is served whole (the cluster has no prefill worker: only a
 * colocated decode worker can take it). */
typedef struct rt_place_ctx {
    const rt_place_req_t *rq;
    const rt_chain_hits_t *hits;
    bool whole;
    uint32_t prefill_blocks; /* the KV blocks a prefill worker's pool needs for the prompt (0: not judged) */
    void *state; /* the policy's own state in this table (rt_placement_ops_t.state_new); NULL: it keeps none */
} rt_place_ctx_t;

/* Placement policy: picks a worker of a role among the usable ones (not
 * refused, not gone, not suspect); NULL when there is none. Called with the
 * table locked. observe (also locked) hears each placed request's timings
 * and corrects the predictions. rejects: a pair predicted to miss the
 * request's SLOs is refused (early rejection). A policy with state of its
 * own (round_robin's turn) makes it with state_new on a table's first use
 * of the policy, and finds it in c->state (observe: state); the table frees
 * it with state_free. A new policy is a new file's ops and a line in
 * placement.c's list of them (router.placement's names come from it). */
typedef struct rt_placement_ops {
    const char *name;
    rt_worker_t *(*pick)(rt_table_t *t, rt_role_t role, const rt_place_ctx_t *c, double now);
    void (*observe)(rt_table_t *t, void *state, rt_worker_t *prefill, rt_worker_t *decode, const rt_timings_t *tm);
    void *(*state_new)(void); /* NULL: no state of its own */
    void (*state_free)(void *state);
    bool rejects;
} rt_placement_ops_t;

/* Placement's answer: a (prefill, decode) pair, both held (release each
 * with rt_table_done), or a refusal — the gRPC code, the reason, and when a
 * worker of the missing role leaves its suspect time (retry_at; 0 when none
 * will by itself: none registered, or all refused). */
typedef struct rt_placement {
    rt_worker_t *prefill, *decode;
    int code; /* TD_RPC_OK when placed */
    double retry_at;
    uint32_t retry_after_ms; /* an early rejection's hint (0: none) */
    const char *rejected;    /* rejected early (answer at once, never queue), the SLO it is for ("ttft", "tpot"):
                              * RESOURCE_EXHAUSTED with the hint, or FAILED_PRECONDITION when even an idle worker
                              * would miss the SLO; NULL when not rejected early */
    char why[320];
    rt_prediction_t pred;
} rt_placement_t;

extern const rt_placement_ops_t rt_placement_least_loaded, rt_placement_round_robin, rt_placement_kv_cost,
    rt_placement_predictive;
/* The policy called name (router.placement), or NULL. */
const rt_placement_ops_t *rt_placement_by_name(const char *name);
/* Tells the config reader the names router.placement may take (before a
 * config is read). */
void rt_placement_register_names(void);

void rt_table_init(rt_table_t *t, const td_kv_layout_t *expect, const td_rpc_tls_t *tls);
/* A worker registered or re-registered (value: its JSON record). */
void rt_table_put(rt_table_t *t, const char *key, const char *value);
/* Frees the table and its workers (at exit: nothing may use it any more). */
void rt_table_fini(rt_table_t *t);
void rt_table_remove(rt_table_t *t, const char *key);
/* Removes every worker whose key is not among keys[0..n) (after the
 * membership was re-read: those left while nobody watched). */
void rt_table_retain(rt_table_t *t, const char *const *keys, size_t n);
/* Picks and takes a reference (inflight + 1); release with rt_table_done. */
rt_worker_t *rt_table_acquire(rt_table_t *t, const rt_placement_ops_t *p, rt_role_t role, const rt_place_req_t *rq);
/* A pair for a request (rq NULL: any), with its prediction, or why not
 * (rt_placement_t): no usable worker, or, under a policy that rejects, a
 * pair predicted to miss the request's SLOs (rejected: RESOURCE_EXHAUSTED
 * with retry_after_ms, or FAILED_PRECONDITION when the request alone on an
 * idle worker would miss them). In a cluster with no prefill worker, a colocated decode
 * worker alone (prefill NULL: it serves the whole request). */
void rt_table_place(rt_table_t *t, const rt_placement_ops_t *p, const rt_place_req_t *rq, rt_placement_t *out);
/* The prefill placed with prediction pred on w ended (answered or failed):
 * its work leaves w's queue. */
void rt_table_prefill_done(rt_table_t *t, rt_worker_t *w, const rt_prediction_t *pred);
/* The stream placed with prediction pred on decode worker w ended (or its
 * attempt failed): its predicted output leaves w's load. */
void rt_table_decode_end(rt_table_t *t, rt_worker_t *w, const rt_prediction_t *pred);
/* Placement's metrics for Health: the policy's name, placements by reason,
 * rejections by reason, the prediction error's p50/p90 and its count, and
 * per worker its corrections and queued work. */
json_t *rt_table_metrics(rt_table_t *t, const rt_placement_ops_t *p);
/* How long a worker is skipped after a call to it failed with a gRPC code,
 * the caller's own deadline and cancel aside: an answer about the request (a
 * malformed or oversized request, a refused landing, a permission) says
 * nothing of the worker: 0; a full pool is load: 0.1 s; a contract or
 * transport it refuses is its configuration: 60 s; anything else (it is
 * unavailable, failed inside, did not answer in time) is a fault: 2 s. */
double rt_suspect_for(int code);
/* Releases w; failed (its call's result), when not NULL and suspect_s > 0,
 * makes it suspect (skipped) for suspect_s seconds with that result as the
 * reason. */
void rt_table_done(rt_table_t *t, rt_worker_t *w, const td_rpc_result_t *failed, double suspect_s);
/* The read rates (GB/s) of a store's tiers, tier 0 first, from the nodes'
 * records (kvstore/tier.h): what a block fetched from each costs. A rate of
 * 0 leaves its tier's cost; tiers past n cost as tier n - 1. */
void rt_table_set_tier_rates(rt_table_t *t, const double *gbps, size_t n);
/* The SLOs the ops config states (common/ops.h: what the planner measures
 * attainment against; 0: none), set by the planner's thread of every router:
 * predictive placement weighs a local prefill against a pair by them for a
 * request that states none of its own (nor the router's config), as it would
 * by the request's. They steer placement only: a request is never refused
 * early for them. */
void rt_table_set_slo_aim(rt_table_t *t, uint32_t ttft_ms, uint32_t tpot_ms);
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
/* What one worker of each role serves, by the profiles (the prefill model
 * refitted, the decode step corrected; DESIGN.md §5), averaged over the
 * registered workers (a suspect one too: a loaded worker's call may time
 * out, its speed is the same): prompt tokens a second for calls of
 * new_tokens new tokens, and output tokens a second within a TPOT SLO of
 * tpot_slo_ms (0: none; the batch then as large as the pool holds) at
 * contexts of ctx_tokens. A role with no profiled worker gets 0. For the
 * planner's predicted demand (router/demand.h). */
typedef struct rt_capacity {
    uint32_t prefill, decode; /* the workers of each role counted */
    double prefill_tok_s, decode_tok_s;
} rt_capacity_t;
void rt_table_capacity(rt_table_t *t, double new_tokens, double ctx_tokens, double tpot_slo_ms, rt_capacity_t *out);
/* Whether a request can be placed now: a usable prefill and decode worker,
 * or, in a cluster with no prefill worker, a usable colocated one. */
bool rt_table_serving(rt_table_t *t);

#endif
