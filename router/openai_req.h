/* openai_req.h — an OpenAI request body (chat or text completion, as
 * vLLM and OpenAI take them) read into a tandem.v1 GenerateRequest: the
 * HTTP front door's parser (router/http.c), kept apart so that a fuzzer can
 * drive it alone. Unknown fields are ignored, as OpenAI's API does; a field
 * of the wrong type or out of range is an error that names it.
 *
 * Function calling (chat's tools and tool_choice): with no parser of a
 * model's own tool-call text, tandem answers a call the client names
 * (tool_choice {"type": "function", "function": {"name": ...}}, or
 * "required" of one tool): the answer is that function's call, its arguments
 * held to the function's parameters (a JSON Schema, as structured output
 * holds text to one). "required" over several tools holds the text to
 * {"name": one of theirs, "arguments": its parameters} (anyOf), which the
 * answer reads back into the call. "none" answers in text; "auto" (the
 * default with tools) is refused naming tool_choice, as vLLM refuses it
 * without a parser. */
#ifndef RT_OPENAI_REQ_H
#define RT_OPENAI_REQ_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "tandem/v1/tandem.pb-c.h"

typedef enum { RT_OAI_CHAT = 1, RT_OAI_COMPLETION } rt_oai_kind_t;

#define RT_OAI_MAX_TOOLS 128
#define RT_OAI_TOOL_NAME 64 /* a function's name: 1 to 64 of a-z, A-Z, 0-9, _ and - (OpenAI's rule) */

/* What the body asks of the answer's shape. */
typedef struct rt_oai_opts {
    bool stream, include_usage;
    char tool[RT_OAI_TOOL_NAME + 1]; /* the function the answer calls ("": text, or any_tool) */
    bool any_tool; /* the answer calls one of the tools: its text {"name": ..., "arguments": {...}} */
} rt_oai_opts_t;

typedef struct rt_oai_error {
    char msg[300];  /* "stop: must be a string or an array of strings" */
    char param[64]; /* the field: "stop" */
} rt_oai_error_t;

/* The body b → *out (heap parts; free it with
 * tandem__v1__generate_request__free_unpacked, on failure too: *out may be
 * set); *o from the body. False with e set. */
bool rt_oai_parse_json(rt_oai_kind_t kind, json_t *b, const char *request_id, Tandem__V1__GenerateRequest **out,
                       rt_oai_opts_t *o, rt_oai_error_t *e);
/* The same from the body's bytes (not JSON: an error). */
bool rt_oai_parse(rt_oai_kind_t kind, const char *body, size_t n, const char *request_id,
                  Tandem__V1__GenerateRequest **out, rt_oai_opts_t *o, rt_oai_error_t *e);

/* A call read back from an answer's text held to "required"'s schema over several tools ({"name": ...,
 * "arguments": {...}}): the arguments' text (the caller frees) with the name in name (cap bytes), or NULL where the
 * text is not one (cut short by max_tokens). */
char *rt_oai_read_call(const char *text, char *name, size_t cap);

/* Why a body that did not parse to a JSON object (b: what it parsed to, NULL
 * when nothing did; je: the parser's error) was refused. */
void rt_oai_body_error(const json_t *b, const json_error_t *je, char *msg, size_t n);

#endif
