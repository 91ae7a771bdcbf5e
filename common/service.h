/* service.h — the one skeleton of every long-running tandem process: the
 * router, the prefill and decode workers and the kvstore node each fill in a
 * td_service_t and hand it to td_service_main, which runs what they share in
 * one order (common/process.h has the pieces):
 *
 *   1. logging and gRPC up, the stop signals installed (td_process_init);
 *   2. the settings: defaults, --config FILE, the service's flags
 *      (td_config_from_args), then configured() for what they imply;
 *   3. the cluster's security (td_cluster_tls);
 *   4. start(): the service builds its parts, starts serving (and says so
 *      in the log), and gives the record it is known by in etcd;
 *   5. the record registered under the cluster's lease (td_member_join),
 *      then registered();
 *   6. until a stop signal, tick() every 50 ms beside the membership's own
 *      (a lost lease registers again: out of the membership, not out of
 *      service);
 *   7. the membership left first, so no new work is placed here; drain()
 *      lets the calls in flight end; stop() frees what start() made.
 *
 * stop() runs after a failed or partial start too, so it frees only what
 * was made. Exit codes: 0 after a stop signal; 2 for a usage or settings
 * error (said on stderr with the usage); 1 for any other error, said on
 * stderr as "PROG: what went wrong". */
#ifndef TD_SERVICE_H
#define TD_SERVICE_H

#include <stddef.h>

#include "common/config.h"
#include "common/process.h"
#include "common/rpc.h"
#include "common/status.h"

typedef struct td_service {
    const char *prog;    /* "tandem-kvstore": the log's component and the messages' prefix */
    const char *section; /* its config section ("prefill": a worker takes that role's flags) */
    unsigned procs;      /* which process it is (TD_PROC_*): the flags the config table gives it */
    const char *const *own; /* flags the service takes itself (NULL-terminated; NULL: none), through own_fn */
    td_own_flag_fn own_fn;
    void *own_ctx;
    const char *usage;
    td_config_t *cfg;         /* where the settings are read into */
    td_rpc_tls_t *tls_files;  /* the cluster pair's files (td_cluster_tls) */
    const td_rpc_tls_t **tls; /* set to the internal planes' security, or NULL (plaintext) */
    void *ctx;                /* every hook's first argument */
    /* after the settings are read (may be NULL): checks and derives what
     * they imply; an error is a settings error (exit code 2) */
    td_status_t (*configured)(void *ctx);
    /* builds the parts and starts serving; fills key (key_len bytes) and
     * *value (malloc'd JSON, taken) with its etcd record */
    td_status_t (*start)(void *ctx, char *key, size_t key_len, char **value);
    /* registered (may be NULL): member is its membership until stop() */
    void (*registered)(void *ctx, td_member_t *member);
    void (*tick)(void *ctx);  /* may be NULL */
    void (*drain)(void *ctx); /* may be NULL */
    void (*stop)(void *ctx);
} td_service_t;

/* Runs s as described above; the process's exit code. */
int td_service_main(const td_service_t *s, int argc, char **argv);

#endif
