/* kv_pool.c — see kv_pool.h.
 *
 * State per block: a count; a name (if published); links in the LRU list of
 * cached blocks (count 0 and named). Free blocks (count 0, no name) are on a
 * stack. The name index is open addressing with linear probing over at least
 * 2x the blocks; a deleted name's slot is refilled by shifting the rest of its
 * run back (no tombstones), so probes stay as short as on a fresh pool.
 *
 * A pool of parts (tensor parallelism) keeps that state once and each rank's
 * part of every block in its own backend's memory; copies in and out go run
 * by run (common/kv_contract.h's td_kv_part_runs) between a rank's part and
 * the whole block. */
#include "engine/kv_pool.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define NAME_EMPTY -1

typedef struct kv_part {
    kern_backend_t *be;
    void *mem;
    td_kv_layout_t g; /* the part's own layout: heads KV heads */
    size_t block_bytes;
    uint32_t head0, heads;
} kv_part_t;

struct eng_kv_pool {
    kern_backend_t *be;
    uint32_t ranks;   /* 1, or the parts' number (parts[0]'s memory is mem) */
    kv_part_t *parts; /* NULL for a pool of whole blocks */
    td_kv_layout_t g;
    size_t block_bytes;
    uint32_t n_blocks;
    void *mem;
    eng_kv_memory_t provider; /* alloc NULL: the backend's memory */
    int32_t *count;
    bool *named;
    td_block_name_t *name;
    int32_t *free_stack;
    uint32_t n_free;
    int32_t *lru_prev, *lru_next; /* cached blocks; head = least recent */
    int32_t lru_head, lru_tail;
    uint32_t n_cached;
    int32_t *index; /* name slots -> block */
    uint32_t index_mask;
    eng_kv_event_fn on_event;
    void *event_ctx;
    uint64_t event_seq;
};

td_status_t eng_kv_pool_create(kern_backend_t *be, const td_kv_layout_t *g, uint32_t n_blocks,
                               const eng_kv_memory_t *mem, eng_kv_pool_t **out)
{
    if (!n_blocks || g->block_tokens < 1)
        return td_error(TD_ERR_INVALID_ARG, "kv pool: %u blocks of %u tokens is not a pool", n_blocks, g->block_tokens);
    if ((unsigned)g->dtype >= TD_KV_DTYPES || !(be->ops->kv_dtypes >> g->dtype & 1))
        return td_error(TD_ERR_UNSUPPORTED, "kv pool: the %s backend does not store KV in %s (model.kv_dtype)",
                        be->ops->name, td_kv_dtype_name(g->dtype));
    eng_kv_pool_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_error(TD_ERR_NO_MEMORY, "kv pool: no memory");
    p->be = be;
    p->ranks = 1;
    p->g = *g;
    p->block_bytes = td_kv_block_bytes(g);
    p->n_blocks = n_blocks;
    uint32_t cap = 16;
    while (cap < 2 * n_blocks)
        cap *= 2;
    p->index_mask = cap - 1;
    p->count = calloc(n_blocks, sizeof *p->count);
    p->named = calloc(n_blocks, sizeof *p->named);
    p->name = calloc(n_blocks, sizeof *p->name);
    p->free_stack = malloc(n_blocks * sizeof *p->free_stack);
    p->lru_prev = malloc(n_blocks * sizeof *p->lru_prev);
    p->lru_next = malloc(n_blocks * sizeof *p->lru_next);
    p->index = malloc(cap * sizeof *p->index);
    if (!p->count || !p->named || !p->name || !p->free_stack || !p->lru_prev || !p->lru_next || !p->index) {
        eng_kv_pool_destroy(p);
        return td_error(TD_ERR_NO_MEMORY, "kv pool: no memory for %u blocks", n_blocks);
    }
    if (mem && mem->alloc)
        p->provider = *mem;
    td_status_t rc = p->provider.alloc ? p->provider.alloc(p->provider.ctx, p->block_bytes * n_blocks, &p->mem)
                                       : be->ops->alloc(be, p->block_bytes * n_blocks, &p->mem);
    if (rc) {
        p->mem = NULL;
        eng_kv_pool_destroy(p);
        return rc;
    }
    for (uint32_t i = 0; i < n_blocks; i++)
        p->free_stack[i] = (int32_t)(n_blocks - 1 - i);
    p->n_free = n_blocks;
    for (uint32_t i = 0; i <= p->index_mask; i++)
        p->index[i] = NAME_EMPTY;
    p->lru_head = p->lru_tail = -1;
    *out = p;
    return TD_OK;
}

td_status_t eng_kv_pool_create_parts(kern_backend_t *const *bes, uint32_t ranks, const uint32_t *head0,
                                     const uint32_t *heads, const td_kv_layout_t *g, uint32_t n_blocks,
                                     const eng_kv_memory_t *mem, eng_kv_pool_t **out)
{
    if (ranks < 2)
        return td_error(TD_ERR_INVALID_ARG, "kv pool: parts for %u ranks", ranks);
    for (uint32_t r = 0; r < ranks; r++)
        if (!heads[r] || head0[r] + heads[r] > g->n_kv_heads)
            return td_error(TD_ERR_INVALID_ARG, "kv pool: rank %u's KV heads %u..%u are not of the model's %u", r,
                            head0[r], head0[r] + heads[r], g->n_kv_heads);
    /* the bookkeeping with rank 0's part as its memory, then the other parts */
    td_kv_layout_t g0 = td_kv_part_layout(g, heads[0]);
    eng_kv_pool_t *p;
    td_status_t rc = eng_kv_pool_create(bes[0], &g0, n_blocks, mem, &p);
    if (rc)
        return rc;
    if (!(p->parts = calloc(ranks, sizeof *p->parts))) {
        eng_kv_pool_destroy(p);
        return td_error(TD_ERR_NO_MEMORY, "kv pool: no memory");
    }
    p->ranks = ranks;
    for (uint32_t r = 0; r < ranks && !rc; r++) {
        kv_part_t *k = &p->parts[r];
        k->be = bes[r], k->g = td_kv_part_layout(g, heads[r]), k->block_bytes = td_kv_block_bytes(&k->g);
        k->head0 = head0[r], k->heads = heads[r];
        if (!(bes[r]->ops->kv_dtypes >> g->dtype & 1))
            rc = td_error(TD_ERR_UNSUPPORTED, "kv pool: the %s backend does not store KV in %s (model.kv_dtype)",
                          bes[r]->ops->name, td_kv_dtype_name(g->dtype));
        else if (r == 0)
            k->mem = p->mem;
        else if (p->provider.alloc && (rc = p->provider.alloc(p->provider.ctx, k->block_bytes * n_blocks, &k->mem)))
            k->mem = NULL;
        else if (!p->provider.alloc)
            rc = bes[r]->ops->alloc(bes[r], k->block_bytes * n_blocks, &k->mem);
    }
    if (rc) {
        eng_kv_pool_destroy(p);
        return rc;
    }
    p->g = *g; /* the whole block: what its names, the stats and every copy in and out speak of */
    p->block_bytes = td_kv_block_bytes(g);
    *out = p;
    return TD_OK;
}

void eng_kv_pool_destroy(eng_kv_pool_t *p)
{
    if (!p)
        return;
    for (uint32_t r = 1; p->parts && r < p->ranks; r++)
        if (p->parts[r].mem && p->provider.alloc)
            p->provider.free(p->provider.ctx, p->parts[r].mem);
        else if (p->parts[r].mem)
            p->parts[r].be->ops->free(p->parts[r].be, p->parts[r].mem);
    free(p->parts);
    if (p->mem && p->provider.alloc)
        p->provider.free(p->provider.ctx, p->mem);
    else if (p->mem)
        p->be->ops->free(p->be, p->mem);
    free(p->count);
    free(p->named);
    free(p->name);
    free(p->free_stack);
    free(p->lru_prev);
    free(p->lru_next);
    free(p->index);
    free(p);
}

static uint32_t name_slot(const eng_kv_pool_t *p, td_block_name_t n) { return (uint32_t)n.lo & p->index_mask; }

static int32_t *index_find(eng_kv_pool_t *p, td_block_name_t n)
{
    for (uint32_t s = name_slot(p, n), k = 0; k <= p->index_mask; s = (s + 1) & p->index_mask, k++) {
        int32_t b = p->index[s];
        if (b == NAME_EMPTY)
            return NULL;
        if (td_block_name_eq(p->name[b], n))
            return &p->index[s];
    }
    return NULL;
}

static void lru_unlink(eng_kv_pool_t *p, int32_t b)
{
    if (p->lru_prev[b] >= 0)
        p->lru_next[p->lru_prev[b]] = p->lru_next[b];
    else
        p->lru_head = p->lru_next[b];
    if (p->lru_next[b] >= 0)
        p->lru_prev[p->lru_next[b]] = p->lru_prev[b];
    else
        p->lru_tail = p->lru_prev[b];
    p->n_cached--;
}

static void lru_push(eng_kv_pool_t *p, int32_t b)
{
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0)
        p->lru_next[p->lru_tail] = b;
    else
        p->lru_head = b;
    p->lru_tail = b;
    p->n_cached++;
}

static void raise_event(eng_kv_pool_t *p, eng_kv_event_kind_t kind, int32_t b)
{
    p->event_seq++;
    if (p->on_event) {
        eng_kv_event_t ev = {.kind = kind, .seq = p->event_seq, .name = p->name[b], .block = b};
        p->on_event(p->event_ctx, &ev);
    }
}

/* Empties slot i and moves back every later entry of its run that may sit
 * there (its home slot is not cyclically within (i, j]). */
static void index_delete(eng_kv_pool_t *p, uint32_t i)
{
    uint32_t m = p->index_mask;
    for (uint32_t j = (i + 1) & m; p->index[j] != NAME_EMPTY; j = (j + 1) & m) {
        uint32_t home = name_slot(p, p->name[p->index[j]]);
        if (((j - home) & m) >= ((j - i) & m)) {
            p->index[i] = p->index[j];
            i = j;
        }
    }
    p->index[i] = NAME_EMPTY;
}

static void unname(eng_kv_pool_t *p, int32_t b)
{
    int32_t *slot = index_find(p, p->name[b]);
    if (slot)
        index_delete(p, (uint32_t)(slot - p->index));
    p->named[b] = false;
    raise_event(p, ENG_KV_REMOVED, b);
}

td_status_t eng_kv_alloc(eng_kv_pool_t *p, int32_t *block)
{
    int32_t b;
    if (p->n_free) {
        b = p->free_stack[--p->n_free];
    } else if (p->lru_head >= 0) { /* evict the least recently used cached block */
        b = p->lru_head;
        lru_unlink(p, b);
        unname(p, b);
    } else {
        return TD_ERR_NO_MEMORY;
    }
    p->count[b] = 1;
    *block = b;
    return TD_OK;
}

void eng_kv_ref(eng_kv_pool_t *p, int32_t b)
{
    if (p->count[b]++ == 0 && p->named[b])
        lru_unlink(p, b);
}

void eng_kv_unref(eng_kv_pool_t *p, int32_t b)
{
    if (--p->count[b] > 0)
        return;
    if (p->named[b])
        lru_push(p, b);
    else
        p->free_stack[p->n_free++] = b;
}

int32_t eng_kv_publish(eng_kv_pool_t *p, int32_t b, td_block_name_t n)
{
    int32_t *slot = index_find(p, n);
    if (slot)
        return *slot;
    if (p->named[b])
        unname(p, b);
    uint32_t s = name_slot(p, n);
    while (p->index[s] != NAME_EMPTY)
        s = (s + 1) & p->index_mask;
    p->index[s] = b;
    p->name[b] = n;
    p->named[b] = true;
    raise_event(p, ENG_KV_STORED, b);
    return b;
}

void eng_kv_set_listener(eng_kv_pool_t *p, eng_kv_event_fn fn, void *ctx)
{
    p->on_event = fn;
    p->event_ctx = ctx;
}

uint64_t eng_kv_snapshot(const eng_kv_pool_t *p, void (*fn)(void *ctx, td_block_name_t name, int32_t block),
                         void *ctx)
{
    for (uint32_t b = 0; b < p->n_blocks; b++)
        if (p->named[b])
            fn(ctx, p->name[b], (int32_t)b);
    return p->event_seq;
}

uint32_t eng_kv_index_longest_run(const eng_kv_pool_t *p)
{
    uint32_t best = 0, run = 0, cap = p->index_mask + 1;
    /* start after an empty slot so that a run across the end is counted whole */
    uint32_t start = 0;
    while (start < cap && p->index[start] != NAME_EMPTY)
        start++;
    for (uint32_t k = 1; k <= cap; k++) {
        uint32_t s = (start + k) & p->index_mask;
        run = p->index[s] == NAME_EMPTY ? 0 : run + 1;
        best = run > best ? run : best;
    }
    return best;
}

int32_t eng_kv_lookup(eng_kv_pool_t *p, td_block_name_t n)
{
    int32_t *slot = index_find(p, n);
    if (!slot)
        return -1;
    eng_kv_ref(p, *slot);
    return *slot;
}

bool eng_kv_holds(eng_kv_pool_t *p, td_block_name_t n)
{
    return index_find(p, n) != NULL;
}

kern_kv_view_t eng_kv_view(const eng_kv_pool_t *p, uint32_t layer)
{
    return eng_kv_view_rank(p, 0, layer);
}

kern_kv_view_t eng_kv_view_rank(const eng_kv_pool_t *p, uint32_t rank, uint32_t layer)
{
    if (p->parts)
        return (kern_kv_view_t){.base = p->parts[rank].mem, .layout = &p->parts[rank].g,
                                .block_bytes = p->parts[rank].block_bytes, .layer = layer};
    return (kern_kv_view_t){.base = p->mem, .layout = &p->g, .block_bytes = p->block_bytes, .layer = layer};
}

uint32_t eng_kv_ranks(const eng_kv_pool_t *p) { return p->ranks; }

void eng_kv_part_heads(const eng_kv_pool_t *p, uint32_t rank, uint32_t *head0, uint32_t *heads)
{
    *head0 = p->parts ? p->parts[rank].head0 : 0;
    *heads = p->parts ? p->parts[rank].heads : p->g.n_kv_heads;
}

/* Copies n blocks between the pool and host memory of whole blocks back to back (out: to host). A pool of parts
 * copies each rank's runs (a replicated KV head is written out by each of its ranks, the same bytes, and read in
 * by each). */
static td_status_t kv_copy(const eng_kv_pool_t *p, const int32_t *blocks, uint32_t n, uint8_t *host, bool out)
{
    td_status_t rc = TD_OK;
    if (!p->parts) {
        for (uint32_t i = 0; i < n && !rc; i++) {
            uint8_t *dev = (uint8_t *)p->mem + (size_t)blocks[i] * p->block_bytes, *h = host + (size_t)i * p->block_bytes;
            rc = out ? p->be->ops->download(p->be, h, dev, p->block_bytes)
                     : p->be->ops->upload(p->be, dev, h, p->block_bytes);
        }
        return rc;
    }
    const uint32_t nr = td_kv_part_n_runs(&p->g);
    for (uint32_t r = 0; r < p->ranks && !rc; r++) {
        const kv_part_t *k = &p->parts[r];
        for (uint32_t i = 0; i < n && !rc; i++)
            for (uint32_t j = 0; j < nr && !rc; j++) {
                const td_kv_run_t run = td_kv_part_run(&p->g, k->head0, k->heads, j);
                uint8_t *dev = (uint8_t *)k->mem + (size_t)blocks[i] * k->block_bytes + run.part_off;
                uint8_t *h = host + (size_t)i * p->block_bytes + run.block_off;
                rc = out ? k->be->ops->download(k->be, h, dev, run.bytes) : k->be->ops->upload(k->be, dev, h, run.bytes);
            }
        if (!rc)
            rc = k->be->ops->sync(k->be);
    }
    return rc;
}

uint32_t eng_kv_layer_pieces(const eng_kv_pool_t *p, int32_t block, uint32_t layer, eng_kv_piece_t *out)
{
    const size_t lb = p->block_bytes / p->g.n_layers;
    if (!p->parts) {
        out[0] = (eng_kv_piece_t){(const uint8_t *)p->mem + (size_t)block * p->block_bytes + layer * lb, lb, layer * lb};
        return 1;
    }
    const uint32_t per = td_kv_part_n_runs(&p->g) / p->g.n_layers;
    uint32_t n = 0;
    for (uint32_t r = 0; r < p->ranks && r < 16; r++) {
        const kv_part_t *k = &p->parts[r];
        if (r && k->head0 == p->parts[r - 1].head0) /* a replica of the rank before's heads */
            continue;
        for (uint32_t i = layer * per; i < (layer + 1) * per; i++) {
            const td_kv_run_t run = td_kv_part_run(&p->g, k->head0, k->heads, i);
            out[n++] = (eng_kv_piece_t){(const uint8_t *)k->mem + (size_t)block * k->block_bytes + run.part_off,
                                        run.bytes, run.block_off};
        }
    }
    return n;
}

td_status_t eng_kv_download(const eng_kv_pool_t *p, const int32_t *blocks, uint32_t n, void *dst)
{
    return kv_copy(p, blocks, n, dst, true);
}

td_status_t eng_kv_upload(eng_kv_pool_t *p, const int32_t *blocks, uint32_t n, const void *src)
{
    return kv_copy(p, blocks, n, (uint8_t *)(uintptr_t)src, false);
}

const td_kv_layout_t *eng_kv_layout(const eng_kv_pool_t *p)
{
    return &p->g;
}

eng_kv_stats_t eng_kv_stats(const eng_kv_pool_t *p)
{
    return (eng_kv_stats_t){.n_blocks = p->n_blocks, .in_use = p->n_blocks - p->n_free - p->n_cached,
                            .cached = p->n_cached, .free = p->n_free, .block_bytes = p->block_bytes,
                            .bytes_per_token = p->block_bytes / p->g.block_tokens};
}
