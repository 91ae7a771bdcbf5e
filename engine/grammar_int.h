/* grammar_int.h — what the compiler (grammar.c) and the matcher
 * (grammar_match.c) share: the rules' elements and a compiled grammar. */
#ifndef ENG_GRAMMAR_INT_H
#define ENG_GRAMMAR_INT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/grammar.h"

enum { E_END, E_ALT, E_SET, E_REF };

typedef struct elem {
    uint8_t kind;
    uint32_t v; /* E_SET: the set; E_REF: the rule */
} elem_t;

/* A mask made once for a set of parse stacks (its signature: each stack's
 * positions, top first), kept for the next text that leaves the same set: a
 * sequence inside a JSON string, or a batch of sequences at the same place of
 * one schema, asks the same mask again and again. */
#define GRAMMAR_MASKS 64

typedef struct mask_entry {
    uint64_t hash, used;
    uint32_t *sig;
    size_t n_sig, cap_sig;
    uint8_t *bits; /* the tokens allowed, a bit each */
    size_t n_ok;
} mask_entry_t;

struct eng_grammar {
    elem_t *el;
    size_t n_el, cap_el;
    uint32_t *rule_at; /* each rule's first element */
    uint8_t (*sets)[32];
    size_t n_sets, cap_sets;
    size_t n_rules;
    mask_entry_t masks[GRAMMAR_MASKS]; /* the matchers' (one engine thread's) */
    uint64_t mask_clock;
    int32_t mask_vocab;                /* the vocabulary the masks are of (0: none yet) */
};

#endif
