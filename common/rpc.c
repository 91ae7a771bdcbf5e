/* rpc.c — see rpc.h.
 *
 * How it works: every call (server or client side) owns a completion queue of
 * the "next" kind. Its operations are tagged with small integers (tag_t); one
 * pump (cq_wait) waits for a given tag and records any other completion it
 * sees on the way (the close-on-server notice, wake-ups, a posted read), so a
 * call is driven by one thread with ordinary blocking code. gRPC allows one
 * outstanding batch per operation type, which this shape keeps naturally.
 *
 * The server's own completion queue only carries "a call arrived" events: for
 * every registered method a few requests stay posted, each with the queue its
 * call will be bound to, and each arrival is re-armed and handed to a new
 * detached thread. Unknown methods are answered UNIMPLEMENTED the same way. */
#define _GNU_SOURCE
#include "common/rpc.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"

#define MAX_METHODS 16
#define POSTED_PER_METHOD 4
#define MAX_MESSAGE (64 << 20)

typedef enum tag { TAG_SEND = 1, TAG_RECV, TAG_STATUS, TAG_CLOSE, TAG_WAKE, TAG_FINISH, TAG_COUNT } tag_t;

typedef struct cq_pump {
    grpc_completion_queue *cq;
    unsigned done, ok; /* bit per tag */
    unsigned wakes;
} cq_pump_t;

static gpr_timespec deadline_in(double s)
{
    if (!(s < 1e8))
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (s < 0)
        s = 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros((int64_t)(s * 1e6), GPR_TIMESPAN));
}

static void cq_record(cq_pump_t *p, grpc_event ev)
{
    tag_t got = (tag_t)(intptr_t)ev.tag;
    if (got == TAG_WAKE) {
        p->wakes++;
        return;
    }
    p->done |= 1u << got;
    if (ev.success)
        p->ok |= 1u << got;
    else
        p->ok &= ~(1u << got);
}

/* Waits for tag t: 1 when it completed well, -1 when it failed, 0 at the deadline. */
static int cq_wait(cq_pump_t *p, tag_t t, gpr_timespec deadline)
{
    unsigned bit = 1u << t;
    while (!(p->done & bit)) {
        grpc_event ev = grpc_completion_queue_next(p->cq, deadline, NULL);
        if (ev.type == GRPC_QUEUE_TIMEOUT)
            return 0;
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return -1;
        cq_record(p, ev);
    }
    p->done &= ~bit;
    return (p->ok & bit) ? 1 : -1;
}

static void cq_destroy(grpc_completion_queue *cq)
{
    if (!cq)
        return;
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type != GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
}

static uint8_t *buffer_copy(grpc_byte_buffer *bb, size_t *len)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return NULL;
    grpc_slice all = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    size_t n = GRPC_SLICE_LENGTH(all);
    uint8_t *out = malloc(n ? n : 1);
    if (out)
        memcpy(out, GRPC_SLICE_START_PTR(all), n);
    grpc_slice_unref(all);
    *len = n;
    return out;
}

/* The message into *buf (capacity *cap, grown when short: no allocation
 * once it is large enough); false without memory. */
static bool buffer_into(grpc_byte_buffer *bb, uint8_t **buf, size_t *cap, size_t *len)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return false;
    bool ok = td_grow((void **)buf, cap, grpc_byte_buffer_length(bb), 1, 256);
    size_t off = 0;
    grpc_slice s;
    while (ok && grpc_byte_buffer_reader_next(&r, &s)) {
        size_t k = GRPC_SLICE_LENGTH(s);
        if ((ok = td_grow((void **)buf, cap, off + k, 1, 256)))
            memcpy(*buf + off, GRPC_SLICE_START_PTR(s), k);
        off += k;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&r);
    *len = off;
    return ok;
}

static grpc_byte_buffer *buffer_of(const void *msg, size_t len)
{
    grpc_slice s = grpc_slice_from_copied_buffer(msg, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

void td_rpc_init(void) { grpc_init(); }
void td_rpc_shutdown(void) { grpc_shutdown(); }

int td_rpc_code_of(td_status_t st)
{
    switch (st) {
    case TD_OK: return TD_RPC_OK;
    case TD_ERR_INVALID_ARG: case TD_ERR_FORMAT: case TD_ERR_OUT_OF_RANGE: return TD_RPC_INVALID_ARGUMENT;
    case TD_ERR_NOT_FOUND: return TD_RPC_NOT_FOUND;
    case TD_ERR_TIMEOUT: return TD_RPC_DEADLINE_EXCEEDED;
    case TD_ERR_CANCELLED: return TD_RPC_CANCELLED;
    case TD_ERR_UNAVAILABLE: return TD_RPC_UNAVAILABLE;
    case TD_ERR_EXHAUSTED: case TD_ERR_NO_MEMORY: return TD_RPC_RESOURCE_EXHAUSTED;
    case TD_ERR_UNSUPPORTED: return TD_RPC_UNIMPLEMENTED;
    case TD_ERR_CONFIG: return TD_RPC_FAILED_PRECONDITION;
    default: return TD_RPC_INTERNAL;
    }
}

td_status_t td_rpc_status_of(int code)
{
    switch (code) {
    case TD_RPC_OK: return TD_OK;
    case TD_RPC_INVALID_ARGUMENT: return TD_ERR_INVALID_ARG;
    case TD_RPC_NOT_FOUND: return TD_ERR_NOT_FOUND;
    case TD_RPC_DEADLINE_EXCEEDED: return TD_ERR_TIMEOUT;
    case TD_RPC_CANCELLED: return TD_ERR_CANCELLED;
    case TD_RPC_UNAVAILABLE: return TD_ERR_UNAVAILABLE;
    case TD_RPC_RESOURCE_EXHAUSTED: return TD_ERR_EXHAUSTED;
    case TD_RPC_UNIMPLEMENTED: return TD_ERR_UNSUPPORTED;
    case TD_RPC_FAILED_PRECONDITION: return TD_ERR_CONFIG;
    default: return TD_ERR_INTERNAL;
    }
}

const char *td_rpc_code_name(int code)
{
    static const char *const n[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                    "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                    "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
    return code >= 0 && code < 17 ? n[code] : "?";
}

static char *read_pem(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = '\0';
    fclose(f);
    return s;
}

typedef struct pems {
    char *ca, *cert, *key;
} pems_t;

static void pems_free(pems_t *p)
{
    free(p->ca);
    free(p->cert);
    free(p->key);
}

static td_status_t pems_load(const td_rpc_tls_t *tls, pems_t *p)
{
    memset(p, 0, sizeof *p);
    const char *paths[3] = {tls->ca_file, tls->cert_file, tls->key_file};
    char **dst[3] = {&p->ca, &p->cert, &p->key};
    for (int i = 0; i < 3; i++)
        if (paths[i] && paths[i][0] && !(*dst[i] = read_pem(paths[i]))) {
            pems_free(p);
            return td_error(TD_ERR_IO, "tls: cannot read %s", paths[i]);
        }
    if (!p->cert != !p->key) {
        pems_free(p);
        return td_error(TD_ERR_CONFIG, "tls: cert_file and key_file go together (one of them is missing)");
    }
    return TD_OK;
}

static bool tls_on(const td_rpc_tls_t *tls)
{
    return tls && ((tls->ca_file && tls->ca_file[0]) || (tls->cert_file && tls->cert_file[0]));
}

/* ------------------------------------------------------------------ server */

typedef struct method {
    char name[128];
    td_rpc_handler_fn fn;
    void *ctx;
    void *handle;
} method_t;

typedef struct posted {
    struct td_rpc_server *srv;
    int method; /* -1: the unimplemented catch-all */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
    grpc_completion_queue *call_cq;
} posted_t;

struct td_rpc_server {
    grpc_server *srv;
    grpc_completion_queue *cq;
    char addr[256];
    bool tls;
    pems_t pems;
    method_t methods[MAX_METHODS];
    int n_methods;
    pthread_t thread;
    bool started, stopping, shut;
    bool abandoned; /* stop gave up waiting for handlers: destroy leaves it */
    int max_active; /* calls handled at once, past which new ones are refused (0: no limit) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int active;
};

struct td_rpc_call {
    td_rpc_server_t *srv;
    method_t *m;
    grpc_call *call;
    cq_pump_t pump;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload_bb;
    uint8_t *payload;
    size_t payload_len;
    int cancelled_flag; /* written by gRPC when TAG_CLOSE completes */
    bool closed, md_sent, finished;
    grpc_byte_buffer *send_bb; /* the message in flight (one at a time), freed when it settles */
    char *peer;
    pthread_mutex_t wake_mu;
    unsigned wakes_seen;
};

static void server_post(td_rpc_server_t *s, int method)
{
    posted_t *p = calloc(1, sizeof *p);
    if (!p)
        return;
    p->srv = s;
    p->method = method;
    p->call_cq = grpc_completion_queue_create_for_next(NULL);
    grpc_metadata_array_init(&p->md);
    grpc_call_error e;
    if (method >= 0) {
        e = grpc_server_request_registered_call(s->srv, s->methods[method].handle, &p->call, &p->deadline, &p->md,
                                                &p->payload, p->call_cq, s->cq, p);
    } else {
        grpc_call_details_init(&p->details);
        e = grpc_server_request_call(s->srv, &p->call, &p->details, &p->md, p->call_cq, s->cq, p);
    }
    if (e != GRPC_CALL_OK) {
        TD_WARN("rpc: cannot post a request for %s: error %d", method >= 0 ? s->methods[method].name : "*", e);
        grpc_metadata_array_destroy(&p->md);
        if (method < 0)
            grpc_call_details_destroy(&p->details);
        cq_destroy(p->call_cq);
        free(p);
    }
}

static void call_start(td_rpc_call_t *c)
{
    grpc_op op = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
    op.data.recv_close_on_server.cancelled = &c->cancelled_flag;
    grpc_call_start_batch(c->call, &op, 1, (void *)(intptr_t)TAG_CLOSE, NULL);
}

static void call_end(td_rpc_call_t *c)
{
    if (!c->finished)
        td_rpc_call_finish(c, TD_RPC_INTERNAL, "the handler ended without a status");
    if (!c->closed && cq_wait(&c->pump, TAG_CLOSE, deadline_in(5)) == 0) {
        grpc_call_cancel(c->call, NULL);
        cq_wait(&c->pump, TAG_CLOSE, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    }
    pthread_mutex_lock(&c->wake_mu);
    grpc_call_unref(c->call);
    c->call = NULL;
    pthread_mutex_unlock(&c->wake_mu);
    cq_destroy(c->pump.cq);
    grpc_metadata_array_destroy(&c->md);
    if (c->payload_bb)
        grpc_byte_buffer_destroy(c->payload_bb);
    free(c->payload);
    if (c->peer)
        gpr_free(c->peer);
    pthread_mutex_destroy(&c->wake_mu);
    td_rpc_server_t *s = c->srv;
    free(c);
    pthread_mutex_lock(&s->mu);
    s->active--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void *call_thread(void *arg)
{
    td_rpc_call_t *c = arg;
    if (c->m)
        c->m->fn(c->m->ctx, c);
    else
        td_rpc_call_finish(c, TD_RPC_UNIMPLEMENTED, "no such method");
    call_end(c);
    return NULL;
}

static void *server_thread(void *arg)
{
    td_rpc_server_t *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        if (ev.tag == (void *)s) { /* the server's shutdown is complete */
            pthread_mutex_lock(&s->mu);
            s->shut = true;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        posted_t *p = ev.tag;
        if (!ev.success) { /* the server is shutting down */
            grpc_metadata_array_destroy(&p->md);
            if (p->method < 0)
                grpc_call_details_destroy(&p->details);
            cq_destroy(p->call_cq);
            free(p);
            continue;
        }
        td_rpc_call_t *c = calloc(1, sizeof *c);
        pthread_mutex_lock(&s->mu);
        bool stopping = s->stopping;
        if (c)
            s->active++;
        bool over = s->max_active && s->active > s->max_active;
        pthread_mutex_unlock(&s->mu);
        if (!stopping)
            server_post(s, p->method);
        if (!c) {
            grpc_call_cancel(p->call, NULL);
            grpc_call_unref(p->call);
            cq_destroy(p->call_cq);
            grpc_metadata_array_destroy(&p->md);
            free(p);
            continue;
        }
        c->srv = s;
        c->m = p->method >= 0 ? &s->methods[p->method] : NULL;
        c->call = p->call;
        c->pump.cq = p->call_cq;
        c->deadline = p->deadline;
        c->md = p->md;
        c->payload_bb = p->payload;
        c->peer = grpc_call_get_peer(c->call);
        pthread_mutex_init(&c->wake_mu, NULL);
        if (c->payload_bb)
            c->payload = buffer_copy(c->payload_bb, &c->payload_len);
        if (p->method < 0)
            grpc_call_details_destroy(&p->details);
        free(p);
        call_start(c);
        if (over && c->m) { /* admission: refused now, not queued */
            td_rpc_call_finish(c, TD_RPC_RESOURCE_EXHAUSTED, "the server handles %d calls at once, its most; "
                               "try again later", s->max_active);
            call_end(c);
            continue;
        }
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, call_thread, c) != 0) {
            TD_WARN("rpc: cannot start a handler thread; answering UNAVAILABLE");
            td_rpc_call_finish(c, TD_RPC_UNAVAILABLE, "the server cannot start a thread");
            call_end(c);
        }
        pthread_attr_destroy(&attr);
    }
    return NULL;
}

td_status_t td_rpc_server_create(const char *addr, const td_rpc_tls_t *tls, td_rpc_server_t **out)
{
    td_rpc_server_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    snprintf(s->addr, sizeof s->addr, "%s", addr);
    if (tls_on(tls)) {
        td_status_t rc = pems_load(tls, &s->pems);
        if (rc) {
            free(s);
            return rc;
        }
        if (!s->pems.cert) {
            pems_free(&s->pems);
            free(s);
            return td_error(TD_ERR_CONFIG, "tls: a server needs cert_file and key_file");
        }
        s->tls = true;
    }
    grpc_arg args[2] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = MAX_MESSAGE},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0},
    };
    grpc_channel_args ca = {2, args};
    s->srv = grpc_server_create(&ca, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(s->srv, s->cq, NULL);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    *out = s;
    return TD_OK;
}

td_status_t td_rpc_server_add(td_rpc_server_t *s, const char *method, td_rpc_handler_fn fn, void *ctx)
{
    if (s->started || s->n_methods == MAX_METHODS)
        return td_error(TD_ERR_INTERNAL, "rpc: cannot register %s (started, or %d methods already)", method,
                        MAX_METHODS);
    method_t *m = &s->methods[s->n_methods];
    snprintf(m->name, sizeof m->name, "%s", method);
    m->fn = fn;
    m->ctx = ctx;
    m->handle = grpc_server_register_method(s->srv, m->name, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle)
        return td_error(TD_ERR_INTERNAL, "rpc: gRPC refused to register %s", method);
    s->n_methods++;
    return TD_OK;
}

td_status_t td_rpc_server_start(td_rpc_server_t *s, int *port)
{
    grpc_server_credentials *cr;
    if (s->tls) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = s->pems.key, .cert_chain = s->pems.cert};
        cr = grpc_ssl_server_credentials_create_ex(
            s->pems.ca, &pair, 1,
            s->pems.ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
    } else {
        cr = grpc_insecure_server_credentials_create();
    }
    int p = grpc_server_add_http2_port(s->srv, s->addr, cr);
    grpc_server_credentials_release(cr);
    if (p <= 0)
        return td_error(TD_ERR_UNAVAILABLE, "rpc: cannot listen on %s (in use, or not an address of this host)",
                        s->addr);
    grpc_server_start(s->srv);
    for (int i = 0; i < s->n_methods; i++)
        for (int k = 0; k < POSTED_PER_METHOD; k++)
            server_post(s, i);
    server_post(s, -1);
    if (pthread_create(&s->thread, NULL, server_thread, s) != 0)
        return td_error(TD_ERR_INTERNAL, "rpc: cannot start the server thread");
    s->started = true;
    if (port)
        *port = p;
    return TD_OK;
}

void td_rpc_server_set_max_calls(td_rpc_server_t *s, int max) { s->max_active = max > 0 ? max : 0; }

int td_rpc_server_active(td_rpc_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->active;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void td_rpc_server_stop(td_rpc_server_t *s, double grace_s)
{
    if (!s || !s->started)
        return;
    pthread_mutex_lock(&s->mu);
    bool was = s->stopping;
    s->stopping = true;
    pthread_mutex_unlock(&s->mu);
    if (was)
        return;
    grpc_server_shutdown_and_notify(s->srv, s->cq, s);
    struct timespec until = td_wall_deadline(grace_s);
    pthread_mutex_lock(&s->mu);
    while (s->active > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0)
        ;
    pthread_mutex_unlock(&s->mu);
    grpc_server_cancel_all_calls(s->srv);
    /* cancelled handlers end within their own waits' deadlines; one that does
     * not in 10 s is left behind (logged) rather than waited on forever */
    until = td_wall_deadline(10);
    int e = 0;
    pthread_mutex_lock(&s->mu);
    while ((s->active > 0 || !s->shut) && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    int left = s->active;
    bool shut = s->shut;
    pthread_mutex_unlock(&s->mu);
    if (left > 0 || !shut) {
        TD_WARN("rpc: %d handler(s) did not end within 10 s of being cancelled; the server is left running",
                left);
        s->abandoned = true;
        return;
    }
    grpc_completion_queue_shutdown(s->cq);
    pthread_join(s->thread, NULL);
    s->started = false;
}

void td_rpc_advertise_addr(const char *listen, int port, char *out, size_t cap)
{
    char host[128];
    snprintf(host, sizeof host, "%s", listen ? listen : "");
    char *colon = strrchr(host, ':');
    if (colon)
        *colon = 0;
    if (host[0] == '[') { /* [v6] */
        memmove(host, host + 1, strlen(host));
        char *b = strchr(host, ']');
        if (b)
            *b = 0;
    }
    if (!host[0] || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "*")) {
        snprintf(host, sizeof host, "127.0.0.1");
        struct ifaddrs *ifs = NULL;
        if (getifaddrs(&ifs) == 0) {
            for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
                if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) &&
                    !(i->ifa_flags & IFF_LOOPBACK)) {
                    inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, host, sizeof host);
                    break;
                }
            freeifaddrs(ifs);
        }
    }
    snprintf(out, cap, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

void td_rpc_server_destroy(td_rpc_server_t *s)
{
    if (!s)
        return;
    if (s->started)
        td_rpc_server_stop(s, 0);
    if (s->abandoned) /* handlers still hold it (td_rpc_server_stop said so): the process is ending */
        return;
    else if (s->srv && !s->stopping) { /* created, never started */
        grpc_server_shutdown_and_notify(s->srv, s->cq, s);
        grpc_server_cancel_all_calls(s->srv);
        grpc_completion_queue_shutdown(s->cq);
        while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
    }
    grpc_server_destroy(s->srv);
    grpc_completion_queue_destroy(s->cq);
    pems_free(&s->pems);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

const uint8_t *td_rpc_call_payload(td_rpc_call_t *c, size_t *len)
{
    *len = c->payload_len;
    return c->payload;
}

const char *td_rpc_call_method(td_rpc_call_t *c) { return c->m ? c->m->name : "?"; }
const char *td_rpc_call_peer(td_rpc_call_t *c) { return c->peer ? c->peer : "?"; }

double td_rpc_call_time_left(td_rpc_call_t *c)
{
    gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0)
        return 1e9;
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (double)left.tv_sec + left.tv_nsec * 1e-9;
}

static void call_poll(td_rpc_call_t *c)
{
    if (!c->closed && cq_wait(&c->pump, TAG_CLOSE, gpr_inf_past(GPR_CLOCK_MONOTONIC)) != 0)
        c->closed = true;
}

bool td_rpc_call_cancelled(td_rpc_call_t *c)
{
    call_poll(c);
    return c->closed && c->cancelled_flag;
}

/* Waits for the message in flight to be written (or the call to fail): 1
 * written, -1 not. The write waits on the client's flow control; a client
 * that is gone ends it. */
static int send_settle(td_rpc_call_t *c)
{
    if (!c->send_bb)
        return 1;
    int r;
    while ((r = cq_wait(&c->pump, TAG_SEND, deadline_in(1))) == 0)
        if (td_rpc_call_cancelled(c)) /* the write waits on a client that is gone */
            grpc_call_cancel(c->call, NULL);
    grpc_byte_buffer_destroy(c->send_bb);
    c->send_bb = NULL;
    return r;
}

/* Sends without waiting for the write: the caller goes on (say, to read the
 * next message from upstream) while gRPC writes; the next send or the finish
 * waits for this one first, so flow control still holds the sender back. */
td_status_t td_rpc_call_send(td_rpc_call_t *c, const void *msg, size_t len)
{
    if (td_rpc_call_cancelled(c) || send_settle(c) != 1)
        return TD_ERR_CANCELLED;
    grpc_op ops[2];
    int n = 0;
    memset(ops, 0, sizeof ops);
    if (!c->md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->md_sent = true;
    }
    grpc_byte_buffer *bb = buffer_of(msg, len);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = bb;
    if (grpc_call_start_batch(c->call, ops, (size_t)n, (void *)(intptr_t)TAG_SEND, NULL) != GRPC_CALL_OK) {
        grpc_byte_buffer_destroy(bb);
        return TD_ERR_CANCELLED;
    }
    c->send_bb = bb;
    return TD_OK;
}

td_status_t td_rpc_call_wait(td_rpc_call_t *c, double timeout_s)
{
    gpr_timespec dl = deadline_in(timeout_s);
    for (;;) {
        if (c->pump.wakes != c->wakes_seen) {
            c->wakes_seen = c->pump.wakes;
            return TD_OK;
        }
        if (c->closed || (c->pump.done & (1u << TAG_CLOSE))) {
            c->closed = true;
            if (c->cancelled_flag)
                return TD_ERR_CANCELLED;
        }
        grpc_event ev = grpc_completion_queue_next(c->pump.cq, dl, NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            return TD_ERR_TIMEOUT;
        cq_record(&c->pump, ev);
    }
}

void td_rpc_call_wake(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->wake_mu);
    if (c->call)
        grpc_call_start_batch(c->call, NULL, 0, (void *)(intptr_t)TAG_WAKE, NULL);
    pthread_mutex_unlock(&c->wake_mu);
}

static void call_status(td_rpc_call_t *c, int code, const char *msg, const void *reply, size_t reply_len)
{
    if (c->finished)
        return;
    c->finished = true;
    send_settle(c);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!c->md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->md_sent = true;
    }
    grpc_byte_buffer *bb = NULL;
    if (reply) {
        bb = buffer_of(reply, reply_len);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = bb;
    }
    grpc_slice details = grpc_slice_from_copied_string(msg ? msg : "");
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n++].data.send_status_from_server.status_details = &details;
    if (grpc_call_start_batch(c->call, ops, (size_t)n, (void *)(intptr_t)TAG_FINISH, NULL) == GRPC_CALL_OK &&
        cq_wait(&c->pump, TAG_FINISH, deadline_in(5)) == 0) {
        grpc_call_cancel(c->call, NULL);
        cq_wait(&c->pump, TAG_FINISH, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    }
    grpc_slice_unref(details);
    if (bb)
        grpc_byte_buffer_destroy(bb);
}

void td_rpc_call_finish(td_rpc_call_t *c, int code, const char *fmt, ...)
{
    char msg[1024] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
    }
    call_status(c, code, msg, NULL, 0);
}

void td_rpc_call_reply(td_rpc_call_t *c, const void *msg, size_t len)
{
    call_status(c, TD_RPC_OK, "", msg ? msg : "", len);
}

/* ------------------------------------------------------------------ client */

/* calls: the client calls in flight on this channel (under mu), so that
 * td_rpc_channel_shutdown can end them; closed: no new call starts. */
struct td_rpc_channel {
    grpc_channel *ch;
    char target[256];
    pthread_mutex_t mu;
    grpc_call **calls;
    size_t n_calls, cap_calls;
    bool closed;
};

#define SHUTDOWN_MSG "the peer left the cluster; the call was ended by the caller"

/* Registers a new call; false (and the call cancelled) when the channel is closed or out of memory. */
static bool channel_track(td_rpc_channel_t *ch, grpc_call *call)
{
    pthread_mutex_lock(&ch->mu);
    bool ok = !ch->closed;
    if (ok && ch->n_calls == ch->cap_calls) {
        size_t nc = ch->cap_calls ? 2 * ch->cap_calls : 16;
        grpc_call **c = realloc(ch->calls, nc * sizeof *c);
        if (c) {
            ch->calls = c;
            ch->cap_calls = nc;
        }
        ok = c != NULL;
    }
    if (ok)
        ch->calls[ch->n_calls++] = call;
    else
        grpc_call_cancel_with_status(call, GRPC_STATUS_UNAVAILABLE,
                                     ch->closed ? SHUTDOWN_MSG : "no memory to track the call", NULL);
    pthread_mutex_unlock(&ch->mu);
    return ok;
}

static void channel_untrack(td_rpc_channel_t *ch, grpc_call *call)
{
    pthread_mutex_lock(&ch->mu);
    for (size_t i = 0; i < ch->n_calls; i++)
        if (ch->calls[i] == call) {
            ch->calls[i] = ch->calls[--ch->n_calls];
            break;
        }
    pthread_mutex_unlock(&ch->mu);
}

void td_rpc_channel_shutdown(td_rpc_channel_t *ch)
{
    if (!ch)
        return;
    pthread_mutex_lock(&ch->mu);
    ch->closed = true;
    for (size_t i = 0; i < ch->n_calls; i++)
        grpc_call_cancel_with_status(ch->calls[i], GRPC_STATUS_UNAVAILABLE, SHUTDOWN_MSG, NULL);
    pthread_mutex_unlock(&ch->mu);
}

struct td_rpc_stream {
    td_rpc_channel_t *ch;
    grpc_call *call;
    cq_pump_t pump;
    grpc_metadata_array md_initial, md_trailing;
    grpc_status_code code;
    grpc_slice details;
    char *error_string;
    grpc_byte_buffer *recv;
    grpc_byte_buffer *send_bb; /* the request in flight after open, freed at destroy */
    bool md_sent, recv_posted, got_initial, status_done, ended;
    uint8_t *msg;   /* the last message read, reused (grown, never shrunk) */
    size_t msg_cap;
};

td_status_t td_rpc_channel_create(const char *target, const td_rpc_tls_t *tls, td_rpc_channel_t **out)
{
    td_rpc_channel_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    snprintf(c->target, sizeof c->target, "%s", target);
    grpc_channel_credentials *cr;
    if (tls_on(tls)) {
        pems_t p;
        td_status_t rc = pems_load(tls, &p);
        if (rc) {
            free(c);
            return rc;
        }
        grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
        cr = grpc_ssl_credentials_create(p.ca, p.cert ? &pair : NULL, NULL, NULL);
        pems_free(&p);
    } else {
        cr = grpc_insecure_credentials_create();
    }
    grpc_arg args[4] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = MAX_MESSAGE},
        /* reconnect fast after a peer restarts (the defaults back off to minutes);
         * calls wait for the connection (WAIT_FOR_READY) up to their deadline:
         * fail-fast calls to a peer that was down once never saw it come back */
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, .value.integer = 1000},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, .value.integer = 100},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, .value.integer = 1000},
    };
    grpc_channel_args ca = {4, args};
    pthread_mutex_init(&c->mu, NULL);
    c->ch = grpc_channel_create(target, cr, &ca);
    grpc_channel_credentials_release(cr);
    if (!c->ch) {
        free(c);
        return td_error(TD_ERR_INVALID_ARG, "rpc: cannot make a channel to '%s'", target);
    }
    *out = c;
    return TD_OK;
}

void td_rpc_channel_destroy(td_rpc_channel_t *ch)
{
    if (!ch)
        return;
    grpc_channel_destroy(ch->ch);
    pthread_mutex_destroy(&ch->mu);
    free(ch->calls);
    free(ch);
}

const char *td_rpc_channel_target(const td_rpc_channel_t *ch) { return ch->target; }

static grpc_call *client_call(td_rpc_channel_t *ch, const char *method, double timeout_s, td_rpc_call_t *parent,
                              grpc_completion_queue *cq)
{
    grpc_slice m = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, parent ? parent->call : NULL, GRPC_PROPAGATE_DEFAULTS, cq, m,
                                               NULL, deadline_in(timeout_s), NULL);
    grpc_slice_unref(m);
    return call;
}

static void result_set(td_rpc_result_t *res, grpc_status_code code, grpc_slice details, const char *fallback)
{
    if (!res)
        return;
    res->code = (int)code;
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof res->message)
        n = sizeof res->message - 1;
    memcpy(res->message, GRPC_SLICE_START_PTR(details), n);
    res->message[n] = '\0';
    if (!n && fallback)
        snprintf(res->message, sizeof res->message, "%s", fallback);
}

/* A call that ran out of time without ever having a connection says so:
 * the bare "Deadline Exceeded" hides a wrong address, a server that is down
 * or a TLS mismatch (a handshake that fails leaves the channel failing). */
static void explain_unconnected(td_rpc_channel_t *ch, td_rpc_result_t *res)
{
    if (!res || res->code != GRPC_STATUS_DEADLINE_EXCEEDED)
        return;
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(ch->ch, 0);
    if (s == GRPC_CHANNEL_READY || s == GRPC_CHANNEL_IDLE)
        return;
    size_t n = strlen(res->message);
    snprintf(res->message + n, sizeof res->message - n,
             " (no connection to %s was made: the server is down, the address is wrong, or TLS does not match)",
             ch->target);
}

td_status_t td_rpc_unary(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                         double timeout_s, td_rpc_call_t *parent, uint8_t **resp, size_t *resp_len,
                         td_rpc_result_t *res)
{
    cq_pump_t pump = {.cq = grpc_completion_queue_create_for_next(NULL)};
    grpc_call *call = client_call(ch, method, timeout_s, parent, pump.cq);
    grpc_metadata_array mi, mt;
    grpc_metadata_array_init(&mi);
    grpc_metadata_array_init(&mt);
    grpc_byte_buffer *out = buffer_of(req, req_len), *in = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *err_str = NULL;
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = out;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &mi;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &in;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &mt;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    ops[5].data.recv_status_on_client.error_string = &err_str;
    td_status_t rc = TD_OK;
    channel_track(ch, call); /* a closed channel cancels it: the batch ends at once */
    if (grpc_call_start_batch(call, ops, 6, (void *)(intptr_t)TAG_STATUS, NULL) != GRPC_CALL_OK) {
        code = GRPC_STATUS_INTERNAL;
        rc = TD_ERR_INTERNAL;
    } else {
        cq_wait(&pump, TAG_STATUS, gpr_inf_future(GPR_CLOCK_MONOTONIC)); /* the call's deadline bounds it */
    }
    channel_untrack(ch, call);
    result_set(res, code, details, err_str);
    explain_unconnected(ch, res);
    if (!rc && code == GRPC_STATUS_OK && in) {
        *resp = buffer_copy(in, resp_len);
        if (!*resp)
            rc = TD_ERR_NO_MEMORY;
    } else if (!rc) {
        rc = code == GRPC_STATUS_OK ? TD_ERR_FORMAT : td_rpc_status_of(code);
        if (code == GRPC_STATUS_OK && res)
            snprintf(res->message, sizeof res->message, "the reply had no message");
    }
    if (in)
        grpc_byte_buffer_destroy(in);
    grpc_byte_buffer_destroy(out);
    grpc_slice_unref(details);
    if (err_str)
        gpr_free((void *)err_str);
    grpc_metadata_array_destroy(&mi);
    grpc_metadata_array_destroy(&mt);
    grpc_call_unref(call);
    cq_destroy(pump.cq);
    return rc;
}

td_status_t td_rpc_stream_open(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                               double timeout_s, td_rpc_call_t *parent, td_rpc_stream_t **out)
{
    td_rpc_stream_t *st = calloc(1, sizeof *st);
    if (!st)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    st->ch = ch;
    st->pump.cq = grpc_completion_queue_create_for_next(NULL);
    st->call = client_call(ch, method, timeout_s, parent, st->pump.cq);
    channel_track(ch, st->call);
    grpc_metadata_array_init(&st->md_initial);
    grpc_metadata_array_init(&st->md_trailing);
    st->details = grpc_empty_slice();
    grpc_op op = {.op = GRPC_OP_RECV_STATUS_ON_CLIENT};
    op.data.recv_status_on_client.trailing_metadata = &st->md_trailing;
    op.data.recv_status_on_client.status = &st->code;
    op.data.recv_status_on_client.status_details = &st->details;
    op.data.recv_status_on_client.error_string = (const char **)&st->error_string;
    grpc_call_start_batch(st->call, &op, 1, (void *)(intptr_t)TAG_STATUS, NULL);
    if (req) {
        grpc_byte_buffer *bb = buffer_of(req, req_len);
        grpc_op ops[3];
        memset(ops, 0, sizeof ops);
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
        ops[1].op = GRPC_OP_SEND_MESSAGE;
        ops[1].data.send_message.send_message = bb;
        ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        st->md_sent = true;
        /* not waited for: the first read waits for the reply anyway, and the
         * buffer lives until destroy (after the call has ended) */
        if (grpc_call_start_batch(st->call, ops, 3, (void *)(intptr_t)TAG_SEND, NULL) == GRPC_CALL_OK)
            st->send_bb = bb;
        else
            grpc_byte_buffer_destroy(bb);
    }
    *out = st;
    return TD_OK;
}

td_status_t td_rpc_stream_write(td_rpc_stream_t *st, const void *msg, size_t len, double timeout_s)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!st->md_sent) {
        ops[n].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        st->md_sent = true;
    }
    grpc_byte_buffer *bb = buffer_of(msg, len);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = bb;
    int r = -1;
    if (grpc_call_start_batch(st->call, ops, (size_t)n, (void *)(intptr_t)TAG_SEND, NULL) == GRPC_CALL_OK) {
        r = cq_wait(&st->pump, TAG_SEND, deadline_in(timeout_s));
        if (r == 0) {
            grpc_call_cancel(st->call, NULL);
            cq_wait(&st->pump, TAG_SEND, gpr_inf_future(GPR_CLOCK_MONOTONIC));
        }
    }
    grpc_byte_buffer_destroy(bb);
    return r == 1 ? TD_OK : r == 0 ? TD_ERR_TIMEOUT : TD_ERR_UNAVAILABLE;
}

td_status_t td_rpc_stream_read(td_rpc_stream_t *st, const uint8_t **msg, size_t *len, double wait_s)
{
    if (st->ended)
        return TD_ERR_NOT_FOUND;
    if (!st->recv_posted) {
        grpc_op ops[2];
        memset(ops, 0, sizeof ops);
        int n = 0;
        if (!st->got_initial) {
            ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
            ops[n++].data.recv_initial_metadata.recv_initial_metadata = &st->md_initial;
            st->got_initial = true;
        }
        ops[n].op = GRPC_OP_RECV_MESSAGE;
        ops[n++].data.recv_message.recv_message = &st->recv;
        if (grpc_call_start_batch(st->call, ops, (size_t)n, (void *)(intptr_t)TAG_RECV, NULL) != GRPC_CALL_OK) {
            st->ended = true;
            return TD_ERR_NOT_FOUND;
        }
        st->recv_posted = true;
    }
    int r = cq_wait(&st->pump, TAG_RECV, deadline_in(wait_s));
    if (r == 0)
        return TD_ERR_TIMEOUT;
    st->recv_posted = false;
    if (r < 0 || !st->recv) {
        st->ended = true;
        return TD_ERR_NOT_FOUND;
    }
    bool ok = buffer_into(st->recv, &st->msg, &st->msg_cap, len);
    grpc_byte_buffer_destroy(st->recv);
    st->recv = NULL;
    *msg = st->msg;
    return ok ? TD_OK : TD_ERR_NO_MEMORY;
}

td_status_t td_rpc_stream_result(td_rpc_stream_t *st, double wait_s, td_rpc_result_t *res)
{
    if (!st->status_done) {
        int r = cq_wait(&st->pump, TAG_STATUS, deadline_in(wait_s));
        if (r == 0)
            return TD_ERR_TIMEOUT;
        st->status_done = true;
    }
    result_set(res, st->code, st->details, st->error_string);
    explain_unconnected(st->ch, res);
    return td_rpc_status_of(st->code);
}

void td_rpc_stream_cancel(td_rpc_stream_t *st) { grpc_call_cancel(st->call, NULL); }

void td_rpc_stream_destroy(td_rpc_stream_t *st)
{
    if (!st)
        return;
    if (!st->status_done) {
        grpc_call_cancel(st->call, NULL);
        cq_wait(&st->pump, TAG_STATUS, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    }
    if (st->recv_posted)
        cq_wait(&st->pump, TAG_RECV, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    if (st->recv)
        grpc_byte_buffer_destroy(st->recv);
    free(st->msg);
    channel_untrack(st->ch, st->call);
    grpc_call_unref(st->call);
    cq_destroy(st->pump.cq);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_metadata_array_destroy(&st->md_initial);
    grpc_metadata_array_destroy(&st->md_trailing);
    grpc_slice_unref(st->details);
    if (st->error_string)
        gpr_free(st->error_string);
    free(st);
}
