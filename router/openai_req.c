/* openai_req.c — see openai_req.h. */
#include "router/openai_req.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
            p = json_array_get(p, 0);
        if (!json_is_string(p))
            return bad(e, "prompt", "%s: must be a string (one prompt per request; token-id prompts are not "
                                    "supported)%s", "");
        const char *ps = str_of(p, "prompt", e);
        if (!ps)
            return false;
        rq->input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        rq->prompt = strdup(ps);
    }
    return true;
}

/* The sampling parameters, priority, SLOs, max_tokens and ignore_eos. */
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
    const char *mt = json_object_get(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if (!get_int(b, mt, &has, &n, e))
        return false;
    if (has) {
        if (n < 1)
            return bad(e, mt, "%s: must be at least 1%s", "");
        if (n > UINT32_MAX)
            return bad(e, mt, "%s: too large (at most the model's context, minus the prompt)%s", "");
        sp->has_max_tokens = 1;
        sp->max_tokens = (uint32_t)n;
    } else if (kind == RT_OAI_COMPLETION) {
        sp->has_max_tokens = 1; /* OpenAI's default for completions */
        sp->max_tokens = 16;
    }
    if ((j = json_object_get(b, "ignore_eos")) && !json_is_null(j)) {
        if (!json_is_boolean(j))
            return bad(e, "ignore_eos", "%s: must be a boolean%s", "");
        sp->has_ignore_eos = 1;
        sp->ignore_eos = json_is_true(j);
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

/* What this server does not do yet (n > 1, logprobs, structured output) is
 * refused naming the field, not ignored. */
static bool refuse_unsupported(json_t *b, rt_oai_error_t *e)
{
    bool has;
    json_int_t n;
    json_t *j;
    if (!get_int(b, "n", &has, &n, e))
        return false;
    if (has && n != 1)
        return bad(e, "n", "%s: only 1 is supported (send one request per completion)%s", "");
    j = json_object_get(b, "logprobs");
    if (j && !json_is_null(j) && !json_is_false(j) && !(json_is_integer(j) && !json_integer_value(j)))
        return bad(e, "logprobs", "%s: not supported by this server (the engine does not return them)%s", "");
    j = json_object_get(b, "top_logprobs");
    if (j && !json_is_null(j) && !(json_is_integer(j) && !json_integer_value(j)))
        return bad(e, "top_logprobs", "%s: not supported by this server%s", "");
    /* structured output does not exist yet: a client asking for JSON is told so, not given prose */
    j = json_object_get(b, "response_format");
    if (j && !json_is_null(j) &&
        !(json_is_object(j) && json_is_string(json_object_get(j, "type")) &&
          !strcmp(json_string_value(json_object_get(j, "type")), "text")))
        return bad(e, "response_format", "%s: only {\"type\": \"text\"} is supported by this server (no structured "
                   "output yet)%s", "");
    static const char *const guided[] = {"guided_json", "guided_regex", "guided_choice", "guided_grammar"};
    for (size_t i = 0; i < sizeof guided / sizeof *guided; i++)
        if ((j = json_object_get(b, guided[i])) && !json_is_null(j))
            return bad(e, guided[i], "%s: not supported by this server (no structured output yet)%s", "");
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
                       bool *stream, bool *include_usage, rt_oai_error_t *e)
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
        !parse_logit_bias(b, sp, e) || !refuse_unsupported(b, e) || !parse_stream(b, stream, include_usage, e))
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
                  Tandem__V1__GenerateRequest **out, bool *stream, bool *include_usage, rt_oai_error_t *e)
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
    bool ok = rt_oai_parse_json(kind, b, request_id, out, stream, include_usage, e);
    json_decref(b);
    return ok;
}
