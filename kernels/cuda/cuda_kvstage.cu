/* KV staging for transfers between nodes (backend.h: kv_gather, kv_scatter, host_alloc,
 * host_free).
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
 * byte) units of a segment; both loops are strided, so any n and seg_bytes are covered. */
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

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* The stream the staging runs on: its own, so that a scatter's copies and its final sync do not
 * wait for a decode step queued on st (a decode node takes KV pages while a step computes; the
 * pages go to reserved blocks no step reads), and a gather waits only for the work before it.
 * PD_CUDA_KV_STREAM=0 keeps everything on st (a measurement switch). */
cudaStream_t kv_stream(cuda_impl *c) {
  if (c->kv_stream_state == 0) {
    const char *ev = getenv("PD_CUDA_KV_STREAM");
    c->kv_stream_state = -1;
    if (!(ev && !strcmp(ev, "0"))) {
      if (cudaStreamCreateWithFlags(&c->st_kv, cudaStreamNonBlocking) == cudaSuccess &&
          cudaEventCreateWithFlags(&c->kv_ev, cudaEventDisableTiming) == cudaSuccess) {
        c->kv_stream_state = 1;
      } else {
        cudaGetLastError();
        if (c->st_kv) cudaStreamDestroy(c->st_kv);
        c->st_kv = NULL;
      }
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

/* Host -> device staging, queued on the stream; the caller syncs before host may change. */
bool host_to_stage(cuda_impl *c, cudaStream_t s, char *dst, const void *src, size_t bytes) {
  if (!c->pin[0] || page_locked(src))
    return CK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  const size_t C = PD_CUDA_PIN_BYTES;
  const size_t n = (bytes + C - 1) / C;
  for (size_t i = 0; i < n; i++) {
    const int b = (int)(i & 1);
    const size_t len = i + 1 < n ? C : bytes - i * C;
    /* pin[b] may still feed the copy of chunk i - 2 */
    if (i >= 2 && !CK(c, cudaEventSynchronize(c->pin_ev[b]))) return false;
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
  pd_cuda_grow(c, &c->stage_dev, &c->stage_dev_size, ids_bytes + data);
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
  be->ops.kv_gather = cu_kv_gather;
  be->ops.kv_scatter = cu_kv_scatter;
  be->ops.host_alloc = cu_host_alloc;
  be->ops.host_free = cu_host_free;
}
