/* pdctl: the command-line tool. Each subcommand lives in its own file. */
#ifndef PDCTL_H
#define PDCTL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "pd/engine.h"
#include "pd/model.h"
#include "pd/opts.h"
#include "pd/tokenizer.h"

int cmd_generate(int argc, char **argv);
int cmd_generate_batch(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_bench_model(int argc, char **argv);
int cmd_perplexity(int argc, char **argv); /* cmd_perplexity.c: sliding-window perplexity */
int cmd_make_model(int argc, char **argv); /* cmd_make_model.c: random-weight model folders */
int cmd_quantize(int argc, char **argv);   /* cmd_quantize.c: compressed-tensors FP8 / 4-bit */
int cmd_devices(int argc, char **argv);    /* cmd_devices.c: CPU kernels, CUDA devices */
#ifdef PD_HAVE_NET
int cmd_cluster(int argc, char **argv); /* cmd_cluster.c: up, status, down */
int cmd_client(int argc, char **argv);  /* cmd_client.c: the ZeroMQ client API */
int cmd_bench(int argc, char **argv);   /* cmd_bench.c: serving benchmark over HTTP */
int cmd_keys(int argc, char **argv);    /* cmd_keys.c: keys generate */
/* The CURVE keypairs of a cluster into dir (created 0700): router.key/.pub, node-K.key/.pub for
 * K < n_nodes, nodes.allow (cmd_keys.c). */
pd_status pdctl_keys_write(const char *dir, int n_nodes, pd_err *e);
/* Writes text to path through a temporary file and a rename, the file mode exactly mode (0600
 * for secrets); errno is kept on failure (cmd_keys.c). */
pd_status pdctl_write_file(const char *path, const char *text, mode_t mode, pd_err *e);

/* One blocking HTTP exchange with url's server (http_client.c, on libcurl): method path [body
 * as JSON]. Returns the status code and the body (malloc'ed, NUL-terminated, at most 8 MiB kept)
 * in *resp (may be NULL), or -1 with a message when no answer came within timeout_ms. */
int pdctl_http(const char *url, const char *method, const char *path, const char *body,
               const char *api_key, int timeout_ms, char **resp, size_t *resp_len, pd_err *e);
#endif

/* Prints "pdctl: <msg>" to stderr and returns 1 (the exit status for user errors). */
int pdctl_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Parses "1,2,3" into a malloc'ed array; NULL with a message on error. */
int32_t *pdctl_parse_ids(const char *s, size_t *n, pd_err *e);
/* The whole file ("-": stdin), NUL-terminated and malloc'ed, its length in *len (may be NULL);
 * NULL when it cannot be read. */
char *pdctl_read_file(const char *path, size_t *len);
double pdctl_now(void);

#ifdef PD_SCHED_H
/* One line of speculative-decoding figures from the scheduler's counters. */
void pdctl_print_spec_stats(FILE *f, const pd_sched_stats *ss, pd_spec_method m);
#endif

#endif
