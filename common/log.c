/* log.c — see log.h. A record is formatted into a stack buffer and written with
 * one write(2), so lines of concurrent threads do not interleave. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define TD_LOG_LINE_MAX 4096

static char td_log_component[32] = "tandem";
static td_log_level_t td_log_level = TD_LOG_INFO;
static bool td_log_json;
static _Thread_local char td_log_last[TD_LOG_LINE_MAX];

static const char *const td_log_names[] = {"debug", "info", "warn", "error", "off"};

td_status_t td_log_level_parse(const char *name, td_log_level_t *level_out)
{
    for (int i = 0; i <= TD_LOG_OFF; i++) {
        if (strcasecmp(name, td_log_names[i]) == 0) {
            *level_out = (td_log_level_t)i;
            return TD_OK;
        }
    }
    return TD_ERR_INVALID_ARG;
}

void td_log_init(const char *component, td_log_level_t level, bool json)
{
    if (component)
        snprintf(td_log_component, sizeof td_log_component, "%s", component);
    td_log_level = level;
    td_log_json = json;
    const char *env = getenv("TANDEM_LOG");
    td_log_level_t from_env;
    if (env && td_log_level_parse(env, &from_env) == TD_OK)
        td_log_level = from_env;
    env = getenv("TANDEM_LOG_FORMAT");
    if (env)
        td_log_json = strcmp(env, "json") == 0;
}

void td_log_set_level(td_log_level_t level) { td_log_level = level; }

/* Appends s to buf as the inside of a JSON string. */
static size_t td_log_json_escape(char *buf, size_t cap, size_t at, const char *s)
{
    for (; *s && at + 7 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            buf[at++] = '\\';
            buf[at++] = (char)c;
        } else if (c < 0x20) {
            at += (size_t)snprintf(buf + at, cap - at, "\\u%04x", c);
        } else {
            buf[at++] = (char)c;
        }
    }
    return at;
}

static void td_log_write(td_log_level_t level, const char *msg)
{
    char line[TD_LOG_LINE_MAX + 256];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char when[40];
    size_t n = strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(when + n, sizeof when - n, ".%03ldZ", ts.tv_nsec / 1000000);

    size_t at;
    if (td_log_json) {
        at = (size_t)snprintf(line, sizeof line,
                              "{\"ts\":\"%s\",\"level\":\"%s\",\"component\":\"%s\",\"msg\":\"",
                              when, td_log_names[level], td_log_component);
        at = td_log_json_escape(line, sizeof line - 3, at, msg);
        line[at++] = '"';
        line[at++] = '}';
    } else {
        at = (size_t)snprintf(line, sizeof line, "%s %-5s %s: %s", when, td_log_names[level],
                              td_log_component, msg);
        if (at > sizeof line - 2)
            at = sizeof line - 2;
    }
    line[at++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, at);
    (void)w;
}

void td_log(td_log_level_t level, const char *fmt, ...)
{
    if (level < td_log_level || level >= TD_LOG_OFF)
        return;
    char msg[TD_LOG_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    td_log_write(level, msg);
}

/* Keeps the message as this thread's last error and logs it at level (TD_LOG_OFF: not at all). */
static void keep_error(td_log_level_t level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
static void keep_error(td_log_level_t level, const char *fmt, va_list ap)
{
    /* formatted aside first: the arguments may be td_last_error() itself (a caller adding context) */
    char msg[sizeof td_log_last];
    vsnprintf(msg, sizeof msg, fmt, ap);
    memcpy(td_log_last, msg, sizeof msg);
    if (level < TD_LOG_OFF && level >= td_log_level)
        td_log_write(level, td_log_last);
}

td_status_t td_error(td_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    keep_error(TD_LOG_ERROR, fmt, ap);
    va_end(ap);
    return status;
}

td_status_t td_error_at(td_log_level_t level, td_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    keep_error(level, fmt, ap);
    va_end(ap);
    return status;
}

const char *td_last_error(void) { return td_log_last; }
void td_clear_error(void) { td_log_last[0] = '\0'; }
