/* transfer_cuda_copy.h — what the device transports share (CUDA IPC,
 * transfer_cuda.c; UCX staged through host memory, transfer_staged.c): the
 * batched copy kernel (transfer_cuda_copy.cu) and the ring of fences that
 * orders their copies after the backend's queued work. */
#ifndef KV_TRANSFER_CUDA_COPY_H
#define KV_TRANSFER_CUDA_COPY_H

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>

#include "common/status.h"

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

/* Fences (kv_transport_ops_t.fence / wait_fence) live in a ring of events:
 * a fence older than the ring names a later point of the same stream, which
 * only waits longer. fence may be called from another thread than the copies
 * (the engine thread beside the pusher), so the ring is locked. */
#define KV_FENCE_RING 1024
typedef struct kv_fences {
    pthread_mutex_t mu;
    cudaEvent_t ring[KV_FENCE_RING];
    uint64_t next; /* fences are 1, 2, ...; 0 is none */
} kv_fences_t;

#ifdef __cplusplus
extern "C" {
#endif
/* On the current device; cudaSuccess or the error (nothing kept). */
cudaError_t kv_fences_init(kv_fences_t *f);
void kv_fences_destroy(kv_fences_t *f);
/* Records the point `stream` has reached; *fence names it. */
td_status_t kv_fences_record(kv_fences_t *f, int device, void *stream, uint64_t *fence);
/* Makes every later copy on `copy` start after the point `fence` names. */
td_status_t kv_fences_wait(kv_fences_t *f, int device, cudaStream_t copy, uint64_t fence);
/* Queues the gathered copies of *b on `copy` and empties it (TD_OK when it
 * was empty); `who` names the transport in the error. */
td_status_t kv_copy_batch_launch(kv_copy_batch_t *b, cudaStream_t copy, const char *who);
/* Polls ev until it completes or `deadline` (td_now_s()) passes; `what`
 * names the work in the error (who: the transport). */
td_status_t kv_event_wait(cudaEvent_t ev, double deadline, const char *who, const char *what);
/* Queues the batch's copies on stream (a cudaStream_t) as one launch; 0, or
 * -1 when the launch failed (cudaGetLastError says why). */
int kv_cuda_copy_batch(const kv_copy_batch_t *b, void *stream);
#ifdef __cplusplus
}
#endif

#endif
