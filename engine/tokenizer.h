/* tokenizer.h — the model's tokenizer, exactly: byte-level BPE (GPT-2, SmolLM2,
 * Llama 3, Qwen2) and SentencePiece-style BPE with byte fallback (Llama 2,
 * Mistral), read from GGUF metadata or a Hugging Face tokenizer.json.
 *
 * Encoding: invalid UTF-8 is replaced by U+FFFD (one per maximal ill-formed
 * subpart); special and added tokens spelled in the text are matched first
 * (leftmost, longest) when asked; the rest is normalized, pre-tokenized
 * (engine/pretok.h) and merged by BPE — by merge rank when the model has merges,
 * else by token score as SentencePiece does — with byte fallback or <unk> for
 * what the vocabulary cannot spell. Decoding inverts it; the streaming decoder
 * never emits part of a UTF-8 character. */
#ifndef ENG_TOKENIZER_H
#define ENG_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct eng_gguf eng_gguf_t;
typedef struct eng_tokenizer eng_tokenizer_t;

typedef enum eng_tok_kind {
    ENG_TOK_BPE_BYTE_LEVEL, /* GPT-2 bytes-to-unicode alphabet */
    ENG_TOK_BPE_SPM,        /* SentencePiece: '▁' for space, <0xNN> byte fallback */
} eng_tok_kind_t;

/* Token types, as GGUF numbers them. */
typedef enum eng_tok_type {
    ENG_TOK_TYPE_UNDEFINED = 0, ENG_TOK_TYPE_NORMAL = 1, ENG_TOK_TYPE_UNKNOWN = 2,
    ENG_TOK_TYPE_CONTROL = 3, ENG_TOK_TYPE_USER_DEFINED = 4, ENG_TOK_TYPE_UNUSED = 5,
    ENG_TOK_TYPE_BYTE = 6,
} eng_tok_type_t;

enum {
    ENG_TOK_PARSE_SPECIAL = 1 << 0, /* match special/added tokens spelled in the text */
    ENG_TOK_ADD_BOS = 1 << 1,       /* prepend BOS if the model asks for it */
};

td_status_t eng_tokenizer_from_gguf(const eng_gguf_t *g, eng_tokenizer_t **out);
/* Reads a tokenizer.json (and, if given, tokenizer_config.json for BOS/EOS and
 * the chat template). */
td_status_t eng_tokenizer_from_json(const char *tokenizer_json, const char *tokenizer_config_json,
                                    eng_tokenizer_t **out);
void eng_tokenizer_destroy(eng_tokenizer_t *tok);

/* Encodes len bytes of text. *ids is (re)allocated and grows as needed (*cap is
 * its capacity); *n receives the count. */
td_status_t eng_tokenizer_encode(const eng_tokenizer_t *tok, const char *text, size_t len, unsigned flags,
                                 int32_t **ids, size_t *cap, size_t *n);

/* Decodes ids into a new NUL-terminated string (*out, caller frees). Invalid
 * UTF-8 that tokens spell is replaced by U+FFFD. skip_special drops control
 * tokens. An id outside the vocabulary is TD_ERR_OUT_OF_RANGE. */
td_status_t eng_tokenizer_decode(const eng_tokenizer_t *tok, const int32_t *ids, size_t n, bool skip_special,
                                 char **out, size_t *out_len);

/* The raw bytes one token stands for (byte-level alphabet undone, '▁' made a
 * space, <0xNN> made a byte); returns the length, writes at most cap bytes. */
size_t eng_tokenizer_token_bytes(const eng_tokenizer_t *tok, int32_t id, char *buf, size_t cap);

/* Streaming decode: push tokens one at a time, get text that is always whole
 * UTF-8 characters. */
typedef struct eng_tok_stream {
    const eng_tokenizer_t *tok;
    unsigned char pending[8];
    size_t n_pending;
    bool started;
    bool skip_special;
} eng_tok_stream_t;

void eng_tok_stream_init(eng_tok_stream_t *s, const eng_tokenizer_t *tok, bool skip_special);
/* Appends the text token id completes to out (cap bytes; 256 always suffice for
 * one token plus pending bytes) and sets *out_len. */
td_status_t eng_tok_stream_push(eng_tok_stream_t *s, int32_t id, char *out, size_t cap, size_t *out_len);
/* Flushes an incomplete character at the end as U+FFFD. */
size_t eng_tok_stream_finish(eng_tok_stream_t *s, char *out, size_t cap);

/* The vocabulary and its special tokens. */
int32_t eng_tokenizer_n_vocab(const eng_tokenizer_t *tok);
eng_tok_kind_t eng_tokenizer_kind(const eng_tokenizer_t *tok);
/* The token's text as stored in the vocabulary (byte-level or '▁' alphabet). */
const char *eng_tokenizer_token_text(const eng_tokenizer_t *tok, int32_t id, size_t *len);
eng_tok_type_t eng_tokenizer_token_type(const eng_tokenizer_t *tok, int32_t id);
/* The id of a token's exact text, or -1. */
int32_t eng_tokenizer_find(const eng_tokenizer_t *tok, const char *text, size_t len);
int32_t eng_tokenizer_bos(const eng_tokenizer_t *tok);  /* -1 if none */
int32_t eng_tokenizer_eos(const eng_tokenizer_t *tok);
/* End-of-generation tokens (EOS, EOT, <|im_end|>, ...); up to cap, returns count. */
size_t eng_tokenizer_eog(const eng_tokenizer_t *tok, int32_t *ids, size_t cap);
bool eng_tokenizer_adds_bos(const eng_tokenizer_t *tok);
size_t eng_tokenizer_n_merges(const eng_tokenizer_t *tok);
size_t eng_tokenizer_n_special(const eng_tokenizer_t *tok);
/* The chat template the model ships (Jinja text), or NULL. */
const char *eng_tokenizer_chat_template(const eng_tokenizer_t *tok);
/* A one-line summary for `tandem inspect`. */
void eng_tokenizer_describe(const eng_tokenizer_t *tok, char *buf, size_t cap);

#endif
