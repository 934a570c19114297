/* The block KV cache manager: host-side bookkeeping for the paged KV cache (the vLLM v1
 * KVCacheManager design). The K/V tensors themselves live in backend memory, per layer
 *   k, v: [num_blocks, num_kv_heads, block_size, head_dim]   (see pd/backend.h)
 * and a token's slot is block_id * block_size + offset_in_block. This module only decides
 * which block ids a sequence uses; it never touches the tensors.
 *
 * Objects
 *   pd_kv_pool  num_blocks fixed-size blocks with reference counts, a free list, an LRU list
 *               of evictable cached blocks, the prefix-cache hash table and pending COW copies.
 *   pd_kv_seq   one sequence: its token ids, block table (block ids in position order), the
 *               number of tokens whose KV is computed. Owned by the pool that created it.
 *
 * One step of the engine, per scheduled sequence s:
 *   1. pd_kv_seq_append_tokens(s, ...)       the tokens to compute must be known (prompt at
 *                                           create; sampled or draft tokens later)
 *   2. pd_kv_seq_allocate(s, n, slots, e)    reserve KV slots for the next n tokens; PD_EFULL
 *                                           means "preempt or wait", with nothing changed
 *   3. pd_kv_pool_copies(p, &c) then pd_kv_pool_copies_done(p): run the copy-on-write block
 *      copies on the backend (all layers, K and V) before the forward step
 *   4. forward: kv_write of the n tokens' K/V into slots (a negative slot: skip, the KV is
 *      already in the cache), attention over pd_kv_seq_block_table(s)
 *   5. pd_kv_seq_commit(s, n)                 those tokens' KV is now computed; full blocks
 *                                           become shareable through the prefix cache
 * Block tables may change at allocate (copy-on-write) and at commit (dedupe): rebuild the
 * backend's block tables from pd_kv_seq_block_table every step.
 *
 * Prefix caching. A FULL block is identified by a 64-bit hash chained over the previous block's
 * hash and its block_size token ids, rooted at a hash of the pool's salt (model identity) and
 * the sequence's cache_salt (tenant isolation). A hit is only taken after an exact check: the
 * stored token ids of the block, the cache salt, and the identity (a never-reused registration
 * id) of the previous block in the chain must all match, so a hash collision can never cause
 * wrong reuse; it only costs a missed hit. A fresh sequence (no blocks yet) claims its longest
 * cached prefix at its first pd_kv_seq_allocate; those tokens count as computed, but at least
 * the last prompt token is always left to compute so the engine produces logits. When every
 * prompt block is cached, the last token's slot is -1: its KV is already in the shared block,
 * which must not be written, and attention reads it from there.
 * Unreferenced cached blocks stay in an LRU list (evictable) and keep their hash; a cached block
 * is evicted only when a new block is needed and the free list is empty. A sequence releases its
 * blocks last-to-first so that, among its blocks, the tail is evicted before the shared prefix.
 * Duplicates: when a sequence commits a full block identical to one already cached (two
 * requests with the same prompt computed in the same step), the sequence switches to the cached
 * block and its own copy returns to the free list at once (dedupe); if its copy is shared with
 * forks it is registered as well and both stay (either may serve a later hit).
 *
 * Copy-on-write. pd_kv_seq_fork shares every block (ref++). A sequence about to write into a
 * block whose ref count is > 1 gets a new block and a copy instruction (src -> dst) instead.
 * Pending copies are independent (distinct dsts, no block is both a src and a dst), so they may
 * run in any order or in one batched kernel; their sources are pinned (never reallocated) until
 * pd_kv_pool_copies_done.
 *
 * Not thread-safe: one scheduler thread owns a pool and its sequences. No function here
 * allocates memory except create, append, fork and pd_kv_pool_check. */
#ifndef PD_KVCACHE_H
#define PD_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/dtype.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_KV_DEFAULT_BLOCK_SIZE 16

typedef struct pd_kv_pool pd_kv_pool;
typedef struct pd_kv_seq pd_kv_seq;

/* Hash of one full block given its parent's hash (or the root). Must be deterministic. */
typedef uint64_t (*pd_kv_hash_fn)(uint64_t parent, const int32_t *tokens, int n);

typedef struct pd_kv_pool_opts {
  int num_blocks;              /* > 0; see pd_kv_num_blocks_for_budget */
  int block_size;              /* tokens per block; 0 means PD_KV_DEFAULT_BLOCK_SIZE */
  bool disable_prefix_caching; /* zero-initialised opts have prefix caching on */
  const void *salt;            /* model identity (name, revision, dtype, ...), may be NULL */
  size_t salt_len;
  pd_kv_hash_fn hash_fn;       /* NULL: pd_kv_hash_block. Tests inject weak hashes here. */
} pd_kv_pool_opts;

/* One block copy for the engine: block dst := block src, in every layer, K and V. */
typedef struct pd_kv_copy {
  int32_t src;
  int32_t dst;
} pd_kv_copy;

typedef struct pd_kv_stats {
  int num_blocks;
  int block_size;
  int used;       /* referenced by at least one sequence */
  int free;       /* unreferenced, no hash */
  int evictable;  /* unreferenced, hashed (in the LRU) */
  int pinned;     /* unreferenced but read by a pending copy */
  int cached;     /* blocks with a registered hash (used or evictable) */
  int num_seqs;
  double usage;   /* 1 - (free + evictable) / num_blocks */
  uint64_t prefix_queries; /* prompt tokens of sequences that looked up the prefix cache */
  uint64_t prefix_hits;    /* of those, tokens taken from the cache (counted as computed) */
  uint64_t evictions;      /* cached blocks whose hash was dropped to reuse the block */
  uint64_t cow_copies;     /* copy-on-write block copies emitted */
  uint64_t dedupes;        /* committed blocks replaced by an identical cached block */
} pd_kv_stats;

/* ---- sizing ---- */

/* Bytes one block occupies across all layers, K and V:
 * 2 * n_layers * n_kv_heads * block_size * head_dim * sizeof(dt). 0 on a non-positive
 * argument, an unknown dtype or overflow. */
size_t pd_kv_block_bytes(int n_layers, int n_kv_heads, int head_dim, int block_size,
                         pd_dtype dt);
/* How many blocks fit in budget_bytes: floor(budget / block_bytes), capped so that every slot
 * id (num_blocks * block_size) fits in int32. 0 when not even one block fits or on bad args. */
int pd_kv_num_blocks_for_budget(size_t budget_bytes, size_t block_bytes, int block_size);

/* ---- hashing (public so a router can compute the same chain for cache affinity) ---- */

/* XXH64 of the token ids as little-endian int32 bytes, seeded with parent. */
uint64_t pd_kv_hash_block(uint64_t parent, const int32_t *tokens, int n);
/* The chain's root: XXH64 of salt, then, when cache_salt != 0, mixed with cache_salt.
 * Block i's hash is pd_kv_hash_block(hash of block i-1 (or the root), tokens + i*bs, bs). */
uint64_t pd_kv_hash_root(const void *salt, size_t salt_len, uint64_t cache_salt);
/* A request's cache_salt string as the 64-bit salt of pd_kv_hash_root (0 for NULL or "": no
 * salt; never 0 otherwise). */
uint64_t pd_kv_cache_salt(const char *s);

/* ---- pool ---- */

pd_kv_pool *pd_kv_pool_create(const pd_kv_pool_opts *o, pd_err *e);
/* Frees the pool and every sequence still alive in it. NULL is a no-op. */
void pd_kv_pool_free(pd_kv_pool *p);

int pd_kv_pool_block_size(const pd_kv_pool *p);
int pd_kv_pool_num_blocks(const pd_kv_pool *p);
/* Blocks an allocation can take now: free + evictable. */
int pd_kv_pool_num_available(const pd_kv_pool *p);
/* ceil(n_tokens / block_size): the blocks n_tokens occupy, for rough admission estimates. */
int pd_kv_pool_blocks_for_tokens(const pd_kv_pool *p, int n_tokens);
void pd_kv_pool_stats(const pd_kv_pool *p, pd_kv_stats *out);

/* Number of leading tokens of tokens[0..n) whose KV is cached, in whole blocks (not capped at
 * n - 1). No side effects, not counted in the stats. 0 when prefix caching is off. */
int pd_kv_pool_lookup_prefix(const pd_kv_pool *p, const int32_t *tokens, int n,
                             uint64_t cache_salt);

/* Drops every hash: nothing computed before the call is ever matched again (use after a weight
 * update). Evictable blocks become free; blocks in use stay with their sequences (whose later
 * blocks are then not cached). Returns the number of hashes dropped. */
int pd_kv_pool_reset_prefix_cache(pd_kv_pool *p);

/* The pending copy-on-write copies (valid until the next call that changes the pool). */
int pd_kv_pool_copies(const pd_kv_pool *p, const pd_kv_copy **copies);
/* Declares the pending copies executed (or enqueued on the stream ahead of the forward step's
 * KV writes): clears the list and unpins their sources. */
void pd_kv_pool_copies_done(pd_kv_pool *p);

/* Walks the whole pool and verifies its invariants: every block's ref count equals the number
 * of references from live sequences' block tables; free + evictable + used + pinned == total;
 * list membership matches each block's state; the hash table holds exactly the hashed blocks;
 * sealed blocks of a sequence that are hashed store that sequence's tokens and hash; pending
 * copies are independent. O(num_blocks + total table length); allocates scratch memory.
 * PD_OK, or PD_EINVAL naming the first violation (PD_ENOMEM if scratch allocation fails). */
pd_status pd_kv_pool_check(const pd_kv_pool *p, pd_err *e);

/* ---- sequences ---- */

/* A new sequence holding a copy of tokens[0..n) (n >= 0) and no blocks. cache_salt != 0
 * isolates its prefix-cache entries from sequences with another salt (per-tenant caches). */
pd_kv_seq *pd_kv_seq_create(pd_kv_pool *p, const int32_t *tokens, int n, uint64_t cache_salt,
                            pd_err *e);
/* Releases every block (abort at any point) and frees the sequence. Blocks whose last
 * reference goes away go to the LRU when hashed, else to the free list. NULL is a no-op. */
void pd_kv_seq_free(pd_kv_seq *s);
/* A new sequence sharing all of s's blocks (ref++) with copies of its tokens and progress.
 * The first write of either into a shared block triggers copy-on-write. */
pd_kv_seq *pd_kv_seq_fork(pd_kv_seq *s, pd_err *e);

/* Appends known token ids (sampled, or speculative drafts) not yet computed. */
pd_status pd_kv_seq_append_tokens(pd_kv_seq *s, const int32_t *tokens, int n, pd_err *e);
/* Keeps the first n tokens (0 <= n <= num_tokens), e.g. to drop rejected draft tokens: the
 * computed count is clamped to n and blocks past ceil(n / block_size) are released. */
pd_status pd_kv_seq_truncate(pd_kv_seq *s, int n, pd_err *e);
/* Releases all blocks and forgets computed progress but keeps the tokens: preemption by
 * recompute. The next allocate looks up the prefix cache again. */
void pd_kv_seq_release(pd_kv_seq *s);

/* Tokens pd_kv_seq_allocate would take from the prefix cache right now: for a sequence with no
 * blocks and nothing computed, its longest cached prefix in whole blocks, capped at
 * num_tokens - 1; otherwise 0. No side effects. */
int pd_kv_seq_prefix_hit(const pd_kv_seq *s);
/* Blocks pd_kv_seq_allocate(s, n_new) would take from the free + evictable pool (cached prefix
 * blocks it claims out of the LRU, new blocks, copy-on-write blocks); allocate succeeds iff
 * this is <= pd_kv_pool_num_available. -1 when n_new is invalid. */
int pd_kv_seq_blocks_needed(const pd_kv_seq *s, int n_new);
/* Reserves KV slots for the next n_new tokens, positions [c, c + n_new) where c is
 * pd_kv_seq_num_computed after the prefix claim (a fresh sequence first claims its cached
 * prefix, see pd_kv_seq_prefix_hit). c + n_new must be <= num_tokens. Writes n_new slot ids
 * into slots: block_id * block_size + offset, or -1 where the position lies in a full block
 * whose KV is already present (do not write it). May emit copy-on-write copies.
 * PD_EFULL when not enough blocks are available: nothing changed (no claim, no eviction).
 * PD_EINVAL on bad arguments. Never allocates memory. */
pd_status pd_kv_seq_allocate(pd_kv_seq *s, int n_new, int32_t *slots, pd_err *e);
/* Marks the next n tokens' KV computed (they must have slots). Full blocks are sealed and,
 * with prefix caching, registered (or deduplicated against an identical cached block). */
pd_status pd_kv_seq_commit(pd_kv_seq *s, int n, pd_err *e);

int pd_kv_seq_num_tokens(const pd_kv_seq *s);
int pd_kv_seq_num_computed(const pd_kv_seq *s);
const int32_t *pd_kv_seq_tokens(const pd_kv_seq *s);
/* The block table: pd_kv_seq_num_blocks(s) block ids in position order; valid until the next
 * call that changes s or the pool. */
const int32_t *pd_kv_seq_block_table(const pd_kv_seq *s);
int pd_kv_seq_num_blocks(const pd_kv_seq *s);
uint64_t pd_kv_seq_cache_salt(const pd_kv_seq *s);

#ifdef __cplusplus
}
#endif
#endif
