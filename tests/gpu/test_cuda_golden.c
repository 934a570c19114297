/* Golden parity of the forward pass on the CUDA backend with Hugging Face transformers (the
 * float32 references in tests/data/golden/<model>/reference.json), with the bf16 tolerances of
 * tests/data/golden/README.md:
 *   - last-position logits: max|mine - ref| / max|ref| < 3e-2
 *   - argmax at every prompt position where our own top-2 gap exceeds what the logit error could
 *     flip (2x the last-logit absolute error, at least 1e-2); logsumexp within 0.1
 *   - 48 greedy tokens equal up to the first step whose reference top-2 gap is below 0.1
 * for the prompt fed whole through a linear block table and in 13-token chunks through a shuffled
 * one, with an F32 and a BF16 KV cache. Then "a batch equals one-at-a-time": all prompts in one
 * ragged forward followed by batched decode steps give the logits each sequence gives alone.
 *
 * Usage: test_cuda_golden <model-name>. Test data: $PD_TEST_DATA_DIR if set (a copy of
 * tests/data on another machine), else the source tree's. Exits 77 without a CUDA device. */
#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

#include "pd/backend_cuda.h"
#include "pd/engine.h"
#include "pd/model.h"
#include "golden_util.h"
#include "pd_test.h"

#define MAX_CTX GOLDEN_MAX_CTX
#define BS 16
#define MAX_BLOCKS (MAX_CTX / BS)
#define NCASES 6

static void forward_or_die(pd_engine *eng, const pd_batch *b, float *logits) {
  pd_err e = {0};
  if (pd_engine_forward(eng, b, logits, &e) != PD_OK) {
    fprintf(stderr, "forward failed: %s\n", e.msg);
    exit(1);
  }
}

static void run_case(pd_engine *eng, int V, const char *gdir, const cJSON *cs, int chunk,
                     const int32_t *bt, int idx, const char *kvname) {
  int32_t ids[MAX_CTX], greedy_ref[64], argmax_ref[MAX_CTX];
  int n = ints(cJSON_GetObjectItem(cs, "input_ids"), ids, MAX_CTX);
  int ng = ints(cJSON_GetObjectItem(cs, "greedy_ids"), greedy_ref, 64);
  int na = ints(cJSON_GetObjectItem(cs, "argmax_per_position"), argmax_ref, MAX_CTX);
  REQUIRE(na == n);
  const cJSON *lse = cJSON_GetObjectItem(cs, "logsumexp_per_position");
  const cJSON *gaps = cJSON_GetObjectItem(cs, "greedy_top2_gap");
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", gdir,
           cJSON_GetObjectItem(cs, "last_logits_file")->valuestring);
  size_t len = 0;
  float *ref = (float *)pd_test_read_file(path, &len);
  REQUIRE(ref && len == (size_t)V * 4);

  runner r = {eng, V, BS, MAX_BLOCKS, bt, 0};
  float *all = malloc((size_t)n * V * sizeof *all), *last = malloc((size_t)V * sizeof *last);
  REQUIRE(all && last);
  feed(&r, ids, n, chunk, all, last);

  double abs_err;
  double err = rel_err(last, ref, V, &abs_err);
  CHECKF(err < 3e-2, "case %d chunk %d kv %s: last-logit error %.3g", idx, chunk, kvname, err);
  const float flip = abs_err * 2 > 1e-2 ? (float)(abs_err * 2) : 1e-2f;
  int bad_argmax = 0;
  double worst_lse = 0;
  for (int p = 0; p < n; p++) {
    float gap;
    int a = argmax(all + (size_t)p * V, V, &gap);
    if (a != argmax_ref[p] && gap > flip) bad_argmax++;
    double d = fabs(logsumexp(all + (size_t)p * V, V) - cJSON_GetArrayItem(lse, p)->valuedouble);
    if (!(d <= worst_lse)) worst_lse = d;
  }
  CHECKF(bad_argmax == 0, "case %d chunk %d kv %s: %d positions with a different argmax", idx,
         chunk, kvname, bad_argmax);
  CHECKF(worst_lse < 0.1, "case %d chunk %d kv %s: logsumexp off by %.3g", idx, chunk, kvname,
         worst_lse);

  int agree = 0, compared = 0;
  for (int t = 0; t < ng; t++) {
    int tok = argmax(last, V, NULL);
    if (cJSON_GetArrayItem(gaps, t)->valuedouble < 0.1) break;
    compared++;
    if (tok != greedy_ref[t]) {
      CHECKF(0, "case %d chunk %d kv %s: greedy step %d gave %d, reference %d", idx, chunk,
             kvname, t, tok, greedy_ref[t]);
      break;
    }
    agree++;
    int32_t next = greedy_ref[t];
    feed(&r, &next, 1, 1, NULL, last);
  }
  printf("case %d (%3d tokens, chunk %3d, kv %-4s): last-logit rel err %.2e, max lse err %.2e, "
         "greedy %d/%d before the first near-tie\n",
         idx, n, chunk, kvname, err, worst_lse, agree, compared);
  free(all);
  free(last);
  free(ref);
}

/* All prompts in one ragged prefill, then `steps` decode steps of every sequence in one batch;
 * then each sequence alone on the same tokens. Logits must agree within the bf16 tolerance. */
static void batch_vs_single(pd_engine *eng, int V, const cJSON *cases, const int32_t *bts) {
  enum { STEPS = 6 };
  int32_t ids[NCASES][MAX_CTX];
  int n[NCASES], S = 0, T = 0;
  const cJSON *cs;
  cJSON_ArrayForEach(cs, cases) {
    REQUIRE(S < NCASES);
    n[S] = ints(cJSON_GetObjectItem(cs, "input_ids"), ids[S], MAX_CTX);
    T += n[S];
    S++;
  }
  REQUIRE(T <= MAX_CTX);
  int32_t *tok = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *slots = malloc((size_t)T * 4);
  int32_t qs[NCASES + 1], ctx[NCASES], rows[NCASES];
  float *blog = malloc((size_t)(STEPS + 1) * NCASES * V * sizeof(float));
  float *slog = malloc((size_t)V * sizeof(float));
  int32_t chosen[STEPS][NCASES];
  REQUIRE(tok && pos && slots && blog && slog);
  /* batched prefill */
  qs[0] = 0;
  for (int s = 0; s < S; s++) {
    for (int i = 0; i < n[s]; i++) {
      tok[qs[s] + i] = ids[s][i];
      pos[qs[s] + i] = i;
      slots[qs[s] + i] = bts[s * MAX_BLOCKS + i / BS] * BS + i % BS;
    }
    qs[s + 1] = qs[s] + n[s];
    ctx[s] = n[s];
    rows[s] = qs[s + 1] - 1;
  }
  pd_batch b = {.n_tokens = T, .tokens = tok, .positions = pos, .slots = slots, .n_seqs = S,
                .q_start = qs, .ctx_len = ctx, .block_tables = bts, .max_blocks = MAX_BLOCKS,
                .n_logits = S, .logit_rows = rows};
  forward_or_die(eng, &b, blog);
  /* batched decode steps: each sequence takes its own argmax */
  for (int st = 0; st < STEPS; st++) {
    for (int s = 0; s < S; s++) {
      chosen[st][s] = argmax(blog + ((size_t)st * NCASES + s) * V, V, NULL);
      tok[s] = chosen[st][s];
      pos[s] = ctx[s];
      slots[s] = bts[s * MAX_BLOCKS + ctx[s] / BS] * BS + ctx[s] % BS;
      ctx[s]++;
      qs[s + 1] = s + 1;
      rows[s] = s;
    }
    pd_batch d = {.n_tokens = S, .tokens = tok, .positions = pos, .slots = slots, .n_seqs = S,
                  .q_start = qs, .ctx_len = ctx, .block_tables = bts, .max_blocks = MAX_BLOCKS,
                  .n_logits = S, .logit_rows = rows};
    forward_or_die(eng, &d, blog + (size_t)(st + 1) * NCASES * V);
  }
  /* each alone, same blocks (overwritten), same tokens */
  double worst = 0;
  int flips = 0;
  for (int s = 0; s < S; s++) {
    runner r = {eng, V, BS, MAX_BLOCKS, bts + s * MAX_BLOCKS, 0};
    for (int st = 0; st <= STEPS; st++) {
      if (st == 0)
        feed(&r, ids[s], n[s], MAX_CTX, NULL, slog);
      else
        feed(&r, &chosen[st - 1][s], 1, 1, NULL, slog);
      const float *bl = blog + ((size_t)st * NCASES + s) * V;
      double abs_err, e = rel_err(bl, slog, V, &abs_err);
      if (e > worst) worst = e;
      float gap;
      int a = argmax(slog, V, &gap);
      if (a != argmax(bl, V, NULL) && gap > 2 * abs_err) flips++;
      CHECKF(e < 2e-2, "batch vs alone: sequence %d step %d: logits differ by %.3g", s, st, e);
    }
  }
  CHECKF(flips == 0, "batch vs alone: %d argmax flips beyond the logit error", flips);
  printf("batch of %d sequences (%d prompt tokens, %d decode steps) vs one at a time: worst "
         "logit rel diff %.2e\n",
         S, T, STEPS, worst);
  free(tok);
  free(pos);
  free(slots);
  free(blog);
  free(slog);
}

int main(int argc, char **argv) {
  REQUIRE(argc == 2);
  if (pd_cuda_device_count() == 0) {
    printf("test_cuda_golden: no CUDA device, skipped\n");
    return 77;
  }
  const char *data = getenv("PD_TEST_DATA_DIR");
  if (!data || !*data) data = PD_TEST_DATA;
  char mdir[2048], gdir[2048], path[4200];
  snprintf(mdir, sizeof mdir, "%s/models/%s", data, argv[1]);
  snprintf(gdir, sizeof gdir, "%s/golden/%s", data, argv[1]);
  snprintf(path, sizeof path, "%s/reference.json", gdir);
  char *js = pd_test_read_file(path, NULL);
  REQUIRE(js);
  cJSON *root = cJSON_Parse(js);
  REQUIRE(root);

  pd_err e = {0};
  pd_model *m = pd_model_load(mdir, NULL, &e);
  if (!m) {
    fprintf(stderr, "load: %s\n", e.msg);
    return 1;
  }
  pd_backend *be = pd_backend_cuda_create(NULL, &e);
  if (!be) {
    fprintf(stderr, "cuda backend: %s\n", e.msg);
    return 1;
  }
  const int V = m->cfg.vocab_size;
  /* Block tables: sequence s owns blocks [s * MAX_BLOCKS, (s + 1) * MAX_BLOCKS), linear or
   * shuffled (37 is coprime with 64). */
  static int32_t bt_linear[NCASES * MAX_BLOCKS], bt_shuffled[NCASES * MAX_BLOCKS];
  for (int s = 0; s < NCASES; s++)
    for (int i = 0; i < MAX_BLOCKS; i++) {
      bt_linear[s * MAX_BLOCKS + i] = s * MAX_BLOCKS + i;
      bt_shuffled[s * MAX_BLOCKS + i] = s * MAX_BLOCKS + (i * 37 + 11) % MAX_BLOCKS;
    }
  /* F32 and BF16 KV with decode steps replayed as graphs, then BF16 op by op (eager) */
  static const pd_dtype kvs[3] = {PD_DTYPE_F32, PD_DTYPE_BF16, PD_DTYPE_BF16};
  const cJSON *cases = cJSON_GetObjectItem(root, "cases");
  for (int k = 0; k < 3; k++) {
    pd_engine_opts o;
    pd_engine_opts_default(&o);
    o.block_size = BS;
    o.max_model_len = MAX_CTX;
    o.num_blocks = NCASES * MAX_BLOCKS;
    o.max_batch_tokens = MAX_CTX;
    o.max_seqs = NCASES;
    o.kv_dtype = kvs[k];
    o.enforce_eager = k == 2;
    pd_engine *eng = pd_engine_create(m, be, &o, &e);
    if (!eng) {
      fprintf(stderr, "engine: %s\n", e.msg);
      return 1;
    }
    const cJSON *cs;
    int idx = 0;
    cJSON_ArrayForEach(cs, cases) {
      run_case(eng, V, gdir, cs, 512, bt_linear, idx, pd_dtype_name(kvs[k]));
      run_case(eng, V, gdir, cs, 13, bt_shuffled + MAX_BLOCKS, idx, pd_dtype_name(kvs[k]));
      idx++;
    }
    CHECK(idx == NCASES);
    batch_vs_single(eng, V, cases, k ? bt_shuffled : bt_linear);
    uint64_t replays = 0;
    int n_graphs = 0;
    pd_engine_graph_stats(eng, &replays, &n_graphs);
    printf("kv %s%s: %llu decode steps replayed from %d graphs\n", pd_dtype_name(kvs[k]),
           k == 2 ? " (eager)" : "", (unsigned long long)replays, n_graphs);
    if (k == 2)
      CHECKF(replays == 0 && n_graphs == 0, "eager engine replayed %llu steps",
             (unsigned long long)replays);
    else
      CHECKF(replays > 0 && n_graphs >= 2, "graphs not used: %llu replays, %d graphs",
             (unsigned long long)replays, n_graphs);
    pd_engine_free(eng);
  }
  CHECKF(pd_backend_cuda_status(be, &e) == PD_OK, "backend status: %s", e.msg);
  pd_backend_destroy(be);
  pd_model_free(m);
  cJSON_Delete(root);
  free(js);
  return pd_test_finish(argv[1]);
}
