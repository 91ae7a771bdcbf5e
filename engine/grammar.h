/* grammar.h — structured output: what a sequence's text must match.
 *
 * A JSON Schema, "any JSON object", a regular expression or a list of
 * strings is compiled once into a context-free grammar over bytes (rules of
 * alternatives of byte sets and rule references, as llama.cpp's GBNF is
 * held). A matcher per sequence keeps the set of parse stacks the text so far
 * leaves open and masks, before each token is sampled, every token whose bytes
 * cannot continue it: the vocabulary is walked in byte order, so tokens that
 * share a prefix share the work of matching it, and a dead prefix skips every
 * token that starts with it. The model's end tokens are allowed only where the
 * text is complete.
 *
 * The JSON Schema subset: type (one or a list), properties (emitted in the
 * schema's order, each one present; extra properties only without
 * properties), items, minItems / maxItems, enum, const, anyOf / oneOf, $ref to
 * #/$defs or #/definitions, minLength / maxLength, pattern; an empty schema
 * is any JSON value. Whitespace between tokens: at most 16 of space, tab or
 * newline. Anything else (allOf, not, if, number bounds, ...) is refused,
 * naming the keyword. */
#ifndef ENG_GRAMMAR_H
#define ENG_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/tokenizer.h"

typedef enum {
    ENG_GRAMMAR_NONE = 0,
    ENG_GRAMMAR_JSON_SCHEMA, /* src: the schema, as JSON text */
    ENG_GRAMMAR_JSON_OBJECT, /* any JSON object */
    ENG_GRAMMAR_REGEX,       /* src: a regular expression the whole text matches */
    ENG_GRAMMAR_CHOICE,      /* one of choices[] exactly */
} eng_grammar_kind_t;

typedef struct eng_grammar eng_grammar_t;

/* Compiles; a user error (TD_ERR_INVALID_ARG) says what in src is wrong or
 * not supported. */
td_status_t eng_grammar_compile(eng_grammar_kind_t kind, const char *src, const char *const *choices,
                                size_t n_choices, eng_grammar_t **out);
void eng_grammar_free(eng_grammar_t *g);
/* Rules and elements, for the record. */
size_t eng_grammar_size(const eng_grammar_t *g);

/* The vocabulary as the matcher walks it: each token's bytes, in byte order
 * (control and unused tokens left out; the model's end tokens kept aside). */
typedef struct eng_vocab_index eng_vocab_index_t;
td_status_t eng_vocab_index_create(const eng_tokenizer_t *tok, const int32_t *eog, size_t n_eog,
                                   eng_vocab_index_t **out);
void eng_vocab_index_free(eng_vocab_index_t *v);

/* One sequence's place in a grammar (g and v outlive it). The masks made
 * are kept in g for other matchers of it (one thread uses g's matchers). */
typedef struct eng_matcher eng_matcher_t;
td_status_t eng_matcher_create(eng_grammar_t *g, const eng_vocab_index_t *v, eng_matcher_t **out);
void eng_matcher_free(eng_matcher_t *m);
/* Sets to -inf the logits (v's vocabulary) of every token that cannot come
 * next; returns how many may. */
size_t eng_matcher_mask(eng_matcher_t *m, float *logits);
/* The same as a bitset: bits ((vocabulary + 7) / 8 bytes) gets token t's
 * bit t % 8 of byte t / 8 set where t may come next (what mask leaves
 * finite); returns how many may. */
size_t eng_matcher_allowed(eng_matcher_t *m, uint8_t *bits);
/* Moves past token tok; false when it cannot come next (the text is then
 * left as it was). An end token is accepted where the text is complete. */
bool eng_matcher_accept(eng_matcher_t *m, int32_t tok);
/* Whether the text so far is complete (an end token may come). */
bool eng_matcher_complete(const eng_matcher_t *m);

#endif
