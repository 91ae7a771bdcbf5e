/* config.h — the one YAML configuration file, one section per role (log,
 * model, router, prefill, decode, kvstore, etcd, cluster, transport,
 * metrics).
 *
 * Every key is written once, in the table of common/config.c: its name,
 * type, place in td_config_t, default, bounds or choices, the command-line
 * flag that sets it and the processes that take that flag, and what it sets.
 * The defaults, the file's reader (a libcyaml schema built from the table),
 * each process's flags, the bounds' messages, every process's --help, and
 * deploy/tandem.yaml and docs/configuration.md (`tandem config`; test_config
 * checks both are what it writes) come from it.
 *
 * Every key is optional; what is absent keeps its default. An unknown key
 * or a value of the wrong type is an error that names the key and its line.
 * Command-line flags override the file with td_config_set("section.key",
 * "value"). */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#define KV_REPLICAS_LIMIT 4 /* kvstore.replicas_max at most */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

/* The default model (deploy/install-deps.sh puts it there), relative to the working directory. */
#define TD_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* A worker role's section (prefill, decode). colocated (decode only): the
 * worker also serves whole requests, prefill included, in its own engine
 * (a cluster without prefill workers: the ops config's colocated models). */
typedef struct td_worker_config {
    uint32_t count, threads, token_budget;
    uint64_t kv_mib;
    bool profile, colocated;
    char *device;
    char *queue; /* the order waiting prompts are computed in (engine/sched.h) */
    uint32_t queue_levels, queue_quantum, queue_age_ms;
    uint64_t swap_mib; /* host memory preempted sequences' KV may wait in */
    uint32_t tp;       /* tensor-parallel ranks of each worker (engine/tp.h) */
} td_worker_config_t;

/* A device name: "cpu" (*cuda -1), "cuda" (*cuda 0) or "cuda:N" (*cuda N,
 * 0..1023); false for anything else. */
bool td_device_parse(const char *s, int *cuda);
/* A role's device setting may list several, comma-separated ("cuda:0,cuda:1"):
 * tandem up gives its k-th worker of the role the (k mod count)-th. Puts that
 * one in out (n bytes) and returns the count, or 0 when an entry is no
 * device name (or too long for out). */
unsigned td_device_pick(const char *list, unsigned k, char *out, size_t n);
/* The same for workers of `per` tensor-parallel ranks: the k-th gets entries k * per .. k * per + per - 1 (round
 * the list), comma-separated in out ("cuda:2,cuda:3": a GPU a rank). */
unsigned td_device_group(const char *list, unsigned k, unsigned per, char *out, size_t n);

typedef struct td_config {
    struct { char *level, *format; } log;
    struct { char *path, *kv_dtype, *numerics, *weights, *load_format; uint32_t block_tokens, context; } model;
    struct {
        char *listen, *http_listen, *served_model_names, *api_keys, *admin_keys, *tls_cert, *tls_key, *tls_client_ca, *tls_ca, *placement;
        uint32_t max_streams, ttft_slo_ms, tpot_slo_ms, index_max_blocks, index_drop_events;
        uint32_t admit_max, tenant_queue_max;
        bool early_reject;
    } router;
    td_worker_config_t prefill, decode;
    struct {
        uint32_t count;
        uint64_t dram_mb, ssd_mb;
        char *data_dir;
        bool use;
        uint32_t replicas_max, hot_hits, hit_half_life_s;
        char *near;
    } kvstore;
    struct { char *endpoints, *data_dir; uint32_t lease_ttl_s; } etcd;
    struct { char *tls_ca, *tls_cert, *tls_key; bool plaintext; } cluster;
    struct { char *kind; bool peer_errors; uint32_t peer_idle_s; char *interfaces; } transport;
    struct { char *listen; } metrics;
} td_config_t;

/* Fills cfg with the defaults. Free with td_config_free(). */
td_status_t td_config_defaults(td_config_t *cfg);
/* Reads path over what cfg holds (call td_config_defaults() first). */
td_status_t td_config_load(td_config_t *cfg, const char *path);
/* Sets "section.key" from its text form, as a flag would. */
td_status_t td_config_set(td_config_t *cfg, const char *key, const char *value);
/* Checks ranges across fields (block_tokens a power of two in 16..256, ...). */
td_status_t td_config_validate(const td_config_t *cfg);
/* The names router.placement may take, from the one table that defines
 * them (router/placement.c's policies, which register them here before a
 * config is read: the router and tandem up). Unregistered (a process that
 * does not place), any name passes. Process-wide; not thread-safe. */
void td_config_placements(const char *const *names, size_t n);
void td_config_free(td_config_t *cfg);

/* The processes a key's flag is for (td_config_key_t.procs). */
enum { TD_PROC_ROUTER = 1, TD_PROC_WORKER = 2, TD_PROC_KVSTORE = 4 };

/* The keys, one table (common/config.c) the defaults, the file's reader,
 * the flags, the bounds, --help and the shipped example come from: i in
 * 0 .. count - 1. */
typedef struct td_config_key {
    const char *name, *def, *doc; /* "section.key", the default as text, what it sets (one line) */
    const char *more;             /* what the example and the reference add (NULL: nothing) */
    const char *type;             /* "string", "integer" or "boolean" */
    uint64_t min, max;            /* an integer's bounds (max 0: none) */
    const char *choices;          /* a string's values ("a|b"; NULL: any) */
    const char *flag;             /* the flag that sets it (NULL: none) */
    unsigned procs;               /* the processes that take the flag (TD_PROC_*) */
} td_config_key_t;
size_t td_config_key_count(void);
td_config_key_t td_config_key(size_t i);
/* What section `name` holds (one line; NULL: no such section). */
const char *td_config_section_doc(const char *name);
/* key's value in its text form (as td_config_set takes it), in out (n bytes). */
td_status_t td_config_get(const td_config_t *cfg, const char *key, char *out, size_t n);

/* The shipped example (deploy/tandem.yaml: every key, its default and what it
 * sets, as comments) and the reference (docs/configuration.md: a table per
 * section), written from the table (config_doc.c; `tandem config`). */
void td_config_write_example(FILE *f);
void td_config_write_reference(FILE *f);

/* A process's flags the config does not hold (--listen of one worker): the
 * caller takes the value; nonzero refuses it (with a message on stderr). */
typedef int (*td_own_flag_fn)(void *ctx, const char *flag, const char *value);

/* The one way a process reads its settings: the defaults, the file of
 * --config FILE over them, every flag the table gives the process (procs: its
 * TD_PROC_* bit; a role section's flags only for section's role) over that,
 * then one validation. Flags named in own[] (NULL-terminated) go to own_fn.
 * Every flag takes a value. Returns 0, or 2 after printing what was wrong and
 * usage; --help (-h) prints the usage and every key (with the process's flag
 * for it), and exits 0. */
/* The own flags every long-running role takes: --listen HOST:PORT and --id
 * ID, copied into the caller's buffers (ctx: a td_listen_id_t). */
typedef struct td_listen_id {
    char *listen, *id;
    size_t listen_cap, id_cap;
} td_listen_id_t;
int td_own_listen_id(void *ctx, const char *flag, const char *value);

int td_config_from_args(td_config_t *cfg, const char *prog, const char *section, unsigned procs,
                        const char *const *own, td_own_flag_fn own_fn, void *ctx, const char *usage, int argc,
                        char **argv);

#endif
