/* swap.h — the engine's swap space (eng_engine_config_t.swap_bytes): host
 * memory holding preempted sequences' KV until the pool has room for them
 * again. The space is the backend's host memory (page-locked on a GPU, an
 * allocation that stalls every stream), taken whole at the first swap-out and
 * kept, so that a preemption allocates nothing; its regions are handed out
 * first fit and given back. The measured speed of a copy decides whether a
 * sequence is swapped or computed again. Internal to the engine. */
#ifndef ENG_SWAP_H
#define ENG_SWAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

typedef struct eng_swap_region {
    size_t at, bytes;
} eng_swap_region_t;

typedef struct eng_swap {
    kern_backend_t *be;
    size_t cap;              /* bytes (0: no swapping) */
    uint8_t *arena;          /* the space (NULL until the first take) */
    bool none;               /* the space could not be had: nothing is swapped */
    size_t used;             /* bytes in the regions handed out */
    double s_per_byte;       /* seconds a byte's round trip takes, smoothed (first guess: 2 GB/s each way) */
    uint64_t outs, ins;      /* sequences swapped out, and back */
    eng_swap_region_t *held; /* the regions handed out, by offset */
    uint32_t n_held, cap_held;
} eng_swap_t;

void eng_swap_init(eng_swap_t *sw, kern_backend_t *be, size_t cap);
void eng_swap_destroy(eng_swap_t *sw);
/* Whether bytes of KV are better swapped out than computed again in
 * recompute_s seconds (0: not measured yet: swapped): room left under cap,
 * and the copy out and back predicted to take less. */
bool eng_swap_worth(const eng_swap_t *sw, size_t bytes, double recompute_s);
/* A region of bytes: the first gap among those handed out that holds it (the
 * space taken at the first call; no memory for it: a warning, and no
 * swapping from then on); NULL: none. */
uint8_t *eng_swap_take(eng_swap_t *sw, size_t bytes);
/* Region r (eng_swap_take's) free again. */
void eng_swap_give(eng_swap_t *sw, const uint8_t *r);
/* A copy of bytes one way took secs: the round trip's speed, smoothed. */
void eng_swap_timed(eng_swap_t *sw, size_t bytes, double secs);

#endif
