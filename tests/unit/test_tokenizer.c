/* test_tokenizer.c — token ids against the reference tokenizers.
 *
 * The corpus (tests/fixtures/tokenizer/corpus.jsonl, made by make_corpus.py)
 * holds 2,005 strings — many scripts, emoji and ZWJ sequences, combining marks,
 * whitespace runs, code, digit runs, spelled special tokens, invalid UTF-8 —
 * with the ids Hugging Face `tokenizers` (the model's original pipeline) and
 * llama.cpp give them. tandem must equal `tokenizers` on every string. */
#include "tests/unit/helpers.h"

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
