/* Helpers shared by the golden tests of every backend (tests/golden, tests/gpu): feeding one
 * sequence through the engine in chunks, and the comparisons of tests/data/golden/README.md. */
#ifndef PD_GOLDEN_UTIL_H
#define PD_GOLDEN_UTIL_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pd/engine.h"
#include "pd_test.h"

#ifndef GOLDEN_MAX_CTX
#define GOLDEN_MAX_CTX 1024
#endif

/* One sequence in the engine: its block table and how many tokens are in the cache. */
typedef struct runner {
  pd_engine *eng;
  int V, bs, max_blocks;
  const int32_t *bt;
  int ctx;
} runner;

/* Feeds tokens [0,n) as new tokens of the sequence in chunks of `chunk`; writes the logits of
 * all n rows into all_logits (if not NULL) and of the last row into last. Exits on failure. */
static inline void feed(runner *r, const int32_t *toks, int n, int chunk, float *all_logits,
                 float *last) {
  int32_t pos[GOLDEN_MAX_CTX], slots[GOLDEN_MAX_CTX], rows[GOLDEN_MAX_CTX];
  REQUIRE(chunk <= GOLDEN_MAX_CTX);
  float *lg = malloc((size_t)chunk * r->V * sizeof *lg);
  REQUIRE(lg);
  for (int off = 0; off < n; off += chunk) {
    int m = n - off < chunk ? n - off : chunk;
    for (int i = 0; i < m; i++) {
      int p = r->ctx + i;
      pos[i] = p;
      slots[i] = r->bt[p / r->bs] * r->bs + p % r->bs;
      rows[i] = i;
    }
    int32_t qs[2] = {0, m}, ctx = r->ctx + m;
    pd_batch b = {.n_tokens = m, .tokens = toks + off, .positions = pos, .slots = slots,
                  .n_seqs = 1, .q_start = qs, .ctx_len = &ctx, .block_tables = r->bt,
                  .max_blocks = r->max_blocks, .n_logits = m, .logit_rows = rows};
    pd_err e = {0};
    if (pd_engine_forward(r->eng, &b, lg, &e) != PD_OK) {
      fprintf(stderr, "forward failed: %s\n", e.msg);
      exit(1);
    }
    r->ctx += m;
    if (all_logits) memcpy(all_logits + (size_t)off * r->V, lg, (size_t)m * r->V * sizeof *lg);
    if (off + m == n) memcpy(last, lg + (size_t)(m - 1) * r->V, (size_t)r->V * sizeof *lg);
  }
  free(lg);
}

/* Index of the largest value; *gap (if not NULL) gets top-1 minus top-2. */
static inline int argmax(const float *x, int n, float *gap) {
  int b = 0;
  for (int i = 1; i < n; i++)
    if (x[i] > x[b]) b = i;
  float second = -INFINITY;
  for (int i = 0; i < n; i++)
    if (i != b && x[i] > second) second = x[i];
  if (gap) *gap = x[b] - second;
  return b;
}

static inline double logsumexp(const float *x, int n) {
  double mx = x[0], s = 0;
  for (int i = 1; i < n; i++)
    if (x[i] > mx) mx = x[i];
  for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
  return mx + log(s);
}

/* max |a - ref| / max |ref|; *abs_err (if not NULL) gets max |a - ref|. NaN counts as
 * infinitely wrong. */
static inline double rel_err(const float *a, const float *ref, int n, double *abs_err) {
  double md = 0, mr = 0;
  for (int i = 0; i < n; i++) {
    double d = fabs((double)a[i] - ref[i]);
    if (isnan(a[i])) d = INFINITY;
    if (d > md) md = d;
    if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
  }
  if (abs_err) *abs_err = md;
  return md / mr;
}

/* A JSON array of numbers into out[0..cap); returns the count. */
static inline int ints(const cJSON *arr, int32_t *out, int cap) {
  int n = 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, arr) {
    REQUIRE(n < cap);
    out[n++] = (int32_t)it->valuedouble;
  }
  return n;
}

#endif
