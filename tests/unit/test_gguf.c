/* test_gguf.c — the GGUF reader on the real model and on broken files.
 *
 * Broken files are built here byte by byte (a tiny writer below), one fault
 * each: every one must give TD_ERR_FORMAT/UNSUPPORTED with a message that names
 * the file and what was wrong, and must not crash or allocate absurdly (the
 * suite also runs under ASan in CI). */
#include "tests/unit/helpers.h"

#include "common/log.h"
#include "engine/gguf.h"
#include "kernels/quant.h"

Test(gguf, default_model_directory)
{
    require_default_model();
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open(DEFAULT_MODEL, &g), TD_OK);
    cr_assert_eq(eng_gguf_version(g), 3);
    cr_assert_eq(eng_gguf_n_kv(g), 33);
    cr_assert_eq(eng_gguf_n_tensors(g), 272);
    uint32_t v;
    cr_assert_eq(eng_gguf_get_u32(g, "llama.block_count", &v), TD_OK);
    cr_assert_eq(v, 30);
    eng_str_t s;
    cr_assert_eq(eng_gguf_get_str(g, "general.architecture", &s), TD_OK);
    cr_assert(s.len == 5 && !memcmp(s.ptr, "llama", 5));
    const eng_gguf_kv_t *toks;
    cr_assert_eq(eng_gguf_get_arr(g, "tokenizer.ggml.tokens", ENG_GGUF_STRING, &toks), TD_OK);
    cr_assert_eq(toks->arr_len, 49152);
    eng_str_t t1 = eng_gguf_arr_str(g, toks, 1);
    cr_assert(t1.len == 12 && !memcmp(t1.ptr, "<|im_start|>", 12));
    /* the types the file really has: Q4_1 matrices, a Q8_0 tied embedding, F32 norms */
    size_t counts[64] = {0};
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++)
        counts[eng_gguf_tensor_at(g, i)->type]++;
    cr_assert_eq(counts[KERN_TYPE_Q4_1], 210);
    cr_assert_eq(counts[KERN_TYPE_Q8_0], 1);
    cr_assert_eq(counts[KERN_TYPE_F32], 61);
    cr_assert_eq(eng_gguf_tensor_find(g, "token_embd.weight")->type, KERN_TYPE_Q8_0);
    cr_assert_null(eng_gguf_tensor_find(g, "output.weight"), "embeddings are tied");
    /* wrong-type getters say so */
    cr_assert_eq(eng_gguf_get_u32(g, "general.architecture", &v), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "general.architecture") && strstr(td_last_error(), "string"));
    cr_assert_eq(eng_gguf_get_u32(g, "no.such.key", &v), TD_ERR_NOT_FOUND);
    eng_gguf_close(g);
}

/* ---- a tiny writer for broken files ---- */

typedef struct gw {
    uint8_t buf[8192];
    size_t n;
} gw_t;

static void w_raw(gw_t *w, const void *p, size_t n) { memcpy(w->buf + w->n, p, n), w->n += n; }
static void w_u32(gw_t *w, uint32_t v) { w_raw(w, &v, 4); }
static void w_u64(gw_t *w, uint64_t v) { w_raw(w, &v, 8); }
static void w_str(gw_t *w, const char *s) { w_u64(w, strlen(s)), w_raw(w, s, strlen(s)); }

typedef struct gspec {
    uint32_t version;
    uint64_t n_tensors_claim, n_kv_claim; /* 0: the true count */
    uint32_t n_dims;
    uint64_t dim0, dim1;
    uint32_t type;
    uint64_t offset0, offset1;
    const char *name1;
    bool dup_key;
    uint32_t alignment; /* 0: none written */
    size_t data_bytes;  /* bytes of tensor data written */
    uint64_t str_len_lie;
} gspec_t;

static gspec_t good(void)
{
    return (gspec_t){.version = 3, .n_dims = 2, .dim0 = 32, .dim1 = 2, .type = KERN_TYPE_F32,
                     .offset0 = 0, .offset1 = 256, .name1 = "b", .data_bytes = 512};
}

static size_t build(gw_t *w, gspec_t s)
{
    w->n = 0;
    w_raw(w, "GGUF", 4);
    w_u32(w, s.version);
    size_t n_kv = 2 + (s.dup_key ? 1 : 0) + (s.alignment ? 1 : 0);
    w_u64(w, s.n_tensors_claim ? s.n_tensors_claim : 2);
    w_u64(w, s.n_kv_claim ? s.n_kv_claim : n_kv);
    w_str(w, "general.architecture");
    w_u32(w, 8);
    if (s.str_len_lie) {
        w_u64(w, s.str_len_lie);
        w_raw(w, "llama", 5);
    } else {
        w_str(w, "llama");
    }
    w_str(w, "list");
    w_u32(w, 9);
    w_u32(w, 4);
    w_u64(w, 3);
    w_u32(w, 1), w_u32(w, 2), w_u32(w, 3);
    if (s.dup_key) {
        w_str(w, "list");
        w_u32(w, 4);
        w_u32(w, 7);
    }
    if (s.alignment) {
        w_str(w, "general.alignment");
        w_u32(w, 4);
        w_u32(w, s.alignment);
    }
    for (int t = 0; t < 2; t++) {
        w_str(w, t ? s.name1 : "a");
        w_u32(w, s.n_dims);
        for (uint32_t d = 0; d < s.n_dims; d++)
            w_u64(w, d == 0 ? s.dim0 : s.dim1);
        w_u32(w, s.type);
        w_u64(w, t ? s.offset1 : s.offset0);
    }
    size_t align = s.alignment && !(s.alignment & (s.alignment - 1)) ? s.alignment : 32;
    while (w->n % align)
        w->buf[w->n++] = 0;
    memset(w->buf + w->n, 0, s.data_bytes);
    w->n += s.data_bytes;
    return w->n;
}

static void expect_fail(gspec_t s, td_status_t want, const char *needle)
{
    gw_t w;
    size_t n = build(&w, s);
    eng_gguf_t *g = NULL;
    td_clear_error();
    td_status_t rc = eng_gguf_open_mem(w.buf, n, "bad.gguf", &g);
    cr_assert_eq(rc, want, "got '%s' (%s)", td_status_str(rc), td_last_error());
    cr_assert(strstr(td_last_error(), "bad.gguf"), "message names the file: %s", td_last_error());
    cr_assert(strstr(td_last_error(), needle), "message '%s' should say '%s'", td_last_error(), needle);
    cr_assert_null(g);
}

Test(gguf, well_formed_small_file_opens)
{
    gw_t w;
    size_t n = build(&w, good());
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open_mem(w.buf, n, "good.gguf", &g), TD_OK, "%s", td_last_error());
    const eng_gguf_kv_t *kv;
    cr_assert_eq(eng_gguf_get_arr(g, "list", ENG_GGUF_U32, &kv), TD_OK);
    cr_assert_eq(eng_gguf_arr_num(kv, 2), 3.0);
    eng_gguf_close(g);
}

Test(gguf, wrong_magic)
{
    gw_t w;
    size_t n = build(&w, good());
    memcpy(w.buf, "GGML", 4);
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open_mem(w.buf, n, "bad.gguf", &g), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "not a GGUF file"));
}

Test(gguf, every_truncation_is_an_error)
{
    gw_t w;
    size_t n = build(&w, good());
    for (size_t cut = 0; cut < n; cut++) {
        eng_gguf_t *g = NULL;
        uint8_t *copy = malloc(cut ? cut : 1); /* exact size, so ASan sees any overread */
        memcpy(copy, w.buf, cut);
        td_status_t rc = eng_gguf_open_mem(copy, cut, "cut.gguf", &g);
        cr_assert_neq(rc, TD_OK, "a file cut at %zu of %zu bytes opened", cut, n);
        cr_assert(strstr(td_last_error(), "cut.gguf"));
        free(copy);
    }
}

Test(gguf, faults_named)
{
    gspec_t s;
    s = good(), s.version = 1;
    expect_fail(s, TD_ERR_UNSUPPORTED, "version 1");
    s = good(), s.version = 4;
    expect_fail(s, TD_ERR_UNSUPPORTED, "version 4");
    s = good(), s.n_kv_claim = 1ull << 60;
    expect_fail(s, TD_ERR_FORMAT, "metadata entries");
    s = good(), s.n_tensors_claim = 1ull << 40;
    expect_fail(s, TD_ERR_FORMAT, "tensors");
    s = good(), s.str_len_lie = 1ull << 50;
    expect_fail(s, TD_ERR_FORMAT, "offset");
    s = good(), s.n_dims = 5;
    expect_fail(s, TD_ERR_FORMAT, "5 dimensions");
    s = good(), s.dim1 = 1ull << 50;
    expect_fail(s, TD_ERR_FORMAT, "absurd shape");
    s = good(), s.dim1 = 0;
    expect_fail(s, TD_ERR_FORMAT, "absurd shape");
    s = good(), s.type = 99;
    expect_fail(s, TD_ERR_UNSUPPORTED, "type unknown (99)");
    s = good(), s.type = 11;
    expect_fail(s, TD_ERR_UNSUPPORTED, "Q3_K");
    s = good(), s.type = KERN_TYPE_Q4_K; /* 32 values: not a multiple of 256 */
    expect_fail(s, TD_ERR_FORMAT, "multiple of Q4_K");
    s = good(), s.offset1 = 100;
    expect_fail(s, TD_ERR_FORMAT, "not aligned");
    s = good(), s.offset1 = 4096;
    expect_fail(s, TD_ERR_FORMAT, "past the end");
    s = good(), s.offset1 = 128;
    expect_fail(s, TD_ERR_FORMAT, "overlap");
    s = good(), s.name1 = "a";
    expect_fail(s, TD_ERR_FORMAT, "appears twice");
    s = good(), s.dup_key = true;
    expect_fail(s, TD_ERR_FORMAT, "'list' appears twice");
    s = good(), s.alignment = 24;
    expect_fail(s, TD_ERR_FORMAT, "power of two");
    s = good(), s.data_bytes = 300;
    expect_fail(s, TD_ERR_FORMAT, "past the end");
}

Test(gguf, file_errors)
{
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open("/nonexistent/model.gguf", &g), TD_ERR_IO);
    cr_assert(strstr(td_last_error(), "/nonexistent/model.gguf"));
    cr_assert_eq(eng_gguf_open("/tmp", &g), TD_ERR_IO);
    char *p = write_temp("GGUF", 4, ".gguf");
    cr_assert_eq(eng_gguf_open(p, &g), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "too short"));
    unlink(p);
    free(p);
}

/* Every metadata value type, and a version 2 header. */
Test(gguf, every_metadata_type_v2_and_v3)
{
    for (uint32_t version = 2; version <= 3; version++) {
        gw_t w = {.n = 0};
        w_raw(&w, "GGUF", 4);
        w_u32(&w, version);
        w_u64(&w, 0);
        w_u64(&w, 14);
        uint8_t u8 = 200;
        int8_t i8 = -100;
        uint16_t u16 = 60000;
        int16_t i16 = -30000;
        int32_t i32 = -2000000000;
        float f32 = 1.5f;
        int64_t i64 = -5000000000LL;
        double f64 = 2.25;
        w_str(&w, "u8"), w_u32(&w, 0), w_raw(&w, &u8, 1);
        w_str(&w, "i8"), w_u32(&w, 1), w_raw(&w, &i8, 1);
        w_str(&w, "u16"), w_u32(&w, 2), w_raw(&w, &u16, 2);
        w_str(&w, "i16"), w_u32(&w, 3), w_raw(&w, &i16, 2);
        w_str(&w, "u32"), w_u32(&w, 4), w_u32(&w, 4000000000u);
        w_str(&w, "i32"), w_u32(&w, 5), w_raw(&w, &i32, 4);
        w_str(&w, "f32"), w_u32(&w, 6), w_raw(&w, &f32, 4);
        w_str(&w, "bool"), w_u32(&w, 7), w.buf[w.n++] = 1;
        w_str(&w, "str"), w_u32(&w, 8), w_str(&w, "héllo");
        w_str(&w, "u64"), w_u32(&w, 10), w_u64(&w, 1ull << 40);
        w_str(&w, "i64"), w_u32(&w, 11), w_raw(&w, &i64, 8);
        w_str(&w, "f64"), w_u32(&w, 12), w_raw(&w, &f64, 8);
        w_str(&w, "strs"), w_u32(&w, 9), w_u32(&w, 8), w_u64(&w, 2), w_str(&w, "a"), w_str(&w, "bc");
        w_str(&w, "nested"), w_u32(&w, 9), w_u32(&w, 9), w_u64(&w, 2);
        w_u32(&w, 4), w_u64(&w, 1), w_u32(&w, 7);
        w_u32(&w, 8), w_u64(&w, 1), w_str(&w, "x");
        eng_gguf_t *g;
        cr_assert_eq(eng_gguf_open_mem(w.buf, w.n, "types.gguf", &g), TD_OK, "v%u: %s", version, td_last_error());
        uint64_t u;
        uint32_t v32;
        float f;
        bool b;
        eng_str_t s;
        cr_assert(eng_gguf_get_u64(g, "u8", &u) == TD_OK && u == 200);
        cr_assert(eng_gguf_get_u64(g, "u16", &u) == TD_OK && u == 60000);
        cr_assert(eng_gguf_get_u32(g, "u32", &v32) == TD_OK && v32 == 4000000000u);
        cr_assert(eng_gguf_get_u64(g, "u64", &u) == TD_OK && u == 1ull << 40);
        cr_assert_eq(eng_gguf_get_u32(g, "u64", &v32), TD_ERR_FORMAT, "does not fit 32 bits");
        cr_assert_eq(eng_gguf_get_u64(g, "i8", &u), TD_ERR_FORMAT, "negative");
        cr_assert_eq(eng_gguf_find(g, "i16")->v.i, -30000);
        cr_assert_eq(eng_gguf_find(g, "i32")->v.i, -2000000000);
        cr_assert_eq(eng_gguf_find(g, "i64")->v.i, -5000000000LL);
        cr_assert(eng_gguf_get_f32(g, "f32", &f) == TD_OK && f == 1.5f);
        cr_assert(eng_gguf_get_f32(g, "f64", &f) == TD_OK && f == 2.25f);
        cr_assert(eng_gguf_get_bool(g, "bool", &b) == TD_OK && b);
        cr_assert(eng_gguf_get_str(g, "str", &s) == TD_OK && s.len == 6 && !memcmp(s.ptr, "héllo", 6));
        const eng_gguf_kv_t *kv;
        cr_assert_eq(eng_gguf_get_arr(g, "strs", ENG_GGUF_STRING, &kv), TD_OK);
        eng_str_t e1 = eng_gguf_arr_str(g, kv, 1);
        cr_assert(e1.len == 2 && !memcmp(e1.ptr, "bc", 2));
        cr_assert_eq(eng_gguf_get_arr(g, "strs", ENG_GGUF_U32, &kv), TD_ERR_FORMAT);
        cr_assert_eq(eng_gguf_find(g, "nested")->arr_type, ENG_GGUF_ARRAY);
        cr_assert_eq(eng_gguf_find(g, "nested")->arr_len, 2);
        eng_gguf_close(g);
    }
}
