/* Fuzz target (f): the Jinja chat-template interpreter (common/tokenizer/chat_template.c):
 * arbitrary templates, and arbitrary messages through the bundled templates (the bundled
 * models' chat_template.jinja, and the chat_template of the llama3 and qwen3
 * tokenizer_config.json, which use namespaces, macros-free loops, filters, tool branches).
 *
 * Input: [template: 0 = the input's own, 1.. = a bundled one] [flags] then NUL-separated
 * parts: the template source (own template only), then role, content, role, content...
 * Properties: parsing and rendering never crash, leak or run away: a template that loops or
 * recurses without end, or builds huge strings, is refused by the interpreter's bounds (steps,
 * depth, output and memory) with a message, within the fuzzer's time limit; a rendering is a
 * NUL-terminated string. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pd/chat_template.h"
#include "pd/json.h"

#define MAX_MSGS 32

static pd_chat_template *g_tpl[3];

static char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0, k;
  char *b = malloc(cap);
  while (b && (k = fread(b + n, 1, cap - n - 1, f)) > 0)
    if ((n += k) == cap - 1) {
      char *nb = realloc(b, cap *= 2);
      if (!nb) free(b);
      b = nb;
    }
  fclose(f);
  if (b) b[n] = 0;
  *len = n;
  return b;
}

static pd_chat_template *load(const char *path, bool from_config) {
  size_t len = 0;
  char *src = read_all(path, &len);
  if (!src) {
    fprintf(stderr, "fuzz_chat_template: cannot read %s\n", path);
    abort();
  }
  pd_err e = {0};
  pd_chat_template *t;
  if (from_config) {
    pd_json_error je;
    cJSON *cfg = pd_json_parse(src, len, &je);
    const cJSON *ct = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "chat_template") : NULL;
    FUZZ_CHECK(cJSON_IsString(ct));
    t = pd_chat_template_parse(ct->valuestring, strlen(ct->valuestring), &e);
    cJSON_Delete(cfg);
  } else {
    t = pd_chat_template_parse(src, len, &e);
  }
  free(src);
  if (!t) {
    fprintf(stderr, "fuzz_chat_template: %s: %s\n", path, e.msg);
    abort();
  }
  return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  g_tpl[0] = load(PD_TEST_DATA "/models/pycoder-12m/chat_template.jinja", false);
  g_tpl[1] = load(PD_TEST_DATA "/tokenizers/llama3/tokenizer_config.json", true);
  g_tpl[2] = load(PD_TEST_DATA "/tokenizers/qwen3/tokenizer_config.json", true);
  return 0;
}

/* A NUL-terminated copy of a part. */
static char *dup_part(fuzz_in *in) {
  fuzz_in part;
  fuzz_split(in, &part);
  char *s = malloc(part.n + 1);
  FUZZ_CHECK(s);
  memcpy(s, part.p, part.n);
  s[part.n] = 0;
  return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_tpl[0]) LLVMFuzzerInitialize(NULL, NULL);
  fuzz_in in = {data, size};
  int which = fuzz_byte(&in) % 4;
  uint8_t flags = fuzz_byte(&in);
  pd_err e = {0};
  pd_chat_template *own = NULL;
  const pd_chat_template *t;
  if (which == 0) {
    fuzz_in src;
    fuzz_split(&in, &src);
    own = pd_chat_template_parse((const char *)src.p, src.n, &e);
    if (!own) {
      FUZZ_CHECK((e.code == PD_EINVAL || e.code == PD_EUNSUPPORTED || e.code == PD_ENOMEM) &&
                 e.msg[0]);
      return 0;
    }
    t = own;
  } else {
    t = g_tpl[which - 1];
  }
  pd_chat_msg msgs[MAX_MSGS];
  char *strs[2 * MAX_MSGS];
  size_t n = 0, ns = 0;
  while (in.n && n < MAX_MSGS) {
    strs[ns++] = dup_part(&in);
    strs[ns++] = dup_part(&in);
    msgs[n].role = strs[ns - 2];
    msgs[n].content = strs[ns - 1];
    n++;
  }
  static const char *const specials[] = {NULL, "", "<s>", "<|begin_of_text|>"};
  pd_chat_vars v = {.messages = msgs,
                    .n_messages = n,
                    .add_generation_prompt = flags & 1,
                    .bos_token = specials[(flags >> 1) & 3],
                    .eos_token = specials[(flags >> 3) & 3]};
  char *out = NULL;
  pd_status st = pd_chat_template_render(t, &v, &out, &e);
  if (st == PD_OK) {
    FUZZ_CHECK(out);
    (void)strlen(out);
  } else {
    FUZZ_CHECK(e.msg[0]);
  }
  free(out);
  for (size_t i = 0; i < ns; i++) free(strs[i]);
  pd_chat_template_free(own);
  return 0;
}
