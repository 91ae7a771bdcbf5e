/* groups.c — each request of a synthetic `tandem bench` workload with its
 * prefix group: index, send time, input length, group (one line each). It
 * calls bench_synthetic itself, so the groups are exactly the bench's; the
 * words do not matter (only how many are drawn), so a one-word list stands
 * in for the tokenizer's. The 2026-11-26 synthetic run's parameters:
 *   groups RATE N SEED GROUPS SHARE MIN MAX OUTPUT_LEN   (3 60 11 20 0.8 128 512 16)
 * Build from the repository root after `make`:
 *   cc -std=gnu11 -I. bench/reuse/groups.c \
 *      build/libtandem_bench.a build/libtandem_engine.a build/libtandem_kernels.a \
 *      build/libtandem_common.a -ljansson -lpcre2-8 -lxxhash -lutf8proc -lm -lpthread -o /tmp/groups */
#include <stdio.h>
#include <stdlib.h>

#include "bench/workload.h"

int main(int argc, char **argv)
{
    if (argc != 9) {
        fprintf(stderr, "usage: groups RATE N SEED GROUPS SHARE MIN MAX OUTPUT_LEN\n");
        return 2;
    }
    static char *word[4096];
    for (size_t i = 0; i < 4096; i++)
        word[i] = "x";
    bench_workload_t w = {.words = word, .n_words = 4096};
    bench_synthetic_t s = {.rate = atof(argv[1]), .cv = 1, .n = (size_t)atol(argv[2]),
                           .seed = (uint64_t)atoll(argv[3]), .groups = (uint32_t)atoi(argv[4]),
                           .prefix_share = atof(argv[5]),
                           .input = {BENCH_DIST_UNIFORM, atof(argv[6]), atof(argv[7])},
                           .output = {BENCH_DIST_FIXED, atof(argv[8]), 0}};
    if (bench_synthetic(&w, &s))
        return 1;
    for (size_t i = 0; i < w.n; i++)
        printf("%zu %.3f %u %d\n", i, w.req[i].t_send, w.req[i].input_len, w.req[i].group);
    w.words = NULL;
    w.n_words = 0;
    bench_workload_free(&w);
    return 0;
}
