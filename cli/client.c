/* client.c — the client forms of the command line: `tandem generate
 * --endpoint HOST:PORT ...` (a streaming Generate against a router) and
 * `tandem health --endpoint HOST:PORT` (exit 0 when the cluster serves) and
 * `tandem status --endpoint HOST:PORT` (the same answer, for a person). */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdbool.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "cli/cli.h"
#include "common/log.h"
#include "common/ops.h"
#include "common/rpc.h"
#include "tandem/v1/tandem.pb-c.h"

bool cli_tls_flag(int argc, char **argv, int *i, td_rpc_tls_t *tls)
{
    const char *a = argv[*i];
    const char **slot = !strcmp(a, "--tls-ca")     ? &tls->ca_file
                        : !strcmp(a, "--tls-cert") ? &tls->cert_file
                        : !strcmp(a, "--tls-key")  ? &tls->key_file
                                                   : NULL;
    if (!slot || *i + 1 >= argc)
        return false;
    *slot = argv[++*i];
    return true;
}

const char cli_health_usage[] = "usage: tandem health --endpoint HOST:PORT [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]\n";
const char cli_status_usage[] =
    "usage: tandem status --endpoint HOST:PORT [--tls-ca PEM [--tls-cert PEM --tls-key PEM]] [--json]\n"
    "  the cluster at a glance: nodes, routers, workers (role, load, KV pool), the KV store's tiers,\n"
    "  SLO attainment over the last minute, the planner's last decision and why\n";

/* The router's Health answer: 0 and *out (free with
 * tandem__v1__health_response__free_unpacked), 2 for bad flags (usage
 * printed), 1 when the router does not answer (said on stderr). */
static int health_call(const char *prog, const char *usage, int argc, char **argv, bool *json,
                       Tandem__V1__HealthResponse **out)
{
    const char *ep = NULL;
    td_rpc_tls_t tls = {0};
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--endpoint") && i + 1 < argc)
            ep = argv[++i];
        else if (json && !strcmp(argv[i], "--json"))
            *json = true;
        else if (!cli_tls_flag(argc, argv, &i, &tls)) {
            ep = NULL;
            break;
        }
    }
    if (!ep) {
        fputs(usage, stderr);
        return 2;
    }
    td_log_set_level(TD_LOG_OFF);
    td_rpc_init();
    td_rpc_channel_t *ch;
    int code = 1;
    *out = NULL;
    if (td_rpc_channel_create(ep, tls.ca_file || tls.cert_file ? &tls : NULL, &ch) == TD_OK) {
        uint8_t *resp;
        size_t n;
        td_rpc_result_t res;
        if (td_rpc_unary(ch, "/tandem.v1.Tandem/Health", "", 0, 5.0, NULL, &resp, &n, &res) == TD_OK) {
            *out = tandem__v1__health_response__unpack(NULL, n, resp);
            if (*out)
                code = 0;
            else
                fprintf(stderr, "%s: %s: the Health answer does not parse\n", prog, ep);
            free(resp);
        } else {
            fprintf(stderr, "%s: %s: %s: %s\n", prog, ep, td_rpc_code_name(res.code), res.message);
        }
        td_rpc_channel_destroy(ch);
    } else {
        fprintf(stderr, "%s: %s\n", prog, td_last_error());
    }
    td_rpc_shutdown();
    return code;
}

int cli_health(int argc, char **argv)
{
    Tandem__V1__HealthResponse *h;
    int code = health_call("tandem health", cli_health_usage, argc, argv, NULL, &h);
    if (code)
        return code;
    bool serving = h->status == TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING;
    printf("%s %s\n", serving ? "SERVING" : "NOT_SERVING", h->detail ? h->detail : "");
    tandem__v1__health_response__free_unpacked(h, NULL);
    return serving ? 0 : 1;
}

static const char *str(json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "-";
}

static double num(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_number(v) ? json_number_value(v) : 0;
}

/* The placement table's line of worker id (queued work, calls in flight). */
static json_t *placed_worker(json_t *d, const char *id)
{
    json_t *ws = json_object_get(json_object_get(d, "placement"), "workers"), *w;
    size_t i;
    json_array_foreach(ws, i, w) if (!strcmp(str(w, "id"), id)) return w;
    return NULL;
}

int cli_status(int argc, char **argv)
{
    Tandem__V1__HealthResponse *h;
    bool as_json = false;
    int code = health_call("tandem status", cli_status_usage, argc, argv, &as_json, &h);
    if (code)
        return code;
    bool serving = h->status == TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING;
    json_t *d = json_loads(h->detail ? h->detail : "", 0, NULL);
    if (as_json || !d) {
        printf("%s\n", h->detail ? h->detail : "{}");
        json_decref(d);
        tandem__v1__health_response__free_unpacked(h, NULL);
        return serving ? 0 : 1;
    }
    size_t i;
    json_t *o;
    printf("cluster: %s, %d prefill + %d decode workers, %.0f requests served (%.0f ok, %.0f failed)\n",
           serving ? "SERVING" : "NOT SERVING", (int)num(d, "prefill_workers"), (int)num(d, "decode_workers"),
           num(d, "requests"), num(d, "ok"), num(d, "errors"));
    printf("\nnodes:\n");
    json_array_foreach(json_object_get(d, "nodes"), i, o) printf("  %-20s %s\n", str(o, "key"), str(o, "address"));
    if (!json_array_size(json_object_get(d, "nodes")))
        printf("  (no node agent registered)\n");
    printf("\nrouters:\n");
    json_array_foreach(json_object_get(d, "routers"), i, o)
        printf("  %-36s metrics %s\n", str(o, "key"), str(o, "metrics"));
    printf("\nworkers:                               queued   calls   KV pool blocks (in use / cached / all)  running\n");
    json_array_foreach(json_object_get(d, "pools"), i, o) {
        json_t *pw = placed_worker(d, str(o, "id"));
        if (json_object_get(o, "error")) {
            printf("  %-8s %-26s does not answer: %s\n", str(o, "role"), str(o, "id"), str(o, "error"));
            continue;
        }
        printf("  %-8s %-26s %6.0f ms %5d   %6d / %6d / %6d (%3.0f%%)          %5d\n", str(o, "role"), str(o, "id"),
               pw ? num(pw, "queued_ms") : 0, pw ? (int)num(pw, "inflight") : 0, (int)num(o, "kv_in_use"),
               (int)num(o, "kv_cached"), (int)num(o, "kv_blocks"),
               num(o, "kv_blocks") ? 100 * num(o, "kv_in_use") / num(o, "kv_blocks") : 0, (int)num(o, "running"));
    }
    json_array_foreach(json_object_get(d, "refused"), i, o)
        printf("  refused  %-26s %s\n", str(o, "id"), str(o, "why"));
    printf("\nKV store:\n");
    json_array_foreach(json_object_get(d, "kvstore"), i, o) {
        if (json_object_get(o, "error")) {
            printf("  %-20s does not answer: %s\n", str(o, "id"), str(o, "error"));
            continue;
        }
        printf("  %-20s hit rate %5.1f%% (%.0f of %.0f blocks asked), %d replicas\n", str(o, "id"),
               100 * num(o, "hit_rate"), num(o, "hits"), num(o, "gets"), (int)num(o, "replicas"));
        size_t k;
        json_t *t;
        json_array_foreach(json_object_get(o, "tiers"), k, t)
            printf("    %-4s %8.1f / %8.1f MiB, %6d blocks, %.0f hits, %.0f evictions\n", str(t, "tier"),
                   num(t, "used_bytes") / 1048576.0, num(t, "capacity_bytes") / 1048576.0, (int)num(t, "blocks"),
                   num(t, "hits"), num(t, "evictions"));
    }
    if (json_object_get(d, "kvstore_error"))
        printf("  %s\n", str(d, "kvstore_error"));
    json_t *slo = json_object_get(d, "slo");
    char ttft[32] = "none", tpot[32] = "none"; /* 0: no SLO */
    if (num(slo, "ttft_ms") > 0)
        snprintf(ttft, sizeof ttft, "%.0f ms", num(slo, "ttft_ms"));
    if (num(slo, "tpot_ms") > 0)
        snprintf(tpot, sizeof tpot, "%.0f ms", num(slo, "tpot_ms"));
    printf("\nSLO (TTFT %s, TPOT %s, target %.0f%%) over the last %d s: ", ttft, tpot, 100 * num(slo, "target"),
           (int)num(slo, "window_s"));
    if (json_object_get(slo, "attainment"))
        printf("%.1f%% of %d requests met it (TTFT p90 %.0f ms, TPOT p90 %.1f ms)\n", 100 * num(slo, "attainment"),
               (int)num(slo, "requests"), num(slo, "ttft_p90_ms"), num(slo, "tpot_p90_ms"));
    else
        printf("no request ended\n");
    json_t *pl = json_object_get(d, "planner"), *want = json_object_get(pl, "desired");
    printf("\nplanner: this router %s the planner", json_is_true(json_object_get(pl, "leader")) ? "is" : "is not");
    if (want)
        printf("; desired %d prefill + %d decode workers, set by %s: %s\n", (int)num(want, "prefill"),
               (int)num(want, "decode"), str(want, "by"), str(want, "reason"));
    else
        printf("; no desired counts yet\n");
    if (json_is_true(json_object_get(pl, "leader")) && json_string_length(json_object_get(pl, "verdict")))
        printf("  last look: %s\n", str(pl, "verdict"));
    if (json_string_length(json_object_get(pl, "error")))
        printf("  error: %s\n", str(pl, "error"));
    json_decref(d);
    tandem__v1__health_response__free_unpacked(h, NULL);
    return serving ? 0 : 1;
}

int cli_generate_remote(const char *endpoint, const td_rpc_tls_t *tls, const char *prompt, bool chat, bool ids,
                        Tandem__V1__SamplingParams *sp, double timeout_s)
{
    td_rpc_init();
    Tandem__V1__GenerateRequest rq = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__ChatInput ci = TANDEM__V1__CHAT_INPUT__INIT;
    Tandem__V1__ChatMessage msg = TANDEM__V1__CHAT_MESSAGE__INIT;
    Tandem__V1__ChatMessage *msgs[1] = {&msg};
    if (chat) {
        msg.role = "user";
        msg.content = (char *)prompt;
        ci.n_messages = 1;
        ci.messages = msgs;
        rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
        rq.chat = &ci;
    } else {
        rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        rq.prompt = (char *)prompt;
    }
    rq.sampling = sp;
    rq.has_return_token_ids = 1;
    rq.return_token_ids = ids;
    size_t n = tandem__v1__generate_request__get_packed_size(&rq);
    uint8_t *buf = malloc(n);
    tandem__v1__generate_request__pack(&rq, buf);
    td_rpc_channel_t *ch;
    td_rpc_stream_t *st;
    int code = 1;
    double t0 = td_now_s();
    /* an API key (router.api_keys) from the environment, as gRPC's authorization metadata */
    char auth[300] = "";
    if (getenv("TANDEM_API_KEY") && getenv("TANDEM_API_KEY")[0])
        snprintf(auth, sizeof auth, "Bearer %s", getenv("TANDEM_API_KEY"));
    if (td_rpc_channel_create(endpoint, tls, &ch)) {
        free(buf);
        return 1;
    }
    td_rpc_channel_set_authorization(ch, auth);
    if (td_rpc_stream_open(ch, "/tandem.v1.Tandem/Generate", buf, n, timeout_s, NULL, &st)) {
        td_rpc_channel_destroy(ch);
        free(buf);
        return 1;
    }
    free(buf);
    const uint8_t *m;
    size_t ml;
    size_t count = 0;
    while (td_rpc_stream_read(st, &m, &ml, timeout_s) == TD_OK) {
        Tandem__V1__GenerateResponse *r = tandem__v1__generate_response__unpack(NULL, ml, m);
        if (!r)
            break;
        if (ids)
            for (size_t i = 0; i < r->n_token_ids; i++)
                printf(count++ ? " %d" : "%d", r->token_ids[i]);
        else
            fputs(r->text ? r->text : "", stdout);
        fflush(stdout);
        if (r->has_finish_reason && r->timing && r->usage)
            fprintf(stderr, "\n[%u prompt + %u generated tokens; TTFT %.1f ms, TPOT %.2f ms, e2e %.1f ms; prefill %s, "
                            "decode %s; %u prompt tokens cached, %u of them from the KV store]\n",
                    r->usage->prompt_tokens, r->usage->completion_tokens, r->timing->ttft_ms, r->timing->tpot_ms,
                    r->timing->e2e_ms, r->timing->prefill_worker, r->timing->decode_worker,
                    r->usage->cached_prompt_tokens, r->usage->store_cached_tokens);
        tandem__v1__generate_response__free_unpacked(r, NULL);
    }
    if (ids)
        printf("\n");
    td_rpc_result_t res;
    if (td_rpc_stream_result(st, 5, &res) == TD_OK)
        code = 0;
    else
        fprintf(stderr, "tandem generate: %s: %s (after %.1f s)\n", td_rpc_code_name(res.code), res.message,
                td_now_s() - t0);
    td_rpc_stream_destroy(st);
    td_rpc_channel_destroy(ch);
    td_rpc_shutdown();
    return code;
}

const char cli_scale_usage[] =
    "usage: tandem scale --endpoint HOST:PORT (--apply OPS.yaml | --prefill N --decode M)\n"
    "                    [--admin-key FILE] [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]\n"
    "  the ops config (deploy/ops.yaml) for the cluster behind the router at HOST:PORT: a whole file,\n"
    "  or fixed worker counts for its model. The router keeps it in etcd; the planner and the nodes'\n"
    "  agents do the rest (tandem health shows the planner's decision). An administrator's call: with\n"
    "  a key of router.admin_keys (--admin-key FILE holds it; tandem up prints where its own is; or\n"
    "  the environment's TANDEM_ADMIN_KEY), or a client certificate named \"admin\".\n";

/* The first line of file, trimmed, into out; false (said) when unreadable or empty. */
static bool read_key(const char *prog, const char *file, char *out, size_t n)
{
    FILE *f = fopen(file, "r");
    bool ok = f && fgets(out, (int)n, f);
    if (f)
        fclose(f);
    if (ok)
        out[strcspn(out, " \t\r\n")] = 0;
    if (!ok || !out[0]) {
        fprintf(stderr, "%s: cannot read a key from %s%s%s\n", prog, file, errno ? ": " : "", errno ? strerror(errno) : "");
        return false;
    }
    return true;
}

static bool count_arg(const char *flag, const char *v, uint32_t *out)
{
    char *end;
    long n = strtol(v, &end, 10);
    if (*end || !*v || n < 1 || n > TD_OPS_MAX_WORKERS) {
        fprintf(stderr, "tandem scale: %s needs a count from 1 to %d, not '%s'\n", flag, TD_OPS_MAX_WORKERS, v);
        return false;
    }
    *out = (uint32_t)n;
    return true;
}

int cli_scale(int argc, char **argv)
{
    const char *ep = NULL, *file = NULL, *key_file = NULL;
    td_rpc_tls_t tls = {0};
    Tandem__V1__ScaleRequest rq = TANDEM__V1__SCALE_REQUEST__INIT;
    for (int i = 0; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--endpoint") && v)
            ep = argv[++i];
        else if (!strcmp(argv[i], "--apply") && v)
            file = argv[++i];
        else if (!strcmp(argv[i], "--admin-key") && v)
            key_file = argv[++i];
        else if (!strcmp(argv[i], "--prefill") && v) {
            if (!count_arg(argv[i], argv[i + 1], &rq.prefill))
                return 2;
            rq.has_prefill = 1;
            i++;
        } else if (!strcmp(argv[i], "--decode") && v) {
            if (!count_arg(argv[i], argv[i + 1], &rq.decode))
                return 2;
            rq.has_decode = 1;
            i++;
        } else if (!cli_tls_flag(argc, argv, &i, &tls)) {
            fprintf(stderr, "tandem scale: unknown argument '%s'\n%s", argv[i], cli_scale_usage);
            return 2;
        }
    }
    if (!ep || !file == !(rq.has_prefill && rq.has_decode) || rq.has_prefill != rq.has_decode) {
        fputs(cli_scale_usage, stderr);
        return 2;
    }
    char key[256] = "", auth[300] = "";
    errno = 0;
    if (key_file && !read_key("tandem scale", key_file, key, sizeof key))
        return 2;
    if (!key[0] && getenv("TANDEM_ADMIN_KEY"))
        snprintf(key, sizeof key, "%s", getenv("TANDEM_ADMIN_KEY"));
    if (key[0])
        snprintf(auth, sizeof auth, "Bearer %s", key);
    td_log_set_level(TD_LOG_OFF);
    char *text = NULL;
    if (file) { /* read and checked here (the errors name the file's lines), sent in canonical form */
        td_ops_t *ops = NULL;
        td_status_t rc = td_ops_load_file(file, &ops);
        if (!rc)
            rc = td_ops_format(ops, &text);
        td_ops_free(ops);
        if (rc) {
            fprintf(stderr, "tandem scale: %s\n", td_last_error());
            return 2;
        }
        rq.ops_yaml = text;
    }
    size_t n = tandem__v1__scale_request__get_packed_size(&rq);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) {
        free(text);
        return 1;
    }
    tandem__v1__scale_request__pack(&rq, buf);
    free(text);
    td_rpc_init();
    td_rpc_channel_t *ch;
    int code = 1;
    if (td_rpc_channel_create(ep, tls.ca_file || tls.cert_file ? &tls : NULL, &ch) == TD_OK) {
        td_rpc_channel_set_authorization(ch, auth);
        uint8_t *out;
        size_t on;
        td_rpc_result_t res;
        if (td_rpc_unary(ch, "/tandem.v1.Tandem/Scale", buf, n, 10.0, NULL, &out, &on, &res) == TD_OK) {
            Tandem__V1__ScaleResponse *sr = tandem__v1__scale_response__unpack(NULL, on, out);
            if (sr) {
                printf("# the ops config in force\n%s", sr->ops_yaml ? sr->ops_yaml : "");
                if (sr->desired && sr->desired[0])
                    printf("# the planner's last decision (it acts on this config within a few seconds)\n%s\n",
                           sr->desired);
                code = 0;
                tandem__v1__scale_response__free_unpacked(sr, NULL);
            }
            free(out);
        } else {
            fprintf(stderr, "tandem scale: %s: %s\n", td_rpc_code_name(res.code), res.message);
        }
        td_rpc_channel_destroy(ch);
    } else {
        fprintf(stderr, "tandem scale: %s\n", td_last_error());
    }
    free(buf);
    td_rpc_shutdown();
    return code;
}
