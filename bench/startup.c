/* startup.c — tandem-bench-startup MODEL [TANDEM_BIN]: how long from process
 * start to "model ready" (weights mapped, description and tokenizer built),
 * against reading the model file once.
 *
 * Three numbers, medians over repeats, page cache warm (the file is read once
 * first): read_once — read() of the whole file into memory; open — the
 * in-process eng_model_open() + close; process — fork/exec of
 * `tandem inspect MODEL --json` to exit, which is start-up plus printing. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "engine/engine.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double read_once(const char *path, size_t *size)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    off_t n = lseek(fd, 0, SEEK_END);
    lseek(fd, 0, SEEK_SET);
    char *buf = malloc((size_t)n);
    double t0 = now_ms();
    size_t got = 0;
    while (got < (size_t)n) {
        ssize_t k = read(fd, buf + got, (size_t)n - got);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    double t = now_ms() - t0;
    volatile char sink = buf[got / 2];
    (void)sink;
    free(buf);
    close(fd);
    *size = got;
    return t;
}

int main(int argc, char **argv)
{
    td_log_init("bench", TD_LOG_WARN, false);
    if (argc < 2) {
        fprintf(stderr, "usage: tandem-bench-startup MODEL [TANDEM_BIN]\n");
        return 2;
    }
    const char *path = argv[1], *bin = argc > 2 ? argv[2] : "build/bin/tandem";
    enum { R = 11 };
    double rd[R], op[R], pr[R], parse[R], tok[R];
    size_t size = 0;
    read_once(path, &size); /* warm the page cache */
    for (int i = 0; i < R; i++)
        rd[i] = read_once(path, &size);
    for (int i = 0; i < R; i++) {
        eng_model_t *m;
        double t0 = now_ms();
        if (eng_model_open(path, &m))
            return 1;
        op[i] = now_ms() - t0;
        eng_model_close(m);
        /* its parts: the GGUF directory alone, and the tokenizer alone */
        eng_gguf_t *g;
        t0 = now_ms();
        eng_gguf_open(path, &g);
        parse[i] = now_ms() - t0;
        eng_tokenizer_t *t;
        t0 = now_ms();
        eng_tokenizer_from_gguf(g, &t);
        tok[i] = now_ms() - t0;
        eng_tokenizer_destroy(t);
        eng_gguf_close(g);
    }
    double eng[R];
    for (int i = 0; i < R; i++) { /* + the engine: weights bound, repacked for the SIMD kernels, KV pool */
        eng_model_t *m;
        eng_engine_t *e;
        eng_engine_config_t cfg = eng_engine_config_default();
        double t0 = now_ms();
        if (eng_model_open(path, &m) || eng_engine_create(m, &cfg, &e))
            return 1;
        eng_engine_destroy(e);
        eng_model_close(m);
        eng[i] = now_ms() - t0;
    }
    for (int i = 0; i < R; i++) {
        double t0 = now_ms();
        pid_t pid = fork();
        if (pid == 0) {
            int devnull = open("/dev/null", O_WRONLY);
            dup2(devnull, 1);
            execl(bin, bin, "inspect", path, "--json", (char *)NULL);
            _exit(127);
        }
        int st;
        waitpid(pid, &st, 0);
        pr[i] = now_ms() - t0;
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "bench: %s inspect failed\n", bin);
            return 1;
        }
    }
    double r = median(rd, R);
    printf("model: %s (%.1f MiB)\n", path, size / 1048576.0);
    printf("| what (median of %d, warm page cache) | ms |\n|---|---|\n", R);
    printf("| read the file once (read() into memory) | %.2f (%.1f GB/s) |\n", r, size / (r * 1e-3) / 1e9);
    printf("| model ready in process (eng_model_open: map + GGUF directory + description + tokenizer) | %.2f |\n",
           median(op, R));
    printf("| of which: GGUF open (map + validate directory) | %.2f |\n", median(parse, R));
    printf("| of which: tokenizer (49k tokens, 49k merges indexed) | %.2f |\n", median(tok, R));
    printf("| engine ready (model open + weights bound and repacked for the CPU kernels + 64 MiB KV pool) | %.2f |\n",
           median(eng, R));
    printf("| process start to exit: `tandem inspect --json` | %.2f |\n", median(pr, R));
    return 0;
}
