/* Device sampling (be->ops.sample of the CUDA backend) against the CPU sampler (common/sample),
 * the reference.
 *
 * Rows of vocabulary sizes 5, 1000, 1001 (no 16-byte loads), 32000, 128256 and 151936: peaked,
 * LLM-like, flat, all equal, heavy ties (integer logits), a few -inf, a few NaN, all -inf but one,
 * and bad rows (a +inf, all -inf, all NaN) whose token must be -1. Real pd_sampler objects with
 * many parameter sets (greedy; temperatures 0.5, 1, 1.7; top_k 1, 2, 50, 5000, 20000; top_p
 * 0.05, 0.9, 0.999; min_p 0.1; combinations; logit_bias with duplicate ids; repetition / presence /
 * frequency penalties over a prompt and accepted output; min_tokens with EOS) give the specs and
 * edits (pd_sampler_dev_spec). Checks:
 *   (a) greedy rows: the token equals pd_sample_token's;
 *   (b) sampled rows, with the sequence's own u and 63 more (0, 1 - 2^-53 and random ones): the
 *       token is the one whose interval holds u in the CDF of pd_sampler_probs() in id order; a
 *       different token only when u lies within 1e-6 relative (+ 1e-8 absolute: weights below
 *       2^-45 of the largest are dropped on the device) of an interval boundary, and then one of
 *       the tokens at that boundary;
 *   (c) logprobs, rank and the top list equal pd_logprobs_compute's (ids equal except at exact
 *       value ties, logprobs within 1e-5);
 *   (d) all specs again in one call, shuffled, with other rows in between: the same outputs;
 *   (e) bad rows give -1 and leave the others as they were (they share the calls).
 * Usage: test_cuda_sample [small]   ("small": only the three smaller vocabularies).
 * Exits 77 (skipped) when there is no CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/backend.h"
#include "pd/backend_cuda.h"
#include "pd/sample.h"
#include "pd_test.h"

static pd_backend *g_gpu;
static pd_sample_ws *g_ws;

/* ---- helpers ------------------------------------------------------------------------------- */

static uint64_t g_rs = 0x7b1d5e0c9a3f2461ull;
static uint64_t rnd_u64(void) {
  uint64_t z = (g_rs += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rnd_unif(void) { return (double)(rnd_u64() >> 11) * 0x1.0p-53; }
static int rnd_int(int n) { return (int)(rnd_u64() % (uint64_t)n); }
static float rnd_normal(float sd) {
  double u1 = rnd_unif(), u2 = rnd_unif();
  if (u1 < 1e-300) u1 = 1e-300;
  return (float)(sd * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  REQUIRE(p);
  return p;
}

/* ---- rows ---------------------------------------------------------------------------------- */

enum {
  R_PEAKED, R_LLM, R_FLAT, R_EQUAL, R_TIES, R_NEGINF, R_NAN, R_ONE, /* valid */
  R_PINF, R_ALLNEG, R_ALLNAN,                                       /* token -1 */
  R_COUNT
};
static const char *k_row_names[R_COUNT] = {"peaked", "llm",  "flat",  "equal",  "ties",  "-inf",
                                           "nan",    "one",  "+inf",  "all -inf", "all nan"};

static void make_row(float *x, int V, int kind) {
  for (int i = 0; i < V; i++) {
    switch (kind) {
    case R_PEAKED: /* a few spikes of +8 .. +15 */
      x[i] = rnd_normal(2.0f);
      if (rnd_int(V > 100 ? 200 : 4) == 0) x[i] += 8.0f + 7.0f * (float)rnd_unif();
      break;
    case R_LLM: x[i] = rnd_normal(3.0f) - 2.0f + (rnd_int(1000) == 0 ? 12.0f : 0.0f); break;
    case R_FLAT: x[i] = rnd_normal(0.05f); break;
    case R_EQUAL: x[i] = 0.5f; break;
    case R_TIES: x[i] = (float)(int)rnd_normal(2.0f); break;
    case R_NEGINF: x[i] = rnd_int(20) == 0 ? -INFINITY : rnd_normal(3.0f); break;
    case R_NAN: x[i] = rnd_int(50) == 0 ? NAN : rnd_normal(3.0f); break;
    case R_ONE: x[i] = -INFINITY; break;
    case R_PINF: x[i] = rnd_normal(3.0f); break;
    case R_ALLNEG: x[i] = -INFINITY; break;
    case R_ALLNAN: x[i] = NAN; break;
    }
  }
  if (kind == R_ONE) x[rnd_int(V)] = rnd_normal(3.0f);
  if (kind == R_PINF) x[rnd_int(V)] = INFINITY;
  if (kind == R_LLM || kind == R_PEAKED) x[rnd_int(V)] = 20.0f; /* one clear winner */
}

/* ---- parameter sets ------------------------------------------------------------------------ */

typedef struct cfg {
  float T;
  int top_k;
  float top_p, min_p;
  float rep, freq, pres;
  int bias;      /* logit_bias with a duplicate id */
  int history;   /* a prompt and accepted output (penalties) */
  int min_tok;   /* min_tokens with EOS, EOS strongly biased up */
  int logprobs;  /* -1 off */
} cfg;

static const cfg k_cfgs[] = {
    {0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},    /* greedy */
    {0.0f, 0, 1.0f, 0.0f, 1.3f, 0.5f, 0.3f, 1, 1, 0, 5},     /* greedy, edits, logprobs */
    {0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 1, 0},     /* greedy, min_tokens */
    {1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {0.5f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, 20},
    {1.7f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.0f, 1, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.0f, 2, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, 2},
    {1.0f, 50, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.0f, 0, 0.05f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.0f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, 1},
    {1.0f, 0, 1.0f, 0.1f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {0.7f, 50, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, 3},
    {1.7f, 2, 0.9f, 0.1f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {0.5f, 50, 0.05f, 0.1f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1, 0, 0, 3},     /* logit_bias */
    {1.0f, 0, 0.9f, 0.0f, 1.3f, 0.5f, 0.3f, 0, 1, 0, -1},    /* penalties */
    {1.0f, 0, 1.0f, 0.0f, 0.8f, -0.5f, -0.3f, 1, 1, 0, 0},   /* penalties < 0, bias */
    {1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 1, -1},    /* min_tokens */
    {1.0f, 50, 1.0f, 0.0f, 1.2f, 0.2f, 0.0f, 1, 1, 1, 0},    /* everything on top_k */
    {1.7f, 0, 0.9f, 0.1f, 1.0f, 0.0f, 0.0f, 0, 0, 0, 1},
    {1.0f, 5000, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.0f, 20000, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, 2}, /* kept set past shared memory */
    {1.0f, 0, 0.999f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 0, -1},
    {1.7f, 0, 0.999f, 0.0f, 1.2f, 0.0f, 0.4f, 0, 1, 0, -1},
};
#define N_CFG ((int)(sizeof k_cfgs / sizeof k_cfgs[0]))
#define N_U 64

/* ---- one vocabulary -------------------------------------------------------------------------- */

typedef struct item {
  int cfg, row;
  pd_sampler *s;
  int greedy;
  int spec0, nspec; /* its specs in the call */
} item;

typedef struct edits_buf {
  pd_dev_sample_edit *e;
  int n, cap;
} edits_buf;

static void get_spec(pd_sampler *s, pd_dev_sample_spec *sp, edits_buf *eb) {
  int32_t need = pd_sampler_dev_spec(s, sp, NULL, 0);
  if (eb->n + need > eb->cap) {
    while (eb->n + need > eb->cap) eb->cap = eb->cap ? eb->cap * 2 : 1024;
    eb->e = realloc(eb->e, (size_t)eb->cap * sizeof *eb->e);
    REQUIRE(eb->e);
  }
  int32_t got = pd_sampler_dev_spec(s, sp, eb->e + eb->n, need);
  REQUIRE(got == need);
  sp->edit_begin = eb->n;
  sp->edit_count = need;
  eb->n += need;
}

static pd_sampler *make_sampler(const cfg *c, int V, uint32_t idx) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = c->T;
  p.top_k = c->top_k;
  p.top_p = c->top_p;
  p.min_p = c->min_p;
  p.repetition_penalty = c->rep;
  p.frequency_penalty = c->freq;
  p.presence_penalty = c->pres;
  p.logprobs = c->logprobs;
  p.has_seed = true;
  p.seed = rnd_u64();
  const int hot = V < 300 ? V : 300;
  int32_t eos = 2 % V;
  pd_logit_bias lb[5];
  if (c->bias) {
    lb[0] = (pd_logit_bias){rnd_int(hot), 4.0f};
    lb[1] = (pd_logit_bias){rnd_int(hot), -50.0f};
    lb[2] = (pd_logit_bias){lb[0].id, 1.5f}; /* duplicate: adds up */
    lb[3] = (pd_logit_bias){rnd_int(V), 2.5f};
    p.logit_bias = lb;
    p.n_logit_bias = 4;
  }
  if (c->min_tok) {
    lb[p.n_logit_bias++] = (pd_logit_bias){eos, 30.0f}; /* would win, were it not suppressed */
    p.logit_bias = lb;
    p.min_tokens = 5;
  }
  pd_err e = {0};
  pd_sampler *s = pd_sampler_new(&p, V, &eos, 1, idx, &e);
  if (!s) fprintf(stderr, "pd_sampler_new: %s\n", e.msg);
  REQUIRE(s);
  if (c->history) {
    int32_t prompt[50];
    for (int i = 0; i < 50; i++) prompt[i] = rnd_int(hot);
    REQUIRE(pd_sampler_add_prompt(s, prompt, 50, &e) == PD_OK);
  }
  /* accepted output (penalties count it); min_tokens stays ahead of it */
  const int n_out = c->min_tok ? 3 : c->history ? 12 : rnd_int(3);
  for (int i = 0; i < n_out; i++) {
    int32_t t = rnd_int(hot);
    if (t == eos) t = (t + 1) % V;
    REQUIRE(pd_sampler_accept(s, t, NULL, &e) == PD_OK);
  }
  return s;
}

/* The token of the id-order CDF c[0, V) (inclusive sums of probs) holding position y (in
 * [0, tot)): the first i with c[i] > y and a nonzero probability; the last such token when
 * rounding leaves y past the end. */
static int cdf_token(const double *c, const float *probs, int V, double y) {
  int lo = 0, hi = V; /* first i with c[i] > y */
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2;
    if (c[mid] > y)
      hi = mid;
    else
      lo = mid + 1;
  }
  while (lo < V && !(probs[lo] > 0.0f)) lo++;
  if (lo == V) {
    lo = V - 1;
    while (lo > 0 && !(probs[lo] > 0.0f)) lo--;
  }
  return lo;
}

static int same_value(float a, float b) {
  if (isnan(a)) a = -INFINITY;
  if (isnan(b)) b = -INFINITY;
  return a == b;
}

static int g_lp_checks, g_near, g_checked;

/* (c): the device's logprobs of token tok against pd_logprobs_compute on the raw row. */
static void check_logprobs(const float *row, int V, int tok, int n_top,
                           const pd_dev_sample_out *o, const char *what) {
  pd_logprobs ref;
  pd_err e = {0};
  if (pd_logprobs_compute(row, V, tok, n_top, &ref, &e) != PD_OK) {
    CHECKF(0, "%s: reference logprobs failed: %s", what, e.msg);
    return;
  }
  g_lp_checks++;
  CHECKF(fabs((double)o->logprob - ref.logprob) <= 1e-5, "%s: logprob %.9g, cpu %.9g", what,
         (double)o->logprob, (double)ref.logprob);
  CHECKF(o->rank == ref.rank, "%s: rank %d, cpu %d", what, o->rank, ref.rank);
  CHECKF(o->n_top == ref.n_top, "%s: n_top %d, cpu %d", what, o->n_top, ref.n_top);
  for (int j = 0; j < ref.n_top && j < o->n_top; j++) {
    const int gi = o->top_id[j], ci = ref.top[j].id;
    CHECKF(gi >= 0 && gi < V, "%s: top[%d] id %d", what, j, gi);
    if (gi < 0 || gi >= V) return;
    CHECKF(gi == ci || same_value(row[gi], row[ci]), "%s: top[%d] id %d (%g), cpu %d (%g)", what,
           j, gi, (double)row[gi], ci, (double)row[ci]);
    const double a = o->top_logprob[j], b = ref.top[j].logprob;
    CHECKF((isinf(a) && isinf(b) && a == b) || fabs(a - b) <= 1e-5,
           "%s: top[%d] logprob %.9g, cpu %.9g", what, j, a, b);
  }
}

/* Bit-identical outputs. */
static int same_out(const pd_dev_sample_out *a, const pd_dev_sample_out *b) {
  int same = a->token == b->token && a->rank == b->rank && a->n_top == b->n_top &&
             memcmp(&a->logprob, &b->logprob, sizeof a->logprob) == 0;
  for (int j = 0; same && j < a->n_top; j++)
    same = a->top_id[j] == b->top_id[j] && a->top_logprob[j] == b->top_logprob[j];
  return same;
}

static void run_calls(const float *d_logits, int V, const pd_dev_sample_spec *specs, int n,
                      const edits_buf *eb, pd_dev_sample_out *out, int per_call) {
  for (int i = 0; i < n; i += per_call) {
    int m = n - i < per_call ? n - i : per_call;
    g_gpu->ops.sample(g_gpu, out + i, d_logits, V, specs + i, m, eb->e, eb->n);
  }
  pd_err e = {0};
  CHECKF(pd_backend_cuda_status(g_gpu, &e) == PD_OK, "backend error: %s", e.msg);
}

static void test_vocab(int V) {
  printf("vocab %d\n", V);
  fflush(stdout);
  float *rows = xmalloc((size_t)R_COUNT * V * sizeof(float));
  for (int r = 0; r < R_COUNT; r++) make_row(rows + (size_t)r * V, V, r);
  float *d_logits = g_gpu->ops.alloc(g_gpu, (size_t)R_COUNT * V * sizeof(float));
  REQUIRE(d_logits);
  g_gpu->ops.to_device(g_gpu, d_logits, rows, (size_t)R_COUNT * V * sizeof(float));

  const int n_items = N_CFG * R_COUNT;
  item *items = xmalloc((size_t)n_items * sizeof *items);
  int n_specs = 0;
  for (int c = 0; c < N_CFG; c++)
    for (int r = 0; r < R_COUNT; r++) {
      item *it = &items[c * R_COUNT + r];
      it->cfg = c;
      it->row = r;
      it->greedy = k_cfgs[c].T < PD_SAMPLE_GREEDY_EPS;
      it->spec0 = n_specs;
      it->nspec = it->greedy ? 1 : N_U;
      n_specs += it->nspec;
    }
  pd_dev_sample_spec *specs = xmalloc((size_t)n_specs * sizeof *specs);
  edits_buf eb = {NULL, 0, 0};
  for (int i = 0; i < n_items; i++) {
    item *it = &items[i];
    it->s = make_sampler(&k_cfgs[it->cfg], V, (uint32_t)i);
    pd_dev_sample_spec sp;
    get_spec(it->s, &sp, &eb);
    sp.row = it->row;
    for (int j = 0; j < it->nspec; j++) {
      specs[it->spec0 + j] = sp;
      if (j == 1) specs[it->spec0 + j].u = 0.0;
      if (j == 2) specs[it->spec0 + j].u = 1.0 - 0x1.0p-53;
      if (j >= 3) specs[it->spec0 + j].u = rnd_unif();
    }
  }
  pd_dev_sample_out *out = xmalloc((size_t)n_specs * sizeof *out);
  memset(out, 0x55, (size_t)n_specs * sizeof *out);
  run_calls(d_logits, V, specs, n_specs, &eb, out, 2500);

  float *row = xmalloc((size_t)V * sizeof(float)), *probs = xmalloc((size_t)V * sizeof(float));
  double *cdf = xmalloc((size_t)V * sizeof(double));
  int bad_items = 0;
  for (int i = 0; i < n_items; i++) {
    const item *it = &items[i];
    const cfg *c = &k_cfgs[it->cfg];
    char what[160];
    snprintf(what, sizeof what, "V=%d cfg %d row %s", V, it->cfg, k_row_names[it->row]);
    const int before = pd_test_failures;
    memcpy(row, rows + (size_t)it->row * V, (size_t)V * sizeof(float));
    pd_err e = {0};
    const int n_top = c->logprobs < 0 ? -1 : c->logprobs;
    /* the CPU fails the row when the edited row has no finite logit or a +inf, and also when
     * logprobs are asked for and the raw row has none */
    pd_logprobs lp;
    int cpu_tok = -1;
    pd_status st = pd_sample_token(it->s, g_ws, row, &cpu_tok, n_top >= 0 ? &lp : NULL, &e);
    if (st != PD_OK) {
      for (int j = 0; j < it->nspec; j++)
        CHECKF(out[it->spec0 + j].token == -1, "%s: token %d, cpu fails (%s)", what,
               out[it->spec0 + j].token, e.msg);
      if (pd_test_failures != before) bad_items++;
      continue;
    }
    if (it->greedy) {
      const pd_dev_sample_out *o = &out[it->spec0];
      g_checked++;
      CHECKF(o->token == cpu_tok, "%s: greedy token %d, cpu %d", what, o->token, cpu_tok);
      if (n_top >= 0 && o->token == cpu_tok) check_logprobs(row, V, cpu_tok, n_top, o, what);
      if (pd_test_failures != before) bad_items++;
      continue;
    }
    st = pd_sampler_probs(it->s, g_ws, row, probs, &e);
    CHECKF(st == PD_OK, "%s: pd_sampler_probs: %s", what, e.msg);
    if (st != PD_OK) continue;
    double acc = 0;
    for (int t = 0; t < V; t++) cdf[t] = acc += probs[t];
    const double tot = acc;
    for (int j = 0; j < it->nspec; j++) {
      const pd_dev_sample_out *o = &out[it->spec0 + j];
      const double u = specs[it->spec0 + j].u, y = u * tot;
      const int ref = cdf_token(cdf, probs, V, y);
      const double d = 1e-6 * y + 1e-8 * tot;
      g_checked++;
      if (o->token != ref) {
        const int lo = cdf_token(cdf, probs, V, y - d > 0 ? y - d : 0);
        const int hi = cdf_token(cdf, probs, V, y + d);
        CHECKF(o->token >= lo && o->token <= hi,
               "%s: u=%.17g: token %d (p %.9g), cpu interval holds %d (p %.9g)", what, u,
               o->token, o->token >= 0 && o->token < V ? (double)probs[o->token] : -1.0, ref,
               (double)probs[ref]);
        g_near++;
      }
      if (n_top >= 0 && j < 8 && o->token >= 0 && o->token < V)
        check_logprobs(row, V, o->token, n_top, o, what);
    }
    if (pd_test_failures != before) bad_items++;
  }

  /* (d) everything again in one call, shuffled, with filler rows in between */
  const int n_fill = n_specs / 4;
  const int n2 = n_specs + n_fill;
  pd_dev_sample_spec *s2 = xmalloc((size_t)n2 * sizeof *s2);
  int *from = xmalloc((size_t)n2 * sizeof *from); /* original index, -1 for fillers */
  for (int i = 0; i < n_specs; i++) s2[i] = specs[i], from[i] = i;
  for (int i = 0; i < n_fill; i++) {
    s2[n_specs + i] = specs[rnd_int(n_specs)];
    s2[n_specs + i].u = rnd_unif();
    s2[n_specs + i].row = rnd_int(R_COUNT);
    from[n_specs + i] = -1;
  }
  for (int i = n2 - 1; i > 0; i--) {
    int j = rnd_int(i + 1);
    pd_dev_sample_spec t = s2[i];
    s2[i] = s2[j], s2[j] = t;
    int f = from[i];
    from[i] = from[j], from[j] = f;
  }
  pd_dev_sample_out *out2 = xmalloc((size_t)n2 * sizeof *out2);
  run_calls(d_logits, V, s2, n2, &eb, out2, n2);
  int diff = 0;
  for (int i = 0; i < n2; i++) {
    if (from[i] < 0) continue;
    diff += !same_out(&out[from[i]], &out2[i]);
  }
  CHECKF(diff == 0, "V=%d: %d outputs differ when shuffled among other rows", V, diff);
  printf("  %d items (%d with failures), %d specs, %d edits; shuffled call of %d specs: "
         "%d differ\n", n_items, bad_items, n_specs, eb.n, n2, diff);

  /* small calls of greedy rows without edits or logprobs (1 to 16 rows: the multi-block argmax
   * with no copies): the same outputs as in the big call, which took the general kernel (every
   * row kind: ties, NaN, +-inf, all -inf, all NaN) */
  {
    pd_dev_sample_spec sb[16];
    int idx[16], nb = 0, calls = 0, n_small = 0, sdiff = 0;
    for (int i = 0; i <= n_specs; i++) {
      if (i < n_specs && specs[i].edit_count == 0 && specs[i].n_top < 0 &&
          specs[i].temperature < PD_SAMPLE_GREEDY_EPS) {
        sb[nb] = specs[i];
        sb[nb].edit_begin = 0;
        idx[nb++] = i;
      }
      if (nb > 0 && (nb == calls % 16 + 1 || i == n_specs)) {
        pd_dev_sample_out o3[16];
        g_gpu->ops.sample(g_gpu, o3, d_logits, V, sb, nb, NULL, 0);
        for (int j = 0; j < nb; j++) sdiff += !same_out(&out[idx[j]], &o3[j]);
        n_small += nb;
        nb = 0;
        calls++;
      }
    }
    pd_err e2 = {0};
    CHECKF(pd_backend_cuda_status(g_gpu, &e2) == PD_OK, "backend error: %s", e2.msg);
    CHECKF(n_small > 0 && sdiff == 0, "V=%d: %d of %d outputs of small greedy calls differ", V,
           sdiff, n_small);
    printf("  small greedy calls: %d specs in %d calls, %d differ\n", n_small, calls, sdiff);
  }
  /* one call of 300 such rows (the eligible specs repeated: a decode step of 300 sequences
   * takes the multi-block argmax too, 13 blocks a row) */
  {
    enum { NL = 300 };
    pd_dev_sample_spec *sl = xmalloc(NL * sizeof *sl);
    int *idx = xmalloc(NL * sizeof *idx), nl = 0;
    for (int pass = 0; nl < NL && pass < NL; pass++)
      for (int i = 0; i < n_specs && nl < NL; i++)
        if (specs[i].edit_count == 0 && specs[i].n_top < 0 &&
            specs[i].temperature < PD_SAMPLE_GREEDY_EPS) {
          sl[nl] = specs[i];
          sl[nl].edit_begin = 0;
          idx[nl++] = i;
        }
    pd_dev_sample_out *o4 = xmalloc(NL * sizeof *o4);
    if (nl > 0) g_gpu->ops.sample(g_gpu, o4, d_logits, V, sl, nl, NULL, 0);
    int ldiff = 0;
    for (int j = 0; j < nl; j++) ldiff += !same_out(&out[idx[j]], &o4[j]);
    CHECKF(nl == NL && ldiff == 0, "V=%d: %d of %d outputs of a %d-row greedy call differ", V,
           ldiff, nl, NL);
    printf("  a greedy call of %d rows: %d differ\n", nl, ldiff);
    free(sl);
    free(idx);
    free(o4);
  }

  for (int i = 0; i < n_items; i++) pd_sampler_free(items[i].s);
  free(items);
  free(specs);
  free(eb.e);
  free(out);
  free(s2);
  free(from);
  free(out2);
  free(row);
  free(probs);
  free(cdf);
  free(rows);
  g_gpu->ops.free(g_gpu, d_logits);
}

int main(int argc, char **argv) {
  if (pd_cuda_device_count() == 0) {
    printf("test_cuda_sample: no CUDA device, skipped\n");
    return 77;
  }
  const int small = argc > 1 && strcmp(argv[1], "small") == 0;
  pd_err e = {0};
  g_gpu = pd_backend_cuda_create(NULL, &e);
  if (!g_gpu) {
    fprintf(stderr, "pd_backend_cuda_create: %s\n", e.msg);
    return 1;
  }
  REQUIRE(g_gpu->ops.sample != NULL);
  g_ws = pd_sample_ws_new(151936, &e);
  REQUIRE(g_ws);
  static const int vocabs[] = {5, 1000, 1001, 32000, 128256, 151936};
  const int nv = small ? 3 : 6;
  for (int i = 0; i < nv; i++) test_vocab(vocabs[i]);
  printf("checked %d tokens (%d inside the boundary tolerance), %d logprob results\n", g_checked,
         g_near, g_lp_checks);
  pd_sample_ws_free(g_ws);
  pd_backend_destroy(g_gpu);
  return pd_test_finish("test_cuda_sample");
}
