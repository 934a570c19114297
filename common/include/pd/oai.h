/* OpenAI-style request fields shared by the offline batch mode and the router: sampling
 * parameters read from a JSON object, and OpenAI-style error objects. */
#ifndef PD_OAI_H
#define PD_OAI_H

#include <cjson/cJSON.h>

#include "pd/sample.h"
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
 * top_logprobs, prompt_logprobs from obj. Absent fields keep pd_sampling_params_init's
 * defaults except max_tokens (default_max_tokens). Wrong types are PD_EINVAL naming the field.
 * Values are range-checked later by pd_sampling_params_validate. */
pd_status pd_oai_params_parse(const cJSON *obj, int default_max_tokens, pd_oai_params *out,
                              pd_err *e);
void pd_oai_params_free(pd_oai_params *p);

/* {"error": {"message": msg, "type": type, "param": null, "code": code}} */
cJSON *pd_oai_error(const char *message, const char *type, int code);

#ifdef __cplusplus
}
#endif
#endif
