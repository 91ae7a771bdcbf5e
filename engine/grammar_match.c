/* grammar_match.c — structured output's matcher (grammar.h): the
 * vocabulary in byte order, the parse stacks a text leaves open, the masks.
 *
 * A parse stack is a linked list of frames, each the position of the next
 * element to match; frames are nodes in one array (index 0: the empty stack,
 * the text complete), shared between stacks. A stack is kept expanded: its top
 * is a byte set, or it is empty. Entering a rule pushes one frame per
 * alternative over the frame to return to — none when the reference ends its
 * alternative, so repetition (a rule that ends by entering itself) does not
 * grow the stack. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/grow.h"
#include "common/log.h"
#include "engine/grammar_int.h"

#define MAX_STACKS 512 /* parse stacks one text may leave open */
#define MAX_TOKEN_BYTES 256

/* ---------------------------------------------------------------- the vocabulary in byte order */

struct eng_vocab_index {
    int32_t n_vocab;
    uint32_t n;          /* tokens walked */
    int32_t *order;      /* their ids, by bytes */
    uint32_t *off;       /* each one's bytes in bytes[] */
    uint16_t *len, *lcp; /* lcp: bytes in common with the one before */
    uint32_t *pos_of;    /* a token id's place in order (UINT32_MAX: not walked) */
    uint8_t *bytes;
    int32_t eog[8];
    uint32_t n_eog;
};

static const uint8_t *sort_bytes;
static const uint32_t *sort_off;
static const uint16_t *sort_len;

static int by_bytes(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    size_t lx = sort_len[x], ly = sort_len[y];
    int c = memcmp(sort_bytes + sort_off[x], sort_bytes + sort_off[y], lx < ly ? lx : ly);
    return c ? c : lx < ly ? -1 : lx > ly;
}

td_status_t eng_vocab_index_create(const eng_tokenizer_t *tok, const int32_t *eog, size_t n_eog,
                                   eng_vocab_index_t **out)
{
    eng_vocab_index_t *v = calloc(1, sizeof *v);
    int32_t V = eng_tokenizer_n_vocab(tok);
    uint32_t *ix = malloc((size_t)V * sizeof *ix), *off = malloc((size_t)V * sizeof *off);
    uint16_t *len = malloc((size_t)V * sizeof *len);
    uint8_t *bytes = malloc((size_t)V * 16 + MAX_TOKEN_BYTES);
    size_t used = 0, cap = (size_t)V * 16 + MAX_TOKEN_BYTES;
    if (!v || !ix || !off || !len || !bytes)
        goto oom;
    v->n_vocab = V;
    for (size_t i = 0; i < n_eog && v->n_eog < 8; i++)
        v->eog[v->n_eog++] = eog[i];
    for (int32_t t = 0; t < V; t++) {
        eng_tok_type_t ty = eng_tokenizer_token_type(tok, t);
        len[t] = 0;
        off[t] = (uint32_t)used;
        if (ty == ENG_TOK_TYPE_CONTROL || ty == ENG_TOK_TYPE_UNUSED || ty == ENG_TOK_TYPE_UNKNOWN)
            continue;
        if (used + MAX_TOKEN_BYTES > cap) {
            uint8_t *nb = realloc(bytes, cap * 2);
            if (!nb)
                goto oom;
            bytes = nb;
            cap *= 2;
        }
        size_t n = eng_tokenizer_token_bytes(tok, t, (char *)bytes + used, MAX_TOKEN_BYTES);
        if (n > MAX_TOKEN_BYTES) /* longer than any grammar text needs in one token: left out */
            n = 0;
        len[t] = (uint16_t)n;
        used += n;
    }
    uint32_t n = 0;
    for (int32_t t = 0; t < V; t++)
        if (len[t])
            ix[n++] = (uint32_t)t;
    sort_bytes = bytes, sort_off = off, sort_len = len;
    qsort(ix, n, sizeof *ix, by_bytes); /* once per model, on the engine thread */
    v->n = n;
    v->order = malloc((n ? n : 1) * sizeof *v->order);
    v->off = malloc((n ? n : 1) * sizeof *v->off);
    v->len = malloc((n ? n : 1) * sizeof *v->len);
    v->lcp = malloc((n ? n : 1) * sizeof *v->lcp);
    v->pos_of = malloc((size_t)V * sizeof *v->pos_of);
    if (!v->order || !v->off || !v->len || !v->lcp || !v->pos_of)
        goto oom;
    for (int32_t t = 0; t < V; t++)
        v->pos_of[t] = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t = ix[i];
        v->order[i] = (int32_t)t;
        v->pos_of[t] = i;
        v->off[i] = off[t];
        v->len[i] = len[t];
        uint16_t l = 0;
        if (i) {
            uint32_t p = ix[i - 1];
            while (l < len[t] && l < len[p] && bytes[off[t] + l] == bytes[off[p] + l])
                l++;
        }
        v->lcp[i] = l;
    }
    v->bytes = bytes;
    free(ix), free(off), free(len);
    *out = v;
    return TD_OK;
oom:
    free(ix), free(off), free(len), free(bytes);
    eng_vocab_index_free(v);
    return td_error(TD_ERR_NO_MEMORY, "structured output: no memory for the vocabulary's index");
}

void eng_vocab_index_free(eng_vocab_index_t *v)
{
    if (!v)
        return;
    free(v->order), free(v->off), free(v->len), free(v->lcp), free(v->pos_of), free(v->bytes);
    free(v);
}

/* ---------------------------------------------------------------- the matcher */

typedef struct frame {
    uint32_t pos, up; /* the next element; the frame below (0: none) */
} frame_t;

struct eng_matcher {
    eng_grammar_t *g; /* its masks are kept in it */
    const eng_vocab_index_t *v;
    frame_t *fr;          /* [0] unused: 0 is the empty stack */
    size_t n_fr, cap_fr;
    uint32_t *cur;        /* the text's open stacks (tops of frames; 0: complete) */
    size_t n_cur, cap_cur;
    /* the walk: sets of stacks after d bytes of the token, one after another in lv, level d at lv_at[d] */
    uint32_t *lv;
    size_t n_lv, cap_lv;
    size_t lv_at[MAX_TOKEN_BYTES + 2], fr_at[MAX_TOKEN_BYTES + 2];
    uint32_t *work;
    size_t cap_work;
    uint8_t *allowed;     /* the walk's tokens allowed, a bit each */
    uint32_t *sig;        /* the open stacks' signature (mask_entry_t) */
    size_t cap_sig;
    uint32_t *remap;      /* compaction: old frame → new (0: not yet) */
    size_t cap_remap;
    frame_t *spare;       /* compaction's other array */
    size_t cap_spare;
};

static uint32_t push_frame(eng_matcher_t *m, uint32_t pos, uint32_t up)
{
    if (!td_grow((void **)&m->fr, &m->cap_fr, m->n_fr + 1, sizeof *m->fr, 1024))
        return UINT32_MAX;
    m->fr[m->n_fr] = (frame_t){pos, up};
    return (uint32_t)m->n_fr++;
}

/* Adds stack s to the set being built at lv[from..), unless it is there. */
static bool set_add_stack(eng_matcher_t *m, size_t from, uint32_t s)
{
    for (size_t i = from; i < m->n_lv; i++) {
        uint32_t t = m->lv[i];
        if (t == s || (t && s && m->fr[t].pos == m->fr[s].pos && m->fr[t].up == m->fr[s].up))
            return true;
    }
    if (m->n_lv - from >= MAX_STACKS)
        return true; /* an ambiguous grammar: the stacks past the most are dropped */
    if (!td_grow((void **)&m->lv, &m->cap_lv, m->n_lv + 1, sizeof *m->lv, 256))
        return false;
    m->lv[m->n_lv++] = s;
    return true;
}

/* Expands stack s (its top frame at any element) into stacks whose tops are
 * byte sets, or the empty stack, added to the set at lv[from..). */
static bool expand(eng_matcher_t *m, size_t from, uint32_t s)
{
    const eng_grammar_t *g = m->g;
    size_t nw = 0, steps = 0;
    if (!td_grow((void **)&m->work, &m->cap_work, 1, sizeof *m->work, 64))
        return false;
    m->work[nw++] = s;
    while (nw) {
        if (++steps > 64 * MAX_STACKS) /* a rule that enters itself without a byte between: left recursion */
            return false;
        uint32_t f = m->work[--nw];
        if (!f) {
            if (!set_add_stack(m, from, 0))
                return false;
            continue;
        }
        const elem_t *e = &g->el[m->fr[f].pos];
        uint32_t up = m->fr[f].up;
        if (e->kind == E_SET) {
            if (!set_add_stack(m, from, f))
                return false;
        } else if (e->kind == E_END || e->kind == E_ALT) { /* the alternative is over: back to the frame below */
            m->work[nw++] = up; /* room: f's place */
        } else { /* E_REF: each alternative of the rule, over the rest of this one (none left: the frame below) */
            uint32_t pos = m->fr[f].pos, below = up, rule = e->v;
            const elem_t *next = &g->el[pos + 1];
            if (next->kind != E_END && next->kind != E_ALT && (below = push_frame(m, pos + 1, up)) == UINT32_MAX)
                return false;
            for (uint32_t a = g->rule_at[rule];; a++) {
                uint32_t nf = push_frame(m, a, below);
                if (nf == UINT32_MAX || !td_grow((void **)&m->work, &m->cap_work, nw + 1, sizeof *m->work, 64))
                    return false;
                m->work[nw++] = nf;
                while (g->el[a].kind != E_ALT && g->el[a].kind != E_END) /* to the next alternative */
                    a++;
                if (g->el[a].kind == E_END)
                    break;
            }
        }
    }
    return true;
}

/* The set after byte c from the set lv[a..b), appended to lv; false without memory. */
static bool advance(eng_matcher_t *m, size_t a, size_t b, uint8_t c)
{
    const eng_grammar_t *g = m->g;
    size_t from = m->n_lv;
    for (size_t i = a; i < b; i++) {
        uint32_t f = m->lv[i];
        if (!f)
            continue;
        const elem_t *e = &g->el[m->fr[f].pos];
        if (!(g->sets[e->v][c >> 3] & (1u << (c & 7))))
            continue;
        uint32_t nf = push_frame(m, m->fr[f].pos + 1, m->fr[f].up);
        if (nf == UINT32_MAX || !expand(m, from, nf))
            return false;
    }
    return true;
}

td_status_t eng_matcher_create(eng_grammar_t *g, const eng_vocab_index_t *v, eng_matcher_t **out)
{
    eng_matcher_t *m = calloc(1, sizeof *m);
    if (!m || !(m->allowed = malloc(((size_t)v->n_vocab + 7) / 8)) || push_frame(m, 0, 0) == UINT32_MAX) {
        eng_matcher_free(m);
        return td_error(TD_ERR_NO_MEMORY, "structured output: no memory for a matcher");
    }
    m->g = g;
    m->v = v;
    /* the text: each alternative of rule 0, over nothing */
    m->n_lv = 0;
    bool ok = true;
    for (uint32_t a = g->rule_at[0]; ok;) {
        uint32_t f = push_frame(m, a, 0);
        ok = f != UINT32_MAX && expand(m, 0, f);
        while (g->el[a].kind != E_ALT && g->el[a].kind != E_END)
            a++;
        if (g->el[a].kind == E_END)
            break;
        a++;
    }
    if (ok && td_grow((void **)&m->cur, &m->cap_cur, m->n_lv ? m->n_lv : 1, sizeof *m->cur, 16)) {
        memcpy(m->cur, m->lv, m->n_lv * sizeof *m->cur);
        m->n_cur = m->n_lv;
        *out = m;
        return TD_OK;
    }
    eng_matcher_free(m);
    return td_error(TD_ERR_NO_MEMORY, "structured output: no memory for a matcher");
}

void eng_matcher_free(eng_matcher_t *m)
{
    if (!m)
        return;
    free(m->fr), free(m->cur), free(m->lv), free(m->work), free(m->allowed), free(m->remap), free(m->spare);
    free(m->sig);
    free(m);
}

bool eng_matcher_complete(const eng_matcher_t *m)
{
    for (size_t i = 0; i < m->n_cur; i++)
        if (!m->cur[i])
            return true;
    return false;
}

static bool is_eog(const eng_vocab_index_t *v, int32_t tok)
{
    for (uint32_t i = 0; i < v->n_eog; i++)
        if (v->eog[i] == tok)
            return true;
    return false;
}

/* The signature of the open stacks into m->sig; its length (0: no memory). */
static size_t signature(eng_matcher_t *m)
{
    size_t n = 0;
    for (size_t i = 0; i < m->n_cur; i++) {
        for (uint32_t f = m->cur[i];; f = m->fr[f].up) {
            if (!td_grow((void **)&m->sig, &m->cap_sig, n + 1, sizeof *m->sig, 64))
                return 0;
            m->sig[n++] = f ? m->fr[f].pos : UINT32_MAX; /* UINT32_MAX: the stack's bottom */
            if (!f)
                break;
        }
    }
    return n;
}

static uint64_t sig_hash(const uint32_t *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

/* logits of the tokens not allowed (bits) set to -inf, the end tokens kept where the text is complete */
static void apply_bits(const eng_matcher_t *m, const uint8_t *bits, float *logits)
{
    const eng_vocab_index_t *v = m->v;
    bool complete = eng_matcher_complete(m);
    for (int32_t t = 0; t < v->n_vocab; t++)
        if (!(bits[t >> 3] & (1u << (t & 7))) && !(complete && is_eog(v, t)))
            logits[t] = -INFINITY;
}

static size_t walk_mask(eng_matcher_t *m);

/* The tokens allowed next, a bit each (the masks kept for the same place in the grammar, else a walk, then kept),
 * the end tokens not counted; *n_ok: how many */
static const uint8_t *allowed_bits(eng_matcher_t *m, size_t *n_ok)
{
    eng_grammar_t *g = m->g;
    const eng_vocab_index_t *v = m->v;
    size_t n_sig = signature(m), nb = ((size_t)v->n_vocab + 7) / 8;
    uint64_t h = sig_hash(m->sig, n_sig);
    if (g->mask_vocab != v->n_vocab) { /* masks of another vocabulary: none kept */
        for (int i = 0; i < GRAMMAR_MASKS; i++)
            g->masks[i].n_sig = 0;
        g->mask_vocab = v->n_vocab;
    }
    mask_entry_t *hit = NULL, *old = &g->masks[0];
    for (int i = 0; i < GRAMMAR_MASKS && n_sig; i++) {
        mask_entry_t *e = &g->masks[i];
        if (e->n_sig == n_sig && e->hash == h && !memcmp(e->sig, m->sig, n_sig * sizeof *m->sig)) {
            hit = e;
            break;
        }
        if (e->used < old->used)
            old = e;
    }
    if (hit) {
        hit->used = ++g->mask_clock;
        *n_ok = hit->n_ok;
        return hit->bits;
    }
    *n_ok = walk_mask(m);
    /* kept for the next text at the same place (unless there is no memory for it) */
    if (n_sig && td_grow((void **)&old->sig, &old->cap_sig, n_sig, sizeof *old->sig, 64) &&
        (old->bits || (old->bits = malloc(nb)))) {
        memcpy(old->sig, m->sig, n_sig * sizeof *m->sig);
        memcpy(old->bits, m->allowed, nb);
        old->n_sig = n_sig;
        old->hash = h;
        old->used = ++g->mask_clock;
        old->n_ok = *n_ok;
    }
    return m->allowed;
}

size_t eng_matcher_mask(eng_matcher_t *m, float *logits)
{
    size_t n_ok;
    const uint8_t *bits = allowed_bits(m, &n_ok);
    apply_bits(m, bits, logits);
    return n_ok + (eng_matcher_complete(m) ? m->v->n_eog : 0);
}

size_t eng_matcher_allowed(eng_matcher_t *m, uint8_t *bits)
{
    const eng_vocab_index_t *v = m->v;
    size_t n_ok;
    memcpy(bits, allowed_bits(m, &n_ok), ((size_t)v->n_vocab + 7) / 8);
    if (!eng_matcher_complete(m))
        return n_ok;
    for (uint32_t i = 0; i < v->n_eog; i++) /* an end token may come where the text is complete */
        if (v->eog[i] >= 0 && v->eog[i] < v->n_vocab)
            bits[v->eog[i] >> 3] |= (uint8_t)(1u << (v->eog[i] & 7));
    return n_ok + v->n_eog;
}

/* The tokens that can come next, into m->allowed (a bit each); how many. */
static size_t walk_mask(eng_matcher_t *m)
{
    const eng_vocab_index_t *v = m->v;
    memset(m->allowed, 0, ((size_t)v->n_vocab + 7) / 8);
    size_t base_fr = m->n_fr, n_ok = 0;
    /* level 0: the text's stacks */
    m->n_lv = 0;
    if (td_grow((void **)&m->lv, &m->cap_lv, m->n_cur + 1, sizeof *m->lv, 256)) {
        memcpy(m->lv, m->cur, m->n_cur * sizeof *m->lv);
        m->n_lv = m->n_cur;
    }
    m->lv_at[0] = 0;
    m->lv_at[1] = m->n_lv;
    m->fr_at[0] = base_fr;
    size_t valid = 0; /* levels 0 .. valid hold the walk's current prefix */
    for (uint32_t i = 0; i < v->n && m->n_cur; i++) {
        const uint8_t *b = v->bytes + v->off[i];
        size_t len = v->len[i], d = v->lcp[i] < valid ? v->lcp[i] : valid;
        m->n_lv = m->lv_at[d + 1]; /* levels 0 .. d kept, and the frames they use */
        m->n_fr = m->fr_at[d];
        bool alive = m->lv_at[d + 1] > m->lv_at[d], ok = true;
        while (alive && d < len) {
            if (!(ok = advance(m, m->lv_at[d], m->lv_at[d + 1], b[d])))
                break;
            m->lv_at[d + 2] = m->n_lv;
            m->fr_at[d + 1] = m->n_fr;
            d++;
            alive = m->lv_at[d + 1] > m->lv_at[d];
        }
        valid = d;
        if (alive && ok && d == len) {
            m->allowed[v->order[i] >> 3] |= (uint8_t)(1u << (v->order[i] & 7));
            n_ok++;
        } else if (!alive) { /* the tokens after it that start with the dead prefix (its d bytes) die too */
            while (i + 1 < v->n && v->lcp[i + 1] >= d)
                i++;
        } else { /* no memory: this token is not allowed, the walk starts again from the text */
            valid = 0;
        }
    }
    m->n_fr = base_fr;
    return n_ok;
}

/* Keeps only the frames the stacks in cur use (the walk's and the past's are
 * dropped), renumbered into the spare array, which becomes the frames. */
static bool compact(eng_matcher_t *m)
{
    if (!td_grow((void **)&m->remap, &m->cap_remap, m->n_fr, sizeof *m->remap, 1024) ||
        !td_grow((void **)&m->spare, &m->cap_spare, m->n_fr, sizeof *m->spare, 1024))
        return false;
    memset(m->remap, 0, m->n_fr * sizeof *m->remap);
    const frame_t *old = m->fr;
    frame_t *nf = m->spare;
    size_t n = 1;
    nf[0] = (frame_t){0, 0};
    for (size_t i = 0; i < m->n_cur; i++) { /* a frame is copied after the frames below it */
        uint32_t chain[1024];
        size_t depth = 0;
        for (uint32_t f = m->cur[i]; f && !m->remap[f]; f = old[f].up) {
            if (depth == sizeof chain / sizeof *chain)
                return false;
            chain[depth++] = f;
        }
        while (depth--) {
            uint32_t f = chain[depth];
            nf[n] = (frame_t){old[f].pos, old[f].up ? m->remap[old[f].up] : 0};
            m->remap[f] = (uint32_t)n++;
        }
        m->cur[i] = m->cur[i] ? m->remap[m->cur[i]] : 0;
    }
    frame_t *t = m->fr;
    size_t tc = m->cap_fr;
    m->fr = m->spare, m->cap_fr = m->cap_spare;
    m->spare = t, m->cap_spare = tc;
    m->n_fr = n;
    return true;
}

bool eng_matcher_accept(eng_matcher_t *m, int32_t tok)
{
    const eng_vocab_index_t *v = m->v;
    if (is_eog(v, tok))
        return eng_matcher_complete(m);
    uint32_t at = tok >= 0 && tok < v->n_vocab ? v->pos_of[tok] : UINT32_MAX;
    if (at == UINT32_MAX)
        return false;
    const uint8_t *b = v->bytes + v->off[at];
    size_t len = v->len[at];
    size_t base_fr = m->n_fr;
    m->n_lv = 0;
    if (!td_grow((void **)&m->lv, &m->cap_lv, m->n_cur + 1, sizeof *m->lv, 256))
        return false;
    memcpy(m->lv, m->cur, m->n_cur * sizeof *m->lv);
    m->n_lv = m->n_cur;
    size_t a = 0, e = m->n_lv;
    for (size_t i = 0; i < len; i++) {
        if (!advance(m, a, e, b[i]) || m->n_lv == e) {
            m->n_fr = base_fr;
            return false;
        }
        a = e;
        e = m->n_lv;
    }
    if (!td_grow((void **)&m->cur, &m->cap_cur, e - a, sizeof *m->cur, 16))
        return false;
    memcpy(m->cur, m->lv + a, (e - a) * sizeof *m->cur);
    m->n_cur = e - a;
    return compact(m);
}
