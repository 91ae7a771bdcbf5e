/* request.h — one Generate request inside the router, whatever transport
 * brought it (gRPC today, HTTP next).
 *
 * The transport parses its request into a tandem.v1 GenerateRequest, gives
 * it a deadline and a sink, and starts it; the request validates and
 * tokenizes, places itself on a (prefill, decode) pair, reserves, prefills,
 * and relays the decode stream into the sink, resuming elsewhere when a
 * worker fails, until it ends — exactly once — with sink->end. The steps
 * that wait run on the router's pool; the relay runs on the RPC
 * completion-queue threads, so an open stream holds no thread.
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

#include "router/router.h"

typedef struct rt_request rt_request_t;

typedef struct rt_sink {
    td_status_t (*emit)(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m);
    /* retry_after_ms: an early rejection's hint (0: none), for the transport's retry header; rejected: the
     * SLO ("ttft", "tpot") an early rejection was for, NULL for any other end: the transport says it in a
     * rejected-early header, so a client tells a request refused for its SLO from a bad one */
    void (*end)(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected);
} rt_sink_t;

/* A request for rq (taken: freed with the request) that may take timeout_s
 * seconds (capped by rq->deadline_ms and an hour). Request objects come from
 * the router's free list (at most router.max_streams + RT_REQ_SLACK exist;
 * an ended one is kept with its buffers for the next); NULL when none is
 * left or without memory (rq is then freed): the caller refuses the request
 * at admission. Nothing runs until rt_request_start. */
rt_request_t *rt_request_create(router_t *r, Tandem__V1__GenerateRequest *rq, double timeout_s, const rt_sink_t *sink,
                                void *sink_ctx);
/* Frees the free list (at exit, once no request is in flight). */
void rt_request_pool_free(router_t *r);
/* Runs it; it ends through sink->end — on this thread when the router holds
 * router.max_streams requests already (RESOURCE_EXHAUSTED). */
void rt_request_start(rt_request_t *q);
/* Before start: the caller's API key (router/keys.h), charged the most the
 * request may use once it is tokenized, settled at its end. */
struct rt_key;
void rt_request_set_key(rt_request_t *q, const struct rt_key *key);
/* Any thread, until end: the client went away. */
void rt_request_cancel(rt_request_t *q);
/* The sink's write of the last emitted message is done (ok false: failed). */
void rt_request_sent(rt_request_t *q, bool ok);

#endif
