/* backend_cuda.h — the CUDA backend (kernels/backend.h). So far: memory,
 * matmul (weights held as fp16, cuBLAS GEMM with fp32 accumulation), RMSNorm,
 * RoPE, SwiGLU, add; the ops it does not have yet are NULL in its table and
 * the engine refuses to run a model on it (a later issue fills them). */
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
