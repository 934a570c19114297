/* pdctl cluster: the run directory of a local cluster and the processes it records (internal to
 * pdctl: cmd_cluster.c starts a cluster, cluster_supervise.c supervises it, cluster_ctl.c holds
 * status, restart and down, cluster_run.c the plumbing below).
 *
 *   DIR/<name>.pid       the process id          (name: router, prefill-0.., decode-0..)
 *   DIR/<name>.log       its stdout and stderr, across restarts
 *   DIR/<name>.ready     the ready file the process writes once serving (docs/cluster.md)
 *   DIR/<name>.restart   a restart request for the supervisor (`pdctl cluster restart`)
 *   DIR/supervisor.pid   the supervisor's process id; DIR/supervisor.log its messages
 *   DIR/keys/            mode 0700: the cluster's CURVE keypairs (pdctl keys generate's layout:
 *                        router.key, router.pub, node-K.key, node-K.pub, nodes.allow; not with
 *                        --secrets-dir or --insecure) and the API key (api-key, 0600); `down`
 *                        removes them
 *   DIR/cluster.json     ports, endpoints, the supervisor, and per process its pid (with its
 *                        start time, so a recycled pid is never signalled), state, restart
 *                        count, last exit and command line; `up` writes it, then only the
 *                        supervisor does (atomically) */
#ifndef PDCTL_CLUSTER_H
#define PDCTL_CLUSTER_H

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define MAX_PROCS 66 /* router + up to 32 prefill + 32 decode (+1 spare) */
#define MAX_ARGS 256
#define MAX_RESTART_LIMIT 100 /* --restart-limit's largest value */

/* What the supervisor is doing with a process (cluster.json "state"). */
typedef enum proc_state {
  PROC_RUNNING,  /* "running": started, and alive as far as the supervisor has seen */
  PROC_BACKOFF,  /* "restarting": exited, to be started again at next_start */
  PROC_STOPPING, /* "stopping": `cluster restart` asked for it; started again once it exits */
  PROC_FAILED,   /* "failed": exited more than restart_limit times within restart_window */
} proc_state;

typedef struct proc {
  char name[32];   /* router, prefill-0, decode-1, ... */
  char role[16];   /* router, prefill, decode */
  pid_t pid;       /* 0 while it is not running */
  unsigned long long start_time; /* /proc/<pid>/stat field 22: tells a recycled pid apart */
  bool reaped;     /* `up`: waitpid saw it exit */
  int exit_status; /* its wait status when reaped */
  int metrics_port;
  char kv_endpoint[128];
  char *argv[MAX_ARGS];
  int argc;
  /* kept by the supervisor, recorded in cluster.json */
  proc_state state;
  int restarts;          /* times the supervisor started it again, for any reason */
  char last_exit[96];    /* "exit 3", "killed by SIGKILL", ... ("" = never exited) */
  double last_exit_time; /* wall clock (s since the epoch), 0 = never */
  double started_time;   /* wall clock of the current start */
  /* the supervisor's own bookkeeping (not recorded) */
  double exits[MAX_RESTART_LIMIT + 1]; /* monotonic times of the latest unexpected exits */
  int n_exits;
  double next_start;     /* PROC_BACKOFF: monotonic time of the next start */
  double kill_at;        /* PROC_STOPPING: monotonic time of the SIGKILL */
  bool ready_seen;       /* its ready file of this start has been read */
} proc;

typedef struct cluster {
  char run_dir[PATH_MAX];
  char model[PATH_MAX];
  int http_port;
  char host[64];
  char cluster_ep[128], client_ep[128];
  double started_at; /* wall clock of `up` */
  proc procs[MAX_PROCS];
  int n;
  int n_prefill, n_decode;
  /* the supervisor */
  pid_t sup_pid;
  unsigned long long sup_start_time;
  int restart_limit;     /* exits within restart_window after which a process is given up */
  double restart_window; /* seconds */
  /* security (no secret in here: paths and public keys) */
  bool insecure;                 /* --insecure: no keys */
  char keys_dir[PATH_MAX];       /* the keypairs: DIR/keys, or --secrets-dir */
  bool keys_generated;           /* keys_dir is DIR/keys, made by `up` (removed by `down`) */
  char router_public_key[48];    /* Z85 */
  char api_key_file[PATH_MAX];   /* DIR/keys/api-key when the router has an API key, else "" */
} cluster;


/* DIR/<name><ext> into out. */
void cl_path_of(char *out, size_t cap, const char *dir, const char *name, const char *ext);
void cl_sleep_ms(int ms);
/* Writes text to path atomically (temp file + rename), mode 0644; -1 with errno on failure. */
int cl_write_file_atomic(const char *path, const char *text);
/* The environment variables that carry secrets or security settings (PD_API_KEY,
 * PD_CURVE_SECRET_KEY, ...): `up` takes its own from them and gives each process its settings
 * on its command line as paths, so cl_spawn removes them from the processes' environment. */
extern const char *const cl_secret_env[];
/* Start time of pid in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 if gone.
 * *zombie tells an exited process that nobody has reaped yet. */
unsigned long long cl_proc_start_time(pid_t pid, bool *zombie);
/* Whether the process we started (pid + start time) still runs. */
bool cl_proc_alive(const proc *p);
/* Whether pid runs and (unless start_time is 0) started at start_time. */
bool cl_pid_alive(pid_t pid, unsigned long long start_time);
/* Prints the last n lines of a log file to stderr. */
void cl_print_log_tail(const char *path, int n);
char *cl_xstrdup(const char *s);
void cl_proc_arg(proc *p, const char *a);
void cl_proc_argf(proc *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cl_cluster_free(cluster *c);
/* Starts p as a daemon (its own session, stdin /dev/null, output to DIR/<name>.log, pid in
 * DIR/<name>.pid; the log is emptied first unless keep_log); 0, or -1 with a message on
 * stderr. */
int cl_spawn(const cluster *c, proc *p, bool keep_log);
/* Notes children of this process that exited (so they are not mistaken for alive). */
void cl_reap(cluster *c);
/* "exit 3", "killed by SIGKILL", "killed by SIGSEGV (core dumped)" for a wait status. */
void cl_exit_reason(int wstatus, char *out, size_t cap);
/* `up`: how p ended, once reaped. */
void cl_describe_exit(const proc *p, char *out, size_t cap);
/* SIGTERM to the nodes, then the router, SIGKILL after timeout_s; returns how many needed
 * SIGKILL. */
int cl_stop_procs(cluster *c, double timeout_s, bool verbose);
void cl_remove_run_files(const cluster *c, bool also_json);
/* Writes DIR/cluster.json atomically (temp file + rename): `up`, then only the supervisor. */
int cl_save_json(const cluster *c);
const char *cl_state_name(proc_state s);
/* The port of "tcp://host:port", -1 for "" or no port. */
int cl_endpoint_port(const char *ep);
/* Processes that run with a ready file in c's run directory (`--ready-file DIR/x.ready`, as
 * every process of the cluster does) but are not among c's records: started by hand from a
 * recorded argv, or by a supervisor that died before recording them. Filled into strays (name:
 * the program, role "router" or "node"); returns how many. */
int cl_find_strays(const cluster *c, cluster *strays);
/* Loads DIR/cluster.json (or, without it, the pid files); -1 when there is no cluster. */
int cl_load_cluster(const char *run_dir, cluster *c, bool quiet);
/* Router health: the HTTP status (-1: no answer) and the node counts it reports. */
int cl_router_health(const cluster *c, int timeout_ms, int *n_prefill, int *n_decode, char *err,
                     size_t errcap);
/* A process's ready file (JSON) when present; NULL otherwise. */
cJSON *cl_read_ready(const cluster *c, const proc *p);

/* The commands besides `up` (cmd_cluster.c): status, restart, down (cluster_ctl.c), and the
 * supervisor that `up` leaves running (cluster_supervise.c). */
int cl_cmd_status(int argc, char **argv);
int cl_cmd_restart(int argc, char **argv);
int cl_cmd_down(int argc, char **argv);
int cl_cmd_supervise(int argc, char **argv);

#endif
