/* test_net.c — the gRPC layer (common/rpc) between real servers and clients on
 * 127.0.0.1, and the etcd client (common/etcd) against a real etcd started
 * here the way `tandem up` starts it. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/certs.h"
#include "common/etcd.h"
#include "common/rpc.h"
#include "common/rpc_pb.h"
#include "common/log.h"
#include "tandem/internal/v1/worker.pb-c.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&t, NULL);
}

/* ---- handlers ---- */
static void h_echo(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    size_t n;
    const uint8_t *p = td_rpc_call_payload(c, &n);
    if (n == 4 && !memcmp(p, "fail", 4)) {
        td_rpc_call_finish(c, TD_RPC_INVALID_ARGUMENT, "field x: bad");
        return;
    }
    td_rpc_call_reply(c, p, n);
}

static volatile int g_stream_saw_cancel;

/* streams the payload's count of messages, one per 20 ms */
static void h_count(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    size_t n;
    const uint8_t *p = td_rpc_call_payload(c, &n);
    char num[16] = "";
    memcpy(num, p, n < sizeof num - 1 ? n : sizeof num - 1); /* the payload is not NUL-terminated */
    int count = atoi(num);
    for (int i = 0; i < count; i++) {
        char m[16];
        int l = snprintf(m, sizeof m, "%d", i);
        if (td_rpc_call_send(c, m, (size_t)l)) {
            g_stream_saw_cancel = 1;
            td_rpc_call_finish(c, TD_RPC_CANCELLED, "gone");
            return;
        }
        if (td_rpc_call_wait(c, 0.02) == TD_ERR_CANCELLED) {
            g_stream_saw_cancel = 1;
            td_rpc_call_finish(c, TD_RPC_CANCELLED, "gone");
            return;
        }
    }
    td_rpc_call_finish(c, TD_RPC_OK, NULL);
}

/* another thread wakes the handler, which then replies */
static void *waker(void *arg)
{
    sleep_s(0.05);
    td_rpc_call_wake(arg);
    return NULL;
}

static void h_wake(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    pthread_t t;
    pthread_create(&t, NULL, waker, c);
    td_status_t rc = td_rpc_call_wait(c, 5);
    pthread_join(t, NULL);
    td_rpc_call_reply(c, rc == TD_OK ? "woken" : "timeout", rc == TD_OK ? 5 : 7);
}

/* answers after 3 s (or when the client gives up) */
static void h_slow(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    td_rpc_call_wait(c, 3);
    td_rpc_call_reply(c, "late", 4);
}

/* relays h_count of a second server, as the router does (parent propagation) */
static td_rpc_channel_t *g_upstream;
static void h_relay(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    size_t n;
    const uint8_t *p = td_rpc_call_payload(c, &n);
    td_rpc_stream_t *st;
    if (td_rpc_stream_open(g_upstream, "/t.T/Count", p, n, 30, td_rpc_call_scope(c), &st)) {
        td_rpc_call_finish(c, TD_RPC_UNAVAILABLE, "upstream: %s", td_last_error());
        return;
    }
    const uint8_t *m;
    size_t l;
    while (td_rpc_stream_read(st, &m, &l, 30) == TD_OK) {
        td_status_t rc = td_rpc_call_send(c, m, l);
        if (rc)
            break;
    }
    td_rpc_result_t res;
    td_rpc_stream_result(st, 5, &res);
    td_rpc_stream_destroy(st);
    td_rpc_call_finish(c, res.code, "%s", res.message);
}

static td_rpc_server_t *start_server(int *port)
{
    td_rpc_server_t *s;
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", NULL, &s), TD_OK);
    td_rpc_server_add(s, "/t.T/Echo", h_echo, NULL);
    td_rpc_server_add(s, "/t.T/Count", h_count, NULL);
    td_rpc_server_add(s, "/t.T/Wake", h_wake, NULL);
    td_rpc_server_add(s, "/t.T/Relay", h_relay, NULL);
    td_rpc_server_add(s, "/t.T/Slow", h_slow, NULL);
    cr_assert_eq(td_rpc_server_start(s, port), TD_OK);
    return s;
}

static void init(void) { td_rpc_init(); }
static void fini(void) { td_rpc_shutdown(); }

Test(rpc, unary_stream_errors, .init = init, .fini = fini, .timeout = 60)
{
    int port;
    td_rpc_server_t *s = start_server(&port);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    td_rpc_channel_t *ch;
    cr_assert_eq(td_rpc_channel_create(target, NULL, &ch), TD_OK);
    uint8_t *r;
    size_t rl;
    td_rpc_result_t res;
    cr_assert_eq(td_rpc_unary(ch, "/t.T/Echo", "hello", 5, 5, NULL, &r, &rl, &res), TD_OK);
    cr_assert_eq(rl, 5);
    cr_assert(!memcmp(r, "hello", 5));
    free(r);
    /* an empty message is a message */
    cr_assert_eq(td_rpc_unary(ch, "/t.T/Echo", "", 0, 5, NULL, &r, &rl, &res), TD_OK);
    cr_assert_eq(rl, 0);
    free(r);
    cr_assert_eq(td_rpc_unary(ch, "/t.T/Echo", "fail", 4, 5, NULL, &r, &rl, &res), TD_ERR_INVALID_ARG);
    cr_assert_eq(res.code, TD_RPC_INVALID_ARGUMENT);
    cr_assert_str_eq(res.message, "field x: bad");
    cr_assert_eq(td_rpc_unary(ch, "/t.T/Nope", "x", 1, 5, NULL, &r, &rl, &res), TD_ERR_UNSUPPORTED);
    cr_assert_eq(res.code, TD_RPC_UNIMPLEMENTED);
    cr_assert_eq(td_rpc_unary(ch, "/t.T/Wake", "x", 1, 5, NULL, &r, &rl, &res), TD_OK);
    cr_assert(rl == 5 && !memcmp(r, "woken", 5));
    free(r);

    /* a stream of 5 */
    td_rpc_stream_t *st;
    cr_assert_eq(td_rpc_stream_open(ch, "/t.T/Count", "5", 1, 10, NULL, &st), TD_OK);
    int got = 0;
    const uint8_t *m;
    size_t ml;
    while (td_rpc_stream_read(st, &m, &ml, 5) == TD_OK) {
        char want[16];
        snprintf(want, sizeof want, "%d", got++);
        cr_assert(ml == strlen(want) && !memcmp(m, want, ml));
    }
    cr_assert_eq(got, 5);
    cr_assert_eq(td_rpc_stream_result(st, 5, &res), TD_OK);
    td_rpc_stream_destroy(st);

    /* a deadline shorter than the stream: DEADLINE_EXCEEDED, in time */
    double t0 = now_s();
    cr_assert_eq(td_rpc_stream_open(ch, "/t.T/Count", "1000", 4, 0.2, NULL, &st), TD_OK);
    while (td_rpc_stream_read(st, &m, &ml, 5) == TD_OK)
        ;
    cr_assert_eq(td_rpc_stream_result(st, 5, &res), TD_ERR_TIMEOUT);
    cr_assert_lt(now_s() - t0, 2.0);
    td_rpc_stream_destroy(st);

    /* the client cancels: the handler learns of it */
    g_stream_saw_cancel = 0;
    cr_assert_eq(td_rpc_stream_open(ch, "/t.T/Count", "1000", 4, 30, NULL, &st), TD_OK);
    cr_assert_eq(td_rpc_stream_read(st, &m, &ml, 5), TD_OK);
    td_rpc_stream_cancel(st);
    td_rpc_stream_destroy(st);
    for (int i = 0; i < 200 && !g_stream_saw_cancel; i++)
        sleep_s(0.01);
    cr_assert(g_stream_saw_cancel, "the server never saw the cancellation");

    /* many calls at once under one deadline: two slow peers cost it once, not twice; an error and an empty
     * reply say what they were; a call without a channel is left as it was */
    td_rpc_unary_call_t all[6] = {
        {.ch = ch, .method = "/t.T/Echo", .req = "hi", .req_len = 2},
        {.ch = ch, .method = "/t.T/Slow"},
        {.ch = ch, .method = "/t.T/Slow"},
        {.ch = ch, .method = "/t.T/Echo", .req = "fail", .req_len = 4},
        {.ch = ch, .method = "/t.T/Count", .req = "0", .req_len = 1},
        {.ch = NULL, .rc = TD_ERR_UNAVAILABLE},
    };
    t0 = now_s();
    td_rpc_unary_all(all, 6, 0.5);
    double took = now_s() - t0;
    cr_assert(all[0].rc == TD_OK && all[0].resp_len == 2 && !memcmp(all[0].resp, "hi", 2));
    cr_assert(all[1].rc == TD_ERR_TIMEOUT && all[2].rc == TD_ERR_TIMEOUT, "slow calls: %d %d", all[1].rc, all[2].rc);
    cr_assert(strstr(all[1].res.message, "/t.T/Slow did not answer within 0.5 s"), "%s", all[1].res.message);
    cr_assert_eq(all[3].rc, TD_ERR_INVALID_ARG, "an error reply: %d (%s)", all[3].rc, all[3].res.message);
    cr_assert_str_eq(all[3].res.message, "field x: bad");
    cr_assert_eq(all[4].rc, TD_ERR_FORMAT, "a reply with no message: %d (%s)", all[4].rc, all[4].res.message);
    cr_assert(all[5].rc == TD_ERR_UNAVAILABLE && !all[5].resp);
    cr_assert(took >= 0.45 && took < 0.9, "two slow calls under one 0.5 s deadline took %.2f s", took);
    for (int i = 0; i < 6; i++)
        free(all[i].resp);

    /* the same with messages: a reply unpacked; one that does not parse as the descriptor says so; a slow one
     * times out; a call without a channel is left as it was */
    uint64_t ids[2] = {7, 8};
    Tandem__Internal__V1__ExtendLandingRequest ext = TANDEM__INTERNAL__V1__EXTEND_LANDING_REQUEST__INIT;
    ext.n_reservation_ids = 2, ext.reservation_ids = ids, ext.has_until_unix_ms = 1, ext.until_unix_ms = 42;
    Tandem__Internal__V1__StatsResponse sr = TANDEM__INTERNAL__V1__STATS_RESPONSE__INIT;
    sr.role = "decode"; /* field 2 a string, where ExtendLandingRequest's field 2 is a number */
    const ProtobufCMessageDescriptor *ed = &tandem__internal__v1__extend_landing_request__descriptor;
    td_rpc_unary_pb_call_t pb[4] = {
        {.ch = ch, .method = "/t.T/Echo", .msg = &ext.base, .desc = ed},
        {.ch = ch, .method = "/t.T/Echo", .msg = &sr.base, .desc = ed},
        {.ch = ch, .method = "/t.T/Slow", .msg = &ext.base, .desc = ed},
        {.ch = NULL, .rc = TD_ERR_UNAVAILABLE, .method = "/t.T/Echo", .msg = &ext.base, .desc = ed},
    };
    td_rpc_unary_all_pb(pb, 4, 0.5);
    Tandem__Internal__V1__ExtendLandingRequest *back = (Tandem__Internal__V1__ExtendLandingRequest *)pb[0].reply;
    cr_assert(pb[0].rc == TD_OK && back && back->n_reservation_ids == 2 && back->reservation_ids[1] == 8 &&
                  back->until_unix_ms == 42, "%d %s", pb[0].rc, pb[0].res.message);
    protobuf_c_message_free_unpacked(pb[0].reply, NULL);
    cr_assert(pb[1].rc == TD_ERR_FORMAT && !pb[1].reply && strstr(pb[1].res.message, "does not parse"), "%d %s",
              pb[1].rc, pb[1].res.message);
    cr_assert(pb[2].rc == TD_ERR_TIMEOUT && !pb[2].reply, "%d %s", pb[2].rc, pb[2].res.message);
    cr_assert(pb[3].rc == TD_ERR_UNAVAILABLE && !pb[3].reply);

    td_rpc_channel_destroy(ch);
    td_rpc_server_stop(s, 1);
    td_rpc_server_destroy(s);

    /* a dead port: the call waits for a connection, but no longer than its deadline */
    cr_assert_eq(td_rpc_channel_create(target, NULL, &ch), TD_OK);
    t0 = now_s();
    cr_assert_eq(td_rpc_unary(ch, "/t.T/Echo", "x", 1, 0.5, NULL, &r, &rl, &res), TD_ERR_TIMEOUT);
    cr_assert_lt(now_s() - t0, 1.5);
    td_rpc_channel_destroy(ch);
}

Test(rpc, cancel_propagates_through_a_relay, .init = init, .fini = fini, .timeout = 60)
{
    int p1, p2;
    td_rpc_server_t *up = start_server(&p1), *front = start_server(&p2);
    char t1[64], t2[64];
    snprintf(t1, sizeof t1, "127.0.0.1:%d", p1);
    snprintf(t2, sizeof t2, "127.0.0.1:%d", p2);
    cr_assert_eq(td_rpc_channel_create(t1, NULL, &g_upstream), TD_OK);
    td_rpc_channel_t *ch;
    cr_assert_eq(td_rpc_channel_create(t2, NULL, &ch), TD_OK);
    g_stream_saw_cancel = 0;
    td_rpc_stream_t *st;
    cr_assert_eq(td_rpc_stream_open(ch, "/t.T/Relay", "1000", 4, 30, NULL, &st), TD_OK);
    const uint8_t *m;
    size_t ml;
    cr_assert_eq(td_rpc_stream_read(st, &m, &ml, 5), TD_OK);
    td_rpc_stream_cancel(st);
    td_rpc_stream_destroy(st);
    for (int i = 0; i < 300 && !g_stream_saw_cancel; i++)
        sleep_s(0.01);
    cr_assert(g_stream_saw_cancel, "the upstream handler never saw the client's cancellation");
    /* the relay's handler may still be ending its upstream stream (a loaded machine: ASan once caught the channel
     * freed under it): its server stops, waiting for it, before the upstream channel goes */
    td_rpc_channel_destroy(ch);
    td_rpc_server_stop(front, 1);
    td_rpc_server_destroy(front);
    td_rpc_channel_destroy(g_upstream);
    td_rpc_server_stop(up, 1);
    td_rpc_server_destroy(up);
}

/* ---- TLS: certificates made here by openssl (a CA, a server certificate
 * for 127.0.0.1, a client certificate, and a second CA that signed nothing) */
static char g_pki[128];

static void pki_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", g_pki, name); }

static void pki_make(void)
{
    td_rpc_init();
    snprintf(g_pki, sizeof g_pki, "/tmp/tandem-test-pki-XXXXXX");
    cr_assert(mkdtemp(g_pki));
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && exec >/dev/null 2>&1 && "
             "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext && "
             "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=test-ca -keyout ca.key -out ca.pem && "
             "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=other-ca -keyout other.key -out other.pem && "
             "openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key -out server.csr && "
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext "
             "-out server.pem && "
             "openssl req -newkey rsa:2048 -nodes -subj /CN=client -keyout client.key -out client.csr && "
             "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out client.pem && "
             "openssl req -newkey rsa:2048 -nodes -subj /CN=router-1 -keyout router.key -out router.csr && "
             "openssl x509 -req -in router.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out router.pem",
             g_pki);
    cr_assert_eq(system(cmd), 0, "openssl could not make the test certificates");
}

static void pki_drop(void)
{
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_pki);
    if (system(cmd)) {
    }
    td_rpc_shutdown();
}

/* one Echo over a fresh channel; TD_OK or why not (g_echo_msg) */
static char g_echo_msg[512];
static td_status_t echo_over(const char *target, const td_rpc_tls_t *tls, double timeout)
{
    td_rpc_channel_t *ch;
    td_status_t rc = td_rpc_channel_create(target, tls, &ch);
    if (rc)
        return rc;
    uint8_t *r = NULL;
    size_t rl = 0;
    td_rpc_result_t res;
    rc = td_rpc_unary(ch, "/t.T/Echo", "tls", 3, timeout, NULL, &r, &rl, &res);
    snprintf(g_echo_msg, sizeof g_echo_msg, "%s", rc ? res.message : "");
    if (rc == TD_OK && (rl != 3 || memcmp(r, "tls", 3)))
        rc = TD_ERR_INTERNAL;
    free(r);
    td_rpc_channel_destroy(ch);
    return rc;
}

static td_rpc_server_t *start_tls_server(const td_rpc_tls_t *tls, char *target, size_t n)
{
    td_rpc_server_t *s;
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", tls, &s), TD_OK, "%s", td_last_error());
    td_rpc_server_add(s, "/t.T/Echo", h_echo, NULL);
    int port;
    cr_assert_eq(td_rpc_server_start(s, &port), TD_OK, "%s", td_last_error());
    snprintf(target, n, "127.0.0.1:%d", port);
    return s;
}

Test(rpc, tls_server_and_mutual, .init = pki_make, .fini = pki_drop, .timeout = 90)
{
    char ca[160], other[160], scert[160], skey[160], ccert[160], ckey[160], target[64];
    pki_path(ca, sizeof ca, "ca.pem");
    pki_path(other, sizeof other, "other.pem");
    pki_path(scert, sizeof scert, "server.pem");
    pki_path(skey, sizeof skey, "server.key");
    pki_path(ccert, sizeof ccert, "client.pem");
    pki_path(ckey, sizeof ckey, "client.key");

    /* server-authenticated TLS */
    td_rpc_tls_t stls = {.cert_file = scert, .key_file = skey};
    td_rpc_server_t *s = start_tls_server(&stls, target, sizeof target);
    td_rpc_tls_t trust = {.ca_file = ca}, wrong = {.ca_file = other};
    cr_assert_eq(echo_over(target, &trust, 5), TD_OK, "a client that trusts the CA must get through");
    double t0 = now_s();
    cr_assert_neq(echo_over(target, NULL, 1), TD_OK, "a plaintext client must not get through");
    cr_assert(strstr(g_echo_msg, "TLS"), "the error should name the likely cause: %s", g_echo_msg);
    cr_assert_neq(echo_over(target, &wrong, 1), TD_OK, "a client trusting another CA must refuse the server");
    cr_assert_lt(now_s() - t0, 4.0, "refused handshakes must end within the calls' deadlines");
    td_rpc_server_stop(s, 1);
    td_rpc_server_destroy(s);

    /* mutual TLS: the server asks for a client certificate signed by its CA */
    td_rpc_tls_t mtls = {.ca_file = ca, .cert_file = scert, .key_file = skey};
    s = start_tls_server(&mtls, target, sizeof target);
    td_rpc_tls_t client = {.ca_file = ca, .cert_file = ccert, .key_file = ckey};
    cr_assert_eq(echo_over(target, &client, 5), TD_OK, "a client with a CA-signed certificate must get through");
    cr_assert_neq(echo_over(target, &trust, 1), TD_OK, "a client without a certificate must be refused");
    td_rpc_server_stop(s, 1);
    td_rpc_server_destroy(s);

    /* configuration errors name the file or the missing half */
    td_rpc_channel_t *ch;
    td_rpc_tls_t missing = {.ca_file = "/nonexistent/ca.pem"};
    cr_assert_eq(td_rpc_channel_create("127.0.0.1:1", &missing, &ch), TD_ERR_IO);
    cr_assert(strstr(td_last_error(), "/nonexistent/ca.pem"), "%s", td_last_error());
    td_rpc_tls_t half = {.cert_file = scert};
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", &half, &s), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "key_file"), "%s", td_last_error());
}

/* A method only some roles may call: the peer's certificate CN decides
 * (its name up to the first '-'), and the refusal names the certificate. */
Test(rpc, roles_by_certificate, .init = pki_make, .fini = pki_drop, .timeout = 90)
{
    char ca[160], scert[160], skey[160], ccert[160], ckey[160], rcert[160], rkey[160], target[64];
    pki_path(ca, sizeof ca, "ca.pem");
    pki_path(scert, sizeof scert, "server.pem");
    pki_path(skey, sizeof skey, "server.key");
    pki_path(ccert, sizeof ccert, "client.pem");
    pki_path(ckey, sizeof ckey, "client.key");
    pki_path(rcert, sizeof rcert, "router.pem");
    pki_path(rkey, sizeof rkey, "router.key");
    td_rpc_tls_t mtls = {.ca_file = ca, .cert_file = scert, .key_file = skey};
    td_rpc_server_t *s;
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", &mtls, &s), TD_OK, "%s", td_last_error());
    td_rpc_server_add(s, "/t.T/Echo", h_echo, NULL);
    cr_assert_eq(td_rpc_server_allow(s, "/t.T/Echo", "prefill,router"), TD_OK);
    cr_assert_neq(td_rpc_server_allow(s, "/t.T/Nope", "router"), TD_OK, "an unregistered method is an error");
    int port;
    cr_assert_eq(td_rpc_server_start(s, &port), TD_OK, "%s", td_last_error());
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    td_rpc_tls_t router = {.ca_file = ca, .cert_file = rcert, .key_file = rkey};
    td_rpc_tls_t client = {.ca_file = ca, .cert_file = ccert, .key_file = ckey};
    cr_assert_eq(echo_over(target, &router, 5), TD_OK, "router-1 is a router: %s", g_echo_msg);
    cr_assert_eq(echo_over(target, &client, 5), TD_ERR_INTERNAL, "client is not a router or prefill worker");
    cr_assert(strstr(g_echo_msg, "CN \"client\"") && strstr(g_echo_msg, "prefill,router"), "%s", g_echo_msg);
    td_rpc_server_stop(s, 1);
    td_rpc_server_destroy(s);

    cr_assert(td_cert_role_in("router", "router"));
    cr_assert(td_cert_role_in("decode,router", "decode-12"));
    cr_assert(!td_cert_role_in("decode", "decoder-1"));
    cr_assert(!td_cert_role_in("router", "-router"));
    cr_assert(!td_cert_role_in("router", ""));
}

/* Grants: signed with a process's key (RSA here, ECDSA from tandem certs),
 * checked against the CA, the signer's role and the exact bytes. */
Test(certs, grants, .init = pki_make, .fini = pki_drop, .timeout = 60)
{
    char ca[160], rcert[160], rkey[160], ocert[160], okey[160];
    pki_path(ca, sizeof ca, "ca.pem");
    pki_path(rcert, sizeof rcert, "router.pem");
    pki_path(rkey, sizeof rkey, "router.key");
    pki_path(ocert, sizeof ocert, "other.pem");
    pki_path(okey, sizeof okey, "other.key");
    td_signer_t *sg, *og;
    td_verifier_t *v;
    cr_assert_eq(td_signer_open(rcert, rkey, &sg), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_signer_open(ocert, okey, &og), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_verifier_open(ca, &v), TD_OK, "%s", td_last_error());
    static const char msg[] = "reservation 7: blocks 3, 9, 4";
    uint8_t sig[TD_SIG_MAX], osig[TD_SIG_MAX];
    size_t sl, ol, cl, ocl;
    cr_assert_eq(td_sign(sg, msg, sizeof msg, sig, &sl), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_sign(og, msg, sizeof msg, osig, &ol), TD_OK, "%s", td_last_error());
    const uint8_t *cert = td_signer_cert(sg, &cl), *ocert_der = td_signer_cert(og, &ocl);
    for (int k = 0; k < 2; k++) /* the second time from the kept certificate */
        cr_assert_eq(td_verify(v, cert, cl, "router", msg, sizeof msg, sig, sl), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_verify(v, cert, cl, "decode", msg, sizeof msg, sig, sl), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "not a decode"), "%s", td_last_error());
    char changed[sizeof msg];
    memcpy(changed, msg, sizeof msg);
    changed[sizeof msg - 2] = '5';
    cr_assert_eq(td_verify(v, cert, cl, "router", changed, sizeof msg, sig, sl), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "signature is not"), "%s", td_last_error());
    cr_assert_eq(td_verify(v, ocert_der, ocl, "other", msg, sizeof msg, osig, ol), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "not one the cluster CA signed"), "%s", td_last_error());
    cr_assert_eq(td_verify(v, cert, cl, "router", msg, sizeof msg, osig, ol), TD_ERR_INVALID_ARG,
                 "another key's signature under this certificate");
    cr_assert_eq(td_verify(v, cert, cl - 1, "router", msg, sizeof msg, sig, sl), TD_ERR_INVALID_ARG,
                 "a cut certificate");
    cr_assert_eq(td_verify(v, NULL, 0, "router", msg, sizeof msg, sig, sl), TD_ERR_INVALID_ARG);
    td_signer_t *bad;
    cr_assert_eq(td_signer_open(rcert, "/nonexistent.key", &bad), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "/nonexistent.key"), "%s", td_last_error());
    td_signer_close(sg);
    td_signer_close(og);
    td_verifier_close(v);
}

/* ---- etcd ---- */
static pid_t g_etcd;
static char g_etcd_dir[128], g_etcd_ep[64];

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    bind(fd, (struct sockaddr *)&a, sizeof a);
    getsockname(fd, (struct sockaddr *)&a, &l);
    close(fd);
    return ntohs(a.sin_port);
}

static void etcd_up(void)
{
    snprintf(g_etcd_dir, sizeof g_etcd_dir, "/tmp/tandem-test-etcd-XXXXXX");
    cr_assert(mkdtemp(g_etcd_dir));
    int cp = free_port(), pp = free_port();
    while (pp == cp)
        pp = free_port();
    char client[64], peer[64], cluster[96];
    snprintf(client, sizeof client, "http://127.0.0.1:%d", cp);
    snprintf(peer, sizeof peer, "http://127.0.0.1:%d", pp);
    snprintf(cluster, sizeof cluster, "n0=%s", peer);
    snprintf(g_etcd_ep, sizeof g_etcd_ep, "127.0.0.1:%d", cp);
    g_etcd = fork();
    if (g_etcd == 0) {
        setpgid(0, 0);
        freopen("/dev/null", "w", stdout);
        if (!getenv("TANDEM_TEST_VERBOSE")) freopen("/dev/null", "w", stderr);
        execlp("timeout", "timeout", "120", "etcd", "--name", "n0", "--data-dir", g_etcd_dir,
               "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
               "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster, "--initial-cluster-state",
               "new", (char *)NULL);
        _exit(127);
    }
    td_rpc_init();
    td_etcd_t *e;
    td_etcd_connect(g_etcd_ep, NULL, &e);
    for (int i = 0; i < 100; i++) {
        td_etcd_kvs_t kvs;
        if (td_etcd_get(e, "/probe", false, &kvs) == TD_OK) {
            td_etcd_kvs_free(&kvs);
            td_etcd_destroy(e);
            return;
        }
        sleep_s(0.1);
    }
    td_etcd_destroy(e);
    cr_assert_fail("etcd did not come up on %s", g_etcd_ep);
}

static void etcd_down(void)
{
    if (g_etcd > 0) {
        kill(-g_etcd, SIGTERM);
        waitpid(g_etcd, NULL, 0);
    }
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_etcd_dir);
    if (system(cmd)) {
    }
    td_rpc_shutdown();
}

typedef struct seen {
    pthread_mutex_t mu;
    int puts, dels;
    char last[64];
} seen_t;

static void on_watch(void *ctx, bool put, const td_etcd_kv_t *kv)
{
    seen_t *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (put)
        s->puts++;
    else
        s->dels++;
    snprintf(s->last, sizeof s->last, "%s", kv->key);
    pthread_mutex_unlock(&s->mu);
}

static volatile int g_lost;
static void on_lost(void *ctx)
{
    (void)ctx;
    g_lost = 1;
}

Test(etcd, kv_lease_watch_election, .init = etcd_up, .fini = etcd_down, .timeout = 90)
{
    td_etcd_t *e, *e2;
    cr_assert_eq(td_etcd_connect(g_etcd_ep, NULL, &e), TD_OK);
    cr_assert_eq(td_etcd_connect(g_etcd_ep, NULL, &e2), TD_OK);
    seen_t seen = {.mu = PTHREAD_MUTEX_INITIALIZER};
    td_etcd_watch_t *w;
    cr_assert_eq(td_etcd_watch_start(e2, "/t/", 0, on_watch, NULL, &seen, &w), TD_OK);
    sleep_s(0.3); /* let the watch be created */

    cr_assert_eq(td_etcd_put(e, "/t/a", "1", 1, 0), TD_OK);
    cr_assert_eq(td_etcd_put(e, "/t/b", "two", 3, 0), TD_OK);
    cr_assert_eq(td_etcd_put(e, "/u/c", "3", 1, 0), TD_OK);
    td_etcd_kvs_t kvs;
    cr_assert_eq(td_etcd_get(e, "/t/", true, &kvs), TD_OK);
    cr_assert_eq(kvs.n, 2);
    cr_assert_str_eq(kvs.kv[0].key, "/t/a");
    cr_assert_str_eq((char *)kvs.kv[1].value, "two");
    td_etcd_kvs_free(&kvs);
    cr_assert_eq(td_etcd_get(e, "/t/b", false, &kvs), TD_OK);
    cr_assert_eq(kvs.n, 1);
    td_etcd_kvs_free(&kvs);
    int64_t del;
    cr_assert_eq(td_etcd_delete(e, "/t/a", false, &del), TD_OK);
    cr_assert_eq(del, 1);

    /* a lease: its key lives while kept alive, and goes when it is not */
    int64_t lease;
    cr_assert_eq(td_etcd_lease_grant(e, 2, &lease), TD_OK);
    cr_assert_eq(td_etcd_put(e, "/t/leased", "x", 1, lease), TD_OK);
    cr_assert_eq(td_etcd_keepalive_start(e, lease, 2, on_lost, NULL), TD_OK);
    sleep_s(3.5);
    cr_assert_eq(td_etcd_get(e, "/t/leased", false, &kvs), TD_OK);
    cr_assert_eq(kvs.n, 1, "the key of a kept-alive lease expired");
    td_etcd_kvs_free(&kvs);
    cr_assert(!g_lost);
    td_etcd_keepalive_stop(e);
    sleep_s(3.5);
    cr_assert_eq(td_etcd_get(e, "/t/leased", false, &kvs), TD_OK);
    cr_assert_eq(kvs.n, 0, "the key of an expired lease is still there");
    td_etcd_kvs_free(&kvs);

    /* election: the first candidate wins, the second waits; revoking hands over */
    int64_t l1, l2;
    bool won;
    cr_assert_eq(td_etcd_lease_grant(e, 10, &l1), TD_OK);
    cr_assert_eq(td_etcd_lease_grant(e2, 10, &l2), TD_OK);
    cr_assert_eq(td_etcd_campaign(e, "/t/leader", "one", 3, l1, &won), TD_OK);
    cr_assert(won);
    cr_assert_eq(td_etcd_campaign(e2, "/t/leader", "two", 3, l2, &won), TD_OK);
    cr_assert(!won);
    cr_assert_eq(td_etcd_campaign(e, "/t/leader", "one", 3, l1, &won), TD_OK);
    cr_assert(won, "the holder must still hold it");
    cr_assert_eq(td_etcd_lease_revoke(e, l1), TD_OK);
    cr_assert_eq(td_etcd_campaign(e2, "/t/leader", "two", 3, l2, &won), TD_OK);
    cr_assert(won);

    sleep_s(0.3);
    pthread_mutex_lock(&seen.mu);
    /* puts: /t/a, /t/b, /t/leased, /t/leader x2; deletes: /t/a, /t/leased, /t/leader */
    cr_assert_eq(seen.puts, 5, "watch saw %d puts", seen.puts);
    cr_assert_eq(seen.dels, 3, "watch saw %d deletes", seen.dels);
    pthread_mutex_unlock(&seen.mu);
    td_etcd_watch_stop(w);

    /* a dead etcd: a clear error within the deadline */
    kill(-g_etcd, SIGKILL);
    waitpid(g_etcd, NULL, 0);
    g_etcd = 0;
    double t0 = now_s();
    cr_assert_neq(td_etcd_put(e, "/t/x", "1", 1, 0), TD_OK);
    cr_assert_lt(now_s() - t0, TD_ETCD_TIMEOUT_S + 1);
    td_etcd_destroy(e);
    td_etcd_destroy(e2);
}

/* A worker bound to a wildcard must not advertise it: peers cannot dial
 * 0.0.0.0. A concrete host is kept as it is. */
Test(rpc, advertised_address_is_reachable)
{
    char a[160];
    td_rpc_advertise_addr("10.1.2.3:0", 4321, a, sizeof a);
    cr_assert_str_eq(a, "10.1.2.3:4321");
    td_rpc_advertise_addr("[fd00::7]:0", 99, a, sizeof a);
    cr_assert_str_eq(a, "[fd00::7]:99");
    const char *wild[] = {"0.0.0.0:0", "[::]:0", ":0"};
    for (size_t i = 0; i < 3; i++) {
        td_rpc_advertise_addr(wild[i], 5000, a, sizeof a);
        cr_assert(strncmp(a, "0.0.0.0", 7) && !strstr(a, "::]"), "%s advertised %s", wild[i], a);
        cr_assert(strstr(a, ":5000"), "%s", a);
        /* it is an address of this machine: a server on the wildcard answers there */
        struct in_addr in;
        char host[64];
        snprintf(host, sizeof host, "%.*s", (int)(strrchr(a, ':') - a), a);
        cr_assert_eq(inet_pton(AF_INET, host, &in), 1, "%s is an IPv4 address", host);
    }
    /* a server on the wildcard is reached at the address it advertises */
    td_rpc_init();
    td_rpc_server_t *srv;
    int port;
    cr_assert_eq(td_rpc_server_create("0.0.0.0:0", NULL, &srv), TD_OK);
    cr_assert_eq(td_rpc_server_start(srv, &port), TD_OK);
    td_rpc_advertise_addr("0.0.0.0:0", port, a, sizeof a);
    td_rpc_channel_t *ch;
    cr_assert_eq(td_rpc_channel_create(a, NULL, &ch), TD_OK);
    uint8_t *resp = NULL;
    size_t rl;
    td_rpc_result_t res;
    td_rpc_unary(ch, "/tandem.test.v1.Nothing/Here", "", 0, 5, NULL, &resp, &rl, &res);
    cr_assert_eq(res.code, TD_RPC_UNIMPLEMENTED, "the server answered at %s: %d %s", a, res.code, res.message);
    free(resp);
    td_rpc_channel_destroy(ch);
    td_rpc_server_destroy(srv);
    td_rpc_shutdown();
}

/* What a resync handed over: the keys, as the watcher's state. */
typedef struct members {
    pthread_mutex_t mu;
    char keys[16][64];
    int n, resyncs, puts_after;
} members_t;

static void members_watch(void *ctx, bool put, const td_etcd_kv_t *kv)
{
    members_t *m = ctx;
    pthread_mutex_lock(&m->mu);
    if (put && m->n < 16) {
        snprintf(m->keys[m->n++], sizeof m->keys[0], "%s", kv->key);
        m->puts_after += m->resyncs > 0;
    }
    pthread_mutex_unlock(&m->mu);
}

static void members_resync(void *ctx, const td_etcd_kvs_t *now)
{
    members_t *m = ctx;
    pthread_mutex_lock(&m->mu);
    m->n = 0;
    for (size_t i = 0; i < now->n && i < 16; i++)
        snprintf(m->keys[m->n++], sizeof m->keys[0], "%s", now->kv[i].key);
    m->resyncs++;
    pthread_mutex_unlock(&m->mu);
}

/* A watch resumed from a revision etcd has compacted away (a router that was
 * away, or fell behind): etcd cancels it; the watch re-reads the prefix,
 * hands the watcher the membership as it is (a key deleted in the lost
 * history is not in it), and goes on delivering events. Before: the watch
 * stayed cancelled and every later event was lost. */
Test(etcd, watch_resumes_after_compaction, .init = etcd_up, .fini = etcd_down, .timeout = 60)
{
    td_etcd_t *e;
    cr_assert_eq(td_etcd_connect(g_etcd_ep, NULL, &e), TD_OK);
    cr_assert_eq(td_etcd_put(e, "/w/a", "1", 1, 0), TD_OK);
    td_etcd_kvs_t kvs;
    cr_assert_eq(td_etcd_get(e, "/w/", true, &kvs), TD_OK);
    int64_t old = kvs.revision;
    td_etcd_kvs_free(&kvs);
    cr_assert_eq(td_etcd_put(e, "/w/b", "2", 1, 0), TD_OK);
    int64_t del;
    cr_assert_eq(td_etcd_delete(e, "/w/a", false, &del), TD_OK);
    cr_assert_eq(td_etcd_get(e, "/w/", true, &kvs), TD_OK);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "ETCDCTL_API=3 etcdctl --endpoints %s compact %lld >/dev/null", g_etcd_ep,
             (long long)kvs.revision);
    td_etcd_kvs_free(&kvs);
    cr_assert_eq(system(cmd), 0, "etcdctl compact");
    members_t m = {.mu = PTHREAD_MUTEX_INITIALIZER};
    td_etcd_watch_t *w;
    cr_assert_eq(td_etcd_watch_start(e, "/w/", old + 1, members_watch, members_resync, &m, &w), TD_OK);
    bool synced = false;
    for (int i = 0; i < 50 && !synced; i++) {
        sleep_s(0.1);
        pthread_mutex_lock(&m.mu);
        synced = m.resyncs > 0;
        pthread_mutex_unlock(&m.mu);
    }
    cr_assert(synced, "the watch re-read the prefix after the compaction");
    pthread_mutex_lock(&m.mu);
    cr_assert_eq(m.n, 1, "the membership now: %d keys", m.n);
    cr_assert_str_eq(m.keys[0], "/w/b", "the key deleted in the lost history is gone");
    pthread_mutex_unlock(&m.mu);
    cr_assert_eq(td_etcd_put(e, "/w/c", "3", 1, 0), TD_OK);
    bool after = false;
    for (int i = 0; i < 50 && !after; i++) {
        sleep_s(0.1);
        pthread_mutex_lock(&m.mu);
        after = m.puts_after > 0;
        pthread_mutex_unlock(&m.mu);
    }
    cr_assert(after, "events after the resync are delivered");
    pthread_mutex_lock(&m.mu);
    cr_assert_eq(m.n, 2);
    cr_assert_str_eq(m.keys[1], "/w/c");
    pthread_mutex_unlock(&m.mu);
    td_etcd_watch_stop(w);
    td_etcd_destroy(e);
}

/* A server at its limit of calls answers the next one RESOURCE_EXHAUSTED at
 * once (admission), and serves again when a call ends. */
Test(rpc, calls_past_the_limit_are_refused_at_once, .init = init, .fini = fini, .timeout = 60)
{
    int port;
    td_rpc_server_t *s;
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", NULL, &s), TD_OK);
    td_rpc_server_add(s, "/t.T/Count", h_count, NULL);
    td_rpc_server_add(s, "/t.T/Echo", h_echo, NULL);
    td_rpc_server_set_max_calls(s, 2);
    cr_assert_eq(td_rpc_server_start(s, &port), TD_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    td_rpc_channel_t *ch;
    cr_assert_eq(td_rpc_channel_create(addr, NULL, &ch), TD_OK);
    td_rpc_stream_t *st[2];
    const uint8_t *m;
    size_t ml;
    for (int i = 0; i < 2; i++) { /* two long streams hold both places */
        cr_assert_eq(td_rpc_stream_open(ch, "/t.T/Count", "1000", 4, 30, NULL, &st[i]), TD_OK);
        cr_assert_eq(td_rpc_stream_read(st[i], &m, &ml, 5), TD_OK);
    }
    uint8_t *out = NULL;
    size_t on;
    td_rpc_result_t res;
    double t0 = now_s();
    cr_assert_neq(td_rpc_unary(ch, "/t.T/Echo", "x", 1, 5, NULL, &out, &on, &res), TD_OK);
    cr_assert_eq(res.code, TD_RPC_RESOURCE_EXHAUSTED, "%d %s", res.code, res.message);
    cr_assert(strstr(res.message, "2 calls at once"), "%s", res.message);
    cr_assert_lt(now_s() - t0, 1.0, "refused at once");
    td_rpc_stream_cancel(st[0]);
    td_rpc_stream_destroy(st[0]);
    bool served = false;
    for (int i = 0; i < 50 && !served; i++) {
        served = td_rpc_unary(ch, "/t.T/Echo", "x", 1, 5, NULL, &out, &on, &res) == TD_OK;
        free(out);
        out = NULL;
        if (!served)
            sleep_s(0.05);
    }
    cr_assert(served, "a place freed up: the next call is served");
    td_rpc_stream_cancel(st[1]);
    td_rpc_stream_destroy(st[1]);
    td_rpc_channel_destroy(ch);
    td_rpc_server_destroy(s);
}

/* ---- detached calls: a stream that lasts holds no handler thread ---- */
#define TICK_CALLS 64
typedef struct tick_pump {
    td_rpc_call_t *call;
    int sent;     /* the pump's (its callbacks never overlap) */
    bool sending, ending;
} tick_pump_t;

static pthread_mutex_t g_tick_mu = PTHREAD_MUTEX_INITIALIZER;
static tick_pump_t *g_ticks[TICK_CALLS];
static int g_n_ticks, g_entered;
static volatile bool g_ticking;

static void tick_end(void *ctx, td_rpc_call_t *c)
{
    tick_pump_t *p = ctx;
    pthread_mutex_lock(&g_tick_mu);
    for (int i = 0; i < g_n_ticks; i++)
        if (g_ticks[i] == p) {
            g_ticks[i] = g_ticks[--g_n_ticks];
            break;
        }
    pthread_mutex_unlock(&g_tick_mu);
    td_rpc_call_finish(c, p->sent == 3 ? TD_RPC_OK : TD_RPC_CANCELLED, "tick");
    free(p);
}

static void tick_pump(void *ctx, bool ok);
static void tick_sent(void *ctx, bool ok)
{
    tick_pump_t *p = ctx;
    p->sending = false;
    if (!ok) {
        p->ending = true;
        td_rpc_call_resume(p->call, tick_end, p);
    }
}

static void tick_pump(void *ctx, bool ok)
{
    (void)ok;
    tick_pump_t *p = ctx;
    if (p->sending || p->ending)
        return;
    if (p->sent == 3 || td_rpc_call_cancelled(p->call)) {
        p->ending = true;
        td_rpc_call_on_wake(p->call, NULL, NULL);
        td_rpc_call_resume(p->call, tick_end, p);
        return;
    }
    p->sending = true;
    p->sent++;
    if (td_rpc_call_send_async(p->call, "t", 1, tick_sent, p) != TD_OK) {
        p->sending = false;
        p->ending = true;
        td_rpc_call_resume(p->call, tick_end, p);
    }
}

/* Each wake of the ticker sends one message; the handler returns at once. */
static void h_tick(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    tick_pump_t *p = calloc(1, sizeof *p);
    p->call = c;
    pthread_mutex_lock(&g_tick_mu);
    g_entered++;
    g_ticks[g_n_ticks++] = p;
    pthread_mutex_unlock(&g_tick_mu);
    td_rpc_call_detach(c);
    td_rpc_call_on_wake(c, tick_pump, p); /* runs once now: the first message */
}

static void *ticker(void *arg)
{
    (void)arg;
    while (g_ticking) {
        sleep_s(0.02);
        pthread_mutex_lock(&g_tick_mu);
        for (int i = 0; i < g_n_ticks; i++)
            td_rpc_call_wake(g_ticks[i]->call);
        pthread_mutex_unlock(&g_tick_mu);
    }
    return NULL;
}

Test(rpc, detached_streams_hold_no_handler_thread, .init = init, .fini = fini, .timeout = 60)
{
    int port;
    td_rpc_server_t *s;
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", NULL, &s), TD_OK);
    td_rpc_server_add(s, "/t.T/Tick", h_tick, NULL);
    td_rpc_server_set_threads(s, 1); /* one handler thread for 48 open streams */
    cr_assert_eq(td_rpc_server_start(s, &port), TD_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    td_rpc_channel_t *ch;
    cr_assert_eq(td_rpc_channel_create(addr, NULL, &ch), TD_OK);
    enum { N = 48 };
    td_rpc_stream_t *st[N];
    const uint8_t *m;
    size_t ml;
    for (int i = 0; i < N; i++) { /* every stream open and answering before any is read to its end */
        cr_assert_eq(td_rpc_stream_open(ch, "/t.T/Tick", "x", 1, 30, NULL, &st[i]), TD_OK);
        cr_assert_eq(td_rpc_stream_read(st[i], &m, &ml, 5), TD_OK, "stream %d got its first message", i);
    }
    pthread_mutex_lock(&g_tick_mu);
    int entered = g_entered, open = g_n_ticks;
    pthread_mutex_unlock(&g_tick_mu);
    cr_assert_eq(entered, N, "%d handlers ran on one thread", entered);
    cr_assert_eq(open, N, "%d streams open at once", open);
    cr_assert_geq(td_rpc_server_active(s), N);
    g_ticking = true;
    pthread_t t;
    pthread_create(&t, NULL, ticker, NULL);
    for (int i = 0; i < N; i++) {
        int got = 1;
        while (td_rpc_stream_read(st[i], &m, &ml, 5) == TD_OK)
            got += ml == 1 && m[0] == 't';
        td_rpc_result_t res;
        cr_assert_eq(td_rpc_stream_result(st[i], 5, &res), TD_OK, "%s", res.message);
        cr_assert_eq(got, 3, "stream %d: %d of 3 messages", i, got);
        td_rpc_stream_destroy(st[i]);
    }
    g_ticking = false;
    pthread_join(t, NULL);
    td_rpc_channel_destroy(ch);
    td_rpc_server_destroy(s);
}
