/* test_fair.c — the router's admission queue (router/fair.h) on its own:
 * shares by weight in tokens under contention, the priority class first, no
 * credit banked while idle, a full tenant queue refused with a hint, deadlines
 * and cancels of waiting requests. */
#include "tests/unit/helpers.h"

#include <math.h>

#include "common/clock.h"
#include "common/rpc.h"
#include "router/fair.h"

typedef struct req {
    rt_fair_entry_t e;
    int tenant; /* the test's index */
    bool went, expired;
} req_t;

#define POOL 4096
static req_t reqs[POOL];
static req_t *running[POOL];
static int n_running;
static int n_expired;

static void on_go(void *r)
{
    ((req_t *)r)->went = true;
    running[n_running++] = r;
}

static void on_expire(void *r)
{
    ((req_t *)r)->expired = true;
    __atomic_add_fetch(&n_expired, 1, __ATOMIC_SEQ_CST);
}

static const char *names[3] = {"alice", "bob", "carol"};

/* enters request i for tenant k; 0 (runs), 1 (waits) or a code */
static int enter(rt_fair_t *f, int i, int k, double weight, int32_t prio, uint32_t prompt, uint32_t max_tokens)
{
    req_t *q = &reqs[i];
    memset(q, 0, sizeof *q);
    q->tenant = k;
    q->e.req = q;
    q->e.prompt = prompt;
    q->e.max_tokens = max_tokens;
    char msg[256];
    double retry;
    int rc = rt_fair_enter(f, &q->e, names[k], weight, prio, msg, sizeof msg, &retry);
    if (!rc)
        running[n_running++] = q;
    return rc;
}

/* ends the oldest running request (having used prompt + out tokens); its tenant */
static int finish_one(rt_fair_t *f, uint32_t out)
{
    cr_assert_gt(n_running, 0);
    req_t *q = running[0];
    memmove(running, running + 1, (size_t)--n_running * sizeof *running);
    rt_fair_leave(f, &q->e, q->e.prompt, out);
    return q->tenant;
}

static rt_fair_t *make(uint32_t admit_max, uint32_t queue_max)
{
    n_running = 0;
    n_expired = 0;
    rt_fair_config_t c = {.admit_max = admit_max, .tenant_queue_max = queue_max};
    rt_fair_t *f;
    cr_assert_eq(rt_fair_create(&c, on_go, on_expire, NULL, &f), TD_OK);
    return f;
}

TestSuite(fair, .timeout = 30);

Test(fair, without_a_limit_every_request_goes)
{
    rt_fair_t *f = make(0, 4);
    for (int i = 0; i < 100; i++)
        cr_assert_eq(enter(f, i, i % 2, 1, 0, 10, 10), 0);
    cr_assert_eq(n_running, 100);
    rt_fair_destroy(f);
}

/* Both tenants always waiting, weights 1:3, equal requests: of the tokens
 * served, bob's share is 3/4 within a request's worth. */
Test(fair, contended_shares_follow_the_weights_by_tokens)
{
    rt_fair_t *f = make(4, 4096);
    int i = 0;
    for (; i < 1000; i++)
        cr_assert_leq(enter(f, i, i % 2, i % 2 ? 3 : 1, 0, 30, 20), 1);
    double tokens[2] = {0, 0};
    for (int k = 0; k < 600; k++)
        tokens[finish_one(f, 20)] += 50;
    double share = tokens[1] / (tokens[0] + tokens[1]);
    cr_assert(fabs(share - 0.75) < 0.01, "bob's share %.3f, weight 3/4", share);
    /* unequal requests: alice's are 4x as long; shares still follow tokens, not requests */
    rt_fair_destroy(f);
    f = make(4, 4096);
    for (i = 0; i < 1000; i++)
        cr_assert_leq(enter(f, i, i % 2, 1, 0, i % 2 ? 10 : 40, 10), 1);
    tokens[0] = tokens[1] = 0;
    int n[2] = {0, 0};
    for (int k = 0; k < 600; k++) {
        req_t *q = running[0];
        int t = finish_one(f, 10);
        tokens[t] += q->e.prompt + 10;
        n[t]++;
    }
    share = tokens[1] / (tokens[0] + tokens[1]);
    cr_assert(fabs(share - 0.5) < 0.02 && n[1] > 2 * n[0], "equal weights: bob %.3f of the tokens, %d vs %d requests",
              share, n[1], n[0]);
    rt_fair_destroy(f);
}

Test(fair, a_higher_class_goes_first)
{
    rt_fair_t *f = make(1, 64);
    cr_assert_eq(enter(f, 0, 0, 1, 0, 10, 10), 0);
    for (int i = 1; i <= 5; i++)
        cr_assert_eq(enter(f, i, 0, 1, 0, 10, 10), 1); /* alice: class 0 */
    for (int i = 6; i <= 8; i++)
        cr_assert_eq(enter(f, i, 1, 1, 5, 10, 10), 1); /* bob: class 5, arriving later */
    int order[9];
    for (int k = 0; k < 9; k++)
        order[k] = finish_one(f, 10);
    const int want[9] = {0, 1, 1, 1, 0, 0, 0, 0, 0};
    for (int k = 0; k < 9; k++)
        cr_assert_eq(order[k], want[k], "the %d-th to end was %s", k, names[order[k]]);
    rt_fair_destroy(f);
}

/* alice alone for 200 requests; bob comes: from then on they alternate
 * (equal weights), bob does not take a run of 200 to catch up */
Test(fair, an_idle_tenant_banks_no_credit)
{
    rt_fair_t *f = make(2, 4096);
    int i = 0;
    for (; i < 400; i++)
        cr_assert_leq(enter(f, i, 0, 1, 0, 10, 10), 1);
    for (int k = 0; k < 200; k++)
        cr_assert_eq(finish_one(f, 10), 0);
    for (int j = 0; j < 100; j++, i++)
        cr_assert_eq(enter(f, i, 1, 1, 0, 10, 10), 1);
    int bob = 0;
    for (int k = 0; k < 40; k++)
        bob += finish_one(f, 10);
    cr_assert(bob >= 16 && bob <= 22, "bob ended %d of the next 40 (half: 20)", bob);
    rt_fair_destroy(f);
}

Test(fair, a_full_tenant_queue_is_refused_with_a_hint_and_others_still_queue)
{
    rt_fair_t *f = make(1, 3);
    cr_assert_eq(enter(f, 0, 0, 1, 0, 10, 10), 0);
    for (int i = 1; i <= 3; i++)
        cr_assert_eq(enter(f, i, 0, 1, 0, 10, 10), 1);
    req_t *q = &reqs[4];
    memset(q, 0, sizeof *q);
    q->e.req = q;
    char msg[256];
    double retry;
    cr_assert_eq(rt_fair_enter(f, &q->e, "alice", 1, 0, msg, sizeof msg, &retry), TD_RPC_RESOURCE_EXHAUSTED);
    cr_assert(strstr(msg, "tenant 'alice' has 3 requests waiting") && retry > 0, "%s (retry %.2f s)", msg, retry);
    cr_assert_eq(enter(f, 5, 1, 1, 0, 10, 10), 1); /* bob's own queue is empty */
    json_t *j = rt_fair_json(f);
    cr_assert_eq(json_integer_value(json_object_get(json_array_get(j, 0), "refused")), 1);
    cr_assert_eq(json_integer_value(json_object_get(json_array_get(j, 0), "waiting")), 3);
    json_decref(j);
    rt_fair_destroy(f); /* what waits is ended */
    cr_assert_eq(n_expired, 4);
}

Test(fair, a_waiting_request_ends_at_its_deadline_or_its_cancel)
{
    rt_fair_t *f = make(1, 8);
    cr_assert_eq(enter(f, 0, 0, 1, 0, 10, 10), 0);
    cr_assert_eq(enter(f, 1, 1, 1, 0, 10, 10), 1);
    req_t *q = &reqs[2];
    memset(q, 0, sizeof *q);
    q->e.req = q;
    q->e.deadline = td_now_s() + 0.2;
    char msg[256];
    double retry;
    cr_assert_eq(rt_fair_enter(f, &q->e, "carol", 1, 0, msg, sizeof msg, &retry), 1);
    double t0 = td_now_s();
    while (!__atomic_load_n(&n_expired, __ATOMIC_SEQ_CST) && td_now_s() - t0 < 5)
        td_sleep_s(0.01);
    cr_assert(q->expired && td_now_s() - t0 < 1.0, "expired %d after %.2f s", q->expired, td_now_s() - t0);
    cr_assert(rt_fair_cancel(f, &reqs[1].e)); /* bob's waits: taken out */
    cr_assert(!rt_fair_cancel(f, &reqs[1].e));
    cr_assert(!rt_fair_cancel(f, &reqs[0].e)); /* running: not the queue's to end */
    finish_one(f, 10);
    cr_assert_eq(n_running, 0, "nothing was left to go");
    rt_fair_destroy(f);
}
