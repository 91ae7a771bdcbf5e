/* test_request.c — the router's request pipeline (router/request.h: place →
 * reserve → prefill → open_decode → stream) against fake prefill and decode
 * workers: real gRPC servers in this process that answer each internal call
 * as the test scripts (serve, or fail with a code; a decode stream may break
 * after some tokens; a prefill may hang until it is cancelled). Each step's
 * failure gets its answer: the request ends with the code and a message
 * naming the worker, or goes on elsewhere; whatever was taken (the
 * reservation, its landing, the workers) is given back. Outputs are checked
 * token for token: a fake worker's output token k is 1000 + k, so a resumed
 * stream must continue exactly where the broken one stopped. */
#include "tests/unit/router_rig.h"

static void assert_tokens(const sink_t *s, uint32_t n)
{
    cr_assert_eq(s->n, n, "%zu tokens, not %u", s->n, n);
    for (uint32_t i = 0; i < n; i++)
        cr_assert_eq(s->tokens[i], (int32_t)(1000 + i), "token %u is %d", i, s->tokens[i]);
}

Test(request, served_through_every_step, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    run(&g, 12, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_OK, "%s", g.sink.message);
    assert_tokens(&g.sink, 12);
    cr_assert_eq(p.prefills, 1);
    cr_assert_eq(d.reserves, 1);
    cr_assert_eq(d.decodes, 1);
    cr_assert(!d.decode_whole);
    cr_assert_eq(d.releases, 0); /* the Decode claimed it */
    cr_assert_eq(worker(&g.table, "p1")->inflight, 0);
    cr_assert_eq(worker(&g.table, "d1")->inflight, 0);
    fake_stop(&p);
    fake_stop(&d);
    rig_down(&g);
}

/* place: no worker to serve it: the answer says so at once. */
Test(request, place_without_workers_answers_unavailable, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    double t0 = td_now_s();
    run(&g, 4, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_UNAVAILABLE, "%d: %s", g.sink.code, g.sink.message);
    cr_assert(strstr(g.sink.message, "worker"), "%s", g.sink.message);
    cr_assert_lt(td_now_s() - t0, 5.0);
    rig_down(&g);
}

/* reserve: a bad request (INVALID_ARGUMENT) ends the request naming the
 * decode worker, nothing is prefilled, and the worker is not suspect. */
Test(request, reserve_refused_ends_the_request, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    d.reserve_code[0] = TD_RPC_INVALID_ARGUMENT;
    run(&g, 4, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_INVALID_ARGUMENT, "%s", g.sink.message);
    cr_assert(strstr(g.sink.message, "decode worker d1"), "%s", g.sink.message);
    cr_assert_eq(p.prefills, 0);
    cr_assert_eq(worker(&g.table, "d1")->suspect_until, 0);
    cr_assert_eq(worker(&g.table, "p1")->inflight, 0);
    fake_stop(&p);
    fake_stop(&d);
    rig_down(&g);
}

/* reserve: a decode worker that fails (UNAVAILABLE) is suspect, and the
 * request goes to the other one. */
Test(request, reserve_failure_goes_elsewhere, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d1, d2;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d1, "d1", "decode", false, &g.table);
    fake_start(&d2, "d2", "decode", false, &g.table);
    d1.reserve_code[0] = TD_RPC_UNAVAILABLE; /* least loaded, equal: the first registered is placed first */
    run(&g, 6, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_OK, "%s", g.sink.message);
    assert_tokens(&g.sink, 6);
    cr_assert(d1.reserves == 1 && d2.reserves == 1, "d1 %d, d2 %d reserves", d1.reserves, d2.reserves);
    cr_assert_gt(worker(&g.table, "d1")->suspect_until, td_now_s());
    cr_assert_eq(p.prefills, 1);
    fake_stop(&p);
    fake_stop(&d1);
    fake_stop(&d2);
    rig_down(&g);
}

/* prefill: a worker that fails is asked to stop putting, the landing is
 * released closed, and the prompt is prefilled on the other worker. */
Test(request, prefill_failure_releases_the_landing_and_goes_elsewhere, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p1, p2, d;
    fake_start(&p1, "p1", "prefill", false, &g.table);
    fake_start(&p2, "p2", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    p1.prefill_code[0] = TD_RPC_UNAVAILABLE; /* placed first */
    run(&g, 6, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_OK, "%s", g.sink.message);
    assert_tokens(&g.sink, 6);
    cr_assert(p1.prefills == 1 && p2.prefills == 1, "p1 %d, p2 %d prefills", p1.prefills, p2.prefills);
    cr_assert_eq(p1.cancels, 1); /* UNAVAILABLE is no answer: asked to stop */
    cr_assert_eq(p2.cancels, 0);
    wait_settled(&d, 1);
    cr_assert_eq(d.releases_closed, 1);
    cr_assert_eq(d.reserves, 2);
    cr_assert_gt(worker(&g.table, "p1")->suspect_until, td_now_s());
    fake_stop(&p1);
    fake_stop(&p2);
    fake_stop(&d);
    rig_down(&g);
}

/* prefill: a refusal (INVALID_ARGUMENT) is an answer: no Cancel, the
 * landing released closed, the request ends naming the prefill worker. */
Test(request, prefill_refused_ends_the_request, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    p.prefill_code[0] = TD_RPC_INVALID_ARGUMENT;
    run(&g, 4, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_INVALID_ARGUMENT, "%s", g.sink.message);
    cr_assert(strstr(g.sink.message, "prefill worker p1"), "%s", g.sink.message);
    cr_assert_eq(p.cancels, 0);
    wait_settled(&d, 1);
    cr_assert_eq(d.releases_closed, 1);
    cr_assert_eq(d.decodes, 0);
    cr_assert_eq(worker(&g.table, "p1")->suspect_until, 0);
    fake_stop(&p);
    fake_stop(&d);
    rig_down(&g);
}

/* prefill: the client goes away mid-prefill: it hears CANCELLED, the
 * prefill worker is asked to stop and the landing released closed. */
Test(request, cancel_during_prefill, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    p.prefill_hangs = true;
    double t0 = td_now_s();
    run(&g, 4, 30, 0.3);
    cr_assert_eq(g.sink.code, TD_RPC_CANCELLED, "%d: %s", g.sink.code, g.sink.message);
    cr_assert_lt(td_now_s() - t0, 5.0);
    wait_settled(&d, 1);
    cr_assert_eq(d.releases_closed, 1);
    cr_assert_eq(worker(&g.table, "p1")->suspect_until, 0); /* the client's doing, not the worker's */
    fake_stop(&p);
    fake_stop(&d);
    rig_down(&g);
}

/* prefill: the deadline passes mid-prefill: DEADLINE_EXCEEDED within it. */
Test(request, deadline_during_prefill, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    p.prefill_hangs = true;
    double t0 = td_now_s();
    run(&g, 4, 0.5, 0);
    double took = td_now_s() - t0;
    cr_assert_eq(g.sink.code, TD_RPC_DEADLINE_EXCEEDED, "%d: %s", g.sink.code, g.sink.message);
    cr_assert(took < 0.5 + 0.3, "answered after %.3f s", took);
    wait_settled(&d, 1);
    fake_stop(&p);
    fake_stop(&d);
    rig_down(&g);
}

/* stream: a decode stream that breaks after 5 tokens is resumed — the
 * prompt and the 5 tokens prefilled again — and the client's tokens go on
 * from the sixth, none lost or repeated. */
Test(request, broken_stream_resumes_where_it_stopped, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d1, d2;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d1, "d1", "decode", false, &g.table);
    fake_start(&d2, "d2", "decode", false, &g.table);
    d1.decode_code[0] = TD_RPC_UNAVAILABLE; /* placed first */
    d1.decode_break[0] = 5;
    run(&g, 12, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_OK, "%s", g.sink.message);
    assert_tokens(&g.sink, 12);
    cr_assert_eq(p.prefills, 2);
    cr_assert_eq(p.prefill_sampled_before, 5); /* the resume: the 5 streamed tokens computed again */
    cr_assert(d1.decodes == 1 && d2.decodes == 1, "d1 %d, d2 %d decodes", d1.decodes, d2.decodes);
    fake_stop(&p);
    fake_stop(&d1);
    fake_stop(&d2);
    rig_down(&g);
}

/* stream: a decode worker's own error three times ends the request
 * INTERNAL, naming the attempts. */
Test(request, internal_errors_end_after_three_attempts, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &g.table);
    fake_start(&d, "d1", "decode", false, &g.table);
    for (int i = 0; i < 3; i++)
        d.decode_code[i] = TD_RPC_INTERNAL;
    run(&g, 6, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_INTERNAL, "%s", g.sink.message);
    cr_assert(strstr(g.sink.message, "3 attempts"), "%s", g.sink.message);
    cr_assert_eq(d.decodes, 3);
    fake_stop(&p);
    fake_stop(&d);
    rig_down(&g);
}

/* open_decode on a colocated worker (no prefill worker): the whole request
 * is one Decode stream, no reservation. */
Test(request, colocated_worker_serves_it_whole, .timeout = 60)
{
    rig_t g;
    rig_up(&g, NULL);
    fake_t d;
    fake_start(&d, "c1", "decode", true, &g.table);
    run(&g, 8, 30, 0);
    cr_assert_eq(g.sink.code, TD_RPC_OK, "%s", g.sink.message);
    assert_tokens(&g.sink, 8);
    cr_assert(d.decode_whole);
    cr_assert_eq(d.reserves, 0);
    fake_stop(&d);
    rig_down(&g);
}
