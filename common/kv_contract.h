/* kv_contract.h — the KV layout (DESIGN.md §3): the one description of a KV
 * block that the pool, the kernels, the wire and the kvstore share, and the
 * contract two peers must agree on before one writes blocks the other reads.
 *
 * A block holds block_tokens consecutive tokens of one sequence, all layers,
 * in the canonical layout (layout_version 1):
 *
 *   [layer][k|v][kv_head][token][head_dim]   in dtype (fp16, fp32 or fp8_e4m3)
 *
 * and for fp8_e4m3 each layer's rows are followed by their scales,
 * [k|v][kv_head][token] in fp32: a row of head_dim values is stored as
 * kern_fp8_quantize_row makes it (amax / 448, then each value over it), so a
 * token's bytes depend on that token's K and V alone — never on which other
 * tokens share its block, how the prompt was chunked or whether the block was
 * written in one step or many (a scale per block would be, and cached output
 * would then depend on the path). The contract names the scale scheme
 * (kv_scales); blocks of another dtype have other names (blockhash.h).
 *
 * The contract is the whole struct: layout version, dtype, tokens per block,
 * block-name hash scheme, the model (its id and the shape that fixes a
 * block's size). Peers state theirs when they connect; a mismatch is refused
 * with an error that names both sides' values, and KV is never converted.
 * Encoded once per wire format: JSON here (etcd records), protobuf in
 * common/kv_contract_pb.h (RPCs). */
#ifndef TD_KV_CONTRACT_H
#define TD_KV_CONTRACT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TD_KV_LAYOUT_VERSION 1   /* [layer][k|v][kv_head][token][head_dim] */
#define TD_KV_HASH_SCHEME "xxh3-128-chain-v1"

typedef enum td_kv_dtype { TD_KV_F32 = 0, TD_KV_F16 = 1, TD_KV_F8_E4M3 = 2 } td_kv_dtype_t;
#define TD_KV_DTYPES 3

/* "fp16" | "fp32" | "fp8_e4m3" (parse takes "fp8" for it too, as vLLM's kv_cache_dtype does) */
const char *td_kv_dtype_name(td_kv_dtype_t d);
bool td_kv_dtype_parse(const char *s, td_kv_dtype_t *out);
/* the dtype's scale scheme, as the contract names it: "none", or "fp32 per token and kv head" */
const char *td_kv_scales_name(td_kv_dtype_t d);
static inline size_t td_kv_dtype_size(td_kv_dtype_t d) { return d == TD_KV_F16 ? 2 : d == TD_KV_F8_E4M3 ? 1 : 4; }

typedef struct td_kv_layout {
    /* the geometry first (positional initializers of tests name these) */
    uint32_t n_layers, n_kv_heads, head_dim, block_tokens;
    td_kv_dtype_t dtype;
    uint32_t layout_version; /* TD_KV_LAYOUT_VERSION */
    char hash_scheme[32];    /* TD_KV_HASH_SCHEME */
    char model_id[128];
    /* tensor parallelism: the ranks whose parts make this side's blocks (1: one), each holding whole KV heads
     * (n_kv_heads / tp of them, or one replicated when tp is the larger: engine/shard.h). Peers of different
     * degrees exchange whole blocks; a degree whose ranks cannot hold whole heads is refused (it cannot be
     * mapped onto the block), naming both sides' degrees and heads. */
    uint32_t tp;
} td_kv_layout_t;

/* A layout of the current version and hash scheme. */
td_kv_layout_t td_kv_layout_make(const char *model_id, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                                 uint32_t block_tokens, td_kv_dtype_t dtype);

/* Bytes of one block (all layers, K and V), of one token's KV in it, and of
 * one layer's slice of a block (its K and V rows, then their scales where the
 * dtype has them: contiguous). */
static inline size_t td_kv_layer_bytes(const td_kv_layout_t *l)
{
    size_t rows = (size_t)2 * l->n_kv_heads * l->block_tokens * l->head_dim * td_kv_dtype_size(l->dtype);
    return rows + (l->dtype == TD_KV_F8_E4M3 ? (size_t)2 * l->n_kv_heads * l->block_tokens * sizeof(float) : 0);
}
static inline size_t td_kv_block_bytes(const td_kv_layout_t *l) { return l->n_layers * td_kv_layer_bytes(l); }
static inline size_t td_kv_token_bytes(const td_kv_layout_t *l) { return td_kv_block_bytes(l) / l->block_tokens; }
/* Elements (not bytes) from a block's start to the K (which 0) or V (which
 * 1) rows of kv_head in layer. */
static inline size_t td_kv_offset(const td_kv_layout_t *l, uint32_t layer, uint32_t which, uint32_t kv_head)
{
    return layer * (td_kv_layer_bytes(l) / td_kv_dtype_size(l->dtype)) +
           ((size_t)which * l->n_kv_heads + kv_head) * l->block_tokens * l->head_dim;
}
/* fp8_e4m3: bytes from a block's start to the scales (fp32, one a token) of
 * the K (which 0) or V (which 1) rows of kv_head in layer. */
static inline size_t td_kv_scale_offset(const td_kv_layout_t *l, uint32_t layer, uint32_t which, uint32_t kv_head)
{
    return layer * td_kv_layer_bytes(l) + (size_t)2 * l->n_kv_heads * l->block_tokens * l->head_dim +
           ((size_t)which * l->n_kv_heads + kv_head) * l->block_tokens * sizeof(float);
}

/* Tensor parallelism (engine/shard.h): a rank's pool holds KV heads
 * [head0, head0 + heads) of every block, in the canonical layout of a model
 * with `heads` KV heads (td_kv_part_layout). The wire and the store keep
 * whole blocks, whatever wrote them: a rank's part lies in a whole block as
 * 2 runs a layer (K's heads, V's heads), 4 with fp8's scales; each run is
 * bytes contiguous on both sides. A peer of another TP degree is a peer like
 * any other: each rank puts its runs at their offsets in the landing block,
 * and takes them from a whole one. */
typedef struct td_kv_run {
    size_t part_off, block_off, bytes;
} td_kv_run_t;
#define TD_KV_RUNS_PER_LAYER 4
td_kv_layout_t td_kv_part_layout(const td_kv_layout_t *whole, uint32_t heads);
/* The runs of the part [head0, head0 + heads) of a block of layout whole; at most
 * TD_KV_RUNS_PER_LAYER * n_layers of them; their number. */
uint32_t td_kv_part_runs(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, td_kv_run_t *runs);
/* Their number, and run i alone (layer l's are [l * n / n_layers, (l + 1) * n / n_layers)). */
uint32_t td_kv_part_n_runs(const td_kv_layout_t *whole);
td_kv_run_t td_kv_part_run(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, uint32_t i);
/* What of the bytes [off, off + bytes) of a whole block the part [head0, head0 + heads) holds: runs (block_off in
 * the whole block, part_off in the part), at most max of them (a range within one layer has at most
 * TD_KV_RUNS_PER_LAYER); their number. A sender's piece goes to a receiver's part this way. */
uint32_t td_kv_part_overlap(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, size_t off, size_t bytes,
                            td_kv_run_t *out, uint32_t max);
/* The part copied into its place in a whole block, and out of it. */
void td_kv_part_to_block(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, const void *part, void *block);
void td_kv_block_to_part(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, const void *block, void *part);

/* A peer's stated kv_scales (NULL: not stated, the dtype's own) against the dtype's: TD_ERR_FORMAT naming
 * both when they differ. */
td_status_t td_kv_scales_check(td_kv_dtype_t d, const char *scales);
/* Checks that peer's contract equals ours; the error names the first field
 * that differs with both values ("block_tokens: here 16, peer 32"). */
td_status_t td_kv_contract_check(const td_kv_layout_t *ours, const td_kv_layout_t *peer, const char *peer_name);
/* Whether l's blocks can be made of tp ranks' parts (each whole KV heads): TD_ERR_CONFIG naming them if not. */
td_status_t td_kv_tp_check(const td_kv_layout_t *l);

/* The JSON form (etcd's worker records): an object with every field; and
 * back, TD_ERR_PARSE naming a missing or ill-typed field. */
struct json_t;
struct json_t *td_kv_layout_to_json(const td_kv_layout_t *l);
td_status_t td_kv_layout_from_json(const struct json_t *j, td_kv_layout_t *l);

/* The digest of one block's bytes (XXH3-64 over the whole block in the
 * canonical layout, every layer, the unused tail of a partial block too).
 * The prefill side states the digest of every block it pushed; the decode
 * side computes it over its landing blocks before decode starts, so a block
 * that is missing, partial or overwritten is an error, never silent garbage.
 * Workers compute it through their backend (kern_backend_ops_t.kv_digest):
 * this function for pools in host memory; GPU pools, which only GPU peers
 * write (CUDA IPC), use the device's own digest where the blocks lie. */
uint64_t td_kv_block_digest(const void *block, size_t block_bytes);

#endif
