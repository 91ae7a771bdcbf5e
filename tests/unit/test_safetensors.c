/* test_safetensors.c — the safetensors reader on the fixture folders and on
 * broken files, each fault giving a named error. */
#include "tests/unit/helpers.h"

#include "common/log.h"
#include "engine/safetensors.h"
#include "kernels/quant.h"

Test(safetensors, single_and_sharded)
{
    eng_safetensors_t *st;
    cr_assert_eq(eng_st_open_dir(FIXTURE("hf/tiny-llama3"), &st), TD_OK, "%s", td_last_error());
    cr_assert_eq(eng_st_n_files(st), 1);
    cr_assert_eq(eng_st_n_tensors(st), 20);
    const eng_st_tensor_t *t = eng_st_find(st, "model.embed_tokens.weight");
    cr_assert(t && t->type == KERN_TYPE_BF16 && t->n_dims == 2 && t->dims[0] == 600 && t->dims[1] == 64);
    t = eng_st_find(st, "model.layers.1.self_attn.k_proj.weight");
    cr_assert(t && t->type == KERN_TYPE_F16 && t->dims[0] == 32);
    float v[4];
    cr_assert_eq(kern_dequant_row(t->type, t->data, v, 4), TD_OK);
    eng_st_close(st);
    cr_assert_eq(eng_st_open_dir(FIXTURE("hf/tiny-spm"), &st), TD_OK, "%s", td_last_error());
    cr_assert_eq(eng_st_n_files(st), 2);
    cr_assert_eq(eng_st_n_tensors(st), 21);
    cr_assert_not_null(eng_st_find(st, "lm_head.weight"));
    eng_st_close(st);
}

static void expect_bad(const char *header, size_t data_bytes, const char *needle)
{
    size_t hl = strlen(header);
    size_t n = 8 + hl + data_bytes;
    uint8_t *buf = calloc(1, n);
    uint64_t h = hl;
    memcpy(buf, &h, 8);
    memcpy(buf + 8, header, hl);
    eng_safetensors_t *st = NULL;
    td_status_t rc = eng_st_open_mem(buf, n, "bad.safetensors", &st);
    cr_assert_neq(rc, TD_OK, "header %s opened", header);
    cr_assert(strstr(td_last_error(), "bad.safetensors"), "%s", td_last_error());
    cr_assert(strstr(td_last_error(), needle), "'%s' should say '%s'", td_last_error(), needle);
    cr_assert_null(st);
    free(buf);
}

Test(safetensors, faults_named)
{
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]", 8, "not valid JSON");
    expect_bad("[1, 2]", 0, "not an object");
    expect_bad("{\"a\": {\"dtype\": \"I64\", \"shape\": [1], \"data_offsets\": [0, 8]}}", 8, "dtype I64");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8, "need 12");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 800]}}", 8, "data_offsets");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}}", 8, "data_offsets");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [-2], \"data_offsets\": [0, 8]}}", 8, "shape[0]");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 8]}}", 8,
               "shape[1]");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
               " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", 12, "overlap");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
               " \"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}", 16, "not valid JSON");
    expect_bad("{\"a\": {\"shape\": [2], \"data_offsets\": [0, 8]}}", 8, "needs dtype");
    /* a header length past the file */
    uint8_t buf[16] = {0};
    uint64_t h = 1u << 30;
    memcpy(buf, &h, 8);
    eng_safetensors_t *st;
    cr_assert_eq(eng_st_open_mem(buf, sizeof buf, "bad.safetensors", &st), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "header length"));
}
