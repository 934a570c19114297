/* Accessors for the cJSON tree of tokenizer.json. */
#include <string.h>

#include "tok_internal.h"

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
