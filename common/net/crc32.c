/* pd_crc32 (pd/crc32.h). The KV payloads are tens of MB a request and both the prefill node
 * (which sums what it sends) and the decode node (which checks it) do it on their loop thread:
 * zlib's table-driven crc32 runs at ~2-4 GB/s, which measured ~6 s of each node's loop over 17 GB
 * of KV in a serving run on the H200 host. Folding with PCLMULQDQ runs several times faster.
 *
 * The folding follows Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
 * Instruction" (2009) for the bit-reflected CRC-32: four 128-bit lanes folded 64 bytes at a time
 * by x^(4*128+-32) mod P, the lanes folded into one, 16-byte steps, 128 -> 64 bits, then a Barrett
 * reduction to 32 bits; the constants are those the paper derives for P = 0x104C11DB7 (also
 * used by zlib's and Linux's folding implementations). Inputs of at least 64 bytes go through
 * it in whole 16-byte blocks; the rest goes to zlib. */
#include "pd/crc32.h"

#include <string.h>
#include <zlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PD_CRC_CLMUL 1

/* d NULL: CRC only; else the bytes are also stored to d as they are loaded (pd_crc32_copy): the
 * copy costs no second read of p, and its memory traffic overlaps the folding's multiplies. */
__attribute__((target("pclmul,sse4.1"), always_inline)) static inline uint32_t
crc_fold_impl(const unsigned char *p, size_t len, uint32_t crc, unsigned char *d) {
  /* len >= 64, len % 16 == 0; crc is the inverted running value (zlib's ~crc) */
  const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
  const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
  const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124LL);
  const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 0x00));
  __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 0x10));
  __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 0x20));
  __m128i x4 = _mm_loadu_si128((const __m128i *)(p + 0x30));
  if (d) {
    _mm_storeu_si128((__m128i *)(d + 0x00), x1);
    _mm_storeu_si128((__m128i *)(d + 0x10), x2);
    _mm_storeu_si128((__m128i *)(d + 0x20), x3);
    _mm_storeu_si128((__m128i *)(d + 0x30), x4);
    d += 64;
  }
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
  p += 64;
  len -= 64;
  while (len >= 64) { /* four lanes, 64 bytes a step */
    __m128i l1 = _mm_clmulepi64_si128(x1, k1k2, 0x00), h1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
    __m128i l2 = _mm_clmulepi64_si128(x2, k1k2, 0x00), h2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
    __m128i l3 = _mm_clmulepi64_si128(x3, k1k2, 0x00), h3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
    __m128i l4 = _mm_clmulepi64_si128(x4, k1k2, 0x00), h4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
    const __m128i y1 = _mm_loadu_si128((const __m128i *)(p + 0x00));
    const __m128i y2 = _mm_loadu_si128((const __m128i *)(p + 0x10));
    const __m128i y3 = _mm_loadu_si128((const __m128i *)(p + 0x20));
    const __m128i y4 = _mm_loadu_si128((const __m128i *)(p + 0x30));
    if (d) {
      _mm_storeu_si128((__m128i *)(d + 0x00), y1);
      _mm_storeu_si128((__m128i *)(d + 0x10), y2);
      _mm_storeu_si128((__m128i *)(d + 0x20), y3);
      _mm_storeu_si128((__m128i *)(d + 0x30), y4);
      d += 64;
    }
    x1 = _mm_xor_si128(_mm_xor_si128(l1, h1), y1);
    x2 = _mm_xor_si128(_mm_xor_si128(l2, h2), y2);
    x3 = _mm_xor_si128(_mm_xor_si128(l3, h3), y3);
    x4 = _mm_xor_si128(_mm_xor_si128(l4, h4), y4);
    p += 64;
    len -= 64;
  }
  /* the four lanes into one */
  __m128i lo = _mm_clmulepi64_si128(x1, k3k4, 0x00), hi = _mm_clmulepi64_si128(x1, k3k4, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(lo, hi), x2);
  lo = _mm_clmulepi64_si128(x1, k3k4, 0x00);
  hi = _mm_clmulepi64_si128(x1, k3k4, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(lo, hi), x3);
  lo = _mm_clmulepi64_si128(x1, k3k4, 0x00);
  hi = _mm_clmulepi64_si128(x1, k3k4, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(lo, hi), x4);
  while (len >= 16) { /* 16 bytes a step */
    lo = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    hi = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    const __m128i y = _mm_loadu_si128((const __m128i *)p);
    if (d) {
      _mm_storeu_si128((__m128i *)d, y);
      d += 16;
    }
    x1 = _mm_xor_si128(_mm_xor_si128(lo, hi), y);
    p += 16;
    len -= 16;
  }
  /* 128 -> 64 bits */
  x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_and_si128(x1, mask32);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, k5, 0x00), x2);
  /* Barrett reduction to 32 bits */
  x2 = _mm_and_si128(x1, mask32);
  x2 = _mm_clmulepi64_si128(x2, poly, 0x10);
  x2 = _mm_and_si128(x2, mask32);
  x2 = _mm_clmulepi64_si128(x2, poly, 0x00);
  x1 = _mm_xor_si128(x1, x2);
  return (uint32_t)_mm_extract_epi32(x1, 1);
}

__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_fold(const unsigned char *p,
                                                                     size_t len, uint32_t crc) {
  return crc_fold_impl(p, len, crc, NULL);
}

__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_fold_copy(unsigned char *d,
                                                                          const unsigned char *p,
                                                                          size_t len,
                                                                          uint32_t crc) {
  return crc_fold_impl(p, len, crc, d);
}

static int have_clmul(void) {
  static int v = -1;
  if (v < 0) {
    __builtin_cpu_init();
    v = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  }
  return v;
}
#endif

int pd_crc32_accelerated(void) {
#ifdef PD_CRC_CLMUL
  return have_clmul();
#else
  return 0;
#endif
}

uint32_t pd_crc32(uint32_t crc, const void *buf, size_t len) {
  const unsigned char *p = buf;
#ifdef PD_CRC_CLMUL
  if (len >= 64 && have_clmul()) {
    const size_t n = len & ~(size_t)15;
    crc = ~crc_fold(p, n, ~crc);
    p += n;
    len -= n;
  }
#endif
  while (len > 0) { /* zlib takes uInt lengths */
    const uInt n = len > (1u << 30) ? (1u << 30) : (uInt)len;
    crc = (uint32_t)crc32((uLong)crc, p, n);
    p += n;
    len -= n;
  }
  return crc;
}

uint32_t pd_crc32_copy(uint32_t crc, void *dst, const void *src, size_t len) {
  unsigned char *d = dst;
  const unsigned char *p = src;
#ifdef PD_CRC_CLMUL
  if (len >= 64 && have_clmul()) {
    const size_t n = len & ~(size_t)15;
    crc = ~crc_fold_copy(d, p, n, ~crc);
    d += n;
    p += n;
    len -= n;
  }
#endif
  /* the rest (or everything without PCLMULQDQ): in pieces that stay in L1 between the two */
  while (len > 0) {
    const size_t n = len > ((size_t)16 << 10) ? ((size_t)16 << 10) : len;
    memcpy(d, p, n);
    crc = (uint32_t)crc32((uLong)crc, d, (uInt)n);
    d += n;
    p += n;
    len -= n;
  }
  return crc;
}
