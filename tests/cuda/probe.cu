// probe.cu — the GPU's measured ceilings for tandem-cuda-check's timings:
// read bandwidth (a sum over a buffer far larger than L2, 16-byte loads).
#include <cuda_runtime.h>

__global__ void k_read_sum(const uint4 *p, size_t n, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) // never in practice; keeps the loads
        *sink = acc;
}

// GB/s of reading `bytes` (median of 9 runs after warm-up); 0 on any error.
extern "C" double kern_cuda_probe_read_gbs(size_t bytes)
{
    void *p = NULL;
    unsigned *sink = NULL;
    cudaEvent_t a, b;
    if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMalloc((void **)&sink, 4) != cudaSuccess) {
        cudaFree(p);
        return 0;
    }
    cudaMemset(p, 1, bytes);
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float ms[9];
    for (int r = -2; r < 9; r++) {
        cudaEventRecord(a);
        k_read_sum<<<sms * 8, 512>>>((const uint4 *)p, bytes / 16, sink);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        if (r >= 0)
            cudaEventElapsedTime(&ms[r], a, b);
    }
    for (int i = 0; i < 9; i++) // sort for the median
        for (int j = i + 1; j < 9; j++)
            if (ms[j] < ms[i]) {
                float t = ms[i];
                ms[i] = ms[j], ms[j] = t;
            }
    bool ok = cudaGetLastError() == cudaSuccess;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(p);
    cudaFree(sink);
    return ok && ms[4] > 0 ? bytes / (ms[4] * 1e-3) / 1e9 : 0;
}
