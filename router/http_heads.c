/* http_heads.c — see http_heads.h. */
#define _GNU_SOURCE
#include "router/http_heads.h"

#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/clock.h"
#include "common/log.h"

typedef struct head {
    struct head *prev, *next;
    struct MHD_Connection *c;
    int fd;
    struct sockaddr_storage addr; /* the client's (its port aside) */
    double since;  /* when it began waiting for a head */
    bool waiting;  /* no complete head since then */
    bool closing;  /* shut down by the guard, MHD closes it */
} head_t;

struct rt_heads {
    pthread_mutex_t mu;
    head_t *first;   /* every open connection, oldest first */
    head_t *last;
    unsigned open, busy_at;
    uint64_t late, crowded;
};

rt_heads_t *rt_heads_create(unsigned busy_at)
{
    rt_heads_t *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    pthread_mutex_init(&g->mu, NULL);
    g->busy_at = busy_at;
    return g;
}

void rt_heads_destroy(rt_heads_t *g)
{
    if (!g)
        return;
    while (g->first) { /* the daemon is stopped: its connections are gone */
        head_t *h = g->first;
        g->first = h->next;
        free(h);
    }
    pthread_mutex_destroy(&g->mu);
    free(g);
}

static bool same_client(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                       sizeof(struct in6_addr));
    return false;
}

/* Under mu: ends h's connection (libmicrohttpd sees the end of its stream
 * and closes it; its fd stays open until then, as h is listed until then). */
static void shut(head_t *h)
{
    if (!h->closing && h->fd >= 0)
        shutdown(h->fd, SHUT_RDWR);
    h->closing = true;
}

void rt_heads_started(rt_heads_t *g, struct MHD_Connection *c, void **socket_ctx)
{
    head_t *h = calloc(1, sizeof *h);
    *socket_ctx = h;
    if (!h)
        return;
    h->c = c;
    const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    h->fd = fi ? fi->connect_fd : -1;
    const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ai && ai->client_addr)
        memcpy(&h->addr, ai->client_addr,
               ai->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
    h->since = td_now_s();
    h->waiting = true;
    pthread_mutex_lock(&g->mu);
    h->prev = g->last;
    if (g->last)
        g->last->next = h;
    else
        g->first = h;
    g->last = h;
    g->open++;
    /* its client's waiting heads past the limit: the oldest goes */
    unsigned n = 0;
    head_t *oldest = NULL;
    for (head_t *o = g->first; o; o = o->next)
        if (o->waiting && !o->closing && same_client(&o->addr, &h->addr)) {
            if (!oldest)
                oldest = o;
            n++;
        }
    if (n > RT_HEADS_PER_CLIENT && oldest && oldest != h) {
        shut(oldest);
        g->crowded++;
    }
    pthread_mutex_unlock(&g->mu);
}

void rt_heads_closed(rt_heads_t *g, void **socket_ctx)
{
    head_t *h = *socket_ctx;
    *socket_ctx = NULL;
    if (!h)
        return;
    pthread_mutex_lock(&g->mu);
    if (h->prev)
        h->prev->next = h->next;
    else
        g->first = h->next;
    if (h->next)
        h->next->prev = h->prev;
    else
        g->last = h->prev;
    g->open--;
    pthread_mutex_unlock(&g->mu);
    free(h);
}

static head_t *head_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *i = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return i ? i->socket_context : NULL;
}

void rt_heads_waiting(rt_heads_t *g, struct MHD_Connection *c, bool waiting)
{
    head_t *h = head_of(c);
    if (!h)
        return;
    pthread_mutex_lock(&g->mu);
    h->waiting = waiting;
    if (waiting)
        h->since = td_now_s();
    pthread_mutex_unlock(&g->mu);
}

unsigned rt_heads_sweep(rt_heads_t *g)
{
    unsigned n = 0;
    double now = td_now_s();
    pthread_mutex_lock(&g->mu);
    double limit = g->open > g->busy_at ? RT_HEAD_TIMEOUT_BUSY_S : RT_HEAD_TIMEOUT_S;
    for (head_t *h = g->first; h; h = h->next)
        if (h->waiting && !h->closing && now - h->since > limit) {
            shut(h);
            n++;
        }
    g->late += n;
    pthread_mutex_unlock(&g->mu);
    if (n)
        TD_WARN("http: %u connection%s closed: no complete request head within %.0f s", n, n > 1 ? "s" : "", limit);
    return n;
}

void rt_heads_counts(rt_heads_t *g, uint64_t *late, uint64_t *crowded)
{
    pthread_mutex_lock(&g->mu);
    *late = g->late;
    *crowded = g->crowded;
    pthread_mutex_unlock(&g->mu);
}
