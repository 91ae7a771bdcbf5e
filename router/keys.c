/* keys.c — see keys.h. */
#define _GNU_SOURCE
#include "router/keys.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/rpc.h"

struct rt_key {
    unsigned char hash[32];
    char name[64];
    double rpm, tpm, req_bucket, tok_bucket, refilled;
    double weight;    /* its share of a contended cluster (router/fair.h) */
    int32_t priority; /* its class there: higher first */
};

struct rt_keys {
    pthread_mutex_t mu; /* the buckets */
    rt_key_t *k;
    size_t n;
};

void rt_keys_free(rt_keys_t *ks)
{
    if (!ks)
        return;
    pthread_mutex_destroy(&ks->mu);
    free(ks->k);
    free(ks);
}

td_status_t rt_keys_load(const char *path, const char *cfg_key, rt_keys_t **out)
{
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (!f)
        return td_error(TD_ERR_CONFIG, "%s: cannot read %s: %s", cfg_key, path, strerror(errno));
    rt_keys_t *ks = calloc(1, sizeof *ks);
    if (!ks) {
        fclose(f);
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", cfg_key);
    }
    pthread_mutex_init(&ks->mu, NULL);
    char line[512];
    int no = 0;
    td_status_t rc = TD_OK;
    while (!rc && fgets(line, sizeof line, f)) {
        no++;
        char *save = NULL, *hash = strtok_r(line, " \t\r\n", &save);
        if (!hash || hash[0] == '#')
            continue;
        char *name = strtok_r(NULL, " \t\r\n", &save), *rpm = strtok_r(NULL, " \t\r\n", &save),
             *tpm = strtok_r(NULL, " \t\r\n", &save), *wt = strtok_r(NULL, " \t\r\n", &save),
             *pr = strtok_r(NULL, " \t\r\n", &save), *more = strtok_r(NULL, " \t\r\n", &save);
        char *e1 = NULL, *e2 = NULL, *e3 = "", *e4 = "";
        double r = rpm ? strtod(rpm, &e1) : -1, t = tpm ? strtod(tpm, &e2) : -1, w = wt ? strtod(wt, &e3) : 1;
        long p = pr ? strtol(pr, &e4, 10) : 0;
        rt_key_t k = {0};
        bool hex = strlen(hash) == 64;
        for (int i = 0; hex && i < 32; i++) {
            unsigned v;
            hex = sscanf(hash + 2 * i, "%2x", &v) == 1;
            k.hash[i] = (unsigned char)v;
        }
        if (!hex || !name || r < 0 || t < 0 || *e1 || *e2 || strlen(name) >= sizeof k.name || *e3 || *e4 ||
            !(w > 0 && w <= 1e6) || p < -1000000 || p > 1000000 || more) {
            rc = td_error(TD_ERR_CONFIG, "%s: %s line %d: expected \"SHA256-HEX NAME RPM TPM [WEIGHT [PRIORITY]]\" "
                          "(a weight over 0 up to 1e6, a priority within +-1e6; tandem apikey NAME makes one)",
                          cfg_key, path, no);
            break;
        }
        k.weight = w;
        k.priority = (int32_t)p;
        snprintf(k.name, sizeof k.name, "%s", name);
        k.rpm = k.req_bucket = r;
        k.tpm = k.tok_bucket = t;
        k.refilled = td_now_s();
        rt_key_t *nk = realloc(ks->k, (ks->n + 1) * sizeof *nk);
        if (!nk) {
            rc = td_error(TD_ERR_NO_MEMORY, "%s: no memory", cfg_key);
            break;
        }
        ks->k = nk;
        ks->k[ks->n++] = k;
    }
    fclose(f);
    if (!rc && !ks->n)
        rc = td_error(TD_ERR_CONFIG, "%s: %s has no key (every request would be refused)", cfg_key, path);
    if (rc) {
        rt_keys_free(ks);
        return rc;
    }
    *out = ks;
    return TD_OK;
}

static void refill(rt_key_t *k, double now)
{
    double dt = now - k->refilled;
    k->refilled = now;
    if (k->rpm) {
        k->req_bucket += dt * k->rpm / 60.0;
        if (k->req_bucket > k->rpm)
            k->req_bucket = k->rpm;
    }
    if (k->tpm) {
        k->tok_bucket += dt * k->tpm / 60.0;
        if (k->tok_bucket > k->tpm)
            k->tok_bucket = k->tpm;
    }
}

int rt_keys_admit(rt_keys_t *ks, const char *authorization, const rt_key_t **key, char *msg, size_t n,
                  double *retry_s)
{
    *key = NULL;
    *retry_s = 0;
    rt_key_t *k = NULL;
    if (authorization && !strncasecmp(authorization, "Bearer ", 7)) {
        unsigned char hash[32];
        SHA256((const unsigned char *)authorization + 7, strlen(authorization + 7), hash);
        for (size_t i = 0; i < ks->n; i++)
            if (!CRYPTO_memcmp(hash, ks->k[i].hash, 32))
                k = &ks->k[i];
    }
    if (!k) {
        snprintf(msg, n, "%s", authorization ? "the API key is not one of this server's"
                                             : "an API key is needed: Authorization: Bearer KEY");
        return TD_RPC_UNAUTHENTICATED;
    }
    pthread_mutex_lock(&ks->mu);
    refill(k, td_now_s());
    bool ok = !k->rpm || k->req_bucket >= 1;
    if (ok && k->rpm)
        k->req_bucket -= 1;
    else if (!ok)
        *retry_s = (1 - k->req_bucket) * 60.0 / k->rpm;
    pthread_mutex_unlock(&ks->mu);
    if (!ok) {
        snprintf(msg, n, "rate limit of key '%s': %.0f requests per minute; try again in %.1f s", k->name, k->rpm,
                 *retry_s);
        return TD_RPC_RESOURCE_EXHAUSTED;
    }
    *key = k;
    return 0;
}

int rt_keys_charge(rt_keys_t *ks, const rt_key_t *key, uint32_t tokens, uint32_t *charged, char *msg, size_t n,
                   double *retry_s)
{
    rt_key_t *k = (rt_key_t *)key;
    *charged = 0;
    *retry_s = 0;
    if (!k || !k->tpm)
        return 0;
    double want = tokens < k->tpm ? tokens : k->tpm;
    pthread_mutex_lock(&ks->mu);
    refill(k, td_now_s());
    bool ok = k->tok_bucket >= want;
    if (ok)
        k->tok_bucket -= want;
    else
        *retry_s = (want - k->tok_bucket) * 60.0 / k->tpm;
    pthread_mutex_unlock(&ks->mu);
    if (!ok) {
        snprintf(msg, n, "rate limit of key '%s': %.0f tokens per minute, and this request may use %u (prompt + "
                 "max_tokens); try again in %.1f s", k->name, k->tpm, tokens, *retry_s);
        return TD_RPC_RESOURCE_EXHAUSTED;
    }
    *charged = (uint32_t)want;
    return 0;
}

void rt_keys_settle(rt_keys_t *ks, const rt_key_t *key, uint32_t charged, uint32_t used)
{
    rt_key_t *k = (rt_key_t *)key;
    if (!k || !k->tpm)
        return;
    pthread_mutex_lock(&ks->mu);
    refill(k, td_now_s());
    k->tok_bucket += (double)charged - (double)used;
    pthread_mutex_unlock(&ks->mu);
}

const char *rt_key_name(const rt_key_t *key) { return key ? key->name : ""; }
double rt_key_weight(const rt_key_t *key) { return key ? key->weight : 1; }
int32_t rt_key_priority(const rt_key_t *key) { return key ? key->priority : 0; }
