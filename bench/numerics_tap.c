/* numerics_tap.c — writes every intermediate of a forward pass, for comparing
 * tandem's numerics with another engine's op by op (bench/numerics_tap.py
 * does it against llama.cpp).
 *
 *   tandem-numerics-tap MODEL OUT_DIR PROMPT_IDS [DECODE_IDS]
 *
 * PROMPT_IDS and DECODE_IDS are comma-separated token ids: the prompt runs as
 * one prefill, then each decode id as one step. OUT_DIR gets one raw fp32 file
 * per tap, named STEP_NAME[-LAYER].f32, and index.tsv (file, rows, cols).
 * Reference numerics unless TANDEM_TAP_NUMERICS=fast. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/log.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "kernels/backend.h"

typedef struct tap_out {
    const char *dir;
    FILE *index;
    int step;
} tap_out_t;

static void on_tap(void *ctx, const char *name, int layer, const float *x, uint32_t rows, uint32_t cols)
{
    tap_out_t *t = ctx;
    char file[512];
    if (layer >= 0)
        snprintf(file, sizeof file, "%d_%s-%d.f32", t->step, name, layer);
    else
        snprintf(file, sizeof file, "%d_%s.f32", t->step, name);
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", t->dir, file);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(x, sizeof *x, (size_t)rows * cols, fp) != (size_t)rows * cols)
        fprintf(stderr, "numerics-tap: cannot write %s: %s\n", path, strerror(errno));
    if (fp)
        fclose(fp);
    fprintf(t->index, "%s\t%u\t%u\n", file, rows, cols);
}

static size_t parse_ids(const char *s, int32_t *out, size_t cap)
{
    size_t n = 0;
    while (s && *s && n < cap) {
        char *end;
        out[n++] = (int32_t)strtol(s, &end, 10);
        s = *end == ',' ? end + 1 : NULL;
    }
    return n;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: tandem-numerics-tap MODEL OUT_DIR PROMPT_IDS [DECODE_IDS]\n");
        return 2;
    }
    static int32_t prompt[4096], dec[4096];
    kern_numerics_t numerics = KERN_NUMERICS_REFERENCE;
    const char *nm = getenv("TANDEM_TAP_NUMERICS");
    if (nm && !kern_numerics_parse(nm, &numerics)) {
        fprintf(stderr, "numerics-tap: TANDEM_TAP_NUMERICS must be fast or reference\n");
        return 2;
    }
    size_t np = parse_ids(argv[3], prompt, 4096), nd = argc > 4 ? parse_ids(argv[4], dec, 4096) : 0;
    mkdir(argv[2], 0755);
    char ipath[1024];
    snprintf(ipath, sizeof ipath, "%s/index.tsv", argv[2]);
    tap_out_t t = {.dir = argv[2], .index = fopen(ipath, "w")};
    eng_model_t *m;
    kern_backend_t *be;
    eng_kv_pool_t *pool;
    eng_forward_t *f;
    uint32_t bt = 16, nblocks = (uint32_t)(np + nd + bt) / bt;
    if (!t.index || eng_model_open(argv[1], &m)) {
        fprintf(stderr, "numerics-tap: %s\n", td_last_error());
        return 1;
    }
    td_kv_layout_t g = td_kv_layout_make(m->kv_id, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, bt, TD_KV_F16);
    if (kern_cpu_backend_create_numerics(2, numerics, &be) || eng_kv_pool_create(be, &g, nblocks, NULL, &pool) ||
        eng_forward_create(m, be, pool, (uint32_t)np, 1, &f)) {
        fprintf(stderr, "numerics-tap: %s\n", td_last_error());
        return 1;
    }
    int32_t table[512];
    for (uint32_t i = 0; i < nblocks; i++)
        table[i] = (int32_t)i;
    eng_forward_set_tap(f, on_tap, &t);
    const float *lg;
    uint32_t nl;
    eng_batch_seq_t s = {.tokens = prompt, .n = (uint32_t)np, .pos0 = 0, .block_table = table, .n_blocks = nblocks,
                         .want_logits = true};
    int rc = 0;
    for (size_t i = 0; i <= nd && !rc; i++) {
        t.step = (int)i;
        if (i) {
            s = (eng_batch_seq_t){.tokens = &dec[i - 1], .n = 1, .pos0 = (uint32_t)(np + i - 1),
                                  .block_table = table, .n_blocks = nblocks, .want_logits = true};
        }
        if (eng_forward_run(f, &s, 1, &lg, &nl)) {
            fprintf(stderr, "numerics-tap: %s\n", td_last_error());
            rc = 1;
            break;
        }
        on_tap(&t, "result_output", -1, lg, 1, m->desc.vocab);
    }
    fclose(t.index);
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    kern_cpu_backend_destroy(be);
    eng_model_close(m);
    return rc;
}
