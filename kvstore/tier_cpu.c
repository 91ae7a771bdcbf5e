/* tier_cpu.c — the CPU tier (kvstore/tier.h): slots of one block in the
 * transport's region, a stack of the free ones. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvstore/tier.h"

struct kv_cpu_tier {
    uint8_t *base;
    size_t bytes, block_bytes;
    uint32_t *free, n_free;
};

td_status_t kv_cpu_tier_create(uint8_t *base, size_t bytes, kv_cpu_tier_t **out)
{
    kv_cpu_tier_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "the CPU tier: no memory");
    c->base = base;
    c->bytes = bytes;
    *out = c;
    return TD_OK;
}

td_status_t kv_cpu_tier_cut(kv_cpu_tier_t *c, size_t block_bytes, uint32_t *slots)
{
    uint32_t n = block_bytes ? (uint32_t)(c->bytes / block_bytes) : 0;
    if (!n)
        return td_error(TD_ERR_INVALID_ARG, "a block of %zu bytes does not fit the %zu-byte CPU tier", block_bytes,
                        c->bytes);
    uint32_t *fr = malloc(n * sizeof *fr);
    if (!fr)
        return td_error(TD_ERR_NO_MEMORY, "the CPU tier: no memory for %u slots", n);
    for (uint32_t i = 0; i < n; i++) /* slot 0 taken first */
        fr[i] = n - 1 - i;
    free(c->free);
    c->free = fr;
    c->n_free = n;
    c->block_bytes = block_bytes;
    *slots = n;
    return TD_OK;
}

void kv_cpu_tier_destroy(kv_cpu_tier_t *c)
{
    if (c)
        free(c->free);
    free(c);
}

static bool cpu_take(void *t, uint32_t *slot)
{
    kv_cpu_tier_t *c = t;
    if (!c->n_free) /* none free, or not cut yet */
        return false;
    *slot = c->free[--c->n_free];
    return true;
}

static void cpu_give(void *t, uint32_t slot)
{
    kv_cpu_tier_t *c = t;
    c->free[c->n_free++] = slot;
}

static uint8_t *cpu_mem(void *t, uint32_t slot)
{
    kv_cpu_tier_t *c = t;
    return c->base + (size_t)slot * c->block_bytes;
}

/* The digest is the writer's, checked by every reader (kvstore/server.c): a
 * copy in memory has nothing of its own to check. */
static td_status_t cpu_write(void *t, uint32_t slot, td_block_name_t name, uint64_t digest, const void *src)
{
    (void)name, (void)digest;
    memcpy(cpu_mem(t, slot), src, ((kv_cpu_tier_t *)t)->block_bytes);
    return TD_OK;
}

static td_status_t cpu_read(void *t, uint32_t slot, td_block_name_t name, uint64_t digest, void *dst)
{
    (void)name, (void)digest;
    memcpy(dst, cpu_mem(t, slot), ((kv_cpu_tier_t *)t)->block_bytes);
    return TD_OK;
}

static uint64_t cpu_capacity(const void *t) { return ((const kv_cpu_tier_t *)t)->bytes; }

static uint64_t cpu_bad_reads(const void *t)
{
    (void)t;
    return 0;
}

const kv_tier_ops_t kv_tier_cpu = {.name = "cpu", .take = cpu_take, .give = cpu_give, .mem = cpu_mem,
                                   .write = cpu_write, .read = cpu_read, .capacity = cpu_capacity,
                                   .bad_reads = cpu_bad_reads, .read_gbps = 2.0 /* a get: 2.0-3.9 GB/s */};
