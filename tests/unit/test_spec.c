/* Speculative decoding in the scheduler, on the bundled pycoder-12m with pycoder-draft-2m:
 *   - n-gram proposals (longest match first, most recent, periodic continuation) and the
 *     adaptive policy's timing model;
 *   - greedy ids and finish reasons are bit-identical to plain decoding on the CPU (logprobs
 *     equal to float rounding) for the draft and the n-gram methods, fixed and adaptive, in mixed batches of
 *     prompts of many lengths, with preemption (a small KV cache), with n > 1, with stop
 *     tokens and max_tokens falling inside an accepted run;
 *   - both block pools hold nothing at the end (rollbacks across block boundaries leak no
 *     block), and speculation did happen (proposals were accepted);
 *   - sampled output has the target's distribution: a two-sample chi-square test of the
 *     second and third tokens over many seeds (top-k 4, so the vocabulary is small), plain
 *     against speculative, for both methods;
 *   - a draft with another tokenizer is refused with a clear error. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd/backend_cuda.h"
#include "pd/runtime.h"
#include "pd/spec.h"
#include "pd_test.h"

#if defined(__SANITIZE_ADDRESS__) || defined(PD_SANITIZED)
#define N_SEEDS 600
#else
#define N_SEEDS 2000
#endif

#define MAX_REQ 2100
#define MAX_OUT 48
#define MAX_N 2

typedef struct out {
  int32_t ids[MAX_N][MAX_OUT];
  float lp[MAX_N][MAX_OUT];
  float gap[MAX_N][MAX_OUT]; /* top-1 minus top-2 logprob */
  int n[MAX_N];
  pd_finish_reason fin[MAX_N];
} out;

static out g_out[MAX_REQ];

static void on_event(void *user, const pd_sched_event *ev) {
  (void)user;
  out *o = &g_out[ev->id];
  if (ev->token >= 0 && o->n[ev->index] < MAX_OUT) {
    int k = o->n[ev->index]++;
    o->ids[ev->index][k] = ev->token;
    o->lp[ev->index][k] = ev->logprobs ? ev->logprobs->logprob : NAN;
    o->gap[ev->index][k] = ev->logprobs && ev->logprobs->n_top >= 2
                               ? ev->logprobs->top[0].logprob - ev->logprobs->top[1].logprob
                               : INFINITY;
  }
  o->fin[ev->index] = ev->finish;
}

typedef struct setup {
  const char *name;
  const char *method; /* NULL: plain */
  bool fixed;
  int k;
  int kv_tokens;
} setup;

/* The bundled models: $PD_TEST_DATA_DIR/models when set (a copy of tests/data, e.g. on a GPU
 * machine that runs a prebuilt bundle), else the source tree's. */
static const char *model_path(const char *name) {
  static char buf[4][512];
  static int next;
  const char *d = getenv("PD_TEST_DATA_DIR");
  char *b = buf[next++ % 4];
  snprintf(b, sizeof buf[0], "%s/models/%s", d && *d ? d : PD_TEST_DATA, name);
  return b;
}

static const char *g_device = "cpu"; /* argv[1]: cuda runs the greedy part on the GPU */
static bool g_gpu;

static void open_rt(pd_runtime *rt, const setup *su) {
  pd_runtime_opts o;
  pd_runtime_opts_default(&o);
  o.model_dir = model_path("pycoder-12m");
  o.device = g_device;
  o.kv_cache_tokens = su->kv_tokens;
  o.max_batch_tokens = 512;
  o.max_seqs = 64;
  if (su->method) {
    o.speculative_method = su->method;
    if (!strcmp(su->method, "draft")) o.speculative_model = model_path("pycoder-draft-2m");
    o.speculative_adaptive = su->fixed ? "off" : "on";
    o.num_speculative_tokens = su->k;
    o.ngram_min = 1;
    o.ngram_max = 3;
  }
  pd_err e = {0};
  if (pd_runtime_open(rt, &o, on_event, NULL, &e) != PD_OK) {
    fprintf(stderr, "runtime (%s): %s\n", su->name, e.msg);
    exit(1);
  }
}

static void run_all(pd_runtime *rt) {
  pd_err e = {0};
  int guard = 0;
  while (pd_sched_has_work(rt->sched)) {
    if (pd_sched_step(rt->sched, &e) != PD_OK) {
      fprintf(stderr, "step: %s\n", e.msg);
      exit(1);
    }
    REQUIRE(++guard < 200000);
  }
}

static void check_pool_idle(pd_kv_pool *p, const char *what) {
  if (!p) return;
  pd_kv_stats st;
  pd_kv_pool_stats(p, &st);
  CHECKF(st.used == 0 && st.num_seqs == 0, "%s: %d blocks in use, %d sequences alive", what,
         st.used, st.num_seqs);
  pd_err e = {0};
  CHECKF(pd_kv_pool_check(p, &e) == PD_OK, "%s: %s", what, e.msg);
}

static int32_t corpus[4096];
static int corpus_n;

static void make_corpus(pd_runtime *rt) {
  const char *src =
      "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
      "class Config(object):\n    def __init__(self, path):\n        self.path = path\n"
      "        self.values = {}\n\n    def load(self):\n        with open(self.path) as f:\n"
      "            for line in f:\n                key, _, value = line.partition('=')\n"
      "                self.values[key.strip()] = value.strip()\n        return self.values\n\n";
  char buf[8192] = "";
  while (strlen(buf) + strlen(src) < sizeof buf) strcat(buf, src);
  int32_t *ids;
  size_t n;
  pd_err e = {0};
  REQUIRE(pd_tokenizer_encode(rt->tok, buf, strlen(buf), false, &ids, &n, &e) == PD_OK);
  corpus_n = n > 4096 ? 4096 : (int)n;
  REQUIRE(corpus_n > 600);
  memcpy(corpus, ids, (size_t)corpus_n * sizeof *ids);
  free(ids);
}

/* ---- the greedy workload ---- */

enum { N_GREEDY = 24 };

static pd_sampling_params greedy_params(int i) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 0;
  p.max_tokens = i % 5 == 3 ? 5 + i % 7 : MAX_OUT; /* some end inside a run */
  p.ignore_eos = true;
  p.logprobs = 2;
  p.n = i % 8 == 5 ? 2 : 1;
  return p;
}

static int greedy_len(int i) { return 1 + (i * 53) % 500; }
static const int32_t *greedy_prompt(int i) { return corpus + (i * 29) % 100; }

static void add_greedy(pd_runtime *rt, const int32_t *stop, int n_stop) {
  pd_err e = {0};
  for (int i = 0; i < N_GREEDY; i++) {
    pd_sampling_params p = greedy_params(i);
    if (n_stop && i % 3 == 0) { /* a stop token taken from the plain output */
      p.stop_token_ids = &stop[i];
      p.n_stop_token_ids = 1;
      p.ignore_eos = false;
    }
    CHECKF(pd_sched_add(rt->sched, (uint64_t)i, greedy_prompt(i), greedy_len(i), &p, &e) == PD_OK,
           "%s", e.msg);
  }
}

static void compare_greedy(const out *ref, const char *what) {
  for (int i = 0; i < N_GREEDY; i++) {
    const out *a = &ref[i], *b = &g_out[i];
    for (int s = 0; s < greedy_params(i).n; s++) {
      if (!g_gpu) { /* (on a GPU a near-tie may change what follows, stop tokens included) */
        CHECKF(a->n[s] == b->n[s], "%s: request %d/%d: %d tokens against %d", what, i, s,
               b->n[s], a->n[s]);
        CHECKF(a->fin[s] == b->fin[s], "%s: request %d/%d: finish %d against %d", what, i, s,
               b->fin[s], a->fin[s]);
      }
      for (int t = 0; t < a->n[s] && t < b->n[s]; t++) {
        /* on a GPU the verification's batch shape changes the bf16 rounding: equal up to the
         * first near-tie of either run */
        if (g_gpu && a->ids[s][t] == b->ids[s][t] && (a->gap[s][t] < 0.1f || b->gap[s][t] < 0.1f))
          break;
        if (g_gpu && a->ids[s][t] != b->ids[s][t]) {
          CHECKF(a->gap[s][t] < 0.1f || b->gap[s][t] < 0.1f,
                 "%s: request %d/%d token %d: %d against %d (gaps %.3g, %.3g)", what, i, s, t,
                 b->ids[s][t], a->ids[s][t], b->gap[s][t], a->gap[s][t]);
          break;
        }
        if (g_gpu) continue;
        /* ids bit for bit; logprobs to float rounding (the CPU kernels' summation order
         * depends on how many rows a step has, so the last bits of a logit do too) */
        if (a->ids[s][t] != b->ids[s][t] ||
            !(fabsf(a->lp[s][t] - b->lp[s][t]) <= 1e-5f * (1.0f + fabsf(a->lp[s][t])))) {
          CHECKF(0, "%s: request %d/%d token %d: %d (logprob %.9g) against %d (%.9g)", what, i, s,
                 t, b->ids[s][t], b->lp[s][t], a->ids[s][t], a->lp[s][t]);
          break;
        }
      }
    }
  }
}

/* ---- the draft's KV handed over: a prefill node's runtime computes it with the prompts
 * (draft_prefill), a decode node's receives it in blocks reserved for it ---- */

typedef struct handover {
  pd_runtime *p, *d;
  int n_done;
  bool done[N_GREEDY];
  int32_t first[N_GREEDY];
} handover;
static handover g_ho;

/* Whole blocks src[i] -> dst[i] of every layer, from one engine's cache into another's (host
 * memory: the CPU backend). */
static void copy_kv(const pd_engine *src, const pd_engine *dst, const int32_t *sb,
                    const int32_t *db, int nb) {
  const int L = pd_engine_config(src)->num_layers;
  for (int l = 0; l < L; l++) {
    pd_kv_layer a, b;
    pd_kv_shape sa, sd;
    pd_err e = {0};
    REQUIRE(pd_engine_kv(src, l, &a, &sa, &e) == PD_OK && pd_engine_kv(dst, l, &b, &sd, &e) == PD_OK);
    const size_t bb = (size_t)sa.num_kv_heads * sa.block_size * sa.head_dim * pd_dtype_size(sa.dtype);
    for (int i = 0; i < nb; i++) {
      memcpy((char *)b.k + (size_t)db[i] * bb, (const char *)a.k + (size_t)sb[i] * bb, bb);
      memcpy((char *)b.v + (size_t)db[i] * bb, (const char *)a.v + (size_t)sb[i] * bb, bb);
    }
  }
}

/* The prefill side's first token: both caches go into the decode side's reserved blocks; even
 * requests are told the draft's KV landed, odd ones not (their draft computes the context). */
static void on_prefill_event(void *user, const pd_sched_event *ev) {
  (void)user;
  const int i = (int)ev->id;
  if (ev->token < 0 || i >= N_GREEDY || g_ho.done[i]) return;
  const int n_ctx = greedy_len(i), bs = 16, nb = (n_ctx + bs - 1) / bs;
  int32_t tb[64], db[64];
  int ntb = 0, ndb = 0;
  pd_err e = {0};
  /* (reserved here, after the prompt: the request ids are the same on both sides) */
  pd_sampling_params p = greedy_params(i);
  p.n = 1;
  pd_sched_req r = {.id = (uint64_t)i, .prompt = greedy_prompt(i), .n_prompt = n_ctx,
                    .params = &p};
  CHECKF(pd_sched_reserve(g_ho.d->sched, &r, tb, 64, &ntb, &e) == PD_OK, "reserve %d: %s", i,
         e.msg);
  CHECKF(pd_sched_reserve_draft(g_ho.d->sched, (uint64_t)i, db, 64, &ndb, &e) == PD_OK,
         "reserve draft %d: %s", i, e.msg);
  CHECKF(ntb == nb && ndb == nb && ev->n_kv_tokens == n_ctx && ev->draft_block_table &&
             ev->n_draft_kv_tokens == n_ctx && ev->n_draft_blocks == nb,
         "request %d: %d and %d blocks reserved, KV of %d and %d tokens computed", i, ntb, ndb,
         ev->n_kv_tokens, ev->n_draft_kv_tokens);
  if (ntb != nb || ndb != nb || !ev->draft_block_table) return;
  copy_kv(g_ho.p->eng, g_ho.d->eng, ev->block_table, tb, nb);
  copy_kv(g_ho.p->draft_eng, g_ho.d->draft_eng, ev->draft_block_table, db, nb);
  if (i % 2 == 0) CHECK(pd_sched_draft_landed(g_ho.d->sched, (uint64_t)i, &e) == PD_OK);
  g_ho.first[i] = ev->token;
  g_ho.done[i] = true;
  g_ho.n_done++;
  pd_sched_abort(g_ho.p->sched, (uint64_t)i);
}

/* The greedy requests (n 1) through a prefill runtime and a decode runtime, both with the
 * draft (k 4, fixed); the decode side's outputs in g_out. */
static void handover_run(pd_sched_stats *st) {
  pd_runtime p, d;
  pd_runtime_opts o;
  pd_runtime_opts_default(&o);
  o.model_dir = model_path("pycoder-12m");
  o.max_batch_tokens = 192; /* long prompts take several chunks */
  o.max_seqs = 64;
  o.speculative_model = model_path("pycoder-draft-2m");
  o.speculative_adaptive = "off";
  o.num_speculative_tokens = 4;
  pd_err e = {0};
  o.draft_prefill = true;
  REQUIRE(pd_runtime_open(&p, &o, on_prefill_event, NULL, &e) == PD_OK);
  o.draft_prefill = false;
  REQUIRE(pd_runtime_open(&d, &o, on_event, NULL, &e) == PD_OK);
  memset(&g_ho, 0, sizeof g_ho);
  g_ho.p = &p;
  g_ho.d = &d;
  memset(g_out, 0, sizeof g_out);
  for (int i = 0; i < N_GREEDY; i++) {
    pd_sampling_params sp = greedy_params(i);
    sp.n = 1;
    sp.max_tokens = 1;
    REQUIRE(pd_sched_add(p.sched, (uint64_t)i, greedy_prompt(i), greedy_len(i), &sp, &e) == PD_OK);
  }
  run_all(&p);
  CHECKF(g_ho.n_done == N_GREEDY, "%d of %d prompts handed over", g_ho.n_done, N_GREEDY);
  memset(g_out, 0, sizeof g_out);
  for (int i = 0; i < N_GREEDY; i++) {
    if (!g_ho.done[i]) continue;
    /* the first token is the prefill side's (as a decode node reports it, not the scheduler) */
    g_out[i].ids[0][0] = g_ho.first[i];
    g_out[i].lp[0][0] = NAN;
    g_out[i].n[0] = 1;
    CHECKF(pd_sched_activate(d.sched, (uint64_t)i, g_ho.first[i], &e) == PD_OK, "activate %d: %s",
           i, e.msg);
  }
  run_all(&d);
  pd_sched_get_stats(d.sched, st);
  check_pool_idle(p.pool, "handover, prefill side");
  check_pool_idle(p.draft_pool, "handover, prefill side's draft");
  check_pool_idle(d.pool, "handover, decode side");
  check_pool_idle(d.draft_pool, "handover, decode side's draft");
  pd_runtime_close(&d);
  pd_runtime_close(&p);
}

/* ---- the sampled workload ---- */

static pd_sampling_params sampled_params(uint64_t seed) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 1.0f;
  p.top_k = 4;
  p.max_tokens = 3;
  p.ignore_eos = true;
  p.seed = seed;
  p.has_seed = true;
  return p;
}

/* Joint counts of (token 2, token 3) for N_SEEDS seeded requests of one prompt. */
typedef struct hist {
  int32_t key[64 * 64];
  int cnt[64 * 64];
  int n;
} hist;

static void count(hist *h, int32_t a, int32_t b) {
  int32_t k = a * 4096 + b;
  for (int i = 0; i < h->n; i++)
    if (h->key[i] == k) {
      h->cnt[i]++;
      return;
    }
  REQUIRE(h->n < 64 * 64);
  h->key[h->n] = k;
  h->cnt[h->n++] = 1;
}

static void sample_run(const setup *su, const int32_t *prompt, int n_prompt, hist *h,
                       pd_sched_stats *st) {
  pd_runtime rt;
  open_rt(&rt, su);
  memset(g_out, 0, sizeof g_out);
  pd_err e = {0};
  for (int i = 0; i < N_SEEDS; i++) {
    pd_sampling_params p = sampled_params(1000 + (uint64_t)i * 7919);
    CHECKF(pd_sched_add(rt.sched, (uint64_t)i, prompt, n_prompt, &p, &e) == PD_OK, "%s", e.msg);
  }
  run_all(&rt);
  memset(h, 0, sizeof *h);
  for (int i = 0; i < N_SEEDS; i++) {
    REQUIRE(g_out[i].n[0] == 3);
    count(h, g_out[i].ids[0][1], g_out[i].ids[0][2]);
  }
  pd_sched_get_stats(rt.sched, st);
  check_pool_idle(rt.pool, su->name);
  check_pool_idle(rt.draft_pool, su->name);
  pd_runtime_close(&rt);
}

/* Two-sample chi-square over the union of categories (rare ones pooled); returns the
 * statistic and its degrees of freedom. */
static double chi2_two_sample(const hist *a, const hist *b, int *df) {
  int32_t keys[2 * 64 * 64];
  int nk = 0;
  for (int i = 0; i < a->n; i++) keys[nk++] = a->key[i];
  for (int i = 0; i < b->n; i++) {
    bool seen = false;
    for (int j = 0; j < a->n && !seen; j++) seen = a->key[j] == b->key[i];
    if (!seen) keys[nk++] = b->key[i];
  }
  double x2 = 0, pa = 0, pb = 0;
  int cats = 0;
  for (int i = 0; i < nk; i++) {
    double ca = 0, cb = 0;
    for (int j = 0; j < a->n; j++)
      if (a->key[j] == keys[i]) ca = a->cnt[j];
    for (int j = 0; j < b->n; j++)
      if (b->key[j] == keys[i]) cb = b->cnt[j];
    if (ca + cb < 10) { /* pooled */
      pa += ca;
      pb += cb;
      continue;
    }
    x2 += (ca - cb) * (ca - cb) / (ca + cb);
    cats++;
  }
  if (pa + pb > 0) {
    x2 += (pa - pb) * (pa - pb) / (pa + pb);
    cats++;
  }
  *df = cats - 1;
  return x2;
}

/* The chi-square quantile at upper tail 1e-4 (Wilson-Hilferty). */
static double chi2_crit(int df) {
  const double z = 3.719; /* standard normal upper 1e-4 */
  double h = 2.0 / (9.0 * df);
  double c = 1 - h + z * sqrt(h);
  return df * c * c * c;
}

int main(int argc, char **argv) {
  if (argc > 1) {
    g_device = argv[1];
    g_gpu = strncmp(g_device, "cuda", 4) == 0;
    if (g_gpu && pd_cuda_device_count() <= 0) {
      printf("no CUDA device: skipped\n");
      return 77;
    }
  }
  /* 1. n-gram proposals */
  {
    int32_t out[8];
    const int32_t t1[] = {5, 6, 7, 8, 1, 2, 5, 6, 7};
    CHECK(pd_spec_ngram_propose(t1, 9, 1, 3, 3, out) == 3); /* "5 6 7" matched at 0 */
    CHECK(out[0] == 8 && out[1] == 1 && out[2] == 2);
    const int32_t t2[] = {1, 9, 3, 2, 9, 4, 9};
    CHECK(pd_spec_ngram_propose(t2, 7, 1, 3, 2, out) == 2); /* only "9": the most recent, at 4 */
    CHECK(out[0] == 4 && out[1] == 9);
    CHECK(pd_spec_ngram_propose(t2, 7, 2, 3, 2, out) == 0); /* no 2-gram "4 9" earlier */
    const int32_t t3[] = {7, 7, 7, 7};
    CHECK(pd_spec_ngram_propose(t3, 4, 1, 3, 5, out) == 5); /* period 1 continues */
    for (int i = 0; i < 5; i++) CHECK(out[i] == 7);
    const int32_t t4[] = {1, 2, 3, 1, 2, 3, 1, 2};
    CHECK(pd_spec_ngram_propose(t4, 8, 2, 2, 4, out) == 4); /* "1 2" at 3: 3, then period 3 */
    CHECK(out[0] == 3 && out[1] == 1 && out[2] == 2 && out[3] == 3);
    CHECK(pd_spec_ngram_propose(t4, 1, 1, 3, 4, out) == 0);
  }
  /* 2. the adaptive policy against simulated step costs */
  if (!g_gpu) {
    /* rate(k) for a batch: tokens per step 1 + a + .. + a^k, time t0 + k * per */
    struct { int batch; double a, t0, per; int want; } cases[] = {
        {1, 0.8, 10, 1.0, 4},   /* cheap proposals, high acceptance: k = K */
        {200, 0.5, 10, 6.0, 0}, /* expensive verification: off */
        {16, 0.6, 10, 2.5, 2},  /* in between: a small k */
    };
    for (int c = 0; c < 3; c++) {
      pd_spec_policy p;
      pd_spec_policy_init(&p, 4);
      double tok_sum = 0, time_sum = 0;
      int last = -1, used[5] = {0};
      for (int step = 0; step < 4000; step++) {
        int k = pd_spec_policy_choose(&p, cases[c].batch);
        REQUIRE(k >= 0 && k <= 4);
        double emitted = 0, pw = 1;
        for (int j = 0; j <= k; j++, pw *= cases[c].a) emitted += pw;
        double t = cases[c].t0 + k * cases[c].per;
        pd_spec_policy_observe(&p, (int)(emitted * 1000 + 0.5), t * 1e-3, true); /* x1000: whole tokens */
        tok_sum += emitted;
        time_sum += t;
        if (step >= 2000) used[k]++;
        last = k;
      }
      (void)last;
      CHECKF(pd_spec_policy_best(&p, cases[c].batch) == cases[c].want,
             "policy case %d: best k %d, want %d", c, pd_spec_policy_best(&p, cases[c].batch),
             cases[c].want);
      /* exploring costs little: the best k ran nearly all of the last 2000 steps */
      CHECKF(used[cases[c].want] > 1900, "policy case %d: k %d in %d of 2000 steps", c,
             cases[c].want, used[cases[c].want]);
      double best_rate = 0;
      for (int k = 0; k <= 4; k++) {
        double emitted = 0, pw = 1;
        for (int j = 0; j <= k; j++, pw *= cases[c].a) emitted += pw;
        double r = emitted / (cases[c].t0 + k * cases[c].per);
        if (r > best_rate) best_rate = r;
      }
      CHECKF(tok_sum / time_sum > 0.97 * best_rate, "policy case %d: %.4f of the best rate %.4f",
             c, tok_sum / time_sum, best_rate);
    }
  }

  /* 3. greedy: plain, then every speculative setup, bit for bit */
  static out ref[N_GREEDY];
  static int32_t stop[N_GREEDY];
  const setup plain = {"plain", NULL, false, 0, 0};
  pd_runtime rt;
  open_rt(&rt, &plain);
  make_corpus(&rt);
  memset(g_out, 0, sizeof g_out);
  add_greedy(&rt, NULL, 0);
  run_all(&rt);
  /* stop tokens: each third request stops at the token it emitted 7th */
  for (int i = 0; i < N_GREEDY; i++) stop[i] = g_out[i].n[0] > 7 ? g_out[i].ids[0][7] : 1;
  memset(g_out, 0, sizeof g_out);
  add_greedy(&rt, stop, N_GREEDY);
  run_all(&rt);
  memcpy(ref, g_out, sizeof ref);
  pd_runtime_close(&rt);
  int stopped = 0;
  for (int i = 0; i < N_GREEDY; i++) stopped += ref[i].fin[0] == PD_FINISH_STOP;
  CHECKF(stopped >= 4, "only %d requests met their stop token", stopped);

  const setup setups[] = {
      {"draft, k 4, fixed", "draft", true, 4, 0},
      {"draft, adaptive", "draft", false, 5, 0},
      {"ngram, k 4, fixed", "ngram", true, 4, 0},
      {"ngram, adaptive", "ngram", false, 4, 0},
      {"draft, k 7, small cache", "draft", true, 7, 1200},
      {"ngram, k 6, small cache", "ngram", true, 6, 1200},
  };
  for (size_t k = 0; k < sizeof setups / sizeof setups[0]; k++) {
    const setup *su = &setups[k];
    open_rt(&rt, su);
    memset(g_out, 0, sizeof g_out);
    add_greedy(&rt, stop, N_GREEDY);
    run_all(&rt);
    compare_greedy(ref, su->name);
    pd_sched_stats st;
    pd_sched_get_stats(rt.sched, &st);
    printf("%-24s %5llu steps, %5llu verified, %5llu proposed, %5llu accepted, %llu preemptions\n",
           su->name, (unsigned long long)st.steps, (unsigned long long)st.spec_verified,
           (unsigned long long)st.spec_proposed, (unsigned long long)st.spec_accepted,
           (unsigned long long)st.preemptions);
    CHECKF(st.spec_verified > 0 && st.spec_accepted > 0, "%s: nothing was accepted", su->name);
    if (g_gpu) { /* the cache copies of two engines on one GPU: nothing leaks either */
      check_pool_idle(rt.pool, su->name);
      check_pool_idle(rt.draft_pool, su->name);
    }
    if (su->fixed) CHECKF(st.spec_accepted * 5 > st.spec_proposed, "%s: acceptance under 20%%", su->name);
    if (su->kv_tokens) CHECKF(st.preemptions > 0, "%s: no preemption", su->name);
    uint64_t hist_sum = 0;
    for (int j = 0; j < PD_SPEC_MAX_K + 2; j++) hist_sum += st.spec_emitted_hist[j];
    CHECK(hist_sum == st.spec_verified && st.spec_emitted_hist[0] == 0);
    check_pool_idle(rt.pool, su->name);
    check_pool_idle(rt.draft_pool, su->name);
    pd_runtime_close(&rt);
  }

  /* 3b. the draft's KV computed with the prompts on a prefill side and handed over into
   * reserved draft blocks: the same greedy ids (n 1, no stop tokens), and speculation from
   * handed-over KV proposes exactly what a draft that computed the context itself does (the CPU
   * forward is row-invariant: the same KV bits) */
  if (!g_gpu) {
    static out ref1[N_GREEDY];
    const setup su = {"draft, k 4, fixed", "draft", true, 4, 0};
    open_rt(&rt, &su);
    memset(g_out, 0, sizeof g_out);
    pd_err e = {0};
    for (int i = 0; i < N_GREEDY; i++) {
      pd_sampling_params sp = greedy_params(i);
      sp.n = 1;
      REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, greedy_prompt(i), greedy_len(i), &sp, &e) ==
              PD_OK);
    }
    run_all(&rt);
    memcpy(ref1, g_out, sizeof ref1);
    pd_runtime_close(&rt);
    pd_sched_stats st;
    handover_run(&st);
    for (int i = 0; i < N_GREEDY; i++) {
      CHECKF(g_out[i].n[0] == ref1[i].n[0], "handover: request %d: %d tokens against %d", i,
             g_out[i].n[0], ref1[i].n[0]);
      for (int t = 0; t < g_out[i].n[0] && t < ref1[i].n[0]; t++)
        if (g_out[i].ids[0][t] != ref1[i].ids[0][t]) {
          CHECKF(0, "handover: request %d token %d: %d against %d", i, t, g_out[i].ids[0][t],
                 ref1[i].ids[0][t]);
          break;
        }
    }
    printf("handover: %llu proposed, %llu accepted (draft KV of half the requests handed over)\n",
           (unsigned long long)st.spec_proposed, (unsigned long long)st.spec_accepted);
    CHECK(st.spec_accepted > 0);
  }

  /* 4. sampling: the distribution of tokens 2 and 3 is the target's (on the CPU, whose
   * forward does not depend on the batch's shape beyond rounding) */
  if (!g_gpu) {
    static hist h_plain, h_spec;
    pd_sched_stats st;
    const int32_t *prompt = corpus + 40;
    const int n_prompt = 200; /* repetitive code: n-gram proposals find matches */
    sample_run(&plain, prompt, n_prompt, &h_plain, &st);
    const setup ss[] = {{"sampled draft", "draft", true, 3, 0},
                        {"sampled ngram", "ngram", true, 3, 0}};
    for (int k = 0; k < 2; k++) {
      sample_run(&ss[k], prompt, n_prompt, &h_spec, &st);
      int df;
      double x2 = chi2_two_sample(&h_plain, &h_spec, &df);
      printf("%s: chi-square %.1f with %d degrees of freedom (critical %.1f); %llu proposed, "
             "%llu accepted\n",
             ss[k].name, x2, df, chi2_crit(df > 0 ? df : 1),
             (unsigned long long)st.spec_proposed, (unsigned long long)st.spec_accepted);
      CHECK(df >= 3);
      CHECKF(x2 < chi2_crit(df), "%s: chi-square %.1f over %.1f (df %d)", ss[k].name, x2,
             chi2_crit(df), df);
      CHECKF(st.spec_accepted > 0 && st.spec_accepted < st.spec_proposed,
             "%s: %llu of %llu accepted", ss[k].name, (unsigned long long)st.spec_accepted,
             (unsigned long long)st.spec_proposed);
    }
    /* the test can fail: the draft's own distribution is not the target's */
    pd_runtime_opts o;
    pd_runtime_opts_default(&o);
    o.model_dir = model_path("pycoder-draft-2m");
    o.max_seqs = 64;
    o.max_batch_tokens = 512;
    pd_runtime drt;
    pd_err e = {0};
    REQUIRE(pd_runtime_open(&drt, &o, on_event, NULL, &e) == PD_OK);
    memset(g_out, 0, sizeof g_out);
    for (int i = 0; i < N_SEEDS; i++) {
      pd_sampling_params p = sampled_params(1000 + (uint64_t)i * 7919);
      REQUIRE(pd_sched_add(drt.sched, (uint64_t)i, prompt, n_prompt, &p, &e) == PD_OK);
    }
    run_all(&drt);
    memset(&h_spec, 0, sizeof h_spec);
    for (int i = 0; i < N_SEEDS; i++) count(&h_spec, g_out[i].ids[0][1], g_out[i].ids[0][2]);
    pd_runtime_close(&drt);
    int df;
    double x2 = chi2_two_sample(&h_plain, &h_spec, &df);
    printf("draft alone: chi-square %.1f with %d degrees of freedom (critical %.1f)\n", x2, df,
           chi2_crit(df > 0 ? df : 1));
    CHECKF(x2 > chi2_crit(df), "the draft's own samples pass as the target's (%.1f)", x2);
  }

  /* 5. a draft with another tokenizer, and bad options */
  {
    pd_runtime_opts o;
    pd_runtime_opts_default(&o);
    o.model_dir = model_path("pycoder-12m");
    /* the draft model with one special token spelled otherwise */
    char dir[] = "/tmp/pd-test-spec-XXXXXX";
    REQUIRE(mkdtemp(dir));
    const char *links[] = {"config.json", "model.safetensors", "tokenizer_config.json"};
    char path[512], target[512];
    for (int i = 0; i < 3; i++) {
      snprintf(path, sizeof path, "%s/%s", dir, links[i]);
      snprintf(target, sizeof target, "%s/%s", model_path("pycoder-draft-2m"), links[i]);
      REQUIRE(symlink(target, path) == 0);
    }
    size_t len = 0;
    snprintf(path, sizeof path, "%s/tokenizer.json", model_path("pycoder-draft-2m"));
    char *tj = pd_test_read_file(path, &len);
    REQUIRE(tj);
    char *at = strstr(tj, "<|im_start|>");
    REQUIRE(at);
    memcpy(at, "<|im_begin|>", 12);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    REQUIRE(f && fwrite(tj, 1, len, f) == len && fclose(f) == 0);
    free(tj);
    o.speculative_model = dir;
    pd_err e = {0};
    CHECK(pd_runtime_open(&rt, &o, on_event, NULL, &e) == PD_EINVAL);
    CHECKF(strstr(e.msg, "tokenizer"), "%s", e.msg);
    const char *all[] = {"config.json", "model.safetensors", "tokenizer_config.json",
                         "tokenizer.json"};
    for (int i = 0; i < 4; i++) {
      snprintf(path, sizeof path, "%s/%s", dir, all[i]);
      unlink(path);
    }
    rmdir(dir);
    o.speculative_model = NULL;
    o.speculative_method = "ngram";
    o.ngram_min = 3;
    o.ngram_max = 2;
    CHECK(pd_runtime_open(&rt, &o, on_event, NULL, &e) == PD_EINVAL);
    o.ngram_min = 1;
    o.num_speculative_tokens = PD_SPEC_MAX_K + 1;
    CHECK(pd_runtime_open(&rt, &o, on_event, NULL, &e) == PD_EINVAL);
    o.num_speculative_tokens = 4;
    o.speculative_method = "medusa";
    CHECK(pd_runtime_open(&rt, &o, on_event, NULL, &e) == PD_EINVAL);
    CHECKF(strstr(e.msg, "medusa"), "%s", e.msg);
    o.speculative_method = "draft";
    CHECK(pd_runtime_open(&rt, &o, on_event, NULL, &e) == PD_EINVAL);
  }
  return pd_test_finish("test_spec");
}
