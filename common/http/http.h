/* HTTP/1.1 server on a pd_evloop: an incremental request parser, a per-connection state
 * machine with limits and timeouts, and a reference-counted request handle through which a
 * handler answers at once, later, or as a stream (chunked; Server-Sent Events).
 * Behaviour, limits and defaults are described in docs/http.md.
 *
 * Life of a request
 *   1. The server parses a complete request (head and body) and calls
 *        on_request(req, msg, ud)
 *      on the loop thread. msg (method, path, query, headers, body) lives as long as req.
 *   2. The handler answers, now or later, on the loop thread, with exactly one of
 *        pd_http_respond / pd_http_respond_error                 (complete response), or
 *        pd_http_stream_begin, pd_http_stream_write | pd_http_sse_event ..., pd_http_stream_end.
 *      To answer later it takes a reference (pd_http_req_ref) and drops it when done. From
 *      another thread, hop to the loop with pd_evloop_post and answer from the callback.
 *   3. If the client goes away (EOF, RST, EPIPE), a send times out, or a stream outruns a slow
 *      reader (max_output_bytes), or the server is freed, before the response is ended, the
 *      server calls the cancel callback set with pd_http_req_on_cancel (once, from the loop,
 *      never from inside a pd_http_* call the handler made) and detaches the request: every
 *      later response call on it returns PD_EIO and does nothing. The handle itself stays
 *      valid until the last reference is dropped.
 * Requests on one connection are handled one at a time, in order (pipelined requests wait);
 * the next one is read once the previous response is fully sent.
 *
 * Threading: everything here runs on the loop thread, except pd_http_req_ref/unref,
 * pd_http_req_msg/id/peer and the helpers at the end (pure functions), which any thread may
 * call. Never SIGPIPE: every send uses MSG_NOSIGNAL. */
#ifndef PD_HTTP_H
#define PD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "evloop.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_http_server pd_http_server;
typedef struct pd_http_req pd_http_req;
typedef struct pd_http_parser pd_http_parser;

typedef struct pd_http_header {
  const char *name;  /* as sent (case preserved); compare case-insensitively */
  const char *value; /* leading/trailing spaces and tabs removed */
} pd_http_header;

/* A parsed request. All strings are NUL-terminated and owned by the request (or parser). */
typedef struct pd_http_request {
  const char *method;  /* "GET", "POST" ... (case-sensitive token, as sent) */
  const char *target;  /* the request-target as sent: "/v1/models?x=1" */
  const char *path;    /* target's path, NOT percent-decoded: "/v1/models" ("/" for
                          absolute-form without a path, "*" for OPTIONS *) */
  const char *query;   /* after '?', not decoded; "" when absent */
  int version_minor;   /* HTTP/1.<version_minor>: 0 or 1 */
  const pd_http_header *headers; /* [num_headers], in arrival order */
  size_t num_headers;
  const char *body;    /* the body after de-chunking, NUL-terminated ("" when none) */
  size_t body_len;     /* bytes, excluding the terminating NUL */
  bool keep_alive;     /* the client allows another request on this connection */
  bool expect_continue;/* "Expect: 100-continue" was sent */
  bool chunked;        /* the body came with Transfer-Encoding: chunked */
} pd_http_request;

typedef struct pd_http_limits {
  size_t max_head_bytes; /* request line + headers + the blank line; over -> 431 (414 when the
                            request line alone is over) */
  size_t max_headers;    /* header fields (and trailer fields); over -> 431 */
  size_t max_body_bytes; /* decoded body; over -> 413 (decided from Content-Length up front) */
} pd_http_limits;

typedef void (*pd_http_handler_fn)(pd_http_req *req, const pd_http_request *msg, void *ud);
typedef void (*pd_http_cancel_fn)(pd_http_req *req, void *ud);

typedef struct pd_http_config {
  const char *host;     /* bind address: "127.0.0.1", "0.0.0.0", "::", or a name */
  int port;             /* 0 = ephemeral (see pd_http_server_port) */
  int backlog;          /* listen(2) backlog */
  int max_connections;  /* open client connections. At the limit a new connection takes the
                           place of the oldest one without a request in progress (idle between
                           requests, or still sending its head: "evictable"); with none, accepting
                           pauses until one closes or becomes evictable */
  int max_connections_per_ip; /* open connections of one peer address; 0 = no limit. A new one
                           over it takes the place of that address's oldest evictable one, or is
                           refused (503, closed) when it has none */
  int busy_percent;           /* the table is "busy" above this share of max_connections (until
                                 it is back at half of it) ... */
  uint32_t busy_timeout_ms;   /* ... and then an evictable connection is closed (408 when its
                                 head was arriving) once it has waited this long for a request;
                                 0 = off */
  pd_http_limits limits;
  size_t max_output_bytes;    /* unsent bytes a stream may queue for a slow reader before the
                                 connection is dropped (and the request cancelled) */
  /* Timeouts in milliseconds; 0 disables one. */
  uint32_t header_timeout_ms; /* from connect / first byte of a request to the end of its head */
  uint32_t body_timeout_ms;   /* from the end of the head to the end of the body */
  uint32_t idle_timeout_ms;   /* keep-alive: from the end of a response to the next request */
  uint32_t send_timeout_ms;   /* with output queued: longest time without send progress */
  uint32_t linger_ms;         /* after a closing response: drain the client's input this long */
  /* CORS (off when NULL or ""): "*" or a comma-separated list of origins allowed to call the
   * server from a browser (the string must outlive the server). When set, the server answers
   * preflights (OPTIONS with Origin and Access-Control-Request-Method) itself, 200 or 400, and
   * adds Access-Control-Allow-Origin (and Vary: Origin for a list) to every response to an
   * allowed Origin, as Starlette's CORSMiddleware does for vLLM. */
  const char *allowed_origins;
  pd_http_handler_fn on_request; /* required */
  void *ud;                      /* passed to on_request */
} pd_http_config;

/* Defaults: host 0.0.0.0, port 8000, backlog 511, max_connections 4096, per address 1024,
 * busy above 75 % with a 2 s header/idle timeout, head 16 KiB, 100 headers, body 8 MiB, output
 * 4 MiB, timeouts header 30 s, body 60 s, idle 60 s, send 60 s, linger 2 s; on_request NULL
 * (must be set). */
void pd_http_config_default(pd_http_config *c);

/* Binds and listens (SO_REUSEADDR, non-blocking, close-on-exec) and starts accepting on loop.
 * Call on the loop thread or before the loop runs. NULL with e set on failure (PD_EINVAL for
 * a bad config, PD_EIO for socket errors such as an address in use). */
pd_http_server *pd_http_server_new(pd_evloop *loop, const pd_http_config *c, pd_err *e);

/* Closes the listener and every connection; requests whose response is not ended get their
 * cancel callback. Requests still referenced by handlers stay valid (detached). Call on the
 * loop thread or while the loop is not running, never from inside a server callback. */
void pd_http_server_free(pd_http_server *s);

/* The bound port (the chosen one when config port was 0). */
int pd_http_server_port(const pd_http_server *s);

typedef struct pd_http_stats {
  uint64_t connections_open;
  uint64_t connections_total;  /* accepted */
  uint64_t requests_total;     /* dispatched to on_request */
  uint64_t responses_error;    /* 4xx/5xx answered by the server itself (parse errors, 408) */
  uint64_t timeouts;           /* connections closed by a header/body/send timeout (the busy
                                  table's shorter one included) */
  uint64_t evicted;            /* evictable connections closed to admit a new one */
  uint64_t refused;            /* new connections refused: their address was over its limit
                                  with nothing evictable */
  uint64_t dropped_slow;       /* connections dropped over max_output_bytes */
  uint64_t cancelled;          /* requests whose cancel callback ran */
} pd_http_stats;
void pd_http_server_stats(const pd_http_server *s, pd_http_stats *out);

/* ---- the request handle ------------------------------------------------------------------ */

/* Reference counting (atomic: any thread). The server's own reference lasts until the
 * response is ended or the request is cancelled; a handler answering later takes its own. */
pd_http_req *pd_http_req_ref(pd_http_req *r);
void pd_http_req_unref(pd_http_req *r);

const pd_http_request *pd_http_req_msg(const pd_http_req *r);
uint64_t pd_http_req_id(const pd_http_req *r);     /* unique per server, from 1 */
const char *pd_http_req_peer(const pd_http_req *r); /* "127.0.0.1:50312", "[::1]:5000" */

/* Sets (or clears, fn NULL) the cancel callback. PD_EIO if the request is already detached
 * (the client is gone): the callback will never run. Clearing always succeeds: a handler that
 * lets go of a request clears its callback first, so that the server never calls into state the
 * handler has freed (a response ended while the client was going away leaves the request
 * detachable until its connection closes). */
pd_status pd_http_req_on_cancel(pd_http_req *r, pd_http_cancel_fn fn, void *ud);
/* True while the client is attached and the response can still be sent. */
bool pd_http_req_connected(const pd_http_req *r);
/* Bytes queued on the connection and not yet sent (0 when detached): the backpressure signal
 * for a streaming producer. */
size_t pd_http_req_pending_output(const pd_http_req *r);

/* ---- responses (loop thread) -------------------------------------------------------------
 * Common rules. headers[n] are extra fields (names are tokens, values must not contain CR, LF
 * or NUL: PD_EINVAL otherwise); the server writes Date, Content-Length or
 * Transfer-Encoding, and Connection itself, and drops framing fields given by the caller
 * (Content-Length, Transfer-Encoding); a caller's "Connection: close" closes the connection
 * after this response. content_type may be NULL (no Content-Type). HEAD requests get the
 * head only. Errors: PD_EIO when the request is detached (client gone), PD_EINVAL when a
 * response was already started or ended (or a stream call without a begun stream). */

/* A complete response with a body of len bytes (len 0: empty body; status 1xx/204/304
 * forbid a body: PD_EINVAL if len > 0). */
pd_status pd_http_respond(pd_http_req *r, int status, const char *content_type,
                          const pd_http_header *headers, size_t n, const void *body, size_t len,
                          pd_err *e);
/* An OpenAI-style JSON error response: {"error": {"message", "type", "param": null, "code"}}.
 * type NULL: derived from status (pd_http_error_type); code NULL: JSON null. */
pd_status pd_http_respond_error(pd_http_req *r, int status, const char *message,
                                const char *type, const char *code, pd_err *e);

/* Starts a streamed response: Transfer-Encoding: chunked for HTTP/1.1 clients; for HTTP/1.0
 * clients the body is delimited by closing the connection. */
pd_status pd_http_stream_begin(pd_http_req *r, int status, const char *content_type,
                               const pd_http_header *headers, size_t n, pd_err *e);
/* Starts a Server-Sent Events stream: 200, text/event-stream, Cache-Control: no-cache,
 * X-Accel-Buffering: no, plus headers[n]. */
pd_status pd_http_sse_begin(pd_http_req *r, const pd_http_header *headers, size_t n, pd_err *e);
/* Queues len bytes as one chunk (len 0 is a no-op) and sends what the socket takes now.
 * PD_EIO if the client is gone, or if the unsent bytes now exceed max_output_bytes: the
 * connection is then dropped and the cancel callback follows from the loop. */
pd_status pd_http_stream_write(pd_http_req *r, const void *data, size_t len, pd_err *e);
/* Writes one SSE event as one chunk: "event: <event>\n" (when event is non-NULL) then
 * "data: <line>\n" for each line of data (split at \n, \r\n or \r), then "\n". */
pd_status pd_http_sse_event(pd_http_req *r, const char *event, const char *data, pd_err *e);
/* Ends the stream (the zero-length chunk, or the close for HTTP/1.0). */
pd_status pd_http_stream_end(pd_http_req *r, pd_err *e);

/* ---- the incremental request parser (used by the server; exposed for tests and tools) ----- */

typedef enum pd_http_parse_result {
  PD_HTTP_PARSE_MORE,  /* every byte consumed, the request is not complete */
  PD_HTTP_PARSE_HEAD,  /* the head is complete and a body follows: feed the rest again */
  PD_HTTP_PARSE_DONE,  /* the request is complete; bytes after *consumed belong to the next */
  PD_HTTP_PARSE_ERROR, /* malformed or over a limit: see pd_http_parser_error_status */
} pd_http_parse_result;

/* A parser for one request at a time within lim. NULL with e set (PD_ENOMEM, PD_EINVAL). */
pd_http_parser *pd_http_parser_new(const pd_http_limits *lim, pd_err *e);
void pd_http_parser_free(pd_http_parser *p);
/* Forgets the current request (and any error) to parse the next one. */
void pd_http_parser_reset(pd_http_parser *p);
/* Consumes bytes from data[0, len); *consumed gets how many were used (all of them for MORE).
 * After HEAD, pd_http_parser_request is valid except for the body; after DONE, entirely.
 * After ERROR (or DONE), feeding again returns the same result and consumes nothing until
 * pd_http_parser_reset. */
pd_http_parse_result pd_http_parser_feed(pd_http_parser *p, const void *data, size_t len,
                                         size_t *consumed);
const pd_http_request *pd_http_parser_request(const pd_http_parser *p);
/* Whether any byte of the current request has arrived (leading blank lines included). */
bool pd_http_parser_started(const pd_http_parser *p);
/* After ERROR: the status to answer (400, 413, 414, 417, 431, 500, 501, 505), and why; 0 when
 * the bytes are not HTTP at all and no answer would be understood (a TLS handshake): close at
 * once. Bytes that cannot start a request line (a method is 1 to 32 token characters) are
 * refused as they arrive, not when a head that never ends times out. */
int pd_http_parser_error_status(const pd_http_parser *p);
const char *pd_http_parser_error_msg(const pd_http_parser *p);

/* ---- helpers (pure, thread-safe) ----------------------------------------------------------- */

/* The value of the first header named name (case-insensitive), or NULL. */
const char *pd_http_header_get(const pd_http_request *m, const char *name);
/* True when a comma-separated header list (every field named name) contains token,
 * case-insensitively: pd_http_header_has_token(m, "Connection", "close"). */
bool pd_http_header_has_token(const pd_http_request *m, const char *name, const char *token);

/* Percent-decodes in[0, n) into out (capacity cap, NUL-terminated); '+' becomes a space when
 * plus_is_space (query strings). *out_len (may be NULL) gets the decoded length. PD_EFORMAT on a
 * bad escape ("%G1", a truncated "%4"), PD_ERANGE if out is too small (len + NUL). */
pd_status pd_http_percent_decode(const char *in, size_t n, char *out, size_t cap,
                                 size_t *out_len, bool plus_is_space);
/* Looks name up in a query string "a=1&b=x%20y" (names are compared after decoding; "a" and
 * "a=" both give ""), decoding the first match into out. PD_ENOTFOUND if absent; PD_EFORMAT /
 * PD_ERANGE as pd_http_percent_decode. */
pd_status pd_http_query_get(const char *query, const char *name, char *out, size_t cap,
                            size_t *out_len);

/* The reason phrase of a status code ("Not Found"); "Unknown" for an unlisted code. */
const char *pd_http_reason(int status);
/* The OpenAI error type for a status: 400-499 "invalid_request_error" except 401
 * "authentication_error", 403 "permission_error", 404 "not_found_error", 429
 * "rate_limit_error"; everything else "server_error". */
const char *pd_http_error_type(int status);
/* The OpenAI-style error body {"error":{"message":..,"type":..,"param":..,"code":..}}
 * (malloc'ed, NUL-terminated; free() it), with type NULL -> "server_error", and code or param
 * NULL (or "" for param) -> null. NULL on allocation failure. */
char *pd_http_error_json(const char *message, const char *type, const char *code,
                         const char *param);

#ifdef __cplusplus
}
#endif
#endif
