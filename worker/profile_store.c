/* profile_store.c — see profile_store.h. */
#define _GNU_SOURCE
#include "worker/profile_store.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/process.h"

/* The cache file of key: DIR/tandem/profiles/ and the key past its
 * "/tandem/profiles/", each character other than [A-Za-z0-9._-] made '_'
 * (the host, role, model and settings stay readable in one name). */
static bool cache_path(const char *key, char *out, size_t n)
{
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[512];
    if (xdg && xdg[0] == '/')
        snprintf(dir, sizeof dir, "%s", xdg);
    else if (home && home[0] == '/')
        snprintf(dir, sizeof dir, "%s/.cache", home);
    else
        return false;
    const char *rel = key;
    static const char prefix[] = "/tandem/profiles/";
    if (!strncmp(rel, prefix, sizeof prefix - 1))
        rel += sizeof prefix - 1;
    int k = snprintf(out, n, "%s/tandem/profiles/", dir);
    if (k < 0 || (size_t)k >= n)
        return false;
    size_t i = (size_t)k;
    for (const char *c = rel; *c && i + 6 < n; c++)
        out[i++] = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '.' ||
                           *c == '-'
                       ? *c
                       : '_';
    if (i + 6 >= n)
        return false;
    memcpy(out + i, ".json", 6);
    return true;
}

/* mkdir -p of path's folder. */
static void make_dirs(const char *path)
{
    char d[1200];
    snprintf(d, sizeof d, "%s", path);
    for (char *s = d + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            mkdir(d, 0755);
            *s = '/';
        }
}

static bool from_etcd(td_etcd_t *etcd, const char *key, eng_profile_t *out)
{
    td_etcd_kvs_t kvs = {0};
    bool ok = false;
    if (etcd && td_etcd_get(etcd, key, false, &kvs) == TD_OK && kvs.n) {
        json_t *j = json_loadb((const char *)kvs.kv[0].value, kvs.kv[0].value_len, 0, NULL);
        ok = j && eng_profile_from_json(j, out) == TD_OK;
        json_decref(j);
    }
    td_etcd_kvs_free(&kvs);
    return ok;
}

static bool from_file(const char *id, const char *path, eng_profile_t *out)
{
    if (access(path, F_OK))
        return false;
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    bool ok = j && eng_profile_from_json(j, out) == TD_OK;
    if (!ok)
        TD_WARN("%s: the cached profile %s is not a profile (%s); measuring it again", id, path,
                j ? td_last_error() : jerr.text);
    json_decref(j);
    return ok;
}

/* Written whole or not at all: a temporary file renamed over the old. */
static void to_file(const char *id, const char *path, const char *v)
{
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    make_dirs(path);
    FILE *f = fopen(tmp, "w");
    bool ok = f && fputs(v, f) >= 0;
    if (f && fclose(f))
        ok = false;
    if (!ok || rename(tmp, path)) {
        TD_WARN("%s: the profile is not kept in %s (%s); a new cluster on this host measures it again", id, path,
                strerror(errno));
        unlink(tmp);
    }
}

/* The host's sweep lock, DIR/tandem/profiles/.sweep.lock beside path: one
 * sweep at a time on a host (side by side on shared cores they inflate each
 * other's times, and a second worker of the same settings then finds the
 * first's file). Waited for SWEEP_WAIT_S at most; -1 when there is no lock
 * (the sweep goes ahead beside the other, said in a warning). */
#define SWEEP_WAIT_S 120.0
static int sweep_lock(const char *id, const char *path)
{
    char lp[1100];
    const char *slash = strrchr(path, '/');
    if (!slash)
        return -1;
    snprintf(lp, sizeof lp, "%.*s/.sweep.lock", (int)(slash - path), path);
    make_dirs(lp);
    int fd = open(lp, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    double until = td_now_s() + SWEEP_WAIT_S;
    while (flock(fd, LOCK_EX | LOCK_NB)) {
        int err = errno;
        if (td_process_stop_signal()) { /* stopped while waiting its turn: no sweep follows (wk_profile_get) */
            close(fd);
            return -1;
        }
        bool late = td_now_s() > until;
        if (err != EWOULDBLOCK)
            TD_WARN("%s: cannot lock %s (%s); sweeping without it", id, lp, strerror(err));
        else if (late)
            TD_WARN("%s: another worker's sweep has held %s for %.0f s; sweeping beside it", id, lp, SWEEP_WAIT_S);
        if (err != EWOULDBLOCK || late) {
            close(fd);
            return -1;
        }
        usleep(50 * 1000);
    }
    return fd;
}

/* Kept in etcd and (when it was measured here) in the cache file. */
static void keep(const char *id, td_etcd_t *etcd, const char *key, const eng_profile_t *p, const char *path)
{
    json_t *pj = eng_profile_to_json(p);
    char *v = pj ? json_dumps(pj, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
    json_decref(pj);
    if (!etcd || !v || td_etcd_put(etcd, key, v, strlen(v), 0))
        TD_WARN("%s: the profile is not kept in etcd (%s); a restart measures it again", id,
                v ? td_last_error() : "no memory");
    if (v && path)
        to_file(id, path, v);
    free(v);
}

/* A kept profile older than PROFILE_FRESH_S is checked (eng_profile_check):
 * off by more than PROFILE_STALE either way, it was measured in another
 * state of the host (a load, a clock, another tenant) and is measured again
 * and replaced. A younger one (another worker's of this start, a cluster
 * started again) is this state's; checking it would only add the noise of
 * one measurement to the sweep's. */
#define PROFILE_STALE 2.0
#define PROFILE_FRESH_S 600.0

td_status_t wk_profile_get(const char *id, const char *key, const char *etcd_endpoints, const td_rpc_tls_t *tls,
                           eng_engine_t *e, int32_t lo, int32_t hi, eng_profile_t *out, char *how, size_t how_len)
{
    td_etcd_t *etcd = NULL;
    if (td_etcd_connect(etcd_endpoints, tls, &etcd))
        etcd = NULL;
    char path[1024];
    bool cached = cache_path(key, path, sizeof path);
    td_status_t rc = TD_OK;
    /* checks and sweeps both time this host: they take turns, and one that waited finds what the one before it
     * measured */
    int lock = cached ? sweep_lock(id, path) : -1;
    if (td_process_stop_signal()) { /* stopped while starting: nothing measured nor kept */
        rc = td_error(TD_ERR_CANCELLED, "%s: stopped before its profile", id);
        goto out;
    }
    const char *from = from_etcd(etcd, key, out) ? "etcd" : cached && from_file(id, path, out) ? path : NULL;
    if (from) {
        double age = (double)time(NULL) - out->measured_at, ratio = 1;
        bool fresh = age >= 0 && age < PROFILE_FRESH_S;
        if (!fresh && (rc = eng_profile_check(e, lo, hi, out, &ratio)))
            goto out;
        if (fresh || (ratio > 1 / PROFILE_STALE && ratio < PROFILE_STALE)) {
            if (fresh)
                snprintf(how, how_len, "reused from %s (measured %.0f s ago)", from, age);
            else
                snprintf(how, how_len, "reused from %s (a 128-token prefill took %.2fx its prediction)", from, ratio);
            if (from == path) /* etcd gets it for this cluster's restarts */
                keep(id, etcd, key, out, NULL);
            goto out;
        }
        TD_INFO("%s: the profile from %s is stale here (a 128-token prefill took %.2fx its prediction); measuring "
                "again", id, from, ratio);
    }
    if ((rc = eng_profile_measure(e, lo, hi, out)))
        goto out;
    snprintf(how, how_len, "measured");
    if (!td_process_stop_signal()) /* stopped meanwhile: etcd may be gone with whoever stopped it */
        keep(id, etcd, key, out, cached ? path : NULL);
out:
    if (lock >= 0)
        close(lock); /* the lock goes with it */
    td_etcd_destroy(etcd);
    return rc;
}
