/* backend_cuda.h — the CUDA backend (kernels/backend.h): every op of the
 * table on one device and one stream; weights held as fp16 rows, matmuls
 * through cuBLAS (loaded at run time) with fp32 accumulation, activations
 * fp32, the KV pool in device memory (fp16 or fp32). tandem-cuda-check
 * checks it op by op against the CPU backend on the GPU machine. */
#ifndef KERN_CUDA_BACKEND_H
#define KERN_CUDA_BACKEND_H

#include "common/status.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend on CUDA device `device`; errors name what was missing (no
 * device, no cuBLAS) or the CUDA call that failed. */
td_status_t kern_cuda_backend_create(int device, kern_backend_t **out);
void kern_cuda_backend_destroy(kern_backend_t *b);
/* Whether kernels are launched programmatically dependent (on by default
 * where the device has it, sm_90 and later); drops the captured steps. For
 * tandem-cuda-check's timings with it and without. Returns the setting in force. */
bool kern_cuda_set_pdl(kern_backend_t *b, bool on);

/* The prompt attention's kernel (for checks and measurements; the backend picks one at creation): 0 the mma.sync
 * kernel, 1.. a warpgroup-MMA variant (attention_wg.cu), taken only where the device has it. Returns the one in
 * use before the call. */
uint32_t kern_cuda_set_prompt_attention(kern_backend_t *b, uint32_t variant);
/* Whether a prompt step's Q, K and V go to the rope and the attention in fp16 (kern_matmul_spec_t's to_next; on
 * by default) or in fp32, as before it (for tandem-cuda-check's comparison). Returns the setting before the call. */
bool kern_cuda_set_qkv_half(kern_backend_t *b, bool on);
/* The newest captured step's edges: all, and programmatic ones (the kernel
 * after may start while the one before ends). For tandem-cuda-check. */
void kern_cuda_graph_edges(kern_backend_t *b, size_t *all, size_t *programmatic);
/* A matrix held in FP8 (kern_weight_t.hold): its codes [rows][cols] and
 * scales [rows] copied to host memory. For tandem-cuda-check. */
td_status_t kern_cuda_fp8_download(kern_backend_t *b, const kern_weight_t *w, uint8_t *codes, float *scales);

#ifdef __cplusplus
}
#endif

#endif
