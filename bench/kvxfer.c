/* kvxfer.c — tandem-bench-kvxfer: KV transfer bandwidth between two processes
 * through the KV transport (kvstore/transfer.h, UCX), against a plain memcpy
 * of the same bytes in one process.
 *
 * The child is the decode side: it allocates a pool with the transport and
 * hands its address and remote key over a pipe. The parent is the prefill
 * side: it puts chunks of the size of one layer of one block (12 KiB for the
 * default model: 2 x 3 kv heads x 16 tokens x 64 x fp16), flushes, and times
 * it; then it checks the bytes landed (the child compares a checksum).
 * Usage: tandem-bench-kvxfer [MiB] [chunk_bytes]. Prints one JSON line. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
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

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 256, chunk = argc > 2 ? (size_t)atol(argv[2]) : 12288;
    size_t bytes = mib << 20;
    bytes -= bytes % chunk;
    const kv_transport_ops_t *xo = &kv_transport_ucx;
    int to_parent[2], to_child[2];
    if (pipe(to_parent) || pipe(to_child))
        return 1;
    pid_t pid = fork();
    if (pid == 0) { /* target */
        kv_xfer_t *x;
        kv_xfer_mem_t *m;
        void *base, *addr, *rkey;
        size_t al, rl;
        if (xo->create(NULL, &x) || xo->mem_alloc(x, bytes, &base, &m) || xo->mem_rkey(x, m, &rkey, &rl) ||
            xo->address(x, &addr, &al) || xo->progress_start(x))
            _exit(1);
        memset(base, 0, bytes);
        uint64_t b = (uint64_t)(uintptr_t)base;
        xwrite(to_parent[1], &al, sizeof al);
        xwrite(to_parent[1], addr, al);
        xwrite(to_parent[1], &rl, sizeof rl);
        xwrite(to_parent[1], rkey, rl);
        xwrite(to_parent[1], &b, sizeof b);
        uint64_t want;
        if (xread(to_child[0], &want, sizeof want))
            _exit(1);
        uint64_t got = sum64(base, bytes);
        xwrite(to_parent[1], &got, sizeof got);
        xo->mem_free(x, m);
        xo->destroy(x);
        _exit(got == want ? 0 : 2);
    }
    size_t al, rl;
    uint64_t rbase;
    xread(to_parent[0], &al, sizeof al);
    void *addr = malloc(al);
    xread(to_parent[0], addr, al);
    xread(to_parent[0], &rl, sizeof rl);
    void *rkey = malloc(rl);
    xread(to_parent[0], rkey, rl);
    xread(to_parent[0], &rbase, sizeof rbase);
    kv_xfer_t *x;
    kv_xfer_mem_t *m;
    void *src;
    kv_xfer_peer_t *peer;
    uint32_t region;
    if (xo->create(NULL, &x) || xo->mem_alloc(x, bytes, &src, &m) || xo->connect(x, addr, al, &peer) ||
        xo->region_add(x, peer, rkey, rl, rbase, bytes, &region))
        return 1;
    for (size_t i = 0; i < bytes; i++)
        ((uint8_t *)src)[i] = (uint8_t)(i * 2654435761u >> 13);
    /* warm-up (wire-up) */
    xo->put(x, peer, region, src, chunk, 0);
    xo->flush(x, peer, 10);
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = td_now_s();
        for (size_t off = 0; off < bytes; off += chunk)
            if (xo->put(x, peer, region, (uint8_t *)src + off, chunk, off))
                return 1;
        if (xo->flush(x, peer, 30))
            return 1;
        double t = td_now_s() - t0;
        best = t < best ? t : best;
    }
    uint64_t want = sum64(src, bytes), got;
    xwrite(to_child[1], &want, sizeof want);
    xread(to_parent[0], &got, sizeof got);
    int st;
    waitpid(pid, &st, 0);
    /* memcpy of the same bytes, the same chunks, in one process */
    uint8_t *dst = malloc(bytes);
    memset(dst, 0, bytes);
    double best_cpy = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = td_now_s();
        for (size_t off = 0; off < bytes; off += chunk)
            memcpy(dst + off, (uint8_t *)src + off, chunk);
        double t = td_now_s() - t0;
        best_cpy = t < best_cpy ? t : best_cpy;
    }
    printf("{\"bytes\": %zu, \"chunk\": %zu, \"ucx_put_gbs\": %.2f, \"memcpy_gbs\": %.2f, \"landed_ok\": %s}\n", bytes,
           chunk, bytes / best / 1e9, bytes / best_cpy / 1e9, got == want && WIFEXITED(st) && !WEXITSTATUS(st) ? "true" : "false");
    free(dst);
    xo->disconnect(x, peer);
    xo->mem_free(x, m);
    xo->destroy(x);
    return got == want ? 0 : 2;
}
