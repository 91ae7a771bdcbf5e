/* pb_wire.c — see pb_wire.h. */
#include "common/pb_wire.h"

#include <stdio.h>
#include <string.h>

#define MAX_DEPTH 16

static bool varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return true;
    }
    return false;
}

static bool find(const ProtobufCMessageDescriptor *d, const uint8_t *p, const uint8_t *end, int depth, char *where,
                 size_t cap, size_t *at)
{
    if (depth > MAX_DEPTH)
        return false;
    while (p < end) {
        uint64_t tag, n;
        if (!varint(&p, end, &tag))
            return false;
        switch (tag & 7) {
        case 0: /* varint */
            if (!varint(&p, end, &n))
                return false;
            break;
        case 1: /* 64-bit */
            if (end - p < 8)
                return false;
            p += 8;
            break;
        case 5: /* 32-bit */
            if (end - p < 4)
                return false;
            p += 4;
            break;
        case 2: { /* length-delimited */
            if (!varint(&p, end, &n) || n > (uint64_t)(end - p))
                return false;
            const ProtobufCFieldDescriptor *f =
                tag >> 3 <= UINT32_MAX ? protobuf_c_message_descriptor_get_field(d, (unsigned)(tag >> 3)) : NULL;
            if (f && f->type == PROTOBUF_C_TYPE_STRING) {
                const uint8_t *z = memchr(p, 0, n);
                if (z) {
                    snprintf(where, cap, "%s", f->name);
                    *at = (size_t)(z - p);
                    return true;
                }
            } else if (f && f->type == PROTOBUF_C_TYPE_MESSAGE &&
                       find(f->descriptor, p, p + n, depth + 1, where, cap, at)) {
                char inner[256];
                snprintf(inner, sizeof inner, "%s", where);
                snprintf(where, cap, "%s.%s", f->name, inner);
                return true;
            }
            p += n;
            break;
        }
        default: /* groups: not in tandem's messages */
            return false;
        }
    }
    return false;
}

bool td_pb_find_nul(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len, char *where,
                    size_t where_cap, size_t *at)
{
    if (where_cap)
        where[0] = 0;
    return find(d, buf, buf + len, 0, where, where_cap, at);
}
