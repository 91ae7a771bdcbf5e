/* process.h — the skeleton every long-running tandem process shares (the
 * router and the prefill and decode workers today; the kvstore next):
 * logging and gRPC set up, SIGTERM/SIGINT turned into a stop request that the
 * main loop sees (drain, then exit 0), SIGPIPE ignored; and membership — a
 * record in etcd under a lease kept alive by a thread, registered again under
 * a new lease whenever the old one is lost (etcd unreachable or frozen past
 * the TTL), so that an etcd outage takes the process out of the membership,
 * never out of service. Settings come from common/config.h
 * (td_config_from_args). Signal state is the one process-wide flag a signal
 * handler may set; everything else lives in the caller's objects. */
#ifndef TD_PROCESS_H
#define TD_PROCESS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/config.h"
#include "common/etcd.h"
#include "common/rpc.h"
#include "common/status.h"

/* Logging as `component`, gRPC started, the signals above installed. */
void td_process_init(const char *component);
/* The signal that asked this process to stop, 0 while none has. */
int td_process_stop_signal(void);
/* Until a stop signal: tick(ctx) every 50 ms (tick may be NULL). */
void td_process_run(void (*tick)(void *ctx), void *ctx);

/* The internal planes' security from cfg's cluster section (config.h): *out
 * is tls, filled with the CA and this process's pair (mutual TLS), or NULL
 * when cluster.plaintext is set, which is logged as a warning naming who
 * is exposed. An error when neither is set or a file cannot be read. */
td_status_t td_cluster_tls(const td_config_t *cfg, td_rpc_tls_t *tls, const td_rpc_tls_t **out);

typedef struct td_member td_member_t;
/* Registers key = value under a lease of ttl_s seconds on etcd (connected
 * here; *etcd, when not NULL, receives the client for the caller's own use). */
td_status_t td_member_join(const char *endpoints, const td_rpc_tls_t *tls, const char *key, const char *value,
                           int64_t ttl_s, td_member_t **out, td_etcd_t **etcd);
/* From the main loop: registers again under a new lease if the lease was
 * lost (retrying every 0.5 s while etcd does not answer, until a stop signal). */
void td_member_tick(td_member_t *m);
/* When this member last found etcd away: its lease lost, a registration
 * that failed, or the registration that ended such a spell (0: never).
 * Any thread. The others' leases lapse in the same spell, so a peer that
 * leaves just after it is likely to register again at once. */
double td_member_away_at(const td_member_t *m);
/* Leaves the membership (the lease revoked) and closes the client. */
void td_member_leave(td_member_t *m);

#endif
