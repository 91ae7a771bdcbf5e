/* metrics.h — the router's Prometheus metrics (common/metrics.h): request
 * latencies observed as they happen (TTFT, inter-token, end to end, the TTFT
 * prediction's relative error), token and prefix-cache counters, and at each
 * scrape the router's own state copied in (requests under way, workers by
 * role, placements and rejections by reason, the cache index, the planner).
 * Its port also answers /targets: every tandem process's metrics address,
 * from etcd, in the shape of Prometheus's http_sd_configs. */
#ifndef RT_METRICS_H
#define RT_METRICS_H

#include <stdint.h>

#include "common/etcd.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/status.h"
#include "router/placement.h"

struct rt_follow;
struct rt_planner;

#define RT_METRICS_CODES 17 /* gRPC status codes 0..16 */

typedef struct rt_metrics {
    td_metrics_t *reg;
    td_metrics_server_t *server;
    char bound[160]; /* HOST:PORT, "" when not served */
    td_metric_t *ttft, *itl, *e2e, *pred_err, *outlen_err;
    td_metric_t *running; /* requests admitted and not ended (request.c adds and takes) */
    td_metric_t *prompt_tokens, *generation_tokens, *prefix_queries, *prefix_hits, *store_hits;
    td_metric_t *by_code[RT_METRICS_CODES]; /* tandem:requests_total{code} */
} rt_metrics_t;

/* What a scrape reads of the router's state besides the series: each alive
 * while the metrics are served (rt_metrics_unserve ends the scrapes).
 * follow and planner may be set after the start, with an atomic release
 * store (a scrape may read them meanwhile); NULL: none. */
typedef struct rt_metrics_src {
    rt_table_t *table;
    const rt_placement_ops_t *place;
    struct rt_follow *follow;
    struct rt_planner *planner;
    td_etcd_t *etcd; /* for /targets */
} rt_metrics_src_t;

/* Serves listen (metrics.listen; nothing when "") with tls; the series exist
 * either way. src is kept. */
td_status_t rt_metrics_start(rt_metrics_t *m, const char *model, const char *listen, const td_rpc_tls_t *tls,
                             const rt_metrics_src_t *src);
/* Ends the scrapes (the series stay: requests still count); then what src
 * points to may go. */
void rt_metrics_unserve(rt_metrics_t *m);
void rt_metrics_stop(rt_metrics_t *m);

/* A request's end, for the counters (any thread). */
void rt_metrics_request_end(rt_metrics_t *m, int code);

#endif
