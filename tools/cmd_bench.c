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
 * The client is libcurl's multi interface on one thread (http_client.h): the requests in flight
 * share one poll loop, so the measuring client costs little CPU next to the server on the same
 * machine, and every chunk is timed on arrival on one clock (CLOCK_MONOTONIC).
 *
 * Random prompts are token ids ("prompt": [ids]) so the input length is exact; ids are drawn
 * uniformly from the non-special ids of --tokenizer DIR when given, else from [10, --vocab-size).
 * Every request sets max_tokens = the output length and ignore_eos, so output lengths are
 * exact too. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "http_client.h"
#include "pdctl.h"

#define ERR_NONE PDCTL_HX_OK
#define ERR_CONNECT PDCTL_HX_CONNECT
#define ERR_TIMEOUT PDCTL_HX_TIMEOUT
#define ERR_HTTP PDCTL_HX_HTTP
#define ERR_STREAM PDCTL_HX_STREAM
#define ERR_INCOMPLETE PDCTL_HX_INCOMPLETE
#define ERR_PROTOCOL PDCTL_HX_PROTOCOL
#define ERR_KINDS PDCTL_HX_KINDS
#define k_err_names pdctl_hx_kind_names
#define ERRBODY_MAX 2048

static double now_s(void) { return pdctl_now(); }

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
  const char *url; /* http[s]://host:port[/prefix] */
  const char *api_key, *model, *endpoint;
  bool chat;
  double temperature;
  bprompt *prompts;
  int n;
  bres *res;
  double t0;
} bench;

typedef struct slot {
  pdctl_hx h;
  int idx; /* request index, -1 when free */
  double deadline;
} slot;

/* One SSE event of request r. */
static void on_event(pdctl_hx *h, const char *data, size_t len, double t) {
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
    pdctl_hx_fail(h, ERR_PROTOCOL, "an SSE event that is not JSON: %.60s", data);
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
            pdctl_hx_fail(h, ERR_PROTOCOL, "out of memory");
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
  pdctl_hx *h = &s->h;
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
    snprintf(r->errmsg, sizeof r->errmsg, "HTTP %ld: %s", h->status, msg);
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
  pdctl_hx_free(h);
  s->idx = -1;
}

static volatile sig_atomic_t g_stop;
static void on_sigint(int sig) { (void)sig; g_stop = 1; }

/* Runs the requests: arrivals at b->res[i].t_sched, at most conc at once (0 = unlimited).
 * Returns the wall time of the run. */
static double run(bench *b, int conc, double timeout_s, bool progress) {
  int max_slots = conc > 0 ? conc : b->n;
  slot *slots = calloc((size_t)max_slots, sizeof *slots);
  void **uds = calloc((size_t)max_slots * 2, sizeof *uds);
  CURLM *multi = curl_multi_init();
  if (!slots || !uds || !multi) {
    free(slots);
    free(uds);
    if (multi) curl_multi_cleanup(multi);
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
          curl_multi_remove_handle(multi, slots[i].h.curl);
          pdctl_hx_fail(&slots[i].h, ERR_TIMEOUT, "interrupted");
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
      r->ttft = -1;
      r->prompt_tokens = r->completion_tokens = -1;
      pd_err e = {0};
      pd_status st = body ? pdctl_hx_init(&s->h, b->url, "POST", api_path(b), body, b->api_key,
                                          timeout_s, &e)
                          : pd_err_set(&e, PD_ENOMEM, "out of memory");
      free(body);
      s->h.sse = true;
      s->h.body_max = ERRBODY_MAX;
      s->h.on_event = on_event;
      uds[2 * k] = b;
      uds[2 * k + 1] = r;
      s->h.ud = &uds[2 * k];
      s->idx = next;
      running++;
      next++;
      r->t_start = now_s();
      if (st == PD_OK && curl_multi_add_handle(multi, s->h.curl) != CURLM_OK)
        st = pd_err_set(&e, PD_EIO, "libcurl refused the request");
      if (st != PD_OK) {
        pdctl_hx_fail(&s->h, ERR_CONNECT, "%s", e.msg);
        finish(b, s, now_s());
        running--, done++;
        failed += !b->res[next - 1].ok;
      }
    }
    /* let curl move the transfers; wake for the next arrival and the progress tick */
    double wake = t + 0.25;
    if (next < b->n && running < max_slots && b->t0 + b->res[next].t_sched < wake)
      wake = b->t0 + b->res[next].t_sched;
    int ms = (int)ceil((wake - now_s()) * 1000.0);
    if (ms < 0) ms = 0;
    int active = 0;
    if (running > 0 && curl_multi_poll(multi, NULL, 0, ms, NULL) != CURLM_OK) {
      fprintf(stderr, "pdctl: curl_multi_poll failed\n");
      g_stop = 1;
      continue;
    }
    if (running == 0 && ms > 0) {
      struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
    curl_multi_perform(multi, &active);
    t = now_s();
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(multi, &left))) {
      if (m->msg != CURLMSG_DONE) continue;
      pdctl_hx *h = NULL;
      curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&h);
      slot *s = NULL;
      for (int i = 0; i < max_slots && !s; i++)
        if (slots[i].idx >= 0 && &slots[i].h == h) s = &slots[i];
      if (!s) continue;
      CURLcode rc = m->data.result;
      curl_multi_remove_handle(multi, s->h.curl); /* m is invalid from here on */
      pdctl_hx_done(&s->h, rc);
      if (s->h.err == ERR_TIMEOUT)
        snprintf(s->h.errmsg, sizeof s->h.errmsg, "no complete answer within %.0f s",
                 timeout_s);
      int idx = s->idx;
      finish(b, s, t);
      running--, done++;
      if (!b->res[idx].ok) failed++;
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
  curl_multi_cleanup(multi);
  free(slots);
  free(uds);
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

/* The router's pd_router_spec_acceptance_length gauge (tokens per speculative verification of
 * its decode nodes), or 0 when it has none or cannot be read. */
static double server_spec_acceptance(const char *url, const char *api_key) {
  char *body = NULL;
  pd_err e = {0};
  double v = 0;
  if (pdctl_http(url, "GET", "/metrics", NULL, api_key, 5000, &body, NULL, &e) == 200 && body) {
    const char *k = "\npd_router_spec_acceptance_length ";
    const char *p = strstr(body, k);
    if (p) v = strtod(p + strlen(k), NULL);
  }
  free(body);
  return v > 0 && isfinite(v) ? v : 0;
}

/* --save-prompts: the requests as `pdctl generate --input` lines, in order. */
static int write_generate_input(const char *path, const bench *b) {
  FILE *f = fopen(path, "w");
  if (!f) return pdctl_fail("--save-prompts: %s: %s", path, strerror(errno));
  for (int i = 0; i < b->n; i++) {
    const bprompt *d = &b->prompts[i];
    cJSON *o = cJSON_CreateObject();
    if (d->ids) {
      cJSON *a = cJSON_AddArrayToObject(o, "prompt_ids");
      for (size_t k = 0; k < d->n_ids; k++) cJSON_AddItemToArray(a, cJSON_CreateNumber(d->ids[k]));
    } else {
      cJSON_AddStringToObject(o, "prompt", d->text);
    }
    cJSON_AddNumberToObject(o, "max_tokens", d->out_len);
    cJSON_AddBoolToObject(o, "ignore_eos", 1);
    if (b->temperature > 0) cJSON_AddNumberToObject(o, "temperature", b->temperature);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s || fputs(s, f) < 0 || fputc('\n', f) < 0) {
      free(s);
      fclose(f);
      return pdctl_fail("--save-prompts: cannot write %s", path);
    }
    free(s);
  }
  if (fclose(f) != 0) return pdctl_fail("--save-prompts: cannot write %s", path);
  return 0;
}

int cmd_bench(int argc, char **argv) {
  const char *url = NULL, *prompts_file = NULL, *svg = NULL, *endpoint = "completions",
             *model = NULL, *tok_dir = NULL, *api_key_arg = NULL, *api_key_file = NULL,
             *save_prompts = NULL;
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
      {"save-prompts", PD_OPT_STR, &save_prompts, "FILE",
       "write the requests as `pdctl generate --input` lines (prompt_ids, max_tokens, "
       "ignore_eos) and exit without sending them: the same prompts offline",
       NULL},
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
  if (!url && !save_prompts) return pdctl_fail("bench needs --url http://HOST:PORT");
  bench b;
  memset(&b, 0, sizeof b);
  if (url && strncasecmp(url, "http://", 7) && strncasecmp(url, "https://", 8))
    return pdctl_fail("--url: '%s': only http:// and https:// URLs are supported", url);
  b.url = url;
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
  }
  if (save_prompts) {
    rc = write_generate_input(save_prompts, &b);
    goto out;
  }
  for (int i = 0; i < num; i++) {
    bprompt *d = &b.prompts[i];
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
  const double spec_len = server_spec_acceptance(url, api_key);
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
    if (spec_len > 0) cJSON_AddNumberToObject(o, "spec_acceptance_length", spec_len);
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
    if (spec_len > 0) printf("%-34s %.2f\n", "Mean acceptance length (server):", spec_len);
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
