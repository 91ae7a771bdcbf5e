/* service.c — see service.h. */
#include "common/service.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"

typedef struct run {
    const td_service_t *s;
    td_member_t *member;
} run_t;

static void tick(void *ctx)
{
    run_t *r = ctx;
    td_member_tick(r->member);
    if (r->s->tick)
        r->s->tick(r->s->ctx);
}

int td_service_main(const td_service_t *s, int argc, char **argv)
{
    td_process_init(s->prog);
    int code = td_config_from_args(s->cfg, s->prog, s->section, s->procs, s->own, s->own_fn, s->own_ctx,
                                   s->usage, argc, argv);
    if (!code && ((s->configured && s->configured(s->ctx)) || td_cluster_tls(s->cfg, s->tls_files, s->tls))) {
        fprintf(stderr, "%s: %s\n", s->prog, td_last_error());
        code = 2;
    }
    if (code) {
        td_config_free(s->cfg);
        td_rpc_shutdown();
        return code;
    }
    run_t r = {.s = s};
    char key[256] = "", *value = NULL;
    code = 1;
    if (s->start(s->ctx, key, sizeof key, &value))
        goto out;
    td_status_t rc = td_member_join(s->cfg->etcd.endpoints, *s->tls, key, value, s->cfg->etcd.lease_ttl_s,
                                    &r.member, NULL);
    free(value);
    value = NULL;
    if (rc)
        goto out;
    if (s->registered)
        s->registered(s->ctx, r.member);
    td_process_run(tick, &r);
    TD_INFO("%s: stopping (signal %d)", s->prog, td_process_stop_signal());
    code = 0;
out:
    if (code && !td_process_stop_signal())
        fprintf(stderr, "%s: %s\n", s->prog, td_last_error());
    free(value);
    if (s->registered && r.member)
        s->registered(s->ctx, NULL);
    td_member_leave(r.member); /* first: no new work is placed here */
    if (!code && s->drain)
        s->drain(s->ctx);
    s->stop(s->ctx);
    td_config_free(s->cfg);
    td_rpc_shutdown();
    return code;
}
