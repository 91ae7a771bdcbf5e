/* transfer_cuda_copy.h — the CUDA IPC transport's batched copy kernel
 * (transfer_cuda_copy.cu), callable from C. */
#ifndef KV_TRANSFER_CUDA_COPY_H
#define KV_TRANSFER_CUDA_COPY_H

#include <stdint.h>

#define KV_COPY_BATCH 160 /* descriptors per launch: 3.8 KiB of kernel parameter */

typedef struct kv_copy_desc {
    const void *src;
    void *dst;
    uint64_t len;
} kv_copy_desc_t;

typedef struct kv_copy_batch {
    kv_copy_desc_t d[KV_COPY_BATCH];
    uint32_t n;
} kv_copy_batch_t;

#ifdef __cplusplus
extern "C" {
#endif
/* Queues the batch's copies on stream (a cudaStream_t) as one launch; 0, or
 * -1 when the launch failed (cudaGetLastError says why). */
int kv_cuda_copy_batch(const kv_copy_batch_t *b, void *stream);
#ifdef __cplusplus
}
#endif

#endif
