/* pd-bench-tokenizer CORPUS REPS TOKENIZER_DIR...: for each tokenizer, the load time (best of 3)
 * and the encoding speed (best of REPS passes over CORPUS, encoded in 4 KiB pieces cut at UTF-8
 * boundaries, like prompts), in CPU time of the calling thread (so that a busy machine blurs
 * the figures less), and a checksum of the ids, so that two builds can be shown to give the
 * same tokens. Public API only: bench/tokenizer_ab.py builds it against an older revision too. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd/tokenizer.h"

static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s CORPUS REPS TOKENIZER_DIR...\n", argv[0]);
    return 2;
  }
  FILE *f = fopen(argv[1], "rb");
  if (!f) {
    perror(argv[1]);
    return 2;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    fprintf(stderr, "%s: cannot read\n", argv[1]);
    return 2;
  }
  fclose(f);
  int reps = atoi(argv[2]);
  for (int a = 3; a < argc; a++) {
    pd_err e = {0};
    pd_tokenizer *t = NULL;
    double best_load = 1e30, best = 1e30;
    for (int i = 0; i < 3; i++) {
      pd_tokenizer_free(t);
      double t0 = cpu_s();
      t = pd_tokenizer_load(argv[a], &e);
      double dt = cpu_s() - t0;
      if (!t) {
        fprintf(stderr, "%s: %s\n", argv[a], e.msg);
        return 1;
      }
      if (dt < best_load) best_load = dt;
    }
    uint64_t sum = 0, ntok = 0;
    for (int r = 0; r < reps; r++) {
      uint64_t s = 1469598103934665603ull, nt = 0; /* FNV-1a over the ids */
      double t0 = cpu_s();
      for (long off = 0; off < n;) {
        long len = n - off < 4096 ? n - off : 4096;
        while (off + len < n && len > 1 && ((unsigned char)buf[off + len] & 0xC0) == 0x80) len--;
        int32_t *ids = NULL;
        size_t k = 0;
        if (pd_tokenizer_encode(t, buf + off, (size_t)len, false, &ids, &k, &e) != PD_OK) {
          fprintf(stderr, "%s: encode: %s\n", argv[a], e.msg);
          return 1;
        }
        for (size_t i = 0; i < k; i++) s = (s ^ (uint32_t)ids[i]) * 1099511628211ull;
        nt += k;
        free(ids);
        off += len;
      }
      double dt = cpu_s() - t0;
      if (dt < best) best = dt;
      sum = s;
      ntok = nt;
    }
    const char *name = strrchr(argv[a], '/');
    printf("%-8s load %.1f ms  encode %.2f MB/s  %llu tokens  ids %016llx\n", name ? name + 1 : argv[a],
           best_load * 1e3, reps > 0 ? (double)n / 1e6 / best : 0.0, (unsigned long long)ntok,
           (unsigned long long)sum);
    pd_tokenizer_free(t);
  }
  free(buf);
  return 0;
}
