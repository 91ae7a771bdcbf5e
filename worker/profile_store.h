/* profile_store.h — where a worker's start-up profile (engine/profile.h)
 * comes from, and where it is kept.
 *
 * A profile is one per host, role, model and engine settings (the key,
 * "/tandem/profiles/HOST/ROLE/MODEL-wWEIGHT_BYTES/DEVICE-KV_DTYPE-NUMERICS-
 * tTHREADS-bBUDGET"). It is
 * looked for, in order:
 *   1. in etcd under the key (no lease): a worker that restarts within the
 *      cluster's life reuses it and registers again within its old lease;
 *   2. in this host's cache, DIR/tandem/profiles/KEY.json with DIR
 *      $XDG_CACHE_HOME, else $HOME/.cache: a new cluster on the same host
 *      (its etcd empty) starts without sweeping again;
 *   3. else the sweep measures it, and it is kept in both. Sweeps on one
 *      host take turns (a lock file in the cache folder, waited for 120 s
 *      at most): side by side on shared cores they inflate each other's
 *      times, and a worker that waited finds what the one before it
 *      measured (two prefill workers of the same settings sweep once).
 * A profile found that was measured over 10 minutes ago is checked first
 * (engine/profile.h eng_profile_check: two 128-token prefills, ~0.5 s on a
 * CPU): one off by more than 2x either way was measured in another state of
 * the host (a load, a clock) and is measured again and replaced. Checks
 * take turns with sweeps (the lock).
 * A cache file that does not parse is named in a warning and measured over.
 * Delete the file to have the next start measure again. */
#ifndef WK_PROFILE_STORE_H
#define WK_PROFILE_STORE_H

#include <stdint.h>

#include "common/rpc.h"
#include "engine/engine.h"
#include "engine/profile.h"

/* The profile for key (see above), sweeping e over token ids [lo, hi) when
 * neither copy has it; id names the worker in messages; how says where it
 * came from ("reused from etcd (...)", "reused from FILE (...)", "measured"). An error
 * only when the sweep failed. */
td_status_t wk_profile_get(const char *id, const char *key, const char *etcd_endpoints, const td_rpc_tls_t *tls,
                           eng_engine_t *e, int32_t lo, int32_t hi, eng_profile_t *out, char *how, size_t how_len);

#endif
