/* Row and elementwise ops of the CUDA backend: norms, embedding, RoPE, SwiGLU, KV-cache writes,
 * row gathers, adds, bias and the activation conversion for cuBLAS. All memory-bound, f32 math;
 * shapes as in backend.h. Each launcher queues one kernel on the stream. */
#include <type_traits>
#include "cuda_internal.h"

namespace {

constexpr int kRowThreads = 256;

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result. */
__device__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  v = pd_warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (l == 0) part[w] = v;
  __syncthreads();
  if (w == 0) {
    float t = l < nw ? part[l] : 0.0f;
    t = pd_warp_sum(t);
    if (l == 0) total = t;
  }
  __syncthreads();
  return total;
}

/* One block per row. r != NULL: x += r first (written back to x). y may alias x.
 * Rows of up to kRowThreads * 4 * kRowVecs floats (float4-aligned) are held in registers: every
 * load of the row is issued before any is used (one memory round trip, not one per element: a
 * decode step's norm of one 4096-wide row took 12.7 us the element-wise way, serialised by the
 * store to x that may alias r). Other rows take the plain loops. */
constexpr int kRowVecs = 8;

/* The vectorised RMSNorms' second half: a row's sum of squares ss (this thread's part) summed
 * over the block, then the row's values v (kRowVecs float4 a thread, i = threadIdx.x + k *
 * kRowThreads) times 1 / rms and w, stored as floats or as 16-bit values (TO). */
template <typename TO>
__device__ __forceinline__ void norm_store(TO *__restrict__ yr, const float4 (&v)[kRowVecs],
                                           float ss, const float *__restrict__ w, float eps,
                                           int D) {
  const int n4 = D / 4;
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
  for (int k = 0; k < kRowVecs; k++) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i < n4) {
      const float4 g = __ldg(reinterpret_cast<const float4 *>(w) + i);
      if constexpr (std::is_same<TO, float>::value) {
        reinterpret_cast<float4 *>(yr)[i] =
            make_float4(v[k].x * inv * g.x, v[k].y * inv * g.y, v[k].z * inv * g.z,
                        v[k].w * inv * g.w);
      } else {
        uint2 o = make_uint2(pd_pack2(v[k].x * inv * g.x, v[k].y * inv * g.y, (TO *)nullptr),
                             pd_pack2(v[k].z * inv * g.z, v[k].w * inv * g.w, (TO *)nullptr));
        reinterpret_cast<uint2 *>(yr)[i] = o;
      }
    }
  }
}

__global__ void __launch_bounds__(kRowThreads)
rmsnorm_kernel(float *__restrict__ y, float *x, const float *__restrict__ r,
               const float *__restrict__ w, float eps, int D) {
  const size_t row = (size_t)blockIdx.x * D;
  float *xr = x + row;
  float *yr = y + row;
  const float *rr = r ? r + row : nullptr;
  const int n4 = D / 4;
  const bool vec = D % 4 == 0 && n4 <= kRowThreads * kRowVecs &&
                   (((uintptr_t)xr | (uintptr_t)yr | (uintptr_t)w | (uintptr_t)rr) & 15) == 0;
  if (vec) {
    float4 v[kRowVecs];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kRowVecs; k++) {
      const int i = threadIdx.x + k * kRowThreads;
      if (i < n4) v[k] = reinterpret_cast<const float4 *>(xr)[i];
    }
    if (rr) {
#pragma unroll
      for (int k = 0; k < kRowVecs; k++) {
        const int i = threadIdx.x + k * kRowThreads;
        if (i < n4) {
          const float4 b = __ldg(reinterpret_cast<const float4 *>(rr) + i);
          v[k].x += b.x; v[k].y += b.y; v[k].z += b.z; v[k].w += b.w;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kRowVecs; k++) {
      const int i = threadIdx.x + k * kRowThreads;
      if (i < n4) {
        ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
        if (rr) reinterpret_cast<float4 *>(xr)[i] = v[k];
      }
    }
    norm_store(yr, v, ss, w, eps, D);
    return;
  }
  float ss = 0.0f;
  if (rr) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      float v = xr[i] + rr[i];
      xr[i] = v;
      ss += v * v;
    }
  } else {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      float v = xr[i];
      ss += v * v;
    }
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / (float)D + eps);
  /* Each thread rereads only the elements it wrote (or read) itself: no race when y == x. */
  for (int i = threadIdx.x; i < D; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

/* One block per token. Rows whose width is a multiple of a 16-byte chunk (and aligned) are
 * copied with every chunk load of a pass issued before any store (kEmbedVecs chunks a thread):
 * one memory round trip for a 4096-wide bf16 row instead of one per element, which made the
 * decode step's first kernel take 7.2 us (CUPTI trace on the H200). */
constexpr int kEmbedVecs = 4;

/* NEXT: also the RMSNorm hand-off of the decode GEMVs (pd_cuda_gemv_pre) for the first layer's
 * QKV: xg = y * g and the row's sum of y^2 in ss[row] (one part a row). */
template <typename T, bool NEXT>
__global__ void embed_kernel(float *__restrict__ y, const T *__restrict__ table,
                             const int32_t *__restrict__ ids, int D, const float *__restrict__ g,
                             float *__restrict__ xg, float *__restrict__ ss) {
  const T *src = table + (size_t)ids[blockIdx.x] * D;
  float *dst = y + (size_t)blockIdx.x * D;
  float *xgr = NEXT ? xg + (size_t)blockIdx.x * D : nullptr;
  float sq = 0.0f;
  constexpr int E = 16 / sizeof(T); /* elements per chunk */
  if (D % E == 0 &&
      (((uintptr_t)src | (uintptr_t)dst | (uintptr_t)xgr | (uintptr_t)(NEXT ? g : nullptr)) &
       15) == 0) {
    const int nch = D / E;
    for (int c0 = threadIdx.x; c0 < nch; c0 += blockDim.x * kEmbedVecs) {
      uint4 raw[kEmbedVecs];
#pragma unroll
      for (int v = 0; v < kEmbedVecs; v++) {
        const int c = c0 + v * blockDim.x;
        if (c < nch) raw[v] = __ldg(reinterpret_cast<const uint4 *>(src) + c);
      }
#pragma unroll
      for (int v = 0; v < kEmbedVecs; v++) {
        const int c = c0 + v * blockDim.x;
        if (c >= nch) break;
        const T *t = reinterpret_cast<const T *>(&raw[v]);
        float4 *o = reinterpret_cast<float4 *>(dst + (size_t)c * E);
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
          const float4 v = make_float4(pd_to_f32(t[4 * j]), pd_to_f32(t[4 * j + 1]),
                                       pd_to_f32(t[4 * j + 2]), pd_to_f32(t[4 * j + 3]));
          o[j] = v;
          if (NEXT) {
            const int e0 = c * E + 4 * j;
            const float4 gw = __ldg(reinterpret_cast<const float4 *>(g + e0));
            reinterpret_cast<float4 *>(xgr + e0)[0] =
                make_float4(v.x * gw.x, v.y * gw.y, v.z * gw.z, v.w * gw.w);
            sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
          }
        }
      }
    }
  } else {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float v = pd_to_f32(src[i]);
      dst[i] = v;
      if (NEXT) {
        xgr[i] = v * g[i];
        sq += v * v;
      }
    }
  }
  if (NEXT) {
    sq = block_sum(sq);
    if (threadIdx.x == 0) ss[blockIdx.x] = sq;
  }
}

/* One block per token: each thread owns frequency indices i (stride blockDim), computes the
 * angle once (rounded to float first, as Hugging Face does) and rotates that pair in every head. */
__global__ void rope_kernel(float *q, float *k, const int32_t *__restrict__ pos,
                            const float *__restrict__ inv_freq, int nqh, int nkvh, int hd) {
  const int half = hd / 2;
  const float p = (float)pos[blockIdx.x];
  float *qr = q ? q + (size_t)blockIdx.x * nqh * hd : nullptr;
  float *kr = k ? k + (size_t)blockIdx.x * nkvh * hd : nullptr;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float ang = p * inv_freq[i];
    float s, c;
    sincosf(ang, &s, &c);
    if (qr)
      for (int h = 0; h < nqh; h++) {
        float *v = qr + (size_t)h * hd;
        float x0 = v[i], x1 = v[i + half];
        v[i] = pd_rope_rot0(x0, x1, c, s);
        v[i + half] = pd_rope_rot1(x0, x1, c, s);
      }
    if (kr)
      for (int h = 0; h < nkvh; h++) {
        float *v = kr + (size_t)h * hd;
        float x0 = v[i], x1 = v[i + half];
        v[i] = pd_rope_rot0(x0, x1, c, s);
        v[i + half] = pd_rope_rot1(x0, x1, c, s);
      }
  }
}

__global__ void swiglu_kernel(float *__restrict__ y, const float *__restrict__ gu, int F,
                              size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t m = i / (size_t)F, f = i - m * (size_t)F;
    const float *row = gu + m * 2 * (size_t)F;
    float g = row[f], u = row[F + f];
    y[i] = g / (1.0f + expf(-g)) * u;
  }
}


/* RMSNorm of rows of D % 4 == 0, D <= kRowThreads * 4 * kRowVecs (aligned) written as 16-bit
 * values: the GEMM operand straight away (the f32 row and the conversion pass skipped). */
template <typename T16>
__global__ void __launch_bounds__(kRowThreads)
rmsnorm16_kernel(T16 *__restrict__ y, const float *__restrict__ x, const float *__restrict__ w,
                 float eps, int D) {
  const float *xr = x + (size_t)blockIdx.x * D;
  T16 *yr = y + (size_t)blockIdx.x * D;
  const int n4 = D / 4;
  float4 v[kRowVecs];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kRowVecs; k++) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i < n4) {
      v[k] = __ldg(reinterpret_cast<const float4 *>(xr) + i);
      ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
  }
  norm_store(yr, v, ss, w, eps, D);
}

/* x += the sum of NP partial products [NP][M][D] (+ bias), then the RMSNorm of the new x as
 * 16-bit values into y: a split GEMM's reduction, the residual add and the next GEMM's operand
 * in one pass (rows of D % 4 == 0, D <= kRowThreads * 4 * kRowVecs, aligned). */
template <typename T16>
__global__ void __launch_bounds__(kRowThreads)
add_rmsnorm16_kernel(T16 *__restrict__ y, float *__restrict__ x, const float *__restrict__ parts,
                     int np, size_t part_stride, const float *__restrict__ bias,
                     const float *__restrict__ w, float eps, int D) {
  float *xr = x + (size_t)blockIdx.x * D;
  const float *pr = parts + (size_t)blockIdx.x * D;
  T16 *yr = y + (size_t)blockIdx.x * D;
  const int n4 = D / 4;
  float4 v[kRowVecs];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kRowVecs; k++) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i < n4) {
      float4 a = reinterpret_cast<const float4 *>(xr)[i];
      for (int p = 0; p < np; p++) {
        const float4 b = reinterpret_cast<const float4 *>(pr + p * part_stride)[i];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      }
      if (bias) {
        const float4 b = __ldg(reinterpret_cast<const float4 *>(bias) + i);
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      }
      reinterpret_cast<float4 *>(xr)[i] = a;
      v[k] = a;
      ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
  }
  norm_store(yr, v, ss, w, eps, D);
}

/* y[m, f] = silu(g + bg) * (u + bu) from 16-bit rows [g | u] of 2F (cuBLAS's output), y in f32
 * or in the 16-bit type (the next GEMM's operand); a 2D grid (row = blockIdx.y), eight outputs
 * per thread, by 16-byte loads and stores when F % 8 == 0 (V8: every row then starts 16-byte
 * aligned in gu and in y), else one at a time. */
template <typename T16, typename TO, bool V8>
__global__ void swiglu16_kernel(TO *__restrict__ y, const T16 *__restrict__ gu,
                                const float *__restrict__ bias, int F) {
  const T16 *row = gu + (size_t)blockIdx.y * 2 * F;
  TO *yr = y + (size_t)blockIdx.y * F;
  const int f = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (f >= F) return;
  auto act = [&](float g, float u, int j) {
    g += bias ? bias[f + j] : 0.0f;
    u += bias ? bias[F + f + j] : 0.0f;
    return pd_from_f32<TO>(g / (1.0f + expf(-g)) * u);
  };
  if constexpr (V8) {
    const uint4 gv = __ldg(reinterpret_cast<const uint4 *>(row + f));
    const uint4 uv = __ldg(reinterpret_cast<const uint4 *>(row + F + f));
    const T16 *gp = reinterpret_cast<const T16 *>(&gv), *up = reinterpret_cast<const T16 *>(&uv);
    __align__(16) TO o[8];
#pragma unroll
    for (int j = 0; j < 8; j++) o[j] = act(pd_to_f32(gp[j]), pd_to_f32(up[j]), j);
    if constexpr (sizeof(TO) == 2) {
      *reinterpret_cast<uint4 *>(yr + f) = *reinterpret_cast<const uint4 *>(o);
    } else {
      reinterpret_cast<float4 *>(yr + f)[0] = reinterpret_cast<const float4 *>(o)[0];
      reinterpret_cast<float4 *>(yr + f)[1] = reinterpret_cast<const float4 *>(o)[1];
    }
  } else {
    const int n = F - f < 8 ? F - f : 8;
    for (int j = 0; j < n; j++)
      yr[f + j] = act(pd_to_f32(row[f + j]), pd_to_f32(row[F + f + j]), j);
  }
}

template <typename T16, typename TO>
void launch_swiglu16(cudaStream_t st, TO *y, const T16 *gu, const float *bias, int M, int F) {
  dim3 grid((unsigned)((F / 8 + 1 + 255) / 256), (unsigned)M);
  if (F % 8 == 0)
    swiglu16_kernel<T16, TO, true><<<grid, 256, 0, st>>>(y, gu, bias, F);
  else
    swiglu16_kernel<T16, TO, false><<<grid, 256, 0, st>>>(y, gu, bias, F);
}

template <typename T16>
__global__ void widen_kernel(float *__restrict__ dst, const T16 *__restrict__ src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = pd_to_f32(src[i]);
}

/* One block per token row; threads over (kv head, dim). */
template <typename T>
__global__ void kv_write_kernel(T *__restrict__ kc, T *__restrict__ vc, const float *__restrict__ k,
                                const float *__restrict__ v, const int32_t *__restrict__ slots,
                                int bs, int nkv, int hd) {
  const int slot = slots[blockIdx.x];
  if (slot < 0) return;
  const int blk = slot / bs, off = slot - blk * bs;
  const int row = nkv * hd;
  const float *kr = k + (size_t)blockIdx.x * row, *vr = v + (size_t)blockIdx.x * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    int g = i / hd, d = i - g * hd;
    size_t dst = (((size_t)blk * nkv + g) * bs + off) * hd + d;
    kc[dst] = pd_from_f32<T>(kr[i]);
    vc[dst] = pd_from_f32<T>(vr[i]);
  }
}

/* Fused decode path: one block per token row of qkv = [q | k | v]. RoPE on q (written to q_out)
 * and on k, then k and v go to the cache slot; the same arithmetic as rope_kernel followed by
 * kv_write_kernel, so the results are identical to the separate ops. */
template <typename T>
__global__ void rope_kv_write_kernel(float *__restrict__ q_out, const float *__restrict__ qkv,
                                     const int32_t *__restrict__ pos,
                                     const float *__restrict__ inv_freq, T *__restrict__ kc,
                                     T *__restrict__ vc, const int32_t *__restrict__ slots,
                                     int bs, int nqh, int nkvh, int hd) {
  const int half = hd / 2;
  const size_t row = (size_t)(nqh + 2 * nkvh) * hd;
  const float *src = qkv + (size_t)blockIdx.x * row;
  const float p = (float)pos[blockIdx.x];
  const int slot = slots[blockIdx.x];
  const int blk = slot >= 0 ? slot / bs : 0, off = slot >= 0 ? slot - blk * bs : 0;
  float *qr = q_out + (size_t)blockIdx.x * nqh * hd;
  /* the angles once per token (head_dim <= 256), then every head's pairs */
  __shared__ float sn_s[128], cs_s[128];
  for (int i = threadIdx.x; i < half; i += blockDim.x) sincosf(p * inv_freq[i], &sn_s[i], &cs_s[i]);
  __syncthreads();
  const int n_rot = (nqh + nkvh) * half;
  for (int idx = threadIdx.x; idx < n_rot; idx += blockDim.x) {
    const int h = idx / half, i = idx - h * half;
    const float s = sn_s[i], c = cs_s[i];
    const float *v = src + (size_t)h * hd;
    const float x0 = v[i], x1 = v[i + half];
    const float y0 = pd_rope_rot0(x0, x1, c, s), y1 = pd_rope_rot1(x0, x1, c, s);
    if (h < nqh) {
      qr[(size_t)h * hd + i] = y0;
      qr[(size_t)h * hd + i + half] = y1;
    } else if (slot >= 0) {
      const int g = h - nqh;
      const size_t dst = (((size_t)blk * nkvh + g) * bs + off) * hd;
      kc[dst + i] = pd_from_f32<T>(y0);
      kc[dst + i + half] = pd_from_f32<T>(y1);
    }
  }
  if (slot < 0) return;
  const float *vr = src + (size_t)(nqh + nkvh) * hd;
  for (int idx = threadIdx.x; idx < nkvh * hd; idx += blockDim.x) {
    const int g = idx / hd, d = idx - g * hd;
    vc[(((size_t)blk * nkvh + g) * bs + off) * hd + d] = pd_from_f32<T>(vr[idx]);
  }
}

__global__ void get_rows_kernel(float *__restrict__ y, const float *__restrict__ x,
                                const int32_t *__restrict__ idx, int D) {
  const float *src = x + (size_t)idx[blockIdx.x] * D;
  float *dst = y + (size_t)blockIdx.x * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
}

__global__ void trap_kernel() { __trap(); }

/* One block a row: y = xg * 1 / sqrt(sum(ss row) / K + eps), as the decode GEMV finishes it. */
__global__ void norm_finish_kernel(float *__restrict__ y, const float *__restrict__ xg,
                                   const float *__restrict__ ss, int parts, float eps, int K) {
  const size_t m = blockIdx.x;
  float s = 0.0f;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) s += ss[m * parts + i];
  s = block_sum(s);
  const float inv = 1.0f / sqrtf(s / (float)K + eps);
  for (int i = threadIdx.x; i < K; i += blockDim.x) y[m * K + i] = xg[m * K + i] * inv;
}

__global__ void add_kernel(float *__restrict__ y, const float *__restrict__ x, size_t n) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  /* float4 body when both are 16-byte aligned (cudaMalloc'ed buffers at row starts are). */
  if ((((uintptr_t)y | (uintptr_t)x) & 15) == 0) {
    size_t n4 = n / 4;
    float4 *y4 = reinterpret_cast<float4 *>(y);
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    for (size_t j = i; j < n4; j += stride) {
      float4 a = y4[j], b = x4[j];
      a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
      y4[j] = a;
    }
    for (size_t j = n4 * 4 + i; j < n; j += stride) y[j] += x[j];
  } else {
    for (size_t j = i; j < n; j += stride) y[j] += x[j];
  }
}

__global__ void bias_kernel(float *__restrict__ y, const float *__restrict__ bias, int N,
                            size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] += bias[i % (size_t)N];
}

template <typename T>
__global__ void convert_kernel(T *__restrict__ dst, const float *__restrict__ src, size_t n) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  /* four at a time when both ends are aligned (cudaMalloc'ed buffers are) */
  if ((((uintptr_t)dst & 7) | ((uintptr_t)src & 15)) == 0) {
    const size_t n4 = n / 4;
    for (size_t j = i; j < n4; j += stride) {
      const float4 v = __ldg(reinterpret_cast<const float4 *>(src) + j);
      reinterpret_cast<uint2 *>(dst)[j] =
          make_uint2(pd_pack2(v.x, v.y, (T *)nullptr), pd_pack2(v.z, v.w, (T *)nullptr));
    }
    for (size_t j = n4 * 4 + i; j < n; j += stride) dst[j] = pd_from_f32<T>(src[j]);
    return;
  }
  for (; i < n; i += stride) dst[i] = pd_from_f32<T>(src[i]);
}

/* Grid for a grid-stride loop over n elements: enough blocks to fill the GPU, capped. */
unsigned grid_for(size_t n, int threads) {
  size_t b = (n + threads - 1) / threads;
  if (b > 65536) b = 65536;
  return b ? (unsigned)b : 1u;
}

int row_threads(int D) {
  int t = 32;
  while (t < D && t < kRowThreads) t *= 2;
  return t;
}

} // namespace

void pd_cuda_rmsnorm(cudaStream_t st, float *y, float *x, const float *r, const float *w,
                     float eps, int M, int D) {
  rmsnorm_kernel<<<M, row_threads(D), 0, st>>>(y, x, r, w, eps, D);
}

void pd_cuda_embed(cudaStream_t st, float *y, const void *table, pd_dtype dt, const int32_t *ids,
                   int M, int D, const float *next_g, float *next_xg, float *next_ss) {
  const int t = row_threads(D);
#define PD_EMBED(T)                                                                             \
  do {                                                                                         \
    if (next_xg)                                                                               \
      embed_kernel<T, true><<<M, t, 0, st>>>(y, (const T *)table, ids, D, next_g, next_xg,     \
                                             next_ss);                                         \
    else                                                                                       \
      embed_kernel<T, false><<<M, t, 0, st>>>(y, (const T *)table, ids, D, NULL, NULL, NULL);  \
  } while (0)
  if (dt == PD_DTYPE_BF16)
    PD_EMBED(__nv_bfloat16);
  else if (dt == PD_DTYPE_F16)
    PD_EMBED(__half);
  else
    PD_EMBED(float);
#undef PD_EMBED
}

void pd_cuda_rope(cudaStream_t st, float *q, float *k, const int32_t *pos, const float *inv_freq,
                  int M, int nqh, int nkvh, int hd) {
  int half = hd / 2, t = 32;
  while (t < half && t < 128) t *= 2;
  rope_kernel<<<M, t, 0, st>>>(nqh ? q : nullptr, nkvh ? k : nullptr, pos, inv_freq, nqh, nkvh,
                               hd);
}

bool pd_cuda_rmsnorm16_ok(const float *x, const float *w, int D) {
  return D % 4 == 0 && D / 4 <= kRowThreads * kRowVecs && (((uintptr_t)x | (uintptr_t)w) & 15) == 0;
}

void pd_cuda_rmsnorm16(cudaStream_t st, void *y, pd_dtype dt, const float *x, const float *w,
                       float eps, int M, int D) {
  if (dt == PD_DTYPE_BF16)
    rmsnorm16_kernel<<<M, row_threads(D / 4), 0, st>>>((__nv_bfloat16 *)y, x, w, eps, D);
  else
    rmsnorm16_kernel<<<M, row_threads(D / 4), 0, st>>>((__half *)y, x, w, eps, D);
}

void pd_cuda_add_rmsnorm16(cudaStream_t st, void *y, pd_dtype dt, float *x, const float *parts,
                           int n_parts, size_t part_stride, const float *bias, const float *w,
                           float eps, int M, int D) {
  if (dt == PD_DTYPE_BF16)
    add_rmsnorm16_kernel<<<M, row_threads(D / 4), 0, st>>>((__nv_bfloat16 *)y, x, parts, n_parts,
                                                           part_stride, bias, w, eps, D);
  else
    add_rmsnorm16_kernel<<<M, row_threads(D / 4), 0, st>>>((__half *)y, x, parts, n_parts,
                                                           part_stride, bias, w, eps, D);
}

void pd_cuda_swiglu16(cudaStream_t st, float *y, const void *gu, pd_dtype dt, const float *bias,
                      int M, int F) {
  if (dt == PD_DTYPE_BF16)
    launch_swiglu16(st, y, (const __nv_bfloat16 *)gu, bias, M, F);
  else
    launch_swiglu16(st, y, (const __half *)gu, bias, M, F);
}

void pd_cuda_swiglu16_to16(cudaStream_t st, void *y, const void *gu, pd_dtype dt,
                           const float *bias, int M, int F) {
  if (dt == PD_DTYPE_BF16)
    launch_swiglu16(st, (__nv_bfloat16 *)y, (const __nv_bfloat16 *)gu, bias, M, F);
  else
    launch_swiglu16(st, (__half *)y, (const __half *)gu, bias, M, F);
}

void pd_cuda_widen(cudaStream_t st, float *dst, const void *src, pd_dtype dt, size_t n) {
  if (dt == PD_DTYPE_BF16)
    widen_kernel<<<grid_for(n, 256), 256, 0, st>>>(dst, (const __nv_bfloat16 *)src, n);
  else
    widen_kernel<<<grid_for(n, 256), 256, 0, st>>>(dst, (const __half *)src, n);
}

void pd_cuda_swiglu(cudaStream_t st, float *y, const float *gu, int M, int F) {
  size_t n = (size_t)M * F;
  swiglu_kernel<<<grid_for(n, 256), 256, 0, st>>>(y, gu, F, n);
}

void pd_cuda_kv_write(cudaStream_t st, const pd_kv_layer *kv, const pd_kv_shape *sh,
                      const float *k, const float *v, const int32_t *slots, int M) {
  int t = row_threads(sh->num_kv_heads * sh->head_dim);
  if (sh->dtype == PD_DTYPE_BF16)
    kv_write_kernel<<<M, t, 0, st>>>((__nv_bfloat16 *)kv->k, (__nv_bfloat16 *)kv->v, k, v, slots,
                                     sh->block_size, sh->num_kv_heads, sh->head_dim);
  else if (sh->dtype == PD_DTYPE_F16)
    kv_write_kernel<<<M, t, 0, st>>>((__half *)kv->k, (__half *)kv->v, k, v, slots,
                                     sh->block_size, sh->num_kv_heads, sh->head_dim);
  else
    kv_write_kernel<<<M, t, 0, st>>>((float *)kv->k, (float *)kv->v, k, v, slots, sh->block_size,
                                     sh->num_kv_heads, sh->head_dim);
}

void pd_cuda_get_rows(cudaStream_t st, float *y, const float *x, const int32_t *idx, int n, int D) {
  get_rows_kernel<<<n, row_threads(D), 0, st>>>(y, x, idx, D);
}

void pd_cuda_add(cudaStream_t st, float *y, const float *x, size_t n) {
  add_kernel<<<grid_for((n + 3) / 4, 256), 256, 0, st>>>(y, x, n);
}

void pd_cuda_trap(cudaStream_t st) { trap_kernel<<<1, 1, 0, st>>>(); }

void pd_cuda_norm_finish(cudaStream_t st, float *y, const float *xg, const float *ss, int parts,
                         float eps, int M, int K) {
  norm_finish_kernel<<<M, 256, 0, st>>>(y, xg, ss, parts, eps, K);
}

void pd_cuda_bias(cudaStream_t st, float *y, const float *bias, int M, int N) {
  size_t n = (size_t)M * N;
  bias_kernel<<<grid_for(n, 256), 256, 0, st>>>(y, bias, N, n);
}

void pd_cuda_convert(cudaStream_t st, void *dst, pd_dtype dt, const float *src, size_t n) {
  if (dt == PD_DTYPE_BF16)
    convert_kernel<<<grid_for(n, 256), 256, 0, st>>>((__nv_bfloat16 *)dst, src, n);
  else
    convert_kernel<<<grid_for(n, 256), 256, 0, st>>>((__half *)dst, src, n);
}

void pd_cuda_rope_kv_write(cudaStream_t st, float *q_out, const float *qkv, const int32_t *pos,
                           const float *inv_freq, const pd_kv_layer *kv, const pd_kv_shape *sh,
                           const int32_t *slots, int M, int nqh) {
  const int nkvh = sh->num_kv_heads, hd = sh->head_dim, bs = sh->block_size;
  int t = 32;
  const int cap = M < 64 ? 1024 : 256; /* few rows: wide blocks, so each thread does little */
  while (t < (nqh + nkvh) * hd / 2 && t < cap) t *= 2;
  if (sh->dtype == PD_DTYPE_BF16)
    rope_kv_write_kernel<<<M, t, 0, st>>>(q_out, qkv, pos, inv_freq, (__nv_bfloat16 *)kv->k,
                                          (__nv_bfloat16 *)kv->v, slots, bs, nqh, nkvh, hd);
  else if (sh->dtype == PD_DTYPE_F16)
    rope_kv_write_kernel<<<M, t, 0, st>>>(q_out, qkv, pos, inv_freq, (__half *)kv->k,
                                          (__half *)kv->v, slots, bs, nqh, nkvh, hd);
  else
    rope_kv_write_kernel<<<M, t, 0, st>>>(q_out, qkv, pos, inv_freq, (float *)kv->k,
                                          (float *)kv->v, slots, bs, nqh, nkvh, hd);
}
