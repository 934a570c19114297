/* pd_map: the program's one hash map (redis has dict.c; we have this). Open addressing with
 * linear probing, at most half full, backward-shift deletion (no tombstones, so a map with
 * steady churn, like the router's request ids, never degrades or rehashes in place).
 *
 * Keys are byte strings or 64-bit integers (one kind per map); values are 64-bit (an id, an
 * index, or a pointer through uintptr_t). The caller supplies each key's 64-bit hash, so a hot
 * path can hash once for several maps, reuse a hash it already has (the KV cache's block hash)
 * or inline the hash function; the map keeps the low 32 bits of it (home slot and a filter
 * before the key compare) and never hashes by itself. Use pd_map_hash (XXH3, libxxhash) for
 * strings and pd_map_hash_u64 for integers unless the key is a good hash already.
 *
 *   pd_map m;
 *   pd_map_init(&m, 0, PD_MAP_COPY_KEYS);
 *   pd_map_cstr_put(&m, "node-1", (uintptr_t)node);            NULL: out of memory
 *   pd_map_slot *s = pd_map_cstr_find(&m, "node-1");           s->val, or NULL
 *   pd_map_cstr_del(&m, "node-1");
 *   for (pd_map_it it = {0}; (s = pd_map_next(&m, &it));) ...  every entry, in slot order
 *   pd_map_free(&m);
 *
 * String keys are borrowed by default (they must stay put while in the map: the tokenizer's
 * arena-held vocabulary) or copied with PD_MAP_COPY_KEYS (freed on removal). Slot pointers stay
 * valid until the next insertion or removal. Not thread-safe: one owner, like every user. */
#ifndef PD_MAP_H
#define PD_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <xxhash.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_map_slot {
  uint64_t key;  /* integer key, or the address of a string key's bytes */
  uint32_t hash; /* low 32 bits of the key's hash: home slot = hash & mask */
  uint32_t len1; /* string key: its length + 1; integer key and empty slot: 0 */
  uint64_t val;
} pd_map_slot;

/* ctrl[i] is 0 for an empty slot, else 0x80 | 7 bits of the hash. Integer lookups probe these
 * bytes and read a slot only where the tag matches: a miss rarely leaves them, and they stay in
 * cache (1 byte a slot: 512 KiB for the 151k merges of Qwen3, whose 12 MiB of slots do not).
 * String lookups probe the slots themselves, whose hash, length and key address share a line:
 * a hit then costs one slot and the key's bytes. (Measured on the tokenizer: integer probes
 * through the slots lost 2-4% of encoding speed; string probes through the control bytes lost
 * 2-9% of load time.) */
typedef struct pd_map {
  pd_map_slot *slots; /* [mask + 1], a power of two; NULL until the first insertion */
  uint8_t *ctrl;      /* [mask + 1], in the same allocation as slots */
  uint32_t mask;
  uint32_t n;     /* entries; n * 2 <= mask + 1 */
  unsigned flags; /* PD_MAP_COPY_KEYS */
} pd_map;

#define PD_MAP_COPY_KEYS 1u /* string keys are copied at insertion and freed by the map */
#define PD_MAP_MAX ((size_t)1 << 30)

/* Room for `expected` entries without growing (0: allocate at the first insertion). false on
 * allocation failure or expected > PD_MAP_MAX; the map is then empty and valid. */
bool pd_map_init(pd_map *m, size_t expected, unsigned flags);
/* Frees the table (and copied keys). The map is then empty and can be used again. */
void pd_map_free(pd_map *m);
/* Grows the table so that n entries fit without growing again; false on allocation failure
 * (the map is unchanged). */
bool pd_map_reserve(pd_map *m, size_t n);
static inline size_t pd_map_count(const pd_map *m) { return m->n; }

/* ---- string keys (bytes [0, len), any bytes; h = the caller's hash of exactly them) ---- */
pd_map_slot *pd_map_str_find(const pd_map *m, uint64_t h, const void *key, size_t len);
/* Inserts key or overwrites its value; the entry's slot, or NULL on allocation failure or
 * len >= UINT32_MAX (the map is unchanged). */
pd_map_slot *pd_map_str_put(pd_map *m, uint64_t h, const void *key, size_t len, uint64_t val);
static inline const char *pd_map_str_key(const pd_map_slot *s) {
  return (const char *)(uintptr_t)s->key;
}
static inline size_t pd_map_str_len(const pd_map_slot *s) { return s->len1 - 1; }

/* ---- integer keys ---- */
pd_map_slot *pd_map_u64_find(const pd_map *m, uint64_t h, uint64_t key);
/* Inserts key or overwrites its value; NULL on allocation failure. */
pd_map_slot *pd_map_u64_put(pd_map *m, uint64_t h, uint64_t key, uint64_t val);
/* Multimap use: always adds an entry, even when key is present; walk a key's entries with
 * pd_map_u64_find, then pd_map_u64_next (NULL after the last). NULL on allocation failure. */
pd_map_slot *pd_map_u64_add(pd_map *m, uint64_t h, uint64_t key, uint64_t val);
/* The next entry of key after `after` (an entry of key). */
pd_map_slot *pd_map_u64_next(const pd_map *m, const pd_map_slot *after, uint64_t key);

/* Removes the entry at s (from a find, put or pd_map_next); frees a copied key. */
void pd_map_remove(pd_map *m, pd_map_slot *s);

/* ---- iteration: for (pd_map_it it = {0}; (s = pd_map_next(m, &it));) ----
 * Every entry once, in slot order. The walk starts after an empty slot, so that no probe run
 * wraps across its start: then removing the entry just returned (pd_map_it_remove, and no other
 * change) neither skips an entry nor shows one twice. */
typedef struct pd_map_it {
  uint32_t i;    /* slot last returned */
  uint32_t left; /* slots still to look at */
  bool started;
} pd_map_it;
pd_map_slot *pd_map_next(const pd_map *m, pd_map_it *it);
/* Removes the entry pd_map_next just returned; the walk goes on with the next one. */
void pd_map_it_remove(pd_map *m, pd_map_it *it);

/* ---- hashes ---- */
static inline uint64_t pd_map_hash(const void *s, size_t n) { return XXH3_64bits(s, n); }
/* A bijective mix (splitmix64's finalizer): consecutive integers land far apart. */
static inline uint64_t pd_map_hash_u64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* ---- NUL-terminated string keys hashed with pd_map_hash ---- */
static inline pd_map_slot *pd_map_cstr_find(const pd_map *m, const char *key) {
  size_t n = strlen(key);
  return pd_map_str_find(m, pd_map_hash(key, n), key, n);
}
static inline pd_map_slot *pd_map_cstr_put(pd_map *m, const char *key, uint64_t val) {
  size_t n = strlen(key);
  return pd_map_str_put(m, pd_map_hash(key, n), key, n, val);
}
/* Removes key; whether it was there. */
static inline bool pd_map_cstr_del(pd_map *m, const char *key) {
  pd_map_slot *s = pd_map_cstr_find(m, key);
  if (s) pd_map_remove(m, s);
  return s != NULL;
}
static inline void *pd_map_ptr(const pd_map_slot *s) { return s ? (void *)(uintptr_t)s->val : NULL; }

#ifdef __cplusplus
}
#endif
#endif
