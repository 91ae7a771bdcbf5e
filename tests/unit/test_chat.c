/* test_chat.c — chat templates rendered in C against jinja2 rendering the
 * real templates (fixtures/chat/make_chat.py: the default model's own ChatML
 * template, and the Llama 3, Llama 2 and Mistral templates). */
#include "tests/unit/helpers.h"

#include "common/log.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

Test(chat, renders_like_jinja)
{
    require_default_model();
    eng_model_t *m;
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &m), TD_OK);
    eng_chat_t smol;
    cr_assert_eq(eng_chat_init(&smol, m->tok), TD_OK);
    cr_assert_eq(smol.kind, ENG_CHAT_CHATML);
    json_error_t err;
    json_t *cases = json_load_file(FIXTURE("chat/expected.json"), 0, &err);
    cr_assert(cases, "%s", err.text);
    size_t i, checked = 0;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *kind = json_string_value(json_object_get(c, "kind"));
        eng_chat_t chat = {0};
        if (!strcmp(kind, "chatml")) {
            chat = smol;
        } else {
            chat.kind = !strcmp(kind, "llama3") ? ENG_CHAT_LLAMA3 : !strcmp(kind, "llama2") ? ENG_CHAT_LLAMA2 : ENG_CHAT_MISTRAL;
            snprintf(chat.bos, sizeof chat.bos, "%s", json_string_value(json_object_get(c, "bos")));
            snprintf(chat.eos, sizeof chat.eos, "%s", json_string_value(json_object_get(c, "eos")));
        }
        json_t *msgs = json_object_get(c, "messages");
        size_t n = json_array_size(msgs);
        eng_chat_msg_t mv[8];
        for (size_t k = 0; k < n; k++) {
            mv[k].role = json_string_value(json_object_get(json_array_get(msgs, k), "role"));
            mv[k].content = json_string_value(json_object_get(json_array_get(msgs, k), "content"));
        }
        char *out = NULL;
        td_status_t rc = eng_chat_render(&chat, mv, n, json_is_true(json_object_get(c, "add_generation_prompt")), &out);
        json_t *want = json_object_get(c, "text");
        if (json_is_null(want)) {
            cr_assert_eq(rc, TD_ERR_INVALID_ARG, "case %zu (%s): jinja refuses it, so must we", i, kind);
        } else {
            cr_assert_eq(rc, TD_OK, "case %zu (%s): %s", i, kind, td_last_error());
            cr_assert_str_eq(out, json_string_value(want), "case %zu (%s)", i, kind);
        }
        free(out);
        checked++;
    }
    cr_assert_geq(checked, 32);
    json_decref(cases);
    eng_chat_free(&smol);
    eng_model_close(m);
}

Test(chat, bad_roles_named)
{
    eng_chat_t chat = {.kind = ENG_CHAT_CHATML};
    eng_chat_msg_t mv[] = {{"user", "hi"}, {"robot", "beep"}};
    char *out;
    cr_assert_eq(eng_chat_render(&chat, mv, 2, true, &out), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "messages[1].role 'robot'"), "%s", td_last_error());
}

Test(chat, templates_from_hf_folders)
{
    eng_model_t *m;
    eng_chat_t chat;
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-llama3"), &m), TD_OK);
    cr_assert_eq(eng_chat_init(&chat, m->tok), TD_OK);
    cr_assert_eq(chat.kind, ENG_CHAT_LLAMA3);
    cr_assert_str_eq(chat.bos, "<|begin_of_text|>");
    eng_chat_free(&chat);
    eng_model_close(m);
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-spm"), &m), TD_OK);
    cr_assert_eq(eng_chat_init(&chat, m->tok), TD_OK);
    cr_assert_eq(chat.kind, ENG_CHAT_MISTRAL);
    eng_chat_free(&chat);
    eng_model_close(m);
}
