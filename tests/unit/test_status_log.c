/* test_status_log.c — statuses have names; td_error logs once and keeps the
 * message as the thread's last error. */
#include "tests/unit/helpers.h"

#include <criterion/redirect.h>

#include "common/log.h"

Test(status_log, names)
{
    cr_assert_str_eq(td_status_str(TD_OK), "ok");
    cr_assert_str_eq(td_status_str(TD_ERR_FORMAT), "format error");
    cr_assert_str_eq(td_status_str((td_status_t)999), "unknown status");
    for (int s = 0; s < TD_STATUS_COUNT; s++)
        cr_assert(td_status_str((td_status_t)s)[0]);
}

Test(status_log, error_keeps_message_and_returns_status)
{
    td_log_set_level(TD_LOG_OFF);
    cr_assert_eq(td_error(TD_ERR_IO, "file %s at %d", "x.gguf", 42), TD_ERR_IO);
    cr_assert_str_eq(td_last_error(), "file x.gguf at 42");
    td_clear_error();
    cr_assert_str_eq(td_last_error(), "");
}

Test(status_log, levels_parse)
{
    td_log_level_t l;
    cr_assert_eq(td_log_level_parse("DEBUG", &l), TD_OK);
    cr_assert_eq(l, TD_LOG_DEBUG);
    cr_assert_eq(td_log_level_parse("loud", &l), TD_ERR_INVALID_ARG);
}

Test(status_log, json_lines, .init = cr_redirect_stderr)
{
    td_log_init("tester", TD_LOG_INFO, true);
    td_log(TD_LOG_INFO, "quote \" and\nnewline");
    fflush(stderr);
    FILE *f = cr_get_redirected_stderr();
    char line[512] = "";
    cr_assert(fgets(line, sizeof line, f));
    json_t *j = json_loads(line, 0, NULL);
    cr_assert(j, "a JSON line: %s", line);
    cr_assert_str_eq(json_string_value(json_object_get(j, "component")), "tester");
    cr_assert_str_eq(json_string_value(json_object_get(j, "msg")), "quote \" and\nnewline");
    json_decref(j);
}
