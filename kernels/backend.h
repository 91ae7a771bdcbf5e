/* backend.h — the kernel backend: one table of operations that the engine's
 * forward pass calls, implemented by kernels/cpu/ (SIMD + a thread pool) and
 * kernels/cuda/ (CUDA C, cuBLAS). ggml's ggml_backend_i is the model.
 *
 * Memory: every pointer an op takes lives in the backend's memory (host memory
 * for the CPU backend, device memory for CUDA), allocated with ops->alloc and
 * filled with ops->upload. Execution: ops are queued in order and may run
 * asynchronously; ops->sync waits for all of them. Nothing is read back
 * implicitly.
 *
 * Errors: an op returns an error it can see at once. A backend that finds one
 * later (an asynchronous kernel that failed) keeps it, sticky: every op after
 * it returns it without running, and sync returns it and clears it, so that
 * the caller fails the batch it was running and may start the next. The
 * caller checks every op's status and sync's.
 *
 * Capabilities: every entry of the table up to attention is set; an op a
 * backend does not have returns TD_ERR_UNSUPPORTED, and `supported` has a bit
 * (KERN_OP_*) for each op it does have, so that a caller refuses a backend up
 * front (kern_backend_check) instead of at its first step. The optional ops
 * after attention (KERN_OPS_OPTIONAL: the fused matmul, sampling, captured
 * steps, rope with the KV store, a weight's columns scaled) are set only where
 * their bit is; a caller checks the bit first.
 *
 * Shapes (row-major, the last dimension contiguous):
 *   activations  x[n][dim] fp32
 *   a weight     W[rows][cols] of any kern_type_t; matmul computes y = x Wᵀ
 *   q, k, v      [n][heads][head_dim] fp32
 * The KV pool (engine/kv_pool.h) is an array of blocks in the canonical layout
 * of common/kv_contract.h, [layer][k|v][kv_head][token][head_dim], fp32 or fp16. */
#ifndef KERN_BACKEND_H
#define KERN_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_contract.h"
#include "common/status.h"

typedef struct kern_backend kern_backend_t;

/* A weight matrix as a backend holds it. `data` is the file's bytes (mapped);
 * the backend may keep its own copy or repacked layout in `priv`.
 *
 * FP8: with hold KERN_TYPE_F8_E4M3 the backend holds the matrix in FP8 E4M3
 * with a scale per row — the file's, when type is F8_E4M3 (scale: its rows
 * scales, host memory, read by weight_prepare only), or made at prepare from
 * any other type as kern_fp8_quantize_row makes them. The CUDA backend's
 * matmuls read the FP8 bytes; the CPU backend keeps the decoded values (the
 * FP8 value times its row's scale) and computes with them as F32 (its
 * prepare sets type F32 and data to that copy). */
typedef struct kern_weight {
    uint32_t type;  /* kern_type_t */
    uint32_t rows;  /* output features */
    uint32_t cols;  /* input features (contiguous) */
    const void *data;
    void *priv;
    uint32_t hold;      /* 0: the backend's own form; KERN_TYPE_F8_E4M3 (above) */
    const float *scale; /* type F8_E4M3: the rows' scales (above) */
    /* data NULL, type F16: the matrix has no file; weight_prepare fills it with kern_fill_row_f16(fill, ...) (a
     * dummy load format, for benchmarks): row r, column c has the whole matrix's value at (fill_row0 + r,
     * fill_col0 + c), so that a tensor-parallel rank's part has its rows and columns of the whole */
    uint64_t fill;
    uint32_t fill_row0, fill_col0;
} kern_weight_t;

/* The FP8 codes and scale of row r of w as a backend holding it in FP8 has
 * them: the file's (type F8_E4M3), else kern_fp8_quantize_row of the row
 * decoded; tmp holds cols floats. The one definition the backends' own
 * conversions are checked against. */
#ifdef __cplusplus
extern "C" {
#endif
td_status_t kern_weight_fp8_row(const kern_weight_t *w, uint32_t r, uint8_t *q, float *scale, float *tmp);
#ifdef __cplusplus
}
#endif

typedef enum kern_rope_style {
    KERN_ROPE_NORM, /* rotate (x[2i], x[2i+1]) */
    KERN_ROPE_NEOX, /* rotate (x[i], x[i + d/2]) */
} kern_rope_style_t;

/* Where the KV of one layer lives: the pool's memory, its layout
 * (common/kv_contract.h) and the layer; block_bytes is the layout's, kept
 * here for the kernels' inner loops. */
typedef struct kern_kv_view {
    void *base; /* block 0 */
    const td_kv_layout_t *layout;
    size_t block_bytes;
    uint32_t layer;
} kern_kv_view_t;

/* Elements from a block's start to the K (which 0) or V (which 1) rows of
 * kv_head in the view's layer. */
static inline size_t kern_kv_offset(const kern_kv_view_t *kv, uint32_t which, uint32_t kv_head)
{
    return td_kv_offset(kv->layout, kv->layer, which, kv_head);
}

/* One sequence's part of a batch: its tokens are rows [row0, row0 + n) of q,
 * at positions pos0 .. pos0 + n - 1, and attend causally to every position
 * from 0, whose KV is in the blocks block_table[0 .. n_blocks). */
typedef struct kern_attn_seq {
    uint32_t row0, n, pos0;
    const int32_t *block_table;
    uint32_t n_blocks;
    /* reference numerics: rows at positions from decode_from on round as
     * llama.cpp's one-token decode steps, earlier rows as its batched prompt
     * (fast numerics ignore it) */
    uint32_t decode_from;
} kern_attn_seq_t;

/* The compute ops, one bit each in kern_backend_ops_t.supported. */
typedef enum kern_op {
    KERN_OP_MATMUL = 1u << 0,
    KERN_OP_MATMUL_MULTI = 1u << 1,
    KERN_OP_RMSNORM = 1u << 2,
    KERN_OP_ROPE = 1u << 3,
    KERN_OP_SWIGLU = 1u << 4,
    KERN_OP_ADD = 1u << 5,
    KERN_OP_EMBED = 1u << 6,
    KERN_OP_KV_STORE = 1u << 7,
    KERN_OP_ATTENTION = 1u << 8,
    KERN_OP_MATMUL_FUSED = 1u << 9,
    KERN_OP_SAMPLE = 1u << 10,
    KERN_OP_GRAPH = 1u << 11,
    KERN_OP_ROPE_KV_STORE = 1u << 12,
    KERN_OP_ROPE_KV_ATTENTION = 1u << 13,
    KERN_OP_WEIGHT_SCALE_COLS = 1u << 14,
} kern_op_t;
#define KERN_OPS_ALL 0x1ffu
#define KERN_OPS_OPTIONAL                                                                                           \
    (KERN_OP_MATMUL_FUSED | KERN_OP_SAMPLE | KERN_OP_GRAPH | KERN_OP_ROPE_KV_STORE | KERN_OP_ROPE_KV_ATTENTION |   \
     KERN_OP_WEIGHT_SCALE_COLS)
/* What the engine's forward pass calls (matmul_multi is optional: the forward
 * pass falls back to one matmul per weight). */
#define KERN_OPS_FORWARD (KERN_OPS_ALL & ~(uint32_t)KERN_OP_MATMUL_MULTI)

/* One matmul with what surrounds it in a layer fused in (matmul_fused):
 * y_i = norm(x) · W_iᵀ for k (<= 4) weights of one type and width, where
 * norm(x) is x's RMSNorm with weight `norm` (eps) when norm is set, else x;
 * with norm_in_w the norm's weight is already in the weights' columns
 * (weight_scale_cols), so norm(x) is x's RMSNorm without it; with glu
 * (k == 2, equal rows) y[0] = silu(x·W0ᵀ) * (x·W1ᵀ) and y[1] is scratch;
 * with accumulate each y_i += instead of =. With glu and to_next, y[0] is
 * read by nothing but the next matmul_fused call, as its x: a backend may
 * hand it over in a form of its own and leave y[0] without it (the CUDA
 * backend's GEMMs take it as fp16). With to_next and k == 3 (no glu, no
 * accumulate: a layer's Q, K and V), y[0..2] are read by nothing but the next
 * rope_kv_store or rope_kv_attention call, the rotated y[0] by nothing but
 * its attention, and that attention's output by nothing but the next
 * matmul_fused call, as its x: a backend may hand them over in a form of its
 * own (the CUDA backend's prompt steps keep them in fp16 alone). */
typedef struct kern_matmul_spec {
    const kern_weight_t *const *w;
    float *const *y;
    uint32_t k;
    const float *x;
    uint32_t n;
    const float *norm;
    float eps;
    bool norm_in_w, glu, accumulate, to_next;
    /* Optional: room for side_rows rows of the k products side by side (a row holds every weight's outputs, in
     * order). Where n <= side_rows and the weights were joined (weights_join), a backend may multiply them at once
     * into side and take each y from there. With glu and to_next side may be y[0]'s own room (y[0] and y[1] are
     * then both scratch). */
    float *side;
    uint32_t side_rows;
} kern_matmul_spec_t;

/* A layer's rope and KV store (rope_kv_attention): q [n][n_heads][head_dim]
 * and k, v [n][n_kv_heads][head_dim] of the step's n rows, rotated for pos
 * (freq and style as rope takes them) and stored to the pool's slots. */
typedef struct kern_rope_kv {
    float *q, *k;
    const float *v;
    uint32_t n_heads, n;
    const int32_t *slots, *pos;
    const float *freq;
    kern_rope_style_t style;
} kern_rope_kv_t;

/* How to pick one row's token (sample): greedy when temperature is 0, else
 * a draw over softmax(logits / temperature) kept to the top_k largest (0:
 * all), the smallest set of those whose mass reaches top_p (1: off) and those
 * at least min_p times the largest's probability (0: off) — eng_sampler's
 * order — at the point u in [0, 1) of the kept mass (the caller's draw). */
typedef struct kern_sample {
    float temperature, top_p, min_p, u;
    int32_t top_k;
    uint32_t masked; /* only the tokens the row's mask allows (structured output: sample's masks) */
} kern_sample_t;

typedef struct kern_backend_ops {
    const char *name;
    uint32_t supported; /* KERN_OP_* bits */
    uint32_t kv_dtypes; /* the KV dtypes kv_store and attention take: bit 1u << td_kv_dtype_t each */
    /* frees the backend and everything it allocated */
    void (*destroy)(kern_backend_t *b);
    /* Optional: the physical device it computes on, the same in every process that uses it (a GPU's UUID as
     * nvidia-smi writes it), in out (cap bytes): the router prices a prefill on a device a decode worker shares
     * as a stall of that worker's streams. NULL: none (the CPU backend: cores are the OS's to share). */
    td_status_t (*device_id)(kern_backend_t *b, char *out, size_t cap);
    /* memory */
    td_status_t (*alloc)(kern_backend_t *b, size_t bytes, void **ptr);
    void (*free)(kern_backend_t *b, void *ptr);
    td_status_t (*upload)(kern_backend_t *b, void *dst, const void *src, size_t bytes);
    td_status_t (*download)(kern_backend_t *b, void *dst, const void *src, size_t bytes);
    /* host memory that upload and download move fastest (page-locked for a
     * device backend; plain for the CPU): staging for KV that leaves or
     * enters the pool through host memory. Any thread. */
    td_status_t (*host_alloc)(kern_backend_t *b, size_t bytes, void **ptr);
    void (*host_free)(kern_backend_t *b, void *ptr);
    /* within backend memory */
    td_status_t (*copy)(kern_backend_t *b, void *dst, const void *src, size_t bytes);
    td_status_t (*sync)(kern_backend_t *b);
    /* The native queue the ops run on (a cudaStream_t), or NULL for a backend
     * whose ops have finished when they return (CPU): a device KV transport
     * orders its copies of pool memory after the work queued on it. */
    void *(*queue)(kern_backend_t *b);
    /* out[i] = the digest of block blocks[i] of the pool at base (block_bytes
     * each), computed where the blocks live, after the work queued so far:
     * td_kv_block_digest on the host; a device backend's own 64-bit digest
     * over the same bytes (peers that compare digests share one transport,
     * so one kind of memory). blocks and out are host memory. */
    td_status_t (*kv_digest)(kern_backend_t *b, const void *base, size_t block_bytes, const int32_t *blocks,
                             uint32_t n, uint64_t *out);
    /* weights: prepare once after load (upload, repack); release frees priv */
    td_status_t (*weight_prepare)(kern_backend_t *b, kern_weight_t *w);
    void (*weight_release)(kern_backend_t *b, kern_weight_t *w);
    /* Optional: puts k prepared weights of one width side by side in one allocation, in order, where the backend
     * gains from multiplying them at once (kern_matmul_spec_t's side). Each keeps its values and is released as
     * before. Weights the backend would not gain from stay apart (TD_OK). */
    td_status_t (*weights_join)(kern_backend_t *b, kern_weight_t *const *w, uint32_t k);

    /* y[n][rows] = x[n][cols] · Wᵀ */
    td_status_t (*matmul)(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n);
    /* y_i = x · W_iᵀ for k (<= 4) weights of one type and width: one pass over
     * x's quantization and one dispatch (Q, K and V; gate and up) */
    td_status_t (*matmul_multi)(kern_backend_t *b, const kern_weight_t *const *w, float *const *y, uint32_t k,
                                const float *x, uint32_t n);
    /* y[i] = x[i] / rms(x[i]) * w, per row of dim */
    td_status_t (*rmsnorm)(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t dim,
                           float eps);
    /* rotates x[n][heads][head_dim] in place; freq[0..head_dim/2) are the
     * per-pair inverse frequencies (scaling already applied); freq[head_dim/2]
     * is powf(base, -2/head_dim) when the model has no scaling, else 0 (the
     * CPU backend's reference numerics build angles from it) */
    td_status_t (*rope)(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t head_dim,
                        const int32_t *pos, const float *freq, kern_rope_style_t style);
    /* y = silu(gate) * up, elementwise over n */
    td_status_t (*swiglu)(kern_backend_t *b, const float *gate, const float *up, float *y, size_t n);
    /* x += y, elementwise */
    td_status_t (*add)(kern_backend_t *b, float *x, const float *y, size_t n);
    /* out[i] = row ids[i] of the table, as fp32 */
    td_status_t (*embed)(kern_backend_t *b, const kern_weight_t *table, const int32_t *ids, uint32_t n, float *out);
    /* writes k, v [n][n_kv_heads][head_dim] of one layer into pool slots
     * (slot = block * block_tokens + offset) */
    td_status_t (*kv_store)(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v,
                            const int32_t *slots, uint32_t n);
    /* out[rows][n_heads][head_dim] = softmax(q kᵀ · scale, causal) v, per
     * sequence. seqs is host memory (the plan); dev_seqs, when not NULL, is
     * the same array in backend memory, from which a device backend reads
     * each sequence's position, rows and table while the kernels run, so that
     * a captured step replays with the current ones. */
    td_status_t (*attention)(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out,
                             uint32_t n_heads, const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs,
                             uint32_t n_seqs, float scale);

    /* ---- optional (KERN_OPS_OPTIONAL): set only where the bit is ---- */
    /* the matmul of kern_matmul_spec_t */
    td_status_t (*matmul_fused)(kern_backend_t *b, const kern_matmul_spec_t *s);
    /* rope on q [n][n_heads][head_dim] and on k [n][n_kv_heads][head_dim] in
     * place, then kv_store of k and v: what rope, rope and kv_store do, in
     * one pass */
    td_status_t (*rope_kv_store)(kern_backend_t *b, const kern_kv_view_t *kv, float *q, float *k, const float *v,
                                 uint32_t n_heads, const int32_t *slots, uint32_t n, const int32_t *pos,
                                 const float *freq, kern_rope_style_t style);
    /* rope_kv_store of r, then attention over the same pool and rows: the
     * same KV in the pool and the same out, in one pass where the backend
     * can (the CUDA backend: a step of decode rows only); q and k may be
     * left rotated or not */
    td_status_t (*rope_kv_attention)(kern_backend_t *b, const kern_kv_view_t *kv, const kern_rope_kv_t *r,
                                     float *out, const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs,
                                     uint32_t n_seqs, float scale);
    /* *fits = every W[r][c] * s[c] fits the type of the backend's copy of w
     * (s: backend memory, [cols]); with apply and *fits, the copy is so
     * scaled, so that a norm's weight rides in the matmul after it
     * (kern_matmul_spec_t's norm_in_w). Otherwise w is unchanged. */
    td_status_t (*weight_scale_cols)(kern_backend_t *b, kern_weight_t *w, const float *s, bool apply, bool *fits);
    /* ids[i] = the token kern_sample_t p[i] picks from logits row i of
     * [n][vocab]; where p[i].masked, only among the tokens row i of masks
     * allows ((vocab + 7) / 8 bytes a row, token t's bit t % 8 of byte t / 8;
     * at least one allowed). p, masks and ids in backend memory */
    td_status_t (*sample)(kern_backend_t *b, const float *logits, uint32_t n, uint32_t vocab, const kern_sample_t *p,
                          const uint8_t *masks, int32_t *ids);
    /* Captured steps: capture_begin records the ops queued after it instead
     * of running them; capture_end(key, keep) ends the recording and, with
     * keep, holds it under key (replacing one there); replay(key) queues it,
     * reading every buffer's contents as they are then. replay answers
     * TD_ERR_NOT_FOUND when nothing is held under key (never made, or dropped
     * because memory it used moved). */
    td_status_t (*capture_begin)(kern_backend_t *b);
    td_status_t (*capture_end)(kern_backend_t *b, uint64_t key, bool keep);
    td_status_t (*replay)(kern_backend_t *b, uint64_t key);
    /* Decode steps whose longest context reaches this many positions run
     * other kernels than shorter ones: a caller capturing steps keeps the
     * two apart, since a replay keeps the kernels of its capture (0: none). */
    uint32_t capture_ctx_split;
} kern_backend_ops_t;

/* Every backend struct begins with its ops table. */
struct kern_backend {
    const kern_backend_ops_t *ops;
};

static inline void kern_backend_destroy(kern_backend_t *b)
{
    if (b)
        b->ops->destroy(b);
}

/* TD_OK when b supports every op in `need` (KERN_OP_* bits); else
 * TD_ERR_UNSUPPORTED naming the backend and the ops it lacks. */
td_status_t kern_backend_check(const kern_backend_t *b, uint32_t need);

/* How the CPU backend rounds. FAST: its own kernels (weights repacked into
 * 8-row tiles, one accumulator per row). REFERENCE: llama.cpp's order of
 * operations in every op that rounds (kernels/cpu/refnum.h), so its floats —
 * and greedy tokens — are bit-identical to llama.cpp's x86 AVX2 build on the
 * same GGUF; it needs AVX2, FMA and F16C. */
typedef enum kern_numerics { KERN_NUMERICS_FAST = 0, KERN_NUMERICS_REFERENCE } kern_numerics_t;

/* The CPU backend with n_threads compute threads (0: one per core). */
td_status_t kern_cpu_backend_create(int n_threads, kern_backend_t **out);
td_status_t kern_cpu_backend_create_numerics(int n_threads, kern_numerics_t numerics, kern_backend_t **out);
/* "fast" or "reference" -> *out; false for anything else */
bool kern_numerics_parse(const char *s, kern_numerics_t *out);
void kern_cpu_backend_destroy(kern_backend_t *b); /* = kern_backend_destroy */

#endif
