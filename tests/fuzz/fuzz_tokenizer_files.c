/* Fuzz target (d, part 3): a model's tokenizer files as pd_tokenizer_load reads them from its
 * directory: tokenizer.json (BPE model, merges, added tokens, normalizers, pre-tokenizers with
 * their regular expressions, decoders, post-processor), tokenizer_config.json (bos/eos tokens,
 * add_bos_token/add_eos_token, chat_template as a string or a list) and chat_template.jinja.
 *
 * Input: tokenizer.json NUL tokenizer_config.json NUL chat_template.jinja; a part after a
 * missing NUL is absent (its file is not there).
 * Properties: nothing crashes, hangs or leaks; a refusal says why; a loaded tokenizer encodes a
 * fixed text (ASCII, accents, an emoji, its own special-token syntax), its ids are within the
 * vocabulary, decode and incremental decode agree, and its chat template, when it has one,
 * renders or refuses with a message. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "pd/tokenizer.h"

static char g_dir[PATH_MAX];
static const char *const FILES[] = {"tokenizer.json", "tokenizer_config.json",
                                    "chat_template.jinja"};

static void unlink_files(void) {
  char path[PATH_MAX + 64];
  for (size_t i = 0; i < sizeof FILES / sizeof *FILES; i++) {
    snprintf(path, sizeof path, "%s/%s", g_dir, FILES[i]);
    unlink(path);
  }
}

static void rm_dir(void) {
  unlink_files();
  rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/pd-fuzz-tok-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  FUZZ_CHECK(mkdtemp(g_dir));
  atexit(rm_dir);
  return 0;
}

/* decode(ids) equals the incremental decoder's pushes and flush, put together */
static void check_decode(const pd_tokenizer *t, const int32_t *ids, size_t n, bool skip) {
  char *text = NULL;
  size_t len = 0;
  pd_err e = {0};
  FUZZ_CHECK(pd_tokenizer_decode(t, ids, n, skip, &text, &len, &e) == PD_OK);
  FUZZ_CHECK(strlen(text) <= len);
  pd_detok *d = pd_detok_new(t, skip);
  FUZZ_CHECK(d);
  size_t at = 0;
  for (size_t i = 0; i <= n; i++) {
    const char *out;
    size_t k;
    pd_status st = i < n ? pd_detok_push(d, ids[i], &out, &k, &e) : pd_detok_flush(d, &out, &k, &e);
    FUZZ_CHECK(st == PD_OK);
    FUZZ_CHECK(at + k <= len && (!k || !memcmp(text + at, out, k)));
    at += k;
  }
  FUZZ_CHECK(at == len);
  pd_detok_free(d);
  free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_dir[0]) LLVMFuzzerInitialize(NULL, NULL);
  unlink_files();
  fuzz_in in = {data, size};
  for (size_t i = 0; i < sizeof FILES / sizeof *FILES; i++) {
    fuzz_in part;
    bool more = fuzz_split(&in, &part);
    fuzz_write_file(g_dir, FILES[i], part.p, part.n);
    if (!more) break;
  }
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load(g_dir, &e);
  if (!t) {
    FUZZ_CHECK(e.code != PD_OK && e.msg[0]);
    return 0;
  }
  int vocab = pd_tokenizer_vocab_size(t);
  FUZZ_CHECK(vocab > 0);
  static const char text[] = "Hello, world!\n  def f(x):\treturn x  # caf\xc3\xa9 \xf0\x9f\x98\x80 "
                             "<|im_start|><s></s><|endoftext|> 12345";
  int32_t *ids = NULL;
  size_t n = 0;
  for (int add = 0; add < 2; add++) {
    pd_status st = pd_tokenizer_encode(t, text, sizeof text - 1, add, &ids, &n, &e);
    if (st != PD_OK) { /* a tokenizer can lack what a text needs (no byte fallback) */
      FUZZ_CHECK(e.msg[0]);
      continue;
    }
    for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab);
    check_decode(t, ids, n, false);
    check_decode(t, ids, n, true);
    free(ids);
    ids = NULL;
  }
  if (pd_tokenizer_has_chat_template(t)) {
    pd_chat_msg msgs[] = {{"system", "Be brief."}, {"user", "hi <|im_end|>"}, {"assistant", "ok"}};
    char *out = NULL;
    if (pd_tokenizer_apply_chat(t, msgs, 3, true, &out, &e) == PD_OK) FUZZ_CHECK(out);
    else FUZZ_CHECK(e.msg[0]);
    free(out);
  }
  pd_tokenizer_free(t);
  return 0;
}
