/* metrics.c — see metrics.h. */
#include "common/metrics.h"

#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/https.h"
#include "common/log.h"
#include "common/rpc.h"

const double td_metrics_latency_s[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,  0.75,
                                       1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const size_t td_metrics_latency_n = sizeof td_metrics_latency_s / sizeof td_metrics_latency_s[0];

/* A double kept as its bits, so that it can be added to atomically. */
typedef _Atomic uint64_t atomic_double_t;

static double ad_load(atomic_double_t *a)
{
    uint64_t b = atomic_load_explicit(a, memory_order_relaxed);
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}

static void ad_store(atomic_double_t *a, double v)
{
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    atomic_store_explicit(a, b, memory_order_relaxed);
}

static void ad_add(atomic_double_t *a, double v)
{
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed), nb;
    do {
        double o;
        memcpy(&o, &old, sizeof o);
        o += v;
        memcpy(&nb, &o, sizeof nb);
    } while (!atomic_compare_exchange_weak_explicit(a, &old, nb, memory_order_relaxed, memory_order_relaxed));
}

struct td_metric {
    struct td_metric *next; /* in its family */
    char *labels;           /* the series' own labels, or "" */
    atomic_double_t value;  /* counter, gauge; a histogram's sum */
    _Atomic uint64_t count; /* histogram: observations */
    size_t n_bounds;
    double *bounds;
    _Atomic uint64_t *buckets; /* histogram: per bucket (not cumulative), n_bounds + 1 with +Inf */
};

typedef struct family {
    struct family *next;
    char *name, *help;
    td_metric_kind_t kind;
    td_metric_t *series, **tail;
} family_t;

struct td_metrics {
    pthread_mutex_t mu;
    char *base; /* model_name="...",role="..." */
    family_t *families, **tail;
    void (*collect)(void *ctx, td_metrics_t *m);
    void *collect_ctx;
};

const char *td_metrics_label(char *buf, size_t cap, const char *key, const char *value)
{
    size_t o = 0;
    int n = snprintf(buf, cap, "%s=\"", key);
    if (n < 0 || (size_t)n >= cap) {
        if (cap)
            buf[0] = 0;
        return buf;
    }
    o = (size_t)n;
    for (const char *p = value ? value : ""; *p && o + 3 < cap; p++) {
        if (*p == '\\' || *p == '"' || *p == '\n') {
            buf[o++] = '\\';
            buf[o++] = *p == '\n' ? 'n' : *p;
        } else {
            buf[o++] = *p;
        }
    }
    buf[o++] = '"';
    buf[o] = 0;
    return buf;
}

td_status_t td_metrics_create(const char *model_name, const char *role, td_metrics_t **out)
{
    td_metrics_t *m = calloc(1, sizeof *m);
    char a[256], b[128];
    size_t n = strlen(td_metrics_label(a, sizeof a, "model_name", model_name)) + 1 +
               strlen(td_metrics_label(b, sizeof b, "role", role)) + 1;
    if (m)
        m->base = malloc(n);
    if (!m || !m->base) {
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "metrics: no memory");
    }
    if (model_name && model_name[0]) /* the kvstore serves every model: no model_name */
        snprintf(m->base, n, "%s,%s", a, b);
    else
        snprintf(m->base, n, "%s", b);
    pthread_mutex_init(&m->mu, NULL);
    m->tail = &m->families;
    *out = m;
    return TD_OK;
}

static void series_free(td_metric_t *s)
{
    free(s->labels);
    free(s->bounds);
    free(s->buckets);
    free(s);
}

void td_metrics_destroy(td_metrics_t *m)
{
    if (!m)
        return;
    for (family_t *f = m->families, *nf; f; f = nf) {
        nf = f->next;
        for (td_metric_t *s = f->series, *ns; s; s = ns) {
            ns = s->next;
            series_free(s);
        }
        free(f->name);
        free(f->help);
        free(f);
    }
    pthread_mutex_destroy(&m->mu);
    free(m->base);
    free(m);
}

td_metric_t *td_metrics_series(td_metrics_t *m, td_metric_kind_t kind, const char *name, const char *help,
                               const char *labels, const double *bounds, size_t n_bounds)
{
    if (!labels)
        labels = "";
    pthread_mutex_lock(&m->mu);
    family_t *f = m->families;
    while (f && strcmp(f->name, name))
        f = f->next;
    if (!f) {
        f = calloc(1, sizeof *f);
        if (f && (!(f->name = strdup(name)) || !(f->help = strdup(help)))) {
            free(f->name);
            free(f);
            f = NULL;
        }
        if (!f)
            goto oom;
        f->kind = kind;
        f->tail = &f->series;
        *m->tail = f;
        m->tail = &f->next;
    }
    td_metric_t *s = f->series;
    while (s && strcmp(s->labels, labels))
        s = s->next;
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || !(s->labels = strdup(labels))) {
            free(s);
            goto oom;
        }
        if (kind == TD_HISTOGRAM) {
            s->n_bounds = n_bounds;
            s->bounds = malloc((n_bounds ? n_bounds : 1) * sizeof *s->bounds);
            s->buckets = calloc(n_bounds + 1, sizeof *s->buckets);
            if (!s->bounds || !s->buckets) {
                series_free(s);
                goto oom;
            }
            memcpy(s->bounds, bounds, n_bounds * sizeof *bounds);
        }
        *f->tail = s;
        f->tail = &s->next;
    }
    pthread_mutex_unlock(&m->mu);
    return s;
oom:
    pthread_mutex_unlock(&m->mu);
    TD_WARN("metrics: no memory for %s{%s}; it is not exported", name, labels);
    return NULL;
}

void td_metric_add(td_metric_t *s, double v)
{
    if (s)
        ad_add(&s->value, v);
}

void td_metric_set(td_metric_t *s, double v)
{
    if (s)
        ad_store(&s->value, v);
}

void td_metric_observe(td_metric_t *s, double v)
{
    if (!s || !s->buckets || isnan(v))
        return;
    size_t i = 0;
    while (i < s->n_bounds && v > s->bounds[i])
        i++;
    atomic_fetch_add_explicit(&s->buckets[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
    ad_add(&s->value, v);
}

void td_metrics_on_collect(td_metrics_t *m, void (*fn)(void *ctx, td_metrics_t *m), void *ctx)
{
    pthread_mutex_lock(&m->mu);
    m->collect = fn;
    m->collect_ctx = ctx;
    pthread_mutex_unlock(&m->mu);
}

typedef struct out {
    char *p;
    size_t n, cap;
    bool failed;
} out_t;

static void outf(out_t *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void outf(out_t *o, const char *fmt, ...)
{
    if (o->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(o->p + o->n, o->cap - o->n, fmt, ap);
        va_end(ap);
        if (k < 0) {
            o->failed = true;
            return;
        }
        if ((size_t)k < o->cap - o->n) {
            o->n += (size_t)k;
            return;
        }
        size_t nc = 2 * o->cap + (size_t)k;
        char *np = realloc(o->p, nc);
        if (!np) {
            o->failed = true;
            return;
        }
        o->p = np;
        o->cap = nc;
    }
}

/* A sample value as the text format writes it. */
static void out_value(out_t *o, double v)
{
    if (isinf(v))
        outf(o, v > 0 ? "+Inf\n" : "-Inf\n");
    else if (isnan(v))
        outf(o, "NaN\n");
    else
        outf(o, "%.17g\n", v);
}

static void out_labels(out_t *o, const char *base, const char *own, const char *le_fmt, double le)
{
    outf(o, "{%s", base);
    if (own[0])
        outf(o, ",%s", own);
    if (le_fmt) {
        if (isinf(le))
            outf(o, ",le=\"+Inf\"");
        else
            outf(o, le_fmt, le);
    }
    outf(o, "} ");
}

char *td_metrics_render(td_metrics_t *m, size_t *len)
{
    pthread_mutex_lock(&m->mu);
    void (*collect)(void *, td_metrics_t *) = m->collect;
    void *cctx = m->collect_ctx;
    pthread_mutex_unlock(&m->mu);
    if (collect)
        collect(cctx, m);
    out_t o = {.cap = 8192};
    o.p = malloc(o.cap);
    if (!o.p)
        return NULL;
    o.p[0] = 0;
    static const char *const kinds[] = {"counter", "gauge", "histogram"};
    pthread_mutex_lock(&m->mu);
    for (family_t *f = m->families; f; f = f->next) {
        outf(&o, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help, f->name, kinds[f->kind]);
        for (td_metric_t *s = f->series; s; s = s->next) {
            if (f->kind != TD_HISTOGRAM) {
                outf(&o, "%s", f->name);
                out_labels(&o, m->base, s->labels, NULL, 0);
                out_value(&o, ad_load(&s->value));
                continue;
            }
            uint64_t cum = 0;
            for (size_t i = 0; i <= s->n_bounds; i++) {
                cum += atomic_load_explicit(&s->buckets[i], memory_order_relaxed);
                outf(&o, "%s_bucket", f->name);
                out_labels(&o, m->base, s->labels, ",le=\"%g\"", i < s->n_bounds ? s->bounds[i] : INFINITY);
                outf(&o, "%llu\n", (unsigned long long)cum);
            }
            outf(&o, "%s_sum", f->name);
            out_labels(&o, m->base, s->labels, NULL, 0);
            out_value(&o, ad_load(&s->value));
            outf(&o, "%s_count", f->name);
            out_labels(&o, m->base, s->labels, NULL, 0);
            /* the count is the +Inf bucket's, read above: the two always agree in one rendering */
            outf(&o, "%llu\n", (unsigned long long)cum);
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (o.failed) {
        free(o.p);
        return NULL;
    }
    if (len)
        *len = o.n;
    return o.p;
}

/* ---------------------------------------------------------------- HTTP */

td_status_t td_listen_addr(const char *listen, const char *what, struct sockaddr_in *sa)
{
    char host[256];
    const char *colon = listen ? strrchr(listen, ':') : NULL;
    if (!colon || (size_t)(colon - listen) >= sizeof host)
        return td_error(TD_ERR_CONFIG, "%s '%s': not HOST:PORT", what, listen ? listen : "");
    memcpy(host, listen, (size_t)(colon - listen));
    host[colon - listen] = 0;
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    if (getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &ai) || !ai)
        return td_error(TD_ERR_CONFIG, "%s '%s': not an IPv4 address and port of this host", what, listen);
    memcpy(sa, ai->ai_addr, sizeof *sa);
    freeaddrinfo(ai);
    return TD_OK;
}

struct td_metrics_server {
    td_metrics_t *m;
    struct MHD_Daemon *d;
    char *path;
    td_metrics_page_fn page;
    void *ctx;
    td_https_t *https; /* NULL: plain HTTP */
};

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, char *body, const char *ctype)
{
    if (!body) /* no memory */
        return MHD_NO;
    struct MHD_Response *rs = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!rs) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(rs, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    enum MHD_Result r = MHD_queue_response(c, status, rs);
    MHD_destroy_response(rs);
    return r;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    td_metrics_server_t *s = cls;
    (void)version, (void)upload, (void)con_cls;
    char why[400];
    if (!td_https_client_ok(s->https, c, why, sizeof why)) {
        char msg[420];
        snprintf(msg, sizeof msg, "forbidden: %s\n", why);
        return reply(c, MHD_HTTP_FORBIDDEN, strdup(msg), "text/plain");
    }
    if (*upload_size) {
        *upload_size = 0; /* a body to a GET is read and ignored */
        return MHD_YES;
    }
    if (strcmp(method, "GET") && strcmp(method, "HEAD"))
        return reply(c, MHD_HTTP_METHOD_NOT_ALLOWED, strdup("only GET\n"), "text/plain");
    if (!strcmp(url, "/metrics")) {
        char *body = td_metrics_render(s->m, NULL);
        return body ? reply(c, MHD_HTTP_OK, body, "text/plain; version=0.0.4; charset=utf-8")
                    : reply(c, MHD_HTTP_SERVICE_UNAVAILABLE, strdup("no memory\n"), "text/plain");
    }
    if (s->path && !strcmp(url, s->path)) {
        const char *ctype = "application/json";
        char *body = s->page(s->ctx, &ctype);
        if (!body) {
            char msg[600];
            snprintf(msg, sizeof msg, "%s\n", td_last_error());
            return reply(c, MHD_HTTP_SERVICE_UNAVAILABLE, strdup(msg), "text/plain");
        }
        return reply(c, MHD_HTTP_OK, body, ctype);
    }
    char msg[400];
    snprintf(msg, sizeof msg, "no page %.300s here: /metrics%s%s\n", url, s->path ? ", " : "", s->path ? s->path : "");
    return reply(c, MHD_HTTP_NOT_FOUND, strdup(msg), "text/plain");
}

td_status_t td_metrics_serve(td_metrics_t *m, const td_metrics_endpoint_t *ep, td_metrics_server_t **out,
                             char *bound, size_t bound_cap)
{
    *out = NULL;
    if (bound_cap)
        bound[0] = 0;
    if (!ep->listen || !ep->listen[0])
        return TD_OK;
    struct sockaddr_in sa;
    td_status_t rc = td_listen_addr(ep->listen, "metrics.listen", &sa);
    if (rc)
        return rc;
    td_metrics_server_t *s = calloc(1, sizeof *s);
    if (!s || (ep->path && !(s->path = strdup(ep->path)))) {
        free(s);
        return td_error(TD_ERR_NO_MEMORY, "metrics: no memory");
    }
    s->m = m;
    s->page = ep->page;
    s->ctx = ep->ctx;
    if ((rc = td_https_load(ep->tls, "metrics.listen", &s->https))) {
        free(s->path);
        free(s);
        return rc;
    }
    struct MHD_OptionItem tls_opts[TD_HTTPS_OPTIONS];
    td_https_options(s->https, tls_opts);
    /* one thread answers: a scrape is short, and a slow scraper waits its turn (30 s at most) */
    s->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG | td_https_flag(s->https),
                            ntohs(sa.sin_port), NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, &sa,
                            MHD_OPTION_CONNECTION_LIMIT, 64u, MHD_OPTION_CONNECTION_TIMEOUT, 30u, MHD_OPTION_ARRAY,
                            tls_opts, MHD_OPTION_END);
    if (!s->d) {
        td_https_free(s->https);
        free(s->path);
        free(s);
        return td_error(TD_ERR_UNAVAILABLE, "metrics: cannot listen on %s (in use, not an address of this host, or "
                        "its TLS pair refused)", ep->listen);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    td_rpc_advertise_addr(ep->listen, di ? (int)di->port : (int)ntohs(sa.sin_port), bound, bound_cap);
    *out = s;
    return TD_OK;
}

void td_metrics_server_stop(td_metrics_server_t *s)
{
    if (!s)
        return;
    MHD_stop_daemon(s->d);
    td_https_free(s->https);
    free(s->path);
    free(s);
}
