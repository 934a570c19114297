/* y[M,N] = x[M,K] W[N,K]^T (+ bias) for small M (decode): a memory-bound GEMV.
 *
 * Everywhere: lanes take 16-byte chunks of a row of W (8 bf16/f16 or 4 f32 weights), so one warp
 * instruction reads 512 contiguous bytes of a row, and several chunks per row are loaded before
 * any is used, to keep many independent loads in flight. W is read with the streaming
 * (evict-first) hint: it is used once, while x (M * K floats, read by every row) should stay in
 * L1/L2. x stays f32 and the sums are f32.
 *
 * M <= 2 (gemv_row_kernel): a warp per row walking the whole of K, 4 chunks in flight per lane,
 * a shuffle reduction, no shared memory or barrier.
 * M = 3..8 (gemv_vec_kernel): every x element fetched from L1 would otherwise be used for one
 * row only, and x traffic (2M bytes per weight byte) would bound the kernel; so a warp owns
 * R = 4 rows and reuses each x element for all of them, and to keep enough warps busy the KS = 4
 * warps of a row group split K into slices. A warp's M * R partial sums are reduced across lanes
 * with a halving butterfly (each step exchanges half of the values: 31 shuffles for 32 values
 * instead of 5 per value), the slices are summed through shared memory, and the bias is added on
 * the way out.
 * Odd K (or misaligned pointers) take the scalar variant: one element per lane per step. */
#include "cuda_internal.h"

namespace {

constexpr int kWarps = 8; /* warps per block */

template <typename WT> struct wvec;
/* 16-bit types: 8 weights per 16-byte chunk. */
template <typename T16> struct wvec16 {
  static constexpr int n = 8;
  __device__ static void unpack(const uint4 &u, float f[8]) {
    float2 t;
    t = pd_unpack2(u.x, (T16 *)nullptr); f[0] = t.x; f[1] = t.y;
    t = pd_unpack2(u.y, (T16 *)nullptr); f[2] = t.x; f[3] = t.y;
    t = pd_unpack2(u.z, (T16 *)nullptr); f[4] = t.x; f[5] = t.y;
    t = pd_unpack2(u.w, (T16 *)nullptr); f[6] = t.x; f[7] = t.y;
  }
};
template <> struct wvec<__nv_bfloat16> : wvec16<__nv_bfloat16> {};
template <> struct wvec<__half> : wvec16<__half> {};
template <> struct wvec<float> {
  static constexpr int n = 4;
  __device__ static void unpack(const uint4 &u, float f[4]) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
};

/* Tiling for MT rows of x: R rows per row group, KS warps per row group, U chunks per row in
 * flight per lane. */
template <int MT> struct tiling;
template <> struct tiling<4> { static constexpr int R = 4, KS = 4, U = 2; };
template <> struct tiling<8> { static constexpr int R = 4, KS = 4, U = 1; };

/* Sums NV values over the warp's lanes. Returns the number of totals this lane holds; they are
 * v[0 .. count) and stand for original indices *first, *first + 1, ... Lanes that differ only in
 * bits of the plain (non-halving) steps hold the same totals. */
template <int NV> __device__ __forceinline__ int warp_reduce_many(float (&v)[NV], int lane,
                                                                   int *first) {
  int cnt = NV, base = 0;
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) {
    if (cnt >= 2) {
      const int half = cnt / 2;
      const bool up = (lane & mask) != 0;
#pragma unroll
      for (int i = 0; i < NV / 2; i++) {
        if (i < half) {
          float send = up ? v[i] : v[i + half];
          float keep = up ? v[i + half] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
        }
      }
      if (up) base += half;
      cnt = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], mask);
    }
  }
  *first = base;
  return cnt;
}

/* M <= 2: a warp per row of W walking the whole of K, U = 4 chunks in flight per lane, no
 * shared memory or barrier: measured the fastest on 4096 x 4096 .. 4096 x 14336 decode shapes
 * (the split-K block variant below pays a barrier and a second wave there). */
template <typename WT, int MT>
__global__ void __launch_bounds__(kWarps * 32)
gemv_row_kernel(float *__restrict__ y, const float *__restrict__ x, const WT *__restrict__ w,
                const float *__restrict__ bias, int M, int N, int K) {
  constexpr int E = wvec<WT>::n;
  constexpr int U = 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= N) return;
  const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)n * K);
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) acc[m] = 0.0f;
  const int nch = K / E;
  for (int c0 = lane; c0 < nch; c0 += 32 * U) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * 32;
      raw[u] = c < nch ? __ldcs(wr + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * 32;
      if (c >= nch) break;
      float wf[E];
      wvec<WT>::unpack(raw[u], wf);
#pragma unroll
      for (int m = 0; m < MT; m++) {
        if (m >= M) break;
        const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)m * K + (size_t)c * E);
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
          float4 t = __ldg(xp + j);
          acc[m] = fmaf(wf[4 * j], t.x, acc[m]);
          acc[m] = fmaf(wf[4 * j + 1], t.y, acc[m]);
          acc[m] = fmaf(wf[4 * j + 2], t.z, acc[m]);
          acc[m] = fmaf(wf[4 * j + 3], t.w, acc[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; m++) acc[m] = pd_warp_sum(acc[m]);
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MT; m++)
      if (m < M) y[(size_t)m * N + n] = acc[m] + (bias ? bias[n] : 0.0f);
  }
}

/* Vector variant: K % wvec<WT>::n == 0 and W, x 16-byte aligned. MT >= M rows of x. */
template <typename WT, int MT>
__global__ void __launch_bounds__(kWarps * 32, 2)
gemv_vec_kernel(float *__restrict__ y, const float *__restrict__ x, const WT *__restrict__ w,
                const float *__restrict__ bias, int M, int N, int K) {
  constexpr int R = tiling<MT>::R, KS = tiling<MT>::KS, U = tiling<MT>::U;
  constexpr int E = wvec<WT>::n;
  constexpr int GROUPS = kWarps / KS; /* row groups per block */
  constexpr int NV = MT * R;
  __shared__ float part[kWarps][NV];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = warp / KS, ks = warp % KS;
  const int n0 = (blockIdx.x * GROUPS + grp) * R;
  const uint4 *wr[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    int n = n0 + r < N ? n0 + r : N - 1;
    wr[r] = reinterpret_cast<const uint4 *>(w + (size_t)n * K);
  }
  float acc[NV];
#pragma unroll
  for (int i = 0; i < NV; i++) acc[i] = 0.0f;

  const int nch = K / E, per = (nch + KS - 1) / KS;
  const int c_lo = ks * per, c_hi = c_lo + per < nch ? c_lo + per : nch;
  if (n0 < N) {
    for (int c0 = c_lo + lane; c0 < c_hi; c0 += 32 * U) {
      uint4 raw[U][R];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int c = c0 + u * 32;
#pragma unroll
        for (int r = 0; r < R; r++) raw[u][r] = c < c_hi ? __ldcs(wr[r] + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int c = c0 + u * 32;
        if (c >= c_hi) break;
#pragma unroll
        for (int m = 0; m < MT; m++) {
          if (m >= M) break;
          const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)m * K + (size_t)c * E);
          float xf[E];
#pragma unroll
          for (int j = 0; j < E / 4; j++) {
            float4 t = __ldg(xp + j);
            xf[4 * j] = t.x; xf[4 * j + 1] = t.y; xf[4 * j + 2] = t.z; xf[4 * j + 3] = t.w;
          }
#pragma unroll
          for (int r = 0; r < R; r++) {
            float wf[E];
            wvec<WT>::unpack(raw[u][r], wf);
#pragma unroll
            for (int e = 0; e < E; e++) acc[m * R + r] = fmaf(wf[e], xf[e], acc[m * R + r]);
          }
        }
      }
    }
  }
  int first;
  const int cnt = warp_reduce_many(acc, lane, &first);
#pragma unroll
  for (int i = 0; i < NV; i++)
    if (i < cnt) part[warp][first + i] = acc[i];
  __syncthreads();
  for (int i = threadIdx.x; i < GROUPS * NV; i += kWarps * 32) {
    const int g = i / NV, v = i - g * NV, m = v / R, r = v - m * R;
    const int n = (blockIdx.x * GROUPS + g) * R + r;
    if (m < M && n < N) {
      float s = bias ? bias[n] : 0.0f;
#pragma unroll
      for (int k = 0; k < KS; k++) s += part[g * KS + k][v];
      y[(size_t)m * N + n] = s;
    }
  }
}

/* Scalar variant for any K and alignment: a warp per row, lanes take consecutive elements. */
template <typename WT, int MT>
__global__ void __launch_bounds__(kWarps * 32)
gemv_scalar_kernel(float *__restrict__ y, const float *__restrict__ x, const WT *__restrict__ w,
                   const float *__restrict__ bias, int M, int N, int K) {
  constexpr int U = 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= N) return;
  const WT *wr = w + (size_t)n * K;
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) acc[m] = 0.0f;
  for (int k0 = lane; k0 < K; k0 += 32 * U) {
    float wf[U];
#pragma unroll
    for (int u = 0; u < U; u++) wf[u] = k0 + u * 32 < K ? pd_to_f32(wr[k0 + u * 32]) : 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int k = k0 + u * 32;
      if (k >= K) break;
#pragma unroll
      for (int m = 0; m < MT; m++) {
        if (m >= M) break;
        acc[m] = fmaf(wf[u], __ldg(x + (size_t)m * K + k), acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; m++) acc[m] = pd_warp_sum(acc[m]);
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MT; m++)
      if (m < M) y[(size_t)m * N + n] = acc[m] + (bias ? bias[n] : 0.0f);
  }
}

/* Gate/up fused with SwiGLU (M <= 2): a warp owns output f and walks the gate row f and the up row
 * F + f together (4 chunks of each in flight per lane), then writes silu(g) * u. */
template <typename WT, int MT>
__global__ void __launch_bounds__(kWarps * 32)
gemv_glu_kernel(float *__restrict__ act, const float *__restrict__ x, const WT *__restrict__ w,
                const float *__restrict__ bias, int M, int F, int K) {
  constexpr int E = wvec<WT>::n;
  constexpr int U = 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int f = blockIdx.x * kWarps + warp;
  if (f >= F) return;
  const uint4 *wg = reinterpret_cast<const uint4 *>(w + (size_t)f * K);
  const uint4 *wu = reinterpret_cast<const uint4 *>(w + ((size_t)F + f) * K);
  float ag[MT], au[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) ag[m] = au[m] = 0.0f;
  const int nch = K / E;
  for (int c0 = lane; c0 < nch; c0 += 32 * U) {
    uint4 rg[U], ru[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * 32;
      rg[u] = c < nch ? __ldcs(wg + c) : make_uint4(0, 0, 0, 0);
      ru[u] = c < nch ? __ldcs(wu + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * 32;
      if (c >= nch) break;
      float fg[E], fu[E];
      wvec<WT>::unpack(rg[u], fg);
      wvec<WT>::unpack(ru[u], fu);
#pragma unroll
      for (int m = 0; m < MT; m++) {
        if (m >= M) break;
        const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)m * K + (size_t)c * E);
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
          float4 t = __ldg(xp + j);
          ag[m] = fmaf(fg[4 * j], t.x, ag[m]);
          ag[m] = fmaf(fg[4 * j + 1], t.y, ag[m]);
          ag[m] = fmaf(fg[4 * j + 2], t.z, ag[m]);
          ag[m] = fmaf(fg[4 * j + 3], t.w, ag[m]);
          au[m] = fmaf(fu[4 * j], t.x, au[m]);
          au[m] = fmaf(fu[4 * j + 1], t.y, au[m]);
          au[m] = fmaf(fu[4 * j + 2], t.z, au[m]);
          au[m] = fmaf(fu[4 * j + 3], t.w, au[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; m++) {
    ag[m] = pd_warp_sum(ag[m]);
    au[m] = pd_warp_sum(au[m]);
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
      if (m >= M) break;
      const float g = ag[m] + (bias ? bias[f] : 0.0f);
      const float u = au[m] + (bias ? bias[F + f] : 0.0f);
      act[(size_t)m * F + f] = g / (1.0f + expf(-g)) * u;
    }
  }
}

template <typename WT, int MT>
void launch(cudaStream_t st, float *y, const float *x, const WT *w, const float *bias, int M,
            int N, int K) {
  const bool vec = K % wvec<WT>::n == 0 && ((uintptr_t)w & 15) == 0 && ((uintptr_t)x & 15) == 0;
  if (vec && MT <= 2) {
    /* (Splitting K of short outputs over several warps of a row was measured slower on the
     * H200: 62% instead of 66% of copy bandwidth on 4096 x 4096, 76% instead of 85% on 4096 x
     * 14336.) */
    gemv_row_kernel<WT, MT><<<(unsigned)((N + kWarps - 1) / kWarps), kWarps * 32, 0, st>>>(
        y, x, w, bias, M, N, K);
  } else if (vec) {
    constexpr int MV = MT <= 2 ? 4 : MT; /* (not instantiated for MT <= 2) */
    constexpr int rows = kWarps / tiling<MV>::KS * tiling<MV>::R;
    gemv_vec_kernel<WT, MV><<<(unsigned)((N + rows - 1) / rows), kWarps * 32, 0, st>>>(
        y, x, w, bias, M, N, K);
  } else {
    gemv_scalar_kernel<WT, MT><<<(unsigned)((N + kWarps - 1) / kWarps), kWarps * 32, 0, st>>>(
        y, x, w, bias, M, N, K);
  }
}

template <typename WT>
void dispatch_m(cudaStream_t st, float *y, const float *x, const WT *w, const float *bias, int M,
                int N, int K) {
  if (M == 1)
    launch<WT, 1>(st, y, x, w, bias, M, N, K);
  else if (M == 2)
    launch<WT, 2>(st, y, x, w, bias, M, N, K);
  else if (M <= 4)
    launch<WT, 4>(st, y, x, w, bias, M, N, K);
  else
    launch<WT, 8>(st, y, x, w, bias, M, N, K);
}

} // namespace

void pd_cuda_gemv(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                  const float *bias, int M, int N, int K) {
  if (wdt == PD_DTYPE_BF16)
    dispatch_m(st, y, x, (const __nv_bfloat16 *)w, bias, M, N, K);
  else if (wdt == PD_DTYPE_F16)
    dispatch_m(st, y, x, (const __half *)w, bias, M, N, K);
  else
    dispatch_m(st, y, x, (const float *)w, bias, M, N, K);
}

bool pd_cuda_gemv_glu_ok(const float *x, const void *w, pd_dtype wdt, int M, int K) {
  const int e = wdt == PD_DTYPE_F32 ? 4 : 8;
  return M >= 1 && M <= PD_CUDA_GEMV_GLU_MAX_M && K % e == 0 && ((uintptr_t)w & 15) == 0 &&
         ((uintptr_t)x & 15) == 0;
}

void pd_cuda_gemv_glu(cudaStream_t st, float *act, const float *x, const void *w, pd_dtype wdt,
                      const float *bias, int M, int F, int K) {
  const unsigned blocks = (unsigned)((F + kWarps - 1) / kWarps);
#define PD_GLU(WT)                                                                              \
  do {                                                                                         \
    if (M == 1)                                                                                \
      gemv_glu_kernel<WT, 1><<<blocks, kWarps * 32, 0, st>>>(act, x, (const WT *)w, bias, M,   \
                                                              F, K);                           \
    else                                                                                       \
      gemv_glu_kernel<WT, 2><<<blocks, kWarps * 32, 0, st>>>(act, x, (const WT *)w, bias, M,   \
                                                              F, K);                           \
  } while (0)
  if (wdt == PD_DTYPE_BF16)
    PD_GLU(__nv_bfloat16);
  else if (wdt == PD_DTYPE_F16)
    PD_GLU(__half);
  else
    PD_GLU(float);
#undef PD_GLU
}
