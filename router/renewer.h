/* renewer.h — the reservations a router holds (reserved on a decode
 * worker, not yet claimed by a Decode or released), renewed every
 * RT_RES_RENEW_S on a thread of their own. Their leases are short, so a
 * router that dies leaves them for one lease at most. Each renewal extends
 * the landing lease on the prefill worker the reservation's landing is lent
 * to, counted from before the decode worker was asked: no put comes after
 * the decode worker's fence on those blocks ends. A fixed table: a request
 * that finds it full is refused. Thread-safe. */
#ifndef RT_RENEWER_H
#define RT_RENEWER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "router/placement.h"

#define RT_RES_LEASE_MS 3000
#define RT_RES_RENEW_S 1.0
#define RT_MAX_HELD 4096

typedef struct rt_renewer rt_renewer_t;

/* Starts the thread; t is the router's worker table (its records are held
 * while a renewal uses them). */
td_status_t rt_renewer_start(rt_table_t *t, rt_renewer_t **out);
/* Stops the thread and frees (NULL: nothing). */
void rt_renewer_stop(rt_renewer_t *rn);
/* Starts renewing reservation id on d, whose landing is lent to prefill
 * worker p (NULL: none yet); false when the table is full. */
bool rt_renewer_add(rt_renewer_t *rn, rt_worker_t *d, uint64_t id, rt_worker_t *p);
void rt_renewer_remove(rt_renewer_t *rn, rt_worker_t *d, uint64_t id);

#endif
