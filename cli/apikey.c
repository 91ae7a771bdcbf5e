/* apikey.c — `tandem apikey`: a new API key for the router's HTTP API and
 * the line of router.api_keys' file that admits it (its SHA-256: the file
 * never holds the key itself). */
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "cli/cli.h"

const char cli_apikey_usage[] =
    "usage: tandem apikey NAME [--rpm N] [--tpm N]\n"
    "  prints a new API key (give it to the client: Authorization: Bearer KEY) and the line to add to the\n"
    "  file router.api_keys names: its SHA-256, NAME, requests and tokens per minute (0: no limit)\n";

int cli_apikey(int argc, char **argv)
{
    if (argc < 1 || argv[0][0] == '-' || strpbrk(argv[0], " \t#") || strlen(argv[0]) > 63) {
        fprintf(stderr, "tandem apikey: a NAME (no spaces, at most 63 bytes) is needed\n%s", cli_apikey_usage);
        return 2;
    }
    long rpm = 0, tpm = 0;
    for (int i = 1; i < argc; i += 2) {
        char *end = NULL;
        long v = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : -1;
        if (v < 0 || !end || *end || (strcmp(argv[i], "--rpm") && strcmp(argv[i], "--tpm"))) {
            fprintf(stderr, "tandem apikey: bad argument '%s'\n%s", argv[i], cli_apikey_usage);
            return 2;
        }
        *(argv[i][2] == 'r' ? &rpm : &tpm) = v;
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
    printf(" %s %ld %ld\n", argv[0], rpm, tpm);
    return 0;
}
