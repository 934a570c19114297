/* PD_CUDA_PROFILE=1: per-op GPU time of the CUDA backend, for finding where a step's time goes
 * on machines without a profiler. Every op of the table is wrapped: CUDA events are recorded
 * around it on the backend's stream (not during a graph capture, so run with --enforce-eager to
 * see the ops of decode steps), the elapsed times are collected at each sync and summed by op and
 * shape, and the table is printed to stderr when the backend is destroyed (the ops are restored
 * by then: nothing else of the backend changes). Graph replays are timed as one op each. The
 * events serialise nothing beyond what the stream already orders, but add a little host time
 * per op. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_state.h"

namespace {

constexpr int kMaxPending = 8192;
constexpr int kMaxKeys = 4096; /* prefill chunks of many shapes fill hundreds */

struct prof_key {
  char name[96];
  double ms;
  long long calls;
};

struct prof_state {
  pd_backend_ops orig;
  cudaEvent_t ev[2 * kMaxPending];
  int key_of[kMaxPending];
  int n_pending;
  prof_key keys[kMaxKeys];
  int n_keys;
};

prof_state *g_prof; /* one profiled backend per process (the first created) */
pd_backend *g_prof_be;

int key_index(const char *name) {
  for (int i = 0; i < g_prof->n_keys; i++)
    if (!strcmp(g_prof->keys[i].name, name)) return i;
  if (g_prof->n_keys == kMaxKeys) return kMaxKeys - 1; /* the last key collects the rest */
  prof_key *k = &g_prof->keys[g_prof->n_keys];
  snprintf(k->name, sizeof k->name, "%s", name);
  return g_prof->n_keys++;
}

void flush(cuda_impl *c) {
  for (int i = 0; i < g_prof->n_pending; i++) {
    if (g_prof->key_of[i] < 0) continue; /* an op still open across a flush */
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, g_prof->ev[2 * i], g_prof->ev[2 * i + 1]) == cudaSuccess) {
      prof_key *k = &g_prof->keys[g_prof->key_of[i]];
      k->ms += ms;
      k->calls++;
    } else {
      cudaGetLastError();
    }
  }
  g_prof->n_pending = 0;
  (void)c;
}

/* Returns the pending slot, or -1 when not recording. */
int begin(pd_backend *be) {
  cuda_impl *c = impl_of(be);
  if (be != g_prof_be || c->capturing) return -1;
  if (g_prof->n_pending == kMaxPending) {
    cudaStreamSynchronize(c->st);
    flush(c);
  }
  int i = g_prof->n_pending++; /* reserved now: ops may nest (matmul_glu calls matmul) */
  g_prof->key_of[i] = -1;
  cudaEventRecord(g_prof->ev[2 * i], c->st);
  return i;
}

void end(pd_backend *be, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void end(pd_backend *be, int i, const char *fmt, ...) {
  if (i < 0 || i >= g_prof->n_pending) return;
  cuda_impl *c = impl_of(be);
  cudaEventRecord(g_prof->ev[2 * i + 1], c->st);
  char name[96];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  g_prof->key_of[i] = key_index(name);
}

void p_sync(pd_backend *be) {
  g_prof->orig.sync(be);
  if (be == g_prof_be) flush(impl_of(be));
}

void p_matmul(pd_backend *be, float *y, const float *x, const void *w, pd_dtype wdt,
              const float *bias, int M, int N, int K) {
  int i = begin(be);
  g_prof->orig.matmul(be, y, x, w, wdt, bias, M, N, K);
  end(be, i, "matmul M=%d N=%d K=%d", M, N, K);
}
void p_rmsnorm(pd_backend *be, float *y, const float *x, const float *w, float eps, int M, int D) {
  int i = begin(be);
  g_prof->orig.rmsnorm(be, y, x, w, eps, M, D);
  end(be, i, "rmsnorm M=%d", M);
}
void p_add_rmsnorm(pd_backend *be, float *y, float *x, const float *r, const float *w, float eps,
                   int M, int D) {
  int i = begin(be);
  g_prof->orig.add_rmsnorm(be, y, x, r, w, eps, M, D);
  end(be, i, "add_rmsnorm M=%d", M);
}
void p_embed(pd_backend *be, float *y, const void *t, pd_dtype dt, const int32_t *ids, int M,
             int D) {
  int i = begin(be);
  g_prof->orig.embed(be, y, t, dt, ids, M, D);
  end(be, i, "embed M=%d", M);
}
void p_embed_fused(pd_backend *be, float *y, const void *t, pd_dtype dt, const int32_t *ids,
                   int M, int D, const float *g, float *xg) {
  int i = begin(be);
  g_prof->orig.embed_fused(be, y, t, dt, ids, M, D, g, xg);
  end(be, i, "embed (hand-off) M=%d", M);
}
void p_rope(pd_backend *be, float *q, float *k, const int32_t *pos, const float *inv, int M,
            int nq, int nkv, int hd) {
  int i = begin(be);
  g_prof->orig.rope(be, q, k, pos, inv, M, nq, nkv, hd);
  end(be, i, "rope M=%d", M);
}
void p_swiglu(pd_backend *be, float *y, const float *gu, int M, int F) {
  int i = begin(be);
  g_prof->orig.swiglu(be, y, gu, M, F);
  end(be, i, "swiglu M=%d", M);
}
void p_kv_write(pd_backend *be, const pd_kv_layer *kv, const pd_kv_shape *sh, const float *k,
                const float *v, const int32_t *slots, int M) {
  int i = begin(be);
  g_prof->orig.kv_write(be, kv, sh, k, v, slots, M);
  end(be, i, "kv_write M=%d", M);
}
void p_attention(pd_backend *be, float *out, const float *q, const pd_kv_layer *kv,
                 const pd_kv_shape *sh, const pd_attn_batch *b, int nq, float scale, int win) {
  int i = begin(be);
  g_prof->orig.attention(be, out, q, kv, sh, b, nq, scale, win);
  end(be, i, "attention %s seqs=%d tokens=%d", b->n_tokens == b->n_seqs ? "decode" : "prefill",
      b->n_seqs, b->n_tokens);
}
void p_get_rows(pd_backend *be, float *y, const float *x, const int32_t *idx, int n, int D) {
  int i = begin(be);
  g_prof->orig.get_rows(be, y, x, idx, n, D);
  end(be, i, "get_rows n=%d", n);
}
void p_add(pd_backend *be, float *y, const float *x, size_t n) {
  int i = begin(be);
  g_prof->orig.add(be, y, x, n);
  end(be, i, "add");
}
void p_matmul_glu(pd_backend *be, float *act, float *gu, const float *x, const void *w,
                  pd_dtype wdt, const float *bias, int M, int F, int K) {
  int i = begin(be);
  g_prof->orig.matmul_glu(be, act, gu, x, w, wdt, bias, M, F, K);
  end(be, i, "matmul_glu M=%d F=%d K=%d", M, F, K);
}
void p_rope_kv_write(pd_backend *be, float *q_out, const float *qkv, const int32_t *pos,
                     const float *inv, const pd_kv_layer *kv, const pd_kv_shape *sh,
                     const int32_t *slots, int M, int nq) {
  int i = begin(be);
  g_prof->orig.rope_kv_write(be, q_out, qkv, pos, inv, kv, sh, slots, M, nq);
  end(be, i, "rope_kv_write M=%d", M);
}
void p_matmul_fused(pd_backend *be, const pd_mm_fused *p) {
  static const char *const ep[] = {"", " +=", " glu", " rope_kv"};
  int i = begin(be);
  g_prof->orig.matmul_fused(be, p);
  end(be, i, "matmul%s%s M=%d N=%d K=%d", p->norm_w ? " norm" : "", ep[p->epilogue & 3], p->M,
      p->N, p->K);
}
void p_sample(pd_backend *be, pd_dev_sample_out *out, const float *logits, int vocab,
              const pd_dev_sample_spec *specs, int n, const pd_dev_sample_edit *edits,
              int n_edits) {
  int i = begin(be);
  g_prof->orig.sample(be, out, logits, vocab, specs, n, edits, n_edits);
  end(be, i, "sample n=%d (with its copies)", n);
}

/* A replay's GPU time, from its launch to its end on the stream: with the step's wall time
 * (pdctl bench-model's ms/step) it tells how much of a step is outside the graph (sampling,
 * copies, host work). */
bool p_graph_launch(pd_backend *be, void *graph) {
  int i = begin(be);
  const bool ok = g_prof->orig.graph_launch(be, graph);
  end(be, i, "graph replay");
  return ok;
}

int cmp_ms(const void *a, const void *b) {
  double x = static_cast<const prof_key *>(a)->ms, y = static_cast<const prof_key *>(b)->ms;
  return x < y ? 1 : x > y ? -1 : 0;
}

} // namespace

void pd_cuda_profile_report(pd_backend *be) {
  if (!g_prof || be != g_prof_be) return;
  cuda_impl *c = impl_of(be);
  cudaStreamSynchronize(c->st);
  flush(c);
  double total = 0;
  for (int i = 0; i < g_prof->n_keys; i++) total += g_prof->keys[i].ms;
  qsort(g_prof->keys, (size_t)g_prof->n_keys, sizeof g_prof->keys[0], cmp_ms);
  fprintf(stderr,
          "\nPD_CUDA_PROFILE: GPU time by op (eager ops and whole graph replays), %.1f ms in all\n",
          total);
  fprintf(stderr, "%-52s %10s %10s %10s %6s\n", "op", "calls", "total ms", "us/call", "%");
  for (int i = 0; i < g_prof->n_keys; i++) {
    const prof_key *k = &g_prof->keys[i];
    if (k->ms < total * 0.002) continue;
    fprintf(stderr, "%-52s %10lld %10.2f %10.2f %6.1f\n", k->name, k->calls, k->ms,
            1e3 * k->ms / (double)(k->calls ? k->calls : 1), 100.0 * k->ms / total);
  }
  for (int i = 0; i < 2 * kMaxPending; i++) cudaEventDestroy(g_prof->ev[i]);
  free(g_prof);
  g_prof = NULL;
  g_prof_be = NULL;
}

void pd_cuda_profile_wrap(pd_backend *be) {
  const char *ev = getenv("PD_CUDA_PROFILE");
  if (!ev || !*ev || !strcmp(ev, "0") || g_prof) return;
  prof_state *p = static_cast<prof_state *>(calloc(1, sizeof *p));
  if (!p) return;
  for (int i = 0; i < 2 * kMaxPending; i++)
    if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
      cudaGetLastError();
      for (int j = 0; j < i; j++) cudaEventDestroy(p->ev[j]);
      free(p);
      return;
    }
  p->orig = be->ops;
  g_prof = p;
  g_prof_be = be;
  be->ops.sync = p_sync;
  be->ops.matmul = p_matmul;
  be->ops.rmsnorm = p_rmsnorm;
  be->ops.add_rmsnorm = p_add_rmsnorm;
  be->ops.embed = p_embed;
  be->ops.rope = p_rope;
  be->ops.swiglu = p_swiglu;
  be->ops.kv_write = p_kv_write;
  be->ops.attention = p_attention;
  be->ops.get_rows = p_get_rows;
  be->ops.add = p_add;
  if (be->ops.matmul_glu) be->ops.matmul_glu = p_matmul_glu;
  if (be->ops.rope_kv_write) be->ops.rope_kv_write = p_rope_kv_write;
  if (be->ops.sample) be->ops.sample = p_sample;
  if (be->ops.matmul_fused) be->ops.matmul_fused = p_matmul_fused;
  if (be->ops.embed_fused) be->ops.embed_fused = p_embed_fused;
  if (be->ops.graph_launch) be->ops.graph_launch = p_graph_launch;
}
