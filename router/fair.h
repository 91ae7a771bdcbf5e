/* fair.h — the router's admission queue: tenants share a contended cluster
 * in proportion to their weights, by tokens.
 *
 * A tenant is an API key (its name; requests without a key are one tenant,
 * "-"), with a weight and a priority class from the key file. While fewer
 * than admit_max requests are out on the workers, a request goes at once;
 * past that it waits in its tenant's queue, and each time one ends the next
 * goes out: the highest class first, then, as the Virtual Token Counter does
 * ("Fairness in Serving LLMs", OSDI '24), the tenant that has been served the
 * fewest tokens per unit of weight. A request is charged when it goes (its
 * prompt and the output its tenant's requests have averaged, at most its
 * max_tokens) and settled at its end by what it used; a tenant that comes back
 * after a pause starts at the least count of those waiting, so an idle spell
 * banks no credit. A tenant's burst fills its own queue, and past
 * tenant_queue_max its requests are refused at once with a retry hint from its
 * own share, not spread over everyone's time to first token. A queued request
 * whose deadline passes, or whose client cancels, leaves the queue then.
 *
 * The entry lives in the caller's request (no allocation per request). Every
 * call is thread-safe; go and expire are called without the lock held. */
#ifndef RT_FAIR_H
#define RT_FAIR_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"

typedef struct rt_fair rt_fair_t;

typedef enum rt_fair_state { RT_FAIR_NONE, RT_FAIR_QUEUED, RT_FAIR_RUNNING } rt_fair_state_t;

typedef struct rt_fair_entry {
    struct rt_fair_entry *next;
    void *req;
    uint32_t tenant;
    uint32_t prompt, max_tokens; /* tokens */
    double charged;              /* tokens charged when it went */
    double deadline, t_queued, t_went; /* td_now_s() */
    rt_fair_state_t state;
} rt_fair_entry_t;

/* A queued request's turn (go: run it; call nothing of rt_fair's from it
 * with the request's entry other than leave) or its end in the queue (expire:
 * its deadline passed; the entry is out of the queue). */
typedef void (*rt_fair_go_fn)(void *req);
typedef void (*rt_fair_expire_fn)(void *req);

typedef struct rt_fair_config {
    uint32_t admit_max;        /* requests out on the workers at once (0: no queue, every request goes) */
    uint32_t tenant_queue_max; /* requests one tenant may have waiting */
} rt_fair_config_t;

/* metrics: where the per-tenant series go (NULL: none). Frees with
 * rt_fair_destroy, which ends what is queued with expire. */
td_status_t rt_fair_create(const rt_fair_config_t *c, rt_fair_go_fn go, rt_fair_expire_fn expire, td_metrics_t *metrics,
                           rt_fair_t **out);
void rt_fair_destroy(rt_fair_t *f);

/* A request ready to go (e->req, prompt, max_tokens and deadline set):
 * 0: it goes now (RUNNING); 1: it waits (QUEUED; go or expire follows); or a
 * TD_RPC code — RESOURCE_EXHAUSTED when its tenant's queue is full, msg
 * saying so and *retry_s when to try again. */
int rt_fair_enter(rt_fair_t *f, rt_fair_entry_t *e, const char *tenant, double weight, int32_t priority, char *msg,
                  size_t n, double *retry_s);
/* A running request's end, having used prompt + output tokens (its
 * charge is settled by them); the next waiting one goes. */
void rt_fair_leave(rt_fair_t *f, rt_fair_entry_t *e, uint32_t prompt, uint32_t output);
/* A queued request's client went away: true when it was taken out of the
 * queue (the caller ends it), false when it is not queued. */
bool rt_fair_cancel(rt_fair_t *f, rt_fair_entry_t *e);

/* Per tenant (Health): weight, class, virtual count, waiting, running, tokens served, refused. */
json_t *rt_fair_json(rt_fair_t *f);

#endif
