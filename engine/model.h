/* model.h — one description of a model, whichever file it came from.
 *
 * Models are data, not code: the engine reads everything it needs to run a
 * Llama-family decoder — Llama 2/3, Mistral, Qwen2/2.5, SmolLM2 — from GGUF
 * metadata or a Hugging Face folder's config.json, and the same forward pass
 * serves them all. eng_model_open() takes either a .gguf file or a folder with
 * config.json + model.safetensors (or a sharded index) + tokenizer.json. */
#ifndef ENG_MODEL_H
#define ENG_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct eng_gguf eng_gguf_t;
typedef struct eng_safetensors eng_safetensors_t;
typedef struct eng_tokenizer eng_tokenizer_t;

typedef enum eng_rope_style {
    ENG_ROPE_NORM, /* rotate adjacent pairs (x0,x1),(x2,x3)... : GGUF llama-family */
    ENG_ROPE_NEOX, /* rotate halves (x_i, x_{i+d/2}) : HF checkpoints, GGUF qwen2 */
} eng_rope_style_t;

typedef enum eng_rope_scaling {
    ENG_ROPE_SCALING_NONE, ENG_ROPE_SCALING_LINEAR, ENG_ROPE_SCALING_YARN, ENG_ROPE_SCALING_LLAMA3,
} eng_rope_scaling_t;

typedef struct eng_model_desc {
    char family[32];        /* llama, mistral, qwen2 (SmolLM2 is llama) */
    char name[128];
    char source[16];        /* gguf | safetensors */
    uint32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, vocab, context;
    float norm_eps;
    float rope_theta;
    eng_rope_style_t rope_style;
    eng_rope_scaling_t rope_scaling;
    float rope_factor, rope_low_freq, rope_high_freq;
    uint32_t rope_orig_context;
    bool tied_embeddings, qkv_bias;
    int32_t bos, eos;
    uint64_t n_params, weight_bytes;
} eng_model_desc_t;

/* How the layers' matrices are held: as the file has them (a device backend
 * decodes them to its own form) or in FP8 E4M3 with a scale per row
 * (kernels/backend.h's kern_weight_t.hold; the embedding and output matrix
 * stay as they are, as FP8 checkpoints keep them). */
typedef enum eng_weight_hold { ENG_WEIGHTS_FILE = 0, ENG_WEIGHTS_FP8 } eng_weight_hold_t;

typedef struct eng_model {
    eng_model_desc_t desc;
    eng_weight_hold_t hold;
    /* the dummy load format (eng_model_set_dummy): the file's weights, if any, are not read; every matrix is
     * filled with seeded values (kernels/quant.h's kern_fill_row_f16), every norm with ones — for benchmarks */
    bool dummy;
    /* the KV contract's model id: desc.name, then " (fp8 weights)" when held
     * in FP8 and " (dummy weights)" with the dummy load format — its KV
     * differs, so peers and the store keep them apart */
    char kv_id[128];
    char *path;
    eng_gguf_t *gguf;          /* one of these two */
    eng_safetensors_t *st;
    eng_tokenizer_t *tok;
} eng_model_t;

/* Opens a model (.gguf file or Hugging Face folder): weights mapped, not read;
 * description and tokenizer built. Free with eng_model_close(). */
td_status_t eng_model_open(const char *path, eng_model_t **out);
void eng_model_close(eng_model_t *m);
/* Sets how the layers' matrices are held (before an engine binds them) and the kv_id that goes with it. */
void eng_model_set_hold(eng_model_t *m, eng_weight_hold_t h);
/* The dummy load format on or off (before an engine binds the weights); the kv_id follows. */
void eng_model_set_dummy(eng_model_t *m, bool on);
/* "file" | "fp8" */
bool eng_weight_hold_parse(const char *s, eng_weight_hold_t *out);
const char *eng_weight_hold_name(eng_weight_hold_t h);

const char *eng_rope_style_name(eng_rope_style_t s);
const char *eng_rope_scaling_name(eng_rope_scaling_t s);

/* Fills a description from GGUF metadata alone (used by eng_model_open). */
td_status_t eng_model_desc_from_gguf(const eng_gguf_t *g, eng_model_desc_t *d);
/* Fills a description from a config.json (and the tensors it names). */
td_status_t eng_model_desc_from_hf(const char *config_json, const eng_safetensors_t *st, eng_model_desc_t *d);

#endif
