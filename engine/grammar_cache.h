/* grammar_cache.h — an engine's compiled grammars for structured output,
 * by source: up to ENG_GRAMMAR_CACHE at once, each counting the sequences
 * whose matcher holds it, the least recently used one no sequence holds
 * replaced; and the vocabulary's index their matchers read (made at the
 * first request that asks). Internal to the engine. */
#ifndef ENG_GRAMMAR_CACHE_H
#define ENG_GRAMMAR_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/grammar.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

#define ENG_GRAMMAR_CACHE 32 /* grammars an engine keeps compiled */

typedef struct eng_grammar_cache {
    eng_vocab_index_t *vocab;
    struct eng_grammar_slot {
        char *key;
        eng_grammar_t *g;
        uint32_t users;
        uint64_t used;
    } slots[ENG_GRAMMAR_CACHE];
    uint64_t clock;
} eng_grammar_cache_t;

/* A matcher for the grammar p asks for (from the cache or compiled into it;
 * the vocabulary's index made from tok and its end tokens at the first
 * call). *slot is the grammar's, counting one more user, as soon as the
 * grammar is had (eng_grammar_cache_release gives it back, even when the
 * matcher then fails); -1 before. A user error says what is wrong with the
 * grammar. */
td_status_t eng_grammar_cache_matcher(eng_grammar_cache_t *gc, const eng_sampling_t *p, const eng_tokenizer_t *tok,
                                      const int32_t *eog, size_t n_eog, int *slot, eng_matcher_t **out);
/* One user of slot fewer (-1: none). */
void eng_grammar_cache_release(eng_grammar_cache_t *gc, int slot);
void eng_grammar_cache_free(eng_grammar_cache_t *gc);

#endif
