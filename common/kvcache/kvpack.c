/* KV page pack/unpack (pd/kvpack.h): host caches with memcpy, backend caches (pd_kvstage)
 * with the backend's kv_gather_runs / kv_scatter_runs (one call per range), or kv_gather /
 * kv_scatter (one call per run) where the backend lacks the batched ops.
 *
 * The staging buffer is a sequence of segments, one per (layer, K/V, listed block), each the
 * slice's heads of that block: (head_end - head_begin) * block_size * head_dim * esize bytes.
 * Inside a block of the cache the heads are outermost, so the heads both sides hold form ONE
 * contiguous run in the segment and one in the cache: every segment is a single memcpy (or none),
 * also for a byte range that starts or ends inside a segment. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "pd/backend_cuda.h"
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

/* The checks every ranged call makes before copying anything. */
static pd_status range_check(const pd_kv_pages *g, const pd_kv_slice *s, const int32_t *ids,
                             int n, size_t off, const void *buf, size_t len, bool pack,
                             pd_err *e) {
  pd_status st = pd_kvpack_check(g, s, ids, n, !pack, e);
  if (st) return st;
  size_t total = pd_kvpack_size(g, s, n);
  if (off > total || len > total - off)
    return pd_err_set(e, PD_ERANGE, "kvpack: range [%zu, +%zu) outside the %zu-byte buffer", off,
                      len, total);
  if (len && !buf) return pd_err_set(e, PD_EINVAL, "kvpack: NULL buffer");
  return PD_OK;
}

static pd_status ranged(const pd_kv_pages *g, const pd_kv_slice *s, const int32_t *ids, int n,
                        size_t off, void *buf, size_t len, bool pack, pd_err *e) {
  pd_status st = range_check(g, s, ids, n, off, buf, len, pack, e);
  if (st) return st;
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

/* ---- backend caches: pd_kvstage ---------------------------------------------------------- */

#define KVSTAGE_BOUNCE_DEFAULT ((size_t)4 << 20)

struct pd_kvstage {
  pd_backend *be;
  size_t bounce_max; /* the batch size for resharded runs, in bytes */
  void *bounce;      /* host; page-locked when from be->ops.host_alloc */
  size_t bounce_cap;
  bool bounce_pinned;
  pd_kv_run *runs; /* the run list of a batched call (kv_gather_runs / kv_scatter_runs) */
  size_t runs_cap;
};

pd_kvstage *pd_kvstage_new(pd_backend *be, size_t bounce_bytes, pd_err *e) {
  if (!be) {
    pd_err_set(e, PD_EINVAL, "kvstage: no backend");
    return NULL;
  }
  if (!be->ops.kv_gather || !be->ops.kv_scatter) {
    pd_err_set(e, PD_EUNSUPPORTED, "kvstage: the %s backend has no kv_gather / kv_scatter",
               be->ops.name ? be->ops.name : "?");
    return NULL;
  }
  pd_kvstage *st = calloc(1, sizeof *st);
  if (!st) {
    pd_err_set(e, PD_ENOMEM, "kvstage: out of memory");
    return NULL;
  }
  st->be = be;
  st->bounce_max = bounce_bytes ? bounce_bytes : KVSTAGE_BOUNCE_DEFAULT;
  return st;
}

static void bounce_release(pd_kvstage *st) {
  if (!st->bounce) return;
  if (st->bounce_pinned) st->be->ops.host_free(st->be, st->bounce);
  else free(st->bounce);
  st->bounce = NULL;
  st->bounce_cap = 0;
  st->bounce_pinned = false;
}

void pd_kvstage_free(pd_kvstage *st) {
  if (!st) return;
  bounce_release(st);
  free(st->runs);
  free(st);
}

/* Makes the bounce buffer at least bytes long (page-locked when the backend can). */
static pd_status bounce_reserve(pd_kvstage *st, size_t bytes, pd_err *e) {
  if (bytes <= st->bounce_cap) return PD_OK;
  bounce_release(st);
  pd_backend *be = st->be;
  if (be->ops.host_alloc && be->ops.host_free) {
    st->bounce = be->ops.host_alloc(be, bytes);
    st->bounce_pinned = st->bounce != NULL;
  }
  if (!st->bounce) st->bounce = malloc(bytes);
  if (!st->bounce) return pd_err_set(e, PD_ENOMEM, "kvstage: no %zu-byte bounce buffer", bytes);
  st->bounce_cap = bytes;
  return PD_OK;
}

/* PD_EBACKEND when the backend recorded a failure (only CUDA backends can fail an op). */
static pd_status backend_status(pd_backend *be, pd_err *e) {
  if (!pd_backend_cuda_stream(be)) return PD_OK;
  pd_err be_err = {0};
  if (pd_backend_cuda_status(be, &be_err) == PD_OK) return PD_OK;
  return pd_err_set(e, PD_EBACKEND, "kvstage: backend failure: %s", be_err.msg);
}

/* One staging walk over a backend cache (see pd/kvpack.h for the cost model). */
typedef struct stage_walk {
  pd_kvstage *st;
  bool pack;
  const int32_t *ids;
  size_t seg;            /* staging segment bytes (the slice's heads) */
  size_t held_a, held_b; /* the heads held here, as a byte range of a segment */
  size_t stride;         /* bytes of one block of one layer's K (or V) */
  size_t coff;           /* byte offset of the first held head inside a block */
  uint8_t *buf;          /* the caller's bytes [off, off + len) */
  size_t off;
} stage_walk;

/* n segments starting at list entry i: host (contiguous, seg_bytes each) <-> the cache at
 * base + ids[i + j] * stride + coff + skip. */
static pd_status stage_io(stage_walk *w, void *base, size_t i, int n, size_t skip, void *host,
                          size_t seg_bytes, pd_err *e) {
  pd_backend *be = w->st->be;
  if (w->pack)
    be->ops.kv_gather(be, host, base, w->ids + i, n, w->stride, w->coff + skip, seg_bytes);
  else
    be->ops.kv_scatter(be, base, host, w->ids + i, n, w->stride, w->coff + skip, seg_bytes);
  return backend_status(be, e);
}

/* Bytes [x0, y0) of segment i of the run starting at staging offset rs. */
static pd_status stage_partial(stage_walk *w, void *base, size_t rs, size_t i, size_t x0,
                               size_t y0, pd_err *e) {
  size_t x = x0 > w->held_a ? x0 : w->held_a;
  size_t y = y0 < w->held_b ? y0 : w->held_b;
  if (x >= y) return PD_OK;
  return stage_io(w, base, i, 1, x - w->held_a, w->buf + (rs + i * w->seg + x - w->off), y - x,
                  e);
}

/* The whole segments [i0, i1) of the run starting at staging offset rs. */
static pd_status stage_full(stage_walk *w, void *base, size_t rs, size_t i0, size_t i1,
                            pd_err *e) {
  if (i0 >= i1) return PD_OK;
  size_t hb = w->held_b - w->held_a;
  if (hb == w->seg) /* every head of the slice is held: staging bytes are the cache's segments */
    return stage_io(w, base, i0, (int)(i1 - i0), 0, w->buf + (rs + i0 * w->seg - w->off), hb, e);
  /* resharding: the held heads are a strided part of each segment; compact them */
  size_t per = w->st->bounce_max / hb;
  if (per < 1) per = 1;
  if (per > i1 - i0) per = i1 - i0;
  pd_status st = bounce_reserve(w->st, per * hb, e);
  if (st) return st;
  uint8_t *bounce = w->st->bounce;
  for (size_t i = i0; i < i1; i += per) {
    size_t m = i1 - i < per ? i1 - i : per;
    if (!w->pack)
      for (size_t j = 0; j < m; j++)
        memcpy(bounce + j * hb, w->buf + (rs + (i + j) * w->seg + w->held_a - w->off), hb);
    if ((st = stage_io(w, base, i, (int)m, 0, bounce, hb, e))) return st;
    if (w->pack)
      for (size_t j = 0; j < m; j++)
        memcpy(w->buf + (rs + (i + j) * w->seg + w->held_a - w->off), bounce + j * hb, hb);
  }
  return PD_OK;
}

/* ---- the batched path: every piece of the range in one kv_gather_runs / kv_scatter_runs ---- */

typedef struct run_list {
  pd_kvstage *st;
  size_t n;
} run_list;

static pd_status run_push(run_list *l, const pd_kv_run *r, pd_err *e) {
  pd_kvstage *st = l->st;
  if (l->n == st->runs_cap) {
    size_t cap = st->runs_cap ? 2 * st->runs_cap : 64;
    pd_kv_run *p = realloc(st->runs, cap * sizeof *p);
    if (!p) return pd_err_set(e, PD_ENOMEM, "kvstage: no room for %zu runs", cap);
    st->runs = p;
    st->runs_cap = cap;
  }
  st->runs[l->n++] = *r;
  return PD_OK;
}

/* Bytes [x0, y0) of segment i of the run starting at staging offset rs, clipped to the held
 * heads: one run of one segment. */
static pd_status batch_partial(const stage_walk *w, run_list *l, const void *base, size_t rs,
                               size_t i, size_t x0, size_t y0, pd_err *e) {
  size_t x = x0 > w->held_a ? x0 : w->held_a;
  size_t y = y0 < w->held_b ? y0 : w->held_b;
  if (x >= y) return PD_OK;
  pd_kv_run r = {.base = base, .ids = w->ids + i, .n = 1, .stride = w->stride,
                 .offset = w->coff + (x - w->held_a), .seg_bytes = y - x,
                 .host_off = rs + i * w->seg + x - w->off};
  return run_push(l, &r, e);
}

/* Collects the pieces of bytes [a, b) of the (layer, K/V) run t (staging offset rs): whole
 * segments as one run when every head is held, else one run per segment's held part. */
static pd_status batch_collect(const stage_walk *w, run_list *l, const void *base, size_t rs,
                               size_t a, size_t b, pd_err *e) {
  const size_t seg = w->seg;
  pd_status st = PD_OK;
  if (w->held_b - w->held_a < seg) { /* resharding: the held part of each touched segment */
    for (size_t i = a / seg; i * seg < b && !st; i++) {
      size_t x0 = a > i * seg ? a - i * seg : 0;
      size_t y0 = b - i * seg < seg ? b - i * seg : seg;
      st = batch_partial(w, l, base, rs, i, x0, y0, e);
    }
    return st;
  }
  const size_t fa = (a + seg - 1) / seg, fb = b / seg; /* whole segments [fa, fb) */
  if (fa > fb) { /* inside one segment */
    size_t i = a / seg;
    return batch_partial(w, l, base, rs, i, a - i * seg, b - i * seg, e);
  }
  if (a % seg) st = batch_partial(w, l, base, rs, a / seg, a % seg, seg, e);
  if (!st && fb > fa) {
    pd_kv_run r = {.base = base, .ids = w->ids + fa, .n = (int)(fb - fa), .stride = w->stride,
                   .offset = w->coff, .seg_bytes = seg, .host_off = rs + fa * seg - w->off};
    st = run_push(l, &r, e);
  }
  if (!st && b % seg) st = batch_partial(w, l, base, rs, fb, 0, b % seg, e);
  return st;
}

static pd_status stage_ranged(pd_kvstage *stg, const pd_kv_pages *g, const pd_kv_slice *s,
                              const int32_t *ids, int n, size_t off, void *buf, size_t len,
                              bool pack, pd_err *e) {
  if (!stg) return pd_err_set(e, PD_EINVAL, "kvstage: NULL stage");
  pd_status st = range_check(g, s, ids, n, off, buf, len, pack, e);
  if (st || !len) return st;
  const size_t hc = head_chunk_bytes(g);
  int lo = s->head_begin > g->head_offset ? s->head_begin : g->head_offset;
  int hi = s->head_end < g->head_offset + g->num_kv_heads ? s->head_end
                                                          : g->head_offset + g->num_kv_heads;
  if (lo >= hi) return PD_OK; /* unpack: none of these heads live here */
  stage_walk w = {.st = stg, .pack = pack, .ids = ids,
                  .seg = hc * (size_t)(s->head_end - s->head_begin),
                  .held_a = (size_t)(lo - s->head_begin) * hc,
                  .held_b = (size_t)(hi - s->head_begin) * hc,
                  .stride = hc * (size_t)g->num_kv_heads,
                  .coff = (size_t)(lo - g->head_offset) * hc, .buf = buf, .off = off};
  const size_t run = w.seg * (size_t)n; /* one (layer, K/V): n segments */
  const size_t end = off + len;
  pd_backend *be = stg->be;
  if (be->ops.kv_gather_runs && be->ops.kv_scatter_runs) { /* one call for the whole range */
    run_list l = {.st = stg, .n = 0};
    for (size_t t = off / run; t * run < end; t++) {
      const size_t rs = t * run;
      const size_t a = (off > rs ? off : rs) - rs;
      const size_t b = (end < rs + run ? end : rs + run) - rs;
      const int layer = s->layer_begin + (int)(t / 2);
      const void *base = t % 2 ? g->layers[layer].v : g->layers[layer].k;
      if ((st = batch_collect(&w, &l, base, rs, a, b, e))) return st;
    }
    if (!l.n) return PD_OK; /* only heads not held here */
    if (l.n > INT_MAX) return pd_err_set(e, PD_ERANGE, "kvstage: %zu runs in one range", l.n);
    if (pack) be->ops.kv_gather_runs(be, buf, stg->runs, (int)l.n);
    else be->ops.kv_scatter_runs(be, buf, stg->runs, (int)l.n);
    return backend_status(be, e);
  }
  for (size_t t = off / run; t * run < end; t++) {
    const size_t rs = t * run;
    const size_t a = (off > rs ? off : rs) - rs;
    const size_t b = (end < rs + run ? end : rs + run) - rs;
    const int layer = s->layer_begin + (int)(t / 2);
    void *base = t % 2 ? g->layers[layer].v : g->layers[layer].k;
    const size_t fa = (a + w.seg - 1) / w.seg, fb = b / w.seg; /* whole segments [fa, fb) */
    if (fa > fb) { /* the range lies inside one segment */
      size_t i = a / w.seg;
      st = stage_partial(&w, base, rs, i, a - i * w.seg, b - i * w.seg, e);
    } else {
      if (a % w.seg) st = stage_partial(&w, base, rs, a / w.seg, a % w.seg, w.seg, e);
      if (!st) st = stage_full(&w, base, rs, fa, fb, e);
      if (!st && b % w.seg) st = stage_partial(&w, base, rs, fb, 0, b % w.seg, e);
    }
    if (st) return st;
  }
  return PD_OK;
}

pd_status pd_kvstage_pack_range(pd_kvstage *st, const pd_kv_pages *src, const pd_kv_slice *s,
                                const int32_t *block_ids, int n_blocks, size_t off, void *buf,
                                size_t len, pd_err *e) {
  return stage_ranged(st, src, s, block_ids, n_blocks, off, buf, len, true, e);
}

pd_status pd_kvstage_unpack_range(pd_kvstage *st, const pd_kv_pages *dst, const pd_kv_slice *s,
                                  const int32_t *block_ids, int n_blocks, size_t off,
                                  const void *buf, size_t len, pd_err *e) {
  return stage_ranged(st, dst, s, block_ids, n_blocks, off, (void *)buf, len, false, e);
}
