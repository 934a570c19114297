/* Fuzz target (a): the HTTP/1.1 request parser (common/http/http_parser.c) as the server drives it:
 * a byte stream of pipelined requests (heads, Content-Length and chunked bodies, trailers) fed
 * through pd_http_parser_feed, requests taken one after another until the stream ends, an
 * error, or an incomplete request.
 *
 * Input: [limits preset] [split seed] stream...
 * Properties checked (besides ASan/UBSan): the stream parsed whole, in pieces whose sizes the
 * seed chooses, and byte by byte gives the same transcript (every request field by field, the
 * bytes each consumed, the final error); consumed never exceeds what was fed, MORE consumes
 * everything; every accepted request keeps the parser's promises (NUL-terminated body within
 * the limit, header values without CR/LF/NUL, path "/..." or "*", keep-alive as the version and
 * Connection say); an error has a status the server knows and a message. The pure helpers run
 * on every parsed request too. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "http.h"
#include "http_internal.h"

static const pd_http_limits PRESETS[] = {
    {.max_head_bytes = 4096, .max_headers = 16, .max_body_bytes = 1000},
    {.max_head_bytes = 64, .max_headers = 2, .max_body_bytes = 16},
    {.max_head_bytes = 16384, .max_headers = 100, .max_body_bytes = (size_t)8 << 20},
};

/* A growing transcript. */
typedef struct tbuf {
  char *p;
  size_t n, cap;
} tbuf;

static void put(tbuf *t, const void *s, size_t n) {
  if (t->n + n > t->cap) {
    size_t cap = t->cap ? t->cap : 1024;
    while (cap < t->n + n) cap *= 2;
    char *p = realloc(t->p, cap);
    FUZZ_CHECK(p);
    t->p = p;
    t->cap = cap;
  }
  memcpy(t->p + t->n, s, n);
  t->n += n;
}

static void puts_(tbuf *t, const char *s) { put(t, s, strlen(s) + 1); }

static void putf(tbuf *t, const char *fmt, long long v) {
  char b[64];
  int k = snprintf(b, sizeof b, fmt, v);
  put(t, b, (size_t)k);
}

static bool has_ctl(const char *s) {
  for (; *s; s++)
    if (*s == '\r' || *s == '\n') return true;
  return false;
}

/* The invariants of an accepted request, and the helpers run on it. */
static void check_request(const pd_http_request *m, const pd_http_limits *lim) {
  FUZZ_CHECK(m->method && m->method[0]);
  FUZZ_CHECK(m->target && m->target[0]);
  FUZZ_CHECK(m->path[0] == '/' || !strcmp(m->path, "*"));
  FUZZ_CHECK(m->query);
  FUZZ_CHECK(m->version_minor == 0 || m->version_minor == 1);
  FUZZ_CHECK(m->num_headers <= lim->max_headers);
  FUZZ_CHECK(m->body && m->body_len <= lim->max_body_bytes && m->body[m->body_len] == 0);
  FUZZ_CHECK(!m->chunked || m->version_minor == 1);
  for (size_t i = 0; i < m->num_headers; i++) {
    const pd_http_header *h = &m->headers[i];
    FUZZ_CHECK(h->name[0]);
    for (const char *c = h->name; *c; c++) FUZZ_CHECK(pdh_is_tchar((unsigned char)*c));
    FUZZ_CHECK(!has_ctl(h->value));
    size_t vl = strlen(h->value);
    FUZZ_CHECK(!vl || (h->value[0] != ' ' && h->value[0] != '\t' && h->value[vl - 1] != ' ' &&
                       h->value[vl - 1] != '\t'));
  }
  bool close = pd_http_header_has_token(m, "Connection", "close");
  bool ka = pd_http_header_has_token(m, "Connection", "keep-alive");
  FUZZ_CHECK(m->keep_alive == (m->version_minor ? !close : ka && !close));
  if (m->version_minor == 1) FUZZ_CHECK(pd_http_header_get(m, "host") != NULL);
  char out[256];
  size_t n = 0;
  pd_status st = pd_http_query_get(m->query, "a", out, sizeof out, &n);
  FUZZ_CHECK(st == PD_OK || st == PD_ENOTFOUND || st == PD_EFORMAT || st == PD_ERANGE);
  if (st == PD_OK) FUZZ_CHECK(n < sizeof out && out[n] == 0);
  st = pd_http_percent_decode(m->path, strlen(m->path), out, sizeof out, &n, false);
  FUZZ_CHECK(st == PD_OK || st == PD_EFORMAT || st == PD_ERANGE);
}

static void record_request(tbuf *t, const pd_http_request *m, size_t consumed) {
  putf(t, "D%lld", (long long)consumed);
  puts_(t, m->method);
  puts_(t, m->target);
  puts_(t, m->path);
  puts_(t, m->query);
  putf(t, "v%lld", m->version_minor);
  putf(t, "h%lld", (long long)m->num_headers);
  for (size_t i = 0; i < m->num_headers; i++) {
    puts_(t, m->headers[i].name);
    puts_(t, m->headers[i].value);
  }
  putf(t, "b%lld", (long long)m->body_len);
  put(t, m->body, m->body_len);
  putf(t, "f%lld", m->keep_alive | m->expect_continue << 1 | m->chunked << 2);
}

/* Tiny PRNG for piece sizes (splitmix64). */
static uint64_t next_rand(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Parses the stream d[0, n) as pipelined requests. mode 0: each feed gets everything left;
 * 1: pieces of 1..maxpiece bytes (seeded); 2: one byte at a time. take: move each request out
 * as the server does (pdh_parser_take) instead of resetting. */
static void transcript(const uint8_t *d, size_t n, const pd_http_limits *lim, int mode,
                       uint64_t seed, size_t maxpiece, bool take, tbuf *t) {
  pd_err e = {0};
  pd_http_parser *p = pd_http_parser_new(lim, &e);
  FUZZ_CHECK(p);
  size_t off = 0, req_start = 0;
  for (;;) {
    size_t piece = n - off;
    if (mode == 1) piece = 1 + (size_t)(next_rand(&seed) % maxpiece);
    if (mode == 2) piece = 1;
    if (piece > n - off) piece = n - off;
    size_t used = 0;
    pd_http_parse_result r = pd_http_parser_feed(p, d + off, piece, &used);
    FUZZ_CHECK(used <= piece);
    off += used;
    if (r == PD_HTTP_PARSE_MORE) {
      FUZZ_CHECK(used == piece);
      if (off == n) {
        put(t, "M", 1);
        putf(t, "%lld", pd_http_parser_started(p));
        break;
      }
    } else if (r == PD_HTTP_PARSE_HEAD) {
      const pd_http_request *m = pd_http_parser_request(p);
      FUZZ_CHECK(m->method && m->path);
      if (off == n) { /* the body never came */
        put(t, "M1", 2);
        break;
      }
    } else if (r == PD_HTTP_PARSE_DONE) {
      const pd_http_request *m = pd_http_parser_request(p);
      check_request(m, lim);
      record_request(t, m, off - req_start);
      req_start = off;
      size_t u2 = 1;
      FUZZ_CHECK(pd_http_parser_feed(p, "x", 1, &u2) == PD_HTTP_PARSE_DONE && u2 == 0);
      if (take) {
        char *head, *body;
        pd_http_header *hdrs;
        pd_http_request msg;
        pdh_parser_take(p, &head, &hdrs, &body, &msg);
        free(head);
        free(hdrs);
        free(body);
      } else {
        pd_http_parser_reset(p);
      }
      if (off == n) break;
    } else {
      int st = pd_http_parser_error_status(p);
      FUZZ_CHECK(st == 0 || st == 400 || st == 413 || st == 414 || st == 417 || st == 431 ||
                 st == 500 || st == 501 || st == 505);
      FUZZ_CHECK(pd_http_parser_error_msg(p)[0]);
      putf(t, "E%lld", st);
      puts_(t, pd_http_parser_error_msg(p));
      break;
    }
  }
  pd_http_parser_free(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in in = {data, size};
  const pd_http_limits *lim = &PRESETS[fuzz_byte(&in) % (sizeof PRESETS / sizeof *PRESETS)];
  uint8_t seed = fuzz_byte(&in);
  tbuf whole = {0}, split = {0};
  transcript(in.p, in.n, lim, 0, 0, 1, seed & 1, &whole);
  transcript(in.p, in.n, lim, 1, seed, 1 + seed % 64, false, &split);
  FUZZ_CHECK(whole.n == split.n && !memcmp(whole.p, split.p, whole.n));
  if (in.n <= 4096) {
    split.n = 0;
    transcript(in.p, in.n, lim, 2, 0, 1, true, &split);
    FUZZ_CHECK(whole.n == split.n && !memcmp(whole.p, split.p, whole.n));
  }
  free(whole.p);
  free(split.p);
  return 0;
}
