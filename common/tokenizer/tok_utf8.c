/* UTF-8 decoding and repair, Unicode predicates and GPT-2's byte-level alphabet. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "tok_internal.h"

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
