/* dequant.h — the CUDA weight decoders (C API over kernels/cuda/dequant.cu).
 * Shapes: src holds n / block_elems blocks of the format in device memory;
 * dst receives n floats in device memory. Asynchronous on `stream`. */
#ifndef KERN_CUDA_DEQUANT_H
#define KERN_CUDA_DEQUANT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* F32, F16, BF16, Q4_0, Q4_1, Q8_0; other types are TD_ERR_UNSUPPORTED. */
td_status_t kern_cuda_dequant(uint32_t type, const void *src, float *dst, size_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif
