/* backend_cuda.h — the CUDA backend (kernels/backend.h). So far: memory,
 * matmul (weights held as fp16, cuBLAS GEMM with fp32 accumulation), RMSNorm,
 * RoPE, SwiGLU, add. The ops it does not have yet (matmul_multi, embed,
 * kv_store, attention) answer TD_ERR_UNSUPPORTED and are missing from its
 * `supported` bits, so the engine refuses it (kern_backend_check) until a
 * later issue completes it; tandem-cuda-check checks it op by op. */
#ifndef KERN_CUDA_BACKEND_H
#define KERN_CUDA_BACKEND_H

#include "common/status.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend on CUDA device `device`; errors name the CUDA call that failed. */
td_status_t kern_cuda_backend_create(int device, kern_backend_t **out);
void kern_cuda_backend_destroy(kern_backend_t *b);

#ifdef __cplusplus
}
#endif

#endif
