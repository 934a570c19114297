/* Internals of the CUDA backend: the backend state, error recording, device helpers shared by the
 * kernel files, and the launchers each op-family file exports to cuda_backend.cu. Not a public
 * header; C++ (CUDA) only.
 *
 * Layering (one .cu per op family, each with host-side launchers taking a stream):
 *   cuda_backend.cu      the ops table: argument checks, memory, cuBLAS, work splitting, errors
 *   cuda_elementwise.cu  rmsnorm, add_rmsnorm, embed, rope, swiglu, kv_write, get_rows, add,
 *                        bias, f32 -> bf16/f16 conversion, the 16-bit-output norm and SwiGLU
 *   cuda_gemv.cu         y = x W^T for small M (memory-bound; the backend uses it for M <= 2),
 *                        and the fused decode GEMVs of matmul_fused (residual add, RMSNorm
 *                        hand-off, SwiGLU, RoPE + KV write)
 *   cuda_attn_decode.cu  split-K paged decode attention, the split merge, the generic kernel
 *   cuda_attn_prefill.cu FlashAttention-style paged prefill on bf16 tensor cores
 *   cuda_attn_decode_tc.cu tensor-core decode attention for bf16/f16 caches
 *   cuda_quant.cu        4-bit and FP8 weights: their decode GEMV, dequantization to bf16
 *   cuda_mma.h           mma.sync / ldmatrix / cp.async helpers of the two tensor-core kernels
 * Further ops, registered by pd_backend_cuda_create (state in cuda_state.h): cuda_sample.cu
 * (sampling), cuda_kvstage.cu (KV staging, pinned memory), cuda_graph.cu (capture and replay),
 * cuda_profile.cu (PD_CUDA_PROFILE timers). */
#ifndef PD_CUDA_INTERNAL_H
#define PD_CUDA_INTERNAL_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pd/backend.h"

/* ---- device helpers --------------------------------------------------------------------------- */

/* Element conversions to and from float for the three stored float types. */
__device__ __forceinline__ float pd_to_f32(float v) { return v; }
__device__ __forceinline__ float pd_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float pd_to_f32(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T pd_from_f32(float v);
template <> __device__ __forceinline__ float pd_from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 pd_from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half pd_from_f32<__half>(float v) {
  return __float2half_rn(v);
}

/* Two floats to two packed 16-bit floats (lo in the low half), round to nearest even. */
__device__ __forceinline__ uint32_t pd_pack2(float lo, float hi, __nv_bfloat16 *) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t pd_pack2(float lo, float hi, __half *) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

/* Two packed 16-bit floats (one 32-bit word) to two floats. */
__device__ __forceinline__ float2 pd_unpack2(uint32_t u, __nv_bfloat16 *) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float2 pd_unpack2(uint32_t u, __half *) {
  __half2 h = *reinterpret_cast<__half2 *>(&u);
  return __half22float2(h);
}

/* Loads 8 consecutive elements at p (16-byte aligned for 16-bit types, 32-byte for f32) as
 * floats. "nc": read-only path. */
__device__ __forceinline__ void pd_load8(const float *p, float out[8]) {
  float4 a = __ldg(reinterpret_cast<const float4 *>(p));
  float4 b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
template <typename T16>
__device__ __forceinline__ void pd_load8_16(const T16 *p, float out[8]) {
  uint4 u = __ldg(reinterpret_cast<const uint4 *>(p));
  float2 f;
  f = pd_unpack2(u.x, (T16 *)nullptr); out[0] = f.x; out[1] = f.y;
  f = pd_unpack2(u.y, (T16 *)nullptr); out[2] = f.x; out[3] = f.y;
  f = pd_unpack2(u.z, (T16 *)nullptr); out[4] = f.x; out[5] = f.y;
  f = pd_unpack2(u.w, (T16 *)nullptr); out[6] = f.x; out[7] = f.y;
}
__device__ __forceinline__ void pd_load8(const __nv_bfloat16 *p, float out[8]) {
  pd_load8_16(p, out);
}
__device__ __forceinline__ void pd_load8(const __half *p, float out[8]) { pd_load8_16(p, out); }

__device__ __forceinline__ float pd_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float pd_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

#define PD_LOG2E 1.4426950408889634f

/* The RoPE rotation with explicit roundings (no FMA contraction), so that every kernel applying
 * RoPE gets the same bits. */
__device__ __forceinline__ float pd_rope_rot0(float x0, float x1, float c, float s) {
  return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
}
__device__ __forceinline__ float pd_rope_rot1(float x0, float x1, float c, float s) {
  return __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
}

/* ---- launchers (host side; all asynchronous on `st`) ------------------------------------------ */

/* Allows `kernel` (a __global__ function) `bytes` of dynamic shared memory on the current device
 * (the opt-in above the 48 KiB default); the attribute is set once per kernel and device. */
cudaError_t pd_cuda_smem_optin(const void *kernel, size_t bytes);

/* Elementwise family: shapes as in backend.h. dt / kv dtype are F32, F16 or BF16. */
void pd_cuda_rmsnorm(cudaStream_t st, float *y, float *x, const float *r, const float *w,
                     float eps, int M, int D);
/* next_xg != NULL: also the RMSNorm hand-off for the next GEMV (pd_cuda_gemv_pre with one part a
 * row): next_xg [M, D] = y * next_g, next_ss [M] the rows' sums of y^2. */
void pd_cuda_embed(cudaStream_t st, float *y, const void *table, pd_dtype dt, const int32_t *ids,
                   int M, int D, const float *next_g, float *next_xg, float *next_ss);
void pd_cuda_rope(cudaStream_t st, float *q, float *k, const int32_t *pos, const float *inv_freq,
                  int M, int nqh, int nkvh, int hd);
void pd_cuda_swiglu(cudaStream_t st, float *y, const float *gu, int M, int F);
void pd_cuda_kv_write(cudaStream_t st, const pd_kv_layer *kv, const pd_kv_shape *sh,
                      const float *k, const float *v, const int32_t *slots, int M);
/* RoPE on the q and k parts of qkv rows [q | k | v], q to q_out, k and v to the cache. */
void pd_cuda_rope_kv_write(cudaStream_t st, float *q_out, const float *qkv, const int32_t *pos,
                           const float *inv_freq, const pd_kv_layer *kv, const pd_kv_shape *sh,
                           const int32_t *slots, int M, int nqh);
void pd_cuda_get_rows(cudaStream_t st, float *y, const float *x, const int32_t *idx, int n, int D);
void pd_cuda_add(cudaStream_t st, float *y, const float *x, size_t n);
/* y [M, K] = xg * 1 / sqrt(sum(ss[m][0, parts)) / K + eps): an RMSNorm hand-off's rows (see
 * pd_cuda_gemv_pre) finished. */
void pd_cuda_norm_finish(cudaStream_t st, float *y, const float *xg, const float *ss, int parts,
                         float eps, int M, int K);
/* A kernel that traps: the context's sticky "unspecified launch failure", as a device fault
 * gives (fault-handling tests only; backend.h inject_fault). */
void pd_cuda_trap(cudaStream_t st);
/* y[M,N] += bias[N] for every row. */
void pd_cuda_bias(cudaStream_t st, float *y, const float *bias, int M, int N);
/* dst[n] = src[n] rounded to dt (BF16 or F16), round to nearest even. */
void pd_cuda_convert(cudaStream_t st, void *dst, pd_dtype dt, const float *src, size_t n);
/* RMSNorm (no residual) with 16-bit output (dt BF16 or F16), for rows pd_cuda_rmsnorm16_ok
 * takes (D % 4 == 0, D <= 8192, x and w 16-byte aligned). */
bool pd_cuda_rmsnorm16_ok(const float *x, const float *w, int D);
/* x [M, D] += sum_p parts[p * part_stride ..] (+ bias), then y = the RMSNorm of x with weights w
 * in 16 bits (dt BF16 or F16): a split GEMM's reduction, the residual add and the next GEMM's
 * operand in one pass (rows as pd_cuda_rmsnorm16_ok; parts 16-byte aligned) */
void pd_cuda_add_rmsnorm16(cudaStream_t st, void *y, pd_dtype dt, float *x, const float *parts,
                           int n_parts, size_t part_stride, const float *bias, const float *w,
                           float eps, int M, int D);
void pd_cuda_rmsnorm16(cudaStream_t st, void *y, pd_dtype dt, const float *x, const float *w,
                       float eps, int M, int D);
/* y[M, F] = silu(g + bias[:F]) * (u + bias[F:]) from 16-bit rows [g | u] (dt BF16 or F16);
 * bias may be NULL. */
void pd_cuda_swiglu16(cudaStream_t st, float *y, const void *gu, pd_dtype dt, const float *bias,
                      int M, int F);
/* The same with y [M, F] in dt (the next GEMM's 16-bit operand, rounded to nearest even). */
void pd_cuda_swiglu16_to16(cudaStream_t st, void *y, const void *gu, pd_dtype dt,
                           const float *bias, int M, int F);
/* dst[n] = src[n] (dt BF16 or F16) widened to f32. */
void pd_cuda_widen(cudaStream_t st, float *dst, const void *src, pd_dtype dt, size_t n);

/* GEMV: y[M,N] = x[M,K] W[N,K]^T (+bias) for 1 <= M <= PD_CUDA_GEMV_MAX_M. */
#define PD_CUDA_GEMV_MAX_M 8
void pd_cuda_gemv(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                  const float *bias, int M, int N, int K, bool accumulate);

/* The fused decode GEMVs below (gate/up + SwiGLU with both rows of an output in one warp, the
 * residual / hand-off GEMV, QKV + RoPE + KV write) take M <= PD_CUDA_GEMV_FUSED_MAX_M rows;
 * pd_cuda_gemv_fused_ok: whether they take these arguments (M in range, K a multiple of the
 * vector width, x and w 16-byte aligned). */
#define PD_CUDA_GEMV_FUSED_MAX_M 2
bool pd_cuda_gemv_fused_ok(const float *x, const void *w, pd_dtype wdt, int M, int K);
/* The RMSNorm hand-off of the decode GEMVs (cuda_gemv.cu): the GEMV that writes the residual
 * stream x also writes xg = x * g (g: the next norm's weight) and per-block partial sums of x^2
 * (pd_cuda_gemv_next_parts(N) of them per row); the next GEMV reads xg and scales its sums by
 * 1 / sqrt(sum / K + eps). */
typedef struct pd_cuda_gemv_pre {
  const float *ss; /* [M][parts] */
  int parts;
  float eps;
} pd_cuda_gemv_pre;
int pd_cuda_gemv_next_parts(int N);
/* act[M,F] = silu(x W_g^T + b_g) * (x W_u^T + b_u), w = [W_g; W_u]; pre != NULL: x is xg of a
 * hand-off. */
void pd_cuda_gemv_glu(cudaStream_t st, float *act, const float *x, const void *w, pd_dtype wdt,
                      const float *bias, int M, int F, int K, const pd_cuda_gemv_pre *pre);
/* The M <= 2 GEMV (preconditions of pd_cuda_gemv_fused_ok) with the hand-off: y (+)= x W^T +
 * bias; pre as above; next_xg != NULL: also xg and the partials (next_ss [M][parts]). */
void pd_cuda_gemv_fused(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                        const float *bias, int M, int N, int K, bool accumulate,
                        const pd_cuda_gemv_pre *pre, const float *next_g, float *next_xg,
                        float *next_ss);
/* The qkv GEMV (M <= 2, as pd_cuda_gemv_fused_ok; head_dim even) with the rope_kv_write epilogue:
 * rows are taken in RoPE pairs, q goes to q_out, k and v to the cache slots. pre as above. */
void pd_cuda_gemv_rope_kv(cudaStream_t st, float *q_out, const float *x, const void *w,
                          pd_dtype wdt, const float *bias, int M, int K,
                          const pd_cuda_gemv_pre *pre, const int32_t *pos,
                          const float *inv_freq, const pd_kv_layer *kv, const pd_kv_shape *sh,
                          const int32_t *slots, int nq);

/* Quantized weights (cuda_quant.cu): PD_DTYPE_Q4, F8W and F8WA rows as pd/dtype.h lays them out.
 * pd_cuda_quant_ok: whether the kernels take the dtype at this K (Q4: a multiple of 32; FP8: of
 * 16). pd_cuda_qgemv: y[M,N] (+)= x[M,K] W^T + bias for 1 <= M <= PD_CUDA_QGEMV_MAX_M, x 16-byte
 * aligned f32 rows (F8WA: already through pd_cuda_fp8_qdq_rows). pd_cuda_dequant16: W as bf16
 * rows [N, K] at dst for a cuBLAS product. pd_cuda_fp8_qdq_rows: each row of x quantized to e4m3
 * with scale max|row| / 448 and back, into dst (the CPU backend's arithmetic). */
#define PD_CUDA_QGEMV_MAX_M 8
bool pd_cuda_quant_dtype(pd_dtype t);
bool pd_cuda_quant_ok(pd_dtype t, int K);
void pd_cuda_qgemv(cudaStream_t st, float *y, const float *x, const void *w, pd_dtype wdt,
                   const float *bias, int M, int N, int K, bool accumulate);
void pd_cuda_dequant16(cudaStream_t st, __nv_bfloat16 *dst, const void *w, pd_dtype wdt, int N,
                       int K);
void pd_cuda_fp8_qdq_rows(cudaStream_t st, float *dst, const float *x, int M, int K);
/* The tensor-core product of quantized W (Q4, F8W, F8WA) with bf16 rows x16 [M, K] (K a multiple
 * of 8, 16-byte aligned): y (+)= x16 W^T (* xs[m] where xs != NULL: F8WA's per-row activation
 * scales, x16 then holding the e4m3 values of x / xs from pd_cuda_fp8_quant16) + bias.
 * pd_cuda_qmma_splits: the blocks K is split over for this shape on n_sm SMs; with splits > 1,
 * ws holds splits * M * N floats of partial sums. */
int pd_cuda_qmma_splits(int M, int N, int K, int n_sm);
void pd_cuda_qmma(cudaStream_t st, float *y, float *ws, int splits, const __nv_bfloat16 *x16,
                  const float *xs, const void *w, pd_dtype wdt, const float *bias, int M, int N,
                  int K, bool accumulate);
void pd_cuda_fp8_quant16(cudaStream_t st, __nv_bfloat16 *dst, float *scales, const float *x,
                         int M, int K);

/* Attention. One call's arguments, resolved; workspaces belong to the backend. */
typedef struct pd_cuda_attn {
  float *out;
  const float *q;
  const void *k, *v;
  pd_dtype kv_dtype;
  int block_size, n_kv_heads, head_dim, n_q_heads, group;
  float scale;
  int window;
  const int32_t *q_start, *ctx_len, *block_tables;
  int max_blocks, n_seqs, n_tokens, max_ctx_len;
  /* split-K: n_splits > 1 writes unnormalised partials to part_o [n_splits, n_tokens, n_q_heads,
   * head_dim] and (max, sum) in the log2 domain to part_ml [n_splits, n_tokens, n_q_heads], then a
   * merge kernel writes out. split_len keys per split (a multiple of 64); for the decode kernel
   * split_len <= 0 means each sequence splits its own context into n_splits equal parts. */
  int n_splits, split_len;
  float *part_o;
  float2 *part_ml;
  int32_t *tile_start; /* prefill: [n_seqs + 1] scratch for the tile prefix sums */
  /* tensor-core decode only: the n_splits (2 .. pd_cuda_attn_decode_tc_max_cluster) splits of a
   * (sequence, KV head) run as one cluster and merge in shared memory: out written directly,
   * part_o / part_ml unused, no merge kernel */
  bool cluster;
  int bm; /* prefill: rows per tile, from pd_cuda_attn_prefill_bm (64 or 128) */
  /* non-NULL: the final output goes there in bf16 (rounded to nearest even) instead of to out:
   * the next GEMM's 16-bit operand */
  __nv_bfloat16 *out16;
  /* tensor-core decode: the tiles by tensor-map copies (pd_cuda_attn_decode_tma_ok), over a
   * cache of num_blocks pages */
  bool tma;
  int num_blocks;
  /* tensor-core decode, one block per (sequence, KV head) (n_splits 1, no cluster): non-NULL,
   * the query rows come from these qkv rows [n_tokens, (n_q_heads + 2 n_kv_heads) * head_dim]
   * with RoPE (rope_pos, rope_inv_freq) instead of from q, and each block first writes its KV
   * head's new K (with RoPE) and V rows to the cache at rope_slots (< 0: none), as
   * rope_kv_write does (the same bits) */
  const float *rope_qkv, *rope_inv_freq;
  const int32_t *rope_pos, *rope_slots;
} pd_cuda_attn;

/* The attention's final output element i (pairs: i even) to out, or to out16 when set. */
__device__ __forceinline__ void pd_attn_store(const pd_cuda_attn &a, size_t i, float v) {
  if (a.out16)
    a.out16[i] = __float2bfloat16_rn(v);
  else
    a.out[i] = v;
}
__device__ __forceinline__ void pd_attn_store2(const pd_cuda_attn &a, size_t i, float v0,
                                               float v1) {
  if (a.out16)
    *reinterpret_cast<__nv_bfloat162 *>(a.out16 + i) = __floats2bfloat162_rn(v0, v1);
  else
    *reinterpret_cast<float2 *>(a.out + i) = make_float2(v0, v1);
}

/* True when the tuned kernels cover this head dim (64, 80, 128). */
bool pd_cuda_attn_tuned_hd(int head_dim);
/* Decode (every sequence has exactly one new token): grid over (sequence, KV head, split). */
void pd_cuda_attn_decode(cudaStream_t st, const pd_cuda_attn *a);
/* The tensor-core decode kernel (cuda_attn_decode_tc.cu): 16-bit caches, group <= 16, tuned
 * head dims; grid over (sequence, KV head, split), all heads of a group in one block. */
bool pd_cuda_attn_decode_tc_ok(const pd_cuda_attn *a);
void pd_cuda_attn_decode_tc(cudaStream_t st, const pd_cuda_attn *a);
bool pd_cuda_attn_decode_tma_ok(const pd_cuda_attn *a, int cc_major);
/* The most splits a->cluster takes on this device (compute capability cc_major): 8 on Hopper
 * and later when such a cluster fits, else 1 (no cluster merge). */
int pd_cuda_attn_decode_tc_max_cluster(const pd_cuda_attn *a, int cc_major);
/* Heads one decode block handles (its query-head chunk) for this group size. */
int pd_cuda_attn_decode_heads(int group);
/* Prefill / mixed batches: tiles of BM (token, head) rows, BM = pd_cuda_attn_prefill_bm(...):
 * 128 for head dim 128 when the sequences bring 128 rows or more each on average and the
 * longest context is 2048 or more, else 64. */
int pd_cuda_attn_prefill_bm(int head_dim, int n_tokens, int n_seqs, int group, int max_ctx);
void pd_cuda_attn_prefill(cudaStream_t st, const pd_cuda_attn *a);
/* Any head dim (even, <= 256), any batch: one warp per (token, query head). Slow; correct. */
void pd_cuda_attn_generic(cudaStream_t st, const pd_cuda_attn *a);
/* Merges the n_splits partials into out. At most pd_cuda_attn_max_splits() splits. */
void pd_cuda_attn_merge(cudaStream_t st, const pd_cuda_attn *a);
int pd_cuda_attn_max_splits(void);

#endif
