/* kvxfer.c — tandem-bench-kvxfer: KV transfer bandwidth between two processes
 * through a KV transport (kvstore/transfer.h), against a plain copy of the
 * same bytes in one process: memcpy for UCX over host memory, a
 * device-to-device cudaMemcpy for CUDA IPC over GPU memory.
 *
 * The child is the decode side: it allocates a pool with the transport and
 * hands its address and remote key over a pipe. The parent is the prefill
 * side: it puts chunks of the size of one layer of one block (12 KiB for the
 * default model: 2 x 3 kv heads x 16 tokens x 64 x fp16), flushes, and times
 * it; then it checks the bytes landed (the child compares a checksum). With
 * CUDA IPC it also checks the ordering a prefill worker relies on: the source
 * is rewritten by work queued on another stream, the put waits for a fence
 * recorded after it, and the new bytes are what lands. The first of the 5
 * passes is reported apart (first_pass_gbs: it pays whatever first touches
 * of the region cost), and connect_ms times making the source, connecting
 * and adding the region. With UCX staged through
 * host memory (ucx_staged: GPU memory on both sides) the target copies what
 * landed into its device before each check, and the plain copy is a
 * device-to-host copy into page-locked memory (the link each byte crosses twice).
 * The two sides may be on different GPUs (SRC_GPU for the prefill side, DST_GPU
 * for the decode side; 0 and 0 by default): CUDA IPC then copies peer to peer
 * (NVLink where there is one), and the plain copy is cudaMemcpyPeerAsync of
 * the same chunks between the same two devices, with peer access enabled.
 * bulk_copy_gbs is the same plain copy made of all the bytes at once: the
 * link's ceiling, which no launch count holds back (0 for host transports).
 * Usage: tandem-bench-kvxfer [MiB] [chunk_bytes] [ucx|cuda_ipc|ucx_staged] [SRC_GPU DST_GPU].
 * Prints one JSON line. */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/clock.h"
#include "common/log.h"
#include "kvstore/transfer.h"

static int xwrite(int fd, const void *p, size_t n) { return write(fd, p, n) == (ssize_t)n ? 0 : -1; }
static int xread(int fd, void *p, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

static uint64_t sum64(const uint8_t *p, size_t n)
{
    uint64_t s = 0;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s += v * (i + 1);
    }
    return s;
}

/* The region's bytes on the host (a device region is copied out first). */
static uint8_t *host_view(int dev, const void *p, size_t n, uint8_t **tmp)
{
    *tmp = NULL;
    (void)n; /* a build without CUDA has host regions only */
    if (!dev)
        return (uint8_t *)p;
#ifdef TANDEM_HAVE_CUDA
    if ((*tmp = malloc(n)) && cudaMemcpy(*tmp, p, n, cudaMemcpyDeviceToHost) == cudaSuccess)
        return *tmp;
#endif
    fprintf(stderr, "tandem-bench-kvxfer: cannot read the device region\n");
    exit(1);
}

static void fill(int dev, void *p, size_t n)
{
    uint8_t *h = malloc(n);
    for (size_t i = 0; i < n; i++)
        h[i] = (uint8_t)(i * 2654435761u >> 13);
    if (!dev)
        memcpy(p, h, n);
#ifdef TANDEM_HAVE_CUDA
    else if (cudaMemcpy(p, h, n, cudaMemcpyHostToDevice) != cudaSuccess)
        exit(1);
#endif
    free(h);
}

/* The target process: a region of bytes peers put into; answers each
 * checksum asked for on in, the region's own on out, until in closes. */
static _Noreturn void target(const kv_transport_ops_t *xo, size_t bytes, int dst_gpu, int dev, int out, int in)
{
    kv_xfer_t *x;
    kv_xfer_mem_t *m;
    void *base, *addr, *rkey;
    size_t al, rl;
    kv_xfer_config_t tc = {.target = true, .device = dst_gpu};
    if (xo->create(&tc, &x) || xo->mem_alloc(x, bytes, &base, &m) || xo->mem_rkey(x, m, &rkey, &rl) ||
        xo->address(x, &addr, &al) || xo->progress_start(x)) {
        fprintf(stderr, "tandem-bench-kvxfer: target: %s\n", td_last_error());
        _exit(1);
    }
    if (!dev)
        memset(base, 0, bytes);
    uint64_t b = xo->remote_base ? xo->remote_base(x, m) : (uint64_t)(uintptr_t)base;
    xwrite(out, &al, sizeof al);
    xwrite(out, addr, al);
    xwrite(out, &rl, sizeof rl);
    xwrite(out, rkey, rl);
    xwrite(out, &b, sizeof b);
    uint64_t want;
    int bad = 0;
    while (!xread(in, &want, sizeof want)) {
        uint64_t zero = 0;
        if (xo->landed && xo->landed(x, m, &zero, 1, bytes)) {
            fprintf(stderr, "tandem-bench-kvxfer: target: %s\n", td_last_error());
            _exit(1);
        }
        uint8_t *tmp, *h = host_view(dev, base, bytes, &tmp);
        uint64_t got = sum64(h, bytes);
        free(tmp);
        bad |= got != want;
        xwrite(out, &got, sizeof got);
    }
    xo->mem_free(x, m);
    xo->destroy(x);
    _exit(bad ? 2 : 0);
}

#ifdef TANDEM_HAVE_CUDA
/* A device transport's baselines: the plain copy of the same bytes in the
 * same chunks (to host memory when the transport stages, else to the peer
 * GPU), the same bytes as one copy (the link's ceiling), then whether a put
 * after a fence sees the bytes the stream wrote before it (*ordered).
 * 0, or 1 when a CUDA call or the put failed. */
static int device_copies(const kv_transport_ops_t *xo, kv_xfer_t *x, kv_xfer_peer_t *peer, uint32_t region,
                         void *src, size_t bytes, size_t chunk, int src_gpu, int dst_gpu, int to_child,
                         int to_parent, double *best_cpy, double *best_bulk, int *ordered)
{
    uint8_t *dst = NULL;
    uint64_t want, got;
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *best_bulk = 1e9;
    bool host = xo->landed != NULL; /* staged: the bytes cross to host memory */
    if (!host && dst_gpu != src_gpu) { /* the peer's memory, as the decode side's GPU holds it */
        cudaSetDevice(dst_gpu);
        cudaError_t pe = cudaDeviceEnablePeerAccess(src_gpu, 0);
        cudaSetDevice(src_gpu);
        if (pe == cudaSuccess || pe == cudaErrorPeerAccessAlreadyEnabled)
            pe = cudaDeviceEnablePeerAccess(dst_gpu, 0);
        if (pe != cudaSuccess && pe != cudaErrorPeerAccessAlreadyEnabled)
            fprintf(stderr, "tandem-bench-kvxfer: peer access %d -> %d: %s (the plain copy is staged by the "
                    "driver)\n", src_gpu, dst_gpu, cudaGetErrorString(pe));
        cudaGetLastError();
        cudaSetDevice(dst_gpu);
    }
    if ((host ? cudaHostAlloc((void **)&dst, bytes, 0) : cudaMalloc((void **)&dst, bytes)) != cudaSuccess)
        return 1;
    cudaSetDevice(src_gpu);
    for (int rep = 0; rep < 5; rep++) {
        double t0 = td_now_s();
        for (size_t off = 0; off < bytes; off += chunk)
            if (!host && dst_gpu != src_gpu)
                cudaMemcpyPeerAsync(dst + off, dst_gpu, (uint8_t *)src + off, src_gpu, chunk, s);
            else
                cudaMemcpyAsync(dst + off, (uint8_t *)src + off, chunk,
                                host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice, s);
        cudaStreamSynchronize(s);
        double t = td_now_s() - t0;
        *best_cpy = t < *best_cpy ? t : *best_cpy;
    }
    for (int rep = 0; rep < 5; rep++) { /* the link's ceiling: the same bytes as one copy */
        double t0 = td_now_s();
        if (!host && dst_gpu != src_gpu)
            cudaMemcpyPeerAsync(dst, dst_gpu, src, src_gpu, bytes, s);
        else
            cudaMemcpyAsync(dst, src, bytes, host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice, s);
        cudaStreamSynchronize(s);
        double t = td_now_s() - t0;
        *best_bulk = t < *best_bulk ? t : *best_bulk;
    }
    host ? cudaFreeHost(dst) : cudaFree(dst);
    /* ordering: the source rewritten on stream s (queued behind a long
     * wait), a fence after it, the put after the fence */
    uint64_t f;
    for (int i = 0; i < 8; i++) /* work ahead of the rewrite, so that an unordered put would see old bytes */
        cudaMemsetAsync(src, 0x11 + i, bytes, s);
    cudaMemsetAsync(src, 0x5a, bytes, s);
    if (xo->fence(x, s, &f) || xo->wait_fence(x, f) || xo->put(x, peer, region, src, bytes, 0) ||
        xo->flush(x, peer, 30))
        return 1;
    uint8_t *expect = malloc(bytes);
    memset(expect, 0x5a, bytes);
    want = sum64(expect, bytes);
    free(expect);
    xwrite(to_child, &want, sizeof want);
    *ordered = !xread(to_parent, &got, sizeof got) && got == want;
    cudaStreamDestroy(s);
    return 0;
}
#endif

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 256, chunk = argc > 2 ? (size_t)atol(argv[2]) : 12288;
    const char *tname = argc > 3 ? argv[3] : "ucx";
    int src_gpu = argc > 5 ? atoi(argv[4]) : 0, dst_gpu = argc > 5 ? atoi(argv[5]) : 0;
    size_t bytes = mib << 20;
    bytes -= bytes % chunk;
    const kv_transport_ops_t *xo = kv_transport_find(tname);
    if (!xo) {
        fprintf(stderr, "tandem-bench-kvxfer: no transport '%s' in this build\n", tname);
        return 2;
    }
    int dev = xo->fence != NULL; /* a device transport: its regions are GPU memory */
    int to_parent[2], to_child[2];
    if (pipe(to_parent) || pipe(to_child))
        return 1;
    pid_t pid = fork(); /* before either side touches CUDA */
    if (pid == 0) { /* target: answers each checksum asked for, until the pipe closes */
        close(to_parent[0]);
        close(to_child[1]);
        target(xo, bytes, dst_gpu, dev, to_parent[1], to_child[0]);
    }
    close(to_parent[1]); /* the child's end: its exit ends our reads */
    close(to_child[0]);
    size_t al, rl;
    uint64_t rbase;
    void *addr = NULL, *rkey = NULL;
    if (xread(to_parent[0], &al, sizeof al) || al > 4096 || !(addr = malloc(al)) || xread(to_parent[0], addr, al) ||
        xread(to_parent[0], &rl, sizeof rl) || rl > 4096 || !(rkey = malloc(rl)) || xread(to_parent[0], rkey, rl) ||
        xread(to_parent[0], &rbase, sizeof rbase)) {
        fprintf(stderr, "tandem-bench-kvxfer: the target did not start\n");
        waitpid(pid, NULL, 0);
        return 1;
    }
    kv_xfer_t *x;
    kv_xfer_mem_t *m;
    void *src;
    kv_xfer_peer_t *peer;
    uint32_t region;
    double c0 = td_now_s();
    kv_xfer_config_t ic = {.device = src_gpu};
    if (xo->create(&ic, &x) || xo->mem_alloc(x, bytes, &src, &m) || xo->connect(x, addr, al, &peer) ||
        xo->region_add(x, peer, rkey, rl, rbase, bytes, &region)) {
        fprintf(stderr, "tandem-bench-kvxfer: %s\n", td_last_error());
        return 1;
    }
    double connect_s = td_now_s() - c0; /* with mem_alloc: the source */
    fill(dev, src, bytes);
    /* warm-up (wire-up) */
    xo->put(x, peer, region, src, chunk, 0);
    xo->flush(x, peer, 10);
    double best = 1e9, first = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = td_now_s();
        for (size_t off = 0; off < bytes; off += chunk)
            if (xo->put(x, peer, region, (uint8_t *)src + off, chunk, off))
                return 1;
        if (xo->flush(x, peer, 30))
            return 1;
        double t = td_now_s() - t0;
        best = t < best ? t : best;
        first = rep ? first : t;
    }
    uint8_t *tmp, *h = host_view(dev, src, bytes, &tmp);
    uint64_t want = sum64(h, bytes), got;
    free(tmp);
    xwrite(to_child[1], &want, sizeof want);
    int landed = !xread(to_parent[0], &got, sizeof got) && got == want, ordered = -1;
    /* the plain copy of the same bytes, the same chunks, in one process */
    double best_cpy = 1e9, best_bulk = 0; /* bulk: device transports only */
    uint8_t *dst = NULL;
    if (!dev) {
        dst = calloc(1, bytes);
        for (int rep = 0; rep < 5; rep++) {
            double t0 = td_now_s();
            for (size_t off = 0; off < bytes; off += chunk)
                memcpy(dst + off, (uint8_t *)src + off, chunk);
            double t = td_now_s() - t0;
            best_cpy = t < best_cpy ? t : best_cpy;
        }
        free(dst);
    }
#ifdef TANDEM_HAVE_CUDA
    else if (device_copies(xo, x, peer, region, src, bytes, chunk, src_gpu, dst_gpu, to_child[1], to_parent[0],
                           &best_cpy, &best_bulk, &ordered))
        return 1;
#endif
    close(to_child[1]);
    int st;
    waitpid(pid, &st, 0);
    printf("{\"transport\": \"%s\", \"gpus\": [%d, %d], \"bytes\": %zu, \"chunk\": %zu, \"put_gbs\": %.2f, "
           "\"first_pass_gbs\": %.2f, \"connect_ms\": %.1f, \"%s_gbs\": %.2f, "
           "\"bulk_copy_gbs\": %.2f, \"landed_ok\": %s, \"ordered_after_fence\": %s}\n",
           xo->name, src_gpu, dst_gpu, bytes, chunk, bytes / best / 1e9, bytes / first / 1e9, connect_s * 1e3,
           !dev ? "memcpy" : xo->landed ? "d2h_copy" : src_gpu != dst_gpu ? "peer_copy" : "d2d_copy",
           bytes / best_cpy / 1e9, best_bulk > 0 ? bytes / best_bulk / 1e9 : 0.0, landed ? "true" : "false",
           ordered < 0 ? "null" : ordered ? "true" : "false");
    xo->disconnect(x, peer);
    xo->mem_free(x, m);
    xo->destroy(x);
    return landed && ordered != 0 && WIFEXITED(st) && !WEXITSTATUS(st) ? 0 : 2;
}
