/* tokenizer_json.c — builds a tokenizer from a Hugging Face tokenizer.json
 * (model BPE; the normalizers, pre-tokenizers and added tokens Llama, Mistral,
 * Qwen2 and SmolLM2 files use) and tokenizer_config.json. Anything else is an
 * error that names the JSON path, never silently ignored. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/tokenizer_int.h"

static td_status_t tj_norm(eng_tokenizer_t *t, const char *src, json_t *n, const char *where)
{
    if (!n || json_is_null(n))
        return TD_OK;
    const char *type = json_string_value(json_object_get(n, "type"));
    if (!type)
        return td_error(TD_ERR_FORMAT, "%s: %s has no 'type'", src, where);
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(n, "normalizers");
        size_t i;
        json_t *x;
        if (!json_is_array(list))
            return td_error(TD_ERR_FORMAT, "%s: %s.normalizers is not an array", src, where);
        json_array_foreach(list, i, x) {
            td_status_t rc = tj_norm(t, src, x, where);
            if (rc)
                return rc;
        }
        return TD_OK;
    }
    static const struct { const char *name; eng_norm_kind_t kind; } simple[] = {
        {"NFC", ENG_NORM_NFC}, {"NFD", ENG_NORM_NFD}, {"NFKC", ENG_NORM_NFKC}, {"NFKD", ENG_NORM_NFKD},
        {"Lowercase", ENG_NORM_LOWERCASE}};
    for (size_t i = 0; i < sizeof simple / sizeof simple[0]; i++)
        if (!strcmp(type, simple[i].name))
            return eng_pretok_add_norm(t->pre, simple[i].kind, NULL, NULL);
    if (!strcmp(type, "Prepend")) {
        const char *s = json_string_value(json_object_get(n, "prepend"));
        if (!s)
            return td_error(TD_ERR_FORMAT, "%s: %s Prepend has no 'prepend' string", src, where);
        return eng_pretok_add_norm(t->pre, ENG_NORM_PREPEND, s, NULL);
    }
    if (!strcmp(type, "Replace")) {
        const char *from = json_string_value(json_object_get(json_object_get(n, "pattern"), "String"));
        const char *to = json_string_value(json_object_get(n, "content"));
        if (!from || !to)
            return td_error(TD_ERR_FORMAT, "%s: %s Replace needs pattern.String and content (regex patterns are not "
                            "supported)", src, where);
        return eng_pretok_add_norm(t->pre, ENG_NORM_REPLACE, from, to);
    }
    return td_error(TD_ERR_UNSUPPORTED, "%s: %s type '%s' is not supported", src, where, type);
}

static td_status_t tj_behavior(const char *src, const char *b, eng_split_behavior_t *out)
{
    if (!b || !strcmp(b, "Isolated")) *out = ENG_SPLIT_ISOLATED;
    else if (!strcmp(b, "Removed")) *out = ENG_SPLIT_REMOVED;
    else if (!strcmp(b, "MergedWithPrevious")) *out = ENG_SPLIT_MERGED_WITH_PREVIOUS;
    else if (!strcmp(b, "MergedWithNext")) *out = ENG_SPLIT_MERGED_WITH_NEXT;
    else return td_error(TD_ERR_UNSUPPORTED, "%s: pre_tokenizer Split behavior '%s' is not supported", src, b);
    return TD_OK;
}

static td_status_t tj_pre(eng_tokenizer_t *t, const char *src, json_t *n, bool *byte_level)
{
    if (!n || json_is_null(n))
        return TD_OK;
    const char *type = json_string_value(json_object_get(n, "type"));
    td_status_t rc;
    if (!type)
        return td_error(TD_ERR_FORMAT, "%s: pre_tokenizer has no 'type'", src);
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(n, "pretokenizers");
        size_t i;
        json_t *x;
        if (!json_is_array(list))
            return td_error(TD_ERR_FORMAT, "%s: pre_tokenizer.pretokenizers is not an array", src);
        json_array_foreach(list, i, x)
            if ((rc = tj_pre(t, src, x, byte_level)))
                return rc;
        return TD_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        *byte_level = true;
        if (json_is_true(json_object_get(n, "add_prefix_space")) &&
            (rc = eng_pretok_add_norm(t->pre, ENG_NORM_PREPEND_ONCE, " ", NULL)))
            return rc;
        json_t *ur = json_object_get(n, "use_regex");
        return (!ur || json_is_true(ur)) ? eng_pretok_add_byte_level(t->pre) : TD_OK;
    }
    if (!strcmp(type, "Digits"))
        return eng_pretok_add_split(t->pre, json_is_true(json_object_get(n, "individual_digits")) ? "\\p{N}" : "\\p{N}+",
                                    ENG_SPLIT_ISOLATED, false);
    if (!strcmp(type, "Split")) {
        json_t *pat = json_object_get(n, "pattern");
        eng_split_behavior_t b = ENG_SPLIT_ISOLATED;
        if ((rc = tj_behavior(src, json_string_value(json_object_get(n, "behavior")), &b)))
            return rc;
        bool invert = json_is_true(json_object_get(n, "invert"));
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        if (re)
            return eng_pretok_add_split(t->pre, re, b, invert);
        if (lit && !invert)
            return eng_pretok_add_split_literal(t->pre, lit, b);
        return td_error(TD_ERR_FORMAT, "%s: pre_tokenizer Split needs pattern.Regex or pattern.String", src);
    }
    if (!strcmp(type, "Metaspace")) {
        const char *rep = json_string_value(json_object_get(n, "replacement"));
        const char *scheme = json_string_value(json_object_get(n, "prepend_scheme"));
        if (!rep)
            rep = "\xe2\x96\x81";
        if ((rc = eng_pretok_add_norm(t->pre, ENG_NORM_REPLACE, " ", rep)))
            return rc;
        bool prepend = scheme ? strcmp(scheme, "never") != 0 : json_is_true(json_object_get(n, "add_prefix_space"));
        if (prepend && (rc = eng_pretok_add_norm(t->pre, ENG_NORM_PREPEND_ONCE, rep, NULL)))
            return rc;
        json_t *split = json_object_get(n, "split");
        if ((!split || json_is_true(split)) &&
            (rc = eng_pretok_add_split_literal(t->pre, rep, ENG_SPLIT_MERGED_WITH_NEXT)))
            return rc;
        t->strip_decoded_space = prepend;
        return TD_OK;
    }
    return td_error(TD_ERR_UNSUPPORTED, "%s: pre_tokenizer type '%s' is not supported", src, type);
}

/* A token named in tokenizer_config.json: a string or {"content": ...}. */
static int32_t tj_token_id(const eng_tokenizer_t *t, json_t *v)
{
    if (json_is_object(v))
        v = json_object_get(v, "content");
    const char *s = json_string_value(v);
    return s ? eng_tokenizer_find(t, s, strlen(s)) : -1;
}

static td_status_t tj_config(eng_tokenizer_t *t, const char *path)
{
    json_error_t jerr;
    json_t *c = json_load_file(path, 0, &jerr);
    if (!c)
        return td_error(TD_ERR_FORMAT, "%s:%d: not valid JSON: %s", path, jerr.line, jerr.text);
    td_status_t rc = TD_OK;
    int32_t id;
    if ((id = tj_token_id(t, json_object_get(c, "bos_token"))) >= 0)
        t->bos = id;
    if ((id = tj_token_id(t, json_object_get(c, "eos_token"))) >= 0)
        t->eos = id;
    if ((id = tj_token_id(t, json_object_get(c, "unk_token"))) >= 0 && t->unk < 0)
        t->unk = id;
    json_t *ab = json_object_get(c, "add_bos_token");
    if (json_is_boolean(ab))
        t->add_bos = json_is_true(ab);
    json_t *ct = json_object_get(c, "chat_template");
    const char *tmpl = json_string_value(ct);
    if (json_is_array(ct)) { /* [{"name": "default", "template": ...}, ...] */
        size_t i;
        json_t *x;
        json_array_foreach(ct, i, x) {
            const char *name = json_string_value(json_object_get(x, "name"));
            if (name && !strcmp(name, "default"))
                tmpl = json_string_value(json_object_get(x, "template"));
        }
    }
    if (tmpl && !(t->chat_template = strdup(tmpl)))
        rc = td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    json_decref(c);
    return rc;
}

/* The vocabulary's size: its largest id, or an added token's, + 1; an id
 * out of range or an added token without content is an error. */
static td_status_t tj_size(const char *path, json_t *vocab, json_t *added, int64_t *out)
{
    int64_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= (1 << 24))
            return td_error(TD_ERR_FORMAT, "%s: model.vocab['%s'] is not a token id in 0..%d", path, key, (1 << 24) - 1);
        if (json_integer_value(val) > max_id)
            max_id = json_integer_value(val);
    }
    size_t i;
    json_array_foreach(added, i, val) {
        json_t *id = json_object_get(val, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= (1 << 24) ||
            !json_is_string(json_object_get(val, "content")))
            return td_error(TD_ERR_FORMAT, "%s: added_tokens[%zu] needs an id in 0..%d and a content string", path, i,
                            (1 << 24) - 1);
        if (json_integer_value(id) > max_id)
            max_id = json_integer_value(id);
    }
    if (max_id < 0)
        return td_error(TD_ERR_FORMAT, "%s: the vocabulary is empty", path);
    *out = max_id + 1;
    return TD_OK;
}

/* The added tokens: their text, control or user-defined, and the special
 * ones matched before the BPE split. */
static td_status_t tj_added(eng_tokenizer_t *t, const char *path, json_t *added)
{
    size_t n_added = json_array_size(added), i;
    json_t *val;
    t->special = calloc(n_added ? n_added : 1, sizeof *t->special);
    if (!t->special)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    json_array_foreach(added, i, val) {
        int32_t id = (int32_t)json_integer_value(json_object_get(val, "id"));
        const char *content = json_string_value(json_object_get(val, "content"));
        td_status_t rc = tok_set_text(t, id, content, strlen(content));
        if (rc)
            return rc;
        t->type[id] = json_is_true(json_object_get(val, "special")) ? ENG_TOK_TYPE_CONTROL : ENG_TOK_TYPE_USER_DEFINED;
        if (content[0])
            t->special[t->n_special++] = (tok_special_t){
                .id = id, .lstrip = json_is_true(json_object_get(val, "lstrip")),
                .rstrip = json_is_true(json_object_get(val, "rstrip"))};
    }
    return TD_OK;
}

/* model.merges, each "a b" or ["a", "b"], in rank order. */
static td_status_t tj_merges(eng_tokenizer_t *t, const char *path, json_t *merges)
{
    td_status_t rc = tok_alloc_pairs(t, json_array_size(merges));
    size_t i;
    json_t *val;
    if (rc)
        return rc;
    json_array_foreach(merges, i, val) {
        const char *a, *b;
        size_t al, bl;
        char *sp = NULL;
        if (json_is_string(val)) {
            a = json_string_value(val);
            sp = strchr(a + (a[0] ? 1 : 0), ' ');
            if (!sp)
                return td_error(TD_ERR_FORMAT, "%s: model.merges[%zu] '%s' is not two tokens separated by a space",
                                path, i, a);
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = strlen(b);
        } else if (json_is_array(val) && json_array_size(val) == 2 && json_is_string(json_array_get(val, 0)) &&
                   json_is_string(json_array_get(val, 1))) {
            a = json_string_value(json_array_get(val, 0));
            b = json_string_value(json_array_get(val, 1));
            al = strlen(a);
            bl = strlen(b);
        } else {
            return td_error(TD_ERR_FORMAT, "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", path, i);
        }
        int32_t ia = eng_tokenizer_find(t, a, al), ib = eng_tokenizer_find(t, b, bl);
        if (ia < 0 || ib < 0)
            return td_error(TD_ERR_FORMAT, "%s: model.merges[%zu] names a token that is not in the vocabulary", path,
                            i);
        if ((rc = tok_add_merge(t, ia, ib, path)))
            return rc;
    }
    return TD_OK;
}

/* BOS from the post-processor template: "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": ...}] */
static void tj_bos(eng_tokenizer_t *t, json_t *root)
{
    json_t *pp = json_object_get(root, "post_processor"), *val;
    json_t *single = json_object_get(pp, "single");
    size_t i;
    if (!single && pp) { /* a Sequence of processors */
        json_array_foreach(json_object_get(pp, "processors"), i, val)
            if (json_object_get(val, "single"))
                single = json_object_get(val, "single");
    }
    if (json_is_array(single) && json_array_size(single) > 0) {
        json_t *first = json_object_get(json_array_get(single, 0), "SpecialToken");
        const char *bos = json_string_value(json_object_get(first, "id"));
        if (bos && (t->bos = eng_tokenizer_find(t, bos, strlen(bos))) >= 0)
            t->add_bos = true;
    }
}

td_status_t eng_tokenizer_from_json(const char *path, const char *config_path, eng_tokenizer_t **out)
{
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        return td_error(TD_ERR_FORMAT, "%s:%d: not valid JSON: %s", path, jerr.line, jerr.text);
    td_status_t rc = TD_OK;
    eng_tokenizer_t *t = NULL;
    json_t *model = json_object_get(root, "model");
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    json_t *added = json_object_get(root, "added_tokens");
    const char *mtype = json_string_value(json_object_get(model, "type"));
    if (!json_is_object(model) || !json_is_object(vocab)) {
        rc = td_error(TD_ERR_FORMAT, "%s: 'model.vocab' is missing or not an object", path);
        goto done;
    }
    if (mtype && strcmp(mtype, "BPE")) {
        rc = td_error(TD_ERR_UNSUPPORTED, "%s: model.type '%s' is not supported (BPE is)", path, mtype);
        goto done;
    }
    if (!json_is_array(merges)) {
        rc = td_error(TD_ERR_FORMAT, "%s: 'model.merges' is missing or not an array", path);
        goto done;
    }
    int64_t size = 0;
    if ((rc = tj_size(path, vocab, added, &size)))
        goto done;
    bool byte_level = false;
    /* the kind is known only after the pre-tokenizer; build into a byte-level
     * shell, then fix the kind */
    if ((rc = tok_alloc(&t, (int32_t)size, ENG_TOK_BPE_BYTE_LEVEL)))
        goto done;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val)
        if ((rc = tok_set_text(t, (int32_t)json_integer_value(val), key, strlen(key))))
            goto done;
    if ((rc = tj_added(t, path, added)))
        goto done;
    if ((rc = tj_norm(t, path, json_object_get(root, "normalizer"), "normalizer")) ||
        (rc = tj_pre(t, path, json_object_get(root, "pre_tokenizer"), &byte_level)))
        goto done;
    t->kind = byte_level ? ENG_TOK_BPE_BYTE_LEVEL : ENG_TOK_BPE_SPM;
    t->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    t->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    /* SentencePiece-style files strip the space the normalizer prepended */
    json_t *norm = json_object_get(root, "normalizer");
    char *norm_text = norm ? json_dumps(norm, JSON_COMPACT) : NULL;
    if (!byte_level && norm_text && strstr(norm_text, "Prepend"))
        t->strip_decoded_space = true;
    free(norm_text);
    if ((rc = tok_finish(t, path)))
        goto done;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->kind == ENG_TOK_BPE_SPM && t->len[id] == 6 && !strncmp(t->text[id], "<0x", 3) &&
            t->text[id][5] == '>' && t->type[id] == ENG_TOK_TYPE_NORMAL)
            t->type[id] = ENG_TOK_TYPE_BYTE;
    const char *unk = json_string_value(json_object_get(model, "unk_token"));
    if (unk)
        t->unk = eng_tokenizer_find(t, unk, strlen(unk));
    if ((rc = tj_merges(t, path, merges)))
        goto done;
    tj_bos(t, root);
    if (config_path && (rc = tj_config(t, config_path)))
        goto done;
    tok_add_eog(t, t->eos);
done:
    json_decref(root);
    if (rc) {
        eng_tokenizer_destroy(t);
        return rc;
    }
    *out = t;
    return TD_OK;
}
