// comm_nccl.cu — kernels/comm.h's all-reduce over NCCL, for the ranks of one
// tensor-parallel worker on the GPUs of one host: one communicator a device
// (ncclCommInitAll: one process drives them all), each rank's sum queued on
// its backend's stream (so a captured decode step holds it too). NCCL is
// loaded at run time (libnccl.so.2, the machine's own: a binary without it
// still starts, and a worker asked for tp > 1 without it stops naming it).
// Making the communicators has a deadline (NCCL_INIT_S): ncclCommInitAll
// waits for every device, and a device that never answers would hold the
// worker's start forever.
#include <dlfcn.h>
#include <errno.h>
#include <nccl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "kernels/comm.h"
#include "kernels/cuda/comm_nccl.h"
#include "kernels/cuda/cuda_int.h"

typedef struct nccl_api {
    ncclResult_t (*init_all)(ncclComm_t *, int, const int *);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    ncclResult_t (*abort)(ncclComm_t);
    ncclResult_t (*destroy)(ncclComm_t);
    const char *(*error)(ncclResult_t);
} nccl_api_t;

static nccl_api_t g_nccl;
static const char *g_nccl_error;
static void load_nccl(void)
{
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        g_nccl_error = dlerror();
        return;
    }
    *(void **)&g_nccl.init_all = dlsym(h, "ncclCommInitAll");
    *(void **)&g_nccl.all_reduce = dlsym(h, "ncclAllReduce");
    *(void **)&g_nccl.send = dlsym(h, "ncclSend");
    *(void **)&g_nccl.recv = dlsym(h, "ncclRecv");
    *(void **)&g_nccl.group_start = dlsym(h, "ncclGroupStart");
    *(void **)&g_nccl.group_end = dlsym(h, "ncclGroupEnd");
    *(void **)&g_nccl.abort = dlsym(h, "ncclCommAbort");
    *(void **)&g_nccl.destroy = dlsym(h, "ncclCommDestroy");
    *(void **)&g_nccl.error = dlsym(h, "ncclGetErrorString");
    if (!g_nccl.init_all || !g_nccl.all_reduce || !g_nccl.send || !g_nccl.recv || !g_nccl.group_start ||
        !g_nccl.group_end || !g_nccl.abort || !g_nccl.destroy || !g_nccl.error)
        g_nccl_error = "libnccl.so.2 lacks ncclCommInitAll, ncclAllReduce, ncclSend, ncclRecv, ncclGroupStart, "
                       "ncclGroupEnd, ncclCommAbort, ncclCommDestroy or ncclGetErrorString (NCCL 2.7 has them)";
}

typedef struct comm_nccl {
    kern_comm_t base;
    ncclComm_t *comms;
    int *devices;
    int aborted; // a rank stopped: the communicators are gone, every later call fails
    uint32_t aborted_by;
    pthread_mutex_t mu;
} comm_nccl_t;

static td_status_t nccl_all_reduce(kern_comm_t *base, uint32_t rank, kern_backend_t *be, float *buf, size_t n)
{
    comm_nccl_t *c = (comm_nccl_t *)base;
    if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE))
        return td_error(TD_ERR_UNAVAILABLE, "tp: rank %u stopped; rank %u's all-reduce cannot complete",
                        c->aborted_by, rank);
    kc_bind(be);
    const ncclResult_t r = g_nccl.all_reduce(buf, buf, n, ncclFloat32, ncclSum, c->comms[rank],
                                             (cudaStream_t)be->ops->queue(be));
    if (r != ncclSuccess)
        return td_error(TD_ERR_INTERNAL, "tp: rank %u (cuda:%d): ncclAllReduce of %zu values: %s", rank,
                        c->devices[rank], n, g_nccl.error(r));
    return TD_OK;
}

// The ranks' logit columns to rank 0: each other rank sends its part whole, rank 0 receives them one after another
// into scratch (in a group: NCCL pairs them however the ranks' threads come) and puts each part, its own too, at its
// columns of whole with a strided copy on its stream.
static td_status_t nccl_gather_cols(kern_comm_t *base, uint32_t rank, kern_backend_t *be, const float *part,
                                    uint32_t rows, const uint32_t *cols, float *whole, float *scratch)
{
    comm_nccl_t *c = (comm_nccl_t *)base;
    if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE))
        return td_error(TD_ERR_UNAVAILABLE, "tp: rank %u stopped; rank %u's gather cannot complete", c->aborted_by,
                        rank);
    kc_bind(be);
    cudaStream_t st = (cudaStream_t)be->ops->queue(be);
    ncclResult_t r = ncclSuccess;
    if (rank) { /* (a rank of no columns sends nothing, and rank 0 expects nothing of it) */
        if (!cols[rank])
            return TD_OK;
        r = g_nccl.send(part, (size_t)rows * cols[rank], ncclFloat32, 0, c->comms[rank], st);
        if (r != ncclSuccess)
            return td_error(TD_ERR_INTERNAL, "tp: rank %u (cuda:%d): ncclSend of %u logit rows: %s", rank,
                            c->devices[rank], rows, g_nccl.error(r));
        return TD_OK;
    }
    size_t width = 0;
    for (uint32_t k = 0; k < base->ranks; k++)
        width += cols[k];
    r = g_nccl.group_start();
    for (uint32_t k = 1, off = cols[0]; k < base->ranks && r == ncclSuccess; off += cols[k], k++)
        if (cols[k])
            r = g_nccl.recv(scratch + (size_t)rows * off, (size_t)rows * cols[k], ncclFloat32, (int)k, c->comms[0], st);
    const ncclResult_t e = g_nccl.group_end();
    if (r == ncclSuccess)
        r = e;
    if (r != ncclSuccess)
        return td_error(TD_ERR_INTERNAL, "tp: rank 0 (cuda:%d): ncclRecv of %u logit rows: %s", c->devices[0], rows,
                        g_nccl.error(r));
    for (uint32_t k = 0, off = 0; k < base->ranks; off += cols[k], k++) {
        const float *src = k ? scratch + (size_t)rows * off : part;
        if (!cols[k])
            continue;
        const cudaError_t ce = cudaMemcpy2DAsync(whole + off, width * sizeof(float), src, cols[k] * sizeof(float),
                                                 cols[k] * sizeof(float), rows, cudaMemcpyDeviceToDevice, st);
        if (ce != cudaSuccess)
            return td_error(TD_ERR_INTERNAL, "tp: rank 0 (cuda:%d): placing rank %u's logit columns: %s",
                            c->devices[0], k, cudaGetErrorString(ce));
    }
    return TD_OK;
}

// NCCL's abort ends the other ranks' collectives in flight (their streams' work fails instead of waiting forever)
static void nccl_abort(kern_comm_t *base, uint32_t rank)
{
    comm_nccl_t *c = (comm_nccl_t *)base;
    pthread_mutex_lock(&c->mu);
    if (!c->aborted) {
        c->aborted_by = rank;
        __atomic_store_n(&c->aborted, 1, __ATOMIC_RELEASE);
        for (uint32_t r = 0; r < base->ranks; r++)
            g_nccl.abort(c->comms[r]);
    }
    pthread_mutex_unlock(&c->mu);
}

static void nccl_destroy(kern_comm_t *base)
{
    comm_nccl_t *c = (comm_nccl_t *)base;
    if (!c)
        return;
    for (uint32_t r = 0; !c->aborted && c->comms && r < base->ranks; r++)
        if (c->comms[r])
            g_nccl.destroy(c->comms[r]);
    pthread_mutex_destroy(&c->mu);
    free(c->comms);
    free(c->devices);
    free(c);
}

// ncclCommInitAll on a thread of its own, waited for until NCCL_INIT_S: past it the call is abandoned (it cannot
// be interrupted), and if it ever returns, its thread destroys what it made. The worker stops on the error.
#define NCCL_INIT_S 120.0

typedef struct nccl_init {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ncclComm_t *comms;
    int *devices;
    int ranks;
    ncclResult_t r;
    bool done, abandoned;
} nccl_init_t;

static void nccl_init_free(nccl_init_t *j)
{
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->comms);
    free(j->devices);
    free(j);
}

static void *nccl_init_main(void *arg)
{
    nccl_init_t *j = (nccl_init_t *)arg;
    const ncclResult_t r = g_nccl.init_all(j->comms, j->ranks, j->devices);
    pthread_mutex_lock(&j->mu);
    j->r = r;
    j->done = true;
    const bool abandoned = j->abandoned;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (abandoned) {
        for (int k = 0; r == ncclSuccess && k < j->ranks; k++)
            g_nccl.destroy(j->comms[k]);
        nccl_init_free(j);
    }
    return NULL;
}

// The communicators of `ranks` devices into comms (NCCL's result), within NCCL_INIT_S; TD_ERR_TIMEOUT past it.
static td_status_t nccl_init_all(ncclComm_t *comms, const int *devices, int ranks, ncclResult_t *res)
{
    nccl_init_t *j = (nccl_init_t *)calloc(1, sizeof *j);
    if (!j || !(j->comms = (ncclComm_t *)calloc((size_t)ranks, sizeof *j->comms)) ||
        !(j->devices = (int *)malloc((size_t)ranks * sizeof *j->devices))) {
        if (j)
            free(j->comms);
        free(j);
        return td_error(TD_ERR_NO_MEMORY, "tp: no memory");
    }
    memcpy(j->devices, devices, (size_t)ranks * sizeof *devices);
    j->ranks = ranks;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    pthread_t th;
    if (pthread_create(&th, NULL, nccl_init_main, j)) {
        nccl_init_free(j);
        return td_error(TD_ERR_NO_MEMORY, "tp: no thread to make NCCL's communicators");
    }
    pthread_detach(th);
    const struct timespec until = td_wall_deadline(NCCL_INIT_S);
    int e = 0;
    pthread_mutex_lock(&j->mu);
    while (!j->done && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&j->cv, &j->mu, &until);
    const bool done = j->done;
    j->abandoned = !done;
    pthread_mutex_unlock(&j->mu);
    if (!done)
        return td_error(TD_ERR_TIMEOUT, "tp: ncclCommInitAll over %d devices did not return within %.0f s", ranks,
                        NCCL_INIT_S);
    *res = j->r;
    memcpy(comms, j->comms, (size_t)ranks * sizeof *comms);
    nccl_init_free(j);
    return TD_OK;
}

static const kern_comm_ops_t nccl_ops = {.name = "nccl",
                                         .capturable = true,
                                         .gather_scratch = true,
                                         .all_reduce = nccl_all_reduce,
                                         .gather_cols = nccl_gather_cols,
                                         .abort = nccl_abort,
                                         .destroy = nccl_destroy};

extern "C" td_status_t kern_comm_nccl_create(uint32_t ranks, kern_backend_t *const *bes, kern_comm_t **out)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_nccl);
    if (g_nccl_error)
        return td_error(TD_ERR_UNSUPPORTED, "tp: cannot load NCCL: %s", g_nccl_error);
    comm_nccl_t *c = (comm_nccl_t *)calloc(1, sizeof *c);
    if (!c || !(c->comms = (ncclComm_t *)calloc(ranks, sizeof *c->comms)) ||
        !(c->devices = (int *)calloc(ranks, sizeof *c->devices))) {
        if (c)
            free(c->comms);
        free(c);
        return td_error(TD_ERR_NO_MEMORY, "tp: no memory");
    }
    c->base = (kern_comm_t){.ops = &nccl_ops, .ranks = ranks};
    pthread_mutex_init(&c->mu, NULL);
    for (uint32_t r = 0; r < ranks; r++) {
        c->devices[r] = ((const kern_cuda_t *)bes[r])->device;
        for (uint32_t q = 0; q < r; q++)
            if (c->devices[q] == c->devices[r]) {
                nccl_destroy(&c->base);
                return td_error(TD_ERR_INVALID_ARG, "tp: ranks %u and %u are both on cuda:%d (NCCL takes one rank "
                                "a device)", q, r, c->devices[r]);
            }
    }
    ncclResult_t r = ncclSuccess;
    td_status_t rc = nccl_init_all(c->comms, c->devices, (int)ranks, &r);
    if (rc || r != ncclSuccess) {
        free(c->comms);
        c->comms = NULL;
        nccl_destroy(&c->base);
        return rc ? rc
                  : td_error(TD_ERR_UNAVAILABLE, "tp: ncclCommInitAll over %u devices: %s", ranks, g_nccl.error(r));
    }
    *out = &c->base;
    return TD_OK;
}
