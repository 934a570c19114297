/* pd_pool: persistent worker threads that run the tasks of one parallel job at a time
 * (kernels/cpu/cpu_pool.c). The CPU backend runs its ops on one; the nodes' parallel CRC-32
 * (pd_crcpool) on another.
 *
 * Workers spin on the job counter for a while after each job (PD_POOL_SPIN_US by default, or
 * pd_pool_create_spin's), then sleep on a condition variable; tasks are handed out dynamically,
 * so a descheduled worker never holds the caller up. */
#ifndef PD_POOL_H
#define PD_POOL_H

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_pool pd_pool;
#define PD_POOL_SPIN_US 300 /* workers' default spin after a job, microseconds */
/* One task of a parallel job. task in [0, n_tasks); thread in [0, pd_pool_size) names the
 * thread running it (0 = the caller) so a task can use that thread's scratch memory. */
typedef void (*pd_pool_fn)(void *ctx, int task, int thread);

/* Starts n_threads - 1 workers (the caller is thread 0). NULL with e set on failure. */
pd_pool *pd_pool_create(int n_threads, pd_err *e);
/* The same with the workers' spin after a job given (0: they sleep at once, for a pool whose
 * jobs come far apart) instead of the default. */
pd_pool *pd_pool_create_spin(int n_threads, int spin_us, pd_err *e);
void pd_pool_destroy(pd_pool *p);
int pd_pool_size(const pd_pool *p);
/* Runs fn(ctx, t, thread) for every t < n_tasks across the pool and returns when all are done
 * (their writes visible to the caller). Tasks are handed out dynamically (an atomic counter):
 * the caller takes whatever tasks remain. Not reentrant; one caller at a time. */
void pd_pool_run(pd_pool *p, pd_pool_fn fn, void *ctx, int n_tasks);

#ifdef __cplusplus
}
#endif
#endif
