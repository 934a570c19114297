/* The continuous-batching scheduler on the bundled pycoder-12m model:
 *   - 64 prompts of 1..1000 tokens in one run give the greedy ids each gives alone;
 *   - the same with a KV cache so small that preemption happens (and is seen to);
 *   - seeded sampling does not depend on what else is in the batch;
 *   - a shared system prompt gives prefix-cache hits and unchanged outputs;
 *   - n > 1 forks share the prompt's blocks; abort at any point frees everything;
 *   - no block is leaked at the end of any run (pool invariants checked). */
#include <math.h>
#include <string.h>

#include "pd/runtime.h"
#include "pd_test.h"

/* Under a sanitizer everything runs 3-10x slower: the same checks on a smaller workload
 * (16 prompts of 1..300 tokens instead of 64 of 1..1000). */
#if defined(__SANITIZE_ADDRESS__) || defined(PD_SANITIZED)
#define SCALE_N 16
#define SCALE_LEN 300
#else
#define SCALE_N 64
#define SCALE_LEN 1000
#endif

#define MAX_REQ 80
#define MAX_OUT 64

typedef struct out {
  int32_t ids[8][MAX_OUT];
  float gap[8][MAX_OUT]; /* top-1 minus top-2 logprob of each step (from logprobs) */
  int n[8];
  pd_finish_reason fin[8];
  int cached;
} out;

typedef struct ctx {
  out o[MAX_REQ];
  int abort_after; /* abort request abort_id after this many of its tokens (-1 = never) */
  uint64_t abort_id;
  pd_sched *sched;
} ctx;

static void on_event(void *user, const pd_sched_event *ev) {
  ctx *c = user;
  out *o = &c->o[ev->id];
  o->cached = ev->num_cached_tokens;
  if (ev->token >= 0 && o->n[ev->index] < MAX_OUT) {
    int k = o->n[ev->index]++;
    o->ids[ev->index][k] = ev->token;
    o->gap[ev->index][k] = ev->logprobs && ev->logprobs->n_top >= 2
                               ? ev->logprobs->top[0].logprob - ev->logprobs->top[1].logprob
                               : INFINITY;
  }
  o->fin[ev->index] = ev->finish;
  if (ev->id == c->abort_id && c->abort_after >= 0 && o->n[ev->index] == c->abort_after)
    CHECK(pd_sched_abort(c->sched, ev->id) == PD_OK);
}

static int g_decode_prefill; /* pd_runtime_opts.decode_prefill_tokens of open_rt */

static void open_rt(pd_runtime *rt, ctx *c, int kv_tokens, int max_batch, bool prefix) {
  pd_runtime_opts o;
  pd_runtime_opts_default(&o);
  o.decode_prefill_tokens = g_decode_prefill;
  o.model_dir = PD_TEST_DATA "/models/pycoder-12m";
  o.kv_cache_tokens = kv_tokens;
  o.max_batch_tokens = max_batch;
  o.max_seqs = 64;
  o.no_prefix_cache = !prefix;
  pd_err e = {0};
  if (pd_runtime_open(rt, &o, on_event, c, &e) != PD_OK) {
    fprintf(stderr, "runtime: %s\n", e.msg);
    exit(1);
  }
  memset(c, 0, sizeof *c);
  c->abort_after = -1;
  c->sched = rt->sched;
}

static void run_all(pd_runtime *rt) {
  pd_err e = {0};
  int guard = 0;
  while (pd_sched_has_work(rt->sched)) {
    if (pd_sched_step(rt->sched, &e) != PD_OK) {
      fprintf(stderr, "step: %s\n", e.msg);
      exit(1);
    }
    REQUIRE(++guard < 100000);
  }
}

/* The pool is empty and consistent once everything has finished. */
static void check_no_leak(pd_runtime *rt) {
  pd_kv_stats st;
  pd_kv_pool_stats(rt->pool, &st);
  CHECKF(st.used == 0 && st.num_seqs == 0, "%d blocks in use, %d sequences alive", st.used,
         st.num_seqs);
  pd_err e = {0};
  CHECKF(pd_kv_pool_check(rt->pool, &e) == PD_OK, "%s", e.msg);
}

static pd_sampling_params greedy(int max_tokens) {
  pd_sampling_params p;
  pd_sampling_params_init(&p);
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.logprobs = 2;
  return p;
}

/* Prompt i: a slice of real Python-ish text tokens, 1..1000 tokens long. */
static int32_t corpus[4096];
static int corpus_n;

static void make_corpus(pd_runtime *rt) {
  const char *src =
      "import os\nimport sys\n\n\nclass Config(object):\n    \"\"\"Holds settings.\"\"\"\n\n"
      "    def __init__(self, path, verbose=False):\n        self.path = path\n"
      "        self.verbose = verbose\n        self.values = {}\n\n    def load(self):\n"
      "        with open(self.path) as f:\n            for line in f:\n"
      "                key, _, value = line.partition('=')\n"
      "                self.values[key.strip()] = value.strip()\n        return self.values\n\n";
  char buf[16384] = "";
  while (strlen(buf) + strlen(src) < sizeof buf) strcat(buf, src);
  int32_t *ids;
  size_t n;
  pd_err e = {0};
  REQUIRE(pd_tokenizer_encode(rt->tok, buf, strlen(buf), false, &ids, &n, &e) == PD_OK);
  REQUIRE(n > 1100);
  corpus_n = n > 4096 ? 4096 : (int)n;
  memcpy(corpus, ids, (size_t)corpus_n * sizeof *ids);
  free(ids);
}

static int prompt_len(int i) { return i == 0 ? 1 : (i * 997) % SCALE_LEN + 1; }
static const int32_t *prompt_of(int i) { return corpus + (i * 37) % 100; }

/* Greedy ids agree up to the first step where either run saw a near-tie. */
static void compare_greedy(const out *a, const out *b, int idx, const char *what) {
  int n = a->n[0] < b->n[0] ? a->n[0] : b->n[0];
  CHECKF(a->n[0] == b->n[0], "%s: request %d produced %d vs %d tokens", what, idx, a->n[0],
         b->n[0]);
  for (int t = 0; t < n; t++) {
    if (a->ids[0][t] != b->ids[0][t]) {
      CHECKF(a->gap[0][t] < 1e-3f || b->gap[0][t] < 1e-3f,
             "%s: request %d step %d: %d vs %d (gap %.3g)", what, idx, t, a->ids[0][t],
             b->ids[0][t], a->gap[0][t]);
      return;
    }
    if (a->gap[0][t] < 1e-3f) return;
  }
}

int main(void) {
  static ctx alone_c, c;
  pd_runtime rt;
  pd_err e = {0};
  enum { N = SCALE_N, GEN = 8 };

  /* 1. each prompt alone (no prefix cache) */
  open_rt(&rt, &alone_c, 4096, 512, false);
  make_corpus(&rt);
  static out alone[N];
  for (int i = 0; i < N; i++) {
    pd_sampling_params p = greedy(GEN);
    REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, prompt_of(i), prompt_len(i), &p, &e) == PD_OK);
    run_all(&rt);
    alone[i] = alone_c.o[i];
    CHECK(alone[i].n[0] == GEN && alone[i].fin[0] == PD_FINISH_LENGTH);
  }
  check_no_leak(&rt);
  pd_runtime_close(&rt);

  /* 2. all 64 together, big cache; 3. all together in a cache that forces preemption */
  int caches[2] = {64 * 1024, SCALE_LEN + SCALE_LEN / 2 + 36};
  for (int k = 0; k < 2; k++) {
    open_rt(&rt, &c, caches[k], 512, true);
    for (int i = 0; i < N; i++) {
      pd_sampling_params p = greedy(GEN);
      REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, prompt_of(i), prompt_len(i), &p, &e) == PD_OK);
    }
    run_all(&rt);
    pd_sched_stats ss;
    pd_sched_get_stats(rt.sched, &ss);
    printf("batched run, cache %d tokens: %llu steps, %llu preemptions, %llu cached prompt "
           "tokens\n",
           caches[k], (unsigned long long)ss.steps, (unsigned long long)ss.preemptions,
           (unsigned long long)ss.cached_prompt_tokens);
    CHECK(ss.steps < (uint64_t)N * (GEN + 2)); /* batching happened */
    if (k == 1) CHECKF(ss.preemptions > 0, "the small cache did not preempt");
    for (int i = 0; i < N; i++) compare_greedy(&alone[i], &c.o[i], i, k ? "preempted" : "batched");
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }

  /* 4. seeded sampling is independent of batch composition */
  {
    static out solo;
    pd_sampling_params p;
    pd_sampling_params_init(&p);
    p.temperature = 0.9f;
    p.top_p = 0.95f;
    p.seed = 1234;
    p.has_seed = true;
    p.max_tokens = 24;
    p.ignore_eos = true;
    open_rt(&rt, &c, 16384, 512, true);
    REQUIRE(pd_sched_add(rt.sched, 0, prompt_of(3), 40, &p, &e) == PD_OK);
    run_all(&rt);
    solo = c.o[0];
    pd_runtime_close(&rt);
    open_rt(&rt, &c, 16384, 512, true);
    for (int i = 1; i < 12; i++) {
      pd_sampling_params q = p;
      q.seed = 99 + (uint64_t)i;
      /* requests 1 and 2 share the seeded request's prompt but not its seed */
      const int32_t *pr = i <= 2 ? prompt_of(3) : prompt_of(i);
      int len = i <= 2 ? 40 : prompt_len(i) % 300 + 1;
      REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, pr, len, &q, &e) == PD_OK);
    }
    pd_sched_step(rt.sched, &e); /* the seeded request joins a batch already under way */
    REQUIRE(pd_sched_add(rt.sched, 0, prompt_of(3), 40, &p, &e) == PD_OK);
    run_all(&rt);
    CHECK(c.o[0].n[0] == 24);
    CHECKF(memcmp(solo.ids[0], c.o[0].ids[0], 24 * sizeof(int32_t)) == 0,
           "seeded sample changed with the batch");
    /* and different seeds give different continuations */
    CHECK(memcmp(c.o[1].ids[0], c.o[2].ids[0], 24 * sizeof(int32_t)) != 0);
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }

  /* 5. shared system prompt: prefix-cache hits, outputs unchanged */
  {
    static out ref[8];
    int32_t prompts[8][400];
    for (int i = 0; i < 8; i++) {
      memcpy(prompts[i], corpus, 300 * sizeof(int32_t)); /* the shared part */
      memcpy(prompts[i] + 300, corpus + 500 + 13 * i, 50 * sizeof(int32_t));
    }
    for (int pass = 0; pass < 2; pass++) {
      open_rt(&rt, &c, 16384, 512, pass == 1);
      for (int i = 0; i < 8; i++) {
        pd_sampling_params p = greedy(GEN);
        REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, prompts[i], 350, &p, &e) == PD_OK);
        run_all(&rt); /* one after the other, so later ones find the shared blocks */
      }
      pd_kv_stats ks;
      pd_kv_pool_stats(rt.pool, &ks);
      if (pass == 0) {
        CHECK(ks.prefix_hits == 0);
        memcpy(ref, c.o, sizeof ref);
      } else {
        printf("prefix cache: %llu of %llu prompt tokens hit\n",
               (unsigned long long)ks.prefix_hits, (unsigned long long)ks.prefix_queries);
        CHECK(ks.prefix_hits >= 7 * 288); /* 18 full blocks of 16 for each later request */
        for (int i = 1; i < 8; i++) CHECK(c.o[i].cached >= 288);
        for (int i = 0; i < 8; i++) compare_greedy(&ref[i], &c.o[i], i, "prefix-cached");
      }
      check_no_leak(&rt);
      pd_runtime_close(&rt);
    }
  }

  /* 6. n > 1: greedy samples are equal; seeded ones differ; forks share the prompt blocks */
  {
    open_rt(&rt, &c, 16384, 512, true);
    pd_sampling_params p = greedy(6);
    p.n = 4;
    REQUIRE(pd_sched_add(rt.sched, 0, prompt_of(5), 100, &p, &e) == PD_OK);
    pd_sampling_params q;
    pd_sampling_params_init(&q);
    q.n = 5;
    q.seed = 7;
    q.has_seed = true;
    q.max_tokens = 12;
    q.ignore_eos = true;
    REQUIRE(pd_sched_add(rt.sched, 1, prompt_of(6), 100, &q, &e) == PD_OK);
    pd_sched_step(rt.sched, &e); /* prefill of both, forks made */
    pd_kv_stats ks;
    pd_kv_pool_stats(rt.pool, &ks);
    /* 9 sequences of 100 tokens: unshared they would take 9 * 7 blocks */
    CHECKF(ks.used <= 2 * 7 + 7, "forks did not share blocks: %d in use", ks.used);
    run_all(&rt);
    for (int k = 0; k < 4; k++) {
      CHECK(c.o[0].n[k] == 6);
      CHECK(memcmp(c.o[0].ids[0], c.o[0].ids[k], 6 * sizeof(int32_t)) == 0);
    }
    int distinct = 0;
    for (int k = 1; k < 5; k++) {
      CHECK(c.o[1].n[k] == 12);
      distinct += memcmp(c.o[1].ids[0], c.o[1].ids[k], 12 * sizeof(int32_t)) != 0;
    }
    CHECK(distinct >= 3);
    pd_sched_stats ss;
    pd_sched_get_stats(rt.sched, &ss);
    CHECK(ss.forks == 3 + 4);
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }

  /* 7. abort at every stage: waiting, mid-prefill, decoding, from inside the callback */
  {
    open_rt(&rt, &c, 8192, 64, true);
    for (int i = 0; i < 6; i++) {
      pd_sampling_params p = greedy(30);
      p.n = i == 2 ? 3 : 1;
      REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, prompt_of(i), 200, &p, &e) == PD_OK);
    }
    CHECK(pd_sched_abort(rt.sched, 5) == PD_OK); /* still waiting */
    pd_sched_step(rt.sched, &e);                  /* request 0 is mid-prefill (64 of 200) */
    CHECK(pd_sched_abort(rt.sched, 0) == PD_OK);
    c.abort_id = 3;
    c.abort_after = 4; /* aborted by its own event callback while decoding */
    for (int s = 0; s < 20; s++) pd_sched_step(rt.sched, &e);
    CHECK(pd_sched_abort(rt.sched, 2) == PD_OK); /* n = 3, forked, decoding */
    CHECK(pd_sched_abort(rt.sched, 42) == PD_ENOTFOUND);
    run_all(&rt);
    CHECK(c.o[0].n[0] == 0 && c.o[5].n[0] == 0);
    CHECK(c.o[3].n[0] == 4);
    CHECK(c.o[1].n[0] == 30 && c.o[4].n[0] == 30);
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }

  /* 8. admission control */
  {
    open_rt(&rt, &c, 256, 64, true);
    pd_sampling_params p = greedy(100);
    CHECK(pd_sched_add(rt.sched, 0, corpus, 200, &p, &e) == PD_ERANGE); /* > pool */
    p.max_tokens = 10;
    CHECK(pd_sched_add(rt.sched, 1, corpus, 0, &p, &e) == PD_EINVAL);
    int32_t bad = 5000;
    CHECK(pd_sched_add(rt.sched, 2, &bad, 1, &p, &e) == PD_EINVAL);
    p.temperature = -1;
    CHECK(pd_sched_add(rt.sched, 3, corpus, 5, &p, &e) == PD_EINVAL);
    p.temperature = 0;
    p.max_tokens = 2000;
    CHECK(pd_sched_add(rt.sched, 4, corpus, 100, &p, &e) == PD_ERANGE); /* > context */
    p.max_tokens = 5;
    CHECK(pd_sched_add(rt.sched, 5, corpus, 10, &p, &e) == PD_OK);
    CHECK(pd_sched_add(rt.sched, 5, corpus, 10, &p, &e) == PD_EINVAL); /* duplicate id */
    run_all(&rt);
    CHECK(c.o[5].n[0] == 5);
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }

  /* 9. steps in two halves (pd_sched_step_begin / _end, as the decode node runs them): requests
   * added and aborted while a step is in flight; the others' outputs are the ones alone */
  {
    open_rt(&rt, &c, 64 * 1024, 512, true);
    enum { H = N < 12 ? N : 12 };
    for (int i = 0; i < H / 2; i++) {
      pd_sampling_params p = greedy(GEN);
      REQUIRE(pd_sched_add(rt.sched, (uint64_t)i, prompt_of(i), prompt_len(i), &p, &e) == PD_OK);
    }
    int next = H / 2, guard = 0;
    bool aborted_running = false, aborted_waiting = false;
    while (pd_sched_has_work(rt.sched) || pd_sched_step_in_flight(rt.sched)) {
      bool started = false;
      REQUIRE(pd_sched_step_begin(rt.sched, &started, &e) == PD_OK);
      CHECK(pd_sched_step_in_flight(rt.sched) == started);
      /* the host's own work while the step runs */
      if (next < H) {
        pd_sampling_params p = greedy(GEN);
        REQUIRE(pd_sched_add(rt.sched, (uint64_t)next, prompt_of(next), prompt_len(next), &p,
                             &e) == PD_OK);
        next++;
      }
      if (!aborted_running && c.o[1].n[0] >= 2) { /* decoding, in this very step */
        CHECK(pd_sched_abort(rt.sched, 1) == PD_OK);
        CHECK(pd_sched_abort(rt.sched, 1) == PD_ENOTFOUND); /* once */
        aborted_running = true;
      }
      if (!aborted_waiting && next == H) { /* just added: still waiting */
        CHECK(pd_sched_abort(rt.sched, (uint64_t)H - 1) == PD_OK);
        aborted_waiting = true;
      }
      if (started) REQUIRE(pd_sched_step_end(rt.sched, &e) == PD_OK);
      CHECK(!pd_sched_step_in_flight(rt.sched));
      REQUIRE(++guard < 10000);
    }
    CHECK(aborted_running && aborted_waiting);
    CHECK(c.o[1].n[0] >= 2 && c.o[1].n[0] < GEN);
    CHECK(c.o[H - 1].n[0] == 0);
    for (int i = 0; i < H - 1; i++)
      if (i != 1) compare_greedy(&alone[i], &c.o[i], i, "two-half steps");
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }
  /* 10. decode_prefill_tokens: while a sequence decodes, a 300-token prompt enters in chunks of
   * at most 32 tokens a step (the decode row beside them); alone, it takes one step; the
   * greedy outputs are those of the uncapped runs */
  for (int cap = 0; cap <= 32; cap += 32) {
    g_decode_prefill = cap;
    open_rt(&rt, &c, 64 * 1024, 512, false);
    pd_sampling_params p = greedy(40);
    REQUIRE(pd_sched_add(rt.sched, 0, prompt_of(1), 5, &p, &e) == PD_OK);
    for (int k = 0; k < 3; k++) REQUIRE(pd_sched_step(rt.sched, &e) == PD_OK);
    pd_sampling_params p2 = greedy(GEN);
    REQUIRE(pd_sched_add(rt.sched, 1, prompt_of(2), 300, &p2, &e) == PD_OK);
    pd_sched_stats a, b;
    pd_sched_get_stats(rt.sched, &a);
    REQUIRE(pd_sched_step(rt.sched, &e) == PD_OK);
    pd_sched_get_stats(rt.sched, &b);
    const uint64_t took = b.batched_tokens - a.batched_tokens;
    CHECKF(took == (cap ? 1u + 32u : 1u + 300u), "cap %d: a step took %llu tokens", cap,
           (unsigned long long)took);
    int steps = 1;
    while (c.o[1].n[0] == 0 && steps < 100) {
      REQUIRE(pd_sched_step(rt.sched, &e) == PD_OK);
      steps++;
    }
    CHECKF(steps == (cap ? 10 : 1), "cap %d: the prompt's first token after %d steps", cap, steps);
    run_all(&rt);
    static out ref[2];
    if (!cap) {
      ref[0] = c.o[0];
      ref[1] = c.o[1];
    } else {
      compare_greedy(&ref[0], &c.o[0], 0, "decode-prefill cap");
      compare_greedy(&ref[1], &c.o[1], 1, "decode-prefill cap");
    }
    check_no_leak(&rt);
    pd_runtime_close(&rt);
  }
  g_decode_prefill = 0;
  return pd_test_finish("test_sched");
}
