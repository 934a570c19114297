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

/* The adaptive policy: how many tokens a step's speculating sequences may propose (0: none),
 * learned from measured throughput: output tokens the decoding sequences emitted per second
 * of whole steps (proposing, the forward pass, verification). For each batch size (power-of-two
 * buckets of the number of decoding sequences) it holds one k for a window of steps (the first
 * ones not counted, so caches and graphs settle). It starts with k = 0 for a window and then
 * challenges the incumbent with a neighbour (k + 1 first) for half a window; the challenger's
 * rate is compared with the incumbent's window just before it and takes over when it is faster
 * by more than 1%. After a win the next challenge comes soon and goes on in the same direction;
 * while challengers lose they come ever more rarely: at least twice as late each time, and late
 * enough that a challenge as slow as the last one costs under 1% of the time (up to every 256th
 * window), so exploring costs little where speculation does not pay. */
#define PD_SPEC_BATCH_BUCKETS 12
#define PD_SPEC_WINDOW 16
#define PD_SPEC_WINDOW_WARM 0
#define PD_SPEC_MAX_BACKOFF 256 /* windows between challenges at most */
typedef struct pd_spec_policy {
  int K;
  struct {
    double rate[PD_SPEC_MAX_K + 1]; /* tokens / s of k's last window */
    int n[PD_SPEC_MAX_K + 1];       /* windows measured, by k */
    int inc;                        /* the incumbent k (-1: none yet) */
    double inc_rate;                /* its last window's rate */
    int windows, next_explore, explore_every, dir;
  } b[PD_SPEC_BATCH_BUCKETS];
  int bucket, k, left, warm; /* the current window */
  /* the current window's counted steps (a step over 3x the window's median time, a graph
   * being recorded or a stall, is left out of its rate) */
  int n_obs;
  int obs_tokens[PD_SPEC_WINDOW];
  double obs_seconds[PD_SPEC_WINDOW];
} pd_spec_policy;

void pd_spec_policy_init(pd_spec_policy *p, int K);
/* k for the next step, which has n_decode decoding sequences. */
int pd_spec_policy_choose(pd_spec_policy *p, int n_decode);
/* The step chosen for ran: its decoding sequences emitted `tokens` in `seconds` (the whole
 * step: proposing, the forward pass, verification). counts = false (a step mostly spent on
 * prefill chunks): it takes its place in the window but is not measured. */
void pd_spec_policy_observe(pd_spec_policy *p, int tokens, double seconds, bool counts);
/* Whether the current window tries speculation against a plain incumbent (k > 0 where k = 0
 * has been best): the caller may let only some sequences take part (a draft model must first
 * compute the KV of everything generated since it last ran, which plain steps skipped). */
bool pd_spec_policy_probing(const pd_spec_policy *p);
/* The incumbent k for n_decode sequences (-1: none yet). */
int pd_spec_policy_best(const pd_spec_policy *p, int n_decode);

#ifdef __cplusplus
}
#endif
#endif
