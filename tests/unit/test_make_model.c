/* pdctl make-model (tools/cmd_make_model.c, linked into this test and run in-process with
 * argv as pdctl would pass it) and the safetensors writer it uses (common/model/st_write.c).
 *
 * Checked against independent facts, not against the generator's own output:
 *   - the published parameter counts of Llama-3-8B/70B, Llama-2-7B, Mistral-7B, Qwen2-7B
 *     (--dry-run), and Llama-3-8B's 4 shards of at most 5 GB;
 *   - the published config fields (rope_theta, eps, context, sliding window, biases) as
 *     pd_model_load reads them, and --like pycoder-12m against the real pycoder-12m config;
 *   - the folder loads with pd_model_load, every tensor has exactly the expected shape, dtype
 *     and byte size; the index maps every tensor to the shard that holds it; shard sizes stay
 *     under --max-shard-size; headers are padded with spaces to 8 bytes;
 *   - weight statistics: N(0, 0.02) (mean, std, kurtosis of a normal), the 2/sqrt(fan_in) cap,
 *     norms exactly 1;
 *   - bytes do not depend on --threads, the shard layout or --layers; they do on --seed;
 *   - the tokenizer (generated, or the real one copied) loads, has exactly vocab ids,
 *     round-trips text, renders its chat template;
 *   - a CPU forward pass gives finite, non-constant logits;
 *   - bad arguments fail with a message that names the problem. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/engine.h"
#include "pd/model.h"
#include "pd/st_write.h"
#include "pd/tokenizer.h"
#include "pd_test.h"
#include "pdctl.h"
#include "st_writer.h"

static char g_tmp[256];  /* the test's scratch directory */
static char g_out[8192]; /* stdout + stderr of the last run */

/* Runs `pdctl make-model <args...>` (NULL-terminated) in this process, capturing its stdout
 * and stderr into g_out. Returns its exit status. */
static int run(const char *first, ...) {
  char *argv[64] = {"pdctl", "make-model"};
  int argc = 2;
  va_list ap;
  va_start(ap, first);
  for (const char *a = first; a; a = va_arg(ap, const char *)) {
    REQUIRE(argc < 63);
    argv[argc++] = (char *)a;
  }
  va_end(ap);
  argv[argc] = NULL;
  char cap[400];
  snprintf(cap, sizeof cap, "%s/captured.txt", g_tmp);
  fflush(stdout);
  fflush(stderr);
  int fd = open(cap, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  int so = dup(1), se = dup(2);
  REQUIRE(so >= 0 && se >= 0);
  dup2(fd, 1);
  dup2(fd, 2);
  close(fd);
  int rc = cmd_make_model(argc, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(so, 1);
  dup2(se, 2);
  close(so);
  close(se);
  size_t n = 0;
  char *txt = stw_read_file(cap, &n);
  REQUIRE(txt);
  snprintf(g_out, sizeof g_out, "%s", txt);
  free(txt);
  return rc;
}

static void path_of(char *buf, size_t n, const char *dir, const char *name) {
  snprintf(buf, n, "%s/%s", dir, name);
}

static bool file_exists(const char *dir, const char *name) {
  char p[600];
  path_of(p, sizeof p, dir, name);
  struct stat sb;
  return stat(p, &sb) == 0;
}

/* ---- checks on a written folder ------------------------------------------------------------ */

static float to_f32(const void *data, pd_dtype dt, size_t i) {
  float f;
  pd_convert_to_f32(&f, (const char *)data + i * pd_dtype_size(dt), dt, 1);
  return f;
}

/* Mean, standard deviation and kurtosis (E[x^4] / var^2; 3 for a normal) of a tensor. */
static void moments(const pd_st_tensor *t, double *mean, double *sd, double *kurt) {
  size_t n = t->nbytes / pd_dtype_size(t->dtype);
  double s1 = 0, s2 = 0, s4 = 0;
  for (size_t i = 0; i < n; i++) s1 += to_f32(t->data, t->dtype, i);
  double m = s1 / (double)n;
  for (size_t i = 0; i < n; i++) {
    double d = to_f32(t->data, t->dtype, i) - m;
    s2 += d * d;
    s4 += d * d * d * d;
  }
  double var = s2 / (double)n;
  *mean = m;
  *sd = sqrt(var);
  *kurt = (s4 / (double)n) / (var * var);
}

/* Every tensor the architecture needs, with the shape its dimensions imply, and nothing else. */
static void check_tensors(const pd_st *st, const pd_model_config *c, pd_dtype dt) {
  const int64_t D = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
  const int64_t Q = (int64_t)c->num_heads * c->head_dim;
  const int64_t KV = (int64_t)c->num_kv_heads * c->head_dim;
  const bool bias = c->arch == PD_ARCH_QWEN2;
  struct {
    char name[96];
    int64_t r, c;
  } want[64];
  int n = 0;
#define WANT(R, C, ...)                                                   \
  do {                                                                    \
    REQUIRE(n < 64);                                                      \
    snprintf(want[n].name, sizeof want[n].name, __VA_ARGS__);             \
    want[n].r = (R);                                                      \
    want[n].c = (C);                                                      \
    n++;                                                                  \
  } while (0)
  WANT(V, D, "model.embed_tokens.weight");
  WANT(D, 0, "model.norm.weight");
  WANT(V, D, "lm_head.weight");
  for (int l = 0; l < c->num_layers; l++) {
    WANT(Q, D, "model.layers.%d.self_attn.q_proj.weight", l);
    WANT(KV, D, "model.layers.%d.self_attn.k_proj.weight", l);
    WANT(KV, D, "model.layers.%d.self_attn.v_proj.weight", l);
    WANT(D, Q, "model.layers.%d.self_attn.o_proj.weight", l);
    if (bias) {
      WANT(Q, 0, "model.layers.%d.self_attn.q_proj.bias", l);
      WANT(KV, 0, "model.layers.%d.self_attn.k_proj.bias", l);
      WANT(KV, 0, "model.layers.%d.self_attn.v_proj.bias", l);
    }
    WANT(F, D, "model.layers.%d.mlp.gate_proj.weight", l);
    WANT(F, D, "model.layers.%d.mlp.up_proj.weight", l);
    WANT(D, F, "model.layers.%d.mlp.down_proj.weight", l);
    WANT(D, 0, "model.layers.%d.input_layernorm.weight", l);
    WANT(D, 0, "model.layers.%d.post_attention_layernorm.weight", l);
  }
#undef WANT
  CHECKF(pd_st_count(st) == (size_t)n, "%zu tensors, expected %d", pd_st_count(st), n);
  for (int i = 0; i < n; i++) {
    const pd_st_tensor *t = pd_st_find(st, want[i].name);
    CHECKF(t != NULL, "tensor %s missing", want[i].name);
    if (!t) continue;
    int nd = want[i].c ? 2 : 1;
    CHECKF(t->dtype == dt, "%s: dtype %s", want[i].name, pd_dtype_name(t->dtype));
    CHECKF(t->ndim == nd && t->shape[0] == want[i].r && (nd == 1 || t->shape[1] == want[i].c),
           "%s: wrong shape", want[i].name);
    size_t bytes = (size_t)want[i].r * (size_t)(want[i].c ? want[i].c : 1) * pd_dtype_size(dt);
    CHECKF(t->nbytes == bytes, "%s: %zu bytes, expected %zu", want[i].name, t->nbytes, bytes);
    if (strstr(want[i].name, "norm")) { /* RMSNorm weights are exactly 1 */
      bool ones = true;
      for (int64_t k = 0; k < want[i].r; k++) ones &= to_f32(t->data, t->dtype, (size_t)k) == 1.0f;
      CHECKF(ones, "%s is not all ones", want[i].name);
    }
  }
}

/* A shard file's layout: u64 header length N (N % 8 == 0), JSON padded with spaces, carrying
 * {"format": "pt"}, then exactly the data its entries describe. Returns its data bytes. */
static uint64_t check_file_layout(const char *path, size_t *n_tensors) {
  size_t len = 0;
  unsigned char *f = stw_read_file(path, &len);
  REQUIRE(f && len >= 8);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; i++) hlen |= (uint64_t)f[i] << (8 * i);
  CHECKF(hlen % 8 == 0, "%s: header length %llu not a multiple of 8", path,
         (unsigned long long)hlen);
  REQUIRE(8 + hlen <= len);
  size_t end = 8 + hlen;
  while (end > 8 && f[end - 1] == ' ') end--;
  CHECKF(f[end - 1] == '}', "%s: header not padded with spaces", path);
  cJSON *h = cJSON_ParseWithLength((const char *)f + 8, hlen);
  REQUIRE(h);
  const cJSON *meta = cJSON_GetObjectItem(h, "__metadata__");
  const cJSON *fmt = meta ? cJSON_GetObjectItem(meta, "format") : NULL;
  CHECKF(cJSON_IsString(fmt) && !strcmp(fmt->valuestring, "pt"), "%s: no format=pt", path);
  uint64_t data = 0;
  size_t nt = 0;
  for (const cJSON *it = h->child; it; it = it->next) {
    if (!strcmp(it->string, "__metadata__")) continue;
    const cJSON *off = cJSON_GetObjectItem(it, "data_offsets");
    uint64_t b = (uint64_t)cJSON_GetArrayItem(off, 1)->valuedouble;
    if (b > data) data = b;
    nt++;
  }
  CHECKF(len == 8 + hlen + data, "%s: %zu bytes, header + data say %llu", path, len,
         (unsigned long long)(8 + hlen + data));
  cJSON_Delete(h);
  free(f);
  if (n_tensors) *n_tensors = nt;
  return data;
}

/* model.safetensors.index.json: every tensor mapped to the file that holds it, totals right,
 * n_shards files named model-0000i-of-0000n, each within max_shard unless it holds one tensor. */
static void check_index(const char *dir, const pd_st *st, int n_shards, uint64_t max_shard) {
  char p[600];
  path_of(p, sizeof p, dir, "model.safetensors.index.json");
  char *txt = stw_read_file(p, NULL);
  REQUIRE(txt);
  cJSON *j = cJSON_Parse(txt);
  REQUIRE(j);
  const cJSON *map = cJSON_GetObjectItem(j, "weight_map");
  const cJSON *meta = cJSON_GetObjectItem(j, "metadata");
  REQUIRE(map && meta);
  CHECK(cJSON_GetArraySize(map) == (int)pd_st_count(st));
  uint64_t total = 0, params = 0;
  for (size_t i = 0; i < pd_st_count(st); i++) {
    const pd_st_tensor *t = pd_st_at(st, i);
    total += t->nbytes;
    params += t->nbytes / pd_dtype_size(t->dtype);
    const cJSON *f = cJSON_GetObjectItem(map, t->name);
    CHECKF(cJSON_IsString(f), "%s not in the weight map", t->name);
    if (!cJSON_IsString(f)) continue;
    path_of(p, sizeof p, dir, f->valuestring);
    pd_err e = {0};
    pd_st *one = pd_st_open_file(p, &e);
    CHECKF(one && pd_st_find(one, t->name), "%s is not in %s", t->name, f->valuestring);
    pd_st_close(one);
  }
  CHECK((uint64_t)cJSON_GetObjectItem(meta, "total_size")->valuedouble == total);
  CHECK((uint64_t)cJSON_GetObjectItem(meta, "total_parameters")->valuedouble == params);
  for (int s = 1; s <= n_shards; s++) {
    char name[64];
    snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s, n_shards);
    path_of(p, sizeof p, dir, name);
    size_t nt = 0;
    uint64_t data = check_file_layout(p, &nt);
    CHECKF(data <= max_shard || nt == 1, "%s: %llu data bytes in %zu tensors > %llu", name,
           (unsigned long long)data, nt, (unsigned long long)max_shard);
  }
  char name[64];
  snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", n_shards + 1, n_shards + 1);
  CHECK(!file_exists(dir, name));
  cJSON_Delete(j);
  free(txt);
}

/* The number after "key: " in the captured output, or -1. */
static long long out_value(const char *key) {
  const char *s = strstr(g_out, key);
  return s ? atoll(s + strlen(key)) : -1;
}

/* Tokenizer: exactly vocab ids, round trips, ids of the special tokens. */
static void check_tokenizer(const char *dir, int vocab, bool synthetic) {
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load(dir, &e);
  CHECKF(t != NULL, "tokenizer: %s", e.msg);
  if (!t) return;
  if (synthetic) {
    CHECK(pd_tokenizer_vocab_size(t) == vocab);
    CHECK(pd_tokenizer_token_to_id(t, "<|endoftext|>") == vocab - 3);
    CHECK(pd_tokenizer_token_to_id(t, "<|im_start|>") == vocab - 2);
    CHECK(pd_tokenizer_token_to_id(t, "<|im_end|>") == vocab - 1);
    CHECK(pd_tokenizer_is_special(t, vocab - 1));
    CHECK(pd_tokenizer_eos_id(t) == vocab - 3);
  } else {
    CHECK(pd_tokenizer_vocab_size(t) <= vocab);
  }
  static const char *texts[] = {
      "the quick brown fox jumps over the lazy dog, and the dog sleeps on.",
      "Hello World!\n\n  def f(x):\n\treturn x + 12345\n",
      "ünïcødé — 日本語のテキスト 🙂👍🏽 ok",
      "<|endoftext|> between special tokens <|im_start|>user",
      "",
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    int32_t *ids = NULL;
    size_t n = 0;
    char *back = NULL;
    size_t blen = 0;
    pd_status st = pd_tokenizer_encode(t, texts[i], strlen(texts[i]), false, &ids, &n, &e);
    CHECKF(st == PD_OK, "encode: %s", e.msg);
    for (size_t k = 0; st == PD_OK && k < n; k++) CHECK(ids[k] >= 0 && ids[k] < vocab);
    if (st == PD_OK) st = pd_tokenizer_decode(t, ids, n, false, &back, &blen, &e);
    CHECKF(st == PD_OK && blen == strlen(texts[i]) && !memcmp(back, texts[i], blen),
           "round trip of text %zu", i);
    if (i == 0 && st == PD_OK) { /* merges do their job on English (few merges: some job) */
      size_t most = vocab >= 4096 ? strlen(texts[0]) / 2 : strlen(texts[0]) * 7 / 8;
      CHECKF(n < most, "%zu tokens for %zu bytes", n, strlen(texts[0]));
    }
    free(ids);
    free(back);
  }
  if (synthetic) {
    pd_chat_msg msg = {"user", "hi"};
    char *txt = NULL;
    CHECK(pd_tokenizer_has_chat_template(t));
    CHECK(pd_tokenizer_apply_chat(t, &msg, 1, true, &txt, &e) == PD_OK);
    CHECK(txt && !strcmp(txt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
    free(txt);
  }
  pd_tokenizer_free(t);
}

/* A prompt and one decode step on the CPU engine: logits finite and not constant. */
static void check_forward(const pd_model *m) {
  pd_err e = {0};
  pd_backend *be = pd_backend_cpu_create(NULL, &e);
  REQUIRE(be);
  pd_engine_opts o;
  pd_engine_opts_default(&o);
  o.max_model_len = 64;
  o.num_blocks = 4;
  o.max_batch_tokens = 16;
  o.max_seqs = 1;
  pd_engine *eng = pd_engine_create(m, be, &o, &e);
  CHECKF(eng != NULL, "engine: %s", e.msg);
  if (!eng) {
    pd_backend_destroy(be);
    return;
  }
  const int V = m->cfg.vocab_size, n = 9;
  float *lg = malloc((size_t)V * sizeof *lg);
  REQUIRE(lg);
  int32_t toks[10], pos[10], slots[10], bt[4] = {0, 1, 2, 3};
  for (int i = 0; i < 10; i++) {
    toks[i] = (int32_t)((i * 7919 + 13) % V);
    pos[i] = slots[i] = i;
  }
  for (int step = 0; step < 2; step++) {
    int first = step ? n : 0, cnt = step ? 1 : n;
    int32_t qs[2] = {0, cnt}, ctx = first + cnt, row = cnt - 1;
    pd_batch b = {.n_tokens = cnt, .tokens = toks + first, .positions = pos + first,
                  .slots = slots + first, .n_seqs = 1, .q_start = qs, .ctx_len = &ctx,
                  .block_tables = bt, .max_blocks = 4, .n_logits = 1, .logit_rows = &row};
    pd_status st = pd_engine_forward(eng, &b, lg, &e);
    CHECKF(st == PD_OK, "forward: %s", e.msg);
    if (st != PD_OK) break;
    float lo = INFINITY, hi = -INFINITY;
    bool finite = true;
    for (int v = 0; v < V; v++) {
      finite &= isfinite(lg[v]) != 0;
      lo = fminf(lo, lg[v]);
      hi = fmaxf(hi, lg[v]);
    }
    CHECKF(finite, "step %d: non-finite logits", step);
    CHECKF(hi - lo > 1e-3f, "step %d: constant logits", step);
  }
  free(lg);
  pd_engine_free(eng);
  pd_backend_destroy(be);
}

static pd_model *load(const char *dir) {
  pd_err e = {0};
  pd_model *m = pd_model_load(dir, NULL, &e);
  CHECKF(m != NULL, "pd_model_load(%s): %s", dir, e.msg);
  return m;
}

/* Same bytes for every tensor name the two folders share; returns how many were compared. */
static int same_tensors(const pd_st *a, const pd_st *b, bool *all_same) {
  int n = 0;
  *all_same = true;
  for (size_t i = 0; i < pd_st_count(b); i++) {
    const pd_st_tensor *tb = pd_st_at(b, i), *ta = pd_st_find(a, tb->name);
    if (!ta) continue;
    n++;
    if (ta->nbytes != tb->nbytes || memcmp(ta->data, tb->data, ta->nbytes)) *all_same = false;
  }
  return n;
}

/* ---- cases --------------------------------------------------------------------------------- */

static void test_llama_tiny(void) {
  char d1[300], d2[300], d3[300], th[16];
  snprintf(d1, sizeof d1, "%s/llama", g_tmp);
  snprintf(d2, sizeof d2, "%s/llama_1layer", g_tmp);
  snprintf(d3, sizeof d3, "%s/llama_seed", g_tmp);
  snprintf(th, sizeof th, "2");
  int rc = run("--like", "llama3-8b", "--layers", "2", "--hidden", "64", "--ffn", "160", "--heads",
               "4", "--kv-heads", "2", "--vocab", "512", "--max-shard-size", "40KB", "--threads",
               th, "--seed", "7", "--out", d1, NULL);
  CHECKF(rc == 0, "make-model failed:\n%s", g_out);
  if (rc) return;
  long long shards = out_value("shards: ");
  CHECK(shards > 2);
  pd_model *m = load(d1);
  if (!m) return;
  const pd_model_config *c = &m->cfg;
  /* overrides */
  CHECK(c->hidden_size == 64 && c->intermediate_size == 160 && c->num_layers == 2);
  CHECK(c->num_heads == 4 && c->num_kv_heads == 2 && c->head_dim == 16 && c->vocab_size == 512);
  /* Meta-Llama-3-8B's published config */
  CHECK(c->arch == PD_ARCH_LLAMA && !strcmp(c->architecture, "LlamaForCausalLM"));
  CHECK(c->rope.type == PD_ROPE_DEFAULT && c->rope.theta == 500000.0);
  CHECK(c->rms_norm_eps == 1e-5 && c->max_position_embeddings == 8192);
  CHECK(!c->tie_word_embeddings && !c->attention_bias && !c->mlp_bias && c->sliding_window == 0);
  CHECK(c->dtype == PD_DTYPE_BF16);
  /* generated tokenizer: no BOS, <|endoftext|> and <|im_end|> end generation */
  CHECK(c->bos_token_id == -1);
  CHECK(c->n_eos == 2 && c->eos_token_ids[0] == 509 && c->eos_token_ids[1] == 511);
  check_tensors(m->st, c, PD_DTYPE_BF16);
  check_index(d1, m->st, (int)shards, 40000);
  CHECK(!file_exists(d1, "model.safetensors"));
  for (const char *f = "generation_config.json"; f; f = NULL) CHECK(file_exists(d1, f));

  /* N(0, 0.02) */
  double mean, sd, kurt;
  moments(pd_st_find(m->st, "model.embed_tokens.weight"), &mean, &sd, &kurt);
  CHECKF(fabs(mean) < 1e-3 && fabs(sd - 0.02) < 0.0006 && kurt > 2.8 && kurt < 3.2,
         "embeddings: mean %g sd %g kurtosis %g", mean, sd, kurt);
  moments(pd_st_find(m->st, "model.layers.1.mlp.down_proj.weight"), &mean, &sd, &kurt);
  CHECKF(fabs(sd - 0.02) < 0.001, "down_proj sd %g", sd);
  check_tokenizer(d1, 512, true);
  check_forward(m);

  /* Same bytes with 1 thread, one file, one layer; different with another seed. */
  rc = run("--like", "llama3-8b", "--layers", "1", "--hidden", "64", "--ffn", "160", "--heads",
           "4", "--kv-heads", "2", "--vocab", "512", "--threads", "1", "--seed", "7", "--out", d2,
           NULL);
  CHECKF(rc == 0, "%s", g_out);
  CHECK(file_exists(d2, "model.safetensors") && !file_exists(d2, "model.safetensors.index.json"));
  pd_model *m2 = rc ? NULL : load(d2);
  if (m2) {
    bool same;
    CHECK(same_tensors(m->st, m2->st, &same) == 12); /* embed, norm, lm_head + layer 0 (9) */
    CHECK(same);
    size_t nt = 0;
    char p[600];
    path_of(p, sizeof p, d2, "model.safetensors");
    check_file_layout(p, &nt);
    CHECK(nt == 12);
  }
  pd_model_free(m2);
  rc = run("--like", "llama3-8b", "--layers", "1", "--hidden", "64", "--ffn", "160", "--heads",
           "4", "--kv-heads", "2", "--vocab", "512", "--seed", "8", "--out", d3, NULL);
  CHECKF(rc == 0, "%s", g_out);
  pd_model *m3 = rc ? NULL : load(d3);
  if (m3) {
    const pd_st_tensor *a = pd_st_find(m->st, "model.embed_tokens.weight"),
                       *b = pd_st_find(m3->st, "model.embed_tokens.weight");
    CHECK(a && b && a->nbytes == b->nbytes && memcmp(a->data, b->data, a->nbytes) != 0);
  }
  pd_model_free(m3);

  /* An existing model is not overwritten without --force; with it, stale shards go. */
  rc = run("--like", "llama3-8b", "--layers", "1", "--hidden", "64", "--ffn", "160", "--heads",
           "4", "--kv-heads", "2", "--vocab", "512", "--out", d1, NULL);
  CHECK(rc != 0 && strstr(g_out, "--force"));
  pd_model_free(m);
  rc = run("--like", "llama3-8b", "--layers", "1", "--hidden", "64", "--ffn", "160", "--heads",
           "4", "--kv-heads", "2", "--vocab", "512", "--force", "--out", d1, NULL);
  CHECKF(rc == 0, "%s", g_out);
  CHECK(file_exists(d1, "model.safetensors") && !file_exists(d1, "model.safetensors.index.json"));
  CHECK(!file_exists(d1, "model-00001-of-00002.safetensors"));
  char name[64];
  snprintf(name, sizeof name, "model-00001-of-%05lld.safetensors", shards);
  CHECK(!file_exists(d1, name));
  pd_model *m4 = rc ? NULL : load(d1);
  CHECK(m4 && m4->cfg.num_layers == 1);
  pd_model_free(m4);
}

/* The 2/sqrt(fan_in) cap: down_proj with fan-in 16384 gets sigma 2/128. */
static void test_sigma_cap(void) {
  char d[300];
  snprintf(d, sizeof d, "%s/wide", g_tmp);
  int rc = run("--like", "llama2-7b", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn",
               "16384", "--vocab", "300", "--out", d, NULL);
  CHECKF(rc == 0, "%s", g_out);
  pd_model *m = rc ? NULL : load(d);
  if (!m) return;
  CHECK(m->cfg.num_kv_heads == 2); /* Llama-2-7B: kv heads = heads, capped to --heads */
  double mean, sd, kurt;
  moments(pd_st_find(m->st, "model.layers.0.mlp.down_proj.weight"), &mean, &sd, &kurt);
  CHECKF(fabs(sd - 2.0 / 128) < 0.0003, "down_proj sd %g, expected %g", sd, 2.0 / 128);
  moments(pd_st_find(m->st, "model.layers.0.mlp.up_proj.weight"), &mean, &sd, &kurt);
  CHECKF(fabs(sd - 0.02) < 0.0004, "up_proj sd %g", sd);
  pd_model_free(m);
}

static void test_qwen2_f32(void) {
  char d[300];
  snprintf(d, sizeof d, "%s/qwen", g_tmp);
  int rc = run("--like", "qwen2-7b", "--layers", "1", "--hidden", "56", "--heads", "4",
               "--kv-heads", "2", "--ffn", "96", "--vocab", "400", "--dtype", "f32", "--out", d,
               NULL);
  CHECKF(rc == 0, "%s", g_out);
  pd_model *m = rc ? NULL : load(d);
  if (!m) return;
  const pd_model_config *c = &m->cfg;
  /* Qwen2-7B: q/k/v biases, rope_theta 1e6, eps 1e-6, 131072 positions, no sliding window */
  CHECK(c->arch == PD_ARCH_QWEN2 && c->attention_bias && c->head_dim == 14);
  CHECK(c->rope.theta == 1e6 && c->rms_norm_eps == 1e-6 && c->max_position_embeddings == 131072);
  CHECK(c->sliding_window == 0 && c->dtype == PD_DTYPE_F32);
  CHECK(m->layers[0].bq.data && m->layers[0].bk.data && m->layers[0].bv.data);
  CHECK(m->layers[0].bq.rows == 56 && m->layers[0].bk.rows == 28 && m->layers[0].bo.data == NULL);
  check_tensors(m->st, c, PD_DTYPE_F32);
  CHECK(file_exists(d, "model.safetensors") && !file_exists(d, "model.safetensors.index.json"));
  char p[600];
  path_of(p, sizeof p, d, "model.safetensors");
  check_file_layout(p, NULL);
  check_tokenizer(d, 400, true);
  check_forward(m);
  pd_model_free(m);
}

static void test_mistral_f16(void) {
  char d[300];
  snprintf(d, sizeof d, "%s/mistral", g_tmp);
  int rc = run("--like", "mistral-7b", "--layers", "1", "--hidden", "64", "--heads", "4",
               "--kv-heads", "1", "--ffn", "128", "--vocab", "300", "--dtype", "f16", "--out", d,
               NULL);
  CHECKF(rc == 0, "%s", g_out);
  pd_model *m = rc ? NULL : load(d);
  if (!m) return;
  const pd_model_config *c = &m->cfg;
  CHECK(c->arch == PD_ARCH_MISTRAL && c->sliding_window == 4096);
  CHECK(c->max_position_embeddings == 32768 && c->rope.theta == 10000.0);
  CHECK(c->dtype == PD_DTYPE_F16 && !c->attention_bias);
  check_tensors(m->st, c, PD_DTYPE_F16);
  check_forward(m);
  pd_model_free(m);
}

static void expect_fail(const char *needle, const char *first, ...);

/* --quantization awq / gptq / fp8: the published 4-bit layouts (qweight, qzeros, scales, g_idx) that
 * the loader repacks, values around the zero point 8 with one f16 scale per layer; embeddings,
 * norms and lm_head in --dtype; a forward pass of finite, varying logits. */
static void test_quantized(void) {
  static const char *methods[2] = {"awq", "gptq"};
  for (int k = 0; k < 2; k++) {
    char d[300];
    snprintf(d, sizeof d, "%s/q-%s", g_tmp, methods[k]);
    int rc = run("--like", "llama3-8b", "--layers", "2", "--hidden", "128", "--heads", "4",
                 "--kv-heads", "2", "--ffn", "256", "--vocab", "300", "--quantization",
                 methods[k], "--group-size", "64", "--out", d, NULL);
    CHECKF(rc == 0, "%s", g_out);
    pd_model *m = rc ? NULL : load(d);
    if (!m) continue;
    const pd_model_config *c = &m->cfg;
    CHECK(c->quant.method == (k ? PD_QUANT_GPTQ : PD_QUANT_AWQ) && c->quant.group_size == 64);
    CHECK(m->tok_embeddings.dtype == PD_DTYPE_BF16 && m->lm_head.dtype == PD_DTYPE_BF16);
    const pd_weight *w = &m->layers[1].w_down; /* [128 out, 256 in] */
    CHECK(w->dtype == PD_DTYPE_Q4 && w->rows == 128 && w->cols == 256);
    if (w->dtype == PD_DTYPE_Q4) {
      const size_t rb = pd_dtype_row_bytes(PD_DTYPE_Q4, 256);
      int hist[16] = {0};
      bool zeros8 = true, one_scale = true;
      uint16_t s0;
      memcpy(&s0, (const uint8_t *)w->data + 128, 2);
      for (int n = 0; n < 128; n++) {
        const uint8_t *r = (const uint8_t *)w->data + (size_t)n * rb;
        for (int i = 0; i < 128; i++) {
          hist[r[i] & 15]++;
          hist[r[i] >> 4]++;
        }
        for (int b = 0; b < 8; b++) {
          uint16_t sz[2];
          memcpy(sz, r + 128 + b * 4, 4);
          zeros8 &= pd_f16_to_f32(sz[1]) == 8.0f;
          one_scale &= sz[0] == s0;
        }
      }
      /* sigma(ffn 256) = 0.02 capped: scale 0.02 / 4.61 */
      CHECKF(zeros8 && one_scale &&
                 fabsf(pd_f16_to_f32(s0) - 0.02f / 4.61f) < 1e-5f,
             "%s: zero points 8 and one scale %g", methods[k], pd_f16_to_f32(s0));
      for (int q = 0; q < 16; q++) /* uniform values: 32768 / 16 = 2048 each */
        CHECKF(hist[q] > 1700 && hist[q] < 2400, "%s: value %d %d times", methods[k], q, hist[q]);
    }
    check_forward(m);
    pd_model_free(m);
  }
  /* fp8: compressed-tensors FP8_DYNAMIC (e4m3 weights, per-channel bf16 scales sd / 16) */
  char d[300];
  snprintf(d, sizeof d, "%s/q-fp8", g_tmp);
  int rc = run("--like", "llama3-8b", "--layers", "2", "--hidden", "128", "--heads", "4",
               "--kv-heads", "2", "--ffn", "256", "--vocab", "300", "--quantization", "fp8",
               "--out", d, NULL);
  CHECKF(rc == 0, "%s", g_out);
  pd_model *m = rc ? NULL : load(d);
  if (m) {
    CHECK(m->cfg.quant.method == PD_QUANT_CT_FP8 && m->cfg.quant.act_fp8_dynamic);
    CHECK(m->lm_head.dtype == PD_DTYPE_BF16);
    const pd_weight *w = &m->layers[1].w_down; /* [128 out, 256 in] */
    CHECK(w->dtype == PD_DTYPE_F8WA && w->rows == 128 && w->cols == 256);
    if (w->dtype == PD_DTYPE_F8WA) {
      double s2 = 0;
      int nan = 0;
      float sc;
      memcpy(&sc, (const uint8_t *)w->data + 256, 4);
      for (int n = 0; n < 128; n++)
        for (int i = 0; i < 256; i++) {
          const uint8_t b = ((const uint8_t *)w->data)[(size_t)n * 260 + i];
          nan += (b & 0x7f) == 0x7f;
          s2 += (double)pd_e4m3_to_f32(b) * pd_e4m3_to_f32(b);
        }
      const double sd = sqrt(s2 / (128 * 256));
      /* sigma(ffn 256) = 0.02 capped: values of standard deviation 16, scale 0.02 / 16 */
      CHECKF(nan == 0 && sd > 15 && sd < 17 && fabsf(sc - pd_bf16_to_f32(pd_f32_to_bf16(0.02f / 16))) < 1e-9f,
             "fp8: %d NaN, value sd %.2f, scale %g", nan, sd, sc);
    }
    check_forward(m);
    pd_model_free(m);
  }
  snprintf(d, sizeof d, "%s/q-bad", g_tmp);
  expect_fail("--quantization 'int3' is not one of awq, gptq, fp8", "--like", "pycoder-12m",
              "--quantization", "int3", "--out", d, NULL);
  expect_fail("--group-size 48", "--like", "pycoder-12m", "--quantization", "awq",
              "--group-size", "48", "--out", d, NULL);
}

/* --like pycoder-12m reproduces the real pycoder-12m's config and copies its tokenizer. */
static void test_pycoder_real_tokenizer(void) {
  char d[300], real[600];
  snprintf(d, sizeof d, "%s/pycoder", g_tmp);
  snprintf(real, sizeof real, "%s/models/pycoder-12m", PD_TEST_DATA);
  int rc = run("--like", "pycoder-12m", "--data-dir", PD_TEST_DATA, "--out", d, NULL);
  CHECKF(rc == 0, "%s", g_out);
  if (rc) return;
  pd_model_config want;
  pd_err e = {0};
  REQUIRE(pd_model_config_load(real, &want, &e) == PD_OK);
  pd_model *m = load(d);
  if (!m) return;
  const pd_model_config *c = &m->cfg;
  CHECK(c->arch == want.arch && c->vocab_size == want.vocab_size);
  CHECK(c->hidden_size == want.hidden_size && c->intermediate_size == want.intermediate_size);
  CHECK(c->num_layers == want.num_layers && c->num_heads == want.num_heads);
  CHECK(c->num_kv_heads == want.num_kv_heads && c->head_dim == want.head_dim);
  CHECK(c->max_position_embeddings == want.max_position_embeddings);
  CHECK(c->rms_norm_eps == want.rms_norm_eps && c->rope.theta == want.rope.theta);
  CHECK(c->rope.type == want.rope.type && c->tie_word_embeddings == want.tie_word_embeddings);
  CHECK(c->bos_token_id == want.bos_token_id && c->n_eos == want.n_eos);
  CHECK(c->n_eos >= 1 && c->eos_token_ids[0] == want.eos_token_ids[0]);
  CHECK(out_value("parameters: ") == 12587904); /* its model.safetensors: 25175808 bytes / 2 */
  /* the real tokenizer files, byte for byte */
  static const char *files[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"};
  for (int i = 0; i < 3; i++) {
    char a[700], b[700];
    size_t na = 0, nb = 0;
    path_of(a, sizeof a, real, files[i]);
    path_of(b, sizeof b, d, files[i]);
    char *x = stw_read_file(a, &na), *y = stw_read_file(b, &nb);
    CHECKF(x && y && na == nb && !memcmp(x, y, na), "%s differs from the real one", files[i]);
    free(x);
    free(y);
  }
  check_tokenizer(d, 4096, false);
  check_forward(m);
  pd_model_free(m);
}

/* Llama 3's real tokenizer (tokenizer.json.xz, unpacked with xz) when the vocab is 128256. */
static void test_llama3_real_tokenizer(void) {
  if (access("/usr/bin/xz", X_OK) != 0 && access("/bin/xz", X_OK) != 0) {
    printf("xz not installed: skipping the Llama 3 tokenizer copy\n");
    return;
  }
  char d[300];
  snprintf(d, sizeof d, "%s/llama3tok", g_tmp);
  int rc = run("--like", "llama3-8b", "--layers", "1", "--hidden", "32", "--heads", "2",
               "--kv-heads", "1", "--ffn", "64", "--data-dir", PD_TEST_DATA, "--out", d, NULL);
  CHECKF(rc == 0, "%s", g_out);
  if (rc) return;
  CHECKF(strstr(g_out, "tokenizers/llama3") != NULL, "did not use the real tokenizer:\n%s", g_out);
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load(d, &e);
  CHECKF(t != NULL, "%s", e.msg);
  pd_model *m = load(d);
  if (t && m) {
    CHECK(pd_tokenizer_vocab_size(t) == 128256 && m->cfg.vocab_size == 128256);
    CHECK(m->cfg.bos_token_id == 128000 && m->cfg.n_eos == 1 && m->cfg.eos_token_ids[0] == 128001);
    CHECK(pd_tokenizer_token_to_id(t, "<|begin_of_text|>") == 128000);
    CHECK(pd_tokenizer_token_to_id(t, "<|end_of_text|>") == 128001);
    /* Llama 3 encodes " world" as one token: 1917 */
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK(pd_tokenizer_encode(t, " world", 6, false, &ids, &n, &e) == PD_OK);
    CHECK(n == 1 && ids && ids[0] == 1917);
    free(ids);
  }
  pd_tokenizer_free(t);
  pd_model_free(m);
}

/* A generated tokenizer of full size: exactly 128256 ids. */
static void test_synthetic_full_vocab(void) {
  char d[300];
  snprintf(d, sizeof d, "%s/synth128k", g_tmp);
  int rc = run("--like", "llama3-8b", "--layers", "1", "--hidden", "32", "--heads", "2",
               "--kv-heads", "1", "--ffn", "64", "--tokenizer", "synthetic", "--out", d, NULL);
  CHECKF(rc == 0, "%s", g_out);
  if (rc) return;
  CHECK(strstr(g_out, "tokenizer: synthetic") != NULL);
  check_tokenizer(d, 128256, true);
  pd_model *m = load(d);
  CHECK(m && m->cfg.vocab_size == 128256 && m->cfg.eos_token_ids[0] == 128253);
  pd_model_free(m);
}

/* Published parameter counts (model cards / safetensors totals), without writing anything. */
static void test_dry_run_counts(void) {
  static const struct {
    const char *like;
    long long params;
  } pub[] = {{"llama3-8b", 8030261248LL},  {"llama3-70b", 70553706496LL},
             {"llama2-7b", 6738415616LL},  {"mistral-7b", 7241732096LL},
             {"qwen2-7b", 7615616512LL}};
  for (size_t i = 0; i < sizeof pub / sizeof pub[0]; i++) {
    int rc = run("--like", pub[i].like, "--dry-run", NULL);
    CHECKF(rc == 0, "%s", g_out);
    CHECKF(out_value("parameters: ") == pub[i].params, "%s: %lld parameters, published %lld",
           pub[i].like, out_value("parameters: "), pub[i].params);
    CHECK(out_value("bytes: ") == 2 * pub[i].params);
    if (!strcmp(pub[i].like, "llama3-8b")) CHECK(out_value("shards: ") == 4);
  }
  int rc = run("--like", "llama3-8b", "--layers", "2", "--dry-run", NULL);
  CHECK(rc == 0 && strstr(g_out, "2 of the published 32 layers"));
}

static void expect_fail(const char *needle, const char *first, ...) {
  char *argv[32];
  int n = 0;
  va_list ap;
  va_start(ap, first);
  for (const char *a = first; a && n < 30; a = va_arg(ap, const char *)) argv[n++] = (char *)a;
  va_end(ap);
  while (n < 31) argv[n++] = NULL;
  int rc = run(argv[0], argv[1], argv[2], argv[3], argv[4], argv[5], argv[6], argv[7], argv[8],
               argv[9], argv[10], argv[11], argv[12], argv[13], argv[14], argv[15], NULL);
  CHECKF(rc != 0, "expected failure for %s", needle);
  CHECKF(strstr(g_out, needle) != NULL, "message lacks '%s':\n%s", needle, g_out);
}

static void test_bad_args(void) {
  char d[300];
  snprintf(d, sizeof d, "%s/bad", g_tmp);
  expect_fail("--like", "--out", d, NULL);
  expect_fail("unknown model 'gpt-5'", "--like", "gpt-5", "--out", d, NULL);
  expect_fail("--out", "--like", "llama3-8b", NULL);
  expect_fail("--layers 0 is out of range", "--like", "llama3-8b", "--layers", "0", "--out", d,
              NULL);
  expect_fail("--layers -3 is out of range", "--like", "llama3-8b", "--layers", "-3", "--out", d,
              NULL);
  expect_fail("not a multiple of --heads 5", "--like", "llama3-8b", "--hidden", "64", "--heads",
              "5", "--out", d, NULL);
  expect_fail("not a multiple of --kv-heads 3", "--like", "llama3-8b", "--heads", "4",
              "--kv-heads", "3", "--out", d, NULL);
  expect_fail("must be even", "--like", "llama3-8b", "--head-dim", "15", "--out", d, NULL);
  expect_fail("--dtype 'int8'", "--like", "llama3-8b", "--dtype", "int8", "--out", d, NULL);
  expect_fail("--max-shard-size '5XB'", "--like", "llama3-8b", "--max-shard-size", "5XB", "--out",
              d, NULL);
  expect_fail("--vocab 100", "--like", "llama3-8b", "--vocab", "100", "--out", d, NULL);
  expect_fail("unknown option '--bogus'", "--like", "llama3-8b", "--bogus", "--out", d, NULL);
  expect_fail("--layers: 'two' is not an integer", "--like", "llama3-8b", "--layers", "two",
              "--out", d, NULL);
  expect_fail("--tokenizer /nonexistent/tok", "--like", "llama3-8b", "--layers", "1", "--hidden",
              "32", "--heads", "2", "--ffn", "64", "--vocab", "400", "--tokenizer",
              "/nonexistent/tok", "--out", d, NULL);
  /* a tokenizer with more ids than --vocab */
  char real[600];
  snprintf(real, sizeof real, "%s/models/pycoder-12m", PD_TEST_DATA);
  expect_fail("more than --vocab 1000", "--like", "pycoder-12m", "--vocab", "1000", "--tokenizer",
              real, "--out", d, NULL);
  CHECK(!file_exists(d, "config.json")); /* nothing half-made that claims to be a model */
  CHECK(run("--help", NULL) == 0 && strstr(g_out, "llama3-70b") &&
        strstr(g_out, "--max-shard-size"));
}

/* The writer on its own: pd_st_save round trip, declared/written byte accounting, refusals. */
static void test_st_write(void) {
  char p[400];
  snprintf(p, sizeof p, "%s/w.safetensors", g_tmp);
  float a[6] = {1, 2, 3, 4, 5, 6};
  uint16_t b[3] = {0x3f80, 0x4000, 0xc000};
  pd_stw_tensor t[2] = {{"a", PD_DTYPE_F32, 2, {2, 3}, a, sizeof a},
                        {"b\"q", PD_DTYPE_BF16, 1, {3}, b, sizeof b}};
  const char *meta[] = {"format", "pt", "note", "x\\y", NULL};
  pd_err e = {0};
  CHECKF(pd_st_save(p, t, 2, meta, true, &e) == PD_OK, "%s", e.msg);
  pd_st *st = pd_st_open_file(p, &e);
  CHECKF(st != NULL, "%s", e.msg);
  if (st) {
    const pd_st_tensor *ta = pd_st_find(st, "a"), *tb = pd_st_find(st, "b\"q");
    CHECK(ta && ta->ndim == 2 && ta->shape[1] == 3 && !memcmp(ta->data, a, sizeof a));
    CHECK(tb && tb->dtype == PD_DTYPE_BF16 && !memcmp(tb->data, b, sizeof b));
    pd_st_close(st);
  }
  check_file_layout(p, NULL);
  /* too short, too long, duplicate, late declaration, leftover temporary on abort */
  pd_stw *w = pd_stw_new(&e);
  REQUIRE(w);
  CHECK(pd_stw_add(w, "x", PD_DTYPE_F32, 1, (int64_t[]){4}, &e) == PD_OK);
  CHECK(pd_stw_add(w, "x", PD_DTYPE_F32, 1, (int64_t[]){4}, &e) == PD_EINVAL);
  CHECK(pd_stw_add(w, "__metadata__", PD_DTYPE_F32, 1, (int64_t[]){4}, &e) == PD_EINVAL);
  CHECK(pd_stw_add(w, "neg", PD_DTYPE_F32, 1, (int64_t[]){-1}, &e) == PD_EINVAL);
  CHECK(pd_stw_data_size(w) == 16 && pd_stw_header_size(w) % 8 == 0);
  CHECK(pd_stw_add(w, "late", PD_DTYPE_F32, 1, (int64_t[]){1}, &e) == PD_EINVAL);
  snprintf(p, sizeof p, "%s/short.safetensors", g_tmp);
  CHECK(pd_stw_begin(w, p, &e) == PD_OK);
  CHECK(pd_stw_write(w, a, 8, &e) == PD_OK);
  CHECK(pd_stw_write(w, a, 12, &e) == PD_ERANGE);
  CHECK(pd_stw_finish(w, false, &e) == PD_EFORMAT && strstr(e.msg, "'x'"));
  pd_stw_free(w);
  CHECK(!file_exists(g_tmp, "short.safetensors") && !file_exists(g_tmp, "short.safetensors.tmp"));
}

int main(void) {
  REQUIRE(stw_mkdtemp("make_model", g_tmp, sizeof g_tmp) == 0);
  test_st_write();
  test_bad_args();
  test_dry_run_counts();
  test_llama_tiny();
  test_sigma_cap();
  test_qwen2_f32();
  test_mistral_f16();
  test_quantized();
  test_pycoder_real_tokenizer();
  test_llama3_real_tokenizer();
  test_synthetic_full_vocab();
  if (!pd_test_failures) stw_rm_rf(g_tmp);
  else fprintf(stderr, "kept %s for inspection\n", g_tmp);
  return pd_test_finish("test_make_model");
}
