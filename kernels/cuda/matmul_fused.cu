// matmul_fused.cu — the fused matmul (kernels/backend.h's kern_matmul_spec_t):
// the RMSNorm before a layer's matmuls, the SwiGLU after gate/up and the
// residual add after the output and down projections, folded into the
// matmul so that none of them is a pass of its own.
//
// One row (a batch-1 decode step) takes a GEMV, bound by reading the weights
// once. Matrices up to GC_B_COLS wide (every matrix of the 7B shape) take
// k_gemv_cols, which splits each row's columns among a block's warps (below,
// where it is defined); wider ones take k_gemv: a warp takes GV_R weight
// rows, each lane streams 16 bytes of each (8 halves) GV_U times before it
// uses them, and GV_BLOCKS blocks of GV_WARPS warps an SM (64 registers a
// thread) keep enough bytes in flight to keep HBM busy. The grid is what the device holds at once; a warp
// takes unit after unit (GV_R rows each) until the rows run out, so no block
// starts after the first ones and the tail is at most one unit a warp. The
// first round is loaded before anything else (before the wait for the kernel
// before), and each round's loads are issued before the round before is used
// (bench/results/gpu-2026-11-25d; the shape, four blocks an SM of short rounds
// over two of long ones, the grid and the norm: gpu-2026-11-25f). x (fp32, a
// few KB a row) is read through L1 where every warp of the SM finds it. Every
// warp reads all of x, so the norm's sum of squares of each x row is made by
// each warp from the same reads; the scale is multiplied in after the dot
// product, and the norm's weight into x as it is read — unless the weights
// carry it in their columns (weight_scale_cols, kern_matmul_spec_t's
// norm_in_w), which spares every warp those reads (gpu-2026-11-26). With glu
// a warp takes the same row of W0 and W1 and writes silu(a) * b.
//
// Matrices held in FP8 take matmul_fp8.cu's GEMV, gemm_fp8.cu's FP8 GEMM above one row, or where that has no
// algorithm the fp16 copy into the GEMM.
//
// More rows take cuBLAS (matmul.cu's gemm): the norm is fused into the
// conversion of x to fp16, the add into the GEMM (beta = 1), SwiGLU runs after.
// Weights joined side by side (weights_join: Q|K|V, gate|up) are one GEMM
// into the caller's side rows where it gave room for them: at a decode batch
// each weight alone is too few tiles to fill the GPU (bench/gpu/gemm_study.cu).
// SwiGLU then reads the joined rows; Q, K and V are copied out of them.
#include "kernels/cuda/cuda_int.h"
#include "kernels/quant.h"

// Rows of x k_gemv takes. Measured on an H100 (bench/results/gpu-2026-11-25b):
// at one row it reads the weights as fast as cuBLAS (2.2-2.5 TB/s); at 2-8 rows
// it falls behind (x's reads through L1 grow with the rows), so cuBLAS takes them.
#define GV_MAXN 1
#define GV_R 2     // weight rows per warp
#define GV_U 2     // 16-byte loads in flight per lane per weight row
#define GV_WARPS 8 // warps per block
#define GV_BLOCKS 4 // blocks an SM (the register cap that allows it)
#define GV_MAXK 4

typedef struct gv_args {
    const __half *w[GV_MAXK];
    float *y[GV_MAXK];
    uint32_t end[GV_MAXK]; // the rows of weights 0 .. i together
    uint32_t k, cols, n, units;
    const float *x, *norm; // norm: the norm's weight (the kernel's NM says whether there is a norm and it is read)
    float eps;
    int glu, acc;
} gv_args_t;

__device__ __forceinline__ float gv_dot8(uint4 w, const float4 a, const float4 b)
{
    const __half2 *h = (const __half2 *)&w;
    float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
    return f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w + f2.x * b.x + f2.y * b.y + f3.x * b.z + f3.y * b.w;
}

__device__ __forceinline__ uint4 gv_load(const __half *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// One round of a warp's weight loads: GV_U 16-byte loads of each of its rows
// from column c0 on (lane's first column), zeros past the row. A row the warp
// does not have is its weight's first (gv_rows), read and not written.
__device__ __forceinline__ void gv_round(uint4 (&wv)[GV_R][GV_U], const __half *const (&wr)[GV_R], uint32_t c0,
                                         uint32_t cols)
{
#pragma unroll
    for (int u = 0; u < GV_U; u++) {
        const uint32_t c = c0 + u * 256;
#pragma unroll
        for (int r = 0; r < GV_R; r++)
            wv[r][u] = c < cols ? gv_load(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
}

// Where unit `unit`'s R weight rows are (glu, R 2: the same row of W0 and W1)
// and where their results go; live[r]: the unit has row r.
template <int R>
__device__ __forceinline__ void gv_rows(const gv_args_t &a, uint32_t unit, const __half *(&wr)[R], float *(&yr)[R],
                                        uint32_t (&yrows)[R], bool (&live)[R])
{
#pragma unroll
    for (int r = 0; r < R; r++) {
        const uint32_t g = a.glu ? unit : unit * R + r;
        // the weight row g falls in (glu: weight r), found with the arrays indexed by constants only (an index
        // known only at run time would copy them out of the parameters to local memory)
        const __half *w = a.glu && r ? a.w[r] : a.w[0];
        float *y = a.y[0];
        uint32_t lo = 0, hi = a.end[0];
        if (!a.glu)
#pragma unroll
            for (int j = 1; j < GV_MAXK; j++)
                if ((uint32_t)j < a.k && g >= a.end[j - 1])
                    w = a.w[j], y = a.y[j], lo = a.end[j - 1], hi = a.end[j] - a.end[j - 1];
        live[r] = unit < a.units && (a.glu || g < lo + hi);
        const uint32_t row = live[r] ? g - lo : 0;
        wr[r] = w + (size_t)row * a.cols;
        yr[r] = y + row;
        yrows[r] = hi;
    }
}

// One unit's dot products, its first round already in wv, and its results
// written. NM, the norm: 0 none; 1 x's RMS only (its weight is in the
// weights); 2 with its weight multiplied into x as it is read. Each x row's
// sum of squares is made from the same reads of x (every warp reads all of
// x), so there is no pass of its own. (The norm is a template argument, not a
// flag read in the loop: the flags cost the engine's step 0.4 ms against the
// study's kernel, gpu-2026-11-26 run 6.)
template <int N, int NM>
__device__ __forceinline__ void gv_unit(const gv_args_t &a, uint4 (&wv)[GV_R][GV_U], const __half *const (&wr)[GV_R],
                                        float *const (&yr)[GV_R], const uint32_t (&yrows)[GV_R],
                                        const bool (&live)[GV_R])
{
    const uint32_t lane = threadIdx.x & 31, cols = a.cols, step = 32 * 8 * GV_U;
    float acc[GV_R][N], ss[N]; // ss: each x row's sum of squares, for the norm
#pragma unroll
    for (int j = 0; j < N; j++) {
        ss[j] = 0;
#pragma unroll
        for (int r = 0; r < GV_R; r++)
            acc[r][j] = 0;
    }
    // each round's loads are issued before the one before is used
    for (uint32_t c0 = lane * 8; c0 < cols; c0 += step) {
        uint4 nx[GV_R][GV_U];
        gv_round(nx, wr, c0 + step, cols);
#pragma unroll
        for (int u = 0; u < GV_U; u++) {
            const uint32_t c = c0 + u * 256;
            if (c >= cols)
                break;
            float4 g0, g1;
            if (NM == 2) {
                g0 = __ldg((const float4 *)(a.norm + c));
                g1 = __ldg((const float4 *)(a.norm + c + 4));
            }
#pragma unroll
            for (int j = 0; j < N; j++) {
                const float *xp = a.x + (size_t)j * cols + c;
                float4 x0 = __ldg((const float4 *)xp), x1 = __ldg((const float4 *)(xp + 4));
                if (NM)
                    ss[j] += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x + x1.y * x1.y +
                             x1.z * x1.z + x1.w * x1.w;
                if (NM == 2) {
                    x0.x *= g0.x, x0.y *= g0.y, x0.z *= g0.z, x0.w *= g0.w;
                    x1.x *= g1.x, x1.y *= g1.y, x1.z *= g1.z, x1.w *= g1.w;
                }
#pragma unroll
                for (int r = 0; r < GV_R; r++)
                    acc[r][j] += gv_dot8(wv[r][u], x0, x1);
            }
        }
#pragma unroll
        for (int u = 0; u < GV_U; u++)
#pragma unroll
            for (int r = 0; r < GV_R; r++)
                wv[r][u] = nx[r][u];
    }
#pragma unroll
    for (int j = 0; j < N; j++)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int r = 0; r < GV_R; r++)
                acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], o);
            if (NM)
                ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], o);
        }
    if (lane >= N)
        return;
    // lane j writes row j of x's results (a register array indexed by a
    // compile-time j only: the select below keeps it in registers)
    float v[GV_R], sq = ss[0];
#pragma unroll
    for (int j = 1; j < N; j++)
        if ((int)lane == j)
            sq = ss[j];
    const float scale = NM ? rsqrtf(sq / cols + a.eps) : 1.0f;
#pragma unroll
    for (int r = 0; r < GV_R; r++) {
        v[r] = acc[r][0];
#pragma unroll
        for (int j = 1; j < N; j++)
            if ((int)lane == j)
                v[r] = acc[r][j];
        v[r] *= scale;
    }
    if (a.glu) {
        float *o = yr[0] + (size_t)lane * yrows[0];
        *o = kc_silu_mul(v[0], v[1]);
        return;
    }
#pragma unroll
    for (int r = 0; r < GV_R; r++) {
        if (!live[r])
            continue;
        float *o = yr[r] + (size_t)lane * yrows[r];
        *o = a.acc ? *o + v[r] : v[r];
    }
}

template <int N, int NM> __global__ void __launch_bounds__(GV_WARPS * 32, GV_BLOCKS) k_gemv(const gv_args_t a)
{
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cols = a.cols;
    // the grid is at most what is resident at once: a warp takes units
    // unit, unit + stride, ... (GV_R rows of the weights' row space each)
    uint32_t unit = blockIdx.x * GV_WARPS + warp;
    const uint32_t stride = gridDim.x * GV_WARPS;
    const __half *wr[GV_R];
    float *yr[GV_R];
    uint32_t yrows[GV_R];
    bool live[GV_R];
    gv_rows(a, unit, wr, yr, yrows, live);
    // Before the wait (cuda_int.h's kc_pdl_wait) only the weights are read,
    // which no kernel writes: the first round into registers, while the
    // kernel before still runs. (Asking L2 for more of each row there, as
    // this kernel once did, made a step slower: gpu-2026-11-25f.)
    uint4 wv[GV_R][GV_U];
    gv_round(wv, wr, lane * 8, cols);
    kc_pdl_wait();
    for (bool first = true; unit < a.units; unit += stride, first = false) {
        if (!first) {
            gv_rows(a, unit, wr, yr, yrows, live);
            gv_round(wv, wr, lane * 8, cols);
        }
        gv_unit<N, NM>(a, wv, wr, yr, yrows, live);
    }
    kc_pdl_release(); // the next kernel's blocks may come in as this one's last ones finish
}

// The GEMV with the columns split among a block's warps (k_gemv_cols), which the step's matrices up to GC_B_COLS
// wide take: a block of W warps takes R adjacent weight rows at a time (a unit: contiguous in memory), warp w the
// 256-column chunks w, w + W, ... of them (at most CMAX), all of its loads of a unit in one round, the next unit's
// issued before this one is used. Each lane keeps x's values of its chunks in registers, read once after the wait
// (and the norm's weight multiplied in, and the sum of squares made, once); the warps' sums meet in shared memory
// (double-buffered: one barrier a unit), and the block's first lane writes the unit's results. A unit is then one
// round trip to memory for the block, not one a round for a warp as in k_gemv: a matrix's tail is one unit's round
// trip, and the grid reads a window of consecutive units at a time. Over a 7B step's matrices on an H200 this read
// 4,188 GB/s against k_gemv's 3,984 and a plain read's 4,472 (bench/results/gpu-2026-11-26e, runs 1 and 2).
#define GC_A_COLS 4096 // widest matrix of shape A: R 2, W 8, CMAX 2 (glu too)
#define GC_RES 64 // residual values a block reads ahead (k_gemv_cols with acc; R is 1 or 2)
#define GC_B_COLS 12288 // of shape B: R 1, W 16, CMAX 3 (no glu: a unit has one row)

// gv_rows for k_gemv_cols, with the two common cases computed directly: one weight (the output and down
// projections, the output matrix) and glu (gate/up); more weights (Q/K/V) look the row up.
template <int R>
__device__ __forceinline__ void gc_rows(const gv_args_t &a, uint32_t unit, const __half *(&wr)[R], float *(&yr)[R],
                                        bool (&live)[R])
{
    if (a.k == 1 && !a.glu) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint32_t g = unit * R + r;
            live[r] = g < a.end[0];
            wr[r] = a.w[0] + (size_t)(live[r] ? g : 0) * a.cols;
            yr[r] = a.y[0] + g;
        }
        return;
    }
    if (a.glu) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            live[r] = unit < a.units;
            wr[r] = a.w[r] + (size_t)(live[r] ? unit : 0) * a.cols;
            yr[r] = a.y[0] + unit;
        }
        return;
    }
    uint32_t yrows[R];
    gv_rows(a, unit, wr, yr, yrows, live);
}

template <int R, int W, int CMAX>
__device__ __forceinline__ void gc_load(uint4 (&wv)[R][CMAX], const gv_args_t &a, uint32_t unit, uint32_t warp,
                                        uint32_t lane, uint32_t nch)
{
    const __half *wr[R];
    float *yr[R];
    bool live[R];
    gc_rows(a, unit, wr, yr, live);
#pragma unroll
    for (int c = 0; c < CMAX; c++) {
        const uint32_t ch = warp + c * W, col = ch * 256 + lane * 8;
#pragma unroll
        for (int r = 0; r < R; r++)
            wv[r][c] = live[r] && ch < nch && col < a.cols ? gv_load(wr[r] + col) : make_uint4(0, 0, 0, 0);
    }
}

template <int R, int W, int CMAX, int NM>
__global__ void __launch_bounds__(W * 32, 1024 / (W * 32)) k_gemv_cols(const gv_args_t a)
{
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cols = a.cols, nch = (cols + 255) / 256;
    __shared__ float part[2][R][W], ssw[W], res[GC_RES];
    uint32_t unit = blockIdx.x;
    uint4 wv[R][CMAX];
    gc_load<R, W, CMAX>(wv, a, unit, warp, lane, nch); // weights only before the wait (cuda_int.h's kc_pdl_wait)
    kc_pdl_wait();
    float4 xs[CMAX][2];
    float ss = 0;
#pragma unroll
    for (int c = 0; c < CMAX; c++) {
        const uint32_t ch = warp + c * W, col = ch * 256 + lane * 8;
        float4 x0 = make_float4(0, 0, 0, 0), x1 = x0;
        if (ch < nch && col < cols) {
            x0 = __ldg((const float4 *)(a.x + col)), x1 = __ldg((const float4 *)(a.x + col + 4));
            if (NM)
                ss += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x + x1.y * x1.y +
                      x1.z * x1.z + x1.w * x1.w;
            if (NM == 2) {
                const float4 g0 = __ldg((const float4 *)(a.norm + col)), g1 = __ldg((const float4 *)(a.norm + col + 4));
                x0.x *= g0.x, x0.y *= g0.y, x0.z *= g0.z, x0.w *= g0.w;
                x1.x *= g1.x, x1.y *= g1.y, x1.z *= g1.z, x1.w *= g1.w;
            }
        }
        xs[c][0] = x0, xs[c][1] = x1;
    }
    // with acc, what the block's first GC_RES rows add to (the residual), read now, all at once: read by the
    // writer after each unit's barrier it was a round trip on the way of the first warp's next loads, 0.085 ms
    // a 7B step (gpu-2026-11-26e run 17)
    if (a.acc)
        for (uint32_t t = threadIdx.x; t < GC_RES; t += W * 32) {
            const __half *wr[R];
            float *yr[R];
            bool live[R];
            gc_rows(a, blockIdx.x + t / R * gridDim.x, wr, yr, live);
            const bool last = t % R == R - 1; // R is 1 or 2: row 0 or row R - 1
            res[t] = (last ? live[R - 1] : live[0]) ? *(last ? yr[R - 1] : yr[0]) : 0.0f;
        }
    float scale = 1.0f;
    if (NM) {
        ss = kc_warp_sum(ss);
        if (lane == 0)
            ssw[warp] = ss;
        __syncthreads();
        float t = 0;
#pragma unroll
        for (int i = 0; i < W; i++)
            t += ssw[i];
        scale = rsqrtf(t / cols + a.eps);
    }
    uint32_t turn = 0; // the block's units so far
    for (int buf = 0; unit < a.units; unit += gridDim.x, buf ^= 1, turn++) {
        uint4 nx[R][CMAX];
        gc_load<R, W, CMAX>(nx, a, unit + gridDim.x, warp, lane, nch);
        float acc[R] = {};
#pragma unroll
        for (int c = 0; c < CMAX; c++)
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r] += gv_dot8(wv[r][c], xs[c][0], xs[c][1]);
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] = kc_warp_sum(acc[r]);
            if (lane == 0)
                part[buf][r][warp] = acc[r];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const __half *wr[R];
            float *yr[R];
            bool live[R];
            gc_rows(a, unit, wr, yr, live);
            float v[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                v[r] = 0;
#pragma unroll
                for (int i = 0; i < W; i++)
                    v[r] += part[buf][r][i];
                v[r] *= scale;
            }
            if (R == 2 && a.glu)
                *yr[0] = kc_silu_mul(v[0], v[R - 1]);
            else
#pragma unroll
                for (int r = 0; r < R; r++)
                    if (live[r]) {
                        const uint32_t i = turn * R + r;
                        *yr[r] = v[r] + (!a.acc ? 0.0f : i < GC_RES ? res[i] : *yr[r]);
                    }
        }
#pragma unroll
        for (int c = 0; c < CMAX; c++)
#pragma unroll
            for (int r = 0; r < R; r++)
                wv[r][c] = nx[r][c];
    }
    kc_pdl_release();
}

// x's rows RMS-normed (weight g; none when g is NULL) and rounded to fp16: one block per row.
__global__ void k_norm_half(const float *x, const float *g, __half *y, uint32_t dim, float eps)
{
    kc_pdl_wait();
    kc_pdl_release();
    const float *xr = x + (size_t)blockIdx.x * dim;
    const float scale = kc_row_rms_scale(xr, dim, eps);
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        y[(size_t)blockIdx.x * dim + i] = __float2half_rn(g ? xr[i] * scale * g[i] : xr[i] * scale);
}

// The joined product's rows (n of `total` values) out to each weight's dense rows: y[i] gets its weight's values;
// with xs set (FP8's sums, gemm_fp8.cu), each times its token's scale xs[t] and its row's ws[r] on the way
typedef struct split_args {
    float *y[GV_MAXK];
    uint32_t end[GV_MAXK]; // the rows of weights 0 .. i together
    uint32_t k, total;
    const float *xs, *ws;
} split_args_t;

__global__ void k_split_rows(const float4 *side, const split_args_t a, size_t n4)
{
    kc_pdl_wait();
    kc_pdl_release();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n4)
        return;
    const uint32_t t4 = a.total / 4, r = (uint32_t)(i / t4), c = (uint32_t)(i % t4) * 4;
    uint32_t j = 0, lo = 0;
    while (c >= a.end[j])
        lo = a.end[j++];
    const uint32_t w = a.end[j] - lo;
    float4 v = side[i];
    if (a.xs) {
        const float t = a.xs[r];
        const float4 s = *(const float4 *)(a.ws + c);
        v = make_float4(v.x * t * s.x, v.y * t * s.y, v.z * t * s.z, v.w * t * s.w);
    }
    *(float4 *)(a.y[j] + (size_t)r * w + (c - lo)) = v;
}

td_status_t kc_split_rows(kern_cuda_t *c, const kern_matmul_spec_t *s, const float *side, const float *xs,
                          const float *ws)
{
    split_args_t a = {};
    uint32_t total = 0;
    for (uint32_t i = 0; i < s->k; i++) {
        a.y[i] = s->y[i];
        a.end[i] = total += s->w[i]->rows;
    }
    a.k = s->k;
    a.total = total;
    a.xs = xs;
    a.ws = ws;
    const size_t n4 = (size_t)s->n * total / 4;
    return kc_launch(c, "split_rows", k_split_rows, kc_blocks(n4, 256), 256, 0, (const float4 *)side, a, n4);
}

bool kc_side_by_side(const kern_matmul_spec_t *s, uint32_t hold)
{
    const size_t esz = hold == KERN_TYPE_F8_E4M3 ? 1 : sizeof(__half);
    for (uint32_t i = 0; i < s->k; i++) {
        const kern_weight_t *w = s->w[i], *prev = i ? s->w[i - 1] : NULL;
        if (w->hold != hold || w->rows % 4 ||
            (prev && (const char *)w->priv != (const char *)prev->priv + (size_t)prev->rows * w->cols * esz))
            return false;
    }
    return true;
}

// Whether s's fp16 weights lie side by side and its side has room for the joined product, so that one GEMM takes
// them all
static bool joined(const kern_matmul_spec_t *s)
{
    return s->k >= 2 && s->side && s->n <= s->side_rows && s->n <= KC_JOIN_MAXN &&
           (s->glu ? s->to_next : !s->accumulate) && kc_side_by_side(s, 0);
}

static td_status_t gemv(kern_cuda_t *c, const kern_matmul_spec_t *s)
{
    gv_args_t a = {};
    uint32_t total = 0;
    for (uint32_t i = 0; i < s->k; i++) {
        a.w[i] = (const __half *)s->w[i]->priv;
        a.y[i] = s->y[i];
        a.end[i] = total += s->w[i]->rows;
    }
    a.k = s->k;
    a.cols = s->w[0]->cols;
    a.n = s->n;
    a.x = s->x;
    a.norm = s->norm;
    a.eps = s->eps;
    a.glu = s->glu;
    a.acc = s->accumulate;
    const int nm = !s->norm ? 0 : s->norm_in_w ? 1 : 2;
    if (a.cols <= GC_A_COLS || (a.cols <= GC_B_COLS && !a.glu)) {
        // k_gemv_cols: a block a unit at a time, the grid at most what the device holds at once
        const bool A = a.cols <= GC_A_COLS;
        const unsigned r = A ? 2 : 1, w = A ? 8 : 16, held = c->gc_grid[A ? 0 : 1];
        a.units = a.glu ? s->w[0]->rows : (total + r - 1) / r;
        void (*const ka[3])(gv_args_t) = {k_gemv_cols<2, 8, 2, 0>, k_gemv_cols<2, 8, 2, 1>, k_gemv_cols<2, 8, 2, 2>};
        void (*const kb[3])(gv_args_t) = {k_gemv_cols<1, 16, 3, 0>, k_gemv_cols<1, 16, 3, 1>,
                                          k_gemv_cols<1, 16, 3, 2>};
        return kc_launch(c, "gemv_cols", A ? ka[nm] : kb[nm], a.units < held ? a.units : held, w * 32, 0, a);
    }
    a.units = s->glu ? s->w[0]->rows : (total + GV_R - 1) / GV_R;
    const unsigned blocks = kc_blocks(a.units, GV_WARPS), grid = blocks < c->gv_grid ? blocks : c->gv_grid;
    void (*const k[3])(gv_args_t) = {k_gemv<GV_MAXN, 0>, k_gemv<GV_MAXN, 1>, k_gemv<GV_MAXN, 2>};
    return kc_launch(c, "gemv", k[nm], grid, GV_WARPS * 32, 0, a);
}

// *grid: the blocks of kernel k (threads a block) the device holds at once, at least one an SM
static td_status_t resident(const kern_cuda_t *c, void (*k)(gv_args_t), int threads, unsigned *grid)
{
    int per_sm = 0;
    CU(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, 0));
    *grid = (unsigned)(per_sm > 0 ? per_sm : 1) * (unsigned)c->sms;
    return TD_OK;
}

td_status_t kc_matmul_fused_init(kern_cuda_t *c)
{
    td_status_t rc = resident(c, k_gemv<GV_MAXN, 2>, GV_WARPS * 32, &c->gv_grid);
    if (!rc)
        rc = resident(c, k_gemv_cols<2, 8, 2, 2>, 8 * 32, &c->gc_grid[0]);
    return rc ? rc : resident(c, k_gemv_cols<1, 16, 3, 2>, 16 * 32, &c->gc_grid[1]);
}

// A glu's product, now in xh as fp16, handed to the next call (to_next): it takes xh when its x is y[0]
static td_status_t hand_over(kern_cuda_t *c, const kern_matmul_spec_t *s, size_t ny)
{
    c->xh_of = s->y[0];
    c->xh_n = ny;
    c->xh_x_too = false; // y[0] keeps x·W0ᵀ
    return TD_OK;
}

td_status_t kc_matmul_fused(kern_backend_t *b, const kern_matmul_spec_t *s)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    // x handed over in fp16 by the call before (a glu with to_next, an attention); whatever this call does, xh is
    // then spent
    const bool handed = s->k && !s->norm && s->x == c->xh_of && (size_t)s->n * s->w[0]->cols == c->xh_n;
    const bool x_holds = !handed || c->xh_x_too; // x itself holds the values (else only xh does)
    c->xh_of = NULL;
    c->qkvh_of = c->qh_of = NULL;
    if (!s->k || s->k > GV_MAXK || (s->glu && (s->k != 2 || s->w[0]->rows != s->w[1]->rows || s->accumulate)))
        return td_error(TD_ERR_INVALID_ARG, "cuda: matmul_fused: %u weights%s%s", s->k, s->glu ? " with glu" : "",
                        s->glu && s->accumulate ? " and accumulate" : "");
    for (uint32_t i = 1; i < s->k; i++)
        if (s->w[i]->cols != s->w[0]->cols)
            return td_error(TD_ERR_INVALID_ARG, "cuda: matmul_fused: widths %u and %u differ", s->w[0]->cols,
                            s->w[i]->cols);
    const uint32_t cols = s->w[0]->cols;
    const size_t nx = (size_t)s->n * cols;
    if (!s->n)
        return TD_OK;
    if (s->w[0]->hold == KERN_TYPE_F8_E4M3 && kc_fp8_gemv_takes(s))
        return kc_fp8_gemv(c, s);
    if (s->n <= GV_MAXN && s->w[0]->cols % 8 == 0 && s->w[0]->hold != KERN_TYPE_F8_E4M3)
        return gemv(c, s);
    td_status_t rc = TD_OK;
    // FP8 weights multiply FP8 activations made from x, where x holds them (a handed attention output does; a
    // handed SwiGLU product is in xh alone and takes the weights' fp16 copy)
    if (s->w[0]->hold == KERN_TYPE_F8_E4M3 && x_holds && (rc = kc_fp8_matmul(c, s)) != TD_ERR_UNSUPPORTED)
        return rc;
    rc = TD_OK;
    if (!handed && !(rc = kc_scratch(c, &c->xh, nx * sizeof(__half)))) {
        if (s->norm)
            rc = kc_launch(c, "norm_half", k_norm_half, s->n, 256, 0, s->x, s->norm_in_w ? NULL : s->norm,
                           (__half *)c->xh.p, cols, s->eps);
        else
            rc = kc_to_half(c, s->x, (__half *)c->xh.p, nx);
    }
    const size_t ny = (size_t)s->n * s->w[0]->rows;
    if (!rc && joined(s)) {
        uint32_t total = 0;
        for (uint32_t i = 0; i < s->k; i++)
            total += s->w[i]->rows;
        if ((rc = kc_gemm_rows(c, (const __half *)s->w[0]->priv, total, cols, s->side, total, s->n, false)))
            return rc;
        if (!s->glu)
            return kc_split_rows(c, s, s->side, NULL, NULL);
        // to_next (joined()): the product to the next call's GEMMs in fp16, as below
        if ((rc = kc_scratch(c, &c->xh, ny * sizeof(__half))) ||
            (rc = kc_swiglu_half_rows(c, s->side, s->side + s->w[0]->rows, total, (__half *)c->xh.p, s->n,
                                      s->w[0]->rows)))
            return rc;
        return hand_over(c, s, ny);
    }
    if (!rc && s->to_next && !s->glu && s->k == 3 && !s->accumulate && !c->qkv_fp32 && !s->w[0]->hold &&
        !s->w[1]->hold && !s->w[2]->hold) {
        // Q, K and V in fp16 for the rope and the attention (to_next; rope_kv_store.cu takes them): half the bytes
        // written and read again (a 4k prompt's are 201 MB a layer in fp32); the attention rounds Q to fp16 and
        // the pool holds K and V so anyway
        size_t at = 0;
        for (uint32_t i = 0; i < 3; i++)
            at += (size_t)s->n * s->w[i]->rows;
        if ((rc = kc_scratch(c, &c->qkvh, at * sizeof(__half))))
            return rc;
        at = 0;
        for (uint32_t i = 0; i < 3 && !rc; i++) {
            rc = kc_gemm_rows_half(c, (const __half *)s->w[i]->priv, s->w[i]->rows, cols, (__half *)c->qkvh.p + at,
                                   s->n);
            c->qkvh_rows[i] = s->w[i]->rows;
            at += (size_t)s->n * s->w[i]->rows;
        }
        if (!rc)
            c->qkvh_of = s->y[0], c->qkvh_n = s->n;
        return rc;
    }
    if (!rc && s->glu && s->to_next && !s->w[0]->hold && !s->w[1]->hold && ny % 2 == 0) {
        // gate's and up's products in fp16, each in its own y's room (scratch both, kern_matmul_spec_t), read by
        // SwiGLU, whose product goes to the next call's GEMMs in fp16 as below: half the bytes written and read
        // again (a 4k prompt's gate and up are 180 MB a layer each in fp32); the product is rounded to fp16 anyway
        __half *gh = (__half *)s->y[0], *uh = (__half *)s->y[1];
        if ((rc = kc_gemm_rows_half(c, (const __half *)s->w[0]->priv, s->w[0]->rows, cols, gh, s->n)) ||
            (rc = kc_gemm_rows_half(c, (const __half *)s->w[1]->priv, s->w[1]->rows, cols, uh, s->n)) ||
            (rc = kc_scratch(c, &c->xh, ny * sizeof(__half))) || (rc = kc_swiglu_hh(c, gh, uh, (__half *)c->xh.p, ny)))
            return rc;
        return hand_over(c, s, ny);
    }
    for (uint32_t i = 0; i < s->k && !rc; i++)
        rc = kc_gemm(c, s->w[i], s->y[i], s->n, s->accumulate);
    if (rc || !s->glu)
        return rc;
    if (!s->to_next)
        return kc_swiglu(b, s->y[0], s->y[1], s->y[0], ny);
    // the product goes to the next call's GEMMs in fp16, in xh (the GEMMs above are done with it: the same
    // stream, and a scratch that grows waits for them first); y[0] keeps x·W0ᵀ, not the product
    if ((rc = kc_scratch(c, &c->xh, ny * sizeof(__half))) ||
        (rc = kc_swiglu_half(c, s->y[0], s->y[1], (__half *)c->xh.p, ny)))
        return rc;
    return hand_over(c, s, ny);
}
