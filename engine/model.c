/* model.c — see model.h. Every required hyper-parameter that is missing or
 * out of range is an error naming the file and the key; optional ones take the
 * defaults the reference implementations use. */
#include "engine/model.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "engine/safetensors.h"
#include "engine/tokenizer.h"

const char *eng_rope_style_name(eng_rope_style_t s) { return s == ENG_ROPE_NEOX ? "neox" : "norm"; }

const char *eng_rope_scaling_name(eng_rope_scaling_t s)
{
    static const char *const n[] = {"none", "linear", "yarn", "llama3"};
    return n[s];
}

static td_status_t check_shape(const char *src, eng_model_desc_t *d)
{
    if (!d->n_layers || d->n_layers > 1024 || !d->hidden || d->hidden > 65536 || !d->n_heads || d->n_heads > 1024 ||
        !d->n_kv_heads || d->n_heads % d->n_kv_heads || !d->ffn || d->ffn > 1 << 20 || !d->vocab ||
        d->vocab > 1 << 24)
        return td_error(TD_ERR_FORMAT,
                        "%s: implausible shape: layers=%u hidden=%u heads=%u kv_heads=%u ffn=%u vocab=%u", src,
                        d->n_layers, d->hidden, d->n_heads, d->n_kv_heads, d->ffn, d->vocab);
    if (!d->head_dim)
        d->head_dim = d->hidden / d->n_heads;
    if (!d->head_dim || d->head_dim > 1024 || d->head_dim % 2)
        return td_error(TD_ERR_FORMAT, "%s: head dimension %u is not a positive even number", src, d->head_dim);
    if (!(d->norm_eps > 0 && d->norm_eps < 1))
        return td_error(TD_ERR_FORMAT, "%s: norm epsilon %g is outside (0, 1)", src, d->norm_eps);
    if (!(d->rope_theta > 0))
        return td_error(TD_ERR_FORMAT, "%s: rope theta %g is not positive", src, d->rope_theta);
    return TD_OK;
}

/* ---- GGUF ---- */

static td_status_t g_u32(const eng_gguf_t *g, const char *arch, const char *suffix, bool required, uint32_t *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    td_status_t rc = eng_gguf_get_u32(g, key, out);
    if (rc == TD_ERR_NOT_FOUND && !required)
        return TD_OK;
    if (rc == TD_ERR_NOT_FOUND)
        return td_error(rc, "%s: required key %s is missing", eng_gguf_path(g), key);
    return rc;
}

static td_status_t g_f32(const eng_gguf_t *g, const char *arch, const char *suffix, float *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    td_status_t rc = eng_gguf_get_f32(g, key, out);
    return rc == TD_ERR_NOT_FOUND ? TD_OK : rc;
}

td_status_t eng_model_desc_from_gguf(const eng_gguf_t *g, eng_model_desc_t *d)
{
    const char *path = eng_gguf_path(g);
    memset(d, 0, sizeof *d);
    snprintf(d->source, sizeof d->source, "gguf");
    eng_str_t s;
    td_status_t rc = eng_gguf_get_str(g, "general.architecture", &s);
    if (rc == TD_ERR_NOT_FOUND)
        return td_error(rc, "%s: required key general.architecture is missing", path);
    if (rc)
        return rc;
    snprintf(d->family, sizeof d->family, "%.*s", (int)(s.len < 31 ? s.len : 31), s.ptr);
    if (strcmp(d->family, "llama") && strcmp(d->family, "mistral") && strcmp(d->family, "qwen2"))
        return td_error(TD_ERR_UNSUPPORTED, "%s: architecture '%s' is not supported (llama, mistral, qwen2 are)", path,
                        d->family);
    if (eng_gguf_get_str(g, "general.name", &s) == TD_OK)
        snprintf(d->name, sizeof d->name, "%.*s", (int)(s.len < 127 ? s.len : 127), s.ptr);
    const char *a = d->family;
    uint32_t rope_dims = 0, key_len = 0;
    d->norm_eps = 1e-5f;
    d->rope_theta = 10000.0f;
    if ((rc = g_u32(g, a, "block_count", true, &d->n_layers)) ||
        (rc = g_u32(g, a, "embedding_length", true, &d->hidden)) ||
        (rc = g_u32(g, a, "attention.head_count", true, &d->n_heads)) ||
        (rc = g_u32(g, a, "feed_forward_length", true, &d->ffn)) ||
        (rc = g_u32(g, a, "context_length", false, &d->context)) ||
        (rc = g_u32(g, a, "rope.dimension_count", false, &rope_dims)) ||
        (rc = g_u32(g, a, "attention.key_length", false, &key_len)) ||
        (rc = g_u32(g, a, "vocab_size", false, &d->vocab)) ||
        (rc = g_f32(g, a, "attention.layer_norm_rms_epsilon", &d->norm_eps)) ||
        (rc = g_f32(g, a, "rope.freq_base", &d->rope_theta)))
        return rc;
    d->n_kv_heads = d->n_heads;
    if ((rc = g_u32(g, a, "attention.head_count_kv", false, &d->n_kv_heads)))
        return rc;
    d->head_dim = key_len ? key_len : rope_dims ? rope_dims : 0;
    const eng_gguf_tensor_t *emb = eng_gguf_tensor_find(g, "token_embd.weight");
    if (!emb)
        return td_error(TD_ERR_FORMAT, "%s: tensor token_embd.weight is missing", path);
    if (!d->vocab)
        d->vocab = (uint32_t)emb->dims[1];
    d->tied_embeddings = eng_gguf_tensor_find(g, "output.weight") == NULL;
    d->qkv_bias = eng_gguf_tensor_find(g, "blk.0.attn_q.bias") != NULL;
    d->rope_style = strcmp(a, "qwen2") == 0 ? ENG_ROPE_NEOX : ENG_ROPE_NORM;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (eng_gguf_get_str(g, key, &s) == TD_OK) {
        if (s.len == 6 && !memcmp(s.ptr, "linear", 6))
            d->rope_scaling = ENG_ROPE_SCALING_LINEAR;
        else if (s.len == 4 && !memcmp(s.ptr, "yarn", 4))
            d->rope_scaling = ENG_ROPE_SCALING_YARN;
        else if (!(s.len == 4 && !memcmp(s.ptr, "none", 4)))
            return td_error(TD_ERR_UNSUPPORTED, "%s: %s '%.*s' is not supported", path, key, (int)s.len, s.ptr);
        if ((rc = g_f32(g, a, "rope.scaling.factor", &d->rope_factor)) ||
            (rc = g_u32(g, a, "rope.scaling.original_context_length", false, &d->rope_orig_context)))
            return rc;
    }
    if (eng_gguf_tensor_find(g, "rope_freqs.weight")) /* Llama 3.1 stores its scaled frequencies */
        d->rope_scaling = ENG_ROPE_SCALING_LLAMA3;
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_at(g, i);
        d->n_params += t->n_elems;
        d->weight_bytes += t->n_bytes;
    }
    return check_shape(path, d);
}

/* ---- Hugging Face ---- */

static td_status_t j_u32(const char *src, json_t *root, const char *key, bool required, uint32_t *out)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        if (required)
            return td_error(TD_ERR_FORMAT, "%s: required key '%s' is missing", src, key);
        return TD_OK;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX)
        return td_error(TD_ERR_FORMAT, "%s: key '%s' is not a non-negative integer", src, key);
    *out = (uint32_t)json_integer_value(v);
    return TD_OK;
}

static td_status_t j_f32(const char *src, json_t *root, const char *key, float *out)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return TD_OK;
    if (!json_is_number(v))
        return td_error(TD_ERR_FORMAT, "%s: key '%s' is not a number", src, key);
    *out = (float)json_number_value(v);
    return TD_OK;
}

/* First id of an int-or-list value (eos_token_id may be a list). */
static int32_t j_first_id(json_t *v)
{
    if (json_is_array(v))
        v = json_array_get(v, 0);
    return json_is_integer(v) ? (int32_t)json_integer_value(v) : -1;
}

td_status_t eng_model_desc_from_hf(const char *config_json, const eng_safetensors_t *st, eng_model_desc_t *d)
{
    memset(d, 0, sizeof *d);
    snprintf(d->source, sizeof d->source, "safetensors");
    json_error_t jerr;
    json_t *root = json_load_file(config_json, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return td_error(TD_ERR_FORMAT, "%s:%d: not valid JSON: %s", config_json, jerr.line, jerr.text);
    td_status_t rc = TD_OK;
    if (!json_is_object(root)) {
        rc = td_error(TD_ERR_FORMAT, "%s: not a JSON object", config_json);
        goto done;
    }
    json_t *mt = json_object_get(root, "model_type");
    if (!json_is_string(mt)) {
        rc = td_error(TD_ERR_FORMAT, "%s: key 'model_type' is missing or not a string", config_json);
        goto done;
    }
    snprintf(d->family, sizeof d->family, "%s", json_string_value(mt));
    if (strcmp(d->family, "llama") && strcmp(d->family, "mistral") && strcmp(d->family, "qwen2")) {
        rc = td_error(TD_ERR_UNSUPPORTED, "%s: model_type '%s' is not supported (llama, mistral, qwen2 are)",
                      config_json, d->family);
        goto done;
    }
    json_t *nm = json_object_get(root, "_name_or_path");
    snprintf(d->name, sizeof d->name, "%s", json_is_string(nm) ? json_string_value(nm) : d->family);
    d->norm_eps = 1e-6f;
    d->rope_theta = 10000.0f;
    if ((rc = j_u32(config_json, root, "num_hidden_layers", true, &d->n_layers)) ||
        (rc = j_u32(config_json, root, "hidden_size", true, &d->hidden)) ||
        (rc = j_u32(config_json, root, "num_attention_heads", true, &d->n_heads)) ||
        (rc = j_u32(config_json, root, "intermediate_size", true, &d->ffn)) ||
        (rc = j_u32(config_json, root, "vocab_size", true, &d->vocab)) ||
        (rc = j_u32(config_json, root, "max_position_embeddings", false, &d->context)) ||
        (rc = j_u32(config_json, root, "head_dim", false, &d->head_dim)) ||
        (rc = j_f32(config_json, root, "rms_norm_eps", &d->norm_eps)) ||
        (rc = j_f32(config_json, root, "rope_theta", &d->rope_theta)))
        goto done;
    d->n_kv_heads = d->n_heads;
    if ((rc = j_u32(config_json, root, "num_key_value_heads", false, &d->n_kv_heads)))
        goto done;
    json_t *tie = json_object_get(root, "tie_word_embeddings");
    d->tied_embeddings = tie ? json_is_true(tie) : !strcmp(d->family, "qwen2");
    if (st && !eng_st_find(st, "lm_head.weight"))
        d->tied_embeddings = true;
    json_t *ab = json_object_get(root, "attention_bias");
    d->qkv_bias = !strcmp(d->family, "qwen2") || json_is_true(ab);
    if (st)
        d->qkv_bias = eng_st_find(st, "model.layers.0.self_attn.q_proj.bias") != NULL;
    d->rope_style = ENG_ROPE_NEOX;
    json_t *rs = json_object_get(root, "rope_scaling");
    if (json_is_object(rs)) {
        json_t *ty = json_object_get(rs, "rope_type");
        if (!ty)
            ty = json_object_get(rs, "type");
        const char *t = json_is_string(ty) ? json_string_value(ty) : "";
        if (!strcmp(t, "linear"))
            d->rope_scaling = ENG_ROPE_SCALING_LINEAR;
        else if (!strcmp(t, "yarn"))
            d->rope_scaling = ENG_ROPE_SCALING_YARN;
        else if (!strcmp(t, "llama3"))
            d->rope_scaling = ENG_ROPE_SCALING_LLAMA3;
        else if (strcmp(t, "default")) {
            rc = td_error(TD_ERR_UNSUPPORTED, "%s: rope_scaling type '%s' is not supported", config_json, t);
            goto done;
        }
        if ((rc = j_f32(config_json, rs, "factor", &d->rope_factor)) ||
            (rc = j_f32(config_json, rs, "low_freq_factor", &d->rope_low_freq)) ||
            (rc = j_f32(config_json, rs, "high_freq_factor", &d->rope_high_freq)) ||
            (rc = j_u32(config_json, rs, "original_max_position_embeddings", false, &d->rope_orig_context)))
            goto done;
    }
    d->bos = j_first_id(json_object_get(root, "bos_token_id"));
    d->eos = j_first_id(json_object_get(root, "eos_token_id"));
    if (st) {
        d->weight_bytes = eng_st_total_bytes(st);
        for (size_t i = 0; i < eng_st_n_tensors(st); i++)
            d->n_params += eng_st_tensor_at(st, i)->n_elems;
    }
    rc = check_shape(config_json, d);
    if (!rc && !st) { /* no weights: what the shape has, in fp16 (the dummy load format's) */
        const uint64_t q = (uint64_t)d->n_heads * d->head_dim, kv = (uint64_t)d->n_kv_heads * d->head_dim;
        d->n_params = (uint64_t)d->vocab * d->hidden * (d->tied_embeddings ? 1 : 2) + d->hidden +
                      (uint64_t)d->n_layers * (2 * d->hidden + d->hidden * (q + 2 * kv) + q * d->hidden +
                                               3 * (uint64_t)d->hidden * d->ffn);
        d->weight_bytes = d->n_params * 2;
    }
done:
    json_decref(root);
    return rc;
}

/* ---- opening ---- */

void eng_model_close(eng_model_t *m)
{
    if (!m)
        return;
    eng_tokenizer_destroy(m->tok);
    eng_gguf_close(m->gguf);
    eng_st_close(m->st);
    free(m->path);
    free(m);
}

static bool file_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

td_status_t eng_model_open(const char *path, eng_model_t **out)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return td_error(TD_ERR_IO, "%s: no such model file or folder", path);
    eng_model_t *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    }
    td_status_t rc;
    if (S_ISDIR(sb.st_mode)) {
        char cfg[PATH_MAX], tj[PATH_MAX], tc[PATH_MAX], gc[PATH_MAX];
        snprintf(cfg, sizeof cfg, "%s/config.json", path);
        snprintf(tj, sizeof tj, "%s/tokenizer.json", path);
        snprintf(tc, sizeof tc, "%s/tokenizer_config.json", path);
        snprintf(gc, sizeof gc, "%s/generation_config.json", path);
        if (!file_exists(cfg)) {
            rc = td_error(TD_ERR_NOT_FOUND, "%s: not a model folder: config.json is missing", path);
            goto fail;
        }
        if (!file_exists(tj)) {
            rc = td_error(TD_ERR_NOT_FOUND, "%s: tokenizer.json is missing (tandem needs the fast tokenizer file)", path);
            goto fail;
        }
        /* a folder without weights opens (its description, its tokenizer): binding its weights then needs the
         * dummy load format (eng_model_set_dummy) */
        char st1[PATH_MAX], sti[PATH_MAX];
        snprintf(st1, sizeof st1, "%s/model.safetensors", path);
        snprintf(sti, sizeof sti, "%s/model.safetensors.index.json", path);
        const bool weights = file_exists(st1) || file_exists(sti);
        if ((weights && (rc = eng_st_open_dir(path, &m->st))) ||
            (rc = eng_model_desc_from_hf(cfg, m->st, &m->desc)) ||
            (rc = eng_tokenizer_from_json(tj, file_exists(tc) ? tc : NULL, &m->tok)))
            goto fail;
        if (file_exists(gc)) {
            json_error_t jerr;
            json_t *g = json_load_file(gc, 0, &jerr);
            if (!g) {
                rc = td_error(TD_ERR_FORMAT, "%s:%d: not valid JSON: %s", gc, jerr.line, jerr.text);
                goto fail;
            }
            int32_t e = j_first_id(json_object_get(g, "eos_token_id"));
            if (e >= 0)
                m->desc.eos = e;
            json_decref(g);
        }
    } else {
        if ((rc = eng_gguf_open(path, &m->gguf)) || (rc = eng_model_desc_from_gguf(m->gguf, &m->desc)) ||
            (rc = eng_tokenizer_from_gguf(m->gguf, &m->tok)))
            goto fail;
        m->desc.bos = eng_tokenizer_bos(m->tok);
        m->desc.eos = eng_tokenizer_eos(m->tok);
    }
    if ((uint32_t)eng_tokenizer_n_vocab(m->tok) > m->desc.vocab) {
        rc = td_error(TD_ERR_FORMAT, "%s: the tokenizer has %d tokens but the model's vocabulary is %u", path,
                      eng_tokenizer_n_vocab(m->tok), m->desc.vocab);
        goto fail;
    }
    if (m->desc.bos < 0)
        m->desc.bos = eng_tokenizer_bos(m->tok);
    if (m->desc.eos < 0)
        m->desc.eos = eng_tokenizer_eos(m->tok);
    eng_model_set_hold(m, ENG_WEIGHTS_FILE);
    *out = m;
    return TD_OK;
fail:
    eng_model_close(m);
    return rc;
}

static void set_kv_id(eng_model_t *m)
{
    /* the name is cut to leave room for the suffixes */
    char sfx[48];
    snprintf(sfx, sizeof sfx, "%s%s", m->hold == ENG_WEIGHTS_FP8 ? " (fp8 weights)" : "",
             m->dummy ? " (dummy weights)" : "");
    snprintf(m->kv_id, sizeof m->kv_id, "%.*s%s", (int)(sizeof m->kv_id - 1 - strlen(sfx)), m->desc.name, sfx);
}

void eng_model_set_hold(eng_model_t *m, eng_weight_hold_t h)
{
    m->hold = h;
    set_kv_id(m);
}

void eng_model_set_dummy(eng_model_t *m, bool on)
{
    m->dummy = on;
    set_kv_id(m);
}

bool eng_weight_hold_parse(const char *s, eng_weight_hold_t *out)
{
    if (!strcmp(s, "file"))
        *out = ENG_WEIGHTS_FILE;
    else if (!strcmp(s, "fp8"))
        *out = ENG_WEIGHTS_FP8;
    else
        return false;
    return true;
}

const char *eng_weight_hold_name(eng_weight_hold_t h) { return h == ENG_WEIGHTS_FP8 ? "fp8" : "file"; }
