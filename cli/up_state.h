/* up_state.h — what `tandem up` keeps on disk and the access it sets up:
 * its run folder (locked while it lives, removed by the next start when it
 * died without cleaning up), the folder it hands to tools (the CA and the
 * client pair only), the administrator key of its router, and etcd's own
 * access control (a role per certificate role). */
#ifndef CLI_UP_STATE_H
#define CLI_UP_STATE_H

#include <stddef.h>

#include "common/rpc.h"
#include "common/status.h"

/* Removes the run folders of earlier runs of this user that no process
 * holds any more (their tandem up was killed: SIGKILL, OOM), then makes this
 * run's (mode 0700) into base (n bytes) and holds its lock until exit.
 * Returns how many stale folders were removed in *removed. */
td_status_t up_run_dir(char *base, size_t n, int *removed);

/* Removes a run folder (at the end of a run, or a start that failed). */
void up_run_dir_remove(const char *base);

/* base/client: ca.pem, client.pem and client.key copied from certdir —
 * what etcdctl or grpcurl need, without the CA's key or another role's. */
td_status_t up_client_dir(const char *base, const char *certdir, char *out, size_t n);

/* A fresh administrator key: base/admin.key (the key, 0600) and
 * base/admin.keys (its router.admin_keys line). */
td_status_t up_admin_key(const char *base, char *key_file, char *keys_file, size_t n);

/* etcd's access control on the fresh etcd at endpoint (waited for up to
 * wait_s): a user per certificate in certdir (its CN, the file name), each
 * with its role's rights (cli/up_state.c's table), then auth enabled. */
td_status_t up_etcd_auth(const char *endpoint, const td_rpc_tls_t *tls, const char *certdir, double wait_s);

#endif
