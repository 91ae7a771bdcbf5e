/* fuzz_openai.c — libFuzzer target: any bytes given to the HTTP front door's
 * request parser (router/openai_req.c) as a chat or a text completion body
 * either become a tandem.v1 GenerateRequest or an error naming a field;
 * never a crash, a leak or an overread (ASan). The first byte picks the kind. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai_req.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!size)
        return 0;
    rt_oai_kind_t kind = data[0] & 1 ? RT_OAI_CHAT : RT_OAI_COMPLETION;
    Tandem__V1__GenerateRequest *rq = NULL;
    rt_oai_opts_t o = {0};
    rt_oai_error_t e;
    memset(&e, 0, sizeof e);
    bool ok = rt_oai_parse(kind, (const char *)data + 1, size - 1, "fuzz", &rq, &o, &e);
    if (ok && !rq)
        __builtin_trap(); /* a success must give a request */
    if (!ok && !e.msg[0])
        __builtin_trap(); /* a failure must say what */
    tandem__v1__generate_request__free_unpacked(rq, NULL);
    char *text = malloc(size), name[RT_OAI_TOOL_NAME + 1]; /* the same bytes as an answer read back into a call */
    if (text) {
        memcpy(text, data + 1, size - 1);
        text[size - 1] = 0;
        free(rt_oai_read_call(text, name, sizeof name));
        free(text);
    }
    return 0;
}
