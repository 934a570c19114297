/* Portable kernels: plain C, one float per "vector". Always built; the fallback on CPUs without
 * AVX2 and on other architectures, and a third implementation the tests hold the SIMD ones to. */
#include <math.h>

#include "cpu_internal.h"
#include "pd/dtype.h"

#define VL 1
typedef float vf;

#define V_KEEP(v) ((void)0)
#define V_ZERO() 0.0f
#define V_SET1(s) (s)
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_LOAD_N(p, n) ((n) > 0 ? *(p) : 0.0f)
#define V_STORE_N(p, v, n) ((n) > 0 ? (void)(*(p) = (v)) : (void)0)
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_MUL(a, b) ((a) * (b))
#define V_DIV(a, b) ((a) / (b))
#define V_MAX(a, b) ((a) > (b) ? (a) : (b))
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_FNMA(a, b, c) ((c) - (a) * (b))
#define V_BLEND_LT(a, b, x, y) ((a) < (b) ? (x) : (y))
#define V_HSUM(v) (v)
#define V_HMAX(v) (v)
#define V_EXP(v) ((v) < -87.33654f ? 0.0f : expf(v))
#define V_LOAD_BF16(p) pd_bf16_to_f32(*(p))
#define V_LOAD_F16(p) pd_f16_to_f32(*(p))
#define V_LOAD_BF16_N(p, n) ((n) > 0 ? pd_bf16_to_f32(*(p)) : 0.0f)
#define V_LOAD_F16_N(p, n) ((n) > 0 ? pd_f16_to_f32(*(p)) : 0.0f)
#define V_LOAD_BF16_PAIR(p, lo, hi)                                                              \
  do {                                                                                           \
    (lo) = pd_bf16_to_f32((p)[0]);                                                               \
    (hi) = pd_bf16_to_f32((p)[1]);                                                               \
  } while (0)
#define V_LOAD_E4M3(p) pd_e4m3_to_f32(*(const uint8_t *)(p))
#define V_LOAD_Q4_PAIR(p, lo, hi)                                                                \
  do {                                                                                           \
    (lo) = (float)(*(const uint8_t *)(p) & 15);                                                  \
    (hi) = (float)(*(const uint8_t *)(p) >> 4);                                                  \
  } while (0)
#define V_DEINTERLEAVE(a, b, ev, od)                                                             \
  do {                                                                                           \
    (ev) = (a);                                                                                  \
    (od) = (b);                                                                                  \
  } while (0)

static inline void v_transpose(vf r[1]) { (void)r; }
static inline void v_hsum4(vf a, vf b, vf c, vf d, float *out) {
  out[0] = a;
  out[1] = b;
  out[2] = c;
  out[3] = d;
}

#define MM_MR 4
#define MM_NV 4
#define MM_KC 512
#define GV_R1 4
#define GV_R2 4
#define GV_R3 2
#define GV_R4 2
#define GV_MAX_M 4
#define AT_KBV 8
#define AT_QB 8
#define AT_SQ 2
#define AT_PQ 2
#define AT_PD 4
#define AL_PD 4

#define KERN_SYM pd_cpu_kern_generic
#define KERN_NAME "generic"
#include "cpu_simd.h"
