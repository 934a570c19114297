/* Test-only safetensors writer; see st_writer.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "st_writer.h"

#include <errno.h>
#include <stdarg.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct stw_tensor {
  char *name, *dtype;
  int ndim;
  int64_t shape[16];
  void *data;
  size_t nbytes;
} stw_tensor;

struct st_writer {
  stw_tensor *t;
  size_t n, cap;
};

st_writer *stw_new(void) { return calloc(1, sizeof(st_writer)); }

void stw_free(st_writer *w) {
  if (!w) return;
  for (size_t i = 0; i < w->n; i++) {
    free(w->t[i].name);
    free(w->t[i].dtype);
    free(w->t[i].data);
  }
  free(w->t);
  free(w);
}

int stw_add(st_writer *w, const char *name, const char *dtype, int ndim, const int64_t *shape,
            const void *data, size_t nbytes) {
  if (ndim < 0 || ndim > 16) {
    fprintf(stderr, "stw_add: bad ndim %d\n", ndim);
    return -1;
  }
  if (w->n == w->cap) {
    size_t cap = w->cap ? 2 * w->cap : 16;
    stw_tensor *t = realloc(w->t, cap * sizeof *t);
    if (!t) return -1;
    w->t = t;
    w->cap = cap;
  }
  stw_tensor *t = &w->t[w->n];
  memset(t, 0, sizeof *t);
  t->name = strdup(name);
  t->dtype = strdup(dtype);
  t->data = malloc(nbytes ? nbytes : 1);
  if (!t->name || !t->dtype || !t->data) {
    free(t->name);
    free(t->dtype);
    free(t->data);
    return -1;
  }
  if (nbytes) memcpy(t->data, data, nbytes);
  t->nbytes = nbytes;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  w->n++;
  return 0;
}

/* Appends printf output to a growing buffer. */
typedef struct sbuf {
  char *p;
  size_t n, cap;
  int err;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
  if (b->err) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
      b->err = 1;
      return;
    }
    if (b->p && b->n + (size_t)k < b->cap) {
      b->n += (size_t)k;
      return;
    }
    size_t cap = b->cap ? b->cap : 256;
    while (cap <= b->n + (size_t)k) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->err = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
}

static void sb_json_str(sbuf *b, const char *s) {
  sb_printf(b, "\"");
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') sb_printf(b, "\\%c", c);
    else if (c < 0x20) sb_printf(b, "\\u%04x", c);
    else sb_printf(b, "%c", c);
  }
  sb_printf(b, "\"");
}

int stw_write(const st_writer *w, const char *path, const char *metadata) {
  sbuf b = {0};
  sb_printf(&b, "{");
  int first = 1;
  if (metadata) {
    sb_printf(&b, "\"__metadata__\":%s", metadata);
    first = 0;
  }
  size_t off = 0;
  for (size_t i = 0; i < w->n; i++) {
    const stw_tensor *t = &w->t[i];
    sb_printf(&b, "%s", first ? "" : ",");
    first = 0;
    sb_json_str(&b, t->name);
    sb_printf(&b, ":{\"dtype\":");
    sb_json_str(&b, t->dtype);
    sb_printf(&b, ",\"shape\":[");
    for (int d = 0; d < t->ndim; d++) sb_printf(&b, "%s%lld", d ? "," : "", (long long)t->shape[d]);
    sb_printf(&b, "],\"data_offsets\":[%zu,%zu]}", off, off + t->nbytes);
    off += t->nbytes;
  }
  sb_printf(&b, "}");
  while (!b.err && b.n % 8) sb_printf(&b, " ");
  if (b.err) {
    free(b.p);
    return -1;
  }
  FILE *f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "stw_write: %s: %s\n", path, strerror(errno));
    free(b.p);
    return -1;
  }
  unsigned char len[8];
  for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)b.n >> (8 * i));
  int ok = fwrite(len, 1, 8, f) == 8 && fwrite(b.p, 1, b.n, f) == b.n;
  for (size_t i = 0; ok && i < w->n; i++)
    ok = fwrite(w->t[i].data, 1, w->t[i].nbytes, f) == w->t[i].nbytes;
  ok = (fclose(f) == 0) && ok;
  free(b.p);
  if (!ok) fprintf(stderr, "stw_write: %s: write failed\n", path);
  return ok ? 0 : -1;
}

int stw_write_raw(const char *path, uint64_t hlen, const char *header, size_t header_bytes,
                  const void *data, size_t data_len) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "stw_write_raw: %s: %s\n", path, strerror(errno));
    return -1;
  }
  unsigned char len[8];
  for (int i = 0; i < 8; i++) len[i] = (unsigned char)(hlen >> (8 * i));
  int ok = fwrite(len, 1, 8, f) == 8;
  if (ok && header_bytes) ok = fwrite(header, 1, header_bytes, f) == header_bytes;
  if (ok && data_len) ok = fwrite(data, 1, data_len, f) == data_len;
  ok = (fclose(f) == 0) && ok;
  return ok ? 0 : -1;
}

int stw_write_file(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "stw_write_file: %s: %s\n", path, strerror(errno));
    return -1;
  }
  int ok = n == 0 || fwrite(p, 1, n, f) == n;
  ok = (fclose(f) == 0) && ok;
  return ok ? 0 : -1;
}

void *stw_read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len + 65536 + 1 > cap) {
      size_t c = cap ? 2 * cap : 1 << 20;
      while (c < len + 65536 + 1) c *= 2;
      char *p = realloc(buf, c);
      if (!p) {
        free(buf);
        fclose(f);
        return NULL;
      }
      buf = p;
      cap = c;
    }
    size_t r = fread(buf + len, 1, 65536, f);
    len += r;
    if (r < 65536) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    return NULL;
  }
  buf[len] = 0;
  if (n) *n = len;
  return buf;
}

int stw_mkdtemp(const char *tag, char *path, size_t cap) {
  int k = snprintf(path, cap, "/tmp/pd_%s_XXXXXX", tag);
  if (k < 0 || (size_t)k >= cap) return -1;
  if (!mkdtemp(path)) {
    fprintf(stderr, "mkdtemp %s: %s\n", path, strerror(errno));
    return -1;
  }
  return 0;
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)ftw;
  int r = (flag == FTW_DP) ? rmdir(p) : unlink(p);
  if (r != 0) fprintf(stderr, "rm %s: %s\n", p, strerror(errno));
  return 0;
}

int stw_rm_rf(const char *path) {
  if (strncmp(path, "/tmp/pd_", 8) != 0) return -1; /* only what stw_mkdtemp made */
  return nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}
