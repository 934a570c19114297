/* Block hashes for the prefix cache: XXH64 (Yann Collet's xxHash, 64-bit variant), written
 * here for two input shapes: bytes (the salt) and int32 token ids, which are hashed as their
 * little-endian bytes so every host computes the same chain. Test vectors come from the
 * reference implementation (python-xxhash). */
#include <string.h>

#include "pd/kvcache.h"

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t xxh_round(uint64_t acc, uint64_t lane) {
  acc += lane * P2;
  acc = rotl64(acc, 31);
  return acc * P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t v) {
  acc ^= xxh_round(0, v);
  return acc * P1 + P4;
}

static inline uint64_t xxh_avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

/* Little-endian loads, independent of the host's byte order. */
static inline uint64_t le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static inline uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The token stream seen as bytes: lane k (8 bytes) is tokens 2k and 2k+1, little-endian. */
static inline uint64_t tok64(const int32_t *t) {
  return (uint64_t)(uint32_t)t[0] | (uint64_t)(uint32_t)t[1] << 32;
}

static uint64_t xxh64_bytes(const uint8_t *p, size_t len, uint64_t seed) {
  const uint8_t *end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const uint8_t *limit = end - 32;
    do {
      v1 = xxh_round(v1, le64(p));
      v2 = xxh_round(v2, le64(p + 8));
      v3 = xxh_round(v3, le64(p + 16));
      v4 = xxh_round(v4, le64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = xxh_merge(h, v1);
    h = xxh_merge(h, v2);
    h = xxh_merge(h, v3);
    h = xxh_merge(h, v4);
  } else {
    h = seed + P5;
  }
  h += (uint64_t)len;
  while (p + 8 <= end) {
    h ^= xxh_round(0, le64(p));
    h = rotl64(h, 27) * P1 + P4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= (uint64_t)le32(p) * P1;
    h = rotl64(h, 23) * P2 + P3;
    p += 4;
  }
  while (p < end) {
    h ^= (uint64_t)(*p) * P5;
    h = rotl64(h, 11) * P1;
    p++;
  }
  return xxh_avalanche(h);
}

/* Same function over n int32 tokens (4n bytes): no 1-byte tail since the length is a multiple
 * of 4. */
static uint64_t xxh64_tokens(const int32_t *t, size_t n, uint64_t seed) {
  const int32_t *end = t + n;
  uint64_t h;
  if (n >= 8) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const int32_t *limit = end - 8;
    do {
      v1 = xxh_round(v1, tok64(t));
      v2 = xxh_round(v2, tok64(t + 2));
      v3 = xxh_round(v3, tok64(t + 4));
      v4 = xxh_round(v4, tok64(t + 6));
      t += 8;
    } while (t <= limit);
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = xxh_merge(h, v1);
    h = xxh_merge(h, v2);
    h = xxh_merge(h, v3);
    h = xxh_merge(h, v4);
  } else {
    h = seed + P5;
  }
  h += (uint64_t)n * 4;
  while (t + 2 <= end) {
    h ^= xxh_round(0, tok64(t));
    h = rotl64(h, 27) * P1 + P4;
    t += 2;
  }
  if (t < end) {
    h ^= (uint64_t)(uint32_t)t[0] * P1;
    h = rotl64(h, 23) * P2 + P3;
  }
  return xxh_avalanche(h);
}

uint64_t pd_kv_hash_block(uint64_t parent, const int32_t *tokens, int n) {
  return xxh64_tokens(tokens, n > 0 ? (size_t)n : 0, parent);
}

uint64_t pd_kv_hash_root(const void *salt, size_t salt_len, uint64_t cache_salt) {
  uint64_t root = xxh64_bytes(salt ? (const uint8_t *)salt : (const uint8_t *)"", salt ? salt_len : 0, 0);
  if (cache_salt != 0) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(cache_salt >> (8 * i));
    root = xxh64_bytes(b, sizeof b, root);
  }
  return root;
}
