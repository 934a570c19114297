/* Speculative decoding: what the scheduler needs beside the sampler's verification
 * (pd_spec_verify in pd/sample.h): the configuration, the n-gram (prompt lookup) proposer and
 * the cost model of the adaptive policy. The scheduler (pd/sched.h) runs the proposals and the
 * verification inside its continuous batch. */
#ifndef PD_SPEC_H
#define PD_SPEC_H

#include <stdbool.h>
#include <stdint.h>

#include "pd/engine.h"
#include "pd/kvcache.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_SPEC_MAX_K 16 /* most proposals per sequence and step */

typedef enum pd_spec_method {
  PD_SPEC_NONE = 0,
  PD_SPEC_NGRAM, /* prompt lookup: the continuation of an earlier match of the last n tokens */
  PD_SPEC_DRAFT  /* a smaller model with the target's vocabulary */
} pd_spec_method;

typedef struct pd_spec_config {
  pd_spec_method method;
  int num_tokens; /* k: most proposals per sequence and step (1..PD_SPEC_MAX_K) */
  bool fixed;     /* no adaptive policy: k proposals wherever there are any */
  int ngram_min, ngram_max; /* n-gram: match lengths, tried longest first */
  /* draft method: the draft model's engine and block pool (as many blocks as the target's,
   * same block size); the scheduler owns neither */
  pd_engine *draft;
  pd_kv_pool *draft_pool;
} pd_spec_config;

/* "ngram" / "draft" / "none" */
const char *pd_spec_method_name(pd_spec_method m);

/* Prompt lookup over the sequence's tokens t[0..n): for g from ngram_max down to ngram_min,
 * the most recent earlier occurrence of the last g tokens t[n-g..n) that is followed by at
 * least one token; its continuation t[i+g .. i+g+k) goes to out, where it reaches the end
 * repeating with period n - i - g (the end is the matched suffix again). Returns the number of
 * tokens proposed: k, or 0 when nothing matches. */
int pd_spec_ngram_propose(const int32_t *t, int n, int ngram_min, int ngram_max, int k,
                          int32_t *out);

/* Step time as a function of the tokens in the step, learned from measurements: one running
 * average per power-of-two bucket of token counts, interpolated linearly towards an adjacent
 * measured bucket. An unmeasured bucket takes the time of the nearest smaller measured one:
 * optimistic, so that the policy tries it and from then on knows. Buckets last measured
 * before step `since` count as unmeasured (so they are measured again now and then). */
#define PD_SPEC_TIME_BUCKETS 20
typedef struct pd_spec_timing {
  double x[PD_SPEC_TIME_BUCKETS], t[PD_SPEC_TIME_BUCKETS]; /* averaged tokens and seconds */
  uint64_t at[PD_SPEC_TIME_BUCKETS]; /* step counter of the last update, 0 = never */
} pd_spec_timing;

void pd_spec_timing_add(pd_spec_timing *tm, int tokens, double seconds, uint64_t step);
/* Estimated seconds for a step of `tokens` tokens; 0 when nothing is measured (since). */
double pd_spec_timing_estimate(const pd_spec_timing *tm, int tokens, uint64_t since);
/* Whether the bucket of `tokens` was measured at or after step `since`. */
bool pd_spec_timing_fresh(const pd_spec_timing *tm, int tokens, uint64_t since);

/* Expected tokens a step emits for a sequence that proposes k tokens each accepted with
 * probability a (independently): 1 + a + a^2 + ... + a^k. */
double pd_spec_expected_tokens(double a, int k);

#ifdef __cplusplus
}
#endif
#endif
