/* Block hashes for the prefix cache: XXH64 (libxxhash) over the token ids as little-endian int32
 * bytes, so every host computes the same chain (test vectors from python-xxhash in
 * tests/unit/test_kvcache.c). */
#include <string.h>
#include <xxhash.h>

#include "pd/kvcache.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the prefix hash reads token ids as little-endian bytes: add a byte swap for this host"
#endif

uint64_t pd_kv_hash_block(uint64_t parent, const int32_t *tokens, int n) {
  return XXH64(tokens, n > 0 ? (size_t)n * sizeof *tokens : 0, parent);
}

uint64_t pd_kv_cache_salt(const char *s) {
  if (!s || !*s) return 0;
  uint64_t h = pd_kv_hash_root(s, strlen(s), 0);
  return h ? h : 1;
}

uint64_t pd_kv_hash_root(const void *salt, size_t salt_len, uint64_t cache_salt) {
  uint64_t root = XXH64(salt ? salt : "", salt ? salt_len : 0, 0);
  if (cache_salt != 0) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(cache_salt >> (8 * i));
    root = XXH64(b, sizeof b, root);
  }
  return root;
}
