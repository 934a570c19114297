/* OpenAI-style request fields shared by the offline batch mode and the router: sampling
 * parameters read from a JSON object, and OpenAI-style error objects. */
#ifndef PD_OAI_H
#define PD_OAI_H

#include <cjson/cJSON.h>

#include "pd/sampling.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sampling parameters with their arrays owned (logit_bias, stop_token_ids). */
typedef struct pd_oai_params {
  pd_sampling_params p;
  pd_logit_bias *logit_bias;
  int32_t *stop_token_ids;
} pd_oai_params;

/* Reads max_tokens (or max_completion_tokens), temperature, top_p, top_k, min_p, seed,
 * repetition_penalty, presence_penalty, frequency_penalty, logit_bias ({"id": bias}),
 * stop_token_ids, ignore_eos, min_tokens, n, logprobs (integer, or true with top_logprobs),
 * top_logprobs, prompt_logprobs from obj (parsed by pd_json_parse, so 64-bit seeds are exact).
 * Absent or null fields keep pd_sampling_params_init's defaults except max_tokens
 * (default_max_tokens). A wrong type, or an integer that does not fit its field (n 2.5,
 * max_tokens 1e30, a seed beyond 64 bits, a negative count), is PD_EINVAL naming the field in
 * the message and in *param (may be NULL). Other ranges are pd_oai_params_validate's. */
pd_status pd_oai_params_parse(const cJSON *obj, int default_max_tokens, pd_oai_params *out,
                              const char **param, pd_err *e);
/* pd_sampling_params_validate, with *param set to the field its message names (or NULL). */
pd_status pd_oai_params_validate(const pd_sampling_params *p, int32_t vocab_size,
                                 const char **param, pd_err *e);
void pd_oai_params_free(pd_oai_params *p);

/* {"error": {"message": msg, "type": type, "param": null, "code": code}} */
cJSON *pd_oai_error(const char *message, const char *type, int code);

#ifdef __cplusplus
}
#endif
#endif
