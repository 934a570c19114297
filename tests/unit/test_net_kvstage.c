/* pd_kvstage (pd/kvpack.h): the backend staging path (kv_gather / kv_scatter) on the CPU backend
 * against the host path (pd_kvpack_*_range), byte for byte, over random geometries (1..5 layers,
 * odd head dims and block sizes, every KV dtype width), shuffled block lists, layer and head
 * sub-slices, random frame cuts (1-byte frames, frames inside one segment, frames spanning
 * layers), and head resharding on unpack (the receiver holds a sub-range, a super-range, an
 * overlapping range or none of the slice's heads) with bounce buffers from 1 byte up, from
 * malloc and from a host_alloc hook. Checks the number of backend calls (one per (layer, K/V)
 * plus at most two for the range's cut segments) and that every error of the host path comes
 * back with the same code before anything is copied. All of it twice: with the batched ops
 * (kv_gather_runs / kv_scatter_runs: exactly ONE call per range, resharded unpacks included) and
 * with them removed from the table (kv_gather / kv_scatter: one call per (layer, K/V) plus at most
 * two for cut segments). The batched CPU ops themselves are checked against kv_gather /
 * kv_scatter (runs with gaps between them in the host buffer, which a gather must not touch), and
 * a few hand-picked ranges (one segment piece only, cuts inside segments, several layers, block
 * ids out of order, resharded unpack) are compared on both paths. The CUDA ops are compared with
 * these in tests/gpu/test_cuda_kvstage.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/backend.h"
#include "pd/kvpack.h"
#include "pd_test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return rng * 2685821657736338717ull;
}
static int irand(int n) { return (int)(rnd() % (uint64_t)n); }

/* ---- a backend whose staging calls are counted ---- */

static pd_backend *g_be;
static void (*real_gather)(pd_backend *, void *, const void *, const int32_t *, int, size_t,
                           size_t, size_t);
static void (*real_scatter)(pd_backend *, void *, const void *, const int32_t *, int, size_t,
                            size_t, size_t);
static void (*real_gather_runs)(pd_backend *, void *, const pd_kv_run *, int);
static void (*real_scatter_runs)(pd_backend *, const void *, const pd_kv_run *, int);
static int n_calls, n_batch_calls, n_host_alloc, n_host_free, last_n_runs;
static bool g_batched; /* the batched ops are in the table */

static void count_gather(pd_backend *be, void *host, const void *base, const int32_t *ids, int n,
                         size_t stride, size_t offset, size_t seg) {
  n_calls++;
  real_gather(be, host, base, ids, n, stride, offset, seg);
}
static void count_scatter(pd_backend *be, void *base, const void *host, const int32_t *ids, int n,
                          size_t stride, size_t offset, size_t seg) {
  n_calls++;
  real_scatter(be, base, host, ids, n, stride, offset, seg);
}
static void count_gather_runs(pd_backend *be, void *host, const pd_kv_run *runs, int n_runs) {
  n_batch_calls++;
  last_n_runs = n_runs;
  real_gather_runs(be, host, runs, n_runs);
}
static void count_scatter_runs(pd_backend *be, const void *host, const pd_kv_run *runs,
                               int n_runs) {
  n_batch_calls++;
  last_n_runs = n_runs;
  real_scatter_runs(be, host, runs, n_runs);
}
/* batched: the counted batched ops in the table; else none (the per-run ops only) */
static void set_batched(bool batched) {
  g_batched = batched;
  g_be->ops.kv_gather_runs = batched ? count_gather_runs : NULL;
  g_be->ops.kv_scatter_runs = batched ? count_scatter_runs : NULL;
}
static void *fake_host_alloc(pd_backend *be, size_t bytes) {
  (void)be;
  n_host_alloc++;
  return malloc(bytes);
}
static void fake_host_free(pd_backend *be, void *p) {
  (void)be;
  n_host_free++;
  free(p);
}

/* ---- caches ---- */

typedef struct cache {
  pd_kv_pages g;
  pd_kv_layer layers[8];
  size_t bytes; /* of one K (or V) buffer */
} cache;

static void cache_new(cache *c, int layers, int blocks, int heads, int head_offset, int bs, int hd,
                      pd_dtype dt) {
  memset(c, 0, sizeof *c);
  c->g = (pd_kv_pages){c->layers, layers, blocks, heads, head_offset, bs, hd, dt};
  c->bytes = (size_t)blocks * heads * bs * hd * pd_dtype_size(dt);
  for (int l = 0; l < layers; l++) {
    c->layers[l].k = malloc(c->bytes);
    c->layers[l].v = malloc(c->bytes);
    REQUIRE(c->layers[l].k && c->layers[l].v);
    for (size_t i = 0; i < c->bytes; i++) {
      ((uint8_t *)c->layers[l].k)[i] = (uint8_t)rnd();
      ((uint8_t *)c->layers[l].v)[i] = (uint8_t)rnd();
    }
  }
}

static void cache_copy(cache *dst, const cache *src) {
  *dst = *src;
  dst->g.layers = dst->layers;
  for (int l = 0; l < src->g.num_layers; l++) {
    dst->layers[l].k = malloc(src->bytes);
    dst->layers[l].v = malloc(src->bytes);
    REQUIRE(dst->layers[l].k && dst->layers[l].v);
    memcpy(dst->layers[l].k, src->layers[l].k, src->bytes);
    memcpy(dst->layers[l].v, src->layers[l].v, src->bytes);
  }
}

static bool cache_eq(const cache *a, const cache *b) {
  for (int l = 0; l < a->g.num_layers; l++)
    if (memcmp(a->layers[l].k, b->layers[l].k, a->bytes) ||
        memcmp(a->layers[l].v, b->layers[l].v, a->bytes))
      return false;
  return true;
}

static void cache_free(cache *c) {
  for (int l = 0; l < c->g.num_layers; l++) {
    free(c->layers[l].k);
    free(c->layers[l].v);
  }
}

/* n distinct ids from [0, total), in random order. */
static void pick_blocks(int32_t *out, int n, int total) {
  int32_t *all = malloc((size_t)total * sizeof *all);
  REQUIRE(all);
  for (int i = 0; i < total; i++) all[i] = i;
  for (int i = total - 1; i > 0; i--) {
    int j = irand(i + 1);
    int32_t t = all[i];
    all[i] = all[j];
    all[j] = t;
  }
  memcpy(out, all, (size_t)n * sizeof *out);
  free(all);
}

/* Random cut points of [0, size): frames [cuts[i], cuts[i+1]). Returns the frame count. */
static int make_cuts(size_t size, size_t seg, size_t *cuts, int cap) {
  int n = 0;
  cuts[n++] = 0;
  int mode = irand(4);
  size_t pos = 0;
  while (pos < size && n < cap - 1) {
    size_t step;
    if (mode == 0) step = size; /* one frame */
    else if (mode == 1) step = 1 + (size_t)irand(3); /* tiny frames */
    else if (mode == 2) step = seg * (size_t)(1 + irand(3)); /* segment-aligned */
    else step = 1 + rnd() % (size / 3 + 1); /* anywhere */
    pos = size - pos < step ? size : pos + step;
    cuts[n++] = pos;
  }
  if (cuts[n - 1] != size) cuts[n++] = size; /* cap reached: the rest in one frame */
  return n - 1;
}

static const pd_dtype k_dtypes[] = {PD_DTYPE_F32, PD_DTYPE_F16, PD_DTYPE_BF16, PD_DTYPE_F8_E4M3};

/* Runs in [off, off + len) of a slice buffer whose runs are `run` bytes. */
static int runs_touched(size_t off, size_t len, size_t run) {
  return len ? (int)((off + len - 1) / run - off / run + 1) : 0;
}

static void random_case(int iter) {
  const int L = 1 + irand(5);
  const int bs = 1 + irand(9), hd = 1 + irand(40);
  const pd_dtype dt = k_dtypes[irand(4)];
  const int src_heads = 1 + irand(6), src_off = irand(3);
  const int src_blocks = 1 + irand(24);
  cache src;
  cache_new(&src, L, src_blocks, src_heads, src_off, bs, hd, dt);
  /* the slice: layers and heads held by src */
  pd_kv_slice s;
  s.layer_begin = irand(L);
  s.layer_end = s.layer_begin + 1 + irand(L - s.layer_begin);
  s.head_begin = src_off + irand(src_heads);
  s.head_end = s.head_begin + 1 + irand(src_off + src_heads - s.head_begin);
  /* the receiver's heads: anything around the slice (sub-range, super-range, overlap, none) */
  const int dst_off = irand(s.head_end + 2);
  const int dst_heads = 1 + irand(7);
  const int dst_blocks = 1 + irand(24);
  const int n = 1 + irand(src_blocks < dst_blocks ? src_blocks : dst_blocks);
  int32_t src_ids[32], dst_ids[32];
  pick_blocks(src_ids, n, src_blocks);
  pick_blocks(dst_ids, n, dst_blocks);

  size_t size = pd_kvpack_size(&src.g, &s, n);
  size_t seg = pd_kvpack_segment_bytes(&src.g, &s);
  REQUIRE(size > 0 && seg > 0);
  size_t run = seg * (size_t)n;
  uint8_t *ref = malloc(size), *got = malloc(size);
  REQUIRE(ref && got);
  pd_err e = {0};
  REQUIRE(pd_kvpack_pack_range(&src.g, &s, src_ids, n, 0, ref, size, &e) == PD_OK);

  pd_kvstage *st = pd_kvstage_new(g_be, (size_t)irand(3) == 0 ? (size_t)(1 + irand(64)) : 0, &e);
  REQUIRE(st);

  /* pack: every frame through the stage equals the host bytes */
  size_t cuts[80];
  int nf = make_cuts(size, seg, cuts, 80);
  memset(got, 0xa5, size);
  bool ok = true;
  for (int f = 0; f < nf; f++) {
    size_t off = cuts[f], len = cuts[f + 1] - cuts[f];
    n_calls = n_batch_calls = 0;
    pd_status r = pd_kvstage_pack_range(st, &src.g, &s, src_ids, n, off, got + off, len, &e);
    ok &= r == PD_OK;
    int touched = runs_touched(off, len, run);
    if (g_batched)
      CHECKF(n_calls == 0 && n_batch_calls == 1, "iter %d: batched pack of [%zu, +%zu) took %d "
             "+ %d calls", iter, off, len, n_calls, n_batch_calls);
    else
      CHECKF(n_calls <= touched + 2 && n_batch_calls == 0,
             "iter %d: pack of [%zu, +%zu) took %d calls for %d runs", iter, off, len, n_calls,
             touched);
  }
  CHECKF(ok && !memcmp(got, ref, size),
         "iter %d: staged pack != host pack (L=%d bs=%d hd=%d dt=%d heads [%d,%d) of [%d,%d), "
         "n=%d, %d frames)", iter, L, bs, hd, (int)dt, s.head_begin, s.head_end, src_off,
         src_off + src_heads, n, nf);
  /* a whole slice in one call: exactly one call per (layer, K/V) */
  n_calls = n_batch_calls = 0;
  CHECK(pd_kvstage_pack_range(st, &src.g, &s, src_ids, n, 0, got, size, &e) == PD_OK);
  if (g_batched)
    CHECKF(n_calls == 0 && n_batch_calls == 1, "iter %d: whole slice took %d + %d calls", iter,
           n_calls, n_batch_calls);
  else
    CHECKF(n_calls == 2 * (s.layer_end - s.layer_begin), "iter %d: whole slice took %d calls",
           iter, n_calls);
  CHECKF(!memcmp(got, ref, size), "iter %d: whole-slice staged pack != host pack", iter);

  /* unpack: frames in random order into two equal caches, host path vs stage path */
  cache dst_host, dst_stage;
  cache_new(&dst_host, L, dst_blocks, dst_heads, dst_off, bs, hd, dt);
  cache_copy(&dst_stage, &dst_host);
  nf = make_cuts(size, seg, cuts, 80);
  int order[80];
  for (int f = 0; f < nf; f++) order[f] = f;
  for (int f = nf - 1; f > 0; f--) {
    int j = irand(f + 1), t = order[f];
    order[f] = order[j];
    order[j] = t;
  }
  const int lo = s.head_begin > dst_off ? s.head_begin : dst_off;
  const int hi = s.head_end < dst_off + dst_heads ? s.head_end : dst_off + dst_heads;
  ok = true;
  for (int k = 0; k < nf; k++) {
    int f = order[k];
    size_t off = cuts[f], len = cuts[f + 1] - cuts[f];
    pd_status a = pd_kvpack_unpack_range(&dst_host.g, &s, dst_ids, n, off, ref + off, len, &e);
    n_calls = n_batch_calls = 0;
    pd_status b =
        pd_kvstage_unpack_range(st, &dst_stage.g, &s, dst_ids, n, off, ref + off, len, &e);
    ok &= a == PD_OK && b == PD_OK;
    int touched = runs_touched(off, len, run);
    if (lo >= hi) {
      CHECKF(n_calls == 0 && n_batch_calls == 0,
             "iter %d: %d + %d calls for a receiver without the heads", iter, n_calls,
             n_batch_calls);
    } else if (g_batched) {
      /* resharded: a range over non-held bytes only makes no call */
      const bool all = hi - lo == s.head_end - s.head_begin;
      CHECKF(n_calls == 0 && (all ? n_batch_calls == 1 : n_batch_calls <= 1),
             "iter %d: batched unpack of [%zu, +%zu) took %d + %d calls", iter, off, len,
             n_calls, n_batch_calls);
    } else if (hi - lo == s.head_end - s.head_begin) {
      CHECKF(n_calls <= touched + 2, "iter %d: unpack of [%zu, +%zu) took %d calls for %d runs",
             iter, off, len, n_calls, touched);
    }
  }
  CHECKF(ok && cache_eq(&dst_host, &dst_stage),
         "iter %d: staged unpack != host unpack (L=%d bs=%d hd=%d dt=%d slice heads [%d,%d), "
         "receiver [%d,%d), n=%d, %d frames)", iter, L, bs, hd, (int)dt, s.head_begin,
         s.head_end, dst_off, dst_off + dst_heads, n, nf);

  cache_free(&dst_host);
  cache_free(&dst_stage);
  pd_kvstage_free(st);
  free(ref);
  free(got);
  cache_free(&src);
}

/* Every error of the host path, with the same code, and nothing written. */
static void errors(void) {
  cache src, dst, dst0;
  cache_new(&src, 3, 10, 4, 0, 4, 8, PD_DTYPE_F16);
  cache_new(&dst, 3, 10, 2, 2, 4, 8, PD_DTYPE_F16);
  cache_copy(&dst0, &dst);
  pd_kv_slice s = {0, 3, 0, 4};
  int32_t ids[4] = {3, 1, 7, 9};
  size_t size = pd_kvpack_size(&src.g, &s, 4);
  uint8_t *buf = malloc(size + 16);
  REQUIRE(buf);
  memset(buf, 7, size + 16);
  pd_err e = {0};
  pd_kvstage *st = pd_kvstage_new(g_be, 0, &e);
  REQUIRE(st);

  struct {
    const char *what;
    pd_kv_slice s;
    int32_t ids[4];
    int n;
    size_t off, len;
    bool null_buf;
  } cases[] = {
      {"negative block id", {0, 3, 0, 4}, {3, -1, 7, 9}, 4, 0, 64, false},
      {"block id past the cache", {0, 3, 0, 4}, {3, 1, 10, 9}, 4, 0, 64, false},
      {"no blocks", {0, 3, 0, 4}, {0}, 0, 0, 0, false},
      {"range past the end", {0, 3, 0, 4}, {3, 1, 7, 9}, 4, size - 8, 9, false},
      {"offset past the end", {0, 3, 0, 4}, {3, 1, 7, 9}, 4, size + 1, 0, false},
      {"NULL buffer", {0, 3, 0, 4}, {3, 1, 7, 9}, 4, 0, 64, true},
      {"empty layer range", {2, 2, 0, 4}, {3, 1, 7, 9}, 4, 0, 64, false},
      {"layers past the model", {1, 4, 0, 4}, {3, 1, 7, 9}, 4, 0, 64, false},
      {"empty head range", {0, 3, 2, 2}, {3, 1, 7, 9}, 4, 0, 64, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint8_t *b = cases[i].null_buf ? NULL : buf;
    for (int pack = 0; pack < 2; pack++) {
      pd_err eh = {0}, es = {0};
      pd_kv_pages *g = pack ? &src.g : &dst.g;
      pd_status h = pack ? pd_kvpack_pack_range(g, &cases[i].s, cases[i].ids, cases[i].n,
                                                cases[i].off, b, cases[i].len, &eh)
                         : pd_kvpack_unpack_range(g, &cases[i].s, cases[i].ids, cases[i].n,
                                                  cases[i].off, b, cases[i].len, &eh);
      n_calls = n_batch_calls = 0;
      pd_status r = pack ? pd_kvstage_pack_range(st, g, &cases[i].s, cases[i].ids, cases[i].n,
                                                 cases[i].off, b, cases[i].len, &es)
                         : pd_kvstage_unpack_range(st, g, &cases[i].s, cases[i].ids, cases[i].n,
                                                   cases[i].off, b, cases[i].len, &es);
      CHECKF(h != PD_OK && r == h && n_calls == 0 && n_batch_calls == 0,
             "%s (%s): host %d, stage %d (%s), %d + %d calls", cases[i].what,
             pack ? "pack" : "unpack", (int)h, (int)r, es.msg, n_calls, n_batch_calls);
    }
  }
  /* pack needs every slice head held: dst holds [2, 4) only */
  pd_err es = {0};
  CHECK(pd_kvstage_pack_range(st, &dst.g, &s, ids, 4, 0, buf, 64, &es) == PD_EINVAL);
  CHECK(cache_eq(&dst, &dst0));
  /* a NULL stage */
  CHECK(pd_kvstage_pack_range(NULL, &src.g, &s, ids, 4, 0, buf, 64, &es) == PD_EINVAL);
  /* zero bytes: fine, no call */
  n_calls = n_batch_calls = 0;
  CHECK(pd_kvstage_unpack_range(st, &dst.g, &s, ids, 4, 100, buf, 0, &es) == PD_OK);
  CHECK(n_calls == 0 && n_batch_calls == 0 && cache_eq(&dst, &dst0));
  /* a backend without the ops */
  pd_backend bare = *g_be;
  bare.ops.kv_gather = NULL;
  CHECK(pd_kvstage_new(&bare, 0, &es) == NULL && es.code == PD_EUNSUPPORTED);
  CHECK(pd_kvstage_new(NULL, 0, &es) == NULL && es.code == PD_EINVAL);
  pd_kvstage_free(NULL);

  pd_kvstage_free(st);
  free(buf);
  cache_free(&src);
  cache_free(&dst);
  cache_free(&dst0);
}

/* The CPU ops themselves: any stride / offset / size, n = 0, segments that do not fill a block. */
static void cpu_ops(void) {
  enum { BYTES = 4096 };
  uint8_t *base = malloc(BYTES), *host = malloc(BYTES), *want = malloc(BYTES);
  REQUIRE(base && host && want);
  for (int iter = 0; iter < 200; iter++) {
    for (int i = 0; i < BYTES; i++) base[i] = (uint8_t)rnd();
    size_t seg = 1 + (size_t)irand(40), stride = seg + (size_t)irand(9);
    size_t offset = (size_t)irand(7);
    int slots = (int)((BYTES - offset - seg) / stride) + 1;
    if (slots > 50) slots = 50;
    int n = irand(slots + 1);
    int32_t ids[50];
    pick_blocks(ids, n, slots);
    g_be->ops.kv_gather(g_be, host, base, ids, n, stride, offset, seg);
    bool ok = true;
    for (int i = 0; i < n; i++)
      ok &= !memcmp(host + (size_t)i * seg, base + (size_t)ids[i] * stride + offset, seg);
    CHECKF(ok, "cpu kv_gather: seg %zu stride %zu offset %zu n %d", seg, stride, offset, n);
    memcpy(want, base, BYTES);
    for (int i = 0; i < n * (int)seg; i++) host[i] = (uint8_t)rnd();
    for (int i = 0; i < n; i++)
      memcpy(want + (size_t)ids[i] * stride + offset, host + (size_t)i * seg, seg);
    g_be->ops.kv_scatter(g_be, base, host, ids, n, stride, offset, seg);
    CHECKF(!memcmp(base, want, BYTES), "cpu kv_scatter: seg %zu stride %zu offset %zu n %d", seg,
           stride, offset, n);
  }
  free(base);
  free(host);
  free(want);
}

/* The batched CPU ops against kv_gather / kv_scatter run by run: up to 6 runs over separate
 * buffers, any stride / offset / size, empty runs, runs placed in the host buffer in any order
 * with gaps, which a gather leaves as they were. */
static void cpu_runs_ops(void) {
  enum { BYTES = 2048, RUNS = 6, HOST = RUNS * BYTES + RUNS * 8 };
  uint8_t *base[RUNS], *want_base[RUNS];
  uint8_t *host = malloc(HOST), *want = malloc(HOST);
  REQUIRE(host && want);
  for (int r = 0; r < RUNS; r++) {
    base[r] = malloc(BYTES);
    want_base[r] = malloc(BYTES);
    REQUIRE(base[r] && want_base[r]);
  }
  for (int iter = 0; iter < 200; iter++) {
    int n_runs = irand(RUNS + 1), order[RUNS];
    pd_kv_run runs[RUNS];
    int32_t ids[RUNS][40];
    for (int r = 0; r < RUNS; r++) order[r] = r;
    for (int r = RUNS - 1; r > 0; r--) { /* host placement order */
      int j = irand(r + 1), t = order[r];
      order[r] = order[j];
      order[j] = t;
    }
    for (int r = 0; r < n_runs; r++) {
      for (int i = 0; i < BYTES; i++) base[r][i] = (uint8_t)rnd();
      size_t seg = (size_t)irand(50), stride = seg + (size_t)irand(9) + (seg == 0);
      size_t offset = (size_t)irand(7);
      int slots = (int)((BYTES - offset - seg) / stride) + 1;
      if (slots > 40) slots = 40;
      int n = irand(slots + 1);
      pick_blocks(ids[r], n, slots);
      runs[r] = (pd_kv_run){base[r], ids[r], n, stride, offset, seg, 0};
    }
    size_t pos = 0;
    for (int k = 0; k < RUNS; k++) {
      int r = order[k];
      if (r >= n_runs) continue;
      pos += (size_t)irand(8); /* a gap */
      runs[r].host_off = pos;
      pos += (size_t)runs[r].n * runs[r].seg_bytes;
    }
    /* gather */
    for (int i = 0; i < HOST; i++) host[i] = want[i] = (uint8_t)rnd();
    for (int r = 0; r < n_runs; r++)
      g_be->ops.kv_gather(g_be, want + runs[r].host_off, runs[r].base, runs[r].ids, runs[r].n,
                          runs[r].stride, runs[r].offset, runs[r].seg_bytes);
    g_be->ops.kv_gather_runs(g_be, host, runs, n_runs);
    CHECKF(!memcmp(host, want, HOST), "cpu kv_gather_runs: iter %d, %d runs", iter, n_runs);
    /* scatter */
    for (int i = 0; i < HOST; i++) host[i] = (uint8_t)rnd();
    for (int r = 0; r < n_runs; r++) {
      memcpy(want_base[r], base[r], BYTES);
      g_be->ops.kv_scatter(g_be, want_base[r], host + runs[r].host_off, runs[r].ids, runs[r].n,
                           runs[r].stride, runs[r].offset, runs[r].seg_bytes);
    }
    g_be->ops.kv_scatter_runs(g_be, host, runs, n_runs);
    bool ok = true;
    for (int r = 0; r < n_runs; r++) ok &= !memcmp(base[r], want_base[r], BYTES);
    CHECKF(ok, "cpu kv_scatter_runs: iter %d, %d runs", iter, n_runs);
  }
  for (int r = 0; r < RUNS; r++) {
    free(base[r]);
    free(want_base[r]);
  }
  free(host);
  free(want);
}

/* Hand-picked ranges of a 3-layer slice (4 heads, segments of 120 bytes, 4 blocks listed out of
 * order), packed and unpacked (into a full receiver and into one holding heads [1, 3) only)
 * through the stage, against the host path. */
static void fixed_ranges(void) {
  cache src;
  cache_new(&src, 3, 10, 4, 0, 3, 5, PD_DTYPE_F16);
  const pd_kv_slice s = {0, 3, 0, 4};
  const int32_t src_ids[4] = {7, 2, 9, 0}, dst_ids[4] = {3, 8, 1, 5};
  const size_t seg = pd_kvpack_segment_bytes(&src.g, &s), run = 4 * seg;
  const size_t size = pd_kvpack_size(&src.g, &s, 4);
  REQUIRE(seg == 120 && size == 6 * run);
  struct {
    const char *what;
    size_t off, len;
    int runs; /* runs of the batched call, full receiver */
  } cases[] = {
      {"a piece of one segment", seg / 2, 3, 1},
      {"the end of one segment and the start of the next", seg - 1, 2, 2},
      {"one whole segment", 2 * seg, seg, 1},
      {"across K and V of a layer", run - 5, 10, 2},
      {"several layers, cut inside segments", seg + 7, 2 * run + 13, 5},
      {"the whole slice", 0, size, 6},
      {"the last byte", size - 1, 1, 1},
  };
  uint8_t *ref = malloc(size), *got = malloc(size);
  REQUIRE(ref && got);
  pd_err e = {0};
  REQUIRE(pd_kvpack_pack_range(&src.g, &s, src_ids, 4, 0, ref, size, &e) == PD_OK);
  for (int batched = 0; batched < 2; batched++) {
    set_batched(batched);
    pd_kvstage *st = pd_kvstage_new(g_be, 0, &e);
    REQUIRE(st);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      const size_t off = cases[c].off, len = cases[c].len;
      memset(got, 0, size);
      n_calls = n_batch_calls = 0;
      CHECK(pd_kvstage_pack_range(st, &src.g, &s, src_ids, 4, off, got, len, &e) == PD_OK);
      CHECKF(!memcmp(got, ref + off, len), "%s (%s): pack", cases[c].what,
             batched ? "batched" : "per run");
      if (batched)
        CHECKF(n_calls == 0 && n_batch_calls == 1 && last_n_runs == cases[c].runs,
               "%s: pack took %d + %d calls, %d runs", cases[c].what, n_calls, n_batch_calls,
               last_n_runs);
      for (int reshard = 0; reshard < 2; reshard++) {
        cache dh, ds;
        cache_new(&dh, 3, 10, reshard ? 2 : 4, reshard ? 1 : 0, 3, 5, PD_DTYPE_F16);
        cache_copy(&ds, &dh);
        CHECK(pd_kvpack_unpack_range(&dh.g, &s, dst_ids, 4, off, ref + off, len, &e) == PD_OK);
        n_calls = n_batch_calls = 0;
        CHECK(pd_kvstage_unpack_range(st, &ds.g, &s, dst_ids, 4, off, ref + off, len, &e) ==
              PD_OK);
        CHECKF(cache_eq(&dh, &ds), "%s (%s%s): unpack", cases[c].what,
               batched ? "batched" : "per run", reshard ? ", resharded" : "");
        if (batched)
          CHECKF(n_calls == 0 && n_batch_calls <= 1 && (reshard || n_batch_calls == 1),
                 "%s: unpack took %d + %d calls", cases[c].what, n_calls, n_batch_calls);
        cache_free(&dh);
        cache_free(&ds);
      }
    }
    pd_kvstage_free(st);
  }
  free(ref);
  free(got);
  cache_free(&src);
}

int main(void) {
  pd_err e = {0};
  pd_backend_opts bo = {.n_threads = 1};
  g_be = pd_backend_cpu_create(&bo, &e);
  REQUIRE(g_be);
  REQUIRE(g_be->ops.kv_gather && g_be->ops.kv_scatter);
  REQUIRE(g_be->ops.kv_gather_runs && g_be->ops.kv_scatter_runs);
  cpu_ops();
  cpu_runs_ops();
  real_gather = g_be->ops.kv_gather;
  real_scatter = g_be->ops.kv_scatter;
  real_gather_runs = g_be->ops.kv_gather_runs;
  real_scatter_runs = g_be->ops.kv_scatter_runs;
  g_be->ops.kv_gather = count_gather;
  g_be->ops.kv_scatter = count_scatter;
  fixed_ranges();
  /* per-run ops only (the batched ones removed from the table) */
  set_batched(false);
  for (int iter = 0; iter < 400; iter++) random_case(iter);
  /* the same with a host_alloc hook: the resharding bounce comes from it and goes back to it */
  g_be->ops.host_alloc = fake_host_alloc;
  g_be->ops.host_free = fake_host_free;
  for (int iter = 400; iter < 600; iter++) random_case(iter);
  CHECKF(n_host_alloc > 0 && n_host_alloc == n_host_free, "host_alloc %d, host_free %d",
         n_host_alloc, n_host_free);
  errors();
  /* batched: one call per range; resharding needs no bounce buffer */
  set_batched(true);
  const int allocs = n_host_alloc;
  for (int iter = 600; iter < 1000; iter++) random_case(iter);
  CHECKF(n_host_alloc == allocs, "batched path: %d bounce allocations", n_host_alloc - allocs);
  errors();
  g_be->ops.host_alloc = NULL;
  g_be->ops.host_free = NULL;
  g_be->ops.kv_gather = real_gather;
  g_be->ops.kv_scatter = real_scatter;
  g_be->ops.kv_gather_runs = real_gather_runs;
  g_be->ops.kv_scatter_runs = real_scatter_runs;
  pd_backend_destroy(g_be);
  return pd_test_finish("test_net_kvstage");
}
