/* Paged causal attention for prefill and mixed batches, FlashAttention-2 style on bf16 tensor
 * cores (mma.sync m16n8k16, f32 accumulate).
 *
 * Work unit: one tile of BM rows of one sequence and one KV head, a row being a (new token,
 * query head of the group) pair, pair p = token * group + head: GQA heads share the K/V tiles
 * that way. Tiles are numbered over the batch by a prefix sum of ceil(n_new * group / BM) (a
 * one-block scan kernel), and each block finds its sequence by binary search, so the host needs
 * no per-sequence metadata. grid = (tile bound, KV heads, splits).
 *
 * BM = 64 (4 warps) or, for head dim 128 and batches of long chunks, 128 (8 warps: every K/V
 * tile staged serves twice the rows). Per block, warps of 16 rows: Q is staged through shared memory into bf16 A fragments held in
 * registers; then for each tile of BN = 64 keys in the row range's causal / sliding-window span
 * (and in this block's split of it), K and V rows are fetched through the block table into
 * shared memory (bf16 caches: cp.async 16-byte copies, double-buffered so that the next tile is
 * in flight while this one is computed; f16 / f32 caches: 16-byte loads converted to bf16), S = Q K^T runs on the tensor
 * cores, the mask and an online softmax (log2 domain) are applied in registers, P is repacked
 * in registers as the A operand of O += P V, V's B fragments coming from ldmatrix.trans.
 * Finally O / l is written (one split) or O and (m, l) go to the split partials. */
#include <cub/block/block_scan.cuh>
#include <math.h>

#include "cuda_mma.h"

namespace {

constexpr int BN = 64;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return pd_tc<__nv_bfloat16>::pack(lo, hi);
}

/* Shared memory of the prefill kernel: K and V tiles of BN rows (stride HD + 8), two stages
 * (double-buffered cp.async) for bf16 caches, which are copied as they are, one stage for the
 * others, which are converted on the way in. */
template <int HD, typename KT> struct pf_smem {
  static constexpr int LD = HD + 8;
  static constexpr int STAGE = 2 * BN * LD; /* elements: K then V */
  static constexpr bool ASYNC = sizeof(KT) == 2 && !__is_same(KT, __half);
  static constexpr int STAGES = ASYNC ? 2 : 1;
  static constexpr size_t BYTES = (size_t)STAGES * STAGE * 2;
};

/* 16 bytes of cache row -> bf16 in shared memory. f32: 4 elements (8 bytes out); 16-bit types: 8
 * elements (16 bytes out). */
__device__ __forceinline__ void stage16(__nv_bfloat16 *dst, const float *src) {
  float4 v = __ldg(reinterpret_cast<const float4 *>(src));
  uint2 o = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  *reinterpret_cast<uint2 *>(dst) = o;
}
__device__ __forceinline__ void stage16(__nv_bfloat16 *dst, const __half *src) {
  float f[8];
  pd_load8(src, f);
  uint4 o = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]),
                       pack_bf16(f[6], f[7]));
  *reinterpret_cast<uint4 *>(dst) = o;
}
__device__ __forceinline__ void zero16(__nv_bfloat16 *dst, int bytes_out) {
  if (bytes_out == 8)
    *reinterpret_cast<uint2 *>(dst) = make_uint2(0, 0);
  else
    *reinterpret_cast<uint4 *>(dst) = make_uint4(0, 0, 0, 0);
}

/* tile_start[s] = sum over s' < s of ceil(n_new(s') * group / BM); tile_start[n_seqs] = total. */
__global__ void __launch_bounds__(1024)
tile_scan_kernel(int32_t *tile_start, const int32_t *__restrict__ q_start, int n_seqs, int group,
                 int BM) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n_seqs; base += 1024) {
    const int i = base + threadIdx.x;
    const int v = i < n_seqs ? ((q_start[i + 1] - q_start[i]) * group + BM - 1) / BM : 0;
    int excl, agg;
    Scan(tmp).ExclusiveSum(v, excl, agg);
    if (i < n_seqs) tile_start[i] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += agg;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_start[n_seqs] = carry;
}

/* Registers budgeted for 8 warps per SM (up to 255 each; 234 used at head dim 128). Budgeting
 * for 12 (168, which spills a little at head dim 128) measured 1-6% slower on the H200. */
template <int HD, typename KT, int BM>
__global__ void __launch_bounds__(BM * 2, 128 / BM) attn_prefill_kernel(pd_cuda_attn a) {
  constexpr int kThreads = BM * 2; /* a warp per 16 rows */
  constexpr int KS = HD / 16; /* k-steps of Q K^T */
  constexpr int NT = BN / 8;  /* 8-key column tiles of S */
  constexpr int DT = HD / 8;  /* 8-dim column tiles of O */
  constexpr int LD = HD + 8;  /* smem row stride (bf16): conflict-free fragment loads */
  constexpr int EPC = 16 / (int)sizeof(KT); /* cache elements per 16-byte load */
  constexpr int CPR = HD / EPC;             /* 16-byte loads per cache row */
  static_assert(HD % 16 == 0 && DT % 2 == 0, "head dim must be a multiple of 16");
  using SM = pf_smem<HD, KT>;
  extern __shared__ __align__(16) unsigned char pf_dyn[];
  __nv_bfloat16 *const tiles = reinterpret_cast<__nv_bfloat16 *>(pf_dyn);
  __nv_bfloat16 *sK = tiles, *sV = tiles + BN * LD; /* stage 0; sK also stages Q */
  /* element offset of each key's row in the cache (-1: none), for two tiles: bf16 caches look
   * them up two tiles ahead, so that issuing a tile's copies is only address arithmetic */
  __shared__ long long sRow[2][BN];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, lg = lane >> 2, lt = lane & 3;
  const int bx = blockIdx.x;
  if (bx >= a.tile_start[a.n_seqs]) return;
  int s = 0, hi_s = a.n_seqs - 1;
  while (s < hi_s) {
    int mid = (s + hi_s + 1) / 2;
    if (a.tile_start[mid] <= bx)
      s = mid;
    else
      hi_s = mid - 1;
  }
  const int tile = bx - a.tile_start[s];
  const int g = blockIdx.y, split = blockIdx.z, G = a.group;
  const int nq = a.n_q_heads, nkv = a.n_kv_heads, bs = a.block_size;
  const int qs = a.q_start[s], n_new = a.q_start[s + 1] - qs, L = a.ctx_len[s];
  const int pairs = n_new * G, p0 = tile * BM;
  const int p_last = (p0 + BM < pairs ? p0 + BM : pairs) - 1;
  const int base = L - n_new; /* position of the sequence's first new token */
  const int pmin = base + p0 / G, pmax = base + p_last / G;
  const int klo = a.window > 0 && pmin - a.window + 1 > 0 ? pmin - a.window + 1 : 0;
  const int khi = pmax + 1;
  const long long kb_l = (long long)klo + (long long)split * a.split_len;
  const int kb = kb_l < khi ? (int)kb_l : khi;
  const int ke = kb_l + a.split_len < khi ? (int)(kb_l + a.split_len) : khi;

  /* This thread's two rows (C-fragment rows lg and lg + 8 of its warp's 16). */
  const int rA = warp * 16 + lg, rB = rA + 8;
  const int pA = p0 + rA, pB = p0 + rB;
  const bool vA = pA < pairs, vB = pB < pairs;
  const int posA = base + (vA ? pA : p_last) / G, posB = base + (vB ? pB : p_last) / G;
  const size_t rowA = vA ? (size_t)(qs + pA / G) * nq + g * G + pA % G : 0;
  const size_t rowB = vB ? (size_t)(qs + pB / G) * nq + g * G + pB % G : 0;

  if (kb >= ke) { /* empty split (n_splits > 1 only) */
    if (lt == 0) {
      if (vA) a.part_ml[(size_t)split * a.n_tokens * nq + rowA] = make_float2(-INFINITY, 0.0f);
      if (vB) a.part_ml[(size_t)split * a.n_tokens * nq + rowB] = make_float2(-INFINITY, 0.0f);
    }
    return;
  }

  /* ---- Q -> bf16 A fragments (staged through sK) */
  for (int i = tid; i < BM * (HD / 4); i += kThreads) {
    const int r = i / (HD / 4), c4 = i - r * (HD / 4), p = p0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p < pairs)
      v = __ldg(reinterpret_cast<const float4 *>(
                    a.q + ((size_t)(qs + p / G) * nq + g * G + p % G) * HD) + c4);
    *reinterpret_cast<uint2 *>(&sK[r * LD + c4 * 4]) =
        make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
  __syncthreads();
  uint32_t qa[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    qa[ks][0] = pd_lds32(&sK[rA * LD + ks * 16 + lt * 2]);
    qa[ks][1] = pd_lds32(&sK[rB * LD + ks * 16 + lt * 2]);
    qa[ks][2] = pd_lds32(&sK[rA * LD + ks * 16 + lt * 2 + 8]);
    qa[ks][3] = pd_lds32(&sK[rB * LD + ks * 16 + lt * 2 + 8]);
  }
  __syncthreads();

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;
  const float sl2 = a.scale * PD_LOG2E;
  const KT *kc = static_cast<const KT *>(a.k), *vc = static_cast<const KT *>(a.v);
  const int32_t *bt = a.block_tables + (size_t)s * a.max_blocks;
  const int win = a.window;

  /* the cache offset of row tid of the tile at kt0 (threads < BN), -1 past the end */
  auto row_off = [&](int kt0) -> long long {
    const int kp = kt0 + tid;
    return kp < ke ? (((long long)bt[kp / bs] * nkv + g) * bs + kp % bs) * HD : -1LL;
  };
  auto rows = [&](int kt0, int buf) {
    if (tid < BN) sRow[buf][tid] = row_off(kt0);
  };
  /* bf16 caches: tile i + 1's copies are in flight while tile i is computed */
  static_assert(BN * CPR % kThreads == 0, "copies per thread");
  auto issue = [&](int stage) {
    __nv_bfloat16 *dk0 = tiles + stage * SM::STAGE, *dv0 = dk0 + BN * LD;
#pragma unroll
    for (int k = 0; k < BN * CPR / kThreads; k++) {
      const int i = tid + k * kThreads, r = i / CPR, c = i - r * CPR;
      const long long ro = sRow[stage][r];
      const size_t off = ro >= 0 ? (size_t)ro + (size_t)c * EPC : 0;
      pd_cp_async16(&dk0[r * LD + c * EPC], kc + off, ro >= 0 ? 16 : 0);
      pd_cp_async16(&dv0[r * LD + c * EPC], vc + off, ro >= 0 ? 16 : 0);
    }
    pd_cp_async_commit();
  };
  if constexpr (SM::ASYNC) {
    rows(kb, 0);
    if (kb + BN < ke) rows(kb + BN, 1);
    __syncthreads();
    issue(0);
  }
  int it = 0;
  for (int kt = kb; kt < ke; kt += BN, it++) {
    /* bf16: tile it + 2's offsets, looked up now and stored into tile it's buffer at the end of
     * this iteration (after the barrier below, which every read of that buffer for tile it's
     * copies precedes; before the end barrier, which the reads for tile it + 2 follow) */
    const bool refill = SM::ASYNC && kt + 2 * BN < ke && tid < BN;
    const long long next_row = refill ? row_off(kt + 2 * BN) : -1LL;
    if constexpr (SM::ASYNC) {
      if (kt + BN < ke) {
        issue((it + 1) & 1);
        pd_cp_async_wait<1>();
      } else {
        pd_cp_async_wait<0>();
      }
      __syncthreads();
      sK = tiles + (it & 1) * SM::STAGE;
      sV = sK + BN * LD;
    } else {
      rows(kt, 0);
      __syncthreads();
      for (int i = tid; i < BN * CPR; i += kThreads) {
        const int r = i / CPR, c = i - r * CPR;
        const long long off = sRow[0][r];
        __nv_bfloat16 *dk = &sK[r * LD + c * EPC], *dv = &sV[r * LD + c * EPC];
        if (off >= 0) {
          stage16(dk, kc + off + c * EPC);
          stage16(dv, vc + off + c * EPC);
        } else {
          zero16(dk, EPC * 2);
          zero16(dv, EPC * 2);
        }
      }
      __syncthreads();
    }

    /* S = Q K^T for this warp's 16 rows x BN keys; K's B fragments by ldmatrix, two k-steps
     * per instruction */
    float sa[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      sa[nt][0] = sa[nt][1] = sa[nt][2] = sa[nt][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks + 1 < KS; ks += 2) {
        uint32_t kb4[4];
        pd_ldmatrix_x4(kb4, &sK[(nt * 8 + (lane & 7)) * LD + ks * 16 + (lane >> 3) * 8]);
        pd_tc<__nv_bfloat16>::mma(sa[nt], qa[ks], kb4[0], kb4[1]);
        pd_tc<__nv_bfloat16>::mma(sa[nt], qa[ks + 1], kb4[2], kb4[3]);
      }
      if constexpr (KS % 2 == 1) {
        const __nv_bfloat16 *kr = &sK[(nt * 8 + lg) * LD + (KS - 1) * 16 + lt * 2];
        pd_tc<__nv_bfloat16>::mma(sa[nt], qa[KS - 1], pd_lds32(kr), pd_lds32(kr + 8));
      }
    }
    /* mask (only tiles that reach past the end, the diagonal or the window's edge), row maxima
     * (a row lives in the 4 lanes of a quad); scores stay unscaled until the exponential */
    const bool need_mask =
        kt + BN > ke || kt + BN - 1 > pmin || (win > 0 && kt <= pmax - win);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int kp = kt + nt * 8 + lt * 2 + e;
          const bool okA = kp < ke && kp <= posA && (win <= 0 || kp > posA - win);
          const bool okB = kp < ke && kp <= posB && (win <= 0 || kp > posB - win);
          if (!okA) sa[nt][e] = -INFINITY;
          if (!okB) sa[nt][2 + e] = -INFINITY;
        }
      }
    }
    float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      mxA = fmaxf(mxA, fmaxf(sa[nt][0], sa[nt][1]));
      mxB = fmaxf(mxB, fmaxf(sa[nt][2], sa[nt][3]));
    }
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
    /* running maxima in log2 units (the scale is positive: max then scale = scale then max) */
    const float mnA = fmaxf(mA, mxA * sl2), mnB = fmaxf(mB, mxB * sl2);
    /* a row with no key yet keeps max -inf: use 0 as the offset so exp2 gives 0, not NaN */
    const float muA = mnA == -INFINITY ? 0.0f : mnA, muB = mnB == -INFINITY ? 0.0f : mnB;
    const float corrA = pd_ex2(mA - muA), corrB = pd_ex2(mB - muB);
    mA = mnA;
    mB = mnB;
    float sumA = 0.0f, sumB = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      sa[nt][0] = pd_ex2(fmaf(sa[nt][0], sl2, -muA));
      sa[nt][1] = pd_ex2(fmaf(sa[nt][1], sl2, -muA));
      sa[nt][2] = pd_ex2(fmaf(sa[nt][2], sl2, -muB));
      sa[nt][3] = pd_ex2(fmaf(sa[nt][3], sl2, -muB));
      sumA += sa[nt][0] + sa[nt][1];
      sumB += sa[nt][2] + sa[nt][3];
    }
    lA = lA * corrA + sumA; /* per-thread partial sums; the quad is summed at the end */
    lB = lB * corrB + sumB;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      o[dt][0] *= corrA;
      o[dt][1] *= corrA;
      o[dt][2] *= corrB;
      o[dt][3] *= corrB;
    }
    /* O += P V: P's C fragments are the A fragments of the next product */
#pragma unroll
    for (int j = 0; j < BN / 16; j++) {
      uint32_t pa[4];
      pa[0] = pack_bf16(sa[2 * j][0], sa[2 * j][1]);
      pa[1] = pack_bf16(sa[2 * j][2], sa[2 * j][3]);
      pa[2] = pack_bf16(sa[2 * j + 1][0], sa[2 * j + 1][1]);
      pa[3] = pack_bf16(sa[2 * j + 1][2], sa[2 * j + 1][3]);
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        uint32_t vb[4];
        pd_ldmatrix_x4_trans(vb, &sV[(j * 16 + (lane & 15)) * LD + dt * 8 + (lane >> 4) * 8]);
        pd_tc<__nv_bfloat16>::mma(o[dt], pa, vb[0], vb[1]);
        pd_tc<__nv_bfloat16>::mma(o[dt + 1], pa, vb[2], vb[3]);
      }
    }
    if (refill) sRow[it & 1][tid] = next_row;
    __syncthreads(); /* sK / sV / sRow are refilled next */
  }

  lA += __shfl_xor_sync(0xffffffffu, lA, 1);
  lA += __shfl_xor_sync(0xffffffffu, lA, 2);
  lB += __shfl_xor_sync(0xffffffffu, lB, 1);
  lB += __shfl_xor_sync(0xffffffffu, lB, 2);
  if (a.n_splits == 1) {
    const float iA = vA ? 1.0f / lA : 0.0f, iB = vB ? 1.0f / lB : 0.0f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      const int d = dt * 8 + lt * 2;
      if (vA) pd_attn_store2(a, rowA * HD + d, o[dt][0] * iA, o[dt][1] * iA);
      if (vB) pd_attn_store2(a, rowB * HD + d, o[dt][2] * iB, o[dt][3] * iB);
    }
  } else {
    const size_t sb = (size_t)split * a.n_tokens * nq;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      const int d = dt * 8 + lt * 2;
      if (vA)
        *reinterpret_cast<float2 *>(a.part_o + (sb + rowA) * HD + d) =
            make_float2(o[dt][0], o[dt][1]);
      if (vB)
        *reinterpret_cast<float2 *>(a.part_o + (sb + rowB) * HD + d) =
            make_float2(o[dt][2], o[dt][3]);
    }
    if (lt == 0) {
      if (vA) a.part_ml[sb + rowA] = make_float2(mA, lA);
      if (vB) a.part_ml[sb + rowB] = make_float2(mB, lB);
    }
  }
}

template <int HD, typename KT, int BM>
void prefill_launch(cudaStream_t st, const pd_cuda_attn *a, dim3 grid) {
  const size_t smem = pf_smem<HD, KT>::BYTES;
  static_assert(BM * (HD + 8) <= 2 * BN * (HD + 8), "Q is staged in one K/V stage");
  if (smem > 48 * 1024) pd_cuda_smem_optin((const void *)attn_prefill_kernel<HD, KT, BM>, smem);
  attn_prefill_kernel<HD, KT, BM><<<grid, BM * 2, smem, st>>>(*a);
}

template <int HD, int BM>
void prefill_hd(cudaStream_t st, const pd_cuda_attn *a, dim3 grid) {
  if (a->kv_dtype == PD_DTYPE_BF16)
    prefill_launch<HD, __nv_bfloat16, BM>(st, a, grid);
  else if (a->kv_dtype == PD_DTYPE_F16)
    prefill_launch<HD, __half, BM>(st, a, grid);
  else
    prefill_launch<HD, float, BM>(st, a, grid);
}

} // namespace

int pd_cuda_attn_prefill_bm(int head_dim, int n_tokens, int n_seqs, int group, int max_ctx) {
  if (head_dim != 128) return 64;
  /* 128-row tiles waste more rows at the ends of short chunks (speculative verification, mixed
   * decode rows) and on the causal diagonal: taken when the sequences bring 128 rows or more
   * each on average over contexts of 2048 or more (H200, 32/8 heads, bf16 cache: 2048 new
   * tokens over 8192 223 -> 231 TFLOP/s, 4 x 512 over 4096 218 -> 228, but 4 x 1024 over 1024
   * 135 -> 128) */
  return (long long)n_tokens * group >= 128LL * n_seqs && max_ctx >= 2048 ? 128 : 64;
}

void pd_cuda_attn_prefill(cudaStream_t st, const pd_cuda_attn *a) {
  const int bm = a->bm == 128 && a->head_dim == 128 ? 128 : 64;
  tile_scan_kernel<<<1, 1024, 0, st>>>(a->tile_start, a->q_start, a->n_seqs, a->group, bm);
  /* sum_s ceil(n_s * group / BM) <= n_tokens * group / BM + n_seqs */
  const long long bound = (long long)a->n_tokens * a->group / bm + a->n_seqs + 1;
  dim3 grid((unsigned)bound, (unsigned)a->n_kv_heads, (unsigned)a->n_splits);
  switch (a->head_dim) {
  case 64: prefill_hd<64, 64>(st, a, grid); break;
  case 80: prefill_hd<80, 64>(st, a, grid); break;
  default:
    if (bm == 128)
      prefill_hd<128, 128>(st, a, grid);
    else
      prefill_hd<128, 64>(st, a, grid);
    break;
  }
}
