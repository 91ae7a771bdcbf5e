/* grammar_cache.c — see grammar_cache.h. */
#include "engine/grammar_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* The compiled grammar p asks for, from the cache or compiled into it; its slot (*slot) counts one more user. */
static td_status_t grammar_get(eng_grammar_cache_t *gc, const eng_sampling_t *p, int *slot)
{
    size_t n = 32 + (p->grammar_src ? strlen(p->grammar_src) : 0);
    for (size_t i = 0; i < p->n_grammar_choices; i++)
        n += strlen(p->grammar_choices[i]) + 24;
    char *key = malloc(n);
    if (!key)
        return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    size_t k = (size_t)snprintf(key, n, "%d:%s", (int)p->grammar, p->grammar_src ? p->grammar_src : "");
    for (size_t i = 0; i < p->n_grammar_choices; i++) /* length-prefixed: no two lists share a key */
        k += (size_t)snprintf(key + k, n - k, "|%zu:%s", strlen(p->grammar_choices[i]), p->grammar_choices[i]);
    int free_at = -1;
    for (int i = 0; i < ENG_GRAMMAR_CACHE; i++) {
        struct eng_grammar_slot *g = &gc->slots[i];
        if (g->key && !strcmp(g->key, key)) {
            free(key);
            g->users++;
            g->used = ++gc->clock;
            *slot = i;
            return TD_OK;
        }
        if (!g->users && (free_at < 0 || !g->key || (gc->slots[free_at].key && g->used < gc->slots[free_at].used)))
            free_at = i;
    }
    if (free_at < 0) {
        free(key);
        return td_user_error("structured output: %d different grammars are in use at once, this engine's most",
                             ENG_GRAMMAR_CACHE);
    }
    eng_grammar_t *g;
    td_status_t rc = eng_grammar_compile(p->grammar, p->grammar_src, p->grammar_choices, p->n_grammar_choices, &g);
    if (rc) {
        free(key);
        return rc;
    }
    struct eng_grammar_slot *sl = &gc->slots[free_at];
    free(sl->key);
    eng_grammar_free(sl->g);
    *sl = (struct eng_grammar_slot){key, g, 1, ++gc->clock};
    *slot = free_at;
    return TD_OK;
}

td_status_t eng_grammar_cache_matcher(eng_grammar_cache_t *gc, const eng_sampling_t *p, const eng_tokenizer_t *tok,
                                      const int32_t *eog, size_t n_eog, int *slot, eng_matcher_t **out)
{
    *out = NULL;
    td_status_t rc = grammar_get(gc, p, slot);
    if (!rc && !gc->vocab)
        rc = eng_vocab_index_create(tok, eog, n_eog, &gc->vocab);
    return rc ? rc : eng_matcher_create(gc->slots[*slot].g, gc->vocab, out);
}

void eng_grammar_cache_release(eng_grammar_cache_t *gc, int slot)
{
    if (slot >= 0)
        gc->slots[slot].users--;
}

void eng_grammar_cache_free(eng_grammar_cache_t *gc)
{
    for (int i = 0; i < ENG_GRAMMAR_CACHE; i++) {
        free(gc->slots[i].key);
        eng_grammar_free(gc->slots[i].g);
    }
    eng_vocab_index_free(gc->vocab);
    memset(gc, 0, sizeof *gc);
}
