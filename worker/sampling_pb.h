/* sampling_pb.h — the engine's sampling parameters from the public API's
 * SamplingParams (tandem.v1). One converter for the router (which validates
 * a request before placing it) and the workers (which run it). Header-only:
 * the engine library does not depend on the generated protobuf code. */
#ifndef ENG_SAMPLING_PB_H
#define ENG_SAMPLING_PB_H

#include "engine/sampler.h"
#include "tandem/v1/tandem.pb-c.h"

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
}

#endif
