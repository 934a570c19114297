/* pd-bench-cuda: what the CUDA backend reaches on this GPU, against the device's own ceilings.
 *
 *   copy      device-to-device cudaMemcpy of 2 GiB (the reference for every %) and of 32 MiB
 *             (what one small kernel can reach); bandwidth counts bytes read + written
 *   cuBLAS    bf16 x bf16 -> f32 GEMM, 8192^3, f32 compute (the backend's prefill GEMM)
 *   GEMV      be->ops.matmul with M = 1 and 8 on Llama-3-8B decode shapes, bf16 weights;
 *             bandwidth counts the weight bytes (x and y are negligible); several copies of
 *             each weight are cycled so that none is served from L2
 *   GEMM      be->ops.matmul with M = 2048 (x conversion + cuBLAS + bias)
 *   decode    be->ops.attention, one token for each of 32 sequences of 8192 tokens, 8 KV heads,
 *             32 query heads, head dim 128, pages shuffled; bandwidth counts the K/V bytes
 *   prefill   be->ops.attention, causal; FLOP/s counts 4 * heads * head_dim per (query, key)
 *             pair actually attended (the causal half)
 *   sample    be->ops.sample on 1 and 256 rows of 128256 logits ~ N(0, 3^2) (greedy, top_k 50
 *             with top_p 0.9, top_p 0.9 alone, and with 5 logprobs): the whole op as the engine
 *             sees it (staging copies, kernel, results back); bandwidth counts one read of the
 *             logits
 * Usage: pd-bench-cuda [device]. Timings: CUDA events over repeated calls after warm-up. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "bench_check.h"
#include "pd/backend_cuda.h"

/* Fills n bf16 (or f32) values with a hash of their index, uniform in [-a, a). */
__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, float a, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(((h & 0xffffff) / 16777216.0f * 2.0f - 1.0f) * a);
  }
}
/* Normal values (mean 0, standard deviation sd) from a hash of the index (Box-Muller). */
__global__ void fill_normal(float *p, size_t n, float sd, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed, g;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    g = h * 3266489917u + 374761393u;
    g ^= g >> 16;
    g *= 2246822519u;
    g ^= g >> 13;
    const float u1 = ((h >> 8) + 1) / 16777217.0f, u2 = (g >> 8) / 16777216.0f;
    p[i] = sd * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
}
__global__ void fill_f32(float *p, size_t n, float a, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = ((h & 0xffffff) / 16777216.0f * 2.0f - 1.0f) * a;
  }
}

static pd_backend *be;
static cudaStream_t st;

static void *dalloc(size_t bytes) {
  void *p = be->ops.alloc(be, bytes);
  if (!p) {
    fprintf(stderr, "cannot allocate %zu bytes\n", bytes);
    exit(1);
  }
  return p;
}

/* Mean milliseconds of one call of f over iters calls (after 3 warm-up calls). */
template <class F> static double time_ms(int iters, F f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; i++) f(i);
  CK(cudaEventRecord(a, st));
  for (int i = 0; i < iters; i++) f(i);
  CK(cudaEventRecord(b, st));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms / iters;
}

static void row(const char *what, const char *shape, double us, const char *unit, double val,
                double pct) {
  if (pct >= 0)
    printf("| %-16s | %-40s | %9.1f | %8.1f %-6s | %5.1f%% |\n", what, shape, us, val, unit, pct);
  else
    printf("| %-16s | %-40s | %9.1f | %8.1f %-6s |        |\n", what, shape, us, val, unit);
}

/* Paged decode / prefill attention on random K/V. n_new tokens for each of S sequences with ctx
 * tokens of context; returns microseconds per call. */
static double attn_case(int S, int n_new, int ctx, int nq, int nkv, int hd, int bs, pd_dtype dt,
                        double *kv_bytes) {
  const int nb_seq = (ctx + bs - 1) / bs, num_blocks = S * nb_seq;
  const size_t elems = (size_t)num_blocks * nkv * bs * hd;
  const size_t esz = dt == PD_DTYPE_F32 ? 4 : 2;
  pd_kv_layer kv = {dalloc(elems * esz), dalloc(elems * esz)};
  if (dt == PD_DTYPE_F32) {
    fill_f32<<<4096, 256, 0, st>>>((float *)kv.k, elems, 1.0f, 1);
    fill_f32<<<4096, 256, 0, st>>>((float *)kv.v, elems, 1.0f, 2);
  } else {
    fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)kv.k, elems, 1.0f, 1);
    fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)kv.v, elems, 1.0f, 2);
  }
  const int T = S * n_new;
  std::vector<int32_t> qs(S + 1), cl(S), bt((size_t)S * nb_seq);
  for (int s = 0; s <= S; s++) qs[s] = s * n_new;
  for (int s = 0; s < S; s++) cl[s] = ctx;
  /* pages shuffled: a fixed permutation of the pool (stride coprime with its size) */
  int stride = 7919;
  while (num_blocks % stride == 0) stride += 2;
  for (size_t i = 0; i < bt.size(); i++) bt[i] = (int32_t)((i * (size_t)stride) % num_blocks);
  int32_t *dqs = (int32_t *)dalloc(qs.size() * 4), *dcl = (int32_t *)dalloc(cl.size() * 4);
  int32_t *dbt = (int32_t *)dalloc(bt.size() * 4);
  be->ops.to_device(be, dqs, qs.data(), qs.size() * 4);
  be->ops.to_device(be, dcl, cl.data(), cl.size() * 4);
  be->ops.to_device(be, dbt, bt.data(), bt.size() * 4);
  float *q = (float *)dalloc((size_t)T * nq * hd * 4), *out = (float *)dalloc((size_t)T * nq * hd * 4);
  fill_f32<<<1024, 256, 0, st>>>(q, (size_t)T * nq * hd, 2.0f, 3);
  pd_kv_shape sh = {num_blocks, bs, nkv, hd, dt};
  pd_attn_batch b = {S, T, dqs, dcl, dbt, nb_seq, ctx, false};
  const float scale = 1.0f / sqrtf((float)hd);
  double ms = time_ms(10, [&](int) { be->ops.attention(be, out, q, &kv, &sh, &b, nq, scale, 0); });
  *kv_bytes = 2.0 * S * (double)ctx * nkv * hd * esz;
  be->ops.free(be, kv.k);
  be->ops.free(be, kv.v);
  be->ops.free(be, dqs);
  be->ops.free(be, dcl);
  be->ops.free(be, dbt);
  be->ops.free(be, q);
  be->ops.free(be, out);
  return ms * 1000;
}

int main(int argc, char **argv) {
  int dev = argc > 1 ? atoi(argv[1]) : 0;
  if (pd_cuda_device_count() == 0) {
    printf("pd-bench-cuda: no CUDA device\n");
    return 77;
  }
  pd_err e = {};
  pd_backend_opts o = {0, dev};
  be = pd_backend_cuda_create(&o, &e);
  if (!be) {
    fprintf(stderr, "pd_backend_cuda_create: %s\n", e.msg);
    return 1;
  }
  st = (cudaStream_t)pd_backend_cuda_stream(be);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("device %d: %s, %d SMs, %.0f MiB, L2 %d MiB\n\n", dev, prop.name,
         prop.multiProcessorCount, prop.totalGlobalMem / 1048576.0, prop.l2CacheSize >> 20);
  printf("| %-16s | %-40s | %9s | %15s | %6s |\n", "what", "shape", "us/call", "rate", "% copy");
  printf("|------------------|------------------------------------------|-----------|-----------------|--------|\n");

  /* ---- copy bandwidth */
  const size_t cb = (size_t)2 << 30;
  void *src = dalloc(cb), *dst = dalloc(cb);
  double ms = time_ms(10, [&](int) { CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice, st)); });
  const double copy_gbs = 2.0 * cb / (ms * 1e-3) / 1e9;
  row("copy d2d", "2 GiB, read + write", ms * 1000, "GB/s", copy_gbs, 100.0);
  /* the ceiling at the size of a 4096 x 4096 bf16 weight: launch, ramp-up and drain included */
  const size_t sb = (size_t)32 << 20;
  ms = time_ms(50, [&](int i) {
    CK(cudaMemcpyAsync((char *)dst + (size_t)(i % 32) * sb, (char *)src + (size_t)(i % 32) * sb, sb,
                       cudaMemcpyDeviceToDevice, st));
  });
  row("copy d2d", "32 MiB, read + write", ms * 1000, "GB/s", 2.0 * sb / (ms * 1e-3) / 1e9,
      100.0 * 2.0 * sb / (ms * 1e-3) / 1e9 / copy_gbs);
  be->ops.free(be, src);
  be->ops.free(be, dst);

  /* ---- cuBLAS bf16 GEMM 8192^3 */
  {
    const int n = 8192;
    __nv_bfloat16 *A = (__nv_bfloat16 *)dalloc((size_t)n * n * 2), *B = (__nv_bfloat16 *)dalloc((size_t)n * n * 2);
    float *C = (float *)dalloc((size_t)n * n * 4);
    fill_bf16<<<4096, 256, 0, st>>>(A, (size_t)n * n, 1.0f, 5);
    fill_bf16<<<4096, 256, 0, st>>>(B, (size_t)n * n, 1.0f, 6);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 1;
    cublasSetStream(h, st);
    const float one = 1.0f, zero = 0.0f;
    ms = time_ms(10, [&](int) {
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF,
                   n, &zero, C, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    row("cuBLAS bf16", "8192 x 8192 x 8192, f32 out", ms * 1000, "TFLOP/s",
        2.0 * n * n * (double)n / (ms * 1e-3) / 1e12, -1);
    cublasDestroy(h);
    be->ops.free(be, A);
    be->ops.free(be, B);
    be->ops.free(be, C);
  }

  /* ---- GEMV / GEMM through the ops table, Llama-3-8B shapes */
  static const int shapes[][2] = {{4096, 4096},  {6144, 4096},  {14336, 4096},
                                  {28672, 4096}, {4096, 14336}, {128256, 4096}};
  for (int si = 0; si < 6; si++) {
    const int N = shapes[si][0], K = shapes[si][1];
    const size_t wb = (size_t)N * K * 2;
    int copies = (int)((512ull << 20) / wb) + 1; /* >= 512 MiB cycled: L2 never holds them */
    if (copies > 16) copies = 16;
    std::vector<void *> w(copies);
    for (int c = 0; c < copies; c++) {
      w[c] = dalloc(wb);
      fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)w[c], (size_t)N * K, 0.02f, 10 + c);
    }
    float *x = (float *)dalloc((size_t)2048 * K * 4), *y = (float *)dalloc((size_t)2048 * N * 4);
    fill_f32<<<1024, 256, 0, st>>>(x, (size_t)2048 * K, 1.0f, 7);
    for (int M : {1, 8}) {
      ms = time_ms(50, [&](int i) {
        be->ops.matmul(be, y, x, w[i % copies], PD_DTYPE_BF16, NULL, M, N, K);
      });
      char shape[64];
      snprintf(shape, sizeof shape, "M=%d N=%d K=%d bf16", M, N, K);
      double gbs = wb / (ms * 1e-3) / 1e9;
      row("GEMV", shape, ms * 1000, "GB/s", gbs, 100.0 * gbs / copy_gbs);
    }
    if (si == 2 || si == 4) {
      const int M = 2048;
      ms = time_ms(5, [&](int i) {
        be->ops.matmul(be, y, x, w[i % copies], PD_DTYPE_BF16, NULL, M, N, K);
      });
      char shape[64];
      snprintf(shape, sizeof shape, "M=%d N=%d K=%d bf16", M, N, K);
      row("GEMM (ops)", shape, ms * 1000, "TFLOP/s", 2.0 * M * N * (double)K / (ms * 1e-3) / 1e12,
          -1);
    }
    for (int c = 0; c < copies; c++) be->ops.free(be, w[c]);
    be->ops.free(be, x);
    be->ops.free(be, y);
  }

  /* ---- decode attention (long contexts) */
  {
    double bytes;
    struct {
      int S, ctx;
      pd_dtype dt;
    } dc[] = {{32, 8192, PD_DTYPE_BF16}, {32, 8192, PD_DTYPE_F32}, {1, 32768, PD_DTYPE_BF16},
              {128, 2048, PD_DTYPE_BF16}, {256, 1024, PD_DTYPE_BF16}, {1, 384, PD_DTYPE_BF16}};
    for (auto &c : dc) {
      double us = attn_case(c.S, 1, c.ctx, 32, 8, 128, 16, c.dt, &bytes);
      char shape[80];
      snprintf(shape, sizeof shape, "%d seqs x %d ctx, 32/8 heads, hd 128, %s", c.S, c.ctx,
               c.dt == PD_DTYPE_F32 ? "f32" : "bf16");
      double gbs = bytes / (us * 1e-6) / 1e9;
      row("decode attn", shape, us, "GB/s", gbs, 100.0 * gbs / copy_gbs);
    }
  }
  /* ---- prefill attention */
  {
    double bytes;
    struct {
      int S, n_new, ctx;
      pd_dtype dt;
    } pc[] = {{1, 4096, 4096, PD_DTYPE_BF16}, {1, 4096, 4096, PD_DTYPE_F32},
              {4, 1024, 1024, PD_DTYPE_BF16}, {4, 512, 4096, PD_DTYPE_BF16},
              {1, 2048, 8192, PD_DTYPE_BF16}};
    for (auto &c : pc) {
      double us = attn_case(c.S, c.n_new, c.ctx, 32, 8, 128, 16, c.dt, &bytes);
      /* attended (query, key) pairs: for query i of n_new (position ctx - n_new + i), pos + 1 */
      double pairs = 0;
      for (int i = 0; i < c.n_new; i++) pairs += c.ctx - c.n_new + i + 1;
      pairs *= c.S;
      char shape[80];
      snprintf(shape, sizeof shape, "%d x %d new / %d ctx, 32/8 heads, %s", c.S, c.n_new, c.ctx,
               c.dt == PD_DTYPE_F32 ? "f32" : "bf16");
      row("prefill attn", shape, us, "TFLOP/s", 4.0 * pairs * 32 * 128 / (us * 1e-6) / 1e12, -1);
    }
  }
  /* ---- device sampling */
  {
    const int V = 128256, maxn = 256;
    float *lg = (float *)dalloc((size_t)maxn * V * 4);
    fill_normal<<<4096, 256, 0, st>>>(lg, (size_t)maxn * V, 3.0f, 12);
    std::vector<pd_dev_sample_spec> sp(maxn);
    std::vector<pd_dev_sample_out> so(maxn);
    struct {
      const char *name;
      float T;
      int k;
      float p;
      int n_top;
    } sc[] = {{"greedy", 0.0f, 0, 1.0f, -1},
              {"top_k 50, top_p 0.9", 1.0f, 50, 0.9f, -1},
              {"top_p 0.9", 1.0f, 0, 0.9f, -1},
              {"k 50, p 0.9, 5 logprobs", 1.0f, 50, 0.9f, 5}};
    for (auto &c : sc)
      for (int n : {1, maxn}) {
        for (int i = 0; i < n; i++) {
          memset(&sp[i], 0, sizeof sp[i]);
          sp[i].row = i;
          sp[i].temperature = c.T;
          sp[i].top_k = c.k;
          sp[i].top_p = c.p;
          sp[i].rep_penalty = 1.0f;
          sp[i].u = fmod(0.5 + i * 0.6180339887498949, 1.0);
          sp[i].n_top = c.n_top;
        }
        ms = time_ms(20, [&](int) { be->ops.sample(be, so.data(), lg, V, sp.data(), n, NULL, 0); });
        char shape[80];
        snprintf(shape, sizeof shape, "%d x %d, %s", n, V, c.name);
        row("sample", shape, ms * 1000, "GB/s", (double)n * V * 4 / (ms * 1e-3) / 1e9, -1);
      }
    be->ops.free(be, lg);
  }
  be->ops.sync(be);
  if (pd_backend_cuda_status(be, &e) != PD_OK) {
    fprintf(stderr, "backend error: %s\n", e.msg);
    return 1;
  }
  pd_backend_destroy(be);
  return 0;
}
