/* libpdnode helpers: logging, ready files, clocks, model fingerprints, CURVE flags, signals. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "node.h"
#include "pd/kvcache.h"

/* ---- logging ---- */

static const char *g_prog = "pd";
static bool g_verbose;

void pd_log_init(const char *prog, bool verbose) {
  g_prog = prog;
  g_verbose = verbose;
  setvbuf(stderr, NULL, _IOLBF, 0);
}

bool pd_log_debug_on(void) { return g_verbose; }

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

static pd_status read_all(const char *path, char **buf, size_t *len, pd_err *e) {
  FILE *f = fopen(path, "rb");
  if (!f) return pd_err_set(e, PD_EIO, "cannot read %s: %s", path, strerror(errno));
  size_t cap = 1 << 16, n = 0;
  char *b = malloc(cap);
  while (b) {
    size_t k = fread(b + n, 1, cap - n, f);
    n += k;
    if (k == 0) break;
    if (n == cap) {
      char *t = realloc(b, cap * 2);
      if (!t) {
        free(b);
        b = NULL;
        break;
      }
      b = t;
      cap *= 2;
    }
  }
  bool err = ferror(f);
  fclose(f);
  if (!b) return pd_err_set(e, PD_ENOMEM, "out of memory reading %s", path);
  if (err) {
    free(b);
    return pd_err_set(e, PD_EIO, "cannot read %s", path);
  }
  *buf = b;
  *len = n;
  return PD_OK;
}

pd_status pd_model_fingerprint(const char *dir, uint64_t *fp, pd_err *e) {
  static const char *files[] = {"config.json", "tokenizer.json"};
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < 2; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, files[i]);
    char *buf = NULL;
    size_t len = 0;
    pd_status st = read_all(path, &buf, &len, e);
    if (st) return st;
    h = pd_kv_hash_root(buf, len, h);
    free(buf);
  }
  *fp = h;
  return PD_OK;
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

pd_status pd_curve_allow_file(pd_curve_auth *auth, const char *path, pd_err *e) {
  FILE *f = fopen(path, "r");
  if (!f) return pd_err_set(e, PD_EIO, "cannot read %s: %s", path, strerror(errno));
  char line[512];
  int n = 0, lineno = 0;
  pd_status st = PD_OK;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#') continue; /* a comment only at the start: '#' is also a Z85 character */
    size_t k = strlen(p);
    while (k && (p[k - 1] == '\n' || p[k - 1] == '\r' || p[k - 1] == ' ' || p[k - 1] == '\t'))
      p[--k] = 0;
    if (!k) continue;
    char canon[PD_CURVE_Z85_LEN + 1];
    if ((st = pd_curve_key_parse(p, NULL, canon, e)) != PD_OK) {
      pd_err_prefix(e, "%s:%d", path, lineno);
      break;
    }
    if ((st = pd_curve_auth_allow(auth, canon, e)) != PD_OK) break;
    n++;
  }
  fclose(f);
  if (st == PD_OK && n == 0) st = pd_err_set(e, PD_EFORMAT, "%s lists no public key", path);
  return st;
}

pd_status pd_curve_keys_from_flags(const char *file, const char *z85, pd_curve_keypair *kp,
                                   bool *have, pd_err *e) {
  memset(kp, 0, sizeof *kp);
  *have = false;
  if (file && *file) {
    pd_status st = pd_curve_keypair_load(file, kp, e);
    if (st) return st;
    if (!kp->secret_z85[0]) return pd_err_set(e, PD_EFORMAT, "%s holds no secret key", file);
    *have = true;
    return PD_OK;
  }
  if (z85 && *z85) {
    pd_status st = pd_curve_keypair_from_secret(z85, kp, e);
    if (st) return st;
    *have = true;
  }
  return PD_OK;
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

void pd_curve_log_denials(pd_curve_auth *auth, pd_log_limit *lim) {
  if (!auth) return;
  pd_curve_denial d[16];
  uint64_t lost = 0;
  int n;
  while ((n = pd_curve_auth_take_denials(auth, d, 16, &lost)) > 0 || lost) {
    lim->held += lost; /* fell out of the handler's record: counted only */
    lost = 0;
    for (int i = 0; i < n; i++)
      if (pd_log_limit_ok(lim, "refusals"))
        pd_log(PD_LOG_WARN, "refused a connection to the %s port from %s (CURVE key %s): %s",
               d[i].domain[0] ? d[i].domain : "CURVE", d[i].address[0] ? d[i].address : "?",
               d[i].key_z85[0] ? d[i].key_z85 : "none", d[i].reason);
    if (n < 16) break;
  }
}

struct pd_hs_watch {
  void *sock, *pair;
  char port[32];
};

pd_hs_watch *pd_hs_watch_start(void *ctx, void *sock, const char *port_name, pd_err *e) {
  pd_hs_watch *w = calloc(1, sizeof *w);
  if (!w) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  w->sock = sock;
  snprintf(w->port, sizeof w->port, "%s", port_name);
  char ep[64];
  snprintf(ep, sizeof ep, "inproc://pd-handshakes-%p", (void *)w);
  int zero = 0;
  if (zmq_socket_monitor(sock, ep, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                       ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0 ||
      !(w->pair = zmq_socket(ctx, ZMQ_PAIR)) ||
      zmq_setsockopt(w->pair, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
      zmq_connect(w->pair, ep) != 0) {
    pd_err_set(e, PD_EIO, "watching the %s port's handshakes: %s", port_name,
               zmq_strerror(zmq_errno()));
    pd_hs_watch_stop(w);
    return NULL;
  }
  return w;
}

/* What a failed handshake (a monitor event and its value) says about the peer, into out. */
static void hs_reason(uint16_t ev, uint32_t code, char *out, size_t cap) {
  if (ev != ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) /* the peer hung up first: it saw a mismatch */
    snprintf(out, cap, "the handshake did not complete (a peer without the cluster's keys, or "
                       "one that gave up)");
  else if (code == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    snprintf(out, cap, "it offered no CURVE keys (a process without the cluster's keys)");
  else if (code == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
    snprintf(out, cap, "its handshake did not decrypt (another server key)");
  else
    snprintf(out, cap, "a broken handshake (ZMTP protocol error %#x)", (unsigned)code);
}

void pd_hs_watch_drain(pd_hs_watch *w, pd_log_limit *lim) {
  if (!w) return;
  for (int k = 0; k < 1000; k++) {
    zmq_msg_t f;
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, w->pair, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&f);
      return;
    }
    uint16_t ev = 0;
    uint32_t val = 0;
    if (zmq_msg_size(&f) >= 6) {
      memcpy(&ev, zmq_msg_data(&f), 2);
      memcpy(&val, (char *)zmq_msg_data(&f) + 2, 4);
    }
    while (zmq_msg_more(&f)) { /* the endpoint frame: the bound one, not the peer */
      zmq_msg_close(&f);
      zmq_msg_init(&f);
      if (zmq_msg_recv(&f, w->pair, 0) < 0) break;
    }
    zmq_msg_close(&f);
    char why[128];
    hs_reason(ev, val, why, sizeof why);
    if (pd_log_limit_ok(lim, "refusals"))
      pd_log(PD_LOG_WARN, "refused a connection to the %s port: %s", w->port, why);
  }
}

void pd_hs_watch_stop(pd_hs_watch *w) {
  if (!w) return;
  zmq_socket_monitor(w->sock, NULL, 0);
  if (w->pair) zmq_close(w->pair);
  free(w);
}

/* ---- signals ---- */

volatile sig_atomic_t pd_node_stop_flag;

static void on_signal(int sig) {
  (void)sig;
  pd_node_stop_flag = 1;
}

void pd_node_install_signals(void) {
  pd_crash_handlers_install(g_prog);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}
