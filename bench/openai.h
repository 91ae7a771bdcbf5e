/* openai.h — the open-loop sender for OpenAI-compatible HTTP servers
 * (/v1/completions, /v1/chat/completions with "stream": true; llama.cpp's
 * server, vLLM, SGLang, tandem's router once it speaks HTTP).
 *
 * Every request is sent at its planned time whatever the server is doing
 * (libcurl's multi interface, one thread), and its Server-Sent Events are
 * timed as they arrive: one token per chunk that carries text. Every request
 * has a deadline (connect 3 s, whole request `timeout_s`); a failure is
 * recorded in its result and the run goes on. */
#ifndef BENCH_OPENAI_H
#define BENCH_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bench/workload.h"
#include "common/status.h"

typedef struct bench_result {
    double t_planned, t_sent;   /* seconds from the run's start */
    double t_first, t_done;     /* first token, end (0: never) */
    uint32_t n_in;              /* prompt tokens (the server's count when it gives one) */
    uint32_t n_out;             /* tokens received */
    uint32_t n_cached;          /* prompt tokens served from a KV cache (the server's count; 0: none or not said) */
    uint32_t n_store_cached;    /* of those, fetched from a KV store */
    double tpot;                /* mean gap between tokens after the first */
    double gap_p90, gap_max;    /* inter-token gaps */
    int status;                 /* HTTP status (openai) or gRPC status code (grpc) */
    bool ok;                    /* finished with success and at least one token */
    bool rejected;              /* refused before any token: HTTP 429/503, gRPC RESOURCE_EXHAUSTED, or an early
                                 * rejection for an SLO (rejected-early header or trailing metadata) */
    char finish[24];            /* finish_reason the server gave */
    double predicted_ttft;      /* the server's placement prediction, seconds (tandem's gRPC Timing; 0: none) */
    double server_ttft;         /* the server's own TTFT, seconds (0: none) */
    uint32_t retry_after_ms;    /* a rejection's retry hint (0: none) */
    char prefill_worker[48];    /* which worker prefilled it ("" unknown) */
    char decode_worker[48];     /* and decoded it: the same one when it prefilled its own request (local) */
    /* the first token's way on the disaggregated path, ms (tandem's gRPC Timing; 0: not said): the Reserve, the
     * Prefill call, the prefill worker's own time in it, the hand-off to the decode worker */
    double reserve_ms, prefill_call_ms, prefill_worker_ms, handoff_ms;
    bool first_token_early; /* the router sent the first token when the prefill answered: the hand-off is not in ttft */
    char error[160];
} bench_result_t;

typedef struct bench_openai {
    const char *endpoint;       /* http://HOST:PORT (the /v1/... path is added) */
    const char *model;          /* "model" field, may be NULL */
    double timeout_s;           /* per request */
    bool ignore_eos;            /* ask for exactly output_len tokens */
    bool progress;              /* a live line on stderr */
} bench_openai_t;

/* Fills r's token figures (n_out, t_first, tpot, gap_p90, gap_max) from the
 * arrival times of its n tokens (seconds from the run's start, ascending);
 * reorders times. Both senders use it. */
void bench_result_times(bench_result_t *r, double *times, uint32_t n);

/* The live progress line both senders print on stderr: redrawn every 0.5 s
 * on a terminal, a log line every 10 s otherwise, and a final line when
 * final is set. *last_print: the time of the last one (seconds). */
void bench_progress(double now, double *last_print, bool final, size_t sent, size_t n, size_t in_flight,
                    size_t done, size_t failed);

/* Runs the workload; res[i] is request i's result. Returns TD_OK even when
 * requests fail (they are counted in the results). */
td_status_t bench_run_openai(const bench_openai_t *o, const bench_workload_t *w, bench_result_t *res);

#endif
