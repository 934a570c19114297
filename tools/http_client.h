/* pdctl's HTTP client, on libcurl: one blocking exchange (pdctl_http: /health, /v1/models, the
 * cluster commands), and exchanges a caller drives many at a time through a curl multi handle
 * (pdctl bench), whose Server-Sent Events are split out and handed over with the time each
 * chunk arrived (one CLOCK_MONOTONIC clock, pdctl_now). */
#ifndef PDCTL_HTTP_CLIENT_H
#define PDCTL_HTTP_CLIENT_H

#include <curl/curl.h>
#include <stdbool.h>
#include <stddef.h>

#include "pd/status.h"

/* Why an exchange failed, for the benchmark's report. */
enum {
  PDCTL_HX_OK,
  PDCTL_HX_CONNECT,    /* no connection, or the request could not be sent */
  PDCTL_HX_TIMEOUT,    /* the exchange's deadline passed */
  PDCTL_HX_HTTP,       /* a status other than 200 (set by the caller that judges it) */
  PDCTL_HX_STREAM,     /* an error event in the stream (set by the caller) */
  PDCTL_HX_INCOMPLETE, /* the connection ended early */
  PDCTL_HX_PROTOCOL,   /* not HTTP, bad framing, bad JSON */
  PDCTL_HX_KINDS
};
extern const char *const pdctl_hx_kind_names[PDCTL_HX_KINDS];

typedef struct pdctl_hx pdctl_hx;
struct pdctl_hx {
  CURL *curl;
  struct curl_slist *hdrs;
  char *req;   /* the request body (curl reads it in place) */
  long status; /* HTTP status once the head has arrived, else 0 */
  /* with sse, a 200 answer's body is split into events: on_event(h, data, len, t) for each,
   * data the event's data lines joined by \n (NUL-terminated), t when its last chunk arrived.
   * Otherwise, or for another status, the body is kept (at most body_max bytes). */
  bool sse;
  void (*on_event)(pdctl_hx *h, const char *data, size_t len, double t);
  void *ud;
  char *body;
  size_t body_len, body_cap, body_max;
  char *line, *data; /* the SSE line and event being assembled */
  size_t line_len, line_cap, data_len, data_cap;
  bool finished;
  int err;          /* PDCTL_HX_*, OK while it goes well */
  char errmsg[160]; /* set with err */
};

/* Prepares method base_url + path (base_url: http[s]://host[:port][/prefix], a trailing /v1
 * dropped: the paths carry it) with a JSON body (may be NULL), a bearer key (may be NULL) and a
 * deadline of timeout_s for the whole exchange. PD_EINVAL for a URL that is not http(s). */
pd_status pdctl_hx_init(pdctl_hx *h, const char *base_url, const char *method, const char *path,
                        const char *body, const char *api_key, double timeout_s, pd_err *e);
/* Marks h failed (the first failure is kept); the transfer stops at its next chunk. */
void pdctl_hx_fail(pdctl_hx *h, int kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* After curl finished h with rc: records the outcome (keeps an earlier pdctl_hx_fail). */
void pdctl_hx_done(pdctl_hx *h, CURLcode rc);
void pdctl_hx_free(pdctl_hx *h);

#endif
