/* safetensors.h — a reader of .safetensors files (one, or the shards a
 * model.safetensors.index.json names) over mmap.
 *
 * File layout: u64le header length N | N bytes of JSON
 *   {"__metadata__": {...}, "name": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}, ...}
 * | tensor bytes (offsets relative to the end of the header).
 * Opening validates the header JSON, every dtype, shape and offset range, that
 * the byte count matches shape x dtype, and that tensors do not overlap. Reads
 * F32, F16 and BF16. */
#ifndef ENG_SAFETENSORS_H
#define ENG_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define ENG_ST_MAX_DIMS 8

typedef struct eng_st_tensor {
    char *name;
    uint32_t type;     /* kern_type_t: F32, F16 or BF16 */
    uint32_t n_dims;
    uint64_t dims[ENG_ST_MAX_DIMS]; /* as safetensors lists them: row-major, last is contiguous */
    uint64_t n_elems, n_bytes;
    const void *data;
    uint32_t shard;    /* index of the file it lives in */
} eng_st_tensor_t;

typedef struct eng_safetensors eng_safetensors_t;

/* Opens one .safetensors file. */
td_status_t eng_st_open(const char *path, eng_safetensors_t **out);
/* Opens a model folder: model.safetensors, or model.safetensors.index.json and
 * its shards. */
td_status_t eng_st_open_dir(const char *dir, eng_safetensors_t **out);
/* Parses a file image in memory (for the fuzzer); data must outlive the reader. */
td_status_t eng_st_open_mem(const void *data, size_t size, const char *name, eng_safetensors_t **out);
void eng_st_close(eng_safetensors_t *st);

size_t eng_st_n_tensors(const eng_safetensors_t *st);
const eng_st_tensor_t *eng_st_tensor_at(const eng_safetensors_t *st, size_t i);
const eng_st_tensor_t *eng_st_find(const eng_safetensors_t *st, const char *name);
size_t eng_st_n_files(const eng_safetensors_t *st);
uint64_t eng_st_total_bytes(const eng_safetensors_t *st);

#endif
