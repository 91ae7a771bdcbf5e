/* grpc.h — the open-loop sender for tandem's gRPC API (tandem.v1.Tandem/
 * Generate, server streaming).
 *
 * The same contract as openai.h: every request goes out at its planned time
 * whatever the server is doing, and every request ends by its deadline. One
 * thread sends on schedule; replies arrive as callbacks of common/rpc's
 * asynchronous client (no thread per request in flight). Calls are fail-fast: an
 * unreachable endpoint or one that stops mid-run fails its requests at once
 * with UNAVAILABLE, counted in the results. Tokens are counted from the
 * token ids each message carries, timed as the message arrives. */
#ifndef BENCH_GRPC_H
#define BENCH_GRPC_H

#include "bench/openai.h"

typedef struct bench_grpc {
    const char *endpoint;       /* HOST:PORT */
    const char *model;          /* GenerateRequest.model, may be NULL */
    const char *tls_ca;         /* PEM the server's certificate chains to; NULL: plaintext */
    double timeout_s;           /* per request (its gRPC deadline) */
    bool ignore_eos;
    bool progress;
} bench_grpc_t;

td_status_t bench_run_grpc(const bench_grpc_t *o, const bench_workload_t *w, bench_result_t *res);

#endif
