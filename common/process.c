/* process.c — see process.h. */
#define _GNU_SOURCE
#include "common/process.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/rpc.h"

static volatile sig_atomic_t g_stop_signal; /* set by the handler; read by td_process_stop_signal */

static void on_signal(int sig) { g_stop_signal = sig; }

void td_process_init(const char *component)
{
    td_log_init(component, TD_LOG_INFO, false);
    td_rpc_init();
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int td_process_stop_signal(void) { return (int)g_stop_signal; }

void td_process_run(void (*tick)(void *ctx), void *ctx)
{
    while (!g_stop_signal) {
        if (tick)
            tick(ctx);
        usleep(50 * 1000);
    }
}

struct td_member {
    td_etcd_t *etcd;
    char *key, *value;
    int64_t ttl_s, lease;
    atomic_bool lost;    /* set by the keep-alive thread */
    atomic_bool changed; /* set by the watch thread: the record was deleted or overwritten */
    _Atomic double away_at; /* when etcd was last found away (td_member_away_at) */
    td_etcd_watch_t *watch;
};

/* The record under its key is this member's own; anything else (a delete by
 * someone, a put of another value) is put right by td_member_tick. */
static void on_record(void *ctx, bool put, const td_etcd_kv_t *kv)
{
    td_member_t *m = ctx;
    if (strcmp(kv->key, m->key))
        return; /* another key under the same prefix ("decode-1" watches "decode-10" too) */
    if (!put || kv->value_len != strlen(m->value) || memcmp(kv->value, m->value, kv->value_len))
        atomic_store(&m->changed, true);
}

static void on_record_resync(void *ctx, const td_etcd_kvs_t *now)
{
    td_member_t *m = ctx;
    bool found = false;
    for (size_t i = 0; i < now->n; i++)
        if (!strcmp(now->kv[i].key, m->key)) {
            found = true;
            on_record(m, true, &now->kv[i]);
        }
    if (!found)
        atomic_store(&m->changed, true);
}

static void on_lease_lost(void *ctx)
{
    td_member_t *m = ctx;
    atomic_store(&m->away_at, td_now_s());
    atomic_store(&m->lost, true);
}

static td_status_t member_register(td_member_t *m)
{
    td_status_t rc = td_etcd_lease_grant(m->etcd, m->ttl_s, &m->lease);
    if (!rc)
        rc = td_etcd_put(m->etcd, m->key, m->value, strlen(m->value), m->lease);
    if (!rc)
        rc = td_etcd_keepalive_start(m->etcd, m->lease, m->ttl_s, on_lease_lost, m);
    return rc;
}

td_status_t td_cluster_tls(const td_config_t *cfg, td_rpc_tls_t *tls, const td_rpc_tls_t **out)
{
    *out = NULL;
    if (cfg->cluster.plaintext) {
        TD_WARN("cluster.plaintext is set: this process's internal RPCs and its etcd client run WITHOUT TLS or "
                "authentication; anyone who can reach their ports can read prompts, take KV memory and change "
                "the membership");
        return TD_OK;
    }
    const char *f[3] = {cfg->cluster.tls_ca, cfg->cluster.tls_cert, cfg->cluster.tls_key};
    static const char *const key[3] = {"cluster.tls_ca", "cluster.tls_cert", "cluster.tls_key"};
    for (int i = 0; i < 3; i++) {
        if (!f[i] || !f[i][0])
            return td_error(TD_ERR_CONFIG, "%s is not set: the internal planes are mutual TLS, every process needs "
                            "the cluster CA and its own certificate and key (`tandem certs` makes them; "
                            "`tandem up` makes throwaway ones), or cluster.plaintext: true", key[i]);
        if (access(f[i], R_OK))
            return td_error(TD_ERR_CONFIG, "%s: cannot read %s", key[i], f[i]);
    }
    *tls = (td_rpc_tls_t){.ca_file = f[0], .cert_file = f[1], .key_file = f[2]};
    *out = tls;
    return TD_OK;
}

td_status_t td_member_join(const char *endpoints, const td_rpc_tls_t *tls, const char *key, const char *value,
                           int64_t ttl_s, td_member_t **out, td_etcd_t **etcd)
{
    td_member_t *m = calloc(1, sizeof *m);
    if (!m || !(m->key = strdup(key)) || !(m->value = strdup(value))) {
        if (m)
            free(m->key);
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "membership: no memory");
    }
    m->ttl_s = ttl_s;
    td_status_t rc = td_etcd_connect(endpoints, tls, &m->etcd);
    if (!rc)
        rc = member_register(m);
    if (!rc)
        rc = td_etcd_watch_start(m->etcd, m->key, 0, on_record, on_record_resync, m, &m->watch);
    if (rc) {
        td_etcd_destroy(m->etcd);
        free(m->key);
        free(m->value);
        free(m);
        return rc;
    }
    if (etcd)
        *etcd = m->etcd;
    *out = m;
    return TD_OK;
}

void td_member_tick(td_member_t *m)
{
    if (m && atomic_exchange(&m->changed, false) && !atomic_load(&m->lost)) {
        /* deleted or overwritten while the lease lives: the record is put back under the same lease */
        td_status_t rc = td_etcd_put(m->etcd, m->key, m->value, strlen(m->value), m->lease);
        if (rc)
            atomic_store(&m->changed, true); /* tried again on the next tick */
        else
            TD_WARN("%s: the record was deleted or changed by someone else while its lease lived; put back",
                    m->key);
    }
    if (!m || !atomic_load(&m->lost))
        return;
    TD_WARN("%s: the etcd lease is lost; serving what runs here and registering again", m->key);
    td_etcd_keepalive_stop(m->etcd);
    atomic_store(&m->lost, false);
    double t0 = td_now_s();
    while (!g_stop_signal && member_register(m)) {
        atomic_store(&m->away_at, td_now_s());
        usleep(500 * 1000);
    }
    atomic_store(&m->away_at, td_now_s()); /* back: the others' leases lapsed too, and they are re-registering */
    if (!g_stop_signal)
        TD_INFO("%s: registered again after %.1f s", m->key, td_now_s() - t0);
}

double td_member_away_at(const td_member_t *m)
{
    return m ? atomic_load(&((td_member_t *)m)->away_at) : 0;
}

void td_member_leave(td_member_t *m)
{
    if (!m)
        return;
    td_etcd_watch_stop(m->watch);
    td_etcd_keepalive_stop(m->etcd);
    td_etcd_lease_revoke(m->etcd, m->lease);
    td_etcd_destroy(m->etcd);
    free(m->key);
    free(m->value);
    free(m);
}
