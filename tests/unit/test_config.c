/* test_config.c — the YAML configuration: defaults, a file over them, flags
 * over the file, and errors that name the key and its line. */
#include "tests/unit/helpers.h"

#include "common/config.h"
#include "common/log.h"

static char *yaml(const char *text) { return write_temp(text, strlen(text), ".yaml"); }

Test(config, defaults_file_and_flags)
{
    td_config_t c;
    cr_assert_eq(td_config_defaults(&c), TD_OK);
    cr_assert_eq(c.model.block_tokens, 16);
    cr_assert_str_eq(c.router.listen, "127.0.0.1:50051");
    char *p = yaml("# a cluster\nrouter:\n  listen: 0.0.0.0:9000\nprefill:\n  count: 3\nkvstore:\n  dram_mb: 4096\n"
                   "model:\n  block_tokens: 32\n");
    cr_assert_eq(td_config_load(&c, p), TD_OK, "%s", td_last_error());
    cr_assert_str_eq(c.router.listen, "0.0.0.0:9000");
    cr_assert_eq(c.prefill.count, 3);
    cr_assert_eq(c.decode.count, 1, "absent keys keep their defaults");
    cr_assert_eq(c.kvstore.dram_mb, 4096);
    cr_assert_eq(c.model.block_tokens, 32);
    cr_assert_eq(td_config_set(&c, "prefill.count", "5"), TD_OK);
    cr_assert_eq(c.prefill.count, 5, "a flag overrides the file");
    cr_assert_eq(td_config_validate(&c), TD_OK);
    unlink(p);
    free(p);
    td_config_free(&c);
}

static char *written(void (*write)(FILE *))
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    write(f);
    fclose(f);
    return buf;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    static char text[1 << 17];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    return text;
}

/* deploy/tandem.yaml and docs/configuration.md are what the table writes
 * (`tandem config [--reference]`), so neither drifts from it; the example
 * loads, validates and changes nothing, and names every key in its section */
Test(config, the_shipped_example_and_reference_are_the_table)
{
    char *ex = written(td_config_write_example), *ref = written(td_config_write_reference);
    cr_assert_str_eq(slurp(TANDEM_SOURCE_DIR "/deploy/tandem.yaml"), ex,
                     "deploy/tandem.yaml is not what the table writes: tandem config > deploy/tandem.yaml");
    cr_assert_str_eq(slurp(TANDEM_SOURCE_DIR "/docs/configuration.md"), ref,
                     "docs/configuration.md is not what the table writes: tandem config --reference > "
                     "docs/configuration.md");
    td_config_t d, c;
    cr_assert_eq(td_config_defaults(&d), TD_OK);
    cr_assert_eq(td_config_defaults(&c), TD_OK);
    cr_assert_eq(td_config_load(&c, TANDEM_SOURCE_DIR "/deploy/tandem.yaml"), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    cr_assert(td_config_key_count() > 50);
    for (size_t i = 0; i < td_config_key_count(); i++) {
        td_config_key_t k = td_config_key(i);
        char want[512], got[512], section[32], line[96], row[96];
        cr_assert_eq(td_config_get(&d, k.name, want, sizeof want), TD_OK);
        cr_assert_eq(td_config_get(&c, k.name, got, sizeof got), TD_OK);
        cr_assert_str_eq(got, want, "%s: the file says %s, the default is %s", k.name, got, want);
        const char *dot = strchr(k.name, '.');
        snprintf(section, sizeof section, "\n%.*s:", (int)(dot - k.name), k.name);
        snprintf(line, sizeof line, "\n  %s:", dot + 1);
        const char *sec = strstr(ex, section), *next = sec ? strstr(sec + 1, "\n") : NULL;
        while (next && next[1] && (next[1] == ' ' || next[1] == '#' || next[1] == '\n'))
            next = strstr(next + 1, "\n"); /* the section ends at the next line that starts a key */
        const char *at = sec ? strstr(sec, line) : NULL;
        cr_assert(at && (!next || at < next), "the example does not name %s in its section", k.name);
        char sname[32];
        snprintf(sname, sizeof sname, "%.*s", (int)(dot - k.name), k.name);
        cr_assert(td_config_section_doc(sname), "section %s says nothing of itself", sname);
        snprintf(row, sizeof row, "| `%s` |", k.name);
        cr_assert(strstr(ref, row), "the reference has no row for %s", k.name);
    }
    free(ex);
    free(ref);
    td_config_free(&c);
    td_config_free(&d);
}

Test(config, unknown_key_names_key_and_line)
{
    td_config_t c;
    td_config_defaults(&c);
    char *p = yaml("router:\n  listen: x\nprefill:\n  count: 1\n  thredas: 4\n");
    cr_assert_eq(td_config_load(&c, p), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "thredas"), "%s", td_last_error());
    cr_assert(strstr(td_last_error(), ":5:"), "line 5: %s", td_last_error());
    unlink(p);
    free(p);
    td_config_free(&c);
}

Test(config, wrong_type_names_key_and_line)
{
    td_config_t c;
    td_config_defaults(&c);
    char *p = yaml("log:\n  level: info\ndecode:\n  threads: many\n");
    cr_assert_eq(td_config_load(&c, p), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "threads"), "%s", td_last_error());
    cr_assert(strstr(td_last_error(), ":4:"), "line 4: %s", td_last_error());
    unlink(p);
    free(p);
    td_config_free(&c);
}

Test(config, unknown_section_and_bad_values)
{
    td_config_t c;
    td_config_defaults(&c);
    char *p = yaml("routr:\n  listen: x\n");
    cr_assert_eq(td_config_load(&c, p), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "routr") && strstr(td_last_error(), ":1:"), "%s", td_last_error());
    unlink(p);
    free(p);
    cr_assert_eq(td_config_set(&c, "prefill.count", "-1"), TD_ERR_CONFIG);
    cr_assert_eq(td_config_set(&c, "prefill.count", "99999999999"), TD_ERR_CONFIG);
    cr_assert_eq(td_config_set(&c, "no.such", "1"), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "no.such"));
    td_config_set(&c, "model.block_tokens", "24");
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "block_tokens = 24"));
    td_config_set(&c, "model.block_tokens", "16");
    td_config_set(&c, "model.numerics", "exact");
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "numerics = 'exact'"), "%s", td_last_error());
    td_config_set(&c, "model.numerics", "reference");
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    td_config_set(&c, "transport.kind", "nvlink");
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "transport.kind = 'nvlink'"), "%s", td_last_error());
    td_config_set(&c, "transport.kind", "ucx");
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    /* tensor parallelism: prefill workers of 2 ranks; decode workers of 2 on the CPU, sharing one GPU or a GPU a
     * rank (a transport region on each rank's GPU), not through the staged transport (a host landing copy) */
    cr_assert_eq(td_config_set(&c, "prefill.tp", "2"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_config_set(&c, "decode.tp", "2"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    td_config_set(&c, "transport.kind", "auto");
    td_config_set(&c, "decode.device", "cuda:0,cuda:0,cuda:1,cuda:1");
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    td_config_set(&c, "decode.device", "cuda:0,cuda:1");
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    td_config_set(&c, "decode.device", "cuda:1");
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "decode.tp = 2"), "%s", td_last_error());
    td_config_set(&c, "decode.device", "cuda:0,cuda:1");
    td_config_set(&c, "transport.kind", "ucx");
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "transport.kind = ucx"), "%s", td_last_error());
    td_config_set(&c, "transport.kind", "auto");
    td_config_set(&c, "decode.device", "cpu");
    td_config_set(&c, "decode.tp", "1");
    td_config_set(&c, "prefill.tp", "17");
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "prefill.tp"), "%s", td_last_error());
    td_config_set(&c, "prefill.tp", "1");
    cr_assert_eq(td_config_load(&c, "/nonexistent.yaml"), TD_ERR_IO);
    td_config_free(&c);
}

Test(config, malformed_yaml)
{
    td_config_t c;
    td_config_defaults(&c);
    char *p = yaml("router:\n  listen: [unclosed\n");
    cr_assert_eq(td_config_load(&c, p), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), p), "%s", td_last_error());
    unlink(p);
    free(p);
    td_config_free(&c);
}

static int own_seen(void *ctx, const char *flag, const char *value)
{
    snprintf(ctx, 64, "%s=%s", flag, value);
    return 0;
}

/* The one way a process reads its settings: the file, then each flag over
 * the key it names (the role's section for "%s" keys), one validation. */
Test(config, flags_set_keys_over_the_file)
{
    const char *yaml = "prefill:\n  threads: 3\n  kv_mib: 32\ntransport:\n  peer_idle_s: 9\n";
    char *path = write_temp(yaml, strlen(yaml), ".yaml");
    static const char *const own[] = {"--id", NULL};
    char seen[64] = "";
    td_config_t cfg;
    char *argv[] = {"p", "--config", path, "--threads", "5", "--id", "w7", NULL};
    cr_assert_eq(td_config_from_args(&cfg, "p", "prefill", TD_PROC_WORKER, own, own_seen, seen, "", 7, argv), 0);
    cr_assert_eq(cfg.prefill.threads, 5, "the flag overrides the file");
    cr_assert_eq(cfg.prefill.kv_mib, 32, "the file's key stays");
    cr_assert_eq(cfg.decode.threads, 0, "another role's section is untouched");
    cr_assert_eq(cfg.transport.peer_idle_s, 9);
    cr_assert_str_eq(seen, "--id=w7");
    td_config_free(&cfg);
    char *bad[] = {"p", "--kv-dtype", "int4", NULL};
    cr_assert_eq(td_config_from_args(&cfg, "p", "prefill", TD_PROC_WORKER, own, own_seen, seen, "", 3, bad), 2,
                 "a flag's value is validated as the file's would be");
    td_config_free(&cfg);
    char *unknown[] = {"p", "--nope", "1", NULL};
    cr_assert_eq(td_config_from_args(&cfg, "p", "prefill", TD_PROC_WORKER, own, own_seen, seen, "", 3, unknown), 2);
    td_config_free(&cfg);
    char *routers[] = {"p", "--max-streams", "9", NULL}; /* the table gives that flag to the router only */
    cr_assert_eq(td_config_from_args(&cfg, "p", "prefill", TD_PROC_WORKER, own, own_seen, seen, "", 3, routers), 2);
    td_config_free(&cfg);
    cr_assert_eq(td_config_from_args(&cfg, "r", "router", TD_PROC_ROUTER, NULL, NULL, NULL, "", 3, routers), 0);
    cr_assert_eq(cfg.router.max_streams, 9);
    td_config_free(&cfg);
    unlink(path);
    free(path);
}

/* A worker's device is cpu, cuda or cuda:N, in the file or by --device; any
 * other name is refused naming the key. */
Test(config, worker_device_names)
{
    int g = 99;
    cr_assert(td_device_parse("cpu", &g) && g == -1);
    cr_assert(td_device_parse("cuda", &g) && g == 0);
    cr_assert(td_device_parse("cuda:3", &g) && g == 3);
    cr_assert(!td_device_parse("cuda:", &g) && !td_device_parse("cuda:x", &g) && !td_device_parse("cuda:-1", &g));
    cr_assert(!td_device_parse("cuda:1024", &g) && !td_device_parse("gpu", &g) && !td_device_parse("cuda:1 ", &g));
    td_config_t c;
    cr_assert_eq(td_config_defaults(&c), TD_OK);
    cr_assert_str_eq(c.prefill.device, "cpu");
    cr_assert_str_eq(c.decode.device, "cpu");
    cr_assert_eq(td_config_set(&c, "decode.device", "cuda:1"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK);
    cr_assert_eq(td_config_set(&c, "prefill.device", "tpu"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "prefill.device = 'tpu'"), "%s", td_last_error());
    /* a list: tandem up's k-th worker of the role takes the (k mod count)-th */
    char one[32];
    cr_assert_eq(td_device_pick("cuda:0,cuda:1", 0, one, sizeof one), 2);
    cr_assert_str_eq(one, "cuda:0");
    cr_assert_eq(td_device_pick("cuda:0,cuda:1", 3, one, sizeof one), 2);
    cr_assert_str_eq(one, "cuda:1");
    cr_assert_eq(td_device_pick("cpu", 5, one, sizeof one), 1);
    cr_assert_str_eq(one, "cpu");
    cr_assert_eq(td_device_pick("cuda:0,gpu", 0, one, sizeof one), 0, "every entry is checked");
    cr_assert_eq(td_device_pick("cuda:0,", 0, one, sizeof one), 0);
    cr_assert_eq(td_config_set(&c, "prefill.device", "cuda:0,cuda:1"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_config_set(&c, "prefill.device", "cuda:0,tpu"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "comma-separated"), "%s", td_last_error());
    /* workers of tensor-parallel ranks: the k-th takes the next tp entries of the list, a GPU a rank */
    char group[64];
    cr_assert_eq(td_device_group("cuda:0,cuda:1,cuda:2,cuda:3", 1, 2, group, sizeof group), 4);
    cr_assert_str_eq(group, "cuda:2,cuda:3");
    cr_assert_eq(td_device_group("cuda:0,cuda:1,cuda:2", 1, 2, group, sizeof group), 3);
    cr_assert_str_eq(group, "cuda:2,cuda:0", "round the list");
    cr_assert_eq(td_device_group("cuda:0,cuda:1", 0, 2, group, 8), 0, "too long for out");
    cr_assert_eq(td_config_set(&c, "prefill.device", "cuda:0,cuda:1,cuda:2,cuda:3"), TD_OK);
    cr_assert_eq(td_config_set(&c, "prefill.tp", "2"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_config_set(&c, "prefill.device", "cuda:0"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG, "one GPU for two ranks");
    cr_assert(strstr(td_last_error(), "prefill.tp = 2 needs a GPU a rank"), "%s", td_last_error());
    cr_assert_eq(td_config_set(&c, "prefill.device", "cpu"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK, "ranks on the CPU: %s", td_last_error());
    td_config_free(&c);
}

/* decode.colocated: a decode worker that serves whole requests (by
 * default: conditional disaggregation); a prefill worker cannot be one */
Test(config, only_decode_workers_are_colocated)
{
    td_config_t c;
    cr_assert_eq(td_config_defaults(&c), TD_OK);
    cr_assert(c.decode.colocated);
    cr_assert_not(c.prefill.colocated);
    cr_assert_eq(td_config_set(&c, "decode.colocated", "false"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_OK, "%s", td_last_error());
    cr_assert_not(c.decode.colocated);
    cr_assert_eq(td_config_set(&c, "prefill.colocated", "true"), TD_OK);
    cr_assert_eq(td_config_validate(&c), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "prefill.colocated"), "%s", td_last_error());
    td_config_free(&c);
}
