/* test_outlen.c — the output-length predictor (router/outlen.h): it learns a
 * tenant's lengths and how length follows the prompt, a chat's history
 * outweighs the averages, the cap holds, and its error is what was observed. */
#include "tests/unit/helpers.h"

#include <math.h>

#include "common/rng.h"
#include "router/outlen.h"

TestSuite(outlen, .timeout = 30);

static double predict(rt_outlen_t *o, const char *tenant, uint32_t prompt, uint32_t max_tokens, double history)
{
    rt_outlen_query_t q = {.tenant = tenant, .prompt_tokens = prompt, .max_tokens = max_tokens,
                           .history_tokens = history};
    return rt_outlen_predict(o, &q);
}

static void observe(rt_outlen_t *o, const char *tenant, uint32_t prompt, uint32_t max_tokens, uint32_t out)
{
    rt_outlen_query_t q = {.tenant = tenant, .prompt_tokens = prompt, .max_tokens = max_tokens};
    rt_outlen_observe(o, &q, rt_outlen_predict(o, &q), out);
}

Test(outlen, before_any_end_it_predicts_half_the_cap)
{
    rt_outlen_t *o;
    cr_assert_eq(rt_outlen_create(&o), TD_OK);
    cr_assert_float_eq(predict(o, "a", 100, 200, 0), 100, 1e-6);
    cr_assert_float_eq(predict(o, NULL, 100, 1, 0), 1, 1e-6);
    double p50, p90;
    uint32_t n;
    rt_outlen_error(o, &p50, &p90, &n);
    cr_assert(n == 0 && p50 < 0 && p90 < 0);
    rt_outlen_destroy(o);
}

/* Two tenants, one answering ~20 tokens and one ~300 (log-normal, sigma 0.3),
 * both with 512-token caps: after 60 ends each, each one's prediction is
 * within 20% of its median, and the error reported is that of the last ends. */
Test(outlen, it_learns_each_tenants_lengths)
{
    rt_outlen_t *o;
    cr_assert_eq(rt_outlen_create(&o), TD_OK);
    td_rng_t r;
    td_rng_seed(&r, 5);
    for (int i = 0; i < 120; i++) {
        double z = sqrt(-2 * log(td_rng_unit(&r) + 1e-12)) * cos(6.283185307179586 * td_rng_unit(&r));
        bool big = i % 2;
        uint32_t out = (uint32_t)lround((big ? 300 : 20) * exp(0.3 * z));
        observe(o, big ? "docs" : "chat", 64 + (uint32_t)(td_rng_unit(&r) * 64), 512, out ? out : 1);
    }
    double chat = predict(o, "chat", 100, 512, 0), docs = predict(o, "docs", 100, 512, 0);
    cr_assert(fabs(chat - 20) / 20 < 0.2, "chat: predicted %.1f, median 20", chat);
    cr_assert(fabs(docs - 300) / 300 < 0.2, "docs: predicted %.1f, median 300", docs);
    double other = predict(o, "new", 100, 512, 0);
    cr_assert(other > chat && other < docs, "a tenant not seen: %.1f, between the two", other);
    double p50, p90;
    uint32_t n;
    rt_outlen_error(o, &p50, &p90, &n);
    cr_assert(n == 120 && p50 > 0 && p50 <= p90, "error p50 %.3f p90 %.3f over %u", p50, p90, n);
    json_t *j = rt_outlen_json(o);
    cr_assert_eq(json_integer_value(json_object_get(j, "ends")), 120);
    cr_assert_float_eq(json_real_value(json_object_get(j, "error_p50")), p50, 1e-12);
    json_decref(j);
    rt_outlen_destroy(o);
}

Test(outlen, length_follows_the_prompts_class)
{
    rt_outlen_t *o;
    cr_assert_eq(rt_outlen_create(&o), TD_OK);
    for (int i = 0; i < 60; i++) { /* summaries: an eighth of the prompt */
        observe(o, NULL, 64, 1024, 8);
        observe(o, NULL, 2048, 1024, 256);
    }
    double s = predict(o, NULL, 70, 1024, 0), l = predict(o, NULL, 2100, 1024, 0);
    cr_assert(s < 16 && l > 128, "a 70-token prompt: %.1f; a 2,100-token one: %.1f", s, l);
    rt_outlen_destroy(o);
}

Test(outlen, a_chats_history_outweighs_the_averages_and_the_cap_holds)
{
    rt_outlen_t *o;
    cr_assert_eq(rt_outlen_create(&o), TD_OK);
    for (int i = 0; i < 60; i++)
        observe(o, "t", 100, 1024, 20);
    double p = predict(o, "t", 100, 1024, 400);
    cr_assert(p > 100, "a chat whose answers averaged 400 tokens: %.1f", p);
    cr_assert_float_eq(predict(o, "t", 100, 50, 400), 50, 1e-9);
    cr_assert_float_eq(predict(o, "t", 100, 1024, 0), 20, 2);
    rt_outlen_destroy(o);
}
