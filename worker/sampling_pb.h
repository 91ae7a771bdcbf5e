/* sampling_pb.h — the engine's sampling parameters from the public API's
 * SamplingParams (tandem.v1). One converter for the router (which validates
 * a request before placing it) and the workers (which run it). Header-only:
 * the engine library does not depend on the generated protobuf code. */
#ifndef ENG_SAMPLING_PB_H
#define ENG_SAMPLING_PB_H

#include <stdlib.h>

#include "engine/sampler.h"
#include "tandem/v1/tandem.pb-c.h"

/* The structured output p asks for: the first of its kinds set (the router refuses more than one). */
static inline eng_grammar_kind_t eng_grammar_kind_of_pb(const Tandem__V1__SamplingParams *p)
{
    return p->json_schema ? ENG_GRAMMAR_JSON_SCHEMA
           : p->json_object ? ENG_GRAMMAR_JSON_OBJECT
           : p->regex       ? ENG_GRAMMAR_REGEX
           : p->n_choice    ? ENG_GRAMMAR_CHOICE
                            : ENG_GRAMMAR_NONE;
}

/* bias: room for p->n_logit_bias entries, outliving *s. p NULL: defaults. */
static inline void eng_sampling_from_pb(const Tandem__V1__SamplingParams *p, eng_sampling_t *s,
                                        eng_logit_bias_t *bias)
{
    *s = eng_sampling_default();
    if (!p)
        return;
    s->temperature = p->temperature;
    s->top_k = p->top_k;
    s->top_p = p->top_p;
    s->min_p = p->min_p;
    s->repetition_penalty = p->repetition_penalty;
    s->presence_penalty = p->presence_penalty;
    s->frequency_penalty = p->frequency_penalty;
    s->seed = p->seed;
    for (size_t i = 0; i < p->n_logit_bias; i++)
        bias[i] = (eng_logit_bias_t){p->logit_bias[i]->key, p->logit_bias[i]->value};
    s->logit_bias = p->n_logit_bias ? bias : NULL;
    s->n_logit_bias = p->n_logit_bias;
    s->stop_ids = p->stop_token_ids;
    s->n_stop_ids = p->n_stop_token_ids;
    s->min_tokens = p->min_tokens;
    s->logprobs = p->logprobs;
    s->top_logprobs = p->top_logprobs;
    s->prompt_logprobs = p->prompt_logprobs;
    s->grammar = eng_grammar_kind_of_pb(p);
    s->grammar_src = p->json_schema ? p->json_schema : p->regex;
    s->grammar_choices = (const char *const *)p->choice;
    s->n_grammar_choices = p->n_choice;
}

/* The other way, for a client: s's structured output into p (pointers to s's strings). */
static inline void eng_sampling_grammar_to_pb(const eng_sampling_t *s, Tandem__V1__SamplingParams *p)
{
    if (s->grammar == ENG_GRAMMAR_JSON_SCHEMA)
        p->json_schema = (char *)s->grammar_src;
    if (s->grammar == ENG_GRAMMAR_REGEX)
        p->regex = (char *)s->grammar_src;
    p->has_json_object = p->json_object = s->grammar == ENG_GRAMMAR_JSON_OBJECT;
    if (s->grammar == ENG_GRAMMAR_CHOICE) {
        p->choice = (char **)s->grammar_choices;
        p->n_choice = s->n_grammar_choices;
    }
}

/* A token's log-probabilities (lp NULL: none) into msg, its top ones' messages into tops and their pointers into
 * top_ptrs (lp->n_top of each, the caller's storage). */
static inline void eng_logprob_fill(Tandem__V1__TokenLogprob *msg, int32_t token, const eng_logprobs_t *lp,
                                    Tandem__V1__TokenLogprob *tops, Tandem__V1__TokenLogprob **top_ptrs)
{
    tandem__v1__token_logprob__init(msg);
    msg->has_token_id = 1;
    msg->token_id = token;
    if (!lp)
        return;
    msg->has_logprob = 1;
    msg->logprob = lp->logprob;
    for (uint32_t k = 0; k < lp->n_top; k++) {
        tandem__v1__token_logprob__init(&tops[k]);
        tops[k].has_token_id = tops[k].has_logprob = 1;
        tops[k].token_id = lp->top_ids[k];
        tops[k].logprob = lp->top[k];
        top_ptrs[k] = &tops[k];
    }
    msg->n_top = lp->n_top;
    msg->top = top_ptrs;
}

/* A prompt's log-probabilities as the API carries them: one message a prompt token, ids[0 .. n] (n + 1 of them),
 * the first without a log-probability, the others lp[0 .. n)'s. One allocation (*mem, free() it after packing)
 * holds the messages; *out is the array of n + 1 pointers into it. */
static inline td_status_t eng_prompt_logprobs_to_pb(const int32_t *ids, const eng_logprobs_t *lp, uint32_t n,
                                                    void **mem, Tandem__V1__TokenLogprob ***out)
{
    size_t tops = 0;
    for (uint32_t i = 0; i < n; i++)
        tops += lp[i].n_top;
    const size_t msgs_n = (size_t)n + 1 + tops;
    char *m = malloc(msgs_n * (sizeof(Tandem__V1__TokenLogprob) + sizeof(void *)) + 16);
    if (!m)
        return TD_ERR_NO_MEMORY;
    Tandem__V1__TokenLogprob **ptrs = (Tandem__V1__TokenLogprob **)(void *)m, **tptrs = ptrs + n + 1;
    Tandem__V1__TokenLogprob *msgs = (Tandem__V1__TokenLogprob *)(void *)(ptrs + msgs_n), *tmsgs = msgs + n + 1;
    for (uint32_t i = 0; i <= n; i++) {
        const eng_logprobs_t *l = i ? &lp[i - 1] : NULL;
        eng_logprob_fill(&msgs[i], ids[i], l, tmsgs, tptrs);
        ptrs[i] = &msgs[i];
        tmsgs += l ? l->n_top : 0;
        tptrs += l ? l->n_top : 0;
    }
    *mem = m;
    *out = ptrs;
    return TD_OK;
}

/* A token's log-probabilities as the API carries them (tandem.v1.TokenLogprob), in out's storage. */
typedef struct eng_logprob_pb {
    Tandem__V1__TokenLogprob tok, top[ENG_MAX_LOGPROBS];
    Tandem__V1__TokenLogprob *ptrs[ENG_MAX_LOGPROBS];
} eng_logprob_pb_t;

static inline Tandem__V1__TokenLogprob *eng_logprob_to_pb(int32_t token, const eng_logprobs_t *lp,
                                                          eng_logprob_pb_t *out)
{
    eng_logprob_fill(&out->tok, token, lp, out->top, out->ptrs);
    return &out->tok;
}

#endif
