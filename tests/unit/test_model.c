/* test_model.c — one description from either file kind, and clear errors for
 * folders that are not models. */
#include "tests/unit/helpers.h"

#include <sys/stat.h>

#include "common/log.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

Test(model, default_gguf)
{
    require_default_model();
    eng_model_t *m;
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &m), TD_OK);
    const eng_model_desc_t *d = &m->desc;
    cr_assert_str_eq(d->family, "llama");
    cr_assert_eq(d->n_layers, 30);
    cr_assert_eq(d->hidden, 576);
    cr_assert_eq(d->n_heads, 9);
    cr_assert_eq(d->n_kv_heads, 3);
    cr_assert_eq(d->head_dim, 64);
    cr_assert_eq(d->ffn, 1536);
    cr_assert_eq(d->vocab, 49152);
    cr_assert_eq(d->context, 8192);
    cr_assert_float_eq(d->rope_theta, 100000.0f, 1e-3);
    cr_assert_float_eq(d->norm_eps, 1e-5f, 1e-9);
    cr_assert(d->tied_embeddings);
    cr_assert(!d->qkv_bias);
    cr_assert_eq(d->rope_style, ENG_ROPE_NORM);
    cr_assert_eq(d->bos, 1);
    cr_assert_eq(d->eos, 2);
    cr_assert_eq(d->n_params, 134515008);
    int32_t eog[8];
    size_t ne = eng_tokenizer_eog(m->tok, eog, 8);
    bool has_im_end = false;
    for (size_t i = 0; i < ne; i++)
        has_im_end |= eog[i] == 2;
    cr_assert(has_im_end, "<|im_end|> (2) ends generation");
    eng_model_close(m);
}

Test(model, hf_folders)
{
    eng_model_t *m;
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-llama3"), &m), TD_OK, "%s", td_last_error());
    cr_assert_str_eq(m->desc.family, "llama");
    cr_assert_str_eq(m->desc.source, "safetensors");
    cr_assert_eq(m->desc.n_kv_heads, 2);
    cr_assert_eq(m->desc.head_dim, 16);
    cr_assert_eq(m->desc.rope_style, ENG_ROPE_NEOX);
    cr_assert_eq(m->desc.rope_scaling, ENG_ROPE_SCALING_LLAMA3);
    cr_assert_float_eq(m->desc.rope_factor, 8.0f, 1e-6);
    cr_assert(m->desc.tied_embeddings);
    cr_assert(eng_tokenizer_adds_bos(m->tok));
    eng_model_close(m);
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-spm"), &m), TD_OK, "%s", td_last_error());
    cr_assert_str_eq(m->desc.family, "mistral");
    cr_assert(!m->desc.tied_embeddings);
    cr_assert_eq(eng_tokenizer_kind(m->tok), ENG_TOK_BPE_SPM);
    eng_model_close(m);
}

static char *temp_dir(void)
{
    char tmpl[] = "/tmp/tandem-model-XXXXXX";
    cr_assert(mkdtemp(tmpl));
    return strdup(tmpl);
}

static void put(const char *dir, const char *name, const char *text)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
}

Test(model, bad_folders_named)
{
    eng_model_t *m;
    char *dir = temp_dir();
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_NOT_FOUND);
    cr_assert(strstr(td_last_error(), "config.json is missing"));
    put(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": 64}");
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_NOT_FOUND);
    cr_assert(strstr(td_last_error(), "tokenizer.json is missing"), "%s", td_last_error());
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cp %s %s %s/", FIXTURE("hf/tiny-llama3/tokenizer.json"),
             FIXTURE("hf/tiny-llama3/model.safetensors"), dir);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "num_hidden_layers"), "names the missing key: %s", td_last_error());
    put(dir, "config.json", "{\"model_type\": \"gpt2\"}");
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "gpt2"));
    put(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": \"64\"}");
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_FORMAT);
    put(dir, "config.json", "{not json");
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "config.json:1"), "%s", td_last_error());
    /* JSON that is not what it claims: a tokenizer.json whose vocab is a list */
    snprintf(cmd, sizeof cmd, "cp %s %s/", FIXTURE("hf/tiny-llama3/config.json"), dir);
    cr_assert_eq(system(cmd), 0);
    put(dir, "tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": [1, 2], \"merges\": []}}");
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "model.vocab"), "%s", td_last_error());
    put(dir, "tokenizer.json", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}, \"merges\": []}}");
    cr_assert_eq(eng_model_open(dir, &m), TD_ERR_UNSUPPORTED);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
    free(dir);
    cr_assert_eq(eng_model_open("/nonexistent", &m), TD_ERR_IO);
}

Test(model, gguf_without_tokenizer)
{
    eng_model_t *m;
    /* the crafted dequant fixture has an architecture but no tokenizer or hyper-parameters */
    cr_assert_neq(eng_model_open(FIXTURE("dequant/crafted.gguf"), &m), TD_OK);
    cr_assert(strstr(td_last_error(), "crafted.gguf"), "%s", td_last_error());
    cr_assert(strstr(td_last_error(), "llama.block_count"), "names the first missing key: %s", td_last_error());
}
