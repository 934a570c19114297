/* config.json parsing, RoPE inverse frequencies and the weight layout of pd_model_load: the four
 * bundled models, crafted configs, and damaged / converted / sharded copies in a temp dir. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/model.h"
#include "st_writer.h"

static int g_fail;
#define CHECK(c)                                                            \
  do {                                                                      \
    if (!(c)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
      g_fail++;                                                             \
    }                                                                       \
  } while (0)

#define MODELS PD_TEST_DATA "/models"
static char g_tmp[256];

/* ---- bundled models --------------------------------------------------------------------------- */

typedef struct expect {
  const char *name;
  pd_arch arch;
  int hidden, inter, layers, heads, kv, head_dim;
  bool tied, bias;
} expect;

/* Values read from each model's config.json by hand. */
static const expect k_models[] = {
    {"pycoder-12m", PD_ARCH_LLAMA, 384, 1024, 6, 6, 2, 64, false, false},
    {"pycoder-draft-2m", PD_ARCH_LLAMA, 192, 512, 2, 3, 1, 64, false, false},
    {"pycoder-qwen2-4m", PD_ARCH_QWEN2, 256, 768, 4, 4, 2, 64, true, true},
    {"tiny-random-llama31", PD_ARCH_LLAMA, 128, 384, 2, 2, 1, 64, false, false},
};

static bool w_is(const pd_weight *w, const pd_st *st, const char *name, int64_t rows,
                 int64_t cols) {
  const pd_st_tensor *t = pd_st_find(st, name);
  return t && w->data == t->data && w->dtype == t->dtype && w->rows == rows && w->cols == cols;
}

static void check_layout(const pd_model *m, const expect *x) {
  const pd_model_config *c = &m->cfg;
  const int64_t D = x->hidden, F = x->inter, Q = (int64_t)x->heads * x->head_dim,
                KV = (int64_t)x->kv * x->head_dim, V = 4096;
  CHECK(w_is(&m->tok_embeddings, m->st, "model.embed_tokens.weight", V, D));
  CHECK(w_is(&m->final_norm, m->st, "model.norm.weight", D, 1));
  if (x->tied) {
    CHECK(m->lm_head.data == m->tok_embeddings.data && m->lm_head.rows == V);
    CHECK(pd_st_find(m->st, "lm_head.weight") == NULL);
  } else {
    CHECK(w_is(&m->lm_head, m->st, "lm_head.weight", V, D));
    CHECK(m->lm_head.data != m->tok_embeddings.data);
  }
  CHECK(m->layers != NULL);
  for (int l = 0; m->layers && l < c->num_layers; l++) {
    const pd_layer_weights *L = &m->layers[l];
    char n[160];
#define IS(field, suffix, r, cc)                                   \
  snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);          \
  CHECK(w_is(&L->field, m->st, n, r, cc))
    IS(attn_norm, "input_layernorm.weight", D, 1);
    IS(ffn_norm, "post_attention_layernorm.weight", D, 1);
    IS(wq, "self_attn.q_proj.weight", Q, D);
    IS(wk, "self_attn.k_proj.weight", KV, D);
    IS(wv, "self_attn.v_proj.weight", KV, D);
    IS(wo, "self_attn.o_proj.weight", D, Q);
    IS(w_gate, "mlp.gate_proj.weight", F, D);
    IS(w_up, "mlp.up_proj.weight", F, D);
    IS(w_down, "mlp.down_proj.weight", D, F);
    if (x->bias) {
      IS(bq, "self_attn.q_proj.bias", Q, 1);
      IS(bk, "self_attn.k_proj.bias", KV, 1);
      IS(bv, "self_attn.v_proj.bias", KV, 1);
    } else {
      CHECK(!L->bq.data && !L->bk.data && !L->bv.data);
    }
    CHECK(!L->bo.data && !L->b_gate.data && !L->b_up.data && !L->b_down.data);
#undef IS
  }
}

static void test_bundled(void) {
  for (size_t i = 0; i < sizeof k_models / sizeof k_models[0]; i++) {
    const expect *x = &k_models[i];
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", MODELS, x->name);
    pd_err e = {0};
    pd_model *m = pd_model_load(dir, NULL, &e);
    if (!m) {
      fprintf(stderr, "load %s: %s\n", dir, e.msg);
      g_fail++;
      continue;
    }
    const pd_model_config *c = &m->cfg;
    CHECK(c->arch == x->arch);
    CHECK(strcmp(c->architecture, x->arch == PD_ARCH_QWEN2 ? "Qwen2ForCausalLM"
                                                           : "LlamaForCausalLM") == 0);
    CHECK(c->vocab_size == 4096 && c->hidden_size == x->hidden &&
          c->intermediate_size == x->inter && c->num_layers == x->layers &&
          c->num_heads == x->heads && c->num_kv_heads == x->kv && c->head_dim == x->head_dim);
    CHECK(c->max_position_embeddings == 2048 && c->rms_norm_eps == 1e-5);
    CHECK(c->tie_word_embeddings == x->tied && c->attention_bias == x->bias && !c->mlp_bias);
    CHECK(c->sliding_window == 0);
    CHECK(c->bos_token_id == -1 && c->n_eos == 1 && c->eos_token_ids[0] == 0);
    CHECK(c->dtype == PD_DTYPE_BF16);
    CHECK(strcmp(m->dir, dir) == 0);
    if (strcmp(x->name, "tiny-random-llama31") == 0) { /* old layout: rope_theta + rope_scaling */
      CHECK(c->rope.type == PD_ROPE_LLAMA3 && c->rope.theta == 500000.0 &&
            c->rope.factor == 8.0 && c->rope.low_freq_factor == 1.0 &&
            c->rope.high_freq_factor == 4.0 && c->rope.original_max_position_embeddings == 256);
    } else { /* new layout: rope_parameters */
      CHECK(c->rope.type == PD_ROPE_DEFAULT && c->rope.theta == 10000.0);
    }
    check_layout(m, x);
    pd_model_free(m);
  }
  pd_err e = {0};
  CHECK(pd_model_load(MODELS "/no-such-model", NULL, &e) == NULL && e.code == PD_ENOTFOUND);
  CHECK(pd_model_load(NULL, NULL, &e) == NULL && e.code == PD_EINVAL);
  CHECK(pd_model_load(MODELS "/no-such-model", NULL, NULL) == NULL); /* e may be NULL */
  pd_model_free(NULL);
}

/* ---- RoPE ------------------------------------------------------------------------------------- */

/* transformers' formulas, evaluated independently in double. regime: 0 high-frequency (kept),
 * 1 medium (smoothed), 2 low-frequency (divided by factor). */
static double ref_inv_freq(const pd_rope_config *r, int dim, int i, int *regime) {
  double inv = 1.0 / pow(r->theta, (double)(2 * i) / dim);
  *regime = 0;
  if (r->type == PD_ROPE_LINEAR) return inv / r->factor;
  if (r->type != PD_ROPE_LLAMA3) return inv;
  double old = r->original_max_position_embeddings;
  double low_wl = old / r->low_freq_factor, high_wl = old / r->high_freq_factor;
  double wl = 2 * M_PI / inv;
  if (wl < high_wl) return inv;
  if (wl > low_wl) {
    *regime = 2;
    return inv / r->factor;
  }
  *regime = 1;
  double s = (old / wl - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
  return (1 - s) * inv / r->factor + s * inv;
}

/* Compares pd_rope_inv_freq with the double reference; returns the regimes seen (bit mask). */
static int check_rope(const pd_model_config *c, double tol, const char *what) {
  int half = c->head_dim / 2, seen = 0;
  float *f = malloc((size_t)half * sizeof *f);
  pd_rope_inv_freq(c, f);
  double worst = 0;
  for (int i = 0; i < half; i++) {
    int regime;
    double ref = ref_inv_freq(&c->rope, c->head_dim, i, &regime);
    seen |= 1 << regime;
    double rel = fabs((double)f[i] - ref) / ref;
    if (rel > worst) worst = rel;
    if (!(rel <= tol)) {
      fprintf(stderr, "%s: inv_freq[%d] = %.9g, reference %.9g (rel %.3g > %.3g)\n", what, i,
              f[i], ref, rel, tol);
      g_fail++;
    }
  }
  free(f);
  return seen;
}

static void test_rope(void) {
  pd_model_config c;
  pd_err e = {0};
  CHECK(pd_model_config_load(MODELS "/pycoder-12m", &c, &e) == PD_OK);
  CHECK(check_rope(&c, 1e-6, "default theta=1e4 d=64") == 1);
  for (int hd = 2; hd <= 256; hd += 2) { /* every dimension, including non powers of two */
    c.head_dim = hd;
    c.rope.theta = hd % 4 ? 1e6 : 5e5;
    check_rope(&c, 1e-6, "default");
  }
  c.head_dim = 96;
  c.rope.type = PD_ROPE_LINEAR;
  c.rope.factor = 4.0;
  check_rope(&c, 1e-6, "linear factor=4 d=96");
  c.rope.factor = 3.0; /* not a power of two: the division rounds */
  check_rope(&c, 1e-6, "linear factor=3 d=96");

  CHECK(pd_model_config_load(MODELS "/tiny-random-llama31", &c, &e) == PD_OK);
  /* Every regime of the llama3 rule occurs with original_max_position_embeddings = 256. */
  CHECK(check_rope(&c, 1e-5, "llama3 tiny-random-llama31") == 7);
  /* Llama 3.1 8B's parameters. */
  c.head_dim = 128;
  c.rope.original_max_position_embeddings = 8192;
  CHECK(check_rope(&c, 1e-5, "llama3 Llama-3.1-8B") == 7);
  /* The first entry is exactly 1 for every type but linear (base ** 0 = 1). */
  float f[64];
  pd_rope_inv_freq(&c, f);
  CHECK(f[0] == 1.0f);
  /* Strictly decreasing frequencies. */
  for (int i = 1; i < 64; i++) CHECK(f[i] < f[i - 1]);
}

/* ---- crafted configs ------------------------------------------------------------------------ */

#define DIMS                                                                            \
  "\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2," \
  "\"num_attention_heads\":4"

static pd_status parse(const char *json, pd_model_config *c, pd_err *e) {
  pd_err_clear(e);
  return pd_model_config_parse(json, strlen(json), c, e);
}

/* {"architectures": [arch], DIMS, extra} */
static pd_status parse_with(const char *arch, const char *extra, pd_model_config *c, pd_err *e) {
  char buf[4096];
  snprintf(buf, sizeof buf, "{\"architectures\":[\"%s\"]," DIMS "%s%s}", arch, *extra ? "," : "",
           extra);
  return parse(buf, c, e);
}

static void expect_fail(pd_status got, const pd_err *e, pd_status code, const char *want,
                        int line) {
  if (got != code || e->code != code || !strstr(e->msg, want)) {
    fprintf(stderr, "line %d: got %d (%s), want %d with '%s'\n", line, got, e->msg, code, want);
    g_fail++;
  }
}
#define FAIL_WITH(call, code, want) expect_fail((call), &e, code, want, __LINE__)

static void test_config(void) {
  pd_model_config c;
  pd_err e = {0};

  /* Minimal Llama: everything else from LlamaConfig's defaults. */
  CHECK(parse_with("LlamaForCausalLM", "", &c, &e) == PD_OK);
  CHECK(c.arch == PD_ARCH_LLAMA && c.head_dim == 16 && c.num_kv_heads == 4 &&
        c.max_position_embeddings == 2048 && c.rms_norm_eps == 1e-6);
  CHECK(c.rope.type == PD_ROPE_DEFAULT && c.rope.theta == 10000.0);
  CHECK(!c.tie_word_embeddings && !c.attention_bias && !c.mlp_bias && c.sliding_window == 0);
  CHECK(c.bos_token_id == 1 && c.n_eos == 1 && c.eos_token_ids[0] == 2 && c.dtype == PD_DTYPE_BF16);

  /* head_dim: explicit (≠ hidden/heads), null, derived. */
  CHECK(parse_with("LlamaForCausalLM", "\"head_dim\":32", &c, &e) == PD_OK && c.head_dim == 32);
  CHECK(parse_with("LlamaForCausalLM", "\"head_dim\":null", &c, &e) == PD_OK && c.head_dim == 16);
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"head_dim\":15", &c, &e), PD_EFORMAT, "head_dim");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"head_dim\":-2", &c, &e), PD_EFORMAT, "head_dim");

  /* GQA. */
  CHECK(parse_with("LlamaForCausalLM", "\"num_key_value_heads\":2", &c, &e) == PD_OK &&
        c.num_kv_heads == 2);
  CHECK(parse_with("LlamaForCausalLM", "\"num_key_value_heads\":null", &c, &e) == PD_OK &&
        c.num_kv_heads == 4);
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"num_key_value_heads\":3", &c, &e), PD_EFORMAT,
            "num_key_value_heads");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"num_key_value_heads\":0", &c, &e), PD_EFORMAT,
            "num_key_value_heads");

  /* Missing or malformed required fields name the field. */
  static const char *required[] = {"vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads"};
  for (size_t i = 0; i < 5; i++) {
    char buf[1024], dims[512];
    snprintf(dims, sizeof dims, "%s", DIMS);
    /* Rename the field so it is missing. */
    char *p = strstr(dims, required[i]);
    CHECK(p != NULL);
    if (p) p[0] = 'X';
    snprintf(buf, sizeof buf, "{\"architectures\":[\"LlamaForCausalLM\"],%s}", dims);
    FAIL_WITH(parse(buf, &c, &e), PD_EFORMAT, required[i]);
  }
  FAIL_WITH(parse("{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":-5,"
                  "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                  "\"num_attention_heads\":4}",
                  &c, &e),
            PD_EFORMAT, "vocab_size");
  FAIL_WITH(parse("{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":100,"
                  "\"hidden_size\":64.5,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                  "\"num_attention_heads\":4}",
                  &c, &e),
            PD_EFORMAT, "hidden_size");
  FAIL_WITH(parse("{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":100,"
                  "\"hidden_size\":\"64\",\"intermediate_size\":128,\"num_hidden_layers\":2,"
                  "\"num_attention_heads\":4}",
                  &c, &e),
            PD_EFORMAT, "hidden_size");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"rms_norm_eps\":0", &c, &e), PD_EFORMAT,
            "rms_norm_eps");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"max_position_embeddings\":0", &c, &e), PD_EFORMAT,
            "max_position_embeddings");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"tie_word_embeddings\":1", &c, &e), PD_EFORMAT,
            "tie_word_embeddings");
  FAIL_WITH(parse("{not json", &c, &e), PD_EFORMAT, "JSON");
  FAIL_WITH(parse("[1,2]", &c, &e), PD_EFORMAT, "object");
  FAIL_WITH(parse("{" DIMS "}", &c, &e), PD_EFORMAT, "architectures");
  FAIL_WITH(parse("{\"architectures\":[]," DIMS "}", &c, &e), PD_EFORMAT, "architectures");

  /* Architectures. */
  FAIL_WITH(parse_with("GPT2LMHeadModel", "", &c, &e), PD_EUNSUPPORTED, "GPT2LMHeadModel");
  CHECK(parse("{\"model_type\":\"mistral\"," DIMS "}", &c, &e) == PD_OK &&
        c.arch == PD_ARCH_MISTRAL && strcmp(c.architecture, "MistralForCausalLM") == 0);
  FAIL_WITH(parse("{\"model_type\":\"gpt2\"," DIMS "}", &c, &e), PD_EUNSUPPORTED, "gpt2");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"hidden_act\":\"gelu\"", &c, &e), PD_EUNSUPPORTED,
            "gelu");
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"quantization_config\":{\"quant_method\":\"hqq\",\"bits\":4}", &c, &e),
            PD_EUNSUPPORTED, "hqq");
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"quantization_config\":{\"quant_method\":\"awq\",\"bits\":4}", &c, &e),
            PD_EFORMAT, "group_size is missing");
  CHECK(parse_with("LlamaForCausalLM",
                   "\"quantization_config\":{\"quant_method\":\"awq\",\"bits\":4,"
                   "\"group_size\":128,\"version\":\"GEMM\",\"zero_point\":true}", &c, &e) == PD_OK &&
        c.quant.method == PD_QUANT_AWQ && c.quant.group_size == 128);

  /* RoPE, new layout. */
  CHECK(parse_with("LlamaForCausalLM",
                   "\"rope_parameters\":{\"rope_theta\":500000.0,\"rope_type\":\"linear\","
                   "\"factor\":2.5}",
                   &c, &e) == PD_OK &&
        c.rope.type == PD_ROPE_LINEAR && c.rope.theta == 500000.0 && c.rope.factor == 2.5);
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"rope_parameters\":{\"rope_theta\":1e4,\"rope_type\":\"yarn\","
                       "\"factor\":4}",
                       &c, &e),
            PD_EUNSUPPORTED, "yarn");
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"rope_parameters\":{\"rope_theta\":1e4,\"rope_type\":\"linear\"}", &c,
                       &e),
            PD_EFORMAT, "factor");
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"rope_parameters\":{\"rope_type\":\"default\","
                       "\"partial_rotary_factor\":0.5}",
                       &c, &e),
            PD_EUNSUPPORTED, "partial_rotary_factor");
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"rope_parameters\":{\"full_attention\":{\"rope_type\":\"default\"}}", &c,
                       &e),
            PD_EUNSUPPORTED, "full_attention");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"rope_parameters\":{\"rope_theta\":-1}", &c, &e),
            PD_EFORMAT, "rope_theta");
  /* rope_parameters without rope_theta: the top-level one. */
  CHECK(parse_with("LlamaForCausalLM",
                   "\"rope_theta\":1000000.0,\"rope_parameters\":{\"rope_type\":\"default\"}", &c,
                   &e) == PD_OK &&
        c.rope.theta == 1e6);

  /* RoPE, old layout: "type" or "rope_type" in rope_scaling. */
  CHECK(parse_with("LlamaForCausalLM",
                   "\"rope_theta\":1000000,\"rope_scaling\":{\"type\":\"linear\",\"factor\":2}",
                   &c, &e) == PD_OK &&
        c.rope.type == PD_ROPE_LINEAR && c.rope.theta == 1e6 && c.rope.factor == 2.0);
  CHECK(parse_with("LlamaForCausalLM", "\"rope_theta\":20000,\"rope_scaling\":null", &c, &e) ==
            PD_OK &&
        c.rope.type == PD_ROPE_DEFAULT && c.rope.theta == 20000.0);
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"rope_scaling\":{\"type\":\"linear\",\"factor\":0}",
                       &c, &e),
            PD_EFORMAT, "rope_scaling.factor");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"rope_theta\":1e99", &c, &e), PD_EFORMAT,
            "rope_theta");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2}",
                       &c, &e),
            PD_EUNSUPPORTED, "dynamic");
  CHECK(parse_with("LlamaForCausalLM",
                   "\"max_position_embeddings\":4096,\"rope_scaling\":{\"rope_type\":\"llama3\","
                   "\"factor\":8,\"low_freq_factor\":1,\"high_freq_factor\":4}",
                   &c, &e) == PD_OK &&
        c.rope.type == PD_ROPE_LLAMA3 && c.rope.original_max_position_embeddings == 4096);
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
                       "\"high_freq_factor\":4,\"original_max_position_embeddings\":8192}",
                       &c, &e),
            PD_EFORMAT, "low_freq_factor");
  FAIL_WITH(parse_with("LlamaForCausalLM",
                       "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
                       "\"low_freq_factor\":4,\"high_freq_factor\":4}",
                       &c, &e),
            PD_EFORMAT, "high_freq_factor");

  /* Token ids. */
  CHECK(parse_with("LlamaForCausalLM", "\"eos_token_id\":[128001,128008,128009]", &c, &e) ==
            PD_OK &&
        c.n_eos == 3 && c.eos_token_ids[0] == 128001 && c.eos_token_ids[2] == 128009);
  CHECK(parse_with("LlamaForCausalLM", "\"eos_token_id\":null,\"bos_token_id\":null", &c, &e) ==
            PD_OK &&
        c.n_eos == 0 && c.bos_token_id == -1);
  CHECK(parse_with("LlamaForCausalLM", "\"eos_token_id\":7,\"bos_token_id\":5", &c, &e) ==
            PD_OK &&
        c.n_eos == 1 && c.eos_token_ids[0] == 7 && c.bos_token_id == 5);
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"eos_token_id\":[1,2,3,4,5,6,7,8,9]", &c, &e),
            PD_EFORMAT, "eos_token_id");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"eos_token_id\":[1,\"x\"]", &c, &e), PD_EFORMAT,
            "eos_token_id");
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"bos_token_id\":-3", &c, &e), PD_EFORMAT,
            "bos_token_id");

  /* dtype. */
  CHECK(parse_with("LlamaForCausalLM", "\"torch_dtype\":\"float16\"", &c, &e) == PD_OK &&
        c.dtype == PD_DTYPE_F16);
  CHECK(parse_with("LlamaForCausalLM", "\"dtype\":\"float32\",\"torch_dtype\":\"float16\"", &c,
                   &e) == PD_OK &&
        c.dtype == PD_DTYPE_F32);
  FAIL_WITH(parse_with("LlamaForCausalLM", "\"dtype\":\"int8\"", &c, &e), PD_EUNSUPPORTED,
            "int8");

  /* Biases. */
  CHECK(parse_with("LlamaForCausalLM", "\"attention_bias\":true,\"mlp_bias\":true", &c, &e) ==
            PD_OK &&
        c.attention_bias && c.mlp_bias);
  CHECK(parse_with("Qwen2ForCausalLM", "\"attention_bias\":false", &c, &e) == PD_OK &&
        c.attention_bias && !c.mlp_bias && c.bos_token_id == -1 && c.n_eos == 0 &&
        c.max_position_embeddings == 32768);
  CHECK(parse_with("MistralForCausalLM", "\"sliding_window\":null", &c, &e) == PD_OK &&
        !c.attention_bias && c.sliding_window == 0);

  /* Sliding windows. */
  CHECK(parse_with("MistralForCausalLM", "", &c, &e) == PD_OK && c.sliding_window == 4096 &&
        c.sliding_window_first_layer == 0);
  CHECK(parse_with("MistralForCausalLM", "\"sliding_window\":1024", &c, &e) == PD_OK &&
        c.sliding_window == 1024);
  FAIL_WITH(parse_with("MistralForCausalLM", "\"sliding_window\":-1", &c, &e), PD_EFORMAT,
            "sliding_window");
  CHECK(parse_with("LlamaForCausalLM", "\"sliding_window\":1024", &c, &e) == PD_OK &&
        c.sliding_window == 0);
  CHECK(parse_with("Qwen2ForCausalLM", "\"sliding_window\":4096,\"use_sliding_window\":false",
                   &c, &e) == PD_OK &&
        c.sliding_window == 0);
  CHECK(parse_with("Qwen2ForCausalLM",
                   "\"sliding_window\":512,\"use_sliding_window\":true,\"max_window_layers\":1",
                   &c, &e) == PD_OK &&
        c.sliding_window == 512 && c.sliding_window_first_layer == 1);
  CHECK(parse_with("Qwen2ForCausalLM",
                   "\"sliding_window\":512,\"use_sliding_window\":true,\"max_window_layers\":28",
                   &c, &e) == PD_OK &&
        c.sliding_window == 0); /* no layer reaches max_window_layers */
  CHECK(parse_with("Qwen2ForCausalLM",
                   "\"sliding_window\":512,\"use_sliding_window\":true,"
                   "\"layer_types\":[\"full_attention\",\"sliding_attention\"]",
                   &c, &e) == PD_OK &&
        c.sliding_window == 512 && c.sliding_window_first_layer == 1);
  FAIL_WITH(parse_with("Qwen2ForCausalLM",
                       "\"sliding_window\":512,\"use_sliding_window\":true,"
                       "\"layer_types\":[\"sliding_attention\",\"full_attention\"]",
                       &c, &e),
            PD_EUNSUPPORTED, "layer_types");
  FAIL_WITH(parse_with("Qwen2ForCausalLM", "\"layer_types\":[\"full_attention\"]", &c, &e),
            PD_EFORMAT, "layer_types");
}

/* ---- damaged / converted / sharded model directories ---------------------------------------- */

typedef struct variant {
  const char *cfg_from, *cfg_to; /* replace in config.json (must occur) */
  const char *convert;            /* "F32" or "F16": every BF16 tensor converted */
  const char *drop;               /* tensor left out */
  const char *shrink;             /* tensor written with one row less */
  const char *retype;             /* tensor written as I16 (same bytes) */
  bool llama_biases;              /* add every Llama attention and MLP bias (zeros) */
  int shards;                     /* > 1: sharded with an index */
} variant;

static int g_dirs;

/* Builds a model directory from src under g_tmp; returns 0 and its path. */
static int make_model(const char *src, const variant *v, char *dir, size_t cap) {
  snprintf(dir, cap, "%s/m%d", g_tmp, g_dirs++);
  if (mkdir(dir, 0700) != 0) return -1;
  char path[700];
  snprintf(path, sizeof path, "%s/config.json", src);
  size_t n;
  char *cfg = stw_read_file(path, &n);
  if (!cfg) return -1;
  char *out = malloc(n + 256);
  if (v->cfg_from) {
    char *p = strstr(cfg, v->cfg_from);
    if (!p) {
      fprintf(stderr, "make_model: '%s' not in %s\n", v->cfg_from, path);
      free(cfg);
      free(out);
      return -1;
    }
    size_t pre = (size_t)(p - cfg);
    memcpy(out, cfg, pre);
    strcpy(out + pre, v->cfg_to);
    strcat(out, p + strlen(v->cfg_from));
  } else {
    strcpy(out, cfg);
  }
  free(cfg);
  snprintf(path, sizeof path, "%s/config.json", dir);
  int rc = stw_write_file(path, out, strlen(out));
  free(out);
  if (rc) return -1;

  snprintf(path, sizeof path, "%s/model.safetensors", src);
  pd_err e = {0};
  pd_st *st = pd_st_open_file(path, &e);
  if (!st) return -1;
  int nsh = v->shards > 1 ? v->shards : 1;
  st_writer *w[4] = {0};
  for (int s = 0; s < nsh; s++) w[s] = stw_new();
  char *idx = malloc(64 + pd_st_count(st) * 200);
  size_t io = (size_t)sprintf(idx, "{\"weight_map\":{");
  bool first = true;
  for (size_t k = 0; k < pd_st_count(st); k++) {
    const pd_st_tensor *t = pd_st_at(st, k);
    int s = (int)(k * (size_t)nsh / pd_st_count(st));
    if (v->drop && strcmp(t->name, v->drop) == 0) continue;
    io += (size_t)sprintf(idx + io, "%s\"%s\":\"part%d.safetensors\"", first ? "" : ",",
                          t->name, s);
    first = false;
    int64_t shape[PD_ST_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    size_t nbytes = t->nbytes;
    const char *dt = pd_dtype_name(t->dtype);
    if (v->shrink && strcmp(t->name, v->shrink) == 0) {
      nbytes -= nbytes / (size_t)shape[0];
      shape[0]--;
    }
    if (v->retype && strcmp(t->name, v->retype) == 0) dt = "I16";
    if (v->convert && t->dtype == PD_DTYPE_BF16) {
      size_t ne = nbytes / 2;
      bool f32 = strcmp(v->convert, "F32") == 0;
      void *buf = malloc(ne * (f32 ? 4 : 2) + 1);
      const uint16_t *in = t->data;
      for (size_t i = 0; i < ne; i++) {
        float x = pd_bf16_to_f32(in[i]);
        if (f32) ((float *)buf)[i] = x;
        else ((uint16_t *)buf)[i] = pd_f32_to_f16(x);
      }
      rc |= stw_add(w[s], t->name, v->convert, t->ndim, shape, buf, ne * (f32 ? 4 : 2));
      free(buf);
    } else {
      rc |= stw_add(w[s], t->name, dt, t->ndim, shape, t->data, nbytes);
    }
  }
  if (v->llama_biases) {
    pd_model_config c;
    if (pd_model_config_load(src, &c, &e) != PD_OK) rc = -1;
    int64_t Q = (int64_t)c.num_heads * c.head_dim, KV = (int64_t)c.num_kv_heads * c.head_dim;
    int64_t F = c.intermediate_size, D = c.hidden_size;
    static const char *names[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                  "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                  "mlp.down_proj"};
    int64_t rows[] = {Q, KV, KV, D, F, F, D};
    uint16_t *zeros = calloc((size_t)(F > Q ? F : Q) + (size_t)D, 2);
    for (int l = 0; l < c.num_layers; l++)
      for (int b = 0; b < 7; b++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.%s.bias", l, names[b]);
        rc |= stw_add(w[0], name, "BF16", 1, &rows[b], zeros, (size_t)rows[b] * 2);
      }
    free(zeros);
  }
  sprintf(idx + io, "}}");
  for (int s = 0; s < nsh; s++) {
    if (nsh > 1) snprintf(path, sizeof path, "%s/part%d.safetensors", dir, s);
    else snprintf(path, sizeof path, "%s/model.safetensors", dir);
    rc |= stw_write(w[s], path, NULL);
    stw_free(w[s]);
  }
  if (nsh > 1) {
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    rc |= stw_write_file(path, idx, strlen(idx));
  }
  free(idx);
  pd_st_close(st);
  return rc ? -1 : 0;
}

static pd_model *load_variant(const char *model, const variant *v, pd_err *e) {
  char src[512], dir[512];
  snprintf(src, sizeof src, "%s/%s", MODELS, model);
  if (make_model(src, v, dir, sizeof dir) != 0) {
    fprintf(stderr, "cannot build variant of %s\n", model);
    g_fail++;
    return NULL;
  }
  pd_err_clear(e);
  return pd_model_load(dir, NULL, e);
}

static void expect_load_fail(const char *model, const variant *v, pd_status code,
                             const char *want1, const char *want2, int line) {
  pd_err e = {0};
  pd_model *m = load_variant(model, v, &e);
  if (m || e.code != code || !strstr(e.msg, want1) || (want2 && !strstr(e.msg, want2))) {
    fprintf(stderr, "line %d: %s: got %s (%d: %s), want %d with '%s' '%s'\n", line, model,
            m ? "success" : "failure", e.code, e.msg, code, want1, want2 ? want2 : "");
    g_fail++;
  }
  pd_model_free(m);
}

/* Every tensor of the original (bf16) appears in m with equal values. */
static void compare_with_original(const pd_model *m, const char *model, pd_dtype want) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s/model.safetensors", MODELS, model);
  pd_err e = {0};
  pd_st *orig = pd_st_open_file(path, &e);
  CHECK(orig != NULL);
  size_t bad = 0;
  for (size_t k = 0; orig && k < pd_st_count(orig); k++) {
    const pd_st_tensor *a = pd_st_at(orig, k), *b = pd_st_find(m->st, a->name);
    CHECK(b && b->dtype == want);
    if (!b) continue;
    size_t ne = a->nbytes / 2;
    for (size_t i = 0; i < ne; i++) {
      float x = pd_bf16_to_f32(((const uint16_t *)a->data)[i]), y;
      if (want == PD_DTYPE_F32) y = ((const float *)b->data)[i];
      else if (want == PD_DTYPE_F16) y = pd_f16_to_f32(((const uint16_t *)b->data)[i]);
      else y = pd_bf16_to_f32(((const uint16_t *)b->data)[i]);
      /* f16 keeps 11 significant bits, bf16 has 8: exact within f16's normal range. */
      float ax = fabsf(x);
      bool exact = want != PD_DTYPE_F16 || ax == 0 || (ax >= 6.2e-5f && ax <= 65504.f);
      if (exact ? x != y : fabsf(x - y) > 6e-8f) bad++;
    }
  }
  CHECK(bad == 0);
  pd_st_close(orig);
}

static void test_variants(void) {
  pd_err e = {0};
  const char *tiny = "tiny-random-llama31", *qwen = "pycoder-qwen2-4m";

  /* f32 and f16 copies load and hold the same values. */
  variant v32 = {.convert = "F32"}, v16 = {.convert = "F16"};
  pd_model *m = load_variant(tiny, &v32, &e);
  if (!m) fprintf(stderr, "f32 copy: %s\n", e.msg);
  CHECK(m && m->tok_embeddings.dtype == PD_DTYPE_F32 && m->layers[1].w_down.dtype == PD_DTYPE_F32);
  if (m) compare_with_original(m, tiny, PD_DTYPE_F32);
  pd_model_free(m);
  m = load_variant(qwen, &v16, &e);
  if (!m) fprintf(stderr, "f16 copy: %s\n", e.msg);
  CHECK(m && m->layers[0].bq.dtype == PD_DTYPE_F16 && m->lm_head.data == m->tok_embeddings.data);
  if (m) compare_with_original(m, qwen, PD_DTYPE_F16);
  pd_model_free(m);

  /* Sharded copies load and hold the same bytes. */
  variant vsh = {.shards = 3};
  m = load_variant(qwen, &vsh, &e);
  if (!m) fprintf(stderr, "sharded copy: %s\n", e.msg);
  if (m) {
    check_layout(m, &k_models[2]);
    compare_with_original(m, qwen, PD_DTYPE_BF16);
  }
  CHECK(m != NULL);
  pd_model_free(m);

  /* Damage: each error names the tensor. */
  variant vdrop = {.drop = "model.layers.1.self_attn.v_proj.weight"};
  expect_load_fail(tiny, &vdrop, PD_ENOTFOUND, "model.layers.1.self_attn.v_proj.weight", "[64, 128]",
                   __LINE__);
  variant vshrink = {.shrink = "model.layers.1.mlp.up_proj.weight"};
  expect_load_fail(tiny, &vshrink, PD_EFORMAT, "'model.layers.1.mlp.up_proj.weight' has shape [383, 128], expected [384, 128]",
                   NULL, __LINE__);
  variant vshrink2 = {.shrink = "model.norm.weight"};
  expect_load_fail(tiny, &vshrink2, PD_EFORMAT, "'model.norm.weight' has shape [127], expected [128]",
                   NULL, __LINE__);
  variant vretype = {.retype = "model.norm.weight"};
  expect_load_fail(tiny, &vretype, PD_EUNSUPPORTED, "model.norm.weight", "I16", __LINE__);
  variant vnohead = {.drop = "lm_head.weight"};
  expect_load_fail(tiny, &vnohead, PD_ENOTFOUND, "lm_head.weight", NULL, __LINE__);
  variant vnobias = {.drop = "model.layers.2.self_attn.k_proj.bias"};
  expect_load_fail(qwen, &vnobias, PD_ENOTFOUND, "model.layers.2.self_attn.k_proj.bias", NULL,
                   __LINE__);
  variant vffn = {.cfg_from = "\"intermediate_size\": 384", .cfg_to = "\"intermediate_size\": 256"};
  expect_load_fail(tiny, &vffn, PD_EFORMAT, "model.layers.0.mlp", "expected [256, 128]", __LINE__);
  variant vbias = {.cfg_from = "\"attention_bias\": false", .cfg_to = "\"attention_bias\": true"};
  expect_load_fail(tiny, &vbias, PD_ENOTFOUND, "model.layers.0.self_attn.q_proj.bias", NULL,
                   __LINE__);
  variant varch = {.cfg_from = "LlamaForCausalLM", .cfg_to = "GPT2LMHeadModel"};
  expect_load_fail(tiny, &varch, PD_EUNSUPPORTED, "GPT2LMHeadModel", "config.json", __LINE__);

  /* Llama with attention_bias and mlp_bias and every bias present. */
  variant vallb = {.cfg_from = "\"attention_bias\": false,",
                   .cfg_to = "\"attention_bias\": true, \"mlp_bias\": true, \"x\": false,",
                   .llama_biases = true};
  m = load_variant(tiny, &vallb, &e);
  if (!m) fprintf(stderr, "llama biases: %s\n", e.msg);
  CHECK(m && m->cfg.attention_bias && m->cfg.mlp_bias);
  for (int l = 0; m && l < 2; l++) {
    const pd_layer_weights *L = &m->layers[l];
    CHECK(L->bq.data && L->bq.rows == 128 && L->bk.rows == 64 && L->bv.rows == 64);
    CHECK(L->bo.data && L->bo.rows == 128 && L->bo.cols == 1);
    CHECK(L->b_gate.rows == 384 && L->b_up.rows == 384 && L->b_down.rows == 128 &&
          L->b_down.data != NULL);
  }
  pd_model_free(m);

  /* Tied, though lm_head.weight is stored: the embeddings serve as the head. */
  variant vtie = {.cfg_from = "\"tie_word_embeddings\": false",
                  .cfg_to = "\"tie_word_embeddings\": true"};
  m = load_variant(tiny, &vtie, &e);
  CHECK(m && m->lm_head.data == m->tok_embeddings.data);
  pd_model_free(m);

  /* A truncated model.safetensors. */
  char dir[512], path[600];
  variant plain = {0};
  CHECK(make_model(MODELS "/pycoder-draft-2m", &plain, dir, sizeof dir) == 0);
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  CHECK(truncate(path, 1000000) == 0);
  m = pd_model_load(dir, NULL, &e);
  CHECK(!m && e.code == PD_EFORMAT && strstr(e.msg, "model.safetensors") &&
        strstr(e.msg, "loading model"));
  pd_model_free(m);
  /* No weights at all. */
  CHECK(unlink(path) == 0);
  m = pd_model_load(dir, NULL, &e);
  CHECK(!m && e.code == PD_ENOTFOUND);
}

/* Random damage to a real config.json: never a crash; whatever parses satisfies the invariants
 * the engine relies on, and gives finite positive RoPE frequencies. */
static void test_config_fuzz(void) {
  size_t n = 0;
  char *orig = stw_read_file(MODELS "/tiny-random-llama31/config.json", &n);
  CHECK(orig != NULL);
  if (!orig) return;
  char *buf = malloc(n + 1);
  uint64_t rng = 88172645463325252ull;
  static const char pick[] = "{}[]\",:0123456789-.eE ntf";
  int ok = 0;
  for (int iter = 0; iter < 3000; iter++) {
    memcpy(buf, orig, n);
    size_t len = n;
    for (int k = 0; k < 3; k++) {
      rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
      size_t at = (size_t)(rng % n);
      if ((rng >> 40) % 8 == 0) len = at;
      else buf[at] = pick[(rng >> 20) % (sizeof pick - 1)];
    }
    pd_model_config c;
    pd_err e = {0};
    pd_status s = pd_model_config_parse(buf, len, &c, &e);
    if (s != PD_OK) {
      CHECK((s == PD_EFORMAT || s == PD_EUNSUPPORTED) && e.code == s && e.msg[0]);
      continue;
    }
    ok++;
    CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0);
    CHECK(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0);
    CHECK(c.head_dim >= 2 && c.head_dim % 2 == 0 && c.head_dim <= 8192);
    CHECK(c.rms_norm_eps > 0 && c.rope.theta > 0 && c.rope.factor > 0);
    CHECK(c.n_eos >= 0 && c.n_eos <= PD_MAX_EOS);
    float *f = malloc((size_t)c.head_dim / 2 * sizeof *f);
    pd_rope_inv_freq(&c, f);
    for (int i = 0; i < c.head_dim / 2; i++) CHECK(isfinite(f[i]) && f[i] >= 0);
    free(f);
  }
  CHECK(ok > 0);
  free(buf);
  free(orig);
}

int main(void) {
  if (stw_mkdtemp("model", g_tmp, sizeof g_tmp)) return 1;
  test_bundled();
  test_rope();
  test_config();
  test_variants();
  test_config_fuzz();
  stw_rm_rf(g_tmp);
  if (g_fail) {
    fprintf(stderr, "test_model: %d check(s) failed\n", g_fail);
    return 1;
  }
  printf("test_model: ok\n");
  return 0;
}
