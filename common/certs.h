/* certs.h — the cluster's certificate authority and the certificates of its
 * processes (DESIGN.md §2 "Security"), made with OpenSSL's libcrypto; and
 * grants signed with a process's key and checked against that CA.
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

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

td_status_t td_certs_make(const char *dir, const char *const *names, size_t n_names, const char *const *hosts,
                          size_t n_hosts, int days);

/* A process's role is its certificate's common name up to the first '-'
 * ("decode-0" is a decode worker, "router" the router): true when cn's role
 * is one of the comma list roles ("router" or "router,prefill"). */
bool td_cert_role_in(const char *roles, const char *cn);

/* The common name of the first certificate in pem into cn (n bytes); false
 * (cn "") when there is none or it does not fit. */
bool td_cert_pem_cn(const char *pem, char *cn, size_t n);

/* Signing with this process's cluster key: a grant (a landing descriptor) a
 * peer can check came from a process of a given role, without asking it.
 * Thread-safe after open. */
typedef struct td_signer td_signer_t;
td_status_t td_signer_open(const char *cert_file, const char *key_file, td_signer_t **out);
void td_signer_close(td_signer_t *s);
/* The signer's certificate (DER), sent beside a signature. */
const uint8_t *td_signer_cert(const td_signer_t *s, size_t *len);
/* The signature of msg (SHA-256, with the key's algorithm): at most
 * TD_SIG_MAX bytes into sig. */
#define TD_SIG_MAX 512
td_status_t td_sign(td_signer_t *s, const void *msg, size_t len, uint8_t *sig, size_t *sig_len);

/* Checking a grant: the signer's certificate chains to the cluster CA, its
 * role is one of roles, and sig is its signature of msg. A certificate seen
 * before is not verified again (a few are kept). Thread-safe after open. */
typedef struct td_verifier td_verifier_t;
td_status_t td_verifier_open(const char *ca_file, td_verifier_t **out);
void td_verifier_close(td_verifier_t *v);
/* TD_ERR_INVALID_ARG naming what did not hold (the certificate, its role,
 * the signature). */
td_status_t td_verify(td_verifier_t *v, const uint8_t *cert, size_t cert_len, const char *roles, const void *msg,
                      size_t len, const uint8_t *sig, size_t sig_len);

#endif
