/* pd_crcpool (pd/crc32.h) against pd_crc32 and zlib's crc32, with 1, 2, 3, 4 and 8 threads:
 *   - one buffer: lengths 0, 1, odd, around PD_CRCPOOL_MIN_BYTES, tens of MiB, random; random
 *     start offsets (misaligned) and random incoming crcs;
 *   - lists of buffers of random sizes (empty ones and NULL ones included) at random places;
 *   - many calls in a row on one pool just over the threshold (every call wakes the workers),
 *     interleaved with short ones, to catch lost or late wake-ups;
 *   - pools created and freed without use; a NULL pool; the thread limit;
 *   - pd_crcpool_copy_crc32v: the same lists and lengths (odd, misaligned sources and
 *     destinations, empty and NULL buffers, chained crcs, many calls in a row): dst equals the
 *     concatenation byte for byte, no byte around it is written, the CRC equals pd_crc32's.
 * Prints (does not check) GB/s of pd_crc32 and of the pool with 1 and 2 threads on 64 MiB that
 * is not in cache, and of copy + CRC: memcpy then pd_crc32, against copy_crc32v with 1 and 2
 * threads. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "pd/crc32.h"
#include "pd_test.h"

#ifdef PD_SANITIZED
#define BIG_MB 12
#define REPEAT 300
#else
#define BIG_MB 40
#define REPEAT 3000
#endif

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_rand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}
static size_t rand_below(size_t n) { return n ? (size_t)(next_rand() % n) : 0; }

static uint32_t zcrc(uint32_t crc, const unsigned char *p, size_t n) {
  while (n > 0) {
    const uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
    crc = (uint32_t)crc32((uLong)crc, p, k);
    p += k;
    n -= k;
  }
  return crc;
}

/* A buffer length for the list tests: empty (1/8), tiny (1/8), under the parallel threshold
 * (3/8) or up to big (3/8). */
static size_t random_len(size_t big) {
  const size_t kind = rand_below(8);
  return kind == 0   ? 0
         : kind == 1 ? rand_below(100)
         : kind <= 4 ? rand_below(PD_CRCPOOL_MIN_BYTES)
                     : rand_below(big);
}

static unsigned char *big;
static size_t big_len;

/* One buffer of len bytes at offset off of big, chained from crc. */
static void check_one(pd_crcpool *p, int threads, size_t off, size_t len, uint32_t crc) {
  const uint32_t want = pd_crc32(crc, big + off, len);
  const uint32_t got = pd_crcpool_crc32(p, crc, big + off, len);
  CHECKF(got == want, "%d threads, offset %zu, length %zu, crc %08x: %08x, pd_crc32 %08x",
         threads, off, len, crc, got, want);
  if (len <= (4u << 20)) /* zlib's table-driven crc is slow: on the shorter ones only */
    CHECKF(want == zcrc(crc, big + off, len), "pd_crc32 differs from zlib at length %zu", len);
}

static void check_lengths(pd_crcpool *p, int threads) {
  const size_t m = PD_CRCPOOL_MIN_BYTES;
  const size_t fixed[] = {0, 1, 2, 15, 63, 64, 65, 1000, 4097, m / 2 - 1, m / 2, m - 1, m,
                          m + 1, m + 63, m + 64, 2 * m - 1, 2 * m + 1, 3 * m + 17,
                          5 * m + 12345, 4u << 20, (4u << 20) - 7, (9u << 20) + 3};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
    const size_t off = rand_below(64);
    check_one(p, threads, off, fixed[i], (uint32_t)next_rand());
    check_one(p, threads, 0, fixed[i], 0);
  }
  check_one(p, threads, 0, big_len, 0);               /* tens of MiB */
  check_one(p, threads, 13, big_len - 13, 0xFFFFFFFFu);
  for (int t = 0; t < 40; t++) {
    size_t len = t % 4 == 0 ? rand_below(big_len) : rand_below(4 * m);
    size_t off = rand_below(big_len - len + 1);
    check_one(p, threads, off, len, (uint32_t)next_rand());
  }
}

/* Lists of up to 16 buffers of random sizes at random places (empty and NULL ones included). */
static void check_lists(pd_crcpool *p, int threads) {
  const void *bufs[16];
  size_t lens[16];
  for (int t = 0; t < 60; t++) {
    const int n = (int)rand_below(17);
    const uint32_t crc = (uint32_t)next_rand();
    uint32_t want = crc, wantz = crc;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
      size_t len = random_len(6u << 20);
      if (len > big_len) len = big_len;
      const size_t off = rand_below(big_len - len + 1);
      bufs[i] = len == 0 && (t & 1) ? NULL : big + off;
      lens[i] = len;
      want = pd_crc32(want, bufs[i], len);
      if (total + len <= (8u << 20)) wantz = zcrc(wantz, big + off, len);
      total += len;
    }
    const uint32_t got = pd_crcpool_crc32v(p, crc, bufs, lens, n);
    CHECKF(got == want, "%d threads, list %d of %d buffers (%zu bytes): %08x, pd_crc32 %08x",
           threads, t, n, total, got, want);
    if (total <= (8u << 20)) CHECKF(want == wantz, "list %d: pd_crc32 differs from zlib", t);
  }
  /* one list that is the big buffer cut at random points: equals one call over it */
  size_t pos = 0;
  int n = 0;
  while (n < 16 && pos < big_len) {
    size_t len = n == 15 ? big_len - pos : rand_below(big_len / 6);
    if (len > big_len - pos) len = big_len - pos;
    bufs[n] = big + pos;
    lens[n++] = len;
    pos += len;
  }
  CHECKF(pd_crcpool_crc32v(p, 0, bufs, lens, n) == pd_crc32(0, big, pos),
         "%d threads: the big buffer as a list of %d differs", threads, n);
}

/* Many calls in a row: each wakes the workers and waits for them. */
static void check_repeat(pd_crcpool *p, int threads) {
  const size_t m = PD_CRCPOOL_MIN_BYTES;
  int bad = 0;
  for (int t = 0; t < REPEAT; t++) {
    const size_t len = t % 3 == 2 ? rand_below(4096) : m + rand_below(m);
    const size_t off = rand_below(big_len - len + 1);
    const uint32_t crc = (uint32_t)next_rand();
    if (pd_crcpool_crc32(p, crc, big + off, len) != pd_crc32(crc, big + off, len)) bad++;
  }
  CHECKF(bad == 0, "%d threads: %d of %d repeated calls differ", threads, bad, REPEAT);
}

/* ---- copy + CRC ---- */

static unsigned char *cdst; /* big_len + 2 * 64 bytes: guards of 64 bytes around any dst */

/* copy_crc32v of bufs[0..n) to cdst + 64 + doff: dst and the CRC against the reference. */
static int check_copy(pd_crcpool *p, int threads, const void *const *bufs, const size_t *lens,
                      int n, size_t doff, uint32_t crc) {
  size_t total = 0;
  uint32_t want = crc;
  for (int i = 0; i < n; i++) {
    total += lens[i];
    want = pd_crc32(want, bufs[i], lens[i]);
  }
  REQUIRE(doff < 64 && total + doff <= big_len);
  memset(cdst, 0xA5, 64 + doff + total + 64);
  unsigned char *dst = cdst + 64 + doff;
  const uint32_t got = pd_crcpool_copy_crc32v(p, crc, dst, bufs, lens, n);
  int bad = got != want;
  CHECKF(got == want, "%d threads, copy of %d buffers (%zu bytes, dst +%zu): crc %08x, want %08x",
         threads, n, total, doff, got, want);
  size_t pos = 0;
  for (int i = 0; i < n; i++) {
    if (lens[i] && memcmp(dst + pos, bufs[i], lens[i]) != 0) {
      CHECKF(0, "%d threads, copy of %d buffers: buffer %d (%zu bytes at %zu) differs", threads,
             n, i, lens[i], pos);
      bad = 1;
    }
    pos += lens[i];
  }
  for (size_t k = 0; k < 64 + doff; k++)
    if (cdst[k] != 0xA5 || (k < 64 && dst[total + k] != 0xA5)) {
      CHECKF(0, "%d threads, copy of %zu bytes: wrote outside dst", threads, total);
      bad = 1;
      break;
    }
  return bad;
}

static void check_copy_all(pd_crcpool *p, int threads) {
  const size_t m = PD_CRCPOOL_MIN_BYTES;
  const size_t fixed[] = {0, 1, 15, 63, 64, 65, 4097, (64u << 10) - 1, (64u << 10) + 1, m - 1, m,
                          m + 1, m + 63, 2 * m + 1, 3 * m + 17, 5 * m + 12345, (9u << 20) + 3};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
    const size_t off = rand_below(64);
    const void *b[1] = {big + off};
    check_copy(p, threads, b, &fixed[i], 1, rand_below(64), (uint32_t)next_rand());
    b[0] = big;
    check_copy(p, threads, b, &fixed[i], 1, 0, 0);
  }
  const void *bufs[16];
  size_t lens[16];
  /* the big buffer whole, and cut at random points */
  bufs[0] = big;
  lens[0] = big_len - 64;
  check_copy(p, threads, bufs, lens, 1, 7, 0xFFFFFFFFu);
  /* random lists (empty and NULL ones included), odd places, total under big_len - 64 */
  for (int t = 0; t < 40; t++) {
    const int n = (int)rand_below(17);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
      size_t len = random_len(3u << 20);
      if (total + len > big_len - 64) len = 0;
      bufs[i] = len == 0 && (t & 1) ? NULL : big + rand_below(big_len - len + 1);
      lens[i] = len;
      total += len;
    }
    check_copy(p, threads, bufs, lens, n, rand_below(64), (uint32_t)next_rand());
  }
  /* many calls in a row: each wakes the workers */
  int bad = 0;
  const int reps = REPEAT / 5;
  for (int t = 0; t < reps; t++) {
    const int n = 1 + (int)rand_below(4);
    for (int i = 0; i < n; i++) {
      lens[i] = t % 3 == 2 ? rand_below(2048) : (m + rand_below(m)) / (size_t)n;
      bufs[i] = big + rand_below(big_len - lens[i] + 1);
    }
    bad += check_copy(p, threads, bufs, lens, n, rand_below(64), (uint32_t)next_rand());
    if (bad) break;
  }
  CHECKF(bad == 0, "%d threads: repeated copies differ", threads);
}

#ifdef PD_SANITIZED
static void timing(void) { printf("timing: skipped in a sanitizer build\n"); }
#else
static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void timing(void) {
  const size_t n = (size_t)64 << 20;
  unsigned char *a = malloc(n), *evict = malloc(n);
  REQUIRE(a && evict);
  for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 131 + (i >> 9));
  pd_crcpool *p1 = pd_crcpool_new(1, NULL), *p2 = pd_crcpool_new(2, NULL);
  REQUIRE(p1 && p2);
  const char *names[3] = {"pd_crc32", "pool, 1 thread", "pool, 2 threads"};
  double best[3] = {1e9, 1e9, 1e9};
  uint32_t c[3] = {0};
  for (int rep = 0; rep < 5; rep++)
    for (int k = 0; k < 3; k++) {
      memset(evict, rep + k, n); /* push a out of the caches */
      const double t0 = now_s();
      c[k] = k == 0 ? pd_crc32(0, a, n) : pd_crcpool_crc32(k == 1 ? p1 : p2, 0, a, n);
      const double dt = now_s() - t0;
      if (dt < best[k]) best[k] = dt;
    }
  CHECK(c[0] == c[1] && c[0] == c[2]);
  for (int k = 0; k < 3; k++)
    printf("timing: %-16s 64 MiB out of cache: %6.2f GB/s (best of 5)\n", names[k],
           (double)n / best[k] / 1e9);

  /* copy + CRC: as on a decode node, 4 MiB frames (16 of them) into one destination */
  unsigned char *d = malloc(n);
  REQUIRE(d);
  memset(d, 1, n); /* faulted in, as a reused staging buffer is */
  enum { NF = 16 };
  const void *fb[NF];
  size_t fl[NF];
  for (int i = 0; i < NF; i++) {
    fb[i] = a + (size_t)i * (n / NF);
    fl[i] = n / NF;
  }
  const char *cnames[3] = {"memcpy + pd_crc32", "copy_crc32v, 1 thr", "copy_crc32v, 2 thr"};
  double cbest[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 5; rep++)
    for (int k = 0; k < 3; k++) {
      memset(evict, rep + k, n);
      const double t0 = now_s();
      uint32_t cc;
      if (k == 0) {
        for (int i = 0; i < NF; i++) memcpy(d + (size_t)i * (n / NF), fb[i], fl[i]);
        cc = 0;
        for (int i = 0; i < NF; i++) cc = pd_crc32(cc, fb[i], fl[i]);
      } else {
        cc = pd_crcpool_copy_crc32v(k == 1 ? p1 : p2, 0, d, fb, fl, NF);
      }
      const double dt = now_s() - t0;
      CHECK(cc == c[0] && memcmp(d, a, n) == 0);
      if (dt < cbest[k]) cbest[k] = dt;
    }
  for (int k = 0; k < 3; k++)
    printf("timing: %-18s 64 MiB out of cache: %6.2f GB/s (best of 5)\n", cnames[k],
           (double)n / cbest[k] / 1e9);
  free(d);
  pd_crcpool_free(p1);
  pd_crcpool_free(p2);
  free(a);
  free(evict);
}
#endif

int main(void) {
  big_len = ((size_t)BIG_MB << 20) + 77;
  big = malloc(big_len);
  cdst = malloc(big_len + 128);
  REQUIRE(big && cdst);
  for (size_t i = 0; i < big_len; i++) big[i] = (unsigned char)next_rand();

  /* no pool, a pool without workers, the limit, create/free without use */
  CHECK(pd_crcpool_threads(NULL) == 1);
  CHECK(pd_crcpool_crc32(NULL, 0, "123456789", 9) == 0xCBF43926u);
  check_one(NULL, 1, 3, 3 * PD_CRCPOOL_MIN_BYTES + 5, 0x12345678u);
  {
    const void *b[2] = {big + 1, big + 5};
    const size_t l[2] = {PD_CRCPOOL_MIN_BYTES + 3, 2 * PD_CRCPOOL_MIN_BYTES};
    check_copy(NULL, 1, b, l, 2, 3, 0x12345678u);
  }
  pd_err e = {0};
  CHECK(pd_crcpool_new(257, &e) == NULL && e.code == PD_EINVAL);
  for (int t = -1; t <= 8; t++) {
    pd_crcpool *p = pd_crcpool_new(t, &e);
    REQUIRE(p);
    CHECK(pd_crcpool_threads(p) == (t < 1 ? 1 : t));
    pd_crcpool_free(p);
  }
  pd_crcpool_free(NULL);

  const int counts[] = {1, 2, 3, 4, 8};
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    const int t = counts[i];
    pd_crcpool *p = pd_crcpool_new(t, &e);
    REQUIRE(p);
    CHECK(pd_crcpool_crc32(p, 0, "123456789", 9) == 0xCBF43926u);
    check_lengths(p, t);
    check_lists(p, t);
    check_repeat(p, t);
    check_copy_all(p, t);
    pd_crcpool_free(p);
    printf("%d thread(s): checked\n", t);
  }
  free(big);
  free(cdst);
  timing();
  return pd_test_finish("test_net_crcpool");
}
