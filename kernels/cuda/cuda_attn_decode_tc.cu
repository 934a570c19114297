/* Paged decode attention on tensor cores for 16-bit KV caches (bf16 / f16): one new token per
 * sequence, grouped-query aware.
 *
 * A block owns one sequence, one KV head and one split of its context, and computes all G query
 * heads of the group at once (G <= 16: the rows of one m16n8k16 tile, padded with zero rows).
 * The context is walked in tiles of 64 keys, double-buffered in shared memory with cp.async
 * (16-byte copies straight from the cache pages found through the block table, so a tile's
 * loads are all in flight before any is waited for). Each of the 4 warps takes 16 keys of a tile:
 * S = Q K^T (K's B fragments read from shared memory), an online softmax in the log2 domain in
 * registers, then O += P V with P repacked in registers as the A operand and V's B fragments from
 * ldmatrix.trans. The 4 warps' (m, l, O) are merged through shared memory at the end; the block
 * writes the normalised output (one split) or the unnormalised partial and (m, l) for the merge
 * kernel, in the same convention as the SIMT decode kernel (cuda_attn_decode.cu).
 *
 * CL (Hopper, at most kMaxCluster splits): the splits of one (sequence, KV head) run as one
 * thread-block cluster and merge through distributed shared memory instead of the partial
 * workspace and the merge kernel: each block leaves its (m, l, O) in its own shared memory, and
 * after a cluster barrier block k merges every k-th output element from all the blocks' copies.
 * That saves a kernel and a round trip through global memory per layer, which is what a short
 * decode attention (batch 1, a few hundred keys, a few microseconds) is made of.
 *
 * TMA (Hopper): the tiles come by tensor-map copies that a few lanes of warp 0 issue, a 64-key
 * tile in 2 to 32 boxes (tma_geom), instead of 16 cp.async a thread with their address
 * arithmetic. The kernel then runs a third of the instructions (ncu, 256 sequences x 1k keys:
 * 98.4 M -> 37.0 M with the softmax's trims below), and that is energy: the board runs the
 * 256-sequence decode step at its 700 W limit, where the attention alone took 191 mJ a layer and
 * now takes 160 (pd-bench-cuda --power; a plain read of the same bytes costs ~100). G8 (at most 8
 * heads a group, Llama's and Qwen's shapes; with TMA) puts the keys in the MMAs' M and the heads
 * in N (S^T = K Q^T, O^T += V^T P^T, P^T's fragments transposed in registers by movmatrix): 8
 * rows of padding at most instead of 12 to 15, half the MMAs. Every variant rescales O only
 * when a maximum moved and masks keys only in a split's last tile.
 *
 * rope_qkv (one block per sequence and KV head): the QKV product's RoPE and cache writes are the
 * blocks' own instead of a kernel's before: a block rotates its Q rows from the product's rows,
 * and writes its KV head's new K (rotated) and V rows to the cache before the tile that holds
 * them is copied (the same arithmetic as rope_kv_write, so the same bits). */
#include <math.h>

#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_mma.h"

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int BN = 64; /* keys per tile: 16 per warp */
constexpr int kMaxCluster = 8; /* the portable cluster size: splits merged in a cluster */

template <int HD> struct tc_geom {
  static constexpr int LD = HD + 8;           /* smem row stride in elements */
  static constexpr int CPR = HD * 2 / 16;     /* 16-byte chunks per row */
  static constexpr int STAGE = 2 * BN * LD;   /* K then V, elements */
  static constexpr size_t SMEM_TILES = (size_t)2 * STAGE * 2;           /* two stages, bytes */
  /* O, m, l, the merge weights [warp][16], then the rows' max and denominator [16] each */
  static constexpr size_t SMEM_MERGE = ((size_t)kWarps * 16 * (HD + 3) + 32) * 4;
  /* CL: the block's merged O [16][HD] and (m, l) [16], after the warps' merge area */
  static constexpr size_t CL_OFF = (SMEM_MERGE + 15) / 16 * 16;
  static constexpr size_t SMEM_CL = CL_OFF + (size_t)16 * HD * 4 + 16 * 8;
  static constexpr size_t SMEM_A = SMEM_TILES > SMEM_MERGE ? SMEM_TILES : SMEM_MERGE;
  static constexpr size_t SMEM = SMEM_A > SMEM_CL ? SMEM_A : SMEM_CL;
};

/* The TMA variant's tiles (Hopper; 16-bit caches, head dims 64 and 128, page sizes a power of two
 * from 8 to 256, no window): a stage is K then V, each as HD / 64 column halves of 64 rows x 128
 * bytes, filled by the tensor-memory accelerator from 2D tensor maps over the caches (a box is
 * up to 64 rows of one page and one half) with the 128-byte swizzle: the 16-byte chunk c of row r
 * sits at chunk c ^ (r & 7), so that the fragment loads (ldmatrix, 8 rows at a time) meet no bank
 * conflict. One lane per box issues its copy; the stage's mbarrier counts the bytes. The threads
 * issue no copies and compute no cache addresses: a 64-key tile costs its warps a wait instead
 * of 16 cp.async and their address arithmetic a thread (with the page-table lookups about 60% of
 * the cp.async kernel's instructions), and on a board at its power limit instructions are
 * time. */
template <int HD> struct tma_geom {
  static constexpr int NH = HD / 64;              /* 128-byte column halves */
  static constexpr int HALF = BN * 128;           /* bytes of one half of one tile */
  static constexpr int STAGE = 2 * NH * HALF;     /* K then V */
  static constexpr size_t SMEM_TILES = 1024 + (size_t)2 * STAGE; /* + alignment slack */
};
/* the byte offset of 16-byte chunk c (0..HD/8-1) of row r in a K or V tile (swizzled) */
__device__ __forceinline__ uint32_t tma_off(int r, int c) {
  return (uint32_t)((c >> 3) * tma_geom<64>::HALF + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* P2: the page size is a power of two (shifts and masks; otherwise divisions: instantiated apart,
 * so that the usual kernel carries no division code). TMA: the tiles come by tensor-map copies
 * (see tma_geom; implies P2). G8 (TMA only): at most 8 query heads a group, computed with the
 * keys as the MMAs' M and the heads as N. */
template <int HD, typename KT, bool CL, bool P2, bool TMA, bool G8>
__global__ void __launch_bounds__(kThreads, 3)
    attn_decode_tc_kernel(const pd_cuda_attn a, const __grid_constant__ CUtensorMap tmk,
                          const __grid_constant__ CUtensorMap tmv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (TMA) __trap(); /* launched only where the code is Hopper's (tma_code_ok) */
#endif
  using G_ = tc_geom<HD>;
  using T_ = tma_geom<HD>;
  constexpr int LD = G_::LD, CPR = G_::CPR, KS = HD / 16, DT = HD / 8;
  static_assert(HD % 16 == 0 && DT % 2 == 0, "head dim must be a multiple of 16");
  static_assert(!TMA || HD % 64 == 0, "the TMA tiles are 64-column halves");
  static_assert(!G8 || TMA, "keys as M: the TMA tiles' layout");
  extern __shared__ __align__(16) unsigned char smem[];
  KT *tiles = reinterpret_cast<KT *>(smem);
  __shared__ __align__(16) KT sQ[16 * LD];
  __shared__ __align__(8) uint64_t bar[2]; /* TMA: a stage's copies done */
  /* TMA: the stages at the first 1024-byte boundary (the swizzle's period) */
  const uint32_t tbase = TMA ? (1024u - ((uint32_t)__cvta_generic_to_shared(smem) & 1023u)) & 1023u
                             : 0u;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, lg = lane >> 2, lt = lane & 3;
  const int s = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int G = a.group, nq = a.n_q_heads, nkv = a.n_kv_heads, bs = a.block_size;
  /* one new token per sequence: q_start[s] = s (not loaded) */
  const int t = s;
  const size_t qrow0 = (size_t)t * nq + (size_t)g * G; /* first query row of the group */
  const int32_t *bt = a.block_tables + (size_t)s * a.max_blocks;
  /* A block's first loads go out before any of them is used, the context length included (its
   * first use, the split's bounds, would otherwise hold back everything after it by an L2
   * round trip): Q's rows, then, where the split's first key does not depend on the context
   * length (a fixed split length and no window), the first tile's block-table entries. */
  const int L = a.ctx_len[s];
  constexpr int QJ = 16 * (HD / 2) / kThreads; /* Q pairs a thread stages */
  static_assert(16 * (HD / 2) % kThreads == 0, "Q's pairs split evenly over the threads");
  /* (rope_qkv: the rows of the QKV product; a thread takes the pairs (i, i + HD / 2) that RoPE
   * rotates instead of adjacent ones) */
  const size_t qkv_row = (size_t)(nq + 2 * nkv) * HD;
  const float *qg = a.rope_qkv ? a.rope_qkv + (size_t)t * qkv_row + (size_t)g * G * HD
                               : a.q + qrow0 * HD;
  float2 qv[QJ]; /* zero rows past G */
#pragma unroll
  for (int j = 0; j < QJ; j++) {
    const unsigned i = tid + j * kThreads, r = i / (HD / 2), d = (i - r * (HD / 2)) * 2;
    if (a.rope_qkv) {
      const unsigned e = i - r * (HD / 2);
      qv[j] = (int)r < G ? make_float2(qg[r * HD + e], qg[r * HD + e + HD / 2])
                         : make_float2(0.0f, 0.0f);
    } else {
      qv[j] = (int)r < G ? *reinterpret_cast<const float2 *>(qg + r * HD + d)
                         : make_float2(0.0f, 0.0f);
    }
  }
  /* A thread copies NJ 16-byte chunks of K and of V per tile: rows (tid + j * kThreads) / CPR.
   * Their pages' ids are read from the block table one tile ahead of the copies (pid), so that
   * issuing a tile's copies waits for no load, and power-of-two page sizes take shifts. */
  constexpr int NJ = TMA ? 1 : BN * CPR / kThreads;
  static_assert(TMA || BN * CPR % kThreads == 0, "a tile's chunks split evenly over the threads");
  const int bs_sh = P2 ? __ffs(bs) - 1 : 0;
  auto page_of = [&](int kp) { return P2 ? kp >> bs_sh : kp / bs; };
  /* the table entry of key kp (clamped into the sequence's row: loaded before kp is known to
   * be inside the context, masked after) */
  auto table_at = [&](int kp) {
    const int pi = page_of(kp);
    return __ldg(bt + (pi < a.max_blocks ? pi : a.max_blocks - 1));
  };
  /* TMA: lane `lane` of warp 0 copies box lane / (2 NH) of a tile (rows of one page), of K or
   * of V as (lane / NH) & 1, column half lane % NH; boxes of box_rows = min(page, 64) rows */
  const int box_rows = bs < BN ? bs : BN, n_box = BN / box_rows;
  const int my_box = lane / (2 * T_::NH), my_kv = (lane / T_::NH) & 1, my_half = lane % T_::NH;
  const bool tma_lane = TMA && warp == 0 && my_box < n_box;
  const bool pre = a.split_len > 0 && a.window <= 0;
  const long long kpre_l = pre ? (long long)split * a.split_len : 0;
  const int kpre = kpre_l < (long long)a.max_blocks * bs ? (int)kpre_l : 0;
  int pre_page[NJ];
#pragma unroll
  for (int j = 0; j < NJ; j++) {
    const int row = TMA ? my_box * box_rows : (tid + j * kThreads) / CPR;
    pre_page[j] = pre && (!TMA || tma_lane) ? table_at(kpre + row) : -1;
  }
  if (TMA && tid == 0) {
    pd_mbar_init(&bar[0], 1);
    pd_mbar_init(&bar[1], 1);
  }

  const int lo = a.window > 0 && L - a.window > 0 ? L - a.window : 0;
  long long sl = a.split_len;
  if (sl <= 0) {
    sl = ((long long)(L - lo) + a.n_splits - 1) / a.n_splits;
    sl = sl < 64 ? 64 : (sl + 63) / 64 * 64;
  }
  const long long kb_l = (long long)lo + (long long)split * sl;
  const int kbeg = kb_l < L ? (int)kb_l : L; /* (pre and a split with keys: kbeg = kpre) */
  const int kend = kb_l + sl < L ? (int)(kb_l + sl) : L;

  if (!CL && kbeg >= kend) { /* an empty split (n_splits > 1 only) */
    if (tid < G)
      a.part_ml[(size_t)split * a.n_tokens * nq + qrow0 + tid] = make_float2(-INFINITY, 0.0f);
    return;
  }
  /* (CL: an empty split walks no tile and leaves m = -inf, l = 0: every block of a cluster
   * reaches its barriers) */

  const KT *kc = static_cast<const KT *>(a.k), *vc = static_cast<const KT *>(a.v);
  const int n_tiles = kbeg < kend ? (kend - kbeg + BN - 1) / BN : 0;
  int pid[NJ]; /* page of each of this thread's rows in the next tile to copy, -1 past the end */
  auto read_pages = [&](int tile) {
    const int k0 = kbeg + tile * BN;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
      const int kp = k0 + (TMA ? my_box * box_rows : (tid + j * kThreads) / CPR);
      if (TMA && !tma_lane) {
        pid[j] = -1;
        continue;
      }
      const int p = tile == 0 && pre ? pre_page[j] : table_at(kp);
      pid[j] = kp < kend ? p : -1;
    }
  };
  auto load_tile = [&](int tile, int stage) {
    const int k0 = kbeg + tile * BN;
    if constexpr (TMA) {
      /* the boxes holding keys of the context; the stage's barrier expects their bytes */
      if (warp == 0) {
        const int valid = kend - k0 < BN ? kend - k0 : BN;
        const int boxes = (valid + box_rows - 1) / box_rows;
        if (lane == 0) pd_mbar_expect(&bar[stage], (uint32_t)(boxes * box_rows * 128 * 2 * T_::NH));
        if (pid[0] >= 0) {
          const int in_page = P2 ? (k0 + my_box * box_rows) & (bs - 1) : 0;
          const int row = (pid[0] * nkv + g) * bs + in_page;
          unsigned char *dst = smem + tbase + stage * T_::STAGE + my_kv * (T_::NH * T_::HALF) +
                               my_half * T_::HALF + my_box * box_rows * 128;
          pd_tma_load_2d(dst, my_kv ? (const void *)&tmv : (const void *)&tmk, my_half * 64, row,
                         &bar[stage]);
        }
      }
    } else {
      KT *sk = tiles + stage * G_::STAGE, *sv = sk + BN * LD;
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        const int i = tid + j * kThreads, r = i / CPR, c = i - r * CPR, kp = k0 + r;
        const bool ok = pid[j] >= 0;
        const int in_page = P2 ? kp & (bs - 1) : kp - page_of(kp) * bs;
        const size_t off =
            ok ? (((size_t)pid[j] * nkv + g) * bs + in_page) * HD + (size_t)c * 8 : 0;
        pd_cp_async16(&sk[r * LD + c * 8], kc + off, ok ? 16 : 0);
        pd_cp_async16(&sv[r * LD + c * 8], vc + off, ok ? 16 : 0);
      }
      pd_cp_async_commit();
    }
  };

  /* rope_qkv: this KV head's new K (with RoPE) and V rows to the cache, as rope_kv_write does,
   * then a proxy fence: the tile that holds them is copied after a barrier that follows (for a
   * one-tile context, the barrier right here; otherwise the one before the tile loop) */
  auto write_new_kv = [&]() {
    const int slot = a.rope_slots[t];
    if (slot < 0) return;
    const float *src = a.rope_qkv + (size_t)t * qkv_row + (size_t)(nq + g) * HD;
    const int blk = slot / bs, off = slot - blk * bs;
    const size_t dst = (((size_t)blk * nkv + g) * bs + off) * HD;
    KT *kw = static_cast<KT *>(const_cast<void *>(a.k));
    KT *vw = static_cast<KT *>(const_cast<void *>(a.v));
    if (tid < HD / 2) {
      float sn, cs;
      sincosf((float)a.rope_pos[t] * a.rope_inv_freq[tid], &sn, &cs);
      const float x0 = src[tid], x1 = src[tid + HD / 2];
      kw[dst + tid] = pd_from_f32<KT>(pd_rope_rot0(x0, x1, cs, sn));
      kw[dst + tid + HD / 2] = pd_from_f32<KT>(pd_rope_rot1(x0, x1, cs, sn));
    }
    if (tid < HD) vw[dst + tid] = pd_from_f32<KT>(src[(size_t)nkv * HD + tid]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
  };
  if (n_tiles > 0) {
    if (TMA && warp == 0) __syncwarp(); /* the barriers' initialisation before their use */
    if (a.rope_qkv && n_tiles == 1) {
      write_new_kv();
      __syncthreads();
    }
    read_pages(0);
    load_tile(0, 0);
    if (n_tiles > 1) read_pages(1);
  }
  if (a.rope_qkv && n_tiles > 1) write_new_kv();
  /* Q rows into shared memory, scaled into the log2 domain (rope_qkv: rotated first, as
   * rope_kv_write rotates them) */
  const float qscale = a.scale * PD_LOG2E;
#pragma unroll
  for (int j = 0; j < QJ; j++) {
    const int i = tid + j * kThreads, r = i / (HD / 2), d = (i - r * (HD / 2)) * 2;
    if (a.rope_qkv) {
      float y0 = 0.0f, y1 = 0.0f;
      if (r < G) {
        float sn, cs;
        sincosf((float)a.rope_pos[t] * a.rope_inv_freq[d / 2], &sn, &cs);
        y0 = pd_rope_rot0(qv[j].x, qv[j].y, cs, sn);
        y1 = pd_rope_rot1(qv[j].x, qv[j].y, cs, sn);
      }
      sQ[r * LD + d / 2] = pd_from_f32<KT>(y0 * qscale);
      sQ[r * LD + d / 2 + HD / 2] = pd_from_f32<KT>(y1 * qscale);
    } else {
      *reinterpret_cast<uint32_t *>(&sQ[r * LD + d]) =
          pd_tc<KT>::pack(qv[j].x * qscale, qv[j].y * qscale);
    }
  }

  __syncthreads(); /* sQ (and, TMA, the barriers' initialisation) */
  uint32_t qa[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    qa[ks][0] = pd_lds32(&sQ[lg * LD + ks * 16 + lt * 2]);
    qa[ks][1] = pd_lds32(&sQ[(lg + 8) * LD + ks * 16 + lt * 2]);
    qa[ks][2] = pd_lds32(&sQ[lg * LD + ks * 16 + lt * 2 + 8]);
    qa[ks][3] = pd_lds32(&sQ[(lg + 8) * LD + ks * 16 + lt * 2 + 8]);
  }

  /* heads as M (rows lg and lg + 8; mA, lA and mB, lB theirs): O [16 heads x HD] as DT tiles of
   * 8 columns. G8, keys as M: O^T [HD x 8 heads] as HD / 16 tiles of 16 rows, heads 2 lt and
   * 2 lt + 1 the lane's columns (mA, lA and mB, lB theirs; l summed over the lane's keys only
   * until the end) */
  float o[DT][4], ot[HD / 16][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < HD / 16; i++) ot[i][0] = ot[i][1] = ot[i][2] = ot[i][3] = 0.0f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;

  for (int tile = 0; tile < n_tiles; tile++) {
    const int st = tile & 1;
    if constexpr (TMA) {
      if (tile + 1 < n_tiles) {
        load_tile(tile + 1, st ^ 1);
        if (tile + 2 < n_tiles) read_pages(tile + 2);
      }
      pd_mbar_wait(&bar[st], (uint32_t)(tile >> 1) & 1);
      /* a tile that ends past the context: its V rows there (stale, or cache rows past the
       * sequence's end, which may hold anything, NaN included) are zeroed, as P is 0 there */
      const int valid = kend - (kbeg + tile * BN);
      if (valid < BN) {
        unsigned char *sv = smem + tbase + st * T_::STAGE + T_::NH * T_::HALF;
        for (int i = tid; i < (BN - valid) * (HD / 8); i += kThreads) {
          const int r = valid + i / (HD / 8), c = i % (HD / 8);
          *reinterpret_cast<uint4 *>(sv + tma_off(r, c)) = make_uint4(0, 0, 0, 0);
        }
        __syncthreads();
      }
    } else {
      if (tile + 1 < n_tiles) {
        load_tile(tile + 1, st ^ 1);
        if (tile + 2 < n_tiles) read_pages(tile + 2); /* used by the next iteration's copies */
        pd_cp_async_wait<1>();
      } else {
        pd_cp_async_wait<0>();
      }
      __syncthreads();
    }
    const KT *sk = tiles + st * G_::STAGE, *sv = sk + BN * LD;
    const unsigned char *tk = smem + tbase + st * T_::STAGE, *tv = tk + T_::NH * T_::HALF;
    const int kw = warp * 16;                     /* this warp's keys in the tile */
    const int kp0 = kbeg + tile * BN + kw;        /* position of its first key */
    const bool last = kbeg + tile * BN + BN > kend; /* keys past the context in this tile */

    if constexpr (G8) {
      /* keys as M, heads as N: S^T [16 keys x 8 heads] = K Q^T with K's A fragments by ldmatrix
       * (matrices: rows 0-7 / 8-15 of chunk 2 ks, then of chunk 2 ks + 1) and Q's B fragments
       * the rows lg of qa; lane: keys lg (s[0], s[1]) and lg + 8 (s[2], s[3]), heads 2 lt and
       * 2 lt + 1 */
      float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const int kr = kw + (lane & 7) + (lane & 8);
#pragma unroll
      for (int ks = 0; ks < KS; ks++) {
        uint32_t ka[4];
        pd_ldmatrix_x4(ka, tk + tma_off(kr, 2 * ks + (lane >> 4)));
        pd_tc<KT>::mma(s4, ka, qa[ks][0], qa[ks][2]);
      }
      if (last) {
        if (kp0 + lg >= kend) s4[0] = s4[1] = -INFINITY;
        if (kp0 + lg + 8 >= kend) s4[2] = s4[3] = -INFINITY;
      }
      /* a head's maximum over the tile's keys: the lane's two, then across lg */
      float mx0 = fmaxf(s4[0], s4[2]), mx1 = fmaxf(s4[1], s4[3]);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float mn0 = fmaxf(mA, mx0), mn1 = fmaxf(mB, mx1);
      const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
      const float c0 = pd_ex2(mA - mu0), c1 = pd_ex2(mB - mu1);
      mA = mn0;
      mB = mn1;
      s4[0] = pd_ex2(s4[0] - mu0);
      s4[2] = pd_ex2(s4[2] - mu0);
      s4[1] = pd_ex2(s4[1] - mu1);
      s4[3] = pd_ex2(s4[3] - mu1);
      lA = lA * c0 + (s4[0] + s4[2]);
      lB = lB * c1 + (s4[1] + s4[3]);
      /* P^T's B fragments (k = keys 2 lt, 2 lt + 1, n = head lg): the packed 8 x 8 blocks of keys
       * 0-7 and 8-15, transposed in registers */
      const uint32_t pb0 = pd_movmatrix_trans(pd_tc<KT>::pack(s4[0], s4[1]));
      const uint32_t pb1 = pd_movmatrix_trans(pd_tc<KT>::pack(s4[2], s4[3]));
      if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
        for (int i = 0; i < HD / 16; i++) {
          ot[i][0] *= c0;
          ot[i][2] *= c0;
          ot[i][1] *= c1;
          ot[i][3] *= c1;
        }
      }
      /* O^T [16 dims x 8 heads] += V^T P^T per 16 dims: V^T's A fragments by ldmatrix.trans
       * (matrices: keys 0-7 of chunks 2 i and 2 i + 1, then keys 8-15) */
      const int vr = kw + ((lane >> 4) << 3) + (lane & 7);
#pragma unroll
      for (int i = 0; i < HD / 16; i++) {
        uint32_t va[4];
        pd_ldmatrix_x4_trans(va, tv + tma_off(vr, 2 * i + ((lane >> 3) & 1)));
        pd_tc<KT>::mma(ot[i], va, pb0, pb1);
      }
    } else {
      float sa[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; nt++) {
        sa[nt][0] = sa[nt][1] = sa[nt][2] = sa[nt][3] = 0.0f;
        if constexpr (TMA) {
          /* K's B fragments of two k-steps an ldmatrix: matrices = 16-byte chunks 2ks .. 2ks+3 */
          const int r = kw + nt * 8 + (lane & 7);
#pragma unroll
          for (int ks = 0; ks < KS; ks += 2) {
            uint32_t kb[4];
            pd_ldmatrix_x4(kb, tk + tma_off(r, 2 * ks + (lane >> 3)));
            pd_tc<KT>::mma(sa[nt], qa[ks], kb[0], kb[1]);
            pd_tc<KT>::mma(sa[nt], qa[ks + 1], kb[2], kb[3]);
          }
        } else {
#pragma unroll
          for (int ks = 0; ks < KS; ks++) {
            const KT *kr = &sk[(kw + nt * 8 + lg) * LD + ks * 16 + lt * 2];
            pd_tc<KT>::mma(sa[nt], qa[ks], pd_lds32(kr), pd_lds32(kr + 8));
          }
        }
      }
      /* the online softmax; keys past the context only in the last tile */
      if (last) {
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const bool ok = kp0 + nt * 8 + lt * 2 + e < kend;
            sa[nt][e] = ok ? sa[nt][e] : -INFINITY;
            sa[nt][2 + e] = ok ? sa[nt][2 + e] : -INFINITY;
          }
      }
      /* a row's online softmax over the tile: its elements e, e + 1 of both n-tiles (row lg:
       * e = 0, row lg + 8: e = 2), the maximum across the quad; returns O's rescaling */
      auto row_softmax = [&](const int e, float &m, float &l) {
        float mx = fmaxf(fmaxf(sa[0][e], sa[0][e + 1]), fmaxf(sa[1][e], sa[1][e + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx);
        const float mu = mn == -INFINITY ? 0.0f : mn;
        const float corr = pd_ex2(m - mu);
        m = mn;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
          sa[nt][e] = pd_ex2(sa[nt][e] - mu);
          sa[nt][e + 1] = pd_ex2(sa[nt][e + 1] - mu);
        }
        l = l * corr + (sa[0][e] + sa[0][e + 1]) + (sa[1][e] + sa[1][e + 1]);
        return corr;
      };
      const float corrA = row_softmax(0, mA, lA), corrB = row_softmax(2, mB, lB);
      uint32_t pa[4];
      pa[0] = pd_tc<KT>::pack(sa[0][0], sa[0][1]);
      pa[1] = pd_tc<KT>::pack(sa[0][2], sa[0][3]);
      pa[2] = pd_tc<KT>::pack(sa[1][0], sa[1][1]);
      pa[3] = pd_tc<KT>::pack(sa[1][2], sa[1][3]);
      /* O rescaled only when a row's maximum moved somewhere in the warp (after the first tiles,
       * rarely) */
      if (__any_sync(0xffffffffu, corrA != 1.0f || corrB != 1.0f)) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
          o[dt][0] *= corrA;
          o[dt][1] *= corrA;
          o[dt][2] *= corrB;
          o[dt][3] *= corrB;
        }
      }
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        uint32_t vb[4];
        if constexpr (TMA)
          pd_ldmatrix_x4_trans(vb, tv + tma_off(kw + (lane & 15), dt + (lane >> 4)));
        else
          pd_ldmatrix_x4_trans(vb, &sv[(kw + (lane & 15)) * LD + dt * 8 + (lane >> 4) * 8]);
        pd_tc<KT>::mma(o[dt], pa, vb[0], vb[1]);
        pd_tc<KT>::mma(o[dt + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads(); /* the stage is refilled next */
  }

  /* merge the 4 warps: O, m, l per row through shared memory (the tiles are done with) */
  float *sO = reinterpret_cast<float *>(smem);             /* [warp][16][HD] */
  float *sM = sO + kWarps * 16 * HD, *sL = sM + kWarps * 16; /* [warp][16] */
  float *sW = sL + kWarps * 16, *sMx = sW + kWarps * 16, *sDen = sMx + 16;
  if constexpr (G8) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      lA += __shfl_xor_sync(0xffffffffu, lA, off);
      lB += __shfl_xor_sync(0xffffffffu, lB, off);
    }
    const int h0 = 2 * lt, h1 = h0 + 1; /* the G heads only */
#pragma unroll
    for (int i = 0; i < HD / 16; i++) {
      const int d = i * 16 + lg;
      if (h0 < G) {
        sO[(warp * 16 + h0) * HD + d] = ot[i][0];
        sO[(warp * 16 + h0) * HD + d + 8] = ot[i][2];
      }
      if (h1 < G) {
        sO[(warp * 16 + h1) * HD + d] = ot[i][1];
        sO[(warp * 16 + h1) * HD + d + 8] = ot[i][3];
      }
    }
    if (lg == 0) {
      sM[warp * 16 + h0] = mA;
      sM[warp * 16 + h1] = mB;
      sL[warp * 16 + h0] = lA;
      sL[warp * 16 + h1] = lB;
    }
  } else {
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
#pragma unroll
    for (int dt = 0; dt < DT; dt++) { /* the G rows only (the rest are the tile's zero rows) */
      const int d = dt * 8 + lt * 2;
      if (lg < G)
        *reinterpret_cast<float2 *>(&sO[(warp * 16 + lg) * HD + d]) =
            make_float2(o[dt][0], o[dt][1]);
      if (lg + 8 < G)
        *reinterpret_cast<float2 *>(&sO[(warp * 16 + lg + 8) * HD + d]) =
            make_float2(o[dt][2], o[dt][3]);
    }
    if (lt == 0) {
      sM[warp * 16 + lg] = mA;
      sM[warp * 16 + lg + 8] = mB;
      sL[warp * 16 + lg] = lA;
      sL[warp * 16 + lg + 8] = lB;
    }
  }
  __syncthreads();
  /* each row's weights 2^(m_w - max) and denominator once, not per element */
  if (tid < G) {
    const int r = tid;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; w++) M = fmaxf(M, sM[w * 16 + r]);
    float den = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) {
      const float mw = sM[w * 16 + r];
      const float wt = mw == -INFINITY ? 0.0f : exp2f(mw - M);
      sW[w * 16 + r] = wt;
      den += wt * sL[w * 16 + r];
    }
    sMx[r] = M;
    sDen[r] = den;
  }
  __syncthreads();
#pragma unroll 4
  for (int i = tid; i < G * HD; i += kThreads) {
    const int r = i / HD, d = i - r * HD;
    const float M = sMx[r], den = sDen[r];
    float num = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) num += sW[w * 16 + r] * sO[(w * 16 + r) * HD + d];
    if (CL) {
      float *cO = reinterpret_cast<float *>(smem + G_::CL_OFF);
      cO[r * HD + d] = num;
      if (d == 0) reinterpret_cast<float2 *>(cO + 16 * HD)[r] = make_float2(M, den);
    } else if (a.n_splits == 1) {
      pd_attn_store(a, (qrow0 + r) * HD + d, num / den);
    } else {
      const size_t sb = (size_t)split * a.n_tokens * nq;
      a.part_o[(sb + qrow0 + r) * HD + d] = num;
      if (d == 0) a.part_ml[sb + qrow0 + r] = make_float2(M, den);
    }
  }
  if constexpr (CL) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    /* the cluster's merge, as merge_kernel's: weights 2^(m_k - max), out = sum w O / sum w l */
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    cl.sync(); /* every block's (m, l, O) is in its shared memory */
    const int nb = (int)cl.num_blocks(), rank = (int)cl.block_rank();
    float *cO = reinterpret_cast<float *>(smem + G_::CL_OFF);
    for (int i = rank * kThreads + tid; i < G * HD; i += nb * kThreads) {
      const int r = i / HD, d = i - r * HD;
      /* every block's (m, l) and O element requested before any is used: one round trip */
      float2 ml[kMaxCluster];
      float ov[kMaxCluster];
#pragma unroll
      for (int k = 0; k < kMaxCluster; k++) {
        if (k < nb) {
          const float *po = cl.map_shared_rank(cO, k);
          ml[k] = reinterpret_cast<const float2 *>(po + 16 * HD)[r];
          ov[k] = po[r * HD + d];
        }
      }
      float M = -INFINITY;
#pragma unroll
      for (int k = 0; k < kMaxCluster; k++)
        if (k < nb) M = fmaxf(M, ml[k].x);
      float num = 0.0f, den = 0.0f;
#pragma unroll
      for (int k = 0; k < kMaxCluster; k++) {
        if (k < nb) {
          const float wt = ml[k].x == -INFINITY ? 0.0f : exp2f(ml[k].x - M);
          num += wt * ov[k];
          den += wt * ml[k].y;
        }
      }
      pd_attn_store(a, (qrow0 + r) * HD + d, num / den);
    }
    /* no block leaves while the others read its shared memory: a relaxed arrival (no memory
     * fence: nothing written here is read after it; the reads above are complete, their values
     * used) */
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
    __trap(); /* launched only on compute capability 9.0 and later */
#endif
  }
}


/* dynamic shared memory of a variant: the tiles, the warps' merge and the cluster's merge
 * overlap (each is done with before the next starts) */
template <int HD, bool TMA> constexpr size_t smem_of() {
  return TMA ? (tma_geom<HD>::SMEM_TILES > tc_geom<HD>::SMEM ? tma_geom<HD>::SMEM_TILES
                                                               : tc_geom<HD>::SMEM)
             : tc_geom<HD>::SMEM;
}

/* The launch of the CL kernel over `grid`, the splits (grid z) of a (sequence, KV head) one
 * cluster; *at is the cluster attribute cfg points to. Also sets the shared-memory opt-in. */
template <int HD, typename KT, bool P2, bool TMA, bool G8>
cudaLaunchConfig_t cluster_config(dim3 grid, cudaStream_t st, cudaLaunchAttribute *at) {
  const size_t smem = smem_of<HD, TMA>();
  pd_cuda_smem_optin((const void *)attn_decode_tc_kernel<HD, KT, true, P2, TMA, G8>, smem);
  at->id = cudaLaunchAttributeClusterDimension;
  at->val.clusterDim.x = 1;
  at->val.clusterDim.y = 1;
  at->val.clusterDim.z = grid.z;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  return cfg;
}

template <int HD, typename KT, bool P2, bool TMA, bool G8>
void launch_p2(cudaStream_t st, const pd_cuda_attn *a, const CUtensorMap &tmk,
               const CUtensorMap &tmv) {
  const size_t smem = smem_of<HD, TMA>();
  dim3 grid((unsigned)a->n_seqs, (unsigned)a->n_kv_heads, (unsigned)a->n_splits);
  if (a->cluster) {
    cudaLaunchAttribute at;
    const cudaLaunchConfig_t cfg = cluster_config<HD, KT, P2, TMA, G8>(grid, st, &at);
    cudaLaunchKernelEx(&cfg, attn_decode_tc_kernel<HD, KT, true, P2, TMA, G8>, *a, tmk, tmv);
    return;
  }
  pd_cuda_smem_optin((const void *)attn_decode_tc_kernel<HD, KT, false, P2, TMA, G8>, smem);
  attn_decode_tc_kernel<HD, KT, false, P2, TMA, G8><<<grid, kThreads, smem, st>>>(*a, tmk, tmv);
}

/* ---- the TMA variant's tensor maps (built per call on the host: no device work) */

/* Whether the TMA variants' device code is Hopper's: a build for sm_80 alone runs its sm_80 code
 * on Hopper too, and there the tensor-map copies are compiled out. */
bool tma_code_ok() {
  cudaFuncAttributes fa;
  const cudaError_t r = cudaFuncGetAttributes(
      &fa, (const void *)attn_decode_tc_kernel<128, __nv_bfloat16, false, true, true, true>);
  if (r != cudaSuccess) cudaGetLastError();
  return r == cudaSuccess && fa.binaryVersion >= 90;
}

/* cuTensorMapEncodeTiled through the runtime (no link to the driver library); NULL where the
 * driver lacks it */
PFN_cuTensorMapEncodeTiled_v12000 tma_encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      return (PFN_cuTensorMapEncodeTiled_v12000)p;
    cudaGetLastError();
    return (PFN_cuTensorMapEncodeTiled_v12000)NULL;
  }();
  return fn;
}

/* The cache at base as a 2D tensor of head_dim columns and num_blocks * n_kv_heads * block_size
 * rows, copied in boxes of 64 columns x min(block_size, 64) rows with the 128-byte swizzle.
 * No L2 promotion: a box's rows are 128-byte halves of the cache rows, and promoting them to
 * 256-byte L2 requests made the L2 serve 25% more sectors to the SMs and move 50% more across
 * its two partitions (ncu, H200, 256 x 1k: L2 traffic 2.17 -> 1.63 GB for 1.08 GB of DRAM
 * reads). Alternated on one H200: 256 x 1k alone 268.5 -> 254-256 us, the 256-sequence step
 * 15.72 -> 15.49-15.54 ms (a plain tensor-map stream of half rows: 513 -> 469 us a 2 GiB). */
bool tma_map(CUtensorMap *m, const void *base, const pd_cuda_attn *a) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = tma_encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)a->head_dim,
                              (cuuint64_t)a->num_blocks * a->n_kv_heads * a->block_size};
  const cuuint64_t strides[1] = {(cuuint64_t)a->head_dim * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)(a->block_size < BN ? a->block_size : BN)};
  const cuuint32_t estr[2] = {1, 1};
  return fn(m,
            a->kv_dtype == PD_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            2, const_cast<void *>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int HD, typename KT> void launch_hd(cudaStream_t st, const pd_cuda_attn *a) {
  static const CUtensorMap none = {};
  if constexpr (HD % 64 == 0) {
    CUtensorMap tmk, tmv;
    if (a->tma && tma_map(&tmk, a->k, a) && tma_map(&tmv, a->v, a)) {
      if (a->group <= 8)
        launch_p2<HD, KT, true, true, true>(st, a, tmk, tmv);
      else
        launch_p2<HD, KT, true, true, false>(st, a, tmk, tmv);
      return;
    }
  }
  if ((a->block_size & (a->block_size - 1)) == 0)
    launch_p2<HD, KT, true, false, false>(st, a, none, none);
  else
    launch_p2<HD, KT, false, false, false>(st, a, none, none);
}

/* Whether a cluster of kMaxCluster blocks of the CL kernel fits on this device (checked once
 * per kernel: the answer depends on its shared memory only; the non-TMA variants use the most) */
template <int HD, typename KT> bool cluster_fits() {
  static int fits = -1;
  if (fits < 0) {
    cudaLaunchAttribute at;
    const cudaLaunchConfig_t cfg =
        cluster_config<HD, KT, true, false, false>(dim3(1, 1, kMaxCluster), 0, &at);
    int n = 0;
    const cudaError_t r = cudaOccupancyMaxActiveClusters(
        &n, (const void *)attn_decode_tc_kernel<HD, KT, true, true, false, false>, &cfg);
    if (r != cudaSuccess) cudaGetLastError();
    fits = r == cudaSuccess && n > 0;
  }
  return fits > 0;
}

template <typename KT> void launch_kt(cudaStream_t st, const pd_cuda_attn *a) {
  switch (a->head_dim) {
  case 64: launch_hd<64, KT>(st, a); break;
  case 80: launch_hd<80, KT>(st, a); break;
  default: launch_hd<128, KT>(st, a); break;
  }
}

template <typename KT> bool fits_kt(int hd) {
  return hd == 64 ? cluster_fits<64, KT>() : hd == 80 ? cluster_fits<80, KT>()
                                                      : cluster_fits<128, KT>();
}

} // namespace

int pd_cuda_attn_decode_tc_max_cluster(const pd_cuda_attn *a, int cc_major) {
  if (cc_major < 9 || !pd_cuda_attn_decode_tc_ok(a)) return 1;
  const bool fits = a->kv_dtype == PD_DTYPE_BF16 ? fits_kt<__nv_bfloat16>(a->head_dim)
                                                 : fits_kt<__half>(a->head_dim);
  return fits ? kMaxCluster : 1;
}

/* The TMA variant (see tma_geom): Hopper and later, head dims 64 and 128, power-of-two pages
 * of 8 to 256 tokens, no window (tiles then start on a page or at a multiple of 64 keys inside
 * one), caches 16-byte aligned, rows indexable in 32 bits, the driver's tensor-map encoder. */
bool pd_cuda_attn_decode_tma_ok(const pd_cuda_attn *a, int cc_major) {
  static const bool on = tma_code_ok();
  const int bs = a->block_size;
  return on && cc_major >= 9 && pd_cuda_attn_decode_tc_ok(a) && a->head_dim % 64 == 0 &&
         bs >= 8 && bs <= 256 && (bs & (bs - 1)) == 0 && a->window <= 0 &&
         ((uintptr_t)a->k & 15) == 0 && ((uintptr_t)a->v & 15) == 0 && a->num_blocks > 0 &&
         (long long)a->num_blocks * a->n_kv_heads * bs < (1LL << 31) && tma_encode_fn();
}

bool pd_cuda_attn_decode_tc_ok(const pd_cuda_attn *a) {
  return (a->kv_dtype == PD_DTYPE_BF16 || a->kv_dtype == PD_DTYPE_F16) && a->group >= 1 &&
         a->group <= 16 && (a->head_dim == 64 || a->head_dim == 80 || a->head_dim == 128);
}

void pd_cuda_attn_decode_tc(cudaStream_t st, const pd_cuda_attn *a) {
  if (a->kv_dtype == PD_DTYPE_BF16)
    launch_kt<__nv_bfloat16>(st, a);
  else
    launch_kt<__half>(st, a);
}
