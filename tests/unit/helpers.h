/* helpers.h — small things the unit tests share: paths of fixtures and of the
 * default model, reading files, hex, JSON id arrays. Header-only (each test is
 * one executable). */
#ifndef TEST_HELPERS_H
#define TEST_HELPERS_H

#include <criterion/criterion.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FIXTURE(rel) TANDEM_SOURCE_DIR "/tests/fixtures/" rel
#define DEFAULT_MODEL TANDEM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"

static inline void require_default_model(void)
{
    cr_assert(access(DEFAULT_MODEL, R_OK) == 0,
              "the default model is missing at %s: run deploy/install-deps.sh", DEFAULT_MODEL);
}

static inline char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static inline char *hex_decode(const char *hex, size_t *len)
{
    size_t n = strlen(hex) / 2;
    char *out = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        out[i] = (char)v;
    }
    out[n] = '\0';
    *len = n;
    return out;
}

/* ids[] of a JSON array; returns the count (caller frees *ids). */
static inline size_t json_ids(json_t *arr, int32_t **ids)
{
    size_t n = json_array_size(arr);
    *ids = malloc((n + 1) * sizeof **ids);
    for (size_t i = 0; i < n; i++)
        (*ids)[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    return n;
}

static inline char *write_temp(const char *content, size_t len, const char *suffix)
{
    char tmpl[] = "/tmp/tandem-test-XXXXXX";
    int fd = mkstemp(tmpl);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, content, len), (ssize_t)len);
    close(fd);
    char *path = malloc(strlen(tmpl) + strlen(suffix) + 1);
    sprintf(path, "%s%s", tmpl, suffix);
    rename(tmpl, path);
    return path;
}

#endif
