/* rpc_server.c — rpc.h's server: methods registered before the start,
 * a few requests posted per method, each call a reference-counted record
 * whose handler runs on the server's pool (see rpc.c for the loop threads
 * that complete its batches). */
#define _GNU_SOURCE
#include "common/rpc_int.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/certs.h"
#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/pool.h"

typedef struct method {
    char name[128];
    td_rpc_handler_fn fn;
    void *ctx;
    void *handle;
    char roles[64]; /* who may call it (td_rpc_server_allow); "" anyone the server admits */
} method_t;

/* A request for the next call of a method, posted to gRPC. */
typedef struct posted {
    rpc_op_t op;
    struct td_rpc_server *srv;
    int method; /* -1: the unimplemented catch-all */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
    grpc_completion_queue *cq;
} posted_t;

struct td_rpc_server {
    grpc_server *srv;
    char addr[256];
    bool tls;
    td_tls_pems_t pems;
    method_t methods[MAX_METHODS];
    int n_methods;
    td_pool_t *pool;
    int threads;
    int max_active; /* calls open at once, past which new ones are refused */
    size_t max_message; /* a request message larger is refused */
    rpc_op_t shutdown_op;
    pthread_mutex_t mu; /* guards what follows */
    pthread_cond_t cv;
    bool started, stopping, shut;
    bool abandoned; /* stop gave up waiting for calls: destroy leaves it */
    int active;     /* call records alive */
    int n_posted;   /* requests posted and not completed */
};

typedef struct call_op {
    rpc_op_t op;
    struct td_rpc_call *c;
    rpc_tag_t tag;
} call_op_t;

struct td_rpc_call {
    td_rpc_server_t *srv;
    method_t *m;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    uint8_t *payload;
    size_t payload_len;
    char *peer;
    char identity[64]; /* the peer certificate's common name, "" if none */
    td_rpc_scope_t scope;
    call_op_t ops[TAG_COUNT];
    rpc_sync_t s;    /* s.mu guards what follows */
    int refs;    /* the owner's, and one per batch in flight or pool task queued */
    int in_cb;   /* callbacks running now */
    int cancelled_flag; /* written by gRPC when TAG_CLOSE completes */
    bool closed, md_sent, finished, send_failed, detached, ended, wake_posted;
    bool task_running; /* a pool task has the call (a resume waits for it to detach) */
    grpc_byte_buffer *send_bb; /* the message in flight (one at a time) */
    grpc_byte_buffer *fin_bb;  /* the reply sent with the status */
    grpc_slice fin_details;
    bool fin_set;
    grpc_metadata trailer[TD_RPC_MAX_TRAILERS]; /* trailing metadata sent with the status */
    size_t n_trailers;
    unsigned wakes, wakes_seen;
    td_rpc_event_fn send_cb, wake_cb, cancel_cb;
    void *send_ctx, *wake_ctx, *cancel_ctx;
    td_rpc_handler_fn resume_fn;
    void *resume_ctx;
};

static void call_free(td_rpc_call_t *c)
{
    td_rpc_server_t *s = c->srv;
    grpc_call_unref(c->call);
    grpc_metadata_array_destroy(&c->md);
    if (c->send_bb)
        grpc_byte_buffer_destroy(c->send_bb);
    if (c->fin_bb)
        grpc_byte_buffer_destroy(c->fin_bb);
    if (c->fin_set)
        grpc_slice_unref(c->fin_details);
    for (size_t i = 0; i < c->n_trailers; i++) {
        grpc_slice_unref(c->trailer[i].key);
        grpc_slice_unref(c->trailer[i].value);
    }
    free(c->payload);
    if (c->peer)
        gpr_free(c->peer);
    rpc_sync_destroy(&c->s);
    pthread_mutex_destroy(&c->scope.mu);
    free(c);
    pthread_mutex_lock(&s->mu);
    s->active--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void call_unref(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    int r = --c->refs;
    pthread_mutex_unlock(&c->s.mu);
    assert(r >= 0);
    if (!r)
        call_free(c);
}

/* Starts a batch tagged t (the caller has set posted and taken the ref,
 * under mu); false (both undone) when gRPC refuses it. */
static bool call_start_batch(td_rpc_call_t *c, rpc_tag_t t, const grpc_op *ops, size_t n)
{
    if (grpc_call_start_batch(c->call, ops, n, rpc_op_arm(&c->ops[t].op), NULL) == GRPC_CALL_OK)
        return true;
    pthread_mutex_lock(&c->s.mu);
    c->s.posted &= ~(1u << t);
    c->refs--; /* the owner still holds one */
    pthread_mutex_unlock(&c->s.mu);
    return false;
}

static void run_cb(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx, bool ok)
{
    if (!fn)
        return;
    fn(ctx, ok);
    pthread_mutex_lock(&c->s.mu);
    c->in_cb--;
    pthread_cond_broadcast(&c->s.cv);
    pthread_mutex_unlock(&c->s.mu);
}

static void call_op_done(rpc_op_t *op, bool ok)
{
    call_op_t *o = (call_op_t *)op;
    td_rpc_call_t *c = o->c;
    td_rpc_event_fn cb1 = NULL, cb2 = NULL;
    void *ctx1 = NULL, *ctx2 = NULL;
    bool cancelled = false;
    pthread_mutex_lock(&c->s.mu);
    switch (o->tag) {
    case TAG_SEND:
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
        if (!ok)
            c->send_failed = true;
        cb1 = c->send_cb;
        ctx1 = c->send_ctx;
        c->send_cb = NULL;
        rpc_sync_complete_locked(&c->s, TAG_SEND, ok);
        break;
    case TAG_CLOSE:
        c->closed = true;
        cancelled = c->cancelled_flag != 0;
        if (cancelled && !c->finished) {
            cb1 = c->cancel_cb;
            ctx1 = c->cancel_ctx;
            c->cancel_cb = NULL;
            cb2 = c->wake_cb;
            ctx2 = c->wake_ctx;
        }
        rpc_sync_complete_locked(&c->s, TAG_CLOSE, ok);
        break;
    case TAG_WAKE:
        c->wake_posted = false;
        c->s.posted &= ~(1u << TAG_WAKE);
        if (!c->finished && !c->ended) {
            cb1 = c->wake_cb;
            ctx1 = c->wake_ctx;
        }
        break;
    default: /* TAG_FINISH */
        rpc_sync_complete_locked(&c->s, o->tag, ok);
        break;
    }
    c->in_cb += (cb1 != NULL) + (cb2 != NULL);
    pthread_mutex_unlock(&c->s.mu);
    if (cancelled)
        td_rpc_scope_cancel(&c->scope);
    run_cb(c, cb1, ctx1, ok);
    run_cb(c, cb2, ctx2, ok);
    call_unref(c);
}

static void server_post(td_rpc_server_t *s, int method);

static void posted_free(posted_t *p)
{
    grpc_metadata_array_destroy(&p->md);
    if (p->method < 0)
        grpc_call_details_destroy(&p->details);
    free(p);
}

/* Waits until the message in flight is written or failed (with mu held);
 * a client that went away while it waits has the call cancelled. */
static void send_settle_locked(td_rpc_call_t *c)
{
    while (c->s.posted & (1u << TAG_SEND)) {
        struct timespec until = rpc_mono_in(1);
        if (pthread_cond_timedwait(&c->s.cv, &c->s.mu, &until) == ETIMEDOUT && c->closed && c->cancelled_flag)
            grpc_call_cancel(c->call, NULL);
    }
}

/* Sends the status (and reply); waits up to 5 s for it to go out (then
 * cancels), except on a loop thread, which must not wait. */
static void call_status(td_rpc_call_t *c, int code, const char *msg, const void *reply, size_t reply_len)
{
    pthread_mutex_lock(&c->s.mu);
    if (c->finished) {
        pthread_mutex_unlock(&c->s.mu);
        return;
    }
    c->finished = true;
    c->wake_cb = c->cancel_cb = NULL;
    if (!rpc_on_loop_thread())
        send_settle_locked(c);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!c->md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->md_sent = true;
    }
    if (reply) {
        grpc_slice sl = grpc_slice_from_copied_buffer(reply, reply_len);
        c->fin_bb = grpc_raw_byte_buffer_create(&sl, 1);
        grpc_slice_unref(sl);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->fin_bb;
    }
    c->fin_details = grpc_slice_from_copied_string(msg ? msg : "");
    c->fin_set = true;
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n].data.send_status_from_server.status_details = &c->fin_details;
    if (c->n_trailers) {
        ops[n].data.send_status_from_server.trailing_metadata_count = c->n_trailers;
        ops[n].data.send_status_from_server.trailing_metadata = c->trailer;
    }
    n++;
    c->s.posted |= 1u << TAG_FINISH;
    c->refs++;
    pthread_mutex_unlock(&c->s.mu);
    if (!call_start_batch(c, TAG_FINISH, ops, (size_t)n) || rpc_on_loop_thread())
        return;
    pthread_mutex_lock(&c->s.mu);
    if (rpc_sync_wait_locked(&c->s, TAG_FINISH, 5) == 0) {
        grpc_call_cancel(c->call, NULL);
        rpc_sync_wait_locked(&c->s, TAG_FINISH, 1e9);
    }
    pthread_mutex_unlock(&c->s.mu);
}

/* With mu held, off the loop threads: waits for the callbacks under way. */
static void callbacks_settle_locked(td_rpc_call_t *c)
{
    while (c->in_cb && !rpc_on_loop_thread())
        pthread_cond_wait(&c->s.cv, &c->s.mu);
}

/* The owner lets go: the status goes out if the handler sent none, the
 * callbacks are turned off (waiting for one under way) and the owner's
 * reference is dropped. */
static void call_end(td_rpc_call_t *c)
{
    if (!c->finished)
        call_status(c, TD_RPC_INTERNAL, "the handler ended without a status", NULL, 0);
    pthread_mutex_lock(&c->s.mu);
    c->ended = true;
    c->wake_cb = c->cancel_cb = c->send_cb = NULL;
    callbacks_settle_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    call_unref(c);
}

/* A pool task: the handler (or a resumed step) of a call. While it runs the
 * call is its own; unless it detaches again, the call ends when it returns. */
static void call_task(void *arg)
{
    td_rpc_call_t *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->s.mu);
        td_rpc_handler_fn fn = c->resume_fn;
        void *ctx = c->resume_ctx;
        c->resume_fn = NULL;
        c->detached = false;
        pthread_mutex_unlock(&c->s.mu);
        if (fn)
            fn(ctx, c);
        else if (c->m)
            c->m->fn(c->m->ctx, c);
        else
            call_status(c, TD_RPC_UNIMPLEMENTED, "no such method", NULL, 0);
        pthread_mutex_lock(&c->s.mu);
        bool detached = c->detached, again = detached && c->resume_fn;
        if (detached && !again)
            c->task_running = false;
        pthread_mutex_unlock(&c->s.mu);
        if (!again) {
            if (!detached)
                call_end(c); /* the owner's reference */
            break;
        }
        /* a callback asked to resume while this task still had the call: run it now */
    }
    call_unref(c); /* the task's */
}

/* The peer certificate's common name, as the TLS handshake verified it. */
static void call_identity(td_rpc_call_t *c)
{
    grpc_auth_context *ac = grpc_call_auth_context(c->call);
    if (!ac)
        return;
    grpc_auth_property_iterator it = grpc_auth_context_find_properties_by_name(ac, GRPC_X509_CN_PROPERTY_NAME);
    const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
    if (p && p->value_length < sizeof c->identity && !memchr(p->value, 0, p->value_length)) {
        memcpy(c->identity, p->value, p->value_length);
        c->identity[p->value_length] = 0;
    }
    grpc_auth_context_release(ac);
}

static void on_arrival(rpc_op_t *op, bool ok)
{
    posted_t *p = (posted_t *)op;
    td_rpc_server_t *s = p->srv;
    pthread_mutex_lock(&s->mu);
    s->n_posted--;
    bool stopping = s->stopping;
    if (!ok)
        pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (!ok) { /* the server is shutting down */
        posted_free(p);
        return;
    }
    if (!stopping)
        server_post(s, p->method);
    td_rpc_call_t *c = calloc(1, sizeof *c);
    if (!c) {
        grpc_call_cancel(p->call, NULL);
        grpc_call_unref(p->call);
        if (p->payload)
            grpc_byte_buffer_destroy(p->payload);
        posted_free(p);
        return;
    }
    c->srv = s;
    c->m = p->method >= 0 ? &s->methods[p->method] : NULL;
    c->call = p->call;
    c->deadline = p->deadline;
    c->md = p->md;
    grpc_metadata_array_init(&p->md);
    c->peer = grpc_call_get_peer(c->call);
    if (s->tls)
        call_identity(c);
    size_t big = 0;
    if (p->payload && grpc_byte_buffer_length(p->payload) > s->max_message) {
        big = grpc_byte_buffer_length(p->payload);
        grpc_byte_buffer_destroy(p->payload);
        p->payload = NULL;
    }
    if (p->payload) {
        size_t cap = 0;
        if (!rpc_buffer_into(p->payload, &c->payload, &cap, &c->payload_len)) {
            free(c->payload);
            c->payload = NULL;
            c->payload_len = 0;
        }
        grpc_byte_buffer_destroy(p->payload);
    }
    posted_free(p);
    gpr_timespec dl = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    double left = gpr_time_cmp(dl, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0
                      ? 1e9
                      : gpr_timespec_to_micros(gpr_time_sub(dl, gpr_now(GPR_CLOCK_MONOTONIC))) * 1e-6;
    rpc_scope_init(&c->scope, left);
    rpc_sync_init(&c->s);
    for (int t = 0; t < TAG_COUNT; t++)
        c->ops[t] = (call_op_t){.op.done = call_op_done, .c = c, .tag = (rpc_tag_t)t};
    pthread_mutex_lock(&s->mu);
    s->active++;
    bool over = s->active > s->max_active;
    pthread_mutex_unlock(&s->mu);
    c->refs = 2; /* the owner's and TAG_CLOSE's */
    c->s.posted = 1u << TAG_CLOSE;
    grpc_op cl = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
    cl.data.recv_close_on_server.cancelled = &c->cancelled_flag;
    call_start_batch(c, TAG_CLOSE, &cl, 1);
    if (c->m && c->m->roles[0] && !td_cert_role_in(c->m->roles, c->identity)) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s: the peer's certificate (CN \"%s\") is not one of the roles that may call "
                 "it (%s)", c->m->name, c->identity[0] ? c->identity : "none", c->m->roles);
        call_status(c, TD_RPC_PERMISSION_DENIED, msg, NULL, 0);
        call_end(c);
        return;
    }
    if ((over || big) && c->m) { /* admission: refused now, not queued */
        char msg[160];
        if (big)
            snprintf(msg, sizeof msg, "request message: %zu bytes, over this server's limit of %zu bytes", big,
                     s->max_message);
        else
            snprintf(msg, sizeof msg, "the server handles %d calls at once, its most; try again later",
                     s->max_active);
        call_status(c, TD_RPC_RESOURCE_EXHAUSTED, msg, NULL, 0);
        call_end(c);
        return;
    }
    c->refs++; /* the task's */
    c->task_running = true;
    if (td_pool_submit(s->pool, call_task, c) != TD_OK) {
        c->refs--;
        call_status(c, TD_RPC_UNAVAILABLE, "the server is stopping", NULL, 0);
        call_end(c);
    }
}

static void server_post(td_rpc_server_t *s, int method)
{
    posted_t *p = calloc(1, sizeof *p);
    if (!p)
        return;
    p->op.done = on_arrival;
    p->srv = s;
    p->method = method;
    p->cq = rpc_loop_pick();
    grpc_metadata_array_init(&p->md);
    pthread_mutex_lock(&s->mu);
    s->n_posted++;
    pthread_mutex_unlock(&s->mu);
    grpc_call_error e;
    /* every read of p comes before the arming (its release is what the
     * thread that completes and frees p acquires): arguments are evaluated
     * in no set order, so none of them may read p */
    grpc_completion_queue *cq = p->cq;
    if (method >= 0) {
        void *handle = s->methods[method].handle;
        rpc_op_t *tag = rpc_op_arm(&p->op);
        e = grpc_server_request_registered_call(s->srv, handle, &p->call, &p->deadline, &p->md, &p->payload, cq, cq,
                                                tag);
    } else {
        grpc_call_details_init(&p->details);
        rpc_op_t *tag = rpc_op_arm(&p->op);
        e = grpc_server_request_call(s->srv, &p->call, &p->details, &p->md, cq, cq, tag);
    }
    if (e != GRPC_CALL_OK) {
        TD_WARN("rpc: cannot post a request for %s: error %d", method >= 0 ? s->methods[method].name : "*", e);
        pthread_mutex_lock(&s->mu);
        s->n_posted--;
        pthread_mutex_unlock(&s->mu);
        posted_free(p);
    }
}

static void on_server_shutdown(rpc_op_t *op, bool ok)
{
    (void)ok;
    td_rpc_server_t *s = (td_rpc_server_t *)((char *)op - offsetof(td_rpc_server_t, shutdown_op));
    pthread_mutex_lock(&s->mu);
    s->shut = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

td_status_t td_rpc_server_create(const char *addr, const td_rpc_tls_t *tls, td_rpc_server_t **out)
{
    td_rpc_server_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    snprintf(s->addr, sizeof s->addr, "%s", addr);
    if (rpc_tls_on(tls)) {
        td_status_t rc = td_tls_pems_load(tls, &s->pems);
        if (rc) {
            free(s);
            return rc;
        }
        if (!s->pems.cert) {
            td_tls_pems_free(&s->pems);
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
    for (int i = 0; i < rpc_loop_count(); i++)
        grpc_server_register_completion_queue(s->srv, rpc_loop_cq(i), NULL);
    s->shutdown_op.done = on_server_shutdown;
    s->max_active = DEFAULT_MAX_CALLS;
    s->max_message = MAX_MESSAGE;
    s->threads = DEFAULT_THREADS;
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

td_status_t td_rpc_server_allow(td_rpc_server_t *s, const char *method, const char *roles)
{
    for (int i = 0; i < s->n_methods; i++)
        if (!strcmp(s->methods[i].name, method)) {
            if (s->started || strlen(roles) >= sizeof s->methods[i].roles)
                return td_error(TD_ERR_INTERNAL, "rpc: cannot restrict %s to '%s'", method, roles);
            if (s->tls)
                snprintf(s->methods[i].roles, sizeof s->methods[i].roles, "%s", roles);
            return TD_OK;
        }
    return td_error(TD_ERR_INTERNAL, "rpc: %s is not registered", method);
}

td_status_t td_rpc_server_start(td_rpc_server_t *s, int *port)
{
    /* one queued task per admitted call at most, and the unimplemented ones */
    td_status_t rc = td_pool_create("rpc", s->threads, (size_t)s->max_active + 64, &s->pool);
    if (rc)
        return rc;
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
    s->started = true;
    for (int i = 0; i < s->n_methods; i++)
        for (int k = 0; k < POSTED_PER_METHOD; k++)
            server_post(s, i);
    server_post(s, -1);
    if (port)
        *port = p;
    return TD_OK;
}

void td_rpc_server_set_max_calls(td_rpc_server_t *s, int max) { s->max_active = max > 0 ? max : DEFAULT_MAX_CALLS; }

void td_rpc_server_set_max_message(td_rpc_server_t *s, size_t bytes)
{
    s->max_message = bytes && bytes < MAX_MESSAGE ? bytes : MAX_MESSAGE;
}
void td_rpc_server_set_threads(td_rpc_server_t *s, int threads) { s->threads = threads > 0 ? threads : DEFAULT_THREADS; }

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
    grpc_server_shutdown_and_notify(s->srv, rpc_loop_cq(0), rpc_op_arm(&s->shutdown_op));
    struct timespec until = td_wall_deadline(grace_s);
    pthread_mutex_lock(&s->mu);
    while (s->active > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0)
        ;
    pthread_mutex_unlock(&s->mu);
    grpc_server_cancel_all_calls(s->srv);
    /* cancelled calls end within their own waits' deadlines; one that does
     * not in 10 s is left behind (logged) rather than waited on forever */
    until = td_wall_deadline(10);
    int e = 0;
    pthread_mutex_lock(&s->mu);
    while ((s->active > 0 || !s->shut || s->n_posted > 0) && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    int left = s->active;
    bool done = s->shut && !s->n_posted && !left;
    pthread_mutex_unlock(&s->mu);
    if (!done) {
        TD_WARN("rpc: %d call(s) did not end within 10 s of being cancelled; the server is left running", left);
        s->abandoned = true;
        return;
    }
    td_pool_destroy(s->pool);
    s->pool = NULL;
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
    if (s->abandoned) /* calls still hold it (td_rpc_server_stop said so): the process is ending */
        return;
    if (!s->stopping) { /* created, never started */
        grpc_server_shutdown_and_notify(s->srv, rpc_loop_cq(0), rpc_op_arm(&s->shutdown_op));
        grpc_server_cancel_all_calls(s->srv);
        pthread_mutex_lock(&s->mu);
        while (!s->shut || s->n_posted > 0)
            pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
    }
    grpc_server_destroy(s->srv);
    td_pool_destroy(s->pool);
    td_tls_pems_free(&s->pems);
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
const char *td_rpc_call_identity(td_rpc_call_t *c) { return c->identity; }

bool td_rpc_call_metadata(td_rpc_call_t *c, const char *key, char *out, size_t n)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_slice *k = &c->md.metadata[i].key, *v = &c->md.metadata[i].value;
        if (GRPC_SLICE_LENGTH(*k) == kl && !memcmp(GRPC_SLICE_START_PTR(*k), key, kl)) {
            size_t vl = GRPC_SLICE_LENGTH(*v);
            if (vl >= n || memchr(GRPC_SLICE_START_PTR(*v), 0, vl))
                return false;
            memcpy(out, GRPC_SLICE_START_PTR(*v), vl);
            out[vl] = 0;
            return true;
        }
    }
    return false;
}
td_rpc_scope_t *td_rpc_call_scope(td_rpc_call_t *c) { return &c->scope; }

double td_rpc_call_time_left(td_rpc_call_t *c)
{
    gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0)
        return 1e9;
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (double)left.tv_sec + left.tv_nsec * 1e-9;
}

bool td_rpc_call_cancelled(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    bool r = c->closed && c->cancelled_flag;
    pthread_mutex_unlock(&c->s.mu);
    return r;
}

/* Posts one message (mu held, no send in flight); cb NULL: blocking use. */
static td_status_t send_post_locked(td_rpc_call_t *c, const void *msg, size_t len, td_rpc_event_fn cb, void *ctx,
                                    grpc_op *ops, int *n)
{
    if (c->finished || c->send_failed || (c->closed && c->cancelled_flag))
        return TD_ERR_CANCELLED;
    *n = 0;
    memset(ops, 0, 2 * sizeof *ops);
    if (!c->md_sent) {
        ops[(*n)++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->md_sent = true;
    }
    grpc_slice sl = grpc_slice_from_copied_buffer(msg, len);
    c->send_bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    ops[*n].op = GRPC_OP_SEND_MESSAGE;
    ops[(*n)++].data.send_message.send_message = c->send_bb;
    c->send_cb = cb;
    c->send_ctx = ctx;
    c->s.posted |= 1u << TAG_SEND;
    c->refs++;
    return TD_OK;
}

/* Sends without waiting for the write: the caller goes on (say, to read the
 * next message from upstream) while gRPC writes; the next send or the finish
 * waits for this one first, so flow control still holds the sender back. */
td_status_t td_rpc_call_send(td_rpc_call_t *c, const void *msg, size_t len)
{
    grpc_op ops[2];
    int n;
    pthread_mutex_lock(&c->s.mu);
    send_settle_locked(c);
    td_status_t rc = send_post_locked(c, msg, len, NULL, NULL, ops, &n);
    pthread_mutex_unlock(&c->s.mu);
    if (rc)
        return rc;
    return call_start_batch(c, TAG_SEND, ops, (size_t)n) ? TD_OK : TD_ERR_CANCELLED;
}

td_status_t td_rpc_call_send_async(td_rpc_call_t *c, const void *msg, size_t len, td_rpc_event_fn done, void *ctx)
{
    grpc_op ops[2];
    int n;
    pthread_mutex_lock(&c->s.mu);
    td_status_t rc = c->s.posted & (1u << TAG_SEND) ? TD_ERR_INTERNAL : send_post_locked(c, msg, len, done, ctx, ops, &n);
    pthread_mutex_unlock(&c->s.mu);
    if (rc == TD_ERR_INTERNAL)
        return td_error(rc, "rpc: a send is already in flight on this call");
    if (rc)
        return rc;
    if (!call_start_batch(c, TAG_SEND, ops, (size_t)n)) {
        pthread_mutex_lock(&c->s.mu);
        c->send_cb = NULL;
        pthread_mutex_unlock(&c->s.mu);
        return TD_ERR_CANCELLED;
    }
    return TD_OK;
}

td_status_t td_rpc_call_wait(td_rpc_call_t *c, double timeout_s)
{
    struct timespec until = rpc_mono_in(timeout_s);
    td_status_t rc = TD_OK;
    pthread_mutex_lock(&c->s.mu);
    for (;;) {
        if (c->wakes != c->wakes_seen) {
            c->wakes_seen = c->wakes;
            break;
        }
        if (c->closed && c->cancelled_flag) {
            rc = TD_ERR_CANCELLED;
            break;
        }
        if (pthread_cond_timedwait(&c->s.cv, &c->s.mu, &until) == ETIMEDOUT) {
            rc = TD_ERR_TIMEOUT;
            break;
        }
    }
    pthread_mutex_unlock(&c->s.mu);
    return rc;
}

/* With mu held: posts an empty batch whose completion runs the wake
 * callback on the call's loop thread (one at a time: wakes coalesce). */
static bool wake_post_locked(td_rpc_call_t *c)
{
    if (!c->wake_cb || c->wake_posted || c->finished || c->ended)
        return false;
    c->wake_posted = true;
    c->s.posted |= 1u << TAG_WAKE;
    c->refs++;
    return true;
}

static void wake_start(td_rpc_call_t *c)
{
    if (!call_start_batch(c, TAG_WAKE, NULL, 0)) {
        pthread_mutex_lock(&c->s.mu);
        c->wake_posted = false;
        pthread_mutex_unlock(&c->s.mu);
    }
}

void td_rpc_call_wake(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    c->wakes++;
    pthread_cond_broadcast(&c->s.cv);
    bool post = wake_post_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    if (post)
        wake_start(c);
}

void td_rpc_call_on_wake(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx)
{
    pthread_mutex_lock(&c->s.mu);
    c->wake_cb = fn;
    c->wake_ctx = ctx;
    bool post = fn && wake_post_locked(c); /* one at once: wakes that came before */
    if (!fn)
        callbacks_settle_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    if (post)
        wake_start(c);
}

void td_rpc_call_on_cancel(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx)
{
    pthread_mutex_lock(&c->s.mu);
    bool now = fn && c->closed && c->cancelled_flag && !c->finished;
    c->cancel_cb = now ? NULL : fn;
    c->cancel_ctx = ctx;
    if (!fn)
        callbacks_settle_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    if (now)
        fn(ctx, true);
}

void td_rpc_call_detach(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    c->detached = true;
    pthread_mutex_unlock(&c->s.mu);
}

void td_rpc_call_done(td_rpc_call_t *c) { call_end(c); }

td_status_t td_rpc_call_resume(td_rpc_call_t *c, td_rpc_handler_fn fn, void *ctx)
{
    pthread_mutex_lock(&c->s.mu);
    c->resume_fn = fn;
    c->resume_ctx = ctx;
    bool queued = c->task_running; /* the task that has it runs fn once it lets go */
    if (!queued) {
        c->task_running = true;
        c->refs++;
    }
    pthread_mutex_unlock(&c->s.mu);
    if (queued)
        return TD_OK;
    td_status_t rc = td_pool_submit(c->srv->pool, call_task, c);
    if (rc) {
        grpc_call_cancel(c->call, NULL);
        pthread_mutex_lock(&c->s.mu);
        c->task_running = false;
        pthread_mutex_unlock(&c->s.mu);
        call_unref(c);
    }
    return rc;
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

void td_rpc_call_set_trailer(td_rpc_call_t *c, const char *key, const char *value)
{
    pthread_mutex_lock(&c->s.mu);
    size_t i = 0;
    while (i < c->n_trailers && grpc_slice_str_cmp(c->trailer[i].key, key))
        i++;
    if (c->finished || i == TD_RPC_MAX_TRAILERS) {
        bool full = !c->finished;
        pthread_mutex_unlock(&c->s.mu);
        if (full)
            TD_WARN("rpc: trailer %s dropped: a call sends at most %d", key, TD_RPC_MAX_TRAILERS);
        return;
    }
    if (i < c->n_trailers) {
        grpc_slice_unref(c->trailer[i].key);
        grpc_slice_unref(c->trailer[i].value);
    } else {
        c->n_trailers++;
    }
    memset(&c->trailer[i], 0, sizeof c->trailer[i]);
    c->trailer[i].key = grpc_slice_from_copied_string(key);
    c->trailer[i].value = grpc_slice_from_copied_string(value);
    pthread_mutex_unlock(&c->s.mu);
}

void td_rpc_call_reply(td_rpc_call_t *c, const void *msg, size_t len)
{
    call_status(c, TD_RPC_OK, "", msg ? msg : "", len);
}
