/* The backend interface: one ops table, filled by each implementation (CPU, CUDA).
 *
 * The engine (common/engine) calls only these entry points; no backend #ifdefs in model code.
 * All pointers passed to ops are backend memory (host memory for the CPU backend, device memory
 * for CUDA) obtained from be->ops.alloc, except where a parameter says "host".
 * Activations are float32, row-major. Weights are row-major [out_features, in_features] in
 * their stored dtype (F32, F16 or BF16) and are converted on the fly; accumulation is float32.
 *
 * Paged KV cache layout, per layer (see pd_kv_layer):
 *   k, v: [num_blocks, num_kv_heads, block_size, head_dim] in kv_dtype
 * A token's slot is block_id * block_size + offset_in_block.
 *
 * Ops are asynchronous with respect to the host on devices; be->ops.sync waits for completion.
 * The CPU backend completes each op before returning. */
#ifndef PD_BACKEND_H
#define PD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/dtype.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_backend pd_backend;

/* One layer's paged K and V storage. */
typedef struct pd_kv_layer {
  void *k; /* [num_blocks, num_kv_heads, block_size, head_dim] */
  void *v; /* [num_blocks, num_kv_heads, block_size, head_dim] */
  /* FP8 (e4m3) caches: the cache holds K / k_scale and V / v_scale (the checkpoint's per-tensor
   * scales, or 1); 0 means 1. Unused by the float dtypes. */
  float k_scale, v_scale;
} pd_kv_layer;

static inline float pd_kv_k_scale(const pd_kv_layer *kv) {
  return kv->k_scale > 0.0f ? kv->k_scale : 1.0f;
}
static inline float pd_kv_v_scale(const pd_kv_layer *kv) {
  return kv->v_scale > 0.0f ? kv->v_scale : 1.0f;
}

typedef struct pd_kv_shape {
  int num_blocks;
  int block_size;
  int num_kv_heads;
  int head_dim;
  pd_dtype dtype; /* F32, F16, BF16; F8_E4M3 on the CPU backend (with pd_kv_layer's scales) */
} pd_kv_shape;

/* One run of KV staging segments for kv_gather_runs / kv_scatter_runs: n segments of seg_bytes,
 * segment j at (char *)base + ids[j] * stride + offset in backend memory (base: a layer's k or
 * v; ids: HOST memory, >= 0) and at host + host_off + j * seg_bytes in the call's host buffer.
 * n == 0 or seg_bytes == 0: nothing (base and ids may then be NULL). */
typedef struct pd_kv_run {
  const void *base;
  const int32_t *ids; /* [n], host */
  int n;
  size_t stride, offset, seg_bytes;
  size_t host_off;
} pd_kv_run;

/* A ragged batch as attention sees it. Sequence s owns the query rows
 * [q_start[s], q_start[s+1]) of the batch; those rows are the newest tokens of the sequence,
 * at positions ctx_len[s] - n_new .. ctx_len[s] - 1, where n_new = q_start[s+1] - q_start[s].
 * Their K/V are already written to the cache when attention runs (kv_write comes first).
 * Token t of sequence s lives in block block_tables[s * max_blocks + t / block_size].
 * All arrays are backend memory. */
typedef struct pd_attn_batch {
  int n_seqs;
  int n_tokens;               /* q_start[n_seqs] */
  const int32_t *q_start;     /* [n_seqs + 1] */
  const int32_t *ctx_len;     /* [n_seqs] tokens in the cache for s, new ones included */
  const int32_t *block_tables; /* [n_seqs, max_blocks] */
  int max_blocks;
  int max_ctx_len;            /* max over ctx_len (used to split the work) */
} pd_attn_batch;

/* ---- device sampling (the optional `sample` op) ----
 * One row of logits sampled on the device with the pipeline of pd/sample.h, steps 1-5:
 * sparse edits (min_tokens suppression, logit_bias, repetition / frequency / presence
 * penalties, in that order and arithmetic), then greedy argmax (ties to the lowest id) or
 * temperature, min_p, top_k (ties at the boundary kept), top_p (smallest descending prefix
 * whose renormalised mass reaches top_p; equal values ordered by id) and one inverse-CDF draw
 * with the given uniform over the kept tokens in id order. Logprobs are of the RAW row
 * (log_softmax of the unedited logits), with the rank and the n_top most likely tokens
 * (descending, ties by lower id), as pd_logprobs_compute. */
#define PD_DEV_SAMPLE_MAX_TOP 20

enum {
  PD_DEV_EDIT_SUPPRESS = 1, /* min_tokens: the logit becomes -inf */
  PD_DEV_EDIT_BIAS = 2,     /* logit += bias */
  PD_DEV_EDIT_SEEN = 4      /* in the prompt or the output: the repetition penalty applies */
};

typedef struct pd_dev_sample_edit {
  int32_t id;     /* token id; unique within one row's edits */
  uint32_t flags; /* PD_DEV_EDIT_* */
  float bias;     /* with PD_DEV_EDIT_BIAS */
  int32_t count;  /* occurrences in the output: frequency and presence penalties when > 0 */
} pd_dev_sample_edit;

typedef struct pd_dev_sample_spec {
  int32_t row;          /* logits row to sample */
  int32_t top_k;        /* <= 0 or >= vocab: off */
  float temperature;    /* < 1e-5 (PD_SAMPLE_GREEDY_EPS): greedy */
  float top_p;          /* (0, 1]; 1 = off */
  float min_p;          /* [0, 1]; 0 = off */
  float rep_penalty;    /* 1 = off */
  float freq_penalty;   /* 0 = off */
  float pres_penalty;   /* 0 = off */
  double u;             /* the draw's uniform in [0, 1) (unused when greedy) */
  int32_t n_top;        /* -1: no logprobs; 0..20: logprob and rank of the token + n_top */
  int32_t edit_begin;   /* this row's edits: edits[edit_begin, edit_begin + edit_count) */
  int32_t edit_count;
} pd_dev_sample_spec;

typedef struct pd_dev_sample_out {
  int32_t token;   /* -1: the row had no finite logit after the edits, or a +inf */
  float logprob;   /* raw log-probability of token (when n_top >= 0) */
  int32_t rank;    /* 1 + tokens with a strictly larger raw logit; NaN counts as -inf */
  int32_t n_top;
  int32_t top_id[PD_DEV_SAMPLE_MAX_TOP];
  float top_logprob[PD_DEV_SAMPLE_MAX_TOP];
} pd_dev_sample_out;

/* ---- the layer ops ----
 * A decoder layer is four op calls: qkv_attention, linear (o, residual), linear (gate/up, GLU),
 * linear (down, residual); embed_norm starts the model and a linear (store) is its LM head. Each
 * op reads what the engine passes and writes what the engine passes: no op reads anything an
 * earlier op call left in the backend, and the engine owns every buffer that crosses op calls.
 *
 * Weights reach the ops as a weight descriptor. Today's formats are dense rows [N, K] in F32,
 * F16 or BF16; quantized formats add kernels (and fields here), not engine paths. */
typedef struct pd_wdesc {
  pd_dtype dtype;   /* of data */
  const void *data; /* [N, K] row-major */
  int N, K;
} pd_wdesc;

/* An activation handed from one op to the next as the next one's matmul operand, in a form the
 * backend chooses (the CUDA backend: 16-bit rows for its cuBLAS GEMMs, or f32 rows with the
 * RMSNorm's partial sums left for its decode GEMVs to finish; the CPU backend: f32 rows). The
 * engine allocates data (ops.act_bytes for the largest M and K) and passes the struct from the
 * op that writes it (out) to the op that reads it (in); the producer fills M, K, form and aux. */
typedef struct pd_act {
  void *data;
  int M, K;
  int form;   /* backend-defined, set by the producer */
  int aux;    /* backend-defined, set by the producer */
  float auxf; /* backend-defined, set by the producer */
} pd_act;

typedef enum {
  PD_LIN_STORE,    /* y = P */
  PD_LIN_RESIDUAL, /* y += P (y: the residual stream); then out = rmsnorm(y) * norm_w if norm_w */
  PD_LIN_GLU       /* out = silu(P[:, :N/2]) * P[:, N/2:]  [M, N/2] */
} pd_lin_epilogue;

/* P = in W^T + bias, in [M, K], W [N, K], bias [N] or NULL (f32). */
typedef struct pd_linear {
  const pd_act *in;
  pd_wdesc w;
  const float *bias;
  pd_lin_epilogue epilogue;
  float *y;             /* STORE: [M, N] out; RESIDUAL: [M, N] in and out */
  pd_act *out;          /* GLU, and RESIDUAL with norm_w: the next linear's operand */
  const float *norm_w;  /* RESIDUAL: [N], or NULL (no out) */
  float eps;
  pd_dtype out_wdtype;  /* the weight dtype of the linear that reads out */
  float *scratch;       /* [M, N] f32 the op may use */
} pd_linear;

/* Attention of a layer from its normed hidden rows: qkv = in Wqkv^T + bias (rows [q | k | v],
 * (n_q_heads + 2 n_kv_heads) * head_dim wide), RoPE on q and k (as `rope`), k and v written to
 * the cache at slots (as `kv_write`; a negative slot skips the row), then causal attention of the
 * rotated q over the cache (as `attention`), into out (the o projection's operand). */
typedef struct pd_qkv_attn {
  const pd_act *in;
  pd_wdesc w;
  const float *bias;      /* [(nq + 2 nkv) hd] or NULL */
  const int32_t *pos;     /* [M] */
  const float *inv_freq;  /* [head_dim / 2] */
  const pd_kv_layer *kv;
  const pd_kv_shape *shape;
  const int32_t *slots;   /* [M] */
  const pd_attn_batch *batch; /* its n_tokens is M */
  int n_q_heads;
  float scale;
  int window;             /* sliding window, 0 = none */
  pd_act *out;            /* [M, n_q_heads * head_dim] */
  pd_dtype out_wdtype;    /* the o projection's weight dtype */
  float *qkv;             /* [M, (nq + 2 nkv) hd] f32 scratch the op may use */
  float *q;               /* [M, nq hd] f32 scratch the op may use */
} pd_qkv_attn;

typedef struct pd_backend_ops {
  const char *name;

  /* ---- memory ---- */
  void *(*alloc)(pd_backend *be, size_t bytes);         /* NULL on failure; zeroed */
  void (*free)(pd_backend *be, void *p);
  void (*to_device)(pd_backend *be, void *dst, const void *host_src, size_t bytes);
  void (*to_host)(pd_backend *be, void *host_dst, const void *src, size_t bytes);
  void (*sync)(pd_backend *be);
  /* Optional (may be NULL): free and total bytes of the backend's memory (device backends). */
  void (*mem_info)(pd_backend *be, size_t *free_bytes, size_t *total_bytes);
  /* Optional (may be NULL): host_src (page-locked memory from host_alloc) to dst, queued after
   * the ops before it and returning at once: host_src must stay unchanged until the backend has
   * been synchronised. While capturing it is recorded, and each replay copies what host_src
   * holds when the replay runs. */
  void (*to_device_async)(pd_backend *be, void *dst, const void *host_src, size_t bytes);
  /* Optional (may be NULL): copy between two backend buffers. */
  void (*copy)(pd_backend *be, void *dst, const void *src, size_t bytes);

  /* ---- ops ---- */
  /* y[M,N] = x[M,K] · W[N,K]^T (+ bias[N] when bias != NULL). W in wdt; x, y, bias f32.
   * y must not alias x. */
  void (*matmul)(pd_backend *be, float *y, const float *x, const void *w, pd_dtype wdt,
                 const float *bias, int M, int N, int K);

  /* y[M,D] = x / sqrt(mean(x^2) + eps) * w[D]. y may alias x. */
  void (*rmsnorm)(pd_backend *be, float *y, const float *x, const float *w, float eps, int M,
                  int D);

  /* Fused residual: x[M,D] += r[M,D]; then y = rmsnorm(x). */
  void (*add_rmsnorm)(pd_backend *be, float *y, float *x, const float *r, const float *w,
                      float eps, int M, int D);

  /* y[M,D] = table[ids[i], :] (table [V,D] in dt), converted to f32. */
  void (*embed)(pd_backend *be, float *y, const void *table, pd_dtype dt, const int32_t *ids,
                int M, int D);

  /* Rotary embedding in place, the rotate-half (GPT-NeoX / HF Llama) layout: for each head,
   * pairs (i, i + head_dim/2), angle = pos * inv_freq[i], i < head_dim/2.
   * q [M, n_q_heads, head_dim], k [M, n_kv_heads, head_dim]; pos [M]; inv_freq [head_dim/2].
   * (RoPE scaling types differ only in inv_freq, which the engine computes once.) */
  void (*rope)(pd_backend *be, float *q, float *k, const int32_t *pos, const float *inv_freq,
               int M, int n_q_heads, int n_kv_heads, int head_dim);

  /* y[M,F] = silu(gu[M, 0:F]) * gu[M, F:2F]  (gate and up concatenated per row). */
  void (*swiglu)(pd_backend *be, float *y, const float *gu, int M, int F);

  /* Writes K and V rows into the cache: for i < M, k[i] ([n_kv_heads, head_dim]) goes to slot
   * slots[i]. A negative slot skips the row. */
  void (*kv_write)(pd_backend *be, const pd_kv_layer *kv, const pd_kv_shape *shape,
                   const float *k, const float *v, const int32_t *slots, int M);

  /* Causal attention over the paged cache.
   * q [n_tokens, n_q_heads, head_dim] -> out [n_tokens, n_q_heads, head_dim].
   * Query head h reads KV head h / (n_q_heads / n_kv_heads). scale multiplies q·k.
   * sliding_window > 0 limits each query to the last sliding_window keys (itself included). */
  void (*attention)(pd_backend *be, float *out, const float *q, const pd_kv_layer *kv,
                    const pd_kv_shape *shape, const pd_attn_batch *b, int n_q_heads, float scale,
                    int sliding_window);

  /* y[i,:] = x[idx[i],:] for i < n; rows of D floats. */
  void (*get_rows)(pd_backend *be, float *y, const float *x, const int32_t *idx, int n, int D);

  /* y[n] += x[n] */
  void (*add)(pd_backend *be, float *y, const float *x, size_t n);

  /* Optional (may be NULL): releases the backend. */
  void (*destroy)(pd_backend *be);

  /* ---- failure ---- */
  /* Optional (NULL: the backend cannot fail): the first failure the backend recorded, as
   * PD_EBACKEND with its message, or PD_OK. Sticky: a device fault (an illegal address, an ECC
   * error, a launch failure) leaves the backend unusable for good, and the process must let go
   * of it (a node leaves the cluster and exits). See pd_backend_status. */
  pd_status (*status)(pd_backend *be, pd_err *e);
  /* Optional: makes the backend fail as a device fault does, for tests of that handling (pd-decode
   * and pd-prefill --fail-device-after). CUDA: a kernel that traps, a sticky launch failure seen
   * at the next sync; CPU: a recorded failure. */
  void (*inject_fault)(pd_backend *be);
  /* Optional (NULL: nothing is recoverable): the recoverable failure since the last call, and
   * clears it: PD_ENOMEM when the device had no memory for an op's scratch (the CUDA backend
   * grows its scratch with the batch). The ops queued after such a failure, up to this call, do
   * nothing: a forward pass that saw one has no defined result, but the backend stays usable. */
  pd_status (*take_error)(pd_backend *be, pd_err *e);

  /* ---- optional extensions (NULL where a backend does not have them) ---- */

  /* Samples n rows of logits [rows, vocab] (backend memory) on the device. specs [n], edits
   * [n_edits] and out [n] are HOST memory; returns when out is filled. Every row's edits must
   * have unique ids in [0, vocab). */
  void (*sample)(pd_backend *be, pd_dev_sample_out *out, const float *logits, int vocab,
                 const pd_dev_sample_spec *specs, int n, const pd_dev_sample_edit *edits,
                 int n_edits);

  /* KV staging for transfers between nodes. Segment i lives at
   * (char *)base + ids[i] * stride + offset in backend memory and at host + i * seg_bytes;
   * ids are HOST memory. gather copies the n segments to the host and returns when they are
   * there; scatter copies them from the host and returns when the host buffer may be reused. */
  void (*kv_gather)(pd_backend *be, void *host, const void *base, const int32_t *ids, int n,
                    size_t stride, size_t offset, size_t seg_bytes);
  void (*kv_scatter)(pd_backend *be, void *base, const void *host, const int32_t *ids, int n,
                     size_t stride, size_t offset, size_t seg_bytes);
  /* Optional (may be NULL): many kv_gather / kv_scatter calls in one, so that a device pays its
   * fixed cost (id upload, launch, copy, sync) once per call instead of once per run (see
   * pd_kv_run). Run r's segment j lies at (char *)runs[r].base + ids[j] * stride + offset and
   * at host + runs[r].host_off + j * seg_bytes. The runs' host ranges must not overlap (they may
   * leave gaps: gather writes no byte outside the runs; scatter may read the bytes between the
   * lowest and the highest run, so host must be one buffer spanning them). Cache segments of
   * one scatter call must not overlap either. Completion as kv_gather / kv_scatter: gather
   * returns when every run's bytes are in host memory, scatter when host may be reused. */
  void (*kv_gather_runs)(pd_backend *be, void *host, const pd_kv_run *runs, int n_runs);
  void (*kv_scatter_runs)(pd_backend *be, const void *host, const pd_kv_run *runs, int n_runs);

  /* Page-locked host memory (faster, asynchronous copies); NULL on failure. */
  void *(*host_alloc)(pd_backend *be, size_t bytes);
  void (*host_free)(pd_backend *be, void *p);

  /* Graphs: the ops queued between capture_begin and capture_end (which must not include
   * to_host, sync, alloc or free) are recorded, not run; graph_launch replays them with the
   * same pointers and sizes (buffer contents may change between replays). capture_end returns
   * NULL when capture failed (the backend stays usable). */
  bool (*capture_begin)(pd_backend *be);
  void *(*capture_end)(pd_backend *be);
  bool (*graph_launch)(pd_backend *be, void *graph);
  void (*graph_free)(pd_backend *be, void *graph);

  /* Fused primitives (optional; NULL where a backend does not have them).
   * act[M,F] = silu(x W_g^T + b_g) * (x W_u^T + b_u) with w = [W_g; W_u] ([2F, K], wdt) and
   * bias = [b_g; b_u] or NULL; gu [M, 2F] is scratch the op may use. */
  void (*matmul_glu)(pd_backend *be, float *act, float *gu, const float *x, const void *w,
                     pd_dtype wdt, const float *bias, int M, int F, int K);
  /* qkv [M, (n_q_heads + 2 n_kv_heads) * head_dim] rows = [q | k | v]: RoPE on q and k (as
   * `rope`), q written to q_out [M, n_q_heads, head_dim], k and v written to the cache slots
   * (as `kv_write`; a negative slot skips the row). */
  void (*rope_kv_write)(pd_backend *be, float *q_out, const float *qkv, const int32_t *pos,
                        const float *inv_freq, const pd_kv_layer *kv, const pd_kv_shape *shape,
                        const int32_t *slots, int M, int n_q_heads);

  /* ---- the layer ops (see pd_linear); the engine calls only these for a forward pass, with
   * get_rows. A backend has all six or none: pd_backend_compose_layer_ops makes them from the
   * primitives above (acts of f32 rows) ---- */
  /* Bytes of a pd_act's data for M rows of K values, in any form. */
  size_t (*act_bytes)(pd_backend *be, int M, int K);
  /* x[M,D] = table[ids] (as embed), and out = rmsnorm(x) * norm_w, the first layer's operand. */
  void (*embed_norm)(pd_backend *be, float *x, pd_act *out, const void *table, pd_dtype dt,
                     const int32_t *ids, int M, int D, const float *norm_w, float eps,
                     pd_dtype out_wdtype);
  /* out = rmsnorm(x [M, D]) * norm_w as a linear's operand. */
  void (*norm)(pd_backend *be, pd_act *out, const float *x, const float *norm_w, float eps, int M,
               int D, pd_dtype out_wdtype);
  void (*linear)(pd_backend *be, const pd_linear *p);
  void (*qkv_attention)(pd_backend *be, const pd_qkv_attn *p);
  /* The values an act holds, as f32 rows [M, K] (for tests and debugging). */
  void (*act_read)(pd_backend *be, float *rows, const pd_act *a);
} pd_backend_ops;

struct pd_backend {
  pd_backend_ops ops;
  bool host_memory; /* backend memory is ordinary host memory: host pointers (e.g. mmapped
                       weights) may be passed to ops directly, without to_device copies */
  void *impl;       /* implementation state */
};

typedef struct pd_backend_opts {
  int n_threads; /* CPU: worker threads, 0 = all online cores */
  int device;    /* CUDA: device ordinal */
  bool profile;  /* CUDA: time every op and graph replay with GPU events; the table goes to stderr
                    when the backend is destroyed (--profile-gpu) */
  const char *cpu_isa; /* CPU: "avx512", "avx2" or "generic" caps the kernel family (--cpu-isa);
                          NULL or "": the best the CPU has */
  int cpu_spin_us;     /* CPU: microseconds a worker spins for work before it sleeps
                          (--cpu-spin-us); 0: the default, 300; negative: it sleeps at once */
} pd_backend_opts;

/* The CPU backend, always built. Picks SIMD kernels at run time by what the CPU supports
 * (AVX-512 / AVX2+FMA / portable C); o->cpu_isa caps the level. */
pd_backend *pd_backend_cpu_create(const pd_backend_opts *o, pd_err *e);
/* The backend a device name selects: NULL or "cpu" the CPU backend, "cuda" or "cuda:N" the
 * CUDA backend on device N (o->device is ignored then). PD_EINVAL names the accepted forms for
 * any other text; PD_EUNSUPPORTED when the build has no CUDA. o and is_gpu may be NULL. */
pd_backend *pd_backend_open(const char *device, const pd_backend_opts *o, bool *is_gpu, pd_err *e);
/* Sets the layer ops of a backend that has none (act_bytes, embed_norm, norm, linear,
 * qkv_attention, act_read) to compositions of its primitive ops (embed, rmsnorm, add_rmsnorm,
 * matmul, add, matmul_glu or swiglu, rope, kv_write, attention); their acts are f32 rows. */
void pd_backend_compose_layer_ops(pd_backend *be);
/* Which kernel family the CPU backend chose: "avx512", "avx2" or "generic". */
const char *pd_backend_cpu_isa(const pd_backend *be);
void pd_backend_destroy(pd_backend *be);
/* be->ops.status where the backend has it, else PD_OK. */
pd_status pd_backend_status(pd_backend *be, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif
