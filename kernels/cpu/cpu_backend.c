/* The CPU backend: fills the ops table of backend.h.
 *
 * This file holds no arithmetic. It checks arguments, picks the kernel family once at create
 * (CPUID; pd_backend_opts.cpu_isa = avx512|avx2|generic forces a lower level), splits each op into tasks for the
 * thread pool (or runs it inline when it is too small to be worth a dispatch), and owns the
 * memory the kernels use: per-thread scratch, caller-side scratch and the RoPE cos/sin table.
 * Every op completes before it returns. A backend is used by one thread at a time. */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_internal.h"
#if PD_CPU_X86
#include <cpuid.h>
#endif

/* Work below these sizes runs on the calling thread: a fork/join costs well under a microsecond,
 * but handing a few KiB of activations to another core and back costs more than it saves. */
#define PAR_MIN_MACS 65536   /* matmul: M * N * K */
#define PAR_MIN_ELEMS 16384  /* row ops: M * D */
#define PAR_MIN_BYTES 262144 /* copies */
#define MM_MC_MAX 256        /* GEMM: most rows of x one task sweeps (x block stays in L2) */
#define ROPE_CACHE_MAX_BYTES ((size_t)64 << 20)

typedef struct cpu_impl {
  const pd_cpu_kern *k;
  pd_pool *pool;
  int nt;
  /* Per-thread scratch, 64-byte aligned; grown by the caller between ops only. */
  void **scr;
  size_t scr_size;
  /* Caller-thread scratch (reordered x for GEMV, attention task offsets). */
  void *host;
  size_t host_size;
  /* RoPE tables, one per inv_freq in use (two models on one backend: a speculative draft
   * beside its target): for position p, cs[p * 2 * half ..] = cos[half], sin[half]. */
  struct rope_tab {
    float *inv;
    int half, npos;
    float *cs;
    uint64_t used;
  } rope[2];
  uint64_t rope_clock;
  bool failed; /* inject_fault was called: status reports a failure from then on */
} cpu_impl;

static cpu_impl *impl_of(pd_backend *be) { return (cpu_impl *)be->impl; }

static void *aligned_zalloc(size_t bytes) {
  void *p = NULL;
  if (bytes > SIZE_MAX - 63) return NULL;
  size_t n = (bytes + 63) & ~(size_t)63;
  if (n == 0) n = 64;
  if (posix_memalign(&p, 64, n) != 0) return NULL;
  memset(p, 0, n);
  return p;
}

/* Makes every thread's scratch at least bytes long. Ops have no error return, so running out of
 * memory for a few hundred KiB of scratch is treated as fatal. */
static void ensure_scratch(cpu_impl *c, size_t bytes) {
  if (bytes <= c->scr_size) return;
  bytes = bytes * 5 / 4;
  for (int t = 0; t < c->nt; t++) {
    free(c->scr[t]);
    c->scr[t] = aligned_zalloc(bytes);
    PD_ASSERT(c->scr[t] != NULL && "cpu backend: out of memory for scratch");
  }
  c->scr_size = bytes;
}

static void *host_scratch(cpu_impl *c, size_t bytes) {
  if (bytes > c->host_size) {
    bytes = bytes * 5 / 4;
    free(c->host);
    c->host = aligned_zalloc(bytes);
    PD_ASSERT(c->host != NULL && "cpu backend: out of memory for scratch");
    c->host_size = bytes;
  }
  return c->host;
}

/* Runs fn over n_tasks on the pool, or inline when parallel is false. */
static void run(cpu_impl *c, pd_pool_fn fn, void *ctx, int n_tasks, int parallel) {
  if (parallel && c->nt > 1 && n_tasks > 1) {
    pd_pool_run(c->pool, fn, ctx, n_tasks);
  } else {
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
  }
}

static int check_wdt(pd_dtype t) {
  return t == PD_DTYPE_F32 || t == PD_DTYPE_F16 || t == PD_DTYPE_BF16;
}
/* KV caches: the float types and FP8 e4m3 (values / the layer's k_scale or v_scale). */
static int check_kvdt(pd_dtype t) { return check_wdt(t) || t == PD_DTYPE_F8_E4M3; }
/* Matmul weights: the float types and 4-bit blocks (K a multiple of PD_Q4_BLOCK). */
static int check_mm_wdt(pd_dtype t, int K) {
  return check_wdt(t) || (t == PD_DTYPE_Q4 && K % PD_Q4_BLOCK == 0) ||
         ((t == PD_DTYPE_F8W || t == PD_DTYPE_F8WA || t == PD_DTYPE_F8WS) && K % 16 == 0);
}

/* ---- memory ---------------------------------------------------------------------------------- */

static void *cpu_alloc(pd_backend *be, size_t bytes) {
  (void)be;
  return aligned_zalloc(bytes);
}
static void cpu_free(pd_backend *be, void *p) {
  (void)be;
  free(p);
}
static void cpu_to_device(pd_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  if (bytes) memcpy(dst, src, bytes);
}
static void cpu_to_host(pd_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  if (bytes) memcpy(dst, src, bytes);
}
static void cpu_sync(pd_backend *be) { (void)be; }

/* ---- matmul ---------------------------------------------------------------------------------- */

typedef struct mm_ctx {
  cpu_impl *c;
  float *y;
  const float *x;  /* x, or its GEMV reordering */
  const void *w;
  pd_dtype wdt;
  const float *bias;
  int M, N, K;
  int rows_per_task; /* GEMV: W rows per task */
  int mc, n_panels;  /* GEMM: x rows per task, output panels */
  int ppt, n_groups; /* GEMM: panels per task (a run of adjacent panels), runs */
} mm_ctx;

static void gemv_task(void *arg, int task, int thread) {
  (void)thread;
  mm_ctx *m = arg;
  int n0 = task * m->rows_per_task, n1 = n0 + m->rows_per_task;
  if (n1 > m->N) n1 = m->N;
  m->c->k->gemv(m->y, m->x, m->w, m->wdt, m->bias, m->M, m->N, m->K, n0, n1);
}

static void gemm_task(void *arg, int task, int thread) {
  mm_ctx *m = arg;
  int mb = task / m->n_groups, p0 = task % m->n_groups * m->ppt;
  int p1 = p0 + m->ppt < m->n_panels ? p0 + m->ppt : m->n_panels;
  int m0 = mb * m->mc, m1 = m0 + m->mc;
  if (m1 > m->M) m1 = m->M;
  m->c->k->gemm(m->y, m->x, m->w, m->wdt, m->bias, m->M, m->N, m->K, m0, m1, p0, p1,
                (float *)m->c->scr[thread]);
}

static void cpu_matmul(pd_backend *be, float *y, const float *x, const void *w, pd_dtype wdt,
                       const float *bias, int M, int N, int K) {
  cpu_impl *c = impl_of(be);
  const pd_cpu_kern *k = c->k;
  PD_ASSERT(M >= 0 && N >= 0 && K >= 0);
  PD_ASSERT(check_mm_wdt(wdt, K));
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int i = 0; i < M; i++) {
      if (bias)
        memcpy(y + (size_t)i * N, bias, (size_t)N * sizeof(float));
      else
        memset(y + (size_t)i * N, 0, (size_t)N * sizeof(float));
    }
    return;
  }
  /* FP8 activations (F8WA): each row quantized to e4m3 with its own scale, max|x| / 448, and
   * back, as the checkpoint's dynamic per-token scheme does before its product */
  if (wdt == PD_DTYPE_F8WA) {
    float *xq = host_scratch(c, (size_t)M * K * sizeof(float));
    for (int i = 0; i < M; i++) {
      const float *xr = x + (size_t)i * K;
      float *qr = xq + (size_t)i * K, amax = 0.0f;
      for (int j = 0; j < K; j++) amax = fmaxf(amax, fabsf(xr[j]));
      const float sc = amax / 448.0f;
      for (int j = 0; j < K; j++)
        qr[j] = sc > 0.0f ? pd_e4m3_to_f32(pd_f32_to_e4m3(xr[j] / sc)) * sc : 0.0f;
    }
    x = xq;
  }
  /* static FP8 activations (F8WS): every row with the layer's input scale (the rows' tail),
   * saturating at +-448 */
  if (wdt == PD_DTYPE_F8WS) {
    float sc;
    memcpy(&sc, (const uint8_t *)w + K + 4, 4);
    float *xq = host_scratch(c, (size_t)M * K * sizeof(float));
    for (size_t i = 0; i < (size_t)M * K; i++) xq[i] = pd_e4m3_to_f32(pd_f32_to_e4m3(x[i] / sc)) * sc;
    x = xq;
  }
  double macs = (double)M * N * K;
  int parallel = c->nt > 1 && macs >= PAR_MIN_MACS;
  mm_ctx m = {.c = c, .y = y, .x = x, .w = w, .wdt = wdt, .bias = bias, .M = M, .N = N, .K = K};

  if (M <= k->gemv_max_m) {
    if (wdt == PD_DTYPE_BF16 || wdt == PD_DTYPE_Q4)
      m.x = k->gemv_prep(host_scratch(c, (size_t)M * K * sizeof(float)), x, wdt, M, K);
    /* About four tasks per thread, in whole 8-row steps, for dynamic balance. */
    int n_tasks = parallel ? 4 * c->nt : 1;
    int rpt = (N + n_tasks - 1) / n_tasks;
    rpt = (rpt + 7) & ~7;
    m.rows_per_task = rpt;
    run(c, gemv_task, &m, (N + rpt - 1) / rpt, parallel);
    return;
  }

  /* GEMM: tasks are (block of at most MM_MC_MAX rows) x (run of adjacent output panels). A task
   * packs each of its panels once and prefetches the next one's W while it computes, so long runs
   * pay off when W comes from DRAM (decode batches); about four tasks per thread keep the dynamic
   * hand-out balanced. Rows are split further only when there are too few panels, since every
   * row block packs its panels again. */
  const int mr = k->mm_mr, nr = k->mm_nr;
  m.n_panels = (N + nr - 1) / nr;
  int mc = M < MM_MC_MAX ? M : MM_MC_MAX;
  int n_mb = (M + mc - 1) / mc;
  m.ppt = m.n_panels;
  if (parallel) {
    int want = 4 * c->nt;
    int groups = (want + n_mb - 1) / n_mb;
    m.ppt = (m.n_panels + groups - 1) / groups;
    if (n_mb * m.n_panels < 2 * c->nt) {
      int split = (2 * c->nt + m.n_panels - 1) / m.n_panels;
      mc = (M + split - 1) / split;
    }
  }
  mc = (mc + mr - 1) / mr * mr;
  m.mc = mc;
  m.n_groups = (m.n_panels + m.ppt - 1) / m.ppt;
  ensure_scratch(c, (size_t)nr * k->mm_kc * sizeof(float));
  run(c, gemm_task, &m, (M + mc - 1) / mc * m.n_groups, parallel);
}

/* ---- row ops --------------------------------------------------------------------------------- */

enum row_kind { ROW_RMSNORM, ROW_ADD_RMSNORM, ROW_SWIGLU, ROW_ROPE, ROW_EMBED, ROW_GET_ROWS };

typedef struct row_ctx {
  cpu_impl *c;
  enum row_kind kind;
  int M, D, rows_per_task;
  float *y, *x;
  const float *cx, *r, *w;
  float eps;
  const void *table;
  pd_dtype dt;
  const int32_t *idx;
  /* rope */
  const struct rope_args *rope;
  float *q, *kk;
  int nqh, nkvh;
} row_ctx;

static void rope_row(const row_ctx *r, int i, float *tmp);

static void row_task(void *arg, int task, int thread) {
  row_ctx *r = arg;
  const pd_cpu_kern *k = r->c->k;
  int i0 = task * r->rows_per_task, i1 = i0 + r->rows_per_task;
  if (i1 > r->M) i1 = r->M;
  size_t D = (size_t)r->D;
  for (int i = i0; i < i1; i++) {
    switch (r->kind) {
    case ROW_RMSNORM: k->rmsnorm(r->y + i * D, r->cx + i * D, r->w, r->eps, r->D); break;
    case ROW_ADD_RMSNORM:
      k->add_rmsnorm(r->y + i * D, r->x + i * D, r->r + i * D, r->w, r->eps, r->D);
      break;
    case ROW_SWIGLU: k->swiglu(r->y + i * D, r->cx + i * 2 * D, r->D); break;
    case ROW_ROPE: rope_row(r, i, (float *)r->c->scr[thread]); break;
    case ROW_EMBED:
      k->to_f32(r->y + i * D,
                (const char *)r->table + (size_t)r->idx[i] * D * pd_dtype_size(r->dt), r->dt, D);
      break;
    case ROW_GET_ROWS:
      memcpy(r->y + i * D, r->cx + (size_t)r->idx[i] * D, D * sizeof(float));
      break;
    }
  }
}

/* Runs a row op over M rows of about `cost` elements each. */
static void run_rows(row_ctx *r, double cost_per_row) {
  cpu_impl *c = r->c;
  int parallel = c->nt > 1 && (double)r->M * cost_per_row >= PAR_MIN_ELEMS && r->M > 1;
  int n_tasks = parallel ? (r->M < 4 * c->nt ? r->M : 4 * c->nt) : 1;
  r->rows_per_task = (r->M + n_tasks - 1) / n_tasks;
  run(c, row_task, r, (r->M + r->rows_per_task - 1) / r->rows_per_task, parallel);
}

static void cpu_rmsnorm(pd_backend *be, float *y, const float *x, const float *w, float eps, int M,
                        int D) {
  PD_ASSERT(M >= 0 && D >= 0);
  if (M == 0 || D == 0) return;
  row_ctx r = {.c = impl_of(be), .kind = ROW_RMSNORM, .M = M, .D = D, .y = y, .cx = x, .w = w,
               .eps = eps};
  run_rows(&r, D);
}

static void cpu_add_rmsnorm(pd_backend *be, float *y, float *x, const float *res, const float *w,
                            float eps, int M, int D) {
  PD_ASSERT(M >= 0 && D >= 0);
  if (M == 0 || D == 0) return;
  row_ctx r = {.c = impl_of(be), .kind = ROW_ADD_RMSNORM, .M = M, .D = D, .y = y, .x = x,
               .r = res, .w = w, .eps = eps};
  run_rows(&r, 2.0 * D);
}

static void cpu_swiglu(pd_backend *be, float *y, const float *gu, int M, int F) {
  PD_ASSERT(M >= 0 && F >= 0);
  if (M == 0 || F == 0) return;
  row_ctx r = {.c = impl_of(be), .kind = ROW_SWIGLU, .M = M, .D = F, .y = y, .cx = gu};
  run_rows(&r, 4.0 * F);
}

static void cpu_embed(pd_backend *be, float *y, const void *table, pd_dtype dt, const int32_t *ids,
                      int M, int D) {
  PD_ASSERT(M >= 0 && D >= 0);
  PD_ASSERT(check_wdt(dt));
  if (M == 0 || D == 0) return;
  for (int i = 0; i < M; i++) PD_ASSERT(ids[i] >= 0);
  row_ctx r = {.c = impl_of(be), .kind = ROW_EMBED, .M = M, .D = D, .y = y, .table = table,
               .dt = dt, .idx = ids};
  run_rows(&r, 0.25 * D);
}

static void cpu_get_rows(pd_backend *be, float *y, const float *x, const int32_t *idx, int n,
                         int D) {
  PD_ASSERT(n >= 0 && D >= 0);
  if (n == 0 || D == 0) return;
  for (int i = 0; i < n; i++) PD_ASSERT(idx[i] >= 0);
  row_ctx r = {.c = impl_of(be), .kind = ROW_GET_ROWS, .M = n, .D = D, .y = y, .cx = x, .idx = idx};
  run_rows(&r, 0.25 * D);
}

/* ---- add ------------------------------------------------------------------------------------- */

typedef struct add_ctx {
  const pd_cpu_kern *k;
  float *y;
  const float *x;
  size_t n, per;
} add_ctx;

static void add_task(void *arg, int task, int thread) {
  (void)thread;
  add_ctx *a = arg;
  size_t i0 = (size_t)task * a->per, i1 = i0 + a->per;
  if (i1 > a->n) i1 = a->n;
  if (i0 < i1) a->k->add(a->y + i0, a->x + i0, i1 - i0);
}

static void cpu_add(pd_backend *be, float *y, const float *x, size_t n) {
  cpu_impl *c = impl_of(be);
  if (n == 0) return;
  int parallel = c->nt > 1 && n * sizeof(float) >= PAR_MIN_BYTES;
  int n_tasks = parallel ? 2 * c->nt : 1;
  add_ctx a = {.k = c->k, .y = y, .x = x, .n = n};
  a.per = ((n + (size_t)n_tasks - 1) / (size_t)n_tasks + 15) & ~(size_t)15;
  run(c, add_task, &a, (int)((n + a.per - 1) / a.per), parallel);
}

/* ---- RoPE ------------------------------------------------------------------------------------ */

/* cs[0..half) = cos(pos * inv_freq), cs[half..2 half) = sin(...), the angle rounded to float first
 * as Hugging Face computes it. */
static void rope_fill(float *cs, int pos, const float *inv_freq, int half) {
  for (int i = 0; i < half; i++) {
    float ang = (float)pos * inv_freq[i];
    cs[i] = cosf(ang);
    cs[half + i] = sinf(ang);
  }
}

/* The table of this inv_freq covering positions [0, npos) (the least recently used one is
 * replaced when both are taken); NULL when it cannot be made (too large, out of memory), in
 * which case rows compute their own cos/sin. */
static const float *rope_cache(cpu_impl *c, const float *inv_freq, int half, int npos) {
  struct rope_tab *t = NULL;
  for (int i = 0; i < 2 && !t; i++)
    if (c->rope[i].inv && c->rope[i].half == half &&
        memcmp(c->rope[i].inv, inv_freq, (size_t)half * sizeof(float)) == 0)
      t = &c->rope[i];
  if (!t) {
    t = c->rope[0].used <= c->rope[1].used ? &c->rope[0] : &c->rope[1];
    free(t->inv);
    free(t->cs);
    memset(t, 0, sizeof *t);
  }
  t->used = ++c->rope_clock;
  if (npos <= t->npos) return t->cs;
  size_t row = 2 * (size_t)half * sizeof(float);
  int cap = t->npos > 0 ? t->npos : 1024;
  while (cap < npos) cap *= 2;
  if ((size_t)cap * row > ROPE_CACHE_MAX_BYTES) return NULL;
  if (!t->inv) {
    t->inv = malloc((size_t)half * sizeof(float) + 1);
    if (!t->inv) return NULL;
    memcpy(t->inv, inv_freq, (size_t)half * sizeof(float));
    t->half = half;
  }
  float *cs = realloc(t->cs, (size_t)cap * row + 1);
  if (!cs) return NULL;
  t->cs = cs;
  for (int p = t->npos; p < cap; p++) rope_fill(cs + (size_t)p * 2 * half, p, inv_freq, half);
  t->npos = cap;
  return cs;
}

struct rope_args {
  const int32_t *pos;
  const float *inv_freq;
  const float *table; /* rope_cache's, or NULL */
  int hd;
};
typedef struct rope_args rope_args;

static void rope_row(const row_ctx *r, int i, float *tmp) {
  const rope_args *ra = r->rope;
  int half = ra->hd / 2;
  const float *cs;
  if (ra->table) {
    cs = ra->table + (size_t)ra->pos[i] * 2 * half;
  } else {
    rope_fill(tmp, ra->pos[i], ra->inv_freq, half);
    cs = tmp;
  }
  if (r->q) r->c->k->rope(r->q + (size_t)i * r->nqh * ra->hd, r->nqh, ra->hd, cs);
  if (r->kk) r->c->k->rope(r->kk + (size_t)i * r->nkvh * ra->hd, r->nkvh, ra->hd, cs);
}

static void cpu_rope(pd_backend *be, float *q, float *k, const int32_t *pos, const float *inv_freq,
                     int M, int n_q_heads, int n_kv_heads, int head_dim) {
  cpu_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && n_q_heads >= 0 && n_kv_heads >= 0 && head_dim >= 0);
  if (M == 0 || head_dim < 2) return;
  int maxp = 0;
  for (int i = 0; i < M; i++) {
    PD_ASSERT(pos[i] >= 0);
    if (pos[i] > maxp) maxp = pos[i];
  }
  int half = head_dim / 2;
  rope_args ra = {.pos = pos, .inv_freq = inv_freq, .hd = head_dim};
  ra.table = maxp < INT32_MAX ? rope_cache(c, inv_freq, half, maxp + 1) : NULL;
  if (!ra.table) ensure_scratch(c, 2 * (size_t)half * sizeof(float));
  row_ctx r = {.c = c, .kind = ROW_ROPE, .M = M, .D = head_dim, .rope = &ra,
               .q = n_q_heads ? q : NULL, .kk = n_kv_heads ? k : NULL, .nqh = n_q_heads,
               .nkvh = n_kv_heads};
  run_rows(&r, 2.0 * (n_q_heads + n_kv_heads) * head_dim);
}

/* ---- KV cache -------------------------------------------------------------------------------- */

typedef struct kvw_ctx {
  const pd_kv_layer *kv;
  const pd_kv_shape *sh;
  const float *k, *v;
  const int32_t *slots;
  int M, per;
} kvw_ctx;

/* scale: FP8 caches store e4m3(src / scale) */
static void store_row(void *dst, const float *src, pd_dtype dt, int n, float scale) {
  if (dt == PD_DTYPE_F8_E4M3) {
    uint8_t *d = dst;
    for (int i = 0; i < n; i++) d[i] = pd_f32_to_e4m3(src[i] / scale);
  } else if (dt == PD_DTYPE_F32) {
    memcpy(dst, src, (size_t)n * sizeof(float));
  } else if (dt == PD_DTYPE_BF16) {
    uint16_t *d = dst;
    for (int i = 0; i < n; i++) d[i] = pd_f32_to_bf16(src[i]);
  } else {
    uint16_t *d = dst;
    for (int i = 0; i < n; i++) d[i] = pd_f32_to_f16(src[i]);
  }
}

static void kvw_task(void *arg, int task, int thread) {
  (void)thread;
  kvw_ctx *w = arg;
  const pd_kv_shape *sh = w->sh;
  size_t esz = pd_dtype_size(sh->dtype), row = (size_t)sh->num_kv_heads * sh->head_dim;
  int i1 = (task + 1) * w->per < w->M ? (task + 1) * w->per : w->M;
  for (int i = task * w->per; i < i1; i++) {
    int32_t slot = w->slots[i];
    if (slot < 0) continue;
    int blk = slot / sh->block_size, off = slot % sh->block_size;
    for (int g = 0; g < sh->num_kv_heads; g++) {
      size_t el = (((size_t)blk * sh->num_kv_heads + g) * sh->block_size + off) * sh->head_dim;
      store_row((char *)w->kv->k + el * esz, w->k + i * row + (size_t)g * sh->head_dim, sh->dtype,
                sh->head_dim, pd_kv_k_scale(w->kv));
      store_row((char *)w->kv->v + el * esz, w->v + i * row + (size_t)g * sh->head_dim, sh->dtype,
                sh->head_dim, pd_kv_v_scale(w->kv));
    }
  }
}

static void cpu_kv_write(pd_backend *be, const pd_kv_layer *kv, const pd_kv_shape *shape,
                         const float *k, const float *v, const int32_t *slots, int M) {
  cpu_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && shape->block_size > 0 && shape->num_kv_heads > 0 && shape->head_dim > 0);
  PD_ASSERT(check_kvdt(shape->dtype));
  if (M == 0) return;
  int64_t n_slots = (int64_t)shape->num_blocks * shape->block_size;
  for (int i = 0; i < M; i++) PD_ASSERT(slots[i] < n_slots);
  size_t bytes = (size_t)M * shape->num_kv_heads * shape->head_dim * 2 * sizeof(float);
  int parallel = c->nt > 1 && bytes >= PAR_MIN_BYTES;
  int n_tasks = parallel ? (M < 2 * c->nt ? M : 2 * c->nt) : 1;
  kvw_ctx w = {.kv = kv, .sh = shape, .k = k, .v = v, .slots = slots, .M = M};
  w.per = (M + n_tasks - 1) / n_tasks;
  run(c, kvw_task, &w, (M + w.per - 1) / w.per, parallel);
}

/* KV staging (backend.h): the cache is host memory, so a segment is one memcpy. The same calls as
 * on a device, so the staging code (pd/kvpack.h, pd_kvstage) runs and is tested without a GPU. */
static void kv_stage_check(const void *host, const void *base, const int32_t *ids, int n) {
  PD_ASSERT(n >= 0);
  PD_ASSERT(n == 0 || (host && base && ids));
  for (int i = 0; i < n; i++) PD_ASSERT(ids[i] >= 0);
}

static void cpu_kv_gather(pd_backend *be, void *host, const void *base, const int32_t *ids, int n,
                          size_t stride, size_t offset, size_t seg_bytes) {
  (void)be;
  kv_stage_check(host, base, ids, n);
  if (!seg_bytes) return;
  for (int i = 0; i < n; i++)
    memcpy((char *)host + (size_t)i * seg_bytes,
           (const char *)base + (size_t)ids[i] * stride + offset, seg_bytes);
}

static void cpu_kv_scatter(pd_backend *be, void *base, const void *host, const int32_t *ids,
                           int n, size_t stride, size_t offset, size_t seg_bytes) {
  (void)be;
  kv_stage_check(host, base, ids, n);
  if (!seg_bytes) return;
  for (int i = 0; i < n; i++)
    memcpy((char *)base + (size_t)ids[i] * stride + offset,
           (const char *)host + (size_t)i * seg_bytes, seg_bytes);
}

/* kv_gather_runs / kv_scatter_runs: the same copies, run by run. */
static void cpu_kv_gather_runs(pd_backend *be, void *host, const pd_kv_run *runs, int n_runs) {
  PD_ASSERT(n_runs >= 0 && (n_runs == 0 || (host && runs)));
  for (int r = 0; r < n_runs; r++)
    if (runs[r].n > 0 && runs[r].seg_bytes)
      cpu_kv_gather(be, (char *)host + runs[r].host_off, runs[r].base, runs[r].ids, runs[r].n,
                    runs[r].stride, runs[r].offset, runs[r].seg_bytes);
}

static void cpu_kv_scatter_runs(pd_backend *be, const void *host, const pd_kv_run *runs,
                                int n_runs) {
  PD_ASSERT(n_runs >= 0 && (n_runs == 0 || (host && runs)));
  for (int r = 0; r < n_runs; r++)
    if (runs[r].n > 0 && runs[r].seg_bytes)
      cpu_kv_scatter(be, (void *)runs[r].base, (const char *)host + runs[r].host_off,
                     runs[r].ids, runs[r].n, runs[r].stride, runs[r].offset,
                     runs[r].seg_bytes);
}

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct attn_ctx {
  cpu_impl *c;
  pd_cpu_attn a;
  const int32_t *task0; /* [n_seqs + 1]: first task of each sequence */
  int n_seqs;
  int tile; /* (token, head) pairs per tile */
} attn_ctx;

static void attn_task(void *arg, int task, int thread) {
  attn_ctx *x = arg;
  /* Sequence of this task: last s with task0[s] <= task. */
  int lo = 0, hi = x->n_seqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (x->task0[mid] <= task)
      lo = mid;
    else
      hi = mid - 1;
  }
  int s = lo, local = task - x->task0[s];
  int pairs = (x->a.q_start[s + 1] - x->a.q_start[s]) * x->a.group;
  int n_tiles = (pairs + x->tile - 1) / x->tile;
  /* Latest tiles (most keys) first, so the long tasks do not trail at the end. */
  int tile = n_tiles - 1 - local / x->a.n_kv_heads;
  pd_cpu_attn_tile t;
  t.s = s;
  t.g = local % x->a.n_kv_heads;
  t.p0 = tile * x->tile;
  t.p1 = t.p0 + x->tile < pairs ? t.p0 + x->tile : pairs;
  x->c->k->attn(&x->a, &t, x->c->scr[thread]);
}

static void cpu_attention(pd_backend *be, float *out, const float *q, const pd_kv_layer *kv,
                          const pd_kv_shape *shape, const pd_attn_batch *b, int n_q_heads,
                          float scale, int sliding_window) {
  cpu_impl *c = impl_of(be);
  const pd_cpu_kern *k = c->k;
  PD_ASSERT(shape->block_size > 0 && shape->num_kv_heads > 0 && shape->head_dim > 0);
  PD_ASSERT(n_q_heads > 0 && n_q_heads % shape->num_kv_heads == 0);
  PD_ASSERT(check_kvdt(shape->dtype));
  PD_ASSERT(b->n_seqs >= 0);
  if (b->n_seqs == 0 || b->n_tokens == 0) return;

  attn_ctx x = {.c = c, .n_seqs = b->n_seqs, .tile = k->at_tile};
  /* FP8 caches hold K / k_scale and V / v_scale: the softmax scale takes k_scale, and the output
   * is multiplied by v_scale after */
  const bool f8 = shape->dtype == PD_DTYPE_F8_E4M3;
  x.a = (pd_cpu_attn){.out = out, .q = q, .k = kv->k, .v = kv->v, .kv_dtype = shape->dtype,
                      .block_size = shape->block_size, .n_kv_heads = shape->num_kv_heads,
                      .head_dim = shape->head_dim, .n_q_heads = n_q_heads,
                      .group = n_q_heads / shape->num_kv_heads,
                      .scale = f8 ? scale * pd_kv_k_scale(kv) : scale,
                      .window = sliding_window, .q_start = b->q_start, .ctx_len = b->ctx_len,
                      .block_tables = b->block_tables, .max_blocks = b->max_blocks};
  int32_t *task0 = host_scratch(c, ((size_t)b->n_seqs + 1) * sizeof(int32_t));
  int64_t total = 0;
  for (int s = 0; s < b->n_seqs; s++) {
    int n_new = b->q_start[s + 1] - b->q_start[s];
    int L = b->ctx_len[s];
    /* Positions travel as floats in the lane kernel: exact below 2^24. */
    PD_ASSERT(n_new >= 0 && L >= n_new && L < (1 << 24));
    PD_ASSERT((int64_t)L <= (int64_t)b->max_blocks * shape->block_size);
    for (int bi = 0; bi < (L + shape->block_size - 1) / shape->block_size; bi++) {
      int32_t blk = b->block_tables[(size_t)s * b->max_blocks + bi];
      PD_ASSERT(blk >= 0 && blk < shape->num_blocks);
    }
    task0[s] = (int32_t)total;
    total += ((int64_t)n_new * x.a.group + x.tile - 1) / x.tile * shape->num_kv_heads;
    PD_ASSERT(total < INT32_MAX);
  }
  task0[b->n_seqs] = (int32_t)total;
  x.task0 = task0;
  ensure_scratch(c, k->attn_scratch(shape->head_dim));
  run(c, attn_task, &x, (int)total, 1);
  if (f8 && pd_kv_v_scale(kv) != 1.0f) {
    const float vs = pd_kv_v_scale(kv);
    const size_t n = (size_t)b->n_tokens * n_q_heads * shape->head_dim;
    for (size_t i = 0; i < n; i++) out[i] *= vs;
  }
}

/* ---- failure --------------------------------------------------------------------------------- */

/* Arithmetic on the host cannot fail; only an injected fault (tests of the nodes' fault
 * handling) makes this backend report one. */
static pd_status cpu_status(pd_backend *be, pd_err *e) {
  if (!impl_of(be)->failed) return PD_OK;
  return pd_err_set(e, PD_EBACKEND, "cpu backend: injected device fault");
}

static void cpu_inject_fault(pd_backend *be) { impl_of(be)->failed = true; }

/* ---- create / destroy ------------------------------------------------------------------------ */

static void cpu_destroy(pd_backend *be) {
  if (!be) return;
  cpu_impl *c = impl_of(be);
  if (c) {
    pd_pool_destroy(c->pool);
    if (c->scr)
      for (int t = 0; t < c->nt; t++) free(c->scr[t]);
    free(c->scr);
    free(c->host);
    for (int i = 0; i < 2; i++) {
      free(c->rope[i].inv);
      free(c->rope[i].cs);
    }
    free(c);
  }
  free(be);
}

static int online_cores(void) {
#ifdef CPU_COUNT
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* The best kernel family this CPU runs, lowered to isa (NULL or "": no cap). */
static const pd_cpu_kern *pick_kernels(const char *isa, pd_err *e) {
  int level = 0; /* 0 generic, 1 avx2, 2 avx512 */
#if PD_CPU_X86
  __builtin_cpu_init();
  /* F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c" for
   * __builtin_cpu_supports */
  unsigned a, b, c, d;
  bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)
    level = 1;
  if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    level = 2;
#endif
  if (isa && *isa) {
    int want;
    if (strcmp(isa, "avx512") == 0)
      want = 2;
    else if (strcmp(isa, "avx2") == 0)
      want = 1;
    else if (strcmp(isa, "generic") == 0)
      want = 0;
    else {
      pd_err_set(e, PD_EINVAL, "--cpu-isa '%s': expected avx512, avx2 or generic", isa);
      return NULL;
    }
    if (want < level) level = want;
  }
#if PD_CPU_X86
  if (level == 2) return &pd_cpu_kern_avx512;
  if (level == 1) return &pd_cpu_kern_avx2;
#endif
  return &pd_cpu_kern_generic;
}

pd_backend *pd_backend_cpu_create(const pd_backend_opts *o, pd_err *e) {
  int nt = o && o->n_threads > 0 ? o->n_threads : online_cores();
  const pd_cpu_kern *k = pick_kernels(o ? o->cpu_isa : NULL, e);
  if (!k) return NULL;
  pd_backend *be = calloc(1, sizeof *be);
  cpu_impl *c = calloc(1, sizeof *c);
  if (!be || !c) {
    free(be);
    free(c);
    pd_err_set(e, PD_ENOMEM, "cpu backend: out of memory");
    return NULL;
  }
  be->impl = c;
  be->host_memory = true; /* weights are used in place from the mapping */
  be->ops = (pd_backend_ops){
      .name = "cpu",
      .alloc = cpu_alloc,
      .free = cpu_free,
      .to_device = cpu_to_device,
      .to_host = cpu_to_host,
      .sync = cpu_sync,
      .matmul = cpu_matmul,
      .rmsnorm = cpu_rmsnorm,
      .add_rmsnorm = cpu_add_rmsnorm,
      .embed = cpu_embed,
      .rope = cpu_rope,
      .swiglu = cpu_swiglu,
      .kv_write = cpu_kv_write,
      .attention = cpu_attention,
      .get_rows = cpu_get_rows,
      .add = cpu_add,
      .destroy = cpu_destroy,
      .status = cpu_status,
      .inject_fault = cpu_inject_fault,
      .kv_gather = cpu_kv_gather,
      .kv_scatter = cpu_kv_scatter,
      .kv_gather_runs = cpu_kv_gather_runs,
      .kv_scatter_runs = cpu_kv_scatter_runs,
  };
  pd_backend_compose_layer_ops(be); /* the layer ops from the ops above */
  c->k = k;
  c->nt = nt;
  c->scr = calloc((size_t)nt, sizeof *c->scr);
  if (!c->scr) {
    cpu_destroy(be);
    pd_err_set(e, PD_ENOMEM, "cpu backend: out of memory");
    return NULL;
  }
  const int spin = !o || o->cpu_spin_us == 0 ? PD_POOL_SPIN_US : o->cpu_spin_us < 0 ? 0
                                                                   : o->cpu_spin_us;
  c->pool = pd_pool_create_spin(nt, spin, e);
  if (!c->pool) {
    cpu_destroy(be);
    return NULL;
  }
  /* Pre-size scratch for the common shapes (GEMM panel, attention up to head_dim 256). */
  size_t need = (size_t)k->mm_nr * k->mm_kc * sizeof(float);
  size_t at = k->attn_scratch(256);
  if (at > need) need = at;
  for (int t = 0; t < nt; t++) {
    c->scr[t] = aligned_zalloc(need);
    if (!c->scr[t]) {
      cpu_destroy(be);
      pd_err_set(e, PD_ENOMEM, "cpu backend: out of memory for scratch");
      return NULL;
    }
  }
  c->scr_size = need;
  return be;
}

const char *pd_backend_cpu_isa(const pd_backend *be) {
  return be && be->impl ? ((const cpu_impl *)be->impl)->k->name : "none";
}

pd_pool *pd_backend_cpu_pool(pd_backend *be) { return impl_of(be)->pool; }
const pd_cpu_kern *pd_backend_cpu_kern(pd_backend *be) { return impl_of(be)->k; }

void pd_backend_destroy(pd_backend *be) {
  if (be && be->ops.destroy) be->ops.destroy(be);
}

pd_status pd_backend_status(pd_backend *be, pd_err *e) {
  return be && be->ops.status ? be->ops.status(be, e) : PD_OK;
}
