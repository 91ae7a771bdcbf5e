/* peers.h — the prefill worker's decode peers: a connection to each decode
 * worker's pool, made on a landing's first use and cached (closed between
 * steps once it failed or sat idle and no request holds it); the pusher
 * thread, which puts each queued slice of KV into a peer's pool while the
 * engine computes the next layers, and flushes every peer it wrote at a
 * barrier; and the checks of a landing descriptor before any byte moves (its
 * grant, its parts).
 *
 * A peer that fails (a put, a flush, a fence, a barrier past its deadline)
 * is marked failed for good: the requests landing on it see that after the
 * step and end UNAVAILABLE; later landings to the same address connect
 * anew. */
#ifndef TANDEM_PREFILL_PEERS_H
#define TANDEM_PREFILL_PEERS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/certs.h"
#include "common/kv_contract.h"
#include "common/status.h"
#include "kvstore/transfer.h"
#include "tandem/internal/v1/worker.pb-c.h"

/* A connection to one decode worker's pool. The fields are the pusher's and
 * the landing code's to read; the peer table owns the entry. */
typedef struct pw_peer {
    uint8_t *addr;
    size_t addr_len;
    kv_xfer_peer_t *peer;
    uint32_t region; /* the decode worker's pool (of parts: rank 0's) */
    /* a pool of parts (LandingDescriptor.parts): a region a rank, each holding KV heads [head0, head0 + heads)
     * of every block in the layout of that many heads (part_bytes a block) */
    uint32_t n_parts;
    struct pw_peer_part {
        uint32_t region, head0, heads;
        size_t part_bytes;
    } parts[KV_XFER_MAX_REGIONS];
    atomic_bool failed; /* set by any thread (the pusher, the engine's), never cleared */
    int refs;    /* requests holding it (under the table's lock) */
    double last_used;
} pw_peer_t;

typedef struct pw_peers pw_peers_t;

typedef struct pw_peers_stats {
    double busy_s;    /* putting and flushing, all time */
    uint64_t bytes;   /* put, all time */
    uint64_t dropped; /* puts not made: past their land-by */
    uint32_t n_peers; /* connections open */
} pw_peers_stats_t;

/* The table and its pusher thread over transport `xo` (endpoint x, which the
 * caller keeps). A connection nobody used for idle_s seconds is closed.
 * pw_peers_destroy frees it. */
td_status_t pw_peers_create(const kv_transport_ops_t *xo, kv_xfer_t *x, double idle_s, pw_peers_t **out);

/* Stops the pusher (call with nothing queued: after a barrier) and closes
 * every connection. NULL is fine. */
void pw_peers_destroy(pw_peers_t *P);

/* The cached connection to the pool `ld` names (contract g: the landing's,
 * checked equal to ours), connecting on first use; held (refs) until
 * pw_peer_release. NULL when it cannot be made (the transport said why). */
pw_peer_t *pw_peer_get(pw_peers_t *P, const Tandem__Internal__V1__LandingDescriptor *ld, const td_kv_layout_t *g);
void pw_peer_release(pw_peers_t *P, pw_peer_t *pe);

/* Between steps (the pusher idle, nothing queued): closes the connections
 * that failed or sat idle, that no request holds. */
void pw_peers_reap(pw_peers_t *P);

/* Marks every peer failed (their requests end UNAVAILABLE), logging why. */
void pw_peers_fail_all(pw_peers_t *P, const char *why);

/* Engine thread: where the transport orders puts after device work, a fence
 * after the work queued on `queue` so far (*fence; 0 where it needs none).
 * On failure every peer has been failed. */
td_status_t pw_peers_fence(pw_peers_t *P, void *queue, uint64_t *fence);

/* Queues a put of len bytes at src to offset dst of peer pe's region, not to
 * be made past land_by (td_now_s()) nor before fence. */
void pw_peers_put(pw_peers_t *P, pw_peer_t *pe, uint32_t region, const void *src, size_t len, uint64_t dst,
                  double land_by, uint64_t fence);

/* Waits until every queued put is issued and every peer it touched flushed;
 * the seconds it waited. Past its deadline every peer is failed rather than
 * the caller waiting on. */
double pw_peers_barrier(pw_peers_t *P);

pw_peers_stats_t pw_peers_stats(pw_peers_t *P);

/* A landing into a pool of parts: 2 to KV_XFER_MAX_REGIONS regions, each
 * part whole KV heads of layout g, every head in some part, and every
 * landing block (a whole block's offset, bb bytes a block) inside every
 * part's region. True for a landing of whole blocks; else why not in err. */
bool pw_landing_parts_ok(const Tandem__Internal__V1__LandingDescriptor *ld, const td_kv_layout_t *g, size_t bb,
                         char *err, size_t n);

/* The landing is a grant from a decode worker of this cluster (checked with
 * v: its signature over the descriptor, fields 12 and 13 left out) whose
 * land-by time has not passed: NULL and *land_by (on td_now_s()'s clock), or
 * why not (*land_by set only when the time is what failed). */
const char *pw_landing_grant(td_verifier_t *v, const Tandem__Internal__V1__LandingDescriptor *ld, double *land_by);

#endif
