/* openai_req.c — see openai_req.h. */
#include "router/openai_req.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h" /* ENG_MAX_STOP_IDS */
#include "router/input.h" /* the request limits (RT_MAX_*) */


static bool bad(rt_oai_error_t *e, const char *param, const char *fmt, const char *what)
{
    snprintf(e->param, sizeof e->param, "%s", param);
    snprintf(e->msg, sizeof e->msg, fmt, param, what);
    return false;
}

/* A JSON string's text; NULL (e set) when it is not a string or holds a NUL,
 * which a C string would cut (tandem does not take text with NULs). */
static const char *str_of(json_t *j, const char *param, rt_oai_error_t *e)
{
    if (!json_is_string(j)) {
        bad(e, param, "%s: must be a string%s", "");
        return NULL;
    }
    const char *s = json_string_value(j);
    if (strlen(s) != json_string_length(j)) {
        snprintf(e->param, sizeof e->param, "%s", param);
        snprintf(e->msg, sizeof e->msg, "%s: a NUL character (U+0000) at byte %zu; tandem does not take text with "
                 "NULs", param, strlen(s));
        return NULL;
    }
    return s;
}

static bool get_num(json_t *o, const char *k, bool *has, double *v, rt_oai_error_t *e)
{
    json_t *j = json_object_get(o, k);
    *has = j && !json_is_null(j);
    if (!*has)
        return true;
    if (!json_is_number(j))
        return bad(e, k, "%s: must be a number%s", "");
    *v = json_number_value(j);
    return true;
}

static bool get_int(json_t *o, const char *k, bool *has, json_int_t *v, rt_oai_error_t *e)
{
    json_t *j = json_object_get(o, k);
    *has = j && !json_is_null(j);
    if (!*has)
        return true;
    if (!json_is_integer(j))
        return bad(e, k, "%s: must be an integer%s", "");
    *v = json_integer_value(j);
    return true;
}

/* Text of a message's content: a string, or an array of {"type":"text","text":...} parts. */
static char *content_text(json_t *c, rt_oai_error_t *e, const char *param)
{
    if (json_is_string(c)) {
        const char *s = str_of(c, param, e);
        return s ? strdup(s) : NULL;
    }
    if (!json_is_array(c)) {
        bad(e, param, "%s: must be a string or an array of text parts%s", "");
        return NULL;
    }
    size_t n = 0, i;
    json_t *p;
    json_array_foreach(c, i, p)
    {
        json_t *t = json_object_get(p, "text");
        if (!json_is_object(p) || !json_is_string(json_object_get(p, "type")) ||
            strcmp(json_string_value(json_object_get(p, "type")), "text") || !json_is_string(t)) {
            bad(e, param, "%s: only text parts ({\"type\": \"text\", \"text\": ...}) are supported%s", "");
            return NULL;
        }
        if (!str_of(t, param, e))
            return NULL;
        n += strlen(json_string_value(t));
    }
    char *s = malloc(n + 1);
    if (!s)
        return NULL;
    s[0] = 0;
    json_array_foreach(c, i, p) strcat(s, json_string_value(json_object_get(p, "text")));
    return s;
}

/* A prompt of token ids (the router checks each is one of the model's). */
static bool prompt_ids(json_t *p, Tandem__V1__GenerateRequest *rq, rt_oai_error_t *e)
{
    size_t n = json_array_size(p), i;
    if (!n)
        return bad(e, "prompt", "%s: empty%s", "");
    Tandem__V1__TokenIds *t = calloc(1, sizeof *t);
    if (t)
        tandem__v1__token_ids__init(t);
    if (!t || !(t->ids = malloc(n * sizeof *t->ids))) {
        free(t);
        return bad(e, "prompt", "%s: no memory%s", "");
    }
    rq->input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT_IDS;
    rq->prompt_ids = t; /* freed with the request from here on */
    json_t *v;
    json_array_foreach(p, i, v)
    {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            char param[48];
            snprintf(param, sizeof param, "prompt[%zu]", i);
            return bad(e, param, "%s: must be a token id (an integer of the model's vocabulary)%s", "");
        }
        t->ids[t->n_ids++] = (int32_t)json_integer_value(v);
    }
    return true;
}

/* The model and the input: a chat's messages or a completion's prompt. */
static bool parse_input(rt_oai_kind_t kind, json_t *b, Tandem__V1__GenerateRequest *rq, rt_oai_error_t *e)
{
    json_t *j;
    if ((j = json_object_get(b, "model")) && !json_is_null(j)) {
        const char *s = str_of(j, "model", e);
        if (!s)
            return false;
        rq->model = strdup(s);
    }
    if (kind == RT_OAI_CHAT) {
        json_t *msgs = json_object_get(b, "messages");
        if (!json_is_array(msgs) || !json_array_size(msgs))
            return bad(e, "messages", "%s: must be a non-empty array of {\"role\", \"content\"}%s", "");
        if (json_array_size(msgs) > RT_MAX_CHAT_MESSAGES)
            return bad(e, "messages", "%s: more than 4096 messages%s", "");
        Tandem__V1__ChatInput *ci = calloc(1, sizeof *ci);
        if (!ci)
            return bad(e, "messages", "%s: no memory%s", "");
        tandem__v1__chat_input__init(ci);
        rq->input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
        rq->chat = ci;
        ci->messages = calloc(json_array_size(msgs), sizeof *ci->messages);
        if (!ci->messages)
            return bad(e, "messages", "%s: no memory%s", "");
        size_t i;
        json_t *m;
        json_array_foreach(msgs, i, m)
        {
            char param[64];
            snprintf(param, sizeof param, "messages[%zu]", i);
            json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
            if (!json_is_object(m) || !json_is_string(role))
                return bad(e, param, "%s: needs a string \"role\"%s", "");
            if (!str_of(role, param, e))
                return false;
            Tandem__V1__ChatMessage *cm = calloc(1, sizeof *cm);
            if (!cm)
                return bad(e, param, "%s: no memory%s", "");
            tandem__v1__chat_message__init(cm);
            ci->messages[ci->n_messages++] = cm;
            cm->role = strdup(json_string_value(role));
            snprintf(param, sizeof param, "messages[%zu].content", i);
            cm->content = json_is_null(content) || !content ? strdup("") : content_text(content, e, param);
            if (!cm->role || !cm->content)
                return e->msg[0] ? false : bad(e, param, "%s: no memory%s", "");
        }
    } else {
        json_t *p = json_object_get(b, "prompt");
        /* one prompt: a string or token ids, alone or as a batch of one ([text] or [[ids]]) */
        if (json_is_array(p) && json_array_size(p) == 1 &&
            (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
            p = json_array_get(p, 0);
        if (json_is_array(p) && json_array_size(p) > 1 &&
            (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
            return bad(e, "prompt", "%s: an array of prompts; this server takes one prompt per request%s", "");
        if (json_is_array(p))
            return prompt_ids(p, rq, e);
        if (!json_is_string(p))
            return bad(e, "prompt", "%s: must be a string or an array of token ids%s", "");
        const char *ps = str_of(p, "prompt", e);
        if (!ps)
            return false;
        rq->input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        rq->prompt = strdup(ps);
    }
    return true;
}

/* The sampling parameters, priority, SLOs, max_tokens, min_tokens, stop_token_ids and ignore_eos. */
static bool parse_sampling(rt_oai_kind_t kind, json_t *b, Tandem__V1__GenerateRequest *rq,
                           Tandem__V1__SamplingParams *sp, rt_oai_error_t *e)
{
    json_t *j;
    /* sampling: OpenAI's defaults (temperature 1, top_p 1), tandem's ranges (the request validates them) */
    bool has;
    double v;
    json_int_t n;
    sp->has_temperature = 1;
    sp->temperature = 1.0f;
    if (!get_num(b, "temperature", &has, &v, e))
        return false;
    if (has)
        sp->temperature = (float)v;
    static const struct { const char *k; size_t off, has_off; } floats[] = {
        {"top_p", offsetof(Tandem__V1__SamplingParams, top_p), offsetof(Tandem__V1__SamplingParams, has_top_p)},
        {"min_p", offsetof(Tandem__V1__SamplingParams, min_p), offsetof(Tandem__V1__SamplingParams, has_min_p)},
        {"presence_penalty", offsetof(Tandem__V1__SamplingParams, presence_penalty),
         offsetof(Tandem__V1__SamplingParams, has_presence_penalty)},
        {"frequency_penalty", offsetof(Tandem__V1__SamplingParams, frequency_penalty),
         offsetof(Tandem__V1__SamplingParams, has_frequency_penalty)},
        {"repetition_penalty", offsetof(Tandem__V1__SamplingParams, repetition_penalty),
         offsetof(Tandem__V1__SamplingParams, has_repetition_penalty)},
    };
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) {
        if (!get_num(b, floats[i].k, &has, &v, e))
            return false;
        if (has) {
            *(float *)(void *)((char *)sp + floats[i].off) = (float)v;
            *(protobuf_c_boolean *)(void *)((char *)sp + floats[i].has_off) = 1;
        }
    }
    if (!get_int(b, "top_k", &has, &n, e))
        return false;
    if (has) {
        if (n < -1 || n > INT32_MAX)
            return bad(e, "top_k", "%s: must be -1, 0 (off) or a positive integer%s", "");
        sp->has_top_k = 1;
        sp->top_k = n < 0 ? 0 : (int32_t)n;
    }
    if (!get_int(b, "seed", &has, &n, e))
        return false;
    if (has) {
        sp->has_seed = 1;
        sp->seed = (uint64_t)n;
    }
    /* n choices, each with its own seed stream (seed + i) */
    _Static_assert(RT_MAX_CHOICES == 16, "the error below says 16");
    if (!get_int(b, "n", &has, &n, e))
        return false;
    if (has && (n < 1 || n > RT_MAX_CHOICES))
        return bad(e, "n", "%s: must be an integer from 1 to 16%s", "");
    if (has) {
        sp->has_n = 1;
        sp->n = (uint32_t)n;
    }
    /* completions' best_of: that many choices run, the n of highest log-probability returned (the HTTP layer
     * picks them: it reads n from the body); their log-probabilities are computed for it */
    json_int_t best_of = 0;
    if (!get_int(b, "best_of", &has, &best_of, e))
        return false;
    json_int_t want = sp->has_n ? (json_int_t)sp->n : 1;
    if (has && best_of != want) {
        json_t *st = json_object_get(b, "stream");
        if (kind != RT_OAI_COMPLETION)
            return bad(e, "best_of", "%s: only for completions%s", "");
        if (best_of < want || best_of > RT_MAX_CHOICES)
            return bad(e, "best_of", "%s: must be from n to 16%s", "");
        if (json_is_true(st))
            return bad(e, "best_of", "%s: cannot be streamed (the best are known at the end)%s", "");
        sp->has_n = 1;
        sp->n = (uint32_t)best_of;
        sp->has_logprobs = sp->logprobs = 1;
    }
    /* vLLM's extension: lower first; tandem's GenerateRequest.priority is higher first */
    if (!get_int(b, "priority", &has, &n, e))
        return false;
    if (has) {
        if (n < -1000000 || n > 1000000)
            return bad(e, "priority", "%s: must be an integer from -1000000 to 1000000 (lower first)%s", "");
        rq->has_priority = 1;
        rq->priority = (int32_t)-n;
    }
    /* tandem's extension, as in GenerateRequest: SLOs tighter than the router's for this request */
    static const struct { const char *k; size_t off, has_off; } slos[] = {
        {"ttft_slo_ms", offsetof(Tandem__V1__GenerateRequest, ttft_slo_ms),
         offsetof(Tandem__V1__GenerateRequest, has_ttft_slo_ms)},
        {"tpot_slo_ms", offsetof(Tandem__V1__GenerateRequest, tpot_slo_ms),
         offsetof(Tandem__V1__GenerateRequest, has_tpot_slo_ms)},
    };
    for (size_t i = 0; i < sizeof slos / sizeof slos[0]; i++) {
        if (!get_int(b, slos[i].k, &has, &n, e))
            return false;
        if (has) {
            if (n < 1 || n > UINT32_MAX)
                return bad(e, slos[i].k, "%s: must be a positive number of milliseconds%s", "");
            *(uint32_t *)(void *)((char *)rq + slos[i].off) = (uint32_t)n;
            *(protobuf_c_boolean *)(void *)((char *)rq + slos[i].has_off) = 1;
        }
    }
    /* completions' echo: the prompt comes back before the completion, with its log-probabilities when logprobs
     * asks for them (then max_tokens may be 0: the prompt scored alone, as evaluation harnesses ask) */
    bool echo = false;
    if ((j = json_object_get(b, "echo")) && !json_is_null(j)) {
        if (!json_is_boolean(j) || (kind != RT_OAI_COMPLETION && json_is_true(j)))
            return bad(e, "echo", "%s: a boolean, for completions%s", "");
        echo = json_is_true(j);
    }
    const char *mt = json_object_get(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if (!get_int(b, mt, &has, &n, e))
        return false;
    if (has) {
        if (n < (echo ? 0 : 1))
            return bad(e, mt, echo ? "%s: must be at least 0%s" : "%s: must be at least 1%s", "");
        if (n > UINT32_MAX)
            return bad(e, mt, "%s: too large (at most the model's context, minus the prompt)%s", "");
        sp->has_max_tokens = 1;
        sp->max_tokens = (uint32_t)n;
    } else if (kind == RT_OAI_COMPLETION) {
        sp->has_max_tokens = 1; /* OpenAI's default for completions */
        sp->max_tokens = 16;
    }
    /* log-probabilities: completions' logprobs = k (the top k too); chat's logprobs: true with top_logprobs = k */
    if ((j = json_object_get(b, "logprobs")) && !json_is_null(j)) {
        if (kind == RT_OAI_COMPLETION) {
            if (!json_is_integer(j) || json_integer_value(j) < 0 || json_integer_value(j) > ENG_MAX_LOGPROBS)
                return bad(e, "logprobs", "%s: must be an integer from 0 to 20%s", "");
            sp->has_logprobs = sp->has_top_logprobs = 1;
            sp->logprobs = 1;
            sp->top_logprobs = (uint32_t)json_integer_value(j);
        } else {
            if (!json_is_boolean(j))
                return bad(e, "logprobs", "%s: must be a boolean%s", "");
            sp->has_logprobs = 1;
            sp->logprobs = json_is_true(j);
        }
    }
    if (!get_int(b, "top_logprobs", &has, &n, e))
        return false;
    if (has) {
        if (kind == RT_OAI_COMPLETION)
            return bad(e, "top_logprobs", "%s: completions take logprobs = k%s", "");
        if (n < 0 || n > ENG_MAX_LOGPROBS)
            return bad(e, "top_logprobs", "%s: must be an integer from 0 to 20%s", "");
        if (n && !sp->logprobs)
            return bad(e, "top_logprobs", "%s: needs logprobs: true%s", "");
        sp->has_top_logprobs = 1;
        sp->top_logprobs = (uint32_t)n;
    }
    /* vLLM's extensions */
    if (!get_int(b, "min_tokens", &has, &n, e))
        return false;
    if (has) {
        if (n < 0 || n > UINT32_MAX)
            return bad(e, "min_tokens", "%s: must be a non-negative integer%s", "");
        sp->has_min_tokens = 1;
        sp->min_tokens = (uint32_t)n;
    }
    if ((j = json_object_get(b, "stop_token_ids")) && !json_is_null(j)) {
        if (!json_is_array(j) || json_array_size(j) > ENG_MAX_STOP_IDS)
            return bad(e, "stop_token_ids", "%s: must be an array of at most 64 token ids%s", "");
        sp->stop_token_ids = calloc(json_array_size(j) + 1, sizeof *sp->stop_token_ids);
        if (!sp->stop_token_ids)
            return bad(e, "stop_token_ids", "%s: no memory%s", "");
        for (size_t i = 0; i < json_array_size(j); i++) {
            json_t *t = json_array_get(j, i);
            if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX)
                return bad(e, "stop_token_ids", "%s: must be an array of token ids%s", "");
            sp->stop_token_ids[sp->n_stop_token_ids++] = (int32_t)json_integer_value(t);
        }
    }
    if ((j = json_object_get(b, "ignore_eos")) && !json_is_null(j)) {
        if (!json_is_boolean(j))
            return bad(e, "ignore_eos", "%s: must be a boolean%s", "");
        sp->has_ignore_eos = 1;
        sp->ignore_eos = json_is_true(j);
    }
    if (echo && (sp->logprobs || !sp->max_tokens)) {
        sp->has_prompt_logprobs = 1;
        sp->prompt_logprobs = 1;
    }
    return true;
}

static bool parse_stop(json_t *b, Tandem__V1__SamplingParams *sp, rt_oai_error_t *e)
{
    json_t *j;
    if ((j = json_object_get(b, "stop")) && !json_is_null(j)) {
        size_t ns = json_is_string(j) ? 1 : json_is_array(j) ? json_array_size(j) : 0;
        if (!json_is_string(j) && !json_is_array(j))
            return bad(e, "stop", "%s: must be a string or an array of strings%s", "");
        if (ns > RT_MAX_STOP)
            return bad(e, "stop", "%s: more than 16 strings%s", "");
        sp->stop = calloc(ns ? ns : 1, sizeof *sp->stop);
        if (!sp->stop)
            return bad(e, "stop", "%s: no memory%s", "");
        for (size_t i = 0; i < ns; i++) {
            json_t *s = json_is_string(j) ? j : json_array_get(j, i);
            const char *st = str_of(s, "stop", e);
            if (!st)
                return false;
            sp->stop[sp->n_stop++] = strdup(st);
        }
    }
    return true;
}

static bool parse_logit_bias(json_t *b, Tandem__V1__SamplingParams *sp, rt_oai_error_t *e)
{
    json_t *j;
    if ((j = json_object_get(b, "logit_bias")) && !json_is_null(j)) {
        if (!json_is_object(j))
            return bad(e, "logit_bias", "%s: must be an object of token id -> bias%s", "");
        if (json_object_size(j) > RT_MAX_LOGIT_BIAS)
            return bad(e, "logit_bias", "%s: more than 1024 entries%s", "");
        sp->logit_bias = calloc(json_object_size(j) + 1, sizeof *sp->logit_bias);
        if (!sp->logit_bias)
            return bad(e, "logit_bias", "%s: no memory%s", "");
        const char *k;
        json_t *bv;
        json_object_foreach(j, k, bv)
        {
            char *end;
            long id = strtol(k, &end, 10);
            if (*end || !k[0] || id < 0 || id > INT32_MAX || !json_is_number(bv))
                return bad(e, "logit_bias", "%s: keys must be token ids and values numbers%s", "");
            Tandem__V1__SamplingParams__LogitBiasEntry *le = malloc(sizeof *le);
            if (!le)
                return bad(e, "logit_bias", "%s: no memory%s", "");
            tandem__v1__sampling_params__logit_bias_entry__init(le);
            le->has_key = le->has_value = 1;
            le->key = (int32_t)id;
            le->value = (float)json_number_value(bv);
            sp->logit_bias[sp->n_logit_bias++] = le;
        }
    }
    return true;
}

/* Structured output: response_format (json_object, json_schema) or vLLM's
 * guided_json, guided_regex, guided_choice — one of them. */
static bool parse_structured(json_t *b, Tandem__V1__SamplingParams *sp, rt_oai_error_t *e)
{
    json_t *j, *schema = NULL;
    const char *by = NULL; /* the field that asked for structured output */
    if ((j = json_object_get(b, "response_format")) && !json_is_null(j)) {
        json_t *t = json_object_get(j, "type");
        const char *type = json_is_object(j) && json_is_string(t) ? json_string_value(t) : "";
        if (!strcmp(type, "json_object")) {
            sp->has_json_object = sp->json_object = 1;
            by = "response_format";
        } else if (!strcmp(type, "json_schema")) {
            json_t *js = json_object_get(j, "json_schema");
            schema = json_object_get(js, "schema");
            if (!json_is_object(js) || !(json_is_object(schema) || json_is_boolean(schema)))
                return bad(e, "response_format", "%s: json_schema needs {\"json_schema\": {\"schema\": {...}}}%s", "");
            by = "response_format";
        } else if (strcmp(type, "text")) {
            return bad(e, "response_format", "%s: type must be text, json_object or json_schema%s", "");
        }
    }
    if ((j = json_object_get(b, "guided_json")) && !json_is_null(j)) {
        if (by)
            return bad(e, "guided_json", "%s: only one of response_format and guided_* may ask for a format%s", "");
        if (!json_is_object(j) && !json_is_string(j))
            return bad(e, "guided_json", "%s: must be a JSON Schema (an object, or its text)%s", "");
        if (json_is_string(j) && !(sp->json_schema = strdup(json_string_value(j))))
            return bad(e, "guided_json", "%s: no memory%s", "");
        schema = json_is_object(j) ? j : NULL;
        by = "guided_json";
    }
    if (schema && !(sp->json_schema = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY)))
        return bad(e, by, "%s: no memory%s", "");
    if ((j = json_object_get(b, "guided_regex")) && !json_is_null(j)) {
        if (by)
            return bad(e, "guided_regex", "%s: only one of response_format and guided_* may ask for a format%s", "");
        const char *re = str_of(j, "guided_regex", e);
        if (!re)
            return false;
        if (!(sp->regex = strdup(re)))
            return bad(e, "guided_regex", "%s: no memory%s", "");
        by = "guided_regex";
    }
    if ((j = json_object_get(b, "guided_choice")) && !json_is_null(j)) {
        if (by)
            return bad(e, "guided_choice", "%s: only one of response_format and guided_* may ask for a format%s", "");
        size_t n = json_array_size(j), i;
        if (!json_is_array(j) || !n || n > 256)
            return bad(e, "guided_choice", "%s: must be an array of 1 to 256 strings%s", "");
        if (!(sp->choice = calloc(n, sizeof *sp->choice)))
            return bad(e, "guided_choice", "%s: no memory%s", "");
        json_t *c;
        json_array_foreach(j, i, c)
        {
            const char *v = str_of(c, "guided_choice", e);
            if (!v)
                return false;
            if (!(sp->choice[sp->n_choice] = strdup(v)))
                return bad(e, "guided_choice", "%s: no memory%s", "");
            sp->n_choice++;
        }
    }
    if ((j = json_object_get(b, "guided_grammar")) && !json_is_null(j))
        return bad(e, "guided_grammar", "%s: grammars are not supported (use guided_json, guided_regex or "
                                        "guided_choice)%s", "");
    return true;
}

/* A function's name by OpenAI's rule (openai_req.h). */
static bool tool_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (!n || n > RT_OAI_TOOL_NAME)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

/* A function's parameters (none stated: any object), a new reference. */
static json_t *params_of(json_t *fn)
{
    json_t *pa = json_object_get(fn, "parameters");
    return json_is_object(pa) ? json_incref(pa) : json_pack("{s:s}", "type", "object");
}

/* The schema a call's text is held to, into sp: fn's parameters, or with fn NULL {"name": one of the tools',
 * "arguments": its parameters} (anyOf). */
static bool call_schema(json_t *tools, json_t *fn, Tandem__V1__SamplingParams *sp, rt_oai_error_t *e)
{
    json_t *schema = fn ? params_of(fn) : json_pack("{s:[]}", "anyOf"), *t;
    size_t i;
    json_array_foreach(fn ? NULL : tools, i, t)
    {
        json_t *f = json_object_get(t, "function");
        json_array_append_new(json_object_get(schema, "anyOf"),
                              json_pack("{s:s, s:{s:{s:O}, s:o}, s:[s, s], s:b}", "type", "object", "properties",
                                        "name", "const", json_object_get(f, "name"), "arguments", params_of(f),
                                        "required", "name", "arguments", "additionalProperties", 0));
    }
    sp->json_schema = schema ? json_dumps(schema, JSON_COMPACT) : NULL;
    json_decref(schema);
    return sp->json_schema || bad(e, "tool_choice", "%s: no memory%s", "");
}

char *rt_oai_read_call(const char *text, char *name, size_t cap)
{
    json_t *j = text ? json_loads(text, 0, NULL) : NULL, *a = json_object_get(j, "arguments");
    const char *nm = json_string_value(json_object_get(j, "name"));
    char *args = nm && strlen(nm) < cap && json_is_object(a) ? json_dumps(a, JSON_COMPACT) : NULL;
    if (args)
        snprintf(name, cap, "%s", nm);
    json_decref(j);
    return args;
}

/* Function calling: tools and tool_choice (openai_req.h); after parse_structured, whose fields it cannot join. */
static bool parse_tools(rt_oai_kind_t kind, json_t *b, Tandem__V1__SamplingParams *sp, rt_oai_opts_t *o,
                        rt_oai_error_t *e)
{
    json_t *tools = json_object_get(b, "tools"), *choice = json_object_get(b, "tool_choice"), *t;
    o->tool[0] = 0;
    o->any_tool = false;
    tools = json_is_null(tools) ? NULL : tools;
    choice = json_is_null(choice) ? NULL : choice;
    if (!tools && !choice)
        return true;
    if (kind != RT_OAI_CHAT)
        return bad(e, tools ? "tools" : "tool_choice", "%s: only chat completions call tools%s", "");
    if (tools && (!json_is_array(tools) || json_array_size(tools) > RT_OAI_MAX_TOOLS)) {
        snprintf(e->param, sizeof e->param, "tools");
        snprintf(e->msg, sizeof e->msg, "tools: must be an array of at most %d tools", RT_OAI_MAX_TOOLS);
        return false;
    }
    size_t n = json_array_size(tools), i;
    json_array_foreach(tools, i, t)
    {
        json_t *f = json_object_get(t, "function"), *nm = json_object_get(f, "name"), *pa = json_object_get(f, "parameters");
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || !type || strcmp(type, "function") || !json_is_object(f) || !json_is_string(nm) ||
            !tool_name_ok(json_string_value(nm)) || (pa && !json_is_null(pa) && !json_is_object(pa))) {
            snprintf(e->param, sizeof e->param, "tools[%zu]", i);
            snprintf(e->msg, sizeof e->msg, "tools[%zu]: must be {\"type\": \"function\", \"function\": {\"name\": "
                     "1 to %d of a-z, A-Z, 0-9, _ and -, \"parameters\": a JSON Schema object}}", i, RT_OAI_TOOL_NAME);
            return false;
        }
    }
    /* the function named: {"type": "function", "function": {"name": ...}} */
    const char *want = json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
    const char *type = json_string_value(json_object_get(choice, "type"));
    const char *mode = json_is_string(choice) ? json_string_value(choice) : !choice ? (n ? "auto" : "none")
                     : want && type && !strcmp(type, "function")            ? "function"
                                                                            : "";
    if (!strcmp(mode, "none"))
        return true; /* answered in text */
    if (!strcmp(mode, "auto"))
        return bad(e, "tool_choice", "%s: auto (the default with tools) needs a parser of the model's own tool-call "
                                     "text, which tandem does not have: name the function ({\"type\": \"function\", "
                                     "\"function\": {\"name\": ...}}), or required, or none%s", "");
    if (strcmp(mode, "required") && strcmp(mode, "function"))
        return bad(e, "tool_choice", "%s: must be none, auto, required or {\"type\": \"function\", \"function\": "
                                     "{\"name\": ...}}%s", "");
    if (sp->json_schema || sp->json_object || sp->regex || sp->n_choice)
        return bad(e, "tool_choice", "%s: a function call's arguments are its structured output; response_format and "
                                     "guided_* cannot be set beside it%s", "");
    if (!strcmp(mode, "required") && !n)
        return bad(e, "tool_choice", "%s: required with no tools%s", "");
    json_t *fn = NULL; /* required over several tools: NULL, any of them */
    json_array_foreach(tools, i, t)
    {
        const char *name = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (!fn && (want ? !strcmp(name, want) : n == 1))
            fn = json_object_get(t, "function");
    }
    if (want && !fn) {
        snprintf(e->param, sizeof e->param, "tool_choice");
        snprintf(e->msg, sizeof e->msg, "tool_choice: no tool is named '%.64s'", want);
        return false;
    }
    if (!call_schema(tools, fn, sp, e))
        return false;
    if (fn)
        snprintf(o->tool, sizeof o->tool, "%s", json_string_value(json_object_get(fn, "name")));
    o->any_tool = !fn;
    return true;
}

static bool parse_stream(json_t *b, bool *stream, bool *include_usage, rt_oai_error_t *e)
{
    json_t *j;
    if ((j = json_object_get(b, "stream")) && !json_is_null(j)) {
        if (!json_is_boolean(j))
            return bad(e, "stream", "%s: must be a boolean%s", "");
        *stream = json_is_true(j);
    }
    json_t *so = json_object_get(b, "stream_options");
    if (so && !json_is_null(so)) {
        json_t *iu = json_object_get(so, "include_usage");
        if (!json_is_object(so) || (iu && !json_is_boolean(iu) && !json_is_null(iu)))
            return bad(e, "stream_options", "%s: must be {\"include_usage\": bool}%s", "");
        if (!*stream)
            return bad(e, "stream_options", "%s: only with stream: true%s", "");
        *include_usage = json_is_true(iu);
    }
    return true;
}

bool rt_oai_parse_json(rt_oai_kind_t kind, json_t *b, const char *request_id, Tandem__V1__GenerateRequest **out,
                       rt_oai_opts_t *o, rt_oai_error_t *e)
{
    Tandem__V1__GenerateRequest *rq = calloc(1, sizeof *rq);
    Tandem__V1__SamplingParams *sp = calloc(1, sizeof *sp);
    if (!rq || !sp) {
        free(rq);
        free(sp);
        snprintf(e->msg, sizeof e->msg, "no memory");
        return false;
    }
    tandem__v1__generate_request__init(rq);
    tandem__v1__sampling_params__init(sp);
    rq->sampling = sp;
    *out = rq;
    if (!parse_input(kind, b, rq, e) || !parse_sampling(kind, b, rq, sp, e) || !parse_stop(b, sp, e) ||
        !parse_logit_bias(b, sp, e) || !parse_structured(b, sp, e) || !parse_tools(kind, b, sp, o, e) ||
        !parse_stream(b, &o->stream, &o->include_usage, e))
        return false;
    rq->request_id = strdup(request_id);
    return true;
}



void rt_oai_body_error(const json_t *b, const json_error_t *je, char *msg, size_t n)
{
    static const char *const kinds[] = {"an object", "an array", "a string", "an integer", "a number", "true",
                                        "false", "null"};
    if (b)
        snprintf(msg, n, "the body is not a JSON object: it is %s", kinds[json_typeof(b)]);
    else
        snprintf(msg, n, "the body is not a JSON object: %s (line %d, column %d)", je->text, je->line, je->column);
}

bool rt_oai_parse(rt_oai_kind_t kind, const char *body, size_t n, const char *request_id,
                  Tandem__V1__GenerateRequest **out, rt_oai_opts_t *o, rt_oai_error_t *e)
{
    *out = NULL;
    json_error_t je;
    json_t *b = json_loadb(body, n, JSON_ALLOW_NUL, &je);
    if (!json_is_object(b)) {
        rt_oai_body_error(b, &je, e->msg, sizeof e->msg);
        json_decref(b);
        e->param[0] = 0;
        return false;
    }
    bool ok = rt_oai_parse_json(kind, b, request_id, out, o, e);
    json_decref(b);
    return ok;
}
