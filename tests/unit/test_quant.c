/* 4-bit checkpoints as the tools publish them (tests/data/quant, copied from ../shared/quant; see
 * its README), on the CPU in float32 with the tolerances of ../shared/quant/README.md:
 *   - GPTQ (GPTQModel 7.7.0, pycoder-qwen2-4m, g128), and any checkpoint directory given on the
 *     command line: the whole checkpoint loads; for the four
 *     reference prompts the last position's logits are within 1e-3 of the largest |logit| of
 *     the tool's own dequantized weights in float32 (`_dense_f32`), and the 16 greedy ids are the
 *     tool's up to its first step whose top-2 gap is under 0.02;
 *   - AWQ (AutoAWQ 0.2.9, gemm) and compressed-tensors pack-quantized W4A16 (llm-compressor
 *     0.14): layer 0's q_proj, the tool's own tensors byte for byte (extract_layer0.py), repacked
 *     into the engine's 4-bit rows, dequantizes to the tool's float32 weight: the first 8
 *     values and the largest |w| exactly, the sum and the sum of |w| to float rounding;
 *   - compressed-tensors FP8 (FP8_DYNAMIC, llm-compressor): layer 0's q_proj likewise, and e4m3
 *     conversions both ways (every value, ties to even, saturation, subnormals);
 *   - quantization configs the kernels cannot take are refused with a message naming them. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/backend_cuda.h"
#include "pd/model.h"
#include "pd/runtime.h"
#include "pd/safetensors.h"
#include "pd_test.h"

static char g_data[1024];
/* --device cuda[:N]: the whole checkpoints on that GPU (bf16 KV) with the GPU tolerances of
 * ../shared/golden/README.md instead of the CPU's */
static const char *g_device;

static cJSON *load_json(const char *dir, const char *name) {
  char p[4200];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  char *t = pd_test_read_file(p, NULL);
  REQUIRE(t);
  cJSON *j = cJSON_Parse(t);
  free(t);
  REQUIRE(j);
  return j;
}

/* ---- GPTQ: the whole checkpoint ---- */

typedef struct greedy_out {
  int32_t ids[32];
  int n;
} greedy_out;

static void on_event(void *user, const pd_sched_event *ev) {
  greedy_out *g = user;
  if (ev->token >= 0 && g->n < 32) g->ids[g->n++] = ev->token;
}

static void test_model_dir(const char *dir) {
  cJSON *ref = load_json(dir, "reference.json");
  const cJSON *cases = cJSON_GetObjectItem(ref, "cases");
  REQUIRE(cJSON_IsArray(cases));
  greedy_out out = {0};
  pd_runtime rt;
  pd_runtime_opts o;
  pd_runtime_opts_default(&o);
  o.model_dir = dir;
  o.threads = 2;
  o.kv_cache_dtype = g_device ? "bf16" : "f32";
  if (g_device) {
    o.device = g_device;
    o.kv_cache_tokens = 4096;
  }
  pd_err e = {0};
  REQUIRE(pd_runtime_open(&rt, &o, on_event, &out, &e) == PD_OK);
  const bool fp8 = rt.model->cfg.quant.method == PD_QUANT_CT_FP8;
  CHECK(rt.model->cfg.quant.method != PD_QUANT_NONE && (fp8 || rt.model->cfg.quant.group_size == 128));
  CHECK(rt.model->layers[0].wq.dtype == (fp8 ? PD_DTYPE_F8WA : PD_DTYPE_Q4));
  /* ../shared/quant/README.md: weight-only 4-bit within 1e-3, greedy up to a gap of 0.02; FP8
   * weights and activations within 2e-2 (per-token scales may round differently), gap 0.1 */
  const double tol = g_device ? 3e-2 : fp8 ? 2e-2 : 1e-3, tie = g_device || fp8 ? 0.1 : 0.02;
  const char *name = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
  const int V = rt.model->cfg.vocab_size;
  float *lg = malloc((size_t)V * sizeof *lg), *rl = malloc((size_t)V * sizeof *rl);
  REQUIRE(lg && rl);
  /* the tool's dequantized weights in float32 (GPTQ, AWQ: dense_f32_reference); else its own
   * path, float32 with the weights decompressed (llm-compressor W4A16) */
  const cJSON *dense = cJSON_GetObjectItem(cJSON_GetObjectItem(ref, "dense_f32_reference"), "cases");
  int ci = 0;
  const cJSON *c;
  cJSON_ArrayForEach(c, cases) {
    const cJSON *ids = cJSON_GetObjectItem(c, "input_ids");
    const int n = cJSON_GetArraySize(ids);
    int32_t tok[256], pos[256], slots[256];
    REQUIRE(n > 0 && n <= 256);
    for (int i = 0; i < n; i++) {
      tok[i] = cJSON_GetArrayItem(ids, i)->valueint;
      pos[i] = i;
      slots[i] = i; /* blocks 0.. in order */
    }
    /* the prompt's last-position logits, one forward */
    int32_t bt[16], qs[2] = {0, n}, ctx = n, row = n - 1;
    for (int b = 0; b < 16; b++) bt[b] = b;
    pd_batch b = {.n_tokens = n, .tokens = tok, .positions = pos, .slots = slots, .n_seqs = 1,
                  .q_start = qs, .ctx_len = &ctx, .block_tables = bt,
                  .max_blocks = (n + 15) / 16, .n_logits = 1, .logit_rows = &row};
    REQUIRE(pd_engine_forward(rt.eng, &b, lg, &e) == PD_OK);
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir,
             dense ? cJSON_GetObjectItem(cJSON_GetArrayItem(dense, ci), "file")->valuestring
                   : cJSON_GetObjectItem(c, "last_logits_file")->valuestring);
    size_t len = 0;
    char *raw = pd_test_read_file(p, &len);
    REQUIRE(raw && len == (size_t)V * 4);
    memcpy(rl, raw, len);
    free(raw);
    double maxref = 0, maxdiff = 0;
    for (int v = 0; v < V; v++) {
      if (fabs(rl[v]) > maxref) maxref = fabs(rl[v]);
      if (fabs(lg[v] - rl[v]) > maxdiff) maxdiff = fabs(lg[v] - rl[v]);
    }
    printf("%s case %d: %d prompt tokens, last-position logits within %.2e of the largest "
           "|logit| %.3f\n", name, ci, n, maxdiff / maxref, maxref);
    CHECKF(maxdiff <= tol * maxref, "%s case %d: logits differ by %.3g (largest |logit| %.3g)",
           name, ci, maxdiff, maxref);
    /* greedy: the tool's ids up to its first near-tie */
    pd_sampling_params sp;
    pd_sampling_params_init(&sp);
    sp.temperature = 0;
    sp.max_tokens = 16;
    sp.ignore_eos = true;
    out.n = 0;
    REQUIRE(pd_sched_add(rt.sched, (uint64_t)ci, tok, n, &sp, &e) == PD_OK);
    while (pd_sched_has_work(rt.sched)) REQUIRE(pd_sched_step(rt.sched, &e) == PD_OK);
    const cJSON *gi = cJSON_GetObjectItem(c, "greedy_ids"), *gap = cJSON_GetObjectItem(c, "greedy_top2_gap");
    int same = 0;
    for (int t = 0; t < cJSON_GetArraySize(gi) && t < out.n; t++) {
      if (out.ids[t] != cJSON_GetArrayItem(gi, t)->valueint) {
        CHECKF(cJSON_GetArrayItem(gap, t)->valuedouble < tie,
               "%s case %d token %d: %d, the tool's %d (gap %.3g)", name, ci, t, out.ids[t],
               cJSON_GetArrayItem(gi, t)->valueint, cJSON_GetArrayItem(gap, t)->valuedouble);
        break;
      }
      same++;
      if (cJSON_GetArrayItem(gap, t)->valuedouble < tie) break;
    }
    printf("%s case %d: %d greedy ids equal the tool's\n", name, ci, same);
    ci++;
  }
  CHECK(ci == 4);
  free(lg);
  free(rl);
  pd_runtime_close(&rt);
  cJSON_Delete(ref);
}

/* ---- AWQ and compressed-tensors: layer 0's q_proj ---- */

static float f16(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return pd_f16_to_f32(h);
}

static void test_layer0(const char *name, const char *check_key) {
  char dir[2048];
  snprintf(dir, sizeof dir, "%s/quant/%s", g_data, name);
  pd_model_config cfg;
  pd_err e = {0};
  REQUIRE(pd_model_config_load(dir, &cfg, &e) == PD_OK);
  pd_st *st = pd_st_open_dir(dir, &e);
  REQUIRE(st);
  cJSON *ref = load_json(dir, "reference.json");
  const cJSON *chk = cJSON_GetObjectItem(ref, "dense_check_layer0_q_proj");
  if (check_key) chk = cJSON_GetObjectItem(chk, check_key);
  REQUIRE(chk);
  const int N = cJSON_GetArrayItem(cJSON_GetObjectItem(chk, "shape"), 0)->valueint;
  const int K = cJSON_GetArrayItem(cJSON_GetObjectItem(chk, "shape"), 1)->valueint;
  void *rows = NULL;
  const bool fp8 = cfg.quant.method == PD_QUANT_CT_FP8;
  REQUIRE((fp8 ? pd_model_fp8_linear : pd_model_quant_linear)(
              st, &cfg.quant, "model.layers.0.self_attn.q_proj", N, K, &rows, &e) == PD_OK);
  const size_t rb = pd_dtype_row_bytes(fp8 ? PD_DTYPE_F8W : PD_DTYPE_Q4, K);
  double sum = 0, asum = 0, mx = 0;
  float first8[8];
  for (int n = 0; n < N; n++) {
    const uint8_t *r = (const uint8_t *)rows + (size_t)n * rb;
    float fsc = 0;
    if (fp8) memcpy(&fsc, r + K, 4);
    for (int k = 0; k < K; k++) {
      const int b = k / PD_Q4_BLOCK, q = (r[k / 2] >> ((k & 1) * 4)) & 15;
      const float w = fp8 ? pd_e4m3_to_f32(r[k]) * fsc
                          : ((float)q - f16(r + K / 2 + b * 4 + 2)) * f16(r + K / 2 + b * 4);
      if (n == 0 && k < 8) first8[k] = w;
      sum += w;
      asum += fabs(w);
      if (fabs(w) > mx) mx = fabs(w);
    }
  }
  const cJSON *f8 = cJSON_GetObjectItem(chk, "first8");
  for (int k = 0; k < 8; k++)
    CHECKF(first8[k] == (float)cJSON_GetArrayItem(f8, k)->valuedouble,
           "%s: w[0][%d] = %.9g, the tool's %.9g", name, k, first8[k],
           cJSON_GetArrayItem(f8, k)->valuedouble);
  const double rmax = cJSON_GetObjectItem(chk, "max_abs")->valuedouble,
               rsum = cJSON_GetObjectItem(chk, "sum")->valuedouble,
               rasum = cJSON_GetObjectItem(chk, "abs_sum")->valuedouble;
  CHECKF(mx == rmax, "%s: max |w| %.9g, the tool's %.9g", name, mx, rmax);
  CHECKF(fabs(asum - rasum) <= 1e-5 * rasum && fabs(sum - rsum) <= 1e-5 * rasum,
         "%s: sum %.9g and sum |w| %.9g, the tool's %.9g and %.9g", name, sum, asum, rsum, rasum);
  printf("%s: layer 0 q_proj [%d, %d] dequantizes to the tool's weights (sum %.6f, sum |w| "
         "%.4f)\n", name, N, K, sum, asum);
  free(rows);
  cJSON_Delete(ref);
  pd_st_close(st);
}

/* ---- refusals ---- */

static void refused(const char *qc, const char *want) {
  char json[2048];
  snprintf(json, sizeof json,
           "{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":64,\"hidden_size\":64,"
           "\"intermediate_size\":128,\"num_hidden_layers\":1,\"num_attention_heads\":2,"
           "\"num_key_value_heads\":1,\"max_position_embeddings\":64,\"rms_norm_eps\":1e-5,"
           "\"quantization_config\":%s}", qc);
  pd_model_config c;
  pd_err e = {0};
  pd_status st = pd_model_config_parse(json, strlen(json), &c, &e);
  CHECKF(st != PD_OK && strstr(e.msg, want), "%s: %s (%s)", qc, e.msg, pd_status_str(st));
}

/* Usage: test_quant [DIR...]: also each whole checkpoint DIR of ../shared/quant's kind (its
 * reference.json beside it), e.g. the AWQ and W4A16 ones too large for the repository. */
int main(int argc, char **argv) {
  const char *d = getenv("PD_TEST_DATA_DIR");
  snprintf(g_data, sizeof g_data, "%s", d && *d ? d : PD_TEST_DATA);
  char dir[2048];
  snprintf(dir, sizeof dir, "%s/quant/pycoder-qwen2-4m-gptq-g128", g_data);
  int a0 = 1;
  if (argc > 2 && strcmp(argv[1], "--device") == 0) {
    g_device = argv[2];
    a0 = 3;
    if (pd_cuda_device_count() == 0) {
      printf("test_quant --device %s: no CUDA device, skipped\n", g_device);
      return 77;
    }
  }
  test_model_dir(dir);
  for (int i = a0; i < argc; i++) test_model_dir(argv[i]);
  if (g_device) return pd_test_finish("test_quant (GPU)");
  test_layer0("pycoder-12m-awq-gemm-g128-q_proj", NULL);
  test_layer0("pycoder-12m-llmc-w4a16-q_proj", "exact_f32_variant");
  test_layer0("pycoder-qwen2-4m-llmc-fp8-dynamic-q_proj", "exact_f32_variant");
  /* e4m3: every byte round-trips; rounding to nearest even, saturation, subnormals */
  for (int b = 0; b < 256; b++)
    if ((b & 0x7f) != 0x7f)
      CHECKF(pd_f32_to_e4m3(pd_e4m3_to_f32((uint8_t)b)) == (b == 0x80 ? 0x80 : b),
             "e4m3 %#x -> %g -> %#x", b, pd_e4m3_to_f32((uint8_t)b),
             pd_f32_to_e4m3(pd_e4m3_to_f32((uint8_t)b)));
  CHECK(pd_e4m3_to_f32(0x7e) == 448.0f && pd_e4m3_to_f32(0x01) == 0x1p-9f &&
        pd_e4m3_to_f32(0x08) == 0x1p-6f && pd_e4m3_to_f32(0xb8) == -1.0f);
  CHECK(pd_f32_to_e4m3(1000.0f) == 0x7e && pd_f32_to_e4m3(-1e9f) == 0xfe);
  CHECK(pd_f32_to_e4m3(1.0625f) == 0x38 && pd_f32_to_e4m3(1.1875f) == 0x3a); /* ties to even */
  CHECK(pd_f32_to_e4m3(0x1p-10f) == 0x00 && pd_f32_to_e4m3(0x1.8p-10f) == 0x01);
  /* against the nearest value by search (ties to the even code), over magnitudes 2^-20..2^10
   * and every midpoint */
  uint32_t seed = 12345;
  int bad = 0;
  for (int i = 0; i < 200000 && bad < 5; i++) {
    seed = seed * 1664525u + 1013904223u;
    float f = ldexpf((float)(seed >> 8) / 16777216.0f - 0.5f, (int)(seed % 31) - 20);
    if (i % 5 == 0) {
      const int c = (int)(seed % 0x7e);
      f = 0.5f * (pd_e4m3_to_f32((uint8_t)c) + pd_e4m3_to_f32((uint8_t)(c + 1)));
    }
    const float a = fminf(fabsf(f), 448.0f);
    int best = 0;
    float bd = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
      const float d = fabsf(pd_e4m3_to_f32((uint8_t)c) - a);
      if (d < bd || (d == bd && !(c & 1))) {
        bd = d;
        best = c;
      }
    }
    const uint8_t want = (uint8_t)((signbit(f) ? 0x80 : 0) | best), got = pd_f32_to_e4m3(f);
    if (got != want && f != 0.0f) {
      CHECKF(0, "e4m3 of %.9g: %#x, nearest %#x", f, got, want);
      bad++;
    }
  }
  refused("{\"quant_method\":\"bitsandbytes\"}", "'bitsandbytes' is not supported");
  refused("{\"quant_method\":\"compressed-tensors\",\"format\":\"float-quantized\","
          "\"config_groups\":{\"g\":{\"format\":\"float-quantized\",\"weights\":{\"num_bits\":8,"
          "\"type\":\"float\",\"strategy\":\"channel\"}}},\"kv_cache_scheme\":{\"num_bits\":4,"
          "\"type\":\"int\",\"strategy\":\"tensor\"}}",
          "kv_cache_scheme other than FP8");
  refused("{\"quant_method\":\"gptq\",\"bits\":8,\"group_size\":128}", "8 is not supported");
  refused("{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":16}", "group_size 16");
  refused("{\"quant_method\":\"awq\",\"bits\":4,\"group_size\":128,\"version\":\"gemv\"}",
          "AWQ version 'gemv'");
  refused("{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":128,\"checkpoint_format\":"
          "\"marlin\"}", "checkpoint_format 'marlin'");
  refused("{\"quant_method\":\"compressed-tensors\",\"format\":\"float-quantized\","
          "\"config_groups\":{\"g\":{\"format\":\"float-quantized\",\"weights\":{\"num_bits\":4,"
          "\"type\":\"float\"}}}}", "8-bit float only");
  refused("{\"quant_method\":\"compressed-tensors\",\"format\":\"naive-quantized\","
          "\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":8}}}}",
          "format 'naive-quantized' is not supported yet");
  refused("{\"quant_method\":\"compressed-tensors\",\"format\":\"pack-quantized\","
          "\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":4,\"type\":\"int\","
          "\"strategy\":\"group\",\"group_size\":128,\"actorder\":\"group\"}}}}",
          "actorder 'group'");
  refused("{\"quant_method\":\"compressed-tensors\",\"format\":\"float-quantized\","
          "\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":8,\"type\":\"float\","
          "\"strategy\":\"tensor\"},\"input_activations\":{\"num_bits\":8,\"type\":"
          "\"float\",\"strategy\":\"channel\",\"dynamic\":false}}}}",
          "other than dynamic per token or static per tensor");
  refused("[1]", "not an object");
  if (pd_test_failures) {
    printf("test_quant: %d checks failed\n", pd_test_failures);
    return 1;
  }
  printf("test_quant: all checks passed\n");
  return 0;
}
