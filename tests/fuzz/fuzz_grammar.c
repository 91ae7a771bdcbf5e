/* fuzz_grammar.c — libFuzzer target: structured output's compiler on any
 * source (the first byte picks a JSON Schema, a regular expression or a list
 * of strings, one a line) either compiles or fails with an error naming what
 * is wrong; never a crash, a hang or an overread (ASan). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/grammar.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    td_log_set_level(TD_LOG_OFF);
    if (!size)
        return 0;
    char *src = malloc(size);
    if (!src)
        return 0;
    memcpy(src, data + 1, size - 1);
    src[size - 1] = 0;
    static const eng_grammar_kind_t kinds[] = {ENG_GRAMMAR_JSON_SCHEMA, ENG_GRAMMAR_REGEX, ENG_GRAMMAR_CHOICE,
                                               ENG_GRAMMAR_JSON_OBJECT};
    eng_grammar_kind_t k = kinds[data[0] % 4];
    const char *choices[64];
    size_t n = 0;
    for (char *p = src; k == ENG_GRAMMAR_CHOICE && n < 64 && p;) {
        choices[n++] = p;
        if ((p = strchr(p, '\n')))
            *p++ = 0;
    }
    eng_grammar_t *g = NULL;
    if (eng_grammar_compile(k, src, choices, n, &g) == TD_OK)
        eng_grammar_free(g);
    free(src);
    return 0;
}
