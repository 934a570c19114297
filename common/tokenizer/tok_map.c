/* The tokenizer's open-addressing hash maps: strings to ids, u64 pairs to merge ranks. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* ================================================================ hashing */

static uint32_t hash_bytes(const char *s, size_t n) {
  /* FNV-1a, finished with a murmur3 mix so that the low bits (the slot index) are good. */
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) {
    h ^= (unsigned char)s[i];
    h *= 1099511628211ULL;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  return (uint32_t)h;
}

static uint64_t hash_u64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* Slots for `expected` keys at a load factor of at most 1/2 (linear probing). */
static size_t table_size(size_t expected) {
  size_t cap = 16;
  while (cap < expected * 2) cap *= 2;
  return cap;
}

/* ================================================================ tk_strmap */

bool tk_strmap_init(tk_strmap *m, size_t expected) {
  size_t cap = table_size(expected);
  if (cap > UINT32_MAX) return false;
  m->e = calloc(cap, sizeof *m->e);
  if (!m->e) return false;
  m->mask = (uint32_t)(cap - 1);
  m->n = 0;
  return true;
}

static bool strmap_grow(tk_strmap *m) {
  tk_strmap bigger;
  if (!tk_strmap_init(&bigger, (size_t)(m->mask + 1))) return false;
  for (uint32_t i = 0; i <= m->mask; i++) {
    tk_strmap_ent *x = &m->e[i];
    if (!x->s) continue;
    uint32_t j = x->hash & bigger.mask;
    while (bigger.e[j].s) j = (j + 1) & bigger.mask;
    bigger.e[j] = *x;
    bigger.n++;
  }
  free(m->e);
  *m = bigger;
  return true;
}

bool tk_strmap_put(tk_strmap *m, const char *s, size_t len, int32_t val) {
  if (len > UINT32_MAX) return false;
  if ((size_t)(m->n + 1) * 2 > (size_t)m->mask + 1 && !strmap_grow(m)) return false;
  uint32_t h = hash_bytes(s, len), i = h & m->mask;
  while (m->e[i].s) {
    tk_strmap_ent *x = &m->e[i];
    if (x->hash == h && x->len == len && memcmp(x->s, s, len) == 0) {
      x->val = val;
      return true;
    }
    i = (i + 1) & m->mask;
  }
  m->e[i] = (tk_strmap_ent){s, (uint32_t)len, h, val};
  m->n++;
  return true;
}

int32_t tk_strmap_get(const tk_strmap *m, const char *s, size_t len) {
  if (!m->e) return -1;
  uint32_t h = hash_bytes(s, len), i = h & m->mask;
  while (m->e[i].s) {
    const tk_strmap_ent *x = &m->e[i];
    if (x->hash == h && x->len == len && memcmp(x->s, s, len) == 0) return x->val;
    i = (i + 1) & m->mask;
  }
  return -1;
}

void tk_strmap_free(tk_strmap *m) {
  free(m->e);
  m->e = NULL;
  m->mask = m->n = 0;
}

/* ================================================================ tk_u64map */

#define U64_EMPTY UINT64_MAX

bool tk_u64map_init(tk_u64map *m, size_t expected) {
  size_t cap = table_size(expected);
  if (cap > UINT32_MAX) return false;
  m->k = malloc(cap * sizeof *m->k);
  m->v = malloc(cap * sizeof *m->v);
  if (!m->k || !m->v) {
    free(m->k);
    free(m->v);
    m->k = m->v = NULL;
    return false;
  }
  memset(m->k, 0xff, cap * sizeof *m->k);
  m->mask = (uint32_t)(cap - 1);
  m->n = 0;
  return true;
}

static bool u64map_grow(tk_u64map *m) {
  tk_u64map bigger;
  if (!tk_u64map_init(&bigger, (size_t)(m->mask + 1))) return false;
  for (uint32_t i = 0; i <= m->mask; i++) {
    if (m->k[i] == U64_EMPTY) continue;
    uint32_t j = (uint32_t)hash_u64(m->k[i]) & bigger.mask;
    while (bigger.k[j] != U64_EMPTY) j = (j + 1) & bigger.mask;
    bigger.k[j] = m->k[i];
    bigger.v[j] = m->v[i];
    bigger.n++;
  }
  tk_u64map_free(m);
  *m = bigger;
  return true;
}

bool tk_u64map_put(tk_u64map *m, uint64_t k, uint64_t v) {
  PD_ASSERT(k != U64_EMPTY);
  if ((size_t)(m->n + 1) * 2 > (size_t)m->mask + 1 && !u64map_grow(m)) return false;
  uint32_t i = (uint32_t)hash_u64(k) & m->mask;
  while (m->k[i] != U64_EMPTY) {
    if (m->k[i] == k) {
      m->v[i] = v;
      return true;
    }
    i = (i + 1) & m->mask;
  }
  m->k[i] = k;
  m->v[i] = v;
  m->n++;
  return true;
}

bool tk_u64map_get(const tk_u64map *m, uint64_t k, uint64_t *v) {
  if (!m->k) return false;
  uint32_t i = (uint32_t)hash_u64(k) & m->mask;
  while (m->k[i] != U64_EMPTY) {
    if (m->k[i] == k) {
      *v = m->v[i];
      return true;
    }
    i = (i + 1) & m->mask;
  }
  return false;
}

void tk_u64map_free(tk_u64map *m) {
  free(m->k);
  free(m->v);
  m->k = m->v = NULL;
  m->mask = m->n = 0;
}
