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
 * e.g. --worker-arg --threads --worker-arg 1.
 *
 * It is also the node agent (DESIGN.md §7): it registers this node in etcd
 * (TD_OPS_NODES_PREFIX), seeds the ops config with its counts when there is
 * none (common/ops.h), and from then on runs this node's share of the
 * planner's desired counts: it starts workers, stops them (each drains), or
 * flips one from a role to the other (drained, then started in the other
 * role in its slot). `tandem up --join ETCD` is the agent alone, for the
 * other hosts of a cluster: no etcd and no router, the kvstore nodes of its
 * config, and its share of the workers; --address names the address its
 * processes bind and advertise, --certs the folder of the role
 * certificates (`tandem certs`: ca.pem, prefill, decode, kvstore, client). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
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
#include "common/ops.h"
#include "common/process.h"
#include "common/rpc.h"
#include "cli/up_state.h"
#include "router/placement.h"
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
    bool used;     /* the slot holds a process (running, or to be started again) */
    char role;     /* a worker's: 'p' or 'd'; 0 for the others */
    bool retiring; /* the agent stopped it (it drains): not started again */
    char flip_to;  /* once it has drained, the role its slot starts in (0: none) */
    bool colocated; /* a decode worker started with decode.colocated */
    double retired_at;
} child_t;

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

/* The kernel's range of local ports for outgoing connections (ip_local_port_range). */
static void ephemeral_range(int *lo, int *hi)
{
    *lo = 32768, *hi = 60999; /* Linux's default */
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (!f)
        return;
    int a, b;
    if (fscanf(f, "%d %d", &a, &b) == 2 && a > 0 && b >= a && b <= 65535)
        *lo = a, *hi = b;
    fclose(f);
}

/* Binds a probe socket to address:port (0: any port); its fd and the port, or -1. */
static int probe_port(const char *address, int port, int *got)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, address, &a.sin_addr);
    socklen_t l = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &l)) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    *got = ntohs(a.sin_port);
    return fd;
}

/* Free ports of address for the cluster's listeners, drawn at random outside
 * the kernel's range for outgoing connections (below it from 10000, or above
 * it where there is more room). A port from that range, which binding to port
 * 0 gives, can be taken by any process's outgoing connection before the
 * listener binds it; the listener then restarts on it forever (seen in CI:
 * the router's HTTP port). Every probe socket stays bound until the last port
 * is chosen, so the ports are distinct. Where no drawn port binds, port 0's.
 * 0 or -1 with errno. */
static int free_ports(const char *address, int *ports, int n)
{
    int fds[8], got = 0, rc = 0, lo, hi;
    ephemeral_range(&lo, &hi);
    const int below = lo - 10000, above = 65535 - hi, room = below > above ? below : above;
    const int first = below > above ? 10000 : hi + 1;
    unsigned seed = (unsigned)time(NULL) ^ ((unsigned)getpid() << 16);
    for (; got < n && got < 8; got++) {
        fds[got] = -1;
        for (int t = 0; t < 200 && room >= 1000 && fds[got] < 0; t++)
            fds[got] = probe_port(address, first + rand_r(&seed) % room, &ports[got]);
        if (fds[got] < 0 && (fds[got] = probe_port(address, 0, &ports[got])) < 0) {
            rc = -1;
            break;
        }
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

static void child_clear(child_t *c)
{
    for (int a = 0; a < c->argc; a++)
        free(c->argv[a]);
    memset(c, 0, sizeof *c);
}

/* A child running binary `prog` of dir, with --config FILE when there is one. */
static void child_begin(child_t *c, const char *prog, const char *dir, const char *config)
{
    char bin[PATH_MAX + 32];
    child_clear(c);
    c->used = true;
    snprintf(c->name, sizeof c->name, "%s", prog);
    snprintf(bin, sizeof bin, "%s/%s", dir, prog);
    add_arg(c, bin);
    if (config) {
        add_arg(c, "--config");
        add_arg(c, config);
    }
}

/* The certificate and key of process NAME: certdir's NAME.pem and NAME.key
 * (the ones tandem up made, or --certs), or the config's cluster pair when
 * certdir is NULL. */
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

/* Whether the router serves (SERVING), and the workers it has of each role
 * (from its detail; -1 when it does not say). */
static bool router_serving(td_rpc_channel_t *ch, int *prefill, int *decode)
{
    uint8_t *out = NULL;
    size_t n = 0;
    td_rpc_result_t res;
    bool ok = false;
    *prefill = *decode = -1;
    if (td_rpc_unary(ch, "/tandem.v1.Tandem/Health", "", 0, 1.0, NULL, &out, &n, &res) == TD_OK) {
        Tandem__V1__HealthResponse *h = tandem__v1__health_response__unpack(NULL, n, out);
        ok = h && h->status == TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING;
        json_t *j = h && h->detail ? json_loads(h->detail, 0, NULL) : NULL;
        json_t *p = json_object_get(j, "prefill_workers"), *d = json_object_get(j, "decode_workers");
        if (json_is_integer(p) && json_is_integer(d))
            *prefill = (int)json_integer_value(p), *decode = (int)json_integer_value(d);
        json_decref(j);
        if (h)
            tandem__v1__health_response__free_unpacked(h, NULL);
    }
    free(out);
    return ok;
}

/* ---------------------------------------------------------------- the node agent */

typedef struct agent {
    pthread_mutex_t mu;
    uint32_t want_p, want_d; /* this node's share (under mu) */
    uint32_t all_p, all_d;   /* the cluster's counts, every node's shares (under mu) */
    bool colocated;          /* the decode workers serve whole requests (the planner's record) */
    bool known;              /* want_* hold a share (the start-up counts, then the planner's) */
    char why[640];           /* the planner's reason behind it */
    /* fixed before the thread starts */
    char etcd_ep[160], node[64], address[64];
    td_rpc_tls_t tls;
    bool plaintext, run_workers, seed, seed_colocated;
    uint32_t seed_p, seed_d;
    pthread_t thread;
} agent_t;

/* The ops config when etcd has none: fixed counts (this node's start-up). */
static void seed_ops(agent_t *a, td_etcd_t *e)
{
    td_etcd_kvs_t kvs = {0};
    if (td_etcd_get(e, TD_OPS_KEY, false, &kvs))
        return;
    bool absent = !kvs.n;
    td_etcd_kvs_free(&kvs);
    a->seed = false;
    if (!absent)
        return;
    char text[256];
    if (a->seed_colocated)
        snprintf(text, sizeof text, "models: [{name: \"*\", colocated: true, decode: %u}]\n", a->seed_d);
    else
        snprintf(text, sizeof text, "models: [{name: \"*\", prefill: %u, decode: %u}]\n", a->seed_p, a->seed_d);
    td_ops_t *ops = NULL;
    char *canon = NULL;
    if (td_ops_parse(text, strlen(text), "tandem up", &ops) || td_ops_format(ops, &canon) ||
        td_etcd_put(e, TD_OPS_KEY, canon, strlen(canon), 0)) {
        fprintf(stderr, "tandem up: cannot seed the ops config: %s\n", td_last_error());
        a->seed = true; /* again on the next look */
    }
    td_ops_free(ops);
    free(canon);
}

/* One look: the planner's counts and the nodes that share them. */
static void agent_look(agent_t *a, td_etcd_t *e)
{
    td_etcd_kvs_t d = {0}, nodes = {0};
    if (td_etcd_get(e, TD_OPS_DESIRED_KEY, false, &d) || !d.n ||
        td_etcd_get(e, TD_OPS_NODES_PREFIX, true, &nodes)) {
        td_etcd_kvs_free(&d);
        return;
    }
    td_ops_desired_t want;
    if (td_ops_desired_parse((const char *)d.kv[0].value, d.kv[0].value_len, &want)) {
        td_etcd_kvs_free(&d);
        td_etcd_kvs_free(&nodes);
        return;
    }
    td_etcd_kvs_free(&d);
    const char *names[256];
    size_t n = 0;
    for (size_t i = 0; i < nodes.n && n < 256; i++)
        names[n++] = nodes.kv[i].key + strlen(TD_OPS_NODES_PREFIX);
    uint32_t p = 0, dd = 0;
    td_ops_share(&want, names, n, a->node, &p, &dd);
    td_etcd_kvs_free(&nodes);
    if (!a->run_workers)
        p = dd = 0;
    pthread_mutex_lock(&a->mu);
    if (!a->known || a->want_p != p || a->want_d != dd || a->colocated != want.colocated)
        fprintf(stderr, "tandem up: node %s runs %u prefill + %u %sdecode of the cluster's %u + %u (%s)\n", a->node,
                p, dd, want.colocated ? "colocated " : "", want.prefill, want.decode, want.reason);
    a->want_p = p;
    a->want_d = dd;
    a->all_p = want.prefill;
    a->all_d = want.decode;
    a->colocated = want.colocated;
    a->known = true;
    snprintf(a->why, sizeof a->why, "%s", want.reason);
    pthread_mutex_unlock(&a->mu);
}

/* Every 0.5 s until a stop signal: this node's record (under a lease; only
 * a node that runs workers has one), the seed, the share. etcd being away
 * leaves the share as it was. */
static void *agent_thread(void *arg)
{
    agent_t *a = arg;
    const td_rpc_tls_t *tls = a->plaintext ? NULL : &a->tls;
    td_etcd_t *e = NULL;
    td_member_t *member = NULL;
    char key[160], value[256];
    snprintf(key, sizeof key, "%s%s", TD_OPS_NODES_PREFIX, a->node);
    snprintf(value, sizeof value, "{\"name\": \"%s\", \"address\": \"%s\", \"pid\": %d}", a->node, a->address,
             (int)getpid());
    while (!td_process_stop_signal()) {
        if (!e && td_etcd_connect(a->etcd_ep, tls, &e))
            e = NULL;
        if (e && a->run_workers && !member && td_member_join(a->etcd_ep, tls, key, value, 3, &member, NULL))
            member = NULL;
        td_member_tick(member);
        if (e && a->seed)
            seed_ops(a, e);
        if (e)
            agent_look(a, e);
        usleep(500 * 1000);
    }
    td_member_leave(member); /* the other nodes take this one's share at once */
    td_etcd_destroy(e);
    return NULL;
}

/* ---------------------------------------------------------------- tandem up */

typedef struct up {
    char dir[PATH_MAX];          /* the binaries */
    const char *config, *model, *etcd_ep, *address;
    const char *certdir, *ca_file; /* certdir NULL: the config's cluster pair */
    const td_config_t *cfg;
    bool plaintext;
    long nkv;
    const char **extra;
    int n_extra;
    int serial[2]; /* workers started so far, per role: their names */
    bool colocated; /* decode workers start with decode.colocated (the agent's last look) */
} up_t;

/* Slot c becomes a worker of role ('p' or 'd'). */
static void worker_child(up_t *u, child_t *c, char role)
{
    bool pre = role == 'p';
    int k = u->serial[!pre]++;
    child_begin(c, pre ? "tandem-prefill" : "tandem-decode", u->dir, u->config);
    c->role = role;
    snprintf(c->name, sizeof c->name, "%s-%d", pre ? "prefill" : "decode", k);
    add_arg(c, "--model");
    add_arg(c, u->model);
    add_arg(c, "--etcd");
    add_arg(c, u->etcd_ep);
    char listen[96], cert[PATH_MAX], key[PATH_MAX];
    snprintf(listen, sizeof listen, "%s:0", u->address);
    add_arg(c, "--listen");
    add_arg(c, listen);
    add_arg(c, "--metrics-listen"); /* a free port, in its etcd record */
    add_arg(c, listen);
    pair_of(u->cfg, u->certdir, pre ? "prefill" : "decode", cert, key);
    add_cluster_tls(c, u->plaintext, u->ca_file, cert, key);
    const char *devs = pre ? u->cfg->prefill.device : u->cfg->decode.device;
    const unsigned tp = pre ? u->cfg->prefill.tp : u->cfg->decode.tp;
    char dev[256];
    if (strchr(devs, ',') && td_device_group(devs, (unsigned)k, tp, dev, sizeof dev)) { /* validated with the config */
        add_arg(c, "--device");
        add_arg(c, dev);
    }
    /* a decode worker prefills whole requests in colocated mode, and always under decode.colocated */
    c->colocated = !pre && (u->colocated || u->cfg->decode.colocated);
    if (!pre && u->colocated) {
        add_arg(c, "--colocated");
        add_arg(c, "true");
    }
    if (pre && u->nkv) { /* each prefill worker's near node, round robin: where its hot blocks get copies */
        char near[32];
        snprintf(near, sizeof near, "kvstore-%ld", k % u->nkv);
        add_arg(c, "--kvstore-near");
        add_arg(c, near);
    }
    for (int e = 0; e < u->n_extra; e++)
        add_arg(c, u->extra[e]);
}

/* The youngest running worker of role that is not retiring, or NULL. */
static child_t *youngest(child_t *kids, int nk, char role)
{
    child_t *best = NULL;
    for (int i = 0; i < nk; i++)
        if (kids[i].used && kids[i].role == role && !kids[i].retiring && (!best || kids[i].started > best->started))
            best = &kids[i];
    return best;
}

static void child_ended(up_t *u, child_t *c, int st);

/* Brings the workers to the agent's share: at most one change per role a call. */
static void reconcile(up_t *u, agent_t *a, child_t *kids, int *nk)
{
    pthread_mutex_lock(&a->mu);
    bool known = a->known;
    uint32_t want[2] = {a->want_p, a->want_d};
    u->colocated = a->colocated;
    pthread_mutex_unlock(&a->mu);
    if (!known)
        return;
    /* decode workers of the other mode (the ops config's colocated changed) drain and stop; new ones replace them.
     * Under decode.colocated every decode worker is of both: the mode is only whether prefill workers run */
    bool colocated = u->colocated || u->cfg->decode.colocated;
    for (int i = 0; i < *nk; i++)
        if (kids[i].used && kids[i].role == 'd' && !kids[i].retiring && kids[i].colocated != colocated) {
            kids[i].retiring = true;
            kids[i].retired_at = td_now_s();
            fprintf(stderr, "tandem up: %s (pid %d) drains and stops: decode workers are now %scolocated\n",
                    kids[i].name, (int)kids[i].pid, u->colocated ? "" : "not ");
            if (kids[i].pid)
                kill(kids[i].pid, SIGTERM);
            else
                child_ended(u, &kids[i], 0);
        }
    uint32_t have[2] = {0, 0}; /* counting the flips under way as their new role */
    for (int i = 0; i < *nk; i++)
        if (kids[i].used && kids[i].role && (!kids[i].retiring || kids[i].flip_to))
            have[(kids[i].flip_to ? kids[i].flip_to : kids[i].role) == 'd']++;
    static const char roles[2] = {'p', 'd'};
    for (int r = 0; r < 2; r++) {
        if (have[r] <= want[r])
            continue;
        child_t *c = youngest(kids, *nk, roles[r]);
        if (!c)
            continue;
        c->retiring = true;
        c->retired_at = td_now_s();
        if (have[!r] < want[!r]) { /* a flip: this one drains, then starts in the other role */
            c->flip_to = roles[!r];
            have[!r]++;
        }
        have[r]--;
        fprintf(stderr, "tandem up: %s (pid %d) drains%s\n", c->name, (int)c->pid,
                c->flip_to ? c->flip_to == 'p' ? ", then becomes a prefill worker" : ", then becomes a decode worker"
                           : " and stops");
        if (c->pid)
            kill(c->pid, SIGTERM);
        else /* between restarts: nothing to drain */
            child_ended(u, c, 0);
    }
    for (int r = 0; r < 2; r++)
        while (have[r] < want[r]) {
            child_t *c = NULL;
            for (int i = 0; i < *nk && !c; i++)
                if (!kids[i].used)
                    c = &kids[i];
            if (!c && *nk < MAX_CHILDREN)
                c = &kids[(*nk)++];
            if (!c)
                break;
            worker_child(u, c, roles[r]);
            spawn(c);
            fprintf(stderr, "tandem up: %s (pid %d) starts\n", c->name, (int)c->pid);
            have[r]++;
        }
}

/* A child ended: restarted after a back-off, or (retiring) its slot freed or flipped. */
static void child_ended(up_t *u, child_t *c, int st)
{
    pid_t pid = c->pid;
    c->pid = 0;
    if (c->retiring) {
        double took = td_now_s() - c->retired_at;
        char was[sizeof c->name];
        memcpy(was, c->name, sizeof was);
        if (c->flip_to) {
            worker_child(u, c, c->flip_to);
            spawn(c);
            fprintf(stderr, "tandem up: %s drained in %.1f s; now %s (pid %d)\n", was, took, c->name, (int)c->pid);
        } else {
            fprintf(stderr, "tandem up: %s drained and stopped in %.1f s\n", was, took);
            child_clear(c);
        }
        return;
    }
    double lived = td_now_s() - c->started;
    c->restarts = lived > 30 ? 0 : c->restarts + 1;
    double backoff = 0.2 * (1 << (c->restarts < 6 ? c->restarts : 6));
    c->restart_at = td_now_s() + backoff;
    if (WIFSIGNALED(st))
        fprintf(stderr, "tandem up: %s (pid %d) was killed by signal %d; restarting in %.1f s\n", c->name, (int)pid,
                WTERMSIG(st), backoff);
    else
        fprintf(stderr, "tandem up: %s (pid %d) exited with %d; restarting in %.1f s\n", c->name, (int)pid,
                WEXITSTATUS(st), backoff);
}

const char cli_up_usage[] =
    "usage: tandem up [--config FILE] [--model PATH] [--prefill N] [--decode N | --colocated N] [--kvstores N]\n"
    "                 [--listen HOST:PORT]\n"
    "                 [--address IP] [--node NAME] [--certs DIR] [--worker-arg ARG]... [--kvstore-arg ARG]...\n"
    "       tandem up --join ETCD_HOST:PORT [--config FILE] [--model PATH] [--kvstores N] [--address IP]\n"
    "                 [--node NAME] [--certs DIR] [--run-workers yes|no] [--worker-arg ARG]...\n"
    "  --colocated N: no prefill workers; N decode workers that each serve whole requests (decode.colocated);\n"
    "  --address: the address this node's processes bind and advertise (default 127.0.0.1);\n"
    "  --certs: ca.pem and the role pairs (tandem certs: router, etcd, client, prefill, decode, kvstore)\n";

/* A count flag's value, from lo to 16; false (said on stderr) otherwise. */
static bool count_arg(const char *flag, const char *v, long lo, long *out)
{
    char *end;
    long n = strtol(v, &end, 10);
    if (*end || !*v || n < lo || n > 16) {
        fprintf(stderr, "tandem up: %s needs a count in [%ld, 16], not '%s'\n", flag, lo, v);
        return false;
    }
    *out = n;
    return true;
}

/* What the flags ask for. */
typedef struct up_flags {
    const char *config, *model, *listen_at, *join, *address, *node, *certs_dir;
    bool run_workers, colocated, decode_given;
    const char *extra[MAX_EXTRA], *kv_extra[MAX_EXTRA];
    int n_extra, n_kv_extra;
    long np, nd, nkv; /* -1: the config's */
} up_flags_t;

/* Parses the flags into f; 0, or 2 after naming a usage error on stderr. */
static int up_parse(int argc, char **argv, up_flags_t *f)
{
    *f = (up_flags_t){.address = "127.0.0.1", .run_workers = true, .np = -1, .nd = -1, .nkv = -1};
    for (int i = 0; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "tandem up: %s needs a value\n%s", argv[i], cli_up_usage);
            return 2;
        }
        if (!strcmp(argv[i], "--config"))
            f->config = v;
        else if (!strcmp(argv[i], "--model"))
            f->model = v;
        else if (!strcmp(argv[i], "--listen"))
            f->listen_at = v;
        else if (!strcmp(argv[i], "--join"))
            f->join = v;
        else if (!strcmp(argv[i], "--node"))
            f->node = v;
        else if (!strcmp(argv[i], "--certs"))
            f->certs_dir = v;
        else if (!strcmp(argv[i], "--address")) {
            struct in_addr ia;
            if (inet_pton(AF_INET, v, &ia) != 1) {
                fprintf(stderr, "tandem up: --address needs an IPv4 address, not '%s'\n", v);
                return 2;
            }
            f->address = v;
        } else if (!strcmp(argv[i], "--run-workers")) {
            if (strcmp(v, "yes") && strcmp(v, "no")) {
                fprintf(stderr, "tandem up: --run-workers needs yes or no, not '%s'\n", v);
                return 2;
            }
            f->run_workers = !strcmp(v, "yes");
        } else if (!strcmp(argv[i], "--prefill") || !strcmp(argv[i], "--decode")) {
            if (!count_arg(argv[i], v, 1, argv[i][2] == 'p' ? &f->np : &f->nd))
                return 2;
            f->decode_given |= argv[i][2] == 'd';
        } else if (!strcmp(argv[i], "--colocated")) {
            if (!count_arg(argv[i], v, 1, &f->nd))
                return 2;
            f->colocated = true;
        } else if (!strcmp(argv[i], "--kvstores")) {
            if (!count_arg(argv[i], v, 0, &f->nkv))
                return 2;
        } else if (!strcmp(argv[i], "--worker-arg") && f->n_extra < MAX_EXTRA)
            f->extra[f->n_extra++] = v;
        else if (!strcmp(argv[i], "--kvstore-arg") && f->n_kv_extra < MAX_EXTRA)
            f->kv_extra[f->n_kv_extra++] = v;
        else {
            fprintf(stderr, "tandem up: unknown argument '%s'\n%s", argv[i], cli_up_usage);
            return 2;
        }
        i++;
    }
    if (f->colocated && f->np >= 0) {
        fprintf(stderr, "tandem up: --colocated runs no prefill workers; it takes no --prefill\n");
        return 2;
    }
    if (f->colocated && f->decode_given) { /* both name the decode workers' count: which one was meant is not known */
        fprintf(stderr, "tandem up: --colocated N is the count of decode workers; it takes no --decode\n");
        return 2;
    }
    if (f->join && (f->np > 0 || f->nd > 0 || f->listen_at)) {
        fprintf(stderr, "tandem up: --join takes its workers from the planner (tandem scale), not --prefill, "
                        "--decode or --listen\n");
        return 2;
    }
    return 0;
}

/* Stops the children: router and workers first (they drain, 35 s), etcd
 * last (5 s); one that does not stop in time is killed. True when one of
 * them did not stop cleanly. */
static bool stop_children(child_t *kids, int nk, const child_t *etcd)
{
    bool unclean = false;
    for (int phase = 0; phase < 2; phase++) {
        for (int i = 0; i < nk; i++)
            if (kids[i].pid && (phase == 1) == (&kids[i] == etcd))
                kill(kids[i].pid, SIGTERM);
        double until = td_now_s() + (phase ? 5 : 35);
        for (;;) {
            bool any = false;
            for (int i = 0; i < nk; i++)
                if (kids[i].pid && (phase == 1) == (&kids[i] == etcd)) {
                    int st;
                    if (waitpid(kids[i].pid, &st, WNOHANG) == kids[i].pid) {
                        /* a clean stop is exit 0 (etcd: death by the SIGTERM we sent) */
                        bool clean = WIFSIGNALED(st) ? &kids[i] == etcd && WTERMSIG(st) == SIGTERM
                                                     : WEXITSTATUS(st) == 0;
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
                    if (kids[i].pid && (phase == 1) == (&kids[i] == etcd)) {
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
    return unclean;
}

/* The readiness probe's TLS (false: the router has none): it trusts
 * tls_ca, else tls_client_ca, else the router's certificate itself
 * (self-signed); for mutual TLS it shows the router's own certificate. */
static bool probe_tls_of(const td_config_t *cfg, td_rpc_tls_t *out)
{
    static char files[3][PATH_MAX];
    *out = (td_rpc_tls_t){0};
    if (!cfg->router.tls_cert || !cfg->router.tls_cert[0])
        return false;
    bool mutual = cfg->router.tls_client_ca && cfg->router.tls_client_ca[0];
    bool ca = cfg->router.tls_ca && cfg->router.tls_ca[0];
    snprintf(files[0], PATH_MAX, "%s", ca ? cfg->router.tls_ca : mutual ? cfg->router.tls_client_ca : cfg->router.tls_cert);
    snprintf(files[1], PATH_MAX, "%s", cfg->router.tls_cert);
    snprintf(files[2], PATH_MAX, "%s", cfg->router.tls_key ? cfg->router.tls_key : "");
    out->ca_file = files[0];
    if (mutual) {
        out->cert_file = files[1];
        out->key_file = files[2];
    }
    return true;
}

/* etcd's command line: a private data dir, the client and peer URLs; with
 * TLS, a certificate the cluster CA signed on both ports, or no connection. */
static void etcd_child(child_t *etcd, const td_config_t *cfg, const up_t *u, const char *datadir, const char *client,
                       const char *peer, const char *cluster)
{
    char cert[PATH_MAX], key[PATH_MAX], etcd_bin[PATH_MAX];
    etcd->used = true;
    snprintf(etcd->name, sizeof etcd->name, "etcd");
    etcd_path(etcd_bin, sizeof etcd_bin);
    const char *eargs[] = {etcd_bin, "--name", "tandem", "--data-dir", datadir, "--listen-client-urls", client,
                           "--advertise-client-urls", client, "--listen-peer-urls", peer,
                           "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster,
                           "--initial-cluster-state", "new", "--log-level", "error", "--logger", "zap"};
    for (size_t i = 0; i < sizeof eargs / sizeof *eargs; i++)
        add_arg(etcd, eargs[i]);
    if (!u->plaintext) {
        pair_of(cfg, u->certdir, "etcd", cert, key);
        const char *targs[] = {"--cert-file", cert, "--key-file", key, "--trusted-ca-file", u->ca_file,
                               "--client-cert-auth", "--peer-cert-file", cert, "--peer-key-file", key,
                               "--peer-trusted-ca-file", u->ca_file, "--peer-client-cert-auth"};
        for (size_t i = 0; i < sizeof targs / sizeof *targs; i++)
            add_arg(etcd, targs[i]);
    }
}

/* The kvstore nodes' command lines: ids kvstore-K (kvstore-NODE-K when
 * joining), data dirs under kvstore.data_dir or the run folder. */
static int kvstore_children(child_t *kids, int nk, const up_t *u, const up_flags_t *f, const char *node,
                            const char *base)
{
    char cert[PATH_MAX], key[PATH_MAX];
    const td_config_t *cfg = u->cfg;
    for (long k = 0; k < u->nkv && nk < MAX_CHILDREN; k++) {
        child_t *c = &kids[nk++];
        child_begin(c, "tandem-kvstore", u->dir, u->config);
        char name[96], kdir[PATH_MAX + 64], listen[96];
        if (f->join)
            snprintf(name, sizeof name, "kvstore-%s-%ld", node, k);
        else
            snprintf(name, sizeof name, "kvstore-%ld", k);
        add_arg(c, "--id");
        add_arg(c, name);
        add_arg(c, "--etcd");
        add_arg(c, u->etcd_ep);
        snprintf(listen, sizeof listen, "%s:0", u->address);
        add_arg(c, "--listen");
        add_arg(c, listen);
        add_arg(c, "--metrics-listen");
        add_arg(c, listen);
        snprintf(kdir, sizeof kdir, "%s/%s", cfg->kvstore.data_dir && cfg->kvstore.data_dir[0] ? cfg->kvstore.data_dir : base,
                 name);
        add_arg(c, "--data-dir");
        add_arg(c, kdir);
        pair_of(cfg, u->certdir, "kvstore", cert, key);
        add_cluster_tls(c, u->plaintext, u->ca_file, cert, key);
        for (int e = 0; e < f->n_kv_extra; e++)
            add_arg(c, f->kv_extra[e]);
    }
    return nk;
}

/* Where the processes listen: etcd's client and peer URLs, the router's
 * gRPC, HTTP and metrics addresses (the flags', the config's, or the free
 * ports found: etcd's client and peer, the router's, the HTTP API's, the
 * metrics'). */
typedef struct up_listens {
    char client[96], peer[96], cluster[128], router[128], http[128], metrics[128];
} up_listens_t;

static void up_listens(const td_config_t *cfg, const up_flags_t *f, bool plaintext, const int ports[5], up_listens_t *l)
{
    const char *scheme = plaintext ? "http" : "https", *address = f->address;
    snprintf(l->client, sizeof l->client, "%s://%s:%d", scheme, address, ports[0]);
    snprintf(l->peer, sizeof l->peer, "%s://%s:%d", scheme, address, ports[1]);
    snprintf(l->cluster, sizeof l->cluster, "tandem=%s", l->peer);
    if (f->listen_at)
        snprintf(l->router, sizeof l->router, "%s", f->listen_at);
    else if (cfg->router.listen && cfg->router.listen[0] && strcmp(cfg->router.listen, "127.0.0.1:50051"))
        snprintf(l->router, sizeof l->router, "%s", cfg->router.listen);
    else
        snprintf(l->router, sizeof l->router, "%s:%d", address, ports[2]);
    /* the OpenAI HTTP API: the config's address, or a free port for the default; "" turns it off */
    const char *hl = cfg->router.http_listen ? cfg->router.http_listen : "";
    if (hl[0] && strcmp(hl, "127.0.0.1:8000"))
        snprintf(l->http, sizeof l->http, "%s", hl);
    else if (hl[0])
        snprintf(l->http, sizeof l->http, "%s:%d", address, ports[3]);
    else
        l->http[0] = 0;
    /* the router's metrics: the config's address, or a free port; its /targets lists every process's */
    if (cfg->metrics.listen[0])
        snprintf(l->metrics, sizeof l->metrics, "%s", cfg->metrics.listen);
    else
        snprintf(l->metrics, sizeof l->metrics, "%s:%d", address, ports[4]);
}

static void router_child(child_t *router, const up_t *u, const up_listens_t *l, const char *admin_keys)
{
    char cert[PATH_MAX], key[PATH_MAX];
    child_begin(router, "tandem-router", u->dir, u->config);
    const char *args[] = {"--model", u->model, "--listen", l->router, "--http-listen", l->http,
                          "--metrics-listen", l->metrics, "--etcd", u->etcd_ep};
    for (size_t i = 0; i < sizeof args / sizeof *args; i++)
        add_arg(router, args[i]);
    if (admin_keys[0]) {
        add_arg(router, "--admin-keys");
        add_arg(router, admin_keys);
    }
    pair_of(u->cfg, u->certdir, "router", cert, key);
    add_cluster_tls(router, u->plaintext, u->ca_file, cert, key);
}

/* The node agent: this node's record, the seed (the cluster's founder
 * only), its share; with TLS, its own certificate ("node": etcd lets it
 * write its node's record). 0, or 2 after naming a missing certificate. */
static int agent_setup(agent_t *agent, const up_t *u, const up_flags_t *f, const char *node, long np, long nd)
{
    static char agent_tls[3][PATH_MAX + 16];
    pthread_mutex_init(&agent->mu, NULL);
    snprintf(agent->etcd_ep, sizeof agent->etcd_ep, "%s", u->etcd_ep);
    snprintf(agent->node, sizeof agent->node, "%s", node);
    snprintf(agent->address, sizeof agent->address, "%s", u->address);
    agent->plaintext = u->plaintext;
    agent->run_workers = f->run_workers;
    agent->seed = !f->join;
    agent->seed_p = (uint32_t)np;
    agent->seed_d = (uint32_t)nd;
    agent->seed_colocated = f->colocated;
    if (!u->plaintext) {
        pair_of(u->cfg, u->certdir, "node", agent_tls[1], agent_tls[2]);
        if (u->certdir && access(agent_tls[1], R_OK)) {
            fprintf(stderr, "tandem up: %s has no node.pem, the node agent's certificate (tandem certs --dir %s "
                            "--names node)\n", u->certdir, u->certdir);
            return 2;
        }
        snprintf(agent_tls[0], sizeof agent_tls[0], "%s", u->ca_file);
        agent->tls = (td_rpc_tls_t){.ca_file = agent_tls[0], .cert_file = agent_tls[1], .key_file = agent_tls[2]};
    }
    if (!f->join && f->run_workers) { /* the founder starts its counts at once; the planner's record takes over */
        agent->want_p = agent->all_p = (uint32_t)np;
        agent->want_d = agent->all_d = (uint32_t)nd;
        agent->colocated = f->colocated;
        agent->known = true;
    }
    return 0;
}

/* Until a stop signal: restarts children that ended, obeys the agent, and
 * (the founder) waits for the router to say SERVING, then prints its
 * endpoint on stdout and its other addresses on stderr. */
static void supervise(up_t *u, agent_t *agent, child_t *kids, int *nk, td_rpc_channel_t *probe,
                      const up_listens_t *l, bool announced)
{
    double t_start = td_now_s(), next_probe = 0;
    while (!td_process_stop_signal()) {
        int st;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
            for (int i = 0; i < *nk; i++)
                if (kids[i].used && kids[i].pid == pid)
                    child_ended(u, &kids[i], st);
        for (int i = 0; i < *nk; i++)
            if (kids[i].used && !kids[i].pid && !kids[i].retiring && kids[i].restart_at <= td_now_s())
                spawn(&kids[i]);
        reconcile(u, agent, kids, nk);
        int np = 0, nd = 0;
        bool serving = false;
        if (!announced && td_now_s() >= next_probe) {
            next_probe = td_now_s() + 0.2;
            serving = router_serving(probe, &np, &nd);
        }
        if (serving) {
            /* serving, and with the cluster's workers (the planner's counts: a colocated decode worker serves
             * alone, while the prefill workers, here or on other nodes, may still be measuring their profiles);
             * 60 s on, it is said as it is */
            pthread_mutex_lock(&agent->mu);
            int want_p = (int)agent->all_p, want_d = (int)agent->all_d;
            bool known = agent->known; /* the planner's counts read (before that, 0 + 0 says nothing) */
            pthread_mutex_unlock(&agent->mu);
            bool whole = np < 0 || (known && np >= want_p && nd >= want_d), late = td_now_s() - t_start > 60;
            if (!whole && late)
                fprintf(stderr, "tandem up: serving with %d prefill + %d decode workers of %d + %d after %.0f s\n",
                        np, nd, want_p, want_d, td_now_s() - t_start);
            if (whole || late) {
                announced = true;
                printf("%s\n", l->router);
                fflush(stdout);
                if (l->http[0])
                    fprintf(stderr, "tandem up: OpenAI-compatible HTTP API at %s://%s/v1\n",
                            u->cfg->router.tls_cert[0] ? "https" : "http", l->http);
                /* the metrics ports are internal planes: mutual TLS with the cluster's CA unless plaintext */
                const char *ms = u->plaintext ? "http" : "https";
                fprintf(stderr, "tandem up: Prometheus metrics at %s://%s/metrics, every process's listed at "
                        "%s://%s/targets (http_sd_configs)%s\n", ms, l->metrics, ms, l->metrics,
                        u->plaintext ? "" : "; scrape with a certificate of the cluster's CA");
                fprintf(stderr, "tandem up: serving at %s after %.1f s (Ctrl-C stops)\n", l->router,
                        td_now_s() - t_start);
            }
        }
        usleep(50 * 1000);
    }
}

/* The internal planes' certificates: mutual TLS with the role pairs of
 * --certs, the config's cluster CA and pair, or (by default) a throwaway CA
 * and a certificate per role made in the run folder; then what tools get
 * (the CA and the client pair, in a folder of their own: not the CA's key,
 * not another role's) and the router's administrator key (tandem scale
 * --admin-key). Sets u's certdir, ca_file and plaintext. 0, or the exit code
 * after naming what failed. */
typedef struct up_keys {
    bool own_certs;
    char certdir[PATH_MAX], ca_file[PATH_MAX + 16], client_dir[PATH_MAX], admin_key[PATH_MAX], admin_keys[PATH_MAX];
} up_keys_t;

static int up_certs(const td_config_t *cfg, const up_flags_t *f, const char *base, up_t *u, up_keys_t *k)
{
    bool plaintext = cfg->cluster.plaintext;
    k->own_certs = !plaintext && !f->certs_dir && !(cfg->cluster.tls_ca && cfg->cluster.tls_ca[0]);
    if (k->own_certs && f->join) {
        fprintf(stderr, "tandem up: --join needs the cluster's certificates: --certs DIR (tandem certs), or "
                        "cluster.tls_ca/tls_cert/tls_key in the config\n");
        return 2;
    }
    if (k->own_certs) {
        snprintf(k->certdir, sizeof k->certdir, "%s/tls", base);
        const char *names[] = {"router", "etcd", "client", "prefill", "decode", "kvstore", "node"};
        const char *hosts[] = {f->address};
        if (td_certs_make(k->certdir, names, 7, hosts, strcmp(f->address, "127.0.0.1") ? 1 : 0, 30)) {
            fprintf(stderr, "tandem up: %s\n", td_last_error());
            return 1;
        }
    } else if (f->certs_dir) {
        snprintf(k->certdir, sizeof k->certdir, "%s", f->certs_dir);
    }
    u->certdir = k->own_certs || f->certs_dir ? k->certdir : NULL;
    if (k->own_certs && up_client_dir(base, k->certdir, k->client_dir, sizeof k->client_dir)) {
        fprintf(stderr, "%s\n", td_last_error());
        return 1;
    }
    if (!f->join && !cfg->router.admin_keys[0] && up_admin_key(base, k->admin_key, k->admin_keys, sizeof k->admin_key)) {
        fprintf(stderr, "%s\n", td_last_error());
        return 1;
    }
    if (u->certdir)
        snprintf(k->ca_file, sizeof k->ca_file, "%s/ca.pem", k->certdir);
    else if (!plaintext)
        snprintf(k->ca_file, sizeof k->ca_file, "%s", cfg->cluster.tls_ca);
    u->ca_file = k->ca_file;
    u->plaintext = plaintext;
    return 0;
}

/* Starts the children: etcd first, and its access control set up (a user
 * per certificate, a role per role) before anything else talks to it; then
 * the rest and the node agent. False when etcd's access control failed
 * (etcd stopped again, the error named). */
static bool start_children(const up_t *u, child_t *kids, int nk, child_t *etcd, agent_t *agent)
{
    int first = 0;
    if (etcd && !u->plaintext && u->certdir) {
        spawn(etcd);
        first = 1;
        static char rt_cert[PATH_MAX], rt_key[PATH_MAX];
        pair_of(u->cfg, u->certdir, "router", rt_cert, rt_key);
        td_rpc_tls_t etls = {.ca_file = u->ca_file, .cert_file = rt_cert, .key_file = rt_key};
        if (up_etcd_auth(u->etcd_ep, &etls, u->certdir, 20)) {
            fprintf(stderr, "%s\n", td_last_error());
            kill(etcd->pid, SIGTERM);
            waitpid(etcd->pid, NULL, 0);
            etcd->pid = 0;
            return false;
        }
    }
    for (int i = first; i < nk; i++)
        spawn(&kids[i]);
    if (pthread_create(&agent->thread, NULL, agent_thread, agent)) {
        fprintf(stderr, "tandem up: cannot start the node agent\n");
        kill(0, SIGTERM);
    }
    return true;
}

/* The folder of this binary, where the others are. */
static bool self_dir(char *out, size_t n)
{
    char self[PATH_MAX];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0)
        return false;
    self[sl] = 0;
    snprintf(out, n, "%s", self);
    char *slash = strrchr(out, '/');
    if (slash)
        *slash = 0;
    return slash != NULL;
}

int cli_up(int argc, char **argv)
{
    static up_flags_t f;
    int bad = up_parse(argc, argv, &f);
    if (bad)
        return bad;
    const char *config = f.config, *model = f.model, *join = f.join, *address = f.address, *node = f.node;
    const char **extra = f.extra;
    bool colocated = f.colocated, plaintext;
    long np = f.np, nd = f.nd, nkv = f.nkv;
    td_config_t cfg;
    td_config_defaults(&cfg);
    rt_placement_register_names(); /* router.placement is checked here, not first by the router it starts */
    if (config && td_config_load(&cfg, config)) {
        fprintf(stderr, "tandem up: %s\n", td_last_error());
        return 2;
    }
    if (colocated)
        np = 0;
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
    static char node_buf[64];
    if (!node) { /* HOST-ADDRESS */
        char host[48] = "node";
        gethostname(host, sizeof host - 1);
        node = node_buf;
        snprintf(node_buf, sizeof node_buf, "%s-%s", host, address);
    }
    static up_t u;
    u.cfg = &cfg;
    u.config = config;
    u.model = model;
    u.address = address;
    u.nkv = nkv;
    u.extra = extra;
    u.n_extra = f.n_extra;
    if (!self_dir(u.dir, sizeof u.dir)) {
        fprintf(stderr, "tandem up: cannot find my own binary\n");
        return 1;
    }

    /* the run folder: etcd's data, the keys; locked while this run (or a child) lives, so the next
     * start removes it when this one was killed before it could */
    char base[64];
    int stale = 0;
    if (up_run_dir(base, sizeof base, &stale)) {
        fprintf(stderr, "%s\n", td_last_error());
        return 1;
    }
    if (stale)
        fprintf(stderr, "tandem up: removed %d run folder%s of earlier runs that ended without cleaning up\n", stale,
                stale > 1 ? "s" : "");
    static char datadir[96];
    snprintf(datadir, sizeof datadir, "%s/etcd", base);
    static up_keys_t keys;
    int failed = up_certs(&cfg, &f, base, &u, &keys);
    if (failed)
        return failed;
    plaintext = u.plaintext;
    int ports[5]; /* etcd's client and peer ports, the router's, the HTTP API's, the router's metrics */
    if (free_ports(address, ports, 5)) {
        fprintf(stderr, "tandem up: cannot find free ports on %s: %s\n", address, strerror(errno));
        return 1;
    }
    static up_listens_t l;
    static char etcd_ep[160];
    up_listens(&cfg, &f, plaintext, ports, &l);
    if (join)
        snprintf(etcd_ep, sizeof etcd_ep, "%s", join);
    else
        snprintf(etcd_ep, sizeof etcd_ep, "%s:%d", address, ports[0]);
    u.etcd_ep = etcd_ep;

    static child_t kids[MAX_CHILDREN];
    int nk = 0;
    child_t *etcd = NULL;
    if (!join) {
        etcd = &kids[nk++];
        etcd_child(etcd, &cfg, &u, datadir, l.client, l.peer, l.cluster);
    }
    nk = kvstore_children(kids, nk, &u, &f, node, base);
    if (!join)
        router_child(&kids[nk++], &u, &l, keys.admin_keys);
    static agent_t agent;
    if (agent_setup(&agent, &u, &f, node, np, nd)) {
        td_config_free(&cfg);
        return 2;
    }
    td_rpc_tls_t probe_tls;
    bool tls = probe_tls_of(&cfg, &probe_tls);
    td_process_init("tandem up"); /* SIGINT/SIGTERM: the stop below; gRPC up */
    td_log_set_level(TD_LOG_OFF);
    td_rpc_channel_t *probe = NULL;
    if (!join && td_rpc_channel_create(l.router, tls ? &probe_tls : NULL, &probe)) {
        fprintf(stderr, "tandem up: cannot probe the router at %s: %s\n", l.router, td_last_error());
        td_rpc_shutdown();
        td_config_free(&cfg);
        return 1;
    }
    if (!start_children(&u, kids, nk, etcd, &agent)) {
        td_rpc_channel_destroy(probe);
        td_rpc_shutdown();
        td_config_free(&cfg);
        up_run_dir_remove(base);
        return 1;
    }
    if (join)
        fprintf(stderr, "tandem up: node %s joins the cluster of etcd %s: %ld kvstore nodes, its share of the workers\n",
                node, etcd_ep, nkv);
    else
        fprintf(stderr, "tandem up: etcd on %s, %ld kvstore nodes, %ld prefill + %ld decode workers, model %s\n", etcd_ep,
                nkv, np, nd, model);
    if (plaintext)
        fprintf(stderr, "tandem up: WARNING: cluster.plaintext is set: etcd and the workers' RPCs take anyone\n");
    else if (keys.own_certs)
        fprintf(stderr, "tandem up: mutual TLS on every internal plane; certificates in %s (the cluster's keys: yours only); "
                        "for tools such as etcdctl: %s (ca.pem, client.pem, client.key: reads etcd, calls Stats)\n",
                keys.certdir, keys.client_dir);
    else
        fprintf(stderr, "tandem up: mutual TLS on every internal plane (cluster CA %s)\n", keys.ca_file);
    if (keys.admin_key[0])
        fprintf(stderr, "tandem up: administrator key (tandem scale --admin-key) in %s\n", keys.admin_key);

    supervise(&u, &agent, kids, &nk, probe, &l, join != NULL);
    fprintf(stderr, "tandem up: stopping\n");
    pthread_join(agent.thread, NULL);
    td_rpc_channel_destroy(probe);
    td_rpc_shutdown();
    /* router and workers first (they drain), etcd last; exit 1 if one of them does not stop cleanly */
    bool unclean = stop_children(kids, nk, etcd);
    up_run_dir_remove(base);
    for (int i = 0; i < nk; i++)
        child_clear(&kids[i]);
    td_config_free(&cfg);
    return unclean ? 1 : 0;
}
