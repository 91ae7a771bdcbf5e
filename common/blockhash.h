/* blockhash.h — block names: the XXH3-128 chain of DESIGN.md §3.
 *
 *   h_0 = H("tandem-kv-v1" 0x00 model_id 0x00 kv_dtype 0x00 u32le(block_tokens))
 *   h_i = H(h_{i-1} as lo64le || hi64le,  tokens of block i as u32le each)
 *
 * Equal names mean equal prefixes (under one model, dtype and block size), so
 * equal KV. Only full blocks are named; a partial last block has no name. */
#ifndef TD_BLOCKHASH_H
#define TD_BLOCKHASH_H

#include <stddef.h>
#include <stdint.h>

typedef struct td_block_name {
    uint64_t lo, hi;
} td_block_name_t;

td_block_name_t td_block_name_root(const char *model_id, const char *kv_dtype, uint32_t block_tokens);
td_block_name_t td_block_name_next(td_block_name_t prev, const int32_t *tokens, uint32_t block_tokens);
/* Names every full block of tokens[0..n) into out (at most cap); returns how
 * many full blocks there are (which may exceed cap). */
size_t td_block_name_chain(td_block_name_t root, const int32_t *tokens, size_t n, uint32_t block_tokens,
                           td_block_name_t *out, size_t cap);
/* 32 lower-case hex digits, hi then lo, NUL-terminated. */
void td_block_name_hex(td_block_name_t name, char buf[33]);

static inline int td_block_name_eq(td_block_name_t a, td_block_name_t b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

#endif
