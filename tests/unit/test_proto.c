/* test_proto.c — the public API messages (proto/tandem/v1/tandem.proto) as
 * protobuf-c generates them: a request round-trips, unset optional fields stay
 * unset (and read as the engine's defaults), and bytes that are not a message
 * are refused. */
#include "tests/unit/helpers.h"

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
