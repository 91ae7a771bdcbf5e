/* certs.c — see certs.h. */
#include "common/certs.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
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

/* ------------------------------------------------------------------ grants */

bool td_cert_role_in(const char *roles, const char *cn)
{
    size_t n = strcspn(cn, "-");
    if (!n)
        return false;
    for (const char *r = roles; *r;) {
        size_t k = strcspn(r, ",");
        if (k == n && !strncmp(r, cn, n))
            return true;
        r += k + (r[k] == ',');
    }
    return false;
}

bool td_cert_pem_cn(const char *pem, char *cn, size_t n)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    X509 *x = b ? PEM_read_bio_X509(b, NULL, NULL, NULL) : NULL;
    BIO_free(b);
    int len = x ? X509_NAME_get_text_by_NID(X509_get_subject_name(x), NID_commonName, cn, (int)n) : -1;
    X509_free(x);
    if (len <= 0 || (size_t)len >= n) {
        if (n)
            cn[0] = 0;
        return false;
    }
    return true;
}

struct td_signer {
    EVP_PKEY *key;
    uint8_t *der;
    size_t der_len;
};

td_status_t td_signer_open(const char *cert_file, const char *key_file, td_signer_t **out)
{
    *out = NULL;
    td_signer_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "certs: no memory");
    FILE *f = fopen(cert_file, "r");
    X509 *x = f ? PEM_read_X509(f, NULL, NULL, NULL) : NULL;
    if (f)
        fclose(f);
    f = x ? fopen(key_file, "r") : NULL;
    s->key = f ? PEM_read_PrivateKey(f, NULL, NULL, NULL) : NULL;
    if (f)
        fclose(f);
    int n = s->key ? i2d_X509(x, &s->der) : -1;
    X509_free(x);
    if (n <= 0) {
        td_status_t rc = td_error(TD_ERR_CONFIG, "certs: cannot read the %s %s", !x ? "certificate" : "key",
                                  !x ? cert_file : key_file);
        ERR_clear_error();
        td_signer_close(s);
        return rc;
    }
    s->der_len = (size_t)n;
    *out = s;
    return TD_OK;
}

void td_signer_close(td_signer_t *s)
{
    if (!s)
        return;
    EVP_PKEY_free(s->key);
    OPENSSL_free(s->der);
    free(s);
}

const uint8_t *td_signer_cert(const td_signer_t *s, size_t *len)
{
    *len = s->der_len;
    return s->der;
}

td_status_t td_sign(td_signer_t *s, const void *msg, size_t len, uint8_t *sig, size_t *sig_len)
{
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    size_t n = 0;
    bool ok = c && EVP_DigestSignInit(c, NULL, EVP_sha256(), NULL, s->key) == 1 &&
              EVP_DigestSign(c, NULL, &n, msg, len) == 1 && n <= TD_SIG_MAX &&
              EVP_DigestSign(c, sig, &n, msg, len) == 1;
    EVP_MD_CTX_free(c);
    if (!ok)
        return ssl_error("signing a grant");
    *sig_len = n;
    return TD_OK;
}

/* a certificate verified before: its digest, its key and its common name */
#define VERIFIED_KEEP 16
typedef struct verified {
    uint8_t digest[SHA256_DIGEST_LENGTH];
    EVP_PKEY *key;
    char cn[64];
} verified_t;

struct td_verifier {
    X509_STORE *store;
    pthread_mutex_t mu;
    verified_t kept[VERIFIED_KEEP];
    unsigned next;
};

td_status_t td_verifier_open(const char *ca_file, td_verifier_t **out)
{
    *out = NULL;
    td_verifier_t *v = calloc(1, sizeof *v);
    if (!v || !(v->store = X509_STORE_new())) {
        free(v);
        return td_error(TD_ERR_NO_MEMORY, "certs: no memory");
    }
    pthread_mutex_init(&v->mu, NULL);
    if (X509_STORE_load_file(v->store, ca_file) != 1) {
        ERR_clear_error();
        td_verifier_close(v);
        return td_error(TD_ERR_CONFIG, "certs: cannot read the CA certificate %s", ca_file);
    }
    *out = v;
    return TD_OK;
}

void td_verifier_close(td_verifier_t *v)
{
    if (!v)
        return;
    for (int i = 0; i < VERIFIED_KEEP; i++)
        EVP_PKEY_free(v->kept[i].key);
    X509_STORE_free(v->store);
    pthread_mutex_destroy(&v->mu);
    free(v);
}

/* The key and common name of cert (DER) once it chains to the CA: from the
 * kept ones, or verified now and kept. A new reference to the key. */
static td_status_t verified_key(td_verifier_t *v, const uint8_t *cert, size_t cert_len, EVP_PKEY **key, char *cn,
                                size_t cn_cap)
{
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256(cert, cert_len, d);
    pthread_mutex_lock(&v->mu);
    for (int i = 0; i < VERIFIED_KEEP; i++)
        if (v->kept[i].key && !memcmp(v->kept[i].digest, d, sizeof d)) {
            EVP_PKEY_up_ref(v->kept[i].key);
            *key = v->kept[i].key;
            snprintf(cn, cn_cap, "%s", v->kept[i].cn);
            pthread_mutex_unlock(&v->mu);
            return TD_OK;
        }
    pthread_mutex_unlock(&v->mu);
    const uint8_t *p = cert;
    X509 *x = cert_len <= LONG_MAX ? d2i_X509(NULL, &p, (long)cert_len) : NULL;
    if (!x || p != cert + cert_len) {
        X509_free(x);
        ERR_clear_error();
        return td_error(TD_ERR_INVALID_ARG, "the signer's certificate does not parse");
    }
    X509_STORE_CTX *ctx = X509_STORE_CTX_new();
    bool ok = ctx && X509_STORE_CTX_init(ctx, v->store, x, NULL) == 1;
    int vr = ok ? X509_verify_cert(ctx) : -1;
    int err = ctx ? X509_STORE_CTX_get_error(ctx) : 0;
    X509_STORE_CTX_free(ctx);
    char name[64] = "";
    X509_NAME_get_text_by_NID(X509_get_subject_name(x), NID_commonName, name, sizeof name);
    if (vr != 1) {
        X509_free(x);
        ERR_clear_error();
        return td_error(TD_ERR_INVALID_ARG, "the signer's certificate (CN \"%s\") is not one the cluster CA signed: %s",
                        name, X509_verify_cert_error_string(err));
    }
    EVP_PKEY *k = X509_get_pubkey(x);
    X509_free(x);
    if (!k)
        return ssl_error("reading the signer's key");
    pthread_mutex_lock(&v->mu);
    verified_t *slot = &v->kept[v->next++ % VERIFIED_KEEP];
    EVP_PKEY_free(slot->key);
    memcpy(slot->digest, d, sizeof d);
    slot->key = k;
    snprintf(slot->cn, sizeof slot->cn, "%s", name);
    EVP_PKEY_up_ref(k);
    pthread_mutex_unlock(&v->mu);
    *key = k;
    snprintf(cn, cn_cap, "%s", name);
    return TD_OK;
}

td_status_t td_verify(td_verifier_t *v, const uint8_t *cert, size_t cert_len, const char *roles, const void *msg,
                      size_t len, const uint8_t *sig, size_t sig_len)
{
    if (!cert_len || !sig_len)
        return td_error(TD_ERR_INVALID_ARG, "unsigned (no %s)", !cert_len ? "signer certificate" : "signature");
    EVP_PKEY *k = NULL;
    char cn[64];
    td_status_t rc = verified_key(v, cert, cert_len, &k, cn, sizeof cn);
    if (rc)
        return rc;
    if (!td_cert_role_in(roles, cn)) {
        EVP_PKEY_free(k);
        return td_error(TD_ERR_INVALID_ARG, "signed by \"%s\", not a %s", cn, roles);
    }
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    int r = c && EVP_DigestVerifyInit(c, NULL, EVP_sha256(), NULL, k) == 1
                ? EVP_DigestVerify(c, sig, sig_len, msg, len) : -1;
    EVP_MD_CTX_free(c);
    EVP_PKEY_free(k);
    ERR_clear_error();
    if (r != 1)
        return td_error(TD_ERR_INVALID_ARG, "the signature is not %s's over these contents", cn);
    return TD_OK;
}
