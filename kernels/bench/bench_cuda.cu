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
 * Usage: pd-bench-cuda [device]. Timings: CUDA events over repeated calls after warm-up.
 *
 *   pd-bench-cuda [device] --quant
 * The copy ceiling and the quantized products instead: Llama-3-8B's linear shapes for M = 1 to
 * 2048, bf16 against 4-bit (PD_DTYPE_Q4) and FP8 (F8WA) rows through the ops table and through
 * each of the backend's three paths (GEMV, tensor-core product, dequantize + cuBLAS).
 *
 *   pd-bench-cuda [device] --power SECONDS [WHAT]
 * Energy instead: the decode step's kinds of work at 256 sequences of 1k context (the M = 256
 * GEMMs, the decode attention, a plain copy, the batch-1 GEMV, the idle GPU) each repeated for
 * SECONDS, with the board's energy counter and SM clock read through NVML (libnvidia-ml, loaded
 * at run time): time per call, mean power, energy per call and the SM clock the power limit left
 * it (WHAT: only the rows whose first column, or first column and shape, starts so, e.g.
 * "decode" or "decode attn 256 seqs"; "GEMM algo": instead, the M = 256 GEMMs through each of
 * cuBLASLt's first 8 heuristic algorithms). What a step costs in joules is what bounds it when
 * the board runs at its power cap. The plain reads and the decode attention run on random bf16
 * and on constant bytes: moving random bits costs 30-40% more (H200: 2 GiB read at 4.5 TB/s
 * draw 390-490 W of bytes 0x01 and 545-640 W of random bf16), so only the random rows say what
 * weights and caches cost. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

#include <vector>

#include "../cuda/cuda_mma.h"
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

/* Copies of an N x K bf16 weight (uniform in +-0.02), 512 MiB or more of them in all (at most
 * 16): cycling through them, no call finds its weight in L2. */
static std::vector<void *> weight_copies(int N, int K) {
  const size_t wb = (size_t)N * K * 2;
  int copies = (int)((512ull << 20) / wb) + 1;
  if (copies > 16) copies = 16;
  std::vector<void *> w(copies);
  for (int c = 0; c < copies; c++) {
    w[c] = dalloc(wb);
    fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)w[c], (size_t)N * K, 0.02f, 10 + c);
  }
  return w;
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

/* ---- energy (--power): NVML through dlopen, so that the program runs where it is missing */
typedef struct nvml_dev *nvml_dev_t;
static struct {
  nvml_dev_t dev;
  int (*energy)(nvml_dev_t, unsigned long long *); /* mJ since the driver loaded */
  int (*clock)(nvml_dev_t, int, unsigned *);      /* type 1: SM, MHz */
} g_nvml;
static double g_power_s = 0;        /* --power SECONDS */
static bool g_kv_const = false;     /* attn_case: caches of one constant instead of random */
static const char *g_power_only = ""; /* --power SECONDS WHAT: the rows whose "what" starts so */
static bool g_attn_only = false;      /* --attn: the copy ceiling and the decode attention only */
static bool g_quant_only = false;     /* --quant: the copy ceiling and the quantized products */

static bool nvml_open(int cuda_dev) {
  void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!h) return false;
  auto init = (int (*)(void))dlsym(h, "nvmlInit_v2");
  auto by_bus = (int (*)(const char *, nvml_dev_t *))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
  g_nvml.energy = (int (*)(nvml_dev_t, unsigned long long *))dlsym(
      h, "nvmlDeviceGetTotalEnergyConsumption");
  g_nvml.clock = (int (*)(nvml_dev_t, int, unsigned *))dlsym(h, "nvmlDeviceGetClockInfo");
  char bus[32];
  if (!init || !by_bus || !g_nvml.energy || !g_nvml.clock || init() != 0 ||
      cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_dev) != cudaSuccess ||
      by_bus(bus, &g_nvml.dev) != 0)
    return false;
  unsigned long long e;
  return g_nvml.energy(g_nvml.dev, &e) == 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Runs f back to back for g_power_s seconds (in ~20 ms batches, the SM clock read after each)
 * and prints time per call, mean power, energy per call and the clock. f == NULL: the idle GPU.
 * Returns milliseconds per call. */
template <class F> static double power_run(const char *what, const char *shape, F *f) {
  char full[160];
  snprintf(full, sizeof full, "%s %s", what, shape);
  if (strncmp(what, g_power_only, strlen(g_power_only)) &&
      strncmp(full, g_power_only, strlen(g_power_only)))
    return 0;
  double per = 0.02; /* seconds a batch */
  int k = 1;
  if (f) {
    for (int i = 0; i < 3; i++) (*f)(i);
    CK(cudaStreamSynchronize(st));
    const double t = now_s();
    (*f)(0);
    CK(cudaStreamSynchronize(st));
    const double one = now_s() - t;
    k = one > 0 && one < per ? (int)(per / one) : 1;
  }
  unsigned long long e0 = 0, e1 = 0;
  g_nvml.energy(g_nvml.dev, &e0);
  const double t0 = now_s();
  long calls = 0;
  double mhz_sum = 0;
  unsigned mhz_min = ~0u;
  int samples = 0;
  while (now_s() - t0 < g_power_s) {
    if (f) {
      for (int i = 0; i < k; i++) (*f)((int)(calls + i));
      CK(cudaStreamSynchronize(st));
      calls += k;
    } else {
      usleep((useconds_t)(per * 1e6));
    }
    unsigned mhz = 0;
    if (g_nvml.clock(g_nvml.dev, 1, &mhz) == 0) {
      mhz_sum += mhz;
      mhz_min = mhz < mhz_min ? mhz : mhz_min;
      samples++;
    }
  }
  const double t1 = now_s();
  g_nvml.energy(g_nvml.dev, &e1);
  const double s = t1 - t0, joules = (double)(e1 - e0) * 1e-3;
  const double us = calls ? s / calls * 1e6 : 0;
  printf("| %-16s | %-40s | %9.1f | %7.1f | %10.3f | %5.0f / %4u |\n", what, shape, us,
         joules / s, calls ? joules / calls * 1e3 : 0.0, samples ? mhz_sum / samples : 0.0,
         samples ? mhz_min : 0u);
  fflush(stdout);
  return us * 1e-3;
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
                        double *kv_bytes, const char *power_shape = NULL) {
  const int nb_seq = (ctx + bs - 1) / bs, num_blocks = S * nb_seq;
  const size_t elems = (size_t)num_blocks * nkv * bs * hd;
  const size_t esz = dt == PD_DTYPE_F32 ? 4 : 2;
  pd_kv_layer kv = {dalloc(elems * esz), dalloc(elems * esz), 1.0f, 1.0f};
  if (dt == PD_DTYPE_F32) {
    fill_f32<<<4096, 256, 0, st>>>((float *)kv.k, elems, 1.0f, 1);
    fill_f32<<<4096, 256, 0, st>>>((float *)kv.v, elems, 1.0f, 2);
  } else {
    fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)kv.k, elems, 1.0f, 1);
    fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)kv.v, elems, 1.0f, 2);
    if (g_kv_const) { /* every value 0x3c3c (0.0115): the energy rows' constant caches */
      CK(cudaMemsetAsync(kv.k, 0x3c, elems * esz, st));
      CK(cudaMemsetAsync(kv.v, 0x3c, elems * esz, st));
    }
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
  pd_attn_batch b = {S, T, dqs, dcl, dbt, nb_seq, ctx};
  const float scale = 1.0f / sqrtf((float)hd);
  auto call = [&](int) { be->ops.attention(be, out, q, &kv, &sh, &b, nq, scale, 0); };
  double ms = power_shape ? power_run("decode attn", power_shape, &call) : time_ms(10, call);
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

/* ---- --power: what reading memory into the SMs costs, by the way it is read. Each kernel reads
 * every byte of a buffer once and keeps almost nothing of it (a xor a thread, stored only if it
 * hits a magic value), so the figures are the read path's own: 16-byte loads into registers (as
 * the decode GEMVs), 16-byte cp.async into shared memory in double-buffered 32 KiB stages (as the
 * decode attention), and bulk copies (sm_90) into the same stages, a 256-byte row each (into
 * rows padded as the attention's) or a 4 KiB page each. */
constexpr int kStageBytes = 32768, kStageRows = kStageBytes / 256, kRowPad = 256 + 16;

__global__ void stream_ldg(const uint4 *p, size_t n, uint32_t *sink) {
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
                d = __ldg(p + i + 3 * stride);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) acc ^= __ldg(p + i).x;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

/* mode 0: cp.async 16 B a thread (16 a thread a stage); 1: bulk, a 256-byte row a thread (128
 * threads); 2: bulk, 4 KiB a thread for the first 8 threads; 3: the same, the 4 KiB chunks
 * scattered over the buffer (a fixed permutation); 4: tensor-map copies as the decode
 * attention's, tm a 2D map of the buffer as 256-byte rows (128 bf16), a box 64 rows x 64
 * columns (128 bytes) with the 128-byte swizzle, four boxes a stage (two row groups x two
 * column halves) */
template <int MODE>
__global__ void __launch_bounds__(128) stream_smem(const char *p, size_t tiles, uint32_t *sink,
                                                   const __grid_constant__ CUtensorMap tm) {
  extern __shared__ __align__(128) unsigned char sm_raw[];
  __shared__ __align__(8) uint64_t bar[2];
  /* (mode 4: the stages at the swizzle's 1024-byte period) */
  unsigned char *sm =
      sm_raw + (MODE == 4 ? (1024u - ((uint32_t)__cvta_generic_to_shared(sm_raw) & 1023u)) & 1023u
                          : 0u);
  constexpr int STAGE = MODE == 1 ? kStageRows * kRowPad : kStageBytes;
  const int tid = threadIdx.x;
  if (MODE > 0 && tid == 0) {
    pd_mbar_init(&bar[0], 1);
    pd_mbar_init(&bar[1], 1);
  }
  __syncthreads();
  auto issue = [&](size_t t, int st) {
    const char *src = p + t * kStageBytes;
    unsigned char *dst = sm + st * STAGE;
    if (MODE == 0) {
#pragma unroll
      for (int j = 0; j < kStageBytes / 16 / 128; j++) {
        const int c = tid + j * 128;
        pd_cp_async16(dst + c * 16, src + c * 16, 16);
      }
      pd_cp_async_commit();
    } else if (MODE == 1) {
      if (tid == 0) pd_mbar_expect(&bar[st], kStageBytes);
      pd_bulk_g2s(dst + tid * kRowPad, src + tid * 256, 256, &bar[st]);
    } else if (MODE == 2) {
      if (tid == 0) pd_mbar_expect(&bar[st], kStageBytes);
      if (tid < kStageBytes / 4096) pd_bulk_g2s(dst + tid * 4096, src + tid * 4096, 4096, &bar[st]);
    } else if (MODE == 3) {
      if (tid == 0) pd_mbar_expect(&bar[st], kStageBytes);
      const size_t nc = tiles * (kStageBytes / 4096), c = t * (kStageBytes / 4096) + tid;
      if (tid < kStageBytes / 4096)
        pd_bulk_g2s(dst + tid * 4096, p + (c * 7919u % nc) * 4096, 4096, &bar[st]);
    } else {
      constexpr int kRows = 64;
      if (tid == 0) pd_mbar_expect(&bar[st], kStageBytes);
      if (tid < kStageBytes / (kRows * 128))
        pd_tma_load_2d(dst + tid * kRows * 128, &tm, (tid & 1) * 64,
                       (int)(t * (kStageBytes / 256) + (tid >> 1) * kRows), &bar[st]);
    }
  };
  uint32_t acc = 0;
  int k = 0; /* tiles this block has consumed */
  size_t t = blockIdx.x;
  if (t < tiles) issue(t, 0);
  for (; t < tiles; t += gridDim.x, k++) {
    const int st = k & 1;
    const size_t nt = t + gridDim.x;
    if (nt < tiles) issue(nt, st ^ 1);
    if (MODE == 0) {
      if (nt < tiles) pd_cp_async_wait<1>();
      else pd_cp_async_wait<0>();
      __syncthreads();
    } else {
      pd_mbar_wait(&bar[st], (uint32_t)(k >> 1) & 1);
    }
    acc ^= *reinterpret_cast<const uint32_t *>(sm + st * STAGE + tid * (MODE == 1 ? kRowPad : 16));
    __syncthreads(); /* the stage is read before it is refilled */
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

static bool bench_tmap(CUtensorMap *m, void *base, size_t bytes, CUtensorMapL2promotion promo) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
  if (!fn) {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return false;
    fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
  }
  const cuuint64_t dims[2] = {128, bytes / 256}, strides[1] = {256};
  const cuuint32_t box[2] = {64, 64}, estr[2] = {1, 1};
  return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, estr,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* --power S "GEMM algo": the M = 256 GEMMs of Llama-3-8B through each of cuBLASLt's first 8
 * heuristic algorithms (bf16 operands, f32 accumulation; out in bf16 for gate/up, as the decode
 * step's GLU product, f32 otherwise), weights cycled out of L2 as above: which algorithm costs
 * the fewest joules where the board runs at its power limit. Rows only when asked for by name. */
static void power_gemm_algos(void) {
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return;
  const size_t ws_bytes = (size_t)32 << 20;
  void *ws = dalloc(ws_bytes);
  static const int shapes[][3] = {{256, 6144, 4096}, {256, 4096, 4096}, {256, 28672, 4096},
                                  {256, 4096, 14336}};
  for (const auto &sh : shapes) {
    const int M = sh[0], N = sh[1], K = sh[2];
    const cudaDataType_t yt = N == 28672 ? CUDA_R_16BF : CUDA_R_32F;
    std::vector<void *> w = weight_copies(N, K);
    void *x = dalloc((size_t)M * K * 2), *y = dalloc((size_t)M * N * 4);
    fill_bf16<<<1024, 256, 0, st>>>((__nv_bfloat16 *)x, (size_t)M * K, 1.0f, 7);
    /* row-major y[M,N] = x[M,K] W[N,K]^T as column-major y^T = op(W) x^T, op = transpose */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K);
    cublasLtMatrixLayoutCreate(&lc, yt, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                         sizeof ws_bytes);
    cublasLtMatmulHeuristicResult_t res[8];
    int n = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 8, res, &n);
    for (int i = 0; i < n; i++) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > ws_bytes) continue;
      int id = 0, tile = 0, splitk = 0, stages = 0;
      size_t got;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id,
                                           &got);
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                           sizeof tile, &got);
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                           &splitk, sizeof splitk, &got);
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                           sizeof stages, &got);
      const float one = 1.0f, zero = 0.0f;
      const size_t copies = w.size();
      auto f = [&](int c) {
        cublasLtMatmul(lt, op, &one, w[(size_t)c % copies], la, x, lb, &zero, y, lc, y, lc,
                       &res[i].algo, ws, ws_bytes, st);
      };
      char shape[80];
      snprintf(shape, sizeof shape, "N=%d K=%d #%d id %d tile %d sk %d st %d", N, K, i, id, tile,
               splitk, stages);
      power_run("GEMM algo M=256", shape, &f);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
    for (void *p : w) be->ops.free(be, p);
    be->ops.free(be, x);
    be->ops.free(be, y);
  }
  CK(cudaGetLastError());
  be->ops.free(be, ws);
  cublasLtDestroy(lt);
}

/* --power: the energy table (see the top of the file) */
static int power_main(void) {
  printf("| %-16s | %-40s | %9s | %7s | %10s | %12s |\n", "what", "shape", "us/call", "W",
         "mJ/call", "SM MHz mean / min");
  printf("|------------------|------------------------------------------|-----------|---------|"
         "------------|-------------------|\n");
  if (!strncmp(g_power_only, "GEMM algo", 9)) {
    power_gemm_algos();
    return 0;
  }
  power_run<void(int)>("idle", "nothing running", NULL);
  {
    const size_t cb = (size_t)2 << 30;
    void *src = dalloc(cb), *dst = dalloc(cb);
    auto f = [&](int) { CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice, st)); };
    power_run("copy d2d", "2 GiB, read + write", &f);
    be->ops.free(be, src);
    be->ops.free(be, dst);
  }
  {
    /* each read twice: of bytes 0x01 (no bit changes on the way) and of random bf16 (as weights
     * and caches are): the energy of moving a byte depends on its bits (H200: +30%) */
    const size_t n = (size_t)2 << 30;
    char *src = (char *)dalloc(n);
    uint32_t *sink = (uint32_t *)dalloc(64);
    int sms = 0, dev = 0, major = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    const size_t tiles = n / kStageBytes;
    const int smem0 = 2 * kStageBytes, smem1 = 2 * kStageRows * kRowPad, smt = smem0 + 1024;
    const CUtensorMap no_map = {};
    CK(cudaFuncSetAttribute(stream_smem<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem0));
    if (major >= 9) {
      CK(cudaFuncSetAttribute(stream_smem<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem1));
      CK(cudaFuncSetAttribute(stream_smem<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem0));
      CK(cudaFuncSetAttribute(stream_smem<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem0));
      CK(cudaFuncSetAttribute(stream_smem<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smt));
    }
    for (int rnd = 0; rnd < 2; rnd++) {
      if (rnd)
        fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)src, n / 2, 1.0f, 5);
      else
        CK(cudaMemsetAsync(src, 1, n, st));
      const char *what = rnd ? "read random" : "read";
      auto ldg = [&](int) {
        stream_ldg<<<sms * 8, 256, 0, st>>>((const uint4 *)src, n / 16, sink);
      };
      power_run(what, "2 GiB, 16-byte loads to registers", &ldg);
      /* a stream_smem mode, 3 blocks an SM */
      auto staged = [&](decltype(&stream_smem<0>) kern, int smem, const CUtensorMap &m,
                        const char *shape) {
        auto f = [&](int) { kern<<<sms * 3, 128, smem, st>>>(src, tiles, sink, m); };
        power_run(what, shape, &f);
      };
      if (!rnd) staged(stream_smem<0>, smem0, no_map, "2 GiB, cp.async 16 B into smem");
      if (major < 9) continue;
      if (!rnd) staged(stream_smem<1>, smem1, no_map, "2 GiB, bulk copies of 256 B rows");
      staged(stream_smem<2>, smem0, no_map, "2 GiB, bulk copies of 4 KiB");
      if (!rnd) staged(stream_smem<3>, smem0, no_map, "2 GiB, bulk copies of 4 KiB, scattered");
      /* tensor-map copies of half rows, as the decode attention's, with and without the L2's
       * promotion of their 128-byte requests to 256 bytes */
      for (int promo = rnd; promo < 2; promo++) {
        CUtensorMap tm;
        if (bench_tmap(&tm, src, n, promo ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                                          : CU_TENSOR_MAP_L2_PROMOTION_L2_256B))
          staged(stream_smem<4>, smt, tm,
                 promo ? "2 GiB, TMA half rows, no L2 promotion"
                       : "2 GiB, TMA half rows, L2 promotion 256 B");
      }
    }
    CK(cudaGetLastError());
    be->ops.free(be, src);
    be->ops.free(be, sink);
  }
  /* Llama-3-8B's projections: M = 1 (one copy of the weight streamed per call) and M = 256 */
  static const int shapes[][3] = {{1, 28672, 4096},   {256, 6144, 4096}, {256, 4096, 4096},
                                  {256, 28672, 4096}, {256, 4096, 14336}};
  for (const auto &sh : shapes) {
    const int M = sh[0], N = sh[1], K = sh[2];
    std::vector<void *> w = weight_copies(N, K);
    const int copies = (int)w.size();
    float *x = (float *)dalloc((size_t)M * K * 4), *y = (float *)dalloc((size_t)M * N * 4);
    fill_f32<<<1024, 256, 0, st>>>(x, (size_t)M * K, 1.0f, 7);
    auto f = [&](int i) { be->ops.matmul(be, y, x, w[i % copies], PD_DTYPE_BF16, NULL, M, N, K); };
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d bf16", M, N, K);
    power_run(M == 1 ? "GEMV" : "GEMM (ops)", shape, &f);
    for (int c = 0; c < copies; c++) be->ops.free(be, w[c]);
    be->ops.free(be, x);
    be->ops.free(be, y);
  }
  double bytes;
  attn_case(256, 1, 1024, 32, 8, 128, 16, PD_DTYPE_BF16, &bytes, "256 seqs x 1024 ctx, bf16");
  attn_case(32, 1, 8192, 32, 8, 128, 16, PD_DTYPE_BF16, &bytes, "32 seqs x 8192 ctx, bf16");
  g_kv_const = true;
  attn_case(256, 1, 1024, 32, 8, 128, 16, PD_DTYPE_BF16, &bytes, "256 x 1024, constant caches");
  g_kv_const = false;
  return 0;
}

/* Random bytes (quantized weights: values and scales alike; the timing does not depend on them,
 * and rows of random f16 scales may hold NaN, which costs the same). */
__global__ void fill_bytes(uint32_t *p, size_t n_words, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_words;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = h;
  }
}

/* --quant: y = x W^T for Llama-3-8B's linear shapes, bf16 (the ops table) against 4-bit rows
 * (PD_DTYPE_Q4) and FP8 rows with per-token FP8 activations (F8WA) through each of the CUDA
 * backend's three paths: the quantized GEMV (M <= 8), the tensor-core product on bf16 x, and W
 * dequantized to bf16 for cuBLAS (each path's x conversions included). Microseconds, the weight
 * bytes read per second (against the copy ceiling) or TFLOP/s, and the speedup over bf16 at the
 * same M. Weights cycle through copies of 512 MiB or more, as the GEMV rows above. */
static void quant_bench(double copy_gbs, int n_sm) {
  static const int shapes[][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  static const int ms_[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048};
  constexpr int NM = sizeof ms_ / sizeof ms_[0];
  static const pd_dtype dts[] = {PD_DTYPE_BF16, PD_DTYPE_Q4, PD_DTYPE_F8WA};
  static const char *names[] = {"bf16", "int4", "fp8"};
  static const char *paths[] = {"ops", "gemv", "mma", "deq+cuBLAS"};
  for (const auto &sh : shapes) {
    const int N = sh[0], K = sh[1];
    float *x = (float *)dalloc((size_t)2048 * K * 4), *y = (float *)dalloc((size_t)2048 * N * 4);
    float *xq = (float *)dalloc((size_t)2048 * K * 4), *xs = (float *)dalloc(2048 * 4);
    __nv_bfloat16 *x16 = (__nv_bfloat16 *)dalloc((size_t)2048 * K * 2);
    __nv_bfloat16 *wdq = (__nv_bfloat16 *)dalloc((size_t)N * K * 2);
    float *qws = (float *)dalloc((size_t)8 * 2048 * N * 4);
    fill_f32<<<1024, 256, 0, st>>>(x, (size_t)2048 * K, 1.0f, 7);
    double base[NM] = {0};
    for (int d = 0; d < 3; d++) {
      const pd_dtype dt = dts[d];
      const size_t wb = (size_t)N * pd_dtype_row_bytes(dt, K);
      int copies = (int)((512ull << 20) / wb) + 1;
      if (copies > 16) copies = 16;
      std::vector<void *> w(copies);
      for (int c = 0; c < copies; c++) {
        w[c] = dalloc(wb);
        if (dt == PD_DTYPE_BF16)
          fill_bf16<<<4096, 256, 0, st>>>((__nv_bfloat16 *)w[c], (size_t)N * K, 0.02f, 10 + c);
        else
          fill_bytes<<<4096, 256, 0, st>>>((uint32_t *)w[c], wb / 4, 10 + c);
      }
      for (int p = 0; p < (d ? 4 : 1); p++)
        for (int mi = 0; mi < NM; mi++) {
          const int M = ms_[mi];
          if (p == 1 && M > PD_CUDA_QGEMV_MAX_M) continue;
          const double ms = time_ms(M >= 256 ? 10 : 40, [&](int i) {
            const void *wi = w[i % copies];
            if (p == 0) {
              be->ops.matmul(be, y, x, wi, dt, NULL, M, N, K);
            } else if (p == 1) {
              const float *xi = x;
              if (dt == PD_DTYPE_F8WA) {
                pd_cuda_fp8_qdq_rows(st, xq, x, M, K);
                xi = xq;
              }
              pd_cuda_qgemv(st, y, xi, wi, dt, NULL, M, N, K, false);
            } else if (p == 2) {
              if (dt == PD_DTYPE_F8WA) pd_cuda_fp8_quant16(st, x16, xs, x, M, K);
              else pd_cuda_convert(st, x16, PD_DTYPE_BF16, x, (size_t)M * K);
              pd_cuda_qmma(st, y, qws, pd_cuda_qmma_splits(M, N, K, n_sm), x16,
                           dt == PD_DTYPE_F8WA ? xs : NULL, wi, dt, NULL, M, N, K, false);
            } else {
              const float *xi = x;
              if (dt == PD_DTYPE_F8WA) {
                pd_cuda_fp8_qdq_rows(st, xq, x, M, K);
                xi = xq;
              }
              pd_cuda_dequant16(st, wdq, wi, dt, N, K);
              be->ops.matmul(be, y, xi, wdq, PD_DTYPE_BF16, NULL, M, N, K);
            }
          });
          if (d == 0) base[mi] = ms;
          char shape[80], what[32];
          snprintf(shape, sizeof shape, "M=%d N=%d K=%d %s %s", M, N, K, names[d], paths[p]);
          snprintf(what, sizeof what, d ? "x%.2f vs bf16" : "matmul", d ? base[mi] / ms : 0.0);
          const double gbs = wb / (ms * 1e-3) / 1e9;
          if (M >= 64)
            row(what, shape, ms * 1000, "TFLOP/s", 2.0 * M * N * (double)K / (ms * 1e-3) / 1e12, -1);
          else
            row(what, shape, ms * 1000, "GB/s", gbs, 100.0 * gbs / copy_gbs);
        }
      for (int c = 0; c < copies; c++) be->ops.free(be, w[c]);
    }
    for (void *p : {(void *)x, (void *)y, (void *)xq, (void *)xs, (void *)x16, (void *)wdq, (void *)qws})
      be->ops.free(be, p);
  }
  be->ops.sync(be);
  pd_err e = {};
  if (pd_backend_cuda_status(be, &e) != PD_OK) fprintf(stderr, "backend error: %s\n", e.msg);
}

int main(int argc, char **argv) {
  int dev = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--power") && i + 1 < argc) {
      g_power_s = atof(argv[++i]);
      if (!(g_power_s > 0 && g_power_s <= 600)) {
        fprintf(stderr, "pd-bench-cuda: --power takes seconds (0 < S <= 600)\n");
        return 2;
      }
      if (i + 1 < argc && !(argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9'))
        g_power_only = argv[++i];
    } else if (!strcmp(argv[i], "--attn")) {
      g_attn_only = true;
    } else if (!strcmp(argv[i], "--quant")) {
      g_quant_only = true;
    } else if (argv[i][0] >= '0' && argv[i][0] <= '9') {
      dev = atoi(argv[i]);
    } else {
      fprintf(stderr, "usage: pd-bench-cuda [device] [--attn | --quant | --power SECONDS [WHAT]]\n");
      return 2;
    }
  }
  if (pd_cuda_device_count() == 0) {
    printf("pd-bench-cuda: no CUDA device\n");
    return 77;
  }
  pd_err e = {};
  pd_backend_opts o = {};
  o.device = dev;
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
  if (g_power_s > 0) {
    if (!nvml_open(dev)) {
      fprintf(stderr, "pd-bench-cuda: --power needs NVML (libnvidia-ml.so.1) with the energy "
                      "counter\n");
      return 1;
    }
    const int rc = power_main();
    pd_backend_destroy(be);
    return rc;
  }
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

  if (g_quant_only) {
    quant_bench(copy_gbs, prop.multiProcessorCount);
    pd_backend_destroy(be);
    return 0;
  }

  /* ---- cuBLAS bf16 GEMM 8192^3 */
  if (!g_attn_only) {
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
  for (int si = 0; si < (g_attn_only ? 0 : 6); si++) {
    const int N = shapes[si][0], K = shapes[si][1];
    const size_t wb = (size_t)N * K * 2;
    std::vector<void *> w = weight_copies(N, K);
    const int copies = (int)w.size();
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
    /* the same 256 x 1k by page size (--block-size): a page holds one head's rows contiguously
     * (16 tokens x 256 bytes at 16), so the page size sets how long the runs the KV reads
     * stream are */
    for (int bs = 16; bs <= 256; bs *= 2) {
      double us = attn_case(256, 1, 1024, 32, 8, 128, bs, PD_DTYPE_BF16, &bytes);
      char shape[80];
      snprintf(shape, sizeof shape, "256 seqs x 1024 ctx, bf16, pages of %d", bs);
      double gbs = bytes / (us * 1e-6) / 1e9;
      row("decode attn", shape, us, "GB/s", gbs, 100.0 * gbs / copy_gbs);
    }
  }
  /* ---- prefill attention */
  if (!g_attn_only) {
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
  if (!g_attn_only) {
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
