/* Logging, clocks, ready files and path helpers shared by every pdserve program (libpdutil). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "pd/log.h"

/* ---- logging ---- */

static const char *g_prog = "pd";
static bool g_verbose;

void pd_log_init(const char *prog, bool verbose) {
  g_prog = prog;
  g_verbose = verbose;
  setvbuf(stderr, NULL, _IOLBF, 0);
}

bool pd_log_debug_on(void) { return g_verbose; }

const char *pd_log_prog(void) { return g_prog; }

void pd_log(int level, const char *fmt, ...) {
  if (level == PD_LOG_DEBUG && !g_verbose) return;
  static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  struct timeval tv;
  gettimeofday(&tv, NULL);
  struct tm tm;
  gmtime_r(&tv.tv_sec, &tm);
  char ts[32];
  strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* one fprintf per line, so lines of concurrent threads never interleave */
  fprintf(stderr, "%s.%03dZ %s %s %s\n", ts, (int)(tv.tv_usec / 1000), g_prog,
          names[level < 0 ? 0 : level > 3 ? 3 : level], msg);
}

/* ---- clocks ---- */

int64_t pd_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

double pd_mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double pd_wall_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- files ---- */

pd_status pd_ready_file_write(const char *path, const cJSON *obj, pd_err *e) {
  char *text = cJSON_PrintUnformatted(obj);
  if (!text) return pd_err_set(e, PD_ENOMEM, "out of memory");
  size_t n = strlen(path) + 16;
  char *tmp = malloc(n);
  if (!tmp) {
    free(text);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  snprintf(tmp, n, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  pd_status st = PD_OK;
  if (!f) {
    st = pd_err_set(e, PD_EIO, "cannot write %s: %s", tmp, strerror(errno));
  } else {
    bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (fclose(f) != 0 || !ok) st = pd_err_set(e, PD_EIO, "cannot write %s", tmp);
    else if (rename(tmp, path) != 0)
      st = pd_err_set(e, PD_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
  }
  free(tmp);
  free(text);
  return st;
}

void pd_basename(const char *dir, char *out, size_t cap) {
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/') n--;
  size_t s = n;
  while (s > 0 && dir[s - 1] != '/') s--;
  size_t k = n - s;
  if (k >= cap) k = cap - 1;
  memcpy(out, dir + s, k);
  out[k] = 0;
}

/* ---- security events in the log ---- */

bool pd_log_limit_ok(pd_log_limit *l, const char *what) {
  int64_t now = pd_now_ms();
  if (now - l->window_ms >= 10000) {
    if (l->held)
      pd_log(PD_LOG_WARN, "%llu more %s in the last %lld s were not logged one by one",
             (unsigned long long)l->held, what, (long long)((now - l->window_ms) / 1000));
    l->window_ms = now;
    l->lines = 0;
    l->held = 0;
  }
  if (l->lines < PD_LOG_LIMIT_LINES) {
    l->lines++;
    return true;
  }
  l->held++;
  return false;
}
