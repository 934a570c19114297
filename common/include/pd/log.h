/* Logging, clocks, ready files and small path helpers (libpdutil): what every pdserve program
 * uses, the router as much as the nodes. */
#ifndef PD_LOG_H
#define PD_LOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- logging ---- */

enum { PD_LOG_DEBUG = 0, PD_LOG_INFO, PD_LOG_WARN, PD_LOG_ERROR };
void pd_log_init(const char *prog, bool verbose);
void pd_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool pd_log_debug_on(void);
/* The program name given to pd_log_init ("pd" before it). */
const char *pd_log_prog(void);

/* ---- small helpers ---- */

/* Writes obj as JSON to path atomically (path.tmp, then rename). */
pd_status pd_ready_file_write(const char *path, const cJSON *obj, pd_err *e);
/* CLOCK_MONOTONIC milliseconds. */
int64_t pd_now_ms(void);
/* CLOCK_MONOTONIC seconds, to the nanosecond (for timing work on a node's loop). */
double pd_mono_s(void);
/* Wall clock seconds since the epoch. */
double pd_wall_s(void);
/* The last path component of dir without trailing slashes ("pycoder-12m"). */
void pd_basename(const char *dir, char *out, size_t cap);
/* ---- rate-limited log lines ---- */

/* At most PD_LOG_LIMIT_LINES lines per 10 s for one kind of event that a stranger can cause at
 * will (refused handshakes); the rest are counted and summed up in the next window. Zero it to
 * start. */
#define PD_LOG_LIMIT_LINES 10
typedef struct pd_log_limit {
  int64_t window_ms; /* start of the current window (pd_now_ms) */
  int lines;         /* lines logged in it */
  uint64_t held;     /* events not logged since the last summary */
} pd_log_limit;
/* Whether one more line may be logged now (a summary of held events is logged first when a new
 * window starts); counts the event as held when not. */
bool pd_log_limit_ok(pd_log_limit *l, const char *what);
#ifdef __cplusplus
}
#endif

#endif /* PD_LOG_H */
