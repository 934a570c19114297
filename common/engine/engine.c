/* Forward pass of Llama-family decoders over the backend ops table.
 *
 * Per layer, for the M tokens of a ragged batch (D = hidden, F = ffn):
 *   xn = rmsnorm(x)                       (fused with the residual add of the previous layer)
 *   q, k, v = xn·Wq^T (+bq), xn·Wk^T (+bk), xn·Wv^T (+bv)
 *   rope(q, k); kv_write(k, v -> slots); a = paged_attention(q)
 *   r = a·Wo^T;  x += r;  xn = rmsnorm(x)
 *   gu = xn·[Wgate;Wup]^T;  h = silu(g)*u;  r = h·Wdown^T;  (x += r in the next norm)
 * then the final norm and the LM head only on the rows whose logits are asked for. */
#include "pd/engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct eng_layer {
  float *attn_norm, *ffn_norm; /* [D] f32 */
  float *bq, *bk, *bv, *bo;    /* f32 or NULL */
  float *bgu, *bdown;          /* f32 or NULL; bgu = [b_gate; b_up] */
  int window;                  /* sliding window of this layer, 0 = none */
  const void *wq, *wk, *wv, *wo, *wgu, *wdown;
  pd_kv_layer kv;
} eng_layer;

struct pd_engine {
  const pd_model *m;
  pd_backend *be;
  pd_engine_opts o;
  pd_kv_shape kvs;
  int D, F, nq, nkv, hd, V;
  const void *tok_emb, *lm_head, *final_norm_w;
  float *final_norm;
  float *inv_freq; /* [hd/2] */
  eng_layer *layers;
  /* Everything the engine allocated on the backend, freed at the end. */
  void **owned;
  int n_owned, cap_owned;
  /* activations [max_batch_tokens, ...] */
  float *x, *xn, *q, *k, *v, *attn, *gu, *act, *sel, *logits;
  /* metadata on the backend */
  int32_t *d_tokens, *d_pos, *d_slots, *d_qstart, *d_ctx, *d_bt, *d_rows;
};

void pd_engine_opts_default(pd_engine_opts *o) {
  memset(o, 0, sizeof *o);
  o->block_size = 16;
  o->max_batch_tokens = 2048;
  o->max_seqs = 256;
  o->kv_dtype = PD_DTYPE_F32;
}

static void *eng_alloc(pd_engine *g, size_t bytes, pd_err *e) {
  if (g->n_owned == g->cap_owned) {
    int cap = g->cap_owned ? 2 * g->cap_owned : 64;
    void **p = realloc(g->owned, (size_t)cap * sizeof *p);
    if (!p) {
      pd_err_set(e, PD_ENOMEM, "out of host memory");
      return NULL;
    }
    g->owned = p;
    g->cap_owned = cap;
  }
  void *p = g->be->ops.alloc(g->be, bytes ? bytes : 1);
  if (!p) {
    pd_err_set(e, PD_ENOMEM, "backend %s: cannot allocate %zu bytes", g->be->ops.name, bytes);
    return NULL;
  }
  g->owned[g->n_owned++] = p;
  return p;
}

/* Small weights (norms, biases) as one f32 vector on the backend: a, then b if given. */
static float *upload_f32_pair(pd_engine *g, const pd_weight *a, const pd_weight *b, pd_err *e) {
  if (!a->data) return NULL;
  size_t na = (size_t)a->rows * (size_t)a->cols, nb = b ? (size_t)b->rows * (size_t)b->cols : 0;
  float *tmp = malloc((na + nb) * sizeof *tmp);
  if (!tmp) {
    pd_err_set(e, PD_ENOMEM, "out of host memory");
    return NULL;
  }
  pd_convert_to_f32(tmp, a->data, a->dtype, na);
  if (b) pd_convert_to_f32(tmp + na, b->data, b->dtype, nb);
  float *d = eng_alloc(g, (na + nb) * sizeof *d, e);
  if (d) g->be->ops.to_device(g->be, d, tmp, (na + nb) * sizeof *d);
  free(tmp);
  return d;
}

static float *upload_f32(pd_engine *g, const pd_weight *w, pd_err *e) {
  return upload_f32_pair(g, w, NULL, e);
}

/* A big weight, in its stored dtype: used in place on host backends, uploaded otherwise.
 * When `b` is given, returns the row-concatenation [a; b] (both must share dtype and cols). */
static const void *place_weight(pd_engine *g, const pd_weight *a, const pd_weight *b, pd_err *e) {
  size_t es = pd_dtype_size(a->dtype);
  size_t na = (size_t)a->rows * (size_t)a->cols * es;
  size_t nb = b ? (size_t)b->rows * (size_t)b->cols * es : 0;
  if (!b && g->be->host_memory) return a->data;
  char *d = eng_alloc(g, na + nb, e);
  if (!d) return NULL;
  g->be->ops.to_device(g->be, d, a->data, na);
  if (b) g->be->ops.to_device(g->be, d + na, b->data, nb);
  return d;
}

const pd_engine_opts *pd_engine_get_opts(const pd_engine *g) { return &g->o; }
const pd_model_config *pd_engine_config(const pd_engine *g) { return &g->m->cfg; }

size_t pd_engine_block_bytes(const pd_engine *g) {
  return 2 * (size_t)g->m->cfg.num_layers * (size_t)g->kvs.block_size *
         (size_t)g->kvs.num_kv_heads * (size_t)g->kvs.head_dim * pd_dtype_size(g->kvs.dtype);
}

pd_engine *pd_engine_create(const pd_model *m, pd_backend *be, const pd_engine_opts *opts,
                            pd_err *e) {
  pd_engine *g = calloc(1, sizeof *g);
  if (!g) {
    pd_err_set(e, PD_ENOMEM, "out of host memory");
    return NULL;
  }
  const pd_model_config *c = &m->cfg;
  g->m = m;
  g->be = be;
  if (opts) {
    g->o = *opts;
  } else {
    pd_engine_opts_default(&g->o);
  }
  pd_engine_opts def;
  pd_engine_opts_default(&def);
  if (g->o.block_size <= 0) g->o.block_size = def.block_size;
  if (g->o.max_batch_tokens <= 0) g->o.max_batch_tokens = def.max_batch_tokens;
  if (g->o.max_seqs <= 0) g->o.max_seqs = def.max_seqs;
  if (g->o.max_model_len <= 0) g->o.max_model_len = c->max_position_embeddings;
  int max_blocks = (g->o.max_model_len + g->o.block_size - 1) / g->o.block_size;
  if (g->o.num_blocks <= 0) g->o.num_blocks = 4 * max_blocks;
  if (g->o.kv_dtype != PD_DTYPE_F32 && g->o.kv_dtype != PD_DTYPE_F16 &&
      g->o.kv_dtype != PD_DTYPE_BF16) {
    pd_err_set(e, PD_EUNSUPPORTED, "KV cache dtype %s is not supported",
               pd_dtype_name(g->o.kv_dtype));
    goto fail;
  }
  g->D = c->hidden_size;
  g->F = c->intermediate_size;
  g->nq = c->num_heads;
  g->nkv = c->num_kv_heads;
  g->hd = c->head_dim;
  g->V = c->vocab_size;
  g->kvs = (pd_kv_shape){g->o.num_blocks, g->o.block_size, g->nkv, g->hd, g->o.kv_dtype};

  /* weights */
  g->tok_emb = place_weight(g, &m->tok_embeddings, NULL, e);
  g->lm_head = place_weight(g, &m->lm_head, NULL, e);
  g->final_norm = upload_f32(g, &m->final_norm, e);
  if (!g->tok_emb || !g->lm_head || !g->final_norm) goto fail;
  g->layers = calloc((size_t)c->num_layers, sizeof *g->layers);
  if (!g->layers) {
    pd_err_set(e, PD_ENOMEM, "out of host memory");
    goto fail;
  }
  size_t kv_bytes = (size_t)g->o.num_blocks * (size_t)g->o.block_size * (size_t)g->nkv *
                    (size_t)g->hd * pd_dtype_size(g->o.kv_dtype);
  for (int l = 0; l < c->num_layers; l++) {
    const pd_layer_weights *w = &m->layers[l];
    eng_layer *L = &g->layers[l];
    L->attn_norm = upload_f32(g, &w->attn_norm, e);
    L->ffn_norm = upload_f32(g, &w->ffn_norm, e);
    if (!L->attn_norm || !L->ffn_norm) goto fail;
    if (w->bq.data && !(L->bq = upload_f32(g, &w->bq, e))) goto fail;
    if (w->bk.data && !(L->bk = upload_f32(g, &w->bk, e))) goto fail;
    if (w->bv.data && !(L->bv = upload_f32(g, &w->bv, e))) goto fail;
    if (w->bo.data && !(L->bo = upload_f32(g, &w->bo, e))) goto fail;
    if (w->b_down.data && !(L->bdown = upload_f32(g, &w->b_down, e))) goto fail;
    if (w->b_gate.data && !(L->bgu = upload_f32_pair(g, &w->b_gate, &w->b_up, e))) goto fail;
    L->window = (c->sliding_window > 0 && l >= c->sliding_window_first_layer) ? c->sliding_window : 0;
    if (w->w_gate.dtype != w->w_up.dtype) {
      pd_err_set(e, PD_EUNSUPPORTED, "layer %d: gate and up projections differ in dtype", l);
      goto fail;
    }
    L->wq = place_weight(g, &w->wq, NULL, e);
    L->wk = place_weight(g, &w->wk, NULL, e);
    L->wv = place_weight(g, &w->wv, NULL, e);
    L->wo = place_weight(g, &w->wo, NULL, e);
    L->wgu = place_weight(g, &w->w_gate, &w->w_up, e);
    L->wdown = place_weight(g, &w->w_down, NULL, e);
    if (!L->wq || !L->wk || !L->wv || !L->wo || !L->wgu || !L->wdown) goto fail;
    L->kv.k = eng_alloc(g, kv_bytes, e);
    L->kv.v = eng_alloc(g, kv_bytes, e);
    if (!L->kv.k || !L->kv.v) goto fail;
  }

  /* RoPE frequencies */
  float *inv = malloc((size_t)(g->hd / 2) * sizeof *inv);
  if (!inv) {
    pd_err_set(e, PD_ENOMEM, "out of host memory");
    goto fail;
  }
  pd_rope_inv_freq(c, inv);
  g->inv_freq = eng_alloc(g, (size_t)(g->hd / 2) * sizeof *inv, e);
  if (g->inv_freq) be->ops.to_device(be, g->inv_freq, inv, (size_t)(g->hd / 2) * sizeof *inv);
  free(inv);
  if (!g->inv_freq) goto fail;

  /* activations */
  size_t T = (size_t)g->o.max_batch_tokens;
  size_t qd = (size_t)g->nq * g->hd, kd = (size_t)g->nkv * g->hd;
#define ALLOC_F(ptr, n) \
  if (!((ptr) = eng_alloc(g, (n) * sizeof(float), e))) goto fail
  ALLOC_F(g->x, T * g->D);
  ALLOC_F(g->xn, T * g->D);
  ALLOC_F(g->q, T * qd);
  ALLOC_F(g->k, T * kd);
  ALLOC_F(g->v, T * kd);
  ALLOC_F(g->attn, T * qd);
  ALLOC_F(g->gu, T * 2 * (size_t)g->F);
  ALLOC_F(g->act, T * (size_t)g->F);
  ALLOC_F(g->sel, T * g->D);
  ALLOC_F(g->logits, T * (size_t)g->V);
#undef ALLOC_F
#define ALLOC_I(ptr, n) \
  if (!((ptr) = eng_alloc(g, (n) * sizeof(int32_t), e))) goto fail
  ALLOC_I(g->d_tokens, T);
  ALLOC_I(g->d_pos, T);
  ALLOC_I(g->d_slots, T);
  ALLOC_I(g->d_rows, T);
  ALLOC_I(g->d_qstart, (size_t)g->o.max_seqs + 1);
  ALLOC_I(g->d_ctx, (size_t)g->o.max_seqs);
  ALLOC_I(g->d_bt, (size_t)g->o.max_seqs * (size_t)max_blocks);
#undef ALLOC_I
  return g;
fail:
  pd_engine_free(g);
  return NULL;
}

void pd_engine_free(pd_engine *g) {
  if (!g) return;
  for (int i = 0; i < g->n_owned; i++) g->be->ops.free(g->be, g->owned[i]);
  free(g->owned);
  free(g->layers);
  free(g);
}

static pd_status validate(const pd_engine *g, const pd_batch *b, pd_err *e) {
  int max_blocks = (g->o.max_model_len + g->o.block_size - 1) / g->o.block_size;
  if (b->n_tokens <= 0 || b->n_tokens > g->o.max_batch_tokens)
    return pd_err_set(e, PD_EINVAL, "batch of %d tokens (engine limit %d)", b->n_tokens,
                      g->o.max_batch_tokens);
  if (b->n_seqs <= 0 || b->n_seqs > g->o.max_seqs)
    return pd_err_set(e, PD_EINVAL, "batch of %d sequences (engine limit %d)", b->n_seqs,
                      g->o.max_seqs);
  if (b->max_blocks <= 0 || b->max_blocks > max_blocks)
    return pd_err_set(e, PD_EINVAL, "block table width %d (engine limit %d)", b->max_blocks,
                      max_blocks);
  if (b->n_logits < 0 || b->n_logits > b->n_tokens)
    return pd_err_set(e, PD_EINVAL, "%d logit rows for %d tokens", b->n_logits, b->n_tokens);
  if (b->q_start[0] != 0 || b->q_start[b->n_seqs] != b->n_tokens)
    return pd_err_set(e, PD_EINVAL, "q_start must run from 0 to n_tokens");
  int64_t slots_total = (int64_t)g->o.num_blocks * g->o.block_size;
  for (int s = 0; s < b->n_seqs; s++) {
    int n_new = b->q_start[s + 1] - b->q_start[s];
    int ctx = b->ctx_len[s];
    if (n_new <= 0 || ctx < n_new || ctx > b->max_blocks * g->o.block_size ||
        ctx > g->o.max_model_len)
      return pd_err_set(e, PD_EINVAL, "sequence %d: %d new tokens, context %d", s, n_new, ctx);
    int nb = (ctx + g->o.block_size - 1) / g->o.block_size;
    for (int j = 0; j < nb; j++) {
      int32_t blk = b->block_tables[(size_t)s * b->max_blocks + j];
      if (blk < 0 || blk >= g->o.num_blocks)
        return pd_err_set(e, PD_EINVAL, "sequence %d: block id %d out of range", s, blk);
    }
    for (int i = b->q_start[s]; i < b->q_start[s + 1]; i++) {
      int pos = ctx - n_new + (i - b->q_start[s]);
      if (b->positions[i] != pos)
        return pd_err_set(e, PD_EINVAL, "token %d: position %d, expected %d", i,
                          b->positions[i], pos);
      if (b->slots[i] >= slots_total)
        return pd_err_set(e, PD_EINVAL, "token %d: slot %d out of range", i, b->slots[i]);
    }
  }
  for (int i = 0; i < b->n_tokens; i++)
    if (b->tokens[i] < 0 || b->tokens[i] >= g->V)
      return pd_err_set(e, PD_EINVAL, "token id %d outside the vocabulary (%d)", b->tokens[i],
                        g->V);
  for (int i = 0; i < b->n_logits; i++)
    if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens)
      return pd_err_set(e, PD_EINVAL, "logit row %d out of range", b->logit_rows[i]);
  return PD_OK;
}

pd_status pd_engine_forward(pd_engine *g, const pd_batch *b, float *logits, pd_err *e) {
  pd_status st = validate(g, b, e);
  if (st != PD_OK) return st;
  pd_backend *be = g->be;
  const pd_model_config *c = &g->m->cfg;
  const int M = b->n_tokens, D = g->D, F = g->F, hd = g->hd;
  const int qd = g->nq * hd, kd = g->nkv * hd;
  const size_t i32 = sizeof(int32_t);

  be->ops.to_device(be, g->d_tokens, b->tokens, (size_t)M * i32);
  be->ops.to_device(be, g->d_pos, b->positions, (size_t)M * i32);
  be->ops.to_device(be, g->d_slots, b->slots, (size_t)M * i32);
  be->ops.to_device(be, g->d_qstart, b->q_start, (size_t)(b->n_seqs + 1) * i32);
  be->ops.to_device(be, g->d_ctx, b->ctx_len, (size_t)b->n_seqs * i32);
  be->ops.to_device(be, g->d_bt, b->block_tables, (size_t)b->n_seqs * b->max_blocks * i32);
  if (b->n_logits > 0)
    be->ops.to_device(be, g->d_rows, b->logit_rows, (size_t)b->n_logits * i32);

  int max_ctx = 0;
  for (int s = 0; s < b->n_seqs; s++)
    if (b->ctx_len[s] > max_ctx) max_ctx = b->ctx_len[s];
  pd_attn_batch ab = {b->n_seqs, M, g->d_qstart, g->d_ctx, g->d_bt, b->max_blocks, max_ctx};
  const float scale = 1.0f / sqrtf((float)hd);
  const float eps = (float)c->rms_norm_eps;

  be->ops.embed(be, g->x, g->tok_emb, g->m->tok_embeddings.dtype, g->d_tokens, M, D);
  for (int l = 0; l < c->num_layers; l++) {
    const eng_layer *L = &g->layers[l];
    const pd_layer_weights *W = &g->m->layers[l];
    if (l == 0)
      be->ops.rmsnorm(be, g->xn, g->x, L->attn_norm, eps, M, D);
    else /* x += the previous layer's MLP output (in act's slot `sel`), then normalise */
      be->ops.add_rmsnorm(be, g->xn, g->x, g->sel, L->attn_norm, eps, M, D);
    be->ops.matmul(be, g->q, g->xn, L->wq, W->wq.dtype, L->bq, M, qd, D);
    be->ops.matmul(be, g->k, g->xn, L->wk, W->wk.dtype, L->bk, M, kd, D);
    be->ops.matmul(be, g->v, g->xn, L->wv, W->wv.dtype, L->bv, M, kd, D);
    be->ops.rope(be, g->q, g->k, g->d_pos, g->inv_freq, M, g->nq, g->nkv, hd);
    be->ops.kv_write(be, &L->kv, &g->kvs, g->k, g->v, g->d_slots, M);
    be->ops.attention(be, g->attn, g->q, &L->kv, &g->kvs, &ab, g->nq, scale, L->window);
    be->ops.matmul(be, g->sel, g->attn, L->wo, W->wo.dtype, L->bo, M, D, qd);
    be->ops.add_rmsnorm(be, g->xn, g->x, g->sel, L->ffn_norm, eps, M, D);
    be->ops.matmul(be, g->gu, g->xn, L->wgu, W->w_gate.dtype, L->bgu, M, 2 * F, D);
    be->ops.swiglu(be, g->act, g->gu, M, F);
    be->ops.matmul(be, g->sel, g->act, L->wdown, W->w_down.dtype, L->bdown, M, D, F);
  }
  be->ops.add(be, g->x, g->sel, (size_t)M * D);
  if (b->n_logits > 0) {
    /* final norm and LM head only on the rows asked for */
    be->ops.get_rows(be, g->xn, g->x, g->d_rows, b->n_logits, D);
    be->ops.rmsnorm(be, g->xn, g->xn, g->final_norm, eps, b->n_logits, D);
    be->ops.matmul(be, g->logits, g->xn, g->lm_head, g->m->lm_head.dtype, NULL, b->n_logits,
                   g->V, D);
    be->ops.to_host(be, logits, g->logits, (size_t)b->n_logits * g->V * sizeof(float));
  }
  be->ops.sync(be);
  return PD_OK;
}

pd_status pd_engine_copy_blocks(pd_engine *g, const int32_t *src, const int32_t *dst, int n,
                                pd_err *e) {
  size_t per = (size_t)g->kvs.block_size * g->kvs.num_kv_heads * g->kvs.head_dim *
               pd_dtype_size(g->kvs.dtype);
  char *tmp = NULL;
  if (!g->be->ops.copy && !(tmp = malloc(per)))
    return pd_err_set(e, PD_ENOMEM, "out of host memory");
  for (int i = 0; i < n; i++) {
    if (src[i] < 0 || src[i] >= g->o.num_blocks || dst[i] < 0 || dst[i] >= g->o.num_blocks) {
      free(tmp);
      return pd_err_set(e, PD_EINVAL, "block copy %d -> %d out of range", src[i], dst[i]);
    }
  }
  for (int l = 0; l < g->m->cfg.num_layers; l++) {
    void *kv[2] = {g->layers[l].kv.k, g->layers[l].kv.v};
    for (int t = 0; t < 2; t++) {
      for (int i = 0; i < n; i++) {
        char *d = (char *)kv[t] + (size_t)dst[i] * per;
        const char *s = (const char *)kv[t] + (size_t)src[i] * per;
        if (g->be->ops.copy) {
          g->be->ops.copy(g->be, d, s, per);
        } else {
          g->be->ops.to_host(g->be, tmp, s, per);
          g->be->ops.to_device(g->be, d, tmp, per);
        }
      }
    }
  }
  free(tmp);
  g->be->ops.sync(g->be);
  return PD_OK;
}

pd_status pd_engine_kv(const pd_engine *g, int layer, pd_kv_layer *kv, pd_kv_shape *shape,
                       pd_err *e) {
  if (layer < 0 || layer >= g->m->cfg.num_layers)
    return pd_err_set(e, PD_EINVAL, "layer %d out of range", layer);
  *kv = g->layers[layer].kv;
  *shape = g->kvs;
  return PD_OK;
}
