/* Every op of the CPU backend against a naive double-precision reference written here, on awkward
 * sizes (odd K and N, one row, tails, K deeper than a GEMM block, ragged batches, shuffled pages,
 * block sizes 1/7/16, GQA ratios 1/2/3/6, sliding windows, 1000-token prompts with a cached
 * prefix), for every kernel family this CPU can run (pd_backend_opts.cpu_isa = generic|avx2|avx512) and for 1
 * and 3 threads (3 > cores here, so the pool's hand-off is exercised too).
 *
 * Tolerances: float32 accumulation against a double reference, relative to the magnitude the
 * error scales with (sum |x_k w_k| for dot products, max |v| for attention). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/backend.h"
#include "pd/dtype.h"

static int g_fail = 0;
static const char *g_cfg = "";

#define CHECK(cond, ...)                                                                         \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      fprintf(stderr, "FAIL [%s] %s:%d: ", g_cfg, __FILE__, __LINE__);                          \
      fprintf(stderr, __VA_ARGS__);                                                              \
      fputc('\n', stderr);                                                                       \
      g_fail++;                                                                                  \
    }                                                                                            \
  } while (0)

/* ---- deterministic random numbers -------------------------------------------------------------- */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 11);
}
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f; }
static int irand(int n) { return (int)(rnd() % (uint32_t)n); }

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

/* Stores n random values in dtype dt at dst and their exact float32 values in f. */
static void fill_dt(void *dst, float *f, pd_dtype dt, size_t n, float lo, float hi) {
  for (size_t i = 0; i < n; i++) {
    float v = frand(lo, hi);
    if (dt == PD_DTYPE_F32) {
      ((float *)dst)[i] = v;
      f[i] = v;
    } else if (dt == PD_DTYPE_BF16) {
      uint16_t h = pd_f32_to_bf16(v);
      ((uint16_t *)dst)[i] = h;
      f[i] = pd_bf16_to_f32(h);
    } else {
      uint16_t h = pd_f32_to_f16(v);
      ((uint16_t *)dst)[i] = h;
      f[i] = pd_f16_to_f32(h);
    }
  }
}

static const pd_dtype k_dts[3] = {PD_DTYPE_F32, PD_DTYPE_F16, PD_DTYPE_BF16};

/* ---- backends under test ---------------------------------------------------------------------- */
#define MAX_BE 6
static pd_backend *g_be[MAX_BE];
static char g_names[MAX_BE][64];
static int g_nbe = 0;

static void open_backends(void) {
  static const char *isas[3] = {"generic", "avx2", "avx512"};
  static const int threads[2] = {1, 3};
  for (int i = 0; i < 3; i++) {
    for (int t = 0; t < 2; t++) {
      pd_err e = {0};
      pd_backend_opts o = {.n_threads = threads[t], .cpu_isa = isas[i]};
      pd_backend *be = pd_backend_cpu_create(&o, &e);
      if (!be) {
        fprintf(stderr, "pd_backend_cpu_create(%s): %s\n", isas[i], e.msg);
        g_fail++;
        continue;
      }
      if (strcmp(pd_backend_cpu_isa(be), isas[i]) != 0) { /* the CPU lacks this level */
        pd_backend_destroy(be);
        continue;
      }
      g_be[g_nbe] = be;
      snprintf(g_names[g_nbe], sizeof g_names[g_nbe], "%s/%dt", isas[i], threads[t]);
      g_nbe++;
    }
  }
  printf("backends:");
  for (int i = 0; i < g_nbe; i++) printf(" %s", g_names[i]);
  printf("\n");
}

static void test_create_errors(void) {
  g_cfg = "create";
  pd_err e = {0};
  pd_backend_opts bad_isa = {.cpu_isa = "sse9"};
  pd_backend *be = pd_backend_cpu_create(&bad_isa, &e);
  CHECK(be == NULL && e.code == PD_EINVAL, "bad cpu_isa must fail with EINVAL");
  pd_backend_opts o = {.n_threads = -5};
  be = pd_backend_cpu_create(&o, &e); /* <= 0 means all cores */
  CHECK(be != NULL, "n_threads <= 0 must mean all cores");
  if (be) {
    const char *isa = pd_backend_cpu_isa(be);
    CHECK(strcmp(isa, "avx512") == 0 || strcmp(isa, "avx2") == 0 || strcmp(isa, "generic") == 0,
          "isa name %s", isa);
    pd_backend_destroy(be);
  }
  pd_backend_destroy(NULL);

  /* device names: cpu by default and by name; malformed names are refused before any backend
   * is made; "cuda" without a device or without CUDA in the build is an error, not the CPU */
  bool gpu = true;
  be = pd_backend_open(NULL, NULL, &gpu, &e);
  CHECK(be && !gpu && !strcmp(be->ops.name, "cpu"), "no device name must open the CPU backend");
  pd_backend_destroy(be);
  gpu = true;
  be = pd_backend_open("cpu", &o, &gpu, &e);
  CHECK(be && !gpu, "\"cpu\" must open the CPU backend");
  pd_backend_destroy(be);
  static const char *bad[] = {"tpu", "cuda:", "cuda:x", "cuda:1x", "cuda:-1", "cudaa", "CPU", ""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    e = (pd_err){0};
    be = pd_backend_open(bad[i], NULL, NULL, &e);
    CHECK(be == NULL && e.code == PD_EINVAL && strstr(e.msg, "--device"),
          "device '%s' must be refused with EINVAL (got %d: %s)", bad[i], e.code, e.msg);
    pd_backend_destroy(be);
  }
  e = (pd_err){0};
  be = pd_backend_open("cuda:1000", NULL, &gpu, &e);
  CHECK(be == NULL && gpu && (e.code == PD_EUNSUPPORTED || e.code == PD_EINVAL ||
                              e.code == PD_EBACKEND),
        "a device that does not exist must fail (got %d: %s)", e.code, e.msg);
  pd_backend_destroy(be);
}

/* ---- memory ops ------------------------------------------------------------------------------ */
static void test_memory(pd_backend *be) {
  for (size_t n = 0; n < 300; n += 37) {
    unsigned char *p = be->ops.alloc(be, n);
    CHECK(p != NULL, "alloc(%zu)", n);
    if (!p) continue;
    CHECK(((uintptr_t)p & 63) == 0, "alloc not 64-byte aligned");
    int zero = 1;
    for (size_t i = 0; i < n; i++) zero &= p[i] == 0;
    CHECK(zero, "alloc(%zu) not zeroed", n);
    unsigned char h[300], back[300];
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 7 + 1);
    be->ops.to_device(be, p, h, n);
    be->ops.sync(be);
    be->ops.to_host(be, back, p, n);
    CHECK(n == 0 || memcmp(h, back, n) == 0, "round trip %zu bytes", n);
    be->ops.free(be, p);
  }
  be->ops.free(be, NULL);
}

/* ---- matmul ---------------------------------------------------------------------------------- */
typedef struct mm_case {
  int M, N, K;
} mm_case;

static void test_matmul(void) {
  static const mm_case cases[] = {
      {1, 1, 1},     {1, 3, 17},    {2, 17, 3},    {3, 33, 64},   {4, 100, 383},  {1, 1000, 383},
      {1, 384, 384}, {5, 31, 1000}, {7, 64, 33},   {2, 70, 1030}, {13, 1, 1030},  {64, 383, 17},
      {64, 129, 1000}, {100, 40, 1300}, {1000, 70, 383}, {9, 4096, 64}, {512, 96, 384},
      /* batched decode (M = sequences): GEMV over W blocks up to 32 rows on avx512 (GEMM on the
       * other levels); GEMM with register tiles of near-equal height, runs of adjacent panels per
       * task with the next panel prefetched; odd N in the last panel, K off the vector width */
      {17, 128, 384}, {17, 2048, 384}, {32, 384, 384}, {32, 384, 1024}, {33, 4096, 384},
      {100, 384, 1024}, {100, 131, 384}, {256, 128, 1024}, {256, 389, 384}, {41, 1021, 1024},
      {29, 77, 1000}, {24, 200, 383},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    int M = cases[ci].M, N = cases[ci].N, K = cases[ci].K;
    for (int di = 0; di < 3; di++) {
      pd_dtype dt = k_dts[di];
      int use_bias = (int)((ci + di) % 2);
      float *x = xmalloc((size_t)M * K * sizeof(float));
      void *w = xmalloc((size_t)N * K * pd_dtype_size(dt));
      float *wf = xmalloc((size_t)N * K * sizeof(float));
      float *bias = xmalloc((size_t)N * sizeof(float));
      double *ref = xmalloc((size_t)M * N * sizeof(double));
      double *mag = xmalloc((size_t)M * N * sizeof(double));
      for (size_t i = 0; i < (size_t)M * K; i++) x[i] = frand(-1, 1);
      fill_dt(w, wf, dt, (size_t)N * K, -1, 1);
      for (int n = 0; n < N; n++) bias[n] = frand(-2, 2);
      for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
          double s = use_bias ? bias[n] : 0, a = use_bias ? fabs(bias[n]) : 0;
          const float *xr = x + (size_t)m * K, *wr = wf + (size_t)n * K;
          for (int k = 0; k < K; k++) {
            s += (double)xr[k] * wr[k];
            a += fabs((double)xr[k] * wr[k]);
          }
          ref[(size_t)m * N + n] = s;
          mag[(size_t)m * N + n] = a;
        }
      const int guard = 19;
      float *y = xmalloc(((size_t)M * N + guard) * sizeof(float));
      for (int b = 0; b < g_nbe; b++) {
        pd_backend *be = g_be[b];
        g_cfg = g_names[b];
        for (size_t i = 0; i < (size_t)M * N + guard; i++) y[i] = 12345.0f;
        be->ops.matmul(be, y, x, w, dt, use_bias ? bias : NULL, M, N, K);
        double worst = 0;
        size_t wi = 0;
        for (size_t i = 0; i < (size_t)M * N; i++) {
          double err = fabs(y[i] - ref[i]) / (mag[i] + 1e-30);
          if (!(err <= worst)) {
            worst = err;
            wi = i;
          }
        }
        CHECK(worst <= 1e-5, "matmul M=%d N=%d K=%d %s bias=%d: rel err %.3g at %zu (%g vs %g)", M,
              N, K, pd_dtype_name(dt), use_bias, worst, wi, y[wi], ref[wi]);
        for (int i = 0; i < guard; i++)
          CHECK(y[(size_t)M * N + i] == 12345.0f, "matmul M=%d N=%d K=%d wrote past y", M, N, K);
      }
      free(x), free(w), free(wf), free(bias), free(ref), free(mag), free(y);
    }
  }
  /* K = 0: y = bias (or zero). */
  float bias[5] = {1, 2, 3, 4, 5}, y[10];
  for (int b = 0; b < g_nbe; b++) {
    g_cfg = g_names[b];
    g_be[b]->ops.matmul(g_be[b], y, bias, bias, PD_DTYPE_F32, bias, 2, 5, 0);
    CHECK(y[0] == 1 && y[9] == 5, "matmul K=0 must give bias");
  }
}

/* 4-bit weights (PD_DTYPE_Q4): random values, scales and zeros in the engine's row layout,
 * against the same weights dequantized in double. GEMV (few rows) and GEMM (many) paths, every
 * ISA and thread count. */
static void test_matmul_q4(void) {
  static const mm_case cases[] = {{1, 8, 32},     {1, 1000, 384}, {2, 17, 64},   {3, 40, 1024},
                                  {4, 96, 384},   {5, 33, 96},    {17, 128, 384}, {64, 129, 1024},
                                  {100, 40, 352}, {256, 389, 384}, {1, 4096, 1024}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const int M = cases[ci].M, N = cases[ci].N, K = cases[ci].K, nb = K / PD_Q4_BLOCK;
    const size_t rb = pd_dtype_row_bytes(PD_DTYPE_Q4, K);
    CHECK(rb == (size_t)K / 2 + (size_t)nb * 4, "Q4 row bytes");
    uint8_t *w = xmalloc((size_t)N * rb);
    float *wf = xmalloc((size_t)N * K * sizeof(float));
    float *x = xmalloc((size_t)M * K * sizeof(float)), *bias = xmalloc((size_t)N * sizeof(float));
    for (int n = 0; n < N; n++) {
      uint8_t *row = w + (size_t)n * rb;
      for (int b = 0; b < nb; b++) {
        const float sc = pd_f16_to_f32(pd_f32_to_f16(frand(0.001f, 0.05f)));
        const float z = (float)(int)frand(0, 16.99f);
        uint16_t h[2] = {pd_f32_to_f16(sc), pd_f32_to_f16(z)};
        memcpy(row + K / 2 + b * 4, h, 4);
        for (int i = 0; i < PD_Q4_BLOCK; i++) {
          const int k = b * PD_Q4_BLOCK + i, q = (int)frand(0, 15.99f);
          if (k & 1) row[k / 2] |= (uint8_t)(q << 4);
          else row[k / 2] = (uint8_t)q;
          wf[(size_t)n * K + k] = ((float)q - z) * sc;
        }
      }
      bias[n] = frand(-1, 1);
    }
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = frand(-1, 1);
    float *y = xmalloc((size_t)M * N * sizeof(float));
    for (int b = 0; b < g_nbe; b++) {
      pd_backend *be = g_be[b];
      g_cfg = g_names[b];
      const int use_bias = (int)(ci % 2);
      be->ops.matmul(be, y, x, w, PD_DTYPE_Q4, use_bias ? bias : NULL, M, N, K);
      double worst = 0;
      for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
          double s = use_bias ? bias[n] : 0, a = use_bias ? fabs(bias[n]) : 0;
          for (int k = 0; k < K; k++) {
            s += (double)x[(size_t)m * K + k] * wf[(size_t)n * K + k];
            a += fabs((double)x[(size_t)m * K + k] * wf[(size_t)n * K + k]);
          }
          const double err = fabs(y[(size_t)m * N + n] - s) / (a + 1e-30);
          if (!(err <= worst)) worst = err;
        }
      CHECK(worst <= 1e-5, "Q4 matmul M=%d N=%d K=%d: rel err %.3g", M, N, K, worst);
    }
    free(w), free(wf), free(x), free(bias), free(y);
  }
}

/* FP8 weights (PD_DTYPE_F8W: e4m3 rows and an f32 scale each; F8WA: the activations quantized to
 * e4m3 per row first), against the same arithmetic in double. */
static void test_matmul_f8(void) {
  static const mm_case cases[] = {{1, 8, 16},   {1, 1000, 384}, {2, 17, 64},    {4, 96, 384},
                                  {5, 33, 96},  {17, 128, 384}, {64, 129, 1024}, {100, 40, 352},
                                  {1, 4096, 1024}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const int M = cases[ci].M, N = cases[ci].N, K = cases[ci].K;
    const size_t rb = pd_dtype_row_bytes(PD_DTYPE_F8W, K);
    uint8_t *w = xmalloc((size_t)N * rb);
    float *wf = xmalloc((size_t)N * K * sizeof(float));
    float *x = xmalloc((size_t)M * K * sizeof(float)), *xq = xmalloc((size_t)M * K * sizeof(float));
    float *bias = xmalloc((size_t)N * sizeof(float)), *y = xmalloc((size_t)M * N * sizeof(float));
    for (int n = 0; n < N; n++) {
      const float sc = frand(0.001f, 0.01f);
      for (int k = 0; k < K; k++) {
        uint8_t b = (uint8_t)irand(256);
        if ((b & 0x7f) == 0x7f) b = 0x7e; /* not NaN */
        w[(size_t)n * rb + k] = b;
        wf[(size_t)n * K + k] = pd_e4m3_to_f32(b) * sc;
      }
      memcpy(w + (size_t)n * rb + K, &sc, 4);
      bias[n] = frand(-1, 1);
    }
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = frand(-3, 3);
    for (int m = 0; m < M; m++) { /* the dynamic per-row FP8 activations */
      float amax = 0;
      for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[(size_t)m * K + k]));
      const float sc = amax / 448.0f;
      for (int k = 0; k < K; k++)
        xq[(size_t)m * K + k] = pd_e4m3_to_f32(pd_f32_to_e4m3(x[(size_t)m * K + k] / sc)) * sc;
    }
    for (int act = 0; act < 2; act++) {
      const pd_dtype dt = act ? PD_DTYPE_F8WA : PD_DTYPE_F8W;
      const float *xr = act ? xq : x;
      for (int b = 0; b < g_nbe; b++) {
        pd_backend *be = g_be[b];
        g_cfg = g_names[b];
        const int use_bias = (int)((ci + act) % 2);
        be->ops.matmul(be, y, x, w, dt, use_bias ? bias : NULL, M, N, K);
        double worst = 0;
        for (int m = 0; m < M; m++)
          for (int n = 0; n < N; n++) {
            double sum = use_bias ? bias[n] : 0, a = use_bias ? fabs(bias[n]) : 0;
            for (int k = 0; k < K; k++) {
              sum += (double)xr[(size_t)m * K + k] * wf[(size_t)n * K + k];
              a += fabs((double)xr[(size_t)m * K + k] * wf[(size_t)n * K + k]);
            }
            const double err = fabs(y[(size_t)m * N + n] - sum) / (a + 1e-30);
            if (!(err <= worst)) worst = err;
          }
        CHECK(worst <= 1e-5, "%s matmul M=%d N=%d K=%d: rel err %.3g", pd_dtype_name(dt), M, N,
              K, worst);
      }
    }
    free(w), free(wf), free(x), free(xq), free(bias), free(y);
  }
}

/* ---- row ops --------------------------------------------------------------------------------- */
static void test_norms(void) {
  static const int Ms[] = {1, 7, 64};
  static const int Ds[] = {1, 3, 17, 384, 1000};
  for (int mi = 0; mi < 3; mi++)
    for (int di = 0; di < 5; di++) {
      int M = Ms[mi], D = Ds[di];
      size_t n = (size_t)M * D;
      float *x = xmalloc(n * 4), *r = xmalloc(n * 4), *w = xmalloc((size_t)D * 4);
      float *y = xmalloc(n * 4), *x2 = xmalloc(n * 4);
      double *ref = xmalloc(n * 8), *ref2 = xmalloc(n * 8), *sum = xmalloc(n * 8);
      for (size_t i = 0; i < n; i++) x[i] = frand(-3, 3), r[i] = frand(-1, 1);
      for (int d = 0; d < D; d++) w[d] = frand(0.5f, 1.5f);
      float eps = 1e-5f;
      for (int m = 0; m < M; m++) {
        double ss = 0, ss2 = 0;
        for (int d = 0; d < D; d++) {
          double v = x[(size_t)m * D + d];
          float s = x[(size_t)m * D + d] + r[(size_t)m * D + d]; /* the residual sum is f32 */
          sum[(size_t)m * D + d] = s;
          ss += v * v;
          ss2 += (double)s * s;
        }
        double inv = 1 / sqrt(ss / D + eps), inv2 = 1 / sqrt(ss2 / D + eps);
        for (int d = 0; d < D; d++) {
          ref[(size_t)m * D + d] = x[(size_t)m * D + d] * inv * w[d];
          ref2[(size_t)m * D + d] = sum[(size_t)m * D + d] * inv2 * w[d];
        }
      }
      for (int b = 0; b < g_nbe; b++) {
        pd_backend *be = g_be[b];
        g_cfg = g_names[b];
        be->ops.rmsnorm(be, y, x, w, eps, M, D);
        double worst = 0;
        for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(y[i] - ref[i]) / (fabs(ref[i]) + 1e-6));
        CHECK(worst <= 1e-5, "rmsnorm M=%d D=%d rel err %g", M, D, worst);
        memcpy(x2, x, n * 4); /* in place: y aliases x */
        be->ops.rmsnorm(be, x2, x2, w, eps, M, D);
        CHECK(memcmp(x2, y, n * 4) == 0, "rmsnorm in place differs M=%d D=%d", M, D);

        memcpy(x2, x, n * 4);
        be->ops.add_rmsnorm(be, y, x2, r, w, eps, M, D);
        double wx = 0, wy = 0;
        for (size_t i = 0; i < n; i++) {
          wx = fmax(wx, fabs(x2[i] - sum[i]));
          wy = fmax(wy, fabs(y[i] - ref2[i]) / (fabs(ref2[i]) + 1e-6));
        }
        CHECK(wx == 0, "add_rmsnorm residual M=%d D=%d err %g", M, D, wx);
        CHECK(wy <= 1e-5, "add_rmsnorm M=%d D=%d rel err %g", M, D, wy);
      }
      free(x), free(r), free(w), free(y), free(x2), free(ref), free(ref2), free(sum);
    }
}

static void test_swiglu(void) {
  static const int Ms[] = {1, 5, 64};
  static const int Fs[] = {1, 17, 1024};
  for (int mi = 0; mi < 3; mi++)
    for (int fi = 0; fi < 3; fi++) {
      int M = Ms[mi], F = Fs[fi];
      float *gu = xmalloc((size_t)M * 2 * F * 4), *y = xmalloc(((size_t)M * F + 3) * 4);
      for (size_t i = 0; i < (size_t)M * 2 * F; i++) gu[i] = frand(-12, 12);
      gu[0] = -100.0f; /* extremes: e^100 must not turn into NaN */
      if (F > 1) gu[1] = 95.0f;
      for (int b = 0; b < g_nbe; b++) {
        pd_backend *be = g_be[b];
        g_cfg = g_names[b];
        y[(size_t)M * F] = 777.0f;
        be->ops.swiglu(be, y, gu, M, F);
        double worst = 0;
        for (int m = 0; m < M; m++)
          for (int f = 0; f < F; f++) {
            double g = gu[(size_t)m * 2 * F + f], u = gu[(size_t)m * 2 * F + F + f];
            double ref = g / (1 + exp(-g)) * u;
            double err = fabs(y[(size_t)m * F + f] - ref) / (fabs(g * u) + 1e-30);
            if (!(err <= worst)) worst = err;
          }
        CHECK(worst <= 1e-5, "swiglu M=%d F=%d rel err %g", M, F, worst);
        CHECK(y[(size_t)M * F] == 777.0f, "swiglu wrote past y");
      }
      free(gu), free(y);
    }
}

static void test_embed_getrows_add(void) {
  static const int Ds[] = {1, 17, 384};
  const int V = 50, M = 37;
  for (int di = 0; di < 3; di++)
    for (int ti = 0; ti < 3; ti++) {
      int D = Ds[di];
      pd_dtype dt = k_dts[ti];
      void *tab = xmalloc((size_t)V * D * pd_dtype_size(dt));
      float *tf = xmalloc((size_t)V * D * 4), *y = xmalloc((size_t)M * D * 4);
      int32_t ids[37];
      fill_dt(tab, tf, dt, (size_t)V * D, -4, 4);
      for (int i = 0; i < M; i++) ids[i] = irand(V);
      ids[0] = V - 1;
      for (int b = 0; b < g_nbe; b++) {
        g_cfg = g_names[b];
        g_be[b]->ops.embed(g_be[b], y, tab, dt, ids, M, D);
        int ok = 1;
        for (int i = 0; i < M; i++) ok &= memcmp(y + (size_t)i * D, tf + (size_t)ids[i] * D, (size_t)D * 4) == 0;
        CHECK(ok, "embed %s D=%d not exact", pd_dtype_name(dt), D);
        memset(y, 0, (size_t)M * D * 4);
        g_be[b]->ops.get_rows(g_be[b], y, tf, ids, M, D);
        ok = 1;
        for (int i = 0; i < M; i++) ok &= memcmp(y + (size_t)i * D, tf + (size_t)ids[i] * D, (size_t)D * 4) == 0;
        CHECK(ok, "get_rows D=%d", D);
      }
      free(tab), free(tf), free(y);
    }
  /* add, small and large (parallel) */
  static const size_t ns[] = {1, 15, 17, 100003};
  for (int i = 0; i < 4; i++) {
    size_t n = ns[i];
    float *a = xmalloc((n + 1) * 4), *bb = xmalloc(n * 4), *orig = xmalloc(n * 4);
    for (size_t j = 0; j < n; j++) orig[j] = frand(-1, 1), bb[j] = frand(-1, 1);
    for (int b = 0; b < g_nbe; b++) {
      g_cfg = g_names[b];
      memcpy(a, orig, n * 4);
      a[n] = 5.0f;
      g_be[b]->ops.add(g_be[b], a, bb, n);
      int ok = 1;
      for (size_t j = 0; j < n; j++) ok &= a[j] == orig[j] + bb[j];
      CHECK(ok && a[n] == 5.0f, "add n=%zu", n);
    }
    free(a), free(bb), free(orig);
  }
}

static void test_rope(void) {
  typedef struct {
    int M, nq, nkv, hd, maxpos;
  } rc;
  static const rc cases[] = {{1, 6, 2, 64, 100},  {7, 3, 1, 6, 5000},    {64, 4, 4, 128, 2048},
                             {5, 2, 1, 2, 10},     {3, 1, 1, 66, 300000}, {33, 5, 1, 34, 70000}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    rc c = cases[ci];
    int half = c.hd / 2;
    float *inv = xmalloc((size_t)half * 4);
    for (int i = 0; i < half; i++) inv[i] = (float)pow(10000.0, -2.0 * i / c.hd);
    size_t nq = (size_t)c.M * c.nq * c.hd, nk = (size_t)c.M * c.nkv * c.hd;
    float *q0 = xmalloc(nq * 4), *k0 = xmalloc(nk * 4), *q = xmalloc(nq * 4), *k = xmalloc(nk * 4);
    int32_t *pos = xmalloc((size_t)c.M * 4);
    for (size_t i = 0; i < nq; i++) q0[i] = frand(-2, 2);
    for (size_t i = 0; i < nk; i++) k0[i] = frand(-2, 2);
    for (int i = 0; i < c.M; i++) pos[i] = irand(c.maxpos);
    pos[0] = c.maxpos - 1;
    for (int b = 0; b < g_nbe; b++) {
      g_cfg = g_names[b];
      memcpy(q, q0, nq * 4);
      memcpy(k, k0, nk * 4);
      g_be[b]->ops.rope(g_be[b], q, k, pos, inv, c.M, c.nq, c.nkv, c.hd);
      double worst = 0;
      for (int which = 0; which < 2; which++) {
        int nh = which ? c.nkv : c.nq;
        const float *src = which ? k0 : q0, *got = which ? k : q;
        for (int m = 0; m < c.M; m++)
          for (int h = 0; h < nh; h++)
            for (int i = 0; i < half; i++) {
              float ang = (float)pos[m] * inv[i]; /* the angle is a float product, as in HF */
              double cs = cos((double)ang), sn = sin((double)ang);
              size_t o = ((size_t)m * nh + h) * c.hd;
              double x1 = src[o + i], x2 = src[o + half + i];
              worst = fmax(worst, fabs(got[o + i] - (x1 * cs - x2 * sn)));
              worst = fmax(worst, fabs(got[o + half + i] - (x2 * cs + x1 * sn)));
            }
      }
      CHECK(worst <= 2e-6, "rope M=%d hd=%d maxpos=%d err %g", c.M, c.hd, c.maxpos, worst);
    }
    free(inv), free(q0), free(k0), free(q), free(k), free(pos);
  }
}

/* ---- KV cache and attention ------------------------------------------------------------------ */
typedef struct at_case {
  int block_size, n_kv, group, head_dim, window;
  pd_dtype dt;
  float scale_mul; /* 1: scale = 1/sqrt(hd); bigger: sharp softmax */
  int n_seqs;
  int n_new[8], ctx[8]; /* ctx 0 = same as n_new (n_new must then be > 0) */
} at_case;

/* Fills the cache through kv_write on backend 0 after checking kv_write itself against the
 * layout; every backend then reads the same pages. */
static void test_attention(void) {
  static const at_case cases[] = {
      /* decode batch, GQA 3 (the bundled model's shape), block 16; one sequence with no new
       * token this step */
      {16, 2, 3, 64, 0, PD_DTYPE_F32, 1, 7, {1, 1, 1, 0, 1, 1, 1}, {1, 17, 33, 5, 100, 250, 16}},
      /* ragged prefill + decode, block 7, MHA */
      {7, 3, 1, 17, 0, PD_DTYPE_F32, 1, 5, {13, 1, 40, 2, 7}, {13, 60, 40, 9, 70}},
      /* block 1, GQA 2, sliding window */
      {1, 2, 2, 32, 5, PD_DTYPE_F32, 1, 4, {9, 1, 30, 3}, {9, 44, 30, 3}},
      /* multi-query (one KV head, GQA 6), window, sharp softmax */
      {16, 1, 6, 64, 40, PD_DTYPE_F32, 8, 3, {50, 1, 90}, {120, 77, 90}},
      /* f16 / bf16 KV, head_dim 128 and 8 */
      {16, 2, 2, 128, 0, PD_DTYPE_F16, 1, 3, {20, 1, 5}, {20, 50, 64}},
      {7, 1, 3, 8, 0, PD_DTYPE_BF16, 1, 3, {11, 1, 4}, {11, 29, 4}},
      /* FP8 KV (k_scale 0.5, v_scale 0.25): decode and prefill, head dims 64 and 17 */
      {16, 2, 3, 64, 0, PD_DTYPE_F8_E4M3, 1, 4, {1, 1, 30, 1}, {40, 17, 30, 300}},
      {7, 3, 1, 17, 9, PD_DTYPE_F8_E4M3, 1, 3, {13, 1, 40}, {13, 60, 40}},
      /* 1000-token prompt, and a 300-token chunk after a 700-token cached prefix */
      {16, 2, 3, 64, 0, PD_DTYPE_F32, 1, 2, {1000, 300}, {1000, 1000}},
      /* long window over a chunked prefill */
      {16, 2, 3, 64, 100, PD_DTYPE_F32, 1, 1, {257}, {600}},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const at_case *c = &cases[ci];
    const int bs = c->block_size, nkv = c->n_kv, hd = c->head_dim, nqh = nkv * c->group;
    const size_t esz = pd_dtype_size(c->dt);
    int ctx[8], qs[9], max_ctx = 0, n_tok = 0, max_blocks = 0, total_blocks = 0;
    for (int s = 0; s < c->n_seqs; s++) {
      ctx[s] = c->ctx[s] ? c->ctx[s] : c->n_new[s];
      qs[s] = n_tok;
      n_tok += c->n_new[s];
      if (ctx[s] > max_ctx) max_ctx = ctx[s];
      int nb = (ctx[s] + bs - 1) / bs;
      if (nb > max_blocks) max_blocks = nb;
      total_blocks += nb;
    }
    qs[c->n_seqs] = n_tok;
    max_blocks += 1;
    const int num_blocks = total_blocks + 5; /* some blocks unused */
    /* Shuffled page assignment. */
    int32_t *perm = xmalloc((size_t)num_blocks * 4);
    for (int i = 0; i < num_blocks; i++) perm[i] = i;
    for (int i = num_blocks - 1; i > 0; i--) {
      int j = irand(i + 1);
      int32_t t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    int32_t *bt = xmalloc((size_t)c->n_seqs * max_blocks * 4);
    for (size_t i = 0; i < (size_t)c->n_seqs * max_blocks; i++) bt[i] = -1;
    int used = 0;
    for (int s = 0; s < c->n_seqs; s++)
      for (int bi = 0; bi < (ctx[s] + bs - 1) / bs; bi++) bt[s * max_blocks + bi] = perm[used++];

    /* K/V rows of every cached token, written with kv_write (all tokens of all seqs). */
    int total_ctx = 0;
    for (int s = 0; s < c->n_seqs; s++) total_ctx += ctx[s];
    size_t row = (size_t)nkv * hd;
    float *kin = xmalloc((size_t)total_ctx * row * 4), *vin = xmalloc((size_t)total_ctx * row * 4);
    int32_t *slots = xmalloc((size_t)(total_ctx + 1) * 4);
    float ampl = c->scale_mul > 1 ? 4.0f : 1.0f;
    for (size_t i = 0; i < (size_t)total_ctx * row; i++) kin[i] = frand(-ampl, ampl), vin[i] = frand(-1, 1);
    int r = 0;
    for (int s = 0; s < c->n_seqs; s++)
      for (int t = 0; t < ctx[s]; t++, r++) slots[r] = bt[s * max_blocks + t / bs] * bs + t % bs;
    slots[total_ctx] = -1; /* skipped row */
    pd_kv_shape shape = {.num_blocks = num_blocks, .block_size = bs, .num_kv_heads = nkv,
                         .head_dim = hd, .dtype = c->dt};
    size_t cache_bytes = (size_t)num_blocks * nkv * bs * hd * esz;
    const bool f8 = c->dt == PD_DTYPE_F8_E4M3;
    pd_kv_layer kv = {.k = g_be[0]->ops.alloc(g_be[0], cache_bytes),
                      .v = g_be[0]->ops.alloc(g_be[0], cache_bytes),
                      .k_scale = f8 ? 0.5f : 0.0f, .v_scale = f8 ? 0.25f : 0.0f};
    /* Extra row so that the skipped slot has data (it must not be written). */
    float *kin2 = xmalloc(((size_t)total_ctx + 1) * row * 4), *vin2 = xmalloc(((size_t)total_ctx + 1) * row * 4);
    memcpy(kin2, kin, (size_t)total_ctx * row * 4);
    memcpy(vin2, vin, (size_t)total_ctx * row * 4);
    for (size_t i = 0; i < row; i++) kin2[(size_t)total_ctx * row + i] = 99.0f, vin2[(size_t)total_ctx * row + i] = 99.0f;
    g_cfg = g_names[0];
    g_be[0]->ops.kv_write(g_be[0], &kv, &shape, kin2, vin2, slots, total_ctx + 1);
    /* Check kv_write against the layout and read back exact cache values (after rounding). */
    float *kc = xmalloc((size_t)total_ctx * row * 4), *vc = xmalloc((size_t)total_ctx * row * 4);
    int kv_ok = 1;
    for (r = 0; r < total_ctx; r++)
      for (int g = 0; g < nkv; g++)
        for (int d = 0; d < hd; d++) {
          int blk = slots[r] / bs, off = slots[r] % bs;
          size_t el = (((size_t)blk * nkv + g) * bs + off) * hd + d;
          size_t ri = (size_t)r * row + (size_t)g * hd + d;
          float kf, vf;
          if (c->dt == PD_DTYPE_F32) {
            kf = ((float *)kv.k)[el], vf = ((float *)kv.v)[el];
            kv_ok &= kf == kin[ri] && vf == vin[ri];
          } else if (f8) { /* e4m3 of the value / the scale */
            const uint8_t kb = ((uint8_t *)kv.k)[el], vb = ((uint8_t *)kv.v)[el];
            kf = pd_e4m3_to_f32(kb) * 0.5f, vf = pd_e4m3_to_f32(vb) * 0.25f;
            kv_ok &= kb == pd_f32_to_e4m3(kin[ri] / 0.5f) && vb == pd_f32_to_e4m3(vin[ri] / 0.25f);
          } else if (c->dt == PD_DTYPE_BF16) {
            kf = pd_bf16_to_f32(((uint16_t *)kv.k)[el]), vf = pd_bf16_to_f32(((uint16_t *)kv.v)[el]);
            kv_ok &= ((uint16_t *)kv.k)[el] == pd_f32_to_bf16(kin[ri]);
          } else {
            kf = pd_f16_to_f32(((uint16_t *)kv.k)[el]), vf = pd_f16_to_f32(((uint16_t *)kv.v)[el]);
            kv_ok &= ((uint16_t *)kv.k)[el] == pd_f32_to_f16(kin[ri]);
          }
          kc[ri] = kf;
          vc[ri] = vf;
        }
    CHECK(kv_ok, "kv_write case %zu: cache content differs from the layout", ci);
    /* Unused blocks must still be zero (nothing written out of place, skipped slot ignored). */
    int untouched = 1;
    for (int i = used; i < num_blocks; i++) {
      const unsigned char *p = (const unsigned char *)kv.k + (size_t)perm[i] * nkv * bs * hd * esz;
      for (size_t j = 0; j < (size_t)nkv * bs * hd * esz; j++) untouched &= p[j] == 0;
    }
    CHECK(untouched, "kv_write case %zu wrote into an unused block", ci);

    /* Queries and the double reference. */
    float scale = c->scale_mul / sqrtf((float)hd);
    float *q = xmalloc((size_t)n_tok * nqh * hd * 4);
    for (size_t i = 0; i < (size_t)n_tok * nqh * hd; i++) q[i] = frand(-ampl, ampl);
    double *ref = xmalloc((size_t)n_tok * nqh * hd * 8);
    double *p = xmalloc((size_t)max_ctx * 8);
    int row0 = 0; /* first cache row (in kin order) of seq s */
    double vmax = 0;
    for (int s = 0; s < c->n_seqs; s++) {
      int n_new = c->n_new[s];
      for (int t = 0; t < n_new; t++) {
        int pos = ctx[s] - n_new + t;
        int lo = c->window > 0 ? pos - c->window + 1 : 0;
        if (lo < 0) lo = 0;
        for (int h = 0; h < nqh; h++) {
          int g = h / c->group;
          const float *qq = q + ((size_t)(qs[s] + t) * nqh + h) * hd;
          double mx = -INFINITY, den = 0;
          for (int j = lo; j <= pos; j++) {
            const float *kk = kc + (size_t)(row0 + j) * row + (size_t)g * hd;
            double sdot = 0;
            for (int d = 0; d < hd; d++) sdot += (double)qq[d] * kk[d];
            p[j] = sdot * scale;
            if (p[j] > mx) mx = p[j];
          }
          for (int j = lo; j <= pos; j++) den += (p[j] = exp(p[j] - mx));
          double *o = ref + ((size_t)(qs[s] + t) * nqh + h) * hd;
          for (int d = 0; d < hd; d++) o[d] = 0;
          for (int j = lo; j <= pos; j++) {
            const float *vv = vc + (size_t)(row0 + j) * row + (size_t)g * hd;
            for (int d = 0; d < hd; d++) o[d] += p[j] / den * vv[d];
          }
        }
      }
      row0 += ctx[s];
    }
    for (size_t i = 0; i < (size_t)total_ctx * row; i++) vmax = fmax(vmax, fabs(vc[i]));

    int32_t qstart[9], ctxl[8];
    for (int s = 0; s <= c->n_seqs; s++) qstart[s] = qs[s];
    for (int s = 0; s < c->n_seqs; s++) ctxl[s] = ctx[s];
    pd_attn_batch batch = {.n_seqs = c->n_seqs, .n_tokens = n_tok, .q_start = qstart,
                           .ctx_len = ctxl, .block_tables = bt, .max_blocks = max_blocks,
                           .max_ctx_len = max_ctx};
    size_t on = (size_t)n_tok * nqh * hd;
    float *out = xmalloc((on + 7) * 4);
    for (int b = 0; b < g_nbe; b++) {
      g_cfg = g_names[b];
      for (size_t i = 0; i < on + 7; i++) out[i] = 555.0f;
      g_be[b]->ops.attention(g_be[b], out, q, &kv, &shape, &batch, nqh, scale, c->window);
      double worst = 0;
      size_t wi = 0;
      for (size_t i = 0; i < on; i++) {
        double e = fabs(out[i] - ref[i]);
        if (!(e <= worst)) worst = e, wi = i;
      }
      double tol = (c->scale_mul > 1 ? 1e-4 : 1e-5) * vmax;
      CHECK(worst <= tol, "attention case %zu (bs=%d nkv=%d G=%d hd=%d win=%d %s): err %.3g at %zu (%g vs %g)",
            ci, bs, nkv, c->group, hd, c->window, pd_dtype_name(c->dt), worst, wi, out[wi], ref[wi]);
      for (int i = 0; i < 7; i++) CHECK(out[on + i] == 555.0f, "attention wrote past out");
    }
    g_be[0]->ops.free(g_be[0], kv.k);
    g_be[0]->ops.free(g_be[0], kv.v);
    free(perm), free(bt), free(kin), free(vin), free(kin2), free(vin2), free(slots), free(kc);
    free(vc), free(q), free(ref), free(p), free(out);
  }
}

int main(void) {
  test_create_errors();
  open_backends();
  if (g_nbe == 0) {
    fprintf(stderr, "no CPU backend could be created\n");
    return 1;
  }
  for (int b = 0; b < g_nbe; b++) {
    g_cfg = g_names[b];
    test_memory(g_be[b]);
  }
  test_matmul();
  test_matmul_q4();
  test_matmul_f8();
  test_norms();
  test_swiglu();
  test_embed_getrows_add();
  test_rope();
  test_attention();
  for (int b = 0; b < g_nbe; b++) pd_backend_destroy(g_be[b]);
  if (g_fail) {
    fprintf(stderr, "%d check(s) failed\n", g_fail);
    return 1;
  }
  printf("test_cpu_ops: all checks passed on %d backend configurations\n", g_nbe);
  return 0;
}
