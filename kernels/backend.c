/* backend.c — what every backend shares: the capability check. */
#include "kernels/backend.h"

#include <stdio.h>

#include "common/log.h"

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
