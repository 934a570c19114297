/* The supervisor of a local cluster (`pdctl cluster supervise --run-dir DIR --ready-fd N`,
 * which `pdctl cluster up` becomes once the cluster is healthy; cluster.h).
 *
 * It is the parent of every process of the cluster, so it learns of an exit at once (SIGCHLD,
 * waitpid) and knows how the process ended. A process that exits, for whatever reason and with
 * whatever status, is started again from its argv in cluster.json after a delay that doubles
 * with each exit inside the restart window (RESTART_DELAY_S, 2x, ... up to RESTART_DELAY_MAX_S);
 * one that exits more than restart_limit times within restart_window seconds is given up
 * (state "failed", logged) until `pdctl cluster restart` asks for it again. A restart request is
 * a file DIR/<name>.restart (`pdctl cluster restart` writes it): the process gets SIGTERM
 * (SIGKILL after STOP_TIMEOUT_S) and is started again at once; such a restart counts in
 * "restarts" but not towards the limit. Every change of a pid, state or count is written to
 * cluster.json at once (atomically), which `status`, `restart` and `down` read.
 *
 * SIGTERM or SIGINT end the supervisor and leave the processes running: `pdctl cluster down`
 * stops it first, so that nothing is restarted while it stops the rest. Its messages go to
 * DIR/supervisor.log, its pid to DIR/supervisor.pid. */
#include <errno.h>
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

#define RESTART_DELAY_S 0.5     /* after the first exit within the window */
#define RESTART_DELAY_MAX_S 30  /* the doubling stops here */
#define STOP_TIMEOUT_S 10       /* a requested restart: SIGTERM, then SIGKILL after this */
#define TICK_MS 100             /* longest sleep: requests and timers are looked at this often */

/* One line in supervisor.log (stderr), with the local time. */
static void slog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void slog(const char *fmt, ...) {
  time_t t = time(NULL);
  struct tm tm;
  char when[32];
  strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime_r(&t, &tm));
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s supervisor: ", when);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(stderr);
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Unexpected exits of p within the last `window` seconds, after dropping older ones. */
static int exits_in_window(proc *p, double now, double window) {
  int keep = 0;
  for (int i = 0; i < p->n_exits; i++)
    if (now - p->exits[i] <= window) p->exits[keep++] = p->exits[i];
  p->n_exits = keep;
  return keep;
}

/* A line in the process's own log, so that a reader of it sees where one run ends. */
static void mark_log(const cluster *c, const proc *p, const char *what) {
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, c->run_dir, p->name, ".log");
  FILE *f = fopen(path, "a");
  if (!f) return;
  fprintf(f, "---- pdctl supervisor: %s ----\n", what);
  fclose(f);
}

/* p could not run on (an exit not asked for, or a failed start): restart it after the backoff,
 * or give up on it past the limit. */
static void failed_run(cluster *c, proc *p, double now) {
  if (p->n_exits == MAX_RESTART_LIMIT + 1) { /* full: the oldest goes */
    memmove(p->exits, p->exits + 1, MAX_RESTART_LIMIT * sizeof p->exits[0]);
    p->n_exits--;
  }
  p->exits[p->n_exits++] = now;
  int n = exits_in_window(p, now, c->restart_window);
  if (n > c->restart_limit) {
    p->state = PROC_FAILED;
    slog("GIVING UP on %s: %d exits within %g s (restart limit %d), the last: %s; "
         "`pdctl cluster restart --run-dir %s %s` starts it again",
         p->name, n, c->restart_window, c->restart_limit, p->last_exit, c->run_dir, p->name);
    mark_log(c, p, "given up: too many exits");
    return;
  }
  double delay = RESTART_DELAY_S;
  for (int i = 1; i < n && delay < RESTART_DELAY_MAX_S; i++) delay *= 2;
  if (delay > RESTART_DELAY_MAX_S) delay = RESTART_DELAY_MAX_S;
  p->state = PROC_BACKOFF;
  p->next_start = now + delay;
  slog("%s: %s; restarting in %.1f s (%d exits within %g s, restart limit %d)", p->name,
       p->last_exit, delay, n, c->restart_window, c->restart_limit);
}

/* Starts p again: its old ready file goes first, so that a new one means this run is up. */
static void start(cluster *c, proc *p, const char *why) {
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, c->run_dir, p->name, ".ready");
  unlink(path);
  p->metrics_port = 0;
  p->kv_endpoint[0] = 0;
  p->ready_seen = false;
  p->restarts++;
  char what[160];
  snprintf(what, sizeof what, "restart %d (%s)", p->restarts, why);
  mark_log(c, p, what);
  if (cl_spawn(c, p, true) != 0) {
    p->pid = 0;
    p->start_time = 0;
    snprintf(p->last_exit, sizeof p->last_exit, "could not be started");
    p->last_exit_time = wall_now();
    failed_run(c, p, pdctl_now());
    return;
  }
  p->state = PROC_RUNNING;
  p->started_time = wall_now();
  slog("%s: started again, pid %d (%s; restart %d)", p->name, (int)p->pid, why, p->restarts);
}

/* p (one of ours) ended with wait status st. */
static void on_exit_status(cluster *c, proc *p, int st) {
  double now = pdctl_now();
  cl_exit_reason(st, p->last_exit, sizeof p->last_exit);
  p->last_exit_time = wall_now();
  pid_t old = p->pid;
  p->pid = 0;
  p->start_time = 0;
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, c->run_dir, p->name, ".ready");
  unlink(path);
  if (p->state == PROC_STOPPING) {
    size_t l = strlen(p->last_exit);
    snprintf(p->last_exit + l, sizeof p->last_exit - l, " (restart requested)");
    slog("%s (pid %d) stopped for a requested restart: %s", p->name, (int)old, p->last_exit);
    start(c, p, "requested");
    return;
  }
  slog("%s (pid %d) exited unexpectedly: %s", p->name, (int)old, p->last_exit);
  failed_run(c, p, now);
}

/* DIR/<name>.restart: `pdctl cluster restart` asks for p. */
static bool take_request(const cluster *c, const proc *p) {
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, c->run_dir, p->name, ".restart");
  return unlink(path) == 0;
}

static void on_request(cluster *c, proc *p) {
  switch (p->state) {
    case PROC_RUNNING:
      if (p->pid > 0) {
        slog("%s: restart requested: SIGTERM to pid %d", p->name, (int)p->pid);
        kill(p->pid, SIGTERM);
        p->state = PROC_STOPPING;
        p->kill_at = pdctl_now() + STOP_TIMEOUT_S;
      }
      break;
    case PROC_BACKOFF:
    case PROC_FAILED:
      slog("%s: restart requested while %s: starting it now", p->name, cl_state_name(p->state));
      p->n_exits = 0; /* an operator's restart starts its count afresh */
      start(c, p, "requested");
      break;
    case PROC_STOPPING:
      break;
  }
}

/* The ready file of p's current run, once it is there: the ports it serves on. */
static bool read_ready(const cluster *c, proc *p) {
  cJSON *rd = cl_read_ready(c, p);
  if (!rd) return false;
  bool mine = false;
  const cJSON *pid = cJSON_GetObjectItemCaseSensitive(rd, "pid");
  if (cJSON_IsNumber(pid) && (pid_t)pid->valuedouble == p->pid) {
    mine = true;
    const cJSON *mp = cJSON_GetObjectItemCaseSensitive(rd, "metrics_port");
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(rd, "kv_endpoint");
    if (cJSON_IsNumber(mp) && mp->valueint > 0) p->metrics_port = mp->valueint;
    if (cJSON_IsString(kv)) snprintf(p->kv_endpoint, sizeof p->kv_endpoint, "%s", kv->valuestring);
  }
  cJSON_Delete(rd);
  return mine;
}

static proc *find_pid(cluster *c, pid_t pid) {
  for (int i = 0; i < c->n; i++)
    if (c->procs[i].pid == pid) return &c->procs[i];
  return NULL;
}

/* The loop: exits, requests, timers, ready files; cluster.json after every change. One byte to
 * ready_fd (unless -1) once it runs. */
static int supervise(cluster *c, int ready_fd) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGUSR1);
  sigprocmask(SIG_BLOCK, &set, NULL);
  signal(SIGPIPE, SIG_IGN);
  slog("supervising %d processes in %s (pid %d; restart limit %d within %g s)", c->n, c->run_dir,
       (int)getpid(), c->restart_limit, c->restart_window);
  if (ready_fd >= 0) {
    ssize_t w = write(ready_fd, "", 1);
    (void)w;
    close(ready_fd);
  }
  int stop_sig = 0;
  for (;;) {
    bool dirty = false;
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
      proc *p = find_pid(c, pid);
      if (p) {
        on_exit_status(c, p, st);
        dirty = true;
      }
    }
    if (stop_sig) break; /* after the exits that came with it are on record */
    double now = pdctl_now();
    for (int i = 0; i < c->n; i++) {
      proc *p = &c->procs[i];
      if (take_request(c, p)) {
        on_request(c, p);
        dirty = true;
      }
      if (p->state == PROC_BACKOFF && now >= p->next_start) {
        start(c, p, p->last_exit);
        dirty = true;
      } else if (p->state == PROC_STOPPING && p->pid > 0 && now >= p->kill_at) {
        slog("%s (pid %d) ignored SIGTERM for %d s: SIGKILL", p->name, (int)p->pid,
             STOP_TIMEOUT_S);
        kill(p->pid, SIGKILL);
        p->kill_at = now + 3600; /* once */
      }
      if (p->state == PROC_RUNNING && !p->ready_seen && p->pid > 0 && read_ready(c, p)) {
        p->ready_seen = true;
        dirty = true;
      }
    }
    if (dirty && cl_save_json(c) != 0)
      slog("cannot write %s/cluster.json: %s", c->run_dir, strerror(errno));
    struct timespec ts = {0, TICK_MS * 1000000L};
    int sig = sigtimedwait(&set, NULL, &ts);
    if (sig == SIGTERM || sig == SIGINT) stop_sig = sig;
    else if (sig == SIGHUP) slog("SIGHUP ignored (SIGTERM ends the supervisor)");
  }
  if (cl_save_json(c) != 0)
    slog("cannot write %s/cluster.json: %s", c->run_dir, strerror(errno));
  int left = 0;
  for (int i = 0; i < c->n; i++) left += c->procs[i].pid > 0;
  slog("stopped by %s; %d processes left running (`pdctl cluster down` stops them)",
       stop_sig == SIGTERM ? "SIGTERM" : "SIGINT", left);
  return 0;
}

/* `pdctl cluster supervise --run-dir DIR [--ready-fd N]`: what `up` becomes once the cluster is healthy (it
 * executes it in the process that started the cluster, so every process is its child). */
int cl_cmd_supervise(int argc, char **argv) {
  const char *run_dir = NULL;
  int ready_fd = -1;
  bool help = false;
  pd_opt opts[] = {{"run-dir", PD_OPT_STR, &run_dir, "DIR", "the cluster's run directory", NULL},
                   {"ready-fd", PD_OPT_INT, &ready_fd, "N",
                    "write one byte to file descriptor N once supervising (`cluster up` waits "
                    "for it)", NULL},
                   {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
                   {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl cluster supervise --run-dir DIR [--ready-fd N]\n"
          "The supervisor that `pdctl cluster up` leaves running; not started by hand.\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!run_dir) return pdctl_fail("cluster supervise needs --run-dir DIR");
  static cluster c;
  if (cl_load_cluster(run_dir, &c, false) != 0) return 3;
  int rc = 0;
  if (c.sup_pid != getpid()) {
    rc = pdctl_fail("cluster supervise: %s/cluster.json names pid %d as its supervisor; only "
                    "`pdctl cluster up` starts one (the processes must be its children)",
                    run_dir, (int)c.sup_pid);
  } else {
    /* every process must be our child: waitpid tells (and reaps one that already ended) */
    for (int i = 0; i < c.n && rc == 0; i++) {
      proc *p = &c.procs[i];
      if (p->pid <= 0) continue;
      int st;
      pid_t r = waitpid(p->pid, &st, WNOHANG);
      if (r < 0 && errno == ECHILD)
        rc = pdctl_fail("cluster supervise: %s (pid %d) is not a child of this process",
                        p->name, (int)p->pid);
      else if (r == p->pid)
        on_exit_status(&c, p, st);
    }
    if (rc == 0) rc = supervise(&c, ready_fd);
  }
  cl_cluster_free(&c);
  return rc;
}
