/* up.c — `tandem up`: a whole cluster on this machine (DESIGN.md §2).
 *
 * Starts etcd (a private data dir, loopback ports), K kvstore nodes, the
 * router and P prefill + D decode workers (the config's counts; 1, 1 + 1 by
 * default), each as its own process (tandem-kvstore, tandem-router,
 * tandem-prefill, tandem-decode, found beside this binary). A kvstore node's
 * SSD tier (kvstore.ssd_mb) lives in kvstore.data_dir/kvstore-K when the
 * config names a data dir (kept: the next start is warm), else in the
 * cluster's throwaway dir. It supervises them: a child that dies is logged and started again
 * (after a short back-off that grows if it keeps dying). When the router
 * reports SERVING it prints the router's endpoint as HOST:PORT on stdout.
 * Ctrl-C / SIGTERM stops the children (workers drain), then etcd, and
 * removes the data dir. Extra worker flags: --worker-arg ARG (repeatable),
 * e.g. --worker-arg --threads --worker-arg 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "cli/cli.h"
#include "common/certs.h"
#include "common/config.h"
#include "common/log.h"
#include "common/rpc.h"
#include "tandem/v1/tandem.pb-c.h"

#define MAX_CHILDREN 64
#define MAX_EXTRA 32

typedef struct child {
    char name[32];
    char *argv[48];
    int argc;
    pid_t pid;
    double started, restart_at;
    int restarts;
} child_t;

static volatile sig_atomic_t g_stop;
static void on_stop(int sig)
{
    (void)sig;
    g_stop = 1;
}

/* The etcd binary: the first on PATH, else Debian's, else /usr/local/bin's. */
static void etcd_path(char *out, size_t n)
{
    const char *path = getenv("PATH");
    while (path && *path) {
        size_t len = strcspn(path, ":");
        if (len && (size_t)snprintf(out, n, "%.*s/etcd", (int)len, path) < n && !access(out, X_OK))
            return;
        path += len + (path[len] == ':');
    }
    snprintf(out, n, "%s", access("/usr/bin/etcd", X_OK) ? "/usr/local/bin/etcd" : "/usr/bin/etcd");
}

/* Free loopback ports for the cluster's listeners: every probe socket stays
 * bound until the last port is chosen, so the ports are distinct (one bound
 * and closed at a time may come back twice; a listener then cannot bind and
 * restarts on the same port forever). 0 or -1 with errno. */
static int free_ports(int *ports, int n)
{
    int fds[8];
    int got = 0, rc = 0;
    for (; got < n && got < 8; got++) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t l = sizeof a;
        fds[got] = socket(AF_INET, SOCK_STREAM, 0);
        if (fds[got] < 0 || bind(fds[got], (struct sockaddr *)&a, sizeof a) ||
            getsockname(fds[got], (struct sockaddr *)&a, &l)) {
            if (fds[got] >= 0)
                close(fds[got]);
            rc = -1;
            break;
        }
        ports[got] = ntohs(a.sin_port);
    }
    int err = errno;
    for (int i = 0; i < got; i++)
        close(fds[i]);
    errno = err;
    return rc;
}

static pid_t spawn(child_t *c)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0); /* a terminal's Ctrl-C reaches us; we stop the children in order */
        /* tandem up killed outright (SIGKILL, OOM) leaves no child behind: each
         * gets SIGTERM (and drains) when its supervisor dies */
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) || getppid() != parent)
            _exit(1);
        execv(c->argv[0], c->argv);
        fprintf(stderr, "tandem up: cannot run %s: %s\n", c->argv[0], strerror(errno));
        _exit(127);
    }
    c->pid = pid;
    c->started = td_now_s();
    return pid;
}

static void add_arg(child_t *c, const char *a)
{
    if (c->argc < 46)
        c->argv[c->argc++] = strdup(a);
    c->argv[c->argc] = NULL;
}

/* A child running binary `prog` of dir, with --config FILE when there is one. */
static void child_begin(child_t *c, const char *prog, const char *dir, const char *config)
{
    char bin[PATH_MAX + 32];
    snprintf(c->name, sizeof c->name, "%s", prog);
    snprintf(bin, sizeof bin, "%s/%s", dir, prog);
    add_arg(c, bin);
    if (config) {
        add_arg(c, "--config");
        add_arg(c, config);
    }
}

/* The certificate and key of process NAME: certdir's NAME.pem and NAME.key
 * (the ones tandem up made), or the config's cluster pair when certdir is NULL. */
static void pair_of(const td_config_t *cfg, const char *certdir, const char *name, char cert[PATH_MAX],
                    char key[PATH_MAX])
{
    if (certdir) {
        snprintf(cert, PATH_MAX, "%s/%s.pem", certdir, name);
        snprintf(key, PATH_MAX, "%s/%s.key", certdir, name);
    } else {
        snprintf(cert, PATH_MAX, "%s", cfg->cluster.tls_cert ? cfg->cluster.tls_cert : "");
        snprintf(key, PATH_MAX, "%s", cfg->cluster.tls_key ? cfg->cluster.tls_key : "");
    }
}

/* The internal planes' flags of a router or worker (they override the config's cluster section). */
static void add_cluster_tls(child_t *c, bool plaintext, const char *ca, const char *cert, const char *key)
{
    if (plaintext)
        return; /* the config says so, and the child reads the same config */
    const char *a[] = {"--cluster-ca", ca, "--cluster-cert", cert, "--cluster-key", key};
    for (size_t i = 0; i < sizeof a / sizeof *a; i++)
        add_arg(c, a[i]);
}

static bool router_serving(td_rpc_channel_t *ch)
{
    uint8_t *out = NULL;
    size_t n = 0;
    td_rpc_result_t res;
    bool ok = false;
    if (td_rpc_unary(ch, "/tandem.v1.Tandem/Health", "", 0, 1.0, NULL, &out, &n, &res) == TD_OK) {
        Tandem__V1__HealthResponse *h = tandem__v1__health_response__unpack(NULL, n, out);
        ok = h && h->status == TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING;
        if (h)
            tandem__v1__health_response__free_unpacked(h, NULL);
    }
    free(out);
    return ok;
}

const char cli_up_usage[] =
    "usage: tandem up [--config FILE] [--model PATH] [--prefill N] [--decode N] [--kvstores N] [--listen HOST:PORT]\n"
    "                 [--worker-arg ARG]... [--kvstore-arg ARG]...\n";

int cli_up(int argc, char **argv)
{
    const char *config = NULL, *model = NULL, *listen_at = NULL;
    const char *extra[MAX_EXTRA], *kv_extra[MAX_EXTRA];
    int n_extra = 0, n_kv_extra = 0;
    long np = -1, nd = -1, nkv = -1;
    for (int i = 0; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "tandem up: %s needs a value\n%s", argv[i], cli_up_usage);
            return 2;
        }
        if (!strcmp(argv[i], "--config"))
            config = v;
        else if (!strcmp(argv[i], "--model"))
            model = v;
        else if (!strcmp(argv[i], "--listen"))
            listen_at = v;
        else if (!strcmp(argv[i], "--prefill") || !strcmp(argv[i], "--decode")) {
            char *end;
            long n = strtol(v, &end, 10);
            if (*end || n < 1 || n > 16) {
                fprintf(stderr, "tandem up: %s needs a count in [1, 16], not '%s'\n", argv[i], v);
                return 2;
            }
            *(argv[i][2] == 'p' ? &np : &nd) = n;
        } else if (!strcmp(argv[i], "--kvstores")) {
            char *end;
            long n = strtol(v, &end, 10);
            if (*end || n < 0 || n > 16) {
                fprintf(stderr, "tandem up: --kvstores needs a count in [0, 16], not '%s'\n", v);
                return 2;
            }
            nkv = n;
        } else if (!strcmp(argv[i], "--worker-arg") && n_extra < MAX_EXTRA)
            extra[n_extra++] = v;
        else if (!strcmp(argv[i], "--kvstore-arg") && n_kv_extra < MAX_EXTRA)
            kv_extra[n_kv_extra++] = v;
        else {
            fprintf(stderr, "tandem up: unknown argument '%s'\n%s", argv[i], cli_up_usage);
            return 2;
        }
        i++;
    }
    td_config_t cfg;
    td_config_defaults(&cfg);
    if (config && td_config_load(&cfg, config)) {
        fprintf(stderr, "tandem up: %s\n", td_last_error());
        return 2;
    }
    if (np < 0)
        np = cfg.prefill.count ? cfg.prefill.count : 1;
    if (nd < 0)
        nd = cfg.decode.count ? cfg.decode.count : 1;
    if (nkv < 0)
        nkv = cfg.kvstore.count > 16 ? 16 : cfg.kvstore.count;
    static char model_buf[PATH_MAX];
    snprintf(model_buf, sizeof model_buf, "%s",
             model ? model : cfg.model.path && cfg.model.path[0] ? cfg.model.path : TD_DEFAULT_MODEL);
    model = model_buf;
    if (access(model, R_OK)) {
        fprintf(stderr, "tandem up: cannot read the model %s: %s\n", model, strerror(errno));
        td_config_free(&cfg);
        return 2;
    }
    /* the binaries beside this one */
    char self[PATH_MAX], dir[PATH_MAX];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) {
        fprintf(stderr, "tandem up: cannot find my own binary\n");
        return 1;
    }
    self[sl] = 0;
    snprintf(dir, sizeof dir, "%s", self);
    *strrchr(dir, '/') = 0;

    char base[] = "/tmp/tandem-up-XXXXXX";
    if (!mkdtemp(base)) {
        fprintf(stderr, "tandem up: cannot make a data dir: %s\n", strerror(errno));
        return 1;
    }
    static char datadir[64], certdir[64];
    snprintf(datadir, sizeof datadir, "%s/etcd", base);
    snprintf(certdir, sizeof certdir, "%s/tls", base);
    /* the internal planes: mutual TLS with the config's cluster CA and pair, or
     * (by default) a throwaway CA and a certificate per process made here */
    bool plaintext = cfg.cluster.plaintext, own_certs = !plaintext && !(cfg.cluster.tls_ca && cfg.cluster.tls_ca[0]);
    if (own_certs) {
        const char *names[3 * 16 + 3];
        char name_buf[3 * 16][32];
        size_t nn = 0;
        names[nn++] = "router";
        names[nn++] = "etcd";
        names[nn++] = "client";
        for (long k = 0; k < np + nd; k++) {
            snprintf(name_buf[k], sizeof name_buf[k], "%s-%ld", k < np ? "prefill" : "decode", k < np ? k : k - np);
            names[nn++] = name_buf[k];
        }
        for (long k = 0; k < nkv; k++) {
            snprintf(name_buf[np + nd + k], sizeof name_buf[0], "kvstore-%ld", k);
            names[nn++] = name_buf[np + nd + k];
        }
        if (td_certs_make(certdir, names, nn, NULL, 0, 30)) {
            fprintf(stderr, "tandem up: %s\n", td_last_error());
            return 1;
        }
    }
    static char ca_file[PATH_MAX];
    if (own_certs)
        snprintf(ca_file, sizeof ca_file, "%s/ca.pem", certdir);
    else if (!plaintext)
        snprintf(ca_file, sizeof ca_file, "%s", cfg.cluster.tls_ca);
    int ports[4]; /* etcd's client and peer ports, the router's, the HTTP API's */
    if (free_ports(ports, 4)) {
        fprintf(stderr, "tandem up: cannot find free loopback ports: %s\n", strerror(errno));
        return 1;
    }
    int cport = ports[0], pport = ports[1];
    const char *scheme = plaintext ? "http" : "https";
    char client[64], peer[64], cluster[96], etcd_ep[64], router_listen[128];
    snprintf(client, sizeof client, "%s://127.0.0.1:%d", scheme, cport);
    snprintf(peer, sizeof peer, "%s://127.0.0.1:%d", scheme, pport);
    snprintf(cluster, sizeof cluster, "tandem=%s", peer);
    snprintf(etcd_ep, sizeof etcd_ep, "127.0.0.1:%d", cport);
    if (listen_at)
        snprintf(router_listen, sizeof router_listen, "%s", listen_at);
    else if (cfg.router.listen && cfg.router.listen[0] && strcmp(cfg.router.listen, "127.0.0.1:50051"))
        snprintf(router_listen, sizeof router_listen, "%s", cfg.router.listen);
    else
        snprintf(router_listen, sizeof router_listen, "127.0.0.1:%d", ports[2]);
    /* the OpenAI HTTP API: the config's address, or a free loopback port for the default; "" turns it off */
    char http_listen[128];
    const char *hl = cfg.router.http_listen ? cfg.router.http_listen : "";
    if (hl[0] && strcmp(hl, "127.0.0.1:8000"))
        snprintf(http_listen, sizeof http_listen, "%s", hl);
    else if (hl[0])
        snprintf(http_listen, sizeof http_listen, "127.0.0.1:%d", ports[3]);
    else
        http_listen[0] = 0;

    static child_t kids[MAX_CHILDREN];
    int nk = 0;
    child_t *etcd = &kids[nk++];
    snprintf(etcd->name, sizeof etcd->name, "etcd");
    char etcd_bin[PATH_MAX];
    etcd_path(etcd_bin, sizeof etcd_bin);
    const char *eargs[] = {etcd_bin, "--name", "tandem", "--data-dir", datadir, "--listen-client-urls", client,
                           "--advertise-client-urls", client, "--listen-peer-urls", peer,
                           "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster,
                           "--initial-cluster-state", "new", "--log-level", "error", "--logger", "zap"};
    for (size_t i = 0; i < sizeof eargs / sizeof *eargs; i++)
        add_arg(etcd, eargs[i]);
    if (!plaintext) { /* clients and the peer port: a certificate the cluster CA signed, or no connection */
        char cert[PATH_MAX], key[PATH_MAX];
        pair_of(&cfg, own_certs ? certdir : NULL, "etcd", cert, key);
        const char *targs[] = {"--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca_file,
                               "--client-cert-auth", "--peer-cert-file", cert, "--peer-key-file", key,
                               "--peer-trusted-ca-file", ca_file, "--peer-client-cert-auth"};
        for (size_t i = 0; i < sizeof targs / sizeof *targs; i++)
            add_arg(etcd, targs[i]);
    }
    for (long k = 0; k < nkv && nk < MAX_CHILDREN; k++) {
        child_t *c = &kids[nk++];
        child_begin(c, "tandem-kvstore", dir, config);
        char name[32], kdir[PATH_MAX + 64];
        snprintf(name, sizeof name, "kvstore-%ld", k);
        add_arg(c, "--id");
        add_arg(c, name);
        add_arg(c, "--etcd");
        add_arg(c, etcd_ep);
        snprintf(kdir, sizeof kdir, "%s/%s", cfg.kvstore.data_dir && cfg.kvstore.data_dir[0] ? cfg.kvstore.data_dir : base,
                 name);
        add_arg(c, "--data-dir");
        add_arg(c, kdir);
        char cert[PATH_MAX], key[PATH_MAX];
        pair_of(&cfg, own_certs ? certdir : NULL, name, cert, key);
        add_cluster_tls(c, plaintext, ca_file, cert, key);
        for (int e = 0; e < n_kv_extra; e++)
            add_arg(c, kv_extra[e]);
    }
    child_t *router = &kids[nk++];
    child_begin(router, "tandem-router", dir, config);
    add_arg(router, "--model");
    add_arg(router, model);
    add_arg(router, "--listen");
    add_arg(router, router_listen);
    add_arg(router, "--http-listen");
    add_arg(router, http_listen);
    add_arg(router, "--etcd");
    add_arg(router, etcd_ep);
    char cert[PATH_MAX], key[PATH_MAX];
    pair_of(&cfg, own_certs ? certdir : NULL, "router", cert, key);
    add_cluster_tls(router, plaintext, ca_file, cert, key);
    for (long k = 0; k < np + nd && nk < MAX_CHILDREN; k++) {
        child_t *c = &kids[nk++];
        bool pre = k < np;
        child_begin(c, pre ? "tandem-prefill" : "tandem-decode", dir, config);
        add_arg(c, "--model");
        add_arg(c, model);
        add_arg(c, "--etcd");
        add_arg(c, etcd_ep);
        char name[32];
        snprintf(name, sizeof name, "%s-%ld", pre ? "prefill" : "decode", pre ? k : k - np);
        pair_of(&cfg, own_certs ? certdir : NULL, name, cert, key);
        add_cluster_tls(c, plaintext, ca_file, cert, key);
        if (pre && nkv) { /* each prefill worker's near node, round robin: where its hot blocks get copies */
            char near[32];
            snprintf(near, sizeof near, "kvstore-%ld", k % nkv);
            add_arg(c, "--kvstore-near");
            add_arg(c, near);
        }
        for (int e = 0; e < n_extra; e++)
            add_arg(c, extra[e]);
    }
    /* the readiness probe speaks the router's TLS when it has one: it trusts
     * tls_ca, else tls_client_ca, else the router's certificate itself
     * (self-signed); for mutual TLS it shows the router's own certificate */
    static char tls_files[3][PATH_MAX];
    td_rpc_tls_t probe_tls = {0};
    bool tls = cfg.router.tls_cert && cfg.router.tls_cert[0];
    if (tls) {
        bool mutual = cfg.router.tls_client_ca && cfg.router.tls_client_ca[0];
        bool ca = cfg.router.tls_ca && cfg.router.tls_ca[0];
        snprintf(tls_files[0], PATH_MAX, "%s",
                 ca ? cfg.router.tls_ca : mutual ? cfg.router.tls_client_ca : cfg.router.tls_cert);
        snprintf(tls_files[1], PATH_MAX, "%s", cfg.router.tls_cert);
        snprintf(tls_files[2], PATH_MAX, "%s", cfg.router.tls_key ? cfg.router.tls_key : "");
        probe_tls.ca_file = tls_files[0];
        if (mutual) {
            probe_tls.cert_file = tls_files[1];
            probe_tls.key_file = tls_files[2];
        }
    }
    td_config_free(&cfg);
    td_log_set_level(TD_LOG_OFF);
    td_rpc_init();
    td_rpc_channel_t *probe = NULL;
    if (td_rpc_channel_create(router_listen, tls ? &probe_tls : NULL, &probe)) {
        fprintf(stderr, "tandem up: cannot probe the router at %s: %s\n", router_listen, td_last_error());
        td_rpc_shutdown();
        return 1;
    }

    struct sigaction sa = {.sa_handler = on_stop};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    for (int i = 0; i < nk; i++)
        spawn(&kids[i]);
    fprintf(stderr, "tandem up: etcd on %s, %ld kvstore nodes, %ld prefill + %ld decode workers, model %s\n", etcd_ep,
            nkv, np, nd, model);
    if (plaintext)
        fprintf(stderr, "tandem up: WARNING: cluster.plaintext is set: etcd and the workers' RPCs take anyone\n");
    else if (own_certs)
        fprintf(stderr, "tandem up: mutual TLS on every internal plane; certificates in %s (ca.pem, and "
                        "client.pem + client.key for tools such as etcdctl)\n", certdir);
    else
        fprintf(stderr, "tandem up: mutual TLS on every internal plane (cluster CA %s)\n", ca_file);

    /* wait for the router to say SERVING, then print its endpoint */
    bool announced = false;
    double t_start = td_now_s();
    double next_probe = 0;
    while (!g_stop) {
        int st;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
            for (int i = 0; i < nk; i++)
                if (kids[i].pid == pid) {
                    double lived = td_now_s() - kids[i].started;
                    kids[i].pid = 0;
                    kids[i].restarts = lived > 30 ? 0 : kids[i].restarts + 1;
                    double backoff = 0.2 * (1 << (kids[i].restarts < 6 ? kids[i].restarts : 6));
                    kids[i].restart_at = td_now_s() + backoff;
                    if (WIFSIGNALED(st))
                        fprintf(stderr, "tandem up: %s (pid %d) was killed by signal %d; restarting in %.1f s\n",
                                kids[i].name, (int)pid, WTERMSIG(st), backoff);
                    else
                        fprintf(stderr, "tandem up: %s (pid %d) exited with %d; restarting in %.1f s\n", kids[i].name,
                                (int)pid, WEXITSTATUS(st), backoff);
                }
        for (int i = 0; i < nk; i++)
            if (!kids[i].pid && kids[i].restart_at <= td_now_s())
                spawn(&kids[i]);
        if (!announced && td_now_s() >= next_probe) {
            next_probe = td_now_s() + 0.2;
            if (router_serving(probe)) {
                announced = true;
                printf("%s\n", router_listen);
                fflush(stdout);
                if (http_listen[0])
                    fprintf(stderr, "tandem up: OpenAI-compatible HTTP API at http://%s/v1\n", http_listen);
                fprintf(stderr, "tandem up: serving at %s after %.1f s (Ctrl-C stops)\n", router_listen,
                        td_now_s() - t_start);
            }
        }
        usleep(50 * 1000);
    }
    fprintf(stderr, "tandem up: stopping\n");
    td_rpc_channel_destroy(probe);
    td_rpc_shutdown();
    /* router and workers first (they drain), etcd last; exit 1 if one of
     * them does not stop cleanly */
    bool unclean = false;
    for (int phase = 0; phase < 2; phase++) {
        for (int i = 0; i < nk; i++)
            if (kids[i].pid && (phase == 1) == (i == 0))
                kill(kids[i].pid, SIGTERM);
        double until = td_now_s() + (phase ? 5 : 35);
        for (;;) {
            bool any = false;
            for (int i = 0; i < nk; i++)
                if (kids[i].pid && (phase == 1) == (i == 0)) {
                    int st;
                    if (waitpid(kids[i].pid, &st, WNOHANG) == kids[i].pid) {
                        /* a clean stop is exit 0 (etcd: death by the SIGTERM we sent) */
                        bool clean = WIFSIGNALED(st) ? i == 0 && WTERMSIG(st) == SIGTERM : WEXITSTATUS(st) == 0;
                        if (!clean) {
                            fprintf(stderr, "tandem up: %s (pid %d) %s %d while stopping\n", kids[i].name,
                                    (int)kids[i].pid, WIFSIGNALED(st) ? "was killed by signal" : "exited with",
                                    WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
                            unclean = true;
                        }
                        kids[i].pid = 0;
                    } else {
                        any = true;
                    }
                }
            if (!any)
                break;
            if (td_now_s() > until) {
                for (int i = 0; i < nk; i++)
                    if (kids[i].pid && (phase == 1) == (i == 0)) {
                        fprintf(stderr, "tandem up: %s did not stop in time; killing it\n", kids[i].name);
                        unclean = true;
                        kill(kids[i].pid, SIGKILL);
                        waitpid(kids[i].pid, NULL, 0);
                        kids[i].pid = 0;
                    }
                break;
            }
            usleep(20 * 1000);
        }
    }
    char rm[PATH_MAX];
    snprintf(rm, sizeof rm, "rm -rf '%s'", base);
    if (system(rm)) {
    }
    for (int i = 0; i < nk; i++)
        for (int a = 0; a < kids[i].argc; a++)
            free(kids[i].argv[a]);
    return unclean ? 1 : 0;
}
