/* Streaming safetensors writer: declare the tensors, then stream their bytes into the file.
 *
 * The file is what the safetensors library writes and what pd_st_open_* reads: u64
 * little-endian header length N, N bytes of JSON
 *   {"__metadata__": {"k": "v", ...}, "name": {"dtype": "BF16", "shape": [..],
 *    "data_offsets": [begin, end]}, ...}
 * padded with spaces to a multiple of 8 (so the data starts 8-byte aligned), then the tensors'
 * bytes back to back, in the order they were declared (the format allows no holes). Tensors
 * whose element size is smaller than their predecessors' may lose alignment: declare the wider
 * dtypes first when mixing dtypes, as the safetensors library does.
 *
 * Because the header comes first and holds every offset, all tensors are declared up front;
 * the data can then be produced piece by piece (gigabytes) without ever being held at once.
 * The file is written as <path>.tmp and renamed to <path> by pd_stw_finish, so a reader never
 * sees a half-written file under the final name; pd_stw_free on an unfinished writer removes
 * the temporary.
 *
 * Usage:
 *   pd_stw *w = pd_stw_new(&e);
 *   pd_stw_add(w, "a", PD_DTYPE_BF16, 2, (int64_t[]){4, 8}, &e);   ... every tensor
 *   pd_stw_begin(w, "model.safetensors", &e);   header written
 *   pd_stw_write(w, bytes, n, &e);               ... exactly pd_stw_data_size(w) bytes in all
 *   pd_stw_finish(w, false, &e);                 checked, closed, renamed
 *   pd_stw_free(w); */
#ifndef PD_ST_WRITE_H
#define PD_ST_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/dtype.h"
#include "pd/safetensors.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_stw pd_stw;

pd_stw *pd_stw_new(pd_err *e);
/* Frees w; an unfinished file (begun, not finished) is closed and its temporary removed. */
void pd_stw_free(pd_stw *w);

/* Declares the next tensor: a unique non-empty name (not "__metadata__"), a dtype, and
 * 0..PD_ST_MAX_DIMS non-negative dims. Only before pd_stw_begin. PD_EINVAL on bad input. */
pd_status pd_stw_add(pd_stw *w, const char *name, pd_dtype dtype, int ndim, const int64_t *shape,
                     pd_err *e);
/* Adds "key": "value" to __metadata__ (a string-to-string map in the format; transformers
 * expects {"format": "pt"}). Only before pd_stw_begin; a repeated key replaces the value. */
pd_status pd_stw_set_metadata(pd_stw *w, const char *key, const char *value, pd_err *e);

size_t pd_stw_count(const pd_stw *w);
/* Bytes of the header: 8 (length) + padded JSON; 0 if it cannot be built. Builds the header,
 * so call it once every tensor is declared: later declarations are refused. */
uint64_t pd_stw_header_size(pd_stw *w);
/* Bytes of tensor data declared so far (the file is header + data). */
uint64_t pd_stw_data_size(const pd_stw *w);
/* Byte size of one tensor's data: product(shape) * element size; 0 when it overflows. */
uint64_t pd_stw_tensor_bytes(pd_dtype dtype, int ndim, const int64_t *shape);

/* Creates <path>.tmp (replacing one left by a crash), reserves the file's size where the file
 * system supports it, and writes the header. PD_EIO with the path and errno text on failure. */
pd_status pd_stw_begin(pd_stw *w, const char *path, pd_err *e);
/* Appends n bytes of tensor data (they may cover several tensors or part of one). Writing
 * more than was declared is PD_ERANGE (nothing written). */
pd_status pd_stw_write(pd_stw *w, const void *data, size_t n, pd_err *e);
/* Bytes of tensor data written so far. */
uint64_t pd_stw_written(const pd_stw *w);
/* Checks that exactly the declared bytes were written (PD_EFORMAT otherwise, naming the
 * tensor that is short), optionally fsyncs the file, closes it and renames it to <path>
 * (with sync, the directory is fsynced too, so the rename itself is durable). */
pd_status pd_stw_finish(pd_stw *w, bool sync, pd_err *e);

/* One whole file from tensors in memory (each t[i].data holds t[i].nbytes bytes, which must
 * equal what its dtype and shape need). meta_kv: NULL or NULL-terminated {key, value, ...}. */
typedef struct pd_stw_tensor {
  const char *name;
  pd_dtype dtype;
  int ndim;
  int64_t shape[PD_ST_MAX_DIMS];
  const void *data;
  size_t nbytes;
} pd_stw_tensor;
pd_status pd_st_save(const char *path, const pd_stw_tensor *t, size_t n, const char *const *meta_kv,
                     bool sync, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif
