/* Every CPU compute kernel, written once over a small vector vocabulary.
 *
 * Included by cpu_avx512.c, cpu_avx2.c and cpu_generic.c after they define, for their ISA:
 *   VL, vf                        floats per vector, the vector type (VL == 1: plain float)
 *   V_ZERO() V_SET1(s) V_LOAD(p) V_STORE(p,v)            unaligned full-width access
 *   V_LOAD_N(p,n) V_STORE_N(p,v,n)                       first n (0..VL) lanes; the rest of a load
 *                                                        is zero and no byte past p+n is touched
 *   V_ADD V_SUB V_MUL V_DIV V_MAX, V_FMA(a,b,c) = a*b+c, V_FNMA(a,b,c) = c-a*b
 *   V_HSUM(v) V_HMAX(v)           horizontal sum / max to a float
 *   V_EXP(v)                      e^x within 2 ulp for x <= 88 (clamped above 88); exactly 0
 *                                 below -87.33, so e^-inf == 0
 *   V_LOAD_BF16(p) V_LOAD_F16(p) V_LOAD_BF16_N(p,n) V_LOAD_F16_N(p,n)   exact widening loads
 *   V_LOAD_BF16_PAIR(p,lo,hi)     2*VL bf16 -> lo = elements 0,2,4,.. hi = elements 1,3,5,..
 *   V_LOAD_Q4_PAIR(p,lo,hi)       VL bytes of 4-bit values -> lo = low nibbles, hi = high ones
 *   V_LOAD_E4M3(p)                VL bytes of FP8 e4m3 -> VL floats, exact
 *   V_DEINTERLEAVE(a,b,ev,od)     32-bit lanes of (a,b) = x[0..2VL): ev = x[0,2,..], od = x[1,3,..]
 *   v_transpose(vf r[VL])         in-register VL x VL transpose
 *   v_hsum4(a,b,c,d,out)          out[0..3] = horizontal sums of a..d
 *   V_BLEND_LT(a,b,x,y)           lane-wise a < b ? x : y
 *   V_KEEP(v)                     keeps v in a register: stops the compiler from folding a load
 *                                 that feeds several FMAs into each of them (which would turn
 *                                 one load into several and make the loop load-bound)
 * and the tuning constants MM_MR, MM_NV, MM_KC, GV_R1..GV_R4, GV_MAX_M, AT_KBV, AT_QB, AT_SQ, AT_PQ,
 * AT_PD, AL_PD, plus KERN_SYM (the exported table) and KERN_NAME.
 *
 * Numerics: weights and KV are widened exactly to float32 in registers; every product and sum is
 * float32 (FMA where the ISA has it). Nothing is rounded to a narrower type. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#define AI static inline __attribute__((always_inline))
#define MM_NR (MM_NV * VL) /* GEMM panel width (output features) */
#define AT_KB (AT_KBV * VL) /* attention key block */

/* ================================================================================================
 * Widening loads by dtype (dt is a compile-time constant wherever these are inlined).
 * ============================================================================================== */

/* Bytes per element of a weight/KV dtype (F32, F16, BF16; F8_E4M3 for KV caches), inlinable in
 * hot loops. */
AI size_t dt_size(pd_dtype dt) {
  return dt == PD_DTYPE_F32 ? 4 : dt == PD_DTYPE_F8_E4M3 ? 1 : 2;
}

AI vf load_dt(const void *base, size_t i, pd_dtype dt) {
  if (dt == PD_DTYPE_F32) return V_LOAD((const float *)base + i);
  if (dt == PD_DTYPE_BF16) return V_LOAD_BF16((const uint16_t *)base + i);
  if (dt == PD_DTYPE_F8_E4M3) return V_LOAD_E4M3((const uint8_t *)base + i);
  return V_LOAD_F16((const uint16_t *)base + i);
}

AI vf load_dt_n(const void *base, size_t i, int n, pd_dtype dt) {
  if (dt == PD_DTYPE_F32) return V_LOAD_N((const float *)base + i, n);
  if (dt == PD_DTYPE_BF16) return V_LOAD_BF16_N((const uint16_t *)base + i, n);
  if (dt == PD_DTYPE_F8_E4M3) { /* n < VL bytes: through a zeroed copy */
    uint8_t t[VL > 16 ? VL : 16] = {0};
    memcpy(t, (const uint8_t *)base + i, (size_t)n);
    return V_LOAD_E4M3(t);
  }
  return V_LOAD_F16_N((const uint16_t *)base + i, n);
}

AI float scalar_dt(const void *base, size_t i, pd_dtype dt) {
  if (dt == PD_DTYPE_F32) return ((const float *)base)[i];
  if (dt == PD_DTYPE_BF16) return pd_bf16_to_f32(((const uint16_t *)base)[i]);
  if (dt == PD_DTYPE_F8_E4M3) return pd_e4m3_to_f32(((const uint8_t *)base)[i]);
  return pd_f16_to_f32(((const uint16_t *)base)[i]);
}

static void k_to_f32(float *dst, const void *src, pd_dtype dt, size_t n) {
  if (dt == PD_DTYPE_F32) {
    memcpy(dst, src, n * sizeof(float));
    return;
  }
  size_t i = 0;
  if (dt == PD_DTYPE_BF16) {
    for (; i + VL <= n; i += VL) V_STORE(dst + i, load_dt(src, i, PD_DTYPE_BF16));
    if (i < n) V_STORE_N(dst + i, load_dt_n(src, i, (int)(n - i), PD_DTYPE_BF16), (int)(n - i));
  } else if (dt == PD_DTYPE_F8_E4M3) {
    for (; i + VL <= n; i += VL) V_STORE(dst + i, load_dt(src, i, PD_DTYPE_F8_E4M3));
    for (; i < n; i++) dst[i] = pd_e4m3_to_f32(((const uint8_t *)src)[i]);
  } else {
    for (; i + VL <= n; i += VL) V_STORE(dst + i, load_dt(src, i, PD_DTYPE_F16));
    if (i < n) V_STORE_N(dst + i, load_dt_n(src, i, (int)(n - i), PD_DTYPE_F16), (int)(n - i));
  }
}

/* ================================================================================================
 * Element-wise row kernels.
 * ============================================================================================== */

static void k_add(float *y, const float *x, size_t n) {
  size_t i = 0;
  for (; i + 4 * VL <= n; i += 4 * VL) {
    vf a0 = V_ADD(V_LOAD(y + i), V_LOAD(x + i));
    vf a1 = V_ADD(V_LOAD(y + i + VL), V_LOAD(x + i + VL));
    vf a2 = V_ADD(V_LOAD(y + i + 2 * VL), V_LOAD(x + i + 2 * VL));
    vf a3 = V_ADD(V_LOAD(y + i + 3 * VL), V_LOAD(x + i + 3 * VL));
    V_STORE(y + i, a0);
    V_STORE(y + i + VL, a1);
    V_STORE(y + i + 2 * VL, a2);
    V_STORE(y + i + 3 * VL, a3);
  }
  for (; i + VL <= n; i += VL) V_STORE(y + i, V_ADD(V_LOAD(y + i), V_LOAD(x + i)));
  if (i < n) {
    int r = (int)(n - i);
    V_STORE_N(y + i, V_ADD(V_LOAD_N(y + i, r), V_LOAD_N(x + i, r)), r);
  }
}

/* Sum of squares of x[0..D) in four vector partial sums. */
static float sumsq(const float *x, int D) {
  vf s0 = V_ZERO(), s1 = V_ZERO(), s2 = V_ZERO(), s3 = V_ZERO();
  int i = 0;
  for (; i + 4 * VL <= D; i += 4 * VL) {
    vf a = V_LOAD(x + i), b = V_LOAD(x + i + VL), c = V_LOAD(x + i + 2 * VL),
       d = V_LOAD(x + i + 3 * VL);
    s0 = V_FMA(a, a, s0);
    s1 = V_FMA(b, b, s1);
    s2 = V_FMA(c, c, s2);
    s3 = V_FMA(d, d, s3);
  }
  for (; i + VL <= D; i += VL) {
    vf a = V_LOAD(x + i);
    s0 = V_FMA(a, a, s0);
  }
  if (i < D) {
    vf a = V_LOAD_N(x + i, D - i);
    s1 = V_FMA(a, a, s1);
  }
  return V_HSUM(V_ADD(V_ADD(s0, s1), V_ADD(s2, s3)));
}

/* y = x * inv * w, the last step of RMSNorm (same order as Hugging Face: (x * rsqrt) * w). */
static void scale_mul(float *y, const float *x, float inv, const float *w, int D) {
  vf s = V_SET1(inv);
  int i = 0;
  for (; i + VL <= D; i += VL) V_STORE(y + i, V_MUL(V_MUL(V_LOAD(x + i), s), V_LOAD(w + i)));
  if (i < D) V_STORE_N(y + i, V_MUL(V_MUL(V_LOAD_N(x + i, D - i), s), V_LOAD_N(w + i, D - i)), D - i);
}

static void k_rmsnorm(float *y, const float *x, const float *w, float eps, int D) {
  float ms = sumsq(x, D) / (float)D;
  scale_mul(y, x, 1.0f / sqrtf(ms + eps), w, D);
}

static void k_add_rmsnorm(float *y, float *x, const float *r, const float *w, float eps, int D) {
  k_add(x, r, (size_t)D);
  k_rmsnorm(y, x, w, eps, D);
}

/* y[f] = silu(g[f]) * u[f] with g = gu[0..F), u = gu[F..2F); silu(g) = g / (1 + e^-g). */
static void k_swiglu(float *y, const float *gu, int F) {
  const float *g = gu, *u = gu + F;
  vf one = V_SET1(1.0f), zero = V_ZERO();
  int i = 0;
  for (; i + VL <= F; i += VL) {
    vf gv = V_LOAD(g + i);
    vf s = V_DIV(gv, V_ADD(one, V_EXP(V_SUB(zero, gv))));
    V_STORE(y + i, V_MUL(s, V_LOAD(u + i)));
  }
  if (i < F) {
    int n = F - i;
    vf gv = V_LOAD_N(g + i, n);
    vf s = V_DIV(gv, V_ADD(one, V_EXP(V_SUB(zero, gv))));
    V_STORE_N(y + i, V_MUL(s, V_LOAD_N(u + i, n)), n);
  }
}

/* Rotate-half RoPE on one token: x [n_heads, head_dim]; cs = cos[half] then sin[half]. */
static void k_rope(float *x, int n_heads, int head_dim, const float *cs) {
  int half = head_dim / 2;
  const float *cs_cos = cs, *cs_sin = cs + half;
  for (int h = 0; h < n_heads; h++) {
    float *a = x + (size_t)h * head_dim, *b = a + half;
    int i = 0;
    for (; i + VL <= half; i += VL) {
      vf c = V_LOAD(cs_cos + i), s = V_LOAD(cs_sin + i);
      vf x1 = V_LOAD(a + i), x2 = V_LOAD(b + i);
      V_STORE(a + i, V_FNMA(x2, s, V_MUL(x1, c)));
      V_STORE(b + i, V_FMA(x1, s, V_MUL(x2, c)));
    }
    if (i < half) {
      int n = half - i;
      vf c = V_LOAD_N(cs_cos + i, n), s = V_LOAD_N(cs_sin + i, n);
      vf x1 = V_LOAD_N(a + i, n), x2 = V_LOAD_N(b + i, n);
      V_STORE_N(a + i, V_FNMA(x2, s, V_MUL(x1, c)), n);
      V_STORE_N(b + i, V_FMA(x1, s, V_MUL(x2, c)), n);
    }
  }
}

/* ================================================================================================
 * GEMV: y[M,N] = x[M,K] W[N,K]^T for a few rows of x. Streams W once per pass of up to four x rows,
 * several W rows at a time, one accumulator per (x row, W row); horizontal sums at the end.
 * bf16 W is widened two vectors at a time (even and odd elements: one shift, one and), so x is
 * first reordered the same way (k_gemv_prep); f32/f16 W keep natural order.
 * ============================================================================================== */

static const float *k_gemv_prep(float *xp, const float *x, pd_dtype wdt, int M, int K) {
  if (wdt != PD_DTYPE_BF16 && wdt != PD_DTYPE_Q4) return x;
  int K2 = K / (2 * VL) * (2 * VL);
  for (int m = 0; m < M; m++) {
    const float *src = x + (size_t)m * K;
    float *dst = xp + (size_t)m * K;
    for (int k = 0; k < K2; k += 2 * VL) {
      vf ev, od;
      V_DEINTERLEAVE(V_LOAD(src + k), V_LOAD(src + k + VL), ev, od);
      V_STORE(dst + k, ev);
      V_STORE(dst + k + VL, od);
    }
    if (K2 < K) memcpy(dst + K2, src + K2, (size_t)(K - K2) * sizeof(float));
  }
  return xp;
}

AI void gv_load2(const void *w, size_t i, pd_dtype dt, vf *lo, vf *hi) {
  if (dt == PD_DTYPE_BF16) {
    V_LOAD_BF16_PAIR((const uint16_t *)w + i, *lo, *hi);
  } else {
    *lo = load_dt(w, i, dt);
    *hi = load_dt(w, i + VL, dt);
  }
}

/* The end of a GEMV block: y[m, n + r] = sum of acc[m * R + r] (times rs[r] where rs is given:
 * a row scale), plus bias. */
AI void gv_finish(float *y, const vf *acc, const float *bias, const float *rs, int M, int R,
                  int N, int n) {
  float s[16];
  int f = 0;
#pragma GCC unroll 4
  for (; f + 4 <= M * R; f += 4) v_hsum4(acc[f], acc[f + 1], acc[f + 2], acc[f + 3], s + f);
#pragma GCC unroll 4
  for (; f < M * R; f++) s[f] = V_HSUM(acc[f]);
#pragma GCC unroll 8
  for (int m = 0; m < M; m++) {
    float *yr = y + (size_t)m * N + n;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const float v = rs ? s[m * R + r] * rs[r] : s[m * R + r];
      yr[r] = bias ? v + bias[n + r] : v;
    }
  }
}

/* y[m, n + r] for m < M, r < R (both compile-time, M * R <= 16). xp rows and W rows have K
 * elements. */
AI void gv_block(float *y, const float *xp, const void *w, pd_dtype dt, const float *bias, int M,
                 int R, int N, int K, int n) {
  vf acc[16];
#pragma GCC unroll 16
  for (int f = 0; f < M * R; f++) acc[f] = V_ZERO();
  const int K2 = K / (2 * VL) * (2 * VL);
  const size_t wrow = (size_t)n * K;
  for (int k = 0; k < K2; k += 2 * VL) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      vf wl, wh;
      /* Prefetch the same column of the next group of R rows: R short rows read side by side
       * are too many interleaved streams for the hardware prefetcher (+25-45% when W streams
       * from L3 or DRAM, as in decode). Once per cache line; not worth it for scalar code.
       * Integer arithmetic: the address may lie past W. */
      if (VL >= 8 && (2 * VL * dt_size(dt) >= 64 || ((k * dt_size(dt)) & 63) == 0))
        __builtin_prefetch(
            (const void *)((uintptr_t)w + (wrow + (size_t)(r + R) * K + k) * dt_size(dt)), 0, 3);
      gv_load2(w, wrow + (size_t)r * K + k, dt, &wl, &wh);
#pragma GCC unroll 8
      for (int m = 0; m < M; m++) {
        acc[m * R + r] = V_FMA(wl, V_LOAD(xp + (size_t)m * K + k), acc[m * R + r]);
        acc[m * R + r] = V_FMA(wh, V_LOAD(xp + (size_t)m * K + k + VL), acc[m * R + r]);
      }
    }
  }
  if (K2 < K) { /* tail: natural order in both x and W */
    int rem = K - K2, n1 = rem < VL ? rem : VL, n2 = rem - n1;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      vf wl = load_dt_n(w, wrow + (size_t)r * K + K2, n1, dt);
      vf wh = load_dt_n(w, wrow + (size_t)r * K + K2 + VL, n2, dt);
#pragma GCC unroll 8
      for (int m = 0; m < M; m++) {
        acc[m * R + r] = V_FMA(wl, V_LOAD_N(xp + (size_t)m * K + K2, n1), acc[m * R + r]);
        acc[m * R + r] = V_FMA(wh, V_LOAD_N(xp + (size_t)m * K + K2 + VL, n2), acc[m * R + r]);
      }
    }
  }
  gv_finish(y, acc, bias, NULL, M, R, N, n);
}

/* Rows [n0, n1) for x rows [0, M) (one pass of at most 4), W dtype fixed. */
AI void gv_rows(float *y, const float *xp, const void *w, pd_dtype dt, const float *bias, int M,
                int R, int N, int K, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R) gv_block(y, xp, w, dt, bias, M, R, N, K, n);
  for (; n < n1; n++) gv_block(y, xp, w, dt, bias, M, 1, N, K, n);
}

/* Passes of at most four x rows: more rows per pass would need more accumulators than there are
 * registers. W is swept in blocks of GV_NB rows (48-128 KiB of bf16 at K = 384-1024) with every
 * pass run on one block before the next, so the passes after the first re-read W from L1/L2
 * whatever the task size (decode batches of up to GV_MAX_M sequences run here). */
#define GV_NB 64
AI void gv_dt(float *y, const float *xp, const void *w, pd_dtype dt, const float *bias, int M,
              int N, int K, int n0_, int n1_) {
  const int passes = (M + 3) / 4;
  const size_t rb = (size_t)K * dt_size(dt);
  for (int n0 = n0_; n0 < n1_; n0 += GV_NB) {
  const int n1 = n1_ - n0 < GV_NB ? n1_ : n0 + GV_NB;
  const int nn = n1_ - n1 < GV_NB ? n1_ - n1 : GV_NB; /* rows of the next block */
  for (int m0 = 0; m0 < M; m0 += 4) {
    /* Several passes: each pulls its share of the next block's W into L2 (the first pass over a
     * block streams from DRAM in decode; the in-pass prefetch runs only a few rows ahead). */
    if (VL >= 8 && passes > 1 && nn > 0) {
      int pi = m0 / 4, per = (nn + passes - 1) / passes;
      int r0 = pi * per, r1 = r0 + per < nn ? r0 + per : nn;
      for (int r = r0; r < r1; r++)
        for (size_t b = 0; b < rb; b += 64)
          __builtin_prefetch((const char *)w + (size_t)(n1 + r) * rb + b, 0, 2);
    }
    int mp = M - m0 < 4 ? M - m0 : 4;
    float *ym = y + (size_t)m0 * N;
    const float *xm = xp + (size_t)m0 * K;
    switch (mp) {
    case 1: gv_rows(ym, xm, w, dt, bias, 1, GV_R1, N, K, n0, n1); break;
    case 2: gv_rows(ym, xm, w, dt, bias, 2, GV_R2, N, K, n0, n1); break;
    case 3: gv_rows(ym, xm, w, dt, bias, 3, GV_R3, N, K, n0, n1); break;
    default: gv_rows(ym, xm, w, dt, bias, 4, GV_R4, N, K, n0, n1); break;
    }
  }
  }
}

/* ---- 4-bit weights (PD_DTYPE_Q4) ----
 * A row: K / 2 bytes of values, then K / 32 (f16 scale, f16 zero) pairs. The VL bytes of a 2 * VL
 * chunk hold its even elements in their low nibbles and its odd ones in their high nibbles: the
 * order k_gemv_prep gives x (as for bf16), so a chunk is two vectors of values, each widened,
 * offset by the block's zero and scaled in registers, then an FMA with x as for float W. */

/* f16 -> f32, exact (normals, subnormals, infinities, NaN): F16C where the ISA has it. */
#if VL > 1
AI float q4_f16(uint16_t h) { return _cvtsh_ss(h); }
#else
AI float q4_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (ex == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (ex) {
    u = sign | ((ex + 112u) << 23) | (man << 13);
  } else {
    float f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24 */
    memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#endif

AI size_t q4_row_bytes(int K) { return (size_t)K / 2 + (size_t)K / 8; }

AI void gq_block(float *y, const float *xp, const uint8_t *w, const float *bias, int M, int R,
                 int N, int K, int n) {
  vf acc[16];
#pragma GCC unroll 16
  for (int f = 0; f < M * R; f++) acc[f] = V_ZERO();
  const size_t rb = q4_row_bytes(K);
  const int nblk = K / PD_Q4_BLOCK;
  for (int b = 0; b < nblk; b++) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const uint8_t *row = w + (size_t)(n + r) * rb;
      uint16_t sz[2];
      memcpy(sz, row + (size_t)K / 2 + (size_t)b * 4, 4);
      const vf s = V_SET1(q4_f16(sz[0])), z = V_SET1(q4_f16(sz[1]));
      if (VL >= 8) __builtin_prefetch(row + rb + (size_t)b * 16, 0, 3); /* the next row's */
#pragma GCC unroll 16
      for (int c = 0; c < PD_Q4_BLOCK / (2 * VL); c++) {
        vf lo, hi;
        V_LOAD_Q4_PAIR(row + (size_t)b * (PD_Q4_BLOCK / 2) + (size_t)c * VL, lo, hi);
        const vf wl = V_MUL(V_SUB(lo, z), s), wh = V_MUL(V_SUB(hi, z), s);
        const size_t k = (size_t)b * PD_Q4_BLOCK + (size_t)c * 2 * VL;
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
          acc[m * R + r] = V_FMA(wl, V_LOAD(xp + (size_t)m * K + k), acc[m * R + r]);
          acc[m * R + r] = V_FMA(wh, V_LOAD(xp + (size_t)m * K + k + VL), acc[m * R + r]);
        }
      }
    }
  }
  gv_finish(y, acc, bias, NULL, M, R, N, n);
}

AI void gq_rows(float *y, const float *xp, const uint8_t *w, const float *bias, int M, int R,
                int N, int K, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R) gq_block(y, xp, w, bias, M, R, N, K, n);
  for (; n < n1; n++) gq_block(y, xp, w, bias, M, 1, N, K, n);
}

/* The GEMM's panel of 4-bit W: rows [n0, n0 + nv), depth [k0, k0 + kc), dequantized. */
static void mm_pack_q4(float *pw, const void *w, int K, int n0, int nv, int k0, int kc) {
  const size_t rb = q4_row_bytes(K);
  for (int i = 0; i < MM_NR; i++) {
    if (i >= nv) {
      for (int k = 0; k < kc; k++) pw[(size_t)k * MM_NR + i] = 0.0f;
      continue;
    }
    const uint8_t *row = (const uint8_t *)w + (size_t)(n0 + i) * rb;
    for (int k = 0; k < kc;) {
      const int kk = k0 + k, b = kk / PD_Q4_BLOCK, end = (b + 1) * PD_Q4_BLOCK - k0;
      uint16_t sz[2];
      memcpy(sz, row + (size_t)K / 2 + (size_t)b * 4, 4);
      const float s = q4_f16(sz[0]), z = q4_f16(sz[1]);
      for (; k < kc && k < end; k++) {
        const int j = k0 + k;
        const int q = (row[j / 2] >> ((j & 1) * 4)) & 15;
        pw[(size_t)k * MM_NR + i] = ((float)q - z) * s;
      }
    }
  }
}

/* ---- FP8 weights (PD_DTYPE_F8W, F8WA, F8WS: rows of K e4m3 bytes, then an f32 scale; F8WS then
 * its activation scale: rows of rb bytes) ----
 * x in natural order (F8WA's and F8WS's activations were quantized before, in the backend); each
 * row's sum is scaled at the end. */
AI void gf_block(float *y, const float *x, const uint8_t *w, const float *bias, int M, int R,
                 int N, int K, size_t rb, int n) {
  vf acc[16];
#pragma GCC unroll 16
  for (int f = 0; f < M * R; f++) acc[f] = V_ZERO();
  for (int k = 0; k < K; k += VL) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const uint8_t *row = w + (size_t)(n + r) * rb;
      if (VL >= 8 && (k & 63) == 0) __builtin_prefetch(row + rb + k, 0, 3);
      const vf wv = V_LOAD_E4M3(row + k);
#pragma GCC unroll 8
      for (int m = 0; m < M; m++)
        acc[m * R + r] = V_FMA(wv, V_LOAD(x + (size_t)m * K + k), acc[m * R + r]);
    }
  }
  float sc[8];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) memcpy(&sc[r], w + (size_t)(n + r) * rb + K, 4);
  gv_finish(y, acc, bias, sc, M, R, N, n);
}

AI void gf_rows(float *y, const float *x, const uint8_t *w, const float *bias, int M, int R,
                int N, int K, size_t rb, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R) gf_block(y, x, w, bias, M, R, N, K, rb, n);
  for (; n < n1; n++) gf_block(y, x, w, bias, M, 1, N, K, rb, n);
}

/* GEMV over W rows of a packed form (dt: PD_DTYPE_Q4, or FP8 for both F8W and F8WA), as gv_dt:
 * passes of at most four x rows over blocks of GV_NB W rows, so that the passes after the first
 * read the block from L2. */
AI void gp_rows(float *y, const float *x, const uint8_t *w, pd_dtype dt, const float *bias, int M,
                int R, int N, int K, int n0, int n1) {
  if (dt == PD_DTYPE_Q4) gq_rows(y, x, w, bias, M, R, N, K, n0, n1);
  else gf_rows(y, x, w, bias, M, R, N, K, pd_dtype_row_bytes(dt, K), n0, n1);
}

AI void gv_packed(float *y, const float *x, const void *w, pd_dtype dt, const float *bias, int M,
                  int N, int K, int n0_, int n1_) {
  for (int n0 = n0_; n0 < n1_; n0 += GV_NB) {
    const int n1 = n1_ - n0 < GV_NB ? n1_ : n0 + GV_NB;
    for (int m0 = 0; m0 < M; m0 += 4) {
      int mp = M - m0 < 4 ? M - m0 : 4;
      float *ym = y + (size_t)m0 * N;
      const float *xm = x + (size_t)m0 * K;
      switch (mp) {
      case 1: gp_rows(ym, xm, w, dt, bias, 1, GV_R1, N, K, n0, n1); break;
      case 2: gp_rows(ym, xm, w, dt, bias, 2, GV_R2, N, K, n0, n1); break;
      case 3: gp_rows(ym, xm, w, dt, bias, 3, GV_R3, N, K, n0, n1); break;
      default: gp_rows(ym, xm, w, dt, bias, 4, GV_R4, N, K, n0, n1); break;
      }
    }
  }
}

/* The GEMM's panel of FP8 W, dequantized (scale applied). */
static void mm_pack_f8(float *pw, const void *w, pd_dtype dt, int K, int n0, int nv, int k0,
                       int kc) {
  const size_t rb = pd_dtype_row_bytes(dt, K);
  for (int i = 0; i < MM_NR; i++) {
    if (i >= nv) {
      for (int k = 0; k < kc; k++) pw[(size_t)k * MM_NR + i] = 0.0f;
      continue;
    }
    const uint8_t *row = (const uint8_t *)w + (size_t)(n0 + i) * rb;
    float sc;
    memcpy(&sc, row + K, 4);
    for (int k = 0; k < kc; k++) pw[(size_t)k * MM_NR + i] = pd_e4m3_to_f32(row[k0 + k]) * sc;
  }
}

static void k_gemv(float *y, const float *xp, const void *w, pd_dtype wdt, const float *bias,
                   int M, int N, int K, int n0, int n1) {
  switch (wdt) {
  case PD_DTYPE_F8W:
  case PD_DTYPE_F8WA: gv_packed(y, xp, w, PD_DTYPE_F8W, bias, M, N, K, n0, n1); break;
  case PD_DTYPE_F8WS: gv_packed(y, xp, w, PD_DTYPE_F8WS, bias, M, N, K, n0, n1); break;
  case PD_DTYPE_Q4: gv_packed(y, xp, w, PD_DTYPE_Q4, bias, M, N, K, n0, n1); break;
  case PD_DTYPE_BF16: gv_dt(y, xp, w, PD_DTYPE_BF16, bias, M, N, K, n0, n1); break;
  case PD_DTYPE_F16: gv_dt(y, xp, w, PD_DTYPE_F16, bias, M, N, K, n0, n1); break;
  default: gv_dt(y, xp, w, PD_DTYPE_F32, bias, M, N, K, n0, n1); break;
  }
}

/* ================================================================================================
 * GEMM for many rows of x. One task owns an output panel of MM_NR features: it widens and
 * transposes that panel of W into [kc][MM_NR] f32 (MM_KC deep at a time, L2-resident), then runs
 * an MM_MR x MM_NR register-tile micro-kernel down its rows of x: per k, MM_NV vector loads of the
 * panel and MM_MR broadcasts of x, MM_MR * MM_NV FMAs. x is read in place (row stride K).
 * ============================================================================================== */

/* Walks the cache lines of a block of W (rows of row_bytes bytes, stride bytes apart) one
 * prefetch at a time, so the micro-kernel can pull in the next panel while it computes this one:
 * at decode batch sizes W comes from DRAM (the weights and KV cache of a step overflow the L3)
 * and a panel's rows are short strided runs that the hardware prefetcher does not follow. */
typedef struct mm_pf {
  const char *row; /* current row */
  size_t stride;   /* bytes between rows */
  int col, row_bytes, rows_left;
} mm_pf;

AI void mm_pf_step(mm_pf *c) {
  if (c->rows_left <= 0) return;
  __builtin_prefetch(c->row + c->col, 0, 2);
  c->col += 64;
  if (c->col >= c->row_bytes) {
    c->col = 0;
    c->row += c->stride;
    c->rows_left--;
  }
}

AI void mm_pack_dt(float *pw, const void *w, pd_dtype dt, int K, int n0, int nv, int k0, int kc) {
  for (int rb = 0; rb < MM_NR; rb += VL) {
    int rv = nv - rb; /* valid W rows in this VL block */
    if (rv > VL) rv = VL;
    int k = 0;
    if (rv == VL) {
      for (; k + VL <= kc; k += VL) {
        vf r[VL];
#pragma GCC unroll 16
        for (int i = 0; i < VL; i++) r[i] = load_dt(w, (size_t)(n0 + rb + i) * K + k0 + k, dt);
        /* Four cache lines ahead along each row, once per line (the first panel of a task was not
         * prefetched by a previous one). Integer arithmetic: the address may lie past W. */
        if (VL >= 8 && ((k * dt_size(dt)) & 63) == 0)
#pragma GCC unroll 16
          for (int i = 0; i < VL; i++)
            __builtin_prefetch((const void *)((uintptr_t)w + ((size_t)(n0 + rb + i) * K + k0 + k) *
                                                                 dt_size(dt) + 256), 0, 2);
        v_transpose(r);
#pragma GCC unroll 16
        for (int i = 0; i < VL; i++) V_STORE(pw + (size_t)(k + i) * MM_NR + rb, r[i]);
      }
    }
    for (; k < kc; k++)
      for (int i = 0; i < VL; i++)
        pw[(size_t)k * MM_NR + rb + i] =
            i < rv ? scalar_dt(w, (size_t)(n0 + rb + i) * K + k0 + k, dt) : 0.0f;
  }
}

static void mm_pack(float *pw, const void *w, pd_dtype dt, int K, int n0, int nv, int k0, int kc) {
  switch (dt) {
  case PD_DTYPE_Q4: mm_pack_q4(pw, w, K, n0, nv, k0, kc); break;
  case PD_DTYPE_F8W:
  case PD_DTYPE_F8WA:
  case PD_DTYPE_F8WS: mm_pack_f8(pw, w, dt, K, n0, nv, k0, kc); break;
  case PD_DTYPE_BF16: mm_pack_dt(pw, w, PD_DTYPE_BF16, K, n0, nv, k0, kc); break;
  case PD_DTYPE_F16: mm_pack_dt(pw, w, PD_DTYPE_F16, K, n0, nv, k0, kc); break;
  default: mm_pack_dt(pw, w, PD_DTYPE_F32, K, n0, nv, k0, kc); break;
  }
}

/* y[0..mr, 0..nv) (row stride ldy) = / += x[0..mr, 0..kc) (row stride ldx) . panel.
 * accum: add to y (later depth blocks); otherwise store, adding bias (NULL for none).
 * pf: advanced by one cache line every second k (an exhausted cursor issues nothing). */
AI void mm_micro(int mr, float *y, int ldy, const float *x, int ldx, const float *pw, int kc,
                 int nv, const float *bias, int accum, mm_pf *pf) {
  vf acc[MM_MR][MM_NV];
#pragma GCC unroll 16
  for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
    for (int v = 0; v < MM_NV; v++) acc[i][v] = V_ZERO();
  for (int k = 0; k < kc; k++) {
    if (VL >= 8 && (k & 1) == 0) mm_pf_step(pf);
    vf b[MM_NV];
#pragma GCC unroll 4
    for (int v = 0; v < MM_NV; v++) {
      b[v] = V_LOAD(pw + (size_t)k * MM_NR + v * VL);
      V_KEEP(b[v]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) {
      vf a = V_SET1(x[(size_t)i * ldx + k]);
#pragma GCC unroll 4
      for (int v = 0; v < MM_NV; v++) acc[i][v] = V_FMA(a, b[v], acc[i][v]);
    }
  }
  if (nv == MM_NR) {
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
      for (int v = 0; v < MM_NV; v++) {
        float *yp = y + (size_t)i * ldy + v * VL;
        vf r = acc[i][v];
        if (accum)
          r = V_ADD(r, V_LOAD(yp));
        else if (bias)
          r = V_ADD(r, V_LOAD(bias + v * VL));
        V_STORE(yp, r);
      }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
      for (int v = 0; v < MM_NV; v++) {
        int n = nv - v * VL;
        if (n <= 0) break;
        if (n > VL) n = VL;
        float *yp = y + (size_t)i * ldy + v * VL;
        vf r = acc[i][v];
        if (accum)
          r = V_ADD(r, V_LOAD_N(yp, n));
        else if (bias)
          r = V_ADD(r, V_LOAD_N(bias + v * VL, n));
        V_STORE_N(yp, r, n);
      }
  }
}

static void mm_micro_any(int mr, float *y, int ldy, const float *x, int ldx, const float *pw,
                         int kc, int nv, const float *bias, int accum, mm_pf *pf) {
  switch (mr) {
#define MM_CASE(R)                                                                                \
  case R: mm_micro(R, y, ldy, x, ldx, pw, kc, nv, bias, accum, pf); break;
  MM_CASE(1)
#if MM_MR >= 2
  MM_CASE(2)
#endif
#if MM_MR >= 3
  MM_CASE(3)
#endif
#if MM_MR >= 4
  MM_CASE(4)
#endif
#if MM_MR >= 5
  MM_CASE(5)
#endif
#if MM_MR >= 6
  MM_CASE(6)
#endif
#if MM_MR >= 7
  MM_CASE(7)
#endif
#if MM_MR >= 8
  MM_CASE(8)
#endif
#if MM_MR >= 9
  MM_CASE(9)
#endif
#if MM_MR >= 10
  MM_CASE(10)
#endif
#if MM_MR >= 11
  MM_CASE(11)
#endif
#if MM_MR >= 12
  MM_CASE(12)
#endif
#if MM_MR >= 13
  MM_CASE(13)
#endif
#if MM_MR >= 14
  MM_CASE(14)
#endif
#undef MM_CASE
  default: break;
  }
}

/* Output panels [p0, p1) on rows [m0, m1). For each panel and depth block: pack (widen and
 * transpose) W into the panel scratch, then sweep the rows in register tiles; while it computes,
 * the micro-kernel prefetches the W of the next depth block or panel of this task. */
static void k_gemm(float *y, const float *x, const void *w, pd_dtype wdt, const float *bias, int M,
                   int N, int K, int m0, int m1, int p0, int p1, float *panel) {
  (void)M;
  const size_t esz = dt_size(wdt);
  for (int p = p0; p < p1; p++) {
    int n0 = p * MM_NR, nv = N - n0 < MM_NR ? N - n0 : MM_NR;
    for (int k0 = 0; k0 < K; k0 += MM_KC) {
      int kc = K - k0 < MM_KC ? K - k0 : MM_KC;
      mm_pack(panel, w, wdt, K, n0, nv, k0, kc);
      /* What this task reads next: the next depth block of this panel, else the next panel. */
      mm_pf pf = {.rows_left = 0};
      if (wdt == PD_DTYPE_Q4 || wdt == PD_DTYPE_F8W || wdt == PD_DTYPE_F8WA ||
          wdt == PD_DTYPE_F8WS) {
        /* (rows of another layout: no prefetch walk) */
      } else if (k0 + kc < K) {
        int kn = K - (k0 + kc) < MM_KC ? K - (k0 + kc) : MM_KC;
        pf = (mm_pf){(const char *)w + ((size_t)n0 * K + k0 + kc) * esz, (size_t)K * esz, 0,
                     (int)(kn * esz), nv};
      } else if (p + 1 < p1) {
        int n1 = n0 + MM_NR, nv1 = N - n1 < MM_NR ? N - n1 : MM_NR;
        int kn = K < MM_KC ? K : MM_KC;
        pf = (mm_pf){(const char *)w + (size_t)n1 * K * esz, (size_t)K * esz, 0, (int)(kn * esz),
                     nv1};
      }
      const float *b = k0 == 0 && bias ? bias + n0 : NULL;
      /* Rows in ceil(rows / MM_MR) tiles of near-equal height (17 rows: 6 + 6 + 5, not
       * 8 + 8 + 1): a short tile does little work per panel load and per loop trip. */
      const int rows = m1 - m0, n_tiles = (rows + MM_MR - 1) / MM_MR;
      int m = m0;
      for (int t = 0; t < n_tiles; t++) {
        int mr = rows / n_tiles + (t < rows % n_tiles);
        float *yt = y + (size_t)m * N + n0;
        const float *xt = x + (size_t)m * K + k0;
        if (mr == MM_MR)
          mm_micro(MM_MR, yt, N, xt, K, panel, kc, nv, b, k0 > 0, &pf);
        else
          mm_micro_any(mr, yt, N, xt, K, panel, kc, nv, b, k0 > 0, &pf);
        m += mr;
      }
    }
  }
}

/* ================================================================================================
 * Attention over the paged KV cache, FlashAttention-style on the CPU.
 *
 * A tile is a run of (new token, query head) pairs of one KV head's group, so GQA heads share
 * every K/V load. Keys are visited in blocks (which may span pages), with an online softmax in
 * f32 (running max m, running sum l, O rescaled when m grows). Two kernels:
 *  - "lanes" (prefill, chunked prefill, verification: more than VL/2 pairs): one vector lane per
 *    query. Scores S^T[key][lane] broadcast K[key][d] against the transposed queries, so K and V
 *    are read in place from the pages with no transposes; masks, max, exp and sums are all
 *    lane-wise; O^T [head_dim][lane] accumulates broadcast V[key][d] times P^T[key].
 *  - "rows" (decode: a few pairs): one query per row. The key block is transposed to
 *    KT [head_dim][keys] (VL x VL in-register transposes) so scores come out VL keys per vector;
 *    O [row][head_dim] accumulates broadcast P[row][key] times V rows.
 * ============================================================================================== */

#define AT_PF 2 /* rows kernel: K/V prefetch distance, in key blocks */
#define AT_ALIGN(n) (((n) + 15) & ~(size_t)15)
#define AL_KB 32 /* lanes kernel: keys per block */

static size_t k_attn_scratch(int head_dim) {
  size_t hd = (size_t)head_dim, hp = AT_ALIGN((hd + VL - 1) / VL * VL);
  /* rows: Q, O [AT_QB][hp], KT [hp][AT_KB], S [AT_QB][AT_KB], VB [AT_KB][hp], m, l */
  size_t rows = 2 * AT_ALIGN((size_t)AT_QB * hp) + AT_ALIGN(hp * AT_KB) +
                AT_ALIGN((size_t)AT_QB * AT_KB) + AT_ALIGN((size_t)AT_KB * hp) + 2 * AT_ALIGN(AT_QB);
  /* lanes: QT, OT [hd][VL], ST [AL_KB][VL], KB, VB [AL_KB][hd], zero row [hd] */
  size_t lanes = 2 * AT_ALIGN(hd * VL) + AT_ALIGN((size_t)AL_KB * VL) + 2 * AT_ALIGN(AL_KB * hd) +
                 AT_ALIGN(hd);
  return (rows > lanes ? rows : lanes) * sizeof(float) + 64;
}

/* Row pointers (into the pages) of keys kb0 .. kb0 + nk - 1 of a sequence, for KV head g. */
static void at_key_rows(const pd_cpu_attn *a, const int32_t *bt, int g, int kb0, int nk,
                        const void **krow, const void **vrow) {
  const int bs = a->block_size;
  const size_t esz = dt_size(a->kv_dtype), head_el = (size_t)bs * a->head_dim;
  int bi = kb0 / bs, off = kb0 - bi * bs;
  size_t el0 = ((size_t)bt[bi] * a->n_kv_heads + g) * head_el;
  for (int j = 0; j < nk; j++) {
    size_t el = el0 + (size_t)off * a->head_dim;
    krow[j] = (const char *)a->k + el * esz;
    vrow[j] = (const char *)a->v + el * esz;
    if (++off == bs && j + 1 < nk) {
      off = 0;
      bi++;
      el0 = ((size_t)bt[bi] * a->n_kv_heads + g) * head_el;
    }
  }
}

/* Prefetches K and V of keys kb0 .. kb0 + nk - 1 into L2 (blocks ahead of the one computed).
 * A page of one KV head is a few KiB: the hardware prefetcher stops at each 4 KiB boundary and
 * pages are scattered, so decode over a long context would otherwise wait on L3/DRAM. L2, not
 * L1: a block of K and V is 16 KiB in f32 at head_dim 64, and pulling two of them into the 32 KiB
 * L1 would evict the block being computed (measured: 1.6x slower decode from DRAM). */
static void at_prefetch_keys(const pd_cpu_attn *a, const int32_t *bt, int g, int kb0, int nk) {
  const int bs = a->block_size;
  const size_t esz = dt_size(a->kv_dtype), row = (size_t)a->head_dim * esz;
  for (int t = kb0; t < kb0 + nk;) {
    int bi = t / bs, off = t - bi * bs, n = bs - off;
    if (n > kb0 + nk - t) n = kb0 + nk - t;
    size_t start = ((((size_t)bt[bi] * a->n_kv_heads + g) * bs + off) * a->head_dim) * esz;
    for (size_t b = 0; b < (size_t)n * row; b += 64) {
      __builtin_prefetch((const char *)a->k + start + b, 0, 2);
      __builtin_prefetch((const char *)a->v + start + b, 0, 2);
    }
    t += n;
  }
}

/* ---- rows kernel ---- */

/* KT[d][j] = key j, dimension d, for j < AT_KB (zero for j >= nk and for d >= hd). */
AI void at_build_kt_dt(float *KT, const void *const *krow, int nk, int hd, int hp, pd_dtype dt) {
  for (int jb = 0; jb < AT_KBV; jb++) {
    int j0 = jb * VL;
    if (j0 >= nk) {
      for (int d = 0; d < hp; d++) V_STORE(KT + (size_t)d * AT_KB + j0, V_ZERO());
      continue;
    }
    for (int d0 = 0; d0 < hp; d0 += VL) {
      int n = hd - d0 < VL ? hd - d0 : VL;
      vf r[VL];
#pragma GCC unroll 16
      for (int c = 0; c < VL; c++) {
        if (j0 + c < nk)
          r[c] = n == VL ? load_dt(krow[j0 + c], (size_t)d0, dt)
                         : load_dt_n(krow[j0 + c], (size_t)d0, n, dt);
        else
          r[c] = V_ZERO();
      }
      v_transpose(r);
#pragma GCC unroll 16
      for (int c = 0; c < VL; c++) V_STORE(KT + (size_t)(d0 + c) * AT_KB + j0, r[c]);
    }
  }
}

static void at_build_kt(float *KT, const void *const *krow, int nk, int hd, int hp, pd_dtype dt) {
  switch (dt) {
  case PD_DTYPE_BF16: at_build_kt_dt(KT, krow, nk, hd, hp, PD_DTYPE_BF16); break;
  case PD_DTYPE_F16: at_build_kt_dt(KT, krow, nk, hd, hp, PD_DTYPE_F16); break;
  case PD_DTYPE_F8_E4M3: at_build_kt_dt(KT, krow, nk, hd, hp, PD_DTYPE_F8_E4M3); break;
  default: at_build_kt_dt(KT, krow, nk, hd, hp, PD_DTYPE_F32); break;
  }
}

/* S[q][0..AT_KB) = Q[q] . KT for nq (compile-time) query rows. */
AI void at_scores(int nq, float *S, const float *Q, int hp, const float *KT) {
  vf acc[AT_SQ][AT_KBV];
#pragma GCC unroll 8
  for (int q = 0; q < nq; q++)
#pragma GCC unroll 4
    for (int v = 0; v < AT_KBV; v++) acc[q][v] = V_ZERO();
  for (int d = 0; d < hp; d++) {
    vf kt[AT_KBV];
#pragma GCC unroll 4
    for (int v = 0; v < AT_KBV; v++) {
      kt[v] = V_LOAD(KT + (size_t)d * AT_KB + v * VL);
      V_KEEP(kt[v]);
    }
#pragma GCC unroll 8
    for (int q = 0; q < nq; q++) {
      vf x = V_SET1(Q[(size_t)q * hp + d]);
#pragma GCC unroll 4
      for (int v = 0; v < AT_KBV; v++) acc[q][v] = V_FMA(x, kt[v], acc[q][v]);
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < nq; q++)
#pragma GCC unroll 4
    for (int v = 0; v < AT_KBV; v++) V_STORE(S + (size_t)q * AT_KB + v * VL, acc[q][v]);
}

static void at_scores_all(float *S, const float *Q, int nq, int hp, const float *KT) {
  int q = 0;
  for (; q + AT_SQ <= nq; q += AT_SQ)
    at_scores(AT_SQ, S + (size_t)q * AT_KB, Q + (size_t)q * hp, hp, KT);
  switch (nq - q) {
  case 0: break;
#if AT_SQ > 1
  case 1: at_scores(1, S + (size_t)q * AT_KB, Q + (size_t)q * hp, hp, KT); break;
#endif
#if AT_SQ > 2
  case 2: at_scores(2, S + (size_t)q * AT_KB, Q + (size_t)q * hp, hp, KT); break;
#endif
#if AT_SQ > 3
  case 3: at_scores(3, S + (size_t)q * AT_KB, Q + (size_t)q * hp, hp, KT); break;
#endif
#if AT_SQ > 4
  case 4: at_scores(4, S + (size_t)q * AT_KB, Q + (size_t)q * hp, hp, KT); break;
#endif
#if AT_SQ > 5
  case 5: at_scores(5, S + (size_t)q * AT_KB, Q + (size_t)q * hp, hp, KT); break;
#endif
  default: break;
  }
}

/* O[q][d0 .. d0 + nd*VL) += sum_{j < nk} P[q][j] * V[j][same] for nq rows (both compile-time). */
AI void at_pv(int nq, int nd, float *O, int hp, const float *P, int nk, const float *const *vrow,
              int d0) {
  vf acc[AT_PQ][AT_PD];
#pragma GCC unroll 8
  for (int q = 0; q < nq; q++)
#pragma GCC unroll 8
    for (int u = 0; u < nd; u++) acc[q][u] = V_LOAD(O + (size_t)q * hp + d0 + u * VL);
  for (int j = 0; j < nk; j++) {
    vf vv[AT_PD];
#pragma GCC unroll 8
    for (int u = 0; u < nd; u++) {
      vv[u] = V_LOAD(vrow[j] + d0 + u * VL);
      V_KEEP(vv[u]);
    }
#pragma GCC unroll 8
    for (int q = 0; q < nq; q++) {
      vf p = V_SET1(P[(size_t)q * AT_KB + j]);
#pragma GCC unroll 8
      for (int u = 0; u < nd; u++) acc[q][u] = V_FMA(p, vv[u], acc[q][u]);
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < nq; q++)
#pragma GCC unroll 8
    for (int u = 0; u < nd; u++) V_STORE(O + (size_t)q * hp + d0 + u * VL, acc[q][u]);
}

AI void at_pv_rows(int nq, float *O, int hp, const float *P, int nk, const float *const *vrow) {
  int d0 = 0;
  for (; d0 + AT_PD * VL <= hp; d0 += AT_PD * VL) at_pv(nq, AT_PD, O, hp, P, nk, vrow, d0);
  switch ((hp - d0) / VL) {
  case 0: break;
#if AT_PD > 1
  case 1: at_pv(nq, 1, O, hp, P, nk, vrow, d0); break;
#endif
#if AT_PD > 2
  case 2: at_pv(nq, 2, O, hp, P, nk, vrow, d0); break;
#endif
#if AT_PD > 3
  case 3: at_pv(nq, 3, O, hp, P, nk, vrow, d0); break;
#endif
  default: break; /* AT_PD <= 4 */
  }
}

static void at_pv_all(float *O, int nq, int hp, const float *P, int nk, const float *const *vrow) {
  int q = 0;
  for (; q + AT_PQ <= nq; q += AT_PQ)
    at_pv_rows(AT_PQ, O + (size_t)q * hp, hp, P + (size_t)q * AT_KB, nk, vrow);
  switch (nq - q) {
  case 0: break;
#if AT_PQ > 1
  case 1: at_pv_rows(1, O + (size_t)q * hp, hp, P + (size_t)q * AT_KB, nk, vrow); break;
#endif
#if AT_PQ > 2
  case 2: at_pv_rows(2, O + (size_t)q * hp, hp, P + (size_t)q * AT_KB, nk, vrow); break;
#endif
#if AT_PQ > 3
  case 3: at_pv_rows(3, O + (size_t)q * hp, hp, P + (size_t)q * AT_KB, nk, vrow); break;
#endif
  default: break;
  }
}

static void at_rows(const pd_cpu_attn *a, const pd_cpu_attn_tile *t, void *scratch) {
  const int hd = a->head_dim, hp = (hd + VL - 1) / VL * VL, KB = AT_KB, G = a->group;
  const int nq = t->p1 - t->p0, s = t->s, g = t->g;
  const int qs = a->q_start[s], base = a->ctx_len[s] - (a->q_start[s + 1] - qs);
  const int32_t *bt = a->block_tables + (size_t)s * a->max_blocks;
  const int direct_v = a->kv_dtype == PD_DTYPE_F32 && hd % VL == 0;

  float *Q = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  float *O = Q + AT_ALIGN((size_t)AT_QB * hp);
  float *KT = O + AT_ALIGN((size_t)AT_QB * hp);
  float *S = KT + AT_ALIGN((size_t)hp * KB);
  float *VB = S + AT_ALIGN((size_t)AT_QB * KB);
  float *mrow = VB + AT_ALIGN((size_t)KB * hp);
  float *lrow = mrow + AT_ALIGN(AT_QB);
  int pos[AT_QB];
  const void *krow[AT_KB], *vsrc[AT_KB];
  const float *vrow[AT_KB];

  /* Query rows, scaled and zero-padded to hp. */
  vf sc = V_SET1(a->scale);
  for (int i = 0; i < nq; i++) {
    int p = t->p0 + i, tt = p / G, h = g * G + p % G;
    const float *src = a->q + ((size_t)(qs + tt) * a->n_q_heads + h) * hd;
    float *dst = Q + (size_t)i * hp;
    int d = 0;
    for (; d + VL <= hd; d += VL) V_STORE(dst + d, V_MUL(V_LOAD(src + d), sc));
    if (d < hp) V_STORE(dst + d, V_MUL(V_LOAD_N(src + d, hd - d), sc));
    for (d = 0; d < hp; d += VL) V_STORE(O + (size_t)i * hp + d, V_ZERO());
    pos[i] = base + tt;
    mrow[i] = -INFINITY;
    lrow[i] = 0.0f;
  }
  const int pmin = pos[0], pmax = pos[nq - 1];
  int kstart = a->window > 0 ? pmin - a->window + 1 : 0;
  if (kstart < 0) kstart = 0;

  /* K/V two blocks ahead, into L2: at decode batch sizes the KV cache streams from DRAM, and a
   * task starts cold, so its first two blocks are requested up front. */
  {
    int n0 = pmax + 1 - kstart < AT_PF * KB ? pmax + 1 - kstart : AT_PF * KB;
    at_prefetch_keys(a, bt, g, kstart, n0);
  }
  for (int kb0 = kstart; kb0 <= pmax; kb0 += KB) {
    const int nk = pmax + 1 - kb0 < KB ? pmax + 1 - kb0 : KB;
    if (kb0 + AT_PF * KB <= pmax)
      at_prefetch_keys(a, bt, g, kb0 + AT_PF * KB,
                       pmax + 1 - (kb0 + AT_PF * KB) < KB ? pmax + 1 - (kb0 + AT_PF * KB) : KB);
    at_key_rows(a, bt, g, kb0, nk, krow, vsrc);
    for (int j = 0; j < nk; j++) {
      if (direct_v) {
        vrow[j] = vsrc[j];
      } else {
        float *dst = VB + (size_t)j * hp;
        k_to_f32(dst, vsrc[j], a->kv_dtype, (size_t)hd);
        for (int d = hd; d < hp; d++) dst[d] = 0.0f;
        vrow[j] = dst;
      }
    }
    at_build_kt(KT, krow, nk, hd, hp, a->kv_dtype);
    at_scores_all(S, Q, nq, hp, KT);

    /* Online softmax, row by row. */
    for (int i = 0; i < nq; i++) {
      float *srow = S + (size_t)i * KB;
      int lo = a->window > 0 ? pos[i] - a->window + 1 : 0;
      int jlo = lo - kb0 > 0 ? lo - kb0 : 0;
      int jhi = pos[i] - kb0 < nk - 1 ? pos[i] - kb0 : nk - 1;
      if (jhi < jlo) { /* no visible key in this block for this row */
        for (int v = 0; v < AT_KBV; v++) V_STORE(srow + v * VL, V_ZERO());
        continue;
      }
      if (jlo > 0 || jhi < KB - 1) {
        for (int j = 0; j < jlo; j++) srow[j] = -INFINITY;
        for (int j = jhi + 1; j < KB; j++) srow[j] = -INFINITY;
      }
      vf vm = V_LOAD(srow);
      for (int v = 1; v < AT_KBV; v++) vm = V_MAX(vm, V_LOAD(srow + v * VL));
      float mx = V_HMAX(vm);
      float mnew = mrow[i] > mx ? mrow[i] : mx;
      float alpha = mrow[i] == -INFINITY ? 0.0f : expf(mrow[i] - mnew);
      vf mv = V_SET1(mnew), sum = V_ZERO();
      for (int v = 0; v < AT_KBV; v++) {
        vf p = V_EXP(V_SUB(V_LOAD(srow + v * VL), mv));
        V_STORE(srow + v * VL, p);
        sum = V_ADD(sum, p);
      }
      lrow[i] = lrow[i] * alpha + V_HSUM(sum);
      mrow[i] = mnew;
      if (alpha != 1.0f) {
        vf av = V_SET1(alpha);
        float *o = O + (size_t)i * hp;
        for (int d = 0; d < hp; d += VL) V_STORE(o + d, V_MUL(V_LOAD(o + d), av));
      }
    }
    at_pv_all(O, nq, hp, S, nk, vrow);
  }

  /* out = O / l */
  for (int i = 0; i < nq; i++) {
    int p = t->p0 + i, tt = p / G, h = g * G + p % G;
    float *dst = a->out + ((size_t)(qs + tt) * a->n_q_heads + h) * hd;
    vf inv = V_SET1(lrow[i] > 0.0f ? 1.0f / lrow[i] : 0.0f);
    const float *o = O + (size_t)i * hp;
    int d = 0;
    for (; d + VL <= hd; d += VL) V_STORE(dst + d, V_MUL(V_LOAD(o + d), inv));
    if (d < hd) V_STORE_N(dst + d, V_MUL(V_LOAD(o + d), inv), hd - d);
  }
}

/* ---- lanes kernel ---- */

/* ST[u][lane] = sum_d K[u][d] * QT[d][lane] for 8 keys. */
AI void al_scores8(float *ST, const float *const *kr, const float *QT, int hd) {
  const float *k0 = kr[0], *k1 = kr[1], *k2 = kr[2], *k3 = kr[3];
  const float *k4 = kr[4], *k5 = kr[5], *k6 = kr[6], *k7 = kr[7];
  vf a0 = V_ZERO(), a1 = V_ZERO(), a2 = V_ZERO(), a3 = V_ZERO();
  vf a4 = V_ZERO(), a5 = V_ZERO(), a6 = V_ZERO(), a7 = V_ZERO();
  for (int d = 0; d < hd; d++) {
    vf q = V_LOAD(QT + (size_t)d * VL);
    V_KEEP(q);
    a0 = V_FMA(V_SET1(k0[d]), q, a0);
    a1 = V_FMA(V_SET1(k1[d]), q, a1);
    a2 = V_FMA(V_SET1(k2[d]), q, a2);
    a3 = V_FMA(V_SET1(k3[d]), q, a3);
    a4 = V_FMA(V_SET1(k4[d]), q, a4);
    a5 = V_FMA(V_SET1(k5[d]), q, a5);
    a6 = V_FMA(V_SET1(k6[d]), q, a6);
    a7 = V_FMA(V_SET1(k7[d]), q, a7);
  }
  V_STORE(ST + 0 * VL, a0);
  V_STORE(ST + 1 * VL, a1);
  V_STORE(ST + 2 * VL, a2);
  V_STORE(ST + 3 * VL, a3);
  V_STORE(ST + 4 * VL, a4);
  V_STORE(ST + 5 * VL, a5);
  V_STORE(ST + 6 * VL, a6);
  V_STORE(ST + 7 * VL, a7);
}

/* OT[d0 + u][lane] += sum_{j < nk} V[j][d0 + u] * P^T[j][lane], u < nd (compile-time). */
AI void al_pv(int nd, float *OT, const float *ST, int nk, const float *const *vr, int d0) {
  vf acc[AL_PD];
#pragma GCC unroll 16
  for (int u = 0; u < nd; u++) acc[u] = V_LOAD(OT + (size_t)(d0 + u) * VL);
  for (int j = 0; j < nk; j++) {
    vf p = V_LOAD(ST + (size_t)j * VL);
    V_KEEP(p);
    const float *v = vr[j] + d0;
#pragma GCC unroll 16
    for (int u = 0; u < nd; u++) acc[u] = V_FMA(V_SET1(v[u]), p, acc[u]);
  }
#pragma GCC unroll 16
  for (int u = 0; u < nd; u++) V_STORE(OT + (size_t)(d0 + u) * VL, acc[u]);
}

static void al_pv_all(float *OT, const float *ST, int nk, const float *const *vr, int hd) {
  int d0 = 0;
  for (; d0 + AL_PD <= hd; d0 += AL_PD) al_pv(AL_PD, OT, ST, nk, vr, d0);
#if AL_PD > 8
  if (hd - d0 >= 8) al_pv(8, OT, ST, nk, vr, d0), d0 += 8;
#endif
#if AL_PD > 4
  if (hd - d0 >= 4) al_pv(4, OT, ST, nk, vr, d0), d0 += 4;
#endif
  if (hd - d0 >= 2) al_pv(2, OT, ST, nk, vr, d0), d0 += 2;
  if (hd - d0 >= 1) al_pv(1, OT, ST, nk, vr, d0);
}

static void at_lanes(const pd_cpu_attn *a, const pd_cpu_attn_tile *t, void *scratch) {
  const int hd = a->head_dim, G = a->group, nq = t->p1 - t->p0, s = t->s, g = t->g;
  const int qs = a->q_start[s], base = a->ctx_len[s] - (a->q_start[s + 1] - qs);
  const int32_t *bt = a->block_tables + (size_t)s * a->max_blocks;
  const int f32 = a->kv_dtype == PD_DTYPE_F32;

  float *QT = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  float *OT = QT + AT_ALIGN((size_t)hd * VL);
  float *ST = OT + AT_ALIGN((size_t)hd * VL);
  float *KB = ST + AT_ALIGN((size_t)AL_KB * VL);
  float *VB = KB + AT_ALIGN((size_t)AL_KB * hd);
  float *zero = VB + AT_ALIGN((size_t)AL_KB * hd);
  const void *krow[AL_KB], *vsrc[AL_KB];
  const float *kr[AL_KB + 8], *vr[AL_KB];
  float posf[VL];

  /* Lane i is pair p0 + i; spare lanes repeat the last pair (their results are dropped). */
  for (int i = 0; i < VL; i++) {
    int p = t->p0 + (i < nq ? i : nq - 1), tt = p / G, h = g * G + p % G;
    const float *src = a->q + ((size_t)(qs + tt) * a->n_q_heads + h) * hd;
    for (int d = 0; d < hd; d++) QT[(size_t)d * VL + i] = src[d] * a->scale;
    posf[i] = (float)(base + tt);
  }
  for (int d = 0; d < hd; d++) V_STORE(OT + (size_t)d * VL, V_ZERO());
  for (int d = 0; d < hd; d++) zero[d] = 0.0f;
  const vf pos = V_LOAD(posf), ninf = V_SET1(-INFINITY), vzero = V_ZERO();
  const vf lo = V_SUB(pos, V_SET1((float)(a->window - 1)));
  vf m = ninf, l = V_ZERO();
  const int pmin = base + t->p0 / G, pmax = base + (t->p1 - 1) / G;
  int kstart = a->window > 0 ? pmin - a->window + 1 : 0;
  if (kstart < 0) kstart = 0;

  for (int kb0 = kstart; kb0 <= pmax; kb0 += AL_KB) {
    const int nk = pmax + 1 - kb0 < AL_KB ? pmax + 1 - kb0 : AL_KB;
    if (kb0 + AL_KB <= pmax)
      at_prefetch_keys(a, bt, g, kb0 + AL_KB,
                       pmax + 1 - (kb0 + AL_KB) < AL_KB ? pmax + 1 - (kb0 + AL_KB) : AL_KB);
    at_key_rows(a, bt, g, kb0, nk, krow, vsrc);
    for (int j = 0; j < nk; j++) {
      if (f32) {
        kr[j] = krow[j];
        vr[j] = vsrc[j];
      } else {
        k_to_f32(KB + (size_t)j * hd, krow[j], a->kv_dtype, (size_t)hd);
        k_to_f32(VB + (size_t)j * hd, vsrc[j], a->kv_dtype, (size_t)hd);
        kr[j] = KB + (size_t)j * hd;
        vr[j] = VB + (size_t)j * hd;
      }
    }
    for (int j = nk; j < ((nk + 7) & ~7); j++) kr[j] = zero;
    for (int j = 0; j < nk; j += 8) al_scores8(ST + (size_t)j * VL, kr + j, QT, hd);

    /* Causal / window masks, lane-wise, only where some lane needs them. */
    if (kb0 + nk - 1 > pmin || (a->window > 0 && kb0 < pmax - a->window + 1)) {
      for (int j = 0; j < nk; j++) {
        vf kp = V_SET1((float)(kb0 + j)), sv = V_LOAD(ST + (size_t)j * VL);
        sv = V_BLEND_LT(pos, kp, ninf, sv);
        if (a->window > 0) sv = V_BLEND_LT(kp, lo, ninf, sv);
        V_STORE(ST + (size_t)j * VL, sv);
      }
    }
    vf mb = V_LOAD(ST);
    for (int j = 1; j < nk; j++) mb = V_MAX(mb, V_LOAD(ST + (size_t)j * VL));
    vf mnew = V_MAX(m, mb);
    /* A lane that has seen no key yet keeps m = -inf; exponentiate against 0 there. */
    vf muse = V_BLEND_LT(mnew, V_SET1(-FLT_MAX), vzero, mnew);
    vf sum = V_ZERO();
    for (int j = 0; j < nk; j++) {
      vf p = V_EXP(V_SUB(V_LOAD(ST + (size_t)j * VL), muse));
      V_STORE(ST + (size_t)j * VL, p);
      sum = V_ADD(sum, p);
    }
    vf alpha = V_EXP(V_SUB(m, muse));
    l = V_FMA(l, alpha, sum);
    m = mnew;
    if (kb0 != kstart)
      for (int d = 0; d < hd; d++) V_STORE(OT + (size_t)d * VL, V_MUL(V_LOAD(OT + (size_t)d * VL), alpha));
    al_pv_all(OT, ST, nk, vr, hd);
  }

  float inv[VL];
  V_STORE(inv, V_DIV(V_SET1(1.0f), l));
  for (int i = 0; i < nq; i++) {
    int p = t->p0 + i, tt = p / G, h = g * G + p % G;
    float *dst = a->out + ((size_t)(qs + tt) * a->n_q_heads + h) * hd;
    for (int d = 0; d < hd; d++) dst[d] = OT[(size_t)d * VL + i] * inv[i];
  }
}

static void k_attn(const pd_cpu_attn *a, const pd_cpu_attn_tile *t, void *scratch) {
  if (VL >= 8 && t->p1 - t->p0 > VL / 2)
    at_lanes(a, t, scratch);
  else
    at_rows(a, t, scratch);
}

/* ================================================================================================ */

const pd_cpu_kern KERN_SYM = {
    .name = KERN_NAME,
    .vl = VL,
    .mm_mr = MM_MR,
    .mm_nr = MM_NR,
    .mm_kc = MM_KC,
    .gemv_max_m = GV_MAX_M,
    .at_tile = VL >= 8 ? VL : AT_QB,
    .gemv_prep = k_gemv_prep,
    .gemv = k_gemv,
    .gemm = k_gemm,
    .attn_scratch = k_attn_scratch,
    .attn = k_attn,
    .rmsnorm = k_rmsnorm,
    .add_rmsnorm = k_add_rmsnorm,
    .swiglu = k_swiglu,
    .rope = k_rope,
    .add = k_add,
    .to_f32 = k_to_f32,
};
