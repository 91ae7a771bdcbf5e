/* test_grammar.c — structured output's compiler and matcher (engine/grammar.h)
 * on the default model's vocabulary: what compiles and what is refused, texts
 * a grammar takes and does not, and the mask against the matcher token by
 * token: every token the mask allows is one the matcher takes, and no other. */
#include "tests/unit/helpers.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rng.h"
#include "engine/grammar.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

static eng_model_t *model;
static eng_vocab_index_t *vocab;
static int32_t eos;

static void setup(void)
{
    require_default_model();
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &model), TD_OK);
    eos = eng_tokenizer_eos(model->tok);
    cr_assert_eq(eng_vocab_index_create(model->tok, &eos, 1, &vocab), TD_OK);
}

static void teardown(void)
{
    eng_vocab_index_free(vocab);
    eng_model_close(model);
}

TestSuite(grammar, .init = setup, .fini = teardown);

static eng_matcher_t *matcher(eng_grammar_kind_t kind, const char *src, const char *const *choices, size_t n)
{
    eng_grammar_t *g;
    cr_assert_eq(eng_grammar_compile(kind, src, choices, n, &g), TD_OK, "%s", td_last_error());
    eng_matcher_t *m;
    cr_assert_eq(eng_matcher_create(g, vocab, &m), TD_OK);
    return m; /* g is leaked with the test process: it must outlive m */
}

/* Feeds text's tokens; the number taken before one was refused. */
static size_t feed(eng_matcher_t *m, const char *text)
{
    int32_t *ids = NULL;
    size_t cap = 0, n = 0;
    cr_assert_eq(eng_tokenizer_encode(model->tok, text, strlen(text), 0, &ids, &cap, &n), TD_OK);
    size_t i = 0;
    while (i < n && eng_matcher_accept(m, ids[i]))
        i++;
    bool all = i == n;
    free(ids);
    return all ? SIZE_MAX : i;
}

Test(grammar, refusals_name_what_is_wrong)
{
    static const struct { eng_grammar_kind_t k; const char *src, *says; } bad[] = {
        {ENG_GRAMMAR_REGEX, "(ab", "not closed"},
        {ENG_GRAMMAR_REGEX, "a{5,2}", "repetition"},
        {ENG_GRAMMAR_REGEX, "*a", "nothing before it"},
        {ENG_GRAMMAR_REGEX, "[b-a]", "reversed"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"allOf\": [{}]}", "allOf"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"type\": \"strin\"}", "strin"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"$ref\": \"#/$defs/none\"}", "$ref"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{not json", "not JSON"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"type\": \"array\", \"minItems\": 3, \"maxItems\": 1}", "maxItems"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        eng_grammar_t *g = NULL;
        cr_expect_eq(eng_grammar_compile(bad[i].k, bad[i].src, NULL, 0, &g), TD_ERR_INVALID_ARG, "%s", bad[i].src);
        cr_expect(strstr(td_last_error(), bad[i].says), "%s: %s", bad[i].src, td_last_error());
    }
    eng_grammar_t *g = NULL;
    cr_expect_eq(eng_grammar_compile(ENG_GRAMMAR_CHOICE, NULL, NULL, 0, &g), TD_ERR_INVALID_ARG);
}

Test(grammar, texts_taken_and_refused)
{
    static const struct { eng_grammar_kind_t k; const char *src, *yes, *no; } cases[] = {
        {ENG_GRAMMAR_REGEX, "[0-9]{3}-[0-9]{4}", "555-1234", "555-12345"},
        {ENG_GRAMMAR_REGEX, "(cat|dog)s?", "dogs", "cow"},
        {ENG_GRAMMAR_REGEX, "\\w+@\\w+\\.com", "me@example.com", "me@example.org"},
        {ENG_GRAMMAR_REGEX, "caf\xc3\xa9+", "caf\xc3\xa9\xc3\xa9", "cafe"},
        {ENG_GRAMMAR_REGEX, "((ab+)+)+++c", "ababbbabc", "abac"}, /* nested repetition stays small (fuzz_grammar) */
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},"
                                  "\"b\":{\"type\":\"string\"}}}", "{\"a\": 12, \"b\": \"x\\\"y\"}",
         "{\"a\": \"12\"}"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"maxItems\":2}",
         "[true, false]", "[true, false, true]"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"enum\":[\"red\",1,null]}", "null", "blue"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"type\":\"number\"}", "-3.25e+2", "01"},
        {ENG_GRAMMAR_JSON_SCHEMA, "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"kids\":{\"type\":"
                                  "\"array\",\"items\":{\"$ref\":\"#/$defs/t\"}}}}},\"$ref\":\"#/$defs/t\"}",
         "{\"kids\": [{\"kids\": []}, {\"kids\": [{\"kids\": []}]}]}", "{\"kids\": [{}]}"},
        {ENG_GRAMMAR_JSON_OBJECT, NULL, "{\"x\": [1, {\"y\": null}], \"z\": \"\\u00e9\"}", "[1]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        eng_matcher_t *m = matcher(cases[i].k, cases[i].src, NULL, 0);
        cr_expect_eq(feed(m, cases[i].yes), SIZE_MAX, "%s refused %s", cases[i].src, cases[i].yes);
        cr_expect(eng_matcher_complete(m), "%s: %s is not complete", cases[i].src, cases[i].yes);
        cr_expect(eng_matcher_accept(m, eos), "the end token after a complete text");
        eng_matcher_free(m);
        m = matcher(cases[i].k, cases[i].src, NULL, 0);
        size_t took = feed(m, cases[i].no);
        cr_expect(took != SIZE_MAX || !eng_matcher_complete(m), "%s took %s", cases[i].src, cases[i].no);
        eng_matcher_free(m);
    }
    const char *const ch[] = {"yes", "no", "it depends"};
    eng_matcher_t *m = matcher(ENG_GRAMMAR_CHOICE, NULL, ch, 3);
    cr_expect_eq(feed(m, "it depends"), SIZE_MAX);
    cr_expect(eng_matcher_complete(m));
    eng_matcher_free(m);
}

/* Walks a grammar with random allowed tokens; at each step the mask is checked
 * against the matcher for every token (a fresh matcher fed the walk so far). */
static void walk(eng_grammar_kind_t k, const char *src, uint64_t seed, int steps, bool exhaustive)
{
    eng_grammar_t *g;
    cr_assert_eq(eng_grammar_compile(k, src, NULL, 0, &g), TD_OK, "%s", td_last_error());
    eng_matcher_t *m;
    cr_assert_eq(eng_matcher_create(g, vocab, &m), TD_OK);
    int32_t V = eng_tokenizer_n_vocab(model->tok), path[256];
    float *lg = malloc((size_t)V * sizeof *lg);
    uint8_t *bits = malloc(((size_t)V + 7) / 8);
    td_rng_t rng;
    td_rng_seed(&rng, seed);
    int n = 0;
    for (; n < steps; n++) {
        for (int32_t t = 0; t < V; t++)
            lg[t] = 0;
        size_t allowed = eng_matcher_mask(m, lg);
        cr_assert(allowed > 0, "%s: nothing allowed after %d tokens", src, n);
        /* the same as a bitset (the GPU's masked pick): a bit where the mask leaves a logit finite */
        cr_assert_eq(eng_matcher_allowed(m, bits), allowed, "%s step %d: the bitset counts other tokens", src, n);
        for (int32_t t = 0; t < V; t++)
            cr_assert_eq((bits[t >> 3] >> (t & 7)) & 1, !isinf(lg[t]), "%s step %d: token %d's bit", src, n, t);
        if (exhaustive || n % 8 == 0) {
            /* every token the mask refuses, the matcher refuses too (a refusal leaves it as it was); the tokens it
             * allows are taken by a matcher fed the walk so far (all of them, or 300 spread over them) */
            int32_t *ok = malloc((size_t)V * sizeof *ok), n_ok = 0;
            for (int32_t t = 0; t < V; t++) {
                if (!isinf(lg[t]))
                    ok[n_ok++] = t;
                else
                    cr_assert(!eng_matcher_accept(m, t), "%s step %d: the mask refuses %d, the matcher takes it",
                              src, n, t);
            }
            int32_t stride = exhaustive || n_ok <= 300 ? 1 : n_ok / 300;
            for (int32_t i = 0; i < n_ok; i += stride) {
                eng_matcher_t *f;
                cr_assert_eq(eng_matcher_create(g, vocab, &f), TD_OK);
                for (int j = 0; j < n; j++)
                    cr_assert(eng_matcher_accept(f, path[j]));
                cr_assert(eng_matcher_accept(f, ok[i]) || (ok[i] == eos && eng_matcher_complete(f)),
                          "%s step %d: the mask allows %d, the matcher refuses it", src, n, ok[i]);
                eng_matcher_free(f);
            }
            free(ok);
        }
        int32_t pick = -1, nth = (int32_t)(td_rng_u64(&rng) % allowed);
        for (int32_t t = 0; t < V && pick < 0; t++)
            if (!isinf(lg[t]) && nth-- == 0)
                pick = t;
        cr_assert(pick >= 0, "the mask says %zu allowed and has fewer", allowed);
        if (pick == eos)
            break;
        cr_assert(eng_matcher_accept(m, pick), "the mask allowed %d, the matcher refused it", pick);
        path[n] = pick;
    }
    char *text = NULL;
    size_t len = 0;
    cr_assert_eq(eng_tokenizer_decode(model->tok, path, (size_t)n, false, &text, &len), TD_OK);
    for (char *c = text; *c; c++)
        *c = *c == '\n' ? '~' : *c;
    cr_log_info("%s: %d tokens: %s", src ? src : "(json object)", n, text);
    free(text);
    free(lg);
    free(bits);
    eng_matcher_free(m);
    eng_grammar_free(g);
}

Test(grammar, mask_is_what_the_matcher_takes, .timeout = 600)
{
    walk(ENG_GRAMMAR_REGEX, "(ab|a[0-9]+)c{2,3}", 1, 4, true);
    for (uint64_t seed = 1; seed <= 6; seed++) {
        walk(ENG_GRAMMAR_JSON_SCHEMA,
             "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"string\",\"maxLength\":6},\"v\":{\"type\":"
             "\"array\",\"items\":{\"type\":\"number\"},\"maxItems\":3}}}", seed, 60, false);
        walk(ENG_GRAMMAR_JSON_OBJECT, NULL, seed, 60, false);
        walk(ENG_GRAMMAR_REGEX, "[a-z]+( [a-z]+){0,3}\\.", seed, 30, false);
    }
}
