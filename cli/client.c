/* client.c — the client forms of the command line: `tandem generate
 * --endpoint HOST:PORT ...` (a streaming Generate against a router) and
 * `tandem health --endpoint HOST:PORT` (exit 0 when the cluster serves). */
#define _GNU_SOURCE
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

int cli_health(int argc, char **argv)
{
    const char *ep = NULL;
    td_rpc_tls_t tls = {0};
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--endpoint") && i + 1 < argc)
            ep = argv[++i];
        else if (!cli_tls_flag(argc, argv, &i, &tls)) {
            ep = NULL;
            break;
        }
    }
    if (!ep) {
        fputs(cli_health_usage, stderr);
        return 2;
    }
    td_log_set_level(TD_LOG_OFF);
    td_rpc_init();
    td_rpc_channel_t *ch;
    int code = 1;
    if (td_rpc_channel_create(ep, tls.ca_file || tls.cert_file ? &tls : NULL, &ch) == TD_OK) {
        uint8_t *out;
        size_t n;
        td_rpc_result_t res;
        if (td_rpc_unary(ch, "/tandem.v1.Tandem/Health", "", 0, 2.0, NULL, &out, &n, &res) == TD_OK) {
            Tandem__V1__HealthResponse *h = tandem__v1__health_response__unpack(NULL, n, out);
            if (h) {
                printf("%s %s\n", h->status == TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING ? "SERVING" : "NOT_SERVING",
                       h->detail ? h->detail : "");
                code = h->status == TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING ? 0 : 1;
                tandem__v1__health_response__free_unpacked(h, NULL);
            }
            free(out);
        } else {
            fprintf(stderr, "tandem health: %s: %s\n", td_rpc_code_name(res.code), res.message);
        }
        td_rpc_channel_destroy(ch);
    }
    td_rpc_shutdown();
    return code;
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
    if (td_rpc_channel_create(endpoint, tls, &ch) || td_rpc_stream_open(ch, "/tandem.v1.Tandem/Generate", buf, n,
                                                                          timeout_s, NULL, &st)) {
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
                            "decode %s]\n",
                    r->usage->prompt_tokens, r->usage->completion_tokens, r->timing->ttft_ms, r->timing->tpot_ms,
                    r->timing->e2e_ms, r->timing->prefill_worker, r->timing->decode_worker);
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
    "                    [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]\n"
    "  the ops config (deploy/ops.yaml) for the cluster behind the router at HOST:PORT: a whole file,\n"
    "  or fixed worker counts for its model. The router keeps it in etcd; the planner and the nodes'\n"
    "  agents do the rest (tandem health shows the planner's decision). An administrator's call:\n"
    "  from the router's host, or with a client certificate named \"admin\".\n";

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
    const char *ep = NULL, *file = NULL;
    td_rpc_tls_t tls = {0};
    Tandem__V1__ScaleRequest rq = TANDEM__V1__SCALE_REQUEST__INIT;
    for (int i = 0; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--endpoint") && v)
            ep = argv[++i];
        else if (!strcmp(argv[i], "--apply") && v)
            file = argv[++i];
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
