/* Weight layout of Llama / Qwen2 / Mistral checkpoints: finds every tensor the forward pass
 * reads, checks its dtype and exact shape against config.json, and points pd_weight at the
 * mapping (nothing is copied). Tensor names are those of transformers' state dicts. */
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

static pd_status mdl_layer(const pd_st *st, const pd_model_config *c, int l, pd_layer_weights *L,
                           pd_err *e) {
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
  W(attn_norm, "input_layernorm.weight", D, 0, true);
  W(wq, "self_attn.q_proj.weight", Q, D, true);
  W(wk, "self_attn.k_proj.weight", KV, D, true);
  W(wv, "self_attn.v_proj.weight", KV, D, true);
  W(wo, "self_attn.o_proj.weight", D, Q, true);
  if (ab) {
    W(bq, "self_attn.q_proj.bias", Q, 0, true);
    W(bk, "self_attn.k_proj.bias", KV, 0, true);
    W(bv, "self_attn.v_proj.bias", KV, 0, true);
  }
  if (ob) W(bo, "self_attn.o_proj.bias", D, 0, true);
  W(ffn_norm, "post_attention_layernorm.weight", D, 0, true);
  W(w_gate, "mlp.gate_proj.weight", F, D, true);
  W(w_up, "mlp.up_proj.weight", F, D, true);
  W(w_down, "mlp.down_proj.weight", D, F, true);
  if (mb) {
    W(b_gate, "mlp.gate_proj.bias", F, 0, true);
    W(b_up, "mlp.up_proj.bias", F, 0, true);
    W(b_down, "mlp.down_proj.bias", D, 0, true);
  }
#undef W
  return PD_OK;
}

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
  for (int l = 0; l < c->num_layers; l++) TRY(mdl_layer(m->st, c, l, &m->layers[l], e));
  return PD_OK;
}

pd_model *pd_model_load(const char *dir, const pd_model_opts *o, pd_err *e) {
  (void)o;
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
    if (s != PD_OK) pd_err_prefix(e, "loading model %s", dir);
  }
  if (s != PD_OK) {
    pd_model_free(m);
    return NULL;
  }
  return m;
}

void pd_model_free(pd_model *m) {
  if (!m) return;
  pd_st_close(m->st);
  free(m->layers);
  free(m);
}
