/* Every op of the CUDA backend against the CPU backend (the reference implementation), on random
 * inputs of awkward sizes: one row to 4096 rows, odd hidden and FFN sizes (4000, 11003), K not a
 * multiple of 8 (the scalar GEMV path), f32 / f16 / bf16 weights and KV caches, head dims 64, 80,
 * 128 (tuned kernels) and 32, 96 (generic kernel), GQA ratios 1, 3, 4, 8, 12, block sizes 16 and
 * 32, pages out of order, ragged batches of many sequences, prefill chunks over a cached prefix,
 * sliding windows, long contexts that split the work (split-K decode and prefill + merge).
 * Cache slots no sequence owns hold NaN, so a kernel reading outside a context poisons its
 * output and fails.
 *
 * Tolerances (max |gpu - cpu| / max |cpu|): paths computing in f32 on both sides (GEMV with
 * M <= 2, SIMT decode attention, row ops) 1e-4; bf16 tensor-core paths (cuBLAS with x rounded
 * to bf16, attention with Q, K, V, P in bf16 or f16) 1.5e-2; TF32 (f32 weights, M > 2) 5e-3;
 * data movement (embed, kv_write, get_rows, add, copies) exact.
 *
 * Usage: test_cuda_ops [small]   ("small": reduced sizes, for compute-sanitizer).
 * Exits 77 (skipped) when there is no CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/backend.h"
#include "pd/backend_cuda.h"
#include "pd/dtype.h"
#include "pd_test.h"

static pd_backend *g_cpu, *g_gpu;
static int g_small;
/* run_layer_case: the linear layers' weight dtype (a quantized one), or -1: the model's */
static int g_lin_dt = -1;

/* ---- helpers ------------------------------------------------------------------------------- */

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 11);
}
static float frand(float lo, float hi) {
  return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f;
}
static int irand(int n) { return (int)(rnd() % (uint32_t)n); }

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  REQUIRE(p);
  return p;
}

static float *rand_f32(size_t n, float lo, float hi) {
  float *p = xmalloc(n * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = frand(lo, hi);
  return p;
}

/* n random values in dtype dt (bytes returned). */
static void *rand_dt(pd_dtype dt, size_t n, float lo, float hi) {
  void *p = xmalloc(n * pd_dtype_size(dt));
  for (size_t i = 0; i < n; i++) {
    float v = frand(lo, hi);
    if (dt == PD_DTYPE_F32)
      ((float *)p)[i] = v;
    else if (dt == PD_DTYPE_BF16)
      ((uint16_t *)p)[i] = pd_f32_to_bf16(v);
    else
      ((uint16_t *)p)[i] = pd_f32_to_f16(v);
  }
  return p;
}

static void set_nan(void *p, pd_dtype dt, size_t i) {
  if (dt == PD_DTYPE_F32)
    ((float *)p)[i] = NAN;
  else if (dt == PD_DTYPE_BF16)
    ((uint16_t *)p)[i] = 0x7fc0;
  else
    ((uint16_t *)p)[i] = 0x7e00;
}

/* N rows of K random weights of about +-amp in dt: the float types as rand_dt; PD_DTYPE_Q4 rows
 * (random 4-bit values, scales near amp / 8, integer zeros) and F8W / F8WA rows (random e4m3 of
 * at most 64, a scale of amp / 64), as pd/dtype.h lays them out. */
static void *rand_w(pd_dtype dt, int N, int K, float amp) {
  if (dt != PD_DTYPE_Q4 && dt != PD_DTYPE_F8W && dt != PD_DTYPE_F8WA)
    return rand_dt(dt, (size_t)N * K, -amp, amp);
  const size_t rb = pd_dtype_row_bytes(dt, K);
  uint8_t *p = xmalloc((size_t)N * rb);
  for (int n = 0; n < N; n++) {
    uint8_t *row = p + (size_t)n * rb;
    if (dt == PD_DTYPE_Q4) {
      for (int j = 0; j < K / 2; j++) row[j] = (uint8_t)rnd();
      for (int b = 0; b < K / PD_Q4_BLOCK; b++) {
        const uint16_t sz[2] = {pd_f32_to_f16(frand(0.5f, 1.0f) * amp / 8), pd_f32_to_f16((float)irand(16))};
        memcpy(row + K / 2 + 4 * b, sz, 4);
      }
    } else {
      for (int j = 0; j < K; j++) row[j] = pd_f32_to_e4m3(frand(-64, 64));
      const float sc = frand(0.5f, 1.0f) * amp / 64;
      memcpy(row + K, &sc, 4);
    }
  }
  return p;
}

static void *up(const void *h, size_t bytes) {
  void *d = g_gpu->ops.alloc(g_gpu, bytes);
  REQUIRE(d);
  if (bytes) g_gpu->ops.to_device(g_gpu, d, h, bytes);
  return d;
}
static void *down(const void *d, size_t bytes) {
  void *h = xmalloc(bytes);
  g_gpu->ops.to_host(g_gpu, h, d, bytes);
  return h;
}
static void gfree(void *d) { g_gpu->ops.free(g_gpu, d); }
static void *down_be(pd_backend *be, const void *d, size_t bytes) {
  void *h = xmalloc(bytes);
  be->ops.to_host(be, h, d, bytes);
  return h;
}

/* max |a - ref| / max |ref|; infinite when a holds a NaN or ref is all zeros but a is not. */
static double rel_err(const float *a, const float *ref, size_t n) {
  double md = 0, mr = 0;
  for (size_t i = 0; i < n; i++) {
    if (isnan(a[i]) || isnan(ref[i])) return INFINITY;
    double d = fabs((double)a[i] - ref[i]);
    if (d > md) md = d;
    if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
  }
  if (mr == 0) return md == 0 ? 0 : INFINITY;
  return md / mr;
}

static const char *dtn(pd_dtype t) { return pd_dtype_name(t); }
static const pd_dtype k_dts[3] = {PD_DTYPE_F32, PD_DTYPE_F16, PD_DTYPE_BF16};

/* ---- memory ----------------------------------------------------------------------------------- */

static void test_memory(void) {
  size_t n = g_small ? (1u << 20) + 3 : (20u << 20) + 5; /* > 2 pinned chunks when not small */
  void *z = g_gpu->ops.alloc(g_gpu, 0); /* a zero-byte allocation is a valid pointer */
  CHECK(z != NULL);
  g_gpu->ops.to_device(g_gpu, z, &n, 0);
  g_gpu->ops.to_host(g_gpu, &n, z, 0);
  gfree(z);
  void *d = g_gpu->ops.alloc(g_gpu, n);
  REQUIRE(d);
  unsigned char *h = down(d, n);
  size_t nz = 0;
  for (size_t i = 0; i < n; i++) nz += h[i] != 0;
  CHECKF(nz == 0, "alloc: %zu nonzero bytes", nz);
  for (size_t i = 0; i < n; i++) h[i] = (unsigned char)rnd();
  g_gpu->ops.to_device(g_gpu, d, h, n);
  void *d2 = g_gpu->ops.alloc(g_gpu, n);
  REQUIRE(d2);
  g_gpu->ops.copy(g_gpu, d2, d, n);
  unsigned char *h2 = down(d2, n);
  CHECKF(memcmp(h, h2, n) == 0, "to_device / copy / to_host round trip differs");
  /* an unaligned sub-range */
  unsigned char *h3 = xmalloc(1001);
  g_gpu->ops.to_host(g_gpu, h3, (char *)d2 + 7, 1001);
  CHECK(memcmp(h3, h + 7, 1001) == 0);
  g_gpu->ops.sync(g_gpu);
  free(h);
  free(h2);
  free(h3);
  gfree(d);
  gfree(d2);
}

/* ---- matmul ----------------------------------------------------------------------------------- */

static void test_matmul(int M, int N, int K, pd_dtype wdt, int with_bias) {
  float *x = rand_f32((size_t)M * K, -1, 1);
  void *w = rand_dt(wdt, (size_t)N * K, -1.0f / sqrtf((float)K + 1), 1.0f / sqrtf((float)K + 1));
  float *bias = with_bias ? rand_f32((size_t)N, -1, 1) : NULL;
  float *ref = xmalloc((size_t)M * N * sizeof *ref);
  g_cpu->ops.matmul(g_cpu, ref, x, w, wdt, bias, M, N, K);

  float *dx = up(x, (size_t)M * K * 4), *dy = g_gpu->ops.alloc(g_gpu, (size_t)M * N * 4);
  REQUIRE(dy);
  void *dw = up(w, (size_t)N * K * pd_dtype_size(wdt));
  float *db = bias ? up(bias, (size_t)N * 4) : NULL;
  g_gpu->ops.matmul(g_gpu, dy, dx, dw, wdt, db, M, N, K);
  float *y = down(dy, (size_t)M * N * 4);
  double err = rel_err(y, ref, (size_t)M * N);
  /* the GEMV (f32 x) up to M = 2, cuBLAS (x rounded to the weight type) above */
  double tol = M <= 2 ? 1e-4 : (wdt == PD_DTYPE_F32 ? 5e-3 : 1.5e-2);
  CHECKF(err < tol, "matmul M=%d N=%d K=%d %s bias=%d: error %.3g (tolerance %.1g)", M, N, K,
         dtn(wdt), with_bias, err, tol);
  if (!(err < tol) || getenv("PD_TEST_VERBOSE"))
    printf("  matmul M=%d N=%d K=%d %s: %.2e\n", M, N, K, dtn(wdt), err);
  free(x);
  free(w);
  free(bias);
  free(ref);
  free(y);
  gfree(dx);
  gfree(dy);
  gfree(dw);
  if (db) gfree(db);
}

static void test_matmuls(void) {
  static const int big[][3] = {{1, 4096, 4096},   {1, 1027, 11003}, {2, 4000, 4096},
                               {3, 333, 80},      {4, 11003, 64},   {5, 4000, 4001},
                               {8, 14336, 4096},  {7, 130, 11000},  {9, 4000, 4096},
                               {33, 11003, 4000}, {300, 1024, 11003}, {4096, 256, 512},
                               {1, 128256 / 4, 4096}, {1, 1000, 16384}, {2, 2000, 8192},
                               {1, 6144, 4096}};
  static const int small[][3] = {{1, 300, 256}, {3, 77, 100}, {8, 64, 4001}, {9, 130, 96},
                                 {40, 64, 200}};
  int n = g_small ? (int)(sizeof small / sizeof small[0]) : (int)(sizeof big / sizeof big[0]);
  for (int i = 0; i < n; i++)
    for (int d = 0; d < 3; d++) {
      const int *s = g_small ? small[i] : big[i];
      test_matmul(s[0], s[1], s[2], k_dts[d], (i + d) % 2);
    }
  test_matmul(5, 17, 0, PD_DTYPE_BF16, 1); /* K = 0: y = bias */
}

/* Quantized weights (PD_DTYPE_Q4, F8W, F8WA) against the CPU backend, through each of the CUDA
 * backend's paths: the GEMV (f32 x, up to 4 rows), the tensor-core product (x in bf16; K not a
 * multiple of its 64-wide steps included) up to 192 rows (4-bit) or 64 (FP8), and above, W
 * dequantized to bf16 for cuBLAS. F8WA: x through the same FP8 quantization on both sides first (an activation whose
 * x / s lands on a rounding tie differently in the two could move the result by one e4m3 step,
 * 2^-4 of that element). */
static void test_qmatmul(int M, int N, int K, pd_dtype wdt, int with_bias) {
  float *x = rand_f32((size_t)M * K, -1, 1);
  void *w = rand_w(wdt, N, K, 1.0f / sqrtf((float)K));
  float *bias = with_bias ? rand_f32((size_t)N, -1, 1) : NULL;
  float *ref = xmalloc((size_t)M * N * sizeof *ref);
  g_cpu->ops.matmul(g_cpu, ref, x, w, wdt, bias, M, N, K);
  const size_t wb = (size_t)N * pd_dtype_row_bytes(wdt, K);
  float *dx = up(x, (size_t)M * K * 4), *dy = g_gpu->ops.alloc(g_gpu, (size_t)M * N * 4);
  REQUIRE(dy);
  void *dw = up(w, wb);
  float *db = bias ? up(bias, (size_t)N * 4) : NULL;
  g_gpu->ops.matmul(g_gpu, dy, dx, dw, wdt, db, M, N, K);
  float *y = down(dy, (size_t)M * N * 4);
  const double err = rel_err(y, ref, (size_t)M * N);
  /* f32 x up to the GEMV rows (4); above, x in bf16 (exact for F8WA's e4m3 values in the
   * tensor-core product, up to 64 rows) */
  const bool f8a = wdt == PD_DTYPE_F8WA;
  const double tol = M <= 4 ? (f8a ? 2e-3 : 1e-4) : f8a && M <= 64 ? 2e-3 : 1.5e-2;
  CHECKF(err < tol, "quantized matmul M=%d N=%d K=%d %s bias=%d: error %.3g (tolerance %.1g)", M,
         N, K, dtn(wdt), with_bias, err, tol);
  printf("  quantized matmul M=%-4d N=%-5d K=%-5d %-5s: %.2e\n", M, N, K, dtn(wdt), err);
  free(x);
  free(w);
  free(bias);
  free(ref);
  free(y);
  gfree(dx);
  gfree(dy);
  gfree(dw);
  if (db) gfree(db);
}

static void test_qmatmuls(void) {
  static const int big[][3] = {{1, 4096, 4096}, {1, 1027, 14336}, {2, 4000, 4096}, {3, 333, 96},
                               {4, 1000, 4000}, {5, 4000, 4096}, {8, 14336, 4096},
                               {7, 130, 11008}, {9, 4000, 4096}, {33, 1103, 4000},
                               {300, 1024, 2048}, {1, 6144, 4096}, {1100, 300, 1024}, {130, 520, 4000},
                               {16, 4096, 14336}, {17, 100, 544}};
  static const int small[][3] = {{1, 300, 256}, {3, 77, 96}, {8, 64, 4000}, {9, 130, 96},
                                 {40, 64, 224}, {1030, 40, 64}, {70, 40, 160}};
  static const pd_dtype qdt[3] = {PD_DTYPE_Q4, PD_DTYPE_F8W, PD_DTYPE_F8WA};
  const int n = g_small ? (int)(sizeof small / sizeof small[0]) : (int)(sizeof big / sizeof big[0]);
  for (int i = 0; i < n; i++)
    for (int d = 0; d < 3; d++) {
      const int *sh = g_small ? small[i] : big[i];
      test_qmatmul(sh[0], sh[1], sh[2], qdt[d], (i + d) % 2);
    }
}

/* ---- row ops ---------------------------------------------------------------------------------- */

static void test_norms(int M, int D) {
  float *x = rand_f32((size_t)M * D, -3, 3), *r = rand_f32((size_t)M * D, -1, 1);
  float *w = rand_f32((size_t)D, 0.5f, 1.5f);
  size_t n = (size_t)M * D;
  float *y = xmalloc(n * 4), *x2 = xmalloc(n * 4);
  float *dx = up(x, n * 4), *dr = up(r, n * 4), *dw = up(w, (size_t)D * 4);
  float *dy = g_gpu->ops.alloc(g_gpu, n * 4);
  REQUIRE(dy);
  /* rmsnorm, then in place (y aliasing x) */
  g_cpu->ops.rmsnorm(g_cpu, y, x, w, 1e-5f, M, D);
  g_gpu->ops.rmsnorm(g_gpu, dy, dx, dw, 1e-5f, M, D);
  float *gy = down(dy, n * 4);
  double e1 = rel_err(gy, y, n);
  CHECKF(e1 < 1e-5, "rmsnorm M=%d D=%d: %.3g", M, D, e1);
  free(gy);
  float *dx2 = up(x, n * 4);
  g_gpu->ops.rmsnorm(g_gpu, dx2, dx2, dw, 1e-5f, M, D);
  gy = down(dx2, n * 4);
  e1 = rel_err(gy, y, n);
  CHECKF(e1 < 1e-5, "rmsnorm in place M=%d D=%d: %.3g", M, D, e1);
  free(gy);
  /* add_rmsnorm: x += r (exact), y = rmsnorm(x) */
  memcpy(x2, x, n * 4);
  g_cpu->ops.add_rmsnorm(g_cpu, y, x2, r, w, 1e-6f, M, D);
  g_gpu->ops.add_rmsnorm(g_gpu, dy, dx, dr, dw, 1e-6f, M, D);
  gy = down(dy, n * 4);
  float *gx = down(dx, n * 4);
  e1 = rel_err(gy, y, n);
  CHECKF(e1 < 1e-5, "add_rmsnorm y M=%d D=%d: %.3g", M, D, e1);
  CHECKF(memcmp(gx, x2, n * 4) == 0, "add_rmsnorm: x += r differs M=%d D=%d", M, D);
  free(gy);
  free(gx);
  free(x);
  free(r);
  free(w);
  free(y);
  free(x2);
  gfree(dx);
  gfree(dx2);
  gfree(dr);
  gfree(dw);
  gfree(dy);
}

static void test_embed_rows_add(void) {
  const int V = 1000, M = 37;
  int32_t ids[37];
  for (int i = 0; i < M; i++) ids[i] = i == 0 ? 0 : i == 1 ? V - 1 : irand(V);
  int32_t *did = up(ids, sizeof ids);
  /* widths: whole 16-byte chunks (one pass, and several passes of the vector copy), odd */
  const int dims[] = {g_small ? 96 : 4000, g_small ? 2056 : 12296, g_small ? 97 : 4001};
  for (int di = 0; di < 3; di++)
  for (int d = 0; d < 3; d++) {
    const int D = dims[di];
    void *tab = rand_dt(k_dts[d], (size_t)V * D, -2, 2);
    void *dtab = up(tab, (size_t)V * D * pd_dtype_size(k_dts[d]));
    float *ref = xmalloc((size_t)M * D * 4);
    float *dy = g_gpu->ops.alloc(g_gpu, (size_t)M * D * 4);
    g_cpu->ops.embed(g_cpu, ref, tab, k_dts[d], ids, M, D);
    g_gpu->ops.embed(g_gpu, dy, dtab, k_dts[d], did, M, D);
    float *y = down(dy, (size_t)M * D * 4);
    CHECKF(memcmp(y, ref, (size_t)M * D * 4) == 0, "embed %s D=%d differs", dtn(k_dts[d]), D);
    free(tab);
    free(ref);
    free(y);
    gfree(dtab);
    gfree(dy);
  }
  /* get_rows: 50 rows of a [300, D] matrix, repeats allowed */
  {
    const int R = 300, n = 50, D = dims[0];
    float *x = rand_f32((size_t)R * D, -1, 1);
    int32_t idx[50];
    for (int i = 0; i < n; i++) idx[i] = irand(R);
    float *ref = xmalloc((size_t)n * D * 4);
    g_cpu->ops.get_rows(g_cpu, ref, x, idx, n, D);
    float *dx = up(x, (size_t)R * D * 4);
    int32_t *di = up(idx, sizeof idx);
    float *dy = g_gpu->ops.alloc(g_gpu, (size_t)n * D * 4);
    g_gpu->ops.get_rows(g_gpu, dy, dx, di, n, D);
    float *y = down(dy, (size_t)n * D * 4);
    CHECKF(memcmp(y, ref, (size_t)n * D * 4) == 0, "get_rows differs");
    free(x);
    free(ref);
    free(y);
    gfree(dx);
    gfree(di);
    gfree(dy);
  }
  /* add: an odd length, and an odd offset (unaligned float4 body) */
  {
    const size_t n = g_small ? 10003 : 1000003;
    float *x = rand_f32(n, -1, 1), *y = rand_f32(n, -1, 1);
    float *dx = up(x, n * 4), *dy = up(y, n * 4);
    g_gpu->ops.add(g_gpu, dy, dx, n);
    g_gpu->ops.add(g_gpu, dy + 1, dx + 1, n - 2);
    g_cpu->ops.add(g_cpu, y, x, n);
    g_cpu->ops.add(g_cpu, y + 1, x + 1, n - 2);
    float *gy = down(dy, n * 4);
    CHECKF(memcmp(gy, y, n * 4) == 0, "add differs");
    free(x);
    free(y);
    free(gy);
    gfree(dx);
    gfree(dy);
  }
  gfree(did);
}

static void test_rope_swiglu(void) {
  static const int hds[3] = {64, 80, 128};
  const int M = g_small ? 9 : 200, nq = 6, nkv = 2;
  for (int h = 0; h < 3; h++) {
    int hd = hds[h], half = hd / 2;
    float *inv = xmalloc((size_t)half * 4);
    for (int i = 0; i < half; i++) inv[i] = powf(500000.0f, -2.0f * i / hd);
    int32_t *pos = xmalloc((size_t)M * 4);
    for (int i = 0; i < M; i++) pos[i] = i < M / 2 ? i : irand(131072);
    size_t nqe = (size_t)M * nq * hd, nke = (size_t)M * nkv * hd;
    float *q = rand_f32(nqe, -2, 2), *k = rand_f32(nke, -2, 2);
    float *dq = up(q, nqe * 4), *dk = up(k, nke * 4), *dinv = up(inv, (size_t)half * 4);
    int32_t *dpos = up(pos, (size_t)M * 4);
    g_cpu->ops.rope(g_cpu, q, k, pos, inv, M, nq, nkv, hd);
    g_gpu->ops.rope(g_gpu, dq, dk, dpos, dinv, M, nq, nkv, hd);
    float *gq = down(dq, nqe * 4), *gk = down(dk, nke * 4);
    double eq = rel_err(gq, q, nqe), ek = rel_err(gk, k, nke);
    CHECKF(eq < 2e-5 && ek < 2e-5, "rope hd=%d: q %.3g k %.3g", hd, eq, ek);
    free(inv);
    free(pos);
    free(q);
    free(k);
    free(gq);
    free(gk);
    gfree(dq);
    gfree(dk);
    gfree(dinv);
    gfree(dpos);
  }
  const int F = g_small ? 1003 : 11003, Ms = 33;
  float *gu = rand_f32((size_t)Ms * 2 * F, -6, 6), *ref = xmalloc((size_t)Ms * F * 4);
  g_cpu->ops.swiglu(g_cpu, ref, gu, Ms, F);
  float *dgu = up(gu, (size_t)Ms * 2 * F * 4), *dy = g_gpu->ops.alloc(g_gpu, (size_t)Ms * F * 4);
  g_gpu->ops.swiglu(g_gpu, dy, dgu, Ms, F);
  float *y = down(dy, (size_t)Ms * F * 4);
  double e = rel_err(y, ref, (size_t)Ms * F);
  CHECKF(e < 1e-5, "swiglu: %.3g", e);
  free(gu);
  free(ref);
  free(y);
  gfree(dgu);
  gfree(dy);
}

/* ---- fused decode ops ------------------------------------------------------------------------- */

/* matmul_glu against the CPU's matmul + swiglu; rope_kv_write against the GPU's own rope +
 * kv_write (the same arithmetic, so the results must be identical bit for bit). */
static void test_fused(void) {
  static const int shapes[][3] = {{1, 1408, 4096}, {2, 1003, 2048}, {1, 77, 1003},
                                  {3, 512, 1024}, {9, 300, 512}};
  for (int si = 0; si < 5; si++)
    for (int d = 0; d < 3; d++)
      for (int wb = 0; wb < 2; wb++) {
        const int M = shapes[si][0], F = shapes[si][1], K = shapes[si][2];
        const pd_dtype wdt = k_dts[d];
        size_t nw = (size_t)2 * F * K;
        void *w = rand_dt(wdt, nw, -0.05f, 0.05f);
        float *x = rand_f32((size_t)M * K, -1, 1), *b = wb ? rand_f32((size_t)2 * F, -1, 1) : NULL;
        float *gu = xmalloc((size_t)M * 2 * F * 4), *ref = xmalloc((size_t)M * F * 4);
        g_cpu->ops.matmul(g_cpu, gu, x, w, wdt, b, M, 2 * F, K);
        g_cpu->ops.swiglu(g_cpu, ref, gu, M, F);
        void *dw = up(w, nw * pd_dtype_size(wdt));
        float *dx = up(x, (size_t)M * K * 4), *db = b ? up(b, (size_t)2 * F * 4) : NULL;
        float *dgu = g_gpu->ops.alloc(g_gpu, (size_t)M * 2 * F * 4);
        float *dact = g_gpu->ops.alloc(g_gpu, (size_t)M * F * 4);
        REQUIRE(g_gpu->ops.matmul_glu);
        g_gpu->ops.matmul_glu(g_gpu, dact, dgu, dx, dw, wdt, db, M, F, K);
        float *act = down(dact, (size_t)M * F * 4);
        double err = rel_err(act, ref, (size_t)M * F);
        /* as test_matmul: GEMV paths are f32 throughout; M > 8 rounds x for cuBLAS */
        const double tol = M <= 2 ? 2e-4 : (wdt == PD_DTYPE_F32 ? 5e-3 : 1.5e-2);
        CHECKF(err < tol, "matmul_glu M=%d F=%d K=%d %s bias=%d: %.3g", M, F, K, dtn(wdt), wb,
               err);
        free(w);
        free(x);
        free(b);
        free(gu);
        free(ref);
        free(act);
        gfree(dw);
        gfree(dx);
        if (db) gfree(db);
        gfree(dgu);
        gfree(dact);
      }

  static const int hds[3] = {64, 80, 128};
  for (int h = 0; h < 3; h++)
    for (int d = 0; d < 3; d++) {
      const int hd = hds[h], half = hd / 2, nq = 6, nkv = 2, M = 37, bs = 16, nb = 12;
      const pd_dtype dt = k_dts[d];
      const int qd = nq * hd, kd = nkv * hd, row = qd + 2 * kd;
      float *inv = xmalloc((size_t)half * 4);
      for (int i = 0; i < half; i++) inv[i] = powf(10000.0f, -2.0f * i / hd);
      int32_t pos[37], slots[37];
      for (int i = 0; i < M; i++) {
        pos[i] = irand(70000);
        slots[i] = i % 5 == 2 ? -1 : (int32_t)((i * 29 + 3) % (nb * bs));
      }
      float *qkv = rand_f32((size_t)M * row, -2, 2);
      float *q = xmalloc((size_t)M * qd * 4), *k = xmalloc((size_t)M * kd * 4),
            *v = xmalloc((size_t)M * kd * 4);
      for (int i = 0; i < M; i++) {
        memcpy(q + (size_t)i * qd, qkv + (size_t)i * row, (size_t)qd * 4);
        memcpy(k + (size_t)i * kd, qkv + (size_t)i * row + qd, (size_t)kd * 4);
        memcpy(v + (size_t)i * kd, qkv + (size_t)i * row + qd + kd, (size_t)kd * 4);
      }
      pd_kv_shape sh = {nb, bs, nkv, hd, dt};
      size_t cb = (size_t)nb * nkv * bs * hd * pd_dtype_size(dt);
      void *cache = rand_dt(dt, (size_t)nb * nkv * bs * hd, -1, 1);
      pd_kv_layer a = {up(cache, cb), up(cache, cb), 1, 1}, f = {up(cache, cb), up(cache, cb), 1, 1};
      float *dq = up(q, (size_t)M * qd * 4), *dk = up(k, (size_t)M * kd * 4),
            *dv = up(v, (size_t)M * kd * 4), *dqkv = up(qkv, (size_t)M * row * 4),
            *dinv = up(inv, (size_t)half * 4);
      float *dqo = g_gpu->ops.alloc(g_gpu, (size_t)M * qd * 4);
      int32_t *dpos = up(pos, sizeof pos), *dsl = up(slots, sizeof slots);
      g_gpu->ops.rope(g_gpu, dq, dk, dpos, dinv, M, nq, nkv, hd);
      g_gpu->ops.kv_write(g_gpu, &a, &sh, dk, dv, dsl, M);
      REQUIRE(g_gpu->ops.rope_kv_write);
      g_gpu->ops.rope_kv_write(g_gpu, dqo, dqkv, dpos, dinv, &f, &sh, dsl, M, nq);
      float *q1 = down(dq, (size_t)M * qd * 4), *q2 = down(dqo, (size_t)M * qd * 4);
      void *k1 = down(a.k, cb), *k2 = down(f.k, cb), *v1 = down(a.v, cb), *v2 = down(f.v, cb);
      CHECKF(memcmp(q1, q2, (size_t)M * qd * 4) == 0 && memcmp(k1, k2, cb) == 0 &&
                 memcmp(v1, v2, cb) == 0,
             "rope_kv_write hd=%d %s differs from rope + kv_write", hd, dtn(dt));
      free(inv);
      free(qkv);
      free(q);
      free(k);
      free(v);
      free(cache);
      free(q1);
      free(q2);
      free(k1);
      free(k2);
      free(v1);
      free(v2);
      gfree(a.k);
      gfree(a.v);
      gfree(f.k);
      gfree(f.v);
      gfree(dq);
      gfree(dk);
      gfree(dv);
      gfree(dqkv);
      gfree(dinv);
      gfree(dqo);
      gfree(dpos);
      gfree(dsl);
    }
}

/* ---- KV cache write --------------------------------------------------------------------------- */

static void test_kv_write(int bs, pd_dtype dt) {
  const int nb = 40, nkv = 2, hd = 80, M = 100;
  pd_kv_shape sh = {nb, bs, nkv, hd, dt};
  size_t ce = (size_t)nb * nkv * bs * hd, cb = ce * pd_dtype_size(dt);
  void *kc = rand_dt(dt, ce, -1, 1), *vc = rand_dt(dt, ce, -1, 1);
  float *k = rand_f32((size_t)M * nkv * hd, -3, 3), *v = rand_f32((size_t)M * nkv * hd, -3, 3);
  int32_t slots[100];
  for (int i = 0; i < M; i++) slots[i] = i % 7 == 3 ? -1 : (int32_t)((i * 37 + 5) % (nb * bs));
  pd_kv_layer dl = {up(kc, cb), up(vc, cb), 1, 1}, hl = {kc, vc, 1, 1};
  float *dk = up(k, (size_t)M * nkv * hd * 4), *dv = up(v, (size_t)M * nkv * hd * 4);
  int32_t *ds = up(slots, sizeof slots);
  g_cpu->ops.kv_write(g_cpu, &hl, &sh, k, v, slots, M);
  g_gpu->ops.kv_write(g_gpu, &dl, &sh, dk, dv, ds, M);
  void *gk = down(dl.k, cb), *gv = down(dl.v, cb);
  CHECKF(memcmp(gk, kc, cb) == 0 && memcmp(gv, vc, cb) == 0, "kv_write bs=%d %s differs", bs,
         dtn(dt));
  free(kc);
  free(vc);
  free(k);
  free(v);
  free(gk);
  free(gv);
  gfree(dl.k);
  gfree(dl.v);
  gfree(dk);
  gfree(dv);
  gfree(ds);
}

/* ---- attention -------------------------------------------------------------------------------- */

typedef struct attn_case {
  const char *name;
  int n_seqs;
  const int *n_new, *ctx; /* per sequence */
  int nq, nkv, hd, bs;
  pd_dtype dt;
  int window;
  double tol;
} attn_case;

/* Builds a paged cache whose blocks are handed out in shuffled order, fills the owned slots with
 * random values and everything else (tails, unused blocks, the unused block-table columns' block)
 * with NaN, runs attention on both backends and compares. */
static void run_attn(const attn_case *c) {
  const int S = c->n_seqs, bs = c->bs;
  int T = 0, max_ctx = 0, max_blocks = 1, used = 0;
  for (int s = 0; s < S; s++) {
    T += c->n_new[s];
    if (c->ctx[s] > max_ctx) max_ctx = c->ctx[s];
    int nb = (c->ctx[s] + bs - 1) / bs;
    if (nb > max_blocks) max_blocks = nb;
    used += nb;
  }
  max_blocks += 1; /* a spare column: never read */
  const int num_blocks = used + 5, poison = used + 2;
  int32_t *perm = xmalloc((size_t)num_blocks * 4);
  for (int i = 0; i < num_blocks; i++) perm[i] = i;
  for (int i = num_blocks - 1; i > 0; i--) {
    int j = irand(i + 1);
    int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  /* the poison block must stay out of the tables: swap it to the end of the permutation */
  for (int i = 0; i < num_blocks; i++)
    if (perm[i] == poison) {
      perm[i] = perm[num_blocks - 1];
      perm[num_blocks - 1] = poison;
    }
  int32_t *bt = xmalloc((size_t)S * max_blocks * 4), *qs = xmalloc((size_t)(S + 1) * 4);
  int next = 0;
  qs[0] = 0;
  for (int s = 0; s < S; s++) {
    int nb = (c->ctx[s] + bs - 1) / bs;
    for (int j = 0; j < max_blocks; j++) bt[(size_t)s * max_blocks + j] = j < nb ? perm[next++] : poison;
    qs[s + 1] = qs[s] + c->n_new[s];
  }
  const size_t ce = (size_t)num_blocks * c->nkv * bs * c->hd, esz = pd_dtype_size(c->dt);
  void *kc = rand_dt(c->dt, ce, -1, 1), *vc = rand_dt(c->dt, ce, -1, 1);
  /* NaN everywhere no sequence owns */
  char *owned = calloc((size_t)num_blocks * bs, 1);
  REQUIRE(owned);
  for (int s = 0; s < S; s++)
    for (int t = 0; t < c->ctx[s]; t++) owned[(size_t)bt[(size_t)s * max_blocks + t / bs] * bs + t % bs] = 1;
  for (int b = 0; b < num_blocks; b++)
    for (int g = 0; g < c->nkv; g++)
      for (int o = 0; o < bs; o++)
        if (!owned[(size_t)b * bs + o])
          for (int d = 0; d < c->hd; d++) {
            size_t i = (((size_t)b * c->nkv + g) * bs + o) * c->hd + d;
            set_nan(kc, c->dt, i);
            set_nan(vc, c->dt, i);
          }
  const size_t qn = (size_t)T * c->nq * c->hd;
  float *q = rand_f32(qn, -2, 2), *ref = xmalloc(qn * 4);
  pd_kv_shape sh = {num_blocks, bs, c->nkv, c->hd, c->dt};
  pd_kv_layer hl = {kc, vc, 1, 1};
  pd_attn_batch hb = {S, T, qs, c->ctx, bt, max_blocks, max_ctx};
  const float scale = 1.0f / sqrtf((float)c->hd);
  g_cpu->ops.attention(g_cpu, ref, q, &hl, &sh, &hb, c->nq, scale, c->window);

  pd_kv_layer dl = {up(kc, ce * esz), up(vc, ce * esz), 1, 1};
  int32_t *dqs = up(qs, (size_t)(S + 1) * 4), *dctx = up(c->ctx, (size_t)S * 4);
  int32_t *dbt = up(bt, (size_t)S * max_blocks * 4);
  float *dq = up(q, qn * 4), *dout = g_gpu->ops.alloc(g_gpu, qn * 4);
  pd_attn_batch db = {S, T, dqs, dctx, dbt, max_blocks, max_ctx};
  g_gpu->ops.attention(g_gpu, dout, dq, &dl, &sh, &db, c->nq, scale, c->window);
  float *out = down(dout, qn * 4);
  double err = rel_err(out, ref, qn);
  CHECKF(err < c->tol, "attention %s (seqs %d, tokens %d, heads %d/%d, hd %d, bs %d, %s, window %d): "
         "error %.3g (tolerance %.1g)", c->name, S, T, c->nq, c->nkv, c->hd, bs, dtn(c->dt),
         c->window, err, c->tol);
  printf("  attention %-22s seqs %4d tokens %5d heads %2d/%d hd %3d bs %2d %-4s window %4d: %.2e\n",
         c->name, S, T, c->nq, c->nkv, c->hd, bs, dtn(c->dt), c->window, err);
  free(perm);
  free(bt);
  free(qs);
  free(kc);
  free(vc);
  free(owned);
  free(q);
  free(ref);
  free(out);
  gfree(dl.k);
  gfree(dl.v);
  gfree(dqs);
  gfree(dctx);
  gfree(dbt);
  gfree(dq);
  gfree(dout);
}

static void test_attention(void) {
  enum { MAXS = 256 };
  static int n_new[MAXS], ctx[MAXS];
  const double tol_f32 = 1e-4, tol_tc = 1.5e-2;
  const int scale = g_small ? 8 : 1; /* contexts shrink by this in small mode */

  /* decode: ragged contexts (one of 1 token, one past 4096), every head layout and dtype */
  /* 16-bit caches run on the tensor-core kernel (bf16 / f16 Q and P: tol_tc) up to 16 heads a
   * group; F32 caches and the 20-head group run on the SIMT kernel (f32 math). */
  static const int layouts[][3] = {{32, 8, 128}, {6, 2, 64},   {8, 8, 80},
                                   {16, 2, 64},  {24, 2, 128}, {40, 2, 64}};
  int S = g_small ? 9 : 37;
  for (int s = 0; s < S; s++) {
    n_new[s] = 1;
    ctx[s] = s == 0 ? 1 : s == 1 ? 4200 / scale : 1 + irand(3000 / scale);
  }
  for (int l = 0; l < 6; l++)
    for (int d = 0; d < 3; d++) {
      const bool tc = k_dts[d] != PD_DTYPE_F32 && layouts[l][0] / layouts[l][1] <= 16;
      attn_case c = {"decode", S, n_new, ctx, layouts[l][0], layouts[l][1], layouts[l][2],
                     (l + d) % 2 ? 32 : 16, k_dts[d], 0, tc ? tol_tc : tol_f32};
      run_attn(&c);
      if (d == 2) {
        c.window = 500 / scale;
        c.name = "decode window";
        run_attn(&c);
      }
    }
  /* pages of a size that is not a power of two (the kernels divide instead of shifting), tiles
   * of 64 keys that start inside a page: three layouts on the tensor-core kernel, an f32 cache
   * and a 20-head group on the SIMT kernel */
  for (int l = 0; l < 5; l++) {
    static const int pl[] = {0, 1, 2, 0, 5};
    const int L = pl[l];
    const pd_dtype dt = l == 1 ? PD_DTYPE_F16 : l == 3 ? PD_DTYPE_F32 : PD_DTYPE_BF16;
    attn_case c = {"decode pages of 12", S, n_new, ctx, layouts[L][0], layouts[L][1],
                   layouts[L][2], 12, dt, 0, l >= 3 ? tol_f32 : tol_tc};
    run_attn(&c);
  }
  /* power-of-two pages other than 16 and 32: on Hopper the tensor-core kernel's tiles come by
   * tensor-map copies in boxes of min(page, 64) rows (8 boxes a 64-key tile, one, and a tile
   * inside a page), the rows past each context NaN */
  for (int l = 0; l < 6; l++) {
    static const int pbs[] = {8, 64, 128};
    const int L = l % 2 ? 1 : 0;
    attn_case c = {"decode pages of 8 / 64 / 128", S, n_new, ctx, layouts[L][0], layouts[L][1],
                   layouts[L][2], pbs[l / 2], l % 2 ? PD_DTYPE_F16 : PD_DTYPE_BF16, 0, tol_tc};
    run_attn(&c);
  }
  /* groups of 1, 2, 5 and 7 heads (Qwen2-7B's): on Hopper the keys-as-M kernel (at most 8 heads a
   * group, N = 8 of which G are real), its softmax lanes half padding */
  for (int l = 0; l < 4; l++) {
    static const int gl[][3] = {{4, 4, 128}, {4, 2, 64}, {10, 2, 128}, {28, 4, 128}};
    attn_case c = {"decode groups 1/2/5/7", S, n_new, ctx, gl[l][0], gl[l][1], gl[l][2],
                   l % 2 ? 32 : 16, l % 2 ? PD_DTYPE_F16 : PD_DTYPE_BF16, 0, tol_tc};
    run_attn(&c);
  }
  /* many short decodes (no split) */
  S = g_small ? 40 : 200;
  for (int s = 0; s < S; s++) {
    n_new[s] = 1;
    ctx[s] = 1 + irand(100);
  }
  {
    attn_case c = {"decode many", S, n_new, ctx, 8, 2, 128, 16, PD_DTYPE_BF16, 0, tol_tc};
    run_attn(&c);
  }

  /* many sequences (2048 and 512 (sequence, KV head) blocks, more than an H200 holds at once:
   * the shape of a 256-sequence decode step), ragged contexts, one of 1 token */
  S = MAXS;
  for (int s = 0; s < S; s++) {
    n_new[s] = 1;
    ctx[s] = s == 7 ? 1 : 1 + irand(1500 / scale);
  }
  for (int l = 0; l < 2; l++) {
    static const int ml[][3] = {{32, 8, 128}, {16, 2, 64}};
    attn_case c = {"decode many units", S, n_new, ctx, ml[l][0], ml[l][1], ml[l][2],
                   l ? 32 : 16, l ? PD_DTYPE_F16 : PD_DTYPE_BF16, 0, tol_tc};
    run_attn(&c);
  }

  /* few sequences (batch-1 decode): 64-key splits; on Hopper up to 8 of them merge inside a
   * thread-block cluster, more go through the merge kernel. Contexts at and around those limits,
   * with empty splits (a 1-token sequence next to a 512-token one). */
  {
    static const int few[][2] = {{300, 0}, {512, 1}, {513, 70}, {64, 65}, {129, 0}};
    for (int f = 0; f < 5; f++) {
      const int nf = few[f][1] ? 2 : 1;
      for (int s = 0; s < nf; s++) {
        n_new[s] = 1;
        ctx[s] = few[f][s];
      }
      for (int l = 0; l < 3; l++) {
        static const int fl[][3] = {{32, 8, 128}, {8, 8, 80}, {24, 2, 64}};
        attn_case c = {"decode few", nf, n_new, ctx, fl[l][0], fl[l][1], fl[l][2], 16,
                       l == 1 ? PD_DTYPE_F16 : PD_DTYPE_BF16, 0, tol_tc};
        run_attn(&c);
      }
    }
  }

  /* mixed prefill: whole prompts, chunks over a cached prefix, decodes in the same batch */
  static const int mix_new[] = {1, 700, 37, 1, 130, 64, 3, 255};
  static const int mix_ctx[] = {1, 700, 1200, 513, 130, 80, 900, 256};
  S = 8;
  for (int s = 0; s < S; s++) {
    n_new[s] = g_small ? (mix_new[s] + 7) / 8 : mix_new[s];
    ctx[s] = g_small ? (mix_ctx[s] + 7) / 8 : mix_ctx[s];
    if (ctx[s] < n_new[s]) ctx[s] = n_new[s];
  }
  for (int l = 0; l < 5; l++)
    for (int d = 0; d < 3; d++) {
      attn_case c = {"prefill mixed", S, n_new, ctx, layouts[l][0], layouts[l][1],
                     layouts[l][2], (l + d) % 2 ? 16 : 32, k_dts[d], 0, tol_tc};
      run_attn(&c);
      if (d == 0) {
        c.window = 100 / (g_small ? 4 : 1);
        c.name = "prefill window";
        run_attn(&c);
      }
    }
  /* a short chunk on a long prefix: few tiles, so the prefill kernel splits the context */
  n_new[0] = 16;
  ctx[0] = 6000 / scale;
  n_new[1] = 1;
  ctx[1] = 3000 / scale;
  for (int d = 0; d < 3; d++) {
    attn_case c = {"prefill long prefix", 2, n_new, ctx, 32, 8, 128, 16, k_dts[d], 0, tol_tc};
    run_attn(&c);
  }
  /* 128-row tiles (head dim 128, sequences bringing 128 query rows or more each on average over
   * contexts of 2048 or more: pd_cuda_attn_prefill_bm): short chunks and single decode rows
   * among them, whose tiles are mostly past their rows' ends, and the causal diagonal inside a
   * tile; the same sizes in small mode */
  static const int bm_new[] = {1, 40, 100, 300, 7};
  static const int bm_ctx[] = {2100, 2048, 2500, 300, 2055};
  for (int s = 0; s < 5; s++) {
    n_new[s] = bm_new[s];
    ctx[s] = bm_ctx[s];
  }
  for (int d = 0; d < 3; d++) {
    attn_case c = {"prefill 128-row tiles", 5, n_new, ctx, 32, 8, 128, 16, k_dts[d], 0, tol_tc};
    run_attn(&c);
    if (d == 0) {
      c.window = 700;
      c.name = "prefill 128-row tiles window";
      run_attn(&c);
    }
  }
  /* one long prompt */
  if (!g_small) {
    n_new[0] = ctx[0] = 4096;
    attn_case c = {"prefill 4096", 1, n_new, ctx, 8, 2, 128, 16, PD_DTYPE_BF16, 0, tol_tc};
    run_attn(&c);
    c.window = 1000;
    c.name = "prefill 4096 window";
    run_attn(&c);
  }
  /* untuned head dims: the generic kernel (f32 math) */
  static const int gen_new[] = {1, 40, 1, 9};
  static const int gen_ctx[] = {300, 40, 1, 100};
  for (int h = 0; h < 2; h++)
    for (int d = 0; d < 3; d++) {
      attn_case c = {"generic head dim", 4, gen_new, gen_ctx, 6, 2, h ? 96 : 32, 16, k_dts[d],
                     d == 1 ? 30 : 0, tol_f32};
      run_attn(&c);
    }
}

/* ---- the layer ops ------------------------------------------------------------------------------
 * The GPU's layer ops (backend.h) against the CPU backend's (its primitives composed), as the
 * engine chains them: embed_norm -> qkv_attention -> linear (o: residual + norm) -> linear (GLU)
 * -> linear (down: residual + norm) -> linear (LM head), and the prefill ending (get_rows, norm,
 * LM head). Each backend runs its own chain; compared after every op: the residual rows, the acts
 * (through act_read), the KV cache and the logits. Decode batches of 1 and 2 sequences (GEMV acts
 * with the norm pending), 3 and 256 (16-bit acts for cuBLAS), a long-context decode (the
 * attention in splits: RoPE and cache writes as a kernel before it) and a prefill batch, for f32,
 * f16 and bf16 weights and head dims 64, 80 and 128. */
typedef struct lo_bufs {
  pd_backend *be;
  void *table, *wqkv, *wo, *wgu, *wdown, *head;
  float *attn_norm, *ffn_norm, *next_norm, *final_norm, *bqkv, *bo, *bgu, *bdown, *inv;
  int32_t *ids, *pos, *slots, *qs, *ctx, *bt, *rows;
  pd_kv_layer kv;
  float *x, *qkv, *q, *scratch, *logits, *sel;
  pd_act act[2];
} lo_bufs;

typedef struct lo_snap {
  float *x0, *a0, *h_attn, *x1, *a1, *h_glu, *x2, *a2, *logits, *rows_logits;
  void *kc, *vc;
} lo_snap;

static void *lo_put(pd_backend *be, const void *h, size_t bytes) {
  void *d = be->ops.alloc(be, bytes ? bytes : 1);
  REQUIRE(d);
  if (bytes) be->ops.to_device(be, d, h, bytes);
  return d;
}
static float *lo_get(pd_backend *be, const void *d, size_t n) {
  float *h = xmalloc(n * sizeof(float));
  be->ops.to_host(be, h, d, n * sizeof(float));
  return h;
}
static float *lo_act(pd_backend *be, const pd_act *a) {
  float *h = xmalloc((size_t)a->M * a->K * sizeof(float) + 4);
  be->ops.act_read(be, h, a);
  return h;
}

static void run_layer_case(const char *name, int S, const int *n_new, const int *ctx, int nq,
                           int nkv, int hd, pd_dtype wdt, pd_dtype kvdt, bool bias) {
  const int D = 256, F = 320, V = 300, bs = 16, qd = nq * hd, kd = nkv * hd, N = qd + 2 * kd;
  int M = 0, max_ctx = 0, mb = 1, nb = 0;
  for (int s = 0; s < S; s++) {
    M += n_new[s];
    if (ctx[s] > max_ctx) max_ctx = ctx[s];
    const int b = (ctx[s] + bs - 1) / bs;
    if (b > mb) mb = b;
    nb += b;
  }
  nb += 1;
  /* host inputs */
  const size_t es = pd_dtype_size(wdt);
  const pd_dtype ldt = g_lin_dt >= 0 ? (pd_dtype)g_lin_dt : wdt; /* the linears' */
  void *table = rand_dt(wdt, (size_t)V * D, -1, 1);
  void *wqkv = rand_w(ldt, N, D, 0.08f), *wo = rand_w(ldt, D, qd, 0.08f);
  void *wgu = rand_w(ldt, 2 * F, D, 0.08f), *wdown = rand_w(ldt, D, F, 0.08f);
  void *head = rand_dt(wdt, (size_t)V * D, -0.08f, 0.08f);
  float *an = rand_f32(D, 0.5f, 1.5f), *fn = rand_f32(D, 0.5f, 1.5f), *nn = rand_f32(D, 0.5f, 1.5f);
  float *finn = rand_f32(D, 0.5f, 1.5f);
  float *bqkv = rand_f32(N, -0.1f, 0.1f), *bo = rand_f32(D, -0.1f, 0.1f);
  float *bgu = rand_f32(2 * F, -0.1f, 0.1f), *bdown = rand_f32(D, -0.1f, 0.1f);
  float *inv = xmalloc((size_t)hd / 2 * 4);
  for (int i = 0; i < hd / 2; i++) inv[i] = powf(500000.0f, -2.0f * i / hd);
  int32_t *ids = xmalloc((size_t)M * 4), *pos = xmalloc((size_t)M * 4), *slots = xmalloc((size_t)M * 4);
  int32_t *qs = xmalloc((size_t)(S + 1) * 4), *bt = xmalloc((size_t)S * mb * 4);
  int32_t rows[2] = {M - 1, 0};
  const int n_rows = M > 1 ? 2 : 1;
  int next = 0, t = 0;
  qs[0] = 0;
  for (int s = 0; s < S; s++) {
    for (int j = 0; j < mb; j++)
      bt[(size_t)s * mb + j] = j < (ctx[s] + bs - 1) / bs ? (next++ + 5) % (nb - 1) : nb - 1;
    for (int i = 0; i < n_new[s]; i++, t++) {
      ids[t] = irand(V);
      pos[t] = ctx[s] - n_new[s] + i;
      slots[t] = bt[(size_t)s * mb + pos[t] / bs] * bs + pos[t] % bs;
    }
    qs[s + 1] = t;
  }
  const size_t ce = (size_t)nb * nkv * bs * hd, cb = ce * pd_dtype_size(kvdt);
  void *kc = rand_dt(kvdt, ce, -1, 1), *vc = rand_dt(kvdt, ce, -1, 1);
  const pd_kv_shape sh = {nb, bs, nkv, hd, kvdt};
  int kmax = D > F ? D : F;
  if (qd > kmax) kmax = qd;
  const float eps = 1e-5f, scale = 1.0f / sqrtf((float)hd);
  lo_snap snap[2];
  for (int side = 0; side < 2; side++) {
    pd_backend *be = side ? g_gpu : g_cpu;
    lo_bufs b = {.be = be};
    b.table = lo_put(be, table, (size_t)V * D * es);
    b.wqkv = lo_put(be, wqkv, (size_t)N * pd_dtype_row_bytes(ldt, D));
    b.wo = lo_put(be, wo, (size_t)D * pd_dtype_row_bytes(ldt, qd));
    b.wgu = lo_put(be, wgu, (size_t)2 * F * pd_dtype_row_bytes(ldt, D));
    b.wdown = lo_put(be, wdown, (size_t)D * pd_dtype_row_bytes(ldt, F));
    b.head = lo_put(be, head, (size_t)V * D * es);
    b.attn_norm = lo_put(be, an, D * 4);
    b.ffn_norm = lo_put(be, fn, D * 4);
    b.next_norm = lo_put(be, nn, D * 4);
    b.final_norm = lo_put(be, finn, D * 4);
    b.bqkv = bias ? lo_put(be, bqkv, (size_t)N * 4) : NULL;
    b.bo = bias ? lo_put(be, bo, D * 4) : NULL;
    b.bgu = bias ? lo_put(be, bgu, (size_t)2 * F * 4) : NULL;
    b.bdown = bias ? lo_put(be, bdown, D * 4) : NULL;
    b.inv = lo_put(be, inv, (size_t)hd / 2 * 4);
    b.ids = lo_put(be, ids, (size_t)M * 4);
    b.pos = lo_put(be, pos, (size_t)M * 4);
    b.slots = lo_put(be, slots, (size_t)M * 4);
    b.qs = lo_put(be, qs, (size_t)(S + 1) * 4);
    b.ctx = lo_put(be, ctx, (size_t)S * 4);
    b.bt = lo_put(be, bt, (size_t)S * mb * 4);
    b.rows = lo_put(be, rows, sizeof rows);
    b.kv.k = lo_put(be, kc, cb);
    b.kv.v = lo_put(be, vc, cb);
    b.x = be->ops.alloc(be, (size_t)M * D * 4);
    b.qkv = be->ops.alloc(be, (size_t)M * N * 4);
    b.q = be->ops.alloc(be, (size_t)M * qd * 4);
    b.scratch = be->ops.alloc(be, (size_t)M * 2 * F * 4);
    b.logits = be->ops.alloc(be, (size_t)M * V * 4);
    b.sel = be->ops.alloc(be, (size_t)M * D * 4);
    REQUIRE(b.x && b.qkv && b.q && b.scratch && b.logits && b.sel);
    for (int i = 0; i < 2; i++) REQUIRE((b.act[i].data = be->ops.alloc(be, be->ops.act_bytes(be, M, kmax))));
    pd_act *a = &b.act[0], *h = &b.act[1];
    lo_snap *sn = &snap[side];
    const pd_wdesc Wqkv = {ldt, b.wqkv, N, D}, Wo = {ldt, b.wo, D, qd}, Wgu = {ldt, b.wgu, 2 * F, D},
                   Wdown = {ldt, b.wdown, D, F}, Whead = {wdt, b.head, V, D};
    be->ops.embed_norm(be, b.x, a, b.table, wdt, b.ids, M, D, b.attn_norm, eps, ldt);
    sn->x0 = lo_get(be, b.x, (size_t)M * D);
    sn->a0 = lo_act(be, a);
    const pd_attn_batch ab = {S, M, b.qs, b.ctx, b.bt, mb, max_ctx};
    const pd_qkv_attn at = {.in = a, .w = Wqkv, .bias = b.bqkv, .pos = b.pos, .inv_freq = b.inv,
                            .kv = &b.kv, .shape = &sh, .slots = b.slots, .batch = &ab,
                            .n_q_heads = nq, .scale = scale, .out = h, .out_wdtype = ldt,
                            .qkv = b.qkv, .q = b.q};
    be->ops.qkv_attention(be, &at);
    sn->h_attn = lo_act(be, h);
    sn->kc = xmalloc(cb);
    sn->vc = xmalloc(cb);
    be->ops.to_host(be, sn->kc, b.kv.k, cb);
    be->ops.to_host(be, sn->vc, b.kv.v, cb);
    const pd_linear o = {.in = h, .w = Wo, .bias = b.bo, .epilogue = PD_LIN_RESIDUAL, .y = b.x,
                         .out = a, .norm_w = b.ffn_norm, .eps = eps, .out_wdtype = ldt,
                         .scratch = b.scratch};
    be->ops.linear(be, &o);
    sn->x1 = lo_get(be, b.x, (size_t)M * D);
    sn->a1 = lo_act(be, a);
    const pd_linear gu = {.in = a, .w = Wgu, .bias = b.bgu, .epilogue = PD_LIN_GLU, .out = h,
                          .out_wdtype = ldt, .scratch = b.scratch};
    be->ops.linear(be, &gu);
    sn->h_glu = lo_act(be, h);
    const pd_linear dn = {.in = h, .w = Wdown, .bias = b.bdown, .epilogue = PD_LIN_RESIDUAL,
                          .y = b.x, .out = a, .norm_w = b.next_norm, .eps = eps,
                          .out_wdtype = wdt, .scratch = b.scratch};
    be->ops.linear(be, &dn);
    sn->x2 = lo_get(be, b.x, (size_t)M * D);
    sn->a2 = lo_act(be, a);
    const pd_linear hd_all = {.in = a, .w = Whead, .epilogue = PD_LIN_STORE, .y = b.logits,
                              .scratch = b.scratch};
    be->ops.linear(be, &hd_all);
    sn->logits = lo_get(be, b.logits, (size_t)M * V);
    /* the prefill ending: a residual without a norm, the chosen rows, their norm, the head */
    const pd_linear dn2 = {.in = h, .w = Wdown, .bias = b.bdown, .epilogue = PD_LIN_RESIDUAL,
                           .y = b.x, .scratch = b.scratch};
    be->ops.linear(be, &dn2);
    be->ops.get_rows(be, b.sel, b.x, b.rows, n_rows, D);
    be->ops.norm(be, a, b.sel, b.final_norm, eps, n_rows, D, wdt);
    const pd_linear hd_rows = {.in = a, .w = Whead, .epilogue = PD_LIN_STORE, .y = b.logits,
                               .scratch = b.scratch};
    be->ops.linear(be, &hd_rows);
    sn->rows_logits = lo_get(be, b.logits, (size_t)n_rows * V);
    be->ops.sync(be);
    void *all[] = {b.table, b.wqkv, b.wo, b.wgu, b.wdown, b.head, b.attn_norm, b.ffn_norm,
                   b.next_norm, b.final_norm, b.bqkv, b.bo, b.bgu, b.bdown, b.inv, b.ids, b.pos,
                   b.slots, b.qs, b.ctx, b.bt, b.rows, b.kv.k, b.kv.v, b.x, b.qkv, b.q,
                   b.scratch, b.logits, b.sel, b.act[0].data, b.act[1].data};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
      if (all[i]) be->ops.free(be, all[i]);
  }
  /* 16-bit operands round what f32 keeps; f32 weights: cuBLAS in TF32, 16-bit caches */
  const double tol = wdt == PD_DTYPE_F32 ? 1e-2 : 3e-2; /* (the caches are 16-bit) */
  struct {
    const char *what;
    float *g, *c;
    size_t n;
  } cmp[] = {{"embed rows", snap[1].x0, snap[0].x0, (size_t)M * D},
             {"embed norm", snap[1].a0, snap[0].a0, (size_t)M * D},
             {"attention", snap[1].h_attn, snap[0].h_attn, (size_t)M * qd},
             {"o residual", snap[1].x1, snap[0].x1, (size_t)M * D},
             {"o norm", snap[1].a1, snap[0].a1, (size_t)M * D},
             {"glu", snap[1].h_glu, snap[0].h_glu, (size_t)M * F},
             {"down residual", snap[1].x2, snap[0].x2, (size_t)M * D},
             {"down norm", snap[1].a2, snap[0].a2, (size_t)M * D},
             {"head", snap[1].logits, snap[0].logits, (size_t)M * V},
             {"rows head", snap[1].rows_logits, snap[0].rows_logits, (size_t)n_rows * V}};
  double worst = 0;
  for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++) {
    const double err = rel_err(cmp[i].g, cmp[i].c, cmp[i].n);
    CHECKF(err < tol, "layer ops %s (M %d, seqs %d, heads %d/%d, hd %d, %s, linears %s, bias %d): "
           "%s error %.3g (tolerance %.1g)", name, M, S, nq, nkv, hd, dtn(wdt), dtn(ldt), bias,
           cmp[i].what, err, tol);
    if (err > worst) worst = err;
    free(cmp[i].g);
    free(cmp[i].c);
  }
  /* the cache: the rows written, converted to f32 */
  float *k0 = xmalloc(ce * 4), *k1 = xmalloc(ce * 4), *v0 = xmalloc(ce * 4), *v1 = xmalloc(ce * 4);
  pd_convert_to_f32(k0, snap[0].kc, kvdt, ce);
  pd_convert_to_f32(k1, snap[1].kc, kvdt, ce);
  pd_convert_to_f32(v0, snap[0].vc, kvdt, ce);
  pd_convert_to_f32(v1, snap[1].vc, kvdt, ce);
  const double ek = rel_err(k1, k0, ce), ev = rel_err(v1, v0, ce);
  CHECKF(ek < tol && ev < tol, "layer ops %s (M %d, hd %d, %s): cache error k %.3g v %.3g", name,
         M, hd, dtn(wdt), ek, ev);
  printf("  layer ops %-14s M %4d seqs %3d heads %2d/%d hd %3d %-4s linears %-5s bias %d: worst "
         "%.2e, cache %.2e / %.2e\n", name, M, S, nq, nkv, hd, dtn(wdt), dtn(ldt), bias, worst, ek,
         ev);
  for (int i = 0; i < 2; i++) {
    free(snap[i].kc);
    free(snap[i].vc);
  }
  free(k0);
  free(k1);
  free(v0);
  free(v1);
  free(table);
  free(wqkv);
  free(wo);
  free(wgu);
  free(wdown);
  free(head);
  free(an);
  free(fn);
  free(nn);
  free(finn);
  free(bqkv);
  free(bo);
  free(bgu);
  free(bdown);
  free(inv);
  free(ids);
  free(pos);
  free(slots);
  free(qs);
  free(bt);
  free(kc);
  free(vc);
}

static void test_layer_ops(void) {
  static int n1[256], ctx[256];
  static const int lay[][3] = {{8, 2, 64}, {4, 2, 80}, {4, 1, 128}};
  const int decode_sizes[] = {1, 2, 3, 256};
  for (int d = 0; d < 3; d++)
    for (int si = 0; si < 4; si++) {
      const int S = decode_sizes[si], l = (d + si) % 3;
      for (int s = 0; s < S; s++) {
        n1[s] = 1;
        ctx[s] = 1 + irand(g_small ? 100 : 300);
      }
      run_layer_case("decode", S, n1, ctx, lay[l][0], lay[l][1], lay[l][2], k_dts[d],
                     d == 1 ? PD_DTYPE_F16 : PD_DTYPE_BF16, (si & 1) == 0);
    }
  /* long contexts: few sequences, the attention in splits */
  for (int d = 1; d < 3; d++) {
    for (int s = 0; s < 3; s++) {
      n1[s] = 1;
      ctx[s] = 1500 + irand(600);
    }
    run_layer_case("decode long", 3, n1, ctx, 4, 1, 128, k_dts[d], PD_DTYPE_BF16, true);
  }
  /* prefill: chunks over cached prefixes and a decode row in one batch */
  static const int pn[] = {40, 1, 17, 70}, pc[] = {40, 300, 120, 90};
  for (int d = 0; d < 3; d++)
    for (int l = 0; l < 3; l++)
      run_layer_case("prefill", 4, pn, pc, lay[l][0], lay[l][1], lay[l][2], k_dts[d],
                     PD_DTYPE_BF16, d == 2);
  /* quantized linears (bf16 embedding and head): decode GEMVs, cuBLAS on dequantized W */
  static const pd_dtype qdt[3] = {PD_DTYPE_Q4, PD_DTYPE_F8W, PD_DTYPE_F8WA};
  for (int q = 0; q < 3; q++) {
    g_lin_dt = (int)qdt[q];
    for (int si = 0; si < 4; si++) {
      const int S = decode_sizes[si], l = (q + si) % 3;
      for (int s = 0; s < S; s++) {
        n1[s] = 1;
        ctx[s] = 1 + irand(g_small ? 100 : 300);
      }
      run_layer_case("decode", S, n1, ctx, lay[l][0], lay[l][1], lay[l][2], PD_DTYPE_BF16,
                     PD_DTYPE_BF16, (si & 1) == 0);
    }
    run_layer_case("prefill", 4, pn, pc, lay[q][0], lay[q][1], lay[q][2], PD_DTYPE_BF16,
                   PD_DTYPE_BF16, q == 1);
  }
  g_lin_dt = -1;
}

/* No device memory for an op's scratch (a batch larger than any before, with the GPU full): the
 * op fails recoverably, not fatally: take_error reports PD_ENOMEM once, the ops queued after it do
 * nothing until then, the backend's status stays OK, and once memory is free again the same op
 * gives the right result. A backend of its own (its scratch at the initial sizes). */
static void test_scratch_oom(void) {
  pd_err e = {0};
  pd_backend *be = pd_backend_cuda_create(NULL, &e);
  REQUIRE(be && be->ops.take_error && be->ops.mem_info);
  const int M = 4096, N = 256, K = 4096; /* cuBLAS: x as a 32 MiB bf16 operand in scratch */
  float *x = rand_f32((size_t)M * K, -1, 1);
  void *w = rand_dt(PD_DTYPE_BF16, (size_t)N * K, -0.02f, 0.02f);
  float *ref = xmalloc((size_t)M * N * sizeof *ref);
  g_cpu->ops.matmul(g_cpu, ref, x, w, PD_DTYPE_BF16, NULL, M, N, K);
  float *dx = be->ops.alloc(be, (size_t)M * K * 4), *dy = be->ops.alloc(be, (size_t)M * N * 4);
  float *d1 = be->ops.alloc(be, (size_t)M * N * 4);
  void *dw = be->ops.alloc(be, (size_t)N * K * 2);
  REQUIRE(dx && dy && d1 && dw);
  be->ops.to_device(be, dx, x, (size_t)M * K * 4);
  be->ops.to_device(be, dw, w, (size_t)N * K * 2);
  float *ones = xmalloc((size_t)M * N * 4);
  for (size_t i = 0; i < (size_t)M * N; i++) ones[i] = 1.0f;
  be->ops.to_device(be, d1, ones, (size_t)M * N * 4);
  /* fill the device: 256 MiB pieces, then 4 MiB ones, until nothing more is given */
  static void *hog[4096];
  int n_hog = 0;
  for (size_t piece = 256u << 20; piece >= 4u << 20; piece /= 64)
    while (n_hog < 4096 && (hog[n_hog] = be->ops.alloc(be, piece)) != NULL) n_hog++;
  size_t free_b = 0, total_b = 0;
  be->ops.mem_info(be, &free_b, &total_b);
  printf("  scratch OOM: %d pieces hold the device, %.1f MiB free\n", n_hog,
         free_b / 1048576.0);
  be->ops.matmul(be, dy, dx, dw, PD_DTYPE_BF16, NULL, M, N, K); /* scratch cannot grow */
  be->ops.add(be, dy, d1, (size_t)M * N);                        /* skipped after that */
  be->ops.sync(be);
  CHECKF(pd_backend_status(be, &e) == PD_OK, "scratch OOM made the backend fail: %s", e.msg);
  pd_status st = be->ops.take_error(be, &e);
  CHECKF(st == PD_ENOMEM && strstr(e.msg, "out of GPU memory"),
         "scratch OOM: take_error gave %d (%s), expected PD_ENOMEM", (int)st, e.msg);
  CHECK(be->ops.take_error(be, &e) == PD_OK); /* taken once */
  float *y = down_be(be, dy, (size_t)M * N * 4);
  int touched = 0;
  for (size_t i = 0; i < (size_t)M * N; i++) touched += y[i] != 0.0f;
  CHECKF(touched == 0, "scratch OOM: %d outputs written by ops after the failure", touched);
  free(y);
  for (int i = 0; i < n_hog; i++) be->ops.free(be, hog[i]);
  be->ops.matmul(be, dy, dx, dw, PD_DTYPE_BF16, NULL, M, N, K);
  be->ops.sync(be);
  CHECK(be->ops.take_error(be, &e) == PD_OK && pd_backend_status(be, &e) == PD_OK);
  y = down_be(be, dy, (size_t)M * N * 4);
  double err = rel_err(y, ref, (size_t)M * N);
  CHECKF(err < 1.5e-2, "matmul after the scratch OOM: error %.3g", err);
  free(y);
  free(x);
  free(w);
  free(ref);
  free(ones);
  be->ops.free(be, dx);
  be->ops.free(be, dy);
  be->ops.free(be, d1);
  be->ops.free(be, dw);
  pd_backend_destroy(be);
}

int main(int argc, char **argv) {
  g_small = argc > 1 && strcmp(argv[1], "small") == 0;
  int ndev = pd_cuda_device_count();
  if (ndev == 0) {
    printf("test_cuda_ops: no CUDA device, skipped\n");
    return 77;
  }
  pd_err e = {0};
  g_cpu = pd_backend_cpu_create(NULL, &e);
  REQUIRE(g_cpu);
  g_gpu = pd_backend_cuda_create(NULL, &e);
  if (!g_gpu) {
    fprintf(stderr, "pd_backend_cuda_create: %s\n", e.msg);
    return 1;
  }
  REQUIRE(strcmp(g_gpu->ops.name, "cuda") == 0 && !g_gpu->host_memory);
  REQUIRE(pd_backend_cuda_stream(g_gpu) != NULL && pd_backend_cuda_stream(g_cpu) == NULL);
  /* device ordinal out of range */
  pd_backend_opts bad = {.n_threads = 0, .device = ndev};
  CHECK(pd_backend_cuda_create(&bad, &e) == NULL && e.code == PD_EINVAL);

  test_memory();
  test_matmuls();
  test_qmatmuls();
  static const int norm_shapes[][2] = {{1, 4096}, {7, 4000}, {300, 11003}, {4096, 64}, {3, 5}};
  for (int i = g_small ? 2 : 0; i < 5; i++)
    test_norms(g_small && i == 2 ? 9 : norm_shapes[i][0], g_small && i == 2 ? 1003 : norm_shapes[i][1]);
  test_embed_rows_add();
  test_rope_swiglu();
  for (int d = 0; d < 3; d++) {
    test_kv_write(16, k_dts[d]);
    test_kv_write(32, k_dts[d]);
  }
  test_attention();
  test_fused();
  test_layer_ops();
  test_scratch_oom();

  g_gpu->ops.sync(g_gpu);
  CHECKF(pd_backend_cuda_status(g_gpu, &e) == PD_OK, "backend status: %s", e.msg);
  pd_backend_destroy(g_gpu);
  pd_backend_destroy(g_cpu);
  return pd_test_finish("test_cuda_ops");
}
