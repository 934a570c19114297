/* Continuous-batching scheduler over the paged KV cache (DESIGN.md common/sched).
 *
 * Each call to pd_sched_step runs ONE forward pass over a ragged batch that mixes prefill
 * chunks and decode tokens of many sequences, under a token budget (max_batch_tokens) and a
 * sequence cap (max_seqs):
 *   1. running sequences first, oldest first: a decoding sequence takes 1 token, a sequence
 *      in the middle of its prompt takes the next chunk (chunked prefill, so a long prompt
 *      never stalls the decodes around it);
 *   2. when the KV blocks run out, the NEWEST running sequence is preempted: its blocks are
 *      freed and it returns to the front of the waiting queue keeping its tokens, to be
 *      recomputed later (prefix caching usually makes that cheap); nothing it generated is
 *      lost;
 *   3. then waiting requests are admitted first come, first served while budget, sequence
 *      slots and blocks allow (none are admitted in a step that preempted);
 *   4. after the forward pass, every sequence whose known tokens are all computed samples its
 *      next token; finished sequences release their blocks at once.
 * Requests with n > 1 prefill once; at the end of the prompt the sequence is forked n - 1
 * times (the forks share every block; copy-on-write on the shared partial block).
 * A request that could never fit (prompt + max_tokens over the context, or more blocks than
 * the whole pool) is refused at pd_sched_add with PD_EINVAL / PD_ERANGE.
 * Not thread-safe: one thread owns the scheduler, its engine and pool. */
#ifndef PD_SCHED_H
#define PD_SCHED_H

#include <stdbool.h>
#include <stdint.h>

#include "pd/engine.h"
#include "pd/kvcache.h"
#include "pd/sample.h"
#include "pd/spec.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_sched pd_sched;

typedef struct pd_sched_opts {
  int max_batch_tokens; /* tokens per forward (default: the engine's max_batch_tokens) */
  int max_seqs;         /* running sequences (default: the engine's max_seqs) */
  int decode_prefill_tokens; /* > 0: the most prompt tokens a step takes while sequences decode
                                (prefill chunks beside decode steps keep those steps short);
                                <= 0: up to max_batch_tokens */
  const int32_t *eos_ids; /* end-of-text ids of the model (copied) */
  int n_eos;
  /* Speculative decoding (NULL or method PD_SPEC_NONE: off; copied). Decoding sequences
   * propose up to num_tokens tokens (n-gram lookup or the draft model's k autoregressive
   * steps, all speculating sequences together), and the step's one forward pass verifies them
   * beside the other sequences' tokens and prefill chunks: greedy keeps the longest prefix the
   * target's argmax agrees with, sampling uses exact rejection sampling (pd_spec_verify), and
   * the target's token after the accepted run is emitted too. Rejected positions are rolled
   * back (pd_kv_seq_truncate); only verified tokens are committed, so only they can enter the
   * prefix cache. Unless `fixed`, the number of proposals per step follows each sequence's
   * measured acceptance and the measured step times (speculation is turned down or off where
   * it would not pay). */
  const pd_spec_config *spec;
  /* With a draft model (spec method PD_SPEC_DRAFT): every prompt chunk a step computes is
   * computed in the draft model too, in the same step, so that the draft's KV of the context is
   * complete when the first token is reported (a prefill node ships it with the model's). */
  bool draft_prefill;
} pd_sched_opts;

/* What a step produced for one sequence (sample `index` of request `id`). */
typedef struct pd_sched_event {
  uint64_t id;
  int index;                  /* which of the request's n samples */
  int32_t token;              /* the new token, or -1 for an event without one */
  const pd_logprobs *logprobs; /* of token, when the request asked for logprobs; else NULL */
  pd_finish_reason finish;    /* PD_FINISH_NONE while it goes on */
  /* Once per request, with the first token of sample 0: logprobs of prompt positions
   * 1..n_prompt-1 (when prompt_logprobs was asked for), and how many prompt tokens came from
   * the prefix cache. */
  const pd_logprobs *prompt_logprobs;
  int n_prompt_logprobs;
  int num_cached_tokens;
  /* Where the sequence's KV lives, valid during the callback only: its block table and how
   * many tokens' KV is computed (a prefill node ships these pages from its callback). */
  const int32_t *block_table;
  int n_blocks;
  int n_kv_tokens;
  /* The same for the draft model's KV (NULL / 0 when the sequence has none). */
  const int32_t *draft_block_table;
  int n_draft_blocks;
  int n_draft_kv_tokens;
} pd_sched_event;

/* A request in full. pd_sched_add is this with n_generated = 0 and sample_index 0. */
typedef struct pd_sched_req {
  uint64_t id;
  const int32_t *prompt;
  int n_prompt;
  /* Output tokens already produced elsewhere (a migrated request): they are context whose KV
   * must be computed (or arrives), and they count as output for penalties, max_tokens and the
   * random stream, so a seeded continuation is the one the original node would have made. */
  const int32_t *generated;
  int n_generated;
  const pd_sampling_params *params;
  uint32_t sample_index; /* random stream of this choice when the caller fans n out itself */
  uint64_t cache_salt;   /* prefix-cache isolation (0 = shared) */
} pd_sched_req;

typedef void (*pd_sched_event_fn)(void *user, const pd_sched_event *ev);

typedef struct pd_sched_stats {
  int running, waiting;
  uint64_t steps, preemptions, forks;
  uint64_t prompt_tokens, generated_tokens, cached_prompt_tokens;
  uint64_t batched_tokens; /* tokens through the forward, all steps */
  /* speculative decoding */
  uint64_t spec_verified;   /* sequence-steps that verified proposals */
  uint64_t spec_proposed, spec_accepted; /* proposal tokens, and those accepted */
  uint64_t spec_emitted_hist[PD_SPEC_MAX_K + 2]; /* [j]: verifications that emitted j tokens */
  uint64_t spec_draft_steps;  /* forward passes of the draft model */
  double spec_draft_seconds;  /* wall time of the proposals (draft forwards and sampling) */
  double spec_verify_seconds; /* engine time of the steps that verified proposals */
  uint64_t spec_verify_steps;
} pd_sched_stats;

pd_sched *pd_sched_create(pd_engine *eng, pd_kv_pool *pool, const pd_sched_opts *o,
                          pd_sched_event_fn on_event, void *user, pd_err *e);
/* Frees the scheduler and aborts (frees) everything still in it. */
void pd_sched_free(pd_sched *s);

/* Queues a request. prompt is copied; params are validated and copied (with their arrays).
 * Refused (nothing queued): PD_EINVAL for bad parameters or a duplicate id, PD_ERANGE when it
 * can never fit (context or pool). */
pd_status pd_sched_add(pd_sched *s, uint64_t id, const int32_t *prompt, int n_prompt,
                       const pd_sampling_params *params, pd_err *e);

pd_status pd_sched_add_req(pd_sched *s, const pd_sched_req *r, pd_err *e);

/* Decode side of disaggregation. Reserves KV blocks for the request's n_prompt + n_generated
 * context tokens, whose KV another process computes and the caller writes into those blocks
 * (block_ids[0..*n_blocks), in token order; cap must hold them). The request is not scheduled
 * until pd_sched_activate. PD_EFULL (nothing changed) when the blocks are not free now; the
 * request then may be retried. Reserved blocks are never preempted. */
pd_status pd_sched_reserve(pd_sched *s, const pd_sched_req *r, int32_t *block_ids, int cap,
                           int *n_blocks, pd_err *e);
/* The KV landed: next_token is the token the prefill side sampled after the context (its
 * event was reported there). The sequence joins the running batch and decodes from it. */
pd_status pd_sched_activate(pd_sched *s, uint64_t id, int32_t next_token, pd_err *e);
/* With a draft model: blocks of the draft's pool for the same context of a request reserved
 * with pd_sched_reserve (not activated yet), which another process fills with the draft's KV.
 * PD_EFULL (nothing changed) when they are not free now: the draft then computes that context
 * itself when the sequence first speculates. PD_EINVAL without a draft model, PD_ENOTFOUND
 * when no such reservation waits. */
pd_status pd_sched_reserve_draft(pd_sched *s, uint64_t id, int32_t *block_ids, int cap,
                                 int *n_blocks, pd_err *e);
/* The draft's KV landed in the blocks of pd_sched_reserve_draft: at activation the draft
 * continues from it. Without this call activation lets go of those blocks (the draft computes
 * the context itself when the sequence first speculates). */
pd_status pd_sched_draft_landed(pd_sched *s, uint64_t id, pd_err *e);

/* Ends a request at any point (waiting, mid-prefill, decoding): its blocks are freed, no more
 * events. PD_ENOTFOUND when no such request is alive. */
pd_status pd_sched_abort(pd_sched *s, uint64_t id);

/* Runs one step (see the file comment) and reports through on_event. Returns PD_OK with
 * nothing done when there is no work. */
pd_status pd_sched_step(pd_sched *s, pd_err *e);

/* pd_sched_step in two halves, so that the caller's own host work (sending the last step's
 * tokens, reading its sockets) runs while the device computes the next step: begin schedules
 * the step and submits its forward pass (*started = false when nothing was run: no work, an
 * error, or nothing schedulable); end waits for it, commits and reports through on_event.
 * Between the two only pd_sched_add, pd_sched_add_req, pd_sched_reserve, pd_sched_activate,
 * pd_sched_abort (deferred to the end of the step), pd_sched_has_work, pd_sched_get_stats and
 * pd_sched_step_in_flight may be called; a begun step must be ended before pd_sched_free. */
pd_status pd_sched_step_begin(pd_sched *s, bool *started, pd_err *e);
pd_status pd_sched_step_end(pd_sched *s, pd_err *e);
bool pd_sched_step_in_flight(const pd_sched *s);

bool pd_sched_has_work(const pd_sched *s);
void pd_sched_get_stats(const pd_sched *s, pd_sched_stats *out);

#ifdef __cplusplus
}
#endif
#endif
