/* allreduce.c — tandem-bench-allreduce [GPUS] [MAX_MIB]: the all-reduce a
 * tensor-parallel worker's ranks run (kernels/comm.h over NCCL: a GPU a rank,
 * each rank on its own thread, queued on its backend's stream, fp32 sums as
 * the forward pass makes them), timed from 16 KiB (the 7B shape's batch-1
 * row) to MAX_MIB (default 256) by doubling.
 *
 * Each size is first checked (rank r's buffer holds r + 1 + i % 7 at element
 * i; every rank must end with the sum), then timed: every rank queues K calls
 * and waits for its stream, K chosen so a round takes ~50 ms; the median of
 * 5 rounds. Bandwidths as nccl-tests defines them: algorithm = bytes / time,
 * bus = algorithm * 2 (n - 1) / n, the figure to hold against the link's.
 * First a line with GPU 0's measured read bandwidth (tests/cuda/probe.cu: the
 * floor a decode step's weight reads are held against), then one JSON line a
 * size; exit 1 when a sum is wrong, a call fails, or a round does not end
 * within ROUND_S (a hung rank: the ranks' threads are left, the process
 * exits). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "engine/engine.h"
#include "kernels/comm.h"
#include "kernels/cuda/comm_nccl.h"

#define MAX_RANKS 8

double kern_cuda_probe_read_gbs(size_t bytes); /* tests/cuda/probe.cu */
#define ROUNDS 5
#define ROUND_S 60.0 /* the longest a round may take: a round is timed to ~50 ms */

typedef struct bench {
    uint32_t ranks;
    kern_backend_t *bes[MAX_RANKS];
    float *bufs[MAX_RANKS];
    kern_comm_t *comm;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t round; /* the round under way: the ranks start it when it grows */
    uint32_t ended; /* the ranks that ended it */
    size_t n;       /* this size's elements */
    uint32_t k;     /* calls a round (0: done) */
    int failed;     /* any rank's call or sync failed */
} bench_t;

typedef struct rank_arg {
    bench_t *b;
    uint32_t rank;
} rank_arg_t;

static void *rank_main(void *arg)
{
    rank_arg_t *a = arg;
    bench_t *b = a->b;
    kern_backend_t *be = b->bes[a->rank];
    for (uint64_t seen = 0;;) {
        pthread_mutex_lock(&b->mu); /* the main thread set n and k (0: done) and began a round */
        while (b->round == seen)
            pthread_cond_wait(&b->cv, &b->mu);
        seen = b->round;
        pthread_mutex_unlock(&b->mu);
        if (!b->k)
            return NULL;
        td_status_t rc = TD_OK;
        for (uint32_t i = 0; i < b->k && !rc; i++)
            rc = b->comm->ops->all_reduce(b->comm, a->rank, be, b->bufs[a->rank], b->n);
        if (!rc)
            rc = be->ops->sync(be);
        pthread_mutex_lock(&b->mu);
        b->failed = b->failed || rc; /* logged where found */
        b->ended++;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
    }
}

/* One round of k calls on every rank (k 0: the ranks end): seconds, or < 0 on failure. */
static double round_s(bench_t *b, size_t n, uint32_t k)
{
    pthread_mutex_lock(&b->mu);
    b->n = n, b->k = k, b->ended = 0, b->round++;
    double t0 = td_now_s();
    pthread_cond_broadcast(&b->cv);
    if (!k) {
        pthread_mutex_unlock(&b->mu);
        return 0;
    }
    const struct timespec until = td_wall_deadline(ROUND_S);
    int rc = 0;
    while (b->ended < b->ranks && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&b->cv, &b->mu, &until);
    const uint32_t ended = b->ended;
    const int failed = b->failed;
    pthread_mutex_unlock(&b->mu);
    if (ended < b->ranks) {
        fprintf(stderr, "tandem-bench-allreduce: %u of %u ranks did not end a round of %u all-reduces of %zu bytes "
                "within %.0f s\n", b->ranks - ended, b->ranks, k, n * sizeof(float), ROUND_S);
        fflush(stdout);
        _exit(1); /* the hung ranks' threads cannot be joined */
    }
    return failed ? -1 : td_now_s() - t0;
}

/* Fills every rank's buffer, one call, and checks each rank's sum. */
static int check(bench_t *b, size_t n, float *host)
{
    for (uint32_t r = 0; r < b->ranks; r++) {
        for (size_t i = 0; i < n; i++)
            host[i] = (float)(r + 1 + i % 7);
        if (b->bes[r]->ops->upload(b->bes[r], b->bufs[r], host, n * sizeof *host))
            return -1;
    }
    if (round_s(b, n, 1) < 0)
        return -1;
    const double ranks = b->ranks;
    for (uint32_t r = 0; r < b->ranks; r++) {
        if (b->bes[r]->ops->download(b->bes[r], host, b->bufs[r], n * sizeof *host))
            return -1;
        for (size_t i = 0; i < n; i++) {
            double want = ranks * (ranks + 1) / 2 + ranks * (double)(i % 7);
            if (host[i] != (float)want)
                return fprintf(stderr, "rank %u, element %zu of %zu: %g, not the sum %g\n", r, i, n, host[i], want),
                       -1;
        }
    }
    memset(host, 0, n * sizeof *host); /* the timed calls sum zeros: nothing grows past a float */
    for (uint32_t r = 0; r < b->ranks; r++)
        if (b->bes[r]->ops->upload(b->bes[r], b->bufs[r], host, n * sizeof *host))
            return -1;
    return 0;
}

static int cmp_d(const void *x, const void *y)
{
    double a = *(const double *)x, c = *(const double *)y;
    return a < c ? -1 : a > c;
}

int main(int argc, char **argv)
{
    bench_t b = {.ranks = argc > 1 ? (uint32_t)atoi(argv[1]) : 2};
    const size_t max_bytes = (size_t)(argc > 2 ? atoi(argv[2]) : 256) << 20;
    if (b.ranks < 2 || b.ranks > MAX_RANKS || max_bytes < (16u << 10)) {
        fprintf(stderr, "usage: tandem-bench-allreduce [GPUS: 2 to %d] [MAX_MIB]\n", MAX_RANKS);
        return 2;
    }
    td_log_set_level(TD_LOG_WARN);
    printf("{\"gpu\": 0, \"read_gbs\": %.0f}\n", kern_cuda_probe_read_gbs((size_t)8 << 30));
    for (uint32_t r = 0; r < b.ranks; r++) {
        char dev[16];
        snprintf(dev, sizeof dev, "cuda:%u", r);
        if (eng_backend_open(dev, 1, KERN_NUMERICS_FAST, &b.bes[r]) ||
            b.bes[r]->ops->alloc(b.bes[r], max_bytes, (void **)&b.bufs[r]))
            return 1; /* logged where found */
    }
    double t0 = td_now_s();
    if (kern_comm_nccl_create(b.ranks, b.bes, &b.comm))
        return 1;
    fprintf(stderr, "NCCL communicators for %u GPUs made in %.2f s\n", b.ranks, td_now_s() - t0);
    float *host = malloc(max_bytes);
    pthread_t th[MAX_RANKS];
    rank_arg_t args[MAX_RANKS];
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    for (uint32_t r = 0; r < b.ranks; r++) {
        args[r] = (rank_arg_t){&b, r};
        pthread_create(&th[r], NULL, rank_main, &args[r]);
    }
    int bad = !host;
    for (size_t bytes = 16u << 10; bytes <= max_bytes && !bad; bytes *= 2) {
        const size_t n = bytes / sizeof(float);
        if ((bad = check(&b, n, host)))
            break;
        double one = round_s(&b, n, 3) / 3; /* warm, and the size of a round */
        uint32_t k = one > 0 ? (uint32_t)(0.05 / one) : 1;
        k = k < 1 ? 1 : k > 2000 ? 2000 : k;
        double t[ROUNDS];
        for (int i = 0; i < ROUNDS && !bad; i++)
            bad = (t[i] = round_s(&b, n, k) / k) < 0;
        if (bad)
            break;
        qsort(t, ROUNDS, sizeof *t, cmp_d);
        const double s = t[ROUNDS / 2], alg = bytes / s / 1e9;
        printf("{\"gpus\": %u, \"bytes\": %zu, \"calls\": %u, \"us\": %.2f, \"algbw_gbs\": %.2f, \"busbw_gbs\": %.2f, "
               "\"sum_ok\": true}\n",
               b.ranks, bytes, k, s * 1e6, alg, alg * 2 * (b.ranks - 1) / b.ranks);
        fflush(stdout);
    }
    round_s(&b, 0, 0);
    for (uint32_t r = 0; r < b.ranks; r++)
        pthread_join(th[r], NULL);
    b.comm->ops->destroy(b.comm);
    for (uint32_t r = 0; r < b.ranks; r++) {
        b.bes[r]->ops->free(b.bes[r], b.bufs[r]);
        kern_backend_destroy(b.bes[r]);
    }
    free(host);
    return bad ? 1 : 0;
}
