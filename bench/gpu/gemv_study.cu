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
#include <algorithm>
#include <vector>

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

template <int R, int U, int W, bool PERSIST, int L2HINT>
__global__ void __launch_bounds__(W * 32)
    k_gemv(const __half *w, const float *x, float *y, uint32_t rows, uint32_t cols, int norm)
{
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
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
            if (lane == 0)
                y[unit * R + r] = norm ? acc[r] * scale : acc[r];
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

template <int R, int U, int W, bool PERSIST, int L2HINT>
static void run(const char *name, Bench &b, int with_norm = 0) // 1: the norm; 2: no check
{
    auto k = k_gemv<R, U, W, PERSIST, L2HINT>;
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, W * 32, 0);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (auto &m : b.mats) {
        uint32_t units = m.rows / R, blocks = (units + W - 1) / W;
        if (PERSIST)
            blocks = std::min<uint32_t>(blocks, per_sm * b.sms);
        k<<<blocks, W * 32, 0, s>>>(m.w, b.x, b.y, m.rows, m.cols, with_norm == 1 && m.norm);
    }
    cudaStreamEndCapture(s, &g);
    cudaGraphInstantiate(&ge, g, 0);
    float ms = median_ms(s, graph_launch, ge);
    float hy[8];
    cudaMemcpy(hy, b.y, sizeof hy, cudaMemcpyDeviceToHost);
    double err = 0;
    for (int i = 0; i < 8; i++)
        err = std::max(err, (double)fabsf(hy[i] - b.check[i]) / (fabsf(b.check[i]) + 1e-3));
    printf("%-34s %d blocks/SM  step %.3f ms  %.0f GB/s  %s  %s\n", name, per_sm, ms, b.bytes / (ms * 1e-3) / 1e9,
           with_norm ? "(not checked)" : err < 1e-3 ? "check ok" : "CHECK FAILED",
           cudaGetErrorString(cudaGetLastError()));
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
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

int main()
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
