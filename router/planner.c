/* planner.c — see planner.h. */
#define _GNU_SOURCE
#include "router/planner.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/ops.h"
#include "router/demand.h"

struct rt_planner {
    char id[192], model[256], alias[256], *endpoints;
    uint32_t lease_ttl_s;
    const td_rpc_tls_t *tls;
    rt_stats_t *stats;
    rt_table_t *table;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop, poked, running, lease_lost;
    /* the thread's, read by rt_planner_json under mu */
    bool leader;
    bool has_desired;
    td_ops_desired_t desired;
    char verdict[640], error[384];
    rt_demand_t demand; /* auto's last predicted demand */
    /* auto's hysteresis: the move wanted (-1 decode to prefill, +1 the other way, 0 none) and since when */
    int want;
    double want_since, changed_at;
    uint64_t decisions; /* desired counts this planner wrote (under mu) */
    /* choose_mode: the attainment measured under each mode (0 disaggregated, 1 colocated) when the planner last
     * left it, and when (0: never); the last window's */
    double mode_att[2], mode_left[2], att;
    char *last_ops;     /* the text of the last ops config it planned by (the thread's): put back after a wipe */
    uint64_t restored;  /* times it put that back (under mu) */
};

static void set_error(rt_planner_t *p, const char *what)
{
    pthread_mutex_lock(&p->mu);
    bool news = strcmp(p->error, what) != 0;
    snprintf(p->error, sizeof p->error, "%s", what);
    pthread_mutex_unlock(&p->mu);
    if (news && what[0])
        TD_WARN("planner: %s", what);
}

/* auto's moves: a decode worker becomes a prefill worker (-1) or the
 * reverse (+1); with choose_mode, the model goes colocated (+COLOCATE:
 * every prefill worker becomes a decode worker that prefills its own
 * requests) or comes back (-COLOCATE: min_prefill of them become prefill
 * workers again). */
#define COLOCATE 2

static const char *move_name(int v)
{
    return v == COLOCATE ? "disaggregated -> colocated" : v == -COLOCATE ? "colocated -> disaggregated"
         : v < 0         ? "decode -> prefill"
                         : "prefill -> decode";
}

/* What rt_planner_json shows of the last prediction (NULL: none, not under auto). */
static void set_demand(rt_planner_t *p, const rt_demand_t *d)
{
    pthread_mutex_lock(&p->mu);
    if (d)
        p->demand = *d;
    else
        memset(&p->demand, 0, sizeof p->demand);
    pthread_mutex_unlock(&p->mu);
}

/* The demand the requests placed since `since` predict (router/demand.h). */
static void predict(rt_planner_t *p, const td_ops_t *ops, double since, rt_demand_t *d)
{
    memset(d, 0, sizeof *d);
    if (!p->table)
        return;
    rt_arrivals_t a;
    rt_stats_arrivals(p->stats, since, &a);
    rt_capacity_t c;
    double n = a.n ? a.n : 1;
    rt_table_capacity(p->table, (a.new_tokens - a.local_tokens) / n, a.ctx_tokens / n, ops->slo.tpot_ms, &c);
    rt_demand_of(&a, &c, d);
}

static int reactive_verdict(rt_planner_t *p, const td_ops_t *ops, const td_ops_model_t *m,
                            const td_ops_desired_t *now, const rt_slo_window_t *w, bool *met, char *why, size_t cap)
{
    double att = p->att = (double)w->met / w->n;
    int n = snprintf(why, cap, "auto: %u requests, %.0f%% met the SLOs (target %.0f%%); %u missed TTFT %u ms (p90 "
                     "%.0f ms), %u missed TPOT %u ms (p90 %.1f ms)", w->n, 100 * att, 100 * ops->slo.attainment,
                     w->ttft_missed, ops->slo.ttft_ms, w->ttft_p90_ms, w->tpot_missed, ops->slo.tpot_ms,
                     w->tpot_p90_ms);
    *met = att >= ops->slo.attainment;
    /* the other mode's attainment when it was left, if lately (the workload may have changed since) */
    int other = !now->colocated;
    double ago = td_now_s() - p->mode_left[other];
    bool known = p->mode_left[other] > 0 && ago < 10.0 * ops->planner.cooldown_s;
    if (m->choose_mode && known && n > 0 && (size_t)n < cap)
        n += snprintf(why + n, cap - n, "; %s met %.0f%% %.0f s ago", other ? "colocated" : "disaggregated",
                      100 * p->mode_att[other], ago);
    if (m->choose_mode && now->colocated) {
        if (n > 0 && (size_t)n < cap)
            snprintf(why + n, cap - n, "; colocated");
        /* not back to what did no better */
        return !*met && w->tpot_missed && w->tpot_missed >= w->ttft_missed && !(known && p->mode_att[0] <= att)
                   ? -COLOCATE : 0;
    }
    if (m->choose_mode && !*met && known && p->mode_att[1] > att + 0.1)
        return COLOCATE; /* disaggregated does worse than colocated did */
    if (m->choose_mode && n > 0 && (size_t)n < cap)
        snprintf(why + n, cap - n, "; %.0f%% of %llu prompt tokens prefilled by their decode workers",
                 w->prompt_tokens ? 100.0 * w->local_tokens / w->prompt_tokens : 0.0,
                 (unsigned long long)w->prompt_tokens);
    if (m->choose_mode && *met && w->prompt_tokens && 4 * w->local_tokens >= 3 * w->prompt_tokens)
        return COLOCATE;
    if (*met)
        return 0;
    if (w->ttft_missed > w->tpot_missed && now->decode > m->min_decode && now->prefill < m->max_prefill)
        return -1;
    if (w->tpot_missed > w->ttft_missed && now->prefill > m->min_prefill && now->decode < m->max_decode)
        return +1;
    return 0;
}

/* auto: the move the window asks for (0: none), in words in why. The mode
 * (choose_mode) goes by what was measured under the one running: colocated
 * while the SLOs hold and the decode workers prefilled at least 3 in 4 of
 * the prompt tokens themselves (conditional disaggregation found the trip
 * to a prefill worker not worth it for them: those workers serve better as
 * decode workers; weighed by tokens, so the long documents of a mixed
 * workload, which the prefill workers take, keep them); back to prefill
 * workers when colocated misses the SLOs with TPOT missed at least as often
 * as TTFT (prompt chunks stalling the running streams, which separating the
 * phases takes away). Between prefill and decode workers, the predicted
 * demand moves first while the SLOs hold (or too few requests ended to
 * judge them), and vetoes a move the misses ask for that it predicts would
 * overload the role giving the worker up. */
static int auto_verdict(rt_planner_t *p, const td_ops_t *ops, const td_ops_model_t *m, const td_ops_desired_t *now,
                        double since, char *why, size_t cap)
{
    rt_demand_t d = {0};
    if (!now->colocated)
        predict(p, ops, since, &d);
    set_demand(p, &d);
    rt_slo_window_t w; /* at least the last 8 since the last change: an overloaded worker finishes few */
    rt_stats_window_n(p->stats, since, p->changed_at, 8, ops->slo.ttft_ms, ops->slo.tpot_ms, &w);
    int v;
    bool met = true;
    if (w.n < 8) {
        snprintf(why, cap, "auto: %u requests finished since %.0f s ago; waiting for 8", w.n,
                 td_now_s() - (p->changed_at ? p->changed_at : since));
        v = 0;
    } else {
        v = reactive_verdict(p, ops, m, now, &w, &met, why, cap);
    }
    rt_demand_say(&d, now->prefill, now->decode, why, cap);
    size_t n = strlen(why);
    if ((v == -1 || v == 1) && rt_demand_vetoes(&d, v, now->prefill, now->decode)) {
        if (n < cap)
            snprintf(why + n, cap - n, "; not %s: predicted to overload the %s workers", move_name(v),
                     v < 0 ? "decode" : "prefill");
        return 0;
    }
    if (!v && met && !now->colocated && (v = rt_demand_move(&d, now->prefill, now->decode, m)) && n < cap)
        snprintf(why + n, cap - n, "; %s predicted to balance them", move_name(v));
    return v;
}

/* The ops config's SLOs (none: 0) to the router's placement, which aims at
 * them for requests that state none (rt_table_set_slo_aim). */
static void aim(rt_planner_t *p, const td_ops_t *ops)
{
    if (p->table)
        rt_table_set_slo_aim(p->table, ops ? ops->slo.ttft_ms : 0, ops ? ops->slo.tpot_ms : 0);
}

/* A router that does not plan reads the ops config for its SLOs alone. */
static void follow_aim(rt_planner_t *p, td_etcd_t *e)
{
    td_etcd_kvs_t kvs = {0};
    if (!p->table || td_etcd_get(e, TD_OPS_KEY, false, &kvs))
        return; /* etcd away: the SLOs last read stay */
    td_ops_t *ops = NULL;
    if (!kvs.n)
        aim(p, NULL);
    else if (td_ops_parse((const char *)kvs.kv[0].value, kvs.kv[0].value_len, "etcd " TD_OPS_KEY, &ops) == TD_OK)
        aim(p, ops);
    td_ops_free(ops);
    td_etcd_kvs_free(&kvs);
}

/* One look, as the leader: the ops config, the counts it asks for, and the
 * record written when they differ from what is there. */
static void plan(rt_planner_t *p, td_etcd_t *e)
{
    td_etcd_kvs_t kvs = {0};
    if (td_etcd_get(e, TD_OPS_KEY, false, &kvs)) {
        set_error(p, td_last_error());
        return;
    }
    if (!kvs.n && p->last_ops) {
        /* someone wiped it (etcd's keys deleted, a restore from an old snapshot): the last one planned by
         * comes back, or the cluster would forget its shape until the next tandem scale */
        td_etcd_kvs_free(&kvs);
        if (td_etcd_put(e, TD_OPS_KEY, p->last_ops, strlen(p->last_ops), 0) ||
            td_etcd_get(e, TD_OPS_KEY, false, &kvs)) {
            set_error(p, td_last_error());
            return;
        }
        TD_WARN("planner: the ops config was gone from etcd (%s); the last one applied is put back", TD_OPS_KEY);
        pthread_mutex_lock(&p->mu);
        p->restored++;
        pthread_mutex_unlock(&p->mu);
    }
    if (!kvs.n) {
        td_etcd_kvs_free(&kvs);
        aim(p, NULL);
        set_error(p, "");
        pthread_mutex_lock(&p->mu);
        snprintf(p->verdict, sizeof p->verdict, "no ops config in etcd (%s): nothing to plan", TD_OPS_KEY);
        pthread_mutex_unlock(&p->mu);
        return;
    }
    td_ops_t *ops = NULL;
    td_status_t rc = td_ops_parse((const char *)kvs.kv[0].value, kvs.kv[0].value_len, "etcd " TD_OPS_KEY, &ops);
    if (!rc && (!p->last_ops || strcmp(p->last_ops, (const char *)kvs.kv[0].value))) {
        char *t = strdup((const char *)kvs.kv[0].value);
        if (t) {
            free(p->last_ops);
            p->last_ops = t;
        }
    }
    td_etcd_kvs_free(&kvs);
    if (rc) {
        set_error(p, td_last_error());
        return;
    }
    aim(p, ops);
    const char *model = p->model;
    const td_ops_model_t *m = td_ops_model(ops, model, p->alias[0] ? p->alias : NULL);
    if (!m) {
        char why[320];
        snprintf(why, sizeof why, "the ops config has no entry for %s (nor \"*\")", model);
        set_error(p, why);
        td_ops_free(ops);
        return;
    }
    td_ops_desired_t cur = {0};
    bool has_cur = false;
    if (td_etcd_get(e, TD_OPS_DESIRED_KEY, false, &kvs) == TD_OK) {
        has_cur = kvs.n && td_ops_desired_parse((const char *)kvs.kv[0].value, kvs.kv[0].value_len, &cur) == TD_OK;
        td_etcd_kvs_free(&kvs);
    } else {
        set_error(p, td_last_error());
        td_ops_free(ops);
        return;
    }
    set_error(p, "");
    td_ops_desired_t next = {.prefill = m->prefill, .decode = m->decode, .colocated = m->colocated};
    char why[640];
    double now = td_now_s();
    if (m->colocated) {
        snprintf(why, sizeof why, "fixed: %u colocated workers", m->decode);
        p->want = 0;
        set_demand(p, NULL);
    } else if (!td_ops_is_auto(m)) {
        snprintf(why, sizeof why, "fixed: %u prefill + %u decode workers", m->prefill, m->decode);
        p->want = 0;
        set_demand(p, NULL);
    } else {
        uint32_t total = has_cur ? cur.prefill + cur.decode : next.prefill + next.decode;
        if (has_cur && cur.colocated && m->choose_mode) { /* the planner's colocated mode: no prefill worker */
            next.prefill = 0;
            next.decode = total;
            next.colocated = true;
        } else if (has_cur) { /* auto starts from what runs, clamped into the bounds */
            next.prefill = cur.prefill < m->min_prefill ? m->min_prefill
                         : cur.prefill > m->max_prefill ? m->max_prefill : cur.prefill;
            next.decode = total > next.prefill ? total - next.prefill : 0;
            next.decode = next.decode < m->min_decode ? m->min_decode
                        : next.decode > m->max_decode ? m->max_decode : next.decode;
        }
        /* the requests that finished in the last 3 x hold_s (at least the last 8), and since the last change */
        double since = now - 3.0 * ops->planner.hold_s;
        if (p->changed_at > since)
            since = p->changed_at;
        int v = auto_verdict(p, ops, m, &next, since, why, sizeof why);
        if (v != p->want) {
            p->want = v;
            p->want_since = now;
        }
        bool held = v && now - p->want_since >= ops->planner.hold_s;
        bool cooled = now - p->changed_at >= ops->planner.cooldown_s;
        size_t n = strlen(why);
        if (v == -COLOCATE && total < m->min_prefill + m->min_decode) {
            snprintf(why + n, sizeof why - n, "; %u workers cannot be %u prefill + %u decode: colocated stays", total,
                     m->min_prefill, m->min_decode);
        } else if (v && held && cooled) {
            if (v == COLOCATE || v == -COLOCATE) { /* what the mode left behind measured, for the way back */
                p->mode_att[v < 0] = p->att;
                p->mode_left[v < 0] = now;
            }
            if (v == COLOCATE) {
                snprintf(why + n, sizeof why - n, "; colocated: the %u prefill worker(s) become decode workers",
                         next.prefill);
                next.decode = total, next.prefill = 0, next.colocated = true;
            } else if (v == -COLOCATE) {
                snprintf(why + n, sizeof why - n, "; disaggregated: %u decode worker(s) become prefill workers",
                         m->min_prefill);
                next.prefill = m->min_prefill, next.decode = total - m->min_prefill, next.colocated = false;
            } else {
                next.prefill = v < 0 ? next.prefill + 1 : next.prefill - 1;
                next.decode = v < 0 ? next.decode - 1 : next.decode + 1;
                snprintf(why + n, sizeof why - n, "; one %s worker becomes a %s worker", v < 0 ? "decode" : "prefill",
                         v < 0 ? "prefill" : "decode");
            }
            p->want = 0;
        } else if (v) {
            snprintf(why + n, sizeof why - n, "; %s wanted for %.0f s (hold %u s, cooldown %u s)", move_name(v),
                     now - p->want_since, ops->planner.hold_s, ops->planner.cooldown_s);
        }
    }
    td_ops_free(ops);
    pthread_mutex_lock(&p->mu);
    snprintf(p->verdict, sizeof p->verdict, "%s", why);
    pthread_mutex_unlock(&p->mu);
    if (has_cur && cur.prefill == next.prefill && cur.decode == next.decode && cur.colocated == next.colocated) {
        pthread_mutex_lock(&p->mu);
        p->desired = cur;
        p->has_desired = true;
        pthread_mutex_unlock(&p->mu);
        return;
    }
    next.at = (double)time(NULL);
    snprintf(next.by, sizeof next.by, "%s", p->id);
    snprintf(next.reason, sizeof next.reason, "%s", why);
    char *j = td_ops_desired_json(&next);
    if (!j || td_etcd_put(e, TD_OPS_DESIRED_KEY, j, strlen(j), 0)) {
        set_error(p, j ? td_last_error() : "no memory for the planner's record");
        free(j);
        return;
    }
    free(j);
    p->changed_at = now;
    TD_INFO("planner: %u prefill + %u %sdecode workers (%s)", next.prefill, next.decode,
            next.colocated ? "colocated " : "", why);
    pthread_mutex_lock(&p->mu);
    p->desired = next;
    p->has_desired = true;
    p->decisions++;
    pthread_mutex_unlock(&p->mu);
}

static void lease_lost(void *ctx)
{
    rt_planner_t *p = ctx;
    pthread_mutex_lock(&p->mu);
    p->lease_lost = p->poked = true; /* campaign again under a new lease */
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Waits s seconds, a poke or the stop; true to go on. */
static bool nap(rt_planner_t *p, double s)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)s;
    until.tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&p->mu);
    while (!p->stop && !p->poked && pthread_cond_timedwait(&p->cv, &p->mu, &until) == 0) {
    }
    p->poked = false;
    bool go = !p->stop;
    pthread_mutex_unlock(&p->mu);
    return go;
}

static void *planner_thread(void *arg)
{
    rt_planner_t *p = arg;
    td_etcd_t *e = NULL;
    int64_t lease = 0;
    double ttl = p->lease_ttl_s;
    do {
        if (!e && td_etcd_connect(p->endpoints, p->tls, &e)) {
            set_error(p, td_last_error());
            e = NULL;
            continue;
        }
        pthread_mutex_lock(&p->mu);
        bool lost = p->lease_lost;
        p->lease_lost = false;
        pthread_mutex_unlock(&p->mu);
        if (lease && lost) { /* a new lease, a new campaign */
            td_etcd_keepalive_stop(e);
            lease = 0;
        }
        if (!lease && (td_etcd_lease_grant(e, (int64_t)ttl, &lease) ||
                       td_etcd_keepalive_start(e, lease, (int64_t)ttl, lease_lost, p))) {
            set_error(p, td_last_error());
            lease = 0;
            continue;
        }
        bool won = false;
        if (td_etcd_campaign(e, TD_OPS_PLANNER_KEY, p->id, strlen(p->id), lease, &won)) {
            set_error(p, td_last_error());
            continue;
        }
        pthread_mutex_lock(&p->mu);
        bool was = p->leader;
        p->leader = won;
        pthread_mutex_unlock(&p->mu);
        if (won != was)
            TD_INFO("planner: %s", won ? "this router plans (elected)" : "another router plans");
        if (won)
            plan(p, e);
        else
            follow_aim(p, e);
    } while (nap(p, 1.0));
    if (e) {
        td_etcd_keepalive_stop(e);
        if (lease) /* resign: the next router's campaign wins at once */
            td_etcd_lease_revoke(e, lease);
        td_etcd_destroy(e);
    }
    return NULL;
}

td_status_t rt_planner_start(const rt_planner_cfg_t *cfg, rt_planner_t **out)
{
    rt_planner_t *p = calloc(1, sizeof *p);
    if (!p || !(p->endpoints = strdup(cfg->etcd_endpoints))) {
        free(p);
        return td_error(TD_ERR_NO_MEMORY, "planner: no memory");
    }
    snprintf(p->id, sizeof p->id, "%s", cfg->id);
    snprintf(p->model, sizeof p->model, "%s", cfg->model);
    snprintf(p->alias, sizeof p->alias, "%s", cfg->alias ? cfg->alias : "");
    p->lease_ttl_s = cfg->lease_ttl_s;
    p->tls = cfg->tls;
    p->stats = cfg->stats;
    p->table = cfg->table;
    pthread_mutex_init(&p->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&p->thread, NULL, planner_thread, p)) {
        free(p->endpoints);
        free(p);
        return td_error(TD_ERR_INTERNAL, "planner: cannot start its thread");
    }
    p->running = true;
    *out = p;
    return TD_OK;
}

void rt_planner_poke(rt_planner_t *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->poked = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void rt_planner_stop(rt_planner_t *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->running)
        pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->last_ops);
    free(p->endpoints);
    free(p);
}

json_t *rt_planner_json(rt_planner_t *p)
{
    if (!p)
        return json_null();
    pthread_mutex_lock(&p->mu);
    json_t *j = json_pack("{s:b, s:s, s:s, s:I, s:I}", "leader", p->leader, "verdict", p->verdict, "error", p->error,
                          "decisions", (json_int_t)p->decisions, "ops_restored", (json_int_t)p->restored);
    const rt_demand_t *dm = &p->demand;
    if (dm->known)
        json_object_set_new(j, "predicted", json_pack("{s:f, s:f, s:f, s:f}", "prompt_tokens_per_s", dm->prompt_tok_s,
                                                      "output_tokens_per_s", dm->output_tok_s, "prefill_workers",
                                                      dm->prefill, "decode_workers", dm->decode));
    if (dm->window_s > 0) /* what a prediction is made of, made or not */
        json_object_set_new(j, "demand_inputs", json_pack("{s:i, s:f, s:f, s:f}", "arrivals", (int)dm->arrivals,
                                                          "window_s", dm->window_s, "prefill_worker_tokens_per_s",
                                                          dm->prefill_cap_tok_s, "decode_worker_tokens_per_s",
                                                          dm->decode_cap_tok_s));
    if (p->has_desired) {
        char *d = td_ops_desired_json(&p->desired);
        json_t *dj = d ? json_loads(d, 0, NULL) : NULL;
        free(d);
        if (dj)
            json_object_set_new(j, "desired", dj);
    }
    pthread_mutex_unlock(&p->mu);
    return j;
}
