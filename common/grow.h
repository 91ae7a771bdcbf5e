/* grow.h — growing a heap array to hold `need` elements: capacity doubles
 * from `first`, so a buffer reused across messages or steps stops
 * allocating once it is large enough. False (nothing changed) without memory. */
#ifndef TD_GROW_H
#define TD_GROW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>

static inline bool td_grow(void **p, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (*p && need <= *cap)
        return true;
    size_t nc = *cap ? *cap : first;
    while (nc < need)
        nc *= 2;
    void *np = realloc(*p, nc * elem);
    if (!np)
        return false;
    *p = np;
    *cap = nc;
    return true;
}

#endif
