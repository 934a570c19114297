/* KV page pack/unpack on the CPU: the staging-buffer format of KV transfers between nodes.
 *
 * A node's paged KV cache, per layer (pd/backend.h):
 *   k, v: [num_blocks, num_kv_heads, block_size, head_dim] in dtype
 * where num_kv_heads are the heads this cache holds: the global kv heads
 * [head_offset, head_offset + num_kv_heads) of the model (a tensor-parallel shard, or all).
 *
 * Staging buffer of a slice (layers [layer_begin, layer_end) — but laid out for ALL layers
 * [0, num_layers) so that offsets are stable — global heads [head_begin, head_end), and a list
 * of n_blocks blocks):
 *   for layer in [0, num_layers):
 *     for kv in (K, V):
 *       for i in [0, n_blocks):
 *         segment = kv[layer][block_ids[i]][head_begin:head_end][:][:]
 * segment_bytes = (head_end - head_begin) * block_size * head_dim * sizeof(dtype); heads are
 * outermost inside a block, so a head range of a block is one contiguous run in the cache.
 * Only the layers of the slice are present in a buffer; the byte at staging offset x of
 * layer L lies at buffer offset x - layer_begin * 2 * n_blocks * segment_bytes.
 *
 * The receiver unpacks into its OWN block ids (the list order is the token order, the same on
 * both sides), and copies only the heads it holds: the intersection of the slice's heads
 * with its [head_offset, head_offset + num_kv_heads); so prefill TP=2 -> decode TP=1 (or the
 * reverse) reshards by head range. Ranged variants pack or unpack any byte range of the buffer,
 * so a transfer can be cut into frames of bounded size and each frame unpacked on arrival
 * without reassembly.
 *
 * The pd_kvpack_* functions read and write caches in host memory (the CPU backend, or a host
 * mirror); nothing allocates; thread-safe on disjoint data. Caches in device memory go through a
 * pd_kvstage (below), which produces and consumes the same bytes with the backend's kv_gather /
 * kv_scatter ops, so either side of a transfer may be a CPU or a GPU node. */
#ifndef PD_KVPACK_H
#define PD_KVPACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/backend.h"
#include "pd/dtype.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One side's paged KV cache: host memory for pd_kvpack_*, backend memory for pd_kvstage_*. */
typedef struct pd_kv_pages {
  pd_kv_layer *layers; /* [num_layers]; k, v: [num_blocks, num_kv_heads, block_size, head_dim] */
  int num_layers;
  int num_blocks;
  int num_kv_heads; /* heads held here */
  int head_offset;  /* global index of local head 0 (TP shard start); 0 for a full cache */
  int block_size;
  int head_dim;
  pd_dtype dtype;
} pd_kv_pages;

/* What a staging buffer holds (besides the block list). Heads are GLOBAL indices. */
typedef struct pd_kv_slice {
  int layer_begin, layer_end; /* [begin, end) within [0, num_layers) */
  int head_begin, head_end;   /* [begin, end), global kv heads */
} pd_kv_slice;

/* Bytes of one segment (one layer, K or V, one block, the slice's heads); 0 on bad args or
 * overflow. */
size_t pd_kvpack_segment_bytes(const pd_kv_pages *g, const pd_kv_slice *s);
/* Bytes of the staging buffer of slice s over n_blocks blocks:
 * (layer_end - layer_begin) * 2 * n_blocks * segment_bytes; 0 on bad args or overflow. */
size_t pd_kvpack_size(const pd_kv_pages *g, const pd_kv_slice *s, int n_blocks);
/* Staging offset of the slice's first byte (layer_begin * 2 * n_blocks * segment_bytes). */
size_t pd_kvpack_offset(const pd_kv_pages *g, const pd_kv_slice *s, int n_blocks);

/* Checks g (positive sizes, an F32/F16/BF16/FP8 dtype, non-NULL layer pointers) and s against
 * g: layers within [0, num_layers), a non-empty head range. For packing (unpack == false) the
 * slice's heads must all be held by g; for unpacking they may extend beyond g's heads (those
 * are skipped) but must lie in [0, 65536). Block ids must be in [0, num_blocks). Duplicate
 * destination ids are not detected here (they would only overwrite): pd_wire_validate_kv_header
 * rejects them on receipt. */
pd_status pd_kvpack_check(const pd_kv_pages *g, const pd_kv_slice *s, const int32_t *block_ids,
                          int n_blocks, bool unpack, pd_err *e);

/* Packs the whole slice: buf receives pd_kvpack_size bytes (cap >= that, else PD_ERANGE).
 * The slice's heads must be held by src. */
pd_status pd_kvpack_pack(const pd_kv_pages *src, const pd_kv_slice *s, const int32_t *block_ids,
                         int n_blocks, void *buf, size_t cap, pd_err *e);
/* Unpacks a whole slice buffer of len = pd_kvpack_size bytes into dst's blocks. */
pd_status pd_kvpack_unpack(const pd_kv_pages *dst, const pd_kv_slice *s,
                           const int32_t *block_ids, int n_blocks, const void *buf, size_t len,
                           pd_err *e);

/* Ranged forms: bytes [off, off + len) of the slice's buffer (off relative to the slice's
 * first byte, off + len <= pd_kvpack_size). pack_range writes them to buf; unpack_range
 * copies them into dst (heads dst does not hold are skipped). */
pd_status pd_kvpack_pack_range(const pd_kv_pages *src, const pd_kv_slice *s,
                               const int32_t *block_ids, int n_blocks, size_t off, void *buf,
                               size_t len, pd_err *e);
pd_status pd_kvpack_unpack_range(const pd_kv_pages *dst, const pd_kv_slice *s,
                                 const int32_t *block_ids, int n_blocks, size_t off,
                                 const void *buf, size_t len, pd_err *e);

/* ---- caches in backend memory (GPU nodes) ----
 *
 * A pd_kvstage packs and unpacks byte ranges of the staging buffer above for a cache whose layer
 * pointers are memory of its backend (device memory on CUDA), with the same arguments, checks and
 * results as pd_kvpack_pack_range / pd_kvpack_unpack_range. `buf` is host memory (a ZeroMQ frame;
 * ordinary pageable memory is fine).
 *
 * In the staging buffer, the n_blocks segments of one (layer, K/V) form one contiguous run of
 * n_blocks * segment_bytes, and in the cache each segment is one contiguous run too (heads are
 * outermost in a block): segment i lies at k_or_v + block_ids[i] * block_bytes + (first head's
 * offset). So the part of a run inside [off, off + len) is:
 *   - one pd_kv_run of all its whole segments, straight to or from buf (stride = block_bytes,
 *     offset = first head's byte offset, seg_bytes = segment_bytes);
 *   - at most two more, of one segment each, for a segment cut by the range's ends (the ops
 *     take any offset and size, so a cut segment moves just its bytes, also straight to buf).
 * With the backend's batched ops (kv_gather_runs / kv_scatter_runs; the CPU and CUDA backends
 * have them) every run of the range goes in ONE call: a frame costs one call, whatever its
 * number of layers and cut segments; on CUDA that is one upload of the run table and ids, one
 * copy kernel, one device-to-host copy of the frame's bytes (or the reverse) and one sync, at
 * PCIe speed also for pageable buf (the backend stages it through its pinned chunks; a
 * page-locked buf is copied to directly). Without them each run is one kv_gather / kv_scatter:
 * 2 L calls for a frame of L layers (+2 at frame cuts), each with the fixed cost of a call.
 *
 * Head resharding (unpack into a cache holding only some of the slice's heads): the held heads
 * are a strided part of each staging segment. Batched: one run per touched segment (its held
 * part, straight from buf), still ONE call for the range. Per-run ops: the held parts are first
 * compacted into a bounce buffer owned by the pd_kvstage (page-locked from be->ops.host_alloc
 * when the backend has it, else malloc; allocated at the first such transfer, at most
 * bounce_bytes long unless one segment needs more), then scattered in batches: one call per
 * bounce-full.
 *
 * Errors: the argument and geometry errors of the host functions (PD_EINVAL, PD_ERANGE), before
 * anything is copied; PD_ENOMEM when the run list cannot grow (nothing copied either);
 * PD_EUNSUPPORTED for a backend without kv_gather / kv_scatter; PD_EBACKEND
 * when the backend reports a failure of its ops (CUDA: pd_backend_cuda_status, which is sticky:
 * the backend should be treated as failed). A failed unpack may have written part of the range.
 * A pd_kvstage is used by one thread at a time, the thread that uses its backend. */
typedef struct pd_kvstage pd_kvstage;

/* A stage for backend be (which must outlive it). bounce_bytes: bounce buffer size for head
 * resharding with the per-run ops (0 = 4 MiB); the batched calls' run list is kept (grown only)
 * by the stage. NULL with e set when be has no kv_gather / kv_scatter or on ENOMEM. */
pd_kvstage *pd_kvstage_new(pd_backend *be, size_t bounce_bytes, pd_err *e);
void pd_kvstage_free(pd_kvstage *st);

/* pd_kvpack_pack_range for a cache in st's backend memory: bytes [off, off + len) of the slice's
 * buffer to buf (host). */
pd_status pd_kvstage_pack_range(pd_kvstage *st, const pd_kv_pages *src, const pd_kv_slice *s,
                                const int32_t *block_ids, int n_blocks, size_t off, void *buf,
                                size_t len, pd_err *e);
/* pd_kvpack_unpack_range for a cache in st's backend memory: buf (host, len bytes) is bytes
 * [off, off + len) of the slice's buffer; heads dst does not hold are skipped. Returns when buf
 * may be reused. */
pd_status pd_kvstage_unpack_range(pd_kvstage *st, const pd_kv_pages *dst, const pd_kv_slice *s,
                                  const int32_t *block_ids, int n_blocks, size_t off,
                                  const void *buf, size_t len, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif
