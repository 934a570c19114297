/* pd/kvpack.h: pack/unpack round trips with shuffled source and destination block ids, every KV
 * dtype width, layer sub-ranges, tensor-parallel head resharding in both directions, and
 * arbitrary frame cuts; checked byte-for-byte against direct indexing of the
 * [num_blocks, num_kv_heads, block_size, head_dim] layout. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/kvpack.h"
#include "pd/wire.h"
#include "pd_test.h"

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) {
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return rng * 2685821657736338717ull;
}

/* A host cache: layers x (K, V) buffers of [blocks, heads, bs, hd]. */
typedef struct cache {
  pd_kv_pages g;
  pd_kv_layer layers[8];
} cache;

static void cache_new(cache *c, int layers, int blocks, int heads, int head_offset, int bs, int hd,
                      pd_dtype dt, int fill) {
  memset(c, 0, sizeof *c);
  c->g = (pd_kv_pages){c->layers, layers, blocks, heads, head_offset, bs, hd, dt};
  size_t bytes = (size_t)blocks * heads * bs * hd * pd_dtype_size(dt);
  for (int l = 0; l < layers; l++) {
    c->layers[l].k = malloc(bytes);
    c->layers[l].v = malloc(bytes);
    REQUIRE(c->layers[l].k && c->layers[l].v);
    uint8_t *k = c->layers[l].k, *v = c->layers[l].v;
    for (size_t i = 0; i < bytes; i++) {
      k[i] = fill < 0 ? (uint8_t)rnd() : (uint8_t)fill;
      v[i] = fill < 0 ? (uint8_t)rnd() : (uint8_t)fill;
    }
  }
}

static void cache_free(cache *c) {
  for (int l = 0; l < c->g.num_layers; l++) {
    free(c->layers[l].k);
    free(c->layers[l].v);
  }
}

/* Bytes of (layer, kv, block, LOCAL head) by direct indexing of the documented layout. */
static const uint8_t *chunk(const cache *c, int layer, int kv, int block, int head) {
  size_t hc = (size_t)c->g.block_size * c->g.head_dim * pd_dtype_size(c->g.dtype);
  const uint8_t *base = kv ? c->layers[layer].v : c->layers[layer].k;
  return base + ((size_t)block * c->g.num_kv_heads + head) * hc;
}

static size_t chunk_bytes(const cache *c) {
  return (size_t)c->g.block_size * c->g.head_dim * pd_dtype_size(c->g.dtype);
}

static void shuffle(int32_t *a, int n) {
  for (int i = n - 1; i > 0; i--) {
    int j = (int)(rnd() % (uint64_t)(i + 1));
    int32_t t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

/* n distinct ids from [0, total), in random order. */
static void pick_blocks(int32_t *out, int n, int total) {
  int32_t *all = malloc((size_t)total * sizeof *all);
  REQUIRE(all);
  for (int i = 0; i < total; i++) all[i] = i;
  shuffle(all, total);
  memcpy(out, all, (size_t)n * sizeof *out);
  free(all);
}

/* dst (global heads [dst.head_offset, +num)) must equal src for the listed blocks, the layers
 * [l0, l1) and the global heads [h0, h1) that dst holds; every other byte of dst must still be
 * the sentinel. */
static int verify(const cache *src, const int32_t *sb, const cache *dst, const int32_t *db, int n,
                  int l0, int l1, int h0, int h1, uint8_t sentinel) {
  int bad = 0;
  size_t hc = chunk_bytes(dst);
  for (int l = 0; l < dst->g.num_layers; l++)
    for (int kv = 0; kv < 2; kv++)
      for (int b = 0; b < dst->g.num_blocks; b++)
        for (int h = 0; h < dst->g.num_kv_heads; h++) {
          int gh = h + dst->g.head_offset;
          const uint8_t *d = chunk(dst, l, kv, b, h);
          int idx = -1;
          for (int i = 0; i < n; i++)
            if (db[i] == b) idx = i;
          bool copied = idx >= 0 && l >= l0 && l < l1 && gh >= h0 && gh < h1;
          if (copied) {
            const uint8_t *s = chunk(src, l, kv, sb[idx], gh - src->g.head_offset);
            if (memcmp(d, s, hc) != 0) bad++;
          } else {
            for (size_t x = 0; x < hc; x++)
              if (d[x] != sentinel) {
                bad++;
                break;
              }
          }
        }
  return bad;
}

static void test_full_roundtrip(pd_dtype dt) {
  cache src, dst;
  const int L = 3, H = 4, BS = 5, HD = 6; /* odd sizes */
  cache_new(&src, L, 17, H, 0, BS, HD, dt, -1);
  cache_new(&dst, L, 23, H, 0, BS, HD, dt, 0xA5);
  enum { N = 9 };
  int32_t sb[N], db[N];
  pick_blocks(sb, N, 17);
  pick_blocks(db, N, 23);
  pd_kv_slice s = {0, L, 0, H};
  size_t size = pd_kvpack_size(&src.g, &s, N);
  CHECK(size == (size_t)L * 2 * N * H * BS * HD * pd_dtype_size(dt));
  CHECK(pd_kvpack_segment_bytes(&src.g, &s) == (size_t)H * BS * HD * pd_dtype_size(dt));
  uint8_t *buf = malloc(size);
  REQUIRE(buf);
  pd_err e = {0};
  CHECK(pd_kvpack_pack(&src.g, &s, sb, N, buf, size, &e) == PD_OK);
  /* The layout itself: segment (layer 1, V, block entry 4) starts where the doc says. */
  size_t seg = pd_kvpack_segment_bytes(&src.g, &s);
  CHECK(memcmp(buf + ((size_t)(1 * 2 + 1) * N + 4) * seg, chunk(&src, 1, 1, sb[4], 0), seg) == 0);
  CHECK(pd_kvpack_unpack(&dst.g, &s, db, N, buf, size, &e) == PD_OK);
  CHECKF(verify(&src, sb, &dst, db, N, 0, L, 0, H, 0xA5) == 0, "dtype %s", pd_dtype_name(dt));
  free(buf);
  cache_free(&src);
  cache_free(&dst);
}

/* Layer sub-range, frame cuts at random places (not at segment boundaries), and agreement with
 * the wire format's KV header validation. */
static void test_ranges(void) {
  cache src, dst;
  const int L = 4, H = 2, BS = 16, HD = 8;
  cache_new(&src, L, 40, H, 0, BS, HD, PD_DTYPE_BF16, -1);
  cache_new(&dst, L, 50, H, 0, BS, HD, PD_DTYPE_BF16, 0x11);
  enum { N = 13 };
  int32_t sb[N], db[N];
  pick_blocks(sb, N, 40);
  pick_blocks(db, N, 50);
  pd_kv_slice s = {1, 3, 0, H};
  size_t size = pd_kvpack_size(&src.g, &s, N);
  size_t off0 = pd_kvpack_offset(&src.g, &s, N);
  CHECK(off0 == 1 * 2 * N * pd_kvpack_segment_bytes(&src.g, &s));
  uint8_t *whole = malloc(size), *pieces = malloc(size);
  REQUIRE(whole && pieces);
  pd_err e = {0};
  CHECK(pd_kvpack_pack(&src.g, &s, sb, N, whole, size, &e) == PD_OK);
  /* pack_range in random pieces reproduces the whole buffer */
  for (size_t off = 0; off < size;) {
    size_t len = 1 + rnd() % 3000;
    if (len > size - off) len = size - off;
    CHECK(pd_kvpack_pack_range(&src.g, &s, sb, N, off, pieces + off, len, &e) == PD_OK);
    off += len;
  }
  CHECK(memcmp(whole, pieces, size) == 0);
  /* unpack_range in other random pieces, out of order */
  enum { MAXP = 4096 };
  size_t starts[MAXP], lens[MAXP];
  int np = 0;
  for (size_t off = 0; off < size && np < MAXP; np++) {
    size_t len = 1 + rnd() % 2500;
    if (len > size - off) len = size - off;
    starts[np] = off;
    lens[np] = len;
    off += len;
  }
  REQUIRE(starts[np - 1] + lens[np - 1] == size);
  for (int i = np - 1; i >= 0; i--)
    CHECK(pd_kvpack_unpack_range(&dst.g, &s, db, N, starts[i], whole + starts[i], lens[i], &e) ==
          PD_OK);
  CHECK(verify(&src, sb, &dst, db, N, 1, 3, 0, H, 0x11) == 0);

  /* The wire format agrees: a header for this slice, cut into two frames, validates. */
  Pd__KvTransferHeader h = PD__KV_TRANSFER_HEADER__INIT;
  uint64_t frames[2] = {size / 3, size - size / 3};
  h.request_id = "r1";
  h.reservation_id = 1;
  uint8_t token[PD_WIRE_TOKEN_BYTES] = {7};
  h.reservation_token = (ProtobufCBinaryData){sizeof token, token};
  h.layer_begin = 1;
  h.layer_end = 3;
  h.head_begin = 0;
  h.head_end = H;
  h.num_layers = L;
  h.block_size = BS;
  h.head_dim = HD;
  h.dtype = PD__KV_DTYPE__KV_DTYPE_BF16;
  h.n_block_ids = N;
  h.block_ids = db;
  h.offset = off0;
  h.n_frame_bytes = 2;
  h.frame_bytes = frames;
  pd_wire_limits lim;
  pd_wire_limits_init(&lim);
  lim.total_blocks = 50;
  lim.num_layers = L;
  lim.num_kv_heads = H;
  lim.head_dim = HD;
  lim.block_size = BS;
  lim.kv_dtype = PD_DTYPE_BF16;
  CHECKF(pd_wire_validate_kv_header(&h, &lim, &e) == PD_OK, "%s", e.msg);
  frames[1] += 2;
  CHECK(pd_wire_validate_kv_header(&h, &lim, &e) == PD_EINVAL);

  free(whole);
  free(pieces);
  cache_free(&src);
  cache_free(&dst);
}

/* TP resharding: prefill TP=2 (two shards of 2 heads) -> decode TP=1 (4 heads), and prefill TP=1
 * -> decode TP=2, and a TP=4 sender with a 3-head-offset mismatch. */
static void test_reshard(void) {
  const int L = 2, H = 4, BS = 4, HD = 16;
  enum { N = 6 };
  cache full;
  cache_new(&full, L, 20, H, 0, BS, HD, PD_DTYPE_F32, -1);
  int32_t sb[N], db[N];
  pick_blocks(sb, N, 20);
  pick_blocks(db, N, 30);
  pd_err e = {0};

  /* Shards of the source, built by copying head ranges out of the full cache. */
  cache shard[2];
  for (int r = 0; r < 2; r++) {
    cache_new(&shard[r], L, 20, 2, 2 * r, BS, HD, PD_DTYPE_F32, 0);
    for (int l = 0; l < L; l++)
      for (int kv = 0; kv < 2; kv++)
        for (int b = 0; b < 20; b++)
          for (int h = 0; h < 2; h++)
            memcpy((uint8_t *)chunk(&shard[r], l, kv, b, h), chunk(&full, l, kv, b, 2 * r + h),
                   chunk_bytes(&full));
  }

  /* TP2 -> TP1: each shard packs its heads; the full destination unpacks both. */
  cache dst;
  cache_new(&dst, L, 30, H, 0, BS, HD, PD_DTYPE_F32, 0x5A);
  for (int r = 0; r < 2; r++) {
    pd_kv_slice s = {0, L, 2 * r, 2 * r + 2};
    size_t size = pd_kvpack_size(&shard[r].g, &s, N);
    uint8_t *buf = malloc(size);
    REQUIRE(buf);
    CHECK(pd_kvpack_pack(&shard[r].g, &s, sb, N, buf, size, &e) == PD_OK);
    CHECK(pd_kvpack_unpack(&dst.g, &s, db, N, buf, size, &e) == PD_OK);
    free(buf);
    /* after shard 0 only heads [0, 2) have landed */
    CHECK(verify(&full, sb, &dst, db, N, 0, L, 0, 2 * r + 2, 0x5A) == 0);
  }
  cache_free(&dst);

  /* TP1 -> TP2: the full source packs all heads once; each destination rank keeps its own. */
  pd_kv_slice all = {0, L, 0, H};
  size_t size = pd_kvpack_size(&full.g, &all, N);
  uint8_t *buf = malloc(size);
  REQUIRE(buf);
  CHECK(pd_kvpack_pack(&full.g, &all, sb, N, buf, size, &e) == PD_OK);
  for (int r = 0; r < 2; r++) {
    cache d;
    cache_new(&d, L, 30, 2, 2 * r, BS, HD, PD_DTYPE_F32, 0x77);
    CHECK(pd_kvpack_unpack(&d.g, &all, db, N, buf, size, &e) == PD_OK);
    CHECK(verify(&full, sb, &d, db, N, 0, L, 0, H, 0x77) == 0);
    cache_free(&d);
  }
  /* Ranged unpack into a shard with cuts inside head runs. */
  {
    cache d;
    cache_new(&d, L, 30, 2, 2, BS, HD, PD_DTYPE_F32, 0x33);
    for (size_t off = 0; off < size;) {
      size_t len = 1 + rnd() % 700;
      if (len > size - off) len = size - off;
      CHECK(pd_kvpack_unpack_range(&d.g, &all, db, N, off, buf + off, len, &e) == PD_OK);
      off += len;
    }
    CHECK(verify(&full, sb, &d, db, N, 0, L, 0, H, 0x33) == 0);
    cache_free(&d);
  }
  /* A slice whose heads a destination does not hold at all changes nothing. */
  {
    cache d;
    cache_new(&d, L, 30, 1, 3, BS, HD, PD_DTYPE_F32, 0x44);
    pd_kv_slice s01 = {0, L, 0, 2};
    size_t sz = pd_kvpack_size(&full.g, &s01, N);
    uint8_t *b2 = malloc(sz);
    REQUIRE(b2);
    CHECK(pd_kvpack_pack(&full.g, &s01, sb, N, b2, sz, &e) == PD_OK);
    CHECK(pd_kvpack_unpack(&d.g, &s01, db, N, b2, sz, &e) == PD_OK);
    CHECK(verify(&full, sb, &d, db, N, 0, 0, 0, 0, 0x44) == 0);
    free(b2);
    cache_free(&d);
  }
  free(buf);
  for (int r = 0; r < 2; r++) cache_free(&shard[r]);
  cache_free(&full);
}

static void test_errors(void) {
  cache c;
  cache_new(&c, 2, 8, 2, 2, 4, 4, PD_DTYPE_F16, 0);
  int32_t ok[2] = {1, 7}, bad[2] = {1, 8}, neg[2] = {-1, 0};
  pd_kv_slice s = {0, 2, 2, 4};
  size_t size = pd_kvpack_size(&c.g, &s, 2);
  uint8_t *buf = calloc(1, size + 16);
  REQUIRE(buf);
  pd_err e = {0};
  CHECK(pd_kvpack_pack(&c.g, &s, ok, 2, buf, size, &e) == PD_OK);
  CHECK(pd_kvpack_pack(&c.g, &s, bad, 2, buf, size, &e) == PD_ERANGE);
  CHECK(pd_kvpack_unpack(&c.g, &s, neg, 2, buf, size, &e) == PD_ERANGE);
  CHECK(pd_kvpack_pack(&c.g, &s, ok, 2, buf, size - 1, &e) == PD_ERANGE);
  CHECK(pd_kvpack_unpack(&c.g, &s, ok, 2, buf, size + 1, &e) == PD_ERANGE);
  CHECK(pd_kvpack_unpack_range(&c.g, &s, ok, 2, size - 4, buf, 8, &e) == PD_ERANGE);
  CHECK(pd_kvpack_unpack_range(&c.g, &s, ok, 2, SIZE_MAX - 2, buf, 8, &e) == PD_ERANGE);
  pd_kv_slice not_held = {0, 2, 0, 4}; /* holds only global heads [2, 4) */
  CHECK(pd_kvpack_pack(&c.g, &not_held, ok, 2, buf, size * 2, &e) == PD_EINVAL);
  pd_kv_slice bad_layers = {1, 3, 2, 4};
  CHECK(pd_kvpack_pack(&c.g, &bad_layers, ok, 2, buf, size, &e) == PD_EINVAL);
  pd_kv_slice empty_heads = {0, 2, 3, 3};
  CHECK(pd_kvpack_pack(&c.g, &empty_heads, ok, 2, buf, size, &e) == PD_EINVAL);
  CHECK(pd_kvpack_pack(&c.g, &s, ok, 0, buf, size, &e) == PD_EINVAL);
  pd_kv_pages g = c.g;
  g.dtype = PD_DTYPE_I32;
  CHECK(pd_kvpack_pack(&g, &s, ok, 2, buf, size, &e) == PD_EINVAL);
  g = c.g;
  g.block_size = 0;
  CHECK(pd_kvpack_pack(&g, &s, ok, 2, buf, size, &e) == PD_EINVAL);
  CHECK(pd_kvpack_size(&g, &s, 2) == 0);
  free(buf);
  cache_free(&c);
}

int main(void) {
  test_full_roundtrip(PD_DTYPE_F32);
  test_full_roundtrip(PD_DTYPE_BF16);
  test_full_roundtrip(PD_DTYPE_F8_E4M3);
  test_ranges();
  test_reshard();
  test_errors();
  return pd_test_finish("test_net_kvpack");
}
