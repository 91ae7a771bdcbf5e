/* generate.c — `tandem generate`: runs the engine in this process on one
 * prompt (or K copies of it, batched) and streams the text as it is made, then
 * prints time to first token, decode speed and token counts on stderr. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "cli/cli.h"
#include "common/config.h"
#include "common/log.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "worker/sampling_pb.h"

#define DEFAULT_MODEL_PATH TD_DEFAULT_MODEL

const char cli_generate_usage[] =
    "usage: tandem generate [--model PATH | --endpoint HOST:PORT [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]] [--chat] [--max-tokens N] [--temperature T] [--top-k K]\n"
    "                       [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S] [--n K]\n"
    "                       [--stop STR]... [--stop-token-id ID]... [--min-tokens N] [--ignore-eos] [--threads N]\n"
    "                       [--json-schema SCHEMA | --json-object | --regex RE | --choice STR...]\n"
    "                       [--kv-tokens N | --kv-mib M] [--kv-dtype fp16|fp32|fp8_e4m3] [--ids]\n"
    "                       [--numerics fast|reference] [--device cpu|cuda[:N]] [--tp N] [--token-budget N]\n"
    "                       [--weights file|fp8]\n"
    "                       [--load-format auto|dummy]\n"
    "                       PROMPT\n";

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct gen_state {
    int n;
    bool ids;
    double t0, t_first, t_last;
    uint64_t first_id;
    size_t generated;
    char **texts;      /* per sequence, when n > 1 */
    size_t *lens;
    int32_t **toks;
    size_t *ntoks;
    eng_finish_t *fin;
} gen_state_t;

static void on_event(void *ctx, const eng_event_t *ev)
{
    gen_state_t *g = ctx;
    int i = (int)(ev->id - g->first_id);
    double t = now_s();
    if (!g->t_first)
        g->t_first = t;
    g->t_last = t;
    if (ev->token >= 0)
        g->generated++;
    if (ev->token >= 0 && ev->finish != ENG_FINISH_EOS) {
        g->toks[i][g->ntoks[i]++] = ev->token;
        if (g->n == 1 && !g->ids) {
            fwrite(ev->text, 1, ev->text_len, stdout);
            fflush(stdout);
        } else if (g->n == 1 && g->ids) {
            printf(g->ntoks[i] > 1 ? " %d" : "%d", ev->token);
            fflush(stdout);
        }
    }
    if (g->n > 1 && ev->text_len) {
        char *nt = realloc(g->texts[i], g->lens[i] + ev->text_len + 1);
        if (nt) {
            memcpy(nt + g->lens[i], ev->text, ev->text_len);
            g->lens[i] += ev->text_len;
            nt[g->lens[i]] = '\0';
            g->texts[i] = nt;
        }
    }
    if (ev->finish)
        g->fin[i] = ev->finish;
}

static bool parse_num(const char *flag, const char *v, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v ? v : "", &end);
    if (!v || errno || end == v || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "tandem generate: %s needs a number in [%g, %g], not '%s'\n", flag, lo, hi, v ? v : "");
        return false;
    }
    *out = x;
    return true;
}

static void ignore_event(void *ctx, const eng_event_t *ev)
{
    (void)ctx;
    (void)ev;
}

/* A GPU loads its kernels and picks its GEMM algorithms on first use: one
 * small request (a 20-token prompt, 2 tokens) goes through the engine first,
 * so that TTFT times the request and not that (it counts in "load"). Its
 * prompt does not begin with BOS, so no later prompt finds its block cached. */
static td_status_t warm_up(eng_engine_t *e, const eng_model_t *m)
{
    int32_t p[20];
    for (int i = 0; i < 20; i++)
        p[i] = (int32_t)m->desc.vocab - 1 - i;
    eng_request_t r = {.prompt = p, .n_prompt = 20, .sampling = eng_sampling_default(), .max_tokens = 2,
                       .ignore_eos = true};
    uint64_t id;
    td_status_t rc = eng_engine_add(e, &r, &id);
    while (!rc && eng_engine_busy(e))
        rc = eng_engine_step(e, ignore_event, NULL);
    return rc;
}

/* The client form: the same request, served by a cluster. */
static int generate_remote(const char *endpoint, const td_rpc_tls_t *tls, const char *prompt, bool chat, bool ids,
                           const eng_request_t *req)
{
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp.has_temperature = sp.has_top_k = sp.has_top_p = sp.has_min_p = sp.has_repetition_penalty = 1;
    sp.has_seed = sp.has_max_tokens = sp.has_ignore_eos = 1;
    sp.temperature = req->sampling.temperature;
    sp.top_k = req->sampling.top_k;
    sp.top_p = req->sampling.top_p;
    sp.min_p = req->sampling.min_p;
    sp.repetition_penalty = req->sampling.repetition_penalty;
    sp.seed = req->sampling.seed;
    sp.max_tokens = req->max_tokens;
    sp.ignore_eos = req->ignore_eos;
    sp.n_stop = req->n_stop;
    sp.stop = (char **)req->stop;
    sp.has_min_tokens = 1;
    sp.min_tokens = req->sampling.min_tokens;
    sp.n_stop_token_ids = req->sampling.n_stop_ids;
    sp.stop_token_ids = (int32_t *)req->sampling.stop_ids;
    eng_sampling_grammar_to_pb(&req->sampling, &sp);
    return cli_generate_remote(endpoint, tls, prompt, chat, ids, &sp, 600);
}

/* The prompt's tokens: its text, or with --chat the model's chat template
 * around it as one user message. */
static td_status_t encode_prompt(const eng_model_t *m, const char *prompt, bool chat, int32_t **toks, size_t *cap,
                                 size_t *nt)
{
    char *text = NULL;
    if (chat) {
        eng_chat_t ch;
        eng_chat_msg_t msg = {"user", prompt};
        td_status_t rc = eng_chat_init(&ch, m->tok);
        if (!rc)
            rc = eng_chat_render(&ch, &msg, 1, true, &text);
        eng_chat_free(&ch);
        if (rc)
            return rc;
    }
    const char *input = text ? text : prompt;
    td_status_t rc = eng_tokenizer_encode(m->tok, input, strlen(input),
                                          (chat ? ENG_TOK_PARSE_SPECIAL : 0) | ENG_TOK_ADD_BOS, toks, cap, nt);
    free(text);
    return rc;
}

static bool gen_state_alloc(gen_state_t *g, uint32_t max_tokens)
{
    size_t n = (size_t)g->n;
    g->texts = calloc(n, sizeof *g->texts);
    g->lens = calloc(n, sizeof *g->lens);
    g->toks = calloc(n, sizeof *g->toks);
    g->ntoks = calloc(n, sizeof *g->ntoks);
    g->fin = calloc(n, sizeof *g->fin);
    if (!g->texts || !g->lens || !g->toks || !g->ntoks || !g->fin)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!(g->toks[i] = malloc((max_tokens + 1) * sizeof(int32_t))))
            return false;
    return true;
}

static void gen_state_free(gen_state_t *g)
{
    for (int i = 0; i < g->n; i++) {
        free(g->texts ? g->texts[i] : NULL);
        free(g->toks ? g->toks[i] : NULL);
    }
    free(g->texts);
    free(g->lens);
    free(g->toks);
    free(g->ntoks);
    free(g->fin);
}

/* With --n above 1, each sequence after the streamed text. */
static void print_sequences(const gen_state_t *g)
{
    if (g->n == 1)
        putchar('\n');
    for (int i = 0; g->n > 1 && i < g->n; i++) {
        printf("--- sequence %d (%s)\n", i, eng_finish_name(g->fin[i]));
        if (g->ids)
            for (size_t k = 0; k < g->ntoks[i]; k++)
                printf(k ? " %d" : "%d", g->toks[i][k]);
        else if (g->texts[i])
            fputs(g->texts[i], stdout);
        putchar('\n');
    }
}

int cli_generate(int argc, char **argv)
{
    const char *model = DEFAULT_MODEL_PATH, *prompt = NULL, *endpoint = NULL;
    bool chat = false, ids = false;
    td_rpc_tls_t tls = {0};
    eng_request_t req = {.sampling = eng_sampling_default(), .max_tokens = 128};
    eng_engine_config_t cfg = eng_engine_config_default();
    const char *stops[16];
    const char *choices[64];
    size_t n_choices = 0;
    int32_t stop_ids[ENG_MAX_STOP_IDS];
    int n = 1;
    double v;
    eng_weight_hold_t hold = ENG_WEIGHTS_FILE;
    bool dummy = false;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *nx = i + 1 < argc ? argv[i + 1] : NULL;
#define NUM(flag, lo, hi) (!strcmp(a, flag) && (i++, true) && parse_num(flag, nx, lo, hi, &v))
        if (!strcmp(a, "--model") && nx) model = argv[++i];
        else if (!strcmp(a, "--endpoint") && nx) endpoint = argv[++i];
        else if (cli_tls_flag(argc, argv, &i, &tls)) ;
        else if (!strcmp(a, "--chat")) chat = true;
        else if (!strcmp(a, "--ids")) ids = true;
        else if (!strcmp(a, "--numerics") && nx) {
            if (!kern_numerics_parse(argv[++i], &cfg.numerics)) {
                fprintf(stderr, "tandem generate: --numerics '%s': it must be fast or reference\n", nx);
                return 2;
            }
        }
        else if (!strcmp(a, "--kv-dtype") && nx) {
            if (!td_kv_dtype_parse(argv[++i], &cfg.kv_dtype)) {
                fprintf(stderr, "tandem generate: --kv-dtype '%s': it must be fp16, fp32 or fp8_e4m3 (fp8)\n", nx);
                return 2;
            }
        }
        else if (!strcmp(a, "--device") && nx) cfg.device = argv[++i];
        else if (!strcmp(a, "--load-format") && nx) {
            if (strcmp(nx, "auto") && strcmp(nx, "dummy")) {
                fprintf(stderr, "tandem generate: --load-format '%s': it must be auto or dummy\n", nx);
                return 2;
            }
            dummy = !strcmp(argv[++i], "dummy");
        }
        else if (!strcmp(a, "--weights") && nx) {
            if (!eng_weight_hold_parse(argv[++i], &hold)) {
                fprintf(stderr, "tandem generate: --weights '%s': it must be file or fp8\n", nx);
                return 2;
            }
        }
        else if (!strcmp(a, "--ignore-eos")) req.ignore_eos = true;
        else if (!strcmp(a, "--json-schema") && nx) req.sampling.grammar = ENG_GRAMMAR_JSON_SCHEMA,
                                                   req.sampling.grammar_src = argv[++i];
        else if (!strcmp(a, "--json-object")) req.sampling.grammar = ENG_GRAMMAR_JSON_OBJECT;
        else if (!strcmp(a, "--regex") && nx) req.sampling.grammar = ENG_GRAMMAR_REGEX,
                                             req.sampling.grammar_src = argv[++i];
        else if (!strcmp(a, "--choice") && nx && n_choices < 64)
            req.sampling.grammar = ENG_GRAMMAR_CHOICE, choices[n_choices++] = argv[++i];
        else if (!strcmp(a, "--stop") && nx && req.n_stop < 16) stops[req.n_stop++] = argv[++i];
        else if (NUM("--max-tokens", 0, 1e6)) req.max_tokens = (uint32_t)v;
        else if (NUM("--min-tokens", 0, 1e6)) req.sampling.min_tokens = (uint32_t)v;
        else if (req.sampling.n_stop_ids < ENG_MAX_STOP_IDS && NUM("--stop-token-id", 0, 2147483647))
            stop_ids[req.sampling.n_stop_ids++] = (int32_t)v;
        else if (NUM("--temperature", -1e9, 1e9)) req.sampling.temperature = (float)v;
        else if (NUM("--top-k", -1e9, 1e9)) req.sampling.top_k = (int32_t)v;
        else if (NUM("--top-p", -1e9, 1e9)) req.sampling.top_p = (float)v;
        else if (NUM("--min-p", -1e9, 1e9)) req.sampling.min_p = (float)v;
        else if (NUM("--repetition-penalty", -1e9, 1e9)) req.sampling.repetition_penalty = (float)v;
        else if (NUM("--seed", 0, 1.8e19)) req.sampling.seed = (uint64_t)v;
        else if (NUM("--n", 1, 256)) n = (int)v;
        else if (NUM("--threads", 0, 1024)) cfg.n_threads = (int)v;
        else if (NUM("--tp", 1, 16)) cfg.tp = (uint32_t)v;
        else if (NUM("--token-budget", 16, 1 << 20)) cfg.token_budget = (uint32_t)v;
        else if (NUM("--kv-tokens", 16, 1e9)) cfg.kv_tokens = (uint64_t)v;
        else if (NUM("--kv-mib", 1, 1e7)) cfg.kv_bytes = (uint64_t)(v * 1048576.0), cfg.kv_tokens = 0;
        else if (a[0] == '-' && a[1] == '-' && a[2]) {
            if (i < argc && !strcmp(argv[i], a)) /* not a NUM flag that failed to parse */
                fprintf(stderr, "tandem generate: unknown or incomplete option '%s'\n%s", a, cli_generate_usage);
            return 2;
        } else if (!prompt) prompt = a;
        else {
            fprintf(stderr, "tandem generate: unexpected argument '%s'\n%s", a, cli_generate_usage);
            return 2;
        }
#undef NUM
    }
    if (!prompt) {
        fputs(cli_generate_usage, stderr);
        return 2;
    }
    req.stop = stops;
    req.sampling.stop_ids = stop_ids;
    req.sampling.grammar_choices = choices;
    req.sampling.n_grammar_choices = n_choices;
    if (endpoint)
        return generate_remote(endpoint, tls.ca_file || tls.cert_file ? &tls : NULL, prompt, chat, ids, &req);
    double t_load = now_s();
    eng_model_t *m;
    if (eng_model_open(model, &m))
        return 1;
    eng_model_set_hold(m, hold);
    eng_model_set_dummy(m, dummy);
    int ret = 1;
    int32_t *toks = NULL;
    size_t cap = 0, nt = 0;
    eng_engine_t *e = NULL;
    gen_state_t g = {.n = n, .ids = ids};
    if (encode_prompt(m, prompt, chat, &toks, &cap, &nt))
        goto out;
    req.prompt = toks;
    req.n_prompt = nt;
    if (eng_sampling_validate(&req.sampling, (int32_t)m->desc.vocab))
        goto out;
    if ((uint32_t)n > cfg.max_seqs)
        cfg.max_seqs = (uint32_t)n;
    if (eng_engine_create(m, &cfg, &e) || (cfg.device && strcmp(cfg.device, "cpu") && warm_up(e, m)))
        goto out;
    if (!gen_state_alloc(&g, req.max_tokens)) {
        fprintf(stderr, "tandem generate: no memory for %d sequences\n", n);
        goto out;
    }
    double t_ready = now_s();
    g.t0 = t_ready;
    for (int i = 0; i < n; i++) {
        uint64_t id;
        eng_request_t r = req;
        r.sampling.seed = req.sampling.seed + (uint64_t)i; /* K different draws when sampling */
        if (eng_engine_add(e, &r, &id)) {
            fprintf(stderr, "tandem generate: %s\n", td_last_error());
            goto out;
        }
        if (i == 0)
            g.first_id = id;
    }
    while (eng_engine_busy(e))
        if (eng_engine_step(e, on_event, &g))
            goto out;
    print_sequences(&g);
    double ttft = g.t_first - g.t0, dec = g.t_last - g.t_first;
    size_t dec_tokens = g.generated > (size_t)n ? g.generated - (size_t)n : 0;
    eng_kv_stats_t kv = eng_engine_kv_stats(e);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(stderr, "\n[%s] load %.0f ms | prompt %zu tokens x %d | TTFT %.1f ms | decode %zu tokens in %.1f ms = "
                    "%.1f tok/s | KV %zu bytes/token, pool %u blocks (%.1f MiB) | peak RSS %.1f MiB | finish %s\n",
            model, (t_ready - t_load) * 1e3, nt, n, ttft * 1e3, dec_tokens, dec * 1e3,
            dec > 0 ? dec_tokens / dec : 0.0, kv.bytes_per_token, kv.n_blocks,
            (double)kv.n_blocks * kv.block_bytes / 1048576.0, ru.ru_maxrss / 1024.0, eng_finish_name(g.fin[0]));
    ret = 0;
out:
    gen_state_free(&g);
    eng_engine_destroy(e);
    free(toks);
    eng_model_close(m);
    return ret;
}
