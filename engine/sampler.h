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
} eng_sampling_t;

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
} eng_sampler_t;

td_status_t eng_sampler_init(eng_sampler_t *s, const eng_sampling_t *p, int32_t n_vocab);
void eng_sampler_free(eng_sampler_t *s);
/* Moves past the draws of n samples made elsewhere (one draw per sampled
 * token unless greedy), so a sequence split across processes draws as one. */
void eng_sampler_skip(eng_sampler_t *s, uint32_t n);
/* Picks a token from logits (not modified); history is the sequence so far
 * (prompt and generated) for the penalties. */
int32_t eng_sampler_sample(eng_sampler_t *s, const float *logits, const int32_t *history, size_t n_history);

/* Whether a backend can pick this sampler's tokens (kernels/backend.h's
 * sample): no logit bias and no penalties. */
bool eng_sampler_on_device(const eng_sampler_t *s);
/* The backend's parameters for the next token, its draw made here (one
 * unless greedy, as eng_sampler_sample draws). */
kern_sample_t eng_sampler_device(eng_sampler_t *s);

#endif
