/* test_blockhash.c — block names (DESIGN.md §3). The pinned values were
 * computed with the Python `xxhash` package (xxh3_128_intdigest) over the
 * byte layout block_hash.h documents:
 *   h0 = xxh3_128(b"tandem-kv-v1\0SmolLM2-135M-Instruct\0fp16\0" + u32le(16))
 *   h1 = xxh3_128(u64le(h0.lo) + u64le(h0.hi) + u32le(100..115)) */
#include "tests/unit/helpers.h"

#include "common/blockhash.h"

Test(blockhash, matches_python_xxhash)
{
    char hex[33];
    td_block_name_t h0 = td_block_name_root("SmolLM2-135M-Instruct", "fp16", 16);
    td_block_name_hex(h0, hex);
    cr_assert_str_eq(hex, "12dadc567582d11979b6ac7dad05f178");
    int32_t toks[16];
    for (int i = 0; i < 16; i++)
        toks[i] = 100 + i;
    td_block_name_t h1 = td_block_name_next(h0, toks, 16);
    td_block_name_hex(h1, hex);
    cr_assert_str_eq(hex, "b7ced48ca2087399c2611f9db35f8e74");
}

Test(blockhash, chain_names_full_blocks_and_prefixes)
{
    int32_t a[40], b[40];
    for (int i = 0; i < 40; i++)
        a[i] = b[i] = i * 7;
    b[20] = 999; /* differs in block 1 (tokens 16..31) */
    td_block_name_t root = td_block_name_root("m", "fp16", 16), na[4], nb[4];
    cr_assert_eq(td_block_name_chain(root, a, 40, 16, na, 4), 2, "40 tokens: 2 full blocks, no name for the rest");
    cr_assert_eq(td_block_name_chain(root, b, 40, 16, nb, 4), 2);
    cr_assert(td_block_name_eq(na[0], nb[0]), "equal prefixes, equal names");
    cr_assert(!td_block_name_eq(na[1], nb[1]));
    /* a name depends on everything before it */
    b[20] = a[20];
    b[3] = 1;
    td_block_name_chain(root, b, 40, 16, nb, 4);
    cr_assert(!td_block_name_eq(na[1], nb[1]), "a change in block 0 renames block 1");
    /* and on the model, dtype and block size */
    cr_assert(!td_block_name_eq(root, td_block_name_root("m", "fp32", 16)));
    cr_assert(!td_block_name_eq(root, td_block_name_root("m", "fp16", 32)));
    cr_assert(!td_block_name_eq(root, td_block_name_root("m2", "fp16", 16)));
}
