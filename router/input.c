/* input.c — see input.h. */
#include "router/input.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rpc.h"
#include "engine/grammar.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "worker/sampling_pb.h" /* eng_grammar_kind_of_pb */

/* served into in->served: each name of the comma-separated list, or the
 * file's name without its folder and extension. */
static td_status_t served_names(const char *path, const char *served, rt_input_t *in)
{
    if (!served || !served[0]) {
        char p[PATH_MAX];
        snprintf(p, sizeof p, "%s", path);
        size_t n = strlen(p);
        while (n > 1 && p[n - 1] == '/') /* a folder given with its slash */
            p[--n] = '\0';
        const char *base = strrchr(p, '/') ? strrchr(p, '/') + 1 : p, *dot = strrchr(base, '.');
        size_t len = dot && (!strcmp(dot, ".gguf") || !strcmp(dot, ".safetensors")) ? (size_t)(dot - base)
                                                                                   : strlen(base);
        snprintf(in->served[0], sizeof in->served[0], "%.*s", (int)(len < 127 ? len : 127), base);
        in->n_served = 1;
        return TD_OK;
    }
    size_t total = strlen(served);
    for (const char *p = served;;) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (!n || n >= sizeof in->served[0] || in->n_served == RT_MAX_SERVED_NAMES)
            return td_error(TD_ERR_CONFIG, "router.served_model_names: '%s': %s", served,
                            !n ? "an empty name" : n >= sizeof in->served[0] ? "a name of 128 bytes or more"
                                                                            : "more than 8 names");
        snprintf(in->served[in->n_served++], sizeof in->served[0], "%.*s", (int)n, p);
        if (!e || (size_t)(e + 1 - served) > total)
            return TD_OK;
        p = e + 1;
    }
}

td_status_t rt_input_open(const char *path, const char *served, rt_input_t *in)
{
    memset(in, 0, sizeof *in);
    td_status_t rc = served_names(path, served, in);
    if (rc || (rc = eng_model_open(path, &in->model)))
        return rc;
    in->has_chat = eng_chat_init(&in->chat, in->model->tok) == TD_OK;
    td_clear_error(); /* no template: chat requests are refused, naming the model */
    return TD_OK;
}

bool rt_input_serves(const rt_input_t *in, const char *name)
{
    for (unsigned i = 0; i < in->n_served; i++)
        if (!strcmp(in->served[i], name))
            return true;
    return !strcmp(in->model->desc.name, name);
}

void rt_input_close(rt_input_t *in)
{
    if (in->has_chat)
        eng_chat_free(&in->chat);
    if (in->model)
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

td_status_t rt_input_ids(const rt_input_t *in, const Tandem__V1__TokenIds *t, int32_t **ids, size_t *n, char *err,
                         size_t errcap)
{
    *ids = NULL;
    *n = 0;
    if (!t || !t->n_ids) {
        snprintf(err, errcap, "prompt_ids: empty (at least one token id)");
        return TD_ERR_INVALID_ARG;
    }
    uint32_t vocab = in->model->desc.vocab;
    for (size_t i = 0; i < t->n_ids; i++)
        if (t->ids[i] < 0 || (uint32_t)t->ids[i] >= vocab) {
            snprintf(err, errcap, "prompt_ids[%zu]: %d is not a token id of this model (0 to %u)", i, t->ids[i],
                     vocab - 1);
            return TD_ERR_INVALID_ARG;
        }
    if (!(*ids = malloc(t->n_ids * sizeof **ids)))
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for %zu prompt ids", t->n_ids);
    memcpy(*ids, t->ids, t->n_ids * sizeof **ids);
    *n = t->n_ids;
    return TD_OK;
}

td_status_t rt_input_structured(const Tandem__V1__SamplingParams *sp, char *err, size_t errcap)
{
    static const char *const field[] = {[ENG_GRAMMAR_JSON_SCHEMA] = "json_schema", [ENG_GRAMMAR_JSON_OBJECT] =
                                        "json_object", [ENG_GRAMMAR_REGEX] = "regex", [ENG_GRAMMAR_CHOICE] = "choice"};
    eng_grammar_kind_t k = eng_grammar_kind_of_pb(sp);
    if (k == ENG_GRAMMAR_NONE)
        return TD_OK;
    if (!!sp->json_schema + !!sp->json_object + !!sp->regex + !!sp->n_choice > 1) {
        snprintf(err, errcap, "sampling.%s: set one of json_schema, json_object, regex and choice", field[k]);
        return TD_ERR_INVALID_ARG;
    }
    if (sp->ignore_eos || sp->min_tokens) {
        snprintf(err, errcap, "sampling.%s: structured output ends where its %s is complete; %s cannot be set with it",
                 field[k], field[k], sp->ignore_eos ? "ignore_eos" : "min_tokens");
        return TD_ERR_INVALID_ARG;
    }
    eng_grammar_t *g;
    if (eng_grammar_compile(k, sp->json_schema ? sp->json_schema : sp->regex, (const char *const *)sp->choice,
                            sp->n_choice, &g)) {
        snprintf(err, errcap, "sampling.%s", td_last_error()); /* the compiler's "json_schema: ..." */
        return TD_ERR_INVALID_ARG;
    }
    eng_grammar_free(g);
    return TD_OK;
}

/* The sampling fields' limits and values, against a vocabulary of vocab tokens. */
static bool sampling_ok(const Tandem__V1__SamplingParams *sp, uint32_t vocab, char *err, size_t errcap)
{
    if (sp->n_stop > RT_MAX_STOP)
        return snprintf(err, errcap, "sampling.stop: %zu strings, at most %d", sp->n_stop, RT_MAX_STOP), false;
    for (size_t i = 0; i < sp->n_stop; i++) {
        size_t b = strlen(sp->stop[i]);
        if (!b || b > RT_MAX_STOP_BYTES)
            return snprintf(err, errcap, b ? "sampling.stop[%zu]: %zu bytes, at most %d" : "sampling.stop[%zu]: empty",
                            i, b, RT_MAX_STOP_BYTES),
                   false;
    }
    if (rt_input_structured(sp, err, errcap))
        return false;
    if (sp->has_n && (sp->n < 1 || sp->n > RT_MAX_CHOICES))
        return snprintf(err, errcap, "sampling.n: %u choices; 1 to %d", sp->n, RT_MAX_CHOICES), false;
    if (sp->n_logit_bias > RT_MAX_LOGIT_BIAS)
        return snprintf(err, errcap, "sampling.logit_bias: %zu entries, at most %d", sp->n_logit_bias,
                        RT_MAX_LOGIT_BIAS),
               false;
    eng_logit_bias_t bias[RT_MAX_LOGIT_BIAS]; /* 8 KiB on the stack: the request's thread */
    eng_sampling_t es;
    eng_sampling_from_pb(sp, &es, bias);
    if (eng_sampling_validate(&es, (int32_t)vocab))
        return snprintf(err, errcap, "sampling: %s", td_last_error()), false;
    return true;
}

int rt_input_check(const rt_input_t *in, const Tandem__V1__GenerateRequest *rq, uint32_t default_max_tokens,
                   int32_t **ids, size_t *n, uint32_t *max_tokens, char *err, size_t errcap)
{
    *ids = NULL;
    *n = 0;
    if (rq->model && rq->model[0] && !rt_input_serves(in, rq->model))
        return snprintf(err, errcap, "model: '%s' is not served here (this router serves '%s')", rq->model,
                        rt_input_name(in)),
               TD_RPC_NOT_FOUND;
    if (rq->request_id && strlen(rq->request_id) > RT_MAX_REQUEST_ID)
        return snprintf(err, errcap, "request_id: %zu bytes, at most %d", strlen(rq->request_id), RT_MAX_REQUEST_ID),
               TD_RPC_INVALID_ARGUMENT;
    if (rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT__NOT_SET)
        return snprintf(err, errcap, "input: set prompt, chat or prompt_ids"), TD_RPC_INVALID_ARGUMENT;
    const Tandem__V1__SamplingParams *sp = rq->sampling;
    if (sp && !sampling_ok(sp, in->model->desc.vocab, err, errcap))
        return TD_RPC_INVALID_ARGUMENT;
    /* 0 with prompt_logprobs: the prompt scored alone */
    *max_tokens = sp && (sp->max_tokens || (sp->has_max_tokens && sp->prompt_logprobs)) ? sp->max_tokens
                                                                                         : default_max_tokens;
    if (sp && sp->min_tokens > *max_tokens)
        return snprintf(err, errcap, "sampling.min_tokens: %u is over max_tokens %u", sp->min_tokens, *max_tokens),
               TD_RPC_INVALID_ARGUMENT;
    bool text = rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
    bool chat = rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    td_status_t rc = text || chat ? rt_tokenize_input(in, text ? rq->prompt : NULL, chat ? rq->chat : NULL, false,
                                                      true, ids, n, err, errcap)
                                  : rt_input_ids(in, rq->prompt_ids, ids, n, err, errcap);
    if (rc) {
        if (rc == TD_ERR_NO_MEMORY)
            snprintf(err, errcap, "%s", td_last_error());
        return td_rpc_code_of(rc);
    }
    uint32_t ctxlen = in->model->desc.context ? in->model->desc.context : 4096;
    if (*n + *max_tokens > ctxlen) {
        snprintf(err, errcap, "%s: %zu prompt tokens + max_tokens %u exceed the context of %u tokens",
                 *n >= ctxlen ? "prompt" : "sampling.max_tokens", *n, *max_tokens, ctxlen);
        free(*ids);
        *ids = NULL;
        return TD_RPC_INVALID_ARGUMENT;
    }
    return 0;
}
