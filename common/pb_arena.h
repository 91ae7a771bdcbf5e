/* pb_arena.h — a protobuf-c allocator over a caller's buffer, for messages
 * unpacked on a per-token path: allocation is a pointer bump, free is a
 * no-op, td_pb_arena_reset makes the buffer whole again. A message larger
 * than the buffer falls back to the heap (and is freed there). */
#ifndef TD_PB_ARENA_H
#define TD_PB_ARENA_H

#include <protobuf-c/protobuf-c.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct td_pb_arena {
    ProtobufCAllocator a; /* pass &arena.a to unpack and free_unpacked */
    uint8_t *buf;
    size_t cap, used;
} td_pb_arena_t;

static inline void *td_pb_arena_alloc_(void *data, size_t n)
{
    td_pb_arena_t *ar = data;
    size_t at = (ar->used + 15) & ~(size_t)15;
    if (at + n <= ar->cap) {
        ar->used = at + n;
        return ar->buf + at;
    }
    return malloc(n ? n : 1);
}

static inline void td_pb_arena_free_(void *data, void *p)
{
    td_pb_arena_t *ar = data;
    if ((uint8_t *)p < ar->buf || (uint8_t *)p >= ar->buf + ar->cap)
        free(p);
}

static inline void td_pb_arena_init(td_pb_arena_t *ar, void *buf, size_t cap)
{
    ar->a = (ProtobufCAllocator){.alloc = td_pb_arena_alloc_, .free = td_pb_arena_free_, .allocator_data = ar};
    ar->buf = buf;
    ar->cap = cap;
    ar->used = 0;
}

static inline void td_pb_arena_reset(td_pb_arena_t *ar) { ar->used = 0; }

#endif
