/* pretok.h — text normalization and pre-tokenization: what happens to text
 * before BPE sees it, as a list of steps read from a model's metadata.
 *
 * Normalizers rewrite the whole text (Unicode NFC/NFKC/NFD/NFKD, lowercase,
 * prepend, replace). Pre-tokenizer steps cut it into pieces; each step applies
 * to every piece the previous step made (so a regex's lookahead never sees past
 * its piece), as Hugging Face `tokenizers` and llama.cpp both do. Split by regex
 * uses PCRE2 with Unicode properties. */
#ifndef ENG_PRETOK_H
#define ENG_PRETOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum eng_norm_kind {
    ENG_NORM_NFC, ENG_NORM_NFD, ENG_NORM_NFKC, ENG_NORM_NFKD, ENG_NORM_LOWERCASE,
    ENG_NORM_PREPEND, ENG_NORM_REPLACE,
    ENG_NORM_PREPEND_ONCE, /* prepend unless the text already starts with it */
} eng_norm_kind_t;

/* How a split keeps what the pattern matched (Hugging Face's names). */
typedef enum eng_split_behavior {
    ENG_SPLIT_ISOLATED,             /* matches and the gaps between them are pieces */
    ENG_SPLIT_REMOVED,              /* only the gaps are pieces */
    ENG_SPLIT_MERGED_WITH_PREVIOUS, /* a match ends the piece before it */
    ENG_SPLIT_MERGED_WITH_NEXT,     /* a match starts the piece after it */
} eng_split_behavior_t;

typedef struct eng_pretok eng_pretok_t;

/* An empty pipeline (text passes through as one piece). */
td_status_t eng_pretok_create(eng_pretok_t **out);
void eng_pretok_destroy(eng_pretok_t *p);

td_status_t eng_pretok_add_norm(eng_pretok_t *p, eng_norm_kind_t kind, const char *arg, const char *arg2);
/* A regex split (PCRE2 syntax, Unicode properties on). */
td_status_t eng_pretok_add_split(eng_pretok_t *p, const char *pattern, eng_split_behavior_t behavior, bool invert);
/* A literal-string split. */
td_status_t eng_pretok_add_split_literal(eng_pretok_t *p, const char *literal, eng_split_behavior_t behavior);
/* Adds the regex steps llama.cpp associates with a GGUF `tokenizer.ggml.pre`
 * name; TD_ERR_UNSUPPORTED (logged) for a name we do not know. */
td_status_t eng_pretok_add_gguf_pre(eng_pretok_t *p, const char *pre_name);

/* The GPT-2 regex split that a byte-level pre-tokenizer applies. */
td_status_t eng_pretok_add_byte_level(eng_pretok_t *p);

/* Normalizes text into a new buffer (*out, *out_len; caller frees *out). */
td_status_t eng_pretok_normalize(const eng_pretok_t *p, const char *text, size_t len, char **out, size_t *out_len);

/* A piece: [start, start + len) of the normalized text. */
typedef struct eng_piece {
    uint32_t start, len;
} eng_piece_t;

/* Cuts text into pieces. *pieces is (re)allocated by this call and grows as
 * needed; *cap is its capacity. Returns the count in *n. */
td_status_t eng_pretok_split(const eng_pretok_t *p, const char *text, size_t len, eng_piece_t **pieces,
                             size_t *cap, size_t *n);

/* One line describing the steps, for `tandem inspect`. */
void eng_pretok_describe(const eng_pretok_t *p, char *buf, size_t cap);

/* Replaces invalid UTF-8 in text with U+FFFD, one per maximal ill-formed
 * subpart (as Python's errors='replace' does). Returns a new buffer, or NULL
 * with *out_len unset when text is already valid (use it as is). */
char *eng_utf8_sanitize(const char *text, size_t len, size_t *out_len);
/* Length of the valid UTF-8 sequence at s (1..4), or 0 if s starts an invalid
 * one; n is the bytes available. */
size_t eng_utf8_valid_len(const unsigned char *s, size_t n);

/* Length of the incomplete but so far valid UTF-8 sequence at s (the maximal
 * ill-formed subpart when more bytes do not follow), 0 if s[0] cannot start one
 * or the sequence is complete. */
size_t eng_utf8_partial_len(const unsigned char *s, size_t n);

#endif
