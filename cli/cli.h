/* cli.h — the subcommands of the `tandem` command line. Each takes the
 * arguments after its name and returns the process exit code (0 ok, 1 error,
 * 2 usage). */
#ifndef CLI_H
#define CLI_H

int cli_inspect(int argc, char **argv);
int cli_tokenize(int argc, char **argv);
int cli_generate(int argc, char **argv);
int cli_perplexity(int argc, char **argv);
int cli_grammar(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_up(int argc, char **argv);
int cli_health(int argc, char **argv);
int cli_status(int argc, char **argv);
int cli_certs(int argc, char **argv);
int cli_apikey(int argc, char **argv);
int cli_kvstatus(int argc, char **argv);
int cli_scale(int argc, char **argv);
int cli_config(int argc, char **argv);
/* Each subcommand's usage text (what `tandem CMD --help` prints). */
extern const char cli_inspect_usage[], cli_tokenize_usage[], cli_generate_usage[], cli_perplexity_usage[], cli_grammar_usage[],
    cli_bench_usage[], cli_up_usage[], cli_health_usage[], cli_status_usage[], cli_certs_usage[],
    cli_apikey_usage[], cli_kvstatus_usage[], cli_scale_usage[], cli_config_usage[];

#include <stdbool.h>
#include "common/rpc.h"
#include "tandem/v1/tandem.pb-c.h"
/* A streaming Generate against a router (client.c); tls NULL: plaintext. */
int cli_generate_remote(const char *endpoint, const td_rpc_tls_t *tls, const char *prompt, bool chat, bool ids,
                        Tandem__V1__SamplingParams *sp, double timeout_s);
/* --tls-ca / --tls-cert / --tls-key at argv[*i] (client side): consumes the
 * flag and its value into tls and returns true; false when argv[*i] is not one. */
bool cli_tls_flag(int argc, char **argv, int *i, td_rpc_tls_t *tls);

#endif
