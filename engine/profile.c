/* profile.c — see profile.h. */
#define _GNU_SOURCE
#include "engine/profile.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "engine/engine.h"

#define MAX_SAMPLES 32

/* Solves the normal equations over the regressors in use (mask); false when singular. */
static int solve(const double (*x)[3], const double *y, uint32_t n, unsigned mask, double out[3])
{
    int idx[3], k = 0;
    for (int j = 0; j < 3; j++)
        if (mask & (1u << j))
            idx[k++] = j;
    double A[3][4] = {{0}};
    for (uint32_t i = 0; i < n; i++)
        for (int r = 0; r < k; r++) {
            for (int c = 0; c < k; c++)
                A[r][c] += x[i][idx[r]] * x[i][idx[c]];
            A[r][k] += x[i][idx[r]] * y[i];
        }
    for (int c = 0; c < k; c++) { /* Gaussian elimination, partial pivoting */
        int piv = c;
        for (int r = c + 1; r < k; r++)
            if (fabs(A[r][c]) > fabs(A[piv][c]))
                piv = r;
        if (fabs(A[piv][c]) < 1e-12)
            return 0;
        for (int j = 0; j <= k; j++) {
            double t = A[c][j];
            A[c][j] = A[piv][j];
            A[piv][j] = t;
        }
        for (int r = 0; r < k; r++)
            if (r != c) {
                double f = A[r][c] / A[c][c];
                for (int j = c; j <= k; j++)
                    A[r][j] -= f * A[c][j];
            }
    }
    out[0] = out[1] = out[2] = 0;
    for (int r = 0; r < k; r++)
        out[idx[r]] = A[r][k] / A[r][r];
    return 1;
}

void eng_profile_fit3(const double (*x)[3], const double *y, uint32_t n, double out[3])
{
    unsigned mask = 7;
    out[0] = out[1] = out[2] = 0;
    while (mask) {
        if (!solve(x, y, n, mask, out)) {
            mask &= mask - 1; /* drop the lowest regressor and try the rest */
            continue;
        }
        unsigned neg = 0;
        for (int j = 0; j < 3; j++)
            if ((mask & (1u << j)) && out[j] < 0)
                neg |= 1u << j;
        if (!neg)
            return;
        mask &= ~neg;
    }
    out[0] = out[1] = out[2] = 0;
}

double eng_profile_prefill_ms(const eng_profile_t *p, double n, double cached)
{
    return p->prefill[0] + p->prefill[1] * n + p->prefill[2] * n * (cached + n / 2);
}

double eng_profile_step_ms(const eng_profile_t *p, double batch, double ctx)
{
    return p->decode[0] + p->decode[1] * batch + p->decode[2] * batch * ctx;
}

/* ---- the sweep ---- */

typedef struct sweep {
    uint64_t rng;
    int32_t lo, hi;
    uint32_t firsts, finished, cached;
} sweep_t;

static void on_event(void *ctx, const eng_event_t *ev)
{
    sweep_t *s = ctx;
    if (ev->token >= 0 && ev->n_generated == 1) {
        s->firsts++;
        s->cached = ev->n_cached;
    }
    if (ev->finish != ENG_FINISH_NONE)
        s->finished++;
}

static void fill(sweep_t *s, int32_t *t, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        s->rng = s->rng * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = s->lo + (int32_t)((s->rng >> 33) % (uint64_t)(s->hi - s->lo));
    }
}

static td_status_t add(eng_engine_t *e, const int32_t *t, uint32_t n, uint32_t max_tokens)
{
    eng_request_t r = {.prompt = t, .n_prompt = n, .sampling = eng_sampling_default(), .max_tokens = max_tokens,
                       .ignore_eos = true};
    uint64_t id;
    return eng_engine_add(e, &r, &id);
}

/* One prompt of n tokens to its first token: the milliseconds, and its cached tokens. */
static td_status_t prefill_once(eng_engine_t *e, sweep_t *s, const int32_t *t, uint32_t n, double *ms)
{
    s->firsts = s->finished = 0;
    double t0 = td_now_s();
    td_status_t rc = add(e, t, n, 1);
    while (!rc && eng_engine_busy(e))
        rc = eng_engine_step(e, on_event, s);
    *ms = (td_now_s() - t0) * 1e3;
    if (rc)
        return rc;
    return s->firsts == 1 ? TD_OK : td_error(TD_ERR_INTERNAL, "profile: a prefill gave no first token");
}

/* batch requests of ctx-token prompts, 8 tokens each: the median step once all decode. */
static td_status_t decode_steps(eng_engine_t *e, sweep_t *s, int32_t *t, uint32_t batch, uint32_t ctx, double *ms)
{
    s->firsts = s->finished = 0;
    td_status_t rc = TD_OK;
    for (uint32_t b = 0; b < batch && !rc; b++) {
        fill(s, t, ctx);
        rc = add(e, t, ctx, 8);
    }
    double steps[16];
    uint32_t n = 0;
    while (!rc && eng_engine_busy(e)) {
        bool all_decoding = s->firsts == batch && s->finished == 0;
        double t0 = td_now_s();
        rc = eng_engine_step(e, on_event, s);
        if (all_decoding && s->finished == 0 && n < 16)
            steps[n++] = (td_now_s() - t0) * 1e3;
    }
    if (rc)
        return rc;
    if (!n)
        return td_error(TD_ERR_INTERNAL, "profile: no decode step of batch %u was timed", batch);
    for (uint32_t i = 1; i < n; i++) /* sort for the median */
        for (uint32_t j = i; j > 0 && steps[j] < steps[j - 1]; j--) {
            double x = steps[j];
            steps[j] = steps[j - 1];
            steps[j - 1] = x;
        }
    *ms = steps[n / 2];
    return TD_OK;
}

td_status_t eng_profile_measure(eng_engine_t *e, int32_t lo, int32_t hi, eng_profile_t *out)
{
    memset(out, 0, sizeof *out);
    sweep_t s = {.rng = 0x9e3779b97f4a7c15ull, .lo = lo, .hi = hi};
    double t_start = td_now_s();
    enum { BASE = 256 };
    int32_t *t = malloc((BASE + 256) * sizeof *t);
    if (!t)
        return td_error(TD_ERR_NO_MEMORY, "profile: no memory");
    double px[MAX_SAMPLES][3], py[MAX_SAMPLES], dx[MAX_SAMPLES][3], dy[MAX_SAMPLES];
    uint32_t np = 0, nd = 0;
    double ms;
    td_status_t rc;
    fill(&s, t, 16);
    if ((rc = prefill_once(e, &s, t, 16, &ms))) /* warm-up: first-touch of weights and scratch */
        goto out;
    /* cold prefills, then the same base with new tokens after it (its blocks cached) */
    static const uint32_t cold[] = {32, 128, 64};
    for (size_t i = 0; i < sizeof cold / sizeof cold[0] && !rc; i++) {
        fill(&s, t, cold[i]);
        if (!(rc = prefill_once(e, &s, t, cold[i], &ms))) {
            double nw = cold[i] - s.cached;
            px[np][0] = 1, px[np][1] = nw, px[np][2] = nw * (s.cached + nw / 2), py[np++] = ms;
        }
    }
    static const uint32_t warm[] = {32, 128};
    for (size_t i = 0; i < sizeof warm / sizeof warm[0] && !rc; i++) { /* t[0..BASE) is the last cold prompt's */
        fill(&s, t, BASE); /* a fresh base each time: cache it, then extend it */
        if ((rc = prefill_once(e, &s, t, BASE, &ms)))
            break;
        px[np][0] = 1, px[np][1] = BASE, px[np][2] = BASE * (BASE / 2.0), py[np++] = ms;
        fill(&s, t + BASE, warm[i]);
        if (!(rc = prefill_once(e, &s, t, BASE + warm[i], &ms))) {
            double nw = BASE + warm[i] - s.cached;
            px[np][0] = 1, px[np][1] = nw, px[np][2] = nw * (s.cached + nw / 2), py[np++] = ms;
        }
    }
    static const struct { uint32_t batch, ctx; } dec[] = {{1, 32}, {8, 32}, {2, 256}};
    for (size_t i = 0; i < sizeof dec / sizeof dec[0] && !rc; i++)
        if (!(rc = decode_steps(e, &s, t, dec[i].batch, dec[i].ctx, &ms))) {
            double ctx = dec[i].ctx + 4; /* the middle of the timed steps */
            dx[nd][0] = 1, dx[nd][1] = dec[i].batch, dx[nd][2] = dec[i].batch * ctx, dy[nd++] = ms;
        }
    if (!rc) {
        out->measured_at = (double)time(NULL);
        eng_profile_fit3((const double (*)[3])px, py, np, out->prefill);
        eng_profile_fit3((const double (*)[3])dx, dy, nd, out->decode);
        out->samples = np + nd;
    }
out:
    out->sweep_s = td_now_s() - t_start;
    free(t);
    return rc;
}

td_status_t eng_profile_check(eng_engine_t *e, int32_t lo, int32_t hi, const eng_profile_t *p, double *ratio)
{
    enum { N = 128 };
    sweep_t s = {.rng = 0x2545f4914f6cdd1dull ^ (uint64_t)(td_now_s() * 1e6), .lo = lo, .hi = hi};
    int32_t t[N];
    double ms, best = 0;
    fill(&s, t, 16);
    td_status_t rc = prefill_once(e, &s, t, 16, &ms); /* warm-up, as the sweep's */
    for (int i = 0; i < 2 && !rc; i++) { /* the faster of two cold prefills: a stall is not the machine's speed */
        fill(&s, t, N);
        if (!(rc = prefill_once(e, &s, t, N, &ms)))
            best = i && best < ms ? best : ms;
    }
    double want = eng_profile_prefill_ms(p, N - s.cached, s.cached);
    *ratio = want > 0 ? best / want : 0;
    return rc;
}

json_t *eng_profile_to_json(const eng_profile_t *p)
{
    /* measured_at in whole seconds, an integer: written as a real, a writer's precision (9 digits) rounded the
     * epoch by up to 5 s, into the future, and a worker reading it at once found it not fresh */
    return json_pack("{s:[f,f,f], s:[f,f,f], s:f, s:i, s:I}", "prefill", p->prefill[0], p->prefill[1],
                     p->prefill[2], "decode", p->decode[0], p->decode[1], p->decode[2], "sweep_s", p->sweep_s,
                     "samples", (int)p->samples, "measured_at", (json_int_t)p->measured_at);
}

td_status_t eng_profile_from_json(const json_t *j, eng_profile_t *p)
{
    memset(p, 0, sizeof *p);
    static const char *const keys[2] = {"prefill", "decode"};
    for (int k = 0; k < 2; k++) {
        const json_t *a = json_object_get(j, keys[k]);
        if (!json_is_array(a) || json_array_size(a) != 3)
            return td_error(TD_ERR_FORMAT, "profile: \"%s\" is not an array of 3 numbers", keys[k]);
        for (size_t i = 0; i < 3; i++) {
            const json_t *v = json_array_get(a, i);
            double d = json_number_value(v);
            if (!json_is_number(v) || !isfinite(d) || d < 0)
                return td_error(TD_ERR_FORMAT, "profile: \"%s\"[%zu] is not a number >= 0", keys[k], i);
            (k ? p->decode : p->prefill)[i] = d;
        }
    }
    p->sweep_s = json_number_value(json_object_get(j, "sweep_s"));
    p->samples = (uint32_t)json_integer_value(json_object_get(j, "samples"));
    p->measured_at = json_number_value(json_object_get(j, "measured_at"));
    return TD_OK;
}
