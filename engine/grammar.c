/* grammar.c — see grammar.h.
 *
 * Compilation builds a small syntax tree (byte strings, byte sets, sequences,
 * alternatives, repetitions, rule references) from the source, then lowers it
 * into rules: a rule is its alternatives' elements (a byte set to match, or a
 * rule to enter) separated by ALT and closed by END, all in one array
 * (grammar_int.h). The matcher is grammar_match.c. */
#define _GNU_SOURCE
#include "engine/grammar.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/grow.h"
#include "common/log.h"
#include "engine/grammar_int.h"

#define INF_REP UINT32_MAX
#define MAX_REP 1000      /* a bounded repetition's most */
#define MAX_WS 16         /* whitespace between JSON tokens */
#define MAX_DEPTH 64      /* a schema's nesting */
#define MAX_ELEMS (1u << 20) /* a compiled grammar's elements */

/* ---------------------------------------------------------------- the syntax tree */

enum { N_LIT, N_SET, N_SEQ, N_ALT, N_REP, N_REF };

typedef struct gnode {
    int kind;
    uint8_t set[32];       /* N_SET */
    char *lit;             /* N_LIT */
    size_t n_lit;
    struct gnode **kids;   /* N_SEQ, N_ALT; N_REP: kids[0] */
    size_t n_kids, cap_kids;
    uint32_t min, max;     /* N_REP */
    uint32_t rule;         /* N_REF */
} gnode_t;

/* What compiling holds: the nodes made (freed at the end), the rules' trees. */
typedef struct build {
    gnode_t **all;
    size_t n_all, cap_all;
    gnode_t **rule_tree;
    size_t n_rules, cap_rules;
    bool oom;
    char err[300];
    /* the JSON Schema's root, for $ref, and the rules made for its definitions */
    json_t *root;
    const char **def_names;
    uint32_t *def_rules;
    size_t n_defs, cap_defs;
    uint32_t json_value; /* the rule of any JSON value (0: none yet; rule 0 is the root's) */
    int depth;
} build_t;

static gnode_t *node(build_t *b, int kind)
{
    gnode_t *n = calloc(1, sizeof *n);
    if (!n || !td_grow((void **)&b->all, &b->cap_all, b->n_all + 1, sizeof *b->all, 64)) {
        free(n);
        b->oom = true;
        return NULL;
    }
    b->all[b->n_all++] = n;
    n->kind = kind;
    return n;
}

static gnode_t *add(build_t *b, gnode_t *parent, gnode_t *kid)
{
    if (!parent || !kid)
        return NULL;
    if (!td_grow((void **)&parent->kids, &parent->cap_kids, parent->n_kids + 1, sizeof *parent->kids, 4)) {
        b->oom = true;
        return NULL;
    }
    parent->kids[parent->n_kids++] = kid;
    return parent;
}

static gnode_t *lit(build_t *b, const char *s, size_t n)
{
    gnode_t *x = node(b, N_LIT);
    if (x && !(x->lit = malloc(n ? n : 1))) {
        b->oom = true;
        return NULL;
    }
    if (x) {
        memcpy(x->lit, s, n);
        x->n_lit = n;
    }
    return x;
}

static gnode_t *lits(build_t *b, const char *s) { return lit(b, s, strlen(s)); }

static gnode_t *set_range(build_t *b, uint8_t lo, uint8_t hi)
{
    gnode_t *x = node(b, N_SET);
    for (unsigned c = lo; x && c <= hi; c++)
        x->set[c >> 3] |= (uint8_t)(1u << (c & 7));
    return x;
}

static void set_add(gnode_t *x, unsigned lo, unsigned hi)
{
    for (unsigned c = lo; x && c <= hi; c++)
        x->set[c >> 3] |= (uint8_t)(1u << (c & 7));
}

static gnode_t *seq(build_t *b) { return node(b, N_SEQ); }

static gnode_t *seq2(build_t *b, gnode_t *x, gnode_t *y) { return add(b, add(b, seq(b), x), y); }

static gnode_t *alt(build_t *b) { return node(b, N_ALT); }

static gnode_t *rep(build_t *b, gnode_t *x, uint32_t min, uint32_t max)
{
    gnode_t *r = node(b, N_REP);
    if (!r || !x)
        return NULL;
    r->min = min;
    r->max = max;
    return add(b, r, x);
}

static gnode_t *ref(build_t *b, uint32_t rule)
{
    gnode_t *r = node(b, N_REF);
    if (r)
        r->rule = rule;
    return r;
}

/* A new rule (its tree set later, or now). */
static uint32_t new_rule(build_t *b, gnode_t *tree)
{
    if (!td_grow((void **)&b->rule_tree, &b->cap_rules, b->n_rules + 1, sizeof *b->rule_tree, 16)) {
        b->oom = true;
        return 0;
    }
    b->rule_tree[b->n_rules] = tree;
    return (uint32_t)b->n_rules++;
}

static bool fail(build_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(build_t *b, const char *fmt, ...)
{
    if (!b->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err, sizeof b->err, fmt, ap);
        va_end(ap);
    }
    return false;
}

/* ---------------------------------------------------------------- regular expressions */

typedef struct rx {
    build_t *b;
    const char *s;
    size_t i, n;
} rx_t;

static gnode_t *rx_alt(rx_t *r);

static void utf8_multi(build_t *b, gnode_t *a);

/* One UTF-8 character, any but newline (the regex '.'). */
static gnode_t *any_char(build_t *b)
{
    gnode_t *a = alt(b), *one = set_range(b, 0, 0x7f);
    if (one)
        one->set['\n' >> 3] &= (uint8_t)~(1u << ('\n' & 7));
    add(b, a, one);
    utf8_multi(b, a);
    return a;
}

/* \d \w \s (and their complements, ASCII only) into set x; false if c is none of them. */
static bool class_escape(gnode_t *x, char c)
{
    gnode_t t = {0};
    switch (c | 0x20) {
    case 'd': set_add(&t, '0', '9'); break;
    case 'w': set_add(&t, '0', '9'), set_add(&t, 'a', 'z'), set_add(&t, 'A', 'Z'), set_add(&t, '_', '_'); break;
    case 's': set_add(&t, ' ', ' '), set_add(&t, '\t', '\r'); break;
    default: return false;
    }
    bool neg = c >= 'A' && c <= 'Z';
    for (int i = 0; i < 32; i++)
        x->set[i] |= neg ? (uint8_t)(~t.set[i] & (i < 16 ? 0xff : 0)) : t.set[i];
    return true;
}

static int escape_byte(char c)
{
    switch (c) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return 0;
    default: return (unsigned char)c;
    }
}

static gnode_t *rx_class(rx_t *r)
{
    build_t *b = r->b;
    gnode_t *x = node(b, N_SET);
    bool neg = r->i < r->n && r->s[r->i] == '^';
    r->i += neg;
    bool first = true;
    while (x && r->i < r->n && (r->s[r->i] != ']' || first)) {
        first = false;
        unsigned char c = (unsigned char)r->s[r->i++];
        if (c >= 0x80) {
            fail(b, "regex: a character class with a non-ASCII character (at byte %zu) is not supported", r->i - 1);
            return NULL;
        }
        if (c == '\\' && r->i < r->n) {
            char e = r->s[r->i++];
            if (class_escape(x, e))
                continue;
            c = (unsigned char)escape_byte(e);
        }
        unsigned hi = c;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            hi = (unsigned char)r->s[r->i++];
            if (hi == '\\' && r->i < r->n)
                hi = (unsigned)escape_byte(r->s[r->i++]);
            if (hi < c) {
                fail(b, "regex: the range %c-%c is reversed", c, hi);
                return NULL;
            }
        }
        set_add(x, c, hi);
    }
    if (r->i >= r->n) {
        fail(b, "regex: a character class is not closed with ]");
        return NULL;
    }
    r->i++;
    if (x && neg) /* ASCII complement; non-ASCII bytes allowed (any UTF-8 character outside the class) */
        for (int i = 0; i < 32; i++)
            x->set[i] = (uint8_t)~x->set[i];
    return x;
}

static gnode_t *rx_atom(rx_t *r)
{
    build_t *b = r->b;
    unsigned char c = (unsigned char)r->s[r->i++];
    if (c == '(') {
        if (r->i + 1 < r->n && r->s[r->i] == '?' && r->s[r->i + 1] == ':')
            r->i += 2;
        else if (r->i < r->n && r->s[r->i] == '?') {
            fail(b, "regex: (?%c groups are not supported", r->i + 1 < r->n ? r->s[r->i + 1] : ' ');
            return NULL;
        }
        gnode_t *x = rx_alt(r);
        if (r->i >= r->n || r->s[r->i] != ')') {
            fail(b, "regex: a group is not closed with )");
            return NULL;
        }
        r->i++;
        return x;
    }
    if (c == '[')
        return rx_class(r);
    if (c == '.')
        return any_char(b);
    if (c == '\\') {
        if (r->i >= r->n) {
            fail(b, "regex: it ends with a lone backslash");
            return NULL;
        }
        char e = r->s[r->i++];
        gnode_t *x = node(b, N_SET);
        if (x && class_escape(x, e))
            return x;
        if (strchr("bBAZzkpPux123456789", e)) {
            fail(b, "regex: \\%c is not supported", e);
            return NULL;
        }
        char one = (char)escape_byte(e);
        return lit(b, &one, 1);
    }
    if (c == ')' || c == '*' || c == '+' || c == '?' || c == '{') {
        fail(b, "regex: '%c' at byte %zu has nothing before it to apply to", c, r->i - 1);
        return NULL;
    }
    /* a whole UTF-8 character is one atom (a quantifier after it repeats all of it) */
    size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : 4;
    size_t at = r->i - 1;
    r->i = at + len <= r->n ? at + len : r->n;
    return lit(b, r->s + at, r->i - at);
}

static bool rx_number(rx_t *r, uint32_t *v)
{
    if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9')
        return false;
    unsigned long x = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9' && x <= MAX_REP)
        x = x * 10 + (unsigned long)(r->s[r->i++] - '0');
    *v = (uint32_t)x;
    return true;
}

static gnode_t *rx_seq(rx_t *r)
{
    build_t *b = r->b;
    gnode_t *s = seq(b);
    while (s && r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')') {
        if ((r->s[r->i] == '^' && r->i == 0) || (r->s[r->i] == '$' && r->i + 1 == r->n)) {
            r->i++; /* the whole text matches: anchors at the ends say nothing more */
            continue;
        }
        gnode_t *a = rx_atom(r);
        if (!a)
            return NULL;
        while (r->i < r->n && strchr("*+?{", r->s[r->i])) {
            char q = r->s[r->i++];
            uint32_t lo = 0, hi = INF_REP;
            if (q == '+')
                lo = 1;
            else if (q == '?')
                hi = 1;
            else if (q == '{') {
                if (!rx_number(r, &lo)) {
                    fail(b, "regex: '{' at byte %zu is not a repetition {m}, {m,} or {m,n}", r->i - 1);
                    return NULL;
                }
                hi = lo;
                if (r->i < r->n && r->s[r->i] == ',') {
                    r->i++;
                    if (!rx_number(r, &hi))
                        hi = INF_REP;
                }
                if (r->i >= r->n || r->s[r->i] != '}' || hi < lo || lo > MAX_REP || (hi != INF_REP && hi > MAX_REP)) {
                    fail(b, "regex: a repetition {m,n} needs m <= n <= %d and a closing }", MAX_REP);
                    return NULL;
                }
                r->i++;
            }
            if (r->i < r->n && r->s[r->i] == '?') /* lazy or greedy: the same set of texts */
                r->i++;
            a = rep(b, a, lo, hi);
        }
        add(b, s, a);
    }
    return s;
}

static gnode_t *rx_alt(rx_t *r)
{
    gnode_t *first = rx_seq(r);
    if (!first || r->i >= r->n || r->s[r->i] != '|')
        return first;
    gnode_t *a = add(r->b, alt(r->b), first);
    while (a && r->i < r->n && r->s[r->i] == '|') {
        r->i++;
        gnode_t *s = rx_seq(r);
        if (!s)
            return NULL;
        add(r->b, a, s);
    }
    return a;
}

static gnode_t *regex(build_t *b, const char *s)
{
    rx_t r = {b, s, 0, strlen(s)};
    gnode_t *x = rx_alt(&r);
    if (x && r.i < r.n) {
        fail(b, "regex: an unmatched ')' at byte %zu", r.i);
        return NULL;
    }
    return x;
}

/* ---------------------------------------------------------------- JSON */

static gnode_t *ws(build_t *b)
{
    gnode_t *w = set_range(b, ' ', ' ');
    set_add(w, '\t', '\t');
    set_add(w, '\n', '\n');
    return rep(b, w, 0, MAX_WS);
}

/* UTF-8 characters of 2 to 4 bytes, as alternatives added to a */
static void utf8_multi(build_t *b, gnode_t *a)
{
    static const uint8_t lead_lo[] = {0, 0xc2, 0xe0, 0xf0}, lead_hi[] = {0, 0xdf, 0xef, 0xf4};
    for (int k = 1; k <= 3; k++) {
        gnode_t *s = add(b, seq(b), set_range(b, lead_lo[k], lead_hi[k]));
        for (int j = 0; j < k; j++)
            add(b, s, set_range(b, 0x80, 0xbf));
        add(b, a, s);
    }
}

/* a string's characters: any whole UTF-8 character but a quote, a backslash or a control character, or an
 * escape */
static gnode_t *json_char(build_t *b)
{
    gnode_t *plain = set_range(b, 0x20, 0x7e);
    if (plain) {
        plain->set['"' >> 3] &= (uint8_t)~(1u << ('"' & 7));
        plain->set['\\' >> 3] &= (uint8_t)~(1u << ('\\' & 7));
    }
    gnode_t *esc = node(b, N_SET);
    for (const char *p = "\"\\/bfnrt"; *p; p++)
        set_add(esc, (unsigned char)*p, (unsigned char)*p);
    gnode_t *hex = set_range(b, '0', '9');
    set_add(hex, 'a', 'f');
    set_add(hex, 'A', 'F');
    gnode_t *u = seq2(b, lits(b, "u"), rep(b, hex, 4, 4));
    gnode_t *e = seq2(b, lits(b, "\\"), add(b, add(b, alt(b), esc), u));
    gnode_t *a = add(b, add(b, alt(b), plain), e);
    utf8_multi(b, a);
    return a;
}

static gnode_t *jstring(build_t *b, uint32_t min, uint32_t max)
{
    return add(b, seq2(b, lits(b, "\""), rep(b, json_char(b), min, max)), lits(b, "\""));
}

static gnode_t *json_number(build_t *b, bool integer)
{
    gnode_t *digit = set_range(b, '0', '9');
    gnode_t *intpart = add(b, add(b, alt(b), lits(b, "0")), seq2(b, set_range(b, '1', '9'), rep(b, digit, 0, 18)));
    gnode_t *n = seq2(b, rep(b, lits(b, "-"), 0, 1), intpart);
    if (integer)
        return n;
    gnode_t *frac = seq2(b, lits(b, "."), rep(b, set_range(b, '0', '9'), 1, 16));
    gnode_t *e = set_range(b, 'e', 'e');
    set_add(e, 'E', 'E');
    gnode_t *sign = set_range(b, '+', '+');
    set_add(sign, '-', '-');
    gnode_t *exp = add(b, seq2(b, e, rep(b, sign, 0, 1)), rep(b, set_range(b, '0', '9'), 1, 3));
    return add(b, add(b, n, rep(b, frac, 0, 1)), rep(b, exp, 0, 1));
}

/* [ item (, item)* ] with min..max items */
static gnode_t *jarray(build_t *b, gnode_t *item, uint32_t min, uint32_t max)
{
    gnode_t *more = add(b, add(b, add(b, seq(b), ws(b)), lits(b, ",")), ws(b));
    add(b, more, item);
    gnode_t *body = seq2(b, item, rep(b, more, min ? min - 1 : 0, max == INF_REP ? INF_REP : max ? max - 1 : 0));
    gnode_t *a = add(b, add(b, seq(b), lits(b, "[")), ws(b));
    if (max == 0)
        return add(b, a, lits(b, "]"));
    add(b, a, min ? body : rep(b, body, 0, 1));
    return add(b, add(b, a, ws(b)), lits(b, "]"));
}

/* { "key": value (, "key": value)* } with any keys and values of schema `value` */
static gnode_t *json_object_any(build_t *b, gnode_t *value)
{
    gnode_t *member = add(b, add(b, add(b, add(b, seq(b), jstring(b, 0, INF_REP)), ws(b)), lits(b, ":")), ws(b));
    add(b, member, value);
    gnode_t *more = add(b, add(b, add(b, seq(b), ws(b)), lits(b, ",")), ws(b));
    add(b, more, member);
    gnode_t *body = seq2(b, member, rep(b, more, 0, INF_REP));
    gnode_t *o = add(b, add(b, seq(b), lits(b, "{")), ws(b));
    return add(b, add(b, add(b, o, rep(b, body, 0, 1)), ws(b)), lits(b, "}"));
}

/* Any JSON value: one rule (recursive), made once. */
static gnode_t *json_any(build_t *b)
{
    if (!b->json_value) {
        b->json_value = new_rule(b, NULL);
        gnode_t *v = alt(b), *any = ref(b, b->json_value);
        add(b, v, json_object_any(b, any));
        add(b, v, jarray(b, any, 0, INF_REP));
        add(b, v, jstring(b, 0, INF_REP));
        add(b, v, json_number(b, false));
        add(b, v, lits(b, "true"));
        add(b, v, lits(b, "false"));
        add(b, v, lits(b, "null"));
        if (b->json_value < b->n_rules)
            b->rule_tree[b->json_value] = v;
    }
    return ref(b, b->json_value);
}

static gnode_t *schema(build_t *b, json_t *s);

static bool get_count(build_t *b, json_t *s, const char *k, uint32_t *v)
{
    json_t *j = json_object_get(s, k);
    if (!j)
        return true;
    if (!json_is_integer(j) || json_integer_value(j) < 0 || json_integer_value(j) > MAX_REP)
        return fail(b, "json_schema: %s must be an integer from 0 to %d", k, MAX_REP);
    *v = (uint32_t)json_integer_value(j);
    return true;
}

/* the literal JSON text of a value (enum, const) */
static gnode_t *json_literal(build_t *b, json_t *v)
{
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) {
        b->oom = true;
        return NULL;
    }
    gnode_t *x = lits(b, t);
    free(t);
    return x;
}

static gnode_t *schema_ref(build_t *b, const char *r)
{
    const char *name = !strncmp(r, "#/$defs/", 8) ? r + 8 : !strncmp(r, "#/definitions/", 14) ? r + 14 : NULL;
    json_t *defs = json_object_get(b->root, r[2] == '$' ? "$defs" : "definitions");
    json_t *d = name ? json_object_get(defs, name) : NULL;
    if (!d) {
        fail(b, "json_schema: $ref '%.100s' is not one of #/$defs or #/definitions", r);
        return NULL;
    }
    for (size_t i = 0; i < b->n_defs; i++)
        if (!strcmp(b->def_names[i], name))
            return ref(b, b->def_rules[i]);
    if (!td_grow((void **)&b->def_names, &b->cap_defs, b->n_defs + 1, sizeof *b->def_names, 8) ||
        !(b->def_rules = realloc(b->def_rules, b->cap_defs * sizeof *b->def_rules))) {
        b->oom = true;
        return NULL;
    }
    uint32_t rule = new_rule(b, NULL); /* made before its body, so that it may refer to itself */
    b->def_names[b->n_defs] = name;
    b->def_rules[b->n_defs++] = rule;
    gnode_t *body = schema(b, d);
    if (!body)
        return NULL;
    b->rule_tree[rule] = body;
    return ref(b, rule);
}

static gnode_t *schema_type(build_t *b, json_t *s, const char *type)
{
    if (!strcmp(type, "string")) {
        json_t *p = json_object_get(s, "pattern");
        if (p) {
            if (!json_is_string(p)) {
                fail(b, "json_schema: pattern must be a string");
                return NULL;
            }
            gnode_t *x = regex(b, json_string_value(p));
            return x ? add(b, seq2(b, lits(b, "\""), x), lits(b, "\"")) : NULL;
        }
        uint32_t min = 0, max = INF_REP;
        if (!get_count(b, s, "minLength", &min) || !get_count(b, s, "maxLength", &max))
            return NULL;
        return jstring(b, min, max);
    }
    if (!strcmp(type, "integer") || !strcmp(type, "number"))
        return json_number(b, type[0] == 'i');
    if (!strcmp(type, "boolean"))
        return add(b, add(b, alt(b), lits(b, "true")), lits(b, "false"));
    if (!strcmp(type, "null"))
        return lits(b, "null");
    if (!strcmp(type, "array")) {
        json_t *items = json_object_get(s, "items");
        uint32_t min = 0, max = INF_REP;
        if (!get_count(b, s, "minItems", &min) || !get_count(b, s, "maxItems", &max))
            return NULL;
        if (max < min) {
            fail(b, "json_schema: maxItems is below minItems");
            return NULL;
        }
        gnode_t *item = items ? schema(b, items) : json_any(b);
        return item ? jarray(b, item, min, max) : NULL;
    }
    if (!strcmp(type, "object")) {
        json_t *props = json_object_get(s, "properties"), *extra = json_object_get(s, "additionalProperties");
        if (!json_object_size(props)) {
            if (json_is_false(extra))
                return lits(b, "{}");
            gnode_t *v = json_is_object(extra) ? schema(b, extra) : json_any(b);
            return v ? json_object_any(b, v) : NULL;
        }
        gnode_t *o = add(b, add(b, seq(b), lits(b, "{")), ws(b));
        const char *k;
        json_t *v;
        bool first = true;
        /* the properties in the schema's order (jansson keeps it), each present */
        json_object_foreach(props, k, v)
        {
            if (!first)
                add(b, add(b, add(b, o, ws(b)), lits(b, ",")), ws(b));
            first = false;
            json_t *key = json_string(k);
            gnode_t *kl = key ? json_literal(b, key) : NULL;
            json_decref(key);
            gnode_t *val = schema(b, v);
            if (!kl || !val)
                return NULL;
            add(b, add(b, add(b, add(b, add(b, o, kl), ws(b)), lits(b, ":")), ws(b)), val);
        }
        return add(b, add(b, o, ws(b)), lits(b, "}"));
    }
    fail(b, "json_schema: type '%.40s' is not one of string, number, integer, boolean, null, array, object", type);
    return NULL;
}

enum { ALT_LITERAL, ALT_SCHEMA, ALT_TYPE };

/* One alternative for each item of array j (schema s's `key`): the item's JSON text (enum), a schema of its own
 * (anyOf, oneOf) or a type name (a list of types). */
static gnode_t *alt_of(build_t *b, json_t *s, json_t *j, const char *key, int as)
{
    if (!json_is_array(j) || !json_array_size(j)) {
        fail(b, "json_schema: %s must be a non-empty array", key);
        return NULL;
    }
    gnode_t *x = alt(b);
    size_t i;
    json_t *v;
    json_array_foreach(j, i, v)
    {
        gnode_t *o = as == ALT_LITERAL  ? json_literal(b, v)
                     : as == ALT_SCHEMA ? schema(b, v)
                     : json_is_string(v) ? schema_type(b, s, json_string_value(v))
                                         : NULL;
        if (!o) {
            if (as == ALT_TYPE && !json_is_string(v))
                fail(b, "json_schema: type must be a string or an array of strings");
            return NULL;
        }
        add(b, x, o);
    }
    return x;
}

static gnode_t *schema_body(build_t *b, json_t *s)
{
    static const char *const refused[] = {"allOf", "not", "if", "then", "else", "patternProperties",
                                          "dependentSchemas", "prefixItems", "contains", "uniqueItems",
                                          "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                          "multipleOf", "minProperties", "maxProperties", "propertyNames"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
        if (json_object_get(s, refused[i])) {
            fail(b, "json_schema: %s is not supported", refused[i]);
            return NULL;
        }
    json_t *j;
    if ((j = json_object_get(s, "$ref"))) {
        if (json_is_string(j))
            return schema_ref(b, json_string_value(j));
        fail(b, "json_schema: $ref must be a string");
        return NULL;
    }
    if ((j = json_object_get(s, "const")))
        return json_literal(b, j);
    if ((j = json_object_get(s, "enum")))
        return alt_of(b, s, j, "enum", ALT_LITERAL);
    if ((j = json_object_get(s, "anyOf")) || (j = json_object_get(s, "oneOf")))
        return alt_of(b, s, j, "anyOf / oneOf", ALT_SCHEMA);
    if ((j = json_object_get(s, "type")))
        return json_is_string(j) ? schema_type(b, s, json_string_value(j)) : alt_of(b, s, j, "type", ALT_TYPE);
    if (json_object_get(s, "properties"))
        return schema_type(b, s, "object");
    if (json_object_get(s, "items"))
        return schema_type(b, s, "array");
    return json_any(b);
}

static gnode_t *schema(build_t *b, json_t *s)
{
    if (json_is_true(s))
        return json_any(b);
    if (!json_is_object(s)) {
        fail(b, "json_schema: a schema must be an object or true");
        return NULL;
    }
    if (b->depth >= MAX_DEPTH) {
        fail(b, "json_schema: nested deeper than %d", MAX_DEPTH);
        return NULL;
    }
    b->depth++;
    gnode_t *x = schema_body(b, s);
    b->depth--;
    return x;
}

/* ---------------------------------------------------------------- lowering */

static bool emit(eng_grammar_t *g, uint8_t kind, uint32_t v)
{
    if (g->n_el >= MAX_ELEMS || !td_grow((void **)&g->el, &g->cap_el, g->n_el + 1, sizeof *g->el, 256))
        return false;
    g->el[g->n_el++] = (elem_t){kind, v};
    return true;
}

static bool emit_set(eng_grammar_t *g, const uint8_t set[32])
{
    size_t i = 0;
    while (i < g->n_sets && memcmp(g->sets[i], set, 32))
        i++;
    if (i == g->n_sets) {
        if (!td_grow((void **)&g->sets, &g->cap_sets, g->n_sets + 1, 32, 32))
            return false;
        memcpy(g->sets[g->n_sets++], set, 32);
    }
    return emit(g, E_SET, (uint32_t)i);
}

/* x's elements appended to the alternative being written (new rules for
 * nested alternatives and repetitions). */
static bool lower_seq(build_t *b, eng_grammar_t *g, gnode_t *x)
{
    if (!x)
        return false;
    switch (x->kind) {
    case N_LIT:
        for (size_t i = 0; i < x->n_lit; i++) {
            uint8_t s[32] = {0};
            uint8_t c = (uint8_t)x->lit[i];
            s[c >> 3] = (uint8_t)(1u << (c & 7));
            if (!emit_set(g, s))
                return false;
        }
        return true;
    case N_SET:
        return emit_set(g, x->set);
    case N_SEQ:
        for (size_t i = 0; i < x->n_kids; i++)
            if (!lower_seq(b, g, x->kids[i]))
                return false;
        return true;
    case N_ALT:
        if (x->n_kids == 1)
            return lower_seq(b, g, x->kids[0]);
        return emit(g, E_REF, new_rule(b, x)) && !b->oom;
    case N_REF:
        return emit(g, E_REF, x->rule);
    case N_REP: {
        /* a repeated part larger than a byte is a rule of its own, entered each time (its copies would multiply
         * with the nesting: (a+)+...) */
        gnode_t *kid = x->kids[0];
        if (kid->kind != N_SET && kid->kind != N_REF && !(kid->kind == N_LIT && kid->n_lit <= 1)) {
            uint32_t r = new_rule(b, kid);
            if (b->oom || !(kid = ref(b, r)))
                return false;
            x->kids[0] = kid; /* the next lowering of x (a shared subtree) enters the same rule */
        }
        for (uint32_t i = 0; i < x->min; i++)
            if (!lower_seq(b, g, kid))
                return false;
        if (x->max == x->min)
            return true;
        /* the optional rest: R ::= kid R | ε (unbounded), or k nested optionals */
        uint32_t k = x->max == INF_REP ? 1 : x->max - x->min, inner = 0;
        for (uint32_t i = 0; i < k; i++) {
            uint32_t r = new_rule(b, NULL);
            gnode_t *more = seq(b);
            add(b, more, kid);
            if (x->max == INF_REP)
                add(b, more, ref(b, r));
            else if (i)
                add(b, more, ref(b, inner));
            gnode_t *a = add(b, add(b, alt(b), more), seq(b));
            if (b->oom)
                return false;
            b->rule_tree[r] = a;
            inner = r;
        }
        return emit(g, E_REF, inner);
    }
    }
    return false;
}

static bool lower(build_t *b, eng_grammar_t *g)
{
    for (size_t r = 0; r < b->n_rules; r++) { /* lowering adds rules; they are lowered in turn */
        if (!td_grow((void **)&g->rule_at, &g->n_rules, r + 1, sizeof *g->rule_at, 16))
            return false;
        g->rule_at[r] = (uint32_t)g->n_el;
        gnode_t *t = b->rule_tree[r];
        if (!t)
            return false;
        if (t->kind == N_ALT) {
            for (size_t i = 0; i < t->n_kids; i++)
                if ((i && !emit(g, E_ALT, 0)) || !lower_seq(b, g, t->kids[i]))
                    return false;
        } else if (!lower_seq(b, g, t)) {
            return false;
        }
        if (!emit(g, E_END, 0))
            return false;
    }
    g->n_rules = b->n_rules;
    return true;
}

td_status_t eng_grammar_compile(eng_grammar_kind_t kind, const char *src, const char *const *choices,
                                size_t n_choices, eng_grammar_t **out)
{
    *out = NULL;
    build_t b = {0};
    new_rule(&b, NULL); /* rule 0: the text */
    gnode_t *top = NULL;
    json_t *js = NULL;
    switch (kind) {
    case ENG_GRAMMAR_JSON_SCHEMA: {
        json_error_t je;
        js = json_loads(src ? src : "", JSON_DECODE_ANY, &je);
        if (!js)
            fail(&b, "json_schema: not JSON: %s (line %d, column %d)", je.text, je.line, je.column);
        b.root = js;
        top = js ? schema(&b, js) : NULL;
        break;
    }
    case ENG_GRAMMAR_JSON_OBJECT:
        top = json_object_any(&b, json_any(&b));
        break;
    case ENG_GRAMMAR_REGEX:
        top = regex(&b, src ? src : "");
        break;
    case ENG_GRAMMAR_CHOICE:
        if (!n_choices)
            fail(&b, "choice: no strings to choose from");
        top = n_choices ? alt(&b) : NULL;
        for (size_t i = 0; top && i < n_choices; i++) {
            if (!choices[i][0]) {
                fail(&b, "choice: string %zu is empty", i);
                top = NULL;
                break;
            }
            add(&b, top, lits(&b, choices[i]));
        }
        break;
    default:
        fail(&b, "structured output: unknown kind %d", (int)kind);
    }
    td_status_t rc = TD_OK;
    eng_grammar_t *g = calloc(1, sizeof *g);
    if (top && g && !b.oom) {
        b.rule_tree[0] = top;
        if (!lower(&b, g) || b.oom)
            rc = g->n_el >= MAX_ELEMS ? td_user_error("structured output: more than %u grammar elements "
                                                      "(repetition counts multiply)", MAX_ELEMS)
                                      : td_error(TD_ERR_NO_MEMORY, "structured output: no memory to compile");
    } else if (!g || b.oom) {
        rc = td_error(TD_ERR_NO_MEMORY, "structured output: no memory to compile");
    } else {
        rc = td_user_error("%s", b.err[0] ? b.err : "structured output: cannot compile");
    }
    for (size_t i = 0; i < b.n_all; i++) {
        free(b.all[i]->lit);
        free(b.all[i]->kids);
        free(b.all[i]);
    }
    free(b.all);
    free(b.rule_tree);
    free(b.def_names);
    free(b.def_rules);
    json_decref(js);
    if (rc) {
        eng_grammar_free(g);
        return rc;
    }
    *out = g;
    return TD_OK;
}

void eng_grammar_free(eng_grammar_t *g)
{
    if (!g)
        return;
    for (int i = 0; i < GRAMMAR_MASKS; i++) {
        free(g->masks[i].sig);
        free(g->masks[i].bits);
    }
    free(g->el);
    free(g->rule_at);
    free(g->sets);
    free(g);
}

size_t eng_grammar_size(const eng_grammar_t *g) { return g->n_el; }
