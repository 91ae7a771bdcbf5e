/* swap.c — see swap.h. */
#include "engine/swap.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

void eng_swap_init(eng_swap_t *sw, kern_backend_t *be, size_t cap)
{
    *sw = (eng_swap_t){.be = be, .cap = cap, .s_per_byte = 2 / 2e9};
}

void eng_swap_destroy(eng_swap_t *sw)
{
    if (sw->arena)
        sw->be->ops->host_free(sw->be, sw->arena);
    free(sw->held);
    memset(sw, 0, sizeof *sw);
}

bool eng_swap_worth(const eng_swap_t *sw, size_t bytes, double recompute_s)
{
    if (!sw->cap || sw->none || !bytes || sw->used + bytes > sw->cap)
        return false;
    return recompute_s <= 0 || (double)bytes * sw->s_per_byte < recompute_s;
}

uint8_t *eng_swap_take(eng_swap_t *sw, size_t bytes)
{
    if (!sw->arena && !sw->none && sw->cap) {
        if (sw->be->ops->host_alloc(sw->be, sw->cap, (void **)&sw->arena)) {
            sw->arena = NULL;
            sw->none = true;
            TD_WARN("engine: no %zu bytes of host memory for the swap space (%s); preempted sequences are computed "
                    "again", sw->cap, td_last_error());
        }
    }
    if (!sw->arena || !bytes || bytes > sw->cap)
        return NULL;
    /* the first gap: before region i, or after the last */
    size_t at = 0;
    uint32_t i = 0;
    for (; i < sw->n_held && at + bytes > sw->held[i].at; i++)
        at = sw->held[i].at + sw->held[i].bytes;
    if (at + bytes > sw->cap)
        return NULL;
    if (sw->n_held == sw->cap_held) {
        uint32_t cap = sw->cap_held ? 2 * sw->cap_held : 16;
        eng_swap_region_t *h = realloc(sw->held, cap * sizeof *h);
        if (!h)
            return NULL;
        sw->held = h, sw->cap_held = cap;
    }
    memmove(&sw->held[i + 1], &sw->held[i], (sw->n_held - i) * sizeof *sw->held);
    sw->held[i] = (eng_swap_region_t){at, bytes};
    sw->n_held++;
    sw->used += bytes;
    return sw->arena + at;
}

void eng_swap_give(eng_swap_t *sw, const uint8_t *r)
{
    if (!r || !sw->arena)
        return;
    const size_t at = (size_t)(r - sw->arena);
    for (uint32_t i = 0; i < sw->n_held; i++)
        if (sw->held[i].at == at) {
            sw->used -= sw->held[i].bytes;
            memmove(&sw->held[i], &sw->held[i + 1], (sw->n_held - i - 1) * sizeof *sw->held);
            sw->n_held--;
            return;
        }
}

void eng_swap_timed(eng_swap_t *sw, size_t bytes, double secs)
{
    if (bytes)
        sw->s_per_byte = 0.8 * sw->s_per_byte + 0.2 * 2 * secs / (double)bytes;
}
