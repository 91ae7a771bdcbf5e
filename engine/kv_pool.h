/* kv_pool.h — the paged KV pool: fixed-size blocks of KV in the canonical
 * layout that every pool, the wire and the kvstore share (td_kv_layout_t,
 * common/kv_contract.h; DESIGN.md §3). Blocks are reference counted: a block
 * shared by several sequences (a common prefix) is freed when the last lets go.
 * A full block may be published under its name (common/blockhash.h); when its
 * count drops to zero it stays cached, reusable by name, until the pool needs
 * the space and evicts it, least recently used first. */
#ifndef ENG_KV_POOL_H
#define ENG_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/status.h"
#include "kernels/backend.h"

typedef struct eng_kv_pool eng_kv_pool_t;

/* Where a pool's blocks live: a provider of one region of `bytes`, freed
 * when the pool goes. The worker's provider maps it with the KV transport
 * (host memory peers can put into, kvstore/transfer.h); a GPU worker's will
 * give device memory. The memory must be the backend's kind. */
typedef struct eng_kv_memory {
    td_status_t (*alloc)(void *ctx, size_t bytes, void **mem);
    void (*free)(void *ctx, void *mem);
    void *ctx;
} eng_kv_memory_t;

/* A pool of n_blocks blocks in the provider's memory (mem NULL or its alloc
 * NULL: the backend's own, ops->alloc). */
td_status_t eng_kv_pool_create(kern_backend_t *be, const td_kv_layout_t *g, uint32_t n_blocks,
                               const eng_kv_memory_t *mem, eng_kv_pool_t **out);
/* A pool whose blocks are split by KV head over tensor-parallel ranks (engine/tp.h): its counts, names and
 * recency kept once, rank r's part of every block (KV heads [head0[r], head0[r] + heads[r]) of g's, in the
 * canonical layout of that many heads) in bes[r]'s memory, or the provider's (mem: each part's allocation
 * asked in rank order, memory every rank's backend reaches). Its layout and stats are the whole block's. */
td_status_t eng_kv_pool_create_parts(kern_backend_t *const *bes, uint32_t ranks, const uint32_t *head0,
                                     const uint32_t *heads, const td_kv_layout_t *g, uint32_t n_blocks,
                                     const eng_kv_memory_t *mem, eng_kv_pool_t **out);
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
/* Whether a block is cached under name; nothing changes (no count, no recency). */
bool eng_kv_holds(eng_kv_pool_t *p, td_block_name_t name);

/* Named blocks come and go: `stored` when a block is published under a new
 * name, `removed` when a named block's name is dropped (it was evicted for
 * space). Each event carries the pool's sequence number, one higher than the
 * last event's, so a consumer (the store's index, the router's cache map)
 * that starts from a snapshot applies exactly the events after it and can
 * tell when it missed one. Events are raised on the thread that changed the
 * pool, inside the call; the listener must not call back into the pool. */
typedef enum eng_kv_event_kind { ENG_KV_STORED = 1, ENG_KV_REMOVED = 2 } eng_kv_event_kind_t;
typedef struct eng_kv_event {
    eng_kv_event_kind_t kind;
    uint64_t seq;
    td_block_name_t name;
    int32_t block;
} eng_kv_event_t;
typedef void (*eng_kv_event_fn)(void *ctx, const eng_kv_event_t *ev);
void eng_kv_set_listener(eng_kv_pool_t *p, eng_kv_event_fn fn, void *ctx);
/* Every named block now (fn(ctx, name, block) each), and the sequence number
 * of the last event it includes. */
uint64_t eng_kv_snapshot(const eng_kv_pool_t *p, void (*fn)(void *ctx, td_block_name_t name, int32_t block),
                         void *ctx);
/* The longest run of occupied slots in the name index: the most slots a
 * lookup of an absent name reads. Deleted names free their slot (no
 * tombstones), so it stays short however long the pool runs. */
uint32_t eng_kv_index_longest_run(const eng_kv_pool_t *p);

/* The pool's layout, and the view of one layer for the backend's kv_store
 * and attention. */
const td_kv_layout_t *eng_kv_layout(const eng_kv_pool_t *p);
kern_kv_view_t eng_kv_view(const eng_kv_pool_t *p, uint32_t layer);
/* A pool of parts: 1 or the ranks; rank r's view of its part (rank 0's: eng_kv_view). */
uint32_t eng_kv_ranks(const eng_kv_pool_t *p);
/* Rank r's KV heads: [*head0, *head0 + *heads) (a pool of whole blocks: all of them). */
void eng_kv_part_heads(const eng_kv_pool_t *p, uint32_t rank, uint32_t *head0, uint32_t *heads);
kern_kv_view_t eng_kv_view_rank(const eng_kv_pool_t *p, uint32_t rank, uint32_t layer);
/* n blocks out to host memory (whole blocks in the canonical layout, back to back), synchronized for a pool of
 * parts (its backends' queues are drained), as queued for a whole one; and in from it, queued. */
td_status_t eng_kv_download(const eng_kv_pool_t *p, const int32_t *blocks, uint32_t n, void *dst);
/* Where layer `layer` of block `block` lies in the pool's memory: pieces, each bytes contiguous there and at off in
 * the whole block — one for a pool of whole blocks, a pool of parts' runs (a replicated head's from the first rank
 * holding it). out: room for ENG_KV_PIECES_MAX; their number. */
typedef struct eng_kv_piece {
    const uint8_t *src;
    size_t bytes, off;
} eng_kv_piece_t;
#define ENG_KV_PIECES_MAX (16 * TD_KV_RUNS_PER_LAYER)
uint32_t eng_kv_layer_pieces(const eng_kv_pool_t *p, int32_t block, uint32_t layer, eng_kv_piece_t *out);
td_status_t eng_kv_upload(eng_kv_pool_t *p, const int32_t *blocks, uint32_t n, const void *src);

typedef struct eng_kv_stats {
    uint32_t n_blocks, in_use, cached, free;
    size_t block_bytes, bytes_per_token;
} eng_kv_stats_t;
eng_kv_stats_t eng_kv_stats(const eng_kv_pool_t *p);

#endif
