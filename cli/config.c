/* config.c — `tandem config`: the config file's keys written out from their
 * table (common/config.h): the example (deploy/tandem.yaml) or the reference
 * (docs/configuration.md). */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "common/config.h"

const char cli_config_usage[] =
    "usage: tandem config [--reference]\n"
    "  prints a config file with every key at its default and what it sets (deploy/tandem.yaml is this);\n"
    "  --reference: the same as Markdown tables (docs/configuration.md)\n";

int cli_config(int argc, char **argv)
{
    if (argc > 1 || (argc == 1 && strcmp(argv[0], "--reference"))) {
        fprintf(stderr, "tandem config: unknown argument '%s'\n%s", argv[argc - 1], cli_config_usage);
        return 2;
    }
    if (argc)
        td_config_write_reference(stdout);
    else
        td_config_write_example(stdout);
    return fflush(stdout) ? 1 : 0;
}
