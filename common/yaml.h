/* yaml.h — YAML documents read and written through a libcyaml schema, the
 * one way tandem turns YAML into structs (the config file, config.h; the ops
 * config, ops.h) and back.
 *
 * A load that fails says where: the origin (a file name, or "etcd
 * /tandem/ops"), the line of the key libcyaml complained about, and its
 * dotted name ("slo.ttft_ms"), so an operator can find it. */
#ifndef TD_YAML_H
#define TD_YAML_H

#include <cyaml/cyaml.h>
#include <stddef.h>

#include "common/status.h"

/* Loads text (len bytes, YAML or JSON) into *out (free with td_yaml_free).
 * TD_ERR_CONFIG naming origin, the key and its line when it does not match
 * the schema. */
td_status_t td_yaml_load(const cyaml_schema_value_t *schema, const char *text, size_t len, const char *origin,
                         void **out);
/* Reads a whole file (at most 1 MiB) and loads it as above. */
td_status_t td_yaml_load_file(const cyaml_schema_value_t *schema, const char *path, void **out);
void td_yaml_free(const cyaml_schema_value_t *schema, void *data);
/* The YAML text of data, NUL-terminated (free()). */
td_status_t td_yaml_save(const cyaml_schema_value_t *schema, const void *data, char **text, size_t *len);

#endif
