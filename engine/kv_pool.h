/* kv_pool.h — the paged KV pool: fixed-size blocks of KV in the canonical
 * layout that every pool, the wire and the kvstore share (DESIGN.md §3).
 *
 * One block holds block_tokens consecutive tokens of one sequence, all layers:
 *
 *   block ─┬─ layer 0 ─┬─ K ─┬─ kv_head 0: [token 0][head_dim] ... [token bt-1][head_dim]
 *          │           │     └─ kv_head 1: ...
 *          │           └─ V ─── kv_head 0 ... kv_head n_kv-1
 *          ├─ layer 1 ── K, V
 *          └─ ...
 *   offset(layer, k|v, head, token) = ((layer * 2 + kv) * n_kv_heads + head) * bt * head_dim + token * head_dim
 *
 * in the pool's dtype (fp32 or fp16). Blocks are reference counted: a block
 * shared by several sequences (a common prefix) is freed when the last lets go.
 * A full block may be published under its name (common/blockhash.h); when its
 * count drops to zero it stays cached, reusable by name, until the pool needs
 * the space and evicts it, least recently used first. */
#ifndef ENG_KV_POOL_H
#define ENG_KV_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/status.h"
#include "kernels/backend.h"

typedef struct eng_kv_geom {
    uint32_t n_layers, n_kv_heads, head_dim, block_tokens;
    kern_kv_dtype_t dtype;
} eng_kv_geom_t;

typedef struct eng_kv_pool eng_kv_pool_t;

/* Bytes of one block (all layers, K and V). */
size_t eng_kv_block_bytes(const eng_kv_geom_t *g);

/* A pool of n_blocks blocks in the backend's memory. */
td_status_t eng_kv_pool_create(kern_backend_t *be, const eng_kv_geom_t *g, uint32_t n_blocks, eng_kv_pool_t **out);
/* The same in memory the caller owns (host memory of block_bytes * n_blocks,
 * e.g. allocated by UCX so that peers can put KV into it); it is not freed here. */
td_status_t eng_kv_pool_create_at(kern_backend_t *be, const eng_kv_geom_t *g, uint32_t n_blocks, void *mem,
                                  eng_kv_pool_t **out);
void eng_kv_pool_destroy(eng_kv_pool_t *p);

/* A fresh block with count 1, evicting a cached one if none is free;
 * TD_ERR_NO_MEMORY (not logged: the scheduler preempts) when all are in use. */
td_status_t eng_kv_alloc(eng_kv_pool_t *p, int32_t *block);
void eng_kv_ref(eng_kv_pool_t *p, int32_t block);
void eng_kv_unref(eng_kv_pool_t *p, int32_t block);
/* Names a full block. If the name already has a block, returns that one and
 * leaves this one unnamed. */
int32_t eng_kv_publish(eng_kv_pool_t *p, int32_t block, td_block_name_t name);
/* The block cached under name (its count raised by one), or -1. */
int32_t eng_kv_lookup(eng_kv_pool_t *p, td_block_name_t name);

/* The view of one layer, for the backend's kv_store and attention. */
kern_kv_view_t eng_kv_view(const eng_kv_pool_t *p, uint32_t layer);

typedef struct eng_kv_stats {
    uint32_t n_blocks, in_use, cached, free;
    size_t block_bytes, bytes_per_token;
} eng_kv_stats_t;
eng_kv_stats_t eng_kv_stats(const eng_kv_pool_t *p);

#endif
