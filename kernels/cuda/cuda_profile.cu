/* --profile-gpu (pd_backend_opts.profile): per-op GPU time of the CUDA backend, for finding where a step's time goes
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
#include <time.h>

#include "cuda_state.h"

namespace {

constexpr int kMaxPending = 8192;
constexpr int kMaxKeys = 4096; /* prefill chunks of many shapes fill hundreds */

struct prof_key {
  char name[96];
  double ms;
  long long calls;
};

/* Graph replays on the GPU's own clock (%globaltimer, ns): a stamp before each launch (outside
 * the graph), the recorded graph's first and last nodes (stamps captured with it), and one after
 * the sampling that follows; read at the next sync. Per graph: the launch's latency (stamp 0 to
 * the first node), the replay's span, from its end to the sampling's end, and the host's part
 * (the previous replay's sampling end to this launch's stamp). */
enum { kStampLaunch, kStampFirst, kStampLast, kStampSample, kStamps };
constexpr int kMaxGraphs = 128;
struct graph_times {
  long long n;
  double launch_us, span_us, tail_us, host_us;
  long long n_tail, n_host; /* replays followed by a sampling / following one directly */
};

__global__ void stamp_kernel(unsigned long long *p) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *p = t;
}

struct prof_state {
  pd_backend_ops orig;
  unsigned long long *d_stamps; /* [kStamps] on the device; NULL: no graph timing */
  int replay_graph;             /* the graph launched since the last sync, or -1 */
  bool sampled;                 /* its sampling stamped */
  unsigned long long prev_sample; /* the last replay's sampling end (0: none) */
  long long ops_since_sample;     /* ops timed since then (any: no host gap to measure) */
  /* the first and the latest stamp read, on the GPU's clock and the host's (a check that the
   * two clocks agree) */
  unsigned long long gpu0, gpu1;
  double host0, host1;
  graph_times gt[kMaxGraphs];
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
  g_prof->ops_since_sample++;
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

void stamp(pd_backend *be, int slot) {
  if (!g_prof->d_stamps) return;
  stamp_kernel<<<1, 1, 0, impl_of(be)->st>>>(g_prof->d_stamps + slot);
}

/* the stamps of the replay since the last sync, if any (after the sync) */
void read_stamps() {
  const int g = g_prof->replay_graph;
  g_prof->replay_graph = -1;
  if (g < 0 || !g_prof->d_stamps) return;
  unsigned long long t[kStamps];
  if (cudaMemcpy(t, g_prof->d_stamps, sizeof t, cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const double now = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
  if (!g_prof->gpu0) {
    g_prof->gpu0 = t[kStampLast];
    g_prof->host0 = now;
  }
  g_prof->gpu1 = t[kStampLast];
  g_prof->host1 = now;
  graph_times *x = &g_prof->gt[g];
  x->n++;
  x->launch_us += (double)(t[kStampFirst] - t[kStampLaunch]) * 1e-3;
  x->span_us += (double)(t[kStampLast] - t[kStampFirst]) * 1e-3;
  if (g_prof->sampled) {
    x->tail_us += (double)(t[kStampSample] - t[kStampLast]) * 1e-3;
    x->n_tail++;
  }
  if (g_prof->prev_sample && t[kStampLaunch] > g_prof->prev_sample) {
    x->host_us += (double)(t[kStampLaunch] - g_prof->prev_sample) * 1e-3;
    x->n_host++;
  }
  g_prof->prev_sample = g_prof->sampled ? t[kStampSample] : 0;
  g_prof->sampled = false;
}

void p_sync(pd_backend *be) {
  g_prof->orig.sync(be);
  if (be == g_prof_be) {
    flush(impl_of(be));
    read_stamps();
  }
}

bool p_capture_begin(pd_backend *be) {
  const bool ok = g_prof->orig.capture_begin(be);
  if (ok && be == g_prof_be) stamp(be, kStampFirst);
  return ok;
}
void *p_capture_end(pd_backend *be) {
  if (be == g_prof_be && impl_of(be)->capturing) stamp(be, kStampLast);
  return g_prof->orig.capture_end(be);
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
  if (be == g_prof_be && g_prof->replay_graph >= 0) {
    stamp(be, kStampSample);
    g_prof->sampled = true;
    g_prof->ops_since_sample = 0;
  }
}

/* A replay's GPU time, from its launch to its end on the stream: with the step's wall time
 * (pdctl bench-model's ms/step) it tells how much of a step is outside the graph (sampling,
 * copies, host work). */
bool p_graph_launch(pd_backend *be, void *graph) {
  /* each recorded graph (a batch size and table width) apart, numbered by first replay (a
   * graph freed and another recorded at its address would share its number; past kMaxGraphs
   * graphs, the rest share one number and get no GPU-clock stamps) */
  static void *seen[kMaxGraphs];
  static int n_seen;
  int g = 0;
  while (g < n_seen && seen[g] != graph) g++;
  if (g == n_seen && n_seen < kMaxGraphs) seen[n_seen++] = graph;
  if (be == g_prof_be) {
    if (g_prof->ops_since_sample > 0) g_prof->prev_sample = 0; /* other work came between */
    stamp(be, kStampLaunch);
  }
  int i = begin(be);
  const bool ok = g_prof->orig.graph_launch(be, graph);
  end(be, i, "graph replay (graph %d)", g);
  if (be == g_prof_be && g < kMaxGraphs) g_prof->replay_graph = g;
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
          "\nprofile-gpu: GPU time by op (eager ops and whole graph replays), %.1f ms in all\n",
          total);
  fprintf(stderr, "%-52s %10s %10s %10s %6s\n", "op", "calls", "total ms", "us/call", "%");
  for (int i = 0; i < g_prof->n_keys; i++) {
    const prof_key *k = &g_prof->keys[i];
    if (k->ms < total * 0.002) continue;
    fprintf(stderr, "%-52s %10lld %10.2f %10.2f %6.1f\n", k->name, k->calls, k->ms,
            1e3 * k->ms / (double)(k->calls ? k->calls : 1), 100.0 * k->ms / total);
  }
  bool head = false;
  for (int g = 0; g < kMaxGraphs; g++) {
    const graph_times *x = &g_prof->gt[g];
    if (x->n < 5) continue;
    if (!head)
      fprintf(stderr, "\nprofile-gpu: graph replays on the GPU's clock (us, means): launch = "
                      "from a stamp just before cudaGraphLaunch to the graph's first node; span = "
                      "first to last node; tail = to the sampling's end; host = from the previous "
                      "replay's sampling end to this launch's stamp, over the replays that followed "
                      "one directly\n%-10s %8s %10s %10s %10s %10s %8s\n",
              "graph", "replays", "launch", "span", "tail", "host", "of");
    head = true;
    fprintf(stderr, "graph %-4d %8lld %10.1f %10.1f %10.1f %10.1f %8lld\n", g, x->n,
            x->launch_us / (double)x->n, x->span_us / (double)x->n,
            x->n_tail ? x->tail_us / (double)x->n_tail : 0.0,
            x->n_host ? x->host_us / (double)x->n_host : 0.0, x->n_host);
  }
  if (head && g_prof->host1 > g_prof->host0 + 1.0)
    fprintf(stderr, "(the GPU's clock against the host's over %.1f s of replays: x %.4f)\n",
            g_prof->host1 - g_prof->host0,
            (double)(g_prof->gpu1 - g_prof->gpu0) * 1e-9 / (g_prof->host1 - g_prof->host0));
  for (int i = 0; i < 2 * kMaxPending; i++) cudaEventDestroy(g_prof->ev[i]);
  if (g_prof->d_stamps) cudaFree(g_prof->d_stamps);
  free(g_prof);
  g_prof = NULL;
  g_prof_be = NULL;
}

void pd_cuda_profile_wrap(pd_backend *be) {
  if (g_prof) return;
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
  p->replay_graph = -1;
  if (cudaMalloc(&p->d_stamps, kStamps * sizeof(unsigned long long)) != cudaSuccess) {
    cudaGetLastError();
    p->d_stamps = NULL;
  }
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
  if (be->ops.capture_begin) be->ops.capture_begin = p_capture_begin;
  if (be->ops.capture_end) be->ops.capture_end = p_capture_end;
}
