/* test_ops.c — the ops config (common/ops.h): the shipped file, defaults,
 * the canonical text read back, errors naming the key (and its line), fixed
 * counts, the planner's record, and each node's share of the counts. */
#include "tests/unit/helpers.h"

#include "common/log.h"
#include "common/ops.h"

static td_ops_t *parse(const char *text)
{
    td_ops_t *o = NULL;
    td_status_t rc = td_ops_parse(text, strlen(text), "test", &o);
    return rc ? NULL : o;
}

Test(ops, the_shipped_file_is_the_defaults)
{
    td_ops_t *f = NULL;
    cr_assert_eq(td_ops_load_file(TANDEM_SOURCE_DIR "/deploy/ops.yaml", &f), TD_OK, "%s", td_last_error());
    td_ops_t *d = parse("models:\n  - name: \"*\"\n");
    cr_assert_not_null(d, "%s", td_last_error());
    char *a = NULL, *b = NULL;
    cr_assert_eq(td_ops_format(f, &a), TD_OK);
    cr_assert_eq(td_ops_format(d, &b), TD_OK);
    cr_assert_str_eq(a, b, "deploy/ops.yaml states the defaults");
    cr_assert_eq(d->models[0].prefill, 1);
    cr_assert_eq(d->models[0].max_decode, 16);
    cr_assert_str_eq(d->models[0].policy, "fixed");
    cr_assert_float_eq(d->slo.attainment, 0.9, 1e-12);
    cr_assert_eq(d->planner.cooldown_s, 30);
    free(a);
    free(b);
    td_ops_free(f);
    td_ops_free(d);
}

Test(ops, the_canonical_text_reads_back_the_same)
{
    td_ops_t *o = parse("slo: {ttft_ms: 2000, tpot_ms: 80, attainment: 0.95}\nmodels:\n"
                        "  - {name: SmolLM2, policy: auto, prefill: 2, decode: 3, max_prefill: 4, max_decode: 5}\n"
                        "  - {name: \"*\", prefill: 1}\n");
    cr_assert_not_null(o, "%s", td_last_error());
    char *t = NULL, *t2 = NULL;
    cr_assert_eq(td_ops_format(o, &t), TD_OK);
    td_ops_t *back = parse(t);
    cr_assert_not_null(back, "%s\n%s", td_last_error(), t);
    cr_assert_eq(td_ops_format(back, &t2), TD_OK);
    cr_assert_str_eq(t, t2);
    cr_assert_eq(back->slo.ttft_ms, 2000);
    cr_assert(td_ops_is_auto(td_ops_model(back, "SmolLM2", NULL)));
    cr_assert_eq(td_ops_model(back, "other", NULL)->prefill, 1, "\"*\" governs every other model");
    cr_assert_eq(td_ops_model(back, "SmolLM2", NULL)->decode, 3);
    /* served under another name, the model's own name still finds its entry; its served name first */
    cr_assert_eq(td_ops_model(back, "SmolLM2-135M-Instruct.Q4_1", "SmolLM2")->decode, 3);
    cr_assert_eq(td_ops_model(back, "SmolLM2", "other")->decode, 3);
    cr_assert_eq(td_ops_model(back, "unknown", "other")->prefill, 1);
    free(t);
    free(t2);
    td_ops_free(o);
    td_ops_free(back);
}

Test(ops, errors_name_the_key)
{
    static const struct { const char *text, *says; } bad[] = {
        {"models:\n  - name: a\n    prefil: 2\n", "test:3: key 'models.prefil'"},
        {"slo:\n  ttft_ms: soon\nmodels:\n  - name: a\n", "test:2: key 'slo.ttft_ms'"},
        {"models:\n  - name: a\n    prefill: 5\n    max_prefill: 4\n", "models[0].prefill = 5"},
        {"models:\n  - name: a\n    policy: sometimes\n", "models[0].policy = \"sometimes\""},
        {"models:\n  - name: a\n  - name: a\n", "models[1].name = \"a\""},
        {"slo:\n  attainment: 1.5\nmodels:\n  - name: a\n", "slo.attainment = 1.5"},
        {"models:\n  - name: a\n    max_decode: 65\n", "models[0].max_decode = 65"},
        {"slo:\n  ttft_ms: 1\n", "models"},
        {"models:\n  - {name: a, colocated: true, policy: auto}\n", "colocated with policy auto"},
        {"models:\n  - {name: a, colocated: true, prefill: 1}\n", "has no prefill workers"},
        {"models:\n  - {name: a, choose_mode: true}\n", "models[0].choose_mode with policy fixed"},
        {"", "empty"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        td_ops_t *o = parse(bad[i].text);
        cr_assert_null(o, "case %zu was taken", i);
        cr_assert(strstr(td_last_error(), bad[i].says), "case %zu: '%s' does not say '%s'", i, td_last_error(),
                  bad[i].says);
    }
}

Test(ops, fixed_counts_within_bounds)
{
    td_ops_t *o = parse("models:\n  - {name: m, policy: auto, max_prefill: 3}\n");
    cr_assert_not_null(o);
    cr_assert_eq(td_ops_set_counts(o, "m", NULL, 3, 2), TD_OK, "%s", td_last_error());
    cr_assert_str_eq(o->models[0].policy, "fixed");
    cr_assert_eq(o->models[0].prefill, 3);
    cr_assert_neq(td_ops_set_counts(o, "m", NULL, 4, 1), TD_OK);
    cr_assert(strstr(td_last_error(), "max_prefill"), "%s", td_last_error());
    cr_assert_eq(td_ops_set_counts(o, "other", NULL, 2, 2), TD_OK, "a model without an entry gets \"*\"");
    cr_assert_eq(o->models_count, 2);
    cr_assert_eq(td_ops_model(o, "other", NULL)->decode, 2);
    td_ops_free(o);
}

/* a colocated model: no prefill workers, its decode count as any other's,
 * and fixed counts that would add prefill workers refused */
Test(ops, a_colocated_model_has_no_prefill_workers)
{
    td_ops_t *o = parse("models:\n  - {name: \"*\", colocated: true, decode: 2}\n");
    cr_assert_not_null(o, "%s", td_last_error());
    const td_ops_model_t *m = td_ops_model(o, "x", NULL);
    cr_assert(m->colocated);
    cr_assert_eq(m->prefill + m->min_prefill + m->max_prefill, 0);
    cr_assert_eq(m->decode, 2);
    cr_assert_eq(m->min_decode, 1);
    cr_assert_eq(td_ops_set_counts(o, "x", NULL, 0, 3), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_ops_model(o, "x", NULL)->decode, 3);
    cr_assert_neq(td_ops_set_counts(o, "x", NULL, 1, 3), TD_OK);
    cr_assert(strstr(td_last_error(), "colocated"), "%s", td_last_error());
    char *t = NULL;
    cr_assert_eq(td_ops_format(o, &t), TD_OK);
    td_ops_t *back = parse(t);
    cr_assert_not_null(back, "%s\n%s", td_last_error(), t);
    cr_assert(back->models[0].colocated, "the canonical text keeps it");
    free(t);
    td_ops_free(back);
    td_ops_free(o);
}

Test(ops, the_planners_record)
{
    td_ops_desired_t d = {.prefill = 2, .decode = 5, .at = 1700000000.5}, back;
    snprintf(d.by, sizeof d.by, "router-1");
    snprintf(d.reason, sizeof d.reason, "fixed policy");
    char *j = td_ops_desired_json(&d);
    cr_assert_not_null(j);
    cr_assert_eq(td_ops_desired_parse(j, strlen(j), &back), TD_OK, "%s", td_last_error());
    cr_assert_eq(back.prefill, 2);
    cr_assert_eq(back.decode, 5);
    cr_assert_str_eq(back.reason, "fixed policy");
    cr_assert_not(back.colocated);
    free(j);
    d.prefill = 0;
    d.colocated = true;
    j = td_ops_desired_json(&d);
    cr_assert_eq(td_ops_desired_parse(j, strlen(j), &back), TD_OK, "%s", td_last_error());
    cr_assert(back.colocated && back.prefill == 0 && back.decode == 5);
    free(j);
    static const char *const bad[] = {"", "{}", "{\"prefill\": -1, \"decode\": 1}", "{\"prefill\": 1}",
                                      "{\"prefill\": 1000, \"decode\": 1}", "[1, 2]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_neq(td_ops_desired_parse(bad[i], strlen(bad[i]), &back), TD_OK, "'%s' was taken", bad[i]);
}

/* every node computes its own share: together they are the counts, none
 * differs from another by more than one per role, and the order the nodes
 * were listed in does not matter */
Test(ops, shares_add_up)
{
    const char *nodes[] = {"c", "a", "d", "b", "e"};
    for (size_t n = 1; n <= 5; n++)
        for (uint32_t p = 0; p <= 9; p++)
            for (uint32_t dd = 0; dd <= 9; dd++) {
                td_ops_desired_t d = {.prefill = p, .decode = dd};
                uint32_t sp = 0, sd = 0, lo = 99, hi = 0;
                for (size_t k = 0; k < n; k++) {
                    uint32_t a, b;
                    td_ops_share(&d, nodes, n, nodes[k], &a, &b);
                    sp += a;
                    sd += b;
                    lo = a + b < lo ? a + b : lo;
                    hi = a + b > hi ? a + b : hi;
                }
                cr_assert_eq(sp, p);
                cr_assert_eq(sd, dd);
                cr_assert_leq(hi - lo, 1, "%zu nodes, %u + %u: totals from %u to %u", n, p, dd, lo, hi);
            }
    uint32_t a, b;
    td_ops_desired_t d = {.prefill = 3, .decode = 3};
    td_ops_share(&d, nodes, 5, "zz", &a, &b);
    cr_assert_eq(a + b, 0, "a node not in the list runs nothing");
}
