/* ops.c — see ops.h. */
#include "common/ops.h"

#include <cyaml/cyaml.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/yaml.h"

#define OPT CYAML_FLAG_OPTIONAL
#define U32(k, s, m) CYAML_FIELD_UINT(k, OPT, s, m)

static const cyaml_schema_field_t slo_fields[] = {
    U32("ttft_ms", __typeof__(((td_ops_t *)0)->slo), ttft_ms),
    U32("tpot_ms", __typeof__(((td_ops_t *)0)->slo), tpot_ms),
    CYAML_FIELD_FLOAT("attainment", OPT, __typeof__(((td_ops_t *)0)->slo), attainment), CYAML_FIELD_END};
static const cyaml_schema_field_t planner_fields[] = {
    U32("interval_s", __typeof__(((td_ops_t *)0)->planner), interval_s),
    U32("hold_s", __typeof__(((td_ops_t *)0)->planner), hold_s),
    U32("cooldown_s", __typeof__(((td_ops_t *)0)->planner), cooldown_s), CYAML_FIELD_END};
static const cyaml_schema_field_t model_fields[] = {
    CYAML_FIELD_STRING_PTR("name", CYAML_FLAG_POINTER, td_ops_model_t, name, 1, 256),
    CYAML_FIELD_STRING_PTR("policy", CYAML_FLAG_POINTER | OPT, td_ops_model_t, policy, 0, 16),
    U32("prefill", td_ops_model_t, prefill), U32("decode", td_ops_model_t, decode),
    U32("min_prefill", td_ops_model_t, min_prefill), U32("max_prefill", td_ops_model_t, max_prefill),
    U32("min_decode", td_ops_model_t, min_decode), U32("max_decode", td_ops_model_t, max_decode),
    CYAML_FIELD_BOOL("colocated", OPT, td_ops_model_t, colocated),
    CYAML_FIELD_BOOL("choose_mode", OPT, td_ops_model_t, choose_mode), CYAML_FIELD_END};
static const cyaml_schema_value_t model_schema = {CYAML_VALUE_MAPPING(CYAML_FLAG_DEFAULT, td_ops_model_t, model_fields)};
static const cyaml_schema_field_t top_fields[] = {
    CYAML_FIELD_MAPPING("slo", OPT, td_ops_t, slo, slo_fields),
    CYAML_FIELD_MAPPING("planner", OPT, td_ops_t, planner, planner_fields),
    CYAML_FIELD_SEQUENCE("models", CYAML_FLAG_POINTER, td_ops_t, models, &model_schema, 1, TD_OPS_MAX_MODELS),
    CYAML_FIELD_END};
static const cyaml_schema_value_t top_schema = {CYAML_VALUE_MAPPING(CYAML_FLAG_POINTER, td_ops_t, top_fields)};

bool td_ops_is_auto(const td_ops_model_t *m) { return m && m->policy && !strcmp(m->policy, "auto"); }

static td_status_t set_policy(td_ops_model_t *m, const char *p)
{
    char *s = strdup(p);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "ops: no memory");
    free(m->policy);
    m->policy = s;
    return TD_OK;
}

/* Fills what is absent (0) with its default and checks every value; the
 * errors name the key as origin:models[i].key. */
static td_status_t complete(td_ops_t *o, const char *origin)
{
    if (o->slo.attainment == 0)
        o->slo.attainment = 0.9;
    if (!(o->slo.attainment > 0 && o->slo.attainment <= 1))
        return td_error(TD_ERR_CONFIG, "%s: slo.attainment = %g; it must be in (0, 1]", origin, o->slo.attainment);
    if (o->slo.ttft_ms > 3600000 || o->slo.tpot_ms > 3600000)
        return td_error(TD_ERR_CONFIG, "%s: slo.%s = %u ms; at most an hour", origin,
                        o->slo.ttft_ms > 3600000 ? "ttft_ms" : "tpot_ms",
                        o->slo.ttft_ms > 3600000 ? o->slo.ttft_ms : o->slo.tpot_ms);
    if (!o->planner.interval_s)
        o->planner.interval_s = 2;
    if (!o->planner.hold_s)
        o->planner.hold_s = 10;
    if (!o->planner.cooldown_s)
        o->planner.cooldown_s = 30;
    const struct { const char *k; uint32_t v; } p[] = {
        {"interval_s", o->planner.interval_s}, {"hold_s", o->planner.hold_s}, {"cooldown_s", o->planner.cooldown_s}};
    for (size_t i = 0; i < 3; i++)
        if (p[i].v > 3600)
            return td_error(TD_ERR_CONFIG, "%s: planner.%s = %u; it must be from 1 to 3600", origin, p[i].k, p[i].v);
    for (unsigned i = 0; i < o->models_count; i++) {
        td_ops_model_t *m = &o->models[i];
        for (unsigned j = 0; j < i; j++)
            if (!strcmp(o->models[j].name, m->name))
                return td_error(TD_ERR_CONFIG, "%s: models[%u].name = \"%s\" is also models[%u]'s", origin, i,
                                m->name, j);
        if (!m->policy && set_policy(m, "fixed"))
            return TD_ERR_NO_MEMORY;
        if (strcmp(m->policy, "fixed") && strcmp(m->policy, "auto"))
            return td_error(TD_ERR_CONFIG, "%s: models[%u].policy = \"%s\"; it must be fixed or auto", origin, i,
                            m->policy);
        if (m->choose_mode && !td_ops_is_auto(m))
            return td_error(TD_ERR_CONFIG, "%s: models[%u].choose_mode with policy %s; the planner chooses the mode "
                            "only under policy auto", origin, i, m->policy);
        struct { const char *role; uint32_t *count, *min, *max; } r[2] = {
            {"prefill", &m->prefill, &m->min_prefill, &m->max_prefill},
            {"decode", &m->decode, &m->min_decode, &m->max_decode}};
        if (m->colocated) { /* no prefill workers: their counts are 0, and nothing moves between roles */
            if (td_ops_is_auto(m))
                return td_error(TD_ERR_CONFIG, "%s: models[%u] is colocated with policy auto; the planner moves "
                                "workers between prefill and decode, and colocated workers do both: use fixed",
                                origin, i);
            if (m->prefill || m->min_prefill || m->max_prefill)
                return td_error(TD_ERR_CONFIG, "%s: models[%u] is colocated with prefill %u (min %u, max %u); a "
                                "colocated model has no prefill workers", origin, i, m->prefill, m->min_prefill,
                                m->max_prefill);
        }
        for (int k = m->colocated; k < 2; k++) {
            if (!*r[k].min)
                *r[k].min = 1;
            if (!*r[k].max)
                *r[k].max = *r[k].count > 16 ? *r[k].count : *r[k].min > 16 ? *r[k].min : 16;
            if (!*r[k].count)
                *r[k].count = *r[k].min;
            if (*r[k].max > TD_OPS_MAX_WORKERS)
                return td_error(TD_ERR_CONFIG, "%s: models[%u].max_%s = %u; at most %d", origin, i, r[k].role,
                                *r[k].max, TD_OPS_MAX_WORKERS);
            if (*r[k].min > *r[k].max)
                return td_error(TD_ERR_CONFIG, "%s: models[%u].min_%s = %u is above max_%s = %u", origin, i,
                                r[k].role, *r[k].min, r[k].role, *r[k].max);
            if (*r[k].count < *r[k].min || *r[k].count > *r[k].max)
                return td_error(TD_ERR_CONFIG, "%s: models[%u].%s = %u; it must be within min_%s..max_%s (%u..%u)",
                                origin, i, r[k].role, *r[k].count, r[k].role, r[k].role, *r[k].min, *r[k].max);
        }
    }
    return TD_OK;
}

/* After a load: the defaults filled and every value checked, or o freed. */
static td_status_t finish(td_status_t rc, td_ops_t *o, const char *origin, td_ops_t **out)
{
    if (!rc && !o)
        rc = td_error(TD_ERR_CONFIG, "%s: empty; an ops config needs models:", origin);
    if (!rc)
        rc = complete(o, origin);
    if (rc) {
        td_ops_free(o);
        return rc;
    }
    *out = o;
    return TD_OK;
}

td_status_t td_ops_parse(const char *text, size_t len, const char *origin, td_ops_t **out)
{
    td_ops_t *o = NULL;
    *out = NULL;
    td_status_t rc = td_yaml_load(&top_schema, text, len, origin, (void **)&o);
    return finish(rc, o, origin, out);
}

td_status_t td_ops_load_file(const char *path, td_ops_t **out)
{
    td_ops_t *o = NULL;
    *out = NULL;
    td_status_t rc = td_yaml_load_file(&top_schema, path, (void **)&o);
    return finish(rc, o, path, out);
}

td_status_t td_ops_format(const td_ops_t *ops, char **text) { return td_yaml_save(&top_schema, ops, text, NULL); }

const td_ops_model_t *td_ops_model(const td_ops_t *ops, const char *model, const char *alias)
{
    const td_ops_model_t *any = NULL, *aka = NULL;
    for (unsigned i = 0; ops && i < ops->models_count; i++) {
        if (!strcmp(ops->models[i].name, model))
            return &ops->models[i];
        if (alias && !strcmp(ops->models[i].name, alias))
            aka = &ops->models[i];
        if (!strcmp(ops->models[i].name, "*"))
            any = &ops->models[i];
    }
    return aka ? aka : any;
}

td_status_t td_ops_set_counts(td_ops_t *ops, const char *model, const char *alias, uint32_t prefill,
                              uint32_t decode)
{
    td_ops_model_t *m = (td_ops_model_t *)td_ops_model(ops, model, alias);
    if (!m) {
        if (ops->models_count >= TD_OPS_MAX_MODELS)
            return td_error(TD_ERR_CONFIG, "ops: %d models already; no room for \"*\"", TD_OPS_MAX_MODELS);
        td_ops_model_t *grown = realloc(ops->models, (ops->models_count + 1) * sizeof *grown);
        if (!grown)
            return td_error(TD_ERR_NO_MEMORY, "ops: no memory");
        ops->models = grown;
        m = &grown[ops->models_count];
        memset(m, 0, sizeof *m);
        if (!(m->name = strdup("*")))
            return td_error(TD_ERR_NO_MEMORY, "ops: no memory");
        ops->models_count++;
        m->prefill = prefill;
        m->decode = decode;
        td_status_t rc = complete(ops, "ops");
        if (rc)
            return rc;
    }
    unsigned i = (unsigned)(m - ops->models);
    if (!m->colocated && (prefill < m->min_prefill || prefill > m->max_prefill))
        return td_error(TD_ERR_CONFIG, "--prefill %u is outside models[%u] (\"%s\") min_prefill..max_prefill (%u..%u)",
                        prefill, i, m->name, m->min_prefill, m->max_prefill);
    if (decode < m->min_decode || decode > m->max_decode)
        return td_error(TD_ERR_CONFIG, "--decode %u is outside models[%u] (\"%s\") min_decode..max_decode (%u..%u)",
                        decode, i, m->name, m->min_decode, m->max_decode);
    if (m->colocated && prefill)
        return td_error(TD_ERR_CONFIG, "--prefill %u: models[%u] (\"%s\") is colocated; it has no prefill workers",
                        prefill, i, m->name);
    m->prefill = prefill;
    m->decode = decode;
    return set_policy(m, "fixed");
}

void td_ops_free(td_ops_t *ops) { td_yaml_free(&top_schema, ops); }

char *td_ops_desired_json(const td_ops_desired_t *d)
{
    json_t *j = json_pack("{s:i, s:i, s:b, s:f, s:s, s:s}", "prefill", (int)d->prefill, "decode", (int)d->decode,
                          "colocated", d->colocated, "at", d->at, "by", d->by, "reason", d->reason);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

td_status_t td_ops_desired_parse(const char *text, size_t len, td_ops_desired_t *out)
{
    memset(out, 0, sizeof *out);
    json_error_t e;
    json_t *j = json_loadb(text, len, 0, &e);
    int p = -1, d = -1, colocated = 0;
    const char *by = "", *why = "";
    double at = 0;
    if (!j || json_unpack_ex(j, &e, 0, "{s:i, s:i, s?b, s?F, s?s, s?s}", "prefill", &p, "decode", &d, "colocated",
                             &colocated, "at", &at, "by", &by, "reason", &why)) {
        json_decref(j);
        return td_error(TD_ERR_FORMAT, "%s: not the planner's record: %s", TD_OPS_DESIRED_KEY, e.text);
    }
    if (p < 0 || d < 0 || p > TD_OPS_MAX_WORKERS || d > TD_OPS_MAX_WORKERS) {
        json_decref(j);
        return td_error(TD_ERR_FORMAT, "%s: prefill %d, decode %d; each must be from 0 to %d", TD_OPS_DESIRED_KEY, p,
                        d, TD_OPS_MAX_WORKERS);
    }
    out->prefill = (uint32_t)p;
    out->decode = (uint32_t)d;
    out->colocated = colocated;
    out->at = at;
    snprintf(out->by, sizeof out->by, "%s", by);
    snprintf(out->reason, sizeof out->reason, "%s", why);
    json_decref(j);
    return TD_OK;
}

void td_ops_share(const td_ops_desired_t *d, const char *const *nodes, size_t n, const char *self, uint32_t *prefill,
                  uint32_t *decode)
{
    size_t me = 0;
    bool found = false;
    for (size_t k = 0; k < n; k++) {
        int c = strcmp(nodes[k], self);
        me += c < 0;
        found = found || c == 0;
    }
    if (!found || !n) {
        *prefill = *decode = 0;
        return;
    }
    uint32_t N = (uint32_t)n, i = (uint32_t)me;
    *prefill = d->prefill / N + (i < d->prefill % N);
    /* decode's remainder goes to the nodes after prefill's */
    uint32_t start = d->prefill % N, rank = (i + N - start) % N;
    *decode = d->decode / N + (rank < d->decode % N);
}
