/* https.c — TLS for the HTTP listeners (https.h). */
#include "common/https.h"

#include <gnutls/gnutls.h>
#include <gnutls/x509.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct td_https {
    td_tls_pems_t pems;
};

td_status_t td_https_load(const td_rpc_tls_t *tls, const char *what, td_https_t **out)
{
    *out = NULL;
    if (!tls || !tls->cert_file || !tls->cert_file[0])
        return TD_OK;
    td_https_t *h = calloc(1, sizeof *h);
    if (!h)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory for its TLS files", what);
    td_status_t rc = td_tls_pems_load(tls, &h->pems); /* its error names the file */
    if (rc) {
        free(h);
        return rc;
    }
    *out = h;
    return TD_OK;
}

void td_https_free(td_https_t *h)
{
    if (!h)
        return;
    td_tls_pems_free(&h->pems);
    free(h);
}

unsigned td_https_flag(const td_https_t *h)
{
    return h ? MHD_USE_TLS : 0;
}

void td_https_options(const td_https_t *h, struct MHD_OptionItem opts[TD_HTTPS_OPTIONS])
{
    size_t n = 0;
    if (h) {
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, h->pems.cert};
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, h->pems.key};
        /* with a trust list the server asks every client for its certificate */
        if (h->pems.ca)
            opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_TRUST, 0, h->pems.ca};
    }
    opts[n] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
}

bool td_https_client_ok(const td_https_t *h, struct MHD_Connection *c, char *why, size_t cap)
{
    if (!h || !h->pems.ca)
        return true;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_GNUTLS_SESSION);
    gnutls_session_t s = ci ? (gnutls_session_t)ci->tls_session : NULL;
    unsigned status = 0, n_peer = 0;
    if (!s || !gnutls_certificate_get_peers(s, &n_peer) || !n_peer) {
        snprintf(why, cap,
                 "no client certificate: this listener wants one the cluster's CA "
                 "signed");
        return false;
    }
    int e = gnutls_certificate_verify_peers2(s, &status);
    if (e < 0) {
        snprintf(why, cap, "the client certificate could not be checked: %s", gnutls_strerror(e));
        return false;
    }
    if (status) {
        gnutls_datum_t out = {0};
        if (gnutls_certificate_verification_status_print(status, GNUTLS_CRT_X509, &out, 0) == 0) {
            snprintf(why, cap, "the client certificate is not accepted: %s", (const char *)out.data);
            gnutls_free(out.data);
        } else {
            snprintf(why, cap, "the client certificate is not accepted (gnutls status 0x%x)", status);
        }
        return false;
    }
    return true;
}
