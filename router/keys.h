/* keys.h — the router's API keys (router.api_keys) and administrator keys
 * (router.admin_keys), for every transport: the HTTP API's
 * "Authorization: Bearer KEY" header and gRPC's "authorization" metadata
 * (same form) find the same key.
 *
 * A key file has one key a line, "SHA256-HEX NAME RPM TPM [WEIGHT [PRIORITY]]"
 * (`tandem apikey NAME` makes one; RPM, TPM 0: no limit; WEIGHT (1) and
 * PRIORITY (0): its share and class in the admission queue, router/fair.h;
 * '#' starts a comment). A key's limits are two
 * token buckets refilled per minute: requests, charged one at the head of a
 * request, and tokens, charged at admission by the most the request may use
 * (its prompt + max_tokens) and settled at its end by what it used — so ten
 * concurrent requests cannot spend ten times what is left. Thread-safe. */
#ifndef RT_KEYS_H
#define RT_KEYS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rt_keys rt_keys_t;
typedef struct rt_key rt_key_t;

/* path: the file; cfg_key names the config key in errors. */
td_status_t rt_keys_load(const char *path, const char *cfg_key, rt_keys_t **out);
void rt_keys_free(rt_keys_t *ks);

/* The key that authorization ("Bearer KEY", or NULL when none was sent)
 * names, charged one request: 0 with *key set, or a TD_RPC code —
 * UNAUTHENTICATED (no key, or not one of these) or RESOURCE_EXHAUSTED (its
 * request rate; *retry_s says when) — with msg saying which. */
int rt_keys_admit(rt_keys_t *ks, const char *authorization, const rt_key_t **key, char *msg, size_t n,
                  double *retry_s);
/* Charges key the tokens a request may use: 0, or RESOURCE_EXHAUSTED with
 * msg and *retry_s when its bucket cannot cover them (a request larger than
 * the whole per-minute limit waits for a full bucket). *charged: what was
 * taken, for rt_keys_settle. */
int rt_keys_charge(rt_keys_t *ks, const rt_key_t *key, uint32_t tokens, uint32_t *charged, char *msg, size_t n,
                   double *retry_s);
/* At the request's end: used tokens replace the charged ones. */
void rt_keys_settle(rt_keys_t *ks, const rt_key_t *key, uint32_t charged, uint32_t used);
const char *rt_key_name(const rt_key_t *key);
/* Its weight (1 for NULL: no key) and priority class (0). */
double rt_key_weight(const rt_key_t *key);
int32_t rt_key_priority(const rt_key_t *key);

#endif
