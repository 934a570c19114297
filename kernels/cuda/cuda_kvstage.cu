/* KV staging for transfers between nodes (backend.h: kv_gather, kv_scatter, kv_gather_runs,
 * kv_scatter_runs, host_alloc, host_free).
 *
 * gather:  ids -> device; a copy kernel packs the n segments
 *          (base + ids[i] * stride + offset, seg_bytes each) into the contiguous device staging
 *          buffer c->stage_dev; one device-to-host copy of the packed bytes. A page-locked host
 *          buffer receives it by DMA directly; a pageable one through the backend's two pinned
 *          chunks (c->pin), chunk i+1 in flight while chunk i is copied out, as cu_to_host does.
 * scatter: the reverse: host -> staging (directly from page-locked memory, else through the
 *          pinned chunks, filling chunk i+1 while chunk i is in flight), then a kernel spreads
 *          the segments into the cache. Returns after a stream sync, so the host buffer may be
 *          reused and a fault shows up in pd_backend_cuda_status at once.
 * Both run on a stream of their own (kv_stream): a gather after the work queued on the
 * backend's stream before it, a scatter concurrently with it (into blocks no queued step reads).
 *
 * stage_dev layout: [ids of the batch, padded to 256 bytes][packed segments]. A call moves its
 * segments in batches of at most kStageData bytes and kStageIds ids, so the staging buffer stays
 * bounded (grown with pd_cuda_grow, after a sync, up to about 36 MiB); a segment larger than
 * kStageData moves in pieces of one segment each.
 *
 * The kernels copy 16 bytes per thread when the cache address (base + offset), the stride and
 * the segment size are all multiples of 16 (every KV layout with head_dim * block_size * esize a
 * multiple of 16), one byte per thread otherwise. Grid: y walks the segments, x the 16-byte (or
 * byte) units of a segment; both loops are strided, so any n and seg_bytes are covered.
 *
 * The batched ops (kv_gather_runs / kv_scatter_runs) pay the fixed cost once for all the runs
 * of a call (pd_kvstage passes every run and cut segment of a frame): per batch, ONE upload of a
 * table (a RunDesc per piece, then all the ids, built in the pinned chunk pin[1]), ONE kernel
 * launch over the flattened segments of every piece (each segment finds its piece by a binary
 * search over the pieces' first flattened index; 16-byte or byte copies chosen per piece), ONE
 * device-to-host copy (or host-to-device) of the staging bytes, which mirror the host span of
 * the batch [lowest, highest byte), and one sync. Runs that lie back to back in the host buffer
 * (pd_kvstage's) make one copy; a gap between runs splits a gather's copy-out there (a gather
 * writes no byte outside its runs), while a scatter uploads the gaps too. Batches are bounded as
 * above (a host span of at most kStageData, kStageIds ids, kStageDescs pieces); a run that does
 * not fit continues in the next batch, a segment larger than kStageData in pieces. Without the
 * pinned chunks (the driver refused them) the runs go one by one through kv_gather / kv_scatter. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_state.h"

namespace {

constexpr size_t kStageData = (size_t)32 << 20; /* packed bytes per batch */
constexpr int kStageIds = 1 << 20;               /* ids per batch */
constexpr size_t kIdsAlign = 256;
constexpr int kThreads = 256;
constexpr unsigned kMaxGridX = 1024;
constexpr unsigned kMaxGridY = 65535;

/* dst[s * units + u] = (T at base + ids[s] * stride + offset)[u] */
template <typename T>
__global__ void gather_kernel(T *__restrict__ dst, const char *__restrict__ base,
                              const int32_t *__restrict__ ids, int n, size_t stride,
                              size_t offset, size_t units) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  for (int s = blockIdx.y; s < n; s += gridDim.y) {
    const T *src = reinterpret_cast<const T *>(base + (size_t)ids[s] * stride + offset);
    T *d = dst + (size_t)s * units;
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += step)
      d[u] = src[u];
  }
}

/* (T at base + ids[s] * stride + offset)[u] = src[s * units + u] */
template <typename T>
__global__ void scatter_kernel(char *__restrict__ base, const T *__restrict__ src,
                               const int32_t *__restrict__ ids, int n, size_t stride,
                               size_t offset, size_t units) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  for (int s = blockIdx.y; s < n; s += gridDim.y) {
    T *d = reinterpret_cast<T *>(base + (size_t)ids[s] * stride + offset);
    const T *from = src + (size_t)s * units;
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += step)
      d[u] = from[u];
  }
}

/* One piece of a batched call (kv_gather_runs / kv_scatter_runs) as the kernel reads it: n
 * segments of seg_bytes, segment j at base + ids[ids_at + j] * stride + offset in the cache and
 * at stage + stage_off + j * seg_bytes in the staging data; its segments are the batch's
 * flattened segments [seg_begin, seg_begin + n). vec: 16-byte units (both sides aligned). */
struct RunDesc {
  const char *base;
  size_t stride, offset, seg_bytes, stage_off;
  int32_t ids_at, seg_begin, n, vec;
  int32_t pad[2];
};
static_assert(sizeof(RunDesc) == 64, "RunDesc: 64 bytes, so the ids after the table align");

/* Every segment of every piece: y walks the flattened segments (the piece of segment g found by
 * a binary search over seg_begin, increasing), x the units of a segment. */
template <bool kGather>
__global__ void runs_kernel(char *__restrict__ stage, const RunDesc *__restrict__ d, int nd,
                            const int32_t *__restrict__ ids, int n_segs) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  for (int g = blockIdx.y; g < n_segs; g += gridDim.y) {
    int lo = 0, hi = nd - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (d[mid].seg_begin <= g) lo = mid;
      else hi = mid - 1;
    }
    const RunDesc r = d[lo];
    const int j = g - r.seg_begin;
    char *cache = const_cast<char *>(r.base) + (size_t)ids[r.ids_at + j] * r.stride + r.offset;
    char *st = stage + r.stage_off + (size_t)j * r.seg_bytes;
    if (r.vec) {
      uint4 *c4 = reinterpret_cast<uint4 *>(cache), *s4 = reinterpret_cast<uint4 *>(st);
      const size_t units = r.seg_bytes / 16;
      for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += step) {
        if (kGather) s4[u] = c4[u];
        else c4[u] = s4[u];
      }
    } else {
      for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < r.seg_bytes;
           u += step) {
        if (kGather) st[u] = cache[u];
        else cache[u] = st[u];
      }
    }
  }
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* The stream the staging runs on: its own, so that a scatter's copies and its final sync do not
 * wait for a decode step queued on st (a decode node takes KV pages while a step computes; the
 * pages go to reserved blocks no step reads), and a gather waits only for the work before it. */
cudaStream_t kv_stream(cuda_impl *c) {
  if (c->kv_stream_state == 0) {
    c->kv_stream_state = -1;
    if (cudaStreamCreateWithFlags(&c->st_kv, cudaStreamNonBlocking) == cudaSuccess &&
        cudaEventCreateWithFlags(&c->kv_ev, cudaEventDisableTiming) == cudaSuccess) {
      c->kv_stream_state = 1;
    } else { /* (everything on st then) */
      cudaGetLastError();
      if (c->st_kv) cudaStreamDestroy(c->st_kv);
      c->st_kv = NULL;
    }
  }
  return c->kv_stream_state == 1 ? c->st_kv : c->st;
}

/* Queues the copy kernel between the staging bytes and the cache. */
bool launch(cuda_impl *c, cudaStream_t s, bool gather, void *stage, const void *base,
            const int32_t *d_ids, int n, size_t stride, size_t offset, size_t seg_bytes) {
  const bool vec = ((uintptr_t)base + offset) % 16 == 0 && stride % 16 == 0 &&
                   seg_bytes % 16 == 0;
  const size_t units = vec ? seg_bytes / 16 : seg_bytes;
  size_t gx = (units + kThreads - 1) / kThreads;
  if (gx > kMaxGridX) gx = kMaxGridX;
  const unsigned gy = (unsigned)n < kMaxGridY ? (unsigned)n : kMaxGridY;
  const dim3 grid((unsigned)gx, gy);
  char *b = static_cast<char *>(const_cast<void *>(base));
  if (gather) {
    if (vec)
      gather_kernel<uint4><<<grid, kThreads, 0, s>>>(static_cast<uint4 *>(stage), b, d_ids, n,
                                                     stride, offset, units);
    else
      gather_kernel<unsigned char><<<grid, kThreads, 0, s>>>(
          static_cast<unsigned char *>(stage), b, d_ids, n, stride, offset, units);
    return CK_LAUNCH(c, "kv_gather");
  }
  if (vec)
    scatter_kernel<uint4><<<grid, kThreads, 0, s>>>(b, static_cast<const uint4 *>(stage), d_ids,
                                                    n, stride, offset, units);
  else
    scatter_kernel<unsigned char><<<grid, kThreads, 0, s>>>(
        b, static_cast<const unsigned char *>(stage), d_ids, n, stride, offset, units);
  return CK_LAUNCH(c, "kv_scatter");
}

bool page_locked(const void *host) {
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, host) != cudaSuccess) {
    cudaGetLastError(); /* older runtimes: pageable memory is an error here */
    return false;
  }
  return at.type == cudaMemoryTypeHost;
}

/* Device staging -> host; complete on return. */
bool stage_to_host(cuda_impl *c, cudaStream_t s, void *dst, const char *src, size_t bytes) {
  if (!c->pin[0] || page_locked(dst)) {
    if (!CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s))) return false;
    return CK(c, cudaStreamSynchronize(s));
  }
  const size_t C = PD_CUDA_PIN_BYTES;
  const size_t n = (bytes + C - 1) / C;
  auto len = [&](size_t i) { return i + 1 < n ? C : bytes - i * C; };
  for (size_t i = 0; i < n; i++) {
    const int b = (int)(i & 1);
    /* pin[b] last held chunk i - 2, copied out at step i - 1 */
    if (!CK(c, cudaMemcpyAsync(c->pin[b], src + i * C, len(i), cudaMemcpyDeviceToHost, s)))
      return false;
    if (!CK(c, cudaEventRecord(c->pin_ev[b], s))) return false;
    if (i > 0) {
      const int pb = (int)((i - 1) & 1);
      if (!CK(c, cudaEventSynchronize(c->pin_ev[pb]))) return false;
      memcpy(static_cast<char *>(dst) + (i - 1) * C, c->pin[pb], len(i - 1));
    }
  }
  const int lb = (int)((n - 1) & 1);
  if (!CK(c, cudaEventSynchronize(c->pin_ev[lb]))) return false;
  memcpy(static_cast<char *>(dst) + (n - 1) * C, c->pin[lb], len(n - 1));
  return true;
}

/* Host -> device staging, queued on the stream; the caller syncs before host may change.
 * pin1_busy: pin[1] still feeds a copy queued before (recorded on pin_ev[1]). */
bool host_to_stage(cuda_impl *c, cudaStream_t s, char *dst, const void *src, size_t bytes,
                   bool pin1_busy = false) {
  if (!c->pin[0] || page_locked(src))
    return CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  const size_t C = PD_CUDA_PIN_BYTES;
  const size_t n = (bytes + C - 1) / C;
  for (size_t i = 0; i < n; i++) {
    const int b = (int)(i & 1);
    const size_t len = i + 1 < n ? C : bytes - i * C;
    /* pin[b] may still feed the copy of chunk i - 2 (or, pin[1], the copy queued before) */
    if ((i >= 2 || (i == 1 && pin1_busy)) && !CK(c, cudaEventSynchronize(c->pin_ev[b])))
      return false;
    memcpy(c->pin[b], static_cast<const char *>(src) + i * C, len);
    if (!CK(c, cudaMemcpyAsync(dst + i * C, c->pin[b], len, cudaMemcpyHostToDevice, s)))
      return false;
    if (!CK(c, cudaEventRecord(c->pin_ev[b], s))) return false;
  }
  return true;
}

/* One batch: n <= kStageIds segments, n * seg_bytes <= kStageData (or one piece of a segment). */
bool batch(cuda_impl *c, cudaStream_t s, bool gather, void *host, const void *base,
           const int32_t *ids, int n, size_t stride, size_t offset, size_t seg_bytes) {
  const size_t ids_bytes = align_up((size_t)n * sizeof(int32_t), kIdsAlign);
  const size_t data = (size_t)n * seg_bytes;
  pd_cuda_grow(c, &c->stage_dev, &c->stage_dev_size, ids_bytes + data, false);
  int32_t *d_ids = static_cast<int32_t *>(c->stage_dev);
  char *d_data = static_cast<char *>(c->stage_dev) + ids_bytes;
  /* ids are pageable host memory as a rule: the copy has read them when this returns */
  if (!CK(c, cudaMemcpyAsync(d_ids, ids, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice,
                             s)))
    return false;
  if (gather) {
    if (!launch(c, s, true, d_data, base, d_ids, n, stride, offset, seg_bytes)) return false;
    return stage_to_host(c, s, host, d_data, data);
  }
  if (!host_to_stage(c, s, d_data, host, data)) return false;
  if (!launch(c, s, false, d_data, base, d_ids, n, stride, offset, seg_bytes)) return false;
  return CK(c, cudaStreamSynchronize(s));
}

void kv_stage(pd_backend *be, bool gather, void *host, const void *base, const int32_t *ids,
              int n, size_t stride, size_t offset, size_t seg_bytes) {
  PD_ASSERT(n >= 0);
  PD_ASSERT(n == 0 || (host && base && ids));
  for (int i = 0; i < n; i++) PD_ASSERT(ids[i] >= 0);
  if (n == 0 || seg_bytes == 0) return;
  cuda_impl *c = impl_of(be);
  PD_ASSERT(!c->capturing && "cuda backend: kv_gather / kv_scatter inside a graph capture");
  pd_cuda_use_device(c);
  const cudaStream_t s = kv_stream(c);
  /* a gather reads what the work queued before it (the forward pass) wrote */
  if (gather && s != c->st &&
      (!CK(c, cudaEventRecord(c->kv_ev, c->st)) || !CK(c, cudaStreamWaitEvent(s, c->kv_ev, 0))))
    return;
  char *h = static_cast<char *>(host);
  if (seg_bytes > kStageData) {
    for (int i = 0; i < n; i++)
      for (size_t p = 0; p < seg_bytes; p += kStageData) {
        const size_t len = seg_bytes - p < kStageData ? seg_bytes - p : kStageData;
        if (!batch(c, s, gather, h + (size_t)i * seg_bytes + p, base, ids + i, 1, stride,
                   offset + p, len))
          return;
      }
    return;
  }
  size_t fit = kStageData / seg_bytes;
  const int per = fit < (size_t)kStageIds ? (int)fit : kStageIds;
  for (int i = 0; i < n; i += per) {
    const int m = n - i < per ? n - i : per;
    if (!batch(c, s, gather, h + (size_t)i * seg_bytes, base, ids + i, m, stride, offset,
               seg_bytes))
      return;
  }
}

void cu_kv_gather(pd_backend *be, void *host, const void *base, const int32_t *ids, int n,
                  size_t stride, size_t offset, size_t seg_bytes) {
  kv_stage(be, true, host, base, ids, n, stride, offset, seg_bytes);
}

void cu_kv_scatter(pd_backend *be, void *base, const void *host, const int32_t *ids, int n,
                   size_t stride, size_t offset, size_t seg_bytes) {
  kv_stage(be, false, const_cast<void *>(host), base, ids, n, stride, offset, seg_bytes);
}

/* ---- batched staging: kv_gather_runs / kv_scatter_runs ------------------------------------ */

constexpr int kStageDescs = 32768; /* pieces per batch (2 MiB of table) */
static_assert(kStageDescs * sizeof(RunDesc) + kStageIds * sizeof(int32_t) <= PD_CUDA_PIN_BYTES,
              "a batch's table (pieces, then ids) fits in one pinned chunk");

/* Where the walk over a call's runs stands: run r, segment j, byte p of it (p > 0 only inside
 * a segment larger than kStageData, which moves in pieces). */
struct Cursor {
  int r, j;
  size_t p;
};

/* n segments of run `run` from segment j on, bytes [p, p + len) of each (p = 0 and len =
 * seg_bytes unless the segments are larger than a batch: then n = 1); h0: host offset of the
 * first byte. */
struct Piece {
  const pd_kv_run *run;
  int j, n;
  size_t p, len, h0;
};

/* Calls f(piece, index, first id) for each piece of the batch that starts at cur and returns
 * the cursor after it. A batch ends where one more piece would take the host span it covers
 * ([lowest, highest byte), which the staging mirrors) past kStageData, or its ids or pieces past
 * kStageIds / kStageDescs. Deterministic: the plan, the table and the copy-out of one batch walk
 * the same pieces. */
template <typename F>
Cursor walk_batch(const pd_kv_run *runs, int n_runs, Cursor cur, F &&f) {
  int nd = 0, nid = 0;
  size_t lo = 0, hi = 0;
  while (cur.r < n_runs) {
    const pd_kv_run &R = runs[cur.r];
    const size_t seg = R.seg_bytes;
    if (R.n <= 0 || seg == 0 || cur.j >= R.n) {
      cur = Cursor{cur.r + 1, 0, 0};
      continue;
    }
    if (nd == kStageDescs || nid == kStageIds) break;
    Piece pc;
    pc.run = &R;
    pc.j = cur.j;
    pc.p = cur.p;
    pc.len = seg > kStageData ? (seg - cur.p < kStageData ? seg - cur.p : kStageData) : seg;
    pc.h0 = R.host_off + (size_t)cur.j * seg + cur.p;
    size_t m = seg > kStageData ? 1 : (size_t)(R.n - cur.j);
    size_t room; /* bytes from h0 the span may still reach */
    if (nd == 0) room = kStageData;
    else if (pc.h0 >= lo) room = pc.h0 - lo > kStageData ? 0 : kStageData - (pc.h0 - lo);
    else room = hi - pc.h0 > kStageData ? 0 : kStageData;
    if (room / pc.len < m) m = room / pc.len;
    if ((size_t)(kStageIds - nid) < m) m = (size_t)(kStageIds - nid);
    if (m == 0) break; /* the next batch starts here */
    pc.n = (int)m;
    f(static_cast<const Piece &>(pc), nd, nid);
    const size_t end = pc.h0 + m * pc.len;
    if (nd == 0 || pc.h0 < lo) lo = pc.h0;
    if (nd == 0 || end > hi) hi = end;
    nd++;
    nid += (int)m;
    if (seg > kStageData) {
      cur.p += pc.len;
      if (cur.p == seg) cur = Cursor{cur.r, cur.j + 1, 0};
    } else {
      cur.j += (int)m;
    }
  }
  return cur;
}

/* A gather's copy-out of one batch: the staging bytes of each stretch of pieces that lie back
 * to back in host memory (the whole batch when the runs do), d_data mirroring host [lo, hi). */
bool runs_to_host(cuda_impl *c, cudaStream_t s, const pd_kv_run *runs, int n_runs, Cursor cur,
                  char *h, bool locked, const char *d_data, size_t lo) {
  bool ok = true;
  size_t a = 0, b = 0; /* the stretch being collected: host [a, b) */
  auto flush = [&]() {
    if (!ok || a == b) return;
    if (locked)
      ok = CK(c, cudaMemcpyAsync(h + a, d_data + (a - lo), b - a, cudaMemcpyDeviceToHost, s));
    else
      ok = stage_to_host(c, s, h + a, d_data + (a - lo), b - a);
  };
  walk_batch(runs, n_runs, cur, [&](const Piece &pc, int, int) {
    if (pc.h0 != b) {
      flush();
      a = pc.h0;
    }
    b = pc.h0 + (size_t)pc.n * pc.len;
  });
  flush();
  return ok && (!locked || CK(c, cudaStreamSynchronize(s)));
}

/* stage_dev layout of a batch: [pieces (RunDesc), ids, padded to 256 bytes][up to 15 bytes, so
 * that staging and host addresses agree mod 16][host bytes [lo, hi) of the batch]. */
void kv_stage_runs(pd_backend *be, bool gather, void *host, const pd_kv_run *runs, int n_runs) {
  PD_ASSERT(n_runs >= 0 && (n_runs == 0 || (host && runs)));
  bool any = false;
  for (int r = 0; r < n_runs; r++) {
    const pd_kv_run &R = runs[r];
    PD_ASSERT(R.n >= 0);
    if (R.n == 0 || R.seg_bytes == 0) continue;
    PD_ASSERT(R.base && R.ids);
    for (int i = 0; i < R.n; i++) PD_ASSERT(R.ids[i] >= 0);
    any = true;
  }
  if (!any) return;
  cuda_impl *c = impl_of(be);
  PD_ASSERT(!c->capturing && "cuda backend: kv_gather_runs / kv_scatter_runs inside a capture");
  char *h = static_cast<char *>(host);
  if (!c->pin[0]) { /* no pinned chunk to build the table in: run by run */
    for (int r = 0; r < n_runs; r++)
      kv_stage(be, gather, h + runs[r].host_off, runs[r].base, runs[r].ids, runs[r].n,
               runs[r].stride, runs[r].offset, runs[r].seg_bytes);
    return;
  }
  pd_cuda_use_device(c);
  const cudaStream_t s = kv_stream(c);
  /* a gather reads what the work queued before it (the forward pass) wrote */
  if (gather && s != c->st &&
      (!CK(c, cudaEventRecord(c->kv_ev, c->st)) || !CK(c, cudaStreamWaitEvent(s, c->kv_ev, 0))))
    return;
  const bool locked = gather && page_locked(host); /* scatter: host_to_stage checks */
  Cursor cur = {0, 0, 0};
  for (;;) {
    /* the batch's extent */
    int nd = 0, nid = 0;
    size_t lo = 0, hi = 0;
    const Cursor next = walk_batch(runs, n_runs, cur, [&](const Piece &pc, int, int) {
      const size_t end = pc.h0 + (size_t)pc.n * pc.len;
      if (nd == 0 || pc.h0 < lo) lo = pc.h0;
      if (nd == 0 || end > hi) hi = end;
      nd++;
      nid += pc.n;
    });
    if (nd == 0) return; /* only empty runs were left */
    const size_t tbl = (size_t)nd * sizeof(RunDesc) + (size_t)nid * sizeof(int32_t);
    const size_t tbl_pad = align_up(tbl, kIdsAlign);
    pd_cuda_grow(c, &c->stage_dev, &c->stage_dev_size, tbl_pad + 16 + (hi - lo), false);
    char *d_tbl = static_cast<char *>(c->stage_dev);
    char *d_data = d_tbl + tbl_pad + ((uintptr_t)h + lo) % 16;
    /* the table, in pin[1] (free: nothing is pending on it between calls or batches) */
    RunDesc *hd = static_cast<RunDesc *>(c->pin[1]);
    int32_t *hids = reinterpret_cast<int32_t *>(hd + nd);
    int nseg = 0;
    size_t max_units = 1;
    walk_batch(runs, n_runs, cur, [&](const Piece &pc, int k, int id0) {
      const pd_kv_run &R = *pc.run;
      const size_t off = R.offset + pc.p;
      const bool vec = ((uintptr_t)R.base + off) % 16 == 0 && (pc.n == 1 || R.stride % 16 == 0) &&
                       pc.len % 16 == 0 && ((uintptr_t)h + pc.h0) % 16 == 0;
      hd[k] = RunDesc{static_cast<const char *>(R.base), R.stride, off, pc.len, pc.h0 - lo,
                      id0, nseg, pc.n, vec ? 1 : 0, {0, 0}};
      memcpy(hids + id0, R.ids + pc.j, (size_t)pc.n * sizeof(int32_t));
      nseg += pc.n;
      const size_t units = vec ? pc.len / 16 : pc.len;
      if (units > max_units) max_units = units;
    });
    if (!CK(c, cudaMemcpyAsync(d_tbl, hd, tbl, cudaMemcpyHostToDevice, s))) return;
    if (!gather) {
      /* pin[1] feeds the table's copy: the upload waits for it before reusing pin[1] */
      if (!CK(c, cudaEventRecord(c->pin_ev[1], s))) return;
      if (!host_to_stage(c, s, d_data, h + lo, hi - lo, true)) return;
    }
    size_t gx = (max_units + kThreads - 1) / kThreads;
    if (gx > kMaxGridX) gx = kMaxGridX;
    const dim3 grid((unsigned)gx, (unsigned)nseg < kMaxGridY ? (unsigned)nseg : kMaxGridY);
    const RunDesc *d_desc = reinterpret_cast<const RunDesc *>(d_tbl);
    const int32_t *d_ids = reinterpret_cast<const int32_t *>(d_desc + nd);
    if (gather) {
      runs_kernel<true><<<grid, kThreads, 0, s>>>(d_data, d_desc, nd, d_ids, nseg);
      if (!CK_LAUNCH(c, "kv_gather_runs")) return;
      if (!runs_to_host(c, s, runs, n_runs, cur, h, locked, d_data, lo)) return;
    } else {
      runs_kernel<false><<<grid, kThreads, 0, s>>>(d_data, d_desc, nd, d_ids, nseg);
      if (!CK_LAUNCH(c, "kv_scatter_runs") || !CK(c, cudaStreamSynchronize(s))) return;
    }
    cur = next;
  }
}

void cu_kv_gather_runs(pd_backend *be, void *host, const pd_kv_run *runs, int n_runs) {
  kv_stage_runs(be, true, host, runs, n_runs);
}

void cu_kv_scatter_runs(pd_backend *be, const void *host, const pd_kv_run *runs, int n_runs) {
  kv_stage_runs(be, false, const_cast<void *>(host), runs, n_runs);
}

/* Page-locked host memory; NULL when the driver refuses (not a backend failure). */
void *cu_host_alloc(pd_backend *be, size_t bytes) {
  cuda_impl *c = impl_of(be);
  pd_cuda_use_device(c);
  void *p = NULL;
  if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return p;
}

void cu_host_free(pd_backend *be, void *p) {
  if (!p) return;
  cuda_impl *c = impl_of(be);
  pd_cuda_use_device(c);
  CK(c, cudaFreeHost(p));
}

} // namespace

void pd_cuda_register_kvstage(pd_backend *be) {
  be->ops.kv_gather = PD_CUDA_GUARD_STICKY(cu_kv_gather);
  be->ops.kv_scatter = PD_CUDA_GUARD_STICKY(cu_kv_scatter);
  be->ops.kv_gather_runs = PD_CUDA_GUARD_STICKY(cu_kv_gather_runs);
  be->ops.kv_scatter_runs = PD_CUDA_GUARD_STICKY(cu_kv_scatter_runs);
  be->ops.host_alloc = cu_host_alloc;
  be->ops.host_free = cu_host_free;
}
