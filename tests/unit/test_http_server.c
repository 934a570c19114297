/* HTTP server over real sockets on 127.0.0.1 (ephemeral ports), the loop in its own thread,
 * every client socket with 5 s send/receive timeouts:
 * GET, POST echo, keep-alive, pipelining (with an asynchronous response in the middle),
 * chunked request bodies, 413 / 431 / 400 / 505, Expect: 100-continue, HEAD, HTTP/1.0
 * (close and keep-alive), header / body / idle timeouts (slow-loris cut off), an answer from
 * another thread, an SSE stream read while it is produced, a client leaving mid-stream (cancel
 * callback), a slow reader dropped at the output cap while another client is served, 200
 * concurrent connections, max_connections, a late answer after a disconnect (safe no-op), and
 * server free with a request still held, clients vanishing under a large response. A full
 * table: idle connections and one sending its head are evicted oldest first to admit new ones,
 * connections with a request in progress never are (the newcomer waits in the backlog until one
 * becomes idle); max_connections_per_ip evicts an address's own oldest idle connection or refuses
 * with 503, other addresses unaffected; above busy_percent the busy timeout closes idle
 * connections (408 for a head on its way) and stops once the table is below it again. The test
 * keeps SIGPIPE at its default action, so a server send that raised it would kill the test. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "http.h"
#include "pd_test.h"

/* ---- server fixture ---- */

typedef struct tsrv {
  pd_evloop *loop;
  pd_http_server *srv;
  pthread_t th;
  int port;
} tsrv;

static void *loop_main(void *arg) {
  tsrv *t = arg;
  pd_err e = {0};
  if (pd_evloop_run(t->loop, &e) != PD_OK) fprintf(stderr, "loop: %s\n", e.msg);
  return NULL;
}

static void handler(pd_http_req *req, const pd_http_request *m, void *ud);

static void srv_config(pd_http_config *c) {
  pd_http_config_default(c);
  c->host = "127.0.0.1";
  c->port = 0;
  c->limits.max_body_bytes = 1 << 20;
  c->on_request = handler;
}

static void srv_start(tsrv *t, const pd_http_config *cfg) {
  pd_err e = {0};
  t->loop = pd_evloop_new(&e);
  REQUIRE(t->loop);
  pd_http_config c = *cfg;
  c.ud = t->loop; /* the handler posts and arms timers on it */
  t->srv = pd_http_server_new(t->loop, &c, &e);
  if (!t->srv) fprintf(stderr, "server: %s\n", e.msg);
  REQUIRE(t->srv);
  t->port = pd_http_server_port(t->srv);
  REQUIRE(t->port > 0);
  REQUIRE(pthread_create(&t->th, NULL, loop_main, t) == 0);
}

static void srv_stop(tsrv *t) {
  pd_evloop_stop(t->loop);
  pthread_join(t->th, NULL);
  pd_http_server_free(t->srv); /* the loop is not running: allowed from this thread */
  pd_evloop_free(t->loop);
}

/* Reads the server's stats on its loop thread. */
typedef struct {
  pd_http_server *srv;
  pd_http_stats st;
  atomic_int done;
} stats_req;
static void on_stats(pd_evloop *l, void *ud) {
  stats_req *r = ud;
  pd_http_server_stats(r->srv, &r->st);
  atomic_store(&r->done, 1);
}
static pd_http_stats srv_stats(tsrv *t) {
  stats_req r = {.srv = t->srv};
  atomic_init(&r.done, 0);
  REQUIRE(pd_evloop_post(t->loop, on_stats, &r, NULL) == PD_OK);
  for (int i = 0; i < 5000 && !atomic_load(&r.done); i++) usleep(1000);
  REQUIRE(atomic_load(&r.done));
  return r.st;
}

static uint64_t now_ms(void) { return pd_evloop_now_ms(); }

/* Waits up to ms for *flag to become nonzero. */
static bool wait_flag(atomic_int *flag, int ms) {
  for (int i = 0; i < ms && !atomic_load(flag); i++) usleep(1000);
  return atomic_load(flag) != 0;
}

/* ---- handler side (runs on the loop thread) ---- */

static atomic_int g_sse_emitted;      /* events written by /sse */
static atomic_int g_cancelled;        /* cancel callbacks seen */
static atomic_int g_flood_cancelled;  /* /flood's cancel callback ran */
static atomic_int g_forever_cancelled;
static atomic_int g_late_status;       /* status of a response attempted after a disconnect */
static atomic_int g_late_done;
static atomic_int g_hold_cancelled;

typedef struct stream_ctx {
  pd_http_req *req;
  pd_evloop *loop;
  uint64_t timer;
  int n, max, period_ms;
  size_t chunk;
  atomic_int *cancel_flag;
} stream_ctx;

static void stream_free(stream_ctx *s) {
  pd_http_req_unref(s->req);
  free(s);
}

static void on_stream_cancel(pd_http_req *req, void *ud) {
  stream_ctx *s = ud;
  atomic_fetch_add(&g_cancelled, 1);
  if (s->cancel_flag) atomic_store(s->cancel_flag, 1);
  if (s->timer) pd_evloop_timer_cancel(s->loop, s->timer);
  /* A write after the cancel is a safe no-op that reports the client gone. */
  pd_err e = {0};
  CHECK(pd_http_stream_write(req, "x", 1, &e) == PD_EIO);
  CHECK(!pd_http_req_connected(req));
  stream_free(s);
}

static void on_sse_tick(pd_evloop *l, uint64_t id, void *ud) {
  stream_ctx *s = ud;
  s->timer = 0;
  char data[32];
  snprintf(data, sizeof data, "{\"i\":%d}", s->n);
  atomic_fetch_add(&g_sse_emitted, 1);
  if (pd_http_sse_event(s->req, NULL, data, NULL) != PD_OK) return; /* cancel follows */
  if (++s->n == s->max) {
    CHECK(pd_http_sse_event(s->req, NULL, "[DONE]", NULL) == PD_OK);
    CHECK(pd_http_stream_end(s->req, NULL) == PD_OK);
    stream_free(s);
    return;
  }
  pd_evloop_timer_add(l, (uint64_t)s->period_ms, on_sse_tick, s, &s->timer, NULL);
}

static void on_flood_tick(pd_evloop *l, uint64_t id, void *ud) {
  stream_ctx *s = ud;
  s->timer = 0;
  static char block[16384];
  memset(block, 'f', sizeof block);
  for (int i = 0; i < 4; i++)
    if (pd_http_stream_write(s->req, block, sizeof block, NULL) != PD_OK) return; /* dropped */
  pd_evloop_timer_add(l, 1, on_flood_tick, s, &s->timer, NULL);
}

static stream_ctx *stream_new(pd_evloop *loop, pd_http_req *req, int max, int period_ms,
                              atomic_int *flag) {
  stream_ctx *s = calloc(1, sizeof *s);
  REQUIRE(s);
  s->req = pd_http_req_ref(req);
  s->loop = loop;
  s->max = max;
  s->period_ms = period_ms;
  s->cancel_flag = flag;
  CHECK(pd_http_req_on_cancel(req, on_stream_cancel, s) == PD_OK);
  return s;
}

/* /async: a worker thread sleeps, then posts the answer back to the loop. */
typedef struct async_job {
  pd_http_req *req;
  pd_evloop *loop;
  int delay_ms;
  bool late; /* record the result (the client is expected to be gone) */
} async_job;

static void on_async_answer(pd_evloop *l, void *ud) {
  async_job *j = ud;
  char body[64];
  int n = snprintf(body, sizeof body, "async:%llu", (unsigned long long)pd_http_req_id(j->req));
  pd_status st = pd_http_respond(j->req, 200, "text/plain", NULL, 0, body, (size_t)n, NULL);
  if (j->late) {
    atomic_store(&g_late_status, (int)st);
    atomic_store(&g_late_done, 1);
  } else {
    CHECK(st == PD_OK);
  }
  pd_http_req_unref(j->req);
  free(j);
}

static void *async_worker(void *arg) {
  async_job *j = arg;
  usleep((useconds_t)j->delay_ms * 1000);
  /* Reading the request from another thread is allowed; answering is not: post. */
  CHECK(strcmp(pd_http_req_msg(j->req)->method, "GET") == 0);
  CHECK(pd_evloop_post(j->loop, on_async_answer, j, NULL) == PD_OK);
  return NULL;
}

static void start_async(pd_evloop *loop, pd_http_req *req, int delay_ms, bool late) {
  async_job *j = calloc(1, sizeof *j);
  REQUIRE(j);
  j->req = pd_http_req_ref(req);
  j->loop = loop;
  j->delay_ms = delay_ms;
  j->late = late;
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, async_worker, j) == 0);
  pthread_detach(th);
}

/* /park: held until the test answers it (unpark) or the client leaves; loop thread only. */
static pd_http_req *g_parked[16];
static int g_n_parked;

static void on_park_cancel(pd_http_req *req, void *ud) {
  for (int i = 0; i < g_n_parked; i++)
    if (g_parked[i] == req) {
      memmove(&g_parked[i], &g_parked[i + 1], (size_t)(g_n_parked - i - 1) * sizeof *g_parked);
      g_n_parked--;
      pd_http_req_unref(req);
      return;
    }
}

static void on_unpark(pd_evloop *l, void *ud) {
  atomic_int *done = ud;
  if (g_n_parked > 0) {
    pd_http_req *req = g_parked[0];
    memmove(&g_parked[0], &g_parked[1], (size_t)(g_n_parked - 1) * sizeof *g_parked);
    g_n_parked--;
    pd_http_req_on_cancel(req, NULL, NULL);
    CHECK(pd_http_respond(req, 200, "text/plain", NULL, 0, "parked", 6, NULL) == PD_OK);
    pd_http_req_unref(req);
  }
  atomic_store(done, 1);
}

static pd_http_req *g_held; /* /hold: kept until server free cancels it */
static void on_hold_cancel(pd_http_req *req, void *ud) {
  atomic_store(&g_hold_cancelled, 1);
  pd_http_req_unref(req); /* the reference /hold took */
  g_held = NULL;
}

static void handler(pd_http_req *req, const pd_http_request *m, void *ud) {
  pd_evloop *loop = ud;
  pd_err e = {0};
  if (strcmp(m->path, "/hello") == 0) {
    CHECK(pd_http_respond(req, 200, "text/plain", NULL, 0, "hello", 5, &e) == PD_OK);
    /* A second answer is refused. */
    CHECK(pd_http_respond(req, 200, "text/plain", NULL, 0, "again", 5, &e) == PD_EINVAL);
  } else if (strcmp(m->path, "/echo") == 0) {
    char q[64] = "";
    pd_http_query_get(m->query, "q", q, sizeof q, NULL);
    pd_http_header h[] = {{"X-Method", m->method}, {"X-Query", q}};
    CHECK(pd_http_respond(req, 200, "application/octet-stream", h, 2, m->body, m->body_len, &e) == PD_OK);
  } else if (strcmp(m->path, "/close") == 0) {
    pd_http_header h[] = {{"Connection", "close"}};
    CHECK(pd_http_respond(req, 200, "text/plain", h, 1, "bye", 3, &e) == PD_OK);
  } else if (strcmp(m->path, "/error") == 0) {
    CHECK(pd_http_respond_error(req, 429, "queue \"full\"", NULL, "queue_full", &e) == PD_OK);
  } else if (strcmp(m->path, "/badheader") == 0) {
    pd_http_header h[] = {{"X-Evil", "a\r\nSet-Cookie: x"}};
    CHECK(pd_http_respond(req, 200, NULL, h, 1, "", 0, &e) == PD_EINVAL);
    CHECK(pd_http_stream_write(req, "x", 1, &e) == PD_EINVAL); /* no stream begun */
    CHECK(pd_http_respond(req, 204, NULL, NULL, 0, NULL, 0, &e) == PD_OK);
  } else if (strcmp(m->path, "/async") == 0) {
    start_async(loop, req, 30, false);
  } else if (strcmp(m->path, "/late") == 0) {
    start_async(loop, req, 300, true);
  } else if (strcmp(m->path, "/sse") == 0) {
    stream_ctx *s = stream_new(loop, req, 5, 40, NULL);
    CHECK(pd_http_sse_begin(req, NULL, 0, &e) == PD_OK);
    CHECK(pd_http_stream_begin(req, 200, NULL, NULL, 0, &e) == PD_EINVAL); /* already begun */
    pd_evloop_timer_add(loop, 0, on_sse_tick, s, &s->timer, NULL);
  } else if (strcmp(m->path, "/sse-forever") == 0) {
    stream_ctx *s = stream_new(loop, req, 1 << 30, 10, &g_forever_cancelled);
    CHECK(pd_http_sse_begin(req, NULL, 0, &e) == PD_OK);
    pd_evloop_timer_add(loop, 0, on_sse_tick, s, &s->timer, NULL);
  } else if (strcmp(m->path, "/flood") == 0) {
    stream_ctx *s = stream_new(loop, req, 0, 1, &g_flood_cancelled);
    CHECK(pd_http_stream_begin(req, 200, "application/octet-stream", NULL, 0, &e) == PD_OK);
    pd_evloop_timer_add(loop, 0, on_flood_tick, s, &s->timer, NULL);
  } else if (strcmp(m->path, "/multiline") == 0) {
    CHECK(pd_http_sse_begin(req, NULL, 0, &e) == PD_OK);
    CHECK(pd_http_sse_event(req, "note", "a\nb\r\nc\rd", &e) == PD_OK);
    CHECK(pd_http_stream_end(req, &e) == PD_OK);
    CHECK(pd_http_stream_end(req, &e) == PD_EINVAL);
  } else if (strcmp(m->path, "/big") == 0) {
    size_t n = 8 << 20;
    char *b = malloc(n);
    REQUIRE(b);
    memset(b, 'b', n);
    CHECK(pd_http_respond(req, 200, "application/octet-stream", NULL, 0, b, n, &e) == PD_OK);
    free(b);
  } else if (strcmp(m->path, "/park") == 0) {
    REQUIRE(g_n_parked < 16);
    g_parked[g_n_parked++] = pd_http_req_ref(req);
    CHECK(pd_http_req_on_cancel(req, on_park_cancel, NULL) == PD_OK);
  } else if (strcmp(m->path, "/hold") == 0) {
    g_held = pd_http_req_ref(req);
    CHECK(pd_http_req_on_cancel(req, on_hold_cancel, NULL) == PD_OK);
  } else {
    CHECK(pd_http_respond_error(req, 404, "no such route", NULL, NULL, &e) == PD_OK);
  }
}

/* ---- client side ---- */

/* A client socket (from source address src when not NULL). */
static int cli_connect_from(int port, int rcvbuf, const char *src) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  if (src) {
    struct sockaddr_in b = {.sin_family = AF_INET};
    REQUIRE(inet_pton(AF_INET, src, &b.sin_addr) == 1);
    REQUIRE(bind(fd, (struct sockaddr *)&b, sizeof b) == 0);
  }
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
  return fd;
}
static int cli_connect_opt(int port, int rcvbuf) { return cli_connect_from(port, rcvbuf, NULL); }

static bool cli_send(int fd, const void *d, size_t n) {
  const char *p = d;
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= (size_t)w;
  }
  return true;
}
static bool cli_sends(int fd, const char *s) { return cli_send(fd, s, strlen(s)); }

/* A buffered reader of responses (its own small parser, independent of the server's). */
typedef struct cli {
  int fd;
  char buf[1 << 16];
  size_t len;
  bool eof, timeout;
} cli;

typedef struct resp {
  int status;
  char head[4096];
  char *body;
  size_t body_len;
  bool chunked, close;
} resp;

static bool cli_fill(cli *c) {
  if (c->len == sizeof c->buf) return false;
  ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
  if (n > 0) {
    c->len += (size_t)n;
    return true;
  }
  if (n == 0) c->eof = true;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) c->timeout = true;
  return false;
}

static void cli_drop(cli *c, size_t n) {
  memmove(c->buf, c->buf + n, c->len - n);
  c->len -= n;
}

/* Reads one line (without CRLF) into out. */
static bool cli_line(cli *c, char *out, size_t cap) {
  for (;;) {
    char *nl = memmem(c->buf, c->len, "\r\n", 2);
    if (nl) {
      size_t l = (size_t)(nl - c->buf);
      if (l >= cap) return false;
      memcpy(out, c->buf, l);
      out[l] = 0;
      cli_drop(c, l + 2);
      return true;
    }
    if (!cli_fill(c)) return false;
  }
}

static bool cli_bytes(cli *c, char *out, size_t n) {
  while (c->len < n)
    if (!cli_fill(c)) return false;
  memcpy(out, c->buf, n);
  cli_drop(c, n);
  return true;
}

static const char *resp_header(const resp *r, const char *name) {
  static char val[512];
  size_t nl = strlen(name);
  const char *p = r->head;
  while ((p = strchr(p, '\n'))) {
    p++;
    if (strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
      const char *v = p + nl + 1;
      while (*v == ' ') v++;
      size_t l = strcspn(v, "\r\n");
      if (l >= sizeof val) l = sizeof val - 1;
      memcpy(val, v, l);
      val[l] = 0;
      return val;
    }
  }
  return NULL;
}

/* Reads a whole response to a request with method (HEAD: no body). Returns false on failure. */
static bool cli_response_m(cli *c, resp *r, bool head_method) {
  memset(r, 0, sizeof *r);
  char line[4096];
  size_t ho = 0;
  do {
    if (!cli_line(c, line, sizeof line)) return false;
    if (ho == 0 && sscanf(line, "HTTP/1.%*d %d", &r->status) != 1) return false;
    ho += (size_t)snprintf(r->head + ho, sizeof r->head - ho, "%s\n", line);
  } while (line[0] != 0);
  const char *te = resp_header(r, "Transfer-Encoding");
  r->chunked = te && strcasecmp(te, "chunked") == 0;
  const char *cn = resp_header(r, "Connection");
  r->close = cn && strcasecmp(cn, "close") == 0;
  const char *cl = resp_header(r, "Content-Length");
  if (head_method || r->status == 204 || r->status == 304 || r->status / 100 == 1) return true;
  if (r->chunked) {
    size_t cap = 0;
    for (;;) {
      if (!cli_line(c, line, sizeof line)) return false;
      size_t n = strtoul(line, NULL, 16);
      if (n == 0) {
        if (!cli_line(c, line, sizeof line)) return false; /* final CRLF */
        return true;
      }
      if (r->body_len + n + 1 > cap) {
        cap = (r->body_len + n + 1) * 2;
        r->body = realloc(r->body, cap);
      }
      if (!cli_bytes(c, r->body + r->body_len, n)) return false;
      r->body_len += n;
      r->body[r->body_len] = 0;
      char crlf[2];
      if (!cli_bytes(c, crlf, 2) || memcmp(crlf, "\r\n", 2) != 0) return false;
    }
  }
  if (cl) {
    size_t n = strtoul(cl, NULL, 10);
    r->body = malloc(n + 1);
    if (!cli_bytes(c, r->body, n)) return false;
    r->body[n] = 0;
    r->body_len = n;
    return true;
  }
  /* Delimited by close. */
  while (cli_fill(c)) {
  }
  if (!c->eof) return false;
  r->body = malloc(c->len + 1);
  memcpy(r->body, c->buf, c->len);
  r->body[c->len] = 0;
  r->body_len = c->len;
  c->len = 0;
  return true;
}
static bool cli_response(cli *c, resp *r) { return cli_response_m(c, r, false); }

static void resp_free(resp *r) {
  free(r->body);
  r->body = NULL;
}

/* True when the server closed the connection (EOF) within the socket timeout, with nothing
 * more to read. */
static bool cli_closed(cli *c) {
  if (c->len) return false;
  while (cli_fill(c)) {
  }
  return c->eof && c->len == 0;
}

static cli *cli_new_from(int port, const char *src) {
  cli *c = calloc(1, sizeof *c);
  REQUIRE(c);
  c->fd = cli_connect_from(port, 0, src);
  return c;
}
static cli *cli_new(int port) { return cli_new_from(port, NULL); }

/* True when the server dropped the connection (EOF or reset) within ms, nothing read. */
static bool cli_gone(cli *c, int ms) {
  struct pollfd pf = {.fd = c->fd, .events = POLLIN};
  if (poll(&pf, 1, ms) <= 0) return false;
  char b[256];
  ssize_t n = recv(c->fd, b, sizeof b, MSG_DONTWAIT);
  return n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE));
}

/* True while the connection stays open and silent for ms. */
static bool cli_quiet(cli *c, int ms) {
  struct pollfd pf = {.fd = c->fd, .events = POLLIN};
  return poll(&pf, 1, ms) == 0;
}

/* Whether src can be bound (another loopback address for per-address tests). */
static bool can_bind(const char *src) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in b = {.sin_family = AF_INET};
  inet_pton(AF_INET, src, &b.sin_addr);
  bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&b, sizeof b) == 0;
  if (fd >= 0) close(fd);
  return ok;
}
static void cli_free(cli *c) {
  close(c->fd);
  free(c);
}

/* One request, one response, on a fresh connection. */
static resp one_shot(int port, const char *req) {
  cli *c = cli_new(port);
  resp r;
  CHECK(cli_sends(c->fd, req));
  CHECKF(cli_response(c, &r), "no response to: %.40s", req);
  cli_free(c);
  return r;
}

/* ---- tests ---- */

static void test_basic(tsrv *t) {
  resp r = one_shot(t->port, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(r.status == 200);
  CHECK(r.body_len == 5 && strcmp(r.body, "hello") == 0);
  CHECK(resp_header(&r, "Date") != NULL);
  CHECK(strcmp(resp_header(&r, "Content-Length"), "5") == 0);
  CHECK(strcmp(resp_header(&r, "Content-Type"), "text/plain") == 0);
  CHECK(!r.close);
  resp_free(&r);

  /* POST with a JSON body and a query string. */
  const char *body = "{\"prompt\": \"caf\xc3\xa9\", \"max_tokens\": 16}";
  char req[512];
  snprintf(req, sizeof req,
           "POST /echo?q=a%%20b&x=1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
  r = one_shot(t->port, req);
  CHECK(r.status == 200);
  CHECK(r.body_len == strlen(body) && strcmp(r.body, body) == 0);
  CHECK(strcmp(resp_header(&r, "X-Method"), "POST") == 0);
  CHECK(strcmp(resp_header(&r, "X-Query"), "a b") == 0);
  resp_free(&r);

  /* 404 in the OpenAI error shape; 429 with a code. */
  r = one_shot(t->port, "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(r.status == 404);
  CHECK(strcmp(resp_header(&r, "Content-Type"), "application/json") == 0);
  CHECK(r.body && strstr(r.body, "\"type\":\"not_found_error\"") != NULL);
  resp_free(&r);
  r = one_shot(t->port, "GET /error HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(r.status == 429);
  CHECK(r.body && strstr(r.body, "\"message\":\"queue \\\"full\\\"\"") != NULL);
  CHECK(r.body && strstr(r.body, "\"code\":\"queue_full\"") != NULL);
  resp_free(&r);
  /* A header value with CRLF is refused (no response splitting); 204 has no body. */
  r = one_shot(t->port, "GET /badheader HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(r.status == 204);
  CHECK(strstr(r.head, "Set-Cookie") == NULL && strstr(r.head, "X-Evil") == NULL);
  CHECK(resp_header(&r, "Content-Length") == NULL);
  resp_free(&r);
}

static void test_keepalive_pipelining(tsrv *t) {
  cli *c = cli_new(t->port);
  for (int i = 0; i < 5; i++) {
    char req[256], want[32];
    int n = snprintf(want, sizeof want, "body-%d", i);
    snprintf(req, sizeof req, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", n, want);
    CHECK(cli_sends(c->fd, req));
    resp r;
    CHECK(cli_response(c, &r));
    CHECK(r.status == 200 && r.body && strcmp(r.body, want) == 0);
    CHECK(!r.close);
    resp_free(&r);
  }
  /* HEAD: headers only (Content-Length of the GET), then the connection is still usable. */
  CHECK(cli_sends(c->fd, "HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  resp r;
  CHECK(cli_response_m(c, &r, true));
  CHECK(r.status == 200 && strcmp(resp_header(&r, "Content-Length"), "5") == 0);
  resp_free(&r);
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200 && r.body && strcmp(r.body, "hello") == 0);
  resp_free(&r);
  cli_free(c);

  /* Pipelined: five requests in one send, an asynchronous one in the middle; answers in order. */
  c = cli_new(t->port);
  const char *pipe =
      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n1"
      "GET /async HTTP/1.1\r\nHost: x\r\n\r\n"
      "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n22\r\n0\r\n\r\n"
      "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /close HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"; /* after Connection: close: never answered */
  CHECK(cli_sends(c->fd, pipe));
  const char *want[] = {"1", "async:", "22", "hello", "bye"};
  for (int i = 0; i < 5; i++) {
    CHECKF(cli_response(c, &r), "pipelined response %d", i);
    CHECKF(r.status == 200 && r.body && strncmp(r.body, want[i], strlen(want[i])) == 0,
           "pipelined response %d: %d '%s'", i, r.status, r.body ? r.body : "");
    if (i == 4) CHECK(r.close);
    resp_free(&r);
  }
  CHECK(cli_closed(c));
  cli_free(c);
}

static void test_chunked_body(tsrv *t) {
  /* Chunks sent one piece at a time, with extensions and a trailer. */
  cli *c = cli_new(t->port);
  const char *parts[] = {"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                         "4\r\nWiki\r\n", "6;ext=1\r\npedia \r\n", "E\r\nin \r\n\r\nchunks.\r\n",
                         "0\r\n", "Trailer-A: 1\r\n", "\r\n"};
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
    CHECK(cli_sends(c->fd, parts[i]));
    usleep(5000);
  }
  resp r;
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200 && r.body && strcmp(r.body, "Wikipedia in \r\n\r\nchunks.") == 0);
  resp_free(&r);
  cli_free(c);
}

static void test_limits_and_errors(tsrv *t) {
  /* 413 from Content-Length, decided before the body is sent; the connection closes. */
  cli *c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"));
  resp r;
  CHECK(cli_response(c, &r));
  CHECK(r.status == 413 && r.close);
  CHECK(r.body && strstr(r.body, "\"error\"") && strstr(r.body, "invalid_request_error"));
  resp_free(&r);
  CHECK(cli_closed(c));
  cli_free(c);

  /* 413 from a chunked body that grows over the limit (1 MiB), while sending. */
  c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"));
  static char chunk[65536 + 16];
  int hl = snprintf(chunk, sizeof chunk, "10000\r\n");
  memset(chunk + hl, 'z', 65536);
  memcpy(chunk + hl + 65536, "\r\n", 2);
  bool sent_ok = true;
  for (int i = 0; i < 17 && sent_ok; i++) sent_ok = cli_send(c->fd, chunk, (size_t)hl + 65536 + 2);
  CHECK(cli_response(c, &r)); /* lingering close: the 413 is readable even mid-upload */
  CHECK(r.status == 413);
  resp_free(&r);
  cli_free(c);

  /* 431: 20 KiB of headers. */
  c = cli_new(t->port);
  static char big[24000];
  int o = snprintf(big, sizeof big, "GET /hello HTTP/1.1\r\nHost: x\r\n");
  for (int i = 0; i < 200; i++) o += snprintf(big + o, sizeof big - (size_t)o, "X-Pad-%03d: %090d\r\n", i, i);
  o += snprintf(big + o, sizeof big - (size_t)o, "\r\n");
  cli_send(c->fd, big, (size_t)o); /* may fail part-way once the server has answered */
  CHECK(cli_response(c, &r));
  CHECK(r.status == 431 && r.close);
  resp_free(&r);
  cli_free(c);

  /* 400 for malformed requests, then close; 505 for HTTP/2 preface-like versions. */
  const char *bad[] = {"GARBAGE\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
                       "GET / HTTP/1.1\r\n\r\n", "GET / HTTP/1.1\nHost: x\n\n",
                       "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    c = cli_new(t->port);
    CHECK(cli_sends(c->fd, bad[i]));
    CHECKF(cli_response(c, &r), "bad request %zu", i);
    CHECKF(r.status == 400 && r.close, "bad request %zu: %d", i, r.status);
    resp_free(&r);
    CHECK(cli_closed(c));
    cli_free(c);
  }
  r = one_shot(t->port, "GET / HTTP/2.0\r\nHost: x\r\n\r\n");
  CHECK(r.status == 505);
  resp_free(&r);
  r = one_shot(t->port, "GET / HTTP/1.1\r\nHost: x\r\nExpect: bananas\r\n\r\n");
  CHECK(r.status == 417);
  resp_free(&r);

  /* Expect: 100-continue: the interim answer comes before the body is sent. */
  c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n"));
  char line[256];
  CHECK(cli_line(c, line, sizeof line) && strcmp(line, "HTTP/1.1 100 Continue") == 0);
  CHECK(cli_line(c, line, sizeof line) && line[0] == 0);
  CHECK(cli_sends(c->fd, "ping"));
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200 && r.body && strcmp(r.body, "ping") == 0);
  resp_free(&r);
  cli_free(c);

  /* HTTP/1.0: closed after the response unless keep-alive was asked for. */
  c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "GET /hello HTTP/1.0\r\n\r\n"));
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200 && r.close && r.body && strcmp(r.body, "hello") == 0);
  resp_free(&r);
  CHECK(cli_closed(c));
  cli_free(c);
  c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200 && !r.close);
  CHECK(strcasecmp(resp_header(&r, "Connection"), "keep-alive") == 0);
  resp_free(&r);
  CHECK(cli_sends(c->fd, "GET /sse HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  CHECK(cli_response(c, &r)); /* no chunking for 1.0: the body ends with the connection */
  CHECK(r.status == 200 && r.close && !r.chunked);
  CHECK(r.body && strstr(r.body, "data: {\"i\":4}\n\n") && strstr(r.body, "data: [DONE]\n\n"));
  resp_free(&r);
  cli_free(c);
}

static void test_timeouts(void) {
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.header_timeout_ms = 300;
  cfg.body_timeout_ms = 300;
  cfg.idle_timeout_ms = 300;
  tsrv t;
  srv_start(&t, &cfg);

  /* Slow-loris: a header byte every 50 ms never completes the head: cut off with 408. */
  cli *c = cli_new(t.port);
  uint64_t t0 = now_ms();
  CHECK(cli_sends(c->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n"));
  bool open = true;
  for (int i = 0; i < 100 && open; i++) {
    usleep(50 * 1000);
    open = cli_sends(c->fd, "X");
    struct pollfd pf = {.fd = c->fd, .events = POLLIN};
    if (poll(&pf, 1, 0) > 0) break;
  }
  resp r;
  CHECK(cli_response(c, &r));
  CHECK(r.status == 408 && r.close);
  resp_free(&r);
  uint64_t el = now_ms() - t0;
  CHECKF(el >= 250 && el < 3000, "slow-loris cut after %llu ms", (unsigned long long)el);
  cli_free(c);

  /* A connection that never sends anything: closed silently. */
  c = cli_new(t.port);
  t0 = now_ms();
  CHECK(cli_closed(c));
  el = now_ms() - t0;
  CHECKF(el >= 250 && el < 3000, "silent connection closed after %llu ms", (unsigned long long)el);
  cli_free(c);

  /* A body that stops arriving: 408. */
  c = cli_new(t.port);
  CHECK(cli_sends(c->fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"));
  CHECK(cli_response(c, &r));
  CHECK(r.status == 408);
  resp_free(&r);
  cli_free(c);

  /* Keep-alive idle: served, then closed after the idle timeout with no bytes. */
  c = cli_new(t.port);
  CHECK(cli_sends(c->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200);
  resp_free(&r);
  t0 = now_ms();
  CHECK(cli_closed(c));
  el = now_ms() - t0;
  CHECKF(el >= 250 && el < 3000, "idle connection closed after %llu ms", (unsigned long long)el);
  cli_free(c);

  /* A request that keeps arriving in time is not cut: three requests 150 ms apart. */
  c = cli_new(t.port);
  for (int i = 0; i < 3; i++) {
    usleep(150 * 1000);
    CHECK(cli_sends(c->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
    CHECK(cli_response(c, &r));
    CHECK(r.status == 200);
    resp_free(&r);
  }
  cli_free(c);

  pd_http_stats st = srv_stats(&t);
  CHECKF(st.timeouts >= 2, "timeouts %llu", (unsigned long long)st.timeouts);
  srv_stop(&t);
}

static void test_async_and_sse(tsrv *t) {
  /* Answer from another thread. */
  uint64_t t0 = now_ms();
  resp r = one_shot(t->port, "GET /async HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(r.status == 200 && r.body && strncmp(r.body, "async:", 6) == 0);
  CHECK(now_ms() - t0 >= 25);
  resp_free(&r);

  /* SSE: events are read while the stream is still being produced. */
  atomic_store(&g_sse_emitted, 0);
  cli *c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "GET /sse HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n"));
  char line[512], head[2048] = "";
  size_t ho = 0;
  do {
    CHECK(cli_line(c, line, sizeof line));
    ho += (size_t)snprintf(head + ho, sizeof head - ho, "%s\n", line);
  } while (line[0]);
  CHECK(strstr(head, "HTTP/1.1 200 OK\n") == head);
  CHECK(strstr(head, "Content-Type: text/event-stream\n") != NULL);
  CHECK(strstr(head, "Transfer-Encoding: chunked\n") != NULL);
  CHECK(strstr(head, "Cache-Control: no-cache\n") != NULL);
  CHECK(strstr(head, "Content-Length") == NULL);
  for (int i = 0; i <= 5; i++) {
    CHECK(cli_line(c, line, sizeof line));
    size_t n = strtoul(line, NULL, 16);
    char data[256] = "";
    CHECK(n > 0 && n < sizeof data && cli_bytes(c, data, n));
    char want[64];
    if (i < 5)
      snprintf(want, sizeof want, "data: {\"i\":%d}\n\n", i);
    else
      snprintf(want, sizeof want, "data: [DONE]\n\n");
    CHECKF(strcmp(data, want) == 0, "event %d: '%s'", i, data);
    if (i == 0) {
      int emitted = atomic_load(&g_sse_emitted);
      CHECKF(emitted < 5, "first event read only after %d were produced", emitted);
    }
    CHECK(cli_line(c, line, sizeof line) && line[0] == 0);
  }
  CHECK(cli_line(c, line, sizeof line) && strcmp(line, "0") == 0);
  CHECK(cli_line(c, line, sizeof line) && line[0] == 0);
  /* Still usable for another request. */
  CHECK(cli_sends(c->fd, "GET /multiline HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_response(c, &r));
  CHECK(r.status == 200 && r.body && strcmp(r.body, "event: note\ndata: a\ndata: b\ndata: c\ndata: d\n\n") == 0);
  resp_free(&r);
  cli_free(c);

  /* The client leaves mid-stream: the cancel callback runs. */
  atomic_store(&g_forever_cancelled, 0);
  int before = atomic_load(&g_cancelled);
  c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "GET /sse-forever HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_line(c, line, sizeof line) && strstr(line, "200"));
  do {
    CHECK(cli_line(c, line, sizeof line));
  } while (line[0]);
  CHECK(cli_line(c, line, sizeof line)); /* first chunk size */
  cli_free(c);
  CHECK(wait_flag(&g_forever_cancelled, 3000));
  CHECK(atomic_load(&g_cancelled) == before + 1);

  /* A client that leaves without reading a large response: the server's sends then fail with
   * EPIPE / ECONNRESET, which must not raise SIGPIPE (it would kill this process). */
  for (int i = 0; i < 3; i++) {
    c = cli_new(t->port);
    CHECK(cli_sends(c->fd, "GET /big HTTP/1.1\r\nHost: x\r\n\r\n"));
    usleep(20 * 1000);
    cli_free(c);
  }
  usleep(200 * 1000);
  r = one_shot(t->port, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(r.status == 200);
  resp_free(&r);

  /* A late answer to a client that already left is a safe no-op returning PD_EIO. */
  atomic_store(&g_late_done, 0);
  c = cli_new(t->port);
  CHECK(cli_sends(c->fd, "GET /late HTTP/1.1\r\nHost: x\r\n\r\n"));
  usleep(50 * 1000);
  cli_free(c);
  CHECK(wait_flag(&g_late_done, 3000));
  CHECK(atomic_load(&g_late_status) == PD_EIO);
}

static void test_slow_reader(void) {
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.max_output_bytes = 256 << 10;
  tsrv t;
  srv_start(&t, &cfg);
  atomic_store(&g_flood_cancelled, 0);

  /* A reader with a small receive buffer that never reads. */
  cli *slow = calloc(1, sizeof *slow);
  REQUIRE(slow);
  slow->fd = cli_connect_opt(t.port, 4096);
  CHECK(cli_sends(slow->fd, "GET /flood HTTP/1.1\r\nHost: x\r\n\r\n"));
  /* Meanwhile others are served promptly. */
  uint64_t worst = 0;
  for (int i = 0; i < 10; i++) {
    uint64_t t0 = now_ms();
    resp r = one_shot(t.port, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(r.status == 200 && r.body && strcmp(r.body, "hello") == 0);
    resp_free(&r);
    uint64_t el = now_ms() - t0;
    if (el > worst) worst = el;
    usleep(10 * 1000);
  }
  CHECKF(worst < 1000, "a request took %llu ms while a slow reader was flooded",
         (unsigned long long)worst);
  CHECK(wait_flag(&g_flood_cancelled, 5000));
  pd_http_stats st = srv_stats(&t);
  CHECK(st.dropped_slow == 1);
  /* The dropped client sees its connection end (after whatever was buffered). */
  size_t total = 0;
  bool eof = false;
  while (total < (size_t)(64 << 20)) { /* bounded even if the server never drops it */
    char buf[65536];
    ssize_t n = recv(slow->fd, buf, sizeof buf, 0);
    if (n > 0) {
      total += (size_t)n;
      continue;
    }
    eof = n == 0 || (n < 0 && errno == ECONNRESET);
    break;
  }
  CHECK(eof);
  CHECKF(total < (size_t)(16 << 20), "the slow reader got %zu bytes", total);
  cli_free(slow);
  srv_stop(&t);
}

static void test_many_connections(tsrv *t) {
  enum { N = 200 };
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 2 * N + 64) {
    rl.rlim_cur = rl.rlim_max < 2 * N + 64 ? rl.rlim_max : 2 * N + 64;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  static cli *cs[N];
  for (int i = 0; i < N; i++) cs[i] = cli_new(t->port);
  for (int i = 0; i < N; i++) {
    char req[256];
    if (i % 4 == 3) {
      snprintf(req, sizeof req, "GET /async HTTP/1.1\r\nHost: x\r\n\r\n");
    } else {
      char b[32];
      int n = snprintf(b, sizeof b, "conn-%d", i);
      snprintf(req, sizeof req, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", n, b);
    }
    CHECK(cli_sends(cs[i]->fd, req));
  }
  int ok = 0;
  for (int i = 0; i < N; i++) {
    resp r;
    if (cli_response(cs[i], &r) && r.status == 200 && r.body) {
      char want[32];
      if (i % 4 == 3)
        snprintf(want, sizeof want, "async:");
      else
        snprintf(want, sizeof want, "conn-%d", i);
      if (strncmp(r.body, want, strlen(want)) == 0) ok++;
    }
    resp_free(&r);
  }
  CHECKF(ok == N, "%d of %d concurrent connections answered correctly", ok, N);
  pd_http_stats st = srv_stats(t);
  CHECKF(st.connections_open >= N, "open %llu", (unsigned long long)st.connections_open);
  for (int i = 0; i < N; i++) cli_free(cs[i]);
}

/* Answers the oldest /park request from the loop and waits for it. */
static void unpark(tsrv *t) {
  atomic_int done;
  atomic_init(&done, 0);
  REQUIRE(pd_evloop_post(t->loop, on_unpark, &done, NULL) == PD_OK);
  CHECK(wait_flag(&done, 5000));
}

/* Waits until the server has n connections open. */
static bool wait_open(tsrv *t, uint64_t n) {
  for (int i = 0; i < 500; i++) {
    if (srv_stats(t).connections_open == n) return true;
    usleep(2000);
  }
  return false;
}

static void test_max_connections(void) {
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.max_connections = 2;
  tsrv t;
  srv_start(&t, &cfg);
  /* Two connections with a request in progress are not evictable ... */
  cli *a = cli_new(t.port), *b = cli_new(t.port);
  CHECK(cli_sends(a->fd, "GET /park HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_sends(b->fd, "GET /park HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(wait_open(&t, 2));
  /* ... so a third connects (kernel backlog) but is not served while they are busy. */
  cli *c = cli_new(t.port);
  CHECK(cli_sends(c->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_quiet(c, 300));
  /* a's answer makes it idle: the newcomer takes its place at once. */
  unpark(&t);
  resp r;
  CHECK(cli_response(a, &r) && r.status == 200);
  resp_free(&r);
  CHECK(cli_response(c, &r) && r.status == 200); /* accepted once a slot frees */
  resp_free(&r);
  CHECK(cli_gone(a, 3000)); /* the idle one made room */
  pd_http_stats st = srv_stats(&t);
  CHECK(st.connections_open <= 2);
  CHECK(st.evicted == 1 && st.refused == 0);
  unpark(&t);
  CHECK(cli_response(b, &r) && r.status == 200);
  resp_free(&r);
  cli_free(a);
  cli_free(b);
  cli_free(c);
  srv_stop(&t);
}

/* A full table of idle connections and one sending its head: each newcomer evicts the oldest. */
static void test_eviction(void) {
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.max_connections = 3;
  cfg.busy_timeout_ms = 0; /* only eviction here */
  tsrv t;
  srv_start(&t, &cfg);
  cli *idle[3];
  for (int i = 0; i < 3; i++) {
    idle[i] = cli_new(t.port);
    CHECK(wait_open(&t, (uint64_t)i + 1)); /* accepted in this order: oldest first */
  }
  cli *d = cli_new(t.port);
  uint64_t t0 = now_ms();
  resp r;
  CHECK(cli_sends(d->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_response(d, &r) && r.status == 200);
  resp_free(&r);
  CHECKF(now_ms() - t0 < 1000, "the newcomer waited %llu ms", (unsigned long long)(now_ms() - t0));
  CHECK(cli_gone(idle[0], 3000));
  CHECK(cli_quiet(idle[1], 50) && cli_quiet(idle[2], 50));
  /* A head on its way is evictable too: slow sends it after idle[1], idle[2] and d (idle after
   * its response), so three more newcomers evict those and the fourth evicts slow. */
  cli *slow = cli_new(t.port); /* evicts idle[1] */
  CHECK(cli_sends(slow->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n"));
  CHECK(cli_gone(idle[1], 3000));
  cli *more[3];
  for (int i = 0; i < 3; i++) {
    more[i] = cli_new(t.port);
    CHECK(cli_sends(more[i]->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
    CHECK(cli_response(more[i], &r) && r.status == 200);
    resp_free(&r);
  }
  CHECK(cli_gone(idle[2], 3000));
  CHECK(cli_gone(d, 3000));
  CHECK(cli_gone(slow, 3000));
  pd_http_stats st = srv_stats(&t);
  CHECKF(st.evicted == 5, "evicted %llu", (unsigned long long)st.evicted);
  CHECK(st.connections_open == 3 && st.refused == 0);
  for (int i = 0; i < 3; i++) cli_free(idle[i]);
  for (int i = 0; i < 3; i++) cli_free(more[i]);
  cli_free(d);
  cli_free(slow);
  srv_stop(&t);
}

static void test_per_ip_limit(void) {
  const char *src = can_bind("127.0.0.2") ? "127.0.0.2" : NULL;
  if (!src) printf("  per-address limit: 127.0.0.2 cannot be bound; one address only\n");
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.max_connections = 10;
  cfg.max_connections_per_ip = 2;
  cfg.busy_timeout_ms = 0;
  tsrv t;
  srv_start(&t, &cfg);
  resp r;
  cli *x1 = cli_new_from(t.port, src), *x2 = cli_new_from(t.port, src);
  CHECK(wait_open(&t, 2));
  /* a third from the same address takes the place of its own oldest idle one */
  cli *x3 = cli_new_from(t.port, src);
  CHECK(cli_sends(x3->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_response(x3, &r) && r.status == 200);
  resp_free(&r);
  CHECK(cli_gone(x1, 3000));
  /* with both busy, a fourth is refused */
  CHECK(cli_sends(x2->fd, "GET /park HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_sends(x3->fd, "GET /park HTTP/1.1\r\nHost: x\r\n\r\n"));
  for (int i = 0; i < 500 && srv_stats(&t).requests_total < 3; i++) usleep(2000);
  usleep(20 * 1000);
  cli *x4 = cli_new_from(t.port, src);
  CHECK(cli_response(x4, &r) && r.status == 503 && r.close && r.body &&
        strstr(r.body, "too many connections"));
  resp_free(&r);
  CHECK(cli_closed(x4));
  if (src) { /* another address is not affected */
    cli *y = cli_new(t.port);
    CHECK(cli_sends(y->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
    CHECK(cli_response(y, &r) && r.status == 200);
    resp_free(&r);
    cli_free(y);
  }
  pd_http_stats st = srv_stats(&t);
  CHECKF(st.refused == 1 && st.evicted == 1, "refused %llu evicted %llu",
         (unsigned long long)st.refused, (unsigned long long)st.evicted);
  unpark(&t);
  unpark(&t);
  CHECK(cli_response(x2, &r) && r.status == 200);
  resp_free(&r);
  CHECK(cli_response(x3, &r) && r.status == 200);
  resp_free(&r);
  cli_free(x1);
  cli_free(x2);
  cli_free(x3);
  cli_free(x4);
  srv_stop(&t);
}

static void test_busy_timeout(void) {
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.max_connections = 8; /* busy above 75 %: from the 7th connection */
  cfg.busy_percent = 75;
  cfg.busy_timeout_ms = 200;
  tsrv t;
  srv_start(&t, &cfg);
  /* Below the mark idle connections keep the ordinary (30 s) header timeout. */
  cli *a[4];
  for (int i = 0; i < 4; i++) a[i] = cli_new(t.port);
  CHECK(wait_open(&t, 4));
  usleep(400 * 1000);
  for (int i = 0; i < 4; i++) CHECK(cli_quiet(a[i], 0));
  /* Three more make the table busy: the four, idle for 400 ms, go at once (oldest first); that
   * leaves three, half the mark, which ends the busy spell, so the three stay. */
  cli *b[3];
  for (int i = 0; i < 3; i++) b[i] = cli_new(t.port);
  uint64_t t0 = now_ms();
  for (int i = 0; i < 4; i++) CHECK(cli_gone(a[i], 3000));
  CHECKF(now_ms() - t0 < 1000, "the busy timeout took %llu ms", (unsigned long long)(now_ms() - t0));
  usleep(400 * 1000);
  for (int i = 0; i < 3; i++) CHECK(cli_quiet(b[i], 0));
  /* A real request is served meanwhile. */
  cli *q = cli_new(t.port);
  resp r;
  CHECK(cli_sends(q->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  CHECK(cli_response(q, &r) && r.status == 200);
  resp_free(&r);
  pd_http_stats st = srv_stats(&t);
  CHECKF(st.timeouts == 4, "timeouts %llu", (unsigned long long)st.timeouts);
  CHECK(st.evicted == 0 && st.refused == 0);
  for (int i = 0; i < 4; i++) cli_free(a[i]);
  for (int i = 0; i < 3; i++) cli_free(b[i]);
  cli_free(q);
  srv_stop(&t);

  /* A head on its way while busy gets 408 after the busy timeout, not the 30 s one: h sends part
   * of a head, six idle connections make the table busy. */
  cfg.busy_timeout_ms = 300;
  srv_start(&t, &cfg);
  cli *h = cli_new(t.port);
  CHECK(cli_sends(h->fd, "GET /hello HTTP/1.1\r\nHost: x\r\n"));
  CHECK(wait_open(&t, 1));
  t0 = now_ms();
  cli *c[6];
  for (int i = 0; i < 6; i++) c[i] = cli_new(t.port);
  bool got = cli_response(h, &r);
  uint64_t el = now_ms() - t0;
  CHECKF(got && r.status == 408 && r.close, "the slow head got %d", got ? r.status : -1);
  if (got) resp_free(&r);
  CHECKF(el >= 200 && el < 3000, "the 408 came after %llu ms", (unsigned long long)el);
  cli_free(h);
  /* the idle ones went with it, until the table was back at half the mark (3 of 8) */
  int gone = 0;
  for (int i = 0; i < 6; i++) gone += cli_gone(c[i], 1000);
  CHECKF(gone >= 3 && gone <= 5, "%d of 6 idle connections closed in the busy spell", gone);
  st = srv_stats(&t);
  CHECKF(st.timeouts >= 1 && st.responses_error >= 1, "timeouts %llu",
         (unsigned long long)st.timeouts);
  for (int i = 0; i < 6; i++) cli_free(c[i]);
  srv_stop(&t);
}

static void test_free_with_held_request(void) {
  pd_http_config cfg;
  srv_config(&cfg);
  tsrv t;
  srv_start(&t, &cfg);
  atomic_store(&g_hold_cancelled, 0);
  cli *c = cli_new(t.port);
  CHECK(cli_sends(c->fd, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n"));
  usleep(100 * 1000);
  pd_http_stats st = srv_stats(&t);
  CHECK(st.requests_total == 1);
  srv_stop(&t); /* frees the server: the held request is cancelled and released */
  CHECK(atomic_load(&g_hold_cancelled) == 1);
  CHECK(g_held == NULL);
  CHECK(cli_closed(c));
  cli_free(c);
}

static void test_bad_config(void) {
  pd_err e = {0};
  pd_evloop *l = pd_evloop_new(&e);
  REQUIRE(l);
  pd_http_config cfg;
  srv_config(&cfg);
  cfg.on_request = NULL;
  CHECK(pd_http_server_new(l, &cfg, &e) == NULL && e.code == PD_EINVAL);
  srv_config(&cfg);
  cfg.port = 70000;
  CHECK(pd_http_server_new(l, &cfg, &e) == NULL && e.code == PD_EINVAL);
  /* A port in use. */
  srv_config(&cfg);
  pd_http_server *s1 = pd_http_server_new(l, &cfg, &e);
  REQUIRE(s1);
  cfg.port = pd_http_server_port(s1);
  CHECK(pd_http_server_new(l, &cfg, &e) == NULL && e.code == PD_EIO);
  pd_http_server_free(s1);
  pd_evloop_free(l);
}

int main(void) {
  tsrv t;
  pd_http_config cfg;
  srv_config(&cfg);
  srv_start(&t, &cfg);
  test_basic(&t);
  test_keepalive_pipelining(&t);
  test_chunked_body(&t);
  test_limits_and_errors(&t);
  test_async_and_sse(&t);
  test_many_connections(&t);
  pd_http_stats st = srv_stats(&t);
  CHECK(st.requests_total > 200);
  CHECK(st.responses_error >= 8);
  srv_stop(&t);

  test_timeouts();
  test_slow_reader();
  test_max_connections();
  test_eviction();
  test_per_ip_limit();
  test_busy_timeout();
  test_free_with_held_request();
  test_bad_config();
  return pd_test_finish("test_http_server");
}
