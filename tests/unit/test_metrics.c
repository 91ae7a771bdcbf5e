/* test_metrics.c — the metrics registry (common/metrics.h): the text
 * format's shape (HELP and TYPE once per family, constant labels first,
 * escaped label values), histograms' cumulative buckets with +Inf equal to
 * the count, and the collect hook running before each rendering. A real
 * Prometheus parsing it is tests/cluster/test_prometheus.py. */
#include "tests/unit/helpers.h"

#include "common/log.h"
#include "common/metrics.h"

static int collected;

static void collect(void *ctx, td_metrics_t *m)
{
    (void)ctx;
    collected++;
    td_metric_set(td_metrics_series(m, TD_GAUGE, "tandem:g", "A gauge.", NULL, NULL, 0), 2.5);
}

Test(metrics, text_format)
{
    td_metrics_t *m = NULL;
    cr_assert_eq(td_metrics_create("M \"x\"", "router", &m), TD_OK);
    char l[64];
    td_metric_t *a = td_metrics_series(m, TD_COUNTER, "tandem:c_total", "Counts.",
                                       td_metrics_label(l, sizeof l, "code", "a\\b\n"), NULL, 0);
    td_metric_t *b = td_metrics_series(m, TD_COUNTER, "tandem:c_total", "Counts.", "code=\"OK\"", NULL, 0);
    cr_assert_eq(a, td_metrics_series(m, TD_COUNTER, "tandem:c_total", "Counts.", l, NULL, 0), "found, not added");
    td_metric_add(a, 1);
    td_metric_add(a, 2);
    td_metric_add(b, 1);
    static const double bounds[] = {0.1, 1, 10};
    td_metric_t *h = td_metrics_series(m, TD_HISTOGRAM, "tandem:h_seconds", "A histogram.", NULL, bounds, 3);
    const double obs[] = {0.05, 0.1, 0.5, 2, 20, 30};
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
        td_metric_observe(h, obs[i]);
    td_metrics_on_collect(m, collect, NULL);
    size_t n = 0;
    char *t = td_metrics_render(m, &n);
    cr_assert_not_null(t);
    cr_assert_eq(n, strlen(t));
    cr_assert_eq(collected, 1);
    const char *want[] = {
        "# HELP tandem:c_total Counts.\n# TYPE tandem:c_total counter\n",
        "tandem:c_total{model_name=\"M \\\"x\\\"\",role=\"router\",code=\"a\\\\b\\n\"} 3\n",
        "tandem:c_total{model_name=\"M \\\"x\\\"\",role=\"router\",code=\"OK\"} 1\n",
        "# TYPE tandem:h_seconds histogram\n",
        "tandem:h_seconds_bucket{model_name=\"M \\\"x\\\"\",role=\"router\",le=\"0.1\"} 2\n", /* le is inclusive */
        "tandem:h_seconds_bucket{model_name=\"M \\\"x\\\"\",role=\"router\",le=\"1\"} 3\n",
        "tandem:h_seconds_bucket{model_name=\"M \\\"x\\\"\",role=\"router\",le=\"10\"} 4\n",
        "tandem:h_seconds_bucket{model_name=\"M \\\"x\\\"\",role=\"router\",le=\"+Inf\"} 6\n",
        "tandem:h_seconds_sum{model_name=\"M \\\"x\\\"\",role=\"router\"} 52.649999999999999\n",
        "tandem:h_seconds_count{model_name=\"M \\\"x\\\"\",role=\"router\"} 6\n",
        "# TYPE tandem:g gauge\ntandem:g{model_name=\"M \\\"x\\\"\",role=\"router\"} 2.5\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert_not_null(strstr(t, want[i]), "missing %s in:\n%s", want[i], t);
    const char *first = strstr(t, "# TYPE tandem:c_total");
    cr_assert_null(strstr(first + 1, "# TYPE tandem:c_total"), "one TYPE line per family");
    free(t);
    td_metrics_destroy(m);
}

Test(metrics, no_model_name_and_bad_listen)
{
    td_metrics_t *m = NULL;
    cr_assert_eq(td_metrics_create(NULL, "kvstore", &m), TD_OK);
    td_metric_set(td_metrics_series(m, TD_GAUGE, "tandem:x", "X.", NULL, NULL, 0), 1);
    char *t = td_metrics_render(m, NULL);
    cr_assert_not_null(strstr(t, "tandem:x{role=\"kvstore\"} 1\n"), "%s", t);
    free(t);
    td_metrics_server_t *s = NULL;
    char at[64];
    cr_assert_eq(td_metrics_serve(m, &(td_metrics_endpoint_t){.listen = ""}, &s, at, sizeof at), TD_OK);
    cr_assert_null(s, "\"\" serves nothing");
    cr_assert_neq(td_metrics_serve(m, &(td_metrics_endpoint_t){.listen = "nohostport"}, &s, at, sizeof at), TD_OK);
    cr_assert_not_null(strstr(td_last_error(), "metrics.listen 'nohostport'"), "%s", td_last_error());
    td_metrics_destroy(m);
}
