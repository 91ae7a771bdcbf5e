/* kv_contract.h — the KV contract (DESIGN.md §3): everything two peers must
 * agree on before one writes KV blocks the other reads. Layout version, pool
 * dtype, tokens per block, block-name hash scheme, and the model (its id and
 * the shape that fixes a block's size). Peers state theirs when they connect;
 * a mismatch is refused with an error that names both sides' values, and KV is
 * never converted. */
#ifndef TD_KV_CONTRACT_H
#define TD_KV_CONTRACT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TD_KV_LAYOUT_VERSION 1   /* [layer][k|v][kv_head][token][head_dim] */
#define TD_KV_HASH_SCHEME "xxh3-128-chain-v1"

typedef struct td_kv_contract {
    uint32_t layout_version;
    char dtype[8];          /* fp16 | fp32 */
    uint32_t block_tokens;
    char hash_scheme[32];
    char model_id[128];
    uint32_t n_layers, n_kv_heads, head_dim;
} td_kv_contract_t;

/* Checks that peer's contract equals ours; the error names the first field
 * that differs with both values ("block_tokens: here 16, peer 32"). */
td_status_t td_kv_contract_check(const td_kv_contract_t *ours, const td_kv_contract_t *peer, const char *peer_name);
/* Bytes of one block under the contract. */
size_t td_kv_contract_block_bytes(const td_kv_contract_t *c);

/* The digest of one block's bytes (XXH3-64 over the whole block in the
 * canonical layout, every layer, the unused tail of a partial block too).
 * The prefill side states the digest of every block it pushed; the decode
 * side computes it over its landing blocks before decode starts, so a block
 * that is missing, partial or overwritten is an error, never silent garbage. */
uint64_t td_kv_block_digest(const void *block, size_t block_bytes);

#endif
