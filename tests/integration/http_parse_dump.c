/* Parses HTTP/1.1 request streams with pdserve's parser (common/http/http_parser.c) as the server
 * does, and prints what it parsed as JSON, for test_http_differential.py, which compares it
 * with llhttp.
 *
 *   http_parse_dump < records
 * stdin: records, each a 4-byte little-endian length and that many bytes (one connection's
 * input). stdout: one JSON line per record:
 *   {"requests": [{"method", "target", "path", "query", "minor", "headers": [[name, value]...],
 *                  "body", "keep_alive", "chunked", "expect_continue", "consumed"}...],
 *    "end": "done" | "more" | "error" | "close", "status": N, "error": "why"}
 * Requests are taken one after another, as pipelined on one connection, with the server's
 * default limits (pd_http_config_default); "end" says how the stream ended: every byte used
 * ("done"), an incomplete request ("more"), an error (its status: 0 for not HTTP at all), or
 * a request without keep-alive with bytes after it, which the server never reads ("close").
 * Strings are bytes: each byte outside printable ASCII is written as \u00XX. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"

static void put_bytes(const char *s, size_t n) {
  putchar('"');
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') printf("\\%c", c);
    else if (c >= 0x20 && c < 0x7f) putchar(c);
    else printf("\\u%04x", c);
  }
  putchar('"');
}

static void put_str(const char *s) { put_bytes(s, strlen(s)); }

static void dump_request(const pd_http_request *m, size_t consumed) {
  printf("{\"method\": ");
  put_str(m->method);
  printf(", \"target\": ");
  put_str(m->target);
  printf(", \"path\": ");
  put_str(m->path);
  printf(", \"query\": ");
  put_str(m->query);
  printf(", \"minor\": %d, \"headers\": [", m->version_minor);
  for (size_t i = 0; i < m->num_headers; i++) {
    printf(i ? ", [" : "[");
    put_str(m->headers[i].name);
    printf(", ");
    put_str(m->headers[i].value);
    printf("]");
  }
  printf("], \"body\": ");
  put_bytes(m->body, m->body_len);
  printf(", \"keep_alive\": %s, \"chunked\": %s, \"expect_continue\": %s, \"consumed\": %zu}",
         m->keep_alive ? "true" : "false", m->chunked ? "true" : "false",
         m->expect_continue ? "true" : "false", consumed);
}

static void parse_stream(pd_http_parser *p, const char *d, size_t n) {
  size_t off = 0;
  int count = 0;
  printf("{\"requests\": [");
  pd_http_parser_reset(p);
  for (;;) {
    size_t used = 0;
    size_t start = off;
    pd_http_parse_result r;
    do { /* after HEAD, the body follows in the same bytes */
      r = pd_http_parser_feed(p, d + off, n - off, &used);
      off += used;
    } while (r == PD_HTTP_PARSE_HEAD && off < n);
    if (r == PD_HTTP_PARSE_DONE) {
      const pd_http_request *m = pd_http_parser_request(p);
      if (count++) printf(", ");
      dump_request(m, off - start);
      bool ka = m->keep_alive;
      pd_http_parser_reset(p);
      if (off == n) {
        printf("], \"end\": \"done\"}\n");
        return;
      }
      if (!ka) {
        printf("], \"end\": \"close\"}\n");
        return;
      }
      continue;
    }
    if (r == PD_HTTP_PARSE_ERROR) {
      printf("], \"end\": \"error\", \"status\": %d, \"error\": ", pd_http_parser_error_status(p));
      put_str(pd_http_parser_error_msg(p));
      printf("}\n");
      return;
    }
    printf("], \"end\": \"more\"}\n"); /* MORE, or HEAD with the body still to come */
    return;
  }
}

int main(void) {
  pd_http_config c;
  pd_http_config_default(&c);
  pd_err e = {0};
  pd_http_parser *p = pd_http_parser_new(&c.limits, &e);
  if (!p) {
    fprintf(stderr, "http_parse_dump: %s\n", e.msg);
    return 1;
  }
  unsigned char len4[4];
  while (fread(len4, 1, 4, stdin) == 4) {
    size_t n = (size_t)len4[0] | (size_t)len4[1] << 8 | (size_t)len4[2] << 16 |
               (size_t)len4[3] << 24;
    char *buf = malloc(n ? n : 1);
    if (!buf || fread(buf, 1, n, stdin) != n) {
      fprintf(stderr, "http_parse_dump: a record is cut short\n");
      return 1;
    }
    parse_stream(p, buf, n);
    free(buf);
  }
  pd_http_parser_free(p);
  return fflush(stdout) == 0 ? 0 : 1;
}
