/* Minimal test harness: CHECK macros that count failures, and file helpers. */
#ifndef PD_TEST_H
#define PD_TEST_H

#include <stdio.h>
#include <stdlib.h>

static int pd_test_failures;

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      pd_test_failures++;                                                     \
    }                                                                         \
  } while (0)

#define CHECKF(cond, ...)                                                     \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                           \
      fputc('\n', stderr);                                                    \
      pd_test_failures++;                                                     \
    }                                                                         \
  } while (0)

#define REQUIRE(cond)                                                         \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: REQUIRE failed: %s\n", __FILE__, __LINE__, #cond); \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

/* Reads a whole file into a malloc'ed NUL-terminated buffer; NULL on error. */
static inline char *pd_test_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  if (buf) {
    buf[n] = 0;
    if (len) *len = (size_t)n;
  }
  return buf;
}

static inline int pd_test_finish(const char *name) {
  if (pd_test_failures) {
    fprintf(stderr, "%s: %d check(s) failed\n", name, pd_test_failures);
    return 1;
  }
  printf("%s: all checks passed\n", name);
  return 0;
}

#endif
