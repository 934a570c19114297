/* Streaming safetensors writer; see pd/st_write.h for the format and the contract. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fallocate */
#endif
#include "pd/st_write.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/map.h"

#define STW_MAX_HEADER ((uint64_t)100 << 20) /* the safetensors library's own header limit */
#define STW_MAX_WRITE ((size_t)1 << 30)     /* one write(2) call; Linux caps at ~2 GiB */

typedef struct stw_entry {
  char *name;
  pd_dtype dtype;
  int ndim;
  int64_t shape[PD_ST_MAX_DIMS];
  uint64_t begin, nbytes; /* offsets relative to the start of the data */
} stw_entry;

struct pd_stw {
  stw_entry *t;
  size_t n, cap;
  pd_map names; /* name (borrowed from t[i].name) -> i */
  char **meta; /* [2 * n_meta] key, value */
  size_t n_meta;
  uint64_t data_size;
  char *header; /* padded JSON, built by pd_stw_begin / pd_stw_header_size */
  size_t header_len;
  int fd;         /* -1 when not begun or finished */
  bool finished;
  char *path, *tmp_path;
  uint64_t written;
};

/* ---- small helpers ------------------------------------------------------------------------- */

/* Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF): JSON strings must be. */
static bool stw_utf8_ok(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    unsigned c = *p;
    int n = c < 0x80 ? 0
            : (c & 0xe0) == 0xc0 ? 1
            : (c & 0xf0) == 0xe0 ? 2
            : (c & 0xf8) == 0xf0 ? 3
                                 : -1;
    if (n < 0) return false;
    uint32_t cp = n == 0 ? c : n == 1 ? (c & 0x1f) : n == 2 ? (c & 0x0f) : (c & 0x07);
    for (int i = 1; i <= n; i++) {
      if ((p[i] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3f);
    }
    static const uint32_t min_cp[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    p += n + 1;
  }
  return true;
}

typedef struct stw_buf {
  char *p;
  size_t n, cap;
  bool oom;
} stw_buf;

static void buf_put(stw_buf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->n + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}

static void buf_printf(stw_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(stw_buf *b, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (k < 0 || (size_t)k >= sizeof tmp) {
    b->oom = true; /* only short numeric pieces go through here */
    return;
  }
  buf_put(b, tmp, (size_t)k);
}

static void buf_json_str(stw_buf *b, const char *s) {
  buf_put(b, "\"", 1);
  for (const char *run = s;; s++) {
    unsigned char c = (unsigned char)*s;
    if (c && c != '"' && c != '\\' && c >= 0x20) continue;
    buf_put(b, run, (size_t)(s - run));
    if (!c) break;
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      buf_put(b, esc, 2);
    } else {
      buf_printf(b, "\\u%04x", c);
    }
    run = s + 1;
  }
  buf_put(b, "\"", 1);
}

/* ---- declaration --------------------------------------------------------------------------- */

pd_stw *pd_stw_new(pd_err *e) {
  pd_stw *w = calloc(1, sizeof *w);
  if (!w) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  w->fd = -1;
  pd_map_init(&w->names, 0, 0); /* allocates with the first tensor */
  return w;
}

void pd_stw_free(pd_stw *w) {
  if (!w) return;
  if (w->fd >= 0) {
    close(w->fd);
    if (w->tmp_path) unlink(w->tmp_path);
  }
  for (size_t i = 0; i < w->n; i++) free(w->t[i].name);
  for (size_t i = 0; i < 2 * w->n_meta; i++) free(w->meta[i]);
  free(w->t);
  pd_map_free(&w->names);
  free(w->meta);
  free(w->header);
  free(w->path);
  free(w->tmp_path);
  free(w);
}

uint64_t pd_stw_tensor_bytes(pd_dtype dtype, int ndim, const int64_t *shape) {
  if ((int)dtype < 0 || dtype >= PD_DTYPE_COUNT || ndim < 0 || ndim > PD_ST_MAX_DIMS) return 0;
  uint64_t n = pd_dtype_size(dtype);
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) return 0;
    uint64_t d = (uint64_t)shape[i];
    if (d && n > UINT64_MAX / 4 / d) return 0; /* keep well clear of overflow */
    n *= d;
  }
  return n;
}

pd_status pd_stw_add(pd_stw *w, const char *name, pd_dtype dtype, int ndim, const int64_t *shape,
                     pd_err *e) {
  if (!w || !name) return pd_err_set(e, PD_EINVAL, "pd_stw_add: NULL argument");
  if (w->header || w->fd >= 0 || w->finished)
    return pd_err_set(e, PD_EINVAL, "pd_stw_add: '%.200s' declared after the header was built",
                      name);
  if (!name[0] || strcmp(name, "__metadata__") == 0 || !stw_utf8_ok(name))
    return pd_err_set(e, PD_EINVAL, "safetensors: invalid tensor name '%.200s'", name);
  if ((int)dtype < 0 || dtype >= PD_DTYPE_COUNT)
    return pd_err_set(e, PD_EINVAL, "safetensors: tensor '%.200s' has an unknown dtype", name);
  if (ndim < 0 || ndim > PD_ST_MAX_DIMS || (ndim > 0 && !shape))
    return pd_err_set(e, PD_EINVAL, "safetensors: tensor '%.200s' has %d dims (0..%d)", name, ndim,
                      PD_ST_MAX_DIMS);
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0)
      return pd_err_set(e, PD_EINVAL, "safetensors: tensor '%.200s' has a negative dim", name);
  uint64_t nb = pd_stw_tensor_bytes(dtype, ndim, shape);
  bool empty = false;
  for (int i = 0; i < ndim; i++) empty |= shape[i] == 0;
  if ((nb == 0 && !empty) || nb > UINT64_MAX / 4 - w->data_size)
    return pd_err_set(e, PD_ERANGE, "safetensors: tensor '%.200s' is too large", name);
  size_t len = strlen(name);
  uint64_t h = pd_map_hash(name, len);
  if (pd_map_str_find(&w->names, h, name, len))
    return pd_err_set(e, PD_EINVAL, "safetensors: tensor '%.200s' declared twice", name);
  if (w->n >= UINT32_MAX - 1) return pd_err_set(e, PD_ERANGE, "safetensors: too many tensors");
  if (w->n == w->cap) {
    size_t cap = w->cap ? 2 * w->cap : 64;
    stw_entry *t = realloc(w->t, cap * sizeof *t);
    if (!t) return pd_err_set(e, PD_ENOMEM, "out of memory");
    w->t = t;
    w->cap = cap;
  }
  stw_entry *t = &w->t[w->n];
  memset(t, 0, sizeof *t);
  if (!(t->name = strdup(name)) || !pd_map_str_put(&w->names, h, t->name, len, w->n)) {
    free(t->name);
    t->name = NULL;
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->begin = w->data_size;
  t->nbytes = nb;
  w->data_size += nb;
  w->n++;
  return PD_OK;
}

pd_status pd_stw_set_metadata(pd_stw *w, const char *key, const char *value, pd_err *e) {
  if (!w || !key || !value) return pd_err_set(e, PD_EINVAL, "pd_stw_set_metadata: NULL argument");
  if (w->header || w->fd >= 0 || w->finished)
    return pd_err_set(e, PD_EINVAL, "pd_stw_set_metadata: after the header was built");
  if (!stw_utf8_ok(key) || !stw_utf8_ok(value))
    return pd_err_set(e, PD_EINVAL, "safetensors: metadata must be valid UTF-8");
  char *v = strdup(value);
  if (!v) return pd_err_set(e, PD_ENOMEM, "out of memory");
  for (size_t i = 0; i < w->n_meta; i++)
    if (strcmp(w->meta[2 * i], key) == 0) {
      free(w->meta[2 * i + 1]);
      w->meta[2 * i + 1] = v;
      return PD_OK;
    }
  char **m = realloc(w->meta, 2 * (w->n_meta + 1) * sizeof *m);
  if (!m) {
    free(v);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  w->meta = m;
  if (!(m[2 * w->n_meta] = strdup(key))) {
    free(v);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  m[2 * w->n_meta + 1] = v;
  w->n_meta++;
  return PD_OK;
}

size_t pd_stw_count(const pd_stw *w) { return w ? w->n : 0; }
uint64_t pd_stw_data_size(const pd_stw *w) { return w ? w->data_size : 0; }
uint64_t pd_stw_written(const pd_stw *w) { return w ? w->written : 0; }

/* Builds the padded header JSON once; later declarations are refused. */
static pd_status stw_build_header(pd_stw *w, pd_err *e) {
  if (w->header) return PD_OK;
  stw_buf b = {0};
  buf_put(&b, "{", 1);
  bool first = true;
  if (w->n_meta) {
    buf_put(&b, "\"__metadata__\":{", 16);
    for (size_t i = 0; i < w->n_meta; i++) {
      if (i) buf_put(&b, ",", 1);
      buf_json_str(&b, w->meta[2 * i]);
      buf_put(&b, ":", 1);
      buf_json_str(&b, w->meta[2 * i + 1]);
    }
    buf_put(&b, "}", 1);
    first = false;
  }
  for (size_t i = 0; i < w->n; i++) {
    const stw_entry *t = &w->t[i];
    if (!first) buf_put(&b, ",", 1);
    first = false;
    buf_json_str(&b, t->name);
    buf_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[", pd_dtype_name(t->dtype));
    for (int d = 0; d < t->ndim; d++) buf_printf(&b, "%s%" PRId64, d ? "," : "", t->shape[d]);
    buf_printf(&b, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", t->begin, t->begin + t->nbytes);
  }
  buf_put(&b, "}", 1);
  while (!b.oom && b.n % 8) buf_put(&b, " ", 1); /* data starts 8-byte aligned */
  if (b.oom) {
    free(b.p);
    return pd_err_set(e, PD_ENOMEM, "out of memory building the safetensors header");
  }
  if (b.n > STW_MAX_HEADER) {
    free(b.p);
    return pd_err_set(e, PD_ERANGE, "safetensors header of %zu bytes exceeds the format's %" PRIu64
                      "-byte limit", b.n, STW_MAX_HEADER);
  }
  w->header = b.p;
  w->header_len = b.n;
  return PD_OK;
}

uint64_t pd_stw_header_size(pd_stw *w) {
  if (!w) return 0;
  if (!w->header && stw_build_header(w, NULL) != PD_OK) return 0;
  return 8 + (uint64_t)w->header_len;
}

/* ---- writing ------------------------------------------------------------------------------- */

static pd_status stw_write_all(pd_stw *w, const void *p, size_t n, pd_err *e) {
  const char *c = p;
  while (n) {
    size_t k = n < STW_MAX_WRITE ? n : STW_MAX_WRITE;
    ssize_t r = write(w->fd, c, k);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return pd_err_set(e, PD_EIO, "%s: write failed: %s", w->tmp_path,
                        r < 0 ? strerror(errno) : "no progress");
    c += r;
    n -= (size_t)r;
  }
  return PD_OK;
}

pd_status pd_stw_begin(pd_stw *w, const char *path, pd_err *e) {
  if (!w || !path || !path[0]) return pd_err_set(e, PD_EINVAL, "pd_stw_begin: no path");
  if (w->fd >= 0 || w->finished) return pd_err_set(e, PD_EINVAL, "pd_stw_begin: called twice");
  pd_status st = stw_build_header(w, e);
  if (st) return st;
  size_t pl = strlen(path);
  w->path = strdup(path);
  w->tmp_path = malloc(pl + 5);
  if (!w->path || !w->tmp_path) return pd_err_set(e, PD_ENOMEM, "out of memory");
  memcpy(w->tmp_path, path, pl);
  memcpy(w->tmp_path + pl, ".tmp", 5);
  w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0)
    return pd_err_set(e, PD_EIO, "%s: cannot create: %s", w->tmp_path, strerror(errno));
  const uint64_t total = 8 + (uint64_t)w->header_len + w->data_size;
#ifdef __linux__
  /* Reserve the space now: a full disk shows up here rather than after gigabytes, and the
   * file is laid out in few extents. File systems without fallocate simply skip this. */
  if (total <= (uint64_t)INT64_MAX && fallocate(w->fd, 0, 0, (off_t)total) != 0 && errno == ENOSPC)
    return pd_err_set(e, PD_EIO, "%s: no space for %.2f GB: %s", w->tmp_path, (double)total / 1e9,
                      strerror(ENOSPC));
#else
  (void)total;
#endif
  unsigned char len[8];
  for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)w->header_len >> (8 * i));
  if ((st = stw_write_all(w, len, 8, e))) return st;
  return stw_write_all(w, w->header, w->header_len, e);
}

pd_status pd_stw_write(pd_stw *w, const void *data, size_t n, pd_err *e) {
  if (!w || (n && !data)) return pd_err_set(e, PD_EINVAL, "pd_stw_write: NULL argument");
  if (w->fd < 0) return pd_err_set(e, PD_EINVAL, "pd_stw_write: file not begun (or finished)");
  if (n > w->data_size - w->written)
    return pd_err_set(e, PD_ERANGE, "%s: %zu bytes written past the %" PRIu64 " declared",
                      w->path, n - (size_t)(w->data_size - w->written), w->data_size);
  pd_status st = stw_write_all(w, data, n, e);
  if (st == PD_OK) w->written += n;
  return st;
}

/* fsync of the directory holding path, so that a rename into it is durable. */
static pd_status stw_sync_dir(const char *path, pd_err *e) {
  char *copy = strdup(path);
  if (!copy) return pd_err_set(e, PD_ENOMEM, "out of memory");
  const char *dir = dirname(copy);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  pd_status st = PD_OK;
  if (fd < 0 || fsync(fd) != 0)
    st = pd_err_set(e, PD_EIO, "%s: fsync of the directory failed: %s", dir, strerror(errno));
  if (fd >= 0) close(fd);
  free(copy);
  return st;
}

pd_status pd_stw_finish(pd_stw *w, bool sync, pd_err *e) {
  if (!w || w->fd < 0) return pd_err_set(e, PD_EINVAL, "pd_stw_finish: file not begun");
  if (w->written != w->data_size) {
    const char *name = "?";
    for (size_t i = 0; i < w->n; i++)
      if (w->written < w->t[i].begin + w->t[i].nbytes) {
        name = w->t[i].name;
        break;
      }
    return pd_err_set(e, PD_EFORMAT,
                      "%s: only %" PRIu64 " of %" PRIu64 " data bytes written (tensor '%.200s' is "
                      "short)", w->path, w->written, w->data_size, name);
  }
  if (sync && fsync(w->fd) != 0)
    return pd_err_set(e, PD_EIO, "%s: fsync failed: %s", w->tmp_path, strerror(errno));
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) {
    int err = errno;
    unlink(w->tmp_path);
    return pd_err_set(e, PD_EIO, "%s: close failed: %s", w->tmp_path, strerror(err));
  }
  if (rename(w->tmp_path, w->path) != 0) {
    int err = errno;
    unlink(w->tmp_path);
    return pd_err_set(e, PD_EIO, "cannot rename %s to %s: %s", w->tmp_path, w->path, strerror(err));
  }
  w->finished = true;
  return sync ? stw_sync_dir(w->path, e) : PD_OK;
}

pd_status pd_st_save(const char *path, const pd_stw_tensor *t, size_t n, const char *const *meta_kv,
                     bool sync, pd_err *e) {
  if (!path || (n && !t)) return pd_err_set(e, PD_EINVAL, "pd_st_save: NULL argument");
  pd_stw *w = pd_stw_new(e);
  if (!w) return PD_ENOMEM;
  pd_status st = PD_OK;
  for (size_t i = 0; meta_kv && meta_kv[i] && !st; i += 2) {
    if (!meta_kv[i + 1]) st = pd_err_set(e, PD_EINVAL, "pd_st_save: metadata key without value");
    else st = pd_stw_set_metadata(w, meta_kv[i], meta_kv[i + 1], e);
  }
  for (size_t i = 0; i < n && !st; i++) {
    st = pd_stw_add(w, t[i].name, t[i].dtype, t[i].ndim, t[i].shape, e);
    if (!st && pd_stw_tensor_bytes(t[i].dtype, t[i].ndim, t[i].shape) != t[i].nbytes)
      st = pd_err_set(e, PD_EINVAL,
                      "pd_st_save: tensor '%.200s' has %zu bytes, its shape needs %" PRIu64,
                      t[i].name, t[i].nbytes,
                      pd_stw_tensor_bytes(t[i].dtype, t[i].ndim, t[i].shape));
    if (!st && t[i].nbytes && !t[i].data)
      st = pd_err_set(e, PD_EINVAL, "pd_st_save: tensor '%.200s' has no data", t[i].name);
  }
  if (!st) st = pd_stw_begin(w, path, e);
  for (size_t i = 0; i < n && !st; i++) st = pd_stw_write(w, t[i].data, t[i].nbytes, e);
  if (!st) st = pd_stw_finish(w, sync, e);
  pd_stw_free(w);
  return st;
}
