/* outlen.h — the router's prediction of how many tokens a request will
 * generate, learnt online from the requests that ended (TetriInfer's length
 * predictor, without a model of its own).
 *
 * How it works: output lengths are roughly log-normal, so the predictor keeps
 * moving averages of log(1 + output) in cells — for all requests, per
 * prompt-length class (powers of two), per tenant (API key), per tenant and
 * class — and backs off from the general to the specific: each cell moves the
 * estimate towards its own average as far as it has seen ends (20 at most,
 * against 2 for what came before), from a prior at half of max_tokens. A chat
 * whose history holds assistant turns counts their mean length at twice the
 * weight of the rest: a conversation's answers tend to be alike. The
 * prediction is at most max_tokens. Its error over the last 256 ends
 * (|predicted - actual| / actual) is reported as the TTFT predictor's is.
 *
 * Limits: the cells are per router; a tenant whose outputs change length is
 * followed at the averages' pace (a fifth per end). Thread-safe. */
#ifndef RT_OUTLEN_H
#define RT_OUTLEN_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rt_outlen rt_outlen_t;

typedef struct rt_outlen_query {
    const char *tenant;     /* the API key's name (NULL or "": none) */
    uint32_t prompt_tokens;
    uint32_t max_tokens;
    double history_tokens; /* the chat's earlier assistant turns' mean length, in tokens (0: none) */
} rt_outlen_query_t;

td_status_t rt_outlen_create(rt_outlen_t **out);
void rt_outlen_destroy(rt_outlen_t *o);

/* The predicted output tokens, 1 .. max_tokens. */
double rt_outlen_predict(rt_outlen_t *o, const rt_outlen_query_t *q);
/* A request that ended having generated `output` tokens (a finish by length
 * counts as it is: the cap is applied at prediction), and what was predicted
 * for it (0: none, no error recorded). */
void rt_outlen_observe(rt_outlen_t *o, const rt_outlen_query_t *q, double predicted, uint32_t output);
/* The relative error of the last 256 predictions: p50 and p90 (both < 0 when none). */
void rt_outlen_error(rt_outlen_t *o, double *p50, double *p90, uint32_t *n);
/* For Health: the error and the cells' count. */
json_t *rt_outlen_json(rt_outlen_t *o);

#endif
