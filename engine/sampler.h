/* sampler.h — choosing the next token from logits.
 *
 * The order is the one vLLM and llama.cpp use: logit bias, repetition /
 * presence / frequency penalties over the sequence's tokens, then temperature
 * (0 = greedy), top-k, top-p, min-p, and a draw from a per-request generator
 * seeded by `seed` (same seed, same tokens). Stop conditions (EOS, stop
 * strings, max tokens) are the engine's, not the sampler's. */
#ifndef ENG_SAMPLER_H
#define ENG_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/rng.h"
#include "common/status.h"
#include "engine/grammar.h"
#include "kernels/backend.h"

typedef struct eng_logit_bias {
    int32_t token;
    float bias;
} eng_logit_bias_t;

typedef struct eng_sampling {
    float temperature;        /* 0: greedy */
    int32_t top_k;            /* 0: off */
    float top_p;              /* 1: off; (0, 1] */
    float min_p;              /* 0: off; [0, 1) */
    float repetition_penalty; /* 1: off; > 0 */
    float presence_penalty, frequency_penalty; /* 0: off; [-2, 2] */
    uint64_t seed;
    const eng_logit_bias_t *logit_bias;
    size_t n_logit_bias;
    /* tokens that end the sequence when sampled (their text is kept, as a
     * special token's is dropped: vLLM's stop_token_ids); copied at init */
    const int32_t *stop_ids;
    size_t n_stop_ids;
    /* until this many tokens are sampled, neither the model's end tokens
     * (eng_sampler_set_eog) nor stop_ids are (vLLM's min_tokens); the engine
     * checks no stop condition before it either */
    uint32_t min_tokens;
    /* each sampled token's log-probability and those of the top_logprobs
     * (<= ENG_MAX_LOGPROBS) most likely tokens (eng_sampler_logprobs) */
    bool logprobs;
    uint32_t top_logprobs;
    /* the prompt's tokens' too (each after the first; the same top_logprobs):
     * the prompt is computed whole, not taken from the prefix cache, and
     * max_tokens may be 0 (the prompt scored, nothing generated) */
    bool prompt_logprobs;
    /* structured output (engine/grammar.h): the generated text must match; the
     * engine compiles it (once per source) and masks each step's tokens */
    eng_grammar_kind_t grammar;
    const char *grammar_src;            /* the JSON Schema or regular expression */
    const char *const *grammar_choices; /* ENG_GRAMMAR_CHOICE's strings */
    size_t n_grammar_choices;
} eng_sampling_t;

#define ENG_MAX_STOP_IDS 64
#define ENG_MAX_LOGPROBS 20

/* A sampled token's log-probability and the most likely tokens' (ids and
 * log-probabilities, most likely first) under the model's distribution: the
 * softmax of the raw logits, before logit bias, penalties and temperature
 * (what OpenAI and vLLM report). */
typedef struct eng_logprobs {
    float logprob;
    uint32_t n_top;
    int32_t top_ids[ENG_MAX_LOGPROBS];
    float top[ENG_MAX_LOGPROBS];
} eng_logprobs_t;

/* The defaults: greedy, every filter off. */
eng_sampling_t eng_sampling_default(void);
/* Checks every field; an error names the field and its allowed range. */
td_status_t eng_sampling_validate(const eng_sampling_t *s, int32_t n_vocab);

typedef struct eng_sampler {
    eng_sampling_t p;
    td_rng_t rng;
    float *work;               /* n_vocab scratch */
    int32_t *idx;
    int32_t n_vocab;
    int32_t stop_ids[ENG_MAX_STOP_IDS]; /* p.stop_ids points here */
    int32_t eog[8];            /* the model's end tokens (min_tokens) */
    uint32_t n_eog;
    uint32_t n_sampled;        /* tokens sampled, here or before (eng_sampler_skip) */
    eng_matcher_t *matcher;    /* structured output's place in its grammar (NULL: none) */
} eng_sampler_t;

td_status_t eng_sampler_init(eng_sampler_t *s, const eng_sampling_t *p, int32_t n_vocab);
void eng_sampler_free(eng_sampler_t *s);
/* The model's end tokens, which min_tokens holds back (at most 8). */
void eng_sampler_set_eog(eng_sampler_t *s, const int32_t *eog, uint32_t n);
/* Structured output: m masks each pick and follows each token (taken; freed with s). */
void eng_sampler_set_matcher(eng_sampler_t *s, eng_matcher_t *m);
/* The sequence goes on with tok (sampled here or elsewhere): the grammar's
 * place moves past it; false when tok cannot continue the text. */
bool eng_sampler_accept(eng_sampler_t *s, int32_t tok);
/* Whether tok is one of the request's stop_ids. */
bool eng_sampler_is_stop_id(const eng_sampler_t *s, int32_t tok);
/* Moves past the draws of n samples made elsewhere (one draw per sampled
 * token unless greedy), so a sequence split across processes draws as one. */
void eng_sampler_skip(eng_sampler_t *s, uint32_t n);
/* Picks a token from logits (not modified); history is the sequence so far
 * (prompt and generated) for the penalties. */
int32_t eng_sampler_sample(eng_sampler_t *s, const float *logits, const int32_t *history, size_t n_history);

/* tok's log-probability and the p.top_logprobs most likely tokens' from logits
 * (not modified). */
void eng_sampler_logprobs(eng_sampler_t *s, const float *logits, int32_t tok, eng_logprobs_t *out);
/* The log of the sum of exp(logits[0..n)) (in double: the softmax's normalizer, log-probabilities' base). */
double eng_logsumexp(const float *logits, int32_t n);

/* Whether a backend can pick this sampler's next token (kernels/backend.h's
 * sample): no logit bias, no penalties, no token held back by min_tokens, no
 * log-probabilities asked for. */
bool eng_sampler_on_device(const eng_sampler_t *s);
/* The backend's parameters for the next token, its draw made here (one
 * unless greedy, as eng_sampler_sample draws). With structured output the
 * grammar's allowed tokens go to mask ((vocabulary + 7) / 8 bytes; where
 * none may come, the first end token alone, as eng_sampler_sample ends the
 * text) and the pick is masked. */
kern_sample_t eng_sampler_device(eng_sampler_t *s, uint8_t *mask);
/* Whether the next pick needs a mask (structured output). */
bool eng_sampler_masked(const eng_sampler_t *s);

#endif
