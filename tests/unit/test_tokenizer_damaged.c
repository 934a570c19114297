/* Damaged tokenizer files must give an error (NULL, a status and a message), never a crash:
 * truncations of a real tokenizer.json at many offsets, values of the wrong type, dangling
 * references (merges, unk_token, template tokens), unsupported components, runaway nesting,
 * garbage bytes, missing files, and a damaged tokenizer_config.json. Also the accepted forms of
 * tokenizer_config.json (bos/eos as strings or {"content": ...} objects). Base file:
 * tests/data/models/pycoder-12m/tokenizer.json. Run under ASan this also checks that every
 * error path frees what it allocated. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "pd/tokenizer.h"

static int g_fail;
#define CHECK(cond, ...)                                                          \
  do {                                                                            \
    if (!(cond)) {                                                                \
      g_fail++;                                                                   \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);    \
      fprintf(stderr, __VA_ARGS__);                                               \
      fprintf(stderr, "\n");                                                      \
    }                                                                             \
  } while (0)

static char g_dir[64];
static char g_json[128], g_cfg[128];

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

static void write_file(const char *path, const char *s, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(s, 1, n, f) != n) {
    perror(path);
    exit(1);
  }
  fclose(f);
}

/* Loads g_json (and config when given); expects failure, optionally with a given code. */
static void expect_fail(const char *what, const char *config, pd_status want) {
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load_files(g_json, config, &e);
  CHECK(t == NULL, "%s: loaded although damaged", what);
  CHECK(e.code != PD_OK && e.msg[0], "%s: no error code or message", what);
  CHECK(want == PD_OK || e.code == want, "%s: got %s (%s), want %s", what, pd_status_str(e.code), e.msg,
        pd_status_str(want));
  pd_tokenizer_free(t);
}

static void expect_json_fail(const char *what, cJSON *root, pd_status want) {
  char *s = cJSON_PrintUnformatted(root);
  write_file(g_json, s, strlen(s));
  free(s);
  expect_fail(what, NULL, want);
}

/* Applies one mutation to a fresh copy of the base document. */
typedef void (*mutate_fn)(cJSON *root);

static cJSON *model(cJSON *root) { return cJSON_GetObjectItemCaseSensitive(root, "model"); }

static void m_model_string(cJSON *r) { cJSON_ReplaceItemInObject(r, "model", cJSON_CreateString("BPE")); }
static void m_model_unigram(cJSON *r) { cJSON_ReplaceItemInObject(model(r), "type", cJSON_CreateString("Unigram")); }
static void m_vocab_array(cJSON *r) { cJSON_ReplaceItemInObject(model(r), "vocab", cJSON_CreateArray()); }
static void m_vocab_missing(cJSON *r) { cJSON_DeleteItemFromObject(model(r), "vocab"); }
static void m_vocab_empty(cJSON *r) {
  cJSON_ReplaceItemInObject(model(r), "vocab", cJSON_CreateObject());
  cJSON_ReplaceItemInObject(model(r), "merges", cJSON_CreateArray());
}
static void m_vocab_value_string(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetObjectItemCaseSensitive(model(r), "vocab"), "a", cJSON_CreateString("7"));
}
static void m_vocab_negative(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetObjectItemCaseSensitive(model(r), "vocab"), "a", cJSON_CreateNumber(-3));
}
static void m_vocab_fraction(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetObjectItemCaseSensitive(model(r), "vocab"), "a", cJSON_CreateNumber(1.5));
}
static void m_vocab_huge(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetObjectItemCaseSensitive(model(r), "vocab"), "a", cJSON_CreateNumber(1e12));
}
static void m_merges_object(cJSON *r) { cJSON_ReplaceItemInObject(model(r), "merges", cJSON_CreateObject()); }
static void m_merges_missing(cJSON *r) { cJSON_DeleteItemFromObject(model(r), "merges"); }
static void m_merge_number(cJSON *r) {
  cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(model(r), "merges"), cJSON_CreateNumber(4));
}
static void m_merge_nospace(cJSON *r) {
  cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(model(r), "merges"), cJSON_CreateString("ab"));
}
static void m_merge_unknown(cJSON *r) {
  cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(model(r), "merges"),
                       cJSON_Parse("[\"no-such-token\", \"a\"]"));
}
static void m_merge_one(cJSON *r) {
  cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(model(r), "merges"), cJSON_Parse("[\"a\"]"));
}
static void m_merge_result_missing(cJSON *r) {
  /* "Ā" and "ā" are tokens, "Āā" is not. */
  cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(model(r), "merges"),
                       cJSON_Parse("[\"\xC4\x80\", \"\xC4\x81\"]"));
}
static void m_unk_missing(cJSON *r) { cJSON_ReplaceItemInObject(model(r), "unk_token", cJSON_CreateString("<nope>")); }
static void m_unk_number(cJSON *r) { cJSON_ReplaceItemInObject(model(r), "unk_token", cJSON_CreateNumber(3)); }
static void m_added_object(cJSON *r) { cJSON_ReplaceItemInObject(r, "added_tokens", cJSON_CreateObject()); }
static void m_added_no_content(cJSON *r) {
  cJSON_DeleteItemFromObject(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r, "added_tokens"), 0), "content");
}
static void m_added_id_string(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r, "added_tokens"), 1), "id",
                            cJSON_CreateString("1"));
}
static void m_norm_bogus(cJSON *r) { cJSON_ReplaceItemInObject(r, "normalizer", cJSON_Parse("{\"type\":\"Bogus\"}")); }
static void m_norm_number(cJSON *r) { cJSON_ReplaceItemInObject(r, "normalizer", cJSON_CreateNumber(1)); }
static void m_norm_precompiled(cJSON *r) {
  cJSON_ReplaceItemInObject(r, "normalizer", cJSON_Parse("{\"type\":\"Precompiled\",\"precompiled_charsmap\":\"\"}"));
}
static void m_norm_replace_nocontent(cJSON *r) {
  cJSON_ReplaceItemInObject(r, "normalizer", cJSON_Parse("{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"}}"));
}
static void m_norm_deep(cJSON *r) {
  /* 100 nested Sequences. */
  cJSON *inner = cJSON_Parse("{\"type\":\"NFC\"}");
  for (int i = 0; i < 100; i++) {
    cJSON *seq = cJSON_CreateObject();
    cJSON_AddStringToObject(seq, "type", "Sequence");
    cJSON *list = cJSON_AddArrayToObject(seq, "normalizers");
    cJSON_AddItemToArray(list, inner);
    inner = seq;
  }
  cJSON_ReplaceItemInObject(r, "normalizer", inner);
}
static cJSON *pretok_list(cJSON *r) {
  return cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "pre_tokenizer"), "pretokenizers");
}
static void m_split_bad_regex(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetArrayItem(pretok_list(r), 0), "pattern", cJSON_Parse("{\"Regex\":\"(\"}"));
}
static void m_split_bad_pattern(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetArrayItem(pretok_list(r), 0), "pattern", cJSON_Parse("{\"Bad\":1}"));
}
static void m_split_no_behavior(cJSON *r) { cJSON_DeleteItemFromObject(cJSON_GetArrayItem(pretok_list(r), 0), "behavior"); }
static void m_split_bad_behavior(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetArrayItem(pretok_list(r), 0), "behavior", cJSON_CreateString("Sideways"));
}
static void m_pretok_list_string(cJSON *r) {
  cJSON_ReplaceItemInObject(cJSON_GetObjectItemCaseSensitive(r, "pre_tokenizer"), "pretokenizers", cJSON_CreateString("x"));
}
static void m_pretok_bert(cJSON *r) { cJSON_ReplaceItemInObject(r, "pre_tokenizer", cJSON_Parse("{\"type\":\"BertPreTokenizer\"}")); }
static void m_metaspace_long(cJSON *r) {
  cJSON_ReplaceItemInObject(r, "pre_tokenizer", cJSON_Parse("{\"type\":\"Metaspace\",\"replacement\":\"ab\"}"));
}
static void m_dec_strip_string(cJSON *r) {
  cJSON_ReplaceItemInObject(r, "decoder", cJSON_Parse("{\"type\":\"Strip\",\"content\":\" \",\"start\":\"x\",\"stop\":0}"));
}
static void m_dec_bogus(cJSON *r) { cJSON_ReplaceItemInObject(r, "decoder", cJSON_Parse("{\"type\":\"WordPiece\"}")); }
static void m_dec_no_type(cJSON *r) { cJSON_ReplaceItemInObject(r, "decoder", cJSON_Parse("{\"decoders\":[]}")); }
static void m_post_unknown_special(cJSON *r) {
  cJSON_ReplaceItemInObject(r, "post_processor", cJSON_Parse(
      "{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<x>\",\"type_id\":0}},"
      "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{}}"));
}
static void m_post_bad_id(cJSON *r) {
  cJSON_ReplaceItemInObject(r, "post_processor", cJSON_Parse(
      "{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<x>\",\"type_id\":0}}],"
      "\"special_tokens\":{\"<x>\":{\"id\":\"<x>\",\"ids\":[999999],\"tokens\":[\"<x>\"]}}}"));
}
static void m_post_bogus(cJSON *r) { cJSON_ReplaceItemInObject(r, "post_processor", cJSON_Parse("{\"type\":\"Bogus\"}")); }

static const struct {
  const char *what;
  mutate_fn fn;
  pd_status want; /* PD_OK: any error */
} k_mutations[] = {
    {"model is a string", m_model_string, PD_EFORMAT},
    {"Unigram model", m_model_unigram, PD_EUNSUPPORTED},
    {"vocab is an array", m_vocab_array, PD_EFORMAT},
    {"vocab missing", m_vocab_missing, PD_EFORMAT},
    {"vocab empty", m_vocab_empty, PD_EFORMAT},
    {"vocab id is a string", m_vocab_value_string, PD_EFORMAT},
    {"vocab id negative", m_vocab_negative, PD_EFORMAT},
    {"vocab id fractional", m_vocab_fraction, PD_EFORMAT},
    {"vocab id huge", m_vocab_huge, PD_EFORMAT},
    {"merges is an object", m_merges_object, PD_EFORMAT},
    {"merges missing", m_merges_missing, PD_EFORMAT},
    {"merge is a number", m_merge_number, PD_EFORMAT},
    {"merge without space", m_merge_nospace, PD_EFORMAT},
    {"merge of unknown token", m_merge_unknown, PD_EFORMAT},
    {"merge with one side", m_merge_one, PD_EFORMAT},
    {"merge result not in vocab", m_merge_result_missing, PD_EFORMAT},
    {"unk_token not in vocab", m_unk_missing, PD_EFORMAT},
    {"unk_token is a number", m_unk_number, PD_EFORMAT},
    {"added_tokens is an object", m_added_object, PD_EFORMAT},
    {"added token without content", m_added_no_content, PD_EFORMAT},
    {"added token id is a string", m_added_id_string, PD_EFORMAT},
    {"unknown normalizer", m_norm_bogus, PD_EUNSUPPORTED},
    {"normalizer is a number", m_norm_number, PD_EFORMAT},
    {"Precompiled normalizer", m_norm_precompiled, PD_EUNSUPPORTED},
    {"Replace without content", m_norm_replace_nocontent, PD_EFORMAT},
    {"normalizers nested 100 deep", m_norm_deep, PD_EFORMAT},
    {"Split with a bad regex", m_split_bad_regex, PD_EUNSUPPORTED},
    {"Split with a bad pattern", m_split_bad_pattern, PD_EFORMAT},
    {"Split without behavior", m_split_no_behavior, PD_EFORMAT},
    {"Split with unknown behavior", m_split_bad_behavior, PD_EFORMAT},
    {"pretokenizers is a string", m_pretok_list_string, PD_EFORMAT},
    {"BertPreTokenizer", m_pretok_bert, PD_EUNSUPPORTED},
    {"Metaspace replacement of two chars", m_metaspace_long, PD_EFORMAT},
    {"Strip start is a string", m_dec_strip_string, PD_EFORMAT},
    {"WordPiece decoder", m_dec_bogus, PD_EUNSUPPORTED},
    {"decoder without type", m_dec_no_type, PD_EFORMAT},
    {"template names an unknown special token", m_post_unknown_special, PD_EFORMAT},
    {"template id out of range", m_post_bad_id, PD_EFORMAT},
    {"unknown post_processor", m_post_bogus, PD_EUNSUPPORTED},
};

int main(void) {
  size_t n;
  char *base = read_all(PD_TEST_DATA "/models/pycoder-12m/tokenizer.json", &n);
  if (!base) {
    fprintf(stderr, "cannot read the pycoder tokenizer.json\n");
    return 1;
  }
  snprintf(g_dir, sizeof g_dir, "/tmp/pd_test_tokdmg_XXXXXX");
  if (!mkdtemp(g_dir)) {
    perror("mkdtemp");
    return 1;
  }
  snprintf(g_json, sizeof g_json, "%s/tokenizer.json", g_dir);
  snprintf(g_cfg, sizeof g_cfg, "%s/tokenizer_config.json", g_dir);

  /* The intact file loads. */
  write_file(g_json, base, n);
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load_files(g_json, NULL, &e);
  CHECK(t != NULL, "intact copy: %s", e.msg);
  pd_tokenizer_free(t);

  /* Truncations. */
  size_t cuts[48];
  int nc = 0;
  size_t fixed[] = {0, 1, 2, 10, 100, 1000, n - 1, n - 2, n - 10};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) cuts[nc++] = fixed[i];
  for (int i = 1; i < 36; i++) cuts[nc++] = n * (size_t)i / 36;
  for (int i = 0; i < nc; i++) {
    /* n - 1 drops only the final newline when there is one: then it is not damaged. */
    size_t k = cuts[i];
    while (k > 0 && (base[k - 1] == '\n' || base[k - 1] == ' ') && k >= n - 2) k--;
    write_file(g_json, base, k);
    char what[64];
    snprintf(what, sizeof what, "truncated at %zu of %zu", k, n);
    expect_fail(what, NULL, PD_EFORMAT);
  }

  /* Invalid UTF-8 inside a token string. */
  {
    char *bad = malloc(n + 1);
    memcpy(bad, base, n + 1);
    char *p = strstr(bad, "\"<|im_end|>\"");
    CHECK(p != NULL, "base file lacks <|im_end|>");
    if (p) p[3] = (char)0xFF;
    write_file(g_json, bad, n);
    expect_fail("invalid UTF-8 in a token", NULL, PD_EFORMAT);
    free(bad);
  }

  /* Garbage and wrong top-level types. */
  const char *junk[] = {"\x00\x01\x02\xff\xfe", "[]", "42", "\"tokenizer\"", "{}", "null", "{\"model\":null}"};
  for (size_t i = 0; i < sizeof junk / sizeof junk[0]; i++) {
    write_file(g_json, junk[i], i == 0 ? 5 : strlen(junk[i]));
    expect_fail(junk[i][0] ? junk[i] : "binary junk", NULL, PD_EFORMAT);
  }

  /* Mutations of the intact document. */
  for (size_t i = 0; i < sizeof k_mutations / sizeof k_mutations[0]; i++) {
    cJSON *root = cJSON_Parse(base);
    k_mutations[i].fn(root);
    expect_json_fail(k_mutations[i].what, root, k_mutations[i].want);
    cJSON_Delete(root);
  }

  /* Missing files. */
  pd_tokenizer *none = pd_tokenizer_load_files("/nonexistent/pdserve/tokenizer.json", NULL, &e);
  CHECK(none == NULL && e.code == PD_ENOTFOUND, "missing file: %s", pd_status_str(e.code));
  none = pd_tokenizer_load("/nonexistent/pdserve", &e);
  CHECK(none == NULL && e.code == PD_ENOTFOUND, "missing directory: %s", pd_status_str(e.code));

  /* tokenizer_config.json: damaged, and its accepted forms. */
  write_file(g_json, base, n);
  const char *cfg = "{\"bos_token\": \"<|im_start|>\", \"eos_token\": {\"content\": \"<|im_end|>\"}, "
                    "\"chat_template\": 17}";
  write_file(g_cfg, cfg, strlen(cfg) / 2);
  expect_fail("truncated tokenizer_config.json", g_cfg, PD_EFORMAT);
  write_file(g_cfg, "[1, 2]", 6);
  expect_fail("tokenizer_config.json is an array", g_cfg, PD_EFORMAT);
  write_file(g_cfg, cfg, strlen(cfg));
  t = pd_tokenizer_load(g_dir, &e); /* the directory has no chat_template.jinja */
  CHECK(t != NULL, "config forms: %s", e.msg);
  if (t) {
    CHECK(pd_tokenizer_bos_id(t) == 1, "bos_token as a string");
    CHECK(pd_tokenizer_eos_id(t) == 2, "eos_token as {\"content\": ...}");
    CHECK(!pd_tokenizer_has_chat_template(t), "a non-string chat_template is no template");
    pd_tokenizer_free(t);
  }
  const char *cfg2 = "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
                     " {\"name\": \"default\", \"template\": \"D\"}], \"add_bos_token\": true,"
                     " \"bos_token\": {\"__type\": \"AddedToken\", \"content\": \"<|endoftext|>\"}}";
  write_file(g_cfg, cfg2, strlen(cfg2));
  t = pd_tokenizer_load(g_dir, &e);
  CHECK(t != NULL, "config with a template list: %s", e.msg);
  if (t) {
    CHECK(pd_tokenizer_has_chat_template(t), "template list");
    CHECK(pd_tokenizer_bos_id(t) == 0, "bos from an AddedToken object");
    int32_t *ids = NULL;
    size_t ni = 0;
    CHECK(pd_tokenizer_encode(t, "", 0, true, &ids, &ni, &e) == PD_OK && ni == 1 && ids[0] == 0,
          "add_bos_token: true adds the BOS");
    free(ids);
    pd_tokenizer_free(t);
  }
  unlink(g_cfg);
  unlink(g_json);
  rmdir(g_dir);
  free(base);
  if (g_fail) {
    fprintf(stderr, "%d checks failed\n", g_fail);
    return 1;
  }
  printf("all damaged-file checks passed\n");
  return 0;
}
