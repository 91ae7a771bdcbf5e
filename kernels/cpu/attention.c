/* attention.c — causal attention over paged KV, and storing KV into pages.
 *
 * Shapes: q, out [rows][n_heads][head_dim]; the KV of layer L for token slot s
 * (block s / block_tokens, offset s % block_tokens) is at
 *   block + ((L * 2 + 0|1) * n_kv_heads + kv_head) * block_tokens * head_dim + offset * head_dim
 * (the canonical block layout of engine/kv_pool.h), fp32, fp16 or fp8_e4m3 (a row
 * with its fp32 scale, kern_fp8_quantize_row's form; common/kv_contract.h).
 *
 * How it works: one task per (query row, head). It walks the sequence's
 * blocks up to the row's own position and keeps a running softmax (max, sum
 * and the weighted sum of V, rescaled when the max grows), so no score buffer
 * as long as the context is needed. fp16 KV is widened to fp32; all arithmetic
 * is fp32. Where the CPU has it (vecdot.h's attn_rows_f16) a task takes the
 * query heads that share a KV head, and walks up to 16 positions at a time:
 * K and V widened once for them, their scores together, one rescale per
 * stretch, vector exps. Query heads share KV heads in groups (GQA). A backend with
 * reference numerics takes llama.cpp's two-pass path instead (refnum.h). fp8
 * KV takes the grouped walk too, each stretch's rows widened to fp32 once (a
 * table of the 256 codes) and multiplied by their scales. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_int.h"
#include "kernels/cpu/refnum.h"
#include "kernels/quant.h"

static float fp8_table[256];
static pthread_once_t fp8_once = PTHREAD_ONCE_INIT;
static void fp8_table_fill(void)
{
    for (int i = 0; i < 256; i++)
        fp8_table[i] = kern_fp8_to_fp32((uint8_t)i);
}

/* fp8 KV: one row of hd codes widened into out, times its scale (a table: the codes' bit tricks make fp32
 * subnormals, which cost a microcode assist each) */
static void fp8_row(const uint8_t *q, float *out, uint32_t hd, float scale)
{
    for (uint32_t i = 0; i < hd; i++)
        out[i] = fp8_table[q[i]] * scale;
}

td_status_t kern_cpu_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v,
                              const int32_t *slots, uint32_t n)
{
    const kern_cpu_t *c = (const kern_cpu_t *)b;
    size_t es = td_kv_dtype_size(kv->layout->dtype);
    for (uint32_t t = 0; t < n; t++) {
        uint32_t blk = (uint32_t)slots[t] / kv->layout->block_tokens, off = (uint32_t)slots[t] % kv->layout->block_tokens;
        uint8_t *base = (uint8_t *)kv->base + (size_t)blk * kv->block_bytes;
        for (uint32_t h = 0; h < kv->layout->n_kv_heads; h++) {
            for (uint32_t which = 0; which < 2; which++) {
                const float *src = (which ? v : k) + ((size_t)t * kv->layout->n_kv_heads + h) * kv->layout->head_dim;
                uint8_t *dst = base + (kern_kv_offset(kv, which, h) + (size_t)off * kv->layout->head_dim) * es;
                if (kv->layout->dtype == TD_KV_F32) {
                    memcpy(dst, src, kv->layout->head_dim * sizeof(float));
                } else if (kv->layout->dtype == TD_KV_F8_E4M3) {
                    float scale;
                    kern_fp8_quantize_row(src, kv->layout->head_dim, dst, &scale);
                    memcpy(base + td_kv_scale_offset(kv->layout, kv->layer, which, h) + (size_t)off * sizeof(float),
                           &scale, sizeof scale);
                } else {
                    c->vd->to_f16(src, (uint16_t *)(void *)dst, kv->layout->head_dim);
                }
            }
        }
    }
    return TD_OK;
}

typedef struct attn_job {
    const kern_kv_view_t *kv;
    const float *q;
    float *out;
    uint32_t n_heads;
    const kern_attn_seq_t *seqs;
    uint32_t n_seqs;
    float scale;
    uint32_t total_rows;
    const kern_vecdot_table_t *vd;
} attn_job_t;

/* The sequence query row `row` belongs to, and the row's position in it. */
static const kern_attn_seq_t *row_seq(const attn_job_t *j, uint32_t row, uint32_t *pos)
{
    const kern_attn_seq_t *s = j->seqs;
    while (row >= s->row0 + s->n)
        s++;
    *pos = s->pos0 + (row - s->row0);
    return s;
}

/* The grouped walks' stretch from position p: up to 16 positions, inside p's block, up to pos (the same stretches
 * for a row however its sequence was split into chunks). */
static inline uint32_t stretch(uint32_t p, uint32_t pos, uint32_t bt)
{
    uint32_t off = p % bt, n = bt - off < 16 ? bt - off : 16;
    return pos + 1 - p < n ? pos + 1 - p : n;
}

/* out's rows of query heads head .. head + nq - 1 of `row`: the grouped walks' sums over their softmax totals */
static void group_out(const attn_job_t *j, uint32_t row, uint32_t head, uint32_t nq, uint32_t hd, const float *acc,
                      const float *l)
{
    for (uint32_t r = 0; r < nq; r++) {
        float *o = j->out + ((size_t)row * j->n_heads + head + r) * hd;
        for (uint32_t i = 0; i < hd; i++)
            o[i] = acc[r * hd + i] / l[r];
    }
}

/* One position's score sc into a running softmax (max *m, sum *l, the weighted sum acc of hd values, rescaled when
 * the max grows): its weight, for the caller to add its V row with. */
static inline float softmax_step(float sc, float *m, float *l, float *acc, uint32_t hd)
{
    if (sc > *m) {
        float r = expf(*m - sc);
        *l *= r;
        for (uint32_t i = 0; i < hd; i++)
            acc[i] *= r;
        *m = sc;
    }
    float e = expf(sc - *m);
    *l += e;
    return e;
}

static void attn_task(void *ctx, int task, int n_tasks)
{
    (void)n_tasks;
    const attn_job_t *j = ctx;
    const kern_kv_view_t *kv = j->kv;
    uint32_t row = (uint32_t)task / j->n_heads, head = (uint32_t)task % j->n_heads, pos;
    const kern_attn_seq_t *s = row_seq(j, row, &pos);
    uint32_t hd = kv->layout->head_dim, kvh = head / (j->n_heads / kv->layout->n_kv_heads);
    size_t es = kv->layout->dtype == TD_KV_F16 ? 2 : 4;
    kern_vec_dot_fn dot = kv->layout->dtype == TD_KV_F16 ? j->vd->f16_f32 : j->vd->f32_f32;
    kern_axpy_fn axpy = kv->layout->dtype == TD_KV_F16 ? j->vd->axpy_f16 : j->vd->axpy_f32;
    const float *q = j->q + ((size_t)row * j->n_heads + head) * hd;
    float qr[512];
    if (kv->layout->dtype == TD_KV_F16) { /* q·k in fp16 inputs, fp32 sums */
        uint16_t qh[512];
        j->vd->to_f16(q, qh, hd);
        for (uint32_t i = 0; i < hd; i++)
            qr[i] = kern_fp16_to_fp32(qh[i]);
        q = qr;
    }
    size_t k_off = kern_kv_offset(kv, 0, kvh) * es, v_off = kern_kv_offset(kv, 1, kvh) * es, row_bytes = hd * es;
    float acc[512];
    memset(acc, 0, hd * sizeof(float));
    float m = -INFINITY, l = 0;
    for (uint32_t p = 0; p <= pos; p++) {
        uint32_t blk = (uint32_t)s->block_table[p / kv->layout->block_tokens], off = p % kv->layout->block_tokens;
        const uint8_t *base = (const uint8_t *)kv->base + (size_t)blk * kv->block_bytes + off * row_bytes;
        float e = softmax_step(dot(base + k_off, q, hd) * j->scale, &m, &l, acc, hd);
        axpy(e, base + v_off, acc, hd);
    }
    float *o = j->out + ((size_t)row * j->n_heads + head) * hd;
    for (uint32_t i = 0; i < hd; i++)
        o[i] = acc[i] / l;
}

/* The walk over fp8 KV: one task per (query row, KV head) for the query heads that share it, in stretches of up to
 * 16 positions inside one block (as attn_group_task's: the same stretches for a row however its sequence was split
 * into chunks), each stretch's K and V rows widened and scaled once for them all. */
static void attn_fp8_task(void *ctx, int task, int n_tasks)
{
    (void)n_tasks;
    const attn_job_t *j = ctx;
    const kern_kv_view_t *kv = j->kv;
    const td_kv_layout_t *g = kv->layout;
    uint32_t n_kv = g->n_kv_heads, group = j->n_heads / n_kv;
    uint32_t row = (uint32_t)task / n_kv, kvh = (uint32_t)task % n_kv, pos;
    const kern_attn_seq_t *s = row_seq(j, row, &pos);
    uint32_t hd = g->head_dim, bt = g->block_tokens;
    size_t k_off = kern_kv_offset(kv, 0, kvh), v_off = kern_kv_offset(kv, 1, kvh);
    size_t ks_off = td_kv_scale_offset(g, kv->layer, 0, kvh), vs_off = td_kv_scale_offset(g, kv->layer, 1, kvh);
    float kr[16 * 512], vr[16 * 512], acc[8 * 512], m[8], l[8];
    for (uint32_t h0 = 0; h0 < group; h0 += 8) {
        uint32_t nq = group - h0 < 8 ? group - h0 : 8, head = kvh * group + h0;
        for (uint32_t r = 0; r < nq; r++)
            m[r] = -INFINITY, l[r] = 0;
        memset(acc, 0, (size_t)nq * hd * sizeof(float));
        for (uint32_t p = 0, n; p <= pos; p += n) {
            uint32_t off = p % bt;
            n = stretch(p, pos, bt);
            const uint8_t *blk = (const uint8_t *)kv->base + (size_t)s->block_table[p / bt] * kv->block_bytes;
            for (uint32_t i = 0; i < n; i++) {
                float ks, vs;
                memcpy(&ks, blk + ks_off + (size_t)(off + i) * sizeof(float), sizeof ks);
                memcpy(&vs, blk + vs_off + (size_t)(off + i) * sizeof(float), sizeof vs);
                fp8_row(blk + k_off + (size_t)(off + i) * hd, kr + (size_t)i * hd, hd, ks);
                fp8_row(blk + v_off + (size_t)(off + i) * hd, vr + (size_t)i * hd, hd, vs);
            }
            for (uint32_t r = 0; r < nq; r++) {
                const float *q = j->q + ((size_t)row * j->n_heads + head + r) * hd;
                for (uint32_t i = 0; i < n; i++) {
                    float e = softmax_step(j->vd->f32_f32(kr + (size_t)i * hd, q, hd) * j->scale, &m[r], &l[r],
                                           acc + (size_t)r * hd, hd);
                    j->vd->axpy_f32(e, vr + (size_t)i * hd, acc + (size_t)r * hd, hd);
                }
            }
        }
        group_out(j, row, head, nq, hd, acc, l);
    }
}

/* The same walk for fp16 KV where the CPU has attn_rows_f16: one task per (query row, KV head) for the query heads
 * that share it (up to 8 at a time), in stretches of up to 16 positions inside one block — the same stretches for a
 * row however its sequence was split into chunks, so a row's output does not depend on what was cached. */
static void attn_group_task(void *ctx, int task, int n_tasks)
{
    (void)n_tasks;
    const attn_job_t *j = ctx;
    const kern_kv_view_t *kv = j->kv;
    uint32_t n_kv = kv->layout->n_kv_heads, group = j->n_heads / n_kv;
    uint32_t row = (uint32_t)task / n_kv, kvh = (uint32_t)task % n_kv, pos;
    const kern_attn_seq_t *s = row_seq(j, row, &pos);
    uint32_t hd = kv->layout->head_dim, bt = kv->layout->block_tokens;
    size_t k_off = kern_kv_offset(kv, 0, kvh) * 2, v_off = kern_kv_offset(kv, 1, kvh) * 2, row_bytes = hd * 2;
    float qr[8 * 512], acc[8 * 512], m[8], l[8];
    for (uint32_t h0 = 0; h0 < group; h0 += 8) {
        uint32_t nq = group - h0 < 8 ? group - h0 : 8, head = kvh * group + h0;
        for (uint32_t r = 0; r < nq; r++) { /* q·k in fp16 inputs, fp32 sums */
            uint16_t qh[512];
            j->vd->to_f16(j->q + ((size_t)row * j->n_heads + head + r) * hd, qh, hd);
            for (uint32_t i = 0; i < hd; i++)
                qr[r * hd + i] = kern_fp16_to_fp32(qh[i]);
            m[r] = -INFINITY, l[r] = 0;
        }
        memset(acc, 0, (size_t)nq * hd * sizeof(float));
        for (uint32_t p = 0, n; p <= pos; p += n) {
            uint32_t off = p % bt;
            n = stretch(p, pos, bt);
            const uint8_t *base = (const uint8_t *)kv->base + (size_t)s->block_table[p / bt] * kv->block_bytes +
                                  off * row_bytes;
            j->vd->attn_rows_f16(base + k_off, base + v_off, n, qr, nq, hd, j->scale, m, l, acc);
        }
        group_out(j, row, head, nq, hd, acc, l);
    }
}

#if defined(__x86_64__)
/* Reference numerics (refnum.h): two passes over the positions, as llama.cpp */
static void attn_ref_task(void *ctx, int task, int n_tasks)
{
    (void)n_tasks;
    const attn_job_t *j = ctx;
    uint32_t row = (uint32_t)task / j->n_heads, head = (uint32_t)task % j->n_heads, pos;
    const kern_attn_seq_t *s = row_seq(j, row, &pos);
    uint32_t n_pad = (pos + 1 + 31) / 32 * 32;
    float stack[4096 * 3 / 2];
    float *scratch = n_pad <= 4096 ? stack : malloc((size_t)n_pad * 6);
    if (!scratch) /* no memory: leave a NaN row rather than a wrong one */
        return (void)memset(j->out + ((size_t)row * j->n_heads + head) * j->kv->layout->head_dim, 0xff,
                            j->kv->layout->head_dim * sizeof(float));
    kern_ref_attention_row(j->kv, s, row, head, j->n_heads, j->q, j->out, j->scale, scratch);
    if (scratch != stack)
        free(scratch);
}
#endif

td_status_t kern_cpu_attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out,
                               uint32_t n_heads, const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs,
                               uint32_t n_seqs, float scale)
{
    (void)dev_seqs; /* host memory: seqs is the one copy */
    kern_cpu_t *c = (kern_cpu_t *)b;
    uint32_t rows = 0;
    for (uint32_t i = 0; i < n_seqs; i++)
        rows = seqs[i].row0 + seqs[i].n > rows ? seqs[i].row0 + seqs[i].n : rows;
    attn_job_t j = {kv, q, out, n_heads, seqs, n_seqs, scale, rows, c->vd};
#if defined(__x86_64__)
    if (c->ref && kv->layout->dtype == TD_KV_F16 && kv->layout->head_dim % 8 == 0) {
        kern_pool_run(c->pool, (int)(rows * n_heads), attn_ref_task, &j);
        return TD_OK;
    }
#endif
    if (kv->layout->dtype == TD_KV_F8_E4M3) {
        pthread_once(&fp8_once, fp8_table_fill);
        kern_pool_run(c->pool, (int)(rows * kv->layout->n_kv_heads), attn_fp8_task, &j);
    } else if (kv->layout->dtype == TD_KV_F16 && c->vd->attn_rows_f16 && kv->layout->head_dim % 8 == 0)
        kern_pool_run(c->pool, (int)(rows * kv->layout->n_kv_heads), attn_group_task, &j);
    else
        kern_pool_run(c->pool, (int)(rows * n_heads), attn_task, &j);
    return TD_OK;
}
