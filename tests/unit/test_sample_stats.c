/* Sampling, statistical behaviour. For each configuration the target distribution is
 * computed here independently (naive double code: full sorts, explicit renormalisation),
 * the library is sampled many times with a fixed seed, and a chi-square goodness-of-fit
 * test must accept the target (p >= 1e-4) and reject a wrong one (temperature off by 20%:
 * p < 1e-4), so that the test has power. Tokens the target excludes must never appear.
 * Also: pd_sampler_probs equals the naive target; speculative verification (exact rejection
 * sampling with random p and q, deterministic drafts, greedy, per-position penalties, early
 * stop) emits the target distribution at every position. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/sample.h"

static int g_fail;
#define CHECK(c)                                                            \
  do {                                                                      \
    if (!(c)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
      g_fail++;                                                             \
    }                                                                       \
  } while (0)

#define P_ACCEPT 1e-4 /* chi-square p-value threshold */

static uint64_t g_rs = 0x0DDB1A5E5BAD5EEDull;
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
static int rnd_draw(const double *p, int V) {
  double u = rnd_unif(), c = 0;
  for (int i = 0; i < V; i++) {
    c += p[i];
    if (u < c) return i;
  }
  for (int i = V - 1; i >= 0; i--)
    if (p[i] > 0) return i;
  return 0;
}

/* ---- chi-square ---- */

/* Regularised upper incomplete gamma Q(a, x) (Numerical Recipes: series / continued
 * fraction). */
static double gammq(double a, double x) {
  if (x <= 0) return 1.0;
  double gln = lgamma(a);
  if (x < a + 1) {
    double ap = a, sum = 1.0 / a, del = sum;
    for (int n = 0; n < 10000; n++) {
      ap += 1;
      del *= x / ap;
      sum += del;
      if (fabs(del) < fabs(sum) * 1e-15) break;
    }
    return 1.0 - sum * exp(-x + a * log(x) - gln);
  }
  double b = x + 1 - a, c = 1.0 / 1e-300, d = 1.0 / b, h = d;
  for (int i = 1; i < 10000; i++) {
    double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (fabs(c) < 1e-300) c = 1e-300;
    d = 1.0 / d;
    double del = d * c;
    h *= del;
    if (fabs(del - 1.0) < 1e-15) break;
  }
  return exp(-x + a * log(x) - gln) * h;
}

/* p-value of observed counts against target probabilities; categories with expected count
 * below 5 are pooled. *impossible counts draws of zero-probability tokens. */
static double chi2_p(const long *obs, const double *p, int V, int *impossible) {
  long N = 0;
  for (int i = 0; i < V; i++) N += obs[i];
  double stat = 0, pool_e = 0;
  long pool_o = 0;
  int bins = 0;
  *impossible = 0;
  for (int i = 0; i < V; i++) {
    if (p[i] <= 0) {
      *impossible += obs[i] > 0;
      continue;
    }
    double E = p[i] * (double)N;
    if (E < 5) {
      pool_e += E;
      pool_o += obs[i];
      continue;
    }
    stat += (obs[i] - E) * (obs[i] - E) / E;
    bins++;
  }
  if (pool_e > 0) {
    stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
    bins++;
  }
  if (bins < 2) return 1.0;
  return gammq((bins - 1) / 2.0, stat / 2.0);
}

/* ---- the naive target ---- */

typedef struct naive_cfg {
  double T;
  int top_k;
  double top_p, min_p;
  double rep, freq, pres;
  const int *seen, *cnt; /* [V] or NULL */
  const double *bias;    /* [V] or NULL */
} naive_cfg;

static const double *g_sort_key;
static int cmp_desc(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  if (g_sort_key[x] != g_sort_key[y]) return g_sort_key[x] > g_sort_key[y] ? -1 : 1;
  return x - y;
}

/* out[V]: the sampling distribution; *margin: the smallest distance of any filter decision
 * from its boundary (the test instance must not sit on a knife edge). */
static void naive_target(const float *raw, int V, const naive_cfg *c, double *out,
                         double *margin) {
  double *z = malloc(V * sizeof(double));
  int *idx = malloc(V * sizeof(int));
  char *keep = malloc(V);
  *margin = INFINITY;
  for (int i = 0; i < V; i++) {
    double v = raw[i];
    if (c->bias) v += c->bias[i];
    if (c->seen && c->rep != 1 && c->seen[i]) v = v > 0 ? v / c->rep : v * c->rep;
    if (c->cnt && c->cnt[i] > 0) v -= c->freq * c->cnt[i] + c->pres;
    z[i] = v / c->T;
    keep[i] = 1;
    idx[i] = i;
  }
  double m = -INFINITY;
  for (int i = 0; i < V; i++) m = z[i] > m ? z[i] : m;
  if (c->min_p > 0)
    for (int i = 0; i < V; i++) {
      double r = exp(z[i] - m);
      double d = fabs(r - c->min_p);
      if (d < *margin) *margin = d;
      if (r < c->min_p) keep[i] = 0;
    }
  g_sort_key = z;
  qsort(idx, V, sizeof(int), cmp_desc);
  if (c->top_k > 0 && c->top_k < V) {
    /* among the survivors of min_p: keep z >= the k-th largest */
    int seen = 0;
    for (int j = 0; j < V; j++) {
      int i = idx[j];
      if (!keep[i]) continue;
      if (++seen > c->top_k) {
        int kth = -1, cntk = 0;
        for (int jj = 0; jj < V && cntk < c->top_k; jj++)
          if (keep[idx[jj]]) kth = idx[jj], cntk++;
        double d = z[kth] - z[i];
        if (d < *margin) *margin = d;
        if (z[i] < z[kth]) keep[i] = 0;
      }
    }
  }
  double S = 0;
  for (int i = 0; i < V; i++) S += keep[i] ? exp(z[i] - m) : 0;
  if (c->top_p < 1) {
    double before = 0;
    for (int j = 0; j < V; j++) {
      int i = idx[j];
      if (!keep[i]) continue;
      double pi = exp(z[i] - m) / S;
      double d = fabs(before - c->top_p);
      if (d < *margin) *margin = d;
      if (!(before < c->top_p)) keep[i] = 0;
      before += pi;
    }
    S = 0;
    for (int i = 0; i < V; i++) S += keep[i] ? exp(z[i] - m) : 0;
  }
  for (int i = 0; i < V; i++) out[i] = keep[i] ? exp(z[i] - m) / S : 0.0;
  free(z);
  free(idx);
  free(keep);
}

static void params_from(pd_sampling_params *p, const naive_cfg *c) {
  pd_sampling_params_init(p);
  p->temperature = (float)c->T;
  p->top_k = c->top_k;
  p->top_p = (float)c->top_p;
  p->min_p = (float)c->min_p;
  p->repetition_penalty = (float)c->rep;
  p->frequency_penalty = (float)c->freq;
  p->presence_penalty = (float)c->pres;
}

/* ---- sampling distribution ---- */

static void run_config(pd_sample_ws *ws, const char *name, naive_cfg c, long N) {
  enum { V = 53 }; /* 6 blocks of 8, one of 4, one row: every SIMD path */
  float raw[V];
  double target[V], wrong[V], margin, m2;
  long obs[V] = {0};
  /* draw logits until the instance is well away from every filter boundary */
  for (int tries = 0;; tries++) {
    for (int i = 0; i < V; i++) raw[i] = rnd_normal(1.5f);
    naive_target(raw, V, &c, target, &margin);
    if (margin > 1e-3) break;
    CHECK(tries < 100);
  }
  naive_cfg cw = c;
  cw.T = c.T * 1.2;
  naive_target(raw, V, &cw, wrong, &m2);

  pd_sampling_params p;
  params_from(&p, &c);
  p.has_seed = true;
  p.seed = 1000 + (uint64_t)N;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  CHECK(s != NULL);
  /* pd_sampler_probs is the same distribution, deterministically */
  float probs[V];
  CHECK(pd_sampler_probs(s, ws, raw, probs, &e) == PD_OK);
  for (int i = 0; i < V; i++) {
    CHECK(fabs(probs[i] - target[i]) < 1e-5);
    CHECK((probs[i] == 0) == (target[i] == 0));
  }
  for (long t = 0; t < N; t++) {
    int32_t tok;
    if (pd_sample_token(s, ws, raw, &tok, NULL, &e) != PD_OK) {
      CHECK(0);
      break;
    }
    obs[tok]++;
    pd_sampler_accept(s, tok, NULL, &e); /* advances the RNG position */
  }
  pd_sampler_free(s);
  int imp, imp2;
  double pv = chi2_p(obs, target, V, &imp);
  double pw = chi2_p(obs, wrong, V, &imp2);
  int kept = 0;
  for (int i = 0; i < V; i++) kept += target[i] > 0;
  printf("%-34s kept %2d/%d  p(target) = %.4f  p(T*1.2) = %.3g\n", name, kept, V, pv, pw);
  CHECK(imp == 0);
  CHECK(pv >= P_ACCEPT);
  CHECK(pw < P_ACCEPT || imp2 > 0);
}

/* Penalties and bias change as tokens are accepted, so every draw uses a fresh sampler
 * (distinct seed) with the same prompt and output history. */
static void run_penalty_config(pd_sample_ws *ws, long N) {
  enum { V = 53 }; /* 6 blocks of 8, one of 4, one row: every SIMD path */
  float raw[V];
  int seen[V] = {0}, cnt[V] = {0};
  double bias[V] = {0}, target[V], wrong[V], margin;
  long obs[V] = {0};
  int32_t prompt[] = {0, 1, 2, 3, 4, 5};
  int32_t hist[] = {3, 6, 6, 7, 8, 8, 8};
  pd_logit_bias lb[2] = {{10, 1.5f}, {11, -2.0f}};
  bias[10] = 1.5, bias[11] = -2.0;
  for (int i = 0; i < 6; i++) seen[prompt[i]] = 1;
  for (int i = 0; i < 7; i++) seen[hist[i]] = 1, cnt[hist[i]]++;
  naive_cfg c = {.T = 0.9, .top_k = 0, .top_p = 0.9, .min_p = 0, .rep = 1.4, .freq = 0.5,
                 .pres = 0.3, .seen = seen, .cnt = cnt, .bias = bias};
  for (int tries = 0;; tries++) {
    for (int i = 0; i < V; i++) raw[i] = rnd_normal(1.5f);
    raw[6] = raw[8] = 3.0f; /* frequent output tokens with high logits: penalties matter */
    naive_target(raw, V, &c, target, &margin);
    if (margin > 1e-3) break;
    CHECK(tries < 100);
  }
  naive_cfg cw = c;
  cw.freq = 0; /* wrong: frequency penalty ignored */
  naive_target(raw, V, &cw, wrong, &margin);
  pd_sampling_params p;
  params_from(&p, &c);
  p.logit_bias = lb;
  p.n_logit_bias = 2;
  p.has_seed = true;
  pd_err e = {0};
  for (long t = 0; t < N; t++) {
    p.seed = (uint64_t)t * 7919u + 1;
    pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
    pd_sampler_add_prompt(s, prompt, 6, &e);
    for (int i = 0; i < 7; i++) pd_sampler_accept(s, hist[i], NULL, &e);
    int32_t tok;
    CHECK(pd_sample_token(s, ws, raw, &tok, NULL, &e) == PD_OK);
    obs[tok]++;
    pd_sampler_free(s);
  }
  int imp, imp2;
  double pv = chi2_p(obs, target, V, &imp), pw = chi2_p(obs, wrong, V, &imp2);
  printf("%-34s p(target) = %.4f  p(no freq) = %.3g\n", "penalties+bias T=0.9 top_p=0.9", pv, pw);
  CHECK(imp == 0);
  CHECK(pv >= P_ACCEPT);
  CHECK(pw < P_ACCEPT || imp2 > 0);
}

/* ---- speculative verification ---- */

static void softmax_d(const float *x, int V, double *p) {
  double m = -INFINITY, S = 0;
  for (int i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
  for (int i = 0; i < V; i++) S += p[i] = exp(x[i] - m);
  for (int i = 0; i < V; i++) p[i] /= S;
}

static void spec_exact(pd_sample_ws *ws, naive_cfg c, bool onehot_drafts, long N) {
  enum { V = 53, K = 2 };
  float tl[(K + 1) * V], keep_tl[(K + 1) * V], ql[K * V];
  float q[K * V];
  double p[K + 1][V], qd[K][V], margin;
  for (int j = 0; j <= K; j++) {
    for (int tries = 0;; tries++) {
      for (int i = 0; i < V; i++) tl[j * V + i] = rnd_normal(1.5f);
      naive_target(tl + j * V, V, &c, p[j], &margin);
      if (margin > 1e-3) break;
    }
  }
  /* the draft resembles the target (logits plus noise), as a real draft model does */
  for (int j = 0; j < K; j++) {
    for (int i = 0; i < V; i++) ql[j * V + i] = tl[j * V + i] / (float)c.T + rnd_normal(0.8f);
    softmax_d(ql + j * V, V, qd[j]);
    for (int z = 0; z < 8; z++) qd[j][rnd_u64() % V] = 0; /* q misses some tokens */
    double S = 0;
    for (int i = 0; i < V; i++) S += qd[j][i];
    for (int i = 0; i < V; i++) q[j * V + i] = (float)(qd[j][i] /= S);
  }
  memcpy(keep_tl, tl, sizeof tl);
  pd_sampling_params sp;
  params_from(&sp, &c);
  sp.has_seed = true;
  sp.seed = 99;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  long obs[K + 1][V];
  memset(obs, 0, sizeof obs);
  long acc0 = 0;
  int fixed[K]; /* one-hot drafts: the target's most likely token at each position */
  for (int j = 0; j < K; j++) {
    fixed[j] = 0;
    for (int i = 1; i < V; i++)
      if (p[j][i] > p[j][fixed[j]]) fixed[j] = i;
  }
  for (long t = 0; t < N; t++) {
    int32_t d[K], out[K + 1], n;
    for (int j = 0; j < K; j++) d[j] = onehot_drafts ? fixed[j] : rnd_draw(qd[j], V);
    pd_finish_reason f;
    if (pd_spec_verify(s, ws, tl, d, onehot_drafts ? NULL : q, K, out, &n, NULL, &f, &e) != PD_OK) {
      CHECK(0);
      break;
    }
    CHECK(n >= 1 && n <= K + 1 && f == PD_FINISH_NONE);
    for (int j = 0; j < n; j++) obs[j][out[j]]++;
    acc0 += n >= 2;
    for (int j = 0; j < n - 1; j++) CHECK(out[j] == d[j]); /* all but the last are accepted drafts */
  }
  CHECK(memcmp(tl, keep_tl, sizeof tl) == 0); /* rows restored */
  CHECK(pd_sampler_n_generated(s) >= N);
  pd_sampler_free(s);
  /* acceptance rate at position 0 is sum_x min(p(x), q(x)) (one-hot: p(draft)) */
  double ea = 0;
  for (int i = 0; i < V; i++) ea += onehot_drafts ? (i == fixed[0] ? p[0][i] : 0) : fmin(p[0][i], qd[0][i]);
  double rate = (double)acc0 / N, sd = sqrt(ea * (1 - ea) / N);
  CHECK(fabs(rate - ea) < 5 * sd + 1e-9);
  for (int j = 0; j <= K; j++) {
    int imp;
    double pv = chi2_p(obs[j], p[j], V, &imp);
    long nj = 0;
    for (int i = 0; i < V; i++) nj += obs[j][i];
    printf("spec %s T=%.1f top_k=%d pos %d: %6ld tokens  p(target) = %.4f\n",
           onehot_drafts ? "one-hot" : "exact  ", c.T, c.top_k, j, nj, pv);
    CHECK(imp == 0);
    CHECK(pv >= P_ACCEPT);
    if (j == 0) {
      /* power: position 0 is clearly not distributed as the draft */
      double qq[V];
      for (int i = 0; i < V; i++) qq[i] = onehot_drafts ? (i == fixed[0]) : qd[0][i];
      int imp2;
      double pw = chi2_p(obs[0], qq, V, &imp2);
      CHECK(pw < P_ACCEPT || imp2 > 0);
    }
  }
  printf("spec acceptance at position 0: %.4f (expected %.4f)\n", rate, ea);
}

/* pd_spec_draft_token draws from q = pd_sampler_probs of the draft logits */
static void spec_draft_dist(pd_sample_ws *ws, long N) {
  enum { V = 53 }; /* 6 blocks of 8, one of 4, one row: every SIMD path */
  float dl[V], q[V], q2[V];
  double target[V], margin;
  naive_cfg c = {.T = 0.8, .top_k = 15, .top_p = 1, .min_p = 0, .rep = 1};
  for (int i = 0; i < V; i++) dl[i] = rnd_normal(1.5f);
  naive_target(dl, V, &c, target, &margin);
  pd_sampling_params sp;
  params_from(&sp, &c);
  sp.has_seed = true;
  sp.seed = 5;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  long obs[V] = {0};
  for (long t = 0; t < N; t++) {
    int32_t tok;
    CHECK(pd_spec_draft_token(s, ws, dl, t == 0 ? q : NULL, &tok, &e) == PD_OK);
    obs[tok]++;
    pd_sampler_accept(s, tok, NULL, &e);
  }
  CHECK(pd_sampler_probs(s, ws, dl, q2, &e) == PD_OK);
  for (int i = 0; i < V; i++) CHECK(q[i] == q2[i] && fabs(q[i] - target[i]) < 1e-5);
  int imp;
  double pv = chi2_p(obs, target, V, &imp);
  printf("spec draft proposals: p(target) = %.4f\n", pv);
  CHECK(imp == 0 && pv >= P_ACCEPT);
  CHECK(pd_sampler_rollback(s, (int32_t)N, &e) == PD_OK && pd_sampler_n_generated(s) == 0);
  pd_sampler_free(s);
}

static void spec_greedy_and_edges(pd_sample_ws *ws) {
  enum { V = 21 };
  float tl[3 * V];
  pd_err e = {0};
  for (int j = 0; j < 3; j++)
    for (int i = 0; i < V; i++) tl[j * V + i] = (float)(i % 7) * 0.1f;
  /* rows 0 and 1: A = 5 best by 0.5 over B = 9; row 2: C = 12 best */
  const int A = 5, B = 9, C = 12;
  for (int j = 0; j < 2; j++) tl[j * V + A] = 3.0f, tl[j * V + B] = 2.5f;
  tl[2 * V + C] = 4.0f;
  pd_sampling_params sp;
  pd_sampling_params_init(&sp);
  sp.temperature = 0.0f;
  sp.frequency_penalty = 1.0f; /* after A is accepted, row 1's argmax becomes B */
  int32_t out[3], n;
  pd_finish_reason f;
  pd_sampler *s = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  CHECK(pd_spec_verify(s, ws, tl, (int32_t[]){A, A}, NULL, 2, out, &n, NULL, &f, &e) == PD_OK);
  CHECK(n == 2 && out[0] == A && out[1] == B && f == PD_FINISH_NONE);
  pd_sampler_free(s);
  s = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  pd_logprobs lp[3];
  CHECK(pd_spec_verify(s, ws, tl, (int32_t[]){A, B}, NULL, 2, out, &n, lp, &f, &e) == PD_OK);
  CHECK(n == 3 && out[0] == A && out[1] == B && out[2] == C);
  CHECK(pd_sampler_n_generated(s) == 3);
  for (int j = 0; j < 3; j++) {
    pd_logprobs ref;
    pd_logprobs_compute(tl + j * V, V, out[j], 0, &ref, &e);
    CHECK(lp[j].token == out[j] && fabsf(lp[j].logprob - ref.logprob) < 1e-6f);
  }
  pd_sampler_free(s);
  /* a first mismatch ends it */
  s = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  CHECK(pd_spec_verify(s, ws, tl, (int32_t[]){B, A}, NULL, 2, out, &n, NULL, &f, &e) == PD_OK);
  CHECK(n == 1 && out[0] == A);
  pd_sampler_free(s);
  /* an accepted stop token ends emission */
  int32_t eos = A;
  s = pd_sampler_new(&sp, V, &eos, 1, 0, &e);
  CHECK(pd_spec_verify(s, ws, tl, (int32_t[]){A, B}, NULL, 2, out, &n, NULL, &f, &e) == PD_OK);
  CHECK(n == 1 && out[0] == A && f == PD_FINISH_STOP);
  pd_sampler_free(s);
  /* max_tokens ends it too */
  sp.max_tokens = 2;
  s = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  CHECK(pd_spec_verify(s, ws, tl, (int32_t[]){A, B}, NULL, 2, out, &n, NULL, &f, &e) == PD_OK);
  CHECK(n == 2 && f == PD_FINISH_LENGTH);
  CHECK(pd_spec_verify(s, ws, tl, (int32_t[]){A, V}, NULL, 2, out, &n, NULL, &f, &e) == PD_EINVAL);
  pd_sampler_free(s);

  /* k = 0 is a plain sample + accept, token for token */
  float rows[64][V];
  for (int t = 0; t < 64; t++)
    for (int i = 0; i < V; i++) rows[t][i] = rnd_normal(1.0f);
  pd_sampling_params_init(&sp);
  sp.has_seed = true;
  sp.seed = 31337;
  sp.top_p = 0.9f;
  pd_sampler *a = pd_sampler_new(&sp, V, NULL, 0, 0, &e), *b = pd_sampler_new(&sp, V, NULL, 0, 0, &e);
  for (int t = 0; t < 64; t++) {
    int32_t ta, tb[1];
    pd_sample_token(a, ws, rows[t], &ta, NULL, &e);
    pd_sampler_accept(a, ta, NULL, &e);
    CHECK(pd_spec_verify(b, ws, rows[t], NULL, NULL, 0, tb, &n, NULL, NULL, &e) == PD_OK);
    CHECK(n == 1 && tb[0] == ta);
  }
  pd_sampler_free(a);
  pd_sampler_free(b);
}

/* Argument "quick": a quarter of the draws (the same checks, for a second SIMD path); then
 * "portable": the SSE2 kernels (pd_sample_set_portable) even where the CPU has AVX2. */
int main(int argc, char **argv) {
  pd_err e = {0};
  if (argc > 2 && strcmp(argv[2], "portable") == 0) pd_sample_set_portable(true);
  pd_sample_ws *ws = pd_sample_ws_new(64, &e);
  const long N = argc > 1 && strcmp(argv[1], "quick") == 0 ? 50000 : 200000;
  naive_cfg base = {.T = 1.0, .top_k = 0, .top_p = 1, .min_p = 0, .rep = 1};
  naive_cfg c;
  c = base, c.T = 0.7;
  run_config(ws, "T=0.7", c, N);
  c = base, c.T = 1.3;
  run_config(ws, "T=1.3", c, N);
  c = base, c.top_k = 5;
  run_config(ws, "top_k=5", c, N);
  c = base, c.top_p = 0.8;
  run_config(ws, "top_p=0.8", c, N);
  c = base, c.min_p = 0.1;
  run_config(ws, "min_p=0.1", c, N);
  c = base, c.T = 0.7, c.top_k = 10, c.top_p = 0.9;
  run_config(ws, "T=0.7 top_k=10 top_p=0.9", c, N);
  c = base, c.T = 1.3, c.min_p = 0.05, c.top_p = 0.8;
  run_config(ws, "T=1.3 min_p=0.05 top_p=0.8", c, N);
  c = base, c.T = 1.5, c.top_k = 25, c.min_p = 0.02, c.top_p = 0.85;
  run_config(ws, "T=1.5 top_k=25 min_p=0.02 top_p=0.85", c, N);
  c = base, c.T = 2.0, c.top_k = 30, c.top_p = 0.95;
  run_config(ws, "T=2 top_k=30 top_p=0.95", c, N);
  run_penalty_config(ws, N / 2);

  c = base;
  spec_exact(ws, c, false, N);
  c = base, c.T = 0.8, c.top_k = 12; /* p has zeros where q has mass */
  spec_exact(ws, c, false, N);
  c = base, c.T = 1.2, c.top_p = 0.9;
  spec_exact(ws, c, true, N);
  spec_draft_dist(ws, N / 2);
  spec_greedy_and_edges(ws);
  pd_sample_ws_free(ws);
  if (g_fail) {
    fprintf(stderr, "%d checks failed\n", g_fail);
    return 1;
  }
  printf("test_sample_stats: all checks passed\n");
  return 0;
}
