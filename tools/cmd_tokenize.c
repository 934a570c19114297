/* pdctl tokenize --model DIR (--text T | --text-file F | --decode 1,2,3) [--json] */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pdctl.h"

int cmd_tokenize(int argc, char **argv) {
  const char *model = NULL, *text = NULL, *text_file = NULL, *decode = NULL;
  bool json = false, help = false, add_special = false;
  pd_opt opts[] = {
      {"model", PD_OPT_STR, &model, "DIR", "model or tokenizer folder (tokenizer.json)", NULL},
      {"text", PD_OPT_STR, &text, "TEXT", "text to encode", NULL},
      {"text-file", PD_OPT_STR, &text_file, "FILE", "encode the contents of FILE (- = stdin)",
       NULL},
      {"decode", PD_OPT_STR, &decode, "IDS", "decode comma-separated token ids", NULL},
      {"add-special", PD_OPT_BOOL, &add_special, NULL, "add the BOS token if the model uses one",
       NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print JSON", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl tokenize --model DIR (--text T | --text-file F | --decode 1,2,3) "
          "[--json]\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!model) return pdctl_fail("tokenize needs --model DIR");
  if (!!text + !!text_file + !!decode != 1)
    return pdctl_fail("give exactly one of --text, --text-file, --decode");
  pd_tokenizer *tok = pd_tokenizer_load(model, &e);
  if (!tok) return pdctl_fail("%s", e.msg);
  int rc = 0;
  if (decode) {
    size_t n = 0;
    int32_t *ids = pdctl_parse_ids(decode, &n, &e);
    char *out = NULL;
    size_t len = 0;
    if (!ids || pd_tokenizer_decode(tok, ids, n, false, &out, &len, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
    } else if (json) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddStringToObject(o, "text", out);
      char *s = cJSON_PrintUnformatted(o);
      puts(s);
      free(s);
      cJSON_Delete(o);
    } else {
      fwrite(out, 1, len, stdout);
      putchar('\n');
    }
    free(ids);
    free(out);
  } else {
    size_t len = 0;
    char *buf = NULL;
    if (text_file) {
      buf = pdctl_read_file(text_file, &len);
      if (!buf) {
        pd_tokenizer_free(tok);
        return pdctl_fail("cannot read %s", text_file);
      }
    }
    const char *src = buf ? buf : text;
    if (!buf) len = strlen(text);
    int32_t *ids = NULL;
    size_t n = 0;
    if (pd_tokenizer_encode(tok, src, len, add_special, &ids, &n, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
    } else if (json) {
      cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "ids"),
            *t = cJSON_AddArrayToObject(o, "tokens");
      for (size_t i = 0; i < n; i++) {
        cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
        const char *ts = pd_tokenizer_id_to_token(tok, ids[i]);
        cJSON_AddItemToArray(t, cJSON_CreateString(ts ? ts : ""));
      }
      char *s = cJSON_PrintUnformatted(o);
      puts(s);
      free(s);
      cJSON_Delete(o);
    } else {
      for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
      putchar('\n');
    }
    free(ids);
    free(buf);
  }
  pd_tokenizer_free(tok);
  return rc;
}
