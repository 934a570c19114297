/* Element types of weights, activations and KV cache, with exact conversions. */
#ifndef PD_DTYPE_H
#define PD_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_dtype {
  PD_DTYPE_F32 = 0,
  PD_DTYPE_F16,
  PD_DTYPE_BF16,
  PD_DTYPE_F64,
  PD_DTYPE_I8,
  PD_DTYPE_U8,
  PD_DTYPE_I16,
  PD_DTYPE_I32,
  PD_DTYPE_I64,
  PD_DTYPE_BOOL,
  PD_DTYPE_F8_E4M3,
  PD_DTYPE_F8_E5M2,
  /* 4-bit weights in blocks of 32 along a row (the engine's form of AWQ, GPTQ and
   * compressed-tensors INT4 checkpoints; never a file's dtype). A row of K elements (K a
   * multiple of 32) is K / 2 bytes of values, byte j holding element 2j in its low nibble and
   * 2j + 1 in its high one, then K / 32 pairs of f16 (scale, zero) for its blocks of 32:
   * w = (q - zero) * scale, exact in float32. */
  PD_DTYPE_Q4,
  /* FP8 weights (compressed-tensors float-quantized; never a file's dtype): a row of K elements
   * (K a multiple of 16) is K bytes of e4m3 values then one f32 scale: w = e4m3 * scale. F8WA:
   * the same, and the activations go through FP8 quantize-dequantize per row (token) first:
   * x' = e4m3(x / s) * s with s = max|x| / 448, as the checkpoint's dynamic activation scheme. */
  PD_DTYPE_F8W,
  PD_DTYPE_F8WA,
  /* F8WS: FP8 weights with a static activation scale (compressed-tensors FP8 with input_scale):
   * a row is K e4m3 bytes, the f32 weight scale, then the f32 activation scale s_in (the same in
   * every row of a product: the largest of the fused modules'): x' = e4m3(x / s_in) * s_in,
   * saturating. */
  PD_DTYPE_F8WS,
  PD_DTYPE_COUNT
} pd_dtype;

/* Elements per block of PD_DTYPE_Q4, and the bytes of one row of K elements. */
#define PD_Q4_BLOCK 32

/* Bytes per element (1 for the 8-bit types; 0 for PD_DTYPE_Q4, see pd_dtype_row_bytes). */
size_t pd_dtype_size(pd_dtype t);
/* Bytes of one row of cols elements (PD_DTYPE_Q4: cols / 2 + cols / 8; F8W, F8WA: cols + 4;
 * F8WS: cols + 8). */
size_t pd_dtype_row_bytes(pd_dtype t, int64_t cols);
/* safetensors spelling: "F32", "BF16", ... */
const char *pd_dtype_name(pd_dtype t);
/* Parses a safetensors dtype string; returns -1 when unknown. */
int pd_dtype_from_name(const char *s);

static inline float pd_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t pd_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float pd_f16_to_f32(uint16_t h);
/* FP8 e4m3 (the "fn" variant: no infinities, 0x7f / 0xff NaN) to float32, exact. */
float pd_e4m3_to_f32(uint8_t b);
/* float32 to e4m3, rounded to nearest even and saturated to +-448 (torch's .to(float8_e4m3fn)
 * of a value already clamped to that range); NaN stays NaN. */
uint8_t pd_f32_to_e4m3(float f);
uint16_t pd_f32_to_f16(float f);

/* Converts n elements of type t at src into float32 at dst. t must be F32, F16 or BF16. */
void pd_convert_to_f32(float *dst, const void *src, pd_dtype t, size_t n);

#ifdef __cplusplus
}
#endif
#endif
