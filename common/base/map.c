/* pd_map: open addressing, linear probing, load <= 1/2, a control byte per slot, backward-shift
 * deletion. See pd/map.h. */
#include "pd/map.h"

#include <stdlib.h>
#include <string.h>

#define MIN_SLOTS 16u

/* The control byte of a full slot: 0x80 and the top 7 of the 32 hash bits kept (the home slot
 * comes from the low bits). */
static inline uint8_t tag_of(uint32_t h32) { return (uint8_t)(0x80 | (h32 >> 25)); }

/* Moves every entry into a new table of cap slots (a power of two, >= 2 * n). */
static bool rehash(pd_map *m, size_t cap) {
  pd_map_slot *t = calloc(cap, sizeof *t + 1);
  if (!t) return false;
  uint8_t *c = (uint8_t *)(t + cap);
  uint32_t mask = (uint32_t)(cap - 1);
  if (m->slots)
    for (size_t i = 0; i <= m->mask; i++) {
      if (!m->ctrl[i]) continue;
      uint32_t j = m->slots[i].hash & mask;
      while (c[j]) j = (j + 1) & mask;
      t[j] = m->slots[i];
      c[j] = m->ctrl[i];
    }
  free(m->slots);
  m->slots = t;
  m->ctrl = c;
  m->mask = mask;
  return true;
}

bool pd_map_reserve(pd_map *m, size_t n) {
  if (n > PD_MAP_MAX) return false;
  size_t cap = MIN_SLOTS;
  while (cap < 2 * n) cap *= 2;
  if (m->slots && cap <= (size_t)m->mask + 1) return true;
  return rehash(m, cap);
}

bool pd_map_init(pd_map *m, size_t expected, unsigned flags) {
  memset(m, 0, sizeof *m);
  m->flags = flags;
  return expected == 0 || pd_map_reserve(m, expected);
}

void pd_map_free(pd_map *m) {
  if (m->slots && (m->flags & PD_MAP_COPY_KEYS))
    for (size_t i = 0; i <= m->mask; i++)
      if (m->ctrl[i]) free((void *)(uintptr_t)m->slots[i].key);
  free(m->slots);
  m->slots = NULL;
  m->ctrl = NULL;
  m->mask = m->n = 0;
}

/* Room for one more entry. */
static bool room(pd_map *m) {
  if (m->slots && (size_t)(m->n + 1) * 2 <= (size_t)m->mask + 1) return true;
  if (m->n >= PD_MAP_MAX) return false;
  return rehash(m, m->slots ? ((size_t)m->mask + 1) * 2 : MIN_SLOTS);
}

/* Fills the first empty slot of h's probe run (there is one: the table is at most half full). */
static pd_map_slot *fill(pd_map *m, uint64_t key, uint32_t h, uint32_t len1, uint64_t val) {
  uint32_t i = h & m->mask;
  while (m->ctrl[i]) i = (i + 1) & m->mask;
  m->ctrl[i] = tag_of(h);
  m->slots[i] = (pd_map_slot){key, h, len1, val};
  m->n++;
  return &m->slots[i];
}

/* ---- string keys ---- */

pd_map_slot *pd_map_str_find(const pd_map *m, uint64_t h, const void *key, size_t len) {
  if (!m->slots || len >= UINT32_MAX) return NULL;
  /* Probes the slots, not the control bytes (see pd/map.h). */
  const uint32_t h32 = (uint32_t)h, len1 = (uint32_t)len + 1, mask = m->mask;
  for (uint32_t i = h32 & mask;; i = (i + 1) & mask) {
    pd_map_slot *s = &m->slots[i];
    if (!s->len1) return NULL;
    if (s->hash == h32 && s->len1 == len1 && memcmp((const void *)(uintptr_t)s->key, key, len) == 0)
      return s;
  }
}

pd_map_slot *pd_map_str_put(pd_map *m, uint64_t h, const void *key, size_t len, uint64_t val) {
  if (len >= UINT32_MAX) return NULL;
  pd_map_slot *s = pd_map_str_find(m, h, key, len);
  if (s) {
    s->val = val;
    return s;
  }
  const void *k = key;
  if (m->flags & PD_MAP_COPY_KEYS) {
    char *c = malloc(len + 1);
    if (!c) return NULL;
    if (len) memcpy(c, key, len);
    c[len] = 0;
    k = c;
  }
  if (!room(m)) {
    if (k != key) free((void *)k);
    return NULL;
  }
  return fill(m, (uint64_t)(uintptr_t)k, (uint32_t)h, (uint32_t)len + 1, val);
}

/* ---- integer keys ---- */

pd_map_slot *pd_map_u64_find(const pd_map *m, uint64_t h, uint64_t key) {
  if (!m->slots) return NULL;
  const uint32_t mask = m->mask;
  const uint8_t tag = tag_of((uint32_t)h);
  for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
    uint8_t c = m->ctrl[i];
    if (!c) return NULL;
    if (c == tag && m->slots[i].key == key) return &m->slots[i];
  }
}

pd_map_slot *pd_map_u64_next(const pd_map *m, const pd_map_slot *after, uint64_t key) {
  const uint32_t mask = m->mask;
  const uint8_t tag = tag_of(after->hash);
  for (uint32_t i = ((uint32_t)(after - m->slots) + 1) & mask;; i = (i + 1) & mask) {
    uint8_t c = m->ctrl[i];
    if (!c) return NULL;
    if (c == tag && m->slots[i].key == key) return &m->slots[i];
  }
}

pd_map_slot *pd_map_u64_add(pd_map *m, uint64_t h, uint64_t key, uint64_t val) {
  if (!room(m)) return NULL;
  return fill(m, key, (uint32_t)h, 0, val);
}

pd_map_slot *pd_map_u64_put(pd_map *m, uint64_t h, uint64_t key, uint64_t val) {
  pd_map_slot *s = pd_map_u64_find(m, h, key);
  if (s) {
    s->val = val;
    return s;
  }
  return pd_map_u64_add(m, h, key, val);
}

/* ---- removal and iteration ---- */

void pd_map_remove(pd_map *m, pd_map_slot *s) {
  const uint32_t mask = m->mask;
  uint32_t hole = (uint32_t)(s - m->slots);
  if (m->flags & PD_MAP_COPY_KEYS) free((void *)(uintptr_t)s->key);
  /* Later entries of the run move up into the hole unless their home lies after it: an entry
   * at j may sit at hole when its probe distance (j - home) is at least (j - hole). */
  for (uint32_t j = (hole + 1) & mask; m->ctrl[j]; j = (j + 1) & mask) {
    uint32_t home = m->slots[j].hash & mask;
    if (((j - home) & mask) >= ((j - hole) & mask)) {
      m->slots[hole] = m->slots[j];
      m->ctrl[hole] = m->ctrl[j];
      hole = j;
    }
  }
  m->slots[hole] = (pd_map_slot){0};
  m->ctrl[hole] = 0;
  m->n--;
}

pd_map_slot *pd_map_next(const pd_map *m, pd_map_it *it) {
  if (!m->slots) return NULL;
  if (!it->started) {
    uint32_t e = 0;
    while (m->ctrl[e]) e++;
    it->i = e;
    it->left = m->mask + 1;
    it->started = true;
  }
  while (it->left) {
    it->i = (it->i + 1) & m->mask;
    it->left--;
    if (m->ctrl[it->i]) return &m->slots[it->i];
  }
  return NULL;
}

void pd_map_it_remove(pd_map *m, pd_map_it *it) {
  pd_map_remove(m, &m->slots[it->i]);
  /* The slot may now hold an entry shifted back from later in the run: look at it again. */
  it->i = (it->i - 1) & m->mask;
  it->left++;
}
