/* tokenizer.c — BPE encode/decode and the GGUF loader (see tokenizer.h).
 *
 * How BPE works here: a piece of text starts as one symbol per character (per
 * byte in the byte-level alphabet). Every adjacent pair that the model can merge
 * goes into a min-heap keyed by (rank, position): the merge rank when the model
 * has a merges list, minus the merged token's score for SentencePiece models.
 * The best pair is merged, its neighbours' pairs are pushed, and stale heap
 * entries (a side already merged elsewhere) are recognised by their recorded
 * length and skipped. This is O(n log n) in the piece length, and it picks the
 * same merges, in the same order, as Hugging Face `tokenizers` and llama.cpp. */
#include "engine/tokenizer_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/log.h"
#include "engine/gguf.h"

/* ---- tables ---- */

uint32_t tok_byte_to_cp(uint8_t b)
{
    if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae))
        return b;
    /* the other 68 bytes map to 256.. in byte order */
    uint32_t n = 0;
    for (uint32_t x = 0; x < b; x++)
        if (!((x >= '!' && x <= '~') || (x >= 0xa1 && x <= 0xac) || (x >= 0xae)))
            n++;
    return 256 + n;
}

static size_t utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decodes one UTF-8 character of valid text; returns its length. */
static size_t utf8_get(const unsigned char *s, uint32_t *cp)
{
    if (s[0] < 0x80) { *cp = s[0]; return 1; }
    if (s[0] < 0xe0) { *cp = ((uint32_t)(s[0] & 0x1f) << 6) | (s[1] & 0x3f); return 2; }
    if (s[0] < 0xf0) { *cp = ((uint32_t)(s[0] & 0x0f) << 12) | ((uint32_t)(s[1] & 0x3f) << 6) | (s[2] & 0x3f); return 3; }
    *cp = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3f) << 12) | ((uint32_t)(s[2] & 0x3f) << 6) | (s[3] & 0x3f);
    return 4;
}

static size_t utf8_char_len(unsigned char c)
{
    return c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
}

/* ---- construction ---- */

td_status_t tok_alloc(eng_tokenizer_t **out, int32_t n_vocab, eng_tok_kind_t kind)
{
    eng_tokenizer_t *t = calloc(1, sizeof *t);
    if (!t)
        return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory");
    t->kind = kind;
    t->n_vocab = n_vocab;
    t->text = calloc((size_t)n_vocab, sizeof *t->text);
    t->len = calloc((size_t)n_vocab, sizeof *t->len);
    t->type = calloc((size_t)n_vocab, sizeof *t->type);
    t->unk = t->bos = t->eos = t->eot = t->pad = -1;
    if (!t->text || !t->len || !t->type || eng_pretok_create(&t->pre)) {
        eng_tokenizer_destroy(t);
        return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory for %d tokens", n_vocab);
    }
    for (int32_t i = 0; i < n_vocab; i++)
        t->type[i] = ENG_TOK_TYPE_NORMAL;
    *out = t;
    return TD_OK;
}

td_status_t tok_set_text(eng_tokenizer_t *t, int32_t id, const char *text, size_t len)
{
    if (t->arena_len + len + 1 > t->arena_cap) {
        /* strings move when the arena grows: keep offsets until tok_finish */
        size_t nc = t->arena_cap ? t->arena_cap * 2 : 1 << 20;
        while (nc < t->arena_len + len + 1)
            nc *= 2;
        char *na = realloc(t->arena, nc);
        if (!na)
            return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory for token texts");
        t->arena = na;
        t->arena_cap = nc;
    }
    memcpy(t->arena + t->arena_len, text, len);
    t->arena[t->arena_len + len] = '\0';
    t->text[id] = (char *)(uintptr_t)t->arena_len; /* an offset until tok_finish */
    t->len[id] = (uint32_t)len;
    t->arena_len += len + 1;
    return TD_OK;
}

static uint32_t hash_bytes(const char *s, size_t n) { return (uint32_t)XXH3_64bits(s, n); }

static uint32_t hash_pair(int32_t a, int32_t b)
{
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    return (uint32_t)XXH3_64bits(&k, sizeof k);
}

int32_t eng_tokenizer_find(const eng_tokenizer_t *t, const char *s, size_t n)
{
    for (uint32_t h = hash_bytes(s, n) & t->map_mask;; h = (h + 1) & t->map_mask) {
        int32_t id = t->map[h];
        if (id < 0)
            return -1;
        if (t->len[id] == n && memcmp(t->text[id], s, n) == 0)
            return id;
    }
}

td_status_t tok_alloc_pairs(eng_tokenizer_t *t, size_t n_merges)
{
    uint32_t cap = 16;
    while (cap < n_merges * 2 + 16)
        cap *= 2;
    t->pairs = malloc(cap * sizeof *t->pairs);
    if (!t->pairs)
        return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory for %zu merges", n_merges);
    for (uint32_t i = 0; i < cap; i++)
        t->pairs[i].a = -1;
    t->pair_mask = cap - 1;
    return TD_OK;
}

static const tok_pair_t *pair_find(const eng_tokenizer_t *t, int32_t a, int32_t b)
{
    for (uint32_t h = hash_pair(a, b) & t->pair_mask;; h = (h + 1) & t->pair_mask) {
        const tok_pair_t *p = &t->pairs[h];
        if (p->a < 0)
            return NULL;
        if (p->a == a && p->b == b)
            return p;
    }
}

td_status_t tok_add_merge(eng_tokenizer_t *t, int32_t a, int32_t b, const char *what)
{
    char buf[512];
    if (t->len[a] + t->len[b] >= sizeof buf)
        return td_error(TD_ERR_FORMAT, "%s: merge %zu makes a token longer than %zu bytes", what, t->n_merges,
                        sizeof buf);
    memcpy(buf, t->text[a], t->len[a]);
    memcpy(buf + t->len[a], t->text[b], t->len[b]);
    int32_t r = eng_tokenizer_find(t, buf, t->len[a] + t->len[b]);
    if (r < 0)
        return td_error(TD_ERR_FORMAT, "%s: merge %zu ('%s' + '%s') makes a token that is not in the vocabulary",
                        what, t->n_merges, t->text[a], t->text[b]);
    uint32_t h = hash_pair(a, b) & t->pair_mask;
    while (t->pairs[h].a >= 0) {
        if (t->pairs[h].a == a && t->pairs[h].b == b) { /* a repeated merge keeps its first rank */
            t->n_merges++;
            return TD_OK;
        }
        h = (h + 1) & t->pair_mask;
    }
    t->pairs[h] = (tok_pair_t){.a = a, .b = b, .result = r, .rank = (uint32_t)t->n_merges++};
    return TD_OK;
}

void tok_add_eog(eng_tokenizer_t *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab)
        return;
    for (size_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return;
    if (t->n_eog < ENG_TOK_MAX_EOG)
        t->eog[t->n_eog++] = id;
}

static int special_cmp(const void *a, const void *b, void *ctx)
{
    const eng_tokenizer_t *t = ctx;
    const tok_special_t *x = a, *y = b;
    if (t->len[x->id] != t->len[y->id])
        return t->len[x->id] > t->len[y->id] ? -1 : 1;
    return x->id - y->id;
}

/* qsort_r is a GNU extension; a small insertion sort keeps us portable C11. */
static void special_sort(eng_tokenizer_t *t)
{
    for (size_t i = 1; i < t->n_special; i++) {
        tok_special_t v = t->special[i];
        size_t j = i;
        while (j > 0 && special_cmp(&t->special[j - 1], &v, t) > 0) {
            t->special[j] = t->special[j - 1];
            j--;
        }
        t->special[j] = v;
    }
}

td_status_t tok_finish(eng_tokenizer_t *t, const char *what)
{
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (!t->len[i] && !t->text[i]) {
            /* a token never set: an empty string at offset 0 would alias token 0 */
            td_status_t rc = tok_set_text(t, i, "", 0);
            if (rc)
                return rc;
        }
    }
    for (int32_t i = 0; i < t->n_vocab; i++)
        t->text[i] = t->arena + (uintptr_t)t->text[i];

    uint32_t cap = 16;
    while (cap < (uint32_t)t->n_vocab * 2u)
        cap *= 2;
    t->map = malloc(cap * sizeof *t->map);
    if (!t->map)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory for the vocabulary index", what);
    memset(t->map, 0xff, cap * sizeof *t->map);
    t->map_mask = cap - 1;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        uint32_t h = hash_bytes(t->text[i], t->len[i]) & t->map_mask;
        bool dup = false;
        for (; t->map[h] >= 0; h = (h + 1) & t->map_mask)
            if (t->len[t->map[h]] == t->len[i] && memcmp(t->text[t->map[h]], t->text[i], t->len[i]) == 0)
                dup = true;
        if (!dup) /* duplicates (unused slots, say) keep the lowest id, as HF and llama.cpp do */
            t->map[h] = i;
    }

    for (int b = 0; b < 256; b++) {
        char buf[8];
        size_t n;
        if (t->kind == ENG_TOK_BPE_BYTE_LEVEL)
            n = utf8_put(tok_byte_to_cp((uint8_t)b), buf);
        else
            n = (size_t)snprintf(buf, sizeof buf, "<0x%02X>", b);
        t->byte_tok[b] = eng_tokenizer_find(t, buf, n);
    }
    memset(t->cp_byte, 0xff, sizeof t->cp_byte);
    for (int b = 0; b < 256; b++)
        t->cp_byte[tok_byte_to_cp((uint8_t)b)] = (int16_t)b;

    size_t ns = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->type[i] == ENG_TOK_TYPE_CONTROL || t->type[i] == ENG_TOK_TYPE_USER_DEFINED ||
             t->type[i] == ENG_TOK_TYPE_UNKNOWN) && t->len[i])
            ns++;
    if (!t->special) {
        t->special = calloc(ns ? ns : 1, sizeof *t->special);
        if (!t->special)
            return td_error(TD_ERR_NO_MEMORY, "%s: no memory", what);
        for (int32_t i = 0; i < t->n_vocab; i++)
            if ((t->type[i] == ENG_TOK_TYPE_CONTROL || t->type[i] == ENG_TOK_TYPE_USER_DEFINED ||
                 t->type[i] == ENG_TOK_TYPE_UNKNOWN) && t->len[i])
                t->special[t->n_special++] = (tok_special_t){.id = i};
    }
    special_sort(t);
    tok_add_eog(t, t->eos);
    tok_add_eog(t, t->eot);
    return TD_OK;
}

void eng_tokenizer_destroy(eng_tokenizer_t *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->len);
    free(t->score);
    free(t->type);
    free(t->arena);
    free(t->map);
    free(t->pairs);
    free(t->special);
    free(t->chat_template);
    eng_pretok_destroy(t->pre);
    free(t);
}

/* ---- GGUF ---- */

static td_status_t gguf_opt_id(const eng_gguf_t *g, const char *key, int32_t n_vocab, int32_t *out)
{
    uint32_t v;
    td_status_t rc = eng_gguf_get_u32(g, key, &v);
    if (rc == TD_ERR_NOT_FOUND)
        return TD_OK;
    if (rc)
        return rc;
    if (v >= (uint32_t)n_vocab)
        return td_error(TD_ERR_FORMAT, "%s: %s = %u is outside the vocabulary of %d tokens", eng_gguf_path(g), key,
                        v, n_vocab);
    *out = (int32_t)v;
    return TD_OK;
}

static td_status_t gguf_opt_bool(const eng_gguf_t *g, const char *key, bool *out)
{
    td_status_t rc = eng_gguf_get_bool(g, key, out);
    return rc == TD_ERR_NOT_FOUND ? TD_OK : rc;
}

td_status_t eng_tokenizer_from_gguf(const eng_gguf_t *g, eng_tokenizer_t **out)
{
    const char *path = eng_gguf_path(g);
    eng_str_t model;
    td_status_t rc = eng_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (rc == TD_ERR_NOT_FOUND)
        return td_error(TD_ERR_NOT_FOUND, "%s: no tokenizer (key tokenizer.ggml.model is missing)", path);
    if (rc)
        return rc;
    eng_tok_kind_t kind;
    if (model.len == 4 && !memcmp(model.ptr, "gpt2", 4))
        kind = ENG_TOK_BPE_BYTE_LEVEL;
    else if (model.len == 5 && !memcmp(model.ptr, "llama", 5))
        kind = ENG_TOK_BPE_SPM;
    else
        return td_error(TD_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model '%.*s' is not supported (gpt2 and llama are)",
                        path, (int)model.len, model.ptr);
    const eng_gguf_kv_t *tokens, *types = NULL, *scores = NULL, *merges = NULL;
    if ((rc = eng_gguf_get_arr(g, "tokenizer.ggml.tokens", ENG_GGUF_STRING, &tokens))) {
        if (rc == TD_ERR_NOT_FOUND)
            td_error(rc, "%s: key tokenizer.ggml.tokens is missing", path);
        return rc;
    }
    if (tokens->arr_len == 0 || tokens->arr_len > (1u << 24))
        return td_error(TD_ERR_FORMAT, "%s: tokenizer.ggml.tokens has %llu entries (1..%u allowed)", path,
                        (unsigned long long)tokens->arr_len, 1u << 24);
    int32_t n = (int32_t)tokens->arr_len;
    rc = eng_gguf_get_arr(g, "tokenizer.ggml.token_type", ENG_GGUF_I32, &types);
    if (rc && rc != TD_ERR_NOT_FOUND)
        return rc;
    rc = eng_gguf_get_arr(g, "tokenizer.ggml.scores", ENG_GGUF_F32, &scores);
    if (rc && rc != TD_ERR_NOT_FOUND)
        return rc;
    rc = eng_gguf_get_arr(g, "tokenizer.ggml.merges", ENG_GGUF_STRING, &merges);
    if (rc && rc != TD_ERR_NOT_FOUND)
        return rc;
    if ((types && types->arr_len != (uint64_t)n) || (scores && scores->arr_len != (uint64_t)n))
        return td_error(TD_ERR_FORMAT, "%s: tokenizer.ggml.token_type/scores length differs from the %d tokens", path, n);
    if (kind == ENG_TOK_BPE_BYTE_LEVEL && !merges)
        return td_error(TD_ERR_FORMAT, "%s: a gpt2 tokenizer needs tokenizer.ggml.merges, which is missing", path);

    eng_tokenizer_t *t;
    if ((rc = tok_alloc(&t, n, kind)))
        return rc;
    for (int32_t i = 0; i < n && !rc; i++) {
        eng_str_t s = eng_gguf_arr_str(g, tokens, (uint64_t)i);
        rc = tok_set_text(t, i, s.ptr, s.len);
        if (types) {
            double ty = eng_gguf_arr_num(types, (uint64_t)i);
            if (ty < 0 || ty > 6) {
                rc = td_error(TD_ERR_FORMAT, "%s: token %d has type %g (0..6 allowed)", path, i, ty);
                break;
            }
            t->type[i] = (uint8_t)ty;
        }
    }
    if (!rc && scores) {
        t->score = malloc((size_t)n * sizeof *t->score);
        if (!t->score)
            rc = td_error(TD_ERR_NO_MEMORY, "%s: no memory for scores", path);
        for (int32_t i = 0; i < n && !rc; i++)
            t->score[i] = (float)eng_gguf_arr_num(scores, (uint64_t)i);
    }
    if (!rc)
        rc = tok_finish(t, path);
    if (!rc && merges) {
        rc = tok_alloc_pairs(t, merges->arr_len);
        for (uint64_t i = 0; i < merges->arr_len && !rc; i++) {
            eng_str_t m = eng_gguf_arr_str(g, merges, i);
            const char *sp = memchr(m.ptr + (m.len ? 1 : 0), ' ', m.len ? m.len - 1 : 0);
            if (!sp) {
                rc = td_error(TD_ERR_FORMAT, "%s: merge %llu '%.*s' is not two tokens separated by a space", path,
                              (unsigned long long)i, (int)(m.len > 60 ? 60 : m.len), m.ptr);
                break;
            }
            int32_t a = eng_tokenizer_find(t, m.ptr, (size_t)(sp - m.ptr));
            int32_t b = eng_tokenizer_find(t, sp + 1, m.len - (size_t)(sp - m.ptr) - 1);
            if (a < 0 || b < 0) {
                rc = td_error(TD_ERR_FORMAT, "%s: merge %llu '%.*s' names a token that is not in the vocabulary",
                              path, (unsigned long long)i, (int)(m.len > 60 ? 60 : m.len), m.ptr);
                break;
            }
            rc = tok_add_merge(t, a, b, path);
        }
    }
    if (!rc)
        rc = gguf_opt_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos);
    if (!rc)
        rc = gguf_opt_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos);
    if (!rc)
        rc = gguf_opt_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk);
    if (!rc)
        rc = gguf_opt_id(g, "tokenizer.ggml.padding_token_id", n, &t->pad);
    if (!rc)
        rc = gguf_opt_id(g, "tokenizer.ggml.eot_token_id", n, &t->eot);
    t->add_bos = kind == ENG_TOK_BPE_SPM;
    t->spm_space_prefix = kind == ENG_TOK_BPE_SPM;
    if (!rc)
        rc = gguf_opt_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
    if (!rc)
        rc = gguf_opt_bool(g, "tokenizer.ggml.add_eos_token", &t->add_eos);
    if (!rc)
        rc = gguf_opt_bool(g, "tokenizer.ggml.add_space_prefix", &t->spm_space_prefix);
    t->strip_decoded_space = kind == ENG_TOK_BPE_SPM && t->spm_space_prefix;
    if (!rc && kind == ENG_TOK_BPE_BYTE_LEVEL) {
        eng_str_t pre;
        char name[64] = "default";
        if (eng_gguf_get_str(g, "tokenizer.ggml.pre", &pre) == TD_OK)
            snprintf(name, sizeof name, "%.*s", (int)(pre.len < 63 ? pre.len : 63), pre.ptr);
        rc = eng_pretok_add_gguf_pre(t->pre, name);
    } else if (!rc) {
        t->byte_fallback = true;
        rc = eng_pretok_add_norm(t->pre, ENG_NORM_REPLACE, " ", "\xe2\x96\x81");
    }
    eng_str_t tmpl;
    if (!rc && eng_gguf_get_str(g, "tokenizer.chat_template", &tmpl) == TD_OK) {
        t->chat_template = strndup(tmpl.ptr, tmpl.len);
        if (!t->chat_template)
            rc = td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    }
    /* end-of-generation: EOS, EOT, and the chat end markers the vocabulary has */
    static const char *const eog_names[] = {"<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>",
                                            "<end_of_turn>"};
    for (size_t i = 0; !rc && i < sizeof eog_names / sizeof eog_names[0]; i++) {
        int32_t id = eng_tokenizer_find(t, eog_names[i], strlen(eog_names[i]));
        if (id >= 0 && t->type[id] == ENG_TOK_TYPE_CONTROL)
            tok_add_eog(t, id);
    }
    if (rc) {
        eng_tokenizer_destroy(t);
        return rc;
    }
    *out = t;
    return TD_OK;
}

/* ---- encoding ---- */

typedef struct tok_sym {
    int32_t id;
    uint32_t start, len;
    int32_t prev, next;
} tok_sym_t;

typedef struct tok_cand {
    double rank;
    int32_t left, right;
    uint32_t size;
    int32_t result;
} tok_cand_t;

typedef struct tok_work {
    tok_sym_t *sym;
    size_t sym_cap;
    tok_cand_t *heap;
    size_t heap_n, heap_cap;
    int32_t *ids;
    size_t n_ids, ids_cap;
} tok_work_t;

static bool cand_less(const tok_cand_t *a, const tok_cand_t *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static td_status_t heap_push(tok_work_t *w, tok_cand_t c)
{
    if (w->heap_n == w->heap_cap) {
        size_t nc = w->heap_cap ? w->heap_cap * 2 : 256;
        tok_cand_t *nh = realloc(w->heap, nc * sizeof *nh);
        if (!nh)
            return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory");
        w->heap = nh;
        w->heap_cap = nc;
    }
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &w->heap[p]))
            break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = c;
    return TD_OK;
}

static tok_cand_t heap_pop(tok_work_t *w)
{
    tok_cand_t top = w->heap[0];
    tok_cand_t last = w->heap[--w->heap_n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const tok_cand_t *best = &last;
        if (l < w->heap_n && cand_less(&w->heap[l], best))
            m = l, best = &w->heap[l];
        if (r < w->heap_n && cand_less(&w->heap[r], best))
            m = r;
        if (m == i)
            break;
        w->heap[i] = w->heap[m];
        i = m;
    }
    if (w->heap_n)
        w->heap[i] = last;
    return top;
}

static td_status_t ids_push(tok_work_t *w, int32_t id)
{
    if (w->n_ids == w->ids_cap) {
        size_t nc = w->ids_cap ? w->ids_cap * 2 : 256;
        int32_t *ni = realloc(w->ids, nc * sizeof *ni);
        if (!ni)
            return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory for %zu ids", nc);
        w->ids = ni;
        w->ids_cap = nc;
    }
    w->ids[w->n_ids++] = id;
    return TD_OK;
}

/* Queues the pair (l, r) if the model can merge it. */
static td_status_t try_pair(const eng_tokenizer_t *t, tok_work_t *w, const char *text, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return TD_OK;
    const tok_sym_t *a = &w->sym[l], *b = &w->sym[r];
    tok_cand_t c = {.left = l, .right = r, .size = a->len + b->len};
    if (t->pairs) {
        if (a->id < 0 || b->id < 0)
            return TD_OK;
        const tok_pair_t *p = pair_find(t, a->id, b->id);
        if (!p)
            return TD_OK;
        c.rank = p->rank;
        c.result = p->result;
    } else {
        int32_t id = eng_tokenizer_find(t, text + a->start, a->len + b->len);
        if (id < 0)
            return TD_OK;
        c.rank = t->score ? -(double)t->score[id] : 0;
        c.result = id;
    }
    return heap_push(w, c);
}

/* BPE over one piece (already in the vocabulary's alphabet) appending ids. */
static td_status_t bpe_piece(const eng_tokenizer_t *t, tok_work_t *w, const char *text, size_t len)
{
    td_status_t rc;
    if (!len)
        return TD_OK;
    if (t->ignore_merges) {
        int32_t id = eng_tokenizer_find(t, text, len);
        if (id >= 0)
            return ids_push(w, id);
    }
    if (len > w->sym_cap) {
        tok_sym_t *ns = realloc(w->sym, len * sizeof *ns);
        if (!ns)
            return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory for a piece of %zu bytes", len);
        w->sym = ns;
        w->sym_cap = len;
    }
    int32_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t cl = utf8_char_len((unsigned char)text[i]);
        if (cl > len - i)
            cl = len - i;
        w->sym[n] = (tok_sym_t){.id = eng_tokenizer_find(t, text + i, cl), .start = (uint32_t)i,
                                .len = (uint32_t)cl, .prev = n - 1, .next = n + 1};
        n++;
        i += cl;
    }
    w->sym[n - 1].next = -1;
    w->heap_n = 0;
    for (int32_t i = 0; i + 1 < n; i++)
        if ((rc = try_pair(t, w, text, i, i + 1)))
            return rc;
    while (w->heap_n) {
        tok_cand_t c = heap_pop(w);
        tok_sym_t *a = &w->sym[c.left], *b = &w->sym[c.right];
        if (!a->len || !b->len || a->next != c.right || a->len + b->len != c.size)
            continue; /* stale */
        a->len += b->len;
        a->id = c.result;
        a->next = b->next;
        if (b->next >= 0)
            w->sym[b->next].prev = c.left;
        b->len = 0;
        if ((rc = try_pair(t, w, text, a->prev, c.left)) || (rc = try_pair(t, w, text, c.left, a->next)))
            return rc;
    }
    bool last_unk = false;
    for (int32_t i = 0; i >= 0; i = w->sym[i].next) {
        const tok_sym_t *s = &w->sym[i];
        if (s->id >= 0) {
            if ((rc = ids_push(w, s->id)))
                return rc;
            last_unk = false;
            continue;
        }
        bool all_bytes = t->byte_fallback;
        for (uint32_t k = 0; k < s->len && all_bytes; k++)
            all_bytes = t->byte_tok[(unsigned char)text[s->start + k]] >= 0;
        if (all_bytes) {
            for (uint32_t k = 0; k < s->len; k++)
                if ((rc = ids_push(w, t->byte_tok[(unsigned char)text[s->start + k]])))
                    return rc;
            last_unk = false;
        } else if (t->unk >= 0) {
            if (!(t->fuse_unk && last_unk) && (rc = ids_push(w, t->unk)))
                return rc;
            last_unk = true;
        } else {
            return td_error(TD_ERR_FORMAT, "tokenizer: '%.*s' cannot be spelled in the vocabulary and there is no "
                            "unknown token", (int)s->len, text + s->start);
        }
    }
    return TD_OK;
}

/* Normalizes, pre-tokenizes and BPE-encodes one fragment of plain text. */
static td_status_t encode_text(const eng_tokenizer_t *t, tok_work_t *w, const char *text, size_t len,
                               bool space_prefix)
{
    char *norm = NULL, *prefixed = NULL;
    size_t nlen;
    td_status_t rc;
    if (space_prefix) {
        prefixed = malloc(len + 2);
        if (!prefixed)
            return td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory");
        prefixed[0] = ' ';
        memcpy(prefixed + 1, text, len);
        text = prefixed;
        len++;
    }
    rc = eng_pretok_normalize(t->pre, text, len, &norm, &nlen);
    free(prefixed);
    if (rc)
        return rc;
    eng_piece_t *pieces = NULL;
    size_t pcap = 0, np = 0;
    if ((rc = eng_pretok_split(t->pre, norm, nlen, &pieces, &pcap, &np)))
        goto done;
    char *mapped = NULL;
    if (t->kind == ENG_TOK_BPE_BYTE_LEVEL) {
        mapped = malloc(nlen * 2 + 1); /* every mapped byte takes at most 2 bytes */
        if (!mapped) {
            rc = td_error(TD_ERR_NO_MEMORY, "tokenizer: no memory");
            goto done;
        }
    }
    for (size_t i = 0; i < np && !rc; i++) {
        const char *p = norm + pieces[i].start;
        size_t pl = pieces[i].len;
        if (mapped) {
            size_t m = 0;
            for (size_t k = 0; k < pl; k++)
                m += utf8_put(tok_byte_to_cp((uint8_t)p[k]), mapped + m);
            p = mapped;
            pl = m;
        }
        rc = bpe_piece(t, w, p, pl);
    }
    free(mapped);
done:
    free(pieces);
    free(norm);
    return rc;
}

static bool is_ws(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* The special token spelled at text[i], longest first, or NULL. */
static const tok_special_t *special_at(const eng_tokenizer_t *t, const char *text, size_t len, size_t i)
{
    for (size_t k = 0; k < t->n_special; k++) {
        const tok_special_t *s = &t->special[k];
        uint32_t sl = t->len[s->id];
        if (sl <= len - i && text[i] == t->text[s->id][0] && memcmp(text + i, t->text[s->id], sl) == 0)
            return s;
    }
    return NULL;
}

td_status_t eng_tokenizer_encode(const eng_tokenizer_t *t, const char *text, size_t len, unsigned flags,
                                 int32_t **ids, size_t *cap, size_t *n)
{
    size_t clean_len = 0;
    char *clean = eng_utf8_sanitize(text, len, &clean_len);
    if (clean) {
        text = clean;
        len = clean_len;
    }
    tok_work_t w = {.ids = *ids, .ids_cap = *cap};
    td_status_t rc = TD_OK;
    bool prev_special = true;
    if ((flags & ENG_TOK_ADD_BOS) && t->add_bos && t->bos >= 0)
        rc = ids_push(&w, t->bos);
    size_t frag = 0, i = 0;
    while (!rc && i <= len) {
        const tok_special_t *s = NULL;
        if ((flags & ENG_TOK_PARSE_SPECIAL) && i < len)
            s = special_at(t, text, len, i);
        if (!s && i < len) {
            i++;
            continue;
        }
        size_t end = i;
        if (s && s->lstrip)
            while (end > frag && is_ws((unsigned char)text[end - 1]))
                end--;
        if (end > frag)
            rc = encode_text(t, &w, text + frag, end - frag, t->spm_space_prefix && prev_special);
        if (rc || !s)
            break;
        rc = ids_push(&w, s->id);
        prev_special = true;
        i += t->len[s->id];
        if (s->rstrip)
            while (i < len && is_ws((unsigned char)text[i]))
                i++;
        frag = i;
        if (end > frag)
            prev_special = false;
    }
    if (!rc && (flags & ENG_TOK_ADD_BOS) && t->add_eos && t->eos >= 0)
        rc = ids_push(&w, t->eos);
    free(clean);
    free(w.sym);
    free(w.heap);
    *ids = w.ids;
    *cap = w.ids_cap;
    *n = rc ? 0 : w.n_ids;
    return rc;
}

/* ---- decoding ---- */

size_t eng_tokenizer_token_bytes(const eng_tokenizer_t *t, int32_t id, char *buf, size_t cap)
{
    const char *s = t->text[id];
    size_t n = t->len[id], o = 0;
    uint8_t ty = t->type[id];
    if (ty == ENG_TOK_TYPE_CONTROL || ty == ENG_TOK_TYPE_USER_DEFINED || ty == ENG_TOK_TYPE_UNKNOWN) {
        o = n < cap ? n : cap;
        memcpy(buf, s, o);
        return o;
    }
    if (ty == ENG_TOK_TYPE_BYTE && t->kind == ENG_TOK_BPE_SPM && n == 6) {
        if (cap)
            buf[0] = (char)strtol(s + 3, NULL, 16);
        return cap ? 1 : 0;
    }
    for (size_t i = 0; i < n && o < cap;) {
        uint32_t cp;
        size_t cl = utf8_get((const unsigned char *)s + i, &cp);
        if (t->kind == ENG_TOK_BPE_BYTE_LEVEL && cp < sizeof t->cp_byte / sizeof t->cp_byte[0] &&
            t->cp_byte[cp] >= 0) {
            buf[o++] = (char)t->cp_byte[cp];
        } else if (t->kind == ENG_TOK_BPE_SPM && cp == 0x2581) {
            buf[o++] = ' ';
        } else {
            for (size_t k = 0; k < cl && o < cap; k++)
                buf[o++] = s[i + k];
        }
        i += cl;
    }
    return o;
}

static bool tok_is_control(const eng_tokenizer_t *t, int32_t id)
{
    return t->type[id] == ENG_TOK_TYPE_CONTROL || t->type[id] == ENG_TOK_TYPE_UNKNOWN;
}

void eng_tok_stream_init(eng_tok_stream_t *s, const eng_tokenizer_t *tok, bool skip_special)
{
    memset(s, 0, sizeof *s);
    s->tok = tok;
    s->skip_special = skip_special;
}

/* Moves the whole characters of in[0..n) to out, replacing each maximal
 * ill-formed subpart with U+FFFD; an incomplete tail (when !final) stays in
 * s->pending for the next token. */
static size_t stream_emit(eng_tok_stream_t *s, const unsigned char *in, size_t n, char *out, bool final)
{
    size_t o = 0, i = 0;
    s->n_pending = 0;
    while (i < n) {
        size_t k = eng_utf8_valid_len(in + i, n - i);
        if (k) {
            memcpy(out + o, in + i, k);
            o += k, i += k;
            continue;
        }
        size_t part = eng_utf8_partial_len(in + i, n - i);
        if (!final && part && part == n - i) {
            memcpy(s->pending, in + i, part);
            s->n_pending = part;
            return o;
        }
        memcpy(out + o, "\xef\xbf\xbd", 3);
        o += 3;
        i += part ? part : 1;
    }
    return o;
}

td_status_t eng_tok_stream_push(eng_tok_stream_t *s, int32_t id, char *out, size_t cap, size_t *out_len)
{
    const eng_tokenizer_t *t = s->tok;
    if (id < 0 || id >= t->n_vocab)
        return td_error(TD_ERR_OUT_OF_RANGE, "decode: token id %d is outside the vocabulary of %d", id, t->n_vocab);
    *out_len = 0;
    if (s->skip_special && tok_is_control(t, id))
        return TD_OK;
    unsigned char buf[8 + 512];
    memcpy(buf, s->pending, s->n_pending);
    size_t n = s->n_pending + eng_tokenizer_token_bytes(t, id, (char *)buf + s->n_pending, 512);
    size_t skip = 0;
    if (!s->started && n) {
        s->started = true;
        if (t->strip_decoded_space && buf[0] == ' ')
            skip = 1;
    }
    if ((n - skip) * 3 > cap)
        return td_error(TD_ERR_INVALID_ARG, "decode: output buffer of %zu bytes is too small", cap);
    *out_len = stream_emit(s, buf + skip, n - skip, out, false);
    return TD_OK;
}

size_t eng_tok_stream_finish(eng_tok_stream_t *s, char *out, size_t cap)
{
    unsigned char tmp[8];
    size_t n = s->n_pending;
    if (!n || cap < 3 * n)
        return 0;
    memcpy(tmp, s->pending, n);
    return stream_emit(s, tmp, n, out, true);
}

td_status_t eng_tokenizer_decode(const eng_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                                 char **out, size_t *out_len)
{
    eng_tok_stream_t s;
    eng_tok_stream_init(&s, t, skip_special);
    size_t cap = 64, len = 0;
    char *buf = malloc(cap);
    if (!buf)
        return td_error(TD_ERR_NO_MEMORY, "decode: no memory");
    for (size_t i = 0; i <= n; i++) {
        if (len + 4096 > cap) {
            while (len + 4096 > cap)
                cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                return td_error(TD_ERR_NO_MEMORY, "decode: no memory");
            }
            buf = nb;
        }
        size_t k;
        if (i == n) {
            k = eng_tok_stream_finish(&s, buf + len, cap - len);
        } else {
            td_status_t rc = eng_tok_stream_push(&s, ids[i], buf + len, cap - len, &k);
            if (rc) {
                free(buf);
                return rc;
            }
        }
        len += k;
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    return TD_OK;
}

/* ---- accessors ---- */

int32_t eng_tokenizer_n_vocab(const eng_tokenizer_t *t) { return t->n_vocab; }
eng_tok_kind_t eng_tokenizer_kind(const eng_tokenizer_t *t) { return t->kind; }
int32_t eng_tokenizer_bos(const eng_tokenizer_t *t) { return t->bos; }
int32_t eng_tokenizer_eos(const eng_tokenizer_t *t) { return t->eos; }
bool eng_tokenizer_adds_bos(const eng_tokenizer_t *t) { return t->add_bos; }
size_t eng_tokenizer_n_merges(const eng_tokenizer_t *t) { return t->n_merges; }
size_t eng_tokenizer_n_special(const eng_tokenizer_t *t) { return t->n_special; }
const char *eng_tokenizer_chat_template(const eng_tokenizer_t *t) { return t->chat_template; }

const char *eng_tokenizer_token_text(const eng_tokenizer_t *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab)
        return NULL;
    if (len)
        *len = t->len[id];
    return t->text[id];
}

eng_tok_type_t eng_tokenizer_token_type(const eng_tokenizer_t *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? (eng_tok_type_t)t->type[id] : ENG_TOK_TYPE_UNDEFINED;
}

size_t eng_tokenizer_eog(const eng_tokenizer_t *t, int32_t *ids, size_t cap)
{
    size_t k = 0;
    for (; k < t->n_eog && k < cap; k++)
        ids[k] = t->eog[k];
    return t->n_eog;
}

void eng_tokenizer_describe(const eng_tokenizer_t *t, char *buf, size_t cap)
{
    char pre[256];
    eng_pretok_describe(t->pre, pre, sizeof pre);
    snprintf(buf, cap, "%s BPE, %d tokens, %zu merges, %zu special, bos=%d eos=%d unk=%d, add_bos=%s, pipeline: %s",
             t->kind == ENG_TOK_BPE_BYTE_LEVEL ? "byte-level" : "sentencepiece", t->n_vocab, t->n_merges,
             t->n_special, t->bos, t->eos, t->unk, t->add_bos ? "yes" : "no", pre);
}
