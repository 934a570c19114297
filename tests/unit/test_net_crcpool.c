/* pd_crcpool (pd/crc32.h) against pd_crc32 and zlib's crc32, with 1, 2, 3, 4 and 8 threads:
 *   - one buffer: lengths 0, 1, odd, around PD_CRCPOOL_MIN_BYTES, tens of MiB, random; random
 *     start offsets (misaligned) and random incoming crcs;
 *   - lists of buffers of random sizes (empty ones and NULL ones included) at random places;
 *   - many calls in a row on one pool just over the threshold (every call wakes the workers),
 *     interleaved with short ones, to catch lost or late wake-ups;
 *   - pools created and freed without use; a NULL pool; the thread limit.
 * Prints (does not check) GB/s of pd_crc32 and of the pool with 1 and 2 threads on 64 MiB that
 * is not in cache. */
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
      const size_t kind = rand_below(8);
      size_t len = kind == 0   ? 0
                   : kind == 1 ? rand_below(100)
                   : kind <= 4 ? rand_below(PD_CRCPOOL_MIN_BYTES)
                               : rand_below(6u << 20);
      if (len > big_len) len = big_len;
      const size_t off = rand_below(big_len - len + 1);
      bufs[i] = len == 0 && kind == 0 && (t & 1) ? NULL : big + off;
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
  pd_crcpool_free(p1);
  pd_crcpool_free(p2);
  free(a);
  free(evict);
}
#endif

int main(void) {
  big_len = ((size_t)BIG_MB << 20) + 77;
  big = malloc(big_len);
  REQUIRE(big);
  for (size_t i = 0; i < big_len; i++) big[i] = (unsigned char)next_rand();

  /* no pool, a pool without workers, the limit, create/free without use */
  CHECK(pd_crcpool_threads(NULL) == 1);
  CHECK(pd_crcpool_crc32(NULL, 0, "123456789", 9) == 0xCBF43926u);
  check_one(NULL, 1, 3, 3 * PD_CRCPOOL_MIN_BYTES + 5, 0x12345678u);
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
    pd_crcpool_free(p);
    printf("%d thread(s): checked\n", t);
  }
  free(big);
  timing();
  return pd_test_finish("test_net_crcpool");
}
