/* The CUDA backend's KV staging ops (kv_gather, kv_scatter, host_alloc, host_free) against the
 * CPU backend's (memcpy), byte for byte:
 *   - random segments: sizes of 1 byte to 64 KiB, 16-byte aligned (the vectorised kernels) and
 *     not (the byte kernels: odd sizes, odd strides, odd offsets), strides from tight to
 *     loose, shuffled and (gather only) repeated ids, n = 0 and seg_bytes = 0;
 *   - large calls: more packed bytes than one staging batch (32 MiB: several batches), more ids
 *     than one batch (1 << 20), a segment larger than a batch (moved in pieces), and host
 *     transfers of many 8 MiB pinned chunks;
 *   - every call once with a pageable (malloc) host buffer and once with a page-locked one
 *     (host_alloc), at an offset inside it;
 *   - the batched ops (kv_gather_runs / kv_scatter_runs) against the CPU's: up to 12 runs of
 *     aligned (vectorised) and unaligned (byte) segments mixed in one call, back to back or with
 *     gaps in the host buffer (which a gather must leave as they were), in any host order, empty
 *     runs; and large calls cut into several batches: more packed bytes than the staging cap
 *     (32 MiB), a segment larger than it among small runs, more ids than a batch holds, more
 *     pieces than a batch's table holds (40,000 one-segment runs);
 *   - pd_kvstage pack / unpack of a device cache against pd_kvpack on a host copy of it: random
 *     geometries, frame cuts and head resharding (tests/unit/test_net_kvstage.c does the same on
 *     the CPU backend), with the batched ops and with them removed from the table, into pageable
 *     and page-locked frames.
 * Scatter results are read back whole, so a write outside the segments shows up too. Prints the
 * gather / scatter bandwidth of a 64 MiB transfer, and the time of one 3.6 MiB frame of 12 runs
 * (6 layers of K and V, 10 blocks of 32 KiB: Llama-3-8B, a 150-token prompt) moved by 12
 * kv_gather / kv_scatter calls and by one kv_gather_runs / kv_scatter_runs. Exits 77 (skipped)
 * without a CUDA device. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd/backend.h"
#include "pd/backend_cuda.h"
#include "pd/kvpack.h"
#include "pd_test.h"

static pd_backend *g_cpu, *g_gpu;

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static size_t urand(size_t n) { return (size_t)(rnd() % (uint64_t)n); }

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  REQUIRE(p);
  return p;
}

static void fill(uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rnd();
    memcpy(p + i, &v, n - i < 8 ? n - i : 8);
  }
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static bool backend_ok(const char *what) {
  pd_err e = {0};
  if (pd_backend_cuda_status(g_gpu, &e) == PD_OK) return true;
  fprintf(stderr, "%s: backend status: %s\n", what, e.msg);
  pd_test_failures++;
  return false;
}

/* n ids: distinct (a random subset of [0, slots), shuffled) or with repeats. */
static int32_t *make_ids(int n, int slots, bool distinct) {
  int32_t *ids = xmalloc((size_t)n * sizeof *ids);
  if (!distinct) {
    for (int i = 0; i < n; i++) ids[i] = (int32_t)urand((size_t)slots);
    return ids;
  }
  int32_t *all = xmalloc((size_t)slots * sizeof *all);
  for (int i = 0; i < slots; i++) all[i] = i;
  for (int i = 0; i < n; i++) { /* partial Fisher-Yates: the first n of a shuffle */
    int j = i + (int)urand((size_t)(slots - i));
    int32_t t = all[i];
    all[i] = all[j];
    all[j] = t;
  }
  memcpy(ids, all, (size_t)n * sizeof *ids);
  free(all);
  return ids;
}

/* A device buffer and its host mirror (what the CPU ops run on). */
typedef struct mirror {
  size_t bytes;
  uint8_t *host;
  void *dev;
} mirror;

static void mirror_new(mirror *m, size_t bytes) {
  m->bytes = bytes;
  m->host = xmalloc(bytes);
  fill(m->host, bytes);
  m->dev = g_gpu->ops.alloc(g_gpu, bytes);
  REQUIRE(m->dev);
  g_gpu->ops.to_device(g_gpu, m->dev, m->host, bytes);
  g_gpu->ops.sync(g_gpu);
}

static void mirror_free(mirror *m) {
  g_gpu->ops.free(g_gpu, m->dev);
  free(m->host);
}

/* One (seg, stride, offset, ids) case: gather and scatter, pageable and page-locked host. */
static void one_case(mirror *m, const char *what, size_t seg, size_t stride, size_t offset,
                     const int32_t *ids, int n, bool distinct, uint8_t *pinned, size_t pinned_cap) {
  const size_t bytes = (size_t)n * seg;
  uint8_t *want = xmalloc(bytes + 64);
  uint8_t *pageable = xmalloc(bytes + 64);
  REQUIRE(bytes + 64 <= pinned_cap);
  for (int kind = 0; kind < 2; kind++) {
    /* host buffers at an odd offset inside their allocation */
    const size_t skew = urand(2) ? 0 : 1 + urand(15);
    uint8_t *h = (kind ? pinned : pageable) + skew;
    const char *hk = kind ? "page-locked" : "pageable";
    /* gather */
    g_cpu->ops.kv_gather(g_cpu, want, m->host, ids, n, stride, offset, seg);
    memset(h, 0x5a, bytes);
    g_gpu->ops.kv_gather(g_gpu, h, m->dev, ids, n, stride, offset, seg);
    if (!backend_ok(what)) break;
    CHECKF(!memcmp(h, want, bytes), "%s: gather into %s memory: seg %zu stride %zu offset %zu n %d",
           what, hk, seg, stride, offset, n);
    /* scatter (distinct ids only: repeated ones would race) */
    if (!distinct) continue;
    fill(h, bytes);
    g_cpu->ops.kv_scatter(g_cpu, m->host, h, ids, n, stride, offset, seg);
    g_gpu->ops.kv_scatter(g_gpu, m->dev, h, ids, n, stride, offset, seg);
    memset(h, 0, bytes); /* the host buffer may be reused at once */
    if (!backend_ok(what)) break;
    uint8_t *back = xmalloc(m->bytes);
    g_gpu->ops.to_host(g_gpu, back, m->dev, m->bytes);
    if (!backend_ok(what)) {
      free(back);
      break;
    }
    size_t first_bad = m->bytes;
    for (size_t i = 0; i < m->bytes && first_bad == m->bytes; i++)
      if (back[i] != m->host[i]) first_bad = i;
    CHECKF(first_bad == m->bytes,
           "%s: scatter from %s memory: seg %zu stride %zu offset %zu n %d: byte %zu differs", what,
           hk, seg, stride, offset, n, first_bad);
    free(back);
  }
  free(want);
  free(pageable);
}

/* A random segment geometry: half the time 16-byte aligned (segments of 16 * 1..64, sometimes up
 * to 16 * big16, strides and offsets multiples of 16: the vector path), else any sizes (1..300,
 * sometimes up to big: the byte path); one in eight back to back (stride = seg). */
static void random_geometry(size_t big16, size_t big, size_t *seg, size_t *stride,
                            size_t *offset) {
  if (urand(2)) {
    *seg = 16 * (1 + urand(urand(4) ? 64 : big16));
    *stride = *seg + 16 * urand(4);
    *offset = 16 * urand(4);
  } else {
    *seg = 1 + urand(urand(4) ? 300 : big);
    *stride = *seg + urand(70);
    *offset = urand(40);
  }
  if (urand(8) == 0) *stride = *seg; /* back to back */
}

static void random_segments(uint8_t *pinned, size_t pinned_cap) {
  mirror m;
  mirror_new(&m, (size_t)8 << 20);
  for (int iter = 0; iter < 120; iter++) {
    size_t seg, stride, offset;
    random_geometry(4096, 65536, &seg, &stride, &offset);
    int slots = (int)((m.bytes - offset - seg) / stride) + 1;
    int cap = (int)(((size_t)4 << 20) / seg); /* at most ~4 MiB per call */
    if (cap > slots) cap = slots;
    if (cap > 3000) cap = 3000;
    const int n = (int)urand((size_t)cap + 1);
    const bool distinct = urand(4) != 0;
    int32_t *ids = make_ids(n ? n : 1, slots, distinct);
    char what[64];
    const bool aligned = seg % 16 == 0 && stride % 16 == 0 && offset % 16 == 0;
    snprintf(what, sizeof what, "random %d (%s)", iter, aligned ? "aligned" : "unaligned");
    one_case(&m, what, seg, stride, offset, ids, n, distinct, pinned, pinned_cap);
    free(ids);
  }
  /* no-ops: n = 0 and seg_bytes = 0 leave everything as it is */
  int32_t id0 = 0;
  uint8_t sentinel[16];
  memset(sentinel, 0x77, sizeof sentinel);
  g_gpu->ops.kv_gather(g_gpu, sentinel, m.dev, &id0, 0, 64, 0, 64);
  g_gpu->ops.kv_gather(g_gpu, sentinel, m.dev, &id0, 1, 64, 0, 0);
  g_gpu->ops.kv_scatter(g_gpu, m.dev, sentinel, &id0, 0, 64, 0, 64);
  g_gpu->ops.kv_scatter(g_gpu, m.dev, sentinel, &id0, 1, 64, 0, 0);
  bool same = true;
  for (size_t i = 0; i < sizeof sentinel; i++) same &= sentinel[i] == 0x77;
  CHECK(same);
  uint8_t *back = xmalloc(m.bytes);
  g_gpu->ops.to_host(g_gpu, back, m.dev, m.bytes);
  CHECK(!memcmp(back, m.host, m.bytes));
  free(back);
  backend_ok("no-ops");
  mirror_free(&m);
}

static void large_calls(uint8_t *pinned, size_t pinned_cap) {
  mirror m;
  mirror_new(&m, (size_t)96 << 20);
  int32_t *ids;
  /* many ids: more than one batch of ids (1 << 20), 16-byte segments */
  ids = make_ids(1200000, (int)(m.bytes / 64), true);
  one_case(&m, "1.2M ids", 16, 64, 16, ids, 1200000, true, pinned, pinned_cap);
  free(ids);
  /* more bytes than one staging batch, many pinned chunks; unaligned stride */
  ids = make_ids(2900, (int)((m.bytes - 12288) / 12296), true);
  one_case(&m, "35 MiB of 12 KiB segments", 12288, 12296, 3, ids, 2900, true, pinned, pinned_cap);
  free(ids);
  /* segments larger than a batch: moved in pieces */
  const size_t big = ((size_t)33 << 20) + 5;
  int32_t two[2] = {1, 0};
  one_case(&m, "two 33 MiB segments", big, big + 7, 11, two, 2, true, pinned, pinned_cap);
  backend_ok("large calls");

  /* bandwidth of a 64 MiB transfer: 4096 segments of 16 KiB (a 7B model's layer, 4k tokens) */
  const int n = 4096;
  const size_t seg = 16384, bytes = (size_t)n * seg;
  ids = make_ids(n, (int)(m.bytes / seg), true);
  uint8_t *pageable = xmalloc(bytes);
  for (int kind = 0; kind < 2; kind++) {
    uint8_t *h = kind ? pinned : pageable;
    g_gpu->ops.kv_gather(g_gpu, h, m.dev, ids, n, seg, 0, seg); /* warm */
    double t0 = now();
    for (int r = 0; r < 3; r++) g_gpu->ops.kv_gather(g_gpu, h, m.dev, ids, n, seg, 0, seg);
    double tg = (now() - t0) / 3;
    t0 = now();
    for (int r = 0; r < 3; r++) g_gpu->ops.kv_scatter(g_gpu, m.dev, h, ids, n, seg, 0, seg);
    double ts = (now() - t0) / 3;
    printf("kv_gather %s: %.1f GB/s, kv_scatter: %.1f GB/s (64 MiB, 16 KiB segments)\n",
           kind ? "page-locked" : "pageable", bytes / tg / 1e9, bytes / ts / 1e9);
  }
  free(pageable);
  free(ids);
  backend_ok("bandwidth");
  mirror_free(&m);
}

/* ---- the batched ops ---- */

/* One batched call, gather and scatter, pageable and page-locked host: runs[r] over the mirror
 * (bases relative to its start: dev_runs on the device, host_runs on the mirror), host_bytes of
 * host buffer. Scatter only when the runs' cache segments are disjoint. */
static void runs_case(mirror *m, const char *what, const pd_kv_run *rel, int n_runs,
                      size_t host_bytes, bool scatter, uint8_t *pinned, size_t pinned_cap) {
  pd_kv_run *dr = xmalloc((size_t)n_runs * sizeof *dr), *hr = xmalloc((size_t)n_runs * sizeof *hr);
  for (int r = 0; r < n_runs; r++) {
    dr[r] = hr[r] = rel[r];
    dr[r].base = (const uint8_t *)m->dev + (uintptr_t)rel[r].base;
    hr[r].base = m->host + (uintptr_t)rel[r].base;
  }
  REQUIRE(host_bytes + 16 <= pinned_cap);
  uint8_t *want = xmalloc(host_bytes), *pageable = xmalloc(host_bytes + 16);
  for (int kind = 0; kind < 2; kind++) {
    const size_t skew = urand(2) ? 0 : 1 + urand(15);
    uint8_t *h = (kind ? pinned : pageable) + skew;
    const char *hk = kind ? "page-locked" : "pageable";
    /* gather: the bytes between runs stay as they were */
    fill(want, host_bytes);
    memcpy(h, want, host_bytes);
    g_cpu->ops.kv_gather_runs(g_cpu, want, hr, n_runs);
    g_gpu->ops.kv_gather_runs(g_gpu, h, dr, n_runs);
    if (!backend_ok(what)) break;
    size_t bad = host_bytes;
    for (size_t i = 0; i < host_bytes && bad == host_bytes; i++)
      if (h[i] != want[i]) bad = i;
    CHECKF(bad == host_bytes, "%s: kv_gather_runs into %s memory (%d runs): byte %zu differs",
           what, hk, n_runs, bad);
    if (!scatter) continue;
    fill(h, host_bytes);
    g_cpu->ops.kv_scatter_runs(g_cpu, h, hr, n_runs);
    g_gpu->ops.kv_scatter_runs(g_gpu, h, dr, n_runs);
    memset(h, 0, host_bytes); /* the host buffer may be reused at once */
    if (!backend_ok(what)) break;
    uint8_t *back = xmalloc(m->bytes);
    g_gpu->ops.to_host(g_gpu, back, m->dev, m->bytes);
    bad = m->bytes;
    for (size_t i = 0; i < m->bytes && bad == m->bytes; i++)
      if (back[i] != m->host[i]) bad = i;
    CHECKF(bad == m->bytes, "%s: kv_scatter_runs from %s memory (%d runs): byte %zu differs",
           what, hk, n_runs, bad);
    free(back);
    if (bad != m->bytes) { /* resynchronise the mirror for the next cases */
      g_gpu->ops.to_device(g_gpu, m->dev, m->host, m->bytes);
      g_gpu->ops.sync(g_gpu);
    }
  }
  free(want);
  free(pageable);
  free(dr);
  free(hr);
}

/* Lays runs out in the host buffer: in list order or shuffled, back to back or with gaps.
 * Returns the host bytes they span. */
static size_t place_runs(pd_kv_run *runs, int n_runs, bool shuffle, bool gaps) {
  int *order = xmalloc((size_t)n_runs * sizeof *order);
  for (int r = 0; r < n_runs; r++) order[r] = r;
  for (int r = n_runs - 1; shuffle && r > 0; r--) {
    int j = (int)urand((size_t)r + 1), t = order[r];
    order[r] = order[j];
    order[j] = t;
  }
  size_t pos = 0;
  for (int k = 0; k < n_runs; k++) {
    pd_kv_run *R = &runs[order[k]];
    if (gaps) pos += urand(40);
    R->host_off = pos;
    pos += (size_t)R->n * R->seg_bytes;
  }
  free(order);
  return pos + (gaps ? urand(40) : 0);
}

static void batched_ops(uint8_t *pinned, size_t pinned_cap) {
  mirror m;
  mirror_new(&m, (size_t)96 << 20);
  REQUIRE(g_gpu->ops.kv_gather_runs && g_gpu->ops.kv_scatter_runs && g_cpu->ops.kv_gather_runs);
  /* random mixes: run r in its own 1 MiB region of the mirror (so scatters never overlap) */
  const size_t region = (size_t)1 << 20;
  for (int iter = 0; iter < 80; iter++) {
    const int n_runs = 1 + (int)urand(12);
    pd_kv_run runs[12];
    int32_t *ids[12];
    for (int r = 0; r < n_runs; r++) {
      size_t seg, stride, offset;
      random_geometry(2048, 20000, &seg, &stride, &offset);
      const int slots = (int)((region - offset - seg) / stride) + 1;
      int cap = (int)(((size_t)2 << 20) / (seg * (size_t)n_runs)) + 1;
      if (cap > slots) cap = slots;
      const int n = urand(10) == 0 ? 0 : (int)urand((size_t)cap) + 1;
      ids[r] = make_ids(n ? n : 1, slots, true);
      runs[r] = (pd_kv_run){(const void *)(uintptr_t)(r * region), ids[r], n, stride, offset, seg,
                            0};
    }
    const size_t host_bytes = place_runs(runs, n_runs, urand(3) == 0, urand(2));
    char what[64];
    snprintf(what, sizeof what, "runs %d", iter);
    runs_case(&m, what, runs, n_runs, host_bytes, true, pinned, pinned_cap);
    for (int r = 0; r < n_runs; r++) free(ids[r]);
  }
  /* several batches: 4 runs of 640 x 16 KiB (40 MiB) back to back */
  {
    pd_kv_run runs[4];
    int32_t *ids = make_ids(4 * 640, (int)(m.bytes / 16384), true);
    for (int r = 0; r < 4; r++)
      runs[r] = (pd_kv_run){0, ids + r * 640, 640, 16384, 0, 16384, 0};
    size_t hb = place_runs(runs, 4, false, false);
    runs_case(&m, "40 MiB in 4 runs", runs, 4, hb, true, pinned, pinned_cap);
    free(ids);
  }
  /* a 33 MiB segment (moved in pieces) between small unaligned runs, with gaps */
  {
    const size_t big = ((size_t)33 << 20) + 5;
    int32_t one = 1, small[3] = {5, 0, 9};
    pd_kv_run runs[3] = {
        {(const void *)(uintptr_t)((size_t)70 << 20), small, 3, 1001, 3, 999, 0},
        {0, &one, 1, big + 7, 11, big, 0},
        {(const void *)(uintptr_t)((size_t)80 << 20), small, 3, 4096, 0, 4096, 0},
    };
    size_t hb = place_runs(runs, 3, true, true);
    runs_case(&m, "a 33 MiB segment among small runs", runs, 3, hb, true, pinned, pinned_cap);
  }
  /* more ids than a batch (1 << 20): 1.2M 16-byte segments in two runs */
  {
    int32_t *ids = make_ids(1200000, (int)(m.bytes / 64), true);
    pd_kv_run runs[2] = {{0, ids, 700000, 64, 16, 16, 0}, {0, ids + 700000, 500000, 64, 16, 16, 0}};
    size_t hb = place_runs(runs, 2, false, false);
    runs_case(&m, "1.2M ids in 2 runs", runs, 2, hb, true, pinned, pinned_cap);
    free(ids);
  }
  /* more pieces than a batch's table (32768): 40,000 runs of one 24-byte segment */
  {
    const int nr = 40000;
    int32_t *ids = make_ids(nr, (int)(m.bytes / 40), true);
    pd_kv_run *runs = xmalloc((size_t)nr * sizeof *runs);
    for (int r = 0; r < nr; r++) runs[r] = (pd_kv_run){0, ids + r, 1, 40, 8, 24, 0};
    size_t hb = place_runs(runs, nr, true, false);
    runs_case(&m, "40,000 one-segment runs", runs, nr, hb, true, pinned, pinned_cap);
    free(runs);
    free(ids);
  }
  /* nothing to do: no runs, empty runs */
  {
    uint8_t sentinel[16];
    memset(sentinel, 0x77, sizeof sentinel);
    int32_t id0 = 0;
    pd_kv_run empty[2] = {{m.dev, &id0, 0, 64, 0, 64, 0}, {m.dev, &id0, 1, 64, 0, 0, 0}};
    g_gpu->ops.kv_gather_runs(g_gpu, sentinel, empty, 0);
    g_gpu->ops.kv_gather_runs(g_gpu, sentinel, empty, 2);
    g_gpu->ops.kv_scatter_runs(g_gpu, sentinel, empty, 2);
    bool same = true;
    for (size_t i = 0; i < sizeof sentinel; i++) same &= sentinel[i] == 0x77;
    CHECK(same);
  }
  backend_ok("batched ops");

  /* one frame of 12 runs of 10 x 32 KiB (3.75 MiB): 12 calls against one batched call */
  {
    enum { RUNS = 12, NB = 10 };
    const size_t seg = 32768, stride = 8 * seg;
    int32_t *ids = make_ids(NB, (int)(m.bytes / RUNS / stride), true); /* inside 1/12th */
    pd_kv_run runs[RUNS];
    for (int r = 0; r < RUNS; r++)
      runs[r] = (pd_kv_run){(const uint8_t *)m.dev + (size_t)r * (m.bytes / RUNS / stride) * stride,
                            ids, NB, stride, 0, seg, (size_t)r * NB * seg};
    const size_t bytes = (size_t)RUNS * NB * seg;
    uint8_t *pageable = xmalloc(bytes);
    for (int kind = 0; kind < 2; kind++) {
      uint8_t *h = kind ? pinned : pageable;
      double t[4];
      for (int way = 0; way < 4; way++) { /* gather per run, batched; scatter per run, batched */
        double best = 1e9;
        for (int rep = 0; rep < 20; rep++) {
          double t0 = now();
          if (way == 0)
            for (int r = 0; r < RUNS; r++)
              g_gpu->ops.kv_gather(g_gpu, h + runs[r].host_off, runs[r].base, ids, NB, stride, 0,
                                   seg);
          else if (way == 1)
            g_gpu->ops.kv_gather_runs(g_gpu, h, runs, RUNS);
          else if (way == 2)
            for (int r = 0; r < RUNS; r++)
              g_gpu->ops.kv_scatter(g_gpu, (void *)runs[r].base, h + runs[r].host_off, ids, NB,
                                    stride, 0, seg);
          else
            g_gpu->ops.kv_scatter_runs(g_gpu, h, runs, RUNS);
          double dt = now() - t0;
          if (dt < best) best = dt;
        }
        t[way] = best;
      }
      printf("a 3.75 MiB frame of 12 runs, %s host: gather %.0f us in 12 calls, %.0f us in one "
             "kv_gather_runs; scatter %.0f us / %.0f us\n", kind ? "page-locked" : "pageable",
             1e6 * t[0], 1e6 * t[1], 1e6 * t[2], 1e6 * t[3]);
    }
    free(pageable);
    free(ids);
    backend_ok("frame timing");
  }
  mirror_free(&m);
}

/* ---- pd_kvstage on a device cache against pd_kvpack on a host copy ---- */

typedef struct dcache {
  pd_kv_pages host_g, dev_g;
  pd_kv_layer host_l[6], dev_l[6];
  size_t bytes;
} dcache;

static void dcache_new(dcache *c, int layers, int blocks, int heads, int head_off, int bs, int hd,
                       pd_dtype dt) {
  memset(c, 0, sizeof *c);
  c->host_g = (pd_kv_pages){c->host_l, layers, blocks, heads, head_off, bs, hd, dt};
  c->dev_g = (pd_kv_pages){c->dev_l, layers, blocks, heads, head_off, bs, hd, dt};
  c->bytes = (size_t)blocks * heads * bs * hd * pd_dtype_size(dt);
  for (int l = 0; l < layers; l++) {
    for (int kv = 0; kv < 2; kv++) {
      uint8_t *h = xmalloc(c->bytes);
      fill(h, c->bytes);
      void *d = g_gpu->ops.alloc(g_gpu, c->bytes);
      REQUIRE(d);
      g_gpu->ops.to_device(g_gpu, d, h, c->bytes);
      if (kv) {
        c->host_l[l].v = h;
        c->dev_l[l].v = d;
      } else {
        c->host_l[l].k = h;
        c->dev_l[l].k = d;
      }
    }
  }
  g_gpu->ops.sync(g_gpu);
}

static bool dcache_same(const dcache *c) {
  bool ok = true;
  uint8_t *back = xmalloc(c->bytes);
  for (int l = 0; l < c->host_g.num_layers && ok; l++) {
    g_gpu->ops.to_host(g_gpu, back, c->dev_l[l].k, c->bytes);
    ok &= !memcmp(back, c->host_l[l].k, c->bytes);
    g_gpu->ops.to_host(g_gpu, back, c->dev_l[l].v, c->bytes);
    ok &= !memcmp(back, c->host_l[l].v, c->bytes);
  }
  free(back);
  return ok;
}

static void dcache_free(dcache *c) {
  for (int l = 0; l < c->host_g.num_layers; l++) {
    free(c->host_l[l].k);
    free(c->host_l[l].v);
    g_gpu->ops.free(g_gpu, c->dev_l[l].k);
    g_gpu->ops.free(g_gpu, c->dev_l[l].v);
  }
}

static const pd_dtype k_dtypes[] = {PD_DTYPE_F32, PD_DTYPE_F16, PD_DTYPE_BF16, PD_DTYPE_F8_E4M3};

static void kvstage_case(int iter, pd_kvstage *st) {
  const int L = 1 + (int)urand(4);
  const int bs = urand(2) ? 16 : 1 + (int)urand(20);
  const int hd = urand(2) ? 64 * (1 + (int)urand(2)) : 1 + (int)urand(90);
  const pd_dtype dt = k_dtypes[urand(4)];
  const int src_heads = 1 + (int)urand(8), src_blocks = 1 + (int)urand(60);
  dcache src;
  dcache_new(&src, L, src_blocks, src_heads, 0, bs, hd, dt);
  pd_kv_slice s;
  s.layer_begin = (int)urand((size_t)L);
  s.layer_end = s.layer_begin + 1 + (int)urand((size_t)(L - s.layer_begin));
  s.head_begin = (int)urand((size_t)src_heads);
  s.head_end = s.head_begin + 1 + (int)urand((size_t)(src_heads - s.head_begin));
  const int dst_off = (int)urand((size_t)s.head_end + 1), dst_heads = 1 + (int)urand(8);
  const int dst_blocks = 1 + (int)urand(60);
  const int n = 1 + (int)urand((size_t)(src_blocks < dst_blocks ? src_blocks : dst_blocks));
  int32_t *src_ids = make_ids(n, src_blocks, true), *dst_ids = make_ids(n, dst_blocks, true);
  pd_err e = {0};
  size_t size = pd_kvpack_size(&src.host_g, &s, n);
  REQUIRE(size > 0);
  uint8_t *ref = xmalloc(size), *got = xmalloc(size);
  REQUIRE(pd_kvpack_pack_range(&src.host_g, &s, src_ids, n, 0, ref, size, &e) == PD_OK);
  /* frames of random sizes, as a prefill node cuts them */
  size_t frame = 1 + urand(urand(2) ? size : 4096);
  /* frames malloc'ed one by one, like ZeroMQ messages, or cut from one page-locked buffer */
  uint8_t *pinned = urand(3) == 0 ? g_gpu->ops.host_alloc(g_gpu, size) : NULL;
  bool ok = true;
  for (size_t off = 0; off < size; off += frame) {
    size_t len = size - off < frame ? size - off : frame;
    uint8_t *f = pinned ? pinned + off : xmalloc(len);
    ok &= pd_kvstage_pack_range(st, &src.dev_g, &s, src_ids, n, off, f, len, &e) == PD_OK;
    memcpy(got + off, f, len);
    if (!pinned) free(f);
  }
  if (pinned) g_gpu->ops.host_free(g_gpu, pinned);
  CHECKF(ok && !memcmp(got, ref, size), "kvstage %d: device pack != host pack (%s%s)", iter,
         ok ? "bytes differ" : e.msg, g_gpu->ops.kv_gather_runs ? ", batched" : "");
  /* unpack into a receiver holding heads [dst_off, dst_off + dst_heads) */
  dcache dst;
  dcache_new(&dst, L, dst_blocks, dst_heads, dst_off, bs, hd, dt);
  frame = 1 + urand(urand(2) ? size : 4096);
  ok = true;
  for (size_t off = 0; off < size; off += frame) {
    size_t len = size - off < frame ? size - off : frame;
    ok &= pd_kvpack_unpack_range(&dst.host_g, &s, dst_ids, n, off, ref + off, len, &e) == PD_OK;
    ok &= pd_kvstage_unpack_range(st, &dst.dev_g, &s, dst_ids, n, off, ref + off, len, &e) ==
          PD_OK;
  }
  CHECKF(ok && dcache_same(&dst),
         "kvstage %d: device unpack != host unpack (L=%d bs=%d hd=%d dt=%d, slice heads [%d,%d), "
         "receiver [%d,%d), n=%d, frames of %zu%s) %s", iter, L, bs, hd, (int)dt, s.head_begin,
         s.head_end, dst_off, dst_off + dst_heads, n, frame,
         g_gpu->ops.kv_scatter_runs ? ", batched" : "", ok ? "" : e.msg);
  backend_ok("kvstage");
  dcache_free(&dst);
  dcache_free(&src);
  free(src_ids);
  free(dst_ids);
  free(ref);
  free(got);
}

int main(void) {
  if (pd_cuda_device_count() == 0) {
    printf("test_cuda_kvstage: no CUDA device, skipped\n");
    return 77;
  }
  pd_err e = {0};
  pd_backend_opts bo = {.n_threads = 1, .device = 0};
  g_cpu = pd_backend_cpu_create(&bo, &e);
  REQUIRE(g_cpu);
  g_gpu = pd_backend_cuda_create(&bo, &e);
  if (!g_gpu) {
    fprintf(stderr, "cuda backend: %s\n", e.msg);
    return 1;
  }
  REQUIRE(g_gpu->ops.kv_gather && g_gpu->ops.kv_scatter && g_gpu->ops.host_alloc &&
          g_gpu->ops.host_free);
  const size_t pinned_cap = ((size_t)72 << 20) + 128;
  uint8_t *pinned = g_gpu->ops.host_alloc(g_gpu, pinned_cap);
  REQUIRE(pinned);

  random_segments(pinned, pinned_cap);
  large_calls(pinned, pinned_cap);
  batched_ops(pinned, pinned_cap);
  pd_kvstage *st = pd_kvstage_new(g_gpu, (size_t)(1 + urand(3)) << 10, &e);
  REQUIRE(st);
  for (int iter = 0; iter < 60; iter++) kvstage_case(iter, st); /* batched */
  void (*gather_runs)(pd_backend *, void *, const pd_kv_run *, int) = g_gpu->ops.kv_gather_runs;
  void (*scatter_runs)(pd_backend *, const void *, const pd_kv_run *, int) =
      g_gpu->ops.kv_scatter_runs;
  g_gpu->ops.kv_gather_runs = NULL; /* per run: kv_gather / kv_scatter */
  g_gpu->ops.kv_scatter_runs = NULL;
  for (int iter = 60; iter < 120; iter++) kvstage_case(iter, st);
  g_gpu->ops.kv_gather_runs = gather_runs;
  g_gpu->ops.kv_scatter_runs = scatter_runs;
  pd_kvstage_free(st);

  g_gpu->ops.host_free(g_gpu, pinned);
  backend_ok("end");
  pd_backend_destroy(g_gpu);
  pd_backend_destroy(g_cpu);
  return pd_test_finish("test_cuda_kvstage");
}
