/* AVX2 kernels (with FMA and F16C): 8 floats per vector.
 * Compiled with -mavx2 -mfma -mf16c (see kernels/CMakeLists.txt) and only called after CPUID
 * confirms those features. */
#include "cpu_internal.h"

#if PD_CPU_X86
#include <immintrin.h>

#define VL 8
typedef __m256 vf;

/* Lane masks for maskload/maskstore: the window at [8 - n] has n leading -1s. */
static const int32_t v_mask_tbl[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static inline __m256i v_mask(int n) {
  return _mm256_loadu_si256((const __m256i *)(v_mask_tbl + 8 - n));
}

#define V_KEEP(v) __asm__("" : "+x"(v))
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(s) _mm256_set1_ps(s)
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_LOAD_N(p, n) _mm256_maskload_ps((p), v_mask(n))
#define V_STORE_N(p, v, n) _mm256_maskstore_ps((p), v_mask(n), (v))
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_DIV _mm256_div_ps
#define V_MAX _mm256_max_ps
#define V_FMA _mm256_fmadd_ps
#define V_FNMA _mm256_fnmadd_ps
#define V_BLEND_LT(a, b, x, y) _mm256_blendv_ps((y), (x), _mm256_cmp_ps((a), (b), _CMP_LT_OQ))

static inline float v_hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float v_hmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define V_HSUM(v) v_hsum(v)
#define V_HMAX(v) v_hmax(v)

/* Partial 16-bit loads go through a zeroed stack copy (AVX2 has no 16-bit masked load). */
static inline __m128i v_load16_n(const uint16_t *p, int n) {
  uint16_t tmp[8] = {0};
  for (int i = 0; i < n; i++) tmp[i] = p[i];
  return _mm_loadu_si128((const __m128i *)tmp);
}
#define V_LOAD_BF16(p)                                                                           \
  _mm256_castsi256_ps(                                                                           \
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define V_LOAD_BF16_N(p, n)                                                                      \
  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v_load16_n((p), (n))), 16))
#define V_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_LOAD_F16_N(p, n) _mm256_cvtph_ps(v_load16_n((p), (n)))
#define V_LOAD_BF16_PAIR(p, lo, hi)                                                              \
  do {                                                                                           \
    __m256i w_ = _mm256_loadu_si256((const __m256i *)(p));                                       \
    __asm__("" : "+x"(w_)); /* one load feeding both ops, not two folded loads */              \
    (lo) = _mm256_castsi256_ps(_mm256_slli_epi32(w_, 16));                                       \
    (hi) = _mm256_castsi256_ps(_mm256_and_si256(w_, _mm256_set1_epi32((int)0xffff0000u)));        \
  } while (0)
/* 8 bytes of e4m3 -> f32, exact (see cpu_avx512.c) */
#define V_LOAD_E4M3(p)                                                                           \
  ({                                                                                             \
    __m256i b_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p)));       \
    __m256i m_ = _mm256_slli_epi32(_mm256_and_si256(b_, _mm256_set1_epi32(0x7f)), 20);            \
    __m256i s_ = _mm256_slli_epi32(_mm256_and_si256(b_, _mm256_set1_epi32(0x80)), 24);            \
    vf f_ = _mm256_mul_ps(_mm256_castsi256_ps(m_), _mm256_set1_ps(0x1p120f));                     \
    _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f_), s_));                            \
  })
/* 8 bytes of 4-bit values: lo = the low nibbles (elements 0,2,..), hi = the high ones. */
#define V_LOAD_Q4_PAIR(p, lo, hi)                                                                \
  do {                                                                                           \
    __m256i q_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p)));       \
    (lo) = _mm256_cvtepi32_ps(_mm256_and_si256(q_, _mm256_set1_epi32(15)));                       \
    (hi) = _mm256_cvtepi32_ps(_mm256_srli_epi32(q_, 4));                                          \
  } while (0)
/* shuffle_ps picks even (odd) elements per 128-bit lane; permute4x64 joins the lanes. */
#define V_DEINTERLEAVE(a, b, ev, od)                                                             \
  do {                                                                                           \
    vf a_ = (a), b_ = (b);                                                                       \
    (ev) = _mm256_castpd_ps(_mm256_permute4x64_pd(                                               \
        _mm256_castps_pd(_mm256_shuffle_ps(a_, b_, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));            \
    (od) = _mm256_castpd_ps(_mm256_permute4x64_pd(                                               \
        _mm256_castps_pd(_mm256_shuffle_ps(a_, b_, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));            \
  } while (0)

/* e^x: Cephes expf, 2^n built in the exponent field (n in [-126, 127] after clamping). */
static inline vf v_exp(vf x) {
  vf under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
  vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  vf p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  vf y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}
#define V_EXP(v) v_exp(v)

static inline void v_transpose(vf r[8]) {
  vf t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  vf t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  vf t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  vf t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  vf u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  vf u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  vf u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  vf u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  vf u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  vf u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  vf u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  vf u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

static inline void v_hsum4(vf a, vf b, vf c, vf d, float *out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

/* Tuning for 16 vector registers. */
#define MM_MR 6   /* GEMM tile: 6 rows x 16 features = 12 accumulators */
#define MM_NV 2
#define MM_KC 512
#define GV_R1 8
#define GV_R2 4
#define GV_R3 2
#define GV_R4 2
#define GV_MAX_M 8
#define AT_KBV 2  /* 16 keys per attention block */
#define AT_QB 16
#define AT_SQ 4
#define AT_PQ 2
#define AT_PD 4
#define AL_PD 12

#define KERN_SYM pd_cpu_kern_avx2
#define KERN_NAME "avx2"
#include "cpu_simd.h"

#endif
