/* ops.h — the ops config: what operators decide about a running cluster
 * (DESIGN.md §7), as opposed to how each process is set up (config.h).
 *
 *   slo:     { ttft_ms: 0, tpot_ms: 0, attainment: 0.9 }
 *   planner: { interval_s: 2, hold_s: 10, cooldown_s: 30 }
 *   models:
 *     - name: "*"            # the model as the router lists it; "*": any
 *       policy: fixed        # fixed: the counts below | auto: the planner moves
 *       prefill: 1           #   workers between roles within the bounds
 *       decode: 1
 *       min_prefill: 1
 *       max_prefill: 16
 *       min_decode: 1
 *       max_decode: 16
 *       colocated: false     # true: no prefill workers; decode workers serve
 *                            #   whole requests (decode.colocated), policy fixed
 *       choose_mode: false   # auto: the planner also runs the model colocated
 *                            #   (no prefill workers) when that serves it better
 *
 * deploy/ops.yaml is the file; `tandem scale --apply FILE` sends it to a
 * router, which validates it and puts it in etcd at TD_OPS_KEY. The elected
 * planner (router/planner.h) turns it into the desired worker counts at
 * TD_OPS_DESIRED_KEY, and every node agent (tandem up) runs its share of
 * them (td_ops_share). One schema reads the file, the etcd copy and the
 * request, and writes the etcd copy (common/yaml.h). */
#ifndef TD_OPS_H
#define TD_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TD_OPS_KEY "/tandem/ops"
#define TD_OPS_DESIRED_KEY "/tandem/desired"
#define TD_OPS_NODES_PREFIX "/tandem/nodes/"
#define TD_OPS_PLANNER_KEY "/tandem/planner"
#define TD_OPS_MAX_WORKERS 64 /* a role's count at most, cluster-wide */
#define TD_OPS_MAX_MODELS 16

typedef struct td_ops_model {
    char *name, *policy;
    uint32_t prefill, decode;
    uint32_t min_prefill, max_prefill, min_decode, max_decode;
    bool colocated;
    bool choose_mode; /* policy auto: the planner may go colocated (prefill 0) and back */
} td_ops_model_t;

typedef struct td_ops {
    struct { uint32_t ttft_ms, tpot_ms; double attainment; } slo;
    struct { uint32_t interval_s, hold_s, cooldown_s; } planner;
    td_ops_model_t *models;
    unsigned models_count;
} td_ops_t;

/* Reads an ops config from text (YAML, or the JSON subset of it), fills
 * the defaults of what is absent and validates it; errors name origin, the
 * key and (for a key the schema refuses) its line. Free with td_ops_free. */
td_status_t td_ops_parse(const char *text, size_t len, const char *origin, td_ops_t **out);
td_status_t td_ops_load_file(const char *path, td_ops_t **out);
/* The canonical YAML of ops (every key, defaults written out; free()). */
td_status_t td_ops_format(const td_ops_t *ops, char **text);
/* The fixed counts of one model (`tandem scale --prefill N --decode M`):
 * its entry (td_ops_model's) becomes policy fixed with these counts; a count
 * outside the entry's bounds is refused naming the bound. An ops with no
 * entry for the model gets one named "*". */
td_status_t td_ops_set_counts(td_ops_t *ops, const char *model, const char *alias, uint32_t prefill,
                              uint32_t decode);
/* The entry that governs a model: the one of its name, else of its alias
 * (the model's own name where it is served under another; NULL: none), else
 * "*", else NULL. */
const td_ops_model_t *td_ops_model(const td_ops_t *ops, const char *model, const char *alias);
bool td_ops_is_auto(const td_ops_model_t *m);
void td_ops_free(td_ops_t *ops);

/* The planner's decision (TD_OPS_DESIRED_KEY, JSON): the cluster's worker
 * counts, who decided and why. */
typedef struct td_ops_desired {
    uint32_t prefill, decode;
    bool colocated;     /* the decode workers serve whole requests (started with decode.colocated) */
    double at;          /* unix seconds */
    char by[192];       /* the planner's id */
    char reason[640];
} td_ops_desired_t;

/* JSON text (free()), or NULL without memory. */
char *td_ops_desired_json(const td_ops_desired_t *d);
td_status_t td_ops_desired_parse(const char *text, size_t len, td_ops_desired_t *out);

/* A node's share of the desired counts: the nodes that take workers (names
 * sorted, self among them) split each role as evenly as they can, the
 * remainders of decode starting where prefill's ended, so that every node
 * computes the same split without talking to the others. */
void td_ops_share(const td_ops_desired_t *d, const char *const *nodes, size_t n, const char *self, uint32_t *prefill,
                  uint32_t *decode);

#endif
