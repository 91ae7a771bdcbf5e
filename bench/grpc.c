/* grpc.c — see grpc.h. Each request is a flight: its stream (common/rpc's
 * client, the one every tandem process uses) and the arrival times of its
 * tokens. Reads are asynchronous: each message arrives as a callback on an
 * RPC completion-queue thread, which records it and posts the next read, so
 * hundreds of requests in flight need no thread each. The sending thread
 * keeps the schedule, and destroys the streams that ended. */
#include "bench/grpc.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/rpc.h"
#include "tandem/v1/tandem.pb-c.h"

typedef struct run run_t;

typedef struct gflight {
    run_t *run;
    td_rpc_stream_t *st;
    double *times;
    size_t n_times, cap_times;
    bench_result_t *res;
    struct gflight *next_done; /* on the run's list of ended flights */
} gflight_t;

/* What the callbacks share with the sending thread (under mu). */
struct run {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    double t0;
    gflight_t *ended; /* flights whose streams the sender destroys */
    size_t done, failed;
};

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

/* The request as GenerateRequest bytes (malloc'd, *len long); chat prompts
 * are a JSON array of {role, content}. NULL (and res->error set) when the
 * prompt is unusable. */
static uint8_t *request_of(const bench_grpc_t *o, const bench_request_t *r, bench_result_t *res, size_t *len)
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
    *len = tandem__v1__generate_request__get_packed_size(&rq);
    uint8_t *b = malloc(*len ? *len : 1);
    if (b)
        tandem__v1__generate_request__pack(&rq, b);
    else
        snprintf(res->error, sizeof res->error, "no memory");
    json_decref(arr);
    free(msgs);
    free(mp);
    return b;
}

/* A message arrived: its tokens, at time t; the final one's usage. */
static void on_message(gflight_t *f, const uint8_t *msg, size_t len, double t)
{
    Tandem__V1__GenerateResponse *m = tandem__v1__generate_response__unpack(NULL, len, msg);
    if (!m) {
        snprintf(f->res->error, sizeof f->res->error, "a GenerateResponse did not parse");
        return;
    }
    size_t k = m->n_token_ids;
    if (!k && m->text && m->text[0])
        k = 1; /* a server that sends text without ids: one token per message */
    if (td_grow((void **)&f->times, &f->cap_times, f->n_times + k, sizeof *f->times, 64))
        for (size_t i = 0; i < k; i++)
            f->times[f->n_times++] = t;
    if (m->has_finish_reason)
        snprintf(f->res->finish, sizeof f->res->finish, "%s", finish_name(m->finish_reason));
    if (m->usage && m->usage->has_prompt_tokens)
        f->res->n_in = m->usage->prompt_tokens;
    if (m->usage && m->usage->has_cached_prompt_tokens)
        f->res->n_cached = m->usage->cached_prompt_tokens;
    if (m->usage && m->usage->has_store_cached_tokens)
        f->res->n_store_cached = m->usage->store_cached_tokens;
    const Tandem__V1__Timing *tm = m->timing;
    if (tm) {
        f->res->predicted_ttft = tm->has_predicted_ttft_ms ? tm->predicted_ttft_ms / 1e3 : 0;
        f->res->server_ttft = tm->has_ttft_ms ? tm->ttft_ms / 1e3 : 0;
        snprintf(f->res->prefill_worker, sizeof f->res->prefill_worker, "%s",
                 tm->prefill_worker ? tm->prefill_worker : "");
        snprintf(f->res->decode_worker, sizeof f->res->decode_worker, "%s", tm->decode_worker ? tm->decode_worker : "");
        if (tm->has_handoff_ms) {
            f->res->reserve_ms = tm->reserve_ms;
            f->res->prefill_call_ms = tm->prefill_call_ms;
            f->res->prefill_worker_ms = tm->prefill_worker_ms;
            f->res->handoff_ms = tm->handoff_ms;
            f->res->first_token_early = tm->first_token_early;
        }
    }
    tandem__v1__generate_response__free_unpacked(m, NULL);
}

/* The stream ended (its status is in): the result, and the flight handed
 * to the sender. */
static void flight_end(gflight_t *f, double t)
{
    bench_result_t *r = f->res;
    td_rpc_result_t st = {0};
    td_rpc_stream_result(f->st, 0, &st);
    r->t_done = t;
    r->status = st.code;
    r->retry_after_ms = st.retry_after_ms;
    bench_result_times(r, f->times, (uint32_t)f->n_times);
    if (st.code != TD_RPC_OK && !r->error[0])
        snprintf(r->error, sizeof r->error, "gRPC status %d: %.120s", st.code, st.message);
    else if (st.code == TD_RPC_OK && !f->n_times && !r->error[0])
        snprintf(r->error, sizeof r->error, "no tokens in the response");
    r->ok = !r->error[0];
    /* refused at admission: busy, or the router's early rejection for an SLO (which says so: rejected-early) */
    r->rejected = !r->ok && !f->n_times && (st.code == TD_RPC_RESOURCE_EXHAUSTED || st.rejected_early[0]);
    run_t *run = f->run;
    pthread_mutex_lock(&run->mu);
    f->next_done = run->ended;
    run->ended = f;
    run->done++;
    run->failed += !r->ok;
    pthread_cond_signal(&run->cv);
    pthread_mutex_unlock(&run->mu);
}

static void on_read(void *ctx, td_status_t rc, const uint8_t *msg, size_t len)
{
    gflight_t *f = ctx;
    double t = td_now_s() - f->run->t0;
    if (rc == TD_OK) {
        on_message(f, msg, len, t);
        if (td_rpc_stream_read_async(f->st, on_read, f) == TD_OK)
            return;
        td_rpc_stream_cancel(f->st); /* cannot happen: one read at a time */
    }
    if (rc == TD_ERR_NO_MEMORY)
        snprintf(f->res->error, sizeof f->res->error, "no memory for a message");
    flight_end(f, t);
}

/* Destroys the streams of the flights that ended since the last call. */
static void reap(run_t *run)
{
    pthread_mutex_lock(&run->mu);
    gflight_t *f = run->ended;
    run->ended = NULL;
    pthread_mutex_unlock(&run->mu);
    while (f) {
        gflight_t *next = f->next_done;
        td_rpc_stream_destroy(f->st);
        f->st = NULL;
        free(f->times);
        f->times = NULL;
        f = next;
    }
}

td_status_t bench_run_grpc(const bench_grpc_t *o, const bench_workload_t *w, bench_result_t *res)
{
    td_rpc_init();
    td_rpc_tls_t tls = {.ca_file = o->tls_ca};
    td_rpc_channel_t *ch = NULL;
    gflight_t *fl = calloc(w->n ? w->n : 1, sizeof *fl);
    td_status_t rc = fl ? td_rpc_channel_create(o->endpoint, o->tls_ca ? &tls : NULL, &ch)
                        : td_error(TD_ERR_NO_MEMORY, "bench: no memory");
    if (rc) {
        free(fl);
        td_rpc_shutdown();
        return rc;
    }
    td_rpc_channel_set_fail_fast(ch, true); /* an endpoint that is down fails its requests at once */
    run_t run = {.t0 = td_now_s()};
    pthread_mutex_init(&run.mu, NULL);
    pthread_cond_init(&run.cv, NULL);
    double last_print = 0;
    size_t next = 0, done = 0, failed = 0;
    while (done < w->n) {
        double now = td_now_s() - run.t0;
        while (next < w->n && w->req[next].t_send <= now) { /* open loop: send on schedule */
            gflight_t *f = &fl[next];
            f->run = &run;
            f->res = &res[next];
            memset(f->res, 0, sizeof *f->res);
            f->res->t_planned = w->req[next].t_send;
            f->res->n_in = w->req[next].input_len;
            f->res->t_sent = td_now_s() - run.t0;
            size_t len = 0;
            uint8_t *rq = request_of(o, &w->req[next], f->res, &len);
            if (rq && td_rpc_stream_open(ch, "/tandem.v1.Tandem/Generate", rq, len, o->timeout_s, NULL, &f->st) == TD_OK &&
                td_rpc_stream_read_async(f->st, on_read, f) == TD_OK) {
                /* the flight is the callbacks' until it ends */
            } else {
                if (!f->res->error[0])
                    snprintf(f->res->error, sizeof f->res->error, "the call would not start: %s", td_last_error());
                if (f->st)
                    td_rpc_stream_destroy(f->st);
                f->st = NULL;
                f->res->t_done = f->res->t_sent;
                pthread_mutex_lock(&run.mu);
                run.done++;
                run.failed++;
                pthread_mutex_unlock(&run.mu);
            }
            free(rq);
            next++;
        }
        double wait = next < w->n ? w->req[next].t_send - (td_now_s() - run.t0) : 0.05;
        wait = wait < 0 ? 0 : wait > 0.05 ? 0.05 : wait;
        struct timespec until = td_wall_deadline(wait);
        pthread_mutex_lock(&run.mu);
        if (!run.ended && run.done < w->n)
            pthread_cond_timedwait(&run.cv, &run.mu, &until);
        done = run.done;
        failed = run.failed;
        pthread_mutex_unlock(&run.mu);
        reap(&run);
        if (o->progress) {
            size_t in_flight = next - done;
            bench_progress(now, &last_print, false, next, w->n, in_flight, done, failed);
        }
    }
    reap(&run);
    if (o->progress)
        bench_progress(0, &last_print, true, next, w->n, 0, done, failed);
    td_rpc_channel_destroy(ch);
    pthread_mutex_destroy(&run.mu);
    pthread_cond_destroy(&run.cv);
    free(fl);
    td_rpc_shutdown();
    return TD_OK;
}
