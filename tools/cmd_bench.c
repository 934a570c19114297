/* pdctl bench --url http://HOST:PORT [--rate R | --concurrency C] --num-prompts N
 *             [--input-len L --output-len O | --prompts-file F] [--json] [--svg FILE] ...
 *
 * A serving benchmark in the manner of vLLM's benchmark_serving: requests arrive as a Poisson
 * process of rate R (or all at once), at most C at a time, each streaming its answer over
 * Server-Sent Events; every token's arrival is timed. Reported: time to first token (TTFT),
 * time per output token after the first (TPOT = (e2e - TTFT) / (output tokens - 1)),
 * inter-token latency (ITL: the gaps between streamed chunks, pooled over requests), end-to-end
 * latency, request and token throughput, errors by kind.
 *
 * The HTTP/1.1 client is a single-threaded poll() loop over non-blocking sockets, one
 * connection per request (Connection: close), so the measuring client costs little CPU next to
 * the server on the same machine and all timestamps come from one clock (CLOCK_MONOTONIC).
 * Responses may be framed by Content-Length, chunked transfer coding or the connection's end.
 *
 * Random prompts are token ids ("prompt": [ids]) so the input length is exact; ids are drawn
 * uniformly from the non-special ids of --tokenizer DIR when given, else from [10, --vocab-size).
 * Every request sets max_tokens = the output length and ignore_eos, so output lengths are
 * exact too. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pdctl.h"

/* ============================================================================================
 * URL
 * ============================================================================================ */

/* Parses http://host[:port][/prefix]. A trailing "/v1" in the path is dropped (the API paths
 * add it). */
static pd_status parse_url(const char *url, pdctl_url *u, pd_err *e) {
  memset(u, 0, sizeof *u);
  if (strncasecmp(url, "http://", 7) != 0)
    return pd_err_set(e, PD_EINVAL, "'%s': only http:// URLs are supported", url);
  const char *h = url + 7, *end = h + strcspn(h, "/");
  const char *hend, *colon;
  if (*h == '[') { /* [ipv6]:port */
    hend = memchr(h, ']', (size_t)(end - h));
    if (!hend) return pd_err_set(e, PD_EINVAL, "'%s': bad IPv6 host", url);
    h++;
    colon = hend[1] == ':' ? hend + 1 : NULL;
  } else {
    colon = memchr(h, ':', (size_t)(end - h));
    hend = colon ? colon : end;
  }
  if (hend == h || (size_t)(hend - h) >= sizeof u->host)
    return pd_err_set(e, PD_EINVAL, "'%s': bad host", url);
  memcpy(u->host, h, (size_t)(hend - h));
  u->port = 80;
  if (colon) {
    char *pe;
    long p = strtol(colon + 1, &pe, 10);
    if (pe != end || p <= 0 || p > 65535) return pd_err_set(e, PD_EINVAL, "'%s': bad port", url);
    u->port = (int)p;
  }
  size_t pl = strlen(end);
  while (pl && end[pl - 1] == '/') pl--;
  if (pl >= 3 && !strncmp(end + pl - 3, "/v1", 3)) pl -= 3;
  if (pl >= sizeof u->prefix) return pd_err_set(e, PD_EINVAL, "'%s': path too long", url);
  memcpy(u->prefix, end, pl);
  return PD_OK;
}

static pd_status resolve(const pdctl_url *u, struct sockaddr_storage *sa, socklen_t *len,
                         pd_err *e) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  struct addrinfo *res = NULL;
  char port[16];
  snprintf(port, sizeof port, "%d", u->port);
  int r = getaddrinfo(u->host, port, &hints, &res);
  if (r != 0 || !res) return pd_err_set(e, PD_ENOTFOUND, "%s: %s", u->host, gai_strerror(r));
  memcpy(sa, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return PD_OK;
}

/* ============================================================================================
 * One HTTP exchange as a state machine over a non-blocking socket
 * ============================================================================================ */

enum { ST_CONNECT, ST_SEND, ST_HEAD, ST_BODY, ST_DONE };
enum { BODY_LENGTH, BODY_CHUNKED, BODY_CLOSE };
enum { CH_SIZE, CH_DATA, CH_DATA_END, CH_TRAILER, CH_END };

/* Error classes of a request, for the report. */
enum {
  ERR_NONE,
  ERR_CONNECT,    /* socket, connect or send failed */
  ERR_TIMEOUT,    /* the request's deadline passed */
  ERR_HTTP,       /* a status other than 200 */
  ERR_STREAM,     /* an error event in the stream */
  ERR_INCOMPLETE, /* the connection ended before [DONE] */
  ERR_PROTOCOL,   /* not HTTP, bad framing, bad JSON */
  ERR_KINDS
};
static const char *const k_err_names[ERR_KINDS] = {"none",   "connect",    "timeout", "http",
                                                   "stream", "incomplete", "protocol"};

#define HEAD_MAX (64 * 1024)
#define ERRBODY_MAX 2048

typedef struct hx {
  int fd, state;
  char *out; /* request bytes */
  size_t out_len, out_off;
  char *head; /* response head until parsed */
  size_t head_len;
  int status;
  int body_mode, ch_state;
  long long body_left; /* BODY_LENGTH: bytes left; chunked: bytes left in the chunk */
  char line[256];      /* chunk-size / trailer line */
  size_t line_len;
  /* sink: SSE parsing when sse (and status 200), else the body is kept (capped) */
  bool sse;
  char *body;
  size_t body_len, body_cap, body_max;
  char *ev; /* the SSE line being assembled */
  size_t ev_len, ev_cap;
  char *data; /* data: lines of the current event, joined by \n */
  size_t data_len, data_cap;
  void (*on_event)(struct hx *h, const char *data, size_t len, double t);
  void *ud;
  bool finished; /* the exchange is over (success or failure) */
  int err;
  char errmsg[160];
} hx;

static double now_s(void) { return pdctl_now(); }

static void hx_fail(hx *h, int kind, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void hx_fail(hx *h, int kind, const char *fmt, ...) {
  if (h->finished) return;
  h->finished = true;
  h->err = kind;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(h->errmsg, sizeof h->errmsg, fmt, ap);
  va_end(ap);
}

static bool grow(char **buf, size_t *cap, size_t need) {
  if (need <= *cap) return true;
  size_t c = *cap ? *cap : 256;
  while (c < need) c *= 2;
  char *t = realloc(*buf, c);
  if (!t) return false;
  *buf = t;
  *cap = c;
  return true;
}

static void hx_free(hx *h) {
  if (h->fd >= 0) close(h->fd);
  h->fd = -1;
  free(h->out);
  free(h->head);
  free(h->body);
  free(h->ev);
  free(h->data);
  h->out = h->head = h->body = h->ev = h->data = NULL;
}

/* Builds the request and starts a non-blocking connect. */
static void hx_start(hx *h, const pdctl_url *u, const struct sockaddr_storage *sa,
                     socklen_t sa_len, const char *method, const char *path, const char *body,
                     const char *api_key) {
  memset(h, 0, sizeof *h);
  h->fd = -1;
  h->body_max = ERRBODY_MAX;
  size_t bl = body ? strlen(body) : 0;
  size_t cap = bl + strlen(path) + strlen(u->prefix) + strlen(u->host) + 512 +
               (api_key ? strlen(api_key) : 0);
  h->out = malloc(cap);
  if (!h->out) {
    hx_fail(h, ERR_CONNECT, "out of memory");
    return;
  }
  int n = snprintf(h->out, cap,
                   "%s %s%s HTTP/1.1\r\nHost: %s:%d\r\nUser-Agent: pdctl-bench\r\n"
                   "Accept: %s\r\nConnection: close\r\n",
                   method, u->prefix, path, u->host, u->port,
                   body ? "text/event-stream, application/json" : "*/*");
  if (api_key) n += snprintf(h->out + n, cap - (size_t)n, "Authorization: Bearer %s\r\n", api_key);
  if (body)
    n += snprintf(h->out + n, cap - (size_t)n,
                  "Content-Type: application/json\r\nContent-Length: %zu\r\n", bl);
  n += snprintf(h->out + n, cap - (size_t)n, "\r\n");
  if (body) memcpy(h->out + n, body, bl);
  h->out_len = (size_t)n + bl;

  h->fd = socket(sa->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (h->fd < 0) {
    hx_fail(h, ERR_CONNECT, "socket: %s", strerror(errno));
    return;
  }
  int one = 1;
  setsockopt(h->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(h->fd, (const struct sockaddr *)sa, sa_len) == 0) {
    h->state = ST_SEND;
  } else if (errno == EINPROGRESS) {
    h->state = ST_CONNECT;
  } else {
    hx_fail(h, ERR_CONNECT, "connect: %s", strerror(errno));
  }
}

static short hx_events(const hx *h) {
  return h->state == ST_CONNECT || h->state == ST_SEND ? POLLOUT : POLLIN;
}

/* ---- SSE: lines "field: value", events end at a blank line ---- */

static void sse_line(hx *h, const char *l, size_t n, double t) {
  if (n && l[n - 1] == '\r') n--;
  if (n == 0) { /* dispatch */
    if (h->data_len && h->on_event) h->on_event(h, h->data, h->data_len, t);
    h->data_len = 0;
    return;
  }
  if (n >= 5 && !memcmp(l, "data:", 5)) {
    l += 5;
    n -= 5;
    if (n && *l == ' ') l++, n--;
    size_t need = h->data_len + n + 2;
    if (!grow(&h->data, &h->data_cap, need)) {
      hx_fail(h, ERR_PROTOCOL, "out of memory");
      return;
    }
    if (h->data_len) h->data[h->data_len++] = '\n';
    memcpy(h->data + h->data_len, l, n);
    h->data_len += n;
    h->data[h->data_len] = 0;
  } /* event:, id:, retry: and comments are not used by the API */
}

static void sink(hx *h, const char *p, size_t n, double t) {
  if (h->sse && h->status == 200) {
    while (n && !h->finished) {
      const char *nl = memchr(p, '\n', n);
      size_t take = nl ? (size_t)(nl - p) : n;
      if (h->ev_len + take > (16u << 20)) {
        hx_fail(h, ERR_PROTOCOL, "an SSE line longer than 16 MiB");
        return;
      }
      if (!grow(&h->ev, &h->ev_cap, h->ev_len + take + 1)) {
        hx_fail(h, ERR_PROTOCOL, "out of memory");
        return;
      }
      memcpy(h->ev + h->ev_len, p, take);
      h->ev_len += take;
      if (nl) {
        sse_line(h, h->ev, h->ev_len, t);
        h->ev_len = 0;
        take++;
      }
      p += take;
      n -= take;
    }
    return;
  }
  size_t room = h->body_max > h->body_len ? h->body_max - h->body_len : 0;
  if (n > room) n = room;
  if (n && grow(&h->body, &h->body_cap, h->body_len + n + 1)) {
    memcpy(h->body + h->body_len, p, n);
    h->body_len += n;
    h->body[h->body_len] = 0;
  }
}

/* The body is complete. */
static void body_end(hx *h, double t) {
  if (h->ev_len) { /* a last line without its newline */
    sse_line(h, h->ev, h->ev_len, t);
    h->ev_len = 0;
  }
  if (h->sse && h->status == 200) sse_line(h, "", 0, t); /* an event without its blank line */
  h->state = ST_DONE;
  h->finished = true;
}

/* Feeds response body bytes through the transfer decoding. */
static void body_bytes(hx *h, const char *p, size_t n, double t) {
  while (n && !h->finished) {
    if (h->body_mode == BODY_CLOSE) {
      sink(h, p, n, t);
      return;
    }
    if (h->body_mode == BODY_LENGTH) {
      size_t take = (long long)n < h->body_left ? n : (size_t)h->body_left;
      sink(h, p, take, t);
      h->body_left -= (long long)take;
      if (h->body_left == 0) body_end(h, t);
      return;
    }
    /* chunked */
    if (h->ch_state == CH_DATA) {
      size_t take = (long long)n < h->body_left ? n : (size_t)h->body_left;
      sink(h, p, take, t);
      h->body_left -= (long long)take;
      p += take;
      n -= take;
      if (h->body_left == 0) h->ch_state = CH_DATA_END;
      continue;
    }
    /* line states: size line, CRLF after data, trailer lines */
    const char *nl = memchr(p, '\n', n);
    size_t take = nl ? (size_t)(nl - p) + 1 : n;
    if (h->line_len + take >= sizeof h->line) {
      hx_fail(h, ERR_PROTOCOL, "chunked framing: line too long");
      return;
    }
    memcpy(h->line + h->line_len, p, take);
    h->line_len += take;
    p += take;
    n -= take;
    if (!nl) continue;
    size_t ll = h->line_len - 1;
    if (ll && h->line[ll - 1] == '\r') ll--;
    h->line[ll] = 0;
    h->line_len = 0;
    if (h->ch_state == CH_DATA_END) {
      if (ll != 0) {
        hx_fail(h, ERR_PROTOCOL, "chunked framing: no CRLF after chunk data");
        return;
      }
      h->ch_state = CH_SIZE;
    } else if (h->ch_state == CH_SIZE) {
      char *end;
      errno = 0;
      long long sz = strtoll(h->line, &end, 16);
      if (end == h->line || errno || sz < 0 || (*end && *end != ';' && *end != ' ')) {
        hx_fail(h, ERR_PROTOCOL, "chunked framing: bad chunk size '%.40s'", h->line);
        return;
      }
      if (sz == 0) h->ch_state = CH_TRAILER;
      else {
        h->body_left = sz;
        h->ch_state = CH_DATA;
      }
    } else if (h->ch_state == CH_TRAILER) {
      if (ll == 0) {
        body_end(h, t);
        return;
      }
    }
  }
}

/* Parses the response head once it is complete; hands what follows to the body. */
static void head_bytes(hx *h, const char *p, size_t n, double t) {
  char *nh = realloc(h->head, h->head_len + n + 1);
  if (!nh) {
    hx_fail(h, ERR_PROTOCOL, "out of memory");
    return;
  }
  h->head = nh;
  memcpy(h->head + h->head_len, p, n);
  size_t old = h->head_len;
  h->head_len += n;
  h->head[h->head_len] = 0;
  char *end = strstr(h->head + (old > 3 ? old - 3 : 0), "\r\n\r\n");
  if (!end) {
    if (h->head_len > HEAD_MAX) hx_fail(h, ERR_PROTOCOL, "response head over %d bytes", HEAD_MAX);
    return;
  }
  size_t head_size = (size_t)(end - h->head) + 4;
  int major = 0, minor = 0, status = 0;
  if (sscanf(h->head, "HTTP/%d.%d %d", &major, &minor, &status) != 3 || major != 1 ||
      status < 100 || status > 999) {
    hx_fail(h, ERR_PROTOCOL, "not an HTTP/1.x response");
    return;
  }
  h->status = status;
  h->body_mode = BODY_CLOSE;
  /* headers */
  for (char *l = strstr(h->head, "\r\n") + 2; l < end; l = strstr(l, "\r\n") + 2) {
    char *le = strstr(l, "\r\n");
    *le = 0;
    if (!strncasecmp(l, "Content-Length:", 15)) {
      h->body_mode = BODY_LENGTH;
      h->body_left = strtoll(l + 15, NULL, 10);
      if (h->body_left < 0) h->body_left = 0;
    } else if (!strncasecmp(l, "Transfer-Encoding:", 18) && strcasestr(l + 18, "chunked")) {
      h->body_mode = BODY_CHUNKED;
      h->ch_state = CH_SIZE;
    }
    *le = '\r';
  }
  if (h->body_mode == BODY_CHUNKED) h->body_left = 0;
  if (status < 200 && status != 101) { /* 100 Continue: an interim answer; read the next */
    size_t rest = h->head_len - head_size;
    memmove(h->head, h->head + head_size, rest);
    h->head_len = rest;
    h->head[rest] = 0;
    if (rest) {
      char *copy = malloc(rest);
      if (!copy) return;
      memcpy(copy, h->head, rest);
      h->head_len = 0;
      head_bytes(h, copy, rest, t);
      free(copy);
    }
    return;
  }
  h->state = ST_BODY;
  size_t rest = h->head_len - head_size;
  if (h->body_mode == BODY_LENGTH && h->body_left == 0) {
    body_end(h, t);
    return;
  }
  if (rest) body_bytes(h, h->head + head_size, rest, t);
}

/* Advances the exchange after poll said the socket is ready (revents). */
static void hx_step(hx *h, short revents) {
  double t = now_s();
  if (h->finished) return;
  if (h->state == ST_CONNECT) {
    int err = 0;
    socklen_t el = sizeof err;
    if (getsockopt(h->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
    if (err) {
      hx_fail(h, ERR_CONNECT, "connect: %s", strerror(err));
      return;
    }
    h->state = ST_SEND;
  }
  if (h->state == ST_SEND) {
    while (h->out_off < h->out_len) {
      ssize_t w = send(h->fd, h->out + h->out_off, h->out_len - h->out_off, MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        hx_fail(h, ERR_CONNECT, "send: %s", strerror(errno));
        return;
      }
      h->out_off += (size_t)w;
    }
    h->state = ST_HEAD;
    return;
  }
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  char buf[16384];
  for (int rounds = 0; rounds < 64 && !h->finished; rounds++) {
    ssize_t r = recv(h->fd, buf, sizeof buf, 0);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR) continue;
      if (h->state == ST_BODY && h->body_mode == BODY_CLOSE) {
        body_end(h, t);
      } else {
        hx_fail(h, ERR_INCOMPLETE, "recv: %s", strerror(errno));
      }
      return;
    }
    if (r == 0) {
      if (h->state == ST_BODY && h->body_mode == BODY_CLOSE) body_end(h, t);
      else
        hx_fail(h, ERR_INCOMPLETE, "the server closed the connection %s",
                h->state == ST_HEAD ? "before answering" : "in the middle of the body");
      return;
    }
    if (h->state == ST_HEAD) head_bytes(h, buf, (size_t)r, t);
    else body_bytes(h, buf, (size_t)r, t);
  }
}

/* ---- one blocking exchange (GET /health, /v1/models, the warm-up request) ---- */

int pdctl_http(const char *url, const char *method, const char *path, const char *body,
               const char *api_key, int timeout_ms, char **resp, size_t *resp_len, pd_err *e) {
  pdctl_url u;
  struct sockaddr_storage sa;
  socklen_t sl;
  if (parse_url(url, &u, e) != PD_OK || resolve(&u, &sa, &sl, e) != PD_OK) return -1;
  hx h;
  hx_start(&h, &u, &sa, sl, method, path, body, api_key);
  h.body_max = 8u << 20;
  double deadline = now_s() + timeout_ms / 1000.0;
  while (!h.finished) {
    int left = (int)((deadline - now_s()) * 1000.0);
    if (left <= 0) {
      hx_fail(&h, ERR_TIMEOUT, "no complete answer within %d ms", timeout_ms);
      break;
    }
    struct pollfd pf = {.fd = h.fd, .events = hx_events(&h)};
    int r = poll(&pf, 1, left);
    if (r < 0 && errno != EINTR) {
      hx_fail(&h, ERR_CONNECT, "poll: %s", strerror(errno));
      break;
    }
    if (r > 0) hx_step(&h, pf.revents);
  }
  int status = -1;
  if (h.err) {
    pd_err_set(e, PD_EIO, "%s %s%s: %s", method, url, path, h.errmsg);
  } else {
    status = h.status;
    if (resp) {
      *resp = h.body;
      h.body = NULL;
      if (!*resp) *resp = calloc(1, 1);
    }
    if (resp_len) *resp_len = h.body_len;
  }
  hx_free(&h);
  return status;
}

pd_status pdctl_url_parse(const char *url, pdctl_url *u, pd_err *e) { return parse_url(url, u, e); }

/* ============================================================================================
 * The benchmark
 * ============================================================================================ */

/* A prompt to send: token ids or text; output length. */
typedef struct bprompt {
  int32_t *ids;
  size_t n_ids;
  char *text;
  int out_len;
} bprompt;

/* One request's measurements. */
typedef struct bres {
  double t_sched;      /* arrival time (s since start) */
  double t_start;      /* sent */
  double ttft, e2e;    /* s; ttft < 0 when no token came */
  double last_tok;     /* time of the latest counted chunk (absolute) */
  double *itl;         /* gaps between counted chunks, s */
  size_t n_itl, cap_itl;
  int n_chunks;        /* counted chunks (ones that carry output) */
  int prompt_tokens, completion_tokens; /* from usage; -1 when not reported */
  bool done_marker;    /* saw data: [DONE] */
  bool ok;
  int err;
  char errmsg[160];
  bool stream_err;
} bres;

typedef struct bench {
  pdctl_url u;
  struct sockaddr_storage sa;
  socklen_t sa_len;
  const char *api_key, *model, *endpoint;
  bool chat;
  double temperature;
  bprompt *prompts;
  int n;
  bres *res;
  double t0;
} bench;

typedef struct slot {
  hx h;
  int idx; /* request index, -1 when free */
  double deadline;
} slot;

/* One SSE event of request r. */
static void on_event(hx *h, const char *data, size_t len, double t) {
  bench *b = ((void **)h->ud)[0];
  bres *r = ((void **)h->ud)[1];
  (void)len;
  if (!strcmp(data, "[DONE]")) {
    r->done_marker = true;
    r->e2e = t - r->t_start;
    return;
  }
  cJSON *j = cJSON_Parse(data);
  if (!j) {
    hx_fail(h, ERR_PROTOCOL, "an SSE event that is not JSON: %.60s", data);
    return;
  }
  cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
  if (err) {
    cJSON *m = cJSON_IsObject(err) ? cJSON_GetObjectItemCaseSensitive(err, "message") : err;
    r->stream_err = true;
    snprintf(r->errmsg, sizeof r->errmsg, "stream error: %s",
             cJSON_IsString(m) ? m->valuestring : "(no message)");
    cJSON_Delete(j);
    return;
  }
  cJSON *usage = cJSON_GetObjectItemCaseSensitive(j, "usage");
  if (cJSON_IsObject(usage)) {
    cJSON *pt = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
    cJSON *ct = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
    if (cJSON_IsNumber(pt)) r->prompt_tokens = pt->valueint;
    if (cJSON_IsNumber(ct)) r->completion_tokens = ct->valueint;
  }
  cJSON *choices = cJSON_GetObjectItemCaseSensitive(j, "choices");
  cJSON *c0 = cJSON_IsArray(choices) ? cJSON_GetArrayItem(choices, 0) : NULL;
  if (c0) {
    /* A chunk counts as output when it carries text; a chat role announcement (delta without
     * content) and a closing chunk with only a finish reason do not. */
    const cJSON *txt;
    if (b->chat) {
      cJSON *d = cJSON_GetObjectItemCaseSensitive(c0, "delta");
      txt = d ? cJSON_GetObjectItemCaseSensitive(d, "content") : NULL;
    } else {
      txt = cJSON_GetObjectItemCaseSensitive(c0, "text");
    }
    cJSON *fr = cJSON_GetObjectItemCaseSensitive(c0, "finish_reason");
    bool has_text = cJSON_IsString(txt) && txt->valuestring[0];
    bool closing = fr && !cJSON_IsNull(fr);
    bool counts = cJSON_IsString(txt) && (has_text || !closing);
    if (counts) {
      if (r->n_chunks == 0) {
        r->ttft = t - r->t_start;
      } else {
        if (r->n_itl == r->cap_itl) {
          size_t cap = r->cap_itl ? 2 * r->cap_itl : 64;
          double *p = realloc(r->itl, cap * sizeof *p);
          if (!p) {
            hx_fail(h, ERR_PROTOCOL, "out of memory");
            cJSON_Delete(j);
            return;
          }
          r->itl = p;
          r->cap_itl = cap;
        }
        r->itl[r->n_itl++] = t - r->last_tok;
      }
      r->last_tok = t;
      r->n_chunks++;
    }
  }
  cJSON_Delete(j);
}

static char *request_body(const bench *b, const bprompt *p) {
  cJSON *o = cJSON_CreateObject();
  if (b->model) cJSON_AddStringToObject(o, "model", b->model);
  if (b->chat) {
    cJSON *msgs = cJSON_AddArrayToObject(o, "messages");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", p->text ? p->text : "");
    cJSON_AddItemToArray(msgs, m);
  } else if (p->ids) {
    cJSON *a = cJSON_AddArrayToObject(o, "prompt");
    for (size_t i = 0; i < p->n_ids; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(p->ids[i]));
  } else {
    cJSON_AddStringToObject(o, "prompt", p->text ? p->text : "");
  }
  cJSON_AddNumberToObject(o, "max_tokens", p->out_len);
  cJSON_AddNumberToObject(o, "temperature", b->temperature);
  cJSON_AddBoolToObject(o, "ignore_eos", 1);
  cJSON_AddBoolToObject(o, "stream", 1);
  cJSON *so = cJSON_AddObjectToObject(o, "stream_options");
  cJSON_AddBoolToObject(so, "include_usage", 1);
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

static const char *api_path(const bench *b) {
  return b->chat ? "/v1/chat/completions" : "/v1/completions";
}

/* Classifies a finished exchange into r. */
static void finish(bench *b, slot *s, double t) {
  bres *r = &b->res[s->idx];
  hx *h = &s->h;
  if (r->e2e <= 0) r->e2e = t - r->t_start;
  if (h->err) {
    r->err = h->err;
    if (!r->errmsg[0]) snprintf(r->errmsg, sizeof r->errmsg, "%s", h->errmsg);
  } else if (h->status != 200) {
    r->err = ERR_HTTP;
    char msg[120] = "";
    cJSON *j = h->body ? cJSON_Parse(h->body) : NULL;
    cJSON *er = j ? cJSON_GetObjectItemCaseSensitive(j, "error") : NULL;
    cJSON *m = er ? cJSON_GetObjectItemCaseSensitive(er, "message") : NULL;
    if (cJSON_IsString(m)) snprintf(msg, sizeof msg, "%s", m->valuestring);
    else if (h->body) snprintf(msg, sizeof msg, "%.100s", h->body);
    cJSON_Delete(j);
    snprintf(r->errmsg, sizeof r->errmsg, "HTTP %d: %s", h->status, msg);
  } else if (r->stream_err) {
    r->err = ERR_STREAM;
  } else if (!r->done_marker) {
    r->err = ERR_INCOMPLETE;
    snprintf(r->errmsg, sizeof r->errmsg, "the stream ended without data: [DONE]");
  } else if (r->n_chunks == 0) {
    r->err = ERR_STREAM;
    snprintf(r->errmsg, sizeof r->errmsg, "no output in the stream");
  } else {
    r->ok = true;
  }
  (void)b;
  hx_free(h);
  s->idx = -1;
}

static volatile sig_atomic_t g_stop;
static void on_sigint(int sig) { (void)sig; g_stop = 1; }

/* Runs the requests: arrivals at b->res[i].t_sched, at most conc at once (0 = unlimited).
 * Returns the wall time of the run. */
static double run(bench *b, int conc, double timeout_s, bool progress) {
  int max_slots = conc > 0 ? conc : b->n;
  slot *slots = calloc((size_t)max_slots, sizeof *slots);
  struct pollfd *pfd = calloc((size_t)max_slots, sizeof *pfd);
  void **uds = calloc((size_t)max_slots * 2, sizeof *uds);
  int *map = calloc((size_t)max_slots, sizeof *map);
  if (!slots || !pfd || !uds || !map) {
    free(slots);
    free(pfd);
    free(uds);
    free(map);
    fprintf(stderr, "pdctl: out of memory\n");
    return -1;
  }
  for (int i = 0; i < max_slots; i++) slots[i].idx = -1;
  int next = 0, done = 0, failed = 0, running = 0;
  bool tty = isatty(2);
  double last_prog = 0;
  int last_dec = 0;
  b->t0 = now_s();
  while (done < b->n) {
    double t = now_s(), rel = t - b->t0;
    if (g_stop) { /* Ctrl-C: fail what is running, skip the rest */
      for (int i = 0; i < max_slots; i++)
        if (slots[i].idx >= 0) {
          hx_fail(&slots[i].h, ERR_TIMEOUT, "interrupted");
          finish(b, &slots[i], t);
          done++, failed++;
        }
      for (; next < b->n; next++) {
        b->res[next].err = ERR_TIMEOUT;
        snprintf(b->res[next].errmsg, sizeof b->res[next].errmsg, "interrupted");
        done++, failed++;
      }
      break;
    }
    /* start what is due */
    while (next < b->n && b->res[next].t_sched <= rel && running < max_slots) {
      int k = 0;
      while (slots[k].idx >= 0) k++;
      slot *s = &slots[k];
      bres *r = &b->res[next];
      char *body = request_body(b, &b->prompts[next]);
      r->t_start = now_s();
      r->ttft = -1;
      r->prompt_tokens = r->completion_tokens = -1;
      hx_start(&s->h, &b->u, &b->sa, b->sa_len, "POST", api_path(b), body, b->api_key);
      free(body);
      s->h.sse = true;
      s->h.on_event = on_event;
      uds[2 * k] = b;
      uds[2 * k + 1] = r;
      s->h.ud = &uds[2 * k];
      s->idx = next;
      s->deadline = r->t_start + timeout_s;
      running++;
      next++;
      if (s->h.finished) {
        finish(b, s, now_s());
        running--, done++;
        failed += !b->res[next - 1].ok;
      }
    }
    /* wait for I/O, the next arrival, a deadline or the progress tick */
    int np = 0;
    double wake = t + 0.25;
    if (next < b->n && running < max_slots && b->t0 + b->res[next].t_sched < wake)
      wake = b->t0 + b->res[next].t_sched;
    for (int i = 0; i < max_slots; i++) {
      if (slots[i].idx < 0) continue;
      pfd[np].fd = slots[i].h.fd;
      pfd[np].events = hx_events(&slots[i].h);
      pfd[np].revents = 0;
      map[np++] = i;
      if (slots[i].deadline < wake) wake = slots[i].deadline;
    }
    int ms = (int)ceil((wake - now_s()) * 1000.0);
    if (ms < 0) ms = 0;
    int pr = poll(pfd, (nfds_t)np, ms);
    t = now_s();
    if (pr < 0 && errno != EINTR) {
      fprintf(stderr, "pdctl: poll: %s\n", strerror(errno));
      g_stop = 1;
      continue;
    }
    for (int j = 0; j < np && pr > 0; j++) {
      slot *s = &slots[map[j]];
      if (pfd[j].revents) hx_step(&s->h, pfd[j].revents);
    }
    for (int i = 0; i < max_slots; i++) {
      slot *s = &slots[i];
      if (s->idx < 0) continue;
      if (!s->h.finished && t >= s->deadline)
        hx_fail(&s->h, ERR_TIMEOUT, "no complete answer within %.0f s", timeout_s);
      if (s->h.finished) {
        int idx = s->idx;
        finish(b, s, t);
        running--, done++;
        if (!b->res[idx].ok) failed++;
      }
    }
    if (progress) {
      if (tty && t - last_prog >= 0.25) {
        fprintf(stderr, "\rbench: %d/%d done, %d failed, %d running, %.1f s   ", done, b->n,
                failed, running, t - b->t0);
        last_prog = t;
      } else if (!tty && done * 10 / b->n > last_dec) {
        last_dec = done * 10 / b->n;
        fprintf(stderr, "bench: %d/%d done, %d failed, %.1f s\n", done, b->n, failed,
                t - b->t0);
      }
    }
  }
  double wall = now_s() - b->t0;
  if (progress && tty)
    fprintf(stderr, "\rbench: %d/%d done, %d failed, %.1f s          \n", done, b->n, failed,
            wall);
  free(slots);
  free(pfd);
  free(uds);
  free(map);
  return wall;
}

/* ---- statistics ---- */

typedef struct dist {
  size_t n;
  double mean, std, min, max, p50, p90, p99;
} dist;

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Percentile with linear interpolation between closest ranks (numpy's default). v sorted. */
static double pct(const double *v, size_t n, double q) {
  if (n == 0) return 0;
  double pos = q / 100.0 * (double)(n - 1);
  size_t lo = (size_t)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
  return v[lo] + (v[hi] - v[lo]) * (pos - (double)lo);
}

/* Sorts v in place and summarises it (values scaled by k: seconds to ms). */
static dist summarise(double *v, size_t n, double k) {
  dist d = {.n = n};
  if (!n) return d;
  qsort(v, n, sizeof *v, cmp_d);
  double s = 0, s2 = 0;
  for (size_t i = 0; i < n; i++) s += v[i];
  d.mean = s / (double)n;
  for (size_t i = 0; i < n; i++) s2 += (v[i] - d.mean) * (v[i] - d.mean);
  d.std = sqrt(s2 / (double)n) * k;
  d.mean *= k;
  d.min = v[0] * k;
  d.max = v[n - 1] * k;
  d.p50 = pct(v, n, 50) * k;
  d.p90 = pct(v, n, 90) * k;
  d.p99 = pct(v, n, 99) * k;
  return d;
}

static cJSON *dist_json(const dist *d) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "n", (double)d->n);
  cJSON_AddNumberToObject(o, "mean", d->mean);
  cJSON_AddNumberToObject(o, "std", d->std);
  cJSON_AddNumberToObject(o, "min", d->min);
  cJSON_AddNumberToObject(o, "p50", d->p50);
  cJSON_AddNumberToObject(o, "p90", d->p90);
  cJSON_AddNumberToObject(o, "p99", d->p99);
  cJSON_AddNumberToObject(o, "max", d->max);
  return o;
}

/* ---- SVG chart: CDFs of TTFT and end-to-end latency, histogram of ITL ---- */

static void svg_escape(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '&': fputs("&amp;", f); break;
      case '"': fputs("&quot;", f); break;
      default:
        if ((unsigned char)*s >= 0x20 || *s == '\t') fputc(*s, f);
    }
  }
}

/* A "nice" axis for values up to v (> 0): a step of 1, 2, 2.5 or 5 times a power of ten giving
 * at most 6 intervals, and the smallest multiple of it that reaches v. */
static void nice_axis(double v, double *max, double *step) {
  if (!(v > 0)) v = 1;
  double raw = v / 6, mag = pow(10, floor(log10(raw))), r = raw / mag;
  double s = r <= 1 ? 1 : r <= 2 ? 2 : r <= 2.5 ? 2.5 : r <= 5 ? 5 : 10;
  *step = s * mag;
  *max = ceil(v / *step - 1e-9) * *step;
}

typedef struct panel {
  double x, y, w, h; /* plot area in px */
} panel;

static void svg_axes(FILE *f, const panel *p, double xmax, double xstep, double ymax,
                     double ystep, const char *xlabel, const char *ylabel, const char *title,
                     bool y_percent) {
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fff\" "
             "stroke=\"#888\"/>\n",
          p->x, p->y, p->w, p->h);
  for (double v = 0; v <= xmax * 1.0001; v += xstep) {
    double X = p->x + v / xmax * p->w;
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>\n", X,
            p->y, X, p->y + p->h);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", X,
            p->y + p->h + 16, v);
  }
  for (double v = 0; v <= ymax * 1.0001; v += ystep) {
    double Y = p->y + p->h - v / ymax * p->h;
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>\n",
            p->x, Y, p->x + p->w, Y);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g%s</text>\n", p->x - 6,
            Y + 4, y_percent ? v * 100 : v, y_percent ? "%" : "");
  }
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", p->x + p->w / 2,
          p->y + p->h + 36);
  svg_escape(f, xlabel);
  fprintf(f, "</text>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
             "transform=\"rotate(-90 %.1f %.1f)\">",
          p->x - 46, p->y + p->h / 2, p->x - 46, p->y + p->h / 2);
  svg_escape(f, ylabel);
  fprintf(f, "</text>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
             "font-weight=\"bold\">",
          p->x + p->w / 2, p->y - 10);
  svg_escape(f, title);
  fputs("</text>\n", f);
}

/* A step CDF of sorted values v[0..n) (ms) in panel p. */
static void svg_cdf(FILE *f, const panel *p, const double *v, size_t n, double xmax,
                    const char *color) {
  if (!n) return;
  fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", color);
  fprintf(f, "%.1f,%.1f ", p->x, p->y + p->h);
  for (size_t i = 0; i < n; i++) {
    double X = p->x + fmin(v[i] / xmax, 1.0) * p->w;
    double Y0 = p->y + p->h - (double)i / (double)n * p->h;
    double Y1 = p->y + p->h - (double)(i + 1) / (double)n * p->h;
    fprintf(f, "%.1f,%.1f %.1f,%.1f ", X, Y0, X, Y1);
  }
  fprintf(f, "%.1f,%.1f\"/>\n", p->x + p->w, p->y);
}

static int write_svg(const char *path, const char *title, double *ttft, size_t n_ttft,
                     double *e2e, size_t n_e2e, double *itl, size_t n_itl, const dist *ditl,
                     pd_err *e) {
  FILE *f = fopen(path, "w");
  if (!f) {
    pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
    return -1;
  }
  const double W = 960, H = 400;
  fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
             "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
             "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
             "<rect width=\"100%%\" height=\"100%%\" fill=\"#fafafa\"/>\n"
             "<text x=\"%.0f\" y=\"22\" text-anchor=\"middle\" font-size=\"15\" "
             "font-weight=\"bold\">",
          W, H, W, H, W / 2);
  svg_escape(f, title);
  fputs("</text>\n", f);

  /* left: CDFs (values are sorted ms) */
  panel L = {70, 60, 380, 270};
  double vmax = 0;
  if (n_ttft) vmax = fmax(vmax, ttft[n_ttft - 1]);
  if (n_e2e) vmax = fmax(vmax, e2e[n_e2e - 1]);
  double xmax, xstep;
  nice_axis(vmax, &xmax, &xstep);
  svg_axes(f, &L, xmax, xstep, 1.0, 0.2, "latency (ms)", "fraction of requests",
           "CDF of request latency", true);
  svg_cdf(f, &L, ttft, n_ttft, xmax, "#1f77b4");
  svg_cdf(f, &L, e2e, n_e2e, xmax, "#d62728");
  fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"3\" fill=\"#1f77b4\"/>"
             "<text x=\"%.0f\" y=\"%.0f\">time to first token</text>\n",
          L.x + L.w - 150, L.y + L.h - 40, L.x + L.w - 134, L.y + L.h - 35);
  fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"3\" fill=\"#d62728\"/>"
             "<text x=\"%.0f\" y=\"%.0f\">end-to-end latency</text>\n",
          L.x + L.w - 150, L.y + L.h - 22, L.x + L.w - 134, L.y + L.h - 17);

  /* right: ITL histogram, up to 1.5 x the 99th percentile so a few outliers do not squeeze
   * the bulk into one bin (the gaps beyond are counted on the chart) */
  panel R = {550, 60, 380, 270};
  double hmax = n_itl ? 1.5 * pct(itl, n_itl, 99) : 1;
  double hx_max, hx_step;
  nice_axis(hmax, &hx_max, &hx_step);
  enum { BINS = 40 };
  size_t bins[BINS] = {0}, over = 0, peak = 1;
  for (size_t i = 0; i < n_itl; i++) {
    int k = (int)(itl[i] / hx_max * BINS);
    if (k >= BINS) {
      over++;
      continue;
    }
    if (k < 0) k = 0;
    if (++bins[k] > peak) peak = bins[k];
  }
  double ymax, ystep;
  nice_axis((double)peak / (double)(n_itl ? n_itl : 1), &ymax, &ystep);
  svg_axes(f, &R, hx_max, hx_step, ymax, ystep, "inter-token latency (ms)", "fraction of gaps",
           "Inter-token latency", true);
  for (int k = 0; k < BINS; k++) {
    if (!bins[k]) continue;
    double frac = (double)bins[k] / (double)n_itl;
    double bh = frac / ymax * R.h, bw = R.w / BINS;
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#2ca02c\" "
               "stroke=\"#fff\" stroke-width=\"0.5\"/>\n",
            R.x + k * bw, R.y + R.h - bh, bw, bh);
  }
  if (n_itl) {
    const double marks[2] = {ditl->p50, ditl->p99};
    const char *names[2] = {"p50", "p99"};
    for (int m = 0; m < 2; m++) {
      if (marks[m] > hx_max) continue;
      double X = R.x + marks[m] / hx_max * R.w;
      bool left = X > R.x + R.w - 100; /* label on the side with room */
      fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\" "
                 "stroke-dasharray=\"4 3\"/><text x=\"%.1f\" y=\"%.1f\" "
                 "text-anchor=\"%s\">%s %.1f ms</text>\n",
              X, R.y, X, R.y + R.h, left ? X - 3 : X + 3, R.y + 14 + 14 * m,
              left ? "end" : "start", names[m], marks[m]);
    }
  }
  if (over)
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%zu gaps beyond the axis</text>\n",
            R.x + R.w - 4, R.y + R.h - 6, over);
  fputs("</svg>\n", f);
  if (fclose(f) != 0) {
    pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
    return -1;
  }
  return 0;
}

/* ---- prompts ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

static const char *const k_words[] = {
    "the",  "model", "server", "token", "cache", "layer", "batch", "prompt", "stream", "node",
    "data", "value", "list",   "print", "return", "while", "class", "import", "function", "loop",
    "time", "queue", "page",   "block", "write",  "read",  "file",  "string", "number", "test"};

/* Reads --prompts-file: JSON Lines, one prompt per line: a JSON string, or an object with
 * "prompt" (a string or a list of token ids) and optionally "output_len" / "max_tokens";
 * any other line is taken as the prompt text itself. Blank lines are skipped. */
static int load_prompts_file(const char *path, bprompt **out, int *count, pd_err *e) {
  FILE *f = fopen(path, "r");
  if (!f) {
    pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
    return -1;
  }
  bprompt *ps = NULL;
  int n = 0, cap = 0, lineno = 0;
  char *line = NULL;
  size_t lcap = 0;
  ssize_t len;
  int rc = 0;
  while ((len = getline(&line, &lcap, f)) >= 0) {
    lineno++;
    while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (!*p) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      bprompt *t = realloc(ps, (size_t)cap * sizeof *t);
      if (!t) {
        rc = -1;
        pd_err_set(e, PD_ENOMEM, "out of memory");
        break;
      }
      ps = t;
    }
    bprompt *bp = &ps[n];
    memset(bp, 0, sizeof *bp);
    bp->out_len = -1;
    cJSON *j = (*p == '{' || *p == '"') ? cJSON_Parse(p) : NULL;
    if (j && cJSON_IsString(j)) {
      bp->text = strdup(j->valuestring);
    } else if (j && cJSON_IsObject(j)) {
      cJSON *pr = cJSON_GetObjectItemCaseSensitive(j, "prompt");
      cJSON *ol = cJSON_GetObjectItemCaseSensitive(j, "output_len");
      if (!ol) ol = cJSON_GetObjectItemCaseSensitive(j, "max_tokens");
      if (cJSON_IsNumber(ol)) bp->out_len = ol->valueint;
      if (cJSON_IsString(pr)) {
        bp->text = strdup(pr->valuestring);
      } else if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) > 0) {
        int k = cJSON_GetArraySize(pr);
        bp->ids = malloc((size_t)k * sizeof *bp->ids);
        bp->n_ids = (size_t)k;
        int i = 0;
        for (cJSON *it = pr->child; it && bp->ids; it = it->next, i++) {
          if (!cJSON_IsNumber(it) || it->valuedouble < 0) {
            pd_err_set(e, PD_EINVAL, "%s:%d: prompt ids must be non-negative integers", path,
                       lineno);
            rc = -1;
            break;
          }
          bp->ids[i] = it->valueint;
        }
      } else {
        pd_err_set(e, PD_EINVAL, "%s:%d: no \"prompt\" string or id list", path, lineno);
        rc = -1;
      }
    } else {
      bp->text = strdup(p);
    }
    cJSON_Delete(j);
    n++;
    if (rc) break;
    if (!bp->text && !bp->ids) {
      pd_err_set(e, PD_ENOMEM, "out of memory");
      rc = -1;
      break;
    }
  }
  free(line);
  fclose(f);
  if (!rc && n == 0) {
    pd_err_set(e, PD_EINVAL, "%s holds no prompts", path);
    rc = -1;
  }
  if (rc) {
    for (int i = 0; i < n; i++) {
      free(ps[i].ids);
      free(ps[i].text);
    }
    free(ps);
    return -1;
  }
  *out = ps;
  *count = n;
  return 0;
}

/* The served model's name from GET /v1/models (the first one); NULL when unknown. */
static char *served_model(const char *url, const char *api_key, int timeout_ms, pd_err *e) {
  char *body = NULL;
  int st = pdctl_http(url, "GET", "/v1/models", NULL, api_key, timeout_ms, &body, NULL, e);
  char *name = NULL;
  if (st == 200) {
    cJSON *j = cJSON_Parse(body);
    cJSON *d = j ? cJSON_GetObjectItemCaseSensitive(j, "data") : NULL;
    cJSON *m0 = cJSON_IsArray(d) ? cJSON_GetArrayItem(d, 0) : NULL;
    cJSON *id = m0 ? cJSON_GetObjectItemCaseSensitive(m0, "id") : NULL;
    if (cJSON_IsString(id)) name = strdup(id->valuestring);
    cJSON_Delete(j);
  } else if (st > 0) {
    pd_err_set(e, PD_EIO, "GET /v1/models answered %d", st);
  }
  free(body);
  return name;
}

int cmd_bench(int argc, char **argv) {
  const char *url = NULL, *prompts_file = NULL, *svg = NULL, *endpoint = "completions",
             *model = NULL, *tok_dir = NULL, *api_key_arg = NULL, *api_key_file = NULL;
  int num = 64, in_len = 128, out_len = 64, conc = 0, vocab = 1000;
  double rate = INFINITY, temperature = 0.0, timeout_s = 600;
  unsigned long long seed = 0;
  bool json = false, help = false, no_warmup = false, quiet = false, conc_seen = false,
       rate_seen = false;
  pd_opt opts[] = {
      {"url", PD_OPT_STR, &url, "URL", "router base URL, http://HOST:PORT", NULL},
      {"endpoint", PD_OPT_STR, &endpoint, "API", "completions (default) or chat", NULL},
      {"model", PD_OPT_STR, &model, "NAME", "model name to send (default: GET /v1/models)",
       NULL},
      {"num-prompts", PD_OPT_INT, &num, "N", "requests to send (default 64)", NULL},
      {"input-len", PD_OPT_INT, &in_len, "L", "random prompt length in tokens (default 128)",
       NULL},
      {"output-len", PD_OPT_INT, &out_len, "O", "output tokens per request (default 64)", NULL},
      {"prompts-file", PD_OPT_STR, &prompts_file, "FILE",
       "JSON Lines of prompts (string, or {\"prompt\": text|[ids], \"output_len\": n})", NULL},
      {"rate", PD_OPT_DOUBLE, &rate, "R",
       "Poisson arrivals of R requests/s (default: all at once)", &rate_seen},
      {"concurrency", PD_OPT_INT, &conc, "C", "at most C requests in flight (default: no cap)",
       &conc_seen},
      {"seed", PD_OPT_U64, &seed, "S", "seed for prompts and arrival times (default 0)", NULL},
      {"temperature", PD_OPT_DOUBLE, &temperature, "T", "sampling temperature (default 0)",
       NULL},
      {"tokenizer", PD_OPT_STR, &tok_dir, "DIR",
       "model folder: random ids avoid its special tokens; chat prompts are decoded ids", NULL},
      {"vocab-size", PD_OPT_INT, &vocab, "V",
       "without --tokenizer: random ids from [10, V) (default 1000)", NULL},
      {"api-key", PD_OPT_STR, &api_key_arg, "KEY",
       "Authorization: Bearer KEY (visible in ps: prefer --api-key-file or PD_API_KEY)", NULL},
      {"api-key-file", PD_OPT_STR, &api_key_file, "FILE", "the API key from a file", NULL},
      {"timeout", PD_OPT_DOUBLE, &timeout_s, "S", "per-request timeout (default 600)", NULL},
      {"no-warmup", PD_OPT_BOOL, &no_warmup, NULL, "skip the single test request first", NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print the results as JSON", NULL},
      {"svg", PD_OPT_STR, &svg, "FILE", "write a chart of the latency distributions", NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "no progress on stderr", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl bench --url http://HOST:PORT [--rate R] [--concurrency C] "
          "--num-prompts N\n"
          "                   [--input-len L --output-len O | --prompts-file F] [--json] "
          "[--svg FILE]\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!url) return pdctl_fail("bench needs --url http://HOST:PORT");
  bench b;
  memset(&b, 0, sizeof b);
  if (parse_url(url, &b.u, &e) != PD_OK || resolve(&b.u, &b.sa, &b.sa_len, &e) != PD_OK)
    return pdctl_fail("--url: %s", e.msg);
  if (strcmp(endpoint, "completions") && strcmp(endpoint, "chat"))
    return pdctl_fail("--endpoint must be completions or chat");
  b.chat = !strcmp(endpoint, "chat");
  if (num < 1) return pdctl_fail("--num-prompts must be at least 1");
  if (in_len < 1 || out_len < 1) return pdctl_fail("--input-len and --output-len must be >= 1");
  if (rate_seen && !(rate > 0)) return pdctl_fail("--rate must be positive");
  if (conc_seen && conc < 1) return pdctl_fail("--concurrency must be at least 1");
  if (!tok_dir && vocab <= 10) return pdctl_fail("--vocab-size must be above 10");
  if (!(timeout_s > 0)) return pdctl_fail("--timeout must be positive");
  char *api_key = NULL;
  if (pd_secret_opt("api-key", api_key_arg, api_key_file, &api_key, &e) != PD_OK)
    return pdctl_fail("%s", e.msg);
  b.api_key = api_key;
  b.temperature = temperature;
  b.endpoint = endpoint;

  /* prompts */
  uint64_t rs = seed * 0x2545F4914F6CDD1Dull + 1;
  pd_tokenizer *tok = NULL;
  int32_t *allowed = NULL;
  int n_allowed = 0;
  int rc = 0;
  b.n = num;
  b.prompts = calloc((size_t)num, sizeof *b.prompts);
  b.res = calloc((size_t)num, sizeof *b.res);
  if (!b.prompts || !b.res) {
    free(b.prompts);
    free(b.res);
    pd_secret_free(api_key);
    return pdctl_fail("out of memory");
  }
  char *model_owned = NULL;
  if (tok_dir) {
    tok = pd_tokenizer_load(tok_dir, &e);
    if (!tok) {
      rc = pdctl_fail("--tokenizer: %s", e.msg);
      goto out;
    }
    int V = pd_tokenizer_vocab_size(tok);
    allowed = malloc((size_t)V * sizeof *allowed);
    if (!allowed) {
      rc = pdctl_fail("out of memory");
      goto out;
    }
    for (int i = 0; i < V; i++)
      if (!pd_tokenizer_is_special(tok, i) && pd_tokenizer_id_to_token(tok, i)) allowed[n_allowed++] = i;
    if (n_allowed == 0) {
      rc = pdctl_fail("--tokenizer: no ordinary tokens");
      goto out;
    }
  }
  if (prompts_file) {
    bprompt *fp = NULL;
    int fn = 0;
    if (load_prompts_file(prompts_file, &fp, &fn, &e) != 0) {
      rc = pdctl_fail("--prompts-file: %s", e.msg);
      goto out;
    }
    for (int i = 0; i < num; i++) { /* cycle through the file */
      const bprompt *s = &fp[i % fn];
      bprompt *d = &b.prompts[i];
      d->out_len = s->out_len > 0 ? s->out_len : out_len;
      if (s->text) d->text = strdup(s->text);
      if (s->ids) {
        d->ids = malloc(s->n_ids * sizeof *d->ids);
        if (d->ids) memcpy(d->ids, s->ids, s->n_ids * sizeof *d->ids);
        d->n_ids = s->n_ids;
      }
    }
    for (int i = 0; i < fn; i++) {
      free(fp[i].ids);
      free(fp[i].text);
    }
    free(fp);
  } else {
    for (int i = 0; i < num; i++) {
      bprompt *d = &b.prompts[i];
      d->out_len = out_len;
      d->n_ids = (size_t)in_len;
      d->ids = malloc((size_t)in_len * sizeof *d->ids);
      if (!d->ids) break;
      for (int k = 0; k < in_len; k++)
        d->ids[k] = allowed ? allowed[rng_next(&rs) % (uint64_t)n_allowed]
                            : (int32_t)(10 + rng_next(&rs) % (uint64_t)(vocab - 10));
    }
  }
  for (int i = 0; i < num; i++) {
    bprompt *d = &b.prompts[i];
    if (!d->ids && !d->text) {
      rc = pdctl_fail("out of memory");
      goto out;
    }
    if (b.chat && !d->text) { /* chat needs text: decode the ids, or make words */
      if (tok) {
        size_t tl = 0;
        if (pd_tokenizer_decode(tok, d->ids, d->n_ids, true, &d->text, &tl, &e) != PD_OK) {
          rc = pdctl_fail("decoding a random prompt: %s", e.msg);
          goto out;
        }
      } else {
        size_t cap = d->n_ids * 10 + 1, l = 0;
        d->text = malloc(cap);
        if (!d->text) {
          rc = pdctl_fail("out of memory");
          goto out;
        }
        for (size_t k = 0; k < d->n_ids; k++) {
          const char *w = k_words[(size_t)d->ids[k] % (sizeof k_words / sizeof *k_words)];
          l += (size_t)snprintf(d->text + l, cap - l, "%s%s", k ? " " : "", w);
        }
      }
    }
  }

  /* arrival times: exponential gaps (a Poisson process) or all at t = 0 */
  double t = 0;
  for (int i = 0; i < num; i++) {
    if (isfinite(rate)) {
      if (i > 0) t += -log(1.0 - rng_uniform(&rs)) / rate;
    }
    b.res[i].t_sched = t;
  }

  /* model name, and one request to check the setup before measuring */
  if (model) {
    b.model = model;
  } else {
    model_owned = served_model(url, api_key, 10000, &e);
    if (!model_owned && e.msg[0]) {
      rc = pdctl_fail("%s", e.msg);
      goto out;
    }
    b.model = model_owned;
  }
  if (!no_warmup) {
    if (!quiet) fprintf(stderr, "bench: one test request first\n");
    char *body = request_body(&b, &b.prompts[0]);
    char *resp = NULL;
    int st = body ? pdctl_http(url, "POST", api_path(&b), body, api_key, (int)(timeout_s * 1000),
                               &resp, NULL, &e)
                  : -1;
    free(body);
    if (st != 200) {
      if (st > 0) rc = pdctl_fail("the test request failed: HTTP %d: %.300s", st, resp ? resp : "");
      else rc = pdctl_fail("the test request failed: %s", e.msg);
      free(resp);
      goto out;
    }
    free(resp);
  }

  struct sigaction sa, old_sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigaction(SIGINT, &sa, &old_sa);
  if (!quiet)
    fprintf(stderr, "bench: %d requests to %s%s, %s, %s\n", num, url, api_path(&b),
            isfinite(rate) ? "Poisson arrivals" : "all at once",
            conc > 0 ? "with a concurrency cap" : "no concurrency cap");
  double wall = run(&b, conc, timeout_s, !quiet);
  sigaction(SIGINT, &old_sa, NULL);
  if (wall < 0) {
    rc = 1;
    goto out;
  }

  /* aggregate */
  int ok = 0, errs[ERR_KINDS] = {0}, short_out = 0;
  long long in_tok = 0, out_tok = 0;
  size_t n_itl_all = 0;
  for (int i = 0; i < num; i++) n_itl_all += b.res[i].n_itl;
  double *ttft = malloc(((size_t)num + 1) * sizeof *ttft);
  double *tpot = malloc(((size_t)num + 1) * sizeof *tpot);
  double *e2e = malloc(((size_t)num + 1) * sizeof *e2e);
  double *itl = malloc((n_itl_all + 1) * sizeof *itl);
  if (!ttft || !tpot || !e2e || !itl) {
    free(ttft);
    free(tpot);
    free(e2e);
    free(itl);
    rc = pdctl_fail("out of memory");
    goto out;
  }
  size_t n_ttft = 0, n_tpot = 0, n_e2e = 0, n_itl = 0;
  const char *first_err = NULL;
  for (int i = 0; i < num; i++) {
    bres *r = &b.res[i];
    if (!r->ok) {
      errs[r->err ? r->err : ERR_PROTOCOL]++;
      if (!first_err) first_err = r->errmsg;
      continue;
    }
    ok++;
    int pt = r->prompt_tokens >= 0 ? r->prompt_tokens : (int)b.prompts[i].n_ids;
    int ct = r->completion_tokens >= 0 ? r->completion_tokens : r->n_chunks;
    if (ct != b.prompts[i].out_len) short_out++;
    in_tok += pt;
    out_tok += ct;
    ttft[n_ttft++] = r->ttft;
    e2e[n_e2e++] = r->e2e;
    if (ct > 1) tpot[n_tpot++] = (r->e2e - r->ttft) / (ct - 1);
    for (size_t k = 0; k < r->n_itl; k++) itl[n_itl++] = r->itl[k];
  }
  dist dt = summarise(ttft, n_ttft, 1e3), dp = summarise(tpot, n_tpot, 1e3),
       di = summarise(itl, n_itl, 1e3), de = summarise(e2e, n_e2e, 1e3);
  double req_tp = ok / wall, in_tp = (double)in_tok / wall, out_tp = (double)out_tok / wall;
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *cfg = cJSON_AddObjectToObject(o, "config");
    cJSON_AddStringToObject(cfg, "url", url);
    cJSON_AddStringToObject(cfg, "endpoint", endpoint);
    if (b.model) cJSON_AddStringToObject(cfg, "model", b.model);
    cJSON_AddNumberToObject(cfg, "num_prompts", num);
    if (prompts_file) cJSON_AddStringToObject(cfg, "prompts_file", prompts_file);
    else {
      cJSON_AddNumberToObject(cfg, "input_len", in_len);
    }
    cJSON_AddNumberToObject(cfg, "output_len", out_len);
    if (isfinite(rate)) cJSON_AddNumberToObject(cfg, "rate", rate);
    else cJSON_AddStringToObject(cfg, "rate", "inf");
    cJSON_AddNumberToObject(cfg, "concurrency", conc);
    cJSON_AddNumberToObject(cfg, "seed", (double)seed);
    cJSON_AddNumberToObject(cfg, "temperature", temperature);
    cJSON_AddNumberToObject(o, "completed", ok);
    cJSON_AddNumberToObject(o, "failed", num - ok);
    cJSON *je = cJSON_AddObjectToObject(o, "errors");
    for (int k = 1; k < ERR_KINDS; k++) cJSON_AddNumberToObject(je, k_err_names[k], errs[k]);
    if (first_err) cJSON_AddStringToObject(o, "first_error", first_err);
    cJSON_AddNumberToObject(o, "short_outputs", short_out);
    cJSON_AddNumberToObject(o, "duration_s", wall);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)in_tok);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)out_tok);
    cJSON_AddNumberToObject(o, "request_throughput", req_tp);
    cJSON_AddNumberToObject(o, "input_throughput", in_tp);
    cJSON_AddNumberToObject(o, "output_throughput", out_tp);
    cJSON_AddNumberToObject(o, "total_token_throughput", in_tp + out_tp);
    cJSON_AddItemToObject(o, "ttft_ms", dist_json(&dt));
    cJSON_AddItemToObject(o, "tpot_ms", dist_json(&dp));
    cJSON_AddItemToObject(o, "itl_ms", dist_json(&di));
    cJSON_AddItemToObject(o, "e2e_ms", dist_json(&de));
    char *s = cJSON_Print(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    printf("============ Serving benchmark ============\n");
    printf("%-34s %s%s\n", "Endpoint:", url, api_path(&b));
    if (isfinite(rate)) printf("%-34s %.3g\n", "Request rate (req/s, Poisson):", rate);
    else printf("%-34s %s\n", "Request rate (req/s):", "inf (all at once)");
    if (conc > 0) printf("%-34s %d\n", "Max concurrency:", conc);
    printf("%-34s %d\n", "Successful requests:", ok);
    printf("%-34s %d\n", "Failed requests:", num - ok);
    for (int k = 1; k < ERR_KINDS; k++)
      if (errs[k]) printf("  %-32s %d\n", k_err_names[k], errs[k]);
    if (first_err) printf("  %-32s %s\n", "first error:", first_err);
    if (short_out) printf("%-34s %d\n", "Outputs of another length:", short_out);
    printf("%-34s %.2f\n", "Benchmark duration (s):", wall);
    printf("%-34s %lld\n", "Total input tokens:", in_tok);
    printf("%-34s %lld\n", "Total generated tokens:", out_tok);
    printf("%-34s %.2f\n", "Request throughput (req/s):", req_tp);
    printf("%-34s %.2f\n", "Input token throughput (tok/s):", in_tp);
    printf("%-34s %.2f\n", "Output token throughput (tok/s):", out_tp);
    printf("%-34s %.2f\n", "Total token throughput (tok/s):", in_tp + out_tp);
    printf("---------------------------------------------------------------\n");
    printf("%-10s %10s %10s %10s %10s %10s\n", "(ms)", "mean", "p50", "p90", "p99", "max");
    const dist *ds[4] = {&dt, &dp, &di, &de};
    const char *nm[4] = {"TTFT", "TPOT", "ITL", "E2E"};
    for (int k = 0; k < 4; k++)
      printf("%-10s %10.2f %10.2f %10.2f %10.2f %10.2f\n", nm[k], ds[k]->mean, ds[k]->p50,
             ds[k]->p90, ds[k]->p99, ds[k]->max);
    printf("===============================================================\n");
  }
  fflush(stdout);
  if (svg) {
    /* the arrays are sorted by summarise(); convert to ms for the chart */
    for (size_t i = 0; i < n_ttft; i++) ttft[i] *= 1e3;
    for (size_t i = 0; i < n_e2e; i++) e2e[i] *= 1e3;
    for (size_t i = 0; i < n_itl; i++) itl[i] *= 1e3;
    char title[256];
    char rate_s[32];
    if (isfinite(rate)) snprintf(rate_s, sizeof rate_s, "%.3g req/s", rate);
    else snprintf(rate_s, sizeof rate_s, "all at once");
    snprintf(title, sizeof title, "pdctl bench: %d requests (%d ok), %s, concurrency %s, %s",
             num, ok, rate_s, conc > 0 ? "capped" : "uncapped",
             prompts_file ? "file prompts" : "random prompts");
    if (conc > 0)
      snprintf(title, sizeof title, "pdctl bench: %d requests (%d ok), %s, concurrency %d, %s",
               num, ok, rate_s, conc, prompts_file ? "file prompts" : "random prompts");
    if (write_svg(svg, title, ttft, n_ttft, e2e, n_e2e, itl, n_itl, &di, &e) != 0)
      rc = pdctl_fail("--svg: %s", e.msg);
  }
  free(ttft);
  free(tpot);
  free(e2e);
  free(itl);
  if (!rc && ok < num) rc = pdctl_fail("%d of %d requests failed", num - ok, num);
out:
  for (int i = 0; i < num; i++) {
    free(b.prompts[i].ids);
    free(b.prompts[i].text);
    free(b.res[i].itl);
  }
  free(b.prompts);
  free(b.res);
  free(allowed);
  free(model_owned);
  pd_tokenizer_free(tok);
  pd_secret_free(api_key);
  return rc;
}
