/* Sampling parameters: defaults, validation with OpenAI-style messages (vLLM's ranges), and
 * stop conditions. */
#include <math.h>
#include <stddef.h>

#include "pd/sampling.h"

void pd_sampling_params_init(pd_sampling_params *p) {
  p->temperature = 1.0f;
  p->top_k = 0;
  p->top_p = 1.0f;
  p->min_p = 0.0f;
  p->repetition_penalty = 1.0f;
  p->presence_penalty = 0.0f;
  p->frequency_penalty = 0.0f;
  p->logit_bias = NULL;
  p->n_logit_bias = 0;
  p->has_seed = false;
  p->seed = 0;
  p->max_tokens = -1;
  p->min_tokens = 0;
  p->stop_token_ids = NULL;
  p->n_stop_token_ids = 0;
  p->ignore_eos = false;
  p->n = 1;
  p->logprobs = -1;
  p->prompt_logprobs = -1;
}

bool pd_sampling_params_is_greedy(const pd_sampling_params *p) {
  return p->temperature < PD_SAMPLE_GREEDY_EPS;
}

/* The comparisons are written so that NaN fails them: !(x >= lo && x <= hi). */
pd_status pd_sampling_params_validate(const pd_sampling_params *p, int32_t vocab_size,
                                      pd_err *e) {
  if (!p) return pd_err_set(e, PD_EINVAL, "sampling params are missing");
  if (vocab_size <= 0) return pd_err_set(e, PD_EINVAL, "vocab size must be positive, got %d", vocab_size);
  if (!(p->temperature >= 0.0f) || isinf(p->temperature))
    return pd_err_set(e, PD_EINVAL, "temperature must be a non-negative number, got %g",
                      (double)p->temperature);
  if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
    return pd_err_set(e, PD_EINVAL, "top_p must be in (0, 1], got %g", (double)p->top_p);
  if (p->top_k < -1)
    return pd_err_set(e, PD_EINVAL, "top_k must be 0 or -1 (disable), or at least 1, got %d",
                      p->top_k);
  if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
    return pd_err_set(e, PD_EINVAL, "min_p must be in [0, 1], got %g", (double)p->min_p);
  if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
    return pd_err_set(e, PD_EINVAL, "presence_penalty must be in [-2, 2], got %g",
                      (double)p->presence_penalty);
  if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
    return pd_err_set(e, PD_EINVAL, "frequency_penalty must be in [-2, 2], got %g",
                      (double)p->frequency_penalty);
  if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 2.0f))
    return pd_err_set(e, PD_EINVAL, "repetition_penalty must be in (0, 2], got %g",
                      (double)p->repetition_penalty);
  if (p->n < 1 || p->n > PD_SAMPLE_MAX_N)
    return pd_err_set(e, PD_EINVAL, "n must be in [1, %d], got %d", PD_SAMPLE_MAX_N, p->n);
  if (p->max_tokens != -1 && p->max_tokens < 1)
    return pd_err_set(e, PD_EINVAL, "max_tokens must be at least 1, got %d", p->max_tokens);
  if (p->min_tokens < 0)
    return pd_err_set(e, PD_EINVAL, "min_tokens must be greater than or equal to 0, got %d",
                      p->min_tokens);
  if (p->max_tokens != -1 && p->min_tokens > p->max_tokens)
    return pd_err_set(e, PD_EINVAL,
                      "min_tokens must be less than or equal to max_tokens=%d, got %d",
                      p->max_tokens, p->min_tokens);
  if (p->logprobs < -1 || p->logprobs > PD_SAMPLE_MAX_LOGPROBS)
    return pd_err_set(e, PD_EINVAL, "logprobs must be in [0, %d] (or -1 for none), got %d",
                      PD_SAMPLE_MAX_LOGPROBS, p->logprobs);
  if (p->prompt_logprobs < -1 || p->prompt_logprobs > PD_SAMPLE_MAX_LOGPROBS)
    return pd_err_set(e, PD_EINVAL,
                      "prompt_logprobs must be in [0, %d] (or -1 for none), got %d",
                      PD_SAMPLE_MAX_LOGPROBS, p->prompt_logprobs);
  if (p->n_logit_bias > 0 && !p->logit_bias)
    return pd_err_set(e, PD_EINVAL, "logit_bias has %zu entries but no array", p->n_logit_bias);
  for (size_t i = 0; i < p->n_logit_bias; i++) {
    const pd_logit_bias *b = &p->logit_bias[i];
    if (b->id < 0 || b->id >= vocab_size)
      return pd_err_set(e, PD_EINVAL, "logit_bias: token id %d is out of vocabulary (size %d)",
                        b->id, vocab_size);
    if (!(b->bias >= -PD_SAMPLE_LOGIT_BIAS_MAX && b->bias <= PD_SAMPLE_LOGIT_BIAS_MAX))
      return pd_err_set(e, PD_EINVAL, "logit_bias: value for token %d must be in [-100, 100], got %g",
                        b->id, (double)b->bias);
  }
  if (p->n_stop_token_ids > 0 && !p->stop_token_ids)
    return pd_err_set(e, PD_EINVAL, "stop_token_ids has %zu entries but no array",
                      p->n_stop_token_ids);
  for (size_t i = 0; i < p->n_stop_token_ids; i++) {
    int32_t id = p->stop_token_ids[i];
    if (id < 0 || id >= vocab_size)
      return pd_err_set(e, PD_EINVAL, "stop_token_ids: token id %d is out of vocabulary (size %d)",
                        id, vocab_size);
  }
  return PD_OK;
}

const char *pd_finish_reason_str(pd_finish_reason r) {
  switch (r) {
    case PD_FINISH_STOP: return "stop";
    case PD_FINISH_LENGTH: return "length";
    default: return NULL;
  }
}

pd_finish_reason pd_sampling_check_stop(const pd_sampling_params *p, const int32_t *eos_ids,
                                        size_t n_eos, int32_t token, int32_t n_generated) {
  if (n_generated > p->min_tokens) {
    if (!p->ignore_eos)
      for (size_t i = 0; i < n_eos; i++)
        if (eos_ids[i] == token) return PD_FINISH_STOP;
    for (size_t i = 0; i < p->n_stop_token_ids; i++)
      if (p->stop_token_ids[i] == token) return PD_FINISH_STOP;
  }
  if (p->max_tokens > 0 && n_generated >= p->max_tokens) return PD_FINISH_LENGTH;
  return PD_FINISH_NONE;
}
