/* ssd.h — a kvstore node's SSD tier: block files in the data dir, read and
 * written with O_DIRECT through io_uring (DESIGN.md §4).
 *
 * One file, `blocks`, preallocated to the tier's size and cut into slots;
 * a slot is a 4 KiB header (magic, the block's name, its digest, its size,
 * the KV contract, a checksum of the header) and the block's bytes. Every
 * read checks the header names the block asked for and the bytes' digest:
 * a bad block is an error naming it, which the node turns into a miss (and
 * drops the block), never wrong KV. `manifest` lists the blocks at a clean
 * stop (with a checksum over it); it is removed when the node opens the
 * tier, so after a crash, or when it is torn or corrupt, the node rebuilds
 * the list by reading every slot's header (and says why). A disk without
 * room for the whole size gets as many slots as fit, said in the log. */
#ifndef KV_SSD_H
#define KV_SSD_H

#include <stdbool.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/kv_contract.h"
#include "common/status.h"
#include "kvstore/index.h"

typedef struct kv_ssd kv_ssd_t;

/* Opens (or creates) the tier in dir, of at most capacity bytes. *have: the
 * files hold blocks, of contract *l (then kv_ssd_set_block_bytes(l) and
 * kv_ssd_restore bring them back). */
td_status_t kv_ssd_open(const char *dir, uint64_t capacity, kv_ssd_t **out, td_kv_layout_t *l, bool *have);
/* Cuts the file into slots for l's blocks (*slots of them); blocks of
 * another contract found in the files are forgotten. */
td_status_t kv_ssd_set_block_bytes(kv_ssd_t *s, const td_kv_layout_t *l, uint32_t *slots);
/* fn(ctx, slot, name, digest) for each block the files hold; the count. */
uint32_t kv_ssd_restore(kv_ssd_t *s, void (*fn)(void *ctx, uint32_t slot, td_block_name_t name, uint64_t digest),
                        void *ctx);
/* A free slot, or false. */
bool kv_ssd_take(kv_ssd_t *s, uint32_t *slot);
void kv_ssd_free(kv_ssd_t *s, uint32_t slot);
td_status_t kv_ssd_write(kv_ssd_t *s, uint32_t slot, td_block_name_t name, uint64_t digest, const void *src);
/* TD_ERR_FORMAT naming the block and what was wrong when the slot does not
 * hold name with that digest. */
td_status_t kv_ssd_read(kv_ssd_t *s, uint32_t slot, td_block_name_t name, uint64_t digest, void *dst);
/* The manifest of every SSD-tier block in ix. */
td_status_t kv_ssd_save_manifest(kv_ssd_t *s, kv_index_t *ix);
uint64_t kv_ssd_capacity(const kv_ssd_t *s);
uint64_t kv_ssd_checksum_errors(const kv_ssd_t *s);
void kv_ssd_close(kv_ssd_t *s);

#endif
