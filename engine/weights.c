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

static td_status_t matrix(const eng_model_t *m, kern_backend_t *be, const char *gname, const char *hname,
                          uint32_t rows, uint32_t cols, kern_weight_t *w)
{
    found_t f;
    const char *name = m->gguf ? gname : hname;
    if (!find(m, gname, hname, &f))
        return td_error(TD_ERR_FORMAT, "%s: tensor %s is missing", m->path, name);
    if (f.n_dims != 2 || f.rows != rows || f.cols != cols)
        return td_error(TD_ERR_FORMAT, "%s: tensor %s is %llu x %llu, the model description needs %u x %u", m->path,
                        name, (unsigned long long)f.rows, (unsigned long long)f.cols, rows, cols);
    *w = (kern_weight_t){.type = f.type, .rows = rows, .cols = cols, .data = f.data};
    return be->ops->weight_prepare(be, w);
}

/* A vector as fp32 in backend memory; optional vectors may be absent (NULL). */
static td_status_t vector(const eng_model_t *m, kern_backend_t *be, const char *gname, const char *hname,
                          uint32_t n, bool optional, float **out)
{
    found_t f;
    const char *name = m->gguf ? gname : hname;
    *out = NULL;
    if (!find(m, gname, hname, &f))
        return optional ? TD_OK : td_error(TD_ERR_FORMAT, "%s: tensor %s is missing", m->path, name);
    if (f.rows * f.cols != n)
        return td_error(TD_ERR_FORMAT, "%s: tensor %s has %llu values, the model description needs %u", m->path, name,
                        (unsigned long long)(f.rows * f.cols), n);
    float *host = malloc(n * sizeof *host);
    if (!host)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", m->path);
    td_status_t rc = kern_dequant_row(f.type, f.data, host, n);
    if (!rc)
        rc = be->ops->alloc(be, n * sizeof(float), (void **)out);
    if (!rc)
        rc = be->ops->upload(be, *out, host, n * sizeof(float));
    free(host);
    return rc;
}

td_status_t eng_weights_bind(const eng_model_t *m, kern_backend_t *be, eng_weights_t *w)
{
    const eng_model_desc_t *d = &m->desc;
    memset(w, 0, sizeof *w);
    w->layers = calloc(d->n_layers, sizeof *w->layers);
    if (!w->layers)
        return td_error(TD_ERR_NO_MEMORY, "weights: no memory");
    w->n_layers = d->n_layers;
    uint32_t hd = d->head_dim, q_dim = d->n_heads * hd, kv_dim = d->n_kv_heads * hd;
    td_status_t rc;
    if ((rc = matrix(m, be, "token_embd.weight", "model.embed_tokens.weight", d->vocab, d->hidden, &w->tok_embd)) ||
        (rc = vector(m, be, "output_norm.weight", "model.norm.weight", d->hidden, false, &w->out_norm)))
        return rc;
    if (d->tied_embeddings)
        w->output = w->tok_embd;
    else if ((rc = matrix(m, be, "output.weight", "lm_head.weight", d->vocab, d->hidden, &w->output)))
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
            (rc = matrix(m, be, g[2], h[2], q_dim, d->hidden, &L->wq)) ||
            (rc = matrix(m, be, g[3], h[3], kv_dim, d->hidden, &L->wk)) ||
            (rc = matrix(m, be, g[4], h[4], kv_dim, d->hidden, &L->wv)) ||
            (rc = matrix(m, be, g[5], h[5], d->hidden, q_dim, &L->wo)) ||
            (rc = matrix(m, be, g[6], h[6], d->ffn, d->hidden, &L->w_gate)) ||
            (rc = matrix(m, be, g[7], h[7], d->ffn, d->hidden, &L->w_up)) ||
            (rc = matrix(m, be, gd, hd_, d->hidden, d->ffn, &L->w_down)) ||
            (rc = vector(m, be, gb[0], hb[0], q_dim, true, &L->bq)) ||
            (rc = vector(m, be, gb[1], hb[1], kv_dim, true, &L->bk)) ||
            (rc = vector(m, be, gb[2], hb[2], kv_dim, true, &L->bv)))
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
    if (w->output.data != w->tok_embd.data)
        be->ops->weight_release(be, &w->output);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
