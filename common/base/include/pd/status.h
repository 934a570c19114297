/* Status codes and error messages shared by every pdserve library.
 *
 * Two tiers (see STYLE.md): runtime failures return a pd_status and fill a pd_err with a
 * human-readable message; broken invariants hit PD_ASSERT, which prints file:line and aborts.
 * Libraries never call exit(). */
#ifndef PD_STATUS_H
#define PD_STATUS_H

#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_status {
  PD_OK = 0,
  PD_EINVAL,       /* invalid argument or input */
  PD_ENOMEM,       /* allocation failed */
  PD_EIO,          /* file or socket I/O failed */
  PD_EFORMAT,      /* malformed file or message (truncated, corrupt, wrong shape) */
  PD_EUNSUPPORTED, /* well-formed but not supported (architecture, RoPE type, dtype) */
  PD_ENOTFOUND,    /* a named thing does not exist (file, tensor, token) */
  PD_EFULL,        /* out of KV blocks / queue full: not an error, a condition to act on */
  PD_ERANGE,       /* a value is out of its allowed range */
  PD_EBACKEND,     /* a backend (CUDA, NCCL) call failed */
  PD_ESTATUS_COUNT
} pd_status;

#define PD_ERR_MSG_MAX 512

typedef struct pd_err {
  pd_status code;
  char msg[PD_ERR_MSG_MAX];
} pd_err;

/* Records code and a printf-style message in e (e may be NULL) and returns code. */
pd_status pd_err_set(pd_err *e, pd_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prefixes the message already in e with a context string ("loading x: <old message>"). */
void pd_err_prefix(pd_err *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pd_err_clear(pd_err *e);
const char *pd_status_str(pd_status s);

/* Prints "file:line: assertion failed: cond" and a backtrace of the calling thread to stderr,
 * then aborts. */
#ifdef __cplusplus
[[noreturn]]
#else
_Noreturn
#endif
void pd_assert_fail(const char *cond, const char *file, int line);
#define PD_ASSERT(cond)                                                                  \
  do {                                                                                   \
    if (!(cond)) pd_assert_fail(#cond, __FILE__, __LINE__);                              \
  } while (0)

/* Writes a backtrace of the calling thread to fd (function names where the program exports
 * them: programs link with -rdynamic; otherwise module and offset, for addr2line). */
void pd_backtrace(int fd);
/* For a program's main: on SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT print "prog: fatal
 * signal N" and a backtrace, then die of the signal as before. Nothing in a sanitizer build
 * (the sanitizer reports these itself). */
void pd_crash_handlers_install(const char *prog);

#ifdef __cplusplus
}
#endif
#endif
