/* placement.c — see placement.h. */
#define _GNU_SOURCE
#include "common/clock.h"
#include "router/placement.h"

#include <assert.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/log.h"
#include "common/process.h"
#include "engine/sched.h"

/* Whether w can take role's part now; c (NULL: any request) narrows it: a
 * request served whole takes a colocated decode worker only. */
static bool usable(const rt_worker_t *w, rt_role_t role, const rt_place_ctx_t *c, double now)
{
    /* a worker whose connection fails (dead, its record not yet expired) is not placed on: a reservation made
     * for it would only be fenced */
    return w->role == role && !w->refused && !w->gone && w->suspect_until <= now && !td_rpc_channel_peer_refused(w->ch) &&
           !td_rpc_channel_down(w->ch) &&
           !(c && c->whole && role == RT_DECODE && !w->colocated) &&
           /* a prefill worker whose pool cannot hold the prompt (its record says its size) refuses it */
           !(c && role == RT_PREFILL && c->prefill_blocks && w->kv_blocks && w->kv_blocks < c->prefill_blocks);
}

/* The prompt's blocks w's pool holds, by the cache index (0: not followed). */
static uint32_t held_by(const rt_worker_t *w, const rt_place_ctx_t *c)
{
    return c->hits && w->ix_src >= 0 ? c->hits->held[w->ix_src] : 0;
}

static rt_worker_t *least_loaded(rt_table_t *t, rt_role_t role, const rt_place_ctx_t *c, double now)
{
    rt_worker_t *best = NULL;
    for (size_t i = 0; i < t->n; i++)
        if (usable(t->w[i], role, c, now) && (!best || t->w[i]->inflight < best->inflight))
            best = t->w[i];
    return best;
}

/* round_robin's state: the next turn, per role */
typedef struct rr_state {
    unsigned next[2];
} rr_state_t;

static void *rr_new(void) { return calloc(1, sizeof(rr_state_t)); }

static rt_worker_t *round_robin(rt_table_t *t, rt_role_t role, const rt_place_ctx_t *c, double now)
{
    rr_state_t none = {{0, 0}}, *s = c->state ? c->state : &none;
    for (size_t k = 0; k < t->n; k++) {
        rt_worker_t *w = t->w[(s->next[role] + k) % t->n];
        if (usable(w, role, c, now)) {
            s->next[role] = (unsigned)((s->next[role] + k + 1) % t->n);
            return w;
        }
    }
    return NULL;
}

/* p's state in t (made on first use), or NULL when it keeps none or there
 * is no room or memory for it (then it picks as from a fresh state). */
static void *policy_state(rt_table_t *t, const rt_placement_ops_t *p)
{
    if (!p->state_new)
        return NULL;
    for (uint32_t i = 0; i < t->n_policy; i++)
        if (t->policy[i].ops == p)
            return t->policy[i].state;
    void *s = t->n_policy < RT_POLICIES ? p->state_new() : NULL;
    if (s) {
        t->policy[t->n_policy].ops = p;
        t->policy[t->n_policy++].state = s;
    }
    return s;
}

/* ---- prediction (DESIGN.md §5) ---- */

/* A worker's profile, or else the first other worker's of its role (the
 * same engine, most likely), or else none (NULL). */
static const eng_profile_t *profile_of(const rt_table_t *t, const rt_worker_t *w)
{
    if (w->has_profile)
        return &w->profile;
    for (size_t i = 0; i < t->n; i++)
        if (t->w[i]->has_profile && t->w[i]->role == w->role)
            return &t->w[i]->profile;
    return NULL;
}

/* The predicted prefill work still ahead on w: what was placed on it counted
 * down since the last placement on an idle worker or the last answer; while
 * calls are in flight never less than a tenth of their work (a call that
 * runs past its prediction is not done until it answers). */
static double queued_ms(const rt_worker_t *w, double now)
{
    if (!w->prefilling)
        return 0;
    double left = w->work_ms - (now - w->work_since) * 1e3;
    return left > 0.1 * w->work_ms ? left : 0.1 * w->work_ms;
}

/* What a call of priority p waits for on w: the work ahead less the calls of
 * lower priority (the engine computes it first; taken as not yet begun), never
 * less than a tenth of the equal or higher work in flight. */
static double queued_for_ms(const rt_worker_t *w, int32_t p, double now)
{
    double lower = 0;
    for (int i = 0; i < RT_PRIOS; i++)
        if (w->by_prio[i].n && w->by_prio[i].priority < p)
            lower += w->by_prio[i].ms;
    if (lower <= 0)
        return queued_ms(w, now);
    double ahead = w->work_ms - lower, left = queued_ms(w, now) - lower;
    return left > 0.1 * ahead ? left : ahead > 0 ? 0.1 * ahead : 0;
}

/* A call's class in w's queue (rt_prediction_t.priority): its priority, and
 * where w's engine runs the mlq order (engine/sched.h), the level its new
 * tokens enter at below it: the work queued ahead of a short prompt is the
 * work of its level and those above, not the long prompts under way. */
static int32_t queue_class(const rt_worker_t *w, int32_t priority, uint32_t new_tokens)
{
    if (!w->queue_levels)
        return priority;
    const int32_t lim = 1 << 20;
    int32_t p = priority > lim ? lim : priority < -lim ? -lim : priority;
    eng_sched_config_t c = {.order = ENG_ORDER_MLQ, .levels = w->queue_levels, .quantum = w->queue_quantum};
    return p * 32 - (int32_t)eng_sched_level(&c, new_tokens, 0);
}

/* Adds (sign 1) or takes back (-1) a call's predicted work in w's slot for its priority. */
static void prio_work(rt_worker_t *w, int32_t p, double ms, int sign)
{
    int at = -1, low = 0;
    for (int i = 0; i < RT_PRIOS && at < 0; i++)
        if (w->by_prio[i].n && w->by_prio[i].priority == p)
            at = i;
    for (int i = 0; i < RT_PRIOS && at < 0 && sign > 0; i++)
        if (!w->by_prio[i].n)
            at = i;
    for (int i = 1; i < RT_PRIOS; i++)
        if (w->by_prio[i].priority < w->by_prio[low].priority)
            low = i;
    if (at < 0) /* no slot of its own: counted with the lowest priority */
        at = low;
    if (sign > 0) {
        if (!w->by_prio[at].n++)
            w->by_prio[at].priority = p, w->by_prio[at].ms = 0;
        w->by_prio[at].ms += ms;
    } else if (w->by_prio[at].n) {
        w->by_prio[at].ms = --w->by_prio[at].n ? w->by_prio[at].ms - ms : 0;
    }
}

/* The profile's time for n new tokens after cached ones, less its constant:
 * how much work the call is, in the profile's measure. */
static double profile_work(const eng_profile_t *pf, double n, double cached)
{
    return pf->prefill[1] * n + pf->prefill[2] * n * (cached + n / 2);
}

static double fit_ms(const rt_worker_t *w, double n, double cached)
{
    return w->pf_fit[0] + w->pf_fit[1] * n + w->pf_fit[2] * n * (cached + n / 2);
}

/* w's prefill model: refitted from what it measured, else its profile (or
 * its role's first other profile), else none (0). The refit is trusted up to
 * RT_REACH times the largest call it saw (in the profile's work); past that,
 * a few calls' fit would extrapolate a shape they never tested (a short
 * call's time alone once put a 1,800-token prompt at 0.6 s, against 17 s
 * measured), so the prediction is the fit at that reach grown as the profile
 * grows. */
#define RT_REACH 1.5
static double prefill_model_ms(const rt_table_t *t, const rt_worker_t *w, double n, double cached)
{
    const eng_profile_t *pf = profile_of(t, w);
    if (!w->n_obs)
        return pf ? eng_profile_prefill_ms(pf, n, cached) : 0;
    double reach = RT_REACH * w->pf_reach;
    if (!pf || profile_work(pf, n, cached) <= reach)
        return fit_ms(w, n, cached);
    /* the n' whose work is the reach: a/2 n'^2 + (b + a cached) n' = reach */
    double a = pf->prefill[2], b = pf->prefill[1] + a * cached, m;
    if (a > 0)
        m = 2 * reach / (b + sqrt(b * b + 2 * a * reach));
    else if (b > 0)
        m = reach / b;
    else
        return fit_ms(w, n, cached);
    double at = eng_profile_prefill_ms(pf, m, cached);
    return at > 0 ? fit_ms(w, m, cached) * eng_profile_prefill_ms(pf, n, cached) / at : fit_ms(w, n, cached);
}

/* Refits w's prefill model after a call that found it idle took ms for n new
 * tokens after cached ones: least squares of relative error (each row over
 * its time) over its last RT_OBS such calls, with the profile at four sizes
 * as prior rows that weigh less as calls accumulate. */
static void prefill_refit(const rt_table_t *t, rt_worker_t *w, double n, double cached, double ms)
{
    double *o = w->obs[w->n_obs++ % RT_OBS];
    o[0] = 1, o[1] = n, o[2] = n * (cached + n / 2), o[3] = ms;
    double x[RT_OBS + 4][3], y[RT_OBS + 4];
    uint32_t k = 0, have = w->n_obs < RT_OBS ? w->n_obs : RT_OBS;
    for (uint32_t i = 0; i < have; i++) {
        for (int j = 0; j < 3; j++)
            x[k][j] = w->obs[i][j] / w->obs[i][3];
        y[k++] = 1;
    }
    const eng_profile_t *pf = profile_of(t, w);
    static const double prior[4][2] = {{64, 0}, {512, 0}, {2048, 0}, {256, 2048}};
    double wt = 1.0 / (1 + have);
    for (int i = 0; pf && i < 4; i++) {
        double pn = prior[i][0], pc = prior[i][1], py = eng_profile_prefill_ms(pf, pn, pc);
        if (py <= 0)
            continue;
        x[k][0] = wt / py, x[k][1] = wt * pn / py, x[k][2] = wt * pn * (pc + pn / 2) / py;
        y[k++] = wt;
    }
    eng_profile_fit3((const double (*)[3])x, y, k, w->pf_fit);
    w->pf_reach = 0;
    for (uint32_t i = 0; pf && i < have; i++) {
        double work = pf->prefill[1] * w->obs[i][1] + pf->prefill[2] * w->obs[i][2];
        w->pf_reach = fmax(w->pf_reach, work);
    }
}

/* What prefill on w would take: its pool's run of the chain, the store's
 * further blocks, the new tokens' prefill, the work queued ahead. */
static void predict_prefill(const rt_table_t *t, const rt_worker_t *w, const rt_place_ctx_t *c, double now,
                            rt_prediction_t *pr)
{
    const rt_place_req_t *rq = c->rq;
    uint32_t bt = t->expect.block_tokens, n = rq ? (uint32_t)rq->n_tokens : 0;
    uint32_t pool = 0, store = 0;
    if (c->hits && w->ix_src >= 0) {
        pool = c->hits->held[w->ix_src];
        store = c->hits->store_run > pool ? c->hits->store_run - pool : 0;
    }
    uint32_t cached = (pool + store) * bt;
    if (n && cached >= n) { /* the last token is computed again for its logits */
        cached = n - 1;
        store = cached / bt > pool ? cached / bt - pool : 0;
    }
    pr->pool_tokens = pool * bt < cached ? pool * bt : cached;
    pr->store_tokens = cached - pr->pool_tokens;
    pr->new_tokens = n - cached;
    pr->blocks = rq ? (uint32_t)rq->n_blocks : 0;
    pr->alone = !w->prefilling;
    /* the store's blocks priced by tier: the run's mix of tiers applied to those fetched */
    double per_block = t->tier_ms_per_block[0];
    if (c->hits && c->hits->store_run) {
        per_block = 0;
        for (int k = 0; k < RT_IX_TIERS; k++)
            per_block += c->hits->store_tier[k] * t->tier_ms_per_block[k];
        per_block /= c->hits->store_run;
    }
    pr->fetch_ms = store * per_block;
    pr->prefill_ms = prefill_model_ms(t, w, pr->new_tokens, cached);
    pr->priority = queue_class(w, rq ? rq->priority : 0, pr->new_tokens);
    pr->queue_ms = queued_for_ms(w, pr->priority, now);
    pr->overhead_ms = t->ov.fit[0] + t->ov.fit[1] * n;
    pr->ttft_ms = pr->overhead_ms + pr->queue_ms + pr->fetch_ms + pr->prefill_ms;
    pr->valid = true;
}

/* The decode worker's time between tokens in a batch of the given size
 * with the request in it. */
static double predict_tbt_at(const rt_table_t *t, const rt_worker_t *d, const rt_place_req_t *rq, double batch,
                             double *raw)
{
    const eng_profile_t *pf = profile_of(t, d);
    double ctx = rq ? (double)rq->n_tokens + rq->max_tokens / 2.0 : 0;
    *raw = pf ? eng_profile_step_ms(pf, batch, ctx) : 0;
    return (d->k_step > 0 ? d->k_step : 1) * *raw;
}

/* The decode worker's time between tokens with the request joining its batch. */
static double predict_tbt(const rt_table_t *t, const rt_worker_t *d, const rt_place_req_t *rq, double *raw)
{
    return predict_tbt_at(t, d, rq, d->inflight + 1, raw);
}

/* What a local prefill on the colocated decode worker d would take: its
 * pool's run of the chain, the new tokens' prefill on its own model, the
 * local prefills queued ahead on it, and the stall each of its running
 * streams sees meanwhile (a step also takes a chunk of the prompt, at most
 * its token budget). */
static void predict_local(const rt_table_t *t, const rt_worker_t *d, const rt_place_ctx_t *c, double now,
                          rt_prediction_t *pr)
{
    const rt_place_req_t *rq = c->rq;
    uint32_t bt = t->expect.block_tokens, n = (uint32_t)rq->n_tokens;
    uint32_t pool = held_by(d, c);
    uint32_t cached = pool * bt < n ? pool * bt : n - 1;
    memset(pr, 0, sizeof *pr);
    pr->local = true;
    pr->pool_tokens = cached;
    pr->new_tokens = n - cached;
    pr->blocks = (uint32_t)rq->n_blocks;
    pr->alone = !d->prefilling;
    pr->prefill_ms = prefill_model_ms(t, d, pr->new_tokens, cached);
    pr->priority = queue_class(d, rq->priority, pr->new_tokens);
    pr->queue_ms = queued_for_ms(d, pr->priority, now);
    pr->ttft_ms = pr->queue_ms + pr->prefill_ms; /* its model is refitted from local TTFTs: the overhead is in it */
    pr->tbt_ms = predict_tbt(t, d, rq, &pr->step_raw_ms);
    uint32_t chunk = d->token_budget && d->token_budget < pr->new_tokens ? d->token_budget : pr->new_tokens;
    pr->stall_ms = d->inflight ? prefill_model_ms(t, d, chunk, cached) : 0;
    pr->valid = true;
}

/* Whether workers a and b compute on a device in common (their records'
 * devices lists). */
static bool share_device(const rt_worker_t *a, const rt_worker_t *b)
{
    for (const char *s = a->devices; *s;) {
        size_t n = strcspn(s, ",");
        for (const char *u = b->devices; *u;) {
            size_t m = strcspn(u, ",");
            if (m == n && !memcmp(s, u, n))
                return true;
            u += m + (u[m] == ',');
        }
        s += n + (s[n] == ',');
    }
    return false;
}

/* A pair whose prefill worker pf computes on a device the decode worker d
 * shares: the GPU time-slices the two processes, so each chunk pf computes
 * (its token budget at most) stalls a step of d's streams as a local
 * prefill's chunk would; the pair is priced that way (0: no device shared). */
static double pair_stall_ms(const rt_table_t *t, const rt_worker_t *pf, const rt_worker_t *d,
                            const rt_prediction_t *pr)
{
    if (!d->inflight || !share_device(pf, d))
        return 0;
    uint32_t chunk = pf->token_budget && pf->token_budget < pr->new_tokens ? pf->token_budget : pr->new_tokens;
    return prefill_model_ms(t, pf, chunk, pr->pool_tokens + pr->store_tokens);
}

/* How far a prediction is past the request's SLOs (where it states none,
 * the ops config's: rt_table_set_slo_aim): the larger of its TTFT and its
 * streams' TPOT over their SLOs; at most 1 where it keeps them. A local
 * prefill's stall counts against the TPOT of the streams running on its
 * worker, and TPOT is a stream's mean time per output token: a stream sees
 * about as many prompts arrive in its life as streams run beside it (Little's
 * law), each stalling one of its steps, so its TPOT is the step plus
 * (inflight + 1) stalls over its output (the request's max_tokens standing
 * for the streams'). Charging the whole stall to one token's TPOT, as
 * before, sent nearly every prompt to the prefill worker, even on the decode
 * worker's own GPU, where that loses 5x
 * (bench/results/distserve-2026-11-29-one-gpu/). With no TPOT SLO a local
 * prefill may add at most a quarter to their TPOT (the pair costs them
 * nothing where prefill has a GPU of its own; a CPU cluster's 8-token
 * answers showed a doubling miss the planner's SLO). */
static double slo_over(const rt_table_t *t, const rt_place_req_t *rq, const rt_prediction_t *pr, double inflight)
{
    double ttft_slo = rq->ttft_slo_ms ? rq->ttft_slo_ms : t->aim_ttft_ms;
    double tpot_slo = rq->tpot_slo_ms ? rq->tpot_slo_ms : t->aim_tpot_ms;
    double tpot = pr->tbt_ms + (inflight + 1) * pr->stall_ms / (rq->max_tokens ? rq->max_tokens : 1);
    double bound = tpot_slo ? tpot_slo : 1.25 * pr->tbt_ms;
    double over = bound > 0 ? tpot / bound : tpot > 0 ? INFINITY : 0;
    return ttft_slo && pr->ttft_ms / ttft_slo > over ? pr->ttft_ms / ttft_slo : over;
}

#define RT_LOCAL_RETRY 8
/* Conditional disaggregation: the colocated decode worker whose local
 * prefill keeps the request's SLOs with a lower predicted TTFT than the best
 * pair (or where the pair would miss them); where none keeps them and the
 * pair misses them too, the one past them least, if by less than the pair;
 * its prediction in local; NULL: the pair it is. */
static rt_worker_t *pick_local(rt_table_t *t, const rt_place_ctx_t *c, const rt_prediction_t *remote,
                               const rt_worker_t *d, double now, rt_prediction_t *local)
{
    rt_worker_t *best = NULL, *least = NULL;
    /* a pair stalls streams only on a shared device */
    const double pair_over = slo_over(t, c->rq, remote, remote->stall_ms ? d->inflight : 0);
    const bool remote_ok = pair_over <= 1;
    double pair_ttft = remote->ttft_ms, best_ttft = remote_ok ? pair_ttft : INFINITY;
    /* where no way keeps the SLOs: the one past them least (a tie: the sooner first token) */
    double least_over = pair_over, least_ttft = pair_ttft;
    rt_prediction_t least_pr;
    for (size_t i = 0; i < t->n; i++) {
        rt_worker_t *w = t->w[i];
        if (!w->colocated || !usable(w, RT_DECODE, c, now))
            continue;
        rt_prediction_t pr;
        predict_local(t, w, c, now, &pr);
        /* a worker never measured prefilling locally is tried while it is idle, and so is one passed over
         * RT_LOCAL_RETRY times since its last local prefill: its profile was measured at start-up, perhaps under
         * other load, and only local calls correct its model (one slow first call would keep it out for good) */
        const double over = slo_over(t, c->rq, &pr, w->inflight);
        bool idle = !w->inflight && !w->prefilling, keeps = over <= 1;
        bool explore = idle && (!w->n_obs || w->local_passed >= RT_LOCAL_RETRY);
        if (keeps && (pr.ttft_ms < best_ttft || (explore && !best))) {
            best = w;
            best_ttft = pr.ttft_ms;
            *local = pr;
        }
        if (!remote_ok && !keeps && (over < least_over || (over == least_over && pr.ttft_ms < least_ttft))) {
            least = w;
            least_over = over, least_ttft = pr.ttft_ms;
            least_pr = pr;
        }
        if (keeps && idle)
            w->local_passed++;
    }
    if (!best && least) {
        best = least;
        *local = least_pr;
    }
    if (best) {
        best->local_passed = 0;
        local->remote_ttft_ms = pair_ttft;
    }
    return best;
}

/* kv_cost (Dynamo's KV router): w * prefill blocks left after the worker's
 * cached overlap + the blocks it is prefilling now; decode least loaded. */
static rt_worker_t *kv_cost(rt_table_t *t, rt_role_t role, const rt_place_ctx_t *c, double now)
{
    if (role == RT_DECODE || !c->rq)
        return least_loaded(t, role, c, now);
    rt_worker_t *best = NULL;
    double best_cost = 0;
    for (size_t i = 0; i < t->n; i++) {
        rt_worker_t *w = t->w[i];
        if (!usable(w, role, c, now))
            continue;
        uint32_t overlap = held_by(w, c);
        double cost = 1.0 * (double)(c->rq->n_blocks - overlap) + w->active_blocks;
        if (!best || cost < best_cost || (cost == best_cost && w->inflight < best->inflight)) {
            best = w;
            best_cost = cost;
        }
    }
    return best;
}

/* Two predicted TTFTs this close are one: equal workers' models, each
 * refitted from its own calls, stay apart by their measurements' noise (a
 * fast CPU's short prompts: 12 of 12 went to one worker of two with a band
 * of 0.25 ms + 1%), while a cached prefix worth having saves more than this. */
static double ttft_tie(double ms)
{
    return 1.0 + 0.05 * ms;
}

/* Between equals, the worker with fewer calls in flight, then the one idle
 * the longest: a burst of small prompts spreads instead of all taking the
 * worker that happens to come first. */
static bool sooner_free(const rt_worker_t *a, const rt_worker_t *b)
{
    return a->inflight != b->inflight ? a->inflight < b->inflight : a->work_since < b->work_since;
}

/* A decode worker's load for c's request: its streams, each weighed by its
 * predicted output over this request's (router/outlen.h; TetriInfer's
 * predicted decode load — without predictions, one a stream), and the share
 * of the prompt's blocks it would have to land (its prefix cache's are not
 * sent again). A request served whole (the worker prefills it too) counts
 * streams alone: there a long prompt's cost is its prefill, which its short
 * predicted output does not show, and documents weighed by their outputs
 * would all queue on one worker. */
static double decode_load(const rt_worker_t *w, const rt_place_ctx_t *c)
{
    double streams = c->rq->pred_out > 0 && !c->whole ? w->out_pred / c->rq->pred_out : w->inflight;
    return streams + (c->rq->n_blocks ? 1 - (double)held_by(w, c) / c->rq->n_blocks : 1);
}

/* Whether w is a decode candidate for c: usable, and (strict) its predicted
 * time between tokens keeps the request's TPOT SLO. */
static bool decode_candidate(const rt_table_t *t, const rt_worker_t *w, const rt_place_ctx_t *c, double now,
                             bool strict)
{
    double raw;
    return usable(w, RT_DECODE, c, now) &&
           (!strict || !c->rq->tpot_slo_ms || predict_tbt(t, w, c->rq, &raw) <= c->rq->tpot_slo_ms);
}

/* The k-th decode candidate of the table's order. */
static rt_worker_t *nth_candidate(const rt_table_t *t, const rt_place_ctx_t *c, double now, bool strict, size_t k)
{
    for (size_t i = 0; i < t->n; i++)
        if (decode_candidate(t, t->w[i], c, now, strict) && !k--)
            return t->w[i];
    return NULL;
}

/* predictive's decode worker, among those whose predicted time between
 * tokens keeps the request's TPOT SLO (all usable when none does): the lower
 * load of two — the one holding most of the prompt's blocks (else one drawn
 * at random) and one drawn from the rest (power of two choices: routers
 * deciding at once on a view a moment old do not all pile onto one worker,
 * and a conversation's worker is always weighed); of two or fewer, the lower
 * load. */
static rt_worker_t *decode_pick(rt_table_t *t, const rt_place_ctx_t *c, double now)
{
    size_t n = 0;
    bool strict = true;
    for (int pass = 0; pass < 2 && !n; pass++, strict = false)
        for (size_t i = 0; i < t->n; i++)
            n += decode_candidate(t, t->w[i], c, now, strict);
    rt_worker_t *a = NULL, *b = NULL;
    if (n <= 2) {
        a = nth_candidate(t, c, now, strict, 0);
        b = n == 2 ? nth_candidate(t, c, now, strict, 1) : NULL;
    } else {
        size_t ia = 0, k = 0;
        uint32_t most = 0;
        for (size_t i = 0; i < t->n; i++)
            if (decode_candidate(t, t->w[i], c, now, strict)) {
                if (held_by(t->w[i], c) > most)
                    most = held_by(t->w[i], c), ia = k;
                k++;
            }
        if (!most)
            ia = (size_t)(td_rng_u64(&t->rng) % n);
        size_t ib = (size_t)(td_rng_u64(&t->rng) % (n - 1));
        ib += ib >= ia;
        a = nth_candidate(t, c, now, strict, ia);
        b = nth_candidate(t, c, now, strict, ib);
    }
    return b && decode_load(b, c) < decode_load(a, c) ? b : a;
}

/* predictive: the prefill worker with the lowest predicted TTFT (of equals,
 * sooner_free's); the decode worker decode_pick weighs (the worker that
 * holds a conversation wins a tie, and up to one stream more). */
static rt_worker_t *predictive(rt_table_t *t, rt_role_t role, const rt_place_ctx_t *c, double now)
{
    if (!c->rq)
        return least_loaded(t, role, c, now);
    if (role == RT_DECODE)
        return decode_pick(t, c, now);
    rt_worker_t *best = NULL;
    double best_v = 0;
    for (size_t i = 0; i < t->n; i++) {
        rt_worker_t *w = t->w[i];
        if (!usable(w, role, c, now))
            continue;
        rt_prediction_t pr = {0};
        predict_prefill(t, w, c, now, &pr);
        if (!best || pr.ttft_ms < best_v - ttft_tie(best_v) ||
            (pr.ttft_ms <= best_v + ttft_tie(best_v) && sooner_free(w, best))) {
            best = w;
            best_v = pr.ttft_ms;
        }
    }
    return best;
}

static void linefit_add(rt_linefit_t *f, double x, double y)
{
    double *o = f->obs[f->n++ % RT_OBS];
    o[0] = x, o[1] = y;
    uint32_t have = f->n < RT_OBS ? f->n : RT_OBS;
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (uint32_t i = 0; i < have; i++) {
        sx += f->obs[i][0], sy += f->obs[i][1];
        sxx += f->obs[i][0] * f->obs[i][0], sxy += f->obs[i][0] * f->obs[i][1];
    }
    double var = have * sxx - sx * sx, slope = have >= 4 && var > 1e-9 * have * sxx ? (have * sxy - sx * sy) / var : 0;
    if (slope < 0)
        slope = 0;
    f->fit[1] = slope;
    f->fit[0] = (sy - slope * sx) / have;
    if (f->fit[0] < 0) { /* through the origin instead */
        f->fit[0] = 0;
        f->fit[1] = sxx > 0 ? sxy / sxx : 0;
    }
}

static double clampd(double x, double lo, double hi) { return x < lo ? lo : x > hi ? hi : x; }

/* Learns from what a request measured: the prefill worker's model (from a
 * call that found it idle: its time less the store fetch), the router's
 * overhead (the attempt's TTFT less its prefill call), the decode worker's
 * correction (measured over predicted time between tokens), and records the
 * TTFT prediction's error. */
static void predict_observe(rt_table_t *t, rt_worker_t *prefill, rt_worker_t *decode, const rt_timings_t *tm)
{
    const rt_prediction_t *pr = &tm->pred;
    if (!pr->valid || !tm->ok)
        return;
    if (pr->local && decode && pr->alone && tm->attempt_ttft_ms > 0) {
        /* the decode worker's own prefill model, refitted from its local first tokens (the router's part in them
         * goes into the model's constant), with the cached split its engine reported */
        double all = tm->prompt_tokens, cached = fmin(tm->cached_tokens, all - 1);
        if (all > 0)
            prefill_refit(t, decode, all - cached, cached, tm->attempt_ttft_ms);
    }
    if (!pr->local && tm->prefill_ms <= 0)
        return;
    if (prefill && pr->alone) {
        /* refitted from the split the worker found, not the index's guess: an index some events behind once
         * had a call of 8 new tokens refitted as one of 184 taking 50 ms, and one of 600 as one of 8 */
        double all = pr->new_tokens + pr->pool_tokens + pr->store_tokens, cached = fmin(tm->call_cached, all - 1);
        double fetch = tm->call_store == pr->store_tokens ? pr->fetch_ms
                                                          : tm->call_store * t->tier_ms_per_block[0] / t->expect.block_tokens;
        if (all > 0 && tm->prefill_ms > fetch + 0.5)
            prefill_refit(t, prefill, all - cached, cached, tm->prefill_ms - fetch);
    }
    if (!pr->local && tm->attempt_ttft_ms > tm->prefill_ms)
        linefit_add(&t->ov, tm->prompt_tokens, tm->attempt_ttft_ms - tm->prefill_ms);
    if (decode && tm->output_tokens > 2 && pr->step_raw_ms > 0 && tm->tpot_ms > 0) {
        double k = clampd(tm->tpot_ms / pr->step_raw_ms, 0.2, 5);
        decode->k_step = decode->k_step > 0 ? exp(0.8 * log(decode->k_step) + 0.2 * log(k)) : k;
    }
    if (tm->attempt_ttft_ms > 0)
        t->err[t->n_err++ % RT_ERR_RING] = (float)(fabs(pr->ttft_ms - tm->attempt_ttft_ms) / tm->attempt_ttft_ms);
}

/* An exponentially weighted mean of each worker's measured TTFT and TPOT. */
static void ewma_observe(rt_table_t *t, void *state, rt_worker_t *prefill, rt_worker_t *decode,
                         const rt_timings_t *tm)
{
    (void)state;
    predict_observe(t, prefill, decode, tm);
    if (!tm->ok)
        return;
    if (prefill)
        prefill->ewma_ttft_ms = prefill->ewma_ttft_ms ? 0.8 * prefill->ewma_ttft_ms + 0.2 * tm->ttft_ms : tm->ttft_ms;
    if (decode && tm->output_tokens > 1)
        decode->ewma_tpot_ms = decode->ewma_tpot_ms ? 0.8 * decode->ewma_tpot_ms + 0.2 * tm->tpot_ms : tm->tpot_ms;
}

const rt_placement_ops_t rt_placement_least_loaded = {.name = "least_loaded", .pick = least_loaded,
                                                      .observe = ewma_observe};
const rt_placement_ops_t rt_placement_round_robin = {.name = "round_robin", .pick = round_robin,
                                                     .observe = ewma_observe, .state_new = rr_new,
                                                     .state_free = free};
const rt_placement_ops_t rt_placement_kv_cost = {.name = "kv_cost", .pick = kv_cost, .observe = ewma_observe};
const rt_placement_ops_t rt_placement_predictive = {.name = "predictive", .pick = predictive,
                                                    .observe = ewma_observe, .rejects = true};

/* Every policy, once: router.placement's names come from here. */
static const rt_placement_ops_t *const all_policies[] = {&rt_placement_least_loaded, &rt_placement_round_robin,
                                                         &rt_placement_kv_cost, &rt_placement_predictive};
#define N_POLICIES (sizeof all_policies / sizeof all_policies[0])

const rt_placement_ops_t *rt_placement_by_name(const char *name)
{
    for (size_t i = 0; i < N_POLICIES; i++)
        if (!strcmp(all_policies[i]->name, name))
            return all_policies[i];
    return NULL;
}

void rt_placement_register_names(void)
{
    static const char *names[N_POLICIES];
    for (size_t i = 0; i < N_POLICIES; i++)
        names[i] = all_policies[i]->name;
    td_config_placements(names, N_POLICIES);
}

static json_t *tier_costs(const rt_table_t *t)
{
    json_t *a = json_array();
    for (int k = 0; k < RT_IX_TIERS; k++)
        json_array_append_new(a, json_real(t->tier_ms_per_block[k]));
    return a;
}

rt_worker_t *rt_table_acquire(rt_table_t *t, const rt_placement_ops_t *p, rt_role_t role, const rt_place_req_t *rq)
{
    rt_place_ctx_t c = {.rq = rq};
    pthread_mutex_lock(&t->mu);
    c.state = policy_state(t, p);
    rt_worker_t *w = p->pick(t, role, &c, td_now_s());
    if (w) {
        w->refs++;
        w->inflight++;
    }
    pthread_mutex_unlock(&t->mu);
    return w;
}

/* Whether a worker of role is registered (usable or not; colocated: a
 * colocated one), under t->mu. */
static bool has_role(const rt_table_t *t, rt_role_t role, bool colocated)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->w[i]->role == role && !t->w[i]->gone && (!colocated || t->w[i]->colocated))
            return true;
    return false;
}

/* Whether a worker of role is usable now for c (NULL: any request), under t->mu. */
static bool any_usable(const rt_table_t *t, rt_role_t role, const rt_place_ctx_t *c, double now)
{
    for (size_t i = 0; i < t->n; i++)
        if (usable(t->w[i], role, c, now))
            return true;
    return false;
}

/* Why no worker of role is usable: the code, the reason, and retry_at. */
static void refuse(rt_table_t *t, rt_role_t role, double now, rt_placement_t *out)
{
    const char *rn = role == RT_PREFILL ? "prefill" : "decode";
    size_t registered = 0, refused = 0;
    const rt_worker_t *first_refused = NULL, *soonest = NULL, *down = NULL, *not_role = NULL;
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
        } else if (td_rpc_channel_peer_refused(w->ch)) {
            not_role = not_role ? not_role : w;
        } else if (td_rpc_channel_down(w->ch)) {
            down = down ? down : w;
        }
    }
    out->retry_at = soonest ? soonest->suspect_until : 0;
    /* a worker whose connection fails is dead (its restart registers under another record, which wakes the
     * wait) or briefly away (the channel reconnects): looked at again shortly, while the deadline allows */
    if (down && (!soonest || soonest->suspect_until > now + RT_DOWN_RETRY_S))
        out->retry_at = now + RT_DOWN_RETRY_S;
    if (!registered) {
        out->code = TD_RPC_UNAVAILABLE;
        snprintf(out->why, sizeof out->why, "no %s worker is registered with this router", rn);
        /* etcd was away just now: the last one left as every lease lapsed, and is registering again */
        double away = td_member_away_at(t->member), left = t->left_at[role];
        if (away && left && now - away < RT_REJOIN_S && now < left + RT_REJOIN_S)
            out->retry_at = left + RT_REJOIN_S;
    } else if (refused == registered) {
        out->code = TD_RPC_FAILED_PRECONDITION;
        snprintf(out->why, sizeof out->why, "every %s worker was refused (%.64s: %.200s)", rn, first_refused->id,
                 first_refused->refused_why);
    } else if (soonest) {
        out->code = full ? TD_RPC_RESOURCE_EXHAUSTED : TD_RPC_UNAVAILABLE;
        snprintf(out->why, sizeof out->why, "no %s worker can take it for %.2f s: %.64s answered %s (%.160s)", rn,
                 soonest->suspect_until - now, soonest->id, td_rpc_code_name(soonest->suspect_code),
                 soonest->suspect_why);
    } else if (down || not_role) {
        out->code = TD_RPC_UNAVAILABLE;
        if (down)
            snprintf(out->why, sizeof out->why, "no %s worker can be reached: the connection to %.64s (%.128s) "
                     "fails", rn, down->id, down->addr);
        else
            snprintf(out->why, sizeof out->why, "no %s worker can be reached: %.64s (%.128s) answered with a "
                     "certificate that is not a %s worker's", rn, not_role->id, not_role->addr, rn);
    } else {
        out->code = TD_RPC_UNAVAILABLE;
        snprintf(out->why, sizeof out->why, "no registered %s worker can take this request", rn);
    }
}

/* The lowest TTFT (ttft) or time between tokens an idle worker of the role
 * is predicted to give the request: its own prefill or step, nothing queued
 * ahead and no other sequence in the batch. */
static double idle_best_ms(const rt_table_t *t, const rt_place_ctx_t *c, bool ttft, double now)
{
    double best = -1;
    for (size_t i = 0; i < t->n; i++) {
        const rt_worker_t *w = t->w[i];
        if (!usable(w, ttft ? RT_PREFILL : RT_DECODE, c, now))
            continue;
        double ms, raw;
        if (ttft) {
            rt_prediction_t pr = {0};
            predict_prefill(t, w, c, now, &pr);
            ms = pr.ttft_ms - pr.queue_ms;
        } else {
            ms = predict_tbt_at(t, w, c->rq, 1, &raw);
        }
        best = best < 0 || ms < best ? ms : best;
    }
    return best;
}

/* An early rejection of the pair (pf, d) predicted in out->pred: when the
 * work ahead is what makes the request late, RESOURCE_EXHAUSTED with a hint
 * (when the queue will have drained by the excess, or a decode step's worth
 * of time); when even an idle worker is predicted to miss the SLO (the
 * request's own prefill or step is over it), FAILED_PRECONDITION and no
 * hint: retrying the same request cannot help, a looser SLO or a shorter
 * prompt can. Both are answered at once (out->rejected). */
static void reject_early(rt_table_t *t, const rt_place_ctx_t *c, const rt_worker_t *pf, const rt_worker_t *d,
                         double now, rt_placement_t *out)
{
    const rt_place_req_t *rq = c->rq;
    const rt_prediction_t *pr = &out->pred;
    const bool ttft = rq->ttft_slo_ms && pr->ttft_ms > rq->ttft_slo_ms;
    const double slo = ttft ? rq->ttft_slo_ms : rq->tpot_slo_ms;
    const double idle = idle_best_ms(t, c, ttft, now);
    out->rejected = ttft ? "ttft" : "tpot";
    *(ttft ? &t->rejected_ttft : &t->rejected_tpot) += 1;
    if (idle > slo) {
        out->code = TD_RPC_FAILED_PRECONDITION;
        if (ttft)
            snprintf(out->why, sizeof out->why, "rejected early: even on an idle prefill worker the predicted time "
                     "to first token of its %u uncached tokens is %.0f ms, over the TTFT SLO of %.0f ms; retrying "
                     "will not help (a looser ttft_slo_ms or a shorter prompt will)", pr->new_tokens, idle, slo);
        else
            snprintf(out->why, sizeof out->why, "rejected early: even alone on an idle decode worker the predicted "
                     "time between tokens is %.1f ms, over the TPOT SLO of %.0f ms; retrying will not help (a looser "
                     "tpot_slo_ms will)", idle, slo);
        return;
    }
    out->code = TD_RPC_RESOURCE_EXHAUSTED;
    out->retry_after_ms = (uint32_t)clampd(ttft ? pr->ttft_ms - slo : 50 * pr->tbt_ms, 10, 60000);
    if (ttft)
        snprintf(out->why, sizeof out->why, "rejected early: the predicted time to first token on the best prefill "
                 "worker (%.64s) is %.0f ms, over the TTFT SLO of %.0f ms; retry after %u ms", pf->id, pr->ttft_ms,
                 slo, out->retry_after_ms);
    else
        snprintf(out->why, sizeof out->why, "rejected early: the predicted time between tokens on the best decode "
                 "worker (%.64s) is %.1f ms, over the TPOT SLO of %.0f ms; retry after %u ms", d->id, pr->tbt_ms,
                 slo, out->retry_after_ms);
}

/* Whether some prefill worker, usable but for its pool's size, holds c's
 * prompt (true also when none is usable at all: that is refuse's to say);
 * *most: the largest such pool, in blocks. */
static bool prefill_fits(const rt_table_t *t, const rt_place_ctx_t *c, double now, uint32_t *most)
{
    rt_place_ctx_t any = *c;
    any.prefill_blocks = 0;
    bool usable_any = false;
    for (size_t i = 0; i < t->n; i++)
        if (usable(t->w[i], RT_PREFILL, &any, now)) {
            usable_any = true;
            if (usable(t->w[i], RT_PREFILL, c, now))
                return true;
            *most = t->w[i]->kv_blocks > *most ? t->w[i]->kv_blocks : *most;
        }
    return !usable_any;
}

/* A prompt no decode worker's pool can hold (each that says its size):
 * refused INVALID_ARGUMENT, naming the sizes, before any placement or
 * deadline is judged; false when some pool may hold it. */
static bool too_big(const rt_table_t *t, const rt_place_req_t *rq, rt_placement_t *out)
{
    uint32_t bt = t->expect.block_tokens, most = 0;
    if (!rq || !bt)
        return false;
    uint64_t need = ((uint64_t)rq->n_tokens + bt - 1) / bt;
    /* n choices share the prompt's blocks; each grows its own output */
    uint64_t each = ((uint64_t)rq->max_tokens + bt - 1) / bt + 1;
    if (rq->n_choices > 1)
        need += rq->n_choices * each;
    for (size_t i = 0; i < t->n; i++) {
        const rt_worker_t *w = t->w[i];
        if (w->role != RT_DECODE || w->refused || w->gone)
            continue;
        if (!w->kv_blocks || w->kv_blocks >= need)
            return false;
        most = w->kv_blocks > most ? w->kv_blocks : most;
    }
    if (!most)
        return false;
    out->code = TD_RPC_INVALID_ARGUMENT;
    if (rq->n_choices > 1)
        snprintf(out->why, sizeof out->why, "sampling.n: %u choices of a %zu-token prompt and up to %u tokens each "
                 "need %llu KV blocks of %u tokens; the largest decode worker's pool has %u", rq->n_choices,
                 rq->n_tokens, rq->max_tokens, (unsigned long long)need, bt, most);
    else
        snprintf(out->why, sizeof out->why, "prompt: %zu tokens need %llu KV blocks of %u tokens; the largest decode "
                 "worker's pool has %u", rq->n_tokens, (unsigned long long)need, bt, most);
    return true;
}

void rt_table_place(rt_table_t *t, const rt_placement_ops_t *p, const rt_place_req_t *rq, rt_placement_t *out)
{
    memset(out, 0, sizeof *out);
    rt_chain_hits_t hits;
    rt_place_ctx_t c = {.rq = rq};
    if (t->ix && rq && rq->n_blocks) { /* the index has its own lock: looked up before the table's */
        rt_kvindex_chain(t->ix, rq->chain, rq->n_blocks, &hits);
        c.hits = &hits;
    }
    double now = td_now_s();
    uint32_t bt = t->expect.block_tokens;
    if (rq && bt) /* the prompt and its first token, as a prefill engine checks */
        c.prefill_blocks = (uint32_t)((rq->n_tokens + 1 + bt - 1) / bt);
    pthread_mutex_lock(&t->mu);
    if (too_big(t, rq, out)) {
        pthread_mutex_unlock(&t->mu);
        return;
    }
    /* no prefill worker in the cluster: the whole request on a colocated
     * decode worker (its step time predicted, and judged by the TPOT SLO;
     * no TTFT prediction); a plain decode worker there could not take it */
    c.whole = !has_role(t, RT_PREFILL, false);
    c.state = policy_state(t, p);
    rt_worker_t *d = p->pick(t, RT_DECODE, &c, now);
    bool whole = d && c.whole;
    rt_worker_t *pf = d && !whole ? p->pick(t, RT_PREFILL, &c, now) : NULL;
    if (d && !whole && !pf) { /* prefill workers registered, none usable (dead, suspect): a colocated decode worker
                               * prefills it itself */
        c.whole = true;
        rt_worker_t *dw = p->pick(t, RT_DECODE, &c, now);
        whole = dw != NULL;
        d = dw ? dw : d;
        c.whole = whole;
    }
    if (!d || (!pf && !whole)) {
        /* usable decode workers but none colocated, and no prefill worker: the prefill side is what is missing */
        bool no_prefill = d || (c.whole && !has_role(t, RT_DECODE, true) && any_usable(t, RT_DECODE, NULL, now));
        uint32_t most = 0;
        if (no_prefill && !prefill_fits(t, &c, now, &most)) { /* usable prefill workers, each too small for it */
            out->code = TD_RPC_INVALID_ARGUMENT;
            snprintf(out->why, sizeof out->why, "prompt: %zu tokens need %u KV blocks of %u tokens on a prefill worker; "
                     "the largest prefill worker's pool has %u, and no colocated decode worker can prefill it",
                     rq->n_tokens, c.prefill_blocks, bt, most);
        } else {
            refuse(t, no_prefill ? RT_PREFILL : RT_DECODE, now, out);
        }
        pthread_mutex_unlock(&t->mu);
        return;
    }
    rt_prediction_t *pr = &out->pred;
    if (pf) {
        predict_prefill(t, pf, &c, now, pr);
        pr->stall_ms = pair_stall_ms(t, pf, d, pr);
    }
    pr->tbt_ms = predict_tbt(t, d, rq, &pr->step_raw_ms);
    rt_prediction_t local;
    rt_worker_t *dl = pf && p->rejects && rq ? pick_local(t, &c, pr, d, now, &local) : NULL;
    if (dl) { /* prefilled where it will decode: no pair, no KV moved */
        d = dl;
        pf = NULL;
        *pr = local;
    }
    if (p->rejects && rq && rq->early_reject &&
        ((rq->ttft_slo_ms && pr->ttft_ms > rq->ttft_slo_ms) || (rq->tpot_slo_ms && pr->tbt_ms > rq->tpot_slo_ms))) {
        reject_early(t, &c, pf, d, now, out);
        pthread_mutex_unlock(&t->mu);
        return;
    }
    d->refs++;
    d->inflight++;
    pr->out_tokens = rq ? rq->pred_out : 0;
    d->out_pred += pr->out_tokens;
    out->decode = d;
    if (dl) { /* its local prefill joins d's queue until rt_table_prefill_done (the first token) */
        if (!d->prefilling++) {
            d->work_ms = 0;
            d->work_since = now;
        }
        d->work_ms += pr->prefill_ms;
        prio_work(d, pr->priority, pr->prefill_ms, 1);
        t->placed_local++;
    }
    if (whole || dl) {
        t->placed_colocated++;
        pthread_mutex_unlock(&t->mu);
        return;
    }
    pf->refs++;
    pf->inflight++;
    /* the prefill's predicted service joins pf's queue until rt_table_prefill_done */
    if (!pf->prefilling++) {
        pf->work_ms = 0;
        pf->work_since = now;
    }
    pf->work_ms += pr->fetch_ms + pr->prefill_ms;
    prio_work(pf, pr->priority, pr->fetch_ms + pr->prefill_ms, 1);
    pf->active_blocks += pr->blocks;
    t->placed[pr->pool_tokens ? 0 : pr->store_tokens ? 1 : 2]++;
    out->prefill = pf;
    pthread_mutex_unlock(&t->mu);
}

void rt_table_decode_end(rt_table_t *t, rt_worker_t *w, const rt_prediction_t *pred)
{
    pthread_mutex_lock(&t->mu);
    w->out_pred -= pred->out_tokens;
    if (w->out_pred < 1e-6)
        w->out_pred = 0; /* rounding */
    pthread_mutex_unlock(&t->mu);
}

void rt_table_prefill_done(rt_table_t *t, rt_worker_t *w, const rt_prediction_t *pred)
{
    double now = td_now_s();
    pthread_mutex_lock(&t->mu);
    /* what is still in flight starts afresh from now: its predicted work, less nothing done yet */
    assert(w->prefilling > 0); /* once per placed prefill */
    w->prefilling -= w->prefilling > 0;
    double left = w->work_ms - (pred->fetch_ms + pred->prefill_ms);
    w->work_ms = w->prefilling && left > 0 ? left : 0;
    w->work_since = now;
    prio_work(w, pred->priority, pred->fetch_ms + pred->prefill_ms, -1);
    w->active_blocks -= pred->blocks < w->active_blocks ? pred->blocks : w->active_blocks;
    pthread_mutex_unlock(&t->mu);
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

json_t *rt_table_metrics(rt_table_t *t, const rt_placement_ops_t *p)
{
    float *e = malloc(RT_ERR_RING * sizeof *e);
    json_t *workers = json_array();
    pthread_mutex_lock(&t->mu);
    size_t n = t->n_err < RT_ERR_RING ? (size_t)t->n_err : RT_ERR_RING;
    if (e)
        memcpy(e, t->err, n * sizeof *e);
    json_t *j = json_pack("{s:s, s:{s:I, s:I, s:I}, s:{s:I, s:I}, s:I, s:f, s:o}", "policy", p->name, "placed",
                          "pool_hit", (json_int_t)t->placed[0], "store_hit", (json_int_t)t->placed[1], "cold",
                          (json_int_t)t->placed[2], "rejected", "ttft", (json_int_t)t->rejected_ttft, "tpot",
                          (json_int_t)t->rejected_tpot, "predictions", (json_int_t)t->n_err, "overhead_ms",
                          t->ov.fit[0], "tier_ms_per_block", tier_costs(t));
    json_object_set_new(j, "overhead_ms_per_token", json_real(t->ov.fit[1]));
    if (t->aim_ttft_ms || t->aim_tpot_ms) /* the ops config's SLOs, which placement aims at */
        json_object_set_new(j, "slo_aim", json_pack("{s:i, s:i}", "ttft_ms", (int)t->aim_ttft_ms, "tpot_ms",
                                                     (int)t->aim_tpot_ms));
    json_object_set_new(json_object_get(j, "placed"), "colocated", json_integer((json_int_t)t->placed_colocated));
    json_object_set_new(json_object_get(j, "placed"), "local", json_integer((json_int_t)t->placed_local));
    double now = td_now_s();
    for (size_t i = 0; i < t->n; i++) {
        const rt_worker_t *w = t->w[i];
        if (w->refused)
            continue;
        json_t *o = json_pack("{s:s, s:s, s:b, s:f, s:f, s:i}", "id", w->id, "role",
                              w->role == RT_PREFILL ? "prefill" : "decode", "profile", w->has_profile, "k_step",
                              w->k_step ? w->k_step : 1.0, "queued_ms", queued_ms(w, now), "inflight", w->inflight);
        if (w->devices[0])
            json_object_set_new(o, "devices", json_string(w->devices));
        if (w->n_obs) /* the prefill model refitted online: a, b, c as the profile's, from how many calls, and how
                       * far it is trusted (RT_REACH times its largest call, in the profile's ms) */
            json_object_set_new(o, "prefill_fit",
                                json_pack("{s:[f,f,f], s:I, s:f}", "coef", w->pf_fit[0], w->pf_fit[1], w->pf_fit[2],
                                          "calls", (json_int_t)w->n_obs, "reach_ms", RT_REACH * w->pf_reach));
        json_array_append_new(workers, o);
    }
    pthread_mutex_unlock(&t->mu);
    if (e && n) {
        qsort(e, n, sizeof *e, cmp_float);
        json_object_set_new(j, "ttft_error_p50", json_real(e[n / 2]));
        json_object_set_new(j, "ttft_error_p90", json_real(e[(size_t)(0.9 * (double)(n - 1))]));
    }
    free(e);
    json_object_set_new(j, "workers", workers);
    return j;
}

void rt_table_observe(rt_table_t *t, const rt_placement_ops_t *p, rt_worker_t *prefill, rt_worker_t *decode,
                      const rt_timings_t *tm)
{
    if (!p->observe)
        return;
    pthread_mutex_lock(&t->mu);
    p->observe(t, policy_state(t, p), prefill, decode, tm);
    pthread_mutex_unlock(&t->mu);
}

bool rt_table_serving(rt_table_t *t)
{
    double now = td_now_s();
    pthread_mutex_lock(&t->mu);
    /* a pair, or (no prefill worker) a colocated decode worker for a request served whole */
    const rt_place_ctx_t c = {.whole = !has_role(t, RT_PREFILL, false)};
    bool serving = c.whole ? any_usable(t, RT_DECODE, &c, now)
                           : any_usable(t, RT_PREFILL, NULL, now) && any_usable(t, RT_DECODE, NULL, now);
    pthread_mutex_unlock(&t->mu);
    return serving;
}

void rt_table_counts(rt_table_t *t, uint32_t *prefill, uint32_t *decode)
{
    double now = td_now_s();
    *prefill = *decode = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++) {
        if (usable(t->w[i], RT_PREFILL, NULL, now))
            (*prefill)++;
        if (usable(t->w[i], RT_DECODE, NULL, now))
            (*decode)++;
    }
    pthread_mutex_unlock(&t->mu);
}

/* The largest batch (up to what the pool holds at ctx tokens a stream) whose
 * step, as predicted for d, stays within tpot_slo_ms, and the output tokens a
 * second it makes; one stream's rate when even that misses the SLO. */
#define RT_CAP_BATCH 512
static double decode_tok_s(const rt_table_t *t, const rt_worker_t *d, double ctx, double tpot_slo_ms)
{
    const eng_profile_t *pf = profile_of(t, d);
    if (!pf)
        return 0;
    double k = d->k_step > 0 ? d->k_step : 1, most = RT_CAP_BATCH;
    if (d->kv_blocks && ctx > 0)
        most = fmax(1, fmin(most, floor((double)d->kv_blocks * t->expect.block_tokens / ctx)));
    double best = 0;
    for (double b = 1;; b = fmin(most, b < 8 ? b + 1 : ceil(b * 1.25))) {
        double ms = k * eng_profile_step_ms(pf, b, ctx);
        if (ms <= 0 || (b > 1 && tpot_slo_ms > 0 && ms > tpot_slo_ms))
            break;
        best = fmax(best, b * 1e3 / ms);
        if (b >= most)
            break;
    }
    return best;
}

void rt_table_capacity(rt_table_t *t, double new_tokens, double ctx_tokens, double tpot_slo_ms, rt_capacity_t *out)
{
    double n = fmax(1, new_tokens);
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n; i++) {
        const rt_worker_t *w = t->w[i];
        if (w->refused || w->gone) /* a suspect one counts: what a worker serves, not whether it answers now */
            continue;
        if (w->role == RT_PREFILL) {
            double ms = prefill_model_ms(t, w, n, 0);
            if (ms > 0) {
                out->prefill_tok_s += n * 1e3 / ms;
                out->prefill++;
            }
        } else {
            double r = decode_tok_s(t, w, ctx_tokens, tpot_slo_ms);
            if (r > 0) {
                out->decode_tok_s += r;
                out->decode++;
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (out->prefill)
        out->prefill_tok_s /= out->prefill;
    if (out->decode)
        out->decode_tok_s /= out->decode;
}
