/* pdctl cluster up|status|down: a local cluster of one pd-router, P pd-prefill and D pd-decode
 * processes on 127.0.0.1, run as daemons and described in a run directory:
 *
 *   DIR/<name>.pid     the process id          (name: router, prefill-0.., decode-0..)
 *   DIR/<name>.log     its stdout and stderr
 *   DIR/<name>.ready   the ready file the process writes once serving (docs/cluster.md)
 *   DIR/cluster.json   ports, endpoints, pids (with their start times, so a recycled pid is
 *                      never signalled), command lines
 *
 * `up` starts the router with free cluster and client ports (port 0: the router binds and
 * reports them in its ready file, so there is no race for a port), then the nodes pointing at
 * it, and waits — bounded — until the router's /health is 200 with every node counted. If a
 * process dies or the wait times out it prints the tail of the failing log, stops everything it
 * started and exits 1. `status` checks each process and the router; `down` sends SIGTERM,
 * waits, sends SIGKILL after a timeout and removes the pid and ready files (logs stay). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pdctl.h"

#define MAX_PROCS 66 /* router + up to 32 prefill + 32 decode (+1 spare) */
#define MAX_ARGS 256

typedef struct proc {
  char name[32];   /* router, prefill-0, decode-1, ... */
  char role[16];   /* router, prefill, decode */
  pid_t pid;
  unsigned long long start_time; /* /proc/<pid>/stat field 22: tells a recycled pid apart */
  bool reaped;     /* `up`: waitpid saw it exit */
  int exit_status; /* its wait status when reaped */
  int metrics_port;
  char kv_endpoint[128];
  char *argv[MAX_ARGS];
  int argc;
} proc;

typedef struct cluster {
  char run_dir[PATH_MAX];
  char model[PATH_MAX];
  int http_port;
  char host[64];
  char cluster_ep[128], client_ep[128];
  proc procs[MAX_PROCS];
  int n;
  int n_prefill, n_decode;
} cluster;

/* ---- small helpers ---- */

static void path_of(char *out, size_t cap, const char *dir, const char *name, const char *ext) {
  snprintf(out, cap, "%s/%s%s", dir, name, ext);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
    if (n + 1 == cap) {
      char *t = realloc(buf, cap *= 2);
      if (!t) free(buf);
      buf = t;
    }
  }
  fclose(f);
  if (buf) {
    buf[n] = 0;
    if (len) *len = n;
  }
  return buf;
}

/* Writes text to path atomically (temp file + rename). */
static int write_file_atomic(const char *path, const char *text) {
  char tmp[PATH_MAX + 16];
  snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) return -1;
  bool ok = fputs(text, f) >= 0;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    unlink(tmp);
    return -1;
  }
  return 0;
}

/* Start time of pid in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 if gone.
 * *zombie tells an exited process that nobody has reaped yet. */
static unsigned long long proc_start_time(pid_t pid, bool *zombie) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  char *s = read_file(path, NULL);
  if (zombie) *zombie = false;
  if (!s) return 0;
  /* the command name is in parentheses and may hold spaces: parse after the last ')' */
  char *p = strrchr(s, ')');
  unsigned long long st = 0;
  if (p) {
    char state = p[2];
    if (zombie) *zombie = state == 'Z' || state == 'X';
    p += 2;
    for (int field = 3; field < 22 && p; field++) {
      p = strchr(p, ' ');
      if (p) p++;
    }
    if (p) st = strtoull(p, NULL, 10);
  }
  free(s);
  return st;
}

/* Whether the process we started (pid + start time) still runs. */
static bool proc_alive(const proc *p) {
  if (p->pid <= 0 || p->reaped) return false;
  bool zombie = false;
  unsigned long long st = proc_start_time(p->pid, &zombie);
  if (st == 0 || zombie) return false;
  return p->start_time == 0 || st == p->start_time;
}

/* Prints the last n lines of a log file to stderr. */
static void print_log_tail(const char *path, int n) {
  size_t len = 0;
  char *s = read_file(path, &len);
  if (!s) {
    fprintf(stderr, "  (no log at %s)\n", path);
    return;
  }
  size_t i = len;
  while (i > 0 && s[i - 1] == '\n') i--;
  int lines = 0;
  size_t start = i;
  while (start > 0) {
    if (s[start - 1] == '\n' && ++lines == n) break;
    start--;
  }
  fprintf(stderr, "---- last lines of %s ----\n%.*s\n----\n", path, (int)(i - start), s + start);
  free(s);
}

/* The folder holding this executable (/proc/self/exe), or "" if unknown. */
static void self_dir(char *out, size_t cap) {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  out[0] = 0;
  if (n <= 0) return;
  buf[n] = 0;
  char *slash = strrchr(buf, '/');
  if (!slash) return;
  *slash = 0;
  snprintf(out, cap, "%s", buf);
}

/* Finds a cluster binary: --bin-dir, then next to pdctl (installed), then the build tree's
 * layout (<build>/tools/pdctl -> <build>/<subdir>/<name>). */
static int find_binary(const char *bin_dir, const char *subdir, const char *name, char *out,
                       size_t cap) {
  char here[PATH_MAX];
  self_dir(here, sizeof here);
  char cand[3][PATH_MAX + 64];
  int nc = 0;
  if (bin_dir) snprintf(cand[nc++], sizeof cand[0], "%s/%s", bin_dir, name);
  if (here[0]) {
    snprintf(cand[nc++], sizeof cand[0], "%s/%s", here, name);
    snprintf(cand[nc++], sizeof cand[0], "%s/../%s/%s", here, subdir, name);
  }
  for (int i = 0; i < nc; i++) {
    if (access(cand[i], X_OK) == 0) {
      char real[PATH_MAX];
      const char *found = realpath(cand[i], real) ? real : cand[i];
      size_t l = strlen(found);
      if (l >= cap) continue;
      memcpy(out, found, l + 1);
      return 0;
    }
  }
  if (bin_dir)
    fprintf(stderr, "pdctl: %s not found in %s\n", name, bin_dir);
  else
    fprintf(stderr, "pdctl: %s not found next to pdctl (%s) nor in %s/../%s; build it, or give "
                    "--bin-dir\n",
            name, here, here, subdir);
  return -1;
}

/* Whether 127.0.0.1:port (or host) can be bound now. */
static bool port_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  return ok;
}

static char *xstrdup(const char *s) {
  char *d = strdup(s);
  if (!d) {
    fputs("pdctl: out of memory\n", stderr);
    exit(1);
  }
  return d;
}

static void proc_arg(proc *p, const char *a) {
  if (p->argc + 1 >= MAX_ARGS) {
    fputs("pdctl: too many arguments\n", stderr);
    exit(1);
  }
  p->argv[p->argc++] = xstrdup(a);
  p->argv[p->argc] = NULL;
}

static void proc_argf(proc *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void proc_argf(proc *p, const char *fmt, ...) {
  char buf[PATH_MAX + 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  proc_arg(p, buf);
}

static void cluster_free(cluster *c) {
  for (int i = 0; i < c->n; i++)
    for (int k = 0; k < c->procs[i].argc; k++) free(c->procs[i].argv[k]);
  c->n = 0;
}

/* Starts p as a daemon: its own session, stdin from /dev/null, stdout and stderr appended to
 * DIR/<name>.log, its pid in DIR/<name>.pid. Exec failures come back through a close-on-exec
 * pipe, so "binary not executable" is reported here rather than as a silent death. */
static int spawn(const cluster *c, proc *p) {
  char logp[PATH_MAX + 64], pidp[PATH_MAX + 64];
  path_of(logp, sizeof logp, c->run_dir, p->name, ".log");
  path_of(pidp, sizeof pidp, c->run_dir, p->name, ".pid");
  int logfd = open(logp, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (logfd < 0) {
    fprintf(stderr, "pdctl: %s: %s\n", logp, strerror(errno));
    return -1;
  }
  int pfd[2];
  if (pipe2(pfd, O_CLOEXEC) != 0) {
    fprintf(stderr, "pdctl: pipe: %s\n", strerror(errno));
    close(logfd);
    return -1;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "pdctl: fork: %s\n", strerror(errno));
    close(logfd);
    close(pfd[0]);
    close(pfd[1]);
    return -1;
  }
  if (pid == 0) {
    setsid();
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(logfd, 1);
    dup2(logfd, 2);
    /* close everything else but the error pipe (close-on-exec) */
    long maxfd = sysconf(_SC_OPEN_MAX);
    for (int fd = 3; fd < (maxfd > 0 && maxfd < 65536 ? maxfd : 1024); fd++)
      if (fd != pfd[1]) close(fd);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execv(p->argv[0], p->argv);
    int err = errno;
    ssize_t w = write(pfd[1], &err, sizeof err);
    (void)w;
    _exit(127);
  }
  close(logfd);
  close(pfd[1]);
  int err = 0;
  ssize_t r;
  while ((r = read(pfd[0], &err, sizeof err)) < 0 && errno == EINTR) {
  }
  close(pfd[0]);
  if (r == (ssize_t)sizeof err) {
    fprintf(stderr, "pdctl: cannot run %s: %s\n", p->argv[0], strerror(err));
    waitpid(pid, NULL, 0);
    return -1;
  }
  p->pid = pid;
  p->start_time = proc_start_time(pid, NULL);
  char num[32];
  snprintf(num, sizeof num, "%d\n", (int)pid);
  if (write_file_atomic(pidp, num) != 0)
    fprintf(stderr, "pdctl: warning: cannot write %s: %s\n", pidp, strerror(errno));
  return 0;
}

/* `up`: notes children that exited (so they are not mistaken for alive) and reaps them. */
static void reap(cluster *c) {
  for (int i = 0; i < c->n; i++) {
    proc *p = &c->procs[i];
    if (p->pid <= 0 || p->reaped) continue;
    int st;
    pid_t r = waitpid(p->pid, &st, WNOHANG);
    if (r == p->pid) {
      p->reaped = true;
      p->exit_status = st;
    }
  }
}

static void describe_exit(const proc *p, char *out, size_t cap) {
  if (!p->reaped) snprintf(out, cap, "exited");
  else if (WIFEXITED(p->exit_status))
    snprintf(out, cap, "exited with status %d", WEXITSTATUS(p->exit_status));
  else if (WIFSIGNALED(p->exit_status))
    snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(p->exit_status),
             strsignal(WTERMSIG(p->exit_status)));
  else
    snprintf(out, cap, "exited");
}

/* Stops processes: SIGTERM to the nodes, then to the router (so nodes can deregister), waits
 * up to timeout_s in all, then SIGKILL. Children of this process are reaped. Returns the number
 * that needed SIGKILL. */
static int stop_procs(cluster *c, double timeout_s, bool verbose) {
  double t0 = pdctl_now();
  int killed = 0;
  for (int pass = 0; pass < 2; pass++) {
    bool router_pass = pass == 1;
    for (int i = 0; i < c->n; i++) {
      proc *p = &c->procs[i];
      if ((strcmp(p->role, "router") == 0) != router_pass) continue;
      if (proc_alive(p)) kill(p->pid, SIGTERM);
    }
    /* the nodes get up to half the time before the router is told */
    double until = router_pass ? t0 + timeout_s : t0 + timeout_s / 2;
    for (;;) {
      reap(c);
      bool any = false;
      for (int i = 0; i < c->n; i++) {
        proc *p = &c->procs[i];
        if ((strcmp(p->role, "router") == 0) != router_pass) continue;
        if (proc_alive(p)) any = true;
      }
      if (!any || pdctl_now() >= until) break;
      sleep_ms(50);
    }
  }
  for (int i = 0; i < c->n; i++) {
    proc *p = &c->procs[i];
    if (!proc_alive(p)) continue;
    if (verbose) fprintf(stderr, "pdctl: %s (pid %d) ignored SIGTERM: SIGKILL\n", p->name, p->pid);
    kill(p->pid, SIGKILL);
    killed++;
  }
  double kdeadline = pdctl_now() + 5;
  for (;;) {
    reap(c);
    bool any = false;
    for (int i = 0; i < c->n; i++) any |= proc_alive(&c->procs[i]);
    if (!any || pdctl_now() >= kdeadline) break;
    sleep_ms(20);
  }
  return killed;
}

static void remove_run_files(const cluster *c, bool also_json) {
  char path[PATH_MAX + 64];
  for (int i = 0; i < c->n; i++) {
    path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".pid");
    unlink(path);
    path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".ready");
    unlink(path);
  }
  if (also_json) {
    path_of(path, sizeof path, c->run_dir, "cluster", ".json");
    unlink(path);
  }
}

/* ---- cluster.json ---- */

static int save_json(const cluster *c) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "run_dir", c->run_dir);
  cJSON_AddStringToObject(o, "model", c->model);
  char url[128];
  snprintf(url, sizeof url, "http://%s:%d", c->host, c->http_port);
  cJSON_AddStringToObject(o, "http_url", url);
  cJSON_AddStringToObject(o, "host", c->host);
  cJSON_AddNumberToObject(o, "http_port", c->http_port);
  cJSON_AddStringToObject(o, "cluster_endpoint", c->cluster_ep);
  cJSON_AddStringToObject(o, "client_endpoint", c->client_ep);
  cJSON_AddNumberToObject(o, "prefill", c->n_prefill);
  cJSON_AddNumberToObject(o, "decode", c->n_decode);
  cJSON_AddNumberToObject(o, "started_at", (double)time(NULL));
  cJSON *arr = cJSON_AddArrayToObject(o, "processes");
  for (int i = 0; i < c->n; i++) {
    const proc *p = &c->procs[i];
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "name", p->name);
    cJSON_AddStringToObject(j, "role", p->role);
    cJSON_AddNumberToObject(j, "pid", p->pid);
    cJSON_AddNumberToObject(j, "start_time", (double)p->start_time);
    char path[PATH_MAX + 64];
    path_of(path, sizeof path, c->run_dir, p->name, ".log");
    cJSON_AddStringToObject(j, "log", path);
    path_of(path, sizeof path, c->run_dir, p->name, ".pid");
    cJSON_AddStringToObject(j, "pid_file", path);
    if (p->metrics_port > 0) cJSON_AddNumberToObject(j, "metrics_port", p->metrics_port);
    if (p->kv_endpoint[0]) cJSON_AddStringToObject(j, "kv_endpoint", p->kv_endpoint);
    cJSON *av = cJSON_AddArrayToObject(j, "argv");
    for (int k = 0; k < p->argc; k++) cJSON_AddItemToArray(av, cJSON_CreateString(p->argv[k]));
    cJSON_AddItemToArray(arr, j);
  }
  char *s = cJSON_Print(o);
  cJSON_Delete(o);
  char path[PATH_MAX + 64];
  path_of(path, sizeof path, c->run_dir, "cluster", ".json");
  size_t l = s ? strlen(s) : 0;
  char *t = s ? realloc(s, l + 2) : NULL;
  if (t) {
    t[l] = '\n';
    t[l + 1] = 0;
  }
  int rc = t ? write_file_atomic(path, t) : -1;
  free(t ? t : s);
  return rc;
}

/* Loads DIR/cluster.json; without it, falls back to the pid files (a cluster.json lost to a
 * crash of `up`) so `down` can still stop what runs. */
static int load_cluster(const char *run_dir, cluster *c, bool quiet) {
  memset(c, 0, sizeof *c);
  snprintf(c->run_dir, sizeof c->run_dir, "%s", run_dir);
  snprintf(c->host, sizeof c->host, "127.0.0.1");
  char path[PATH_MAX + 64];
  path_of(path, sizeof path, run_dir, "cluster", ".json");
  char *s = read_file(path, NULL);
  cJSON *o = s ? cJSON_Parse(s) : NULL;
  free(s);
  if (o) {
    cJSON *v;
    if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(o, "model")))
      snprintf(c->model, sizeof c->model, "%s", v->valuestring);
    if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(o, "host")))
      snprintf(c->host, sizeof c->host, "%s", v->valuestring);
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(o, "http_port")))
      c->http_port = v->valueint;
    if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(o, "cluster_endpoint")))
      snprintf(c->cluster_ep, sizeof c->cluster_ep, "%s", v->valuestring);
    if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(o, "client_endpoint")))
      snprintf(c->client_ep, sizeof c->client_ep, "%s", v->valuestring);
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(o, "prefill")))
      c->n_prefill = v->valueint;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(o, "decode")))
      c->n_decode = v->valueint;
    cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "processes");
    cJSON *j;
    cJSON_ArrayForEach(j, arr) {
      if (c->n >= MAX_PROCS) break;
      proc *p = &c->procs[c->n];
      memset(p, 0, sizeof *p);
      cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
      cJSON *role = cJSON_GetObjectItemCaseSensitive(j, "role");
      cJSON *pid = cJSON_GetObjectItemCaseSensitive(j, "pid");
      cJSON *stt = cJSON_GetObjectItemCaseSensitive(j, "start_time");
      if (!cJSON_IsString(name) || !cJSON_IsNumber(pid)) continue;
      snprintf(p->name, sizeof p->name, "%s", name->valuestring);
      snprintf(p->role, sizeof p->role, "%s", cJSON_IsString(role) ? role->valuestring : "");
      p->pid = (pid_t)pid->valueint;
      p->start_time = cJSON_IsNumber(stt) ? (unsigned long long)stt->valuedouble : 0;
      if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(j, "metrics_port")))
        p->metrics_port = v->valueint;
      if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(j, "kv_endpoint")))
        snprintf(p->kv_endpoint, sizeof p->kv_endpoint, "%s", v->valuestring);
      c->n++;
    }
    cJSON_Delete(o);
    return 0;
  }
  /* no cluster.json: the pid files that exist */
  const char *roles[3] = {"router", "prefill", "decode"};
  for (int r = 0; r < 3; r++) {
    for (int i = 0; i < (r == 0 ? 1 : 32); i++) {
      char name[32];
      if (r == 0) snprintf(name, sizeof name, "router");
      else snprintf(name, sizeof name, "%s-%d", roles[r], i);
      path_of(path, sizeof path, run_dir, name, ".pid");
      char *t = read_file(path, NULL);
      if (!t) continue;
      proc *p = &c->procs[c->n++];
      memset(p, 0, sizeof *p);
      snprintf(p->name, sizeof p->name, "%s", name);
      snprintf(p->role, sizeof p->role, "%s", roles[r]);
      p->pid = (pid_t)atoi(t);
      free(t);
      /* no start time on record: only signal a process whose command line names the binary */
      char cmd[64], *cl;
      snprintf(cmd, sizeof cmd, "/proc/%d/cmdline", (int)p->pid);
      cl = read_file(cmd, NULL);
      if (!cl || !strstr(cl, r == 0 ? "pd-router" : r == 1 ? "pd-prefill" : "pd-decode"))
        p->pid = 0;
      free(cl);
    }
  }
  if (c->n == 0) {
    if (!quiet) fprintf(stderr, "pdctl: no cluster in %s (no cluster.json, no pid files)\n", run_dir);
    return -1;
  }
  return 0;
}

/* Router health: the HTTP status (-1: no answer) and the node counts it reports. */
static int router_health(const cluster *c, int timeout_ms, int *n_prefill, int *n_decode,
                         char *err, size_t errcap) {
  char url[128];
  snprintf(url, sizeof url, "http://%s:%d", strcmp(c->host, "0.0.0.0") ? c->host : "127.0.0.1",
           c->http_port);
  char *body = NULL;
  pd_err e = {0};
  int st = pdctl_http(url, "GET", "/health", NULL, NULL, timeout_ms, &body, NULL, &e);
  *n_prefill = *n_decode = -1;
  if (st < 0) {
    if (err) snprintf(err, errcap, "%.200s", e.msg);
    return -1;
  }
  cJSON *o = body ? cJSON_Parse(body) : NULL;
  cJSON *p = o ? cJSON_GetObjectItemCaseSensitive(o, "prefill_nodes") : NULL;
  cJSON *d = o ? cJSON_GetObjectItemCaseSensitive(o, "decode_nodes") : NULL;
  if (cJSON_IsNumber(p)) *n_prefill = p->valueint;
  if (cJSON_IsNumber(d)) *n_decode = d->valueint;
  if (err) snprintf(err, errcap, "HTTP %d %.200s", st, body ? body : "");
  cJSON_Delete(o);
  free(body);
  return st;
}

/* ---- up ---- */

/* Ctrl-C or SIGTERM while `up` waits: stop what was started instead of leaving it behind. */
static volatile sig_atomic_t g_up_interrupted;
static void on_up_signal(int sig) { g_up_interrupted = sig; }

static bool check_interrupted(void) {
  if (!g_up_interrupted) return false;
  fprintf(stderr, "pdctl: interrupted (%s): stopping what was started\n",
          strsignal(g_up_interrupted));
  return true;
}

/* Reads a ready file (JSON) when present; NULL otherwise. */
static cJSON *read_ready(const cluster *c, const proc *p) {
  char path[PATH_MAX + 64];
  path_of(path, sizeof path, c->run_dir, p->name, ".ready");
  char *s = read_file(path, NULL);
  cJSON *o = s ? cJSON_Parse(s) : NULL;
  free(s);
  return o;
}

/* The first process of c that is not running, or NULL. */
static proc *first_dead(cluster *c) {
  reap(c);
  for (int i = 0; i < c->n; i++)
    if (!proc_alive(&c->procs[i])) return &c->procs[i];
  return NULL;
}

static void report_dead(const cluster *c, const proc *p) {
  char how[96], logp[PATH_MAX + 64];
  describe_exit(p, how, sizeof how);
  path_of(logp, sizeof logp, c->run_dir, p->name, ".log");
  fprintf(stderr, "pdctl: %s (pid %d) %s during startup\n", p->name, (int)p->pid, how);
  print_log_tail(logp, 20);
}

static int fail_up(cluster *c, bool keep) {
  if (keep) {
    fprintf(stderr, "pdctl: --keep-on-failure: leaving the processes running; "
                    "`pdctl cluster down --run-dir %s` stops them\n",
            c->run_dir);
    save_json(c);
  } else {
    stop_procs(c, 5, false);
    remove_run_files(c, true);
  }
  cluster_free(c);
  return 1;
}

/* Splits s at whitespace into p's argv. */
static void add_split_args(proc *p, const char *s) {
  char *copy = xstrdup(s), *save = NULL;
  for (char *t = strtok_r(copy, " \t\n", &save); t; t = strtok_r(NULL, " \t\n", &save))
    proc_arg(p, t);
  free(copy);
}

static bool binary_accepts(const char *bin, const char *flag) {
  /* `bin --help` lists every flag; run it with a short bound */
  char cmd[PATH_MAX + 64];
  snprintf(cmd, sizeof cmd, "timeout 10 '%s' --help 2>&1", bin);
  FILE *f = popen(cmd, "r");
  if (!f) return true; /* cannot tell: let the process itself complain */
  char line[1024];
  bool found = false;
  size_t fl = strlen(flag);
  while (fgets(line, sizeof line, f)) {
    char *q = strstr(line, flag);
    if (q && !(q[fl] == '-' || (q[fl] >= 'a' && q[fl] <= 'z'))) found = true;
  }
  pclose(f);
  return found;
}

/* Entry k (round robin) of a comma-separated device list ("cuda:0,cuda:1") into out. */
static void device_pick(const char *list, int k, char *out, size_t cap) {
  int n = 1;
  for (const char *q = list; *q; q++) n += *q == ',';
  int want = k % n;
  const char *a = list;
  for (int i = 0; i < want; i++) a = strchr(a, ',') + 1;
  const char *b = strchr(a, ',');
  size_t len = b ? (size_t)(b - a) : strlen(a);
  if (len >= cap) len = cap - 1;
  memcpy(out, a, len);
  out[len] = 0;
}

static bool device_is_gpu(const char *d) { return strncmp(d, "cuda", 4) == 0; }

/* Every entry of a device list is cpu, cuda or cuda:N. */
static bool device_list_ok(const char *list) {
  if (!*list) return false;
  char one[64];
  int n = 1;
  for (const char *q = list; *q; q++) n += *q == ',';
  for (int k = 0; k < n; k++) {
    device_pick(list, k, one, sizeof one);
    if (!strcmp(one, "cpu") || !strcmp(one, "cuda")) continue;
    if (strncmp(one, "cuda:", 5) != 0 || !one[5]) return false;
    for (const char *q = one + 5; *q; q++)
      if (*q < '0' || *q > '9') return false;
  }
  return true;
}

/* Whether a node flag was given by the user: in an args string or after "--". */
static bool flag_given(const char *args, int argc, char **argv, int from, const char *flag) {
  if (args && strstr(args, flag)) return true;
  for (int i = from; i < argc; i++)
    if (!strncmp(argv[i], flag, strlen(flag))) return true;
  return false;
}

static int cluster_up(int argc, char **argv) {
  /* node flags after "--" pass through */
  int dd = argc;
  for (int i = 3; i < argc; i++)
    if (!strcmp(argv[i], "--")) {
      dd = i;
      break;
    }
  const char *model = NULL, *draft = NULL, *run_dir = NULL, *bin_dir = NULL, *host = "127.0.0.1",
             *router_args = NULL, *prefill_args = NULL, *decode_args = NULL, *api_key = NULL,
             *name = NULL, *device = NULL, *prefill_device = NULL, *decode_device = NULL,
             *kv_dtype = NULL;
  int n_prefill = 1, n_decode = 1, port = 8000;
  double gpu_util = 0;
  double timeout_s = 180;
  bool help = false, keep = false, quiet = false;
  pd_opt opts[] = {
      {"model", PD_OPT_STR, &model, "DIR", "model folder (every process)", NULL},
      {"draft-model", PD_OPT_STR, &draft, "DIR",
       "draft model for speculative decoding (prefill and decode nodes)", NULL},
      {"prefill", PD_OPT_INT, &n_prefill, "P", "prefill nodes (default 1)", NULL},
      {"decode", PD_OPT_INT, &n_decode, "D", "decode nodes (default 1)", NULL},
      {"port", PD_OPT_INT, &port, "PORT", "router HTTP port (default 8000; 0 = a free one)",
       NULL},
      {"host", PD_OPT_STR, &host, "HOST", "router HTTP bind address (default 127.0.0.1)", NULL},
      {"run-dir", PD_OPT_STR, &run_dir, "DIR", "pid, log and ready files, cluster.json", NULL},
      {"served-model-name", PD_OPT_STR, &name, "NAME", "model name for clients", NULL},
      {"api-key", PD_OPT_STR, &api_key, "KEY", "router: require this bearer key on /v1", NULL},
      {"router-args", PD_OPT_STR, &router_args, "\"FLAGS\"", "extra router flags", NULL},
      {"prefill-args", PD_OPT_STR, &prefill_args, "\"FLAGS\"", "extra prefill-node flags",
       NULL},
      {"decode-args", PD_OPT_STR, &decode_args, "\"FLAGS\"", "extra decode-node flags", NULL},
      {"device", PD_OPT_STR, &device, "DEV",
       "device of every prefill and decode node: cpu (default), cuda, cuda:N, or a list "
       "cuda:0,cuda:1 handed out round robin", NULL},
      {"prefill-device", PD_OPT_STR, &prefill_device, "DEV",
       "device of the prefill nodes (overrides --device)", NULL},
      {"decode-device", PD_OPT_STR, &decode_device, "DEV",
       "device of the decode nodes (overrides --device)", NULL},
      {"gpu-memory-utilization", PD_OPT_DOUBLE, &gpu_util, "F",
       "each GPU node's share of its device's memory (weights + KV); nodes sharing a GPU "
       "need shares that add up to at most ~0.9 (node default 0.9)", NULL},
      {"kv-cache-dtype", PD_OPT_STR, &kv_dtype, "T",
       "KV dtype of every node (f32, bf16, f16); prefill and decode must agree (default: bf16 "
       "when CPU and GPU nodes are mixed, else the nodes' own default)", NULL},
      {"bin-dir", PD_OPT_STR, &bin_dir, "DIR",
       "where pd-router, pd-prefill, pd-decode are (default: found from pdctl's location)", NULL},
      {"timeout", PD_OPT_DOUBLE, &timeout_s, "S", "readiness wait (default 180)", NULL},
      {"keep-on-failure", PD_OPT_BOOL, &keep, NULL, "leave processes running if startup fails",
       NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "print only errors", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, dd, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl cluster up --model DIR [--draft-model DIR] --prefill P --decode D "
          "--port PORT --run-dir DIR [-- node flags...]\n"
          "Flags after -- go to every prefill and decode node (e.g. -- --threads 1).\n"
          "GPU nodes: --device cuda:0 (or --prefill-device / --decode-device) and "
          "--gpu-memory-utilization F (each node's share).\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!model) return pdctl_fail("cluster up needs --model DIR");
  if (!run_dir) return pdctl_fail("cluster up needs --run-dir DIR");
  if (n_prefill < 1 || n_prefill > 32 || n_decode < 1 || n_decode > 32)
    return pdctl_fail("--prefill and --decode must be in 1..32");
  if (port < 0 || port > 65535) return pdctl_fail("--port must be in 0..65535");
  if (!(timeout_s > 0)) return pdctl_fail("--timeout must be positive");
  if (!prefill_device) prefill_device = device ? device : "cpu";
  if (!decode_device) decode_device = device ? device : "cpu";
  if (!device_list_ok(prefill_device) || !device_list_ok(decode_device))
    return pdctl_fail("devices must be cpu, cuda or cuda:N (comma-separated lists allowed)");
  if (gpu_util < 0 || gpu_util > 1)
    return pdctl_fail("--gpu-memory-utilization must be in (0, 1]");
  struct stat sb;
  if (stat(model, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return pdctl_fail("--model %s: not a folder", model);
  if (draft && (stat(draft, &sb) != 0 || !S_ISDIR(sb.st_mode)))
    return pdctl_fail("--draft-model %s: not a folder", draft);
  if (mkdir(run_dir, 0755) != 0 && errno != EEXIST)
    return pdctl_fail("--run-dir %s: %s", run_dir, strerror(errno));

  static cluster c; /* large: keep it off the stack */
  memset(&c, 0, sizeof c);
  char real[PATH_MAX];
  if (!realpath(run_dir, real)) return pdctl_fail("--run-dir %s: %s", run_dir, strerror(errno));
  snprintf(c.run_dir, sizeof c.run_dir, "%s", real);
  char model_abs[PATH_MAX], draft_abs[PATH_MAX];
  if (!realpath(model, model_abs)) return pdctl_fail("--model %s: %s", model, strerror(errno));
  if (draft && !realpath(draft, draft_abs))
    return pdctl_fail("--draft-model %s: %s", draft, strerror(errno));
  snprintf(c.model, sizeof c.model, "%s", model_abs);
  snprintf(c.host, sizeof c.host, "%s", host);
  c.n_prefill = n_prefill;
  c.n_decode = n_decode;

  /* a cluster already running here? */
  {
    cluster old;
    if (load_cluster(c.run_dir, &old, true) == 0) {
      for (int i = 0; i < old.n; i++)
        if (proc_alive(&old.procs[i]))
          return pdctl_fail("a cluster is already running in %s (%s, pid %d); run `pdctl "
                            "cluster down --run-dir %s` first",
                            c.run_dir, old.procs[i].name, (int)old.procs[i].pid, c.run_dir);
      remove_run_files(&old, true);
    }
  }
  if (port > 0 && strcmp(host, "127.0.0.1") == 0 && !port_free(port))
    return pdctl_fail("port %d on 127.0.0.1 is in use; pick another --port (0 = any free one)",
                      port);

  char router_bin[PATH_MAX], prefill_bin[PATH_MAX], decode_bin[PATH_MAX];
  if (find_binary(bin_dir, "router", "pd-router", router_bin, sizeof router_bin) ||
      find_binary(bin_dir, "prefill-node", "pd-prefill", prefill_bin, sizeof prefill_bin) ||
      find_binary(bin_dir, "decode-node", "pd-decode", decode_bin, sizeof decode_bin))
    return 1;
  if (draft && !binary_accepts(decode_bin, "--draft-model"))
    return pdctl_fail("%s does not take --draft-model (no speculative decoding in this build)",
                      decode_bin);

  /* the router: free cluster and client ports, reported in its ready file */
  proc *r = &c.procs[c.n++];
  snprintf(r->name, sizeof r->name, "router");
  snprintf(r->role, sizeof r->role, "router");
  proc_arg(r, router_bin);
  proc_arg(r, "--model");
  proc_arg(r, model_abs);
  if (name) {
    proc_arg(r, "--served-model-name");
    proc_arg(r, name);
  }
  proc_arg(r, "--host");
  proc_arg(r, host);
  proc_arg(r, "--port");
  proc_argf(r, "%d", port);
  proc_arg(r, "--cluster-port");
  proc_arg(r, "0");
  proc_arg(r, "--client-port");
  proc_arg(r, "0");
  if (api_key) {
    proc_arg(r, "--api-key");
    proc_arg(r, api_key);
  }
  proc_arg(r, "--ready-file");
  proc_argf(r, "%s/router.ready", c.run_dir);
  if (router_args) add_split_args(r, router_args);
  double t0 = pdctl_now(), deadline = t0 + timeout_s;
  if (!quiet) fprintf(stderr, "pdctl: starting pd-router (logs in %s)\n", c.run_dir);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_up_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  if (spawn(&c, r) != 0) return fail_up(&c, false);
  for (;;) {
    if (check_interrupted()) return fail_up(&c, false);
    proc *dead = first_dead(&c);
    if (dead) {
      report_dead(&c, dead);
      return fail_up(&c, keep);
    }
    cJSON *rd = read_ready(&c, r);
    if (rd) {
      cJSON *hp = cJSON_GetObjectItemCaseSensitive(rd, "http_port");
      cJSON *ce = cJSON_GetObjectItemCaseSensitive(rd, "cluster_endpoint");
      cJSON *cl = cJSON_GetObjectItemCaseSensitive(rd, "client_endpoint");
      bool ok = cJSON_IsNumber(hp) && cJSON_IsString(ce);
      if (ok) {
        c.http_port = hp->valueint;
        snprintf(c.cluster_ep, sizeof c.cluster_ep, "%s", ce->valuestring);
        if (cJSON_IsString(cl)) snprintf(c.client_ep, sizeof c.client_ep, "%s", cl->valuestring);
      }
      cJSON_Delete(rd);
      if (ok) break;
    }
    if (pdctl_now() > deadline) {
      fprintf(stderr, "pdctl: pd-router did not write its ready file within %.0f s\n", timeout_s);
      char logp[PATH_MAX + 64];
      path_of(logp, sizeof logp, c.run_dir, "router", ".log");
      print_log_tail(logp, 20);
      return fail_up(&c, keep);
    }
    sleep_ms(50);
  }

  /* the nodes */
  bool threads_given = flag_given(prefill_args, argc, argv, dd + 1, "--threads") ||
                       flag_given(decode_args, argc, argv, dd + 1, "--threads");
  /* The KV dtype must be the same on both sides of a transfer; "auto" is f32 on a CPU node and
   * bf16 on a GPU node, so a mixed cluster gets bf16 everywhere unless told otherwise. */
  int n_gpu = 0, n_cpu_nodes = 0;
  for (int k = 0; k < n_prefill + n_decode; k++) {
    bool pre = k < n_prefill;
    char dev[64];
    device_pick(pre ? prefill_device : decode_device, pre ? k : k - n_prefill, dev, sizeof dev);
    if (device_is_gpu(dev)) n_gpu++;
    else n_cpu_nodes++;
  }
  bool dtype_given = flag_given(prefill_args, argc, argv, dd + 1, "--kv-cache-dtype") ||
                     flag_given(decode_args, argc, argv, dd + 1, "--kv-cache-dtype");
  if (!kv_dtype && !dtype_given && n_gpu && n_cpu_nodes) {
    kv_dtype = "bf16";
    if (!quiet)
      fprintf(stderr, "pdctl: CPU and GPU nodes: --kv-cache-dtype bf16 on every node (the KV "
                      "dtype must match across a transfer)\n");
  }
  /* GPU nodes spend no CPU threads on the forward: the cores go to the CPU nodes */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int n_share = n_cpu_nodes ? n_cpu_nodes : 1;
  int node_threads = cores > n_share ? (int)(cores / n_share) : 1;
  for (int k = 0; k < n_prefill + n_decode; k++) {
    bool pre = k < n_prefill;
    int idx = pre ? k : k - n_prefill;
    char dev[64];
    device_pick(pre ? prefill_device : decode_device, idx, dev, sizeof dev);
    bool gpu = device_is_gpu(dev);
    proc *p = &c.procs[c.n++];
    snprintf(p->name, sizeof p->name, "%s-%d", pre ? "prefill" : "decode", idx);
    snprintf(p->role, sizeof p->role, "%s", pre ? "prefill" : "decode");
    proc_arg(p, pre ? prefill_bin : decode_bin);
    proc_arg(p, "--model");
    proc_arg(p, model_abs);
    if (draft) {
      proc_arg(p, "--draft-model");
      proc_arg(p, draft_abs);
    }
    if (name) {
      proc_arg(p, "--served-model-name");
      proc_arg(p, name);
    }
    proc_arg(p, "--router");
    proc_arg(p, c.cluster_ep);
    proc_arg(p, "--node-id");
    proc_arg(p, p->name);
    proc_arg(p, "--metrics-port");
    proc_arg(p, "0");
    if (!pre) {
      proc_arg(p, "--kv-port");
      proc_arg(p, "0");
    }
    proc_arg(p, "--ready-file");
    proc_argf(p, "%s/%s.ready", c.run_dir, p->name);
    proc_arg(p, "--device");
    proc_arg(p, dev);
    if (gpu && gpu_util > 0) proc_argf(p, "--gpu-memory-utilization=%g", gpu_util);
    if (kv_dtype) proc_argf(p, "--kv-cache-dtype=%s", kv_dtype);
    if (pre && prefill_args) add_split_args(p, prefill_args);
    if (!pre && decode_args) add_split_args(p, decode_args);
    for (int i = dd + 1; i < argc; i++) proc_arg(p, argv[i]);
    /* The nodes share this machine's cores: unless told otherwise, split them so that the
     * CPU backends' spinning thread pools never oversubscribe it (2 nodes x all cores on
     * 2 cores runs several times slower than 1 thread each). */
    if (!threads_given && !gpu) proc_argf(p, "--threads=%d", node_threads);
    if (spawn(&c, p) != 0) return fail_up(&c, false);
  }
  if (!quiet)
    fprintf(stderr, "pdctl: started %d prefill and %d decode nodes; waiting for them to register\n",
            n_prefill, n_decode);

  /* wait: every node's ready file, then the router counting them all */
  char last[256] = "";
  for (;;) {
    if (check_interrupted()) return fail_up(&c, false);
    proc *dead = first_dead(&c);
    if (dead) {
      report_dead(&c, dead);
      return fail_up(&c, keep);
    }
    int ready = 0;
    for (int i = 1; i < c.n; i++) {
      proc *p = &c.procs[i];
      if (p->metrics_port > 0 || p->kv_endpoint[0]) {
        ready++;
        continue;
      }
      cJSON *rd = read_ready(&c, p);
      if (!rd) continue;
      cJSON *mp = cJSON_GetObjectItemCaseSensitive(rd, "metrics_port");
      cJSON *kv = cJSON_GetObjectItemCaseSensitive(rd, "kv_endpoint");
      p->metrics_port = cJSON_IsNumber(mp) && mp->valueint > 0 ? mp->valueint : -1;
      if (cJSON_IsString(kv)) snprintf(p->kv_endpoint, sizeof p->kv_endpoint, "%s", kv->valuestring);
      cJSON_Delete(rd);
      ready++;
    }
    if (ready == c.n - 1) {
      int np = 0, nd = 0;
      int st = router_health(&c, 2000, &np, &nd, last, sizeof last);
      if (st == 200 && np >= n_prefill && nd >= n_decode) break;
    } else {
      snprintf(last, sizeof last, "%d of %d nodes registered", ready, c.n - 1);
    }
    if (pdctl_now() > deadline) {
      fprintf(stderr, "pdctl: the cluster was not ready within %.0f s (%s)\n", timeout_s, last);
      for (int i = 1; i < c.n; i++) {
        cJSON *rd = read_ready(&c, &c.procs[i]);
        if (rd) {
          cJSON_Delete(rd);
          continue;
        }
        char logp[PATH_MAX + 64];
        path_of(logp, sizeof logp, c.run_dir, c.procs[i].name, ".log");
        fprintf(stderr, "pdctl: %s has not registered\n", c.procs[i].name);
        print_log_tail(logp, 10);
      }
      return fail_up(&c, keep);
    }
    sleep_ms(100);
  }
  if (save_json(&c) != 0) {
    fprintf(stderr, "pdctl: cannot write %s/cluster.json: %s\n", c.run_dir, strerror(errno));
    return fail_up(&c, false);
  }
  if (!quiet) {
    printf("cluster up in %.1f s: router http://%s:%d (client API %s), %d prefill, %d decode\n",
           pdctl_now() - t0, strcmp(host, "0.0.0.0") ? host : "127.0.0.1", c.http_port,
           c.client_ep[0] ? c.client_ep : "off", n_prefill, n_decode);
    for (int i = 0; i < c.n; i++)
      printf("  %-11s pid %-7d log %s/%s.log\n", c.procs[i].name, (int)c.procs[i].pid,
             c.run_dir, c.procs[i].name);
    printf("stop it with: pdctl cluster down --run-dir %s\n", c.run_dir);
  }
  cluster_free(&c);
  return 0;
}

/* ---- status ---- */

static int cluster_status(int argc, char **argv) {
  const char *run_dir = NULL;
  bool json = false, help = false;
  pd_opt opts[] = {
      {"run-dir", PD_OPT_STR, &run_dir, "DIR", "the cluster's run directory", NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print JSON", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl cluster status --run-dir DIR [--json]\n"
          "Exit status 0: every process runs and the router is healthy; 1 otherwise; 3: no "
          "cluster there.\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!run_dir) return pdctl_fail("cluster status needs --run-dir DIR");
  static cluster c;
  if (load_cluster(run_dir, &c, false) != 0) return 3;
  int n_alive = 0;
  bool alive[MAX_PROCS];
  for (int i = 0; i < c.n; i++) n_alive += alive[i] = proc_alive(&c.procs[i]);
  int np = -1, nd = -1, hst = -1;
  char herr[256] = "";
  char *nodes = NULL;
  if (c.http_port > 0) {
    hst = router_health(&c, 3000, &np, &nd, herr, sizeof herr);
    if (hst > 0) {
      char url[128];
      snprintf(url, sizeof url, "http://%s:%d",
               strcmp(c.host, "0.0.0.0") ? c.host : "127.0.0.1", c.http_port);
      int ns = pdctl_http(url, "GET", "/cluster/nodes", NULL, NULL, 3000, &nodes, NULL, &e);
      if (ns != 200) {
        free(nodes);
        nodes = NULL;
      }
    }
  }
  bool healthy = n_alive == c.n && hst == 200;
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "run_dir", c.run_dir);
    cJSON_AddBoolToObject(o, "healthy", healthy);
    cJSON_AddNumberToObject(o, "http_port", c.http_port);
    cJSON_AddStringToObject(o, "client_endpoint", c.client_ep);
    cJSON *h = cJSON_AddObjectToObject(o, "router_health");
    cJSON_AddNumberToObject(h, "status", hst);
    cJSON_AddNumberToObject(h, "prefill_nodes", np);
    cJSON_AddNumberToObject(h, "decode_nodes", nd);
    cJSON *arr = cJSON_AddArrayToObject(o, "processes");
    for (int i = 0; i < c.n; i++) {
      cJSON *j = cJSON_CreateObject();
      cJSON_AddStringToObject(j, "name", c.procs[i].name);
      cJSON_AddStringToObject(j, "role", c.procs[i].role);
      cJSON_AddNumberToObject(j, "pid", c.procs[i].pid);
      cJSON_AddBoolToObject(j, "alive", alive[i]);
      cJSON_AddItemToArray(arr, j);
    }
    cJSON *nj = nodes ? cJSON_Parse(nodes) : NULL;
    if (nj) cJSON_AddItemToObject(o, "nodes", nj);
    char *s = cJSON_Print(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    printf("cluster in %s: %s\n", c.run_dir, healthy ? "healthy" : "NOT healthy");
    for (int i = 0; i < c.n; i++)
      printf("  %-11s pid %-7d %s\n", c.procs[i].name, (int)c.procs[i].pid,
             alive[i] ? "running" : "not running");
    if (c.http_port <= 0) printf("  router health: unknown port\n");
    else if (hst < 0) printf("  router http://127.0.0.1:%d/health: no answer (%s)\n", c.http_port, herr);
    else
      printf("  router http://127.0.0.1:%d/health: %d, %d prefill and %d decode nodes alive\n",
             c.http_port, hst, np, nd);
    cJSON *nj = nodes ? cJSON_Parse(nodes) : NULL;
    cJSON *list = nj && cJSON_IsArray(nj) ? nj : nj ? cJSON_GetObjectItemCaseSensitive(nj, "nodes") : NULL;
    if (!list && nj) list = cJSON_GetObjectItemCaseSensitive(nj, "data");
    cJSON *n;
    cJSON_ArrayForEach(n, list) {
      cJSON *id = cJSON_GetObjectItemCaseSensitive(n, "node_id");
      if (!id) id = cJSON_GetObjectItemCaseSensitive(n, "id");
      cJSON *role = cJSON_GetObjectItemCaseSensitive(n, "role");
      cJSON *state = cJSON_GetObjectItemCaseSensitive(n, "state");
      printf("  node %-20s %-8s %s\n", cJSON_IsString(id) ? id->valuestring : "?",
             cJSON_IsString(role) ? role->valuestring : "",
             cJSON_IsString(state) ? state->valuestring : "");
    }
    cJSON_Delete(nj);
  }
  free(nodes);
  return healthy ? 0 : 1;
}

/* ---- down ---- */

static int cluster_down(int argc, char **argv) {
  const char *run_dir = NULL;
  double timeout_s = 10;
  bool help = false, quiet = false;
  pd_opt opts[] = {
      {"run-dir", PD_OPT_STR, &run_dir, "DIR", "the cluster's run directory", NULL},
      {"timeout", PD_OPT_DOUBLE, &timeout_s, "S",
       "seconds to wait after SIGTERM before SIGKILL (default 10)", NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "print only errors", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl cluster down --run-dir DIR [--timeout S]\n", stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!run_dir) return pdctl_fail("cluster down needs --run-dir DIR");
  if (timeout_s < 0) return pdctl_fail("--timeout must not be negative");
  static cluster c;
  if (load_cluster(run_dir, &c, quiet) != 0) return quiet ? 0 : 3;
  int running = 0;
  for (int i = 0; i < c.n; i++) running += proc_alive(&c.procs[i]);
  int killed = stop_procs(&c, timeout_s, !quiet);
  int left = 0;
  for (int i = 0; i < c.n; i++) left += proc_alive(&c.procs[i]);
  remove_run_files(&c, left == 0);
  if (left) return pdctl_fail("%d processes are still running after SIGKILL", left);
  if (!quiet)
    printf("cluster in %s stopped: %d processes%s\n", c.run_dir, running,
           killed ? " (some needed SIGKILL)" : "");
  return 0;
}

int cmd_cluster(int argc, char **argv) {
  const char *sub = argc > 2 ? argv[2] : NULL;
  if (sub && !strcmp(sub, "up")) return cluster_up(argc, argv);
  if (sub && !strcmp(sub, "status")) return cluster_status(argc, argv);
  if (sub && !strcmp(sub, "down")) return cluster_down(argc, argv);
  fputs("usage: pdctl cluster up|status|down [options]   ('pdctl cluster up --help')\n"
        "  up      start pd-router, P pd-prefill and D pd-decode on 127.0.0.1 as daemons\n"
        "  status  is every process running, is the router healthy\n"
        "  down    stop them (SIGTERM, then SIGKILL after --timeout)\n",
        stderr);
  return sub && (!strcmp(sub, "--help") || !strcmp(sub, "-h")) ? 0 : 2;
}
