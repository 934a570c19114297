/* The block KV cache manager: block pool, free list, LRU of evictable cached blocks, the
 * prefix-cache index, copy-on-write, and per-sequence block tables. See pd/kvcache.h for
 * the contract; this file documents the internal invariants.
 *
 * Block states (exactly one; pd_kv_pool_check verifies all of this):
 *   FREE       ref 0, pins 0, no hash; in free_list
 *   EVICTABLE  ref 0, pins 0, hashed;  in lru (head = least recently released)
 *   USED       ref > 0;                in no list
 *   PINNED     ref 0, pins > 0;        in no list (a pending copy still reads it)
 * Per sequence:
 *   n_blocks <= ceil(n_tokens / bs); n_computed <= n_tokens; n_computed <= n_blocks * bs;
 *   blocks [0, n_sealed) are full, their KV final and immutable (never written again), so a
 *   slot inside them is reported as -1; n_sealed * bs <= n_tokens.
 *   n_sealed * bs <= n_computed except right after a full-prompt cache hit (then
 *   n_computed = n_tokens - 1).
 * Hashed blocks store their tokens, the hash, the cache salt and parent_uid (the registration
 * id of the previous block in the chain, 0 for the first block); a lookup accepts a block only
 * when all of them match, so the 64-bit hash is an index, never the proof of equality. */
#include <stdlib.h>
#include <string.h>

#include "pd/kvcache.h"
#include "pd/map.h"

enum { BLK_FREE = 0, BLK_EVICTABLE, BLK_USED, BLK_PINNED };

typedef struct kv_block {
  uint64_t hash;       /* valid when hashed */
  uint64_t uid;        /* registration id, unique over the pool's life; 0 when not hashed */
  uint64_t parent_uid; /* uid of the previous block of the chain at registration; 0: first */
  uint64_t salt;       /* cache salt of the sequence that registered it */
  int32_t ref;         /* references from sequences' block tables */
  int32_t pins;        /* pending copies that read this block */
  int32_t prev, next;  /* links in free_list or lru; -1 at the ends */
  uint8_t state;
  uint8_t hashed;
  uint8_t copy_dst;    /* the dst of a pending copy */
} kv_block;

typedef struct kv_list {
  int32_t head, tail;
  int n;
} kv_list;

struct pd_kv_seq {
  pd_kv_pool *pool;
  pd_kv_seq *prev, *next; /* the pool's list of live sequences */
  uint64_t cache_salt;
  uint64_t root;          /* hash chain root for this salt */
  int32_t *tokens;
  int n_tokens, cap_tokens;
  uint64_t *hashes;       /* [n_tokens / bs] chained hashes of full token blocks (prefix
                             caching only) */
  int cap_hashes;
  int32_t *table;         /* [n_blocks], capacity >= ceil(n_tokens / bs) at all times */
  int n_blocks, cap_blocks;
  int n_computed;
  int n_sealed;
};

struct pd_kv_pool {
  int num_blocks;
  int block_size;
  bool prefix_caching;
  pd_kv_hash_fn hash_fn;
  uint64_t root; /* root for cache_salt 0 */
  void *salt;    /* copy of the pool salt, to derive roots for other cache salts */
  size_t salt_len;

  kv_block *blocks;  /* [num_blocks] */
  int32_t *tokens;   /* [num_blocks, block_size] token ids of hashed blocks */
  pd_map index;      /* block hash -> block id, one entry per hashed block (a multimap: blocks
                        of different content may share a hash, and identical ones may both be
                        cached); reserved for num_blocks entries, so it never allocates again */
  kv_list free_list;
  kv_list lru;
  int n_used, n_pinned, n_hashed;
  uint64_t next_uid;

  pd_kv_copy *copies; /* [n_copies], capacity num_blocks (dsts are distinct used blocks) */
  int n_copies;

  pd_kv_seq *seqs;
  int n_seqs;

  uint64_t prefix_queries, prefix_hits, evictions, cow_copies, dedupes;
};

/* ---------------------------------------------------------------------------------------- */
/* sizing                                                                                   */

size_t pd_kv_block_bytes(int n_layers, int n_kv_heads, int head_dim, int block_size,
                         pd_dtype dt) {
  size_t es = pd_dtype_size(dt);
  if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || block_size <= 0 || es == 0) return 0;
  size_t f[5] = {2, (size_t)n_layers, (size_t)n_kv_heads, (size_t)block_size, (size_t)head_dim};
  size_t bytes = es;
  for (int i = 0; i < 5; i++) {
    if (bytes > SIZE_MAX / f[i]) return 0;
    bytes *= f[i];
  }
  return bytes;
}

int pd_kv_num_blocks_for_budget(size_t budget_bytes, size_t block_bytes, int block_size) {
  if (block_bytes == 0 || block_size <= 0) return 0;
  size_t n = budget_bytes / block_bytes;
  size_t cap = (size_t)INT32_MAX / (size_t)block_size; /* every slot id fits in int32 */
  if (n > cap) n = cap;
  return (int)n;
}

/* ---------------------------------------------------------------------------------------- */
/* lists                                                                                    */

static void list_init(kv_list *l) {
  l->head = l->tail = -1;
  l->n = 0;
}

static void list_push_back(kv_block *B, kv_list *l, int32_t b) {
  B[b].prev = l->tail;
  B[b].next = -1;
  if (l->tail >= 0) B[l->tail].next = b;
  else l->head = b;
  l->tail = b;
  l->n++;
}

static void list_push_front(kv_block *B, kv_list *l, int32_t b) {
  B[b].next = l->head;
  B[b].prev = -1;
  if (l->head >= 0) B[l->head].prev = b;
  else l->tail = b;
  l->head = b;
  l->n++;
}

static void list_remove(kv_block *B, kv_list *l, int32_t b) {
  if (B[b].prev >= 0) B[B[b].prev].next = B[b].next;
  else l->head = B[b].next;
  if (B[b].next >= 0) B[B[b].next].prev = B[b].prev;
  else l->tail = B[b].prev;
  B[b].prev = B[b].next = -1;
  l->n--;
}

static int32_t list_pop_front(kv_block *B, kv_list *l) {
  int32_t b = l->head;
  if (b >= 0) list_remove(B, l, b);
  return b;
}

/* ---------------------------------------------------------------------------------------- */
/* prefix-cache index: a pd_map multimap from block hash to block id                         */

static bool block_matches(const pd_kv_pool *p, int32_t b, uint64_t hash, uint64_t parent_uid,
                          uint64_t salt, const int32_t *tokens) {
  const kv_block *k = &p->blocks[b];
  return k->hashed && k->hash == hash && k->parent_uid == parent_uid && k->salt == salt &&
         memcmp(p->tokens + (size_t)b * p->block_size, tokens,
                (size_t)p->block_size * sizeof(int32_t)) == 0;
}

/* The index's hash of a block hash: mixed, so that an injected weak hash_fn (tests) does not
 * pile its values into one probe run. */
static inline uint64_t index_hash(uint64_t hash) { return pd_map_hash_u64(hash); }

/* The cached block with exactly this content and chain position, or -1. Where several match
 * (copies kept for forks), the most recently registered, the highest uid. */
static int32_t cache_find(const pd_kv_pool *p, uint64_t hash, uint64_t parent_uid,
                          uint64_t salt, const int32_t *tokens) {
  int32_t best = -1;
  for (const pd_map_slot *x = pd_map_u64_find(&p->index, index_hash(hash), hash); x;
       x = pd_map_u64_next(&p->index, x, hash)) {
    int32_t b = (int32_t)x->val;
    if (block_matches(p, b, hash, parent_uid, salt, tokens) &&
        (best < 0 || p->blocks[b].uid > p->blocks[best].uid))
      best = b;
  }
  return best;
}

static void cache_insert(pd_kv_pool *p, int32_t b, uint64_t hash, uint64_t parent_uid,
                         uint64_t salt, const int32_t *tokens) {
  kv_block *k = &p->blocks[b];
  PD_ASSERT(!k->hashed);
  k->hash = hash;
  k->parent_uid = parent_uid;
  k->salt = salt;
  k->uid = p->next_uid++;
  k->hashed = 1;
  memcpy(p->tokens + (size_t)b * p->block_size, tokens, (size_t)p->block_size * sizeof(int32_t));
  const pd_map_slot *x = pd_map_u64_add(&p->index, index_hash(hash), hash, (uint64_t)b);
  PD_ASSERT(x); /* reserved for every block */
  p->n_hashed++;
}

/* Drops b's hash (b's list membership is the caller's business). */
static void cache_remove(pd_kv_pool *p, int32_t b) {
  kv_block *k = &p->blocks[b];
  PD_ASSERT(k->hashed);
  pd_map_slot *x = pd_map_u64_find(&p->index, index_hash(k->hash), k->hash);
  while (x && x->val != (uint64_t)b) x = pd_map_u64_next(&p->index, x, k->hash);
  PD_ASSERT(x);
  pd_map_remove(&p->index, x);
  k->hashed = 0;
  k->uid = 0;
  p->n_hashed--;
}

/* ---------------------------------------------------------------------------------------- */
/* block references                                                                         */

/* Puts an unreferenced, unpinned block where it belongs: the LRU tail when it keeps a hash
 * (most recently released, evicted last), else the free list's head (reused first). */
static void block_park(pd_kv_pool *p, int32_t b) {
  kv_block *k = &p->blocks[b];
  if (k->hashed) {
    k->state = BLK_EVICTABLE;
    list_push_back(p->blocks, &p->lru, b);
  } else {
    k->state = BLK_FREE;
    list_push_front(p->blocks, &p->free_list, b);
  }
}

static void block_unpin(pd_kv_pool *p, int32_t b) {
  kv_block *k = &p->blocks[b];
  PD_ASSERT(k->pins > 0);
  if (--k->pins == 0 && k->ref == 0) {
    PD_ASSERT(k->state == BLK_PINNED);
    p->n_pinned--;
    block_park(p, b);
  }
}

/* Removes the pending copy whose dst is b (b is being released: nothing will read it). */
static void drop_copy_to(pd_kv_pool *p, int32_t b) {
  for (int i = 0; i < p->n_copies; i++) {
    if (p->copies[i].dst == b) {
      int32_t src = p->copies[i].src;
      memmove(&p->copies[i], &p->copies[i + 1], (size_t)(p->n_copies - i - 1) * sizeof *p->copies);
      p->n_copies--;
      p->blocks[b].copy_dst = 0;
      block_unpin(p, src);
      return;
    }
  }
  PD_ASSERT(!"copy_dst block without a pending copy");
}

/* Takes one more reference to b, which may be in use, evictable (a prefix hit) or pinned. */
static void block_ref(pd_kv_pool *p, int32_t b) {
  kv_block *k = &p->blocks[b];
  if (k->ref == 0) {
    if (k->state == BLK_EVICTABLE) list_remove(p->blocks, &p->lru, b);
    else if (k->state == BLK_PINNED) p->n_pinned--;
    else PD_ASSERT(!"block_ref on a free block");
    k->state = BLK_USED;
    p->n_used++;
  }
  k->ref++;
}

static void block_unref(pd_kv_pool *p, int32_t b) {
  kv_block *k = &p->blocks[b];
  PD_ASSERT(k->ref > 0 && k->state == BLK_USED);
  if (--k->ref > 0) return;
  p->n_used--;
  if (k->copy_dst) drop_copy_to(p, b); /* may unpin and park other blocks, never b */
  if (k->pins > 0) {
    k->state = BLK_PINNED;
    p->n_pinned++;
  } else {
    block_park(p, b);
  }
}

/* A block for new content: the free list first; only when it is empty, the least recently
 * released cached block loses its hash (eviction). The caller checked availability. */
static int32_t block_take(pd_kv_pool *p) {
  int32_t b = list_pop_front(p->blocks, &p->free_list);
  if (b < 0) {
    b = list_pop_front(p->blocks, &p->lru);
    PD_ASSERT(b >= 0);
    cache_remove(p, b);
    p->evictions++;
  }
  kv_block *k = &p->blocks[b];
  PD_ASSERT(k->ref == 0 && k->pins == 0 && !k->copy_dst);
  k->state = BLK_USED;
  k->ref = 1;
  p->n_used++;
  return b;
}

/* ---------------------------------------------------------------------------------------- */
/* pool                                                                                     */

pd_kv_pool *pd_kv_pool_create(const pd_kv_pool_opts *o, pd_err *e) {
  if (!o) {
    pd_err_set(e, PD_EINVAL, "kv pool: no options");
    return NULL;
  }
  int bs = o->block_size ? o->block_size : PD_KV_DEFAULT_BLOCK_SIZE;
  if (bs <= 0 || o->num_blocks <= 0 || (int64_t)o->num_blocks * bs > INT32_MAX) {
    pd_err_set(e, PD_EINVAL, "kv pool: bad geometry (num_blocks %d, block_size %d): need both "
               "> 0 and num_blocks * block_size <= 2^31 - 1", o->num_blocks, bs);
    return NULL;
  }
  if (o->salt_len > 0 && !o->salt) {
    pd_err_set(e, PD_EINVAL, "kv pool: salt_len %zu with a NULL salt", o->salt_len);
    return NULL;
  }
  pd_kv_pool *p = calloc(1, sizeof *p);
  if (!p) goto oom;
  p->num_blocks = o->num_blocks;
  p->block_size = bs;
  p->prefix_caching = !o->disable_prefix_caching;
  p->hash_fn = o->hash_fn ? o->hash_fn : pd_kv_hash_block;
  p->root = pd_kv_hash_root(o->salt, o->salt_len, 0);
  if (o->salt_len > 0) {
    p->salt = malloc(o->salt_len);
    if (!p->salt) goto oom;
    memcpy(p->salt, o->salt, o->salt_len);
    p->salt_len = o->salt_len;
  }
  p->blocks = calloc((size_t)o->num_blocks, sizeof *p->blocks);
  p->tokens = malloc((size_t)o->num_blocks * (size_t)bs * sizeof *p->tokens);
  p->copies = malloc((size_t)o->num_blocks * sizeof *p->copies);
  if (!p->blocks || !p->tokens || !p->copies) goto oom;
  if (p->prefix_caching && !pd_map_init(&p->index, (size_t)o->num_blocks, 0)) goto oom;
  list_init(&p->free_list);
  list_init(&p->lru);
  for (int32_t b = 0; b < o->num_blocks; b++) {
    p->blocks[b].state = BLK_FREE;
    list_push_back(p->blocks, &p->free_list, b); /* ascending ids: block 0 is taken first */
  }
  p->next_uid = 1;
  return p;
oom:
  pd_kv_pool_free(p);
  pd_err_set(e, PD_ENOMEM, "kv pool: out of memory for %d blocks of %d tokens", o->num_blocks, bs);
  return NULL;
}

static void seq_destroy(pd_kv_seq *s);

void pd_kv_pool_free(pd_kv_pool *p) {
  if (!p) return;
  while (p->seqs) seq_destroy(p->seqs);
  free(p->blocks);
  free(p->tokens);
  pd_map_free(&p->index);
  free(p->copies);
  free(p->salt);
  free(p);
}

int pd_kv_pool_block_size(const pd_kv_pool *p) { return p->block_size; }
int pd_kv_pool_num_blocks(const pd_kv_pool *p) { return p->num_blocks; }
int pd_kv_pool_num_available(const pd_kv_pool *p) { return p->free_list.n + p->lru.n; }

int pd_kv_pool_blocks_for_tokens(const pd_kv_pool *p, int n_tokens) {
  if (n_tokens <= 0) return 0;
  return (int)(((int64_t)n_tokens + p->block_size - 1) / p->block_size);
}

void pd_kv_pool_stats(const pd_kv_pool *p, pd_kv_stats *out) {
  memset(out, 0, sizeof *out);
  out->num_blocks = p->num_blocks;
  out->block_size = p->block_size;
  out->used = p->n_used;
  out->free = p->free_list.n;
  out->evictable = p->lru.n;
  out->pinned = p->n_pinned;
  out->cached = p->n_hashed;
  out->num_seqs = p->n_seqs;
  out->usage = 1.0 - (double)(p->free_list.n + p->lru.n) / (double)p->num_blocks;
  out->prefix_queries = p->prefix_queries;
  out->prefix_hits = p->prefix_hits;
  out->evictions = p->evictions;
  out->cow_copies = p->cow_copies;
  out->dedupes = p->dedupes;
}

static uint64_t root_for(const pd_kv_pool *p, uint64_t cache_salt) {
  return cache_salt ? pd_kv_hash_root(p->salt, p->salt_len, cache_salt) : p->root;
}

int pd_kv_pool_lookup_prefix(const pd_kv_pool *p, const int32_t *tokens, int n,
                             uint64_t cache_salt) {
  if (!p->prefix_caching || !tokens || n <= 0) return 0;
  const int bs = p->block_size;
  uint64_t h = root_for(p, cache_salt), parent_uid = 0;
  int i = 0;
  for (; (int64_t)(i + 1) * bs <= n; i++) {
    h = p->hash_fn(h, tokens + (size_t)i * bs, bs);
    int32_t b = cache_find(p, h, parent_uid, cache_salt, tokens + (size_t)i * bs);
    if (b < 0) break;
    parent_uid = p->blocks[b].uid;
  }
  return i * bs;
}

int pd_kv_pool_reset_prefix_cache(pd_kv_pool *p) {
  int dropped = 0;
  for (int32_t b = 0; b < p->num_blocks; b++) {
    kv_block *k = &p->blocks[b];
    if (!k->hashed) continue;
    cache_remove(p, b);
    dropped++;
    if (k->state == BLK_EVICTABLE) {
      list_remove(p->blocks, &p->lru, b);
      block_park(p, b);
    }
  }
  return dropped;
}

int pd_kv_pool_copies(const pd_kv_pool *p, const pd_kv_copy **copies) {
  if (copies) *copies = p->copies;
  return p->n_copies;
}

void pd_kv_pool_copies_done(pd_kv_pool *p) {
  /* Unpinning may park blocks but never touches the copy list, so iterate then clear. */
  int n = p->n_copies;
  p->n_copies = 0;
  for (int i = 0; i < n; i++) {
    p->blocks[p->copies[i].dst].copy_dst = 0;
    block_unpin(p, p->copies[i].src);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* sequences                                                                                */

/* Grows s's arrays for n_tokens tokens; no other change, so a failure leaves s as it was. */
static bool seq_reserve(pd_kv_seq *s, int n_tokens) {
  const int bs = s->pool->block_size;
  if (n_tokens > s->cap_tokens) {
    int cap = s->cap_tokens ? s->cap_tokens : 64;
    while (cap < n_tokens) cap = cap > INT32_MAX / 2 ? INT32_MAX : cap * 2;
    int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
    if (!t) return false;
    s->tokens = t;
    s->cap_tokens = cap;
  }
  int nb = (int)(((int64_t)n_tokens + bs - 1) / bs);
  if (nb > s->cap_blocks) {
    int cap = s->cap_blocks ? s->cap_blocks : 8;
    while (cap < nb) cap *= 2;
    int32_t *t = realloc(s->table, (size_t)cap * sizeof *t);
    if (!t) return false;
    s->table = t;
    s->cap_blocks = cap;
  }
  int nh = n_tokens / bs;
  if (s->pool->prefix_caching && nh > s->cap_hashes) {
    int cap = s->cap_hashes ? s->cap_hashes : 8;
    while (cap < nh) cap *= 2;
    uint64_t *h = realloc(s->hashes, (size_t)cap * sizeof *h);
    if (!h) return false;
    s->hashes = h;
    s->cap_hashes = cap;
  }
  return true;
}

/* Hashes the full token blocks [from, n_tokens / bs). */
static void seq_hash_blocks(pd_kv_seq *s, int from) {
  const pd_kv_pool *p = s->pool;
  if (!p->prefix_caching) return;
  const int bs = p->block_size;
  for (int i = from; i < s->n_tokens / bs; i++)
    s->hashes[i] = p->hash_fn(i ? s->hashes[i - 1] : s->root, s->tokens + (size_t)i * bs, bs);
}

static void seq_link(pd_kv_seq *s) {
  pd_kv_pool *p = s->pool;
  s->prev = NULL;
  s->next = p->seqs;
  if (p->seqs) p->seqs->prev = s;
  p->seqs = s;
  p->n_seqs++;
}

static void seq_free_memory(pd_kv_seq *s) {
  free(s->tokens);
  free(s->table);
  free(s->hashes);
  free(s);
}

pd_kv_seq *pd_kv_seq_create(pd_kv_pool *p, const int32_t *tokens, int n, uint64_t cache_salt,
                            pd_err *e) {
  if (!p || n < 0 || (n > 0 && !tokens)) {
    pd_err_set(e, PD_EINVAL, "kv seq: bad arguments (n %d)", n);
    return NULL;
  }
  pd_kv_seq *s = calloc(1, sizeof *s);
  if (!s) goto oom;
  s->pool = p;
  s->cache_salt = cache_salt;
  s->root = root_for(p, cache_salt);
  if (!seq_reserve(s, n)) goto oom;
  if (n > 0) memcpy(s->tokens, tokens, (size_t)n * sizeof *tokens);
  s->n_tokens = n;
  seq_hash_blocks(s, 0);
  seq_link(s);
  return s;
oom:
  if (s) seq_free_memory(s);
  pd_err_set(e, PD_ENOMEM, "kv seq: out of memory for %d tokens", n);
  return NULL;
}

/* Releases blocks [keep, n_blocks) last to first, so that when they become evictable the
 * sequence's tail is evicted before the prefix other requests are likelier to share. */
static void seq_release_from(pd_kv_seq *s, int keep) {
  for (int i = s->n_blocks - 1; i >= keep; i--) block_unref(s->pool, s->table[i]);
  if (s->n_blocks > keep) s->n_blocks = keep;
}

static void seq_destroy(pd_kv_seq *s) {
  pd_kv_pool *p = s->pool;
  seq_release_from(s, 0);
  if (s->prev) s->prev->next = s->next;
  else p->seqs = s->next;
  if (s->next) s->next->prev = s->prev;
  p->n_seqs--;
  seq_free_memory(s);
}

void pd_kv_seq_free(pd_kv_seq *s) {
  if (s) seq_destroy(s);
}

void pd_kv_seq_release(pd_kv_seq *s) {
  seq_release_from(s, 0);
  s->n_computed = 0;
  s->n_sealed = 0;
}

pd_kv_seq *pd_kv_seq_fork(pd_kv_seq *s, pd_err *e) {
  pd_kv_seq *c = calloc(1, sizeof *c);
  if (!c) goto oom;
  c->pool = s->pool;
  c->cache_salt = s->cache_salt;
  c->root = s->root;
  if (!seq_reserve(c, s->n_tokens)) goto oom;
  if (s->n_tokens > 0) memcpy(c->tokens, s->tokens, (size_t)s->n_tokens * sizeof *c->tokens);
  c->n_tokens = s->n_tokens;
  int nh = s->n_tokens / s->pool->block_size;
  if (s->pool->prefix_caching && nh > 0) memcpy(c->hashes, s->hashes, (size_t)nh * sizeof *c->hashes);
  for (int i = 0; i < s->n_blocks; i++) {
    c->table[i] = s->table[i];
    block_ref(s->pool, s->table[i]);
  }
  c->n_blocks = s->n_blocks;
  c->n_computed = s->n_computed;
  c->n_sealed = s->n_sealed;
  seq_link(c);
  return c;
oom:
  if (c) seq_free_memory(c);
  pd_err_set(e, PD_ENOMEM, "kv seq fork: out of memory for %d tokens", s->n_tokens);
  return NULL;
}

pd_status pd_kv_seq_append_tokens(pd_kv_seq *s, const int32_t *tokens, int n, pd_err *e) {
  if (n < 0 || (n > 0 && !tokens) || n > INT32_MAX - s->n_tokens)
    return pd_err_set(e, PD_EINVAL, "kv seq append: bad count %d (have %d tokens)", n, s->n_tokens);
  if (n == 0) return PD_OK;
  if (!seq_reserve(s, s->n_tokens + n))
    return pd_err_set(e, PD_ENOMEM, "kv seq append: out of memory for %d tokens", s->n_tokens + n);
  int from = s->n_tokens / s->pool->block_size;
  memcpy(s->tokens + s->n_tokens, tokens, (size_t)n * sizeof *tokens);
  s->n_tokens += n;
  seq_hash_blocks(s, from);
  return PD_OK;
}

pd_status pd_kv_seq_truncate(pd_kv_seq *s, int n, pd_err *e) {
  if (n < 0 || n > s->n_tokens)
    return pd_err_set(e, PD_EINVAL, "kv seq truncate: %d is outside [0, %d]", n, s->n_tokens);
  const int bs = s->pool->block_size;
  /* hashes[i] depends only on tokens [0, (i+1)*bs), so the first n / bs stay valid. */
  s->n_tokens = n;
  if (s->n_computed > n) s->n_computed = n;
  if (s->n_sealed > n / bs) s->n_sealed = n / bs;
  seq_release_from(s, (int)(((int64_t)n + bs - 1) / bs));
  return PD_OK;
}

/* What an allocation of n_new tokens does, computed without changing anything. */
typedef struct alloc_plan {
  bool claim;      /* a fresh sequence: claim hit_blocks cached blocks first */
  int hit_blocks;
  int start;       /* first position to allocate: n_computed after the claim */
  int n_sealed;    /* after the claim */
  int n_blocks;    /* existing blocks after the claim */
  int w0, w1;      /* blocks [w0, w1] receive writes; w0 > w1 when none do */
  int cow;         /* existing shared blocks among [w0, w1] that need copy-on-write */
  int grow;        /* new blocks appended */
  int need;        /* blocks taken from free + evictable */
} alloc_plan;

/* Fills pl; with hit_ids non-NULL (room for n_tokens / bs ids) also records the claimed
 * block ids. Returns false when n_new is out of range. */
static bool seq_plan(const pd_kv_seq *s, int n_new, alloc_plan *pl, int32_t *hit_ids) {
  const pd_kv_pool *p = s->pool;
  const int bs = p->block_size;
  memset(pl, 0, sizeof *pl);
  if (n_new < 0) return false;
  pl->claim = p->prefix_caching && s->n_blocks == 0 && s->n_computed == 0 && s->n_tokens > 0;
  int hit_cost = 0;
  if (pl->claim) {
    uint64_t parent_uid = 0;
    for (int i = 0; i < s->n_tokens / bs; i++) {
      int32_t b = cache_find(p, s->hashes[i], parent_uid, s->cache_salt, s->tokens + (size_t)i * bs);
      if (b < 0) break;
      if (p->blocks[b].state == BLK_EVICTABLE) hit_cost++;
      if (hit_ids) hit_ids[i] = b;
      parent_uid = p->blocks[b].uid;
      pl->hit_blocks++;
    }
    pl->start = pl->hit_blocks * bs;
    if (pl->start == s->n_tokens) pl->start = s->n_tokens - 1; /* always compute the last one */
    pl->n_sealed = pl->hit_blocks;
    pl->n_blocks = pl->hit_blocks;
  } else {
    pl->start = s->n_computed;
    pl->n_sealed = s->n_sealed;
    pl->n_blocks = s->n_blocks;
  }
  if (n_new > s->n_tokens - pl->start) return false;
  int end = pl->start + n_new;
  int first_write = pl->start > pl->n_sealed * bs ? pl->start : pl->n_sealed * bs;
  pl->w0 = first_write / bs;
  pl->w1 = first_write < end ? (end - 1) / bs : pl->w0 - 1;
  for (int i = pl->w0; i <= pl->w1 && i < pl->n_blocks; i++)
    if (p->blocks[s->table[i]].ref > 1) pl->cow++;
  if (pl->w1 >= pl->n_blocks) pl->grow = pl->w1 + 1 - pl->n_blocks;
  pl->need = hit_cost + pl->cow + pl->grow;
  return true;
}

int pd_kv_seq_prefix_hit(const pd_kv_seq *s) {
  alloc_plan pl;
  if (!seq_plan(s, 0, &pl, NULL) || !pl.claim) return 0;
  return pl.start;
}

int pd_kv_seq_blocks_needed(const pd_kv_seq *s, int n_new) {
  alloc_plan pl;
  return seq_plan(s, n_new, &pl, NULL) ? pl.need : -1;
}

/* The block whose content b will have once the pending copies ran: a pending dst reads
 * through to its src, which keeps pending copies independent of each other. */
static int32_t copy_source(const pd_kv_pool *p, int32_t b) {
  if (!p->blocks[b].copy_dst) return b;
  for (int i = 0; i < p->n_copies; i++)
    if (p->copies[i].dst == b) return p->copies[i].src;
  PD_ASSERT(!"copy_dst block without a pending copy");
  return -1;
}

pd_status pd_kv_seq_allocate(pd_kv_seq *s, int n_new, int32_t *slots, pd_err *e) {
  pd_kv_pool *p = s->pool;
  const int bs = p->block_size;
  alloc_plan pl;
  /* The table's capacity always covers ceil(n_tokens / bs) ids, so hit ids can be staged in
   * it; n_blocks only moves once the allocation is certain. */
  if (!seq_plan(s, n_new, &pl, s->table))
    return pd_err_set(e, PD_EINVAL, "kv allocate: %d new tokens from position %d, but the "
                      "sequence has %d tokens", n_new, pl.start, s->n_tokens);
  if (n_new > 0 && !slots) return pd_err_set(e, PD_EINVAL, "kv allocate: slots is NULL");
  int avail = p->free_list.n + p->lru.n;
  if (pl.need > avail)
    return pd_err_set(e, PD_EFULL, "kv allocate: %d blocks needed, %d available", pl.need, avail);

  if (pl.claim) {
    for (int i = 0; i < pl.hit_blocks; i++) block_ref(p, s->table[i]);
    s->n_blocks = pl.n_blocks;
    s->n_sealed = pl.n_sealed;
    s->n_computed = pl.start;
    p->prefix_queries += (uint64_t)s->n_tokens;
    p->prefix_hits += (uint64_t)pl.start;
  }
  /* Existing blocks about to be written: shared ones are copied, private cached ones lose
   * their hash (their content is about to change). */
  for (int i = pl.w0; i <= pl.w1 && i < s->n_blocks; i++) {
    int32_t b = s->table[i];
    kv_block *k = &p->blocks[b];
    if (k->ref > 1) {
      int32_t src = copy_source(p, b);
      int32_t dst = block_take(p);
      PD_ASSERT(p->n_copies < p->num_blocks);
      p->copies[p->n_copies++] = (pd_kv_copy){src, dst};
      p->blocks[src].pins++;
      p->blocks[dst].copy_dst = 1;
      block_unref(p, b); /* ref stays >= 1: the other owners keep it */
      s->table[i] = dst;
      p->cow_copies++;
    } else if (k->hashed) {
      cache_remove(p, b);
    }
  }
  for (int i = s->n_blocks; i <= pl.w1; i++) s->table[i] = block_take(p);
  if (pl.w1 >= s->n_blocks) s->n_blocks = pl.w1 + 1;

  for (int k = 0; k < n_new; k++) {
    int pos = pl.start + k, blk = pos / bs;
    slots[k] = blk < s->n_sealed ? -1 : s->table[blk] * bs + pos % bs;
  }
  return PD_OK;
}

/* Seals block i of s (full, computed) and, with prefix caching, registers it in the cache or
 * switches s to an identical cached block. */
static void seq_seal(pd_kv_seq *s, int i) {
  pd_kv_pool *p = s->pool;
  const int bs = p->block_size;
  if (!p->prefix_caching) return;
  uint64_t parent_uid = 0;
  if (i > 0) {
    const kv_block *pk = &p->blocks[s->table[i - 1]];
    if (!pk->hashed) return; /* chain broken (prefix cache reset): unreachable, skip */
    parent_uid = pk->uid;
  }
  const int32_t *tok = s->tokens + (size_t)i * bs;
  uint64_t h = s->hashes[i];
  int32_t b = s->table[i];
  kv_block *k = &p->blocks[b];
  if (k->hashed) {
    if (block_matches(p, b, h, parent_uid, s->cache_salt, tok)) return;
    cache_remove(p, b); /* stale registration (rewritten after a truncate) */
  }
  int32_t other = cache_find(p, h, parent_uid, s->cache_salt, tok);
  if (other < 0) {
    cache_insert(p, b, h, parent_uid, s->cache_salt, tok);
  } else if (k->ref == 1) {
    block_ref(p, other);
    s->table[i] = other;
    block_unref(p, b);
    p->dedupes++;
  } else {
    /* Shared with forks: replacing it in s alone would free nothing; keep both cached. */
    cache_insert(p, b, h, parent_uid, s->cache_salt, tok);
  }
}

pd_status pd_kv_seq_commit(pd_kv_seq *s, int n, pd_err *e) {
  const int bs = s->pool->block_size;
  int64_t slots_end = (int64_t)s->n_blocks * bs;
  if (n < 0 || s->n_computed + (int64_t)n > s->n_tokens || s->n_computed + (int64_t)n > slots_end)
    return pd_err_set(e, PD_EINVAL, "kv commit: %d tokens from %d, but the sequence has %d "
                      "tokens and slots for %lld", n, s->n_computed, s->n_tokens,
                      (long long)slots_end);
  s->n_computed += n;
  while ((int64_t)(s->n_sealed + 1) * bs <= s->n_computed) {
    seq_seal(s, s->n_sealed);
    s->n_sealed++;
  }
  return PD_OK;
}

int pd_kv_seq_num_tokens(const pd_kv_seq *s) { return s->n_tokens; }
int pd_kv_seq_num_computed(const pd_kv_seq *s) { return s->n_computed; }
const int32_t *pd_kv_seq_tokens(const pd_kv_seq *s) { return s->tokens; }
const int32_t *pd_kv_seq_block_table(const pd_kv_seq *s) { return s->table; }
int pd_kv_seq_num_blocks(const pd_kv_seq *s) { return s->n_blocks; }
uint64_t pd_kv_seq_cache_salt(const pd_kv_seq *s) { return s->cache_salt; }

/* ---------------------------------------------------------------------------------------- */
/* invariant checker                                                                        */

#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      st = pd_err_set(e, PD_EINVAL, "kv check: " __VA_ARGS__); \
      goto done;                                             \
    }                                                        \
  } while (0)

static pd_status check_list(const pd_kv_pool *p, const kv_list *l, int state, const char *name,
                            pd_err *e) {
  int n = 0;
  int32_t prev = -1;
  for (int32_t b = l->head; b >= 0; b = p->blocks[b].next) {
    if (b >= p->num_blocks || ++n > p->num_blocks)
      return pd_err_set(e, PD_EINVAL, "kv check: %s list is corrupt at block %d", name, b);
    const kv_block *k = &p->blocks[b];
    if (k->prev != prev)
      return pd_err_set(e, PD_EINVAL, "kv check: %s list: block %d has a wrong back link", name, b);
    if (k->state != state)
      return pd_err_set(e, PD_EINVAL, "kv check: block %d in the %s list has state %d", b, name,
                        k->state);
    prev = b;
  }
  if (prev != l->tail || n != l->n)
    return pd_err_set(e, PD_EINVAL, "kv check: %s list has %d blocks (tail %d), counted %d "
                      "(tail %d)", name, l->n, l->tail, n, prev);
  return PD_OK;
}

pd_status pd_kv_pool_check(const pd_kv_pool *p, pd_err *e) {
  pd_status st = PD_OK;
  const int N = p->num_blocks, bs = p->block_size;
  int32_t *refs = calloc((size_t)N, sizeof *refs);
  int32_t *pins = calloc((size_t)N, sizeof *pins);
  int32_t *mark = calloc((size_t)N, sizeof *mark); /* per-sequence stamp: no duplicate ids */
  if (!refs || !pins || !mark) {
    st = pd_err_set(e, PD_ENOMEM, "kv check: out of memory");
    goto done;
  }
  if ((st = check_list(p, &p->free_list, BLK_FREE, "free", e)) != PD_OK) goto done;
  if ((st = check_list(p, &p->lru, BLK_EVICTABLE, "lru", e)) != PD_OK) goto done;

  /* Sequences: their references, and their own bookkeeping. */
  int n_seqs = 0, stamp = 0;
  for (const pd_kv_seq *s = p->seqs; s; s = s->next) {
    CHECK(++n_seqs <= p->n_seqs, "sequence list longer than %d", p->n_seqs);
    CHECK(s->pool == p, "sequence of another pool");
    CHECK(s->n_tokens >= 0 && s->n_computed >= 0 && s->n_computed <= s->n_tokens,
          "sequence computed %d of %d tokens", s->n_computed, s->n_tokens);
    CHECK(s->n_blocks <= (s->n_tokens + bs - 1) / bs && s->n_blocks <= s->cap_blocks,
          "sequence has %d blocks for %d tokens", s->n_blocks, s->n_tokens);
    CHECK((int64_t)s->n_computed <= (int64_t)s->n_blocks * bs,
          "sequence computed %d tokens with %d blocks", s->n_computed, s->n_blocks);
    CHECK(s->n_sealed >= 0 && s->n_sealed <= s->n_blocks && s->n_sealed * bs <= s->n_tokens,
          "sequence sealed %d blocks (has %d, %d tokens)", s->n_sealed, s->n_blocks, s->n_tokens);
    /* The one exception: a full-prompt cache hit leaves the last token to compute. */
    CHECK(s->n_sealed * bs <= s->n_computed + 1,
          "sequence sealed %d blocks but computed only %d tokens", s->n_sealed, s->n_computed);
    stamp++;
    for (int i = 0; i < s->n_blocks; i++) {
      int32_t b = s->table[i];
      CHECK(b >= 0 && b < N, "sequence block %d is out of range", b);
      CHECK(mark[b] != stamp, "block %d appears twice in one sequence", b);
      mark[b] = stamp;
      refs[b]++;
      if (i >= s->n_sealed && p->blocks[b].hashed) {
        /* A cached block past the sealed prefix (left by a truncate) must still hold what it
         * is cached as wherever this sequence computed KV into it: a write must drop the
         * hash (or copy the block) first. */
        int end = s->n_computed < (i + 1) * bs ? s->n_computed : (i + 1) * bs;
        for (int j = i * bs; j < end; j++)
          CHECK(p->tokens[(size_t)b * bs + (j - i * bs)] == s->tokens[j],
                "cached block %d (index %d) was written with other tokens", b, i);
      }
      if (p->prefix_caching && i < s->n_sealed && p->blocks[b].hashed) {
        const kv_block *k = &p->blocks[b];
        CHECK(k->hash == s->hashes[i] && k->salt == s->cache_salt &&
                  memcmp(p->tokens + (size_t)b * bs, s->tokens + (size_t)i * bs,
                         (size_t)bs * sizeof(int32_t)) == 0,
              "sealed block %d (index %d) is cached with other content", b, i);
        /* A cached chain runs through this sequence's own blocks: the parent of sealed block
         * i is exactly block i - 1 of its table (which is hashed too). */
        if (i == 0) {
          CHECK(k->parent_uid == 0, "first block %d has a parent", b);
        } else {
          const kv_block *pk = &p->blocks[s->table[i - 1]];
          CHECK(pk->hashed && pk->uid == k->parent_uid,
                "sealed block %d (index %d) is chained to another parent", b, i);
        }
      }
    }
    if (p->prefix_caching) {
      uint64_t h = s->root;
      for (int i = 0; i < s->n_tokens / bs; i++) {
        h = p->hash_fn(h, s->tokens + (size_t)i * bs, bs);
        CHECK(h == s->hashes[i], "sequence block hash %d is stale", i);
      }
    }
  }
  CHECK(n_seqs == p->n_seqs, "%d sequences listed, %d counted", p->n_seqs, n_seqs);

  /* Pending copies: distinct dsts held by sequences, sources that are not dsts. */
  for (int i = 0; i < p->n_copies; i++) {
    int32_t src = p->copies[i].src, dst = p->copies[i].dst;
    CHECK(src >= 0 && src < N && dst >= 0 && dst < N && src != dst, "bad copy %d -> %d", src, dst);
    CHECK(p->blocks[dst].copy_dst && refs[dst] > 0, "copy dst %d is not a held pending dst", dst);
    CHECK(!p->blocks[src].copy_dst, "copy source %d is itself a pending dst", src);
    pins[src]++;
    for (int j = 0; j < i; j++) CHECK(p->copies[j].dst != dst, "two copies into block %d", dst);
  }

  /* Blocks: state against counts, and the hash table. */
  int used = 0, pinned = 0, hashed = 0, ncopy_dst = 0;
  for (int32_t b = 0; b < N; b++) {
    const kv_block *k = &p->blocks[b];
    CHECK(k->ref == refs[b], "block %d has ref %d but %d references", b, k->ref, refs[b]);
    CHECK(k->pins == pins[b], "block %d has %d pins but %d pending copies read it", b, k->pins,
          pins[b]);
    switch (k->state) {
      case BLK_FREE: CHECK(k->ref == 0 && k->pins == 0 && !k->hashed, "free block %d is busy", b); break;
      case BLK_EVICTABLE:
        CHECK(k->ref == 0 && k->pins == 0 && k->hashed, "evictable block %d is busy or unhashed", b);
        break;
      case BLK_USED: CHECK(k->ref > 0, "used block %d has no reference", b); used++; break;
      case BLK_PINNED: CHECK(k->ref == 0 && k->pins > 0, "pinned block %d is wrong", b); pinned++; break;
      default: CHECK(0, "block %d has state %d", b, k->state);
    }
    if (k->copy_dst) ncopy_dst++;
    if (k->hashed) {
      hashed++;
      CHECK(k->uid > 0 && k->uid < p->next_uid, "block %d has uid %llu", b,
            (unsigned long long)k->uid);
      int found = 0;
      for (const pd_map_slot *x = pd_map_u64_find(&p->index, index_hash(k->hash), k->hash); x;
           x = pd_map_u64_next(&p->index, x, k->hash))
        if (x->val == (uint64_t)b) found++;
      CHECK(found == 1, "hashed block %d is %d times in the prefix-cache index", b, found);
    } else {
      CHECK(k->uid == 0, "unhashed block %d keeps uid %llu", b, (unsigned long long)k->uid);
    }
  }
  CHECK(ncopy_dst == p->n_copies, "%d pending-dst flags for %d copies", ncopy_dst, p->n_copies);
  CHECK(used == p->n_used && pinned == p->n_pinned && hashed == p->n_hashed,
        "counters used %d pinned %d hashed %d, counted %d %d %d", p->n_used, p->n_pinned,
        p->n_hashed, used, pinned, hashed);
  CHECK(p->free_list.n + p->lru.n + used + pinned == N,
        "free %d + evictable %d + used %d + pinned %d != %d blocks", p->free_list.n, p->lru.n,
        used, pinned, N);
  const pd_map_slot *x;
  for (pd_map_it it = {0}; (x = pd_map_next(&p->index, &it));) {
    int32_t c = x->val < (uint64_t)N ? (int32_t)x->val : -1;
    CHECK(c >= 0 && p->blocks[c].hashed && p->blocks[c].hash == x->key,
          "prefix-cache index entry %016llx -> %lld is not a hashed block of that hash",
          (unsigned long long)x->key, (long long)x->val);
  }
  CHECK(pd_map_count(&p->index) == (size_t)hashed, "prefix-cache index holds %zu blocks, %d are "
        "hashed", pd_map_count(&p->index), hashed);
done:
  free(refs);
  free(pins);
  free(mark);
  return st;
}
