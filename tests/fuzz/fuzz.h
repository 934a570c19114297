/* Shared by the fuzz targets (tests/fuzz/fuzz_*.c): the libFuzzer entry points, a check that
 * aborts (so that libFuzzer, and the replay test, report the input), and a reader that takes
 * bytes off the front of an input to steer a target. */
#ifndef PD_FUZZ_H
#define PD_FUZZ_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* A property of the code under test that failed: print it and abort. */
#define FUZZ_CHECK(cond)                                                               \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond);    \
      abort();                                                                         \
    }                                                                                  \
  } while (0)

/* Control bytes taken from the front of an input; 0 once it is used up. */
typedef struct fuzz_in {
  const uint8_t *p;
  size_t n;
} fuzz_in;

static inline uint8_t fuzz_byte(fuzz_in *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

/* An in-memory file holding data[0, n), for parsers that take a path: *path gets
 * "/proc/self/fd/<fd>" (cap >= 32); returns the fd, to close when done. */
static inline int fuzz_memfile(const void *data, size_t n, char *path, size_t cap) {
  int fd = memfd_create("fuzz", MFD_CLOEXEC);
  FUZZ_CHECK(fd >= 0);
  const char *d = (const char *)data;
  while (n) {
    ssize_t k = write(fd, d, n);
    FUZZ_CHECK(k > 0);
    d += k;
    n -= (size_t)k;
  }
  snprintf(path, cap, "/proc/self/fd/%d", fd);
  return fd;
}

/* Writes data[0, n) to dir/name (replacing it). */
static inline void fuzz_write_file(const char *dir, const char *name, const void *data, size_t n) {
  char path[PATH_MAX + 256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  FUZZ_CHECK(f);
  FUZZ_CHECK(fwrite(data, 1, n, f) == n);
  FUZZ_CHECK(fclose(f) == 0);
}

/* Splits in at the first NUL: *a gets what comes before, in what comes after (or nothing).
 * false when there is no NUL. */
static inline bool fuzz_split(fuzz_in *in, fuzz_in *a) {
  const uint8_t *z = in->n ? (const uint8_t *)memchr(in->p, 0, in->n) : NULL;
  a->p = in->p;
  a->n = z ? (size_t)(z - in->p) : in->n;
  in->p += z ? a->n + 1 : in->n;
  in->n -= z ? a->n + 1 : in->n;
  return z != NULL;
}

#endif
