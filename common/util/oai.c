#include "pd/oai.h"

#include "pd/json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Each reader names the field in its message and in *param (the OpenAI error's "param"). */

static pd_status bad(const char **param, const char *name, pd_err *e, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static pd_status bad(const char **param, const char *name, pd_err *e, const char *fmt, ...) {
  *param = name;
  va_list ap;
  va_start(ap, fmt);
  char msg[PD_ERR_MSG_MAX];
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return pd_err_set(e, PD_EINVAL, "%s", msg);
}

static const cJSON *field(const cJSON *obj, const char *name) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
  return it && !cJSON_IsNull(it) ? it : NULL;
}

static pd_status get_num(const cJSON *obj, const char *name, double *v, bool *present,
                         const char **param, pd_err *e) {
  const cJSON *it = field(obj, name);
  *present = false;
  if (!it) return PD_OK;
  if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
    return bad(param, name, e, "'%s' must be a number", name);
  *v = it->valuedouble;
  *present = true;
  return PD_OK;
}

/* An integer in [lo, hi], read exactly (pd_json_int64): 2.5, 1e30 and 2^64 do not fit. */
static pd_status get_int(const cJSON *obj, const char *name, int64_t lo, int64_t hi,
                         int64_t *v, bool *present, const char **param, pd_err *e) {
  const cJSON *it = field(obj, name);
  *present = false;
  if (!it) return PD_OK;
  if (!cJSON_IsNumber(it)) return bad(param, name, e, "'%s' must be an integer", name);
  int64_t x;
  if (!pd_json_int64(it, &x) || x < lo || x > hi) {
    if (isfinite(it->valuedouble) && it->valuedouble != floor(it->valuedouble))
      return bad(param, name, e, "'%s' must be an integer, got %g", name, it->valuedouble);
    return bad(param, name, e, "'%s' must be an integer in [%lld, %lld]", name, (long long)lo,
               (long long)hi);
  }
  *v = x;
  *present = true;
  return PD_OK;
}

#define FLOAT_FIELD(name, dst)                                     \
  do {                                                             \
    double d_;                                                     \
    bool p_;                                                       \
    if ((st = get_num(obj, name, &d_, &p_, param, e))) goto fail; \
    if (p_) dst = (float)d_;                                       \
  } while (0)

#define INT_FIELD(name, lo, hi, dst)                                        \
  do {                                                                      \
    int64_t v_;                                                             \
    bool p_;                                                                \
    if ((st = get_int(obj, name, lo, hi, &v_, &p_, param, e))) goto fail; \
    if (p_) dst = (int32_t)v_;                                              \
  } while (0)

pd_status pd_oai_params_parse(const cJSON *obj, int default_max_tokens, pd_oai_params *out,
                              const char **param, pd_err *e) {
  memset(out, 0, sizeof *out);
  const char *unused;
  if (!param) param = &unused;
  *param = NULL;
  pd_sampling_params *p = &out->p;
  pd_sampling_params_init(p);
  p->max_tokens = default_max_tokens;
  pd_status st = PD_OK;
  const int64_t big = INT32_MAX;
  INT_FIELD("max_tokens", 1, big, p->max_tokens);
  INT_FIELD("max_completion_tokens", 1, big, p->max_tokens);
  FLOAT_FIELD("temperature", p->temperature);
  FLOAT_FIELD("top_p", p->top_p);
  INT_FIELD("top_k", -1, big, p->top_k);
  FLOAT_FIELD("min_p", p->min_p);
  FLOAT_FIELD("repetition_penalty", p->repetition_penalty);
  FLOAT_FIELD("presence_penalty", p->presence_penalty);
  FLOAT_FIELD("frequency_penalty", p->frequency_penalty);
  INT_FIELD("min_tokens", 0, big, p->min_tokens);
  INT_FIELD("n", 1, big, p->n);
  INT_FIELD("prompt_logprobs", 0, PD_SAMPLE_MAX_LOGPROBS, p->prompt_logprobs);
  {
    /* vLLM's range: a signed 64-bit integer; the sampler's stream takes its bits */
    int64_t seed;
    bool has;
    if ((st = get_int(obj, "seed", INT64_MIN, INT64_MAX, &seed, &has, param, e))) goto fail;
    if (has) {
      p->seed = (uint64_t)seed;
      p->has_seed = true;
    }
  }
  const cJSON *it = field(obj, "ignore_eos");
  if (it) {
    if (!cJSON_IsBool(it)) {
      st = bad(param, "ignore_eos", e, "'ignore_eos' must be a boolean");
      goto fail;
    }
    p->ignore_eos = cJSON_IsTrue(it);
  }
  /* logprobs: an integer (completions, vLLM), or a boolean with top_logprobs (chat). As in
   * vLLM's chat, a top_logprobs above 0 with logprobs absent or false is refused rather than
   * ignored (beside an integer logprobs, the completions form, it has no meaning). */
  it = field(obj, "logprobs");
  int32_t top = 0;
  INT_FIELD("top_logprobs", 0, PD_SAMPLE_MAX_LOGPROBS, top);
  if (it && cJSON_IsBool(it)) {
    p->logprobs = cJSON_IsTrue(it) ? top : -1;
  } else if (it) {
    INT_FIELD("logprobs", 0, PD_SAMPLE_MAX_LOGPROBS, p->logprobs);
  }
  if (top > 0 && (!it || cJSON_IsFalse(it))) {
    st = bad(param, "top_logprobs", e, "when using `top_logprobs`, `logprobs` must be set to true");
    goto fail;
  }
  it = field(obj, "logit_bias");
  if (it) {
    if (!cJSON_IsObject(it)) {
      st = bad(param, "logit_bias", e, "'logit_bias' must be an object of token id: bias");
      goto fail;
    }
    int n = cJSON_GetArraySize(it), k = 0;
    out->logit_bias = calloc((size_t)(n ? n : 1), sizeof *out->logit_bias);
    if (!out->logit_bias) {
      st = pd_err_set(e, PD_ENOMEM, "out of memory");
      goto fail;
    }
    const cJSON *kv;
    cJSON_ArrayForEach(kv, it) {
      char *end;
      long id = strtol(kv->string, &end, 10);
      if (!kv->string[0] || *end || id < 0 || id > big) {
        st = bad(param, "logit_bias", e, "logit_bias key '%.40s' is not a token id", kv->string);
        goto fail;
      }
      if (!cJSON_IsNumber(kv) || !isfinite(kv->valuedouble)) {
        st = bad(param, "logit_bias", e, "logit_bias value for %ld must be a number", id);
        goto fail;
      }
      out->logit_bias[k++] = (pd_logit_bias){(int32_t)id, (float)kv->valuedouble};
    }
    p->logit_bias = out->logit_bias;
    p->n_logit_bias = (size_t)k;
  }
  it = field(obj, "stop_token_ids");
  if (it) {
    if (!cJSON_IsArray(it)) {
      st = bad(param, "stop_token_ids", e, "'stop_token_ids' must be a list of token ids");
      goto fail;
    }
    int n = cJSON_GetArraySize(it), k = 0;
    out->stop_token_ids = calloc((size_t)(n ? n : 1), sizeof *out->stop_token_ids);
    if (!out->stop_token_ids) {
      st = pd_err_set(e, PD_ENOMEM, "out of memory");
      goto fail;
    }
    const cJSON *v;
    cJSON_ArrayForEach(v, it) {
      int64_t id;
      if (!pd_json_int64(v, &id) || id < 0 || id > big) {
        st = bad(param, "stop_token_ids", e, "'stop_token_ids' must hold token ids");
        goto fail;
      }
      out->stop_token_ids[k++] = (int32_t)id;
    }
    p->stop_token_ids = out->stop_token_ids;
    p->n_stop_token_ids = (size_t)k;
  }
  return PD_OK;
fail:
  pd_oai_params_free(out);
  return st;
}

/* The names pd_sampling_params_validate starts its messages with. */
static const char *const sampling_fields[] = {
    "temperature", "top_p",      "top_k",      "min_p",           "presence_penalty",
    "frequency_penalty", "repetition_penalty", "n", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logit_bias", "stop_token_ids"};

pd_status pd_oai_params_validate(const pd_sampling_params *p, int32_t vocab_size,
                                 const char **param, pd_err *e) {
  *param = NULL;
  pd_status st = pd_sampling_params_validate(p, vocab_size, e);
  if (st != PD_OK && e)
    for (size_t i = 0; i < sizeof sampling_fields / sizeof *sampling_fields; i++) {
      size_t l = strlen(sampling_fields[i]);
      if (!strncmp(e->msg, sampling_fields[i], l) && (e->msg[l] == ' ' || e->msg[l] == ':'))
        *param = sampling_fields[i];
    }
  return st;
}

void pd_oai_params_free(pd_oai_params *p) {
  free(p->logit_bias);
  free(p->stop_token_ids);
  p->logit_bias = NULL;
  p->stop_token_ids = NULL;
}

cJSON *pd_oai_error(const char *message, const char *type, int code) {
  cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
  cJSON_AddStringToObject(err, "message", message);
  cJSON_AddStringToObject(err, "type", type);
  cJSON_AddNullToObject(err, "param");
  cJSON_AddNumberToObject(err, "code", code);
  return root;
}
