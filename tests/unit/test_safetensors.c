/* safetensors reader: the bundled files, every kind of damage the header validation must catch,
 * sharded directories (model.safetensors.index.json) and the *.safetensors fallback. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/safetensors.h"
#include "st_writer.h"

static int g_fail;
#define CHECK(c)                                                       \
  do {                                                                 \
    if (!(c)) {                                                        \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
      g_fail++;                                                        \
    }                                                                  \
  } while (0)

#define MODELS PD_TEST_DATA "/models"
#define TINY MODELS "/tiny-random-llama31"

static char g_tmp[256];

static void path_in(char *out, size_t cap, const char *dir, const char *name) {
  snprintf(out, cap, "%s/%s", dir, name);
}

/* Opening path must fail with code, the message naming the file and containing want (if any). */
static void expect_open_fail(const char *path, pd_status code, const char *want, int line) {
  pd_err e = {0};
  pd_st *st = pd_st_open_file(path, &e);
  if (st || e.code != code || !strstr(e.msg, path) || (want && !strstr(e.msg, want))) {
    fprintf(stderr, "line %d: %s: got %s (code %d: %s), want code %d containing '%s'\n", line,
            path, st ? "success" : "failure", e.code, e.msg, code, want ? want : "");
    g_fail++;
  }
  pd_st_close(st);
}

/* ---- bundled files ------------------------------------------------------------------------ */

static void test_bundled(void) {
  static const struct {
    const char *name;
    size_t count; /* tensors in the header, from the files themselves */
    int64_t hidden;
  } models[] = {{"pycoder-12m", 2 + 6 * 9 + 1, 384},
                {"pycoder-draft-2m", 2 + 2 * 9 + 1, 192},
                {"pycoder-qwen2-4m", 1 + 4 * 12 + 1, 256},
                {"tiny-random-llama31", 2 + 2 * 9 + 1, 128}};
  for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
    char dir[512], file[600];
    snprintf(dir, sizeof dir, "%s/%s", MODELS, models[i].name);
    path_in(file, sizeof file, dir, "model.safetensors");
    pd_err e = {0};
    pd_st *st = pd_st_open_dir(dir, &e);
    if (!st) {
      fprintf(stderr, "open %s: %s\n", dir, e.msg);
      g_fail++;
      continue;
    }
    CHECK(pd_st_count(st) == models[i].count);
    const pd_st_tensor *t = pd_st_find(st, "model.embed_tokens.weight");
    CHECK(t && t->dtype == PD_DTYPE_BF16 && t->ndim == 2 && t->shape[0] == 4096 &&
          t->shape[1] == models[i].hidden && t->nbytes == (size_t)(4096 * models[i].hidden * 2));
    CHECK(pd_st_find(st, "no.such.tensor") == NULL);
    CHECK(pd_st_find(st, "__metadata__") == NULL);
    CHECK(pd_st_at(st, pd_st_count(st)) == NULL);
    /* Every listed tensor is found by name, and the tensors tile the data section exactly
     * (files written by the safetensors library have no gaps). */
    struct stat sb;
    CHECK(stat(file, &sb) == 0);
    const char *lo = NULL, *hi = NULL;
    size_t total = 0;
    for (size_t k = 0; k < pd_st_count(st); k++) {
      const pd_st_tensor *a = pd_st_at(st, k);
      CHECK(a && pd_st_find(st, a->name) == a);
      const char *p = a->data;
      if (!lo || p < lo) lo = p;
      if (!hi || p + a->nbytes > hi) hi = p + a->nbytes;
      total += a->nbytes;
    }
    CHECK(hi - lo == (ptrdiff_t)total);
    uint64_t hlen = 0;
    FILE *f = fopen(file, "rb");
    unsigned char b8[8] = {0};
    CHECK(f && fread(b8, 1, 8, f) == 8);
    if (f) fclose(f);
    for (int j = 7; j >= 0; j--) hlen = (hlen << 8) | b8[j];
    CHECK((uint64_t)sb.st_size == 8 + hlen + total);
    pd_st_close(st);
  }

  /* Spot check against bytes read independently: tiny-random-llama31's model.norm.weight has
   * data_offsets [2884608, 2884864] after a 2232-byte header (read with Python's json). */
  pd_err e = {0};
  pd_st *st = pd_st_open_file(TINY "/model.safetensors", &e);
  CHECK(st != NULL);
  const pd_st_tensor *t = st ? pd_st_find(st, "model.norm.weight") : NULL;
  CHECK(t && t->nbytes == 256 && t->ndim == 1 && t->shape[0] == 128);
  FILE *f = fopen(TINY "/model.safetensors", "rb");
  unsigned char buf[256];
  CHECK(f && fseek(f, 8 + 2232 + 2884608, SEEK_SET) == 0 && fread(buf, 1, 256, f) == 256);
  if (f) fclose(f);
  CHECK(t && memcmp(t->data, buf, 256) == 0);
  pd_st_close(st);

  /* Missing file and directory. */
  CHECK(pd_st_open_file(MODELS "/nope.safetensors", &e) == NULL && e.code == PD_ENOTFOUND);
  CHECK(pd_st_open_dir(MODELS "/no-such-model", &e) == NULL && e.code == PD_ENOTFOUND);
  CHECK(pd_st_open_file(NULL, &e) == NULL && e.code == PD_EINVAL);
  pd_st_close(NULL);
  CHECK(pd_st_find(NULL, "x") == NULL && pd_st_count(NULL) == 0);
}

/* ---- truncation ----------------------------------------------------------------------------- */

static void test_truncated(void) {
  size_t n = 0;
  unsigned char *all = stw_read_file(TINY "/model.safetensors", &n);
  CHECK(all && n > 4096);
  if (!all) return;
  uint64_t hlen = 0;
  for (int j = 7; j >= 0; j--) hlen = (hlen << 8) | all[j];
  size_t cuts[] = {0, 1, 7, 8, 9, 8 + hlen / 2, 8 + hlen - 1, 8 + hlen, 8 + hlen + 1,
                   n / 2, n - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    char path[512];
    snprintf(path, sizeof path, "%s/cut%zu.safetensors", g_tmp, cuts[i]);
    CHECK(stw_write_file(path, all, cuts[i]) == 0);
    expect_open_fail(path, PD_EFORMAT, NULL, __LINE__);
    unlink(path);
  }
  free(all);
}

/* ---- crafted headers ------------------------------------------------------------------------ */

static void write_hdr(const char *path, const char *hdr, size_t data_len) {
  unsigned char data[64] = {0};
  CHECK(data_len <= sizeof data);
  CHECK(stw_write_raw(path, strlen(hdr), hdr, strlen(hdr), data, data_len) == 0);
}

static void test_headers(void) {
  char path[512];
  snprintf(path, sizeof path, "%s/h.safetensors", g_tmp);

  /* Header length larger than the file. */
  CHECK(stw_write_raw(path, 1000, "{}", 2, "0123456789", 10) == 0);
  expect_open_fail(path, PD_EFORMAT, "header length", __LINE__);
  /* Header length past the 100 MB limit, in a (sparse) file big enough to hold it. */
  {
    uint64_t big = (uint64_t)200 << 20;
    CHECK(stw_write_raw(path, big, "{}", 2, NULL, 0) == 0);
    CHECK(truncate(path, (off_t)(big + 16)) == 0);
    expect_open_fail(path, PD_EFORMAT, "limit", __LINE__);
  }

  static const struct {
    const char *hdr;
    size_t data;
    const char *want; /* in the message */
  } bad[] = {
      {"", 0, "JSON"},
      {"{not json", 0, "JSON"},
      {"[1, 2]", 0, "object"},
      {"{} x", 0, "after the header"},
      {"{\"a\": 5}", 0, "'a'"},
      {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "Q4"},
      {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "dtype"},
      {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "dtype"},
      {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "shape"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "shape[0]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, "shape[0]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,\"2\"],\"data_offsets\":[0,8]}}", 8, "shape[1]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
       "dimensions"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
       "\"data_offsets\":[0,4]}}",
       4, "overflow"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,4]}}", 4,
       "shape"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, "data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, "data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[250],\"data_offsets\":[0,1000]}}", 8, "outside"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 8, "outside"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 8, "outside"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 12, "need 12"},
      {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 16, "need 8"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
       8, "twice"},
      {"{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "empty name"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int before = g_fail;
    write_hdr(path, bad[i].hdr, bad[i].data);
    expect_open_fail(path, PD_EFORMAT, bad[i].want, __LINE__);
    if (g_fail != before) fprintf(stderr, "  (case %zu: %s)\n", i, bad[i].hdr);
  }

  /* Valid edge cases: metadata ignored, trailing padding, scalar, empty and 8-D tensors. */
  const char *ok =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
      "\"z\":{\"dtype\":\"BF16\",\"shape\":[0,5],\"data_offsets\":[4,4]},"
      "\"m\":{\"dtype\":\"I8\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[4,6]}}   \n  ";
  unsigned char data[6] = {0, 0, 0x80, 0x3f, 7, 9}; /* 1.0f, then int8 7, 9 */
  CHECK(stw_write_raw(path, strlen(ok), ok, strlen(ok), data, sizeof data) == 0);
  pd_err e = {0};
  pd_st *st = pd_st_open_file(path, &e);
  if (!st) fprintf(stderr, "valid edge cases: %s\n", e.msg);
  CHECK(st && pd_st_count(st) == 3);
  const pd_st_tensor *s = st ? pd_st_find(st, "s") : NULL;
  float one = 0;
  if (s) memcpy(&one, s->data, 4);
  CHECK(s && s->ndim == 0 && s->nbytes == 4 && one == 1.0f);
  const pd_st_tensor *z = st ? pd_st_find(st, "z") : NULL;
  CHECK(z && z->ndim == 2 && z->shape[0] == 0 && z->shape[1] == 5 && z->nbytes == 0);
  const pd_st_tensor *m = st ? pd_st_find(st, "m") : NULL;
  CHECK(m && m->ndim == 8 && m->shape[7] == 2 && m->dtype == PD_DTYPE_I8 &&
        ((const signed char *)m->data)[1] == 9);
  pd_st_close(st);

  /* Empty header object: a valid file with no tensors. */
  write_hdr(path, "{}", 0);
  st = pd_st_open_file(path, &e);
  CHECK(st && pd_st_count(st) == 0 && pd_st_find(st, "a") == NULL);
  pd_st_close(st);
  unlink(path);
}

/* ---- sharded -------------------------------------------------------------------------------- */

/* Writes the tensors of src into nshards files of dir (tensor k goes to shard
 * k * nshards / count, so each shard holds a contiguous run) and the matching index. The
 * index maps tensor `moved` (if not NULL) to shard `moved_to` instead, and maps `extra`
 * (if not NULL) to shard 1 although no shard holds it. */
static int write_shards(const pd_st *src, const char *dir, int nshards, const char *moved,
                        int moved_to, const char *extra) {
  size_t count = pd_st_count(src);
  st_writer *w[8];
  for (int s = 0; s < nshards; s++) w[s] = stw_new();
  size_t idx_cap = 256 + count * 160;
  char *idx = malloc(idx_cap);
  size_t o = (size_t)snprintf(idx, idx_cap, "{\"metadata\":{\"total_size\":0},\"weight_map\":{");
  for (size_t k = 0; k < count; k++) {
    const pd_st_tensor *t = pd_st_at(src, k);
    int s = (int)(k * (size_t)nshards / count);
    if (stw_add(w[s], t->name, pd_dtype_name(t->dtype), t->ndim, t->shape, t->data, t->nbytes))
      return -1;
    int ms = (moved && strcmp(moved, t->name) == 0) ? moved_to : s;
    o += (size_t)snprintf(idx + o, idx_cap - o, "%s\"%s\":\"model-%05d-of-%05d.safetensors\"",
                          k ? "," : "", t->name, ms + 1, nshards);
  }
  if (extra)
    o += (size_t)snprintf(idx + o, idx_cap - o, ",\"%s\":\"model-00002-of-%05d.safetensors\"",
                          extra, nshards);
  o += (size_t)snprintf(idx + o, idx_cap - o, "}}");
  int rc = 0;
  for (int s = 0; s < nshards; s++) {
    char name[64], path[512];
    snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, nshards);
    path_in(path, sizeof path, dir, name);
    if (stw_write(w[s], path, "{\"format\":\"pt\"}")) rc = -1;
    stw_free(w[s]);
  }
  char path[512];
  path_in(path, sizeof path, dir, "model.safetensors.index.json");
  if (stw_write_file(path, idx, o)) rc = -1;
  free(idx);
  return rc;
}

static void write_index(const char *dir, const char *text) {
  char path[512];
  path_in(path, sizeof path, dir, "model.safetensors.index.json");
  CHECK(stw_write_file(path, text, strlen(text)) == 0);
}

static void expect_dir_fail(const char *dir, pd_status code, const char *want, int line) {
  pd_err e = {0};
  pd_st *st = pd_st_open_dir(dir, &e);
  if (st || e.code != code || (want && !strstr(e.msg, want))) {
    fprintf(stderr, "line %d: open_dir %s: got %s (code %d: %s), want code %d with '%s'\n",
            line, dir, st ? "success" : "failure", e.code, e.msg, code, want ? want : "");
    g_fail++;
  }
  pd_st_close(st);
}

static void test_sharded(void) {
  pd_err e = {0};
  pd_st *one = pd_st_open_file(TINY "/model.safetensors", &e);
  CHECK(one != NULL);
  if (!one) return;
  char dir[512];
  snprintf(dir, sizeof dir, "%s/sharded", g_tmp);
  CHECK(mkdir(dir, 0700) == 0);

  for (int nshards = 2; nshards <= 3; nshards++) {
    CHECK(write_shards(one, dir, nshards, NULL, 0, NULL) == 0);
    pd_st *sh = pd_st_open_dir(dir, &e);
    if (!sh) fprintf(stderr, "sharded open: %s\n", e.msg);
    CHECK(sh && pd_st_count(sh) == pd_st_count(one));
    for (size_t k = 0; sh && k < pd_st_count(one); k++) {
      const pd_st_tensor *a = pd_st_at(one, k), *b = pd_st_find(sh, a->name);
      CHECK(b && b->dtype == a->dtype && b->ndim == a->ndim && b->nbytes == a->nbytes &&
            memcmp(b->shape, a->shape, sizeof a->shape[0] * (size_t)a->ndim) == 0 &&
            memcmp(b->data, a->data, a->nbytes) == 0 && b->data != a->data);
    }
    pd_st_close(sh);
  }

  /* Damaged indexes (3 shards on disk). */
  const char *victim = "model.layers.0.mlp.up_proj.weight"; /* in shard 1 of 3 */
  CHECK(write_shards(one, dir, 3, victim, 2, NULL) == 0);
  expect_dir_fail(dir, PD_EFORMAT, victim, __LINE__); /* mapped to a shard that lacks it */
  CHECK(write_shards(one, dir, 3, NULL, 0, "model.layers.9.ghost.weight") == 0);
  expect_dir_fail(dir, PD_EFORMAT, "model.layers.9.ghost.weight", __LINE__);
  write_index(dir, "{\"weight_map\":{\"a\":\"../model-00001-of-00003.safetensors\"}}");
  expect_dir_fail(dir, PD_EFORMAT, "../model", __LINE__);
  write_index(dir, "{\"weight_map\":{\"a\":\"sub/model-00001-of-00003.safetensors\"}}");
  expect_dir_fail(dir, PD_EFORMAT, "sub/model", __LINE__);
  write_index(dir, "{\"weight_map\":{\"a\":\"x..y.safetensors\"}}");
  expect_dir_fail(dir, PD_EFORMAT, "x..y", __LINE__);
  write_index(dir, "{\"weight_map\":{\"a\":\"\"}}");
  expect_dir_fail(dir, PD_EFORMAT, NULL, __LINE__);
  write_index(dir, "{\"weight_map\":{\"a\":3}}");
  expect_dir_fail(dir, PD_EFORMAT, "\"a\"", __LINE__);
  write_index(dir, "{\"weight_map\":{\"a\":\"missing-shard.safetensors\"}}");
  expect_dir_fail(dir, PD_ENOTFOUND, "missing-shard.safetensors", __LINE__);
  write_index(dir, "{\"metadata\":{}}");
  expect_dir_fail(dir, PD_EFORMAT, "weight_map", __LINE__);
  write_index(dir, "{\"weight_map\":{}}");
  expect_dir_fail(dir, PD_EFORMAT, "empty", __LINE__);
  write_index(dir, "{\"weight_map\": ");
  expect_dir_fail(dir, PD_EFORMAT, "JSON", __LINE__);

  /* A tensor present in two shards is ambiguous. */
  {
    const pd_st_tensor *t = pd_st_find(one, "model.norm.weight");
    st_writer *w = stw_new();
    CHECK(stw_add(w, t->name, "BF16", 1, t->shape, t->data, t->nbytes) == 0);
    char p[600];
    path_in(p, sizeof p, dir, "dup.safetensors");
    CHECK(stw_write(w, p, NULL) == 0);
    stw_free(w);
    write_index(dir,
                "{\"weight_map\":{\"model.norm.weight\":\"dup.safetensors\","
                "\"model.embed_tokens.weight\":\"model-00001-of-00003.safetensors\","
                "\"lm_head.weight\":\"model-00001-of-00003.safetensors\"}}");
    pd_st *st = pd_st_open_dir(dir, &e);
    CHECK(st && pd_st_count(st) == 1 + (pd_st_count(one) + 2) / 3); /* shard 1 + dup */
    pd_st_close(st);
    /* Shard 3 also holds model.norm.weight (the last tensor). */
    write_index(dir,
                "{\"weight_map\":{\"model.norm.weight\":\"dup.safetensors\","
                "\"x\":\"model-00003-of-00003.safetensors\"}}");
    expect_dir_fail(dir, PD_EFORMAT, "twice", __LINE__);
  }
  /* A damaged shard is reported with its name. */
  {
    char p[600];
    path_in(p, sizeof p, dir, "model-00002-of-00003.safetensors");
    CHECK(write_shards(one, dir, 3, NULL, 0, NULL) == 0);
    CHECK(truncate(p, 4000) == 0);
    expect_dir_fail(dir, PD_EFORMAT, "model-00002-of-00003.safetensors", __LINE__);
  }
  pd_st_close(one);
}

/* ---- *.safetensors fallback ------------------------------------------------------------------ */

static void test_glob(void) {
  char dir[512];
  snprintf(dir, sizeof dir, "%s/glob", g_tmp);
  CHECK(mkdir(dir, 0700) == 0);
  expect_dir_fail(dir, PD_ENOTFOUND, "no model.safetensors", __LINE__);

  float v[3] = {1, 2, 3};
  int64_t shp[1] = {1};
  const char *names[] = {"b.safetensors", "a.safetensors"};
  const char *tensors[] = {"tb", "ta"};
  for (int i = 0; i < 2; i++) {
    st_writer *w = stw_new();
    CHECK(stw_add(w, tensors[i], "F32", 1, shp, &v[i], 4) == 0);
    char p[600];
    path_in(p, sizeof p, dir, names[i]);
    CHECK(stw_write(w, p, NULL) == 0);
    stw_free(w);
  }
  /* Not a safetensors name: ignored. */
  char p[600];
  path_in(p, sizeof p, dir, "notes.txt");
  CHECK(stw_write_file(p, "hello", 5) == 0);
  pd_err e = {0};
  pd_st *st = pd_st_open_dir(dir, &e);
  if (!st) fprintf(stderr, "glob: %s\n", e.msg);
  CHECK(st && pd_st_count(st) == 2);
  /* Sorted by file name: a.safetensors first. */
  CHECK(st && strcmp(pd_st_at(st, 0)->name, "ta") == 0 && strcmp(pd_st_at(st, 1)->name, "tb") == 0);
  const pd_st_tensor *tb = st ? pd_st_find(st, "tb") : NULL;
  CHECK(tb && *(const float *)tb->data == 1.0f);
  pd_st_close(st);

  /* model.safetensors takes precedence over the other files. */
  st_writer *w = stw_new();
  CHECK(stw_add(w, "only", "F32", 1, shp, &v[2], 4) == 0);
  path_in(p, sizeof p, dir, "model.safetensors");
  CHECK(stw_write(w, p, NULL) == 0);
  stw_free(w);
  st = pd_st_open_dir(dir, &e);
  CHECK(st && pd_st_count(st) == 1 && pd_st_find(st, "only") && !pd_st_find(st, "ta"));
  pd_st_close(st);
}

/* ---- a large header: ~1000 tensors, lookups by hash --------------------------------------- */

static void test_many(void) {
  st_writer *w = stw_new();
  enum { N = 1500 };
  for (int i = 0; i < N; i++) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.w", i);
    int32_t v = i;
    int64_t shp[1] = {1};
    CHECK(stw_add(w, name, "I32", 1, shp, &v, 4) == 0);
  }
  char p[600];
  path_in(p, sizeof p, g_tmp, "many.safetensors");
  CHECK(stw_write(w, p, NULL) == 0);
  stw_free(w);
  pd_err e = {0};
  pd_st *st = pd_st_open_file(p, &e);
  CHECK(st && pd_st_count(st) == N);
  for (int i = 0; st && i < N; i++) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.w", i);
    const pd_st_tensor *t = pd_st_find(st, name);
    int32_t v = -1;
    if (t) memcpy(&v, t->data, 4);
    CHECK(t && v == i);
  }
  CHECK(st && pd_st_find(st, "model.layers.1500.w") == NULL);
  pd_st_close(st);
  unlink(p);
}

/* ---- random damage: never a crash, never a tensor outside the file -------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) { /* xorshift64* */
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return (uint32_t)((g_rng * 2685821657736338717ull) >> 32);
}

static void test_fuzz(void) {
  /* A small valid file: three tensors of different dtypes. */
  st_writer *w = stw_new();
  float f[6] = {1, 2, 3, 4, 5, 6};
  int64_t s23[2] = {2, 3}, s4[1] = {4}, s1[1] = {1};
  CHECK(stw_add(w, "model.a.weight", "F32", 2, s23, f, sizeof f) == 0);
  CHECK(stw_add(w, "model.b.bias", "BF16", 1, s4, f, 8) == 0);
  CHECK(stw_add(w, "c", "I8", 1, s1, f, 1) == 0);
  char p[600];
  path_in(p, sizeof p, g_tmp, "fuzz.safetensors");
  CHECK(stw_write(w, p, "{\"format\":\"pt\"}") == 0);
  stw_free(w);
  size_t n = 0;
  unsigned char *orig = stw_read_file(p, &n), *buf = malloc(n + 1);
  CHECK(orig && buf);
  if (!orig || !buf) return;
  static const char pick[] = "{}[]\",:0123456789-.eE \\x";
  int opened = 0;
  for (int iter = 0; iter < 3000; iter++) {
    memcpy(buf, orig, n);
    size_t len = n;
    int edits = 1 + (int)(rnd() % 4);
    for (int k = 0; k < edits; k++) {
      size_t at = rnd() % n;
      switch (rnd() % 4) {
        case 0: buf[at] = (unsigned char)rnd(); break;
        case 1: buf[at] = (unsigned char)pick[rnd() % (sizeof pick - 1)]; break;
        case 2: buf[at] = (unsigned char)(buf[at] ^ (1u << (rnd() % 8))); break;
        default: len = at; break; /* truncate */
      }
    }
    CHECK(stw_write_file(p, buf, len) == 0);
    pd_err e = {0};
    pd_st *st = pd_st_open_file(p, &e);
    if (st) {
      opened++;
      /* Touch every byte: a tensor reaching past the mapping would fault here. */
      unsigned sum = 0;
      for (size_t k = 0; k < pd_st_count(st); k++) {
        const pd_st_tensor *t = pd_st_at(st, k);
        CHECK(pd_st_find(st, t->name) == t);
        CHECK(t->nbytes <= len);
        for (size_t b = 0; b < t->nbytes; b++) sum += ((const unsigned char *)t->data)[b];
      }
      (void)sum;
      pd_st_close(st);
    } else {
      CHECK(e.code == PD_EFORMAT && e.msg[0]);
    }
  }
  CHECK(opened > 0 && opened < 3000); /* some damage is harmless (inside data), most is not */
  free(orig);
  free(buf);
  unlink(p);
}

int main(void) {
  if (stw_mkdtemp("st", g_tmp, sizeof g_tmp)) return 1;
  test_bundled();
  test_truncated();
  test_headers();
  test_sharded();
  test_glob();
  test_many();
  test_fuzz();
  stw_rm_rf(g_tmp);
  if (g_fail) {
    fprintf(stderr, "test_safetensors: %d check(s) failed\n", g_fail);
    return 1;
  }
  printf("test_safetensors: ok\n");
  return 0;
}
