/* Golden tokenizer test: for every entry of tests/data/golden/tokenizer_reference.json (made
 * with Hugging Face `tokenizers`, add_special_tokens=False), encoding the text must give exactly
 * the reference ids, and decoding the reference ids (skip_special=false) exactly the reference
 * text. Tokenizers: llama2, llama3, qwen3 (decompressed by the build into argv[1]/<name>/) and
 * pycoder (tests/data/models/pycoder-12m). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "pd/tokenizer.h"

static char *read_all(const char *path) {
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
  return b;
}

static void print_ids(const char *label, const int32_t *v, size_t n) {
  fprintf(stderr, "    %s (%zu):", label, n);
  for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", (int)v[i]);
  fprintf(stderr, "\n");
}

/* Returns the number of failing entries. */
static int check_tokenizer(const char *name, const char *dir, const cJSON *cases) {
  pd_err e = {0};
  pd_tokenizer *t = pd_tokenizer_load(dir, &e);
  if (!t) {
    fprintf(stderr, "FAIL %s: cannot load %s: %s\n", name, dir, e.msg);
    return 1;
  }
  int fails = 0, n_cases = 0;
  const cJSON *c;
  cJSON_ArrayForEach(c, cases) {
    n_cases++;
    const cJSON *jt = cJSON_GetObjectItemCaseSensitive(c, "text");
    const cJSON *jids = cJSON_GetObjectItemCaseSensitive(c, "ids");
    const cJSON *jdec = cJSON_GetObjectItemCaseSensitive(c, "decoded");
    if (!cJSON_IsString(jt) || !cJSON_IsArray(jids) || !cJSON_IsString(jdec)) {
      fprintf(stderr, "FAIL %s: malformed reference entry %d\n", name, n_cases);
      fails++;
      continue;
    }
    size_t n_ref = (size_t)cJSON_GetArraySize(jids);
    int32_t *ref = malloc((n_ref + 1) * sizeof *ref);
    size_t k = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, jids) ref[k++] = (int32_t)x->valuedouble;

    int32_t *ids = NULL;
    size_t n_ids = 0;
    pd_status st = pd_tokenizer_encode(t, jt->valuestring, strlen(jt->valuestring), false, &ids, &n_ids, &e);
    if (st) {
      fprintf(stderr, "FAIL %s: encode(%s): %s\n", name, jt->valuestring, e.msg);
      fails++;
    } else if (n_ids != n_ref || memcmp(ids, ref, n_ids * sizeof *ids) != 0) {
      fprintf(stderr, "FAIL %s: ids differ for \"%s\"\n", name, jt->valuestring);
      print_ids("got", ids, n_ids);
      print_ids("want", ref, n_ref);
      fails++;
    }
    free(ids);

    char *text = NULL;
    size_t len = 0;
    st = pd_tokenizer_decode(t, ref, n_ref, false, &text, &len, &e);
    if (st) {
      fprintf(stderr, "FAIL %s: decode: %s\n", name, e.msg);
      fails++;
    } else if (len != strlen(jdec->valuestring) || memcmp(text, jdec->valuestring, len) != 0) {
      fprintf(stderr, "FAIL %s: decoded text differs\n    got  [%s]\n    want [%s]\n", name, text,
              jdec->valuestring);
      fails++;
    }
    free(text);
    free(ref);
  }
  printf("%-8s %d cases, %d failures\n", name, n_cases, fails);
  pd_tokenizer_free(t);
  return fails + (n_cases == 0);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <decompressed tokenizers dir>\n", argv[0]);
    return 2;
  }
  char *json = read_all(PD_TEST_DATA "/golden/tokenizer_reference.json");
  cJSON *ref = json ? cJSON_Parse(json) : NULL;
  free(json);
  if (!ref) {
    fprintf(stderr, "cannot read tokenizer_reference.json\n");
    return 1;
  }
  const char *names[] = {"llama2", "llama3", "qwen3", "pycoder"};
  int fails = 0;
  for (int i = 0; i < 4; i++) {
    char dir[4096];
    if (!strcmp(names[i], "pycoder")) snprintf(dir, sizeof dir, "%s/models/pycoder-12m", PD_TEST_DATA);
    else snprintf(dir, sizeof dir, "%s/%s", argv[1], names[i]);
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/tokenizer.json", dir);
    FILE *f = fopen(probe, "rb");
    if (!f) {
      fprintf(stderr, "SKIP: %s is missing (xz not available at build time?)\n", probe);
      cJSON_Delete(ref);
      return 77;
    }
    fclose(f);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(ref, names[i]);
    if (!cJSON_IsArray(cases)) {
      fprintf(stderr, "FAIL: no reference cases for %s\n", names[i]);
      fails++;
      continue;
    }
    fails += check_tokenizer(names[i], dir, cases);
  }
  cJSON_Delete(ref);
  if (fails) fprintf(stderr, "%d failures\n", fails);
  return fails ? 1 : 0;
}
