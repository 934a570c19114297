/* The CUDA backend: fills the ops table of backend.h (see pd/backend_cuda.h for the contract).
 *
 * This file holds the state and the glue: argument checks, device memory, the pinned staging of
 * device-to-host copies, cuBLAS, the choice of kernel and of the split count for each call, and
 * error recording. The kernels live in the cuda_*.cu files beside it. Every op queues its work on
 * the backend's stream and returns; nothing is allocated in the forward's hot path: the cuBLAS
 * workspace, the bf16 activation buffer, the attention split partials and the tile scratch are
 * allocated at create and grown (after a stream sync) only when a call needs more than ever
 * before. */
#include <cublas_v2.h>
#include <mutex>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_state.h"
#include "pd/backend_cuda.h"

namespace {

constexpr size_t kBlasWorkspace = (size_t)32 << 20; /* cuBLAS' recommendation for Hopper */
constexpr size_t kPinnedChunk = PD_CUDA_PIN_BYTES; /* two of these stage device-to-host copies */
constexpr size_t kXconvInitial = (size_t)16 << 20;  /* bf16 x for cuBLAS: 2048 x 4096 tokens */
constexpr size_t kAttnWorkspace = (size_t)64 << 20; /* attention split partials */
constexpr int kTilesInitial = 4096;                  /* tile prefix sums: sequences + 1 */

thread_local int tl_dev = -1;

void use_device(cuda_impl *c) { pd_cuda_use_device(c); }
/* Scratch of the forward's ops, which decode graphs record. */
void grow(cuda_impl *c, void **buf, size_t *size, size_t bytes) {
  pd_cuda_grow(c, buf, size, bytes, true);
}

bool float_dtype(pd_dtype t) {
  return t == PD_DTYPE_F32 || t == PD_DTYPE_F16 || t == PD_DTYPE_BF16;
}

/* A weight dtype the matmuls take at this K: the float types, and the quantized rows of
 * cuda_quant.cu where their kernels take K. */
bool weight_ok(pd_dtype t, int K) { return float_dtype(t) || pd_cuda_quant_ok(t, K); }

} // namespace

cudaError_t pd_cuda_smem_optin(const void *kernel, size_t bytes) {
  static std::mutex mu;
  static struct {
    const void *kernel;
    unsigned long long devices;
  } done[64];
  static int n_done;
  int dev = 0;
  cudaError_t r = cudaGetDevice(&dev);
  if (r != cudaSuccess) return r;
  const unsigned long long bit = 1ull << (dev & 63);
  std::lock_guard<std::mutex> lock(mu);
  int i = 0;
  while (i < n_done && done[i].kernel != kernel) i++;
  if (i < n_done && (done[i].devices & bit)) return cudaSuccess;
  r = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  if (r != cudaSuccess) return r;
  if (i == n_done && n_done < 64) done[n_done++] = {kernel, 0};
  if (i < n_done) done[i].devices |= bit;
  return cudaSuccess;
}

void pd_cuda_record(cuda_impl *c, const char *fmt, ...) {
  if (c->status != PD_OK) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->msg, sizeof c->msg, fmt, ap);
  va_end(ap);
  c->status = PD_EBACKEND;
  fprintf(stderr, "pdserve cuda backend: %s\n", c->msg);
}

bool pd_cuda_ck(cuda_impl *c, cudaError_t r, const char *what, const char *file, int line) {
  if (r == cudaSuccess) return true;
  pd_cuda_record(c, "%s:%d: %s: %s", file, line, what, cudaGetErrorString(r));
  return false;
}
bool pd_cuda_ckb(cuda_impl *c, cublasStatus_t r, const char *what, const char *file, int line) {
  if (r == CUBLAS_STATUS_SUCCESS) return true;
  pd_cuda_record(c, "%s:%d: %s: cuBLAS status %d", file, line, what, (int)r);
  return false;
}

void pd_cuda_use_device(cuda_impl *c) {
  if (tl_dev != c->dev) {
    CK(c, cudaSetDevice(c->dev));
    tl_dev = c->dev;
  }
}

void pd_cuda_free_retired(cuda_impl *c) {
  for (int i = 0; i < c->n_retired; i++) cudaFree(c->retired[i]);
  free(c->retired);
  c->retired = NULL;
  c->n_retired = c->cap_retired = 0;
}

/* Keeps p for the graphs that may read it; false when the list cannot grow (p is then kept
 * for good: a leak is better than a replay into freed memory). */
static bool retire(cuda_impl *c, void *p) {
  if (c->n_retired == c->cap_retired) {
    const int cap = c->cap_retired ? 2 * c->cap_retired : 8;
    void **v = static_cast<void **>(realloc(c->retired, (size_t)cap * sizeof *v));
    if (!v) return false;
    c->retired = v;
    c->cap_retired = cap;
  }
  c->retired[c->n_retired++] = p;
  return true;
}

void pd_cuda_grow(cuda_impl *c, void **buf, size_t *size, size_t bytes, bool in_graphs) {
  if (bytes <= *size) return;
  PD_ASSERT(!c->capturing && "cuda backend: scratch must not grow during a graph capture");
  const bool keep = in_graphs && c->n_graphs > 0 && *buf;
  bytes += bytes / 4;
  if (keep && bytes < 2 * *size) bytes = 2 * *size;
  CK(c, cudaStreamSynchronize(c->st));
  if (!keep) CK(c, cudaFree(*buf));
  else if (!retire(c, *buf))
    fprintf(stderr, "pdserve cuda backend: out of host memory: %zu bytes of scratch stay "
            "allocated\n", *size);
  *buf = NULL;
  *size = 0;
  cudaError_t r = cudaMalloc(buf, bytes);
  if (r != cudaSuccess) {
    cudaGetLastError(); /* out of memory is not sticky */
    *buf = NULL;
    snprintf(c->soft_msg, sizeof c->soft_msg,
             "out of GPU memory: %zu bytes of scratch for a batch could not be allocated (%s); "
             "a smaller --max-batch-tokens or --gpu-memory-utilization leaves room",
             bytes, cudaGetErrorString(r));
    throw pd_cuda_scratch_oom{};
  }
  *size = bytes;
}

void pd_cuda_soft_fail(cuda_impl *c) {
  if (!c->soft_failed) fprintf(stderr, "pdserve cuda backend: %s\n", c->soft_msg);
  c->soft_failed = true;
}

namespace {

/* ---- memory ------------------------------------------------------------------------------- */

void *cu_alloc(pd_backend *be, size_t bytes) {
  cuda_impl *c = impl_of(be);
  use_device(c);
  void *p = NULL;
  if (bytes == 0) bytes = 1;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError(); /* out of memory is not sticky: the caller gets NULL */
    return NULL;
  }
  if (!CK(c, cudaMemsetAsync(p, 0, bytes, c->st))) {
    cudaFree(p);
    return NULL;
  }
  return p;
}

void cu_free(pd_backend *be, void *p) {
  if (!p) return;
  cuda_impl *c = impl_of(be);
  use_device(c);
  CK(c, cudaFree(p));
}

/* The host buffer may be reused as soon as this returns: CUDA stages pageable memory before
 * returning; for page-locked memory (which it would read later) the stream is synchronised. */
void cu_to_device(pd_backend *be, void *dst, const void *src, size_t bytes) {
  if (!bytes) return;
  cuda_impl *c = impl_of(be);
  use_device(c);
  CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->st));
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, src) == cudaSuccess) {
    if (at.type == cudaMemoryTypeHost) CK(c, cudaStreamSynchronize(c->st));
  } else {
    cudaGetLastError();
  }
}

/* A page-locked source the caller keeps until the next sync: no sync here (and so capturable:
 * a graph's metadata upload is a node of the graph). */
void cu_to_device_async(pd_backend *be, void *dst, const void *src, size_t bytes) {
  if (!bytes) return;
  cuda_impl *c = impl_of(be);
  use_device(c);
  CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->st));
}

/* Device to host through two pinned chunks: chunk i+1 is in flight while chunk i is copied out,
 * so large copies (logits) run near PCIe speed without pinning the caller's memory. Complete on
 * return. */
void cu_to_host(pd_backend *be, void *dst, const void *src, size_t bytes) {
  if (!bytes) return;
  cuda_impl *c = impl_of(be);
  use_device(c);
  if (!c->pin[0]) {
    CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->st));
    CK(c, cudaStreamSynchronize(c->st));
    return;
  }
  const size_t n = (bytes + kPinnedChunk - 1) / kPinnedChunk;
  auto len = [&](size_t i) { return i + 1 < n ? kPinnedChunk : bytes - i * kPinnedChunk; };
  for (size_t i = 0; i < n; i++) {
    const int b = (int)(i & 1);
    if (!CK(c, cudaMemcpyAsync(c->pin[b], (const char *)src + i * kPinnedChunk, len(i),
                               cudaMemcpyDeviceToHost, c->st)))
      return;
    CK(c, cudaEventRecord(c->pin_ev[b], c->st));
    if (i > 0) {
      const int pb = (int)((i - 1) & 1);
      if (!CK(c, cudaEventSynchronize(c->pin_ev[pb]))) return;
      memcpy((char *)dst + (i - 1) * kPinnedChunk, c->pin[pb], len(i - 1));
    }
  }
  const int lb = (int)((n - 1) & 1);
  if (!CK(c, cudaEventSynchronize(c->pin_ev[lb]))) return;
  memcpy((char *)dst + (n - 1) * kPinnedChunk, c->pin[lb], len(n - 1));
}

void cu_copy(pd_backend *be, void *dst, const void *src, size_t bytes) {
  if (!bytes) return;
  cuda_impl *c = impl_of(be);
  use_device(c);
  CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->st));
}

/* Free and total device memory (sizes the KV cache from --gpu-memory-utilization). */
static void cu_mem_info(pd_backend *be, size_t *free_bytes, size_t *total_bytes) {
  cuda_impl *c = impl_of(be);
  use_device(c);
  *free_bytes = *total_bytes = 0;
  CK(c, cudaMemGetInfo(free_bytes, total_bytes));
}

void cu_sync(pd_backend *be) {
  cuda_impl *c = impl_of(be);
  use_device(c);
  CK(c, cudaStreamSynchronize(c->st));
}

/* ---- matmul ------------------------------------------------------------------------------- */

/* Our GEMV up to GEMV_ROWS rows, cuBLAS above: on the H200 the GEMV reads W at 63-95% of copy
 * bandwidth for M <= 2 but under 60% at M = 8, where cuBLAS does better. */
enum { GEMV_ROWS = 2 };
static_assert(GEMV_ROWS <= PD_CUDA_GEMV_MAX_M, "the GEMV kernels take at most 8 rows");

/* cuBLAS: y[M,N] (type yt) = x16[M,K] W[N,K]^T + beta y, 16-bit operands, f32 accumulation.
 * Row-major y = x W^T is, column-major, y^T[N,M] = W^T... : A = W seen as a K x N column-major
 * matrix (lda = K) transposed, B = x as K x M (ldb = K), C = y as N x M. */
static void gemm16(cuda_impl *c, void *y, cudaDataType_t yt, const void *x16, const void *w,
                   pd_dtype wdt, int M, int N, int K, float beta) {
  const float one = 1.0f;
  const cudaDataType_t t = wdt == PD_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  CKB(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, t, K, x16, t, K, &beta,
                      y, yt, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* y (+)= x W^T + bias for quantized W (cuda_quant.cu): decode rows by the quantized GEMV (F8WA's
 * activations through their FP8 quantize-dequantize first), up to qmma_rows rows by the
 * tensor-core product on bf16 x (F8WA: the e4m3 values of x / s and the row scales s), and
 * above, W dequantized to bf16 for cuBLAS. The bounds are where each path stops being the
 * fastest (pd-bench-cuda --quant, H100, Llama-3-8B shapes): the tensor-core product reads 4-bit
 * W at about a third of copy bandwidth up to M = 16 and runs at 110-160 TFLOP/s from M = 64; at
 * M = 256 dequantizing for cuBLAS is faster (0.39x of bf16 against 0.31x). */
enum { QGEMV_ROWS = 4 };
static_assert(QGEMV_ROWS <= PD_CUDA_QGEMV_MAX_M, "the quantized GEMV takes at most 8 rows");
static int qmma_rows(pd_dtype wdt) { return wdt == PD_DTYPE_Q4 ? 192 : 64; }

static void qmatmul(cuda_impl *c, float *y, const float *x, const void *w, pd_dtype wdt,
                    const float *bias, int M, int N, int K, bool accumulate) {
  const bool f8a = wdt == PD_DTYPE_F8WA;
  if (M <= qmma_rows(wdt)) {
    if (M <= QGEMV_ROWS && ((uintptr_t)x & 15) == 0) {
      if (f8a) {
        grow(c, reinterpret_cast<void **>(&c->xq), &c->xq_size, (size_t)M * K * sizeof(float));
        pd_cuda_fp8_qdq_rows(c->st, c->xq, x, M, K);
        CK_LAUNCH(c, "fp8 activations");
        x = c->xq;
      }
      pd_cuda_qgemv(c->st, y, x, w, wdt, bias, M, N, K, accumulate);
      CK_LAUNCH(c, "gemv (quantized)");
      return;
    }
    grow(c, &c->xconv, &c->xconv_size, (size_t)M * K * 2);
    __nv_bfloat16 *x16 = static_cast<__nv_bfloat16 *>(c->xconv);
    if (f8a) {
      grow(c, reinterpret_cast<void **>(&c->xq), &c->xq_size, (size_t)M * sizeof(float));
      pd_cuda_fp8_quant16(c->st, x16, c->xq, x, M, K);
    } else {
      pd_cuda_convert(c->st, x16, PD_DTYPE_BF16, x, (size_t)M * K);
    }
    CK_LAUNCH(c, "convert x");
    const int splits = pd_cuda_qmma_splits(M, N, K, c->n_sm);
    if (splits > 1)
      grow(c, reinterpret_cast<void **>(&c->qws), &c->qws_size, (size_t)splits * M * N * 4);
    pd_cuda_qmma(c->st, y, c->qws, splits, x16, f8a ? c->xq : NULL, w, wdt, bias, M, N, K,
                 accumulate);
    CK_LAUNCH(c, "quantized product (tensor cores)");
    return;
  }
  if (f8a) {
    grow(c, reinterpret_cast<void **>(&c->xq), &c->xq_size, (size_t)M * K * sizeof(float));
    pd_cuda_fp8_qdq_rows(c->st, c->xq, x, M, K);
    CK_LAUNCH(c, "fp8 activations");
    x = c->xq;
  }
  grow(c, &c->wdq, &c->wdq_size, (size_t)N * K * 2);
  pd_cuda_dequant16(c->st, static_cast<__nv_bfloat16 *>(c->wdq), w, wdt, N, K);
  CK_LAUNCH(c, "dequantize");
  grow(c, &c->xconv, &c->xconv_size, (size_t)M * K * 2);
  pd_cuda_convert(c->st, c->xconv, PD_DTYPE_BF16, x, (size_t)M * K);
  CK_LAUNCH(c, "convert x");
  gemm16(c, y, CUDA_R_32F, c->xconv, c->wdq, PD_DTYPE_BF16, M, N, K, accumulate ? 1.0f : 0.0f);
  if (bias) {
    pd_cuda_bias(c->st, y, bias, M, N);
    CK_LAUNCH(c, "bias");
  }
}

/* y = x W^T + bias, or y += that when accumulate. */
static void matmul_impl(cuda_impl *c, float *y, const float *x, const void *w, pd_dtype wdt,
                        const float *bias, int M, int N, int K, bool accumulate) {
  if (K == 0) {
    if (!accumulate) CK(c, cudaMemsetAsync(y, 0, (size_t)M * N * sizeof(float), c->st));
    if (bias) pd_cuda_bias(c->st, y, bias, M, N);
    CK_LAUNCH(c, "matmul (K = 0)");
    return;
  }
  if (pd_cuda_quant_dtype(wdt)) {
    qmatmul(c, y, x, w, wdt, bias, M, N, K, accumulate);
    return;
  }
  if (M <= GEMV_ROWS) {
    pd_cuda_gemv(c->st, y, x, w, wdt, bias, M, N, K, accumulate);
    CK_LAUNCH(c, "gemv");
    return;
  }
  /* Row-major y[M,N] = x[M,K] W[N,K]^T is, column-major, y^T[N,M] = W^T... : A = W seen as a
   * K x N column-major matrix (lda = K) transposed, B = x as K x M (ldb = K), C = y as N x M. */
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  if (wdt == PD_DTYPE_F32) {
    CKB(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_32F, K, x,
                        CUDA_R_32F, K, &beta, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F_FAST_TF32,
                        CUBLAS_GEMM_DEFAULT));
  } else {
    grow(c, &c->xconv, &c->xconv_size, (size_t)M * K * 2);
    pd_cuda_convert(c->st, c->xconv, wdt, x, (size_t)M * K);
    CK_LAUNCH(c, "convert x");
    gemm16(c, y, CUDA_R_32F, c->xconv, w, wdt, M, N, K, beta);
  }
  if (bias) {
    pd_cuda_bias(c->st, y, bias, M, N);
    CK_LAUNCH(c, "bias");
  }
}

void cu_matmul(pd_backend *be, float *y, const float *x, const void *w, pd_dtype wdt,
               const float *bias, int M, int N, int K) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && N >= 0 && K >= 0);
  PD_ASSERT(K == 0 || weight_ok(wdt, K));
  if (M == 0 || N == 0) return;
  use_device(c);
  matmul_impl(c, y, x, w, wdt, bias, M, N, K, false);
}

/* ---- row ops ------------------------------------------------------------------------------ */

void cu_rmsnorm(pd_backend *be, float *y, const float *x, const float *w, float eps, int M, int D) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && D >= 0);
  if (M == 0 || D == 0) return;
  use_device(c);
  pd_cuda_rmsnorm(c->st, y, const_cast<float *>(x), NULL, w, eps, M, D);
  CK_LAUNCH(c, "rmsnorm");
}

void cu_add_rmsnorm(pd_backend *be, float *y, float *x, const float *r, const float *w, float eps,
                    int M, int D) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && D >= 0);
  if (M == 0 || D == 0) return;
  use_device(c);
  pd_cuda_rmsnorm(c->st, y, x, r, w, eps, M, D);
  CK_LAUNCH(c, "add_rmsnorm");
}

void cu_embed(pd_backend *be, float *y, const void *table, pd_dtype dt, const int32_t *ids, int M,
              int D) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && D >= 0);
  PD_ASSERT(float_dtype(dt));
  if (M == 0 || D == 0) return;
  use_device(c);
  pd_cuda_embed(c->st, y, table, dt, ids, M, D, NULL, NULL, NULL);
  CK_LAUNCH(c, "embed");
}

void cu_rope(pd_backend *be, float *q, float *k, const int32_t *pos, const float *inv_freq, int M,
             int n_q_heads, int n_kv_heads, int head_dim) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && n_q_heads >= 0 && n_kv_heads >= 0 && head_dim >= 0);
  if (M == 0 || head_dim < 2 || (n_q_heads == 0 && n_kv_heads == 0)) return;
  use_device(c);
  pd_cuda_rope(c->st, q, k, pos, inv_freq, M, n_q_heads, n_kv_heads, head_dim);
  CK_LAUNCH(c, "rope");
}

void cu_swiglu(pd_backend *be, float *y, const float *gu, int M, int F) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && F >= 0);
  if (M == 0 || F == 0) return;
  use_device(c);
  pd_cuda_swiglu(c->st, y, gu, M, F);
  CK_LAUNCH(c, "swiglu");
}

void cu_kv_write(pd_backend *be, const pd_kv_layer *kv, const pd_kv_shape *shape, const float *k,
                 const float *v, const int32_t *slots, int M) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && shape->block_size > 0 && shape->num_kv_heads > 0 && shape->head_dim > 0);
  PD_ASSERT(float_dtype(shape->dtype));
  if (M == 0) return;
  use_device(c);
  pd_cuda_kv_write(c->st, kv, shape, k, v, slots, M);
  CK_LAUNCH(c, "kv_write");
}

void cu_get_rows(pd_backend *be, float *y, const float *x, const int32_t *idx, int n, int D) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(n >= 0 && D >= 0);
  if (n == 0 || D == 0) return;
  use_device(c);
  pd_cuda_get_rows(c->st, y, x, idx, n, D);
  CK_LAUNCH(c, "get_rows");
}

void cu_add(pd_backend *be, float *y, const float *x, size_t n) {
  cuda_impl *c = impl_of(be);
  if (n == 0) return;
  use_device(c);
  pd_cuda_add(c->st, y, x, n);
  CK_LAUNCH(c, "add");
}

/* ---- fused decode-path ops ---------------------------------------------------------------- */

void cu_matmul_glu(pd_backend *be, float *act, float *gu, const float *x, const void *w,
                   pd_dtype wdt, const float *bias, int M, int F, int K) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && F >= 0 && K >= 0);
  PD_ASSERT(K == 0 || weight_ok(wdt, K));
  if (M == 0 || F == 0) return;
  use_device(c);
  if (K > 0 && pd_cuda_gemv_fused_ok(x, w, wdt, M, K)) {
    pd_cuda_gemv_glu(c->st, act, x, w, wdt, bias, M, F, K, NULL);
    CK_LAUNCH(c, "gemv_glu");
    return;
  }
  be->ops.matmul(be, gu, x, w, wdt, bias, M, 2 * F, K);
  pd_cuda_swiglu(c->st, act, gu, M, F);
  CK_LAUNCH(c, "swiglu");
}

void cu_rope_kv_write(pd_backend *be, float *q_out, const float *qkv, const int32_t *pos,
                      const float *inv_freq, const pd_kv_layer *kv, const pd_kv_shape *shape,
                      const int32_t *slots, int M, int n_q_heads) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && n_q_heads > 0 && shape->block_size > 0 && shape->num_kv_heads > 0);
  PD_ASSERT(shape->head_dim >= 2 && shape->head_dim % 2 == 0 && shape->head_dim <= 256);
  PD_ASSERT(float_dtype(shape->dtype));
  if (M == 0) return;
  use_device(c);
  pd_cuda_rope_kv_write(c->st, q_out, qkv, pos, inv_freq, kv, shape, slots, M, n_q_heads);
  CK_LAUNCH(c, "rope_kv_write");
}

/* ---- attention ---------------------------------------------------------------------------- */

/* Splits of the context so that about `target` blocks run, each split at least min_len keys,
 * within the partial workspace and the merge kernel's limit. Sets a->n_splits, a->split_len. */
void choose_splits(cuda_impl *c, pd_cuda_attn *a, long long blocks, long long target, int span,
                   int min_len, int align) {
  long long per_split = (long long)a->n_tokens * a->n_q_heads * ((long long)a->head_dim + 2) * 4;
  long long n = (target + blocks - 1) / blocks;
  long long by_len = (span + min_len - 1) / min_len;
  long long by_ws = (long long)(c->attn_ws_size / (size_t)per_split);
  if (n > by_len) n = by_len;
  if (n > by_ws) n = by_ws;
  if (n > pd_cuda_attn_max_splits()) n = pd_cuda_attn_max_splits();
  if (n <= 1) {
    a->n_splits = 1;
    a->split_len = 1 << 30; /* covers any context; the kernels clamp in 64-bit arithmetic */
    return;
  }
  int len = (int)((span + n - 1) / n);
  len = (len + align - 1) / align * align;
  a->split_len = len;
  a->n_splits = (span + len - 1) / len;
  if (a->n_splits == 1) a->split_len = 1 << 30;
  a->part_o = c->attn_ws;
  a->part_ml = reinterpret_cast<float2 *>(c->attn_ws + (size_t)a->n_splits * a->n_tokens *
                                                           a->n_q_heads * a->head_dim);
}

/* The RoPE and cache writes of a QKV product that an attention call does itself (qkv_attention):
 * inside the decode kernel where it runs one block per (sequence, KV head), as a
 * rope_kv_write kernel before it otherwise. */
struct attn_rope {
  const float *qkv, *inv_freq;
  const int32_t *pos, *slots;
};

/* Attention as the `attention` op, into out (f32) or out16 (bf16, when not NULL); rope: the
 * QKV rows' RoPE and cache writes first (q is then where the rotated q rows go). */
static void attn_core(cuda_impl *c, float *out, __nv_bfloat16 *out16, const float *q,
                      const pd_kv_layer *kv, const pd_kv_shape *shape, const pd_attn_batch *b,
                      int n_q_heads, float scale, int sliding_window, const attn_rope *rope) {
  PD_ASSERT(shape->block_size > 0 && shape->num_kv_heads > 0 && shape->head_dim > 0);
  PD_ASSERT(n_q_heads > 0 && n_q_heads % shape->num_kv_heads == 0);
  PD_ASSERT(float_dtype(shape->dtype));
  PD_ASSERT(shape->head_dim % 2 == 0 && shape->head_dim <= 256);
  PD_ASSERT(b->n_seqs >= 0 && b->n_tokens >= b->n_seqs);
  if (b->n_seqs == 0 || b->n_tokens == 0) return;
  use_device(c);
  /* the rope_kv_write kernel, unless the decode kernel takes it */
  auto rope_first = [&]() {
    if (!rope) return;
    pd_cuda_rope_kv_write(c->st, const_cast<float *>(q), rope->qkv, rope->pos, rope->inv_freq,
                          kv, shape, rope->slots, b->n_tokens, n_q_heads);
    CK_LAUNCH(c, "rope_kv_write");
    rope = nullptr;
  };
  pd_cuda_attn a;
  memset(&a, 0, sizeof a);
  a.out = out;
  a.q = q;
  a.k = kv->k;
  a.v = kv->v;
  a.kv_dtype = shape->dtype;
  a.block_size = shape->block_size;
  a.num_blocks = shape->num_blocks;
  a.n_kv_heads = shape->num_kv_heads;
  a.head_dim = shape->head_dim;
  a.n_q_heads = n_q_heads;
  a.group = n_q_heads / shape->num_kv_heads;
  a.scale = scale;
  a.window = sliding_window;
  a.q_start = b->q_start;
  a.ctx_len = b->ctx_len;
  a.block_tables = b->block_tables;
  a.max_blocks = b->max_blocks;
  a.n_seqs = b->n_seqs;
  a.n_tokens = b->n_tokens;
  a.max_ctx_len = b->max_ctx_len > 0 ? b->max_ctx_len : 1;
  a.n_splits = 1;
  a.split_len = 1 << 30;
  a.out16 = out16;

  if (!pd_cuda_attn_tuned_hd(a.head_dim)) {
    rope_first();
    pd_cuda_attn_generic(c->st, &a);
    CK_LAUNCH(c, "attention (generic)");
    return;
  }
  if (b->n_tokens == b->n_seqs) {
    /* Pure decode: every sequence brings exactly one token (each brings at least one); tensor
     * cores for 16-bit caches, the SIMT kernel otherwise. */
    int span = a.max_ctx_len;
    if (a.window > 0 && a.window < span) span = a.window;
    if (pd_cuda_attn_decode_tc_ok(&a)) {
      /* few sequences (batch-1 decode): splits of 64 keys, so that the latency of a block's
       * serial walk over its keys does not set the step's time (H200, Llama-3-8B batch 1 at
       * 128-384 tokens of context: 231 tok/s; 128 keys 229, 256 207, 512 or no split 226) */
      const long long blocks = (long long)a.n_seqs * a.n_kv_heads;
      /* up to 8 splits merge inside a cluster, without the merge kernel (H200, Llama-3-8B
       * batch 1: 4.24 -> 4.20 ms a step; one sequence over 384 keys 9.5 -> 7.9 us); the
       * splits aim at 6 blocks an SM */
      choose_splits(c, &a, blocks, 6LL * c->n_sm, span, blocks < c->n_sm ? 64 : 256,
                    64);
      /* per sequence (see pd_cuda_attn), except where the splits are of the smallest length,
       * 64 keys: each sequence's own would be 64 too, and a fixed length lets the kernel's
       * first block-table loads go out before the context length is known */
      if (a.n_splits > 1 && a.split_len != 64) a.split_len = 0;
      a.cluster = a.n_splits > 1 &&
                  a.n_splits <= pd_cuda_attn_decode_tc_max_cluster(&a, c->cc_major);
      /* (not for splits of one tile: batch 1's attention over a few hundred keys is a chain
       * of latencies, where the tensor-map copies' barrier adds one: 4.071 -> 4.080 ms a step) */
      a.tma = a.split_len != 64 && pd_cuda_attn_decode_tma_ok(&a, c->cc_major);
      if (rope && a.n_splits == 1 && !a.cluster) {
        a.rope_qkv = rope->qkv;
        a.rope_inv_freq = rope->inv_freq;
        a.rope_pos = rope->pos;
        a.rope_slots = rope->slots;
        rope = nullptr;
      }
      rope_first();
      pd_cuda_attn_decode_tc(c->st, &a);
      CK_LAUNCH(c, "attention (decode, tensor cores)");
      if (a.cluster) return;
    } else {
      const int maxg = pd_cuda_attn_decode_heads(a.group);
      long long blocks = (long long)a.n_seqs * a.n_kv_heads * ((a.group + maxg - 1) / maxg);
      choose_splits(c, &a, blocks, 8LL * c->n_sm, span, 256, 64);
      if (a.n_splits > 1) a.split_len = 0; /* per sequence: see pd_cuda_attn */
      rope_first();
      pd_cuda_attn_decode(c->st, &a);
      CK_LAUNCH(c, "attention (decode)");
    }
  } else {
    a.bm = pd_cuda_attn_prefill_bm(a.head_dim, a.n_tokens, a.n_seqs, a.group, a.max_ctx_len);
    int span = a.max_ctx_len;
    if (a.window > 0 && (long long)a.window + a.bm < span) span = a.window + a.bm;
    if (a.n_seqs + 1 > c->tiles_cap) {
      void *p = c->tiles;
      size_t sz = (size_t)c->tiles_cap * sizeof(int32_t);
      grow(c, &p, &sz, ((size_t)a.n_seqs + 1) * sizeof(int32_t));
      c->tiles = static_cast<int32_t *>(p);
      c->tiles_cap = (int)(sz / sizeof(int32_t));
    }
    a.tile_start = c->tiles;
    long long tiles = (long long)a.n_tokens * a.group / a.bm + a.n_seqs;
    /* two 4-warp blocks or one 8-warp block fit an SM */
    choose_splits(c, &a, tiles * a.n_kv_heads, (a.bm == 128 ? 1LL : 2LL) * c->n_sm, span, 512, 64);
    rope_first();
    pd_cuda_attn_prefill(c->st, &a);
    CK_LAUNCH(c, "attention (prefill)");
  }
  if (a.n_splits > 1) {
    pd_cuda_attn_merge(c->st, &a);
    CK_LAUNCH(c, "attention (merge)");
  }
}

void cu_attention(pd_backend *be, float *out, const float *q, const pd_kv_layer *kv,
                  const pd_kv_shape *shape, const pd_attn_batch *b, int n_q_heads, float scale,
                  int sliding_window) {
  attn_core(impl_of(be), out, nullptr, q, kv, shape, b, n_q_heads, scale, sliding_window,
            nullptr);
}

/* ---- the layer ops (backend.h) --------------------------------------------------------------
 * The acts between them, by the consumer's needs:
 *  - ACT_F32: f32 rows [M, K].
 *  - ACT_PARTIALS (M <= GEMV_ROWS): the RMSNorm left for the decode GEMV that reads the rows to
 *    finish (pd_cuda_gemv_pre): xg = y * g [M, K] f32, then aux partial sums of y^2 a row
 *    (act_ss); auxf holds eps. A decode layer is then four GEMV kernels and the attention.
 *  - ACT_H16 (M above the GEMV rows, 16-bit weights): the rows in aux's dtype (BF16 or F16), the
 *    operand cuBLAS reads, written by the op before (the norm, the SwiGLU, the attention) instead
 *    of f32 rows to convert: half the traffic. */
enum { ACT_F32 = 0, ACT_PARTIALS = 1, ACT_H16 = 2 };

static size_t act_rows_bytes(int M, int K) { return ((size_t)M * (size_t)K * 4 + 15) & ~(size_t)15; }
static float *act_ss(const pd_act *a) {
  return reinterpret_cast<float *>(static_cast<char *>(a->data) + act_rows_bytes(a->M, a->K));
}
static void set_act(pd_act *a, int M, int K, int form, int aux, float auxf) {
  a->M = M;
  a->K = K;
  a->form = form;
  a->aux = aux;
  a->auxf = auxf;
}
static bool is16(pd_dtype t) { return t == PD_DTYPE_BF16 || t == PD_DTYPE_F16; }

size_t cu_act_bytes(pd_backend *be, int M, int K) {
  (void)be;
  return act_rows_bytes(M < 0 ? 0 : M, K < 0 ? 0 : K) +
         (size_t)GEMV_ROWS * PD_CUDA_HO_PARTS * sizeof(float);
}

/* out = rmsnorm(x [M, D]) * w: 16-bit rows for a cuBLAS consumer, f32 rows for a GEMV. */
static void act_norm(cuda_impl *c, pd_act *out, const float *x, const float *w, float eps, int M,
                     int D, pd_dtype out_wdtype) {
  if (M > GEMV_ROWS && is16(out_wdtype) && pd_cuda_rmsnorm16_ok(x, w, D)) {
    pd_cuda_rmsnorm16(c->st, out->data, out_wdtype, x, w, eps, M, D);
    CK_LAUNCH(c, "rmsnorm (16-bit out)");
    set_act(out, M, D, ACT_H16, out_wdtype, 0.0f);
  } else {
    pd_cuda_rmsnorm(c->st, static_cast<float *>(out->data), const_cast<float *>(x), NULL, w, eps,
                    M, D);
    CK_LAUNCH(c, "rmsnorm");
    set_act(out, M, D, ACT_F32, 0, 0.0f);
  }
}

void cu_norm(pd_backend *be, pd_act *out, const float *x, const float *norm_w, float eps, int M,
             int D, pd_dtype out_wdtype) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && D >= 0);
  set_act(out, M, D, ACT_F32, 0, 0.0f);
  if (M == 0 || D == 0) return;
  use_device(c);
  act_norm(c, out, x, norm_w, eps, M, D, out_wdtype);
}

/* The embedding and the first layer's norm: for decode rows the embedding kernel leaves the
 * norm's partial sums (one a row) for the QKV GEMV. */
void cu_embed_norm(pd_backend *be, float *x, pd_act *out, const void *table, pd_dtype dt,
                   const int32_t *ids, int M, int D, const float *norm_w, float eps,
                   pd_dtype out_wdtype) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(M >= 0 && D >= 0);
  PD_ASSERT(float_dtype(dt));
  set_act(out, M, D, ACT_F32, 0, 0.0f);
  if (M == 0 || D == 0) return;
  use_device(c);
  if (M <= GEMV_ROWS && D % 8 == 0) {
    pd_cuda_embed(c->st, x, table, dt, ids, M, D, norm_w, static_cast<float *>(out->data),
                  act_ss(out));
    CK_LAUNCH(c, "embed");
    set_act(out, M, D, ACT_PARTIALS, 1, eps);
    return;
  }
  pd_cuda_embed(c->st, x, table, dt, ids, M, D, NULL, NULL, NULL);
  CK_LAUNCH(c, "embed");
  act_norm(c, out, x, norm_w, eps, M, D, out_wdtype);
}

/* The operand of a product with W (wdt) from act in, for the GEMM paths: exactly one of *x16
 * (16-bit rows for cuBLAS) and *x (f32 rows) is set. */
static void gemm_operand(cuda_impl *c, const pd_act *in, pd_dtype wdt, const void **x16,
                         const float **x) {
  const int M = in->M, K = in->K;
  const bool w16 = is16(wdt) && K > 0 && M > GEMV_ROWS;
  *x16 = NULL;
  *x = static_cast<const float *>(in->data);
  if (in->form == ACT_H16) {
    /* written for this product: M above the GEMV rows and the same 16-bit type */
    PD_ASSERT(w16 && in->aux == (int)wdt && "an act in 16 bits for another weight type");
    *x16 = in->data;
    *x = NULL;
    return;
  }
  if (in->form == ACT_PARTIALS) { /* a GEMV did not take it (alignment): finish the norm */
    grow(c, reinterpret_cast<void **>(&c->xfin), &c->xfin_size, (size_t)M * K * sizeof(float));
    pd_cuda_norm_finish(c->st, c->xfin, static_cast<const float *>(in->data), act_ss(in), in->aux,
                        in->auxf, M, K);
    CK_LAUNCH(c, "norm finish");
    *x = c->xfin;
  }
  if (w16) {
    grow(c, &c->xconv, &c->xconv_size, (size_t)M * K * 2);
    pd_cuda_convert(c->st, c->xconv, wdt, *x, (size_t)M * K);
    CK_LAUNCH(c, "convert x");
    *x16 = c->xconv;
    *x = NULL;
  }
}

/* y (+)= operand W^T + bias by cuBLAS (or matmul_impl's GEMV for f32 rows) */
static void gemm_any(cuda_impl *c, float *y, const void *x16, const float *x, const void *w,
                     pd_dtype wdt, const float *bias, int M, int N, int K, bool accumulate) {
  if (!x16) {
    matmul_impl(c, y, x, w, wdt, bias, M, N, K, accumulate);
    return;
  }
  gemm16(c, y, CUDA_R_32F, x16, w, wdt, M, N, K, accumulate ? 1.0f : 0.0f);
  if (bias) {
    pd_cuda_bias(c->st, y, bias, M, N);
    CK_LAUNCH(c, "bias");
  }
}

/* The decode GEMV's view of act in (f32 rows, or the rows with their norm pending); false when
 * the product does not run as a GEMV. */
static bool gemv_input(const pd_act *in, const void *w, pd_dtype wdt, const float **xs,
                       pd_cuda_gemv_pre *pre, const pd_cuda_gemv_pre **prep) {
  const int M = in->M, K = in->K;
  if (K <= 0 || M > GEMV_ROWS || in->form == ACT_H16 ||
      !pd_cuda_gemv_fused_ok(static_cast<const float *>(in->data), w, wdt, M, K))
    return false;
  *xs = static_cast<const float *>(in->data);
  *prep = NULL;
  if (in->form == ACT_PARTIALS) {
    *pre = {act_ss(in), in->aux, in->auxf};
    *prep = pre;
  }
  return true;
}

/* A residual product whose next product norms its output, above the GEMV rows with 16-bit
 * weights: the product goes to a scratch of partial sums (its K halves as a batched GEMM where
 * K >= 8192: cuBLAS's own split-K would add a reduce kernel of its own), and one kernel adds them
 * and the bias to y and writes the RMSNorm of the new y as the next product's 16-bit operand:
 * one kernel where cuBLAS's reduce and the norm were two. */
static int resid_splits(int K) { return K >= 8192 && K % 16 == 0 ? 2 : 1; }

static bool resid_norm_ok(cuda_impl *c, const pd_linear *p, int M, int N, int K) {
  const size_t ws = (size_t)resid_splits(K) * M * N * sizeof(float);
  return K > 0 && p->eps > 0.0f && is16(p->out_wdtype) &&
         pd_cuda_rmsnorm16_ok(p->y, p->norm_w, N) &&
         (!p->bias || ((uintptr_t)p->bias & 15) == 0) &&
         (!c->capturing || c->acc_ws_size >= ws); /* (a capture cannot grow the scratch) */
}

static void resid_norm(cuda_impl *c, const pd_linear *p, const void *x16, int M, int N, int K) {
  const int splits = resid_splits(K);
  const pd_dtype wdt = p->w.dtype;
  grow(c, reinterpret_cast<void **>(&c->acc_ws), &c->acc_ws_size,
       (size_t)splits * M * N * sizeof(float));
  if (splits == 1) {
    gemm16(c, c->acc_ws, CUDA_R_32F, x16, p->w.data, wdt, M, N, K, 0.0f);
  } else {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType_t t = wdt == PD_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    const int kh = K / 2;
    CKB(c, cublasGemmStridedBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, kh, &one,
                                      p->w.data, t, K, kh, x16, t, K, kh, &zero, c->acc_ws,
                                      CUDA_R_32F, N, (long long)M * N, splits, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
  }
  pd_cuda_add_rmsnorm16(c->st, p->out->data, p->out_wdtype, p->y, c->acc_ws, splits,
                        (size_t)M * N, p->bias, p->norm_w, p->eps, M, N);
  CK_LAUNCH(c, "residual add + rmsnorm (16-bit out)");
  set_act(p->out, M, N, ACT_H16, p->out_wdtype, 0.0f);
}

/* Decode rows (M <= GEMV_ROWS) run as one GEMV kernel with the epilogue inside, reading the
 * norm the op before left pending and leaving the next one pending; larger M run the RMSNorm
 * into the 16-bit GEMM operand, cuBLAS, and the epilogue's kernel (the residual add is cuBLAS's
 * beta = 1, or the split-K reduce with the next norm). */
void cu_linear(pd_backend *be, const pd_linear *p) {
  cuda_impl *c = impl_of(be);
  const pd_act *in = p->in;
  const int M = in->M, K = in->K, N = p->w.N;
  const pd_dtype wdt = p->w.dtype;
  const void *w = p->w.data;
  PD_ASSERT(M >= 0 && N >= 0 && K >= 0 && K == p->w.K);
  PD_ASSERT(K == 0 || weight_ok(wdt, K));
  PD_ASSERT(p->epilogue != PD_LIN_GLU || N % 2 == 0);
  const bool out_act = p->epilogue == PD_LIN_GLU || (p->epilogue == PD_LIN_RESIDUAL && p->norm_w);
  const int out_K = p->epilogue == PD_LIN_GLU ? N / 2 : N;
  if (out_act) set_act(p->out, M, out_K, ACT_F32, 0, 0.0f);
  if (M == 0 || N == 0) return;
  use_device(c);
  const float *xs;
  pd_cuda_gemv_pre pre;
  const pd_cuda_gemv_pre *prep;
  if (gemv_input(in, w, wdt, &xs, &pre, &prep)) {
    switch (p->epilogue) {
    case PD_LIN_GLU:
      pd_cuda_gemv_glu(c->st, static_cast<float *>(p->out->data), xs, w, wdt, p->bias, M, N / 2,
                       K, prep);
      break;
    case PD_LIN_STORE:
      pd_cuda_gemv_fused(c->st, p->y, xs, w, wdt, p->bias, M, N, K, false, prep, NULL, NULL, NULL);
      break;
    case PD_LIN_RESIDUAL: {
      /* the next norm left pending for the GEMV after (not where this one took a pending norm:
       * one buffer of partial sums each way) */
      const int parts = pd_cuda_gemv_next_parts(N);
      const bool ho = p->norm_w && !prep && parts <= PD_CUDA_HO_PARTS && N % 8 == 0;
      pd_cuda_gemv_fused(c->st, p->y, xs, w, wdt, p->bias, M, N, K, true, prep,
                         ho ? p->norm_w : NULL, ho ? static_cast<float *>(p->out->data) : NULL,
                         ho ? act_ss(p->out) : NULL);
      CK_LAUNCH(c, "gemv (fused)");
      if (ho) set_act(p->out, M, N, ACT_PARTIALS, parts, p->eps);
      else if (p->norm_w) act_norm(c, p->out, p->y, p->norm_w, p->eps, M, N, p->out_wdtype);
      return;
    }
    }
    CK_LAUNCH(c, "gemv (fused)");
    return;
  }
  const void *x16;
  const float *x;
  gemm_operand(c, in, wdt, &x16, &x);
  switch (p->epilogue) {
  case PD_LIN_GLU:
    if (x16) {
      /* cuBLAS writes the 16-bit product; the SwiGLU writes the next product's 16-bit operand
       * where that has this weight type (a quarter of the traffic of f32 out and a conversion) */
      const cudaDataType_t t16 = wdt == PD_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
      gemm16(c, p->scratch, t16, x16, w, wdt, M, N, K, 0.0f);
      if (p->out_wdtype == wdt) {
        pd_cuda_swiglu16_to16(c->st, p->out->data, p->scratch, wdt, p->bias, M, N / 2);
        CK_LAUNCH(c, "swiglu (16-bit in and out)");
        set_act(p->out, M, N / 2, ACT_H16, wdt, 0.0f);
      } else {
        pd_cuda_swiglu16(c->st, static_cast<float *>(p->out->data), p->scratch, wdt, p->bias, M,
                         N / 2);
        CK_LAUNCH(c, "swiglu (16-bit in)");
      }
    } else {
      matmul_impl(c, p->scratch, x, w, wdt, p->bias, M, N, K, false);
      pd_cuda_swiglu(c->st, static_cast<float *>(p->out->data), p->scratch, M, N / 2);
      CK_LAUNCH(c, "swiglu");
    }
    break;
  case PD_LIN_STORE:
    gemm_any(c, p->y, x16, x, w, wdt, p->bias, M, N, K, false);
    break;
  case PD_LIN_RESIDUAL:
    if (x16 && p->norm_w && resid_norm_ok(c, p, M, N, K)) {
      resid_norm(c, p, x16, M, N, K);
      break;
    }
    gemm_any(c, p->y, x16, x, w, wdt, p->bias, M, N, K, true);
    if (p->norm_w) act_norm(c, p->out, p->y, p->norm_w, p->eps, M, N, p->out_wdtype);
    break;
  }
}

/* QKV product, RoPE, cache writes and attention. Decode rows: one GEMV with the RoPE and the
 * cache writes in its epilogue; larger M: cuBLAS, then the attention, whose decode kernel does
 * the RoPE and cache writes itself where it runs one block per (sequence, KV head). The output
 * goes to the o projection's operand: bf16 rows above the GEMV rows with bf16 weights. */
void cu_qkv_attention(pd_backend *be, const pd_qkv_attn *p) {
  cuda_impl *c = impl_of(be);
  const pd_act *in = p->in;
  const pd_kv_shape *sh = p->shape;
  const int M = in->M, K = in->K, N = p->w.N, hd = sh->head_dim;
  const pd_dtype wdt = p->w.dtype;
  PD_ASSERT(M >= 0 && K == p->w.K && p->batch->n_tokens == M);
  PD_ASSERT(K == 0 || weight_ok(wdt, K));
  PD_ASSERT(p->n_q_heads > 0 && hd % 2 == 0 && hd <= 256);
  PD_ASSERT(N == (p->n_q_heads + 2 * sh->num_kv_heads) * hd);
  PD_ASSERT(float_dtype(sh->dtype));
  const int qd = p->n_q_heads * hd;
  const bool o16 = M > GEMV_ROWS && p->out_wdtype == PD_DTYPE_BF16;
  set_act(p->out, M, qd, o16 ? ACT_H16 : ACT_F32, o16 ? PD_DTYPE_BF16 : 0, 0.0f);
  if (M == 0) return;
  use_device(c);
  float *out = o16 ? nullptr : static_cast<float *>(p->out->data);
  __nv_bfloat16 *out16 = o16 ? static_cast<__nv_bfloat16 *>(p->out->data) : nullptr;
  const float *xs;
  pd_cuda_gemv_pre pre;
  const pd_cuda_gemv_pre *prep;
  if (gemv_input(in, p->w.data, wdt, &xs, &pre, &prep)) {
    pd_cuda_gemv_rope_kv(c->st, p->q, xs, p->w.data, wdt, p->bias, M, K, prep, p->pos,
                         p->inv_freq, p->kv, sh, p->slots, p->n_q_heads);
    CK_LAUNCH(c, "gemv (qkv, rope, cache)");
    attn_core(c, out, out16, p->q, p->kv, sh, p->batch, p->n_q_heads, p->scale, p->window,
              nullptr);
    return;
  }
  const void *x16;
  const float *x;
  gemm_operand(c, in, wdt, &x16, &x);
  gemm_any(c, p->qkv, x16, x, p->w.data, wdt, p->bias, M, N, K, false);
  const attn_rope r = {p->qkv, p->inv_freq, p->pos, p->slots};
  attn_core(c, out, out16, p->q, p->kv, sh, p->batch, p->n_q_heads, p->scale, p->window, &r);
}

/* The values of an act as f32 rows on the host. */
void cu_act_read(pd_backend *be, float *rows, const pd_act *a) {
  cuda_impl *c = impl_of(be);
  const size_t n = (size_t)a->M * a->K;
  if (n == 0) return;
  use_device(c);
  const float *src = static_cast<const float *>(a->data);
  if (a->form != ACT_F32) {
    grow(c, reinterpret_cast<void **>(&c->xfin), &c->xfin_size, n * sizeof(float));
    if (a->form == ACT_H16)
      pd_cuda_widen(c->st, c->xfin, a->data, (pd_dtype)a->aux, n);
    else
      pd_cuda_norm_finish(c->st, c->xfin, src, act_ss(a), a->aux, a->auxf, a->M, a->K);
    CK_LAUNCH(c, "act read");
    src = c->xfin;
  }
  cu_to_host(be, rows, src, n * sizeof(float));
}

/* ---- create / destroy --------------------------------------------------------------------- */

pd_status cu_status(pd_backend *be, pd_err *e) {
  cuda_impl *c = impl_of(be);
  if (c->status == PD_OK) return PD_OK;
  return pd_err_set(e, c->status, "%s", c->msg);
}

pd_status cu_take_error(pd_backend *be, pd_err *e) {
  cuda_impl *c = impl_of(be);
  if (!c->soft_failed) return PD_OK;
  c->soft_failed = false;
  return pd_err_set(e, PD_ENOMEM, "%s", c->soft_msg);
}

/* A real device fault, on purpose: the trap is a sticky launch failure that every later call on
 * this context reports, seen here at once by the sync. */
void cu_inject_fault(pd_backend *be) {
  cuda_impl *c = impl_of(be);
  use_device(c);
  pd_cuda_trap(c->st);
  CK_LAUNCH(c, "injected fault");
  CK(c, cudaStreamSynchronize(c->st));
}

void cu_destroy(pd_backend *be) {
  if (!be) return;
  cuda_impl *c = impl_of(be);
  if (c) {
    cudaSetDevice(c->dev);
    tl_dev = c->dev;
    pd_cuda_profile_report(be);
    if (c->st) cudaStreamSynchronize(c->st);
    if (c->blas) cublasDestroy(c->blas);
    cudaFree(c->blas_ws);
    cudaFree(c->xconv);
    cudaFree(c->wdq);
    cudaFree(c->xq);
    cudaFree(c->qws);
    cudaFree(c->acc_ws);
    cudaFree(c->attn_ws);
    cudaFree(c->xfin);
    cudaFree(c->tiles);
    pd_cuda_free_extras(c);
    pd_cuda_free_retired(c);
    for (int i = 0; i < 2; i++) {
      if (c->pin[i]) cudaFreeHost(c->pin[i]);
      if (c->pin_ev[i]) cudaEventDestroy(c->pin_ev[i]);
    }
    if (c->st) cudaStreamDestroy(c->st);
    free(c);
  }
  free(be);
}

} // namespace

void pd_cuda_free_extras(cuda_impl *c) {
  cudaFree(c->smp_dev);
  cudaFree(c->smp_greedy);
  if (c->smp_host) cudaFreeHost(c->smp_host);
  cudaFree(c->stage_dev);
  if (c->st_kv) {
    cudaStreamSynchronize(c->st_kv);
    cudaStreamDestroy(c->st_kv);
  }
  if (c->kv_ev) cudaEventDestroy(c->kv_ev);
  c->st_kv = NULL;
  c->kv_ev = NULL;
  c->kv_stream_state = 0;
  c->smp_dev = c->smp_host = c->stage_dev = c->smp_greedy = NULL;
  c->smp_dev_size = c->smp_host_size = c->stage_dev_size = 0;
}

extern "C" int pd_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" pd_backend *pd_backend_cuda_create(const pd_backend_opts *o, pd_err *e) {
  const int dev = o ? o->device : 0;
  const int n = pd_cuda_device_count();
  if (n == 0) {
    pd_err_set(e, PD_EUNSUPPORTED, "cuda backend: no CUDA device is available");
    return NULL;
  }
  if (dev < 0 || dev >= n) {
    pd_err_set(e, PD_EINVAL, "cuda backend: device %d out of range (%d devices)", dev, n);
    return NULL;
  }
  cudaDeviceProp prop;
  cudaError_t r = cudaSetDevice(dev);
  if (r == cudaSuccess) r = cudaGetDeviceProperties(&prop, dev);
  if (r != cudaSuccess) {
    pd_err_set(e, PD_EBACKEND, "cuda backend: device %d: %s", dev, cudaGetErrorString(r));
    return NULL;
  }
  if (prop.major < 8) {
    pd_err_set(e, PD_EUNSUPPORTED,
               "cuda backend: %s has compute capability %d.%d; 8.0 or newer is required",
               prop.name, prop.major, prop.minor);
    return NULL;
  }
  tl_dev = dev;
  pd_backend *be = static_cast<pd_backend *>(calloc(1, sizeof *be));
  cuda_impl *c = static_cast<cuda_impl *>(calloc(1, sizeof *c));
  if (!be || !c) {
    free(be);
    free(c);
    pd_err_set(e, PD_ENOMEM, "cuda backend: out of host memory");
    return NULL;
  }
  be->impl = c;
  be->host_memory = false;
  be->ops.name = "cuda";
  be->ops.alloc = cu_alloc;
  be->ops.free = cu_free;
  be->ops.to_device = cu_to_device;
  be->ops.to_host = cu_to_host;
  be->ops.sync = cu_sync;
  be->ops.copy = cu_copy;
  be->ops.to_device_async = cu_to_device_async;
  be->ops.mem_info = cu_mem_info;
  be->ops.matmul = PD_CUDA_GUARD(cu_matmul);
  be->ops.rmsnorm = PD_CUDA_GUARD(cu_rmsnorm);
  be->ops.add_rmsnorm = PD_CUDA_GUARD(cu_add_rmsnorm);
  be->ops.embed = PD_CUDA_GUARD(cu_embed);
  be->ops.rope = PD_CUDA_GUARD(cu_rope);
  be->ops.swiglu = PD_CUDA_GUARD(cu_swiglu);
  be->ops.kv_write = PD_CUDA_GUARD(cu_kv_write);
  be->ops.attention = PD_CUDA_GUARD(cu_attention);
  be->ops.get_rows = PD_CUDA_GUARD(cu_get_rows);
  be->ops.add = PD_CUDA_GUARD(cu_add);
  be->ops.destroy = cu_destroy;
  be->ops.status = cu_status;
  be->ops.inject_fault = cu_inject_fault;
  be->ops.take_error = cu_take_error;
  be->ops.matmul_glu = PD_CUDA_GUARD(cu_matmul_glu);
  be->ops.rope_kv_write = PD_CUDA_GUARD(cu_rope_kv_write);
  be->ops.act_bytes = cu_act_bytes;
  be->ops.embed_norm = PD_CUDA_GUARD(cu_embed_norm);
  be->ops.norm = PD_CUDA_GUARD(cu_norm);
  be->ops.linear = PD_CUDA_GUARD(cu_linear);
  be->ops.qkv_attention = PD_CUDA_GUARD(cu_qkv_attention);
  be->ops.act_read = PD_CUDA_GUARD(cu_act_read);
  pd_cuda_register_sample(be);
  pd_cuda_register_kvstage(be);
  pd_cuda_register_graph(be);
  c->dev = dev;
  c->n_sm = prop.multiProcessorCount;
  c->cc_major = prop.major;

  const char *what = NULL;
  cublasStatus_t bs = CUBLAS_STATUS_SUCCESS;
  if ((r = cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking)) != cudaSuccess) {
    what = "creating a stream";
  } else if ((bs = cublasCreate(&c->blas)) != CUBLAS_STATUS_SUCCESS) {
    what = "creating the cuBLAS handle";
  } else if ((r = cudaMalloc(&c->blas_ws, kBlasWorkspace)) != cudaSuccess ||
             (r = cudaMalloc(&c->xconv, kXconvInitial)) != cudaSuccess ||
             (r = cudaMalloc((void **)&c->attn_ws, kAttnWorkspace)) != cudaSuccess ||
             (r = cudaMalloc((void **)&c->tiles, kTilesInitial * sizeof(int32_t))) !=
                 cudaSuccess) {
    what = "allocating workspaces";
  } else if ((bs = cublasSetStream(c->blas, c->st)) != CUBLAS_STATUS_SUCCESS ||
             (bs = cublasSetWorkspace(c->blas, c->blas_ws, kBlasWorkspace)) !=
                 CUBLAS_STATUS_SUCCESS) {
    what = "configuring cuBLAS";
  }
  if (what) {
    if (bs != CUBLAS_STATUS_SUCCESS)
      pd_err_set(e, PD_EBACKEND, "cuda backend: %s: cuBLAS status %d", what, (int)bs);
    else
      pd_err_set(e, PD_EBACKEND, "cuda backend: %s: %s", what, cudaGetErrorString(r));
    cudaGetLastError();
    cu_destroy(be);
    return NULL;
  }
  c->xconv_size = kXconvInitial;
  c->attn_ws_size = kAttnWorkspace;
  c->tiles_cap = kTilesInitial;
  /* Pinned staging is an optimisation: without it to_host copies directly. */
  for (int i = 0; i < 2; i++) {
    if (cudaHostAlloc(&c->pin[i], kPinnedChunk, cudaHostAllocDefault) != cudaSuccess ||
        cudaEventCreateWithFlags(&c->pin_ev[i], cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      for (int j = 0; j < 2; j++) {
        if (c->pin[j]) cudaFreeHost(c->pin[j]);
        if (c->pin_ev[j]) cudaEventDestroy(c->pin_ev[j]);
        c->pin[j] = NULL;
        c->pin_ev[j] = NULL;
      }
      break;
    }
  }
  if (o && o->profile) pd_cuda_profile_wrap(be);
  return be;
}

extern "C" void *pd_backend_cuda_stream(pd_backend *be) {
  if (!be || be->ops.destroy != cu_destroy) return NULL;
  return impl_of(be)->st;
}

extern "C" pd_status pd_backend_cuda_status(pd_backend *be, pd_err *e) {
  if (!be || be->ops.destroy != cu_destroy)
    return pd_err_set(e, PD_EINVAL, "not a CUDA backend");
  return cu_status(be, e);
}
