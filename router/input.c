/* input.c — see input.h. */
#include "router/input.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/tokenizer.h"

td_status_t rt_input_open(const char *path, rt_input_t *in)
{
    memset(in, 0, sizeof *in);
    td_status_t rc = eng_model_open(path, &in->model);
    if (rc)
        return rc;
    in->has_chat = eng_chat_init(&in->chat, in->model->tok) == TD_OK;
    td_clear_error(); /* no template: chat requests are refused, naming the model */
    return TD_OK;
}

void rt_input_close(rt_input_t *in)
{
    if (in->has_chat)
        eng_chat_free(&in->chat);
    eng_model_close(in->model);
    memset(in, 0, sizeof *in);
}

td_status_t rt_tokenize_input(const rt_input_t *in, const char *prompt, const Tandem__V1__ChatInput *chat,
                              bool parse_special, bool add_bos, int32_t **ids, size_t *n, char *err, size_t errcap)
{
    char *text = NULL;
    const char *input = prompt;
    unsigned flags = add_bos ? ENG_TOK_ADD_BOS : 0;
    if (chat) {
        if (!in->has_chat) {
            snprintf(err, errcap, "chat: the model %s has no chat template; send a prompt", in->model->desc.name);
            return TD_ERR_INVALID_ARG;
        }
        if (!chat->n_messages) {
            snprintf(err, errcap, "chat.messages: empty");
            return TD_ERR_INVALID_ARG;
        }
        if (chat->n_messages > RT_MAX_CHAT_MESSAGES) {
            snprintf(err, errcap, "chat.messages: %zu messages, at most %d", chat->n_messages, RT_MAX_CHAT_MESSAGES);
            return TD_ERR_INVALID_ARG;
        }
        eng_chat_msg_t *msgs = calloc(chat->n_messages, sizeof *msgs);
        if (!msgs)
            return TD_ERR_NO_MEMORY;
        size_t bytes = 0;
        for (size_t i = 0; i < chat->n_messages; i++) {
            msgs[i].role = chat->messages[i]->role ? chat->messages[i]->role : "";
            msgs[i].content = chat->messages[i]->content ? chat->messages[i]->content : "";
            bytes += strlen(msgs[i].content);
        }
        bool agp = chat->has_add_generation_prompt ? chat->add_generation_prompt
                                                   : strcmp(msgs[chat->n_messages - 1].role, "assistant") != 0;
        td_status_t rc = bytes > RT_MAX_PROMPT_BYTES ? TD_ERR_INVALID_ARG
                                                  : eng_chat_render(&in->chat, msgs, chat->n_messages, agp, &text);
        free(msgs);
        if (rc) {
            if (bytes > RT_MAX_PROMPT_BYTES)
                snprintf(err, errcap, "chat.messages: %zu bytes of content, more than the limit of %u", bytes,
                         RT_MAX_PROMPT_BYTES);
            else
                snprintf(err, errcap, "chat.messages: %s", td_last_error());
            return TD_ERR_INVALID_ARG;
        }
        input = text;
        flags |= ENG_TOK_PARSE_SPECIAL;
    } else {
        if (!prompt || !prompt[0]) {
            snprintf(err, errcap, "prompt: empty (set prompt or chat)");
            return TD_ERR_INVALID_ARG;
        }
        if (strlen(prompt) > RT_MAX_PROMPT_BYTES) {
            snprintf(err, errcap, "prompt: %zu bytes, more than the limit of %u", strlen(prompt), RT_MAX_PROMPT_BYTES);
            return TD_ERR_INVALID_ARG;
        }
        if (parse_special)
            flags |= ENG_TOK_PARSE_SPECIAL;
    }
    size_t cap = 0;
    *ids = NULL;
    td_status_t rc = eng_tokenizer_encode(in->model->tok, input, strlen(input), flags, ids, &cap, n);
    free(text);
    if (rc)
        snprintf(err, errcap, "%s: %s", chat ? "chat" : "prompt", td_last_error());
    return rc;
}
