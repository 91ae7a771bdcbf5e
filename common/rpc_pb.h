/* rpc_pb.h — common/rpc.h's calls with protobuf-c messages: the one place
 * that packs a request, calls, and unpacks the reply (and packs a handler's
 * reply). */
#ifndef TD_RPC_PB_H
#define TD_RPC_PB_H

#include <protobuf-c/protobuf-c.h>

#include "common/rpc.h"

/* A unary call of msg; on TD_OK *reply (free with
 * protobuf_c_message_free_unpacked) is the reply unpacked as desc. Otherwise
 * res holds what the peer or the transport answered (code 0 when the reply
 * did not parse: TD_ERR_FORMAT) and td_last_error() names method and peer;
 * it is logged at debug level only: the caller says it as loud as it is. */
td_status_t td_rpc_unary_pb(td_rpc_channel_t *ch, const char *method, const ProtobufCMessage *msg,
                            const ProtobufCMessageDescriptor *desc, double timeout_s, td_rpc_scope_t *scope,
                            ProtobufCMessage **reply, td_rpc_result_t *res);
/* The fan-out (rpc.h's td_rpc_unary_all) with protobuf-c messages: each
 * call's msg packed; on TD_OK its reply unpacked as desc (free with
 * protobuf_c_message_free_unpacked), a reply that does not parse is
 * TD_ERR_FORMAT with res saying so. A call with ch NULL is skipped (its rc
 * and res stay as the caller set them). */
typedef struct td_rpc_unary_pb_call {
    td_rpc_channel_t *ch;
    const char *method;
    const ProtobufCMessage *msg;
    const ProtobufCMessageDescriptor *desc;
    td_status_t rc;
    ProtobufCMessage *reply;
    td_rpc_result_t res;
} td_rpc_unary_pb_call_t;
void td_rpc_unary_all_pb(td_rpc_unary_pb_call_t *calls, size_t n, double timeout_s);
/* A server stream opened with request msg (rpc.h's td_rpc_stream_open). */
td_status_t td_rpc_stream_open_pb(td_rpc_channel_t *ch, const char *method, const ProtobufCMessage *msg,
                                  double timeout_s, td_rpc_scope_t *scope, td_rpc_stream_t **out);
/* The call's request unpacked as desc (free with
 * protobuf_c_message_free_unpacked): every handler unpacks here. NULL when
 * it does not parse or a string field holds a NUL, and then the call is
 * finished with INVALID_ARGUMENT naming the method or the field. */
ProtobufCMessage *td_rpc_request_pb(td_rpc_call_t *call, const ProtobufCMessageDescriptor *desc);
/* Ends a unary call with m (RESOURCE_EXHAUSTED when it cannot be packed). */
void td_rpc_reply_pb(td_rpc_call_t *call, const ProtobufCMessage *m);

#endif
