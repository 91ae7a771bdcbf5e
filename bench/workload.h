/* workload.h — what `tandem bench` sends and when.
 *
 * A workload is a list of requests, each with a send time (seconds from the
 * start; the sender keeps this schedule however slow the server is: open
 * loop), a prompt and the number of tokens to generate. Prompts are built from
 * words that are one token each in the given tokenizer, so a prompt of n words
 * is n tokens, and equal word sequences are equal token prefixes:
 *   synthetic  Poisson (cv 1) or gamma (other cv) arrivals at a rate; input and
 *              output lengths fixed, uniform, log-uniform or lognormal; optional shared-prefix
 *              groups (a share of each prompt is its group's common prefix);
 *   trace      Mooncake JSONL {timestamp (ms), input_length, output_length,
 *              hash_ids}: one id per block of the trace's block size (512
 *              tokens in Mooncake's public traces), equal ids the same block
 *              text, so prompts share exactly the prefixes the ids say;
 *   prompts    JSONL {"prompt": "..."} or {"messages": [...]} (+ optional
 *              "max_tokens"), sent at the rate. */
#ifndef BENCH_WORKLOAD_H
#define BENCH_WORKLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct eng_tokenizer eng_tokenizer_t;

typedef enum bench_dist { BENCH_DIST_FIXED, BENCH_DIST_UNIFORM, BENCH_DIST_LOGUNIFORM, BENCH_DIST_LOGNORMAL } bench_dist_t;

/* A length distribution: fixed a; uniform [a, b]; log-uniform [a, b] (each
 * doubling of length as likely); lognormal with mean a, sigma b. */
typedef struct bench_len {
    bench_dist_t dist;
    double a, b;
} bench_len_t;

typedef struct bench_synthetic {
    double rate;          /* requests per second */
    double cv;            /* coefficient of variation of the gaps: 1 = Poisson */
    size_t n;
    bench_len_t input, output;
    uint32_t groups;      /* shared-prefix groups (0: none) */
    double prefix_share;  /* share of each prompt that is its group's prefix */
    uint64_t seed;
} bench_synthetic_t;

typedef struct bench_request {
    double t_send;
    char *prompt;         /* text, or a JSON array of chat messages when chat */
    bool chat;
    uint32_t input_len, output_len;
    int32_t group;        /* shared-prefix group or -1 */
} bench_request_t;

typedef struct bench_workload {
    bench_request_t *req;
    size_t n;
    char **words;         /* the one-token words prompts are made of */
    size_t n_words;
    /* 0: none; else every prompt's words go through a bijection of the word list drawn from it (prompts
     * files: a salt line leads each prompt), so two salts give prompts that share no block while each
     * workload's own sharing (its groups, a trace's hash ids) stays exact: a sweep's rates do not serve
     * each other's prompts from a cache */
    uint64_t salt;
} bench_workload_t;

/* Chooses up to 4,096 one-token words of the tokenizer (a leading space and
 * lower-case ASCII letters); fewer than 256 is an error. */
td_status_t bench_words(const eng_tokenizer_t *tok, bench_workload_t *w);
td_status_t bench_synthetic(bench_workload_t *w, const bench_synthetic_t *s);
typedef struct bench_trace_opts {
    double time_scale;     /* multiplies the timestamps (0.5: twice as fast) */
    uint32_t block_tokens; /* tokens per hash id in the file (0: 512, Mooncake's) */
    uint32_t divide;       /* lengths and block size divided by this (0, 1: as is); it must divide the block
                              size, so a scaled trace keeps exactly the sharing the ids say */
} bench_trace_opts_t;

/* max_n caps the requests read (0: all). A malformed line is an error naming
 * the line and the field. */
td_status_t bench_trace(bench_workload_t *w, const char *path, const bench_trace_opts_t *o, size_t max_n);
td_status_t bench_prompts(bench_workload_t *w, const char *path, double rate, uint32_t max_tokens, size_t max_n);
void bench_workload_free(bench_workload_t *w);

/* The text of trace block `id` (`words` one-token words, deterministic in id). */
void bench_block_text(const bench_workload_t *w, uint64_t id, uint32_t words, char **out, size_t *len, size_t *cap);

#endif
