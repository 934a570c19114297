/* safetensors files, memory-mapped: single file or sharded (model.safetensors.index.json).
 *
 * Format: 8-byte little-endian header length N, then N bytes of JSON
 * {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
 * then the data; offsets are relative to the byte after the header. Every header entry is
 * checked (known dtype, offsets inside the file, size = product(shape) * dtype size) at open. */
#ifndef PD_SAFETENSORS_H
#define PD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "pd/dtype.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_ST_MAX_DIMS 8

typedef struct pd_st_tensor {
  const char *name;
  pd_dtype dtype;
  int ndim;
  int64_t shape[PD_ST_MAX_DIMS];
  const void *data; /* into the mapping; valid until pd_st_close. Aligned to the element size
                       only if the file's offsets are (files written by the safetensors
                       library are: header padded to 8 bytes) */
  size_t nbytes;
} pd_st_tensor;

typedef struct pd_st pd_st; /* one or more mapped files */

/* Opens dir/model.safetensors.index.json (all shards it names; every tensor it maps must be in
 * its shard) if present, else dir/model.safetensors, else every file of dir whose name ends in
 * ".safetensors", in byte order of names. A tensor name defined in two files is an error. */
pd_st *pd_st_open_dir(const char *dir, pd_err *e);
pd_st *pd_st_open_file(const char *path, pd_err *e);
void pd_st_close(pd_st *st);

const pd_st_tensor *pd_st_find(const pd_st *st, const char *name); /* NULL if absent; O(1) */
size_t pd_st_count(const pd_st *st);
const pd_st_tensor *pd_st_at(const pd_st *st, size_t i);

#ifdef __cplusplus
}
#endif
#endif
