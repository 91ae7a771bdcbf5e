/* weights.h — the model's tensors bound to the engine's roles, from either
 * naming scheme (GGUF "blk.N.attn_q.weight", Hugging Face
 * "model.layers.N.self_attn.q_proj.weight"), shapes checked against the
 * description. Matrices stay in the file's format and mapping (the backend
 * prepares them); vectors (norms, biases) are copied to fp32. */
#ifndef ENG_WEIGHTS_H
#define ENG_WEIGHTS_H

#include "common/status.h"
#include "engine/model.h"
#include "engine/shard.h"
#include "kernels/backend.h"

typedef struct eng_layer_weights {
    float *attn_norm, *ffn_norm;   /* [hidden], backend memory */
    float *bq, *bk, *bv;           /* qkv biases or NULL */
    kern_weight_t wq, wk, wv, wo, w_gate, w_up, w_down;
} eng_layer_weights_t;

typedef struct eng_weights {
    kern_weight_t tok_embd;  /* [vocab][hidden]; read by rows (embed) */
    kern_weight_t output;    /* [vocab][hidden]; the embedding when tied */
    float *out_norm;
    eng_layer_weights_t *layers;
    uint32_t n_layers;
    /* the norms' weights are in the matrices after them (eng_weights_fold_norms):
     * attn_norm in wq, wk, wv; ffn_norm in w_gate, w_up; out_norm in output
     * unless the output is the embedding (tied) */
    bool norms_folded;
    void **owned; /* the parts of matrices a tensor-parallel rank cut out of the file's rows */
    uint32_t n_owned, cap_owned;
} eng_weights_t;

/* Binds and prepares every tensor; an absent tensor or a wrong shape is
 * TD_ERR_FORMAT naming it. Free with eng_weights_release(). */
td_status_t eng_weights_bind(const eng_model_t *m, kern_backend_t *be, eng_weights_t *w);
/* The same for one tensor-parallel rank (engine/shard.h): its rows or columns of each matrix; the embedding
 * whole. */
td_status_t eng_weights_bind_shard(const eng_model_t *m, kern_backend_t *be, const eng_shard_t *s, eng_weights_t *w);
/* The most values a quantization block of the matrices tensor parallelism cuts by columns (O, down) holds in
 * this model's file (1: plain floats), for eng_shard_plan. */
uint32_t eng_weights_col_block(const eng_model_t *m);
void eng_weights_release(eng_weights_t *w, kern_backend_t *be);

/* Moves each RMSNorm's weight into the columns of the matrices it feeds
 * (the backend's weight_scale_cols), where the backend has that op: its
 * fused matmul then reads x alone. All of them or none: when one product
 * would not fit a weight's type, nothing changes (logged). Only for a
 * forward pass that takes the fused matmul with norm_in_w. */
td_status_t eng_weights_fold_norms(eng_weights_t *w, kern_backend_t *be, bool tied);

#endif
