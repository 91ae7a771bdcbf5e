/* pretok.c — see pretok.h. */
#define _GNU_SOURCE /* memmem */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/pretok.h"

#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/log.h"

#define PRETOK_MAX_STEPS 16

typedef struct pretok_norm {
    eng_norm_kind_t kind;
    char *arg, *arg2;
} pretok_norm_t;

typedef struct pretok_step {
    pcre2_code *re;  /* NULL: literal split */
    char *literal;
    eng_split_behavior_t behavior;
    bool invert;
} pretok_step_t;

struct eng_pretok {
    pretok_norm_t norms[PRETOK_MAX_STEPS];
    size_t n_norms;
    pretok_step_t steps[PRETOK_MAX_STEPS];
    size_t n_steps;
    /* Read-only once built: any number of threads split text with one
     * pre-tokenizer at once (each call has its own match data). */
};

/* The pre-tokenizer regexes of GGUF `tokenizer.ggml.pre` names, as llama.cpp
 * and the models' original tokenizer.json files define them. */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define RE_LLAMA3                                                                                      \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                    \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

static const struct {
    const char *name;
    const char *re[2];
} gguf_pre_table[] = {
    {"default", {RE_GPT2, NULL}},   {"gpt-2", {RE_GPT2, NULL}},       {"gpt2", {RE_GPT2, NULL}},
    {"mpt", {RE_GPT2, NULL}},       {"olmo", {RE_GPT2, NULL}},        {"jais", {RE_GPT2, NULL}},
    {"smollm", {"\\p{N}", RE_GPT2}}, {"starcoder", {"\\p{N}", RE_GPT2}}, {"refact", {"\\p{N}", RE_GPT2}},
    {"codeshell", {"\\p{N}", RE_GPT2}}, {"llama3", {RE_LLAMA3, NULL}}, {"llama-v3", {RE_LLAMA3, NULL}},
    {"llama-bpe", {RE_LLAMA3, NULL}}, {"falcon3", {RE_LLAMA3, NULL}},  {"qwen2", {RE_QWEN2, NULL}},
    {"deepseek-r1-qwen", {RE_QWEN2, NULL}},
};

td_status_t eng_pretok_create(eng_pretok_t **out)
{
    eng_pretok_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_error(TD_ERR_NO_MEMORY, "pretok: no memory");
    *out = p;
    return TD_OK;
}

void eng_pretok_destroy(eng_pretok_t *p)
{
    if (!p)
        return;
    for (size_t i = 0; i < p->n_norms; i++) {
        free(p->norms[i].arg);
        free(p->norms[i].arg2);
    }
    for (size_t i = 0; i < p->n_steps; i++) {
        pcre2_code_free(p->steps[i].re);
        free(p->steps[i].literal);
    }
    free(p);
}

td_status_t eng_pretok_add_norm(eng_pretok_t *p, eng_norm_kind_t kind, const char *arg, const char *arg2)
{
    if (p->n_norms == PRETOK_MAX_STEPS)
        return td_error(TD_ERR_UNSUPPORTED, "pretok: more than %d normalizers", PRETOK_MAX_STEPS);
    pretok_norm_t *n = &p->norms[p->n_norms];
    n->kind = kind;
    n->arg = arg ? strdup(arg) : NULL;
    n->arg2 = arg2 ? strdup(arg2) : NULL;
    if ((arg && !n->arg) || (arg2 && !n->arg2))
        return td_error(TD_ERR_NO_MEMORY, "pretok: no memory");
    if ((kind == ENG_NORM_PREPEND || kind == ENG_NORM_PREPEND_ONCE || kind == ENG_NORM_REPLACE) &&
        (!n->arg || !n->arg[0]))
        return td_error(TD_ERR_FORMAT, "pretok: a prepend/replace normalizer needs a non-empty string");
    p->n_norms++;
    return TD_OK;
}

td_status_t eng_pretok_add_split(eng_pretok_t *p, const char *pattern, eng_split_behavior_t behavior, bool invert)
{
    if (p->n_steps == PRETOK_MAX_STEPS)
        return td_error(TD_ERR_UNSUPPORTED, "pretok: more than %d split steps", PRETOK_MAX_STEPS);
    int err;
    PCRE2_SIZE erroff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                                   &erroff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        return td_error(TD_ERR_FORMAT, "pretok: regex /%s/ does not compile at offset %zu: %s", pattern,
                        (size_t)erroff, (char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort: falls back to the interpreter */
    p->steps[p->n_steps++] = (pretok_step_t){.re = re, .behavior = behavior, .invert = invert};
    return TD_OK;
}

td_status_t eng_pretok_add_split_literal(eng_pretok_t *p, const char *literal, eng_split_behavior_t behavior)
{
    if (p->n_steps == PRETOK_MAX_STEPS)
        return td_error(TD_ERR_UNSUPPORTED, "pretok: more than %d split steps", PRETOK_MAX_STEPS);
    if (!literal[0])
        return td_error(TD_ERR_FORMAT, "pretok: empty split string");
    char *copy = strdup(literal);
    if (!copy)
        return td_error(TD_ERR_NO_MEMORY, "pretok: no memory");
    p->steps[p->n_steps++] = (pretok_step_t){.literal = copy, .behavior = behavior};
    return TD_OK;
}

td_status_t eng_pretok_add_gguf_pre(eng_pretok_t *p, const char *pre_name)
{
    for (size_t i = 0; i < sizeof gguf_pre_table / sizeof gguf_pre_table[0]; i++) {
        if (strcmp(gguf_pre_table[i].name, pre_name) != 0)
            continue;
        for (int k = 0; k < 2 && gguf_pre_table[i].re[k]; k++) {
            td_status_t rc = eng_pretok_add_split(p, gguf_pre_table[i].re[k], ENG_SPLIT_ISOLATED, false);
            if (rc)
                return rc;
        }
        return TD_OK;
    }
    return td_error(TD_ERR_UNSUPPORTED, "tokenizer.ggml.pre '%s' is not a pre-tokenizer tandem knows", pre_name);
}

td_status_t eng_pretok_add_byte_level(eng_pretok_t *p)
{
    return eng_pretok_add_split(p, RE_GPT2, ENG_SPLIT_ISOLATED, false);
}

void eng_pretok_describe(const eng_pretok_t *p, char *buf, size_t cap)
{
    static const char *const norm_names[] = {"nfc", "nfd", "nfkc", "nfkd", "lowercase", "prepend", "replace",
                                              "prepend"};
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < p->n_norms && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s", at ? " " : "", norm_names[p->norms[i].kind]);
    for (size_t i = 0; i < p->n_steps && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%ssplit(%s)", at ? " " : "",
                               p->steps[i].re ? "regex" : "literal");
    if (!at && cap)
        snprintf(buf, cap, "none");
}

size_t eng_utf8_valid_len(const unsigned char *s, size_t n)
{
    if (!n)
        return 0;
    unsigned char c = s[0];
    if (c < 0x80)
        return 1;
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf)
        len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
    } else {
        return 0;
    }
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xbf)
            return 0;
    return len;
}

size_t eng_utf8_partial_len(const unsigned char *s, size_t n)
{
    if (!n)
        return 0;
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    size_t len;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) { len = 3; if (c == 0xe0) lo = 0xa0; if (c == 0xed) hi = 0x9f; }
    else if (c >= 0xf0 && c <= 0xf4) { len = 4; if (c == 0xf0) lo = 0x90; if (c == 0xf4) hi = 0x8f; }
    else return 0;
    size_t i = 1;
    if (i < n && s[i] >= lo && s[i] <= hi) {
        i++;
        while (i < len && i < n && s[i] >= 0x80 && s[i] <= 0xbf)
            i++;
    }
    return i < len ? i : 0;
}

char *eng_utf8_sanitize(const char *text, size_t len, size_t *out_len)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    while (i < len) {
        size_t k = eng_utf8_valid_len(s + i, len - i);
        if (!k)
            break;
        i += k;
    }
    if (i == len)
        return NULL;
    char *out = malloc(len * 3 + 1); /* each bad byte becomes at most 3 */
    if (!out)
        return NULL;
    memcpy(out, text, i);
    size_t o = i;
    while (i < len) {
        size_t k = eng_utf8_valid_len(s + i, len - i);
        if (k) {
            memcpy(out + o, s + i, k);
            o += k, i += k;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            size_t bad = eng_utf8_partial_len(s + i, len - i);
            i += bad ? bad : 1;
        }
    }
    out[o] = '\0';
    *out_len = o;
    return out;
}

/* ---- normalization ---- */

static td_status_t norm_unicode(eng_norm_kind_t kind, char **buf, size_t *len)
{
    utf8proc_option_t opt = UTF8PROC_STABLE;
    switch (kind) {
    case ENG_NORM_NFC: opt |= UTF8PROC_COMPOSE; break;
    case ENG_NORM_NFD: opt |= UTF8PROC_DECOMPOSE; break;
    case ENG_NORM_NFKC: opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case ENG_NORM_NFKD: opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    default: break;
    }
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)*buf, (utf8proc_ssize_t)*len, &dst, opt);
    if (n < 0)
        return td_user_error("normalize: %s", utf8proc_errmsg(n));
    free(*buf);
    *buf = (char *)dst;
    *len = (size_t)n;
    return TD_OK;
}

/* Unicode's Cased and Case_Ignorable properties, closely enough for the
 * final-sigma rule (Hugging Face lowercases with Rust's str::to_lowercase). */
static bool cp_cased(utf8proc_int32_t c)
{
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

static bool cp_case_ignorable(utf8proc_int32_t c)
{
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_ME || k == UTF8PROC_CATEGORY_CF ||
           k == UTF8PROC_CATEGORY_LM || k == UTF8PROC_CATEGORY_SK || c == '\'' || c == '.' || c == ':' ||
           c == 0xb7 || c == 0x2019;
}

/* Full lowercase: the simple mapping, plus SpecialCasing's unconditional
 * U+0130 -> "i\u0307" and the final sigma (capital sigma at the end of a word
 * -> U+03C2). */
static td_status_t norm_lower(char **buf, size_t *len)
{
    size_t n = 0, i = 0;
    utf8proc_int32_t *cps = malloc((*len + 1) * sizeof *cps);
    char *out = malloc(*len * 2 + 8);
    if (!cps || !out) {
        free(cps);
        free(out);
        return td_error(TD_ERR_NO_MEMORY, "normalize: no memory");
    }
    while (i < *len) {
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)*buf + i, (utf8proc_ssize_t)(*len - i), &cps[n]);
        if (k <= 0) {
            free(cps);
            free(out);
            return td_user_error("normalize: invalid UTF-8 at byte %zu", i);
        }
        i += (size_t)k;
        n++;
    }
    size_t o = 0;
    for (size_t j = 0; j < n; j++) {
        utf8proc_int32_t c = cps[j];
        if (c == 0x130) {
            o += (size_t)utf8proc_encode_char('i', (utf8proc_uint8_t *)out + o);
            o += (size_t)utf8proc_encode_char(0x307, (utf8proc_uint8_t *)out + o);
            continue;
        }
        if (c == 0x3a3) {
            size_t b = j, a = j + 1;
            while (b > 0 && cp_case_ignorable(cps[b - 1]))
                b--;
            while (a < n && cp_case_ignorable(cps[a]))
                a++;
            bool final = b > 0 && cp_cased(cps[b - 1]) && !(a < n && cp_cased(cps[a]));
            o += (size_t)utf8proc_encode_char(final ? 0x3c2 : 0x3c3, (utf8proc_uint8_t *)out + o);
            continue;
        }
        o += (size_t)utf8proc_encode_char(utf8proc_tolower(c), (utf8proc_uint8_t *)out + o);
    }
    free(cps);
    free(*buf);
    *buf = out;
    *len = o;
    return TD_OK;
}

static td_status_t norm_replace(const char *from, const char *to, char **buf, size_t *len)
{
    size_t fl = strlen(from), tl = to ? strlen(to) : 0, count = 0;
    for (const char *p = *buf; (p = memmem(p, *len - (size_t)(p - *buf), from, fl)); p += fl)
        count++;
    if (!count)
        return TD_OK;
    size_t nl = *len + count * tl - count * fl;
    char *out = malloc(nl + 1);
    if (!out)
        return td_error(TD_ERR_NO_MEMORY, "normalize: no memory");
    const char *p = *buf, *end = *buf + *len;
    char *o = out;
    const char *q;
    while ((q = memmem(p, (size_t)(end - p), from, fl))) {
        memcpy(o, p, (size_t)(q - p));
        o += q - p;
        memcpy(o, to, tl);
        o += tl;
        p = q + fl;
    }
    memcpy(o, p, (size_t)(end - p));
    o += end - p;
    *o = '\0';
    free(*buf);
    *buf = out;
    *len = nl;
    return TD_OK;
}

td_status_t eng_pretok_normalize(const eng_pretok_t *p, const char *text, size_t len, char **out, size_t *out_len)
{
    char *buf = malloc(len + 1);
    if (!buf)
        return td_error(TD_ERR_NO_MEMORY, "normalize: no memory for %zu bytes", len);
    memcpy(buf, text, len);
    buf[len] = '\0';
    td_status_t rc = TD_OK;
    for (size_t i = 0; i < p->n_norms && !rc; i++) {
        const pretok_norm_t *n = &p->norms[i];
        switch (n->kind) {
        case ENG_NORM_NFC: case ENG_NORM_NFD: case ENG_NORM_NFKC: case ENG_NORM_NFKD:
            if (len)
                rc = norm_unicode(n->kind, &buf, &len);
            break;
        case ENG_NORM_LOWERCASE: rc = norm_lower(&buf, &len); break;
        case ENG_NORM_REPLACE: rc = norm_replace(n->arg, n->arg2, &buf, &len); break;
        case ENG_NORM_PREPEND:
        case ENG_NORM_PREPEND_ONCE:
            if (len && !(n->kind == ENG_NORM_PREPEND_ONCE && len >= strlen(n->arg) &&
                         memcmp(buf, n->arg, strlen(n->arg)) == 0)) {
                size_t al = strlen(n->arg);
                char *nb = malloc(len + al + 1);
                if (!nb) {
                    rc = td_error(TD_ERR_NO_MEMORY, "normalize: no memory");
                    break;
                }
                memcpy(nb, n->arg, al);
                memcpy(nb + al, buf, len + 1);
                free(buf);
                buf = nb;
                len += al;
            }
            break;
        }
    }
    if (rc) {
        free(buf);
        return rc;
    }
    *out = buf;
    *out_len = len;
    return TD_OK;
}

/* ---- splitting ---- */

typedef struct seg_list {
    eng_piece_t *v;
    size_t n, cap;
} seg_list_t;

static td_status_t seg_push(seg_list_t *l, uint32_t start, uint32_t len)
{
    if (!len)
        return TD_OK;
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 64;
        eng_piece_t *nv = realloc(l->v, nc * sizeof *nv);
        if (!nv)
            return td_error(TD_ERR_NO_MEMORY, "pretok: no memory for %zu pieces", nc);
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = (eng_piece_t){start, len};
    return TD_OK;
}

/* Extends the last piece by len bytes (it must end at start). */
static td_status_t seg_extend(seg_list_t *l, uint32_t start, uint32_t len, bool open)
{
    if (open && l->n && l->v[l->n - 1].start + l->v[l->n - 1].len == start) {
        l->v[l->n - 1].len += len;
        return TD_OK;
    }
    return seg_push(l, start, len);
}

/* Splits [start, start+len) of text by one step, appending to out. */
static td_status_t split_one(pcre2_match_data *md, const pretok_step_t *st, const char *text, uint32_t start,
                             uint32_t len, seg_list_t *out)
{
    const char *subj = text + start;
    size_t at = 0;
    bool join_next = false; /* MERGED_WITH_NEXT: the next gap joins the last piece */
    td_status_t rc = TD_OK;
    while (at <= len && !rc) {
        size_t ms, me;
        if (st->re) {
            int r = pcre2_match(st->re, (PCRE2_SPTR)subj, len, at, PCRE2_NO_UTF_CHECK, md, NULL);
            if (r < 0) {
                if (r != PCRE2_ERROR_NOMATCH)
                    return td_error(TD_ERR_INTERNAL, "pretok: regex match failed (%d)", r);
                break;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            ms = ov[0], me = ov[1];
        } else {
            const char *hit = memmem(subj + at, len - at, st->literal, strlen(st->literal));
            if (!hit)
                break;
            ms = (size_t)(hit - subj), me = ms + strlen(st->literal);
        }
        if (me == ms) { /* empty match: step over one character */
            at = ms + 1;
            while (at < len && ((unsigned char)subj[at] & 0xc0) == 0x80)
                at++;
            if (ms >= len)
                break;
            continue;
        }
        uint32_t gs = start + (uint32_t)at, gl = (uint32_t)(ms - at);
        uint32_t mst = start + (uint32_t)ms, ml = (uint32_t)(me - ms);
        bool match_is_piece = !st->invert; /* with invert, the gaps play the matches' role */
        switch (st->behavior) {
        case ENG_SPLIT_ISOLATED:
            if (!(rc = seg_push(out, gs, gl)))
                rc = seg_push(out, mst, ml);
            break;
        case ENG_SPLIT_REMOVED:
            rc = seg_push(out, match_is_piece ? gs : mst, match_is_piece ? gl : ml);
            break;
        case ENG_SPLIT_MERGED_WITH_PREVIOUS:
            if (!(rc = seg_extend(out, gs, gl, join_next)))
                rc = seg_extend(out, mst, ml, gl > 0 || join_next);
            join_next = false;
            break;
        case ENG_SPLIT_MERGED_WITH_NEXT:
            if (!(rc = seg_extend(out, gs, gl, join_next)))
                rc = seg_push(out, mst, ml);
            join_next = true;
            break;
        }
        at = me;
    }
    if (!rc && at < len) {
        uint32_t gs = start + (uint32_t)at, gl = len - (uint32_t)at;
        if (st->behavior == ENG_SPLIT_MERGED_WITH_NEXT)
            rc = seg_extend(out, gs, gl, join_next);
        else if (st->behavior == ENG_SPLIT_MERGED_WITH_PREVIOUS)
            rc = seg_extend(out, gs, gl, join_next);
        else
            rc = seg_push(out, gs, gl);
    }
    return rc;
}

td_status_t eng_pretok_split(const eng_pretok_t *p, const char *text, size_t len, eng_piece_t **pieces,
                             size_t *cap, size_t *n)
{
    if (len > UINT32_MAX)
        return td_user_error("pretok: text of %zu bytes is too long", len);
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    if (!md)
        return td_error(TD_ERR_NO_MEMORY, "pretok: no memory");
    seg_list_t cur = {.v = *pieces, .n = 0, .cap = *cap};
    td_status_t rc = seg_push(&cur, 0, (uint32_t)len);
    seg_list_t next = {0};
    for (size_t s = 0; s < p->n_steps && !rc; s++) {
        next.n = 0;
        for (size_t i = 0; i < cur.n && !rc; i++)
            rc = split_one(md, &p->steps[s], text, cur.v[i].start, cur.v[i].len, &next);
        seg_list_t t = cur;
        cur = next;
        next = t;
    }
    free(next.v);
    pcre2_match_data_free(md);
    *pieces = cur.v;
    *cap = cur.cap;
    *n = rc ? 0 : cur.n;
    return rc;
}
