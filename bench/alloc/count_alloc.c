/* count_alloc.c — a malloc interposer (LD_PRELOAD) that counts heap
 * allocations by the object that called the allocator: the program itself
 * (tandem's code, linked statically), libc (strdup and friends, called from
 * ours), protobuf-c (unpacking messages ours asked for), gRPC (its own
 * buffers and slices) and the rest. Every 100 ms it writes the counts to
 * $TANDEM_ALLOC_DIR/<program>-<pid>, so a benchmark can read them between
 * requests. Used by bench/alloc_per_token.py; never part of a tandem binary. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { BY_EXE, BY_LIBC, BY_PROTOBUF, BY_GRPC, BY_OTHER, N_BY };
static const char *const by_name[N_BY] = {"exe", "libc", "protobuf_c", "grpc", "other"};
static atomic_ulong counts[N_BY];
static void *(*real_malloc)(size_t), *(*real_calloc)(size_t, size_t), *(*real_realloc)(void *, size_t);
static __thread int inside;
static char exe_path[4096];

/* calloc is asked for by dlsym itself before real_calloc is known */
static char boot[4096];
static size_t boot_used;

static int classify(void *ret)
{
    Dl_info di;
    if (!dladdr(ret, &di) || !di.dli_fname)
        return BY_OTHER;
    const char *f = di.dli_fname, *fb = strrchr(f, '/'), *eb = strrchr(exe_path, '/');
    if (!strcmp(f, exe_path) || !fb || (eb && !strcmp(fb, eb)))
        return BY_EXE;
    if (strstr(f, "/libc.so"))
        return BY_LIBC;
    if (strstr(f, "libprotobuf-c"))
        return BY_PROTOBUF;
    if (strstr(f, "libgrpc") || strstr(f, "libgpr") || strstr(f, "libabsl") || strstr(f, "libaddress_sorting") ||
        strstr(f, "libupb") || strstr(f, "libre2") || strstr(f, "libcares") || strstr(f, "libssl") ||
        strstr(f, "libcrypto") || strstr(f, "libstdc++"))
        return BY_GRPC;
    return BY_OTHER;
}

static void count(void *ret)
{
    if (inside)
        return;
    inside = 1;
    atomic_fetch_add_explicit(&counts[classify(ret)], 1, memory_order_relaxed);
    inside = 0;
}

static void init(void)
{
    if (real_malloc)
        return;
    real_calloc = NULL;
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
}

void *malloc(size_t n)
{
    init();
    count(__builtin_return_address(0));
    return real_malloc(n);
}

void *calloc(size_t a, size_t b)
{
    if (!real_calloc) { /* during dlsym */
        size_t n = (a * b + 15) & ~(size_t)15;
        if (boot_used + n > sizeof boot)
            return NULL;
        void *p = boot + boot_used;
        boot_used += n;
        return p;
    }
    count(__builtin_return_address(0));
    return real_calloc(a, b);
}

void *realloc(void *p, size_t n)
{
    init();
    count(__builtin_return_address(0));
    return real_realloc(p, n);
}

void free(void *p)
{
    static void (*real_free)(void *);
    if ((char *)p >= boot && (char *)p < boot + sizeof boot)
        return;
    if (!real_free)
        real_free = dlsym(RTLD_NEXT, "free");
    real_free(p);
}

static void *dumper(void *arg)
{
    (void)arg;
    inside = 1; /* this thread's own allocations are not counted */
    const char *dir = getenv("TANDEM_ALLOC_DIR");
    char path[4608], tmp[4700];
    const char *base = strrchr(exe_path, '/');
    snprintf(path, sizeof path, "%s/%s-%d", dir, base ? base + 1 : exe_path, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    for (;;) {
        FILE *f = fopen(tmp, "w");
        if (f) {
            for (int i = 0; i < N_BY; i++)
                fprintf(f, "%s %lu\n", by_name[i], atomic_load(&counts[i]));
            fclose(f);
            rename(tmp, path);
        }
        usleep(100 * 1000);
    }
    return NULL;
}

__attribute__((constructor)) static void start(void)
{
    init();
    ssize_t n = readlink("/proc/self/exe", exe_path, sizeof exe_path - 1);
    exe_path[n > 0 ? n : 0] = 0;
    if (!getenv("TANDEM_ALLOC_DIR") || !strstr(exe_path, "tandem-"))
        return;
    pthread_t t;
    inside = 1;
    pthread_create(&t, NULL, dumper, NULL);
    pthread_detach(t);
    inside = 0;
}
