/* HTTP/1.1 server: listener, per-connection state machine, responses. See http.h and
 * docs/http.md.
 *
 * Connection states
 *   IDLE      waiting for the first byte of a request (deadline: header timeout for the first
 *             request of a connection, counted from accept; idle timeout afterwards)
 *   HEAD      request head arriving (header timeout, counted from its first byte)
 *   BODY      body arriving (body timeout, from the end of the head)
 *   HANDLING  request handed to on_request; no reading (pipelined bytes wait in the kernel),
 *             only EPOLLRDHUP to notice a client that leaves; response bytes flow as written
 *   DRAIN     response ended; flushing; then IDLE (keep-alive) or LINGER (close)
 *   LINGER    our side shut down; the client's remaining input is read and discarded until it
 *             closes or linger_ms passes, so that it reads our last response rather than a RST
 * Every state change happens in conn_drive(), called from the connection's fd events, its timer
 * and "kicks" (a zero-delay server timer that drives connections whose response a handler
 * changed from outside conn_drive). Response calls only queue bytes, try a non-blocking send
 * and set flags, so a handler is never re-entered and a connection is never freed under it.
 *
 * A full table (the idle-connection flood). Connections in IDLE or HEAD have no request in
 * progress: they are "evictable", kept in a list oldest first (by when they became so: accept,
 * or the end of their last response) and in one such list per peer address. A new connection
 * over max_connections_per_ip takes the place of its address's oldest evictable one (refused
 * when there is none); one over max_connections takes the place of the oldest evictable one
 * overall (nginx reuses idle keep-alive connections the same way); only when nothing is
 * evictable does accepting pause. Above busy_percent of the table (and until it is back at half
 * of that), evictable connections get busy_timeout_ms instead of the header and idle timeouts:
 * one sweep timer, armed for the oldest, closes them in order. So idle and slow clients cannot
 * keep out /health or a real request. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "http_internal.h"
#include "pd/map.h"

#define READ_CHUNK 65536       /* bytes read per recv */
#define DRIVE_BUDGET 16        /* requests / reads per conn_drive before yielding to others */
#define ACCEPT_BATCH 64        /* accepts per listener event */
#define ACCEPT_RETRY_MS 100    /* pause after EMFILE / ENFILE / ENOBUFS */
#define OUT_KEEP_CAP (256 << 10) /* an emptied output buffer above this is released */
#define PEER_MAX 64

typedef enum { CS_IDLE, CS_HEAD, CS_BODY, CS_HANDLING, CS_DRAIN, CS_LINGER } conn_state;
typedef enum { TK_NONE, TK_HEADER, TK_BODY, TK_IDLE, TK_SEND, TK_LINGER } timer_kind;
typedef enum { R_NONE, R_STREAM, R_DONE } resp_state;
typedef enum { F_LENGTH, F_CHUNKED, F_CLOSE } framing;

typedef struct conn conn;

/* The open connections of one peer address (the key of the server's per-address map). */
typedef struct peer_ip {
  uint32_t n;            /* open connections */
  conn *ev_head, *ev_tail; /* its evictable ones, oldest first */
  char key[INET6_ADDRSTRLEN];
} peer_ip;

struct pd_http_req {
  atomic_int refs;
  pd_http_request msg;
  char *head, *body; /* owned storage msg points into */
  pd_http_header *hdrs;
  conn *c; /* NULL once detached (response ended, client gone, server freed) */
  uint64_t id;
  resp_state rstate;
  bool head_only; /* HEAD request: no body bytes are sent */
  bool chunked;   /* the stream uses chunked framing */
  pd_http_cancel_fn cancel_fn;
  void *cancel_ud;
  char peer[PEER_MAX];
};

struct conn {
  pd_http_server *srv;
  int fd;
  conn_state state;
  pd_http_parser *parser;
  char *pend; /* input read but not yet parsed (pipelined bytes), pend[pend_off, pend_len) */
  size_t pend_off, pend_len;
  char *out; /* queued output, out[out_off, out_len) */
  size_t out_off, out_len, out_cap;
  pd_http_req *req;  /* the request being handled (state HANDLING) */
  bool close_after;  /* close once the current response is out */
  bool failed;       /* a response call failed (send error, overflow, ENOMEM): close */
  bool fail_slow;    /* ... because of max_output_bytes */
  bool driving;      /* inside conn_drive (response calls must not kick) */
  bool kicked;
  bool first_request;
  unsigned interest;
  uint64_t timer_id, timer_at, deadline; /* monotonic ms; timer_at: when the armed timer fires */
  timer_kind tkind;
  conn *prev, *next;   /* server's list */
  conn *kprev, *knext; /* server's kick list */
  /* no request in progress (IDLE, HEAD): in the server's and its address's evictable lists */
  bool evictable;
  uint64_t idle_since; /* monotonic ms: when it became evictable */
  conn *eprev, *enext; /* server's evictable list */
  conn *iprev, *inext; /* its address's evictable list */
  peer_ip *ip;
  char peer[PEER_MAX];
};

struct pd_http_server {
  pd_evloop *loop;
  pd_http_config cfg;
  char *host;
  int lfd, port;
  bool accept_paused;
  uint64_t accept_timer;
  conn *conns;
  size_t nconns;
  conn *kick_head, *kick_tail;
  size_t nkick;
  uint64_t kick_timer;
  conn *ev_head, *ev_tail; /* evictable connections, oldest first */
  pd_map ips;              /* peer address -> peer_ip */
  uint64_t busy_timer;     /* the sweep of the busy table */
  bool busy;               /* see table_busy */
  uint64_t next_req_id;
  bool freeing;
  pd_http_stats st;
  time_t date_t;
  char date[40];
  char scratch[READ_CHUNK];
};

static void conn_drive(conn *c);
static void conn_close(conn *c);

/* ---- config ------------------------------------------------------------------------------ */

void pd_http_config_default(pd_http_config *c) {
  memset(c, 0, sizeof *c);
  c->host = "0.0.0.0";
  c->port = 8000;
  c->backlog = 511;
  c->max_connections = 4096;
  c->max_connections_per_ip = 1024;
  c->busy_percent = 75;
  c->busy_timeout_ms = 2000;
  c->limits.max_head_bytes = 16 << 10;
  c->limits.max_headers = 100;
  c->limits.max_body_bytes = 8 << 20;
  c->max_output_bytes = 4 << 20;
  c->header_timeout_ms = 30000;
  c->body_timeout_ms = 60000;
  c->idle_timeout_ms = 60000;
  c->send_timeout_ms = 60000;
  c->linger_ms = 2000;
}

/* ---- timers ------------------------------------------------------------------------------ */

static void conn_on_timer(pd_evloop *loop, uint64_t id, void *ud);

static uint32_t kind_ms(const pd_http_server *s, timer_kind k) {
  switch (k) {
    case TK_HEADER: return s->cfg.header_timeout_ms;
    case TK_BODY: return s->cfg.body_timeout_ms;
    case TK_IDLE: return s->cfg.idle_timeout_ms;
    case TK_SEND: return s->cfg.send_timeout_ms;
    case TK_LINGER: return s->cfg.linger_ms;
    default: return 0;
  }
}

/* Sets the connection's deadline to now + the kind's timeout (a timeout of 0: none). The
 * armed heap timer is only replaced when the new deadline is earlier; a later one is picked up
 * when the timer fires, so pushing a deadline forward (send progress) costs nothing. */
static bool conn_set_deadline(conn *c, timer_kind k) {
  uint32_t ms = kind_ms(c->srv, k);
  c->tkind = ms ? k : TK_NONE;
  if (c->tkind == TK_NONE) return true;
  uint64_t now = pd_evloop_now_ms();
  c->deadline = now + ms;
  if (c->timer_id && c->timer_at <= c->deadline) return true;
  if (c->timer_id) pd_evloop_timer_cancel(c->srv->loop, c->timer_id);
  c->timer_id = 0;
  if (pd_evloop_timer_add(c->srv->loop, ms, conn_on_timer, c, &c->timer_id, NULL) != PD_OK)
    return false;
  c->timer_at = c->deadline;
  return true;
}

/* ---- output ------------------------------------------------------------------------------ */

static size_t out_pending(const conn *c) { return c->out_len - c->out_off; }

static bool out_reserve(conn *c, size_t n) {
  if (c->out_off > 0 && c->out_off == c->out_len) c->out_off = c->out_len = 0;
  if (c->out_len + n <= c->out_cap) return true;
  if (c->out_off > 0 && c->out_off >= c->out_len / 2) { /* compact before growing */
    memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
    c->out_len -= c->out_off;
    c->out_off = 0;
    if (c->out_len + n <= c->out_cap) return true;
  }
  size_t cap = c->out_cap ? c->out_cap : 4096;
  while (cap < c->out_len + n) cap *= 2;
  char *o = realloc(c->out, cap);
  if (!o) return false;
  c->out = o;
  c->out_cap = cap;
  return true;
}

static void out_put(conn *c, const void *d, size_t n) {
  memcpy(c->out + c->out_len, d, n);
  c->out_len += n;
}

/* Sends queued output until done or EAGAIN. false on a send error (client gone). */
static bool conn_flush(conn *c) {
  bool progress = false;
  while (c->out_off < c->out_len) {
    ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (n > 0) {
      c->out_off += (size_t)n;
      progress = true;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      return false;
    }
  }
  if (c->out_off == c->out_len) {
    c->out_off = c->out_len = 0;
    if (c->out_cap > OUT_KEEP_CAP) {
      free(c->out);
      c->out = NULL;
      c->out_cap = 0;
    }
  }
  if (progress && c->tkind == TK_SEND) conn_set_deadline(c, TK_SEND);
  return true;
}

/* ---- kicks: drive a connection later, from the loop ---------------------------------------- */

static void on_kicks(pd_evloop *loop, uint64_t id, void *ud) {
  pd_http_server *s = ud;
  s->kick_timer = 0;
  /* Only those queued now: a connection kicked again while driven waits for the next pass. */
  size_t n = s->nkick;
  while (n-- > 0 && s->kick_head) {
    conn *c = s->kick_head;
    s->kick_head = c->knext;
    if (s->kick_head)
      s->kick_head->kprev = NULL;
    else
      s->kick_tail = NULL;
    c->knext = c->kprev = NULL;
    c->kicked = false;
    s->nkick--;
    conn_drive(c);
  }
  if (s->kick_head && !s->kick_timer)
    pd_evloop_timer_add(s->loop, 0, on_kicks, s, &s->kick_timer, NULL);
}

static void conn_kick(conn *c) {
  pd_http_server *s = c->srv;
  if (c->kicked) return;
  c->kicked = true;
  c->kprev = s->kick_tail;
  c->knext = NULL;
  if (s->kick_tail)
    s->kick_tail->knext = c;
  else
    s->kick_head = c;
  s->kick_tail = c;
  s->nkick++;
  /* On failure (ENOMEM) the connection stays queued and goes with the next successful kick;
   * its own timer still bounds how long it can wait. */
  if (!s->kick_timer && !s->freeing)
    pd_evloop_timer_add(s->loop, 0, on_kicks, s, &s->kick_timer, NULL);
}

static void kick_unlink(conn *c) {
  pd_http_server *s = c->srv;
  if (!c->kicked) return;
  if (c->kprev)
    c->kprev->knext = c->knext;
  else
    s->kick_head = c->knext;
  if (c->knext)
    c->knext->kprev = c->kprev;
  else
    s->kick_tail = c->kprev;
  c->kprev = c->knext = NULL;
  c->kicked = false;
  s->nkick--;
}

/* ---- connections without a request in progress (see the file comment) -------------------- */

static void listener_resume(pd_http_server *s);
static void conn_timed_out(conn *c, timer_kind k);
static void busy_arm(pd_http_server *s);

/* Busy from above busy_percent of the table until it is back at half of that: the sweep then
 * drains the idle connections instead of closing one each time the table crosses the mark. */
static bool table_busy(pd_http_server *s) {
  size_t used = s->nconns * 100, mark = (size_t)s->cfg.max_connections * (size_t)s->cfg.busy_percent;
  if (!s->cfg.busy_timeout_ms) return false;
  if (used > mark) s->busy = true;
  else if (used * 2 <= mark) s->busy = false;
  return s->busy;
}

/* Closes, in order, the evictable connections that have waited busy_timeout_ms while the table
 * is busy, and re-arms itself for the next one. */
static void on_busy(pd_evloop *loop, uint64_t id, void *ud) {
  pd_http_server *s = ud;
  s->busy_timer = 0;
  uint64_t now = pd_evloop_now_ms();
  while (s->ev_head && table_busy(s) && s->ev_head->idle_since + s->cfg.busy_timeout_ms <= now) {
    conn *c = s->ev_head;
    if (c->state == CS_IDLE) s->st.timeouts++; /* (a head on its way: counted with its 408) */
    conn_timed_out(c, c->state == CS_HEAD ? TK_HEADER : TK_IDLE); /* leaves the list */
  }
  busy_arm(s);
}

static void busy_arm(pd_http_server *s) {
  if (s->busy_timer || s->freeing || !s->ev_head || !table_busy(s)) return;
  uint64_t now = pd_evloop_now_ms(), due = s->ev_head->idle_since + s->cfg.busy_timeout_ms;
  pd_evloop_timer_add(s->loop, due > now ? due - now : 0, on_busy, s, &s->busy_timer, NULL);
}

static void ev_link(conn *c) {
  pd_http_server *s = c->srv;
  peer_ip *ip = c->ip;
  c->evictable = true;
  c->idle_since = pd_evloop_now_ms();
  c->enext = NULL;
  c->eprev = s->ev_tail;
  if (s->ev_tail) s->ev_tail->enext = c;
  else s->ev_head = c;
  s->ev_tail = c;
  c->inext = NULL;
  c->iprev = ip->ev_tail;
  if (ip->ev_tail) ip->ev_tail->inext = c;
  else ip->ev_head = c;
  ip->ev_tail = c;
}

static void ev_unlink(conn *c) {
  if (!c->evictable) return;
  pd_http_server *s = c->srv;
  peer_ip *ip = c->ip;
  if (c->eprev) c->eprev->enext = c->enext;
  else s->ev_head = c->enext;
  if (c->enext) c->enext->eprev = c->eprev;
  else s->ev_tail = c->eprev;
  if (c->iprev) c->iprev->inext = c->inext;
  else ip->ev_head = c->inext;
  if (c->inext) c->inext->iprev = c->iprev;
  else ip->ev_tail = c->iprev;
  c->eprev = c->enext = c->iprev = c->inext = NULL;
  c->evictable = false;
}

/* Every state change goes through here, so the evictable lists follow the states: IDLE and HEAD
 * are evictable (HEAD keeps the place its IDLE had). A connection that becomes evictable may
 * let a waiting client in. */
static void conn_enter(conn *c, conn_state st) {
  bool ev = st == CS_IDLE || st == CS_HEAD;
  c->state = st;
  if (ev == c->evictable) return;
  if (!ev) {
    ev_unlink(c);
    return;
  }
  ev_link(c);
  if (!c->srv->freeing) {
    listener_resume(c->srv);
    busy_arm(c->srv);
  }
}

/* The open connections of one address: counted in, and out (freed at zero). */
static peer_ip *ip_ref(pd_http_server *s, const char *key) {
  peer_ip *ip = pd_map_ptr(pd_map_cstr_find(&s->ips, key));
  if (!ip) {
    ip = calloc(1, sizeof *ip);
    if (!ip) return NULL;
    snprintf(ip->key, sizeof ip->key, "%s", key);
    if (!pd_map_cstr_put(&s->ips, ip->key, (uintptr_t)ip)) {
      free(ip);
      return NULL;
    }
  }
  ip->n++;
  return ip;
}

static void ip_unref(pd_http_server *s, peer_ip *ip) {
  if (--ip->n > 0) return;
  pd_map_cstr_del(&s->ips, ip->key);
  free(ip);
}

/* ---- response formatting ------------------------------------------------------------------- */

static const char *http_date(pd_http_server *s) {
  static const char *days[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static const char *mons[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                               "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  time_t now = time(NULL);
  if (now != s->date_t) {
    struct tm tm;
    gmtime_r(&now, &tm);
    snprintf(s->date, sizeof s->date, "%s, %02d %s %04d %02d:%02d:%02d GMT", days[tm.tm_wday % 7],
             tm.tm_mday, mons[tm.tm_mon % 12], tm.tm_year + 1900, tm.tm_hour, tm.tm_min,
             tm.tm_sec);
    s->date_t = now;
  }
  return s->date;
}

static bool valid_value(const char *v) {
  for (; *v; v++)
    if (*v == '\r' || *v == '\n') return false;
  return true;
}

static bool valid_name(const char *n) {
  if (!*n) return false;
  for (; *n; n++)
    if (!pdh_is_tchar((unsigned char)*n)) return false;
  return true;
}

static bool is_framing_header(const char *name) {
  size_t n = strlen(name);
  return pdh_eq_nocase(name, n, "content-length") || pdh_eq_nocase(name, n, "transfer-encoding");
}

static bool is_connection_close(const pd_http_header *h) {
  size_t n = strlen(h->name);
  if (!pdh_eq_nocase(h->name, n, "connection")) return false;
  pd_http_header one = *h;
  pd_http_request m = {.headers = &one, .num_headers = 1};
  return pd_http_header_has_token(&m, "connection", "close");
}

static bool status_has_no_body(int status) {
  return (status >= 100 && status < 200) || status == 204 || status == 304;
}

/* The connection of a request that may still be answered, or NULL with the error set. */
static conn *answerable(pd_http_req *r, bool want_stream, pd_status *st, pd_err *e) {
  if (r->rstate == R_DONE) {
    *st = pd_err_set(e, PD_EINVAL, "http: response already ended");
    return NULL;
  }
  if (want_stream != (r->rstate == R_STREAM)) {
    *st = pd_err_set(e, PD_EINVAL, "%s",
                     want_stream ? "http: no stream begun" : "http: response already started");
    return NULL;
  }
  if (!r->c || r->c->failed) {
    *st = pd_err_set(e, PD_EIO, "http: client disconnected");
    return NULL;
  }
  return r->c;
}

/* Queues the status line and header fields. body_len is used for F_LENGTH. */
/* The Access-Control-Allow-Origin value for a response to m (NULL: none): "*" when the
 * configuration allows any origin, else m's Origin when the list holds it exactly. */
static const char *cors_origin(const pd_http_server *s, const pd_http_request *m) {
  const char *list = s->cfg.allowed_origins;
  const char *o = list && *list ? pd_http_header_get(m, "Origin") : NULL;
  if (!o) return NULL;
  size_t ol = strlen(o);
  for (const char *p = list; *p;) {
    while (*p == ',' || *p == ' ') p++;
    const char *end = p;
    while (*end && *end != ',') end++;
    const char *t = end;
    while (t > p && t[-1] == ' ') t--;
    if (t - p == 1 && *p == '*') return "*";
    if ((size_t)(t - p) == ol && !memcmp(p, o, ol)) return o;
    p = end;
  }
  return NULL;
}

static pd_status write_head(conn *c, pd_http_req *r, int status, const char *ctype,
                            const pd_http_header *hdrs, size_t n, framing fr, size_t body_len,
                            pd_err *e) {
  if (status < 200 || status > 999)
    return pd_err_set(e, PD_EINVAL, "http: bad final status %d", status);
  if (ctype && !valid_value(ctype)) return pd_err_set(e, PD_EINVAL, "http: bad Content-Type");
  bool close = c->close_after || fr == F_CLOSE;
  const char *acao = cors_origin(c->srv, &r->msg); /* the parser refused CR/LF in the Origin */
  size_t need = 64 + strlen(pd_http_reason(status)) + 64 + 40 + 48 + 32 + 32;
  if (ctype) need += 16 + strlen(ctype);
  if (acao) need += 64 + strlen(acao);
  for (size_t i = 0; i < n; i++) {
    if (!hdrs[i].name || !hdrs[i].value || !valid_name(hdrs[i].name) || !valid_value(hdrs[i].value))
      return pd_err_set(e, PD_EINVAL, "http: bad response header #%zu", i);
    if (is_connection_close(&hdrs[i])) close = true;
    need += strlen(hdrs[i].name) + strlen(hdrs[i].value) + 4;
  }
  if (!out_reserve(c, need)) return pd_err_set(e, PD_ENOMEM, "http: out of memory");
  char *p = c->out + c->out_len;
  char *start = p;
  p += sprintf(p, "HTTP/1.1 %d %s\r\nDate: %s\r\n", status, pd_http_reason(status),
               http_date(c->srv));
  if (ctype) p += sprintf(p, "Content-Type: %s\r\n", ctype);
  if (acao)
    p += sprintf(p, "Access-Control-Allow-Origin: %s\r\n%s", acao,
                 strcmp(acao, "*") ? "Vary: Origin\r\n" : "");
  for (size_t i = 0; i < n; i++) {
    if (is_framing_header(hdrs[i].name)) continue;
    size_t nl = strlen(hdrs[i].name);
    if (pdh_eq_nocase(hdrs[i].name, nl, "connection")) continue; /* ours below */
    p += sprintf(p, "%s: %s\r\n", hdrs[i].name, hdrs[i].value);
  }
  if (fr == F_LENGTH && !status_has_no_body(status))
    p += sprintf(p, "Content-Length: %zu\r\n", body_len);
  else if (fr == F_CHUNKED)
    p += sprintf(p, "Transfer-Encoding: chunked\r\n");
  if (close)
    p += sprintf(p, "Connection: close\r\n");
  else if (r->msg.version_minor == 0)
    p += sprintf(p, "Connection: keep-alive\r\n");
  p += sprintf(p, "\r\n");
  c->out_len += (size_t)(p - start);
  c->close_after = close;
  return PD_OK;
}

/* After a response call queued bytes or changed state from outside conn_drive: send what the
 * socket takes now and let the loop drive whatever else has to happen. */
static void after_write(conn *c, bool state_changed) {
  if (!c->failed && !conn_flush(c)) c->failed = true;
  if (c->driving) return;
  if (c->failed || state_changed || out_pending(c) > 0) conn_kick(c);
}

pd_status pd_http_respond(pd_http_req *r, int status, const char *content_type,
                          const pd_http_header *headers, size_t n, const void *body, size_t len,
                          pd_err *e) {
  pd_status st = PD_OK;
  conn *c = answerable(r, false, &st, e);
  if (!c) return st;
  if (len > 0 && status_has_no_body(status))
    return pd_err_set(e, PD_EINVAL, "http: status %d has no body", status);
  size_t mark = c->out_len;
  st = write_head(c, r, status, content_type, headers, n, F_LENGTH, len, e);
  if (st != PD_OK) return st;
  if (len > 0 && !r->head_only) {
    if (!out_reserve(c, len)) {
      c->out_len = mark;
      return pd_err_set(e, PD_ENOMEM, "http: out of memory for a %zu-byte body", len);
    }
    out_put(c, body, len);
  }
  r->rstate = R_DONE;
  after_write(c, true);
  return PD_OK;
}

pd_status pd_http_respond_error(pd_http_req *r, int status, const char *message,
                                const char *type, const char *code, pd_err *e) {
  char *json = pd_http_error_json(message, type ? type : pd_http_error_type(status), code, NULL);
  if (!json) return pd_err_set(e, PD_ENOMEM, "http: out of memory");
  pd_status st = pd_http_respond(r, status, "application/json", NULL, 0, json, strlen(json), e);
  free(json);
  return st;
}

pd_status pd_http_stream_begin(pd_http_req *r, int status, const char *content_type,
                               const pd_http_header *headers, size_t n, pd_err *e) {
  pd_status st = PD_OK;
  conn *c = answerable(r, false, &st, e);
  if (!c) return st;
  if (status_has_no_body(status))
    return pd_err_set(e, PD_EINVAL, "http: status %d cannot be streamed", status);
  framing fr = r->msg.version_minor >= 1 ? F_CHUNKED : F_CLOSE;
  st = write_head(c, r, status, content_type, headers, n, fr, 0, e);
  if (st != PD_OK) return st;
  r->chunked = fr == F_CHUNKED;
  r->rstate = R_STREAM;
  after_write(c, false);
  return PD_OK;
}

pd_status pd_http_sse_begin(pd_http_req *r, const pd_http_header *headers, size_t n,
                            pd_err *e) {
  pd_http_header h[32];
  if (n > 30) return pd_err_set(e, PD_EINVAL, "http: too many SSE headers");
  h[0] = (pd_http_header){"Cache-Control", "no-cache"};
  h[1] = (pd_http_header){"X-Accel-Buffering", "no"};
  for (size_t i = 0; i < n; i++) h[2 + i] = headers[i];
  return pd_http_stream_begin(r, 200, "text/event-stream", h, n + 2, e);
}

/* Queues one chunk made of parts[0..np) (total len bytes). */
static pd_status stream_put(pd_http_req *r, const void *const *parts, const size_t *lens,
                            size_t np, pd_err *e) {
  pd_status st = PD_OK;
  conn *c = answerable(r, true, &st, e);
  if (!c) return st;
  size_t len = 0;
  for (size_t i = 0; i < np; i++) len += lens[i];
  if (len == 0 || r->head_only) return PD_OK;
  if (!out_reserve(c, len + 24)) {
    c->failed = true;
    after_write(c, false);
    return pd_err_set(e, PD_ENOMEM, "http: out of memory");
  }
  if (r->chunked) c->out_len += (size_t)sprintf(c->out + c->out_len, "%zx\r\n", len);
  for (size_t i = 0; i < np; i++) out_put(c, parts[i], lens[i]);
  if (r->chunked) out_put(c, "\r\n", 2);
  after_write(c, false);
  if (!c->failed && out_pending(c) > c->srv->cfg.max_output_bytes) {
    /* A reader this slow would make us buffer without bound: drop it. */
    c->failed = true;
    c->fail_slow = true;
    if (!c->driving) conn_kick(c);
  }
  if (c->failed) return pd_err_set(e, PD_EIO, "http: client disconnected or too slow");
  return PD_OK;
}

pd_status pd_http_stream_write(pd_http_req *r, const void *data, size_t len, pd_err *e) {
  const void *parts[1] = {data};
  size_t lens[1] = {len};
  return stream_put(r, parts, lens, 1, e);
}

pd_status pd_http_sse_event(pd_http_req *r, const char *event, const char *data, pd_err *e) {
  if (event && !valid_value(event)) return pd_err_set(e, PD_EINVAL, "http: bad SSE event name");
  if (!data) data = "";
  /* "data: " per line plus "\n": at most 7 bytes per input byte's line break, 7 more fixed. */
  size_t dl = strlen(data), lines = 1;
  for (size_t i = 0; i < dl; i++)
    if (data[i] == '\n' || (data[i] == '\r' && data[i + 1] != '\n')) lines++;
  size_t cap = (event ? 8 + strlen(event) : 0) + dl + 7 * lines + 2;
  char stackbuf[1024];
  char *buf = cap <= sizeof stackbuf ? stackbuf : malloc(cap);
  if (!buf) return pd_err_set(e, PD_ENOMEM, "http: out of memory");
  size_t o = 0;
  if (event) o += (size_t)sprintf(buf, "event: %s\n", event);
  const char *p = data;
  for (;;) {
    size_t l = strcspn(p, "\r\n");
    memcpy(buf + o, "data: ", 6);
    o += 6;
    memcpy(buf + o, p, l);
    o += l;
    buf[o++] = '\n';
    p += l;
    if (!*p) break;
    p += (p[0] == '\r' && p[1] == '\n') ? 2 : 1;
  }
  buf[o++] = '\n';
  PD_ASSERT(o <= cap);
  const void *parts[1] = {buf};
  size_t lens[1] = {o};
  pd_status st = stream_put(r, parts, lens, 1, e);
  if (buf != stackbuf) free(buf);
  return st;
}

pd_status pd_http_stream_end(pd_http_req *r, pd_err *e) {
  pd_status st = PD_OK;
  conn *c = answerable(r, true, &st, e);
  if (!c) return st;
  if (r->chunked && !r->head_only) {
    if (!out_reserve(c, 5)) {
      c->failed = true;
      after_write(c, false);
      return pd_err_set(e, PD_ENOMEM, "http: out of memory");
    }
    out_put(c, "0\r\n\r\n", 5);
  }
  r->rstate = R_DONE;
  after_write(c, true);
  return PD_OK;
}

/* ---- request handles ------------------------------------------------------------------------ */

pd_http_req *pd_http_req_ref(pd_http_req *r) {
  atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
  return r;
}

void pd_http_req_unref(pd_http_req *r) {
  if (!r) return;
  if (atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) != 1) return;
  free(r->head);
  free(r->hdrs);
  free(r->body);
  free(r);
}

const pd_http_request *pd_http_req_msg(const pd_http_req *r) { return &r->msg; }
uint64_t pd_http_req_id(const pd_http_req *r) { return r->id; }
const char *pd_http_req_peer(const pd_http_req *r) { return r->peer; }

pd_status pd_http_req_on_cancel(pd_http_req *r, pd_http_cancel_fn fn, void *ud) {
  if (fn && !r->c && r->rstate != R_DONE) return PD_EIO;
  r->cancel_fn = fn;
  r->cancel_ud = ud;
  return PD_OK;
}

bool pd_http_req_connected(const pd_http_req *r) {
  return r->c && !r->c->failed && r->rstate != R_DONE;
}

size_t pd_http_req_pending_output(const pd_http_req *r) { return r->c ? out_pending(r->c) : 0; }

/* ---- connections -------------------------------------------------------------------------- */

/* Closes the socket and frees the connection; an unanswered request is detached and its
 * cancel callback runs (after the connection is gone from the loop). */
static void conn_close(conn *c) {
  pd_http_server *s = c->srv;
  kick_unlink(c);
  ev_unlink(c);
  ip_unref(s, c->ip);
  if (c->timer_id) pd_evloop_timer_cancel(s->loop, c->timer_id);
  pd_evloop_del_fd(s->loop, c->fd);
  close(c->fd);
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  s->nconns--;
  s->st.connections_open = s->nconns;
  if (c->fail_slow) s->st.dropped_slow++;

  pd_http_req *r = c->req;
  c->req = NULL;
  if (r) {
    r->c = NULL;
    if (r->rstate != R_DONE && r->cancel_fn) {
      pd_http_cancel_fn fn = r->cancel_fn;
      r->cancel_fn = NULL;
      s->st.cancelled++;
      fn(r, r->cancel_ud);
    }
    pd_http_req_unref(r);
  }
  pd_http_parser_free(c->parser);
  free(c->pend);
  free(c->out);
  free(c);
  if (!s->freeing) listener_resume(s);
}

static void conn_on_timer(pd_evloop *loop, uint64_t id, void *ud) {
  conn *c = ud;
  c->timer_id = 0;
  if (c->tkind == TK_NONE) return;
  uint64_t now = pd_evloop_now_ms();
  if (now < c->deadline) { /* pushed forward since armed */
    if (pd_evloop_timer_add(loop, c->deadline - now, conn_on_timer, c, &c->timer_id, NULL) ==
        PD_OK) {
      c->timer_at = c->deadline;
      return;
    }
  }
  conn_timed_out(c, c->tkind);
}

/* A timeout of kind k ran out: a 408 when a request was on its way, else the connection
 * closes. */
static void conn_timed_out(conn *c, timer_kind k) {
  pd_http_server *s = c->srv;
  switch (k) {
    case TK_HEADER:
    case TK_BODY:
      if (c->state == CS_HEAD || c->state == CS_BODY) {
        /* A request was on its way: tell the client why it is cut off. */
        s->st.timeouts++;
        s->st.responses_error++;
        char *json = pd_http_error_json(c->state == CS_HEAD ? "timed out reading the request head"
                                                            : "timed out reading the request body",
                                        pd_http_error_type(408), NULL, NULL);
        if (!json) break;
        pd_http_req fake = {.msg.version_minor = 1};
        c->close_after = true;
        size_t mark = c->out_len;
        if (write_head(c, &fake, 408, "application/json", NULL, 0, F_LENGTH, strlen(json), NULL) !=
                PD_OK ||
            !out_reserve(c, strlen(json))) {
          c->out_len = mark;
          free(json);
          break;
        }
        out_put(c, json, strlen(json));
        free(json);
        conn_enter(c, CS_DRAIN);
        if (!conn_set_deadline(c, TK_SEND)) break;
        conn_drive(c);
        return;
      }
      break; /* never started (first request of the connection): close silently */
    case TK_SEND:
      s->st.timeouts++;
      break;
    default: /* TK_IDLE, TK_LINGER */
      break;
  }
  conn_close(c);
}

/* Queues a server-generated error response and switches to DRAIN with close. */
static void conn_error(conn *c, int status, const char *msg) {
  c->srv->st.responses_error++;
  c->close_after = true;
  c->pend_off = c->pend_len = 0; /* whatever follows a malformed request is not parsed */
  char *json = pd_http_error_json(msg, pd_http_error_type(status), NULL, NULL);
  pd_http_req fake = {.msg.version_minor = 1};
  size_t len = json ? strlen(json) : 0;
  if (write_head(c, &fake, status, json ? "application/json" : NULL, NULL, 0, F_LENGTH, len,
                 NULL) != PD_OK ||
      !out_reserve(c, len)) {
    c->failed = true;
  } else if (len) {
    out_put(c, json, len);
  }
  free(json);
  conn_enter(c, CS_DRAIN);
  if (!conn_set_deadline(c, TK_SEND)) c->failed = true;
}

/* A CORS preflight (OPTIONS with Origin and Access-Control-Request-Method, CORS on) answered
 * here, before any handler or API key check, as Starlette's CORSMiddleware does: 200 "OK"
 * allowing our methods and the headers asked for, or 400 naming what is not allowed. The
 * allowed origin itself goes out from write_head. */
static bool cors_preflight(pd_http_server *s, pd_http_req *r) {
  const pd_http_request *m = &r->msg;
  const char *method = pd_http_header_get(m, "Access-Control-Request-Method");
  if (!s->cfg.allowed_origins || !*s->cfg.allowed_origins || strcmp(m->method, "OPTIONS") ||
      !method || !pd_http_header_get(m, "Origin"))
    return false;
  bool origin_ok = cors_origin(s, m) != NULL;
  bool method_ok = !strcmp(method, "GET") || !strcmp(method, "HEAD") ||
                   !strcmp(method, "POST") || !strcmp(method, "OPTIONS");
  if (!origin_ok || !method_ok) {
    char msg[64];
    snprintf(msg, sizeof msg, "Disallowed CORS %s%s%s", origin_ok ? "" : "origin",
             !origin_ok && !method_ok ? ", " : "", method_ok ? "" : "method");
    pd_http_respond(r, 400, "text/plain; charset=utf-8", NULL, 0, msg, strlen(msg), NULL);
    return true;
  }
  const char *want = pd_http_header_get(m, "Access-Control-Request-Headers");
  pd_http_header h[3] = {{"Access-Control-Allow-Methods", "GET, HEAD, OPTIONS, POST"},
                         {"Access-Control-Max-Age", "600"},
                         {"Access-Control-Allow-Headers", want ? want : ""}};
  pd_http_respond(r, 200, "text/plain; charset=utf-8", h, want ? 3 : 2, "OK", 2, NULL);
  return true;
}

/* Hands the parsed request to the handler (or answers a CORS preflight). */
static void conn_dispatch(conn *c) {
  pd_http_server *s = c->srv;
  pd_http_req *r = calloc(1, sizeof *r);
  if (!r) {
    conn_error(c, 503, "out of memory");
    return;
  }
  atomic_init(&r->refs, 1);
  pdh_parser_take(c->parser, &r->head, &r->hdrs, &r->body, &r->msg);
  r->id = ++s->next_req_id;
  r->head_only = strcmp(r->msg.method, "HEAD") == 0;
  memcpy(r->peer, c->peer, sizeof r->peer);
  r->c = c;
  c->req = r;
  conn_enter(c, CS_HANDLING);
  if (!r->msg.keep_alive) c->close_after = true;
  c->tkind = TK_NONE;
  s->st.requests_total++;
  if (cors_preflight(s, r)) return;
  s->cfg.on_request(r, &r->msg, s->cfg.ud);
}

/* Keeps leftover input (pipelined bytes) for the next parse. */
static bool keep_pending(conn *c, const char *d, size_t n, bool from_pend, size_t used) {
  if (from_pend) {
    c->pend_off += used;
    if (c->pend_off == c->pend_len) {
      free(c->pend);
      c->pend = NULL;
      c->pend_off = c->pend_len = 0;
    }
    return true;
  }
  if (used == n) return true;
  char *p = malloc(n - used);
  if (!p) return false;
  memcpy(p, d + used, n - used);
  free(c->pend);
  c->pend = p;
  c->pend_off = 0;
  c->pend_len = n - used;
  return true;
}

static unsigned conn_want(const conn *c) {
  unsigned w = out_pending(c) ? PD_EV_WRITE : 0;
  switch (c->state) {
    case CS_IDLE:
    case CS_HEAD:
    case CS_BODY:
    case CS_LINGER: return w | PD_EV_READ;
    case CS_HANDLING: return w | PD_EV_RDHUP;
    default: return w;
  }
}

/* The state machine. May close (and free) c: callers must not touch c afterwards. */
static void conn_drive(conn *c) {
  pd_http_server *s = c->srv;
  int budget = DRIVE_BUDGET;
  c->driving = true;
  for (;;) {
    if (c->failed) goto close;
    if (out_pending(c) && !conn_flush(c)) goto close;
    bool pending = out_pending(c) > 0;

    if (c->state == CS_HANDLING) {
      if (c->req->rstate != R_DONE) {
        /* The handler is at work; only a send stall is timed. */
        if (pending && c->tkind != TK_SEND && !conn_set_deadline(c, TK_SEND)) goto close;
        if (!pending) c->tkind = TK_NONE;
        goto out;
      }
      pd_http_req *r = c->req;
      c->req = NULL;
      r->c = NULL;
      pd_http_req_unref(r);
      conn_enter(c, CS_DRAIN);
      if (!conn_set_deadline(c, TK_SEND)) goto close;
      continue;
    }
    if (c->state == CS_DRAIN) {
      if (pending) goto out;
      if (c->close_after) {
        /* Half-close and drain, so the client reads this response rather than a reset. */
        if (shutdown(c->fd, SHUT_WR) < 0) goto close;
        conn_enter(c, CS_LINGER);
        if (!conn_set_deadline(c, TK_LINGER)) goto close;
        continue;
      }
      conn_enter(c, CS_IDLE);
      c->first_request = false;
      if (!conn_set_deadline(c, TK_IDLE)) goto close;
      if (--budget <= 0) {
        conn_kick(c);
        goto out;
      }
      continue;
    }
    if (c->state == CS_LINGER) {
      ssize_t n = recv(c->fd, s->scratch, sizeof s->scratch, 0);
      if (n > 0) {
        if (--budget <= 0) {
          conn_kick(c);
          goto out;
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) goto out;
      goto close; /* EOF or error: done */
    }

    /* IDLE / HEAD / BODY: parse pending input, else read. */
    const char *d;
    size_t n;
    bool from_pend = c->pend_len > c->pend_off;
    if (from_pend) {
      d = c->pend + c->pend_off;
      n = c->pend_len - c->pend_off;
    } else {
      if (--budget <= 0) {
        conn_kick(c);
        goto out;
      }
      ssize_t r = recv(c->fd, s->scratch, sizeof s->scratch, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) goto out;
      if (r <= 0) goto close; /* EOF (between or inside requests) or error */
      d = s->scratch;
      n = (size_t)r;
    }
    size_t used = 0;
    pd_http_parse_result res = pd_http_parser_feed(c->parser, d, n, &used);
    if (!keep_pending(c, d, n, from_pend, used)) goto close;
    if (c->state == CS_IDLE && pd_http_parser_started(c->parser)) {
      conn_enter(c, CS_HEAD);
      /* The first request's head deadline runs from accept; later ones from their first byte. */
      if (!c->first_request && !conn_set_deadline(c, TK_HEADER)) goto close;
    }
    switch (res) {
      case PD_HTTP_PARSE_MORE:
        break;
      case PD_HTTP_PARSE_HEAD:
        conn_enter(c, CS_BODY);
        if (!conn_set_deadline(c, TK_BODY)) goto close;
        if (pd_http_parser_request(c->parser)->expect_continue && c->pend_len == c->pend_off) {
          static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
          if (!out_reserve(c, sizeof cont - 1)) goto close;
          out_put(c, cont, sizeof cont - 1);
        }
        break;
      case PD_HTTP_PARSE_DONE:
        conn_dispatch(c);
        break;
      case PD_HTTP_PARSE_ERROR:
        if (!pd_http_parser_error_status(c->parser)) { /* not HTTP: no answer would be read */
          s->st.responses_error++;
          goto close;
        }
        conn_error(c, pd_http_parser_error_status(c->parser), pd_http_parser_error_msg(c->parser));
        break;
    }
  }
out:
  c->driving = false;
  if (c->failed) { /* a response call failed after the last check (inside on_request) */
    conn_close(c);
    return;
  }
  {
    unsigned want = conn_want(c);
    if (want != c->interest) {
      if (pd_evloop_mod_fd(s->loop, c->fd, want, NULL) != PD_OK) {
        conn_close(c);
        return;
      }
      c->interest = want;
    }
  }
  return;
close:
  c->driving = false;
  conn_close(c);
}

static void conn_on_event(pd_evloop *loop, int fd, unsigned ev, void *ud) {
  conn *c = ud;
  if (ev & (PD_EV_ERR | PD_EV_HUP)) {
    conn_close(c);
    return;
  }
  if ((ev & PD_EV_RDHUP) && c->state == CS_HANDLING) {
    /* The client left (or half-closed) while its request was being handled. */
    conn_close(c);
    return;
  }
  conn_drive(c);
}

/* The peer's address alone ("127.0.0.1", "::1": the per-address key) and with its port
 * ("127.0.0.1:50312", "[::1]:5000": for logs). */
static void peer_addr(const struct sockaddr_storage *ss, char *ip, size_t ip_cap, char *out,
                      size_t cap) {
  snprintf(ip, ip_cap, "?");
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, ip, (socklen_t)ip_cap);
    snprintf(out, cap, "%s:%u", ip, (unsigned)ntohs(a->sin_port));
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, ip, (socklen_t)ip_cap);
    snprintf(out, cap, "[%s]:%u", ip, (unsigned)ntohs(a->sin6_port));
  } else {
    snprintf(ip, ip_cap, "unix");
    snprintf(out, cap, "unix");
  }
}

static void conn_new(pd_http_server *s, int fd, const char *ip, const char *peer) {
  conn *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    return;
  }
  c->srv = s;
  c->fd = fd;
  c->first_request = true;
  c->parser = pd_http_parser_new(&s->cfg.limits, NULL);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* SSE tokens go out at once */
  snprintf(c->peer, sizeof c->peer, "%s", peer);
  if (!c->parser || !(c->ip = ip_ref(s, ip)) ||
      pd_evloop_add_fd(s->loop, fd, PD_EV_READ, conn_on_event, c, NULL) != PD_OK) {
    if (c->ip) ip_unref(s, c->ip);
    pd_http_parser_free(c->parser);
    free(c);
    close(fd);
    return;
  }
  c->interest = PD_EV_READ;
  c->next = s->conns;
  if (s->conns) s->conns->prev = c;
  s->conns = c;
  s->nconns++;
  s->st.connections_total++;
  s->st.connections_open = s->nconns;
  conn_enter(c, CS_IDLE);
  if (!conn_set_deadline(c, TK_HEADER)) conn_close(c);
}

/* An address over its limit with nothing to give up: a best-effort 503 (one non-blocking send
 * into an empty socket buffer) and close; no table slot is taken. */
static void conn_refuse(pd_http_server *s, int fd) {
  static const char body[] = "{\"error\":{\"message\":\"too many connections from this address\","
                             "\"type\":\"server_error\",\"param\":null,\"code\":null}}";
  char resp[512];
  int n = snprintf(resp, sizeof resp,
                   "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                   "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                   sizeof body - 1, body);
  ssize_t w = send(fd, resp, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)w;
  close(fd);
  s->st.refused++;
  s->st.responses_error++;
}

/* Admits an accepted socket, making room first (see the file comment). */
static void conn_admit(pd_http_server *s, int fd, const struct sockaddr_storage *ss) {
  char ip[INET6_ADDRSTRLEN], peer[PEER_MAX];
  peer_addr(ss, ip, sizeof ip, peer, sizeof peer);
  int per_ip = s->cfg.max_connections_per_ip;
  peer_ip *pi = per_ip > 0 ? pd_map_ptr(pd_map_cstr_find(&s->ips, ip)) : NULL;
  if (pi && pi->n >= (uint32_t)per_ip) {
    if (!pi->ev_head) {
      conn_refuse(s, fd);
      return;
    }
    s->st.evicted++;
    conn_close(pi->ev_head); /* may free pi */
  }
  if (s->nconns >= (size_t)s->cfg.max_connections) {
    if (!s->ev_head) { /* on_accept checks before accepting: not reached */
      conn_refuse(s, fd);
      return;
    }
    s->st.evicted++;
    conn_close(s->ev_head);
  }
  conn_new(s, fd, ip, peer);
}

/* ---- listener ------------------------------------------------------------------------------- */

static void listener_pause(pd_http_server *s) {
  if (s->accept_paused) return;
  if (pd_evloop_mod_fd(s->loop, s->lfd, 0, NULL) == PD_OK) s->accept_paused = true;
}

static void listener_resume(pd_http_server *s) {
  if (!s->accept_paused || s->accept_timer ||
      (s->nconns >= (size_t)s->cfg.max_connections && !s->ev_head))
    return;
  if (pd_evloop_mod_fd(s->loop, s->lfd, PD_EV_READ, NULL) == PD_OK) s->accept_paused = false;
}

static void on_accept_retry(pd_evloop *loop, uint64_t id, void *ud) {
  pd_http_server *s = ud;
  s->accept_timer = 0;
  listener_resume(s);
}

static void on_accept(pd_evloop *loop, int fd, unsigned ev, void *ud) {
  pd_http_server *s = ud;
  for (int i = 0; i < ACCEPT_BATCH; i++) {
    if (s->nconns >= (size_t)s->cfg.max_connections && !s->ev_head) {
      /* Every connection has a request in progress: leave further clients in the kernel's
       * backlog until one closes or becomes evictable. */
      listener_pause(s);
      return;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int cfd = accept4(s->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (cfd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        /* Level-triggered: retrying at once would spin. Back off. */
        listener_pause(s);
        if (!s->accept_timer)
          pd_evloop_timer_add(loop, ACCEPT_RETRY_MS, on_accept_retry, s, &s->accept_timer, NULL);
      }
      return; /* EAGAIN: drained */
    }
    conn_admit(s, cfd, &ss);
  }
}

pd_http_server *pd_http_server_new(pd_evloop *loop, const pd_http_config *cfg, pd_err *e) {
  if (!loop || !cfg || !cfg->on_request) {
    pd_err_set(e, PD_EINVAL, "http: a loop and an on_request handler are required");
    return NULL;
  }
  if (cfg->port < 0 || cfg->port > 65535 || cfg->max_connections < 1 ||
      cfg->max_output_bytes < 1 || cfg->backlog < 1 || cfg->max_connections_per_ip < 0 ||
      cfg->busy_percent < 1 || cfg->busy_percent > 100) {
    pd_err_set(e, PD_EINVAL, "http: bad config (port %d, max_connections %d, backlog %d)",
               cfg->port, cfg->max_connections, cfg->backlog);
    return NULL;
  }
  pd_http_parser *probe = pd_http_parser_new(&cfg->limits, e); /* validates the limits */
  if (!probe) return NULL;
  pd_http_parser_free(probe);

  pd_http_server *s = calloc(1, sizeof *s);
  if (!s) {
    pd_err_set(e, PD_ENOMEM, "http: out of memory");
    return NULL;
  }
  s->loop = loop;
  s->cfg = *cfg;
  s->lfd = -1;
  pd_map_init(&s->ips, 0, PD_MAP_COPY_KEYS);
  s->host = strdup(cfg->host ? cfg->host : "0.0.0.0");
  if (!s->host) {
    pd_err_set(e, PD_ENOMEM, "http: out of memory");
    free(s);
    return NULL;
  }
  s->cfg.host = s->host;

  char portstr[16];
  snprintf(portstr, sizeof portstr, "%d", cfg->port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE}, *res = NULL;
  int gai = getaddrinfo(s->host, portstr, &hints, &res);
  if (gai != 0) {
    pd_err_set(e, PD_EINVAL, "http: cannot resolve bind address '%s': %s", s->host,
               gai_strerror(gai));
    free(s->host);
    free(s);
    return NULL;
  }
  int err = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, cfg->backlog) == 0) {
      s->lfd = fd;
      break;
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(res);
  if (s->lfd < 0) {
    pd_err_set(e, PD_EIO, "http: cannot listen on %s:%d: %s", s->host, cfg->port, strerror(err));
    free(s->host);
    free(s);
    return NULL;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(s->lfd, (struct sockaddr *)&ss, &sl) == 0)
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
  if (pd_evloop_add_fd(loop, s->lfd, PD_EV_READ, on_accept, s, e) != PD_OK) {
    close(s->lfd);
    free(s->host);
    free(s);
    return NULL;
  }
  return s;
}

void pd_http_server_free(pd_http_server *s) {
  if (!s) return;
  s->freeing = true;
  pd_evloop_del_fd(s->loop, s->lfd);
  close(s->lfd);
  if (s->accept_timer) pd_evloop_timer_cancel(s->loop, s->accept_timer);
  if (s->kick_timer) pd_evloop_timer_cancel(s->loop, s->kick_timer);
  if (s->busy_timer) pd_evloop_timer_cancel(s->loop, s->busy_timer);
  s->kick_timer = s->busy_timer = 0;
  /* Cancel callbacks may answer other requests meanwhile: their kicks are not scheduled
   * (freeing) and their connections are closed in turn. */
  while (s->conns) conn_close(s->conns);
  pd_map_free(&s->ips); /* empty by now */
  free(s->host);
  free(s);
}

int pd_http_server_port(const pd_http_server *s) { return s->port; }

void pd_http_server_stats(const pd_http_server *s, pd_http_stats *out) { *out = s->st; }
