/* Decode graphs under the load a decode node sees: sequences arrive with their prompts already
 * in the cache and leave at any time, so the batch grows and shrinks through every recorded
 * size, and block tables of every width come and go. Each step runs on an engine that replays
 * graphs and on an eager one (same backend, same tokens); their logits must agree within the
 * bf16 tolerance of tests/data/golden/README.md (relative 2e-2, no argmax flip beyond twice the
 * logit error) at every step, and the backend must report no failure.
 *
 * A shape is recorded the second time it runs and replayed from the third.
 * The schedule is chosen so that a graph recorded early is replayed after later, larger batches
 * have run eagerly for the first time: that is when scratch a graph recorded used to be freed and
 * reallocated under it (the decode node's illegal address under serving load: a replay wrote
 * into memory freed and handed to the KV staging or sampling buffers, whose kernels then read
 * corrupted tables). Here each phase allocates a device buffer filled with a known pattern (a
 * canary, as the staging and sampling buffers are allocations made between steps) and every
 * canary must be intact after every step: a replay that writes into freed scratch lands in one.
 * Contexts include
 * one, 130, 260, 520 and 1030 tokens, so tables of 8 to 128 blocks are recorded; batch sizes walk
 * every bucket up to the largest batch.
 *
 * Then steps of a few tokens a sequence, as speculative verification and a draft's catch-up run
 * them (1 to 5 tokens each, ragged, padded to a recorded shape of sequences and rows): with the
 * logits of every row, and of each sequence's last row only.
 *
 * Usage: test_cuda_graph_shapes [MODEL_DIR] [short]: the model (default: pycoder-12m of the test
 * data, $PD_TEST_DATA_DIR if set) and, with `short`, 24 sequences of up to 12 tokens (one of
 * 130) and fewer steps (for compute-sanitizer). Exits 77 without a CUDA device. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pd/backend_cuda.h"
#include "pd/engine.h"
#include "pd/model.h"
#include "golden_util.h"
#include "pd_test.h"

#define BS 16

typedef struct seq {
  int n_prompt, ctx, blocks0, n_blocks; /* its blocks: [blocks0, blocks0 + n_blocks) */
  int32_t last;                         /* the token to feed next */
} seq;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)(rng >> 11);
}

typedef struct pair {
  pd_engine *g, *e; /* graphs, eager */
  int V;
  float *lg, *le;   /* [max_seqs, V] */
  double worst;
  int steps, rows;
} pair;

static void run(pair *p, const pd_batch *b) {
  pd_err e = {0};
  if (pd_engine_forward(p->g, b, p->lg, &e) != PD_OK) {
    fprintf(stderr, "graph engine: %s\n", e.msg);
    exit(1);
  }
  if (pd_engine_forward(p->e, b, p->le, &e) != PD_OK) {
    fprintf(stderr, "eager engine: %s\n", e.msg);
    exit(1);
  }
}

/* Compares the n rows of the last run; returns the number of bad rows. */
static int compare(pair *p, int n, const char *what) {
  int bad = 0;
  for (int i = 0; i < n; i++) {
    const float *g = p->lg + (size_t)i * p->V, *e = p->le + (size_t)i * p->V;
    double abs_err, err = rel_err(g, e, p->V, &abs_err);
    float gap;
    int ae = argmax(e, p->V, &gap);
    bool flip = argmax(g, p->V, NULL) != ae && gap > 2 * abs_err;
    if (!(err < 2e-2) || flip) {
      if (bad < 3)
        fprintf(stderr, "%s: row %d of %d: graph vs eager logits differ by %.3g%s\n", what, i, n,
                err, flip ? " (argmax flipped)" : "");
      bad++;
    }
    if (err > p->worst) p->worst = err;
  }
  p->rows += n;
  return bad;
}

/* Puts sequence s's prompt into the cache, alone, two tokens a step: a decode node receives
 * its caches whole and never runs a long forward, so nothing here may size the backend's
 * scratch for more rows than a decode batch has (two rows run on the GEMV path; a one-token
 * step, the last of an odd prompt, is a graph replay of batch 1). */
static void prefill(pair *p, seq *q, const int32_t *bt) {
  for (int off = 0; off < q->n_prompt; off += 2) {
    const int n = q->n_prompt - off < 2 ? q->n_prompt - off : 2;
    int32_t tok[2], pos[2], slots[2], rows[2] = {0, 1};
    for (int i = 0; i < n; i++) {
      tok[i] = (int32_t)(rnd() % (uint32_t)p->V);
      pos[i] = off + i;
      slots[i] = bt[(off + i) / BS] * BS + (off + i) % BS;
    }
    int32_t qs[2] = {0, n}, ctx = off + n;
    pd_batch b = {.n_tokens = n, .tokens = tok, .positions = pos, .slots = slots, .n_seqs = 1,
                  .q_start = qs, .ctx_len = &ctx, .block_tables = bt,
                  .max_blocks = (ctx + BS - 1) / BS, .n_logits = n, .logit_rows = rows};
    run(p, &b);
    CHECK(compare(p, n, "prefill") == 0);
    q->ctx = ctx;
    q->last = argmax(p->lg + (size_t)(n - 1) * p->V, p->V, NULL);
  }
}

int main(int argc, char **argv) {
  if (pd_cuda_device_count() == 0) {
    printf("test_cuda_graph_shapes: no CUDA device, skipped\n");
    return 77;
  }
  const char *data = getenv("PD_TEST_DATA_DIR");
  if (!data || !*data) data = PD_TEST_DATA;
  char mdir[2048];
  snprintf(mdir, sizeof mdir, "%s/models/pycoder-12m", data);
  bool is_short = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "short")) is_short = true;
    else snprintf(mdir, sizeof mdir, "%s", argv[i]);
  }
  /* batch sizes of the schedule (every recorded bucket up to S, then smaller ones again) */
  static const int sched_full[] = {1,   2,   3,  4,   6,   8,  12, 16, 20, 24,  32, 40, 48,
                                   56,  64,  80, 96,  112, 128, 160, 192, 224, 256, 7, 1,
                                   33,  256, 2,  100, 16, 250, 3,  64, 1,  180, 9};
  static const int sched_short[] = {1, 2, 3, 4, 8, 12, 16, 24, 5, 1, 17, 24, 2, 20, 1};
  const int *sched = is_short ? sched_short : sched_full;
  const int n_sched = is_short ? (int)(sizeof sched_short / sizeof *sched_short)
                               : (int)(sizeof sched_full / sizeof *sched_full);
  const int S = is_short ? 24 : 256;
  const int prompt_span = is_short ? 12 : 48; /* short prompts: 1..prompt_span tokens */
  const int STEPS = 3; /* decode steps per phase (a shape is recorded the second time) */
  /* multi-token steps: batch sizes, and at most VQ tokens a sequence */
  static const int vsched_full[] = {1, 2, 4, 7, 16, 33, 64, 100, 200, 3, 64};
  static const int vsched_short[] = {1, 2, 5, 12, 3};
  const int *vsched = is_short ? vsched_short : vsched_full;
  const int n_vsched = is_short ? (int)(sizeof vsched_short / sizeof *vsched_short)
                                : (int)(sizeof vsched_full / sizeof *vsched_full);
  enum { VQ = 5, VSTEPS = 4 }; /* a phase's steps keep each sequence's token count */
  static const int long_prompts[] = {130, 260, 520, 1030};

  pd_err e = {0};
  pd_model *m = pd_model_load(mdir, NULL, &e);
  if (!m) {
    fprintf(stderr, "load %s: %s\n", mdir, e.msg);
    return 1;
  }
  const int V = m->cfg.vocab_size;
  const int max_ctx = 1030 + n_sched * STEPS + n_vsched * VSTEPS * VQ + 1;
  REQUIRE(m->cfg.max_position_embeddings >= max_ctx);
  seq *q = calloc((size_t)S, sizeof *q);
  REQUIRE(q);
  int total_blocks = 0, max_blocks = 0;
  for (int s = 0; s < S; s++) {
    /* four long prompts spread over the batch; the rest 1..48 tokens */
    q[s].n_prompt =
        s % 61 == 7 && s / 61 < 4 ? long_prompts[s / 61] : 1 + (s * 37) % prompt_span;
    q[s].blocks0 = total_blocks;
    q[s].n_blocks = (q[s].n_prompt + n_sched * STEPS + n_vsched * VSTEPS * VQ + BS) / BS;
    total_blocks += q[s].n_blocks;
    if (q[s].n_blocks > max_blocks) max_blocks = q[s].n_blocks;
  }
  pd_backend *be = pd_backend_cuda_create(NULL, &e);
  if (!be) {
    fprintf(stderr, "cuda backend: %s\n", e.msg);
    return 1;
  }
  pd_engine_opts o;
  pd_engine_opts_default(&o);
  o.block_size = BS;
  o.max_model_len = max_blocks * BS;
  o.num_blocks = total_blocks;
  o.max_batch_tokens = 2048;
  o.max_seqs = S;
  o.kv_dtype = PD_DTYPE_BF16;
  pair p = {.V = V};
  p.g = pd_engine_create(m, be, &o, &e);
  o.enforce_eager = true;
  p.e = p.g ? pd_engine_create(m, be, &o, &e) : NULL;
  if (!p.g || !p.e) {
    fprintf(stderr, "engine: %s\n", e.msg);
    return 1;
  }
  p.lg = malloc((size_t)S * VQ * V * sizeof(float));
  p.le = malloc((size_t)S * VQ * V * sizeof(float));
  int32_t *tables = malloc((size_t)S * max_blocks * 4);
  REQUIRE(p.lg && p.le && tables);
  /* sequence s owns blocks [blocks0, blocks0 + n_blocks), in a shuffled order */
  int32_t *own = malloc((size_t)max_blocks * 4);
  REQUIRE(own);

  /* the prompts' caches, sequence by sequence */
  for (int s = 0; s < S; s++) {
    for (int i = 0; i < q[s].n_blocks; i++)
      own[i] = q[s].blocks0 + (i * 37 + s) % q[s].n_blocks;
    memcpy(tables + (size_t)s * max_blocks, own, (size_t)q[s].n_blocks * 4);
    prefill(&p, &q[s], tables + (size_t)s * max_blocks);
  }
  free(own);

  int32_t *tok = malloc((size_t)S * VQ * 4), *pos = malloc((size_t)S * VQ * 4),
          *slots = malloc((size_t)S * VQ * 4);
  int32_t *qs = malloc((size_t)(S + 1) * 4), *ctx = malloc((size_t)S * 4),
          *rows = malloc((size_t)S * VQ * 4), *bt = malloc((size_t)S * max_blocks * 4);
  int *which = malloc((size_t)S * sizeof *which), *nqs = malloc((size_t)S * sizeof *nqs);
  REQUIRE(tok && pos && slots && qs && ctx && rows && bt && which && nqs);
  int bad = 0, phase_first = 0, bad_canaries = 0;
  enum { MAX_CANARIES = 3 * 40 };
  void *canary[MAX_CANARIES];
  size_t canary_bytes[MAX_CANARIES];
  int n_canary = 0;
  const size_t max_canary = (size_t)2 << 20;
  uint32_t *pattern = malloc(max_canary), *back = malloc(max_canary);
  REQUIRE(pattern && back);
  for (size_t i = 0; i < max_canary / 4; i++)
    pattern[i] = 0xC0DE0000u ^ (uint32_t)(i * 2654435761u);
  for (int ph = 0; ph < n_sched; ph++) {
    const int n = sched[ph] < S ? sched[ph] : S;
    /* canaries: allocations made between steps, as the KV staging and sampling buffers are
     * (of a few sizes, so that memory freed under a graph is likely to be handed to one) */
    for (int k = 0; k < 3; k++) {
      REQUIRE(n_canary < MAX_CANARIES);
      canary_bytes[n_canary] =
          k == 0 ? ((size_t)64 << 10) << (ph % 6) : k == 1 ? (size_t)192 << 10 : (size_t)1 << 20;
      canary[n_canary] = be->ops.alloc(be, canary_bytes[n_canary]);
      REQUIRE(canary[n_canary]);
      be->ops.to_device(be, canary[n_canary], pattern, canary_bytes[n_canary]);
      n_canary++;
    }
    /* a window of n sequences starting at a moving offset: different contexts (and table
     * widths: the long prompts come and go) at each visit of a size */
    phase_first = (phase_first + 53) % S;
    for (int i = 0; i < n; i++) which[i] = (phase_first + i) % S;
    for (int st = 0; st < STEPS; st++) {
      int mb = 1;
      for (int i = 0; i < n; i++) {
        seq *x = &q[which[i]];
        const int32_t *t = tables + (size_t)which[i] * max_blocks;
        tok[i] = x->last;
        pos[i] = x->ctx;
        slots[i] = t[x->ctx / BS] * BS + x->ctx % BS;
        ctx[i] = x->ctx + 1;
        qs[i] = i;
        rows[i] = i;
        int used = (ctx[i] + BS - 1) / BS;
        if (used > mb) mb = used;
      }
      qs[n] = n;
      for (int i = 0; i < n; i++)
        memcpy(bt + (size_t)i * mb, tables + (size_t)which[i] * max_blocks, (size_t)mb * 4);
      pd_batch b = {.n_tokens = n, .tokens = tok, .positions = pos, .slots = slots, .n_seqs = n,
                    .q_start = qs, .ctx_len = ctx, .block_tables = bt, .max_blocks = mb,
                    .n_logits = n, .logit_rows = rows};
      run(&p, &b);
      char what[96];
      snprintf(what, sizeof what, "phase %d (%d sequences, %d-block tables) step %d", ph, n, mb,
               st);
      int nb = compare(&p, n, what);
      CHECKF(nb == 0, "%s: %d rows differ", what, nb);
      bad += nb;
      p.steps++;
      for (int i = 0; i < n; i++) {
        q[which[i]].ctx++;
        q[which[i]].last = argmax(p.lg + (size_t)i * V, V, NULL);
      }
    }
    for (int c = 0; c < n_canary; c++) {
      be->ops.to_host(be, back, canary[c], canary_bytes[c]);
      if (memcmp(back, pattern, canary_bytes[c]) != 0) {
        CHECKF(0, "after phase %d (%d sequences): a %zu-byte buffer allocated at phase %d was "
               "overwritten", ph, n, canary_bytes[c], c / 3);
        bad_canaries++;
        be->ops.to_device(be, canary[c], pattern, canary_bytes[c]); /* report it once */
      }
    }
  }
  uint64_t replays_decode = 0;
  pd_engine_graph_stats(p.g, &replays_decode, NULL);
  const int steps_decode = p.steps;
  /* steps of 1..VQ tokens a sequence; even phases ask for every row's logits (verification),
   * odd ones for each sequence's last row (a draft catching up) */
  for (int ph = 0; ph < n_vsched; ph++) {
    const int n = vsched[ph] < S ? vsched[ph] : S;
    const bool every_row = ph % 2 == 0;
    phase_first = (phase_first + 29) % S;
    for (int i = 0; i < n; i++) which[i] = (phase_first + i) % S;
    for (int i = 0; i < n; i++) nqs[i] = 1 + (int)(rnd() % VQ);
    for (int st = 0; st < VSTEPS; st++) {
      int mb = 1, M = 0, nl = 0;
      for (int i = 0; i < n; i++) {
        seq *x = &q[which[i]];
        const int32_t *t = tables + (size_t)which[i] * max_blocks;
        const int nq = nqs[i];
        qs[i] = M;
        for (int j = 0; j < nq; j++, M++) {
          tok[M] = j == 0 ? x->last : (int32_t)(rnd() % (uint32_t)V);
          pos[M] = x->ctx + j;
          slots[M] = t[(x->ctx + j) / BS] * BS + (x->ctx + j) % BS;
          if (every_row || j == nq - 1) rows[nl++] = M;
        }
        ctx[i] = x->ctx + nq;
        int used = (ctx[i] + BS - 1) / BS;
        if (used > mb) mb = used;
      }
      qs[n] = M;
      for (int i = 0; i < n; i++)
        memcpy(bt + (size_t)i * mb, tables + (size_t)which[i] * max_blocks, (size_t)mb * 4);
      pd_batch b = {.n_tokens = M, .tokens = tok, .positions = pos, .slots = slots, .n_seqs = n,
                    .q_start = qs, .ctx_len = ctx, .block_tables = bt, .max_blocks = mb,
                    .n_logits = nl, .logit_rows = rows};
      run(&p, &b);
      char what[128];
      snprintf(what, sizeof what, "multi-token phase %d (%d sequences, %d rows, %s) step %d", ph,
               n, M, every_row ? "every row" : "last rows", st);
      int nb = compare(&p, nl, what);
      CHECKF(nb == 0, "%s: %d rows differ", what, nb);
      bad += nb;
      p.steps++;
      for (int i = 0; i < n; i++) {
        q[which[i]].ctx = ctx[i];
        const int last = every_row ? qs[i + 1] - 1 : i;
        q[which[i]].last = argmax(p.lg + (size_t)last * V, V, NULL);
      }
    }
  }
  uint64_t replays = 0;
  int n_graphs = 0;
  pd_engine_graph_stats(p.g, &replays, &n_graphs);
  printf("%d multi-token steps: %llu replayed\n", p.steps - steps_decode,
         (unsigned long long)(replays - replays_decode));
  CHECKF(replays - replays_decode >= (uint64_t)(p.steps - steps_decode) / 4,
         "multi-token steps were not replayed: %llu of %d",
         (unsigned long long)(replays - replays_decode), p.steps - steps_decode);
  printf("%d steps over %d sequences (%d rows): %llu replayed from %d graphs; worst "
         "graph-vs-eager logit difference %.2e; %d rows out of tolerance; %d canaries "
         "overwritten\n",
         p.steps, S, p.rows, (unsigned long long)replays, n_graphs, p.worst, bad, bad_canaries);
  CHECKF(replays > (uint64_t)p.steps / 4 && n_graphs >= (is_short ? 6 : 16),
         "graphs were not exercised: %llu replays, %d graphs", (unsigned long long)replays,
         n_graphs);
  CHECKF(pd_backend_cuda_status(be, &e) == PD_OK, "backend status: %s", e.msg);
  for (int i = 0; i < n_canary; i++) be->ops.free(be, canary[i]);
  free(pattern);
  free(back);
  pd_engine_free(p.g);
  pd_engine_free(p.e);
  CHECKF(pd_backend_cuda_status(be, &e) == PD_OK, "backend status after free: %s", e.msg);
  pd_backend_destroy(be);
  pd_model_free(m);
  free(q);
  free(p.lg);
  free(p.le);
  free(tables);
  free(tok);
  free(pos);
  free(slots);
  free(qs);
  free(ctx);
  free(rows);
  free(bt);
  free(which);
  free(nqs);
  if (pd_test_failures) {
    printf("test_cuda_graph_shapes: %d checks failed\n", pd_test_failures);
    return 1;
  }
  printf("test_cuda_graph_shapes: all checks passed\n");
  return 0;
}
