/* pdctl cluster up: a local cluster of one pd-router, P pd-prefill and D pd-decode processes on
 * 127.0.0.1, run as daemons under a supervisor and described in a run directory (cluster.h).
 *
 * `up` starts the router with free cluster and client ports (port 0: the router binds and
 * reports them in its ready file, so there is no race for a port), then the nodes pointing at
 * it, and waits — bounded — until the router's /health is 200 with every node counted. If a
 * process dies or the wait times out it prints the tail of the failing log, stops everything it
 * started and exits 1. Once the cluster is healthy, the router's recorded argv is pinned to the
 * ports it bound (a restarted router is found by the nodes again), and the process that
 * started the processes stays behind as their supervisor (cluster_supervise.c). `status`,
 * `restart` and `down` are in cluster_ctl.c.
 *
 * Security (docs/cluster.md, "Security"): unless --insecure, every process proves it belongs
 * to the cluster. `up` writes CURVE keypairs into DIR/keys (mode 0700; or takes those of
 * --secrets-dir): the router admits only the nodes' keys on its cluster port, decode nodes
 * only the nodes' keys on their KV ports. Secrets reach the processes as files, never on a
 * command line: --curve-secret-file DIR/keys/<name>.key, --api-key-file DIR/keys/api-key
 * (0600); cluster.json holds paths and public keys only. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"
#include "pd/backend_cuda.h"
#include "pd/net.h"
#include "pdctl.h"

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

/* Ctrl-C or SIGTERM while `up` waits: stop what was started instead of leaving it behind. */
static volatile sig_atomic_t g_up_interrupted;
static void on_up_signal(int sig) { g_up_interrupted = sig; }

static bool check_interrupted(void) {
  if (!g_up_interrupted) return false;
  fprintf(stderr, "pdctl: interrupted (%s): stopping what was started\n",
          strsignal(g_up_interrupted));
  return true;
}

/* The first process of c that is not running, or NULL. */
static proc *first_dead(cluster *c) {
  cl_reap(c);
  for (int i = 0; i < c->n; i++)
    if (!cl_proc_alive(&c->procs[i])) return &c->procs[i];
  return NULL;
}

static void report_dead(const cluster *c, const proc *p) {
  char how[96], logp[PATH_MAX + 64];
  cl_describe_exit(p, how, sizeof how);
  cl_path_of(logp, sizeof logp, c->run_dir, p->name, ".log");
  fprintf(stderr, "pdctl: %s (pid %d) ended during startup: %s\n", p->name, (int)p->pid, how);
  cl_print_log_tail(logp, 20);
}

static int fail_up(cluster *c, bool keep) {
  if (keep) {
    fprintf(stderr, "pdctl: --keep-on-failure: leaving the processes running; "
                    "`pdctl cluster down --run-dir %s` stops them\n",
            c->run_dir);
    cl_save_json(c);
  } else {
    cl_stop_procs(c, 5, false);
    cl_remove_run_files(c, true);
  }
  cl_cluster_free(c);
  return 1;
}

/* `up` in two processes. The parent (the command the user ran) waits; the child starts every
 * process of the cluster, so that they are its children, and once the cluster is healthy it
 * becomes their supervisor (become_supervisor), which tells the parent once it supervises;
 * the parent then exits 0. When the start fails the child cleans up and exits non-zero, and
 * the parent exits with its status. Ctrl-C or SIGTERM to the parent reach the child (which
 * stops what it started). Returns the write end of the status pipe in the child; in the parent
 * it never returns. On a failure to fork, -1 (the exit status, negated). */
static int fork_supervisor(const char *run_dir) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -pdctl_fail("pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) {
    close(fds[0]);
    close(fds[1]);
    return -pdctl_fail("fork: %s", strerror(errno));
  }
  if (child == 0) {
    close(fds[0]);
    return fds[1];
  }
  close(fds[1]);
  bool forwarded = false;
  for (;;) {
    if (g_up_interrupted && !forwarded) {
      kill(child, g_up_interrupted);
      forwarded = true;
    }
    struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
    int r = poll(&pfd, 1, 200);
    if (r <= 0) continue; /* timeout, or EINTR from a signal: forward it */
    char b;
    ssize_t n = read(fds[0], &b, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n == 1) exit(0); /* healthy and supervised; the child printed the summary */
    break;               /* EOF: the child ended */
  }
  int st = 0;
  while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
  }
  char path[PATH_MAX + 64];
  cl_path_of(path, sizeof path, run_dir, "supervisor", ".pid");
  if (access(path, F_OK) == 0) /* the cluster was up: the supervisor itself failed */
    fprintf(stderr, "pdctl: the supervisor did not start (%s/supervisor.log says why); the "
                    "processes run unsupervised: `pdctl cluster down --run-dir %s` stops them\n",
            run_dir, run_dir);
  if (WIFEXITED(st)) exit(WEXITSTATUS(st) ? WEXITSTATUS(st) : 1);
  char how[64];
  cl_exit_reason(st, how, sizeof how);
  fprintf(stderr, "pdctl: the process starting the cluster (pid %d) ended: %s\n", (int)child, how);
  exit(1);
}

/* The child of fork_supervisor, with a healthy cluster on record in cluster.json: a daemon
 * (own session, output to DIR/supervisor.log, pid in DIR/supervisor.pid) that runs `pdctl
 * cluster supervise --run-dir DIR --ready-fd N` in this very process; the supervisor tells the
 * waiting parent through N once it supervises. */
static int become_supervisor(cluster *c, int status_fd) {
  char logp[PATH_MAX + 64], pidp[PATH_MAX + 64];
  cl_path_of(logp, sizeof logp, c->run_dir, "supervisor", ".log");
  cl_path_of(pidp, sizeof pidp, c->run_dir, "supervisor", ".pid");
  int logfd = open(logp, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  int nullfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  char num[32];
  snprintf(num, sizeof num, "%d\n", (int)getpid());
  if (logfd < 0 || nullfd < 0 || cl_write_file_atomic(pidp, num) != 0) {
    fprintf(stderr, "pdctl: cannot start the supervisor: %s: %s\n", logfd < 0 ? logp : pidp,
            strerror(errno));
    if (logfd >= 0) close(logfd);
    if (nullfd >= 0) close(nullfd);
    return fail_up(c, false);
  }
  fflush(NULL);
  setsid();
  dup2(nullfd, 0);
  dup2(logfd, 1);
  dup2(logfd, 2);
  close(nullfd);
  close(logfd);
  fcntl(status_fd, F_SETFD, 0); /* kept across exec (the processes it starts close it) */
  for (int i = 0; cl_secret_env[i]; i++) unsetenv(cl_secret_env[i]); /* `up` took them */
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  char self[PATH_MAX], fd[16];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  self[n > 0 ? n : 0] = 0;
  snprintf(fd, sizeof fd, "%d", status_fd);
  char *args[] = {self, "cluster", "supervise", "--run-dir", c->run_dir, "--ready-fd", fd, NULL};
  cl_cluster_free(c);
  if (n > 0) execv(self, args);
  fprintf(stderr, "pdctl: cannot execute %s (%s): supervising from this process\n", self,
          strerror(errno));
  return cl_cmd_supervise(7, args);
}

/* Sets every value of a router flag in r's argv (`--flag V` and `--flag=V`) to v. */
static void pin_router_port(proc *r, const char *flag, int v) {
  size_t fl = strlen(flag);
  for (int i = 1; i < r->argc; i++) {
    char *a = r->argv[i];
    bool sep = !strcmp(a, flag) && i + 1 < r->argc;
    if (!sep && !(strncmp(a, flag, fl) == 0 && a[fl] == '=')) continue;
    char buf[64];
    if (sep) snprintf(buf, sizeof buf, "%d", v);
    else snprintf(buf, sizeof buf, "%s=%d", flag, v);
    free(r->argv[sep ? i + 1 : i]);
    r->argv[sep ? i + 1 : i] = cl_xstrdup(buf);
  }
}

/* Splits s at whitespace into p's argv. */
static void add_split_args(proc *p, const char *s) {
  char *copy = cl_xstrdup(s), *save = NULL;
  for (char *t = strtok_r(copy, " \t\n", &save); t; t = strtok_r(NULL, " \t\n", &save))
    cl_proc_arg(p, t);
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

/* The cluster's secrets (module comment): the keypairs (new ones in DIR/keys, or those of
 * secrets_dir; none with insecure) and the API key in DIR/keys/api-key, recorded in c. 0, or
 * 1 after a message (nothing needs undoing: a new `up` writes them again). */
static int setup_security(cluster *c, const char *secrets_dir, bool insecure, const char *api_key,
                          const char *api_key_file, bool quiet) {
  char keys[PATH_MAX - 16];
  if ((size_t)snprintf(keys, sizeof keys, "%s/keys", c->run_dir) >= sizeof keys)
    return pdctl_fail("--run-dir %s: path too long", c->run_dir);
  pd_err e = {0};
  char *key = NULL;
  if (pd_secret_opt("api-key", api_key, api_key_file, &key, &e) != PD_OK)
    return pdctl_fail("%s", e.msg);
  c->insecure = insecure;
  if (insecure) {
    if (!quiet)
      fprintf(stderr, "pdctl: warning: --insecure: no keys: any process that reaches the "
                      "cluster's ports can join it, read its requests or send KV pages\n");
  } else if (secrets_dir) {
    if (!realpath(secrets_dir, c->keys_dir)) {
      pd_secret_free(key);
      return pdctl_fail("--secrets-dir %s: %s", secrets_dir, strerror(errno));
    }
  } else {
    snprintf(c->keys_dir, sizeof c->keys_dir, "%s", keys);
    c->keys_generated = true;
    if (pdctl_keys_write(keys, c->n_prefill + c->n_decode, &e) != PD_OK) {
      pd_secret_free(key);
      return pdctl_fail("the cluster's keys: %s", e.msg);
    }
  }
  if (!insecure) { /* every file a process will be given, and the router's public key */
    char path[PATH_MAX + 64], what[64];
    pd_curve_keypair kp;
    int n = c->n_prefill + c->n_decode;
    for (int k = -3; k < n; k++) {
      if (k >= 0) snprintf(what, sizeof what, "node-%d.key", k);
      snprintf(path, sizeof path, "%s/%s", c->keys_dir,
               k == -3 ? "router.key" : k == -2 ? "router.pub" : k == -1 ? "nodes.allow" : what);
      if (access(path, R_OK) != 0) {
        pd_secret_free(key);
        return pdctl_fail("%s: %s (`pdctl keys generate --out DIR --nodes %d` writes what a "
                          "cluster of %d nodes needs)", path, strerror(errno), n, n);
      }
      if (k == -2) {
        if (pd_curve_key_arg(path, false, &kp, &e) != PD_OK) {
          pd_secret_free(key);
          return pdctl_fail("%s", e.msg);
        }
        snprintf(c->router_public_key, sizeof c->router_public_key, "%s", kp.public_z85);
      }
    }
  }
  if (key) {
    snprintf(c->api_key_file, sizeof c->api_key_file, "%s/api-key", keys);
    char *text = malloc(strlen(key) + 2);
    pd_status st = !text ? pd_err_set(&e, PD_ENOMEM, "out of memory")
                   : mkdir(keys, 0700) != 0 && errno != EEXIST
                       ? pd_err_set(&e, PD_EIO, "%s: %s", keys, strerror(errno))
                       : PD_OK;
    if (!st) {
      sprintf(text, "%s\n", key);
      st = pdctl_write_file(c->api_key_file, text, 0600, &e);
    }
    pd_secret_free(text);
    pd_secret_free(key);
    if (st) return pdctl_fail("the API key: %s", e.msg);
  }
  return 0;
}

/* p's flags for the cluster's security: the router's (node < 0) or those of node `node` (its
 * number among all nodes, prefill nodes first). Paths only: no secret is ever on a command
 * line. */
static void security_args(const cluster *c, proc *p, int node) {
  if (c->insecure) {
    cl_proc_arg(p, "--insecure");
  } else if (node < 0) {
    cl_proc_argf(p, "--curve-secret-file=%s/router.key", c->keys_dir);
    cl_proc_argf(p, "--curve-allow-file=%s/nodes.allow", c->keys_dir);
  } else {
    cl_proc_argf(p, "--curve-secret-file=%s/node-%d.key", c->keys_dir, node);
    cl_proc_argf(p, "--router-public-key=%s/router.pub", c->keys_dir);
    if (node >= c->n_prefill) cl_proc_argf(p, "--curve-allow-file=%s/nodes.allow", c->keys_dir);
  }
  if (node < 0 && c->api_key_file[0]) cl_proc_argf(p, "--api-key-file=%s", c->api_key_file);
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

/* CUDA devices, counted in a child process: a CUDA context in the supervisor would hold device
 * memory for as long as the cluster runs. */
static int gpu_count(void) {
  pid_t pid = fork();
  if (pid == 0) {
    int n = pd_cuda_device_count();
    _exit(n < 0 ? 0 : n > 100 ? 100 : n);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) return 0;
  return WEXITSTATUS(st);
}

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
             *kv_dtype = NULL, *api_key_file = NULL, *secrets_dir = NULL, *spec_method = NULL,
             *spec_adaptive = NULL;
  int spec_k = 0, ngram_min = 0, ngram_max = 0;
  int n_prefill = -1, n_decode = -1, n_unified = -1, port = 8000, restart_limit = 5;
  double gpu_util = 0, restart_window = 60;
  double timeout_s = 180;
  bool help = false, keep = false, quiet = false, insecure = false;
  pd_opt opts[] = {
      {"model", PD_OPT_STR, &model, "DIR", "model folder (every process)", NULL},
      {"speculative-model", PD_OPT_STR, &draft, "DIR",
       "speculative decoding with this draft model: decode and unified nodes speculate, prefill "
       "nodes ship the draft's KV with the model's", NULL},
      {"speculative-method", PD_OPT_STR, &spec_method, "M",
       "draft (the default with --speculative-model) or ngram, on every node",
       NULL},
      {"num-speculative-tokens", PD_OPT_INT, &spec_k, "K",
       "speculative decoding: most tokens proposed per step (the nodes' default: 4)", NULL},
      {"speculative-adaptive", PD_OPT_STR, &spec_adaptive, "on|off",
       "speculative decoding: adapt the proposals to acceptance and step times (on)", NULL},
      {"ngram-min", PD_OPT_INT, &ngram_min, "N", "n-gram speculation: shortest match", NULL},
      {"ngram-max", PD_OPT_INT, &ngram_max, "N", "n-gram speculation: longest match", NULL},
      {"prefill", PD_OPT_INT, &n_prefill, "P",
       "prefill nodes (default 1; 0 with --decode D: D unified nodes)", NULL},
      {"decode", PD_OPT_INT, &n_decode, "D", "decode nodes (default 1)", NULL},
      {"unified", PD_OPT_INT, &n_unified, "U",
       "unified nodes: decode nodes that also prefill (pd-decode --unified); the router sends "
       "them short prompts, or all when there is no prefill node. Default: none, but one alone "
       "with --device cuda on a machine with one GPU", NULL},
      {"port", PD_OPT_INT, &port, "PORT", "router HTTP port (default 8000; 0 = a free one)",
       NULL},
      {"host", PD_OPT_STR, &host, "HOST", "router HTTP bind address (default 127.0.0.1)", NULL},
      {"run-dir", PD_OPT_STR, &run_dir, "DIR", "pid, log and ready files, cluster.json", NULL},
      {"served-model-name", PD_OPT_STR, &name, "NAME", "model name for clients", NULL},
      {"api-key", PD_OPT_STR, &api_key, "KEY",
       "the router requires this key of clients, HTTP and ZeroMQ (visible in ps: prefer "
       "--api-key-file or PD_API_KEY); the router reads it from DIR/keys/api-key", NULL},
      {"api-key-file", PD_OPT_STR, &api_key_file, "FILE", "the API key from a file", NULL},
      {"secrets-dir", PD_OPT_STR, &secrets_dir, "DIR",
       "the cluster's keypairs from `pdctl keys generate --out DIR --nodes N` (N >= prefill + "
       "decode; node K gets node-K.key, prefill nodes first) instead of new ones in "
       "RUN-DIR/keys", NULL},
      {"insecure", PD_OPT_BOOL, &insecure, NULL,
       "no authentication: any process that reaches the cluster's ports can join it or send "
       "KV pages (every process logs a warning)", NULL},
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
       "KV dtype of every node (f32, bf16, f16, fp8 on CPU nodes); prefill and decode must agree (default: bf16 "
       "when CPU and GPU nodes are mixed, else the nodes' own default)", NULL},
      {"bin-dir", PD_OPT_STR, &bin_dir, "DIR",
       "where pd-router, pd-prefill, pd-decode are (default: found from pdctl's location)", NULL},
      {"timeout", PD_OPT_DOUBLE, &timeout_s, "S", "readiness wait (default 180)", NULL},
      {"restart-limit", PD_OPT_INT, &restart_limit, "N",
       "the supervisor restarts a process that exits, and gives up on one that exits more than "
       "N times within --restart-window (default 5; 0 = at its first exit)", NULL},
      {"restart-window", PD_OPT_DOUBLE, &restart_window, "S",
       "seconds in which --restart-limit counts exits (default 60)", NULL},
      {"keep-on-failure", PD_OPT_BOOL, &keep, NULL, "leave processes running if startup fails",
       NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "print only errors", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, dd, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl cluster up --model DIR [--speculative-model DIR] --prefill P --decode D "
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
  /* the layout: one GPU and no layout asked for gets one unified node (the whole GPU for one
   * process: no KV copies, no split memory); otherwise one prefill and one decode node */
  const bool layout_given = n_prefill >= 0 || n_decode >= 0 || n_unified >= 0;
  if (!layout_given && device && device_is_gpu(device) && !prefill_device && !decode_device &&
      !strchr(device, ',') && gpu_count() == 1) {
    n_prefill = n_decode = 0;
    n_unified = 1;
    if (!quiet)
      fprintf(stderr, "pdctl: one GPU: one unified node (--prefill 1 --decode 1 for the "
                      "disaggregated layout on it)\n");
  }
  if (n_unified < 0) n_unified = 0;
  if (n_prefill < 0) n_prefill = n_unified > 0 ? 0 : 1;
  if (n_decode < 0) n_decode = n_unified > 0 ? 0 : 1;
  if (n_prefill == 0 && n_unified == 0) { /* --prefill 0 --decode D: the decode nodes prefill */
    n_unified = n_decode;
    n_decode = 0;
  }
  if (n_prefill < 0 || n_prefill > 32 || n_decode < 0 || n_decode > 32 || n_unified < 0 ||
      n_unified > 32 || n_decode + n_unified < 1 || n_prefill + n_decode + n_unified > 32)
    return pdctl_fail("--prefill, --decode and --unified must be in 0..32, with at least one "
                      "decode or unified node and 32 nodes at most");
  n_decode += n_unified; /* unified nodes are decode nodes that also prefill: the last ones */
  if (port < 0 || port > 65535) return pdctl_fail("--port must be in 0..65535");
  if (!(timeout_s > 0)) return pdctl_fail("--timeout must be positive");
  if (restart_limit < 0 || restart_limit > MAX_RESTART_LIMIT)
    return pdctl_fail("--restart-limit must be in 0..%d", MAX_RESTART_LIMIT);
  if (!(restart_window > 0)) return pdctl_fail("--restart-window must be positive");
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
    return pdctl_fail("--speculative-model %s: not a folder", draft);
  if (insecure && secrets_dir) return pdctl_fail("--insecure and --secrets-dir exclude each other");
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
    return pdctl_fail("--speculative-model %s: %s", draft, strerror(errno));
  snprintf(c.model, sizeof c.model, "%s", model_abs);
  snprintf(c.host, sizeof c.host, "%s", host);
  c.n_prefill = n_prefill;
  c.n_decode = n_decode;
  c.restart_limit = restart_limit;
  c.restart_window = restart_window;
  c.started_at = (double)time(NULL);

  /* a cluster already running here? */
  {
    static cluster old;
    if (cl_load_cluster(c.run_dir, &old, true) == 0) {
      const char *what = NULL;
      pid_t pid = 0;
      if (cl_pid_alive(old.sup_pid, old.sup_start_time)) {
        what = "its supervisor";
        pid = old.sup_pid;
      }
      for (int i = 0; i < old.n && !what; i++)
        if (cl_proc_alive(&old.procs[i])) {
          what = old.procs[i].name;
          pid = old.procs[i].pid;
        }
      if (!what) cl_remove_run_files(&old, true);
      cl_cluster_free(&old);
      if (what)
        return pdctl_fail("a cluster is already running in %s (%s, pid %d); run `pdctl "
                          "cluster down --run-dir %s` first, or `pdctl cluster restart` for one "
                          "process",
                          c.run_dir, what, (int)pid, c.run_dir);
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
  const bool spec = draft || spec_method || spec_k || spec_adaptive || ngram_min || ngram_max;
  if (spec && !binary_accepts(decode_bin, "--speculative-model"))
    return pdctl_fail("%s does not take --speculative-model (no speculative decoding in this "
                      "build)", decode_bin);
  if (setup_security(&c, secrets_dir, insecure, api_key, api_key_file, quiet) != 0) return 1;

  /* the router: free cluster and client ports, reported in its ready file */
  proc *r = &c.procs[c.n++];
  snprintf(r->name, sizeof r->name, "router");
  snprintf(r->role, sizeof r->role, "router");
  cl_proc_arg(r, router_bin);
  cl_proc_arg(r, "--model");
  cl_proc_arg(r, model_abs);
  if (name) {
    cl_proc_arg(r, "--served-model-name");
    cl_proc_arg(r, name);
  }
  cl_proc_arg(r, "--host");
  cl_proc_arg(r, host);
  cl_proc_arg(r, "--port");
  cl_proc_argf(r, "%d", port);
  cl_proc_arg(r, "--cluster-port");
  cl_proc_arg(r, "0");
  cl_proc_arg(r, "--client-port");
  cl_proc_arg(r, "0");
  security_args(&c, r, -1);
  cl_proc_arg(r, "--ready-file");
  cl_proc_argf(r, "%s/router.ready", c.run_dir);
  if (router_args) add_split_args(r, router_args);
  double t0 = pdctl_now(), deadline = t0 + timeout_s;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_up_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  /* From here on the child does the work: it starts every process (so they are its children)
   * and, once the cluster is healthy, becomes its supervisor; this process waits for it. */
  int status_fd = fork_supervisor(c.run_dir);
  if (status_fd < 0) {
    cl_cluster_free(&c);
    return -status_fd;
  }
  if (!quiet) fprintf(stderr, "pdctl: starting pd-router (logs in %s)\n", c.run_dir);
  if (cl_spawn(&c, r, false) != 0) return fail_up(&c, false);
  for (;;) {
    if (check_interrupted()) return fail_up(&c, false);
    proc *dead = first_dead(&c);
    if (dead) {
      report_dead(&c, dead);
      return fail_up(&c, keep);
    }
    cJSON *rd = cl_read_ready(&c, r);
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
      cl_path_of(logp, sizeof logp, c.run_dir, "router", ".log");
      cl_print_log_tail(logp, 20);
      return fail_up(&c, keep);
    }
    cl_sleep_ms(50);
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
    cl_proc_arg(p, pre ? prefill_bin : decode_bin);
    cl_proc_arg(p, "--model");
    cl_proc_arg(p, model_abs);
    /* every node: decode nodes speculate, prefill nodes compute the draft's KV of the prompts
     * and ship it with the model's */
    if (draft) {
      cl_proc_arg(p, "--speculative-model");
      cl_proc_arg(p, draft_abs);
    }
    if (spec_method) {
      cl_proc_arg(p, "--speculative-method");
      cl_proc_arg(p, spec_method);
    }
    if (!pre && spec_adaptive) {
      cl_proc_arg(p, "--speculative-adaptive");
      cl_proc_arg(p, spec_adaptive);
    }
    const struct { const char *flag; int v; } ints[] = {
        {"--num-speculative-tokens", spec_k}, {"--ngram-min", ngram_min}, {"--ngram-max", ngram_max}};
    for (size_t j = 0; j < sizeof ints / sizeof ints[0]; j++)
      if (!pre && ints[j].v) {
        char v[16];
        snprintf(v, sizeof v, "%d", ints[j].v);
        cl_proc_arg(p, ints[j].flag);
        cl_proc_arg(p, v);
      }
    if (name) {
      cl_proc_arg(p, "--served-model-name");
      cl_proc_arg(p, name);
    }
    cl_proc_arg(p, "--router");
    cl_proc_arg(p, c.cluster_ep);
    cl_proc_arg(p, "--node-id");
    cl_proc_arg(p, p->name);
    cl_proc_arg(p, "--metrics-port");
    cl_proc_arg(p, "0");
    if (!pre) {
      cl_proc_arg(p, "--kv-port");
      cl_proc_arg(p, "0");
      if (idx >= n_decode - n_unified) cl_proc_arg(p, "--unified");
    }
    cl_proc_arg(p, "--ready-file");
    cl_proc_argf(p, "%s/%s.ready", c.run_dir, p->name);
    security_args(&c, p, k);
    cl_proc_arg(p, "--device");
    cl_proc_arg(p, dev);
    if (gpu && gpu_util > 0) cl_proc_argf(p, "--gpu-memory-utilization=%g", gpu_util);
    if (kv_dtype) cl_proc_argf(p, "--kv-cache-dtype=%s", kv_dtype);
    if (pre && prefill_args) add_split_args(p, prefill_args);
    if (!pre && decode_args) add_split_args(p, decode_args);
    for (int i = dd + 1; i < argc; i++) cl_proc_arg(p, argv[i]);
    /* The nodes share this machine's cores: unless told otherwise, split them so that the
     * CPU backends' spinning thread pools never oversubscribe it (2 nodes x all cores on
     * 2 cores runs several times slower than 1 thread each). */
    if (!threads_given && !gpu) cl_proc_argf(p, "--threads=%d", node_threads);
    if (cl_spawn(&c, p, false) != 0) return fail_up(&c, false);
  }
  if (!quiet)
    fprintf(stderr, "pdctl: started %d prefill, %d decode and %d unified nodes; waiting for them "
                    "to register\n", n_prefill, n_decode - n_unified, n_unified);

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
      cJSON *rd = cl_read_ready(&c, p);
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
      int st = cl_router_health(&c, 2000, &np, &nd, last, sizeof last);
      if (st == 200 && np >= n_prefill && nd >= n_decode) break;
    } else {
      snprintf(last, sizeof last, "%d of %d nodes registered", ready, c.n - 1);
    }
    if (pdctl_now() > deadline) {
      fprintf(stderr, "pdctl: the cluster was not ready within %.0f s (%s)\n", timeout_s, last);
      for (int i = 1; i < c.n; i++) {
        cJSON *rd = cl_read_ready(&c, &c.procs[i]);
        if (rd) {
          cJSON_Delete(rd);
          continue;
        }
        char logp[PATH_MAX + 64];
        cl_path_of(logp, sizeof logp, c.run_dir, c.procs[i].name, ".log");
        fprintf(stderr, "pdctl: %s has not registered\n", c.procs[i].name);
        cl_print_log_tail(logp, 10);
      }
      return fail_up(&c, keep);
    }
    cl_sleep_ms(100);
  }
  /* a restarted router binds the ports this one did: the nodes find it again */
  pin_router_port(r, "--port", c.http_port);
  pin_router_port(r, "--cluster-port", cl_endpoint_port(c.cluster_ep));
  pin_router_port(r, "--client-port", c.client_ep[0] ? cl_endpoint_port(c.client_ep) : -1);
  double now = (double)time(NULL);
  for (int i = 0; i < c.n; i++) c.procs[i].started_time = now;
  c.sup_pid = getpid();
  c.sup_start_time = cl_proc_start_time(c.sup_pid, NULL);
  if (cl_save_json(&c) != 0) {
    fprintf(stderr, "pdctl: cannot write %s/cluster.json: %s\n", c.run_dir, strerror(errno));
    return fail_up(&c, false);
  }
  if (!quiet) {
    printf("cluster up in %.1f s: router http://%s:%d (client API %s), %d prefill, %d decode, "
           "%d unified\n", pdctl_now() - t0, strcmp(host, "0.0.0.0") ? host : "127.0.0.1",
           c.http_port, c.client_ep[0] ? c.client_ep : "off", n_prefill, n_decode - n_unified,
           n_unified);
    for (int i = 0; i < c.n; i++)
      printf("  %-11s pid %-7d log %s/%s.log\n", c.procs[i].name, (int)c.procs[i].pid,
             c.run_dir, c.procs[i].name);
    printf("  %-11s pid %-7d log %s/supervisor.log (restarts a process that exits, up to %d "
           "times within %g s)\n",
           "supervisor", (int)c.sup_pid, c.run_dir, restart_limit, restart_window);
    printf("stop it with: pdctl cluster down --run-dir %s\n", c.run_dir);
  }
  return become_supervisor(&c, status_fd);
}

int cmd_cluster(int argc, char **argv) {
  const char *sub = argc > 2 ? argv[2] : NULL;
  if (sub && !strcmp(sub, "up")) return cluster_up(argc, argv);
  if (sub && !strcmp(sub, "status")) return cl_cmd_status(argc, argv);
  if (sub && !strcmp(sub, "restart")) return cl_cmd_restart(argc, argv);
  if (sub && !strcmp(sub, "down")) return cl_cmd_down(argc, argv);
  if (sub && !strcmp(sub, "supervise")) return cl_cmd_supervise(argc, argv);
  fputs("usage: pdctl cluster up|status|restart|down [options]   ('pdctl cluster up --help')\n"
        "  up       start pd-router, P pd-prefill and D pd-decode on 127.0.0.1 as daemons,\n"
        "           and a supervisor that restarts any of them that exits\n"
        "  status   every process (state, restarts, last exit), the supervisor, the router\n"
        "  restart  restart one process by name (router, prefill-0, decode-1, ...)\n"
        "  down     stop the supervisor, then every process (SIGTERM, SIGKILL after --timeout)\n",
        stderr);
  return sub && (!strcmp(sub, "--help") || !strcmp(sub, "-h")) ? 0 : 2;
}

