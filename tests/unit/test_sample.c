/* Sampling, deterministic behaviour: parameter validation, stop conditions, Philox known
 * answers, greedy decoding, penalties and logit_bias against hand-computed logits, the
 * row being restored, raw logprobs against a naive double log_softmax, seed determinism
 * (same seed, different seeds, interleaved sequences, n > 1), rollback, min_tokens. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/sample.h"

static int g_fail;
#define CHECK(c)                                                       \
  do {                                                                 \
    if (!(c)) {                                                        \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
      g_fail++;                                                        \
    }                                                                  \
  } while (0)

/* Test-side RNG (independent of the library's). */
static uint64_t g_rs = 0x1234567887654321ull;
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
static void rnd_logits(float *x, int V, float sd) {
  for (int i = 0; i < V; i++) x[i] = rnd_normal(sd);
}

/* ---- validation ---- */

static void expect_invalid(const pd_sampling_params *p, int V, const char *needle) {
  pd_err e = {0};
  pd_status st = pd_sampling_params_validate(p, V, &e);
  CHECK(st == PD_EINVAL);
  if (st == PD_EINVAL && !strstr(e.msg, needle)) {
    fprintf(stderr, "message '%s' does not mention '%s'\n", e.msg, needle);
    g_fail++;
  }
  /* the sampler refuses the same params */
  pd_err e2 = {0};
  pd_sampler *s = pd_sampler_new(p, V, NULL, 0, 0, &e2);
  CHECK(s == NULL && e2.code == PD_EINVAL);
  pd_sampler_free(s);
}

static void test_validation(void) {
  const int V = 100;
  pd_sampling_params p;
  pd_err e = {0};
  pd_sampling_params_init(&p);
  CHECK(pd_sampling_params_validate(&p, V, &e) == PD_OK);
  CHECK(p.temperature == 1.0f && p.top_p == 1.0f && p.top_k == 0 && p.n == 1 && p.logprobs == -1);

#define BAD(field, value, needle)           \
  do {                                      \
    pd_sampling_params_init(&p);            \
    p.field = value;                        \
    expect_invalid(&p, V, needle);          \
  } while (0)
#define GOOD(field, value)                                      \
  do {                                                          \
    pd_sampling_params_init(&p);                                \
    p.field = value;                                            \
    CHECK(pd_sampling_params_validate(&p, V, &e) == PD_OK);     \
  } while (0)
  BAD(temperature, -0.1f, "temperature");
  BAD(temperature, NAN, "temperature");
  BAD(temperature, INFINITY, "temperature");
  GOOD(temperature, 0.0f);
  GOOD(temperature, 5.0f); /* vLLM: any non-negative temperature */
  BAD(top_p, 0.0f, "top_p must be in (0, 1]");
  BAD(top_p, 1.01f, "top_p");
  BAD(top_p, NAN, "top_p");
  GOOD(top_p, 1.0f);
  GOOD(top_p, 1e-6f);
  BAD(top_k, -2, "top_k");
  GOOD(top_k, -1);
  GOOD(top_k, 0);
  GOOD(top_k, 1000000); /* larger than vocab = off */
  BAD(min_p, -0.01f, "min_p");
  BAD(min_p, 1.5f, "min_p");
  GOOD(min_p, 1.0f);
  BAD(presence_penalty, 2.5f, "presence_penalty must be in [-2, 2]");
  BAD(presence_penalty, -2.01f, "presence_penalty");
  GOOD(presence_penalty, -2.0f);
  BAD(frequency_penalty, 3.0f, "frequency_penalty");
  GOOD(frequency_penalty, 2.0f);
  BAD(repetition_penalty, 0.0f, "repetition_penalty must be in (0, 2]");
  BAD(repetition_penalty, 2.01f, "repetition_penalty");
  GOOD(repetition_penalty, 2.0f);
  GOOD(repetition_penalty, 0.5f);
  BAD(n, 0, "n must be in [1, 128]");
  BAD(n, 129, "n must be");
  GOOD(n, 128);
  BAD(max_tokens, 0, "max_tokens");
  BAD(max_tokens, -5, "max_tokens");
  GOOD(max_tokens, -1);
  GOOD(max_tokens, 1);
  BAD(min_tokens, -1, "min_tokens");
  BAD(logprobs, 21, "logprobs must be in [0, 20]");
  BAD(logprobs, -2, "logprobs");
  GOOD(logprobs, 20);
  GOOD(logprobs, 0);
  BAD(prompt_logprobs, 21, "prompt_logprobs");
  GOOD(prompt_logprobs, 5);
#undef BAD
#undef GOOD
  pd_sampling_params_init(&p);
  p.max_tokens = 5;
  p.min_tokens = 6;
  expect_invalid(&p, V, "min_tokens must be less than or equal to max_tokens");

  pd_logit_bias lb[2] = {{3, 5.0f}, {V, 1.0f}};
  pd_sampling_params_init(&p);
  p.logit_bias = lb;
  p.n_logit_bias = 2;
  expect_invalid(&p, V, "logit_bias");
  lb[1] = (pd_logit_bias){-1, 1.0f};
  expect_invalid(&p, V, "out of vocabulary");
  lb[1] = (pd_logit_bias){7, 100.5f};
  expect_invalid(&p, V, "[-100, 100]");
  lb[1] = (pd_logit_bias){7, -100.0f};
  CHECK(pd_sampling_params_validate(&p, V, &e) == PD_OK);
  p.logit_bias = NULL;
  expect_invalid(&p, V, "logit_bias");

  int32_t stops[2] = {5, 100};
  pd_sampling_params_init(&p);
  p.stop_token_ids = stops;
  p.n_stop_token_ids = 2;
  expect_invalid(&p, V, "stop_token_ids");
  stops[1] = 99;
  CHECK(pd_sampling_params_validate(&p, V, &e) == PD_OK);

  pd_sampling_params_init(&p);
  CHECK(pd_sampling_params_validate(&p, 0, &e) == PD_EINVAL);
  CHECK(pd_sampling_params_validate(NULL, V, &e) == PD_EINVAL);
  /* eos ids are checked by the sampler */
  int32_t bad_eos = V;
  pd_sampler *s = pd_sampler_new(&p, V, &bad_eos, 1, 0, &e);
  CHECK(s == NULL && e.code == PD_EINVAL);
}

/* ---- stop conditions ---- */

static void test_stops(void) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  int32_t eos[2] = {2, 9};
  int32_t stops[1] = {7};
  p.stop_token_ids = stops;
  p.n_stop_token_ids = 1;
  p.max_tokens = 4;
  CHECK(pd_sampling_check_stop(&p, eos, 2, 2, 1) == PD_FINISH_STOP);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 9, 1) == PD_FINISH_STOP);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 7, 1) == PD_FINISH_STOP);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 5, 1) == PD_FINISH_NONE);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 5, 3) == PD_FINISH_NONE);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 5, 4) == PD_FINISH_LENGTH);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 2, 4) == PD_FINISH_STOP); /* stop wins over length */
  p.ignore_eos = true;
  CHECK(pd_sampling_check_stop(&p, eos, 2, 2, 1) == PD_FINISH_NONE);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 7, 1) == PD_FINISH_STOP); /* stop ids still stop */
  CHECK(pd_sampling_check_stop(&p, eos, 2, 2, 4) == PD_FINISH_LENGTH);
  p.ignore_eos = false;
  p.min_tokens = 2;
  CHECK(pd_sampling_check_stop(&p, eos, 2, 2, 1) == PD_FINISH_NONE);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 7, 2) == PD_FINISH_NONE);
  CHECK(pd_sampling_check_stop(&p, eos, 2, 7, 3) == PD_FINISH_STOP);
  p.max_tokens = -1;
  CHECK(pd_sampling_check_stop(&p, eos, 2, 5, 1000000) == PD_FINISH_NONE);
  CHECK(strcmp(pd_finish_reason_str(PD_FINISH_STOP), "stop") == 0);
  CHECK(strcmp(pd_finish_reason_str(PD_FINISH_LENGTH), "length") == 0);
  CHECK(pd_finish_reason_str(PD_FINISH_NONE) == NULL);

  /* through the sampler: accept reports the finish */
  pd_err e = {0};
  p.min_tokens = 0;
  p.max_tokens = 3;
  pd_sampler *s = pd_sampler_new(&p, 10, eos, 2, 0, &e);
  CHECK(s != NULL);
  pd_finish_reason f;
  CHECK(pd_sampler_accept(s, 4, &f, &e) == PD_OK && f == PD_FINISH_NONE);
  CHECK(pd_sampler_accept(s, 9, &f, &e) == PD_OK && f == PD_FINISH_STOP);
  CHECK(pd_sampler_accept(s, 4, &f, &e) == PD_OK && f == PD_FINISH_LENGTH);
  CHECK(pd_sampler_n_generated(s) == 3);
  CHECK(pd_sampler_accept(s, 10, &f, &e) == PD_EINVAL);
  CHECK(pd_sampler_accept(s, -1, &f, &e) == PD_EINVAL);
  pd_sampler_free(s);
}

/* ---- Philox known answers (Random123 kat_vectors) ---- */

static void test_philox(void) {
  static const uint32_t ctr[3][4] = {{0, 0, 0, 0},
                                     {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                                     {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}};
  static const uint32_t key[3][2] = {{0, 0}, {0xffffffffu, 0xffffffffu}, {0xa4093822u, 0x299f31d0u}};
  static const uint32_t want[3][4] = {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
                                      {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
                                      {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}};
  for (int t = 0; t < 3; t++) {
    uint32_t out[4];
    pd_philox4x32_10(ctr[t], key[t], out);
    CHECK(memcmp(out, want[t], sizeof out) == 0);
  }
}

/* ---- greedy ---- */

static void test_greedy(pd_sample_ws *ws) {
  const int V = 1000;
  float *x = malloc(V * sizeof(float));
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 0.0f;
  p.top_k = 3; /* ignored by greedy */
  p.top_p = 0.1f;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  CHECK(s != NULL);
  for (int t = 0; t < 50; t++) {
    rnd_logits(x, V, 3.0f);
    int want = 0;
    for (int i = 1; i < V; i++)
      if (x[i] > x[want]) want = i;
    int32_t tok = -1;
    CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK);
    CHECK(tok == want);
    CHECK(pd_sampler_accept(s, tok, NULL, &e) == PD_OK);
  }
  /* ties go to the lowest id; NaN is never chosen; -inf rows are an error */
  for (int i = 0; i < V; i++) x[i] = 0.0f;
  x[17] = 5.0f, x[400] = 5.0f, x[3] = NAN;
  int32_t tok = -1;
  CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && tok == 17);
  for (int i = 0; i < V; i++) x[i] = -INFINITY;
  CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_EINVAL);
  x[5] = INFINITY;
  CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_EINVAL);
  /* a workspace smaller than the row is refused */
  pd_sample_ws *small = pd_sample_ws_new(V - 1, &e);
  CHECK(pd_sample_token(s, small, x, &tok, NULL, &e) == PD_EINVAL);
  pd_sample_ws_free(small);
  /* temperature below the greedy epsilon is greedy */
  pd_sampler_free(s);
  p.temperature = 1e-6f;
  s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  rnd_logits(x, V, 1.0f);
  int want = 0;
  for (int i = 1; i < V; i++)
    if (x[i] > x[want]) want = i;
  for (int t = 0; t < 20; t++) {
    CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && tok == want);
    pd_sampler_accept(s, tok, NULL, &e);
  }
  pd_sampler_free(s);
  free(x);
}

/* ---- penalties and bias: exact effect on the logits ---- */

static void test_penalties(pd_sample_ws *ws) {
  const int V = 64;
  float raw[64], x[64], want[64];
  pd_logit_bias lb[3] = {{10, 2.5f}, {11, -3.0f}, {10, 0.5f}}; /* duplicates add up */
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.4f;
  p.presence_penalty = 0.7f;
  p.logit_bias = lb;
  p.n_logit_bias = 3;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  CHECK(s != NULL);
  int32_t prompt[] = {1, 2, 3, 2, 10};
  int32_t out[] = {3, 4, 4, 5, 11, 4, 12};
  CHECK(pd_sampler_add_prompt(s, prompt, 5, &e) == PD_OK);
  int cnt[64] = {0}, seen[64] = {0};
  for (int i = 0; i < 5; i++) seen[prompt[i]] = 1;
  for (int i = 0; i < 7; i++) {
    CHECK(pd_sampler_accept(s, out[i], NULL, &e) == PD_OK);
    cnt[out[i]]++;
    seen[out[i]] = 1;
  }
  rnd_logits(raw, V, 2.0f);
  raw[2] = -1.5f; /* a negative logit seen in the prompt: multiplied */
  raw[4] = 2.0f;  /* positive, output three times */
  /* expected, in vLLM's order: bias, repetition, frequency, presence (float arithmetic) */
  for (int i = 0; i < V; i++) {
    float z = raw[i];
    if (i == 10) z = z + 3.0f;
    if (i == 11) z = z + -3.0f;
    if (seen[i]) z = z > 0 ? z / 1.3f : z * 1.3f;
    if (cnt[i] > 0) {
      z = z - 0.4f * (float)cnt[i];
      z = z - 0.7f;
    }
    want[i] = z;
  }
  memcpy(x, raw, sizeof x);
  CHECK(pd_sampler_process_logits(s, x, &e) == PD_OK);
  for (int i = 0; i < V; i++) CHECK(fabsf(x[i] - want[i]) <= 1e-6f * (1 + fabsf(want[i])));
  CHECK(fabsf(x[2] - (-1.5f * 1.3f)) < 1e-6f);
  CHECK(fabsf(x[4] - (2.0f / 1.3f - 1.2f - 0.7f)) < 1e-6f);
  CHECK(x[40] == raw[40] || seen[40]);

  /* the sampled path uses the same processed logits (greedy picks their argmax), and the
   * row is restored bit for bit */
  p.temperature = 0.0f;
  pd_sampler *g = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  pd_sampler_add_prompt(g, prompt, 5, &e);
  for (int i = 0; i < 7; i++) pd_sampler_accept(g, out[i], NULL, &e);
  int am = 0;
  for (int i = 1; i < V; i++)
    if (want[i] > want[am]) am = i;
  memcpy(x, raw, sizeof x);
  int32_t tok;
  CHECK(pd_sample_token(g, ws, x, &tok, NULL, &e) == PD_OK && tok == am);
  CHECK(memcmp(x, raw, sizeof x) == 0);

  /* rollback undoes output counts exactly; prompt marks stay */
  CHECK(pd_sampler_rollback(s, 3, &e) == PD_OK); /* removes 11, 4, 12 */
  cnt[11]--, cnt[4]--, cnt[12]--;
  memcpy(x, raw, sizeof x);
  pd_sampler_process_logits(s, x, &e);
  for (int i = 0; i < V; i++) {
    float z = raw[i];
    if (i == 10) z = z + 3.0f;
    if (i == 11) z = z + -3.0f;
    int sn = (i == 1 || i == 2 || i == 3 || i == 10) || cnt[i] > 0;
    if (sn) z = z > 0 ? z / 1.3f : z * 1.3f;
    if (cnt[i] > 0) {
      z = z - 0.4f * (float)cnt[i];
      z = z - 0.7f;
    }
    CHECK(fabsf(x[i] - z) <= 1e-6f * (1 + fabsf(z)));
  }
  CHECK(pd_sampler_n_generated(s) == 4);
  CHECK(pd_sampler_rollback(s, 5, &e) == PD_EINVAL);
  CHECK(pd_sampler_add_prompt(s, (int32_t[]){V}, 1, &e) == PD_EINVAL);
  pd_sampler_free(s);
  pd_sampler_free(g);

  /* many distinct tokens (the count map grows and rehashes) against a naive count array */
  const int BV = 151936;
  pd_sampling_params_init(&p);
  p.frequency_penalty = 0.25f;
  p.presence_penalty = -0.5f;
  s = pd_sampler_new(&p, BV, NULL, 0, 0, &e);
  int *bc = calloc(BV, sizeof(int));
  float *bx = malloc(BV * sizeof(float)), *br = malloc(BV * sizeof(float));
  for (int i = 0; i < 20000; i++) {
    int32_t t = (int32_t)(rnd_u64() % (i < 10000 ? 5000u : (uint32_t)BV));
    bc[t]++;
    CHECK(pd_sampler_accept(s, t, NULL, &e) == PD_OK);
  }
  rnd_logits(br, BV, 1.0f);
  memcpy(bx, br, BV * sizeof(float));
  pd_sampler_process_logits(s, bx, &e);
  int bad = 0;
  for (int i = 0; i < BV; i++) {
    float z = br[i];
    if (bc[i] > 0) {
      z = z - 0.25f * (float)bc[i];
      z = z + 0.5f;
    }
    bad += fabsf(bx[i] - z) > 1e-5f * (1 + fabsf(z));
  }
  CHECK(bad == 0);
  free(bc);
  free(bx);
  free(br);
  pd_sampler_free(s);
}

static void test_logit_bias_forcing(pd_sample_ws *ws) {
  const int V = 500;
  float x[500];
  pd_logit_bias lb[1] = {{123, 100.0f}};
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 1.3f;
  p.logit_bias = lb;
  p.n_logit_bias = 1;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  for (int t = 0; t < 300; t++) {
    rnd_logits(x, V, 2.0f);
    int32_t tok = -1;
    CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && tok == 123);
    pd_sampler_accept(s, tok, NULL, &e);
  }
  pd_sampler_free(s);
  /* a -100 bias bans the argmax, also in greedy mode */
  p.temperature = 0.0f;
  rnd_logits(x, V, 2.0f);
  int am = 0, second = -1;
  for (int i = 1; i < V; i++)
    if (x[i] > x[am]) am = i;
  for (int i = 0; i < V; i++)
    if (i != am && (second < 0 || x[i] > x[second])) second = i;
  lb[0] = (pd_logit_bias){am, -100.0f};
  s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  int32_t tok = -1;
  CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && tok == second);
  pd_sampler_free(s);
}

/* ---- min_tokens suppresses stop tokens ---- */

static void test_min_tokens(pd_sample_ws *ws) {
  const int V = 50;
  float x[50];
  int32_t eos = 7;
  int32_t stop[1] = {8};
  pd_logit_bias lb[2] = {{7, 30.0f}, {8, 29.0f}}; /* make stop tokens overwhelmingly likely */
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.min_tokens = 3;
  p.logit_bias = lb;
  p.n_logit_bias = 2;
  p.stop_token_ids = stop;
  p.n_stop_token_ids = 1;
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, &eos, 1, 0, &e);
  for (int t = 0; t < 4; t++) {
    rnd_logits(x, V, 1.0f);
    int32_t tok;
    pd_finish_reason f;
    CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK);
    if (t < 3) CHECK(tok != 7 && tok != 8);
    else CHECK(tok == 7 || tok == 8);
    CHECK(pd_sampler_accept(s, tok, &f, &e) == PD_OK);
    CHECK(f == (t < 3 ? PD_FINISH_NONE : PD_FINISH_STOP));
  }
  pd_sampler_free(s);
  /* with ignore_eos, EOS is neither suppressed nor a stop; stop ids still are both */
  p.ignore_eos = true;
  lb[1].bias = -100.0f;
  s = pd_sampler_new(&p, V, &eos, 1, 0, &e);
  rnd_logits(x, V, 1.0f);
  int32_t tok;
  pd_finish_reason f;
  CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && tok == 7);
  CHECK(pd_sampler_accept(s, tok, &f, &e) == PD_OK && f == PD_FINISH_NONE);
  pd_sampler_free(s);
}

/* ---- logprobs against naive double log_softmax ---- */

static void naive_logprobs(const float *x, int V, double *lp) {
  double m = -INFINITY, S = 0;
  for (int i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
  for (int i = 0; i < V; i++) S += exp((double)x[i] - m);
  for (int i = 0; i < V; i++) lp[i] = (double)x[i] - m - log(S);
}

static void check_logprobs(const float *x, int V, const pd_logprobs *lp, int n_top) {
  double *ref = calloc((size_t)V, sizeof(double));
  naive_logprobs(x, V, ref);
  int t = lp->token;
  CHECK(fabs(lp->logprob - ref[t]) < 1e-5);
  int rank = 1;
  for (int i = 0; i < V; i++) rank += x[i] > x[t];
  CHECK(lp->rank == rank);
  CHECK(lp->n_top == (n_top < V ? n_top : V));
  /* the top list is the n_top largest, descending, ties by id */
  char *used = calloc(V, 1);
  for (int j = 0; j < lp->n_top; j++) {
    int best = -1;
    for (int i = 0; i < V; i++)
      if (!used[i] && (best < 0 || x[i] > x[best])) best = i;
    used[best] = 1;
    CHECK(lp->top[j].id == best);
    CHECK(fabs(lp->top[j].logprob - ref[best]) < 1e-5);
    if (j > 0) CHECK(lp->top[j].logprob <= lp->top[j - 1].logprob);
  }
  free(used);
  free(ref);
}

static void test_logprobs(pd_sample_ws *ws) {
  pd_err e = {0};
  const int sizes[] = {1, 7, 13, 50, 1003, 32005};
  for (int si = 0; si < 6; si++) {
    int V = sizes[si];
    float *x = malloc(V * sizeof(float));
    for (int rep = 0; rep < 3; rep++) {
      rnd_logits(x, V, rep == 2 ? 8.0f : 2.0f);
      if (V > 10) x[3] = x[5] = 4.0f; /* a tie */
      for (int nt = 0; nt <= 20; nt += 5) {
        pd_logprobs lp;
        int tok = (int)(rnd_u64() % (uint64_t)V);
        CHECK(pd_logprobs_compute(x, V, tok, nt, &lp, &e) == PD_OK);
        CHECK(lp.token == tok);
        check_logprobs(x, V, &lp, nt);
      }
    }
    free(x);
  }
  /* -inf entries and NaN: log-probability -inf, never in the top list ahead of finite ones */
  float y[6] = {1.0f, -INFINITY, 0.5f, NAN, 2.0f, -INFINITY};
  pd_logprobs lp;
  CHECK(pd_logprobs_compute(y, 6, 1, 3, &lp, &e) == PD_OK);
  CHECK(isinf(lp.logprob) && lp.logprob < 0);
  CHECK(lp.top[0].id == 4 && lp.top[1].id == 0 && lp.top[2].id == 2);
  CHECK(pd_logprobs_compute(y, 6, 6, 3, &lp, &e) == PD_EINVAL);
  CHECK(pd_logprobs_compute(y, 6, 0, 21, &lp, &e) == PD_EINVAL);

  /* pd_sample_token reports RAW logprobs, whatever the processing */
  const int V = 2005;
  float *x = malloc(V * sizeof(float)), *keep = malloc(V * sizeof(float));
  pd_logit_bias lb[1] = {{9, 6.0f}};
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 0.6f;
  p.top_k = 40;
  p.top_p = 0.9f;
  p.repetition_penalty = 1.5f;
  p.frequency_penalty = 1.0f;
  p.logit_bias = lb;
  p.n_logit_bias = 1;
  p.logprobs = 7;
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  for (int t = 0; t < 30; t++) {
    rnd_logits(x, V, 2.0f);
    memcpy(keep, x, V * sizeof(float));
    int32_t tok;
    CHECK(pd_sample_token(s, ws, x, &tok, &lp, &e) == PD_OK);
    CHECK(memcmp(x, keep, V * sizeof(float)) == 0);
    CHECK(lp.token == tok);
    check_logprobs(x, V, &lp, 7);
    pd_sampler_accept(s, tok, NULL, &e);
  }
  pd_sampler_free(s);
  free(x);
  free(keep);
}

/* ---- ties: top_k keeps every token equal to the k-th; top_p orders equal weights by id ---- */

static void test_ties(pd_sample_ws *ws) {
  enum { V = 1000 };
  float x[V], probs[V];
  pd_err e = {0};
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  for (int i = 0; i < V; i++) x[i] = 0.0f;
  p.top_p = 0.3004f; /* keeps ids 0..300: the mass before id j is j / 1000 */
  pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  CHECK(pd_sampler_probs(s, ws, x, probs, &e) == PD_OK);
  for (int i = 0; i < V; i++) CHECK(i <= 300 ? fabsf(probs[i] - 1.0f / 301) < 1e-6f : probs[i] == 0.0f);
  for (int t = 0; t < 200; t++) {
    int32_t tok;
    CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && tok <= 300);
    pd_sampler_accept(s, tok, NULL, &e);
  }
  pd_sampler_free(s);
  pd_sampling_params_init(&p);
  p.top_k = 5; /* all equal: all tied with the 5th */
  s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  CHECK(pd_sampler_probs(s, ws, x, probs, &e) == PD_OK);
  for (int i = 0; i < V; i++) CHECK(fabsf(probs[i] - 1.0f / V) < 1e-6f);
  pd_sampler_free(s);
  /* ten tokens tied at the top, top_k = 3: all ten kept, nothing else */
  for (int i = 0; i < V; i++) x[i] = rnd_normal(1.0f) - 10.0f;
  for (int j = 0; j < 10; j++) x[j * 97] = 5.0f;
  p.top_k = 3;
  s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  CHECK(pd_sampler_probs(s, ws, x, probs, &e) == PD_OK);
  for (int i = 0; i < V; i++) CHECK(i % 97 == 0 && i / 97 < 10 ? fabsf(probs[i] - 0.1f) < 1e-6f : probs[i] == 0.0f);
  pd_sampler_free(s);
}

/* ---- pd_sampler_probs against a naive sort at an odd vocabulary size (10007: every SIMD
 * path and the refinement of crowded boundary bins run) ---- */

static const float *g_key;
static int cmp_desc(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  if (g_key[x] != g_key[y]) return g_key[x] > g_key[y] ? -1 : 1;
  return x - y;
}

static void test_probs_vs_sort(pd_sample_ws *ws) {
  enum { V = 10007 };
  float *x = malloc(V * sizeof(float)), *probs = malloc(V * sizeof(float));
  int *idx = malloc(V * sizeof(int));
  double *ref = malloc(V * sizeof(double));
  pd_err e = {0};
  struct { float T; int k; float p, minp; } cfg[] = {
      {1.0f, 0, 0.9f, 0.0f}, {0.7f, 3000, 1.0f, 0.0f}, {1.3f, 2500, 0.8f, 0.0f},
      {1.0f, 0, 1.0f, 0.0f}, {0.5f, 0, 0.6f, 0.02f}, {1.0f, 5, 0.95f, 0.0f}};
  for (int ci = 0; ci < 6; ci++) {
    rnd_logits(x, V, 1.0f);
    for (int i = 0; i < V; i++) idx[i] = i;
    g_key = x;
    qsort(idx, V, sizeof(int), cmp_desc);
    /* naive, in vLLM's order: temperature, min_p, top_k, top_p */
    double T = cfg[ci].T, m = x[idx[0]];
    int K = V;
    if (cfg[ci].minp > 0) {
      K = 0;
      while (K < V && exp((x[idx[K]] - m) / T) >= cfg[ci].minp) K++;
    }
    if (cfg[ci].k > 0 && cfg[ci].k < K) K = cfg[ci].k;
    double S = 0;
    for (int j = 0; j < K; j++) S += exp((x[idx[j]] - m) / T);
    if (cfg[ci].p < 1) {
      double before = 0;
      int j = 0;
      while (j < K && before < cfg[ci].p) before += exp((x[idx[j++]] - m) / T) / S;
      K = j;
      S = 0;
      for (j = 0; j < K; j++) S += exp((x[idx[j]] - m) / T);
    }
    for (int i = 0; i < V; i++) ref[i] = 0;
    for (int j = 0; j < K; j++) ref[idx[j]] = exp((x[idx[j]] - m) / T) / S;
    pd_sampling_params p;
    pd_sampling_params_init(&p);
    p.temperature = cfg[ci].T;
    p.top_k = cfg[ci].k;
    p.top_p = cfg[ci].p;
    p.min_p = cfg[ci].minp;
    pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
    CHECK(pd_sampler_probs(s, ws, x, probs, &e) == PD_OK);
    int mism = 0;
    double maxd = 0;
    for (int i = 0; i < V; i++) {
      mism += (probs[i] > 0) != (ref[i] > 0);
      maxd = fmax(maxd, fabs(probs[i] - ref[i]));
    }
    CHECK(mism == 0);
    CHECK(maxd < 1e-6);
    for (int t = 0; t < 50; t++) {
      int32_t tok;
      CHECK(pd_sample_token(s, ws, x, &tok, NULL, &e) == PD_OK && ref[tok] > 0);
      pd_sampler_accept(s, tok, NULL, &e);
    }
    pd_sampler_free(s);
  }
  free(x);
  free(probs);
  free(idx);
  free(ref);
}

/* ---- extreme inputs: huge temperatures and logits, -inf and NaN entries ---- */

static void test_extremes(pd_sample_ws *ws) {
  enum { V = 200 };
  float x[V], keep[V];
  pd_err e = {0};
  const float temps[] = {1e-4f, 1.0f, 1e30f, 3e38f};
  for (int ti = 0; ti < 4; ti++) {
    for (int variant = 0; variant < 2; variant++) {
      for (int i = 0; i < V; i++) x[i] = variant ? fmaxf(-3e38f, fminf(3e38f, rnd_normal(1e38f))) : rnd_normal(3.0f);
      for (int i = 0; i < 10; i++) x[i] = -INFINITY;
      for (int i = 10; i < 20; i++) x[i] = NAN;
      if (variant) x[20] = 3.4e38f, x[21] = -3.4e38f;
      memcpy(keep, x, sizeof x);
      pd_sampling_params p;
      pd_sampling_params_init(&p);
      p.temperature = temps[ti];
      p.top_p = 0.7f;
      p.top_k = 150;
      p.min_p = ti == 1 ? 0.01f : 0.0f;
      p.logprobs = 3;
      pd_sampler *s = pd_sampler_new(&p, V, NULL, 0, 0, &e);
      CHECK(s != NULL);
      for (int t = 0; t < 100; t++) {
        int32_t tok = -1;
        pd_logprobs lp;
        pd_status st = pd_sample_token(s, ws, x, &tok, &lp, &e);
        CHECK(st == PD_OK);
        CHECK(tok >= 20 && tok < V);
        if (st != PD_OK || tok < 20) {
          fprintf(stderr, "T=%g variant %d: %s\n", (double)temps[ti], variant, e.msg);
          break;
        }
        pd_sampler_accept(s, tok, NULL, &e);
      }
      CHECK(memcmp(x, keep, sizeof x) == 0);
      pd_sampler_free(s);
    }
  }
}

/* ---- seeds ---- */

static void run_seq(pd_sample_ws *ws, const pd_sampling_params *p, uint32_t idx, float *const *rows,
                    int n, int V, int32_t *out) {
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(p, V, NULL, 0, idx, &e);
  for (int t = 0; t < n; t++) {
    CHECK(pd_sample_token(s, ws, rows[t], &out[t], NULL, &e) == PD_OK);
    pd_sampler_accept(s, out[t], NULL, &e);
  }
  pd_sampler_free(s);
}

static void test_seeds(pd_sample_ws *ws) {
  enum { V = 300, N = 400 };
  float *rows[N];
  for (int t = 0; t < N; t++) {
    rows[t] = malloc(V * sizeof(float));
    rnd_logits(rows[t], V, 1.0f);
  }
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 1.0f;
  p.top_p = 0.95f;
  p.has_seed = true;
  p.seed = 42;
  int32_t a[N], b[N], c[N], d[N], u1[N], u2[N];
  run_seq(ws, &p, 0, rows, N, V, a);
  run_seq(ws, &p, 0, rows, N, V, b);
  CHECK(memcmp(a, b, sizeof a) == 0);
  p.seed = 43;
  run_seq(ws, &p, 0, rows, N, V, c);
  int diff = 0;
  for (int t = 0; t < N; t++) diff += a[t] != c[t];
  CHECK(diff > N / 2);
  p.seed = 42;
  run_seq(ws, &p, 1, rows, N, V, d); /* another of the request's n samples */
  diff = 0;
  for (int t = 0; t < N; t++) diff += a[t] != d[t];
  CHECK(diff > N / 2);
  /* unseeded sequences get distinct seeds from the global source */
  p.has_seed = false;
  run_seq(ws, &p, 0, rows, N, V, u1);
  run_seq(ws, &p, 0, rows, N, V, u2);
  diff = 0;
  for (int t = 0; t < N; t++) diff += u1[t] != u2[t];
  CHECK(diff > N / 2);

  /* interleaving two sequences (different seeds, params and logits) changes neither, and a
   * retry before accept gives the same token */
  pd_err e = {0};
  pd_sampling_params q;
  pd_sampling_params_init(&q);
  q.has_seed = true;
  q.seed = 7;
  q.top_k = 20;
  q.temperature = 1.2f;
  int32_t alone[N];
  run_seq(ws, &q, 0, rows, N, V, alone);
  p.has_seed = true;
  p.seed = 42;
  pd_sampler *s1 = pd_sampler_new(&p, V, NULL, 0, 0, &e), *s2 = pd_sampler_new(&q, V, NULL, 0, 0, &e);
  CHECK(pd_sampler_seed(s1) == 42 && pd_sampler_params(s2)->seed == 7);
  for (int t = 0; t < N; t++) {
    int32_t t1, t2, t2b;
    CHECK(pd_sample_token(s2, ws, rows[t], &t2, NULL, &e) == PD_OK);
    CHECK(pd_sample_token(s2, ws, rows[t], &t2b, NULL, &e) == PD_OK);
    CHECK(t2 == t2b);
    CHECK(pd_sample_token(s1, ws, rows[N - 1 - t], &t1, NULL, &e) == PD_OK);
    CHECK(t2 == alone[t]);
    pd_sampler_accept(s2, t2, NULL, &e);
    pd_sampler_accept(s1, t1, NULL, &e);
  }
  pd_sampler_free(s1);
  pd_sampler_free(s2);
  /* the effective seed of an unseeded sampler reproduces it */
  p.has_seed = false;
  pd_sampler *s3 = pd_sampler_new(&p, V, NULL, 0, 0, &e);
  pd_sampling_params r = *pd_sampler_params(s3);
  CHECK(r.has_seed && r.seed == pd_sampler_seed(s3));
  int32_t x3[N], y3[N];
  for (int t = 0; t < N; t++) {
    pd_sample_token(s3, ws, rows[t], &x3[t], NULL, &e);
    pd_sampler_accept(s3, x3[t], NULL, &e);
  }
  run_seq(ws, &r, 0, rows, N, V, y3);
  CHECK(memcmp(x3, y3, sizeof x3) == 0);
  pd_sampler_free(s3);
  for (int t = 0; t < N; t++) free(rows[t]);
}

int main(void) {
  pd_err e = {0};
  pd_sample_ws *ws = pd_sample_ws_new(151936, &e);
  if (!ws) {
    fprintf(stderr, "%s\n", e.msg);
    return 1;
  }
  CHECK(pd_sample_ws_new(0, &e) == NULL && e.code == PD_EINVAL);
  test_validation();
  test_stops();
  test_philox();
  test_greedy(ws);
  test_penalties(ws);
  test_logit_bias_forcing(ws);
  test_min_tokens(ws);
  test_logprobs(ws);
  test_ties(ws);
  test_probs_vs_sort(ws);
  test_extremes(ws);
  test_seeds(ws);
  pd_sample_ws_free(ws);
  if (g_fail) {
    fprintf(stderr, "%d checks failed\n", g_fail);
    return 1;
  }
  printf("test_sample: all checks passed\n");
  return 0;
}
