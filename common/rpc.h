/* rpc.h — gRPC over the C core (libgrpc), the way every tandem process uses it.
 *
 * The idea: one completion queue per call, driven by one thread at a time, so
 * that a handler reads like blocking code (read the request, send messages,
 * finish) while gRPC stays asynchronous underneath. The server's own thread
 * only accepts calls and hands each to a fresh handler thread; clients run their
 * calls in the caller's thread. Payloads are opaque bytes (protobuf-c packs and
 * unpacks them in the callers).
 *
 * Deadlines and cancellation travel both ways: a server call knows the client's
 * deadline and learns of its cancellation (td_rpc_call_cancelled, and every wait
 * returns TD_ERR_CANCELLED); a client call made on behalf of a server call
 * (parent) inherits the parent's deadline and is cancelled with it — this is
 * how the router's upstream calls die with the client's.
 *
 * Another thread (an engine loop) hands work to a handler through its own
 * queue and td_rpc_call_wake(), an empty batch that wakes the handler blocked
 * in td_rpc_call_wait(). TLS with mutual authentication is an option of both
 * sides (td_rpc_tls_t); without it, plain HTTP/2.
 *
 * Threads: a td_rpc_call_t belongs to its handler thread, except
 * td_rpc_call_wake(), which any thread may call while the handler has not
 * finished (the caller's own lock makes sure of that). */
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
    TD_RPC_RESOURCE_EXHAUSTED = 8,
    TD_RPC_FAILED_PRECONDITION = 9,
    TD_RPC_ABORTED = 10,
    TD_RPC_UNIMPLEMENTED = 12,
    TD_RPC_INTERNAL = 13,
    TD_RPC_UNAVAILABLE = 14,
};

/* PEM files; all NULL: no TLS. With ca_file alone a client checks the server;
 * with cert and key as well, both sides authenticate (the server then asks
 * for and checks the client's certificate). */
typedef struct td_rpc_tls {
    const char *ca_file, *cert_file, *key_file;
} td_rpc_tls_t;

/* Starts and stops the gRPC library (reference counted; every process calls
 * init once before anything here and shutdown after destroying everything). */
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

/* ---- server ---- */
typedef struct td_rpc_server td_rpc_server_t;
typedef struct td_rpc_call td_rpc_call_t;
/* Runs in its own thread; must end the call with td_rpc_call_finish() or
 * td_rpc_call_reply(). */
typedef void (*td_rpc_handler_fn)(void *ctx, td_rpc_call_t *call);

/* A server on addr ("127.0.0.1:0" picks a port). */
td_status_t td_rpc_server_create(const char *addr, const td_rpc_tls_t *tls, td_rpc_server_t **out);
/* Registers a method ("/tandem.v1.Tandem/Generate") before start. */
td_status_t td_rpc_server_add(td_rpc_server_t *s, const char *method, td_rpc_handler_fn fn, void *ctx);
/* At most max calls handled at once (before start; 0: no limit): a call past
 * it is answered RESOURCE_EXHAUSTED at once, without a handler. */
void td_rpc_server_set_max_calls(td_rpc_server_t *s, int max);
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
/* Seconds left before the client's deadline (a large number when none). */
double td_rpc_call_time_left(td_rpc_call_t *c);
/* True once the client cancelled, went away or its deadline passed. */
bool td_rpc_call_cancelled(td_rpc_call_t *c);
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
/* Unary success: the reply message and status OK. */
void td_rpc_call_reply(td_rpc_call_t *c, const void *msg, size_t len);

/* ---- client ---- */
typedef struct td_rpc_channel td_rpc_channel_t;
typedef struct td_rpc_stream td_rpc_stream_t;

/* The outcome of a client call: the gRPC code and its message. */
typedef struct td_rpc_result {
    int code;
    char message[512];
} td_rpc_result_t;

td_status_t td_rpc_channel_create(const char *target, const td_rpc_tls_t *tls, td_rpc_channel_t **out);
void td_rpc_channel_destroy(td_rpc_channel_t *ch);
/* Any thread: ends every call in flight on ch with UNAVAILABLE and makes new
 * ones fail the same way at once — for a peer that left (its lease expired),
 * whose calls would otherwise wait for a connection until their deadlines. */
void td_rpc_channel_shutdown(td_rpc_channel_t *ch);
const char *td_rpc_channel_target(const td_rpc_channel_t *ch);

/* A unary call. On TD_OK *resp (malloc'd, the caller frees) holds the reply.
 * Otherwise res says what the server or the transport answered. parent, when
 * not NULL, is the server call this one serves: its deadline and cancellation
 * carry over. */
td_status_t td_rpc_unary(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                         double timeout_s, td_rpc_call_t *parent, uint8_t **resp, size_t *resp_len,
                         td_rpc_result_t *res);

/* A streaming call. With req, the request is sent and the client half-closes
 * (server streaming); with req NULL, messages are sent with td_rpc_stream_write
 * (bidirectional). */
td_status_t td_rpc_stream_open(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                               double timeout_s, td_rpc_call_t *parent, td_rpc_stream_t **out);
td_status_t td_rpc_stream_write(td_rpc_stream_t *st, const void *msg, size_t len, double timeout_s);
/* Reads the next message into the stream's own buffer (reused: no
 * allocation per message once it is large enough); *msg stays valid until
 * the next read or destroy. TD_ERR_NOT_FOUND at the end of the stream (then
 * td_rpc_stream_result says how it ended), TD_ERR_TIMEOUT if none came within
 * wait_s (the read stays posted; call again). */
td_status_t td_rpc_stream_read(td_rpc_stream_t *st, const uint8_t **msg, size_t *len, double wait_s);
/* The final status (waits up to wait_s for it). */
td_status_t td_rpc_stream_result(td_rpc_stream_t *st, double wait_s, td_rpc_result_t *res);
/* Cancels from any thread. */
void td_rpc_stream_cancel(td_rpc_stream_t *st);
void td_rpc_stream_destroy(td_rpc_stream_t *st);

#endif
