#include "pd/oai.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static pd_status get_num(const cJSON *obj, const char *name, double *v, bool *present,
                         pd_err *e) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
  *present = false;
  if (!it || cJSON_IsNull(it)) return PD_OK;
  if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
    return pd_err_set(e, PD_EINVAL, "'%s' must be a number", name);
  *v = it->valuedouble;
  *present = true;
  return PD_OK;
}

static pd_status get_int(const cJSON *obj, const char *name, int64_t lo, int64_t hi,
                         int64_t *v, bool *present, pd_err *e) {
  double d = 0;
  pd_status st = get_num(obj, name, &d, present, e);
  if (st || !*present) return st;
  if (d != floor(d)) return pd_err_set(e, PD_EINVAL, "'%s' must be an integer", name);
  if (d < (double)lo || d > (double)hi)
    return pd_err_set(e, PD_EINVAL, "'%s' must be between %lld and %lld, got %.0f", name,
                      (long long)lo, (long long)hi, d);
  *v = (int64_t)d;
  return PD_OK;
}

#define FLOAT_FIELD(name, dst)                            \
  do {                                                    \
    double d_;                                            \
    bool p_;                                              \
    if ((st = get_num(obj, name, &d_, &p_, e))) goto fail; \
    if (p_) dst = (float)d_;                              \
  } while (0)

#define INT_FIELD(name, lo, hi, dst)                               \
  do {                                                             \
    int64_t v_;                                                    \
    bool p_;                                                       \
    if ((st = get_int(obj, name, lo, hi, &v_, &p_, e))) goto fail; \
    if (p_) dst = (int32_t)v_;                                     \
  } while (0)

pd_status pd_oai_params_parse(const cJSON *obj, int default_max_tokens, pd_oai_params *out,
                              pd_err *e) {
  memset(out, 0, sizeof *out);
  pd_sampling_params *p = &out->p;
  pd_sampling_params_init(p);
  p->max_tokens = default_max_tokens;
  pd_status st = PD_OK;
  const int64_t big = 2147483647;
  INT_FIELD("max_tokens", -big, big, p->max_tokens);
  INT_FIELD("max_completion_tokens", -big, big, p->max_tokens);
  FLOAT_FIELD("temperature", p->temperature);
  FLOAT_FIELD("top_p", p->top_p);
  INT_FIELD("top_k", -big, big, p->top_k);
  FLOAT_FIELD("min_p", p->min_p);
  FLOAT_FIELD("repetition_penalty", p->repetition_penalty);
  FLOAT_FIELD("presence_penalty", p->presence_penalty);
  FLOAT_FIELD("frequency_penalty", p->frequency_penalty);
  INT_FIELD("min_tokens", -big, big, p->min_tokens);
  INT_FIELD("n", -big, big, p->n);
  INT_FIELD("prompt_logprobs", -1, big, p->prompt_logprobs);
  {
    int64_t seed;
    bool has;
    if ((st = get_int(obj, "seed", INT64_MIN / 2, INT64_MAX / 2, &seed, &has, e))) goto fail;
    if (has) {
      p->seed = (uint64_t)seed;
      p->has_seed = true;
    }
  }
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, "ignore_eos");
  if (it && !cJSON_IsNull(it)) {
    if (!cJSON_IsBool(it)) {
      st = pd_err_set(e, PD_EINVAL, "'ignore_eos' must be a boolean");
      goto fail;
    }
    p->ignore_eos = cJSON_IsTrue(it);
  }
  /* logprobs: an integer (completions, vLLM), or a boolean with top_logprobs (chat) */
  it = cJSON_GetObjectItemCaseSensitive(obj, "logprobs");
  if (it && !cJSON_IsNull(it)) {
    if (cJSON_IsBool(it)) {
      p->logprobs = cJSON_IsTrue(it) ? 0 : -1;
      if (cJSON_IsTrue(it)) INT_FIELD("top_logprobs", 0, big, p->logprobs);
    } else {
      INT_FIELD("logprobs", 0, big, p->logprobs);
    }
  }
  it = cJSON_GetObjectItemCaseSensitive(obj, "logit_bias");
  if (it && !cJSON_IsNull(it)) {
    if (!cJSON_IsObject(it)) {
      st = pd_err_set(e, PD_EINVAL, "'logit_bias' must be an object of token id: bias");
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
        st = pd_err_set(e, PD_EINVAL, "logit_bias key '%s' is not a token id", kv->string);
        goto fail;
      }
      if (!cJSON_IsNumber(kv) || !isfinite(kv->valuedouble)) {
        st = pd_err_set(e, PD_EINVAL, "logit_bias value for %ld must be a number", id);
        goto fail;
      }
      out->logit_bias[k++] = (pd_logit_bias){(int32_t)id, (float)kv->valuedouble};
    }
    p->logit_bias = out->logit_bias;
    p->n_logit_bias = (size_t)k;
  }
  it = cJSON_GetObjectItemCaseSensitive(obj, "stop_token_ids");
  if (it && !cJSON_IsNull(it)) {
    if (!cJSON_IsArray(it)) {
      st = pd_err_set(e, PD_EINVAL, "'stop_token_ids' must be a list of token ids");
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
      if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
          v->valuedouble > (double)big) {
        st = pd_err_set(e, PD_EINVAL, "'stop_token_ids' must hold token ids");
        goto fail;
      }
      out->stop_token_ids[k++] = (int32_t)v->valuedouble;
    }
    p->stop_token_ids = out->stop_token_ids;
    p->n_stop_token_ids = (size_t)k;
  }
  return PD_OK;
fail:
  pd_oai_params_free(out);
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
