/* transfer_staged.c — the UCX KV transport for device memory (transfer.h): a
 * GPU worker's pool reached over UCX from any host. Debian's UCX has no CUDA
 * transports, so the bytes cross through host memory (DESIGN.md §2).
 *
 * Initiator: a put's source is pool memory on the device. Puts are gathered
 * into one of two page-locked, UCX-registered staging buffers (STAGE_BYTES
 * each), copied there on the transport's own stream (small ones by the
 * batched copy kernel, transfer_cuda_copy.cu; large ones by the copy engine)
 * after the fences the caller waited for. When a buffer fills (or at a flush)
 * its copies are closed by an event; then the other buffer, closed earlier,
 * is awaited, sent with UCX puts and flushed, which frees it to fill — so one
 * buffer's device-to-host copy overlaps the other's sending. A get moves
 * through a staging buffer one chunk at a time (nothing in tandem gets from a
 * device pool over UCX so far).
 *
 * Target: the pool is device memory; peers put into a host landing copy of
 * it (UCX-allocated, so their puts stay one-sided; page-locked when CUDA can
 * register it), and once the initiator has flushed and said so (the decode
 * worker's Prefill completion) landed() copies those ranges into the device.
 * Peers' gets read the landing copy. It costs host memory the size of the
 * pool, and only targets (kv_xfer_config_t.target) keep one.
 *
 * Threads: as UCX's — one thread at a time per context, the target's progress
 * thread beside it; fence may be called from another thread. Every wait has a
 * deadline. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_cuda_copy.h"

#define STAGE_BYTES (2u << 20) /* the tail a flush still has to send: small, so that little of a push is exposed */
#define STAGE_ENTRIES 4096     /* puts gathered into one staging buffer at most */
#define BATCHED_MAX (1u << 20) /* puts up to this size are copied by the batched kernel */
#define STAGE_WAIT_S 10.0      /* a staging buffer's copy, send and flush */

typedef struct entry {
    kv_xfer_peer_t *peer;
    uint32_t region;
    uint32_t len;
    uint64_t off; /* in the staging buffer */
    uint64_t remote;
} entry_t;

typedef enum { SLOT_FILLING, SLOT_COPYING, SLOT_SENT } slot_state_t;

typedef struct slot {
    uint8_t *buf; /* page-locked, mapped: the copy kernel writes it directly */
    kv_xfer_mem_t *reg;
    cudaEvent_t copied;
    slot_state_t state;
    size_t used;
    entry_t e[STAGE_ENTRIES];
    uint32_t n;
} slot_t;

struct kv_xfer {
    int device;
    bool target;
    kv_xfer_t *ucx;
    cudaStream_t copy;
    cudaEvent_t done;
    kv_fences_t fences;
    bool fences_made;
    kv_copy_batch_t batch; /* copies into the filling buffer not yet launched */
    slot_t slot[2];
    int cur;
    /* where a sender's time goes, logged at destroy: buffers sent, seconds
     * waiting for their copies, issuing their puts, flushing them */
    uint64_t sent;
    double t_copy, t_put, t_flush;
};

struct kv_xfer_mem {
    void *dev;
    size_t bytes;
    kv_xfer_mem_t *landing; /* the host landing copy (targets), or NULL */
    uint8_t *landing_addr;
    bool landing_pinned;
};

struct kv_xfer_peer {
    kv_xfer_peer_t *ucx;
    bool failed;
    char err[256];
};

#define CK(call, what)                                                                                                 \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess)                                                                                         \
            return td_error(TD_ERR_INTERNAL, "ucx_staged: %s: %s", what, cudaGetErrorString(e_));                      \
    } while (0)

static td_status_t wait_event(cudaEvent_t ev, double deadline, const char *what)
{
    return kv_event_wait(ev, deadline, "ucx_staged", what);
}

static void st_destroy(kv_xfer_t *x)
{
    if (!x)
        return;
    if (x->sent)
        TD_INFO("ucx_staged: %llu staging buffers sent: %.1f ms waiting for their copies, %.1f ms issuing the puts, "
                "%.1f ms flushing", (unsigned long long)x->sent, x->t_copy * 1e3, x->t_put * 1e3, x->t_flush * 1e3);
    cudaSetDevice(x->device);
    if (x->copy)
        cudaStreamSynchronize(x->copy);
    for (int i = 0; i < 2; i++) {
        slot_t *s = &x->slot[i];
        if (s->reg)
            kv_transport_ucx.mem_free(x->ucx, s->reg);
        if (s->buf)
            cudaFreeHost(s->buf);
        if (s->copied)
            cudaEventDestroy(s->copied);
    }
    if (x->fences_made)
        kv_fences_destroy(&x->fences);
    if (x->done)
        cudaEventDestroy(x->done);
    if (x->copy)
        cudaStreamDestroy(x->copy);
    kv_transport_ucx.destroy(x->ucx);
    free(x);
}

static td_status_t st_create(const kv_xfer_config_t *cfg, kv_xfer_t **out)
{
    kv_xfer_t *x = calloc(1, sizeof *x);
    if (!x)
        return td_error(TD_ERR_NO_MEMORY, "ucx_staged: no memory");
    x->device = cfg ? cfg->device : 0;
    x->target = cfg && cfg->target;
    td_status_t rc = kv_transport_ucx.create(cfg, &x->ucx);
    if (rc) {
        free(x);
        return rc;
    }
    cudaError_t e = cudaSetDevice(x->device);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&x->copy, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&x->done, cudaEventDisableTiming);
    if (e == cudaSuccess && (e = kv_fences_init(&x->fences)) == cudaSuccess)
        x->fences_made = true;
    for (int i = 0; i < 2 && e == cudaSuccess; i++) {
        if ((e = cudaHostAlloc((void **)&x->slot[i].buf, STAGE_BYTES, cudaHostAllocMapped | cudaHostAllocPortable)) ==
            cudaSuccess)
            e = cudaEventCreateWithFlags(&x->slot[i].copied, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
        rc = td_error(TD_ERR_UNSUPPORTED, "ucx_staged: device %d: %s", x->device, cudaGetErrorString(e));
        st_destroy(x);
        return rc;
    }
    for (int i = 0; i < 2; i++)
        if ((rc = kv_ucx_mem_register(x->ucx, x->slot[i].buf, STAGE_BYTES, &x->slot[i].reg))) {
            st_destroy(x);
            return rc;
        }
    *out = x;
    return TD_OK;
}

/* ------------------------------------------------------------ target side */

static td_status_t st_mem_alloc(kv_xfer_t *x, size_t bytes, void **addr, kv_xfer_mem_t **out)
{
    kv_xfer_mem_t *m = calloc(1, sizeof *m);
    if (!m)
        return td_error(TD_ERR_NO_MEMORY, "ucx_staged: no memory");
    cudaSetDevice(x->device);
    cudaError_t e = cudaMalloc(&m->dev, bytes);
    if (e == cudaSuccess)
        e = cudaMemset(m->dev, 0, bytes);
    if (e != cudaSuccess) {
        cudaFree(m->dev);
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "ucx_staged: cannot allocate %zu MiB of memory on device %d: %s", bytes >> 20,
                        x->device, cudaGetErrorString(e));
    }
    m->bytes = bytes;
    if (x->target) {
        void *a;
        td_status_t rc = kv_transport_ucx.mem_alloc(x->ucx, bytes, &a, &m->landing);
        if (rc) {
            cudaFree(m->dev);
            free(m);
            return rc;
        }
        m->landing_addr = a;
        /* page-locked, its copies into the device run at the link's speed; else they are staged by the driver */
        m->landing_pinned = cudaHostRegister(a, bytes, cudaHostRegisterPortable) == cudaSuccess;
        if (!m->landing_pinned) {
            TD_DEBUG("ucx_staged: the landing copy could not be page-locked (%s); it is copied from pageable memory",
                     cudaGetErrorString(cudaGetLastError()));
        }
    }
    *addr = m->dev;
    *out = m;
    return TD_OK;
}

static void st_mem_free(kv_xfer_t *x, kv_xfer_mem_t *m)
{
    if (!m)
        return;
    cudaSetDevice(x->device);
    if (m->landing) {
        if (m->landing_pinned)
            cudaHostUnregister(m->landing_addr);
        kv_transport_ucx.mem_free(x->ucx, m->landing);
    }
    cudaFree(m->dev);
    free(m);
}

/* A memory no peer writes into (not a target's) has no key: *len is 0. */
static td_status_t st_mem_rkey(kv_xfer_t *x, kv_xfer_mem_t *m, void **rkey, size_t *len)
{
    if (!m->landing) {
        *rkey = NULL;
        *len = 0;
        return TD_OK;
    }
    return kv_transport_ucx.mem_rkey(x->ucx, m->landing, rkey, len);
}

static td_status_t st_address(kv_xfer_t *x, void **addr, size_t *len)
{
    return kv_transport_ucx.address(x->ucx, addr, len);
}

static td_status_t st_progress_start(kv_xfer_t *x)
{
    return kv_transport_ucx.progress_start(x->ucx);
}

static td_status_t st_landed(kv_xfer_t *x, kv_xfer_mem_t *m, const uint64_t *offsets, uint32_t n, size_t len)
{
    if (!m->landing)
        return td_error(TD_ERR_INVALID_ARG, "ucx_staged: this memory has no landing copy (not a target's)");
    cudaSetDevice(x->device);
    for (uint32_t i = 0; i < n; i++) {
        if (offsets[i] > m->bytes || len > m->bytes - offsets[i])
            return td_error(TD_ERR_OUT_OF_RANGE,
                            "ucx_staged: %zu landed bytes at offset %llu pass the memory's end "
                            "(%zu bytes)",
                            len, (unsigned long long)offsets[i], m->bytes);
        CK(cudaMemcpyAsync((uint8_t *)m->dev + offsets[i], m->landing_addr + offsets[i], len, cudaMemcpyHostToDevice,
                           x->copy),
           "copying landed bytes into the device");
    }
    CK(cudaEventRecord(x->done, x->copy), "cudaEventRecord");
    return wait_event(x->done, td_now_s() + STAGE_WAIT_S, "copying landed bytes into the device");
}

static uint64_t st_remote_base(kv_xfer_t *x, kv_xfer_mem_t *m)
{
    (void)x;
    return (uint64_t)(uintptr_t)m->landing_addr;
}

/* ------------------------------------------------------------ initiator side */

static td_status_t st_connect(kv_xfer_t *x, const void *addr, size_t addr_len, kv_xfer_peer_t **out)
{
    kv_xfer_peer_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_error(TD_ERR_NO_MEMORY, "ucx_staged: no memory");
    td_status_t rc = kv_transport_ucx.connect(x->ucx, addr, addr_len, &p->ucx);
    if (rc) {
        free(p);
        return rc;
    }
    *out = p;
    return TD_OK;
}

static td_status_t st_region_add(kv_xfer_t *x, kv_xfer_peer_t *p, const void *rkey, size_t rkey_len,
                                 uint64_t remote_base, uint64_t remote_len, uint32_t *region)
{
    return kv_transport_ucx.region_add(x->ucx, p->ucx, rkey, rkey_len, remote_base, remote_len, region);
}

static void peer_fail(kv_xfer_peer_t *p)
{
    if (!p->failed) {
        p->failed = true;
        snprintf(p->err, sizeof p->err, "%s", td_last_error());
    }
}

static td_status_t launch_batch(kv_xfer_t *x) { return kv_copy_batch_launch(&x->batch, x->copy, "ucx_staged"); }

/* The filling buffer's copies are closed by its event. */
static td_status_t close_slot(kv_xfer_t *x, slot_t *s)
{
    td_status_t rc = launch_batch(x);
    if (rc)
        return rc;
    CK(cudaEventRecord(s->copied, x->copy), "cudaEventRecord");
    s->state = SLOT_COPYING;
    return TD_OK;
}

/* A closed buffer, once its copies are done, goes out with one UCX put per
 * entry; a peer whose put fails is marked and its further entries skipped. */
static td_status_t send_slot(kv_xfer_t *x, slot_t *s, double deadline)
{
    double t0 = td_now_s();
    td_status_t rc = wait_event(s->copied, deadline, "a copy into host staging");
    double t1 = td_now_s();
    x->t_copy += t1 - t0;
    if (rc)
        return rc;
    for (uint32_t i = 0; i < s->n; i++) {
        entry_t *e = &s->e[i];
        if (!e->peer->failed &&
            kv_transport_ucx.put(x->ucx, e->peer->ucx, e->region, s->buf + e->off, e->len, e->remote))
            peer_fail(e->peer);
    }
    x->t_put += td_now_s() - t1;
    x->sent++;
    s->state = SLOT_SENT;
    return TD_OK;
}

/* A sent buffer's puts are flushed, peer by peer; then it is free to fill. */
static void reclaim_slot(kv_xfer_t *x, slot_t *s, double deadline)
{
    double t0 = td_now_s();
    for (uint32_t i = 0; i < s->n; i++) {
        kv_xfer_peer_t *p = s->e[i].peer;
        bool seen = false;
        for (uint32_t k = 0; k < i && !seen; k++)
            seen = s->e[k].peer == p;
        if (seen || p->failed)
            continue;
        double left = deadline - td_now_s();
        if (kv_transport_ucx.flush(x->ucx, p->ucx, left > 0.01 ? left : 0.01))
            peer_fail(p);
    }
    x->t_flush += td_now_s() - t0;
    s->state = SLOT_FILLING;
    s->used = 0;
    s->n = 0;
}

/* Everything gathered so far is sent and flushed (the older buffer first). */
static td_status_t drain(kv_xfer_t *x, double deadline)
{
    slot_t *cur = &x->slot[x->cur], *old = &x->slot[!x->cur];
    td_status_t rc = TD_OK;
    if (cur->state == SLOT_FILLING && cur->n)
        rc = close_slot(x, cur);
    if (!rc && old->state == SLOT_COPYING)
        rc = send_slot(x, old, deadline);
    if (!rc && cur->state == SLOT_COPYING)
        rc = send_slot(x, cur, deadline);
    if (old->state == SLOT_SENT)
        reclaim_slot(x, old, deadline);
    if (cur->state == SLOT_SENT)
        reclaim_slot(x, cur, deadline);
    return rc;
}

/* The filling buffer is full: it is closed, the other one sent and flushed
 * (while this one's copies run), and filling moves to it. */
static td_status_t rotate(kv_xfer_t *x)
{
    double deadline = td_now_s() + STAGE_WAIT_S;
    slot_t *cur = &x->slot[x->cur], *old = &x->slot[!x->cur];
    td_status_t rc = close_slot(x, cur);
    if (!rc && old->state == SLOT_COPYING)
        rc = send_slot(x, old, deadline);
    if (old->state == SLOT_SENT)
        reclaim_slot(x, old, deadline);
    if (rc)
        return rc;
    x->cur = !x->cur;
    return TD_OK;
}

static td_status_t st_put(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, const void *src, size_t len,
                          uint64_t offset)
{
    if (p->failed)
        return td_error(TD_ERR_UNAVAILABLE, "ucx_staged: the peer failed: %s", p->err);
    cudaSetDevice(x->device);
    const uint8_t *from = src;
    if (x->slot[x->cur].state != SLOT_FILLING && drain(x, td_now_s() + STAGE_WAIT_S))
        return td_error(TD_ERR_UNAVAILABLE, "ucx_staged: host staging is held by a transfer that failed: %s",
                        td_last_error());
    while (len) {
        slot_t *s = &x->slot[x->cur];
        if (s->used == STAGE_BYTES || s->n == STAGE_ENTRIES) {
            td_status_t rc = rotate(x);
            if (rc)
                return rc;
            continue;
        }
        size_t chunk = len < STAGE_BYTES - s->used ? len : STAGE_BYTES - s->used;
        s->e[s->n++] = (entry_t){p, region, (uint32_t)chunk, s->used, offset};
        if (chunk <= BATCHED_MAX) {
            x->batch.d[x->batch.n++] = (kv_copy_desc_t){from, s->buf + s->used, chunk};
            if (x->batch.n == KV_COPY_BATCH) {
                td_status_t rc = launch_batch(x);
                if (rc)
                    return rc;
            }
        } else {
            td_status_t rc = launch_batch(x); /* in order with the gathered ones */
            if (rc)
                return rc;
            CK(cudaMemcpyAsync(s->buf + s->used, from, chunk, cudaMemcpyDeviceToHost, x->copy), "put");
        }
        s->used += chunk;
        from += chunk;
        offset += chunk;
        len -= chunk;
    }
    return TD_OK;
}

static td_status_t st_flush(kv_xfer_t *x, kv_xfer_peer_t *p, double timeout_s)
{
    cudaSetDevice(x->device);
    td_status_t rc = drain(x, td_now_s() + timeout_s);
    if (rc)
        return rc;
    return p->failed ? td_error(TD_ERR_UNAVAILABLE, "ucx_staged: the peer failed: %s", p->err) : TD_OK;
}

static td_status_t st_get(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, void *dst, size_t len, uint64_t offset)
{
    if (p->failed)
        return td_error(TD_ERR_UNAVAILABLE, "ucx_staged: the peer failed: %s", p->err);
    cudaSetDevice(x->device);
    double deadline = td_now_s() + STAGE_WAIT_S;
    td_status_t rc = drain(x, deadline); /* the staging buffers are free after it */
    slot_t *s = &x->slot[x->cur];
    for (size_t done = 0; !rc && done < len;) {
        size_t chunk = len - done < STAGE_BYTES ? len - done : STAGE_BYTES;
        double left = deadline - td_now_s();
        if ((rc = kv_transport_ucx.get(x->ucx, p->ucx, region, s->buf, chunk, offset + done)) ||
            (rc = kv_transport_ucx.flush(x->ucx, p->ucx, left > 0.01 ? left : 0.01))) {
            peer_fail(p);
            break;
        }
        cudaError_t e = cudaMemcpyAsync((uint8_t *)dst + done, s->buf, chunk, cudaMemcpyHostToDevice, x->copy);
        if (e == cudaSuccess)
            e = cudaEventRecord(x->done, x->copy);
        if (e != cudaSuccess)
            return td_error(TD_ERR_INTERNAL, "ucx_staged: get: %s", cudaGetErrorString(e));
        rc = wait_event(x->done, deadline, "a copy from host staging");
        done += chunk;
    }
    return rc;
}

static void st_disconnect(kv_xfer_t *x, kv_xfer_peer_t *p)
{
    if (!p)
        return;
    cudaSetDevice(x->device);
    if (drain(x, td_now_s() + 2)) /* no entry may name p after this */
        TD_DEBUG("ucx_staged: closing a connection: %s", td_last_error());
    for (int i = 0; i < 2; i++) { /* a drain that failed before sending leaves entries: p's are dropped */
        slot_t *s = &x->slot[i];
        uint32_t k = 0;
        for (uint32_t j = 0; j < s->n; j++)
            if (s->e[j].peer != p)
                s->e[k++] = s->e[j];
        s->n = k;
    }
    kv_transport_ucx.disconnect(x->ucx, p->ucx);
    free(p);
}

static td_status_t st_fence(kv_xfer_t *x, void *stream, uint64_t *fence)
{
    return kv_fences_record(&x->fences, x->device, stream, fence);
}

static td_status_t st_wait_fence(kv_xfer_t *x, uint64_t fence)
{
    td_status_t rc = launch_batch(x); /* copies before the wait need only the earlier fences */
    return rc ? rc : kv_fences_wait(&x->fences, x->device, x->copy, fence);
}

const kv_transport_ops_t kv_transport_ucx_staged = {
    .name = "ucx_staged",
    .create = st_create,
    .destroy = st_destroy,
    .mem_alloc = st_mem_alloc,
    .mem_free = st_mem_free,
    .mem_rkey = st_mem_rkey,
    .address = st_address,
    .progress_start = st_progress_start,
    .connect = st_connect,
    .region_add = st_region_add,
    .put = st_put,
    .get = st_get,
    .flush = st_flush,
    .disconnect = st_disconnect,
    .fence = st_fence,
    .wait_fence = st_wait_fence,
    .landed = st_landed,
    .remote_base = st_remote_base,
};
