// attention_int.h — what the attention kernels' files share (attention.cu, attention_wide.cu): the launch's
// arguments, the sequences' lookup, the pool's offsets and the asynchronous copies. Internal to kernels/cuda/.
#ifndef KERN_CUDA_ATTENTION_INT_H
#define KERN_CUDA_ATTENTION_INT_H

#include "kernels/cuda/cuda_int.h"

#define ATT_MAXSEQ 96

typedef struct att_seq {
    const int32_t *table;
    uint32_t row0, n, pos0, tile0; // tile0: the first of its tiles in this launch
    uint32_t idx;                  // its index in the caller's array
} att_seq_t;

typedef struct att_args {
    att_seq_t seq[ATT_MAXSEQ];
    uint32_t n_seqs;
    const uint8_t *base;
    size_t block_bytes;
    uint32_t layer, n_kv, bt, hd, n_heads, group, hc, qt;
    size_t lstride; // a layer's elements in a block (fp8: bytes, its scales included)
    float scale;
    const float *q;
    const __half *qh; // prompt rows on the warpgroup MMA: q in fp16 there instead (rope_kv_store's; or NULL)
    float *out;
    __half *outh; // prompt rows on the warpgroup MMA: the output in fp16 too, for the O projection (or NULL)
    int out32;    // the output in fp32 (at out) as well: not when outh alone is read (Q was handed over in fp16)
    float *ws;       // decode: each slice's (max, sum, acc[hd]) per (row, head)
    unsigned *cnt;   // decode: slices finished per (sequence, KV head), back to 0 after the merge
    uint32_t splits; // decode: slices per sequence
    const kern_attn_seq_t *dseq; // decode: the sequences in device memory (read there), or NULL
    int dseq_all; // decode: the launch takes every sequence of dseq, block x the x-th (seq[] unused)
    // decode with the rope and KV store folded in (rope_kv_attention): q is the row's unrotated q, rk and rv
    // its k and v, stored to its slot by the block whose slice has the row's position
    const float *rk, *rv;
    const int32_t *rslots, *rpos;
    const float *rfreq;
    int rope, rneox;
} att_args_t;

// Decode: the launch's i-th sequence, from device memory when the caller gave
// it there (a captured step replays with the positions of the moment).
__device__ __forceinline__ att_seq_t dec_seq(const att_args_t &a, uint32_t i)
{
    if (a.dseq_all) {
        const kern_attn_seq_t d = a.dseq[i];
        return att_seq_t{d.block_table, d.row0, d.n, d.pos0, 0, i};
    }
    att_seq_t S = a.seq[i];
    if (a.dseq) {
        const kern_attn_seq_t d = a.dseq[S.idx];
        S.table = d.block_table, S.row0 = d.row0, S.n = d.n, S.pos0 = d.pos0;
    }
    return S;
}

// Elements from a block's start to the K (which 0) or V (which 1) rows of kvh in the launch's layer; fp8: bytes
// from it to those rows' scales
__device__ __forceinline__ size_t att_rows(const att_args_t &a, uint32_t which, uint32_t kvh)
{
    return a.layer * a.lstride + ((size_t)which * a.n_kv + kvh) * a.bt * a.hd;
}
__device__ __forceinline__ size_t att_scales(const att_args_t &a, uint32_t which, uint32_t kvh)
{
    return a.layer * a.lstride + (size_t)2 * a.n_kv * a.bt * a.hd + ((size_t)which * a.n_kv + kvh) * a.bt * sizeof(float);
}
// 16 bytes global -> shared without passing through registers; zeros when !valid
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid)
{
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 2^x on the special-function unit (-inf gives 0), without exp2f's handling of denormal results: the
// scores' softmax weights are rounded to fp16 anyway
__device__ __forceinline__ float att_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t att_pack_half2(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&h;
}

// The tensor-core prompt kernels' running softmax (k_attention_mma, attention_wg.cu) over one tile's scores sc (rows a and b of the thread, positions p0 + 8n + 2t, + 1 in
// sc[4n..4n+3]), in place: the causal mask (only a tile that reaches past the warp's first row has positions to
// mask), each row's max, the weights (base 2) and their sum; corr: what O is to be multiplied by for the new max
template <int KT>
__device__ __forceinline__ void att_softmax(float (&sc)[KT / 2], uint32_t p0, uint32_t warp_first, uint32_t pos_a,
                                            uint32_t t, float &m_a, float &m_b, float &l_a, float &l_b,
                                            float &corr_a, float &corr_b)
{
    const uint32_t pos_b = pos_a + 8;
    float mx_a = -INFINITY, mx_b = -INFINITY;
    const bool diag = p0 + KT - 1 > warp_first;
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
        if (diag) {
            const uint32_t c = p0 + n * 8 + t * 2;
            if (c > pos_a) sc[4 * n] = -INFINITY;
            if (c + 1 > pos_a) sc[4 * n + 1] = -INFINITY;
            if (c > pos_b) sc[4 * n + 2] = -INFINITY;
            if (c + 1 > pos_b) sc[4 * n + 3] = -INFINITY;
        }
        mx_a = fmaxf(mx_a, fmaxf(sc[4 * n], sc[4 * n + 1]));
        mx_b = fmaxf(mx_b, fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
    }
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o2));
    }
    const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
    // a row with nothing seen yet keeps 0 as its base (no -inf - -inf)
    const float base_a = mn_a == -INFINITY ? 0.0f : mn_a, base_b = mn_b == -INFINITY ? 0.0f : mn_b;
    corr_a = att_ex2(m_a - base_a), corr_b = att_ex2(m_b - base_b);
    m_a = mn_a, m_b = mn_b;
    float sum_a = 0, sum_b = 0;
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
        sc[4 * n] = att_ex2(sc[4 * n] - base_a);
        sc[4 * n + 1] = att_ex2(sc[4 * n + 1] - base_a);
        sc[4 * n + 2] = att_ex2(sc[4 * n + 2] - base_b);
        sc[4 * n + 3] = att_ex2(sc[4 * n + 3] - base_b);
        sum_a += sc[4 * n] + sc[4 * n + 1];
        sum_b += sc[4 * n + 2] + sc[4 * n + 3];
    }
    l_a = l_a * corr_a + sum_a; // the quad's partial sums; reduced once at the end
    l_b = l_b * corr_b + sum_b;
}

// The prompt kernel on Hopper's warpgroup MMA (attention_wg.cu): a block takes the rows of its warpgroups (64 each)
// of one sequence and one query head. The rows a block when it takes the layout (a compute capability 9.0 device,
// fp16 KV, head_dim 64 or 128), else 0; the launch of `tiles` blocks a head.
td_status_t kc_attention_wg_init(kern_cuda_t *c);
uint32_t kc_attention_wg_rows(const kern_cuda_t *c, const td_kv_layout_t *g);
td_status_t kc_attention_wg(kern_cuda_t *c, const att_args_t &a, uint32_t hd, uint32_t tiles, uint32_t n_heads);

// The wide decode kernel (attention_wide.cu): a warp a (sequence, KV head) over the whole context, for steps of
// many decode rows at short contexts, where the split kernel's blocks of four warps left most of them idle.
// Whether it takes the launch (fp16 KV, head_dim 64 or 128, up to 8 query heads a KV head), and the launch.
bool kc_attention_wide_takes(const td_kv_layout_t *g, uint32_t group);
td_status_t kc_attention_wide(kern_cuda_t *c, const att_args_t &a, const td_kv_layout_t *g);
td_status_t kc_attention_wide_init(kern_cuda_t *c);

#endif
