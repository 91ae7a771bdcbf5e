/* shard.c — see shard.h. */
#include "engine/shard.h"

#include "common/log.h"

eng_shard_t eng_shard_whole(const eng_model_desc_t *d)
{
    return (eng_shard_t){.tp = 1, .q_heads = d->n_heads, .kv_heads = d->n_kv_heads, .ffn = d->ffn, .vocab = d->vocab};
}

td_status_t eng_shard_plan(const eng_model_desc_t *d, uint32_t tp, uint32_t rank, uint32_t block_elems,
                           eng_shard_t *out)
{
    if (!tp || rank >= tp)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: no rank %u", tp, rank);
    if (!d->n_kv_heads || d->n_heads % d->n_kv_heads)
        return td_error(TD_ERR_INVALID_ARG, "%s: %u attention heads over %u KV heads", d->name, d->n_heads,
                        d->n_kv_heads);
    if (d->n_heads % tp)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: %s's %u attention heads do not divide over %u ranks", tp, d->name,
                        d->n_heads, tp);
    if (d->n_kv_heads % tp && tp % d->n_kv_heads)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: %s's %u KV heads neither divide over %u ranks nor are replicated "
                        "evenly over them", tp, d->name, d->n_kv_heads, tp);
    if (d->ffn % tp)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: %s's FFN of %u columns does not divide over %u ranks", tp, d->name,
                        d->ffn, tp);
    const uint32_t q = d->n_heads / tp, f = d->ffn / tp, be = block_elems ? block_elems : 1;
    if ((q * d->head_dim) % be || f % be)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: %s's split columns (%u of the attention output, %u of the FFN) "
                        "are not whole quantization blocks of %u values", tp, d->name, q * d->head_dim, f, be);
    eng_shard_t s = {.tp = tp, .rank = rank, .q_head0 = rank * q, .q_heads = q, .ffn0 = rank * f, .ffn = f};
    if (d->n_kv_heads >= tp)
        s.kv_heads = d->n_kv_heads / tp, s.kv_head0 = rank * s.kv_heads;
    else /* replicated: the KV head of this rank's query heads */
        s.kv_heads = 1, s.kv_head0 = rank / (tp / d->n_kv_heads);
    s.vocab = eng_shard_vocab(d->vocab, tp, rank, &s.vocab0);
    *out = s;
    return TD_OK;
}

uint32_t eng_shard_vocab(uint32_t vocab, uint32_t tp, uint32_t rank, uint32_t *vocab0)
{
    const uint32_t v = (vocab + tp - 1) / tp;
    *vocab0 = rank * v < vocab ? rank * v : vocab;
    return vocab - *vocab0 < v ? vocab - *vocab0 : v;
}

eng_model_desc_t eng_shard_desc(const eng_model_desc_t *d, const eng_shard_t *s)
{
    eng_model_desc_t r = *d;
    r.n_heads = s->q_heads, r.n_kv_heads = s->kv_heads, r.ffn = s->ffn, r.vocab = s->vocab;
    return r;
}
