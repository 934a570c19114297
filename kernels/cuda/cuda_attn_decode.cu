/* Paged attention without tensor cores: the split-K decode kernel, the merge of split partials
 * (shared with the prefill kernel) and a generic kernel for untuned head dims.
 *
 * Decode (one new token per sequence, the query at position ctx_len - 1). A block owns one
 * sequence, one KV head and a chunk of up to MAXG of its query heads (GQA: K and V are read once
 * for the whole group), and one split of the context, [lo + split * split_len, ...). It walks the
 * split in chunks of kChunk keys, in three phases separated by barriers:
 *   1. scores: 4 threads per key, each holding 16-byte pieces of the key row (several keys'
 *      pieces loaded before any is used), dot it with every query head of the chunk (q
 *      pre-scaled by scale * log2 e, staged in shared memory, each q piece read once for all
 *      those keys); the 4 partial dots are combined with two shuffles; scores land in shared
 *      memory;
 *   2. softmax: a warp per head takes the chunk maximum, rescales the running (max, sum) and turns
 *      the scores into probabilities in place;
 *   3. values: thread (key lane, 8-dim chunk) streams V rows, found through the row indices
 *      phase 1 left in shared memory (a warp reads whole rows; each thread keeps 4 to 16 rows'
 *      pieces in flight), and accumulates p * v for every head in registers, after rescaling
 *      them by the chunk's correction factor.
 * MAXG (1, 2, 4 or 8) is a template parameter so that the per-head accumulators are registers.
 * At the end the key lanes are summed through shared-memory atomics and the block writes either
 * the normalised output (one split) or the unnormalised partial and its (max, sum) in the log2
 * domain for the merge kernel. Everything is f32; K/V are converted as they are loaded. */
#include <math.h>

#include "cuda_internal.h"

namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 512; /* keys per shared-memory score chunk */

/* 8 cache elements as raw 16-byte words (1 for 16-bit types, 2 for f32), so that many loads can
 * be in flight in few registers; converted to floats only when used. */
template <typename KT> struct raw8 {
  static constexpr int n = sizeof(KT) == 4 ? 2 : 1;
  uint4 u[n];
  __device__ __forceinline__ void load(const KT *p) {
#pragma unroll
    for (int i = 0; i < n; i++) u[i] = __ldg(reinterpret_cast<const uint4 *>(p) + i);
  }
  __device__ __forceinline__ void to_f32(float f[8]) const {
    if constexpr (sizeof(KT) == 4) {
      f[0] = __uint_as_float(u[0].x); f[1] = __uint_as_float(u[0].y);
      f[2] = __uint_as_float(u[0].z); f[3] = __uint_as_float(u[0].w);
      f[4] = __uint_as_float(u[n - 1].x); f[5] = __uint_as_float(u[n - 1].y);
      f[6] = __uint_as_float(u[n - 1].z); f[7] = __uint_as_float(u[n - 1].w);
    } else {
      float2 t;
      t = pd_unpack2(u[0].x, (KT *)nullptr); f[0] = t.x; f[1] = t.y;
      t = pd_unpack2(u[0].y, (KT *)nullptr); f[2] = t.x; f[3] = t.y;
      t = pd_unpack2(u[0].z, (KT *)nullptr); f[4] = t.x; f[5] = t.y;
      t = pd_unpack2(u[0].w, (KT *)nullptr); f[6] = t.x; f[7] = t.y;
    }
  }
};

template <int HD, typename KT, int MAXG>
__global__ void __launch_bounds__(kThreads, MAXG <= 4 ? 3 : 2)
attn_decode_kernel(pd_cuda_attn a, int n_hchunks) {
  constexpr int C = HD / 8;                /* 8-element pieces per row */
  constexpr int TPK = 4;                   /* phase 1: threads per key */
  constexpr int CPT = (C + TPK - 1) / TPK; /* pieces per thread in phase 1 */
  constexpr int KPI = kThreads / TPK;      /* keys per phase-1 step */
  constexpr int RN = raw8<KT>::n;
  /* Keys in flight per thread: 32 to 48 registers of raw data in phase 1 (where q pieces and
   * per-head dots also live in registers), up to 64 in phase 3; sized so that nothing spills
   * under the launch bounds (3 blocks per SM, 2 for MAXG = 8). */
  constexpr int RAW1 = MAXG >= 4 ? 8 : 12; /* 16-byte words */
  constexpr int KU = RAW1 / (CPT * RN) > 0 ? RAW1 / (CPT * RN) : 1;
  constexpr int KL = kThreads / C; /* phase 3: keys in parallel */
  /* phase 3: rows per thread in flight, at most 128 keys per block step */
  constexpr int U3A = RN == 1 ? (MAXG >= 4 ? 12 : 16) : (MAXG >= 4 ? 4 : 6), U3B = 128 / KL;
  constexpr int U3 = U3A < U3B ? U3A : U3B;
  __shared__ __align__(16) float q_s[MAXG][HD];
  __shared__ __align__(16) float acc_s[MAXG][HD];
  __shared__ float sc[MAXG][kChunk];
  __shared__ int32_t roff[kChunk]; /* cache row (in head_dim units) of each key of the chunk */
  __shared__ float m_s[MAXG], l_s[MAXG], corr_s[MAXG];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int s = blockIdx.x, split = blockIdx.z;
  const int G = a.group, hc = blockIdx.y % n_hchunks, g = blockIdx.y / n_hchunks;
  const int h0 = hc * MAXG;
  const int Gc = G - h0 < MAXG ? G - h0 : MAXG;
  const int nq = a.n_q_heads, nkv = a.n_kv_heads, bs = a.block_size;
  const int qh0 = g * G + h0; /* first query head of this block */
  const int t = a.q_start[s];
  const int L = a.ctx_len[s];
  const int lo = a.window > 0 && L - a.window > 0 ? L - a.window : 0;
  /* split_len <= 0: every sequence cuts its own span into n_splits parts (multiples of 64 keys),
   * so that ragged contexts balance and the launch does not depend on the longest one. */
  long long sl = a.split_len;
  if (sl <= 0) {
    sl = ((long long)(L - lo) + a.n_splits - 1) / a.n_splits;
    sl = sl < 64 ? 64 : (sl + 63) / 64 * 64;
  }
  const long long kb_l = (long long)lo + (long long)split * sl;
  const int kbeg = kb_l < L ? (int)kb_l : L;
  const int kend = kb_l + sl < L ? (int)(kb_l + sl) : L;
  const KT *kc = static_cast<const KT *>(a.k), *vc = static_cast<const KT *>(a.v);
  const int32_t *bt = a.block_tables + (size_t)s * a.max_blocks;

  if (kbeg >= kend) { /* an empty split: only exists when n_splits > 1 */
    if (tid < Gc)
      a.part_ml[((size_t)split * a.n_tokens + t) * nq + qh0 + tid] = make_float2(-INFINITY, 0.0f);
    return;
  }

  const float qscale = a.scale * PD_LOG2E;
  for (int i = tid; i < MAXG * HD; i += kThreads) {
    int h = i / HD, d = i - h * HD;
    q_s[h][d] = h < Gc ? a.q[((size_t)t * nq + qh0 + h) * HD + d] * qscale : 0.0f;
    acc_s[h][d] = 0.0f;
  }
  if (tid < MAXG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  __syncthreads();

  const int kg = tid / TPK, lt = tid % TPK;  /* phase 1 roles */
  const int kl = tid / C, cc = tid - kl * C; /* phase 3 roles */
  const bool p3 = kl < KL;
  float acc[MAXG][8];
#pragma unroll
  for (int h = 0; h < MAXG; h++)
#pragma unroll
    for (int e = 0; e < 8; e++) acc[h][e] = 0.0f;

  for (int cb = kbeg; cb < kend; cb += kChunk) {
    const int n = kend - cb < kChunk ? kend - cb : kChunk;
    /* ---- phase 1: scores. Loop bounds are uniform across the block (shuffles need whole
     * warps); KU keys per thread are loaded before any is used. */
    for (int j0 = 0; j0 < n; j0 += KU * KPI) {
      raw8<KT> kr[KU][CPT];
#pragma unroll
      for (int u = 0; u < KU; u++) {
        const int j = j0 + u * KPI + kg;
        if (j < n) {
          const int kp = cb + j;
          const int row = (bt[kp / bs] * nkv + g) * bs + kp % bs;
          if (lt == 0) roff[j] = row;
          const KT *p = kc + (size_t)row * HD;
#pragma unroll
          for (int ci = 0; ci < CPT; ci++) {
            const int c = lt + ci * TPK;
            if (c < C) kr[u][ci].load(p + c * 8);
          }
        }
      }
      float d[KU][MAXG];
#pragma unroll
      for (int u = 0; u < KU; u++)
#pragma unroll
        for (int h = 0; h < MAXG; h++) d[u][h] = 0.0f;
#pragma unroll
      for (int ci = 0; ci < CPT; ci++) {
        const int c = lt + ci * TPK;
        if (c < C) {
          /* this piece of q for every head, reused for all KU keys */
          float4 qa[MAXG], qb[MAXG];
#pragma unroll
          for (int h = 0; h < MAXG; h++) {
            qa[h] = *reinterpret_cast<const float4 *>(&q_s[h][c * 8]);
            qb[h] = *reinterpret_cast<const float4 *>(&q_s[h][c * 8 + 4]);
          }
#pragma unroll
          for (int u = 0; u < KU; u++) {
            float kf[8];
            kr[u][ci].to_f32(kf);
#pragma unroll
            for (int h = 0; h < MAXG; h++) {
              float x = d[u][h];
              x = fmaf(qa[h].x, kf[0], x); x = fmaf(qa[h].y, kf[1], x);
              x = fmaf(qa[h].z, kf[2], x); x = fmaf(qa[h].w, kf[3], x);
              x = fmaf(qb[h].x, kf[4], x); x = fmaf(qb[h].y, kf[5], x);
              x = fmaf(qb[h].z, kf[6], x); x = fmaf(qb[h].w, kf[7], x);
              d[u][h] = x;
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < KU; u++) {
        const int j = j0 + u * KPI + kg;
#pragma unroll
        for (int h = 0; h < MAXG; h++) {
          float x = d[u][h];
          x += __shfl_xor_sync(0xffffffffu, x, 1);
          x += __shfl_xor_sync(0xffffffffu, x, 2);
          if (lt == 0 && j < n && h < Gc) sc[h][j] = x;
        }
      }
    }
    __syncthreads();
    /* ---- phase 2: chunk softmax, running max / sum */
    for (int h = warp; h < Gc; h += kThreads / 32) {
      float mx = -INFINITY;
      for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sc[h][j]);
      mx = pd_warp_max(mx);
      const float m_old = m_s[h], m_new = fmaxf(m_old, mx); /* finite: n >= 1 */
      float sum = 0.0f;
      for (int j = lane; j < n; j += 32) {
        float p = exp2f(sc[h][j] - m_new);
        sc[h][j] = p;
        sum += p;
      }
      sum = pd_warp_sum(sum);
      __syncwarp(); /* every lane has read m_s[h] before lane 0 rewrites it */
      if (lane == 0) {
        const float corr = exp2f(m_old - m_new); /* 0 on the first chunk */
        l_s[h] = l_s[h] * corr + sum;
        m_s[h] = m_new;
        corr_s[h] = corr;
      }
    }
    __syncthreads();
    /* ---- phase 3: p * V, U3 rows per thread in flight */
    if (p3) {
#pragma unroll
      for (int h = 0; h < MAXG; h++) {
        const float corr = h < Gc ? corr_s[h] : 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[h][e] *= corr;
      }
      for (int j0 = kl; j0 < n; j0 += U3 * KL) {
        raw8<KT> vr[U3];
#pragma unroll
        for (int u = 0; u < U3; u++) {
          const int j = j0 + u * KL;
          if (j < n) vr[u].load(vc + (size_t)roff[j] * HD + cc * 8);
        }
#pragma unroll
        for (int u = 0; u < U3; u++) {
          const int j = j0 + u * KL;
          if (j < n) {
            float vf[8];
            vr[u].to_f32(vf);
#pragma unroll
            for (int h = 0; h < MAXG; h++) {
              const float p = h < Gc ? sc[h][j] : 0.0f;
#pragma unroll
              for (int e = 0; e < 8; e++) acc[h][e] = fmaf(p, vf[e], acc[h][e]);
            }
          }
        }
      }
    }
    __syncthreads(); /* sc is rewritten by the next chunk */
  }

  if (p3) {
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
      if (h < Gc) {
#pragma unroll
        for (int e = 0; e < 8; e++) atomicAdd(&acc_s[h][cc * 8 + e], acc[h][e]);
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < Gc * HD; i += kThreads) {
    const int h = i / HD, d = i - h * HD;
    if (a.n_splits == 1)
      pd_attn_store(a, ((size_t)t * nq + qh0 + h) * HD + d, acc_s[h][d] / l_s[h]);
    else
      a.part_o[(((size_t)split * a.n_tokens + t) * nq + qh0 + h) * HD + d] = acc_s[h][d];
  }
  if (a.n_splits > 1 && tid < Gc)
    a.part_ml[((size_t)split * a.n_tokens + t) * nq + qh0 + tid] = make_float2(m_s[tid], l_s[tid]);
}

/* out[row] = sum_i 2^(m_i - M) o_i / sum_i 2^(m_i - M) l_i over the splits that saw a key. */
constexpr int kMaxMergeSplits = 1024;
__global__ void merge_kernel(float *__restrict__ out, __nv_bfloat16 *__restrict__ out16,
                             const float *__restrict__ po,
                             const float2 *__restrict__ pml, int n_splits, size_t n_rows,
                             int hd) {
  __shared__ float wgt[kMaxMergeSplits];
  __shared__ float inv_den;
  const size_t row = blockIdx.x;
  if (threadIdx.x < 32) {
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n_splits; i += 32) mx = fmaxf(mx, pml[i * n_rows + row].x);
    mx = pd_warp_max(mx);
    float den = 0.0f;
    for (int i = threadIdx.x; i < n_splits; i += 32) {
      float2 ml = pml[i * n_rows + row];
      float w = ml.x == -INFINITY ? 0.0f : exp2f(ml.x - mx);
      wgt[i] = w;
      den += w * ml.y;
    }
    den = pd_warp_sum(den);
    if (threadIdx.x == 0) inv_den = 1.0f / den;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < n_splits; i++)
      if (wgt[i] != 0.0f) acc += wgt[i] * po[(i * n_rows + row) * hd + d];
    if (out16)
      out16[row * hd + d] = __float2bfloat16_rn(acc * inv_den);
    else
      out[row * hd + d] = acc * inv_den;
  }
}

/* Generic: one warp per (token, query head), keys one at a time with an online softmax; lane l
 * holds dims l, l + 32, ... (head_dim <= 256). */
template <typename KT>
__global__ void __launch_bounds__(128) attn_generic_kernel(pd_cuda_attn a) {
  constexpr int DPL = 8;
  const int lane = threadIdx.x & 31;
  const long long wi = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
  const int nq = a.n_q_heads, HD = a.head_dim, bs = a.block_size, nkv = a.n_kv_heads;
  if (wi >= (long long)a.n_tokens * nq) return;
  const int t = (int)(wi / nq), h = (int)(wi % nq), g = h / a.group;
  int lo_s = 0, hi_s = a.n_seqs - 1;
  while (lo_s < hi_s) {
    int mid = (lo_s + hi_s + 1) / 2;
    if (a.q_start[mid] <= t)
      lo_s = mid;
    else
      hi_s = mid - 1;
  }
  const int s = lo_s;
  const int n_new = a.q_start[s + 1] - a.q_start[s], L = a.ctx_len[s];
  const int pos = L - n_new + (t - a.q_start[s]);
  const int lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  const KT *kc = static_cast<const KT *>(a.k), *vc = static_cast<const KT *>(a.v);
  const int32_t *bt = a.block_tables + (size_t)s * a.max_blocks;
  const float qscale = a.scale * PD_LOG2E;
  float qv[DPL], acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; i++) {
    int d = lane + 32 * i;
    qv[i] = d < HD ? a.q[((size_t)t * nq + h) * HD + d] * qscale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int kp = lo; kp <= pos; kp++) {
    size_t off = (((size_t)bt[kp / bs] * nkv + g) * bs + kp % bs) * HD;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      int d = lane + 32 * i;
      if (d < HD) dot = fmaf(qv[i], pd_to_f32(kc[off + d]), dot);
    }
    dot = pd_warp_sum(dot);
    const float mn = fmaxf(m, dot), corr = exp2f(m - mn), p = exp2f(dot - mn);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < HD ? p * pd_to_f32(vc[off + d]) : 0.0f);
    }
    m = mn;
  }
#pragma unroll
  for (int i = 0; i < DPL; i++) {
    int d = lane + 32 * i;
    if (d < HD) pd_attn_store(a, ((size_t)t * nq + h) * HD + d, acc[i] / l);
  }
}

template <int HD, typename KT>
void decode_hd_kt(cudaStream_t st, const pd_cuda_attn *a) {
  const int maxg = pd_cuda_attn_decode_heads(a->group);
  const int n_hchunks = (a->group + maxg - 1) / maxg;
  dim3 grid((unsigned)a->n_seqs, (unsigned)(a->n_kv_heads * n_hchunks), (unsigned)a->n_splits);
  if (maxg == 1)
    attn_decode_kernel<HD, KT, 1><<<grid, kThreads, 0, st>>>(*a, n_hchunks);
  else if (maxg == 2)
    attn_decode_kernel<HD, KT, 2><<<grid, kThreads, 0, st>>>(*a, n_hchunks);
  else if (maxg == 4)
    attn_decode_kernel<HD, KT, 4><<<grid, kThreads, 0, st>>>(*a, n_hchunks);
  else
    attn_decode_kernel<HD, KT, 8><<<grid, kThreads, 0, st>>>(*a, n_hchunks);
}

template <typename KT> void decode_kt(cudaStream_t st, const pd_cuda_attn *a) {
  switch (a->head_dim) {
  case 64: decode_hd_kt<64, KT>(st, a); break;
  case 80: decode_hd_kt<80, KT>(st, a); break;
  default: decode_hd_kt<128, KT>(st, a); break;
  }
}

} // namespace

bool pd_cuda_attn_tuned_hd(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 128;
}

int pd_cuda_attn_decode_heads(int group) { return group <= 2 ? group : group <= 4 ? 4 : 8; }

void pd_cuda_attn_decode(cudaStream_t st, const pd_cuda_attn *a) {
  if (a->kv_dtype == PD_DTYPE_BF16)
    decode_kt<__nv_bfloat16>(st, a);
  else if (a->kv_dtype == PD_DTYPE_F16)
    decode_kt<__half>(st, a);
  else
    decode_kt<float>(st, a);
}

void pd_cuda_attn_merge(cudaStream_t st, const pd_cuda_attn *a) {
  size_t rows = (size_t)a->n_tokens * a->n_q_heads;
  int threads = a->head_dim <= 64 ? 64 : 128;
  merge_kernel<<<(unsigned)rows, threads, 0, st>>>(a->out, a->out16, a->part_o, a->part_ml, a->n_splits,
                                                   rows, a->head_dim);
}

int pd_cuda_attn_max_splits(void) { return kMaxMergeSplits; }

void pd_cuda_attn_generic(cudaStream_t st, const pd_cuda_attn *a) {
  long long warps = (long long)a->n_tokens * a->n_q_heads;
  unsigned blocks = (unsigned)((warps + 3) / 4);
  if (a->kv_dtype == PD_DTYPE_BF16)
    attn_generic_kernel<__nv_bfloat16><<<blocks, 128, 0, st>>>(*a);
  else if (a->kv_dtype == PD_DTYPE_F16)
    attn_generic_kernel<__half><<<blocks, 128, 0, st>>>(*a);
  else
    attn_generic_kernel<float><<<blocks, 128, 0, st>>>(*a);
}
