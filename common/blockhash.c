/* blockhash.c — see blockhash.h. Inputs are serialized little endian so that
 * names agree across hosts. */
#include "common/blockhash.h"

#include <stdio.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

static void put_u32le(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

static void put_u64le(uint8_t *p, uint64_t v)
{
    put_u32le(p, (uint32_t)v);
    put_u32le(p + 4, (uint32_t)(v >> 32));
}

static td_block_name_t from_xxh(XXH128_hash_t h)
{
    return (td_block_name_t){.lo = h.low64, .hi = h.high64};
}

td_block_name_t td_block_name_root(const char *model_id, const char *kv_dtype, uint32_t block_tokens)
{
    XXH3_state_t st;
    static const char tag[] = "tandem-kv-v1";
    uint8_t zero = 0, bt[4];
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, tag, sizeof tag - 1);
    XXH3_128bits_update(&st, &zero, 1);
    XXH3_128bits_update(&st, model_id, strlen(model_id));
    XXH3_128bits_update(&st, &zero, 1);
    XXH3_128bits_update(&st, kv_dtype, strlen(kv_dtype));
    XXH3_128bits_update(&st, &zero, 1);
    put_u32le(bt, block_tokens);
    XXH3_128bits_update(&st, bt, 4);
    return from_xxh(XXH3_128bits_digest(&st));
}

td_block_name_t td_block_name_next(td_block_name_t prev, const int32_t *tokens, uint32_t block_tokens)
{
    XXH3_state_t st;
    uint8_t buf[16 + 4 * 64];
    XXH3_128bits_reset(&st);
    put_u64le(buf, prev.lo);
    put_u64le(buf + 8, prev.hi);
    XXH3_128bits_update(&st, buf, 16);
    for (uint32_t i = 0; i < block_tokens;) {
        uint32_t k = 0;
        for (; k < 64 && i < block_tokens; k++, i++)
            put_u32le(buf + 4 * k, (uint32_t)tokens[i]);
        XXH3_128bits_update(&st, buf, 4 * k);
    }
    return from_xxh(XXH3_128bits_digest(&st));
}

size_t td_block_name_chain(td_block_name_t root, const int32_t *tokens, size_t n, uint32_t block_tokens,
                           td_block_name_t *out, size_t cap)
{
    size_t full = block_tokens ? n / block_tokens : 0;
    td_block_name_t h = root;
    for (size_t b = 0; b < full && b < cap; b++) {
        h = td_block_name_next(h, tokens + b * block_tokens, block_tokens);
        out[b] = h;
    }
    return full;
}

void td_block_name_hex(td_block_name_t name, char buf[33])
{
    snprintf(buf, 33, "%016llx%016llx", (unsigned long long)name.hi, (unsigned long long)name.lo);
}
