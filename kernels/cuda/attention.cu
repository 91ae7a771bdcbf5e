// attention.cu — causal attention over the paged KV pool, for prefill (many
// rows of a sequence, with or without a cached prefix) and decode (one row
// per sequence) alike.
//
// A thread block takes a tile of one sequence's query rows and the query
// heads of one KV head (GQA: the group shares every K and V load), at most
// 16 (row, head) pairs, 4 per warp. It walks the sequence's positions up to
// its last row's in tiles of 32, gathered from the pages of the block table
// into shared memory as fp32; lane j scores position j of the tile for a
// pair, the warp keeps the pair's running softmax (max, sum, and the
// weighted sum of V with each lane holding head_dim / 32 of it) and rescales
// when the max grows, so no score buffer as long as the context is needed.
// Arithmetic is fp32; with fp16 KV the query is rounded to fp16 first, as
// the CPU backend does. head_dim: at most 256.
#include "kernels/cuda/cuda_int.h"

#define ATT_WARPS 4
#define ATT_PAIRS 4 // (row, head) pairs per warp
#define ATT_KT 32   // positions per K/V tile (one per lane)
#define ATT_MAXD 8  // head_dim / 32 at most
#define ATT_MAXSEQ 96

typedef struct att_seq {
    const int32_t *table;
    uint32_t row0, n, pos0, tile0; // tile0: the first of its tiles in this launch
} att_seq_t;

typedef struct att_args {
    att_seq_t seq[ATT_MAXSEQ];
    uint32_t n_seqs;
    const uint8_t *base;
    size_t block_bytes;
    uint32_t layer, n_kv, bt, hd, n_heads, group, hc, qt;
    float scale;
    const float *q;
    float *out;
} att_args_t;

static size_t att_smem(uint32_t hd) { return ((size_t)16 * hd + ATT_KT * (hd + 1) + ATT_KT * hd) * sizeof(float); }

template <typename T> __device__ __forceinline__ float kc_to_float(T v);
template <> __device__ __forceinline__ float kc_to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float kc_to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __global__ void __launch_bounds__(ATT_WARPS * 32) k_attention(const att_args_t a)
{
    extern __shared__ float sm[];
    const uint32_t hd = a.hd, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *sq = sm;                    // [16][hd]: the pairs' queries, scaled
    float *sk = sq + 16 * hd;          // [KT][hd + 1]: K rows (padded: lane j reads row j with few conflicts)
    float *sv = sk + ATT_KT * (hd + 1); // [KT][hd]
    uint32_t s = 0;
    while (s + 1 < a.n_seqs && a.seq[s + 1].tile0 <= blockIdx.x)
        s++;
    const att_seq_t S = a.seq[s];
    const uint32_t r0 = (blockIdx.x - S.tile0) * a.qt, rows = min(a.qt, S.n - r0);
    const uint32_t kvh = blockIdx.y, h0 = kvh * a.group + blockIdx.z * a.hc;
    const uint32_t hc = min(a.hc, a.group - blockIdx.z * a.hc), npairs = rows * hc;
    for (uint32_t i = threadIdx.x; i < npairs * hd; i += blockDim.x) {
        uint32_t p = i / hd, d = i % hd;
        float v = a.q[((size_t)(S.row0 + r0 + p / hc) * a.n_heads + h0 + p % hc) * hd + d];
        if (sizeof(T) == 2)
            v = __half2float(__float2half_rn(v));
        sq[p * hd + d] = v;
    }
    const uint32_t last = S.pos0 + r0 + rows - 1; // the tile's last row's position
    const size_t k_off = (((size_t)a.layer * 2 + 0) * a.n_kv + kvh) * a.bt * hd;
    const size_t v_off = (((size_t)a.layer * 2 + 1) * a.n_kv + kvh) * a.bt * hd;
    float m[ATT_PAIRS], l[ATT_PAIRS], acc[ATT_PAIRS][ATT_MAXD];
#pragma unroll
    for (int j = 0; j < ATT_PAIRS; j++) {
        m[j] = -INFINITY, l[j] = 0;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            acc[j][i] = 0;
    }
    for (uint32_t p0 = 0; p0 <= last; p0 += ATT_KT) {
        __syncthreads(); // the previous tile is read by every warp
        for (uint32_t i = threadIdx.x; i < ATT_KT * hd; i += blockDim.x) {
            uint32_t j = i / hd, d = i % hd, pos = p0 + j;
            float kf = 0, vf = 0;
            if (pos <= last) {
                const T *blk = (const T *)(a.base + (size_t)S.table[pos / a.bt] * a.block_bytes);
                size_t o = (size_t)(pos % a.bt) * hd + d;
                kf = kc_to_float<T>(blk[k_off + o]);
                vf = kc_to_float<T>(blk[v_off + o]);
            }
            sk[j * (hd + 1) + d] = kf;
            sv[j * hd + d] = vf;
        }
        __syncthreads();
        // every index into m, l and acc is a constant once unrolled
#pragma unroll
        for (int j = 0; j < ATT_PAIRS; j++) {
            const uint32_t p = warp * ATT_PAIRS + j;
            const uint32_t pos_r = S.pos0 + r0 + p / hc, pos = p0 + lane;
            const bool live = p < npairs && pos <= pos_r;
            float sc = -INFINITY;
            if (live) {
                const float *qv = sq + p * hd, *kr = sk + lane * (hd + 1);
                float dot = 0;
                for (uint32_t d = 0; d < hd; d++)
                    dot += qv[d] * kr[d];
                sc = dot * a.scale;
            }
            float mt = sc;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            // mt is -inf when the pair is not this warp's or every position of
            // the tile is after its row's: nothing to add
            const float mn = fmaxf(m[j], mt);
            const float corr = mt == -INFINITY ? 1.0f : __expf(m[j] - mn);
            const float e = live ? __expf(sc - mn) : 0.0f;
            float es = e;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                es += __shfl_xor_sync(0xffffffffu, es, o);
            l[j] = l[j] * corr + es;
            m[j] = mn;
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++)
                acc[j][i] *= corr;
            if (mt != -INFINITY) {
#pragma unroll 4
                for (int t = 0; t < ATT_KT; t++) {
                    const float pt = __shfl_sync(0xffffffffu, e, t);
                    const float *vr = sv + t * hd + lane;
#pragma unroll
                    for (int i = 0; i < ATT_MAXD; i++)
                        if (lane + 32 * i < hd)
                            acc[j][i] += pt * vr[32 * i];
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < ATT_PAIRS; j++) {
        const uint32_t p = warp * ATT_PAIRS + j;
        if (p < npairs) {
            float *o = a.out + ((size_t)(S.row0 + r0 + p / hc) * a.n_heads + h0 + p % hc) * hd;
            const float inv = 1.0f / l[j];
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++)
                if (lane + 32 * i < hd)
                    o[lane + 32 * i] = acc[j][i] * inv;
        }
    }
}

td_status_t kc_attention_init(void)
{
    int bytes = (int)att_smem(32 * ATT_MAXD);
    CU(cudaFuncSetAttribute(k_attention<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CU(cudaFuncSetAttribute(k_attention<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return TD_OK;
}

td_status_t kc_attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out, uint32_t n_heads,
                         const kern_attn_seq_t *seqs, uint32_t n_seqs, float scale)
{
    const td_kv_layout_t *g = kv->layout;
    if (!g->head_dim || g->head_dim > 32 * ATT_MAXD)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: attention: head_dim %u is past %u", g->head_dim, 32 * ATT_MAXD);
    if (!g->n_kv_heads || n_heads % g->n_kv_heads)
        return td_error(TD_ERR_INVALID_ARG, "cuda: attention: %u heads over %u KV heads", n_heads, g->n_kv_heads);
    att_args_t a;
    a.base = (const uint8_t *)kv->base;
    a.block_bytes = kv->block_bytes;
    a.layer = kv->layer;
    a.n_kv = g->n_kv_heads;
    a.bt = g->block_tokens;
    a.hd = g->head_dim;
    a.n_heads = n_heads;
    a.group = n_heads / g->n_kv_heads;
    a.hc = a.group < 16 ? a.group : 16;
    a.qt = 16 / a.hc;
    a.scale = scale;
    a.q = q;
    a.out = out;
    cudaStream_t st = ((kern_cuda_t *)b)->stream;
    size_t smem = att_smem(g->head_dim);
    for (uint32_t s0 = 0; s0 < n_seqs; s0 += ATT_MAXSEQ) { // independent sequences: a launch per 96
        uint32_t tiles = 0;
        a.n_seqs = 0;
        for (uint32_t s = s0; s < n_seqs && s < s0 + ATT_MAXSEQ; s++) {
            if (!seqs[s].n)
                continue;
            a.seq[a.n_seqs++] = (att_seq_t){seqs[s].block_table, seqs[s].row0, seqs[s].n, seqs[s].pos0, tiles};
            tiles += (seqs[s].n + a.qt - 1) / a.qt;
        }
        if (!tiles)
            continue;
        dim3 grid(tiles, a.n_kv, (a.group + a.hc - 1) / a.hc);
        if (g->dtype == TD_KV_F16)
            k_attention<__half><<<grid, ATT_WARPS * 32, smem, st>>>(a);
        else
            k_attention<float><<<grid, ATT_WARPS * 32, smem, st>>>(a);
        td_status_t rc = kc_launched("attention");
        if (rc)
            return rc;
    }
    return TD_OK;
}
