/* status.h — the one status type of tandem.
 *
 * Every function that can fail returns a td_status_t (UCX's ucs_status_t is the
 * model). TD_OK is zero, so `if (rc) goto fail;` reads naturally. The error is
 * logged once, where it is first detected, with the facts a reader needs; callers
 * only pass the status up. td_status_str() names a status for messages. */
#ifndef TD_STATUS_H
#define TD_STATUS_H

typedef enum td_status {
    TD_OK = 0,
    TD_ERR_INVALID_ARG,    /* a caller or user gave a value outside its domain */
    TD_ERR_NO_MEMORY,      /* an allocation failed */
    TD_ERR_IO,             /* open/read/mmap/stat failed */
    TD_ERR_FORMAT,         /* a file or message is not what it claims to be */
    TD_ERR_UNSUPPORTED,    /* well formed, but a feature we do not implement */
    TD_ERR_NOT_FOUND,      /* a named thing (key, tensor, token) is absent */
    TD_ERR_OUT_OF_RANGE,   /* an index or size past a limit */
    TD_ERR_CONFIG,         /* the configuration is wrong */
    TD_ERR_TIMEOUT,        /* a deadline passed */
    TD_ERR_INTERNAL,       /* a bug: an invariant did not hold */
    TD_ERR_CANCELLED,      /* the caller or the peer gave up */
    TD_ERR_UNAVAILABLE,    /* a peer cannot be reached or went away */
    TD_ERR_EXHAUSTED,      /* no capacity left (pool, queue, slots) */
    TD_STATUS_COUNT
} td_status_t;

/* A short, static, lower-case name of the status ("format error"). */
const char *td_status_str(td_status_t status);

#endif
