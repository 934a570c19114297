/* pdctl: generate, tokenize, bench-model (later: cluster, client, bench, make-model). */
#include "pd/sched.h"
#include "pdctl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int pdctl_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pdctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return 1;
}

char *pdctl_read_file(const char *path, size_t *len) {
  FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
  if (!f) return NULL;
  size_t cap = 1 << 12, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
    if (n + 1 == cap) {
      char *t = realloc(buf, cap *= 2);
      if (!t) free(buf);
      buf = t;
    }
  }
  int err = ferror(f);
  if (f != stdin) fclose(f);
  if (!buf || err) {
    free(buf);
    return NULL;
  }
  buf[n] = 0;
  if (len) *len = n;
  return buf;
}

void pdctl_print_spec_stats(FILE *f, const pd_sched_stats *ss, pd_spec_method m) {
  double emitted = 0;
  for (int j = 0; j < PD_SPEC_MAX_K + 2; j++) emitted += (double)j * ss->spec_emitted_hist[j];
  fprintf(f,
          "pdctl: speculative (%s): %llu verifications, %llu proposed, %llu accepted (%.1f%%), "
          "%.2f tokens per verification; draft %.3f s in %llu forwards, verify steps %.3f s\n",
          pd_spec_method_name(m), (unsigned long long)ss->spec_verified,
          (unsigned long long)ss->spec_proposed, (unsigned long long)ss->spec_accepted,
          ss->spec_proposed ? 100.0 * ss->spec_accepted / ss->spec_proposed : 0.0,
          ss->spec_verified ? emitted / ss->spec_verified : 0.0, ss->spec_draft_seconds,
          (unsigned long long)ss->spec_draft_steps, ss->spec_verify_seconds);
}

double pdctl_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int32_t *pdctl_parse_ids(const char *s, size_t *n, pd_err *e) {
  size_t cap = 16, k = 0;
  int32_t *ids = malloc(cap * sizeof *ids);
  if (!ids) return NULL;
  const char *p = s;
  while (*p) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 0 || v > 2147483647L) {
      free(ids);
      pd_err_set(e, PD_EINVAL, "token ids must be non-negative integers separated by commas");
      return NULL;
    }
    if (k == cap) {
      int32_t *t = realloc(ids, 2 * cap * sizeof *ids);
      if (!t) {
        free(ids);
        pd_err_set(e, PD_ENOMEM, "out of memory");
        return NULL;
      }
      ids = t;
      cap *= 2;
    }
    ids[k++] = (int32_t)v;
    p = end;
    while (*p == ' ') p++;
    if (*p == ',') p++;
    else if (*p) {
      free(ids);
      pd_err_set(e, PD_EINVAL, "unexpected '%c' in the token id list", *p);
      return NULL;
    }
  }
  *n = k;
  return ids;
}

static void usage(void) {
  fputs("usage: pdctl <command> [options]\n\n"
        "commands:\n"
        "  generate     generate text from a model on this machine\n"
        "  tokenize     encode text to token ids, or decode ids to text\n"
        "  bench-model  measure prefill and decode tokens/s of a model on this machine\n"
        "  perplexity   token-level perplexity of a model on a text or token ids\n"
        "  cluster      start, inspect and stop a local cluster (router + prefill + decode)\n"
        "  client       send a request to a router's ZeroMQ client API, print the answer\n"
        "  bench        serving benchmark against a running router (TTFT, TPOT, ITL)\n"
        "  keys         write the CURVE keypairs of a cluster (keys generate)\n"
        "  make-model   write a model folder with published shapes and random weights\n"
        "  quantize     write an FP8 or 4-bit compressed-tensors checkpoint of a float model\n"
        "  devices      the CPU kernel family and the CUDA devices this build can use\n\n"
        "Run 'pdctl <command> --help' for the options of a command.\n",
        stderr);
}

int main(int argc, char **argv) {
  pd_crash_handlers_install("pdctl");
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "generate")) return cmd_generate(argc, argv);
  if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc, argv);
  if (!strcmp(cmd, "bench-model")) return cmd_bench_model(argc, argv);
  if (!strcmp(cmd, "perplexity")) return cmd_perplexity(argc, argv);
  if (!strcmp(cmd, "make-model")) return cmd_make_model(argc, argv);
  if (!strcmp(cmd, "quantize")) return cmd_quantize(argc, argv);
  if (!strcmp(cmd, "devices")) return cmd_devices(argc, argv);
#ifdef PD_HAVE_NET
  if (!strcmp(cmd, "cluster")) return cmd_cluster(argc, argv);
  if (!strcmp(cmd, "client")) return cmd_client(argc, argv);
  if (!strcmp(cmd, "bench")) return cmd_bench(argc, argv);
  if (!strcmp(cmd, "keys")) return cmd_keys(argc, argv);
#else
  if (!strcmp(cmd, "cluster") || !strcmp(cmd, "client") || !strcmp(cmd, "bench") ||
      !strcmp(cmd, "keys"))
    return pdctl_fail("'%s' needs the network layer: rebuild with libzmq and protobuf-c "
                      "(-DPD_NET=ON)", cmd);
#endif
  usage();
  return pdctl_fail("unknown command '%s'", cmd) + 1;
}
