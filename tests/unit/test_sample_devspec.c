/* pd_sampler_dev_spec against pd_sampler_process_logits: for many random parameter sets and
 * histories (prompt, accepted output, rollbacks, the min_tokens boundary), applying the returned
 * edits to a copy of a random row with the arithmetic documented in pd/backend.h (and
 * kernels/cuda/cuda_sample.cu) gives exactly the row pd_sampler_process_logits produces, bit for
 * bit (any NaN matches any NaN). Also: the spec's fields, one edit per distinct id, ids in range,
 * every edit doing something, the call with too small a buffer (count returned, the prefix
 * written, nothing past cap touched), and that the call reads the state only. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/sample.h"
#include "pd_test.h"

static uint64_t g_rs = 0x9d2c5680a3b1f7e3ull;
static uint64_t rnd_u64(void) {
  uint64_t z = (g_rs += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rnd_unif(void) { return (double)(rnd_u64() >> 11) * 0x1.0p-53; }
static int rnd_int(int n) { return (int)(rnd_u64() % (uint64_t)n); }
static float rnd_range(float lo, float hi) { return lo + (hi - lo) * (float)rnd_unif(); }
static float rnd_normal(float sd) {
  double u1 = rnd_unif(), u2 = rnd_unif();
  if (u1 < 1e-300) u1 = 1e-300;
  return (float)(sd * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* The documented device arithmetic (backend.h "device sampling", cuda_sample.cu). */
static void apply_dev_edits(float *x, const pd_dev_sample_spec *sp, const pd_dev_sample_edit *ed,
                            int n) {
  for (int i = 0; i < n; i++) {
    float z = x[ed[i].id];
    if (ed[i].flags & PD_DEV_EDIT_SUPPRESS) z = -INFINITY;
    if (ed[i].flags & PD_DEV_EDIT_BIAS) z = z + ed[i].bias;
    const float zb = z;
    if ((ed[i].flags & PD_DEV_EDIT_SEEN) && sp->rep_penalty != 1.0f)
      z = z > 0.0f ? z / sp->rep_penalty : z * sp->rep_penalty;
    if (ed[i].count > 0) {
      z = z - sp->freq_penalty * (float)ed[i].count;
      z = z - sp->pres_penalty;
    }
    if (z == zb) z = zb; /* an equal result keeps the biased value (-0 / +0) */
    x[ed[i].id] = z;
  }
}

static int same_float(float a, float b) {
  if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
  uint32_t ua, ub;
  memcpy(&ua, &a, 4);
  memcpy(&ub, &b, 4);
  return ua == ub;
}

static float pick_penalty(void) {
  switch (rnd_int(5)) {
  case 0:
  case 1: return 0.0f;
  case 2: return -0.0f; /* "off" by value, yet -0 - -0 = +0: the equal-value rule matters */
  default: return rnd_range(-2.0f, 2.0f);
  }
}

static void rnd_row(float *x, int V) {
  for (int i = 0; i < V; i++) {
    int r = rnd_int(40);
    x[i] = r == 0   ? NAN
           : r == 1 ? -INFINITY
           : r == 2 ? 0.0f
           : r == 3 ? -0.0f
           : r == 4 ? rnd_normal(1e30f)
                    : rnd_normal(3.0f);
  }
}

static int g_cases, g_edits_total, g_retry_cases;

/* Checks the sampler's current state. */
static void check_state(pd_sampler *s, int V, const float *raw, float *a, float *b,
                        pd_dev_sample_edit *ed, uint8_t *mark) {
  pd_dev_sample_spec sp, sp2;
  const pd_sampling_params *p = pd_sampler_params(s);
  memset(&sp, 0x5a, sizeof sp);
  int32_t n = pd_sampler_dev_spec(s, &sp, NULL, 0);
  CHECK(n >= 0);
  if (n < 0) return;
  CHECK(sp.edit_count == n && sp.row == 0 && sp.edit_begin == 0);
  CHECK(sp.u == pd_sampler_uniform(s, PD_RNG_LANE_SAMPLE));
  CHECK(sp.n_top == (p->logprobs < 0 ? -1 : p->logprobs));
  CHECK(sp.top_k == p->top_k && sp.temperature == p->temperature && sp.top_p == p->top_p &&
        sp.min_p == p->min_p);
  const int pen = p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                  p->presence_penalty != 0.0f;
  CHECK(sp.rep_penalty == (pen ? p->repetition_penalty : 1.0f));
  CHECK(sp.freq_penalty == (pen ? p->frequency_penalty : 0.0f));
  CHECK(sp.pres_penalty == (pen ? p->presence_penalty : 0.0f));

  /* a buffer too small: the count comes back, the first cap entries are written */
  int32_t cap = n > 1 ? n / 2 : 0;
  const pd_dev_sample_edit guard = {-77, 0xdead, 1.0f, -5};
  for (int i = 0; i <= n + 1; i++) ed[i] = guard;
  int32_t n2 = pd_sampler_dev_spec(s, &sp2, cap ? ed : NULL, cap);
  CHECK(n2 == n);
  for (int i = cap; i <= n + 1; i++)
    CHECK(ed[i].id == guard.id && ed[i].flags == guard.flags && ed[i].count == guard.count);
  pd_dev_sample_edit *part = malloc(((size_t)cap + 1) * sizeof *part);
  REQUIRE(part);
  memcpy(part, ed, (size_t)cap * sizeof *part);
  if (cap > 0) g_retry_cases++;

  /* the retry with room for everything (one spare entry stays untouched) */
  n2 = pd_sampler_dev_spec(s, &sp2, ed, n + 1);
  CHECK(n2 == n);
  CHECK(ed[n].id == guard.id && ed[n].count == guard.count);
  CHECK(memcmp(&sp, &sp2, sizeof sp) == 0);
  CHECK(memcmp(part, ed, (size_t)cap * sizeof *part) == 0);
  free(part);

  for (int i = 0; i < n; i++) {
    CHECK(ed[i].id >= 0 && ed[i].id < V);
    if (ed[i].id < 0 || ed[i].id >= V) return;
    CHECKF(!mark[ed[i].id], "id %d twice", ed[i].id);
    mark[ed[i].id] = 1;
    CHECK(ed[i].flags != 0 || ed[i].count > 0);
    const uint32_t known = PD_DEV_EDIT_SUPPRESS | PD_DEV_EDIT_BIAS | PD_DEV_EDIT_SEEN;
    CHECK((ed[i].flags & ~known) == 0);
  }
  for (int i = 0; i < n; i++) mark[ed[i].id] = 0;

  memcpy(a, raw, (size_t)V * sizeof(float));
  memcpy(b, raw, (size_t)V * sizeof(float));
  pd_err e = {0};
  CHECK(pd_sampler_process_logits(s, a, &e) == PD_OK);
  apply_dev_edits(b, &sp, ed, n);
  int bad = 0;
  for (int i = 0; i < V; i++)
    if (!same_float(a[i], b[i])) {
      if (bad++ < 5)
        fprintf(stderr, "  id %d: raw %a, process_logits %a, edits %a\n", i, (double)raw[i],
                (double)a[i], (double)b[i]);
    }
  CHECKF(bad == 0, "%d logits differ (n_gen %d, %d edits)", bad, pd_sampler_n_generated(s), n);
  g_cases++;
  g_edits_total += n;
}

static void one_sampler(int V, float *raw, float *a, float *b, pd_dev_sample_edit *ed,
                        uint8_t *mark) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = rnd_int(4) == 0 ? 0.0f : rnd_range(0.1f, 2.0f);
  p.top_k = rnd_int(3) == 0 ? 1 + rnd_int(100) : 0;
  p.top_p = rnd_int(3) == 0 ? rnd_range(0.05f, 1.0f) : 1.0f;
  p.min_p = rnd_int(4) == 0 ? rnd_range(0.0f, 0.5f) : 0.0f;
  p.repetition_penalty = rnd_int(2) ? rnd_range(0.5f, 2.0f) : 1.0f;
  p.frequency_penalty = pick_penalty();
  p.presence_penalty = pick_penalty();
  p.logprobs = rnd_int(3) - 1 + (rnd_int(2) ? 0 : rnd_int(20));
  if (p.logprobs > 20) p.logprobs = 20;
  const int hot = V < 64 ? V : 64; /* a small id range, so that the lists overlap */
  pd_logit_bias lb[12];
  p.n_logit_bias = (size_t)rnd_int(13);
  for (size_t i = 0; i < p.n_logit_bias; i++) {
    lb[i].id = rnd_int(3) ? rnd_int(hot) : rnd_int(V);
    lb[i].bias = rnd_int(4) == 0 ? (rnd_int(2) ? 100.0f : -100.0f) : rnd_range(-5.0f, 5.0f);
  }
  p.logit_bias = lb;
  int32_t stop[3], eos[3];
  p.n_stop_token_ids = (size_t)rnd_int(4);
  for (size_t i = 0; i < p.n_stop_token_ids; i++) stop[i] = rnd_int(hot);
  p.stop_token_ids = stop;
  size_t n_eos = (size_t)rnd_int(4);
  for (size_t i = 0; i < n_eos; i++) eos[i] = rnd_int(hot);
  p.ignore_eos = rnd_int(4) == 0;
  p.min_tokens = rnd_int(3) ? rnd_int(8) : 0;
  p.has_seed = true;
  p.seed = rnd_u64();
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, eos, n_eos, (uint32_t)rnd_int(4), &e);
  CHECKF(s != NULL, "pd_sampler_new: %s", e.msg);
  if (!s) return;
  int32_t prompt[300];
  int np = rnd_int(3) ? rnd_int(300) : 0;
  for (int i = 0; i < np; i++) prompt[i] = rnd_int(3) ? rnd_int(hot) : rnd_int(V);
  CHECK(pd_sampler_add_prompt(s, prompt, (size_t)np, &e) == PD_OK);
  rnd_row(raw, V);
  check_state(s, V, raw, a, b, ed, mark);
  const int steps = 1 + rnd_int(12);
  for (int t = 0; t < steps; t++) {
    int k = 1 + rnd_int(6);
    for (int i = 0; i < k; i++) {
      int32_t tok = rnd_int(2) ? rnd_int(hot) : rnd_int(V);
      CHECK(pd_sampler_accept(s, tok, NULL, &e) == PD_OK);
    }
    if (rnd_int(4) == 0) {
      int r = rnd_int(pd_sampler_n_generated(s) + 1);
      CHECK(pd_sampler_rollback(s, r, &e) == PD_OK);
    }
    if (rnd_int(3) == 0) rnd_row(raw, V);
    check_state(s, V, raw, a, b, ed, mark);
  }
  pd_sampler_free(s);
}

int main(void) {
  static const int vocabs[] = {1, 7, 64, 200, 1000, 5003};
  const int maxV = 5003;
  float *raw = malloc(maxV * sizeof(float)), *a = malloc(maxV * sizeof(float)),
        *b = malloc(maxV * sizeof(float));
  pd_dev_sample_edit *ed = malloc(((size_t)maxV + 2) * sizeof *ed);
  uint8_t *mark = calloc(maxV, 1);
  REQUIRE(raw && a && b && ed && mark);
  for (int it = 0; it < 1500; it++) one_sampler(vocabs[it % 6], raw, a, b, ed, mark);

  /* a hand-made case: bias, suppression and penalties on one id, duplicates in the bias list,
   * and a long history with many distinct ids */
  {
    const int V = 5003;
    int32_t eos = 3;
    pd_logit_bias lb[4] = {{3, 1.5f}, {9, -2.0f}, {3, 0.25f}, {4000, 7.0f}};
    pd_sampling_params p;
    pd_sampling_params_init(&p);
    p.repetition_penalty = 1.25f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = -0.75f;
    p.logit_bias = lb;
    p.n_logit_bias = 4;
    p.min_tokens = 2000;
    pd_err e = {0};
    pd_sampler *s = pd_sampler_new(&p, V, &eos, 1, 0, &e);
    REQUIRE(s);
    int32_t pr[] = {3, 9, 9, 17};
    CHECK(pd_sampler_add_prompt(s, pr, 4, &e) == PD_OK);
    for (int i = 0; i < 1500; i++) CHECK(pd_sampler_accept(s, rnd_int(V), NULL, &e) == PD_OK);
    CHECK(pd_sampler_accept(s, 9, NULL, &e) == PD_OK);
    CHECK(pd_sampler_accept(s, 4000, NULL, &e) == PD_OK);
    rnd_row(raw, V);
    check_state(s, V, raw, a, b, ed, mark);
    pd_dev_sample_spec sp;
    int32_t n = pd_sampler_dev_spec(s, &sp, ed, V + 2);
    int found3 = 0;
    for (int i = 0; i < n; i++)
      if (ed[i].id == 3) {
        found3 = 1;
        CHECK(ed[i].flags == (PD_DEV_EDIT_SUPPRESS | PD_DEV_EDIT_BIAS | PD_DEV_EDIT_SEEN));
        CHECK(ed[i].bias == 1.75f);
      }
    CHECK(found3);
    pd_sampler_free(s);
  }
  printf("dev_spec: %d states, %d edits, %d short-buffer retries\n", g_cases, g_edits_total,
         g_retry_cases);
  CHECK(g_retry_cases > 100);
  free(raw);
  free(a);
  free(b);
  free(ed);
  free(mark);
  return pd_test_finish("test_sample_devspec");
}
