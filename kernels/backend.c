/* backend.c — what every backend shares: the capability check, a weight's FP8 rows. */
#include "kernels/backend.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "kernels/quant.h"

td_status_t kern_backend_check(const kern_backend_t *b, uint32_t need)
{
    static const char *const names[] = {"matmul", "matmul_multi", "rmsnorm",   "rope",         "swiglu", "add",
                                        "embed",  "kv_store",     "attention", "matmul_fused", "sample", "graph",
                                        "rope_kv_store", "rope_kv_attention", "weight_scale_cols"};
    uint32_t missing = need & ~b->ops->supported;
    if (!missing)
        return TD_OK;
    char list[160] = "";
    size_t n = 0;
    for (unsigned i = 0; i < sizeof names / sizeof names[0]; i++)
        if (missing & (1u << i))
            n += (size_t)snprintf(list + n, n < sizeof list ? sizeof list - n : 0, "%s%s", n ? ", " : "", names[i]);
    return td_error(TD_ERR_UNSUPPORTED, "backend %s does not support %s", b->ops->name, list);
}

td_status_t kern_weight_fp8_row(const kern_weight_t *w, uint32_t r, uint8_t *q, float *scale, float *tmp)
{
    const kern_type_info_t *info = kern_type_info(w->type);
    if (!info)
        return td_error(TD_ERR_UNSUPPORTED, "fp8: a weight of type %u", w->type);
    const uint8_t *row = (const uint8_t *)w->data + kern_type_row_bytes(info, w->cols) * r;
    if (w->type == KERN_TYPE_F8_E4M3) {
        memcpy(q, row, w->cols);
        *scale = w->scale ? w->scale[r] : 1.0f;
        return TD_OK;
    }
    td_status_t rc = kern_dequant_row(w->type, row, tmp, w->cols);
    if (!rc)
        kern_fp8_quantize_row(tmp, w->cols, q, scale);
    return rc;
}
