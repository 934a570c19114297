/* What a request asks of sampling and what it gets back, without the sampler itself: the
 * parameters (OpenAI / vLLM semantics) and their checks, stop conditions, logprobs records.
 * The router and the ZeroMQ wire use these; the sampler (pd/sample.h) and the engine build on
 * them. */
#ifndef PD_SAMPLING_H
#define PD_SAMPLING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_SAMPLE_MAX_LOGPROBS 20   /* largest logprobs / prompt_logprobs */
#define PD_SAMPLE_MAX_N 128         /* largest n */
#define PD_SAMPLE_GREEDY_EPS 1e-5f  /* temperature below this is greedy (vLLM's _SAMPLING_EPS) */
#define PD_SAMPLE_LOGIT_BIAS_MAX 100.0f /* |bias| limit, as OpenAI */
#define PD_SAMPLE_CUTOFF 40.0f      /* see the file comment */

/* ---- request parameters ---- */

typedef struct pd_logit_bias {
  int32_t id;
  float bias; /* added to the logit; [-100, 100] */
} pd_logit_bias;

/* Defaults (pd_sampling_params_init) are the "off" values noted below. The arrays are
 * borrowed: pd_sampler_new copies what it keeps. */
typedef struct pd_sampling_params {
  float temperature;        /* >= 0; < PD_SAMPLE_GREEDY_EPS means greedy. Default 1 */
  int32_t top_k;            /* 0 or -1 = off; >= vocab is off too. Default 0 */
  float top_p;              /* (0, 1]; 1 = off */
  float min_p;              /* [0, 1]; 0 = off */
  float repetition_penalty; /* (0, 2]; 1 = off */
  float presence_penalty;   /* [-2, 2]; 0 = off */
  float frequency_penalty;  /* [-2, 2]; 0 = off */
  const pd_logit_bias *logit_bias; /* [n_logit_bias]; duplicated ids add up */
  size_t n_logit_bias;
  bool has_seed;            /* false: a seed is drawn from the process-wide source */
  uint64_t seed;
  int32_t max_tokens;       /* >= 1, or -1 = no limit (the scheduler caps at the context) */
  int32_t min_tokens;       /* >= 0: stop tokens are suppressed before this many tokens */
  const int32_t *stop_token_ids; /* [n_stop_token_ids]: stop even with ignore_eos */
  size_t n_stop_token_ids;
  bool ignore_eos;          /* EOS is not a stop (and is not suppressed by min_tokens) */
  int32_t n;                /* samples per prompt, [1, 128]; the scheduler forks sequences */
  int32_t logprobs;         /* -1 = off; 0..20 alternatives besides the chosen token */
  int32_t prompt_logprobs;  /* -1 = off; 0..20, for every prompt position after the first */
} pd_sampling_params;

void pd_sampling_params_init(pd_sampling_params *p);

/* Checks every field against vLLM's ranges (above) and the ids in logit_bias and
 * stop_token_ids against vocab_size. PD_EINVAL with an OpenAI-style message that starts with
 * the field's name ("top_p must be in (0, 1], got 0": pd_oai_params_validate reports it as the
 * error's param); PD_OK otherwise. */
pd_status pd_sampling_params_validate(const pd_sampling_params *p, int32_t vocab_size,
                                      pd_err *e);

bool pd_sampling_params_is_greedy(const pd_sampling_params *p);

/* ---- stop conditions ---- */

typedef enum pd_finish_reason {
  PD_FINISH_NONE = 0, /* keep generating */
  PD_FINISH_STOP,     /* EOS (unless ignore_eos) or a stop_token_id: OpenAI "stop" */
  PD_FINISH_LENGTH    /* max_tokens reached: OpenAI "length" */
} pd_finish_reason;

/* "stop", "length", or NULL for PD_FINISH_NONE (JSON null). */
const char *pd_finish_reason_str(pd_finish_reason r);

/* Whether generation ends after `token`, the n_generated-th output token (counting it).
 * A stop token ends it only when n_generated > min_tokens; a stop wins over length. The
 * stop token itself is part of the output ids (the detokenizer hides special tokens).
 * eos_ids: the model's end-of-sequence ids (tokenizer + generation_config), may be empty. */
pd_finish_reason pd_sampling_check_stop(const pd_sampling_params *p, const int32_t *eos_ids,
                                        size_t n_eos, int32_t token, int32_t n_generated);

/* ---- logprobs ---- */

typedef struct pd_token_logprob {
  int32_t id;
  float logprob;
} pd_token_logprob;

typedef struct pd_logprobs {
  int32_t token;   /* the chosen (or actual next prompt) token */
  float logprob;   /* its raw log-probability */
  int32_t rank;    /* 1 + number of tokens with a strictly larger logit */
  int32_t n_top;   /* entries in top */
  pd_token_logprob top[PD_SAMPLE_MAX_LOGPROBS]; /* descending; ties by lower id */
} pd_logprobs;

#ifdef __cplusplus
}
#endif
#endif
