/* Incremental HTTP/1.1 request parser (RFC 9112), strict where leniency enables request
 * smuggling: CRLF line endings only, no obs-fold, no whitespace before a header colon,
 * Content-Length digits only and consistent, Transfer-Encoding only "chunked" (last, once) and
 * never together with Content-Length or in HTTP/1.0, Host required in HTTP/1.1.
 *
 * The head is collected into one buffer (at most max_head_bytes) and parsed in place once its
 * blank line has arrived; the body is copied into a buffer sized from Content-Length, or grown
 * while de-chunking, never beyond max_body_bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "http_internal.h"

enum {
  PS_HEAD,
  PS_BODY_CL,
  PS_CHUNK_LINE,  /* chunk-size [; ext] CRLF */
  PS_CHUNK_DATA,
  PS_CHUNK_CRLF,  /* CRLF after chunk data */
  PS_TRAILER,     /* trailer fields, then the final CRLF */
  PS_DONE,
  PS_ERROR,
};

/* Sub-states of PS_CHUNK_LINE / PS_CHUNK_CRLF / PS_TRAILER. A chunk line is RFC 9112 7.1:
 *   chunk-size [ chunk-ext ] CRLF
 *   chunk-ext  = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )
 *   chunk-ext-name = token; chunk-ext-val = token / quoted-string */
enum {
  CL_HEX,        /* chunk-size */
  CL_BWS,        /* BWS after the size: only before a ';' */
  CL_NAME0,      /* after ';': BWS, then the name's first tchar */
  CL_NAME,       /* in the name */
  CL_NAME_BWS,   /* BWS after the name: '=' or ';' follows */
  CL_VAL0,       /* after '=': BWS, then a token or a quoted-string */
  CL_TOKEN,      /* in a token value */
  CL_QUOTED,     /* in a quoted-string */
  CL_QPAIR,      /* after a backslash in a quoted-string */
  CL_VAL_END,    /* right after a quoted-string: BWS, ';' or the CR */
  CL_VAL_BWS,    /* BWS after a value: only before a ';' */
  CL_LF,
};
enum { TR_LINE_START, TR_NAME, TR_IN_LINE, TR_LINE_LF, TR_END_LF };

#define CHUNK_LINE_MAX 4096 /* bytes of one chunk-size line including extensions */
#define HEAD_INIT_CAP 1024

struct pd_http_parser {
  pd_http_limits lim;
  int state, sub;
  bool started;
  size_t skipped; /* blank-line bytes before the request line */
  bool skipped_cr; /* the last of them was a CR: an LF must follow */

  char *head; /* request line + headers, then the split path/query copy */
  size_t head_len, head_cap;
  pd_http_header *hdrs;

  char *body;
  size_t body_len, body_cap;
  uint64_t remaining;   /* Content-Length left, or bytes left of the current chunk */
  uint64_t chunk_size;  /* being parsed */
  size_t line_bytes;    /* of the current chunk-size line */
  int hex_digits;
  size_t trailer_bytes, trailer_fields;

  pd_http_request req;
  int err_status;
  const char *err_msg;
  char err_buf[96]; /* a message that names a limit */
};

bool pdh_is_tchar(unsigned char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static unsigned char lower(unsigned char c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

bool pdh_eq_nocase(const char *a, size_t n, const char *b) {
  size_t m = strlen(b);
  if (n != m) return false;
  for (size_t i = 0; i < n; i++)
    if (lower((unsigned char)a[i]) != lower((unsigned char)b[i])) return false;
  return true;
}

static pd_http_parse_result fail(pd_http_parser *p, int status, const char *msg) {
  p->state = PS_ERROR;
  p->err_status = status;
  p->err_msg = msg;
  return PD_HTTP_PARSE_ERROR;
}

/* 413, naming the limit so that a client knows what it may send. */
static pd_http_parse_result fail_body(pd_http_parser *p) {
  snprintf(p->err_buf, sizeof p->err_buf, "request body too large: the limit is %zu bytes",
           p->lim.max_body_bytes);
  return fail(p, 413, p->err_buf);
}

pd_http_parser *pd_http_parser_new(const pd_http_limits *lim, pd_err *e) {
  if (!lim || lim->max_head_bytes < 32 || lim->max_headers < 1 ||
      lim->max_body_bytes > ((size_t)1 << 40)) {
    pd_err_set(e, PD_EINVAL,
               "http parser: bad limits (head >= 32 bytes, >= 1 header, body <= 1 TiB)");
    return NULL;
  }
  pd_http_parser *p = calloc(1, sizeof *p);
  if (!p) {
    pd_err_set(e, PD_ENOMEM, "http parser: out of memory");
    return NULL;
  }
  p->lim = *lim;
  pd_http_parser_reset(p);
  return p;
}

void pd_http_parser_free(pd_http_parser *p) {
  if (!p) return;
  free(p->head);
  free(p->hdrs);
  free(p->body);
  free(p);
}

void pd_http_parser_reset(pd_http_parser *p) {
  /* The head buffer is kept for the next request when it is small (most are); the rest goes. */
  if (p->head && p->head_cap > 4 * HEAD_INIT_CAP) {
    free(p->head);
    p->head = NULL;
    p->head_cap = 0;
  }
  free(p->hdrs);
  p->hdrs = NULL;
  free(p->body);
  p->body = NULL;
  p->body_len = p->body_cap = 0;
  p->head_len = 0;
  p->state = PS_HEAD;
  p->sub = 0;
  p->started = false;
  p->skipped = 0;
  p->skipped_cr = false;
  p->remaining = p->chunk_size = 0;
  p->line_bytes = 0;
  p->hex_digits = 0;
  p->trailer_bytes = p->trailer_fields = 0;
  memset(&p->req, 0, sizeof p->req);
  p->err_status = 0;
  p->err_msg = NULL;
}

const pd_http_request *pd_http_parser_request(const pd_http_parser *p) { return &p->req; }
bool pd_http_parser_started(const pd_http_parser *p) { return p->started; }
int pd_http_parser_error_status(const pd_http_parser *p) { return p->err_status; }
const char *pd_http_parser_error_msg(const pd_http_parser *p) {
  return p->err_msg ? p->err_msg : "";
}

void pdh_parser_take(pd_http_parser *p, char **head, pd_http_header **hdrs, char **body,
                     pd_http_request *msg) {
  *msg = p->req;
  *head = p->head;
  *hdrs = p->hdrs;
  *body = p->body;
  p->head = NULL;
  p->head_cap = 0;
  p->hdrs = NULL;
  p->body = NULL;
  pd_http_parser_reset(p);
}

static bool reserve_head(pd_http_parser *p, size_t need) {
  if (need <= p->head_cap) return true;
  size_t cap = p->head_cap ? p->head_cap : HEAD_INIT_CAP;
  while (cap < need) cap *= 2;
  char *h = realloc(p->head, cap);
  if (!h) return false;
  p->head = h;
  p->head_cap = cap;
  return true;
}

/* ---- head ------------------------------------------------------------------------------- */

static bool is_ows(char c) { return c == ' ' || c == '\t'; }

/* Field-value byte: HTAB, SP, VCHAR, obs-text. */
static bool is_field_char(unsigned char c) { return c == '\t' || (c >= 0x20 && c != 0x7f); }

/* Calls fn on every element of a comma-separated list value, OWS-trimmed, empties skipped.
 * Returns false as soon as fn does. */
typedef bool (*list_fn)(const char *tok, size_t n, void *ud);
static bool for_each_token(const char *v, list_fn fn, void *ud) {
  while (*v) {
    while (*v == ',' || is_ows(*v)) v++;
    const char *s = v;
    while (*v && *v != ',') v++;
    const char *end = v;
    while (end > s && is_ows(end[-1])) end--;
    if (end > s && !fn(s, (size_t)(end - s), ud)) return false;
  }
  return true;
}

typedef struct te_state {
  int count;         /* codings seen */
  int chunked_count; /* of which "chunked" */
  bool last_chunked; /* the most recent one was "chunked" */
} te_state;

static bool te_token(const char *t, size_t n, void *ud) {
  te_state *s = ud;
  s->count++;
  s->last_chunked = pdh_eq_nocase(t, n, "chunked");
  if (s->last_chunked) s->chunked_count++;
  return true;
}

typedef struct conn_tokens {
  bool close, keep_alive;
} conn_tokens;

static bool conn_token(const char *t, size_t n, void *ud) {
  conn_tokens *c = ud;
  if (pdh_eq_nocase(t, n, "close")) c->close = true;
  if (pdh_eq_nocase(t, n, "keep-alive")) c->keep_alive = true;
  return true;
}

static int hexval(unsigned char c);

/* Why t[0, n) is not a request-target of RFC 9112 3.2, by its characters (RFC 3986): NULL when
 * it is made of unreserved characters, sub-delims, ':', '@', '/', '?' and pct-encoded octets
 * ('%' and two hex digits), with '[' and ']' only in the authority of an absolute-form target
 * (an IP literal). So no CTL, SP or non-ASCII byte, no '#' (a fragment is never sent), and
 * none of " < > \ ^ ` { | }: a target two parsers could split or decode differently is
 * refused (RFC 9112 3: an invalid request-line gets 400). The forms are checked later. */
static const char *target_invalid(const char *t, size_t n) {
  const char *auth = NULL, *auth_end = NULL;
  if (n && t[0] != '/') {
    const char *sl = memchr(t, '/', n);
    if (sl && sl > t && sl[-1] == ':' && (size_t)(sl - t) + 1 < n && sl[1] == '/') {
      auth = sl + 2;
      for (auth_end = auth; auth_end < t + n && *auth_end != '/' && *auth_end != '?';) auth_end++;
    }
  }
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)t[i];
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
        (c && strchr("-._~!$&'()*+,;=:@/?", c)))
      continue;
    if (c == '%') {
      if (i + 2 >= n || hexval((unsigned char)t[i + 1]) < 0 || hexval((unsigned char)t[i + 2]) < 0)
        return "invalid percent-encoding in request target";
      i += 2;
      continue;
    }
    if ((c == '[' || c == ']') && auth && t + i >= auth && t + i < auth_end) continue;
    return "invalid character in request target";
  }
  return NULL;
}

/* Parses head[0, head_len), which ends with CRLF CRLF, in place. */
static pd_http_parse_result parse_head(pd_http_parser *p) {
  char *h = p->head;
  size_t n = p->head_len;

  /* Lines: every LF must follow a CR, no other CR, no NUL. Count header lines. */
  size_t lines = 0, first_line_len = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)h[i];
    if (c == '\n') {
      if (i == 0 || h[i - 1] != '\r') return fail(p, 400, "bare LF in request head");
      if (lines == 0) first_line_len = i - 1;
      lines++;
    } else if (c == '\r') {
      if (i + 1 >= n || h[i + 1] != '\n') return fail(p, 400, "bare CR in request head");
    } else if (c == 0) {
      return fail(p, 400, "NUL byte in request head");
    }
  }
  /* lines = request line + fields + blank line */
  size_t nfields = lines >= 2 ? lines - 2 : 0;
  if (nfields > p->lim.max_headers) return fail(p, 431, "too many header fields");

  /* Room behind the head for "path\0query\0" (at most the target's length + 2), reserved
   * before any pointer into the buffer is taken. */
  if (!reserve_head(p, n + first_line_len + 3)) return fail(p, 500, "out of memory");
  h = p->head;

  /* Request line: method SP target SP HTTP/1.x */
  char *line = h, *eol = h + first_line_len;
  *eol = 0;
  char *sp1 = memchr(line, ' ', first_line_len);
  if (!sp1 || sp1 == line) return fail(p, 400, "malformed request line");
  for (char *c = line; c < sp1; c++)
    if (!pdh_is_tchar((unsigned char)*c)) return fail(p, 400, "invalid method");
  char *target = sp1 + 1;
  char *sp2 = memchr(target, ' ', (size_t)(eol - target));
  if (!sp2 || sp2 == target) return fail(p, 400, "malformed request line");
  const char *why = target_invalid(target, (size_t)(sp2 - target));
  if (why) return fail(p, 400, why);
  char *ver = sp2 + 1;
  size_t vlen = (size_t)(eol - ver);
  if (vlen != 8 || memcmp(ver, "HTTP/", 5) != 0 || ver[5] < '0' || ver[5] > '9' ||
      ver[6] != '.' || ver[7] < '0' || ver[7] > '9')
    return fail(p, 400, "malformed HTTP version");
  if (ver[5] != '1') return fail(p, 505, "only HTTP/1.x is supported");
  int minor = ver[7] - '0';
  *sp1 = 0;
  *sp2 = 0;
  p->req.method = line;
  p->req.target = target;
  p->req.version_minor = minor >= 1 ? 1 : 0; /* a later 1.x is answered as 1.1 (RFC 9110 2.5) */

  /* Header fields. */
  p->hdrs = calloc(nfields ? nfields : 1, sizeof *p->hdrs);
  if (!p->hdrs) return fail(p, 500, "out of memory");
  size_t nh = 0;
  char *cur = eol + 2;
  char *end = h + n - 2; /* the final blank line's CR */
  bool cl_seen = false, te_seen = false, expect_continue = false, expect_other = false;
  bool cl_bad = false;
  uint64_t cl = 0;
  int host_count = 0;
  te_state te = {0};
  conn_tokens ct = {0};
  while (cur < end) {
    char *le = memchr(cur, '\r', (size_t)(end - cur) + 1);
    PD_ASSERT(le && le[1] == '\n');
    *le = 0;
    if (is_ows(*cur)) return fail(p, 400, "obsolete line folding is not accepted");
    char *colon = strchr(cur, ':');
    if (!colon || colon == cur) return fail(p, 400, "malformed header field");
    for (char *c = cur; c < colon; c++)
      if (!pdh_is_tchar((unsigned char)*c)) return fail(p, 400, "invalid header field name");
    char *v = colon + 1;
    while (is_ows(*v)) v++;
    char *ve = le;
    while (ve > v && is_ows(ve[-1])) ve--;
    for (char *c = v; c < ve; c++)
      if (!is_field_char((unsigned char)*c)) return fail(p, 400, "invalid header field value");
    *colon = 0;
    *ve = 0;
    size_t name_len = (size_t)(colon - cur);
    p->hdrs[nh].name = cur;
    p->hdrs[nh].value = v;
    nh++;

    if (pdh_eq_nocase(cur, name_len, "content-length")) {
      uint64_t val = 0;
      bool ok = *v != 0;
      for (char *c = v; *c && ok; c++) {
        if (*c < '0' || *c > '9') {
          ok = false;
        } else if (val > (UINT64_MAX - 9) / 10) {
          val = UINT64_MAX; /* saturate: over any limit */
        } else {
          val = val * 10 + (uint64_t)(*c - '0');
        }
      }
      if (!ok || (cl_seen && val != cl)) cl_bad = true;
      cl_seen = true;
      cl = val;
    } else if (pdh_eq_nocase(cur, name_len, "transfer-encoding")) {
      te_seen = true;
      for_each_token(v, te_token, &te);
    } else if (pdh_eq_nocase(cur, name_len, "connection")) {
      for_each_token(v, conn_token, &ct);
    } else if (pdh_eq_nocase(cur, name_len, "expect")) {
      if (pdh_eq_nocase(v, strlen(v), "100-continue"))
        expect_continue = true;
      else
        expect_other = true;
    } else if (pdh_eq_nocase(cur, name_len, "host")) {
      host_count++;
    }
    cur = le + 2;
  }
  p->req.headers = p->hdrs;
  p->req.num_headers = nh;

  /* Framing and semantics, most fundamental first. */
  if (cl_bad) return fail(p, 400, "invalid Content-Length");
  if (te_seen) {
    if (minor == 0) return fail(p, 400, "Transfer-Encoding in an HTTP/1.0 request");
    if (cl_seen) return fail(p, 400, "both Transfer-Encoding and Content-Length");
    if (te.count == 0 || !te.last_chunked || te.chunked_count != 1)
      return fail(p, 400, "Transfer-Encoding must end with a single chunked");
  }
  if (minor >= 1 ? host_count != 1 : host_count > 1)
    return fail(p, 400, "HTTP/1.1 requires exactly one Host header");
  if (te_seen && te.count > 1) return fail(p, 501, "unsupported transfer coding");
  if (expect_other) return fail(p, 417, "unsupported expectation");
  if (cl_seen && cl > p->lim.max_body_bytes) return fail_body(p);

  /* Target forms: origin ("/p?q"), asterisk ("*", OPTIONS only), absolute ("http://h/p?q"). */
  const char *t = target;
  if (*t == '*' && t[1] == 0) {
    if (strcmp(line, "OPTIONS") != 0) return fail(p, 400, "'*' target is only for OPTIONS");
  } else if (*t != '/') {
    size_t sl = 0;
    if (strncasecmp(t, "http://", 7) == 0)
      sl = 7;
    else if (strncasecmp(t, "https://", 8) == 0)
      sl = 8;
    if (!sl) return fail(p, 400, "unsupported request target form");
    t += sl;
    while (*t && *t != '/' && *t != '?') t++;
  }
  char *out = h + n; /* the reserved room */
  const char *q = strchr(t, '?');
  size_t plen = q ? (size_t)(q - t) : strlen(t);
  p->req.path = out;
  if (plen == 0) {
    *out++ = '/';
  } else {
    memcpy(out, t, plen);
    out += plen;
  }
  *out++ = 0;
  p->req.query = out;
  if (q) {
    size_t ql = strlen(q + 1);
    memcpy(out, q + 1, ql);
    out += ql;
  }
  *out = 0;

  p->req.keep_alive = minor >= 1 ? !ct.close : (ct.keep_alive && !ct.close);
  p->req.expect_continue = expect_continue && minor >= 1; /* ignored in 1.0 (RFC 9110 10.1.1) */
  p->req.chunked = te_seen;
  p->req.body = "";
  p->req.body_len = 0;

  if (te_seen) {
    p->state = PS_CHUNK_LINE;
    p->sub = CL_HEX;
    return PD_HTTP_PARSE_HEAD;
  }
  if (cl > 0) {
    p->body = malloc((size_t)cl + 1);
    if (!p->body) return fail(p, 500, "out of memory");
    p->body_cap = (size_t)cl + 1;
    p->remaining = cl;
    p->state = PS_BODY_CL;
    return PD_HTTP_PARSE_HEAD;
  }
  p->state = PS_DONE;
  return PD_HTTP_PARSE_DONE;
}

/* Appends head bytes; returns the result and sets *used. */
static pd_http_parse_result feed_head(pd_http_parser *p, const char *d, size_t len,
                                      size_t *used) {
  size_t i = 0;
  if (p->head_len == 0) {
    /* RFC 9112 2.2: ignore blank lines (CRLF, or a bare LF) before the request line (bounded);
     * a bare CR there is invalid (2.2: a bare CR makes its element invalid). Both errors are
     * found byte by byte, so the first in the stream is the one reported however it arrives. */
    for (; i < len && (d[i] == '\r' || d[i] == '\n'); i++) {
      if (p->skipped_cr && d[i] != '\n') break;
      p->skipped_cr = d[i] == '\r';
      p->started = true;
      if (++p->skipped > p->lim.max_head_bytes) {
        *used = i + 1;
        return fail(p, 400, "too many blank lines before the request");
      }
    }
    if (p->skipped_cr && i < len) {
      *used = i;
      return fail(p, 400, "bare CR before the request line");
    }
    if (i == len) {
      *used = len;
      return PD_HTTP_PARSE_MORE;
    }
  }
  p->started = true;
  size_t before = p->head_len;
  size_t room = p->lim.max_head_bytes - before;
  size_t take = len - i < room ? len - i : room;
  if (!reserve_head(p, before + take + 1)) {
    *used = i;
    return fail(p, 500, "out of memory");
  }
  memcpy(p->head + before, d + i, take);
  size_t total = before + take;
  /* Not HTTP at all: refuse now rather than wait 30 s for a head that never ends. The method
   * is checked as it arrives (1 to 32 token characters, then a space). A TLS ClientHello
   * (record type 0x16) would not understand an HTTP answer: it gets none. */
  size_t mlim = total < 33 ? total : 33;
  bool method_done = before > 0 && memchr(p->head, ' ', before < mlim ? before : mlim);
  for (size_t k = before; !method_done && k < mlim; k++) {
    unsigned char ch = (unsigned char)p->head[k];
    if (ch == ' ' && k > 0) break;
    if (!pdh_is_tchar(ch) || k == 32) {
      *used = i + take;
      if (k == 0 && ch == 0x16) return fail(p, 0, "a TLS handshake on a plain-text HTTP port");
      return fail(p, 400, "not an HTTP request");
    }
  }
  size_t from = before >= 3 ? before - 3 : 0;
  const char *hit = total - from >= 4 ? memmem(p->head + from, total - from, "\r\n\r\n", 4) : NULL;
  size_t endpos = hit ? (size_t)(hit - p->head) + 4 : total;
  /* Reject a bare LF as soon as it arrives: a client using LF-only line ends would otherwise
   * wait for a CRLF CRLF that never comes. (parse_head checks CRs too.) */
  for (size_t k = before; k < endpos; k++) {
    if (p->head[k] == '\n' && (k == 0 || p->head[k - 1] != '\r')) {
      p->head_len = endpos;
      *used = i + (endpos - before);
      return fail(p, 400, "bare LF in request head");
    }
  }
  if (hit) {
    p->head_len = endpos;
    *used = i + (endpos - before);
    return parse_head(p);
  }
  p->head_len = total;
  *used = i + take;
  if (total >= p->lim.max_head_bytes) {
    if (!memchr(p->head, '\n', total)) return fail(p, 414, "request line too long");
    return fail(p, 431, "request header fields too large");
  }
  return PD_HTTP_PARSE_MORE;
}

/* ---- body ------------------------------------------------------------------------------- */

static bool body_append(pd_http_parser *p, const char *d, size_t n) {
  if (p->body_len + n + 1 > p->body_cap) {
    size_t cap = p->body_cap ? p->body_cap : 4096;
    while (cap < p->body_len + n + 1) cap *= 2;
    if (cap > p->lim.max_body_bytes + 1) cap = p->lim.max_body_bytes + 1;
    char *b = realloc(p->body, cap);
    if (!b) return false;
    p->body = b;
    p->body_cap = cap;
  }
  memcpy(p->body + p->body_len, d, n);
  p->body_len += n;
  return true;
}

static int hexval(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* The chunk-line sub-state after byte c in state st (CL_BWS .. CL_VAL_END), or -1 when c may
 * not come there. Whitespace only where RFC 9112 7.1.1 has BWS; nothing after the size but
 * extensions (a "5 " line is refused: whitespace without a ';' is no extension, and a parser
 * that skipped it could disagree with one that did not on where the chunk starts). */
static int chunk_ext_step(int st, unsigned char c) {
  bool ws = c == ' ' || c == '\t';
  switch (st) {
    case CL_BWS: return ws ? CL_BWS : c == ';' ? CL_NAME0 : -1;
    case CL_NAME0: return ws ? CL_NAME0 : pdh_is_tchar(c) ? CL_NAME : -1;
    case CL_NAME:
      if (pdh_is_tchar(c)) return CL_NAME;
      return ws ? CL_NAME_BWS : c == '=' ? CL_VAL0 : c == ';' ? CL_NAME0 : c == '\r' ? CL_LF : -1;
    case CL_NAME_BWS: return ws ? CL_NAME_BWS : c == '=' ? CL_VAL0 : c == ';' ? CL_NAME0 : -1;
    case CL_VAL0: return ws ? CL_VAL0 : c == '"' ? CL_QUOTED : pdh_is_tchar(c) ? CL_TOKEN : -1;
    case CL_TOKEN:
      if (pdh_is_tchar(c)) return CL_TOKEN;
      return ws ? CL_VAL_BWS : c == ';' ? CL_NAME0 : c == '\r' ? CL_LF : -1;
    case CL_QUOTED: /* qdtext = HTAB / SP / %x21 / %x23-5B / %x5D-7E / obs-text */
      if (c == '"') return CL_VAL_END;
      if (c == '\\') return CL_QPAIR;
      return ws || (c >= 0x21 && c != 0x7f) ? CL_QUOTED : -1;
    case CL_QPAIR: return ws || (c >= 0x21 && c != 0x7f) ? CL_QUOTED : -1;
    case CL_VAL_END: return ws ? CL_VAL_BWS : c == ';' ? CL_NAME0 : c == '\r' ? CL_LF : -1;
    case CL_VAL_BWS: return ws ? CL_VAL_BWS : c == ';' ? CL_NAME0 : -1;
    default: return -1;
  }
}

static pd_http_parse_result finish(pd_http_parser *p) {
  if (p->body) {
    p->body[p->body_len] = 0;
    p->req.body = p->body;
  } else {
    p->req.body = "";
  }
  p->req.body_len = p->body_len;
  p->state = PS_DONE;
  return PD_HTTP_PARSE_DONE;
}

pd_http_parse_result pd_http_parser_feed(pd_http_parser *p, const void *data, size_t len,
                                         size_t *consumed) {
  const char *d = data;
  size_t i = 0;
  *consumed = 0;
  if (p->state == PS_DONE) return PD_HTTP_PARSE_DONE;
  if (p->state == PS_ERROR) return PD_HTTP_PARSE_ERROR;
  if (p->state == PS_HEAD) {
    size_t used = 0;
    pd_http_parse_result r = feed_head(p, d, len, &used);
    *consumed = used;
    return r;
  }
  while (i < len) {
    unsigned char c = (unsigned char)d[i];
    switch (p->state) {
      case PS_BODY_CL: {
        size_t n = len - i;
        if (n > p->remaining) n = (size_t)p->remaining;
        memcpy(p->body + p->body_len, d + i, n);
        p->body_len += n;
        p->remaining -= n;
        i += n;
        if (p->remaining == 0) {
          *consumed = i;
          return finish(p);
        }
        break;
      }
      case PS_CHUNK_LINE:
        i++;
        if (++p->line_bytes > CHUNK_LINE_MAX) {
          *consumed = i;
          return fail(p, 400, "chunk size line too long");
        }
        if (p->sub == CL_HEX) {
          int v = hexval(c);
          if (v >= 0) {
            p->chunk_size = p->chunk_size * 16 + (uint64_t)v;
            p->hex_digits++;
            if (p->body_len + p->chunk_size > p->lim.max_body_bytes) {
              *consumed = i;
              return fail_body(p);
            }
          } else if (p->hex_digits > 0 && c == ';') {
            p->sub = CL_NAME0;
          } else if (p->hex_digits > 0 && (c == ' ' || c == '\t')) {
            p->sub = CL_BWS;
          } else if (p->hex_digits > 0 && c == '\r') {
            p->sub = CL_LF;
          } else {
            *consumed = i;
            return fail(p, 400, "malformed chunk size");
          }
        } else if (p->sub != CL_LF) {
          int next = chunk_ext_step(p->sub, c);
          if (next < 0) {
            *consumed = i;
            return fail(p, 400, p->sub == CL_BWS ? "malformed chunk size"
                                                 : "malformed chunk extension");
          }
          p->sub = next;
        } else { /* CL_LF */
          if (c != '\n') {
            *consumed = i;
            return fail(p, 400, "chunk size line not ended by CRLF");
          }
          if (p->chunk_size == 0) {
            p->state = PS_TRAILER;
            p->sub = TR_LINE_START;
          } else {
            p->remaining = p->chunk_size;
            p->state = PS_CHUNK_DATA;
          }
          p->chunk_size = 0;
          p->hex_digits = 0;
          p->line_bytes = 0;
        }
        break;
      case PS_CHUNK_DATA: {
        size_t n = len - i;
        if (n > p->remaining) n = (size_t)p->remaining;
        if (!body_append(p, d + i, n)) {
          *consumed = i;
          return fail(p, 500, "out of memory");
        }
        p->remaining -= n;
        i += n;
        if (p->remaining == 0) {
          p->state = PS_CHUNK_CRLF;
          p->sub = 0;
        }
        break;
      }
      case PS_CHUNK_CRLF:
        i++;
        if (c != (p->sub == 0 ? '\r' : '\n')) {
          *consumed = i;
          return fail(p, 400, "chunk data not followed by CRLF");
        }
        if (p->sub == 0) {
          p->sub = 1;
        } else {
          p->state = PS_CHUNK_LINE;
          p->sub = CL_HEX;
        }
        break;
      case PS_TRAILER:
        i++;
        if (++p->trailer_bytes > p->lim.max_head_bytes) {
          *consumed = i;
          return fail(p, 431, "trailer fields too large");
        }
        switch (p->sub) {
          case TR_LINE_START:
            if (c == '\r') {
              p->sub = TR_END_LF;
            } else if (!pdh_is_tchar(c)) {
              *consumed = i;
              return fail(p, 400, "malformed trailer field");
            } else {
              if (++p->trailer_fields > p->lim.max_headers) {
                *consumed = i;
                return fail(p, 431, "too many trailer fields");
              }
              p->sub = TR_NAME;
            }
            break;
          case TR_NAME:
            if (c == ':') {
              p->sub = TR_IN_LINE;
            } else if (!pdh_is_tchar(c)) {
              *consumed = i;
              return fail(p, 400, "malformed trailer field");
            }
            break;
          case TR_IN_LINE:
            if (c == '\r') {
              p->sub = TR_LINE_LF;
            } else if (!is_field_char(c)) {
              *consumed = i;
              return fail(p, 400, "malformed trailer field");
            }
            break;
          case TR_LINE_LF:
            if (c != '\n') {
              *consumed = i;
              return fail(p, 400, "trailer field not ended by CRLF");
            }
            p->sub = TR_LINE_START;
            break;
          default: /* TR_END_LF */
            if (c != '\n') {
              *consumed = i;
              return fail(p, 400, "chunked body not ended by CRLF");
            }
            *consumed = i;
            return finish(p);
        }
        break;
      default:
        PD_ASSERT(0 && "unreachable parser state");
    }
  }
  *consumed = i;
  return PD_HTTP_PARSE_MORE;
}
