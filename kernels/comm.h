/* comm.h — the collective a tensor-parallel worker's ranks need (engine/tp.h):
 * after a row-parallel matmul every rank holds a partial sum of the same
 * rows, and each must end with their total. One kern_comm_t joins the ranks
 * of one worker; each rank runs on its own thread and calls with its own
 * buffer, queued on its own backend.
 *
 *   memory (kernels/comm_memory.c): ranks whose buffers every rank's
 *           backend reaches (host memory, or ranks sharing one GPU); a call
 *           waits (up to the comm's deadline) until every rank has called,
 *           then each rank adds its share of the elements over all buffers
 *           in rank order with its backend's add and copies the total to
 *           every buffer: the same bits on every rank, whatever the thread
 *           timing. It drains the backends' queues (a captured GPU step
 *           cannot hold it: such steps run uncaptured).
 *   nccl (kernels/cuda/comm_nccl.cu): ncclAllReduce on each rank's stream.
 *
 * The logit rows come together on rank 0 (gather_cols: each rank holds its
 * vocabulary rows' columns), where the backend picks the tokens or the host
 * reads them: through the same rendezvous in memory, or NCCL's sends to rank
 * 0 and a strided copy there. */
#ifndef KERN_COMM_H
#define KERN_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kern_comm kern_comm_t;

typedef struct kern_comm_ops {
    const char *name;
    bool capturable;     /* a call may be queued inside a captured GPU step (it waits on no host) */
    bool gather_scratch; /* gather_cols carries the parts through scratch (without, rank 0 passes NULL) */
    /* Rank `rank`'s buf [n] (memory of be) becomes the sum over the ranks' bufs, once the work queued on be
     * before it has run. Every rank must call, in the same order, with the same n. */
    td_status_t (*all_reduce)(kern_comm_t *c, uint32_t rank, kern_backend_t *be, float *buf, size_t n);
    /* Rank `rank`'s part [rows][cols[rank]] (memory of be) becomes columns [cols[0] + ... + cols[rank - 1], + cols[rank])
     * of rank 0's whole [rows][cols[0] + ... + cols[ranks - 1]], once the work queued on be before it has run;
     * scratch (rank 0's memory, as many floats as whole; where the ops say gather_scratch) carries the parts on the way. Every rank must call, in
     * the same order, with the same rows and cols; whole and scratch are rank 0's (the others pass NULL). Rank 0's
     * work queued after the call sees whole complete. */
    td_status_t (*gather_cols)(kern_comm_t *c, uint32_t rank, kern_backend_t *be, const float *part, uint32_t rows,
                               const uint32_t *cols, float *whole, float *scratch);
    /* A rank that stops before its next call says so: the others' waits end with an error instead of their
     * deadline, and every later call fails at once. */
    void (*abort)(kern_comm_t *c, uint32_t rank);
    void (*destroy)(kern_comm_t *c);
} kern_comm_ops_t;

struct kern_comm {
    const kern_comm_ops_t *ops;
    uint32_t ranks;
};

/* ranks ranks in this process whose memories each rank's backend reaches; a wait for the others ends after
 * deadline_ms. */
td_status_t kern_comm_memory_create(uint32_t ranks, uint32_t deadline_ms, kern_comm_t **out);

#ifdef __cplusplus
}
#endif

#endif
