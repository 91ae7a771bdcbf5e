/* table.c — the router's table of workers (router/placement.h): records
 * from etcd in (a worker's role, address, contract, profile, queue), each
 * worker's references and suspicion, the wait for a change. What to place
 * where, and the predictions it takes, are placement.c's. */
#define _GNU_SOURCE
#include "common/clock.h"
#include "router/placement.h"

#include <assert.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "engine/sched.h"

void rt_table_init(rt_table_t *t, const td_kv_layout_t *expect, const td_rpc_tls_t *tls)
{
    memset(t, 0, sizeof *t);
    t->tls = tls;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->changed, NULL);
    t->expect = *expect;
    td_rng_seed(&t->rng, (uint64_t)getpid() ^ (uint64_t)(td_now_s() * 1e9));
    /* until a node's record says its tiers' rates: the CPU tier's and the SSD tier's (kvstore/tier.c) */
    rt_table_set_tier_rates(t, (const double[]){2.0, 0.65}, 2);
}

void rt_table_set_tier_rates(rt_table_t *t, const double *gbps, size_t n)
{
    double bytes = (double)td_kv_block_bytes(&t->expect);
    pthread_mutex_lock(&t->mu);
    for (size_t k = 0; k < RT_IX_TIERS; k++)
        if (k < n && gbps[k] > 0)
            t->tier_ms_per_block[k] = bytes / (gbps[k] * 1e6);
        else if (k >= n && k)
            t->tier_ms_per_block[k] = t->tier_ms_per_block[k - 1]; /* deeper than any given: as the last */
    pthread_mutex_unlock(&t->mu);
}

void rt_table_set_slo_aim(rt_table_t *t, uint32_t ttft_ms, uint32_t tpot_ms)
{
    pthread_mutex_lock(&t->mu);
    t->aim_ttft_ms = ttft_ms, t->aim_tpot_ms = tpot_ms;
    pthread_mutex_unlock(&t->mu);
}

static void worker_put(rt_worker_t *w)
{
    assert(w->refs > 0);
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
    w->ix_src = -1;
    snprintf(w->key, sizeof w->key, "%s", key);
    take_str(j, "id", w->id, sizeof w->id);
    take_str(j, "addr", w->addr, sizeof w->addr);
    char role[16];
    take_str(j, "role", role, sizeof role);
    w->role = !strcmp(role, "prefill") ? RT_PREFILL : RT_DECODE;
    w->colocated = w->role == RT_DECODE && json_is_true(json_object_get(j, "colocated"));
    take_str(j, "devices", w->devices, sizeof w->devices);
    const json_t *q = json_object_get(j, "queue");
    json_int_t ql = json_integer_value(json_object_get(q, "levels")), qq = json_integer_value(json_object_get(q, "quantum"));
    eng_order_t order;
    if (eng_order_parse(json_string_value(json_object_get(q, "order")), &order) && order == ENG_ORDER_MLQ &&
        ql >= 1 && ql <= 16 && qq >= 1 && qq <= UINT32_MAX)
        w->queue_levels = (uint32_t)ql, w->queue_quantum = (uint32_t)qq;
    json_int_t tb = json_integer_value(json_object_get(j, "token_budget"));
    w->token_budget = tb > 0 && tb <= UINT32_MAX ? (uint32_t)tb : 0;
    json_int_t kvb = json_integer_value(json_object_get(j, "kv_blocks"));
    w->kv_blocks = kvb > 0 && kvb <= UINT32_MAX ? (uint32_t)kvb : 0;
    td_status_t crc = td_kv_layout_from_json(json_object_get(j, "contract"), &w->contract);
    const json_t *prof = json_object_get(j, "profile");
    if (prof && eng_profile_from_json(prof, &w->profile))
        TD_WARN("router: the worker record %s has a profile that does not parse (%s); its speed is learnt online",
                key, td_last_error());
    else
        w->has_profile = prof != NULL;
    json_decref(j);
    if ((strcmp(role, "prefill") && strcmp(role, "decode")) || !w->addr[0]) {
        TD_WARN("router: the worker record %s has no usable role or address; ignored", key);
        free(w);
        return;
    }
    char who[160];
    snprintf(who, sizeof who, "worker %s", w->id);
    td_rpc_tls_t tc; /* the channel talks only to a worker of the record's role (a cluster certificate of
                      * another role, a client's, may have written the record) */
    if (crc || td_kv_contract_check(&t->expect, &w->contract, who)) {
        w->refused = true;
        snprintf(w->refused_why, sizeof w->refused_why, "%s", td_last_error());
        td_log(TD_LOG_ERROR, "router: %s (%s) refused: its KV contract differs from the cluster's: %s", w->id,
               w->addr, w->refused_why);
    } else if (td_rpc_channel_create(w->addr, td_rpc_tls_peer(t->tls, w->role == RT_PREFILL ? "prefill" : "decode", &tc),
                                     &w->ch)) {
        free(w);
        return;
    } else {
        /* a worker's address is its process's: one that cannot be reached is dead or going (its restart comes
         * back under another id), so a call fails at once instead of waiting for it until its record's lease
         * runs out, and the request is placed on another */
        td_rpc_channel_set_fail_fast(w->ch, true);
        TD_INFO("router: %s worker %s joined at %s", role, w->id, w->addr);
    }
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->w[i]->key, key)) { /* re-registered: replace */
            memcpy(w->pf_fit, t->w[i]->pf_fit, sizeof w->pf_fit);
            memcpy(w->obs, t->w[i]->obs, sizeof w->obs);
            w->n_obs = t->w[i]->n_obs;
            w->pf_reach = t->w[i]->pf_reach;
            w->k_step = t->w[i]->k_step;
            w->ix_src = t->w[i]->ix_src;
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

void rt_table_fini(rt_table_t *t)
{
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++)
        worker_put(t->w[i]);
    free(t->w);
    t->w = NULL;
    t->n = 0;
    for (uint32_t i = 0; i < t->n_policy; i++)
        if (t->policy[i].ops->state_free)
            t->policy[i].ops->state_free(t->policy[i].state);
    t->n_policy = 0;
    pthread_mutex_unlock(&t->mu);
    pthread_cond_destroy(&t->changed);
    pthread_mutex_destroy(&t->mu);
}

void rt_table_remove(rt_table_t *t, const char *key)
{
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->w[i]->key, key)) {
            TD_INFO("router: worker %s left; its calls in flight end now", t->w[i]->id);
            t->left_at[t->w[i]->role] = td_now_s();
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

double rt_suspect_for(int code)
{
    switch (code) {
    case TD_RPC_OK:
    case TD_RPC_CANCELLED:
    case TD_RPC_INVALID_ARGUMENT:
    case TD_RPC_NOT_FOUND:
    case TD_RPC_PERMISSION_DENIED:
    case TD_RPC_UNAUTHENTICATED:
    case TD_RPC_OUT_OF_RANGE:
        return 0;
    case TD_RPC_RESOURCE_EXHAUSTED: return 0.1;
    case TD_RPC_FAILED_PRECONDITION: return 60;
    default: return 2;
    }
}

void rt_table_done(rt_table_t *t, rt_worker_t *w, const td_rpc_result_t *failed, double suspect_s)
{
    pthread_mutex_lock(&t->mu);
    assert(w->inflight > 0); /* released once per pick */
    w->inflight--;
    if (failed && suspect_s > 0) {
        w->suspect_until = td_now_s() + suspect_s;
        w->suspect_code = failed->code ? failed->code : TD_RPC_UNAVAILABLE;
        snprintf(w->suspect_why, sizeof w->suspect_why, "%.*s", (int)sizeof w->suspect_why - 1, failed->message);
    }
    worker_put(w);
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
