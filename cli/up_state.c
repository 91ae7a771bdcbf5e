/* up_state.c — see up_state.h. */
#define _GNU_SOURCE
#include "cli/up_state.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/ops.h"

#define RUN_PREFIX "tandem-up-"
#define LOCK_NAME ".lock"

void up_run_dir_remove(const char *dir)
{
    char cmd[PATH_MAX + 32];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) {
    }
}

td_status_t up_run_dir(char *base, size_t n, int *removed)
{
    *removed = 0;
    const char *tmp = "/tmp";
    DIR *d = opendir(tmp);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (strncmp(e->d_name, RUN_PREFIX, strlen(RUN_PREFIX)))
            continue;
        char dir[PATH_MAX], lock[PATH_MAX + 16];
        snprintf(dir, sizeof dir, "%s/%s", tmp, e->d_name);
        snprintf(lock, sizeof lock, "%s/" LOCK_NAME, dir);
        struct stat st;
        if (lstat(dir, &st) || !S_ISDIR(st.st_mode) || st.st_uid != geteuid())
            continue;
        int fd = open(lock, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0)
            continue; /* not one of ours, or still being made */
        if (!flock(fd, LOCK_EX | LOCK_NB)) { /* its tandem up is gone: nobody holds the lock */
            up_run_dir_remove(dir);
            ++*removed;
        }
        close(fd);
    }
    if (d)
        closedir(d);
    snprintf(base, n, "%s/" RUN_PREFIX "XXXXXX", tmp);
    if (!mkdtemp(base))
        return td_error(TD_ERR_IO, "tandem up: cannot make a run folder in %s: %s", tmp, strerror(errno));
    char lock[PATH_MAX + 16];
    snprintf(lock, sizeof lock, "%s/" LOCK_NAME, base);
    /* held (not close-on-exec: the children do not need it, but a lock that
     * outlives tandem up in a draining child still marks the folder in use) */
    int fd = open(lock, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB))
        return td_error(TD_ERR_IO, "tandem up: cannot lock %s: %s", lock, strerror(errno));
    return TD_OK;
}

static td_status_t copy_file(const char *from, const char *to, mode_t mode)
{
    FILE *in = fopen(from, "rb");
    int ofd = in ? open(to, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode) : -1;
    FILE *out = ofd >= 0 ? fdopen(ofd, "wb") : NULL;
    bool ok = in && out;
    char buf[8192];
    size_t k;
    while (ok && (k = fread(buf, 1, sizeof buf, in)) > 0)
        ok = fwrite(buf, 1, k, out) == k;
    ok = ok && !ferror(in);
    if (in)
        fclose(in);
    if (out)
        ok = !fclose(out) && ok;
    else if (ofd >= 0)
        close(ofd);
    return ok ? TD_OK : td_error(TD_ERR_IO, "tandem up: cannot copy %s to %s: %s", from, to, strerror(errno));
}

td_status_t up_client_dir(const char *base, const char *certdir, char *out, size_t n)
{
    snprintf(out, n, "%s/client", base);
    if (mkdir(out, 0700) && errno != EEXIST)
        return td_error(TD_ERR_IO, "tandem up: cannot make %s: %s", out, strerror(errno));
    static const char *const files[] = {"ca.pem", "client.pem", "client.key"};
    for (int i = 0; i < 3; i++) {
        char from[PATH_MAX], to[PATH_MAX];
        snprintf(from, sizeof from, "%s/%s", certdir, files[i]);
        snprintf(to, sizeof to, "%s/%s", out, files[i]);
        td_status_t rc = copy_file(from, to, i == 2 ? 0600 : 0644);
        if (rc)
            return rc;
    }
    return TD_OK;
}

td_status_t up_admin_key(const char *base, char *key_file, char *keys_file, size_t n)
{
    unsigned char raw[24], hash[32];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
        return td_error(TD_ERR_IO, "tandem up: getrandom failed: %s", strerror(errno));
    char key[4 + 2 * sizeof raw + 1] = "tdk-";
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(key + 4 + 2 * i, 3, "%02x", raw[i]);
    SHA256((const unsigned char *)key, strlen(key), hash);
    snprintf(key_file, n, "%s/admin.key", base);
    snprintf(keys_file, n, "%s/admin.keys", base);
    int kfd = open(key_file, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int hfd = open(keys_file, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    char line[160];
    int len = 0;
    for (int i = 0; i < 32; i++)
        len += snprintf(line + len, sizeof line - (size_t)len, "%02x", hash[i]);
    len += snprintf(line + len, sizeof line - (size_t)len, " admin 0 0\n");
    bool ok = kfd >= 0 && hfd >= 0 && dprintf(kfd, "%s\n", key) > 0 && write(hfd, line, (size_t)len) == len;
    if (kfd >= 0)
        close(kfd);
    if (hfd >= 0)
        close(hfd);
    return ok ? TD_OK : td_error(TD_ERR_IO, "tandem up: cannot write %s: %s", key_file, strerror(errno));
}

/* Who may read and write what in etcd, by certificate role. Every role that
 * talks to etcd reads the cluster's keys; each writes only its own: a worker
 * its record and profiles, a store node its record, a node agent its node's
 * record and the seed of the ops config, routers everything (the ops config,
 * the planner's decisions and election, their records); a client (etcdctl,
 * tandem status) and the etcd server's own certificate write nothing. */
static const td_etcd_grant_t grants[] = {
    {"router", "/tandem/", true, true},
    {"admin", "/tandem/", true, true},
    {"node", "/tandem/", true, false},
    {"node", TD_OPS_NODES_PREFIX, true, true},
    {"node", TD_OPS_KEY, false, true},
    {"prefill", "/tandem/", true, false},
    {"prefill", "/tandem/workers/prefill/", true, true},
    {"prefill", "/tandem/profiles/", true, true},
    {"decode", "/tandem/", true, false},
    {"decode", "/tandem/workers/decode/", true, true},
    {"decode", "/tandem/profiles/", true, true},
    {"kvstore", "/tandem/", true, false},
    {"kvstore", "/tandem/kvstores/", true, true},
    {"client", "/tandem/", true, false},
};

td_status_t up_etcd_auth(const char *endpoint, const td_rpc_tls_t *tls, const char *certdir, double wait_s)
{
    /* the users: every certificate of the folder (NAME.pem, the CA's aside) */
    char *users[128];
    size_t nu = 0;
    DIR *d = opendir(certdir);
    struct dirent *e;
    while (d && (e = readdir(d)) && nu < 128) {
        size_t len = strlen(e->d_name);
        if (len > 4 && !strcmp(e->d_name + len - 4, ".pem") && strcmp(e->d_name, "ca.pem"))
            users[nu++] = strndup(e->d_name, len - 4);
    }
    if (d)
        closedir(d);
    td_etcd_t *etcd = NULL;
    td_status_t rc = td_etcd_connect(endpoint, tls, &etcd);
    /* etcd is starting: the first call waits for it */
    double until = td_now_s() + wait_s;
    td_etcd_kvs_t kvs = {0};
    while (!rc && (rc = td_etcd_get(etcd, "/tandem/", true, &kvs)) && td_now_s() < until)
        usleep(100 * 1000);
    td_etcd_kvs_free(&kvs);
    if (!rc)
        rc = td_etcd_auth_enable(etcd, grants, sizeof grants / sizeof *grants, (const char *const *)users, nu);
    td_etcd_destroy(etcd);
    for (size_t i = 0; i < nu; i++)
        free(users[i]);
    return rc ? td_error(rc, "tandem up: etcd's access control: %s", td_last_error()) : TD_OK;
}
