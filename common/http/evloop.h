/* A small single-threaded event loop over epoll (the redis ae.c shape): fd watchers, monotonic
 * one-shot timers in a binary min-heap, and a thread-safe queue of posted callbacks woken by an
 * eventfd.
 *
 * Threading. One thread calls pd_evloop_run; every function here must be called on that thread
 * (or while the loop is not running), EXCEPT pd_evloop_post and pd_evloop_stop, which any thread
 * may call at any time while the loop object exists. Callbacks run on the loop thread, one at a
 * time, and may add, change or remove any watcher or timer (their own included).
 *
 * Fds. Level-triggered by default (a readable fd is reported again until drained); pass
 * PD_EV_EDGE for edge-triggered fds such as ZMQ_FD, which the loop reports once per edge. The
 * loop never closes an fd it watches: remove the watcher (pd_evloop_del_fd) before close(). An
 * event already fetched for an fd whose watcher was removed (or removed and re-added for a new
 * file with the same number) in the same batch is dropped, so callbacks never see stale events.
 *
 * Timers. Deadlines are CLOCK_MONOTONIC milliseconds; a timer fires once, no earlier than its
 * delay, in deadline order (ties in the order they were added). A timer added from a timer
 * callback with delay 0 runs in the next iteration, never in the same pass, so a callback that
 * re-arms itself cannot starve I/O. Ids are never reused within a loop's lifetime in practice
 * (a 32-bit generation per slot), so cancelling an id that already fired is a safe no-op. */
#ifndef PD_EVLOOP_H
#define PD_EVLOOP_H

#include <stdbool.h>
#include <stdint.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_evloop pd_evloop;

/* Interest flags (pd_evloop_add_fd / pd_evloop_mod_fd) and reported events (callback mask). */
enum {
  PD_EV_READ = 1u << 0,  /* interest and report: readable (or EOF pending) */
  PD_EV_WRITE = 1u << 1, /* interest and report: writable */
  PD_EV_RDHUP = 1u << 2, /* interest and report: the peer shut down its sending side */
  PD_EV_HUP = 1u << 3,   /* report only, always watched: hang-up */
  PD_EV_ERR = 1u << 4,   /* report only, always watched: error condition on the fd */
  PD_EV_EDGE = 1u << 5,  /* interest modifier: edge-triggered (EPOLLET) */
};

typedef void (*pd_ev_fd_fn)(pd_evloop *loop, int fd, unsigned events, void *ud);
typedef void (*pd_ev_timer_fn)(pd_evloop *loop, uint64_t timer_id, void *ud);
typedef void (*pd_ev_post_fn)(pd_evloop *loop, void *ud);

/* Creates a loop (epoll instance + eventfd). NULL with e set on failure. */
pd_evloop *pd_evloop_new(pd_err *e);

/* Frees the loop. Callbacks still queued by pd_evloop_post are run first (so they can release
 * what they own); pending timers are dropped without running; watched fds are not closed.
 * Must not be called while pd_evloop_run is executing. NULL is a no-op. */
void pd_evloop_free(pd_evloop *loop);

/* Runs until pd_evloop_stop is called: waits for fd events, due timers and posted callbacks
 * and dispatches them. Returns PD_OK after a stop, PD_EIO if epoll_wait fails for a reason
 * other than EINTR. A stop requested before run makes run return at once (the request is
 * consumed, so the loop can be run again). */
pd_status pd_evloop_run(pd_evloop *loop, pd_err *e);

/* Asks the loop to return from pd_evloop_run after the current dispatch. Thread-safe and
 * async-signal-unsafe (takes no locks, but callers should prefer a thread over a handler). */
void pd_evloop_stop(pd_evloop *loop);

/* Watches fd with interest (PD_EV_READ | PD_EV_WRITE | PD_EV_RDHUP, optionally | PD_EV_EDGE);
 * interest 0 keeps only HUP/ERR reporting. fn(loop, fd, events, ud) is called with the
 * reported events. PD_EINVAL if fd is negative or already watched, PD_EIO if epoll_ctl fails
 * (e.g. a regular file), PD_ENOMEM. */
pd_status pd_evloop_add_fd(pd_evloop *loop, int fd, unsigned interest, pd_ev_fd_fn fn, void *ud,
                           pd_err *e);
/* Changes the interest of a watched fd (cheap when unchanged). PD_EINVAL if not watched. */
pd_status pd_evloop_mod_fd(pd_evloop *loop, int fd, unsigned interest, pd_err *e);
/* Stops watching fd (no-op if not watched). Call before closing the fd. */
void pd_evloop_del_fd(pd_evloop *loop, int fd);

/* Arms a one-shot timer: fn(loop, id, ud) runs once, delay_ms (>= 0) from now. *id (nonzero)
 * identifies it for pd_evloop_timer_cancel. PD_ENOMEM if the timer table cannot grow. */
pd_status pd_evloop_timer_add(pd_evloop *loop, uint64_t delay_ms, pd_ev_timer_fn fn, void *ud,
                              uint64_t *id, pd_err *e);
/* Cancels a pending timer. Returns true if it was pending (and will now never run); false if
 * id is 0, unknown, already fired or already cancelled. */
bool pd_evloop_timer_cancel(pd_evloop *loop, uint64_t id);
/* Number of pending timers (for tests and metrics). */
size_t pd_evloop_timer_count(const pd_evloop *loop);

/* Queues fn(loop, ud) to run on the loop thread in a later iteration and wakes the loop.
 * Thread-safe; callbacks run in the order they were posted (per posting thread and overall,
 * as serialised by the queue lock). PD_ENOMEM if the queue node cannot be allocated, in which
 * case fn will not run. */
pd_status pd_evloop_post(pd_evloop *loop, pd_ev_post_fn fn, void *ud, pd_err *e);

/* True when called from the thread currently inside pd_evloop_run. */
bool pd_evloop_in_loop_thread(const pd_evloop *loop);

/* CLOCK_MONOTONIC now in milliseconds (the clock timers use). */
uint64_t pd_evloop_now_ms(void);

#ifdef __cplusplus
}
#endif
#endif
