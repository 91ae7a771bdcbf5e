/* repack_int.h — what the AVX2 and the VNNI tiles of the repacked matmul
 * share (repack.h): reading activation-block fields, broadcasting 4 activation
 * bytes, the prefetch distance, and the loop that walks row groups and token
 * groups over a tile function. Included only by files compiled for AVX2. */
#ifndef KERN_CPU_REPACK_INT_H
#define KERN_CPU_REPACK_INT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/repack.h"

/* Bytes ahead of the block being read that a block's loop asks the cache for:
 * the weights stream from memory once per decode step. */
#define PREFETCH_AHEAD 4096

static inline __m256i bcast4(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline float rdf(const uint8_t *p) /* an fp16 field */
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline int32_t rdi(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Token groups of 4, then the rest, each with its own unrolled tile. */
#define GEMM_BODY(TILE, GB)                                                                                   \
    const uint8_t *W = wr, *X = xq;                                                                        \
    uint32_t nb = cols / 32;                                                                               \
    for (uint32_t g = g0; g < g1; g++) {                                                                   \
        const uint8_t *blk = W + (size_t)g * nb * (GB);                                                    \
        uint32_t t0 = 0;                                                                                   \
        for (; t0 + 4 <= n; t0 += 4)                                                                       \
            TILE(blk, nb, X + (size_t)t0 * xq_stride, xq_stride, 4, y + (size_t)t0 * rows + 8 * g, rows);  \
        const uint8_t *xr = X + (size_t)t0 * xq_stride;                                                    \
        float *yr = y + (size_t)t0 * rows + 8 * g;                                                         \
        switch (n - t0) {                                                                                  \
        case 3: TILE(blk, nb, xr, xq_stride, 3, yr, rows); break;                                          \
        case 2: TILE(blk, nb, xr, xq_stride, 2, yr, rows); break;                                          \
        case 1: TILE(blk, nb, xr, xq_stride, 1, yr, rows); break;                                          \
        default: break;                                                                                    \
        }                                                                                                  \
    }

#endif
