/* comm_nccl.h — kernels/comm.h's NCCL all-reduce (comm_nccl.cu). */
#ifndef KERN_COMM_NCCL_H
#define KERN_COMM_NCCL_H

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ranks ranks, rank r on the CUDA backend bes[r] (each on its own device); errors name what was missing (NCCL,
 * a device given twice) or NCCL's own. */
td_status_t kern_comm_nccl_create(uint32_t ranks, kern_backend_t *const *bes, kern_comm_t **out);

#ifdef __cplusplus
}
#endif

#endif
