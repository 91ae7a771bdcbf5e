/* rpc_client.c — rpc.h's client: channels (with the server's role check
 * and the authorization sent with every call), unary calls, streams and
 * unary calls fanned out at once. A client call is owned by its caller,
 * who waits for its batches before freeing. */
#define _GNU_SOURCE
#include "common/rpc_int.h"

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
#include <unistd.h>

#include "common/certs.h"
#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/pool.h"

/* calls: the client calls in flight on this channel (under mu), so that
 * td_rpc_channel_shutdown can end them; closed: no new call starts. */
struct td_rpc_channel {
    grpc_channel *ch;
    char target[256];
    pthread_mutex_t mu;
    grpc_call **calls;
    size_t n_calls, cap_calls;
    bool closed, fail_fast;
    grpc_metadata auth; /* "authorization" sent with every call (value empty: none) */
    size_t n_md;
    struct peer_check *pc; /* the server's role check (NULL: none) */
};

/* A channel's check of the server's certificate role, shared with gRPC's
 * copy of the verify options (which may outlive the channel: counted). A
 * server that fails it is refused for good: calls waiting for it (they wait
 * for the connection) are ended at once, and later calls end at start. */
typedef struct peer_check {
    pthread_mutex_t mu;
    int refs;
    char roles[128];
    char why[320];         /* the refusal, once refused */
    td_rpc_channel_t *ch;  /* NULL once the channel is destroyed */
    int refused;           /* atomic */
} peer_check_t;

static void peer_check_put(void *arg)
{
    peer_check_t *pc = arg;
    pthread_mutex_lock(&pc->mu);
    bool last = --pc->refs == 0;
    pthread_mutex_unlock(&pc->mu);
    if (last) {
        pthread_mutex_destroy(&pc->mu);
        free(pc);
    }
}

/* Ends the calls a refused server's channel holds (a thread of its own: not
 * from inside gRPC's handshake). */
static void *peer_refused_thread(void *arg)
{
    peer_check_t *pc = arg;
    pthread_mutex_lock(&pc->mu);
    td_rpc_channel_t *ch = pc->ch;
    if (ch) {
        pthread_mutex_lock(&ch->mu);
        for (size_t i = 0; i < ch->n_calls; i++)
            grpc_call_cancel_with_status(ch->calls[i], GRPC_STATUS_PERMISSION_DENIED, pc->why, NULL);
        pthread_mutex_unlock(&ch->mu);
    }
    pthread_mutex_unlock(&pc->mu);
    peer_check_put(pc);
    return NULL;
}

/* The initial metadata of a call on ch into op. */
static void channel_md(td_rpc_channel_t *ch, grpc_op *op)
{
    op->data.send_initial_metadata.count = ch->n_md;
    op->data.send_initial_metadata.metadata = ch->n_md ? &ch->auth : NULL;
}

void td_rpc_channel_set_authorization(td_rpc_channel_t *ch, const char *value)
{
    if (ch->n_md) {
        grpc_slice_unref(ch->auth.key);
        grpc_slice_unref(ch->auth.value);
        ch->n_md = 0;
    }
    if (value && value[0]) {
        ch->auth.key = grpc_slice_from_static_string("authorization");
        ch->auth.value = grpc_slice_from_copied_string(value);
        ch->n_md = 1;
    }
}

#define SHUTDOWN_MSG "the peer left the cluster; the call was ended by the caller"

/* Registers a new call; a closed channel (or no memory) cancels it at once. */
static void channel_track(td_rpc_channel_t *ch, grpc_call *call)
{
    pthread_mutex_lock(&ch->mu);
    bool ok = !ch->closed && td_grow((void **)&ch->calls, &ch->cap_calls, ch->n_calls + 1, sizeof *ch->calls, 16);
    if (ok)
        ch->calls[ch->n_calls++] = call;
    else
        grpc_call_cancel_with_status(call, GRPC_STATUS_UNAVAILABLE,
                                     ch->closed ? SHUTDOWN_MSG : "no memory to track the call", NULL);
    pthread_mutex_unlock(&ch->mu);
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

/* The server's certificate must name one of the channel's peer roles; a
 * non-zero answer makes gRPC refuse the connection. */
static int verify_peer_role(const char *target, const char *peer_pem, void *arg)
{
    peer_check_t *pc = arg;
    char cn[128];
    if (td_cert_pem_cn(peer_pem, cn, sizeof cn) && td_cert_role_in(pc->roles, cn))
        return 0;
    pthread_mutex_lock(&pc->mu);
    bool first = !pc->refused;
    if (first) {
        snprintf(pc->why, sizeof pc->why, "%s shows a certificate of this cluster named \"%.100s\", not one of role "
                 "%.100s: not connecting", target ? target : "?", cn, pc->roles);
        __atomic_store_n(&pc->refused, 1, __ATOMIC_RELEASE);
    }
    pthread_t t;
    pthread_attr_t a;
    bool cancel = pc->ch != NULL;
    if (cancel)
        pc->refs++;
    pthread_mutex_unlock(&pc->mu);
    if (first)
        TD_WARN("rpc: %s", pc->why);
    if (cancel) {
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, peer_refused_thread, pc))
            peer_check_put(pc);
        pthread_attr_destroy(&a);
    }
    return 1;
}

bool td_rpc_channel_down(const td_rpc_channel_t *ch)
{
    return ch && grpc_channel_check_connectivity_state(ch->ch, 0) == GRPC_CHANNEL_TRANSIENT_FAILURE;
}

bool td_rpc_channel_peer_refused(const td_rpc_channel_t *ch)
{
    return ch && ch->pc && __atomic_load_n(&ch->pc->refused, __ATOMIC_ACQUIRE);
}

td_status_t td_rpc_channel_create(const char *target, const td_rpc_tls_t *tls, td_rpc_channel_t **out)
{
    td_rpc_channel_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    snprintf(c->target, sizeof c->target, "%s", target);
    grpc_channel_credentials *cr;
    if (rpc_tls_on(tls)) {
        td_tls_pems_t p;
        td_status_t rc = td_tls_pems_load(tls, &p);
        if (rc) {
            free(c);
            return rc;
        }
        grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
        if (tls->peer_roles && !(c->pc = calloc(1, sizeof *c->pc))) {
            td_tls_pems_free(&p);
            free(c);
            return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
        }
        if (c->pc) {
            pthread_mutex_init(&c->pc->mu, NULL);
            c->pc->refs = 2; /* the channel's, the credentials' (their destruct) */
            c->pc->ch = c;
            snprintf(c->pc->roles, sizeof c->pc->roles, "%s", tls->peer_roles);
        }
        grpc_ssl_verify_peer_options vo = {.verify_peer_callback = verify_peer_role,
                                           .verify_peer_callback_userdata = c->pc,
                                           .verify_peer_destruct = peer_check_put};
        cr = grpc_ssl_credentials_create_ex(p.ca, p.cert ? &pair : NULL, c->pc ? &vo : NULL, NULL);
        td_tls_pems_free(&p);
    } else {
        cr = grpc_insecure_credentials_create();
    }
    grpc_arg args[5] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = MAX_MESSAGE},
        /* reconnect fast after a peer restarts (the defaults back off to minutes);
         * calls wait for the connection (WAIT_FOR_READY) up to their deadline:
         * fail-fast calls to a peer that was down once never saw it come back */
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, .value.integer = 1000},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, .value.integer = 100},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, .value.integer = 1000},
        /* no retry filter: gRPC 1.51's aborts the process (an absl assertion) on trailing metadata
         * without grpc-status, which a peer closing its transport mid-call can send (etcd stopping
         * while our calls to it are in flight). Every caller handles a failed call itself. */
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ENABLE_RETRIES, .value.integer = 0},
    };
    grpc_channel_args ca = {5, args};
    pthread_mutex_init(&c->mu, NULL);
    c->ch = grpc_channel_create(target, cr, &ca);
    grpc_channel_credentials_release(cr);
    if (!c->ch) {
        if (c->pc)
            peer_check_put(c->pc);
        free(c);
        return td_error(TD_ERR_INVALID_ARG, "rpc: cannot make a channel to '%s'", target);
    }
    *out = c;
    return TD_OK;
}

void td_rpc_channel_set_fail_fast(td_rpc_channel_t *ch, bool on) { ch->fail_fast = on; }

void td_rpc_channel_destroy(td_rpc_channel_t *ch)
{
    if (!ch)
        return;
    if (ch->pc) {
        pthread_mutex_lock(&ch->pc->mu);
        ch->pc->ch = NULL;
        pthread_mutex_unlock(&ch->pc->mu);
        peer_check_put(ch->pc);
    }
    grpc_channel_destroy(ch->ch);
    td_rpc_channel_set_authorization(ch, NULL);
    pthread_mutex_destroy(&ch->mu);
    free(ch->calls);
    free(ch);
}

const char *td_rpc_channel_target(const td_rpc_channel_t *ch) { return ch->target; }

static grpc_call *client_call(td_rpc_channel_t *ch, const char *method, double timeout_s, td_rpc_scope_t *scope,
                              grpc_completion_queue *cq)
{
    if (scope && td_rpc_scope_left(scope) < timeout_s)
        timeout_s = td_rpc_scope_left(scope);
    grpc_slice m = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                               rpc_deadline_in(timeout_s), NULL);
    grpc_slice_unref(m);
    channel_track(ch, call);
    rpc_scope_track(scope, call);
    if (td_rpc_channel_peer_refused(ch))
        grpc_call_cancel_with_status(call, GRPC_STATUS_PERMISSION_DENIED, ch->pc->why, NULL);
    return call;
}

static void client_call_end(td_rpc_channel_t *ch, td_rpc_scope_t *scope, grpc_call *call)
{
    rpc_scope_untrack(scope, call);
    channel_untrack(ch, call);
    grpc_call_unref(call);
}

static void result_set(td_rpc_result_t *res, grpc_status_code code, grpc_slice details, const char *fallback,
                       const grpc_metadata_array *trailing)
{
    if (!res)
        return;
    res->code = (int)code;
    res->retry_after_ms = 0;
    res->rejected_early[0] = '\0';
    for (size_t i = 0; trailing && i < trailing->count; i++) {
        const grpc_metadata *m = &trailing->metadata[i];
        char v[16];
        size_t vn = GRPC_SLICE_LENGTH(m->value);
        if (!grpc_slice_str_cmp(m->key, "rejected-early") && vn && vn < sizeof res->rejected_early) {
            memcpy(res->rejected_early, GRPC_SLICE_START_PTR(m->value), vn);
            res->rejected_early[vn] = '\0';
            continue;
        }
        if (grpc_slice_str_cmp(m->key, "retry-after-ms") || !vn || vn >= sizeof v)
            continue;
        memcpy(v, GRPC_SLICE_START_PTR(m->value), vn);
        v[vn] = '\0';
        char *end;
        unsigned long ms = strtoul(v, &end, 10);
        if (!*end && ms <= UINT32_MAX)
            res->retry_after_ms = (uint32_t)ms;
    }
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

/* A client batch: completes into its sync (and, for streams, the stream). */
typedef struct client_op {
    rpc_op_t op;
    rpc_sync_t *s;
    struct td_rpc_stream *st; /* NULL: a unary call */
    rpc_tag_t tag;
} client_op_t;

static void stream_op_done(client_op_t *o, bool ok);

static void client_op_done(rpc_op_t *op, bool ok)
{
    client_op_t *o = (client_op_t *)op;
    if (o->st) {
        stream_op_done(o, ok);
        return;
    }
    pthread_mutex_lock(&o->s->mu);
    rpc_sync_complete_locked(o->s, o->tag, ok);
    pthread_mutex_unlock(&o->s->mu);
}

td_status_t td_rpc_unary(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                         double timeout_s, td_rpc_scope_t *scope, uint8_t **resp, size_t *resp_len,
                         td_rpc_result_t *res)
{
    rpc_sync_t s;
    rpc_sync_init(&s);
    client_op_t op = {.op.done = client_op_done, .s = &s, .tag = TAG_STATUS};
    grpc_call *call = client_call(ch, method, timeout_s, scope, rpc_loop_pick());
    grpc_metadata_array mi, mt;
    grpc_metadata_array_init(&mi);
    grpc_metadata_array_init(&mt);
    grpc_slice sl = grpc_slice_from_copied_buffer(req, req_len);
    grpc_byte_buffer *out = grpc_raw_byte_buffer_create(&sl, 1), *in = NULL;
    grpc_slice_unref(sl);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *err_str = NULL;
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = ch->fail_fast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    channel_md(ch, &ops[0]);
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
    if (grpc_call_start_batch(call, ops, 6, rpc_op_arm(&op.op), NULL) != GRPC_CALL_OK) {
        code = GRPC_STATUS_INTERNAL;
        rc = TD_ERR_INTERNAL;
    } else {
        rpc_sync_wait(&s, TAG_STATUS, 1e9); /* the call's deadline bounds it */
    }
    client_call_end(ch, scope, call);
    rpc_sync_destroy(&s);
    result_set(res, code, details, err_str, &mt);
    explain_unconnected(ch, res);
    if (!rc && code == GRPC_STATUS_OK && in) {
        size_t cap = 0;
        *resp = NULL;
        if (!rpc_buffer_into(in, resp, &cap, resp_len)) {
            free(*resp);
            *resp = NULL;
            rc = TD_ERR_NO_MEMORY;
        } else if (!*resp) { /* an empty reply: still a buffer the caller frees */
            *resp = malloc(1);
            rc = *resp ? TD_OK : TD_ERR_NO_MEMORY;
        }
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
    return rc;
}

struct td_rpc_stream {
    td_rpc_channel_t *ch;
    td_rpc_scope_t *scope;
    grpc_call *call;
    client_op_t ops[TAG_COUNT];
    grpc_metadata_array md_initial, md_trailing;
    grpc_status_code code;
    grpc_slice details;
    char *error_string;
    grpc_byte_buffer *recv;
    grpc_byte_buffer *send_bb; /* the message in flight (the request after open, or a write) */
    bool md_sent, got_initial, ended;
    uint8_t *msg; /* the last message read, reused (grown, never shrunk) */
    size_t msg_cap, msg_len;
    rpc_sync_t s; /* s.mu guards what follows */
    bool status_done, end_pending;
    int in_cb;
    td_rpc_read_fn read_cb;
    void *read_ctx;
};

static void stream_read_cb(td_rpc_stream_t *st, td_rpc_read_fn cb, void *ctx, td_status_t rc)
{
    cb(ctx, rc, rc ? NULL : st->msg, rc ? 0 : st->msg_len);
    pthread_mutex_lock(&st->s.mu);
    st->in_cb--;
    pthread_cond_broadcast(&st->s.cv);
    pthread_mutex_unlock(&st->s.mu);
}

static void stream_op_done(client_op_t *o, bool ok)
{
    td_rpc_stream_t *st = o->st;
    td_rpc_read_fn cb = NULL;
    void *ctx = NULL;
    td_status_t rc = TD_OK;
    pthread_mutex_lock(&st->s.mu);
    if (o->tag == TAG_RECV && st->read_cb) {
        st->s.posted &= ~(1u << TAG_RECV);
        cb = st->read_cb;
        ctx = st->read_ctx;
        st->read_cb = NULL;
        bool got = ok && st->recv;
        if (got) {
            got = rpc_buffer_into(st->recv, &st->msg, &st->msg_cap, &st->msg_len);
            rc = got ? TD_OK : TD_ERR_NO_MEMORY;
        }
        if (st->recv)
            grpc_byte_buffer_destroy(st->recv);
        st->recv = NULL;
        if (!got && rc == TD_OK) { /* the end: told once the status is in */
            st->ended = true;
            rc = TD_ERR_NOT_FOUND;
            if (!st->status_done) {
                st->end_pending = true;
                st->read_cb = cb;
                st->read_ctx = ctx;
                cb = NULL;
            }
        }
    } else if (o->tag == TAG_STATUS) {
        st->status_done = true;
        if (st->end_pending) {
            st->end_pending = false;
            cb = st->read_cb;
            ctx = st->read_ctx;
            st->read_cb = NULL;
            rc = TD_ERR_NOT_FOUND;
        }
        rpc_sync_complete_locked(&st->s, TAG_STATUS, ok);
    } else {
        rpc_sync_complete_locked(&st->s, o->tag, ok);
    }
    if (cb)
        st->in_cb++;
    pthread_mutex_unlock(&st->s.mu);
    if (cb)
        stream_read_cb(st, cb, ctx, rc);
}

td_status_t td_rpc_stream_open(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                               double timeout_s, td_rpc_scope_t *scope, td_rpc_stream_t **out)
{
    td_rpc_stream_t *st = calloc(1, sizeof *st);
    if (!st)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    st->ch = ch;
    st->scope = scope;
    rpc_sync_init(&st->s);
    for (int t = 0; t < TAG_COUNT; t++)
        st->ops[t] = (client_op_t){.op.done = client_op_done, .s = &st->s, .st = st, .tag = (rpc_tag_t)t};
    st->call = client_call(ch, method, timeout_s, scope, rpc_loop_pick());
    grpc_metadata_array_init(&st->md_initial);
    grpc_metadata_array_init(&st->md_trailing);
    st->details = grpc_empty_slice();
    grpc_op op = {.op = GRPC_OP_RECV_STATUS_ON_CLIENT};
    op.data.recv_status_on_client.trailing_metadata = &st->md_trailing;
    op.data.recv_status_on_client.status = &st->code;
    op.data.recv_status_on_client.status_details = &st->details;
    op.data.recv_status_on_client.error_string = (const char **)&st->error_string;
    st->s.posted |= 1u << TAG_STATUS;
    if (grpc_call_start_batch(st->call, &op, 1, rpc_op_arm(&st->ops[TAG_STATUS].op), NULL) != GRPC_CALL_OK) {
        st->s.posted = 0;
        st->status_done = true;
        st->code = GRPC_STATUS_INTERNAL;
    }
    if (req) {
        grpc_slice sl = grpc_slice_from_copied_buffer(req, req_len);
        st->send_bb = grpc_raw_byte_buffer_create(&sl, 1);
        grpc_slice_unref(sl);
        grpc_op ops[3];
        memset(ops, 0, sizeof ops);
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[0].flags = ch->fail_fast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY;
        channel_md(ch, &ops[0]);
        ops[1].op = GRPC_OP_SEND_MESSAGE;
        ops[1].data.send_message.send_message = st->send_bb;
        ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        st->md_sent = true;
        /* not waited for: the first read waits for the reply anyway */
        pthread_mutex_lock(&st->s.mu);
        st->s.posted |= 1u << TAG_SEND;
        pthread_mutex_unlock(&st->s.mu);
        if (grpc_call_start_batch(st->call, ops, 3, rpc_op_arm(&st->ops[TAG_SEND].op), NULL) != GRPC_CALL_OK) {
            pthread_mutex_lock(&st->s.mu);
            st->s.posted &= ~(1u << TAG_SEND);
            pthread_mutex_unlock(&st->s.mu);
        }
    }
    *out = st;
    return TD_OK;
}

td_status_t td_rpc_stream_write(td_rpc_stream_t *st, const void *msg, size_t len, double timeout_s)
{
    pthread_mutex_lock(&st->s.mu);
    rpc_sync_settle_locked(&st->s, TAG_SEND);
    st->s.done &= ~(1u << TAG_SEND);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_slice sl = grpc_slice_from_copied_buffer(msg, len);
    st->send_bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    st->s.posted |= 1u << TAG_SEND;
    pthread_mutex_unlock(&st->s.mu);
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!st->md_sent) {
        ops[n].flags = st->ch->fail_fast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY;
        channel_md(st->ch, &ops[n]);
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        st->md_sent = true;
    }
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = st->send_bb;
    int r = -1;
    if (grpc_call_start_batch(st->call, ops, (size_t)n, rpc_op_arm(&st->ops[TAG_SEND].op), NULL) == GRPC_CALL_OK) {
        r = rpc_sync_wait(&st->s, TAG_SEND, timeout_s);
        if (r == 0) {
            grpc_call_cancel(st->call, NULL);
            r = rpc_sync_wait(&st->s, TAG_SEND, 1e9) == 1 ? 0 : -1;
        }
    } else {
        pthread_mutex_lock(&st->s.mu);
        st->s.posted &= ~(1u << TAG_SEND);
        pthread_mutex_unlock(&st->s.mu);
    }
    return r == 1 ? TD_OK : r == 0 ? TD_ERR_TIMEOUT : TD_ERR_UNAVAILABLE;
}

/* Posts a receive (mu not held); false when gRPC refuses it (the stream is over). */
static bool stream_post_recv(td_rpc_stream_t *st)
{
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
    return grpc_call_start_batch(st->call, ops, (size_t)n, rpc_op_arm(&st->ops[TAG_RECV].op), NULL) == GRPC_CALL_OK;
}

td_status_t td_rpc_stream_read(td_rpc_stream_t *st, const uint8_t **msg, size_t *len, double wait_s)
{
    if (st->ended)
        return TD_ERR_NOT_FOUND;
    pthread_mutex_lock(&st->s.mu);
    bool post = !(st->s.posted & (1u << TAG_RECV)) && !(st->s.done & (1u << TAG_RECV));
    if (post)
        st->s.posted |= 1u << TAG_RECV;
    pthread_mutex_unlock(&st->s.mu);
    if (post && !stream_post_recv(st)) {
        pthread_mutex_lock(&st->s.mu);
        st->s.posted &= ~(1u << TAG_RECV);
        pthread_mutex_unlock(&st->s.mu);
        st->ended = true;
        return TD_ERR_NOT_FOUND;
    }
    int r = rpc_sync_wait(&st->s, TAG_RECV, wait_s);
    if (r == 0)
        return TD_ERR_TIMEOUT;
    if (r < 0 || !st->recv) {
        st->ended = true;
        return TD_ERR_NOT_FOUND;
    }
    bool ok = rpc_buffer_into(st->recv, &st->msg, &st->msg_cap, len);
    grpc_byte_buffer_destroy(st->recv);
    st->recv = NULL;
    *msg = st->msg;
    return ok ? TD_OK : TD_ERR_NO_MEMORY;
}

td_status_t td_rpc_stream_read_async(td_rpc_stream_t *st, td_rpc_read_fn cb, void *ctx)
{
    pthread_mutex_lock(&st->s.mu);
    td_status_t rc = st->ended ? TD_ERR_NOT_FOUND
                     : (st->s.posted & (1u << TAG_RECV)) || st->read_cb ? TD_ERR_INTERNAL
                                                                        : TD_OK;
    if (!rc) {
        st->read_cb = cb;
        st->read_ctx = ctx;
        st->s.posted |= 1u << TAG_RECV;
    }
    pthread_mutex_unlock(&st->s.mu);
    if (rc == TD_ERR_INTERNAL)
        return td_error(rc, "rpc: a read is already posted on this stream");
    if (rc)
        return rc;
    if (!stream_post_recv(st)) {
        pthread_mutex_lock(&st->s.mu);
        st->s.posted &= ~(1u << TAG_RECV);
        st->read_cb = NULL;
        st->ended = true;
        pthread_mutex_unlock(&st->s.mu);
        return TD_ERR_NOT_FOUND;
    }
    return TD_OK;
}

td_status_t td_rpc_stream_result(td_rpc_stream_t *st, double wait_s, td_rpc_result_t *res)
{
    pthread_mutex_lock(&st->s.mu);
    bool done = st->status_done;
    if (!done && wait_s > 0) {
        struct timespec until = rpc_mono_in(wait_s);
        while (!st->status_done && pthread_cond_timedwait(&st->s.cv, &st->s.mu, &until) != ETIMEDOUT)
            ;
        done = st->status_done;
    }
    pthread_mutex_unlock(&st->s.mu);
    if (!done)
        return TD_ERR_TIMEOUT;
    result_set(res, st->code, st->details, st->error_string, &st->md_trailing);
    explain_unconnected(st->ch, res);
    return td_rpc_status_of(st->code);
}

void td_rpc_stream_cancel(td_rpc_stream_t *st) { grpc_call_cancel(st->call, NULL); }

/* td_rpc_unary_all: each call as a server-streaming one (the wire of a unary
 * call), all sent first with their reads posted, then one wait for them all. */
typedef struct unary_all {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t left; /* reads not yet answered */
} unary_all_t;

typedef struct unary_slot {
    unary_all_t *all;
    td_rpc_unary_call_t *c;
    bool answered, got; /* the read came back; with a message */
} unary_slot_t;

static void unary_all_read(void *ctx, td_status_t rc, const uint8_t *msg, size_t len)
{
    unary_slot_t *sl = ctx;
    pthread_mutex_lock(&sl->all->mu);
    if (rc == TD_OK && (sl->c->resp = malloc(len ? len : 1))) {
        memcpy(sl->c->resp, msg, len);
        sl->c->resp_len = len;
        sl->got = true;
    }
    sl->answered = true;
    sl->all->left--;
    pthread_cond_broadcast(&sl->all->cv);
    pthread_mutex_unlock(&sl->all->mu);
}

void td_rpc_unary_all(td_rpc_unary_call_t *calls, size_t n, double timeout_s)
{
    td_rpc_stream_t **st = calloc(n ? n : 1, sizeof *st);
    unary_slot_t *slot = calloc(n ? n : 1, sizeof *slot);
    unary_all_t all = {.left = 0};
    pthread_mutex_init(&all.mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&all.cv, &ca);
    pthread_condattr_destroy(&ca);
    for (size_t i = 0; i < n; i++) {
        td_rpc_unary_call_t *c = &calls[i];
        c->resp = NULL;
        c->resp_len = 0;
        if (!c->ch)
            continue;
        memset(&c->res, 0, sizeof c->res);
        if (!st || !slot) { /* no memory for the lists: one after the other */
            c->rc = td_rpc_unary(c->ch, c->method, c->req ? c->req : "", c->req_len, timeout_s, NULL, &c->resp,
                                 &c->resp_len, &c->res);
            continue;
        }
        slot[i] = (unary_slot_t){.all = &all, .c = c};
        /* req NULL: an empty message */
        if ((c->rc = td_rpc_stream_open(c->ch, c->method, c->req ? c->req : "", c->req_len, timeout_s, NULL, &st[i]))) {
            snprintf(c->res.message, sizeof c->res.message, "%s", td_last_error());
            continue;
        }
        pthread_mutex_lock(&all.mu);
        all.left++;
        pthread_mutex_unlock(&all.mu);
        if (td_rpc_stream_read_async(st[i], unary_all_read, &slot[i])) { /* over already: its status says why */
            pthread_mutex_lock(&all.mu);
            all.left--;
            slot[i].answered = true;
            pthread_mutex_unlock(&all.mu);
        }
    }
    struct timespec until = rpc_mono_in(timeout_s);
    pthread_mutex_lock(&all.mu);
    while (all.left && pthread_cond_timedwait(&all.cv, &all.mu, &until) != ETIMEDOUT)
        ;
    pthread_mutex_unlock(&all.mu);
    for (size_t i = 0; st && slot && i < n; i++) {
        td_rpc_unary_call_t *c = &calls[i];
        if (!st[i])
            continue;
        pthread_mutex_lock(&all.mu);
        bool answered = slot[i].answered, got = slot[i].got;
        pthread_mutex_unlock(&all.mu);
        if (got) {
            c->rc = TD_OK;
        } else if (!answered) {
            td_rpc_stream_cancel(st[i]);
            c->rc = TD_ERR_TIMEOUT;
            c->res.code = TD_RPC_DEADLINE_EXCEEDED;
            snprintf(c->res.message, sizeof c->res.message, "%s did not answer within %.1f s", c->method, timeout_s);
        } else if ((c->rc = td_rpc_stream_result(st[i], 1.0, &c->res)) == TD_OK) { /* OK without a message */
            c->rc = TD_ERR_FORMAT;
            snprintf(c->res.message, sizeof c->res.message, "the reply had no message");
        } else if (c->res.code == TD_RPC_DEADLINE_EXCEEDED) { /* the call's own deadline came before the wait's */
            snprintf(c->res.message, sizeof c->res.message, "%s did not answer within %.1f s", c->method, timeout_s);
        } else if (c->rc == TD_ERR_TIMEOUT && !c->res.message[0]) {
            snprintf(c->res.message, sizeof c->res.message, "%s ended without its status", c->method);
        }
        td_rpc_stream_destroy(st[i]); /* waits for its read's callback */
    }
    pthread_cond_destroy(&all.cv);
    pthread_mutex_destroy(&all.mu);
    free(slot);
    free(st);
}

void td_rpc_stream_destroy(td_rpc_stream_t *st)
{
    if (!st)
        return;
    pthread_mutex_lock(&st->s.mu);
    if (!st->status_done)
        grpc_call_cancel(st->call, NULL);
    while (st->s.posted || st->in_cb || st->end_pending)
        pthread_cond_wait(&st->s.cv, &st->s.mu);
    pthread_mutex_unlock(&st->s.mu);
    if (st->recv)
        grpc_byte_buffer_destroy(st->recv);
    free(st->msg);
    client_call_end(st->ch, st->scope, st->call);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_metadata_array_destroy(&st->md_initial);
    grpc_metadata_array_destroy(&st->md_trailing);
    grpc_slice_unref(st->details);
    if (st->error_string)
        gpr_free(st->error_string);
    rpc_sync_destroy(&st->s);
    free(st);
}
