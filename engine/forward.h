/* forward.h — the forward pass over a batch of sequences.
 *
 * One call runs any mix of prefill chunks and decode tokens: each sequence of
 * the batch brings its next tokens, their first position and a block table
 * that already covers every position up to its last token. The pass writes the
 * new tokens' KV into those blocks and returns logits for the sequences that
 * ask for them (of their last token). Prefill and decode are the same code;
 * only the number of tokens per sequence differs. */
#ifndef ENG_FORWARD_H
#define ENG_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/shard.h"
#include "kernels/backend.h"
#include "kernels/comm.h"

typedef struct eng_batch_seq {
    const int32_t *tokens;   /* the tokens to run now */
    uint32_t n;
    uint32_t pos0;           /* position of tokens[0] (= tokens already in the KV) */
    const int32_t *block_table;
    uint32_t n_blocks;
    bool want_logits;        /* logits of tokens[n - 1] */
    bool all_logits;         /* logits of every token of the sequence (scoring) */
    /* reference numerics (kernels/backend.h): positions from here on are
     * generated tokens, rounded as one-token steps; 0: decided by this step
     * (one token: a decode step; more: prompt rows) */
    uint32_t decode_from;
} eng_batch_seq_t;

typedef struct eng_forward eng_forward_t;

/* Scratch for batches of up to max_tokens tokens and max_logits logit rows is
 * allocated here, once. The weights are bound and prepared. */
td_status_t eng_forward_create(const eng_model_t *m, kern_backend_t *be, eng_kv_pool_t *pool, uint32_t max_tokens,
                               uint32_t max_logits, eng_forward_t **out);
/* One rank of a tensor-parallel worker (engine/tp.h runs them): its part of the model (shard), its KV heads in
 * pool, its comm to the other ranks (shard->tp ranks). It computes the logits of its vocabulary rows; the comm
 * gathers every rank's into rank 0's whole rows, which rank 0 returns or picks from (the others return none). */
td_status_t eng_forward_create_rank(const eng_model_t *m, kern_backend_t *be, eng_kv_pool_t *pool,
                                    const eng_shard_t *shard, kern_comm_t *comm, uint32_t max_tokens,
                                    uint32_t max_logits, eng_forward_t **out);
void eng_forward_destroy(eng_forward_t *f);

/* Runs the batch. *logits points at n_logits rows of vocab floats (host
 * memory, in the order of the sequences that asked, all rows of an all_logits
 * sequence in order), valid until the next run; NULL on a tensor-parallel
 * rank other than 0. */
td_status_t eng_forward_run(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_logits);

/* Whether the backend picks tokens itself (KERN_OP_SAMPLE; of a tensor-parallel worker, rank 0's does, the
 * others running eng_forward_run beside it). */
bool eng_forward_can_sample(const eng_forward_t *f);
/* Runs the batch and picks each logit row's token on the backend with p[i]
 * (host memory, one per row, in eng_forward_run's order): ids[i], n_ids of
 * them. Only the ids cross back. masks (host memory, NULL: none): row i's
 * allowed tokens where p[i].masked ((vocab + 7) / 8 bytes a row, as
 * eng_matcher_allowed makes them), for at most eng_forward_mask_rows rows. */
td_status_t eng_forward_run_sampled(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs,
                                    const kern_sample_t *p, const uint8_t *masks, int32_t *ids, uint32_t *n_ids);
/* The logit rows a step may pick on the backend with masks (0: none). */
uint32_t eng_forward_mask_rows(const eng_forward_t *f);

/* fn(ctx, layer) runs after each layer's new KV is stored in the pool, while
 * the rest of the pass is still to come (the prefill worker streams it). */
void eng_forward_set_layer_hook(eng_forward_t *f, void (*fn)(void *ctx, uint32_t layer), void *ctx);

/* What the engine runs its steps on, one table for one process's forward
 * (eng_forward_pass, over an eng_forward_t) and a tensor-parallel worker's
 * ranks (eng_tp_pass, over an eng_tp_t): the calls above by their names. */
typedef struct eng_pass_ops {
    td_status_t (*run)(void *p, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                       uint32_t *n_logits);
    bool (*can_sample)(const void *p);
    uint32_t (*mask_rows)(const void *p);
    td_status_t (*run_sampled)(void *p, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *sp,
                               const uint8_t *masks, int32_t *ids, uint32_t *n_ids);
    void (*set_layer_hook)(void *p, void (*fn)(void *ctx, uint32_t layer), void *ctx);
} eng_pass_ops_t;
extern const eng_pass_ops_t eng_forward_pass;

/* The tap: fn(ctx, name, layer, x, rows, cols) sees each intermediate of a
 * run — a host copy of rows x cols floats, named as llama.cpp names its graph's
 * tensors (attn_norm, Qcur, Kcur, Vcur before RoPE; Qrope, Krope after;
 * kqv_out, attn_out, ffn_inp, ffn_norm, ffn_gate, ffn_up, ffn_swiglu, ffn_out,
 * l_out; embd and result_norm with layer -1). For numerics work: it
 * synchronizes after every step. NULL turns it off. On a backend whose
 * weights carry the norms (eng_weights_fold_norms: CUDA) the step stays
 * fused, and the tap sees only the names that path has (embd, Qcur, Kcur,
 * Vcur, Qrope, Krope, kqv_out). */
typedef void (*eng_tap_fn)(void *ctx, const char *name, int layer, const float *x, uint32_t rows, uint32_t cols);
void eng_forward_set_tap(eng_forward_t *f, eng_tap_fn fn, void *ctx);

#endif
