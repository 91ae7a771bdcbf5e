/* config_doc.c — the config table written out for people (config.h):
 * deploy/tandem.yaml, every key at its default with what it sets as comments,
 * and docs/configuration.md, a table per section. `tandem config` prints
 * them; test_config checks that the shipped files are what this writes, so
 * neither drifts from the table. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "common/config.h"

/* text as comment lines of at most 100 columns, each starting with lead */
static void wrap(FILE *f, const char *lead, const char *text)
{
    size_t width = 100 - strlen(lead), col = 0;
    for (const char *p = text; *p;) {
        size_t word = strcspn(p, " ");
        if (col && col + 1 + word > width) {
            fputc('\n', f);
            col = 0;
        }
        fprintf(f, "%s%.*s", col ? " " : lead, (int)word, p);
        col += (col ? 1 : 0) + word;
        p += word;
        p += strspn(p, " ");
    }
    if (col)
        fputc('\n', f);
}

/* What a key takes, in words: its choices or bounds ("" when any). */
static void values(const td_config_key_t *k, char *out, size_t n)
{
    out[0] = 0;
    if (k->choices) {
        size_t at = (size_t)snprintf(out, n, "one of ");
        for (const char *c = k->choices; *c && at < n; c += strcspn(c, "|"), c += *c == '|')
            at += (size_t)snprintf(out + at, n - at, "%s%.*s", c == k->choices ? "" : ", ", (int)strcspn(c, "|"), c);
    } else if (k->max) {
        snprintf(out, n, "from %llu to %llu", (unsigned long long)k->min, (unsigned long long)k->max);
    } else if (k->min) {
        snprintf(out, n, "at least %llu", (unsigned long long)k->min);
    }
}

static void procs(unsigned p, char *out, size_t n)
{
    static const char *const names[] = {"tandem-router", "the workers", "tandem-kvstore"};
    size_t at = 0, count = 0, seen = 0;
    for (unsigned b = 0; b < 3; b++)
        count += (p >> b) & 1;
    out[0] = 0;
    for (unsigned b = 0; b < 3; b++)
        if (p & (1u << b)) {
            seen++;
            at += (size_t)snprintf(out + at, at < n ? n - at : 0, "%s%s",
                                   seen == 1 ? "" : seen == count ? " and " : ", ", names[b]);
        }
}

/* a YAML scalar for a default: plain where that reads back as the same string */
static void scalar(FILE *f, const td_config_key_t *k)
{
    bool plain = k->def[0] && strspn(k->def, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:,-") ==
                                  strlen(k->def);
    fprintf(f, plain || strcmp(k->type, "string") ? "%s" : "\"%s\"", k->def);
}

/* Key i's section into name when it differs from key i - 1's (a heading is due); false when the same. */
static bool new_section(size_t i, char *name, size_t n)
{
    td_config_key_t k = td_config_key(i), prev = i ? td_config_key(i - 1) : (td_config_key_t){.name = ""};
    size_t len = (size_t)(strchr(k.name, '.') - k.name);
    if (!strncmp(prev.name, k.name, len + 1))
        return false;
    snprintf(name, n, "%.*s", (int)len, k.name);
    return true;
}

void td_config_write_example(FILE *f)
{
    fputs("# tandem.yaml — the config file: how each process is set up, for `tandem up --config\n"
          "# deploy/tandem.yaml` (tandem-router, tandem-prefill, tandem-decode and tandem-kvstore read it with\n"
          "# --config too). What operators decide about the running cluster — worker counts, SLOs, the planner's\n"
          "# policy — is the other file, the ops config (deploy/ops.yaml, applied with `tandem scale`).\n"
          "# Every key is optional; the values below are the defaults. A flag overrides the file's value.\n"
          "# Written by `tandem config` from the key table (common/config.c): change the table, not this file.\n",
          f);
    for (size_t i = 0; i < td_config_key_count(); i++) {
        td_config_key_t k = td_config_key(i);
        char name[32];
        if (new_section(i, name, sizeof name)) {
            fputc('\n', f);
            wrap(f, "# ", td_config_section_doc(name) ? td_config_section_doc(name) : "");
            fprintf(f, "%s:\n", name);
        }
        char text[2048], vals[128], who[96];
        values(&k, vals, sizeof vals);
        procs(k.procs, who, sizeof who);
        size_t at = (size_t)snprintf(text, sizeof text, "%s%s%s", k.doc, k.more ? " — " : "", k.more ? k.more : "");
        if (vals[0] || k.flag)
            snprintf(text + at, sizeof text - at, " (%s%s%s%s%s%s)", vals, vals[0] && k.flag ? "; " : "",
                     k.flag ? "flag " : "", k.flag ? k.flag : "", k.flag ? " of " : "", k.flag ? who : "");
        wrap(f, "  # ", text);
        fprintf(f, "  %s: ", strchr(k.name, '.') + 1);
        scalar(f, &k);
        fputc('\n', f);
    }
}

/* a table cell: '|' would end it */
static void cell(FILE *f, const char *s)
{
    for (; *s; s++)
        if (*s == '|')
            fputs("\\|", f);
        else
            fputc(*s, f);
}

void td_config_write_reference(FILE *f)
{
    fputs("# Configuration reference\n\n"
          "Every key of the config file (`--config FILE`; the shipped example, every key at its default, is\n"
          "`deploy/tandem.yaml`). Every key is optional; a flag overrides the file's value; an unknown key, a\n"
          "value of the wrong type or one out of bounds is refused naming the key (and its line). What operators\n"
          "decide about a running cluster — worker counts, SLOs, the planner's policy — is the ops config\n"
          "(`deploy/ops.yaml`, `tandem scale`), not this file.\n\n"
          "Written by `tandem config --reference` from the key table in `common/config.c`; a test checks that\n"
          "this file is what the table writes.\n",
          f);
    for (size_t i = 0; i < td_config_key_count(); i++) {
        td_config_key_t k = td_config_key(i);
        char name[32];
        if (new_section(i, name, sizeof name)) {
            const char *doc = td_config_section_doc(name);
            fprintf(f, "\n## %s\n\n%s%s| key | type | default | values | flag | what it sets |\n"
                       "|---|---|---|---|---|---|\n", name, doc ? doc : "", doc ? "\n\n" : "");
        }
        char vals[128], who[96];
        values(&k, vals, sizeof vals);
        procs(k.procs, who, sizeof who);
        fprintf(f, "| `%s` | %s | `%s` | %s | ", k.name, k.type, k.def[0] ? k.def : "\"\"", vals);
        if (k.flag)
            fprintf(f, "`%s` (%s)", k.flag, who);
        fputs(" | ", f);
        cell(f, k.doc);
        if (k.more) {
            fputs(" — ", f);
            cell(f, k.more);
        }
        fputs(" |\n", f);
    }
}
