/* perplexity.c — `tandem perplexity FILE [--model PATH] [--ctx N] [--threads N] [--numerics M]`:
 * the model's perplexity on a text file, the way llama.cpp's perplexity tool
 * measures it: the text is tokenized whole, cut into chunks of N tokens (512),
 * each chunk is evaluated from an empty cache, and the second half of each
 * chunk is scored (every token predicted from at least N/2 before it). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "common/config.h"
#include "common/log.h"
#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

#define PPL_ROWS 64 /* logit rows per forward call */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

const char cli_perplexity_usage[] =
    "usage: tandem perplexity FILE [--model PATH] [--ctx N (even, 16..65536)] [--threads N] [--numerics fast|reference]\n"
    "                         [--kv-dtype fp16|fp32|fp8_e4m3]\n"
    "                         [--device cpu|cuda[:N]] [--weights file|fp8] [--load-format auto|dummy]\n";

int cli_perplexity(int argc, char **argv)
{
    const char *model = TD_DEFAULT_MODEL, *file = NULL, *device = NULL;
    long ctx = 512, threads = 0;
    kern_numerics_t numerics = KERN_NUMERICS_FAST;
    td_kv_dtype_t kv_dtype = TD_KV_F16;
    eng_weight_hold_t hold = ENG_WEIGHTS_FILE;
    bool dummy = false;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
        else if (!strcmp(argv[i], "--load-format") && i + 1 < argc) {
            if (strcmp(argv[i + 1], "auto") && strcmp(argv[i + 1], "dummy")) {
                fprintf(stderr, "tandem perplexity: --load-format '%s': it must be auto or dummy\n", argv[i + 1]);
                return 2;
            }
            dummy = !strcmp(argv[++i], "dummy");
        }
        else if (!strcmp(argv[i], "--weights") && i + 1 < argc) {
            if (!eng_weight_hold_parse(argv[++i], &hold)) {
                fprintf(stderr, "tandem perplexity: --weights '%s': it must be file or fp8\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--kv-dtype") && i + 1 < argc) {
            if (!td_kv_dtype_parse(argv[++i], &kv_dtype)) {
                fprintf(stderr, "tandem perplexity: --kv-dtype '%s': it must be fp16, fp32 or fp8_e4m3 (fp8)\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--numerics") && i + 1 < argc) {
            if (!kern_numerics_parse(argv[++i], &numerics)) {
                fprintf(stderr, "tandem perplexity: --numerics '%s': it must be fast or reference\n", argv[i]);
                return 2;
            }
        }
        else if (!file && argv[i][0] != '-') file = argv[i];
        else {
            fputs(cli_perplexity_usage, stderr);
            return 2;
        }
    }
    if (!file || ctx < 16 || ctx > 65536 || ctx % 2 || threads < 0) {
        fputs(cli_perplexity_usage, stderr);
        return 2;
    }
    FILE *fp = fopen(file, "rb");
    if (!fp) {
        fprintf(stderr, "tandem perplexity: %s: %s\n", file, strerror(errno));
        return 1;
    }
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *text = malloc((size_t)size + 1);
    size_t got = text ? fread(text, 1, (size_t)size, fp) : 0;
    fclose(fp);
    eng_model_t *m = NULL;
    kern_backend_t *be = NULL;
    eng_kv_pool_t *pool = NULL;
    eng_forward_t *f = NULL;
    int32_t *toks = NULL, *table = NULL;
    size_t cap = 0, n = 0;
    int ret = 1;
    if (!text || got != (size_t)size || eng_model_open(model, &m))
        goto out;
    eng_model_set_hold(m, hold);
    eng_model_set_dummy(m, dummy);
    if (m->desc.context && (uint32_t)ctx > m->desc.context) {
        fprintf(stderr, "tandem perplexity: --ctx %ld is past the model's context of %u\n", ctx, m->desc.context);
        goto out;
    }
    if (eng_tokenizer_encode(m->tok, text, got, 0, &toks, &cap, &n))
        goto out;
    uint32_t bt = 16, nblocks = (uint32_t)(ctx + bt - 1) / bt;
    td_kv_layout_t g = td_kv_layout_make(m->kv_id, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, bt, kv_dtype);
    table = malloc(nblocks * sizeof *table);
    if (!table || eng_backend_open(device, (int)threads, numerics, &be) || eng_kv_pool_create(be, &g, nblocks, NULL, &pool) ||
        eng_forward_create(m, be, pool, PPL_ROWS, PPL_ROWS, &f))
        goto out;
    for (uint32_t i = 0; i < nblocks; i++)
        table[i] = (int32_t)i;
    size_t chunks = n / (size_t)ctx, scored = 0;
    if (!chunks) {
        fprintf(stderr, "tandem perplexity: %s has %zu tokens, fewer than one chunk of %ld\n", file, n, ctx);
        goto out;
    }
    double nll = 0, t0 = now_s();
    uint32_t V = m->desc.vocab;
    for (size_t c = 0; c < chunks; c++) {
        const int32_t *ch = toks + c * (size_t)ctx;
        double cn = 0;
        for (uint32_t p = 0; p < (uint32_t)ctx; p += PPL_ROWS) {
            uint32_t k = (uint32_t)ctx - p < PPL_ROWS ? (uint32_t)ctx - p : PPL_ROWS;
            bool score = p + k > (uint32_t)ctx / 2;
            eng_batch_seq_t s = {.tokens = ch + p, .n = k, .pos0 = p, .block_table = table, .n_blocks = nblocks,
                                 .all_logits = score};
            const float *lg;
            uint32_t nl;
            if (eng_forward_run(f, &s, 1, &lg, &nl))
                goto out;
            for (uint32_t r = 0; score && r < k; r++) {
                uint32_t i = p + r;
                if (i < (uint32_t)ctx / 2 || i + 1 >= (uint32_t)ctx)
                    continue;
                const float *row = lg + (size_t)r * V;
                cn += eng_logsumexp(row, (int32_t)V) - row[ch[i + 1]]; /* the log-probabilities' one definition */
                scored++;
            }
        }
        nll += cn;
        fprintf(stderr, "\r[%zu/%zu] ppl %.4f", c + 1, chunks, exp(nll / (double)scored));
    }
    double dt = now_s() - t0;
    fprintf(stderr, "\n");
    printf("perplexity %.6f over %zu scored tokens (%zu chunks of %ld, %zu tokens in the file); %.1f tokens/s\n",
           exp(nll / (double)scored), scored, chunks, ctx, n, chunks * (double)ctx / dt);
    ret = 0;
out:
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    kern_backend_destroy(be); /* the device's own destroy */
    eng_model_close(m);
    free(table);
    free(toks);
    free(text);
    return ret;
}
