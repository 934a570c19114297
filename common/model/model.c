/* Weight layout of Llama / Qwen2 / Mistral checkpoints: finds every tensor the forward pass
 * reads, checks its dtype and exact shape against config.json, and points pd_weight at the
 * mapping (nothing is copied). Tensor names are those of transformers' state dicts. */
#include <math.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/model.h"

static bool mdl_dtype_ok(pd_dtype t) {
  return t == PD_DTYPE_F32 || t == PD_DTYPE_F16 || t == PD_DTYPE_BF16;
}

static void mdl_shape_str(char *buf, size_t n, const int64_t *shape, int ndim) {
  size_t o = 0;
  o += (size_t)snprintf(buf + o, n - o, "[");
  for (int i = 0; i < ndim && o < n; i++)
    o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (o < n) snprintf(buf + o, n - o, "]");
}

/* Points w at tensor name, which must have shape [rows, cols] (cols == 0: 1-D [rows]) and a
 * float dtype. An absent tensor is PD_ENOTFOUND when required, else leaves w zeroed. */
static pd_status mdl_take(const pd_st *st, const char *name, int64_t rows, int64_t cols,
                          bool required, pd_weight *w, pd_err *e) {
  memset(w, 0, sizeof *w);
  int64_t want[2] = {rows, cols};
  int want_ndim = cols ? 2 : 1;
  char ws[64], gs[160];
  mdl_shape_str(ws, sizeof ws, want, want_ndim);
  const pd_st_tensor *t = pd_st_find(st, name);
  if (!t) {
    if (!required) return PD_OK;
    return pd_err_set(e, PD_ENOTFOUND, "tensor '%s' (expected shape %s) is missing", name, ws);
  }
  if (!mdl_dtype_ok(t->dtype))
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "tensor '%s' has dtype %s; weights must be F32, F16 or BF16", name,
                      pd_dtype_name(t->dtype));
  bool ok = t->ndim == want_ndim;
  for (int i = 0; ok && i < want_ndim; i++) ok = t->shape[i] == want[i];
  if (!ok) {
    mdl_shape_str(gs, sizeof gs, t->shape, t->ndim);
    return pd_err_set(e, PD_EFORMAT, "tensor '%s' has shape %s, expected %s", name, gs, ws);
  }
  w->data = t->data;
  w->dtype = t->dtype;
  w->rows = rows;
  w->cols = cols ? cols : 1;
  return PD_OK;
}

#define TRY(x)                  \
  do {                          \
    pd_status s_ = (x);         \
    if (s_ != PD_OK) return s_; \
  } while (0)

/* ---- quantized linear layers ---------------------------------------------------------------- */

/* Tensor prefix.suffix with the given dtype class and shape, or an error naming it. */
static const pd_st_tensor *q_tensor(const pd_st *st, const char *prefix, const char *suffix,
                                    bool is_int, int64_t d0, int64_t d1, pd_err *e) {
  char n[200], ws[64], gs[160];
  snprintf(n, sizeof n, "%s.%s", prefix, suffix);
  int64_t want[2] = {d0, d1};
  mdl_shape_str(ws, sizeof ws, want, 2);
  const pd_st_tensor *t = pd_st_find(st, n);
  if (!t) {
    pd_err_set(e, PD_ENOTFOUND, "quantized tensor '%s' (expected shape %s) is missing", n, ws);
    return NULL;
  }
  if (is_int ? t->dtype != PD_DTYPE_I32 : !mdl_dtype_ok(t->dtype)) {
    pd_err_set(e, PD_EFORMAT, "tensor '%s' has dtype %s, expected %s", n, pd_dtype_name(t->dtype),
               is_int ? "I32" : "F16, BF16 or F32");
    return NULL;
  }
  if (t->ndim != 2 || t->shape[0] != d0 || t->shape[1] != d1) {
    mdl_shape_str(gs, sizeof gs, t->shape, t->ndim);
    pd_err_set(e, PD_EFORMAT, "tensor '%s' has shape %s, expected %s", n, gs, ws);
    return NULL;
  }
  return t;
}

static uint32_t q_word(const pd_st_tensor *t, int64_t r, int64_t c) {
  uint32_t w;
  memcpy(&w, (const char *)t->data + ((size_t)r * (size_t)t->shape[1] + (size_t)c) * 4, 4);
  return w;
}

static float q_float(const pd_st_tensor *t, int64_t r, int64_t c) {
  const size_t i = (size_t)r * (size_t)t->shape[1] + (size_t)c;
  if (t->dtype == PD_DTYPE_F32) {
    float f;
    memcpy(&f, (const char *)t->data + i * 4, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, (const char *)t->data + i * 2, 2);
  return t->dtype == PD_DTYPE_BF16 ? pd_bf16_to_f32(h) : pd_f16_to_f32(h);
}

/* AutoAWQ's packing order: nibble i of a word holds column 8j + awq_order[i]. */
static const int awq_nibble_of_col[8] = {0, 4, 1, 5, 2, 6, 3, 7};

pd_status pd_model_quant_linear(const pd_st *st, const pd_quant_config *qc, const char *prefix,
                                int64_t N, int64_t K, void **rows, pd_err *e) {
  *rows = NULL;
  if (K % PD_Q4_BLOCK || N % 8)
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "'%s': %lld x %lld is not a shape the 4-bit kernels take (in features a "
                      "multiple of %d, out features of 8)", prefix, (long long)N, (long long)K,
                      PD_Q4_BLOCK);
  const int64_t G = qc->group_size ? qc->group_size : K; /* inputs per group */
  if (K % G)
    return pd_err_set(e, PD_EFORMAT, "'%s': %lld input features are not whole groups of %lld",
                      prefix, (long long)K, (long long)G);
  const int64_t NG = K / G;
  const pd_st_tensor *qw = NULL, *qz = NULL, *sc = NULL;
  switch (qc->method) {
  case PD_QUANT_AWQ:
    if (!(qw = q_tensor(st, prefix, "qweight", true, K, N / 8, e)) ||
        !(qz = q_tensor(st, prefix, "qzeros", true, NG, N / 8, e)) ||
        !(sc = q_tensor(st, prefix, "scales", false, NG, N, e)))
      return e->code;
    break;
  case PD_QUANT_GPTQ: {
    if (!(qw = q_tensor(st, prefix, "qweight", true, K / 8, N, e)) ||
        !(qz = q_tensor(st, prefix, "qzeros", true, NG, N / 8, e)) ||
        !(sc = q_tensor(st, prefix, "scales", false, NG, N, e)))
      return e->code;
    char n[200];
    snprintf(n, sizeof n, "%s.g_idx", prefix);
    const pd_st_tensor *gi = pd_st_find(st, n);
    if (gi) { /* act-order: groups by g_idx; only the contiguous assignment is taken yet */
      if (gi->dtype != PD_DTYPE_I32 || gi->ndim != 1 || gi->shape[0] != K)
        return pd_err_set(e, PD_EFORMAT, "tensor '%s' is not I32 [%lld]", n, (long long)K);
      for (int64_t k = 0; k < K; k++) {
        int32_t v;
        memcpy(&v, (const char *)gi->data + (size_t)k * 4, 4);
        if (v != (int32_t)(k / G))
          return pd_err_set(e, PD_EUNSUPPORTED,
                            "'%s': act-order (desc_act) groups (g_idx[%lld] = %d) are not "
                            "supported yet", prefix, (long long)k, v);
      }
    }
    break;
  }
  case PD_QUANT_CT_PACKED: {
    if (!(qw = q_tensor(st, prefix, "weight_packed", true, N, K / 8, e)) ||
        !(sc = q_tensor(st, prefix, "weight_scale", false, N, NG, e)))
      return e->code;
    char n[200];
    snprintf(n, sizeof n, "%s.weight_shape", prefix);
    const pd_st_tensor *ws = pd_st_find(st, n);
    if (ws) {
      int64_t v[2] = {0, 0};
      if (ws->ndim == 1 && ws->shape[0] == 2 && ws->dtype == PD_DTYPE_I64) memcpy(v, ws->data, 16);
      else if (ws->ndim == 1 && ws->shape[0] == 2 && ws->dtype == PD_DTYPE_I32) {
        int32_t v32[2];
        memcpy(v32, ws->data, 8);
        v[0] = v32[0];
        v[1] = v32[1];
      }
      if (v[0] != N || v[1] != K)
        return pd_err_set(e, PD_EFORMAT, "tensor '%s' does not say [%lld, %lld]", n,
                          (long long)N, (long long)K);
    }
    if (!qc->sym)
      return pd_err_set(e, PD_EUNSUPPORTED,
                        "'%s': asymmetric compressed-tensors weights are not supported yet", prefix);
    break;
  }
  default:
    return pd_err_set(e, PD_EINVAL, "'%s': not a quantized checkpoint", prefix);
  }
  const size_t rb = pd_dtype_row_bytes(PD_DTYPE_Q4, K);
  uint8_t *buf = malloc((size_t)N * rb);
  if (!buf) return pd_err_set(e, PD_ENOMEM, "out of memory");
  const int64_t nb = K / PD_Q4_BLOCK;
  for (int64_t n = 0; n < N; n++) {
    uint8_t *row = buf + (size_t)n * rb;
    uint16_t *blk = (uint16_t *)(void *)(row + K / 2);
    for (int64_t k = 0; k < K; k++) {
      uint32_t q;
      switch (qc->method) {
      case PD_QUANT_AWQ: q = q_word(qw, k, n / 8) >> (4 * awq_nibble_of_col[n % 8]); break;
      case PD_QUANT_GPTQ: q = q_word(qw, k / 8, n) >> (4 * (k % 8)); break;
      default: q = q_word(qw, n, k / 8) >> (4 * (k % 8)); break;
      }
      q &= 15u;
      if (k & 1) row[k / 2] |= (uint8_t)(q << 4);
      else row[k / 2] = (uint8_t)q;
    }
    for (int64_t b = 0; b < nb; b++) {
      const int64_t g = b * PD_Q4_BLOCK / G;
      float s, z;
      switch (qc->method) {
      case PD_QUANT_AWQ:
        s = q_float(sc, g, n);
        z = (float)((q_word(qz, g, n / 8) >> (4 * awq_nibble_of_col[n % 8])) & 15u);
        break;
      case PD_QUANT_GPTQ:
        s = q_float(sc, g, n);
        z = (float)((q_word(qz, g, n / 8) >> (4 * (n % 8))) & 15u) + (qc->zeros_minus_one ? 1.0f : 0.0f);
        break;
      default: /* values stored offset by 8 */
        s = q_float(sc, n, g);
        z = 8.0f;
        break;
      }
      if (!(fabsf(s) < 65504.0f)) {
        free(buf);
        return pd_err_set(e, PD_EFORMAT, "'%s': scale %g of row %lld is not a finite f16",
                          prefix, (double)s, (long long)n);
      }
      uint16_t sh = pd_f32_to_f16(s), zh = pd_f32_to_f16(z);
      memcpy(&blk[2 * b], &sh, 2);
      memcpy(&blk[2 * b + 1], &zh, 2);
    }
  }
  *rows = buf;
  return PD_OK;
}

/* A model-owned slot for one more buffer the loader makes. */
static pd_status mdl_own(pd_model *m, void *buf, pd_err *e) {
  void **ov = realloc(m->owned, (size_t)(m->n_owned + 1) * sizeof *ov);
  if (!ov) {
    free(buf);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  m->owned = ov;
  m->owned[m->n_owned++] = buf;
  return PD_OK;
}

/* A 4-bit linear layer [N out, K in]: its PD_DTYPE_Q4 rows are made after every layer is
 * parsed, all layers at once (mdl_make_rows); until then data is NULL. */
static pd_status mdl_q4(pd_model *m, const char *prefix, int64_t N, int64_t K, pd_weight *w,
                        pd_err *e) {
  (void)m;
  (void)prefix;
  (void)e;
  w->data = NULL;
  w->dtype = PD_DTYPE_Q4;
  w->rows = N;
  w->cols = K;
  return PD_OK;
}

pd_status pd_model_fp8_linear(const pd_st *st, const pd_quant_config *qc, const char *prefix,
                               int64_t N, int64_t K, void **rows, pd_err *e) {
  *rows = NULL;
  char n[200], gs[160], ws[64];
  int64_t want[2] = {N, K};
  mdl_shape_str(ws, sizeof ws, want, 2);
  snprintf(n, sizeof n, "%s.weight", prefix);
  const pd_st_tensor *w = pd_st_find(st, n);
  if (!w || w->dtype != PD_DTYPE_F8_E4M3 || w->ndim != 2 || w->shape[0] != N || w->shape[1] != K) {
    if (w) mdl_shape_str(gs, sizeof gs, w->shape, w->ndim);
    return pd_err_set(e, w ? PD_EFORMAT : PD_ENOTFOUND, "FP8 tensor '%s': expected F8_E4M3 %s%s%s",
                      n, ws, w ? ", found " : " (missing)", w ? gs : "");
  }
  if (K % 16)
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "'%s': %lld input features (the FP8 kernels take multiples of 16)", prefix,
                      (long long)K);
  snprintf(n, sizeof n, "%s.weight_scale", prefix);
  const pd_st_tensor *sc = pd_st_find(st, n);
  int64_t ns = 1;
  if (sc)
    for (int i = 0; i < sc->ndim; i++) ns *= sc->shape[i];
  if (!sc || !mdl_dtype_ok(sc->dtype) || (ns != 1 && ns != N) ||
      (ns == N && N > 1 && !(sc->ndim == 2 && sc->shape[1] == 1) && sc->ndim != 1))
    return pd_err_set(e, PD_EFORMAT,
                      "tensor '%s': expected a scale per output channel [%lld, 1] or one scale",
                      n, (long long)N);
  /* static activations: prefix.input_scale, one positive scale (F8WS rows) */
  float in_scale = 0.0f;
  if (qc->act_fp8_static) {
    char ni[200];
    snprintf(ni, sizeof ni, "%s.input_scale", prefix);
    const pd_st_tensor *is = pd_st_find(st, ni);
    if (is && is->nbytes == pd_dtype_size(is->dtype) && mdl_dtype_ok(is->dtype))
      pd_convert_to_f32(&in_scale, is->data, is->dtype, 1);
    if (!(in_scale > 0.0f) || !isfinite(in_scale))
      return pd_err_set(e, is ? PD_EFORMAT : PD_ENOTFOUND, "tensor '%s' %s", ni,
                        is ? "is not one positive float scale" : "is missing");
  }
  const size_t rb = pd_dtype_row_bytes(qc->act_fp8_static ? PD_DTYPE_F8WS : PD_DTYPE_F8W, K);
  uint8_t *buf = malloc((size_t)N * rb);
  if (!buf) return pd_err_set(e, PD_ENOMEM, "out of memory");
  for (int64_t r = 0; r < N; r++) {
    memcpy(buf + (size_t)r * rb, (const uint8_t *)w->data + (size_t)r * (size_t)K, (size_t)K);
    const int64_t i = ns == 1 ? 0 : r;
    float s;
    if (sc->dtype == PD_DTYPE_F32) {
      memcpy(&s, (const char *)sc->data + (size_t)i * 4, 4);
    } else {
      uint16_t h;
      memcpy(&h, (const char *)sc->data + (size_t)i * 2, 2);
      s = sc->dtype == PD_DTYPE_BF16 ? pd_bf16_to_f32(h) : pd_f16_to_f32(h);
    }
    if (!isfinite(s)) {
      free(buf);
      return pd_err_set(e, PD_EFORMAT, "tensor '%s': scale %lld is not finite", n, (long long)i);
    }
    memcpy(buf + (size_t)r * rb + (size_t)K, &s, 4);
    if (qc->act_fp8_static) memcpy(buf + (size_t)r * rb + (size_t)K + 4, &in_scale, 4);
  }
  *rows = buf;
  return PD_OK;
}

/* A linear layer prefix of [rows out, cols in]: its float `.weight` where the checkpoint has one
 * (every checkpoint; a quantized one for the layers it left alone), else its quantized tensors
 * (FP8 checkpoints keep the name `.weight` for their e4m3 tensors). */
static pd_status mdl_linear(pd_model *m, const char *prefix, int64_t rows, int64_t cols,
                            pd_weight *w, pd_err *e) {
  char n[200];
  snprintf(n, sizeof n, "%s.weight", prefix);
  const pd_st_tensor *t = pd_st_find(m->st, n);
  if (m->cfg.quant.method == PD_QUANT_CT_FP8 && t && t->dtype == PD_DTYPE_F8_E4M3) {
    void *buf;
    TRY(pd_model_fp8_linear(m->st, &m->cfg.quant, prefix, rows, cols, &buf, e));
    TRY(mdl_own(m, buf, e));
    w->data = buf;
    w->dtype = m->cfg.quant.act_fp8_dynamic  ? PD_DTYPE_F8WA
               : m->cfg.quant.act_fp8_static ? PD_DTYPE_F8WS
                                             : PD_DTYPE_F8W;
    w->rows = rows;
    w->cols = cols;
    return PD_OK;
  }
  if (m->cfg.quant.method == PD_QUANT_NONE || m->cfg.quant.method == PD_QUANT_CT_FP8 || t)
    return mdl_take(m->st, n, rows, cols, true, w, e);
  return mdl_q4(m, prefix, rows, cols, w, e);
}

static pd_status mdl_layer(pd_model *m, int l, pd_layer_weights *L, pd_err *e) {
  const pd_st *st = m->st;
  const pd_model_config *c = &m->cfg;
  const int64_t D = c->hidden_size, F = c->intermediate_size;
  const int64_t Q = (int64_t)c->num_heads * c->head_dim, KV = (int64_t)c->num_kv_heads * c->head_dim;
  const bool ab = c->attention_bias, ob = c->attention_bias && c->arch == PD_ARCH_LLAMA,
             mb = c->mlp_bias;
  char n[160];
#define W(field, suffix, rows, cols, req)                                  \
  do {                                                                     \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                \
    TRY(mdl_take(st, n, rows, cols, req, &L->field, e));                   \
  } while (0)
#define LIN(field, name, rows, cols)                                       \
  do {                                                                     \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, name);                  \
    TRY(mdl_linear(m, n, rows, cols, &L->field, e));                       \
  } while (0)
  W(attn_norm, "input_layernorm.weight", D, 0, true);
  LIN(wq, "self_attn.q_proj", Q, D);
  LIN(wk, "self_attn.k_proj", KV, D);
  LIN(wv, "self_attn.v_proj", KV, D);
  LIN(wo, "self_attn.o_proj", D, Q);
  if (ab) {
    W(bq, "self_attn.q_proj.bias", Q, 0, true);
    W(bk, "self_attn.k_proj.bias", KV, 0, true);
    W(bv, "self_attn.v_proj.bias", KV, 0, true);
  }
  if (ob) W(bo, "self_attn.o_proj.bias", D, 0, true);
  W(ffn_norm, "post_attention_layernorm.weight", D, 0, true);
  LIN(w_gate, "mlp.gate_proj", F, D);
  LIN(w_up, "mlp.up_proj", F, D);
  LIN(w_down, "mlp.down_proj", D, F);
  if (mb) {
    W(b_gate, "mlp.gate_proj.bias", F, 0, true);
    W(b_up, "mlp.up_proj.bias", F, 0, true);
    W(b_down, "mlp.down_proj.bias", D, 0, true);
  }
#undef W
#undef LIN
  if (c->quant.act_fp8_static) { /* fused products (q/k/v, gate/up) quantize x once: with the
                                  * largest of their input scales, as vLLM does */
    pd_weight *groups[2][3] = {{&L->wq, &L->wk, &L->wv}, {&L->w_gate, &L->w_up, NULL}};
    for (int g = 0; g < 2; g++) {
      float mx = 0.0f;
      for (int i = 0; i < 3 && groups[g][i]; i++) {
        const pd_weight *w = groups[g][i];
        float v = 0.0f;
        if (w->dtype == PD_DTYPE_F8WS) memcpy(&v, (const uint8_t *)w->data + w->cols + 4, 4);
        mx = fmaxf(mx, v);
      }
      for (int i = 0; i < 3 && groups[g][i]; i++) {
        pd_weight *w = groups[g][i];
        if (w->dtype != PD_DTYPE_F8WS) continue;
        const size_t rb = pd_dtype_row_bytes(PD_DTYPE_F8WS, w->cols);
        for (int64_t r = 0; r < w->rows; r++)
          memcpy((uint8_t *)w->data + (size_t)r * rb + w->cols + 4, &mx, 4);
      }
    }
  }
  if (c->quant.kv_fp8_scales) { /* one positive finite scale each, [] or [1] */
    const char *names[2] = {"k_scale", "v_scale"};
    float *dst[2] = {&L->k_scale, &L->v_scale};
    for (int i = 0; i < 2; i++) {
      snprintf(n, sizeof n, "model.layers.%d.self_attn.%s", l, names[i]);
      const pd_st_tensor *t = pd_st_find(st, n);
      float v = 0.0f;
      if (t && t->nbytes == pd_dtype_size(t->dtype) &&
          (t->dtype == PD_DTYPE_F32 || t->dtype == PD_DTYPE_BF16 || t->dtype == PD_DTYPE_F16))
        pd_convert_to_f32(&v, t->data, t->dtype, 1);
      if (!(v > 0.0f) || !isfinite(v))
        return pd_err_set(e, t ? PD_EFORMAT : PD_ENOTFOUND,
                          "kv_cache_scheme: tensor '%s' %s", n,
                          t ? "is not one positive float scale" : "is missing");
      *dst[i] = v;
    }
  }
  return PD_OK;
}

static pd_status mdl_make_rows(pd_model *m, bool fp8, pd_err *e);

static pd_status mdl_weights(pd_model *m, pd_err *e) {
  const pd_model_config *c = &m->cfg;
  const int64_t V = c->vocab_size, D = c->hidden_size;
  TRY(mdl_take(m->st, "model.embed_tokens.weight", V, D, true, &m->tok_embeddings, e));
  TRY(mdl_take(m->st, "model.norm.weight", D, 0, true, &m->final_norm, e));
  /* Tied: transformers shares embed_tokens with lm_head and ignores a stored lm_head.weight,
   * which we still check so that a damaged file is reported. */
  TRY(mdl_take(m->st, "lm_head.weight", V, D, !c->tie_word_embeddings, &m->lm_head, e));
  if (c->tie_word_embeddings) m->lm_head = m->tok_embeddings;
  m->layers = calloc((size_t)c->num_layers, sizeof *m->layers);
  if (!m->layers) return pd_err_set(e, PD_ENOMEM, "out of memory");
  for (int l = 0; l < c->num_layers; l++) TRY(mdl_layer(m, l, &m->layers[l], e));
  if (c->quant.method != PD_QUANT_NONE && c->quant.method != PD_QUANT_CT_FP8)
    TRY(mdl_make_rows(m, false, e));
  return PD_OK;
}

/* ---- --quantization fp8 ------------------------------------------------------------------ */

/* One linear layer's float rows as F8WA rows (malloc'ed): each row's e4m3 values of w / s and
 * s = max|row| / 448 (1 for a zero row), as llm-compressor's FP8 channel scheme computes them. */
static void *mdl_fp8_rows(const pd_weight *w) {
  const int64_t N = w->rows, K = w->cols;
  const size_t rb = pd_dtype_row_bytes(PD_DTYPE_F8WA, K), es = pd_dtype_size(w->dtype);
  uint8_t *out = malloc((size_t)N * rb);
  float *row = malloc((size_t)K * sizeof *row);
  if (!out || !row) {
    free(out);
    free(row);
    return NULL;
  }
  for (int64_t n = 0; n < N; n++) {
    pd_convert_to_f32(row, (const char *)w->data + (size_t)n * K * es, w->dtype, (size_t)K);
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
    const float sc = amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
    uint8_t *o = out + (size_t)n * rb;
    for (int64_t k = 0; k < K; k++) o[k] = pd_f32_to_e4m3(row[k] / sc);
    memcpy(o + K, &sc, 4);
  }
  free(row);
  return out;
}

static pd_weight *mdl_linears(pd_layer_weights *L, int i) {
  pd_weight *all[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
  return all[i];
}
static const char *const mdl_linear_names[7] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

/* The rows of every linear layer that needs them made (4-bit: repacked from the checkpoint's
 * tensors; fp8: quantized from the float weights), on threads over the layers. */
typedef struct rows_job {
  pd_model *m;
  bool fp8;
  int first, step;
  void **bufs;  /* [num_layers * 7]; NULL where nothing was made */
  pd_err err;   /* the first failure of this thread */
} rows_job;

static void *rows_worker(void *arg) {
  rows_job *j = arg;
  for (int l = j->first; l < j->m->cfg.num_layers && !j->err.code; l += j->step)
    for (int i = 0; i < 7 && !j->err.code; i++) {
      const pd_weight *w = mdl_linears(&j->m->layers[l], i);
      void *b = NULL;
      if (j->fp8) {
        if (!(b = mdl_fp8_rows(w))) pd_err_set(&j->err, PD_ENOMEM, "out of memory");
      } else if (w->dtype == PD_DTYPE_Q4 && !w->data) {
        char prefix[160];
        snprintf(prefix, sizeof prefix, "model.layers.%d.%s", l, mdl_linear_names[i]);
        pd_model_quant_linear(j->m->st, &j->m->cfg.quant, prefix, w->rows, w->cols, &b, &j->err);
      }
      j->bufs[(size_t)l * 7 + i] = b;
    }
  return NULL;
}

static pd_status mdl_make_rows(pd_model *m, bool fp8, pd_err *e) {
  const int L = m->cfg.num_layers;
  if (L <= 0) return PD_OK;
  void **bufs = calloc((size_t)L * 7, sizeof *bufs);
  if (!bufs) return pd_err_set(e, PD_ENOMEM, "out of memory");
  long nt = sysconf(_SC_NPROCESSORS_ONLN);
  if (nt < 1) nt = 1;
  if (nt > 64) nt = 64;
  if (nt > L) nt = L;
  pthread_t th[64];
  rows_job jobs[64];
  bool started[64] = {false};
  for (int t = 0; t < nt; t++) jobs[t] = (rows_job){.m = m, .fp8 = fp8, .first = t,
                                                     .step = (int)nt, .bufs = bufs};
  for (int t = 1; t < nt; t++) started[t] = pthread_create(&th[t], NULL, rows_worker, &jobs[t]) == 0;
  rows_worker(&jobs[0]);
  pd_status s = PD_OK;
  for (int t = 0; t < nt; t++) {
    if (t > 0 && started[t]) pthread_join(th[t], NULL);
    else if (t > 0) rows_worker(&jobs[t]); /* (no thread: done here) */
    if (jobs[t].err.code && s == PD_OK) {
      *e = jobs[t].err;
      s = e->code;
    }
  }
  for (int l = 0; l < L; l++)
    for (int i = 0; i < 7; i++) {
      void *b = bufs[(size_t)l * 7 + i];
      if (!b) continue;
      if (s != PD_OK) {
        free(b);
        continue;
      }
      if ((s = mdl_own(m, b, e)) != PD_OK) continue; /* (mdl_own freed b) */
      pd_weight *w = mdl_linears(&m->layers[l], i);
      w->data = b;
      if (fp8) w->dtype = PD_DTYPE_F8WA;
    }
  free(bufs);
  return s;
}

static pd_status mdl_quantize_fp8(pd_model *m, pd_err *e) {
  const pd_model_config *c = &m->cfg;
  if (c->quant.method != PD_QUANT_NONE)
    return pd_err_set(e, PD_EINVAL,
                      "--quantization fp8: the checkpoint is quantized already (its "
                      "quantization_config)");
  if (c->hidden_size % 16 || c->intermediate_size % 16 || (c->num_heads * c->head_dim) % 16)
    return pd_err_set(e, PD_EUNSUPPORTED,
                      "--quantization fp8: the linear layers' input widths (%d, %d, %d) must be "
                      "multiples of 16", c->hidden_size, c->intermediate_size,
                      c->num_heads * c->head_dim);
  return mdl_make_rows(m, true, e);
}

pd_model *pd_model_load(const char *dir, const pd_model_opts *o, pd_err *e) {
  pd_err local;
  if (!e) e = &local;
  if (!dir || !dir[0]) {
    pd_err_set(e, PD_EINVAL, "pd_model_load: no directory given");
    return NULL;
  }
  pd_model *m = calloc(1, sizeof *m);
  if (!m) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  int n = snprintf(m->dir, sizeof m->dir, "%s", dir);
  pd_status s;
  if (n < 0 || (size_t)n >= sizeof m->dir) {
    s = pd_err_set(e, PD_EINVAL, "model directory path too long");
  } else if ((s = pd_model_config_load(dir, &m->cfg, e)) == PD_OK) {
    m->st = pd_st_open_dir(dir, e);
    s = m->st ? mdl_weights(m, e) : e->code;
    if (s == PD_OK && o && o->quantize_fp8) s = mdl_quantize_fp8(m, e);
    if (s != PD_OK) pd_err_prefix(e, "loading model %s", dir);
  }
  if (s != PD_OK) {
    pd_model_free(m);
    return NULL;
  }
  return m;
}

static size_t mdl_wbytes(const pd_weight *w) {
  return w->data ? (size_t)w->rows * pd_dtype_row_bytes(w->dtype, w->cols) : 0;
}

size_t pd_model_weight_bytes(const pd_model *m) {
  size_t n = mdl_wbytes(&m->tok_embeddings) + mdl_wbytes(&m->final_norm);
  if (m->lm_head.data != m->tok_embeddings.data) n += mdl_wbytes(&m->lm_head);
  for (int l = 0; l < m->cfg.num_layers; l++) {
    const pd_layer_weights *L = &m->layers[l];
    const pd_weight *all[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk,
                              &L->bv, &L->bo, &L->ffn_norm, &L->w_gate, &L->w_up, &L->w_down,
                              &L->b_gate, &L->b_up, &L->b_down};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) n += mdl_wbytes(all[i]);
  }
  return n;
}

void pd_model_free(pd_model *m) {
  if (!m) return;
  pd_st_close(m->st);
  free(m->layers);
  for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
  free(m->owned);
  free(m);
}
