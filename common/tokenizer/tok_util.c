/* Small building blocks of the tokenizer: byte buffers, hash maps, an arena, UTF-8 and Unicode
 * predicates, the GPT-2 byte-level alphabet, PCRE2 helpers and JSON accessors. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "tok_internal.h"

/* ================================================================ tk_buf */

bool tk_buf_reserve(tk_buf *b, size_t extra) {
  if (b->cap - b->n > extra) return true; /* keep one spare byte for tk_buf_cstr */
  size_t need = b->n + extra + 1;
  if (need < b->n) return false;
  size_t cap = b->cap ? b->cap : 64;
  while (cap < need) {
    if (cap > SIZE_MAX / 2) return false;
    cap *= 2;
  }
  char *p = realloc(b->p, cap);
  if (!p) return false;
  b->p = p;
  b->cap = cap;
  return true;
}

bool tk_buf_put(tk_buf *b, const void *s, size_t n) {
  if (!n) return true;
  if (!tk_buf_reserve(b, n)) return false;
  memcpy(b->p + b->n, s, n);
  b->n += n;
  return true;
}

bool tk_buf_putc(tk_buf *b, char c) {
  if (!tk_buf_reserve(b, 1)) return false;
  b->p[b->n++] = c;
  return true;
}

bool tk_buf_cstr(tk_buf *b) {
  if (!tk_buf_reserve(b, 0)) return false;
  b->p[b->n] = 0;
  return true;
}

void tk_buf_free(tk_buf *b) {
  free(b->p);
  b->p = NULL;
  b->n = b->cap = 0;
}

/* ================================================================ hashing */

static uint32_t hash_bytes(const char *s, size_t n) {
  /* FNV-1a, finished with a murmur3 mix so that the low bits (the slot index) are good. */
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) {
    h ^= (unsigned char)s[i];
    h *= 1099511628211ULL;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  return (uint32_t)h;
}

static uint64_t hash_u64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* Slots for `expected` keys at a load factor of at most 1/2 (linear probing). */
static size_t table_size(size_t expected) {
  size_t cap = 16;
  while (cap < expected * 2) cap *= 2;
  return cap;
}

/* ================================================================ tk_strmap */

bool tk_strmap_init(tk_strmap *m, size_t expected) {
  size_t cap = table_size(expected);
  if (cap > UINT32_MAX) return false;
  m->e = calloc(cap, sizeof *m->e);
  if (!m->e) return false;
  m->mask = (uint32_t)(cap - 1);
  m->n = 0;
  return true;
}

static bool strmap_grow(tk_strmap *m) {
  tk_strmap bigger;
  if (!tk_strmap_init(&bigger, (size_t)(m->mask + 1))) return false;
  for (uint32_t i = 0; i <= m->mask; i++) {
    tk_strmap_ent *x = &m->e[i];
    if (!x->s) continue;
    uint32_t j = x->hash & bigger.mask;
    while (bigger.e[j].s) j = (j + 1) & bigger.mask;
    bigger.e[j] = *x;
    bigger.n++;
  }
  free(m->e);
  *m = bigger;
  return true;
}

bool tk_strmap_put(tk_strmap *m, const char *s, size_t len, int32_t val) {
  if (len > UINT32_MAX) return false;
  if ((size_t)(m->n + 1) * 2 > (size_t)m->mask + 1 && !strmap_grow(m)) return false;
  uint32_t h = hash_bytes(s, len), i = h & m->mask;
  while (m->e[i].s) {
    tk_strmap_ent *x = &m->e[i];
    if (x->hash == h && x->len == len && memcmp(x->s, s, len) == 0) {
      x->val = val;
      return true;
    }
    i = (i + 1) & m->mask;
  }
  m->e[i] = (tk_strmap_ent){s, (uint32_t)len, h, val};
  m->n++;
  return true;
}

int32_t tk_strmap_get(const tk_strmap *m, const char *s, size_t len) {
  if (!m->e) return -1;
  uint32_t h = hash_bytes(s, len), i = h & m->mask;
  while (m->e[i].s) {
    const tk_strmap_ent *x = &m->e[i];
    if (x->hash == h && x->len == len && memcmp(x->s, s, len) == 0) return x->val;
    i = (i + 1) & m->mask;
  }
  return -1;
}

void tk_strmap_free(tk_strmap *m) {
  free(m->e);
  m->e = NULL;
  m->mask = m->n = 0;
}

/* ================================================================ tk_u64map */

#define U64_EMPTY UINT64_MAX

bool tk_u64map_init(tk_u64map *m, size_t expected) {
  size_t cap = table_size(expected);
  if (cap > UINT32_MAX) return false;
  m->k = malloc(cap * sizeof *m->k);
  m->v = malloc(cap * sizeof *m->v);
  if (!m->k || !m->v) {
    free(m->k);
    free(m->v);
    m->k = m->v = NULL;
    return false;
  }
  memset(m->k, 0xff, cap * sizeof *m->k);
  m->mask = (uint32_t)(cap - 1);
  m->n = 0;
  return true;
}

static bool u64map_grow(tk_u64map *m) {
  tk_u64map bigger;
  if (!tk_u64map_init(&bigger, (size_t)(m->mask + 1))) return false;
  for (uint32_t i = 0; i <= m->mask; i++) {
    if (m->k[i] == U64_EMPTY) continue;
    uint32_t j = (uint32_t)hash_u64(m->k[i]) & bigger.mask;
    while (bigger.k[j] != U64_EMPTY) j = (j + 1) & bigger.mask;
    bigger.k[j] = m->k[i];
    bigger.v[j] = m->v[i];
    bigger.n++;
  }
  tk_u64map_free(m);
  *m = bigger;
  return true;
}

bool tk_u64map_put(tk_u64map *m, uint64_t k, uint64_t v) {
  PD_ASSERT(k != U64_EMPTY);
  if ((size_t)(m->n + 1) * 2 > (size_t)m->mask + 1 && !u64map_grow(m)) return false;
  uint32_t i = (uint32_t)hash_u64(k) & m->mask;
  while (m->k[i] != U64_EMPTY) {
    if (m->k[i] == k) {
      m->v[i] = v;
      return true;
    }
    i = (i + 1) & m->mask;
  }
  m->k[i] = k;
  m->v[i] = v;
  m->n++;
  return true;
}

bool tk_u64map_get(const tk_u64map *m, uint64_t k, uint64_t *v) {
  if (!m->k) return false;
  uint32_t i = (uint32_t)hash_u64(k) & m->mask;
  while (m->k[i] != U64_EMPTY) {
    if (m->k[i] == k) {
      *v = m->v[i];
      return true;
    }
    i = (i + 1) & m->mask;
  }
  return false;
}

void tk_u64map_free(tk_u64map *m) {
  free(m->k);
  free(m->v);
  m->k = m->v = NULL;
  m->mask = m->n = 0;
}

/* ================================================================ tk_arena */

struct tk_arena_blk {
  tk_arena_blk *next;
  size_t used, cap;
  char data[];
};

char *tk_arena_dup(tk_arena *a, const char *s, size_t n) {
  if (n >= SIZE_MAX / 2) return NULL;
  tk_arena_blk *b = a->head;
  if (!b || b->cap - b->used < n + 1) {
    size_t cap = n + 1 > (1u << 20) ? n + 1 : (1u << 20);
    b = malloc(sizeof *b + cap);
    if (!b) return NULL;
    b->next = a->head;
    b->used = 0;
    b->cap = cap;
    a->head = b;
  }
  char *p = b->data + b->used;
  if (n) memcpy(p, s, n);
  p[n] = 0;
  b->used += n + 1;
  return p;
}

void tk_arena_free(tk_arena *a) {
  tk_arena_blk *b = a->head;
  while (b) {
    tk_arena_blk *next = b->next;
    free(b);
    b = next;
  }
  a->head = NULL;
}

/* ================================================================ UTF-8 */

const char tk_fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Examines the sequence starting at s[i] (a byte >= 0x80). Returns the length of the complete
 * valid character, or 0 with *sub = the length of its maximal invalid subpart, and *incomplete
 * = true when the subpart runs into the end of the data (more bytes could complete it). */
static size_t utf8_seq(const unsigned char *s, size_t n, size_t i, size_t *sub, bool *incomplete) {
  unsigned char c = s[i];
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  *incomplete = false;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
  } else {
    *sub = 1;
    return 0;
  }
  size_t j = 1;
  for (; j <= need; j++) {
    if (i + j >= n) {
      *incomplete = true;
      break;
    }
    unsigned char b = s[i + j];
    unsigned char l = j == 1 ? lo : 0x80, h = j == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
  }
  if (j > need) return need + 1;
  *sub = j;
  return 0;
}

size_t tk_utf8_valid_prefix(const char *str, size_t n) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < n) {
    /* ASCII runs eight bytes at a time. */
    while (i + 8 <= n) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    if (s[i] < 0x80) {
      i++;
      continue;
    }
    size_t sub;
    bool inc;
    size_t l = utf8_seq(s, n, i, &sub, &inc);
    if (!l) return i;
    i += l;
  }
  return n;
}

int tk_utf8_len(unsigned char c) {
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c >= 0xE0 && c <= 0xEF) return 3;
  if (c >= 0xF0 && c <= 0xF4) return 4;
  return 1;
}

int tk_utf8_next(const char *str, size_t n, uint32_t *cp) {
  const unsigned char *s = (const unsigned char *)str;
  int l = tk_utf8_len(s[0]);
  if ((size_t)l > n) l = 1;
  switch (l) {
    case 1: *cp = s[0]; break;
    case 2: *cp = ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F); break;
    case 3: *cp = ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F); break;
    default:
      *cp = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
            ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
  }
  return l;
}

int tk_utf8_encode(uint32_t cp, char out[4]) {
  if (cp < 0x80) {
    out[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = (char)(0xF0 | (cp >> 18));
  out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  out[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

size_t tk_utf8_lossy(tk_buf *out, const unsigned char *s, size_t n, bool final) {
  size_t i = 0, run = 0; /* s[run, i) is valid and not yet copied */
  while (i < n) {
    if (s[i] < 0x80) {
      i++;
      continue;
    }
    size_t sub;
    bool inc;
    size_t l = utf8_seq(s, n, i, &sub, &inc);
    if (l) {
      i += l;
      continue;
    }
    if (!tk_buf_put(out, s + run, i - run)) return (size_t)-1;
    if (inc && !final) return i;
    if (!tk_buf_put(out, tk_fffd, 3)) return (size_t)-1;
    i += sub;
    run = i;
  }
  if (n > run && !tk_buf_put(out, s + run, n - run)) return (size_t)-1; /* s may be NULL if n == 0 */
  return n;
}

bool tk_is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

bool tk_is_word_char(uint32_t c) {
  if (c < 0x80)
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
  }
}

/* ================================================================ byte-level alphabet */

static tk_bytelevel g_bytelevel;
static pthread_once_t g_bytelevel_once = PTHREAD_ONCE_INIT;

/* GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes to
 * U+0100.. in increasing byte order. */
static void bytelevel_init(void) {
  int extra = 0;
  for (int i = 0; i < 324; i++) g_bytelevel.dec[i] = -1;
  for (int b = 0; b < 256; b++) {
    bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    uint32_t cp = printable ? (uint32_t)b : (uint32_t)(256 + extra++);
    char tmp[4];
    int l = tk_utf8_encode(cp, tmp);
    memcpy(g_bytelevel.enc[b], tmp, (size_t)l);
    g_bytelevel.enc_len[b] = (uint8_t)l;
    g_bytelevel.dec[cp] = (int16_t)b;
  }
}

const tk_bytelevel *tk_bytelevel_table(void) {
  pthread_once(&g_bytelevel_once, bytelevel_init);
  return &g_bytelevel;
}

bool tk_bytelevel_encode(tk_buf *out, const char *s, size_t n) {
  const tk_bytelevel *bl = tk_bytelevel_table();
  if (!tk_buf_reserve(out, 2 * n)) return false;
  for (size_t i = 0; i < n; i++) {
    unsigned char b = (unsigned char)s[i];
    memcpy(out->p + out->n, bl->enc[b], bl->enc_len[b]);
    out->n += bl->enc_len[b];
  }
  return true;
}

/* ================================================================ regex */

bool tk_ranges_push(tk_ranges *r, size_t s, size_t e) {
  if (r->n == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 64;
    tk_range *v = realloc(r->v, cap * sizeof *v);
    if (!v) return false;
    r->v = v;
    r->cap = cap;
  }
  r->v[r->n++] = (tk_range){s, e};
  return true;
}

void tk_ranges_free(tk_ranges *r) {
  free(r->v);
  r->v = NULL;
  r->n = r->cap = 0;
}

pcre2_code *tk_re_compile(const char *pat, size_t len, bool literal, const char *what, pd_err *e) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &err, &off, NULL);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    pd_err_set(e, PD_EUNSUPPORTED, "%s: cannot compile pattern at offset %zu: %s", what,
               (size_t)off, (const char *)msg);
    return NULL;
  }
  /* JIT is an optimisation only: without it pcre2_match interprets. */
  (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
  return re;
}

pd_status tk_re_find_all(const pcre2_code *re, const char *s, size_t n, pcre2_match_data *md,
                         tk_ranges *out, pd_err *e) {
  out->n = 0;
  size_t last_end = 0, last_match_end = 0;
  bool have_last = false;
  while (last_end <= n) {
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, md, NULL);
    /* The JIT stack is small (32 KiB); long runs of a repeated class can exhaust it. The
     * interpreter keeps its backtracking frames on the heap. */
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                       NULL);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      return pd_err_set(e, rc == PCRE2_ERROR_NOMEMORY ? PD_ENOMEM : PD_EINVAL,
                        "regex match failed: %s", (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t ms = ov[0], me = ov[1];
    if (ms > me || me > n) return pd_err_set(e, PD_EUNSUPPORTED, "regex match with \\K is not supported");
    if (ms == me && have_last && last_match_end == me) {
      if (last_end >= n) break;
      last_end += (size_t)tk_utf8_len((unsigned char)s[last_end]);
      continue;
    }
    last_end = me;
    last_match_end = me;
    have_last = true;
    if (!tk_ranges_push(out, ms, me)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  return PD_OK;
}

/* memmem without the GNU dependency on the needle length > 0. */
static const char *find_lit(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn > hn) return NULL;
  const char *end = h + (hn - nn);
  for (const char *p = h; p <= end;) {
    p = memchr(p, nd[0], (size_t)(end - p) + 1);
    if (!p) return NULL;
    if (memcmp(p, nd, nn) == 0) return p;
    p++;
  }
  return NULL;
}

pd_status tk_replace_all(const pcre2_code *re, const char *lit, size_t lit_len, const char *rep,
                         size_t rep_len, const char *s, size_t n, pcre2_match_data *md,
                         tk_ranges *scratch, tk_buf *out, pd_err *e) {
  if (!re) {
    PD_ASSERT(lit_len > 0);
    size_t i = 0;
    while (i < n) {
      const char *p = find_lit(s + i, n - i, lit, lit_len);
      size_t stop = p ? (size_t)(p - s) : n;
      if (!tk_buf_put(out, s + i, stop - i)) goto oom;
      if (!p) return PD_OK;
      if (!tk_buf_put(out, rep, rep_len)) goto oom;
      i = stop + lit_len;
    }
    return PD_OK;
  }
  pd_status st = tk_re_find_all(re, s, n, md, scratch, e);
  if (st) return st;
  size_t prev = 0;
  for (size_t k = 0; k < scratch->n; k++) {
    if (!tk_buf_put(out, s + prev, scratch->v[k].s - prev)) goto oom;
    if (!tk_buf_put(out, rep, rep_len)) goto oom;
    prev = scratch->v[k].e;
  }
  if (!tk_buf_put(out, s + prev, n - prev)) goto oom;
  return PD_OK;
oom:
  return pd_err_set(e, PD_ENOMEM, "out of memory");
}

/* ================================================================ JSON */

const char *tk_json_str(const cJSON *o, const char *key) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(x) ? x->valuestring : NULL;
}

bool tk_json_bool(const cJSON *o, const char *key, bool dflt) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsBool(x) ? cJSON_IsTrue(x) : dflt;
}

pd_status tk_json_pattern(const cJSON *o, const char *what, const char **pat, bool *is_regex,
                          pd_err *e) {
  const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "pattern");
  if (!cJSON_IsObject(p)) return pd_err_set(e, PD_EFORMAT, "%s: \"pattern\" must be an object", what);
  const char *s = tk_json_str(p, "String");
  if (s) {
    *pat = s;
    *is_regex = false;
    return PD_OK;
  }
  s = tk_json_str(p, "Regex");
  if (s) {
    *pat = s;
    *is_regex = true;
    return PD_OK;
  }
  return pd_err_set(e, PD_EFORMAT, "%s: \"pattern\" needs a \"String\" or \"Regex\" string", what);
}
