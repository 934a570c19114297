/* A small pool of worker threads for CPU-heavy work that a pd_evloop must not do itself (the
 * router tokenizes prompts and renders chat templates in it, so that one 8 MB prompt does not
 * stall every other client for a second).
 *
 * A job is a pd_work the caller embeds in its own struct. It is submitted on the loop thread;
 * run(w) executes on some worker thread; then done(w) executes on the loop thread (delivered
 * through an eventfd the loop watches). Between submit and done the job belongs to the pool:
 * run must only touch what the job owns (its inputs and outputs), never loop-owned state, and
 * the loop must not touch what run reads or writes. done may free the job.
 *
 * Two lanes. A job marked big (the caller decides: the router uses the prompt's size) runs on
 * at most threads - 1 workers at a time when there are two or more, so small jobs always find a
 * worker while big ones are being ground through; small jobs are taken first. FIFO within a
 * lane. Workers run at a lower priority (nice +10) than the process, so the loop comes first
 * when CPUs are short.
 *
 * Threading: pd_workpool_new / submit / pending / free are loop-thread calls (or calls made
 * while the loop is not running). */
#ifndef PD_WORKPOOL_H
#define PD_WORKPOOL_H

#include <stdbool.h>
#include <stddef.h>

#include "evloop.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_workpool pd_workpool;
typedef struct pd_work pd_work;
typedef void (*pd_work_fn)(pd_work *w);

struct pd_work {
  pd_work_fn run;  /* worker thread */
  pd_work_fn done; /* loop thread, once, after run returned (or instead of it: see ran) */
  bool big;        /* set by the caller before submit: the big lane */
  bool ran;        /* set by the pool: false when the pool was freed before run could start */
  pd_work *next_;  /* private to the pool */
};

/* Starts threads workers (1..64) whose completions come back on loop. NULL with e set. */
pd_workpool *pd_workpool_new(pd_evloop *loop, int threads, pd_err *e);

/* Queues w (run and done set). PD_EINVAL without callbacks; never fails otherwise. */
pd_status pd_workpool_submit(pd_workpool *p, pd_work *w, pd_err *e);

/* Jobs submitted whose done has not run yet (queued, running, or finished and undelivered). */
size_t pd_workpool_pending(const pd_workpool *p);

/* Stops the pool: waits for the jobs that are running, then calls done for every job still
 * held (ran true for those that ran, false for those that never started), on the calling
 * thread, before it returns. Call on the loop thread or while the loop is not running. NULL is
 * a no-op. */
void pd_workpool_free(pd_workpool *p);

#ifdef __cplusplus
}
#endif
#endif
