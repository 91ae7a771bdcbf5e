/* transfer_cuda.c — the CUDA IPC KV transport (kvstore/transfer.h): device
 * memory of one process written and read by another process on the same host,
 * its own GPU or a peer GPU of that host (DESIGN.md §2).
 *
 * The target allocates its region with cudaMalloc and describes it by a CUDA
 * IPC handle and the UUID of the device that holds it (the "remote key"; a
 * worker of tensor-parallel ranks has a region on each rank's GPU); its
 * address names the host (the kernel's boot id: CUDA IPC joins processes of
 * one boot of one machine) and its first device (UUIDs: CUDA_VISIBLE_DEVICES
 * cannot renumber them). The initiator opens
 * the handle once per region and copies on its own copy stream, so copies
 * overlap the computation that queues them: puts up to 1 MiB are gathered and
 * copied KV_COPY_BATCH at a time by one kernel (transfer_cuda_copy.cu; a
 * cudaMemcpyAsync each is launch-bound at these sizes), larger ones go by
 * cudaMemcpyAsync; a flush records an event after the copies and polls it
 * against its deadline.
 *
 * Ordering: the source of a put is pool memory that the initiator's backend
 * writes with queued kernels. fence() records, on the thread that queues them,
 * the point the backend's stream has reached; wait_fence() makes every later
 * put start after it (transfer_cuda_copy.h's ring).
 *
 * Threads: the target side and each connection are used by one thread at a
 * time; fence may be called from another thread than the puts. Every call
 * makes its context's device current on the calling thread. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_cuda_copy.h"

#define BATCHED_MAX (1u << 20) /* puts up to this many bytes go through the batched copy */
#define ADDR_MAGIC 0x31494354u /* "TCI1" */
#define RKEY_MAGIC 0x324b4354u /* "TCK2": with the device's UUID */

typedef struct ci_addr {
    uint32_t magic;
    int32_t pid;
    char boot_id[40];
    unsigned char uuid[16];
} ci_addr_t;

typedef struct ci_rkey {
    uint32_t magic;
    uint32_t pad;
    uint64_t bytes;
    unsigned char uuid[16]; /* the device whose memory it is */
    cudaIpcMemHandle_t handle;
} ci_rkey_t;

struct kv_xfer {
    int device;
    unsigned char uuid[16];
    char boot_id[40];
    cudaStream_t copy;
    cudaEvent_t done; /* a flush's point on the copy stream */
    kv_fences_t fences;
    kv_copy_batch_t batch; /* puts not yet launched (the putting thread's) */
};

struct kv_xfer_mem {
    void *ptr;
    size_t bytes;
    int device;
};

typedef struct ci_region {
    uint8_t *ptr; /* the peer's region, opened here */
    uint64_t len;
} ci_region_t;

struct kv_xfer_peer {
    int device; /* the peer's (first) device, as numbered here */
    int pid;
    ci_region_t regions[KV_XFER_MAX_REGIONS];
    uint32_t n_regions;
};

#define CK(call, what)                                                                                         \
    do {                                                                                                       \
        cudaError_t e_ = (call);                                                                               \
        if (e_ != cudaSuccess)                                                                                 \
            return td_error(TD_ERR_INTERNAL, "cuda_ipc: %s: %s", what, cudaGetErrorString(e_));                \
    } while (0)

static void read_boot_id(char *out, size_t n)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    out[0] = 0;
    if (f) {
        if (fgets(out, (int)n, f))
            out[strcspn(out, "\n")] = 0;
        fclose(f);
    }
}

cudaError_t kv_fences_init(kv_fences_t *f)
{
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < KV_FENCE_RING && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&f->ring[i], cudaEventDisableTiming);
    if (e != cudaSuccess)
        kv_fences_destroy(f);
    return e;
}

void kv_fences_destroy(kv_fences_t *f)
{
    for (int i = 0; i < KV_FENCE_RING && f->ring[i]; i++)
        cudaEventDestroy(f->ring[i]);
    memset(f->ring, 0, sizeof f->ring);
    pthread_mutex_destroy(&f->mu);
}

td_status_t kv_fences_record(kv_fences_t *f, int device, void *stream, uint64_t *fence)
{
    pthread_mutex_lock(&f->mu);
    uint64_t n = ++f->next;
    cudaSetDevice(device);
    cudaError_t e = cudaEventRecord(f->ring[n % KV_FENCE_RING], (cudaStream_t)stream);
    pthread_mutex_unlock(&f->mu);
    if (e != cudaSuccess)
        return td_error(TD_ERR_INTERNAL, "recording a KV fence: %s", cudaGetErrorString(e));
    *fence = n;
    return TD_OK;
}

td_status_t kv_fences_wait(kv_fences_t *f, int device, cudaStream_t copy, uint64_t fence)
{
    pthread_mutex_lock(&f->mu);
    cudaSetDevice(device);
    cudaError_t e = cudaStreamWaitEvent(copy, f->ring[fence % KV_FENCE_RING], 0);
    pthread_mutex_unlock(&f->mu);
    if (e != cudaSuccess)
        return td_error(TD_ERR_INTERNAL, "waiting for a KV fence: %s", cudaGetErrorString(e));
    return TD_OK;
}

static td_status_t ci_create(const kv_xfer_config_t *cfg, kv_xfer_t **out)
{
    kv_xfer_t *x = calloc(1, sizeof *x);
    if (!x)
        return td_error(TD_ERR_NO_MEMORY, "cuda_ipc: no memory");
    x->device = cfg ? cfg->device : 0;
    read_boot_id(x->boot_id, sizeof x->boot_id);
    struct cudaDeviceProp prop;
    bool fences = false;
    cudaError_t e = cudaSetDevice(x->device);
    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&prop, x->device);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&x->copy, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&x->done, cudaEventDisableTiming);
    if (e == cudaSuccess && (e = kv_fences_init(&x->fences)) == cudaSuccess)
        fences = true;
    if (e != cudaSuccess) {
        td_status_t rc = td_error(TD_ERR_UNSUPPORTED, "cuda_ipc: device %d: %s", x->device, cudaGetErrorString(e));
        if (fences)
            kv_fences_destroy(&x->fences);
        if (x->done)
            cudaEventDestroy(x->done);
        if (x->copy)
            cudaStreamDestroy(x->copy);
        free(x);
        return rc;
    }
    memcpy(x->uuid, prop.uuid.bytes, 16);
    *out = x;
    return TD_OK;
}

static void ci_destroy(kv_xfer_t *x)
{
    if (!x)
        return;
    cudaSetDevice(x->device);
    cudaStreamSynchronize(x->copy);
    kv_fences_destroy(&x->fences);
    cudaEventDestroy(x->done);
    cudaStreamDestroy(x->copy);
    free(x);
}

static td_status_t ci_mem_alloc_on(kv_xfer_t *x, int device, size_t bytes, void **addr, kv_xfer_mem_t **out)
{
    kv_xfer_mem_t *m = calloc(1, sizeof *m);
    if (!m)
        return td_error(TD_ERR_NO_MEMORY, "cuda_ipc: no memory");
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaMalloc(&m->ptr, bytes);
    if (e == cudaSuccess)
        e = cudaMemset(m->ptr, 0, bytes);
    cudaSetDevice(x->device);
    if (e != cudaSuccess) {
        if (m->ptr)
            cudaFree(m->ptr);
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "cuda_ipc: cannot allocate %zu MiB of memory on device %d: %s", bytes >> 20,
                        device, cudaGetErrorString(e));
    }
    m->bytes = bytes;
    m->device = device;
    *addr = m->ptr;
    *out = m;
    return TD_OK;
}

static td_status_t ci_mem_alloc(kv_xfer_t *x, size_t bytes, void **addr, kv_xfer_mem_t **out)
{
    return ci_mem_alloc_on(x, x->device, bytes, addr, out);
}

static void ci_mem_free(kv_xfer_t *x, kv_xfer_mem_t *m)
{
    if (!m)
        return;
    cudaSetDevice(m->device);
    cudaFree(m->ptr);
    cudaSetDevice(x->device);
    free(m);
}

static td_status_t ci_mem_rkey(kv_xfer_t *x, kv_xfer_mem_t *m, void **rkey, size_t *len)
{
    ci_rkey_t *k = calloc(1, sizeof *k);
    if (!k)
        return td_error(TD_ERR_NO_MEMORY, "cuda_ipc: no memory");
    struct cudaDeviceProp prop;
    cudaError_t e = cudaSetDevice(m->device);
    if (e == cudaSuccess)
        e = cudaIpcGetMemHandle(&k->handle, m->ptr);
    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&prop, m->device);
    cudaSetDevice(x->device);
    if (e != cudaSuccess) {
        free(k);
        return td_error(TD_ERR_INTERNAL, "cuda_ipc: the remote key of memory on device %d: %s", m->device,
                        cudaGetErrorString(e));
    }
    memcpy(k->uuid, prop.uuid.bytes, 16);
    k->magic = RKEY_MAGIC;
    k->bytes = m->bytes;
    *rkey = k;
    *len = sizeof *k;
    return TD_OK;
}

static td_status_t ci_address(kv_xfer_t *x, void **addr, size_t *len)
{
    ci_addr_t *a = calloc(1, sizeof *a);
    if (!a)
        return td_error(TD_ERR_NO_MEMORY, "cuda_ipc: no memory");
    a->magic = ADDR_MAGIC;
    a->pid = (int32_t)getpid();
    memcpy(a->boot_id, x->boot_id, sizeof a->boot_id);
    memcpy(a->uuid, x->uuid, 16);
    *addr = a;
    *len = sizeof *a;
    return TD_OK;
}

static td_status_t ci_progress_start(kv_xfer_t *x)
{
    (void)x; /* copies need nothing of the target's threads */
    return TD_OK;
}

/* Whether device dev's memory can be reached from this context's device (itself, or a peer). */
static td_status_t reachable(kv_xfer_t *x, int dev, const char *whose)
{
    if (dev == x->device)
        return TD_OK;
    int can = 0;
    CK(cudaDeviceCanAccessPeer(&can, x->device, dev), "cudaDeviceCanAccessPeer");
    if (!can)
        return td_error(TD_ERR_UNSUPPORTED, "cuda_ipc: device %d cannot access %s device %d (no peer access between "
                        "them)", x->device, whose, dev);
    return TD_OK;
}

/* The device here whose UUID is uuid (a peer's, pid's), reachable from this context's. */
static td_status_t reachable_uuid(kv_xfer_t *x, const unsigned char *uuid, int pid, int *dev)
{
    int n = 0;
    *dev = -1;
    cudaSetDevice(x->device);
    CK(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    for (int i = 0; i < n && *dev < 0; i++) {
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, i) == cudaSuccess && !memcmp(prop.uuid.bytes, uuid, 16))
            *dev = i;
    }
    if (*dev < 0)
        return td_error(TD_ERR_UNSUPPORTED, "cuda_ipc: a GPU of the peer (pid %d) is not visible to this process "
                        "(device %d here; check CUDA_VISIBLE_DEVICES)", pid, x->device);
    return reachable(x, *dev, "the peer's");
}

static td_status_t ci_connect(kv_xfer_t *x, const void *addr, size_t addr_len, kv_xfer_peer_t **out)
{
    ci_addr_t a;
    if (addr_len != sizeof a)
        return td_error(TD_ERR_INVALID_ARG, "cuda_ipc: a peer address of %zu bytes is not one (it has %zu)", addr_len,
                        sizeof a);
    memcpy(&a, addr, sizeof a);
    a.boot_id[sizeof a.boot_id - 1] = 0;
    if (a.magic != ADDR_MAGIC)
        return td_error(TD_ERR_INVALID_ARG, "cuda_ipc: the peer address is not a CUDA IPC address");
    if (strcmp(a.boot_id, x->boot_id))
        return td_error(TD_ERR_UNSUPPORTED, "cuda_ipc: the peer (pid %d) runs on another host (boot id %s, here %s): "
                        "CUDA IPC joins processes of one host", (int)a.pid, a.boot_id, x->boot_id);
    int dev;
    td_status_t rc = reachable_uuid(x, a.uuid, (int)a.pid, &dev);
    if (rc)
        return rc;
    kv_xfer_peer_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_error(TD_ERR_NO_MEMORY, "cuda_ipc: no memory");
    p->device = dev;
    p->pid = (int)a.pid;
    *out = p;
    return TD_OK;
}

static td_status_t ci_region_add(kv_xfer_t *x, kv_xfer_peer_t *p, const void *rkey, size_t rkey_len,
                                 uint64_t remote_base, uint64_t remote_len, uint32_t *region)
{
    (void)remote_base; /* offsets count from the region's start */
    ci_rkey_t k;
    if (rkey_len != sizeof k)
        return td_error(TD_ERR_INVALID_ARG, "cuda_ipc: a remote key of %zu bytes is not one (it has %zu)", rkey_len,
                        sizeof k);
    memcpy(&k, rkey, sizeof k);
    if (k.magic != RKEY_MAGIC)
        return td_error(TD_ERR_INVALID_ARG, "cuda_ipc: the remote key is not a CUDA IPC handle");
    if (remote_len > k.bytes)
        return td_error(TD_ERR_INVALID_ARG, "cuda_ipc: a region of %llu bytes stated over an allocation of %llu",
                        (unsigned long long)remote_len, (unsigned long long)k.bytes);
    if (p->n_regions == KV_XFER_MAX_REGIONS)
        return td_error(TD_ERR_EXHAUSTED, "cuda_ipc: a peer has at most %d regions", KV_XFER_MAX_REGIONS);
    int dev;
    td_status_t rc = reachable_uuid(x, k.uuid, p->pid, &dev); /* a rank's region may be on another GPU */
    if (rc)
        return rc;
    void *ptr;
    CK(cudaIpcOpenMemHandle(&ptr, k.handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    p->regions[p->n_regions] = (ci_region_t){ptr, remote_len};
    *region = p->n_regions++;
    return TD_OK;
}

static td_status_t bounds(kv_xfer_peer_t *p, uint32_t region, size_t len, uint64_t offset)
{
    if (region >= p->n_regions)
        return td_error(TD_ERR_INVALID_ARG, "cuda_ipc: region %u was not added", region);
    uint64_t rl = p->regions[region].len;
    if (offset > rl || len > rl - offset)
        return td_error(TD_ERR_OUT_OF_RANGE, "cuda_ipc: %zu bytes at offset %llu pass the region's end (%llu bytes)",
                        len, (unsigned long long)offset, (unsigned long long)rl);
    return TD_OK;
}

td_status_t kv_copy_batch_launch(kv_copy_batch_t *b, cudaStream_t copy, const char *who)
{
    if (!b->n)
        return TD_OK;
    int rc = kv_cuda_copy_batch(b, copy);
    b->n = 0;
    return rc ? td_error(TD_ERR_INTERNAL, "%s: the batched copy did not launch: %s", who,
                         cudaGetErrorString(cudaGetLastError()))
              : TD_OK;
}

td_status_t kv_event_wait(cudaEvent_t ev, double deadline, const char *who, const char *what)
{
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess)
            return TD_OK;
        if (e != cudaErrorNotReady)
            return td_error(TD_ERR_UNAVAILABLE, "%s: %s failed: %s", who, what, cudaGetErrorString(e));
        if (td_now_s() > deadline)
            return td_error(TD_ERR_TIMEOUT, "%s: %s did not complete in time", who, what);
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* Launches the gathered puts; every operation that orders the copy stream
 * (a fence wait, a get, a flush) comes after it. */
static td_status_t launch_batch(kv_xfer_t *x) { return kv_copy_batch_launch(&x->batch, x->copy, "cuda_ipc"); }

static td_status_t ci_put(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, const void *src, size_t len,
                          uint64_t offset)
{
    td_status_t rc = bounds(p, region, len, offset);
    if (rc)
        return rc;
    cudaSetDevice(x->device);
    if (len <= BATCHED_MAX) {
        x->batch.d[x->batch.n++] = (kv_copy_desc_t){src, p->regions[region].ptr + offset, len};
        return x->batch.n == KV_COPY_BATCH ? launch_batch(x) : TD_OK;
    }
    CK(cudaMemcpyAsync(p->regions[region].ptr + offset, src, len, cudaMemcpyDefault, x->copy), "put");
    return TD_OK;
}

static td_status_t ci_get(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, void *dst, size_t len, uint64_t offset)
{
    td_status_t rc = bounds(p, region, len, offset);
    if (rc)
        return rc;
    cudaSetDevice(x->device);
    if ((rc = launch_batch(x)))
        return rc;
    CK(cudaMemcpyAsync(dst, p->regions[region].ptr + offset, len, cudaMemcpyDefault, x->copy), "get");
    return TD_OK;
}

static td_status_t ci_flush(kv_xfer_t *x, kv_xfer_peer_t *p, double timeout_s)
{
    (void)p; /* one copy stream: every peer's copies are flushed together */
    cudaSetDevice(x->device);
    td_status_t rc = launch_batch(x);
    if (rc)
        return rc;
    CK(cudaEventRecord(x->done, x->copy), "cudaEventRecord");
    return kv_event_wait(x->done, td_now_s() + timeout_s, "cuda_ipc", "the copies");
}

static void ci_disconnect(kv_xfer_t *x, kv_xfer_peer_t *p)
{
    if (!p)
        return;
    cudaSetDevice(x->device);
    launch_batch(x); /* the batch may hold other peers' puts; this one's land or not, unflushed */
    cudaStreamSynchronize(x->copy); /* no copy may still use the mappings */
    for (uint32_t i = 0; i < p->n_regions; i++)
        cudaIpcCloseMemHandle(p->regions[i].ptr);
    free(p);
}

/* Peer access from this context's device to dev's memory, for puts from a rank's part there. */
static td_status_t ci_reach(kv_xfer_t *x, int device)
{
    td_status_t rc = reachable(x, device, "this process's");
    if (rc || device == x->device)
        return rc;
    cudaSetDevice(x->device);
    cudaError_t e = cudaDeviceEnablePeerAccess(device, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError(); /* taken already: not an error, and not one a later call should see */
    else if (e != cudaSuccess)
        return td_error(TD_ERR_UNSUPPORTED, "cuda_ipc: peer access from device %d to device %d: %s", x->device,
                        device, cudaGetErrorString(e));
    return TD_OK;
}

static td_status_t ci_fence(kv_xfer_t *x, void *stream, uint64_t *fence)
{
    return kv_fences_record(&x->fences, x->device, stream, fence);
}

static td_status_t ci_wait_fence(kv_xfer_t *x, uint64_t fence)
{
    td_status_t rc = launch_batch(x); /* puts before the wait need only the earlier fences */
    return rc ? rc : kv_fences_wait(&x->fences, x->device, x->copy, fence);
}

const kv_transport_ops_t kv_transport_cuda_ipc = {
    .name = "cuda_ipc",
    .create = ci_create,
    .destroy = ci_destroy,
    .mem_alloc = ci_mem_alloc,
    .mem_free = ci_mem_free,
    .mem_rkey = ci_mem_rkey,
    .address = ci_address,
    .progress_start = ci_progress_start,
    .connect = ci_connect,
    .region_add = ci_region_add,
    .put = ci_put,
    .get = ci_get,
    .flush = ci_flush,
    .disconnect = ci_disconnect,
    .fence = ci_fence,
    .wait_fence = ci_wait_fence,
    .mem_alloc_on = ci_mem_alloc_on,
    .reach = ci_reach,
};
