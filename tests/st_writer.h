/* A small safetensors WRITER for tests only: builds files (sharded, converted, damaged) that
 * the reader in common/model must accept or reject. Not part of any library.
 *
 * Output layout, as the safetensors library writes it: u64 little-endian header length N, N
 * bytes of JSON padded with spaces to a multiple of 8, then the tensors' bytes in the order
 * they were added. All functions return 0 on success and -1 (with a message on stderr) on
 * failure. */
#ifndef PD_TEST_ST_WRITER_H
#define PD_TEST_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

typedef struct st_writer st_writer;

st_writer *stw_new(void);
void stw_free(st_writer *w);

/* Adds a tensor. dtype is written verbatim (so a test may write an unknown one); data
 * (nbytes) is copied. nbytes need not match shape x dtype: damaged files are the point. */
int stw_add(st_writer *w, const char *name, const char *dtype, int ndim, const int64_t *shape,
            const void *data, size_t nbytes);

/* Writes the file; metadata may be NULL or a JSON object text for "__metadata__". */
int stw_write(const st_writer *w, const char *path, const char *metadata);

/* Writes [u64 hlen][header_bytes bytes of header][data_len bytes of data] exactly as given,
 * whatever hlen says. */
int stw_write_raw(const char *path, uint64_t hlen, const char *header, size_t header_bytes,
                  const void *data, size_t data_len);

/* Whole-file helpers. stw_read_file returns a malloc'd buffer (NUL-terminated) or NULL. */
int stw_write_file(const char *path, const void *p, size_t n);
void *stw_read_file(const char *path, size_t *n);

/* mkdtemp under /tmp (template prefix "pd_<tag>_"); path receives the directory.
 * stw_rm_rf removes a directory tree created by the tests. */
int stw_mkdtemp(const char *tag, char *path, size_t cap);
int stw_rm_rf(const char *path);

#endif
