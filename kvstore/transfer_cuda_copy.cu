// transfer_cuda_copy.cu — the CUDA IPC transport's batched copy: many small
// copies (one layer of one block each: 12 KiB to a few hundred KiB) in one
// launch, where one cudaMemcpyAsync each costs more in launches than in
// bytes (tandem-bench-kvxfer: 2.5 GB/s at 12 KiB). The descriptors travel as
// the kernel's parameter (copied at launch: nothing to keep alive).
#include <cuda_runtime.h>
#include <stdint.h>

#include "kvstore/transfer_cuda_copy.h"

__global__ void k_copy_batch(kv_copy_batch_t b)
{
    const kv_copy_desc_t d = b.d[blockIdx.x];
    const uint8_t *s = (const uint8_t *)d.src;
    uint8_t *t = (uint8_t *)d.dst;
    size_t step = (size_t)blockDim.x * gridDim.y, first = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    if ((((uintptr_t)s | (uintptr_t)t | d.len) & 15) == 0) {
        const uint4 *s4 = (const uint4 *)s;
        uint4 *t4 = (uint4 *)t;
        for (size_t i = first; i < d.len / 16; i += step)
            t4[i] = s4[i];
    } else {
        for (size_t i = first; i < d.len; i += step)
            t[i] = s[i];
    }
}

extern "C" int kv_cuda_copy_batch(const kv_copy_batch_t *b, void *stream)
{
    if (!b->n)
        return 0;
    uint64_t most = 0;
    for (uint32_t i = 0; i < b->n; i++)
        most = b->d[i].len > most ? b->d[i].len : most;
    unsigned y = (unsigned)((most + 512 * 16 * 4 - 1) / (512 * 16 * 4)); // about 4 passes of 512 threads each
    y = y < 1 ? 1 : y > 64 ? 64 : y;
    k_copy_batch<<<dim3(b->n, y), 512, 0, (cudaStream_t)stream>>>(*b);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
