/* config.c — see config.h.
 *
 * How it works: one table (cfg_fields) holds every key once — its dotted
 * name, type, place in td_config_t, default, bounds or choices, and one line
 * of what it sets. The defaults, td_config_set (the flags), the YAML
 * reader's schema (libcyaml, built from the table: common/yaml.h), the
 * bounds' messages and `td_config_keys` (deploy/tandem.yaml is checked
 * against it) all come from it. What libcyaml fills is a "raw" tree of
 * pointers, one per key, so that an absent key is NULL and keeps its value. */
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

/* Every key once. min/max bound a number (max 0: any); choices ("a|b")
 * limit a string (NULL: any); rules across keys are td_config_validate's. */
typedef struct cfg_field {
    const char *name;
    cfg_kind_t kind;
    size_t off;
    const char *def;
    uint64_t min, max;
    const char *choices;
    const char *doc;
} cfg_field_t;

#define S(name, member, def, choices, doc) {name, CFG_STR, offsetof(td_config_t, member), def, 0, 0, choices, doc}
#define U(name, member, def, min, max, doc) {name, CFG_U32, offsetof(td_config_t, member), def, min, max, NULL, doc}
#define L(name, member, def, min, max, doc) {name, CFG_U64, offsetof(td_config_t, member), def, min, max, NULL, doc}
#define B(name, member, def, doc) {name, CFG_BOOL, offsetof(td_config_t, member), def, 0, 0, NULL, doc}
#define WORKER(r)                                                                                                     \
    U(#r ".count", r.count, "1", 0, 0, "workers of the role tandem up starts"),                                       \
    U(#r ".threads", r.threads, "0", 0, 256, "engine threads (0: one per core)"),                                     \
    U(#r ".token_budget", r.token_budget, "512", 1, 1u << 20, "tokens per engine step (the chunked-prefill size)"),  \
    L(#r ".kv_mib", r.kv_mib, "64", 1, 1u << 20, "the KV pool (MiB)"),                                                \
    B(#r ".profile", r.profile, "true", "measure the start-up profile (worker/profile_store.h)"),                       \
    S(#r ".device", r.device, "cpu", NULL, "cpu, cuda or cuda:N (a comma-separated list: one per worker in turn)"),   \
    B(#r ".colocated", r.colocated, "false", "serve whole requests too (decode only)")

static const cfg_field_t cfg_fields[] = {
    S("log.level", log.level, "info", NULL, "what is logged: debug, info, warn, error or off (any case)"),
    S("log.format", log.format, "text", "text|json", "log lines as text or JSON"),
    S("model.path", model.path, TD_DEFAULT_MODEL, NULL, "the GGUF or safetensors model"),
    S("model.kv_dtype", model.kv_dtype, "fp16", "fp16|fp32", "the KV cache's element type (the KV contract)"),
    S("model.numerics", model.numerics, "fast", "fast|reference", "tandem's kernels, or llama.cpp's rounding"),
    U("model.block_tokens", model.block_tokens, "16", 16, 256, "tokens per KV block, a power of two"),
    U("model.context", model.context, "0", 0, 0, "the context length (0: the model's)"),
    S("router.listen", router.listen, "127.0.0.1:50051", NULL, "the public gRPC API"),
    S("router.http_listen", router.http_listen, "127.0.0.1:8000", NULL, "the OpenAI HTTP API (\"\": none)"),
    S("router.api_keys", router.api_keys, "", NULL, "the API keys' file (\"\": an open API)"),
    S("router.admin_keys", router.admin_keys, "", NULL, "the administrators' keys' file"),
    S("router.tls_cert", router.tls_cert, "", NULL, "the public API's TLS certificate"),
    S("router.tls_key", router.tls_key, "", NULL, "its key"),
    S("router.tls_client_ca", router.tls_client_ca, "", NULL, "client certificates required, signed by this CA"),
    S("router.tls_ca", router.tls_ca, "", NULL, "the CA clients trust (tandem up's probe)"),
    U("router.max_streams", router.max_streams, "4096", 1, 1u << 20, "calls the router handles at once"),
    S("router.placement", router.placement, "predictive", NULL, "the placement policy (router/placement.h)"),
    U("router.ttft_slo_ms", router.ttft_slo_ms, "0", 0, 0, "the TTFT SLO (0: none)"),
    U("router.tpot_slo_ms", router.tpot_slo_ms, "0", 0, 0, "the TPOT SLO (0: none)"),
    B("router.early_reject", router.early_reject, "true", "refuse at once what no pair is predicted to serve in time"),
    U("router.index_max_blocks", router.index_max_blocks, "262144", 1024, 1u << 26, "the cache index's bound"),
    U("router.index_drop_events", router.index_drop_events, "0", 0, 0, "a test hook: drop one event in N"),
    WORKER(prefill),
    WORKER(decode),
    U("kvstore.count", kvstore.count, "1", 0, 0, "kvstore nodes tandem up starts"),
    L("kvstore.dram_mb", kvstore.dram_mb, "1024", 0, 0, "a node's CPU tier (MiB)"),
    L("kvstore.ssd_mb", kvstore.ssd_mb, "0", 0, 0, "its SSD tier (MiB; 0: none)"),
    S("kvstore.data_dir", kvstore.data_dir, "", NULL, "the SSD tier's folder"),
    B("kvstore.use", kvstore.use, "true", "workers fetch from and publish to the store"),
    U("kvstore.replicas_max", kvstore.replicas_max, "2", 0, KV_REPLICAS_LIMIT, "copies of a hot block"),
    U("kvstore.hot_hits", kvstore.hot_hits, "8", 1, 0, "reads per half-life that make a block hot"),
    U("kvstore.hit_half_life_s", kvstore.hit_half_life_s, "30", 1, 0, "the reads' half-life (s)"),
    S("kvstore.near", kvstore.near, "", NULL, "the id of the kvstore node on this host"),
    S("etcd.endpoints", etcd.endpoints, "127.0.0.1:2379", NULL, "etcd's client endpoints"),
    S("etcd.data_dir", etcd.data_dir, "", NULL, "tandem up's etcd data folder"),
    U("etcd.lease_ttl_s", etcd.lease_ttl_s, "3", 1, 3600, "a registration's lease (s)"),
    S("cluster.tls_ca", cluster.tls_ca, "", NULL, "the cluster CA (the internal planes' mutual TLS)"),
    S("cluster.tls_cert", cluster.tls_cert, "", NULL, "this process's certificate"),
    S("cluster.tls_key", cluster.tls_key, "", NULL, "its key"),
    B("cluster.plaintext", cluster.plaintext, "false", "the internal planes open to anyone (said loudly)"),
    S("transport.kind", transport.kind, "auto", "auto|ucx|cuda_ipc", "the KV transport"),
    B("transport.peer_errors", transport.peer_errors, "false", "UCX peer error handling"),
    U("transport.peer_idle_s", transport.peer_idle_s, "60", 1, 86400, "a KV connection unused this long closes (s)"),
    S("transport.interfaces", transport.interfaces, "lo", NULL, "the network interfaces UCX uses"),
    S("metrics.listen", metrics.listen, "", NULL, "Prometheus metrics (\"\": none)"),
};
#define N_FIELDS (sizeof cfg_fields / sizeof cfg_fields[0])

/* ---- the YAML schema, from the table ----
 * raw: a section pointer per section, in the order sections first appear;
 * each section a pointer per key of it, in table order. */
#define MAX_SECTIONS 16

typedef struct schema {
    cyaml_schema_field_t top[MAX_SECTIONS + 1], keys[N_FIELDS + MAX_SECTIONS];
    cyaml_schema_value_t value;
    char section[MAX_SECTIONS][16];
    size_t n_sections, first[MAX_SECTIONS + 1]; /* the section's keys: cfg_fields[first[s] .. first[s + 1]) */
    int sec_of[N_FIELDS];                       /* each key's section (its place: i - first[sec_of[i]]) */
} schema_t;

static void schema_build(schema_t *sc)
{
    memset(sc, 0, sizeof *sc);
    size_t k = 0;
    for (size_t i = 0; i < N_FIELDS; i++) {
        const char *dot = strchr(cfg_fields[i].name, '.');
        size_t len = (size_t)(dot - cfg_fields[i].name), s = sc->n_sections;
        const char *last = s ? sc->section[s - 1] : "";
        if (strlen(last) != len || strncmp(last, cfg_fields[i].name, len)) { /* a new section: its keys follow */
            s = sc->n_sections++;
            snprintf(sc->section[s], sizeof sc->section[s], "%.*s", (int)len, cfg_fields[i].name);
            sc->first[s] = i;
            if (s)
                sc->keys[k++] = (cyaml_schema_field_t)CYAML_FIELD_END;
            sc->top[s] = (cyaml_schema_field_t){.key = sc->section[s], .data_offset = s * sizeof(void *),
                                                .value = {.type = CYAML_MAPPING,
                                                          .flags = CYAML_FLAG_OPTIONAL | CYAML_FLAG_POINTER,
                                                          .mapping = {.fields = &sc->keys[k]}}};
        } else {
            s--;
        }
        sc->sec_of[i] = (int)s;
        cyaml_schema_field_t *f = &sc->keys[k++];
        f->key = dot + 1;
        f->data_offset = (i - sc->first[s]) * sizeof(void *);
        f->value.flags = CYAML_FLAG_OPTIONAL | CYAML_FLAG_POINTER;
        static const cyaml_type_e types[] = {CYAML_STRING, CYAML_UINT, CYAML_UINT, CYAML_BOOL};
        static const uint32_t sizes[] = {sizeof(char *), sizeof(uint32_t), sizeof(uint64_t), sizeof(bool)};
        f->value.type = types[cfg_fields[i].kind];
        f->value.data_size = sizes[cfg_fields[i].kind];
        if (cfg_fields[i].kind == CFG_STR)
            f->value.string.max = CYAML_UNLIMITED;
    }
    sc->first[sc->n_sections] = N_FIELDS;
    sc->keys[k] = (cyaml_schema_field_t)CYAML_FIELD_END;
    for (size_t s = 0; s < sc->n_sections; s++)
        sc->top[s].value.data_size = (uint32_t)((sc->first[s + 1] - sc->first[s]) * sizeof(void *));
    sc->top[sc->n_sections] = (cyaml_schema_field_t)CYAML_FIELD_END;
    sc->value = (cyaml_schema_value_t){.type = CYAML_MAPPING, .flags = CYAML_FLAG_POINTER,
                                       .data_size = (uint32_t)(sc->n_sections * sizeof(void *)),
                                       .mapping = {.fields = sc->top}};
}

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
    for (size_t i = 0; i < N_FIELDS; i++) {
        td_status_t rc = td_config_set(cfg, cfg_fields[i].name, cfg_fields[i].def);
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
    schema_t *sc = malloc(sizeof *sc);
    if (!sc)
        return td_error(TD_ERR_NO_MEMORY, "config: no memory");
    schema_build(sc);
    void **raw = NULL;
    td_status_t rc = td_yaml_load_file(&sc->value, path, (void **)&raw);
    for (size_t i = 0; i < N_FIELDS && !rc && raw; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        void **section = raw[sc->sec_of[i]];
        void *v = section ? section[i - sc->first[sc->sec_of[i]]] : NULL;
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
    if (raw)
        td_yaml_free(&sc->value, raw);
    free(sc);
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

/* One key against its bounds or choices in the table. */
static td_status_t check_field(const td_config_t *cfg, const cfg_field_t *f)
{
    const char *slot = (const char *)cfg + f->off;
    if (f->kind == CFG_STR && f->choices) {
        const char *v = *(char *const *)(const void *)slot;
        char list[160] = ""; /* "a, b or c", for the message */
        size_t at = 0;
        for (const char *c = f->choices; *c;) {
            size_t len = strcspn(c, "|");
            if (strlen(v) == len && !strncmp(v, c, len))
                return TD_OK;
            const char *sep = !at ? "" : c[len] ? ", " : " or ";
            at += (size_t)snprintf(list + at, at < sizeof list ? sizeof list - at : 0, "%s%.*s", sep, (int)len, c);
            c += len + (c[len] == '|');
        }
        return td_error(TD_ERR_CONFIG, "config: %s = '%s'; it must be %s", f->name, v, list);
    }
    if (f->kind != CFG_U32 && f->kind != CFG_U64)
        return TD_OK;
    uint64_t v = f->kind == CFG_U32 ? *(const uint32_t *)(const void *)slot : *(const uint64_t *)(const void *)slot;
    if (v >= f->min && (!f->max || v <= f->max))
        return TD_OK;
    if (f->max)
        return td_error(TD_ERR_CONFIG, "config: %s = %llu; it must be from %llu to %llu", f->name,
                        (unsigned long long)v, (unsigned long long)f->min, (unsigned long long)f->max);
    return td_error(TD_ERR_CONFIG, "config: %s = %llu; it must be at least %llu", f->name, (unsigned long long)v,
                    (unsigned long long)f->min);
}

td_status_t td_config_validate(const td_config_t *cfg)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if (check_field(cfg, &cfg_fields[i]))
            return TD_ERR_CONFIG;
    /* the rules the table's bounds do not say */
    uint32_t bt = cfg->model.block_tokens;
    if (bt & (bt - 1))
        return td_error(TD_ERR_CONFIG, "config: model.block_tokens = %u; it must be a power of two from 16 to 256", bt);
    const struct { const char *role; const char *device; } w[] = {{"prefill", cfg->prefill.device},
                                                                   {"decode", cfg->decode.device}};
    for (size_t i = 0; i < 2; i++) {
        char one[32];
        if (!td_device_pick(w[i].device, 0, one, sizeof one))
            return td_error(TD_ERR_CONFIG, "config: %s.device = '%s'; it must be cpu, cuda or cuda:N (or a "
                            "comma-separated list of them, one for each worker in turn)", w[i].role, w[i].device);
    }
    td_log_level_t lv;
    if (td_log_level_parse(cfg->log.level, &lv))
        return td_error(TD_ERR_CONFIG, "config: log.level = '%s'; it must be debug, info, warn, error or off",
                        cfg->log.level);
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
    return TD_OK;
}

size_t td_config_key_count(void) { return N_FIELDS; }

td_config_key_t td_config_key(size_t i)
{
    return i < N_FIELDS ? (td_config_key_t){cfg_fields[i].name, cfg_fields[i].def, cfg_fields[i].doc}
                        : (td_config_key_t){NULL, NULL, NULL};
}

td_status_t td_config_get(const td_config_t *cfg, const char *key, char *out, size_t n)
{
    for (size_t i = 0; i < N_FIELDS; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        if (strcmp(f->name, key))
            continue;
        const char *slot = (const char *)cfg + f->off;
        if (f->kind == CFG_STR)
            snprintf(out, n, "%s", *(char *const *)(const void *)slot);
        else if (f->kind == CFG_BOOL)
            snprintf(out, n, "%s", *(const bool *)(const void *)slot ? "true" : "false");
        else
            snprintf(out, n, "%llu", f->kind == CFG_U32 ? (unsigned long long)*(const uint32_t *)(const void *)slot
                                                        : (unsigned long long)*(const uint64_t *)(const void *)slot);
        return TD_OK;
    }
    return td_error(TD_ERR_CONFIG, "config: unknown key '%s'", key);
}

/* --help: the usage, then every key with its default and what it sets. */
static void help(const char *usage)
{
    printf("%s\nconfig keys (section.key: default — what it sets; deploy/tandem.yaml has more on each):\n", usage);
    for (size_t i = 0; i < N_FIELDS; i++)
        printf("  %-26s %-18s %s\n", cfg_fields[i].name, cfg_fields[i].def[0] ? cfg_fields[i].def : "\"\"",
               cfg_fields[i].doc);
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
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            help(usage);
            td_config_free(cfg);
            exit(0);
        }
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
