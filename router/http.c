/* http.c — see http.h.
 *
 * libmicrohttpd runs one polling thread (epoll) for every connection. A
 * generation request is parsed there into a tandem.v1 GenerateRequest and
 * started as a router request (choices.h: sampling.n requests) whose sink is the connection: the
 * connection is suspended until the request's first message or its end, and
 * then answered — with the SSE stream (200, chunked) for a streaming request
 * that has begun, or with one JSON body (the completion, or an error whose
 * HTTP status follows its gRPC code). While a stream runs, the sink formats
 * each message into the connection's buffer and resumes the connection; the
 * reader hands the bytes to libmicrohttpd and, once they are all taken,
 * reports the write (rt_choices_sent) so the request sends the next one. The
 * per-token path formats into buffers it reuses: it allocates nothing once
 * they are large enough.
 *
 * Lifetime: an hreq has two owners, libmicrohttpd (until its
 * request-completed callback) and the router request (until the sink's end);
 * the last one frees it. hreq.mu guards what both touch. */
#define _GNU_SOURCE
#include "router/http.h"

#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>

#include "common/clock.h"
#include "common/grow.h"
#include "common/https.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "engine/tokenizer.h"
#include "router/choices.h"
#include "router/http_heads.h"
#include "router/keys.h"
#include "router/openai_req.h"
#include "router/request.h"

#define HTTP_TIMEOUT_S 600.0 /* a request's deadline (HTTP has none of its own) */

struct rt_http {
    rt_requests_t *rs;
    const rt_env_t *env;
    struct MHD_Daemon *d;
    long created; /* for /v1/models */
    td_https_t *https; /* the public API's TLS (router.tls_*), NULL: plain HTTP */
    pthread_mutex_t mu; /* active */
    struct hreq *active; /* generations started and not ended (to cancel them at stop) */
    int open;            /* connections open now (MHD's thread; read by it only) */
    /* The hang-up watcher: a suspended connection is not polled by MHD, so a
     * client that goes away before its answer (a non-streaming request, or a
     * stream before its first chunk) is seen here (EPOLLRDHUP) and cancelled. */
    int ep;
    pthread_t watcher;
    bool watching;
    int stop_watch;      /* atomic */
    uint64_t serial;     /* under mu: names a generation in the watch set */
    int max_open;        /* past which a request is answered 503 and its connection closed */
    rt_heads_t *heads;   /* the connections waiting for a request head (slowloris's), closed when late */
};


/* One choice of a generation (sampling.n): its text so far (a non-streaming
 * request's), its log-probabilities (a chunk's, or the whole answer's: chat's
 * content entries (lp), or completions' tokens (lp), token_logprobs,
 * top_logprobs and text_offset arrays' items, comma-joined) and its end. */
typedef struct choice {
    char *text;
    size_t n_text, cap_text;
    char *lp, *lp_val, *lp_top, *lp_off;
    size_t n_lp, n_lp_val, n_lp_top, n_lp_off, cap_lp, cap_lp_val, cap_lp_top, cap_lp_off;
    size_t lp_at; /* completions' text_offset: the bytes of the tokens before */
    const char *finish;
    bool role_sent, echo_sent;
    char *echoed; /* its first text after the echoed prompt */
    char tool[RT_OAI_TOOL_NAME + 1]; /* the function it calls ("": none, or not yet read back) */
    double logprob; /* its tokens' log-probabilities summed (best_of picks by it) */
} choice_t;

typedef struct hreq {
    rt_http_t *h;
    struct MHD_Connection *conn;
    char *body;
    size_t n_body, cap_body;
    bool too_big;
    /* a generation */
    rt_oai_kind_t kind;
    bool stream, include_usage, begun; /* begun: the request was started */
    char tool[RT_OAI_TOOL_NAME + 1];    /* the function each choice calls (chat's tool_choice), "": text */
    bool any_tool;                      /* each choice calls one of the tools, read back from its text at its end */
    char id[48];
    rt_choices_t *q; /* until the sink's end */
    pthread_mutex_t mu;
    int refs;
    bool suspended, ended, answered, mhd_done, need_sent;
    bool streamed; /* a streaming request has written its first chunk */
    struct hreq *prev, *next; /* in h->active */
    uint64_t serial; /* its name in the hang-up watcher's set */
    int fd;          /* the connection's socket while watched, else -1 */
    int end_code;
    char end_msg[512];
    uint32_t end_retry_ms; /* an early rejection's hint: Retry-After and retry-after-ms */
    const char *end_rejected; /* an early rejection's SLO ("ttft", "tpot"): the rejected-early header */
    char *out; /* bytes for the client: SSE chunks, or the whole JSON body */
    size_t n_out, off_out, cap_out;
    choice_t *ch; /* sampling.n of them */
    uint32_t n_ch;
    uint32_t n_best; /* completions' best_of: the n of highest log-probability answered (0: all) */
    bool logprobs; /* sampling.logprobs, as the client asked (best_of computes them for itself) */
    char *echo;    /* completions' echo: the prompt, written before each choice's text */
    uint32_t prompt_tokens, completion_tokens, cached_tokens; /* completion_tokens: all choices' */
    bool has_usage;
    const rt_key_t *key; /* the caller's, when keys are on (router/keys.h) */
} hreq_t;

/* ---------------------------------------------------------------- helpers */

static void hreq_put(hreq_t *x)
{
    pthread_mutex_lock(&x->mu);
    bool last = --x->refs == 0;
    pthread_mutex_unlock(&x->mu);
    if (!last)
        return;
    pthread_mutex_destroy(&x->mu);
    free(x->body);
    free(x->out);
    for (uint32_t i = 0; i < x->n_ch; i++) {
        choice_t *c = &x->ch[i];
        free(c->text);
        free(c->lp), free(c->lp_val), free(c->lp_top), free(c->lp_off);
        free(c->echoed);
    }
    free(x->ch);
    free(x->echo);
    free(x);
}

/* Appends n bytes to the growing buffer *b (*len bytes of *cap, NUL-terminated); false without memory. */
static bool buf_add(char **b, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (!td_grow((void **)b, cap, *len + n + 1, 1, 1024))
        return false;
    memcpy(*b + *len, s, n);
    *len += n;
    (*b)[*len] = 0;
    return true;
}

/* Appends n bytes of s as the inside of a JSON string (escaped, no quotes). */
static bool buf_json(char **b, size_t *len, size_t *cap, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    for (const unsigned char *p = (const unsigned char *)s; p < (const unsigned char *)s + n; p++) {
        char e[8];
        size_t k = 0;
        switch (*p) {
        case '"': e[k++] = '\\', e[k++] = '"'; break;
        case '\\': e[k++] = '\\', e[k++] = '\\'; break;
        case '\n': e[k++] = '\\', e[k++] = 'n'; break;
        case '\r': e[k++] = '\\', e[k++] = 'r'; break;
        case '\t': e[k++] = '\\', e[k++] = 't'; break;
        default:
            if (*p < 0x20) {
                memcpy(e, "\\u00", 4);
                k = 4;
                e[k++] = hex[*p >> 4];
                e[k++] = hex[*p & 15];
            } else {
                e[k++] = (char)*p;
            }
        }
        if (!buf_add(b, len, cap, e, k))
            return false;
    }
    return true;
}

static bool out_add(hreq_t *x, const char *s, size_t n) { return buf_add(&x->out, &x->n_out, &x->cap_out, s, n); }

static bool out_str(hreq_t *x, const char *s) { return out_add(x, s, strlen(s)); }

/* Appends s as the inside of a JSON string (escaped, no quotes). */
static bool out_json_str(hreq_t *x, const char *s) { return buf_json(&x->out, &x->n_out, &x->cap_out, s, strlen(s)); }

static int http_status_of(int code)
{
    switch (code) {
    case TD_RPC_INVALID_ARGUMENT:
    case TD_RPC_FAILED_PRECONDITION:
        return 400;
    case TD_RPC_NOT_FOUND: return 404;
    case TD_RPC_UNAUTHENTICATED: return 401;
    case TD_RPC_RESOURCE_EXHAUSTED: return 429;
    case TD_RPC_UNAVAILABLE: return 503;
    case TD_RPC_DEADLINE_EXCEEDED: return 504;
    case TD_RPC_CANCELLED: return 499;
    case TD_RPC_UNIMPLEMENTED: return 501;
    default: return 500;
    }
}

static const char *error_type_of(int status)
{
    return status == 400 || status == 404 || status == 413 || status == 401 || status == 415 ? "invalid_request_error"
           : status == 429                                  ? "rate_limit_error"
           : status == 503                                  ? "service_unavailable"
                                                            : "server_error";
}

/* {"error": {...}}: the message; param: the field it names ("sampling.stop"
 * → "stop", "prompt_ids[3]" → "prompt[3]"), taken from the message's "FIELD: ..." prefix when it has one. */
static char *error_json(int status, const char *message, const char *param)
{
    char p[64] = "";
    if (param) {
        snprintf(p, sizeof p, "%s", param);
    } else if (status == 400 || status == 404) {
        const char *colon = strstr(message, ": ");
        size_t n = colon ? (size_t)(colon - message) : 0;
        if (n && n < sizeof p && !memchr(message, ' ', n)) {
            memcpy(p, message, n);
            p[n] = 0;
            const char *dot = strrchr(p, '.');
            if (!strncmp(p, "sampling.", 9) && dot)
                memmove(p, dot + 1, strlen(dot + 1) + 1);
            if (!strcmp(p, "sampling")) { /* "sampling: temperature -1 is outside ..." */
                size_t k = strcspn(message + n + 2, " :");
                if (k && k < sizeof p) {
                    memcpy(p, message + n + 2, k);
                    p[k] = 0;
                }
            } else if (!strcmp(p, "chat"))
                snprintf(p, sizeof p, "messages");
            else if (!strncmp(p, "chat.", 5))
                memmove(p, p + 5, strlen(p + 5) + 1);
            else if (!strncmp(p, "prompt_ids", 10)) /* "prompt_ids[3]" → "prompt[3]" */
                memmove(p + 6, p + 10, strlen(p + 10) + 1);
            /* structured output: the OpenAI field that asks for it */
            if (!strcmp(p, "json_schema") || !strcmp(p, "json_object"))
                snprintf(p, sizeof p, "response_format");
            else if (!strcmp(p, "regex") || !strcmp(p, "choice"))
                snprintf(p, sizeof p, "guided_%s", !strcmp(p, "regex") ? "regex" : "choice");
        }
    }
    json_t *j = json_pack("{s:{s:s, s:s, s:o, s:i}}", "error", "message", message, "type", error_type_of(status),
                          "param", p[0] ? json_string(p) : json_null(), "code", status);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* The OpenAI field a request's error names where error_json cannot tell it from the message: a function call's
 * parameters schema is refused as structured output's (sampling.json_schema), but the client sent it in tools. */
static const char *end_param(const hreq_t *x)
{
    return (x->tool[0] || x->any_tool) && !strncmp(x->end_msg, "sampling.json_schema", 20) ? "tools" : NULL;
}

/* retry_ms: a 429's hint, as Retry-After (seconds, rounded up) and retry-after-ms (OpenAI's clients read it);
 * rejected: the SLO an early rejection was for, as rejected-early (NULL: not one) */
static enum MHD_Result respond_retry(struct MHD_Connection *c, int status, char *body_owned, const char *ctype,
                                     uint32_t retry_ms, const char *rejected)
{
    const char *fallback = "{\"error\":{\"message\":\"no memory\",\"type\":\"server_error\",\"param\":null,\"code\":500}}";
    struct MHD_Response *rs =
        body_owned ? MHD_create_response_from_buffer(strlen(body_owned), body_owned, MHD_RESPMEM_MUST_FREE)
                   : MHD_create_response_from_buffer(strlen(fallback), (void *)fallback, MHD_RESPMEM_PERSISTENT);
    if (!rs) {
        free(body_owned);
        return MHD_NO;
    }
    MHD_add_response_header(rs, "Content-Type", ctype ? ctype : "application/json");
    if (status == 429) {
        char sec[16], ms[16];
        snprintf(sec, sizeof sec, "%u", retry_ms ? (retry_ms + 999) / 1000 : 1);
        snprintf(ms, sizeof ms, "%u", retry_ms ? retry_ms : 1000);
        MHD_add_response_header(rs, "Retry-After", sec);
        MHD_add_response_header(rs, "retry-after-ms", ms);
    }
    if (rejected && body_owned)
        MHD_add_response_header(rs, "rejected-early", rejected);
    enum MHD_Result ret = MHD_queue_response(c, body_owned ? (unsigned)status : 500u, rs);
    MHD_destroy_response(rs);
    return ret;
}

static enum MHD_Result respond(struct MHD_Connection *c, int status, char *body_owned, const char *ctype)
{
    return respond_retry(c, status, body_owned, ctype, 0, NULL);
}

/* Too many connections: 503, and this one closed (MHD's own limit, a little
 * higher, leaves room to say so instead of dropping the connection). */
static enum MHD_Result respond_crowded(rt_http_t *h, struct MHD_Connection *c)
{
    char msg[200];
    snprintf(msg, sizeof msg, "%d connections are open, this server's most (2 x router.max_streams + 1024); "
             "close idle ones or try again later", h->max_open);
    char *body = error_json(503, msg, NULL);
    struct MHD_Response *rs = body ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!rs) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(rs, "Content-Type", "application/json");
    MHD_add_response_header(rs, "Retry-After", "1");
    MHD_add_response_header(rs, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(c, 503, rs);
    MHD_destroy_response(rs);
    return ret;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code)
{
    rt_http_t *h = cls;
    h->open += code == MHD_CONNECTION_NOTIFY_STARTED ? 1 : -1;
    if (code == MHD_CONNECTION_NOTIFY_STARTED)
        rt_heads_started(h->heads, c, socket_ctx);
    else
        rt_heads_closed(h->heads, socket_ctx);
}

static enum MHD_Result respond_error(struct MHD_Connection *c, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum MHD_Result respond_error(struct MHD_Connection *c, int status, const char *param, const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return respond(c, status, error_json(status, msg, param), NULL);
}

static enum MHD_Result respond_json(struct MHD_Connection *c, int status, json_t *j)
{
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return respond(c, status, s, NULL);
}

/* ---------------------------------------------------------------- log-probabilities */

static bool utf8_whole(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t k = s[i] < 0x80 ? 1 : (s[i] & 0xe0) == 0xc0 ? 2 : (s[i] & 0xf0) == 0xe0 ? 3 : (s[i] & 0xf8) == 0xf0 ? 4 : 0;
        if (!k || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

/* A token's entry text into b: its bytes where they are whole UTF-8, else "bytes:\xNN..." as vLLM writes a
 * piece of a character; the bytes themselves in raw (*nraw). */
static bool lp_token(hreq_t *x, int32_t id, char **b, size_t *len, size_t *cap, unsigned char *raw, size_t *nraw)
{
    *nraw = eng_tokenizer_token_bytes(x->h->env->input->model->tok, id, (char *)raw, 64);
    if (*nraw > 64)
        *nraw = 64;
    if (utf8_whole(raw, *nraw))
        return buf_json(b, len, cap, (const char *)raw, *nraw);
    bool ok = buf_add(b, len, cap, "bytes:", 6);
    for (size_t i = 0; ok && i < *nraw; i++) {
        char h[8];
        snprintf(h, sizeof h, "\\\\x%02x", raw[i]);
        ok = buf_add(b, len, cap, h, strlen(h));
    }
    return ok;
}

/* chat: {"token": ..., "logprob": ..., "bytes": [...]} (without its closing brace) */
static bool lp_chat_entry(hreq_t *x, choice_t *c, int32_t id, float logprob)
{
    unsigned char raw[64];
    size_t nraw;
    char num[48];
    bool ok = buf_add(&c->lp, &c->n_lp, &c->cap_lp, "{\"token\":\"", 10) &&
              lp_token(x, id, &c->lp, &c->n_lp, &c->cap_lp, raw, &nraw);
    snprintf(num, sizeof num, "\",\"logprob\":%.7g,\"bytes\":[", logprob);
    ok = ok && buf_add(&c->lp, &c->n_lp, &c->cap_lp, num, strlen(num));
    for (size_t i = 0; ok && i < nraw; i++) {
        snprintf(num, sizeof num, "%s%u", i ? "," : "", raw[i]);
        ok = buf_add(&c->lp, &c->n_lp, &c->cap_lp, num, strlen(num));
    }
    return ok && buf_add(&c->lp, &c->n_lp, &c->cap_lp, "]", 1);
}

/* One token's log-probabilities into choice c's buffers: chat's content entry, or completions' items of
 * tokens, token_logprobs, top_logprobs (the sampled token's and the top ones, as vLLM lists them) and
 * text_offset. */
static bool lp_add(hreq_t *x, choice_t *c, const Tandem__V1__TokenLogprob *lp)
{
    char num[48];
    bool ok = true;
    if (x->kind == RT_OAI_CHAT) {
        ok = (!c->n_lp || buf_add(&c->lp, &c->n_lp, &c->cap_lp, ",", 1)) && lp_chat_entry(x, c, lp->token_id, lp->logprob) &&
             buf_add(&c->lp, &c->n_lp, &c->cap_lp, ",\"top_logprobs\":[", 17);
        for (size_t i = 0; ok && i < lp->n_top; i++)
            ok = (!i || buf_add(&c->lp, &c->n_lp, &c->cap_lp, ",", 1)) &&
                 lp_chat_entry(x, c, lp->top[i]->token_id, lp->top[i]->logprob) && buf_add(&c->lp, &c->n_lp, &c->cap_lp, "}", 1);
        return ok && buf_add(&c->lp, &c->n_lp, &c->cap_lp, "]}", 2);
    }
    unsigned char raw[64];
    size_t nraw;
    const char *sep = c->n_lp ? "," : "";
    ok = buf_add(&c->lp, &c->n_lp, &c->cap_lp, sep, strlen(sep)) && buf_add(&c->lp, &c->n_lp, &c->cap_lp, "\"", 1) &&
         lp_token(x, lp->token_id, &c->lp, &c->n_lp, &c->cap_lp, raw, &nraw) && buf_add(&c->lp, &c->n_lp, &c->cap_lp, "\"", 1);
    if (lp->has_logprob)
        snprintf(num, sizeof num, "%s%.7g", sep, lp->logprob);
    else /* a prompt's first token: nothing before it */
        snprintf(num, sizeof num, "%snull", sep);
    ok = ok && buf_add(&c->lp_val, &c->n_lp_val, &c->cap_lp_val, num, strlen(num));
    snprintf(num, sizeof num, "%s%zu", sep, c->lp_at);
    ok = ok && buf_add(&c->lp_off, &c->n_lp_off, &c->cap_lp_off, num, strlen(num));
    c->lp_at += nraw;
    if (!lp->has_logprob)
        return ok && buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, sep, strlen(sep)) &&
               buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, "null", 4);
    ok = ok && buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, sep, strlen(sep)) &&
         buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, "{", 1);
    for (size_t i = 0; ok && i <= lp->n_top; i++) { /* the sampled token first, then the top ones but it */
        const Tandem__V1__TokenLogprob *t = i ? lp->top[i - 1] : lp;
        if (i && t->token_id == lp->token_id)
            continue;
        ok = (!i || buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, ",", 1)) &&
             buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, "\"", 1) &&
             lp_token(x, t->token_id, &c->lp_top, &c->n_lp_top, &c->cap_lp_top, raw, &nraw);
        snprintf(num, sizeof num, "\":%.7g", t->logprob);
        ok = ok && buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, num, strlen(num));
    }
    return ok && buf_add(&c->lp_top, &c->n_lp_top, &c->cap_lp_top, "}", 1);
}

/* `"logprobs":...,` of a choice: null, or what the buffers hold (then emptied) */
static bool out_logprobs(hreq_t *x, choice_t *c)
{
    if (!x->logprobs)
        return out_str(x, "\"logprobs\":null,");
    bool ok;
    if (x->kind == RT_OAI_CHAT)
        ok = out_str(x, "\"logprobs\":{\"content\":[") && out_str(x, c->lp ? c->lp : "") &&
             out_str(x, "],\"refusal\":null},");
    else
        ok = out_str(x, "\"logprobs\":{\"tokens\":[") && out_str(x, c->lp ? c->lp : "") &&
             out_str(x, "],\"token_logprobs\":[") && out_str(x, c->lp_val ? c->lp_val : "") &&
             out_str(x, "],\"top_logprobs\":[") && out_str(x, c->lp_top ? c->lp_top : "") &&
             out_str(x, "],\"text_offset\":[") && out_str(x, c->lp_off ? c->lp_off : "") && out_str(x, "]},");
    char *bufs[] = {c->lp, c->lp_val, c->lp_top, c->lp_off};
    for (int i = 0; i < 4; i++)
        if (bufs[i])
            bufs[i][0] = 0;
    c->n_lp = c->n_lp_val = c->n_lp_top = c->n_lp_off = 0;
    return ok;
}

/* ---------------------------------------------------------------- the sink */

static const char *finish_name(int f)
{
    return f == TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH ? "length" : "stop";
}

/* The head of one SSE chunk: `data: {"id":...,"model":"NAME"` (its choices follow). */
static bool chunk_head(hreq_t *x)
{
    char head[400];
    snprintf(head, sizeof head, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%ld,\"model\":\"", x->id,
             x->kind == RT_OAI_CHAT ? "chat.completion.chunk" : "text_completion", (long)time(NULL));
    return out_str(x, head) && out_json_str(x, rt_input_name(x->h->env->input)) && out_str(x, "\"");
}

/* Choice index's function call, opened: its id, type and name, and the start of its arguments' text. */
static bool tool_call_head(hreq_t *x, uint32_t index, bool delta)
{
    char head[200];
    snprintf(head, sizeof head, "\"tool_calls\":[{%s\"id\":\"call-%s-%u\",\"type\":\"function\",\"function\":"
             "{\"name\":\"", delta ? "\"index\":0," : "", strchr(x->id, '-') + 1, index);
    return out_str(x, head) && out_json_str(x, x->ch[index].tool) && out_str(x, "\",\"arguments\":\"");
}

/* A streamed function call's delta: its head with the role first, then its arguments' text as it comes. */
static bool tool_delta(hreq_t *x, uint32_t index, const char *text)
{
    choice_t *c = &x->ch[index];
    if (c->role_sent && !text)
        return true;
    bool ok = c->role_sent ? out_str(x, "\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"")
                           : out_str(x, "\"role\":\"assistant\",") && tool_call_head(x, index, true);
    c->role_sent = true;
    return ok && out_json_str(x, text ? text : "") && out_str(x, "\"}}]");
}

/* A chunk that carries text (and the role, first) and/or the finish reason. */
static bool chunk(hreq_t *x, uint32_t index, const char *text, const char *finish)
{
    choice_t *c = &x->ch[index];
    char head[48];
    snprintf(head, sizeof head, ",\"choices\":[{\"index\":%u,", index);
    if (!chunk_head(x) || !out_str(x, head))
        return false;
    if (x->kind == RT_OAI_CHAT && c->tool[0]) {
        if (!out_str(x, "\"delta\":{") || !tool_delta(x, index, text) || !out_str(x, "},") || !out_logprobs(x, c))
            return false;
    } else if (x->kind == RT_OAI_CHAT) {
        bool ok = out_str(x, "\"delta\":{");
        if (!c->role_sent) {
            ok = ok && out_str(x, "\"role\":\"assistant\"") && out_str(x, text || !finish ? "," : "");
            c->role_sent = true;
        }
        if (text || !finish)
            ok = ok && out_str(x, "\"content\":\"") && out_json_str(x, text ? text : "") && out_str(x, "\"");
        if (!ok || !out_str(x, "},") || !out_logprobs(x, c))
            return false;
    } else if (!out_str(x, "\"text\":\"") || !out_json_str(x, text ? text : "") || !out_str(x, "\",") ||
               !out_logprobs(x, c)) {
        return false;
    }
    if (finish)
        return out_str(x, "\"finish_reason\":\"") && out_str(x, finish) && out_str(x, "\"}]}\n\n");
    return out_str(x, "\"finish_reason\":null}]}\n\n");
}

static bool usage_json(hreq_t *x)
{
    char u[300];
    snprintf(u, sizeof u,
             "\"usage\":{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%u,"
             "\"prompt_tokens_details\":{\"cached_tokens\":%u}}",
             x->prompt_tokens, x->completion_tokens, x->prompt_tokens + x->completion_tokens, x->cached_tokens);
    return out_str(x, u);
}

/* Resumes the connection if it waits for us; called with mu held, which it
 * releases (libmicrohttpd is not entered with it held). */
static void wake_and_unlock(hreq_t *x)
{
    bool resume = x->suspended;
    x->suspended = false;
    pthread_mutex_unlock(&x->mu);
    if (resume)
        MHD_resume_connection(x->conn);
}


static td_status_t h_emit(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m)
{
    (void)q;
    hreq_t *x = ctx;
    pthread_mutex_lock(&x->mu);
    if (x->mhd_done) { /* the client is gone */
        pthread_mutex_unlock(&x->mu);
        return TD_ERR_CANCELLED;
    }
    uint32_t index = m->has_index && m->index < x->n_ch ? m->index : 0;
    choice_t *c = &x->ch[index];
    if (m->usage) { /* each choice's last message: the prompt counted once, the completions summed */
        x->has_usage = true;
        x->prompt_tokens = m->usage->prompt_tokens;
        x->completion_tokens += m->usage->completion_tokens;
        if (!index)
            x->cached_tokens = m->usage->cached_prompt_tokens;
    }
    bool fin = m->has_finish_reason && m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    bool bad_fin = fin && m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS &&
                   m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP &&
                   m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    const char *text = m->text && m->text[0] ? m->text : NULL;
    bool ok = true;
    for (size_t i = 0; ok && x->echo && x->logprobs && i < m->n_prompt_logprobs; i++)
        ok = lp_add(x, c, m->prompt_logprobs[i]);
    for (size_t i = 0; i < m->n_logprobs; i++)
        c->logprob += m->logprobs[i]->has_logprob ? m->logprobs[i]->logprob : 0;
    for (size_t i = 0; ok && x->logprobs && i < m->n_logprobs; i++)
        ok = lp_add(x, c, m->logprobs[i]);
    if (x->echo && !c->echo_sent) { /* the prompt before the choice's first text */
        c->echo_sent = true;
        size_t el = strlen(x->echo), tl = text ? strlen(text) : 0;
        if ((c->echoed = malloc(el + tl + 1))) { /* kept until the request is freed */
            memcpy(c->echoed, x->echo, el);
            memcpy(c->echoed + el, text ? text : "", tl + 1);
            text = c->echoed;
        }
    }
    if (!x->stream || x->any_tool) { /* collected; written at the end (its call read back from the whole text) */
        size_t n = text ? strlen(text) : 0;
        ok = td_grow((void **)&c->text, &c->cap_text, c->n_text + n + 1, 1, 256);
        if (ok && n)
            memcpy(c->text + c->n_text, text, n);
        if (ok) {
            c->n_text += n;
            c->text[c->n_text] = 0;
        }
        if (fin && !bad_fin)
            c->finish = finish_name(m->finish_reason);
        if (!x->stream || !fin) {
            rt_choices_t *g = x->q;
            pthread_mutex_unlock(&x->mu);
            rt_choices_sent(g, ok);
            return TD_OK;
        }
        char *args = NULL; /* a streamed choice's end: its call whole in one chunk (its text, where not one) */
        text = ok && (args = rt_oai_read_call(c->text, c->tool, sizeof c->tool)) ? args : c->text;
        ok = ok && chunk(x, index, text, NULL);
        free(args);
        text = NULL;
    }
    if (ok && (text || (!c->role_sent && !fin) || c->n_lp))
        ok = chunk(x, index, text, NULL);
    if (ok && fin && !bad_fin)
        ok = chunk(x, index, NULL, finish_name(m->finish_reason));
    x->need_sent = ok;
    x->streamed = true;
    if (!ok) {
        pthread_mutex_unlock(&x->mu);
        return TD_ERR_NO_MEMORY;
    }
    wake_and_unlock(x);
    return TD_OK;
}

static void active_remove(hreq_t *x)
{
    rt_http_t *h = x->h;
    pthread_mutex_lock(&h->mu);
    if (x->prev)
        x->prev->next = x->next;
    else if (h->active == x)
        h->active = x->next;
    if (x->next)
        x->next->prev = x->prev;
    x->prev = x->next = NULL;
    pthread_mutex_unlock(&h->mu);
}

/* Adds x's connection to the hang-up watcher's set (best effort: a
 * connection not watched is noticed at its first write, as before). */
static void watch(hreq_t *x)
{
    x->fd = -1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(x->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!x->h->watching || !ci)
        return;
    struct epoll_event ev = {.events = EPOLLRDHUP | EPOLLONESHOT, .data.u64 = x->serial};
    if (!epoll_ctl(x->h->ep, EPOLL_CTL_ADD, ci->connect_fd, &ev))
        x->fd = ci->connect_fd;
}

static void unwatch(hreq_t *x)
{
    if (x->fd >= 0) /* still libmicrohttpd's open socket: the connection waits for this end to resume */
        epoll_ctl(x->h->ep, EPOLL_CTL_DEL, x->fd, NULL);
    x->fd = -1;
}

/* A generation is named by its serial, not its address: x is looked up in
 * the active list under h->mu, where h_end cannot take it out meanwhile. */
static void *watcher_thread(void *arg)
{
    rt_http_t *h = arg;
    struct epoll_event evs[64];
    while (!__atomic_load_n(&h->stop_watch, __ATOMIC_ACQUIRE)) {
        int n = epoll_wait(h->ep, evs, 64, 200);
        rt_heads_sweep(h->heads);
        for (int i = 0; i < n; i++) {
            pthread_mutex_lock(&h->mu);
            for (hreq_t *x = h->active; x; x = x->next) {
                if (x->serial != evs[i].data.u64)
                    continue;
                pthread_mutex_lock(&x->mu);
                if (x->q && !x->ended && !x->mhd_done) {
                    TD_INFO("http: the client of %s went away before its answer; cancelled", x->id);
                    rt_choices_cancel(x->q);
                }
                pthread_mutex_unlock(&x->mu);
                break;
            }
            pthread_mutex_unlock(&h->mu);
        }
    }
    return NULL;
}

static void h_end(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected)
{
    hreq_t *x = ctx;
    active_remove(x);
    unwatch(x);
    pthread_mutex_lock(&x->mu);
    x->ended = true;
    x->q = NULL;
    x->end_code = code;
    x->end_retry_ms = retry_after_ms;
    x->end_rejected = rejected;
    snprintf(x->end_msg, sizeof x->end_msg, "%s", message ? message : "");
    if (!x->mhd_done) {
        if (x->stream && (x->streamed || code == TD_RPC_OK)) { /* the stream has begun: it ends in the stream */
            if (code != TD_RPC_OK) {
                char *e = error_json(http_status_of(code), x->end_msg, end_param(x));
                if (e && out_str(x, "data: ") && out_str(x, e))
                    out_str(x, "\n\n");
                free(e);
            } else if (x->include_usage && chunk_head(x) && out_str(x, ",\"choices\":[],")) {
                usage_json(x);
                out_str(x, "}\n\n");
            }
            out_str(x, "data: [DONE]\n\n");
        } else if (code == TD_RPC_OK) { /* the whole completion, one body */
            char head[400];
            snprintf(head, sizeof head, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%ld,\"model\":\"", x->id,
                     x->kind == RT_OAI_CHAT ? "chat.completion" : "text_completion", (long)time(NULL));
            out_str(x, head);
            out_json_str(x, rt_input_name(x->h->env->input));
            out_str(x, "\",\"choices\":[");
            uint32_t order[RT_MAX_CHOICES], n_out = x->n_best ? x->n_best : x->n_ch;
            for (uint32_t i = 0; i < x->n_ch; i++) { /* best_of: by log-probability, highest first */
                uint32_t k = i;
                for (; k > 0 && x->n_best && x->ch[order[k - 1]].logprob < x->ch[i].logprob; k--)
                    order[k] = order[k - 1];
                order[k] = i;
            }
            for (uint32_t i = 0; i < n_out; i++) {
                choice_t *c = &x->ch[order[i]];
                snprintf(head, sizeof head, "%s{\"index\":%u,", i ? "," : "", i);
                out_str(x, head);
                char *args = NULL; /* "required" over several tools: its call read back (its text, where not one) */
                if (x->kind == RT_OAI_CHAT &&
                    (c->tool[0] || (x->any_tool && (args = rt_oai_read_call(c->text, c->tool, sizeof c->tool))))) {
                    out_str(x, "\"message\":{\"role\":\"assistant\",\"content\":null,");
                    tool_call_head(x, order[i], false);
                    out_json_str(x, args ? args : c->text ? c->text : "");
                    out_str(x, "\"}}]},");
                    free(args);
                } else {
                    out_str(x, x->kind == RT_OAI_CHAT ? "\"message\":{\"role\":\"assistant\",\"content\":\""
                                                      : "\"text\":\"");
                    out_json_str(x, c->text ? c->text : "");
                    out_str(x, x->kind == RT_OAI_CHAT ? "\"}," : "\",");
                }
                out_logprobs(x, c);
                out_str(x, "\"finish_reason\":\"");
                out_str(x, c->finish ? c->finish : "stop");
                out_str(x, "\"}");
            }
            out_str(x, "],");
            usage_json(x);
            out_str(x, "}");
        }
    }
    wake_and_unlock(x);
    hreq_put(x); /* the request's reference */
}

static const rt_sink_t http_sink = {.emit = h_emit, .end = h_end};

/* libmicrohttpd takes the stream's bytes here. */
static ssize_t reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    hreq_t *x = cls;
    pthread_mutex_lock(&x->mu);
    size_t avail = x->n_out - x->off_out, n = avail < max ? avail : max;
    memcpy(buf, x->out + x->off_out, n);
    x->off_out += n;
    rt_choices_t *sent = NULL;
    if (x->off_out == x->n_out) {
        x->n_out = x->off_out = 0;
        if (x->need_sent) {
            x->need_sent = false;
            sent = x->q;
        }
    }
    if (!n && x->ended) {
        pthread_mutex_unlock(&x->mu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (!n) { /* nothing yet: wait for the next message */
        x->suspended = true;
        MHD_suspend_connection(x->conn);
    }
    pthread_mutex_unlock(&x->mu);
    if (sent)
        rt_choices_sent(sent, true);
    return (ssize_t)n;
}

static enum MHD_Result authorize(struct hreq *x, bool *refused);

/* ---------------------------------------------------------------- endpoints */

/* completions' echo: the prompt's text, a token-id prompt's decoded (ids not
 * of the model echo nothing: the router refuses them, naming the field) */
static char *echo_text(const rt_input_t *in, const Tandem__V1__GenerateRequest *rq)
{
    if (rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT)
        return strdup(rq->prompt);
    const Tandem__V1__TokenIds *t = rq->prompt_ids;
    for (size_t i = 0; i < t->n_ids; i++)
        if (t->ids[i] < 0 || (uint32_t)t->ids[i] >= in->model->desc.vocab)
            return strdup("");
    char *text = NULL;
    size_t len = 0;
    if (eng_tokenizer_decode(in->model->tok, t->ids, t->n_ids, false, &text, &len))
        return NULL;
    return text;
}

static enum MHD_Result start_generation(hreq_t *x)
{
    const rt_env_t *env = x->h->env;
    json_error_t je;
    json_t *b = json_loadb(x->body ? x->body : "", x->n_body, JSON_ALLOW_NUL, &je);
    if (!json_is_object(b)) {
        char why[300];
        rt_oai_body_error(b, &je, why, sizeof why);
        json_decref(b);
        return respond_error(x->conn, 400, NULL, "%s", why);
    }
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd)
        rnd = (uint64_t)time(NULL);
    snprintf(x->id, sizeof x->id, "%s-%016llx", x->kind == RT_OAI_CHAT ? "chatcmpl" : "cmpl", (unsigned long long)rnd);
    Tandem__V1__GenerateRequest *rq = NULL;
    rt_oai_error_t e = {0};
    rt_oai_opts_t o = {0};
    bool ok = rt_oai_parse_json(x->kind, b, x->id, &rq, &o, &e);
    x->stream = o.stream, x->include_usage = o.include_usage, x->any_tool = o.any_tool;
    memcpy(x->tool, o.tool, sizeof x->tool);
    const bool echo = x->kind == RT_OAI_COMPLETION && json_is_true(json_object_get(b, "echo"));
    /* best_of above n: n answered (the parser checked both) */
    json_t *best_of = json_object_get(b, "best_of"), *n = json_object_get(b, "n"), *lp = json_object_get(b, "logprobs");
    json_int_t want = json_is_integer(n) ? json_integer_value(n) : 1;
    x->n_best = ok && json_is_integer(best_of) && json_integer_value(best_of) > want ? (uint32_t)want : 0;
    const bool asked_lp = lp && !json_is_null(lp);
    json_decref(b);
    if (!ok) {
        tandem__v1__generate_request__free_unpacked(rq, NULL);
        return respond_error(x->conn, 400, e.param[0] ? e.param : NULL, "%s", e.msg);
    }
    x->logprobs = rq->sampling && rq->sampling->logprobs && !(x->n_best && !asked_lp);
    if (echo && !(x->echo = echo_text(x->h->env->input, rq))) {
        tandem__v1__generate_request__free_unpacked(rq, NULL);
        return respond_error(x->conn, 503, NULL, "no memory");
    }
    /* the choices' state: sampling.n of them (an n out of range is refused by the request, naming it) */
    x->n_ch = rq->sampling && rq->sampling->n > 1 && rq->sampling->n <= RT_MAX_CHOICES ? rq->sampling->n : 1;
    if (!(x->ch = calloc(x->n_ch, sizeof *x->ch))) {
        x->n_ch = 0;
        tandem__v1__generate_request__free_unpacked(rq, NULL);
        return respond_error(x->conn, 503, NULL, "no memory");
    }
    for (uint32_t i = 0; i < x->n_ch; i++) /* a named function: every choice calls it */
        memcpy(x->ch[i].tool, x->tool, sizeof x->tool);
    rt_choices_t *q = rt_choices_create(x->h->rs, rq, HTTP_TIMEOUT_S, &http_sink, x);
    if (!q)
        return respond_error(x->conn, 429, NULL, "the router holds %u requests at once, its most; try again later",
                             env->max_streams);
    pthread_mutex_lock(&x->h->mu);
    x->next = x->h->active;
    if (x->next)
        x->next->prev = x;
    x->h->active = x;
    x->serial = ++x->h->serial;
    pthread_mutex_unlock(&x->h->mu);
    watch(x);
    pthread_mutex_lock(&x->mu);
    x->q = q;
    x->refs++; /* the request's */
    x->begun = true;
    x->suspended = true;
    MHD_suspend_connection(x->conn);
    pthread_mutex_unlock(&x->mu);
    rt_choices_set_key(q, x->key);
    rt_choices_start(q);
    return MHD_YES;
}

/* Called again once resumed: the answer's head, when there is one to give. */
static enum MHD_Result answer(hreq_t *x)
{
    pthread_mutex_lock(&x->mu);
    if (x->answered || (!x->ended && !x->streamed)) { /* spurious: wait on */
        if (!x->answered) {
            x->suspended = true;
            MHD_suspend_connection(x->conn);
        }
        pthread_mutex_unlock(&x->mu);
        return MHD_YES;
    }
    x->answered = true;
    if (x->stream && (x->streamed || x->end_code == TD_RPC_OK)) {
        pthread_mutex_unlock(&x->mu);
        struct MHD_Response *rs = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, reader, x, NULL);
        if (!rs)
            return MHD_NO;
        MHD_add_response_header(rs, "Content-Type", "text/event-stream");
        MHD_add_response_header(rs, "Cache-Control", "no-cache");
        enum MHD_Result ret = MHD_queue_response(x->conn, 200, rs);
        MHD_destroy_response(rs);
        return ret;
    }
    int code = x->end_code;
    uint32_t retry_ms = x->end_retry_ms;
    const char *rejected = x->end_rejected;
    char *body = NULL;
    if (code == TD_RPC_OK) {
        body = x->out;
        x->out = NULL;
        x->n_out = x->cap_out = 0;
    } else {
        body = error_json(http_status_of(code), x->end_msg, end_param(x));
    }
    pthread_mutex_unlock(&x->mu);
    return respond_retry(x->conn, code == TD_RPC_OK ? 200 : http_status_of(code), body, NULL, retry_ms, rejected);
}

static enum MHD_Result models(rt_http_t *h, struct MHD_Connection *c)
{
    const eng_model_desc_t *d = &h->env->input->model->desc;
    return respond_json(c, 200,
                        json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:i}]}", "object", "list", "data", "id",
                                  rt_input_name(h->env->input),
                                  "object", "model", "created", (json_int_t)h->created, "owned_by", "tandem",
                                  "max_model_len", (int)d->context));
}

static enum MHD_Result health(rt_http_t *h, struct MHD_Connection *c)
{
    uint32_t np, nd;
    rt_table_counts(h->env->table, &np, &nd);
    bool ok = rt_table_serving(h->env->table);
    return respond_json(c, ok ? 200 : 503,
                        json_pack("{s:s, s:i, s:i}", "status", ok ? "serving" : "not serving (no prefill or decode "
                                  "worker)", "prefill_workers", (int)np, "decode_workers", (int)nd));
}

static enum MHD_Result tokenize(hreq_t *x)
{
    const rt_env_t *env = x->h->env;
    json_error_t je;
    json_t *b = json_loadb(x->body ? x->body : "", x->n_body, 0, &je);
    if (!json_is_object(b)) {
        char why[300];
        rt_oai_body_error(b, &je, why, sizeof why);
        json_decref(b);
        return respond_error(x->conn, 400, NULL, "%s", why);
    }
    json_t *p = json_object_get(b, "prompt"), *msgs = json_object_get(b, "messages"),
           *spec = json_object_get(b, "add_special_tokens");
    char err[600] = "";
    int32_t *ids = NULL;
    size_t n = 0;
    td_status_t rc;
    if (json_is_string(p)) {
        rc = rt_tokenize_input(env->input, json_string_value(p), NULL, false, !spec || json_is_true(spec), &ids, &n, err,
                               sizeof err);
    } else if (json_is_array(msgs)) {
        Tandem__V1__GenerateRequest *rq = NULL;
        rt_oai_error_t e = {0};
        rt_oai_opts_t o = {0};
        json_t *only = json_pack("{s:O}", "messages", msgs);
        bool ok = rt_oai_parse_json(RT_OAI_CHAT, only, "tokenize", &rq, &o, &e);
        json_decref(only);
        rc = ok ? rt_tokenize_input(env->input, NULL, rq->chat, false, true, &ids, &n, err, sizeof err) : TD_ERR_INVALID_ARG;
        if (!ok)
            snprintf(err, sizeof err, "%s", e.msg);
        tandem__v1__generate_request__free_unpacked(rq, NULL);
    } else {
        rc = TD_ERR_INVALID_ARG;
        snprintf(err, sizeof err, "prompt: set \"prompt\" (a string) or \"messages\"");
    }
    json_decref(b);
    if (rc) {
        free(ids);
        return respond_error(x->conn, http_status_of(td_rpc_code_of(rc)), NULL, "%s", err);
    }
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(arr, json_integer(ids[i]));
    free(ids);
    return respond_json(x->conn, 200, json_pack("{s:I, s:i, s:o}", "count", (json_int_t)n, "max_model_len",
                                                (int)env->input->model->desc.context, "tokens", arr));
}

static enum MHD_Result detokenize(hreq_t *x)
{
    const rt_env_t *env = x->h->env;
    json_t *b = json_loadb(x->body ? x->body : "", x->n_body, 0, NULL);
    json_t *t = json_object_get(b, "tokens");
    if (!json_is_array(t)) {
        json_decref(b);
        return respond_error(x->conn, 400, "tokens", "tokens: must be an array of token ids");
    }
    size_t n = json_array_size(t);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; ids && i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= env->input->model->desc.vocab) {
            free(ids);
            json_decref(b);
            return respond_error(x->conn, 400, "tokens", "tokens[%zu]: not a token id of this model (0 to %u)", i,
                                 env->input->model->desc.vocab - 1);
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    json_decref(b);
    char *text = NULL;
    size_t len = 0;
    if (!ids || eng_tokenizer_decode(env->input->model->tok, ids, n, false, &text, &len)) {
        free(ids);
        return respond_error(x->conn, 500, NULL, "cannot decode the tokens");
    }
    free(ids);
    json_t *j = json_pack("{s:s%}", "prompt", text, len);
    free(text);
    return respond_json(x->conn, 200, j);
}

/* GET /tokenizer_info, as vLLM serves it: what a client needs to tokenize
 * for this server (lm-evaluation-harness's remote tokenizer asks it, then
 * sends /tokenize and token-id prompts). */
static enum MHD_Result tokenizer_info(const rt_http_t *h, struct MHD_Connection *c)
{
    const eng_tokenizer_t *tok = h->env->input->model->tok;
    json_t *j = json_pack("{s:s, s:i, s:i, s:b}", "tokenizer_class", "tandem (the model file's tokenizer)",
                          "model_max_length", (int)h->env->input->model->desc.context, "vocab_size",
                          (int)eng_tokenizer_n_vocab(tok), "add_bos_token", eng_tokenizer_adds_bos(tok));
    const struct { const char *k; int32_t id; } special[] = {{"eos_token", eng_tokenizer_eos(tok)},
                                                             {"bos_token", eng_tokenizer_bos(tok)}};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++) {
        size_t len = 0;
        const char *t = special[i].id >= 0 ? eng_tokenizer_token_text(tok, special[i].id, &len) : NULL;
        json_object_set_new(j, special[i].k, t ? json_stringn(t, len) : json_null());
    }
    const char *tmpl = eng_tokenizer_chat_template(tok);
    json_object_set_new(j, "chat_template", tmpl ? json_string(tmpl) : json_null());
    return respond_json(c, 200, j);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    (void)version;
    rt_http_t *h = cls;
    hreq_t *x = *con_cls;
    if (!x) { /* the head: this request's state */
        x = calloc(1, sizeof *x);
        if (!x)
            return MHD_NO;
        x->h = h;
        x->conn = c;
        x->refs = 1;
        pthread_mutex_init(&x->mu, NULL);
        *con_cls = x;
        rt_heads_waiting(h->heads, c, false);
        char why[400];
        if (!td_https_client_ok(h->https, c, why, sizeof why))
            return respond_error(c, 403, NULL, "%s", why);
        if (h->open > h->max_open)
            return respond_crowded(h, c);
        /* a body announced over the limit is refused before a byte of it is read (MHD then closes) */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > RT_MAX_REQUEST_BYTES)
            return respond_error(c, 413, NULL, "the body (Content-Length %s) is over this server's limit of %u "
                                 "bytes", cl, RT_MAX_REQUEST_BYTES);
        return MHD_YES;
    }
    if (*upload_size) { /* a piece of the body */
        if (x->n_body + *upload_size > RT_MAX_REQUEST_BYTES)
            x->too_big = true;
        else if (td_grow((void **)&x->body, &x->cap_body, x->n_body + *upload_size + 1, 1, 4096)) {
            memcpy(x->body + x->n_body, upload, *upload_size);
            x->n_body += *upload_size;
        } else {
            x->too_big = true;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (x->begun)
        return answer(x);
    if (x->too_big)
        return respond_error(c, 413, NULL, "the body is over this server's limit of %u bytes", RT_MAX_REQUEST_BYTES);
    bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET");
    /* a body is JSON: the content types a browser may post cross-site without asking first (text/plain, forms)
     * are refused, so a web page cannot make its visitor's browser call this API */
    const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (post && ct && strncasecmp(ct, "application/json", 16))
        return respond_error(c, 415, NULL, "Content-Type %.80s: this API takes application/json bodies", ct);
    if (strcmp(url, "/health")) {
        bool refused;
        enum MHD_Result ar = authorize(x, &refused);
        if (refused)
            return ar;
    }
    if (!strcmp(url, "/v1/chat/completions") || !strcmp(url, "/v1/completions")) {
        if (!post)
            return respond_error(c, 405, NULL, "%s takes POST", url);
        x->kind = !strcmp(url, "/v1/chat/completions") ? RT_OAI_CHAT : RT_OAI_COMPLETION;
        return start_generation(x);
    }
    if (!strcmp(url, "/v1/models") && get)
        return models(h, c);
    if (!strcmp(url, "/health") && get)
        return health(h, c);
    if (!strcmp(url, "/tokenizer_info") && get)
        return tokenizer_info(h, c);
    if (!strcmp(url, "/tokenize") && post)
        return tokenize(x);
    if (!strcmp(url, "/detokenize") && post)
        return detokenize(x);
    return respond_error(c, 404, NULL, "no route %s %s (this server has POST /v1/chat/completions, POST "
                         "/v1/completions, GET /v1/models, GET /health, GET /tokenizer_info, POST /tokenize, POST "
                         "/detokenize)", method, url);
}

/* The request is over for libmicrohttpd: a client that went away cancels it. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)toe;
    hreq_t *x = *con_cls;
    rt_heads_waiting(((rt_http_t *)cls)->heads, c, true); /* the next head is awaited from now */
    if (!x)
        return;
    *con_cls = NULL;
    pthread_mutex_lock(&x->mu);
    x->mhd_done = true;
    rt_choices_t *q = x->q, *unsent = NULL;
    if (q && !x->ended)
        rt_choices_cancel(q); /* does not call the sink; end has not returned (q is set) */
    if (x->need_sent) {
        x->need_sent = false;
        unsent = q;
    }
    pthread_mutex_unlock(&x->mu);
    if (unsent)
        rt_choices_sent(unsent, false);
    hreq_put(x); /* libmicrohttpd's reference */
}

/* ---------------------------------------------------------------- API keys */

/* The caller's key from "Authorization: Bearer KEY", charged one request (its
 * tokens are charged by the request once tokenized); refused: the answer
 * (401, 429) is queued. */
static enum MHD_Result authorize(hreq_t *x, bool *refused)
{
    rt_keys_t *ks = x->h->env->api_keys;
    *refused = false;
    if (!ks)
        return MHD_YES;
    char msg[256];
    double retry_s;
    int code = rt_keys_admit(ks, MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "Authorization"), &x->key,
                             msg, sizeof msg, &retry_s);
    if (!code)
        return MHD_YES;
    *refused = true;
    return respond_retry(x->conn, http_status_of(code), error_json(http_status_of(code), msg, NULL), NULL,
                         (uint32_t)(retry_s * 1e3 + 0.5), NULL);
}

/* ---------------------------------------------------------------- start, stop */

td_status_t rt_http_start(rt_requests_t *rs, const char *listen, const td_rpc_tls_t *tls, rt_http_t **out, int *port)
{
    struct sockaddr_in sa;
    td_status_t lrc = td_listen_addr(listen, "router.http_listen", &sa);
    if (lrc)
        return lrc;
    rt_http_t *h = calloc(1, sizeof *h);
    if (!h) {
        return td_error(TD_ERR_NO_MEMORY, "http: no memory");
    }
    h->rs = rs;
    h->env = rt_requests_env(rs);
    h->created = (long)time(NULL);
    td_status_t rc = td_https_load(tls, "router.http_listen", &h->https);
    if (rc) {
        free(h);
        return rc;
    }
    pthread_mutex_init(&h->mu, NULL);
    h->max_open = (int)(2 * h->env->max_streams + 1024);
    h->heads = rt_heads_create((unsigned)h->max_open / 2);
    if (!h->heads) {
        pthread_mutex_destroy(&h->mu);
        td_https_free(h->https);
        free(h);
        return td_error(TD_ERR_NO_MEMORY, "http: no memory");
    }
    h->ep = epoll_create1(EPOLL_CLOEXEC);
    h->watching = h->ep >= 0 && !pthread_create(&h->watcher, NULL, watcher_thread, h);
    if (!h->watching)
        TD_WARN("http: no hang-up watcher (%s): a client that leaves before its answer is noticed at its first "
                "write", strerror(errno));
    struct MHD_OptionItem tls_opts[TD_HTTPS_OPTIONS];
    td_https_options(h->https, tls_opts);
    h->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                                MHD_USE_ERROR_LOG | td_https_flag(h->https),
                            ntohs(sa.sin_port), NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, &sa,
                            /* open connections, idle keep-alive ones included: more than the requests the
                             * router admits (router.max_streams), which past that answers 429; past
                             * max_open a request is answered 503, past 64 more MHD drops connections */
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)h->max_open + 64u,
                            MHD_OPTION_CONNECTION_TIMEOUT, 300u, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, h, MHD_OPTION_ARRAY, tls_opts,
                            MHD_OPTION_END);
    if (!h->d) {
        if (h->watching) {
            __atomic_store_n(&h->stop_watch, 1, __ATOMIC_RELEASE);
            pthread_join(h->watcher, NULL);
        }
        if (h->ep >= 0)
            close(h->ep);
        rt_heads_destroy(h->heads);
        pthread_mutex_destroy(&h->mu);
        td_https_free(h->https);
        free(h);
        return td_error(TD_ERR_UNAVAILABLE, "http: cannot listen on %s (in use, not an address of this host, or "
                        "its TLS pair refused)", listen);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    *port = di ? di->port : ntohs(sa.sin_port);
    *out = h;
    return TD_OK;
}

void rt_http_stop(rt_http_t *h)
{
    if (!h)
        return;
    /* no new connections; every generation under way cancelled, and waited for (its end resumes its
     * connection, which libmicrohttpd needs before it stops) */
    MHD_quiesce_daemon(h->d);
    pthread_mutex_lock(&h->mu);
    for (hreq_t *x = h->active; x; x = x->next) {
        pthread_mutex_lock(&x->mu);
        if (x->q)
            rt_choices_cancel(x->q);
        pthread_mutex_unlock(&x->mu);
    }
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; i < 1000; i++) { /* 10 s at most */
        pthread_mutex_lock(&h->mu);
        bool left = h->active != NULL;
        pthread_mutex_unlock(&h->mu);
        if (!left)
            break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    MHD_stop_daemon(h->d); /* every connection's completed callback runs */
    if (h->watching) {
        __atomic_store_n(&h->stop_watch, 1, __ATOMIC_RELEASE);
        pthread_join(h->watcher, NULL); /* within its 200 ms wait */
    }
    if (h->ep >= 0)
        close(h->ep);
    rt_heads_destroy(h->heads);
    pthread_mutex_destroy(&h->mu);
    td_https_free(h->https);
    free(h);
}
