/* gguf.h — a reader of GGUF v2/v3 model files over mmap.
 *
 * The file is mapped read-only and never copied: keys, strings and tensor data
 * point into the mapping. Opening validates everything a later reader would
 * trust — magic, version, counts against the bytes that remain, string and array
 * lengths, alignment, each tensor's type, shape, offset and size, duplicate
 * names, overlap — so that after a successful open every accessor is bounds-safe.
 * Errors name the file, the byte offset and what was wrong (td_last_error()).
 *
 * File layout (little endian):
 *   "GGUF" u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 type | value }        string = u64 len + bytes
 *   n_tensors x { string name | u32 n_dims | u64 dims[n_dims] | u32 type | u64 offset }
 *   padding to `general.alignment` (default 32) | tensor data (offsets relative here)
 */
#ifndef ENG_GGUF_H
#define ENG_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define ENG_GGUF_MAX_DIMS 4

typedef enum eng_gguf_vtype {
    ENG_GGUF_U8 = 0, ENG_GGUF_I8 = 1, ENG_GGUF_U16 = 2, ENG_GGUF_I16 = 3,
    ENG_GGUF_U32 = 4, ENG_GGUF_I32 = 5, ENG_GGUF_F32 = 6, ENG_GGUF_BOOL = 7,
    ENG_GGUF_STRING = 8, ENG_GGUF_ARRAY = 9, ENG_GGUF_U64 = 10, ENG_GGUF_I64 = 11,
    ENG_GGUF_F64 = 12,
    ENG_GGUF_VTYPE_COUNT
} eng_gguf_vtype_t;

/* A length-counted string inside the mapping (not NUL-terminated). */
typedef struct eng_str {
    const char *ptr;
    size_t len;
} eng_str_t;

typedef struct eng_gguf_kv {
    eng_str_t key;
    eng_gguf_vtype_t type;
    /* scalars: the value, widened */
    union {
        uint64_t u;
        int64_t i;
        double f;
        bool b;
        eng_str_t s;
    } v;
    /* arrays: element type, count, first element; for string arrays
     * str_off[i] is the offset of element i's length field in the file */
    eng_gguf_vtype_t arr_type;
    uint64_t arr_len;
    const uint8_t *arr_data;
    uint64_t *str_off;
} eng_gguf_kv_t;

typedef struct eng_gguf_tensor {
    eng_str_t name;
    uint32_t n_dims;
    uint64_t dims[ENG_GGUF_MAX_DIMS]; /* dims[0] is the contiguous (row) one */
    uint32_t type;                     /* kern_type_t */
    uint64_t offset;                   /* from the start of the data section */
    uint64_t n_elems;
    uint64_t n_bytes;
    const void *data;
} eng_gguf_tensor_t;

typedef struct eng_gguf eng_gguf_t;

/* Maps and validates the file. On success *out owns the mapping; free with
 * eng_gguf_close(). */
td_status_t eng_gguf_open(const char *path, eng_gguf_t **out);
/* Same over a caller's buffer, which must outlive the reader (name is for
 * messages). */
td_status_t eng_gguf_open_mem(const void *data, size_t size, const char *name, eng_gguf_t **out);
void eng_gguf_close(eng_gguf_t *g);

const char *eng_gguf_path(const eng_gguf_t *g);
uint32_t eng_gguf_version(const eng_gguf_t *g);
size_t eng_gguf_file_size(const eng_gguf_t *g);
uint32_t eng_gguf_alignment(const eng_gguf_t *g);
uint64_t eng_gguf_data_offset(const eng_gguf_t *g);

size_t eng_gguf_n_kv(const eng_gguf_t *g);
const eng_gguf_kv_t *eng_gguf_kv_at(const eng_gguf_t *g, size_t i);
const eng_gguf_kv_t *eng_gguf_find(const eng_gguf_t *g, const char *key);

size_t eng_gguf_n_tensors(const eng_gguf_t *g);
const eng_gguf_tensor_t *eng_gguf_tensor_at(const eng_gguf_t *g, size_t i);
const eng_gguf_tensor_t *eng_gguf_tensor_find(const eng_gguf_t *g, const char *name);

/* Typed getters. A missing key is TD_ERR_NOT_FOUND (not logged: callers decide
 * whether it is optional); a key of the wrong type is TD_ERR_FORMAT (logged,
 * naming the key and both types). Integer getters accept any integer type whose
 * value fits. */
td_status_t eng_gguf_get_u64(const eng_gguf_t *g, const char *key, uint64_t *out);
td_status_t eng_gguf_get_u32(const eng_gguf_t *g, const char *key, uint32_t *out);
td_status_t eng_gguf_get_f32(const eng_gguf_t *g, const char *key, float *out);
td_status_t eng_gguf_get_bool(const eng_gguf_t *g, const char *key, bool *out);
td_status_t eng_gguf_get_str(const eng_gguf_t *g, const char *key, eng_str_t *out);
/* An array key of the given element type. */
td_status_t eng_gguf_get_arr(const eng_gguf_t *g, const char *key, eng_gguf_vtype_t elem,
                             const eng_gguf_kv_t **out);

/* Element i of an array (i < arr_len, type as checked by eng_gguf_get_arr). */
eng_str_t eng_gguf_arr_str(const eng_gguf_t *g, const eng_gguf_kv_t *kv, uint64_t i);
double eng_gguf_arr_num(const eng_gguf_kv_t *kv, uint64_t i);

const char *eng_gguf_vtype_name(eng_gguf_vtype_t t);

/* Decodes n values of a tensor starting at element `first` (both multiples of the
 * type's block) into dst as floats. */
td_status_t eng_gguf_tensor_read_f32(const eng_gguf_tensor_t *t, uint64_t first, size_t n, float *dst);

#endif
