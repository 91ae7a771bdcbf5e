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
//
// Decode rows (one per sequence) take k_attention_decode (flash-decoding):
// the context is split into slices so that even one sequence fills the GPU;
// a block takes one slice of one sequence for one KV head and all the query
// heads of its group, lane j of a warp scoring position j of a chunk of 32
// straight from the pages (fp16 V rows copied to shared memory while the
// scores are made); the last slice of a (sequence, KV head) to finish merges
// the slices' partial softmax states. A short context takes one slice, and
// no merge.
//
// Prompt rows over fp16 KV with head_dim 64 or 128 take the tensor cores
// instead: on compute capability 9.0 the warpgroup MMA (attention_wg.cu),
// elsewhere (and over fp8 KV) k_attention_mma, flash-attention 2's scheme: a block takes 64
// rows of one sequence and one query head, a warp 16 of them; each tile of
// 64 positions is gathered from the pages into shared memory with cp.async
// (K and V rows as in the pool; the next tile's loads in flight while this
// one is used), the operands come out of shared memory with ldmatrix (V's
// transposed), S = Q Kᵀ and O += P V are mma.sync m16n8k16 (fp16 inputs,
// fp32 sums), the softmax runs on the fp32 scores in registers (base 2, the
// scale folded into Q). P is rounded to fp16 for the P V product. The blocks
// of a sequence's last rows, which walk the most positions, go first.
//
// fp8_e4m3 KV (a row's codes and its scale, common/kv_contract.h): decode
// rows take k_attention_decode's fp16 path with rows of bytes (a lane's K row
// in registers, V rows through shared memory by cp.async, 16 values a 16-byte
// load), a K row's scale multiplying its score and a V row's its softmax
// weight, the query in fp32 as on the CPU backend; prompt rows the tensor-core
// kernel, each tile's values widened and scaled to fp16 on their way to
// shared memory (plain loads: cp.async cannot convert); other head_dims
// k_attention.
#include "kernels/cuda/attention_int.h"

#define ATT_WARPS 4
#define ATT_PAIRS 4 // (row, head) pairs per warp
#define ATT_KT 32   // positions per K/V tile (one per lane)
#define ATT_MAXD 8  // head_dim / 32 at most
typedef __nv_fp8_e4m3 kv8_t;

static size_t att_smem(uint32_t hd) { return ((size_t)16 * hd + ATT_KT * (hd + 1) + ATT_KT * hd) * sizeof(float); }

template <typename T> __device__ __forceinline__ float kc_to_float(T v);
template <> __device__ __forceinline__ float kc_to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float kc_to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float kc_to_float<kv8_t>(kv8_t v) { return static_cast<float>(v); }

// A running softmax state at its start: no maximum yet, nothing summed.
template <int N>
__device__ __forceinline__ void softmax_reset(float (&m)[N], float (&l)[N], float (&acc)[N][ATT_MAXD])
{
#pragma unroll
    for (int j = 0; j < N; j++) {
        m[j] = -INFINITY, l[j] = 0;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            acc[j][i] = 0;
    }
}

template <typename T> __global__ void __launch_bounds__(ATT_WARPS * 32) k_attention(const att_args_t a)
{
    kc_pdl_wait();
    kc_pdl_release();
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
    const size_t k_off = att_rows(a, 0, kvh), v_off = att_rows(a, 1, kvh);
    const size_t ks_off = att_scales(a, 0, kvh), vs_off = att_scales(a, 1, kvh); // fp8
    float m[ATT_PAIRS], l[ATT_PAIRS], acc[ATT_PAIRS][ATT_MAXD];
    softmax_reset(m, l, acc);
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
                if constexpr (sizeof(T) == 1) {
                    const uint8_t *b8 = (const uint8_t *)blk;
                    kf *= ((const float *)(b8 + ks_off))[pos % a.bt];
                    vf *= ((const float *)(b8 + vs_off))[pos % a.bt];
                }
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

// ---- decode rows: the context split in slices ----
// 8 values from 16-byte aligned pool memory (head_dim a multiple of 8)
__device__ __forceinline__ void load8(const __half *p, float *f)
{
    const uint4 u = *(const uint4 *)p;
    const __half2 *h = (const __half2 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 x = __half22float2(h[i]);
        f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
}
__device__ __forceinline__ void load8(const kv8_t *p, float *f) // 8-byte aligned
{
    const uint2 u = *(const uint2 *)p;
    const __nv_fp8x2_storage_t *c = (const __nv_fp8x2_storage_t *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(c[i], __NV_E4M3)));
        f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
}
__device__ __forceinline__ void load8(const float *p, float *f)
{
    const float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
#define DEC_MAXG 8 // query heads per KV head this kernel takes
// (sequence, KV head) pairs an SM from which a step of decode rows alone at a context under KC_DEC_KS_CTX takes
// the wide kernel (attention_wide.cu) instead
#define WIDE_MIN_PER_SM 8
#define DEC_SLICE 256 // positions a slice has at least (fewer slices than a.splits where the context is short)

// HD: the head_dim when it is one the kernel is built for (64, 128), so that
// the loops over it unroll and every load of a K row is in flight at once;
// 0 for any other (read from a). With fp16 KV and such a head_dim (SV), a
// lane loads its position's whole K row into registers before it uses any of
// it (loaded and used 32 bytes at a time, a row cost eight trips to memory
// one after another: gpu-2026-11-26b), and each chunk's V rows go to the
// warp's shared rows by cp.async, issued with the K loads and read after the
// scores; otherwise K is read as it is used and V from the pool DEC_VB
// positions at a time. Each chunk's pages are looked up a chunk ahead.
// KS (with SV): the chunk's K rows go to the warp's shared rows by cp.async
// too, a row to HD / 8 lanes, and each lane takes its row from there. A lane
// loading a row of its own makes every load instruction touch 32 lines; these
// touch 2-4 (the attention alone 13-15% faster, gpu-2026-11-26c run 3).
#define DEC_VB 8
#define DEC_KS_WAVES 4 // K through shared memory only for grids of at least this many waves of its blocks
#define DEC_KPAD 8 // halves past each shared K row: the rows of 8 lanes' 16-byte reads fall in different banks
// k_attention_decode's shared memory: the queries, the warps' states, with sv the warps' V rows (fp16) and
// each warp's softmax weights, with sk the warps' K rows
// (es: the KV's bytes a value)
static size_t dec_smem(uint32_t hd, uint32_t group, bool sv, bool sk, size_t es = sizeof(__half))
{
    return ((size_t)DEC_MAXG * hd + (size_t)4 * group * (hd + 2)) * sizeof(float) +
           (sv ? (size_t)4 * 32 * hd * es + (size_t)4 * group * 32 * sizeof(float) : 0) +
           (sv && sk ? (size_t)4 * 32 * (hd + DEC_KPAD) * sizeof(__half) : 0);
}
// 8 values of a 16-byte fp16 load
// values d..d + 7 of a row held as 16-byte loads w (d a multiple of 8): fp16 (a load each) or fp8_e4m3 (half a load)
__device__ __forceinline__ void unpack8(const uint4 u, float *f);
template <typename T> __device__ __forceinline__ void unpack8_at(const uint4 *w, uint32_t d, float *f)
{
    if constexpr (sizeof(T) == 2) {
        unpack8(w[d / 8], f);
    } else {
        const uint4 u = w[d / 16];
        const uint2 c = (d / 8) % 2 ? make_uint2(u.z, u.w) : make_uint2(u.x, u.y);
        const __nv_fp8x2_storage_t *p = (const __nv_fp8x2_storage_t *)&c;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[i], __NV_E4M3)));
            f[2 * i] = x.x, f[2 * i + 1] = x.y;
        }
    }
}
__device__ __forceinline__ void unpack8(const uint4 u, float *f)
{
    const __half2 *h = (const __half2 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 x = __half22float2(h[i]);
        f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
}
// Before its programmatic wait (cuda_int.h's kc_pdl_wait) the kernel reads
// only what no kernel of the step writes: what the host wrote (the sequence,
// its block table, the row's position and slot, the rope's frequencies) and,
// with SV, the K rows (into registers) and V rows (into shared memory) of the
// positions before the row's in each warp's first chunk, which earlier steps
// stored (those kernels have ended: cuda_int.h). The queries and the row's
// own K and V come after the wait.
template <typename T, int HD, int GM, bool KS>
__global__ void __launch_bounds__(128) k_attention_decode(const att_args_t a)
{
    // SV with fp16 or fp8 KV; VPL: values a 16-byte load holds
    constexpr bool SV = HD != 0 && sizeof(T) <= 2, SK = SV && KS, F8 = sizeof(T) == 1;
    constexpr uint32_t VPL = 16 / sizeof(T);
    extern __shared__ float dsm[];
    constexpr int E = HD ? HD / 32 : ATT_MAXD; // values of a head a lane holds
    const uint32_t hd = HD ? HD : a.hd, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = a.group;
    const att_seq_t S = dec_seq(a, blockIdx.x);
    const uint32_t kvh = blockIdx.y, split = blockIdx.z, h0 = kvh * G;
    // the context in slices of at least DEC_SLICE positions, at most a.splits of them (the rest of the grid
    // has nothing to do: a captured step's grid is fixed, its context is not)
    const uint32_t ctx = S.pos0 + 1, splits = min(a.splits, (ctx + DEC_SLICE - 1) / DEC_SLICE);
    if (split >= splits) {
        kc_pdl_wait(); // every block waits, so that the kernel still ends after the one before
        return;
    }
    const uint32_t per = ((ctx + splits - 1) / splits + 31) / 32 * 32;
    const uint32_t lo = split * per, hi = min(ctx, lo + per);
    const bool owner = S.pos0 / per == split; // the block whose slice holds the row's position
    float *sq = dsm;                  // [G][hd] queries
    float *part = sq + DEC_MAXG * hd; // [4 warps][G][hd + 2]: each warp's state
    T *sv = (T *)(part + 4 * G * (hd + 2)) + (size_t)warp * 32 * hd; // SV: this warp's [32][hd] V rows
    float *pw = (float *)((T *)(part + 4 * G * (hd + 2)) + (size_t)4 * 32 * hd) + (size_t)warp * G * 32; // [G][32]
    // SK: this warp's [32][hd + DEC_KPAD] K rows
    T *skr = (T *)((float *)((T *)(part + 4 * G * (hd + 2)) + (size_t)4 * 32 * hd) + (size_t)4 * G * 32) +
             (size_t)warp * 32 * (HD + DEC_KPAD);
    // block_tokens is a power of two (the launch checks)
    const uint32_t bt_shift = __ffs(a.bt) - 1, bt_mask = a.bt - 1;
    const size_t k_off = att_rows(a, 0, kvh), v_off = att_rows(a, 1, kvh);
    const size_t ks_off = att_scales(a, 0, kvh), vs_off = att_scales(a, 1, kvh); // F8
    // lane's position's page (a.base past the slice: read nothing)
    auto page = [&](uint32_t pos) {
        return pos < hi ? a.base + (size_t)S.table[pos >> bt_shift] * a.block_bytes : a.base;
    };
    // SV: the K row of position p on page rw into kw (zeros unless ok)
    uint4 kw[SV ? HD / VPL : 1];
    auto load_k = [&](const uint8_t *rw, uint32_t p, bool ok) {
        const uint4 *kp = (const uint4 *)((const T *)rw + k_off + (size_t)(p & bt_mask) * hd);
#pragma unroll
        for (int i = 0; i < (SV ? HD / VPL : 1); i++)
            kw[i] = ok ? kp[i] : make_uint4(0, 0, 0, 0);
    };
    // the rows at offset off of the chunk from cc to dst (rows stride apart), a row HD / 8 lanes (coalesced),
    // all but position `skip`'s, as one cp.async group: V into sv, and with SK the K rows into skr
    auto copy_rows = [&](const uint8_t *rw, uint32_t cc, uint32_t skip, size_t off, T *dst, uint32_t stride) {
        constexpr uint32_t LPR = SV ? HD / VPL : 32, RPI = 32 / LPR; // lanes a row, rows an issue
        const T *mine = (const T *)rw + off + (size_t)((cc + lane) & bt_mask) * hd;
        const uint32_t n_live = min(32u, hi - cc);
#pragma unroll
        for (uint32_t it = 0; it < LPR; it++) {
            const uint32_t t = it * RPI + lane / LPR, seg = (lane % LPR) * VPL;
            const T *src = (const T *)__shfl_sync(0xffffffffu, (unsigned long long)mine, t);
            if (t < n_live && cc + t != skip)
                cp_async16(dst + t * stride + seg, src + seg, true);
        }
        cp_async_commit();
    };
    auto copy_v = [&](const uint8_t *rw, uint32_t cc, uint32_t skip) { copy_rows(rw, cc, skip, v_off, sv, hd); };
    auto copy_k = [&](const uint8_t *rw, uint32_t cc, uint32_t skip) {
        copy_rows(rw, cc, skip, k_off, skr, HD + DEC_KPAD);
    };
    // SK: a lane's row of the chunk's K (copy_k's) into kw
    auto fill_k = [&]() {
#pragma unroll
        for (int i = 0; i < (SV ? HD / VPL : 1); i++)
            kw[i] = *(const uint4 *)(skr + lane * (HD + DEC_KPAD) + i * VPL);
    };
    uint32_t c0 = lo + warp * 32;
    const uint8_t *row = page(c0 + lane);
    // the rope's angle for the one pair each thread rotates (with HD, half the head_dim divides the block: a
    // thread's pairs of every query head and of K are the same pair)
    const uint32_t half = hd / 2;
    const int32_t rpos = a.rope ? a.rpos[S.row0] : 0;
    const uint32_t rslot = a.rope && owner ? (uint32_t)a.rslots[S.row0] : 0;
    float rs = 0, rc = 1;
    if (HD && a.rope)
        kc_rope_angle(rpos, a.rfreq, threadIdx.x % half, &rs, &rc);
    if constexpr (SV)
        if (c0 < hi) {
            if constexpr (SK)
                copy_k(row, c0, S.pos0);
            else
                load_k(row, c0 + lane, c0 + lane < hi && c0 + lane != S.pos0);
            copy_v(row, c0, S.pos0);
        }
    kc_pdl_wait();
    kc_pdl_release();
    if (!a.rope) {
        for (uint32_t i = threadIdx.x; i < G * hd; i += blockDim.x) {
            float v = a.q[((size_t)S.row0 * a.n_heads + h0 + i / hd) * hd + i % hd];
            if (sizeof(T) == 2)
                v = __half2float(__float2half_rn(v));
            sq[i] = v;
        }
    } else if constexpr (!F8) { // (fp8 KV: the launch stores first)
        // rope_kv_store's work for this row and KV head: the queries rotated here, and the row's K (rotated)
        // and V stored by the block whose slice holds its position, before any block reads it
        const size_t kv_row = ((size_t)S.row0 * a.n_kv + kvh) * hd;
        float *sk = part; // the row's K, before part holds the warps' states
        for (uint32_t i = threadIdx.x; i < G * hd; i += blockDim.x)
            sq[i] = a.q[((size_t)S.row0 * a.n_heads + h0 + i / hd) * hd + i % hd];
        if (owner)
            for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
                sk[i] = a.rk[kv_row + i];
        __syncthreads();
        uint32_t ia, ib;
        for (uint32_t i = threadIdx.x; i < G * half; i += blockDim.x) {
            float *qh = sq + (i / half) * hd, s = rs, c = rc;
            if (!HD)
                kc_rope_angle(rpos, a.rfreq, i % half, &s, &c);
            kc_rope_rot(qh, i % half, hd, s, c, a.rneox, &ia, &ib);
            if (sizeof(T) == 2)
                qh[ia] = __half2float(__float2half_rn(qh[ia])), qh[ib] = __half2float(__float2half_rn(qh[ib]));
        }
        if (owner) {
            uint8_t *base = (uint8_t *)a.base;
            for (uint32_t p = threadIdx.x; p < half; p += blockDim.x) {
                float s = rs, c = rc;
                if (!HD)
                    kc_rope_angle(rpos, a.rfreq, p, &s, &c);
                kc_rope_store_k<T>(sk, p, hd, s, c, a.rneox, base, a.block_bytes, a.layer, a.n_kv, a.bt, rslot, kvh);
            }
            for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x)
                *kc_kv_dst<T>(base, a.block_bytes, a.layer, 1, a.n_kv, a.bt, hd, rslot, kvh, d) =
                    kc_from_float<T>(a.rv[kv_row + d]);
        }
    }
    __syncthreads();
    // SV: the row's own K and V (stored above, or by the kernel before) where the warp's first chunk holds it
    const bool fix = SV && c0 <= S.pos0 && S.pos0 < min(hi, c0 + 32);
    if constexpr (SV)
        if (fix) {
            const uint32_t t0 = S.pos0 - c0;
            if (!SK && lane == t0)
                load_k(row, S.pos0, true);
            const T *v0 = (const T *)__shfl_sync(0xffffffffu, (unsigned long long)row, t0);
            v0 += v_off + (size_t)(S.pos0 & bt_mask) * hd;
            if (lane < HD / VPL)
                cp_async16(sv + t0 * hd + lane * VPL, v0 + lane * VPL, true);
            cp_async_commit();
        }
    float m[GM], l[GM], acc[GM][ATT_MAXD];
    softmax_reset(m, l, acc);
    for (bool first = true; c0 < hi; c0 += 4 * 32, first = false) {
        const uint32_t pos = c0 + lane;
        const bool live = pos < hi;
        const uint32_t n_live = min(32u, hi - c0);
        const size_t in_blk = (size_t)(pos & bt_mask) * hd;
        const T *vrow = (const T *)row + v_off + in_blk;
        if constexpr (SV) {
            if (!first) {
                if constexpr (SK)
                    copy_k(row, c0, UINT32_MAX);
                else
                    load_k(row, pos, live);
                copy_v(row, c0, UINT32_MAX);
            }
            if constexpr (SK) {
                // the chunk's K rows have landed (its V, and the row's own V, may not have)
                if (first && fix)
                    cp_async_wait<2>();
                else
                    cp_async_wait<1>();
                __syncwarp();
                fill_k();
                if (first && fix && pos == S.pos0)
                    load_k(row, S.pos0, true); // the row's own K, stored after the wait
            }
        }
        const uint8_t *next = page(c0 + 4 * 32 + lane);
        // SV with a small group: each head's dot product in DP sums of its own, so that its FMAs are not one
        // chain of hd
        constexpr int DP = SV && GM <= 2 ? 4 : 1;
        float sc[GM], sp[GM][DP];
#pragma unroll
        for (int h = 0; h < GM; h++)
#pragma unroll
            for (int j = 0; j < DP; j++)
                sp[h][j] = 0;
        float ksc = 1, vsc = 0; // F8: the scales of this lane's position's K and V rows
        if constexpr (F8)
            if (live)
                ksc = ((const float *)(row + ks_off))[pos & bt_mask], vsc = ((const float *)(row + vs_off))[pos & bt_mask];
        if (live) { // this lane's position's row of K
            const T *kr = (const T *)row + k_off + in_blk;
#pragma unroll(HD ? HD / 8 : 1)
            for (uint32_t d = 0; d < hd; d += 8) { // SV: from kw; else read 16 or 32 bytes at a time
                float k[8];
                if constexpr (SV)
                    unpack8_at<T>(kw, d, k);
                else
                    load8(kr + d, k);
#pragma unroll
                for (int h = 0; h < GM; h++)
                    if (GM <= 2 || h < (int)G) // a group of GM <= 2 is GM heads (dec_kernel)
#pragma unroll
                        for (int e = 0; e < 8; e++)
                            sp[h][e % DP] += sq[h * hd + d + e] * k[e];
            }
        }
#pragma unroll
        for (int h = 0; h < GM; h++) {
            sc[h] = sp[h][0];
#pragma unroll
            for (int j = 1; j < DP; j++)
                sc[h] += sp[h][j];
        }
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= (int)G)
                break;
            const float s = live ? (F8 ? sc[h] * ksc : sc[h]) * a.scale : -INFINITY;
            float mt = s;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m[h], mt); // finite: the chunk has at least one live position
            const float corr = __expf(m[h] - mn), e = live ? __expf(s - mn) : 0.0f;
            float es = e;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                es += __shfl_xor_sync(0xffffffffu, es, o);
            l[h] = l[h] * corr + es;
            m[h] = mn;
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++)
                acc[h][i] *= corr;
            sc[h] = F8 ? e * vsc : e; // F8: P·V's weight takes the V row's scale
        }
        if constexpr (SV) {
            // P·V with the weights from shared memory (a shuffle a position made each step wait on the one
            // before) and a lane's E values of a head its E consecutive dims (one load a row); rows past n_live
            // weigh 0 and are zeros, so that the loop has no exit to check and its loads go out ahead of use
#pragma unroll
            for (int h = 0; h < GM; h++)
                if (GM <= 2 || h < (int)G)
                    pw[h * 32 + lane] = sc[h];
            cp_async_wait<0>();
            if (n_live < 32)
                for (uint32_t i = n_live * (HD / VPL) + lane; i < 32 * (HD / VPL); i += 32)
                    ((uint4 *)sv)[i] = make_uint4(0, 0, 0, 0);
            __syncwarp();
#pragma unroll 8
            for (uint32_t t = 0; t < 32; t++) {
                float v[E];
                if constexpr (F8) { // E codes (4 or 2 bytes); the row's scale is in its weight
                    const __nv_fp8x2_storage_t *c = (const __nv_fp8x2_storage_t *)(sv + t * HD + lane * E);
#pragma unroll
                    for (int i = 0; i < E / 2; i++) {
                        const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(c[i], __NV_E4M3)));
                        v[2 * i] = x.x, v[2 * i + 1] = x.y;
                    }
                } else if constexpr (E == 4) {
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
                        const float p = pw[h * 32 + t];
#pragma unroll
                        for (int i = 0; i < E; i++)
                            acc[h][i] += p * v[i];
                    }
            }
            __syncwarp(); // every lane is done with the rows and weights before the next chunk's land
        } else {
            for (uint32_t t0 = 0; t0 < n_live; t0 += DEC_VB) {
                float v[DEC_VB][E];
#pragma unroll
                for (int u = 0; u < DEC_VB; u++) {
                    const T *vr = (const T *)__shfl_sync(0xffffffffu, (unsigned long long)vrow, (t0 + u) & 31);
                    const bool ok = t0 + u < n_live;
#pragma unroll
                    for (int i = 0; i < E; i++)
                        v[u][i] = ok && lane + 32 * i < hd ? kc_to_float<T>(vr[lane + 32 * i]) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < DEC_VB; u++)
#pragma unroll
                    for (int h = 0; h < GM; h++) {
                        if (h >= (int)G)
                            break;
                        const float p = __shfl_sync(0xffffffffu, sc[h], (t0 + u) & 31); // 0 past n_live
#pragma unroll
                        for (int i = 0; i < E; i++)
                            acc[h][i] += p * v[u][i];
                    }
            }
        }
        row = next;
    }
    // the four warps' states into one: (max, sum, acc) per head
    const uint32_t stride = hd + 2;
#pragma unroll
    for (int h = 0; h < GM; h++) {
        if (h >= (int)G)
            break;
        float *w = part + ((size_t)warp * G + h) * stride;
        if (lane == 0)
            w[0] = m[h], w[1] = l[h];
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++) {
            const uint32_t d = SV ? lane * E + i : lane + 32 * i; // SV: a lane's dims are consecutive
            if ((!SV || i < E) && d < hd)
                w[2 + d] = acc[h][i];
        }
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < G * hd; i += blockDim.x) {
        const uint32_t h = i / hd, d = i % hd;
        float M = -INFINITY;
        for (int w = 0; w < 4; w++)
            M = fmaxf(M, part[((size_t)w * G + h) * stride]);
        float L = 0, A = 0;
        for (int w = 0; w < 4; w++) {
            const float *pw = part + ((size_t)w * G + h) * stride;
            const float f = pw[0] == -INFINITY ? 0.0f : __expf(pw[0] - M);
            L += pw[1] * f;
            A += pw[2 + d] * f;
        }
        const uint32_t head = h0 + h;
        if (splits == 1) {
            a.out[((size_t)S.row0 * a.n_heads + head) * hd + d] = A / L;
        } else {
            float *o = a.ws + (((size_t)blockIdx.x * a.n_heads + head) * a.splits + split) * stride;
            if (d == 0)
                o[0] = M, o[1] = L;
            o[2 + d] = A;
        }
    }
    if (splits == 1)
        return;
    // The last slice of this (sequence, KV head) to finish merges the
    // slices into the output (and sets the count back for the next launch),
    // so that no second kernel is needed.
    __shared__ bool last;
    __threadfence(); // the slice's state is visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned *cnt = a.cnt + (size_t)blockIdx.x * a.n_kv + kvh;
        last = atomicAdd(cnt, 1u) == splits - 1;
        if (last)
            *cnt = 0;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    for (uint32_t i = threadIdx.x; i < G * hd; i += blockDim.x) {
        const uint32_t h = i / hd, d = i % hd, head = h0 + h;
        const float *w = a.ws + ((size_t)blockIdx.x * a.n_heads + head) * a.splits * stride;
        float M = -INFINITY;
        for (uint32_t s = 0; s < splits; s++)
            M = fmaxf(M, __ldcg(w + s * stride));
        float L = 0, A = 0;
        for (uint32_t s = 0; s < splits; s++) {
            const float ms = __ldcg(w + s * stride), f = ms == -INFINITY ? 0.0f : __expf(ms - M);
            L += __ldcg(w + s * stride + 1) * f;
            A += __ldcg(w + s * stride + 2 + d) * f;
        }
        a.out[((size_t)S.row0 * a.n_heads + head) * hd + d] = A / L;
    }
}

// ---- the tensor-core path for prompt rows ----
#define MMA_ROWS 64 // query rows per block (16 per warp)
#define MMA_KT 64   // positions per K/V tile
#define MMA_PAD 8   // halves of padding per shared row (ldmatrix's 8 row reads fall in distinct banks)

// Shared memory of k_attention_mma: two tiles (the one in use, the next in
// flight), each K and V rows as in the pool.
static size_t mma_smem(uint32_t hd) { return (size_t)2 * 2 * MMA_KT * (hd + MMA_PAD) * sizeof(__half); }

__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 fp16 matrices from shared memory, lanes 8m..8m+7 giving the rows of
// matrix m; thread i gets (row i/4, columns 2(i%4), 2(i%4)+1) of each, or with
// trans the same of each matrix transposed.
__device__ __forceinline__ void ldsm_x4(uint32_t *r, const __half *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t *r, const __half *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}

// 8 fp8_e4m3 codes times their row's scale, as 8 fp16 values
__device__ __forceinline__ uint4 f8x8_to_half(uint2 c, float s)
{
    const __nv_fp8x2_storage_t *p = (const __nv_fp8x2_storage_t *)&c;
    uint4 r;
    uint32_t *h = (uint32_t *)&r;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[i], __NV_E4M3)));
        h[i] = att_pack_half2(x.x * s, x.y * s);
    }
    return r;
}

// Three blocks an SM (168 registers, a few bytes spilled): faster than two
// without the cap; two 16-row tiles a warp (255 registers, two blocks) were
// slower still (bench/results/gpu-2026-11-25e/). F8: fp8_e4m3 KV.
template <int HD, bool F8> __global__ void __launch_bounds__(128, 3) k_attention_mma(const att_args_t a)
{
    constexpr uint32_t LD = HD + MMA_PAD; // a shared row, in halves
    extern __shared__ __align__(16) __half mma_sm[]; // [2 tiles][K, V][MMA_KT][LD]
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // the blocks of the last rows (the longest walks) first, so that the short ones fill in at the end
    const uint32_t bx = gridDim.x - 1 - blockIdx.x;
    uint32_t s = 0;
    while (s + 1 < a.n_seqs && a.seq[s + 1].tile0 <= bx)
        s++;
    const att_seq_t S = a.seq[s];
    const uint32_t r0 = (bx - S.tile0) * MMA_ROWS, rows = min((uint32_t)MMA_ROWS, S.n - r0);
    const uint32_t head = blockIdx.y, kvh = head / a.group;
    const uint32_t last = S.pos0 + r0 + rows - 1;              // the block's last row's position
    const uint32_t wr0 = warp * 16;                            // the warp's first row in the block
    const uint32_t warp_first = S.pos0 + r0 + wr0, warp_last = warp_first + 15; // the warp's rows' positions
    const uint32_t pos_a = warp_first + g;                                       // this thread's first row's position (+ 8: its second)
    const bool warp_live = wr0 < rows;
    const size_t k_off = att_rows(a, 0, kvh), v_off = att_rows(a, 1, kvh);
    const size_t ks_off = att_scales(a, 0, kvh), vs_off = att_scales(a, 1, kvh); // F8
    // One tile's K and V rows into buffer b: consecutive threads take consecutive 16-byte pieces of a row
    // (coalesced), a thread PER pieces JSTEP positions apart; positions past the last row read as zeros.
    // The pages of a tile's pieces are looked up a tile ahead (pages()), so the loads wait on no table read.
    constexpr uint32_t PER = MMA_KT * (HD / 8) / 128, JSTEP = 128 / (HD / 8);
    // with JSTEP 8, pieces 2q and 2q + 1 (positions jt + 16q and jt + 16q + 8, jt < 8) share a page:
    // block_tokens is at least 16
    constexpr uint32_t PPG = JSTEP >= 16 ? 1 : 16 / JSTEP, NPG = PER / PPG;
    const uint32_t jt = threadIdx.x / (HD / 8), dt = (threadIdx.x % (HD / 8)) * 8;
    const uint32_t bt_shift = __ffs(a.bt) - 1, bt_mask = a.bt - 1; // block_tokens is a power of two
    int32_t pg[NPG];
    auto pages = [&](uint32_t p0) {
#pragma unroll
        for (uint32_t m = 0; m < NPG; m++) {
            const uint32_t pos = p0 + jt + m * PPG * JSTEP;
            pg[m] = pos <= last ? S.table[pos >> bt_shift] : 0;
        }
    };
    auto load = [&](uint32_t b, uint32_t p0) {
        __half *kb = mma_sm + (size_t)b * 2 * MMA_KT * LD, *vb = kb + MMA_KT * LD;
#pragma unroll
        for (uint32_t m = 0; m < PER; m++) {
            const uint32_t j = jt + m * JSTEP, pos = p0 + j;
            const bool ok = pos <= last;
            const uint8_t *page = a.base + (size_t)pg[m / PPG] * a.block_bytes;
            const size_t o8 = ok ? (size_t)(pos & bt_mask) * HD + dt : 0;
            if constexpr (F8) {
                uint4 kh = make_uint4(0, 0, 0, 0), vh = kh;
                if (ok) {
                    const float *ks = (const float *)(page + ks_off), *vs = (const float *)(page + vs_off);
                    kh = f8x8_to_half(*(const uint2 *)(page + k_off + o8), ks[pos & bt_mask]);
                    vh = f8x8_to_half(*(const uint2 *)(page + v_off + o8), vs[pos & bt_mask]);
                }
                *(uint4 *)(kb + j * LD + dt) = kh;
                *(uint4 *)(vb + j * LD + dt) = vh;
            } else {
                const __half *blk = (const __half *)page;
                cp_async16(kb + j * LD + dt, ok ? blk + k_off + o8 : blk, ok);
                cp_async16(vb + j * LD + dt, ok ? blk + v_off + o8 : blk, ok);
            }
        }
    };
    const uint32_t n_tiles = last / MMA_KT + 1;
    pages(0);
    load(0, 0);
    cp_async_commit();
    if (n_tiles > 1)
        pages(MMA_KT);
    // Q fragments (rows g and g + 8 of the warp's 16), scaled for exp2, while the first tile comes
    const float qs = a.scale * 1.4426950408889634f;
    uint32_t qf[HD / 16][4];
    {
        const uint32_t ra = min(r0 + wr0 + g, S.n - 1), rb = min(r0 + wr0 + g + 8, S.n - 1);
        const float *qa = a.q + ((size_t)(S.row0 + ra) * a.n_heads + head) * HD;
        const float *qb = a.q + ((size_t)(S.row0 + rb) * a.n_heads + head) * HD;
#pragma unroll
        for (int k = 0; k < HD / 16; k++) {
            const int c = k * 16 + t * 2;
            qf[k][0] = att_pack_half2(qa[c] * qs, qa[c + 1] * qs);
            qf[k][1] = att_pack_half2(qb[c] * qs, qb[c + 1] * qs);
            qf[k][2] = att_pack_half2(qa[c + 8] * qs, qa[c + 9] * qs);
            qf[k][3] = att_pack_half2(qb[c + 8] * qs, qb[c + 9] * qs);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0, l_b = 0;
    // the lane's row within an 8x8 matrix and which of the x4 load's four matrices it addresses
    const uint32_t lr = lane & 7, lm = lane >> 3;
    for (uint32_t it = 0; it < n_tiles; it++) {
        const uint32_t p0 = it * MMA_KT;
        if (it + 1 < n_tiles) { // the next tile's loads go out before this one is used
            load((it + 1) & 1, p0 + MMA_KT);
            cp_async_commit();
            if (it + 2 < n_tiles)
                pages(p0 + 2 * MMA_KT);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // this tile is in shared memory for every warp
        if (warp_live && p0 <= warp_last) { // else the warp's rows are all before this tile (or past the sequence)
            const __half *kb = mma_sm + (size_t)(it & 1) * 2 * MMA_KT * LD, *vb = kb + MMA_KT * LD;
            float sc[MMA_KT / 8][4];
#pragma unroll
            for (int nt = 0; nt < MMA_KT / 8; nt++)
                sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0;
            // S = Q Kᵀ: matrices (positions nt*8.., dims k*16 + 0, 8, 16, 24) are B of chunks k and k + 1
#pragma unroll
            for (int k = 0; k < HD / 16; k += 2)
#pragma unroll
                for (int nt = 0; nt < MMA_KT / 8; nt++) {
                    uint32_t b[4];
                    ldsm_x4(b, kb + (nt * 8 + lr) * LD + k * 16 + lm * 8);
                    mma16816(sc[nt], qf[k], b[0], b[1]);
                    mma16816(sc[nt], qf[k + 1], b[2], b[3]);
                }
            // the causal mask, the running max and sum, the weights (sc[nt][i] is a flat array's [4nt + i])
            float corr_a, corr_b;
            att_softmax<MMA_KT>(reinterpret_cast<float(&)[MMA_KT / 2]>(sc), p0, warp_first, pos_a, t, m_a, m_b, l_a,
                                l_b, corr_a, corr_b);
            if (__any_sync(0xffffffffu, corr_a != 1.0f || corr_b != 1.0f)) { // else no row's max grew
#pragma unroll
                for (int i = 0; i < HD / 8; i++) {
                    o[i][0] *= corr_a, o[i][1] *= corr_a;
                    o[i][2] *= corr_b, o[i][3] *= corr_b;
                }
            }
            // O += P V: matrices (positions kt*16 + 0, 8, dims nd*8 and nd*8 + 8), transposed, are B of
            // dim tiles nd and nd + 1
#pragma unroll
            for (int kt = 0; kt < MMA_KT / 16; kt++) {
                uint32_t pa[4];
                pa[0] = att_pack_half2(sc[2 * kt][0], sc[2 * kt][1]);
                pa[1] = att_pack_half2(sc[2 * kt][2], sc[2 * kt][3]);
                pa[2] = att_pack_half2(sc[2 * kt + 1][0], sc[2 * kt + 1][1]);
                pa[3] = att_pack_half2(sc[2 * kt + 1][2], sc[2 * kt + 1][3]);
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd += 2) {
                    uint32_t b[4];
                    ldsm_x4_trans(b, vb + (kt * 16 + (lm & 1) * 8 + lr) * LD + (nd + (lm >> 1)) * 8);
                    mma16816(o[nd], pa, b[0], b[1]);
                    mma16816(o[nd + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads(); // every warp is done with this tile before the next load overwrites it
    }
    if (!warp_live)
        return;
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
    }
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
    const uint32_t ra = r0 + wr0 + g, rb = ra + 8;
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) {
        const uint32_t c = nd * 8 + t * 2;
        if (ra < S.n)
            *(float2 *)(a.out + ((size_t)(S.row0 + ra) * a.n_heads + head) * HD + c) =
                make_float2(o[nd][0] * inv_a, o[nd][1] * inv_a);
        if (rb < S.n)
            *(float2 *)(a.out + ((size_t)(S.row0 + rb) * a.n_heads + head) * HD + c) =
                make_float2(o[nd][2] * inv_b, o[nd][3] * inv_b);
    }
}

// The decode kernel for the pool's type, the head_dim and the group (query heads per KV head): with fp16 KV and a
// head_dim of 64 or 128, GM the smallest of 1, 2, 4 and 8 that holds the group. The loops over the group's heads
// then have no more steps than it: with GM 8 for every group, the 7B shape's (one head a group) took 6,048
// instructions of code and stalled on instruction fetch (bench/results/gpu-2026-11-26, run 9).
typedef void (*dec_fn_t)(att_args_t);
template <typename T, int HD, bool KS> static dec_fn_t dec_by_group(uint32_t group)
{
    return group <= 1 ? k_attention_decode<T, HD, 1, KS>
           : group <= 2 ? k_attention_decode<T, HD, 2, KS>
           : group <= 4 ? k_attention_decode<T, HD, 4, KS>
                        : k_attention_decode<T, HD, DEC_MAXG, KS>;
}
// sk: K through shared memory (fp16 KV, head_dim 64 or 128 only; the others ignore it)
static dec_fn_t dec_kernel(td_kv_dtype_t dt, uint32_t hd, uint32_t group, bool sk)
{
    const bool h16 = dt == TD_KV_F16;
    if (dt == TD_KV_F8_E4M3)
        return hd == 64    ? dec_by_group<kv8_t, 64, false>(group)
               : hd == 128 ? dec_by_group<kv8_t, 128, false>(group)
                           : k_attention_decode<kv8_t, 0, DEC_MAXG, false>;
    if (hd == 64 && h16)
        return sk ? dec_by_group<__half, 64, true>(group) : dec_by_group<__half, 64, false>(group);
    if (hd == 128 && h16)
        return sk ? dec_by_group<__half, 128, true>(group) : dec_by_group<__half, 128, false>(group);
    if (hd == 64)
        return k_attention_decode<float, 64, DEC_MAXG, false>;
    if (hd == 128)
        return k_attention_decode<float, 128, DEC_MAXG, false>;
    return h16 ? k_attention_decode<__half, 0, DEC_MAXG, false> : k_attention_decode<float, 0, DEC_MAXG, false>;
}

// dec_ks_grid's second index: dec_by_group's kernel for a group
static int dec_group_ix(uint32_t group) { return group <= 1 ? 0 : group <= 2 ? 1 : group <= 4 ? 2 : 3; }

td_status_t kc_attention_init(kern_cuda_t *c)
{
    td_status_t rc = kc_attention_wide_init(c);
    if (!rc)
        rc = kc_attention_wg_init(c);
    if (rc)
        return rc;
    for (uint32_t group = 1; group <= DEC_MAXG; group *= 2)
        for (uint32_t hd = 64; hd <= 128; hd *= 2) {
            for (int sk = 0; sk < 2; sk++)
                CU(cudaFuncSetAttribute(dec_kernel(TD_KV_F16, hd, group, sk), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)dec_smem(hd, DEC_MAXG, true, sk)));
            int per_sm = 0;
            CU(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dec_kernel(TD_KV_F16, hd, group, true), 128,
                                                             dec_smem(hd, group, true, true)));
            c->dec_ks_grid[hd == 128][dec_group_ix(group)] = (unsigned)(per_sm > 0 ? per_sm : 1) * (unsigned)c->sms;
        }
    int bytes = (int)att_smem(32 * ATT_MAXD);
    CU(cudaFuncSetAttribute(k_attention<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CU(cudaFuncSetAttribute(k_attention<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CU(cudaFuncSetAttribute(k_attention<kv8_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CU(cudaFuncSetAttribute(k_attention_mma<64, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)mma_smem(64)));
    CU(cudaFuncSetAttribute(k_attention_mma<128, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)mma_smem(128)));
    CU(cudaFuncSetAttribute(k_attention_mma<64, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)mma_smem(64)));
    CU(cudaFuncSetAttribute(k_attention_mma<128, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)mma_smem(128)));
    return TD_OK;
}

// Whether k_attention_decode takes decode rows of n_heads query heads over layout g
static bool dec_takes(const td_kv_layout_t *g, uint32_t n_heads)
{
    return g->n_kv_heads && n_heads % g->n_kv_heads == 0 && n_heads / g->n_kv_heads <= DEC_MAXG &&
           g->head_dim % 8 == 0 && g->head_dim <= 32 * ATT_MAXD;
}

// kc_attention, or with r (decode rows only) rope_kv_attention's one pass
static td_status_t attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out, uint32_t n_heads,
                             const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs, uint32_t n_seqs,
                             float scale, const kern_rope_kv_t *r)
{
    kc_bind(b);
    const td_kv_layout_t *g = kv->layout;
    if (!g->head_dim || g->head_dim > 32 * ATT_MAXD)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: attention: head_dim %u is past %u", g->head_dim, 32 * ATT_MAXD);
    if (!g->n_kv_heads || n_heads % g->n_kv_heads)
        return td_error(TD_ERR_INVALID_ARG, "cuda: attention: %u heads over %u KV heads", n_heads, g->n_kv_heads);
    if (!g->block_tokens || (g->block_tokens & (g->block_tokens - 1)))
        return td_error(TD_ERR_UNSUPPORTED, "cuda: attention: block_tokens %u is not a power of two", g->block_tokens);
    att_args_t a;
    a.base = (const uint8_t *)kv->base;
    a.block_bytes = kv->block_bytes;
    a.layer = kv->layer;
    a.n_kv = g->n_kv_heads;
    a.bt = g->block_tokens;
    a.hd = g->head_dim;
    a.lstride = td_kv_layer_bytes(g) / td_kv_dtype_size(g->dtype);
    a.n_heads = n_heads;
    a.group = n_heads / g->n_kv_heads;
    a.hc = a.group < 16 ? a.group : 16;
    a.qt = 16 / a.hc;
    a.scale = scale;
    a.q = q;
    a.qh = NULL;
    a.out = out;
    a.outh = NULL;
    a.out32 = 1;
    a.dseq = dev_seqs;
    a.rope = r != NULL;
    if (r) {
        a.rk = r->k, a.rv = r->v, a.rslots = r->slots, a.rpos = r->pos, a.rfreq = r->freq;
        a.rneox = r->style == KERN_ROPE_NEOX;
    }
    size_t smem = att_smem(g->head_dim);
    // prompt rows (16 or more) over fp16 or fp8 KV with a head_dim the tensor-core
    // kernel has go there, decode rows to the split kernel, the rest to the
    // general kernel
    const bool mma_ok = (g->dtype == TD_KV_F16 || g->dtype == TD_KV_F8_E4M3) && (g->head_dim == 64 || g->head_dim == 128);
    const bool dec_ok = dec_takes(g, n_heads);
    kern_cuda_t *c = (kern_cuda_t *)b;
    const uint32_t wg_rows = mma_ok ? kc_attention_wg_rows(c, g) : 0; // Hopper's warpgroup MMA (attention_wg.cu)
    // Decode rows may read K through shared memory (coalesced; the attention alone 13% faster at 256 sequences),
    // which holds fewer blocks an SM. Not when the step has one row: the matmuls around the attention are then
    // the GEMV under programmatic launch, whose x must keep the SM's L1, and the larger shared memory made that
    // step 12% slower; nor when the grid is under DEC_KS_WAVES of those blocks: a last, part-filled wave made
    // 16 sequences at 1k 4.5% slower (gpu-2026-11-26c run 3); nor at a context under KC_DEC_KS_CTX, where it
    // was slower (run 6: a captured step keeps its kernels, so the forward captures the two apart)
    uint32_t rows = 0;
    for (uint32_t i = 0; i < n_seqs; i++)
        rows += seqs[i].n;
    // a step of decode rows alone, its sequences in device memory: one decode launch for all of them (a launch per
    // ATT_MAXSEQ left each launch a part-filled last wave)
    a.dseq_all = dev_seqs && dec_ok && rows == n_seqs;
    // prompt rows that all take the warpgroup kernel in one launch also leave their output in fp16 where the O
    // projection's matmul takes it (matmul_fused's xh, handed over as a glu's product is) instead of converting it
    // in a pass of its own; xh holds that much already once one such projection has run (it grows there)
    bool hand = wg_rows && n_seqs <= ATT_MAXSEQ;
    for (uint32_t i = 0; i < n_seqs && hand; i++)
        hand = !seqs[i].n || seqs[i].n >= 16;
    const size_t n_out = (size_t)rows * n_heads * g->head_dim;
    if (hand && c->xh.cap >= n_out * sizeof(__half))
        a.outh = (__half *)c->xh.p;
    // the rotated Q in fp16 (rope_kv_store took Q, K and V so): the warpgroup kernel reads it there; the others
    // read fp32, made from it first
    if (q && q == c->qh_of) {
        c->qh_of = NULL;
        td_status_t rc;
        if (hand) {
            a.qh = (const __half *)c->qkvh.p;
            a.out32 = !a.outh; // the output goes to the O projection alone (kern_matmul_spec_t's to_next)
        } else if ((rc = kc_q_to_float(c, (float *)q, n_out)))
            return rc;
    }
    for (int pass = 0; pass < 3; pass++) { // 0: general, 1: tensor cores, 2: decode
        if ((pass == 1 && !mma_ok) || (pass == 2 && !dec_ok))
            continue;
        const uint32_t per_tile = pass == 1 ? (wg_rows ? wg_rows : MMA_ROWS) : pass == 2 ? 1 : a.qt;
        uint32_t s = 0;
        while (s < n_seqs) { // independent sequences: a launch per ATT_MAXSEQ
            uint32_t tiles = 0, max_ctx = 0;
            a.n_seqs = 0;
            for (; s < n_seqs && (a.n_seqs < ATT_MAXSEQ || a.dseq_all); s++) {
                if (a.dseq_all && pass == 2) { // (seq[] unused: dec_seq reads dseq)
                    a.n_seqs++;
                    tiles++;
                    max_ctx = max_ctx > seqs[s].pos0 + 1 ? max_ctx : seqs[s].pos0 + 1;
                    continue;
                }
                const kern_attn_seq_t *q = &seqs[s];
                int cls = q->n == 1 && dec_ok ? 2 : q->n >= 16 && mma_ok ? 1 : 0;
                if (!q->n || cls != pass)
                    continue;
                a.seq[a.n_seqs++] = (att_seq_t){q->block_table, q->row0, q->n, q->pos0, tiles, s};
                tiles += (q->n + per_tile - 1) / per_tile;
                max_ctx = max_ctx > q->pos0 + 1 ? max_ctx : q->pos0 + 1;
            }
            if (!tiles)
                continue;
            td_status_t rc;
            if (pass == 1 && wg_rows) {
                rc = kc_attention_wg(c, a, g->head_dim, tiles, n_heads);
            } else if (pass == 1) {
                dim3 grid(tiles, n_heads);
                const bool f8 = g->dtype == TD_KV_F8_E4M3;
                rc = kc_launch(c, "attention_mma",
                               g->head_dim == 64 ? (f8 ? k_attention_mma<64, true> : k_attention_mma<64, false>)
                                                 : (f8 ? k_attention_mma<128, true> : k_attention_mma<128, false>),
                               grid, 128, mma_smem(g->head_dim), a);
            } else if (pass == 2 && a.dseq_all && kc_attention_wide_takes(g, a.group) &&
                       max_ctx < KC_DEC_KS_CTX && (size_t)a.n_seqs * a.n_kv >= (size_t)WIDE_MIN_PER_SM * c->sms) {
                // many decode rows at a short context: a warp a (sequence, KV head) (attention_wide.cu)
                a.splits = 1;
                a.ws = NULL;
                a.cnt = NULL;
                rc = kc_attention_wide(c, a, g);
            } else if (pass == 2) {
                // enough slices for two blocks per SM, none shorter than
                // DEC_SLICE positions; read from device memory, the positions
                // may move on, so the grid does not depend on them (the kernel
                // takes as many slices as the context needs; a block past
                // them does nothing)
                uint32_t blocks = a.n_seqs * a.n_kv, want = (2 * (uint32_t)c->sms + blocks - 1) / blocks;
                uint32_t most = dev_seqs ? want : (max_ctx + DEC_SLICE - 1) / DEC_SLICE;
                a.splits = want < 1 ? 1 : want > most ? (most ? most : 1) : want;
                a.ws = NULL;
                a.cnt = NULL;
                if (a.splits > 1) {
                    size_t need = (size_t)a.n_seqs * n_heads * a.splits * (g->head_dim + 2) * sizeof(float);
                    if ((rc = kc_scratch(c, &c->ws, need)))
                        return rc;
                    a.ws = (float *)c->ws.p;
                    // the slices' counts start at zero, and each launch leaves them so
                    need = (size_t)(a.n_seqs > ATT_MAXSEQ ? a.n_seqs : ATT_MAXSEQ) * a.n_kv * sizeof(unsigned);
                    if (c->cnt.cap < need) {
                        if ((rc = kc_scratch(c, &c->cnt, need)))
                            return rc;
                        CU(cudaMemsetAsync(c->cnt.p, 0, c->cnt.cap, c->stream));
                    }
                    a.cnt = (unsigned *)c->cnt.p;
                }
                const uint32_t hd = g->head_dim;
                const bool h16 = g->dtype == TD_KV_F16;
                const bool sv = (h16 || g->dtype == TD_KV_F8_E4M3) && (hd == 64 || hd == 128);
                const bool sk = sv && h16 && rows > 1 && max_ctx >= KC_DEC_KS_CTX &&
                                (size_t)a.n_seqs * a.n_kv * a.splits >=
                                    (size_t)DEC_KS_WAVES * c->dec_ks_grid[hd == 128][dec_group_ix(a.group)];
                const size_t dsmem = dec_smem(hd, a.group, sv, sk, td_kv_dtype_size(g->dtype));
                dim3 grid(a.n_seqs, a.n_kv, a.splits);
                rc = kc_launch(c, "attention_decode", dec_kernel(g->dtype, hd, a.group, sk), grid, 128, dsmem, a);
            } else {
                dim3 grid(tiles, a.n_kv, (a.group + a.hc - 1) / a.hc);
                rc = kc_launch(c, "attention",
                               g->dtype == TD_KV_F16        ? k_attention<__half>
                               : g->dtype == TD_KV_F8_E4M3 ? k_attention<kv8_t>
                                                            : k_attention<float>,
                               grid, ATT_WARPS * 32, smem, a);
            }
            if (rc)
                return rc;
        }
    }
    c->xh_of = a.outh ? out : NULL;
    c->xh_n = a.outh ? n_out : 0;
    c->xh_x_too = a.out32;
    return TD_OK;
}

td_status_t kc_attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out, uint32_t n_heads,
                         const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs, uint32_t n_seqs,
                         float scale)
{
    return attention(b, kv, q, out, n_heads, seqs, dev_seqs, n_seqs, scale, NULL);
}

td_status_t kc_rope_kv_attention(kern_backend_t *b, const kern_kv_view_t *kv, const kern_rope_kv_t *r, float *out,
                                 const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs, uint32_t n_seqs,
                                 float scale)
{
    // one pass when every row is a sequence's one decode row and the decode kernel takes them all (not over fp8
    // KV, whose rows are stored a warp each, with their scale)
    bool one = dec_takes(kv->layout, r->n_heads) && r->n == n_seqs && kv->layout->dtype != TD_KV_F8_E4M3 &&
               !kc_qkv_handed((kern_cuda_t *)b, r->q, r->n);
    for (uint32_t s = 0; one && s < n_seqs; s++)
        one = seqs[s].n == 1;
    if (one)
        return attention(b, kv, r->q, out, r->n_heads, seqs, dev_seqs, n_seqs, scale, r);
    td_status_t rc = kc_rope_kv_store(b, kv, r->q, r->k, r->v, r->n_heads, r->slots, r->n, r->pos, r->freq, r->style);
    return rc ? rc : kc_attention(b, kv, r->q, out, r->n_heads, seqs, dev_seqs, n_seqs, scale);
}
