/* client.h — the KV store's client library: how workers find, read and
 * write blocks in the kvstore nodes (DESIGN.md §4).
 *
 * The live nodes are the records under /tandem/kvstores/ in etcd (watched);
 * a name's home is the node with the highest rendezvous score
 * XXH3-64(name, seed = XXH3-64(node id)), so every process agrees on it
 * without asking, a node's loss moves only its own names (to their next
 * node), and its return moves back only those.
 *
 * Reads are two-phase so that a worker takes pool blocks only for what the
 * store holds: kv_client_lookup asks the near node (the one on this host,
 * kvstore.near: it may hold replicas of hot blocks) for the whole chain,
 * then each home node for its names of the rest (held under a read lease)
 * and finds the longest prefix held;
 * kv_client_fetch moves those blocks with one UCX get per contiguous run
 * and checks each block's digest (a block that arrives otherwise ends the
 * prefix there); kv_client_read_end lets the leases go. Writes are
 * write-behind: kv_client_put_async queues blocks for the client's writer
 * threads (Put, UCX puts, Commit with digests) and calls back when done, so
 * the caller keeps the source bytes untouched until then.
 *
 * Every RPC and transfer has a deadline; a node that is dead or frozen
 * turns into a shorter prefix (a miss), never a hang. Thread safe. */
#ifndef KV_CLIENT_H
#define KV_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/kv_contract.h"
#include "common/rpc.h"
#include "common/status.h"
#include "kvstore/transfer.h"

typedef struct kv_client kv_client_t;
typedef struct kv_client_read kv_client_read_t;

typedef struct kv_client_config {
    const char *etcd_endpoints;
    const td_rpc_tls_t *tls;      /* the cluster's mutual TLS, or NULL (plaintext) */
    td_kv_layout_t contract;      /* the blocks' contract */
    kv_xfer_config_t xfer;        /* the KV transport's settings */
    uint32_t max_queued_blocks;   /* write-behind: blocks waiting at most (default 4096); more are not published */
    const char *near_node;        /* kvstore.near: the node on this host, asked first (NULL or "": none) */
} kv_client_config_t;

td_status_t kv_client_create(const kv_client_config_t *cfg, kv_client_t **out);
/* Waits for the writers' queue to drain (up to 5 s), then closes. */
void kv_client_destroy(kv_client_t *c);
/* The longest prefix of names[0..n) the store holds: *found names, held for
 * the reader until kv_client_read_end (*rd, also when *found is 0). Nodes
 * that fail or time out count as misses (logged at debug). */
td_status_t kv_client_lookup(kv_client_t *c, const td_block_name_t *names, uint32_t n, double timeout_s,
                             kv_client_read_t **rd, uint32_t *found);
/* Reads blocks [from, from + n) of the prefix found (from + n <= found)
 * into dst[0..n) (block_bytes each); *got: the blocks, from the first, that
 * arrived with their digests (fewer than n when a node failed or a block
 * was bad). */
td_status_t kv_client_fetch(kv_client_t *c, kv_client_read_t *rd, uint32_t from, uint32_t n, void *const *dst,
                            double timeout_s, uint32_t *got);
void kv_client_read_end(kv_client_t *c, kv_client_read_t *rd);

/* Queues names[i] with its bytes src[i] for publishing; done(ctx, stored)
 * runs on one of the writer threads once every block was stored, found present,
 * or failed (stored: how many were new). src must stay unchanged until
 * then. TD_ERR_EXHAUSTED (done not called) when the queue is full. */
td_status_t kv_client_put_async(kv_client_t *c, const td_block_name_t *names, const void *const *src, uint32_t n,
                                void (*done)(void *ctx, uint32_t stored), void *ctx);

/* Writes names[i] with src[i] to the live node node_id now (not to their
 * homes), as replicas when replica is set; *stored: how many were new.
 * digests[i]: the digest the block was stored with (a copy carries its
 * writer's, so bytes that changed since are caught by its readers), or
 * NULL to hash src[i]. */
td_status_t kv_client_put_node(kv_client_t *c, const char *node_id, const td_block_name_t *names,
                               const void *const *src, const uint64_t *digests, uint32_t n, bool replica,
                               uint32_t *stored);

/* The home of name among node ids ids[0..n) (rendezvous hashing): its
 * index, or -1 when n is 0. */
int kv_client_home(td_block_name_t name, const uint64_t *id_seeds, uint32_t n);
uint64_t kv_client_node_seed(const char *id);

#endif
