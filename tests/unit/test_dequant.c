/* test_dequant.c — tandem's dequantization against the `gguf` package's.
 *
 * crafted: every supported type on random blocks (fixtures/dequant/
 * make_crafted.py), on the AVX2 and the portable path, must equal the
 * reference bit for bit (both follow ggml's arithmetic). real_model: every
 * tensor of the default model, summarized by ref_dequant.py (run live from the
 * test venv), must agree in count, sums and the first and last values. */
#include "tests/unit/helpers.h"

#include <math.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "kernels/quant.h"

static void check_crafted(void)
{
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open(FIXTURE("dequant/crafted.gguf"), &g), TD_OK, "%s", td_last_error());
    size_t len;
    float *want = (float *)(void *)read_file(FIXTURE("dequant/crafted_expected.bin"), &len);
    size_t at = 0;
    cr_assert_eq(eng_gguf_n_tensors(g), 9);
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_at(g, i);
        float *got = malloc(t->n_elems * sizeof *got);
        cr_assert_eq(eng_gguf_tensor_read_f32(t, 0, t->n_elems, got), TD_OK);
        size_t diff = 0;
        for (size_t k = 0; k < t->n_elems; k++)
            if (memcmp(&got[k], &want[at + k], 4) != 0 && !(isnan(got[k]) && isnan(want[at + k])))
                diff++;
        cr_assert_eq(diff, 0, "%s (%s path): %zu of %llu values differ from gguf's", kern_type_info(t->type)->name,
                     kern_cpu_path(), diff, (unsigned long long)t->n_elems);
        at += t->n_elems;
        free(got);
    }
    cr_assert_eq(at * 4, len);
    free(want);
    eng_gguf_close(g);
}

Test(dequant, crafted_every_type_default_path) { check_crafted(); }

Test(dequant, crafted_every_type_portable_path)
{
    setenv("TANDEM_CPU", "portable", 1); /* read once, at first use, in this test's process */
    check_crafted();
    cr_assert_str_eq(kern_cpu_path(), "portable");
}

Test(dequant, partial_reads_and_bad_ranges)
{
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open(FIXTURE("dequant/crafted.gguf"), &g), TD_OK);
    const eng_gguf_tensor_t *t = eng_gguf_tensor_find(g, "t.Q4_K");
    cr_assert(t);
    float all[1536], part[512];
    cr_assert_eq(eng_gguf_tensor_read_f32(t, 0, 1536, all), TD_OK);
    cr_assert_eq(eng_gguf_tensor_read_f32(t, 512, 512, part), TD_OK);
    cr_assert(memcmp(all + 512, part, sizeof part) == 0, "row 1 read alone equals row 1 of the whole");
    cr_assert_eq(eng_gguf_tensor_read_f32(t, 1024, 1024, part), TD_ERR_OUT_OF_RANGE);
    cr_assert_eq(eng_gguf_tensor_read_f32(t, 100, 256, part), TD_ERR_OUT_OF_RANGE, "start inside a block");
    eng_gguf_close(g);
}

Test(dequant, fp16_conversion_round_trips)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kern_fp16_to_fp32((uint16_t)h);
        if (isnan(f))
            continue;
        cr_assert_eq(kern_fp32_to_fp16(f), h, "fp16 %04x -> %g -> %04x", h, f, kern_fp32_to_fp16(f));
    }
    cr_assert_eq(kern_fp32_to_fp16(65520.0f), 0x7c00, "rounds to inf past the largest half");
    cr_assert_eq(kern_fp32_to_fp16(1.0f + 1.0f / 2048), 0x3c00, "ties go to even");
}

Test(dequant, real_model_every_tensor_matches_gguf_package, .timeout = 600)
{
    require_default_model();
    const char *py = TANDEM_SOURCE_DIR "/.venv/bin/python";
    cr_assert(access(py, X_OK) == 0, "the test venv is missing: run deploy/install-deps.sh --test");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout 500 %s %s %s", py, FIXTURE("dequant/ref_dequant.py"), DEFAULT_MODEL);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    eng_gguf_t *g;
    cr_assert_eq(eng_gguf_open(DEFAULT_MODEL, &g), TD_OK);
    size_t cap = 1 << 16, rows = 0;
    char *line = malloc(cap);
    float *buf = NULL;
    size_t buf_n = 0;
    while (fgets(line, (int)cap, p)) {
        json_t *row = json_loads(line, 0, NULL);
        cr_assert(row, "bad line from ref_dequant.py");
        const char *name = json_string_value(json_object_get(row, "name"));
        const eng_gguf_tensor_t *t = eng_gguf_tensor_find(g, name);
        cr_assert(t, "tensor %s", name);
        cr_assert_eq((json_int_t)t->n_elems, json_integer_value(json_object_get(row, "n")));
        if (buf_n < t->n_elems) {
            buf = realloc(buf, t->n_elems * sizeof *buf);
            buf_n = t->n_elems;
        }
        cr_assert_eq(eng_gguf_tensor_read_f32(t, 0, t->n_elems, buf), TD_OK);
        double sum = 0, sumsq = 0;
        for (size_t k = 0; k < t->n_elems; k++) {
            sum += buf[k];
            sumsq += (double)buf[k] * buf[k];
        }
        double rs = json_real_value(json_object_get(row, "sum")), rq = json_real_value(json_object_get(row, "sumsq"));
        cr_assert(fabs(sum - rs) <= 1e-9 * (fabs(rq) + 1), "%s: sum %.17g vs %.17g", name, sum, rs);
        cr_assert(fabs(sumsq - rq) <= 1e-9 * (rq + 1), "%s: sumsq %.17g vs %.17g", name, sumsq, rq);
        json_t *head = json_object_get(row, "head"), *tail = json_object_get(row, "tail");
        for (size_t k = 0; k < 32; k++) {
            cr_assert_eq(buf[k], (float)json_real_value(json_array_get(head, k)), "%s[%zu]", name, k);
            cr_assert_eq(buf[t->n_elems - 32 + k], (float)json_real_value(json_array_get(tail, k)), "%s tail", name);
        }
        json_decref(row);
        rows++;
    }
    cr_assert_eq(pclose(p), 0, "ref_dequant.py failed");
    cr_assert_eq(rows, eng_gguf_n_tensors(g), "every tensor compared");
    fprintf(stderr, "dequant: %zu tensors of the default model equal to the gguf package's (%s path)\n", rows,
            kern_cpu_path());
    free(buf);
    free(line);
    eng_gguf_close(g);
}
