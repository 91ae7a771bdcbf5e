/* profile.h — a worker's measured speed (DESIGN.md §5): a short sweep at
 * start-up, fitted to the two models the router predicts with,
 *
 *   prefill_ms(new, cached) = a + b*new + c*new*(cached + new/2)
 *   step_ms(batch, ctx)     = d0 + d1*batch + d2*batch*ctx
 *
 * (linear work plus the attention term), published with the worker's etcd
 * record. A GPU worker and a CPU worker run the same sweep through their own
 * engine and so publish different coefficients through the same code. */
#ifndef ENG_PROFILE_H
#define ENG_PROFILE_H

#include <jansson.h>
#include <stdint.h>

#include "common/status.h"

typedef struct eng_profile {
    double prefill[3]; /* a, b, c (ms) */
    double decode[3];  /* d0, d1, d2 (ms) */
    double sweep_s;    /* how long the sweep took */
    uint32_t samples;  /* measurements fitted */
    double measured_at; /* when the sweep ran, seconds since the epoch (0: not said) */
} eng_profile_t;

struct eng_engine;
/* Runs the sweep on an idle engine (before it serves: nothing else may use
 * it meanwhile) with random prompts over token ids [lo, hi). The blocks it
 * names stay cached, evictable like any. */
td_status_t eng_profile_measure(struct eng_engine *e, int32_t lo, int32_t hi, eng_profile_t *out);
/* A profile measured before (another start's, kept in a cache) checked on
 * this engine: a cold 128-token prefill's time (the faster of two) over the
 * profile's prediction for it, in *ratio. Same conditions as the sweep. */
td_status_t eng_profile_check(struct eng_engine *e, int32_t lo, int32_t hi, const eng_profile_t *p, double *ratio);
double eng_profile_prefill_ms(const eng_profile_t *p, double new_tokens, double cached_tokens);
double eng_profile_step_ms(const eng_profile_t *p, double batch, double ctx);
/* {"prefill": [a, b, c], "decode": [d0, d1, d2], "sweep_s": s, "samples": n, "measured_at": t} */
json_t *eng_profile_to_json(const eng_profile_t *p);
/* TD_ERR_FORMAT (naming the field) when j is not such an object. */
td_status_t eng_profile_from_json(const json_t *j, eng_profile_t *p);
/* Least squares of y over three regressors (x[i][0..2]); coefficients < 0
 * are set to 0 and the rest refitted, so a prediction never falls with size. */
void eng_profile_fit3(const double (*x)[3], const double *y, uint32_t n, double out[3]);

#endif
