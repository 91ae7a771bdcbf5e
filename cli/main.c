/* main.c — `tandem`: the command line. Dispatches to a subcommand. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"

static const char usage[] =
    "usage: tandem COMMAND [ARGS]\n"
    "  up [--config FILE] [--prefill N] [--decode N]  a whole cluster on this machine; prints the router's HOST:PORT\n"
    "  health --endpoint HOST:PORT           is the cluster serving (exit 0) or not\n"
    "  status --endpoint HOST:PORT           the cluster at a glance: nodes, workers, KV pools and store, SLOs, planner\n"
    "  certs --dir DIR [--hosts H1,H2]       a cluster CA and certificates for its processes\n"
    "  apikey NAME [--rpm N] [--tpm N]       an API key for the HTTP API, and its line for router.api_keys\n"
    "  scale --endpoint HOST:PORT (--apply OPS.yaml | --prefill N --decode M)\n"
    "                                        the ops config: worker counts or the planner's policy (deploy/ops.yaml)\n"
    "  kvstore-status --etcd HOST:PORT       the KV store's nodes: per tier bytes, blocks, hits, evictions; replicas\n"
    "  config [--reference]                  every config key, its default and what it sets (deploy/tandem.yaml)\n"
    "  --version                             the version and the commit it was built from\n"
    "\n"
    "commands:\n"
    "  inspect MODEL [--json]              describe a model: hyper-parameters, tensors, tokenizer\n"
    "  tokenize MODEL TEXT [--chat] [--json] [--no-special] [--bos]\n"
    "                                      print token ids of TEXT ('-' reads stdin)\n"
    "  tokenize MODEL --decode ID...       print the text of token ids\n"
    "  generate [--model PATH] [--chat] [--max-tokens N] [--temperature T] [--seed S] [--n K] [--ids] PROMPT\n"
    "                                      run the model on PROMPT here and stream the text\n"
    "                                      (tandem generate --help for every option)\n"
    "  perplexity FILE [--model PATH] [--ctx N] [--threads N]\n"
    "                                      the model's perplexity on a text file\n"
    "  grammar MODEL (--json-schema S | --regex RE | ...) [--tokens ID,...]\n"
    "                                      the tokens structured output allows, step by step\n"
    "  bench --endpoint HOST:PORT [--rate R | --sweep R1,R2] [--goodput ttft:MS,tpot:MS] ...\n"
    "                                      SLO goodput of a serving endpoint (tandem bench for all options)\n"
    "\n"
    "MODEL is a .gguf file or a Hugging Face folder (config.json, model.safetensors,\n"
    "tokenizer.json). Logging: TANDEM_LOG=debug|info|warn|error|off, TANDEM_LOG_FORMAT=json.\n";

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *usage;
} commands[] = {
    {"inspect", cli_inspect, cli_inspect_usage},          {"tokenize", cli_tokenize, cli_tokenize_usage},
    {"generate", cli_generate, cli_generate_usage},       {"perplexity", cli_perplexity, cli_perplexity_usage},
    {"bench", cli_bench, cli_bench_usage},                {"up", cli_up, cli_up_usage},
    {"health", cli_health, cli_health_usage},             {"certs", cli_certs, cli_certs_usage},
    {"apikey", cli_apikey, cli_apikey_usage},             {"kvstore-status", cli_kvstatus, cli_kvstatus_usage},
    {"scale", cli_scale, cli_scale_usage},                {"status", cli_status, cli_status_usage},
    {"config", cli_config, cli_config_usage},             {"grammar", cli_grammar, cli_grammar_usage},
};

int main(int argc, char **argv)
{
    td_log_init("tandem", TD_LOG_WARN, false);
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("tandem %s (commit %s)\n", TANDEM_VERSION, TANDEM_COMMIT);
        return 0;
    }
    for (size_t c = 0; c < sizeof commands / sizeof commands[0]; c++) {
        if (strcmp(argv[1], commands[c].name))
            continue;
        for (int i = 2; i < argc; i++)
            if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
                fputs(commands[c].usage, stdout);
                return 0;
            }
        return commands[c].run(argc - 2, argv + 2);
    }
    fprintf(stderr, "tandem: unknown command '%s'\n\n%s", argv[1], usage);
    return 2;
}
