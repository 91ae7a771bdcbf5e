/* check.c — tandem-cuda-check MODEL: decodes every tensor of a GGUF file on the
 * GPU and on the CPU, and compares them bit for bit; times the GPU decode of
 * the largest tensor against its memory-traffic floor. Run on the GPU machine
 * (deploy/gpu-bundle.sh builds what it needs). */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "kernels/cuda/dequant.h"
#include "kernels/quant.h"

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "cuda: %s: %s\n", #x, cudaGetErrorString(e_));                      \
            return 1;                                                                            \
        }                                                                                        \
    } while (0)

int main(int argc, char **argv)
{
    td_log_init("cuda-check", TD_LOG_WARN, false);
    if (argc != 2) {
        fprintf(stderr, "usage: tandem-cuda-check MODEL.gguf\n");
        return 2;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
    eng_gguf_t *g;
    if (eng_gguf_open(argv[1], &g))
        return 1;
    size_t max_n = 0, max_bytes = 0, checked = 0, bad = 0;
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_at(g, i);
        max_n = t->n_elems > max_n ? t->n_elems : max_n;
        max_bytes = t->n_bytes > max_bytes ? t->n_bytes : max_bytes;
    }
    void *dsrc;
    float *ddst, *host = malloc(max_n * 4), *ref = malloc(max_n * 4);
    CK(cudaMalloc(&dsrc, max_bytes));
    CK(cudaMalloc((void **)&ddst, max_n * 4));
    const eng_gguf_tensor_t *big = NULL;
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_at(g, i);
        CK(cudaMemcpy(dsrc, t->data, t->n_bytes, cudaMemcpyHostToDevice));
        if (kern_cuda_dequant(t->type, dsrc, ddst, t->n_elems, NULL) != TD_OK) {
            printf("  %.*s: type %s not decoded on the GPU\n", (int)t->name.len, t->name.ptr,
                   kern_type_info(t->type)->name);
            continue;
        }
        CK(cudaMemcpy(host, ddst, t->n_elems * 4, cudaMemcpyDeviceToHost));
        eng_gguf_tensor_read_f32(t, 0, t->n_elems, ref);
        if (memcmp(host, ref, t->n_elems * 4) != 0)
            bad++;
        checked++;
        if (!big || t->n_bytes > big->n_bytes)
            big = t;
    }
    printf("decode: %zu tensors compared with the CPU, %zu differ\n", checked, bad);
    if (big) {
        CK(cudaMemcpy(dsrc, big->data, big->n_bytes, cudaMemcpyHostToDevice));
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        for (int w = 0; w < 3; w++)
            kern_cuda_dequant(big->type, dsrc, ddst, big->n_elems, NULL);
        int reps = 50;
        CK(cudaEventRecord(a, 0));
        for (int r = 0; r < reps; r++)
            kern_cuda_dequant(big->type, dsrc, ddst, big->n_elems, NULL);
        CK(cudaEventRecord(b, 0));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        double bytes = (double)big->n_bytes + big->n_elems * 4.0;
        printf("timing: %.*s (%s, %llu values): %.3f ms, %.0f GB/s moved (read + write)\n", (int)big->name.len,
               big->name.ptr, kern_type_info(big->type)->name, (unsigned long long)big->n_elems, ms / reps,
               bytes / (ms / reps * 1e-3) / 1e9);
    }
    cudaFree(dsrc);
    cudaFree(ddst);
    free(host);
    free(ref);
    eng_gguf_close(g);
    return bad ? 1 : 0;
}
