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

/* The RMSNorm hand-off between decode GEMVs (M <= 2). The residual add rides in the GEMV that
 * writes the residual stream x (y += x W^T, "acc"); with NEXT that GEMV also writes xg = x * g
 * (g: the next RMSNorm's weight, one element per warp, no extra pass) and, per block, the sum
 * of x^2 over its outputs. The next GEMV (PRE) takes xg as its input row, as any GEMV would,
 * sums the partials (loaded before its main loop, added after it) and scales its dot products
 * by 1 / sqrt(mean(x^2) + eps): what rmsnorm would have multiplied every element by. So the
 * norm costs neither a kernel nor work in the inner loop. */
struct pre_args {
  const float *ss; /* [M][parts] partial sums of x^2 */
  int parts;
  float eps;
};

/* A warp's rmsnorm scale for row m: the lanes load the partial sums (load) once the first
 * weight chunks are in flight, so that their latency hides behind those, and finish the sum
 * (scale) after the main loop. The partials are read 4 at a time (independent 16-byte loads,
 * one round trip for the usual 512 of them): summed one load after another they cost several
 * L2 round trips before the first weights were even requested. */
template <int MT> struct pre_sum {
  float v[MT];
  __device__ __forceinline__ void load(const pre_args &p, int M, int lane) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
      v[m] = 0.0f;
      if (m >= M) continue;
      const float *row = p.ss + (size_t)m * p.parts;
      if ((p.parts & 3) == 0 && ((uintptr_t)p.ss & 15) == 0) {
        const float4 *r4 = reinterpret_cast<const float4 *>(row);
#pragma unroll 4
        for (int i = lane; i < p.parts / 4; i += 32) {
          const float4 t = __ldg(r4 + i);
          v[m] += (t.x + t.y) + (t.z + t.w);
        }
      } else {
        for (int i = lane; i < p.parts; i += 32) v[m] += __ldg(row + i);
      }
    }
  }
  __device__ __forceinline__ float scale(const pre_args &p, int m, int K) {
    return 1.0f / sqrtf(pd_warp_sum(v[m]) / (float)K + p.eps);
  }
};

/* One warp's dot products of R rows of W (wr[r]: 16-byte chunks, K wide) with the M <= MT rows
 * of x: lanes take chunks c = lane, lane + 32, ..., U chunks of each row in flight per lane
 * (all loaded before any is used); acc[r][m] gets this lane's partial sums (a warp sum after).
 * The caller loads the first U chunks (warp_load at c0 = lane) and may issue other loads (the
 * norm partials) before warp_dot uses them.
 * (Software pipelining, the next U chunks requested before this U are used, measured slower on
 * the H200: 4096 x 4096 11.8 -> 12.7 us, 6144 x 4096 16.0 -> 19.2 us.) */
template <int R, int U>
__device__ __forceinline__ void warp_load(const uint4 *const (&wr)[R], int c0, int nch,
                                          uint4 (&raw)[U][R]) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int c = c0 + u * 32;
#pragma unroll
    for (int r = 0; r < R; r++) raw[u][r] = c < nch ? __ldcs(wr[r] + c) : make_uint4(0, 0, 0, 0);
  }
}

template <typename WT, int MT, int R, int U>
__device__ __forceinline__ void warp_fma(const uint4 (&raw)[U][R], const float *__restrict__ x,
                                         int M, int K, int c0, int nch, float (&acc)[R][MT]) {
  constexpr int E = wvec<WT>::n;
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int c = c0 + u * 32;
    if (c >= nch) break;
    float wf[R][E];
#pragma unroll
    for (int r = 0; r < R; r++) wvec<WT>::unpack(raw[u][r], wf[r]);
#pragma unroll
    for (int m = 0; m < MT; m++) {
      if (m >= M) break;
      const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)m * K + (size_t)c * E);
#pragma unroll
      for (int j = 0; j < E / 4; j++) {
        const float4 t = __ldg(xp + j);
#pragma unroll
        for (int r = 0; r < R; r++) {
          acc[r][m] = fmaf(wf[r][4 * j], t.x, acc[r][m]);
          acc[r][m] = fmaf(wf[r][4 * j + 1], t.y, acc[r][m]);
          acc[r][m] = fmaf(wf[r][4 * j + 2], t.z, acc[r][m]);
          acc[r][m] = fmaf(wf[r][4 * j + 3], t.w, acc[r][m]);
        }
      }
    }
  }
}

/* raw: the chunks at c0 = lane, from warp_load. */
template <typename WT, int MT, int R, int U>
__device__ __forceinline__ void warp_dot(const uint4 *const (&wr)[R], const float *__restrict__ x,
                                         int M, int K, int lane, uint4 (&raw)[U][R],
                                         float (&acc)[R][MT]) {
  const int nch = K / wvec<WT>::n;
  warp_fma<WT, MT, R, U>(raw, x, M, K, lane, nch, acc);
  for (int c0 = lane + 32 * U; c0 < nch; c0 += 32 * U) {
    warp_load<R, U>(wr, c0, nch, raw);
    warp_fma<WT, MT, R, U>(raw, x, M, K, c0, nch, acc);
  }
}

struct row_args {
  float *y;
  const float *x;
  const void *w;
  const float *bias;
  int M, N, K;
  bool acc;     /* y += */
  pre_args pre; /* PRE */
  const float *next_g; /* NEXT: [N] */
  float *next_xg;      /* NEXT: [M, N] */
  float *next_ss;      /* NEXT: [M][gridDim.x] */
};

/* M <= 2: a warp per row of W walking the whole of K, U = 4 chunks in flight per lane, no
 * shared memory or barrier (but NEXT's one): measured the fastest on 4096 x 4096 .. 4096 x
 * 14336 decode shapes (the split-K block variant below pays a barrier and a second wave there).
 * (An RMSNorm folded into the inner loop, x * g and x^2 per element, measured slower than a
 * norm kernel of its own: the LM head went from 238 to 311 us; hence the hand-off above.) */
template <typename WT, int MT, bool PRE, bool NEXT, int U, int WPB>
__global__ void __launch_bounds__(WPB * 32) gemv_row_kernel(row_args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * WPB + warp, M = a.M, N = a.N, K = a.K;
  if (!NEXT && n >= N) return;
  const bool active = n < N;
  float dot[1][MT];
#pragma unroll
  for (int m = 0; m < MT; m++) dot[0][m] = 0.0f;
  const uint4 *const wr[1] = {
      reinterpret_cast<const uint4 *>(static_cast<const WT *>(a.w) + (size_t)(active ? n : 0) * K)};
  uint4 raw[U][1];
  pre_sum<MT> pre;
  if (active) warp_load<1, U>(wr, lane, K / wvec<WT>::n, raw);
  if (PRE) pre.load(a.pre, M, lane);
  if (active) warp_dot<WT, MT, 1, U>(wr, a.x, M, K, lane, raw, dot);
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) {
    acc[m] = pd_warp_sum(dot[0][m]);
    if (PRE) acc[m] *= pre.scale(a.pre, m, K);
  }
  __shared__ float sq[NEXT ? WPB : 1][MT];
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
      float v = 0.0f;
      if (m < M && active) {
        float *o = a.y + (size_t)m * N + n;
        v = acc[m] + (a.bias ? a.bias[n] : 0.0f);
        if (a.acc) v += *o;
        *o = v;
        if (NEXT) a.next_xg[(size_t)m * N + n] = v * a.next_g[n];
      }
      if (NEXT) sq[warp][m] = v * v;
    }
  }
  if (NEXT) {
    __syncthreads();
    if (threadIdx.x < MT && (int)threadIdx.x < M) {
      float t = 0.0f;
#pragma unroll
      for (int w2 = 0; w2 < WPB; w2++) t += sq[w2][threadIdx.x];
      a.next_ss[(size_t)threadIdx.x * gridDim.x + blockIdx.x] = t;
    }
  }
}

/* Vector variant: K % wvec<WT>::n == 0 and W, x 16-byte aligned. MT >= M rows of x. */
template <typename WT, int MT>
__global__ void __launch_bounds__(kWarps * 32, 2)
gemv_vec_kernel(float *__restrict__ y, const float *__restrict__ x, const WT *__restrict__ w,
                const float *__restrict__ bias, int M, int N, int K, bool acc_out) {
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
      y[(size_t)m * N + n] = acc_out ? y[(size_t)m * N + n] + s : s;
    }
  }
}

/* Scalar variant for any K and alignment: a warp per row, lanes take consecutive elements. */
template <typename WT, int MT>
__global__ void __launch_bounds__(kWarps * 32)
gemv_scalar_kernel(float *__restrict__ y, const float *__restrict__ x, const WT *__restrict__ w,
                   const float *__restrict__ bias, int M, int N, int K, bool acc_out) {
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
      if (m < M) {
        float *o = y + (size_t)m * N + n;
        const float v = acc[m] + (bias ? bias[n] : 0.0f);
        *o = acc_out ? *o + v : v;
      }
  }
}

/* Two rows per warp (M <= 2), with an epilogue on the pair: a warp walks rows r0 and r1 together
 * (4 chunks of each in flight per lane), PRE as in gemv_row_kernel, then
 *  - EP_GLU:  pair j = (gate row j, up row F + j) -> act[m, j] = silu(gate) * up;
 *  - EP_ROPE: pair j = (h * hd + i, h * hd + i + hd / 2) of the qkv rows [q heads | k heads |
 *    v heads] -> RoPE'd q to q_out, RoPE'd k and plain v to the cache slot (as rope_kv_write,
 *    the same angle and rotation, so the same bits for the same products). */
enum { EP_GLU, EP_ROPE };

struct pair_args {
  const float *x;
  const void *w;
  const float *bias;
  int M, K, n_pairs;
  pre_args pre; /* PRE */
  float *act; /* EP_GLU: [M, F] */
  int F;
  float *q_out; /* EP_ROPE */
  const int32_t *pos, *slots;
  const float *inv_freq;
  void *kc, *vc;
  pd_dtype kdt;
  int bs, nq, nkv, hd;
};

__device__ __forceinline__ void store_kv(void *cache, pd_dtype dt, size_t i, float v) {
  if (dt == PD_DTYPE_BF16)
    static_cast<__nv_bfloat16 *>(cache)[i] = __float2bfloat16_rn(v);
  else if (dt == PD_DTYPE_F16)
    static_cast<__half *>(cache)[i] = __float2half_rn(v);
  else
    static_cast<float *>(cache)[i] = v;
}

template <typename WT, int MT, bool PRE, int EP, int U, int WPB>
__global__ void __launch_bounds__(WPB * 32) gemv_pair_kernel(pair_args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = blockIdx.x * WPB + warp;
  if (j >= a.n_pairs) return;
  const int K = a.K, M = a.M;
  int r0, r1, h = 0, i = 0;
  if (EP == EP_GLU) {
    r0 = j;
    r1 = a.F + j;
  } else {
    const int half = a.hd / 2;
    h = j / half;
    i = j - h * half;
    r0 = h * a.hd + i;
    r1 = r0 + half;
  }
  const WT *w = static_cast<const WT *>(a.w);
  const uint4 *const wr[2] = {reinterpret_cast<const uint4 *>(w + (size_t)r0 * K),
                              reinterpret_cast<const uint4 *>(w + (size_t)r1 * K)};
  uint4 raw[U][2];
  pre_sum<MT> pre;
  warp_load<2, U>(wr, lane, K / wvec<WT>::n, raw);
  float dot[2][MT];
#pragma unroll
  for (int m = 0; m < MT; m++) dot[0][m] = dot[1][m] = 0.0f;
  if (PRE) pre.load(a.pre, M, lane);
  warp_dot<WT, MT, 2, U>(wr, a.x, M, K, lane, raw, dot);
  float s0[MT], s1[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) {
    s0[m] = pd_warp_sum(dot[0][m]);
    s1[m] = pd_warp_sum(dot[1][m]);
    if (PRE) {
      const float inv = pre.scale(a.pre, m, K);
      s0[m] *= inv;
      s1[m] *= inv;
    }
  }
  if (lane != 0) return;
  const float b0 = a.bias ? a.bias[r0] : 0.0f, b1 = a.bias ? a.bias[r1] : 0.0f;
#pragma unroll
  for (int m = 0; m < MT; m++) {
    if (m >= M) break;
    const float v0 = s0[m] + b0, v1 = s1[m] + b1;
    if (EP == EP_GLU) {
      a.act[(size_t)m * a.F + j] = v0 / (1.0f + expf(-v0)) * v1;
    } else {
      const int half = a.hd / 2, nq = a.nq, nkv = a.nkv;
      if (h >= nq + nkv) { /* v: no rotation */
        const int slot = a.slots[m];
        if (slot < 0) continue;
        const int blk = slot / a.bs, off = slot - blk * a.bs;
        const size_t dst = (((size_t)blk * nkv + (h - nq - nkv)) * a.bs + off) * a.hd;
        store_kv(a.vc, a.kdt, dst + i, v0);
        store_kv(a.vc, a.kdt, dst + i + half, v1);
        continue;
      }
      float sn, cs;
      sincosf((float)a.pos[m] * a.inv_freq[i], &sn, &cs);
      const float y0 = pd_rope_rot0(v0, v1, cs, sn), y1 = pd_rope_rot1(v0, v1, cs, sn);
      if (h < nq) {
        float *qr = a.q_out + ((size_t)m * nq + h) * a.hd;
        qr[i] = y0;
        qr[i + half] = y1;
      } else {
        const int slot = a.slots[m];
        if (slot < 0) continue;
        const int blk = slot / a.bs, off = slot - blk * a.bs;
        const size_t dst = (((size_t)blk * nkv + (h - nq)) * a.bs + off) * a.hd;
        store_kv(a.kc, a.kdt, dst + i, y0);
        store_kv(a.kc, a.kdt, dst + i + half, y1);
      }
    }
  }
}

/* The decode GEMV's shape, measured on the H200 (Llama-3-8B decode at batch 1, and the kernel
 * bench): U = 4 chunks in flight per lane for one row per warp (U = 8: 4096 x 4096 12.0 -> 14.0
 * us, 230 -> 212 tok/s; U = 2: 12.8 us), U = 2 for the two-row kernel (the same 8 loads in
 * flight per lane: 231 -> 233 tok/s), 8 warps per block (4: the same). */
constexpr int kRowU = 4, kPairU = 2;

template <typename WT, int MT, bool PRE, bool NEXT>
void launch(cudaStream_t st, const row_args &a) {
  const bool vec = a.K % wvec<WT>::n == 0 && ((uintptr_t)a.w & 15) == 0 &&
                   ((uintptr_t)a.x & 15) == 0;
  const WT *w = static_cast<const WT *>(a.w);
  if (vec && MT <= 2) {
    /* (Splitting K of short outputs over several warps of a row was measured slower on the
     * H200: 62% instead of 66% of copy bandwidth on 4096 x 4096, 76% instead of 85% on 4096 x
     * 14336.) */
    gemv_row_kernel<WT, MT, PRE, NEXT, kRowU, kWarps>
        <<<(unsigned)((a.N + kWarps - 1) / kWarps), kWarps * 32, 0, st>>>(a);
  } else if (vec) {
    constexpr int MV = MT <= 2 ? 4 : MT; /* (not instantiated for MT <= 2) */
    constexpr int rows = kWarps / tiling<MV>::KS * tiling<MV>::R;
    gemv_vec_kernel<WT, MV><<<(unsigned)((a.N + rows - 1) / rows), kWarps * 32, 0, st>>>(
        a.y, a.x, w, a.bias, a.M, a.N, a.K, a.acc);
  } else {
    gemv_scalar_kernel<WT, MT><<<(unsigned)((a.N + kWarps - 1) / kWarps), kWarps * 32, 0, st>>>(
        a.y, a.x, w, a.bias, a.M, a.N, a.K, a.acc);
  }
}

template <typename WT> void dispatch_m(cudaStream_t st, const row_args &a) {
  if (a.M == 1)
    launch<WT, 1, false, false>(st, a);
  else if (a.M == 2)
    launch<WT, 2, false, false>(st, a);
  else if (a.M <= 4)
    launch<WT, 4, false, false>(st, a);
  else
    launch<WT, 8, false, false>(st, a);
}

/* The fused decode GEMV (M <= 2, vector path): PRE and NEXT chosen by the arguments. */
template <typename WT, int MT> void fused_row(cudaStream_t st, const row_args &a) {
  const bool pre = a.pre.ss != nullptr, next = a.next_xg != nullptr;
  if (pre && next)
    launch<WT, MT, true, true>(st, a);
  else if (pre)
    launch<WT, MT, true, false>(st, a);
  else if (next)
    launch<WT, MT, false, true>(st, a);
  else
    launch<WT, MT, false, false>(st, a);
}

template <typename WT, int EP>
void pair_launch(cudaStream_t st, const pair_args &a) {
  constexpr int U = kPairU, W = kWarps;
  {
    const unsigned blocks = (unsigned)((a.n_pairs + W - 1) / W);
    if (a.M == 1) {
      if (a.pre.ss)
        gemv_pair_kernel<WT, 1, true, EP, U, W><<<blocks, W * 32, 0, st>>>(a);
      else
        gemv_pair_kernel<WT, 1, false, EP, U, W><<<blocks, W * 32, 0, st>>>(a);
    } else {
      if (a.pre.ss)
        gemv_pair_kernel<WT, 2, true, EP, U, W><<<blocks, W * 32, 0, st>>>(a);
      else
        gemv_pair_kernel<WT, 2, false, EP, U, W><<<blocks, W * 32, 0, st>>>(a);
    }
  }
}

template <int EP> void pair_dispatch(cudaStream_t st, pd_dtype wdt, const pair_args &a) {
  if (wdt == PD_DTYPE_BF16)
    pair_launch<__nv_bfloat16, EP>(st, a);
  else if (wdt == PD_DTYPE_F16)
    pair_launch<__half, EP>(st, a);
  else
    pair_launch<float, EP>(st, a);
}

row_args make_row(float *y, const float *x, const void *w, const float *bias, int M, int N, int K,
                  bool accumulate) {
  row_args a = {};
  a.y = y;
  a.x = x;
  a.w = w;
  a.bias = bias;
  a.M = M;
  a.N = N;
  a.K = K;
  a.acc = accumulate;
  return a;
}

pair_args make_pair(const float *x, const void *w, const float *bias, int M, int K, int n_pairs) {
  pair_args a = {};
  a.x = x;
  a.w = w;
  a.bias = bias;
  a.M = M;
  a.K = K;
  a.n_pairs = n_pairs;
  return a;
}

pre_args to_pre(const pd_cuda_gemv_pre *p) {
  pre_args r = {};
  if (p) {
    r.ss = p->ss;
    r.parts = p->parts;
    r.eps = p->eps;
  }
  return r;
}

} // namespace

void pd_cuda_gemv(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                  const float *bias, int M, int N, int K, bool accumulate) {
  const row_args a = make_row(y, x, w, bias, M, N, K, accumulate);
  if (wdt == PD_DTYPE_BF16)
    dispatch_m<__nv_bfloat16>(st, a);
  else if (wdt == PD_DTYPE_F16)
    dispatch_m<__half>(st, a);
  else
    dispatch_m<float>(st, a);
}

bool pd_cuda_gemv_fused_ok(const float *x, const void *w, pd_dtype wdt, int M, int K) {
  if (wdt != PD_DTYPE_F32 && wdt != PD_DTYPE_F16 && wdt != PD_DTYPE_BF16) return false;
  const int e = wdt == PD_DTYPE_F32 ? 4 : 8;
  return M >= 1 && M <= PD_CUDA_GEMV_FUSED_MAX_M && K % e == 0 && ((uintptr_t)w & 15) == 0 &&
         ((uintptr_t)x & 15) == 0;
}

int pd_cuda_gemv_next_parts(int N) { return (N + kWarps - 1) / kWarps; }

void pd_cuda_gemv_glu(cudaStream_t st, float *act, const float *x, const void *w, pd_dtype wdt,
                      const float *bias, int M, int F, int K, const pd_cuda_gemv_pre *pre) {
  pair_args a = make_pair(x, w, bias, M, K, F);
  a.pre = to_pre(pre);
  a.act = act;
  a.F = F;
  pair_dispatch<EP_GLU>(st, wdt, a);
}

void pd_cuda_gemv_fused(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                        const float *bias, int M, int N, int K, bool accumulate,
                        const pd_cuda_gemv_pre *pre, const float *next_g, float *next_xg,
                        float *next_ss) {
  row_args a = make_row(y, x, w, bias, M, N, K, accumulate);
  a.pre = to_pre(pre);
  a.next_g = next_g;
  a.next_xg = next_xg;
  a.next_ss = next_ss;
#define PD_FUSED(WT)                                                                            \
  do {                                                                                         \
    if (M == 1)                                                                                \
      fused_row<WT, 1>(st, a);                                                                 \
    else                                                                                       \
      fused_row<WT, 2>(st, a);                                                                 \
  } while (0)
  if (wdt == PD_DTYPE_BF16)
    PD_FUSED(__nv_bfloat16);
  else if (wdt == PD_DTYPE_F16)
    PD_FUSED(__half);
  else
    PD_FUSED(float);
#undef PD_FUSED
}

void pd_cuda_gemv_rope_kv(cudaStream_t st, float *q_out, const float *x, const void *w,
                          pd_dtype wdt, const float *bias, int M, int K,
                          const pd_cuda_gemv_pre *pre, const int32_t *pos,
                          const float *inv_freq, const pd_kv_layer *kv, const pd_kv_shape *sh,
                          const int32_t *slots, int nq) {
  pair_args a = make_pair(x, w, bias, M, K, (nq + 2 * sh->num_kv_heads) * (sh->head_dim / 2));
  a.pre = to_pre(pre);
  a.q_out = q_out;
  a.pos = pos;
  a.slots = slots;
  a.inv_freq = inv_freq;
  a.kc = kv->k;
  a.vc = kv->v;
  a.kdt = sh->dtype;
  a.bs = sh->block_size;
  a.nq = nq;
  a.nkv = sh->num_kv_heads;
  a.hd = sh->head_dim;
  pair_dispatch<EP_ROPE>(st, wdt, a);
}
