/* request.h — one Generate request inside the router, whatever transport
 * brought it (gRPC today, HTTP next).
 *
 * The transport parses its request into a tandem.v1 GenerateRequest, gives
 * it a deadline and a sink, and starts it; the request validates and
 * tokenizes, then runs attempts — place, reserve, prefill, open_decode,
 * stream — resuming elsewhere when a worker fails, until it ends — exactly
 * once — with sink->end. The steps that wait run on the env's pool; the
 * relay runs on the RPC completion-queue threads, so an open stream holds
 * no thread.
 *
 * The sink: emit sends one response without blocking and reports its write
 * with rt_request_sent (one in flight at a time: a slow client holds the
 * stream back); end is the last call the request makes, on a pool thread,
 * and may block; after end returns the request is gone, so the transport
 * must have stopped calling rt_request_cancel and rt_request_sent by then.
 * The transport calls rt_request_cancel when its client goes away. */
#ifndef RT_REQUEST_H
#define RT_REQUEST_H

#include <stdbool.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/pool.h"
#include "router/input.h"
#include "router/keys.h"
#include "router/metrics.h"
#include "router/placement.h"
#include "router/renewer.h"
#include "router/stats.h"
#include "tandem/v1/tandem.pb-c.h"

/* Request objects beyond max_streams: those created and not yet admitted
 * (a handler thread's worth each). */
#define RT_REQ_SLACK 64

/* What a request uses of the router, filled by the router (or a test) and
 * alive while requests run: the pipeline reaches the rest of the process
 * through nothing else. */
typedef struct rt_env {
    const rt_input_t *input;         /* the model's tokenizer and chat template */
    rt_table_t *table;               /* the workers */
    const rt_placement_ops_t *place; /* router.placement */
    td_block_name_t chain_root;      /* of the cluster's block names (common/blockhash.h) */
    td_pool_t *pool;                 /* runs the steps that wait (placement, reserve, prefill) */
    rt_renewer_t *renewer;           /* renews the reservations requests hold */
    rt_stats_t *stats;               /* counts their ends */
    rt_metrics_t *metrics;           /* Prometheus (NULL: none) */
    rt_keys_t *api_keys;             /* router.api_keys (NULL: none) */
    uint32_t max_streams;            /* router.max_streams */
    uint32_t default_max_tokens;     /* when a request gives none */
    uint32_t ttft_slo_ms, tpot_slo_ms; /* router.ttft_slo_ms, tpot_slo_ms (0: none) */
    bool early_reject;               /* router.early_reject */
    uint32_t admit_max, tenant_queue_max; /* the admission queue's (router/fair.h; admit_max 0: none) */
} rt_env_t;

/* The request objects (a free list, kept with their buffers) and how many
 * requests run. */
typedef struct rt_requests rt_requests_t;

typedef struct rt_request rt_request_t;

typedef struct rt_sink {
    td_status_t (*emit)(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m);
    /* retry_after_ms: an early rejection's hint (0: none), for the transport's retry header; rejected: the
     * SLO ("ttft", "tpot") an early rejection was for, NULL for any other end: the transport says it in a
     * rejected-early header, so a client tells a request refused for its SLO from a bad one */
    void (*end)(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected);
} rt_sink_t;

/* env is copied. */
td_status_t rt_requests_create(const rt_env_t *env, rt_requests_t **out);
/* Frees the objects (at exit, once no request is in flight). */
void rt_requests_destroy(rt_requests_t *rs);
const rt_env_t *rt_requests_env(const rt_requests_t *rs);
/* Requests started and not ended. */
uint32_t rt_requests_active(rt_requests_t *rs);
/* The admission queue's tenants (router/fair.h), for Health. */
json_t *rt_requests_fair_json(rt_requests_t *rs);
/* The output-length predictor's error and counts (router/outlen.h), for Health. */
json_t *rt_requests_outlen_json(rt_requests_t *rs);

/* A request for rq (taken: freed with the request) that may take timeout_s
 * seconds (capped by rq->deadline_ms and an hour). Request objects come from
 * rs's free list (at most max_streams + RT_REQ_SLACK exist; an ended one is
 * kept with its buffers for the next); NULL when none is left or without
 * memory (rq is then freed): the caller refuses the request at admission.
 * Nothing runs until rt_request_start. */
rt_request_t *rt_request_create(rt_requests_t *rs, Tandem__V1__GenerateRequest *rq, double timeout_s,
                                const rt_sink_t *sink, void *sink_ctx);
/* Runs it; it ends through sink->end — on this thread when max_streams
 * requests run already (RESOURCE_EXHAUSTED). */
void rt_request_start(rt_request_t *q);
/* Before start: the caller's API key (router/keys.h), charged the most the
 * request may use once it is tokenized, settled at its end. */
void rt_request_set_key(rt_request_t *q, const rt_key_t *key);
/* Before start: the request is choice `index` of n (router/choices.h): its
 * messages carry the index, and the first choice's placement counts the KV
 * of all n. */
void rt_request_set_choice(rt_request_t *q, uint32_t index, uint32_t n);
/* Any thread, until end: the client went away. */
void rt_request_cancel(rt_request_t *q);
/* The sink's write of the last emitted message is done (ok false: failed). */
void rt_request_sent(rt_request_t *q, bool ok);

#endif
