/* inspect.c — `tandem inspect MODEL [--json]`: the model description, every
 * tensor (name, type, shape, bytes) and a tokenizer summary. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/tokenizer.h"
#include "kernels/quant.h"

typedef struct cli_tensor {
    const char *name;
    int name_len;
    const char *type;
    uint32_t n_dims;
    const uint64_t *dims;
    uint64_t bytes;
} cli_tensor_t;

/* Tensor i of either file kind, with GGUF dims listed outermost first as
 * PyTorch and safetensors list them. */
static bool tensor_get(const eng_model_t *m, size_t i, cli_tensor_t *t, uint64_t dims[8])
{
    if (m->gguf) {
        const eng_gguf_tensor_t *g = eng_gguf_tensor_at(m->gguf, i);
        if (!g)
            return false;
        *t = (cli_tensor_t){g->name.ptr, (int)g->name.len, kern_type_info(g->type)->name, g->n_dims, dims, g->n_bytes};
        for (uint32_t d = 0; d < g->n_dims; d++)
            dims[d] = g->dims[g->n_dims - 1 - d];
        return true;
    }
    const eng_st_tensor_t *s = m->st ? eng_st_tensor_at(m->st, i) : NULL; /* a folder without weights has none */
    if (!s)
        return false;
    *t = (cli_tensor_t){s->name, (int)strlen(s->name), kern_type_info(s->type)->name, s->n_dims, s->dims, s->n_bytes};
    return true;
}

static json_t *desc_json(const eng_model_desc_t *d)
{
    return json_pack("{s:s,s:s,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:f,s:s,s:s,s:f,s:b,s:b,s:i,s:i,s:I,s:I}",
                     "family", d->family, "name", d->name, "source", d->source, "layers", (json_int_t)d->n_layers,
                     "hidden", (json_int_t)d->hidden, "heads", (json_int_t)d->n_heads, "kv_heads",
                     (json_int_t)d->n_kv_heads, "head_dim", (json_int_t)d->head_dim, "ffn", (json_int_t)d->ffn,
                     "vocab", (json_int_t)d->vocab, "context", (json_int_t)d->context, "norm_eps",
                     (double)d->norm_eps, "rope_theta", (double)d->rope_theta, "rope_style",
                     eng_rope_style_name(d->rope_style), "rope_scaling", eng_rope_scaling_name(d->rope_scaling),
                     "rope_factor", (double)d->rope_factor, "tied_embeddings", d->tied_embeddings, "qkv_bias",
                     d->qkv_bias, "bos", d->bos, "eos", d->eos, "params", (json_int_t)d->n_params, "weight_bytes",
                     (json_int_t)d->weight_bytes);
}

const char cli_inspect_usage[] = "usage: tandem inspect MODEL [--json]\n";

int cli_inspect(int argc, char **argv)
{
    const char *path = NULL;
    bool as_json = false;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            as_json = true;
        else if (!path && argv[i][0] != '-')
            path = argv[i];
        else {
            fprintf(stderr, "tandem inspect: unexpected argument '%s'\nusage: tandem inspect MODEL [--json]\n", argv[i]);
            return 2;
        }
    }
    if (!path) {
        fputs(cli_inspect_usage, stderr);
        return 2;
    }
    eng_model_t *m;
    if (eng_model_open(path, &m))
        return 1;
    const eng_model_desc_t *d = &m->desc;
    char tokdesc[512];
    eng_tokenizer_describe(m->tok, tokdesc, sizeof tokdesc);
    cli_tensor_t t;
    uint64_t dims[8];
    if (as_json) {
        json_t *root = json_object(), *tensors = json_array();
        json_object_set_new(root, "path", json_string(path));
        if (m->gguf)
            json_object_set_new(root, "gguf", json_pack("{s:i,s:I,s:i,s:I}", "version", eng_gguf_version(m->gguf),
                                                        "file_bytes", (json_int_t)eng_gguf_file_size(m->gguf),
                                                        "alignment", eng_gguf_alignment(m->gguf), "data_offset",
                                                        (json_int_t)eng_gguf_data_offset(m->gguf)));
        json_object_set_new(root, "model", desc_json(d));
        for (size_t i = 0; tensor_get(m, i, &t, dims); i++) {
            json_t *shape = json_array();
            for (uint32_t k = 0; k < t.n_dims; k++)
                json_array_append_new(shape, json_integer((json_int_t)t.dims[k]));
            json_array_append_new(tensors, json_pack("{s:s%,s:s,s:o,s:I}", "name", t.name, (size_t)t.name_len, "type",
                                                     t.type, "shape", shape, "bytes", (json_int_t)t.bytes));
        }
        json_object_set_new(root, "tensors", tensors);
        int32_t eog[8];
        size_t ne = eng_tokenizer_eog(m->tok, eog, 8);
        json_t *eogs = json_array();
        for (size_t i = 0; i < ne && i < 8; i++)
            json_array_append_new(eogs, json_integer(eog[i]));
        json_object_set_new(root, "tokenizer",
                            json_pack("{s:s,s:i,s:I,s:I,s:i,s:i,s:b,s:o,s:b,s:s}", "kind",
                                      eng_tokenizer_kind(m->tok) == ENG_TOK_BPE_BYTE_LEVEL ? "byte-level-bpe" : "sentencepiece-bpe",
                                      "tokens", eng_tokenizer_n_vocab(m->tok), "merges",
                                      (json_int_t)eng_tokenizer_n_merges(m->tok), "special",
                                      (json_int_t)eng_tokenizer_n_special(m->tok), "bos", eng_tokenizer_bos(m->tok),
                                      "eos", eng_tokenizer_eos(m->tok), "add_bos", eng_tokenizer_adds_bos(m->tok),
                                      "eog", eogs, "chat_template", eng_tokenizer_chat_template(m->tok) != NULL,
                                      "summary", tokdesc));
        json_dumpf(root, stdout, JSON_INDENT(2));
        putchar('\n');
        json_decref(root);
    } else {
        printf("model       %s\n", path);
        printf("name        %s\n", d->name);
        printf("family      %s (from %s)\n", d->family, d->source);
        if (m->gguf)
            printf("file        GGUF v%u, %zu bytes, tensor data at %llu, aligned to %u\n", eng_gguf_version(m->gguf),
                   eng_gguf_file_size(m->gguf), (unsigned long long)eng_gguf_data_offset(m->gguf),
                   eng_gguf_alignment(m->gguf));
        printf("layers      %u\nhidden      %u\nheads       %u (kv %u, head dim %u)\nffn         %u\n", d->n_layers,
               d->hidden, d->n_heads, d->n_kv_heads, d->head_dim, d->ffn);
        printf("vocab       %u\ncontext     %u\nnorm eps    %g\n", d->vocab, d->context, d->norm_eps);
        printf("rope        theta %g, %s style, scaling %s", d->rope_theta, eng_rope_style_name(d->rope_style),
               eng_rope_scaling_name(d->rope_scaling));
        if (d->rope_scaling)
            printf(" x%g", d->rope_factor);
        printf("\ntied embed  %s\nqkv bias    %s\nbos / eos   %d / %d\n", d->tied_embeddings ? "yes" : "no",
               d->qkv_bias ? "yes" : "no", d->bos, d->eos);
        printf("parameters  %" PRIu64 " (%.1f MiB of weights)\n", d->n_params, d->weight_bytes / 1048576.0);
        printf("tokenizer   %s\n\n", tokdesc);
        printf("%-40s %-5s %-22s %12s\n", "tensor", "type", "shape", "bytes");
        for (size_t i = 0; tensor_get(m, i, &t, dims); i++) {
            char shape[64] = "[";
            size_t at = 1;
            for (uint32_t k = 0; k < t.n_dims; k++)
                at += (size_t)snprintf(shape + at, sizeof shape - at, "%s%" PRIu64, k ? ", " : "", t.dims[k]);
            snprintf(shape + at, sizeof shape - at, "]");
            printf("%-40.*s %-5s %-22s %12" PRIu64 "\n", t.name_len, t.name, t.type, shape, t.bytes);
        }
    }
    eng_model_close(m);
    return 0;
}
