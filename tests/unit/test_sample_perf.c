/* Sampling on a 151936-token vocabulary (Qwen2): the distribution pd_sampler_probs builds
 * equals a naive double computation (full sort) for top_p / top_k / min_p, every sampled
 * token lies in the kept set, and the time per call is printed (top_p = 0.9 should be well
 * under 1 ms). Timing is reported, not asserted: sanitizer builds and a busy machine vary. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd/sample.h"

static int g_fail;
#define CHECK(c)                                                            \
  do {                                                                      \
    if (!(c)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
      g_fail++;                                                             \
    }                                                                       \
  } while (0)

enum { V = 151936 };

static uint64_t g_rs = 0xC0FFEE1234ull;
static uint64_t rnd_u64(void) {
  uint64_t z = (g_rs += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rnd_unif(void) { return (double)(rnd_u64() >> 11) * 0x1.0p-53; }
static float rnd_normal(float sd) {
  double u1 = rnd_unif(), u2 = rnd_unif();
  if (u1 < 1e-300) u1 = 1e-300;
  return (float)(sd * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const float *g_key;
static int cmp_desc(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  if (g_key[x] != g_key[y]) return g_key[x] > g_key[y] ? -1 : 1;
  return x - y;
}

/* Naive target for temperature, min_p, top_k, top_p (vLLM order), in double, by a full
 * sort. *margin: the closest any decision came to its boundary (relative units). */
static void naive(const float *x, double T, int top_k, double top_p, double min_p, double *out,
                  double *margin) {
  int *idx = malloc(V * sizeof(int));
  for (int i = 0; i < V; i++) idx[i] = i;
  g_key = x;
  qsort(idx, V, sizeof(int), cmp_desc);
  double m = x[idx[0]];
  int K = V;
  *margin = INFINITY;
  if (min_p > 0) {
    K = 0;
    while (K < V && exp((x[idx[K]] - m) / T) >= min_p) K++;
    if (K < V) *margin = fmin(*margin, min_p - exp((x[idx[K]] - m) / T));
    *margin = fmin(*margin, exp((x[idx[K - 1]] - m) / T) - min_p);
  }
  if (top_k > 0 && top_k < K) {
    *margin = fmin(*margin, (double)x[idx[top_k - 1]] - x[idx[top_k]]);
    K = top_k;
  }
  double S = 0;
  for (int j = 0; j < K; j++) S += exp((x[idx[j]] - m) / T);
  if (top_p < 1) {
    double before = 0;
    int j = 0;
    while (j < K && before < top_p) before += exp((x[idx[j++]] - m) / T) / S;
    double prev = before - exp((x[idx[j - 1]] - m) / T) / S;
    *margin = fmin(*margin, fmin(top_p - prev, before - top_p));
    K = j;
    S = 0;
    for (int jj = 0; jj < K; jj++) S += exp((x[idx[jj]] - m) / T);
  }
  memset(out, 0, V * sizeof(double));
  for (int j = 0; j < K; j++) out[idx[j]] = exp((x[idx[j]] - m) / T) / S;
  free(idx);
}

typedef struct scenario {
  const char *name;
  float T;
  int top_k;
  float top_p, min_p;
  int logprobs;
} scenario;

static void run(pd_sample_ws *ws, const scenario *sc, float *const *rows, int nrows, int iters,
                bool check) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = sc->T;
  p.top_k = sc->top_k;
  p.top_p = sc->top_p;
  p.min_p = sc->min_p;
  p.logprobs = sc->logprobs;
  p.has_seed = true;
  p.seed = 2024;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  float *probs = malloc(V * sizeof(float));
  double *ref = malloc(V * sizeof(double));
  if (check && sc->T > 0) {
    for (int r = 0; r < nrows; r++) {
      double margin;
      naive(rows[r], sc->T, sc->top_k, sc->top_p, sc->min_p, ref, &margin);
      CHECK(margin > 1e-7); /* the instance is not on a knife edge */
      CHECK(pd_sampler_probs(s, ws, rows[r], probs, &e) == PD_OK);
      int mism = 0, kept = 0;
      double maxd = 0;
      for (int i = 0; i < V; i++) {
        mism += (probs[i] > 0) != (ref[i] > 0);
        kept += ref[i] > 0;
        double d = fabs(probs[i] - ref[i]);
        maxd = d > maxd ? d : maxd;
      }
      CHECK(mism == 0);
      CHECK(maxd < 1e-6);
      if (r == 0) printf("  %-34s kept %6d tokens, max |p - naive| = %.2g\n", sc->name, kept, maxd);
      for (int t = 0; t < 20; t++) {
        int32_t tok;
        CHECK(pd_sample_token(s, ws, rows[r], &tok, NULL, &e) == PD_OK);
        CHECK(ref[tok] > 0);
        pd_sampler_accept(s, tok, NULL, &e);
      }
    }
  }
  pd_logprobs lp;
  uint64_t digest = 1469598103934665603ull; /* FNV-1a of the tokens: equal across SIMD paths */
  double t0 = now_s();
  for (int it = 0; it < iters; it++) {
    int32_t tok;
    if (pd_sample_token(s, ws, rows[it % nrows], &tok, sc->logprobs >= 0 ? &lp : NULL, &e) != PD_OK) {
      CHECK(0);
      break;
    }
    digest = (digest ^ (uint64_t)tok) * 1099511628211ull;
    pd_sampler_accept(s, tok, NULL, &e);
  }
  double us = (now_s() - t0) / iters * 1e6;
  printf("  %-34s %8.1f us per token  (tokens %016llx)\n", sc->name, us, (unsigned long long)digest);
  free(probs);
  free(ref);
  pd_sampler_free(s);
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200;
  pd_err e = {0};
  pd_sample_ws *ws = pd_sample_ws_new(V, &e);
  enum { R = 4 };
  float *flat[R], *peaked[R];
  for (int r = 0; r < R; r++) {
    flat[r] = malloc(V * sizeof(float));
    peaked[r] = malloc(V * sizeof(float));
    /* flat: every token matters (the worst case for top_p) */
    for (int i = 0; i < V; i++) flat[r][i] = rnd_normal(1.0f);
    /* LLM-like: a bulk far below a few dozen plausible tokens */
    for (int i = 0; i < V; i++) peaked[r][i] = rnd_normal(2.0f);
    for (int j = 0; j < 40; j++) peaked[r][rnd_u64() % V] = 8.0f + 10.0f * (float)rnd_unif();
  }
  static const scenario sc[] = {
      {"greedy", 0.0f, 0, 1.0f, 0.0f, -1},
      {"T=1 (no filter)", 1.0f, 0, 1.0f, 0.0f, -1},
      {"top_p=0.9", 1.0f, 0, 0.9f, 0.0f, -1},
      {"top_k=50", 1.0f, 50, 1.0f, 0.0f, -1},
      {"T=0.7 top_k=50 top_p=0.9", 0.7f, 50, 0.9f, 0.0f, -1},
      {"min_p=0.05 top_p=0.95", 1.0f, 0, 0.95f, 0.05f, -1},
      {"top_p=0.9 + logprobs=5", 1.0f, 0, 0.9f, 0.0f, 5},
      {"top_k=20000 top_p=0.99", 1.0f, 20000, 0.99f, 0.0f, -1},
  };
  const int nsc = (int)(sizeof sc / sizeof sc[0]);
  printf("vocab %d, flat logits N(0,1):\n", V);
  for (int i = 0; i < nsc; i++) run(ws, &sc[i], flat, R, iters, i == 2 || i == 3 || i == 4 || i == 7);
  printf("vocab %d, peaked logits (40 tokens at 8..18 over N(0,2)):\n", V);
  for (int i = 0; i < nsc; i++) run(ws, &sc[i], peaked, R, iters, i == 2 || i == 4 || i == 5 || i == 7);
  for (int r = 0; r < R; r++) free(flat[r]), free(peaked[r]);
  pd_sample_ws_free(ws);
  if (g_fail) {
    fprintf(stderr, "%d checks failed\n", g_fail);
    return 1;
  }
  printf("test_sample_perf: all checks passed\n");
  return 0;
}
