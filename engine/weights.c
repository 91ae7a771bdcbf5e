/* weights.c — see weights.h. */
#include "engine/weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "engine/safetensors.h"
#include "kernels/quant.h"

/* A tensor by role: its type, data and shape as (rows, cols) with cols contiguous. */
typedef struct found {
    uint32_t type;
    const void *data;
    uint64_t rows, cols;
    uint32_t n_dims;
} found_t;

static bool find(const eng_model_t *m, const char *gguf_name, const char *hf_name, found_t *f)
{
    if (!m->gguf && !m->st)
        return false;
    if (m->gguf) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_find(m->gguf, gguf_name);
        if (!t)
            return false;
        *f = (found_t){t->type, t->data, t->n_dims > 1 ? t->dims[1] : 1, t->dims[0], t->n_dims};
        return true;
    }
    const eng_st_tensor_t *t = eng_st_find(m->st, hf_name);
    if (!t)
        return false;
    *f = (found_t){t->type, t->data, t->n_dims > 1 ? t->dims[0] : 1, t->dims[t->n_dims - 1], t->n_dims};
    return true;
}

/* An F8_E4M3 matrix's scales as FP8 checkpoints publish them: the tensor
 * "<name>_scale" (HF "...weight_scale"), one value a row or one for the
 * matrix; *out: rows floats (malloc'd). */
static td_status_t fp8_scales(const eng_model_t *m, const char *name, uint32_t rows, float **out)
{
    char sname[128];
    snprintf(sname, sizeof sname, "%s_scale", name);
    const eng_st_tensor_t *t = m->st ? eng_st_find(m->st, sname) : NULL;
    if (!t)
        return td_error(TD_ERR_FORMAT, "%s: FP8 tensor %s has no scale (%s)", m->path, name, sname);
    uint64_t n = 1;
    for (uint32_t i = 0; i < t->n_dims; i++)
        n *= t->dims[i];
    if (n != 1 && n != rows)
        return td_error(TD_ERR_FORMAT, "%s: %s has %llu values: one, or one a row (%u), is read", m->path, sname,
                        (unsigned long long)n, rows);
    float *s = malloc((size_t)rows * sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", m->path);
    td_status_t rc = kern_dequant_row(t->type, t->data, s, n);
    for (uint32_t r = 1; !rc && n == 1 && r < rows; r++)
        s[r] = s[0];
    if (rc)
        free(s);
    else
        *out = s;
    return rc;
}

/* A matrix bound and prepared; a layer's matrix (layer true) held as the
 * model says (eng_model_t.hold; an FP8 file's always in FP8). */
/* The dummy load format's seed of a matrix: its (Hugging Face) name's FNV-1a hash. */
static uint64_t fill_seed(const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    return h;
}

/* The part of a matrix a tensor-parallel rank holds: rows [r0, r0 + rows) and columns [c0, c0 + cols) of the
 * whole (full_rows x full_cols); columns cut only at a quantization block's edge (eng_shard_plan checks). */
typedef struct cut {
    uint32_t full_rows, full_cols, r0, c0;
} cut_t;

/* Keeps memory a bound matrix reads (a part cut out of the file's rows) until the weights go. */
static td_status_t keep(eng_weights_t *w, void *p)
{
    if (w->n_owned == w->cap_owned) {
        uint32_t cap = w->cap_owned ? 2 * w->cap_owned : 16;
        void **o = realloc(w->owned, cap * sizeof *o);
        if (!o)
            return td_error(TD_ERR_NO_MEMORY, "weights: no memory");
        w->owned = o, w->cap_owned = cap;
    }
    w->owned[w->n_owned++] = p;
    return TD_OK;
}

static td_status_t matrix(const eng_model_t *m, kern_backend_t *be, const char *gname, const char *hname,
                          uint32_t rows, uint32_t cols, bool layer, const cut_t *cut, eng_weights_t *ws,
                          kern_weight_t *w)
{
    found_t f;
    const char *name = m->gguf ? gname : hname;
    const cut_t whole = {rows, cols, 0, 0};
    if (!cut)
        cut = &whole;
    if (m->dummy) { /* no file read: seeded values, filled by the backend */
        *w = (kern_weight_t){.type = KERN_TYPE_F16, .rows = rows, .cols = cols, .fill = fill_seed(hname),
                             .fill_row0 = cut->r0, .fill_col0 = cut->c0,
                             .hold = layer && m->hold == ENG_WEIGHTS_FP8 ? KERN_TYPE_F8_E4M3 : 0};
        return be->ops->weight_prepare(be, w);
    }
    if (!m->gguf && !m->st)
        return td_error(TD_ERR_NOT_FOUND, "%s: the folder has no weights (model.safetensors); the dummy load "
                        "format (model.load_format: dummy) fills seeded values instead, for benchmarks", m->path);
    if (!find(m, gname, hname, &f))
        return td_error(TD_ERR_FORMAT, "%s: tensor %s is missing", m->path, name);
    if (f.n_dims != 2 || f.rows != cut->full_rows || f.cols != cut->full_cols)
        return td_error(TD_ERR_FORMAT, "%s: tensor %s is %llu x %llu, the model description needs %u x %u", m->path,
                        name, (unsigned long long)f.rows, (unsigned long long)f.cols, cut->full_rows, cut->full_cols);
    const kern_type_info_t *ti = kern_type_info(f.type);
    if (!ti)
        return td_error(TD_ERR_UNSUPPORTED, "%s: tensor %s has type %u, which the engine does not read", m->path, name,
                        f.type);
    const size_t row_bytes = (size_t)cut->full_cols / ti->block_elems * ti->block_bytes;
    const uint8_t *data = (const uint8_t *)f.data + (size_t)cut->r0 * row_bytes;
    if (cols != cut->full_cols) { /* a rank's columns: each row's part copied out, whole blocks */
        if (cut->c0 % ti->block_elems || cols % ti->block_elems)
            return td_error(TD_ERR_INVALID_ARG, "%s: tensor %s: columns %u..%u are not whole %s blocks", m->path,
                            name, cut->c0, cut->c0 + cols, ti->name);
        const size_t part = (size_t)cols / ti->block_elems * ti->block_bytes;
        const size_t skip = (size_t)cut->c0 / ti->block_elems * ti->block_bytes;
        uint8_t *p = malloc((size_t)rows * part);
        if (!p)
            return td_error(TD_ERR_NO_MEMORY, "%s: no memory for a part of %s", m->path, name);
        for (uint32_t r = 0; r < rows; r++)
            memcpy(p + (size_t)r * part, data + (size_t)r * row_bytes + skip, part);
        td_status_t rc = keep(ws, p);
        if (rc) {
            free(p);
            return rc;
        }
        data = p;
    }
    *w = (kern_weight_t){.type = f.type, .rows = rows, .cols = cols, .data = data};
    float *scale = NULL;
    if (f.type == KERN_TYPE_F8_E4M3) {
        if (!layer || m->gguf)
            return td_error(TD_ERR_UNSUPPORTED, "%s: tensor %s is FP8: only a layer's matrices of a safetensors "
                            "model are read in FP8", m->path, name);
        td_status_t rc = fp8_scales(m, name, cut->full_rows, &scale);
        if (rc)
            return rc;
        w->scale = scale + cut->r0;
    }
    if (layer && (m->hold == ENG_WEIGHTS_FP8 || f.type == KERN_TYPE_F8_E4M3))
        w->hold = KERN_TYPE_F8_E4M3;
    td_status_t rc = be->ops->weight_prepare(be, w);
    free(scale);
    w->scale = NULL;
    return rc;
}

uint32_t eng_weights_col_block(const eng_model_t *m)
{
    found_t f;
    uint32_t most = 1;
    const char *g[] = {"blk.0.attn_output.weight", "blk.0.ffn_down.weight"};
    const char *h[] = {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"};
    for (int i = 0; i < 2 && !m->dummy; i++) {
        const kern_type_info_t *ti = find(m, g[i], h[i], &f) ? kern_type_info(f.type) : NULL;
        if (ti && ti->block_elems > most)
            most = ti->block_elems;
    }
    return most;
}

/* A vector as fp32 in backend memory, its values [off, off + len) of the file's n (len 0: all); optional vectors
 * may be absent (NULL). */
static td_status_t vector_part(const eng_model_t *m, kern_backend_t *be, const char *gname, const char *hname,
                               uint32_t n, uint32_t off, uint32_t len, bool optional, float **out)
{
    found_t f;
    const char *name = m->gguf ? gname : hname;
    *out = NULL;
    if (!len)
        len = n;
    if (m->dummy) { /* the dummy load format: norms of ones, no biases */
        if (optional)
            return TD_OK;
        n = len;
        float *ones = malloc(n * sizeof *ones);
        if (!ones)
            return td_error(TD_ERR_NO_MEMORY, "%s: no memory", m->path);
        for (uint32_t i = 0; i < n; i++)
            ones[i] = 1.0f;
        td_status_t rc = be->ops->alloc(be, n * sizeof(float), (void **)out);
        if (!rc)
            rc = be->ops->upload(be, *out, ones, n * sizeof(float));
        if (!rc)
            rc = be->ops->sync(be); /* the upload reads ones before they are freed */
        free(ones);
        return rc;
    }
    if (!find(m, gname, hname, &f))
        return optional ? TD_OK : td_error(TD_ERR_FORMAT, "%s: tensor %s is missing", m->path, name);
    if (f.rows * f.cols != n)
        return td_error(TD_ERR_FORMAT, "%s: tensor %s has %llu values, the model description needs %u", m->path, name,
                        (unsigned long long)(f.rows * f.cols), n);
    if (f.type == KERN_TYPE_F8_E4M3)
        return td_error(TD_ERR_UNSUPPORTED, "%s: tensor %s is FP8: only a layer's matrices are read in FP8", m->path,
                        name);
    float *host = malloc(n * sizeof *host);
    if (!host)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", m->path);
    td_status_t rc = kern_dequant_row(f.type, f.data, host, n);
    if (!rc)
        rc = be->ops->alloc(be, len * sizeof(float), (void **)out);
    if (!rc)
        rc = be->ops->upload(be, *out, host + off, len * sizeof(float));
    if (!rc)
        rc = be->ops->sync(be); /* the upload reads host before it is freed */
    free(host);
    return rc;
}

static td_status_t vector(const eng_model_t *m, kern_backend_t *be, const char *gname, const char *hname,
                          uint32_t n, bool optional, float **out)
{
    return vector_part(m, be, gname, hname, n, 0, 0, optional, out);
}

td_status_t eng_weights_bind(const eng_model_t *m, kern_backend_t *be, eng_weights_t *w)
{
    const eng_shard_t whole = eng_shard_whole(&m->desc);
    return eng_weights_bind_shard(m, be, &whole, w);
}

td_status_t eng_weights_bind_shard(const eng_model_t *m, kern_backend_t *be, const eng_shard_t *sh, eng_weights_t *w)
{
    const eng_model_desc_t *d = &m->desc;
    memset(w, 0, sizeof *w);
    w->layers = calloc(d->n_layers, sizeof *w->layers);
    if (!w->layers)
        return td_error(TD_ERR_NO_MEMORY, "weights: no memory");
    w->n_layers = d->n_layers;
    const uint32_t hd = d->head_dim, q_dim = d->n_heads * hd, kv_dim = d->n_kv_heads * hd;
    const uint32_t q_part = sh->q_heads * hd, kv_part = sh->kv_heads * hd, q0 = sh->q_head0 * hd;
    const uint32_t kv0 = sh->kv_head0 * hd;
    /* each matrix's part: by output rows (Q, K, V, gate, up, the output), by input columns (O, down) */
    const cut_t cq = {q_dim, d->hidden, q0, 0}, ckv = {kv_dim, d->hidden, kv0, 0}, co = {d->hidden, q_dim, 0, q0};
    const cut_t cf = {d->ffn, d->hidden, sh->ffn0, 0}, cd = {d->hidden, d->ffn, 0, sh->ffn0};
    const cut_t cv = {d->vocab, d->hidden, sh->vocab0, 0};
    const bool whole = sh->tp == 1;
    td_status_t rc;
    if ((rc = matrix(m, be, "token_embd.weight", "model.embed_tokens.weight", d->vocab, d->hidden, false, NULL, w,
                     &w->tok_embd)) ||
        (rc = vector(m, be, "output_norm.weight", "model.norm.weight", d->hidden, false, &w->out_norm)))
        return rc;
    if (d->tied_embeddings && whole)
        w->output = w->tok_embd;
    else if ((rc = d->tied_embeddings ? matrix(m, be, "token_embd.weight", "model.embed_tokens.weight", sh->vocab,
                                               d->hidden, false, &cv, w, &w->output)
                                      : matrix(m, be, "output.weight", "lm_head.weight", sh->vocab, d->hidden,
                                               false, &cv, w, &w->output)))
        return rc;
    for (uint32_t i = 0; i < d->n_layers; i++) {
        eng_layer_weights_t *L = &w->layers[i];
        char g[8][64], h[8][96];
        static const char *const gn[] = {"attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                         "ffn_gate", "ffn_up"};
        static const char *const hn[] = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                         "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                         "mlp.gate_proj", "mlp.up_proj"};
        for (int k = 0; k < 8; k++) {
            snprintf(g[k], sizeof g[k], "blk.%u.%s.weight", i, gn[k]);
            snprintf(h[k], sizeof h[k], "model.layers.%u.%s.weight", i, hn[k]);
        }
        char gd[64], hd_[96], gb[3][64], hb[3][96];
        snprintf(gd, sizeof gd, "blk.%u.ffn_down.weight", i);
        snprintf(hd_, sizeof hd_, "model.layers.%u.mlp.down_proj.weight", i);
        for (int k = 0; k < 3; k++) {
            snprintf(gb[k], sizeof gb[k], "blk.%u.%s.bias", i, gn[2 + k]);
            snprintf(hb[k], sizeof hb[k], "model.layers.%u.%s.bias", i, hn[2 + k]);
        }
        if ((rc = vector(m, be, g[0], h[0], d->hidden, false, &L->attn_norm)) ||
            (rc = vector(m, be, g[1], h[1], d->hidden, false, &L->ffn_norm)) ||
            (rc = matrix(m, be, g[2], h[2], q_part, d->hidden, true, &cq, w, &L->wq)) ||
            (rc = matrix(m, be, g[3], h[3], kv_part, d->hidden, true, &ckv, w, &L->wk)) ||
            (rc = matrix(m, be, g[4], h[4], kv_part, d->hidden, true, &ckv, w, &L->wv)) ||
            (rc = matrix(m, be, g[5], h[5], d->hidden, q_part, true, &co, w, &L->wo)) ||
            (rc = matrix(m, be, g[6], h[6], sh->ffn, d->hidden, true, &cf, w, &L->w_gate)) ||
            (rc = matrix(m, be, g[7], h[7], sh->ffn, d->hidden, true, &cf, w, &L->w_up)) ||
            (rc = matrix(m, be, gd, hd_, d->hidden, sh->ffn, true, &cd, w, &L->w_down)) ||
            (rc = vector_part(m, be, gb[0], hb[0], q_dim, q0, q_part, true, &L->bq)) ||
            (rc = vector_part(m, be, gb[1], hb[1], kv_dim, kv0, kv_part, true, &L->bk)) ||
            (rc = vector_part(m, be, gb[2], hb[2], kv_dim, kv0, kv_part, true, &L->bv)))
            return rc;
        /* the matrices one x multiplies, side by side where the backend multiplies them at once */
        kern_weight_t *qkv[3] = {&L->wq, &L->wk, &L->wv}, *gu[2] = {&L->w_gate, &L->w_up};
        if (be->ops->weights_join &&
            ((rc = be->ops->weights_join(be, qkv, 3)) || (rc = be->ops->weights_join(be, gu, 2))))
            return rc;
    }
    return TD_OK;
}

/* weight_scale_cols over every (matrix, norm) pair eng_weights_fold_norms folds; *fits false from the first that
 * does not fit on */
static td_status_t scale_pairs(eng_weights_t *w, kern_backend_t *be, bool tied, bool apply, bool *fits)
{
    td_status_t rc = TD_OK;
    *fits = true;
    for (uint32_t i = 0; i < w->n_layers && !rc && *fits; i++) {
        eng_layer_weights_t *L = &w->layers[i];
        kern_weight_t *ws[5] = {&L->wq, &L->wk, &L->wv, &L->w_gate, &L->w_up};
        for (int k = 0; k < 5 && !rc && *fits; k++)
            rc = be->ops->weight_scale_cols(be, ws[k], k < 3 ? L->attn_norm : L->ffn_norm, apply, fits);
    }
    if (!rc && *fits && !tied)
        rc = be->ops->weight_scale_cols(be, &w->output, w->out_norm, apply, fits);
    return rc;
}

td_status_t eng_weights_fold_norms(eng_weights_t *w, kern_backend_t *be, bool tied)
{
    if (!(be->ops->supported & KERN_OP_WEIGHT_SCALE_COLS) || w->norms_folded)
        return TD_OK;
    /* every check first, then every scaling: all of them or none */
    bool fits;
    td_status_t rc = scale_pairs(w, be, tied, false, &fits);
    if (rc)
        return rc;
    if (!fits) {
        TD_INFO("weights: the norms stay apart from the matmuls (a matrix times its norm's weight leaves the "
                "backend's type)");
        return TD_OK;
    }
    if ((rc = scale_pairs(w, be, tied, true, &fits)))
        return rc;
    if (!fits)
        return td_error(TD_ERR_INTERNAL, "weights: a norm's weight fitted its matmul, then did not");
    w->norms_folded = true;
    return TD_OK;
}

void eng_weights_release(eng_weights_t *w, kern_backend_t *be)
{
    if (!w->layers)
        return;
    for (uint32_t i = 0; i < w->n_layers; i++) {
        eng_layer_weights_t *L = &w->layers[i];
        float *vecs[] = {L->attn_norm, L->ffn_norm, L->bq, L->bk, L->bv};
        for (int k = 0; k < 5; k++)
            if (vecs[k])
                be->ops->free(be, vecs[k]);
        kern_weight_t *mats[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int k = 0; k < 7; k++)
            be->ops->weight_release(be, mats[k]);
    }
    if (w->out_norm)
        be->ops->free(be, w->out_norm);
    be->ops->weight_release(be, &w->tok_embd);
    if (w->output.data != w->tok_embd.data || w->output.rows != w->tok_embd.rows)
        be->ops->weight_release(be, &w->output);
    for (uint32_t i = 0; i < w->n_owned; i++)
        free(w->owned[i]);
    free(w->owned);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
