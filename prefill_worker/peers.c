/* peers.c — see peers.h. The pusher is one thread with a queue of puts
 * (each with its peer, region, land-by and fence) and a barrier flag: the
 * engine thread queues a layer's slices as the layer ends, raises the
 * barrier after the step and waits (bounded) until the thread has issued
 * everything and flushed each peer it touched. */
#define _GNU_SOURCE
#include "prefill_worker/peers.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"

typedef struct job {
    pw_peer_t *pe;
    uint32_t region;
    const void *src;
    size_t len;
    uint64_t dst;
    double land_by; /* td_now_s() past which the put must not be made */
    uint64_t fence; /* a device transport's point after which src is written (0: none) */
} job_t;

typedef struct pusher {
    const kv_transport_ops_t *xo;
    kv_xfer_t *x;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job_t *jobs;
    size_t n_jobs, cap_jobs, head;
    bool barrier, stop;     /* a barrier is asked for / done when cleared */
    pw_peer_t **touched;    /* peers written since the last barrier */
    size_t n_touched, cap_touched;
    double busy_s;          /* time spent putting and flushing, all time */
    uint64_t bytes;
    uint64_t dropped;       /* puts not made: past their land-by */
    uint64_t fence;         /* the last fence waited for (pusher thread) */
} pusher_t;

struct pw_peers {
    pusher_t pusher;
    pthread_mutex_t mu; /* the table and each entry's refs */
    pw_peer_t **peers;
    size_t n_peers, cap_peers;
    double idle_s;
};

/* Every put and flush of the pusher has its own deadline; this one bounds
 * the whole barrier (many peers, each slow up to its flush deadline). */
#define BARRIER_DEADLINE_S 30.0

/* ------------------------------------------------------------ the pusher */

static void touch(pusher_t *p, pw_peer_t *pe)
{
    for (size_t i = 0; i < p->n_touched; i++)
        if (p->touched[i] == pe)
            return;
    if (p->n_touched == p->cap_touched) {
        size_t nc = p->cap_touched ? 2 * p->cap_touched : 16;
        pw_peer_t **t = realloc(p->touched, nc * sizeof *t);
        if (!t) { /* it would not be flushed: its requests fail rather than announce KV that may not have landed */
            pe->failed = true;
            TD_WARN("prefill: no memory to track a decode peer for the flush; its requests fail");
            return;
        }
        p->touched = t;
        p->cap_touched = nc;
    }
    p->touched[p->n_touched++] = pe;
}

static void *pusher_thread(void *arg)
{
    pusher_t *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->head == p->n_jobs && !p->barrier && !p->stop)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop)
            break;
        if (p->head < p->n_jobs) {
            job_t j = p->jobs[p->head++];
            pthread_mutex_unlock(&p->mu);
            double t0 = td_now_s();
            /* past land-by the block may be another request's: dropped (its request sees the time and fails) */
            bool late = t0 > j.land_by;
            if (j.fence > p->fence && p->xo->wait_fence) { /* the layer that wrote src comes first */
                if (p->xo->wait_fence(p->x, j.fence)) {
                    j.pe->failed = true;
                    TD_WARN("prefill: %s", td_last_error());
                }
                p->fence = j.fence;
            }
            if (!j.pe->failed && !late && p->xo->put(p->x, j.pe->peer, j.region, j.src, j.len, j.dst)) {
                j.pe->failed = true;
                TD_WARN("prefill: a KV put failed: %s", td_last_error());
            }
            pthread_mutex_lock(&p->mu);
            p->dropped += late;
            p->busy_s += td_now_s() - t0;
            p->bytes += late ? 0 : j.len;
            touch(p, j.pe);
            continue;
        }
        /* barrier: everything queued is issued; flush every peer touched */
        pw_peer_t **t = p->touched;
        size_t nt = p->n_touched;
        p->n_touched = 0;
        p->head = p->n_jobs = 0;
        pthread_mutex_unlock(&p->mu);
        double t0 = td_now_s();
        for (size_t i = 0; i < nt; i++)
            if (!t[i]->failed && p->xo->flush(p->x, t[i]->peer, 10.0)) {
                t[i]->failed = true;
                TD_WARN("prefill: flushing KV to a decode worker failed: %s", td_last_error());
            }
        pthread_mutex_lock(&p->mu);
        p->busy_s += td_now_s() - t0;
        p->barrier = false;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void pw_peers_put(pw_peers_t *P, pw_peer_t *pe, uint32_t region, const void *src, size_t len, uint64_t dst,
                  double land_by, uint64_t fence)
{
    pusher_t *p = &P->pusher;
    pthread_mutex_lock(&p->mu);
    if (p->n_jobs == p->cap_jobs) {
        size_t nc = p->cap_jobs ? 2 * p->cap_jobs : 1024;
        job_t *j = realloc(p->jobs, nc * sizeof *j);
        if (!j) {
            pe->failed = true;
            pthread_mutex_unlock(&p->mu);
            return;
        }
        p->jobs = j;
        p->cap_jobs = nc;
    }
    p->jobs[p->n_jobs++] = (job_t){pe, region, src, len, dst, land_by, fence};
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

double pw_peers_barrier(pw_peers_t *P)
{
    pusher_t *p = &P->pusher;
    double t0 = td_now_s();
    struct timespec until = td_wall_deadline(BARRIER_DEADLINE_S);
    int e = 0;
    pthread_mutex_lock(&p->mu);
    p->barrier = true;
    pthread_cond_broadcast(&p->cv);
    while (p->barrier && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&p->cv, &p->mu, &until);
    bool stuck = p->barrier;
    pthread_mutex_unlock(&p->mu);
    if (stuck)
        pw_peers_fail_all(P, "the KV pushes of a step did not land within 30 s");
    return td_now_s() - t0;
}

td_status_t pw_peers_fence(pw_peers_t *P, void *queue, uint64_t *fence)
{
    *fence = 0;
    pusher_t *p = &P->pusher;
    td_status_t rc = p->xo->fence ? p->xo->fence(p->x, queue, fence) : TD_OK;
    if (rc)
        pw_peers_fail_all(P, td_last_error()); /* unordered puts could copy KV not yet written */
    return rc;
}

pw_peers_stats_t pw_peers_stats(pw_peers_t *P)
{
    pw_peers_stats_t s;
    pthread_mutex_lock(&P->pusher.mu);
    s.busy_s = P->pusher.busy_s;
    s.bytes = P->pusher.bytes;
    s.dropped = P->pusher.dropped;
    pthread_mutex_unlock(&P->pusher.mu);
    pthread_mutex_lock(&P->mu);
    s.n_peers = (uint32_t)P->n_peers;
    pthread_mutex_unlock(&P->mu);
    return s;
}

/* ------------------------------------------------------------ the table */

td_status_t pw_peers_create(const kv_transport_ops_t *xo, kv_xfer_t *x, double idle_s, pw_peers_t **out)
{
    pw_peers_t *P = calloc(1, sizeof *P);
    if (!P)
        return td_error(TD_ERR_NO_MEMORY, "prefill: no memory for the decode peers");
    pthread_mutex_init(&P->mu, NULL);
    P->idle_s = idle_s;
    pusher_t *p = &P->pusher;
    p->xo = xo;
    p->x = x;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (pthread_create(&p->thread, NULL, pusher_thread, p)) {
        pw_peers_destroy(P);
        return td_error(TD_ERR_INTERNAL, "cannot start the pusher thread");
    }
    p->started = true;
    *out = P;
    return TD_OK;
}

void pw_peers_destroy(pw_peers_t *P)
{
    if (!P)
        return;
    pusher_t *p = &P->pusher;
    if (p->started) {
        pthread_mutex_lock(&p->mu);
        p->stop = true;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        pthread_join(p->thread, NULL);
    }
    for (size_t i = 0; i < P->n_peers; i++) {
        p->xo->disconnect(p->x, P->peers[i]->peer);
        free(P->peers[i]->addr);
        free(P->peers[i]);
    }
    free(P->peers);
    free(p->jobs);
    free(p->touched);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&P->mu);
    free(P);
}

void pw_peer_release(pw_peers_t *P, pw_peer_t *pe)
{
    pthread_mutex_lock(&P->mu);
    pe->refs--;
    pe->last_used = td_now_s();
    pthread_mutex_unlock(&P->mu);
}

void pw_peers_reap(pw_peers_t *P)
{
    const kv_transport_ops_t *xo = P->pusher.xo;
    double now = td_now_s();
    pthread_mutex_lock(&P->mu);
    for (size_t i = 0; i < P->n_peers;) {
        pw_peer_t *pe = P->peers[i];
        if (pe->refs > 0 || (!pe->failed && now - pe->last_used < P->idle_s)) {
            i++;
            continue;
        }
        TD_INFO("prefill: closing the connection to a decode worker's pool (%s)", pe->failed ? "it failed" : "idle");
        xo->disconnect(P->pusher.x, pe->peer);
        free(pe->addr);
        free(pe);
        P->peers[i] = P->peers[--P->n_peers];
    }
    pthread_mutex_unlock(&P->mu);
}

void pw_peers_fail_all(pw_peers_t *P, const char *why)
{
    pthread_mutex_lock(&P->mu);
    for (size_t i = 0; i < P->n_peers; i++)
        P->peers[i]->failed = true;
    pthread_mutex_unlock(&P->mu);
    TD_WARN("prefill: %s; the requests landing on every decode worker fail", why);
}

/* The decode worker's pool as regions of a new connection: one, or one a rank's part (checked by
 * pw_landing_parts_ok). */
static td_status_t peer_regions(kv_xfer_t *x, const kv_transport_ops_t *xo, pw_peer_t *pe,
                                const Tandem__Internal__V1__LandingDescriptor *ld, const td_kv_layout_t *g)
{
    if (!ld->n_parts)
        return xo->region_add(x, pe->peer, ld->region_key.data, ld->region_key.len, ld->remote_base,
                              ld->region_bytes, &pe->region);
    for (uint32_t k = 0; k < ld->n_parts; k++) {
        const Tandem__Internal__V1__LandingPart *lp = ld->parts[k];
        struct pw_peer_part *pp = &pe->parts[k];
        td_status_t rc = xo->region_add(x, pe->peer, lp->region->region_key.data, lp->region->region_key.len,
                                        lp->region->remote_base, lp->region->region_bytes, &pp->region);
        if (rc)
            return rc;
        pp->head0 = lp->kv_head0, pp->heads = lp->kv_heads;
        const td_kv_layout_t part = td_kv_part_layout(g, lp->kv_heads);
        pp->part_bytes = td_kv_block_bytes(&part);
    }
    pe->n_parts = (uint32_t)ld->n_parts;
    pe->region = pe->parts[0].region;
    return TD_OK;
}

pw_peer_t *pw_peer_get(pw_peers_t *P, const Tandem__Internal__V1__LandingDescriptor *ld, const td_kv_layout_t *g)
{
    pthread_mutex_lock(&P->mu);
    for (size_t i = 0; i < P->n_peers; i++) {
        pw_peer_t *pe = P->peers[i];
        if (!pe->failed && pe->addr_len == ld->address.len && !memcmp(pe->addr, ld->address.data, pe->addr_len) &&
            pe->n_parts == ld->n_parts) {
            pe->refs++;
            pe->last_used = td_now_s();
            pthread_mutex_unlock(&P->mu);
            return pe;
        }
    }
    kv_xfer_t *x = P->pusher.x;
    const kv_transport_ops_t *xo = P->pusher.xo;
    pw_peer_t *pe = calloc(1, sizeof *pe);
    if (pe && (pe->addr = malloc(ld->address.len ? ld->address.len : 1))) {
        memcpy(pe->addr, ld->address.data, ld->address.len);
        pe->addr_len = ld->address.len;
        if (xo->connect(x, ld->address.data, ld->address.len, &pe->peer) == TD_OK &&
            peer_regions(x, xo, pe, ld, g) == TD_OK) {
            if (P->n_peers == P->cap_peers) {
                size_t nc = P->cap_peers ? 2 * P->cap_peers : 8;
                pw_peer_t **np = realloc(P->peers, nc * sizeof *np);
                if (np) {
                    P->peers = np;
                    P->cap_peers = nc;
                }
            }
            if (P->n_peers < P->cap_peers) {
                pe->refs = 1;
                pe->last_used = td_now_s();
                P->peers[P->n_peers++] = pe;
                pthread_mutex_unlock(&P->mu);
                return pe;
            }
        }
        if (pe->peer)
            xo->disconnect(x, pe->peer);
    }
    if (pe)
        free(pe->addr);
    free(pe);
    pthread_mutex_unlock(&P->mu);
    return NULL;
}

/* ------------------------------------------------------------ a landing's checks */

bool pw_landing_parts_ok(const Tandem__Internal__V1__LandingDescriptor *ld, const td_kv_layout_t *g, size_t bb,
                         char *err, size_t n)
{
    if (!ld->n_parts)
        return true;
    if (ld->n_parts < 2 || ld->n_parts > KV_XFER_MAX_REGIONS) {
        snprintf(err, n, "landing: %zu parts (2 to %d)", ld->n_parts, KV_XFER_MAX_REGIONS);
        return false;
    }
    for (size_t k = 0; k < ld->n_parts; k++) {
        const Tandem__Internal__V1__LandingPart *lp = ld->parts[k];
        if (!lp->region) {
            snprintf(err, n, "landing: part %zu names no region", k);
            return false;
        }
        if (!lp->kv_heads || lp->kv_head0 >= g->n_kv_heads || lp->kv_heads > g->n_kv_heads - lp->kv_head0) {
            snprintf(err, n, "landing: part %zu holds KV heads %u..%u; the model has %u", k, lp->kv_head0,
                     lp->kv_head0 + lp->kv_heads, g->n_kv_heads);
            return false;
        }
        const td_kv_layout_t part = td_kv_part_layout(g, lp->kv_heads);
        const size_t pb = td_kv_block_bytes(&part);
        for (size_t b = 0; b < ld->n_block_offsets; b++) {
            const uint64_t o = ld->block_offsets[b], at = o / bb * pb;
            const uint64_t rb = lp->region->region_bytes;
            if (o % bb || at > rb || pb > rb - at) {
                snprintf(err, n, "landing: block %zu at offset %llu is not a whole block inside part %zu's %llu bytes",
                         b, (unsigned long long)o, k, (unsigned long long)rb);
                return false;
            }
        }
    }
    for (uint32_t h = 0; h < g->n_kv_heads; h++) {
        size_t k = 0;
        while (k < ld->n_parts && (h < ld->parts[k]->kv_head0 || h - ld->parts[k]->kv_head0 >= ld->parts[k]->kv_heads))
            k++;
        if (k == ld->n_parts) {
            snprintf(err, n, "landing: no part holds KV head %u", h);
            return false;
        }
    }
    return true;
}

const char *pw_landing_grant(td_verifier_t *v, const Tandem__Internal__V1__LandingDescriptor *ld, double *land_by)
{
    static __thread char why[400];
    if (!ld->has_signature || !ld->has_signer_cert || !ld->has_land_by_unix_ms)
        return "not signed by a decode worker (no signature, signer certificate or land-by time)";
    Tandem__Internal__V1__LandingDescriptor u = *ld;
    u.has_signature = u.has_signer_cert = 0;
    size_t n = tandem__internal__v1__landing_descriptor__get_packed_size(&u);
    uint8_t *m = malloc(n);
    if (!m)
        return "no memory to check its signature";
    tandem__internal__v1__landing_descriptor__pack(&u, m);
    td_status_t rc = td_verify(v, ld->signer_cert.data, ld->signer_cert.len, "decode", m, n,
                               ld->signature.data, ld->signature.len);
    free(m);
    if (rc) {
        snprintf(why, sizeof why, "not a grant of this cluster's decode workers: %s", td_last_error());
        return why;
    }
    *land_by = td_local_of_unix_ms(ld->land_by_unix_ms);
    double left = *land_by - td_now_s();
    if (left <= 0) {
        snprintf(why, sizeof why, "its land-by time passed %.3f s ago; the blocks may be another request's", -left);
        return why;
    }
    return NULL;
}
