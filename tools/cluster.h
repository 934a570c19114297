/* pdctl cluster: the run directory of a local cluster and the processes it records (internal to
 * pdctl; cmd_cluster.c holds the commands, cluster_run.c the plumbing below).
 *
 *   DIR/<name>.pid     the process id          (name: router, prefill-0.., decode-0..)
 *   DIR/<name>.log     its stdout and stderr
 *   DIR/<name>.ready   the ready file the process writes once serving (docs/cluster.md)
 *   DIR/cluster.json   ports, endpoints, pids (with their start times, so a recycled pid is
 *                      never signalled), command lines */
#ifndef PDCTL_CLUSTER_H
#define PDCTL_CLUSTER_H

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

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


/* DIR/<name><ext> into out. */
void cl_path_of(char *out, size_t cap, const char *dir, const char *name, const char *ext);
void cl_sleep_ms(int ms);
/* The whole file, NUL-terminated (malloc'ed), or NULL. */
char *cl_read_file(const char *path, size_t *len);
/* Writes text to path atomically (temp file + rename); -1 with errno on failure. */
int cl_write_file_atomic(const char *path, const char *text);
/* Start time of pid in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 if gone.
 * *zombie tells an exited process that nobody has reaped yet. */
unsigned long long cl_proc_start_time(pid_t pid, bool *zombie);
/* Whether the process we started (pid + start time) still runs. */
bool cl_proc_alive(const proc *p);
/* Prints the last n lines of a log file to stderr. */
void cl_print_log_tail(const char *path, int n);
char *cl_xstrdup(const char *s);
void cl_proc_arg(proc *p, const char *a);
void cl_proc_argf(proc *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cl_cluster_free(cluster *c);
/* Starts p as a daemon (its own session, stdin /dev/null, output to DIR/<name>.log, pid in
 * DIR/<name>.pid); 0, or -1 with a message on stderr. */
int cl_spawn(const cluster *c, proc *p);
/* Notes children of this process that exited (so they are not mistaken for alive). */
void cl_reap(cluster *c);
void cl_describe_exit(const proc *p, char *out, size_t cap);
/* SIGTERM to the nodes, then the router, SIGKILL after timeout_s; returns how many needed
 * SIGKILL. */
int cl_stop_procs(cluster *c, double timeout_s, bool verbose);
void cl_remove_run_files(const cluster *c, bool also_json);
int cl_save_json(const cluster *c);
/* Loads DIR/cluster.json (or, without it, the pid files); -1 when there is no cluster. */
int cl_load_cluster(const char *run_dir, cluster *c, bool quiet);
/* Router health: the HTTP status (-1: no answer) and the node counts it reports. */
int cl_router_health(const cluster *c, int timeout_ms, int *n_prefill, int *n_decode, char *err,
                     size_t errcap);
/* A process's ready file (JSON) when present; NULL otherwise. */
cJSON *cl_read_ready(const cluster *c, const proc *p);

#endif
