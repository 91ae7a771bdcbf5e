/* fuzz_gguf.c — libFuzzer target: any bytes given to the GGUF reader either
 * open (and then every accessor, the model description, the tokenizer and a
 * dequantization of each tensor's first blocks run clean) or fail with an
 * error; never a crash, an overread or a huge allocation (ASan). */
#include <stdint.h>
#include <stdlib.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "kernels/quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    td_log_set_level(TD_LOG_OFF);
    eng_gguf_t *g;
    if (eng_gguf_open_mem(data, size, "fuzz.gguf", &g) != TD_OK)
        return 0;
    for (size_t i = 0; i < eng_gguf_n_kv(g); i++) {
        const eng_gguf_kv_t *kv = eng_gguf_kv_at(g, i);
        if (kv->type == ENG_GGUF_ARRAY && kv->arr_type == ENG_GGUF_STRING)
            for (uint64_t k = 0; k < kv->arr_len; k++)
                (void)eng_gguf_arr_str(g, kv, k);
        else if (kv->type == ENG_GGUF_ARRAY && kv->arr_type != ENG_GGUF_ARRAY)
            for (uint64_t k = 0; k < kv->arr_len; k++)
                (void)eng_gguf_arr_num(kv, k);
    }
    float buf[512];
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_at(g, i);
        size_t block = kern_type_info(t->type)->block_elems;
        size_t n = t->n_elems < 512 ? t->n_elems : 512;
        n -= n % block;
        if (n)
            (void)eng_gguf_tensor_read_f32(t, 0, n, buf);
    }
    eng_model_desc_t d;
    (void)eng_model_desc_from_gguf(g, &d);
    eng_tokenizer_t *tok;
    if (eng_tokenizer_from_gguf(g, &tok) == TD_OK) {
        int32_t *ids = NULL;
        size_t cap = 0, n = 0;
        static const char text[] = "Hello, world! 123 <|im_start|> \xe2\x82";
        if (eng_tokenizer_encode(tok, text, sizeof text - 1, ENG_TOK_PARSE_SPECIAL, &ids, &cap, &n) == TD_OK) {
            char *out;
            size_t len;
            if (eng_tokenizer_decode(tok, ids, n, false, &out, &len) == TD_OK)
                free(out);
        }
        free(ids);
        eng_tokenizer_destroy(tok);
    }
    eng_gguf_close(g);
    return 0;
}
