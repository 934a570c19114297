/* Sampling: request parameters (OpenAI / vLLM semantics), per-sequence sampler state,
 * token sampling over one row of host float32 logits, logprobs, stop conditions, and
 * speculative-decoding verification (exact rejection sampling).
 *
 * Pipeline of pd_sample_token, in vLLM's order:
 *   1. min_tokens: stop tokens (EOS unless ignore_eos, stop_token_ids) get -inf while fewer
 *      than min_tokens tokens have been generated;
 *   2. logit_bias: logits[id] += bias;
 *   3. penalties: repetition (HF/vLLM: for tokens seen in prompt or output, positive logits
 *      are divided by it, non-positive ones multiplied), then frequency (-= f * count) and
 *      presence (-= p if count > 0), both over OUTPUT tokens only (OpenAI);
 *   4. greedy (temperature < PD_SAMPLE_GREEDY_EPS): argmax, ties to the lowest id;
 *   5. otherwise temperature (logits / T), then min_p (keep p >= min_p * p_max), top_k
 *      (keep logits >= the k-th largest: ties at the boundary are kept, like vLLM and HF),
 *      top_p (keep the smallest descending prefix whose renormalised mass reaches top_p;
 *      equal weights are ordered by id), and a draw from the renormalised survivors.
 * Tokens whose probability is below exp(-PD_SAMPLE_CUTOFF) times the largest one are never
 * drawn (relative mass dropped < vocab * 4e-18: far below float rounding).
 *
 * Logprobs are those of the model's RAW distribution, log_softmax of the unprocessed
 * logits, like vLLM's default (logprobs_mode "raw_logprobs") and OpenAI: they describe what
 * the model believes, independent of the sampling knobs. The rank of the chosen token is
 * 1 + the number of tokens with a strictly larger raw logit.
 *
 * Randomness is counter-based: the uniform for a draw is Philox4x32-10 keyed by the
 * sequence's seed (and its sample index among the request's n) and counted by the output
 * position and a lane. So a seeded sequence draws the same numbers whatever else is in the
 * batch, on whichever node samples it (the prefill node samples token 0, the decode node the
 * rest), across preemption and recomputation, and a retried call gives the same token.
 * Unseeded sequences take a seed from a process-wide source (getrandom); pd_sampler_seed()
 * reports it so it can travel with the request.
 *
 * Cost: O(vocab) per token with no full sort (a histogram of the candidates locates the
 * top_k / top_p boundary; only the boundary's few tokens are sorted). The row kernels use
 * AVX2 when the CPU has it (PD_SAMPLE_NO_AVX2=1 turns it off), else SSE2 or plain C; every
 * path gives bit-identical results, so a seeded request samples the same tokens on every node.
 *
 * Threads: a pd_sampler belongs to one sequence, a pd_sample_ws to one thread; nothing is
 * shared except the seed source, which is thread-safe. Nothing allocates on the per-token
 * path except pd_sampler_accept, which grows the penalty map (amortised) when penalties
 * are on, and the sort of a boundary made of thousands of exactly equal logits. */
#ifndef PD_SAMPLE_H
#define PD_SAMPLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/backend.h"
#include "pd/sampling.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Raw log_softmax of logits [vocab] at `token`, its rank, and the n_top (0..20) most likely
 * tokens. For prompt logprobs: logits of position i and the prompt token at i + 1 (the first
 * prompt token has none; OpenAI reports null). Reads logits only. NaN logits count as -inf.
 * PD_EINVAL for a bad token, vocab or n_top, or when no logit is finite. */
pd_status pd_logprobs_compute(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                              pd_logprobs *out, pd_err *e);

/* Process-wide: the sampler's portable (SSE2) kernels even where AVX2 is there (--cpu-isa
 * generic), so that machines of different families sample the same bits. */
void pd_sample_set_portable(bool on);

/* ---- workspace (one per sampling thread) ---- */

typedef struct pd_sample_ws pd_sample_ws;

/* Scratch for rows of up to max_vocab logits: about 38 bytes per entry (5.8 MB for 152k). */
pd_sample_ws *pd_sample_ws_new(int32_t max_vocab, pd_err *e);
void pd_sample_ws_free(pd_sample_ws *ws);

/* ---- per-sequence sampler ---- */

typedef struct pd_sampler pd_sampler;

/* Validates p (pd_sampling_params_validate) and builds the state of one sequence.
 * vocab_size: the logits row length. eos_ids: as for pd_sampling_check_stop (copied).
 * sample_index: which of the request's n samples this is (0..n-1); it is mixed into the
 * RNG key so that seeded samples of one request differ from each other. */
pd_sampler *pd_sampler_new(const pd_sampling_params *p, int32_t vocab_size,
                           const int32_t *eos_ids, size_t n_eos, uint32_t sample_index,
                           pd_err *e);
void pd_sampler_free(pd_sampler *s);

/* Records prompt tokens (for the repetition penalty; a no-op when it is off). May be called
 * in several chunks. PD_EINVAL for an id out of range, PD_ENOMEM. */
pd_status pd_sampler_add_prompt(pd_sampler *s, const int32_t *ids, size_t n, pd_err *e);

/* Samples the next token from logits [vocab] (host float32) with the sequence's state at
 * its current output position. Does not advance the state: call pd_sampler_accept with the
 * token (sampling again before that returns the same token). logits is used in place and
 * restored bit for bit before returning. lp may be NULL; otherwise it receives the raw
 * logprob and rank of the token and max(0, params.logprobs) top alternatives.
 * PD_EINVAL when ws is too small or no logit is finite (or one is +inf). */
pd_status pd_sample_token(pd_sampler *s, pd_sample_ws *ws, float *logits, int32_t *token,
                          pd_logprobs *lp, pd_err *e);

/* Appends an output token: updates penalty counts incrementally (O(1)), advances the
 * position, and reports whether generation is finished (finish may be NULL). */
pd_status pd_sampler_accept(pd_sampler *s, int32_t token, pd_finish_reason *finish,
                            pd_err *e);

/* Removes the last n accepted tokens (drafts accepted tentatively while proposing). */
pd_status pd_sampler_rollback(pd_sampler *s, int32_t n, pd_err *e);

/* Applies steps 1-3 of the pipeline (min_tokens, logit_bias, penalties) to logits [vocab]
 * in place and permanently: the logits greedy decoding takes the argmax of. */
pd_status pd_sampler_process_logits(pd_sampler *s, float *logits, pd_err *e);

/* The sampling distribution at the current position as dense probabilities probs [vocab]
 * (zeros where filtered; one-hot at the argmax when greedy). logits is restored as in
 * pd_sample_token. */
pd_status pd_sampler_probs(pd_sampler *s, pd_sample_ws *ws, float *logits, float *probs,
                           pd_err *e);

uint64_t pd_sampler_seed(const pd_sampler *s);          /* the effective seed */
int32_t pd_sampler_n_generated(const pd_sampler *s);    /* output tokens accepted */
int32_t pd_sampler_vocab(const pd_sampler *s);
const pd_sampling_params *pd_sampler_params(const pd_sampler *s); /* arrays point to copies */

/* ---- device sampling ---- */

/* Describes the sequence's next draw for a backend's `sample` op (pd/backend.h): fills *spec
 * (everything but row and edit_begin; u is pd_sampler_uniform on PD_RNG_LANE_SAMPLE; n_top is
 * -1 without logprobs, else max(0, params.logprobs)) and writes the row's edits (min_tokens
 * suppression, logit_bias, penalties; one entry per distinct id) to edits[0 .. cap). Returns
 * the number of edits the row needs, which may exceed cap: then call again with more room.
 * Reads the state only (like pd_sample_token, it does not advance it). */
int32_t pd_sampler_dev_spec(const pd_sampler *s, pd_dev_sample_spec *spec,
                            pd_dev_sample_edit *edits, int32_t cap);

/* ---- random numbers ---- */

/* Lanes separate the independent draws made at one output position. */
typedef enum pd_rng_lane {
  PD_RNG_LANE_SAMPLE = 0,   /* pd_sample_token and the bonus token of verification */
  PD_RNG_LANE_ACCEPT = 1,   /* speculative accept test */
  PD_RNG_LANE_RESIDUAL = 2, /* speculative resample from the residual */
  PD_RNG_LANE_DRAFT = 3,    /* draft proposals */
  PD_RNG_LANE_USER = 16     /* first lane free for other uses */
} pd_rng_lane;

/* A uniform double in [0, 1) (53 random bits) for the sequence's current output position
 * and lane: Philox4x32-10, key = splitmix64 mix of (seed, sample_index), counter =
 * {position low, position high, lane, 0}. */
double pd_sampler_uniform(const pd_sampler *s, uint32_t lane);

/* Philox4x32-10 (Salmon et al. 2011; Random123, cuRAND): one block. */
void pd_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* ---- speculative decoding ---- */

/* Draft proposal: q = the sampling distribution of the draft logits [vocab] at the current
 * position (pd_sampler_probs), and a draw from it on PD_RNG_LANE_DRAFT. q_out [vocab] may be
 * NULL when the caller does not keep it. The caller then accepts the draft tentatively
 * (pd_sampler_accept, so the next position sees its penalties) and rolls all drafts back
 * (pd_sampler_rollback) before pd_spec_verify. */
pd_status pd_spec_draft_token(pd_sampler *s, pd_sample_ws *ws, float *draft_logits,
                              float *q_out, int32_t *token, pd_err *e);

/* Verifies k draft tokens against the target model and emits 1..k+1 tokens.
 * target_logits: [k+1][vocab], row j = target logits after the prompt, the accepted output
 *   and draft[0..j-1]; rows are used in place and restored.
 * draft: [k] proposed ids. draft_probs: [k][vocab] the draft's sampling distribution at each
 *   position, or NULL for deterministic drafts (n-gram lookup: q is one-hot at the draft).
 * Exact (temperature > 0): with p_j the target's sampling distribution at position j
 *   (penalties see the tokens accepted so far), draft x is accepted with probability
 *   min(1, p_j(x) / q_j(x)); on the first rejection a token is drawn from
 *   norm(max(0, p_j - q_j)) and verification ends; if all k are accepted a bonus token is
 *   drawn from p_k. The emitted tokens are distributed exactly as sampling from the target.
 * Greedy: draft j is accepted iff it equals the argmax of the processed target logits; the
 *   first mismatch emits that argmax.
 * out_tokens: [k+1]; *n_out: emitted count. Emitted tokens are ACCEPTED into s (do not call
 * pd_sampler_accept for them); emission stops early at a stop token or max_tokens, and
 * *finish (may be NULL) says why. lp: NULL or [k+1], filled like pd_sample_token's for each
 * emitted token from its target row. k may be 0 (a plain sample + accept). */
pd_status pd_spec_verify(pd_sampler *s, pd_sample_ws *ws, float *target_logits,
                         const int32_t *draft, const float *draft_probs, int32_t k,
                         int32_t *out_tokens, int32_t *n_out, pd_logprobs *lp,
                         pd_finish_reason *finish, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif
