/* engine.c — tandem-bench-engine: the engine's speed on one model, and the
 * machine's floors, for bench/engine.py to set beside llama.cpp.
 *
 *   tandem-bench-engine MODEL THREADS REPEATS
 *
 * prints JSON lines: {"what": "prefill512" | "decode1" | "decode16", "tok_s": [...]}
 * for each repeat, then {"what": "read_gbs"} (streaming read bandwidth of a
 * 512 MiB buffer with THREADS threads) and {"what": "fma_gflops"} (peak fp32
 * FMA throughput with THREADS threads), and {"what": "bytes_per_token"} (the
 * weight bytes a decode step reads: every matrix once, the embedding row).
 * Decode runs 64 steps after a 32-token prompt, greedy, EOS ignored. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "engine/engine.h"
#include "engine/gguf.h"
#include "engine/model.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct counter {
    double t_first, t_last;
    size_t tokens;
} counter_t;

static kern_numerics_t numerics = KERN_NUMERICS_FAST;

static void on_ev(void *ctx, const eng_event_t *ev)
{
    counter_t *c = ctx;
    double t = now_s();
    if (!c->tokens)
        c->t_first = t;
    c->t_last = t;
    c->tokens++;
    (void)ev;
}

/* Tokens per second of: a 512-token prefill (prefill=1), or decode of nseq
 * sequences (aggregate tokens/s over the steps after the first token). */
static double run(eng_model_t *m, int threads, int prefill, int nseq)
{
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.numerics = numerics;
    cfg.n_threads = threads;
    cfg.prefix_cache = false;
    cfg.kv_tokens = 32768;
    eng_engine_t *e;
    if (eng_engine_create(m, &cfg, &e))
        exit(1);
    int32_t prompt[512];
    for (int i = 0; i < 512; i++)
        prompt[i] = 1000 + (i * 37) % 20000;
    counter_t c = {0};
    eng_request_t r = {.prompt = prompt, .n_prompt = prefill ? 512 : 32, .sampling = eng_sampling_default(),
                       .max_tokens = prefill ? 1 : 65, .ignore_eos = true};
    uint64_t id;
    double t0 = now_s();
    for (int s = 0; s < nseq; s++) {
        prompt[0] = 1000 + s; /* distinct sequences */
        if (eng_engine_add(e, &r, &id))
            exit(1);
    }
    while (eng_engine_busy(e))
        if (eng_engine_step(e, on_ev, &c))
            exit(1);
    double v = prefill ? 512.0 / (c.t_first - t0) : (c.tokens - nseq) / (c.t_last - c.t_first);
    eng_engine_destroy(e);
    return v;
}

typedef struct bw_arg {
    const char *buf;
    size_t n;
    double sum;
} bw_arg_t;

static void *bw_thread(void *p)
{
    bw_arg_t *a = p;
    __m256 acc = _mm256_setzero_ps();
    for (size_t i = 0; i < a->n; i += 128)
        acc = _mm256_add_ps(acc, _mm256_add_ps(_mm256_load_ps((const float *)(const void *)(a->buf + i)),
                                                _mm256_load_ps((const float *)(const void *)(a->buf + i + 64))));
    float t[8];
    _mm256_storeu_ps(t, acc);
    a->sum = t[0];
    return NULL;
}

/* Reads every cache line of 512 MiB (far past the caches) with n threads. */
static double read_bandwidth(int n)
{
    size_t size = 512u << 20;
    char *buf = aligned_alloc(64, size);
    memset(buf, 1, size);
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        pthread_t th[64];
        bw_arg_t a[64];
        double t0 = now_s();
        for (int i = 0; i < n; i++) {
            a[i] = (bw_arg_t){buf + size / n * i, size / n, 0};
            pthread_create(&th[i], NULL, bw_thread, &a[i]);
        }
        for (int i = 0; i < n; i++)
            pthread_join(th[i], NULL);
        double gbs = size / (now_s() - t0) / 1e9;
        best = gbs > best ? gbs : best;
    }
    free(buf);
    return best;
}

static void *fma_thread(void *p)
{
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0;
    __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (long i = 0; i < 20000000; i++) {
        a0 = _mm256_fmadd_ps(a0, m, c), a1 = _mm256_fmadd_ps(a1, m, c), a2 = _mm256_fmadd_ps(a2, m, c);
        a3 = _mm256_fmadd_ps(a3, m, c), a4 = _mm256_fmadd_ps(a4, m, c), a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c), a7 = _mm256_fmadd_ps(a7, m, c), a8 = _mm256_fmadd_ps(a8, m, c);
        a9 = _mm256_fmadd_ps(a9, m, c);
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                      _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(_mm256_add_ps(a6, a7),
                                                                                         _mm256_add_ps(a8, a9)))));
    *(float *)p = t[0];
    return NULL;
}

/* fp32 GFLOP/s of AVX2 FMAs (10 independent chains) on n threads. */
static double fma_peak(int n)
{
    pthread_t th[64];
    float sink[64];
    double t0 = now_s();
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, fma_thread, &sink[i]);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    return n * 20000000.0 * 10 * 8 * 2 / (now_s() - t0) / 1e9;
}

static int emit(const char *what, const double *v, int n)
{
    printf("{\"what\": \"%s\", \"tok_s\": [", what);
    for (int i = 0; i < n; i++)
        printf(i ? ", %.2f" : "%.2f", v[i]);
    return printf("]}\n");
}

int main(int argc, char **argv)
{
    td_log_init("bench", TD_LOG_WARN, false);
    if ((argc != 4 && argc != 5) || (argc == 5 && !kern_numerics_parse(argv[4], &numerics))) {
        fprintf(stderr, "usage: tandem-bench-engine MODEL THREADS REPEATS [fast|reference]\n");
        return 2;
    }
    int threads = atoi(argv[2]), reps = atoi(argv[3]);
    eng_model_t *m;
    if (eng_model_open(argv[1], &m))
        return 1;
    double v[64];
    for (int i = 0; i < reps; i++)
        v[i] = run(m, threads, 1, 1);
    emit("prefill512", v, reps);
    for (int i = 0; i < reps; i++)
        v[i] = run(m, threads, 0, 1);
    emit("decode1", v, reps);
    for (int i = 0; i < reps; i++)
        v[i] = run(m, threads, 0, 16);
    emit("decode16", v, reps);
    printf("{\"what\": \"read_gbs\", \"value\": %.2f}\n", read_bandwidth(threads));
    printf("{\"what\": \"fma_gflops\", \"value\": %.1f}\n", fma_peak(threads));
    /* a decode step reads every matrix once, plus one embedding row; norms are noise */
    uint64_t bytes = 0;
    for (size_t i = 0; m->gguf && i < eng_gguf_n_tensors(m->gguf); i++)
        bytes += eng_gguf_tensor_at(m->gguf, i)->n_bytes;
    printf("{\"what\": \"bytes_per_token\", \"value\": %llu}\n", (unsigned long long)bytes);
    printf("{\"what\": \"flops_per_token\", \"value\": %llu}\n", (unsigned long long)(2 * m->desc.n_params));
    eng_model_close(m);
    return 0;
}
