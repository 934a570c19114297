/* Failure reports: a broken invariant (PD_ASSERT) and a fatal signal each print what failed and
 * a backtrace naming the functions on the stack, then the process dies as before (SIGABRT,
 * the signal). Each case runs in a child whose stderr the test reads. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pd/status.h"
#include "pd_test.h"

/* not static, not inlined or cloned: the backtrace names exported functions (programs link with
 * -rdynamic) */
void pd_test_assert_here(int x) __attribute__((noinline, noipa));
void pd_test_assert_here(int x) { PD_ASSERT(x == 1); }
void pd_test_segv_here(void) __attribute__((noinline, noipa));
void pd_test_segv_here(void) {
  raise(SIGSEGV);
  __asm__ volatile(""); /* not a tail call: this frame stays on the stack */
}

/* Runs fn in a child; its stderr in out, its wait status returned. */
static int run_child(void (*fn)(void), char *out, size_t cap) {
  int p[2];
  REQUIRE(pipe(p) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(p[1], 2);
    close(p[0]);
    fn();
    _exit(0);
  }
  close(p[1]);
  size_t n = 0;
  ssize_t r;
  while (n + 1 < cap && (r = read(p[0], out + n, cap - 1 - n)) > 0) n += (size_t)r;
  out[n] = 0;
  close(p[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  return st;
}

static void child_assert(void) { pd_test_assert_here(2); }
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
static void child_segv(void) {
  pd_crash_handlers_install("test_failure_report");
  pd_test_segv_here();
}
#endif

int main(void) {
  static char out[65536];
  int st = run_child(child_assert, out, sizeof out);
  CHECKF(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "assert: status %d", st);
  CHECKF(strstr(out, "assertion failed: x == 1") != NULL, "assert: no condition in: %s", out);
  CHECKF(strstr(out, "backtrace:") && strstr(out, "pd_test_assert_here"),
         "assert: no backtrace naming the function in: %s", out);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  /* (a sanitizer build leaves fatal signals to the sanitizer's own report) */
  st = run_child(child_segv, out, sizeof out);
  CHECKF(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "segv: status %d", st);
  CHECKF(strstr(out, "test_failure_report: fatal signal 11") != NULL, "segv: %s", out);
  CHECKF(strstr(out, "pd_test_segv_here") != NULL, "segv: no backtrace naming it in: %s", out);
#endif
  if (pd_test_failures) {
    printf("test_failure_report: %d checks failed\n", pd_test_failures);
    return 1;
  }
  printf("test_failure_report: all checks passed\n");
  return 0;
}
