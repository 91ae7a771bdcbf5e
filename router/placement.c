/* placement.c — see placement.h. */
#define _GNU_SOURCE
#include "common/clock.h"
#include "router/placement.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

static bool usable(const rt_worker_t *w, rt_role_t role, double now)
{
    return w->role == role && !w->refused && !w->gone && w->suspect_until <= now;
}

static rt_worker_t *least_loaded(rt_table_t *t, rt_role_t role, const int32_t *tokens, size_t n_tokens, double now)
{
    (void)tokens;
    (void)n_tokens;
    rt_worker_t *best = NULL;
    for (size_t i = 0; i < t->n; i++)
        if (usable(t->w[i], role, now) && (!best || t->w[i]->inflight < best->inflight))
            best = t->w[i];
    return best;
}

/* An exponentially weighted mean of each worker's measured TTFT and TPOT. */
static void ewma_observe(rt_table_t *t, rt_worker_t *prefill, rt_worker_t *decode, const rt_timings_t *tm)
{
    (void)t;
    if (!tm->ok)
        return;
    if (prefill)
        prefill->ewma_ttft_ms = prefill->ewma_ttft_ms ? 0.8 * prefill->ewma_ttft_ms + 0.2 * tm->ttft_ms : tm->ttft_ms;
    if (decode && tm->output_tokens > 1)
        decode->ewma_tpot_ms = decode->ewma_tpot_ms ? 0.8 * decode->ewma_tpot_ms + 0.2 * tm->tpot_ms : tm->tpot_ms;
}

const rt_placement_ops_t rt_placement_least_loaded = {.name = "least_loaded", .pick = least_loaded,
                                                      .observe = ewma_observe};

void rt_table_init(rt_table_t *t, const td_kv_layout_t *expect, const td_rpc_tls_t *tls)
{
    memset(t, 0, sizeof *t);
    t->tls = tls;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->changed, NULL);
    t->expect = *expect;
}

static void worker_put(rt_worker_t *w)
{
    if (--w->refs == 0) {
        td_rpc_channel_destroy(w->ch);
        free(w);
    }
}

static void take_str(json_t *o, const char *k, char *dst, size_t cap)
{
    const char *s = json_string_value(json_object_get(o, k));
    snprintf(dst, cap, "%s", s ? s : "");
}

void rt_table_put(rt_table_t *t, const char *key, const char *value)
{
    json_error_t err;
    json_t *j = json_loads(value, 0, &err);
    if (!j || !json_is_object(j)) {
        TD_WARN("router: the worker record %s is not JSON (%s); ignored", key, err.text);
        json_decref(j);
        return;
    }
    rt_worker_t *w = calloc(1, sizeof *w);
    if (!w) {
        json_decref(j);
        return;
    }
    w->refs = 1;
    snprintf(w->key, sizeof w->key, "%s", key);
    take_str(j, "id", w->id, sizeof w->id);
    take_str(j, "addr", w->addr, sizeof w->addr);
    char role[16];
    take_str(j, "role", role, sizeof role);
    w->role = !strcmp(role, "prefill") ? RT_PREFILL : RT_DECODE;
    td_status_t crc = td_kv_layout_from_json(json_object_get(j, "contract"), &w->contract);
    json_decref(j);
    if ((strcmp(role, "prefill") && strcmp(role, "decode")) || !w->addr[0]) {
        TD_WARN("router: the worker record %s has no usable role or address; ignored", key);
        free(w);
        return;
    }
    char who[160];
    snprintf(who, sizeof who, "worker %s", w->id);
    if (crc || td_kv_contract_check(&t->expect, &w->contract, who)) {
        w->refused = true;
        snprintf(w->refused_why, sizeof w->refused_why, "%s", td_last_error());
        td_log(TD_LOG_ERROR, "router: %s (%s) refused: its KV contract differs from the cluster's: %s", w->id,
               w->addr, w->refused_why);
    } else if (td_rpc_channel_create(w->addr, t->tls, &w->ch)) {
        free(w);
        return;
    } else {
        TD_INFO("router: %s worker %s joined at %s", role, w->id, w->addr);
    }
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->w[i]->key, key)) { /* re-registered: replace */
            t->w[i]->gone = true;
            if (strcmp(t->w[i]->addr, w->addr)) /* another process now: end what the old one held */
                td_rpc_channel_shutdown(t->w[i]->ch);
            worker_put(t->w[i]);
            t->w[i] = w;
            pthread_cond_broadcast(&t->changed);
            pthread_mutex_unlock(&t->mu);
            return;
        }
    if (t->n == t->cap) {
        size_t nc = t->cap ? 2 * t->cap : 16;
        rt_worker_t **nw = realloc(t->w, nc * sizeof *nw);
        if (!nw) {
            pthread_mutex_unlock(&t->mu);
            TD_WARN("router: no memory to add worker %s to the table; it is not used", w->id);
            worker_put(w);
            return;
        }
        t->w = nw;
        t->cap = nc;
    }
    t->w[t->n++] = w;
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->mu);
}

void rt_table_remove(rt_table_t *t, const char *key)
{
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->w[i]->key, key)) {
            TD_INFO("router: worker %s left; its calls in flight end now", t->w[i]->id);
            t->w[i]->gone = true;
            td_rpc_channel_shutdown(t->w[i]->ch); /* requests on it fail over instead of waiting */
            worker_put(t->w[i]);
            t->w[i] = t->w[--t->n];
            pthread_cond_broadcast(&t->changed);
            break;
        }
    pthread_mutex_unlock(&t->mu);
}

void rt_table_retain(rt_table_t *t, const char *const *keys, size_t n)
{
    char gone[64][256];
    size_t n_gone = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n && n_gone < 64; i++) {
        bool keep = false;
        for (size_t k = 0; k < n && !keep; k++)
            keep = !strcmp(t->w[i]->key, keys[k]);
        if (!keep)
            snprintf(gone[n_gone++], sizeof gone[0], "%s", t->w[i]->key);
    }
    pthread_mutex_unlock(&t->mu);
    for (size_t i = 0; i < n_gone; i++)
        rt_table_remove(t, gone[i]);
}

rt_worker_t *rt_table_acquire(rt_table_t *t, const rt_placement_ops_t *p, rt_role_t role, const int32_t *tokens,
                              size_t n_tokens)
{
    pthread_mutex_lock(&t->mu);
    rt_worker_t *w = p->pick(t, role, tokens, n_tokens, td_now_s());
    if (w) {
        w->refs++;
        w->inflight++;
    }
    pthread_mutex_unlock(&t->mu);
    return w;
}

void rt_table_done(rt_table_t *t, rt_worker_t *w, const td_rpc_result_t *failed, double suspect_s)
{
    pthread_mutex_lock(&t->mu);
    w->inflight--;
    if (failed) {
        w->suspect_until = td_now_s() + suspect_s;
        w->suspect_code = failed->code ? failed->code : TD_RPC_UNAVAILABLE;
        snprintf(w->suspect_why, sizeof w->suspect_why, "%.*s", (int)sizeof w->suspect_why - 1, failed->message);
    }
    worker_put(w);
    pthread_mutex_unlock(&t->mu);
}

/* Why no worker of role is usable: the code, the reason, and retry_at. */
static void refuse(rt_table_t *t, rt_role_t role, double now, rt_placement_t *out)
{
    const char *rn = role == RT_PREFILL ? "prefill" : "decode";
    size_t registered = 0, refused = 0;
    const rt_worker_t *first_refused = NULL, *soonest = NULL;
    bool full = false;
    for (size_t i = 0; i < t->n; i++) {
        const rt_worker_t *w = t->w[i];
        if (w->role != role || w->gone)
            continue;
        registered++;
        if (w->refused) {
            refused++;
            first_refused = first_refused ? first_refused : w;
        } else if (w->suspect_until > now) {
            if (!soonest || w->suspect_until < soonest->suspect_until)
                soonest = w;
            full = full || w->suspect_code == TD_RPC_RESOURCE_EXHAUSTED;
        }
    }
    out->retry_at = soonest ? soonest->suspect_until : 0;
    if (!registered) {
        out->code = TD_RPC_UNAVAILABLE;
        snprintf(out->why, sizeof out->why, "no %s worker is registered with this router", rn);
    } else if (refused == registered) {
        out->code = TD_RPC_FAILED_PRECONDITION;
        snprintf(out->why, sizeof out->why, "every %s worker was refused (%.64s: %.200s)", rn, first_refused->id,
                 first_refused->refused_why);
    } else {
        out->code = full ? TD_RPC_RESOURCE_EXHAUSTED : TD_RPC_UNAVAILABLE;
        snprintf(out->why, sizeof out->why, "no %s worker can take it for %.2f s: %.64s answered %s (%.160s)", rn,
                 soonest ? soonest->suspect_until - now : 0.0, soonest ? soonest->id : "?",
                 td_rpc_code_name(soonest ? soonest->suspect_code : 0), soonest ? soonest->suspect_why : "");
    }
}

void rt_table_place(rt_table_t *t, const rt_placement_ops_t *p, const int32_t *tokens, size_t n_tokens,
                    rt_placement_t *out)
{
    memset(out, 0, sizeof *out);
    double now = td_now_s();
    pthread_mutex_lock(&t->mu);
    rt_worker_t *d = p->pick(t, RT_DECODE, tokens, n_tokens, now);
    rt_worker_t *pf = d ? p->pick(t, RT_PREFILL, tokens, n_tokens, now) : NULL;
    if (d && pf) {
        d->refs++;
        d->inflight++;
        pf->refs++;
        pf->inflight++;
        out->decode = d;
        out->prefill = pf;
    } else {
        refuse(t, d ? RT_PREFILL : RT_DECODE, now, out);
    }
    pthread_mutex_unlock(&t->mu);
}

void rt_table_observe(rt_table_t *t, const rt_placement_ops_t *p, rt_worker_t *prefill, rt_worker_t *decode,
                      const rt_timings_t *tm)
{
    if (!p->observe)
        return;
    pthread_mutex_lock(&t->mu);
    p->observe(t, prefill, decode, tm);
    pthread_mutex_unlock(&t->mu);
}

void rt_table_wait(rt_table_t *t, double until)
{
    struct timespec ts = td_wall_deadline(until - td_now_s());
    pthread_mutex_lock(&t->mu);
    pthread_cond_timedwait(&t->changed, &t->mu, &ts);
    pthread_mutex_unlock(&t->mu);
}

void rt_table_hold(rt_table_t *t, rt_worker_t *w)
{
    pthread_mutex_lock(&t->mu);
    w->refs++;
    pthread_mutex_unlock(&t->mu);
}

void rt_table_unhold(rt_table_t *t, rt_worker_t *w)
{
    pthread_mutex_lock(&t->mu);
    worker_put(w);
    pthread_mutex_unlock(&t->mu);
}

uint32_t rt_table_registered(rt_table_t *t, rt_role_t role)
{
    uint32_t n = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++)
        n += t->w[i]->role == role && !t->w[i]->refused && !t->w[i]->gone;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void rt_table_counts(rt_table_t *t, uint32_t *prefill, uint32_t *decode)
{
    double now = td_now_s();
    *prefill = *decode = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++) {
        if (usable(t->w[i], RT_PREFILL, now))
            (*prefill)++;
        if (usable(t->w[i], RT_DECODE, now))
            (*decode)++;
    }
    pthread_mutex_unlock(&t->mu);
}
