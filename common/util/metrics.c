/* Prometheus metrics registry (pd/metrics.h). Families and series live in small arrays; the
 * number of series in a process is in the tens, so linear lookups at creation are fine and
 * updates go straight through the handle. */
#include "pd/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double pd_metrics_latency_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                                             1,     2,     5,    10,   20,   30,  60};
const int pd_metrics_latency_buckets_n =
    (int)(sizeof pd_metrics_latency_buckets / sizeof pd_metrics_latency_buckets[0]);
const double pd_metrics_fine_buckets[] = {1e-5,   2.5e-5, 5e-5,  1e-4, 2.5e-4, 5e-4, 1e-3,
                                          2.5e-3, 5e-3,   0.01,  0.025, 0.05,  0.1,  0.25,
                                          0.5,    1,      2.5,   5,    10};
const int pd_metrics_fine_buckets_n =
    (int)(sizeof pd_metrics_fine_buckets / sizeof pd_metrics_fine_buckets[0]);
const double pd_metrics_itl_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                         0.1,   0.15,   0.2,   0.3,  0.5,  1,    2,    5};
const int pd_metrics_itl_buckets_n =
    (int)(sizeof pd_metrics_itl_buckets / sizeof pd_metrics_itl_buckets[0]);

typedef struct family family;

struct pd_metric {
  family *fam;
  pd_metrics *reg;
  char *labels;   /* "" or k="v",... */
  double value;   /* counter / gauge */
  double sum;     /* histogram */
  uint64_t count; /* histogram observations */
  uint64_t *buckets; /* histogram: [n_bounds] per-bucket (not cumulative) counts */
};

struct family {
  char *name, *help;
  pd_metric_type type;
  double bounds[PD_METRICS_MAX_BUCKETS];
  int n_bounds;
  pd_metric **series;
  int n_series, cap_series;
};

typedef struct collect_cb {
  void (*fn)(pd_metrics *m, void *ud);
  void *ud;
} collect_cb;

struct pd_metrics {
  pthread_mutex_t mu;
  family **fams;
  int n_fams, cap_fams;
  collect_cb cbs[8];
  int n_cbs;
};

pd_metrics *pd_metrics_new(pd_err *e) {
  pd_metrics *m = calloc(1, sizeof *m);
  if (!m) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  pthread_mutex_init(&m->mu, NULL);
  return m;
}

static void family_free(family *f) {
  for (int i = 0; i < f->n_series; i++) {
    free(f->series[i]->labels);
    free(f->series[i]->buckets);
    free(f->series[i]);
  }
  free(f->series);
  free(f->name);
  free(f->help);
  free(f);
}

void pd_metrics_free(pd_metrics *m) {
  if (!m) return;
  for (int i = 0; i < m->n_fams; i++) family_free(m->fams[i]);
  free(m->fams);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

static bool name_ok(const char *s) {
  if (!s || !*s) return false;
  for (const char *p = s; *p; p++) {
    char c = *p;
    bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(p != s && c >= '0' && c <= '9')) return false;
  }
  return true;
}

/* k="v"(,k="v")*: names well formed, values quoted with escapes. */
static bool labels_ok(const char *s) {
  const char *p = s;
  if (!*p) return true;
  for (;;) {
    const char *k = p;
    while ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' ||
           (p != k && *p >= '0' && *p <= '9'))
      p++;
    if (p == k || *p++ != '=' || *p++ != '"') return false;
    while (*p && *p != '"') {
      if (*p == '\n') return false;
      if (*p == '\\') {
        p++;
        if (*p != '\\' && *p != '"' && *p != 'n') return false;
      }
      p++;
    }
    if (*p++ != '"') return false;
    if (!*p) return true;
    if (*p++ != ',') return false;
  }
}

static char *dupstr(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

static pd_metric *get_series(pd_metrics *m, const char *name, const char *help,
                             const char *labels, pd_metric_type type, const double *bounds,
                             int n_bounds) {
  if (!m || !name_ok(name)) return NULL;
  if (!labels) labels = "";
  if (!labels_ok(labels)) return NULL;
  if (type == PD_METRIC_HISTOGRAM) {
    if (n_bounds < 1 || n_bounds > PD_METRICS_MAX_BUCKETS || !bounds) return NULL;
    for (int i = 0; i < n_bounds; i++)
      if (!isfinite(bounds[i]) || (i && bounds[i] <= bounds[i - 1])) return NULL;
  }
  pd_metric *out = NULL;
  pthread_mutex_lock(&m->mu);
  family *f = NULL;
  for (int i = 0; i < m->n_fams; i++)
    if (!strcmp(m->fams[i]->name, name)) f = m->fams[i];
  if (f) {
    if (f->type != type) goto done;
    if (type == PD_METRIC_HISTOGRAM &&
        (f->n_bounds != n_bounds || memcmp(f->bounds, bounds, (size_t)n_bounds * sizeof *bounds)))
      goto done;
    for (int i = 0; i < f->n_series; i++)
      if (!strcmp(f->series[i]->labels, labels)) {
        out = f->series[i];
        goto done;
      }
  } else {
    if (m->n_fams == m->cap_fams) {
      int cap = m->cap_fams ? 2 * m->cap_fams : 16;
      family **v = realloc(m->fams, (size_t)cap * sizeof *v);
      if (!v) goto done;
      m->fams = v;
      m->cap_fams = cap;
    }
    f = calloc(1, sizeof *f);
    if (!f) goto done;
    f->name = dupstr(name);
    f->help = dupstr(help ? help : "");
    f->type = type;
    if (type == PD_METRIC_HISTOGRAM) {
      memcpy(f->bounds, bounds, (size_t)n_bounds * sizeof *bounds);
      f->n_bounds = n_bounds;
    }
    if (!f->name || !f->help) {
      family_free(f);
      goto done;
    }
    m->fams[m->n_fams++] = f;
  }
  if (f->n_series == f->cap_series) {
    int cap = f->cap_series ? 2 * f->cap_series : 4;
    pd_metric **v = realloc(f->series, (size_t)cap * sizeof *v);
    if (!v) goto done;
    f->series = v;
    f->cap_series = cap;
  }
  pd_metric *s = calloc(1, sizeof *s);
  if (!s) goto done;
  s->fam = f;
  s->reg = m;
  s->labels = dupstr(labels);
  if (type == PD_METRIC_HISTOGRAM) s->buckets = calloc((size_t)f->n_bounds, sizeof *s->buckets);
  if (!s->labels || (type == PD_METRIC_HISTOGRAM && !s->buckets)) {
    free(s->labels);
    free(s->buckets);
    free(s);
    goto done;
  }
  f->series[f->n_series++] = s;
  out = s;
done:
  pthread_mutex_unlock(&m->mu);
  return out;
}

pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *help,
                              const char *labels) {
  return get_series(m, name, help, labels, PD_METRIC_COUNTER, NULL, 0);
}

pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *help,
                            const char *labels) {
  return get_series(m, name, help, labels, PD_METRIC_GAUGE, NULL, 0);
}

pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *help,
                                const char *labels, const double *bounds, int n_bounds) {
  return get_series(m, name, help, labels, PD_METRIC_HISTOGRAM, bounds, n_bounds);
}

void pd_metric_add(pd_metric *s, double v) {
  if (!s || !isfinite(v)) return;
  if (s->fam->type == PD_METRIC_HISTOGRAM) return;
  if (s->fam->type == PD_METRIC_COUNTER && v < 0) return;
  pthread_mutex_lock(&s->reg->mu);
  s->value += v;
  pthread_mutex_unlock(&s->reg->mu);
}

void pd_metric_set(pd_metric *s, double v) {
  if (!s || !isfinite(v) || s->fam->type != PD_METRIC_GAUGE) return;
  pthread_mutex_lock(&s->reg->mu);
  s->value = v;
  pthread_mutex_unlock(&s->reg->mu);
}

void pd_metric_observe(pd_metric *s, double v) {
  if (!s || isnan(v) || s->fam->type != PD_METRIC_HISTOGRAM) return;
  family *f = s->fam;
  int b = 0;
  while (b < f->n_bounds && v > f->bounds[b]) b++;
  pthread_mutex_lock(&s->reg->mu);
  if (b < f->n_bounds) s->buckets[b]++;
  s->count++;
  if (isfinite(v)) s->sum += v;
  pthread_mutex_unlock(&s->reg->mu);
}

double pd_metric_value(const pd_metric *s) {
  if (!s) return 0;
  pthread_mutex_lock(&s->reg->mu);
  double v = s->fam->type == PD_METRIC_HISTOGRAM ? (double)s->count : s->value;
  pthread_mutex_unlock(&s->reg->mu);
  return v;
}

pd_status pd_metrics_on_collect(pd_metrics *m, void (*fn)(pd_metrics *m, void *ud), void *ud) {
  pthread_mutex_lock(&m->mu);
  pd_status st = PD_OK;
  if (m->n_cbs == (int)(sizeof m->cbs / sizeof m->cbs[0])) st = PD_EFULL;
  else m->cbs[m->n_cbs++] = (collect_cb){fn, ud};
  pthread_mutex_unlock(&m->mu);
  return st;
}

char *pd_metrics_escape_label(const char *value, char *out, size_t cap) {
  size_t j = 0;
  if (cap == 0) return out;
  for (const char *p = value ? value : ""; *p; p++) {
    const char *rep = NULL;
    char one[2] = {*p, 0};
    if (*p == '\\') rep = "\\\\";
    else if (*p == '"') rep = "\\\"";
    else if (*p == '\n') rep = "\\n";
    else rep = one;
    size_t n = strlen(rep);
    if (j + n >= cap) break;
    memcpy(out + j, rep, n);
    j += n;
  }
  out[j] = 0;
  return out;
}

/* ---- rendering ---- */

typedef struct sbuf {
  char *p;
  size_t n, cap;
  bool oom;
} sbuf;

__attribute__((format(printf, 2, 3))) static void sb_printf(sbuf *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
      b->oom = true;
      return;
    }
    if (b->p && b->n + (size_t)k < b->cap) {
      b->n += (size_t)k;
      return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + (size_t)k + 1) cap *= 2;
    char *q = realloc(b->p, cap);
    if (!q) {
      b->oom = true;
      return;
    }
    b->p = q;
    b->cap = cap;
  }
}

/* A sample value as Prometheus writes it: integers without exponent, +Inf/-Inf/NaN named. */
static void fmt_value(char *out, size_t cap, double v) {
  if (isnan(v)) snprintf(out, cap, "NaN");
  else if (isinf(v)) snprintf(out, cap, v > 0 ? "+Inf" : "-Inf");
  else if (v == floor(v) && fabs(v) < 1e15) snprintf(out, cap, "%.0f", v);
  else {
    /* the shortest form that reads back as the same double: 0.005, not 0.0050000000000000001 */
    for (int prec = 15; prec <= 17; prec++) {
      snprintf(out, cap, "%.*g", prec, v);
      if (strtod(out, NULL) == v) break;
    }
  }
}

/* HELP text escapes backslash and newline. */
static void help_escape(sbuf *b, const char *s) {
  for (; *s; s++) {
    if (*s == '\\') sb_printf(b, "\\\\");
    else if (*s == '\n') sb_printf(b, "\\n");
    else sb_printf(b, "%c", *s);
  }
}

char *pd_metrics_render(pd_metrics *m, size_t *len) {
  collect_cb cbs[8];
  pthread_mutex_lock(&m->mu);
  int n_cbs = m->n_cbs;
  memcpy(cbs, m->cbs, sizeof cbs);
  pthread_mutex_unlock(&m->mu);
  for (int i = 0; i < n_cbs; i++) cbs[i].fn(m, cbs[i].ud);

  sbuf b = {0};
  sb_printf(&b, "%s", "");
  pthread_mutex_lock(&m->mu);
  static const char *types[] = {"counter", "gauge", "histogram"};
  for (int i = 0; i < m->n_fams; i++) {
    family *f = m->fams[i];
    sb_printf(&b, "# HELP %s ", f->name);
    help_escape(&b, f->help);
    sb_printf(&b, "\n# TYPE %s %s\n", f->name, types[f->type]);
    for (int j = 0; j < f->n_series; j++) {
      pd_metric *s = f->series[j];
      char v[64];
      bool has = s->labels[0] != 0;
      if (f->type != PD_METRIC_HISTOGRAM) {
        fmt_value(v, sizeof v, s->value);
        sb_printf(&b, "%s%s%s%s %s\n", f->name, has ? "{" : "", s->labels, has ? "}" : "", v);
        continue;
      }
      uint64_t cum = 0;
      for (int k = 0; k < f->n_bounds; k++) {
        cum += s->buckets[k];
        fmt_value(v, sizeof v, f->bounds[k]);
        sb_printf(&b, "%s_bucket{%s%sle=\"%s\"} %llu\n", f->name, s->labels, has ? "," : "", v,
                  (unsigned long long)cum);
      }
      sb_printf(&b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", f->name, s->labels, has ? "," : "",
                (unsigned long long)s->count);
      fmt_value(v, sizeof v, s->sum);
      sb_printf(&b, "%s_sum%s%s%s %s\n", f->name, has ? "{" : "", s->labels, has ? "}" : "", v);
      sb_printf(&b, "%s_count%s%s%s %llu\n", f->name, has ? "{" : "", s->labels, has ? "}" : "",
                (unsigned long long)s->count);
    }
  }
  pthread_mutex_unlock(&m->mu);
  if (b.oom) {
    free(b.p);
    return NULL;
  }
  if (len) *len = b.n;
  return b.p;
}
