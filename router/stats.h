/* stats.h — what the router counts of the requests that ended: requests,
 * ok and errors, the router's own time per request (wall and thread CPU
 * time, and how long its steps waited for a pool thread), and a ring of the
 * last ends with their TTFT and TPOT, from which SLO attainment over a
 * window is read (the planner's auto policy, `tandem status`).
 * Thread-safe. */
#ifndef RT_STATS_H
#define RT_STATS_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rt_stats rt_stats_t;

typedef struct rt_slo_window {
    uint32_t n, met, ttft_missed, tpot_missed; /* failed requests count as missing both */
    /* their prompt tokens, and of them those their decode workers prefilled though prefill workers were there
     * (conditional disaggregation) */
    uint64_t prompt_tokens, local_tokens;
    double ttft_p90_ms, tpot_p90_ms;
} rt_slo_window_t;

td_status_t rt_stats_create(rt_stats_t **out);
void rt_stats_destroy(rt_stats_t *s);

/* A request ended (ok: it was served; overhead < 0: none measured, it ended
 * before it was validated). Times in seconds. */
void rt_stats_count(rt_stats_t *s, bool ok, double overhead, double cpu, double handoff);
/* A request that a client waited for ended (ok: it finished; local: its
 * decode worker prefilled its prompt_tokens though prefill workers were
 * there), for rt_stats_window. */
void rt_stats_done(rt_stats_t *s, double ttft_ms, double tpot_ms, bool ok, uint32_t prompt_tokens, bool local);
/* The requests that ended since `since` (td_now_s() time) held to SLOs of
 * ttft_slo_ms and tpot_slo_ms (0: none). */
void rt_stats_window(rt_stats_t *s, double since, double ttft_slo_ms, double tpot_slo_ms, rt_slo_window_t *out);
/* The same, reaching back past since (to floor at most) until it holds
 * min_n requests: when few end (an overloaded worker finishes few), the
 * last ones still say how the SLOs fare. */
void rt_stats_window_n(rt_stats_t *s, double since, double floor, uint32_t min_n, double ttft_slo_ms,
                       double tpot_slo_ms, rt_slo_window_t *out);
/* A request was placed (its first placement): the prompt tokens it
 * computes (local: on its decode worker, though prefill workers were there),
 * the output tokens predicted for it and its context (prompt and half that
 * output), for rt_stats_arrivals: the load on its way, before it ends. */
void rt_stats_arrive(rt_stats_t *s, uint32_t new_tokens, bool local, double out_tokens, double ctx_tokens);
typedef struct rt_arrivals {
    uint32_t n;
    double seconds; /* the window's length (the span the ring holds, where it wrapped within it) */
    double new_tokens, local_tokens, out_tokens, ctx_tokens; /* sums (local_tokens: of new_tokens) */
} rt_arrivals_t;
/* The requests placed since `since` (td_now_s() time). */
void rt_stats_arrivals(rt_stats_t *s, double since, rt_arrivals_t *out);
/* Into j: requests, ok, errors, and the p50/p99/max of the router's time per
 * request (overhead_ms, overhead_cpu_ms, handoff_ms). */
void rt_stats_json(rt_stats_t *s, json_t *j);

#endif
