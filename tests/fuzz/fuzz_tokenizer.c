/* Fuzz target (e): the bundled tokenizers (tests/data/models/pycoder-12m: byte-level BPE with a
 * Split regex, as in every bundled model; and the decompressed llama2: SentencePiece-style BPE
 * with byte fallback, llama3 and qwen3: byte-level BPE with their pre-tokenizer regexes and NFC)
 * encoding arbitrary bytes and decoding arbitrary ids.
 *
 * Input: [tokenizer] [flags: add_special, skip_special, ids] bytes... With the ids flag the
 * bytes are little-endian 32-bit token ids (taken modulo vocabulary + 2, so out-of-range ids
 * come up too), else text to encode.
 * Properties: nothing crashes, hangs or leaks; encoding refuses invalid UTF-8 and only that;
 * every id it returns is within the vocabulary; decoding every id list gives the same text as
 * the incremental decoder's pushes and flush (pd/tokenizer.h's promise); on the byte-level
 * tokenizers without a normalizer, decode(encode(text)) is text again. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pd/tokenizer.h"

static const struct {
  const char *dir;
  bool round_trip; /* byte-level, no normalizer: decode(encode(x)) == x */
} TOKS[] = {
    {PD_TEST_DATA "/models/pycoder-12m", true},
    {PD_TOKENIZER_DATA_DIR "/llama2", false},
    {PD_TOKENIZER_DATA_DIR "/llama3", true},
    {PD_TOKENIZER_DATA_DIR "/qwen3", false},
};
#define N_TOKS (sizeof TOKS / sizeof *TOKS)
static pd_tokenizer *g_tok[N_TOKS];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  for (size_t i = 0; i < N_TOKS; i++) {
    pd_err e = {0};
    if (!(g_tok[i] = pd_tokenizer_load(TOKS[i].dir, &e))) {
      fprintf(stderr, "fuzz_tokenizer: %s: %s\n", TOKS[i].dir, e.msg);
      abort(); /* a missing tokenizer is a failure, not a skip */
    }
  }
  return 0;
}

/* Mirrors tok_utf8.c's UTF-8 check: well-formed (no overlongs, surrogates or > U+10FFFF). */
static bool utf8_ok(const uint8_t *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t k;
    uint32_t cp;
    if (c < 0x80) {
      i++;
      continue;
    } else if (c >= 0xc2 && c <= 0xdf) {
      k = 1, cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      k = 2, cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      k = 3, cp = c & 0x07;
    } else {
      return false;
    }
    for (size_t j = 1; j <= k; j++) {
      if (i + j >= n || (s[i + j] & 0xc0) != 0x80) return false;
      cp = cp << 6 | (s[i + j] & 0x3f);
    }
    if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += k + 1;
  }
  return true;
}

static char *decode_checked(const pd_tokenizer *t, const int32_t *ids, size_t n, bool skip,
                            size_t *len) {
  char *text = NULL;
  pd_err e = {0};
  if (pd_tokenizer_decode(t, ids, n, skip, &text, len, &e) != PD_OK) return NULL;
  pd_detok *d = pd_detok_new(t, skip);
  FUZZ_CHECK(d);
  size_t at = 0;
  for (size_t i = 0; i <= n; i++) {
    const char *out;
    size_t k;
    pd_status st = i < n ? pd_detok_push(d, ids[i], &out, &k, &e) : pd_detok_flush(d, &out, &k, &e);
    FUZZ_CHECK(st == PD_OK);
    if (!(at + k <= *len && (!k || !memcmp(text + at, out, k))))
      fprintf(stderr, "incremental decoding differs at byte %zu (token %zu of %zu)\n", at, i, n);
    FUZZ_CHECK(at + k <= *len && (!k || !memcmp(text + at, out, k)));
    at += k;
  }
  FUZZ_CHECK(at == *len);
  pd_detok_free(d);
  return text;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_tok[0]) LLVMFuzzerInitialize(NULL, NULL);
  fuzz_in in = {data, size};
  size_t which = fuzz_byte(&in) % N_TOKS;
  uint8_t flags = fuzz_byte(&in);
  const pd_tokenizer *t = g_tok[which];
  bool add = flags & 1, skip = flags & 2;
  int vocab = pd_tokenizer_vocab_size(t);
  size_t len = 0;
  if (flags & 4) {
    size_t n = in.n / 4;
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    FUZZ_CHECK(ids);
    bool in_range = true;
    for (size_t i = 0; i < n; i++) {
      uint32_t v = (uint32_t)in.p[4 * i] | (uint32_t)in.p[4 * i + 1] << 8 |
                   (uint32_t)in.p[4 * i + 2] << 16 | (uint32_t)in.p[4 * i + 3] << 24;
      ids[i] = (int32_t)(v % (uint32_t)(vocab + 2));
      in_range &= ids[i] < vocab;
    }
    char *text = decode_checked(t, ids, n, skip, &len);
    FUZZ_CHECK((text != NULL) == in_range);
    if (text) { /* what decoding gives, encoded again */
      int32_t *again = NULL;
      size_t m = 0;
      pd_err e = {0};
      if (pd_tokenizer_encode(t, text, len, add, &again, &m, &e) == PD_OK) free(again);
    }
    free(text);
    free(ids);
    return 0;
  }
  int32_t *ids = NULL;
  size_t n = 0;
  pd_err e = {0};
  pd_status st = pd_tokenizer_encode(t, (const char *)in.p, in.n, add, &ids, &n, &e);
  bool valid = utf8_ok(in.p, in.n) && !memchr(in.p, 0, in.n);
  if (st != PD_OK) {
    if (valid) fprintf(stderr, "refused valid UTF-8: %s\n", e.msg);
    FUZZ_CHECK(st == PD_EINVAL && !valid && e.msg[0]);
    return 0;
  }
  for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab);
  char *text = decode_checked(t, ids, n, skip, &len);
  FUZZ_CHECK(text);
  if (TOKS[which].round_trip && !add && !skip) {
    if (!(len == in.n && !memcmp(text, in.p, len)))
      fprintf(stderr, "round trip: %zu bytes in, %zu out\n", in.n, len);
    FUZZ_CHECK(len == in.n && !memcmp(text, in.p, len));
  }
  free(text);
  free(ids);
  return 0;
}
