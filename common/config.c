/* config.c — see config.h.
 *
 * How it works: libcyaml loads the file (common/yaml.h) into a "raw" struct
 * whose every scalar is a pointer, so that an absent key is NULL and keeps the
 * default. A table of fields (name, type, where in td_config_t, where in the
 * raw struct) merges the raw values and serves td_config_set(). */
#include "common/config.h"

#include <ctype.h>
#include <cyaml/cyaml.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/yaml.h"

typedef enum cfg_kind { CFG_STR, CFG_U32, CFG_U64, CFG_BOOL } cfg_kind_t;

/* raw: what libcyaml fills */
typedef struct { char *level, *format; } raw_log_t;
typedef struct { char *path, *kv_dtype, *numerics; uint32_t *block_tokens, *context; } raw_model_t;
typedef struct {
    char *listen, *http_listen, *api_keys, *admin_keys, *tls_cert, *tls_key, *tls_client_ca, *tls_ca, *placement;
    uint32_t *max_streams, *ttft_slo_ms, *tpot_slo_ms, *index_max_blocks, *index_drop_events;
    bool *early_reject;
} raw_router_t;
typedef struct {
    uint32_t *count, *threads, *token_budget;
    uint64_t *kv_mib;
    bool *profile, *colocated;
    char *device;
} raw_workers_t;
typedef struct {
    uint32_t *count;
    uint64_t *dram_mb, *ssd_mb;
    char *data_dir;
    bool *use;
    uint32_t *replicas_max, *hot_hits, *hit_half_life_s;
    char *near;
} raw_kvstore_t;
typedef struct { char *endpoints, *data_dir; uint32_t *lease_ttl_s; } raw_etcd_t;
typedef struct { char *tls_ca, *tls_cert, *tls_key; bool *plaintext; } raw_cluster_t;
typedef struct { char *kind; bool *peer_errors; uint32_t *peer_idle_s; char *interfaces; } raw_transport_t;
typedef struct { char *listen; } raw_metrics_t;
typedef struct {
    raw_log_t *log;
    raw_model_t *model;
    raw_router_t *router;
    raw_workers_t *prefill, *decode;
    raw_kvstore_t *kvstore;
    raw_etcd_t *etcd;
    raw_cluster_t *cluster;
    raw_transport_t *transport;
    raw_metrics_t *metrics;
} raw_config_t;

#define OPT (CYAML_FLAG_OPTIONAL | CYAML_FLAG_POINTER)
#define STR(k, s, m) CYAML_FIELD_STRING_PTR(k, OPT, s, m, 0, CYAML_UNLIMITED)

static const cyaml_schema_field_t log_fields[] = {
    STR("level", raw_log_t, level), STR("format", raw_log_t, format), CYAML_FIELD_END};
static const cyaml_schema_field_t model_fields[] = {
    STR("path", raw_model_t, path), STR("kv_dtype", raw_model_t, kv_dtype), STR("numerics", raw_model_t, numerics),
    CYAML_FIELD_UINT_PTR("block_tokens", OPT, raw_model_t, block_tokens),
    CYAML_FIELD_UINT_PTR("context", OPT, raw_model_t, context), CYAML_FIELD_END};
static const cyaml_schema_field_t router_fields[] = {STR("listen", raw_router_t, listen),
                                                       STR("http_listen", raw_router_t, http_listen),
                                                       STR("api_keys", raw_router_t, api_keys),
                                                       STR("admin_keys", raw_router_t, admin_keys),
                                                       STR("tls_cert", raw_router_t, tls_cert),
                                                       STR("tls_key", raw_router_t, tls_key),
                                                       STR("tls_client_ca", raw_router_t, tls_client_ca),
                                                       STR("tls_ca", raw_router_t, tls_ca),
                                                       CYAML_FIELD_UINT_PTR("max_streams", OPT, raw_router_t,
                                                                            max_streams),
                                                       STR("placement", raw_router_t, placement),
                                                       CYAML_FIELD_UINT_PTR("ttft_slo_ms", OPT, raw_router_t,
                                                                            ttft_slo_ms),
                                                       CYAML_FIELD_UINT_PTR("tpot_slo_ms", OPT, raw_router_t,
                                                                            tpot_slo_ms),
                                                       CYAML_FIELD_BOOL_PTR("early_reject", OPT, raw_router_t,
                                                                            early_reject),
                                                       CYAML_FIELD_UINT_PTR("index_max_blocks", OPT, raw_router_t,
                                                                            index_max_blocks),
                                                       CYAML_FIELD_UINT_PTR("index_drop_events", OPT, raw_router_t,
                                                                            index_drop_events),
                                                       CYAML_FIELD_END};
static const cyaml_schema_field_t workers_fields[] = {
    CYAML_FIELD_UINT_PTR("count", OPT, raw_workers_t, count),
    CYAML_FIELD_UINT_PTR("threads", OPT, raw_workers_t, threads),
    CYAML_FIELD_UINT_PTR("token_budget", OPT, raw_workers_t, token_budget),
    CYAML_FIELD_UINT_PTR("kv_mib", OPT, raw_workers_t, kv_mib),
    CYAML_FIELD_BOOL_PTR("profile", OPT, raw_workers_t, profile), STR("device", raw_workers_t, device),
    CYAML_FIELD_BOOL_PTR("colocated", OPT, raw_workers_t, colocated), CYAML_FIELD_END};
static const cyaml_schema_field_t kvstore_fields[] = {
    CYAML_FIELD_UINT_PTR("count", OPT, raw_kvstore_t, count),
    CYAML_FIELD_UINT_PTR("dram_mb", OPT, raw_kvstore_t, dram_mb), CYAML_FIELD_UINT_PTR("ssd_mb", OPT, raw_kvstore_t, ssd_mb),
    STR("data_dir", raw_kvstore_t, data_dir), CYAML_FIELD_BOOL_PTR("use", OPT, raw_kvstore_t, use),
    CYAML_FIELD_UINT_PTR("replicas_max", OPT, raw_kvstore_t, replicas_max),
    CYAML_FIELD_UINT_PTR("hot_hits", OPT, raw_kvstore_t, hot_hits),
    CYAML_FIELD_UINT_PTR("hit_half_life_s", OPT, raw_kvstore_t, hit_half_life_s), STR("near", raw_kvstore_t, near),
    CYAML_FIELD_END};
static const cyaml_schema_field_t etcd_fields[] = {
    STR("endpoints", raw_etcd_t, endpoints), STR("data_dir", raw_etcd_t, data_dir),
    CYAML_FIELD_UINT_PTR("lease_ttl_s", OPT, raw_etcd_t, lease_ttl_s), CYAML_FIELD_END};

static const cyaml_schema_field_t cluster_fields[] = {
    STR("tls_ca", raw_cluster_t, tls_ca), STR("tls_cert", raw_cluster_t, tls_cert),
    STR("tls_key", raw_cluster_t, tls_key), CYAML_FIELD_BOOL_PTR("plaintext", OPT, raw_cluster_t, plaintext),
    CYAML_FIELD_END};
static const cyaml_schema_field_t transport_fields[] = {
    STR("kind", raw_transport_t, kind),
    CYAML_FIELD_BOOL_PTR("peer_errors", OPT, raw_transport_t, peer_errors),
    CYAML_FIELD_UINT_PTR("peer_idle_s", OPT, raw_transport_t, peer_idle_s),
    STR("interfaces", raw_transport_t, interfaces), CYAML_FIELD_END};
static const cyaml_schema_field_t metrics_fields[] = {STR("listen", raw_metrics_t, listen), CYAML_FIELD_END};

static const cyaml_schema_field_t top_fields[] = {
    CYAML_FIELD_MAPPING_PTR("log", OPT, raw_config_t, log, log_fields),
    CYAML_FIELD_MAPPING_PTR("model", OPT, raw_config_t, model, model_fields),
    CYAML_FIELD_MAPPING_PTR("router", OPT, raw_config_t, router, router_fields),
    CYAML_FIELD_MAPPING_PTR("prefill", OPT, raw_config_t, prefill, workers_fields),
    CYAML_FIELD_MAPPING_PTR("decode", OPT, raw_config_t, decode, workers_fields),
    CYAML_FIELD_MAPPING_PTR("kvstore", OPT, raw_config_t, kvstore, kvstore_fields),
    CYAML_FIELD_MAPPING_PTR("etcd", OPT, raw_config_t, etcd, etcd_fields),
    CYAML_FIELD_MAPPING_PTR("cluster", OPT, raw_config_t, cluster, cluster_fields),
    CYAML_FIELD_MAPPING_PTR("transport", OPT, raw_config_t, transport, transport_fields),
    CYAML_FIELD_MAPPING_PTR("metrics", OPT, raw_config_t, metrics, metrics_fields),
    CYAML_FIELD_END};

static const cyaml_schema_value_t top_schema = {
    CYAML_VALUE_MAPPING(CYAML_FLAG_POINTER, raw_config_t, top_fields)};

/* Every field once: its dotted name, kind, place in td_config_t, and how to
 * reach it in the raw struct (section pointer offset, member offset). */
typedef struct cfg_field {
    const char *name;
    cfg_kind_t kind;
    size_t off;
    size_t raw_section, raw_member;
} cfg_field_t;

#define F(name, kind, member, rsec, rtype, rmember)                                            \
    {name, kind, offsetof(td_config_t, member), offsetof(raw_config_t, rsec), offsetof(rtype, rmember)}

static const cfg_field_t cfg_fields[] = {
    F("log.level", CFG_STR, log.level, log, raw_log_t, level),
    F("log.format", CFG_STR, log.format, log, raw_log_t, format),
    F("model.path", CFG_STR, model.path, model, raw_model_t, path),
    F("model.kv_dtype", CFG_STR, model.kv_dtype, model, raw_model_t, kv_dtype),
    F("model.numerics", CFG_STR, model.numerics, model, raw_model_t, numerics),
    F("model.block_tokens", CFG_U32, model.block_tokens, model, raw_model_t, block_tokens),
    F("model.context", CFG_U32, model.context, model, raw_model_t, context),
    F("router.listen", CFG_STR, router.listen, router, raw_router_t, listen),
    F("router.http_listen", CFG_STR, router.http_listen, router, raw_router_t, http_listen),
    F("router.api_keys", CFG_STR, router.api_keys, router, raw_router_t, api_keys),
    F("router.admin_keys", CFG_STR, router.admin_keys, router, raw_router_t, admin_keys),
    F("router.tls_cert", CFG_STR, router.tls_cert, router, raw_router_t, tls_cert),
    F("router.tls_key", CFG_STR, router.tls_key, router, raw_router_t, tls_key),
    F("router.tls_client_ca", CFG_STR, router.tls_client_ca, router, raw_router_t, tls_client_ca),
    F("router.tls_ca", CFG_STR, router.tls_ca, router, raw_router_t, tls_ca),
    F("router.max_streams", CFG_U32, router.max_streams, router, raw_router_t, max_streams),
    F("router.placement", CFG_STR, router.placement, router, raw_router_t, placement),
    F("router.ttft_slo_ms", CFG_U32, router.ttft_slo_ms, router, raw_router_t, ttft_slo_ms),
    F("router.tpot_slo_ms", CFG_U32, router.tpot_slo_ms, router, raw_router_t, tpot_slo_ms),
    F("router.early_reject", CFG_BOOL, router.early_reject, router, raw_router_t, early_reject),
    F("router.index_max_blocks", CFG_U32, router.index_max_blocks, router, raw_router_t, index_max_blocks),
    F("router.index_drop_events", CFG_U32, router.index_drop_events, router, raw_router_t, index_drop_events),
    F("prefill.count", CFG_U32, prefill.count, prefill, raw_workers_t, count),
    F("prefill.threads", CFG_U32, prefill.threads, prefill, raw_workers_t, threads),
    F("prefill.token_budget", CFG_U32, prefill.token_budget, prefill, raw_workers_t, token_budget),
    F("prefill.kv_mib", CFG_U64, prefill.kv_mib, prefill, raw_workers_t, kv_mib),
    F("prefill.profile", CFG_BOOL, prefill.profile, prefill, raw_workers_t, profile),
    F("prefill.device", CFG_STR, prefill.device, prefill, raw_workers_t, device),
    F("prefill.colocated", CFG_BOOL, prefill.colocated, prefill, raw_workers_t, colocated),
    F("decode.count", CFG_U32, decode.count, decode, raw_workers_t, count),
    F("decode.threads", CFG_U32, decode.threads, decode, raw_workers_t, threads),
    F("decode.token_budget", CFG_U32, decode.token_budget, decode, raw_workers_t, token_budget),
    F("decode.kv_mib", CFG_U64, decode.kv_mib, decode, raw_workers_t, kv_mib),
    F("decode.profile", CFG_BOOL, decode.profile, decode, raw_workers_t, profile),
    F("decode.device", CFG_STR, decode.device, decode, raw_workers_t, device),
    F("decode.colocated", CFG_BOOL, decode.colocated, decode, raw_workers_t, colocated),
    F("kvstore.count", CFG_U32, kvstore.count, kvstore, raw_kvstore_t, count),
    F("kvstore.dram_mb", CFG_U64, kvstore.dram_mb, kvstore, raw_kvstore_t, dram_mb),
    F("kvstore.ssd_mb", CFG_U64, kvstore.ssd_mb, kvstore, raw_kvstore_t, ssd_mb),
    F("kvstore.data_dir", CFG_STR, kvstore.data_dir, kvstore, raw_kvstore_t, data_dir),
    F("kvstore.use", CFG_BOOL, kvstore.use, kvstore, raw_kvstore_t, use),
    F("kvstore.replicas_max", CFG_U32, kvstore.replicas_max, kvstore, raw_kvstore_t, replicas_max),
    F("kvstore.hot_hits", CFG_U32, kvstore.hot_hits, kvstore, raw_kvstore_t, hot_hits),
    F("kvstore.hit_half_life_s", CFG_U32, kvstore.hit_half_life_s, kvstore, raw_kvstore_t, hit_half_life_s),
    F("kvstore.near", CFG_STR, kvstore.near, kvstore, raw_kvstore_t, near),
    F("etcd.endpoints", CFG_STR, etcd.endpoints, etcd, raw_etcd_t, endpoints),
    F("etcd.data_dir", CFG_STR, etcd.data_dir, etcd, raw_etcd_t, data_dir),
    F("etcd.lease_ttl_s", CFG_U32, etcd.lease_ttl_s, etcd, raw_etcd_t, lease_ttl_s),
    F("cluster.tls_ca", CFG_STR, cluster.tls_ca, cluster, raw_cluster_t, tls_ca),
    F("cluster.tls_cert", CFG_STR, cluster.tls_cert, cluster, raw_cluster_t, tls_cert),
    F("cluster.tls_key", CFG_STR, cluster.tls_key, cluster, raw_cluster_t, tls_key),
    F("cluster.plaintext", CFG_BOOL, cluster.plaintext, cluster, raw_cluster_t, plaintext),
    F("transport.kind", CFG_STR, transport.kind, transport, raw_transport_t, kind),
    F("transport.peer_errors", CFG_BOOL, transport.peer_errors, transport, raw_transport_t, peer_errors),
    F("transport.peer_idle_s", CFG_U32, transport.peer_idle_s, transport, raw_transport_t, peer_idle_s),
    F("transport.interfaces", CFG_STR, transport.interfaces, transport, raw_transport_t, interfaces),
    F("metrics.listen", CFG_STR, metrics.listen, metrics, raw_metrics_t, listen),
};
#define N_FIELDS (sizeof cfg_fields / sizeof cfg_fields[0])

static td_status_t set_str(char **slot, const char *v)
{
    char *copy = strdup(v);
    if (!copy)
        return td_error(TD_ERR_NO_MEMORY, "config: no memory");
    free(*slot);
    *slot = copy;
    return TD_OK;
}

td_status_t td_config_defaults(td_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    static const struct { const char *k, *v; } defaults[] = {
        {"log.level", "info"}, {"log.format", "text"},
        {"model.path", TD_DEFAULT_MODEL}, {"model.kv_dtype", "fp16"}, {"model.numerics", "fast"},
        {"model.block_tokens", "16"}, {"model.context", "0"},
        {"router.listen", "127.0.0.1:50051"}, {"router.http_listen", "127.0.0.1:8000"}, {"router.api_keys", ""}, {"router.admin_keys", ""}, {"router.tls_cert", ""}, {"router.tls_key", ""},
        {"router.tls_client_ca", ""}, {"router.tls_ca", ""}, {"router.max_streams", "4096"},
        {"router.placement", "predictive"}, {"router.ttft_slo_ms", "0"}, {"router.tpot_slo_ms", "0"},
        {"router.early_reject", "true"}, {"router.index_max_blocks", "262144"}, {"router.index_drop_events", "0"},
        {"prefill.count", "1"}, {"prefill.threads", "0"}, {"prefill.token_budget", "512"}, {"prefill.kv_mib", "64"}, {"prefill.profile", "true"}, {"prefill.device", "cpu"},
        {"prefill.colocated", "false"},
        {"decode.count", "1"}, {"decode.threads", "0"}, {"decode.token_budget", "512"}, {"decode.kv_mib", "64"}, {"decode.profile", "true"}, {"decode.device", "cpu"},
        {"decode.colocated", "false"},
        {"kvstore.count", "1"}, {"kvstore.dram_mb", "1024"}, {"kvstore.ssd_mb", "0"}, {"kvstore.data_dir", ""},
        {"kvstore.use", "true"}, {"kvstore.replicas_max", "2"}, {"kvstore.hot_hits", "8"},
        {"kvstore.hit_half_life_s", "30"}, {"kvstore.near", ""},
        {"etcd.endpoints", "127.0.0.1:2379"}, {"etcd.data_dir", ""}, {"etcd.lease_ttl_s", "3"},
        {"cluster.tls_ca", ""}, {"cluster.tls_cert", ""}, {"cluster.tls_key", ""}, {"cluster.plaintext", "false"},
        {"transport.kind", "auto"},
        {"transport.peer_errors", "false"}, {"transport.peer_idle_s", "60"}, {"transport.interfaces", "lo"},
        {"metrics.listen", ""},
    };
    for (size_t i = 0; i < sizeof defaults / sizeof defaults[0]; i++) {
        td_status_t rc = td_config_set(cfg, defaults[i].k, defaults[i].v);
        if (rc)
            return rc;
    }
    return TD_OK;
}

td_status_t td_config_set(td_config_t *cfg, const char *key, const char *value)
{
    for (size_t i = 0; i < N_FIELDS; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        if (strcmp(f->name, key) != 0)
            continue;
        char *slot = (char *)cfg + f->off;
        if (f->kind == CFG_STR)
            return set_str((char **)(void *)slot, value);
        if (f->kind == CFG_BOOL) {
            bool t = !strcmp(value, "true") || !strcmp(value, "1"), fa = !strcmp(value, "false") || !strcmp(value, "0");
            if (!t && !fa)
                return td_error(TD_ERR_CONFIG, "config: %s: '%s' is not true or false", key, value);
            *(bool *)(void *)slot = t;
            return TD_OK;
        }
        char *end;
        errno = 0;
        unsigned long long v = strtoull(value, &end, 10);
        if (errno || end == value || *end || value[0] == '-' ||
            (f->kind == CFG_U32 && v > UINT32_MAX))
            return td_error(TD_ERR_CONFIG, "config: %s: '%s' is not an unsigned %s-bit integer", key, value,
                            f->kind == CFG_U32 ? "32" : "64");
        if (f->kind == CFG_U32)
            *(uint32_t *)(void *)slot = (uint32_t)v;
        else
            *(uint64_t *)(void *)slot = v;
        return TD_OK;
    }
    return td_error(TD_ERR_CONFIG, "config: unknown key '%s'", key);
}

td_status_t td_config_load(td_config_t *cfg, const char *path)
{
    raw_config_t *raw = NULL;
    td_status_t st = td_yaml_load_file(&top_schema, path, (void **)&raw);
    if (st)
        return st;
    td_status_t rc = TD_OK;
    for (size_t i = 0; i < N_FIELDS && !rc && raw; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        char *section = *(char **)(void *)((char *)raw + f->raw_section);
        if (!section)
            continue;
        void *v = *(void **)(void *)(section + f->raw_member);
        if (!v)
            continue;
        char *slot = (char *)cfg + f->off;
        if (f->kind == CFG_STR)
            rc = set_str((char **)(void *)slot, v);
        else if (f->kind == CFG_BOOL)
            *(bool *)(void *)slot = *(bool *)v;
        else if (f->kind == CFG_U32)
            *(uint32_t *)(void *)slot = *(uint32_t *)v;
        else
            *(uint64_t *)(void *)slot = *(uint64_t *)v;
    }
    td_yaml_free(&top_schema, raw);
    return rc ? rc : td_config_validate(cfg);
}

bool td_device_parse(const char *s, int *cuda)
{
    if (!strcmp(s, "cpu")) {
        *cuda = -1;
        return true;
    }
    if (!strcmp(s, "cuda")) {
        *cuda = 0;
        return true;
    }
    if (strncmp(s, "cuda:", 5) || !isdigit((unsigned char)s[5]))
        return false;
    char *end;
    long n = strtol(s + 5, &end, 10);
    if (*end || n > 1023)
        return false;
    *cuda = (int)n;
    return true;
}

unsigned td_device_pick(const char *list, unsigned k, char *out, size_t n)
{
    unsigned count = 0;
    for (const char *p = list;; p++) { /* count them, each checked */
        size_t len = strcspn(p, ",");
        char one[32];
        int gpu;
        if (len >= sizeof one)
            return 0;
        memcpy(one, p, len);
        one[len] = 0;
        if (!td_device_parse(one, &gpu))
            return 0;
        count++;
        p += len;
        if (!*p)
            break;
    }
    const char *p = list;
    for (unsigned i = 0; i < k % count; i++)
        p += strcspn(p, ",") + 1;
    size_t len = strcspn(p, ",");
    if (len >= n)
        return 0;
    memcpy(out, p, len);
    out[len] = 0;
    return count;
}

static const char *const *placements;
static size_t n_placements;

void td_config_placements(const char *const *names, size_t n)
{
    placements = names;
    n_placements = n;
}

td_status_t td_config_validate(const td_config_t *cfg)
{
    uint32_t bt = cfg->model.block_tokens;
    if (bt < 16 || bt > 256 || (bt & (bt - 1)))
        return td_error(TD_ERR_CONFIG, "config: model.block_tokens = %u; it must be a power of two from 16 to 256", bt);
    if (strcmp(cfg->transport.kind, "auto") && strcmp(cfg->transport.kind, "ucx") &&
        strcmp(cfg->transport.kind, "cuda_ipc"))
        return td_error(TD_ERR_CONFIG, "config: transport.kind = '%s'; it must be auto, ucx or cuda_ipc",
                        cfg->transport.kind);
    if (strcmp(cfg->model.kv_dtype, "fp16") && strcmp(cfg->model.kv_dtype, "fp32"))
        return td_error(TD_ERR_CONFIG, "config: model.kv_dtype = '%s'; it must be fp16 or fp32", cfg->model.kv_dtype);
    if (strcmp(cfg->model.numerics, "fast") && strcmp(cfg->model.numerics, "reference"))
        return td_error(TD_ERR_CONFIG, "config: model.numerics = '%s'; it must be fast or reference",
                        cfg->model.numerics);
    const struct { const char *role; uint32_t budget; uint64_t mib; uint32_t threads; const char *device; } w[] = {
        {"prefill", cfg->prefill.token_budget, cfg->prefill.kv_mib, cfg->prefill.threads, cfg->prefill.device},
        {"decode", cfg->decode.token_budget, cfg->decode.kv_mib, cfg->decode.threads, cfg->decode.device}};
    for (size_t i = 0; i < 2; i++) {
        char one[32];
        if (!td_device_pick(w[i].device, 0, one, sizeof one))
            return td_error(TD_ERR_CONFIG, "config: %s.device = '%s'; it must be cpu, cuda or cuda:N (or a "
                            "comma-separated list of them, one for each worker in turn)", w[i].role, w[i].device);
        if (w[i].threads > 256)
            return td_error(TD_ERR_CONFIG, "config: %s.threads = %u; it must be from 0 (one per core) to 256",
                            w[i].role, w[i].threads);
        if (w[i].budget < 1 || w[i].budget > 1u << 20)
            return td_error(TD_ERR_CONFIG, "config: %s.token_budget = %u; it must be from 1 to 1048576", w[i].role,
                            w[i].budget);
        if (w[i].mib < 1 || w[i].mib > 1u << 20)
            return td_error(TD_ERR_CONFIG, "config: %s.kv_mib = %llu; it must be from 1 to 1048576", w[i].role,
                            (unsigned long long)w[i].mib);
    }
    if (cfg->prefill.colocated)
        return td_error(TD_ERR_CONFIG, "config: prefill.colocated = true; only decode workers serve whole requests "
                        "(decode.colocated)");
    bool known = !n_placements;
    char names[256] = "";
    for (size_t i = 0, at = 0; i < n_placements; i++) {
        known = known || !strcmp(cfg->router.placement, placements[i]);
        at += (size_t)snprintf(names + at, at < sizeof names ? sizeof names - at : 0, "%s%s", i ? ", " : "",
                               placements[i]);
    }
    if (!known)
        return td_error(TD_ERR_CONFIG, "config: router.placement = \"%s\"; it must be one of %s",
                        cfg->router.placement, names);
    if (cfg->router.index_max_blocks < 1024 || cfg->router.index_max_blocks > 1u << 26)
        return td_error(TD_ERR_CONFIG, "config: router.index_max_blocks = %u; it must be from 1024 to 67108864",
                        cfg->router.index_max_blocks);
    if (cfg->router.max_streams < 1 || cfg->router.max_streams > 1u << 20)
        return td_error(TD_ERR_CONFIG, "config: router.max_streams = %u; it must be from 1 to 1048576",
                        cfg->router.max_streams);
    if (cfg->etcd.lease_ttl_s < 1 || cfg->etcd.lease_ttl_s > 3600)
        return td_error(TD_ERR_CONFIG, "config: etcd.lease_ttl_s = %u; it must be from 1 to 3600",
                        cfg->etcd.lease_ttl_s);
    if (cfg->transport.peer_idle_s < 1 || cfg->transport.peer_idle_s > 86400)
        return td_error(TD_ERR_CONFIG, "config: transport.peer_idle_s = %u; it must be from 1 to 86400",
                        cfg->transport.peer_idle_s);
    td_log_level_t lv;
    if (td_log_level_parse(cfg->log.level, &lv))
        return td_error(TD_ERR_CONFIG, "config: log.level = '%s'; it must be debug, info, warn, error or off",
                        cfg->log.level);
    if (cfg->kvstore.replicas_max > KV_REPLICAS_LIMIT)
        return td_error(TD_ERR_CONFIG, "config: kvstore.replicas_max = %u; at most %u", cfg->kvstore.replicas_max,
                        KV_REPLICAS_LIMIT);
    if (!cfg->kvstore.hot_hits || !cfg->kvstore.hit_half_life_s)
        return td_error(TD_ERR_CONFIG, "config: kvstore.%s is 0; it must be at least 1",
                        cfg->kvstore.hot_hits ? "hit_half_life_s" : "hot_hits");
    if (strcmp(cfg->log.format, "text") && strcmp(cfg->log.format, "json"))
        return td_error(TD_ERR_CONFIG, "config: log.format = '%s'; it must be text or json", cfg->log.format);
    return TD_OK;
}

void td_config_free(td_config_t *cfg)
{
    if (!cfg)
        return;
    for (size_t i = 0; i < N_FIELDS; i++)
        if (cfg_fields[i].kind == CFG_STR) {
            char **slot = (char **)(void *)((char *)cfg + cfg_fields[i].off);
            free(*slot);
            *slot = NULL;
        }
}

int td_config_from_args(td_config_t *cfg, const char *prog, const char *section, const td_flag_t *flags,
                        size_t n_flags, const char *const *own, td_own_flag_fn own_fn, void *ctx, const char *usage,
                        int argc, char **argv)
{
    if (td_config_defaults(cfg))
        return 2;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--config") && td_config_load(cfg, argv[i + 1])) {
            fprintf(stderr, "%s: %s\n", prog, td_last_error());
            return 2;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        const td_flag_t *f = NULL;
        for (size_t k = 0; k < n_flags && !f; k++)
            if (!strcmp(a, flags[k].flag))
                f = &flags[k];
        bool mine = false;
        for (size_t k = 0; own && own[k] && !mine; k++)
            mine = !strcmp(a, own[k]);
        if (!f && !mine && strcmp(a, "--config")) {
            fprintf(stderr, "%s: unknown argument '%s'\n%s", prog, a, usage);
            return 2;
        }
        if (!v) {
            fprintf(stderr, "%s: %s needs a value\n", prog, a);
            return 2;
        }
        i++;
        if (mine) {
            if (own_fn(ctx, a, v))
                return 2;
        } else if (f) {
            char key[96];
            snprintf(key, sizeof key, f->key, section ? section : "");
            if (td_config_set(cfg, key, v)) {
                fprintf(stderr, "%s: %s: %s\n", prog, a, td_last_error());
                return 2;
            }
        }
    }
    if (td_config_validate(cfg)) {
        fprintf(stderr, "%s: %s\n", prog, td_last_error());
        return 2;
    }
    return 0;
}

int td_own_listen_id(void *ctx, const char *flag, const char *value)
{
    td_listen_id_t *o = ctx;
    if (!strcmp(flag, "--listen"))
        snprintf(o->listen, o->listen_cap, "%s", value);
    else
        snprintf(o->id, o->id_cap, "%s", value);
    return 0;
}
