/* choices.c — n choices of one Generate request (choices.h).
 *
 * Each choice is a request of its own whose sink is its slot here. A slot's
 * message goes to the transport when no other is being written, else it
 * waits in the slot (its request waits for the write's report anyway, so at
 * most one message a choice waits); each report the transport gives
 * (rt_choices_sent) goes to the choice whose message it was, and the next
 * waiting one is written, taking the slots in turn. The group is freed after
 * the transport's end, which comes when the last choice has ended. */
#include "router/choices.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/grow.h"
#include "common/pb_arena.h"

typedef struct slot {
    rt_choices_t *g;
    rt_request_t *q;
    uint32_t index;
    bool ended;
    /* its message while another is written, packed (the request's copy is gone when its emit returns); unpacked
     * into the arena to be written: no allocation per message once the buffer is large enough */
    bool waiting;
    uint8_t *packed;
    size_t n_packed, cap_packed;
    td_pb_arena_t arena;
    _Alignas(16) uint8_t mem[2048];
} slot_t;

struct rt_choices {
    rt_requests_t *rs;
    rt_sink_t sink;
    void *sink_ctx;
    const rt_key_t *key;
    double deadline;        /* td_now_s() past which the choices started late have no time left */
    uint8_t *packed;        /* the request, for choices 1 .. n - 1 */
    size_t n_packed;
    uint32_t n, n_started, n_ended;
    pthread_mutex_t mu;
    slot_t *writing;        /* the slot whose message the transport writes (NULL: none) */
    uint32_t turn;          /* the next slot looked at for a waiting message */
    bool cancelled, failed, rest_started;
    int code;               /* the first failure's (or OK) */
    char msg[1024];
    uint32_t retry_after_ms;
    const char *rejected;
    slot_t slot[];
};

static td_status_t c_emit(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m);
static void c_end(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected);
static const rt_sink_t choice_sink = {.emit = c_emit, .end = c_end};

rt_choices_t *rt_choices_create(rt_requests_t *rs, Tandem__V1__GenerateRequest *rq, double timeout_s,
                                const rt_sink_t *sink, void *sink_ctx)
{
    /* an n out of range is the first choice's to refuse (it names the field); it runs alone */
    uint32_t n = rq->sampling && rq->sampling->has_n && rq->sampling->n > 1 && rq->sampling->n <= RT_MAX_CHOICES
                     ? rq->sampling->n
                     : 1;
    rt_choices_t *g = calloc(1, sizeof *g + n * sizeof *g->slot);
    if (g && n > 1 && (g->packed = malloc(tandem__v1__generate_request__get_packed_size(rq))))
        g->n_packed = tandem__v1__generate_request__pack(rq, g->packed);
    if (!g || (n > 1 && !g->packed)) {
        if (g)
            free(g->packed);
        free(g);
        tandem__v1__generate_request__free_unpacked(rq, NULL);
        return NULL;
    }
    g->slot[0].q = rt_request_create(rs, rq, timeout_s, &choice_sink, &g->slot[0]);
    if (!g->slot[0].q) { /* rq is freed */
        free(g->packed);
        free(g);
        return NULL;
    }
    g->rs = rs;
    g->sink = *sink;
    g->sink_ctx = sink_ctx;
    g->deadline = td_now_s() + timeout_s;
    g->n = n;
    g->n_started = 1;
    for (uint32_t i = 0; i < n; i++) {
        g->slot[i].g = g;
        g->slot[i].index = i;
        td_pb_arena_init(&g->slot[i].arena, g->slot[i].mem, sizeof g->slot[i].mem);
    }
    pthread_mutex_init(&g->mu, NULL);
    rt_request_set_choice(g->slot[0].q, 0, n);
    return g;
}

void rt_choices_set_key(rt_choices_t *g, const rt_key_t *key)
{
    g->key = key;
    rt_request_set_key(g->slot[0].q, key);
}

void rt_choices_start(rt_choices_t *g) { rt_request_start(g->slot[0].q); }

void rt_choices_cancel(rt_choices_t *g)
{
    /* under mu: a choice's end (which takes mu) cannot pass while it is cancelled */
    pthread_mutex_lock(&g->mu);
    g->cancelled = true;
    for (uint32_t i = 0; i < g->n; i++)
        if (g->slot[i].q && !g->slot[i].ended)
            rt_request_cancel(g->slot[i].q);
    pthread_mutex_unlock(&g->mu);
}

/* Under mu: the next slot whose message waits, which becomes the one
 * written (NULL: none waits). */
static slot_t *take_waiting(rt_choices_t *g)
{
    for (uint32_t k = 0; k < g->n; k++) {
        slot_t *t = &g->slot[(g->turn + k) % g->n];
        if (t->waiting) {
            t->waiting = false;
            g->turn = (t->index + 1) % g->n;
            g->writing = t;
            return t;
        }
    }
    g->writing = NULL;
    return NULL;
}

/* Writes the waiting messages from slot s on, until the transport takes one
 * (its report comes later) or none waits. A message the transport refuses is
 * reported failed to its choice, which then ends (the client is gone). */
static void write_waiting(rt_choices_t *g, slot_t *s)
{
    while (s) {
        Tandem__V1__GenerateResponse *m =
            tandem__v1__generate_response__unpack(&s->arena.a, s->n_packed, s->packed);
        td_status_t rc = m ? g->sink.emit(g->sink_ctx, s->q, m) : TD_ERR_NO_MEMORY;
        if (m)
            tandem__v1__generate_response__free_unpacked(m, &s->arena.a);
        td_pb_arena_reset(&s->arena);
        if (rc == TD_OK)
            return;
        rt_request_t *q = s->q;
        pthread_mutex_lock(&g->mu);
        s = take_waiting(g);
        pthread_mutex_unlock(&g->mu);
        rt_request_sent(q, false);
    }
}

/* Choices 1 .. n - 1, once the first's prompt is in the caches; a choice the
 * router has no room for fails the group. */
static void start_rest(rt_choices_t *g)
{
    pthread_mutex_lock(&g->mu);
    bool go = !g->rest_started && !g->cancelled && !g->failed && g->n > 1;
    g->rest_started = true;
    pthread_mutex_unlock(&g->mu);
    for (uint32_t i = 1; go && i < g->n; i++) {
        Tandem__V1__GenerateRequest *rq = tandem__v1__generate_request__unpack(NULL, g->n_packed, g->packed);
        if (rq) { /* its own seed stream: seed + i when a seed was given */
            rq->sampling->has_n = 0;
            rq->sampling->seed += rq->sampling->has_seed ? i : 0;
        }
        double left = g->deadline - td_now_s();
        rt_request_t *q = rq ? rt_request_create(g->rs, rq, left > 0.001 ? left : 0.001, &choice_sink, &g->slot[i])
                             : NULL;
        pthread_mutex_lock(&g->mu);
        if (!q || g->cancelled || g->failed) {
            if (!q && !g->failed) {
                g->failed = true;
                g->code = TD_RPC_RESOURCE_EXHAUSTED;
                snprintf(g->msg, sizeof g->msg, "sampling.n: choice %u of %u found the router full "
                         "(router.max_streams) or out of memory; try again later", i, g->n);
            }
            for (uint32_t k = 0; k < i; k++)
                if (g->slot[k].q && !g->slot[k].ended)
                    rt_request_cancel(g->slot[k].q);
            pthread_mutex_unlock(&g->mu);
            if (q) { /* made but not to run: it ends at once, cancelled */
                rt_request_set_choice(q, i, g->n);
                pthread_mutex_lock(&g->mu);
                g->slot[i].q = q;
                g->n_started++;
                pthread_mutex_unlock(&g->mu);
                rt_request_cancel(q);
                rt_request_start(q);
            }
            return;
        }
        g->slot[i].q = q;
        g->n_started++;
        pthread_mutex_unlock(&g->mu);
        rt_request_set_choice(q, i, g->n);
        rt_request_set_key(q, g->key);
        rt_request_start(q);
    }
}

static td_status_t c_emit(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m)
{
    (void)q;
    slot_t *s = ctx;
    rt_choices_t *g = s->g;
    if (s->index == 0)
        start_rest(g);
    pthread_mutex_lock(&g->mu);
    if (g->writing) { /* written when the transport reports the one it has */
        size_t n = tandem__v1__generate_response__get_packed_size(m);
        bool ok = td_grow((void **)&s->packed, &s->cap_packed, n ? n : 1, 1, 256);
        if (ok) {
            s->n_packed = tandem__v1__generate_response__pack(m, s->packed);
            s->waiting = true;
        }
        pthread_mutex_unlock(&g->mu);
        return ok ? TD_OK : TD_ERR_NO_MEMORY;
    }
    g->writing = s;
    pthread_mutex_unlock(&g->mu);
    td_status_t rc = g->sink.emit(g->sink_ctx, s->q, m);
    if (rc != TD_OK) { /* this choice hears it now; the next waiting message is written */
        pthread_mutex_lock(&g->mu);
        slot_t *next = take_waiting(g);
        pthread_mutex_unlock(&g->mu);
        write_waiting(g, next);
    }
    return rc;
}

void rt_choices_sent(rt_choices_t *g, bool ok)
{
    pthread_mutex_lock(&g->mu);
    slot_t *done = g->writing, *next = take_waiting(g);
    pthread_mutex_unlock(&g->mu);
    /* the next choice's message goes out before this one's report (which may bring this choice's next) */
    write_waiting(g, next);
    if (done)
        rt_request_sent(done->q, ok);
}

static void c_end(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected)
{
    slot_t *s = ctx;
    rt_choices_t *g = s->g;
    if (s->index == 0)
        start_rest(g); /* a first choice that ended without a message (refused, failed) starts none */
    pthread_mutex_lock(&g->mu);
    s->ended = true;
    g->n_ended++;
    if (code != TD_RPC_OK && !g->failed) { /* the first failure is the answer; the other choices stop */
        g->failed = true;
        g->code = code;
        snprintf(g->msg, sizeof g->msg, "%s", message ? message : "");
        g->retry_after_ms = retry_after_ms;
        g->rejected = rejected;
        for (uint32_t k = 0; k < g->n; k++)
            if (g->slot[k].q && !g->slot[k].ended)
                rt_request_cancel(g->slot[k].q);
    }
    bool last = g->n_ended == g->n_started && g->rest_started;
    pthread_mutex_unlock(&g->mu);
    if (!last)
        return;
    g->sink.end(g->sink_ctx, g->failed ? g->code : TD_RPC_OK, g->failed ? g->msg : "", g->retry_after_ms,
                g->rejected);
    pthread_mutex_destroy(&g->mu);
    for (uint32_t i = 0; i < g->n; i++)
        free(g->slot[i].packed);
    free(g->packed);
    free(g);
}
