/* Quantized weights on the CUDA backend: PD_DTYPE_Q4 (4-bit values in blocks of 32 with an f16
 * scale and zero each) and PD_DTYPE_F8W / F8WA (e4m3 rows with an f32 scale), in the row layouts
 * of pd/dtype.h, as the engine uploads them.
 *
 * Decode rows (M <= PD_CUDA_QGEMV_MAX_M): a GEMV that reads each weight once for all rows and
 * dequantizes in registers. A warp owns R rows of W; its lanes take one 4-bit block (16 bytes of
 * values, the block's 4-byte scale and zero from the row's tail) or 16 FP8 values at a time, two
 * such chunks in flight, with x read through L1. 4-bit values become floats with the exponent
 * trick (0x4B000000 | q is 2^23 + q, minus 2^23 + zero gives q - zero exactly: the zero points
 * of every format pdserve loads are integers), so a block costs per element one FMA per row of x
 * and about three integer and float operations shared by them; the block's scale multiplies its
 * partial dot once. FP8 pairs go to f16 pairs with the conversion instruction (sm_89 and later;
 * emulated before) and the row's scale multiplies the whole dot.
 *
 * Larger M: pd_cuda_dequant16 writes W in bf16 for cuBLAS (the backend's scratch), the product
 * runs as for a bf16 checkpoint.
 *
 * F8WA's activations are quantized per row (token) to e4m3 and back before either path
 * (pd_cuda_fp8_qdq_rows), with the arithmetic of the CPU backend: s = max|x| / 448,
 * x' = e4m3(x / s) * s, saturating, nearest even. */
#include <cuda_fp8.h>

#include "cuda_mma.h"

namespace {

constexpr int kQWarps = 8; /* warps per block */
constexpr float kMagic = 8388608.0f; /* 2^23 */

struct qargs {
  float *y;
  const float *x;
  const uint8_t *w;
  const float *bias;
  int M, N, K;
  bool acc;
};

/* Rows per warp for MT rows of x: fewer where the partial sums would spill. */
template <int MT> struct qtile { static constexpr int R = MT <= 2 ? 2 : 4; };
template <> struct qtile<8> { static constexpr int R = 2; };

/* The sums acc[r][m] of a warp's lanes, then lane i < R * MT writes output i. */
template <int MT, int R>
__device__ __forceinline__ void q_store(const qargs &a, int n0, int lane, float (&acc)[R][MT]) {
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int m = 0; m < MT; m++) acc[r][m] = pd_warp_sum(acc[r][m]);
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
      const int n = n0 + r;
      if (lane != r * MT + m || m >= a.M || n >= a.N) continue;
      float v = acc[r][m];
      if (a.bias) v += a.bias[n];
      float *yp = a.y + (size_t)m * a.N + n;
      *yp = a.acc ? *yp + v : v;
    }
  }
}

/* 4-bit rows, like the FP8 ones, by words: lane l takes words l, l + 32, ... (8 values each,
 * element i of a word in bits 4i), so that a warp's loads of W are 128 contiguous bytes and its
 * loads of x (two float4 a lane) 1 KiB; word w's (scale, zero) is the tail's word w / 4. U words
 * of each of the R rows in flight per lane. */
template <int MT>
__global__ void __launch_bounds__(kQWarps * 32) q4_gemv_kernel(qargs a) {
  constexpr int R = qtile<MT>::R, U = MT <= 2 ? 8 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * kQWarps + warp) * R;
  if (n0 >= a.N) return;
  const int K = a.K, nw = K / 8;
  const size_t rb = (size_t)K / 2 + (size_t)K / 8;
  const uint32_t *wr[R], *sr[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    const int n = n0 + r < a.N ? n0 + r : a.N - 1;
    wr[r] = reinterpret_cast<const uint32_t *>(a.w + (size_t)n * rb);
    sr[r] = wr[r] + K / 8;
  }
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int m = 0; m < MT; m++) acc[r][m] = 0.0f;
  for (int c0 = lane; c0 < nw; c0 += 32 * U) {
    uint32_t raw[U][R], sz[U][R];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int r = 0; r < R; r++) {
        const int c = c0 + 32 * u;
        raw[u][r] = c < nw ? __ldcs(wr[r] + c) : 0u;
        sz[u][r] = c < nw ? __ldg(sr[r] + c / 4) : 0u;
      }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c >= nw) break;
      float wf[R][8], sc[R];
#pragma unroll
      for (int r = 0; r < R; r++) {
        const __half2 h = *reinterpret_cast<const __half2 *>(&sz[u][r]);
        const float zf = kMagic + __high2float(h);
        sc[r] = __low2float(h);
#pragma unroll
        for (int i = 0; i < 8; i++)
          wf[r][i] = __uint_as_float(0x4B000000u | ((raw[u][r] >> (4 * i)) & 15u)) - zf;
      }
#pragma unroll
      for (int m = 0; m < MT; m++) {
        if (m >= a.M) break;
        const float4 *xp = reinterpret_cast<const float4 *>(a.x + (size_t)m * K) + 2 * c;
        const float4 xa = __ldg(xp), xb = __ldg(xp + 1);
#pragma unroll
        for (int r = 0; r < R; r++) {
          float t = wf[r][0] * xa.x;
          t = fmaf(wf[r][1], xa.y, t);
          t = fmaf(wf[r][2], xa.z, t);
          t = fmaf(wf[r][3], xa.w, t);
          t = fmaf(wf[r][4], xb.x, t);
          t = fmaf(wf[r][5], xb.y, t);
          t = fmaf(wf[r][6], xb.z, t);
          t = fmaf(wf[r][7], xb.w, t);
          acc[r][m] = fmaf(sc[r], t, acc[r][m]);
        }
      }
    }
  }
  q_store<MT, R>(a, n0, lane, acc);
}

/* Four e4m3 values (one word) as floats. */
__device__ __forceinline__ void f8_unpack4(uint32_t u, float f[4]) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u >> 16), __NV_E4M3);
  const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

/* FP8 rows (K + 4 bytes: only 4-byte aligned): lanes take words (4 values), U of them in flight
 * per row, consecutive lanes on consecutive words. */
template <int MT>
__global__ void __launch_bounds__(kQWarps * 32) f8_gemv_kernel(qargs a) {
  constexpr int R = qtile<MT>::R, U = MT <= 2 ? 8 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * kQWarps + warp) * R;
  if (n0 >= a.N) return;
  const int K = a.K, nw = K / 4;
  const size_t rb = (size_t)K + 4;
  const uint32_t *wr[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    const int n = n0 + r < a.N ? n0 + r : a.N - 1;
    wr[r] = reinterpret_cast<const uint32_t *>(a.w + (size_t)n * rb);
  }
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int m = 0; m < MT; m++) acc[r][m] = 0.0f;
  for (int c0 = lane; c0 < nw; c0 += 32 * U) {
    uint32_t raw[U][R];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int r = 0; r < R; r++) raw[u][r] = c0 + 32 * u < nw ? __ldcs(wr[r] + c0 + 32 * u) : 0u;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c >= nw) break;
      float wf[R][4];
#pragma unroll
      for (int r = 0; r < R; r++) f8_unpack4(raw[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < MT; m++) {
        if (m >= a.M) break;
        const float4 t = __ldg(reinterpret_cast<const float4 *>(a.x + (size_t)m * K) + c);
#pragma unroll
        for (int r = 0; r < R; r++) {
          float s = acc[r][m];
          s = fmaf(wf[r][0], t.x, s);
          s = fmaf(wf[r][1], t.y, s);
          s = fmaf(wf[r][2], t.z, s);
          s = fmaf(wf[r][3], t.w, s);
          acc[r][m] = s;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
    const float sc = __ldg(reinterpret_cast<const float *>(wr[r] + nw));
#pragma unroll
    for (int m = 0; m < MT; m++) acc[r][m] *= sc;
  }
  q_store<MT, R>(a, n0, lane, acc);
}

template <int MT> void launch_q(cudaStream_t st, const qargs &a, pd_dtype wdt) {
  constexpr int R = qtile<MT>::R;
  const int rows_per_block = kQWarps * R;
  const dim3 grid((a.N + rows_per_block - 1) / rows_per_block), block(kQWarps * 32);
  if (wdt == PD_DTYPE_Q4) {
    q4_gemv_kernel<MT><<<grid, block, 0, st>>>(a);
  } else {
    f8_gemv_kernel<MT><<<grid, block, 0, st>>>(a);
  }
}

/* Q4 rows to bf16: a thread per block of 32. */
__global__ void q4_dequant_kernel(__nv_bfloat16 *dst, const uint8_t *w, int N, int K) {
  const int nb = K / PD_Q4_BLOCK;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)N * nb) return;
  const size_t n = i / nb;
  const int b = (int)(i % nb);
  const uint8_t *row = w + n * ((size_t)K / 2 + (size_t)K / 8);
  const uint32_t *vp = reinterpret_cast<const uint32_t *>(row) + 4 * b;
  const uint32_t szw = __ldg(reinterpret_cast<const uint32_t *>(row + K / 2) + b);
  const __half2 h = *reinterpret_cast<const __half2 *>(&szw);
  const float sc = __low2float(h), zf = kMagic + __high2float(h);
  uint4 *out = reinterpret_cast<uint4 *>(dst + n * K + (size_t)b * PD_Q4_BLOCK);
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const uint32_t u = __ldg(vp + j);
    uint32_t o[4];
#pragma unroll
    for (int i2 = 0; i2 < 4; i2++) {
      const float lo = (__uint_as_float(0x4B000000u | ((u >> (8 * i2)) & 15u)) - zf) * sc;
      const float hi = (__uint_as_float(0x4B000000u | ((u >> (8 * i2 + 4)) & 15u)) - zf) * sc;
      o[i2] = pd_pack2(lo, hi, (__nv_bfloat16 *)nullptr);
    }
    out[j] = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

/* FP8 rows to bf16: a thread per word (4 values). */
__global__ void f8_dequant_kernel(__nv_bfloat16 *dst, const uint8_t *w, int N, int K) {
  const int nw = K / 4;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)N * nw) return;
  const size_t n = i / nw;
  const int c = (int)(i % nw);
  const uint32_t *row = reinterpret_cast<const uint32_t *>(w + n * ((size_t)K + 4));
  const float sc = __ldg(reinterpret_cast<const float *>(row + nw));
  float f[4];
  f8_unpack4(__ldg(row + c), f);
  uint2 o;
  o.x = pd_pack2(f[0] * sc, f[1] * sc, (__nv_bfloat16 *)nullptr);
  o.y = pd_pack2(f[2] * sc, f[3] * sc, (__nv_bfloat16 *)nullptr);
  *reinterpret_cast<uint2 *>(dst + n * K + 4 * (size_t)c) = o;
}

/* A row of x quantized to e4m3 with the row's scale and back: a block per row. */
__global__ void fp8_qdq_kernel(float *dst, const float *x, int K) {
  __shared__ float red[32];
  const float *xr = x + (size_t)blockIdx.x * K;
  float *dr = dst + (size_t)blockIdx.x * K;
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(xr[k]));
  amax = pd_warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
    v = pd_warp_max(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float sc = red[0] / 448.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    float v = 0.0f;
    if (sc > 0.0f) {
      const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(xr[k] / sc, __NV_SATFINITE, __NV_E4M3);
      v = __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3))) * sc;
    }
    dr[k] = v;
  }
}

/* ---- the tensor-core product for larger M ------------------------------------------------
 * y[M,N] (+)= x16[M,K] W[N,K]^T with bf16 mma.sync m16n8k16 and f32 accumulation. A block of 8
 * warps owns BN = 128 rows of W (16 a warp) and BM = 16 MT16 <= 64 rows of x, and walks its
 * range of K in steps of 64: the raw tiles (W in its stored form, x16 as it is) come into a ring
 * of kStages shared-memory stages by cp.async, kStages - 1 steps ahead; each step a thread turns
 * one 4-bit block (or 32 FP8 values) of the W tile into bf16 values in a shared tile (4-bit:
 * (q - zero) * scale rounded to bf16, as a bf16 checkpoint's weights are; FP8: the e4m3 value,
 * exact, the row scale and F8WA's per-row activation scale multiply the sums at the end), and
 * the warps multiply it by the x stage through ldmatrix. Where M and N give fewer blocks than
 * the SMs can keep busy, K is split over blocks (gridDim.z) whose sums go to a workspace that
 * qmma_reduce adds up in order, so the result does not depend on timing. */
constexpr int kMmaThreads = 256, kBN = 128, kBK = 64, kStages = 4, kLD = kBK + 8;

struct mma_args {
  float *y;              /* gridDim.z == 1 */
  float *ws;             /* gridDim.z > 1: [splits][M][N] */
  const __nv_bfloat16 *x16;
  const uint8_t *w;
  const float *bias;
  const float *xs;       /* F8WA: [M] activation scales, else NULL */
  int M, N, K;
  int k_per_split;       /* a multiple of kBK */
  bool acc;
};

/* 4 bytes global -> shared, asynchronous, zeros where src_bytes is 0 */
__device__ __forceinline__ void cp_async4(void *dst, const void *src, int src_bytes) {
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
               "r"(src_bytes));
}

/* Raw bytes of one stage: the W tile (4-bit: values [kBN][32] then (scale, zero) words
 * [kBN][2]; FP8: values [kBN][64]) and the x tile [BM][kLD] bf16. */
template <int FMT> struct wfmt;
template <> struct wfmt<0> {
  static constexpr int raw_bytes = kBN * 32 + kBN * 8;
  /* thread t: row t / 2, block t % 2 of the step */
  static __device__ __forceinline__ void issue(uint8_t *raw, const mma_args &a, int n0, int k0,
                                               int t) {
    const int r = t >> 1, j = t & 1, n = n0 + r, kb = k0 / PD_Q4_BLOCK + j;
    const bool ok = n < a.N && kb < a.K / PD_Q4_BLOCK;
    const uint8_t *row = a.w + (size_t)(ok ? n : 0) * ((size_t)a.K / 2 + (size_t)a.K / 8);
    const uint8_t *src = row + (ok ? 16 * kb : 0);
    uint8_t *dst = raw + r * 32 + 16 * j;
    if ((a.K & 127) == 0) {
      pd_cp_async16(dst, src, ok ? 16 : 0);
    } else {
#pragma unroll
      for (int i = 0; i < 4; i++) cp_async4(dst + 4 * i, src + 4 * i, ok ? 4 : 0);
    }
    cp_async4(raw + kBN * 32 + r * 8 + 4 * j, row + a.K / 2 + (ok ? 4 * kb : 0), ok ? 4 : 0);
  }
  static __device__ __forceinline__ void convert(__nv_bfloat16 *wt, const uint8_t *raw, int t) {
    const int r = t >> 1, j = t & 1;
    const uint4 v = *reinterpret_cast<const uint4 *>(raw + r * 32 + 16 * j);
    const uint32_t szw = *reinterpret_cast<const uint32_t *>(raw + kBN * 32 + r * 8 + 4 * j);
    const __half2 h = *reinterpret_cast<const __half2 *>(&szw);
    const float sc = __low2float(h), zf = kMagic + __high2float(h);
    uint4 *o = reinterpret_cast<uint4 *>(wt + r * kLD + 32 * j);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint32_t u = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
      uint32_t p[4];
#pragma unroll
      for (int e = 0; e < 4; e++)
        p[e] = pd_pack2((__uint_as_float(0x4B000000u | ((u >> (8 * e)) & 15u)) - zf) * sc,
                        (__uint_as_float(0x4B000000u | ((u >> (8 * e + 4)) & 15u)) - zf) * sc,
                        (__nv_bfloat16 *)nullptr);
      o[i] = make_uint4(p[0], p[1], p[2], p[3]);
    }
  }
};
template <> struct wfmt<1> {
  static constexpr int raw_bytes = kBN * 64;
  /* thread t: row t / 2, words 8 (t % 2) .. + 7 of the step (FP8 rows are 4-byte aligned) */
  static __device__ __forceinline__ void issue(uint8_t *raw, const mma_args &a, int n0, int k0,
                                               int t) {
    const int r = t >> 1, h = t & 1, n = n0 + r;
    const uint8_t *row = a.w + (size_t)(n < a.N ? n : 0) * ((size_t)a.K + 4);
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int k = k0 + 4 * (8 * h + i);
      const bool ok = n < a.N && k < a.K;
      cp_async4(raw + r * 64 + 4 * (8 * h + i), row + (ok ? k : 0), ok ? 4 : 0);
    }
  }
  static __device__ __forceinline__ void convert(__nv_bfloat16 *wt, const uint8_t *raw, int t) {
    const int r = t >> 1, h = t & 1;
    const uint4 *src = reinterpret_cast<const uint4 *>(raw + r * 64 + 32 * h);
    uint4 *o = reinterpret_cast<uint4 *>(wt + r * kLD + 32 * h);
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const uint4 v = src[q];
      const uint32_t us[4] = {v.x, v.y, v.z, v.w};
      uint32_t p[8];
#pragma unroll
      for (int i = 0; i < 4; i++) {
        float f[4];
        f8_unpack4(us[i], f);
        p[2 * i] = pd_pack2(f[0], f[1], (__nv_bfloat16 *)nullptr);
        p[2 * i + 1] = pd_pack2(f[2], f[3], (__nv_bfloat16 *)nullptr);
      }
      o[2 * q] = make_uint4(p[0], p[1], p[2], p[3]);
      o[2 * q + 1] = make_uint4(p[4], p[5], p[6], p[7]);
    }
  }
};

template <int FMT, int MT16> struct qmma_cfg {
  static constexpr int BM = 16 * MT16;
  static constexpr int raw_bytes = (wfmt<FMT>::raw_bytes + 15) / 16 * 16;
  static constexpr int x_bytes = BM * kLD * 2;
  static constexpr size_t smem = (size_t)kStages * (raw_bytes + x_bytes) + (size_t)kBN * kLD * 2;
};

template <int MT16>
__device__ __forceinline__ void x_issue(__nv_bfloat16 *xs, const mma_args &a, int m0, int k0,
                                        int t) {
  constexpr int BM = 16 * MT16;
  for (int c = t; c < BM * (kBK / 8); c += kMmaThreads) {
    const int r = c / (kBK / 8), k = k0 + 8 * (c % (kBK / 8));
    const bool ok = m0 + r < a.M && k < a.K;
    pd_cp_async16(xs + r * kLD + 8 * (c % (kBK / 8)),
                  a.x16 + (ok ? (size_t)(m0 + r) * a.K + k : 0), ok ? 16 : 0);
  }
}

template <int FMT, int MT16>
__global__ void __launch_bounds__(kMmaThreads) qmma_kernel(mma_args a) {
  using cfg = qmma_cfg<FMT, MT16>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint8_t *raw = smem;                                            /* [kStages][raw_bytes] */
  __nv_bfloat16 *xst = reinterpret_cast<__nv_bfloat16 *>(smem + kStages * cfg::raw_bytes);
  __nv_bfloat16 *wt = xst + kStages * (cfg::x_bytes / 2);         /* [kBN][kLD] */
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int m0 = blockIdx.x * cfg::BM, n0 = blockIdx.y * kBN;
  const int kb = blockIdx.z * a.k_per_split;
  const int ke = min(a.K, kb + a.k_per_split);
  const int steps = (ke - kb + kBK - 1) / kBK;
  for (int s = 0; s < kStages - 1; s++) {
    if (s < steps) {
      wfmt<FMT>::issue(raw + s * cfg::raw_bytes, a, n0, kb + s * kBK, t);
      x_issue<MT16>(xst + s * (cfg::x_bytes / 2), a, m0, kb + s * kBK, t);
    }
    pd_cp_async_commit();
  }
  float acc[MT16][2][4];
#pragma unroll
  for (int i = 0; i < MT16; i++)
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
  for (int s = 0; s < steps; s++) {
    const int st = s % kStages;
    pd_cp_async_wait<kStages - 2>();
    __syncthreads(); /* stage st landed for all; the previous step's reads of wt are done */
    wfmt<FMT>::convert(wt, raw + st * cfg::raw_bytes, t);
    {
      const int sn = s + kStages - 1;
      if (sn < steps) {
        wfmt<FMT>::issue(raw + (sn % kStages) * cfg::raw_bytes, a, n0, kb + sn * kBK, t);
        x_issue<MT16>(xst + (sn % kStages) * (cfg::x_bytes / 2), a, m0, kb + sn * kBK, t);
      }
      pd_cp_async_commit();
    }
    __syncthreads(); /* wt written */
    const __nv_bfloat16 *xs = xst + st * (cfg::x_bytes / 2);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ks++) {
      const int kk = 16 * ks;
      uint32_t af[MT16][4], bf[4];
#pragma unroll
      for (int i = 0; i < MT16; i++)
        pd_ldmatrix_x4(af[i], xs + (16 * i + (lane & 15)) * kLD + kk + 8 * (lane >> 4));
      pd_ldmatrix_x4(bf, wt + (16 * warp + 8 * (lane >> 4) + (lane & 7)) * kLD + kk +
                             8 * ((lane >> 3) & 1));
#pragma unroll
      for (int i = 0; i < MT16; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
          pd_tc<__nv_bfloat16>::mma(acc[i][j], af[i], bf[2 * j], bf[2 * j + 1]);
    }
  }
  pd_cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < MT16; i++)
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int m = m0 + 16 * i + (lane >> 2) + 8 * (e >> 1);
        const int n = n0 + 16 * warp + 8 * j + 2 * (lane & 3) + (e & 1);
        if (m >= a.M || n >= a.N) continue;
        float v = acc[i][j][e];
        if (FMT == 1) {
          v *= __ldg(reinterpret_cast<const float *>(a.w + (size_t)n * ((size_t)a.K + 4) + a.K));
          if (a.xs) v *= a.xs[m];
        }
        if (gridDim.z > 1) {
          a.ws[((size_t)blockIdx.z * a.M + m) * a.N + n] = v;
          continue;
        }
        if (a.bias) v += a.bias[n];
        float *yp = a.y + (size_t)m * a.N + n;
        *yp = a.acc ? *yp + v : v;
      }
}

/* y (+)= the splits' sums, in order, + bias */
__global__ void qmma_reduce(float *y, const float *ws, const float *bias, int M, int N,
                            int splits, bool acc) {
  const size_t n_all = (size_t)M * N;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_all;
       i += (size_t)gridDim.x * blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < splits; s++) v += ws[(size_t)s * n_all + i];
    if (bias) v += bias[i % N];
    y[i] = acc ? y[i] + v : v;
  }
}

/* F8WA's operand for the tensor-core product: each row's e4m3 values of x / s as bf16 (exact)
 * and s = max|row| / 448 (0 for a zero row). */
__global__ void fp8_quant16_kernel(__nv_bfloat16 *dst, float *scales, const float *x, int K) {
  __shared__ float red[32];
  const float *xr = x + (size_t)blockIdx.x * K;
  __nv_bfloat16 *dr = dst + (size_t)blockIdx.x * K;
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(xr[k]));
  amax = pd_warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
    v = pd_warp_max(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float sc = red[0] / 448.0f;
  if (threadIdx.x == 0) scales[blockIdx.x] = sc;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    float v = 0.0f;
    if (sc > 0.0f) {
      const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(xr[k] / sc, __NV_SATFINITE, __NV_E4M3);
      v = __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)));
    }
    dr[k] = __float2bfloat16_rn(v);
  }
}

} // namespace

bool pd_cuda_quant_dtype(pd_dtype t) {
  return t == PD_DTYPE_Q4 || t == PD_DTYPE_F8W || t == PD_DTYPE_F8WA;
}

bool pd_cuda_quant_ok(pd_dtype t, int K) {
  if (t == PD_DTYPE_Q4) return K > 0 && K % PD_Q4_BLOCK == 0;
  return (t == PD_DTYPE_F8W || t == PD_DTYPE_F8WA) && K > 0 && K % 16 == 0;
}

void pd_cuda_qgemv(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                   const float *bias, int M, int N, int K, bool accumulate) {
  const qargs a = {y, x, static_cast<const uint8_t *>(w), bias, M, N, K, accumulate};
  if (M <= 1) launch_q<1>(st, a, wdt);
  else if (M <= 2) launch_q<2>(st, a, wdt);
  else if (M <= 4) launch_q<4>(st, a, wdt);
  else launch_q<8>(st, a, wdt);
}

void pd_cuda_dequant16(cudaStream_t st, __nv_bfloat16 *dst, const void *w, pd_dtype wdt, int N,
                       int K) {
  const uint8_t *wb = static_cast<const uint8_t *>(w);
  if (wdt == PD_DTYPE_Q4) {
    const size_t n = (size_t)N * (K / PD_Q4_BLOCK);
    q4_dequant_kernel<<<(unsigned)((n + 255) / 256), 256, 0, st>>>(dst, wb, N, K);
  } else {
    const size_t n = (size_t)N * (K / 4);
    f8_dequant_kernel<<<(unsigned)((n + 255) / 256), 256, 0, st>>>(dst, wb, N, K);
  }
}

void pd_cuda_fp8_qdq_rows(cudaStream_t st, float *dst, const float *x, int M, int K) {
  fp8_qdq_kernel<<<M, 256, 0, st>>>(dst, x, K);
}

int pd_cuda_qmma_splits(int M, int N, int K, int n_sm) {
  const int bm = M <= 16 ? 16 : M <= 32 ? 32 : 64;
  const int tiles = ((M + bm - 1) / bm) * ((N + kBN - 1) / kBN);
  const int steps = (K + kBK - 1) / kBK;
  int splits = (2 * n_sm + tiles - 1) / tiles;
  if (splits > steps / 4) splits = steps / 4; /* at least 4 steps a split */
  if (splits > 8) splits = 8;
  return splits < 1 ? 1 : splits;
}

template <int FMT, int MT16>
static void qmma_launch(cudaStream_t st, const mma_args &a, int splits) {
  using cfg = qmma_cfg<FMT, MT16>;
  const void *k = reinterpret_cast<const void *>(qmma_kernel<FMT, MT16>);
  (void)pd_cuda_smem_optin(k, cfg::smem); /* (a refusal fails the launch, which is checked) */
  const dim3 grid((a.M + cfg::BM - 1) / cfg::BM, (a.N + kBN - 1) / kBN, splits);
  qmma_kernel<FMT, MT16><<<grid, kMmaThreads, cfg::smem, st>>>(a);
}

template <int FMT>
static void qmma_fmt(cudaStream_t st, const mma_args &a, int splits) {
  if (a.M <= 16) qmma_launch<FMT, 1>(st, a, splits);
  else if (a.M <= 32) qmma_launch<FMT, 2>(st, a, splits);
  else qmma_launch<FMT, 4>(st, a, splits);
}

void pd_cuda_qmma(cudaStream_t st, float *y, float *ws, int splits, const __nv_bfloat16 *x16,
                  const float *xs, const void *w, pd_dtype wdt, const float *bias, int M, int N,
                  int K, bool accumulate) {
  const int steps = (K + kBK - 1) / kBK;
  const int per = (steps + splits - 1) / splits;
  mma_args a = {y, ws, x16, static_cast<const uint8_t *>(w), bias, xs, M, N, K, per * kBK,
                accumulate};
  const int used = (steps + per - 1) / per;
  if (wdt == PD_DTYPE_Q4) qmma_fmt<0>(st, a, used);
  else qmma_fmt<1>(st, a, used);
  if (used > 1) {
    const size_t n = (size_t)M * N;
    qmma_reduce<<<(unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096), 256, 0, st>>>(
        y, ws, bias, M, N, used, accumulate);
  }
}

void pd_cuda_fp8_quant16(cudaStream_t st, __nv_bfloat16 *dst, float *scales, const float *x,
                         int M, int K) {
  fp8_quant16_kernel<<<M, 256, 0, st>>>(dst, scales, x, K);
}
