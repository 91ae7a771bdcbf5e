/* workload.c — see workload.h. Randomness comes from the seeded common/rng.h
 * generator, so a workload is the same every run. */
#define _GNU_SOURCE
#include "bench/workload.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rng.h"
#include "engine/tokenizer.h"

typedef td_rng_t rng_t;

/* Uniform in (0, 1): never 0, so log() is safe. */
static double rng_unit(rng_t *r) { return ((td_rng_u64(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static double rng_normal(rng_t *r)
{
    return sqrt(-2 * log(rng_unit(r))) * cos(2 * 3.14159265358979323846 * rng_unit(r));
}

/* Gamma(k, 1) by Marsaglia and Tsang (k >= 1; boosted for k < 1). */
static double rng_gamma(rng_t *r, double k)
{
    if (k < 1)
        return rng_gamma(r, k + 1) * pow(rng_unit(r), 1 / k);
    double d = k - 1.0 / 3, c = 1 / sqrt(9 * d);
    for (;;) {
        double x = rng_normal(r), v = 1 + c * x;
        if (v <= 0)
            continue;
        v = v * v * v;
        double u = rng_unit(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v))
            return d * v;
    }
}

static uint32_t draw_len(rng_t *r, const bench_len_t *l)
{
    double v = l->a;
    if (l->dist == BENCH_DIST_UNIFORM)
        v = l->a + (l->b - l->a + 1) * rng_unit(r) - 0.5;
    else if (l->dist == BENCH_DIST_LOGUNIFORM)
        v = l->a * exp(log(l->b / l->a) * rng_unit(r));
    else if (l->dist == BENCH_DIST_LOGNORMAL) /* mean a: mu = ln a - sigma^2 / 2 */
        v = exp(log(l->a) - l->b * l->b / 2 + l->b * rng_normal(r));
    long n = lround(v);
    return n < 1 ? 1 : (uint32_t)n;
}

td_status_t bench_words(const eng_tokenizer_t *tok, bench_workload_t *w)
{
    memset(w, 0, sizeof *w);
    w->words = calloc(4096, sizeof *w->words);
    if (!w->words)
        return td_error(TD_ERR_NO_MEMORY, "bench: no memory");
    int32_t *ids = NULL;
    size_t cap = 0, n;
    char buf[64];
    for (int32_t id = 0; id < eng_tokenizer_n_vocab(tok) && w->n_words < 4096; id++) {
        size_t len = eng_tokenizer_token_bytes(tok, id, buf, sizeof buf - 1);
        if (len < 4 || len > 9 || buf[0] != ' ')
            continue;
        bool ok = true;
        for (size_t i = 1; i < len && ok; i++)
            ok = buf[i] >= 'a' && buf[i] <= 'z';
        buf[len] = '\0';
        /* one token on its own, and still one after another word */
        char two[80];
        snprintf(two, sizeof two, " the%s", buf);
        if (!ok || eng_tokenizer_encode(tok, buf, len, 0, &ids, &cap, &n) || n != 1 ||
            eng_tokenizer_encode(tok, two, strlen(two), 0, &ids, &cap, &n) || n != 2)
            continue;
        if (!(w->words[w->n_words++] = strdup(buf)))
            break;
    }
    free(ids);
    if (w->n_words < 256)
        return td_error(TD_ERR_UNSUPPORTED, "bench: the tokenizer has only %zu one-token words (256 needed)",
                        w->n_words);
    return TD_OK;
}

/* Appends n words drawn from r to a growing string. */
/* The salt's bijection of word indices: i -> (i * p + salt) mod n, p a prime above any word count (4,096). */
static size_t salted(const bench_workload_t *w, size_t i)
{
    static const uint64_t primes[] = {4099, 4111, 4127, 4129, 4133, 4139, 4153, 4157};
    if (!w->salt)
        return i;
    return (size_t)((i * primes[(w->salt >> 3) & 7] + w->salt) % w->n_words);
}

static td_status_t append_words(const bench_workload_t *w, rng_t *r, size_t n, char **s, size_t *len, size_t *cap)
{
    for (size_t i = 0; i < n; i++) {
        const char *word = w->words[salted(w, td_rng_u64(r) % w->n_words)];
        size_t wl = strlen(word);
        if (*len + wl + 1 > *cap) {
            size_t nc = *cap ? *cap * 2 : 4096;
            while (nc < *len + wl + 1)
                nc *= 2;
            char *ns = realloc(*s, nc);
            if (!ns)
                return td_error(TD_ERR_NO_MEMORY, "bench: no memory for prompts");
            *s = ns;
            *cap = nc;
        }
        memcpy(*s + *len, word, wl + 1);
        *len += wl;
    }
    return TD_OK;
}

void bench_block_text(const bench_workload_t *w, uint64_t id, uint32_t words, char **out, size_t *len, size_t *cap)
{
    rng_t r;
    td_rng_seed(&r, id * 0x2545f4914f6cdd1dull + 12345);
    append_words(w, &r, words, out, len, cap);
}

static td_status_t grow(bench_workload_t *w, size_t n)
{
    bench_request_t *nr = realloc(w->req, n * sizeof *nr);
    if (!nr)
        return td_error(TD_ERR_NO_MEMORY, "bench: no memory for %zu requests", n);
    w->req = nr;
    return TD_OK;
}

td_status_t bench_synthetic(bench_workload_t *w, const bench_synthetic_t *s)
{
    if (!(s->rate > 0) || !(s->cv > 0) || !s->n || !(s->prefix_share >= 0 && s->prefix_share < 1))
        return td_error(TD_ERR_INVALID_ARG, "bench: rate, cv and the request count must be positive and the "
                        "prefix share in [0, 1)");
    td_status_t rc = grow(w, s->n);
    if (rc)
        return rc;
    rng_t r;
    td_rng_seed(&r, s->seed);
    double t = 0, k = 1 / (s->cv * s->cv); /* gamma gaps with mean 1/rate and the given cv */
    for (size_t i = 0; i < s->n; i++) {
        bench_request_t *q = &w->req[w->n];
        memset(q, 0, sizeof *q);
        q->t_send = t;
        t += rng_gamma(&r, k) / (k * s->rate);
        q->input_len = draw_len(&r, &s->input);
        q->output_len = draw_len(&r, &s->output);
        q->group = s->groups ? (int32_t)(td_rng_u64(&r) % s->groups) : -1;
        size_t len = 0, cap = 0, shared = q->group >= 0 ? (size_t)(q->input_len * s->prefix_share) : 0;
        if (shared) {
            rng_t g;
            td_rng_seed(&g, s->seed * 31 + (uint64_t)q->group + 1);
            if ((rc = append_words(w, &g, shared, &q->prompt, &len, &cap)))
                return rc;
        }
        if ((rc = append_words(w, &r, q->input_len - shared, &q->prompt, &len, &cap)))
            return rc;
        w->n++;
    }
    return TD_OK;
}

static td_status_t trace_line_error(const char *path, size_t line, const char *field, const char *what)
{
    return td_error(TD_ERR_FORMAT, "bench: %s:%zu: field '%s' %s", path, line, field, what);
}

td_status_t bench_trace(bench_workload_t *w, const char *path, const bench_trace_opts_t *o, size_t max_n)
{
    uint32_t block = o->block_tokens ? o->block_tokens : 512, divide = o->divide ? o->divide : 1;
    if (block % divide)
        return td_error(TD_ERR_INVALID_ARG, "bench: the trace's block size (%u tokens) is not a multiple of the "
                        "divisor %u", block, divide);
    FILE *f = fopen(path, "r");
    if (!f)
        return td_error(TD_ERR_IO, "bench: %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t lcap = 0, lineno = 0;
    ssize_t got;
    td_status_t rc = TD_OK;
    double t0 = -1;
    while (rc == TD_OK && (got = getline(&line, &lcap, f)) > 0 && (!max_n || w->n < max_n)) {
        lineno++;
        if (got <= 1 && (line[0] == '\n' || line[0] == '\0'))
            continue;
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        if (!j || !json_is_object(j)) {
            rc = td_error(TD_ERR_FORMAT, "bench: %s:%zu: not a JSON object (%s)", path, lineno, j ? "" : err.text);
            json_decref(j);
            break;
        }
        json_t *ts = json_object_get(j, "timestamp"), *in = json_object_get(j, "input_length"),
               *out = json_object_get(j, "output_length"), *ids = json_object_get(j, "hash_ids");
        if (!json_is_number(ts) || json_number_value(ts) < 0)
            rc = trace_line_error(path, lineno, "timestamp", "is missing or not a non-negative number (ms)");
        else if (!json_is_integer(in) || json_integer_value(in) < 1 || json_integer_value(in) > 1 << 20)
            rc = trace_line_error(path, lineno, "input_length", "is missing or not an integer in 1..1048576");
        else if (!json_is_integer(out) || json_integer_value(out) < 1 || json_integer_value(out) > 1 << 20)
            rc = trace_line_error(path, lineno, "output_length", "is missing or not an integer in 1..1048576");
        else if (!json_is_array(ids) || json_array_size(ids) * block < (size_t)json_integer_value(in) ||
                 (json_array_size(ids) - 1) * block >= (size_t)json_integer_value(in))
            rc = td_error(TD_ERR_FORMAT, "bench: %s:%zu: field 'hash_ids' is missing or does not cover "
                          "input_length in blocks of %u tokens (the trace's block size: --trace-block)",
                          path, lineno, block);
        for (size_t i = 0; !rc && i < json_array_size(ids); i++)
            if (!json_is_integer(json_array_get(ids, i)) || json_integer_value(json_array_get(ids, i)) < 0)
                rc = trace_line_error(path, lineno, "hash_ids", "holds something other than non-negative integers");
        if (!rc && !(rc = grow(w, w->n + 1))) {
            bench_request_t *q = &w->req[w->n];
            memset(q, 0, sizeof *q);
            double t = json_number_value(ts) / 1000.0;
            if (t0 < 0)
                t0 = t;
            q->t_send = (t - t0) * o->time_scale;
            /* scaled: lengths and the block size divided alike, so the ids still cover the prompt */
            q->input_len = (uint32_t)((json_integer_value(in) + divide - 1) / divide);
            q->output_len = (uint32_t)((json_integer_value(out) + divide - 1) / divide);
            q->group = -1;
            size_t len = 0, cap = 0;
            for (size_t i = 0; i < json_array_size(ids); i++)
                bench_block_text(w, (uint64_t)json_integer_value(json_array_get(ids, i)), block / divide,
                                 &q->prompt, &len, &cap);
            /* the last block holds only what input_length leaves: cut after that many words */
            size_t words = 0, cut = 0;
            for (size_t k = 0; k < len && words <= q->input_len; k++)
                if (q->prompt[k] == ' ' && ++words == q->input_len + 1)
                    cut = k;
            if (cut)
                q->prompt[cut] = '\0';
            if (!q->prompt)
                rc = td_error(TD_ERR_NO_MEMORY, "bench: no memory");
            else
                w->n++;
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    if (!rc && !w->n)
        rc = td_error(TD_ERR_FORMAT, "bench: %s holds no requests", path);
    return rc;
}

td_status_t bench_prompts(bench_workload_t *w, const char *path, double rate, uint32_t max_tokens, size_t max_n)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return td_error(TD_ERR_IO, "bench: %s: %s", path, strerror(errno));
    if (!(rate > 0)) {
        fclose(f);
        return td_error(TD_ERR_INVALID_ARG, "bench: a prompts file needs a positive --rate");
    }
    char *line = NULL;
    size_t lcap = 0, lineno = 0;
    td_status_t rc = TD_OK;
    rng_t r;
    td_rng_seed(&r, 7);
    double t = 0;
    while (rc == TD_OK && getline(&line, &lcap, f) > 0 && (!max_n || w->n < max_n)) {
        lineno++;
        if (line[0] == '\n')
            continue;
        json_t *o = json_loads(line, 0, NULL);
        json_t *p = json_object_get(o, "prompt"), *m = json_object_get(o, "messages"),
               *mt = json_object_get(o, "max_tokens");
        if (!json_is_object(o) || (!json_is_string(p) && !json_is_array(m))) {
            rc = td_error(TD_ERR_FORMAT, "bench: %s:%zu: field 'prompt' (a string) or 'messages' (an array) is "
                          "missing", path, lineno);
        } else if (mt && (!json_is_integer(mt) || json_integer_value(mt) < 1)) {
            rc = td_error(TD_ERR_FORMAT, "bench: %s:%zu: field 'max_tokens' is not a positive integer", path, lineno);
        } else if (!(rc = grow(w, w->n + 1))) {
            bench_request_t *q = &w->req[w->n++];
            memset(q, 0, sizeof *q);
            q->t_send = t;
            t += -log(rng_unit(&r)) / rate;
            q->chat = !json_is_string(p);
            char salt[32] = "";
            if (w->salt) /* a few tokens ahead of the text: no block shared with another salt's prompts */
                snprintf(salt, sizeof salt, "[%llu] ", (unsigned long long)w->salt);
            json_t *first = q->chat ? json_array_get(m, 0) : NULL;
            json_t *fc = first ? json_object_get(first, "content") : NULL;
            if (salt[0] && q->chat && json_is_string(fc)) {
                char *c = NULL;
                if (asprintf(&c, "%s%s", salt, json_string_value(fc)) > 0) {
                    json_object_set_new(first, "content", json_string(c));
                    free(c);
                }
            }
            if (q->chat)
                q->prompt = json_dumps(m, JSON_COMPACT);
            else if (asprintf(&q->prompt, "%s%s", salt, json_string_value(p)) < 0)
                q->prompt = NULL;
            q->output_len = mt ? (uint32_t)json_integer_value(mt) : max_tokens;
            q->group = -1;
        }
        json_decref(o);
    }
    free(line);
    fclose(f);
    return rc;
}

void bench_workload_free(bench_workload_t *w)
{
    for (size_t i = 0; i < w->n; i++)
        free(w->req[i].prompt);
    free(w->req);
    for (size_t i = 0; i < w->n_words; i++)
        free(w->words[i]);
    free(w->words);
    memset(w, 0, sizeof *w);
}
