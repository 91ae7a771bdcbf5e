// attention_wide.cu — decode attention for steps of many decode rows at short contexts (issue 51).
//
// The split kernel (attention.cu's k_attention_decode) gives a (sequence, KV head) a block of four warps, each
// taking 32 positions of a slice, and meets them at block barriers to merge; at a short context most of the four
// are idle and every block pays the barriers, and with its registers and shared memory four blocks fit an SM:
// a step of 256 sequences at ~76 positions read the KV at under half the GPU's bandwidth (bench/results/
// batched-decode-2026-12-05.md). Here a block is one warp and takes one (sequence, KV head) over its whole
// context, in chunks of 32 positions: the chunk's K and V rows are copied into the warp's shared memory by
// cp.async (the first chunk's before the programmatic wait: earlier steps stored them), lane j scores
// position j for each query head of the group, the warp keeps each head's running softmax, and lane i holds
// head_dim / 32 consecutive values of each head's output. No barrier but the warp's own.
//
// With the rope and KV store folded in (rope_kv_attention) the warp rotates the row's query and K, stores K and
// V to the row's slot, and puts the row's own K and V into its chunk from registers' copies (its copy from the
// pool could pass the store). fp16 KV; head_dim 64 or 128; up to 8 query heads a KV head. The query is rounded
// to fp16 after the rope, as the other kernels and the CPU backend do.
#include "kernels/cuda/attention_int.h"

#define WD_CH 32  // positions a chunk: one a lane
#define WD_KPAD 8 // halves past each shared K row: the lanes' 16-byte reads of one offset fall in distinct banks
#define WD_MAXG 8

// A block's shared memory: queries [G][hd] and the row's own K and V [hd] (fp32), the softmax weights [G][32],
// then the chunk's K [32][hd + KPAD] and V [32][hd] rows (fp16)
static size_t wd_smem(uint32_t hd, uint32_t group)
{
    return ((size_t)group * hd + 2 * hd + (size_t)group * WD_CH) * sizeof(float) +
           ((size_t)WD_CH * (hd + WD_KPAD) + (size_t)WD_CH * hd) * sizeof(__half);
}

template <int HD, int GM> __global__ void __launch_bounds__(32) k_attention_wide(const att_args_t a)
{
    constexpr int E = HD / 32, LPR = HD / 8, RPI = 32 / LPR; // values a lane; lanes a row copy; rows an issue
    extern __shared__ float wsm[];
    const uint32_t lane = threadIdx.x, G = GM <= 2 ? GM : a.group, half = HD / 2;
    float *sq = wsm, *sk_own = sq + G * HD, *sv_own = sk_own + HD, *pw = sv_own + HD;
    __half *sk = (__half *)(pw + G * WD_CH), *sv = sk + WD_CH * (HD + WD_KPAD);
    const att_seq_t S = dec_seq(a, blockIdx.x);
    const uint32_t kvh = blockIdx.y, h0 = kvh * G, ctx = S.pos0 + 1;
    const uint32_t bt_shift = __ffs(a.bt) - 1, bt_mask = a.bt - 1;
    const size_t k_off = att_rows(a, 0, kvh), v_off = att_rows(a, 1, kvh);
    // the chunk from c0's K and V rows into shared memory, all but position `skip`'s, as one cp.async group;
    // a row HD / 8 lanes (16 bytes each), RPI rows an issue
    auto copy = [&](uint32_t c0, uint32_t skip) {
        const uint32_t pos = c0 + lane;
        const uint8_t *pg = pos < ctx ? a.base + (size_t)S.table[pos >> bt_shift] * a.block_bytes : a.base;
        const size_t in_blk = (size_t)(pos & bt_mask) * HD;
        const __half *mk = (const __half *)pg + k_off + in_blk, *mv = (const __half *)pg + v_off + in_blk;
        const uint32_t n_live = min((uint32_t)WD_CH, ctx - c0);
#pragma unroll
        for (uint32_t it = 0; it < WD_CH / RPI; it++) {
            const uint32_t t = it * RPI + lane / LPR, seg = (lane % LPR) * 8;
            const __half *kr = (const __half *)__shfl_sync(0xffffffffu, (unsigned long long)mk, t);
            const __half *vr = (const __half *)__shfl_sync(0xffffffffu, (unsigned long long)mv, t);
            if (t < n_live && c0 + t != skip) {
                cp_async16(sk + t * (HD + WD_KPAD) + seg, kr + seg, true);
                cp_async16(sv + t * HD + seg, vr + seg, true);
            }
        }
        cp_async_commit();
    };
    copy(0, S.pos0); // stored by earlier steps: before the wait
    kc_pdl_wait();
    kc_pdl_release();
    for (uint32_t i = lane; i < G * HD; i += 32)
        sq[i] = a.q[((size_t)S.row0 * a.n_heads + h0 + i / HD) * HD + i % HD];
    if (a.rope) { // rope_kv_store's work for the row: its query and K rotated, K and V stored to its slot
        const size_t kv_row = ((size_t)S.row0 * a.n_kv + kvh) * HD;
        const int32_t rpos = a.rpos[S.row0];
        const uint32_t slot = (uint32_t)a.rslots[S.row0];
        for (uint32_t d = lane; d < HD; d += 32)
            sk_own[d] = a.rk[kv_row + d], sv_own[d] = a.rv[kv_row + d];
        __syncwarp();
        uint8_t *base = (uint8_t *)a.base;
        for (uint32_t p = lane; p < half; p += 32) {
            float s, c;
            kc_rope_angle(rpos, a.rfreq, p, &s, &c);
            kc_rope_store_k<__half>(sk_own, p, HD, s, c, a.rneox, base, a.block_bytes, a.layer, a.n_kv, a.bt, slot,
                                    kvh);
        }
        for (uint32_t d = lane; d < HD; d += 32)
            *kc_kv_dst<__half>(base, a.block_bytes, a.layer, 1, a.n_kv, a.bt, HD, slot, kvh, d) =
                __float2half_rn(sv_own[d]);
        for (uint32_t i = lane; i < G * half; i += 32) {
            uint32_t ia, ib;
            kc_rope_pair(sq + (i / half) * HD, i % half, HD, rpos, a.rfreq, a.rneox, &ia, &ib);
        }
    } else if (S.pos0 < WD_CH) { // the row's K and V, stored by the kernel before: after the wait
        const uint32_t t = S.pos0;
        const uint8_t *pg = a.base + (size_t)S.table[S.pos0 >> bt_shift] * a.block_bytes;
        const size_t in_blk = (size_t)(S.pos0 & bt_mask) * HD;
        if (lane < LPR) {
            cp_async16(sk + t * (HD + WD_KPAD) + lane * 8, (const __half *)pg + k_off + in_blk + lane * 8, true);
            cp_async16(sv + t * HD + lane * 8, (const __half *)pg + v_off + in_blk + lane * 8, true);
        }
        cp_async_commit();
    }
    __syncwarp();
    for (uint32_t i = lane; i < G * HD; i += 32) // the query as the fp16 KV's arithmetic takes it
        sq[i] = __half2float(__float2half_rn(sq[i]));
    float m[GM], l[GM], acc[GM][E];
#pragma unroll
    for (int h = 0; h < GM; h++) {
        m[h] = -INFINITY, l[h] = 0;
#pragma unroll
        for (int i = 0; i < E; i++)
            acc[h][i] = 0;
    }
    for (uint32_t c0 = 0; c0 < ctx; c0 += WD_CH) {
        if (c0)
            copy(c0, a.rope ? S.pos0 : UINT32_MAX);
        cp_async_wait<0>();
        __syncwarp();
        const uint32_t n_live = min((uint32_t)WD_CH, ctx - c0);
        if (a.rope && S.pos0 - c0 < n_live) { // the row's own K and V, as stored
            const uint32_t t = S.pos0 - c0;
            for (uint32_t d = lane; d < HD; d += 32) {
                sk[t * (HD + WD_KPAD) + d] = __float2half_rn(sk_own[d]);
                sv[t * HD + d] = __float2half_rn(sv_own[d]);
            }
            __syncwarp();
        }
        // scores: lane j, position c0 + j, for each head (four partial sums, so that the FMAs are not one chain)
        float sp[GM][4];
#pragma unroll
        for (int h = 0; h < GM; h++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                sp[h][j] = 0;
        if (lane < n_live) {
            const __half *kr = sk + lane * (HD + WD_KPAD);
#pragma unroll
            for (int d = 0; d < HD; d += 8) {
                const uint4 u = *(const uint4 *)(kr + d);
                const __half2 *k2 = (const __half2 *)&u;
                float k[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 f = __half22float2(k2[i]);
                    k[2 * i] = f.x, k[2 * i + 1] = f.y;
                }
#pragma unroll
                for (int h = 0; h < GM; h++)
                    if (GM <= 2 || h < (int)G) {
                        const float4 q0 = *(const float4 *)(sq + h * HD + d), q1 = *(const float4 *)(sq + h * HD + d + 4);
                        sp[h][0] += q0.x * k[0] + q0.y * k[1];
                        sp[h][1] += q0.z * k[2] + q0.w * k[3];
                        sp[h][2] += q1.x * k[4] + q1.y * k[5];
                        sp[h][3] += q1.z * k[6] + q1.w * k[7];
                    }
            }
        }
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= (int)G)
                break;
            const float s = lane < n_live ? (sp[h][0] + sp[h][1] + sp[h][2] + sp[h][3]) * a.scale : -INFINITY;
            float mt = s;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m[h], mt); // finite: the chunk has a live position
            const float corr = __expf(m[h] - mn), e = lane < n_live ? __expf(s - mn) : 0.0f;
            float es = e;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                es += __shfl_xor_sync(0xffffffffu, es, o);
            l[h] = l[h] * corr + es;
            m[h] = mn;
#pragma unroll
            for (int i = 0; i < E; i++)
                acc[h][i] *= corr;
            pw[h * WD_CH + lane] = e;
        }
        __syncwarp();
        // P·V: lane i's E consecutive values of each head, over the chunk's live rows
        for (uint32_t t = 0; t < n_live; t++) {
            float v[E];
            if constexpr (E == 4) {
                const uint2 r = *(const uint2 *)(sv + t * HD + lane * 4);
                const float2 x = __half22float2(*(const __half2 *)&r.x), y = __half22float2(*(const __half2 *)&r.y);
                v[0] = x.x, v[1] = x.y, v[2] = y.x, v[3] = y.y;
            } else {
                const float2 x = __half22float2(*(const __half2 *)(sv + t * HD + lane * 2));
                v[0] = x.x, v[1] = x.y;
            }
#pragma unroll
            for (int h = 0; h < GM; h++)
                if (GM <= 2 || h < (int)G) {
                    const float p = pw[h * WD_CH + t];
#pragma unroll
                    for (int i = 0; i < E; i++)
                        acc[h][i] += p * v[i];
                }
        }
        __syncwarp(); // every lane is done with the chunk before the next one's copies land
    }
#pragma unroll
    for (int h = 0; h < GM; h++)
        if (GM <= 2 || h < (int)G) {
            float *o = a.out + ((size_t)S.row0 * a.n_heads + h0 + h) * HD + lane * E;
            const float inv = 1.0f / l[h];
#pragma unroll
            for (int i = 0; i < E; i++)
                o[i] = acc[h][i] * inv;
        }
}

typedef void (*wd_fn_t)(att_args_t);
template <int HD> static wd_fn_t wd_by_group(uint32_t group)
{
    return group <= 1   ? k_attention_wide<HD, 1>
           : group <= 2 ? k_attention_wide<HD, 2>
           : group <= 4 ? k_attention_wide<HD, 4>
                        : k_attention_wide<HD, WD_MAXG>;
}
static wd_fn_t wd_kernel(uint32_t hd, uint32_t group) { return hd == 64 ? wd_by_group<64>(group) : wd_by_group<128>(group); }

bool kc_attention_wide_takes(const td_kv_layout_t *g, uint32_t group)
{
    return g->dtype == TD_KV_F16 && (g->head_dim == 64 || g->head_dim == 128) && group >= 1 && group <= WD_MAXG;
}

td_status_t kc_attention_wide_init(kern_cuda_t *c)
{
    (void)c;
    for (uint32_t group = 1; group <= WD_MAXG; group *= 2)
        for (uint32_t hd = 64; hd <= 128; hd *= 2)
            CU(cudaFuncSetAttribute(wd_kernel(hd, group), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)wd_smem(hd, WD_MAXG)));
    return TD_OK;
}

td_status_t kc_attention_wide(kern_cuda_t *c, const att_args_t &a, const td_kv_layout_t *g)
{
    return kc_launch(c, "attention_wide", wd_kernel(g->head_dim, a.group), dim3(a.n_seqs, a.n_kv), 32,
                     wd_smem(g->head_dim, a.group), a);
}
