/* pdctl: generate, tokenize, bench-model (later: cluster, client, bench, make-model). */
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

int pdctl_runner_open(pdctl_runner *r, const char *model_dir, int n_seqs, int max_len,
                      int max_batch_tokens, int threads, pd_err *e) {
  memset(r, 0, sizeof *r);
  r->model = pd_model_load(model_dir, NULL, e);
  if (!r->model) return -1;
  pd_backend_opts bo = {.n_threads = threads};
  r->be = pd_backend_cpu_create(&bo, e);
  if (!r->be) goto fail;
  const pd_model_config *c = &r->model->cfg;
  if (max_len > c->max_position_embeddings) {
    pd_err_set(e, PD_EINVAL, "%d tokens exceed the model's context of %d", max_len,
               c->max_position_embeddings);
    goto fail;
  }
  pd_engine_opts o;
  pd_engine_opts_default(&o);
  r->bs = o.block_size;
  r->max_blocks = (max_len + r->bs - 1) / r->bs;
  if (r->max_blocks < 1) r->max_blocks = 1;
  o.max_model_len = r->max_blocks * r->bs;
  o.num_blocks = n_seqs * r->max_blocks;
  o.max_seqs = n_seqs;
  o.max_batch_tokens = max_batch_tokens > n_seqs ? max_batch_tokens : n_seqs;
  r->eng = pd_engine_create(r->model, r->be, &o, e);
  if (!r->eng) goto fail;
  r->n_seqs = n_seqs;
  r->V = c->vocab_size;
  r->bt = malloc((size_t)n_seqs * r->max_blocks * sizeof *r->bt);
  r->ctx = calloc((size_t)n_seqs, sizeof *r->ctx);
  r->logits = malloc((size_t)o.max_batch_tokens * r->V * sizeof *r->logits);
  if (!r->bt || !r->ctx || !r->logits) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    goto fail;
  }
  for (int i = 0; i < n_seqs * r->max_blocks; i++) r->bt[i] = i;
  return 0;
fail:
  pdctl_runner_close(r);
  return -1;
}

void pdctl_runner_close(pdctl_runner *r) {
  pd_engine_free(r->eng);
  if (r->be) pd_backend_destroy(r->be);
  pd_model_free(r->model);
  free(r->bt);
  free(r->ctx);
  free(r->logits);
  memset(r, 0, sizeof *r);
}

static pd_status check_room(pdctl_runner *r, int s, int n, pd_err *e) {
  if (r->ctx[s] + n > r->max_blocks * r->bs)
    return pd_err_set(e, PD_ERANGE, "sequence would exceed its %d-token context",
                      r->max_blocks * r->bs);
  return PD_OK;
}

pd_status pdctl_runner_feed(pdctl_runner *r, int s, const int32_t *toks, int n, pd_err *e) {
  pd_status st = check_room(r, s, n, e);
  if (st) return st;
  int chunk = pd_engine_get_opts(r->eng)->max_batch_tokens;
  int32_t *pos = malloc((size_t)chunk * 2 * sizeof *pos);
  if (!pos) return pd_err_set(e, PD_ENOMEM, "out of memory");
  int32_t *slots = pos + chunk;
  for (int off = 0; off < n && st == PD_OK; off += chunk) {
    int m = n - off < chunk ? n - off : chunk;
    for (int i = 0; i < m; i++) {
      int p = r->ctx[s] + i;
      pos[i] = p;
      slots[i] = r->bt[s * r->max_blocks + p / r->bs] * r->bs + p % r->bs;
    }
    int32_t qs[2] = {0, m}, ctx = r->ctx[s] + m, row = m - 1;
    pd_batch b = {.n_tokens = m, .tokens = toks + off, .positions = pos, .slots = slots,
                  .n_seqs = 1, .q_start = qs, .ctx_len = &ctx,
                  .block_tables = r->bt + (size_t)s * r->max_blocks, .max_blocks = r->max_blocks,
                  .n_logits = 1, .logit_rows = &row};
    st = pd_engine_forward(r->eng, &b, r->logits, e);
    if (st == PD_OK) r->ctx[s] += m;
  }
  free(pos);
  return st;
}

pd_status pdctl_runner_step(pdctl_runner *r, const int32_t *toks, pd_err *e) {
  int n = r->n_seqs;
  for (int s = 0; s < n; s++) {
    pd_status st = check_room(r, s, 1, e);
    if (st) return st;
  }
  int32_t *buf = malloc((size_t)n * 5 * sizeof *buf + sizeof *buf);
  if (!buf) return pd_err_set(e, PD_ENOMEM, "out of memory");
  int32_t *pos = buf, *slots = buf + n, *qs = buf + 2 * n, *ctx = buf + 3 * n + 1,
          *rows = buf + 4 * n + 1;
  for (int s = 0; s < n; s++) {
    int p = r->ctx[s];
    pos[s] = p;
    slots[s] = r->bt[s * r->max_blocks + p / r->bs] * r->bs + p % r->bs;
    qs[s] = s;
    ctx[s] = p + 1;
    rows[s] = s;
  }
  qs[n] = n;
  pd_batch b = {.n_tokens = n, .tokens = toks, .positions = pos, .slots = slots, .n_seqs = n,
                .q_start = qs, .ctx_len = ctx, .block_tables = r->bt,
                .max_blocks = r->max_blocks, .n_logits = n, .logit_rows = rows};
  pd_status st = pd_engine_forward(r->eng, &b, r->logits, e);
  if (st == PD_OK)
    for (int s = 0; s < n; s++) r->ctx[s]++;
  free(buf);
  return st;
}

static void usage(void) {
  fputs("usage: pdctl <command> [options]\n\n"
        "commands:\n"
        "  generate     generate text from a model on this machine\n"
        "  tokenize     encode text to token ids, or decode ids to text\n"
        "  bench-model  measure prefill and decode tokens/s of a model on this machine\n"
        "  cluster      start, inspect and stop a local cluster (router + prefill + decode)\n"
        "  client       send a request to a router's ZeroMQ client API, print the answer\n"
        "  bench        serving benchmark against a running router (TTFT, TPOT, ITL)\n"
        "  keys         write the CURVE keypairs of a cluster (keys generate)\n"
        "  make-model   write a model folder with published shapes and random weights\n"
        "  devices      the CPU kernel family and the CUDA devices this build can use\n\n"
        "Run 'pdctl <command> --help' for the options of a command.\n",
        stderr);
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "generate")) return cmd_generate(argc, argv);
  if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc, argv);
  if (!strcmp(cmd, "bench-model")) return cmd_bench_model(argc, argv);
  if (!strcmp(cmd, "make-model")) return cmd_make_model(argc, argv);
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
