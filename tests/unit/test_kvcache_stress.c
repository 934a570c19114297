/* Randomised stress test of the block KV cache manager: thousands of scheduler-like operations
 * (create with prompts from a tiny alphabet so prefixes collide, chunked prefill, decode with
 * speculative drafts and truncation, fork, preempt by release or free, prefix-cache reset) on
 * small pools under memory pressure, with several block sizes and with deliberately weak hashes.
 *
 * After every operation: pd_kv_pool_check (ref counts == references from live sequences,
 * free + evictable + used + pinned == total, ...). After every engine step: a fake backend
 * (one int64 per slot holding a hash of the cache salt and the token prefix at that position,
 * which is what real KV depends on) must hold every live sequence's computed positions, which
 * catches wrong prefix reuse, missing or wrong copy-on-write, and writes into shared blocks.
 * Also checked: PD_EFULL iff pd_kv_seq_blocks_needed > available, with no side effects; every
 * written slot's block is referenced by the writing sequence alone.
 *
 * Usage: test_kvcache_stress [seed]   (default: a fixed seed) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/kvcache.h"

#define EXPECT(c)                                                                      \
  do {                                                                                 \
    if (!(c)) {                                                                        \
      fprintf(stderr, "%s:%d: FAILED: %s (config %s, iteration %d)\n", __FILE__, __LINE__, \
              #c, g_config, g_iter);                                                   \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

static const char *g_config = "";
static int g_iter;

static uint64_t g_rng;
static uint64_t rnd64(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static int rnd(int n) { return n > 0 ? (int)(rnd64() % (uint64_t)n) : 0; } /* [0, n) */
static bool chance(int percent) { return rnd(100) < percent; }

#define MAX_SEQS 20
#define MAX_TOKENS 64

typedef struct world {
  pd_kv_pool *p;
  int bs, n_slots;
  int64_t *kv;                /* fake backend: [num_blocks * block_size] */
  pd_kv_seq *seqs[MAX_SEQS];
  int n;
  int32_t sys[4][16];         /* shared "system prompts" */
  uint64_t ops, efull, steps; /* what the run exercised */
} world;

static void inv(world *w) {
  pd_err e = {0};
  if (pd_kv_pool_check(w->p, &e) != PD_OK) {
    fprintf(stderr, "invariant broken (config %s, iteration %d): %s\n", g_config, g_iter, e.msg);
    exit(1);
  }
  w->ops++;
}

static int64_t kv_value(uint64_t salt, const int32_t *tok, int pos) {
  uint64_t h = 1469598103934665603ULL ^ salt;
  for (int i = 0; i <= pos; i++) {
    uint32_t t = (uint32_t)tok[i];
    for (int b = 0; b < 4; b++) {
      h ^= (t >> (8 * b)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  return (int64_t)(h | 1);
}

static void verify_all(world *w) {
  for (int i = 0; i < w->n; i++) {
    const pd_kv_seq *s = w->seqs[i];
    const int32_t *tab = pd_kv_seq_block_table(s);
    for (int pos = 0; pos < pd_kv_seq_num_computed(s); pos++) {
      int slot = tab[pos / w->bs] * w->bs + pos % w->bs;
      if (w->kv[slot] != kv_value(pd_kv_seq_cache_salt(s), pd_kv_seq_tokens(s), pos)) {
        fprintf(stderr, "config %s iteration %d: sequence %d has wrong KV at position %d "
                "(slot %d)\n", g_config, g_iter, i, pos, slot);
        exit(1);
      }
    }
  }
}

static void remove_seq(world *w, int i, bool free_it) {
  if (free_it) pd_kv_seq_free(w->seqs[i]);
  w->seqs[i] = w->seqs[--w->n];
}

static void op_create(world *w) {
  if (w->n == MAX_SEQS) return;
  int32_t t[40];
  int n = 0;
  if (chance(70)) { /* a shared system prompt, cut anywhere */
    int k = rnd(4), len = rnd(17);
    memcpy(t, w->sys[k], (size_t)len * sizeof *t);
    n = len;
  }
  int tail = rnd(12);
  for (int i = 0; i < tail; i++) t[n++] = 1 + rnd(3);
  if (n == 0) t[n++] = 1 + rnd(3);
  uint64_t salt = chance(85) ? 0 : 5;
  pd_err e = {0};
  pd_kv_seq *s = pd_kv_seq_create(w->p, t, n, salt, &e);
  EXPECT(s);
  w->seqs[w->n++] = s;
  inv(w);
}

typedef struct planned {
  pd_kv_seq *s;
  int start, n;
  int32_t slots[MAX_TOKENS];
  bool drafted; /* tokens appended this step: the sequence is decoding */
} planned;

/* Number of live sequences whose table holds block b. */
static int holders(const world *w, int32_t b) {
  int c = 0;
  for (int i = 0; i < w->n; i++) {
    const int32_t *tab = pd_kv_seq_block_table(w->seqs[i]);
    for (int j = 0; j < pd_kv_seq_num_blocks(w->seqs[i]); j++) c += tab[j] == b;
  }
  return c;
}

static void op_step(world *w) {
  planned plan[MAX_SEQS];
  int np = 0;
  pd_err e = {0};
  int order[MAX_SEQS];
  for (int i = 0; i < w->n; i++) order[i] = i;
  for (int i = w->n - 1; i > 0; i--) {
    int j = rnd(i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  pd_kv_seq *picked[MAX_SEQS];
  int npicked = 0;
  for (int i = 0; i < w->n; i++)
    if (chance(60)) picked[npicked++] = w->seqs[order[i]];

  for (int k = 0; k < npicked; k++) {
    pd_kv_seq *s = picked[k];
    int idx = -1;
    for (int i = 0; i < w->n; i++)
      if (w->seqs[i] == s) idx = i;
    if (idx < 0) continue; /* preempted (freed) earlier in this step */
    bool in_plan = false;
    for (int i = 0; i < np; i++) in_plan |= plan[i].s == s;
    if (in_plan) continue;
    bool drafted = false;
    if (pd_kv_seq_num_computed(s) == pd_kv_seq_num_tokens(s)) {
      if (pd_kv_seq_num_tokens(s) + 4 > MAX_TOKENS) { /* finished */
        remove_seq(w, idx, true);
        inv(w);
        continue;
      }
      int32_t d[4];
      int nd = 1 + rnd(chance(30) ? 4 : 1); /* a sampled token, sometimes with drafts */
      for (int i = 0; i < nd; i++) d[i] = 1 + rnd(3);
      EXPECT(pd_kv_seq_append_tokens(s, d, nd, &e) == PD_OK);
      drafted = true;
      inv(w);
    }
    bool fresh = pd_kv_seq_num_blocks(s) == 0 && pd_kv_seq_num_computed(s) == 0;
    int start = fresh ? pd_kv_seq_prefix_hit(s) : pd_kv_seq_num_computed(s);
    int remaining = pd_kv_seq_num_tokens(s) - start;
    EXPECT(remaining >= 1);
    int n = chance(50) ? remaining : 1 + rnd(remaining); /* whole or chunked prefill */
    int need = pd_kv_seq_blocks_needed(s, n);
    int avail = pd_kv_pool_num_available(w->p);
    EXPECT(need >= 0);
    pd_kv_stats before, after;
    pd_kv_pool_stats(w->p, &before);
    int nb = pd_kv_seq_num_blocks(s), nc = pd_kv_seq_num_computed(s);
    int32_t tab[MAX_TOKENS];
    memcpy(tab, pd_kv_seq_block_table(s), (size_t)nb * sizeof *tab);
    planned *pl = &plan[np];
    pd_status st = pd_kv_seq_allocate(s, n, pl->slots, &e);
    if (need > avail) {
      EXPECT(st == PD_EFULL);
      w->efull++;
      pd_kv_pool_stats(w->p, &after);
      EXPECT(memcmp(&before, &after, sizeof before) == 0);
      EXPECT(pd_kv_seq_num_blocks(s) == nb && pd_kv_seq_num_computed(s) == nc);
      EXPECT(memcmp(tab, pd_kv_seq_block_table(s), (size_t)nb * sizeof *tab) == 0);
      inv(w);
      if (chance(60) && w->n > 1) { /* preempt someone (maybe already scheduled) */
        int v = rnd(w->n);
        pd_kv_seq *victim = w->seqs[v];
        for (int i = 0; i < np; i++)
          if (plan[i].s == victim) plan[i].s = NULL;
        if (chance(50)) remove_seq(w, v, true);
        else pd_kv_seq_release(victim);
        inv(w);
      }
      continue;
    }
    EXPECT(st == PD_OK);
    EXPECT(pd_kv_seq_num_computed(s) == start);
    inv(w);
    pl->s = s;
    pl->start = start;
    pl->n = n;
    pl->drafted = drafted;
    const int32_t *t2 = pd_kv_seq_block_table(s);
    for (int i = 0; i < n; i++) {
      int pos = start + i;
      if (pl->slots[i] < 0) continue;
      EXPECT(pl->slots[i] == t2[pos / w->bs] * w->bs + pos % w->bs);
      EXPECT(holders(w, t2[pos / w->bs]) == 1); /* never write a shared block */
    }
    np++;
  }

  /* the engine: copies (any order), then the forward's KV writes, then commits */
  const pd_kv_copy *c;
  int ncopies = pd_kv_pool_copies(w->p, &c);
  bool rev = chance(50);
  for (int k = 0; k < ncopies; k++) {
    const pd_kv_copy *x = &c[rev ? ncopies - 1 - k : k];
    memcpy(w->kv + (size_t)x->dst * w->bs, w->kv + (size_t)x->src * w->bs,
           (size_t)w->bs * sizeof *w->kv);
  }
  pd_kv_pool_copies_done(w->p);
  inv(w);
  for (int i = 0; i < np; i++) {
    planned *pl = &plan[i];
    if (!pl->s) continue;
    const int32_t *tok = pd_kv_seq_tokens(pl->s);
    for (int k = 0; k < pl->n; k++)
      if (pl->slots[k] >= 0)
        w->kv[pl->slots[k]] = kv_value(pd_kv_seq_cache_salt(pl->s), tok, pl->start + k);
  }
  for (int i = 0; i < np; i++) {
    planned *pl = &plan[i];
    if (!pl->s) continue;
    int accept = pl->n;
    if (pl->drafted && pl->n > 1 && chance(50)) { /* speculative: reject some drafts */
      accept = 1 + rnd(pl->n);
      EXPECT(pd_kv_seq_truncate(pl->s, pl->start + accept, &e) == PD_OK);
      inv(w);
    } else if (chance(10)) { /* the engine commits less than it computed */
      accept = rnd(pl->n + 1);
    }
    EXPECT(pd_kv_seq_commit(pl->s, accept, &e) == PD_OK);
    inv(w);
  }
  verify_all(w);
  w->steps++;
}

static void op_fork(world *w) {
  if (w->n == 0 || w->n == MAX_SEQS) return;
  pd_err e = {0};
  pd_kv_seq *c = pd_kv_seq_fork(w->seqs[rnd(w->n)], &e);
  EXPECT(c);
  w->seqs[w->n++] = c;
  inv(w);
  verify_all(w);
}

static void run(const char *name, int num_blocks, int bs, pd_kv_hash_fn fn, bool prefix,
                int iters, uint64_t seed) {
  g_config = name;
  g_rng = seed ? seed : 88172645463325252ULL;
  world w;
  memset(&w, 0, sizeof w);
  pd_kv_pool_opts o = {0};
  o.num_blocks = num_blocks;
  o.block_size = bs;
  o.hash_fn = fn;
  o.disable_prefix_caching = !prefix;
  o.salt = "stress";
  o.salt_len = 6;
  pd_err e = {0};
  w.p = pd_kv_pool_create(&o, &e);
  EXPECT(w.p);
  w.bs = bs;
  w.n_slots = num_blocks * bs;
  w.kv = calloc((size_t)w.n_slots, sizeof *w.kv);
  EXPECT(w.kv);
  for (int k = 0; k < 4; k++)
    for (int i = 0; i < 16; i++) w.sys[k][i] = 1 + rnd(3);

  for (g_iter = 0; g_iter < iters; g_iter++) {
    int r = rnd(100);
    if (r < 20) op_create(&w);
    else if (r < 75) op_step(&w);
    else if (r < 82) op_fork(&w);
    else if (r < 90) {
      if (w.n > 0) {
        remove_seq(&w, rnd(w.n), true);
        inv(&w);
      }
    } else if (r < 96) {
      if (w.n > 0) {
        pd_kv_seq_release(w.seqs[rnd(w.n)]);
        inv(&w);
      }
    } else if (r < 97) {
      if (w.n > 0) { /* roll back: drop tokens, maybe computed ones */
        pd_kv_seq *s = w.seqs[rnd(w.n)];
        int nt = pd_kv_seq_num_tokens(s);
        EXPECT(pd_kv_seq_truncate(s, nt - rnd(nt / 2 + 1), &e) == PD_OK);
        inv(&w);
        verify_all(&w);
      }
    } else if (r < 98) {
      pd_kv_pool_reset_prefix_cache(w.p);
      inv(&w);
      verify_all(&w);
    } else if (w.n > 0) { /* tokens arrive without being scheduled yet */
      pd_kv_seq *s = w.seqs[rnd(w.n)];
      int32_t t = 1 + rnd(3);
      if (pd_kv_seq_num_tokens(s) < MAX_TOKENS - 4) EXPECT(pd_kv_seq_append_tokens(s, &t, 1, &e) == PD_OK);
      inv(&w);
    }
  }
  pd_kv_stats st;
  pd_kv_pool_stats(w.p, &st);
  printf("%-14s blocks %3d bs %d: %llu checks, %llu steps, %llu EFULL, prefix hits %llu/%llu "
         "tokens, %llu evictions, %llu COW, %llu dedupes\n",
         name, num_blocks, bs, (unsigned long long)w.ops, (unsigned long long)w.steps,
         (unsigned long long)w.efull, (unsigned long long)st.prefix_hits,
         (unsigned long long)st.prefix_queries, (unsigned long long)st.evictions,
         (unsigned long long)st.cow_copies, (unsigned long long)st.dedupes);
  /* the run must have exercised what it claims to test */
  EXPECT(w.efull > 0 && st.cow_copies > 0);
  if (prefix) EXPECT(st.prefix_hits > 0 && st.evictions > 0 && st.dedupes > 0);
  else EXPECT(st.prefix_hits == 0 && st.cached == 0);
  /* leaving sequences alive: the pool frees them; first free half explicitly */
  while (w.n > 0 && chance(50)) {
    remove_seq(&w, rnd(w.n), true);
    inv(&w);
  }
  pd_kv_pool_free(w.p);
  free(w.kv);
}

/* Weak hashes: chains collide constantly; only exact verification keeps reuse correct. */
static uint64_t hash_2bit(uint64_t parent, const int32_t *t, int n) {
  return (parent * 31 + (uint64_t)t[0] + (uint64_t)n) & 3;
}
static uint64_t hash_const(uint64_t parent, const int32_t *t, int n) {
  (void)parent;
  (void)t;
  (void)n;
  return 0;
}

int main(int argc, char **argv) {
  uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 0;
  run("xxh64", 24, 4, NULL, true, 20000, seed);
  run("xxh64-tight", 10, 3, NULL, true, 20000, seed ^ 0x1234);
  run("xxh64-bs1", 40, 1, NULL, true, 15000, seed ^ 0x5678);
  run("xxh64-bs16", 8, 16, NULL, true, 10000, seed ^ 0x9abc);
  run("weak-2bit", 24, 4, hash_2bit, true, 20000, seed ^ 0xdef0);
  run("weak-const", 16, 2, hash_const, true, 15000, seed ^ 0x4242);
  run("no-prefix", 16, 4, NULL, false, 15000, seed ^ 0x7777);
  printf("test_kvcache_stress: all passed\n");
  return 0;
}
