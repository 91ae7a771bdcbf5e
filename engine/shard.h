/* shard.h — tensor parallelism's split of a model over tp ranks (Megatron's):
 * Q, K and V by output rows (whole heads) and O by input columns; gate and up
 * by output rows and down by input columns; the output matrix by vocabulary
 * rows. Each rank's attention is its heads' alone; after O and after down
 * the ranks' partial sums are added (an all-reduce), after the output matrix
 * their logits are put side by side (engine/tp.h runs the ranks). A model with
 * fewer KV heads than ranks gives each rank one KV head, replicated over the
 * ranks whose query heads use it, as vLLM and SGLang do.
 *
 * The embedding stays whole on every rank (a vocabulary of 128k rows at a
 * hidden of 8k is 2 GB in fp16: a rank's memory holds it; splitting it saves
 * that and costs an all-reduce a step). */
#ifndef ENG_SHARD_H
#define ENG_SHARD_H

#include <stdint.h>

#include "common/status.h"
#include "engine/model.h"

typedef struct eng_shard {
    uint32_t tp, rank;
    uint32_t q_head0, q_heads;   /* query heads [q_head0, q_head0 + q_heads) */
    uint32_t kv_head0, kv_heads; /* the KV heads those use */
    uint32_t ffn0, ffn;          /* columns of the FFN */
    uint32_t vocab0, vocab;      /* rows of the output matrix: ceil(vocab / tp) each, the last the rest */
} eng_shard_t;

/* The whole model as rank 0 of 1. */
eng_shard_t eng_shard_whole(const eng_model_desc_t *d);

/* Rank `rank`'s part of d at tp ranks. A split the model's shape does not
 * allow is TD_ERR_INVALID_ARG naming the numbers ("tp 2: 9 attention heads
 * do not divide"); block_elems is the most values a quantization block of a
 * split matrix's columns holds (O's and down's columns are cut at a block's
 * edge), 1 for plain floats. */
td_status_t eng_shard_plan(const eng_model_desc_t *d, uint32_t tp, uint32_t rank, uint32_t block_elems,
                           eng_shard_t *out);

/* Rank `rank`'s rows of a vocabulary of `vocab` at tp ranks: how many, from *vocab0 (eng_shard_plan's split; the
 * ranks' rows side by side are the whole vocabulary in order). */
uint32_t eng_shard_vocab(uint32_t vocab, uint32_t tp, uint32_t rank, uint32_t *vocab0);

/* d as rank s sees it: its heads, FFN columns and vocabulary rows */
eng_model_desc_t eng_shard_desc(const eng_model_desc_t *d, const eng_shard_t *s);

#endif
