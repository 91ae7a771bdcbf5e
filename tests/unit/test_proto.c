/* test_proto.c — the public API messages (proto/tandem/v1/tandem.proto) as
 * protobuf-c generates them: a request round-trips, unset optional fields stay
 * unset (and read as the engine's defaults), and bytes that are not a message
 * are refused. */
#define _GNU_SOURCE
#include "tests/unit/helpers.h"

#include "common/kv_contract_pb.h"
#include "common/log.h"
#include "common/pb_wire.h"
#include "tandem/v1/tandem.pb-c.h"

Test(proto, generate_request_round_trip)
{
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    Tandem__V1__ChatInput chat = TANDEM__V1__CHAT_INPUT__INIT;
    Tandem__V1__ChatMessage m = TANDEM__V1__CHAT_MESSAGE__INIT, *msgs[1] = {&m};
    m.role = "user";
    m.content = "héllo 🤗";
    chat.n_messages = 1;
    chat.messages = msgs;
    chat.has_add_generation_prompt = 1;
    chat.add_generation_prompt = 1;
    req.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    req.chat = &chat;
    sp.has_temperature = 1;
    sp.temperature = 0.7f;
    sp.has_max_tokens = 1;
    sp.max_tokens = 32;
    char *stop[] = {"\n\n"};
    sp.n_stop = 1;
    sp.stop = stop;
    req.sampling = &sp;
    req.request_id = "r-1";
    req.has_deadline_ms = 1;
    req.deadline_ms = 5000;
    size_t n = tandem__v1__generate_request__get_packed_size(&req);
    uint8_t *buf = malloc(n);
    cr_assert_eq(tandem__v1__generate_request__pack(&req, buf), n);
    Tandem__V1__GenerateRequest *back = tandem__v1__generate_request__unpack(NULL, n, buf);
    cr_assert_not_null(back);
    cr_assert_eq(back->input_case, TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT);
    cr_assert_str_eq(back->chat->messages[0]->content, "héllo 🤗");
    cr_assert(back->sampling->has_temperature && back->sampling->temperature == 0.7f);
    cr_assert(!back->sampling->has_top_p, "an unset optional stays unset");
    cr_assert_eq(back->sampling->top_p, 1.0f, "and reads as the engine's default");
    cr_assert_eq(back->sampling->repetition_penalty, 1.0f);
    cr_assert_eq(back->sampling->max_tokens, 32);
    cr_assert_str_eq(back->sampling->stop[0], "\n\n");
    cr_assert_eq(back->deadline_ms, 5000);
    tandem__v1__generate_request__free_unpacked(back, NULL);
    free(buf);
}

Test(proto, garbage_is_refused)
{
    uint8_t junk[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 'x'}; /* field 1, length 4 GiB, 1 byte present */
    cr_assert_null(tandem__v1__generate_request__unpack(NULL, sizeof junk, junk));
    uint8_t bad_wire[] = {0x07};                                /* wire type 7 does not exist */
    cr_assert_null(tandem__v1__generate_request__unpack(NULL, sizeof bad_wire, bad_wire));
}

/* The KV layout's two wire forms (common/kv_contract.h): protobuf for RPCs,
 * JSON for etcd records. Each round-trips every field; a record with a field
 * missing or ill-typed is refused with the field named. */
Test(proto, kv_layout_round_trips_in_both_wire_forms)
{
    td_kv_layout_t l = td_kv_layout_make("SmolLM2-135M-Instruct", 30, 3, 64, 16, TD_KV_F16), back;
    Tandem__Internal__V1__KvContract pb;
    td_kv_layout_to_pb(&l, &pb);
    uint8_t buf[512];
    size_t n = tandem__internal__v1__kv_contract__pack(&pb, buf);
    Tandem__Internal__V1__KvContract *got = tandem__internal__v1__kv_contract__unpack(NULL, n, buf);
    cr_assert_not_null(got);
    cr_assert_eq(td_kv_layout_from_pb(got, &back), TD_OK);
    tandem__internal__v1__kv_contract__free_unpacked(got, NULL);
    cr_assert_eq(memcmp(&l, &back, sizeof l), 0, "protobuf round trip");
    cr_assert_eq(td_kv_layout_from_pb(NULL, &back), TD_ERR_FORMAT);

    json_t *j = td_kv_layout_to_json(&l);
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    j = json_loads(text, 0, NULL);
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_OK, "%s", td_last_error());
    cr_assert_eq(memcmp(&l, &back, sizeof l), 0, "JSON round trip: %s", text);
    json_object_set_new(j, "head_dim", json_string("64"));
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "'head_dim'"), "%s", td_last_error());
    json_object_set_new(j, "head_dim", json_integer(64));
    json_object_set_new(j, "dtype", json_string("int4"));
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "dtype 'int4'"), "%s", td_last_error());
    /* a dtype with another scale scheme than the one stated is refused, naming both */
    json_object_set_new(j, "dtype", json_string("fp8_e4m3"));
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "kv_scales 'none'") && strstr(td_last_error(), "per token"), "%s",
              td_last_error());
    json_object_del(j, "model_id");
    json_object_set_new(j, "dtype", json_string("fp16"));
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "'model_id'"), "%s", td_last_error());
    json_decref(j);
    free(text);
    /* tensor parallelism: the degree round-trips in both forms; a record without it is one rank's */
    td_kv_layout_t t2 = l;
    t2.tp = 2;
    td_kv_layout_to_pb(&t2, &pb);
    n = tandem__internal__v1__kv_contract__pack(&pb, buf);
    got = tandem__internal__v1__kv_contract__unpack(NULL, n, buf);
    cr_assert_eq(td_kv_layout_from_pb(got, &back), TD_OK);
    cr_assert_eq(back.tp, 2);
    got->has_tp = 0;
    cr_assert_eq(td_kv_layout_from_pb(got, &back), TD_OK);
    cr_assert_eq(back.tp, 1);
    tandem__internal__v1__kv_contract__free_unpacked(got, NULL);
    j = td_kv_layout_to_json(&t2);
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_OK, "%s", td_last_error());
    cr_assert_eq(back.tp, 2);
    json_object_del(j, "tp");
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_OK, "%s", td_last_error());
    cr_assert_eq(back.tp, 1);
    json_decref(j);
    /* the geometry the pool and the kernels read: offsets of K and V rows */
    cr_assert_eq(td_kv_block_bytes(&l), (size_t)30 * 2 * 3 * 16 * 64 * 2);
    cr_assert_eq(td_kv_offset(&l, 1, 1, 2), (size_t)((1 * 2 + 1) * 3 + 2) * 16 * 64);
    cr_assert_eq(td_kv_token_bytes(&l) * 16, td_kv_block_bytes(&l));
}

/* fp8_e4m3 KV: a byte a value, each layer's rows followed by their fp32 scales (one a token and KV head); the
 * contract states the scheme in both wire forms, and "fp8" names it as vLLM's kv_cache_dtype does. */
Test(proto, fp8_kv_layout_and_its_scales)
{
    td_kv_dtype_t d;
    cr_assert(td_kv_dtype_parse("fp8", &d) && d == TD_KV_F8_E4M3);
    cr_assert(td_kv_dtype_parse("fp8_e4m3", &d) && d == TD_KV_F8_E4M3);
    cr_assert(!td_kv_dtype_parse("fp8_e5m2", &d));
    td_kv_layout_t l = td_kv_layout_make("SmolLM2-135M-Instruct", 30, 3, 64, 16, TD_KV_F8_E4M3), back;
    const size_t rows = (size_t)2 * 3 * 16 * 64, scales = (size_t)2 * 3 * 16 * 4;
    cr_assert_eq(td_kv_layer_bytes(&l), rows + scales);
    cr_assert_eq(td_kv_token_bytes(&l), 12240u, "30 layers x (2 x 3 x 64 bytes + 2 x 3 scales of 4): 53%% of fp16's");
    cr_assert_eq(td_kv_offset(&l, 2, 1, 1), 2 * (rows + scales) + (size_t)(1 * 3 + 1) * 16 * 64);
    cr_assert_eq(td_kv_scale_offset(&l, 2, 1, 1), 2 * (rows + scales) + rows + (size_t)(1 * 3 + 1) * 16 * 4);
    cr_assert_eq(td_kv_scale_offset(&l, 29, 1, 2) + 16 * 4, td_kv_block_bytes(&l), "the last scales end the block");
    Tandem__Internal__V1__KvContract pb;
    td_kv_layout_to_pb(&l, &pb);
    cr_assert_str_eq(pb.kv_scales, "fp32 per token and kv head");
    cr_assert_eq(td_kv_layout_from_pb(&pb, &back), TD_OK);
    cr_assert_eq(memcmp(&l, &back, sizeof l), 0);
    json_t *j = td_kv_layout_to_json(&l);
    cr_assert_str_eq(json_string_value(json_object_get(j, "dtype")), "fp8_e4m3");
    cr_assert_eq(td_kv_layout_from_json(j, &back), TD_OK, "%s", td_last_error());
    cr_assert_eq(memcmp(&l, &back, sizeof l), 0);
    json_decref(j);
    td_kv_layout_t f16 = td_kv_layout_make("SmolLM2-135M-Instruct", 30, 3, 64, 16, TD_KV_F16);
    cr_assert_eq(td_kv_contract_check(&f16, &l, "decode-1"), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "dtype: here 'fp16', peer 'fp8_e4m3'"), "%s", td_last_error());
}

/* A NUL inside a string field is found in the wire bytes, with the field's
 * path and the byte offset, at any depth; clean and truncated bytes are not
 * reported (protobuf-c's unpack would cut such a string at the NUL). */
Test(proto, nul_inside_a_string_is_found_with_its_field)
{
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__ChatInput chat = TANDEM__V1__CHAT_INPUT__INIT;
    Tandem__V1__ChatMessage m0 = TANDEM__V1__CHAT_MESSAGE__INIT, m1 = TANDEM__V1__CHAT_MESSAGE__INIT;
    Tandem__V1__ChatMessage *msgs[2] = {&m0, &m1};
    m0.role = m1.role = "user";
    m0.content = "clean";
    m1.content = "hiXthere";
    chat.n_messages = 2;
    chat.messages = msgs;
    req.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    req.chat = &chat;
    req.request_id = "r-1";
    size_t n = tandem__v1__generate_request__get_packed_size(&req);
    uint8_t *buf = malloc(n);
    tandem__v1__generate_request__pack(&req, buf);
    char where[128];
    size_t at = 99;
    cr_assert_not(td_pb_find_nul(&tandem__v1__generate_request__descriptor, buf, n, where, sizeof where, &at));
    uint8_t *x = memmem(buf, n, "hiXthere", 8);
    cr_assert_not_null(x);
    x[2] = 0;
    cr_assert(td_pb_find_nul(&tandem__v1__generate_request__descriptor, buf, n, where, sizeof where, &at));
    cr_assert_str_eq(where, "chat.messages.content");
    cr_assert_eq(at, 2);
    /* cut inside the string's bytes: the message does not parse, nothing is reported */
    cr_assert_not(td_pb_find_nul(&tandem__v1__generate_request__descriptor, buf, (size_t)(x - buf) + 1, where,
                                 sizeof where, &at));
    free(buf);
}
