/* fair.c — see fair.h.
 *
 * How it works: one lock over a table of tenants, each with its FIFO of
 * waiting entries and its virtual token count (vtc: tokens charged divided by
 * its weight). Whenever a request ends or arrives with room to spare, the
 * dispatcher takes the head of the waiting tenant with the highest class and
 * then the least vtc, charges it, and counts it running, until admit_max run;
 * the entries taken are handed to go() after the lock is dropped. A timer
 * thread sleeps until the earliest deadline of a waiting entry and ends those
 * past it with expire().
 *
 * Limits: the count is kept per router (routers do not share it), and the
 * charge made when a request goes is the tenant's average output, settled by
 * the truth at the end: a tenant whose outputs change length is mischarged
 * for one request's worth until its average follows. */
#include "router/fair.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/rpc.h"

#define FAIR_TENANTS 1024 /* more share the last one's entry ("*") */

typedef struct tenant {
    char name[64];
    double weight, vtc;
    double mean_out; /* output tokens its requests averaged (0: none ended yet) */
    int32_t priority;
    rt_fair_entry_t *head, *tail;
    uint32_t waiting, running;
    uint64_t served, refused;
    td_metric_t *m_tokens, *m_waiting, *m_running, *m_refused;
} tenant_t;

struct rt_fair {
    rt_fair_config_t c;
    rt_fair_go_fn go;
    rt_fair_expire_fn expire;
    td_metrics_t *metrics;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* the timer's: a new earliest deadline, or stop */
    tenant_t *t;
    uint32_t n_t, cap_t;
    uint32_t running, waiting;
    double mean_s; /* seconds a request ran (a moving average), for retry hints */
    pthread_t timer;
    bool stop, has_timer;
};

static tenant_t *tenant_of(rt_fair_t *f, const char *name)
{
    if (!name || !name[0])
        name = "-";
    for (uint32_t i = 0; i < f->n_t; i++)
        if (!strcmp(f->t[i].name, name))
            return &f->t[i];
    if (f->n_t == FAIR_TENANTS)
        return &f->t[FAIR_TENANTS - 1];
    if (f->n_t == f->cap_t) { /* grown while tenants are few; entries point at tenants by index, not address */
        uint32_t cap = f->cap_t ? 2 * f->cap_t : 16;
        tenant_t *t = realloc(f->t, cap * sizeof *t);
        if (!t)
            return f->n_t ? &f->t[f->n_t - 1] : NULL;
        f->t = t;
        f->cap_t = cap;
    }
    tenant_t *t = &f->t[f->n_t++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", f->n_t == FAIR_TENANTS ? "*" : name);
    t->weight = 1;
    if (f->metrics) {
        char lab[160];
        td_metrics_label(lab, sizeof lab, "tenant", t->name);
        t->m_tokens = td_metrics_series(f->metrics, TD_COUNTER, "tandem:tenant_tokens_total",
                                        "Tokens served to the tenant (API key): prompt and output.", lab, NULL, 0);
        t->m_waiting = td_metrics_series(f->metrics, TD_GAUGE, "tandem:tenant_requests_waiting",
                                         "The tenant's requests waiting in the router's admission queue.", lab, NULL, 0);
        t->m_running = td_metrics_series(f->metrics, TD_GAUGE, "tandem:tenant_requests_running",
                                         "The tenant's requests out on the workers.", lab, NULL, 0);
        t->m_refused = td_metrics_series(f->metrics, TD_COUNTER, "tandem:tenant_requests_refused_total",
                                         "The tenant's requests refused because its queue was full.", lab, NULL, 0);
    }
    return t;
}

/* Charges e (of tenant t) as it goes: its prompt and the output t's requests average. */
static void charge(tenant_t *t, rt_fair_entry_t *e)
{
    double out = t->mean_out > 0 ? t->mean_out : e->max_tokens / 2.0;
    if (out > e->max_tokens)
        out = e->max_tokens;
    e->charged = e->prompt + out;
    t->vtc += e->charged / t->weight;
}

/* A tenant back from idle starts at the least count of those active
 * (waiting or running): a pause banks no credit to spend later. */
static void lift(rt_fair_t *f, tenant_t *t)
{
    double least = -1;
    for (uint32_t i = 0; i < f->n_t; i++)
        if (&f->t[i] != t && (f->t[i].waiting || f->t[i].running) && (least < 0 || f->t[i].vtc < least))
            least = f->t[i].vtc;
    if (least > t->vtc)
        t->vtc = least;
}

/* The waiting tenant whose head goes next: the highest class, then the least count. */
static tenant_t *pick(rt_fair_t *f)
{
    tenant_t *best = NULL;
    for (uint32_t i = 0; i < f->n_t; i++) {
        tenant_t *t = &f->t[i];
        if (t->waiting && (!best || t->priority > best->priority ||
                           (t->priority == best->priority && t->vtc < best->vtc)))
            best = t;
    }
    return best;
}

/* Takes waiting e out of its tenant t's queue (it waits no more: NONE). */
static void dequeue(rt_fair_t *f, tenant_t *t, rt_fair_entry_t *e)
{
    rt_fair_entry_t **p = &t->head, *prev = NULL;
    while (*p && *p != e)
        prev = *p, p = &(*p)->next;
    if (!*p)
        return;
    *p = e->next;
    if (t->tail == e)
        t->tail = prev;
    e->next = NULL;
    e->state = RT_FAIR_NONE;
    t->waiting--, f->waiting--;
    td_metric_set(t->m_waiting, t->waiting);
}

/* e of tenant t goes: charged, counted running. */
static void start(rt_fair_t *f, tenant_t *t, rt_fair_entry_t *e)
{
    charge(t, e);
    t->running++, f->running++;
    e->state = RT_FAIR_RUNNING;
    e->t_went = td_now_s();
    td_metric_set(t->m_running, t->running);
}

/* Takes waiting entries while there is room, onto *out (a list through next). */
static void dispatch(rt_fair_t *f, rt_fair_entry_t **out)
{
    tenant_t *t;
    while (f->running < f->c.admit_max && (t = pick(f))) {
        rt_fair_entry_t *e = t->head;
        dequeue(f, t, e);
        start(f, t, e);
        e->next = *out;
        *out = e;
    }
}

/* Hands each entry of list (through next) to fn, but skip, without the lock. */
static void hand_over(rt_fair_entry_t *list, void (*fn)(void *req), const rt_fair_entry_t *skip)
{
    while (list) {
        rt_fair_entry_t *nx = list->next;
        list->next = NULL;
        if (list != skip)
            fn(list->req);
        list = nx;
    }
}

static void *timer_main(void *arg)
{
    rt_fair_t *f = arg;
    pthread_mutex_lock(&f->mu);
    while (!f->stop) {
        double now = td_now_s(), first = 0;
        rt_fair_entry_t *gone = NULL;
        for (uint32_t i = 0; i < f->n_t; i++) {
            tenant_t *t = &f->t[i];
            for (rt_fair_entry_t *e = t->head, *nx; e; e = nx) {
                nx = e->next;
                if (e->deadline > 0 && e->deadline <= now) {
                    dequeue(f, t, e);
                    e->next = gone;
                    gone = e;
                } else if (e->deadline > 0 && (!first || e->deadline < first)) {
                    first = e->deadline;
                }
            }
        }
        if (gone) {
            pthread_mutex_unlock(&f->mu);
            hand_over(gone, f->expire, NULL);
            pthread_mutex_lock(&f->mu);
            continue;
        }
        struct timespec ts = td_wall_deadline(first ? first - now : 3600);
        pthread_cond_timedwait(&f->cv, &f->mu, &ts);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

td_status_t rt_fair_create(const rt_fair_config_t *c, rt_fair_go_fn go, rt_fair_expire_fn expire, td_metrics_t *metrics,
                           rt_fair_t **out)
{
    rt_fair_t *f = calloc(1, sizeof *f);
    if (!f)
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for its admission queue");
    f->c = *c;
    f->go = go;
    f->expire = expire;
    f->metrics = metrics;
    f->mean_s = 1;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (f->c.admit_max) {
        if (pthread_create(&f->timer, NULL, timer_main, f)) {
            rt_fair_destroy(f);
            return td_error(TD_ERR_NO_MEMORY, "router: cannot start the admission queue's timer");
        }
        f->has_timer = true;
    }
    *out = f;
    return TD_OK;
}

void rt_fair_destroy(rt_fair_t *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    pthread_cond_signal(&f->cv);
    rt_fair_entry_t *gone = NULL;
    for (uint32_t i = 0; i < f->n_t; i++)
        while (f->t[i].head) {
            rt_fair_entry_t *e = f->t[i].head;
            dequeue(f, &f->t[i], e);
            e->next = gone;
            gone = e;
        }
    pthread_mutex_unlock(&f->mu);
    if (f->has_timer)
        pthread_join(f->timer, NULL);
    hand_over(gone, f->expire, NULL);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f->t);
    free(f);
}

int rt_fair_enter(rt_fair_t *f, rt_fair_entry_t *e, const char *tenant, double weight, int32_t priority, char *msg,
                  size_t n, double *retry_s)
{
    *retry_s = 0;
    pthread_mutex_lock(&f->mu);
    tenant_t *t = tenant_of(f, tenant);
    if (!t) {
        pthread_mutex_unlock(&f->mu);
        snprintf(msg, n, "the router has no memory for another tenant");
        return TD_RPC_RESOURCE_EXHAUSTED;
    }
    e->tenant = (uint32_t)(t - f->t);
    t->weight = weight > 0 ? weight : 1;
    t->priority = priority;
    e->next = NULL;
    e->t_queued = td_now_s();
    if (!t->waiting && !t->running)
        lift(f, t);
    if (!f->c.admit_max || (f->running < f->c.admit_max && !f->waiting)) { /* room, and no one ahead */
        start(f, t, e);
        pthread_mutex_unlock(&f->mu);
        return 0;
    }
    if (t->waiting >= f->c.tenant_queue_max) {
        double wsum = t->weight;
        for (uint32_t i = 0; i < f->n_t; i++)
            if (&f->t[i] != t && f->t[i].waiting && f->t[i].priority >= t->priority)
                wsum += f->t[i].weight;
        double share = f->c.admit_max * t->weight / wsum; /* the requests it runs at once while all wait */
        *retry_s = (t->waiting + 1) * f->mean_s / (share > 1 ? share : 1);
        t->refused++;
        td_metric_add(t->m_refused, 1);
        snprintf(msg, n, "tenant '%s' has %u requests waiting, the most one tenant may queue "
                 "(router.tenant_queue_max); try again in %.1f s", t->name, t->waiting, *retry_s);
        pthread_mutex_unlock(&f->mu);
        return TD_RPC_RESOURCE_EXHAUSTED;
    }
    e->state = RT_FAIR_QUEUED;
    if (t->tail)
        t->tail->next = e;
    else
        t->head = e;
    t->tail = e;
    t->waiting++, f->waiting++;
    td_metric_set(t->m_waiting, t->waiting);
    rt_fair_entry_t *go = NULL;
    dispatch(f, &go);
    bool now = e->state == RT_FAIR_RUNNING;
    if (!now && e->deadline > 0)
        pthread_cond_signal(&f->cv); /* perhaps the earliest deadline */
    pthread_mutex_unlock(&f->mu);
    hand_over(go, f->go, e);
    return now ? 0 : 1;
}

void rt_fair_leave(rt_fair_t *f, rt_fair_entry_t *e, uint32_t prompt, uint32_t output)
{
    pthread_mutex_lock(&f->mu);
    if (e->state != RT_FAIR_RUNNING) {
        pthread_mutex_unlock(&f->mu);
        return;
    }
    tenant_t *t = &f->t[e->tenant];
    double used = (double)prompt + output;
    t->vtc += (used - e->charged) / t->weight;
    t->served += (uint64_t)used;
    td_metric_add(t->m_tokens, used);
    t->mean_out = t->mean_out > 0 ? 0.8 * t->mean_out + 0.2 * output : output;
    double ran = td_now_s() - e->t_went;
    f->mean_s = 0.9 * f->mean_s + 0.1 * ran;
    t->running--, f->running--;
    td_metric_set(t->m_running, t->running);
    e->state = RT_FAIR_NONE;
    rt_fair_entry_t *go = NULL;
    dispatch(f, &go);
    pthread_mutex_unlock(&f->mu);
    hand_over(go, f->go, NULL);
}

bool rt_fair_cancel(rt_fair_t *f, rt_fair_entry_t *e)
{
    pthread_mutex_lock(&f->mu);
    bool queued = e->state == RT_FAIR_QUEUED;
    if (queued)
        dequeue(f, &f->t[e->tenant], e);
    pthread_mutex_unlock(&f->mu);
    return queued;
}

json_t *rt_fair_json(rt_fair_t *f)
{
    json_t *a = json_array();
    pthread_mutex_lock(&f->mu);
    for (uint32_t i = 0; i < f->n_t; i++) {
        const tenant_t *t = &f->t[i];
        json_array_append_new(a, json_pack("{s:s, s:f, s:i, s:f, s:i, s:i, s:I, s:I}", "tenant", t->name, "weight",
                                           t->weight, "priority", (int)t->priority, "virtual_tokens", t->vtc,
                                           "waiting", (int)t->waiting, "running", (int)t->running, "tokens_served",
                                           (json_int_t)t->served, "refused", (json_int_t)t->refused));
    }
    pthread_mutex_unlock(&f->mu);
    return a;
}
