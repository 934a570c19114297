/* Fuzz target (d, part 1): safetensors files as a checkpoint brings them (common/model/
 * safetensors.c): the 8-byte header length, the JSON header (dtypes, shapes, data offsets,
 * __metadata__) validated against the file's size, and a sharded checkpoint's
 * model.safetensors.index.json (its weight_map against the shards it names).
 *
 * Input: [mode] bytes... mode 0: the bytes are one .safetensors file. mode 1: they are the
 * index.json of a directory that also holds two valid shards, a.safetensors (tensors x, y) and
 * b.safetensors (z).
 * Properties: nothing crashes or leaks; an opened checkpoint's every tensor is found by its
 * name, has a known dtype, at most PD_ST_MAX_DIMS dimensions, nbytes = product(shape) x the
 * dtype's size, and its bytes are readable (the first and the last). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "pd/safetensors.h"

static char g_dir[PATH_MAX];

static void rm_dir(void) {
  static const char *names[] = {"a.safetensors", "b.safetensors", "model.safetensors.index.json"};
  char path[PATH_MAX + 64];
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
    unlink(path);
  }
  rmdir(g_dir);
}

/* A valid shard: F32 tensors name[i] of shape [i + 1]. */
static void write_shard(const char *file, const char *const *names, int n) {
  char hdr[512];
  int k = snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"format\":\"pt\"}");
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    size_t nb = 4 * (size_t)(i + 1);
    k += snprintf(hdr + k, sizeof hdr - (size_t)k,
                  ",\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],\"data_offsets\":[%zu,%zu]}",
                  names[i], i + 1, off, off + nb);
    off += nb;
  }
  k += snprintf(hdr + k, sizeof hdr - (size_t)k, "}");
  uint8_t buf[1024];
  uint64_t hl = (uint64_t)k;
  for (int b = 0; b < 8; b++) buf[b] = (uint8_t)(hl >> (8 * b));
  memcpy(buf + 8, hdr, (size_t)k);
  memset(buf + 8 + k, 0x3f, off);
  fuzz_write_file(g_dir, file, buf, 8 + (size_t)k + off);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/pd-fuzz-st-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  FUZZ_CHECK(mkdtemp(g_dir));
  atexit(rm_dir);
  static const char *const a[] = {"x", "y"}, *const b[] = {"z"};
  write_shard("a.safetensors", a, 2);
  write_shard("b.safetensors", b, 1);
  return 0;
}

static void check(const pd_st *st) {
  size_t n = pd_st_count(st);
  volatile uint8_t sink = 0;
  for (size_t i = 0; i < n; i++) {
    const pd_st_tensor *t = pd_st_at(st, i);
    FUZZ_CHECK(t && t->name);
    FUZZ_CHECK(pd_st_find(st, t->name) == t);
    FUZZ_CHECK(t->ndim >= 0 && t->ndim <= PD_ST_MAX_DIMS);
    FUZZ_CHECK(pd_dtype_size(t->dtype) > 0);
    uint64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) {
      FUZZ_CHECK(t->shape[d] >= 0);
      numel *= (uint64_t)t->shape[d];
    }
    FUZZ_CHECK(numel * (uint64_t)pd_dtype_size(t->dtype) == t->nbytes);
    if (t->nbytes) {
      const uint8_t *b = t->data;
      sink ^= b[0];
      sink ^= b[t->nbytes - 1];
    }
  }
  FUZZ_CHECK(pd_st_at(st, n) == NULL);
  (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_dir[0]) LLVMFuzzerInitialize(NULL, NULL);
  fuzz_in in = {data, size};
  int mode = fuzz_byte(&in) % 2;
  pd_err e = {0};
  pd_st *st;
  if (mode == 0) {
    char path[64];
    int fd = fuzz_memfile(in.p, in.n, path, sizeof path);
    st = pd_st_open_file(path, &e);
    close(fd);
  } else {
    fuzz_write_file(g_dir, "model.safetensors.index.json", in.p, in.n);
    st = pd_st_open_dir(g_dir, &e);
  }
  if (!st) {
    FUZZ_CHECK(e.code != PD_OK && e.msg[0]);
    return 0;
  }
  check(st);
  pd_st_close(st);
  return 0;
}
