/* A small Prometheus metrics registry: counters, gauges and histograms rendered in the
 * Prometheus text exposition format (version 0.0.4), for /metrics on the router and the nodes.
 *
 * A family is a metric name with its HELP text and TYPE; a series is a family plus one label
 * set. Series are created once (at startup, or the first time a label value is seen) and
 * updated through their handle; updates are cheap (one mutex, no allocation).
 *
 *   pd_metrics *m = pd_metrics_new(&e);
 *   pd_metric *req = pd_metrics_counter(m, "pd_router_requests_total", "Requests answered.",
 *                                       "api=\"chat\",code=\"200\"");
 *   pd_metric_add(req, 1);
 *   static const double b[] = {0.01, 0.1, 1};
 *   pd_metric *ttft = pd_metrics_histogram(m, "pd_router_time_to_first_token_seconds",
 *                                          "Time to first token.", NULL, b, 3);
 *   pd_metric_observe(ttft, 0.042);
 *   char *text = pd_metrics_render(m, &len);   // free() it
 *
 * Histograms have cumulative `_bucket{le=...}` series (ascending bounds, then `+Inf`), `_sum`
 * and `_count`. Label sets are given pre-formatted (`k="v",k2="v2"`, values escaped with
 * pd_metrics_escape_label); they are checked for shape when the series is created.
 *
 * Thread-safety: every function may be called from any thread (one mutex per registry);
 * pd_metrics_free must not race with anything. Collect callbacks run inside pd_metrics_render
 * with the lock NOT held, so they may update series (gauges sampled at scrape time). */
#ifndef PD_METRICS_H
#define PD_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_metrics pd_metrics;
typedef struct pd_metric pd_metric;

typedef enum pd_metric_type {
  PD_METRIC_COUNTER = 0,
  PD_METRIC_GAUGE,
  PD_METRIC_HISTOGRAM
} pd_metric_type;

#define PD_METRICS_MAX_BUCKETS 32

pd_metrics *pd_metrics_new(pd_err *e);
void pd_metrics_free(pd_metrics *m);

/* Returns the series name{labels}, creating the family (with help and type) and the series on
 * first use; a later call with the same name and labels returns the same handle. labels may be
 * NULL or "" (no labels). NULL when the name or labels are malformed, when the name exists with
 * another type (or other buckets), or on allocation failure: updating a NULL handle is a no-op,
 * so a caller may ignore the failure. Histogram bounds: 1..PD_METRICS_MAX_BUCKETS finite values,
 * strictly ascending (copied). */
pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *help,
                              const char *labels);
pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *help,
                            const char *labels);
pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *help,
                                const char *labels, const double *bounds, int n_bounds);

/* Counters: v >= 0 (negative or NaN values are ignored). Gauges: any finite v. NULL: no-op. */
void pd_metric_add(pd_metric *s, double v);
/* Gauges only (counters ignore it). */
void pd_metric_set(pd_metric *s, double v);
/* Histograms only: counts v in the first bucket whose bound is >= v. */
void pd_metric_observe(pd_metric *s, double v);
/* Current value (counter, gauge) or observation count (histogram); 0 for NULL. */
double pd_metric_value(const pd_metric *s);

/* Registers fn to run at the start of every pd_metrics_render (e.g. to set gauges from a
 * component's state). At most 8 callbacks. PD_EFULL beyond. */
pd_status pd_metrics_on_collect(pd_metrics *m, void (*fn)(pd_metrics *m, void *ud), void *ud);

/* The whole registry in the text format, malloc'ed and NUL-terminated; *len (may be NULL)
 * gets its length. NULL on allocation failure. */
char *pd_metrics_render(pd_metrics *m, size_t *len);

/* Writes value escaped for a label value (backslash, double quote and newline escaped) into
 * out (cap bytes, NUL-terminated, truncated to fit). Returns out. */
char *pd_metrics_escape_label(const char *value, char *out, size_t cap);

/* Standard bucket sets, ascending, in seconds. */
extern const double pd_metrics_latency_buckets[]; /* 0.001 s .. 60 s, for TTFT / e2e */
extern const int pd_metrics_latency_buckets_n;
extern const double pd_metrics_itl_buckets[];     /* 0.001 s .. 5 s, for inter-token gaps */
/* 10 us .. 10 s, 2.5x apart: quantities that can take microseconds (a KV transfer of a short
 * prompt between nodes on one host, a decode step of a small model on a GPU) */
extern const double pd_metrics_fine_buckets[];
extern const int pd_metrics_fine_buckets_n;
extern const int pd_metrics_itl_buckets_n;

#ifdef __cplusplus
}
#endif
#endif
