/* Liveness tracking: last-seen times and deadlines for a set of named peers (nodes that send
 * heartbeats) or tasks (a KV transfer that must finish in time).
 *
 * Each entry has a last-seen time. With suspect_ms and dead_ms from the options it is
 *   ALIVE    while now - last_seen <  suspect_ms
 *   SUSPECT  while now - last_seen in [suspect_ms, dead_ms)  (the router stops sending new
 *            work there but keeps its requests)
 *   DEAD     once  now - last_seen >= dead_ms: pd_liveness_sweep reports it once and removes it
 * An entry may carry its own dead_ms (pd_liveness_set_deadline) instead of the default, e.g. a
 * reservation's ttl. Times are milliseconds of a monotonic clock (pd_liveness_now_ms), passed in
 * by the caller so tests control time.
 *
 * Ids are copied (at most PD_LIVENESS_ID_MAX bytes). Lookups are O(1) on average (open
 * addressing); sweep is O(entries). Not thread-safe: one owner thread (the router's loop). */
#ifndef PD_LIVENESS_H
#define PD_LIVENESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_LIVENESS_ID_MAX 128

typedef enum pd_live_state {
  PD_LIVE_UNKNOWN = 0, /* not tracked (never seen, removed, or swept as dead) */
  PD_LIVE_ALIVE,
  PD_LIVE_SUSPECT,
  PD_LIVE_DEAD /* deadline passed, not yet swept */
} pd_live_state;

typedef struct pd_liveness_opts {
  int64_t suspect_ms; /* > 0; <= dead_ms */
  int64_t dead_ms;    /* > 0: default deadline after the last sighting */
} pd_liveness_opts;

typedef struct pd_liveness pd_liveness;

/* Milliseconds of CLOCK_MONOTONIC. */
int64_t pd_liveness_now_ms(void);

pd_liveness *pd_liveness_new(const pd_liveness_opts *o, pd_err *e);
void pd_liveness_free(pd_liveness *lv);

/* Records a sighting of id at now_ms (adds the entry if new). A sighting older than the last one
 * is ignored (out-of-order delivery never moves a deadline back). An entry that is DEAD but not
 * yet swept is revived: sweep before handling incoming messages to make deaths final.
 * PD_EINVAL for an empty or too long id, PD_ENOMEM. */
pd_status pd_liveness_seen(pd_liveness *lv, const char *id, int64_t now_ms, pd_err *e);
/* Gives id its own dead_ms (suspect at half of it, unless the default suspect_ms is smaller).
 * PD_ENOTFOUND if id is not tracked. */
pd_status pd_liveness_set_deadline(pd_liveness *lv, const char *id, int64_t dead_ms, pd_err *e);
/* Stops tracking id; returns whether it was tracked. */
bool pd_liveness_remove(pd_liveness *lv, const char *id);

pd_live_state pd_liveness_state(const pd_liveness *lv, const char *id, int64_t now_ms);
/* Last sighting of id, or -1 when not tracked. */
int64_t pd_liveness_last_seen(const pd_liveness *lv, const char *id);
int pd_liveness_count(const pd_liveness *lv);

/* Reports every entry whose deadline has passed (now_ms - last_seen >= its dead_ms) to
 * on_dead (may be NULL) and removes it. Returns the number removed. on_dead must not call
 * other pd_liveness functions on lv. */
typedef void (*pd_liveness_dead_fn)(const char *id, int64_t last_seen_ms, void *user);
int pd_liveness_sweep(pd_liveness *lv, int64_t now_ms, pd_liveness_dead_fn on_dead, void *user);

/* Milliseconds from now_ms until the next state change of any entry (ALIVE -> SUSPECT or
 * -> DEAD): a poll timeout for the owner's loop. 0 if one is due already, -1 when empty. */
int64_t pd_liveness_next_event_ms(const pd_liveness *lv, int64_t now_ms);

#ifdef __cplusplus
}
#endif
#endif
