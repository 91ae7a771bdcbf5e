/* router.h — the router process's state, shared by its parts: the gRPC
 * front (router.c), the requests (request.c) and the reservation renewer. */
#ifndef RT_ROUTER_H
#define RT_ROUTER_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/config.h"
#include "common/etcd.h"
#include "common/pool.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "router/metrics.h"
#include "router/placement.h"
#include "tandem/v1/tandem.pb-c.h"

#define RT_OVERHEAD_RING 4096
/* Request objects beyond router.max_streams: those created and not yet
 * admitted (a handler thread's worth each). */
#define RT_REQ_SLACK 64

/* Reservations this router holds (reserved on a decode worker, not yet
 * claimed by a Decode or released). Their leases are short and renewed
 * every second, so a router that dies leaves them for one lease at most. A
 * fixed table: a request that finds it full is refused at admission. */
#define RT_RES_LEASE_MS 3000
#define RT_RES_RENEW_S 1.0
#define RT_MAX_HELD 4096

/* Limits on a public request, each refused with INVALID_ARGUMENT naming the
 * field (a larger message: RESOURCE_EXHAUSTED before it is parsed). Prompt
 * length is bounded by the model's context once tokenized. */
#define RT_MAX_REQUEST_BYTES (4u << 20)
#define RT_MAX_REQUEST_ID 256
#define RT_MAX_STOP 16
#define RT_MAX_STOP_BYTES 1024
#define RT_MAX_LOGIT_BIAS 1024
#define RT_MAX_CHAT_MESSAGES 4096

/* Requests that ended, for the planner's SLO attainment (router/planner.h). */
#define RT_DONE_RING 4096
typedef struct rt_done {
    double t, ttft_ms, tpot_ms;
    bool ok;
} rt_done_t;

typedef struct rt_slo_window {
    uint32_t n, met, ttft_missed, tpot_missed; /* failed requests count as missing both */
    double ttft_p90_ms, tpot_p90_ms;
} rt_slo_window_t;

typedef struct rt_held {
    rt_worker_t *d;
    uint64_t id;
    rt_worker_t *p; /* the prefill worker its landing is lent to (NULL: none yet): each renewal extends its lease */
} rt_held_t;

typedef struct router {
    eng_model_t *model;
    eng_chat_t chat;
    bool has_chat;
    rt_table_t table;
    const rt_placement_ops_t *place; /* router.placement */
    td_block_name_t chain_root;      /* of the cluster's block names (common/blockhash.h) */
    rt_kvindex_t *index;             /* the cache index (router/kvindex.h) */
    struct rt_follow *follow;        /* keeps it (router/follow.h) */
    td_etcd_t *etcd;
    td_etcd_watch_t *watch;
    td_config_t cfg; /* the file, then the flags over it; validated */
    td_rpc_tls_t tls_files;  /* the internal planes' mutual TLS (cluster section) */
    const td_rpc_tls_t *tls; /* &tls_files, or NULL under cluster.plaintext */
    uint32_t default_max_tokens;
    struct rt_keys *api_keys, *admin_keys; /* router.api_keys, router.admin_keys (NULL: none) */
    td_pool_t *pool; /* runs the requests' steps that wait (placement, reserve, prefill) */
    pthread_mutex_t mu;
    uint32_t n_active; /* requests started and not ended (at most router.max_streams) */
    struct rt_request *free_reqs; /* ended request objects, kept for reuse (request.c) */
    uint32_t n_reqs;              /* request objects that exist, in use or free */
    uint64_t n_requests, n_errors, n_ok;
    double overhead[RT_OVERHEAD_RING];     /* seconds of router work per request (wall clock) */
    double overhead_cpu[RT_OVERHEAD_RING]; /* the same sections in thread CPU time */
    double handoff[RT_OVERHEAD_RING];      /* seconds its steps waited in the pool's queue */
    size_t n_overhead;
    rt_done_t done[RT_DONE_RING]; /* the last requests that ended (under mu) */
    uint64_t n_done;
    struct rt_planner *planner;
    rt_metrics_t metrics; /* Prometheus (router/metrics.h) */
    /* reservation renewal (held_*: under held_mu) */
    pthread_mutex_t held_mu;
    pthread_cond_t held_cv;
    rt_held_t held[RT_MAX_HELD];
    size_t n_held;
    pthread_t renewer;
    bool renewer_running, renewer_stop;
} router_t;

/* Renders (chat) and tokenizes the input; an error (INVALID_ARGUMENT) names
 * the field in err. */
td_status_t rt_tokenize_input(router_t *r, const char *prompt, const Tandem__V1__ChatInput *chat, bool parse_special,
                              bool add_bos, int32_t **ids, size_t *n, char *err, size_t errcap);
/* Starts renewing reservation id on d; false when the table is full. */
bool rt_held_add(router_t *r, rt_worker_t *d, uint64_t id, rt_worker_t *p);
void rt_held_remove(router_t *r, rt_worker_t *d, uint64_t id);
/* A request ended (ok: it finished), for rt_slo_window. */
void rt_record_done(router_t *r, double ttft_ms, double tpot_ms, bool ok);
/* The requests that ended since `since` (td_now_s() time) held to SLOs of
 * ttft_slo_ms and tpot_slo_ms (0: none). */
void rt_slo_window(router_t *r, double since, double ttft_slo_ms, double tpot_slo_ms, rt_slo_window_t *out);
/* Counts a request (overhead < 0: none measured). */
void rt_count(router_t *r, bool ok, double overhead, double cpu, double handoff);

#endif
