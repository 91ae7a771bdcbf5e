/* demand.c — see demand.h. */
#include "router/demand.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void rt_demand_of(const rt_arrivals_t *a, const rt_capacity_t *c, rt_demand_t *out)
{
    *out = (rt_demand_t){.arrivals = a->n, .window_s = a->seconds, .prefill_cap_tok_s = c->prefill_tok_s,
                         .decode_cap_tok_s = c->decode_tok_s};
    if (a->n < RT_DEMAND_MIN_N || a->seconds <= 0 || c->prefill_tok_s <= 0 || c->decode_tok_s <= 0)
        return;
    out->known = true;
    out->prompt_tok_s = a->new_tokens / a->seconds;
    out->output_tok_s = a->out_tokens / a->seconds;
    double remote = a->new_tokens - a->local_tokens;
    out->prefill = remote / a->seconds / c->prefill_tok_s;
    out->decode = out->output_tok_s / c->decode_tok_s + a->local_tokens / a->seconds / c->prefill_tok_s;
}

/* The busiest role's utilization at a split (a role of no workers with work is infinitely busy). */
static double busiest(const rt_demand_t *d, double prefill, double decode)
{
    double up = prefill > 0 ? d->prefill / prefill : d->prefill > 0 ? INFINITY : 0;
    double ud = decode > 0 ? d->decode / decode : d->decode > 0 ? INFINITY : 0;
    return fmax(up, ud);
}

int rt_demand_move(const rt_demand_t *d, uint32_t prefill, uint32_t decode, const td_ops_model_t *m)
{
    if (!d->known)
        return 0;
    double now = busiest(d, prefill, decode);
    if (now < RT_DEMAND_FULL)
        return 0;
    double to_prefill = decode > m->min_decode && prefill < m->max_prefill ? busiest(d, prefill + 1, decode - 1)
                                                                           : INFINITY;
    double to_decode = prefill > m->min_prefill && decode < m->max_decode ? busiest(d, prefill - 1, decode + 1)
                                                                          : INFINITY;
    double best = fmin(to_prefill, to_decode);
    if (!(best <= now * (1 - RT_DEMAND_GAIN)))
        return 0;
    return to_prefill <= to_decode ? -1 : +1;
}

bool rt_demand_vetoes(const rt_demand_t *d, int move, uint32_t prefill, uint32_t decode)
{
    if (!d->known || !move)
        return false;
    double now = busiest(d, prefill, decode);
    if (move < 0)
        return decode > 1 && d->decode / (decode - 1) > 1 && d->decode / (decode - 1) > now;
    return prefill > 1 && d->prefill / (prefill - 1) > 1 && d->prefill / (prefill - 1) > now;
}

void rt_demand_say(const rt_demand_t *d, uint32_t prefill, uint32_t decode, char *why, size_t cap)
{
    size_t n = strlen(why);
    if (n >= cap || !d->known)
        return;
    snprintf(why + n, cap - n, "; predicted: %.0f prompt + %.0f output tokens/s need %.2f prefill + %.2f decode "
             "workers (%.0f%% / %.0f%% busy)", d->prompt_tok_s, d->output_tok_s, d->prefill, d->decode,
             prefill ? 100 * d->prefill / prefill : 0.0, decode ? 100 * d->decode / decode : 0.0);
}
