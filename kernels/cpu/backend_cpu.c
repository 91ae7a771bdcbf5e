/* backend_cpu.c — the CPU backend: host memory, synchronous ops on a thread
 * pool, AVX2 kernels when the CPU has them (kernels/cpu/vecdot.h). */
#define _DEFAULT_SOURCE /* madvise(MADV_HUGEPAGE) */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/log.h"
#include "kernels/cpu/cpu_int.h"
#include "kernels/cpu/repack.h"
#include "kernels/quant.h"

void *kern_cpu_scratch(kern_cpu_t *c, size_t bytes)
{
    if (bytes <= c->scratch_cap)
        return c->scratch;
    size_t cap = c->scratch_cap ? c->scratch_cap : 1 << 16;
    while (cap < bytes)
        cap *= 2;
    void *p = NULL;
    if (posix_memalign(&p, 64, cap) != 0)
        return NULL;
    free(c->scratch);
    c->scratch = p;
    c->scratch_cap = cap;
    return p;
}

static td_status_t cpu_alloc(kern_backend_t *b, size_t bytes, void **ptr)
{
    (void)b;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return td_error(TD_ERR_NO_MEMORY, "cpu backend: cannot allocate %zu bytes", bytes);
    *ptr = p;
    return TD_OK;
}

static void cpu_free(kern_backend_t *b, void *ptr)
{
    (void)b;
    free(ptr);
}

static td_status_t cpu_copy(kern_backend_t *b, void *dst, const void *src, size_t bytes)
{
    (void)b;
    memmove(dst, src, bytes);
    return TD_OK;
}

static td_status_t cpu_sync(kern_backend_t *b)
{
    (void)b;
    return TD_OK;
}

/* Repacked weights live in an arena of 2 MiB-aligned chunks advised for huge
 * pages, in the order the model binds them: a decode step streams them once,
 * front to back, and 4 KiB pages would cost a TLB miss every 4 KiB. The arena
 * is freed with the backend. */
#define ARENA_CHUNK (64u << 20)
#define HUGE_PAGE (2u << 20)

static void *arena_alloc(kern_cpu_t *c, size_t n)
{
    n = (n + 63) & ~(size_t)63;
    kern_cpu_chunk_t *ch = c->arena;
    if (!ch || ch->used + n > ch->size) {
        size_t size = n > ARENA_CHUNK ? (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE : ARENA_CHUNK;
        void *mem = NULL;
        if (posix_memalign(&mem, HUGE_PAGE, size) != 0)
            return NULL;
        madvise(mem, size, MADV_HUGEPAGE);
        kern_cpu_chunk_t *nc = malloc(sizeof *nc);
        if (!nc) {
            free(mem);
            return NULL;
        }
        *nc = (kern_cpu_chunk_t){.next = c->arena, .mem = mem, .size = size, .used = 0};
        c->arena = ch = nc;
    }
    void *p = (uint8_t *)ch->mem + ch->used;
    ch->used += n;
    return p;
}

/* Weights stay in the mapped file; on the AVX2 path Q4_1 and Q8_0 matrices
 * also get an 8-row interleaved copy (kernels/cpu/repack.h) that matmul uses. */
/* FP8 (kernels/backend.h's kern_weight_t): the decoded values, each FP8 value
 * times its row's scale, kept as an F32 matrix in the arena. */
static td_status_t prepare_fp8(kern_cpu_t *c, kern_weight_t *w)
{
    float *dst = arena_alloc(c, (size_t)w->rows * w->cols * sizeof *dst);
    uint8_t *q = malloc(w->cols);
    float *tmp = malloc((size_t)w->cols * sizeof *tmp);
    td_status_t rc = dst && q && tmp ? TD_OK
                                     : td_error(TD_ERR_NO_MEMORY, "cpu backend: no memory for a %ux%u FP8 matrix",
                                                w->rows, w->cols);
    for (uint32_t r = 0; r < w->rows && !rc; r++) {
        float s, *d = dst + (size_t)r * w->cols;
        if (!(rc = kern_weight_fp8_row(w, r, q, &s, tmp)))
            for (uint32_t i = 0; i < w->cols; i++)
                d[i] = kern_fp8_to_fp32(q[i]) * s;
    }
    free(q);
    free(tmp);
    if (rc)
        return rc;
    w->type = KERN_TYPE_F32;
    w->data = dst;
    w->hold = KERN_TYPE_F8_E4M3;
    w->scale = NULL;
    w->priv = NULL;
    return TD_OK;
}

static td_status_t cpu_weight_prepare(kern_backend_t *b, kern_weight_t *w)
{
    kern_cpu_t *c = (kern_cpu_t *)b;
    if (!w->data && w->type == KERN_TYPE_F16) { /* no file: seeded values (kern_weight_t.fill) */
        uint16_t *d = arena_alloc(c, (size_t)w->rows * w->cols * sizeof *d);
        if (!d)
            return td_error(TD_ERR_NO_MEMORY, "cpu backend: no memory for a %ux%u matrix", w->rows, w->cols);
        for (uint32_t r = 0; r < w->rows; r++)
            kern_fill_row_f16(w->fill, (uint64_t)w->fill_row0 + r, w->fill_col0, w->cols, d + (size_t)r * w->cols);
        w->data = d;
    }
    if (w->hold == KERN_TYPE_F8_E4M3 || w->type == KERN_TYPE_F8_E4M3)
        return prepare_fp8(c, w);
    size_t n = kern_repack_size(w);
    w->priv = NULL;
    if (!n || c->vd != &kern_vecdot_avx2 || c->ref)
        return TD_OK;
    if (!(w->priv = arena_alloc(c, n)))
        return td_error(TD_ERR_NO_MEMORY, "cpu backend: no memory to repack a %ux%u matrix", w->rows, w->cols);
    kern_repack(w, w->priv, c->vnni);
    return TD_OK;
}

/* The arena goes with the backend. */
static void cpu_weight_release(kern_backend_t *b, kern_weight_t *w)
{
    (void)b;
    w->priv = NULL;
}

static void *cpu_queue(kern_backend_t *b)
{
    (void)b;
    return NULL;
}

static td_status_t cpu_kv_digest(kern_backend_t *b, const void *base, size_t block_bytes, const int32_t *blocks,
                                 uint32_t n, uint64_t *out)
{
    (void)b;
    for (uint32_t i = 0; i < n; i++)
        out[i] = td_kv_block_digest((const uint8_t *)base + (size_t)blocks[i] * block_bytes, block_bytes);
    return TD_OK;
}

static const kern_backend_ops_t kern_cpu_ops = {
    .name = "cpu",
    .supported = KERN_OPS_ALL,
    .kv_dtypes = (1u << TD_KV_F32) | (1u << TD_KV_F16) | (1u << TD_KV_F8_E4M3),
    .destroy = kern_cpu_backend_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .queue = cpu_queue,
    .kv_digest = cpu_kv_digest,
    .weight_prepare = cpu_weight_prepare,
    .weight_release = cpu_weight_release,
    .matmul = kern_cpu_matmul,
    .matmul_multi = kern_cpu_matmul_multi,
    .rmsnorm = kern_cpu_rmsnorm,
    .rope = kern_cpu_rope,
    .swiglu = kern_cpu_swiglu,
    .add = kern_cpu_add,
    .embed = kern_cpu_embed,
    .kv_store = kern_cpu_kv_store,
    .attention = kern_cpu_attention,
};

bool kern_numerics_parse(const char *s, kern_numerics_t *out)
{
    if (s && !strcmp(s, "fast"))
        *out = KERN_NUMERICS_FAST;
    else if (s && !strcmp(s, "reference"))
        *out = KERN_NUMERICS_REFERENCE;
    else
        return false;
    return true;
}

td_status_t kern_cpu_backend_create(int n_threads, kern_backend_t **out)
{
    return kern_cpu_backend_create_numerics(n_threads, KERN_NUMERICS_FAST, out);
}

td_status_t kern_cpu_backend_create_numerics(int n_threads, kern_numerics_t numerics, kern_backend_t **out)
{
    const kern_vecdot_table_t *vd = kern_vecdot();
    if (numerics == KERN_NUMERICS_REFERENCE && vd != &kern_vecdot_avx2)
        return td_error(TD_ERR_UNSUPPORTED, "cpu backend: reference numerics need a CPU with AVX2, FMA and F16C "
                                            "(llama.cpp's x86 build), and TANDEM_CPU not set to portable");
    kern_cpu_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "cpu backend: no memory");
    c->base.ops = &kern_cpu_ops;
    c->vd = vd;
    c->vnni = c->vd == &kern_vecdot_avx2 && kern_cpu_has_vnni();
    if (numerics == KERN_NUMERICS_REFERENCE) {
        c->vd = &kern_vecdot_avx2_ref;
        c->ref = true;
    }
    td_status_t rc = kern_pool_create(n_threads, &c->pool);
    if (rc) {
        free(c);
        return rc;
    }
    *out = &c->base;
    return TD_OK;
}

void kern_cpu_backend_destroy(kern_backend_t *b)
{
    kern_cpu_t *c = (kern_cpu_t *)b;
    if (!c)
        return;
    kern_pool_destroy(c->pool);
    free(c->scratch);
    while (c->arena) {
        kern_cpu_chunk_t *n = c->arena->next;
        free(c->arena->mem);
        free(c->arena);
        c->arena = n;
    }
    free(c);
}
