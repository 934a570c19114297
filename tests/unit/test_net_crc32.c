/* pd_crc32 against zlib's crc32: every length 0..600 at every start offset 0..15, chained calls
 * that split a buffer at random points, a 9 MB buffer, and the standard check value.
 * pd_crc32_copy: the same CRCs, and dst equal to the source with no byte around it written, for
 * every length 0..600 at source and destination offsets 0..15, and 9 MB + 13 bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "pd/crc32.h"
#include "pd_test.h"

static uint32_t zcrc(uint32_t crc, const unsigned char *p, size_t n) {
  return (uint32_t)crc32((uLong)crc, p, (uInt)n);
}

int main(void) {
  printf("carry-less multiplication path: %s\n", pd_crc32_accelerated() ? "yes" : "no");
  CHECKF(pd_crc32(0, "123456789", 9) == 0xCBF43926u, "check value %08x", pd_crc32(0, "123456789", 9));
  const size_t big = (9u << 20) + 13;
  unsigned char *b = malloc(big);
  REQUIRE(b);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < big; i++) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    b[i] = (unsigned char)s;
  }
  int bad = 0;
  for (int off = 0; off < 16; off++)
    for (size_t n = 0; n <= 600; n++) {
      const uint32_t seed = (uint32_t)(n * 2654435761u);
      if (pd_crc32(seed, b + off, n) != zcrc(seed, b + off, n) && bad++ < 5)
        CHECKF(0, "offset %d length %zu: %08x vs zlib %08x", off, n, pd_crc32(seed, b + off, n),
               zcrc(seed, b + off, n));
    }
  CHECKF(bad == 0, "%d short inputs differ from zlib", bad);
  CHECKF(pd_crc32(0, b, big) == zcrc(0, b, big), "9 MB: %08x vs %08x", pd_crc32(0, b, big),
         zcrc(0, b, big));
  /* pd_crc32_copy: lengths 0..600, misaligned source and destination, guards around dst */
  unsigned char *d = malloc(big + 64);
  REQUIRE(d);
  bad = 0;
  for (int off = 0; off < 16; off++)
    for (size_t n = 0; n <= 600; n++) {
      const int doff = (off * 7 + (int)n) % 16;
      const uint32_t seed = (uint32_t)(n * 2654435761u);
      memset(d, 0x5A, n + 48);
      const uint32_t c = pd_crc32_copy(seed, d + 16 + doff, b + off, n);
      int ok = c == zcrc(seed, b + off, n) && memcmp(d + 16 + doff, b + off, n) == 0;
      for (int k = 0; k < 16 + doff; k++) ok = ok && d[k] == 0x5A;
      for (int k = 0; k < 16; k++) ok = ok && d[16 + doff + n + (size_t)k] == 0x5A;
      if (!ok && bad++ < 5) CHECKF(0, "copy: offsets %d/%d length %zu differ", off, doff, n);
    }
  CHECKF(bad == 0, "%d short copies differ", bad);
  CHECKF(pd_crc32_copy(7, d + 3, b, big) == pd_crc32(7, b, big) && memcmp(d + 3, b, big) == 0,
         "copy of 9 MB differs");
  free(d);
  /* chained over random splits */
  for (int t = 0; t < 50; t++) {
    size_t pos = 0;
    uint32_t c = 0;
    const size_t end = 100000 + (size_t)t * 977;
    while (pos < end) {
      size_t n = (size_t)(rand() % 5000);
      if (n > end - pos) n = end - pos;
      c = pd_crc32(c, b + pos, n);
      pos += n;
    }
    CHECKF(c == zcrc(0, b, end), "chained %d: %08x vs %08x", t, c, zcrc(0, b, end));
  }
  free(b);
  return pd_test_finish("test_net_crc32");
}
