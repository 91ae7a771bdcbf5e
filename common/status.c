/* status.c — names of the statuses in status.h. */
#include "common/status.h"

static const char *const td_status_names[TD_STATUS_COUNT] = {
    [TD_OK] = "ok",
    [TD_ERR_INVALID_ARG] = "invalid argument",
    [TD_ERR_NO_MEMORY] = "out of memory",
    [TD_ERR_IO] = "i/o error",
    [TD_ERR_FORMAT] = "format error",
    [TD_ERR_UNSUPPORTED] = "unsupported",
    [TD_ERR_NOT_FOUND] = "not found",
    [TD_ERR_OUT_OF_RANGE] = "out of range",
    [TD_ERR_CONFIG] = "configuration error",
    [TD_ERR_TIMEOUT] = "timed out",
    [TD_ERR_INTERNAL] = "internal error",
    [TD_ERR_CANCELLED] = "cancelled",
    [TD_ERR_UNAVAILABLE] = "unavailable",
    [TD_ERR_EXHAUSTED] = "resource exhausted",
};

const char *td_status_str(td_status_t status)
{
    if ((unsigned)status >= TD_STATUS_COUNT)
        return "unknown status";
    return td_status_names[status];
}
