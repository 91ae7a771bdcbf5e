/* fuzz_safetensors.c — libFuzzer target: any bytes given to the safetensors
 * reader either open (and every tensor's first values decode) or fail with an
 * error; never a crash or an overread (ASan). */
#include <stdint.h>

#include "common/log.h"
#include "engine/safetensors.h"
#include "kernels/quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    td_log_set_level(TD_LOG_OFF);
    eng_safetensors_t *st;
    if (eng_st_open_mem(data, size, "fuzz.safetensors", &st) != TD_OK)
        return 0;
    float buf[256];
    for (size_t i = 0; i < eng_st_n_tensors(st); i++) {
        const eng_st_tensor_t *t = eng_st_tensor_at(st, i);
        size_t n = t->n_elems < 256 ? t->n_elems : 256;
        if (n)
            (void)kern_dequant_row(t->type, t->data, buf, n);
    }
    eng_st_close(st);
    return 0;
}
