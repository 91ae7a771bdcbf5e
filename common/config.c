/* config.c — see config.h.
 *
 * How it works: one table (cfg_fields) holds every key once — its dotted
 * name, type, place in td_config_t, default, bounds or choices, the flag that
 * sets it and which processes take that flag, and what it sets. The
 * defaults, the flags each process takes, the YAML reader's schema (libcyaml,
 * built from the table: common/yaml.h), the bounds' messages, --help, and
 * deploy/tandem.yaml and docs/configuration.md (config_doc.c writes them) all
 * come from it. What libcyaml fills is a "raw" tree of
 * pointers, one per key, so that an absent key is NULL and keeps its value. */
#include "common/config.h"

#include <ctype.h>
#include <cyaml/cyaml.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/yaml.h"

typedef enum cfg_kind { CFG_STR, CFG_U32, CFG_U64, CFG_BOOL } cfg_kind_t;

/* Every key once. min/max bound a number (max 0: any); choices ("a|b")
 * limit a string (NULL: any); rules across keys are td_config_validate's.
 * flag sets it from the command line of the processes in procs (TD_PROC_*;
 * a role section's flag only in that role's worker); doc is one line (the
 * --help line), more what deploy/tandem.yaml and docs/configuration.md add. */
typedef struct cfg_field {
    const char *name;
    cfg_kind_t kind;
    size_t off;
    const char *def;
    uint64_t min, max;
    const char *choices;
    const char *doc, *flag;
    unsigned procs;
    const char *more;
} cfg_field_t;

#define R TD_PROC_ROUTER
#define W TD_PROC_WORKER
#define K TD_PROC_KVSTORE
#define S(name_, member, def_, choices_, doc_, ...)                                                                   \
    {.name = name_, .kind = CFG_STR, .off = offsetof(td_config_t, member), .def = def_, .choices = choices_,          \
     .doc = doc_, __VA_ARGS__}
#define U(name_, member, def_, min_, max_, doc_, ...)                                                                 \
    {.name = name_, .kind = CFG_U32, .off = offsetof(td_config_t, member), .def = def_, .min = min_, .max = max_,     \
     .doc = doc_, __VA_ARGS__}
#define L(name_, member, def_, min_, max_, doc_, ...)                                                                 \
    {.name = name_, .kind = CFG_U64, .off = offsetof(td_config_t, member), .def = def_, .min = min_, .max = max_,     \
     .doc = doc_, __VA_ARGS__}
#define B(name_, member, def_, doc_, ...)                                                                             \
    {.name = name_, .kind = CFG_BOOL, .off = offsetof(td_config_t, member), .def = def_, .doc = doc_, __VA_ARGS__}
#define WORKER(r, colocated_def, colocated_more)                                                                                     \
    U(#r ".count", r.count, "1", 0, 0, "workers of the role tandem up starts",                                        \
      .more = "tandem up seeds the ops config with it; from then on tandem scale and the planner decide"),          \
    U(#r ".threads", r.threads, "0", 0, 256, "engine threads (0: one per core)", .flag = "--threads", .procs = W),    \
    U(#r ".token_budget", r.token_budget, "512", 1, 1u << 20, "tokens per engine step (the chunked-prefill size)",    \
      .flag = "--token-budget", .procs = W, .more = "prompts are prefilled in chunks of at most this many"),         \
    L(#r ".kv_mib", r.kv_mib, "64", 1, 1u << 20, "the KV pool (MiB)", .flag = "--kv-mib", .procs = W),                \
    S(#r ".queue", r.queue, "fcfs", "fcfs|cache|mlq", "the order waiting prompts are computed in", .flag = "--queue",  \
      .procs = W,                                                                                                     \
      .more = "fcfs: arrival order (priorities first); cache: the prompt under way, then the longest cached prefix "  \
              "first, and a prompt waits a step for a prefix another prompt is computing rather than computing it " \
              "too (SGLang's longest-prefix-match); mlq: skip-join multi-level feedback (FastServe): a prompt enters " \
              "the first level whose quantum holds it and drops a level per quantum used, so short prompts pass "   \
              "long ones under way. Priorities come first and the age bound holds in every order"),                \
    L(#r ".swap_mib", r.swap_mib, "512", 0, 1u << 20, "host memory a preempted sequence's KV waits in (MiB)",         \
      .flag = "--swap-mib", .procs = W,                                                                               \
      .more = "when the pool runs short the newest sequence is preempted: its KV is copied here and back when the "   \
              "pool has room, if that is predicted cheaper than computing it again (else it is recomputed); 0: "      \
              "always recomputed. Taken whole at the first preemption (page-locked on a GPU) and kept"),               \
    U(#r ".queue_levels", r.queue_levels, "4", 1, 16, "mlq: the queue's levels", .flag = "--queue-levels",           \
      .procs = W),                                                                                                    \
    U(#r ".queue_quantum", r.queue_quantum, "256", 1, 1u << 20, "mlq: level 0's quantum in prompt tokens",            \
      .flag = "--queue-quantum", .procs = W, .more = "level i's is this << i"),                                      \
    U(#r ".queue_age_ms", r.queue_age_ms, "10000", 0, 0, "a prompt waiting longer goes first, whatever the order",    \
      .flag = "--queue-age-ms", .procs = W, .more = "0: no bound (a prompt may starve behind others)"),            \
    B(#r ".profile", r.profile, "true", "measure the start-up profile (worker/profile_store.h)",                       \
      .more = "prefill and decode step times measured at start-up (about 2 s alone) and published with the worker's " \
              "registration for the router's predictions (a pool under 2048 tokens is not profiled); kept in "      \
              "$XDG_CACHE_HOME/tandem/profiles/ (else ~/.cache), so the next start on the host reuses it (checked "  \
              "first when older than 10 minutes; delete the file to measure again); a host's sweeps take turns"),    \
    S(#r ".device", r.device, "cpu", NULL, "cpu, cuda or cuda:N (a comma-separated list: one per worker in turn)",    \
      .flag = "--device", .procs = W,                                                                                 \
      .more = "the backend and the KV pool's memory; tandem up gives each worker of the role the next entry of a "    \
              "list, or with tp ranks the next tp entries, a GPU a rank (a worker itself takes one, or tp). A "      \
              "prefill and a decode worker on GPUs of one host move KV through "                                     \
              "CUDA IPC, and both must be on GPUs (a CPU and a GPU worker are refused as peers, naming both "         \
              "transports). A GPU worker does not use the KV store yet"),                                           \
    U(#r ".tp", r.tp, "1", 1, 16, "tensor-parallel ranks of each worker", .flag = "--tp", .procs = W,                \
      .more = "the model split over that many ranks (heads, FFN columns, vocabulary), one process driving them; "    \
              "device names them: cpu, or a GPU a rank (cuda:0,cuda:1). Workers of any degrees are peers: each rank's "    \
              "heads go to their place in the whole block, or into the part of a decode worker's rank that holds "    \
              "them, in that rank's GPU (CUDA IPC between the GPUs of one host; ranks may share one, cuda:0,cuda:0)"), \
    B(#r ".colocated", r.colocated, colocated_def, "serve whole requests too (decode only)", .flag = "--colocated",   \
      .procs = W, .more = colocated_more)

static const cfg_field_t cfg_fields[] = {
    S("log.level", log.level, "info", NULL, "what is logged: debug, info, warn, error or off (any case)",
      .more = "TANDEM_LOG in the environment wins over it"),
    S("log.format", log.format, "text", "text|json", "log lines as text or JSON"),
    S("model.path", model.path, TD_DEFAULT_MODEL, NULL, "the GGUF or safetensors model", .flag = "--model",
      .procs = R | W, .more = "a .gguf file or a Hugging Face folder (config.json, model.safetensors, tokenizer.json)"),
    S("model.kv_dtype", model.kv_dtype, "fp16", "fp16|fp32|fp8_e4m3|fp8", "the KV cache's element type (the KV contract)",
      .flag = "--kv-dtype", .procs = R | W,
      .more = "fp8_e4m3 (or fp8): a byte a value and an fp32 scale per token and KV head, about half of fp16's bytes in "
              "the pool, on the wire and in the store; the CPU and CUDA backends"),
    S("model.numerics", model.numerics, "fast", "fast|reference", "tandem's kernels, or llama.cpp's rounding",
      .flag = "--numerics", .procs = W,
      .more = "reference: llama.cpp's rounding bit for bit (the same greedy tokens as llama.cpp on the same GGUF; "
              "AVX2 CPUs; a slower prefill)"),
    S("model.weights", model.weights, "file", "file|fp8", "how the layers' matrices are held: as the file has them, or FP8",
      .flag = "--weights", .procs = R | W,
      .more = "fp8: E4M3 with a scale per output channel, converted at load (an FP8 safetensors checkpoint is read as "
              "it is whatever this says); half the bytes a decode step reads on the GPU. The embedding and output "
              "matrix stay as they are. Part of the KV contract's model id: every worker of a cluster agrees"),
    S("model.load_format", model.load_format, "auto", "auto|dummy", "where the weights come from: the model's file, or dummy",
      .flag = "--load-format", .procs = R | W,
      .more = "dummy (as vLLM's --load-format dummy): the file's weights are not read, and a folder needs none "
              "(config.json and tokenizer.json are enough); every matrix is filled with seeded values (the same "
              "bits on every backend), every norm with ones — to serve and measure a model's shape without its "
              "weights on disk. For benchmarks: the output means nothing. Part of the KV contract's model id"),
    U("model.block_tokens", model.block_tokens, "16", 16, 256, "tokens per KV block, a power of two",
      .flag = "--block-tokens", .procs = R | W, .more = "part of the KV contract: every worker of a cluster agrees"),
    U("model.context", model.context, "0", 0, 0, "the context length (0: the model's)"),
    S("router.listen", router.listen, "127.0.0.1:50051", NULL, "the public gRPC API", .flag = "--listen", .procs = R,
      .more = "tandem up picks a free loopback port when this is left at its default"),
    S("router.http_listen", router.http_listen, "127.0.0.1:8000", NULL, "the OpenAI HTTP API (\"\": none)",
      .flag = "--http-listen", .procs = R,
      .more = "/v1/chat/completions, /v1/completions, /v1/models, /health, /tokenize, /detokenize; tandem up picks "
              "a free loopback port when this is left at its default. HTTPS with tls_cert and tls_key, as the gRPC "
              "API; with tls_client_ca a certless client is answered 403"),
    S("router.served_model_names", router.served_model_names, "", NULL,
      "the model's names for clients, comma-separated (\"\": the model file's name without its extension)",
      .flag = "--served-model-names", .procs = R,
      .more = "the first is the one ListModels and /v1/models list and answers carry; a request may name any of them "
              "or the model's own name (GGUF general.name); another name is 404 / NOT_FOUND. As vLLM's "
              "--served-model-name"),
    S("router.api_keys", router.api_keys, "", NULL, "the API keys' file (\"\": an open API)", .flag = "--api-keys",
      .procs = R,
      .more = "one key a line, \"SHA256-HEX NAME RPM TPM [WEIGHT [PRIORITY]]\" (requests and tokens per minute, 0: "
              "no limit; the key's share and class in the admission queue, router.admit_max: 1 and 0; `tandem apikey "
              "NAME --rpm N --tpm M --weight W --priority P` makes a key and its line). Clients send \"Authorization: Bearer KEY\" "
              "(HTTP) or the same as gRPC metadata \"authorization\"; an unknown key is 401 / UNAUTHENTICATED, a key "
              "past its limit 429 / RESOURCE_EXHAUSTED with a retry hint. Tokens are charged at admission by prompt "
              "+ max_tokens and settled at the end by what was used. \"\": no keys asked (logged)"),
    S("router.admin_keys", router.admin_keys, "", NULL, "the administrators' keys' file", .flag = "--admin-keys",
      .procs = R,
      .more = "the same form (limits ignored): a call (Scale, the ops config) is an administrator's with one of "
              "these keys, or with a client certificate named \"admin\" (tls_client_ca set) — never because of the "
              "address it comes from. tandem up makes one per run and prints where its key is (tandem scale "
              "--admin-key FILE). \"\" and no admin certificate: nobody may Scale"),
    S("router.tls_cert", router.tls_cert, "", NULL, "the public API's TLS certificate", .flag = "--tls-cert",
      .procs = R, .more = "set it and tls_key to serve gRPC and HTTP over TLS; clients then pass --tls-ca (tandem "
                          "generate / health) or ssl_channel_credentials (grpcio)"),
    S("router.tls_key", router.tls_key, "", NULL, "its key", .flag = "--tls-key", .procs = R),
    S("router.tls_client_ca", router.tls_client_ca, "", NULL, "client certificates required, signed by this CA",
      .flag = "--tls-client-ca", .procs = R,
      .more = "mutual TLS on the public API; tandem up's readiness probe then shows tls_cert as its client "
              "certificate"),
    S("router.tls_ca", router.tls_ca, "", NULL, "the CA clients trust (tandem up's probe)",
      .more = "empty: tls_client_ca, else tls_cert itself (a self-signed certificate)"),
    U("router.max_streams", router.max_streams, "4096", 1, 1u << 20, "calls the router handles at once",
      .flag = "--max-streams", .procs = R,
      .more = "streams in flight; past it a new call is answered RESOURCE_EXHAUSTED at once"),
    U("router.admit_max", router.admit_max, "0", 0, 1u << 20, "requests out on the workers at once (0: no limit)",
      .flag = "--admit-max", .procs = R,
      .more = "past it a request waits its turn in the admission queue, per tenant (API key): tenants are served "
              "tokens in proportion to their keys' weights, a higher priority class first, a tenant back from idle "
              "with no credit banked (router/fair.h); a queued request's deadline is kept"),
    U("router.tenant_queue_max", router.tenant_queue_max, "64", 1, 1u << 20,
      "requests one tenant may have waiting in the admission queue",
      .more = "past it the tenant's requests are refused at once (RESOURCE_EXHAUSTED) with a retry hint from its "
              "own share, not queued behind everyone"),
    S("router.placement", router.placement, "predictive", NULL, "the placement policy (router/placement.h)",
      .more = "predictive: the prefill worker with the lowest predicted time to first token (its queue of equal or "
              "higher priority, the prompt's blocks its pool holds, the further blocks the KV store can supply from "
              "which tier, its speed: the start-up profile, refitted online) and the least loaded decode worker "
              "predicted to stay under the TPOT SLO (docs/DESIGN.md §5); kv_cost (Dynamo's: prefill blocks left "
              "after the pool's overlap + blocks being prefilled), least_loaded, round_robin"),
    U("router.ttft_slo_ms", router.ttft_slo_ms, "0", 0, 0, "the TTFT SLO (0: none)",
      .more = "every request is held to it; a request may tighten it (GenerateRequest ttft_slo_ms, the same field "
              "in an HTTP request's body)"),
    U("router.tpot_slo_ms", router.tpot_slo_ms, "0", 0, 0, "the TPOT SLO (0: none)",
      .more = "as ttft_slo_ms, per output token after the first"),
    B("router.early_reject", router.early_reject, "true", "refuse at once what no pair is predicted to serve in time",
      .more = "under predictive placement, a request no pair is predicted to serve within its SLOs is answered "
              "RESOURCE_EXHAUSTED at once (gRPC trailing metadata retry-after-ms; HTTP 429 with Retry-After) instead "
              "of being queued late; one that even an idle worker is predicted to miss is answered "
              "FAILED_PRECONDITION (HTTP 400) with no hint. Both carry rejected-early: ttft or tpot. A stream under "
              "way is never rejected: its resume after a worker's death is placed whatever it costs. Higher "
              "GenerateRequest.priority is computed first, and the prediction counts only the work of equal or "
              "higher priority ahead, so under load the lower priorities are the ones refused"),
    U("router.index_max_blocks", router.index_max_blocks, "262144", 1024, 1u << 26, "the cache index's bound",
      .more = "block names; the router follows every prefill pool and kvstore node through their event logs"),
    U("router.index_drop_events", router.index_drop_events, "0", 0, 0, "a test hook: drop one event in N"),
    WORKER(prefill, "false", "only decode workers serve whole requests: true is refused"),
    WORKER(decode, "true",
           "the decode worker also serves whole requests, prefill included, in its own engine, as vLLM or SGLang "
           "serve without disaggregation; a cluster with no prefill worker places every request on one (tandem up "
           "--colocated N; the ops config's colocated models). Beside prefill workers, predictive placement has it "
           "prefill a request itself when that keeps the request's SLOs with a sooner predicted first token "
           "(conditional disaggregation; with no TPOT SLO, only while the prompt's chunks at most double its running "
           "streams' step); false: every prompt is prefilled by a prefill worker"),
    U("kvstore.count", kvstore.count, "1", 0, 0, "kvstore nodes tandem up starts", .more = "tandem up --kvstores N"),
    L("kvstore.dram_mb", kvstore.dram_mb, "1024", 0, 0, "a node's CPU tier (MiB)", .flag = "--dram-mb", .procs = K,
      .more = "DRAM that peers read and write with UCX one-sided operations"),
    L("kvstore.ssd_mb", kvstore.ssd_mb, "0", 0, 0, "its SSD tier (MiB; 0: none)", .flag = "--ssd-mb", .procs = K,
      .more = "block files in data_dir, O_DIRECT + io_uring, a checksum per block, a manifest at a clean stop so a "
              "restart is warm"),
    S("kvstore.data_dir", kvstore.data_dir, "", NULL, "the SSD tier's folder", .flag = "--data-dir", .procs = K,
      .more = "tandem up gives node K data_dir/kvstore-K (its own throwaway folder when this is empty)"),
    B("kvstore.use", kvstore.use, "true", "workers fetch from and publish to the store",
      .more = "prefill workers look prompts up in it after their own pool and read the prefix found; every worker "
              "publishes each full block its pool names, write-behind (prefill: the prompt's; decode: the answer's, "
              "so a conversation's next turn hits). false: each pool caches on its own"),
    U("kvstore.replicas_max", kvstore.replicas_max, "2", 0, KV_REPLICAS_LIMIT, "copies of a hot block",
      .flag = "--replicas-max", .procs = K,
      .more = "a block read hot_hits times within about a half-life (decayed hits) is copied to the nodes its "
              "readers are near, up to this many copies; a copy whose reads cool (below hot_hits / 4) is dropped"),
    U("kvstore.hot_hits", kvstore.hot_hits, "8", 1, 0, "reads per half-life that make a block hot",
      .flag = "--hot-hits", .procs = K),
    U("kvstore.hit_half_life_s", kvstore.hit_half_life_s, "30", 1, 0, "the reads' half-life (s)",
      .flag = "--hit-half-life-s", .procs = K),
    S("kvstore.near", kvstore.near, "", NULL, "the id of the kvstore node on this host", .flag = "--kvstore-near",
      .procs = W,
      .more = "asked first, and where hot blocks get copies; tandem up gives prefill worker K kvstore-(K mod count)"),
    S("etcd.endpoints", etcd.endpoints, "127.0.0.1:2379", NULL, "etcd's client endpoints", .flag = "--etcd",
      .procs = R | W | K, .more = "tandem up starts its own etcd on free loopback ports"),
    S("etcd.data_dir", etcd.data_dir, "", NULL, "tandem up's etcd data folder"),
    U("etcd.lease_ttl_s", etcd.lease_ttl_s, "3", 1, 3600, "a registration's lease (s)", .flag = "--lease-ttl",
      .procs = W | K, .more = "a process that dies leaves the membership this long after"),
    S("cluster.tls_ca", cluster.tls_ca, "", NULL, "the cluster CA (the internal planes' mutual TLS)",
      .flag = "--cluster-ca", .procs = R | W | K,
      .more = "router <-> workers and every process <-> etcd: a peer without a certificate the cluster CA signed "
              "is refused. tandem up makes a throwaway CA and one pair per process when this is empty (it prints "
              "the folder; client.pem/client.key there are for tools such as etcdctl). For many hosts `tandem "
              "certs --dir DIR --hosts H1,H2` makes the CA and the pairs. A certificate's common name up to its "
              "first '-' is the process's role: only a \"router\" certificate may call the workers' Prefill, "
              "Reserve, Decode, Release and Renew, and a prefill worker puts KV only into landings signed by a "
              "\"decode\" certificate — name them router, prefill-N, decode-N (tandem certs --names)"),
    S("cluster.tls_cert", cluster.tls_cert, "", NULL, "this process's certificate", .flag = "--cluster-cert",
      .procs = R | W | K),
    S("cluster.tls_key", cluster.tls_key, "", NULL, "its key", .flag = "--cluster-key", .procs = R | W | K),
    B("cluster.plaintext", cluster.plaintext, "false", "the internal planes open to anyone (said loudly)",
      .flag = "--plaintext", .procs = R | W | K,
      .more = "true: no TLS and no authentication on the internal planes — anyone who can reach a port reads "
              "prompts, takes KV memory and rewrites the membership; every process logs it as a warning"),
    S("transport.kind", transport.kind, "auto", "auto|ucx|cuda_ipc", "the KV transport", .flag = "--transport",
      .procs = W,
      .more = "auto: UCX between CPU workers, CUDA IPC between GPU workers (one host); ucx: GPU workers too, their "
              "KV staged through page-locked host memory (GPU workers on different hosts; a GPU decode worker then "
              "keeps a host landing copy as large as its pool)"),
    B("transport.peer_errors", transport.peer_errors, "false", "UCX peer error handling",
      .more = "a dead decode worker fails its endpoint at once, but UCX 1.13 then cannot use shared memory on one "
              "host (~17x slower puts); off, a dead peer is learnt from gRPC and etcd instead"),
    U("transport.peer_idle_s", transport.peer_idle_s, "60", 1, 86400, "a KV connection unused this long closes (s)",
      .flag = "--peer-idle-s", .procs = W),
    S("transport.interfaces", transport.interfaces, "lo", NULL, "the network interfaces UCX uses",
      .flag = "--interfaces", .procs = W | K,
      .more = "comma-separated (UCX_NET_DEVICES): loopback for a one-machine cluster; the cluster network's "
              "interface on many hosts"),
    S("metrics.listen", metrics.listen, "", NULL, "Prometheus metrics (\"\": none)", .flag = "--metrics-listen",
      .procs = R | W | K,
      .more = "https://LISTEN/metrics (names as vLLM's under tandem:, labels model_name and role), an internal "
              "plane like the others: the process's cluster pair, and only clients showing a certificate of "
              "cluster.tls_ca (plain http under cluster.plaintext). One address per process, so mostly given as a "
              "flag; port 0 takes a free port, which the process puts in its etcd record. tandem up gives every "
              "process one, and a router's metrics port also answers /targets: every process's metrics address for "
              "Prometheus's http_sd_configs"),
};
#undef R
#undef W
#undef K

/* What each section is, for deploy/tandem.yaml and docs/configuration.md. */
static const struct {
    const char *name, *doc;
} cfg_sections[] = {
    {"log", "Logging (TANDEM_LOG and TANDEM_LOG_FORMAT in the environment win)."},
    {"model", "The model, and the KV contract every worker of a cluster must share."},
    {"router", "The router: the public APIs (gRPC and OpenAI HTTP), their keys and TLS, placement and SLOs."},
    {"prefill", "Prefill workers: how many tandem up starts and how each one runs."},
    {"decode", "Decode workers: the same keys."},
    {"kvstore", "The KV store (docs/DESIGN.md §4): tandem-kvstore nodes, each a CPU tier and an optional SSD tier; "
                "a block name's node is chosen by rendezvous hashing over the nodes in etcd."},
    {"etcd", "etcd: the membership, the ops config and the planner's election."},
    {"cluster", "The internal planes' security: mutual TLS under a cluster CA."},
    {"transport", "The KV transport between prefill and decode workers."},
    {"metrics", "Prometheus metrics."},
};

#define N_FIELDS (sizeof cfg_fields / sizeof cfg_fields[0])

/* ---- the YAML schema, from the table ----
 * raw: a section pointer per section, in the order sections first appear;
 * each section a pointer per key of it, in table order. */
#define MAX_SECTIONS 16

typedef struct schema {
    cyaml_schema_field_t top[MAX_SECTIONS + 1], keys[N_FIELDS + MAX_SECTIONS];
    cyaml_schema_value_t value;
    char section[MAX_SECTIONS][16];
    size_t n_sections, first[MAX_SECTIONS + 1]; /* the section's keys: cfg_fields[first[s] .. first[s + 1]) */
    int sec_of[N_FIELDS];                       /* each key's section (its place: i - first[sec_of[i]]) */
} schema_t;

static void schema_build(schema_t *sc)
{
    memset(sc, 0, sizeof *sc);
    size_t k = 0;
    for (size_t i = 0; i < N_FIELDS; i++) {
        const char *dot = strchr(cfg_fields[i].name, '.');
        size_t len = (size_t)(dot - cfg_fields[i].name), s = sc->n_sections;
        const char *last = s ? sc->section[s - 1] : "";
        if (strlen(last) != len || strncmp(last, cfg_fields[i].name, len)) { /* a new section: its keys follow */
            s = sc->n_sections++;
            snprintf(sc->section[s], sizeof sc->section[s], "%.*s", (int)len, cfg_fields[i].name);
            sc->first[s] = i;
            if (s)
                sc->keys[k++] = (cyaml_schema_field_t)CYAML_FIELD_END;
            sc->top[s] = (cyaml_schema_field_t){.key = sc->section[s], .data_offset = s * sizeof(void *),
                                                .value = {.type = CYAML_MAPPING,
                                                          .flags = CYAML_FLAG_OPTIONAL | CYAML_FLAG_POINTER,
                                                          .mapping = {.fields = &sc->keys[k]}}};
        } else {
            s--;
        }
        sc->sec_of[i] = (int)s;
        cyaml_schema_field_t *f = &sc->keys[k++];
        f->key = dot + 1;
        f->data_offset = (i - sc->first[s]) * sizeof(void *);
        f->value.flags = CYAML_FLAG_OPTIONAL | CYAML_FLAG_POINTER;
        static const cyaml_type_e types[] = {CYAML_STRING, CYAML_UINT, CYAML_UINT, CYAML_BOOL};
        static const uint32_t sizes[] = {sizeof(char *), sizeof(uint32_t), sizeof(uint64_t), sizeof(bool)};
        f->value.type = types[cfg_fields[i].kind];
        f->value.data_size = sizes[cfg_fields[i].kind];
        if (cfg_fields[i].kind == CFG_STR)
            f->value.string.max = CYAML_UNLIMITED;
    }
    sc->first[sc->n_sections] = N_FIELDS;
    sc->keys[k] = (cyaml_schema_field_t)CYAML_FIELD_END;
    for (size_t s = 0; s < sc->n_sections; s++)
        sc->top[s].value.data_size = (uint32_t)((sc->first[s + 1] - sc->first[s]) * sizeof(void *));
    sc->top[sc->n_sections] = (cyaml_schema_field_t)CYAML_FIELD_END;
    sc->value = (cyaml_schema_value_t){.type = CYAML_MAPPING, .flags = CYAML_FLAG_POINTER,
                                       .data_size = (uint32_t)(sc->n_sections * sizeof(void *)),
                                       .mapping = {.fields = sc->top}};
}

static td_status_t set_str(char **slot, const char *v)
{
    char *copy = strdup(v);
    if (!copy)
        return td_error(TD_ERR_NO_MEMORY, "config: no memory");
    free(*slot);
    *slot = copy;
    return TD_OK;
}

td_status_t td_config_defaults(td_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_FIELDS; i++) {
        td_status_t rc = td_config_set(cfg, cfg_fields[i].name, cfg_fields[i].def);
        if (rc)
            return rc;
    }
    return TD_OK;
}

td_status_t td_config_set(td_config_t *cfg, const char *key, const char *value)
{
    for (size_t i = 0; i < N_FIELDS; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        if (strcmp(f->name, key) != 0)
            continue;
        char *slot = (char *)cfg + f->off;
        if (f->kind == CFG_STR)
            return set_str((char **)(void *)slot, value);
        if (f->kind == CFG_BOOL) {
            bool t = !strcmp(value, "true") || !strcmp(value, "1"), fa = !strcmp(value, "false") || !strcmp(value, "0");
            if (!t && !fa)
                return td_error(TD_ERR_CONFIG, "config: %s: '%s' is not true or false", key, value);
            *(bool *)(void *)slot = t;
            return TD_OK;
        }
        char *end;
        errno = 0;
        unsigned long long v = strtoull(value, &end, 10);
        if (errno || end == value || *end || value[0] == '-' ||
            (f->kind == CFG_U32 && v > UINT32_MAX))
            return td_error(TD_ERR_CONFIG, "config: %s: '%s' is not an unsigned %s-bit integer", key, value,
                            f->kind == CFG_U32 ? "32" : "64");
        if (f->kind == CFG_U32)
            *(uint32_t *)(void *)slot = (uint32_t)v;
        else
            *(uint64_t *)(void *)slot = v;
        return TD_OK;
    }
    return td_error(TD_ERR_CONFIG, "config: unknown key '%s'", key);
}

td_status_t td_config_load(td_config_t *cfg, const char *path)
{
    schema_t *sc = malloc(sizeof *sc);
    if (!sc)
        return td_error(TD_ERR_NO_MEMORY, "config: no memory");
    schema_build(sc);
    void **raw = NULL;
    td_status_t rc = td_yaml_load_file(&sc->value, path, (void **)&raw);
    for (size_t i = 0; i < N_FIELDS && !rc && raw; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        void **section = raw[sc->sec_of[i]];
        void *v = section ? section[i - sc->first[sc->sec_of[i]]] : NULL;
        if (!v)
            continue;
        char *slot = (char *)cfg + f->off;
        if (f->kind == CFG_STR)
            rc = set_str((char **)(void *)slot, v);
        else if (f->kind == CFG_BOOL)
            *(bool *)(void *)slot = *(bool *)v;
        else if (f->kind == CFG_U32)
            *(uint32_t *)(void *)slot = *(uint32_t *)v;
        else
            *(uint64_t *)(void *)slot = *(uint64_t *)v;
    }
    if (raw)
        td_yaml_free(&sc->value, raw);
    free(sc);
    return rc ? rc : td_config_validate(cfg);
}

bool td_device_parse(const char *s, int *cuda)
{
    if (!strcmp(s, "cpu")) {
        *cuda = -1;
        return true;
    }
    if (!strcmp(s, "cuda")) {
        *cuda = 0;
        return true;
    }
    if (strncmp(s, "cuda:", 5) || !isdigit((unsigned char)s[5]))
        return false;
    char *end;
    long n = strtol(s + 5, &end, 10);
    if (*end || n > 1023)
        return false;
    *cuda = (int)n;
    return true;
}

unsigned td_device_group(const char *list, unsigned k, unsigned per, char *out, size_t n)
{
    unsigned count = 0;
    for (const char *p = list;; p++) { /* count them, each checked */
        size_t len = strcspn(p, ",");
        char one[32];
        int gpu;
        if (len >= sizeof one)
            return 0;
        memcpy(one, p, len);
        one[len] = 0;
        if (!td_device_parse(one, &gpu))
            return 0;
        count++;
        p += len;
        if (!*p)
            break;
    }
    size_t at = 0;
    for (unsigned j = 0; j < (per ? per : 1); j++) { /* entries k * per + j, round the list */
        const char *p = list;
        for (unsigned i = 0; i < (k * (per ? per : 1) + j) % count; i++)
            p += strcspn(p, ",") + 1;
        size_t len = strcspn(p, ",");
        if (at + len + (j > 0) >= n)
            return 0;
        if (j)
            out[at++] = ',';
        memcpy(out + at, p, len);
        at += len;
    }
    out[at] = 0;
    return count;
}

unsigned td_device_pick(const char *list, unsigned k, char *out, size_t n) { return td_device_group(list, k, 1, out, n); }

static const char *const *placements;
static size_t n_placements;

void td_config_placements(const char *const *names, size_t n)
{
    placements = names;
    n_placements = n;
}

/* One key against its bounds or choices in the table. */
static td_status_t check_field(const td_config_t *cfg, const cfg_field_t *f)
{
    const char *slot = (const char *)cfg + f->off;
    if (f->kind == CFG_STR && f->choices) {
        const char *v = *(char *const *)(const void *)slot;
        char list[160] = ""; /* "a, b or c", for the message */
        size_t at = 0;
        for (const char *c = f->choices; *c;) {
            size_t len = strcspn(c, "|");
            if (strlen(v) == len && !strncmp(v, c, len))
                return TD_OK;
            const char *sep = !at ? "" : c[len] ? ", " : " or ";
            at += (size_t)snprintf(list + at, at < sizeof list ? sizeof list - at : 0, "%s%.*s", sep, (int)len, c);
            c += len + (c[len] == '|');
        }
        return td_error(TD_ERR_CONFIG, "config: %s = '%s'; it must be %s", f->name, v, list);
    }
    if (f->kind != CFG_U32 && f->kind != CFG_U64)
        return TD_OK;
    uint64_t v = f->kind == CFG_U32 ? *(const uint32_t *)(const void *)slot : *(const uint64_t *)(const void *)slot;
    if (v >= f->min && (!f->max || v <= f->max))
        return TD_OK;
    if (f->max)
        return td_error(TD_ERR_CONFIG, "config: %s = %llu; it must be from %llu to %llu", f->name,
                        (unsigned long long)v, (unsigned long long)f->min, (unsigned long long)f->max);
    return td_error(TD_ERR_CONFIG, "config: %s = %llu; it must be at least %llu", f->name, (unsigned long long)v,
                    (unsigned long long)f->min);
}

td_status_t td_config_validate(const td_config_t *cfg)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if (check_field(cfg, &cfg_fields[i]))
            return TD_ERR_CONFIG;
    /* the rules the table's bounds do not say */
    uint32_t bt = cfg->model.block_tokens;
    if (bt & (bt - 1))
        return td_error(TD_ERR_CONFIG, "config: model.block_tokens = %u; it must be a power of two from 16 to 256", bt);
    const struct { const char *role; const char *device; } w[] = {{"prefill", cfg->prefill.device},
                                                                   {"decode", cfg->decode.device}};
    for (size_t i = 0; i < 2; i++) {
        char one[32];
        if (!td_device_pick(w[i].device, 0, one, sizeof one))
            return td_error(TD_ERR_CONFIG, "config: %s.device = '%s'; it must be cpu, cuda or cuda:N (or a "
                            "comma-separated list of them, one for each worker in turn)", w[i].role, w[i].device);
    }
    td_log_level_t lv;
    if (td_log_level_parse(cfg->log.level, &lv))
        return td_error(TD_ERR_CONFIG, "config: log.level = '%s'; it must be debug, info, warn, error or off",
                        cfg->log.level);
    if (cfg->prefill.colocated)
        return td_error(TD_ERR_CONFIG, "config: prefill.colocated = true; only decode workers serve whole requests "
                        "(decode.colocated)");
    for (size_t i = 0; i < 2; i++) { /* a worker of tp ranks on GPUs takes tp of them */
        char one[32];
        const uint32_t tp = i ? cfg->decode.tp : cfg->prefill.tp;
        const unsigned nd = td_device_pick(w[i].device, 0, one, sizeof one);
        if (tp > 1 && strcmp(one, "cpu") && nd < tp)
            return td_error(TD_ERR_CONFIG, "config: %s.device = '%s' lists %u device(s); %s.tp = %u needs a GPU a rank "
                            "(tandem up hands each worker the next %u of the list)", w[i].role, w[i].device, nd,
                            w[i].role, tp, tp);
    }
    if (cfg->decode.tp > 1 && strncmp(cfg->decode.device, "cpu", 3)) { /* a region a rank, on the rank's GPU */
        if (!strcmp(cfg->transport.kind, "ucx"))
            return td_error(TD_ERR_CONFIG, "config: decode.tp = %u on GPUs with transport.kind = ucx: a pool of parts "
                            "takes puts in place, not through a host landing copy (transport.kind: cuda_ipc or auto)",
                            cfg->decode.tp);
    }
    bool known = !n_placements;
    char names[256] = "";
    for (size_t i = 0, at = 0; i < n_placements; i++) {
        known = known || !strcmp(cfg->router.placement, placements[i]);
        at += (size_t)snprintf(names + at, at < sizeof names ? sizeof names - at : 0, "%s%s", i ? ", " : "",
                               placements[i]);
    }
    if (!known)
        return td_error(TD_ERR_CONFIG, "config: router.placement = \"%s\"; it must be one of %s",
                        cfg->router.placement, names);
    return TD_OK;
}

size_t td_config_key_count(void) { return N_FIELDS; }

td_config_key_t td_config_key(size_t i)
{
    if (i >= N_FIELDS)
        return (td_config_key_t){0};
    const cfg_field_t *f = &cfg_fields[i];
    static const char *const types[] = {"string", "integer", "integer", "boolean"};
    return (td_config_key_t){f->name, f->def, f->doc, f->more, types[f->kind], f->min, f->max, f->choices, f->flag,
                             f->procs};
}

const char *td_config_section_doc(const char *name)
{
    for (size_t i = 0; i < sizeof cfg_sections / sizeof cfg_sections[0]; i++)
        if (!strcmp(cfg_sections[i].name, name))
            return cfg_sections[i].doc;
    return NULL;
}

td_status_t td_config_get(const td_config_t *cfg, const char *key, char *out, size_t n)
{
    for (size_t i = 0; i < N_FIELDS; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        if (strcmp(f->name, key))
            continue;
        const char *slot = (const char *)cfg + f->off;
        if (f->kind == CFG_STR)
            snprintf(out, n, "%s", *(char *const *)(const void *)slot);
        else if (f->kind == CFG_BOOL)
            snprintf(out, n, "%s", *(const bool *)(const void *)slot ? "true" : "false");
        else
            snprintf(out, n, "%llu", f->kind == CFG_U32 ? (unsigned long long)*(const uint32_t *)(const void *)slot
                                                        : (unsigned long long)*(const uint64_t *)(const void *)slot);
        return TD_OK;
    }
    return td_error(TD_ERR_CONFIG, "config: unknown key '%s'", key);
}

/* Does the process (procs bit, role section) take key f's flag? */
static bool takes_flag(const cfg_field_t *f, unsigned procs, const char *section)
{
    if (!f->flag || !(f->procs & procs))
        return false;
    bool role_key = !strncmp(f->name, "prefill.", 8) || !strncmp(f->name, "decode.", 7);
    return !role_key || (section && !strncmp(f->name, section, strlen(section)) && f->name[strlen(section)] == '.');
}

/* --help: the usage, then every key with its default, the process's flag for it and what it sets. */
static void help(const char *usage, unsigned procs, const char *section)
{
    printf("%s\nconfig keys (section.key: default, this program's flag for it — what it sets; "
           "docs/configuration.md has more on each):\n", usage);
    for (size_t i = 0; i < N_FIELDS; i++) {
        const cfg_field_t *f = &cfg_fields[i];
        printf("  %-26s %-18s %-18s %s\n", f->name, f->def[0] ? f->def : "\"\"",
               takes_flag(f, procs, section) ? f->flag : "", f->doc);
    }
}

void td_config_free(td_config_t *cfg)
{
    if (!cfg)
        return;
    for (size_t i = 0; i < N_FIELDS; i++)
        if (cfg_fields[i].kind == CFG_STR) {
            char **slot = (char **)(void *)((char *)cfg + cfg_fields[i].off);
            free(*slot);
            *slot = NULL;
        }
}

int td_config_from_args(td_config_t *cfg, const char *prog, const char *section, unsigned procs,
                        const char *const *own, td_own_flag_fn own_fn, void *ctx, const char *usage, int argc,
                        char **argv)
{
    if (td_config_defaults(cfg))
        return 2;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            help(usage, procs, section);
            td_config_free(cfg);
            exit(0);
        }
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--config") && td_config_load(cfg, argv[i + 1])) {
            fprintf(stderr, "%s: %s\n", prog, td_last_error());
            return 2;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        const cfg_field_t *f = NULL;
        for (size_t k = 0; k < N_FIELDS && !f; k++)
            if (takes_flag(&cfg_fields[k], procs, section) && !strcmp(a, cfg_fields[k].flag))
                f = &cfg_fields[k];
        bool mine = false;
        for (size_t k = 0; own && own[k] && !mine; k++)
            mine = !strcmp(a, own[k]);
        if (!f && !mine && strcmp(a, "--config")) {
            fprintf(stderr, "%s: unknown argument '%s'\n%s", prog, a, usage);
            return 2;
        }
        if (!v) {
            fprintf(stderr, "%s: %s needs a value\n", prog, a);
            return 2;
        }
        i++;
        if (mine) {
            if (own_fn(ctx, a, v))
                return 2;
        } else if (f && td_config_set(cfg, f->name, v)) {
            fprintf(stderr, "%s: %s: %s\n", prog, a, td_last_error());
            return 2;
        }
    }
    if (td_config_validate(cfg)) {
        fprintf(stderr, "%s: %s\n", prog, td_last_error());
        return 2;
    }
    return 0;
}

int td_own_listen_id(void *ctx, const char *flag, const char *value)
{
    td_listen_id_t *o = ctx;
    if (!strcmp(flag, "--listen"))
        snprintf(o->listen, o->listen_cap, "%s", value);
    else
        snprintf(o->id, o->id_cap, "%s", value);
    return 0;
}
