// gemv_study.cu — which shape of batch-1 GEMV reads a 7B-shaped decode step's weights fastest on this GPU
// (bench/results/gpu-2026-11-25f, runs 5 and 6). The step's 129 matrices (32 layers of QKV 12288x4096, O
// 4096x4096, gate/up 22016x4096, down 4096x11008; the output 32000x4096), each distinct, are multiplied by
// one fp32 row back to back in a captured graph, and the whole step is timed against the bytes of the
// weights, beside one kernel that only reads them. A variant is: R rows a warp, U 16-byte loads a lane a row
// in a round (the next round's loads issued before this one is used, as kernels/cuda/matmul_fused.cu does),
// W warps a block; persistent: the grid is what the device holds at once and a warp takes unit after unit;
// an L2 hint on the loads; with the norm: each block first reduces x (the RMSNorm the fused kernel folds in
// on QKV, gate/up and the output). Built with the CUDA backend (tandem-gemv-study); deploy/gpu-bundle.sh
// carries it and bundle/run.sh 5 runs it.
// The check compares the output's first rows with a host dot product (not with the norm on).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <algorithm>
#include <vector>

#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_int.h"
#include "kernels/quant.h"

template <int L2HINT> __device__ __forceinline__ uint4 ld16(const __half *p)
{
    uint4 v;
    if (L2HINT == 256)
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else if (L2HINT == 128)
        asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else if (L2HINT == 1)
        asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b)
{
    const __half2 *h = (const __half2 *)&w;
    float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
    return f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w + f2.x * b.x + f2.y * b.y + f3.x * b.z + f3.y * b.w;
}

template <int R, int U, int W, bool PERSIST, int L2HINT, bool PDL = false>
__global__ void __launch_bounds__(W * 32)
    k_gemv(const __half *w, const float *x, float *y, uint32_t rows, uint32_t cols, int norm)
{
    bool waited = !PDL;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, units = rows / R, step = 32 * 8 * U;
    __shared__ float part[W], scale;
    if (norm) {
        float ss = 0;
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x)
            ss += x[c] * x[c];
        for (int o = 16; o > 0; o >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0)
            part[warp] = ss;
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0;
            for (int i = 0; i < W; i++)
                t += part[i];
            scale = rsqrtf(t / cols + 1e-5f);
        }
        __syncthreads();
    }
    for (uint32_t unit = blockIdx.x * W + warp; unit < units; unit += PERSIST ? gridDim.x * W : units) {
        const __half *wr[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            wr[r] = w + (size_t)(unit * R + r) * cols;
        uint4 wv[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t c = lane * 8 + u * 256;
                wv[r][u] = c < cols ? ld16<L2HINT>(wr[r] + c) : make_uint4(0, 0, 0, 0);
            }
        if (!waited) { // programmatic launch: the first round loaded before the wait for the kernel before
            asm volatile("griddepcontrol.wait;" ::: "memory");
            waited = true;
        }
        float acc[R] = {};
        for (uint32_t c0 = lane * 8; c0 < cols; c0 += step) {
            uint4 nx[R][U];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const uint32_t c = c0 + step + u * 256;
                    nx[r][u] = c < cols ? ld16<L2HINT>(wr[r] + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const uint32_t c = c0 + u * 256;
                if (c >= cols)
                    break;
                float4 x0 = __ldg((const float4 *)(x + c)), x1 = __ldg((const float4 *)(x + c + 4));
#pragma unroll
                for (int r = 0; r < R; r++)
                    acc[r] += dot8(wv[r][u], x0, x1);
            }
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++)
                    wv[r][u] = nx[r][u];
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] = kc_warp_sum(acc[r]);
            if (lane == 0)
                y[unit * R + r] = norm ? acc[r] * scale : acc[r];
        }
    }
    if (!waited)
        asm volatile("griddepcontrol.wait;" ::: "memory");
    if (PDL)
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Split columns: a block of W warps takes R adjacent rows at a time (a unit: R rows, contiguous in memory), and
// warp w takes the 256-column chunks w, w + W, ... (at most CMAX) of each of them, all of its loads of a unit in
// one round; the next unit's loads are issued before this one is used; the warps' sums meet in shared memory
// (double-buffered, one barrier a unit). So a unit is one round trip to memory for the block, not one a round
// for a warp: a matrix's tail is a unit's round trip, and at any time the grid reads a window of consecutive
// units. XR: each lane keeps x's values of its chunks in registers (read once); else x through L1 each unit.
// k_split's loads of unit `unit`: warp w's chunks of its R rows (zeros past the row or the units)
template <int R, int W, int CMAX>
__device__ __forceinline__ void split_load(uint4 (&wv)[R][CMAX], const __half *w, uint32_t unit, uint32_t units,
                                           uint32_t cols, uint32_t nch, uint32_t warp, uint32_t lane)
{
#pragma unroll
    for (int c = 0; c < CMAX; c++) {
        const uint32_t ch = warp + c * W, col = ch * 256 + lane * 8;
#pragma unroll
        for (int r = 0; r < R; r++)
            wv[r][c] = ch < nch && col < cols && unit < units ? ld16<0>(w + (size_t)(unit * R + r) * cols + col)
                                                             : make_uint4(0, 0, 0, 0);
    }
}

template <int R, int W, int CMAX, bool XR, int MINB>
__global__ void __launch_bounds__(W * 32, MINB)
    k_split(const __half *w, const float *x, float *y, uint32_t rows, uint32_t cols, int)
{
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, units = rows / R;
    const uint32_t nch = (cols + 255) / 256;
    __shared__ float part[2][R][W];
    uint32_t unit = blockIdx.x;
    uint4 wv[R][CMAX];
    split_load<R, W, CMAX>(wv, w, unit, units, cols, nch, warp, lane);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    float4 xs[CMAX][2];
    if (XR)
#pragma unroll
        for (int c = 0; c < CMAX; c++) {
            const uint32_t ch = warp + c * W, col = ch * 256 + lane * 8;
            const bool in = ch < nch && col < cols;
            xs[c][0] = in ? __ldg((const float4 *)(x + col)) : make_float4(0, 0, 0, 0);
            xs[c][1] = in ? __ldg((const float4 *)(x + col + 4)) : make_float4(0, 0, 0, 0);
        }
    for (int buf = 0; unit < units; unit += gridDim.x, buf ^= 1) {
        uint4 nx[R][CMAX];
        split_load<R, W, CMAX>(nx, w, unit + gridDim.x, units, cols, nch, warp, lane);
        float acc[R] = {};
#pragma unroll
        for (int c = 0; c < CMAX; c++) {
            const uint32_t ch = warp + c * W, col = ch * 256 + lane * 8;
            float4 x0, x1;
            if (XR)
                x0 = xs[c][0], x1 = xs[c][1];
            else if (ch < nch && col < cols)
                x0 = __ldg((const float4 *)(x + col)), x1 = __ldg((const float4 *)(x + col + 4));
            else
                x0 = x1 = make_float4(0, 0, 0, 0);
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r] += dot8(wv[r][c], x0, x1);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] = kc_warp_sum(acc[r]);
            if (lane == 0)
                part[buf][r][warp] = acc[r];
        }
        __syncthreads();
        if (warp == 0 && lane < R) {
            float s = 0;
#pragma unroll
            for (int i = 0; i < W; i++)
                s += part[buf][lane][i];
            y[unit * R + lane] = s;
        }
#pragma unroll
        for (int c = 0; c < CMAX; c++)
#pragma unroll
            for (int r = 0; r < R; r++)
                wv[r][c] = nx[r][c];
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// The whole chain in one persistent kernel (R2 U2 W8, 4 blocks an SM, all resident: a cooperative launch): the
// matrices one after another, and between two a barrier of the whole grid (BAR), as a step whose every matmul
// takes the one before's output would need. Before the barrier each warp already loads its first unit's first
// rounds of the next matrix (the weights depend on nothing): P = 0, the first round into registers (what the
// kernel per matmul does before its programmatic wait); P > 0, P rounds into the warp's shared memory by
// cp.async. XL2: x read through L2 only (ld.cg), as x written inside the same kernel must be; else through L1.
struct Chain {
    const __half *const *w;
    const uint32_t *rows, *cols;
    int n;
    const float *x;
    float *y;
    unsigned *bar;
};

__device__ __forceinline__ void cp16(void *smem, const void *g)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"(g)
                 : "memory");
}

template <int P, bool BAR, bool XL2> __global__ void __launch_bounds__(256, 4) k_chain(const Chain a)
{
    constexpr int R = 2, U = 2, W = 8;
    constexpr uint32_t step = 32 * 8 * U;
    extern __shared__ uint4 pre[]; // [W][P][R][U][32]
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stride = gridDim.x * W,
                   first = blockIdx.x * W + warp;
    uint4 *mine = pre + (size_t)warp * P * R * U * 32;
    uint4 wv[R][U];
    auto prefetch = [&](int m) {
        const uint32_t cols = a.cols[m];
        if (first >= a.rows[m] / R)
            return;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const __half *row = a.w[m] + (size_t)(first * R + r) * cols;
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (P == 0) {
                    const uint32_t c = lane * 8 + u * 256;
                    wv[r][u] = c < cols ? ld16<0>(row + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int i = 0; i < P; i++) {
                    const uint32_t c = lane * 8 + i * step + u * 256;
                    if (c < cols)
                        cp16(mine + ((i * R + r) * U + u) * 32 + lane, row + c);
                }
            }
        }
        if (P)
            asm volatile("cp.async.commit_group;" ::: "memory");
    };
    prefetch(0);
    for (int m = 0; m < a.n; m++) {
        const __half *w = a.w[m];
        const uint32_t cols = a.cols[m], units = a.rows[m] / R;
        if (P)
            asm volatile("cp.async.wait_all;" ::: "memory");
        for (uint32_t unit = first; unit < units; unit += stride) {
            const bool pf = unit == first;
            const __half *wr[R];
#pragma unroll
            for (int r = 0; r < R; r++)
                wr[r] = w + (size_t)(unit * R + r) * cols;
            if (!pf || P > 0)
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const uint32_t c = lane * 8 + u * 256;
                        wv[r][u] = pf ? mine[(r * U + u) * 32 + lane]
                                      : c < cols ? ld16<0>(wr[r] + c) : make_uint4(0, 0, 0, 0);
                    }
            float acc[R] = {};
            int i = 0;
            for (uint32_t c0 = lane * 8; c0 < cols; c0 += step, i++) {
                uint4 nx[R][U];
                const bool from_smem = pf && i + 1 < P;
#pragma unroll
                for (int u = 0; u < U; u++)
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const uint32_t c = c0 + step + u * 256;
                        nx[r][u] = from_smem ? mine[(((i + 1) * R + r) * U + u) * 32 + lane]
                                   : c < cols ? ld16<0>(wr[r] + c) : make_uint4(0, 0, 0, 0);
                    }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const uint32_t c = c0 + u * 256;
                    if (c >= cols)
                        break;
                    float4 x0, x1;
                    if (XL2)
                        x0 = __ldcg((const float4 *)(a.x + c)), x1 = __ldcg((const float4 *)(a.x + c + 4));
                    else
                        x0 = __ldg((const float4 *)(a.x + c)), x1 = __ldg((const float4 *)(a.x + c + 4));
#pragma unroll
                    for (int r = 0; r < R; r++)
                        acc[r] += dot8(wv[r][u], x0, x1);
                }
#pragma unroll
                for (int u = 0; u < U; u++)
#pragma unroll
                    for (int r = 0; r < R; r++)
                        wv[r][u] = nx[r][u];
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
                    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
                if (lane == 0)
                    a.y[unit * R + r] = acc[r];
            }
        }
        if (m + 1 == a.n)
            break;
        prefetch(m + 1);
        if (BAR) {
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(a.bar, 1u);
                const unsigned target = (unsigned)(m + 1) * gridDim.x;
                unsigned v;
                do
                    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(a.bar) : "memory");
                while (v < target);
            }
            __syncthreads();
        }
    }
}

__global__ void k_read(const uint4 *p, size_t n, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u)
        *sink = acc;
}

__global__ void k_fill(__half *p, size_t n, uint32_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        p[i] = __float2half(((h >> 8) & 0xffff) / 65536.0f - 0.5f);
    }
}

struct Mat {
    uint32_t rows, cols;
    const __half *w;
    int norm;
};

struct Bench {
    std::vector<Mat> mats;
    const float *x;
    float *y;
    int sms;
    double bytes;
    float check[8];
};

static float median_ms(cudaStream_t s, void (*launch)(cudaStream_t, void *), void *arg)
{
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ms;
    for (int i = -2; i < 9; i++) {
        cudaEventRecord(a, s);
        launch(s, arg);
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float t;
        cudaEventElapsedTime(&t, a, b);
        if (i >= 0)
            ms.push_back(t);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return ms[4];
}

static void graph_launch(cudaStream_t s, void *g) { cudaGraphLaunch((cudaGraphExec_t)g, s); }

// Launches k into s (being captured), programmatically dependent on the kernel before when pdl.
template <typename... P, typename... A>
static void launch(cudaStream_t s, void (*k)(P...), uint32_t grid, uint32_t block, size_t smem, bool pdl, A... args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = s, cfg.attrs = &at;
    cfg.numAttrs = pdl ? 1 : 0;
    cudaLaunchKernelEx(&cfg, k, args...);
}

// Prints a step's line: its time against the weights' bytes, and (when `checked`) the output's first rows against
// the host's dot products.
static void report_step(const char *name, const Bench &b, const char *label, float ms, bool checked)
{
    float hy[8];
    cudaMemcpy(hy, b.y, sizeof hy, cudaMemcpyDeviceToHost);
    double err = 0;
    for (int i = 0; i < 8; i++)
        err = std::max(err, (double)fabsf(hy[i] - b.check[i]) / (fabsf(b.check[i]) + 1e-3));
    printf("%-34s %s  step %.3f ms  %.0f GB/s  %s  %s\n", name, label, ms, b.bytes / (ms * 1e-3) / 1e9,
           !checked ? "(not checked)" : err < 1e-3 ? "check ok" : "CHECK FAILED",
           cudaGetErrorString(cudaGetLastError()));
}

// Times the captured step g on s (median of 9), checks the output's first rows when `checked`, prints the line
// and frees g and s.
static void time_graph(const char *name, Bench &b, cudaStream_t s, cudaGraph_t g, const char *label, bool checked)
{
    cudaGraphExec_t ge;
    cudaGraphInstantiate(&ge, g, 0);
    report_step(name, b, label, median_ms(s, graph_launch, ge), checked);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
}

template <int R, int U, int W, bool PERSIST, int L2HINT, bool PDL = false>
static void run(const char *name, Bench &b, int with_norm = 0) // 1: the norm; 2: no check
{
    auto k = k_gemv<R, U, W, PERSIST, L2HINT, PDL>;
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, W * 32, 0);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaGraph_t g;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (auto &m : b.mats) {
        uint32_t units = m.rows / R, blocks = (units + W - 1) / W;
        if (PERSIST)
            blocks = std::min<uint32_t>(blocks, per_sm * b.sms);
        launch(s, k, blocks, W * 32, 0, PDL, m.w, b.x, b.y, m.rows, m.cols, (int)(with_norm == 1 && m.norm));
    }
    cudaStreamEndCapture(s, &g);
    char label[32];
    snprintf(label, sizeof label, "%d blocks/SM", per_sm);
    time_graph(name, b, s, g, label, !with_norm);
}

struct ReadArg {
    const uint4 *p;
    size_t n;
    unsigned *sink;
    int sms;
};
static void read_launch(cudaStream_t s, void *v)
{
    ReadArg *r = (ReadArg *)v;
    k_read<<<r->sms * 4, 512, 0, s>>>(r->p, r->n, r->sink);
}

// The engine's epilogues on the committed shape (R2 U2 W8, persistent, programmatic launch), to see what each
// costs in the step. NM, the norm on the matrices that have it: 0 none; 1 as kernels/cuda/matmul_fused.cu folds
// it (x times the norm's weight as it is read, each x row's sum of squares from the same reads, the scale after
// the dot product); 2 the sum of squares only (the norm's weight folded into the weights at load); 3 each block
// first stages x times the weight in shared memory and reduces the sum of squares there. XS: x read from shared
// memory (staged by each block first) on every matrix. GLU: gate/up as the engine runs it (a warp takes row r of
// W0 and row r of W1, the two halves of the 22016-row matrix, and writes silu(a) * b).
template <int NM, bool GLU, bool XS>
__global__ void __launch_bounds__(256, 4)
    k_gemv_e(const __half *w, const float *x, const float *g, float *y, uint32_t rows, uint32_t cols, int norm,
             int glu)
{
    constexpr int R = 2, U = 2, W = 8;
    extern __shared__ float xs[]; // NM 3 or XS: x (times the norm's weight) staged
    __shared__ float part[W];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, step = 32 * 8 * U;
    const bool pair = GLU && glu, stage = XS || (NM == 3 && norm);
    const uint32_t units = pair ? rows / 2 : rows / R;
    uint32_t unit = blockIdx.x * W + warp;
    const __half *wr[R];
    uint4 wv[R][U];
    auto first_round = [&]() {
#pragma unroll
        for (int r = 0; r < R; r++)
            wr[r] = w + (size_t)(pair ? unit + r * (rows / 2) : unit * R + r) * cols;
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t c = lane * 8 + u * 256;
                wv[r][u] = c < cols && unit < units ? ld16<0>(wr[r] + c) : make_uint4(0, 0, 0, 0);
            }
    };
    first_round();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    float bscale = 1.0f; // NM 3: the block's scale
    if (stage) {
        float ss = 0;
        for (uint32_t c = threadIdx.x * 4; c < cols; c += 256 * 4) {
            float4 v = __ldg((const float4 *)(x + c));
            if (NM == 3 && norm) {
                const float4 gg = __ldg((const float4 *)(g + c));
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                v.x *= gg.x, v.y *= gg.y, v.z *= gg.z, v.w *= gg.w;
            }
            *(float4 *)(xs + c) = v;
        }
        if (NM == 3 && norm) {
            for (int o = 16; o > 0; o >>= 1)
                ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0)
                part[warp] = ss;
        }
        __syncthreads();
        if (NM == 3 && norm) {
            float t = 0;
#pragma unroll
            for (int i = 0; i < W; i++)
                t += part[i];
            bscale = rsqrtf(t / cols + 1e-5f);
        }
    }
    for (bool firstu = true; unit < units; unit += gridDim.x * W, firstu = false) {
        if (!firstu)
            first_round();
        float acc[R] = {}, ss = 0;
        for (uint32_t c0 = lane * 8; c0 < cols; c0 += step) {
            uint4 nx[R][U];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const uint32_t c = c0 + step + u * 256;
                    nx[r][u] = c < cols ? ld16<0>(wr[r] + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const uint32_t c = c0 + u * 256;
                if (c >= cols)
                    break;
                float4 x0, x1;
                if (stage)
                    x0 = *(const float4 *)(xs + c), x1 = *(const float4 *)(xs + c + 4);
                else
                    x0 = __ldg((const float4 *)(x + c)), x1 = __ldg((const float4 *)(x + c + 4));
                if ((NM == 1 || NM == 2) && norm)
                    ss += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x + x1.y * x1.y +
                          x1.z * x1.z + x1.w * x1.w;
                if (NM == 1 && norm) {
                    const float4 g0 = __ldg((const float4 *)(g + c)), g1 = __ldg((const float4 *)(g + c + 4));
                    x0.x *= g0.x, x0.y *= g0.y, x0.z *= g0.z, x0.w *= g0.w;
                    x1.x *= g1.x, x1.y *= g1.y, x1.z *= g1.z, x1.w *= g1.w;
                }
#pragma unroll
                for (int r = 0; r < R; r++)
                    acc[r] += dot8(wv[r][u], x0, x1);
            }
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++)
                    wv[r][u] = nx[r][u];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
            if ((NM == 1 || NM == 2) && norm)
                ss += __shfl_xor_sync(0xffffffffu, ss, o);
        }
        const float scale = (NM == 1 || NM == 2) && norm ? rsqrtf(ss / cols + 1e-5f) : bscale;
        if (lane == 0) {
            if (pair)
                y[unit] = acc[0] * scale / (1.0f + __expf(-acc[0] * scale)) * (acc[1] * scale);
            else
#pragma unroll
                for (int r = 0; r < R; r++)
                    y[unit * R + r] = acc[r] * scale;
        }
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <int NM, bool GLU, bool XS> static void run_e(const char *name, Bench &b, const float *g)
{
    auto k = k_gemv_e<NM, GLU, XS>;
    const size_t smem = NM == 3 || XS ? 11008 * 4 : 0;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, smem);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaGraph_t gr;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (auto &m : b.mats) {
        const int glu = m.rows == 22016;
        uint32_t units = m.rows / 2, blocks = std::min<uint32_t>((units + 7) / 8, per_sm * b.sms);
        launch(s, k, blocks, 256, smem, true, m.w, b.x, g, b.y, m.rows, m.cols, m.norm, glu);
    }
    cudaStreamEndCapture(s, &gr);
    char label[32];
    snprintf(label, sizeof label, "%d blocks/SM", per_sm);
    time_graph(name, b, s, gr, label, !NM);
}

// The engine's own GEMV, through the CUDA backend's matmul_fused (kernels/cuda/matmul_fused.cu) on the same
// weights, captured and replayed by the backend: LAYER 0, every matrix alone (k 1, no norm, no add: the study's
// plain chain); 1, as a layer calls it (Q, K and V as three weights with the norm, the output projection added
// onto the residual, gate and up as two weights with glu and the norm, down added, the output with the norm);
// 2, the same with the norm's weight in the weights (norm_in_w; the weights are not scaled: timing only).
// layer: 0 every matrix alone; 1 as a layer (Q/K/V three weights, the norm, glu, the adds); 2 the same with the
// norm in the weights; 3 the same with Q/K/V one weight
static void run_engine(const char *name, Bench &b, int layer)
{
    kern_backend_t *be;
    if (kern_cuda_backend_create(0, &be)) {
        printf("%-34s no backend\n", name);
        return;
    }
    float *buf[8], *g;
    for (int i = 0; i < 8; i++)
        cudaMalloc(&buf[i], 32000 * 4), cudaMemset(buf[i], 0, 32000 * 4);
    cudaMalloc(&g, 11008 * 4);
    cudaMemset(g, 0, 11008 * 4);
    std::vector<kern_weight_t> ws;
    ws.reserve(b.mats.size() * 3);
    int rc = be->ops->capture_begin(be);
    for (size_t i = 0; i < b.mats.size() && !rc; i++) {
        const Mat &m = b.mats[i];
        kern_matmul_spec_t sp = {};
        const kern_weight_t *w[3];
        float *y[3] = {buf[0], buf[1], buf[2]};
        const int kind = i + 1 == b.mats.size() ? 4 : (int)(i % 4); // 0 QKV, 1 O, 2 gate/up, 3 down, 4 output
        uint32_t parts = 1;
        if (layer && layer != 3 && kind == 0)
            parts = 3;
        if (layer && kind == 2)
            parts = 2;
        for (uint32_t k = 0; k < parts; k++) {
            ws.push_back({KERN_TYPE_F16, m.rows / parts, m.cols, nullptr,
                          (void *)(m.w + (size_t)k * (m.rows / parts) * m.cols)});
            w[k] = &ws.back();
        }
        sp.w = w, sp.y = y, sp.k = parts, sp.n = 1, sp.eps = 1e-5f;
        sp.x = b.x;
        if (layer) {
            if (kind == 0 || kind == 2 || kind == 4)
                sp.norm = g, sp.norm_in_w = layer >= 2;
            if (kind == 1 || kind == 3)
                sp.accumulate = true, sp.y = &buf[3];
            if (kind == 2)
                sp.glu = true, sp.to_next = true;
        }
        rc = be->ops->matmul_fused(be, &sp);
    }
    if (!rc)
        rc = be->ops->capture_end(be, 7, true);
    cudaStream_t s = (cudaStream_t)be->ops->queue(be);
    struct Arg {
        kern_backend_t *be;
    } arg = {be};
    auto replay = [](cudaStream_t, void *v) { ((Arg *)v)->be->ops->replay(((Arg *)v)->be, 7); };
    float ms = rc ? 0 : median_ms(s, replay, &arg);
    printf("%-34s %s  step %.3f ms  %.0f GB/s  %s\n", name, rc ? "FAILED" : "", ms, b.bytes / (ms * 1e-3) / 1e9,
           cudaGetErrorString(cudaGetLastError()));
    kern_cuda_backend_destroy(be);
    for (int i = 0; i < 8; i++)
        cudaFree(buf[i]);
    cudaFree(g);
}

struct ChainRun {
    void (*k)(Chain);
    Chain c;
    int blocks;
    size_t smem;
};
static void chain_launch(cudaStream_t s, void *v)
{
    ChainRun *r = (ChainRun *)v;
    cudaMemsetAsync(r->c.bar, 0, sizeof(unsigned), s);
    void *args[] = {&r->c};
    cudaLaunchCooperativeKernel((void *)r->k, r->blocks, 256, args, r->smem, s);
}

template <int P, bool BAR, bool XL2> static void run_chain(const char *name, Bench &b, const Chain &c)
{
    ChainRun r = {k_chain<P, BAR, XL2>, c, 0, (size_t)8 * P * 2 * 2 * 32 * 16};
    cudaFuncSetAttribute(r.k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)r.smem);
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, r.k, 256, r.smem);
    r.blocks = per_sm * b.sms;
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    char label[32];
    snprintf(label, sizeof label, "%d blocks/SM", per_sm);
    report_step(name, b, label, median_ms(s, chain_launch, &r), true);
    cudaStreamDestroy(s);
}

typedef void (*SplitK)(const __half *, const float *, float *, uint32_t, uint32_t, int);

// The step with k_split: K4 for the matrices 4096 wide (W4 warps a block), K11 for the down projections (11008),
// each with its own R, all launched programmatically dependent; the grid what the device holds at once.
static void run_split(const char *name, Bench &b, SplitK k4, int w4, int r4, SplitK k11, int w11, int r11)
{
    int ps4 = 0, ps11 = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ps4, k4, w4 * 32, 0);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ps11, k11, w11 * 32, 0);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaGraph_t g;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (auto &m : b.mats) {
        const bool wide = m.cols > 4096;
        const int r = wide ? r11 : r4, per_sm = wide ? ps11 : ps4;
        const uint32_t units = m.rows / r, blocks = std::min<uint32_t>(units, per_sm * b.sms);
        launch(s, wide ? k11 : k4, blocks, (wide ? w11 : w4) * 32, 0, true, m.w, b.x, b.y, m.rows, m.cols, 0);
    }
    cudaStreamEndCapture(s, &g);
    char label[32];
    snprintf(label, sizeof label, "%d/%d blocks/SM", ps4, ps11);
    time_graph(name, b, s, g, label, true);
}

int main(int argc, char **argv)
{
    Bench b;
    cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0);
    const uint32_t shapes[4][2] = {{12288, 4096}, {4096, 4096}, {22016, 4096}, {4096, 11008}};
    size_t total = 0;
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < 4; i++)
            b.mats.push_back({shapes[i][0], shapes[i][1], nullptr, i == 0 || i == 2}),
                total += (size_t)shapes[i][0] * shapes[i][1];
    b.mats.push_back({32000, 4096, nullptr, 1});
    total += (size_t)32000 * 4096;
    __half *w;
    if (cudaMalloc(&w, total * 2) != cudaSuccess) {
        printf("no memory for %.1f GB of weights\n", total * 2 / 1e9);
        return 1;
    }
    k_fill<<<b.sms * 8, 256>>>(w, total, 1234);
    size_t off = 0;
    for (auto &m : b.mats)
        m.w = w + off, off += (size_t)m.rows * m.cols;
    float *x, *y;
    cudaMalloc(&x, 11008 * 4);
    cudaMalloc(&y, 32000 * 4);
    std::vector<float> hx(11008);
    for (int i = 0; i < 11008; i++)
        hx[i] = (i % 17) * 0.01f - 0.08f;
    cudaMemcpy(x, hx.data(), 11008 * 4, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
    b.x = x, b.y = y;
    const Mat &last = b.mats.back(); // the last launch writes y: the output's first rows are checked
    std::vector<__half> hw((size_t)8 * last.cols);
    cudaMemcpy(hw.data(), last.w, hw.size() * 2, cudaMemcpyDeviceToHost);
    for (int r = 0; r < 8; r++) {
        double sum = 0;
        for (uint32_t c = 0; c < last.cols; c++)
            sum += (double)__half2float(hw[(size_t)r * last.cols + c]) * hx[c];
        b.check[r] = (float)sum;
    }
    b.bytes = total * 2.0;
    printf("%d SMs, %.2f GB of weights, %zu kernels a step\n", b.sms, b.bytes / 1e9, b.mats.size());
    if (argc > 1 && !strcmp(argv[1], "split")) {
        // the committed shape against split columns, alternating, three passes
        for (int rep = 0; rep < 3; rep++) {
            ReadArg ra = {(const uint4 *)w, total * 2 / 16, (unsigned *)y, b.sms};
            float ms = median_ms(0, read_launch, &ra);
            printf("%-34s one kernel reading every weight: %.3f ms  %.0f GB/s\n", "read floor", ms,
                   b.bytes / (ms * 1e-3) / 1e9);
            run<2, 2, 8, true, 0, true>("R2 U2 W8 persistent, programmatic", b);
            run_split("split R1 W8, x regs | R1 W16", b, k_split<1, 8, 2, true, 4>, 8, 1, k_split<1, 16, 3, true, 2>,
                      16, 1);
            run_split("split R2 W8, x regs | R1 W16", b, k_split<2, 8, 2, true, 4>, 8, 2, k_split<1, 16, 3, true, 2>,
                      16, 1);
            run_split("split R2 W8, x L1 | R1 W8 x L1", b, k_split<2, 8, 2, false, 4>, 8, 2,
                      k_split<1, 8, 6, false, 4>, 8, 1);
            run_split("split R4 W8, x regs | R2 W16", b, k_split<4, 8, 2, true, 3>, 8, 4, k_split<2, 16, 3, true, 2>,
                      16, 2);
            run_split("split R2 W4, x L1 | R1 W4 x L1", b, k_split<2, 4, 4, false, 6>, 4, 2,
                      k_split<1, 4, 11, false, 5>, 4, 1);
            run_split("split R1 W16, x regs | R1 W16", b, k_split<1, 16, 1, true, 2>, 16, 1,
                      k_split<1, 16, 3, true, 2>, 16, 1);
            run_split("split R2 W8, x regs | R1 W8 x L1", b, k_split<2, 8, 2, true, 4>, 8, 2,
                      k_split<1, 8, 6, false, 4>, 8, 1);
            run_split("split R2 W8, x regs | R1 W12 x L1", b, k_split<2, 8, 2, true, 4>, 8, 2,
                      k_split<1, 12, 4, false, 2>, 12, 1);
            run_engine("engine's kernel: plain", b, 0);
            run_engine("engine's kernel: layer, norm_in_w", b, 2);
            run_engine("engine's kernel: the same, QKV one", b, 3);
        }
        return 0;
    }
    if (argc > 1 && !strcmp(argv[1], "chain")) {
        // the step's chain as 129 kernels (with and without programmatic launch) against one kernel with a
        // barrier of the grid between matrices, alternating, three passes
        std::vector<const __half *> hw_ptr;
        std::vector<uint32_t> hrc;
        for (auto &m : b.mats)
            hw_ptr.push_back(m.w), hrc.push_back(m.rows);
        for (auto &m : b.mats)
            hrc.push_back(m.cols);
        const __half **dw;
        uint32_t *drc;
        unsigned *bar;
        cudaMalloc(&dw, hw_ptr.size() * sizeof *dw);
        cudaMalloc(&drc, hrc.size() * 4);
        cudaMalloc(&bar, 4);
        cudaMemcpy(dw, hw_ptr.data(), hw_ptr.size() * sizeof *dw, cudaMemcpyHostToDevice);
        cudaMemcpy(drc, hrc.data(), hrc.size() * 4, cudaMemcpyHostToDevice);
        float *g;
        cudaMalloc(&g, 11008 * 4);
        cudaMemcpy(g, hx.data(), 11008 * 4, cudaMemcpyHostToDevice);
        const Chain c = {dw, drc, drc + b.mats.size(), (int)b.mats.size(), x, y, bar};
        for (int rep = 0; rep < 3; rep++) {
            ReadArg ra = {(const uint4 *)w, total * 2 / 16, (unsigned *)y, b.sms};
            float ms = median_ms(0, read_launch, &ra);
            printf("%-34s one kernel reading every weight: %.3f ms  %.0f GB/s\n", "read floor", ms,
                   b.bytes / (ms * 1e-3) / 1e9);
            run<2, 2, 8, true, 0>("kernels: R2 U2 W8 persistent", b);
            run<2, 2, 8, true, 0, true>("kernels: the same, programmatic", b);
            run_e<0, false, false>("engine-like: plain", b, g);
            run_engine("engine's kernel: plain", b, 0);
            run_engine("engine's kernel: as a layer", b, 1);
            run_engine("engine's kernel: layer, norm_in_w", b, 2);
            run_e<1, false, false>("engine-like: norm x*g (engine's)", b, g);
            run_e<2, false, false>("engine-like: norm ss only (folded)", b, g);
            run_e<3, false, false>("engine-like: norm staged in smem", b, g);
            run_e<0, false, true>("engine-like: x staged in smem", b, g);
            run_e<0, true, false>("engine-like: glu pairs", b, g);
            run_e<1, true, false>("engine-like: norm x*g + glu", b, g);
            run_e<2, true, false>("engine-like: norm ss only + glu", b, g);
            run_e<3, true, false>("engine-like: norm staged + glu", b, g);
            run_chain<0, false, false>("one kernel, no barrier (ceiling)", b, c);
            run_chain<0, true, false>("one kernel, barrier, P0", b, c);
            run_chain<0, true, true>("one kernel, barrier, P0, x by L2", b, c);
            run_chain<2, true, false>("one kernel, barrier, P2", b, c);
            run_chain<2, true, true>("one kernel, barrier, P2, x by L2", b, c);
            run_chain<3, true, true>("one kernel, barrier, P3, x by L2", b, c);
            run_chain<4, true, true>("one kernel, barrier, P4, x by L2", b, c);
        }
        return 0;
    }
    for (int rep = 0; rep < 2; rep++) {
        ReadArg ra = {(const uint4 *)w, total * 2 / 16, (unsigned *)y, b.sms};
        float ms = median_ms(0, read_launch, &ra);
        printf("%-34s one kernel reading every weight: %.3f ms  %.0f GB/s\n", "read floor", ms,
               b.bytes / (ms * 1e-3) / 1e9);
        run<2, 4, 8, false, 0>("R2 U4 W8 (before)", b);
        run<2, 4, 8, false, 0>("R2 U4 W8 (before) + norm", b, 1);
        run<2, 4, 8, false, 256>("R2 U4 W8 L2::256B", b);
        run<2, 4, 8, false, 128>("R2 U4 W8 L2::128B", b);
        run<2, 4, 8, false, 1>("R2 U4 W8 ld.cs", b);
        run<2, 4, 8, true, 0>("R2 U4 W8 persistent", b);
        run<2, 4, 4, false, 0>("R2 U4 W4", b);
        run<2, 4, 16, false, 0>("R2 U4 W16", b);
        run<2, 8, 8, false, 0>("R2 U8 W8", b);
        run<1, 8, 8, false, 0>("R1 U8 W8", b);
        run<1, 4, 8, false, 0>("R1 U4 W8", b);
        run<4, 2, 8, false, 0>("R4 U2 W8", b);
        run<4, 2, 4, false, 0>("R4 U2 W4", b);
        run<1, 2, 8, false, 0>("R1 U2 W8", b);
        run<2, 2, 8, false, 0>("R2 U2 W8", b);
        run<2, 2, 8, false, 0>("R2 U2 W8 + norm", b, 1);
        run<2, 2, 4, false, 0>("R2 U2 W4", b);
        run<2, 2, 4, false, 0>("R2 U2 W4 + norm", b, 1);
        run<2, 2, 8, true, 0>("R2 U2 W8 persistent", b);
        run<2, 2, 8, true, 0>("R2 U2 W8 persistent + norm", b, 1);
        run<2, 1, 8, false, 0>("R2 U1 W8", b);
        run<4, 1, 8, false, 0>("R4 U1 W8", b);
        run<1, 1, 8, false, 0>("R1 U1 W8", b);
    }
    // the two shapes of fewer rows (the output and down projections: 4096 rows, so GV_R 2 fills half the device's
    // warps): 32 of each, distinct, back to back
    for (int shape = 1; shape <= 3; shape += 2) {
        Bench o = b;
        o.mats.clear();
        o.bytes = 0;
        for (const Mat &m : b.mats)
            if (m.rows == shapes[shape][0] && m.cols == shapes[shape][1])
                o.mats.push_back({m.rows, m.cols, m.w, 0}), o.bytes += 2.0 * m.rows * m.cols;
        // the check is of the step's last matrix: off here
        for (int i = 0; i < 8; i++)
            o.check[i] = NAN;
        printf("%u x %u alone, 32 of them:\n", shapes[shape][0], shapes[shape][1]);
        for (int rep = 0; rep < 2; rep++) {
            run<2, 2, 8, true, 0>("  R2 U2 W8 persistent", o, 2);
            run<1, 2, 8, true, 0>("  R1 U2 W8 persistent", o, 2);
            run<1, 4, 8, true, 0>("  R1 U4 W8 persistent", o, 2);
            run<2, 4, 8, true, 0>("  R2 U4 W8 persistent", o, 2);
            run<1, 8, 8, true, 0>("  R1 U8 W8 persistent", o, 2);
        }
    }
    return 0;
}
