/* HTTP request parser and helpers: valid requests field by field (whole, byte by byte and in
 * random splits, which must agree), each rejection with its status code, pipelined requests,
 * limits, and a fuzz run of random and mutated requests (invariants checked, no crash under
 * ASan/UBSan). Also the pure helpers: header lookup, percent-decoding, query strings, reason
 * phrases, OpenAI error bodies (parsed back with cJSON). */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "pd_test.h"

static const pd_http_limits LIM = {.max_head_bytes = 4096, .max_headers = 16,
                                   .max_body_bytes = 1000};

static uint64_t g_rs = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
  uint64_t z = (g_rs += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static size_t rnd_below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

/* Feeds s whole; returns the result, *consumed total consumed. */
static pd_http_parse_result feed_all(pd_http_parser *p, const char *s, size_t n,
                                     size_t *consumed) {
  size_t off = 0;
  pd_http_parse_result r = PD_HTTP_PARSE_MORE;
  for (;;) {
    size_t used = 0;
    r = pd_http_parser_feed(p, s + off, n - off, &used);
    off += used;
    if (r != PD_HTTP_PARSE_HEAD) break;
  }
  if (consumed) *consumed = off;
  return r;
}

/* Feeds s in pieces of random length (1..maxpiece); returns the final result. */
static pd_http_parse_result feed_split(pd_http_parser *p, const char *s, size_t n, size_t maxpiece,
                                       size_t *consumed) {
  size_t off = 0;
  pd_http_parse_result r;
  for (;;) {
    size_t piece = 1 + rnd_below(maxpiece);
    if (piece > n - off) piece = n - off;
    size_t used = 0;
    r = pd_http_parser_feed(p, s + off, piece, &used);
    CHECK(used <= piece);
    off += used;
    if (r == PD_HTTP_PARSE_DONE || r == PD_HTTP_PARSE_ERROR) break;
    if (r == PD_HTTP_PARSE_MORE) {
      CHECK(used == piece);
      if (off >= n) break;
    }
  }
  if (consumed) *consumed = off;
  return r;
}

static pd_http_parser *mk(void) {
  pd_err e = {0};
  pd_http_parser *p = pd_http_parser_new(&LIM, &e);
  REQUIRE(p);
  return p;
}

/* ---- valid requests ---- */

static void test_simple_get(void) {
  pd_http_parser *p = mk();
  const char *s = "GET /v1/models?x=1&y=%20z HTTP/1.1\r\nHost: localhost:8000\r\n"
                  "User-Agent:  curl/8  \r\nAccept: */*\r\n\r\n";
  size_t used = 0;
  CHECK(!pd_http_parser_started(p));
  CHECK(feed_all(p, s, strlen(s), &used) == PD_HTTP_PARSE_DONE);
  CHECK(used == strlen(s));
  CHECK(pd_http_parser_started(p));
  const pd_http_request *m = pd_http_parser_request(p);
  CHECK(strcmp(m->method, "GET") == 0);
  CHECK(strcmp(m->target, "/v1/models?x=1&y=%20z") == 0);
  CHECK(strcmp(m->path, "/v1/models") == 0);
  CHECK(strcmp(m->query, "x=1&y=%20z") == 0);
  CHECK(m->version_minor == 1);
  CHECK(m->num_headers == 3);
  CHECK(m->keep_alive);
  CHECK(!m->chunked && !m->expect_continue);
  CHECK(m->body_len == 0 && m->body && m->body[0] == 0);
  CHECK(strcmp(m->headers[1].name, "User-Agent") == 0);
  CHECK(strcmp(m->headers[1].value, "curl/8") == 0); /* OWS trimmed both sides */
  CHECK(strcmp(pd_http_header_get(m, "user-agent"), "curl/8") == 0);
  CHECK(strcmp(pd_http_header_get(m, "HOST"), "localhost:8000") == 0);
  CHECK(pd_http_header_get(m, "missing") == NULL);
  /* Feeding after DONE consumes nothing. */
  CHECK(pd_http_parser_feed(p, "x", 1, &used) == PD_HTTP_PARSE_DONE && used == 0);
  pd_http_parser_free(p);
}

static void test_post_and_pipelining(void) {
  pd_http_parser *p = mk();
  const char *s = "POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello worldGET /two "
                  "HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n\r\n";
  size_t n = strlen(s), used = 0;
  CHECK(feed_all(p, s, n, &used) == PD_HTTP_PARSE_DONE);
  const pd_http_request *m = pd_http_parser_request(p);
  CHECK(strcmp(m->method, "POST") == 0);
  CHECK(m->body_len == 11 && memcmp(m->body, "hello world", 11) == 0 && m->body[11] == 0);
  size_t first = strlen("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello world");
  CHECK(used == first);
  pd_http_parser_reset(p);
  size_t used2 = 0;
  CHECK(feed_all(p, s + used, n - used, &used2) == PD_HTTP_PARSE_DONE);
  m = pd_http_parser_request(p);
  CHECK(strcmp(m->path, "/two") == 0);
  CHECK(!m->keep_alive);
  CHECK(used + used2 == n - 2); /* the trailing CRLF belongs to the next (blank-line) request */
  pd_http_parser_reset(p);
  CHECK(feed_all(p, s + n - 2, 2, &used2) == PD_HTTP_PARSE_MORE && used2 == 2);
  CHECK(pd_http_parser_started(p)); /* blank lines count as a started request */
  pd_http_parser_free(p);
}

static void test_chunked(void) {
  const char *s = "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                  "5\r\nhello\r\n1;name=val\r\n \r\nA ; q = \"a \\\" b\"\t;t;u=v\r\n0123456789\r\n"
                  "0\r\nX-Trailer: 1\r\n\r\n";
  for (int rep = 0; rep < 50; rep++) {
    pd_http_parser *p = mk();
    size_t used = 0;
    pd_http_parse_result r =
        rep == 0 ? feed_all(p, s, strlen(s), &used) : feed_split(p, s, strlen(s), rep, &used);
    CHECK(r == PD_HTTP_PARSE_DONE);
    CHECK(used == strlen(s));
    const pd_http_request *m = pd_http_parser_request(p);
    CHECK(m->chunked);
    CHECK(m->body_len == 16 && strcmp(m->body, "hello 0123456789") == 0);
    pd_http_parser_free(p);
  }
  /* Empty chunked body. */
  pd_http_parser *p = mk();
  const char *e = "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n0\r\n\r\n";
  CHECK(feed_all(p, e, strlen(e), NULL) == PD_HTTP_PARSE_DONE);
  CHECK(pd_http_parser_request(p)->body_len == 0);
  pd_http_parser_free(p);
}

static void test_forms_and_versions(void) {
  struct {
    const char *req, *path, *query;
    int minor;
    bool keep_alive, expect;
  } cases[] = {
      {"GET http://example.com:80/a/b?c=d HTTP/1.1\r\nHost: example.com\r\n\r\n", "/a/b", "c=d", 1,
       true, false},
      {"GET https://example.com HTTP/1.1\r\nHost: example.com\r\n\r\n", "/", "", 1, true, false},
      {"GET http://h?q HTTP/1.1\r\nHost: h\r\n\r\n", "/", "q", 1, true, false},
      {"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", "*", "", 1, true, false},
      {"GET / HTTP/1.0\r\n\r\n", "/", "", 0, false, false},
      {"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", "/", "", 0, true, false},
      {"GET / HTTP/1.1\r\nHost: h\r\nConnection: foo, close\r\n\r\n", "/", "", 1, false, false},
      {"GET / HTTP/1.9\r\nHost: h\r\n\r\n", "/", "", 1, true, false},
      {"GET /? HTTP/1.1\r\nHost: h\r\n\r\n", "/", "", 1, true, false},
      {"GET http://[::1]:80/a%2Fb?c=%7e:@!$&'()*+,;= HTTP/1.1\r\nHost: h\r\n\r\n", "/a%2Fb",
       "c=%7e:@!$&'()*+,;=", 1, true, false},
      {"\r\n\r\nGET /x HTTP/1.1\r\nHost: h\r\n\r\n", "/x", "", 1, true, false},
      {"\n\r\n\nGET /x HTTP/1.1\r\nHost: h\r\n\r\n", "/x", "", 1, true, false},
      {"GET /e HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\n\r\n", "/e", "", 1, true, true},
      {"GET /e HTTP/1.0\r\nExpect: 100-continue\r\n\r\n", "/e", "", 0, false, false},
      {"GET /%7Euser HTTP/1.1\r\nHost: h\r\nX-Empty:\r\nX-Obs: caf\xc3\xa9\r\n\r\n", "/%7Euser", "",
       1, true, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    pd_http_parser *p = mk();
    pd_http_parse_result r = feed_all(p, cases[i].req, strlen(cases[i].req), NULL);
    CHECKF(r == PD_HTTP_PARSE_DONE, "case %zu: result %d (%d %s)", i, r,
           pd_http_parser_error_status(p), pd_http_parser_error_msg(p));
    if (r == PD_HTTP_PARSE_DONE) {
      const pd_http_request *m = pd_http_parser_request(p);
      CHECKF(strcmp(m->path, cases[i].path) == 0, "case %zu: path '%s'", i, m->path);
      CHECKF(strcmp(m->query, cases[i].query) == 0, "case %zu: query '%s'", i, m->query);
      CHECKF(m->version_minor == cases[i].minor, "case %zu", i);
      CHECKF(m->keep_alive == cases[i].keep_alive, "case %zu", i);
      CHECKF(m->expect_continue == cases[i].expect, "case %zu", i);
    }
    pd_http_parser_free(p);
  }
}

/* ---- rejections ---- */

static void test_errors(void) {
  char big_line[5000], big_head[5000], many[2000];
  snprintf(big_line, sizeof big_line, "GET /%04500d HTTP/1.1\r\nHost: a\r\n\r\n", 0);
  memset(big_line + 5, 'a', 4400);
  snprintf(big_head, sizeof big_head, "GET / HTTP/1.1\r\nHost: a\r\nX-Big: %04500d\r\n\r\n", 0);
  int o = snprintf(many, sizeof many, "GET / HTTP/1.1\r\nHost: a\r\n");
  for (int i = 0; i < 20; i++) o += snprintf(many + o, sizeof many - (size_t)o, "X-%d: v\r\n", i);
  snprintf(many + o, sizeof many - (size_t)o, "\r\n");
  struct {
    const char *req;
    int status;
  } cases[] = {
      {"GET / HTTP/1.1\r\n\r\n", 400},                                       /* no Host */
      {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},                  /* two Hosts */
      {"GET /\r\nHost: a\r\n\r\n", 400},                                      /* HTTP/0.9 style */
      {"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400},                            /* double space */
      {"GET / HTTP/1.1 \r\nHost: a\r\n\r\n", 400},                            /* trailing space */
      {"G@T / HTTP/1.1\r\nHost: a\r\n\r\n", 400},                             /* bad method */
      {"GET /a\x01 HTTP/1.1\r\nHost: a\r\n\r\n", 400},                        /* CTL in target */
      {"GET /\xc3\xa9 HTTP/1.1\r\nHost: a\r\n\r\n", 400},                     /* non-ASCII target */
      /* RFC 3986 characters only (differential test against llhttp) */
      {"GET /a{b} HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET /a#frag HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET /a\"b HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET /a?b|c HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET http://h\\/x HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET /[x] HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET /%zz HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET /a%4 HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400},                             /* * not OPTIONS */
      {"GET example.com:443 HTTP/1.1\r\nHost: a\r\n\r\n", 400},               /* authority form */
      {"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505},
      {"GET / HTTP/0.9\r\nHost: a\r\n\r\n", 505},
      {"GET / HTTX/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET / HTTP/1.10\r\nHost: a\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400},                  /* obs-fold */
      {"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400},                            /* space before : */
      {"GET / HTTP/1.1\r\nHost: a\r\nNoColon\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\n: empty\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nX: a\x7f b\r\n\r\n", 400},               /* DEL in value */
      {"GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n", 400},                       /* bare LF */
      {"GET / HTTP/1.1\nHost: a\n\n", 400},                                   /* LF-only */
      {"GET / HTTP/1.1\r\nHost: a\rX: b\r\n\r\n", 400},                       /* bare CR */
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1001\r\n\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999999\r\n\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\n", 400},
      {"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\n\r\n", 417},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3 x\r\nabc", 400},
      /* chunk lines as RFC 9112 7.1.1 has them (differential test against llhttp): whitespace
       * only as BWS around ';' and '=', names and values tokens or quoted-strings */
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3 \r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\t\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a=b \r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a \r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;=b\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a=\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a=b,c\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a=\"b\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a=\"b\"c\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;a=\"\x01\"\r\nabc", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;;\r\nabc", 400},
      /* a bare CR before the request line (RFC 9112 2.2), where blank lines are skipped */
      {"\rGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"\r\n\r\rGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3e9\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffffffff\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nBad Trailer\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\rX", 400},
      {big_line, 414},
      {big_head, 431},
      {many, 431},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    for (int mode = 0; mode < 2; mode++) {
      pd_http_parser *p = mk();
      size_t n = strlen(cases[i].req), used = 0;
      pd_http_parse_result r =
          mode == 0 ? feed_all(p, cases[i].req, n, &used) : feed_split(p, cases[i].req, n, 7, &used);
      CHECKF(r == PD_HTTP_PARSE_ERROR, "case %zu mode %d: result %d", i, mode, r);
      CHECKF(pd_http_parser_error_status(p) == cases[i].status, "case %zu mode %d: status %d (%s)",
             i, mode, pd_http_parser_error_status(p), pd_http_parser_error_msg(p));
      CHECK(strlen(pd_http_parser_error_msg(p)) > 0);
      CHECK(used <= n);
      size_t u2 = 1;
      CHECK(pd_http_parser_feed(p, "x", 1, &u2) == PD_HTTP_PARSE_ERROR && u2 == 0);
      /* A reset parser parses a good request again. */
      pd_http_parser_reset(p);
      const char *ok = "GET / HTTP/1.1\r\nHost: a\r\n\r\n";
      CHECK(feed_all(p, ok, strlen(ok), NULL) == PD_HTTP_PARSE_DONE);
      pd_http_parser_free(p);
    }
  }
  /* Blank lines over the head limit, then a bare CR: the first error in the stream is the one
   * reported, whole or in pieces (found by fuzz_http, corpus http/crash-blank-lines-then-bare-cr) */
  {
    static char blanks[4200];
    size_t n = 4100;
    memset(blanks, '\n', n);
    memcpy(blanks + n, "\r\n\rGET", 6);
    n += 6;
    for (int mode = 0; mode < 3; mode++) {
      pd_http_parser *p = mk();
      size_t used = 0;
      pd_http_parse_result r = mode == 0 ? feed_all(p, blanks, n, &used)
                                         : feed_split(p, blanks, n, mode == 1 ? 7 : 1, &used);
      const char *msg = pd_http_parser_error_msg(p);
      CHECKF(r == PD_HTTP_PARSE_ERROR && strstr(msg, "too many blank lines"),
             "mode %d: result %d (%s)", mode, r, msg);
      CHECK(used <= n);
      pd_http_parser_free(p);
    }
  }
  /* Chunked total over the limit across several chunks (each one small). */
  pd_http_parser *p = mk();
  char buf[4096];
  int k = snprintf(buf, sizeof buf, "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n");
  for (int i = 0; i < 5; i++) {
    k += snprintf(buf + k, sizeof buf - (size_t)k, "c8\r\n");
    memset(buf + k, 'x', 200);
    k += 200;
    k += snprintf(buf + k, sizeof buf - (size_t)k, "\r\n");
  }
  k += snprintf(buf + k, sizeof buf - (size_t)k, "1\r\nx\r\n0\r\n\r\n");
  CHECK(feed_all(p, buf, (size_t)k, NULL) == PD_HTTP_PARSE_ERROR);
  CHECK(pd_http_parser_error_status(p) == 413);
  /* Exactly at the limit is fine. */
  pd_http_parser_reset(p);
  k = snprintf(buf, sizeof buf, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n");
  memset(buf + k, 'y', 1000);
  CHECK(feed_all(p, buf, (size_t)k + 1000, NULL) == PD_HTTP_PARSE_DONE);
  CHECK(pd_http_parser_request(p)->body_len == 1000);
  pd_http_parser_free(p);
  /* Bad limits are refused. */
  pd_err e = {0};
  pd_http_limits bad = {.max_head_bytes = 4, .max_headers = 1, .max_body_bytes = 10};
  CHECK(pd_http_parser_new(&bad, &e) == NULL && e.code == PD_EINVAL);
}

/* ---- fuzz ---- */

static const char *CORPUS[] = {
    "GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    "Content-Length: 27\r\n\r\n{\"prompt\":\"hi\",\"stream\":1}\n",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    "4\r\n{\"a\"\r\n3;x=y\r\n:1}\r\n0\r\nT: v\r\n\r\n",
    "GET /health?verbose=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "POST /generate HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello",
    "OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
};

/* Parses buf as a sequence of pipelined requests with the given feed strategy; writes a
 * transcript (results, status codes, bodies) for comparison between strategies. */
static size_t transcript(const char *buf, size_t n, int strategy, char *out, size_t cap) {
  pd_http_parser *p = mk();
  size_t off = 0, o = 0;
  int guard = 0;
  while (off < n && guard++ < 1000) {
    size_t used = 0;
    pd_http_parse_result r;
    if (strategy == 0) {
      r = feed_all(p, buf + off, n - off, &used);
    } else {
      r = feed_split(p, buf + off, n - off, strategy == 1 ? 1 : 13, &used);
    }
    CHECK(used <= n - off);
    off += used;
    if (r == PD_HTTP_PARSE_DONE) {
      const pd_http_request *m = pd_http_parser_request(p);
      /* Invariants of every accepted request. */
      CHECK(m->body_len <= LIM.max_body_bytes);
      CHECK(m->body[m->body_len] == 0);
      CHECK(m->num_headers <= LIM.max_headers);
      CHECK(m->method[0] != 0);
      CHECK(m->path[0] == '/' || strcmp(m->path, "*") == 0);
      CHECK(m->version_minor == 0 || m->version_minor == 1);
      for (size_t i = 0; i < m->num_headers; i++) {
        CHECK(m->headers[i].name[0] != 0);
        CHECK(strchr(m->headers[i].value, '\r') == NULL && strchr(m->headers[i].value, '\n') == NULL);
      }
      if (o + 64 + m->body_len < cap) {
        o += (size_t)snprintf(out + o, cap - o, "D%zu:%s:%zu:", used, m->path, m->body_len);
        memcpy(out + o, m->body, m->body_len);
        o += m->body_len;
      }
      pd_http_parser_reset(p);
    } else if (r == PD_HTTP_PARSE_ERROR) {
      int st = pd_http_parser_error_status(p);
      CHECK(st == 0 || st == 400 || st == 413 || st == 414 || st == 417 || st == 431 ||
            st == 501 || st == 505); /* 0: a TLS handshake byte */
      if (o + 16 < cap) o += (size_t)snprintf(out + o, cap - o, "E%d", st);
      break;
    } else {
      if (o + 16 < cap) o += (size_t)snprintf(out + o, cap - o, "M");
      break;
    }
  }
  pd_http_parser_free(p);
  return o;
}

static void mutate(char *buf, size_t *n, size_t cap) {
  int ops = 1 + (int)rnd_below(4);
  for (int k = 0; k < ops; k++) {
    size_t len = *n;
    switch (rnd_below(7)) {
      case 0: /* flip a byte */
        if (len) buf[rnd_below(len)] = (char)rnd();
        break;
      case 1: /* insert an interesting byte */
        if (len + 1 < cap) {
          static const char interesting[] = "\r\n :;\t0fF\x00\x7f\xff-,";
          size_t at = rnd_below(len + 1);
          memmove(buf + at + 1, buf + at, len - at);
          buf[at] = interesting[rnd_below(sizeof interesting - 1)];
          (*n)++;
        }
        break;
      case 2: /* delete a range */
        if (len) {
          size_t at = rnd_below(len), l = 1 + rnd_below(8);
          if (l > len - at) l = len - at;
          memmove(buf + at, buf + at + l, len - at - l);
          *n -= l;
        }
        break;
      case 3: /* duplicate a range */
        if (len) {
          size_t at = rnd_below(len), l = 1 + rnd_below(32);
          if (l > len - at) l = len - at;
          if (len + l < cap) {
            memmove(buf + at + l, buf + at, len - at);
            (*n) += l;
          }
        }
        break;
      case 4: /* truncate */
        *n = rnd_below(len + 1);
        break;
      case 5: /* a random digit run (lengths, chunk sizes) */
        if (len) {
          size_t at = rnd_below(len), l = 1 + rnd_below(12);
          for (size_t i = at; i < len && i < at + l; i++) buf[i] = "0123456789abcdef"[rnd_below(16)];
        }
        break;
      default: /* append another corpus request (pipelining) */
        {
          const char *c = CORPUS[rnd_below(sizeof CORPUS / sizeof CORPUS[0])];
          size_t cl = strlen(c);
          if (len + cl < cap) {
            memcpy(buf + len, c, cl);
            *n += cl;
          }
        }
        break;
    }
  }
}

static void test_fuzz(void) {
  enum { CAP = 8192 };
  static char buf[CAP], t0[CAP * 2], t1[CAP * 2], t2[CAP * 2];
  int done = 0, errors = 0;
  for (int it = 0; it < 6000; it++) {
    size_t n;
    if (it % 10 == 0) { /* pure noise, sometimes starting like a request */
      n = rnd_below(600);
      for (size_t i = 0; i < n; i++) buf[i] = (char)rnd();
      if (it % 20 == 0 && n > 4) memcpy(buf, "GET ", 4);
    } else {
      const char *c = CORPUS[rnd_below(sizeof CORPUS / sizeof CORPUS[0])];
      n = strlen(c);
      memcpy(buf, c, n);
      mutate(buf, &n, CAP);
    }
    size_t l0 = transcript(buf, n, 0, t0, sizeof t0);
    size_t l1 = transcript(buf, n, it % 2 ? 1 : 2, t1, sizeof t1);
    CHECKF(l0 == l1 && memcmp(t0, t1, l0) == 0, "iteration %d: split feeding disagrees", it);
    if (it % 50 == 0) {
      size_t l2 = transcript(buf, n, 1, t2, sizeof t2);
      CHECK(l0 == l2 && memcmp(t0, t2, l0) == 0);
    }
    if (l0 && t0[0] == 'D') done++;
    if (memchr(t0, 'E', l0)) errors++;
  }
  /* The mutations must exercise both outcomes. */
  CHECKF(done > 500 && errors > 500, "done %d errors %d", done, errors);
  printf("fuzz: 6000 inputs, %d parsed a first request, %d hit an error\n", done, errors);
}

/* ---- helpers ---- */

static void test_helpers(void) {
  char out[64];
  size_t n = 0;
  CHECK(pd_http_percent_decode("a%20b+c%2B%e2%82%ac", 19, out, sizeof out, &n, true) == PD_OK);
  CHECK(strcmp(out, "a b c+\xe2\x82\xac") == 0 && n == 9);
  CHECK(pd_http_percent_decode("a+b", 3, out, sizeof out, &n, false) == PD_OK && strcmp(out, "a+b") == 0);
  CHECK(pd_http_percent_decode("%4", 2, out, sizeof out, NULL, true) == PD_EFORMAT);
  CHECK(pd_http_percent_decode("%", 1, out, sizeof out, NULL, true) == PD_EFORMAT);
  CHECK(pd_http_percent_decode("%G1", 3, out, sizeof out, NULL, true) == PD_EFORMAT);
  CHECK(pd_http_percent_decode("abcd", 4, out, 4, NULL, true) == PD_ERANGE);
  CHECK(pd_http_percent_decode("abc", 3, out, 4, NULL, true) == PD_OK);
  CHECK(pd_http_percent_decode("%00x", 4, out, sizeof out, &n, true) == PD_OK && n == 2 && out[1] == 'x');

  const char *q = "model=llama%2D3&stream=true&empty=&flag&a%20b=c+d&model=second";
  CHECK(pd_http_query_get(q, "model", out, sizeof out, &n) == PD_OK && strcmp(out, "llama-3") == 0);
  CHECK(pd_http_query_get(q, "stream", out, sizeof out, NULL) == PD_OK && strcmp(out, "true") == 0);
  CHECK(pd_http_query_get(q, "empty", out, sizeof out, &n) == PD_OK && n == 0);
  CHECK(pd_http_query_get(q, "flag", out, sizeof out, &n) == PD_OK && n == 0);
  CHECK(pd_http_query_get(q, "a b", out, sizeof out, NULL) == PD_OK && strcmp(out, "c d") == 0);
  CHECK(pd_http_query_get(q, "missing", out, sizeof out, NULL) == PD_ENOTFOUND);
  CHECK(pd_http_query_get(q, "mode", out, sizeof out, NULL) == PD_ENOTFOUND);
  CHECK(pd_http_query_get("", "x", out, sizeof out, NULL) == PD_ENOTFOUND);
  CHECK(pd_http_query_get("x=%zz", "x", out, sizeof out, NULL) == PD_EFORMAT);
  CHECK(pd_http_query_get("x=toolongvalue", "x", out, 4, NULL) == PD_ERANGE);

  pd_http_header hs[] = {{"Connection", "keep-alive, Upgrade"}, {"X-A", "1"}, {"connection", "Close"}};
  pd_http_request m = {.headers = hs, .num_headers = 3};
  CHECK(strcmp(pd_http_header_get(&m, "CONNECTION"), "keep-alive, Upgrade") == 0);
  CHECK(pd_http_header_has_token(&m, "connection", "upgrade"));
  CHECK(pd_http_header_has_token(&m, "Connection", "close"));
  CHECK(!pd_http_header_has_token(&m, "Connection", "keep"));
  CHECK(!pd_http_header_has_token(&m, "X-A", "2"));

  CHECK(strcmp(pd_http_reason(200), "OK") == 0);
  CHECK(strcmp(pd_http_reason(404), "Not Found") == 0);
  CHECK(strcmp(pd_http_reason(413), "Content Too Large") == 0);
  CHECK(strcmp(pd_http_reason(431), "Request Header Fields Too Large") == 0);
  CHECK(strcmp(pd_http_reason(503), "Service Unavailable") == 0);
  CHECK(strcmp(pd_http_reason(799), "Unknown") == 0);
  CHECK(strcmp(pd_http_error_type(400), "invalid_request_error") == 0);
  CHECK(strcmp(pd_http_error_type(404), "not_found_error") == 0);
  CHECK(strcmp(pd_http_error_type(429), "rate_limit_error") == 0);
  CHECK(strcmp(pd_http_error_type(500), "server_error") == 0);

  const char *msg = "bad \"prompt\"\n\t\\ \x01 caf\xc3\xa9";
  char *js = pd_http_error_json(msg, "invalid_request_error", "context_length_exceeded", "");
  REQUIRE(js);
  cJSON *root = cJSON_Parse(js);
  REQUIRE(root);
  cJSON *err = cJSON_GetObjectItemCaseSensitive(root, "error");
  CHECK(cJSON_IsObject(err));
  cJSON *mm = cJSON_GetObjectItemCaseSensitive(err, "message");
  CHECK(cJSON_IsString(mm) && strcmp(mm->valuestring, msg) == 0);
  CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(err, "type")->valuestring, "invalid_request_error") == 0);
  CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(err, "code")->valuestring, "context_length_exceeded") == 0);
  CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(err, "param")));
  cJSON_Delete(root);
  free(js);
  js = pd_http_error_json("x", NULL, NULL, NULL);
  REQUIRE(js);
  root = cJSON_Parse(js);
  REQUIRE(root);
  err = cJSON_GetObjectItemCaseSensitive(root, "error");
  CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(err, "param")));
  CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(err, "code")));
  CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(err, "type")->valuestring, "server_error") == 0);
  cJSON_Delete(root);
  free(js);
  js = pd_http_error_json("x", NULL, NULL, "messages.[0].content"); /* the parameter at fault */
  REQUIRE(js);
  root = cJSON_Parse(js);
  REQUIRE(root);
  err = cJSON_GetObjectItemCaseSensitive(root, "error");
  CHECK(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(err, "param")) &&
        !strcmp(cJSON_GetObjectItemCaseSensitive(err, "param")->valuestring, "messages.[0].content"));
  cJSON_Delete(root);
  free(js);
}

/* Bytes that are not HTTP are refused as they arrive, not after a header timeout: a TLS
 * ClientHello with status 0 (close, no answer), other garbage with 400. A method of 32 token
 * characters still parses; the split between method and target may fall anywhere. */
static void test_not_http(void) {
  static const char hello[] = "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03";
  struct {
    const char *bytes;
    size_t n;
    int status;
  } cases[] = {
      {hello, sizeof hello - 1, 0},
      {hello, 1, 0},
      {"\x00\x01\x02\x03", 4, 400},
      {"\r\n\x80" "abc", 6, 400},
      {"GET\t/ HTTP/1.1", 14, 400},
      {"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", 63, 400},
      {" GET / HTTP/1.1", 15, 400},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    pd_http_parser *p = mk();
    size_t used = 0;
    pd_http_parse_result r = pd_http_parser_feed(p, cases[i].bytes, cases[i].n, &used);
    CHECKF(r == PD_HTTP_PARSE_ERROR && pd_http_parser_error_status(p) == cases[i].status,
           "case %zu: result %d status %d", i, r, pd_http_parser_error_status(p));
    pd_http_parser_free(p);
  }
  char req[128];
  int k = snprintf(req, sizeof req, "%s / HTTP/1.1\r\nHost: a\r\n\r\n",
                   "ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEF"); /* 32 characters */
  for (size_t cut = 0; cut <= 40; cut++) {
    pd_http_parser *p = mk();
    size_t u1 = 0, u2 = 0;
    pd_http_parse_result r = pd_http_parser_feed(p, req, cut, &u1);
    CHECKF(r == PD_HTTP_PARSE_MORE, "cut %zu: %d", cut, r);
    r = pd_http_parser_feed(p, req + cut, (size_t)k - cut, &u2);
    CHECKF(r == PD_HTTP_PARSE_DONE, "cut %zu: %d (%s)", cut, r, pd_http_parser_error_msg(p));
    pd_http_parser_free(p);
  }
}

int main(void) {
  test_not_http();
  test_simple_get();
  test_post_and_pipelining();
  test_chunked();
  test_forms_and_versions();
  test_errors();
  test_fuzz();
  test_helpers();
  return pd_test_finish("test_http_parser");
}
