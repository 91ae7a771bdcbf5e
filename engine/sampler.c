/* sampler.c — see sampler.h. Candidates are sorted only as far as top-k /
 * top-p need (a partial selection, then a sort of the survivors). */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

eng_sampling_t eng_sampling_default(void)
{
    return (eng_sampling_t){.temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .repetition_penalty = 1};
}

td_status_t eng_sampling_validate(const eng_sampling_t *s, int32_t n_vocab)
{
    if (!(s->temperature >= 0) || s->temperature > 100)
        return td_user_error("temperature %g is outside [0, 100]", s->temperature);
    if (s->top_k < 0)
        return td_user_error("top_k %d is negative (0 turns it off)", s->top_k);
    if (!(s->top_p > 0 && s->top_p <= 1))
        return td_user_error("top_p %g is outside (0, 1]", s->top_p);
    if (!(s->min_p >= 0 && s->min_p < 1))
        return td_user_error("min_p %g is outside [0, 1)", s->min_p);
    if (!(s->repetition_penalty > 0) || s->repetition_penalty > 10)
        return td_user_error("repetition_penalty %g is outside (0, 10]", s->repetition_penalty);
    if (!(fabsf(s->presence_penalty) <= 2))
        return td_user_error("presence_penalty %g is outside [-2, 2]", s->presence_penalty);
    if (!(fabsf(s->frequency_penalty) <= 2))
        return td_user_error("frequency_penalty %g is outside [-2, 2]", s->frequency_penalty);
    if (s->top_logprobs > ENG_MAX_LOGPROBS)
        return td_user_error("top_logprobs %u is over %d", s->top_logprobs, ENG_MAX_LOGPROBS);
    if (s->n_stop_ids > ENG_MAX_STOP_IDS)
        return td_user_error("%zu stop_token_ids, at most %d", s->n_stop_ids, ENG_MAX_STOP_IDS);
    for (size_t i = 0; i < s->n_stop_ids; i++)
        if (s->stop_ids[i] < 0 || s->stop_ids[i] >= n_vocab)
            return td_user_error("stop_token_ids names token %d, outside the vocabulary of %d", s->stop_ids[i],
                                 n_vocab);
    for (size_t i = 0; i < s->n_logit_bias; i++) {
        if (s->logit_bias[i].token < 0 || s->logit_bias[i].token >= n_vocab)
            return td_user_error("logit_bias names token %d, outside the vocabulary of %d", s->logit_bias[i].token,
                                 n_vocab);
        if (!(fabsf(s->logit_bias[i].bias) <= 100))
            return td_user_error("logit_bias for token %d is %g, outside [-100, 100]", s->logit_bias[i].token,
                                 s->logit_bias[i].bias);
    }
    return TD_OK;
}

td_status_t eng_sampler_init(eng_sampler_t *s, const eng_sampling_t *p, int32_t n_vocab)
{
    memset(s, 0, sizeof *s);
    td_status_t rc = eng_sampling_validate(p, n_vocab);
    if (rc)
        return rc;
    s->p = *p;
    if (p->n_stop_ids) /* memcpy's source may not be NULL, even for nothing */
        memcpy(s->stop_ids, p->stop_ids, p->n_stop_ids * sizeof *s->stop_ids);
    s->p.stop_ids = s->stop_ids;
    s->n_vocab = n_vocab;
    s->work = malloc((size_t)n_vocab * sizeof *s->work);
    s->idx = malloc((size_t)n_vocab * sizeof *s->idx);
    if (!s->work || !s->idx) {
        eng_sampler_free(s);
        return td_error(TD_ERR_NO_MEMORY, "sampler: no memory");
    }
    td_rng_seed(&s->rng, p->seed);
    return TD_OK;
}

void eng_sampler_free(eng_sampler_t *s)
{
    free(s->work);
    free(s->idx);
    eng_matcher_free(s->matcher);
    s->work = NULL;
    s->idx = NULL;
    s->matcher = NULL;
}

static const float *cmp_vals;
static int cmp_desc(const void *a, const void *b)
{
    float x = cmp_vals[*(const int32_t *)a], y = cmp_vals[*(const int32_t *)b];
    if (x != y)
        return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

/* Reorders idx[0..n) so that idx[0..k) are the k largest by vals, sorted
 * (a quickselect, then a sort of the k). */
static void top_sorted(int32_t *idx, int32_t n, int32_t k, const float *vals)
{
    int32_t lo = 0, hi = n - 1;
    while (k < n && lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        float pv = vals[idx[mid]];
        int32_t t = idx[mid];
        idx[mid] = idx[hi];
        idx[hi] = t;
        int32_t store = lo;
        for (int32_t i = lo; i < hi; i++)
            if (vals[idx[i]] > pv) {
                t = idx[i];
                idx[i] = idx[store];
                idx[store] = t;
                store++;
            }
        t = idx[store];
        idx[store] = idx[hi];
        idx[hi] = t;
        if (store == k - 1 || store == k)
            break;
        if (store > k)
            hi = store - 1;
        else
            lo = store + 1;
    }
    cmp_vals = vals;
    qsort(idx, (size_t)(k < n ? k : n), sizeof *idx, cmp_desc);
}

void eng_sampler_set_eog(eng_sampler_t *s, const int32_t *eog, uint32_t n)
{
    s->n_eog = n < 8 ? n : 8;
    memcpy(s->eog, eog, s->n_eog * sizeof *eog);
}

bool eng_sampler_is_stop_id(const eng_sampler_t *s, int32_t tok)
{
    for (size_t i = 0; i < s->p.n_stop_ids; i++)
        if (s->stop_ids[i] == tok)
            return true;
    return false;
}

void eng_sampler_skip(eng_sampler_t *s, uint32_t n)
{
    s->n_sampled += n;
    if (s->p.temperature == 0) /* greedy draws nothing */
        return;
    for (uint32_t i = 0; i < n; i++)
        td_rng_u64(&s->rng);
}

int32_t eng_sampler_sample(eng_sampler_t *s, const float *logits, const int32_t *hist, size_t n_hist)
{
    const eng_sampling_t *p = &s->p;
    int32_t V = s->n_vocab;
    float *w = s->work;
    memcpy(w, logits, (size_t)V * sizeof *w);
    for (size_t i = 0; i < p->n_logit_bias; i++)
        w[p->logit_bias[i].token] += p->logit_bias[i].bias;
    if (s->n_sampled++ < p->min_tokens) { /* the end tokens and stop_ids are held back */
        for (uint32_t i = 0; i < s->n_eog; i++)
            w[s->eog[i]] = -INFINITY;
        for (size_t i = 0; i < p->n_stop_ids; i++)
            w[s->stop_ids[i]] = -INFINITY;
    }
    if (s->matcher && !eng_matcher_mask(s->matcher, w)) /* nothing continues the text: it ends */
        return s->n_eog ? s->eog[0] : 0;
    if (p->repetition_penalty != 1 || p->presence_penalty != 0 || p->frequency_penalty != 0) {
        memset(s->idx, 0, (size_t)V * sizeof *s->idx); /* idx as occurrence counts */
        for (size_t i = 0; i < n_hist; i++)
            if (hist[i] >= 0 && hist[i] < V)
                s->idx[hist[i]]++;
        for (int32_t t = 0; t < V; t++) {
            if (!s->idx[t])
                continue;
            if (p->repetition_penalty != 1)
                w[t] = w[t] > 0 ? w[t] / p->repetition_penalty : w[t] * p->repetition_penalty;
            w[t] -= p->presence_penalty + p->frequency_penalty * (float)s->idx[t];
        }
    }
    int32_t best = 0;
    for (int32_t t = 1; t < V; t++)
        if (w[t] > w[best])
            best = t;
    if (p->temperature == 0)
        return best;
    /* candidates: the top_k set, or all; probabilities relative to their softmax */
    int32_t limit = p->top_k > 0 && p->top_k < V ? p->top_k : V;
    for (int32_t t = 0; t < V; t++)
        s->idx[t] = t;
    float mx = w[best];
    int32_t m = limit < V ? limit : 64;
    int32_t keep = limit;
    double z = 0;
    if (limit == V)
        for (int32_t t = 0; t < V; t++)
            z += exp((double)(w[t] - mx) / p->temperature);
    bool cut = p->top_p < 1 || p->min_p > 0;
    if (!cut && limit < V)
        top_sorted(s->idx, V, limit, w);
    for (; cut;) { /* sort a growing head until both cut-offs fall inside it */
        top_sorted(s->idx, V, m, w);
        if (limit < V && m == limit) {
            z = 0;
            for (int32_t i = 0; i < m; i++)
                z += exp((double)(w[s->idx[i]] - mx) / p->temperature);
        }
        double first = 1.0, acc = 0;
        keep = m;
        bool settled = m == limit;
        for (int32_t i = 0; i < m; i++) {
            double e = exp((double)(w[s->idx[i]] - mx) / p->temperature);
            if (i == 0)
                first = e;
            if (p->min_p > 0 && e < p->min_p * first) {
                keep = i;
                settled = true;
                break;
            }
            acc += e;
            if (p->top_p < 1 && acc >= p->top_p * z) {
                keep = i + 1;
                settled = true;
                break;
            }
        }
        if (settled)
            break;
        m = m * 8 < limit ? m * 8 : limit;
    }
    double total = 0;
    for (int32_t i = 0; i < keep; i++)
        total += exp((double)(w[s->idx[i]] - mx) / p->temperature);
    double r = td_rng_unit(&s->rng) * total, acc = 0;
    for (int32_t i = 0; i < keep; i++) {
        acc += exp((double)(w[s->idx[i]] - mx) / p->temperature);
        if (r < acc)
            return s->idx[i];
    }
    return s->idx[keep - 1];
}

bool eng_sampler_on_device(const eng_sampler_t *s)
{
    const eng_sampling_t *p = &s->p;
    return !p->n_logit_bias && p->repetition_penalty == 1 && p->presence_penalty == 0 && p->frequency_penalty == 0 &&
           s->n_sampled >= p->min_tokens && !p->logprobs;
}

bool eng_sampler_masked(const eng_sampler_t *s) { return s->matcher != NULL; }

void eng_sampler_set_matcher(eng_sampler_t *s, eng_matcher_t *m)
{
    eng_matcher_free(s->matcher);
    s->matcher = m;
}

bool eng_sampler_accept(eng_sampler_t *s, int32_t tok) { return !s->matcher || eng_matcher_accept(s->matcher, tok); }

kern_sample_t eng_sampler_device(eng_sampler_t *s, uint8_t *mask)
{
    const eng_sampling_t *p = &s->p;
    bool masked = false;
    if (s->matcher) { /* nothing continues the text: it ends, as eng_sampler_sample ends it */
        masked = true;
        if (!eng_matcher_allowed(s->matcher, mask)) {
            const int32_t end = s->n_eog ? s->eog[0] : 0;
            memset(mask, 0, ((size_t)s->n_vocab + 7) / 8);
            mask[end >> 3] = (uint8_t)(1u << (end & 7));
        }
    }
    s->n_sampled++;
    return (kern_sample_t){.temperature = p->temperature, .top_p = p->top_p, .min_p = p->min_p, .top_k = p->top_k,
                           .u = p->temperature == 0 ? 0.0f : (float)td_rng_unit(&s->rng), .masked = masked};
}

double eng_logsumexp(const float *logits, int32_t n)
{
    float mx = logits[0];
    for (int32_t t = 1; t < n; t++)
        mx = logits[t] > mx ? logits[t] : mx;
    double z = 0;
    for (int32_t t = 0; t < n; t++)
        z += exp((double)logits[t] - mx);
    return mx + log(z);
}

void eng_sampler_logprobs(eng_sampler_t *s, const float *logits, int32_t tok, eng_logprobs_t *out)
{
    const int32_t V = s->n_vocab, k = (int32_t)s->p.top_logprobs;
    const double lse = eng_logsumexp(logits, V);
    out->logprob = (float)(logits[tok] - lse);
    out->n_top = (uint32_t)k;
    if (!k)
        return;
    for (int32_t t = 0; t < V; t++)
        s->idx[t] = t;
    top_sorted(s->idx, V, k, logits);
    for (int32_t i = 0; i < k; i++) {
        out->top_ids[i] = s->idx[i];
        out->top[i] = (float)(logits[s->idx[i]] - lse);
    }
}
