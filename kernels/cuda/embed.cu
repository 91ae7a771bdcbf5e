// embed.cu — out[i] = row ids[i] of the embedding table (held as fp16 rows,
// like every weight of this backend), widened to fp32; one block per token.
// An id outside the table gives a zero row (the engine checks ids before).
#include "kernels/cuda/cuda_int.h"

__global__ void k_embed(const __half *table, const int32_t *ids, uint32_t rows, uint32_t cols, float *out)
{
    kc_pdl_wait();
    kc_pdl_release();
    int32_t id = ids[blockIdx.x];
    float *o = out + (size_t)blockIdx.x * cols;
    bool ok = id >= 0 && (uint32_t)id < rows;
    const __half *r = table + (size_t)(ok ? id : 0) * cols;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x)
        o[i] = ok ? __half2float(r[i]) : 0.0f;
}

td_status_t kc_embed(kern_backend_t *b, const kern_weight_t *table, const int32_t *ids, uint32_t n, float *out)
{
    kc_bind(b);
    if (!n)
        return TD_OK;
    return kc_launch((kern_cuda_t *)b, "embed", k_embed, n, 256, 0, (const __half *)table->priv, ids, table->rows,
                     table->cols, out);
}
