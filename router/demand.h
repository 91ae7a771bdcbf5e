/* demand.h — the planner's predicted demand (DESIGN.md §7): from the
 * requests placed over a window (the prompt tokens each computes, the output
 * tokens predicted for it: router/outlen.h) and what one worker of each role
 * serves by its profile (rt_table_capacity), the workers each phase needs at
 * that rate. The planner moves on it before SLO misses show — one worker
 * toward the split whose busiest role is least busy, when the busiest is
 * nearly full — and will not make a move the misses ask for that it predicts
 * overloads the role giving the worker up. Pure arithmetic, no locks. */
#ifndef RT_DEMAND_H
#define RT_DEMAND_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/ops.h"
#include "router/placement.h"
#include "router/stats.h"

/* A role is "nearly full" at this predicted utilization (its need over its
 * workers); a move must lower the busiest role's by this share of it. */
#define RT_DEMAND_FULL 0.9
#define RT_DEMAND_GAIN 0.1
/* Arrivals a prediction needs in its window. */
#define RT_DEMAND_MIN_N 4

typedef struct rt_demand {
    bool known;             /* enough arrivals and both roles' capacity known */
    double prefill, decode; /* workers needed: busy-seconds a second of each role's work */
    double prompt_tok_s, output_tok_s; /* the arrivals' rates, for the planner's words */
    /* what it was computed from, known or not (Health shows them): the arrivals and the window, one worker's
     * prompt and output tokens a second */
    uint32_t arrivals;
    double window_s, prefill_cap_tok_s, decode_cap_tok_s;
} rt_demand_t;

/* The need of the arrivals a at the capacities c. Prompt tokens a decode
 * worker prefills itself (local) count as its work, at the prefill
 * workers' rate. */
void rt_demand_of(const rt_arrivals_t *a, const rt_capacity_t *c, rt_demand_t *out);
/* The move d asks of a split of prefill + decode workers within m's bounds:
 * -1 a decode worker becomes a prefill worker, +1 the reverse, 0 none. */
int rt_demand_move(const rt_demand_t *d, uint32_t prefill, uint32_t decode, const td_ops_model_t *m);
/* Whether d forbids move (-1 or +1): after it the role giving up a worker
 * would be over full (utilization above 1) and busier than the busiest role
 * is now. */
bool rt_demand_vetoes(const rt_demand_t *d, int move, uint32_t prefill, uint32_t decode);
/* d in words into why (appended at its length): the rates and the needs. */
void rt_demand_say(const rt_demand_t *d, uint32_t prefill, uint32_t decode, char *why, size_t cap);
#endif
