/* Forward pass of Llama-family decoders over the backend ops table.
 *
 * Per layer, for the M tokens of a ragged batch (D = hidden, F = ffn):
 *   a = rmsnorm(x)                        (the previous op's epilogue, or embed_norm)
 *   qkv = a·Wqkv^T (+b); rope(q, k); kv_write(k, v -> slots); o = paged_attention(q)
 *                                         (one qkv_attention op)
 *   x += o·Wo^T;  a = rmsnorm(x)          (linear, residual epilogue)
 *   h = silu(a·Wgate^T) * (a·Wup^T)       (linear, GLU epilogue)
 *   x += h·Wdown^T;  a = rmsnorm(x)       (linear, residual epilogue; the next layer's norm)
 * then the final norm and the LM head only on the rows whose logits are asked for. Four op calls
 * a layer, on every backend (pd/backend.h, "the layer ops"); what one op hands the next (a) is
 * an act in the backend's own form, in buffers the engine owns. */
#include "pd/engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct eng_layer {
  float *attn_norm, *ffn_norm; /* [D] f32 */
  float *bo;                   /* f32 or NULL */
  float *bgu, *bdown;          /* f32 or NULL; bgu = [b_gate; b_up] */
  float *bqkv;                 /* [bq; bk; bv] (zeros where absent) or NULL */
  int window;                  /* sliding window of this layer, 0 = none */
  pd_wdesc wqkv, wo, wgu, wdown; /* wqkv = [wq; wk; wv], wgu = [w_gate; w_up] */
  pd_kv_layer kv;
} eng_layer;

/* A recorded step: B sequences, M rows and L logits rows (padded), block tables mbw wide. */
typedef struct eng_graph {
  int B, M, L, mbw;
  bool all_rows; /* logits of every row, in order (run_model's all_rows) */
  void *exec; /* NULL: not recorded (seen once so far), or the capture failed (tried) */
  bool tried;
  /* page-locked staging of the graph's metadata, whose upload is the graph's first node
   * (backends with to_device_async and host_alloc; NULL: uploaded from h_meta before each
   * replay) */
  int32_t *hm;
} eng_graph;

#define ENG_MAX_GRAPHS 192
#define ENG_GRAPH_PINNED (256 * 1024) /* largest page-locked metadata staging of a graph */

/* Where a run's metadata lies on the backend. */
typedef struct eng_meta {
  int32_t *tokens, *pos, *slots, *rows, *qstart, *ctx, *bt;
} eng_meta;

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
  pd_wdesc lm_head_w;
  /* activations [max_batch_tokens, ...]: the residual stream x, the QKV rows and q (scratch of
   * qkv_attention), the scratch of the linears, the rows the LM head reads, the logits, and the
   * two acts that carry each op's output to the next */
  float *x, *qkv, *q, *scratch, *sel, *logits;
  pd_act act[2];
  /* metadata on the backend: `dm` is what the ops of a run read; eager runs point it at
   * buffers of their own (`dm_eager`), graph replays into one packed area (d_gmeta) laid out as
   * h_meta, so that a replay's metadata is a single upload */
  eng_meta dm, dm_eager;
  int32_t *d_gmeta;
  int max_blocks; /* block-table capacity per sequence */
  /* graphs of decode steps (backends with capture), and the host staging of their padded
   * metadata */
  bool use_graphs;
  eng_graph graphs[ENG_MAX_GRAPHS];
  int n_graphs;
  uint64_t replays;
  int32_t *h_meta; /* tokens, pos, slots, rows [B each], qstart [B + 1], ctx [B], bt [B, mbw] */
  size_t h_meta_n;
  double forward_s; /* wall time inside pd_engine_forward */
  pd_err pending; /* a recoverable backend failure of the pass in flight (ops.take_error) */
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double pd_engine_forward_seconds(const pd_engine *g) { return g->forward_s; }

/* Collects the backend's recoverable failure, if any, into g->pending (the first one of the
 * pass is kept); true when the pass has one. */
static bool take_pending(pd_engine *g) {
  pd_backend *be = g->be;
  pd_err e = {0};
  if (be->ops.take_error && be->ops.take_error(be, &e) != PD_OK && g->pending.code == PD_OK)
    g->pending = e;
  return g->pending.code != PD_OK;
}

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
 * With several parts, returns their row-concatenation (all share dtype and cols). */
static const void *place_weights(pd_engine *g, const pd_weight *const *parts, int n, pd_err *e) {
  if (n == 1 && g->be->host_memory) return parts[0]->data;
  const pd_dtype dt = parts[0]->dtype;
  size_t total = 0;
  for (int i = 0; i < n; i++) total += (size_t)parts[i]->rows * pd_dtype_row_bytes(dt, parts[i]->cols);
  char *d = eng_alloc(g, total, e);
  if (!d) return NULL;
  if (g->be->host_memory) { /* concatenation in host memory */
    size_t off = 0;
    for (int i = 0; i < n; i++) {
      size_t nb = (size_t)parts[i]->rows * pd_dtype_row_bytes(dt, parts[i]->cols);
      memcpy(d + off, parts[i]->data, nb);
      off += nb;
    }
    return d;
  }
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    size_t nb = (size_t)parts[i]->rows * pd_dtype_row_bytes(dt, parts[i]->cols);
    g->be->ops.to_device(g->be, d + off, parts[i]->data, nb);
    off += nb;
  }
  return d;
}

static const void *place_weight(pd_engine *g, const pd_weight *a, const pd_weight *b, pd_err *e) {
  const pd_weight *parts[2] = {a, b};
  return place_weights(g, parts, b ? 2 : 1, e);
}

/* [bq; bk; bv] as f32 on the backend, zeros for the absent ones. */
static float *upload_qkv_bias(pd_engine *g, const pd_layer_weights *w, int qd, int kd, pd_err *e) {
  float *tmp = calloc((size_t)(qd + 2 * kd), sizeof *tmp);
  if (!tmp) {
    pd_err_set(e, PD_ENOMEM, "out of host memory");
    return NULL;
  }
  const pd_weight *b[3] = {&w->bq, &w->bk, &w->bv};
  const int off[3] = {0, qd, qd + kd}, len[3] = {qd, kd, kd};
  for (int i = 0; i < 3; i++)
    if (b[i]->data) pd_convert_to_f32(tmp + off[i], b[i]->data, b[i]->dtype, (size_t)len[i]);
  float *d = eng_alloc(g, (size_t)(qd + 2 * kd) * sizeof *d, e);
  if (d) g->be->ops.to_device(g->be, d, tmp, (size_t)(qd + 2 * kd) * sizeof *d);
  free(tmp);
  return d;
}

/* The largest batch a decode graph is recorded for. */
static int graph_cap(const pd_engine *g) {
  return g->o.max_seqs < g->o.max_batch_tokens ? g->o.max_seqs : g->o.max_batch_tokens;
}

/* The most rows a multi-token step's graph has, and the most tokens one of its sequences
 * brings (longer chunks are prefill, whose steps are long enough to run op by op). */
#define ENG_GRAPH_MAX_ROWS 1024
#define ENG_GRAPH_MAX_Q 16
static int graph_rows_cap(const pd_engine *g) {
  return g->o.max_batch_tokens < ENG_GRAPH_MAX_ROWS ? g->o.max_batch_tokens : ENG_GRAPH_MAX_ROWS;
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
      g->o.kv_dtype != PD_DTYPE_BF16 && g->o.kv_dtype != PD_DTYPE_F8_E4M3) {
    pd_err_set(e, PD_EUNSUPPORTED, "KV cache dtype %s is not supported",
               pd_dtype_name(g->o.kv_dtype));
    goto fail;
  }
  if (c->quant.act_fp8_static && strcmp(be->ops.name, "cpu") != 0) {
    pd_err_set(e, PD_EUNSUPPORTED,
               "FP8 checkpoints with static activation scales (input_scale) run on the CPU "
               "backend only (the %s backend has no kernels for them yet)", be->ops.name);
    goto fail;
  }
  if (g->o.kv_dtype == PD_DTYPE_F8_E4M3 && strcmp(be->ops.name, "cpu") != 0) {
    pd_err_set(e, PD_EUNSUPPORTED,
               "an FP8 KV cache runs on the CPU backend only (the %s backend's attention "
               "kernels read 16- and 32-bit caches)", be->ops.name);
    goto fail;
  }
  if (!be->ops.act_bytes || !be->ops.embed_norm || !be->ops.norm || !be->ops.linear ||
      !be->ops.qkv_attention) {
    pd_err_set(e, PD_EUNSUPPORTED, "backend %s has no layer ops", be->ops.name);
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
  g->lm_head_w = (pd_wdesc){m->lm_head.dtype, g->lm_head, g->V, g->D};
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
    if (w->bo.data && !(L->bo = upload_f32(g, &w->bo, e))) goto fail;
    if (w->b_down.data && !(L->bdown = upload_f32(g, &w->b_down, e))) goto fail;
    if (w->b_gate.data && !(L->bgu = upload_f32_pair(g, &w->b_gate, &w->b_up, e))) goto fail;
    L->window = (c->sliding_window > 0 && l >= c->sliding_window_first_layer) ? c->sliding_window : 0;
    if (w->w_gate.dtype != w->w_up.dtype) {
      pd_err_set(e, PD_EUNSUPPORTED, "layer %d: gate and up projections differ in dtype", l);
      goto fail;
    }
    if (w->wq.dtype != w->wk.dtype || w->wq.dtype != w->wv.dtype) {
      pd_err_set(e, PD_EUNSUPPORTED, "layer %d: q, k and v projections differ in dtype", l);
      goto fail;
    }
    const pd_weight *qkv[3] = {&w->wq, &w->wk, &w->wv};
    const int qd = g->nq * g->hd, kd = g->nkv * g->hd;
    L->wqkv = (pd_wdesc){w->wq.dtype, place_weights(g, qkv, 3, e), qd + 2 * kd, g->D};
    if (!L->wqkv.data) goto fail;
    if ((w->bq.data || w->bk.data || w->bv.data) &&
        !(L->bqkv = upload_qkv_bias(g, w, qd, kd, e)))
      goto fail;
    L->wo = (pd_wdesc){w->wo.dtype, place_weight(g, &w->wo, NULL, e), g->D, qd};
    L->wgu = (pd_wdesc){w->w_gate.dtype, place_weight(g, &w->w_gate, &w->w_up, e), 2 * g->F,
                        g->D};
    L->wdown = (pd_wdesc){w->w_down.dtype, place_weight(g, &w->w_down, NULL, e), g->D, g->F};
    if (!L->wo.data || !L->wgu.data || !L->wdown.data) goto fail;
    L->kv.k = eng_alloc(g, kv_bytes, e);
    L->kv.v = eng_alloc(g, kv_bytes, e);
    L->kv.k_scale = w->k_scale; /* (0: 1) */
    L->kv.v_scale = w->v_scale;
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
  ALLOC_F(g->q, T * qd);
  ALLOC_F(g->qkv, T * (qd + 2 * kd));
  const size_t scr = 2 * (size_t)g->F > (size_t)g->D ? 2 * (size_t)g->F : (size_t)g->D;
  ALLOC_F(g->scratch, T * scr);
  ALLOC_F(g->sel, T * g->D);
  ALLOC_F(g->logits, T * (size_t)g->V);
#undef ALLOC_F
  /* the acts: the largest K an op hands on is D (norms), F (the GLU) or qd (the attention) */
  int kmax = g->D > g->F ? g->D : g->F;
  if ((int)qd > kmax) kmax = (int)qd;
  for (int i = 0; i < 2; i++) {
    g->act[i].data = eng_alloc(g, be->ops.act_bytes(be, (int)T, kmax), e);
    if (!g->act[i].data) goto fail;
  }
#define ALLOC_I(ptr, n) \
  if (!((ptr) = eng_alloc(g, (n) * sizeof(int32_t), e))) goto fail
  ALLOC_I(g->dm_eager.tokens, T);
  ALLOC_I(g->dm_eager.pos, T);
  ALLOC_I(g->dm_eager.slots, T);
  ALLOC_I(g->dm_eager.rows, T);
  ALLOC_I(g->dm_eager.qstart, (size_t)g->o.max_seqs + 1);
  ALLOC_I(g->dm_eager.ctx, (size_t)g->o.max_seqs);
  ALLOC_I(g->dm_eager.bt, (size_t)g->o.max_seqs * (size_t)max_blocks);
  g->dm = g->dm_eager;
  g->max_blocks = max_blocks;
  g->use_graphs = !g->o.enforce_eager && be->ops.capture_begin && be->ops.capture_end &&
                  be->ops.graph_launch && be->ops.graph_free;
  if (g->use_graphs) { /* a replay's padded batch: at most graph_cap sequences */
    const size_t B = (size_t)graph_cap(g), R = (size_t)graph_rows_cap(g);
    const size_t M = R > B ? R : B;
    ALLOC_I(g->d_gmeta, 4 * M + 2 * B + 1 + B * (size_t)max_blocks);
  }
#undef ALLOC_I
  return g;
fail:
  pd_engine_free(g);
  return NULL;
}

void pd_engine_free(pd_engine *g) {
  if (!g) return;
  for (int i = 0; i < g->n_graphs; i++) {
    if (g->graphs[i].exec) g->be->ops.graph_free(g->be, g->graphs[i].exec);
    if (g->graphs[i].hm) g->be->ops.host_free(g->be, g->graphs[i].hm);
  }
  free(g->h_meta);
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

bool pd_engine_can_sample(const pd_engine *g) {
  return g->be->ops.sample != NULL && !g->o.no_device_sampling;
}

void pd_engine_graph_stats(const pd_engine *g, uint64_t *replays, int *n_graphs) {
  if (replays) *replays = g->replays;
  if (n_graphs) {
    int n = 0;
    for (int i = 0; i < g->n_graphs; i++) n += g->graphs[i].exec != NULL;
    *n_graphs = n;
  }
}

static pd_status validate_sampling(const pd_engine *g, const pd_batch *b, pd_err *e) {
  if (b->n_sample == 0) return PD_OK;
  if (!pd_engine_can_sample(g))
    return pd_err_set(e, PD_EUNSUPPORTED, "backend %s cannot sample on the device",
                      g->be->ops.name);
  if (b->n_sample < 0 || b->n_sample > b->n_logits || !b->sample || !b->sample_out ||
      b->n_edits < 0 || (b->n_edits > 0 && !b->edits))
    return pd_err_set(e, PD_EINVAL, "%d device-sampled rows of %d logit rows", b->n_sample,
                      b->n_logits);
  for (int i = 0; i < b->n_sample; i++) {
    const pd_dev_sample_spec *sp = &b->sample[i];
    if (sp->edit_count < 0 || sp->edit_begin < 0 || sp->edit_begin > b->n_edits ||
        sp->edit_count > b->n_edits - sp->edit_begin || sp->n_top > PD_DEV_SAMPLE_MAX_TOP)
      return pd_err_set(e, PD_EINVAL, "device sample %d: bad edit range or n_top", i);
  }
  for (int i = 0; i < b->n_edits; i++)
    if (b->edits[i].id < 0 || b->edits[i].id >= g->V)
      return pd_err_set(e, PD_EINVAL, "sampling edit of token %d outside the vocabulary",
                        b->edits[i].id);
  return PD_OK;
}

/* The layers, the final norm and the LM head over the metadata already on the backend.
 * all_rows: the logits rows are every row of the batch in order (n_logits == M, row i = i), as
 * in decode steps: the last layer's residual linear then norms for the LM head itself. */
static void run_model(pd_engine *g, int M, int n_seqs, int max_blocks, int max_ctx,
                      int n_logits, bool all_rows) {
  pd_backend *be = g->be;
  const pd_model_config *c = &g->m->cfg;
  const int D = g->D;
  const pd_attn_batch ab = {n_seqs, M, g->dm.qstart, g->dm.ctx, g->dm.bt, max_blocks, max_ctx};
  const float scale = 1.0f / sqrtf((float)g->hd);
  const float eps = (float)c->rms_norm_eps;
  pd_act *a = &g->act[0], *h = &g->act[1]; /* a: normed rows; h: attention / GLU output */
  const bool head_now = all_rows && n_logits > 0;

  be->ops.embed_norm(be, g->x, a, g->tok_emb, g->m->tok_embeddings.dtype, g->dm.tokens, M, D,
                     g->layers[0].attn_norm, eps, g->layers[0].wqkv.dtype);
  for (int l = 0; l < c->num_layers; l++) {
    const eng_layer *L = &g->layers[l];
    const pd_qkv_attn at = {.in = a, .w = L->wqkv, .bias = L->bqkv, .pos = g->dm.pos,
                            .inv_freq = g->inv_freq, .kv = &L->kv, .shape = &g->kvs,
                            .slots = g->dm.slots, .batch = &ab, .n_q_heads = g->nq,
                            .scale = scale, .window = L->window, .out = h,
                            .out_wdtype = L->wo.dtype, .qkv = g->qkv, .q = g->q};
    be->ops.qkv_attention(be, &at);
    const pd_linear o = {.in = h, .w = L->wo, .bias = L->bo, .epilogue = PD_LIN_RESIDUAL,
                         .y = g->x, .out = a, .norm_w = L->ffn_norm, .eps = eps,
                         .out_wdtype = L->wgu.dtype, .scratch = g->scratch};
    be->ops.linear(be, &o);
    const pd_linear gu = {.in = a, .w = L->wgu, .bias = L->bgu, .epilogue = PD_LIN_GLU,
                          .out = h, .out_wdtype = L->wdown.dtype, .scratch = g->scratch};
    be->ops.linear(be, &gu);
    /* the next layer's norm; after the last, the final norm where the LM head reads every row */
    const bool last = l + 1 == c->num_layers;
    const pd_linear down = {
        .in = h, .w = L->wdown, .bias = L->bdown, .epilogue = PD_LIN_RESIDUAL, .y = g->x,
        .out = a, .eps = eps, .scratch = g->scratch,
        .norm_w = !last ? g->layers[l + 1].attn_norm : head_now ? g->final_norm : NULL,
        .out_wdtype = !last ? g->layers[l + 1].wqkv.dtype : g->lm_head_w.dtype};
    be->ops.linear(be, &down);
  }
  if (n_logits <= 0) return;
  if (!head_now) { /* final norm and LM head only on the rows asked for */
    be->ops.get_rows(be, g->sel, g->x, g->dm.rows, n_logits, D);
    be->ops.norm(be, a, g->sel, g->final_norm, eps, n_logits, D, g->lm_head_w.dtype);
  }
  const pd_linear head = {.in = a, .w = g->lm_head_w, .epilogue = PD_LIN_STORE, .y = g->logits,
                          .scratch = g->scratch};
  be->ops.linear(be, &head);
}

/* The batch's metadata into the engine's backend buffers. */
static void upload_batch(pd_engine *g, const pd_batch *b) {
  pd_backend *be = g->be;
  const size_t i32 = sizeof(int32_t), M = (size_t)b->n_tokens, S = (size_t)b->n_seqs;
  be->ops.to_device(be, g->dm.tokens, b->tokens, M * i32);
  be->ops.to_device(be, g->dm.pos, b->positions, M * i32);
  be->ops.to_device(be, g->dm.slots, b->slots, M * i32);
  be->ops.to_device(be, g->dm.qstart, b->q_start, (S + 1) * i32);
  be->ops.to_device(be, g->dm.ctx, b->ctx_len, S * i32);
  be->ops.to_device(be, g->dm.bt, b->block_tables, S * (size_t)b->max_blocks * i32);
  if (b->n_logits > 0)
    be->ops.to_device(be, g->dm.rows, b->logit_rows, (size_t)b->n_logits * i32);
}

/* Whether the batch asks for the logits of every row, in order (decode steps). */
static bool rows_all(const pd_batch *b) {
  if (b->n_logits != b->n_tokens) return false;
  for (int i = 0; i < b->n_logits; i++)
    if (b->logit_rows[i] != i) return false;
  return true;
}

/* Padded batch sizes that graphs are recorded for. */
static int graph_bucket(const pd_engine *g, int n) {
  static const int sizes[] = {1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                              144, 160, 176, 192, 208, 224, 240, 256, 320, 384, 448, 512};
  const int cap = graph_cap(g);
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    if (sizes[i] >= n) return sizes[i] <= cap ? sizes[i] : n <= cap ? cap : -1;
  return -1;
}

/* Padded row counts of the graphs of multi-token steps (speculative verification, a draft's
 * catch-up: a few tokens per sequence) and of their logits rows: steps of about 1.25x. */
static int rows_bucket(int n, int cap) {
  static const int sizes[] = {1,   2,   3,   4,   5,   6,   8,   10,  12,  16,  20,  24,
                              28,  32,  40,  48,  56,  64,  80,  96,  112, 128, 160, 192,
                              224, 256, 320, 384, 448, 512, 640, 768, 896, 1024};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    if (sizes[i] >= n) return sizes[i] <= cap ? sizes[i] : n <= cap ? cap : -1;
  return -1;
}

/* The packed metadata of a replay with B sequences, M rows and L logits rows (block tables last,
 * any width), in the order of h_meta: tokens, pos, slots [M each], rows [L], qstart [B + 1],
 * ctx [B], bt [B, mbw]. */
static eng_meta packed_meta(int32_t *base, int B, int M, int L) {
  eng_meta m;
  m.tokens = base;
  m.pos = m.tokens + M;
  m.slots = m.pos + M;
  m.rows = m.slots + M;
  m.qstart = m.rows + L;
  m.ctx = m.qstart + B + 1;
  m.bt = m.ctx + B;
  return m;
}

/* A step through a recorded graph. The batch is padded to a recorded shape, so that one
 * recording serves every step of that shape:
 *  - decode steps (one token per sequence) to B sequences: a padding sequence is token 0 at
 *    position 0, no cache write, a context of one token in block 0;
 *  - steps of a few tokens per sequence (verification of speculated tokens) to B sequences and
 *    M rows: the real rows keep their places, the padding sequences share the padding rows (at
 *    least one each, at positions 0.., no cache writes, keys read from block 0), and the logits
 *    rows are padded to L (row 0);
 * and the block tables to mbw columns. Outputs of padding rows are ignored. Returns false when
 * the step cannot use a graph. */
static bool forward_graph(pd_engine *g, const pd_batch *b) {
  const int n = b->n_seqs, n_rows = b->n_tokens;
  const bool all_rows = rows_all(b);
  int B, M, L;
  if (n_rows == n) {
    B = M = L = graph_bucket(g, n);
    if (B < 0) return false;
  } else {
    for (int s = 0; s < n; s++)
      if (b->q_start[s + 1] - b->q_start[s] > ENG_GRAPH_MAX_Q) return false;
    const int cap = graph_rows_cap(g);
    B = graph_bucket(g, n);
    for (;;) { /* every padding sequence has a row; padding rows need a padding sequence */
      if (B < 0) return false;
      M = rows_bucket(n_rows + (B - n), cap);
      if (M < 0) return false;
      if (M > n_rows && B == n) {
        B = graph_bucket(g, n + 1);
        continue;
      }
      break;
    }
    L = all_rows ? M : rows_bucket(b->n_logits > 0 ? b->n_logits : 1, M);
    if (L < 0) return false;
  }
  int mbw = 8;
  while (mbw < b->max_blocks) mbw *= 2;
  const int pad_seqs = B - n, pad_rows = M - n_rows;
  const int pad_each = pad_seqs > 0 ? pad_rows / pad_seqs : 0,
            pad_more = pad_seqs > 0 ? pad_rows % pad_seqs : 0;
  while (pad_seqs > 0 && mbw * g->o.block_size < pad_each + 1) mbw *= 2;
  if (mbw > g->max_blocks) {
    if (pad_seqs > 0 && g->max_blocks * g->o.block_size < pad_each + 1) return false;
    mbw = g->max_blocks;
  }
  eng_graph *gr = NULL;
  for (int i = 0; i < g->n_graphs; i++)
    if (g->graphs[i].B == B && g->graphs[i].M == M && g->graphs[i].L == L &&
        g->graphs[i].mbw == mbw && g->graphs[i].all_rows == all_rows)
      gr = &g->graphs[i];
  if (gr && !gr->exec && gr->tried) return false; /* capture failed before: eager */
  if (!gr) {
    /* A shape is recorded the second time it comes: one that comes once (a probe of
     * speculation, a rare mix) costs no capture. Its first time runs op by op, unpadded. A
     * full table makes room from shapes seen once. */
    if (g->n_graphs < ENG_MAX_GRAPHS) {
      gr = &g->graphs[g->n_graphs++];
    } else {
      for (int i = 0; i < g->n_graphs && !gr; i++)
        if (!g->graphs[i].exec && !g->graphs[i].tried) gr = &g->graphs[i];
      if (!gr) return false;
    }
    *gr = (eng_graph){.B = B, .M = M, .L = L, .mbw = mbw, .all_rows = all_rows};
    return false;
  }

  pd_backend *be = g->be;
  const bool record = !gr->exec; /* its second time: run it, then record it */
  const size_t need = (size_t)3 * M + L + 2 * (size_t)B + 1 + (size_t)B * mbw;
  /* the staging: the graph's own page-locked buffer (a new shape gets one where the backend
   * can upload from it inside the graph and the metadata is small: at most ENG_GRAPH_PINNED
   * bytes, so that up to ENG_MAX_GRAPHS graphs pin little memory; larger batches' steps are
   * long enough for a copy of their own), else the pageable h_meta */
  int32_t *hm = gr->hm;
  if (record && !hm && be->ops.to_device_async && be->ops.host_alloc && be->ops.host_free &&
      need * sizeof(int32_t) <= ENG_GRAPH_PINNED)
    hm = be->ops.host_alloc(be, need * sizeof(int32_t));
  if (!hm && need > g->h_meta_n) {
    int32_t *p = realloc(g->h_meta, need * sizeof *p);
    if (!p) return false;
    g->h_meta = p;
    g->h_meta_n = need;
  }
  int32_t *hbuf = hm ? hm : g->h_meta;
  const eng_meta h = packed_meta(hbuf, B, M, L);
  memcpy(h.tokens, b->tokens, (size_t)n_rows * sizeof *h.tokens);
  memcpy(h.pos, b->positions, (size_t)n_rows * sizeof *h.pos);
  memcpy(h.slots, b->slots, (size_t)n_rows * sizeof *h.slots);
  memcpy(h.qstart, b->q_start, (size_t)(n + 1) * sizeof *h.qstart);
  memcpy(h.ctx, b->ctx_len, (size_t)n * sizeof *h.ctx);
  for (int i = 0; i < L; i++)
    h.rows[i] = all_rows ? i : i < b->n_logits ? b->logit_rows[i] : 0;
  for (int i = 0; i < n; i++) {
    int32_t *r = h.bt + (size_t)i * mbw;
    memcpy(r, b->block_tables + (size_t)i * b->max_blocks, (size_t)b->max_blocks * sizeof *r);
    for (int j = b->max_blocks; j < mbw; j++) r[j] = 0;
  }
  int row = n_rows;
  for (int i = n; i < B; i++) { /* the padding sequences */
    const int t = n_rows == n ? 1 : pad_each + (i - n < pad_more);
    h.qstart[i] = row;
    h.ctx[i] = t;
    for (int j = 0; j < t; j++, row++) {
      h.tokens[row] = 0;
      h.pos[row] = j;
      h.slots[row] = -1;
    }
    memset(h.bt + (size_t)i * mbw, 0, (size_t)mbw * sizeof *h.bt);
  }
  h.qstart[B] = row;
  PD_ASSERT(row == M);
  /* one upload (H200, Llama-3-8B batch 1: 4.195 -> 4.186 ms a step against one per array):
   * from the host's first copy to the graph's first kernel the GPU waits; from page-locked
   * staging it is the graph's first node, not a call of its own before the launch */
  const size_t bytes = need * sizeof(int32_t);
  g->dm = packed_meta(g->d_gmeta, B, M, L);
  if (!hm) be->ops.to_device(be, g->d_gmeta, g->h_meta, bytes);
  const int max_ctx = mbw * g->o.block_size;
  if (!record) {
    if (be->ops.graph_launch(be, gr->exec)) {
      g->replays++;
    } else {
      /* the launch failed: the error is recorded */
      if (hm) be->ops.to_device_async(be, g->d_gmeta, hm, bytes);
      run_model(g, M, B, mbw, max_ctx, L, all_rows);
    }
  } else {
    /* Its first padded run: run it for real (this also sizes every scratch buffer), then
     * record it for the next steps. */
    if (hm) be->ops.to_device_async(be, g->d_gmeta, hm, bytes);
    run_model(g, M, B, mbw, max_ctx, L, all_rows);
    be->ops.sync(be);
    if (take_pending(g)) { /* (scratch could not grow: no graph; a later step tries again) */
      if (hm) be->ops.host_free(be, hm);
      g->dm = g->dm_eager;
      return true;
    }
    gr->tried = true;
    gr->hm = hm;
    if (be->ops.capture_begin(be)) {
      if (hm) be->ops.to_device_async(be, g->d_gmeta, hm, bytes);
      run_model(g, M, B, mbw, max_ctx, L, all_rows);
      gr->exec = be->ops.capture_end(be);
    }
  }
  g->dm = g->dm_eager;
  return true;
}

pd_status pd_engine_submit(pd_engine *g, const pd_batch *b, pd_err *e) {
  const double t0 = now_s();
  pd_status st = validate(g, b, e);
  if (st == PD_OK) st = validate_sampling(g, b, e);
  if (st != PD_OK) return st;
  bool done = false;
  if (g->use_graphs) done = forward_graph(g, b);
  if (!done) {
    upload_batch(g, b);
    int max_ctx = 0;
    for (int s = 0; s < b->n_seqs; s++)
      if (b->ctx_len[s] > max_ctx) max_ctx = b->ctx_len[s];
    run_model(g, b->n_tokens, b->n_seqs, b->max_blocks, max_ctx, b->n_logits, rows_all(b));
  }
  take_pending(g);
  g->forward_s += now_s() - t0;
  return PD_OK;
}

pd_status pd_engine_finish(pd_engine *g, const pd_batch *b, float *logits, pd_err *e) {
  const double t0 = now_s();
  pd_backend *be = g->be;
  const int n_host = b->n_logits - b->n_sample;
  if (b->n_sample > 0) {
    for (int i = 0; i < b->n_sample; i++) b->sample[i].row = n_host + i;
    be->ops.sample(be, b->sample_out, g->logits, g->V, b->sample, b->n_sample, b->edits,
                   b->n_edits);
  }
  if (n_host > 0)
    be->ops.to_host(be, logits, g->logits, (size_t)n_host * g->V * sizeof(float));
  be->ops.sync(be);
  g->forward_s += now_s() - t0;
  /* a device that faulted (sticky) leaves logits and samples undefined: say so instead */
  pd_err be_err = {0};
  if (pd_backend_status(be, &be_err) != PD_OK)
    return pd_err_set(e, PD_EBACKEND, "the device failed: %s", be_err.msg);
  /* a recoverable failure (no memory for scratch): this pass has no result; the next may */
  if (take_pending(g)) {
    pd_status st = pd_err_set(e, g->pending.code, "%s", g->pending.msg);
    g->pending = (pd_err){0};
    return st;
  }
  return PD_OK;
}

pd_status pd_engine_forward(pd_engine *g, const pd_batch *b, float *logits, pd_err *e) {
  pd_status st = pd_engine_submit(g, b, e);
  return st != PD_OK ? st : pd_engine_finish(g, b, logits, e);
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
