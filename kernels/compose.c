/* The layer ops (pd_linear, pd_qkv_attn, embed_norm, norm) as compositions of a backend's
 * primitive ops, for backends without fused versions (the CPU backend). Their acts are f32 rows:
 * data holds M x K floats, form and aux are 0. The arithmetic is the primitives' own, op for op,
 * so a forward pass through these gives the bits the primitives give. */
#include <stdint.h>

#include "pd/status.h"
#include "pd/backend.h"

static size_t cmp_act_bytes(pd_backend *be, int M, int K) {
  (void)be;
  return (size_t)(M > 0 ? M : 0) * (size_t)(K > 0 ? K : 0) * sizeof(float);
}

static void set_act(pd_act *a, int M, int K) {
  a->M = M;
  a->K = K;
  a->form = 0;
  a->aux = 0;
  a->auxf = 0.0f;
}

static void cmp_norm(pd_backend *be, pd_act *out, const float *x, const float *norm_w, float eps,
                     int M, int D, pd_dtype out_wdtype) {
  (void)out_wdtype;
  set_act(out, M, D);
  be->ops.rmsnorm(be, out->data, x, norm_w, eps, M, D);
}

static void cmp_embed_norm(pd_backend *be, float *x, pd_act *out, const void *table, pd_dtype dt,
                           const int32_t *ids, int M, int D, const float *norm_w, float eps,
                           pd_dtype out_wdtype) {
  be->ops.embed(be, x, table, dt, ids, M, D);
  cmp_norm(be, out, x, norm_w, eps, M, D, out_wdtype);
}

static void cmp_linear(pd_backend *be, const pd_linear *p) {
  const pd_act *in = p->in;
  const int M = in->M, K = in->K, N = p->w.N;
  PD_ASSERT(in->form == 0 && K == p->w.K);
  const float *x = in->data;
  switch (p->epilogue) {
  case PD_LIN_STORE:
    be->ops.matmul(be, p->y, x, p->w.data, p->w.dtype, p->bias, M, N, K);
    break;
  case PD_LIN_RESIDUAL:
    be->ops.matmul(be, p->scratch, x, p->w.data, p->w.dtype, p->bias, M, N, K);
    if (p->norm_w) {
      set_act(p->out, M, N);
      be->ops.add_rmsnorm(be, p->out->data, p->y, p->scratch, p->norm_w, p->eps, M, N);
    } else {
      be->ops.add(be, p->y, p->scratch, (size_t)M * N);
    }
    break;
  case PD_LIN_GLU:
    PD_ASSERT(N % 2 == 0);
    set_act(p->out, M, N / 2);
    if (be->ops.matmul_glu) {
      be->ops.matmul_glu(be, p->out->data, p->scratch, x, p->w.data, p->w.dtype, p->bias, M,
                         N / 2, K);
    } else {
      be->ops.matmul(be, p->scratch, x, p->w.data, p->w.dtype, p->bias, M, N, K);
      be->ops.swiglu(be, p->out->data, p->scratch, M, N / 2);
    }
    break;
  }
}

/* The three projections as the row blocks of the concatenated weight (Wq, Wk, Wv), so that each
 * is the product a separate weight would give; k and v go to the qkv scratch. */
static void cmp_qkv_attention(pd_backend *be, const pd_qkv_attn *p) {
  const pd_act *in = p->in;
  const pd_kv_shape *sh = p->shape;
  const int M = in->M, K = in->K, hd = sh->head_dim;
  const int qd = p->n_q_heads * hd, kd = sh->num_kv_heads * hd;
  PD_ASSERT(in->form == 0 && K == p->w.K && p->w.N == qd + 2 * kd);
  PD_ASSERT(p->batch->n_tokens == M);
  const size_t row = pd_dtype_row_bytes(p->w.dtype, K);
  const char *w = p->w.data;
  const float *x = in->data;
  float *k = p->qkv, *v = p->qkv + (size_t)M * kd;
  const float *b = p->bias;
  be->ops.matmul(be, p->q, x, w, p->w.dtype, b, M, qd, K);
  be->ops.matmul(be, k, x, w + (size_t)qd * row, p->w.dtype, b ? b + qd : NULL, M, kd, K);
  be->ops.matmul(be, v, x, w + (size_t)(qd + kd) * row, p->w.dtype, b ? b + qd + kd : NULL, M,
                 kd, K);
  be->ops.rope(be, p->q, k, p->pos, p->inv_freq, M, p->n_q_heads, sh->num_kv_heads, hd);
  be->ops.kv_write(be, p->kv, sh, k, v, p->slots, M);
  set_act(p->out, M, qd);
  be->ops.attention(be, p->out->data, p->q, p->kv, sh, p->batch, p->n_q_heads, p->scale,
                    p->window);
}

static void cmp_act_read(pd_backend *be, float *rows, const pd_act *a) {
  PD_ASSERT(a->form == 0);
  be->ops.to_host(be, rows, a->data, (size_t)a->M * a->K * sizeof(float));
}

void pd_backend_compose_layer_ops(pd_backend *be) {
  pd_backend_ops *o = &be->ops;
  if (!o->act_bytes) o->act_bytes = cmp_act_bytes;
  if (!o->embed_norm) o->embed_norm = cmp_embed_norm;
  if (!o->norm) o->norm = cmp_norm;
  if (!o->linear) o->linear = cmp_linear;
  if (!o->qkv_attention) o->qkv_attention = cmp_qkv_attention;
  if (!o->act_read) o->act_read = cmp_act_read;
}
