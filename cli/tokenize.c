/* tokenize.c — `tandem tokenize MODEL TEXT` prints token ids separated by
 * spaces; `--decode ID...` prints text. --chat applies the model's chat
 * template to TEXT as one user message; --json prints {"ids": [...]} (with the
 * pieces); --no-special treats special-token text as plain text; --bos adds BOS
 * where the model wants one. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

const char cli_tokenize_usage[] = "usage: tandem tokenize MODEL TEXT [--chat] [--json] [--no-special] [--bos]\n"
                                "       tandem tokenize MODEL --decode ID...\n";

static char *read_stdin(size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t k = fread(buf + n, 1, cap - n, stdin);
        n += k;
        if (n < cap)
            break;
        char *nb = realloc(buf, cap *= 2);
        if (!nb)
            free(buf);
        buf = nb;
    }
    *len = n;
    return buf;
}

static int do_decode(eng_model_t *m, int n_ids, char **ids_text, bool as_json)
{
    int32_t *ids = malloc(((size_t)n_ids + 1) * sizeof *ids);
    if (!ids)
        return 1;
    for (int i = 0; i < n_ids; i++) {
        char *end;
        errno = 0;
        long v = strtol(ids_text[i], &end, 10);
        if (errno || *end || end == ids_text[i] || v < 0 || v >= eng_tokenizer_n_vocab(m->tok)) {
            fprintf(stderr, "tandem tokenize: '%s' is not a token id (0..%d)\n", ids_text[i],
                    eng_tokenizer_n_vocab(m->tok) - 1);
            free(ids);
            return 1;
        }
        ids[i] = (int32_t)v;
    }
    char *text;
    size_t len;
    td_status_t rc = eng_tokenizer_decode(m->tok, ids, (size_t)n_ids, false, &text, &len);
    free(ids);
    if (rc)
        return 1;
    if (as_json) {
        json_t *o = json_pack("{s:s%}", "text", text, len);
        json_dumpf(o, stdout, JSON_COMPACT);
        putchar('\n');
        json_decref(o);
    } else {
        fwrite(text, 1, len, stdout);
        putchar('\n');
    }
    free(text);
    return 0;
}

int cli_tokenize(int argc, char **argv)
{
    const char *model = NULL, *text = NULL;
    bool chat = false, as_json = false, special = true, bos = false;
    int decode_at = -1;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--chat")) chat = true;
        else if (!strcmp(argv[i], "--json")) as_json = true;
        else if (!strcmp(argv[i], "--no-special")) special = false;
        else if (!strcmp(argv[i], "--bos")) bos = true;
        else if (!strcmp(argv[i], "--decode")) { decode_at = i + 1; break; }
        else if (!model) model = argv[i];
        else if (!text) text = argv[i];
        else {
            fprintf(stderr, "tandem tokenize: unexpected argument '%s'\n%s", argv[i], cli_tokenize_usage);
            return 2;
        }
    }
    if (!model || (decode_at < 0 && !text)) {
        fputs(cli_tokenize_usage, stderr);
        return 2;
    }
    eng_model_t *m;
    if (eng_model_open(model, &m))
        return 1;
    int ret = 1;
    if (decode_at >= 0) {
        ret = do_decode(m, argc - decode_at, argv + decode_at, as_json);
        eng_model_close(m);
        return ret;
    }
    char *owned = NULL, *rendered = NULL;
    size_t len;
    if (!strcmp(text, "-")) {
        owned = read_stdin(&len);
        if (!owned)
            goto out;
        text = owned;
    } else {
        len = strlen(text);
    }
    if (chat) {
        eng_chat_t ch;
        char *msg = strndup(text, len);
        eng_chat_msg_t one = {.role = "user", .content = msg};
        td_status_t rc = msg ? eng_chat_init(&ch, m->tok) : TD_ERR_NO_MEMORY;
        if (!rc) {
            rc = eng_chat_render(&ch, &one, 1, true, &rendered);
            eng_chat_free(&ch);
        }
        free(msg);
        if (rc)
            goto out;
        text = rendered;
        len = strlen(rendered);
        special = true; /* the template's markers are special tokens */
    }
    int32_t *ids = NULL;
    size_t cap = 0, n = 0;
    unsigned flags = (special ? ENG_TOK_PARSE_SPECIAL : 0) | (bos ? ENG_TOK_ADD_BOS : 0);
    if (eng_tokenizer_encode(m->tok, text, len, flags, &ids, &cap, &n))
        goto out;
    if (as_json) {
        json_t *arr = json_array(), *pieces = json_array();
        for (size_t i = 0; i < n; i++) {
            char piece[512];
            size_t pl = eng_tokenizer_token_bytes(m->tok, ids[i], piece, sizeof piece);
            json_array_append_new(arr, json_integer(ids[i]));
            json_t *p = json_stringn(piece, pl); /* NULL when the piece is not valid UTF-8 alone */
            json_array_append_new(pieces, p ? p : json_null());
        }
        json_t *o = json_pack("{s:o,s:o,s:I}", "ids", arr, "pieces", pieces, "count", (json_int_t)n);
        json_dumpf(o, stdout, JSON_COMPACT);
        putchar('\n');
        json_decref(o);
    } else {
        for (size_t i = 0; i < n; i++)
            printf(i ? " %d" : "%d", ids[i]);
        putchar('\n');
    }
    free(ids);
    ret = 0;
out:
    free(owned);
    free(rendered);
    eng_model_close(m);
    return ret;
}
