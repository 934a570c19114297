/* pdctl cluster status | restart | down: the commands that act on a running local cluster
 * through its run directory (cluster.h). They read cluster.json, which the supervisor keeps
 * current (pids, start times, states, restart counts, last exits), and never write it:
 * `restart` asks the supervisor through DIR/<name>.restart, `down` stops the supervisor before
 * anything else. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"
#include "pdctl.h"

static proc *find_proc(cluster *c, const char *name) {
  for (int i = 0; i < c->n; i++)
    if (!strcmp(c->procs[i].name, name)) return &c->procs[i];
  return NULL;
}

static bool sup_alive(const cluster *c) { return cl_pid_alive(c->sup_pid, c->sup_start_time); }

/* What status shows for p: the supervisor's state, unless the process it records is gone. */
static const char *shown_state(const proc *p, bool alive) {
  if (p->state == PROC_FAILED) return "GAVE UP";
  if (p->state == PROC_RUNNING && !alive) return "not running";
  return cl_state_name(p->state);
}

/* "killed by SIGKILL 42 s ago", or "-". */
static void last_exit_text(const proc *p, char *out, size_t cap) {
  if (!p->last_exit[0]) {
    snprintf(out, cap, "-");
    return;
  }
  double ago = (double)time(NULL) - p->last_exit_time;
  snprintf(out, cap, "%s, %.0f s ago", p->last_exit, ago > 0 ? ago : 0);
}

/* Live nodes of a role that the router should count (running, as far as we can see). */
static int nodes_up(const cluster *c, const char *role) {
  int n = 0;
  for (int i = 0; i < c->n; i++)
    n += !strcmp(c->procs[i].role, role) && c->procs[i].state == PROC_RUNNING &&
         cl_proc_alive(&c->procs[i]);
  return n;
}

/* ---- status ---- */

int cl_cmd_status(int argc, char **argv) {
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
          "Exit status 0: the supervisor and every process run and the router is healthy; 1 "
          "otherwise (a process restarting, given up on, or not running; no supervisor); 3: no "
          "cluster there.\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!run_dir) return pdctl_fail("cluster status needs --run-dir DIR");
  static cluster c, strays;
  if (cl_load_cluster(run_dir, &c, false) != 0) return 3;
  cl_find_strays(&c, &strays);
  bool sup = sup_alive(&c);
  int n_ok = 0;
  bool alive[MAX_PROCS];
  for (int i = 0; i < c.n; i++) {
    alive[i] = cl_proc_alive(&c.procs[i]);
    n_ok += alive[i] && c.procs[i].state == PROC_RUNNING;
  }
  int np = -1, nd = -1, hst = -1;
  char herr[256] = "";
  char *nodes = NULL;
  if (c.http_port > 0) {
    hst = cl_router_health(&c, 3000, &np, &nd, herr, sizeof herr);
    if (hst > 0) {
      char url[128];
      snprintf(url, sizeof url, "http://%s:%d",
               strcmp(c.host, "0.0.0.0") ? c.host : "127.0.0.1", c.http_port);
      char *key = NULL; /* the router's API key guards /cluster/nodes: from the run folder */
      if (c.api_key_file[0] && pd_secret_opt("api-key", NULL, c.api_key_file, &key, &e) != PD_OK)
        fprintf(stderr, "pdctl: %s\n", e.msg);
      int ns = pdctl_http(url, "GET", "/cluster/nodes", NULL, key, 3000, &nodes, NULL, &e);
      pd_secret_free(key);
      if (ns != 200) {
        free(nodes);
        nodes = NULL;
      }
    }
  }
  bool healthy = sup && n_ok == c.n && hst == 200;
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "run_dir", c.run_dir);
    cJSON_AddBoolToObject(o, "healthy", healthy);
    cJSON_AddNumberToObject(o, "http_port", c.http_port);
    cJSON_AddStringToObject(o, "cluster_endpoint", c.cluster_ep);
    cJSON_AddStringToObject(o, "client_endpoint", c.client_ep);
    cJSON *sj = cJSON_AddObjectToObject(o, "supervisor");
    cJSON_AddNumberToObject(sj, "pid", c.sup_pid);
    cJSON_AddBoolToObject(sj, "alive", sup);
    cJSON_AddNumberToObject(sj, "restart_limit", c.restart_limit);
    cJSON_AddNumberToObject(sj, "restart_window", c.restart_window);
    cJSON *h = cJSON_AddObjectToObject(o, "router_health");
    cJSON_AddNumberToObject(h, "status", hst);
    cJSON_AddNumberToObject(h, "prefill_nodes", np);
    cJSON_AddNumberToObject(h, "decode_nodes", nd);
    cJSON *arr = cJSON_AddArrayToObject(o, "processes");
    for (int i = 0; i < c.n; i++) {
      const proc *p = &c.procs[i];
      cJSON *j = cJSON_CreateObject();
      cJSON_AddStringToObject(j, "name", p->name);
      cJSON_AddStringToObject(j, "role", p->role);
      cJSON_AddNumberToObject(j, "pid", p->pid);
      cJSON_AddBoolToObject(j, "alive", alive[i]);
      cJSON_AddStringToObject(j, "state", cl_state_name(p->state));
      cJSON_AddNumberToObject(j, "restarts", p->restarts);
      cJSON_AddStringToObject(j, "last_exit", p->last_exit);
      cJSON_AddNumberToObject(j, "last_exit_time", p->last_exit_time);
      if (p->metrics_port > 0) cJSON_AddNumberToObject(j, "metrics_port", p->metrics_port);
      cJSON_AddItemToArray(arr, j);
    }
    cJSON *sa = cJSON_AddArrayToObject(o, "not_on_record");
    for (int i = 0; i < strays.n; i++) {
      cJSON *j = cJSON_CreateObject();
      cJSON_AddNumberToObject(j, "pid", strays.procs[i].pid);
      cJSON_AddStringToObject(j, "program", strays.procs[i].name);
      cJSON_AddItemToArray(sa, j);
    }
    cJSON *nj = nodes ? cJSON_Parse(nodes) : NULL;
    if (nj) cJSON_AddItemToObject(o, "nodes", nj);
    char *s = cJSON_Print(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    printf("cluster in %s: %s\n", c.run_dir, healthy ? "healthy" : "NOT healthy");
    if (sup)
      printf("  %-11s pid %-7d running (restarts a process that exits; gives up on one that exits "
             "more than %d times within %g s)\n",
             "supervisor", (int)c.sup_pid, c.restart_limit, c.restart_window);
    else
      printf("  %-11s pid %-7d NOT running: nothing is restarted (`pdctl cluster down`, then "
             "`up`, brings one back)\n",
             "supervisor", (int)c.sup_pid);
    printf("  %-11s %-7s %-12s %-8s %s\n", "PROCESS", "PID", "STATE", "RESTARTS", "LAST EXIT");
    for (int i = 0; i < c.n; i++) {
      const proc *p = &c.procs[i];
      char pid[16], last[160];
      if (p->pid > 0) snprintf(pid, sizeof pid, "%d", (int)p->pid);
      else snprintf(pid, sizeof pid, "-");
      last_exit_text(p, last, sizeof last);
      printf("  %-11s %-7s %-12s %-8d %s\n", p->name, pid, shown_state(p, alive[i]), p->restarts,
             last);
    }
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
    for (int i = 0; i < strays.n; i++)
      printf("  not on record: %s pid %d runs with a ready file in %s (`cluster down` stops it "
             "too)\n",
             strays.procs[i].name, (int)strays.procs[i].pid, c.run_dir);
    for (int i = 0; i < c.n; i++)
      if (c.procs[i].state == PROC_FAILED)
        printf("the supervisor gave up on %s after more than %d exits within %g s (last: %s); "
               "`pdctl cluster restart --run-dir %s %s` starts it again\n",
               c.procs[i].name, c.restart_limit, c.restart_window, c.procs[i].last_exit,
               c.run_dir, c.procs[i].name);
  }
  free(nodes);
  cl_cluster_free(&c);
  return healthy ? 0 : 1;
}

/* ---- restart ---- */

/* Takes the arguments of argv[first..argc) that are neither an option of opts nor an option's
 * value out of argv (into pos, at most maxpos); returns argv's new length. */
static int take_positional(const pd_opt *opts, int argc, char **argv, int first, char **pos,
                           int maxpos, int *npos) {
  int out = first;
  *npos = 0;
  for (int i = first; i < argc; i++) {
    char *a = argv[i];
    if (a[0] == '-' && a[1] == '-' && a[2]) {
      argv[out++] = a;
      if (strchr(a, '=')) continue;
      for (const pd_opt *o = opts; o->name; o++)
        if (!strcmp(a + 2, o->name) && o->type != PD_OPT_BOOL && i + 1 < argc) {
          argv[out++] = argv[++i];
          break;
        }
    } else if (*npos < maxpos) {
      pos[(*npos)++] = a;
    } else {
      argv[out++] = a; /* one too many: pd_opts_parse refuses it */
    }
  }
  return out;
}

/* Whether p's ready file is there and was written by the process with p's pid. */
static bool ready_now(const cluster *c, const proc *p) {
  cJSON *rd = cl_read_ready(c, p);
  const cJSON *pid = rd ? cJSON_GetObjectItemCaseSensitive(rd, "pid") : NULL;
  bool yes = cJSON_IsNumber(pid) && (pid_t)pid->valuedouble == p->pid;
  cJSON_Delete(rd);
  return yes;
}

int cl_cmd_restart(int argc, char **argv) {
  const char *run_dir = NULL;
  double timeout_s = 120;
  bool help = false, quiet = false;
  pd_opt opts[] = {
      {"run-dir", PD_OPT_STR, &run_dir, "DIR", "the cluster's run directory", NULL},
      {"timeout", PD_OPT_DOUBLE, &timeout_s, "S",
       "how long to wait for the process to be back (default 120)", NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "print only errors", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  char *pos[1] = {NULL};
  int npos = 0;
  argc = take_positional(opts, argc, argv, 3, pos, 1, &npos);
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl cluster restart --run-dir DIR [--timeout S] NAME\n"
          "Restarts one process of the cluster (NAME as in `cluster status`: router, prefill-0, "
          "decode-1, ...) through its supervisor: SIGTERM (SIGKILL after 10 s), started again "
          "at once (one the supervisor gave up on, too), and waits until it is back: its ready "
          "file written and the router's /health counting every running node.\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!run_dir) return pdctl_fail("cluster restart needs --run-dir DIR");
  if (npos != 1) return pdctl_fail("cluster restart needs the NAME of one process");
  if (!(timeout_s > 0)) return pdctl_fail("--timeout must be positive");
  const char *name = pos[0];
  static cluster c;
  if (cl_load_cluster(run_dir, &c, false) != 0) return 3;
  int rc = 1;
  proc *p = find_proc(&c, name);
  if (!p) {
    char names[512] = "";
    for (int i = 0; i < c.n; i++)
      snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
               c.procs[i].name);
    pdctl_fail("no process %s in %s (there are: %s)", name, c.run_dir, names);
    goto out;
  }
  if (!sup_alive(&c)) {
    pdctl_fail("the cluster in %s has no supervisor running (pid %d gone): restart it with "
               "`pdctl cluster down --run-dir %s` and `up`",
               c.run_dir, (int)c.sup_pid, c.run_dir);
    goto out;
  }
  pid_t old_pid = p->pid, sup_pid = c.sup_pid;
  unsigned long long old_start = p->start_time, sup_start = c.sup_start_time;
  char req[PATH_MAX + 64];
  cl_path_of(req, sizeof req, c.run_dir, name, ".restart");
  if (cl_write_file_atomic(req, "restart\n") != 0) {
    pdctl_fail("%s: %s", req, strerror(errno));
    goto out;
  }
  kill(sup_pid, SIGUSR1); /* wakes it; it also looks every 100 ms */
  double t0 = pdctl_now(), deadline = t0 + timeout_s;
  char last[256] = "the supervisor has not taken the request";
  for (;;) {
    cl_sleep_ms(100);
    cl_cluster_free(&c);
    if (cl_load_cluster(run_dir, &c, true) != 0) {
      pdctl_fail("%s/cluster.json is gone: the cluster was stopped", run_dir);
      goto out;
    }
    if (!cl_pid_alive(sup_pid, sup_start)) {
      pdctl_fail("the supervisor (pid %d) ended while %s restarted", (int)sup_pid, name);
      goto out;
    }
    p = find_proc(&c, name);
    bool taken = access(req, F_OK) != 0;
    if (p && taken) {
      bool fresh = p->pid > 0 && (p->pid != old_pid || p->start_time != old_start);
      if (p->state == PROC_FAILED) {
        pdctl_fail("%s did not come back: the supervisor gave up on it (%s); its log: %s/%s.log",
                   name, p->last_exit, c.run_dir, name);
        goto out;
      } else if (!fresh || p->state != PROC_RUNNING || !cl_proc_alive(p)) {
        snprintf(last, sizeof last, "%s is %s", name, cl_state_name(p->state));
      } else if (!ready_now(&c, p)) {
        snprintf(last, sizeof last, "%s (pid %d) has not written its ready file", name,
                 (int)p->pid);
      } else {
        int np = 0, nd = 0, want_p = nodes_up(&c, "prefill"), want_d = nodes_up(&c, "decode");
        int hst = cl_router_health(&c, 2000, &np, &nd, last, sizeof last);
        if (hst == 200 && np >= want_p && nd >= want_d) {
          if (!quiet)
            printf("%s restarted in %.1f s: pid %d (was %d); the router counts %d prefill and "
                   "%d decode nodes\n",
                   name, pdctl_now() - t0, (int)p->pid, (int)old_pid, np, nd);
          rc = 0;
          goto out;
        }
        if (hst > 0)
          snprintf(last, sizeof last, "the router's /health: %d, %d of %d prefill and %d of %d "
                   "decode nodes", hst, np, want_p, nd, want_d);
      }
    }
    if (pdctl_now() > deadline) {
      pdctl_fail("%s was not back within %.0f s (%s); its log: %s/%s.log", name, timeout_s, last,
                 c.run_dir, name);
      goto out;
    }
  }
out:
  cl_cluster_free(&c);
  return rc;
}

/* ---- down ---- */

/* Stops the supervisor (SIGTERM; SIGKILL after 5 s): false when it would not end. */
static bool stop_supervisor(const cluster *c, bool verbose) {
  const int sigs[2] = {SIGTERM, SIGKILL};
  for (int k = 0; k < 2 && sup_alive(c); k++) {
    if (k == 1 && verbose)
      fprintf(stderr, "pdctl: the supervisor (pid %d) ignored SIGTERM: SIGKILL\n",
              (int)c->sup_pid);
    kill(c->sup_pid, sigs[k]);
    double until = pdctl_now() + 5;
    while (sup_alive(c) && pdctl_now() < until) cl_sleep_ms(20);
  }
  return !sup_alive(c);
}

int cl_cmd_down(int argc, char **argv) {
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
    fputs("usage: pdctl cluster down --run-dir DIR [--timeout S]\n"
          "Stops the supervisor first (nothing is restarted from then on), then the nodes and "
          "the router (SIGTERM, SIGKILL after --timeout), and any process that runs with a "
          "ready file in DIR without being on record.\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!run_dir) return pdctl_fail("cluster down needs --run-dir DIR");
  if (timeout_s < 0) return pdctl_fail("--timeout must not be negative");
  static cluster c, strays;
  if (cl_load_cluster(run_dir, &c, quiet) != 0) return quiet ? 0 : 3;
  bool had_sup = sup_alive(&c);
  if (!stop_supervisor(&c, !quiet)) {
    int rc = pdctl_fail("the supervisor (pid %d) is still running after SIGKILL", (int)c.sup_pid);
    cl_cluster_free(&c);
    return rc;
  }
  /* the supervisor's last word on the pids (a process it just restarted) */
  if (had_sup) {
    cl_cluster_free(&c);
    if (cl_load_cluster(run_dir, &c, quiet) != 0) return quiet ? 0 : 3;
  }
  int running = 0;
  for (int i = 0; i < c.n; i++) running += cl_proc_alive(&c.procs[i]);
  int killed = cl_stop_procs(&c, timeout_s, !quiet);
  int n_strays = cl_find_strays(&c, &strays);
  if (n_strays) {
    if (!quiet)
      fprintf(stderr, "pdctl: %d processes not on record run with a ready file in %s: stopping "
                      "them too\n",
              n_strays, c.run_dir);
    killed += cl_stop_procs(&strays, timeout_s, !quiet);
  }
  int left = 0;
  for (int i = 0; i < c.n; i++) left += cl_proc_alive(&c.procs[i]);
  for (int i = 0; i < strays.n; i++) left += cl_proc_alive(&strays.procs[i]);
  cl_remove_run_files(&c, left == 0);
  cl_cluster_free(&c);
  if (left) return pdctl_fail("%d processes are still running after SIGKILL", left);
  if (!quiet)
    printf("cluster in %s stopped: %d processes%s%s%s\n", c.run_dir, running + n_strays,
           had_sup ? " and the supervisor" : "", n_strays ? " (some not on record)" : "",
           killed ? " (some needed SIGKILL)" : "");
  return 0;
}
