/* metrics.h — Prometheus metrics of a tandem process (docs/operations.md §6): a
 * registry of counters, gauges and histograms, rendered in Prometheus's text
 * exposition format (version 0.0.4), and served over HTTP at /metrics on the
 * address the config's metrics.listen names.
 *
 * Names follow vLLM's under a `tandem:` prefix; every series carries the
 * process's constant labels model_name and role, then its own. Updating a
 * series is lock-free and allocates nothing (per-token paths observe
 * histograms); finding or adding a series takes the registry's lock and may
 * allocate, so it belongs at start-up or in the collect hook, which runs
 * before each rendering to copy the process's own counters and gauges in. */
#ifndef TD_METRICS_H
#define TD_METRICS_H

#include <netinet/in.h>
#include <stddef.h>

#include "common/rpc.h"
#include "common/status.h"

typedef enum td_metric_kind { TD_COUNTER, TD_GAUGE, TD_HISTOGRAM } td_metric_kind_t;

typedef struct td_metrics td_metrics_t;
typedef struct td_metric td_metric_t;

/* A registry whose series all carry model_name (unless NULL or "") and role. */
td_status_t td_metrics_create(const char *model_name, const char *role, td_metrics_t **out);
void td_metrics_destroy(td_metrics_t *m);

/* The series name{labels} (labels: `key="value",...` already escaped with
 * td_metrics_label, or NULL), added on first use with help and, for a
 * histogram, the bucket upper bounds (ascending; +Inf is implied). NULL only
 * without memory (logged) — the update functions take NULL and do nothing. */
td_metric_t *td_metrics_series(td_metrics_t *m, td_metric_kind_t kind, const char *name, const char *help,
                               const char *labels, const double *bounds, size_t n_bounds);
/* `key="value"` into buf with the value escaped for the text format. */
const char *td_metrics_label(char *buf, size_t cap, const char *key, const char *value);

void td_metric_add(td_metric_t *s, double v);     /* counter or gauge */
void td_metric_set(td_metric_t *s, double v);     /* gauge, or a counter mirrored from a running total */
void td_metric_observe(td_metric_t *s, double v); /* histogram */

/* Called with the registry unlocked before every rendering. */
void td_metrics_on_collect(td_metrics_t *m, void (*fn)(void *ctx, td_metrics_t *m), void *ctx);

/* The text format of every series (malloc'd, NUL-terminated), NULL without memory. */
char *td_metrics_render(td_metrics_t *m, size_t *len);

/* Bucket bounds in seconds shared by the latency histograms (vLLM's TTFT ones). */
extern const double td_metrics_latency_s[];
extern const size_t td_metrics_latency_n;

/* ---- the HTTP endpoint ---- */

/* HOST:PORT (IPv4; port 0: any free one) for a listener; what names the
 * setting the error cites. */
td_status_t td_listen_addr(const char *listen, const char *what, struct sockaddr_in *sa);

typedef struct td_metrics_server td_metrics_server_t;
/* A further GET path the endpoint answers: a body (malloc'd) and its
 * content type, or NULL for 503 naming td_last_error(). */
typedef char *(*td_metrics_page_fn)(void *ctx, const char **content_type);

typedef struct td_metrics_endpoint {
    const char *listen;       /* metrics.listen; "" or NULL serves nothing */
    const td_rpc_tls_t *tls;  /* the process's cluster pair and CA (https.h: HTTPS, client
                               * certificates the CA signed); NULL: plain HTTP */
    const char *path;         /* a further page (NULL: none), answered by page(ctx) */
    td_metrics_page_fn page;
    void *ctx;
} td_metrics_endpoint_t;

/* Serves GET /metrics (and the further page) as ep says; *out NULL when
 * ep->listen is empty. *bound receives HOST:PORT as peers reach it
 * (td_rpc_advertise_addr: the port chosen when 0 was asked, a wildcard host
 * replaced by this machine's address). */
td_status_t td_metrics_serve(td_metrics_t *m, const td_metrics_endpoint_t *ep, td_metrics_server_t **out,
                             char *bound, size_t bound_cap);
void td_metrics_server_stop(td_metrics_server_t *s);

#endif
