/* Unit tests of the block KV cache manager (common/kvcache): allocation and release without
 * leaks, prefix reuse, partial blocks never shared, LRU eviction order, eviction only when
 * needed, PD_EFULL without side effects, copy-on-write, pinned copy sources, dedupe, truncation,
 * prefix-cache reset, salts, and hash-collision safety under an injected weak hash.
 *
 * pd_kv_pool_check runs after every operation. A fake backend (one int64 per slot) stands in
 * for the K/V tensors: a slot's value is a hash of the cache salt and the token prefix ending
 * at that position, which is exactly what real KV depends on, so any wrong reuse, missing copy
 * or write into a shared block shows up as a wrong value when each sequence is verified. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/kvcache.h"

#define EXPECT(c)                                                       \
  do {                                                                  \
    if (!(c)) {                                                         \
      fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #c);   \
      exit(1);                                                          \
    }                                                                   \
  } while (0)

#define EXPECT_OK(call)                                                              \
  do {                                                                               \
    pd_err e_ = {0};                                                                 \
    pd_status st_ = (call);                                                          \
    (void)e_;                                                                        \
    if (st_ != PD_OK) {                                                              \
      fprintf(stderr, "%s:%d: FAILED: %s -> %s\n", __FILE__, __LINE__, #call,        \
              pd_status_str(st_));                                                   \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

static void inv(const pd_kv_pool *p) {
  pd_err e = {0};
  if (pd_kv_pool_check(p, &e) != PD_OK) {
    fprintf(stderr, "invariant broken: %s\n", e.msg);
    exit(1);
  }
}

/* ---- fake backend ------------------------------------------------------------------------ */

typedef struct fake_kv {
  int bs;
  int64_t *slot; /* [num_blocks * block_size] */
  int n_slots;
} fake_kv;

static fake_kv fake_new(const pd_kv_pool *p) {
  fake_kv f;
  f.bs = pd_kv_pool_block_size(p);
  f.n_slots = pd_kv_pool_num_blocks(p) * f.bs;
  f.slot = calloc((size_t)f.n_slots, sizeof *f.slot);
  EXPECT(f.slot);
  return f;
}

/* FNV-1a over (salt, tokens[0..pos]): the "KV" of position pos. */
static int64_t kv_value(uint64_t salt, const int32_t *tok, int pos) {
  uint64_t h = 1469598103934665603ULL ^ salt;
  for (int i = 0; i <= pos; i++) {
    uint32_t t = (uint32_t)tok[i];
    for (int b = 0; b < 4; b++) {
      h ^= (t >> (8 * b)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  return (int64_t)(h | 1); /* never 0, the value of an unwritten slot */
}

static void fake_copies(fake_kv *f, pd_kv_pool *p, bool reverse) {
  const pd_kv_copy *c;
  int n = pd_kv_pool_copies(p, &c);
  for (int k = 0; k < n; k++) {
    const pd_kv_copy *x = &c[reverse ? n - 1 - k : k];
    memcpy(f->slot + (size_t)x->dst * f->bs, f->slot + (size_t)x->src * f->bs,
           (size_t)f->bs * sizeof *f->slot);
  }
  pd_kv_pool_copies_done(p);
}

/* The forward pass's KV writes for slots of positions [start, start + n). */
static void fake_write(fake_kv *f, const pd_kv_seq *s, int start, int n, const int32_t *slots) {
  for (int k = 0; k < n; k++) {
    if (slots[k] < 0) continue;
    EXPECT(slots[k] < f->n_slots);
    f->slot[slots[k]] = kv_value(pd_kv_seq_cache_salt(s), pd_kv_seq_tokens(s), start + k);
  }
}

/* Every computed position of s holds its own KV. */
static void fake_verify(const fake_kv *f, const pd_kv_seq *s) {
  const int32_t *tab = pd_kv_seq_block_table(s);
  for (int pos = 0; pos < pd_kv_seq_num_computed(s); pos++) {
    int slot = tab[pos / f->bs] * f->bs + pos % f->bs;
    if (f->slot[slot] != kv_value(pd_kv_seq_cache_salt(s), pd_kv_seq_tokens(s), pos)) {
      fprintf(stderr, "wrong KV at position %d (slot %d)\n", pos, slot);
      exit(1);
    }
  }
}

/* allocate n -> copies -> writes -> commit n, as one engine step of one sequence. */
#define step(f, p, s, n) step_at(__LINE__, f, p, s, n)
static void step_at(int line, fake_kv *f, pd_kv_pool *p, pd_kv_seq *s, int n) {
  int32_t slots[256];
  EXPECT(n <= 256);
  pd_err e = {0};
  if (pd_kv_seq_allocate(s, n, slots, &e) != PD_OK) {
    fprintf(stderr, "%s:%d: allocate(%d): %s\n", __FILE__, line, n, e.msg);
    exit(1);
  }
  int start = pd_kv_seq_num_computed(s);
  inv(p);
  fake_copies(f, p, false);
  fake_write(f, s, start, n, slots);
  EXPECT_OK(pd_kv_seq_commit(s, n, &e_));
  inv(p);
  fake_verify(f, s);
}

static pd_kv_pool *pool_new(int num_blocks, int bs, bool prefix, pd_kv_hash_fn fn) {
  pd_kv_pool_opts o = {0};
  o.num_blocks = num_blocks;
  o.block_size = bs;
  o.disable_prefix_caching = !prefix;
  o.salt = "test-model";
  o.salt_len = 10;
  o.hash_fn = fn;
  pd_err e = {0};
  pd_kv_pool *p = pd_kv_pool_create(&o, &e);
  if (!p) fprintf(stderr, "pool create: %s\n", e.msg);
  EXPECT(p);
  inv(p);
  return p;
}

static pd_kv_seq *seq_new(pd_kv_pool *p, const int32_t *t, int n, uint64_t salt) {
  pd_err e = {0};
  pd_kv_seq *s = pd_kv_seq_create(p, t, n, salt, &e);
  EXPECT(s);
  inv(p);
  return s;
}

static pd_kv_stats stats(const pd_kv_pool *p) {
  pd_kv_stats st;
  pd_kv_pool_stats(p, &st);
  return st;
}

static void seq_range(int32_t *t, int n, int32_t first) {
  for (int i = 0; i < n; i++) t[i] = first + i;
}

/* ---- tests ------------------------------------------------------------------------------- */

/* XXH64 vectors from the reference implementation (python-xxhash 3.x). */
static void test_hash_vectors(void) {
  EXPECT(pd_kv_hash_root(NULL, 0, 0) == 0xef46db3751d8e999ULL);
  EXPECT(pd_kv_hash_root("abc", 3, 0) == 0x44bc2cf5ad770999ULL);
  EXPECT(pd_kv_hash_root("pdserve-test-salt", 17, 0) == 0xe06d8773fb635407ULL);
  EXPECT(pd_kv_hash_root("pdserve-test-salt", 17, 42) == 0xa3c2e8c0115d6663ULL);
  uint8_t bytes[45];
  for (int i = 0; i < 45; i++) bytes[i] = (uint8_t)i;
  EXPECT(pd_kv_hash_root(bytes, 40, 0) == 0xf5da40f1b11741e9ULL);
  EXPECT(pd_kv_hash_root(bytes, 45, 0) == 0x10fdd84d6409abdfULL);
  int32_t t[37];
  seq_range(t, 37, 1);
  EXPECT(pd_kv_hash_block(0x0123456789abcdefULL, t, 37) == 0x44f1aabaa97b2afcULL);
  const int32_t odd[5] = {-1, 7, 151643, 0, 2147483647};
  EXPECT(pd_kv_hash_block(0xfffffffffffffff0ULL, odd, 5) == 0xce9acd140ffdfe7dULL);
  seq_range(t, 16, 100);
  EXPECT(pd_kv_hash_block(12345, t, 16) == 0x81710bd1d025a656ULL);
}

static void test_sizing(void) {
  /* 2 (K,V) * 2 layers * 4 heads * 16 tokens * 64 dims * 2 bytes */
  EXPECT(pd_kv_block_bytes(2, 4, 64, 16, PD_DTYPE_F16) == 32768);
  EXPECT(pd_kv_block_bytes(1, 1, 1, 1, PD_DTYPE_F32) == 8);
  EXPECT(pd_kv_block_bytes(0, 4, 64, 16, PD_DTYPE_F16) == 0);
  EXPECT(pd_kv_block_bytes(1 << 30, 1 << 30, 1 << 30, 1 << 30, PD_DTYPE_F32) == 0); /* overflow */
  EXPECT(pd_kv_block_bytes(1, 1, 1, 1, PD_DTYPE_COUNT) == 0);
  EXPECT(pd_kv_num_blocks_for_budget(1000000, 32768, 16) == 30);
  EXPECT(pd_kv_num_blocks_for_budget(32767, 32768, 16) == 0);
  EXPECT(pd_kv_num_blocks_for_budget(SIZE_MAX, 1, 16) == 2147483647 / 16);
  EXPECT(pd_kv_num_blocks_for_budget(100, 0, 16) == 0);

  pd_kv_pool_opts o = {0};
  pd_err e = {0};
  o.num_blocks = 0;
  EXPECT(pd_kv_pool_create(&o, &e) == NULL && e.code == PD_EINVAL);
  o.num_blocks = 2147483647 / 16 + 1; /* slot ids would overflow int32 */
  EXPECT(pd_kv_pool_create(&o, &e) == NULL && e.code == PD_EINVAL);
  o.num_blocks = 10;
  pd_kv_pool *p = pd_kv_pool_create(&o, &e);
  EXPECT(p && pd_kv_pool_block_size(p) == PD_KV_DEFAULT_BLOCK_SIZE);
  EXPECT(pd_kv_pool_blocks_for_tokens(p, 0) == 0 && pd_kv_pool_blocks_for_tokens(p, 16) == 1 &&
         pd_kv_pool_blocks_for_tokens(p, 17) == 2);
  pd_kv_pool_free(p);
}

static void test_alloc_free(bool prefix) {
  pd_kv_pool *p = pool_new(8, 4, prefix, NULL);
  fake_kv f = fake_new(p);
  int32_t t[16], slots[16];
  seq_range(t, 10, 1);
  pd_kv_seq *s = seq_new(p, t, 10, 0);
  EXPECT(pd_kv_seq_num_tokens(s) == 10 && pd_kv_seq_num_blocks(s) == 0);
  EXPECT(pd_kv_seq_blocks_needed(s, 10) == 3);
  EXPECT(pd_kv_seq_blocks_needed(s, 11) == -1);
  pd_err e = {0};
  EXPECT(pd_kv_seq_allocate(s, 11, slots, &e) == PD_EINVAL); /* more than the tokens */
  inv(p);
  EXPECT_OK(pd_kv_seq_allocate(s, 10, slots, &e_));
  inv(p);
  const int32_t *tab = pd_kv_seq_block_table(s);
  EXPECT(pd_kv_seq_num_blocks(s) == 3);
  EXPECT(tab[0] != tab[1] && tab[1] != tab[2] && tab[0] != tab[2]);
  for (int k = 0; k < 10; k++) EXPECT(slots[k] == tab[k / 4] * 4 + k % 4);
  pd_kv_stats st = stats(p);
  EXPECT(st.used == 3 && st.free == 5 && st.evictable == 0 && st.num_seqs == 1);
  EXPECT(st.usage > 0.374 && st.usage < 0.376);
  EXPECT(pd_kv_seq_commit(s, 11, &e) == PD_EINVAL);
  EXPECT_OK(pd_kv_seq_commit(s, 10, &e_));
  inv(p);
  fake_write(&f, s, 0, 10, slots); /* (write order vs commit does not matter to the fake) */
  fake_verify(&f, s);

  /* decode: one token at a time; a new block only at a block boundary */
  int32_t nt[2] = {77, 78};
  EXPECT_OK(pd_kv_seq_append_tokens(s, nt, 1, &e_));
  EXPECT(pd_kv_seq_blocks_needed(s, 1) == 0);
  step(&f, p, s, 1);
  EXPECT(stats(p).used == 3);
  EXPECT_OK(pd_kv_seq_append_tokens(s, nt, 2, &e_));
  EXPECT(pd_kv_seq_blocks_needed(s, 2) == 1); /* positions 11 and 12 */
  step(&f, p, s, 2);
  EXPECT(stats(p).used == 4 && pd_kv_seq_num_computed(s) == 13);

  pd_kv_seq_free(s);
  inv(p);
  st = stats(p);
  EXPECT(st.used == 0 && st.num_seqs == 0);
  if (prefix) EXPECT(st.evictable == 3 && st.free == 5 && st.cached == 3); /* 3 full blocks */
  else EXPECT(st.evictable == 0 && st.free == 8 && st.cached == 0);
  EXPECT(pd_kv_pool_num_available(p) == 8);
  pd_kv_seq_free(NULL);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_prefix_reuse(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[14], b[14];
  seq_range(a, 14, 10);
  memcpy(b, a, sizeof b);
  for (int i = 10; i < 14; i++) b[i] = 900 + i; /* shares a's first 10 tokens */
  pd_kv_seq *A = seq_new(p, a, 14, 0);
  EXPECT(pd_kv_seq_prefix_hit(A) == 0);
  step(&f, p, A, 14);
  EXPECT(stats(p).cached == 3); /* 12 tokens in full blocks; block 3 is partial */

  pd_kv_seq *B = seq_new(p, b, 14, 0);
  EXPECT(pd_kv_pool_lookup_prefix(p, b, 14, 0) == 8);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 14, 0) == 12);
  EXPECT(pd_kv_seq_prefix_hit(B) == 8);
  EXPECT(pd_kv_seq_blocks_needed(B, 6) == 2); /* hits are in use by A: free of charge */
  EXPECT(pd_kv_seq_blocks_needed(B, 7) == -1);
  step(&f, p, B, 6);
  const int32_t *ta = pd_kv_seq_block_table(A), *tb = pd_kv_seq_block_table(B);
  EXPECT(tb[0] == ta[0] && tb[1] == ta[1] && tb[2] != ta[2] && tb[3] != ta[3]);
  pd_kv_stats st = stats(p);
  EXPECT(st.prefix_queries == 28 && st.prefix_hits == 8);
  EXPECT(st.used == 6);

  /* A goes away: its shared blocks stay with B, its full block 2 becomes evictable, its
   * partial block 3 free. */
  pd_kv_seq_free(A);
  inv(p);
  st = stats(p);
  EXPECT(st.used == 4 && st.evictable == 1 && st.free == 11);

  /* C = a again: all three full blocks hit, one of them out of the LRU. */
  pd_kv_seq *C = seq_new(p, a, 14, 0);
  EXPECT(pd_kv_seq_prefix_hit(C) == 12);
  EXPECT(pd_kv_seq_blocks_needed(C, 2) == 2); /* 1 claimed from the LRU + 1 new */
  int avail = pd_kv_pool_num_available(p);
  step(&f, p, C, 2);
  EXPECT(pd_kv_pool_num_available(p) == avail - 2);
  fake_verify(&f, B);
  st = stats(p);
  EXPECT(st.prefix_hits == 20 && st.evictable == 0);
  pd_kv_seq_free(B);
  pd_kv_seq_free(C);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_partial_not_shared(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[8];
  seq_range(a, 8, 1);
  pd_kv_seq *A = seq_new(p, a, 6, 0);
  step(&f, p, A, 6);
  EXPECT(stats(p).cached == 1);
  pd_kv_seq *B = seq_new(p, a, 6, 0);
  EXPECT(pd_kv_seq_prefix_hit(B) == 4); /* block 1 holds 2 of 4 tokens: never shared */
  step(&f, p, B, 2);
  EXPECT(pd_kv_seq_block_table(B)[0] == pd_kv_seq_block_table(A)[0]);
  EXPECT(pd_kv_seq_block_table(B)[1] != pd_kv_seq_block_table(A)[1]);
  /* A fills its block 1: now it is cached. */
  EXPECT_OK(pd_kv_seq_append_tokens(A, a + 6, 2, &e_));
  step(&f, p, A, 2);
  EXPECT(stats(p).cached == 2);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 8);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 7, 0) == 4); /* lookup only counts whole blocks */
  pd_kv_seq_free(A);
  pd_kv_seq_free(B);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

/* A prompt that is entirely cached: the last token is left to compute and its slot is -1
 * (its KV is already in the shared block). */
static void test_full_prompt_hit(void) {
  pd_kv_pool *p = pool_new(8, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[8];
  seq_range(a, 8, 40);
  pd_kv_seq *A = seq_new(p, a, 8, 0);
  step(&f, p, A, 8);
  pd_kv_seq *B = seq_new(p, a, 8, 0);
  EXPECT(pd_kv_seq_prefix_hit(B) == 7);
  EXPECT(pd_kv_seq_blocks_needed(B, 1) == 0);
  int32_t slot;
  EXPECT_OK(pd_kv_seq_allocate(B, 1, &slot, &e_));
  inv(p);
  EXPECT(slot == -1 && pd_kv_seq_num_computed(B) == 7 && pd_kv_seq_num_blocks(B) == 2);
  EXPECT(pd_kv_seq_block_table(B)[1] == pd_kv_seq_block_table(A)[1]);
  EXPECT_OK(pd_kv_seq_commit(B, 1, &e_));
  inv(p);
  fake_verify(&f, B);
  int32_t nt = 5;
  EXPECT_OK(pd_kv_seq_append_tokens(B, &nt, 1, &e_));
  EXPECT(pd_kv_seq_blocks_needed(B, 1) == 1);
  EXPECT_OK(pd_kv_seq_allocate(B, 1, &slot, &e_));
  EXPECT(slot == pd_kv_seq_block_table(B)[2] * 4);
  EXPECT(stats(p).used == 3);
  pd_kv_seq_free(A);
  pd_kv_seq_free(B);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_lru_order(void) {
  pd_kv_pool *p = pool_new(6, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[9], b[8], c[9], d[5], x[4];
  seq_range(a, 8, 100);
  seq_range(b, 8, 200);
  seq_range(c, 9, 300);
  seq_range(d, 5, 400);
  seq_range(x, 4, 500);
  pd_kv_seq *A = seq_new(p, a, 8, 0), *B = seq_new(p, b, 8, 0), *C = seq_new(p, c, 8, 0);
  step(&f, p, A, 8);
  step(&f, p, B, 8);
  step(&f, p, C, 8);
  EXPECT(pd_kv_pool_num_available(p) == 0);
  pd_kv_seq_free(A);
  inv(p);
  pd_kv_seq_free(B);
  inv(p);
  pd_kv_seq_free(C);
  inv(p);
  /* LRU, oldest first: A1 A0 B1 B0 C1 C0 (each sequence released tail-first). */
  pd_kv_stats st = stats(p);
  EXPECT(st.evictable == 6 && st.free == 0);
  pd_kv_seq *D = seq_new(p, d, 5, 0);
  step(&f, p, D, 5); /* 2 blocks: evicts A1 then A0 */
  EXPECT(stats(p).evictions == 2);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 0);
  EXPECT(pd_kv_pool_lookup_prefix(p, b, 8, 0) == 8);
  EXPECT(pd_kv_pool_lookup_prefix(p, c, 8, 0) == 8);
  pd_kv_seq *X = seq_new(p, x, 4, 0);
  step(&f, p, X, 4); /* evicts B1: B's first block survives its second */
  EXPECT(stats(p).evictions == 3);
  EXPECT(pd_kv_pool_lookup_prefix(p, b, 8, 0) == 4);
  EXPECT(pd_kv_pool_lookup_prefix(p, c, 8, 0) == 8);
  /* Claiming C's blocks takes them out of the LRU: only B0 is left to evict. */
  pd_kv_seq *C2 = seq_new(p, c, 8, 0);
  EXPECT(pd_kv_seq_blocks_needed(C2, 1) == 2);
  step(&f, p, C2, 1);
  st = stats(p);
  EXPECT(st.evictable == 1 && st.free == 0 && st.used == 5);
  /* Releasing C2 puts its blocks back at the MRU end: B0 is evicted next, then C1, C0. */
  pd_kv_seq_free(C2);
  inv(p);
  pd_kv_seq_free(X); /* X0 (full, cached) goes to the MRU end too */
  inv(p);
  EXPECT(pd_kv_pool_lookup_prefix(p, x, 4, 0) == 4);
  int32_t nt[3] = {1, 2, 3};
  EXPECT_OK(pd_kv_seq_append_tokens(D, nt, 3, &e_)); /* D: 8 tokens, needs no block */
  EXPECT_OK(pd_kv_seq_append_tokens(D, nt, 1, &e_)); /* 9th token: one more block */
  EXPECT(pd_kv_seq_blocks_needed(D, 4) == 1);
  step(&f, p, D, 4);
  EXPECT(pd_kv_pool_lookup_prefix(p, b, 8, 0) == 0);
  EXPECT(pd_kv_pool_lookup_prefix(p, c, 8, 0) == 8);
  EXPECT(pd_kv_pool_lookup_prefix(p, x, 4, 0) == 4);
  EXPECT_OK(pd_kv_seq_append_tokens(D, nt, 1, &e_));
  EXPECT_OK(pd_kv_seq_append_tokens(D, nt, 3, &e_));
  step(&f, p, D, 4); /* positions 9..12: one more block, evicts C1 */
  EXPECT(pd_kv_pool_lookup_prefix(p, c, 8, 0) == 4);
  EXPECT(pd_kv_pool_lookup_prefix(p, x, 4, 0) == 4);
  EXPECT(stats(p).evictions == 5);
  pd_kv_seq_free(D);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_evict_only_when_needed(void) {
  pd_kv_pool *p = pool_new(8, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[8], b[16], c[16];
  seq_range(a, 8, 1);
  seq_range(b, 16, 100);
  seq_range(c, 16, 200);
  pd_kv_seq *A = seq_new(p, a, 8, 0);
  step(&f, p, A, 8);
  pd_kv_seq_free(A);
  inv(p);
  EXPECT(stats(p).evictable == 2 && stats(p).free == 6);
  pd_kv_seq *B = seq_new(p, b, 16, 0);
  step(&f, p, B, 16); /* 4 blocks from the free list */
  EXPECT(stats(p).evictions == 0 && pd_kv_pool_lookup_prefix(p, a, 8, 0) == 8);
  pd_kv_seq *C = seq_new(p, c, 12, 0);
  step(&f, p, C, 12); /* 2 free + 1 evicted */
  EXPECT(stats(p).evictions == 1 && pd_kv_pool_lookup_prefix(p, a, 8, 0) == 4);
  /* A's prefix came back: a second request for it reuses A0 without eviction. */
  pd_kv_seq *A2 = seq_new(p, a, 4, 0);
  EXPECT(pd_kv_seq_prefix_hit(A2) == 3);
  EXPECT(pd_kv_seq_blocks_needed(A2, 1) == 1); /* the claim itself takes A0 out of the LRU */
  step(&f, p, A2, 1);
  EXPECT(stats(p).evictions == 1 && stats(p).free == 0 && stats(p).evictable == 0);
  pd_kv_seq_free(A2);
  pd_kv_seq_free(B);
  pd_kv_seq_free(C);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

typedef struct snapshot {
  pd_kv_stats st;
  int n_blocks, n_computed, n_tokens;
  int32_t table[64];
  int lookup;
} snapshot;

static snapshot snap(const pd_kv_pool *p, const pd_kv_seq *s, const int32_t *probe, int n) {
  snapshot x;
  memset(&x, 0, sizeof x);
  pd_kv_pool_stats(p, &x.st);
  x.n_blocks = pd_kv_seq_num_blocks(s);
  x.n_computed = pd_kv_seq_num_computed(s);
  x.n_tokens = pd_kv_seq_num_tokens(s);
  memcpy(x.table, pd_kv_seq_block_table(s), (size_t)x.n_blocks * sizeof(int32_t));
  x.lookup = pd_kv_pool_lookup_prefix(p, probe, n, 0);
  return x;
}

static bool snap_eq(const snapshot *a, const snapshot *b) {
  return memcmp(&a->st, &b->st, sizeof a->st) == 0 && a->n_blocks == b->n_blocks &&
         a->n_computed == b->n_computed && a->n_tokens == b->n_tokens &&
         memcmp(a->table, b->table, (size_t)a->n_blocks * sizeof(int32_t)) == 0 &&
         a->lookup == b->lookup;
}

static void test_efull_no_side_effects(void) {
  pd_kv_pool *p = pool_new(4, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[16], b[8], slots[16];
  seq_range(a, 16, 1);
  seq_range(b, 8, 100);
  pd_kv_seq *A = seq_new(p, a, 8, 0);
  step(&f, p, A, 8);
  pd_kv_seq_free(A);
  pd_kv_seq *B = seq_new(p, b, 8, 0);
  step(&f, p, B, 8); /* 2 free blocks used; A's 2 blocks remain evictable */
  /* C = a's 8 cached tokens + 8 more: 2 claimed from the LRU + 2 new > 2 available. */
  pd_kv_seq *C = seq_new(p, a, 16, 0);
  EXPECT(pd_kv_seq_prefix_hit(C) == 8);
  EXPECT(pd_kv_seq_blocks_needed(C, 8) == 4 && pd_kv_pool_num_available(p) == 2);
  snapshot before = snap(p, C, a, 16), beforeB = snap(p, B, a, 16);
  pd_err e = {0};
  EXPECT(pd_kv_seq_allocate(C, 8, slots, &e) == PD_EFULL);
  EXPECT(e.code == PD_EFULL);
  inv(p);
  snapshot after = snap(p, C, a, 16), afterB = snap(p, B, a, 16);
  EXPECT(snap_eq(&before, &after) && snap_eq(&beforeB, &afterB));
  EXPECT(pd_kv_seq_prefix_hit(C) == 8);
  /* A running sequence that outgrows the pool: EFULL, nothing changes. */
  EXPECT_OK(pd_kv_seq_append_tokens(B, a, 16, &e_));
  EXPECT(pd_kv_seq_blocks_needed(B, 16) == 4);
  before = snap(p, B, a, 16);
  EXPECT(pd_kv_seq_allocate(B, 16, slots, &e) == PD_EFULL);
  inv(p);
  after = snap(p, B, a, 16);
  EXPECT(snap_eq(&before, &after));
  EXPECT(pd_kv_seq_blocks_needed(B, 8) == 2); /* the scheduler can ask for less */
  /* Preempt B: C now fits. */
  pd_kv_seq_free(B);
  inv(p);
  step(&f, p, C, 8);
  EXPECT(stats(p).prefix_hits == 8 && stats(p).used == 4);
  pd_kv_seq_free(C);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_cow(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[6], slots[4];
  seq_range(a, 6, 7);
  pd_kv_seq *A = seq_new(p, a, 6, 0);
  step(&f, p, A, 6);
  pd_err e = {0};
  pd_kv_seq *B = pd_kv_seq_fork(A, &e);
  EXPECT(B);
  inv(p);
  EXPECT(pd_kv_seq_num_computed(B) == 6 && pd_kv_seq_num_blocks(B) == 2);
  const int32_t *ta = pd_kv_seq_block_table(A), *tb = pd_kv_seq_block_table(B);
  int32_t shared0 = ta[0], shared1 = ta[1];
  EXPECT(tb[0] == shared0 && tb[1] == shared1 && stats(p).used == 2);
  int32_t ya = 50, yb = 60;
  EXPECT_OK(pd_kv_seq_append_tokens(A, &ya, 1, &e_));
  EXPECT_OK(pd_kv_seq_append_tokens(B, &yb, 1, &e_));
  EXPECT(pd_kv_seq_blocks_needed(A, 1) == 1);
  EXPECT_OK(pd_kv_seq_allocate(A, 1, slots, &e_));
  inv(p);
  const pd_kv_copy *c;
  EXPECT(pd_kv_pool_copies(p, &c) == 1);
  ta = pd_kv_seq_block_table(A);
  EXPECT(c[0].src == shared1 && c[0].dst == ta[1] && ta[1] != shared1 && ta[0] == shared0);
  EXPECT(slots[0] == ta[1] * 4 + 2);
  /* B is now the only owner of the old block: it writes in place, no copy. */
  EXPECT(pd_kv_seq_blocks_needed(B, 1) == 0);
  EXPECT_OK(pd_kv_seq_allocate(B, 1, slots + 1, &e_));
  inv(p);
  EXPECT(slots[1] == shared1 * 4 + 2 && pd_kv_pool_copies(p, NULL) == 1);
  /* A second fork of A before the copies ran shares the pending dst; its own copy must read
   * the original source, so the two copies are independent. */
  pd_kv_seq *A2 = pd_kv_seq_fork(A, &e);
  EXPECT(A2);
  EXPECT_OK(pd_kv_seq_truncate(A2, 6, &e_)); /* A2 = a, to be continued differently */
  int32_t y2 = 70;
  EXPECT_OK(pd_kv_seq_append_tokens(A2, &y2, 1, &e_));
  EXPECT_OK(pd_kv_seq_allocate(A2, 1, slots + 2, &e_));
  inv(p);
  EXPECT(pd_kv_pool_copies(p, &c) == 2);
  EXPECT(c[1].src == shared1 && c[1].dst == pd_kv_seq_block_table(A2)[1]);
  EXPECT(stats(p).cow_copies == 2);
  fake_copies(&f, p, true); /* in reverse: order must not matter */
  inv(p);
  fake_write(&f, A, 6, 1, slots);
  fake_write(&f, B, 6, 1, slots + 1);
  fake_write(&f, A2, 6, 1, slots + 2);
  EXPECT_OK(pd_kv_seq_commit(A, 1, &e_));
  EXPECT_OK(pd_kv_seq_commit(B, 1, &e_));
  EXPECT_OK(pd_kv_seq_commit(A2, 1, &e_));
  inv(p);
  fake_verify(&f, A);
  fake_verify(&f, B);
  fake_verify(&f, A2);
  pd_kv_seq_free(A);
  pd_kv_seq_free(B);
  pd_kv_seq_free(A2);
  inv(p);
  EXPECT(stats(p).used == 0);
  free(f.slot);
  pd_kv_pool_free(p);
}

/* Sources of pending copies are pinned: never reused until copies_done; a copy whose dst is
 * released before it ran is dropped. */
static void test_pinned_copies(void) {
  pd_kv_pool *p = pool_new(4, 4, false, NULL);
  fake_kv f = fake_new(p);
  int32_t a[6], c8[8], slots[8];
  seq_range(a, 6, 3);
  seq_range(c8, 8, 30);
  pd_kv_seq *A = seq_new(p, a, 6, 0);
  step(&f, p, A, 6);
  pd_err e = {0};
  pd_kv_seq *B = pd_kv_seq_fork(A, &e);
  EXPECT(B);
  int32_t y = 9;
  EXPECT_OK(pd_kv_seq_append_tokens(A, &y, 1, &e_));
  EXPECT_OK(pd_kv_seq_allocate(A, 1, slots, &e_));
  const pd_kv_copy *c;
  EXPECT(pd_kv_pool_copies(p, &c) == 1);
  int32_t src = c[0].src;
  pd_kv_seq_free(B); /* preempted in the same step: the source must survive the step */
  inv(p);
  pd_kv_stats st = stats(p);
  EXPECT(st.pinned == 1 && st.used == 2 && st.free == 1 && pd_kv_pool_num_available(p) == 1);
  pd_kv_seq *C = seq_new(p, c8, 8, 0);
  EXPECT(pd_kv_seq_blocks_needed(C, 8) == 2);
  EXPECT(pd_kv_seq_allocate(C, 8, slots, &e) == PD_EFULL); /* the pinned block is not free */
  fake_copies(&f, p, false);
  inv(p);
  st = stats(p);
  EXPECT(st.pinned == 0 && st.free == 2);
  fake_write(&f, A, 6, 1, slots);
  EXPECT_OK(pd_kv_seq_commit(A, 1, &e_));
  fake_verify(&f, A);
  step(&f, p, C, 8);
  EXPECT(pd_kv_seq_block_table(C)[0] == src || pd_kv_seq_block_table(C)[1] == src);

  /* dst released before the copy ran: the copy disappears, its source is unpinned */
  pd_kv_seq_free(C);
  pd_kv_seq *D = pd_kv_seq_fork(A, &e);
  EXPECT(D);
  EXPECT_OK(pd_kv_seq_truncate(D, 6, &e_));
  EXPECT_OK(pd_kv_seq_append_tokens(D, &y, 1, &e_));
  EXPECT_OK(pd_kv_seq_allocate(D, 1, slots, &e_));
  EXPECT(pd_kv_pool_copies(p, NULL) == 1);
  inv(p);
  pd_kv_seq_free(D);
  inv(p);
  EXPECT(pd_kv_pool_copies(p, NULL) == 0 && stats(p).pinned == 0);
  pd_kv_seq_free(A);
  inv(p);
  EXPECT(stats(p).free == 4);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_dedupe(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[10], sa[10], sb[10];
  seq_range(a, 10, 20);
  pd_kv_seq *A = seq_new(p, a, 10, 0), *B = seq_new(p, a, 10, 0);
  /* Scheduled in the same step: neither finds the other's blocks. */
  EXPECT_OK(pd_kv_seq_allocate(A, 10, sa, &e_));
  EXPECT_OK(pd_kv_seq_allocate(B, 10, sb, &e_));
  EXPECT(stats(p).used == 6);
  fake_write(&f, A, 0, 10, sa);
  fake_write(&f, B, 0, 10, sb);
  EXPECT_OK(pd_kv_seq_commit(A, 10, &e_));
  inv(p);
  int32_t b2 = pd_kv_seq_block_table(B)[2];
  EXPECT_OK(pd_kv_seq_commit(B, 10, &e_));
  inv(p);
  const int32_t *ta = pd_kv_seq_block_table(A), *tb = pd_kv_seq_block_table(B);
  EXPECT(tb[0] == ta[0] && tb[1] == ta[1] && tb[2] == b2); /* partial block 2 stays B's */
  pd_kv_stats st = stats(p);
  EXPECT(st.dedupes == 2 && st.used == 4 && st.cached == 2 && st.free == 12);
  fake_verify(&f, A);
  fake_verify(&f, B);

  /* Shared with a fork: both copies are kept and registered. */
  pd_kv_seq *C = seq_new(p, a, 10, 0), *D = seq_new(p, a, 10, 0);
  pd_kv_seq_free(A);
  pd_kv_seq_free(B);
  pd_kv_pool_reset_prefix_cache(p);
  EXPECT_OK(pd_kv_seq_allocate(C, 10, sa, &e_));
  EXPECT_OK(pd_kv_seq_allocate(D, 10, sb, &e_));
  fake_write(&f, C, 0, 10, sa);
  fake_write(&f, D, 0, 10, sb);
  pd_err e = {0};
  pd_kv_seq *D2 = pd_kv_seq_fork(D, &e);
  EXPECT(D2);
  EXPECT_OK(pd_kv_seq_commit(C, 10, &e_));
  EXPECT_OK(pd_kv_seq_commit(D, 10, &e_));
  EXPECT_OK(pd_kv_seq_commit(D2, 10, &e_));
  inv(p);
  st = stats(p);
  EXPECT(st.dedupes == 2 && st.cached == 4 && st.used == 6);
  fake_verify(&f, C);
  fake_verify(&f, D);
  fake_verify(&f, D2);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 10, 0) == 8);
  pd_kv_seq_free(C);
  pd_kv_seq_free(D);
  pd_kv_seq_free(D2);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

/* Speculative decoding: drafts get slots, rejected ones are truncated away. */
static void test_truncate(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[8], d[4] = {91, 92, 93, 94}, slots[8];
  seq_range(a, 8, 60);
  pd_kv_seq *A = seq_new(p, a, 5, 0);
  step(&f, p, A, 5);
  EXPECT_OK(pd_kv_seq_append_tokens(A, d, 4, &e_)); /* positions 5..8 */
  EXPECT(pd_kv_seq_blocks_needed(A, 4) == 1);
  EXPECT_OK(pd_kv_seq_allocate(A, 4, slots, &e_));
  fake_write(&f, A, 5, 4, slots);
  EXPECT(pd_kv_seq_num_blocks(A) == 3);
  EXPECT_OK(pd_kv_seq_truncate(A, 7, &e_)); /* 2 drafts accepted: block 2 goes back */
  inv(p);
  EXPECT(pd_kv_seq_num_blocks(A) == 2 && stats(p).used == 2);
  EXPECT_OK(pd_kv_seq_commit(A, 2, &e_));
  inv(p);
  fake_verify(&f, A);
  pd_err e = {0};
  EXPECT(pd_kv_seq_truncate(A, 8, &e) == PD_EINVAL);

  /* Truncating into a cached full block keeps it cached until it is written. */
  pd_kv_seq *B = seq_new(p, a, 8, 0);
  EXPECT(pd_kv_seq_prefix_hit(B) == 4); /* A's first block */
  step(&f, p, B, 4);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 8);
  EXPECT_OK(pd_kv_seq_truncate(B, 6, &e_));
  inv(p);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 8);
  int32_t b1 = pd_kv_seq_block_table(B)[1];
  EXPECT_OK(pd_kv_seq_append_tokens(B, d, 2, &e_));
  EXPECT(pd_kv_seq_blocks_needed(B, 2) == 0);
  step(&f, p, B, 2); /* private: rewritten in place, its old hash dropped */
  EXPECT(pd_kv_seq_block_table(B)[1] == b1);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 4);
  int32_t bd[8];
  memcpy(bd, a, 6 * sizeof(int32_t));
  bd[6] = d[0];
  bd[7] = d[1];
  EXPECT(pd_kv_pool_lookup_prefix(p, bd, 8, 0) == 8);
  /* The hash goes at the write, not only when the block is full again. */
  EXPECT_OK(pd_kv_seq_truncate(B, 6, &e_));
  EXPECT(pd_kv_pool_lookup_prefix(p, bd, 8, 0) == 8);
  EXPECT_OK(pd_kv_seq_append_tokens(B, a + 6, 1, &e_));
  step(&f, p, B, 1);
  EXPECT(pd_kv_seq_block_table(B)[1] == b1);
  EXPECT(pd_kv_pool_lookup_prefix(p, bd, 8, 0) == 4);
  EXPECT_OK(pd_kv_seq_append_tokens(B, d + 1, 1, &e_));
  step(&f, p, B, 1); /* full again, as a[0..7) + d[1]: cached under that content */
  bd[6] = a[6];
  bd[7] = d[1];
  EXPECT(pd_kv_pool_lookup_prefix(p, bd, 8, 0) == 8);

  /* Same, but someone claims the cached block between the truncate and the write: COW. */
  EXPECT_OK(pd_kv_seq_truncate(B, 6, &e_));
  pd_kv_seq *C = seq_new(p, bd, 8, 0);
  step(&f, p, C, 1); /* full-prompt hit: claims both of B's blocks */
  EXPECT(pd_kv_seq_block_table(C)[1] == b1);
  EXPECT_OK(pd_kv_seq_append_tokens(B, d + 2, 2, &e_));
  EXPECT(pd_kv_seq_blocks_needed(B, 2) == 1);
  step(&f, p, B, 2);
  EXPECT(pd_kv_seq_block_table(B)[1] != b1);
  fake_verify(&f, C);
  pd_kv_seq_free(A);
  pd_kv_seq_free(B);
  pd_kv_seq_free(C);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_release_and_reset(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[12], b[12];
  seq_range(a, 12, 1);
  seq_range(b, 12, 50);
  pd_kv_seq *A = seq_new(p, a, 9, 0);
  step(&f, p, A, 9);
  /* preemption by recompute: blocks back to the pool, tokens kept, prefix found again */
  pd_kv_seq_release(A);
  inv(p);
  EXPECT(pd_kv_seq_num_blocks(A) == 0 && pd_kv_seq_num_computed(A) == 0);
  EXPECT(pd_kv_seq_num_tokens(A) == 9 && stats(p).used == 0);
  EXPECT(pd_kv_seq_prefix_hit(A) == 8);
  step(&f, p, A, 1);
  EXPECT(pd_kv_seq_num_computed(A) == 9);
  pd_kv_seq_free(A);
  pd_kv_seq *B = seq_new(p, b, 8, 0);
  step(&f, p, B, 8);
  EXPECT(stats(p).cached == 4);
  EXPECT(pd_kv_pool_reset_prefix_cache(p) == 4);
  inv(p);
  pd_kv_stats st = stats(p);
  EXPECT(st.cached == 0 && st.evictable == 0 && st.free == 14 && st.used == 2);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 0 && pd_kv_pool_lookup_prefix(p, b, 8, 0) == 0);
  /* B continues; its chain was cut, so its later blocks are not cached either */
  EXPECT_OK(pd_kv_seq_append_tokens(B, b + 8, 4, &e_));
  step(&f, p, B, 4);
  EXPECT(stats(p).cached == 0);
  /* a new sequence starts a new chain */
  pd_kv_seq *C = seq_new(p, b, 12, 0);
  EXPECT(pd_kv_seq_prefix_hit(C) == 0);
  step(&f, p, C, 12);
  EXPECT(stats(p).cached == 3 && pd_kv_pool_lookup_prefix(p, b, 12, 0) == 12);
  pd_kv_seq_free(B);
  pd_kv_seq_free(C);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_salts(void) {
  pd_kv_pool *p = pool_new(16, 4, true, NULL);
  fake_kv f = fake_new(p);
  int32_t a[8];
  seq_range(a, 8, 1);
  pd_kv_seq *A = seq_new(p, a, 8, 7);
  step(&f, p, A, 8);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 7) == 8);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 0) == 0);
  EXPECT(pd_kv_pool_lookup_prefix(p, a, 8, 8) == 0);
  pd_kv_seq *B = seq_new(p, a, 8, 8), *C = seq_new(p, a, 8, 7);
  EXPECT(pd_kv_seq_prefix_hit(B) == 0 && pd_kv_seq_prefix_hit(C) == 7);
  step(&f, p, B, 8);
  step(&f, p, C, 1);
  EXPECT(pd_kv_seq_block_table(B)[0] != pd_kv_seq_block_table(A)[0]);
  EXPECT(pd_kv_seq_block_table(C)[0] == pd_kv_seq_block_table(A)[0]);
  pd_kv_seq_free(A);
  pd_kv_seq_free(B);
  pd_kv_seq_free(C);
  inv(p);
  /* the pool salt (model identity) changes every hash */
  EXPECT(pd_kv_hash_root("model-a", 7, 0) != pd_kv_hash_root("model-b", 7, 0));
  EXPECT(pd_kv_hash_root("model-a", 7, 0) != pd_kv_hash_root("model-a", 7, 1));
  free(f.slot);
  pd_kv_pool_free(p);
}

/* The weakest possible hash: every block collides. Exact verification (tokens, salt and the
 * parent block's identity) must keep every lookup correct. */
static uint64_t const_hash(uint64_t parent, const int32_t *t, int n) {
  (void)parent;
  (void)t;
  (void)n;
  return 42;
}

static void test_collisions(void) {
  pd_kv_pool *p = pool_new(32, 4, true, const_hash);
  fake_kv f = fake_new(p);
  int32_t a[9] = {1, 2, 3, 4, 5, 6, 7, 8, 0};
  int32_t b[9] = {9, 9, 9, 9, 5, 6, 7, 8, 0}; /* b's 2nd block == a's 2nd, other parent */
  int32_t c[9] = {1, 2, 3, 4, 9, 9, 9, 9, 0};
  int32_t ab[9] = {5, 6, 7, 8, 1, 2, 3, 4, 0};
  pd_kv_seq *B = seq_new(p, b, 9, 0);
  step(&f, p, B, 9);
  pd_kv_seq *A = seq_new(p, a, 9, 0);
  EXPECT(pd_kv_seq_prefix_hit(A) == 0); /* same hash, other tokens */
  step(&f, p, A, 9);
  EXPECT(pd_kv_pool_lookup_prefix(p, c, 8, 0) == 4);
  EXPECT(pd_kv_pool_lookup_prefix(p, ab, 8, 0) == 0);
  pd_kv_seq *A2 = seq_new(p, a, 9, 0);
  EXPECT(pd_kv_seq_prefix_hit(A2) == 8);
  step(&f, p, A2, 1);
  EXPECT(pd_kv_seq_block_table(A2)[1] == pd_kv_seq_block_table(A)[1]);
  EXPECT(pd_kv_seq_block_table(A2)[1] != pd_kv_seq_block_table(B)[1]);
  fake_verify(&f, A2);
  pd_kv_seq *S = seq_new(p, a, 9, 3); /* another salt, same hash, same tokens */
  EXPECT(pd_kv_seq_prefix_hit(S) == 0);
  pd_kv_seq_free(S);
  pd_kv_seq_free(A);
  pd_kv_seq_free(A2);
  pd_kv_seq_free(B);
  inv(p);
  free(f.slot);
  pd_kv_pool_free(p);
}

static void test_bad_args(void) {
  pd_kv_pool *p = pool_new(4, 4, true, NULL);
  pd_err e = {0};
  int32_t t[4] = {1, 2, 3, 4}, slots[4];
  EXPECT(pd_kv_seq_create(p, NULL, 3, 0, &e) == NULL && e.code == PD_EINVAL);
  EXPECT(pd_kv_seq_create(p, t, -1, 0, &e) == NULL && e.code == PD_EINVAL);
  pd_kv_seq *s = seq_new(p, NULL, 0, 0);
  EXPECT(pd_kv_seq_prefix_hit(s) == 0 && pd_kv_seq_blocks_needed(s, 0) == 0);
  EXPECT(pd_kv_seq_blocks_needed(s, 1) == -1 && pd_kv_seq_blocks_needed(s, -1) == -1);
  EXPECT_OK(pd_kv_seq_allocate(s, 0, NULL, &e_));
  EXPECT(pd_kv_seq_allocate(s, 1, slots, &e) == PD_EINVAL);
  EXPECT(pd_kv_seq_append_tokens(s, NULL, 2, &e) == PD_EINVAL);
  EXPECT(pd_kv_seq_append_tokens(s, t, -2, &e) == PD_EINVAL);
  EXPECT_OK(pd_kv_seq_append_tokens(s, t, 4, &e_));
  EXPECT(pd_kv_seq_allocate(s, 4, NULL, &e) == PD_EINVAL);
  EXPECT(pd_kv_seq_commit(s, 1, &e) == PD_EINVAL); /* no slots yet */
  EXPECT(pd_kv_seq_commit(s, -1, &e) == PD_EINVAL);
  inv(p);
  EXPECT(stats(p).used == 0);
  /* a sequence left alive is freed with its pool */
  EXPECT_OK(pd_kv_seq_allocate(s, 4, slots, &e_));
  inv(p);
  pd_kv_pool_free(p);
  pd_kv_pool_free(NULL);
}

int main(void) {
  test_hash_vectors();
  test_sizing();
  test_alloc_free(true);
  test_alloc_free(false);
  test_prefix_reuse();
  test_partial_not_shared();
  test_full_prompt_hit();
  test_lru_order();
  test_evict_only_when_needed();
  test_efull_no_side_effects();
  test_cow();
  test_pinned_copies();
  test_dedupe();
  test_truncate();
  test_release_and_reset();
  test_salts();
  test_collisions();
  test_bad_args();
  printf("test_kvcache: all passed\n");
  return 0;
}
