/* kv_contract_pb.h — the KV layout's protobuf form (KvContract in
 * proto/tandem/internal/v1/worker.proto), for the RPCs that carry it. */
#ifndef TD_KV_CONTRACT_PB_H
#define TD_KV_CONTRACT_PB_H

#include "common/kv_contract.h"
#include "tandem/internal/v1/worker.pb-c.h"

/* A KvContract pointing into l (l must outlive it). */
void td_kv_layout_to_pb(const td_kv_layout_t *l, Tandem__Internal__V1__KvContract *pb);
/* Back; TD_ERR_FORMAT naming the missing or unknown field (pb NULL: "missing"). */
td_status_t td_kv_layout_from_pb(const Tandem__Internal__V1__KvContract *pb, td_kv_layout_t *l);

#endif
