/* yaml.c — see yaml.h.
 *
 * libcyaml's error backtrace gives the line of the enclosing mapping, not of
 * the offending key, so on failure the key it names ("Unexpected key: x", "in
 * mapping field 'x'") is looked up again with libyaml, which gives the key's
 * own line. */
#include "common/yaml.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "common/log.h"

/* libcyaml's messages, gathered for the error we report. */
typedef struct cyaml_msgs {
    char text[2048];
    size_t len;
} cyaml_msgs_t;

static void cyaml_collect(cyaml_log_t level, void *ctx, const char *fmt, va_list args)
{
    cyaml_msgs_t *m = ctx;
    if (level < CYAML_LOG_ERROR || m->len >= sizeof m->text - 1)
        return;
    int n = vsnprintf(m->text + m->len, sizeof m->text - m->len, fmt, args);
    if (n > 0)
        m->len += (size_t)n < sizeof m->text - m->len ? (size_t)n : sizeof m->text - m->len - 1;
}

/* From libcyaml's messages: the innermost key it complains about and the
 * enclosing mapping field, e.g. "Unexpected key: foo" + "in mapping field 'log'". */
static void cyaml_blame(const char *msgs, char *key, size_t keycap, char *parent, size_t parcap)
{
    key[0] = parent[0] = '\0';
    const char *p = strstr(msgs, "Unexpected key: ");
    if (p) {
        p += strlen("Unexpected key: ");
        size_t n = strcspn(p, "\n");
        snprintf(key, keycap, "%.*s", (int)n, p);
    }
    const char *q = msgs;
    char first[64] = "", second[64] = "";
    while ((q = strstr(q, "in mapping field '"))) {
        q += strlen("in mapping field '");
        size_t n = strcspn(q, "'");
        if (!first[0])
            snprintf(first, sizeof first, "%.*s", (int)n, q);
        else if (!second[0])
            snprintf(second, sizeof second, "%.*s", (int)n, q);
    }
    if (key[0]) {
        snprintf(parent, parcap, "%s", first);
    } else {
        snprintf(key, keycap, "%s", first);
        snprintf(parent, parcap, "%s", second);
    }
}

/* The 1-based line of key in text, 0 if not found: the first mapping key
 * named key inside the value of a mapping key named parent (at any depth:
 * a list's entries too), or anywhere when parent is "". */
static size_t yaml_key_line(const char *text, size_t len, const char *parent, const char *key)
{
    enum { MAX_DEPTH = 32 };
    yaml_parser_t parser;
    yaml_event_t ev;
    size_t line = 0;
    /* per open collection: a mapping?, and whether its next scalar is a value */
    bool mapping[MAX_DEPTH] = {false}, value_next[MAX_DEPTH] = {false};
    int depth = 0, inside = parent[0] ? -1 : 0; /* the depth whose collections are parent's value */
    bool parent_value_next = false;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    while (!line && yaml_parser_parse(&parser, &ev)) {
        yaml_event_type_t type = ev.type;
        bool start = type == YAML_MAPPING_START_EVENT || type == YAML_SEQUENCE_START_EVENT;
        if (start || type == YAML_SCALAR_EVENT) {
            bool is_key = depth > 0 && mapping[depth - 1] && !value_next[depth - 1];
            if (depth > 0 && mapping[depth - 1])
                value_next[depth - 1] = !value_next[depth - 1];
            if (type == YAML_SCALAR_EVENT && is_key) {
                const char *v = (const char *)ev.data.scalar.value;
                if (inside >= 0 && depth > inside && !strcmp(v, key))
                    line = ev.start_mark.line + 1;
                else if (inside < 0 && !strcmp(v, parent))
                    parent_value_next = true; /* what follows is its value */
            } else if (start) {
                if (parent_value_next && inside < 0)
                    inside = depth; /* this collection and everything in it */
                parent_value_next = false;
                if (depth < MAX_DEPTH) {
                    mapping[depth] = type == YAML_MAPPING_START_EVENT;
                    value_next[depth] = false;
                }
                depth++;
            } else {
                parent_value_next = false;
            }
        } else if (type == YAML_MAPPING_END_EVENT || type == YAML_SEQUENCE_END_EVENT) {
            depth--;
            if (parent[0] && inside >= 0 && depth <= inside)
                inside = -1;
        }
        yaml_event_delete(&ev);
        if (type == YAML_STREAM_END_EVENT || depth >= MAX_DEPTH)
            break;
    }
    yaml_parser_delete(&parser);
    return line;
}

static const cyaml_config_t *config_of(cyaml_msgs_t *msgs, cyaml_config_t *cc)
{
    msgs->len = 0;
    msgs->text[0] = '\0';
    *cc = (cyaml_config_t){
        .log_fn = cyaml_collect, .log_ctx = msgs, .mem_fn = cyaml_mem,
        .log_level = CYAML_LOG_ERROR, .flags = CYAML_CFG_DEFAULT,
    };
    return cc;
}

td_status_t td_yaml_load(const cyaml_schema_value_t *schema, const char *text, size_t len, const char *origin,
                         void **out)
{
    cyaml_msgs_t msgs;
    cyaml_config_t cc;
    *out = NULL;
    cyaml_err_t err = cyaml_load_data((const uint8_t *)text, len, config_of(&msgs, &cc), schema,
                                      (cyaml_data_t **)out, NULL);
    if (err == CYAML_OK)
        return TD_OK;
    *out = NULL;
    char key[128], parent[64];
    cyaml_blame(msgs.text, key, sizeof key, parent, sizeof parent);
    size_t line = key[0] ? yaml_key_line(text, len, parent, key) : 0;
    char *nl;
    while ((nl = strchr(msgs.text, '\n')))
        *nl = ' ';
    if (line)
        return td_error(TD_ERR_CONFIG, "%s:%zu: key '%s%s%s': %s (%s)", origin, line, parent, parent[0] ? "." : "",
                        key, cyaml_strerror(err), msgs.text);
    return td_error(TD_ERR_CONFIG, "%s: %s (%s)", origin, cyaml_strerror(err), msgs.text);
}

td_status_t td_yaml_load_file(const cyaml_schema_value_t *schema, const char *path, void **out)
{
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return td_error(TD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1u << 20;
    char *text = malloc(cap + 1);
    size_t n = text ? fread(text, 1, cap + 1, fp) : 0;
    bool err = ferror(fp);
    fclose(fp);
    if (!text)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory to read it", path);
    td_status_t rc = err ? td_error(TD_ERR_IO, "%s: cannot read it", path)
                   : n > cap ? td_error(TD_ERR_CONFIG, "%s: larger than 1 MiB; not a config file", path)
                             : td_yaml_load(schema, text, n, path, out);
    free(text);
    return rc;
}

void td_yaml_free(const cyaml_schema_value_t *schema, void *data)
{
    cyaml_msgs_t msgs;
    cyaml_config_t cc;
    if (data)
        cyaml_free(config_of(&msgs, &cc), schema, data, 0);
}

td_status_t td_yaml_save(const cyaml_schema_value_t *schema, const void *data, char **text, size_t *len)
{
    cyaml_msgs_t msgs;
    cyaml_config_t cc;
    char *out = NULL;
    size_t n = 0;
    cyaml_err_t err = cyaml_save_data(&out, &n, config_of(&msgs, &cc), schema, data, 0);
    if (err != CYAML_OK)
        return td_error(TD_ERR_INTERNAL, "yaml: cannot write the document: %s (%s)", cyaml_strerror(err), msgs.text);
    char *s = realloc(out, n + 1); /* libcyaml's text is not NUL-terminated */
    if (!s) {
        free(out);
        return td_error(TD_ERR_NO_MEMORY, "yaml: no memory");
    }
    s[n] = 0;
    *text = s;
    if (len)
        *len = n;
    return TD_OK;
}
