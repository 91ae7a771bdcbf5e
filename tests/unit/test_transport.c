/* test_transport.c — the UCX KV transport (kvstore/transfer.h) between two
 * real processes: a forked target that maps two regions and serves them, and
 * this process as the initiator. One-sided puts and gets, several regions per
 * peer, refusal of an access past a region, back-pressure past the pending
 * limit, and the deadlines: a frozen target makes a flush time out at its
 * deadline, a killed one makes it fail — never a hang. */
#define _GNU_SOURCE
#include "tests/unit/helpers.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvstore/transfer.h"

#define REGION_BYTES (1u << 20)

typedef struct target {
    pid_t pid;
    int cmd; /* write end: closing it ends the target */
    void *addr;
    size_t addr_len;
    void *rkey[2];
    size_t rkey_len[2];
    uint64_t base[2];
} target_t;

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

/* Forks the target: two regions of REGION_BYTES, region r filled with r + 1. */
static void target_start(target_t *t)
{
    int up[2], down[2];
    cr_assert_eq(pipe(up), 0);
    cr_assert_eq(pipe(down), 0);
    pid_t parent = getpid();
    t->pid = fork();
    cr_assert_geq(t->pid, 0);
    if (t->pid == 0) {
        /* dies with the test, even frozen (SIGSTOP) by a test whose assertion ended it: a frozen target
         * left behind would hold the runner's output open for ever */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        close(up[0]);
        close(down[1]);
        const kv_transport_ops_t *xo = &kv_transport_ucx;
        kv_xfer_t *x;
        kv_xfer_mem_t *m[2];
        void *base[2], *addr, *rkey;
        size_t al, rl;
        if (xo->create(NULL, &x) || xo->address(x, &addr, &al))
            _exit(1);
        (void)!write(up[1], &al, sizeof al);
        (void)!write(up[1], addr, al);
        for (int r = 0; r < 2; r++) {
            if (xo->mem_alloc(x, REGION_BYTES, &base[r], &m[r]) || xo->mem_rkey(x, m[r], &rkey, &rl))
                _exit(1);
            memset(base[r], r + 1, REGION_BYTES);
            uint64_t b = (uint64_t)(uintptr_t)base[r];
            (void)!write(up[1], &rl, sizeof rl);
            (void)!write(up[1], rkey, rl);
            (void)!write(up[1], &b, sizeof b);
        }
        if (xo->progress_start(x))
            _exit(1);
        char c;
        while (read(down[0], &c, 1) > 0)
            ;
        _exit(0);
    }
    close(up[1]);
    close(down[0]);
    t->cmd = down[1];
    cr_assert_eq(xread(up[0], &t->addr_len, sizeof t->addr_len), 0, "the target did not start");
    t->addr = malloc(t->addr_len);
    cr_assert_eq(xread(up[0], t->addr, t->addr_len), 0);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(xread(up[0], &t->rkey_len[r], sizeof t->rkey_len[r]), 0);
        t->rkey[r] = malloc(t->rkey_len[r]);
        cr_assert_eq(xread(up[0], t->rkey[r], t->rkey_len[r]), 0);
        cr_assert_eq(xread(up[0], &t->base[r], sizeof t->base[r]), 0);
    }
    close(up[0]);
}

static void target_stop(target_t *t)
{
    close(t->cmd);
    kill(t->pid, SIGCONT);
    int st;
    waitpid(t->pid, &st, 0);
    free(t->addr);
    free(t->rkey[0]);
    free(t->rkey[1]);
}

/* Connects x to the target's two regions. */
static kv_xfer_peer_t *attach(const kv_transport_ops_t *xo, kv_xfer_t *x, target_t *t, uint32_t region[2])
{
    kv_xfer_peer_t *p;
    cr_assert_eq(xo->connect(x, t->addr, t->addr_len, &p), TD_OK, "%s", td_last_error());
    for (int r = 0; r < 2; r++)
        cr_assert_eq(xo->region_add(x, p, t->rkey[r], t->rkey_len[r], t->base[r], REGION_BYTES, &region[r]), TD_OK,
                     "%s", td_last_error());
    return p;
}

Test(transport, put_get_regions_and_bounds, .timeout = 60)
{
    target_t t;
    target_start(&t);
    const kv_transport_ops_t *xo = kv_transport_find("ucx");
    cr_assert_eq(xo, &kv_transport_ucx);
    cr_assert_null(kv_transport_find("cuda-ipc"), "a transport this build lacks is not found");
    kv_xfer_t *x;
    cr_assert_eq(xo->create(NULL, &x), TD_OK);
    uint32_t region[2];
    kv_xfer_peer_t *p = attach(xo, x, &t, region);
    cr_assert_neq(region[0], region[1]);
    /* the target's bytes, read one-sidedly */
    uint8_t *got = malloc(REGION_BYTES), *src = malloc(REGION_BYTES);
    cr_assert_eq(xo->get(x, p, region[1], got, 4096, 1000), TD_OK);
    cr_assert_eq(xo->flush(x, p, 10), TD_OK, "%s", td_last_error());
    for (int i = 0; i < 4096; i++)
        cr_assert_eq(got[i], 2, "region 1 byte %d", i);
    /* a put into region 1 lands there and nowhere else */
    for (size_t i = 0; i < REGION_BYTES; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 11);
    cr_assert_eq(xo->put(x, p, region[1], src, 65536, 4096), TD_OK);
    cr_assert_eq(xo->flush(x, p, 10), TD_OK);
    memset(got, 0, REGION_BYTES);
    cr_assert_eq(xo->get(x, p, region[1], got, 65536 + 8192, 0), TD_OK);
    cr_assert_eq(xo->get(x, p, region[0], got + 131072, 65536, 4096), TD_OK);
    cr_assert_eq(xo->flush(x, p, 10), TD_OK);
    for (int i = 0; i < 4096; i++)
        cr_assert_eq(got[i], 2, "before the put, byte %d", i);
    cr_assert_eq(memcmp(got + 4096, src, 65536), 0, "the put landed");
    for (int i = 4096 + 65536; i < 65536 + 8192; i++)
        cr_assert_eq(got[i], 2, "after the put, byte %d", i);
    for (int i = 0; i < 65536; i++)
        cr_assert_eq(got[131072 + i], 1, "region 0 untouched, byte %d", i);
    /* past the end of a region, or a region the peer does not have: refused, nothing moves */
    cr_assert_eq(xo->put(x, p, region[0], src, 4096, REGION_BYTES - 4095), TD_ERR_OUT_OF_RANGE);
    cr_assert(strstr(td_last_error(), "past the region's 1048576 bytes"), "%s", td_last_error());
    cr_assert_eq(xo->put(x, p, region[0], src, 16, UINT64_MAX - 8), TD_ERR_OUT_OF_RANGE);
    cr_assert_eq(xo->get(x, p, 7, got, 16, 0), TD_ERR_OUT_OF_RANGE);
    cr_assert_eq(xo->flush(x, p, 10), TD_OK, "a refused access does not fail the peer");
    xo->disconnect(x, p);
    xo->destroy(x);
    free(got);
    free(src);
    target_stop(&t);
}

/* Far more puts than the transport keeps pending (4096): each put past the
 * limit waits for half to complete; every byte lands. */
Test(transport, back_pressure, .timeout = 60)
{
    target_t t;
    target_start(&t);
    const kv_transport_ops_t *xo = &kv_transport_ucx;
    kv_xfer_t *x;
    cr_assert_eq(xo->create(NULL, &x), TD_OK);
    uint32_t region[2];
    kv_xfer_peer_t *p = attach(xo, x, &t, region);
    enum { N = 16384, LEN = 64 };
    uint8_t *src = malloc((size_t)N * LEN), *got = malloc((size_t)N * LEN);
    for (size_t i = 0; i < (size_t)N * LEN; i++)
        src[i] = (uint8_t)(i * 7 + 3);
    for (int i = 0; i < N; i++)
        cr_assert_eq(xo->put(x, p, region[0], src + (size_t)i * LEN, LEN, (uint64_t)i * LEN), TD_OK, "put %d: %s", i,
                     td_last_error());
    cr_assert_eq(xo->flush(x, p, 30), TD_OK, "%s", td_last_error());
    cr_assert_eq(xo->get(x, p, region[0], got, (size_t)N * LEN, 0), TD_OK);
    cr_assert_eq(xo->flush(x, p, 30), TD_OK);
    cr_assert_eq(memcmp(got, src, (size_t)N * LEN), 0);
    xo->disconnect(x, p);
    xo->destroy(x);
    free(src);
    free(got);
    target_stop(&t);
}

/* With peer error handling (transport.peer_errors), a frozen target makes a
 * flush end at its deadline (TD_ERR_TIMEOUT), and a killed one makes the
 * put or the flush fail within it: the caller always gets an answer. */
Test(transport, frozen_and_dead_peers_meet_the_deadline, .timeout = 90)
{
    target_t t;
    target_start(&t);
    /* over TCP, as between hosts: on one host UCX may pick a one-sided transport (CMA) whose puts land in a
     * stopped process without it, and which one it picks is not fixed */
    setenv("UCX_TLS", "tcp", 1);
    const kv_transport_ops_t *xo = &kv_transport_ucx;
    kv_xfer_config_t cfg = {.peer_errors = true};
    kv_xfer_t *x;
    cr_assert_eq(xo->create(&cfg, &x), TD_OK);
    uint32_t region[2];
    kv_xfer_peer_t *p = attach(xo, x, &t, region);
    static uint8_t src[1 << 20];
    cr_assert_eq(xo->put(x, p, region[0], src, sizeof src, 0), TD_OK);
    cr_assert_eq(xo->flush(x, p, 10), TD_OK, "%s", td_last_error());
    kill(t.pid, SIGSTOP);
    int st;
    cr_assert_eq(waitpid(t.pid, &st, WUNTRACED), t.pid); /* stopped, every thread of it, before the puts */
    cr_assert(WIFSTOPPED(st));
    double t0 = td_now_s();
    td_status_t rc = TD_OK;
    for (int i = 0; i < 8 && !rc; i++)
        rc = xo->put(x, p, region[0], src, sizeof src, 0);
    if (!rc)
        rc = xo->flush(x, p, 1.0);
    double frozen = td_now_s() - t0;
    cr_assert_eq(rc, TD_ERR_TIMEOUT, "a frozen target: %s", td_last_error());
    cr_assert(frozen >= 0.9 && frozen < 3.0, "the flush ended at its 1 s deadline (%.2f s)", frozen);
    kill(t.pid, SIGKILL);
    kill(t.pid, SIGCONT);
    t0 = td_now_s();
    rc = TD_OK;
    for (int i = 0; i < 8 && !rc; i++)
        rc = xo->put(x, p, region[0], src, sizeof src, 0);
    if (!rc)
        rc = xo->flush(x, p, 5.0);
    double dead = td_now_s() - t0;
    cr_assert(rc == TD_ERR_UNAVAILABLE || rc == TD_ERR_TIMEOUT, "a dead target: rc %d (%s)", rc, td_last_error());
    cr_assert_lt(dead, 6.0, "answered within the deadline (%.2f s)", dead);
    cr_log_info("transport: frozen target flush ended after %.2f s (deadline 1 s); dead target answered %s after "
                "%.2f s", frozen, rc == TD_ERR_UNAVAILABLE ? "UNAVAILABLE" : "TIMEOUT", dead);
    xo->disconnect(x, p);
    xo->destroy(x);
    target_stop(&t);
}

/* A landing descriptor names its transport: "ucx" (or nothing) and, in a
 * build with CUDA, "cuda_ipc", whose puts can be ordered after device work
 * (fence); any other name is none. Without a GPU, the CUDA IPC transport
 * refuses to start, naming the device. */
Test(transport, transports_by_name)
{
    cr_assert_eq(kv_transport_find(""), &kv_transport_ucx);
    cr_assert_eq(kv_transport_find("ucx"), &kv_transport_ucx);
    cr_assert_null(kv_transport_find("rdma"));
    cr_assert(!kv_transport_ucx.fence && !kv_transport_ucx.wait_fence, "host memory needs no fences");
#ifdef TANDEM_HAVE_CUDA
    const kv_transport_ops_t *ci = kv_transport_find("cuda_ipc");
    cr_assert_eq(ci, &kv_transport_cuda_ipc);
    cr_assert(ci->fence && ci->wait_fence && ci->get && ci->flush);
    kv_xfer_config_t cfg = {.device = 7};
    kv_xfer_t *x = NULL;
    td_status_t rc = ci->create(&cfg, &x);
    if (rc) /* no GPU, or no device 7 */
        cr_assert(strstr(td_last_error(), "cuda_ipc: device 7:"), "%s", td_last_error());
    else
        ci->destroy(x);
#endif
}
