/* Device sampling: the `sample` op of backend.h (pipeline of pd/sample.h, steps 1-5).
 *
 * One thread block of 1024 threads per sampled row; rows run in parallel. Per row:
 *   edits    a row with edits is copied to a scratch row and the edits are applied there, one
 *            thread per edit (ids are unique), with apply_edits()' float arithmetic:
 *              SUPPRESS: z = -inf;  BIAS: z = z + bias;
 *              SEEN and rep != 1: z = z > 0 ? z / rep : z * rep;
 *              count > 0: z = z - freq * count; z = z - pres;
 *            and, like apply_edits, the penalty result replaces the biased value only when it
 *            compares unequal (or is NaN): -0 and +0 stay as they were. The raw row stays intact.
 *   raw      with logprobs (n_top >= 0), in the same pass as the copy (or the max pass when the
 *            row has no edits): the raw max and an online log-sum-exp (NaN and -inf count as
 *            -inf), and the n_top largest (value desc, id asc) through per-warp sorted lists that
 *            are merged at the end. After the draw: the token's raw logprob and its rank,
 *            1 + count(raw > raw[token]), read off the top list when the token is in it.
 *   greedy   temperature < 1e-5: argmax of the edited row, ties to the lowest id.
 *   sampled  as select_tokens() on the CPU: m = max, lo = max(m - 40 T, m + T ln(min_p)),
 *            candidates z >= lo, weights w = exp((z - m) * (1/T)) with the CPU's own exp
 *            polynomial and roundings (so the weights are the CPU's bit for bit), turned into
 *            64-bit fixed point: W = round(w * 2^44) (2^43 for a vocabulary of 2^20, so that a
 *            row of equal logits cannot overflow). Every sum is an integer sum: exact and the same
 *            in any order, so the token does not depend on the threads, the other rows or the
 *            path taken below. A weight of at most 2^-45 of the largest rounds to 0 and is never
 *            drawn (the CPU keeps tokens down to e^-40 ~ 4e-18 of it; the mass lost is at most
 *            vocab * 2^-45 of the largest weight, below 5e-9 of the total for 152k tokens).
 *            top_k (0 < k < vocab, more than k candidates): the k-th largest logit by radix
 *            select on order-preserving uint32 keys of the floats (-0 sorts with +0), 8 bits per
 *            level, the boundary bin found from a 256-bin histogram; every candidate >= it is
 *            kept (ties kept).
 *            top_p < 1: target = ceil(top_p * kept mass); the smallest prefix in (value desc,
 *            id asc) order whose mass reaches it: the same radix descent on mass histograms finds
 *            the boundary value t, then the ties at t are taken in id order until the target is
 *            reached.
 *            Draw: x = floor(u * kept mass) (exact, 128-bit product); the token is the first kept
 *            id (id order) whose inclusive prefix mass exceeds x.
 *
 * Passes over the row (each reads it from L2 or HBM): the max (with top_k it also counts the
 * tokens per level-0 bin, which settles level 0 when more than k of them lie above the bin of
 * lo); a histogram pass (the weights of all candidates and, with top_p, their count and mass
 * per bin); then one pass per radix level until the undecided set -- every candidate at or above
 * the boundary bin -- holds at most kCap (16384) tokens. Those are copied into shared memory as
 * (key, id) and the rest runs there (remaining levels, ties, draw; weights recomputed from the
 * keys). So top_k = 50 typically takes two passes (the max with its counts, the copy), top_p
 * alone three or four. The draw over the list buckets the kept mass by id (256 ids a bucket),
 * scans the buckets and lays out the one holding x by id. Over the row (no top_k / top_p, or a
 * kept set larger than kCap) it uses the mass of every tile of 128 ids -- recorded by the
 * histogram pass when every candidate is kept, else one more pass -- a block scan, and the
 * rescan of one tile by one warp. Histograms use 32-bit shared-memory atomics only (hist_add).
 * Shared memory is about 166 KiB: one block per SM.
 *
 * Small greedy calls (at most 16 rows, no edits, no logprobs) take greedy_kernel instead: see
 * "greedy fast path" below.
 *
 * Scratch: the op copies specs and edits through pinned staging (c->smp_host) to the device
 * (c->smp_dev, which also holds the outputs and the scratch rows); both grow only when a call
 * needs more. Rows with edits take a scratch row each; at most kScratchBudget bytes of them, so
 * a call with more edited rows is launched in several chunks. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


#include "cuda_state.h"

namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;                     /* units in flight per thread (see for_units) */
constexpr int kWarps = kThreads / 32;
constexpr int kCap = 16384;                    /* shared-memory list: tokens */
constexpr int kTile = 128;                     /* ids per warp tile of a draw over the row */
constexpr int kMaxVocab = 1 << 20;
constexpr int kMaxTiles = kMaxVocab / kTile;
constexpr int kBucket = 256;                   /* ids per bucket of a draw over the list */
constexpr int kBuckets = kMaxVocab / kBucket;
constexpr int kMaxTop = PD_DEV_SAMPLE_MAX_TOP;
constexpr float kGreedyEps = 1e-5f;            /* PD_SAMPLE_GREEDY_EPS (pd/sample.h) */
constexpr float kCutoff = 40.0f;               /* PD_SAMPLE_CUTOFF (pd/sample.h) */
constexpr size_t kScratchBudget = (size_t)128 << 20; /* edited rows per launch: this many bytes */
constexpr unsigned kFull = 0xffffffffu;

/* One row of a call, as the kernel reads it (built on the host from pd_dev_sample_spec). */
struct Row {
  int32_t row;
  int32_t top_k;
  int32_t n_top;      /* -1: no logprobs */
  int32_t edit_begin;
  int32_t edit_count;
  int32_t slot;       /* scratch row of this launch, -1 without edits */
  float T, top_p, min_p;
  float log_min_p;    /* logf(min_p), computed on the host like the CPU sampler does */
  float rep, freq, pres;
  float pad_;
  double u;
};

/* A token of the shared-memory list (its weight is recomputed from the key when needed). */
struct Ent {
  uint32_t key;
  int32_t id;
};

/* Block-uniform results, written by one thread or warp, read by all after a barrier. */
struct Ctl {
  int sel_ok;
  uint32_t sel_b, sel_above_c, sel_cb;
  unsigned long long sel_above_m, sel_mb;
  int f_tile, f_id;
  unsigned long long f_base, f_incl;
  unsigned long long red_u;
  double red_d;
  float red_f;
  int red_i;
  float xt;
  int rank;
  int list_n;
  uint32_t above0;
};

struct Shared {
  union {
    Ent list[kCap];                             /* the undecided set, in no order */
    unsigned long long tile_mass[kMaxTiles];    /* draw over the row: mass per warp tile */
    struct {
      float v[kWarps][kMaxTop];
      int id[kWarps][kMaxTop];
      int cnt[kWarps];
    } top;                                      /* raw pass: per-warp top lists */
  } u;
  unsigned int hc[256];                         /* histogram: tokens per bin */
  unsigned int hm_lo[256], hm_hi[256];          /* and their mass: hi * 2^32 + lo (see hist_add) */
  unsigned long long red_u[kWarps];
  double red_d[kWarps];
  float red_f[kWarps];
  int red_i[kWarps];
  unsigned int bk_lo[kBuckets], bk_hi[kBuckets]; /* find_list: mass per bucket of ids */
  unsigned long long slot[kBucket];             /* find_list: weights of one bucket, by id */
  float top_v[kMaxTop];                         /* merged raw top list */
  int top_i[kMaxTop];
  Ctl ctl;
};

static_assert(sizeof(Shared) <= 227 * 1024, "shared memory of one block");

/* ---- element helpers ---------------------------------------------------------------------- */

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

__device__ __forceinline__ float qnan() { return __int_as_float(0x7fc00000); }

/* Order-preserving key: a < b (floats, not NaN) iff key(a) < key(b); -0 gets +0's key. */
__device__ __forceinline__ uint32_t fkey(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The float of a key (inverse of fkey; -0 comes back as +0). */
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* (value desc, id asc) */
__device__ __forceinline__ bool before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

/* fast_expf of common/sample/sampler.c with the same roundings (no contraction): the weights
 * are the CPU sampler's bit for bit. NaN and anything below -87 give exp(-87). */
__device__ __forceinline__ float cpu_expf(float x) {
  x = x > -87.0f ? x : -87.0f;
  x = x < 88.0f ? x : 88.0f;
  const float t = __fmul_rn(x, 1.44269504088896341f);
  const float tb = __fadd_rn(t, 12582912.0f); /* 1.5 * 2^23 + r: r sits in the low bits */
  const float r = __fsub_rn(tb, 12582912.0f);
  float f = __fsub_rn(x, __fmul_rn(r, 0.693359375f));
  f = __fadd_rn(f, __fmul_rn(r, 2.12194440e-4f));
  const float z = __fmul_rn(f, f);
  float y = 1.9875691500e-4f;
  y = __fadd_rn(__fmul_rn(y, f), 1.3981999507e-3f);
  y = __fadd_rn(__fmul_rn(y, f), 8.3334519073e-3f);
  y = __fadd_rn(__fmul_rn(y, f), 4.1665795894e-2f);
  y = __fadd_rn(__fmul_rn(y, f), 1.6666665459e-1f);
  y = __fadd_rn(__fmul_rn(y, f), 5.0000001201e-1f);
  y = __fadd_rn(__fadd_rn(__fmul_rn(y, z), f), 1.0f);
  const int ri = __float_as_int(tb) - 0x4B400000; /* == (int)r */
  return __fmul_rn(y, __int_as_float((ri + 127) << 23));
}

/* w (positive, at most ~1) * 2^fs rounded to the nearest integer (ties to even): the scaling
 * by a power of two is exact. */
__device__ __forceinline__ unsigned long long to_fixed(float w, int fs) {
  return __float2ull_rn(__fmul_rn(w, __int_as_float((127 + fs) << 23)));
}

/* Candidate test and weights of one row. */
struct Cand {
  float lo, m, invT;
  int fs;
};

__device__ __forceinline__ unsigned long long weight(const Cand &c, float z) {
  return to_fixed(cpu_expf(__fmul_rn(__fsub_rn(z, c.m), c.invT)), c.fs);
}

/* Which candidates are kept: lo_key <= key <= hi_key and (key > kt or (key == kt and
 * id <= cid)). */
struct Keep {
  uint32_t lo_key, hi_key, kt;
  int cid;
};

__device__ __forceinline__ bool kept(const Keep &k, uint32_t key, int id) {
  return key >= k.lo_key && key <= k.hi_key && (key > k.kt || (key == k.kt && id <= k.cid));
}

/* Four elements from unit q (ids 4q .. 4q+3); NaN past the end. vec: p is 16-byte aligned and
 * V a multiple of 4. */
__device__ __forceinline__ void load4(const float *p, int q, int V, bool vec, float v[4]) {
  const int i = q << 2;
  if (vec) {
    if (i < V) {
      const float4 t = *reinterpret_cast<const float4 *>(p + i);
      v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
      v[0] = v[1] = v[2] = v[3] = qnan();
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = i + j < V ? p[i + j] : qnan();
  }
}

/* Calls f(first id, float v[4]) for every unit of the row: warp w takes units w*32 + lane +
 * r*1024 (r < U) of every U*1024, all loaded before any is processed, so loads are coalesced
 * and many are in flight, and each thread sees its ids in increasing order. Warp-uniform: every
 * lane runs every iteration (units past the end are NaN), so f may use warp votes and shuffles.
 * The 32 units of one warp and r are one tile of kTile ids (hist_row, find_row). U = 4 where f
 * is light; heavy f take U = 2 (registers). */
template <int U = kUnroll, class F>
__device__ __forceinline__ void for_units(const float *p, int V, bool vec, F &&f) {
  const int nu = (V + 3) >> 2;
  for (int qb = warp_id() * 32; qb < nu; qb += U * kThreads) {
    float a[U][4];
#pragma unroll
    for (int r = 0; r < U; r++) load4(p, qb + lane_id() + r * kThreads, V, vec, a[r]);
#pragma unroll
    for (int r = 0; r < U; r++) f((qb + lane_id() + r * kThreads) << 2, a[r]);
  }
}

/* ---- warp and block reductions ------------------------------------------------------------ */

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ unsigned long long warp_scan_u64(unsigned long long v) {
  const int lane = lane_id();
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += t;
  }
  return v;
}

/* Each reduction starts with a barrier, so that a slow thread still reading the previous
 * result in Shared is not overtaken. Every thread gets the result. */
__device__ unsigned long long block_sum_u64(Shared &S, unsigned long long v) {
  v = warp_sum_u64(v);
  __syncthreads();
  if (lane_id() == 0) S.red_u[warp_id()] = v;
  __syncthreads();
  if (warp_id() == 0) {
    const unsigned long long t = warp_sum_u64(S.red_u[lane_id()]);
    if (lane_id() == 0) S.ctl.red_u = t;
  }
  __syncthreads();
  return S.ctl.red_u;
}

__device__ double block_sum_d(Shared &S, double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();
  if (lane_id() == 0) S.red_d[warp_id()] = v;
  __syncthreads();
  if (warp_id() == 0) {
    double t = S.red_d[lane_id()];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(kFull, t, o);
    if (lane_id() == 0) S.ctl.red_d = t;
  }
  __syncthreads();
  return S.ctl.red_d;
}

__device__ __forceinline__ void warp_argmax(float &v, int &i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, i, o);
    if (before(ov, oi, v, i)) v = ov, i = oi;
  }
}

/* The largest (v, i) in (value desc, id asc) order; v must not be NaN. */
__device__ void block_argmax(Shared &S, float &v, int &i) {
  warp_argmax(v, i);
  __syncthreads();
  if (lane_id() == 0) S.red_f[warp_id()] = v, S.red_i[warp_id()] = i;
  __syncthreads();
  if (warp_id() == 0) {
    float t = S.red_f[lane_id()];
    int ti = S.red_i[lane_id()];
    warp_argmax(t, ti);
    if (lane_id() == 0) S.ctl.red_f = t, S.ctl.red_i = ti;
  }
  __syncthreads();
  v = S.ctl.red_f;
  i = S.ctl.red_i;
}

/* Exclusive prefix sum over threads in thread order; *total gets the sum. */
__device__ unsigned long long block_scan_u64(Shared &S, unsigned long long v,
                                             unsigned long long *total) {
  const unsigned long long inc = warp_scan_u64(v);
  __syncthreads();
  if (lane_id() == 31) S.red_u[warp_id()] = inc;
  __syncthreads();
  if (warp_id() == 0) {
    const unsigned long long t = S.red_u[lane_id()];
    const unsigned long long ti = warp_scan_u64(t);
    S.red_u[lane_id()] = ti - t;
    if (lane_id() == 31) S.ctl.red_u = ti;
  }
  __syncthreads();
  *total = S.ctl.red_u;
  return S.red_u[warp_id()] + inc - v;
}

/* ---- histograms ------------------------------------------------------------------------------ */

/* Adds one element to bin `bin` (its count, and w when mass). Shared-memory atomics on 32 bits
 * only (64-bit ones are compare-and-swap loops, which crawl when many lanes hit one bin, as rows
 * do): the mass is kept as lo + hi * 2^32 per bin; the lo add returns the old value, and a
 * wrap-around carries into hi. The sum is exact and independent of the order. */
__device__ __forceinline__ void hist_add(Shared &S, bool act, uint32_t bin, unsigned long long w,
                                         bool mass) {
  if (!act) return;
  atomicAdd(&S.hc[bin], 1u);
  if (mass) {
    const uint32_t lo = (uint32_t)w, old = atomicAdd(&S.hm_lo[bin], lo);
    const uint32_t hi = (uint32_t)(w >> 32) + (old + lo < old ? 1u : 0u);
    if (hi) atomicAdd(&S.hm_hi[bin], hi);
  }
}

__device__ __forceinline__ unsigned long long bin_mass(const Shared &S, int b) {
  return ((unsigned long long)S.hm_hi[b] << 32) + S.hm_lo[b];
}

/* Histogram parameters: the elements counted are the candidates with key >= thr whose key
 * matches prefix in the bytes above `level` (level 0: the top byte, 3: the lowest). */
struct HistSpec {
  uint32_t thr;
  int level;
  uint32_t prefix;
  bool bins;  /* fill S.hc / S.hm_* (else only the totals) */
  bool mass;  /* weights (else counts only) */
  bool tiles; /* hist_row: also the mass of every tile (S.u.tile_mass), for find_row */
};

__device__ __forceinline__ uint32_t prefix_mask(int level) {
  return level == 0 ? 0u : ~0u << (32 - 8 * level);
}

__device__ void hist_zero(Shared &S, bool bins) {
  if (bins)
    for (int b = threadIdx.x; b < 256; b += kThreads) S.hc[b] = 0, S.hm_lo[b] = 0, S.hm_hi[b] = 0;
  __syncthreads();
}

/* Over the row z. *cnt, *msum: totals over the elements counted. */
__device__ void hist_row(Shared &S, const float *z, int V, bool vec, const Cand &c,
                         const HistSpec &h, uint32_t *cnt, unsigned long long *msum) {
  hist_zero(S, h.bins);
  const int shift = 24 - 8 * h.level, nt = (V + kTile - 1) / kTile;
  const uint32_t pm = prefix_mask(h.level), pv = h.prefix & pm;
  unsigned long long n = 0, ms = 0;
  for_units<2>(z, V, vec, [&](int i0, const float *v) {
    unsigned long long ts = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const float t = v[j];
      const uint32_t k = fkey(t);
      const bool act = t >= c.lo && k >= h.thr && (k & pm) == pv; /* NaN fails */
      unsigned long long w = 0;
      if (h.mass && act) w = weight(c, t);
      n += act;
      ts += w;
      if (h.bins) hist_add(S, act, (k >> shift) & 255u, w, h.mass);
    }
    ms += ts;
    if (h.tiles) { /* the warp's 32 units are one tile */
      ts = warp_sum_u64(ts);
      const int tile = i0 / kTile;
      if (lane_id() == 0 && tile < nt) S.u.tile_mass[tile] = ts;
    }
  });
  *cnt = (uint32_t)block_sum_u64(S, n);
  *msum = block_sum_u64(S, ms);
}

/* Over the shared-memory list [0, n). */
__device__ void hist_list(Shared &S, int n, const Cand &c, const HistSpec &h, uint32_t *cnt,
                          unsigned long long *msum) {
  hist_zero(S, h.bins);
  const int shift = 24 - 8 * h.level;
  const uint32_t pm = prefix_mask(h.level), pv = h.prefix & pm;
  unsigned long long nc = 0, ms = 0;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const Ent E = S.u.list[e];
    const bool act = E.key >= h.thr && (E.key & pm) == pv;
    const unsigned long long w = act && h.mass ? weight(c, key_float(E.key)) : 0;
    nc += act;
    ms += w;
    if (h.bins) hist_add(S, act, (E.key >> shift) & 255u, w, h.mass);
  }
  *cnt = (uint32_t)block_sum_u64(S, nc);
  *msum = block_sum_u64(S, ms);
}

/* From the top bin down, the first bin b where (everything above b) + b reaches need, by
 * count or by mass. Results in S.ctl (sel_ok = 0 when the total stays below need). */
__device__ void select_bin(Shared &S, bool by_mass, unsigned long long need) {
  __syncthreads();
  if (warp_id() == 0) {
    const int lane = lane_id();
    unsigned long long lc = 0, lm = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int b = 255 - 8 * lane - j;
      lc += S.hc[b];
      lm += bin_mass(S, b);
    }
    const unsigned long long ic = warp_scan_u64(lc), im = warp_scan_u64(lm);
    const unsigned bal = __ballot_sync(kFull, (by_mass ? im : ic) >= need);
    if (lane == 0) S.ctl.sel_ok = bal != 0;
    if (bal && lane == __ffs(bal) - 1) {
      unsigned long long ac = ic - lc, am = im - lm;
      for (int j = 0; j < 8; j++) {
        const int b = 255 - 8 * lane - j;
        const unsigned long long bc = S.hc[b], bm = bin_mass(S, b);
        if ((by_mass ? am + bm : ac + bc) >= need) {
          S.ctl.sel_b = (uint32_t)b;
          S.ctl.sel_above_c = (uint32_t)ac;
          S.ctl.sel_above_m = am;
          S.ctl.sel_cb = (uint32_t)bc;
          S.ctl.sel_mb = bm;
          break;
        }
        ac += bc;
        am += bm;
      }
    }
  }
  __syncthreads();
}

/* ---- the shared-memory list ------------------------------------------------------------------ */

/* Copies the candidates of the row with key >= lowkey to the list (at most kCap: the caller
 * knows the count from a histogram), in no particular order: slots are taken per warp with one
 * atomic. Returns the count, which is above kCap only if that bookkeeping is broken. */
__device__ int compact(Shared &S, const float *z, int V, bool vec, const Cand &c,
                       uint32_t lowkey) {
  __syncthreads();
  if (threadIdx.x == 0) S.ctl.list_n = 0;
  __syncthreads();
  const unsigned lt = (1u << lane_id()) - 1;
  for_units<2>(z, V, vec, [&](int i0, const float *v) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const uint32_t k = fkey(v[j]);
      const bool sel = v[j] >= c.lo && k >= lowkey;
      const unsigned bal = __ballot_sync(kFull, sel);
      if (!bal) continue;
      int base = 0;
      if (lane_id() == 0) base = atomicAdd(&S.ctl.list_n, __popc(bal));
      base = __shfl_sync(kFull, base, 0);
      const int pos = base + __popc(bal & lt);
      if (sel && pos < kCap) S.u.list[pos] = Ent{k, i0 + j};
    }
  });
  __syncthreads();
  return S.ctl.list_n;
}

/* ---- finding the token: the first kept id whose inclusive prefix mass exceeds x ------------- */

/* Over the list [0, n) (in no order): the kept mass per bucket of kBucket ids (32-bit atomics
 * as in hist_add), a block scan over the buckets, then the bucket holding x laid out by id in
 * S.slot (ids are unique) and scanned by one warp. Returns the id (-1 if none) and, in *incl,
 * the inclusive prefix mass at it. */
__device__ int find_list(Shared &S, int n, const Cand &c, const Keep &K, unsigned long long x,
                         unsigned long long *incl) {
  __syncthreads();
  if (threadIdx.x == 0) S.ctl.f_tile = -1, S.ctl.f_id = -1;
  for (int b = threadIdx.x; b < kBuckets; b += kThreads) S.bk_lo[b] = 0, S.bk_hi[b] = 0;
  for (int b = threadIdx.x; b < kBucket; b += kThreads) S.slot[b] = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const Ent E = S.u.list[e];
    if (!kept(K, E.key, E.id)) continue;
    const unsigned long long w = weight(c, key_float(E.key));
    const int b = E.id / kBucket;
    const uint32_t lo = (uint32_t)w, old = atomicAdd(&S.bk_lo[b], lo);
    const uint32_t hi = (uint32_t)(w >> 32) + (old + lo < old ? 1u : 0u);
    if (hi) atomicAdd(&S.bk_hi[b], hi);
  }
  __syncthreads();
  constexpr int g = kBuckets / kThreads;
  const int b0 = (int)threadIdx.x * g;
  unsigned long long m[g], own = 0;
#pragma unroll
  for (int j = 0; j < g; j++) {
    m[j] = ((unsigned long long)S.bk_hi[b0 + j] << 32) + S.bk_lo[b0 + j];
    own += m[j];
  }
  unsigned long long tot;
  const unsigned long long ex = block_scan_u64(S, own, &tot);
  if (own > 0 && ex <= x && x - ex < own) {
    unsigned long long cum = ex;
#pragma unroll
    for (int j = 0; j < g; j++) {
      if (x - cum < m[j]) {
        S.ctl.f_tile = b0 + j;
        S.ctl.f_base = cum;
        break;
      }
      cum += m[j];
    }
  }
  __syncthreads();
  const int B = S.ctl.f_tile;
  if (B >= 0) {
    for (int e = threadIdx.x; e < n; e += kThreads) {
      const Ent E = S.u.list[e];
      if (E.id / kBucket == B && kept(K, E.key, E.id))
        S.slot[E.id % kBucket] = weight(c, key_float(E.key));
    }
  }
  __syncthreads();
  if (warp_id() == 0 && B >= 0) {
    const int lane = lane_id();
    const unsigned long long base = S.ctl.f_base; /* <= x < base + the bucket's mass */
    constexpr int per = kBucket / 32;
    unsigned long long w[per], ls = 0;
#pragma unroll
    for (int j = 0; j < per; j++) ls += w[j] = S.slot[lane * per + j];
    const unsigned long long inc = warp_scan_u64(ls);
    const unsigned bal = __ballot_sync(kFull, x - base < inc);
    if (bal && lane == __ffs(bal) - 1) {
      unsigned long long cum = base + inc - ls;
      for (int j = 0; j < per; j++) {
        if (x - cum < w[j]) {
          S.ctl.f_id = B * kBucket + lane * per + j;
          S.ctl.f_incl = cum + w[j];
          break;
        }
        cum += w[j];
      }
    }
  }
  __syncthreads();
  *incl = S.ctl.f_incl;
  return S.ctl.f_id;
}

/* Kept weights of the four ids of unit q. */
__device__ __forceinline__ void unit_weights(const float *z, int V, bool vec, const Cand &c,
                                             const Keep &K, int q, unsigned long long w[4]) {
  float v[4];
  load4(z, q, V, vec, v);
#pragma unroll
  for (int j = 0; j < 4; j++)
    w[j] = v[j] >= c.lo && kept(K, fkey(v[j]), 4 * q + j) ? weight(c, v[j]) : 0ull;
}

/* Over the row: the mass of every tile of kTile ids (one warp's 32 units of a for_units step;
 * already in S.u.tile_mass when have_tiles, from hist_row over exactly these tokens), a block
 * scan over the tiles, and the rescan of the one tile that holds x by one warp. Same results as
 * find_list. */
__device__ int find_row(Shared &S, const float *z, int V, bool vec, const Cand &c, const Keep &K,
                        unsigned long long x, unsigned long long *incl, bool have_tiles) {
  __syncthreads();
  if (threadIdx.x == 0) S.ctl.f_tile = -1, S.ctl.f_id = -1;
  const int nt = (V + kTile - 1) / kTile;
  if (!have_tiles)
    for_units<2>(z, V, vec, [&](int i0, const float *v) {
      unsigned long long s = 0;
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (v[j] >= c.lo && kept(K, fkey(v[j]), i0 + j)) s += weight(c, v[j]);
      s = warp_sum_u64(s);
      const int tile = i0 / kTile;
      if (lane_id() == 0 && tile < nt) S.u.tile_mass[tile] = s;
    });
  __syncthreads();
  const int g = (nt + kThreads - 1) / kThreads;
  const int t0 = (int)threadIdx.x * g, t1 = min(t0 + g, nt);
  unsigned long long own = 0;
  for (int t = t0; t < t1; t++) own += S.u.tile_mass[t];
  unsigned long long tot;
  const unsigned long long ex = block_scan_u64(S, own, &tot);
  if (own > 0 && ex <= x && x - ex < own) {
    unsigned long long cum = ex;
    for (int t = t0; t < t1; t++) {
      const unsigned long long m = S.u.tile_mass[t];
      if (x - cum < m) {
        S.ctl.f_tile = t;
        S.ctl.f_base = cum;
        break;
      }
      cum += m;
    }
  }
  __syncthreads();
  if (warp_id() == 0 && S.ctl.f_tile >= 0) {
    const int t = S.ctl.f_tile, lane = lane_id();
    const unsigned long long base = S.ctl.f_base; /* <= x < base + the tile's mass */
    unsigned long long w[4];
    unit_weights(z, V, vec, c, K, t * (kTile / 4) + lane, w);
    const unsigned long long ls = w[0] + w[1] + w[2] + w[3];
    const unsigned long long inc = warp_scan_u64(ls);
    const unsigned bal = __ballot_sync(kFull, x - base < inc);
    if (bal && lane == __ffs(bal) - 1) {
      unsigned long long cum = base + inc - ls;
      for (int j = 0; j < 4; j++) {
        if (x - cum < w[j]) {
          S.ctl.f_id = t * kTile + lane * 4 + j;
          S.ctl.f_incl = cum + w[j];
          break;
        }
        cum += w[j];
      }
    }
  }
  __syncthreads();
  *incl = S.ctl.f_incl;
  return S.ctl.f_id;
}

/* ---- steps 4-5 for a sampled row ------------------------------------------------------------- */

/* ceil(top_p * M), within [1, M]. */
__device__ __forceinline__ unsigned long long mass_target(float top_p, unsigned long long M) {
  const double t = (double)top_p * (double)M;
  unsigned long long T = t >= (double)M ? M : __double2ull_ru(t);
  if (T > M) T = M;
  return T ? T : 1;
}

/* floor(u * K) for u in [0, 1): u's 53 bits times K, exactly. */
__device__ __forceinline__ unsigned long long draw_point(double u, unsigned long long K) {
  unsigned long long bits;
  if (!(u > 0.0))
    bits = 0;
  else if (u >= 1.0)
    bits = (1ull << 53) - 1;
  else
    bits = (unsigned long long)(u * 9007199254740992.0); /* 2^53 */
  return __umul64hi(bits << 11, K);
}

/* The token of a sampled row (temperature >= the greedy epsilon) whose edited logits are z and
 * whose max m is finite; -1 only if the bookkeeping fails (a bug). */
__device__ int sample_row(Shared &S, const float *z, int V, bool vec, const Row &R, float m,
                          bool hist0) {
  const float T = R.T;
  Cand c;
  c.m = m;
  c.invT = __fdiv_rn(1.0f, T);
  float lo = __fsub_rn(m, __fmul_rn(kCutoff, T));
  if (R.min_p > 0.0f) {
    const float lm = __fadd_rn(m, __fmul_rn(T, R.log_min_p)); /* p >= min_p * p_max */
    lo = lm > lo ? lm : lo;
  }
  if (!(lo > -FLT_MAX)) lo = -FLT_MAX; /* a huge T: still never keep -inf */
  c.lo = lo;
  c.fs = V >= kMaxVocab ? 43 : 44;
  const int k = R.top_k;
  const bool use_k = k > 0 && k < V, use_p = R.top_p < 1.0f;

  /* candidates: count, and (without top_k) mass; level-0 bins for the filters. With top_k, the
   * max pass counted every non-NaN token per level-0 bin: enough when more than k of them lie
   * in bins above the one of lo (all candidates) */
  uint32_t C = 0;
  unsigned long long M = 0;
  bool counted = false;
  if (hist0) {
    const uint32_t blo = fkey(lo) >> 24;
    if (warp_id() == 0) {
      uint32_t a = 0;
      for (uint32_t b = blo + 1 + lane_id(); b < 256; b += 32) a += S.hc[b];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(kFull, a, o);
      if (lane_id() == 0) S.ctl.above0 = a;
    }
    __syncthreads();
    if (S.ctl.above0 > (uint32_t)k) {
      C = S.ctl.above0; /* a lower bound of the candidates: more than k is what matters */
      counted = true;
    }
  }
  const bool tiles = !use_k && !use_p; /* the draw takes every candidate: tiles now */
  if (!counted)
    hist_row(S, z, V, vec, c, HistSpec{0, 0, 0, use_k || use_p, !use_k, tiles}, &C, &M);

  bool in_list = false;
  int list_n = 0;
  uint32_t thr = 0;      /* top_k: kept candidates have key >= thr */
  uint32_t n_kept = C;
  unsigned long long M_kept = M;

  if (use_k && C > (uint32_t)k) {
    unsigned long long need = (unsigned long long)k;
    uint32_t ge_above = 0, prefix = 0;
    for (int level = 0;; level++) {
      select_bin(S, false, need);
      if (!S.ctl.sel_ok) return -1;
      const uint32_t b = S.ctl.sel_b, ac = S.ctl.sel_above_c, cb = S.ctl.sel_cb;
      const uint32_t lowb = prefix | (b << (24 - 8 * level));
      const uint32_t ge = ge_above + ac + cb; /* candidates with key >= lowb */
      if (ac + cb == need || level == 3) {   /* bin b is kept whole (level 3: one value) */
        thr = lowb;
        n_kept = ge;
        break;
      }
      need -= ac;
      ge_above += ac;
      prefix = lowb;
      if (!in_list && ge <= (uint32_t)kCap) {
        list_n = compact(S, z, V, vec, c, lowb);
        if (list_n > kCap) return -1;
        in_list = true;
      }
      uint32_t cn;
      unsigned long long ms;
      const HistSpec h{0, level + 1, prefix, true, false, false};
      if (in_list)
        hist_list(S, list_n, c, h, &cn, &ms);
      else
        hist_row(S, z, V, vec, c, h, &cn, &ms);
    }
  }
  if (use_k) { /* mass of the kept set, and its level-0 bins for top_p */
    if (!in_list && n_kept <= (uint32_t)kCap) {
      list_n = compact(S, z, V, vec, c, thr);
      if (list_n > kCap) return -1;
      in_list = true;
    }
    uint32_t cn;
    const HistSpec h{thr, 0, 0, use_p, true, false};
    if (in_list)
      hist_list(S, list_n, c, h, &cn, &M_kept);
    else
      hist_row(S, z, V, vec, c, h, &cn, &M_kept);
  }

  Keep K{thr, 0xffffffffu, thr, INT_MAX};
  unsigned long long K_mass = M_kept;
  if (use_p) {
    unsigned long long rem = mass_target(R.top_p, M_kept), above = 0;
    uint32_t ge_above = 0, prefix = 0;
    for (int level = 0;; level++) {
      select_bin(S, true, rem);
      if (!S.ctl.sel_ok) return -1;
      const uint32_t b = S.ctl.sel_b, ac = S.ctl.sel_above_c, cb = S.ctl.sel_cb;
      const unsigned long long am = S.ctl.sel_above_m, mb = S.ctl.sel_mb;
      const uint32_t lowb = prefix | (b << (24 - 8 * level));
      rem -= am; /* >= 1: the mass still needed from bin b on */
      above += am;
      if (cb == 1) { /* one kept token in bin b: it and everything above */
        K.kt = lowb > thr ? lowb : thr;
        K_mass = above + mb;
        break;
      }
      if (level == 3) { /* cb tokens tied at the value lowb: take them in id order */
        const Keep ties{lowb, lowb, lowb, INT_MAX};
        unsigned long long inc;
        const int cid = in_list ? find_list(S, list_n, c, ties, rem - 1, &inc)
                                : find_row(S, z, V, vec, c, ties, rem - 1, &inc, false);
        if (cid < 0) return -1;
        K.kt = lowb;
        K.cid = cid;
        K_mass = above + inc;
        break;
      }
      ge_above += ac;
      prefix = lowb;
      if (!in_list && ge_above + cb <= (uint32_t)kCap) {
        list_n = compact(S, z, V, vec, c, lowb > thr ? lowb : thr);
        if (list_n > kCap) return -1;
        in_list = true;
      }
      uint32_t cn;
      unsigned long long ms;
      const HistSpec h{thr, level + 1, prefix, true, true, false};
      if (in_list)
        hist_list(S, list_n, c, h, &cn, &ms);
      else
        hist_row(S, z, V, vec, c, h, &cn, &ms);
    }
  }

  const unsigned long long xd = draw_point(R.u, K_mass);
  unsigned long long inc;
  return in_list ? find_list(S, list_n, c, K, xd, &inc)
                 : find_row(S, z, V, vec, c, K, xd, &inc, tiles);
}

/* ---- the kernel ------------------------------------------------------------------------------ */

__global__ void __launch_bounds__(kThreads, 1)
sample_kernel(const float *__restrict__ logits, int V, const Row *__restrict__ rows,
              const pd_dev_sample_edit *__restrict__ edits, float *scratch,
              pd_dev_sample_out *__restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared &S = *reinterpret_cast<Shared *>(smem);
  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id();
  const Row R = rows[blockIdx.x];
  pd_dev_sample_out *o = out + blockIdx.x;
  const float *x = logits + (size_t)R.row * (size_t)V;
  float *zs = R.slot >= 0 ? scratch + (size_t)R.slot * (size_t)V : nullptr;
  const bool want_lp = R.n_top >= 0;
  const int n_top = want_lp ? min(min(R.n_top, kMaxTop), V) : 0;
  const bool vec_x = (V & 3) == 0 && ((uintptr_t)x & 15) == 0;
  const bool vec_s = zs && (V & 3) == 0 && ((uintptr_t)zs & 15) == 0;

  /* raw statistics of this thread: online log-sum-exp, +inf seen, and the warp's top list
   * (lane j holds entry j; tcnt and the threshold (thv, thi) are warp-uniform) */
  float rm = -INFINITY;
  double rs = 0.0;
  bool rinf = false;
  float tv = -INFINITY, thv = -INFINITY;
  int ti = INT_MAX, thi = INT_MAX, tcnt = 0;

  auto top_offer = [&](bool valid, float v, int id) { /* warp-uniform */
    bool want = valid && (tcnt < n_top || before(v, id, thv, thi));
    unsigned mask = __ballot_sync(kFull, want);
    while (mask) {
      const int src = __ffs(mask) - 1;
      const float sv = __shfl_sync(kFull, v, src);
      const int si = __shfl_sync(kFull, id, src);
      const int pos = __popc(__ballot_sync(kFull, lane < tcnt && before(tv, ti, sv, si)));
      const float pv = __shfl_up_sync(kFull, tv, 1);
      const int pi = __shfl_up_sync(kFull, ti, 1);
      if (lane == pos) {
        tv = sv, ti = si;
      } else if (lane > pos) {
        tv = pv, ti = pi;
      }
      if (tcnt < n_top) tcnt++;
      if (tcnt == n_top) {
        thv = __shfl_sync(kFull, tv, n_top - 1);
        thi = __shfl_sync(kFull, ti, n_top - 1);
      }
      if (lane == src) want = false;
      want = want && (tcnt < n_top || before(v, id, thv, thi));
      mask = __ballot_sync(kFull, want);
    }
  };
  auto raw_unit = [&](int i0, const float *v) { /* four elements; warp-uniform */
    float um = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      if (v[j] == INFINITY)
        rinf = true;
      else if (v[j] > um) /* NaN fails */
        um = v[j];
    }
    if (um > rm) { /* a new running max: rescale what was summed */
      rs *= (double)__expf(rm - um);
      rm = um;
    }
    float s4 = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++)
      if (v[j] > -INFINITY && v[j] < INFINITY) s4 += __expf(v[j] - rm);
    rs += (double)s4;
    if (n_top > 0) {
      float tvj[4];
      bool any = false;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        tvj[j] = v[j] != v[j] ? -INFINITY : v[j];
        any |= i0 + j < V && (tcnt < n_top || before(tvj[j], i0 + j, thv, thi));
      }
      if (__any_sync(kFull, any))
#pragma unroll
        for (int j = 0; j < 4; j++) top_offer(i0 + j < V, tvj[j], i0 + j);
    }
  };

  /* 1. edits: copy the row (raw statistics on the way), then one thread per edit */
  if (zs) {
    auto copy_unit = [&](int i0, const float *v) {
      if (vec_s) {
        if (i0 < V) *reinterpret_cast<float4 *>(zs + i0) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
          if (i0 + j < V) zs[i0 + j] = v[j];
      }
    };
    if (want_lp)
      for_units<2>(x, V, vec_x, [&](int i0, const float *v) {
        copy_unit(i0, v);
        raw_unit(i0, v);
      });
    else
      for_units(x, V, vec_x, copy_unit);
    __syncthreads();
    for (int e = tid; e < R.edit_count; e += kThreads) {
      const pd_dev_sample_edit ed = edits[R.edit_begin + e];
      if (ed.id < 0 || ed.id >= V) continue;
      float zv = x[ed.id];
      if (ed.flags & PD_DEV_EDIT_SUPPRESS) zv = -INFINITY;
      if (ed.flags & PD_DEV_EDIT_BIAS) zv = __fadd_rn(zv, ed.bias);
      const float zb = zv;
      if ((ed.flags & PD_DEV_EDIT_SEEN) && R.rep != 1.0f)
        zv = zv > 0.0f ? __fdiv_rn(zv, R.rep) : __fmul_rn(zv, R.rep);
      if (ed.count > 0) {
        zv = __fsub_rn(zv, __fmul_rn(R.freq, __int2float_rn(ed.count)));
        zv = __fsub_rn(zv, R.pres);
      }
      if (zv == zb) zv = zb; /* apply_edits keeps an equal value (NaN compares unequal) */
      zs[ed.id] = zv;
    }
    __syncthreads();
  }
  const float *z = zs ? zs : x;
  const bool vec_z = zs ? vec_s : vec_x;

  /* 2. max and argmax of the edited row (raw statistics too when it is the raw row; for
   * top_k, the level-0 count histogram, good for every bin above the candidate threshold's) */
  const bool hist0 = !(R.T < kGreedyEps) && R.top_k > 0 && R.top_k < V;
  hist_zero(S, hist0);
  float m = -INFINITY;
  int am = INT_MAX;
  auto max_unit = [&](int i0, const float *v) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      if (v[j] > m) m = v[j], am = i0 + j; /* ids increase per thread: ties keep the first */
      if (hist0) hist_add(S, v[j] == v[j], fkey(v[j]) >> 24, 0, false);
    }
  };
  if (!zs && want_lp)
    for_units<2>(z, V, vec_z, [&](int i0, const float *v) {
      max_unit(i0, v);
      raw_unit(i0, v);
    });
  else
    for_units(z, V, vec_z, max_unit);
  block_argmax(S, m, am);

  double lse = 0.0;
  float mraw = -INFINITY;
  bool raw_ok = true;
  if (want_lp) {
    const bool any_inf = __syncthreads_or(rinf);
    float fm = rm;
    int fi = 0;
    block_argmax(S, fm, fi);
    mraw = fm;
    const double part = rm > -INFINITY ? rs * exp((double)rm - (double)mraw) : 0.0;
    const double sum = block_sum_d(S, part);
    raw_ok = !any_inf && mraw > -INFINITY;
    lse = (double)mraw + log(sum);
    if (n_top > 0) { /* merge the warp lists: n_top rounds of a warp argmax over their heads */
      if (lane < tcnt) S.u.top.v[warp][lane] = tv, S.u.top.id[warp][lane] = ti;
      if (lane == 0) S.u.top.cnt[warp] = tcnt;
      __syncthreads();
      if (warp == 0) {
        const int cnt = S.u.top.cnt[lane];
        int h = 0;
        for (int r = 0; r < n_top; r++) {
          const float cv = h < cnt ? S.u.top.v[lane][h] : -INFINITY;
          const int ci = h < cnt ? S.u.top.id[lane][h] : INT_MAX;
          float bv = cv;
          int bi = ci;
          warp_argmax(bv, bi);
          if (h < cnt && ci == bi) h++;
          if (lane == 0) S.top_v[r] = bv, S.top_i[r] = bi;
        }
      }
      __syncthreads();
    }
  }

  if (!(m > -INFINITY && m < INFINITY && raw_ok)) {
    if (tid == 0) {
      o->token = -1;
      o->logprob = 0.0f;
      o->rank = 0;
      o->n_top = 0;
    }
    return;
  }

  /* 3. the token */
  int token = R.T < kGreedyEps ? am : sample_row(S, z, V, vec_z, R, m, hist0);

  /* 4. logprobs of the raw row */
  int rank = 0;
  float xt = 0.0f;
  if (want_lp && token >= 0) {
    __syncthreads();
    if (tid == 0) {
      const float t = x[token];
      int r = -1; /* -1: count over the row */
      if (t >= mraw) {
        r = 1;
      } else if (n_top > 0 && t >= S.top_v[n_top - 1]) { /* every larger value is listed */
        r = 1;
        for (int j = 0; j < n_top; j++) r += S.top_v[j] > t;
      }
      S.ctl.xt = t;
      S.ctl.rank = r;
    }
    __syncthreads();
    xt = S.ctl.xt;
    rank = S.ctl.rank;
    if (rank < 0) {
      unsigned long long g = 0;
      for_units(x, V, vec_x, [&](int, const float *v) {
#pragma unroll
        for (int j = 0; j < 4; j++) g += v[j] > xt; /* NaN counts as -inf */
      });
      rank = 1 + (int)block_sum_u64(S, g);
    }
  }
  if (tid == 0) {
    o->token = token;
    if (want_lp && token >= 0) {
      o->logprob = (float)((double)xt - lse);
      o->rank = rank;
      o->n_top = n_top;
      for (int j = 0; j < n_top; j++) {
        o->top_id[j] = S.top_i[j];
        o->top_logprob[j] = (float)((double)S.top_v[j] - lse);
      }
    } else {
      o->logprob = 0.0f;
      o->rank = 0;
      o->n_top = 0;
    }
  }
}

/* ---- greedy fast path ------------------------------------------------------------------------
 * A call of at most kFastRows rows, every one greedy without edits or logprobs (a decode step
 * with default penalties): the argmax of each row is spread over `chunks` blocks (fast_chunks:
 * 64 for up to 64 rows, fewer for more rows, so that a call is a few thousand blocks) instead of
 * one, the rows' ids travel in the launch parameters and the outputs are written straight into
 * the mapped staging memory, so the call needs no copies. The result is the sample kernel's: the
 * first largest value (NaN skipped), token -1 when that is not finite. Each block reduces its
 * chunk and leaves (max, id); the last block of a row to finish (a counter per row, reset by
 * that block for the next call) reduces the chunks in order. (H200, Llama-3-8B, 256 greedy rows
 * of 128k: the general kernel, one 1024-thread block a row with the specs' and outputs' copies,
 * took ~88 us of the decode step's tail.) */
constexpr int kFastRows = 512, kFastChunks = 64, kFastThreads = 256;
int fast_chunks(int n) {
  const int c = 4096 / (n > 0 ? n : 1);
  return c < 4 ? 4 : c > kFastChunks ? kFastChunks : c;
}

struct FastRows {
  int32_t row[kFastRows];
};

struct FastScratch {
  unsigned int count[kFastRows];
  float v[kFastRows][kFastChunks];
  int32_t id[kFastRows][kFastChunks];
};

__global__ void __launch_bounds__(kFastThreads)
greedy_kernel(const float *__restrict__ logits, int V, const __grid_constant__ FastRows rows,
              int chunks, FastScratch *fs, pd_dev_sample_out *__restrict__ out) {
  __shared__ float sv[kFastThreads / 32];
  __shared__ int si[kFastThreads / 32];
  __shared__ bool last;
  const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
  const float *x = logits + (size_t)rows.row[r] * (size_t)V;
  const int per = ((V + chunks - 1) / chunks + 3) & ~3;
  const int lo = c * per, hi = lo + per < V ? lo + per : V;
  float m = -INFINITY;
  int am = INT_MAX;
  if (((uintptr_t)x & 15) == 0) {
    for (int i = lo + tid * 4; i < hi; i += kFastThreads * 4) {
      if (i + 4 <= hi) {
        const float4 t = __ldg(reinterpret_cast<const float4 *>(x + i));
        if (t.x > m) m = t.x, am = i;
        if (t.y > m) m = t.y, am = i + 1;
        if (t.z > m) m = t.z, am = i + 2;
        if (t.w > m) m = t.w, am = i + 3;
      } else {
        for (int j = i; j < hi; j++)
          if (x[j] > m) m = x[j], am = j;
      }
    }
  } else {
    for (int i = lo + tid; i < hi; i += kFastThreads)
      if (x[i] > m) m = x[i], am = i;
  }
  warp_argmax(m, am);
  if (lane_id() == 0) sv[warp_id()] = m, si[warp_id()] = am;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kFastThreads / 32; w++)
      if (before(sv[w], si[w], m, am)) m = sv[w], am = si[w];
    fs->v[r][c] = m;
    fs->id[r][c] = am;
    __threadfence();
    last = atomicAdd(&fs->count[r], 1u) == (unsigned)chunks - 1;
  }
  __syncthreads();
  if (!last || tid >= 32) return;
  __threadfence();
  m = -INFINITY;
  am = INT_MAX;
  for (int k = tid; k < chunks; k += 32) {
    const float v = __ldcg(&fs->v[r][k]);
    const int id = __ldcg(&fs->id[r][k]);
    if (before(v, id, m, am)) m = v, am = id;
  }
  warp_argmax(m, am);
  if (tid == 0) {
    fs->count[r] = 0;
    pd_dev_sample_out *o = out + r;
    o->token = m > -INFINITY && m < INFINITY ? am : -1;
    o->logprob = 0.0f;
    o->rank = 0;
    o->n_top = 0;
  }
}

/* ---- host side ------------------------------------------------------------------------------- */

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* The kernel's shared memory is above the 48 KiB default. */
bool ensure_smem_attr(cuda_impl *c) {
  return CK(c, pd_cuda_smem_optin((const void *)sample_kernel, sizeof(Shared)));
}

/* Pinned staging of at least `bytes`; grown (after a sync) only when a call needs more. */
bool grow_host(cuda_impl *c, size_t bytes) {
  if (bytes <= c->smp_host_size) return true;
  bytes += bytes / 4;
  if (c->smp_host) {
    CK(c, cudaStreamSynchronize(c->st));
    CK(c, cudaFreeHost(c->smp_host));
    c->smp_host = NULL;
    c->smp_host_size = 0;
  }
  void *p = NULL;
  /* mapped where the platform allows (the greedy fast path writes there), else plain pinned */
  if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped) != cudaSuccess) {
    cudaGetLastError();
    p = NULL;
    if (!CK(c, cudaHostAlloc(&p, bytes, cudaHostAllocDefault))) return false;
  }
  c->smp_host = p;
  c->smp_host_size = bytes;
  return true;
}

void fail_all(pd_dev_sample_out *out, int n) {
  for (int i = 0; i < n; i++) {
    memset(&out[i], 0, sizeof out[i]);
    out[i].token = -1;
  }
}

void cu_sample(pd_backend *be, pd_dev_sample_out *out, const float *logits, int vocab,
               const pd_dev_sample_spec *specs, int n, const pd_dev_sample_edit *edits,
               int n_edits) {
  cuda_impl *c = impl_of(be);
  PD_ASSERT(n >= 0 && n_edits >= 0);
  if (n == 0) return;
  PD_ASSERT(out && specs && logits);
  PD_ASSERT(vocab > 0 && vocab <= kMaxVocab && "cuda sample: vocabulary above 2^20");
  PD_ASSERT(n_edits == 0 || edits);
  PD_ASSERT(!c->capturing && "cuda sample: not capturable (it waits for its results)");
  for (int i = 0; i < n; i++) {
    const pd_dev_sample_spec *s = &specs[i];
    PD_ASSERT(s->row >= 0 && s->n_top >= -1 && s->n_top <= PD_DEV_SAMPLE_MAX_TOP);
    PD_ASSERT(s->edit_count >= 0 && s->edit_begin >= 0 &&
              (int64_t)s->edit_begin + s->edit_count <= n_edits);
  }
  for (int i = 0; i < n_edits; i++) PD_ASSERT(edits[i].id >= 0 && edits[i].id < vocab);
  pd_cuda_use_device(c);
  if (!ensure_smem_attr(c)) {
    fail_all(out, n);
    return;
  }

  /* staging: [rows][edits][out] on both sides; the scratch rows after them on the device */
  const size_t rows_b = round_up((size_t)n * sizeof(Row), 256);
  const size_t edits_b = round_up((size_t)n_edits * sizeof(pd_dev_sample_edit), 256);
  const size_t out_b = round_up((size_t)n * sizeof(pd_dev_sample_out), 256);
  const size_t row_bytes = round_up((size_t)vocab * sizeof(float), 256);
  int n_edited = 0;
  for (int i = 0; i < n; i++) n_edited += specs[i].edit_count > 0;
  size_t per_launch = kScratchBudget / row_bytes;
  if (per_launch < 1) per_launch = 1;
  const int slots = (size_t)n_edited < per_launch ? n_edited : (int)per_launch;
  if (!grow_host(c, rows_b + edits_b + out_b)) {
    fail_all(out, n);
    return;
  }
  pd_cuda_grow(c, &c->smp_dev, &c->smp_dev_size,
               rows_b + edits_b + out_b + (size_t)slots * row_bytes, false);
  char *hb = static_cast<char *>(c->smp_host), *db = static_cast<char *>(c->smp_dev);
  Row *hr = reinterpret_cast<Row *>(hb);
  pd_dev_sample_out *ho = reinterpret_cast<pd_dev_sample_out *>(hb + rows_b + edits_b);
  const Row *dr = reinterpret_cast<const Row *>(db);
  const pd_dev_sample_edit *de = reinterpret_cast<const pd_dev_sample_edit *>(db + rows_b);
  pd_dev_sample_out *dout = reinterpret_cast<pd_dev_sample_out *>(db + rows_b + edits_b);
  float *dscr = reinterpret_cast<float *>(db + rows_b + edits_b + out_b);

  int edited = 0;
  for (int i = 0; i < n; i++) {
    const pd_dev_sample_spec *s = &specs[i];
    Row r;
    memset(&r, 0, sizeof r);
    r.row = s->row;
    r.top_k = s->top_k;
    r.n_top = s->n_top;
    r.edit_begin = s->edit_begin;
    r.edit_count = s->edit_count;
    r.slot = s->edit_count > 0 ? edited++ % slots : -1;
    r.T = s->temperature;
    r.top_p = s->top_p;
    r.min_p = s->min_p;
    r.log_min_p = s->min_p > 0.0f ? logf(s->min_p) : 0.0f;
    r.rep = s->rep_penalty;
    r.freq = s->freq_penalty;
    r.pres = s->pres_penalty;
    r.u = s->u;
    hr[i] = r;
  }
  /* greedy rows without edits or logprobs: the multi-block argmax (H200, Llama-3-8B batch 1: a
   * greedy step 4.18 -> 4.16 ms with it, the op 24 -> 13 us) */
  bool fast = n <= kFastRows && n_edits == 0;
  for (int i = 0; fast && i < n; i++)
    fast = specs[i].temperature < kGreedyEps && specs[i].n_top < 0 && specs[i].edit_count == 0;
  pd_dev_sample_out *hout = NULL; /* the device's address of the outputs' staging */
  if (fast && cudaHostGetDevicePointer((void **)&hout, ho, 0) != cudaSuccess) {
    cudaGetLastError(); /* not mapped: the general path */
    fast = false;
  }
  if (fast && !c->smp_greedy) {
    if (!CK(c, cudaMalloc(&c->smp_greedy, sizeof(FastScratch))) ||
        !CK(c, cudaMemsetAsync(c->smp_greedy, 0, sizeof(FastScratch), c->st))) {
      fail_all(out, n);
      return;
    }
  }
  if (fast) {
    FastRows fr;
    memset(&fr, 0, sizeof fr);
    for (int i = 0; i < n; i++) fr.row[i] = specs[i].row;
    const int chunks = fast_chunks(n);
    greedy_kernel<<<dim3((unsigned)chunks, (unsigned)n), kFastThreads, 0, c->st>>>(
        logits, vocab, fr, chunks, static_cast<FastScratch *>(c->smp_greedy), hout);
    bool ok = CK_LAUNCH(c, "sample (greedy)");
    ok = CK(c, cudaStreamSynchronize(c->st)) && ok;
    if (!ok) {
      fail_all(out, n);
      return;
    }
    memcpy(out, ho, (size_t)n * sizeof(pd_dev_sample_out));
    return;
  }
  if (n_edits > 0) memcpy(hb + rows_b, edits, (size_t)n_edits * sizeof(pd_dev_sample_edit));
  bool ok = CK(c, cudaMemcpyAsync(db, hb, rows_b + edits_b, cudaMemcpyHostToDevice, c->st));
  /* launches: a new one after every `slots` edited rows (their scratch rows are reused) */
  const size_t smem = sizeof(Shared);
  int start = 0;
  for (int i = 0; ok && i < n; i++) {
    if (i + 1 < n && !(hr[i].slot >= 0 && hr[i].slot == slots - 1)) continue;
    sample_kernel<<<i + 1 - start, kThreads, smem, c->st>>>(logits, vocab, dr + start, de, dscr,
                                                            dout + start);
    ok = CK_LAUNCH(c, "sample");
    start = i + 1;
  }
  ok = ok && CK(c, cudaMemcpyAsync(ho, dout, (size_t)n * sizeof(pd_dev_sample_out),
                                   cudaMemcpyDeviceToHost, c->st));
  ok = CK(c, cudaStreamSynchronize(c->st)) && ok;
  if (!ok) {
    fail_all(out, n);
    return;
  }
  memcpy(out, ho, (size_t)n * sizeof(pd_dev_sample_out));
}

} // namespace

void pd_cuda_register_sample(pd_backend *be) { be->ops.sample = PD_CUDA_GUARD(cu_sample); }
