/* https.h — TLS for tandem's HTTP listeners on libmicrohttpd (the OpenAI API,
 * /metrics), with the same PEM files and the same rule as the gRPC planes
 * (td_rpc_tls_t): the listener shows cert_file; with ca_file it also wants a
 * client certificate that CA signed, and the listener answers a request
 * without one 403 naming what was missing. Without cert_file the listener is
 * plain HTTP. */
#ifndef TD_HTTPS_H
#define TD_HTTPS_H

#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/rpc.h"

typedef struct td_https td_https_t;

/* Reads tls's files once (what names the listener in errors). *out is NULL,
 * and the listener plain, when tls is NULL or has no cert_file. */
td_status_t td_https_load(const td_rpc_tls_t *tls, const char *what, td_https_t **out);
void td_https_free(td_https_t *h);

/* The MHD_start_daemon flag (MHD_USE_TLS, or 0 for NULL) and the options
 * after it, as an MHD_OPTION_ARRAY's items ending in MHD_OPTION_END (at most
 * TD_HTTPS_OPTIONS items). h must outlive the daemon. */
#define TD_HTTPS_OPTIONS 5
unsigned td_https_flag(const td_https_t *h);
void td_https_options(const td_https_t *h, struct MHD_OptionItem opts[TD_HTTPS_OPTIONS]);

/* True when the connection may be served: always for a plain listener or one
 * without a CA; otherwise when the client showed a certificate the CA signed.
 * False with the reason in why, for the caller's 403 answer. */
bool td_https_client_ok(const td_https_t *h, struct MHD_Connection *c, char *why, size_t cap);

#endif
