/* The model fingerprint the router compares across nodes (pd/model.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/kvcache.h"
#include "pd/model.h"

static pd_status read_all(const char *path, char **buf, size_t *len, pd_err *e) {
  FILE *f = fopen(path, "rb");
  if (!f) return pd_err_set(e, PD_EIO, "cannot read %s: %s", path, strerror(errno));
  size_t cap = 1 << 16, n = 0;
  char *b = malloc(cap);
  while (b) {
    size_t k = fread(b + n, 1, cap - n, f);
    n += k;
    if (k == 0) break;
    if (n == cap) {
      char *t = realloc(b, cap * 2);
      if (!t) {
        free(b);
        b = NULL;
        break;
      }
      b = t;
      cap *= 2;
    }
  }
  bool err = ferror(f);
  fclose(f);
  if (!b) return pd_err_set(e, PD_ENOMEM, "out of memory reading %s", path);
  if (err) {
    free(b);
    return pd_err_set(e, PD_EIO, "cannot read %s", path);
  }
  *buf = b;
  *len = n;
  return PD_OK;
}

pd_status pd_model_fingerprint(const char *dir, uint64_t *fp, pd_err *e) {
  static const char *files[] = {"config.json", "tokenizer.json"};
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < 2; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, files[i]);
    char *buf = NULL;
    size_t len = 0;
    pd_status st = read_all(path, &buf, &len, e);
    if (st) return st;
    h = pd_kv_hash_root(buf, len, h);
    free(buf);
  }
  *fp = h;
  return PD_OK;
}
