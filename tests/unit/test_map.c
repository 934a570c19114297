/* pd_map (pd/map.h): string and integer keys, insertion, lookup, overwrite, removal, growth,
 * collisions (the caller supplies the hash, so a test can make every key collide), iteration
 * with removal, multimap use, and random operations against a plain array. */
#include "pd/map.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_test.h"

/* Every entry sits in the probe run of its home slot (no empty slot between), and the count
 * is right: what backward-shift deletion must preserve. */
static void check_table(const pd_map *m) {
  if (!m->slots) {
    CHECK(m->n == 0);
    return;
  }
  size_t used = 0;
  for (uint32_t i = 0; i <= m->mask; i++) {
    if (!m->ctrl[i]) continue;
    used++;
    for (uint32_t j = m->slots[i].hash & m->mask; j != i; j = (j + 1) & m->mask)
      if (!m->ctrl[j]) {
        CHECKF(0, "slot %u: empty slot %u inside its probe run", i, j);
        return;
      }
  }
  CHECK(used == m->n);
  CHECK(2 * (size_t)m->n <= (size_t)m->mask + 1);
}

static void test_empty(void) {
  pd_map m;
  REQUIRE(pd_map_init(&m, 0, 0));
  CHECK(m.slots == NULL && pd_map_count(&m) == 0);
  CHECK(pd_map_str_find(&m, pd_map_hash("a", 1), "a", 1) == NULL);
  CHECK(pd_map_u64_find(&m, pd_map_hash_u64(0), 0) == NULL);
  CHECK(pd_map_cstr_find(&m, "") == NULL);
  CHECK(!pd_map_cstr_del(&m, "x"));
  pd_map_it it = {0};
  CHECK(pd_map_next(&m, &it) == NULL);
  pd_map_free(&m);
  pd_map_free(&m); /* twice is fine */
  CHECK(!pd_map_init(&m, PD_MAP_MAX + 1, 0));
  CHECK(m.slots == NULL);
  CHECK(pd_map_str_put(&m, 0, "x", (size_t)UINT32_MAX, 1) == NULL);
  CHECK(pd_map_str_find(&m, 0, "x", (size_t)UINT32_MAX) == NULL);
  CHECK(pd_map_count(&m) == 0);
  pd_map_free(&m);
}

/* Borrowed string keys, including the empty key, keys with NUL bytes and prefixes of others. */
static void test_strings(void) {
  enum { N = 20000 };
  static char keys[N][16];
  pd_map m;
  REQUIRE(pd_map_init(&m, 0, 0));
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "k%d", i);
    size_t n = strlen(keys[i]);
    pd_map_slot *s = pd_map_str_put(&m, pd_map_hash(keys[i], n), keys[i], n, (uint64_t)i);
    REQUIRE(s);
    CHECK(pd_map_str_key(s) == keys[i] && pd_map_str_len(s) == n && s->val == (uint64_t)i);
  }
  CHECK(pd_map_count(&m) == N);
  check_table(&m);
  for (int i = 0; i < N; i++) {
    pd_map_slot *s = pd_map_cstr_find(&m, keys[i]);
    CHECKF(s && s->val == (uint64_t)i, "k%d", i);
  }
  /* Lookups by bytes that are not NUL-terminated, and misses. */
  char buf[] = "k123xyz";
  pd_map_slot *s = pd_map_str_find(&m, pd_map_hash(buf, 4), buf, 4);
  CHECK(s && s->val == 123);
  CHECK(pd_map_str_find(&m, pd_map_hash(buf, 5), buf, 5) == NULL);
  CHECK(pd_map_cstr_find(&m, "k") == NULL && pd_map_cstr_find(&m, "k20000") == NULL);
  /* Overwrite keeps one entry. */
  REQUIRE(pd_map_cstr_put(&m, keys[7], 700));
  CHECK(pd_map_count(&m) == N && pd_map_cstr_find(&m, "k7")->val == 700);
  /* The empty key and keys holding NUL bytes are keys like any other. */
  static const char nul1[] = {'a', 0, 'b'}, nul2[] = {'a', 0, 'c'};
  REQUIRE(pd_map_str_put(&m, pd_map_hash("", 0), "", 0, 1));
  REQUIRE(pd_map_str_put(&m, pd_map_hash(nul1, 3), nul1, 3, 2));
  REQUIRE(pd_map_str_put(&m, pd_map_hash(nul2, 3), nul2, 3, 3));
  CHECK(pd_map_str_find(&m, pd_map_hash("", 0), "", 0)->val == 1);
  CHECK(pd_map_str_find(&m, pd_map_hash(nul1, 3), nul1, 3)->val == 2);
  CHECK(pd_map_str_find(&m, pd_map_hash(nul2, 3), nul2, 3)->val == 3);
  CHECK(pd_map_cstr_find(&m, "a") == NULL); /* "a" is a prefix of nul1 up to its NUL */
  /* Remove half, the rest stays. */
  for (int i = 0; i < N; i += 2) CHECK(pd_map_cstr_del(&m, keys[i]));
  CHECK(!pd_map_cstr_del(&m, keys[0]));
  CHECK(pd_map_count(&m) == N / 2 + 3);
  check_table(&m);
  for (int i = 0; i < N; i++) {
    s = pd_map_cstr_find(&m, keys[i]);
    CHECKF(i % 2 ? s && s->val == (uint64_t)(i == 7 ? 700 : i) : s == NULL, "k%d", i);
  }
  pd_map_free(&m);
  CHECK(pd_map_count(&m) == 0 && pd_map_cstr_find(&m, "k1") == NULL);
}

/* PD_MAP_COPY_KEYS: the map owns its keys (ASan reports a leak or a use after free here). */
static void test_copied_keys(void) {
  pd_map m;
  REQUIRE(pd_map_init(&m, 4, PD_MAP_COPY_KEYS));
  char buf[32];
  for (int i = 0; i < 1000; i++) {
    snprintf(buf, sizeof buf, "request-%d", i);
    REQUIRE(pd_map_cstr_put(&m, buf, 0) != NULL);
    pd_map_slot *s = pd_map_cstr_find(&m, buf);
    REQUIRE(s);
    CHECK(pd_map_str_key(s) != buf && strcmp(pd_map_str_key(s), buf) == 0); /* NUL-terminated */
    s->val = (uint64_t)i;
  }
  memset(buf, 'z', sizeof buf - 1); /* the caller's buffer is gone */
  for (int i = 0; i < 1000; i++) {
    snprintf(buf, sizeof buf, "request-%d", i);
    pd_map_slot *s = pd_map_cstr_find(&m, buf);
    CHECKF(s && s->val == (uint64_t)i, "%s", buf);
    if (i % 3 == 0) CHECK(pd_map_cstr_del(&m, buf));
  }
  REQUIRE(pd_map_cstr_put(&m, "request-1", 5)); /* overwrite keeps the first copy */
  CHECK(pd_map_count(&m) == 1000 - 334);
  check_table(&m);
  pd_map_free(&m); /* frees the remaining copies */
}

static void test_u64(void) {
  pd_map m;
  REQUIRE(pd_map_init(&m, 0, 0));
  const uint64_t special[] = {0, 1, UINT64_MAX, (uint64_t)1 << 63, 0xffffffff};
  for (int i = 0; i < 5; i++) REQUIRE(pd_map_u64_put(&m, pd_map_hash_u64(special[i]), special[i], (uint64_t)i));
  for (int i = 0; i < 5; i++) {
    pd_map_slot *s = pd_map_u64_find(&m, pd_map_hash_u64(special[i]), special[i]);
    CHECK(s && s->key == special[i] && s->val == (uint64_t)i);
  }
  /* Growth from 16 slots to many, consecutive keys (the merge table's (left, right) pairs). */
  for (uint64_t k = 2; k < 100000; k++) REQUIRE(pd_map_u64_put(&m, pd_map_hash_u64(k << 32 | k), k << 32 | k, k));
  check_table(&m);
  CHECK(pd_map_count(&m) == 5 + 99998);
  for (uint64_t k = 2; k < 100000; k++) {
    pd_map_slot *s = pd_map_u64_find(&m, pd_map_hash_u64(k << 32 | k), k << 32 | k);
    CHECKF(s && s->val == k, "%llu", (unsigned long long)k);
  }
  CHECK(pd_map_u64_find(&m, pd_map_hash_u64(2), 2) == NULL);
  pd_map_free(&m);

  /* reserve: no reallocation up to the reserved count. */
  REQUIRE(pd_map_init(&m, 1000, 0));
  pd_map_slot *t = m.slots;
  for (uint64_t k = 0; k < 1000; k++) REQUIRE(pd_map_u64_put(&m, pd_map_hash_u64(k), k, k));
  CHECK(m.slots == t);
  REQUIRE(pd_map_reserve(&m, 10)); /* smaller than what it has: nothing changes */
  CHECK(m.slots == t);
  REQUIRE(pd_map_reserve(&m, 5000));
  CHECK(m.mask + 1 >= 10000);
  for (uint64_t k = 0; k < 1000; k++) CHECK(pd_map_u64_find(&m, pd_map_hash_u64(k), k)->val == k);
  pd_map_free(&m);
}

/* Every key hashes alike: one long probe run, which also wraps past the table's end. */
static void test_collisions(void) {
  for (int home = 0; home < 2; home++) {
    pd_map m;
    REQUIRE(pd_map_init(&m, 300, 0)); /* 1024 slots */
    uint64_t h = home ? 1023 : 5;     /* 1023: the run starts at the last slot and wraps */
    for (uint64_t k = 0; k < 300; k++) REQUIRE(pd_map_u64_put(&m, h, k, k * 10));
    check_table(&m);
    for (uint64_t k = 0; k < 300; k += 3) {
      pd_map_slot *s = pd_map_u64_find(&m, h, k);
      REQUIRE(s);
      pd_map_remove(&m, s);
      check_table(&m);
    }
    for (uint64_t k = 0; k < 300; k++) {
      pd_map_slot *s = pd_map_u64_find(&m, h, k);
      CHECKF(k % 3 ? s && s->val == k * 10 : s == NULL, "home %d key %llu", home,
             (unsigned long long)k);
    }
    /* Strings that collide in all 64 bits are told apart by their bytes. */
    pd_map sm;
    REQUIRE(pd_map_init(&sm, 0, PD_MAP_COPY_KEYS));
    char buf[16];
    for (int i = 0; i < 200; i++) {
      snprintf(buf, sizeof buf, "%d", i);
      REQUIRE(pd_map_str_put(&sm, h, buf, strlen(buf), (uint64_t)i));
    }
    for (int i = 0; i < 200; i++) {
      snprintf(buf, sizeof buf, "%d", i);
      pd_map_slot *s = pd_map_str_find(&sm, h, buf, strlen(buf));
      CHECK(s && s->val == (uint64_t)i);
    }
    check_table(&sm);
    pd_map_free(&sm);
    pd_map_free(&m);
  }
}

/* Iteration sees every entry once; removing the current entry (also inside a run that wraps
 * past the end of the table) skips nothing and repeats nothing. */
static void test_iteration(void) {
  for (int weak = 0; weak < 3; weak++) {
    pd_map m;
    REQUIRE(pd_map_init(&m, 0, 0));
    enum { N = 3000 };
    static uint8_t seen[N];
    for (uint64_t k = 0; k < N; k++) {
      /* weak 1: clusters of 8 keys per hash; weak 2: clusters homed at the end of the table */
      uint64_t h = weak == 0 ? pd_map_hash_u64(k) : weak == 1 ? k / 8 : ~(k % 4);
      REQUIRE(pd_map_u64_put(&m, h, k, h));
    }
    memset(seen, 0, sizeof seen);
    pd_map_slot *s;
    size_t visits = 0;
    for (pd_map_it it = {0}; (s = pd_map_next(&m, &it));) {
      seen[s->key]++;
      visits++;
    }
    CHECK(visits == N);
    for (int k = 0; k < N; k++) CHECKF(seen[k] == 1, "weak %d key %d seen %d times", weak, k, seen[k]);
    memset(seen, 0, sizeof seen);
    visits = 0;
    for (pd_map_it it = {0}; (s = pd_map_next(&m, &it));) {
      seen[s->key]++;
      visits++;
      if (s->key % 2) pd_map_it_remove(&m, &it);
    }
    CHECK(visits == N);
    for (int k = 0; k < N; k++) CHECKF(seen[k] == 1, "weak %d key %d seen %d times", weak, k, seen[k]);
    CHECK(pd_map_count(&m) == N / 2);
    check_table(&m);
    for (uint64_t k = 0; k < N; k++) {
      uint64_t h = weak == 0 ? pd_map_hash_u64(k) : weak == 1 ? k / 8 : ~(k % 4);
      CHECK((pd_map_u64_find(&m, h, k) != NULL) == (k % 2 == 0));
    }
    /* Removing everything while iterating empties the map. */
    for (pd_map_it it = {0}; (s = pd_map_next(&m, &it));) pd_map_it_remove(&m, &it);
    CHECK(pd_map_count(&m) == 0);
    pd_map_free(&m);
  }
}

/* Multimap: equal keys added several times, walked with find + next, removed one by one. */
static void test_multimap(void) {
  pd_map m;
  REQUIRE(pd_map_init(&m, 0, 0));
  for (uint64_t v = 0; v < 5; v++) REQUIRE(pd_map_u64_add(&m, 77, 42, v));
  for (uint64_t k = 0; k < 50; k++) REQUIRE(pd_map_u64_add(&m, 77, k + 100, k)); /* same run */
  REQUIRE(pd_map_u64_add(&m, pd_map_hash_u64(9), 9, 9));
  unsigned mask = 0;
  int count = 0;
  for (pd_map_slot *s = pd_map_u64_find(&m, 77, 42); s; s = pd_map_u64_next(&m, s, 42)) {
    CHECK(s->key == 42);
    mask |= 1u << s->val;
    count++;
  }
  CHECK(count == 5 && mask == 0x1f);
  /* Remove the entry holding 3. */
  pd_map_slot *s = pd_map_u64_find(&m, 77, 42);
  while (s && s->val != 3) s = pd_map_u64_next(&m, s, 42);
  REQUIRE(s);
  pd_map_remove(&m, s);
  check_table(&m);
  mask = 0, count = 0;
  for (s = pd_map_u64_find(&m, 77, 42); s; s = pd_map_u64_next(&m, s, 42)) mask |= 1u << s->val, count++;
  CHECK(count == 4 && mask == 0x17);
  CHECK(pd_map_count(&m) == 55);
  pd_map_free(&m);
}

/* Random inserts, overwrites, removals and lookups against a plain array of the live keys,
 * with a good hash and with a poor one (long runs, many equal 32-bit hashes). */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static void test_random(void) {
  enum { KEYS = 4096 };
#ifdef PD_SANITIZED
  const int ops = 60000;
#else
  const int ops = 400000;
#endif
  static int64_t ref[KEYS]; /* value, or -1 when absent */
  static char names[KEYS][12];
  for (int i = 0; i < KEYS; i++) snprintf(names[i], sizeof names[i], "n%x", i * 7919);
  for (int mode = 0; mode < 4; mode++) { /* 0, 1: u64 good / poor hash; 2, 3: strings */
    pd_map m;
    REQUIRE(pd_map_init(&m, 0, mode == 3 ? PD_MAP_COPY_KEYS : 0));
    for (int i = 0; i < KEYS; i++) ref[i] = -1;
    size_t live = 0;
    for (int op = 0; op < ops; op++) {
      int k = (int)(rnd() % KEYS), what = (int)(rnd() % 8);
      uint64_t h = mode == 1 ? (uint64_t)(k % 37) << 32 | (uint64_t)(k % 13)
                   : mode >= 2 ? pd_map_hash(names[k], strlen(names[k]))
                               : pd_map_hash_u64((uint64_t)k);
      pd_map_slot *s = mode >= 2 ? pd_map_str_find(&m, h, names[k], strlen(names[k]))
                                 : pd_map_u64_find(&m, h, (uint64_t)k);
      CHECKF((s != NULL) == (ref[k] >= 0), "mode %d op %d key %d", mode, op, k);
      if (s && ref[k] >= 0) CHECK(s->val == (uint64_t)ref[k]);
      if (what < 4) { /* put */
        uint64_t v = rnd() & 0xffffff;
        s = mode >= 2 ? pd_map_str_put(&m, h, names[k], strlen(names[k]), v)
                      : pd_map_u64_put(&m, h, (uint64_t)k, v);
        REQUIRE(s);
        if (ref[k] < 0) live++;
        ref[k] = (int64_t)v;
      } else if (what < 7 && s) { /* remove */
        pd_map_remove(&m, s);
        ref[k] = -1;
        live--;
      }
      if (pd_map_count(&m) != live) {
        CHECKF(0, "mode %d op %d: count %zu, expected %zu", mode, op, pd_map_count(&m), live);
        break;
      }
      if (op % 20000 == 0) check_table(&m);
    }
    check_table(&m);
    pd_map_slot *s;
    size_t n = 0;
    for (pd_map_it it = {0}; (s = pd_map_next(&m, &it));) n++;
    CHECK(n == live);
    pd_map_free(&m);
  }
}

int main(void) {
  test_empty();
  test_strings();
  test_copied_keys();
  test_u64();
  test_collisions();
  test_iteration();
  test_multimap();
  test_random();
  return pd_test_finish("test_map");
}
