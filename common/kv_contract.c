/* kv_contract.c — see kv_contract.h. */
#include "common/kv_contract.h"

#include <string.h>
#include <xxhash.h>

#include "common/log.h"

static td_status_t differ_u(const char *field, uint32_t a, uint32_t b, const char *peer)
{
    return td_error(TD_ERR_CONFIG, "KV contract mismatch with %s: %s: here %u, peer %u", peer, field, a, b);
}

static td_status_t differ_s(const char *field, const char *a, const char *b, const char *peer)
{
    return td_error(TD_ERR_CONFIG, "KV contract mismatch with %s: %s: here '%s', peer '%s'", peer, field, a, b);
}

td_status_t td_kv_contract_check(const td_kv_contract_t *a, const td_kv_contract_t *b, const char *peer)
{
    if (a->layout_version != b->layout_version)
        return differ_u("layout_version", a->layout_version, b->layout_version, peer);
    if (strncmp(a->dtype, b->dtype, sizeof a->dtype))
        return differ_s("dtype", a->dtype, b->dtype, peer);
    if (a->block_tokens != b->block_tokens)
        return differ_u("block_tokens", a->block_tokens, b->block_tokens, peer);
    if (strncmp(a->hash_scheme, b->hash_scheme, sizeof a->hash_scheme))
        return differ_s("hash_scheme", a->hash_scheme, b->hash_scheme, peer);
    if (strncmp(a->model_id, b->model_id, sizeof a->model_id))
        return differ_s("model_id", a->model_id, b->model_id, peer);
    if (a->n_layers != b->n_layers)
        return differ_u("n_layers", a->n_layers, b->n_layers, peer);
    if (a->n_kv_heads != b->n_kv_heads)
        return differ_u("n_kv_heads", a->n_kv_heads, b->n_kv_heads, peer);
    if (a->head_dim != b->head_dim)
        return differ_u("head_dim", a->head_dim, b->head_dim, peer);
    return TD_OK;
}

size_t td_kv_contract_block_bytes(const td_kv_contract_t *c)
{
    return (size_t)c->n_layers * 2 * c->n_kv_heads * c->block_tokens * c->head_dim * (!strcmp(c->dtype, "fp16") ? 2 : 4);
}

uint64_t td_kv_block_digest(const void *block, size_t block_bytes)
{
    return XXH3_64bits(block, block_bytes);
}
