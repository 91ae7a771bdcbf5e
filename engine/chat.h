/* chat.h — chat templates: turning a conversation into the prompt text the
 * model was trained on.
 *
 * tandem does not run Jinja. It recognises the template families the supported
 * models ship — ChatML (SmolLM2, Qwen2), Llama 3, Llama 2 and Mistral — from
 * the model's own template text, and renders them in C, byte for byte as the
 * Jinja template would (checked against jinja2 in tests). A template of no
 * known family is an error, not a guess. */
#ifndef ENG_CHAT_H
#define ENG_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

typedef struct eng_tokenizer eng_tokenizer_t;

typedef enum eng_chat_kind {
    ENG_CHAT_CHATML, ENG_CHAT_LLAMA3, ENG_CHAT_LLAMA2, ENG_CHAT_MISTRAL,
} eng_chat_kind_t;

typedef struct eng_chat_msg {
    const char *role;    /* system | user | assistant */
    const char *content;
} eng_chat_msg_t;

typedef struct eng_chat {
    eng_chat_kind_t kind;
    char *default_system; /* ChatML: the system turn inserted when none is given (NULL: none) */
    char bos[32];         /* Llama templates begin with the BOS text */
    char eos[32];
} eng_chat_t;

/* Recognises the model's template (NULL or "" for a model with none:
 * TD_ERR_NOT_FOUND). Free with eng_chat_free(). */
td_status_t eng_chat_init(eng_chat_t *chat, const eng_tokenizer_t *tok);
void eng_chat_free(eng_chat_t *chat);
const char *eng_chat_kind_name(eng_chat_kind_t kind);

/* Renders messages (and, if asked, the assistant's generation prompt) into a
 * new string (*out, caller frees). An unknown role or a misplaced system turn
 * is TD_ERR_INVALID_ARG naming the message. */
td_status_t eng_chat_render(const eng_chat_t *chat, const eng_chat_msg_t *msgs, size_t n,
                            bool add_generation_prompt, char **out);

#endif
