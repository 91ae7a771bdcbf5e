/* kv_contract_pb.c — see kv_contract_pb.h. */
#include "common/kv_contract_pb.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"

void td_kv_layout_to_pb(const td_kv_layout_t *l, Tandem__Internal__V1__KvContract *pb)
{
    tandem__internal__v1__kv_contract__init(pb);
    pb->has_layout_version = pb->has_block_tokens = pb->has_n_layers = pb->has_n_kv_heads = pb->has_head_dim = 1;
    pb->layout_version = l->layout_version;
    pb->block_tokens = l->block_tokens;
    pb->n_layers = l->n_layers;
    pb->n_kv_heads = l->n_kv_heads;
    pb->head_dim = l->head_dim;
    pb->dtype = (char *)td_kv_dtype_name(l->dtype);
    pb->kv_scales = (char *)td_kv_scales_name(l->dtype);
    pb->hash_scheme = (char *)l->hash_scheme;
    pb->model_id = (char *)l->model_id;
    pb->has_tp = 1;
    pb->tp = l->tp ? l->tp : 1;
}

td_status_t td_kv_layout_from_pb(const Tandem__Internal__V1__KvContract *pb, td_kv_layout_t *l)
{
    memset(l, 0, sizeof *l);
    if (!pb)
        return td_error(TD_ERR_FORMAT, "contract: missing");
    if (!td_kv_dtype_parse(pb->dtype, &l->dtype))
        return td_error(TD_ERR_FORMAT, "contract: dtype '%s' is not fp16, fp32 or fp8_e4m3", pb->dtype ? pb->dtype : "");
    td_status_t rc = td_kv_scales_check(l->dtype, pb->kv_scales);
    if (rc)
        return rc;
    l->layout_version = pb->layout_version;
    l->block_tokens = pb->block_tokens;
    l->n_layers = pb->n_layers;
    l->n_kv_heads = pb->n_kv_heads;
    l->head_dim = pb->head_dim;
    snprintf(l->hash_scheme, sizeof l->hash_scheme, "%s", pb->hash_scheme ? pb->hash_scheme : "");
    snprintf(l->model_id, sizeof l->model_id, "%s", pb->model_id ? pb->model_id : "");
    l->tp = pb->has_tp ? pb->tp : 1; /* a peer that does not state it: one rank */
    if (!l->tp)
        return td_error(TD_ERR_FORMAT, "contract: tp 0");
    return TD_OK;
}
