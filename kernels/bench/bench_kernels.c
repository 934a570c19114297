/* pd-bench-kernels: speed of the CPU backend's kernels.
 *
 *   pd-bench-kernels [-t THREADS] [-q] [-c] [-s SECTION]
 *
 * Prints: the float32 FMA peak of this machine (a pure register FMA loop, 1 thread and all),
 * the thread pool's per-op dispatch overhead, matmul GFLOP/s for the decode (M = 1) and prefill
 * (M = 512) shapes of the bundled pycoder-12m model (bf16 weights), a sweep of M for the GEMV/GEMM
 * crossover, attention times, and a whole decode step / prefill chunk of that model built from
 * backend ops (what the engine's forward pass costs in kernels alone). -i ISA caps the kernel
 * family as --cpu-isa does. Each figure is the best of several timed batches (the machine may be
 * shared). -q runs shorter batches; -s runs one section (peak, pool, matmul, sweep, attn, model);
 * "batch" covers batched decode (M = 17..256 sequences, 1 token each) for matmul and attention;
 * -c times with the process CPU clock instead of the wall clock, which makes -t 1 figures
 * repeatable on a machine other processes are using (meaningless with more threads). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../cpu/cpu_internal.h"
#include "pd/backend.h"
#include "pd/dtype.h"

#if PD_CPU_X86
#include <immintrin.h>
#endif

static double g_batch_s = 0.05; /* seconds per timed batch */
static const char *g_only = NULL;  /* run one section only */

static int want(const char *section) { return !g_only || strcmp(g_only, section) == 0; }

static int g_cpu_clock = 0; /* -c: time with the process CPU clock (single thread on a busy box) */

static double now(void) {
  struct timespec ts;
  clock_gettime(g_cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef void (*bench_fn)(void *ctx);

/* Best seconds per call over 15 batches of about g_batch_s / 5 each: short batches so that some
 * of them run while other processes sleep. */
static double time_it(bench_fn fn, void *ctx) {
  fn(ctx); /* warm up (also grows scratch, fills caches) */
  double t0 = now();
  int reps = 0;
  do {
    fn(ctx);
    reps++;
  } while (now() - t0 < g_batch_s / 5);
  double per = (now() - t0) / reps;
  int n = (int)(g_batch_s / 5 / per) + 1;
  double best = 1e30;
  for (int b = 0; b < 15; b++) {
    double t = now();
    for (int i = 0; i < n; i++) fn(ctx);
    t = (now() - t) / n;
    if (t < best) best = t;
  }
  return best;
}

/* ---- FMA peak ------------------------------------------------------------------------------- */

#define PEAK_ITERS 20000000L

#if PD_CPU_X86
__attribute__((target("avx512f,fma"))) static float peak_avx512(void) {
  __m512 a[12], b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(0.1f * (float)(i + 1));
  for (long it = 0; it < PEAK_ITERS; it++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx2,fma"))) static float peak_avx2(void) {
  __m256 a[12], b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
  for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(0.1f * (float)(i + 1));
  for (long it = 0; it < PEAK_ITERS; it++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
  float o[8];
  _mm256_storeu_ps(o, s);
  return o[0] + o[7];
}
#endif

typedef struct peak_arg {
  int width; /* floats per FMA */
  float out;
} peak_arg;

static void *peak_thread(void *p) {
  peak_arg *a = p;
#if PD_CPU_X86
  a->out = a->width == 16 ? peak_avx512() : peak_avx2();
#else
  a->out = 0;
#endif
  return NULL;
}

/* GFLOP/s of n threads each running the FMA loop of the given width. */
static double peak_gflops(int n, int width) {
  pthread_t th[64];
  peak_arg args[64];
  if (n > 64) n = 64;
  double t = now();
  for (int i = 0; i < n; i++) {
    args[i].width = width;
    pthread_create(&th[i], NULL, peak_thread, &args[i]);
  }
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  t = now() - t;
  return (double)n * PEAK_ITERS * 12 * width * 2 / t / 1e9;
}

/* ---- pool dispatch --------------------------------------------------------------------------- */

static void empty_task(void *ctx, int task, int thread) {
  (void)ctx, (void)task, (void)thread;
}

/* One task per thread that waits until every task has started: each job is a full fork/join
 * across all threads, so its time is the pool's round-trip latency. */
typedef struct rendezvous {
  _Atomic int arrived;
  int target;
} rendezvous;
static void rendezvous_task(void *ctx, int task, int thread) {
  (void)task, (void)thread;
  rendezvous *r = ctx;
  atomic_fetch_add(&r->arrived, 1);
  while (atomic_load(&r->arrived) < r->target) {
  }
}

typedef struct pool_arg {
  pd_pool *pool;
  int n_tasks;
  rendezvous rv;
} pool_arg;
static void pool_once(void *p) {
  pool_arg *a = p;
  pd_pool_run(a->pool, empty_task, NULL, a->n_tasks);
}
static void pool_rendezvous(void *p) {
  pool_arg *a = p;
  a->rv.target += a->n_tasks;
  pd_pool_run(a->pool, rendezvous_task, &a->rv, a->n_tasks);
}

/* ---- matmul ---------------------------------------------------------------------------------- */

typedef struct mm_arg {
  pd_backend *be;
  float *y, *x;
  void *w;
  int M, N, K;
  int n_w, cur; /* cold W: n_w copies of W back to back, used in turn */
} mm_arg;

static void mm_once(void *p) {
  mm_arg *a = p;
  const uint16_t *w = (const uint16_t *)a->w + (size_t)a->cur * a->N * a->K;
  if (++a->cur == a->n_w) a->cur = 0;
  a->be->ops.matmul(a->be, a->y, a->x, w, PD_DTYPE_BF16, NULL, a->M, a->N, a->K);
}

static void *rand_bf16(size_t n) {
  uint16_t *w = malloc(n * 2);
  if (!w) return NULL;
  uint32_t s = 12345;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    w[i] = pd_f32_to_bf16(((float)(s >> 8) / 16777216.0f - 0.5f) * 0.1f);
  }
  return w;
}

static float *rand_f32(size_t n, float ampl) {
  float *x = malloc(n * 4 + 4);
  if (!x) return NULL;
  uint32_t s = 777;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    x[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 2 * ampl;
  }
  return x;
}

/* Seconds per matmul. cold: W cycles through copies filling 96 MiB, so it comes from DRAM as in a
 * whole decode step (whose weights and KV cache together overflow the L3); else W stays cached. */
static double bench_matmul_w(pd_backend *be, int M, int N, int K, double *gbs, int cold) {
  mm_arg a = {.be = be, .M = M, .N = N, .K = K, .n_w = 1};
  if (cold) a.n_w = (int)(((size_t)96 << 20) / ((size_t)N * K * 2)) + 1;
  a.w = rand_bf16((size_t)a.n_w * N * K);
  a.x = rand_f32((size_t)M * K, 1);
  a.y = malloc((size_t)M * N * 4);
  if (!a.w || !a.x || !a.y) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  double t = time_it(mm_once, &a);
  if (gbs) *gbs = (double)N * K * 2 / t / 1e9;
  free(a.w), free(a.x), free(a.y);
  return t;
}

static double bench_matmul(pd_backend *be, int M, int N, int K, double *gbs) {
  return bench_matmul_w(be, M, N, K, gbs, 0);
}

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct at_arg {
  pd_backend *be;
  float *out, *q;
  pd_kv_layer kv;
  pd_kv_shape shape;
  pd_attn_batch b;
  int nqh;
} at_arg;

static void at_once(void *p) {
  at_arg *a = p;
  a->be->ops.attention(a->be, a->out, a->q, &a->kv, &a->shape, &a->b, a->nqh,
                       1.0f / sqrtf((float)a->shape.head_dim), 0);
}

/* n_seqs sequences, each with n_new new tokens at the end of ctx cached tokens; model shape. */
static void bench_attention(pd_backend *be, const char *what, int n_seqs, int n_new, int ctx) {
  const int bs = 16, nkv = 2, nqh = 6, hd = 64;
  int bps = (ctx + bs - 1) / bs;
  at_arg a = {.be = be, .nqh = nqh};
  a.shape = (pd_kv_shape){.num_blocks = n_seqs * bps, .block_size = bs, .num_kv_heads = nkv,
                          .head_dim = hd, .dtype = PD_DTYPE_F32};
  size_t cache = (size_t)a.shape.num_blocks * nkv * bs * hd;
  a.kv.k = rand_f32(cache, 1);
  a.kv.v = rand_f32(cache, 1);
  int32_t *qs = malloc((size_t)(n_seqs + 1) * 4), *cl = malloc((size_t)n_seqs * 4);
  int32_t *bt = malloc((size_t)n_seqs * bps * 4);
  for (int s = 0; s <= n_seqs; s++) qs[s] = s * n_new;
  for (int s = 0; s < n_seqs; s++) cl[s] = ctx;
  for (int i = 0; i < n_seqs * bps; i++) bt[i] = (i * 7919) % (n_seqs * bps); /* scattered */
  a.b = (pd_attn_batch){.n_seqs = n_seqs, .n_tokens = n_seqs * n_new, .q_start = qs,
                        .ctx_len = cl, .block_tables = bt, .max_blocks = bps, .max_ctx_len = ctx};
  a.q = rand_f32((size_t)n_seqs * n_new * nqh * hd, 1);
  a.out = malloc((size_t)n_seqs * n_new * nqh * hd * 4);
  double t = time_it(at_once, &a);
  double keys = 0; /* query-key pairs */
  for (int i = 0; i < n_new; i++) keys += ctx - n_new + i + 1;
  double flops = 4.0 * hd * keys * nqh * n_seqs;
  printf("  %-44s %9.1f us  %6.1f GFLOP/s\n", what, t * 1e6, flops / t / 1e9);
  free(a.kv.k), free(a.kv.v), free(qs), free(cl), free(bt), free(a.q), free(a.out);
}

/* ---- a whole model step ---------------------------------------------------------------------- */

/* pycoder-12m: 6 layers, hidden 384, 6 heads / 2 KV heads of 64, ffn 1024, vocab 4096. */
enum { ML = 6, MH = 384, MQ = 6, MKV = 2, MD = 64, MF = 1024, MV = 4096 };

typedef struct model {
  pd_backend *be;
  void *wq[ML], *wk[ML], *wv[ML], *wo[ML], *wgu[ML], *wd[ML], *lm, *emb;
  float *n1[ML], *n2[ML], *nf, inv[MD / 2];
  pd_kv_layer kv[ML];
  pd_kv_shape shape;
  /* activations for up to maxM tokens */
  float *x, *h, *q, *k, *v, *att, *o, *gu, *act, *logits;
  int32_t *ids, *pos, *slots, qs[2], cl[1], *bt;
  int maxM, ctx0, M, max_blocks;
} model;

static void model_init(model *m, pd_backend *be, int maxM, int max_ctx) {
  memset(m, 0, sizeof *m);
  m->be = be;
  m->maxM = maxM;
  for (int l = 0; l < ML; l++) {
    m->wq[l] = rand_bf16((size_t)MQ * MD * MH);
    m->wk[l] = rand_bf16((size_t)MKV * MD * MH);
    m->wv[l] = rand_bf16((size_t)MKV * MD * MH);
    m->wo[l] = rand_bf16((size_t)MH * MQ * MD);
    m->wgu[l] = rand_bf16((size_t)2 * MF * MH);
    m->wd[l] = rand_bf16((size_t)MH * MF);
    m->n1[l] = rand_f32(MH, 1);
    m->n2[l] = rand_f32(MH, 1);
  }
  m->lm = rand_bf16((size_t)MV * MH);
  m->emb = rand_bf16((size_t)MV * MH);
  m->nf = rand_f32(MH, 1);
  for (int i = 0; i < MD / 2; i++) m->inv[i] = powf(10000.0f, -2.0f * i / MD);
  int bs = 16;
  m->max_blocks = (max_ctx + bs - 1) / bs;
  m->shape = (pd_kv_shape){.num_blocks = m->max_blocks, .block_size = bs, .num_kv_heads = MKV,
                           .head_dim = MD, .dtype = PD_DTYPE_F32};
  for (int l = 0; l < ML; l++) {
    size_t n = (size_t)m->max_blocks * bs * MKV * MD * 4;
    m->kv[l].k = be->ops.alloc(be, n);
    m->kv[l].v = be->ops.alloc(be, n);
  }
  m->bt = malloc((size_t)m->max_blocks * 4);
  for (int i = 0; i < m->max_blocks; i++) m->bt[i] = i;
  size_t M = (size_t)maxM;
  m->x = malloc(M * MH * 4), m->h = malloc(M * MH * 4), m->q = malloc(M * MQ * MD * 4);
  m->k = malloc(M * MKV * MD * 4), m->v = malloc(M * MKV * MD * 4), m->att = malloc(M * MQ * MD * 4);
  m->o = malloc(M * MH * 4), m->gu = malloc(M * 2 * MF * 4), m->act = malloc(M * MF * 4);
  m->logits = malloc(MV * 4);
  m->ids = malloc(M * 4), m->pos = malloc(M * 4), m->slots = malloc(M * 4);
  for (int i = 0; i < maxM; i++) m->ids[i] = (i * 31) % MV;
}

static void model_free(model *m) {
  for (int l = 0; l < ML; l++) {
    free(m->wq[l]), free(m->wk[l]), free(m->wv[l]), free(m->wo[l]), free(m->wgu[l]), free(m->wd[l]);
    free(m->n1[l]), free(m->n2[l]);
    m->be->ops.free(m->be, m->kv[l].k);
    m->be->ops.free(m->be, m->kv[l].v);
  }
  free(m->lm), free(m->emb), free(m->nf), free(m->bt);
  free(m->x), free(m->h), free(m->q), free(m->k), free(m->v), free(m->att), free(m->o);
  free(m->gu), free(m->act), free(m->logits), free(m->ids), free(m->pos), free(m->slots);
}

/* One forward step of M new tokens at positions ctx0 .. ctx0 + M - 1 of one sequence, logits for
 * the last token only (what prefill and decode both need). */
static void model_step(void *p) {
  model *m = p;
  pd_backend *be = m->be;
  const int M = m->M;
  for (int i = 0; i < M; i++) {
    m->pos[i] = m->ctx0 + i;
    m->slots[i] = m->ctx0 + i;
  }
  m->qs[0] = 0, m->qs[1] = M, m->cl[0] = m->ctx0 + M;
  pd_attn_batch b = {.n_seqs = 1, .n_tokens = M, .q_start = m->qs, .ctx_len = m->cl,
                     .block_tables = m->bt, .max_blocks = m->max_blocks, .max_ctx_len = m->cl[0]};
  be->ops.embed(be, m->x, m->emb, PD_DTYPE_BF16, m->ids, M, MH);
  be->ops.rmsnorm(be, m->h, m->x, m->n1[0], 1e-5f, M, MH);
  for (int l = 0; l < ML; l++) {
    be->ops.matmul(be, m->q, m->h, m->wq[l], PD_DTYPE_BF16, NULL, M, MQ * MD, MH);
    be->ops.matmul(be, m->k, m->h, m->wk[l], PD_DTYPE_BF16, NULL, M, MKV * MD, MH);
    be->ops.matmul(be, m->v, m->h, m->wv[l], PD_DTYPE_BF16, NULL, M, MKV * MD, MH);
    be->ops.rope(be, m->q, m->k, m->pos, m->inv, M, MQ, MKV, MD);
    be->ops.kv_write(be, &m->kv[l], &m->shape, m->k, m->v, m->slots, M);
    be->ops.attention(be, m->att, m->q, &m->kv[l], &m->shape, &b, MQ, 0.125f, 0);
    be->ops.matmul(be, m->o, m->att, m->wo[l], PD_DTYPE_BF16, NULL, M, MH, MQ * MD);
    be->ops.add_rmsnorm(be, m->h, m->x, m->o, m->n2[l], 1e-5f, M, MH);
    be->ops.matmul(be, m->gu, m->h, m->wgu[l], PD_DTYPE_BF16, NULL, M, 2 * MF, MH);
    be->ops.swiglu(be, m->act, m->gu, M, MF);
    be->ops.matmul(be, m->o, m->act, m->wd[l], PD_DTYPE_BF16, NULL, M, MH, MF);
    be->ops.add_rmsnorm(be, m->h, m->x, m->o, l + 1 < ML ? m->n1[l + 1] : m->nf, 1e-5f, M, MH);
  }
  be->ops.matmul(be, m->logits, m->h + (size_t)(M - 1) * MH, m->lm, PD_DTYPE_BF16, NULL, 1, MV, MH);
}

/* ---- sections -------------------------------------------------------------------------------- */

/* Returns the all-thread FMA peak in GFLOP/s (0 when not measured). */
static double section_peak(pd_backend *be, int nt) {
#if PD_CPU_X86
  if (strcmp(pd_backend_cpu_isa(be), "generic") == 0) return 0;
  int width = strcmp(pd_backend_cpu_isa(be), "avx512") == 0 ? 16 : 8;
  double p1 = peak_gflops(1, width), pn = peak_gflops(nt, width);
  printf("FMA peak (f32, %d-wide, registers only): %.1f GFLOP/s on 1 thread, %.1f on %d\n\n", width,
         p1, pn, nt);
  return pn;
#else
  (void)be, (void)nt;
  return 0;
#endif
}

static void section_pool(pd_pool *pool, int nt) {
  pool_arg pa = {.pool = pool, .n_tasks = 8 * nt};
  double t_empty = time_it(pool_once, &pa);
  pa.n_tasks = nt;
  atomic_init(&pa.rv.arrived, 0);
  pa.rv.target = 0;
  double t_join = time_it(pool_rendezvous, &pa);
  printf("thread pool: fork/join of all %d threads %.2f us; empty job of %d tasks %.2f us\n\n", nt,
         t_join * 1e6, 8 * nt, t_empty * 1e6);
}

static void section_matmul(pd_backend *be, double peak) {
  static const int shapes[][2] = {{384, 384},  {128, 384},  {1024, 384},
                                  {2048, 384}, {384, 1024}, {4096, 384}};
  printf("matmul, bf16 W [N,K], f32 x [M,K]        time      GFLOP/s   %%peak   W GB/s\n");
  for (int mi = 0; mi < 2; mi++) {
    int M = mi == 0 ? 1 : 512;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
      int N = shapes[s][0], K = shapes[s][1];
      double gbs;
      double t = bench_matmul(be, M, N, K, &gbs);
      double gf = 2.0 * M * N * K / t / 1e9;
      printf("  M=%-4d N=%-5d K=%-5d               %9.1f us %8.1f %7.0f%% %8.1f\n", M, N, K,
             t * 1e6, gf, peak > 0 ? 100 * gf / peak : 0, gbs);
    }
  }
}

/* Batched decode: M = number of sequences, the projection shapes of pycoder-12m. */
static void section_batch(pd_backend *be, double peak) {
  static const int shapes[][2] = {{128, 384}, {384, 384}, {2048, 384}, {384, 1024}, {4096, 384}};
  static const int Ms[] = {17, 32, 64, 128, 256};
  printf("\nbatched decode matmul, bf16 W [N,K]          time      GFLOP/s   %%peak\n");
  for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
      int M = Ms[mi], N = shapes[s][0], K = shapes[s][1];
      double t = bench_matmul(be, M, N, K, NULL);
      double gf = 2.0 * M * N * K / t / 1e9;
      printf("  M=%-4d N=%-5d K=%-5d               %9.1f us %8.1f %7.0f%%\n", M, N, K, t * 1e6, gf,
             peak > 0 ? 100 * gf / peak : 0);
    }
  }
  printf("\nsame, W cold (from DRAM, as in a whole decode step)\n");
  for (size_t mi = 0; mi < 2; mi++) {
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
      int M = mi == 0 ? 32 : 128, N = shapes[s][0], K = shapes[s][1];
      double t = bench_matmul_w(be, M, N, K, NULL, 1);
      double gf = 2.0 * M * N * K / t / 1e9;
      printf("  M=%-4d N=%-5d K=%-5d               %9.1f us %8.1f %7.0f%%\n", M, N, K, t * 1e6, gf,
             peak > 0 ? 100 * gf / peak : 0);
    }
  }
  printf("\nbatched decode attention (1 new token per sequence)\n");
  bench_attention(be, "decode, 32 seqs, ctx 200", 32, 1, 200);
  bench_attention(be, "decode, 128 seqs, ctx 200", 128, 1, 200);
}

static void section_sweep(pd_backend *be) {
  static const int Ms[] = {1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128};
  printf("\nmatmul M sweep, N=1024 K=384 (GEMV up to M=%d, GEMM above)\n",
         pd_backend_cpu_kern(be)->gemv_max_m);
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    double t = bench_matmul(be, Ms[i], 1024, 384, NULL);
    printf("  M=%-4d %9.1f us  %7.1f GFLOP/s  %7.2f us/row\n", Ms[i], t * 1e6,
           2.0 * Ms[i] * 1024 * 384 / t / 1e9, t * 1e6 / Ms[i]);
  }
}

static void section_attn(pd_backend *be) {
  printf("\nattention (6 q heads / 2 KV heads of 64, f32 KV, blocks of 16)\n");
  bench_attention(be, "decode, 1 seq, ctx 512", 1, 1, 512);
  bench_attention(be, "decode, 1 seq, ctx 2048", 1, 1, 2048);
  bench_attention(be, "decode, 16 seqs, ctx 256", 16, 1, 256);
  bench_attention(be, "prefill, 512 tokens", 1, 512, 512);
  bench_attention(be, "prefill, 1024 tokens", 1, 1024, 1024);
  bench_attention(be, "chunked prefill, 256 new after 768 cached", 1, 256, 1024);
}

static void section_model(pd_backend *be) {
  printf("\nwhole model step from backend ops (pycoder-12m shapes, bf16 weights, 22 MB)\n");
  model m;
  model_init(&m, be, 512, 2048);
  m.M = 512, m.ctx0 = 0;
  double tp = time_it(model_step, &m);
  printf("  prefill 512 tokens:           %8.2f ms  -> %7.0f tokens/s\n", tp * 1e3, 512 / tp);
  static const int ctxs[] = {16, 256, 1024};
  for (int i = 0; i < 3; i++) {
    m.M = 1, m.ctx0 = ctxs[i];
    double t = time_it(model_step, &m);
    printf("  decode 1 token at ctx %-5d   %8.1f us  -> %7.0f tokens/s\n", ctxs[i], t * 1e6, 1 / t);
  }
  model_free(&m);
}

int main(int argc, char **argv) {
  int threads = 0;
  const char *isa = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "-t") == 0 && i + 1 < argc)
      threads = atoi(argv[++i]);
    else if (strcmp(argv[i], "-i") == 0 && i + 1 < argc)
      isa = argv[++i];
    else if (strcmp(argv[i], "-q") == 0)
      g_batch_s = 0.01;
    else if (strcmp(argv[i], "-c") == 0)
      g_cpu_clock = 1;
    else if (strcmp(argv[i], "-s") == 0 && i + 1 < argc)
      g_only = argv[++i];
    else {
      fprintf(stderr, "usage: %s [-t THREADS] [-i avx512|avx2|generic] [-q] [-c] "
                      "[-s peak|pool|matmul|sweep|batch|attn|model]\n",
              argv[0]);
      return 2;
    }
  }
  pd_err e = {0};
  pd_backend_opts o = {.n_threads = threads, .cpu_isa = isa};
  pd_backend *be = pd_backend_cpu_create(&o, &e);
  if (!be) {
    fprintf(stderr, "cpu backend: %s\n", e.msg);
    return 1;
  }
  pd_pool *pool = pd_backend_cpu_pool(be);
  int nt = pd_pool_size(pool);
  printf("pd-bench-kernels: isa %s, %d thread(s)\n\n", pd_backend_cpu_isa(be), nt);
  double peak = want("peak") || want("matmul") || want("batch") ? section_peak(be, nt) : 0;
  if (want("pool")) section_pool(pool, nt);
  if (want("matmul")) section_matmul(be, peak);
  if (want("sweep")) section_sweep(be);
  if (want("batch")) section_batch(be, peak);
  if (want("attn")) section_attn(be);
  if (want("model")) section_model(be);
  pd_backend_destroy(be);
  return 0;
}
