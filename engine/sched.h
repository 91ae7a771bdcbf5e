/* sched.h — the order in which an engine computes its waiting prompts.
 *
 * Each step the engine fills its token budget with one token per running
 * sequence, then with chunks of the prompts still to compute. Which prompts
 * come first is this table's choice:
 *   fcfs   arrival order (a higher priority inserted ahead of lower ones not
 *          yet begun) — what the engine always did;
 *   cache  the prompt under way first, then the longest run of cached prefix
 *          blocks (SGLang's longest-prefix-match): a hot prefix is reused
 *          before it is evicted; and a prompt whose next uncached block
 *          another prompt is computing right now waits for it to be
 *          published instead of computing it a second time;
 *   mlq    skip-join multi-level feedback (FastServe): a prompt enters the
 *          first level whose quantum (quantum << level tokens) holds the
 *          tokens it has to compute, and drops a level each time it has used
 *          its level's quantum; lower levels first, arrival order within
 *          one. Short prompts pass long ones already under way, and a step
 *          that computes a prompt of one level takes no chunk of a higher
 *          level beside it: the short prompt's step stays short.
 * In every order a higher priority goes first, and a prompt that has waited
 * past the age bound goes before those that have not (in arrival order), so
 * nothing starves. Decode tokens of running sequences are not ordered here:
 * every running sequence gets its token each step. */
#ifndef ENG_SCHED_H
#define ENG_SCHED_H

#include <stdbool.h>
#include <stdint.h>

typedef enum eng_order { ENG_ORDER_FCFS, ENG_ORDER_CACHE, ENG_ORDER_MLQ, ENG_ORDER_COUNT } eng_order_t;

typedef struct eng_sched_config {
    eng_order_t order;
    uint32_t levels;  /* mlq: queue levels, 1..16 (4) */
    uint32_t quantum; /* mlq: level 0's quantum in tokens computed; level i's is quantum << i (256) */
    double age_s;     /* a prompt waiting longer than this goes first (10 s; 0: no bound) */
} eng_sched_config_t;

eng_sched_config_t eng_sched_config_default(void);
const char *eng_order_name(eng_order_t o);
/* "fcfs", "cache" or "mlq"; false for anything else. */
bool eng_order_parse(const char *s, eng_order_t *out);

/* A prompt still to compute, as the orders see it. */
typedef struct eng_sched_item {
    int32_t priority;
    double arrived;  /* td_now_s() when it was added */
    bool started;    /* part of it is computed (a chunk ran, or its prefix came from the cache) */
    uint32_t cached; /* cache: prefix blocks the pool holds for it now (a started prompt: 0) */
    uint32_t entry;  /* mlq: tokens it had to compute when first seen */
    uint32_t served; /* mlq: tokens computed for it since */
} eng_sched_item_t;

/* The level an mlq prompt is at: the first whose quantum holds entry, less
 * the quanta served has used up, at most levels - 1. */
uint32_t eng_sched_level(const eng_sched_config_t *c, uint32_t entry, uint32_t served);

/* Whether it has waited past the age bound at now. */
bool eng_sched_aged(const eng_sched_config_t *c, const eng_sched_item_t *it, double now);
/* Whether it may share a step whose first prompt is first: mlq takes no
 * prompt of a higher level beside one of a lower (a short prompt's step stays
 * short); a prompt past the age bound always may. */
bool eng_sched_joins(const eng_sched_config_t *c, const eng_sched_item_t *first, const eng_sched_item_t *it,
                     double now);
/* Whether a prompt not begun waits while another prompt computes the block it
 * would compute next (the cache order: it takes the block once published). */
bool eng_sched_waits_for_shared(const eng_sched_config_t *c);

/* Puts the indices 0 .. n - 1 of items (given in arrival order) into idx in
 * the order their chunks are taken at time now. scratch holds n indices.
 * Stable: equals keep arrival order. Allocates nothing. */
void eng_sched_order(const eng_sched_config_t *c, const eng_sched_item_t *items, uint32_t n, double now, uint32_t *idx,
                     uint32_t *scratch);

#endif
