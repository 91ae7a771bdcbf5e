/* transfer.h — moving KV bytes between processes: the KV transport.
 *
 * A transport is a table of operations (kv_transport_ops_t) over a context:
 * UCX over host memory (shared memory, TCP, RDMA: whatever UCX finds); in
 * builds with CUDA, CUDA IPC over device memory between processes of one host
 * (transfer_cuda.c), and UCX for device memory on any host, staged through
 * page-locked, UCX-registered host buffers (transfer_staged.c).
 *
 * The target of a transfer exposes memory that peers may write into: it is
 * allocated by the transport itself (for UCX, ucp_mem_map with ALLOCATE, the
 * only way puts stay truly one-sided, shared/STACK.md), and described to
 * peers by an opaque address and remote key, handed over an authenticated RPC.
 * The initiator connects to that description and issues puts and gets; a
 * put's completion means only that its source may be reused, so a flush is
 * what says the bytes have landed (and that gets have arrived). Every wait has a deadline; a peer that died
 * turns into TD_ERR_UNAVAILABLE, never a hang.
 *
 * Threads: a context is used by one thread at a time, except that a target
 * may run kv_xfer_progress_start's thread beside the thread that set it up. */
#ifndef KV_TRANSFER_H
#define KV_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct kv_xfer kv_xfer_t;
typedef struct kv_xfer_mem kv_xfer_mem_t;
typedef struct kv_xfer_peer kv_xfer_peer_t;

/* Settings of a transport (the worker's `kvstore.transport` config keys). */
typedef struct kv_xfer_config {
    /* UCX: peer error handling on endpoints, so a dead target fails its
     * endpoint at once. In UCX 1.13 it rules out the shared-memory transports
     * (RMA then runs over TCP loopback, ~17x slower: bench/results), so it is
     * off by default; a dead peer is then learnt from gRPC and etcd, and every
     * wait here still has a deadline. */
    bool peer_errors;
    /* The network interfaces UCX may use, comma-separated ("lo", "eth1"; its
     * UCX_NET_DEVICES); NULL or "" leaves UCX's own choice (every interface).
     * UCX listens on each, unauthenticated, so tandem names them. */
    const char *interfaces;
    /* Device transports: the device whose memory this process allocates and copies from. */
    int device;
    /* Peers put into this process's memory (a decode worker's pool): the
     * staged transport keeps a host landing copy of it (see landed). */
    bool target;
} kv_xfer_config_t;

#define KV_XFER_MAX_REGIONS 8

typedef struct kv_transport_ops {
    const char *name;
    td_status_t (*create)(const kv_xfer_config_t *cfg, kv_xfer_t **out);
    void (*destroy)(kv_xfer_t *x);
    /* Target side: memory peers may put into and get from, its remote key
     * (the region's description for peers), our address. */
    td_status_t (*mem_alloc)(kv_xfer_t *x, size_t bytes, void **addr, kv_xfer_mem_t **out);
    void (*mem_free)(kv_xfer_t *x, kv_xfer_mem_t *m);
    td_status_t (*mem_rkey)(kv_xfer_t *x, kv_xfer_mem_t *m, void **rkey, size_t *len); /* malloc'd */
    td_status_t (*address)(kv_xfer_t *x, void **addr, size_t *len);                      /* malloc'd */
    /* Target side, optional: a thread that drives the transport for peers'
     * operations that need the target's help (TCP). */
    td_status_t (*progress_start)(kv_xfer_t *x);
    /* Initiator side: a connection to the peer at addr, then the peer's
     * regions (up to KV_XFER_MAX_REGIONS: a pool, a store's tiers), each
     * described by its remote key, its base address there and its length. */
    td_status_t (*connect)(kv_xfer_t *x, const void *addr, size_t addr_len, kv_xfer_peer_t **out);
    td_status_t (*region_add)(kv_xfer_t *x, kv_xfer_peer_t *p, const void *rkey, size_t rkey_len,
                              uint64_t remote_base, uint64_t remote_len, uint32_t *region);
    /* One-sided writes and reads of len bytes at offset in a region; an
     * access past the region's end is refused (TD_ERR_OUT_OF_RANGE) before
     * anything moves. Completion is what flush waits for. */
    td_status_t (*put)(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, const void *src, size_t len, uint64_t offset);
    td_status_t (*get)(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, void *dst, size_t len, uint64_t offset);
    /* Waits until every put to p so far has landed and every get has
     * arrived (or timeout_s passes: TD_ERR_TIMEOUT). */
    td_status_t (*flush)(kv_xfer_t *x, kv_xfer_peer_t *p, double timeout_s);
    void (*disconnect)(kv_xfer_t *x, kv_xfer_peer_t *p);
    /* Device transports only (NULL for UCX): sources written by queued device
     * work. fence records the point reached so far on `stream` (the
     * backend's queue, kern_backend_ops_t.queue) and may be called from the
     * thread that queues that work while another thread puts; after
     * wait_fence(f), every later put starts once that point is done. */
    td_status_t (*fence)(kv_xfer_t *x, void *stream, uint64_t *fence);
    td_status_t (*wait_fence)(kv_xfer_t *x, uint64_t fence);
    /* Target side, optional (NULL: peers' puts land in the memory itself):
     * peers put into a landing copy of m; once their initiator flushed and
     * said so, the n ranges [offsets[i], offsets[i] + len) are copied from it
     * into m's memory (returns when done). */
    td_status_t (*landed)(kv_xfer_t *x, kv_xfer_mem_t *m, const uint64_t *offsets, uint32_t n, size_t len);
    /* Set with landed: the address peers name m by (its landing copy's base:
     * a region's remote_base); without it, the address mem_alloc returned. */
    uint64_t (*remote_base)(kv_xfer_t *x, kv_xfer_mem_t *m);
    /* Device transports, optional (NULL: the context's device only): another
     * device of this process, for a worker whose tensor-parallel ranks take a
     * GPU each. mem_alloc_on is mem_alloc on that device (its remote key names
     * it, so an initiator knows whose memory it maps); reach lets puts take
     * their source, and gets their destination, in that device's memory. */
    td_status_t (*mem_alloc_on)(kv_xfer_t *x, int device, size_t bytes, void **addr, kv_xfer_mem_t **out);
    td_status_t (*reach)(kv_xfer_t *x, int device);
} kv_transport_ops_t;

extern const kv_transport_ops_t kv_transport_ucx;
#ifdef TANDEM_HAVE_CUDA
extern const kv_transport_ops_t kv_transport_cuda_ipc;
extern const kv_transport_ops_t kv_transport_ucx_staged;
#endif

/* UCX's context only: registers [addr, addr + len) of this process's memory
 * (host buffers a transport puts from and gets into); mem_free unregisters. */
td_status_t kv_ucx_mem_register(kv_xfer_t *x, void *addr, size_t len, kv_xfer_mem_t **out);

/* The transport a landing descriptor names ("ucx"; in builds with CUDA
 * "cuda_ipc" and "ucx_staged"; "" means ucx), or NULL. */
const kv_transport_ops_t *kv_transport_find(const char *name);

#endif
