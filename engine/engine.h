/* engine.h — the single-process engine: requests in, tokens out.
 *
 * It owns a model, a backend, the paged KV pool and the forward pass, and
 * schedules requests by continuous batching: every step fills a token budget
 * with one token for each running sequence and chunks of waiting prompts
 * (chunked prefill) in the configured order (engine/sched.h), reuses cached
 * prefix blocks by name, and, when the pool runs short, preempts the newest
 * sequence (its KV swapped out to host memory and back, or dropped and
 * recomputed, whichever is predicted cheaper) rather than failing. One thread owns the engine; nothing here locks. */
#ifndef ENG_ENGINE_H
#define ENG_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_contract.h"
#include "common/status.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/sched.h"
#include "kernels/backend.h"

typedef struct eng_engine_config {
    /* The backend to run on, the caller's (it outlives the engine and must
     * round as `numerics` says); NULL: the engine makes the CPU backend with
     * n_threads and numerics. Refused unless it has every op the forward
     * pass calls (kern_backend_check). */
    kern_backend_t *backend;
    const char *device;       /* the backend made when `backend` is NULL: eng_backend_open's names (NULL: cpu) */
    int n_threads;            /* CPU compute threads (0: one per core) */
    uint32_t block_tokens;    /* tokens per KV block (16) */
    td_kv_dtype_t kv_dtype; /* fp16 (default) or fp32 */
    kern_numerics_t numerics; /* fast (default) or llama.cpp's exact rounding (kernels/backend.h) */
    uint64_t kv_tokens;       /* pool size in tokens (0: use kv_bytes) */
    uint64_t kv_bytes;        /* pool size in bytes (0 and kv_tokens 0: 64 MiB) */
    uint32_t token_budget;    /* tokens per step (512) */
    uint32_t max_seqs;        /* sequences per step (64) */
    bool prefix_cache;        /* reuse KV of equal prefixes (on) */
    eng_kv_memory_t kv_memory; /* where the pool lives (alloc NULL: the backend's memory) */
    double block_wait_s;      /* how long a request may wait for a KV block held by landing
                               * reservations before it fails (10 s: longer than their lease) */
    eng_sched_config_t sched; /* the order waiting prompts are computed in (engine/sched.h; fcfs) */
    uint64_t swap_bytes;      /* host memory a preempted sequence's KV may wait in instead of being computed
                               * again, when the copy is predicted cheaper (0: always recomputed) */
    uint32_t tp;              /* tensor-parallel ranks (engine/tp.h; 0 or 1: one); device then names the ranks'
                               * devices ("cpu", "cuda:0,1"), the pool's size counts them all */
} eng_engine_config_t;

eng_engine_config_t eng_engine_config_default(void);

/* The backend of a device: "cpu" (n_threads compute threads, rounding as
 * numerics says) or "cuda" / "cuda:N" (the GPU's own numerics: reference is
 * refused). Errors name the device: a build without the CUDA backend, no such
 * GPU, or a malformed name. */
td_status_t eng_backend_open(const char *device, int n_threads, kern_numerics_t numerics, kern_backend_t **out);

typedef enum eng_finish {
    ENG_FINISH_NONE, ENG_FINISH_EOS, ENG_FINISH_STOP, ENG_FINISH_LENGTH, ENG_FINISH_CANCELLED, ENG_FINISH_ERROR,
} eng_finish_t;
const char *eng_finish_name(eng_finish_t f);

typedef struct eng_request {
    const int32_t *prompt;
    size_t n_prompt;
    eng_sampling_t sampling;
    uint32_t max_tokens;        /* > 0 */
    const char *const *stop;    /* stop strings (not included in the output) */
    size_t n_stop;
    bool ignore_eos;
    /* Higher first: a new prompt is computed before the waiting prompts of
     * lower priority that have not started (one already under way is not
     * overtaken); equal priorities keep their order. */
    int32_t priority;
    /* td_now_s() by which its prompt must be computed (0: none): a chunk of
     * it that would overrun is cut to what the engine's measured speed fits
     * in the time left, and past it no more of it is computed — the caller
     * cancels it (its call's deadline passed). */
    double deadline;
    /* Imported KV (a decode worker's request): the KV of all n_prompt tokens
     * is already in these blocks (ceil(n_prompt / block_tokens) of them, from
     * eng_engine_kv_reserve; the engine owns them once the add succeeds), and
     * first_token, sampled by the prefill side, is the first generated token. */
    const int32_t *kv_blocks;
    int32_t first_token;
    /* Tokens of this sequence sampled elsewhere before (the prefill side's
     * first token, tokens streamed before a resume): a seeded sampler skips
     * that many draws, so the sequence's random stream is the one a single
     * process would have drawn. */
    uint32_t sampled_before;
    /* A resumed stream: the last resume_generated prompt tokens were
     * generated before, and resume_text_sent bytes of their text were already
     * delivered. Their text is replayed into the stop-string window (what was
     * held back is emitted, a stop string spanning the break is found) and
     * the delivered bytes are not emitted again. */
    uint32_t resume_generated;
    size_t resume_text_sent;
} eng_request_t;

/* What a step produced for one request. */
typedef struct eng_event {
    uint64_t id;
    int32_t token;              /* -1 when only finishing */
    const char *text;           /* the text this token completes (whole UTF-8) */
    size_t text_len;
    eng_finish_t finish;        /* NONE while running */
    const char *error;          /* with ENG_FINISH_ERROR: what went wrong (valid during the callback) */
    uint32_t n_prompt, n_generated, n_cached; /* n_cached: prompt tokens served from the prefix cache */
    /* the token's log-probabilities when the request asked (sampling.logprobs); NULL otherwise, and for a first
     * token sampled elsewhere (valid during the callback) */
    const eng_logprobs_t *logprobs;
    /* with sampling.prompt_logprobs, on the request's first event: the prompt's tokens 1 .. n_prompt - 1 (entry i
     * is token i + 1's) */
    const eng_logprobs_t *prompt_logprobs;
    uint32_t n_prompt_logprobs;
} eng_event_t;

typedef void (*eng_event_fn)(void *ctx, const eng_event_t *ev);

typedef struct eng_engine eng_engine_t;

td_status_t eng_engine_create(eng_model_t *m, const eng_engine_config_t *cfg, eng_engine_t **out);
void eng_engine_destroy(eng_engine_t *e);

/* Queues a request; every field is checked first (an error names it:
 * an empty or too long prompt, max_tokens 0, a token id outside the
 * vocabulary, bad sampling parameters). */
td_status_t eng_engine_add(eng_engine_t *e, const eng_request_t *r, uint64_t *id);
/* Ends a request now (its blocks are freed); an unknown id is TD_ERR_NOT_FOUND. */
td_status_t eng_engine_cancel(eng_engine_t *e, uint64_t id);
/* Runs one step and reports each request's new token (and finishes). A step
 * that fails (a backend op's error) ends every request of its batch with
 * ENG_FINISH_ERROR and the message, and returns that error; the engine goes
 * on with the other requests. A request that can get no KV block at all (the
 * pool held by landing reservations, nothing to preempt) waits up to
 * cfg.block_wait_s for one, then ends the same way. */
td_status_t eng_engine_step(eng_engine_t *e, eng_event_fn fn, void *ctx);
bool eng_engine_busy(const eng_engine_t *e);
/* Busy, but the last step ran nothing: every request waits for KV blocks
 * (held by reservations); the caller may wait a little before the next step. */
bool eng_engine_stalled(const eng_engine_t *e);

eng_kv_stats_t eng_engine_kv_stats(const eng_engine_t *e);
/* The pool itself (engine thread only): its stored/removed events and
 * snapshot (kv_pool.h) feed the KV store's and the router's indexes. */
eng_kv_pool_t *eng_engine_kv_pool(eng_engine_t *e);
/* Requests in the engine (waiting or running). */
uint32_t eng_engine_n_requests(const eng_engine_t *e);
/* Sequences preempted so far (their KV swapped out, or dropped and recomputed later). */
uint64_t eng_engine_preemptions(const eng_engine_t *e);
/* Prompt tokens computed so far (chunks of prompts and of recomputation; not
 * those the prefix cache or a landing supplied). */
uint64_t eng_engine_prompt_computed(const eng_engine_t *e);
/* Preempted sequences whose KV went to host memory, and those that came back. */
void eng_engine_swaps(const eng_engine_t *e, uint64_t *out, uint64_t *in);

/* Landing blocks for n_tokens tokens of KV written from outside (a peer's
 * puts): ceil(n_tokens / block_tokens) fresh blocks into blocks[], or
 * TD_ERR_EXHAUSTED (nothing taken) when the pool cannot spare them. */
td_status_t eng_engine_kv_reserve(eng_engine_t *e, uint32_t n_tokens, int32_t *blocks);
/* The same for the KV of tokens[0..n_tokens), taking first the blocks of
 * its leading full blocks that the prefix cache holds (as a prompt added
 * here would: never the block of the last token, computed for its logits):
 * blocks[0..*n_held) are those, their counts raised, and need no KV from
 * outside; the rest are fresh. */
td_status_t eng_engine_kv_reserve_prefix(eng_engine_t *e, const int32_t *tokens, uint32_t n_tokens, int32_t *blocks,
                                         uint32_t *n_held);
/* The name of tokens' block n_blocks - 1 (the chain of DESIGN.md §3 under
 * this engine's model, dtype and block size); n_blocks full blocks. */
td_block_name_t eng_engine_block_name(const eng_engine_t *e, const int32_t *tokens, uint32_t n_blocks);
void eng_engine_kv_release(eng_engine_t *e, const int32_t *blocks, uint32_t n);
/* The pool's memory (block b starts at base + b * block_bytes): the
 * backend's kind, device memory on a GPU. */
void *eng_engine_kv_base(const eng_engine_t *e, size_t *block_bytes);
/* out[i] = the digest of pool block blocks[i] as the backend computes it
 * (kern_backend_ops_t.kv_digest), after the work queued so far. */
td_status_t eng_engine_kv_digest(eng_engine_t *e, const int32_t *blocks, uint32_t n, uint64_t *out);
/* The backend's native queue (kern_backend_ops_t.queue): NULL on the CPU. */
void *eng_engine_queue(eng_engine_t *e);
/* The physical devices it computes on (kern_backend_ops_t.device_id: a rank's each), comma-separated in out;
 * "" where its backend names none (the CPU). */
void eng_engine_device_ids(eng_engine_t *e, char *out, size_t cap);
/* Whether the pool is host memory that other threads and UCX may read and
 * write directly (the CPU backend); otherwise its blocks leave and enter the
 * pool through host staging memory, with these (engine thread): */
bool eng_engine_kv_on_host(const eng_engine_t *e);
/* Pool blocks blocks[0..n) to dst / from src, host memory holding them back
 * to back (block_bytes each), after the work queued so far; both return once
 * the copies are done. */
td_status_t eng_engine_kv_download(eng_engine_t *e, const int32_t *blocks, uint32_t n, void *dst);
td_status_t eng_engine_kv_upload(eng_engine_t *e, const int32_t *blocks, uint32_t n, const void *src);
/* Host staging memory the backend copies fastest (kern_backend_ops_t.host_alloc); any thread. */
td_status_t eng_engine_host_alloc(eng_engine_t *e, size_t bytes, void **ptr);
void eng_engine_host_free(eng_engine_t *e, void *ptr);

/* Called after each layer of each step, once that layer's KV of the step's
 * tokens is in the pool — on a device backend, once its kernels are queued
 * (eng_engine_queue orders what reads it): for every sequence in the step, the blocks the step
 * wrote, [first_block, end_block) of its table. */
typedef struct eng_layer_seq {
    uint64_t id;
    const int32_t *blocks;
    uint32_t first_block, end_block;
} eng_layer_seq_t;
typedef void (*eng_layer_fn)(void *ctx, uint32_t layer, const eng_layer_seq_t *seqs, uint32_t n);
void eng_engine_set_layer_hook(eng_engine_t *e, eng_layer_fn fn, void *ctx);
/* The KV contract this engine's blocks follow (kv_contract.h). */
td_kv_layout_t eng_engine_kv_contract(const eng_engine_t *e);

#endif
