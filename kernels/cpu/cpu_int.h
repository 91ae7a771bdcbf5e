/* cpu_int.h — the CPU backend's struct and op entry points, shared by the op
 * files of kernels/cpu/ (one op per file) and backend_cpu.c, which fills the
 * table. Ownership: the engine thread that calls the ops owns the backend;
 * the pool's workers only run the tasks an op hands them. */
#ifndef KERN_CPU_INT_H
#define KERN_CPU_INT_H

#include <stdbool.h>

#include "kernels/backend.h"
#include "kernels/cpu/threadpool.h"
#include "kernels/cpu/vecdot.h"

typedef struct kern_cpu_chunk {
    struct kern_cpu_chunk *next;
    void *mem;
    size_t size, used;
} kern_cpu_chunk_t;

typedef struct kern_cpu {
    kern_backend_t base;
    kern_pool_t *pool;
    const kern_vecdot_table_t *vd;
    /* scratch reused across calls (grown, never shrunk): quantized activations,
     * per-thread decode rows for K-quants, attention scores */
    void *scratch;
    size_t scratch_cap;
    kern_cpu_chunk_t *arena; /* repacked weights (backend_cpu.c) */
    bool vnni;               /* repacked kernels with AVX-512 VNNI (repack.h) */
    bool ref;                /* reference numerics: llama.cpp's orders of operations */
} kern_cpu_t;

/* Grows the backend scratch to at least bytes; returns it or NULL. */
void *kern_cpu_scratch(kern_cpu_t *c, size_t bytes);

td_status_t kern_cpu_matmul(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n);
td_status_t kern_cpu_matmul_multi(kern_backend_t *b, const kern_weight_t *const *w, float *const *y, uint32_t k,
                                  const float *x, uint32_t n);
td_status_t kern_cpu_rmsnorm(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t dim,
                             float eps);
td_status_t kern_cpu_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t head_dim,
                          const int32_t *pos, const float *freq, kern_rope_style_t style);
td_status_t kern_cpu_swiglu(kern_backend_t *b, const float *gate, const float *up, float *y, size_t n);
td_status_t kern_cpu_add(kern_backend_t *b, float *x, const float *y, size_t n);
td_status_t kern_cpu_embed(kern_backend_t *b, const kern_weight_t *table, const int32_t *ids, uint32_t n, float *out);
td_status_t kern_cpu_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v,
                              const int32_t *slots, uint32_t n);
td_status_t kern_cpu_attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out,
                               uint32_t n_heads, const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs,
                               uint32_t n_seqs, float scale);

#endif
