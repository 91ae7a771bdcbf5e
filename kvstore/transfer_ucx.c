/* transfer_ucx.c — the UCX KV transport (transfer.h).
 *
 * One UCP context and worker per process side. The target allocates its pool
 * with ucp_mem_map(ALLOCATE) and publishes the packed remote key and the
 * worker address; the initiator makes an endpoint from that address (with
 * peer error handling, so a dead target fails the endpoint instead of hanging
 * it), unpacks the key, and puts. Requests UCX hands back are kept per peer
 * and reaped by progress; a flush waits for them and then for the endpoint's
 * flush, which is what guarantees remote completion. */
#define _GNU_SOURCE
#include "common/clock.h"
#include "kvstore/transfer.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include "common/log.h"

#define MAX_PENDING 4096

struct kv_xfer {
    kv_xfer_config_t cfg;
    ucp_context_h ctx;
    ucp_worker_h worker;
    pthread_t progress;
    bool progress_running;
    atomic_bool stop; /* set by destroy, read by the progress thread */
};

struct kv_xfer_mem {
    ucp_mem_h memh;
    void *addr;
    size_t len;
};

/* A region UCX reaches through shared memory is mapped into this process
 * too (local: that mapping). Left to itself, the first put or get touching
 * each of its 4 KiB pages here faults (~1-3 us a page: it held staged GPU
 * pushes to a third of the bench's speed, bench/results/gpu-2026-11-25c);
 * so each MAP_CHUNK of it has its page tables filled in one call
 * (MADV_POPULATE_WRITE) the first time a transfer touches it (mapped: one
 * bit a chunk). Filling the whole region at once would put seconds on the
 * first request to a large pool. */
#define MAP_CHUNK (2u << 20)

typedef struct region {
    ucp_rkey_h rkey;
    uint64_t base, len;
    uint8_t *local;
    uint8_t *mapped; /* NULL: not shared memory (or nothing to fill) */
} region_t;

static void region_map(region_t *r, uint64_t offset, size_t len)
{
    if (!r->mapped || !len)
        return;
    for (uint64_t c = offset / MAP_CHUNK, end = (offset + len - 1) / MAP_CHUNK; c <= end; c++) {
        if (r->mapped[c / 8] & (1u << (c % 8)))
            continue;
        r->mapped[c / 8] |= (uint8_t)(1u << (c % 8));
        uintptr_t a = (uintptr_t)r->local + c * MAP_CHUNK, lo = a & ~(uintptr_t)4095;
        uint64_t n = c * MAP_CHUNK + MAP_CHUNK < r->len ? MAP_CHUNK : r->len - c * MAP_CHUNK;
        if (madvise((void *)lo, n + (a - lo), MADV_POPULATE_WRITE) && errno == EINVAL) {
            free(r->mapped); /* a kernel before 5.14: the pages fault as before */
            r->mapped = NULL;
            return;
        }
    }
}

struct kv_xfer_peer {
    ucp_ep_h ep;
    region_t regions[KV_XFER_MAX_REGIONS];
    uint32_t n_regions;
    void *pending[MAX_PENDING];
    size_t n_pending;
    ucs_status_t failed; /* set by the error handler */
};

static td_status_t ucx_create(const kv_xfer_config_t *cfg_in, kv_xfer_t **out)
{
    kv_xfer_t *x = calloc(1, sizeof *x);
    if (!x)
        return td_error(TD_ERR_NO_MEMORY, "ucx: no memory");
    if (cfg_in)
        x->cfg = *cfg_in;
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        free(x);
        return td_error(TD_ERR_CONFIG, "ucx: cannot read its configuration: %s", ucs_status_string(st));
    }
    if (x->cfg.interfaces && x->cfg.interfaces[0] &&
        (st = ucp_config_modify(cfg, "NET_DEVICES", x->cfg.interfaces)) != UCS_OK) {
        ucp_config_release(cfg);
        td_status_t rc = td_error(TD_ERR_CONFIG, "ucx: transport.interfaces '%s' refused: %s", x->cfg.interfaces,
                                  ucs_status_string(st));
        free(x);
        return rc;
    }
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
    st = ucp_init(&p, cfg, &x->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        free(x);
        return td_error(TD_ERR_UNAVAILABLE, "ucx: ucp_init failed: %s", ucs_status_string(st));
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_MULTI};
    st = ucp_worker_create(x->ctx, &wp, &x->worker);
    if (st != UCS_OK) {
        ucp_cleanup(x->ctx);
        free(x);
        return td_error(TD_ERR_UNAVAILABLE, "ucx: cannot create a worker: %s", ucs_status_string(st));
    }
    *out = x;
    return TD_OK;
}

static void ucx_destroy(kv_xfer_t *x)
{
    if (!x)
        return;
    if (x->progress_running) {
        atomic_store(&x->stop, true);
        ucp_worker_signal(x->worker);
        pthread_join(x->progress, NULL);
    }
    ucp_worker_destroy(x->worker);
    ucp_cleanup(x->ctx);
    free(x);
}

static td_status_t ucx_mem_alloc(kv_xfer_t *x, size_t bytes, void **addr, kv_xfer_mem_t **out)
{
    kv_xfer_mem_t *m = calloc(1, sizeof *m);
    if (!m)
        return td_error(TD_ERR_NO_MEMORY, "ucx: no memory");
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                               .address = NULL, .length = bytes, .flags = UCP_MEM_MAP_ALLOCATE};
    ucs_status_t st = ucp_mem_map(x->ctx, &mp, &m->memh);
    if (st != UCS_OK) {
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "ucx: cannot allocate %zu bytes of registered memory: %s", bytes,
                        ucs_status_string(st));
    }
    ucp_mem_attr_t a = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
    ucp_mem_query(m->memh, &a);
    m->addr = a.address;
    m->len = a.length;
    /* Resident now: a pool or tier the machine cannot back (a full
     * /dev/shm under UCX's shared-memory segment) fails here, naming its
     * size, instead of with SIGBUS at the first put into it; and the first
     * transfers do not pay its page faults (they cost the store 10x). */
    if (madvise(m->addr, m->len, MADV_POPULATE_WRITE) && errno != EINVAL) {
        int e = errno;
        ucp_mem_unmap(x->ctx, m->memh);
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "ucx: cannot make %zu bytes of registered memory resident: %s", bytes,
                        strerror(e));
    }
    *addr = m->addr;
    *out = m;
    return TD_OK;
}

td_status_t kv_ucx_mem_register(kv_xfer_t *x, void *addr, size_t len, kv_xfer_mem_t **out)
{
    kv_xfer_mem_t *m = calloc(1, sizeof *m);
    if (!m)
        return td_error(TD_ERR_NO_MEMORY, "ucx: no memory");
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH, .address = addr, .length = len};
    ucs_status_t st = ucp_mem_map(x->ctx, &mp, &m->memh);
    if (st != UCS_OK) {
        free(m);
        return td_error(TD_ERR_INTERNAL, "ucx: cannot register %zu bytes: %s", len, ucs_status_string(st));
    }
    m->addr = addr;
    m->len = len;
    *out = m;
    return TD_OK;
}

static void ucx_mem_free(kv_xfer_t *x, kv_xfer_mem_t *m)
{
    if (!m)
        return;
    ucp_mem_unmap(x->ctx, m->memh);
    free(m);
}

static td_status_t ucx_mem_rkey(kv_xfer_t *x, kv_xfer_mem_t *m, void **rkey, size_t *len)
{
    void *buf;
    size_t n;
    ucs_status_t st = ucp_rkey_pack(x->ctx, m->memh, &buf, &n);
    if (st != UCS_OK)
        return td_error(TD_ERR_INTERNAL, "ucx: cannot pack a remote key: %s", ucs_status_string(st));
    *rkey = malloc(n);
    if (*rkey)
        memcpy(*rkey, buf, n);
    ucp_rkey_buffer_release(buf);
    *len = n;
    return *rkey ? TD_OK : td_error(TD_ERR_NO_MEMORY, "ucx: no memory");
}

static td_status_t ucx_address(kv_xfer_t *x, void **addr, size_t *len)
{
    ucp_address_t *a;
    size_t n;
    ucs_status_t st = ucp_worker_get_address(x->worker, &a, &n);
    if (st != UCS_OK)
        return td_error(TD_ERR_INTERNAL, "ucx: no worker address: %s", ucs_status_string(st));
    *addr = malloc(n);
    if (*addr)
        memcpy(*addr, a, n);
    ucp_worker_release_address(x->worker, a);
    *len = n;
    return *addr ? TD_OK : td_error(TD_ERR_NO_MEMORY, "ucx: no memory");
}

static void *progress_thread(void *arg)
{
    kv_xfer_t *x = arg;
    int fd = -1;
    ucp_worker_get_efd(x->worker, &fd);
    while (!atomic_load(&x->stop)) {
        if (ucp_worker_progress(x->worker))
            continue;
        if (fd >= 0 && ucp_worker_arm(x->worker) == UCS_OK) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            poll(&p, 1, 100);
        }
    }
    return NULL;
}

static td_status_t ucx_progress_start(kv_xfer_t *x)
{
    if (x->progress_running)
        return TD_OK;
    if (pthread_create(&x->progress, NULL, progress_thread, x))
        return td_error(TD_ERR_INTERNAL, "ucx: cannot start the progress thread");
    x->progress_running = true;
    return TD_OK;
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    kv_xfer_peer_t *p = arg;
    p->failed = status;
}

static td_status_t ucx_connect(kv_xfer_t *x, const void *addr, size_t addr_len, kv_xfer_peer_t **out)
{
    (void)addr_len;
    kv_xfer_peer_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_error(TD_ERR_NO_MEMORY, "ucx: no memory");
    /* Peer error handling (a dead target fails the endpoint) rules out UCX's
     * shared-memory transports in 1.13: RMA then runs as active messages over
     * TCP loopback at 1.2 GB/s instead of 20.8 GB/s (bench/results). So it is
     * off unless the config asks for it (kv_xfer_config_t.peer_errors). */
    bool peer_errors = x->cfg.peer_errors;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
                          .err_handler = {.cb = on_ep_error, .arg = p}};
    ucs_status_t st = ucp_ep_create(x->worker, &ep, &p->ep);
    if (st != UCS_OK) {
        free(p);
        return td_error(TD_ERR_UNAVAILABLE, "ucx: cannot reach the peer: %s", ucs_status_string(st));
    }
    *out = p;
    return TD_OK;
}

static td_status_t ucx_region_add(kv_xfer_t *x, kv_xfer_peer_t *p, const void *rkey, size_t rkey_len,
                                  uint64_t remote_base, uint64_t remote_len, uint32_t *region)
{
    (void)x;
    if (p->n_regions == KV_XFER_MAX_REGIONS)
        return td_error(TD_ERR_EXHAUSTED, "ucx: a peer has at most %d regions", KV_XFER_MAX_REGIONS);
    if (!rkey || !rkey_len || !remote_len || remote_base + remote_len < remote_base)
        return td_error(TD_ERR_FORMAT, "ucx: a region needs a remote key and a length that fits (base %llu, "
                        "length %llu)", (unsigned long long)remote_base, (unsigned long long)remote_len);
    region_t *r = &p->regions[p->n_regions];
    ucs_status_t st = ucp_ep_rkey_unpack(p->ep, rkey, &r->rkey);
    if (st != UCS_OK)
        return td_error(TD_ERR_FORMAT, "ucx: the peer's remote key does not unpack: %s", ucs_status_string(st));
    r->base = remote_base;
    r->len = remote_len;
    *region = p->n_regions++;
    void *local;
    if (ucp_rkey_ptr(r->rkey, remote_base, &local) == UCS_OK &&
        (r->mapped = calloc((remote_len + MAP_CHUNK - 1) / MAP_CHUNK / 8 + 1, 1)))
        r->local = local;
    return TD_OK;
}

/* The remote address of [offset, offset + len) of a region, or an error. */
static td_status_t locate(const kv_xfer_peer_t *p, uint32_t region, size_t len, uint64_t offset, const char *what,
                          uint64_t *remote)
{
    if (p->failed != UCS_OK)
        return td_error(TD_ERR_UNAVAILABLE, "ucx: the peer failed: %s", ucs_status_string(p->failed));
    if (region >= p->n_regions)
        return td_error(TD_ERR_OUT_OF_RANGE, "ucx: %s to region %u, the peer has %u", what, region, p->n_regions);
    const region_t *r = &p->regions[region];
    if (offset > r->len || len > r->len - offset)
        return td_error(TD_ERR_OUT_OF_RANGE, "ucx: %s of %zu bytes at offset %llu is past the region's %llu bytes",
                        what, len, (unsigned long long)offset, (unsigned long long)r->len);
    *remote = r->base + offset;
    return TD_OK;
}

/* Frees the requests that are done; returns the first error seen. */
static ucs_status_t reap(kv_xfer_peer_t *p)
{
    ucs_status_t err = UCS_OK;
    size_t k = 0;
    for (size_t i = 0; i < p->n_pending; i++) {
        ucs_status_t st = ucp_request_check_status(p->pending[i]);
        if (st == UCS_INPROGRESS) {
            p->pending[k++] = p->pending[i];
            continue;
        }
        if (st != UCS_OK && err == UCS_OK)
            err = st;
        ucp_request_free(p->pending[i]);
    }
    p->n_pending = k;
    return err;
}

static td_status_t wait_pending(kv_xfer_t *x, kv_xfer_peer_t *p, size_t below, double deadline)
{
    for (;;) {
        ucs_status_t st = reap(p);
        if (st != UCS_OK && p->failed == UCS_OK)
            p->failed = st;
        if (p->failed != UCS_OK)
            return td_error(TD_ERR_UNAVAILABLE, "ucx: an operation on the peer failed: %s", ucs_status_string(p->failed));
        if (p->n_pending <= below)
            return TD_OK;
        if (td_now_s() > deadline)
            return td_error(TD_ERR_TIMEOUT, "ucx: %zu operations on the peer did not complete in time", p->n_pending);
        ucp_worker_progress(x->worker);
    }
}

/* Issues one put or get; its request, if UCX returns one, joins pending. */
static td_status_t rma(kv_xfer_t *x, kv_xfer_peer_t *p, bool put, uint32_t region, void *local, size_t len,
                       uint64_t offset)
{
    uint64_t remote = 0;
    td_status_t rc = locate(p, region, len, offset, put ? "a put" : "a get", &remote);
    if (rc)
        return rc;
    if (p->n_pending == MAX_PENDING && (rc = wait_pending(x, p, MAX_PENDING / 2, td_now_s() + 10)))
        return rc;
    region_map(&p->regions[region], offset, len);
    ucp_request_param_t rp = {.op_attr_mask = 0};
    ucs_status_ptr_t r = put ? ucp_put_nbx(p->ep, local, len, remote, p->regions[region].rkey, &rp)
                             : ucp_get_nbx(p->ep, local, len, remote, p->regions[region].rkey, &rp);
    if (r == NULL)
        return TD_OK;
    if (UCS_PTR_IS_ERR(r)) {
        p->failed = UCS_PTR_STATUS(r);
        return td_error(TD_ERR_UNAVAILABLE, "ucx: %s of %zu bytes failed: %s", put ? "put" : "get", len,
                        ucs_status_string(p->failed));
    }
    p->pending[p->n_pending++] = r;
    ucp_worker_progress(x->worker);
    return TD_OK;
}

static td_status_t ucx_put(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, const void *src, size_t len,
                           uint64_t offset)
{
    return rma(x, p, true, region, (void *)src, len, offset);
}

static td_status_t ucx_get(kv_xfer_t *x, kv_xfer_peer_t *p, uint32_t region, void *dst, size_t len, uint64_t offset)
{
    return rma(x, p, false, region, dst, len, offset);
}

static td_status_t ucx_flush(kv_xfer_t *x, kv_xfer_peer_t *p, double timeout_s)
{
    double deadline = td_now_s() + timeout_s;
    td_status_t rc = wait_pending(x, p, 0, deadline);
    if (rc)
        return rc;
    ucp_request_param_t rp = {.op_attr_mask = 0};
    ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &rp);
    if (r == NULL)
        return TD_OK;
    if (UCS_PTR_IS_ERR(r)) {
        p->failed = UCS_PTR_STATUS(r);
        return td_error(TD_ERR_UNAVAILABLE, "ucx: flush failed: %s", ucs_status_string(p->failed));
    }
    p->pending[p->n_pending++] = r;
    return wait_pending(x, p, 0, deadline);
}

static void ucx_disconnect(kv_xfer_t *x, kv_xfer_peer_t *p)
{
    if (!p)
        return;
    wait_pending(x, p, 0, td_now_s() + (p->failed == UCS_OK ? 2 : 0));
    for (size_t i = 0; i < p->n_pending; i++) { /* abandoned: cancel and free */
        ucp_request_cancel(x->worker, p->pending[i]);
        ucp_request_free(p->pending[i]);
    }
    for (uint32_t i = 0; i < p->n_regions; i++) {
        ucp_rkey_destroy(p->regions[i].rkey);
        free(p->regions[i].mapped);
    }
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &rp);
    if (r && !UCS_PTR_IS_ERR(r)) {
        double deadline = td_now_s() + 2;
        while (ucp_request_check_status(r) == UCS_INPROGRESS && td_now_s() < deadline)
            ucp_worker_progress(x->worker);
        ucp_request_free(r);
    }
    free(p);
}

const kv_transport_ops_t kv_transport_ucx = {
    .name = "ucx",
    .create = ucx_create,
    .destroy = ucx_destroy,
    .mem_alloc = ucx_mem_alloc,
    .mem_free = ucx_mem_free,
    .mem_rkey = ucx_mem_rkey,
    .address = ucx_address,
    .progress_start = ucx_progress_start,
    .connect = ucx_connect,
    .region_add = ucx_region_add,
    .put = ucx_put,
    .get = ucx_get,
    .flush = ucx_flush,
    .disconnect = ucx_disconnect,
};

const kv_transport_ops_t *kv_transport_find(const char *name)
{
    if (!name || !name[0] || !strcmp(name, kv_transport_ucx.name))
        return &kv_transport_ucx;
#ifdef TANDEM_HAVE_CUDA
    if (!strcmp(name, kv_transport_cuda_ipc.name))
        return &kv_transport_cuda_ipc;
    if (!strcmp(name, kv_transport_ucx_staged.name))
        return &kv_transport_ucx_staged;
#endif
    return NULL;
}
