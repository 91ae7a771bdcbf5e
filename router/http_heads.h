/* http_heads.h — the HTTP front door's guard against connections that
 * never finish a request head (slowloris): every connection is tracked
 * from its start, and one still waiting for a complete head (its first, or
 * the next on a kept-alive connection) is closed
 *   - after RT_HEAD_TIMEOUT_S, or RT_HEAD_TIMEOUT_BUSY_S once more than half
 *     of the connections the server takes are open;
 *   - at once, the oldest first, when its client (its address) holds more
 *     than RT_HEADS_PER_CLIENT of them and opens another.
 * So a crowd of half-sent heads cannot fill the server: a legitimate
 * client gets its answer, or a 503 when finished requests fill it.
 *
 * Threads: started/done/waiting/closed are called from libmicrohttpd's
 * thread (its connection callbacks), sweep from any other; the guard locks. */
#ifndef RT_HTTP_HEADS_H
#define RT_HTTP_HEADS_H

#include <microhttpd.h>
#include <stdbool.h>
#include <stdint.h>

#define RT_HEAD_TIMEOUT_S 10.0
#define RT_HEAD_TIMEOUT_BUSY_S 2.0
#define RT_HEADS_PER_CLIENT 256

typedef struct rt_heads rt_heads_t;

/* busy_at: open connections past which the short timeout applies. */
rt_heads_t *rt_heads_create(unsigned busy_at);
void rt_heads_destroy(rt_heads_t *g);
/* A connection opened (MHD_CONNECTION_NOTIFY_STARTED), and closed. */
void rt_heads_started(rt_heads_t *g, struct MHD_Connection *c, void **socket_ctx);
void rt_heads_closed(rt_heads_t *g, void **socket_ctx);
/* Its request head is complete (waiting false), or its request is over and
 * it waits for the next head from now (waiting true). */
void rt_heads_waiting(rt_heads_t *g, struct MHD_Connection *c, bool waiting);
/* Closes the connections past their head deadline; how many. */
unsigned rt_heads_sweep(rt_heads_t *g);
/* Connections closed for a late head, and for their client's limit, so far. */
void rt_heads_counts(rt_heads_t *g, uint64_t *late, uint64_t *crowded);

#endif
