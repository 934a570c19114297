/* AVX-512 kernels (F + BW + VL + DQ, with FMA and F16C): 16 floats per vector.
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c (see
 * kernels/CMakeLists.txt) and only called after CPUID confirms those features. */
#include "cpu_internal.h"

#if PD_CPU_X86
#include <immintrin.h>

#define VL 16
typedef __m512 vf;

static inline __mmask16 v_mask(int n) { return (__mmask16)((1u << n) - 1u); }

#define V_KEEP(v) __asm__("" : "+v"(v))
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(s) _mm512_set1_ps(s)
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_LOAD_N(p, n) _mm512_maskz_loadu_ps(v_mask(n), (p))
#define V_STORE_N(p, v, n) _mm512_mask_storeu_ps((p), v_mask(n), (v))
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_DIV _mm512_div_ps
#define V_MAX _mm512_max_ps
#define V_FMA _mm512_fmadd_ps
#define V_FNMA _mm512_fnmadd_ps
#define V_BLEND_LT(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((a), (b), _CMP_LT_OQ), (y), (x))
#define V_HSUM(v) _mm512_reduce_add_ps(v)
#define V_HMAX(v) _mm512_reduce_max_ps(v)

#define V_LOAD_BF16(p)                                                                           \
  _mm512_castsi512_ps(                                                                           \
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define V_LOAD_BF16_N(p, n)                                                                      \
  _mm512_castsi512_ps(                                                                           \
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(v_mask(n), (p))), 16))
#define V_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LOAD_F16_N(p, n) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(v_mask(n), (p)))
/* 32 bf16: each 32-bit lane holds elements (2i, 2i+1); bf16 -> f32 is a 16-bit shift. */
#define V_LOAD_BF16_PAIR(p, lo, hi)                                                              \
  do {                                                                                           \
    __m512i w_ = _mm512_loadu_si512((const void *)(p));                                          \
    __asm__("" : "+v"(w_)); /* one load feeding both ops, not two folded loads */              \
    (lo) = _mm512_castsi512_ps(_mm512_slli_epi32(w_, 16));                                       \
    (hi) = _mm512_castsi512_ps(_mm512_and_si512(w_, _mm512_set1_epi32((int)0xffff0000u)));        \
  } while (0)
/* 16 bytes of e4m3 -> f32, exact: the 7 bits at the top of an f32 scaled by 2^120 (normal and
 * subnormal alike), then the sign. */
#define V_LOAD_E4M3(p)                                                                           \
  ({                                                                                             \
    __m512i b_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)));       \
    __m512i m_ = _mm512_slli_epi32(_mm512_and_si512(b_, _mm512_set1_epi32(0x7f)), 20);            \
    __m512i s_ = _mm512_slli_epi32(_mm512_and_si512(b_, _mm512_set1_epi32(0x80)), 24);            \
    vf f_ = _mm512_mul_ps(_mm512_castsi512_ps(m_), _mm512_set1_ps(0x1p120f));                     \
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f_), s_));                            \
  })
/* 16 bytes of 4-bit values: lo = the low nibbles (elements 0,2,..), hi = the high ones. */
#define V_LOAD_Q4_PAIR(p, lo, hi)                                                                \
  do {                                                                                           \
    __m512i q_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)));       \
    (lo) = _mm512_cvtepi32_ps(_mm512_and_si512(q_, _mm512_set1_epi32(15)));                       \
    (hi) = _mm512_cvtepi32_ps(_mm512_srli_epi32(q_, 4));                                          \
  } while (0)
#define V_DEINTERLEAVE(a, b, ev, od)                                                             \
  do {                                                                                           \
    const __m512i ie_ = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0); \
    const __m512i io_ = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1); \
    vf a_ = (a), b_ = (b);                                                                       \
    (ev) = _mm512_permutex2var_ps(a_, ie_, b_);                                                  \
    (od) = _mm512_permutex2var_ps(a_, io_, b_);                                                  \
  } while (0)

/* e^x: Cephes expf (range reduction by ln2 in two parts, degree-5 polynomial), 2^n by scalef. */
static inline vf v_exp(vf x) {
  __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.0f));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  vf y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  y = _mm512_scalef_ps(y, n);
  return _mm512_mask_blend_ps(under, y, _mm512_setzero_ps());
}
#define V_EXP(v) v_exp(v)

static inline void v_transpose(vf r[16]) {
  vf t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  /* u[4i + c], 128-bit lane L = rows 4i..4i+3 of column 4L + c. */
  for (int c = 0; c < 4; c++) {
    vf w0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    vf w1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    vf w2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    vf w3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(w0, w2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(w0, w2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(w1, w3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(w1, w3, 0xDD);
  }
}

static inline void v_hsum4(vf a, vf b, vf c, vf d, float *out) {
  __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

/* Tuning for Zen 4 / Skylake-SP class cores (32 vector registers). */
#define MM_MR 8   /* GEMM tile: 8 rows x 32 features = 16 accumulators */
#define MM_NV 2
#define MM_KC 512 /* panel 32 x 512 floats = 64 KiB, stays in L2 */
#define GV_R1 8   /* GEMV W rows per step for 1..4 x rows */
#define GV_R2 4
#define GV_R3 4
#define GV_R4 4
#define GV_MAX_M 32 /* GEMV (passes of 4 rows over L2-sized W blocks) up to here, GEMM above: at
                    * 17-32 rows it beats pack + GEMM with W in cache (+5-20%), on par from DRAM */
#define AT_KBV 2  /* 32 keys per attention block */
#define AT_QB 16  /* query vectors per tile */
#define AT_SQ 4   /* score rows per register block (8 accumulators) */
#define AT_PQ 3   /* P.V rows per register block */
#define AT_PD 4   /* P.V vectors of head_dim per register block (12 accumulators) */
#define AL_PD 16  /* lanes kernel: head_dim rows of O^T per register block */

#define KERN_SYM pd_cpu_kern_avx512
#define KERN_NAME "avx512"
#include "cpu_simd.h"

#endif
