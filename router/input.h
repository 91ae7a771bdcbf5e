/* input.h — a request's input as the router reads it: the model's
 * tokenizer and chat template, a prompt or chat messages rendered and
 * tokenized, every limit refused naming the field. */
#ifndef RT_INPUT_H
#define RT_INPUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "tandem/v1/tandem.pb-c.h"

/* Limits on a public request, each refused with INVALID_ARGUMENT naming the
 * field (a larger message: RESOURCE_EXHAUSTED before it is parsed). Prompt
 * length is bounded by the model's context once tokenized. */
#define RT_MAX_REQUEST_BYTES (4u << 20)
#define RT_MAX_PROMPT_BYTES (1u << 20)
#define RT_MAX_REQUEST_ID 256
#define RT_MAX_STOP 16
#define RT_MAX_STOP_BYTES 1024
#define RT_MAX_LOGIT_BIAS 1024
#define RT_MAX_CHAT_MESSAGES 4096
#define RT_MAX_CHOICES 16 /* sampling.n */

#define RT_MAX_SERVED_NAMES 8

typedef struct rt_input {
    eng_model_t *model; /* its description and tokenizer (its weights are mapped, never read) */
    eng_chat_t chat;
    bool has_chat; /* the model has a chat template */
    char served[RT_MAX_SERVED_NAMES][128]; /* the names clients use; served[0] is the one listed */
    unsigned n_served;
} rt_input_t;

/* Opens the model at path (its tokenizer and chat template); served: the
 * names it is served under, comma-separated ("" or NULL: the file's name
 * without its extension). A bad list is TD_ERR_CONFIG naming it. */
td_status_t rt_input_open(const char *path, const char *served, rt_input_t *in);
void rt_input_close(rt_input_t *in);

/* The name the model is listed under. */
static inline const char *rt_input_name(const rt_input_t *in) { return in->served[0]; }

/* Whether a request's model names this one: a served name or the model's own. */
bool rt_input_serves(const rt_input_t *in, const char *name);

/* Renders (chat) and tokenizes the input: prompt, or chat when not NULL;
 * *ids is the caller's to free. An error (INVALID_ARGUMENT) names the field
 * in err. */
td_status_t rt_tokenize_input(const rt_input_t *in, const char *prompt, const Tandem__V1__ChatInput *chat,
                              bool parse_special, bool add_bos, int32_t **ids, size_t *n, char *err, size_t errcap);
/* A prompt given as token ids: copied to *ids (the caller's to free) once
 * each is one of the model's; an error names the field in err. */
td_status_t rt_input_ids(const rt_input_t *in, const Tandem__V1__TokenIds *t, int32_t **ids, size_t *n, char *err,
                         size_t errcap);

/* Structured output (sampling.json_schema, json_object, regex, choice): at
 * most one, one that compiles (the workers compile it again, once per
 * source), and no ignore_eos or min_tokens beside it. An error names the
 * field in err (INVALID_ARGUMENT). */
td_status_t rt_input_structured(const Tandem__V1__SamplingParams *sp, char *err, size_t errcap);

/* A public request read whole before it is placed: the model it names, its
 * id, its input tokenized (*ids, the caller's to free, n of them), its
 * sampling (the limits above, structured output, the sampler's ranges over
 * the vocabulary, no empty stop string) and *max_tokens (sampling.max_tokens,
 * or default_max_tokens unset; 0 with prompt_logprobs: the prompt scored
 * alone), which with the prompt must fit the model's context. 0, or the gRPC
 * code with err naming the field (*ids NULL then). */
int rt_input_check(const rt_input_t *in, const Tandem__V1__GenerateRequest *rq, uint32_t default_max_tokens,
                   int32_t **ids, size_t *n, uint32_t *max_tokens, char *err, size_t errcap);

#endif
