/* grpc.c — see grpc.h. Each request is a flight: its call, the three batches
 * in progress on it (start: metadata + request + close; one receive at a time;
 * the status), and the arrival times of its tokens. A flight ends when its
 * status has come and no batch of it is pending. Tags are the flight's address
 * with the batch kind in the low bits. */
#include "bench/grpc.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "tandem/v1/tandem.pb-c.h"

enum { K_START = 0, K_RECV = 1, K_STATUS = 2, K_MASK = 3 };

typedef struct gflight {
    grpc_call *call;
    grpc_metadata_array md_in, md_trail;
    grpc_byte_buffer *send, *recv;
    grpc_status_code code;
    grpc_slice details;
    const char *err_str;
    int pending;                /* batches started and not completed */
    bool status_done, ended;
    double *times;
    uint32_t n_times, cap_times;
    bench_result_t *res;
} gflight_t;

static gpr_timespec in_seconds(double s)
{
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros((int64_t)(s * 1e6), GPR_TIMESPAN));
}

static const char *finish_name(Tandem__V1__FinishReason f)
{
    switch (f) {
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS: return "stop";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return "cancelled";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_DEADLINE: return "deadline";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "";
    }
}

/* The request as GenerateRequest bytes; chat prompts are a JSON array of
 * {role, content}. NULL (and res->error set) when the prompt is unusable. */
static grpc_byte_buffer *request_of(const bench_grpc_t *o, const bench_request_t *r, bench_result_t *res)
{
    Tandem__V1__GenerateRequest rq = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    Tandem__V1__ChatInput ci = TANDEM__V1__CHAT_INPUT__INIT;
    Tandem__V1__ChatMessage *msgs = NULL, **mp = NULL;
    json_t *arr = NULL;
    rq.model = (char *)(o->model ? o->model : "");
    rq.has_return_token_ids = rq.return_token_ids = 1;
    sp.has_max_tokens = sp.has_temperature = 1;
    sp.max_tokens = r->output_len;
    sp.temperature = 0;
    sp.has_ignore_eos = 1;
    sp.ignore_eos = o->ignore_eos;
    rq.sampling = &sp;
    if (r->chat) {
        arr = json_loads(r->prompt, 0, NULL);
        size_t n = json_array_size(arr);
        msgs = calloc(n ? n : 1, sizeof *msgs);
        mp = calloc(n ? n : 1, sizeof *mp);
        for (size_t i = 0; msgs && mp && i < n; i++) {
            json_t *m = json_array_get(arr, i);
            tandem__v1__chat_message__init(&msgs[i]);
            const char *role = json_string_value(json_object_get(m, "role"));
            const char *content = json_string_value(json_object_get(m, "content"));
            msgs[i].role = (char *)(role ? role : "");
            msgs[i].content = (char *)(content ? content : "");
            mp[i] = &msgs[i];
        }
        if (!n || !msgs || !mp) {
            snprintf(res->error, sizeof res->error, "the chat prompt is not a JSON array of messages");
            json_decref(arr);
            free(msgs);
            free(mp);
            return NULL;
        }
        ci.n_messages = n;
        ci.messages = mp;
        rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
        rq.chat = &ci;
    } else {
        rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        rq.prompt = r->prompt;
    }
    size_t len = tandem__v1__generate_request__get_packed_size(&rq);
    grpc_slice sl = grpc_slice_malloc(len);
    tandem__v1__generate_request__pack(&rq, GRPC_SLICE_START_PTR(sl));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    json_decref(arr);
    free(msgs);
    free(mp);
    return bb;
}

static void *tag(gflight_t *f, int kind) { return (void *)((uintptr_t)f | (uintptr_t)kind); }

static bool post_recv(gflight_t *f)
{
    grpc_op op = {.op = GRPC_OP_RECV_MESSAGE};
    op.data.recv_message.recv_message = &f->recv;
    if (grpc_call_start_batch(f->call, &op, 1, tag(f, K_RECV), NULL) != GRPC_CALL_OK)
        return false;
    f->pending++;
    return true;
}

/* A message arrived: its tokens, at this time; the final one's usage. */
static void on_message(gflight_t *f, double t)
{
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, f->recv))
        return;
    grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    Tandem__V1__GenerateResponse *m =
        tandem__v1__generate_response__unpack(NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
    grpc_slice_unref(all);
    if (!m) {
        snprintf(f->res->error, sizeof f->res->error, "a GenerateResponse did not parse");
        return;
    }
    uint32_t k = (uint32_t)m->n_token_ids;
    if (!k && m->text && m->text[0])
        k = 1; /* a server that sends text without ids: one token per message */
    if (f->n_times + k > f->cap_times) {
        uint32_t nc = f->cap_times ? f->cap_times : 64;
        while (nc < f->n_times + k)
            nc *= 2;
        double *nt = realloc(f->times, nc * sizeof *nt);
        if (nt) {
            f->times = nt;
            f->cap_times = nc;
        }
    }
    for (uint32_t i = 0; i < k && f->n_times < f->cap_times; i++)
        f->times[f->n_times++] = t;
    if (m->has_finish_reason)
        snprintf(f->res->finish, sizeof f->res->finish, "%s", finish_name(m->finish_reason));
    if (m->usage && m->usage->has_prompt_tokens)
        f->res->n_in = m->usage->prompt_tokens;
    tandem__v1__generate_response__free_unpacked(m, NULL);
}

static void finish(gflight_t *f, double t)
{
    bench_result_t *r = f->res;
    r->t_done = t;
    r->status = (int)f->code;
    bench_result_times(r, f->times, f->n_times);
    if (f->code != GRPC_STATUS_OK && !r->error[0]) {
        char *d = grpc_slice_to_c_string(f->details);
        snprintf(r->error, sizeof r->error, "gRPC status %d: %s", (int)f->code, d && d[0] ? d : f->err_str ? f->err_str : "");
        gpr_free(d);
    } else if (f->code == GRPC_STATUS_OK && !f->n_times && !r->error[0]) {
        snprintf(r->error, sizeof r->error, "no tokens in the response");
    }
    r->ok = !r->error[0];
    r->rejected = !r->ok && !f->n_times && f->code == GRPC_STATUS_RESOURCE_EXHAUSTED;
}

static void flight_free(gflight_t *f)
{
    if (f->call)
        grpc_call_unref(f->call);
    if (f->send)
        grpc_byte_buffer_destroy(f->send);
    if (f->recv)
        grpc_byte_buffer_destroy(f->recv);
    grpc_metadata_array_destroy(&f->md_in);
    grpc_metadata_array_destroy(&f->md_trail);
    grpc_slice_unref(f->details);
    if (f->err_str)
        gpr_free((void *)f->err_str);
    free(f->times);
    f->call = NULL;
    f->send = f->recv = NULL;
    f->times = NULL;
}

/* Starts request i; false when it could not start (its result says why). */
static bool launch(const bench_grpc_t *o, grpc_channel *ch, grpc_completion_queue *cq, gflight_t *f,
                   const bench_request_t *r, grpc_slice method)
{
    grpc_metadata_array_init(&f->md_in);
    grpc_metadata_array_init(&f->md_trail);
    f->details = grpc_empty_slice();
    f->code = GRPC_STATUS_UNKNOWN;
    f->send = request_of(o, r, f->res);
    if (!f->send)
        return false;
    f->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL, in_seconds(o->timeout_s),
                                       NULL);
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA; /* fail-fast: an endpoint that is down fails the call at once */
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = f->send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &f->md_in;
    grpc_op st = {.op = GRPC_OP_RECV_STATUS_ON_CLIENT};
    st.data.recv_status_on_client.trailing_metadata = &f->md_trail;
    st.data.recv_status_on_client.status = &f->code;
    st.data.recv_status_on_client.status_details = &f->details;
    st.data.recv_status_on_client.error_string = &f->err_str;
    if (!f->call || grpc_call_start_batch(f->call, ops, 4, tag(f, K_START), NULL) != GRPC_CALL_OK) {
        snprintf(f->res->error, sizeof f->res->error, "gRPC would not start the call");
        return false;
    }
    f->pending++;
    if (grpc_call_start_batch(f->call, &st, 1, tag(f, K_STATUS), NULL) == GRPC_CALL_OK)
        f->pending++;
    post_recv(f);
    return true;
}

static char *read_file(const char *path)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    char chunk[4096];
    while ((n = fread(chunk, 1, sizeof chunk, fp)) > 0) {
        if (len + n + 1 > cap) {
            cap = (len + n + 1) * 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(fp);
                return NULL;
            }
            buf = nb;
        }
        memcpy(buf + len, chunk, n);
        len += n;
    }
    fclose(fp);
    if (buf)
        buf[len] = 0;
    return buf;
}

td_status_t bench_run_grpc(const bench_grpc_t *o, const bench_workload_t *w, bench_result_t *res)
{
    grpc_channel_credentials *cr;
    if (o->tls_ca) {
        char *ca = read_file(o->tls_ca);
        if (!ca)
            return td_error(TD_ERR_IO, "bench: cannot read the TLS CA file %s", o->tls_ca);
        cr = grpc_ssl_credentials_create(ca, NULL, NULL, NULL);
        free(ca);
    } else {
        cr = grpc_insecure_credentials_create();
    }
    grpc_init();
    grpc_arg args[2] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = 64 << 20},
        /* a restarted server is tried again soon (the default backs off for up to 2 minutes) */
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, .value.integer = 1000},
    };
    grpc_channel_args ca = {2, args};
    grpc_channel *ch = grpc_channel_create(o->endpoint, cr, &ca);
    grpc_channel_credentials_release(cr);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    gflight_t *fl = calloc(w->n ? w->n : 1, sizeof *fl);
    if (!ch || !cq || !fl) {
        free(fl);
        if (cq)
            grpc_completion_queue_destroy(cq);
        if (ch)
            grpc_channel_destroy(ch);
        grpc_shutdown();
        return td_error(TD_ERR_NO_MEMORY, "bench: cannot make a gRPC channel to %s", o->endpoint);
    }
    grpc_slice method = grpc_slice_from_static_string("/tandem.v1.Tandem/Generate");
    double t0 = td_now_s(), last_print = 0;
    size_t next = 0, in_flight = 0, done = 0, failed = 0;
    while (done < w->n) {
        double now = td_now_s() - t0;
        while (next < w->n && w->req[next].t_send <= now) { /* open loop: send on schedule */
            gflight_t *f = &fl[next];
            f->res = &res[next];
            memset(f->res, 0, sizeof *f->res);
            f->res->t_planned = w->req[next].t_send;
            f->res->n_in = w->req[next].input_len;
            f->res->t_sent = td_now_s() - t0;
            if (launch(o, ch, cq, f, &w->req[next], method)) {
                in_flight++;
            } else {
                if (!f->pending)
                    flight_free(f);
                f->res->t_done = f->res->t_sent;
                f->res->ok = false;
                f->ended = true;
                done++;
                failed++;
            }
            next++;
        }
        double wait = next < w->n ? w->req[next].t_send - (td_now_s() - t0) : 0.05;
        wait = wait < 0 ? 0 : wait > 0.05 ? 0.05 : wait;
        grpc_event ev = grpc_completion_queue_next(cq, in_seconds(wait), NULL);
        while (ev.type == GRPC_OP_COMPLETE) {
            double t = td_now_s() - t0;
            gflight_t *f = (gflight_t *)((uintptr_t)ev.tag & ~(uintptr_t)K_MASK);
            int kind = (int)((uintptr_t)ev.tag & K_MASK);
            f->pending--;
            if (kind == K_RECV) {
                if (ev.success && f->recv) {
                    on_message(f, t);
                    grpc_byte_buffer_destroy(f->recv);
                    f->recv = NULL;
                    post_recv(f);
                }
            } else if (kind == K_STATUS) {
                f->status_done = true;
            }
            if (f->status_done && !f->pending && !f->ended) {
                f->ended = true;
                finish(f, t);
                flight_free(f);
                in_flight--;
                done++;
                failed += !f->res->ok;
            }
            ev = grpc_completion_queue_next(cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
        }
        if (o->progress)
            bench_progress(now, &last_print, false, next, w->n, in_flight, done, failed);
    }
    if (o->progress)
        bench_progress(0, &last_print, true, next, w->n, 0, done, failed);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type != GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    grpc_channel_destroy(ch);
    free(fl);
    grpc_shutdown();
    return TD_OK;
}
