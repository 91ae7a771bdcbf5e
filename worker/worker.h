/* worker.h — what the prefill and the decode worker processes share: the
 * engine loop thread and the process skeleton around it (DESIGN.md §2, §6).
 *
 * Both roles run the same engine, so a worker can later switch role. The
 * engine thread owns the engine: RPC handler threads never touch it; they
 * hand it closures (eng_worker_call, which waits for the result) and receive
 * its events through listeners registered per request id. Events of a step
 * are delivered after the role's after-step hook has run (the prefill worker
 * makes sure the step's KV has landed before anyone hears of its token).
 *
 * The skeleton: parse flags and the YAML config, open the model, make the KV
 * pool in UCX-allocated memory (peers put into it), start the engine thread
 * and the gRPC server, register in etcd under a lease kept alive, and on
 * SIGTERM/SIGINT drain: leave etcd, let running calls finish, stop. */
#ifndef ENG_WORKER_H
#define ENG_WORKER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/config.h"
#include "common/etcd.h"
#include "common/kv_contract.h"
#include "common/kv_contract_pb.h"
#include "common/rpc.h"
#include "engine/engine.h"
#include "worker/sampling_pb.h"
#include "kvstore/client.h"
#include "kvstore/transfer.h"
#include "tandem/internal/v1/worker.pb-c.h"

typedef struct eng_worker eng_worker_t;

/* Engine-thread callbacks of a role. */
typedef struct eng_worker_role {
    const char *name;                                    /* "prefill" | "decode" */
    td_status_t (*attach)(eng_worker_t *w, void *ctx);   /* after the engine exists, before serving */
    void (*before_step)(eng_worker_t *w, void *ctx);     /* optional */
    void (*after_step)(eng_worker_t *w, void *ctx);      /* optional */
    void (*stats)(eng_worker_t *w, void *ctx, Tandem__Internal__V1__StatsResponse *r); /* optional, engine thread */
    void (*detach)(eng_worker_t *w, void *ctx);          /* optional: at exit, the engine thread stopped, the
                                                          * transport still up (after a successful attach) */
    void *ctx;
} eng_worker_role_t;

/* Parses argv, builds everything, serves until a signal, drains; returns
 * the process exit code. The role registers its gRPC methods in attach. */
int eng_worker_main(int argc, char **argv, eng_worker_role_t *role);

/* ---- for the role code ---- */
eng_engine_t *eng_worker_engine(eng_worker_t *w);           /* engine thread only */
void *eng_worker_role_ctx(eng_worker_t *w);                 /* the role's state (eng_worker_role_t.ctx) */
td_rpc_server_t *eng_worker_server(eng_worker_t *w);
const char *eng_worker_id(const eng_worker_t *w);
td_kv_layout_t eng_worker_contract(const eng_worker_t *w);
const kv_transport_ops_t *eng_worker_transport(eng_worker_t *w, kv_xfer_t **x);
/* Engine thread, on a target: pool blocks blocks[0..n) that peers put
 * (their initiator flushed) are made visible to the engine
 * (kv_transport_ops_t.landed; nothing to do for most transports). */
td_status_t eng_worker_kv_landed(eng_worker_t *w, const int32_t *blocks, uint32_t n);
/* The transport's description of this worker's pool (address, and its first region's remote key, base address
 * and length); constant once serving. */
void eng_worker_pool_desc(eng_worker_t *w, const void **addr, size_t *addr_len, const void **rkey, size_t *rkey_len,
                          uint64_t *base, uint64_t *len);
/* The pool's regions: one, or one a rank's part (a decode worker of tensor-parallel ranks, each holding KV heads
 * [head0, head0 + heads) of every block); region i, constant once serving. */
typedef struct eng_pool_region {
    const void *rkey;
    size_t rkey_len;
    uint64_t base, len;
    uint32_t head0, heads;
} eng_pool_region_t;
uint32_t eng_worker_pool_regions(const eng_worker_t *w);
eng_pool_region_t eng_worker_pool_region(eng_worker_t *w, uint32_t i);
const eng_model_t *eng_worker_model(const eng_worker_t *w);
/* The process's configuration (the file with the flags over it); constant. */
const td_config_t *eng_worker_config(const eng_worker_t *w);
/* The internal planes' certificate files, or NULL under cluster.plaintext. */
const td_rpc_tls_t *eng_worker_tls(const eng_worker_t *w);

/* The KV store's client (kvstore.use), or NULL: not configured, or none
 * could be set up. Every full block the pool names is published to the store
 * write-behind, after the step that named it (its events delivered first):
 * a prefill worker's prompt blocks, a decode worker's answer blocks (a
 * conversation's next turn finds them), so a block the pool evicts was
 * offered to the store before. Stats counts them (store_offered, store_new,
 * store_unpublished). */
kv_client_t *eng_worker_store(eng_worker_t *w);
/* Engine thread: eng_kv_publish for a block whose bytes came from the store
 * (not published back). */
int32_t eng_worker_kv_adopt(eng_worker_t *w, int32_t block, td_block_name_t name);

/* Runs fn(w, arg) on the engine thread; waits for it (TD_ERR_TIMEOUT after
 * timeout_s, the closure still runs later: arg must outlive it — keep it in
 * the request object). */
td_status_t eng_worker_call(eng_worker_t *w, void (*fn)(eng_worker_t *w, void *arg), void *arg, double timeout_s);
/* The same, for an arg the caller would free: on TD_ERR_TIMEOUT it becomes
 * the closure's, and the engine thread calls drop(arg) once fn has run. */
td_status_t eng_worker_call_or_drop(eng_worker_t *w, void (*fn)(eng_worker_t *w, void *arg), void *arg,
                                    void (*drop)(void *arg), double timeout_s);
/* Engine thread: events of request id go to fn(ctx, ev) until its finish.
 * TD_ERR_NO_MEMORY (nothing registered): the caller must end the request. */
td_status_t eng_worker_listen(eng_worker_t *w, uint64_t id, eng_event_fn fn, void *ctx);
void eng_worker_unlisten(eng_worker_t *w, uint64_t id);

#endif
