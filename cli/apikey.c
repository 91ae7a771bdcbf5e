/* apikey.c — `tandem apikey`: a new API key for the router's HTTP API and
 * the line of router.api_keys' file that admits it (its SHA-256: the file
 * never holds the key itself). */
#include <openssl/sha.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "cli/cli.h"

const char cli_apikey_usage[] =
    "usage: tandem apikey NAME [--rpm N] [--tpm N] [--weight W] [--priority P]\n"
    "  prints a new API key (give it to the client: Authorization: Bearer KEY) and the line to add to the\n"
    "  file router.api_keys names: its SHA-256, NAME, requests and tokens per minute (0: no limit), and its\n"
    "  weight (1) and priority class (0) when the cluster is contended (router.admit_max): tenants are served\n"
    "  tokens in proportion to their weights, a higher class first\n";

int cli_apikey(int argc, char **argv)
{
    if (argc < 1 || argv[0][0] == '-' || strpbrk(argv[0], " \t#") || strlen(argv[0]) > 63) {
        fprintf(stderr, "tandem apikey: a NAME (no spaces, at most 63 bytes) is needed\n%s", cli_apikey_usage);
        return 2;
    }
    long rpm = 0, tpm = 0, prio = 0;
    double weight = 1;
    for (int i = 1; i < argc; i += 2) {
        char *end = NULL;
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = v != NULL;
        if (ok && !strcmp(f, "--weight")) {
            weight = strtod(v, &end);
            ok = *end == '\0' && weight > 0 && weight <= 1e6;
        } else if (ok && !strcmp(f, "--priority")) {
            prio = strtol(v, &end, 10);
            ok = *end == '\0' && prio >= -1000000 && prio <= 1000000;
        } else if (ok && (!strcmp(f, "--rpm") || !strcmp(f, "--tpm"))) {
            long n = strtol(v, &end, 10);
            ok = *end == '\0' && n >= 0;
            *(f[2] == 'r' ? &rpm : &tpm) = n;
        } else {
            ok = false;
        }
        if (!ok || !v[0]) {
            fprintf(stderr, "tandem apikey: bad argument '%s'%s%s\n%s", f, v ? " " : "", v ? v : "", cli_apikey_usage);
            return 2;
        }
    }
    unsigned char raw[24], hash[32];
    if (getrandom(raw, sizeof raw, 0) != sizeof raw) {
        fprintf(stderr, "tandem apikey: getrandom failed\n");
        return 1;
    }
    char key[4 + 2 * sizeof raw + 1] = "tdk-";
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(key + 4 + 2 * i, 3, "%02x", raw[i]);
    SHA256((const unsigned char *)key, strlen(key), hash);
    printf("key:  %s\nline: ", key);
    for (int i = 0; i < 32; i++)
        printf("%02x", hash[i]);
    printf(" %s %ld %ld", argv[0], rpm, tpm);
    if (weight != 1 || prio)
        printf(" %g %ld", weight, prio);
    printf("\n");
    return 0;
}
