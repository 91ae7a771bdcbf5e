/* kv_contract.c — see kv_contract.h. */
#include "common/kv_contract.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "common/log.h"

static td_status_t differ_u(const char *field, uint32_t a, uint32_t b, const char *peer)
{
    return td_error(TD_ERR_CONFIG, "KV contract mismatch with %s: %s: here %u, peer %u", peer, field, a, b);
}

static td_status_t differ_s(const char *field, const char *a, const char *b, const char *peer)
{
    return td_error(TD_ERR_CONFIG, "KV contract mismatch with %s: %s: here '%s', peer '%s'", peer, field, a, b);
}

static const char *const dtype_names[TD_KV_DTYPES] = {[TD_KV_F32] = "fp32", [TD_KV_F16] = "fp16",
                                                      [TD_KV_F8_E4M3] = "fp8_e4m3"};

const char *td_kv_dtype_name(td_kv_dtype_t d) { return (unsigned)d < TD_KV_DTYPES ? dtype_names[d] : "?"; }

bool td_kv_dtype_parse(const char *s, td_kv_dtype_t *out)
{
    for (unsigned d = 0; s && d < TD_KV_DTYPES; d++)
        if (!strcmp(s, dtype_names[d])) {
            *out = (td_kv_dtype_t)d;
            return true;
        }
    if (s && !strcmp(s, "fp8")) {
        *out = TD_KV_F8_E4M3;
        return true;
    }
    return false;
}

const char *td_kv_scales_name(td_kv_dtype_t d) { return d == TD_KV_F8_E4M3 ? "fp32 per token and kv head" : "none"; }

td_kv_layout_t td_kv_layout_make(const char *model_id, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                                 uint32_t block_tokens, td_kv_dtype_t dtype)
{
    td_kv_layout_t l = {.n_layers = n_layers, .n_kv_heads = n_kv_heads, .head_dim = head_dim,
                        .block_tokens = block_tokens, .dtype = dtype, .layout_version = TD_KV_LAYOUT_VERSION,
                        .tp = 1};
    snprintf(l.hash_scheme, sizeof l.hash_scheme, "%s", TD_KV_HASH_SCHEME);
    snprintf(l.model_id, sizeof l.model_id, "%s", model_id ? model_id : "");
    return l;
}

td_status_t td_kv_scales_check(td_kv_dtype_t d, const char *scales)
{
    if (scales && strcmp(scales, td_kv_scales_name(d)))
        return td_error(TD_ERR_FORMAT, "KV contract: kv_scales '%s' is not dtype %s's ('%s')", scales,
                        td_kv_dtype_name(d), td_kv_scales_name(d));
    return TD_OK;
}

td_status_t td_kv_contract_check(const td_kv_layout_t *a, const td_kv_layout_t *b, const char *peer)
{
    if (a->layout_version != b->layout_version)
        return differ_u("layout_version", a->layout_version, b->layout_version, peer);
    if (a->dtype != b->dtype)
        return differ_s("dtype", td_kv_dtype_name(a->dtype), td_kv_dtype_name(b->dtype), peer);
    if (a->block_tokens != b->block_tokens)
        return differ_u("block_tokens", a->block_tokens, b->block_tokens, peer);
    if (strncmp(a->hash_scheme, b->hash_scheme, sizeof a->hash_scheme))
        return differ_s("hash_scheme", a->hash_scheme, b->hash_scheme, peer);
    if (strncmp(a->model_id, b->model_id, sizeof a->model_id))
        return differ_s("model_id", a->model_id, b->model_id, peer);
    if (a->n_layers != b->n_layers)
        return differ_u("n_layers", a->n_layers, b->n_layers, peer);
    if (a->n_kv_heads != b->n_kv_heads)
        return differ_u("n_kv_heads", a->n_kv_heads, b->n_kv_heads, peer);
    if (a->head_dim != b->head_dim)
        return differ_u("head_dim", a->head_dim, b->head_dim, peer);
    /* another degree is a peer like any other (whole blocks between them); one that cannot be mapped is not */
    if (td_kv_tp_check(b))
        return td_error(TD_ERR_CONFIG, "KV contract mismatch with %s: tp: here %u (%u KV heads), peer %u: its ranks "
                        "cannot each hold whole KV heads, so its parts cannot be mapped onto a block", peer,
                        a->tp ? a->tp : 1, a->n_kv_heads, b->tp);
    return td_kv_tp_check(a);
}

td_status_t td_kv_tp_check(const td_kv_layout_t *l)
{
    const uint32_t tp = l->tp ? l->tp : 1, h = l->n_kv_heads;
    if (!h || (h % tp && tp % h))
        return td_error(TD_ERR_CONFIG, "KV contract: tp %u over %u KV heads: the ranks cannot each hold whole KV "
                        "heads", tp, h);
    return TD_OK;
}

json_t *td_kv_layout_to_json(const td_kv_layout_t *l)
{
    return json_pack("{s:i, s:i, s:s, s:s, s:i, s:s, s:s, s:i, s:i, s:i}", "tp", (json_int_t)(l->tp ? l->tp : 1),
                     "layout_version", (json_int_t)l->layout_version,
                     "dtype", td_kv_dtype_name(l->dtype), "kv_scales", td_kv_scales_name(l->dtype), "block_tokens", (json_int_t)l->block_tokens, "hash_scheme",
                     l->hash_scheme, "model_id", l->model_id, "n_layers", (json_int_t)l->n_layers, "n_kv_heads",
                     (json_int_t)l->n_kv_heads, "head_dim", (json_int_t)l->head_dim);
}

static td_status_t json_u32(const json_t *j, const char *key, uint32_t *out)
{
    json_t *v = json_object_get(j, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX)
        return td_error(TD_ERR_FORMAT, "KV contract: '%s' is missing or not a 32-bit count", key);
    *out = (uint32_t)json_integer_value(v);
    return TD_OK;
}

static td_status_t json_str(const json_t *j, const char *key, char *out, size_t cap)
{
    const char *v = json_string_value(json_object_get(j, key));
    if (!v || strlen(v) >= cap)
        return td_error(TD_ERR_FORMAT, "KV contract: '%s' is missing, not a string or longer than %zu bytes", key,
                        cap - 1);
    memcpy(out, v, strlen(v) + 1);
    return TD_OK;
}

td_status_t td_kv_layout_from_json(const json_t *j, td_kv_layout_t *l)
{
    memset(l, 0, sizeof *l);
    if (!json_is_object(j))
        return td_error(TD_ERR_FORMAT, "KV contract: not a JSON object");
    char dtype[16];
    td_status_t rc;
    if ((rc = json_u32(j, "layout_version", &l->layout_version)) || (rc = json_u32(j, "block_tokens", &l->block_tokens)) ||
        (rc = json_u32(j, "n_layers", &l->n_layers)) || (rc = json_u32(j, "n_kv_heads", &l->n_kv_heads)) ||
        (rc = json_u32(j, "head_dim", &l->head_dim)) || (rc = json_str(j, "dtype", dtype, sizeof dtype)) ||
        (rc = json_str(j, "hash_scheme", l->hash_scheme, sizeof l->hash_scheme)) ||
        (rc = json_str(j, "model_id", l->model_id, sizeof l->model_id)))
        return rc;
    if (!td_kv_dtype_parse(dtype, &l->dtype))
        return td_error(TD_ERR_FORMAT, "KV contract: dtype '%s' is not fp16, fp32 or fp8_e4m3", dtype);
    l->tp = 1; /* a record without it: one rank */
    if (json_object_get(j, "tp") && (rc = json_u32(j, "tp", &l->tp)))
        return rc;
    if (!l->tp)
        return td_error(TD_ERR_FORMAT, "KV contract: 'tp' is 0");
    return td_kv_scales_check(l->dtype, json_string_value(json_object_get(j, "kv_scales")));
}

td_kv_layout_t td_kv_part_layout(const td_kv_layout_t *whole, uint32_t heads)
{
    td_kv_layout_t p = *whole;
    p.n_kv_heads = heads;
    return p;
}

/* Run i of the part [head0, head0 + heads) of a block of layout whole (i below the number of runs). */
td_kv_run_t td_kv_part_run(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, uint32_t i)
{
    const td_kv_layout_t part = td_kv_part_layout(whole, heads);
    const size_t es = td_kv_dtype_size(whole->dtype);
    const uint32_t per = whole->dtype == TD_KV_F8_E4M3 ? 4 : 2, l = i / per, which = i % per % 2;
    if (i % per < 2) /* the rows of K or V */
        return (td_kv_run_t){.part_off = td_kv_offset(&part, l, which, 0) * es,
                             .block_off = td_kv_offset(whole, l, which, head0) * es,
                             .bytes = (size_t)heads * whole->block_tokens * whole->head_dim * es};
    return (td_kv_run_t){.part_off = td_kv_scale_offset(&part, l, which, 0), /* their fp8 scales */
                         .block_off = td_kv_scale_offset(whole, l, which, head0),
                         .bytes = (size_t)heads * whole->block_tokens * sizeof(float)};
}

uint32_t td_kv_part_n_runs(const td_kv_layout_t *whole)
{
    return whole->n_layers * (whole->dtype == TD_KV_F8_E4M3 ? 4 : 2);
}

uint32_t td_kv_part_runs(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, td_kv_run_t *runs)
{
    const uint32_t n = td_kv_part_n_runs(whole);
    for (uint32_t i = 0; i < n; i++)
        runs[i] = td_kv_part_run(whole, head0, heads, i);
    return n;
}

uint32_t td_kv_part_overlap(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, size_t off, size_t bytes,
                            td_kv_run_t *out, uint32_t max)
{
    const size_t lb = td_kv_layer_bytes(whole), end = off + bytes;
    const uint32_t per = td_kv_part_n_runs(whole) / whole->n_layers;
    uint32_t n = 0;
    if (!bytes || !lb)
        return 0;
    for (size_t l = off / lb; l <= (end - 1) / lb && l < whole->n_layers; l++)
        for (uint32_t i = (uint32_t)l * per; i < (uint32_t)(l + 1) * per; i++) {
            const td_kv_run_t r = td_kv_part_run(whole, head0, heads, i);
            const size_t lo = off > r.block_off ? off : r.block_off;
            const size_t hi = end < r.block_off + r.bytes ? end : r.block_off + r.bytes;
            if (lo < hi && n < max)
                out[n++] = (td_kv_run_t){.part_off = r.part_off + (lo - r.block_off), .block_off = lo, .bytes = hi - lo};
        }
    return n;
}

/* both directions: to_block true copies the part into the block */
static void part_copy(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, uint8_t *part, uint8_t *block,
                      bool to_block)
{
    for (uint32_t i = 0, n = td_kv_part_n_runs(whole); i < n; i++) {
        const td_kv_run_t r = td_kv_part_run(whole, head0, heads, i);
        uint8_t *p = part + r.part_off, *b = block + r.block_off;
        memcpy(to_block ? b : p, to_block ? p : b, r.bytes);
    }
}

void td_kv_part_to_block(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, const void *part, void *block)
{
    part_copy(whole, head0, heads, (uint8_t *)part, block, true);
}

void td_kv_block_to_part(const td_kv_layout_t *whole, uint32_t head0, uint32_t heads, const void *block, void *part)
{
    part_copy(whole, head0, heads, part, (uint8_t *)block, false);
}

uint64_t td_kv_block_digest(const void *block, size_t block_bytes)
{
    return XXH3_64bits(block, block_bytes);
}
