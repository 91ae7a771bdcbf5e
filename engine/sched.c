/* sched.c — the prompt orders (sched.h): a table of comparisons, and one
 * stable merge sort that applies them.
 *
 * An order compares two prompts and says which goes first, or that they are
 * equal; equals keep arrival order. fcfs has no comparison: the engine's
 * list is already in its order. The sort is bottom-up over the caller's
 * index arrays, so a step allocates nothing. */
#include "engine/sched.h"

#include <string.h>

typedef int (*order_cmp_fn)(const eng_sched_config_t *c, const eng_sched_item_t *a, const eng_sched_item_t *b);

static int cache_cmp(const eng_sched_config_t *c, const eng_sched_item_t *a, const eng_sched_item_t *b)
{
    (void)c;
    if (a->started != b->started) /* the prompt under way finishes first: its blocks are published sooner */
        return a->started ? -1 : 1;
    return a->cached > b->cached ? -1 : a->cached < b->cached;
}

static int mlq_cmp(const eng_sched_config_t *c, const eng_sched_item_t *a, const eng_sched_item_t *b)
{
    uint32_t la = eng_sched_level(c, a->entry, a->served), lb = eng_sched_level(c, b->entry, b->served);
    return la < lb ? -1 : la > lb;
}

/* mlq: a step holding a prompt of one level takes none of a higher level */
static bool mlq_joins(const eng_sched_config_t *c, const eng_sched_item_t *first, const eng_sched_item_t *it)
{
    return eng_sched_level(c, it->entry, it->served) <= eng_sched_level(c, first->entry, first->served);
}

static const struct {
    const char *name;
    order_cmp_fn cmp; /* NULL: arrival order */
    /* whether it may share a step whose first prompt is first (NULL: any may) */
    bool (*joins)(const eng_sched_config_t *c, const eng_sched_item_t *first, const eng_sched_item_t *it);
    bool waits_for_shared; /* a prompt waits for a block another prompt is computing */
} orders[ENG_ORDER_COUNT] = {
    [ENG_ORDER_FCFS] = {.name = "fcfs"},
    [ENG_ORDER_CACHE] = {.name = "cache", .cmp = cache_cmp, .waits_for_shared = true},
    [ENG_ORDER_MLQ] = {.name = "mlq", .cmp = mlq_cmp, .joins = mlq_joins},
};

bool eng_sched_aged(const eng_sched_config_t *c, const eng_sched_item_t *it, double now)
{
    return c->age_s > 0 && now - it->arrived > c->age_s;
}

bool eng_sched_joins(const eng_sched_config_t *c, const eng_sched_item_t *first, const eng_sched_item_t *it,
                     double now)
{
    return c->order >= ENG_ORDER_COUNT || !orders[c->order].joins || eng_sched_aged(c, it, now) ||
           orders[c->order].joins(c, first, it);
}

bool eng_sched_waits_for_shared(const eng_sched_config_t *c)
{
    return c->order < ENG_ORDER_COUNT && orders[c->order].waits_for_shared;
}

eng_sched_config_t eng_sched_config_default(void)
{
    return (eng_sched_config_t){.order = ENG_ORDER_FCFS, .levels = 4, .quantum = 256, .age_s = 10};
}

const char *eng_order_name(eng_order_t o) { return o < ENG_ORDER_COUNT ? orders[o].name : "?"; }

bool eng_order_parse(const char *s, eng_order_t *out)
{
    for (int i = 0; s && i < ENG_ORDER_COUNT; i++)
        if (!strcmp(s, orders[i].name)) {
            *out = (eng_order_t)i;
            return true;
        }
    return false;
}

uint32_t eng_sched_level(const eng_sched_config_t *c, uint32_t entry, uint32_t served)
{
    uint32_t top = c->levels ? c->levels - 1 : 0, q = c->quantum ? c->quantum : 1, l = 0;
    while (l < top && ((uint64_t)q << l) < entry) /* skip-join: the first level whose quantum holds it */
        l++;
    uint64_t left = served;
    while (l < top && left >= ((uint64_t)q << l)) { /* each quantum used up drops it one level */
        left -= (uint64_t)q << l;
        l++;
    }
    return l;
}

/* a before b (< 0), after (> 0), or equal: priority, then the age bound, then the order's own */
static int compare(const eng_sched_config_t *c, order_cmp_fn cmp, const eng_sched_item_t *a,
                   const eng_sched_item_t *b, double now)
{
    if (a->priority != b->priority)
        return a->priority > b->priority ? -1 : 1;
    bool oa = eng_sched_aged(c, a, now), ob = eng_sched_aged(c, b, now);
    if (oa != ob)
        return oa ? -1 : 1;
    if (oa) /* both past the bound: arrival order */
        return 0;
    return cmp(c, a, b);
}

void eng_sched_order(const eng_sched_config_t *c, const eng_sched_item_t *items, uint32_t n, double now, uint32_t *idx,
                     uint32_t *scratch)
{
    for (uint32_t i = 0; i < n; i++)
        idx[i] = i;
    order_cmp_fn cmp = c->order < ENG_ORDER_COUNT ? orders[c->order].cmp : NULL;
    if (!cmp)
        return;
    uint32_t *from = idx, *to = scratch;
    for (uint32_t w = 1; w < n; w *= 2) {
        for (uint32_t lo = 0; lo < n; lo += 2 * w) {
            uint32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            uint32_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) /* ties take the left run's: stable */
                to[k++] = compare(c, cmp, &items[from[j]], &items[from[i]], now) < 0 ? from[j++] : from[i++];
            while (i < mid)
                to[k++] = from[i++];
            while (j < hi)
                to[k++] = from[j++];
        }
        uint32_t *t = from;
        from = to;
        to = t;
    }
    if (from != idx)
        memcpy(idx, from, n * sizeof *idx);
}
