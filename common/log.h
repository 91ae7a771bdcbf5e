/* log.h — leveled logging to stderr, plain or JSON lines.
 *
 * One line per record: time (UTC, ms), level, component, message. The JSON form
 * ({"ts":..,"level":..,"component":..,"msg":..}) is for log collectors. The level
 * and form come from td_log_init() or the environment (TANDEM_LOG=debug|info|warn|
 * error|off, TANDEM_LOG_FORMAT=json).
 *
 * td_error() is how a module reports a failure: it logs the message once at error
 * level, keeps it as this thread's last error (td_last_error(), which the command
 * line and tests read) and returns the status so the caller can pass it up. */
#ifndef TD_LOG_H
#define TD_LOG_H

#include <stdbool.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_log_level {
    TD_LOG_DEBUG,
    TD_LOG_INFO,
    TD_LOG_WARN,
    TD_LOG_ERROR,
    TD_LOG_OFF
} td_log_level_t;

/* Sets the component name (copied) and the level; json selects JSON lines.
 * The environment overrides both. Safe to call again. */
void td_log_init(const char *component, td_log_level_t level, bool json);
void td_log_set_level(td_log_level_t level);
/* Parses "debug", "info", "warn", "error", "off". */
td_status_t td_log_level_parse(const char *name, td_log_level_t *level_out);

void td_log(td_log_level_t level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Logs fmt at error level, stores it as the thread's last error, returns status. */
td_status_t td_error(td_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* As td_error, logged at level instead (TD_LOG_OFF: only kept): for a
 * layer whose caller decides how loud the failure is (a peer's refusal the
 * caller retries elsewhere, a user's bad input at WARN). */
td_status_t td_error_at(td_log_level_t level, td_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A user's input is wrong (TD_ERR_INVALID_ARG): the message is kept as the
 * last error and logged at debug level only; the caller that knows whose
 * request it is logs it at WARN naming the request (a bad request is the
 * user's error, not the server's). */
#define td_user_error(...) td_error_at(TD_LOG_DEBUG, TD_ERR_INVALID_ARG, __VA_ARGS__)
/* The message of this thread's last td_error(), "" if none. */
const char *td_last_error(void);
void td_clear_error(void);

#define TD_DEBUG(...) td_log(TD_LOG_DEBUG, __VA_ARGS__)
#define TD_INFO(...) td_log(TD_LOG_INFO, __VA_ARGS__)
#define TD_WARN(...) td_log(TD_LOG_WARN, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
