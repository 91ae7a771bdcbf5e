/* rpc.h — gRPC over the C core (libgrpc), the way every tandem process uses it.
 *
 * Threads, fixed whatever the number of calls: a few completion-queue
 * threads per process (started by td_rpc_init) receive every completion of
 * every call, server or client, and hand it on — to the thread blocked on
 * that call's condition variable, or to an asynchronous callback. Servers
 * run their handlers on a fixed pool of threads (common/pool.h); a call
 * past the server's limit is answered RESOURCE_EXHAUSTED at once.
 *
 * Two ways to write a handler or a client:
 *  - blocking: a handler reads like blocking code (read the request, send
 *    messages, finish) and a client call waits for its reply; this holds a
 *    pool thread (a handler) or the caller's thread (a client) meanwhile;
 *  - asynchronous, for streams that last: a handler detaches its call
 *    (td_rpc_call_detach) and returns its thread; sends, wake-ups, reads of
 *    an upstream stream and the client's cancel then arrive as callbacks on a
 *    completion-queue thread. Callbacks must not block (no blocking call of
 *    this API in them): they post the next operation, or resume the call on
 *    the pool (td_rpc_call_resume) for anything that waits. The callbacks of
 *    one call never run concurrently with each other.
 *
 * Deadlines and cancellation: a scope (td_rpc_scope_t) is a deadline and a
 * cancel switch that client calls are made under: cancelling it ends them
 * all, and a call made under it gets at most its time left. A server call has
 * one (td_rpc_call_scope: the client's deadline, cancelled when the client
 * goes away); a router request makes its own, whatever transport serves it.
 * Payloads are opaque bytes (protobuf-c packs and unpacks them in the callers).
 * TLS with mutual authentication is an option of both sides (td_rpc_tls_t);
 * without it, plain HTTP/2. */
#ifndef TD_RPC_H
#define TD_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* gRPC status codes we use (grpc_status_code's values). */
enum {
    TD_RPC_OK = 0,
    TD_RPC_CANCELLED = 1,
    TD_RPC_UNKNOWN = 2,
    TD_RPC_INVALID_ARGUMENT = 3,
    TD_RPC_DEADLINE_EXCEEDED = 4,
    TD_RPC_NOT_FOUND = 5,
    TD_RPC_PERMISSION_DENIED = 7,
    TD_RPC_RESOURCE_EXHAUSTED = 8,
    TD_RPC_FAILED_PRECONDITION = 9,
    TD_RPC_ABORTED = 10,
    TD_RPC_OUT_OF_RANGE = 11,
    TD_RPC_UNIMPLEMENTED = 12,
    TD_RPC_INTERNAL = 13,
    TD_RPC_UNAVAILABLE = 14,
    TD_RPC_UNAUTHENTICATED = 16,
};

/* PEM files; all NULL: no TLS. With ca_file alone a client checks the server;
 * with cert and key as well, both sides authenticate (the server then asks
 * for and checks the client's certificate). */
typedef struct td_rpc_tls {
    const char *ca_file, *cert_file, *key_file;
    /* a client's channel only: the roles (td_cert_role_in's comma list) the
     * server's certificate must name, or the connection is refused (a
     * certificate of this cluster is not enough: a worker must be a worker) */
    const char *peer_roles;
} td_rpc_tls_t;

/* The text of a td_rpc_tls_t's PEM files, each NULL where its path is unset;
 * an error naming the file that cannot be read, or a cert without its key. */
typedef struct td_tls_pems {
    char *ca, *cert, *key;
} td_tls_pems_t;
td_status_t td_tls_pems_load(const td_rpc_tls_t *tls, td_tls_pems_t *p);
void td_tls_pems_free(td_tls_pems_t *p);

/* Starts and stops the gRPC library and the completion-queue threads
 * (reference counted, process-wide like gRPC itself: every process calls init
 * once before anything here and shutdown after destroying everything). */
void td_rpc_init(void);
void td_rpc_shutdown(void);

/* The grpc status code a td_status_t maps to, and back. */
int td_rpc_code_of(td_status_t st);
td_status_t td_rpc_status_of(int code);
const char *td_rpc_code_name(int code);

/* The HOST:PORT peers should dial for a server bound to listen ("HOST:PORT",
 * port the bound one): listen's host, except that a wildcard (0.0.0.0, ::,
 * empty) is not an address anyone can reach — then the first up, non-loopback
 * IPv4 address of this machine (127.0.0.1 when it has none). */
void td_rpc_advertise_addr(const char *listen, int port, char *out, size_t cap);

/* ---- scopes ---- */
typedef struct td_rpc_scope td_rpc_scope_t;

/* A scope whose calls end by timeout_s from now (>= 1e8: no deadline). */
td_status_t td_rpc_scope_create(double timeout_s, td_rpc_scope_t **out);
void td_rpc_scope_destroy(td_rpc_scope_t *sc);
/* Any thread: ends every call in flight under sc with CANCELLED; later
 * calls under it fail at once. Idempotent. */
void td_rpc_scope_cancel(td_rpc_scope_t *sc);
bool td_rpc_scope_cancelled(td_rpc_scope_t *sc);
/* Seconds left before its deadline (a large number when none). */
double td_rpc_scope_left(td_rpc_scope_t *sc);

/* ---- server ---- */
typedef struct td_rpc_server td_rpc_server_t;
typedef struct td_rpc_call td_rpc_call_t;
/* Runs on a thread of the server's pool; must end the call with
 * td_rpc_call_finish() or td_rpc_call_reply(), or detach it. */
typedef void (*td_rpc_handler_fn)(void *ctx, td_rpc_call_t *call);
/* An asynchronous event of a call (a write done, a wake-up, a cancel), on a
 * completion-queue thread; ok: the operation succeeded. */
typedef void (*td_rpc_event_fn)(void *ctx, bool ok);

/* A server on addr ("127.0.0.1:0" picks a port). */
td_status_t td_rpc_server_create(const char *addr, const td_rpc_tls_t *tls, td_rpc_server_t **out);
/* Registers a method ("/tandem.v1.Tandem/Generate") before start. */
td_status_t td_rpc_server_add(td_rpc_server_t *s, const char *method, td_rpc_handler_fn fn, void *ctx);
/* Only peers of these roles may call method (before start; roles is a comma
 * list, "router" or "router,prefill"): a peer's role is its certificate's
 * common name up to the first '-' ("decode-0" is a decode worker), so this
 * needs a mutual-TLS server; any other peer is answered PERMISSION_DENIED,
 * naming its certificate, without a handler. A server without TLS cannot
 * tell peers apart and lets every call through (cluster.plaintext). */
td_status_t td_rpc_server_allow(td_rpc_server_t *s, const char *method, const char *roles);
/* At most max calls open at once, queued, running or detached (before start;
 * default 4096): a call past it is answered RESOURCE_EXHAUSTED at once,
 * without a handler. */
void td_rpc_server_set_max_calls(td_rpc_server_t *s, int max);
/* The largest request message (before start; default and most 64 MiB): a
 * larger one is answered RESOURCE_EXHAUSTED, naming both sizes. */
void td_rpc_server_set_max_message(td_rpc_server_t *s, size_t bytes);
/* Handler threads (before start; default 16). */
void td_rpc_server_set_threads(td_rpc_server_t *s, int threads);
/* Binds and starts serving; *port is the bound port. */
td_status_t td_rpc_server_start(td_rpc_server_t *s, int *port);
/* Stops accepting, lets running calls finish for up to grace_s seconds,
 * cancels the rest and waits for their handlers. */
void td_rpc_server_stop(td_rpc_server_t *s, double grace_s);
void td_rpc_server_destroy(td_rpc_server_t *s);
/* Calls whose handlers are running now. */
int td_rpc_server_active(td_rpc_server_t *s);

/* The request message (valid until finish). */
const uint8_t *td_rpc_call_payload(td_rpc_call_t *c, size_t *len);
const char *td_rpc_call_method(td_rpc_call_t *c);
const char *td_rpc_call_peer(td_rpc_call_t *c);
/* The common name of the peer's certificate ("router", "decode-0"), or ""
 * when the peer showed none (a server without mutual TLS). */
const char *td_rpc_call_identity(td_rpc_call_t *c);
/* The client's initial metadata value of key (lower case) into out (n
 * bytes): false when absent, too long or holding a NUL. */
bool td_rpc_call_metadata(td_rpc_call_t *c, const char *key, char *out, size_t n);
/* Seconds left before the client's deadline (a large number when none). */
double td_rpc_call_time_left(td_rpc_call_t *c);
/* True once the client cancelled, went away or its deadline passed. */
bool td_rpc_call_cancelled(td_rpc_call_t *c);
/* The call's scope: the client's deadline, cancelled when the client goes
 * away; valid until the call is done. */
td_rpc_scope_t *td_rpc_call_scope(td_rpc_call_t *c);
/* Sends one message of a server stream without waiting for the write: the
 * next send (or the status) waits for it first, so one message is in flight
 * at a time and a slow client still holds the sender back. TD_ERR_CANCELLED
 * when the client is gone (learnt now or at the next send). */
td_status_t td_rpc_call_send(td_rpc_call_t *c, const void *msg, size_t len);
/* Waits for td_rpc_call_wake() (TD_OK), cancellation (TD_ERR_CANCELLED) or
 * timeout_s (TD_ERR_TIMEOUT). A wake that came earlier returns at once. */
td_status_t td_rpc_call_wait(td_rpc_call_t *c, double timeout_s);
/* Any thread: wakes the handler's td_rpc_call_wait(). */
void td_rpc_call_wake(td_rpc_call_t *c);
/* Ends the call with a status and message (printf style). */
void td_rpc_call_finish(td_rpc_call_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* A trailing metadata pair (a lower-case key) to send with the status, e.g.
 * retry-after-ms on an early rejection; a key set again takes the new value.
 * At most TD_RPC_MAX_TRAILERS keys (one more is dropped, with a warning). */
#define TD_RPC_MAX_TRAILERS 4
void td_rpc_call_set_trailer(td_rpc_call_t *c, const char *key, const char *value);
/* Unary success: the reply message and status OK. */
void td_rpc_call_reply(td_rpc_call_t *c, const void *msg, size_t len);

/* -- asynchronous server calls -- */
/* The handler keeps the call open after it returns; some thread later ends
 * it with finish (or reply) and then td_rpc_call_done. */
void td_rpc_call_detach(td_rpc_call_t *c);
/* Ends a detached call (finished or not: then INTERNAL). Not on a
 * completion-queue thread. c is gone after it. */
void td_rpc_call_done(td_rpc_call_t *c);
/* Runs fn(ctx, c) on the server's pool as the call's handler again (for a
 * callback with something to wait for): the call ends when fn returns,
 * unless fn detaches it again. */
td_status_t td_rpc_call_resume(td_rpc_call_t *c, td_rpc_handler_fn fn, void *ctx);
/* Sends one message and calls done(ctx, ok) once it is written (ok false:
 * the client is gone). One send at a time: the next waits for done. */
td_status_t td_rpc_call_send_async(td_rpc_call_t *c, const void *msg, size_t len, td_rpc_event_fn done, void *ctx);
/* From now on every td_rpc_call_wake() (coalesced) and the client's cancel
 * call fn(ctx, true) on the call's completion-queue thread, until the call
 * is finished; fn NULL turns it off and, off a completion-queue thread, waits
 * for any callback of the call under way (then the callbacks' context may be
 * freed). The first call runs once at once, for the wakes that came before. */
void td_rpc_call_on_wake(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx);
/* fn(ctx, true) once, on a completion-queue thread, if the client cancels or
 * goes away before the call is finished (at once, in this thread, if it is
 * gone already); fn NULL turns it off and, off a completion-queue thread,
 * waits for any callback of the call under way. */
void td_rpc_call_on_cancel(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx);

/* ---- client ---- */
typedef struct td_rpc_channel td_rpc_channel_t;
typedef struct td_rpc_stream td_rpc_stream_t;

/* The outcome of a client call: the gRPC code and its message. */
typedef struct td_rpc_result {
    int code;
    char message[512];
    uint32_t retry_after_ms; /* the server's retry-after-ms trailing metadata (0: none) */
    char rejected_early[8];  /* its rejected-early trailing metadata: the SLO a request was refused for ("": none) */
} td_rpc_result_t;

td_status_t td_rpc_channel_create(const char *target, const td_rpc_tls_t *tls, td_rpc_channel_t **out);
/* tls with peer_roles set to roles, in copy (NULL when tls is: no TLS). */
static inline const td_rpc_tls_t *td_rpc_tls_peer(const td_rpc_tls_t *tls, const char *roles, td_rpc_tls_t *copy)
{
    if (!tls)
        return NULL;
    *copy = *tls;
    copy->peer_roles = roles;
    return copy;
}
void td_rpc_channel_destroy(td_rpc_channel_t *ch);
/* Calls on ch fail at once when there is no connection (UNAVAILABLE)
 * instead of waiting for one until their deadlines (before any call). */
void td_rpc_channel_set_fail_fast(td_rpc_channel_t *ch, bool on);
/* True while ch cannot connect (its last attempt failed and it waits to try
 * again): a call on it would fail or wait. */
bool td_rpc_channel_down(const td_rpc_channel_t *ch);
/* True once the server showed a certificate outside the channel's
 * peer_roles: its calls end PERMISSION_DENIED, naming what it showed. */
bool td_rpc_channel_peer_refused(const td_rpc_channel_t *ch);
/* Every call on ch from now on sends "authorization: value" (NULL or "":
 * none); set before the channel's first call. */
void td_rpc_channel_set_authorization(td_rpc_channel_t *ch, const char *value);
/* Any thread: ends every call in flight on ch with UNAVAILABLE and makes new
 * ones fail the same way at once — for a peer that left (its lease expired),
 * whose calls would otherwise wait for a connection until their deadlines. */
void td_rpc_channel_shutdown(td_rpc_channel_t *ch);
const char *td_rpc_channel_target(const td_rpc_channel_t *ch);

/* A unary call. On TD_OK *resp (malloc'd, the caller frees) holds the reply.
 * Otherwise res says what the server or the transport answered. scope, when
 * not NULL, bounds its deadline and cancels it. */
td_status_t td_rpc_unary(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                         double timeout_s, td_rpc_scope_t *scope, uint8_t **resp, size_t *resp_len,
                         td_rpc_result_t *res);

/* Many unary calls at once, all within one timeout (a status page asking
 * every peer: the slowest bounds it, not the sum). Each call's fields in,
 * its outcome out: rc TD_OK with resp (malloc'd, the caller frees), or the
 * error with res saying what the server or the transport answered. A call
 * with ch NULL is skipped (its rc and res stay as the caller set them). */
typedef struct td_rpc_unary_call {
    td_rpc_channel_t *ch;
    const char *method;
    const void *req;
    size_t req_len;
    td_status_t rc;
    uint8_t *resp;
    size_t resp_len;
    td_rpc_result_t res;
} td_rpc_unary_call_t;
void td_rpc_unary_all(td_rpc_unary_call_t *calls, size_t n, double timeout_s);

/* A streaming call. With req, the request is sent and the client half-closes
 * (server streaming); with req NULL, messages are sent with td_rpc_stream_write
 * (bidirectional). */
td_status_t td_rpc_stream_open(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                               double timeout_s, td_rpc_scope_t *scope, td_rpc_stream_t **out);
td_status_t td_rpc_stream_write(td_rpc_stream_t *st, const void *msg, size_t len, double timeout_s);
/* Reads the next message into the stream's own buffer (reused: no
 * allocation per message once it is large enough); *msg stays valid until
 * the next read or destroy. TD_ERR_NOT_FOUND at the end of the stream (then
 * td_rpc_stream_result says how it ended), TD_ERR_TIMEOUT if none came within
 * wait_s (the read stays posted; call again). */
td_status_t td_rpc_stream_read(td_rpc_stream_t *st, const uint8_t **msg, size_t *len, double wait_s);
/* A read whose outcome arrives as cb(ctx, rc, msg, len) on a
 * completion-queue thread: TD_OK with the message (valid during cb), or
 * TD_ERR_NOT_FOUND at the end of the stream, called once the final status is
 * in (td_rpc_stream_result with wait 0 then answers). cb may post the next
 * read; one read at a time. */
typedef void (*td_rpc_read_fn)(void *ctx, td_status_t rc, const uint8_t *msg, size_t len);
td_status_t td_rpc_stream_read_async(td_rpc_stream_t *st, td_rpc_read_fn cb, void *ctx);
/* The final status (waits up to wait_s for it). */
td_status_t td_rpc_stream_result(td_rpc_stream_t *st, double wait_s, td_rpc_result_t *res);
/* Cancels from any thread. */
void td_rpc_stream_cancel(td_rpc_stream_t *st);
/* Cancels it if still open and waits for its operations; not on a
 * completion-queue thread. */
void td_rpc_stream_destroy(td_rpc_stream_t *st);

#endif
