/* pdctl's HTTP client on libcurl (http_client.h). */
#include "http_client.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pdctl.h"

const char *const pdctl_hx_kind_names[PDCTL_HX_KINDS] = {
    "none", "connect", "timeout", "http", "stream", "incomplete", "protocol"};

static pthread_once_t g_curl_once = PTHREAD_ONCE_INIT;
static CURLcode g_curl_init = CURLE_FAILED_INIT;
static void curl_init_once(void) { g_curl_init = curl_global_init(CURL_GLOBAL_DEFAULT); }

void pdctl_hx_fail(pdctl_hx *h, int kind, const char *fmt, ...) {
  if (h->err) return;
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
  char *p = realloc(*buf, c);
  if (!p) return false;
  *buf = p;
  *cap = c;
  return true;
}

/* One complete SSE line (without its end of line). */
static void sse_line(pdctl_hx *h, const char *l, size_t n, double t) {
  if (n == 0) { /* blank line: the event is complete */
    if (h->data_len && h->on_event) {
      h->data[h->data_len] = 0;
      h->on_event(h, h->data, h->data_len, t);
    }
    h->data_len = 0;
    return;
  }
  if (n < 5 || memcmp(l, "data:", 5) != 0) return; /* comments, event:, id:, retry: */
  l += 5, n -= 5;
  if (n && *l == ' ') l++, n--;
  if (!grow(&h->data, &h->data_cap, h->data_len + n + 2)) {
    pdctl_hx_fail(h, PDCTL_HX_PROTOCOL, "out of memory");
    return;
  }
  if (h->data_len) h->data[h->data_len++] = '\n';
  memcpy(h->data + h->data_len, l, n);
  h->data_len += n;
}

/* curl's write callback: the body as it arrives. */
static size_t on_body(char *p, size_t size, size_t nmemb, void *ud) {
  pdctl_hx *h = ud;
  const size_t n = size * nmemb;
  const double t = pdctl_now();
  if (!h->status) curl_easy_getinfo(h->curl, CURLINFO_RESPONSE_CODE, &h->status);
  if (h->sse && h->status == 200) {
    for (size_t i = 0; i < n && !h->err; i++) {
      char c = p[i];
      if (c == '\n') {
        size_t len = h->line_len;
        if (len && h->line[len - 1] == '\r') len--;
        sse_line(h, h->line, len, t);
        h->line_len = 0;
      } else if (!grow(&h->line, &h->line_cap, h->line_len + 1)) {
        pdctl_hx_fail(h, PDCTL_HX_PROTOCOL, "out of memory");
      } else {
        h->line[h->line_len++] = c;
      }
    }
  } else if (h->body_len < h->body_max) {
    size_t k = h->body_max - h->body_len < n ? h->body_max - h->body_len : n;
    if (!grow(&h->body, &h->body_cap, h->body_len + k + 1)) {
      pdctl_hx_fail(h, PDCTL_HX_PROTOCOL, "out of memory");
    } else {
      memcpy(h->body + h->body_len, p, k);
      h->body_len += k;
      h->body[h->body_len] = 0;
    }
  }
  return h->err ? 0 : n; /* 0 stops the transfer (CURLE_WRITE_ERROR) */
}

pd_status pdctl_hx_init(pdctl_hx *h, const char *base_url, const char *method, const char *path,
                        const char *body, const char *api_key, double timeout_s, pd_err *e) {
  memset(h, 0, sizeof *h);
  h->body_max = 2048;
  pthread_once(&g_curl_once, curl_init_once);
  if (g_curl_init != CURLE_OK)
    return pd_err_set(e, PD_EIO, "libcurl: %s", curl_easy_strerror(g_curl_init));
  if (strncasecmp(base_url, "http://", 7) && strncasecmp(base_url, "https://", 8))
    return pd_err_set(e, PD_EINVAL, "'%s': only http:// and https:// URLs are supported",
                      base_url);
  size_t bl = strlen(base_url);
  while (bl && base_url[bl - 1] == '/') bl--;
  if (bl >= 3 && !strncmp(base_url + bl - 3, "/v1", 3)) bl -= 3;
  char url[2048];
  if (bl + strlen(path) >= sizeof url) return pd_err_set(e, PD_EINVAL, "URL too long");
  memcpy(url, base_url, bl);
  strcpy(url + bl, path); /* fits: checked above */
  h->curl = curl_easy_init();
  if (!h->curl) return pd_err_set(e, PD_ENOMEM, "libcurl: cannot create a handle");
  CURL *c = h->curl;
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000.0));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, h);
  curl_easy_setopt(c, CURLOPT_PRIVATE, h);
  if (!strcmp(method, "POST") || body) {
    h->req = strdup(body ? body : "");
    if (!h->req) return pd_err_set(e, PD_ENOMEM, "out of memory");
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, h->req);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(h->req));
    h->hdrs = curl_slist_append(h->hdrs, "Content-Type: application/json");
  }
  if (strcmp(method, "GET") && strcmp(method, "POST"))
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
  if (api_key && *api_key) {
    char auth[1024];
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", api_key);
    h->hdrs = curl_slist_append(h->hdrs, auth);
  }
  h->hdrs = curl_slist_append(h->hdrs, "Expect:"); /* no 100-continue round trip */
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, h->hdrs);
  return PD_OK;
}

void pdctl_hx_done(pdctl_hx *h, CURLcode rc) {
  h->finished = true;
  if (!h->status) curl_easy_getinfo(h->curl, CURLINFO_RESPONSE_CODE, &h->status);
  if (rc == CURLE_OK || h->err) return;
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
      pdctl_hx_fail(h, PDCTL_HX_CONNECT, "%s", curl_easy_strerror(rc));
      break;
    case CURLE_OPERATION_TIMEDOUT:
      pdctl_hx_fail(h, PDCTL_HX_TIMEOUT, "no complete answer in time");
      break;
    case CURLE_GOT_NOTHING:
    case CURLE_RECV_ERROR:
    case CURLE_PARTIAL_FILE:
      pdctl_hx_fail(h, PDCTL_HX_INCOMPLETE, "the server closed the connection: %s",
                    curl_easy_strerror(rc));
      break;
    default:
      pdctl_hx_fail(h, PDCTL_HX_PROTOCOL, "%s", curl_easy_strerror(rc));
      break;
  }
}

void pdctl_hx_free(pdctl_hx *h) {
  if (h->curl) curl_easy_cleanup(h->curl);
  curl_slist_free_all(h->hdrs);
  free(h->req);
  free(h->body);
  free(h->line);
  free(h->data);
  h->curl = NULL;
  h->hdrs = NULL;
  h->req = h->body = h->line = h->data = NULL;
}

int pdctl_http(const char *url, const char *method, const char *path, const char *body,
               const char *api_key, int timeout_ms, char **resp, size_t *resp_len, pd_err *e) {
  pdctl_hx h;
  if (pdctl_hx_init(&h, url, method, path, body, api_key, timeout_ms / 1000.0, e) != PD_OK) {
    pdctl_hx_free(&h);
    return -1;
  }
  h.body_max = 8u << 20;
  pdctl_hx_done(&h, curl_easy_perform(h.curl));
  int status = -1;
  if (h.err) {
    pd_err_set(e, PD_EIO, "%s %s%s: %s", method, url, path, h.errmsg);
  } else {
    status = (int)h.status;
    if (resp) {
      *resp = h.body;
      h.body = NULL;
      if (!*resp) *resp = calloc(1, 1);
    }
    if (resp_len) *resp_len = h.body_len;
  }
  pdctl_hx_free(&h);
  return status;
}
