/* Tokenizer unit tests (argv[1]: the directory holding the decompressed llama2/llama3/qwen3
 * tokenizers; pycoder comes from tests/data/models/pycoder-12m).
 *
 *  - incremental decoding of every golden id list, token by token, equals the one-shot decode,
 *    and every chunk is valid UTF-8 on its own; the same for random id sequences rich in
 *    partial UTF-8 (byte-fallback and byte-level single-byte tokens);
 *  - invalid UTF-8 input is PD_EINVAL; edge-of-range valid input is accepted;
 *  - load time of the 151k-entry Qwen3 tokenizer (asserted < 1 s in Release builds);
 *  - decode(encode(x)) == x for the byte-level tokenizers (NFC(x) for Qwen3);
 *  - bad ids, BOS/EOS from tokenizer_config.json, add_special, vocabulary lookups;
 *  - byte-fallback and byte-level decoding of partial/invalid byte runs (values from HF);
 *  - added-token flags (lstrip, rstrip, single_word, normalized) on the cases of the
 *    `tokenizers` test suite; Metaspace("first") equals the legacy Llama-2 normalizer;
 *  - concurrent encoding and chat rendering from eight threads sharing the tokenizers; the
 *    chat-template call path.
 * Reference values come from the data files or from Hugging Face `tokenizers`, never from this
 * implementation. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <utf8proc.h>

#include "pd/tokenizer.h"

static int g_fail;
#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      g_fail++;                                                       \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
    }                                                                 \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0, r;
  char *b = malloc(cap);
  while (b && (r = fread(b + n, 1, cap - n - 1, f)) > 0) {
    n += r;
    if (n + 1 == cap) {
      char *nb = realloc(b, cap * 2);
      if (!nb) free(b);
      b = nb;
      cap *= 2;
    }
  }
  fclose(f);
  if (b) b[n] = 0;
  if (len) *len = n;
  return b;
}

static bool write_all(const char *path, const char *s, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return false;
  bool ok = fwrite(s, 1, n, f) == n;
  return (fclose(f) == 0) && ok;
}

/* Strict UTF-8 check, written independently of the library. */
static bool utf8_ok(const char *str, size_t n) {
  const unsigned char *s = (const unsigned char *)str;
  for (size_t i = 0; i < n;) {
    unsigned c = s[i];
    size_t k;
    unsigned min;
    if (c < 0x80) { i++; continue; }
    else if ((c & 0xE0) == 0xC0) { k = 1; min = 0x80; c &= 0x1F; }
    else if ((c & 0xF0) == 0xE0) { k = 2; min = 0x800; c &= 0x0F; }
    else if ((c & 0xF8) == 0xF0) { k = 3; min = 0x10000; c &= 0x07; }
    else return false;
    if (n - i < k + 1) return false;
    for (size_t j = 1; j <= k; j++) {
      if ((s[i + j] & 0xC0) != 0x80) return false;
      c = (c << 6) | (s[i + j] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return false;
    i += k + 1;
  }
  return true;
}

/* ---------------------------------------------------------------- fixtures */

typedef struct fixture {
  const char *name;
  char dir[4096];
  pd_tokenizer *t;
  const cJSON *cases; /* golden entries */
  bool byte_level;    /* decode(encode(x)) == x */
  bool nfc;           /* ... up to NFC */
} fixture;

static fixture g_fx[4] = {
    {.name = "llama2"},
    {.name = "llama3", .byte_level = true},
    {.name = "qwen3", .byte_level = true, .nfc = true},
    {.name = "pycoder", .byte_level = true},
};

static fixture *fx(const char *name) {
  for (int i = 0; i < 4; i++)
    if (!strcmp(g_fx[i].name, name)) return &g_fx[i];
  return NULL;
}

/* Golden ids of an entry into a malloc'ed array. */
static int32_t *case_ids(const cJSON *c, size_t *n) {
  const cJSON *a = cJSON_GetObjectItemCaseSensitive(c, "ids"), *x;
  *n = (size_t)cJSON_GetArraySize(a);
  int32_t *v = malloc((*n + 1) * sizeof *v);
  size_t k = 0;
  cJSON_ArrayForEach(x, a) v[k++] = (int32_t)x->valuedouble;
  return v;
}

static const char *case_text(const cJSON *c) {
  return cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
}

/* ---------------------------------------------------------------- incremental decoding */

/* Decodes ids both ways; checks chunk validity and equality. Returns the one-shot text. */
static char *check_stream(const fixture *f, const int32_t *ids, size_t n, bool skip, const char *what) {
  pd_err e = {0};
  char *full = NULL;
  size_t full_len = 0;
  pd_status st = pd_tokenizer_decode(f->t, ids, n, skip, &full, &full_len, &e);
  CHECK(st == PD_OK, "%s %s: decode: %s", f->name, what, e.msg);
  if (st) return NULL;
  CHECK(utf8_ok(full, full_len), "%s %s: one-shot decode is not valid UTF-8", f->name, what);
  pd_detok *d = pd_detok_new(f->t, skip);
  CHECK(d != NULL, "pd_detok_new");
  if (!d) return full;
  char *acc = malloc(full_len + 64);
  size_t acc_len = 0, acc_cap = full_len + 64;
  bool chunks_ok = true;
  for (size_t i = 0; i <= n; i++) {
    const char *out = NULL;
    size_t out_len = 0;
    st = i < n ? pd_detok_push(d, ids[i], &out, &out_len, &e) : pd_detok_flush(d, &out, &out_len, &e);
    CHECK(st == PD_OK, "%s %s: detok: %s", f->name, what, e.msg);
    if (st) break;
    if (!utf8_ok(out, out_len)) chunks_ok = false;
    if (acc_len + out_len > acc_cap) {
      acc_cap = 2 * (acc_len + out_len);
      acc = realloc(acc, acc_cap);
    }
    memcpy(acc + acc_len, out, out_len);
    acc_len += out_len;
  }
  CHECK(chunks_ok, "%s %s: a pushed chunk is not valid UTF-8", f->name, what);
  CHECK(acc_len == full_len && memcmp(acc, full, full_len) == 0,
        "%s %s: incremental [%.*s] != one-shot [%s]", f->name, what, (int)acc_len, acc, full);
  free(acc);
  pd_detok_free(d);
  return full;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 11);
}

static void test_incremental(fixture *f) {
  const cJSON *c;
  cJSON_ArrayForEach(c, f->cases) {
    size_t n;
    int32_t *ids = case_ids(c, &n);
    for (int skip = 0; skip < 2; skip++) {
      char *full = check_stream(f, ids, n, skip, case_text(c));
      if (full && !skip) {
        const char *want = cJSON_GetObjectItemCaseSensitive(c, "decoded")->valuestring;
        CHECK(!strcmp(full, want), "%s: decode [%s] != reference [%s]", f->name, full, want);
      }
      free(full);
    }
    free(ids);
  }
  /* Random sequences; half of the ids are tokens of one byte / one byte-level character, so
   * UTF-8 sequences get split across tokens (and some are invalid). */
  int vocab = pd_tokenizer_vocab_size(f->t);
  int32_t small[512];
  int n_small = 0;
  for (int id = 0; id < vocab && n_small < 512; id++) {
    const char *s = pd_tokenizer_id_to_token(f->t, id);
    if (!s) continue;
    size_t l = strlen(s);
    bool byte_tok = l == 6 && !strncmp(s, "<0x", 3);
    bool one_char = l >= 1 && l <= 2 && ((unsigned char)s[0] >= 0x80 || l == 1);
    if (byte_tok || (f->byte_level && one_char)) small[n_small++] = id;
  }
  for (int rep = 0; rep < 300; rep++) {
    int32_t ids[32];
    size_t n = 1 + rnd() % 24;
    for (size_t i = 0; i < n; i++) {
      int32_t id;
      do {
        id = (n_small && rnd() % 2) ? small[rnd() % (uint32_t)n_small] : (int32_t)(rnd() % (uint32_t)vocab);
      } while (!pd_tokenizer_id_to_token(f->t, id));
      ids[i] = id;
    }
    free(check_stream(f, ids, n, rep % 2, "random"));
  }
}

/* ---------------------------------------------------------------- invalid input */

static void test_invalid_utf8(fixture *f) {
  static const struct {
    const char *s;
    size_t n;
  } bad[] = {
      {"\x80", 1},              {"\xC0\x80", 2},          {"\xC1\xBF", 2},
      {"\xC3", 1},              {"ok\xE2\x82", 4},        {"\xE0\x80\x80", 3},
      {"\xED\xA0\x80", 3},      {"\xF4\x90\x80\x80", 4},  {"\xF5\x80\x80\x80", 4},
      {"\xFF", 1},              {"a\xE2\x28\xA1", 4},     {"\xF0\x9F\x98", 3},
  };
  static const struct {
    const char *s;
    size_t n;
  } good[] = {
      {"\xF4\x8F\xBF\xBF", 4}, {"\xEF\xBF\xBF", 3}, {"\xED\x9F\xBF", 3}, {"\xEE\x80\x80", 3},
      {"a\0b", 3},             {"\xC2\x80", 2},     {"", 0},
  };
  pd_err e = {0};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int32_t *ids = (int32_t *)&e;
    size_t n = 99;
    pd_status st = pd_tokenizer_encode(f->t, bad[i].s, bad[i].n, false, &ids, &n, &e);
    CHECK(st == PD_EINVAL, "%s: invalid UTF-8 case %zu gave %d", f->name, i, (int)st);
    CHECK(ids == NULL && n == 0, "%s: outputs not cleared on error", f->name);
    free(st ? NULL : ids);
  }
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    int32_t *ids = NULL;
    size_t n = 0;
    pd_status st = pd_tokenizer_encode(f->t, good[i].s, good[i].n, false, &ids, &n, &e);
    CHECK(st == PD_OK, "%s: valid case %zu rejected: %s", f->name, i, e.msg);
    CHECK(st || ids != NULL, "%s: ids must be allocated even when empty", f->name);
    if (!st && f->byte_level && good[i].n) {
      char *text = NULL;
      size_t len = 0;
      st = pd_tokenizer_decode(f->t, ids, n, false, &text, &len, &e);
      CHECK(st == PD_OK && len == good[i].n && !memcmp(text, good[i].s, len),
            "%s: valid case %zu does not round-trip", f->name, i);
      free(text);
    }
    free(ids);
  }
}

/* ---------------------------------------------------------------- round trip */

static void test_roundtrip(fixture *f) {
  pd_err e = {0};
  const cJSON *c;
  cJSON_ArrayForEach(c, f->cases) {
    const char *text = case_text(c);
    char *want = f->nfc ? (char *)utf8proc_NFC((const utf8proc_uint8_t *)text) : strdup(text);
    int32_t *ids = NULL;
    size_t n = 0;
    char *back = NULL;
    size_t len = 0;
    pd_status st = pd_tokenizer_encode(f->t, text, strlen(text), false, &ids, &n, &e);
    if (!st) st = pd_tokenizer_decode(f->t, ids, n, false, &back, &len, &e);
    CHECK(st == PD_OK, "%s: %s", f->name, e.msg);
    CHECK(!st && len == strlen(want) && !memcmp(back, want, len), "%s: round trip of [%s] gave [%s]",
          f->name, want, back ? back : "");
    free(ids);
    free(back);
    free(want);
  }
  /* Random valid UTF-8 over the whole code space (qwen3 normalizes: compare to NFC). */
  for (int rep = 0; rep < 200; rep++) {
    char text[256];
    size_t n = 0;
    int chars = 1 + (int)(rnd() % 40);
    for (int k = 0; k < chars; k++) {
      uint32_t cp;
      switch (rnd() % 4) {
        case 0: cp = 0x20 + rnd() % 0x5F; break;
        case 1: cp = 0x80 + rnd() % 0x780; break;
        case 2: cp = 0x800 + rnd() % 0xF800; break;
        default: cp = 0x10000 + rnd() % 0x100000; break;
      }
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = ' ';
      n += (size_t)utf8proc_encode_char((utf8proc_int32_t)cp, (utf8proc_uint8_t *)text + n);
    }
    text[n] = 0;
    char *want = f->nfc ? (char *)utf8proc_NFC((const utf8proc_uint8_t *)text) : strdup(text);
    int32_t *ids = NULL;
    size_t ni = 0;
    char *back = NULL;
    size_t len = 0;
    pd_status st = pd_tokenizer_encode(f->t, text, n, false, &ids, &ni, &e);
    if (!st) st = pd_tokenizer_decode(f->t, ids, ni, false, &back, &len, &e);
    CHECK(st == PD_OK && len == strlen(want) && !memcmp(back, want, len), "%s: random round trip failed",
          f->name);
    free(ids);
    free(back);
    free(want);
  }
}

/* ---------------------------------------------------------------- ids and config */

static void expect_ids(fixture *f, const char *text, bool add_special, const int32_t *want, size_t n_want) {
  pd_err e = {0};
  int32_t *ids = NULL;
  size_t n = 0;
  pd_status st = pd_tokenizer_encode(f->t, text, strlen(text), add_special, &ids, &n, &e);
  bool same = !st && n == n_want && !memcmp(ids, want, n * sizeof *ids);
  CHECK(same, "%s: encode(\"%s\", add_special=%d) gave %zu ids", f->name, text, add_special, n);
  free(ids);
}

static void test_ids_and_config(void) {
  pd_err e = {0};
  /* Values from tokenizer.json / tokenizer_config.json. */
  fixture *l2 = fx("llama2"), *l3 = fx("llama3"), *q3 = fx("qwen3"), *py = fx("pycoder");
  CHECK(pd_tokenizer_vocab_size(l2->t) == 32000, "llama2 vocab %d", pd_tokenizer_vocab_size(l2->t));
  CHECK(pd_tokenizer_vocab_size(l3->t) == 128256, "llama3 vocab");
  CHECK(pd_tokenizer_vocab_size(q3->t) == 151669, "qwen3 vocab");
  CHECK(pd_tokenizer_vocab_size(py->t) == 4096, "pycoder vocab");
  CHECK(pd_tokenizer_bos_id(l2->t) == 1 && pd_tokenizer_eos_id(l2->t) == 2, "llama2 bos/eos");
  CHECK(pd_tokenizer_bos_id(l3->t) == 128000 && pd_tokenizer_eos_id(l3->t) == 128001, "llama3 bos/eos");
  CHECK(pd_tokenizer_bos_id(q3->t) == -1 && pd_tokenizer_eos_id(q3->t) == 151645, "qwen3 bos/eos");
  CHECK(pd_tokenizer_bos_id(py->t) == -1 && pd_tokenizer_eos_id(py->t) == 0, "pycoder bos/eos");
  CHECK(pd_tokenizer_token_to_id(py->t, "<|im_start|>") == 1, "pycoder <|im_start|>");
  CHECK(pd_tokenizer_token_to_id(py->t, "no such token, surely") == -1, "unknown token");
  CHECK(!strcmp(pd_tokenizer_id_to_token(py->t, 2), "<|im_end|>"), "pycoder id 2");
  CHECK(pd_tokenizer_id_to_token(py->t, 4096) == NULL && pd_tokenizer_id_to_token(py->t, -1) == NULL, "range");
  CHECK(pd_tokenizer_is_special(py->t, 0) && !pd_tokenizer_is_special(py->t, 100), "special flags");
  CHECK(pd_tokenizer_is_special(q3->t, 151645), "qwen3 <|im_end|> special");
  CHECK(!pd_tokenizer_is_special(q3->t, pd_tokenizer_token_to_id(q3->t, "</think>")), "</think> is not special");
  /* Every pycoder id maps to a string that maps back to it. */
  int bad = 0;
  for (int32_t id = 0; id < 4096; id++)
    if (pd_tokenizer_token_to_id(py->t, pd_tokenizer_id_to_token(py->t, id)) != id) bad++;
  CHECK(bad == 0, "%d pycoder ids do not round-trip through their strings", bad);

  /* add_special: Llama 2 puts <s> first (TemplateProcessing + add_bos_token); the others add
   * nothing (ByteLevel post-processors; qwen3 add_bos_token false). */
  const cJSON *c0 = cJSON_GetArrayItem(l2->cases, 0);
  size_t n;
  int32_t *ref = case_ids(c0, &n);
  int32_t with_bos[64];
  with_bos[0] = 1;
  memcpy(with_bos + 1, ref, n * sizeof *ref);
  expect_ids(l2, case_text(c0), true, with_bos, n + 1);
  free(ref);
  int32_t bos_only = 1;
  expect_ids(l2, "", true, &bos_only, 1);
  fixture *others[3] = {l3, q3, py};
  for (int i = 0; i < 3; i++) {
    const cJSON *c = cJSON_GetArrayItem(others[i]->cases, 0);
    ref = case_ids(c, &n);
    expect_ids(others[i], case_text(c), true, ref, n);
    free(ref);
  }

  /* Bad ids. */
  for (int i = 0; i < 4; i++) {
    int32_t badids[2] = {-1, pd_tokenizer_vocab_size(g_fx[i].t)};
    for (int k = 0; k < 2; k++) {
      char *text = (char *)&e;
      size_t len = 7;
      CHECK(pd_tokenizer_decode(g_fx[i].t, &badids[k], 1, false, &text, &len, &e) == PD_EINVAL &&
                text == NULL,
            "%s: decode of id %d", g_fx[i].name, badids[k]);
      pd_detok *d = pd_detok_new(g_fx[i].t, false);
      const char *out;
      size_t out_len;
      CHECK(pd_detok_push(d, badids[k], &out, &out_len, &e) == PD_EINVAL, "%s: detok of id %d",
            g_fx[i].name, badids[k]);
      pd_detok_free(d);
    }
  }
  /* No ids at all: "" (a byte-level flush of nothing once did pointer arithmetic on NULL, a
   * UBSan report found by tests/fuzz/fuzz_tokenizer.c). */
  for (int i = 0; i < 4; i++) {
    char *text = NULL;
    size_t len = 1;
    CHECK(pd_tokenizer_decode(g_fx[i].t, NULL, 0, false, &text, &len, &e) == PD_OK && text &&
              !text[0] && len == 0,
          "%s: decode of no ids", g_fx[i].name);
    free(text);
  }
}

/* ---------------------------------------------------------------- partial bytes */

static void expect_decode(fixture *f, const int32_t *ids, size_t n, const char *want) {
  pd_err e = {0};
  char *text = NULL;
  size_t len = 0;
  pd_status st = pd_tokenizer_decode(f->t, ids, n, false, &text, &len, &e);
  CHECK(st == PD_OK && len == strlen(want) && !memcmp(text, want, len), "%s: decode gave [%s], want [%s]",
        f->name, text ? text : "", want);
  free(text);
  free(check_stream(f, ids, n, false, "partial bytes"));
}

static void test_partial_bytes(void) {
  /* Expected strings are what Hugging Face `tokenizers` returns for these ids. */
  fixture *l2 = fx("llama2"), *q3 = fx("qwen3");
  int32_t e5 = pd_tokenizer_token_to_id(l2->t, "<0xE5>"), a4 = pd_tokenizer_token_to_id(l2->t, "<0xA4>");
  int32_t a7 = pd_tokenizer_token_to_id(l2->t, "<0xA7>"), ff = pd_tokenizer_token_to_id(l2->t, "<0xFF>");
  int32_t sp_a = pd_tokenizer_token_to_id(l2->t, "\xE2\x96\x81" "a");
  CHECK(e5 == 232 && a4 == 167 && a7 == 170 && ff == 258 && sp_a == 264, "llama2 byte token ids");
  expect_decode(l2, (int32_t[]){e5, a4, a7}, 3, "\xE5\xA4\xA7");
  expect_decode(l2, (int32_t[]){e5, a4, sp_a}, 3, "\xEF\xBF\xBD\xEF\xBF\xBD a");
  /* An invalid run turns into one U+FFFD per byte, the valid prefix included. */
  expect_decode(l2, (int32_t[]){sp_a, e5, a4, a7, ff, sp_a}, 6,
                "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD a");

  /* Byte-level: U+00E5 'å' is byte 0xE5, '¤' 0xA4, '§' 0xA7. */
  int32_t b_e5 = pd_tokenizer_token_to_id(q3->t, "\xC3\xA5"), b_a4 = pd_tokenizer_token_to_id(q3->t, "\xC2\xA4");
  int32_t b_a7 = pd_tokenizer_token_to_id(q3->t, "\xC2\xA7"), b_a = pd_tokenizer_token_to_id(q3->t, "a");
  CHECK(b_e5 == 161 && b_a4 == 97 && b_a7 == 100, "qwen3 byte ids");
  expect_decode(q3, (int32_t[]){b_e5, b_a4, b_a7}, 3, "\xE5\xA4\xA7");
  expect_decode(q3, (int32_t[]){b_e5, b_a4}, 2, "\xEF\xBF\xBD");
  expect_decode(q3, (int32_t[]){b_e5, b_a}, 2, "\xEF\xBF\xBD" "a");
  /* The character is released by the push that completes it; a dangling start is flushed as
   * U+FFFD. */
  pd_err e = {0};
  pd_detok *d = pd_detok_new(q3->t, false);
  const char *out;
  size_t n;
  CHECK(pd_detok_push(d, b_e5, &out, &n, &e) == PD_OK && n == 0, "held");
  CHECK(pd_detok_push(d, b_a4, &out, &n, &e) == PD_OK && n == 0, "held");
  CHECK(pd_detok_push(d, b_a7, &out, &n, &e) == PD_OK && n == 3 && !memcmp(out, "\xE5\xA4\xA7", 3), "released");
  CHECK(pd_detok_push(d, b_e5, &out, &n, &e) == PD_OK && n == 0, "held");
  CHECK(pd_detok_flush(d, &out, &n, &e) == PD_OK && n == 3 && !memcmp(out, "\xEF\xBF\xBD", 3), "flushed");
  pd_detok_free(d);
}

/* ---------------------------------------------------------------- synthetic tokenizers */

/* Writes a tokenizer.json with a one-character vocabulary (no merges), the given normalizer
 * and added tokens, into dir; returns the loaded tokenizer. */
static pd_tokenizer *synthetic(const char *dir, const char *chars, const char *normalizer_json,
                               const char *added_json) {
  cJSON *root = cJSON_CreateObject();
  cJSON *model = cJSON_AddObjectToObject(root, "model");
  cJSON_AddStringToObject(model, "type", "BPE");
  cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
  int n = 0;
  for (const char *p = chars; *p; p++) {
    char s[2] = {*p, 0};
    cJSON_AddNumberToObject(vocab, s, n++);
  }
  cJSON_AddArrayToObject(model, "merges");
  cJSON *added = cJSON_Parse(added_json);
  int k = 0;
  cJSON *it;
  cJSON_ArrayForEach(it, added) cJSON_AddNumberToObject(it, "id", n + k++);
  cJSON_AddItemToObject(root, "added_tokens", added);
  cJSON_AddItemToObject(root, "normalizer", normalizer_json ? cJSON_Parse(normalizer_json) : cJSON_CreateNull());
  char *s = cJSON_PrintUnformatted(root);
  char path[4200];
  snprintf(path, sizeof path, "%s/tokenizer.json", dir);
  write_all(path, s, strlen(s));
  free(s);
  cJSON_Delete(root);
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load(dir, &e);
  CHECK(t != NULL, "synthetic tokenizer: %s", e.msg);
  return t;
}

/* Expected ids from a spec: "{name}" is the added token name, any other character its
 * vocabulary id. */
static void expect_spec(pd_tokenizer *t, const char *text, const char *spec) {
  int32_t want[256];
  size_t nw = 0;
  for (const char *p = spec; *p;) {
    if (*p == '{') {
      const char *q = strchr(p, '}');
      char name[64];
      snprintf(name, sizeof name, "%.*s", (int)(q - p - 1), p + 1);
      want[nw++] = pd_tokenizer_token_to_id(t, name);
      p = q + 1;
    } else {
      char s[2] = {*p++, 0};
      want[nw++] = pd_tokenizer_token_to_id(t, s);
    }
  }
  pd_err e = {0};
  int32_t *ids = NULL;
  size_t n = 0;
  pd_status st = pd_tokenizer_encode(t, text, strlen(text), false, &ids, &n, &e);
  CHECK(!st && n == nw && !memcmp(ids, want, n * sizeof *ids), "encode(\"%s\") != %s", text, spec);
  free(ids);
}

static void test_added_flags(const char *tmp) {
  const char *chars = " []<>abcdefghijklmnopqrstuvwxyz";
  const char *lower = "{\"type\":\"Lowercase\"}";
  /* added_vocabulary.rs options_use_cases. */
  pd_tokenizer *t = synthetic(tmp, chars, lower,
      "[{\"content\":\"my\",\"lstrip\":true,\"rstrip\":true,\"normalized\":true,\"special\":false},"
      "{\"content\":\"name\",\"normalized\":true,\"special\":false},"
      "{\"content\":\"ony\",\"single_word\":true,\"normalized\":true,\"special\":false},"
      "{\"content\":\"[CLS]\",\"normalized\":false,\"special\":true},"
      "{\"content\":\"[SEP]\",\"normalized\":false,\"special\":true}]");
  if (t) {
    expect_spec(t, "[CLS] My name is Anthony [SEP]", "{[CLS]}{my}{name} is anthony {[SEP]}");
    pd_tokenizer_free(t);
  }
  /* test_single_word_is_correct. */
  t = synthetic(tmp, chars, lower,
      "[{\"content\":\"<mask>\",\"single_word\":true,\"normalized\":true,\"special\":false}]");
  if (t) {
    expect_spec(t, "<mask> My name <mask> A<mask> <mask>ony <mask>",
                "{<mask>} my name {<mask>} a<mask> <mask>ony {<mask>}");
    pd_tokenizer_free(t);
  }
  /* test_lstrip_unicode_space. */
  t = synthetic(tmp, chars, lower,
      "[{\"content\":\"<mask>\",\"lstrip\":true,\"rstrip\":true,\"single_word\":true,"
      "\"normalized\":true,\"special\":false}]");
  if (t) {
    expect_spec(t, "Hi <mask> there\t<mask>\t<mask>\xE2\x80\x80", "hi{<mask>}there{<mask>}{<mask>}");
    pd_tokenizer_free(t);
  }
  char path[4200];
  snprintf(path, sizeof path, "%s/tokenizer.json", tmp);
  unlink(path);
}

/* A vocabulary that gives one id to several strings: each string encodes to the id, and the id
 * decodes to the shortest string (then the smallest bytes) whatever the order in the file. */
static void test_shared_id(const char *tmp) {
  const char *orders[2][4] = {{"a", "zz", "y", "x"}, {"x", "y", "zz", "a"}};
  for (int o = 0; o < 2; o++) {
    cJSON *root = cJSON_CreateObject();
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int i = 0; i < 4; i++) cJSON_AddNumberToObject(vocab, orders[o][i], strcmp(orders[o][i], "a") ? 1 : 0);
    cJSON_AddArrayToObject(model, "merges");
    char *js = cJSON_PrintUnformatted(root);
    char path[4200];
    snprintf(path, sizeof path, "%s/tokenizer.json", tmp);
    write_all(path, js, strlen(js));
    free(js);
    cJSON_Delete(root);
    pd_err e = {0};
    pd_tokenizer *t = pd_tokenizer_load(tmp, &e);
    CHECK(t != NULL, "shared-id tokenizer: %s", e.msg);
    if (t) {
      CHECK(pd_tokenizer_token_to_id(t, "zz") == 1 && pd_tokenizer_token_to_id(t, "x") == 1 &&
                pd_tokenizer_token_to_id(t, "y") == 1 && pd_tokenizer_token_to_id(t, "a") == 0,
            "shared-id lookups (order %d)", o);
      const char *s = pd_tokenizer_id_to_token(t, 1);
      CHECK(s && !strcmp(s, "x"), "id 1 decodes to '%s', want 'x' (order %d)", s ? s : "(null)", o);
      pd_tokenizer_free(t);
    }
    unlink(path);
  }
}

/* Metaspace(prepend_scheme "first", split false) is the modern form of Llama 2's
 * Prepend/Replace normalizer: same ids on the golden texts, except those that start with a
 * space (Prepend adds "▁" regardless; Metaspace does not add a second one). */
static void test_metaspace_equivalence(const char *tmp) {
  fixture *l2 = fx("llama2");
  char path[4200];
  snprintf(path, sizeof path, "%s/tokenizer.json", l2->dir);
  char *s = read_all(path, NULL);
  cJSON *root = s ? cJSON_Parse(s) : NULL;
  free(s);
  CHECK(root != NULL, "cannot read llama2 tokenizer.json");
  if (!root) return;
  cJSON_ReplaceItemInObject(root, "normalizer", cJSON_CreateNull());
  cJSON_ReplaceItemInObject(root, "pre_tokenizer",
      cJSON_Parse("{\"type\":\"Metaspace\",\"replacement\":\"\xE2\x96\x81\",\"prepend_scheme\":\"first\",\"split\":false}"));
  s = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  snprintf(path, sizeof path, "%s/tokenizer.json", tmp);
  write_all(path, s, strlen(s));
  free(s);
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load_files(path, NULL, &e);
  CHECK(t != NULL, "metaspace variant: %s", e.msg);
  if (t) {
    fixture f = *l2;
    f.t = t;
    const cJSON *c;
    int compared = 0;
    cJSON_ArrayForEach(c, l2->cases) {
      if (case_text(c)[0] == ' ') continue;
      size_t n;
      int32_t *ref = case_ids(c, &n);
      expect_ids(&f, case_text(c), false, ref, n);
      free(ref);
      compared++;
    }
    CHECK(compared >= 15, "too few cases compared");
    /* With a leading space the two schemes differ by one "▁" (as in `tokenizers`). */
    int32_t *ids = NULL;
    size_t n = 0;
    pd_status st = pd_tokenizer_encode(t, " Hello", 6, false, &ids, &n, &e);
    CHECK(!st && n == 1 && ids[0] == pd_tokenizer_token_to_id(t, "\xE2\x96\x81Hello"), "Metaspace \" Hello\"");
    free(ids);
    CHECK(pd_tokenizer_bos_id(t) == -1 && !pd_tokenizer_has_chat_template(t), "no config given");
    pd_tokenizer_free(t);
  }
  unlink(path);
}

/* ---------------------------------------------------------------- threads, chat, timing */

/* The router tokenizes and renders chat templates on several worker threads at once, sharing one
 * pd_tokenizer: eight threads, two per tokenizer, encode every golden case and render a chat
 * (pycoder, llama3 and qwen3 have templates) over and over, and every result must equal the
 * reference (the golden ids; the chat rendered before the threads start). Under
 * PD_SANITIZE=thread this is the data-race check of the shared tokenizer. */
typedef struct thread_arg {
  fixture *f;
  const char *chat_ref; /* NULL: the tokenizer has no template */
  int fails;
} thread_arg;

static const pd_chat_msg g_thread_msgs[3] = {
    {"system", "You write Python."}, {"user", "sort a list of 1000 numbers, ü ñ 中文"},
    {"assistant", "def sort(xs):\n    return sorted(xs)"}};

static void *encode_worker(void *p) {
  thread_arg *a = p;
  for (int rep = 0; rep < 5; rep++) {
    const cJSON *c;
    cJSON_ArrayForEach(c, a->f->cases) {
      size_t n_ref, n = 0;
      int32_t *ref = case_ids(c, &n_ref), *ids = NULL;
      pd_err e = {0};
      const char *text = case_text(c);
      if (pd_tokenizer_encode(a->f->t, text, strlen(text), false, &ids, &n, &e) || n != n_ref ||
          memcmp(ids, ref, n * sizeof *ids))
        a->fails++;
      free(ids);
      free(ref);
    }
    if (a->chat_ref) {
      char *out = NULL;
      pd_err e = {0};
      if (pd_tokenizer_apply_chat(a->f->t, g_thread_msgs, 3, true, &out, &e) != PD_OK ||
          strcmp(out, a->chat_ref))
        a->fails++;
      free(out);
    }
  }
  return NULL;
}

static void test_threads(void) {
  enum { PER = 2 };
  thread_arg args[4 * PER];
  char *refs[4] = {0};
  for (int i = 0; i < 4; i++) {
    pd_err e = {0};
    if (pd_tokenizer_has_chat_template(g_fx[i].t) &&
        pd_tokenizer_apply_chat(g_fx[i].t, g_thread_msgs, 3, true, &refs[i], &e) != PD_OK)
      refs[i] = NULL; /* a template this interpreter cannot render: encoding is still checked */
    printf("  threads: %s chat %s\n", g_fx[i].name, refs[i] ? "rendered" : "none");
    for (int k = 0; k < PER; k++) args[i * PER + k] = (thread_arg){&g_fx[i], refs[i], 0};
  }
  pthread_t th[4 * PER];
  for (int i = 0; i < 4 * PER; i++)
    CHECK(pthread_create(&th[i], NULL, encode_worker, &args[i]) == 0, "pthread_create");
  for (int i = 0; i < 4 * PER; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 4 * PER; i++)
    CHECK(args[i].fails == 0, "%s: %d concurrent encodes or chat renders differ from the reference",
          args[i].f->name, args[i].fails);
  for (int i = 0; i < 4; i++) free(refs[i]);
}

static void test_chat(void) {
  pd_err e = {0};
  CHECK(pd_tokenizer_has_chat_template(fx("pycoder")->t), "pycoder has chat_template.jinja");
  CHECK(pd_tokenizer_has_chat_template(fx("qwen3")->t), "qwen3 config has a chat_template");
  CHECK(pd_tokenizer_has_chat_template(fx("llama3")->t), "llama3 config has a chat_template");
  CHECK(!pd_tokenizer_has_chat_template(fx("llama2")->t), "llama2 has none");
  pd_chat_msg msgs[2] = {{"user", "hi"}, {"assistant", "hello"}};
  char *out = (char *)&e;
  CHECK(pd_tokenizer_apply_chat(fx("llama2")->t, msgs, 2, true, &out, &e) == PD_ENOTFOUND && out == NULL,
        "no template");
  pd_chat_msg bad = {NULL, "x"};
  CHECK(pd_tokenizer_apply_chat(fx("pycoder")->t, &bad, 1, true, &out, &e) == PD_EINVAL, "NULL role");
  /* The interpreter behind it is tested on its own; here only the call path. */
  for (int i = 0; i < 4; i++) {
    if (!pd_tokenizer_has_chat_template(g_fx[i].t)) continue;
    pd_err_clear(&e);
    pd_status st = pd_tokenizer_apply_chat(g_fx[i].t, msgs, 2, true, &out, &e);
    if (st == PD_OK) {
      CHECK(out != NULL && strstr(out, "hello") != NULL, "%s: rendered chat lacks the message", g_fx[i].name);
    } else {
      CHECK(out == NULL && e.msg[0] != 0, "%s: chat error without message", g_fx[i].name);
      printf("  chat %s: %s (%s)\n", g_fx[i].name, pd_status_str(st), e.msg);
    }
    free(out);
  }
}

static void test_load_time(void) {
  pd_err e = {0};
  fixture *q3 = fx("qwen3");
  double best = 1e9;
  for (int rep = 0; rep < 2; rep++) {
    double t0 = now_s();
    pd_tokenizer *t = pd_tokenizer_load(q3->dir, &e);
    double dt = now_s() - t0;
    CHECK(t != NULL, "qwen3 load: %s", e.msg);
    pd_tokenizer_free(t);
    if (dt < best) best = dt;
  }
  printf("  qwen3 tokenizer load: %.3f s\n", best);
#ifdef PD_TOK_ASSERT_LOAD_TIME
  CHECK(best < 1.0, "loading the qwen3 tokenizer took %.3f s", best);
#endif
  /* Encoding throughput on the golden texts (printed only). */
  for (int i = 1; i < 3; i++) {
    fixture *f = &g_fx[i];
    size_t bytes = 0;
    double t0 = now_s();
    for (int rep = 0; rep < 20; rep++) {
      const cJSON *c;
      cJSON_ArrayForEach(c, f->cases) {
        const char *text = case_text(c);
        int32_t *ids = NULL;
        size_t n = 0;
        pd_tokenizer_encode(f->t, text, strlen(text), false, &ids, &n, &e);
        free(ids);
        bytes += strlen(text);
      }
    }
    printf("  %s encode: %.1f MB/s\n", f->name, (double)bytes / 1e6 / (now_s() - t0));
  }
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <decompressed tokenizers dir>\n", argv[0]);
    return 2;
  }
  size_t len;
  char *json = read_all(PD_TEST_DATA "/golden/tokenizer_reference.json", &len);
  cJSON *ref = json ? cJSON_Parse(json) : NULL;
  free(json);
  if (!ref) {
    fprintf(stderr, "cannot read tokenizer_reference.json\n");
    return 1;
  }
  for (int i = 0; i < 4; i++) {
    fixture *f = &g_fx[i];
    if (!strcmp(f->name, "pycoder")) snprintf(f->dir, sizeof f->dir, "%s/models/pycoder-12m", PD_TEST_DATA);
    else snprintf(f->dir, sizeof f->dir, "%s/%s", argv[1], f->name);
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/tokenizer.json", f->dir);
    if (access(probe, R_OK) != 0) {
      fprintf(stderr, "SKIP: %s is missing (xz not available at build time?)\n", probe);
      return 77;
    }
    pd_err e = {0};
    f->t = pd_tokenizer_load(f->dir, &e);
    if (!f->t) {
      fprintf(stderr, "FAIL: loading %s: %s\n", f->dir, e.msg);
      return 1;
    }
    f->cases = cJSON_GetObjectItemCaseSensitive(ref, f->name);
  }
  char tmp[] = "/tmp/pd_test_tokenizer_XXXXXX";
  if (!mkdtemp(tmp)) {
    perror("mkdtemp");
    return 1;
  }

  for (int i = 0; i < 4; i++) {
    test_incremental(&g_fx[i]);
    test_invalid_utf8(&g_fx[i]);
    if (g_fx[i].byte_level) test_roundtrip(&g_fx[i]);
  }
  test_ids_and_config();
  test_partial_bytes();
  test_added_flags(tmp);
  test_shared_id(tmp);
  test_metaspace_equivalence(tmp);
  test_threads();
  test_chat();
  test_load_time();

  rmdir(tmp);
  for (int i = 0; i < 4; i++) pd_tokenizer_free(g_fx[i].t);
  cJSON_Delete(ref);
  if (g_fail) {
    fprintf(stderr, "%d checks failed\n", g_fail);
    return 1;
  }
  printf("all tokenizer checks passed\n");
  return 0;
}
