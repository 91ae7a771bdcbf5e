/* certs.h — the cluster's certificate authority and the certificates of its
 * processes (DESIGN.md §2 "Security"), made with OpenSSL's libcrypto.
 *
 * One CA signs every process's certificate; every internal plane (router ↔
 * workers, etcd) accepts only peers whose certificate that CA signed, and
 * every process shows its own. Keys are ECDSA P-256; a certificate names its
 * process (CN) and the hosts it serves (subjectAltName: the loopback address
 * and "localhost" always, then the hosts given), and may serve and dial
 * (extendedKeyUsage serverAuth + clientAuth).
 *
 * In dir: ca.pem and ca.key, then NAME.pem and NAME.key for every name. Key
 * files are written 0600 and the folder is made 0700. An existing CA in dir
 * is used, not replaced, so certificates can be added later. */
#ifndef TD_CERTS_H
#define TD_CERTS_H

#include <stddef.h>

#include "common/status.h"

td_status_t td_certs_make(const char *dir, const char *const *names, size_t n_names, const char *const *hosts,
                          size_t n_hosts, int days);

#endif
