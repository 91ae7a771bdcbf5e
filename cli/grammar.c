/* grammar.c — `tandem grammar MODEL FORMAT [--tokens ID,...]`: which tokens
 * structured output allows, step by step. For the empty text and after each
 * of the tokens given, one JSON line: {"step", "complete", "allowed": [ids]}
 * (the model's end tokens are in it where the text is complete). A token the
 * grammar refuses ends it with an error naming the step. For users checking a
 * schema or a regular expression against a model's vocabulary, and for the
 * tests that compare the masks with another implementation's. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"
#include "engine/grammar.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

const char cli_grammar_usage[] =
    "usage: tandem grammar MODEL (--json-schema SCHEMA | --json-object | --regex RE | --choice STR...)\n"
    "                      [--tokens ID,ID,...]\n"
    "  one JSON line for the empty text and after each token: the step, whether the text is complete, and the\n"
    "  token ids allowed next\n";

static void print_step(size_t step, eng_matcher_t *m, float *logits, int32_t n_vocab)
{
    for (int32_t t = 0; t < n_vocab; t++)
        logits[t] = 0;
    eng_matcher_mask(m, logits);
    printf("{\"step\": %zu, \"complete\": %s, \"allowed\": [", step, eng_matcher_complete(m) ? "true" : "false");
    bool first = true;
    for (int32_t t = 0; t < n_vocab; t++)
        if (!isinf(logits[t])) {
            printf("%s%d", first ? "" : ", ", t);
            first = false;
        }
    printf("]}\n");
}

int cli_grammar(int argc, char **argv)
{
    const char *path = NULL, *src = NULL, *tokens = "";
    const char *choices[256];
    size_t n_choices = 0;
    eng_grammar_kind_t kind = ENG_GRAMMAR_NONE;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *nx = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json-schema") && nx)
            kind = ENG_GRAMMAR_JSON_SCHEMA, src = argv[++i];
        else if (!strcmp(a, "--json-object"))
            kind = ENG_GRAMMAR_JSON_OBJECT;
        else if (!strcmp(a, "--regex") && nx)
            kind = ENG_GRAMMAR_REGEX, src = argv[++i];
        else if (!strcmp(a, "--choice") && nx && n_choices < 256)
            kind = ENG_GRAMMAR_CHOICE, choices[n_choices++] = argv[++i];
        else if (!strcmp(a, "--tokens") && nx)
            tokens = argv[++i];
        else if (a[0] != '-' && !path)
            path = a;
        else {
            fprintf(stderr, "tandem grammar: unexpected argument '%s'\n%s", a, cli_grammar_usage);
            return 2;
        }
    }
    if (!path || kind == ENG_GRAMMAR_NONE) {
        fputs(cli_grammar_usage, stderr);
        return 2;
    }
    eng_model_t *m = NULL;
    eng_grammar_t *g = NULL;
    eng_vocab_index_t *v = NULL;
    eng_matcher_t *mt = NULL;
    float *logits = NULL;
    int rc = 1;
    if (eng_model_open(path, &m) || eng_grammar_compile(kind, src, choices, n_choices, &g)) {
        fprintf(stderr, "tandem grammar: %s\n", td_last_error());
        goto out;
    }
    int32_t n_vocab = eng_tokenizer_n_vocab(m->tok), eog = eng_tokenizer_eos(m->tok);
    if (eng_vocab_index_create(m->tok, &eog, 1, &v) || eng_matcher_create(g, v, &mt) ||
        !(logits = malloc((size_t)n_vocab * sizeof *logits))) {
        fprintf(stderr, "tandem grammar: %s\n", td_last_error());
        goto out;
    }
    size_t step = 0;
    print_step(step, mt, logits, n_vocab);
    for (const char *p = tokens; *p;) {
        char *end;
        errno = 0;
        long id = strtol(p, &end, 10);
        if (end == p || errno || id < 0 || id >= n_vocab) {
            fprintf(stderr, "tandem grammar: --tokens: '%.20s' is not a token id of this model\n", p);
            goto out;
        }
        if (!eng_matcher_accept(mt, (int32_t)id)) {
            fprintf(stderr, "tandem grammar: token %ld (step %zu) does not continue the text\n", id, step + 1);
            goto out;
        }
        print_step(++step, mt, logits, n_vocab);
        p = *end == ',' ? end + 1 : end;
    }
    rc = 0;
out:
    free(logits);
    eng_matcher_free(mt);
    eng_vocab_index_free(v);
    eng_grammar_free(g);
    eng_model_close(m);
    return rc;
}
