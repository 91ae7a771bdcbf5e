/* certs.c — see certs.h. */
#include "common/certs.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"

static td_status_t ssl_error(const char *what)
{
    char buf[256] = "";
    unsigned long e = ERR_get_error();
    if (e)
        ERR_error_string_n(e, buf, sizeof buf);
    ERR_clear_error();
    return td_error(TD_ERR_INTERNAL, "certs: %s failed%s%s", what, buf[0] ? ": " : "", buf);
}

static bool add_ext(X509 *x, X509 *issuer, int nid, const char *value)
{
    X509V3_CTX ctx;
    X509V3_set_ctx(&ctx, issuer, x, NULL, NULL, 0);
    X509_EXTENSION *ex = X509V3_EXT_nconf_nid(NULL, &ctx, nid, value);
    bool ok = ex && X509_add_ext(x, ex, -1);
    X509_EXTENSION_free(ex);
    return ok;
}

/* A certificate for key, named cn, signed by (issuer, issuer_key); a CA when
 * issuer is NULL (self-signed). */
static X509 *make_cert(EVP_PKEY *key, const char *cn, const char *san, X509 *issuer, EVP_PKEY *issuer_key, int days)
{
    X509 *x = X509_new();
    BIGNUM *serial = BN_new();
    bool ok = x && serial && X509_set_version(x, 2) && BN_rand(serial, 63, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) &&
              BN_to_ASN1_INTEGER(serial, X509_get_serialNumber(x)) &&
              X509_gmtime_adj(X509_getm_notBefore(x), -3600) &&
              X509_gmtime_adj(X509_getm_notAfter(x), (long)days * 86400) && X509_set_pubkey(x, key);
    BN_free(serial);
    X509_NAME *name = ok ? X509_get_subject_name(x) : NULL;
    ok = ok && X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, (const unsigned char *)"tandem", -1, -1, 0) &&
         X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0) &&
         X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : name);
    X509 *iss = issuer ? issuer : x;
    if (ok && !issuer)
        ok = add_ext(x, iss, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") &&
             add_ext(x, iss, NID_key_usage, "critical,keyCertSign,cRLSign") &&
             add_ext(x, iss, NID_subject_key_identifier, "hash");
    else if (ok)
        ok = add_ext(x, iss, NID_basic_constraints, "critical,CA:FALSE") &&
             add_ext(x, iss, NID_key_usage, "critical,digitalSignature,keyAgreement") &&
             add_ext(x, iss, NID_ext_key_usage, "serverAuth,clientAuth") &&
             add_ext(x, iss, NID_subject_alt_name, san) && add_ext(x, iss, NID_subject_key_identifier, "hash") &&
             add_ext(x, iss, NID_authority_key_identifier, "keyid:always");
    ok = ok && X509_sign(x, issuer ? issuer_key : key, EVP_sha256()) > 0;
    if (!ok) {
        X509_free(x);
        return NULL;
    }
    return x;
}

static td_status_t write_pem(const char *path, X509 *x, EVP_PKEY *key)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, key ? 0600 : 0644);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0)
            close(fd);
        return td_error(TD_ERR_IO, "certs: cannot write %s: %s", path, strerror(errno));
    }
    bool ok = key ? PEM_write_PrivateKey(f, key, NULL, NULL, 0, NULL, NULL) : PEM_write_X509(f, x);
    if (fclose(f) || !ok)
        return td_error(TD_ERR_IO, "certs: cannot write %s", path);
    return TD_OK;
}

static td_status_t write_pair(const char *dir, const char *name, X509 *x, EVP_PKEY *key)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s.pem", dir, name);
    td_status_t rc = write_pem(path, x, NULL);
    snprintf(path, sizeof path, "%s/%s.key", dir, name);
    return rc ? rc : write_pem(path, NULL, key);
}

/* The CA of dir: read when ca.pem and ca.key are there, else made. */
static td_status_t ca_of(const char *dir, int days, X509 **ca, EVP_PKEY **ca_key)
{
    char cp[PATH_MAX], kp[PATH_MAX];
    snprintf(cp, sizeof cp, "%s/ca.pem", dir);
    snprintf(kp, sizeof kp, "%s/ca.key", dir);
    FILE *fc = fopen(cp, "r"), *fk = fopen(kp, "r");
    if (fc && fk) {
        *ca = PEM_read_X509(fc, NULL, NULL, NULL);
        *ca_key = PEM_read_PrivateKey(fk, NULL, NULL, NULL);
        fclose(fc);
        fclose(fk);
        if (!*ca || !*ca_key || X509_check_private_key(*ca, *ca_key) != 1) {
            X509_free(*ca);
            EVP_PKEY_free(*ca_key);
            *ca = NULL;
            *ca_key = NULL;
            return td_error(TD_ERR_FORMAT, "certs: %s and %s are not a certificate and its key", cp, kp);
        }
        return TD_OK;
    }
    if (fc)
        fclose(fc);
    if (fk)
        fclose(fk);
    *ca_key = EVP_EC_gen("P-256");
    *ca = *ca_key ? make_cert(*ca_key, "tandem cluster CA", NULL, NULL, NULL, days) : NULL;
    if (!*ca) {
        EVP_PKEY_free(*ca_key);
        *ca_key = NULL;
        return ssl_error("making the CA");
    }
    return write_pair(dir, "ca", *ca, *ca_key);
}

td_status_t td_certs_make(const char *dir, const char *const *names, size_t n_names, const char *const *hosts,
                          size_t n_hosts, int days)
{
    if (mkdir(dir, 0700) && errno != EEXIST)
        return td_error(TD_ERR_IO, "certs: cannot make %s: %s", dir, strerror(errno));
    char san[4096];
    size_t at = (size_t)snprintf(san, sizeof san, "DNS:localhost,IP:127.0.0.1");
    for (size_t i = 0; i < n_hosts; i++) {
        unsigned char addr[16];
        bool ip = inet_pton(AF_INET, hosts[i], addr) == 1 || inet_pton(AF_INET6, hosts[i], addr) == 1;
        if (!hosts[i][0] || strpbrk(hosts[i], ", "))
            return td_error(TD_ERR_INVALID_ARG, "certs: '%s' is not a host name or address", hosts[i]);
        at += (size_t)snprintf(san + at, at < sizeof san ? sizeof san - at : 0, ",%s:%s", ip ? "IP" : "DNS",
                               hosts[i]);
        if (at >= sizeof san)
            return td_error(TD_ERR_INVALID_ARG, "certs: too many hosts");
    }
    X509 *ca = NULL;
    EVP_PKEY *ca_key = NULL;
    td_status_t rc = ca_of(dir, days, &ca, &ca_key);
    for (size_t i = 0; !rc && i < n_names; i++) {
        if (!names[i][0] || strchr(names[i], '/') || !strcmp(names[i], "ca")) {
            rc = td_error(TD_ERR_INVALID_ARG, "certs: '%s' cannot name a certificate", names[i]);
            break;
        }
        EVP_PKEY *key = EVP_EC_gen("P-256");
        X509 *x = key ? make_cert(key, names[i], san, ca, ca_key, days) : NULL;
        rc = x ? write_pair(dir, names[i], x, key) : ssl_error("making a certificate");
        X509_free(x);
        EVP_PKEY_free(key);
    }
    X509_free(ca);
    EVP_PKEY_free(ca_key);
    return rc;
}
