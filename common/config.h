/* config.h — the one YAML configuration file, one section per role.
 *
 *   log:     { level: info, format: text }
 *   model:   { path: models/SmolLM2-135M-Instruct.Q4_1.gguf, kv_dtype: fp16,
 *              numerics: fast, block_tokens: 16, context: 0 }  (numerics: fast, or
 *              reference = llama.cpp's rounding bit for bit; kernels/backend.h)
 *   router:  { listen: 127.0.0.1:50051, http_listen: 127.0.0.1:8000, tls_cert: "", tls_key: "",
 *              tls_client_ca: "", tls_ca: "", max_streams: 4096 }  (TLS on the public API when cert+key
 *              are set; client certificates required when tls_client_ca is; tls_ca:
 *              what clients trust, for tandem up's readiness probe; max_streams: calls the
 *              router handles at once, past which it answers RESOURCE_EXHAUSTED; http_listen:
 *              the OpenAI-compatible HTTP API, "" for none; api_keys: its keys file, one
 *              "SHA256-HEX NAME RPM TPM" a line (`tandem apikey` makes them), "" for an open API (the
 *              HTTP API's Authorization header and gRPC's authorization metadata);
 *              admin_keys: the same form, the keys of administrators (Scale), "" for none;
 *              placement: predictive | kv_cost | least_loaded | round_robin (DESIGN.md §5);
 *              ttft_slo_ms: 0, tpot_slo_ms: 0 — the SLOs a request is held to unless it
 *              tightens them (0: none); early_reject: true — answer RESOURCE_EXHAUSTED with a
 *              retry hint at once when no pair is predicted to meet them (predictive only);
 *              index_max_blocks: 262144 — the cache index's bound; index_drop_events: 0 — a
 *              test hook: the index's follower discards one event in every N it receives)
 *   prefill: { count: 1, threads: 0, token_budget: 512, kv_mib: 64, profile: true, device: cpu }
 *   decode:  { count: 1, threads: 0, token_budget: 512, kv_mib: 64, profile: true, device: cpu }
 *            (token_budget: tokens per engine step, the chunked-prefill size;
 *            kv_mib: the worker's KV pool; profile: measure prefill and decode step
 *            times at start-up and publish the fitted model with the registration
 *            (kept in the host's cache: worker/profile_store.h);
 *            device: cpu, cuda or cuda:N — the backend, and where the KV pool lives: a
 *            GPU worker's pool is device memory, and its KV goes to a decode worker on
 *            the same host through CUDA IPC)
 *   kvstore: { count: 1, dram_mb: 1024, ssd_mb: 0, data_dir: "", use: true }  (count: kvstore nodes
 *            `tandem up` starts; dram_mb: a node's CPU tier; ssd_mb: its SSD tier, block files
 *            in data_dir (0: none); use: prefill workers fetch prefixes from and publish
 *            blocks to the kvstore nodes registered in etcd;
 *            replicas_max: 2, hot_hits: 8, hit_half_life_s: 30, near: ""  (a block read more
 *            than hot_hits times per half-life, decayed, gets up to replicas_max copies on other
 *            nodes, first the readers' near nodes, and loses them when it cools; near: the id of
 *            the kvstore node on this worker's host, asked first and told to readers' homes)
 *   etcd:    { endpoints: 127.0.0.1:2379, data_dir: "", lease_ttl_s: 3 }  (lease_ttl_s: a
 *            worker's registration lease; a dead worker leaves the membership this long after)
 *   cluster: { tls_ca: "", tls_cert: "", tls_key: "", plaintext: false }  (the internal planes,
 *            router <-> workers and etcd: mutual TLS, every peer's certificate signed by the CA
 *            tls_ca names, this process's own pair; `tandem certs` makes them, `tandem up`
 *            makes throwaway ones. plaintext: true leaves those planes open to anyone who
 *            can reach them, and says so loudly)
 *   transport: { kind: auto, peer_errors: false, peer_idle_s: 60, interfaces: lo }  (the KV transport,
 *            kvstore/transfer.h: kind: auto (UCX for a CPU worker, CUDA IPC for a GPU worker: one
 *            host), ucx (a GPU worker's KV staged through page-locked host memory, for GPU
 *            workers on different hosts) or cuda_ipc; peer_errors: UCX peer error handling,
 *            which costs UCX's shared-memory paths; peer_idle_s: a prefill worker closes a connection to a decode
 *            worker unused this long; interfaces: the network interfaces UCX may listen and
 *            connect on, comma-separated: loopback by default, the cluster's network on many hosts)
 *   metrics: { listen: "" }  (Prometheus metrics of this process at http://LISTEN/metrics, common/metrics.h;
 *            "" for none; port 0 takes a free port, which the process logs and puts in its etcd record;
 *            `tandem up` gives every process one)
 *
 * Every key is optional; what is absent keeps its default. The file is read
 * through a libcyaml schema; an unknown key or a value of the wrong type is an
 * error that names the key and its line. Command-line flags override the file
 * with td_config_set("section.key", "value"). */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#define KV_REPLICAS_LIMIT 4 /* kvstore.replicas_max at most */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
} td_worker_config_t;

/* A device name: "cpu" (*cuda -1), "cuda" (*cuda 0) or "cuda:N" (*cuda N,
 * 0..1023); false for anything else. */
bool td_device_parse(const char *s, int *cuda);
/* A role's device setting may list several, comma-separated ("cuda:0,cuda:1"):
 * tandem up gives its k-th worker of the role the (k mod count)-th. Puts that
 * one in out (n bytes) and returns the count, or 0 when an entry is no
 * device name (or too long for out). */
unsigned td_device_pick(const char *list, unsigned k, char *out, size_t n);

typedef struct td_config {
    struct { char *level, *format; } log;
    struct { char *path, *kv_dtype, *numerics; uint32_t block_tokens, context; } model;
    struct {
        char *listen, *http_listen, *api_keys, *admin_keys, *tls_cert, *tls_key, *tls_client_ca, *tls_ca, *placement;
        uint32_t max_streams, ttft_slo_ms, tpot_slo_ms, index_max_blocks, index_drop_events;
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

/* A command-line flag that sets a config key ("%s" in key: the process's
 * section, e.g. "%s.threads" for a prefill worker's prefill.threads). */
typedef struct td_flag {
    const char *flag, *key;
} td_flag_t;

/* A process's flags the config does not hold (--listen of one worker): the
 * caller takes the value; nonzero refuses it (with a message on stderr). */
typedef int (*td_own_flag_fn)(void *ctx, const char *flag, const char *value);

/* The one way a process reads its settings: the defaults, the file of
 * --config FILE over them, every flag of `flags` over that, then one
 * validation. Flags named in own[] (NULL-terminated) go to own_fn. Every flag
 * takes a value. Returns 0, or 2 after printing what was wrong and usage. */
/* The own flags every long-running role takes: --listen HOST:PORT and --id
 * ID, copied into the caller's buffers (ctx: a td_listen_id_t). */
typedef struct td_listen_id {
    char *listen, *id;
    size_t listen_cap, id_cap;
} td_listen_id_t;
int td_own_listen_id(void *ctx, const char *flag, const char *value);

int td_config_from_args(td_config_t *cfg, const char *prog, const char *section, const td_flag_t *flags,
                        size_t n_flags, const char *const *own, td_own_flag_fn own_fn, void *ctx, const char *usage,
                        int argc, char **argv);

#endif
