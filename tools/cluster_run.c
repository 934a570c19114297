/* The run directory of a local cluster (cluster.h): files, processes, cluster.json. */
#include <dirent.h>
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

int cl_write_file_atomic(const char *path, const char *text) {
  return pdctl_write_file(path, text, 0644, NULL) == PD_OK ? 0 : -1;
}

const char *const cl_secret_env[] = {"PD_API_KEY",          "PD_API_KEY_FILE",
                                     "PD_CURVE_SECRET_KEY", "PD_CURVE_SECRET_FILE",
                                     "PD_CURVE_ALLOW_FILE", "PD_ROUTER_PUBLIC_KEY",
                                     "PD_INSECURE",         NULL};

/* Start time of pid in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 if gone.
 * *zombie tells an exited process that nobody has reaped yet. */
unsigned long long cl_proc_start_time(pid_t pid, bool *zombie) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  char *s = pdctl_read_file(path, NULL);
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
bool cl_pid_alive(pid_t pid, unsigned long long start_time) {
  if (pid <= 0) return false;
  bool zombie = false;
  unsigned long long st = cl_proc_start_time(pid, &zombie);
  if (st == 0 || zombie) return false;
  return start_time == 0 || st == start_time;
}

bool cl_proc_alive(const proc *p) { return !p->reaped && cl_pid_alive(p->pid, p->start_time); }

/* Prints the last n lines of a log file to stderr. */
void cl_print_log_tail(const char *path, int n) {
  size_t len = 0;
  char *s = pdctl_read_file(path, &len);
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
 * DIR/<name>.log (emptied first unless keep_log), its pid in DIR/<name>.pid. Exec failures come
 * back through a close-on-exec pipe, so "binary not executable" is reported here rather than
 * as a silent death. */
int cl_spawn(const cluster *c, proc *p, bool keep_log) {
  char logp[PATH_MAX + 64], pidp[PATH_MAX + 64];
  cl_path_of(logp, sizeof logp, c->run_dir, p->name, ".log");
  cl_path_of(pidp, sizeof pidp, c->run_dir, p->name, ".pid");
  int logfd = open(logp, O_WRONLY | O_CREAT | (keep_log ? 0 : O_TRUNC) | O_APPEND | O_CLOEXEC,
                   0644);
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
    for (int i = 0; cl_secret_env[i]; i++) unsetenv(cl_secret_env[i]);
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

static const char *signal_name(int sig) {
  static const struct {
    int sig;
    const char *name;
  } names[] = {{SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"},
               {SIGILL, "SIGILL"},   {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"},
               {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGKILL, "SIGKILL"},
               {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
               {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},
               {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (names[i].sig == sig) return names[i].name;
  return NULL;
}

void cl_exit_reason(int wstatus, char *out, size_t cap) {
  if (WIFEXITED(wstatus)) {
    snprintf(out, cap, "exit %d", WEXITSTATUS(wstatus));
  } else if (WIFSIGNALED(wstatus)) {
    int sig = WTERMSIG(wstatus);
    const char *name = signal_name(sig);
    const char *core = WCOREDUMP(wstatus) ? " (core dumped)" : "";
    if (name) snprintf(out, cap, "killed by %s%s", name, core);
    else snprintf(out, cap, "killed by signal %d%s", sig, core);
  } else {
    snprintf(out, cap, "wait status %#x", (unsigned)wstatus);
  }
}

void cl_describe_exit(const proc *p, char *out, size_t cap) {
  if (p->reaped) cl_exit_reason(p->exit_status, out, cap);
  else snprintf(out, cap, "gone");
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

/* DIR/keys: the API key, and the keypairs `up` made (never those of --secrets-dir). */
static void remove_keys(const cluster *c) {
  char dir[PATH_MAX + 16], path[PATH_MAX + 64];
  snprintf(dir, sizeof dir, "%s/keys", c->run_dir);
  snprintf(path, sizeof path, "%s/api-key", dir);
  unlink(path);
  if (c->keys_generated) {
    static const char *const fixed[] = {"router.key", "router.pub", "nodes.allow"};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
      snprintf(path, sizeof path, "%s/%s", dir, fixed[i]);
      unlink(path);
    }
    for (int k = 0; k < c->n_prefill + c->n_decode; k++)
      for (int pub = 0; pub < 2; pub++) {
        snprintf(path, sizeof path, "%s/node-%d.%s", dir, k, pub ? "pub" : "key");
        unlink(path);
      }
  }
  rmdir(dir); /* only when empty: a file of the user's stays */
}

void cl_remove_run_files(const cluster *c, bool also_json) {
  char path[PATH_MAX + 64];
  for (int i = 0; i < c->n; i++) {
    cl_path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".pid");
    unlink(path);
    cl_path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".ready");
    unlink(path);
    cl_path_of(path, sizeof path, c->run_dir, c->procs[i].name, ".restart");
    unlink(path);
  }
  cl_path_of(path, sizeof path, c->run_dir, "supervisor", ".pid");
  unlink(path);
  if (also_json) {
    cl_path_of(path, sizeof path, c->run_dir, "cluster", ".json");
    unlink(path);
    remove_keys(c);
  }
}

/* Whether /proc/<pid>/cmdline's first argument contains what. */
static bool cmdline_has(pid_t pid, const char *what) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
  char *cl = pid > 0 ? pdctl_read_file(path, NULL) : NULL;
  bool yes = cl && strstr(cl, what);
  free(cl);
  return yes;
}

/* ---- cluster.json ---- */

static const char *const state_names[] = {"running", "restarting", "stopping", "failed"};

const char *cl_state_name(proc_state s) {
  return (unsigned)s < sizeof state_names / sizeof state_names[0] ? state_names[s] : "?";
}

static proc_state state_of(const char *name) {
  for (size_t i = 0; i < sizeof state_names / sizeof state_names[0]; i++)
    if (!strcmp(name, state_names[i])) return (proc_state)i;
  return PROC_RUNNING;
}

int cl_endpoint_port(const char *ep) {
  const char *colon = ep ? strrchr(ep, ':') : NULL;
  return colon && colon[1] ? atoi(colon + 1) : -1;
}

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
  cJSON_AddNumberToObject(o, "cluster_port", cl_endpoint_port(c->cluster_ep));
  cJSON_AddNumberToObject(o, "client_port", cl_endpoint_port(c->client_ep));
  cJSON_AddNumberToObject(o, "prefill", c->n_prefill);
  cJSON_AddNumberToObject(o, "decode", c->n_decode);
  cJSON_AddNumberToObject(o, "started_at", c->started_at);
  char path[PATH_MAX + 64];
  cJSON *sup = cJSON_AddObjectToObject(o, "supervisor");
  cJSON_AddNumberToObject(sup, "pid", c->sup_pid);
  cJSON_AddNumberToObject(sup, "start_time", (double)c->sup_start_time);
  cl_path_of(path, sizeof path, c->run_dir, "supervisor", ".log");
  cJSON_AddStringToObject(sup, "log", path);
  cJSON_AddNumberToObject(sup, "restart_limit", c->restart_limit);
  cJSON_AddNumberToObject(sup, "restart_window", c->restart_window);
  /* paths and public keys only: nothing here is a secret */
  cJSON *sec = cJSON_AddObjectToObject(o, "security");
  cJSON_AddBoolToObject(sec, "insecure", c->insecure);
  if (!c->insecure) {
    cJSON_AddStringToObject(sec, "keys_dir", c->keys_dir);
    cJSON_AddBoolToObject(sec, "keys_generated", c->keys_generated);
    cJSON_AddStringToObject(sec, "router_public_key", c->router_public_key);
  }
  if (c->api_key_file[0]) cJSON_AddStringToObject(sec, "api_key_file", c->api_key_file);
  cJSON *arr = cJSON_AddArrayToObject(o, "processes");
  for (int i = 0; i < c->n; i++) {
    const proc *p = &c->procs[i];
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "name", p->name);
    cJSON_AddStringToObject(j, "role", p->role);
    cJSON_AddNumberToObject(j, "pid", p->pid);
    cJSON_AddNumberToObject(j, "start_time", (double)p->start_time);
    cJSON_AddStringToObject(j, "state", cl_state_name(p->state));
    cJSON_AddNumberToObject(j, "restarts", p->restarts);
    cJSON_AddStringToObject(j, "last_exit", p->last_exit);
    cJSON_AddNumberToObject(j, "last_exit_time", p->last_exit_time);
    cJSON_AddNumberToObject(j, "started_time", p->started_time);
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

static void json_str(const cJSON *o, const char *key, char *out, size_t cap) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (cJSON_IsString(v)) snprintf(out, cap, "%s", v->valuestring);
}

static double json_num(const cJSON *o, const char *key, double dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

/* One entry of cluster.json's "processes" into p; false when it is not one. */
static bool load_proc(const cJSON *j, proc *p) {
  memset(p, 0, sizeof *p);
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
  if (!cJSON_IsString(name) || !cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "pid")))
    return false;
  snprintf(p->name, sizeof p->name, "%s", name->valuestring);
  json_str(j, "role", p->role, sizeof p->role);
  p->pid = (pid_t)json_num(j, "pid", 0);
  p->start_time = (unsigned long long)json_num(j, "start_time", 0);
  p->metrics_port = (int)json_num(j, "metrics_port", 0);
  json_str(j, "kv_endpoint", p->kv_endpoint, sizeof p->kv_endpoint);
  char state[32] = "running";
  json_str(j, "state", state, sizeof state);
  p->state = state_of(state);
  p->restarts = (int)json_num(j, "restarts", 0);
  json_str(j, "last_exit", p->last_exit, sizeof p->last_exit);
  p->last_exit_time = json_num(j, "last_exit_time", 0);
  p->started_time = json_num(j, "started_time", 0);
  const cJSON *a;
  cJSON_ArrayForEach(a, cJSON_GetObjectItemCaseSensitive(j, "argv"))
    if (cJSON_IsString(a)) cl_proc_arg(p, a->valuestring);
  return true;
}

/* Loads DIR/cluster.json; without it, falls back to the pid files (a cluster.json lost to a
 * crash of `up`) so `down` can still stop what runs. */
int cl_load_cluster(const char *run_dir, cluster *c, bool quiet) {
  memset(c, 0, sizeof *c);
  snprintf(c->run_dir, sizeof c->run_dir, "%s", run_dir);
  snprintf(c->host, sizeof c->host, "127.0.0.1");
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, run_dir, "cluster", ".json");
  char *s = pdctl_read_file(path, NULL);
  cJSON *o = s ? cJSON_Parse(s) : NULL;
  free(s);
  if (o) {
    json_str(o, "model", c->model, sizeof c->model);
    json_str(o, "host", c->host, sizeof c->host);
    c->http_port = (int)json_num(o, "http_port", 0);
    json_str(o, "cluster_endpoint", c->cluster_ep, sizeof c->cluster_ep);
    json_str(o, "client_endpoint", c->client_ep, sizeof c->client_ep);
    c->n_prefill = (int)json_num(o, "prefill", 0);
    c->n_decode = (int)json_num(o, "decode", 0);
    c->started_at = json_num(o, "started_at", 0);
    const cJSON *sup = cJSON_GetObjectItemCaseSensitive(o, "supervisor");
    c->sup_pid = (pid_t)json_num(sup, "pid", 0);
    c->sup_start_time = (unsigned long long)json_num(sup, "start_time", 0);
    c->restart_limit = (int)json_num(sup, "restart_limit", 0);
    c->restart_window = json_num(sup, "restart_window", 0);
    const cJSON *sec = cJSON_GetObjectItemCaseSensitive(o, "security");
    c->insecure = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(sec, "insecure"));
    c->keys_generated = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(sec, "keys_generated"));
    json_str(sec, "keys_dir", c->keys_dir, sizeof c->keys_dir);
    json_str(sec, "router_public_key", c->router_public_key, sizeof c->router_public_key);
    json_str(sec, "api_key_file", c->api_key_file, sizeof c->api_key_file);
    const cJSON *j;
    cJSON_ArrayForEach(j, cJSON_GetObjectItemCaseSensitive(o, "processes")) {
      if (c->n >= MAX_PROCS) break;
      if (load_proc(j, &c->procs[c->n])) c->n++;
    }
    cJSON_Delete(o);
    return 0;
  }
  /* no cluster.json: the supervisor's pid file, if its process is a pdctl */
  cl_path_of(path, sizeof path, run_dir, "supervisor", ".pid");
  char *sp = pdctl_read_file(path, NULL);
  if (sp) {
    c->sup_pid = (pid_t)atoi(sp);
    free(sp);
    if (!cmdline_has(c->sup_pid, "pdctl")) c->sup_pid = 0;
  }
  /* no cluster.json: the pid files that exist */
  const char *roles[3] = {"router", "prefill", "decode"};
  for (int r = 0; r < 3; r++) {
    for (int i = 0; i < (r == 0 ? 1 : 32); i++) {
      char name[32];
      if (r == 0) snprintf(name, sizeof name, "router");
      else snprintf(name, sizeof name, "%s-%d", roles[r], i);
      cl_path_of(path, sizeof path, run_dir, name, ".pid");
      char *t = pdctl_read_file(path, NULL);
      if (!t) continue;
      proc *p = &c->procs[c->n++];
      memset(p, 0, sizeof *p);
      snprintf(p->name, sizeof p->name, "%s", name);
      snprintf(p->role, sizeof p->role, "%s", roles[r]);
      p->pid = (pid_t)atoi(t);
      free(t);
      /* no start time on record: only signal a process whose command line names the binary */
      if (!cmdline_has(p->pid, r == 0 ? "pd-router" : r == 1 ? "pd-prefill" : "pd-decode"))
        p->pid = 0;
    }
  }
  if (c->n == 0 && c->sup_pid == 0) {
    if (!quiet) fprintf(stderr, "pdctl: no cluster in %s (no cluster.json, no pid files)\n", run_dir);
    return -1;
  }
  return 0;
}

/* Whether a command line (NUL-separated arguments, len bytes) holds `--ready-file PATH` or
 * `--ready-file=PATH` with PATH a ready file in run_dir. */
static bool argv_has_ready_file_in(const char *cl, size_t len, const char *run_dir) {
  size_t dl = strlen(run_dir);
  bool after_flag = false;
  for (const char *a = cl; a < cl + len; a += strlen(a) + 1) {
    const char *path = NULL;
    if (after_flag) path = a;
    else if (!strncmp(a, "--ready-file=", 13)) path = a + 13;
    after_flag = !strcmp(a, "--ready-file");
    size_t pl = path ? strlen(path) : 0;
    if (path && pl > dl + 7 && !strncmp(path, run_dir, dl) && path[dl] == '/' &&
        !strchr(path + dl + 1, '/') && !strcmp(path + pl - 6, ".ready"))
      return true;
  }
  return false;
}

int cl_find_strays(const cluster *c, cluster *strays) {
  memset(strays, 0, sizeof *strays);
  snprintf(strays->run_dir, sizeof strays->run_dir, "%s", c->run_dir);
  DIR *d = opendir("/proc");
  if (!d) return 0;
  struct dirent *de;
  while ((de = readdir(d)) && strays->n < MAX_PROCS) {
    char *end;
    long pid = strtol(de->d_name, &end, 10);
    if (*end || pid <= 0 || pid == getpid()) continue;
    bool known = false;
    for (int i = 0; i < c->n && !known; i++) known = c->procs[i].pid == pid;
    if (known) continue;
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/cmdline", pid);
    size_t len = 0;
    char *cl = pdctl_read_file(path, &len);
    if (cl && argv_has_ready_file_in(cl, len, c->run_dir)) {
      bool zombie = false;
      unsigned long long st = cl_proc_start_time((pid_t)pid, &zombie);
      if (st && !zombie) {
        proc *p = &strays->procs[strays->n++];
        p->pid = (pid_t)pid;
        p->start_time = st;
        const char *base = strrchr(cl, '/');
        snprintf(p->name, sizeof p->name, "%s", base ? base + 1 : cl);
        snprintf(p->role, sizeof p->role, "%s", strstr(p->name, "router") ? "router" : "node");
      }
    }
    free(cl);
  }
  closedir(d);
  return strays->n;
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
  char *s = pdctl_read_file(path, NULL);
  cJSON *o = s ? cJSON_Parse(s) : NULL;
  free(s);
  return o;
}

