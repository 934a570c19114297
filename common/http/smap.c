/* A string -> pointer hash map with open addressing (linear probing, tombstones). See smap.h. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "smap.h"

#define TOMB ((char *)1)

static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (; *s; s++) {
    h ^= (unsigned char)*s;
    h *= 1099511628211ull;
  }
  return h ^ (h >> 29);
}

void smap_init(smap *m) { memset(m, 0, sizeof *m); }

void smap_free(smap *m) {
  for (size_t i = 0; i < m->cap; i++)
    if (m->v[i].key && m->v[i].key != TOMB) free(m->v[i].key);
  free(m->v);
  memset(m, 0, sizeof *m);
}

static bool grow(smap *m) {
  size_t cap = m->cap ? m->cap * 2 : 64;
  while (m->n * 2 >= cap) cap *= 2; /* after dropping tombstones, stay under half full */
  smap_entry *v = calloc(cap, sizeof *v);
  if (!v) return false;
  for (size_t i = 0; i < m->cap; i++) {
    char *k = m->v[i].key;
    if (!k || k == TOMB) continue;
    size_t j = hash_str(k) & (cap - 1);
    while (v[j].key) j = (j + 1) & (cap - 1);
    v[j] = m->v[i];
  }
  free(m->v);
  m->v = v;
  m->cap = cap;
  m->used = m->n;
  return true;
}

bool smap_put(smap *m, const char *key, void *val) {
  if ((m->used + 1) * 2 > m->cap && !grow(m)) return false;
  size_t mask = m->cap - 1, j = hash_str(key) & mask, tomb = (size_t)-1;
  while (m->v[j].key) {
    if (m->v[j].key == TOMB) {
      if (tomb == (size_t)-1) tomb = j;
    } else if (!strcmp(m->v[j].key, key)) {
      m->v[j].val = val;
      return true;
    }
    j = (j + 1) & mask;
  }
  char *k = strdup(key);
  if (!k) return false;
  if (tomb != (size_t)-1) j = tomb;
  else m->used++;
  m->v[j].key = k;
  m->v[j].val = val;
  m->n++;
  return true;
}

static smap_entry *find(const smap *m, const char *key) {
  if (!m->cap) return NULL;
  size_t mask = m->cap - 1, j = hash_str(key) & mask;
  while (m->v[j].key) {
    if (m->v[j].key != TOMB && !strcmp(m->v[j].key, key)) return &m->v[j];
    j = (j + 1) & mask;
  }
  return NULL;
}

void *smap_get(const smap *m, const char *key) {
  smap_entry *e = find(m, key);
  return e ? e->val : NULL;
}

void smap_del(smap *m, const char *key) {
  smap_entry *e = find(m, key);
  if (!e) return;
  free(e->key);
  e->key = TOMB;
  e->val = NULL;
  m->n--;
}
