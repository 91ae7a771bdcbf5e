/* choices.h — a Generate request for n choices (sampling.n) behind the
 * interface a transport uses for one: n requests (router/request.h) of the
 * one prompt.
 *
 * The first choice runs at once; the others start when its first token is
 * out, so the prompt's KV is in the prefix caches by then and each computes
 * only what the cache cannot give (its last partial block), as vLLM's
 * parallel sampling shares a prefix. Choice i samples with seed + i when the
 * request gives a seed. Their messages reach the transport's sink one at a
 * time (a sink has one write in flight), each carrying GenerateResponse.index;
 * the sink's end comes once, after every choice has ended: OK, or the first
 * failure, which cancels the other choices. n = 1 is a group of one. */
#ifndef RT_CHOICES_H
#define RT_CHOICES_H

#include <stdbool.h>

#include "router/request.h"

typedef struct rt_choices rt_choices_t;

/* As rt_request_create, for rq's sampling.n choices (rq taken). The sink's
 * emit gets each message with the choice's request, which the transport
 * passes back to nothing: it reports writes with rt_choices_sent. NULL when
 * the router has no room for the first choice or no memory (rq freed). */
rt_choices_t *rt_choices_create(rt_requests_t *rs, Tandem__V1__GenerateRequest *rq, double timeout_s,
                                const rt_sink_t *sink, void *sink_ctx);
/* Before start: the caller's API key, charged by each choice. */
void rt_choices_set_key(rt_choices_t *g, const rt_key_t *key);
void rt_choices_start(rt_choices_t *g);
/* Any thread, until the sink's end: the client went away. */
void rt_choices_cancel(rt_choices_t *g);
/* The sink's write of the last emitted message is done (ok false: failed). */
void rt_choices_sent(rt_choices_t *g, bool ok);

#endif
