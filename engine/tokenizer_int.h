/* tokenizer_int.h — the tokenizer's internals, shared by tokenizer.c (the
 * algorithm and the GGUF loader) and tokenizer_json.c (the tokenizer.json loader). */
#ifndef ENG_TOKENIZER_INT_H
#define ENG_TOKENIZER_INT_H

#include "engine/pretok.h"
#include "engine/tokenizer.h"

#define ENG_TOK_MAX_EOG 8

typedef struct tok_special {
    int32_t id;
    bool lstrip, rstrip;
} tok_special_t;

typedef struct tok_pair {
    int32_t a, b, result;
    uint32_t rank;
} tok_pair_t;

struct eng_tokenizer {
    eng_tok_kind_t kind;
    int32_t n_vocab;
    char **text;      /* token texts, NUL-terminated, in `arena` */
    uint32_t *len;
    float *score;     /* SentencePiece scores (NULL: none) */
    uint8_t *type;    /* eng_tok_type_t */
    char *arena;
    size_t arena_len, arena_cap;

    int32_t *map;     /* open addressing: text -> id, -1 empty */
    uint32_t map_mask;
    tok_pair_t *pairs; /* open addressing: (a, b) -> merge; a == -1 empty */
    uint32_t pair_mask;
    size_t n_merges;

    bool ignore_merges;   /* a whole piece that is a token is taken as is (Llama 3) */
    bool byte_fallback;   /* unknown characters become <0xNN> tokens */
    bool fuse_unk;
    bool spm_space_prefix; /* SentencePiece from GGUF: ' ' before text after a special */
    bool strip_decoded_space; /* decoder drops the first leading space */
    bool add_bos, add_eos;
    int32_t unk, bos, eos, eot, pad;
    int32_t eog[ENG_TOK_MAX_EOG];
    size_t n_eog;

    eng_pretok_t *pre;
    tok_special_t *special; /* sorted longest first */
    size_t n_special;
    int32_t byte_tok[256];  /* token of each single byte (byte-level char or <0xNN>), -1 */
    int16_t cp_byte[324];   /* byte-level: codepoint -> byte, -1 */
    char *chat_template;
};

/* Allocates an empty tokenizer for n tokens. */
td_status_t tok_alloc(eng_tokenizer_t **out, int32_t n_vocab, eng_tok_kind_t kind);
/* Sets token id's text (copied). */
td_status_t tok_set_text(eng_tokenizer_t *tok, int32_t id, const char *text, size_t len);
/* Builds the text index, byte tables, special list; after every text is set.
 * `what` names the source in messages. */
td_status_t tok_finish(eng_tokenizer_t *tok, const char *what);
/* Adds a merge of tokens a and b (rank = order of calls). */
td_status_t tok_add_merge(eng_tokenizer_t *tok, int32_t a, int32_t b, const char *what);
td_status_t tok_alloc_pairs(eng_tokenizer_t *tok, size_t n_merges);
void tok_add_eog(eng_tokenizer_t *tok, int32_t id);
/* The GPT-2 byte -> codepoint map. */
uint32_t tok_byte_to_cp(uint8_t b);

#endif
