/* safetensors reader: each file is mapped read-only, its JSON header is validated entry by
 * entry before any pointer into the data is handed out, and tensors are found by name through
 * a pd_map (large checkpoints hold ~1000 tensors over several shards).
 *
 * File layout: [u64 little-endian N][N bytes of JSON header, space-padded][data bytes];
 * header entries give data_offsets relative to the first data byte. */
#include "pd/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/map.h"

#define ST_MAX_HEADER ((uint64_t)100 << 20) /* bytes of JSON header we agree to parse */
#define ST_MAX_INDEX ((off_t)100 << 20)     /* bytes of model.safetensors.index.json */
#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"
#define ST_PATH_MAX 4096

typedef struct st_file {
  char *path;
  void *map; /* whole file, PROT_READ; NULL for an empty mapping */
  size_t size;
} st_file;

struct pd_st {
  st_file *files;
  size_t nfiles, cap_files;
  pd_st_tensor *tensors; /* names are owned (strdup) */
  uint32_t *file_of;     /* [ntensors]: index into files */
  size_t ntensors, cap_tensors;
  pd_map names; /* name (borrowed from tensors[i].name) -> i */
};

const pd_st_tensor *pd_st_find(const pd_st *st, const char *name) {
  if (!st || !name) return NULL;
  const pd_map_slot *x = pd_map_cstr_find(&st->names, name);
  return x ? &st->tensors[x->val] : NULL;
}

size_t pd_st_count(const pd_st *st) { return st ? st->ntensors : 0; }

const pd_st_tensor *pd_st_at(const pd_st *st, size_t i) {
  return (st && i < st->ntensors) ? &st->tensors[i] : NULL;
}

/* Appends t (taking ownership of t->name) as a tensor of file fi; rejects a name already
 * present in any file. */
static pd_status st_add_tensor(pd_st *st, pd_st_tensor *t, uint32_t fi, pd_err *e) {
  if (st->ntensors >= UINT32_MAX - 1) {
    free((char *)t->name);
    return pd_err_set(e, PD_EFORMAT, "%s: too many tensors", st->files[fi].path);
  }
  if (st->ntensors == st->cap_tensors) {
    size_t cap = st->cap_tensors ? 2 * st->cap_tensors : 64;
    pd_st_tensor *nt = realloc(st->tensors, cap * sizeof *nt);
    if (nt) st->tensors = nt;
    uint32_t *nf = nt ? realloc(st->file_of, cap * sizeof *nf) : NULL;
    if (nf) st->file_of = nf;
    if (!nt || !nf) {
      free((char *)t->name);
      return pd_err_set(e, PD_ENOMEM, "out of memory indexing tensors");
    }
    st->cap_tensors = cap;
  }
  size_t len = strlen(t->name);
  uint64_t h = pd_map_hash(t->name, len);
  const pd_map_slot *dup = pd_map_str_find(&st->names, h, t->name, len);
  if (dup) {
    uint32_t other = st->file_of[dup->val];
    pd_status s = pd_err_set(e, PD_EFORMAT, "%s: tensor '%s' is defined twice (also in %s)",
                             st->files[fi].path, t->name, st->files[other].path);
    free((char *)t->name);
    return s;
  }
  if (!pd_map_str_put(&st->names, h, t->name, len, st->ntensors)) {
    free((char *)t->name);
    return pd_err_set(e, PD_ENOMEM, "out of memory indexing tensors");
  }
  st->tensors[st->ntensors] = *t;
  st->file_of[st->ntensors] = fi;
  st->ntensors++;
  return PD_OK;
}

void pd_st_close(pd_st *st) {
  if (!st) return;
  for (size_t i = 0; i < st->ntensors; i++) free((char *)st->tensors[i].name);
  for (size_t i = 0; i < st->nfiles; i++) {
    if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
    free(st->files[i].path);
  }
  free(st->files);
  free(st->tensors);
  free(st->file_of);
  pd_map_free(&st->names);
  free(st);
}

/* ---- one file ------------------------------------------------------------------------------ */

/* A JSON number that is an integer in [0, 2^53] (exact in a double). */
static bool st_json_u53(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return false;
  double d = v->valuedouble;
  if (!(d >= 0.0 && d <= 9007199254740992.0) || d != floor(d)) return false;
  *out = (uint64_t)d;
  return true;
}

static bool st_is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Validates one header entry (name -> {dtype, shape, data_offsets}) against a data section of
 * data_size bytes starting at data, and fills t (name not set). */
static pd_status st_parse_entry(const char *path, const cJSON *it, const uint8_t *data,
                                uint64_t data_size, pd_st_tensor *t, pd_err *e) {
  const char *name = it->string;
  if (!cJSON_IsObject(it))
    return pd_err_set(e, PD_EFORMAT, "%s: tensor '%s': header entry is not a JSON object", path,
                      name);
  const cJSON *jd = cJSON_GetObjectItemCaseSensitive(it, "dtype");
  const cJSON *js = cJSON_GetObjectItemCaseSensitive(it, "shape");
  const cJSON *jo = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
  if (!cJSON_IsString(jd))
    return pd_err_set(e, PD_EFORMAT, "%s: tensor '%s': missing or non-string \"dtype\"", path,
                      name);
  int dt = pd_dtype_from_name(jd->valuestring);
  if (dt < 0)
    return pd_err_set(e, PD_EFORMAT, "%s: tensor '%s': unknown dtype \"%.32s\"", path, name,
                      jd->valuestring);
  if (!cJSON_IsArray(js))
    return pd_err_set(e, PD_EFORMAT, "%s: tensor '%s': missing or non-array \"shape\"", path,
                      name);
  int ndim = cJSON_GetArraySize(js);
  if (ndim > PD_ST_MAX_DIMS)
    return pd_err_set(e, PD_EFORMAT, "%s: tensor '%s': %d dimensions (at most %d supported)",
                      path, name, ndim, PD_ST_MAX_DIMS);
  memset(t, 0, sizeof *t);
  t->dtype = (pd_dtype)dt;
  t->ndim = ndim;
  uint64_t numel = 1;
  bool overflow = false;
  int d = 0;
  for (const cJSON *x = js->child; x; x = x->next, d++) {
    uint64_t v;
    if (!st_json_u53(x, &v) || v > INT64_MAX)
      return pd_err_set(e, PD_EFORMAT,
                        "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, d);
    t->shape[d] = (int64_t)v;
    if (__builtin_mul_overflow(numel, v, &numel)) overflow = true;
  }
  uint64_t nbytes;
  if (overflow || __builtin_mul_overflow(numel, (uint64_t)pd_dtype_size(t->dtype), &nbytes))
    return pd_err_set(e, PD_EFORMAT, "%s: tensor '%s': shape is too large (size overflows)",
                      path, name);
  uint64_t off[2];
  if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !st_json_u53(jo->child, &off[0]) ||
      !st_json_u53(jo->child->next, &off[1]))
    return pd_err_set(e, PD_EFORMAT,
                      "%s: tensor '%s': \"data_offsets\" must be [begin, end] of non-negative "
                      "integers",
                      path, name);
  if (off[0] > off[1] || off[1] > data_size)
    return pd_err_set(e, PD_EFORMAT,
                      "%s: tensor '%s': data_offsets [%llu, %llu] outside the data section "
                      "(%llu bytes)",
                      path, name, (unsigned long long)off[0], (unsigned long long)off[1],
                      (unsigned long long)data_size);
  if (off[1] - off[0] != nbytes)
    return pd_err_set(e, PD_EFORMAT,
                      "%s: tensor '%s': data_offsets span %llu bytes but shape and dtype %s "
                      "need %llu",
                      path, name, (unsigned long long)(off[1] - off[0]),
                      pd_dtype_name(t->dtype), (unsigned long long)nbytes);
  t->data = data + off[0];
  t->nbytes = (size_t)nbytes;
  return PD_OK;
}

/* Maps path, validates its header and adds its tensors. On failure st keeps what it had
 * (the file is recorded, so pd_st_close unmaps it). */
static pd_status st_add_file(pd_st *st, const char *path, pd_err *e) {
  if (st->nfiles == st->cap_files) {
    size_t cap = st->cap_files ? 2 * st->cap_files : 4;
    st_file *f = realloc(st->files, cap * sizeof *f);
    if (!f) return pd_err_set(e, PD_ENOMEM, "out of memory");
    st->files = f;
    st->cap_files = cap;
  }
  if (st->nfiles >= UINT32_MAX) return pd_err_set(e, PD_EINVAL, "too many files");
  uint32_t fi = (uint32_t)st->nfiles;
  st_file *f = &st->files[fi];
  memset(f, 0, sizeof *f);
  f->path = strdup(path);
  if (!f->path) return pd_err_set(e, PD_ENOMEM, "out of memory");
  st->nfiles++;

  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return pd_err_set(e, errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: cannot open: %s", path,
                      strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int err = errno;
    close(fd);
    return pd_err_set(e, PD_EIO, "%s: cannot stat: %s", path, strerror(err));
  }
  if (!S_ISREG(sb.st_mode)) {
    close(fd);
    return pd_err_set(e, PD_EIO, "%s: not a regular file", path);
  }
  uint64_t size = (uint64_t)sb.st_size;
  if (size < 8) {
    close(fd);
    return pd_err_set(e, PD_EFORMAT,
                      "%s: file is %llu bytes, too short for the 8-byte header length", path,
                      (unsigned long long)size);
  }
  if (size > SIZE_MAX) {
    close(fd);
    return pd_err_set(e, PD_EFORMAT, "%s: file too large to map", path);
  }
  void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  close(fd);
  if (map == MAP_FAILED) return pd_err_set(e, PD_EIO, "%s: mmap failed: %s", path, strerror(err));
  f->map = map;
  f->size = (size_t)size;

  const uint8_t *p = map;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
  if (hlen > size - 8)
    return pd_err_set(e, PD_EFORMAT,
                      "%s: header length %llu exceeds the %llu bytes after the length field "
                      "(truncated or not a safetensors file)",
                      path, (unsigned long long)hlen, (unsigned long long)(size - 8));
  if (hlen > ST_MAX_HEADER)
    return pd_err_set(e, PD_EFORMAT, "%s: header length %llu exceeds the %llu-byte limit", path,
                      (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
  const char *hdr = (const char *)p + 8;
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
  if (!root) {
    long at = (end && end >= hdr && end <= hdr + hlen) ? (long)(end - hdr) : -1;
    return pd_err_set(e, PD_EFORMAT, "%s: header is not valid JSON (error near byte %ld of %llu)",
                      path, at, (unsigned long long)hlen);
  }
  pd_status s = PD_OK;
  for (const char *q = end; q < hdr + hlen; q++) {
    if (!st_is_json_space(*q)) {
      s = pd_err_set(e, PD_EFORMAT, "%s: unexpected bytes after the header JSON (byte %ld)",
                     path, (long)(q - hdr));
      goto out;
    }
  }
  if (!cJSON_IsObject(root)) {
    s = pd_err_set(e, PD_EFORMAT, "%s: header is not a JSON object", path);
    goto out;
  }
  const uint8_t *data = p + 8 + hlen;
  uint64_t data_size = size - 8 - hlen;
  for (const cJSON *it = root->child; it; it = it->next) {
    if (!it->string || !it->string[0]) {
      s = pd_err_set(e, PD_EFORMAT, "%s: header has an entry with an empty name", path);
      goto out;
    }
    if (strcmp(it->string, "__metadata__") == 0) continue;
    pd_st_tensor t;
    s = st_parse_entry(path, it, data, data_size, &t, e);
    if (s != PD_OK) goto out;
    t.name = strdup(it->string);
    if (!t.name) {
      s = pd_err_set(e, PD_ENOMEM, "out of memory");
      goto out;
    }
    s = st_add_tensor(st, &t, fi, e);
    if (s != PD_OK) goto out;
  }
out:
  cJSON_Delete(root);
  return s;
}

static pd_st *st_new(pd_err *e) {
  pd_st *st = calloc(1, sizeof *st);
  if (!st) pd_err_set(e, PD_ENOMEM, "out of memory");
  else pd_map_init(&st->names, 0, 0); /* allocates with the first tensor */
  return st;
}

pd_st *pd_st_open_file(const char *path, pd_err *e) {
  if (!path) {
    pd_err_set(e, PD_EINVAL, "pd_st_open_file: NULL path");
    return NULL;
  }
  pd_st *st = st_new(e);
  if (!st) return NULL;
  if (st_add_file(st, path, e) != PD_OK) {
    pd_st_close(st);
    return NULL;
  }
  return st;
}

/* ---- directories -------------------------------------------------------------------------- */

static pd_status st_join(char *out, const char *dir, const char *name, pd_err *e) {
  int n = snprintf(out, ST_PATH_MAX, "%s/%s", dir, name);
  if (n < 0 || n >= ST_PATH_MAX)
    return pd_err_set(e, PD_EINVAL, "path too long: %s/%s", dir, name);
  return PD_OK;
}

/* Reads a whole small file into a NUL-terminated buffer. */
static pd_status st_read_small(const char *path, off_t limit, char **out, size_t *len,
                               pd_err *e) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return pd_err_set(e, errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: cannot open: %s", path,
                      strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    close(fd);
    return pd_err_set(e, PD_EIO, "%s: not a readable regular file", path);
  }
  if (sb.st_size > limit) {
    close(fd);
    return pd_err_set(e, PD_EFORMAT, "%s: %lld bytes exceeds the %lld-byte limit", path,
                      (long long)sb.st_size, (long long)limit);
  }
  char *buf = malloc((size_t)sb.st_size + 1);
  if (!buf) {
    close(fd);
    return pd_err_set(e, PD_ENOMEM, "out of memory reading %s", path);
  }
  size_t got = 0;
  while (got < (size_t)sb.st_size) {
    ssize_t r = read(fd, buf + got, (size_t)sb.st_size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int err = r < 0 ? errno : 0;
      free(buf);
      close(fd);
      return pd_err_set(e, PD_EIO, "%s: read failed: %s", path,
                        err ? strerror(err) : "file shrank while reading");
    }
    got += (size_t)r;
  }
  close(fd);
  buf[got] = 0;
  *out = buf;
  *len = got;
  return PD_OK;
}

/* A shard name from the index must be a plain file name inside the model directory. */
static bool st_shard_name_ok(const char *s) {
  return s[0] && !strchr(s, '/') && !strchr(s, '\\') && !strstr(s, "..");
}

static pd_st *st_open_index(const char *dir, const char *ipath, pd_err *e) {
  char *text = NULL;
  size_t len = 0;
  if (st_read_small(ipath, ST_MAX_INDEX, &text, &len, e) != PD_OK) return NULL;
  cJSON *root = cJSON_ParseWithLength(text, len);
  free(text);
  pd_st *st = NULL;
  const char **shards = NULL;
  size_t nshards = 0;
  if (!root) {
    pd_err_set(e, PD_EFORMAT, "%s: not valid JSON", ipath);
    goto fail;
  }
  const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
  if (!cJSON_IsObject(root) || !cJSON_IsObject(wm)) {
    pd_err_set(e, PD_EFORMAT, "%s: missing \"weight_map\" object", ipath);
    goto fail;
  }
  int nmap = cJSON_GetArraySize(wm);
  if (nmap == 0) {
    pd_err_set(e, PD_EFORMAT, "%s: \"weight_map\" is empty", ipath);
    goto fail;
  }
  shards = malloc((size_t)nmap * sizeof *shards);
  if (!shards) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    goto fail;
  }
  /* Distinct shard names, in order of first appearance. Shard counts are small (tens). */
  for (const cJSON *it = wm->child; it; it = it->next) {
    if (!cJSON_IsString(it)) {
      pd_err_set(e, PD_EFORMAT, "%s: weight_map[\"%s\"] is not a file name string", ipath,
                 it->string ? it->string : "");
      goto fail;
    }
    if (!st_shard_name_ok(it->valuestring)) {
      pd_err_set(e, PD_EFORMAT,
                 "%s: weight_map[\"%s\"] = \"%s\" is not a plain file name in the model "
                 "directory",
                 ipath, it->string ? it->string : "", it->valuestring);
      goto fail;
    }
    size_t k = 0;
    while (k < nshards && strcmp(shards[k], it->valuestring) != 0) k++;
    if (k == nshards) shards[nshards++] = it->valuestring;
  }
  st = st_new(e);
  if (!st) goto fail;
  for (size_t k = 0; k < nshards; k++) {
    char path[ST_PATH_MAX];
    if (st_join(path, dir, shards[k], e) != PD_OK) goto fail;
    if (st_add_file(st, path, e) != PD_OK) {
      pd_err_prefix(e, "shard %zu of %zu named by %s", k + 1, nshards, ipath);
      goto fail;
    }
  }
  /* Every mapped name must live in the shard the index names (file k = shards[k]). */
  for (const cJSON *it = wm->child; it; it = it->next) {
    const pd_st_tensor *t = pd_st_find(st, it->string);
    size_t k = 0;
    while (strcmp(shards[k], it->valuestring) != 0) k++;
    if (!t || st->file_of[t - st->tensors] != k) {
      pd_err_set(e, PD_EFORMAT, "%s: tensor '%s' is mapped to %s, which does not contain it",
                 ipath, it->string, it->valuestring);
      goto fail;
    }
  }
  free(shards);
  cJSON_Delete(root);
  return st;
fail:
  free(shards);
  cJSON_Delete(root);
  pd_st_close(st);
  return NULL;
}

static int st_cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static pd_st *st_open_glob(const char *dir, pd_err *e) {
  DIR *d = opendir(dir);
  if (!d) {
    pd_err_set(e, errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: cannot open directory: %s", dir,
               strerror(errno));
    return NULL;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  pd_st *st = NULL;
  struct dirent *de;
  while ((de = readdir(d))) {
    size_t len = strlen(de->d_name);
    static const char ext[] = ".safetensors";
    if (len <= sizeof ext - 1 || strcmp(de->d_name + len - (sizeof ext - 1), ext) != 0) continue;
    if (n == cap) {
      size_t c = cap ? 2 * cap : 8;
      char **nn = realloc(names, c * sizeof *nn);
      if (!nn) goto oom;
      names = nn;
      cap = c;
    }
    if (!(names[n] = strdup(de->d_name))) goto oom;
    n++;
  }
  closedir(d);
  d = NULL;
  if (n == 0) {
    pd_err_set(e, PD_ENOTFOUND, "%s: no %s, %s or *.safetensors file", dir, ST_INDEX_NAME,
               ST_SINGLE_NAME);
    goto done;
  }
  qsort(names, n, sizeof *names, st_cmp_str);
  if (!(st = st_new(e))) goto done;
  for (size_t i = 0; i < n; i++) {
    char path[ST_PATH_MAX];
    if (st_join(path, dir, names[i], e) != PD_OK || st_add_file(st, path, e) != PD_OK) {
      pd_st_close(st);
      st = NULL;
      goto done;
    }
  }
  goto done;
oom:
  pd_err_set(e, PD_ENOMEM, "out of memory");
done:
  if (d) closedir(d);
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  return st;
}

pd_st *pd_st_open_dir(const char *dir, pd_err *e) {
  if (!dir || !dir[0]) {
    pd_err_set(e, PD_EINVAL, "pd_st_open_dir: no directory given");
    return NULL;
  }
  char path[ST_PATH_MAX];
  struct stat sb;
  if (st_join(path, dir, ST_INDEX_NAME, e) != PD_OK) return NULL;
  if (stat(path, &sb) == 0) return st_open_index(dir, path, e);
  if (errno != ENOENT) {
    pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
    return NULL;
  }
  if (st_join(path, dir, ST_SINGLE_NAME, e) != PD_OK) return NULL;
  if (stat(path, &sb) == 0) return pd_st_open_file(path, e);
  if (errno != ENOENT) {
    pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
    return NULL;
  }
  return st_open_glob(dir, e);
}
