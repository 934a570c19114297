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
 * The caches are host memory here (the CPU backend, or a host mirror); the CUDA backend packs
 * with its own kernels into the same layout. Nothing allocates. Thread-safe on disjoint data. */
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

/* One side's paged KV cache in host memory. */
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

#ifdef __cplusplus
}
#endif
#endif
