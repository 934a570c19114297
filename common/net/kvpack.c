/* KV page pack/unpack on the CPU (pd/kvpack.h).
 *
 * The staging buffer is a sequence of segments, one per (layer, K/V, listed block), each the
 * slice's heads of that block: (head_end - head_begin) * block_size * head_dim * esize bytes.
 * Inside a block of the cache the heads are outermost, so the heads both sides hold form ONE
 * contiguous run in the segment and one in the cache: every segment is a single memcpy (or none),
 * also for a byte range that starts or ends inside a segment. */
#include <string.h>

#include "pd/kvpack.h"

#define MAX_HEADS 65536

static bool kv_dtype_ok(pd_dtype t) {
  return t == PD_DTYPE_F32 || t == PD_DTYPE_F16 || t == PD_DTYPE_BF16 ||
         t == PD_DTYPE_F8_E4M3 || t == PD_DTYPE_F8_E5M2;
}

static bool mul3(size_t a, size_t b, size_t c, size_t *r) {
  size_t t;
  return !__builtin_mul_overflow(a, b, &t) && !__builtin_mul_overflow(t, c, r);
}

/* Bytes of one head of one block: block_size * head_dim * esize. */
static size_t head_chunk_bytes(const pd_kv_pages *g) {
  size_t r;
  if (!mul3((size_t)g->block_size, (size_t)g->head_dim, pd_dtype_size(g->dtype), &r)) return 0;
  return r;
}

static bool geom_ok(const pd_kv_pages *g) {
  return g && g->layers && g->num_layers > 0 && g->num_blocks > 0 && g->num_kv_heads > 0 &&
         g->num_kv_heads <= MAX_HEADS && g->head_offset >= 0 &&
         g->head_offset <= MAX_HEADS - g->num_kv_heads && g->block_size > 0 && g->head_dim > 0 &&
         (unsigned)g->dtype < PD_DTYPE_COUNT && kv_dtype_ok(g->dtype);
}

static bool slice_ok(const pd_kv_pages *g, const pd_kv_slice *s) {
  return s && s->layer_begin >= 0 && s->layer_begin < s->layer_end &&
         s->layer_end <= g->num_layers && s->head_begin >= 0 && s->head_begin < s->head_end &&
         s->head_end <= MAX_HEADS;
}

size_t pd_kvpack_segment_bytes(const pd_kv_pages *g, const pd_kv_slice *s) {
  if (!geom_ok(g) || !slice_ok(g, s)) return 0;
  size_t hc = head_chunk_bytes(g), r;
  if (!hc || __builtin_mul_overflow(hc, (size_t)(s->head_end - s->head_begin), &r)) return 0;
  return r;
}

size_t pd_kvpack_size(const pd_kv_pages *g, const pd_kv_slice *s, int n_blocks) {
  size_t seg = pd_kvpack_segment_bytes(g, s), r;
  if (!seg || n_blocks <= 0) return 0;
  if (!mul3(seg, 2 * (size_t)n_blocks, (size_t)(s->layer_end - s->layer_begin), &r)) return 0;
  return r;
}

size_t pd_kvpack_offset(const pd_kv_pages *g, const pd_kv_slice *s, int n_blocks) {
  size_t seg = pd_kvpack_segment_bytes(g, s), r;
  if (!seg || n_blocks <= 0) return 0;
  if (!mul3(seg, 2 * (size_t)n_blocks, (size_t)s->layer_begin, &r)) return 0;
  return r;
}

pd_status pd_kvpack_check(const pd_kv_pages *g, const pd_kv_slice *s, const int32_t *block_ids,
                          int n_blocks, bool unpack, pd_err *e) {
  if (!geom_ok(g))
    return pd_err_set(e, PD_EINVAL, "kvpack: invalid cache geometry (sizes must be positive, "
                      "dtype F32/F16/BF16/F8, at most %d heads)", MAX_HEADS);
  size_t hc = head_chunk_bytes(g), cache_bytes;
  if (!hc || !mul3(hc, (size_t)g->num_kv_heads, (size_t)g->num_blocks, &cache_bytes))
    return pd_err_set(e, PD_ERANGE, "kvpack: cache size overflows");
  if (!slice_ok(g, s))
    return pd_err_set(e, PD_EINVAL, "kvpack: slice layers [%d, %d) heads [%d, %d) invalid for "
                      "%d layers", s ? s->layer_begin : 0, s ? s->layer_end : 0,
                      s ? s->head_begin : 0, s ? s->head_end : 0, g->num_layers);
  if (!unpack && (s->head_begin < g->head_offset ||
                  s->head_end > g->head_offset + g->num_kv_heads))
    return pd_err_set(e, PD_EINVAL, "kvpack: heads [%d, %d) are not all held here ([%d, %d))",
                      s->head_begin, s->head_end, g->head_offset,
                      g->head_offset + g->num_kv_heads);
  for (int l = s->layer_begin; l < s->layer_end; l++)
    if (!g->layers[l].k || !g->layers[l].v)
      return pd_err_set(e, PD_EINVAL, "kvpack: layer %d has no K/V storage", l);
  if (n_blocks <= 0 || !block_ids)
    return pd_err_set(e, PD_EINVAL, "kvpack: no blocks");
  if (pd_kvpack_size(g, s, n_blocks) == 0 ||
      pd_kvpack_offset(g, s, n_blocks) > SIZE_MAX - pd_kvpack_size(g, s, n_blocks))
    return pd_err_set(e, PD_ERANGE, "kvpack: staging size overflows");
  for (int i = 0; i < n_blocks; i++)
    if (block_ids[i] < 0 || block_ids[i] >= g->num_blocks)
      return pd_err_set(e, PD_ERANGE, "kvpack: block id %d (entry %d) out of range [0, %d)",
                        block_ids[i], i, g->num_blocks);
  return PD_OK;
}

/* Copies bytes [off, off + len) of the slice's buffer between buf and the cache. */
static void walk(const pd_kv_pages *g, const pd_kv_slice *s, const int32_t *ids, int n,
                 size_t off, uint8_t *buf, size_t len, bool pack) {
  const size_t hc = head_chunk_bytes(g);
  const size_t seg = hc * (size_t)(s->head_end - s->head_begin);
  /* Heads held on this side, as a byte range [held_a, held_b) of every segment. */
  int lo = s->head_begin > g->head_offset ? s->head_begin : g->head_offset;
  int hi = s->head_end < g->head_offset + g->num_kv_heads ? s->head_end
                                                          : g->head_offset + g->num_kv_heads;
  if (lo >= hi) return; /* unpack: none of these heads live here */
  const size_t held_a = (size_t)(lo - s->head_begin) * hc;
  const size_t held_b = (size_t)(hi - s->head_begin) * hc;
  const size_t local_lo = (size_t)(lo - g->head_offset);
  const size_t end = off + len;
  size_t sgi = off / seg;
  for (size_t pos = off; pos < end; sgi++) {
    const size_t seg_start = sgi * seg;
    const size_t a = pos - seg_start;
    const size_t b = end - seg_start < seg ? end - seg_start : seg;
    const size_t x = a > held_a ? a : held_a;
    const size_t y = b < held_b ? b : held_b;
    if (x < y) {
      const size_t i = sgi % (size_t)n;
      const size_t t = sgi / (size_t)n;
      const int layer = s->layer_begin + (int)(t / 2);
      uint8_t *base = (uint8_t *)(t % 2 ? g->layers[layer].v : g->layers[layer].k);
      uint8_t *cache = base + ((size_t)ids[i] * (size_t)g->num_kv_heads + local_lo) * hc +
                       (x - held_a);
      uint8_t *stage = buf + (seg_start + x - off);
      if (pack)
        memcpy(stage, cache, y - x);
      else
        memcpy(cache, stage, y - x);
    }
    pos = seg_start + b;
  }
}

static pd_status ranged(const pd_kv_pages *g, const pd_kv_slice *s, const int32_t *ids, int n,
                        size_t off, void *buf, size_t len, bool pack, pd_err *e) {
  pd_status st = pd_kvpack_check(g, s, ids, n, !pack, e);
  if (st) return st;
  size_t total = pd_kvpack_size(g, s, n);
  if (off > total || len > total - off)
    return pd_err_set(e, PD_ERANGE, "kvpack: range [%zu, +%zu) outside the %zu-byte buffer", off,
                      len, total);
  if (len && !buf) return pd_err_set(e, PD_EINVAL, "kvpack: NULL buffer");
  if (len) walk(g, s, ids, n, off, buf, len, pack);
  return PD_OK;
}

pd_status pd_kvpack_pack_range(const pd_kv_pages *src, const pd_kv_slice *s,
                               const int32_t *block_ids, int n_blocks, size_t off, void *buf,
                               size_t len, pd_err *e) {
  return ranged(src, s, block_ids, n_blocks, off, buf, len, true, e);
}

pd_status pd_kvpack_unpack_range(const pd_kv_pages *dst, const pd_kv_slice *s,
                                 const int32_t *block_ids, int n_blocks, size_t off,
                                 const void *buf, size_t len, pd_err *e) {
  return ranged(dst, s, block_ids, n_blocks, off, (void *)buf, len, false, e);
}

pd_status pd_kvpack_pack(const pd_kv_pages *src, const pd_kv_slice *s, const int32_t *block_ids,
                         int n_blocks, void *buf, size_t cap, pd_err *e) {
  size_t need = pd_kvpack_size(src, s, n_blocks);
  if (need && cap < need)
    return pd_err_set(e, PD_ERANGE, "kvpack: buffer of %zu bytes, %zu needed", cap, need);
  return ranged(src, s, block_ids, n_blocks, 0, buf, need, true, e);
}

pd_status pd_kvpack_unpack(const pd_kv_pages *dst, const pd_kv_slice *s,
                           const int32_t *block_ids, int n_blocks, const void *buf, size_t len,
                           pd_err *e) {
  size_t need = pd_kvpack_size(dst, s, n_blocks);
  if (need && len != need)
    return pd_err_set(e, PD_ERANGE, "kvpack: buffer of %zu bytes, the slice has %zu", len, need);
  return ranged(dst, s, block_ids, n_blocks, 0, (void *)buf, need, false, e);
}
