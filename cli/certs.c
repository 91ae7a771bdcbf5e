/* certs.c — `tandem certs`: the cluster's CA and its processes' certificates
 * (common/certs.h), for a cluster of many hosts; `tandem up` makes throwaway
 * ones for itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/certs.h"
#include "common/log.h"

#define MAX_LIST 64

const char cli_certs_usage[] =
    "usage: tandem certs --dir DIR [--names N1,N2,...] [--hosts H1,H2,...] [--days D]\n"
    "  makes DIR/ca.pem + ca.key (kept if there: certificates can be added later) and, for every name,\n"
    "  DIR/NAME.pem + NAME.key signed by that CA, valid for localhost, 127.0.0.1 and every host given\n"
    "  (names default: router,prefill,decode,kvstore,etcd,client,node; days default: 365).\n"
    "  Point each process at its pair with cluster.tls_cert / cluster.tls_key and at DIR/ca.pem with\n"
    "  cluster.tls_ca; give etcd its pair with --cert-file/--key-file/--trusted-ca-file --client-cert-auth.\n";

/* Splits s (modified) at commas into out[]; the count, or -1 if too many. */
static int split(char *s, const char **out)
{
    int n = 0;
    for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
        if (n == MAX_LIST)
            return -1;
        out[n++] = tok;
    }
    return n;
}

int cli_certs(int argc, char **argv)
{
    const char *dir = NULL;
    char names_buf[1024] = "router,prefill,decode,kvstore,etcd,client,node", hosts_buf[4096] = "";
    int days = 365;
    for (int i = 0; i < argc; i += 2) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "tandem certs: %s needs a value\n%s", argv[i], cli_certs_usage);
            return 2;
        }
        if (!strcmp(argv[i], "--dir"))
            dir = v;
        else if (!strcmp(argv[i], "--names"))
            snprintf(names_buf, sizeof names_buf, "%s", v);
        else if (!strcmp(argv[i], "--hosts"))
            snprintf(hosts_buf, sizeof hosts_buf, "%s", v);
        else if (!strcmp(argv[i], "--days") && (days = atoi(v)) > 0 && days <= 36500)
            ;
        else {
            fprintf(stderr, "tandem certs: unknown or bad argument '%s %s'\n%s", argv[i], v, cli_certs_usage);
            return 2;
        }
    }
    if (!dir) {
        fprintf(stderr, "tandem certs: --dir is required\n%s", cli_certs_usage);
        return 2;
    }
    const char *names[MAX_LIST], *hosts[MAX_LIST];
    int nn = split(names_buf, names), nh = split(hosts_buf, hosts);
    if (nn < 1 || nh < 0) {
        fprintf(stderr, "tandem certs: --names needs 1 to %d names, --hosts at most %d hosts\n", MAX_LIST, MAX_LIST);
        return 2;
    }
    if (td_certs_make(dir, names, (size_t)nn, hosts, (size_t)nh, days))
        return 1; /* td_error said what */
    printf("%s: ca.pem", dir);
    for (int i = 0; i < nn; i++)
        printf(", %s.pem", names[i]);
    printf(" (keys beside them, 0600)\n");
    return 0;
}
