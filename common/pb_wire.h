/* pb_wire.h — checks on a protobuf message's wire bytes that protobuf-c's
 * unpacked form cannot show. A string field is unpacked into a C string, so
 * a NUL inside it (U+0000, valid UTF-8) would silently cut the string there;
 * tandem refuses such a message instead, naming the field. */
#ifndef TD_PB_WIRE_H
#define TD_PB_WIRE_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* True when a string field of the message of type d in buf[0..len), or of a
 * message nested in it, holds a NUL byte; then `where` gets the field's path
 * ("chat.messages.content") and *at the NUL's byte offset in that string.
 * A message that does not parse answers false (its unpack reports it). */
bool td_pb_find_nul(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len, char *where,
                    size_t where_cap, size_t *at);

#endif
