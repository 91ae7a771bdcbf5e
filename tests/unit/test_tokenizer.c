/* test_tokenizer.c — token ids against the reference tokenizers.
 *
 * The corpus (tests/fixtures/tokenizer/corpus.jsonl, made by make_corpus.py)
 * holds 2,005 strings — many scripts, emoji and ZWJ sequences, combining marks,
 * whitespace runs, code, digit runs, spelled special tokens, invalid UTF-8 —
 * with the ids Hugging Face `tokenizers` (the model's original pipeline) and
 * llama.cpp give them. tandem must equal `tokenizers` on every string. */
#include "tests/unit/helpers.h"

#include <pthread.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/pretok.h"
#include "engine/tokenizer.h"

typedef struct corpus_stats {
    size_t n, hf_mismatch, llama_agree, llama_differs, llama_crash, roundtrip_fail, stream_fail;
} corpus_stats_t;

static void check_stream(const eng_tokenizer_t *tok, const int32_t *ids, size_t n, const char *full, size_t full_len,
                         corpus_stats_t *st)
{
    eng_tok_stream_t s;
    eng_tok_stream_init(&s, tok, false);
    char *acc = malloc(full_len * 3 + 64);
    size_t at = 0;
    char piece[4096];
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        size_t k;
        cr_assert_eq(eng_tok_stream_push(&s, ids[i], piece, sizeof piece, &k), TD_OK);
        /* every emitted piece is whole UTF-8 */
        for (size_t j = 0; j < k;) {
            size_t cl = 0;
            unsigned char c = (unsigned char)piece[j];
            cl = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
            if (j + cl > k) {
                ok = false;
                break;
            }
            j += cl;
        }
        memcpy(acc + at, piece, k);
        at += k;
    }
    at += eng_tok_stream_finish(&s, acc + at, 64);
    if (!ok || at != full_len || memcmp(acc, full, full_len) != 0)
        st->stream_fail++;
    free(acc);
}

static corpus_stats_t run_corpus(const eng_tokenizer_t *tok)
{
    size_t len;
    char *data = read_file(FIXTURE("tokenizer/corpus.jsonl"), &len);
    corpus_stats_t st = {0};
    int32_t *ids = NULL;
    size_t cap = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        json_error_t err;
        json_t *row = json_loads(line, 0, &err);
        cr_assert(row, "corpus line %zu: %s", st.n + 1, err.text);
        size_t tl;
        char *text = hex_decode(json_string_value(json_object_get(row, "hex")), &tl);
        int32_t *want;
        size_t nw = json_ids(json_object_get(row, "hf"), &want);
        size_t n;
        cr_assert_eq(eng_tokenizer_encode(tok, text, tl, ENG_TOK_PARSE_SPECIAL, &ids, &cap, &n), TD_OK);
        bool same = n == nw && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0);
        if (!same) {
            st.hf_mismatch++;
            if (st.hf_mismatch <= 5) {
                fprintf(stderr, "mismatch on corpus line %zu (%s):\n  tandem:", st.n + 1,
                        json_string_value(json_object_get(row, "hex")));
                for (size_t i = 0; i < n; i++)
                    fprintf(stderr, " %d", ids[i]);
                fprintf(stderr, "\n  hf:    ");
                for (size_t i = 0; i < nw; i++)
                    fprintf(stderr, " %d", want[i]);
                fprintf(stderr, "\n");
            }
        }
        json_t *ll = json_object_get(row, "llama");
        if (!ll)
            st.llama_agree += same;
        else if (json_is_string(ll))
            st.llama_crash++;
        else
            st.llama_differs++;
        /* decoding gives back the text, with invalid UTF-8 replaced */
        char *dec;
        size_t dl;
        cr_assert_eq(eng_tokenizer_decode(tok, ids, n, false, &dec, &dl), TD_OK);
        size_t sl = 0;
        char *clean = eng_utf8_sanitize(text, tl, &sl);
        const char *expect = clean ? clean : text;
        size_t el = clean ? sl : tl;
        if (dl != el || memcmp(dec, expect, el) != 0)
            st.roundtrip_fail++;
        check_stream(tok, ids, n, dec, dl, &st);
        free(dec);
        free(clean);
        free(want);
        free(text);
        json_decref(row);
        st.n++;
    }
    free(ids);
    free(data);
    return st;
}

Test(tokenizer, smollm2_corpus_matches_hf_tokenizers)
{
    require_default_model();
    eng_gguf_t *g;
    eng_tokenizer_t *tok;
    cr_assert_eq(eng_gguf_open(DEFAULT_MODEL, &g), TD_OK);
    cr_assert_eq(eng_tokenizer_from_gguf(g, &tok), TD_OK);
    corpus_stats_t st = run_corpus(tok);
    fprintf(stderr,
            "tokenizer corpus: %zu strings; equal to HF tokenizers on %zu; llama.cpp agrees with both on %zu, "
            "differs on %zu (invalid UTF-8), aborts on %zu\n",
            st.n, st.n - st.hf_mismatch, st.llama_agree, st.llama_differs, st.llama_crash);
    cr_assert_geq(st.n, 2000);
    cr_assert_eq(st.hf_mismatch, 0, "%zu strings tokenize differently from HF tokenizers", st.hf_mismatch);
    cr_assert_eq(st.roundtrip_fail, 0, "%zu strings do not decode back", st.roundtrip_fail);
    cr_assert_eq(st.stream_fail, 0, "%zu streams differ from the full decode", st.stream_fail);
    eng_tokenizer_destroy(tok);
    eng_gguf_close(g);
}

/* One tokenizer, many threads (the router tokenizes on every RPC thread):
 * each thread's ids are those of a single-threaded encode. A shared regex
 * match buffer once made two simultaneous requests crash the router. */
typedef struct enc_job {
    const eng_tokenizer_t *tok;
    const char *text;
    const int32_t *want;
    size_t n_want;
    int bad;
} enc_job_t;

static void *enc_thread(void *arg)
{
    enc_job_t *j = arg;
    for (int it = 0; it < 300; it++) {
        int32_t *ids = NULL;
        size_t n = 0, cap = 0;
        if (eng_tokenizer_encode(j->tok, j->text, strlen(j->text), 0, &ids, &cap, &n) || n != j->n_want ||
            memcmp(ids, j->want, n * sizeof *ids))
            j->bad++;
        free(ids);
    }
    return NULL;
}

Test(tokenizer, concurrent_encodes_equal_single_threaded)
{
    require_default_model();
    eng_gguf_t *g;
    eng_tokenizer_t *tok;
    cr_assert_eq(eng_gguf_open(DEFAULT_MODEL, &g), TD_OK);
    cr_assert_eq(eng_tokenizer_from_gguf(g, &tok), TD_OK);
    static const char *texts[4] = {
        "The history of the lighthouse begins in ancient times. Summarize the text above in one sentence:",
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # 12345 67890",
        "Ünïcödé — text with emoji 🙂🙂 and numbers 3.14159, 2718281828; done.",
        "   leading spaces, tabs\tand\nnewlines\r\n   and 'quotes' it's we're they'll",
    };
    enc_job_t jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        int32_t *ids = NULL;
        size_t n = 0, cap = 0;
        cr_assert_eq(eng_tokenizer_encode(tok, texts[i], strlen(texts[i]), 0, &ids, &cap, &n), TD_OK);
        jobs[i] = (enc_job_t){tok, texts[i], ids, n, 0};
    }
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, enc_thread, &jobs[i]);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        cr_assert_eq(jobs[i].bad, 0, "thread %d: %d of 300 encodes differ from the single-threaded one", i, jobs[i].bad);
        free((void *)jobs[i].want);
    }
    eng_tokenizer_destroy(tok);
    eng_gguf_close(g);
}

/* The tiny Hugging Face folders: tokenizer.json loaders (byte-level with the
 * Llama 3 regex and ignore_merges; SentencePiece with byte fallback). */
static void run_hf_expected(const char *dir, const char *column)
{
    eng_model_t *m;
    cr_assert_eq(eng_model_open(dir, &m), TD_OK, "%s", td_last_error());
    size_t len;
    char *data = read_file(FIXTURE("hf/expected.jsonl"), &len);
    size_t rows = 0, bad = 0;
    int32_t *ids = NULL;
    size_t cap = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *row = json_loads(line, 0, NULL);
        size_t tl, n;
        char *text = hex_decode(json_string_value(json_object_get(row, "hex")), &tl);
        int32_t *want;
        size_t nw = json_ids(json_object_get(row, column), &want);
        cr_assert_eq(eng_tokenizer_encode(m->tok, text, tl, ENG_TOK_PARSE_SPECIAL, &ids, &cap, &n), TD_OK);
        if (n != nw || (n && memcmp(ids, want, n * sizeof *ids))) {
            if (++bad <= 3) {
                fprintf(stderr, "%s row %zu (%s):\n  tandem:", column, rows, json_string_value(json_object_get(row, "hex")));
                for (size_t i = 0; i < n; i++)
                    fprintf(stderr, " %d", ids[i]);
                fprintf(stderr, "\n  hf:    ");
                for (size_t i = 0; i < nw; i++)
                    fprintf(stderr, " %d", want[i]);
                fprintf(stderr, "\n");
            }
        }
        free(want);
        free(text);
        json_decref(row);
        rows++;
    }
    fprintf(stderr, "%s: %zu of %zu strings equal to HF tokenizers\n", dir, rows - bad, rows);
    cr_assert_geq(rows, 400);
    cr_assert_eq(bad, 0);
    free(ids);
    free(data);
    eng_model_close(m);
}

Test(tokenizer, tokenizer_json_byte_level_llama3_style) { run_hf_expected(FIXTURE("hf/tiny-llama3"), "llama3"); }
Test(tokenizer, tokenizer_json_sentencepiece_byte_fallback) { run_hf_expected(FIXTURE("hf/tiny-spm"), "spm"); }

Test(tokenizer, bos_and_specials)
{
    eng_model_t *m;
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-spm"), &m), TD_OK);
    int32_t *ids = NULL;
    size_t cap = 0, n;
    cr_assert_eq(eng_tokenizer_encode(m->tok, "hi</s>", 6, ENG_TOK_PARSE_SPECIAL | ENG_TOK_ADD_BOS, &ids, &cap, &n), TD_OK);
    cr_assert_eq(ids[0], 1, "BOS first");
    cr_assert_eq(ids[n - 1], 2, "</s> parsed as the special token");
    cr_assert_eq(eng_tokenizer_encode(m->tok, "hi</s>", 6, 0, &ids, &cap, &n), TD_OK);
    cr_assert_neq(ids[n - 1], 2, "without PARSE_SPECIAL the text stays text");
    char *dec;
    size_t dl;
    cr_assert_eq(eng_tokenizer_encode(m->tok, "Hello world", 11, 0, &ids, &cap, &n), TD_OK);
    cr_assert_eq(eng_tokenizer_decode(m->tok, ids, n, false, &dec, &dl), TD_OK);
    cr_assert_str_eq(dec, "Hello world", "SentencePiece decode drops the prefix space");
    free(dec);
    free(ids);
    eng_model_close(m);
}

Test(tokenizer, decode_rejects_unknown_id)
{
    eng_model_t *m;
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-llama3"), &m), TD_OK);
    int32_t bad[] = {5, 100000};
    char *out;
    size_t len;
    cr_assert_eq(eng_tokenizer_decode(m->tok, bad, 2, false, &out, &len), TD_ERR_OUT_OF_RANGE);
    cr_assert(strstr(td_last_error(), "100000"), "the message names the id: %s", td_last_error());
    eng_model_close(m);
}

/* The token whose bytes are exactly the one byte b. */
static int32_t byte_token(const eng_tokenizer_t *tok, unsigned char b)
{
    for (int32_t id = 0; id < eng_tokenizer_n_vocab(tok); id++) {
        char tb[8];
        if (eng_tokenizer_token_bytes(tok, id, tb, sizeof tb) == 1 && (unsigned char)tb[0] == b)
            return id;
    }
    return -1;
}

Test(tokenizer, stream_holds_partial_utf8)
{
    require_default_model();
    eng_model_t *m;
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &m), TD_OK);
    const char *hug = "\xf0\x9f\xa4\x97"; /* U+1F917, fed one byte token at a time */
    eng_tok_stream_t s;
    eng_tok_stream_init(&s, m->tok, false);
    char out[256];
    size_t k, total = 0;
    for (int i = 0; i < 4; i++) {
        int32_t tid = byte_token(m->tok, (unsigned char)hug[i]);
        cr_assert_geq(tid, 0);
        cr_assert_eq(eng_tok_stream_push(&s, tid, out + total, sizeof out - total, &k), TD_OK);
        if (i < 3)
            cr_assert_eq(k, 0, "byte %d of 4 emits nothing yet", i + 1);
        total += k;
    }
    cr_assert_eq(total, 4);
    cr_assert(memcmp(out, hug, 4) == 0);
    /* a dangling lead byte at the end becomes U+FFFD */
    eng_tok_stream_init(&s, m->tok, false);
    cr_assert_eq(eng_tok_stream_push(&s, byte_token(m->tok, 0xe2), out, sizeof out, &k), TD_OK);
    cr_assert_eq(k, 0);
    k = eng_tok_stream_finish(&s, out, sizeof out);
    cr_assert_eq(k, 3);
    cr_assert(memcmp(out, "\xef\xbf\xbd", 3) == 0);
    eng_model_close(m);
}

/* SentencePiece from GGUF (Llama 2 / Mistral files: scores, no merges) against
 * llama.cpp on the same file (fixtures/tokenizer/make_spm_gguf.py). Strings
 * with invalid UTF-8 are compared after the replacement both make differ: there
 * llama.cpp replaces per byte, tandem per maximal subpart, so those rows are
 * counted apart. */
Test(tokenizer, gguf_sentencepiece_matches_llama_cpp)
{
    eng_gguf_t *g;
    eng_tokenizer_t *tok;
    cr_assert_eq(eng_gguf_open(FIXTURE("tokenizer/spm.gguf"), &g), TD_OK, "%s", td_last_error());
    cr_assert_eq(eng_tokenizer_from_gguf(g, &tok), TD_OK, "%s", td_last_error());
    cr_assert_eq(eng_tokenizer_kind(tok), ENG_TOK_BPE_SPM);
    size_t len;
    char *data = read_file(FIXTURE("tokenizer/spm_expected.jsonl"), &len);
    size_t rows = 0, valid = 0, bad = 0;
    int32_t *ids = NULL;
    size_t cap = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *row = json_loads(line, 0, NULL);
        size_t tl, n;
        char *text = hex_decode(json_string_value(json_object_get(row, "hex")), &tl);
        size_t sl;
        char *clean = eng_utf8_sanitize(text, tl, &sl);
        rows++;
        if (!clean) {
            int32_t *want;
            size_t nw = json_ids(json_object_get(row, "llama"), &want);
            cr_assert_eq(eng_tokenizer_encode(tok, text, tl, ENG_TOK_PARSE_SPECIAL | ENG_TOK_ADD_BOS, &ids, &cap, &n),
                         TD_OK);
            if (n != nw || memcmp(ids, want, n * sizeof *ids)) {
                if (++bad <= 3) {
                    fprintf(stderr, "spm row %zu:\n  tandem:", rows);
                    for (size_t i = 0; i < n; i++)
                        fprintf(stderr, " %d", ids[i]);
                    fprintf(stderr, "\n  llama: ");
                    for (size_t i = 0; i < nw; i++)
                        fprintf(stderr, " %d", want[i]);
                    fprintf(stderr, "\n");
                }
            }
            free(want);
            valid++;
        }
        free(clean);
        free(text);
        json_decref(row);
    }
    fprintf(stderr, "sentencepiece GGUF: %zu of %zu valid-UTF-8 strings equal to llama.cpp\n", valid - bad, valid);
    cr_assert_geq(valid, 350);
    cr_assert_eq(bad, 0);
    free(ids);
    free(data);
    eng_tokenizer_destroy(tok);
    eng_gguf_close(g);
}

/* Normalizers from tokenizer.json: NFKC then lowercase before the Llama 3 split
 * (fixtures/hf/make_hf.py, column "norm"). */
Test(tokenizer, tokenizer_json_normalizers)
{
    eng_tokenizer_t *tok;
    cr_assert_eq(eng_tokenizer_from_json(FIXTURE("hf/norm-tokenizer.json"), NULL, &tok), TD_OK, "%s", td_last_error());
    size_t len;
    char *data = read_file(FIXTURE("hf/expected.jsonl"), &len);
    size_t rows = 0, bad = 0;
    int32_t *ids = NULL;
    size_t cap = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *row = json_loads(line, 0, NULL);
        size_t tl, n;
        char *text = hex_decode(json_string_value(json_object_get(row, "hex")), &tl);
        int32_t *want;
        size_t nw = json_ids(json_object_get(row, "norm"), &want);
        cr_assert_eq(eng_tokenizer_encode(tok, text, tl, ENG_TOK_PARSE_SPECIAL, &ids, &cap, &n), TD_OK);
        if (n != nw || (n && memcmp(ids, want, n * sizeof *ids))) {
            if (++bad <= 3)
                fprintf(stderr, "norm row %zu (%s) differs\n", rows, json_string_value(json_object_get(row, "hex")));
        }
        free(want);
        free(text);
        json_decref(row);
        rows++;
    }
    fprintf(stderr, "normalizers: %zu of %zu strings equal to HF tokenizers\n", rows - bad, rows);
    cr_assert_eq(bad, 0);
    free(ids);
    free(data);
    eng_tokenizer_destroy(tok);
}

/* The command line, run as a user runs it. */
static char *run(const char *cmd, int *status)
{
    char timed[1200];
    snprintf(timed, sizeof timed, "timeout 60 sh -c \"%s\"", cmd);
    FILE *p = popen(timed, "r");
    cr_assert(p);
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, p);
    buf[n] = '\0';
    *status = pclose(p);
    return buf;
}

Test(tokenizer, cli_tokenize_and_decode)
{
    require_default_model();
    int st;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/tandem tokenize %s 'Hello world'", TANDEM_BIN_DIR, DEFAULT_MODEL);
    cr_assert_str_eq(run(cmd, &st), "19556 905\n");
    cr_assert_eq(st, 0);
    snprintf(cmd, sizeof cmd, "%s/tandem tokenize %s --decode 19556 905", TANDEM_BIN_DIR, DEFAULT_MODEL);
    cr_assert_str_eq(run(cmd, &st), "Hello world\n");
    snprintf(cmd, sizeof cmd, "%s/tandem tokenize %s --chat hi --json", TANDEM_BIN_DIR, DEFAULT_MODEL);
    json_t *j = json_loads(run(cmd, &st), 0, NULL);
    cr_assert(j && st == 0);
    cr_assert_eq(json_integer_value(json_array_get(json_object_get(j, "ids"), 0)), 1, "<|im_start|> first");
    json_decref(j);
    snprintf(cmd, sizeof cmd, "printf 'a\\nb' | %s/tandem tokenize %s -", TANDEM_BIN_DIR, DEFAULT_MODEL);
    cr_assert_str_eq(run(cmd, &st), "81 198 82\n");
    snprintf(cmd, sizeof cmd, "%s/tandem tokenize %s --decode 99999 2>&1", TANDEM_BIN_DIR, DEFAULT_MODEL);
    cr_assert(strstr(run(cmd, &st), "'99999' is not a token id"));
    cr_assert_neq(st, 0);
    snprintf(cmd, sizeof cmd, "%s/tandem tokenize /no/such.gguf hi 2>&1", TANDEM_BIN_DIR);
    cr_assert(strstr(run(cmd, &st), "/no/such.gguf"));
    cr_assert_neq(st, 0);
    snprintf(cmd, sizeof cmd, "%s/tandem inspect %s --json", TANDEM_BIN_DIR, DEFAULT_MODEL);
    j = json_loads(run(cmd, &st), 0, NULL);
    cr_assert(j && st == 0);
    cr_assert_eq(json_array_size(json_object_get(j, "tensors")), 272);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "model"), "layers")), 30);
    json_decref(j);
}
