/* rng.h — the one seeded random generator (xoshiro256**, seeded through
 * splitmix64): same seed, same sequence, on every host. The sampler draws from
 * it, and bench workloads are built with it. Header-only: a few cycles a draw. */
#ifndef TD_RNG_H
#define TD_RNG_H

#include <stdint.h>

typedef struct td_rng {
    uint64_t s[4];
} td_rng_t;

static inline uint64_t td_rng_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline void td_rng_seed(td_rng_t *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) {
        uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        r->s[i] = z ^ (z >> 31);
    }
}

static inline uint64_t td_rng_u64(td_rng_t *r)
{
    uint64_t *s = r->s, res = td_rng_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0], s[3] ^= s[1], s[1] ^= s[2], s[0] ^= s[3], s[2] ^= t, s[3] = td_rng_rotl(s[3], 45);
    return res;
}

/* Uniform in [0, 1), 53 bits. */
static inline double td_rng_unit(td_rng_t *r) { return (double)(td_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

#endif
