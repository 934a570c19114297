/* config.json of Llama / Qwen2 / Mistral checkpoints, and their RoPE inverse frequencies.
 *
 * Defaults for absent fields follow transformers' LlamaConfig, Qwen2Config and MistralConfig
 * (5.x), except the model's dimensions (vocab_size, hidden_size, intermediate_size,
 * num_hidden_layers, num_attention_heads), which a real checkpoint always writes and which we
 * therefore require. A JSON null counts as absent wherever transformers accepts None. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/model.h"

#define CFG_MAX_BYTES ((off_t)16 << 20) /* config.json size limit */
#define CFG_MAX_DIM (1 << 28)          /* vocab, hidden, intermediate sizes */
#define CFG_MAX_LAYERS 4096
#define CFG_MAX_HEADS 4096
#define CFG_MAX_HEAD_DIM 8192

/* ---- typed field access --------------------------------------------------------------------- */

/* obj[key], or NULL when absent or JSON null. */
static const cJSON *cfg_get(const cJSON *obj, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
  return (v && !cJSON_IsNull(v)) ? v : NULL;
}

/* v (not NULL) as an integer in [lo, hi]; field names it in messages. */
static pd_status cfg_as_int(const cJSON *v, const char *field, long lo, long hi, int *out,
                            pd_err *e) {
  if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
    return pd_err_set(e, PD_EFORMAT, "config: field '%s' must be an integer", field);
  double d = v->valuedouble;
  if (d < (double)lo || d > (double)hi)
    return pd_err_set(e, PD_EFORMAT, "config: field '%s' = %.17g is out of range [%ld, %ld]",
                      field, d, lo, hi);
  *out = (int)d;
  return PD_OK;
}

static pd_status cfg_int_req(const cJSON *o, const char *key, long lo, long hi, int *out,
                             pd_err *e) {
  const cJSON *v = cfg_get(o, key);
  if (!v) return pd_err_set(e, PD_EFORMAT, "config: required field '%s' is missing", key);
  return cfg_as_int(v, key, lo, hi, out, e);
}

static pd_status cfg_int_opt(const cJSON *o, const char *key, int def, long lo, long hi,
                             int *out, pd_err *e) {
  const cJSON *v = cfg_get(o, key);
  if (!v) {
    *out = def;
    return PD_OK;
  }
  return cfg_as_int(v, key, lo, hi, out, e);
}

/* v (not NULL) as a number in (lo, hi]. */
static pd_status cfg_as_num(const cJSON *v, const char *field, double lo, double hi, double *out,
                            pd_err *e) {
  if (!cJSON_IsNumber(v) || !(v->valuedouble > lo && v->valuedouble <= hi))
    return pd_err_set(e, PD_EFORMAT, "config: field '%s' must be a number in (%g, %g]", field,
                      lo, hi);
  *out = v->valuedouble;
  return PD_OK;
}

/* v (not NULL) as a finite number > 0 that float32 arithmetic handles comfortably. */
static pd_status cfg_as_pos(const cJSON *v, const char *field, double *out, pd_err *e) {
  return cfg_as_num(v, field, 0.0, 1e30, out, e);
}

static pd_status cfg_bool_opt(const cJSON *o, const char *key, bool def, bool *out, pd_err *e) {
  const cJSON *v = cfg_get(o, key);
  if (!v) {
    *out = def;
    return PD_OK;
  }
  if (!cJSON_IsBool(v))
    return pd_err_set(e, PD_EFORMAT, "config: field '%s' must be true or false", key);
  *out = cJSON_IsTrue(v);
  return PD_OK;
}

#define TRY(x)                     \
  do {                             \
    pd_status s_ = (x);            \
    if (s_ != PD_OK) return s_;    \
  } while (0)

/* ---- sections ------------------------------------------------------------------------------ */

static pd_status cfg_arch(const cJSON *root, pd_model_config *c, pd_err *e) {
  static const struct {
    const char *arch, *model_type;
    pd_arch id;
  } known[] = {{"LlamaForCausalLM", "llama", PD_ARCH_LLAMA},
               {"Qwen2ForCausalLM", "qwen2", PD_ARCH_QWEN2},
               {"MistralForCausalLM", "mistral", PD_ARCH_MISTRAL}};
  const cJSON *a = cfg_get(root, "architectures");
  const char *name = NULL;
  if (a) {
    if (!cJSON_IsArray(a) || !cJSON_IsString(a->child))
      return pd_err_set(e, PD_EFORMAT,
                        "config: field 'architectures' must be a non-empty list of strings");
    name = a->child->valuestring;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
      if (strcmp(name, known[i].arch) == 0) {
        c->arch = known[i].id;
        snprintf(c->architecture, sizeof c->architecture, "%s", name);
        return PD_OK;
      }
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "config: architecture '%.64s' is not supported (supported: "
                      "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)",
                      name);
  }
  /* No architectures list: transformers' Auto classes fall back on model_type. */
  const cJSON *mt = cfg_get(root, "model_type");
  if (!cJSON_IsString(mt))
    return pd_err_set(e, PD_EFORMAT, "config: required field 'architectures' is missing");
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    if (strcmp(mt->valuestring, known[i].model_type) == 0) {
      c->arch = known[i].id;
      snprintf(c->architecture, sizeof c->architecture, "%s", known[i].arch);
      return PD_OK;
    }
  return pd_err_set(e, PD_EUNSUPPORTED,
                    "config: model_type '%.64s' is not supported (supported: llama, qwen2, "
                    "mistral)",
                    mt->valuestring);
}

/* RoPE: transformers 5 writes {"rope_parameters": {"rope_theta", "rope_type", "factor", ...}};
 * older files have a top-level "rope_theta" and "rope_scaling": {"type" | "rope_type", ...}. */
static pd_status cfg_rope(const cJSON *root, pd_model_config *c, pd_err *e) {
  pd_rope_config *r = &c->rope;
  const cJSON *sc = NULL;
  const char *where = "rope_scaling";
  const cJSON *rp = cfg_get(root, "rope_parameters");
  if (rp) {
    if (!cJSON_IsObject(rp))
      return pd_err_set(e, PD_EFORMAT, "config: field 'rope_parameters' must be an object");
    sc = rp;
    where = "rope_parameters";
  } else {
    const cJSON *rs = cfg_get(root, "rope_scaling");
    if (rs && !cJSON_IsObject(rs))
      return pd_err_set(e, PD_EFORMAT, "config: field 'rope_scaling' must be an object");
    sc = rs;
  }
  char field[64];

  const cJSON *th = sc ? cfg_get(sc, "rope_theta") : NULL;
  snprintf(field, sizeof field, "%s.rope_theta", where);
  if (!th) {
    th = cfg_get(root, "rope_theta");
    snprintf(field, sizeof field, "rope_theta");
  }
  r->theta = 10000.0; /* transformers' default_theta for these models */
  if (th) TRY(cfg_as_num(th, field, 1.0, 1e30, &r->theta, e)); /* theta <= 1: no decay */

  const cJSON *ty = sc ? cfg_get(sc, "rope_type") : NULL;
  if (!ty && sc) ty = cfg_get(sc, "type");
  if (ty && !cJSON_IsString(ty))
    return pd_err_set(e, PD_EFORMAT, "config: field '%s.rope_type' must be a string", where);
  if (!ty && sc == rp && rp) {
    /* Per-layer-type parameters ({"full_attention": {...}, ...}) belong to other families. */
    for (const cJSON *it = rp->child; it; it = it->next)
      if (cJSON_IsObject(it))
        return pd_err_set(e, PD_EUNSUPPORTED,
                          "config: per-layer-type rope_parameters ('%.40s') are not supported",
                          it->string ? it->string : "");
  }
  const char *type = ty ? ty->valuestring : "default";

  const cJSON *prf = sc ? cfg_get(sc, "partial_rotary_factor") : NULL;
  if (!prf) prf = cfg_get(root, "partial_rotary_factor");
  if (prf && (!cJSON_IsNumber(prf) || prf->valuedouble != 1.0))
    return pd_err_set(e, PD_EUNSUPPORTED, "config: partial_rotary_factor != 1 is not supported");

  r->factor = 1.0;
  r->low_freq_factor = 0.0;
  r->high_freq_factor = 0.0;
  r->original_max_position_embeddings = 0;
  if (strcmp(type, "default") == 0) {
    r->type = PD_ROPE_DEFAULT;
    return PD_OK;
  }
  bool linear = strcmp(type, "linear") == 0, llama3 = strcmp(type, "llama3") == 0;
  if (!linear && !llama3)
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "config: RoPE type '%.40s' (%s) is not supported (supported: default, "
                      "linear, llama3)",
                      type, where);
  r->type = linear ? PD_ROPE_LINEAR : PD_ROPE_LLAMA3;
  const cJSON *v = cfg_get(sc, "factor");
  snprintf(field, sizeof field, "%s.factor", where);
  if (!v) return pd_err_set(e, PD_EFORMAT, "config: required field '%s' is missing", field);
  /* transformers expects factor >= 1 (it warns otherwise); below 1e-3 float32 breaks down. */
  TRY(cfg_as_num(v, field, 1e-3, 1e6, &r->factor, e));
  if (linear) return PD_OK;

  static const char *names[2] = {"low_freq_factor", "high_freq_factor"};
  double *dst[2] = {&r->low_freq_factor, &r->high_freq_factor};
  for (int i = 0; i < 2; i++) {
    snprintf(field, sizeof field, "%s.%s", where, names[i]);
    v = cfg_get(sc, names[i]);
    if (!v) return pd_err_set(e, PD_EFORMAT, "config: required field '%s' is missing", field);
    TRY(cfg_as_num(v, field, 0.0, 1e6, dst[i], e));
  }
  if (!(r->high_freq_factor > r->low_freq_factor))
    return pd_err_set(e, PD_EFORMAT,
                      "config: %s.high_freq_factor (%g) must exceed low_freq_factor (%g)", where,
                      r->high_freq_factor, r->low_freq_factor);
  snprintf(field, sizeof field, "%s.original_max_position_embeddings", where);
  v = cfg_get(sc, "original_max_position_embeddings");
  if (v) return cfg_as_int(v, field, 1, INT_MAX, &r->original_max_position_embeddings, e);
  r->original_max_position_embeddings = c->max_position_embeddings;
  return PD_OK;
}

static pd_status cfg_dtype(const cJSON *root, pd_model_config *c, pd_err *e) {
  const char *key = "dtype";
  const cJSON *v = cfg_get(root, key);
  if (!v) v = cfg_get(root, key = "torch_dtype");
  c->dtype = PD_DTYPE_BF16;
  if (!v) return PD_OK;
  if (!cJSON_IsString(v))
    return pd_err_set(e, PD_EFORMAT, "config: field '%s' must be a string", key);
  const char *s = v->valuestring;
  if (strncmp(s, "torch.", 6) == 0) s += 6;
  if (strcmp(s, "bfloat16") == 0) c->dtype = PD_DTYPE_BF16;
  else if (strcmp(s, "float16") == 0 || strcmp(s, "half") == 0) c->dtype = PD_DTYPE_F16;
  else if (strcmp(s, "float32") == 0 || strcmp(s, "float") == 0) c->dtype = PD_DTYPE_F32;
  else
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "config: %s '%.32s' is not supported (bfloat16, float16, float32)", key, s);
  return PD_OK;
}

static pd_status cfg_tokens(const cJSON *root, pd_model_config *c, pd_err *e) {
  /* Llama and Mistral default to bos 1 / eos 2; Qwen2 to none. */
  bool has_defaults = c->arch != PD_ARCH_QWEN2;
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(root, "bos_token_id");
  c->bos_token_id = (!b && has_defaults) ? 1 : -1;
  if (b && !cJSON_IsNull(b)) TRY(cfg_as_int(b, "bos_token_id", 0, INT_MAX, &c->bos_token_id, e));

  const cJSON *eo = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
  c->n_eos = 0;
  if (!eo) {
    if (has_defaults) c->eos_token_ids[c->n_eos++] = 2;
  } else if (cJSON_IsArray(eo)) {
    int n = cJSON_GetArraySize(eo);
    if (n > PD_MAX_EOS)
      return pd_err_set(e, PD_EFORMAT, "config: field 'eos_token_id' lists %d ids (at most %d)",
                        n, PD_MAX_EOS);
    for (const cJSON *x = eo->child; x; x = x->next)
      TRY(cfg_as_int(x, "eos_token_id", 0, INT_MAX, &c->eos_token_ids[c->n_eos++], e));
  } else if (!cJSON_IsNull(eo)) {
    TRY(cfg_as_int(eo, "eos_token_id", 0, INT_MAX, &c->eos_token_ids[0], e));
    c->n_eos = 1;
  }
  return PD_OK;
}

/* Sliding-window attention. Mistral: "sliding_window" on every layer (absent: 4096, null: none).
 * Qwen2: only with use_sliding_window, and only on the layers that layer_types marks
 * "sliding_attention" (derived as layers >= max_window_layers when layer_types is absent). */
static pd_status cfg_sliding(const cJSON *root, pd_model_config *c, pd_err *e) {
  c->sliding_window = 0;
  c->sliding_window_first_layer = 0;
  if (c->arch == PD_ARCH_LLAMA) return PD_OK;
  const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
  int win = 0;
  if (!sw) win = 4096;
  else if (!cJSON_IsNull(sw)) TRY(cfg_as_int(sw, "sliding_window", 1, INT_MAX, &win, e));
  if (c->arch == PD_ARCH_MISTRAL) {
    c->sliding_window = win;
    return PD_OK;
  }
  bool use = false;
  TRY(cfg_bool_opt(root, "use_sliding_window", false, &use, e));
  const cJSON *lt = cfg_get(root, "layer_types");
  int first = c->num_layers; /* first "sliding_attention" layer */
  if (lt) {
    if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->num_layers)
      return pd_err_set(e, PD_EFORMAT,
                        "config: field 'layer_types' must list one type per layer (%d)",
                        c->num_layers);
    int i = 0;
    for (const cJSON *x = lt->child; x; x = x->next, i++) {
      bool full = cJSON_IsString(x) && strcmp(x->valuestring, "full_attention") == 0;
      bool slide = cJSON_IsString(x) && strcmp(x->valuestring, "sliding_attention") == 0;
      if (!full && !slide)
        return pd_err_set(e, PD_EUNSUPPORTED, "config: layer_types[%d] is not supported", i);
      if (slide && first == c->num_layers) first = i;
      if (full && first < i && use && win > 0)
        return pd_err_set(e, PD_EUNSUPPORTED,
                          "config: layer_types interleave full and sliding attention "
                          "(layer %d); only a sliding suffix is supported",
                          i);
    }
  } else {
    TRY(cfg_int_opt(root, "max_window_layers", 28, 0, INT_MAX, &first, e));
    if (first > c->num_layers) first = c->num_layers;
  }
  if (use && win > 0 && first < c->num_layers) {
    c->sliding_window = win;
    c->sliding_window_first_layer = first;
  }
  return PD_OK;
}

/* obj[key] as a string, or NULL. */
static const char *cfg_str(const cJSON *obj, const char *key) {
  const cJSON *v = cfg_get(obj, key);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* The group size of a quantization: -1 (or 0) is one group per row; otherwise a multiple of the
 * 32-element blocks the kernels dequantize. */
static pd_status cfg_quant_group(const cJSON *v, const char *field, int *out, pd_err *e) {
  int g = 0;
  if (!v) return pd_err_set(e, PD_EFORMAT, "config: %s is missing", field);
  TRY(cfg_as_int(v, field, -1, 1 << 20, &g, e));
  if (g <= 0) g = 0;
  if (g && g % PD_Q4_BLOCK)
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "config: %s %d is not supported (a multiple of %d, or -1)", field, g,
                      PD_Q4_BLOCK);
  *out = g;
  return PD_OK;
}

static pd_status cfg_bits4(const cJSON *v, const char *field, pd_err *e) {
  int b = 0;
  if (!v) return pd_err_set(e, PD_EFORMAT, "config: %s is missing", field);
  TRY(cfg_as_int(v, field, 1, 64, &b, e));
  if (b != 4)
    return pd_err_set(e, PD_EUNSUPPORTED, "config: %s %d is not supported (4-bit weights only)",
                      field, b);
  return PD_OK;
}

/* quantization_config: AWQ (gemm), GPTQ and compressed-tensors pack-quantized, 4-bit. Anything
 * else is refused naming what it is. */
/* compressed-tensors kv_cache_scheme: FP8 (e4m3) per-tensor static scales, the layers'
 * self_attn.k_scale / v_scale, used with --kv-cache-dtype fp8. */
static pd_status cfg_kv_scheme(const cJSON *q, pd_quant_config *out, pd_err *e) {
  const cJSON *kv = cfg_get(q, "kv_cache_scheme");
  if (!kv) return PD_OK;
  const char *type = cfg_str(kv, "type"), *strat = cfg_str(kv, "strategy");
  int b = 0;
  if (!cfg_get(kv, "num_bits") ||
      cfg_as_int(cfg_get(kv, "num_bits"), "kv_cache_scheme.num_bits", 1, 64, &b, e) != PD_OK ||
      b != 8 || !type || strcmp(type, "float") != 0 || (strat && strcmp(strat, "tensor") != 0) ||
      cJSON_IsTrue(cfg_get(kv, "dynamic")))
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "config: compressed-tensors kv_cache_scheme other than FP8 with static "
                      "per-tensor scales (%d bits, type '%.16s', strategy '%.16s') is not "
                      "supported", b, type ? type : "?", strat ? strat : "?");
  out->kv_fp8_scales = true;
  return PD_OK;
}

static pd_status cfg_quant(const cJSON *q, pd_quant_config *out, pd_err *e) {
  memset(out, 0, sizeof *out);
  if (!cJSON_IsObject(q)) return pd_err_set(e, PD_EFORMAT, "config: quantization_config is not an object");
  const char *m = cfg_str(q, "quant_method");
  if (!m) return pd_err_set(e, PD_EFORMAT, "config: quantization_config.quant_method is missing");
  out->bits = 4;
  if (!strcmp(m, "awq")) {
    const char *ver = cfg_str(q, "version");
    if (ver && strcasecmp(ver, "gemm") != 0)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: AWQ version '%.32s' is not supported (gemm)", ver);
    TRY(cfg_bits4(cfg_get(q, "bits") ? cfg_get(q, "bits") : cfg_get(q, "w_bit"),
                  "quantization_config.bits", e));
    const cJSON *g = cfg_get(q, "group_size") ? cfg_get(q, "group_size") : cfg_get(q, "q_group_size");
    TRY(cfg_quant_group(g, "quantization_config.group_size", &out->group_size, e));
    bool zp = true;
    TRY(cfg_bool_opt(q, "zero_point", true, &zp, e));
    if (!zp)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: AWQ without zero points (zero_point false) is not supported");
    out->method = PD_QUANT_AWQ;
    return PD_OK;
  }
  if (!strcmp(m, "gptq")) {
    TRY(cfg_bits4(cfg_get(q, "bits"), "quantization_config.bits", e));
    TRY(cfg_quant_group(cfg_get(q, "group_size"), "quantization_config.group_size",
                        &out->group_size, e));
    const char *f = cfg_str(q, "checkpoint_format");
    if (!f) f = cfg_str(q, "format");
    if (f && strcmp(f, "gptq") != 0 && strcmp(f, "gptq_v2") != 0)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: GPTQ checkpoint_format '%.32s' is not supported (gptq, gptq_v2)", f);
    if (cfg_get(q, "dynamic"))
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: GPTQ per-module 'dynamic' overrides are not supported yet");
    out->method = PD_QUANT_GPTQ;
    out->zeros_minus_one = !f || !strcmp(f, "gptq");
    TRY(cfg_bool_opt(q, "sym", true, &out->sym, e));
    return PD_OK;
  }
  if (!strcmp(m, "compressed-tensors")) {
    const char *fmt = cfg_str(q, "format");
    const cJSON *groups = cfg_get(q, "config_groups");
    const cJSON *grp = groups && cJSON_IsObject(groups) ? groups->child : NULL;
    if (!grp || grp->next)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: compressed-tensors with %s config group is not supported (one)",
                        grp ? "more than one" : "no");
    const char *gfmt = cfg_str(grp, "format");
    if (gfmt) fmt = gfmt;
    if (fmt && !strcmp(fmt, "float-quantized")) {
      const cJSON *w = cfg_get(grp, "weights");
      if (!cJSON_IsObject(w))
        return pd_err_set(e, PD_EFORMAT, "config: compressed-tensors group without 'weights'");
      int b = 0;
      if (!cfg_get(w, "num_bits"))
        return pd_err_set(e, PD_EFORMAT, "config: weights.num_bits is missing");
      TRY(cfg_as_int(cfg_get(w, "num_bits"), "weights.num_bits", 1, 64, &b, e));
      const char *type = cfg_str(w, "type"), *strat = cfg_str(w, "strategy");
      if (b != 8 || !type || strcmp(type, "float") != 0)
        return pd_err_set(e, PD_EUNSUPPORTED,
                          "config: compressed-tensors float-quantized weights of %d bits, type "
                          "'%.16s' (8-bit float only)", b, type ? type : "?");
      if (strat && strcmp(strat, "channel") != 0 && strcmp(strat, "tensor") != 0)
        return pd_err_set(e, PD_EUNSUPPORTED,
                          "config: FP8 weights.strategy '%.16s' is not supported (channel, "
                          "tensor)", strat);
      const cJSON *in = cfg_get(grp, "input_activations");
      if (in) {
        bool dyn = false;
        TRY(cfg_bool_opt(in, "dynamic", false, &dyn, e));
        const char *is = cfg_str(in, "strategy"), *it = cfg_str(in, "type");
        const bool dyn_ok = dyn && (!is || !strcmp(is, "token"));
        const bool static_ok = !dyn && is && !strcmp(is, "tensor");
        if (!(dyn_ok || static_ok) || (it && strcmp(it, "float") != 0))
          return pd_err_set(e, PD_EUNSUPPORTED,
                            "config: FP8 input activations other than dynamic per token or static "
                            "per tensor (%s, strategy '%.16s') are not supported",
                            dyn ? "dynamic" : "static", is ? is : "?");
        out->act_fp8_dynamic = dyn_ok;
        out->act_fp8_static = static_ok;
      }
      TRY(cfg_kv_scheme(q, out, e));
      out->bits = 8;
      out->method = PD_QUANT_CT_FP8;
      return PD_OK;
    }
    if (!fmt || strcmp(fmt, "pack-quantized") != 0)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: compressed-tensors format '%.32s' is not supported yet "
                        "(pack-quantized)", fmt ? fmt : "?");
    const cJSON *w = cfg_get(grp, "weights");
    if (!cJSON_IsObject(w))
      return pd_err_set(e, PD_EFORMAT, "config: compressed-tensors group without 'weights'");
    if (cfg_get(grp, "input_activations"))
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: compressed-tensors activation quantization is not supported "
                        "with pack-quantized weights");
    TRY(cfg_bits4(cfg_get(w, "num_bits"), "weights.num_bits", e));
    const char *type = cfg_str(w, "type");
    if (type && strcmp(type, "int") != 0)
      return pd_err_set(e, PD_EUNSUPPORTED, "config: compressed-tensors weights.type '%.16s'", type);
    const char *strat = cfg_str(w, "strategy");
    if (strat && !strcmp(strat, "channel")) {
      out->group_size = 0;
    } else if (!strat || !strcmp(strat, "group")) {
      TRY(cfg_quant_group(cfg_get(w, "group_size"), "weights.group_size", &out->group_size, e));
    } else {
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: compressed-tensors weights.strategy '%.16s' is not supported "
                        "(group, channel)", strat);
    }
    const char *ao = cfg_str(w, "actorder");
    if (ao && strcmp(ao, "static") != 0)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "config: compressed-tensors weights.actorder '%.16s' is not supported "
                        "yet (static)", ao);
    TRY(cfg_bool_opt(w, "symmetric", true, &out->sym, e));
    TRY(cfg_kv_scheme(q, out, e));
    out->method = PD_QUANT_CT_PACKED;
    return PD_OK;
  }
  return pd_err_set(e, PD_EUNSUPPORTED,
                    "config: quantization_config.quant_method '%.32s' is not supported (awq, "
                    "gptq, compressed-tensors)", m);
}

static pd_status cfg_parse_root(const cJSON *root, pd_model_config *c, pd_err *e) {
  if (!cJSON_IsObject(root))
    return pd_err_set(e, PD_EFORMAT, "config: top level is not a JSON object");
  TRY(cfg_arch(root, c, e));

  const cJSON *q = cfg_get(root, "quantization_config");
  if (q) TRY(cfg_quant(q, &c->quant, e));
  const cJSON *act = cfg_get(root, "hidden_act");
  if (act && !(cJSON_IsString(act) && (strcmp(act->valuestring, "silu") == 0 ||
                                       strcmp(act->valuestring, "swish") == 0)))
    return pd_err_set(e, PD_EUNSUPPORTED, "config: hidden_act '%.32s' is not supported (silu)",
                      cJSON_IsString(act) ? act->valuestring : "?");

  TRY(cfg_int_req(root, "vocab_size", 1, CFG_MAX_DIM, &c->vocab_size, e));
  TRY(cfg_int_req(root, "hidden_size", 1, CFG_MAX_DIM, &c->hidden_size, e));
  TRY(cfg_int_req(root, "intermediate_size", 1, CFG_MAX_DIM, &c->intermediate_size, e));
  TRY(cfg_int_req(root, "num_hidden_layers", 1, CFG_MAX_LAYERS, &c->num_layers, e));
  TRY(cfg_int_req(root, "num_attention_heads", 1, CFG_MAX_HEADS, &c->num_heads, e));
  TRY(cfg_int_opt(root, "num_key_value_heads", c->num_heads, 1, CFG_MAX_HEADS, &c->num_kv_heads,
                  e));
  if (c->num_heads % c->num_kv_heads != 0)
    return pd_err_set(e, PD_EFORMAT,
                      "config: num_attention_heads (%d) is not a multiple of "
                      "num_key_value_heads (%d)",
                      c->num_heads, c->num_kv_heads);
  /* transformers: head_dim = config.head_dim or hidden_size // num_attention_heads */
  TRY(cfg_int_opt(root, "head_dim", 0, 0, CFG_MAX_HEAD_DIM, &c->head_dim, e));
  if (c->head_dim == 0) c->head_dim = c->hidden_size / c->num_heads;
  if (c->head_dim < 2 || c->head_dim % 2 != 0)
    return pd_err_set(e, PD_EFORMAT, "config: head_dim (%d) must be even and positive (RoPE)",
                      c->head_dim);
  int max_pos_default = c->arch == PD_ARCH_QWEN2     ? 32768
                        : c->arch == PD_ARCH_MISTRAL ? 4096 * 32
                                                     : 2048;
  TRY(cfg_int_opt(root, "max_position_embeddings", max_pos_default, 1, INT_MAX,
                  &c->max_position_embeddings, e));
  c->rms_norm_eps = 1e-6;
  const cJSON *eps = cfg_get(root, "rms_norm_eps");
  if (eps) TRY(cfg_as_pos(eps, "rms_norm_eps", &c->rms_norm_eps, e));
  TRY(cfg_rope(root, c, e));
  TRY(cfg_bool_opt(root, "tie_word_embeddings", false, &c->tie_word_embeddings, e));
  if (c->arch == PD_ARCH_LLAMA) {
    TRY(cfg_bool_opt(root, "attention_bias", false, &c->attention_bias, e));
    TRY(cfg_bool_opt(root, "mlp_bias", false, &c->mlp_bias, e));
  } else {
    c->attention_bias = c->arch == PD_ARCH_QWEN2; /* fixed by the architecture */
    c->mlp_bias = false;
  }
  TRY(cfg_sliding(root, c, e));
  TRY(cfg_tokens(root, c, e));
  return cfg_dtype(root, c, e);
}

pd_status pd_model_config_parse(const char *json, size_t len, pd_model_config *c, pd_err *e) {
  if (!json || !c) return pd_err_set(e, PD_EINVAL, "pd_model_config_parse: NULL argument");
  memset(c, 0, sizeof *c);
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root) return pd_err_set(e, PD_EFORMAT, "config: not valid JSON");
  pd_status s = cfg_parse_root(root, c, e);
  cJSON_Delete(root);
  return s;
}

pd_status pd_model_config_load(const char *dir, pd_model_config *c, pd_err *e) {
  if (!dir || !c) return pd_err_set(e, PD_EINVAL, "pd_model_config_load: NULL argument");
  char path[4096];
  int n = snprintf(path, sizeof path, "%s/config.json", dir);
  if (n < 0 || (size_t)n >= sizeof path)
    return pd_err_set(e, PD_EINVAL, "model directory path too long: %s", dir);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return pd_err_set(e, errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: cannot open: %s", path,
                      strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size > CFG_MAX_BYTES) {
    close(fd);
    return pd_err_set(e, PD_EIO, "%s: not a regular file of at most %lld bytes", path,
                      (long long)CFG_MAX_BYTES);
  }
  char *buf = malloc((size_t)sb.st_size + 1);
  if (!buf) {
    close(fd);
    return pd_err_set(e, PD_ENOMEM, "out of memory reading %s", path);
  }
  size_t got = 0;
  while (got < (size_t)sb.st_size) {
    ssize_t r = read(fd, buf + got, (size_t)sb.st_size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  if (got != (size_t)sb.st_size) {
    free(buf);
    return pd_err_set(e, PD_EIO, "%s: short read", path);
  }
  pd_status s = pd_model_config_parse(buf, got, c, e);
  free(buf);
  if (s != PD_OK) pd_err_prefix(e, "%s", path);
  return s;
}

/* ---- RoPE ----------------------------------------------------------------------------------- */

/* transformers (modeling_rope_utils.py), on float32 CPU tensors:
 *   inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
 * i.e. e = float(i) / float(dim) (float division), p = pow(float(base), e) in float (we take
 * the correctly rounded value; torch's vectorised powf is within 1 ulp of it), inv = 1 / p.
 * Python scalars meeting a float32 tensor are rounded to float first; each tensor op rounds to
 * float. This file is compiled as ISO C11 (no FP contraction), so every line below rounds like
 * the corresponding torch op. */
void pd_rope_inv_freq(const pd_model_config *c, float *inv_freq) {
  const pd_rope_config *r = &c->rope;
  const int dim = c->head_dim, half = c->head_dim / 2;
  const float base = (float)r->theta;
  for (int i = 0; i < half; i++) {
    float ex = (float)(2 * i) / (float)dim;
    float p = (float)pow((double)base, (double)ex);
    inv_freq[i] = 1.0f / p;
  }
  if (r->type == PD_ROPE_LINEAR) {
    const float f = (float)r->factor; /* inv_freq /= factor */
    for (int i = 0; i < half; i++) inv_freq[i] = inv_freq[i] / f;
  } else if (r->type == PD_ROPE_LLAMA3) {
    const double old_ctx = (double)r->original_max_position_embeddings;
    const float factor = (float)r->factor;
    const float low = (float)r->low_freq_factor;
    const float two_pi = (float)6.283185307179586; /* Python's 2 * math.pi */
    const float old_ctx_f = (float)old_ctx;
    const float low_wl = (float)(old_ctx / r->low_freq_factor);   /* low_freq_wavelen */
    const float high_wl = (float)(old_ctx / r->high_freq_factor); /* high_freq_wavelen */
    const float span = (float)(r->high_freq_factor - r->low_freq_factor);
    for (int i = 0; i < half; i++) {
      const float inv = inv_freq[i];
      /* wavelen = 2 * math.pi / inv_freq  ==  inv_freq.reciprocal() * (2 * pi) */
      const float wavelen = (1.0f / inv) * two_pi;
      /* inv_freq_llama = where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq) */
      const float inv_llama = wavelen > low_wl ? inv / factor : inv;
      /* smooth = (old_context_len / wavelen - low_freq_factor) / (high - low) */
      const float smooth = ((1.0f / wavelen) * old_ctx_f - low) / span;
      /* smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama */
      const float a = ((1.0f - smooth) * inv_llama) / factor;
      const float b = smooth * inv_llama;
      const float smoothed = a + b;
      const int medium = !(wavelen < high_wl) && !(wavelen > low_wl);
      inv_freq[i] = medium ? smoothed : inv_llama;
    }
  }
}
