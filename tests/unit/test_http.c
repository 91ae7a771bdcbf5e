/* test_http.c — the router's OpenAI HTTP layer (router/http.h) over the
 * request pipeline and fake workers (router_rig.h), driven by libcurl: the
 * routes and their answers (models, health, completions whole and streamed
 * as server-sent events, tokenize), each worker failure mapped to its HTTP
 * status with OpenAI's error shape naming what failed, refused bodies (415,
 * 404, 405, 400 naming the field), API keys (401 without, 200 with), and a
 * client that hangs up cancelling its request upstream. */
#include "tests/unit/router_rig.h"

#include <curl/curl.h>
#include <openssl/evp.h>

#include "router/http.h"

typedef struct reply {
    long status;
    char *body;
    size_t n;
} reply_t;

static size_t on_data(char *p, size_t size, size_t n, void *ctx)
{
    reply_t *r = ctx;
    char *b = realloc(r->body, r->n + size * n + 1);
    cr_assert(b);
    memcpy(b + r->n, p, size * n);
    r->n += size * n;
    b[r->n] = '\0';
    r->body = b;
    return size * n;
}

/* One request to the HTTP port; ctype NULL: application/json when there is a body. */
static reply_t http(int port, const char *method, const char *path, const char *ctype, const char *body,
                    const char *bearer, double timeout_s)
{
    reply_t r = {0};
    CURL *c = curl_easy_init();
    char url[256], auth[256], ct[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    struct curl_slist *h = NULL;
    if (body) {
        snprintf(ct, sizeof ct, "Content-Type: %s", ctype ? ctype : "application/json");
        h = curl_slist_append(h, ct);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    }
    if (bearer) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", bearer);
        h = curl_slist_append(h, auth);
    }
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1e3));
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    if (curl_easy_perform(c) == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (!r.body)
        r.body = calloc(1, 1);
    return r;
}

/* The message of OpenAI's error shape, "" when the body has none. */
static const char *error_message(const reply_t *r, char *out, size_t n)
{
    json_t *j = json_loads(r->body, 0, NULL);
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    snprintf(out, n, "%s", m ? m : "");
    json_decref(j);
    return out;
}

/* "t1000 t1001 ..." for n tokens: the fake decode worker's text. */
static void expected_text(uint32_t n, char *out, size_t cap)
{
    size_t at = 0;
    out[0] = '\0';
    for (uint32_t i = 0; i < n; i++)
        at += (size_t)snprintf(out + at, cap - at, "t%u ", 1000 + i);
}

typedef struct front {
    rig_t g;
    rt_http_t *h;
    int port;
} front_t;

static void front_up(front_t *f, rt_keys_t *keys)
{
    rig_up(&f->g, keys);
    cr_assert_eq(rt_http_start(f->g.requests, "127.0.0.1:0", NULL, &f->h, &f->port), TD_OK);
}

static void front_down(front_t *f)
{
    rt_http_stop(f->h);
    rig_down(&f->g);
}

Test(http, routes_models_health_and_completions, .timeout = 60)
{
    front_t f;
    front_up(&f, NULL);
    reply_t r = http(f.port, "GET", "/health", NULL, NULL, NULL, 10);
    cr_assert_eq(r.status, 503, "%ld %s", r.status, r.body); /* no worker yet */
    free(r.body);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &f.g.table);
    fake_start(&d, "d1", "decode", false, &f.g.table);
    r = http(f.port, "GET", "/health", NULL, NULL, NULL, 10);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    free(r.body);
    r = http(f.port, "GET", "/v1/models", NULL, NULL, NULL, 10);
    cr_assert_eq(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    /* the model file's name without its extension (router.served_model_names unset) */
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id")),
                     "SmolLM2-135M-Instruct.Q4_1");
    json_decref(j);
    free(r.body);
    /* a request may name it, or the model's own name (GGUF general.name); another name is 404 naming the served one */
    char body[512];
    snprintf(body, sizeof body, "{\"model\": \"%s\", \"prompt\": \"hi\", \"max_tokens\": 2}",
             f.g.input.model->desc.name);
    r = http(f.port, "POST", "/v1/completions", NULL, body, NULL, 30);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    free(r.body);
    r = http(f.port, "POST", "/v1/completions", NULL,
             "{\"model\": \"SmolLM2-135M-Instruct.Q4_1\", \"prompt\": \"hi\", \"max_tokens\": 2}", NULL, 30);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    free(r.body);
    r = http(f.port, "POST", "/v1/completions", NULL, "{\"model\": \"gpt-4\", \"prompt\": \"hi\", \"max_tokens\": 2}",
             NULL, 30);
    cr_assert_eq(r.status, 404, "%ld %s", r.status, r.body);
    cr_assert(strstr(r.body, "'gpt-4' is not served here (this router serves 'SmolLM2-135M-Instruct.Q4_1')"), "%s",
              r.body);
    free(r.body);
    r = http(f.port, "POST", "/v1/completions", NULL, "{\"prompt\": \"hello world\", \"max_tokens\": 7}", NULL, 30);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    j = json_loads(r.body, 0, NULL);
    char want[256];
    expected_text(7, want, sizeof want);
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(choice, "text")), want);
    cr_assert_str_eq(json_string_value(json_object_get(choice, "finish_reason")), "length");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 7);
    json_decref(j);
    free(r.body);
    fake_stop(&p);
    fake_stop(&d);
    front_down(&f);
}

/* A streamed completion: its SSE chunks' texts make the same text, then
 * data: [DONE]. */
Test(http, streamed_completion_is_server_sent_events, .timeout = 60)
{
    front_t f;
    front_up(&f, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &f.g.table);
    fake_start(&d, "d1", "decode", false, &f.g.table);
    reply_t r = http(f.port, "POST", "/v1/completions", NULL,
                     "{\"prompt\": \"hello world\", \"max_tokens\": 9, \"stream\": true}", NULL, 30);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    char got[512] = "", want[256];
    size_t at = 0;
    int events = 0;
    bool done = false;
    for (char *line = strtok(r.body, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: ", 6))
            continue;
        if (!strcmp(line + 6, "[DONE]")) {
            done = true;
            continue;
        }
        json_t *j = json_loads(line + 6, 0, NULL);
        cr_assert(j, "not JSON: %s", line);
        const char *t = json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
        if (t)
            at += (size_t)snprintf(got + at, sizeof got - at, "%s", t);
        events++;
        json_decref(j);
    }
    expected_text(9, want, sizeof want);
    cr_assert_str_eq(got, want);
    cr_assert(done && events >= 9, "%d events, [DONE] %d", events, done);
    free(r.body);
    fake_stop(&p);
    fake_stop(&d);
    front_down(&f);
}

/* Worker failures as HTTP: a reservation refused (INVALID_ARGUMENT) is
 * 400 naming the decode worker; no worker at all is 503. */
Test(http, worker_failures_map_to_statuses, .timeout = 60)
{
    front_t f;
    front_up(&f, NULL);
    const char *body = "{\"prompt\": \"hello\", \"max_tokens\": 3}";
    reply_t r = http(f.port, "POST", "/v1/completions", NULL, body, NULL, 30);
    char msg[1024];
    cr_assert_eq(r.status, 503, "%ld %s", r.status, r.body);
    cr_assert(strstr(error_message(&r, msg, sizeof msg), "worker"), "%s", r.body);
    free(r.body);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &f.g.table);
    fake_start(&d, "d1", "decode", false, &f.g.table);
    d.reserve_code[0] = TD_RPC_INVALID_ARGUMENT;
    r = http(f.port, "POST", "/v1/completions", NULL, body, NULL, 30);
    cr_assert_eq(r.status, 400, "%ld %s", r.status, r.body);
    cr_assert(strstr(error_message(&r, msg, sizeof msg), "decode worker d1"), "%s", r.body);
    free(r.body);
    fake_stop(&p);
    fake_stop(&d);
    front_down(&f);
}

/* Bodies and routes refused, each naming why. */
Test(http, refusals_name_what_was_wrong, .timeout = 60)
{
    front_t f;
    front_up(&f, NULL);
    char msg[1024];
    struct {
        const char *method, *path, *ctype, *body;
        long status;
        const char *names;
    } cases[] = {
        {"POST", "/v1/completions", "text/plain", "{\"prompt\": \"x\"}", 415, "application/json"},
        {"GET", "/v1/nothing", NULL, NULL, 404, "no route"},
        {"GET", "/v1/completions", NULL, NULL, 405, "POST"},
        {"POST", "/v1/completions", NULL, "{\"prompt\": \"x\", \"temperature\": -1}", 400, "temperature"},
        {"POST", "/v1/completions", NULL, "[1, 2]", 400, "array"},
        {"POST", "/v1/completions", NULL, "{\"prompt\": \"x\", \"guided_grammar\": \"root ::= x\"}", 400,
         "guided_grammar"},
        {"POST", "/v1/completions", NULL, "{\"prompt\": \"x\", \"guided_regex\": \"(a\"}", 400, "not closed"},
        {"POST", "/v1/chat/completions", NULL, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
         "\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"schema\": {\"not\": {}}}}}", 400, "not"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        reply_t r = http(f.port, cases[i].method, cases[i].path, cases[i].ctype, cases[i].body, NULL, 10);
        cr_assert_eq(r.status, cases[i].status, "%s %s: %ld %s", cases[i].method, cases[i].path, r.status, r.body);
        cr_assert(strstr(error_message(&r, msg, sizeof msg), cases[i].names), "%s %s: %s", cases[i].method,
                  cases[i].path, r.body);
        free(r.body);
    }
    reply_t r = http(f.port, "POST", "/tokenize", NULL, "{\"prompt\": \"hello world\"}", NULL, 10);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    json_t *j = json_loads(r.body, 0, NULL);
    cr_assert_gt(json_array_size(json_object_get(j, "tokens")), 1);
    json_decref(j);
    free(r.body);
    front_down(&f);
}

/* router.api_keys: no key or a wrong one is 401; the key in the file is let in. */
Test(http, api_keys, .timeout = 60)
{
    unsigned char dg[32];
    unsigned len = 0;
    cr_assert(EVP_Digest("sesame", 6, dg, &len, EVP_sha256(), NULL));
    char path[] = "/tmp/tandem-test-keys-XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *kf = fdopen(fd, "w");
    for (int i = 0; i < 32; i++)
        fprintf(kf, "%02x", dg[i]);
    fprintf(kf, " tester 0 0\n");
    fclose(kf);
    rt_keys_t *keys;
    cr_assert_eq(rt_keys_load(path, "router.api_keys", &keys), TD_OK);
    unlink(path);
    front_t f;
    front_up(&f, keys);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &f.g.table);
    fake_start(&d, "d1", "decode", false, &f.g.table);
    const char *body = "{\"prompt\": \"hello\", \"max_tokens\": 2}";
    reply_t r = http(f.port, "POST", "/v1/completions", NULL, body, NULL, 10);
    cr_assert_eq(r.status, 401, "%ld %s", r.status, r.body);
    free(r.body);
    r = http(f.port, "POST", "/v1/completions", NULL, body, "open-sesame", 10);
    cr_assert_eq(r.status, 401, "%ld %s", r.status, r.body);
    free(r.body);
    r = http(f.port, "POST", "/v1/completions", NULL, body, "sesame", 30);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.body);
    free(r.body);
    fake_stop(&p);
    fake_stop(&d);
    front_down(&f);
    rt_keys_free(keys);
}

/* A client that hangs up mid-prefill cancels its request: the prefill
 * worker is asked to stop and the landing is released closed. */
Test(http, hang_up_cancels_upstream, .timeout = 60)
{
    front_t f;
    front_up(&f, NULL);
    fake_t p, d;
    fake_start(&p, "p1", "prefill", false, &f.g.table);
    fake_start(&d, "d1", "decode", false, &f.g.table);
    p.prefill_hangs = true;
    reply_t r = http(f.port, "POST", "/v1/completions", NULL,
                     "{\"prompt\": \"hello\", \"max_tokens\": 4, \"stream\": true}", NULL, 0.5);
    cr_assert_eq(r.status, 0); /* the client gave up */
    free(r.body);
    wait_settled(&d, 1);
    cr_assert_eq(d.releases_closed, 1);
    cr_assert_eq(p.cancels, 1);
    fake_stop(&p);
    fake_stop(&d);
    front_down(&f);
}

/* A public request read whole (rt_input_check): each bad field refused with its code and name, before any
 * tokenizing where the check is cheaper; a good one tokenized, its max_tokens the default where unset. */
Test(http, request_checks_name_the_field, .timeout = 30)
{
    require_default_model();
    rt_input_t in;
    cr_assert_eq(rt_input_open(DEFAULT_MODEL, NULL, &in), TD_OK);
    Tandem__V1__GenerateRequest rq = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    char err[600], *stops[RT_MAX_STOP + 1], *empty = "", big[RT_MAX_STOP_BYTES + 2];
    int32_t *ids;
    size_t n;
    uint32_t mt;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "input: set prompt"), "%s", err);
    rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
    rq.prompt = "The capital of France is";
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), 0, "%s", err);
    cr_assert(n > 3 && ids && mt == 16, "%zu ids, max_tokens %u", n, mt);
    free(ids);
    rq.model = "another";
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_NOT_FOUND);
    cr_assert(strstr(err, "model: 'another'") && !ids, "%s", err);
    rq.model = NULL;
    rq.sampling = &sp;
    for (size_t i = 0; i <= RT_MAX_STOP; i++)
        stops[i] = "x";
    sp.stop = stops;
    sp.n_stop = RT_MAX_STOP + 1;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling.stop: 17 strings"), "%s", err);
    sp.n_stop = 2;
    stops[1] = empty;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling.stop[1]: empty"), "%s", err);
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    stops[1] = big;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling.stop[1]: 1025 bytes"), "%s", err);
    sp.n_stop = 0;
    sp.has_n = 1;
    sp.n = RT_MAX_CHOICES + 1;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling.n: 17 choices"), "%s", err);
    sp.has_n = 0;
    sp.temperature = -1;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling: ") && strstr(err, "temperature"), "%s", err);
    sp.temperature = 0;
    sp.max_tokens = 4;
    sp.min_tokens = 5;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling.min_tokens: 5 is over max_tokens 4"), "%s", err);
    sp.min_tokens = 0;
    sp.max_tokens = in.model->desc.context;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), TD_RPC_INVALID_ARGUMENT);
    cr_assert(strstr(err, "sampling.max_tokens: ") && strstr(err, "exceed the context") && !ids, "%s", err);
    sp.max_tokens = 0; /* with prompt_logprobs: the prompt scored alone */
    sp.has_max_tokens = 1;
    sp.prompt_logprobs = 1;
    cr_assert_eq(rt_input_check(&in, &rq, 16, &ids, &n, &mt, err, sizeof err), 0, "%s", err);
    cr_assert_eq(mt, 0);
    free(ids);
    rt_input_close(&in);
}

/* router.served_model_names: the list read in order, the model's own name an alias, a bad list refused naming it */
Test(http, served_model_names, .timeout = 30)
{
    require_default_model();
    rt_input_t in;
    cr_assert_eq(rt_input_open(DEFAULT_MODEL, "smollm2,tiny-chat", &in), TD_OK);
    cr_assert_eq(in.n_served, 2);
    cr_assert_str_eq(rt_input_name(&in), "smollm2");
    cr_assert(rt_input_serves(&in, "tiny-chat") && rt_input_serves(&in, in.model->desc.name));
    cr_assert(!rt_input_serves(&in, "SmolLM2-135M-Instruct.Q4_1") && !rt_input_serves(&in, "smollm"));
    rt_input_close(&in);
    static const char *bad[] = {",a", "a,,b", "a,", "1,2,3,4,5,6,7,8,9"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_eq(rt_input_open(DEFAULT_MODEL, bad[i], &in), TD_ERR_CONFIG, "%s", bad[i]);
        cr_assert(strstr(td_last_error(), "router.served_model_names"), "%s", td_last_error());
        rt_input_close(&in);
    }
}
