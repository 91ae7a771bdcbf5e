/* http.h — the router's OpenAI-compatible HTTP/1.1 front door
 * (libmicrohttpd), on the same request path as gRPC (router/request.h):
 *
 *   POST /v1/chat/completions, POST /v1/completions   streaming (SSE chunks,
 *        `data: [DONE]`, stream_options.include_usage) or not
 *   GET  /v1/models, GET /health, POST /tokenize, POST /detokenize
 *
 * Errors are OpenAI's shape ({"error": {"message", "type", "param",
 * "code"}}) naming the field; a full router is 429 with Retry-After, no
 * worker 503. A client that disconnects cancels its request. */
#ifndef RT_HTTP_H
#define RT_HTTP_H

#include "common/rpc.h"
#include "router/request.h"

typedef struct rt_http rt_http_t;

/* Serves on listen ("HOST:PORT"; port 0 picks one, *port says which): HTTPS
 * with tls's pair when it has one (the public API's router.tls_*; with its
 * CA, client certificates it signed only, 403 otherwise), plain HTTP when
 * tls is NULL. */
td_status_t rt_http_start(rt_requests_t *rs, const char *listen, const td_rpc_tls_t *tls, rt_http_t **out, int *port);
/* Stops accepting, ends what is open (its requests cancelled) and frees. */
void rt_http_stop(rt_http_t *h);

#endif
