/* tp.h — a tensor-parallel forward pass: tp ranks, each a forward
 * (engine/forward.h) over its part of the model (engine/shard.h) on its own
 * backend and KV pool, every step run on all of them at once, a thread a rank
 * (the caller's thread is rank 0's); their all-reduces go through one comm
 * (kernels/comm.h), which also puts their logits' columns side by side in
 * rank 0's rows (where rank 0's backend picks the tokens). One process drives
 * the worker's devices: the engine, its scheduler and its pool's bookkeeping
 * stay one, and each rank's thread queues only its own device's work (with
 * NCCL, calls from a thread a device need no grouping).
 *
 * The ranks' pools hold the same blocks (one block table serves them all),
 * each its KV heads' part of a block (common/kv_shard.h maps a part to the
 * canonical block and back). */
#ifndef ENG_TP_H
#define ENG_TP_H

#include <stdint.h>

#include "common/status.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "kernels/backend.h"
#include "kernels/comm.h"

typedef struct eng_tp eng_tp_t;

/* tp ranks: bes[r] and pools[r] rank r's (pools[r]'s layout holding rank r's KV heads, every pool as many
 * blocks), comm joining tp ranks. Refuses a split the model does not allow (eng_shard_plan's error). */
td_status_t eng_tp_create(const eng_model_t *m, uint32_t tp, kern_backend_t *const *bes, eng_kv_pool_t *const *pools,
                          kern_comm_t *comm, uint32_t max_tokens, uint32_t max_logits, eng_tp_t **out);
void eng_tp_destroy(eng_tp_t *t);

/* eng_forward_run over every rank; *logits rows of the whole vocabulary. A rank's error ends the step on every
 * rank (the comm is aborted: later steps fail too) and is returned. */
td_status_t eng_tp_run(eng_tp_t *t, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                       uint32_t *n_logits);
/* The same with rank 0's backend picking the tokens (eng_forward_run_sampled's arguments), when
 * eng_tp_can_sample; eng_tp_mask_rows as eng_forward_mask_rows. */
bool eng_tp_can_sample(const eng_tp_t *t);
uint32_t eng_tp_mask_rows(const eng_tp_t *t);
td_status_t eng_tp_run_sampled(eng_tp_t *t, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *p,
                               const uint8_t *masks, int32_t *ids, uint32_t *n_ids);

/* fn(ctx, layer) once a layer's KV is stored by every rank (rank 0 calls it after the layer's first all-reduce,
 * which every rank reaches only after its store; its queue drained), as eng_forward_set_layer_hook's. */
void eng_tp_set_layer_hook(eng_tp_t *t, void (*fn)(void *ctx, uint32_t layer), void *ctx);

/* The calls above as the engine's pass table (engine/forward.h), over an eng_tp_t. */
extern const eng_pass_ops_t eng_tp_pass;

/* Rank r's KV heads: [*head0, *head0 + *heads) of the model's. */
void eng_tp_kv_heads(const eng_tp_t *t, uint32_t r, uint32_t *head0, uint32_t *heads);

/* Rank r's part of m at tp ranks (eng_shard_plan with the columns cut at whole quantization blocks of the file
 * and whole groups of 32 values). */
td_status_t eng_tp_plan(const eng_model_t *m, uint32_t tp, uint32_t r, eng_shard_t *out);

/* Everything a tensor-parallel engine runs on, made from names: a backend a rank, its comm, the pool of parts
 * (g: the whole block's layout, n_blocks of them) and the forward. devices: "cpu" (every rank a CPU backend of
 * n_threads threads, the all-reduce in memory) or "cuda:0,1" / "cuda:0,cuda:1" (a GPU a rank, NCCL), as many as
 * ranks. Errors name what was wrong (a device list of another length, a GPU named twice, a split the model does
 * not allow, no NCCL). mem: the parts' memory provider (NULL or no alloc: each rank's backend's). */
#define ENG_TP_MAX 16
typedef struct eng_tp_set {
    uint32_t tp;
    kern_backend_t *bes[ENG_TP_MAX];
    kern_comm_t *comm;
    eng_kv_pool_t *pool;
    eng_tp_t *fwd;
} eng_tp_set_t;
td_status_t eng_tp_open(const eng_model_t *m, uint32_t tp, const char *devices, int n_threads,
                        kern_numerics_t numerics, const td_kv_layout_t *g, uint32_t n_blocks,
                        const eng_kv_memory_t *mem, uint32_t max_tokens, uint32_t max_logits, eng_tp_set_t *out);
void eng_tp_close(eng_tp_set_t *s);

#endif
