/* rpc_pb.c — protobuf-c messages over common/rpc.h (rpc_pb.h). */
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "common/pb_wire.h"
#include "common/rpc_pb.h"

td_status_t td_rpc_unary_pb(td_rpc_channel_t *ch, const char *method, const ProtobufCMessage *msg,
                            const ProtobufCMessageDescriptor *desc, double timeout_s, td_rpc_scope_t *scope,
                            ProtobufCMessage **reply, td_rpc_result_t *res)
{
    *reply = NULL;
    res->code = 0;
    res->message[0] = 0;
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        return td_error_at(TD_LOG_DEBUG, TD_ERR_NO_MEMORY, "%s: no memory", method);
    protobuf_c_message_pack(msg, buf);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    td_status_t rc = td_rpc_unary(ch, method, buf, n, timeout_s, scope, &resp, &rlen, res);
    free(buf);
    if (rc)
        return td_error_at(TD_LOG_DEBUG, rc, "%s at %s: %s %s", method, td_rpc_channel_target(ch),
                           td_rpc_code_name(res->code), res->message);
    *reply = protobuf_c_message_unpack(desc, NULL, rlen, resp);
    free(resp);
    if (!*reply)
        return td_error_at(TD_LOG_DEBUG, TD_ERR_FORMAT, "%s at %s: the reply does not parse", method,
                           td_rpc_channel_target(ch));
    return TD_OK;
}

void td_rpc_unary_all_pb(td_rpc_unary_pb_call_t *calls, size_t n, double timeout_s)
{
    td_rpc_unary_call_t *raw = calloc(n ? n : 1, sizeof *raw);
    for (size_t i = 0; i < n; i++) {
        calls[i].reply = NULL;
        if (!calls[i].ch)
            continue;
        size_t len = protobuf_c_message_get_packed_size(calls[i].msg);
        uint8_t *buf = raw ? malloc(len ? len : 1) : NULL;
        if (!buf) {
            calls[i].rc = TD_ERR_NO_MEMORY;
            snprintf(calls[i].res.message, sizeof calls[i].res.message, "%s: no memory", calls[i].method);
            continue;
        }
        protobuf_c_message_pack(calls[i].msg, buf);
        raw[i] = (td_rpc_unary_call_t){.ch = calls[i].ch, .method = calls[i].method, .req = buf, .req_len = len};
    }
    if (!raw)
        return;
    td_rpc_unary_all(raw, n, timeout_s);
    for (size_t i = 0; i < n; i++) {
        if (!raw[i].ch)
            continue;
        calls[i].rc = raw[i].rc;
        calls[i].res = raw[i].res;
        if (!raw[i].rc && !(calls[i].reply = protobuf_c_message_unpack(calls[i].desc, NULL, raw[i].resp_len,
                                                                       raw[i].resp))) {
            calls[i].rc = TD_ERR_FORMAT;
            snprintf(calls[i].res.message, sizeof calls[i].res.message, "%s at %s: the reply does not parse",
                     calls[i].method, td_rpc_channel_target(calls[i].ch));
        }
        free((void *)raw[i].req);
        free(raw[i].resp);
    }
    free(raw);
}

td_status_t td_rpc_stream_open_pb(td_rpc_channel_t *ch, const char *method, const ProtobufCMessage *msg,
                                  double timeout_s, td_rpc_scope_t *scope, td_rpc_stream_t **out)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        return td_error_at(TD_LOG_DEBUG, TD_ERR_NO_MEMORY, "%s: no memory", method);
    protobuf_c_message_pack(msg, buf);
    td_status_t rc = td_rpc_stream_open(ch, method, buf, n, timeout_s, scope, out);
    free(buf);
    return rc;
}

ProtobufCMessage *td_rpc_request_pb(td_rpc_call_t *call, const ProtobufCMessageDescriptor *desc)
{
    size_t n;
    const uint8_t *p = td_rpc_call_payload(call, &n);
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, n, p);
    if (!m) {
        TD_WARN("%s from %s: the request does not parse as %s", td_rpc_call_method(call), td_rpc_call_peer(call),
                desc->name);
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "%s: the request does not parse as %s",
                           td_rpc_call_method(call), desc->name);
        return NULL;
    }
    /* a NUL inside a string field would cut it short once unpacked: refused, naming the field */
    char where[256];
    size_t at;
    if (td_pb_find_nul(desc, p, n, where, sizeof where, &at)) {
        TD_WARN("%s from %s: %s: a NUL character at byte %zu", td_rpc_call_method(call), td_rpc_call_peer(call), where,
                at);
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT,
                           "%s: a NUL character (U+0000) at byte %zu; tandem does not take text with NULs", where, at);
        protobuf_c_message_free_unpacked(m, NULL);
        return NULL;
    }
    return m;
}

void td_rpc_reply_pb(td_rpc_call_t *call, const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    if (!b) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    protobuf_c_message_pack(m, b);
    td_rpc_call_reply(call, b, n);
    free(b);
}
