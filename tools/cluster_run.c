/* The run directory of a local cluster (cluster.h): files, processes, cluster.json. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"
#include "pdctl.h"

void cl_path_of(char *out, size_t cap, const char *dir, const char *name, const char *ext) {
  snprintf(out, cap, "%s/%s%s", dir, name, ext);
}

void cl_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

char *cl_read_file(const char *path, size_t *len) {
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
int cl_write_file_atomic(const char *path, const char *text) {
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
unsigned long long cl_proc_start_time(pid_t pid, bool *zombie) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  char *s = cl_read_file(path, NULL);
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
bool cl_proc_alive(const proc *p) {
  if (p->pid <= 0 || p->reaped) return false;
  bool zombie = false;
  unsigned long long st = cl_proc_start_time(p->pid, &zombie);
  if (st == 0 || zombie) return false;
  return p->start_time == 0 || st == p->start_time;
}

/* Prints the last n lines of a log file to stderr. */
void cl_print_log_tail(const char *path, int n) {
  size_t len = 0;
  char *s = cl_read_file(path, &len);
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
char *cl_xstrdup(const char *s) {
  char *d = strdup(s);
  if (!d) {
    fputs("pdctl: out of memory\n", stderr);
    exit(1);
  }
  return d;
}

void cl_proc_arg(proc *p, const char *a) {
  if (p->argc + 1 >= MAX_ARGS) {
    fputs("pdctl: too many arguments\n", stderr);
    exit(1);
  }
  p->argv[p->argc++] = cl_xstrdup(a);
  p->argv[p->argc] = NULL;
}

void cl_proc_argf(proc *p, const char *fmt, ...) {
  char buf[PATH_MAX + 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  cl_proc_arg(p, buf);
}

void cl_cluster_free(cluster *c) {
  for (int i = 0; i < c->n; i++)
    for (int k = 0; k < c->procs[i].argc; k++) free(c->procs[i].argv[k]);
  c->n = 0;
}

/* Starts p as a daemon: its own session, stdin from /dev/null, stdout and stderr appended to
 * DIR/<name>.log, its pid in DIR/<name>.pid. Exec failures come back through a close-on-exec
 * pipe, so "binary not executable" is reported here rather than as a silent death. */
int cl_spawn(const cluster *c, proc *p) {
  char logp[PATH_MAX + 64], pidp[PATH_MAX + 64];
  cl_path_of(logp, sizeof logp, c->run_dir, p->name, ".log");
  cl_path_of(pidp, sizeof pidp, c->run_dir, p->name, ".pid");
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
  p->start_time = cl_proc_start_time(pid, NULL);
  char num[32];
  snprintf(num, sizeof num, "%d\n", (int)pid);
  if (cl_write_file_atomic(pidp, num) != 0)
    fprintf(stderr, "pdctl: warning: cannot write %s: %s\n", pidp, strerror(errno));
  return 0;
}

/* `up`: notes children that exited (so they are not mistaken for alive) and reaps them. */
void cl_reap(cluster *c) {
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

void cl_describe_exit(const proc *p, char *out, size_t cap) {
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
int cl_stop_procs(cluster *c, double timeout_s, bool verbose) {
  double t0 = pdctl_now();
  int killed = 0;
  for (int pass = 0; pass < 2; pass++) {
    bool router_pass = pass == 1;
    for (int i = 0; i < c->n; i++) {
      proc *p = &c->procs[i];
      if ((strcmp(p->role, "router") == 0) != router_pass) continue;
      if (cl_proc_alive(p)) kill(p->pid, SIGTERM);
    }
    /* the nodes get up to half the time before the router is told */
    double until = router_pass ? t0 + timeout_s : t0 + timeout_s / 2;
    for (;;) {
      cl_reap(c);
      bool any = false;
      for (int i = 0; i < c->n; i++) {
        proc *p = &c->procs[i];
        if ((strcmp(p->role, "router") == 0) != router_pass) continue;
        if (cl_proc_alive(p)) any = true;
      }
      if (!any || pdctl_now() >= until) break;
      cl_sleep_ms(50);
    }
  }
  for (int i = 0; i < c->n; i++) {
    proc *p = &c->procs[i];
    if (!cl_proc_alive(p)) continue;
    if (verbose) fprintf(stderr, "pdctl: %s (pid %d) ignored SIGTERM: SIGKILL\n", p->name, p->pid);
    kill(p->pid, SIGKILL);
    killed++;
  }
  double kdeadline = pdctl_now() + 5;
  for (;;) {
    cl_reap(c);
    bool any = false;
    for (int i = 0; i < c->n; i++) any |= cl_proc_alive(&c->procs[i]);
    if (!any || pdctl_now() >= kdeadline) break;
    cl_sleep_ms(20);
  }
  return killed;
}

void cl_remove_run_files(const cluster *c, bool also_json) {
  char path[PATH_MAX + 64];
  for (int i = 0; i < c->n; i++) {
    cl_path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".pid");
    unlink(path);
    cl_path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".ready");
    unlink(path);
  }
  if (also_json) {
    cl_path_of(path, sizeof path, c->run_dir, "cluster", ".json");
    unlink(path);
  }
}

/* ---- cluster.json ---- */

int cl_save_json(const cluster *c) {
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
    cl_path_of(path, sizeof path, c->run_dir, p->name, ".log");
    cJSON_AddStringToObject(j, "log", path);
    cl_path_of(path, sizeof path, c->run_dir, p->name, ".pid");
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
  cl_path_of(path, sizeof path, c->run_dir, "cluster", ".json");
  size_t l = s ? strlen(s) : 0;
  char *t = s ? realloc(s, l + 2) : NULL;
  if (t) {
    t[l] = '\n';
    t[l + 1] = 0;
  }
  int rc = t ? cl_write_file_atomic(path, t) : -1;
  free(t ? t : s);
  return rc;
}

/* Loads DIR/cluster.json; without it, falls back to the pid files (a cluster.json lost to a
 * crash of `up`) so `down` can still stop what runs. */
int cl_load_cluster(const char *run_dir, cluster *c, bool quiet) {
  memset(c, 0, sizeof *c);
  snprintf(c->run_dir, sizeof c->run_dir, "%s", run_dir);
  snprintf(c->host, sizeof c->host, "127.0.0.1");
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, run_dir, "cluster", ".json");
  char *s = cl_read_file(path, NULL);
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
      cl_path_of(path, sizeof path, run_dir, name, ".pid");
      char *t = cl_read_file(path, NULL);
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
      cl = cl_read_file(cmd, NULL);
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
int cl_router_health(const cluster *c, int timeout_ms, int *n_prefill, int *n_decode,
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

/* Reads a ready file (JSON) when present; NULL otherwise. */
cJSON *cl_read_ready(const cluster *c, const proc *p) {
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, c->run_dir, p->name, ".ready");
  char *s = cl_read_file(path, NULL);
  cJSON *o = s ? cJSON_Parse(s) : NULL;
  free(s);
  return o;
}

