/* gguf.c — see gguf.h. Parsing is a cursor over the mapped bytes: every read
 * checks the bytes that remain first, every count is bounded by what the
 * remaining bytes could hold before anything is allocated for it, so a lying
 * header costs an error, never a huge allocation or an out-of-bounds read. */
#define _DEFAULT_SOURCE
#include "engine/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/quant.h"

#define GGUF_MAX_ARRAY_DEPTH 8
#define GGUF_DEFAULT_ALIGNMENT 32

struct eng_gguf {
    char *path;
    const uint8_t *base;
    size_t size;
    bool mapped;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    size_t n_kv;
    eng_gguf_kv_t *kv;
    size_t n_tensors;
    eng_gguf_tensor_t *tensors;
};

typedef struct gguf_cursor {
    const uint8_t *base;
    size_t size;
    size_t off;
    const char *path;
} gguf_cursor_t;

static const char *const gguf_vtype_names[ENG_GGUF_VTYPE_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

static const uint8_t gguf_vtype_size[ENG_GGUF_VTYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char *eng_gguf_vtype_name(eng_gguf_vtype_t t)
{
    return (unsigned)t < ENG_GGUF_VTYPE_COUNT ? gguf_vtype_names[t] : "unknown";
}

static td_status_t gguf_need(gguf_cursor_t *c, size_t n, const char *what)
{
    if (n > c->size - c->off)
        return td_error(TD_ERR_FORMAT, "%s: truncated at offset %zu: %s needs %zu bytes, %zu remain",
                        c->path, c->off, what, n, c->size - c->off);
    return TD_OK;
}

static td_status_t gguf_u32(gguf_cursor_t *c, uint32_t *v, const char *what)
{
    td_status_t rc = gguf_need(c, 4, what);
    if (rc)
        return rc;
    memcpy(v, c->base + c->off, 4);
    c->off += 4;
    return TD_OK;
}

static td_status_t gguf_u64(gguf_cursor_t *c, uint64_t *v, const char *what)
{
    td_status_t rc = gguf_need(c, 8, what);
    if (rc)
        return rc;
    memcpy(v, c->base + c->off, 8);
    c->off += 8;
    return TD_OK;
}

static td_status_t gguf_string(gguf_cursor_t *c, eng_str_t *s, const char *what)
{
    size_t at = c->off;
    uint64_t len;
    td_status_t rc = gguf_u64(c, &len, what);
    if (rc)
        return rc;
    if (len > c->size - c->off)
        return td_error(TD_ERR_FORMAT, "%s: %s at offset %zu claims %llu bytes, only %zu remain",
                        c->path, what, at, (unsigned long long)len, c->size - c->off);
    s->ptr = (const char *)c->base + c->off;
    s->len = (size_t)len;
    c->off += (size_t)len;
    return TD_OK;
}

/* Skips or reads one array; nested arrays are walked (bounded depth) but not exposed. */
static td_status_t gguf_array(gguf_cursor_t *c, eng_gguf_kv_t *kv, int depth, const char *key)
{
    size_t at = c->off;
    uint32_t et;
    uint64_t n;
    td_status_t rc;
    if (depth > GGUF_MAX_ARRAY_DEPTH)
        return td_error(TD_ERR_FORMAT, "%s: key '%s': arrays nested deeper than %d at offset %zu",
                        c->path, key, GGUF_MAX_ARRAY_DEPTH, at);
    if ((rc = gguf_u32(c, &et, "array element type")) || (rc = gguf_u64(c, &n, "array length")))
        return rc;
    if (et >= ENG_GGUF_VTYPE_COUNT)
        return td_error(TD_ERR_FORMAT, "%s: key '%s': unknown array element type %u at offset %zu",
                        c->path, key, et, at);
    size_t remain = c->size - c->off;
    size_t min_elem = et == ENG_GGUF_STRING ? 8 : et == ENG_GGUF_ARRAY ? 12 : gguf_vtype_size[et];
    if (n > remain / min_elem)
        return td_error(TD_ERR_FORMAT,
                        "%s: key '%s': array at offset %zu claims %llu elements of %s, only %zu bytes remain",
                        c->path, key, at, (unsigned long long)n, gguf_vtype_names[et], remain);
    if (kv) {
        kv->arr_type = (eng_gguf_vtype_t)et;
        kv->arr_len = n;
        kv->arr_data = c->base + c->off;
    }
    if (et == ENG_GGUF_STRING) {
        uint64_t *offs = NULL;
        if (kv && n) {
            offs = malloc(n * sizeof *offs);
            if (!offs)
                return td_error(TD_ERR_NO_MEMORY, "%s: key '%s': no memory for %llu string offsets",
                                c->path, key, (unsigned long long)n);
            kv->str_off = offs;
        }
        for (uint64_t i = 0; i < n; i++) {
            eng_str_t s;
            if (offs)
                offs[i] = c->off;
            if ((rc = gguf_string(c, &s, "array string")))
                return rc;
        }
    } else if (et == ENG_GGUF_ARRAY) {
        for (uint64_t i = 0; i < n; i++)
            if ((rc = gguf_array(c, NULL, depth + 1, key)))
                return rc;
    } else {
        if (et == ENG_GGUF_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (c->base[c->off + i] > 1)
                    return td_error(TD_ERR_FORMAT, "%s: key '%s': bool element %llu is %u at offset %zu",
                                    c->path, key, (unsigned long long)i, c->base[c->off + i],
                                    c->off + (size_t)i);
        c->off += (size_t)n * min_elem;
    }
    return TD_OK;
}

static td_status_t gguf_value(gguf_cursor_t *c, eng_gguf_kv_t *kv, char *keybuf)
{
    size_t at = c->off;
    td_status_t rc;
    if (kv->type == ENG_GGUF_STRING)
        return gguf_string(c, &kv->v.s, "string value");
    if (kv->type == ENG_GGUF_ARRAY)
        return gguf_array(c, kv, 0, keybuf);
    size_t sz = gguf_vtype_size[kv->type];
    if ((rc = gguf_need(c, sz, "value")))
        return rc;
    const uint8_t *p = c->base + c->off;
    union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
            float f32; uint64_t u64; int64_t i64; double f64; } x;
    memcpy(&x, p, sz);
    switch (kv->type) {
    case ENG_GGUF_U8: kv->v.u = x.u8; break;
    case ENG_GGUF_I8: kv->v.i = x.i8; break;
    case ENG_GGUF_U16: kv->v.u = x.u16; break;
    case ENG_GGUF_I16: kv->v.i = x.i16; break;
    case ENG_GGUF_U32: kv->v.u = x.u32; break;
    case ENG_GGUF_I32: kv->v.i = x.i32; break;
    case ENG_GGUF_F32: kv->v.f = x.f32; break;
    case ENG_GGUF_U64: kv->v.u = x.u64; break;
    case ENG_GGUF_I64: kv->v.i = x.i64; break;
    case ENG_GGUF_F64: kv->v.f = x.f64; break;
    case ENG_GGUF_BOOL:
        if (x.u8 > 1)
            return td_error(TD_ERR_FORMAT, "%s: key '%s': bool value %u at offset %zu", c->path,
                            keybuf, x.u8, at);
        kv->v.b = x.u8;
        break;
    default: break;
    }
    c->off += sz;
    return TD_OK;
}

static bool str_eq(eng_str_t s, const char *z)
{
    size_t n = strlen(z);
    return s.len == n && memcmp(s.ptr, z, n) == 0;
}

/* A printable copy of a key for messages (keys are untrusted bytes). */
static void key_print(eng_str_t s, char *buf, size_t cap)
{
    size_t n = 0, i = 0;
    for (; i < s.len && n + 8 < cap; i++) {
        unsigned char ch = (unsigned char)s.ptr[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '\'')
            buf[n++] = (char)ch;
        else
            n += (size_t)snprintf(buf + n, cap - n, "\\x%02x", ch);
    }
    if (i < s.len) {
        memcpy(buf + n, "...", 3);
        n += 3;
    }
    buf[n] = '\0';
}

static int tensor_cmp_offset(const void *a, const void *b)
{
    const eng_gguf_tensor_t *const *x = a, *const *y = b;
    return (*x)->offset < (*y)->offset ? -1 : (*x)->offset > (*y)->offset;
}

static td_status_t gguf_tensor_info(gguf_cursor_t *c, eng_gguf_t *g, size_t idx)
{
    eng_gguf_tensor_t *t = &g->tensors[idx];
    size_t at = c->off;
    char name[160];
    td_status_t rc;
    if ((rc = gguf_string(c, &t->name, "tensor name")))
        return rc;
    key_print(t->name, name, sizeof name);
    if ((rc = gguf_u32(c, &t->n_dims, "tensor n_dims")))
        return rc;
    if (t->n_dims < 1 || t->n_dims > ENG_GGUF_MAX_DIMS)
        return td_error(TD_ERR_FORMAT, "%s: tensor '%s' at offset %zu has %u dimensions (1..%d allowed)",
                        c->path, name, at, t->n_dims, ENG_GGUF_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if ((rc = gguf_u64(c, &t->dims[d], "tensor dimension")))
            return rc;
        if (t->dims[d] == 0 || __builtin_mul_overflow(n, t->dims[d], &n) || n > (1ull << 48))
            return td_error(TD_ERR_FORMAT, "%s: tensor '%s' at offset %zu has an absurd shape (dim %u = %llu)",
                            c->path, name, at, d, (unsigned long long)t->dims[d]);
    }
    for (uint32_t d = t->n_dims; d < ENG_GGUF_MAX_DIMS; d++)
        t->dims[d] = 1;
    t->n_elems = n;
    if ((rc = gguf_u32(c, &t->type, "tensor type")) || (rc = gguf_u64(c, &t->offset, "tensor offset")))
        return rc;
    const kern_type_info_t *info = kern_type_info(t->type);
    if (!info) {
        const char *tn = kern_type_name_any(t->type);
        return td_error(TD_ERR_UNSUPPORTED,
                        "%s: tensor '%s' has type %s (%u), which tandem does not read "
                        "(supported: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K)",
                        c->path, name, tn ? tn : "unknown", t->type);
    }
    if (t->dims[0] % info->block_elems)
        return td_error(TD_ERR_FORMAT, "%s: tensor '%s': row of %llu values is not a multiple of %s's block of %u",
                        c->path, name, (unsigned long long)t->dims[0], info->name, info->block_elems);
    t->n_bytes = n / info->block_elems * info->block_bytes;
    for (size_t j = 0; j < idx; j++)
        if (g->tensors[j].name.len == t->name.len &&
            memcmp(g->tensors[j].name.ptr, t->name.ptr, t->name.len) == 0)
            return td_error(TD_ERR_FORMAT, "%s: tensor name '%s' appears twice", c->path, name);
    return TD_OK;
}

static td_status_t gguf_parse(eng_gguf_t *g)
{
    gguf_cursor_t c = {.base = g->base, .size = g->size, .off = 0, .path = g->path};
    td_status_t rc;
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    if ((rc = gguf_u32(&c, &magic, "magic")))
        return rc;
    if (memcmp(&magic, "GGUF", 4) != 0)
        return td_error(TD_ERR_FORMAT, "%s: not a GGUF file: magic is %02x %02x %02x %02x, expected 'GGUF'",
                        g->path, g->base[0], g->base[1], g->base[2], g->base[3]);
    if ((rc = gguf_u32(&c, &g->version, "version")))
        return rc;
    if (g->version != 2 && g->version != 3)
        return td_error(TD_ERR_UNSUPPORTED, "%s: GGUF version %u is not supported (2 and 3 are)",
                        g->path, g->version);
    if ((rc = gguf_u64(&c, &n_tensors, "tensor count")) || (rc = gguf_u64(&c, &n_kv, "metadata count")))
        return rc;
    /* smallest kv: key len(8) + type(4) + u8; smallest tensor info: 8+4+8+4+8 */
    size_t remain = c.size - c.off;
    if (n_kv > remain / 13)
        return td_error(TD_ERR_FORMAT, "%s: header claims %llu metadata entries; %zu bytes cannot hold them",
                        g->path, (unsigned long long)n_kv, remain);
    if (n_tensors > remain / 32)
        return td_error(TD_ERR_FORMAT, "%s: header claims %llu tensors; %zu bytes cannot hold them",
                        g->path, (unsigned long long)n_tensors, remain);
    g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory for the directory", g->path);

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < n_kv; i++) {
        eng_gguf_kv_t *kv = &g->kv[i];
        char key[160];
        size_t at = c.off;
        uint32_t type;
        if ((rc = gguf_string(&c, &kv->key, "metadata key")))
            return rc;
        g->n_kv = i + 1; /* so that close() frees what this entry allocates */
        key_print(kv->key, key, sizeof key);
        if ((rc = gguf_u32(&c, &type, "metadata type")))
            return rc;
        if (type >= ENG_GGUF_VTYPE_COUNT)
            return td_error(TD_ERR_FORMAT, "%s: key '%s' at offset %zu has unknown value type %u",
                            g->path, key, at, type);
        kv->type = (eng_gguf_vtype_t)type;
        if ((rc = gguf_value(&c, kv, key)))
            return rc;
        for (size_t j = 0; j < i; j++)
            if (g->kv[j].key.len == kv->key.len && memcmp(g->kv[j].key.ptr, kv->key.ptr, kv->key.len) == 0)
                return td_error(TD_ERR_FORMAT, "%s: key '%s' appears twice", g->path, key);
        if (str_eq(kv->key, "general.alignment")) {
            if (kv->type != ENG_GGUF_U32 || kv->v.u == 0 || (kv->v.u & (kv->v.u - 1)))
                return td_error(TD_ERR_FORMAT, "%s: general.alignment must be a u32 power of two", g->path);
            g->alignment = (uint32_t)kv->v.u;
        }
    }
    for (size_t i = 0; i < n_tensors; i++) {
        if ((rc = gguf_tensor_info(&c, g, i)))
            return rc;
        g->n_tensors = i + 1;
    }
    uint64_t data = (c.off + g->alignment - 1) / g->alignment * g->alignment;
    g->data_offset = data;
    if (n_tensors && data > g->size)
        return td_error(TD_ERR_FORMAT, "%s: truncated: tensor data would start at %llu, file has %zu bytes",
                        g->path, (unsigned long long)data, g->size);
    size_t data_size = g->size - (size_t)(data < g->size ? data : g->size);

    /* Bounds, alignment and overlap of the tensor data, checked in offset order. */
    eng_gguf_tensor_t **order = malloc((n_tensors ? n_tensors : 1) * sizeof *order);
    if (!order)
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", g->path);
    for (size_t i = 0; i < n_tensors; i++)
        order[i] = &g->tensors[i];
    qsort(order, n_tensors, sizeof *order, tensor_cmp_offset);
    uint64_t end_prev = 0;
    const eng_gguf_tensor_t *prev = NULL;
    rc = TD_OK;
    for (size_t i = 0; i < n_tensors && !rc; i++) {
        eng_gguf_tensor_t *t = order[i];
        char name[160], pname[160];
        key_print(t->name, name, sizeof name);
        if (t->offset % g->alignment) {
            rc = td_error(TD_ERR_FORMAT, "%s: tensor '%s' data offset %llu is not aligned to %u", g->path,
                          name, (unsigned long long)t->offset, g->alignment);
        } else if (t->offset > data_size || t->n_bytes > data_size - t->offset) {
            rc = td_error(TD_ERR_FORMAT,
                          "%s: tensor '%s' data [%llu, +%llu) runs past the end of the file "
                          "(data section is %zu bytes)",
                          g->path, name, (unsigned long long)t->offset, (unsigned long long)t->n_bytes,
                          data_size);
        } else if (prev && t->offset < end_prev) {
            key_print(prev->name, pname, sizeof pname);
            rc = td_error(TD_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap at data offset %llu", g->path,
                          pname, name, (unsigned long long)t->offset);
        } else {
            t->data = g->base + data + t->offset;
            end_prev = t->offset + t->n_bytes;
            prev = t;
        }
    }
    free(order);
    return rc;
}

static td_status_t gguf_open_common(eng_gguf_t *g, eng_gguf_t **out)
{
    td_status_t rc = gguf_parse(g);
    if (rc) {
        eng_gguf_close(g);
        return rc;
    }
    *out = g;
    return TD_OK;
}

td_status_t eng_gguf_open_mem(const void *data, size_t size, const char *name, eng_gguf_t **out)
{
    eng_gguf_t *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(name ? name : "(memory)"))) {
        free(g);
        return td_error(TD_ERR_NO_MEMORY, "gguf: no memory");
    }
    g->base = data;
    g->size = size;
    if (size < 4) {
        eng_gguf_close(g);
        return td_error(TD_ERR_FORMAT, "%s: not a GGUF file: %zu bytes is too short for a header", name, size);
    }
    return gguf_open_common(g, out);
}

td_status_t eng_gguf_open(const char *path, eng_gguf_t **out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return td_error(TD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return td_error(TD_ERR_IO, "%s: not a regular file", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return td_error(TD_ERR_FORMAT, "%s: not a GGUF file: %lld bytes is too short for a header", path,
                        (long long)st.st_size);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return td_error(TD_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
    eng_gguf_t *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(path))) {
        free(g);
        munmap(map, (size_t)st.st_size);
        return td_error(TD_ERR_NO_MEMORY, "%s: no memory", path);
    }
    g->base = map;
    g->size = (size_t)st.st_size;
    g->mapped = true;
    return gguf_open_common(g, out);
}

void eng_gguf_close(eng_gguf_t *g)
{
    if (!g)
        return;
    if (g->kv)
        for (size_t i = 0; i < g->n_kv; i++)
            free(g->kv[i].str_off);
    free(g->kv);
    free(g->tensors);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    free(g->path);
    free(g);
}

const char *eng_gguf_path(const eng_gguf_t *g) { return g->path; }
uint32_t eng_gguf_version(const eng_gguf_t *g) { return g->version; }
size_t eng_gguf_file_size(const eng_gguf_t *g) { return g->size; }
uint32_t eng_gguf_alignment(const eng_gguf_t *g) { return g->alignment; }
uint64_t eng_gguf_data_offset(const eng_gguf_t *g) { return g->data_offset; }
size_t eng_gguf_n_kv(const eng_gguf_t *g) { return g->n_kv; }
size_t eng_gguf_n_tensors(const eng_gguf_t *g) { return g->n_tensors; }

const eng_gguf_kv_t *eng_gguf_kv_at(const eng_gguf_t *g, size_t i)
{
    return i < g->n_kv ? &g->kv[i] : NULL;
}

const eng_gguf_tensor_t *eng_gguf_tensor_at(const eng_gguf_t *g, size_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const eng_gguf_kv_t *eng_gguf_find(const eng_gguf_t *g, const char *key)
{
    for (size_t i = 0; i < g->n_kv; i++)
        if (str_eq(g->kv[i].key, key))
            return &g->kv[i];
    return NULL;
}

const eng_gguf_tensor_t *eng_gguf_tensor_find(const eng_gguf_t *g, const char *name)
{
    for (size_t i = 0; i < g->n_tensors; i++)
        if (str_eq(g->tensors[i].name, name))
            return &g->tensors[i];
    return NULL;
}

static td_status_t wrong_type(const eng_gguf_t *g, const char *key, eng_gguf_vtype_t has, const char *want)
{
    return td_error(TD_ERR_FORMAT, "%s: key '%s' is %s, expected %s", g->path, key,
                    eng_gguf_vtype_name(has), want);
}

static bool is_unsigned(eng_gguf_vtype_t t)
{
    return t == ENG_GGUF_U8 || t == ENG_GGUF_U16 || t == ENG_GGUF_U32 || t == ENG_GGUF_U64;
}

static bool is_signed(eng_gguf_vtype_t t)
{
    return t == ENG_GGUF_I8 || t == ENG_GGUF_I16 || t == ENG_GGUF_I32 || t == ENG_GGUF_I64;
}

td_status_t eng_gguf_get_u64(const eng_gguf_t *g, const char *key, uint64_t *out)
{
    const eng_gguf_kv_t *kv = eng_gguf_find(g, key);
    if (!kv)
        return TD_ERR_NOT_FOUND;
    if (is_unsigned(kv->type)) {
        *out = kv->v.u;
    } else if (is_signed(kv->type)) {
        if (kv->v.i < 0)
            return td_error(TD_ERR_FORMAT, "%s: key '%s' is negative (%lld)", g->path, key, (long long)kv->v.i);
        *out = (uint64_t)kv->v.i;
    } else {
        return wrong_type(g, key, kv->type, "an integer");
    }
    return TD_OK;
}

td_status_t eng_gguf_get_u32(const eng_gguf_t *g, const char *key, uint32_t *out)
{
    uint64_t v;
    td_status_t rc = eng_gguf_get_u64(g, key, &v);
    if (rc)
        return rc;
    if (v > UINT32_MAX)
        return td_error(TD_ERR_FORMAT, "%s: key '%s' = %llu does not fit 32 bits", g->path, key,
                        (unsigned long long)v);
    *out = (uint32_t)v;
    return TD_OK;
}

td_status_t eng_gguf_get_f32(const eng_gguf_t *g, const char *key, float *out)
{
    const eng_gguf_kv_t *kv = eng_gguf_find(g, key);
    if (!kv)
        return TD_ERR_NOT_FOUND;
    if (kv->type == ENG_GGUF_F32 || kv->type == ENG_GGUF_F64)
        *out = (float)kv->v.f;
    else if (is_unsigned(kv->type))
        *out = (float)kv->v.u;
    else if (is_signed(kv->type))
        *out = (float)kv->v.i;
    else
        return wrong_type(g, key, kv->type, "a number");
    return TD_OK;
}

td_status_t eng_gguf_get_bool(const eng_gguf_t *g, const char *key, bool *out)
{
    const eng_gguf_kv_t *kv = eng_gguf_find(g, key);
    if (!kv)
        return TD_ERR_NOT_FOUND;
    if (kv->type != ENG_GGUF_BOOL)
        return wrong_type(g, key, kv->type, "bool");
    *out = kv->v.b;
    return TD_OK;
}

td_status_t eng_gguf_get_str(const eng_gguf_t *g, const char *key, eng_str_t *out)
{
    const eng_gguf_kv_t *kv = eng_gguf_find(g, key);
    if (!kv)
        return TD_ERR_NOT_FOUND;
    if (kv->type != ENG_GGUF_STRING)
        return wrong_type(g, key, kv->type, "string");
    *out = kv->v.s;
    return TD_OK;
}

td_status_t eng_gguf_get_arr(const eng_gguf_t *g, const char *key, eng_gguf_vtype_t elem,
                             const eng_gguf_kv_t **out)
{
    const eng_gguf_kv_t *kv = eng_gguf_find(g, key);
    if (!kv)
        return TD_ERR_NOT_FOUND;
    if (kv->type != ENG_GGUF_ARRAY)
        return wrong_type(g, key, kv->type, "array");
    if (kv->arr_type != elem) {
        char want[32];
        snprintf(want, sizeof want, "array of %s", eng_gguf_vtype_name(elem));
        return td_error(TD_ERR_FORMAT, "%s: key '%s' is an array of %s, expected %s", g->path, key,
                        eng_gguf_vtype_name(kv->arr_type), want);
    }
    *out = kv;
    return TD_OK;
}

eng_str_t eng_gguf_arr_str(const eng_gguf_t *g, const eng_gguf_kv_t *kv, uint64_t i)
{
    const uint8_t *p = g->base + kv->str_off[i];
    uint64_t len;
    memcpy(&len, p, 8);
    return (eng_str_t){(const char *)p + 8, (size_t)len};
}

double eng_gguf_arr_num(const eng_gguf_kv_t *kv, uint64_t i)
{
    const uint8_t *p = kv->arr_data + i * gguf_vtype_size[kv->arr_type];
    union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
            float f32; uint64_t u64; int64_t i64; double f64; } x;
    memcpy(&x, p, gguf_vtype_size[kv->arr_type]);
    switch (kv->arr_type) {
    case ENG_GGUF_U8: case ENG_GGUF_BOOL: return x.u8;
    case ENG_GGUF_I8: return x.i8;
    case ENG_GGUF_U16: return x.u16;
    case ENG_GGUF_I16: return x.i16;
    case ENG_GGUF_U32: return x.u32;
    case ENG_GGUF_I32: return x.i32;
    case ENG_GGUF_F32: return x.f32;
    case ENG_GGUF_U64: return (double)x.u64;
    case ENG_GGUF_I64: return (double)x.i64;
    case ENG_GGUF_F64: return x.f64;
    default: return 0;
    }
}

td_status_t eng_gguf_tensor_read_f32(const eng_gguf_tensor_t *t, uint64_t first, size_t n, float *dst)
{
    const kern_type_info_t *info = kern_type_info(t->type);
    if (first > t->n_elems || n > t->n_elems - first || first % info->block_elems)
        return td_error(TD_ERR_OUT_OF_RANGE, "tensor '%.*s': read of %zu values at %llu is out of range",
                        (int)t->name.len, t->name.ptr, n, (unsigned long long)first);
    const uint8_t *src = (const uint8_t *)t->data + first / info->block_elems * info->block_bytes;
    return kern_dequant_row(t->type, src, dst, n);
}
