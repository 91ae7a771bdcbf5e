/* safetensors.c — see safetensors.h. The header is JSON (jansson); tensor
 * bytes stay in the mapping. */
#define _DEFAULT_SOURCE
#include "engine/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/quant.h"

#define ST_MAX_HEADER (100u << 20) /* the format's own limit */
#define ST_MAX_SHARDS 4096

typedef struct st_file {
    char *path;
    const uint8_t *base;
    size_t size;
    bool mapped;
} st_file_t;

struct eng_safetensors {
    st_file_t *files;
    size_t n_files;
    eng_st_tensor_t *tensors;
    size_t n_tensors, cap_tensors;
};

void eng_st_close(eng_safetensors_t *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->n_tensors; i++)
        free(st->tensors[i].name);
    for (size_t i = 0; i < st->n_files; i++) {
        if (st->files[i].mapped)
            munmap((void *)st->files[i].base, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->tensors);
    free(st);
}

static int st_cmp_begin(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

static td_status_t st_dtype(const char *s, uint32_t *type)
{
    if (!strcmp(s, "F32")) *type = KERN_TYPE_F32;
    else if (!strcmp(s, "F16")) *type = KERN_TYPE_F16;
    else if (!strcmp(s, "BF16")) *type = KERN_TYPE_BF16;
    else if (!strcmp(s, "F8_E4M3")) *type = KERN_TYPE_F8_E4M3;
    else return TD_ERR_UNSUPPORTED;
    return TD_OK;
}

/* Parses the header of file index fi and appends its tensors. */
static td_status_t st_parse(eng_safetensors_t *st, uint32_t fi)
{
    const st_file_t *f = &st->files[fi];
    const char *path = f->path;
    if (f->size < 8)
        return td_error(TD_ERR_FORMAT, "%s: %zu bytes is too short for a safetensors header", path, f->size);
    uint64_t hlen;
    memcpy(&hlen, f->base, 8);
    if (hlen < 2 || hlen > ST_MAX_HEADER || hlen > f->size - 8)
        return td_error(TD_ERR_FORMAT, "%s: header length %llu is impossible (file has %zu bytes, limit %u)", path,
                        (unsigned long long)hlen, f->size, ST_MAX_HEADER);
    json_error_t jerr;
    json_t *root = json_loadb((const char *)f->base + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return td_error(TD_ERR_FORMAT, "%s: header is not valid JSON at byte %d: %s", path, jerr.position + 8,
                        jerr.text);
    td_status_t rc = TD_OK;
    uint64_t *ranges = NULL;
    size_t data_size = f->size - 8 - (size_t)hlen;
    const uint8_t *data = f->base + 8 + hlen;
    if (!json_is_object(root)) {
        rc = td_error(TD_ERR_FORMAT, "%s: header is JSON but not an object", path);
        goto done;
    }
    size_t n = json_object_size(root);
    ranges = malloc((n ? n : 1) * 2 * sizeof *ranges);
    if (!ranges || st->n_tensors + n > st->cap_tensors) {
        size_t nc = st->n_tensors + n + 16;
        eng_st_tensor_t *nt = ranges ? realloc(st->tensors, nc * sizeof *nt) : NULL;
        if (!nt) {
            rc = td_error(TD_ERR_NO_MEMORY, "%s: no memory for %zu tensors", path, n);
            goto done;
        }
        st->tensors = nt;
        st->cap_tensors = nc;
    }
    size_t nr = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) {
            if (!json_is_object(val)) {
                rc = td_error(TD_ERR_FORMAT, "%s: __metadata__ is not an object", path);
                goto done;
            }
            continue;
        }
        json_t *dt = json_object_get(val, "dtype"), *shape = json_object_get(val, "shape"),
               *offs = json_object_get(val, "data_offsets");
        if (!json_is_object(val) || !json_is_string(dt) || !json_is_array(shape) || !json_is_array(offs) ||
            json_array_size(offs) != 2) {
            rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' needs dtype (string), shape (array) and data_offsets "
                          "([begin, end])", path, key);
            goto done;
        }
        eng_st_tensor_t t = {.shard = fi};
        if (st_dtype(json_string_value(dt), &t.type)) {
            rc = td_error(TD_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s (F32, F16, BF16 and F8_E4M3 are read)", path, key,
                          json_string_value(dt));
            goto done;
        }
        t.n_dims = (uint32_t)json_array_size(shape);
        if (t.n_dims > ENG_ST_MAX_DIMS) {
            rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' has %u dimensions (at most %d)", path, key, t.n_dims,
                          ENG_ST_MAX_DIMS);
            goto done;
        }
        uint64_t ne = 1;
        for (uint32_t d = 0; d < t.n_dims; d++) {
            json_t *x = json_array_get(shape, d);
            json_int_t v = json_is_integer(x) ? json_integer_value(x) : -1;
            if (v < 0 || __builtin_mul_overflow(ne, (uint64_t)v, &ne) || ne > (1ull << 48)) {
                rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' shape[%u] is not a sane size", path, key, d);
                goto done;
            }
            t.dims[d] = (uint64_t)v;
        }
        t.n_elems = ne;
        t.n_bytes = ne * kern_type_info(t.type)->block_bytes;
        json_t *b = json_array_get(offs, 0), *e = json_array_get(offs, 1);
        if (!json_is_integer(b) || !json_is_integer(e) || json_integer_value(b) < 0 ||
            json_integer_value(e) < json_integer_value(b) || (uint64_t)json_integer_value(e) > data_size) {
            rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' data_offsets are not a range inside the %zu data bytes",
                          path, key, data_size);
            goto done;
        }
        uint64_t begin = (uint64_t)json_integer_value(b), end = (uint64_t)json_integer_value(e);
        if (end - begin != t.n_bytes) {
            rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' has %llu bytes but its shape and dtype need %llu", path,
                          key, (unsigned long long)(end - begin), (unsigned long long)t.n_bytes);
            goto done;
        }
        if (eng_st_find(st, key)) {
            rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' appears in two shards", path, key);
            goto done;
        }
        t.data = data + begin;
        t.name = strdup(key);
        if (!t.name) {
            rc = td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
            goto done;
        }
        st->tensors[st->n_tensors++] = t;
        ranges[2 * nr] = begin;
        ranges[2 * nr + 1] = end;
        nr++;
    }
    qsort(ranges, nr, 2 * sizeof *ranges, st_cmp_begin);
    for (size_t i = 1; i < nr; i++)
        if (ranges[2 * i] < ranges[2 * i - 1]) {
            rc = td_error(TD_ERR_FORMAT, "%s: two tensors overlap at data offset %llu", path,
                          (unsigned long long)ranges[2 * i]);
            break;
        }
done:
    free(ranges);
    json_decref(root);
    return rc;
}

static td_status_t st_add_file(eng_safetensors_t *st, const char *path, const void *mem, size_t mem_size)
{
    st_file_t *nf = realloc(st->files, (st->n_files + 1) * sizeof *nf);
    if (!nf)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    st->files = nf;
    st_file_t *f = &st->files[st->n_files];
    memset(f, 0, sizeof *f);
    if (!(f->path = strdup(path)))
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    st->n_files++;
    if (mem) {
        f->base = mem;
        f->size = mem_size;
    } else {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return td_error(TD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        struct stat sb;
        if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < 8) {
            close(fd);
            return td_error(TD_ERR_FORMAT, "%s: not a safetensors file (too short or not a regular file)", path);
        }
        void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        close(fd);
        if (map == MAP_FAILED)
            return td_error(TD_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
        f->base = map;
        f->size = (size_t)sb.st_size;
        f->mapped = true;
    }
    return st_parse(st, (uint32_t)(st->n_files - 1));
}

static td_status_t st_new(eng_safetensors_t **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? TD_OK : td_error(TD_ERR_NO_MEMORY, "safetensors: no memory");
}

td_status_t eng_st_open_mem(const void *data, size_t size, const char *name, eng_safetensors_t **out)
{
    eng_safetensors_t *st;
    td_status_t rc = st_new(&st);
    if (!rc)
        rc = st_add_file(st, name ? name : "(memory)", data ? data : "", size);
    if (rc) {
        eng_st_close(st);
        return rc;
    }
    *out = st;
    return TD_OK;
}

td_status_t eng_st_open(const char *path, eng_safetensors_t **out)
{
    eng_safetensors_t *st;
    td_status_t rc = st_new(&st);
    if (!rc)
        rc = st_add_file(st, path, NULL, 0);
    if (rc) {
        eng_st_close(st);
        return rc;
    }
    *out = st;
    return TD_OK;
}

td_status_t eng_st_open_dir(const char *dir, eng_safetensors_t **out)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (access(path, R_OK) == 0)
        return eng_st_open(path, out);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_error_t jerr;
    json_t *idx = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!idx) {
        if (access(path, R_OK) != 0)
            return td_error(TD_ERR_NOT_FOUND, "%s: neither model.safetensors nor model.safetensors.index.json is there",
                            dir);
        return td_error(TD_ERR_FORMAT, "%s:%d: not valid JSON: %s", path, jerr.line, jerr.text);
    }
    eng_safetensors_t *st;
    td_status_t rc = st_new(&st);
    json_t *map = json_object_get(idx, "weight_map");
    if (!rc && !json_is_object(map))
        rc = td_error(TD_ERR_FORMAT, "%s: key 'weight_map' is missing or not an object", path);
    /* open each shard the map names, once */
    const char *key;
    json_t *val;
    if (!rc)
        json_object_foreach(map, key, val) {
            if (!json_is_string(val)) {
                rc = td_error(TD_ERR_FORMAT, "%s: weight_map['%s'] is not a file name", path, key);
                break;
            }
            const char *shard = json_string_value(val);
            if (strchr(shard, '/') || !strcmp(shard, "..")) {
                rc = td_error(TD_ERR_FORMAT, "%s: weight_map['%s'] = '%s' is not a plain file name", path, key, shard);
                break;
            }
            char sp[PATH_MAX];
            snprintf(sp, sizeof sp, "%s/%s", dir, shard);
            bool seen = false;
            for (size_t i = 0; i < st->n_files && !seen; i++)
                seen = !strcmp(st->files[i].path, sp);
            if (seen)
                continue;
            if (st->n_files == ST_MAX_SHARDS) {
                rc = td_error(TD_ERR_FORMAT, "%s: more than %d shards", path, ST_MAX_SHARDS);
                break;
            }
            if ((rc = st_add_file(st, sp, NULL, 0)))
                break;
        }
    if (!rc)
        json_object_foreach(map, key, val) {
            const eng_st_tensor_t *t = eng_st_find(st, key);
            if (!t) {
                rc = td_error(TD_ERR_FORMAT, "%s: weight_map names tensor '%s', which its shard does not hold", path, key);
                break;
            }
        }
    json_decref(idx);
    if (rc) {
        eng_st_close(st);
        return rc;
    }
    *out = st;
    return TD_OK;
}

size_t eng_st_n_tensors(const eng_safetensors_t *st) { return st->n_tensors; }
size_t eng_st_n_files(const eng_safetensors_t *st) { return st->n_files; }

const eng_st_tensor_t *eng_st_tensor_at(const eng_safetensors_t *st, size_t i)
{
    return i < st->n_tensors ? &st->tensors[i] : NULL;
}

const eng_st_tensor_t *eng_st_find(const eng_safetensors_t *st, const char *name)
{
    for (size_t i = 0; i < st->n_tensors; i++)
        if (!strcmp(st->tensors[i].name, name))
            return &st->tensors[i];
    return NULL;
}

uint64_t eng_st_total_bytes(const eng_safetensors_t *st)
{
    uint64_t s = 0;
    for (size_t i = 0; i < st->n_tensors; i++)
        s += st->tensors[i].n_bytes;
    return s;
}
