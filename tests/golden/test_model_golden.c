/* Golden parity of the CPU forward pass with Hugging Face transformers (float32 reference
 * outputs in tests/data/golden/<model>/reference.json; tolerances from its README):
 *   - last-position logits: max|mine - ref| / max|ref| < 1e-3
 *   - argmax at every prompt position (where our top-2 gap leaves no doubt), logsumexp < 1e-3
 *   - 48 greedy tokens equal up to the first near-tie (reference top-2 gap < 0.02)
 * and the same results when the prompt is fed in small chunks through a shuffled block table
 * (chunked prefill over pages out of order). Usage: test_model_golden <model-name>. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pd/engine.h"
#include "pd/model.h"
#include "golden_util.h"
#include "pd_test.h"

#define MAX_CTX GOLDEN_MAX_CTX

/* Runs one case: prompt fed in `chunk`-token pieces through block table `bt`, then greedy. */
static void run_case(pd_engine *eng, const pd_model_config *cfg, const char *gdir,
                     const cJSON *cs, int chunk, int32_t *bt, int max_blocks, int idx) {
  int V = cfg->vocab_size;
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

  runner r = {eng, V, pd_engine_get_opts(eng)->block_size, max_blocks, bt, 0};
  float *all = malloc((size_t)n * V * sizeof *all), *last = malloc((size_t)V * sizeof *last);
  REQUIRE(all && last);
  feed(&r, ids, n, chunk, all, last);

  double err = rel_err(last, ref, V, NULL);
  CHECKF(err < 1e-3, "case %d chunk %d: last-logit error %.3g", idx, chunk, err);
  int bad_argmax = 0;
  double worst_lse = 0;
  for (int p = 0; p < n; p++) {
    float gap;
    int a = argmax(all + (size_t)p * V, V, &gap);
    if (a != argmax_ref[p] && gap > 1e-3f) bad_argmax++;
    double d = fabs(logsumexp(all + (size_t)p * V, V) - cJSON_GetArrayItem(lse, p)->valuedouble);
    if (d > worst_lse) worst_lse = d;
  }
  CHECKF(bad_argmax == 0, "case %d chunk %d: %d positions with a different argmax", idx, chunk,
         bad_argmax);
  CHECKF(worst_lse < 1e-3, "case %d chunk %d: logsumexp off by %.3g", idx, chunk, worst_lse);

  /* greedy decoding, compared up to the first near-tie of the reference */
  int agree = 0, compared = 0;
  for (int t = 0; t < ng; t++) {
    int tok = argmax(last, V, NULL);
    if (cJSON_GetArrayItem(gaps, t)->valuedouble < 0.02) break;
    compared++;
    if (tok != greedy_ref[t]) {
      CHECKF(0, "case %d chunk %d: greedy step %d gave %d, reference %d", idx, chunk, t, tok,
             greedy_ref[t]);
      break;
    }
    agree++;
    int32_t next = greedy_ref[t];
    feed(&r, &next, 1, 1, NULL, last);
  }
  printf("case %d (%d prompt tokens, chunk %d): last-logit rel err %.2e, max lse err %.2e, "
         "greedy %d/%d before first near-tie\n",
         idx, n, chunk, err, worst_lse, agree, compared);
  free(all);
  free(last);
  free(ref);
}

int main(int argc, char **argv) {
  REQUIRE(argc == 2);
  char mdir[2048], gdir[2048], path[4200];
  snprintf(mdir, sizeof mdir, "%s/models/%s", PD_TEST_DATA, argv[1]);
  snprintf(gdir, sizeof gdir, "%s/golden/%s", PD_TEST_DATA, argv[1]);
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
  pd_backend *be = pd_backend_cpu_create(NULL, &e);
  REQUIRE(be);
  pd_engine_opts o;
  pd_engine_opts_default(&o);
  o.max_model_len = MAX_CTX;
  o.num_blocks = 2 * MAX_CTX / o.block_size;
  o.max_batch_tokens = 512;
  pd_engine *eng = pd_engine_create(m, be, &o, &e);
  if (!eng) {
    fprintf(stderr, "engine: %s\n", e.msg);
    return 1;
  }
  int max_blocks = MAX_CTX / o.block_size;
  int32_t bt_linear[MAX_CTX / 16], bt_shuffled[MAX_CTX / 16];
  for (int i = 0; i < max_blocks; i++) {
    bt_linear[i] = i;
    bt_shuffled[i] = (int32_t)((i * 37 + 11) % o.num_blocks); /* 37 is coprime with 128 */
  }
  const cJSON *cases = cJSON_GetObjectItem(root, "cases"), *cs;
  int idx = 0;
  cJSON_ArrayForEach(cs, cases) {
    run_case(eng, &m->cfg, gdir, cs, 512, bt_linear, max_blocks, idx);
    run_case(eng, &m->cfg, gdir, cs, 13, bt_shuffled, max_blocks, idx);
    idx++;
  }
  CHECK(idx == 6);
  pd_engine_free(eng);
  pd_backend_destroy(be);
  pd_model_free(m);
  cJSON_Delete(root);
  free(js);
  return pd_test_finish(argv[1]);
}
