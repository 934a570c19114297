/* Pure HTTP helpers: header lookup, percent-decoding and query strings, reason phrases and
 * OpenAI-style error bodies. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

const char *pd_http_header_get(const pd_http_request *m, const char *name) {
  for (size_t i = 0; i < m->num_headers; i++)
    if (pdh_eq_nocase(m->headers[i].name, strlen(m->headers[i].name), name))
      return m->headers[i].value;
  return NULL;
}

bool pd_http_header_has_token(const pd_http_request *m, const char *name, const char *token) {
  for (size_t i = 0; i < m->num_headers; i++) {
    if (!pdh_eq_nocase(m->headers[i].name, strlen(m->headers[i].name), name)) continue;
    const char *v = m->headers[i].value;
    while (*v) {
      while (*v == ',' || *v == ' ' || *v == '\t') v++;
      const char *s = v;
      while (*v && *v != ',') v++;
      const char *e = v;
      while (e > s && (e[-1] == ' ' || e[-1] == '\t')) e--;
      if (e > s && pdh_eq_nocase(s, (size_t)(e - s), token)) return true;
    }
  }
  return false;
}

static int hexdig(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

pd_status pd_http_percent_decode(const char *in, size_t n, char *out, size_t cap,
                                 size_t *out_len, bool plus_is_space) {
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    char c = in[i];
    if (c == '%') {
      if (n - i < 3) return PD_EFORMAT; /* "%" needs two hex digits after it */
      int a = hexdig((unsigned char)in[i + 1]), b = hexdig((unsigned char)in[i + 2]);
      if (a < 0 || b < 0) return PD_EFORMAT;
      c = (char)(a * 16 + b);
      i += 2;
    } else if (c == '+' && plus_is_space) {
      c = ' ';
    }
    if (o + 1 >= cap) return PD_ERANGE;
    out[o++] = c;
  }
  if (cap == 0) return PD_ERANGE;
  out[o] = 0;
  if (out_len) *out_len = o;
  return PD_OK;
}

pd_status pd_http_query_get(const char *query, const char *name, char *out, size_t cap,
                            size_t *out_len) {
  const char *q = query ? query : "";
  size_t name_len = strlen(name);
  while (*q) {
    const char *amp = strchr(q, '&');
    size_t plen = amp ? (size_t)(amp - q) : strlen(q);
    const char *eq = memchr(q, '=', plen);
    size_t klen = eq ? (size_t)(eq - q) : plen;
    /* Decode the key (bounded: a key longer than the name plus escapes cannot match). */
    if (klen > 0 && klen <= 3 * name_len + 3) {
      char key[3 * 256 + 4];
      char *kb = klen < sizeof key ? key : malloc(klen + 1);
      if (!kb) return PD_ENOMEM;
      size_t kl = 0;
      pd_status st = pd_http_percent_decode(q, klen, kb, klen + 1, &kl, true);
      bool match = st == PD_OK && kl == name_len && memcmp(kb, name, kl) == 0;
      if (kb != key) free(kb);
      if (match) {
        const char *v = eq ? eq + 1 : q + plen;
        size_t vlen = eq ? plen - klen - 1 : 0;
        return pd_http_percent_decode(v, vlen, out, cap, out_len, true);
      }
    }
    if (!amp) break;
    q = amp + 1;
  }
  return PD_ENOTFOUND;
}

const char *pd_http_reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 101: return "Switching Protocols";
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 206: return "Partial Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 304: return "Not Modified";
    case 307: return "Temporary Redirect";
    case 308: return "Permanent Redirect";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 406: return "Not Acceptable";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Content";
    case 426: return "Upgrade Required";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

const char *pd_http_error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    default: break;
  }
  if (status >= 400 && status < 500) return "invalid_request_error";
  return "server_error";
}

char *pd_http_error_json(const char *message, const char *type, const char *code,
                         const char *param) {
  cJSON *root = cJSON_CreateObject();
  if (!root) return NULL;
  cJSON *err = cJSON_AddObjectToObject(root, "error");
  bool ok = err && cJSON_AddStringToObject(err, "message", message ? message : "") &&
            cJSON_AddStringToObject(err, "type", type ? type : "server_error") &&
            (param && *param ? cJSON_AddStringToObject(err, "param", param) != NULL
                             : cJSON_AddNullToObject(err, "param") != NULL) &&
            (code ? cJSON_AddStringToObject(err, "code", code) != NULL
                  : cJSON_AddNullToObject(err, "code") != NULL);
  char *s = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  if (!s) return NULL;
  /* cJSON allocates with its hooks (malloc by default); copy so callers can always free(). */
  char *copy = strdup(s);
  cJSON_free(s);
  return copy;
}
