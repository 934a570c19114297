/* Table-driven command-line flags, shared by pdctl and the node binaries.
 *
 * Every flag --some-name can also come from the environment as PD_SOME_NAME, and from a JSON
 * config file given with --config FILE (or PD_CONFIG): {"some-name": value, ...}. The
 * environment wins over the file and the command line over both. Values: --name VALUE or
 * --name=VALUE; boolean flags take no value. */
#ifndef PD_OPTS_H
#define PD_OPTS_H

#include <stdbool.h>
#include <stdio.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_opt_type {
  PD_OPT_STR,    /* const char ** */
  PD_OPT_INT,    /* int * */
  PD_OPT_DOUBLE, /* double * */
  PD_OPT_BOOL,   /* bool *, set to true when present */
  PD_OPT_U64,    /* unsigned long long * */
} pd_opt_type;

typedef struct pd_opt {
  const char *name; /* without the leading dashes */
  pd_opt_type type;
  void *dst;
  const char *metavar; /* e.g. "N"; NULL for bools */
  const char *help;
  bool *seen; /* optional: set when given */
} pd_opt;

/* Parses argv[first..argc) against opts (terminated by an entry with name == NULL) after
 * applying PD_* environment variables. Positional arguments are rejected. */
pd_status pd_opts_parse(const pd_opt *opts, int argc, char **argv, int first, pd_err *e);
void pd_opts_usage(FILE *f, const pd_opt *opts);

/* Secrets (an API key) stay off command lines: a program takes --NAME VALUE (or PD_NAME in its
 * environment, which other users cannot read) and --NAME-file FILE. pd_secret_opt resolves such
 * a pair: at most one may be given (PD_ERANGE otherwise); *out is a malloc'ed copy of the
 * secret, or NULL when neither is given. A file holds the secret on its first line (the line
 * end and surrounding blanks are dropped); a secret is 1..4096 bytes of printable ASCII without
 * spaces. Error messages name the flag or the file, never the secret. */
pd_status pd_secret_opt(const char *name, const char *value, const char *file, char **out,
                        pd_err *e);
/* Overwrites and frees a secret from pd_secret_opt (NULL: no-op). */
void pd_secret_free(char *s);

#ifdef __cplusplus
}
#endif
#endif
