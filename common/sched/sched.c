/* Continuous batching: see pd/sched.h for the policy. */
#include "pd/sched.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct sreq sreq;

typedef struct sseq {
  sreq *req;
  int index;         /* sample index within the request */
  uint64_t order;    /* admission order: request arrival, then index */
  pd_kv_seq *kv;
  pd_sampler *smp;
  /* this step */
  int n_new;         /* tokens scheduled */
  int sample_row;    /* row in the step's logits, or -1 */
  int dev_row;       /* index of its device-sampling spec this step, or -1 (host sampling) */
  int lp_row0;       /* first prompt-logprob row, or -1 */
  int lp_pos0, lp_count; /* prompt positions covered by those rows */
  /* speculative decoding */
  int n_draft;                     /* proposals appended to kv for this step (0: none) */
  int32_t draft[PD_SPEC_MAX_K];    /* the proposals */
  long dq_off;                     /* their draft distributions in the step's dq, or -1 */
  int c0;                          /* computed tokens before this step */
  float acc_a, acc_r;              /* decayed counts of accepted and rejected proposals */
  pd_kv_seq *dkv;                  /* the draft model's KV (draft method) */
  bool dkv_landed; /* reserved: the draft's KV of the context landed in dkv's blocks */
  bool spec_dev; /* greedy verification on the device: rows dev_row .. dev_row + n_draft */
} sseq;

struct sreq {
  uint64_t id;
  int n, n_prompt, n_generated, max_tokens;
  uint32_t sample_base;
  uint64_t cache_salt;
  bool reserved; /* waiting for its KV (pd_sched_reserve) */
  pd_sampling_params p;
  pd_logit_bias *lb;
  int32_t *stop_ids;
  sseq **seqs; /* [n]; NULL when not created yet or finished */
  int n_alive;
  bool forked;
  int num_cached;
  pd_logprobs *prompt_lp; /* [n_prompt - 1] when asked */
  int prompt_lp_done;     /* positions recorded */
  bool first_sent;
  bool counted; /* prompt counted in the stats */
  bool aborted; /* aborted from an event callback: dropped at the end of the step */
};

typedef struct seq_list {
  sseq **v;
  int n, cap;
} seq_list;

struct pd_sched {
  pd_engine *eng;
  pd_kv_pool *pool;
  pd_sched_event_fn on_event;
  void *user;
  int max_batch_tokens, max_seqs, max_model_len, max_blocks, V;
  int decode_prefill_tokens; /* > 0: prompt tokens a step takes while sequences decode */
  int32_t *eos;
  int n_eos;
  seq_list running, waiting, reserved;
  sreq **reqs;
  int n_reqs, cap_reqs;
  uint64_t next_order, salt_counter;
  pd_sample_ws *ws;
  /* per-step scratch */
  int32_t *tokens, *pos, *slots, *qstart, *ctx, *bt, *rows;
  float *logits;
  sseq **sched;
  /* device sampling (engines that can): per-step specs, edits, results */
  bool dev_sample;
  pd_dev_sample_spec *specs;
  pd_dev_sample_out *outs;
  pd_dev_sample_edit *edits;
  int32_t edits_cap;
  pd_sched_stats st;
  bool in_step;   /* between the start and the end of a step: aborts are deferred */
  bool in_flight; /* a step's forward pass was submitted and not yet finished */
  pd_batch batch; /* that step's batch (arrays above) */
  int n_sched;    /* that step's sequences: sched[0 .. n_sched) */
  /* speculative decoding (spec.method != PD_SPEC_NONE) */
  pd_spec_config spec;
  pd_spec_policy policy;            /* the adaptive choice of k */
  bool policy_step;                 /* this step's k came from the policy */
  double step_t0;                   /* when the step began */
  int step_tokens;                  /* tokens it emitted */
  bool step_measured;               /* it counts for the policy (mostly decode) */
  int step_decoding;                /* decoding sequences in the step */
  uint64_t step_gen0;               /* generated_tokens before the step's emits */
  double propose_s;                 /* the step's proposing time */
  double acc_a, acc_r;              /* decayed accepted and rejected counts, all sequences */
  bool step_verifies;               /* this step verifies proposals */
  double eng_t0;                    /* engine seconds at the step's submit */
  float *dq;                        /* draft distributions of the step [.., V] */
  size_t dq_cap, dq_used;           /* in floats */
  sseq **cand;                      /* proposing sequences of the step */
  int *plan;                        /* their planned proposal counts */
  /* the draft model's batch */
  int d_max_batch_tokens, d_max_blocks;
  int32_t *d_tokens, *d_pos, *d_slots, *d_qstart, *d_ctx, *d_bt, *d_rows;
  float *d_logits;
  int *d_idx; /* candidate index of each draft batch sequence */
  int *d_hrow, *d_drow; /* its host logits row or device-sampled row (-1: none) */
  bool d_dev;           /* the draft engine samples on the device: greedy proposals there */
  pd_dev_sample_spec *d_specs;
  pd_dev_sample_out *d_outs;
  bool draft_prefill; /* prompt chunks run through the draft too (pd_sched_opts) */
};

/* ---- small containers ---- */

static bool list_reserve(seq_list *l, int n) {
  if (n <= l->cap) return true;
  int cap = l->cap ? l->cap : 16;
  while (cap < n) cap *= 2;
  sseq **v = realloc(l->v, (size_t)cap * sizeof *v);
  if (!v) return false;
  l->v = v;
  l->cap = cap;
  return true;
}

static bool list_insert(seq_list *l, int at, sseq *q) {
  if (!list_reserve(l, l->n + 1)) return false;
  memmove(l->v + at + 1, l->v + at, (size_t)(l->n - at) * sizeof *l->v);
  l->v[at] = q;
  l->n++;
  return true;
}

static void list_remove_at(seq_list *l, int at) {
  memmove(l->v + at, l->v + at + 1, (size_t)(l->n - at - 1) * sizeof *l->v);
  l->n--;
}

static bool list_remove(seq_list *l, const sseq *q) {
  for (int i = 0; i < l->n; i++)
    if (l->v[i] == q) {
      list_remove_at(l, i);
      return true;
    }
  return false;
}

/* ---- lifecycle ---- */

static pd_status spec_init(pd_sched *s, const pd_spec_config *c, pd_err *e) {
  if (c->method != PD_SPEC_NGRAM && c->method != PD_SPEC_DRAFT)
    return pd_err_set(e, PD_EINVAL, "speculative decoding: unknown method %d", (int)c->method);
  if (c->num_tokens < 1 || c->num_tokens > PD_SPEC_MAX_K)
    return pd_err_set(e, PD_EINVAL, "--num-speculative-tokens must be in [1, %d], not %d",
                      PD_SPEC_MAX_K, c->num_tokens);
  if (c->method == PD_SPEC_NGRAM && (c->ngram_min < 1 || c->ngram_max < c->ngram_min))
    return pd_err_set(e, PD_EINVAL, "--ngram-min and --ngram-max: need 1 <= min <= max, not %d, %d",
                      c->ngram_min, c->ngram_max);
  s->spec = *c;
  pd_spec_policy_init(&s->policy, c->num_tokens);
  size_t S = (size_t)s->max_seqs;
  s->cand = malloc(S * sizeof *s->cand);
  s->plan = malloc(S * sizeof *s->plan);
  if (!s->cand || !s->plan) return pd_err_set(e, PD_ENOMEM, "out of memory");
  if (c->method != PD_SPEC_DRAFT) return PD_OK;
  if (!c->draft || !c->draft_pool)
    return pd_err_set(e, PD_EINVAL, "speculative decoding with a draft model: no draft engine");
  const pd_engine_opts *d = pd_engine_get_opts(c->draft);
  if (pd_engine_config(c->draft)->vocab_size != s->V)
    return pd_err_set(e, PD_EINVAL, "the draft model's vocabulary (%d) differs from the target's (%d)",
                      pd_engine_config(c->draft)->vocab_size, s->V);
  if (d->max_seqs < s->max_seqs || pd_kv_pool_block_size(c->draft_pool) != d->block_size)
    return pd_err_set(e, PD_EINVAL, "the draft engine takes fewer sequences than the target's");
  s->d_max_batch_tokens = d->max_batch_tokens;
  s->d_max_blocks = (d->max_model_len + d->block_size - 1) / d->block_size;
  size_t T = (size_t)s->d_max_batch_tokens;
  s->d_tokens = malloc(T * sizeof(int32_t));
  s->d_pos = malloc(T * sizeof(int32_t));
  s->d_slots = malloc(T * sizeof(int32_t));
  s->d_rows = malloc(S * sizeof(int32_t));
  s->d_qstart = malloc((S + 1) * sizeof(int32_t));
  s->d_ctx = malloc(S * sizeof(int32_t));
  s->d_idx = malloc(S * sizeof(int));
  s->d_hrow = malloc(S * sizeof(int));
  s->d_drow = malloc(S * sizeof(int));
  s->d_dev = pd_engine_can_sample(c->draft);
  if (s->d_dev) {
    s->d_specs = malloc(S * sizeof *s->d_specs);
    s->d_outs = malloc(S * sizeof *s->d_outs);
    if (!s->d_specs || !s->d_outs) return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  s->d_bt = malloc(S * (size_t)s->d_max_blocks * sizeof(int32_t));
  s->d_logits = malloc(S * (size_t)s->V * sizeof(float));
  if (!s->d_tokens || !s->d_pos || !s->d_slots || !s->d_rows || !s->d_qstart || !s->d_ctx ||
      !s->d_idx || !s->d_hrow || !s->d_drow || !s->d_bt || !s->d_logits)
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  return PD_OK;
}

pd_sched *pd_sched_create(pd_engine *eng, pd_kv_pool *pool, const pd_sched_opts *o,
                          pd_sched_event_fn on_event, void *user, pd_err *e) {
  pd_sched *s = calloc(1, sizeof *s);
  if (!s) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  const pd_engine_opts *eo = pd_engine_get_opts(eng);
  s->eng = eng;
  s->pool = pool;
  s->on_event = on_event;
  s->user = user;
  s->max_batch_tokens = o && o->max_batch_tokens > 0 ? o->max_batch_tokens : eo->max_batch_tokens;
  if (s->max_batch_tokens > eo->max_batch_tokens) s->max_batch_tokens = eo->max_batch_tokens;
  s->max_seqs = o && o->max_seqs > 0 ? o->max_seqs : eo->max_seqs;
  s->decode_prefill_tokens = o && o->decode_prefill_tokens > 0 ? o->decode_prefill_tokens : 0;
  if (s->max_seqs > eo->max_seqs) s->max_seqs = eo->max_seqs;
  s->max_model_len = eo->max_model_len;
  s->max_blocks = (eo->max_model_len + eo->block_size - 1) / eo->block_size;
  s->V = pd_engine_config(eng)->vocab_size;
  if (pd_kv_pool_block_size(pool) != eo->block_size ||
      pd_kv_pool_num_blocks(pool) > eo->num_blocks) {
    pd_err_set(e, PD_EINVAL, "KV pool (%d blocks of %d) does not match the engine (%d of %d)",
               pd_kv_pool_num_blocks(pool), pd_kv_pool_block_size(pool), eo->num_blocks,
               eo->block_size);
    free(s);
    return NULL;
  }
  if (o && o->n_eos > 0) {
    s->eos = malloc((size_t)o->n_eos * sizeof *s->eos);
    if (!s->eos) goto oom;
    memcpy(s->eos, o->eos_ids, (size_t)o->n_eos * sizeof *s->eos);
    s->n_eos = o->n_eos;
  }
  size_t T = (size_t)s->max_batch_tokens, S = (size_t)s->max_seqs;
  s->tokens = malloc(T * sizeof(int32_t));
  s->pos = malloc(T * sizeof(int32_t));
  s->slots = malloc(T * sizeof(int32_t));
  s->rows = malloc(T * sizeof(int32_t));
  s->qstart = malloc((S + 1) * sizeof(int32_t));
  s->ctx = malloc(S * sizeof(int32_t));
  s->bt = malloc(S * (size_t)s->max_blocks * sizeof(int32_t));
  s->sched = malloc(S * sizeof *s->sched);
  s->logits = malloc(T * (size_t)s->V * sizeof(float));
  if (!s->tokens || !s->pos || !s->slots || !s->rows || !s->qstart || !s->ctx || !s->bt ||
      !s->sched || !s->logits)
    goto oom;
  s->dev_sample = pd_engine_can_sample(eng);
  if (s->dev_sample) {
    /* a row per token at most (greedy verification samples every row of a sequence) */
    s->specs = malloc(T * sizeof *s->specs);
    s->outs = malloc(T * sizeof *s->outs);
    if (!s->specs || !s->outs) goto oom;
  }
  s->ws = pd_sample_ws_new(s->V, e);
  if (!s->ws) {
    pd_sched_free(s);
    return NULL;
  }
  if (o && o->spec && o->spec->method != PD_SPEC_NONE && spec_init(s, o->spec, e) != PD_OK) {
    pd_sched_free(s);
    return NULL;
  }
  s->draft_prefill = o && o->draft_prefill && s->spec.method == PD_SPEC_DRAFT;
  return s;
oom:
  pd_err_set(e, PD_ENOMEM, "out of memory");
  pd_sched_free(s);
  return NULL;
}

static void seq_free(sseq *q) {
  if (!q) return;
  pd_kv_seq_free(q->kv);
  pd_kv_seq_free(q->dkv);
  pd_sampler_free(q->smp);
  free(q);
}

static void req_free(sreq *r) {
  if (!r) return;
  for (int i = 0; i < r->n; i++) seq_free(r->seqs[i]);
  free(r->seqs);
  free(r->lb);
  free(r->stop_ids);
  free(r->prompt_lp);
  free(r);
}

void pd_sched_free(pd_sched *s) {
  if (!s) return;
  for (int i = 0; i < s->n_reqs; i++) req_free(s->reqs[i]);
  free(s->reqs);
  free(s->running.v);
  free(s->waiting.v);
  free(s->reserved.v);
  free(s->eos);
  free(s->tokens);
  free(s->pos);
  free(s->slots);
  free(s->rows);
  free(s->qstart);
  free(s->ctx);
  free(s->bt);
  free(s->sched);
  free(s->logits);
  free(s->specs);
  free(s->outs);
  free(s->edits);
  free(s->dq);
  free(s->cand);
  free(s->plan);
  free(s->d_tokens);
  free(s->d_pos);
  free(s->d_slots);
  free(s->d_rows);
  free(s->d_qstart);
  free(s->d_ctx);
  free(s->d_idx);
  free(s->d_hrow);
  free(s->d_drow);
  free(s->d_specs);
  free(s->d_outs);
  free(s->d_bt);
  free(s->d_logits);
  pd_sample_ws_free(s->ws);
  free(s);
}

static int find_req(const pd_sched *s, uint64_t id) {
  for (int i = 0; i < s->n_reqs; i++)
    if (s->reqs[i]->id == id) return i;
  return -1;
}

static void drop_req(pd_sched *s, sreq *r) {
  for (int i = 0; i < r->n; i++)
    if (r->seqs[i]) {
      if (!list_remove(&s->running, r->seqs[i]) && !list_remove(&s->waiting, r->seqs[i]))
        list_remove(&s->reserved, r->seqs[i]);
    }
  int k = find_req(s, r->id);
  if (k >= 0) {
    memmove(s->reqs + k, s->reqs + k + 1, (size_t)(s->n_reqs - k - 1) * sizeof *s->reqs);
    s->n_reqs--;
  }
  req_free(r);
}

static sseq *seq_new(pd_sched *s, sreq *r, int index, pd_kv_seq *kv, pd_err *e) {
  sseq *q = calloc(1, sizeof *q);
  if (!q) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  q->req = r;
  q->index = index;
  q->order = s->next_order++;
  q->kv = kv;
  q->dq_off = -1;
  q->smp = pd_sampler_new(&r->p, s->V, s->eos, (size_t)s->n_eos, r->sample_base + (uint32_t)index,
                          e);
  bool ok = q->smp &&
            pd_sampler_add_prompt(q->smp, pd_kv_seq_tokens(kv), (size_t)r->n_prompt, e) == PD_OK;
  /* tokens generated elsewhere count as output: penalties, max_tokens, random position */
  for (int i = 0; ok && i < r->n_generated; i++)
    ok = pd_sampler_accept(q->smp, pd_kv_seq_tokens(kv)[r->n_prompt + i], NULL, e) == PD_OK;
  if (!ok) {
    pd_sampler_free(q->smp);
    free(q);
    return NULL;
  }
  return q;
}

/* Validates and builds a request with its first sequence (not queued anywhere yet). */
static sreq *req_build(pd_sched *s, const pd_sched_req *in, bool reserve, pd_err *e) {
  const pd_sampling_params *params = in->params;
  int n_prompt = in->n_prompt, n_gen = in->n_generated, n_ctx = n_prompt + n_gen;
  if (n_prompt <= 0 || n_gen < 0) {
    pd_err_set(e, PD_EINVAL, "the prompt is empty");
    return NULL;
  }
  if (find_req(s, in->id) >= 0) {
    pd_err_set(e, PD_EINVAL, "request id %llu is in use", (unsigned long long)in->id);
    return NULL;
  }
  if (pd_sampling_params_validate(params, s->V, e) != PD_OK) return NULL;
  if ((n_gen > 0 || reserve) && params->n > 1) {
    pd_err_set(e, PD_EINVAL, "n > 1 is fanned out by the caller here");
    return NULL;
  }
  for (int i = 0; i < n_ctx; i++) {
    int32_t t = i < n_prompt ? in->prompt[i] : in->generated[i - n_prompt];
    if (t < 0 || t >= s->V) {
      pd_err_set(e, PD_EINVAL, "token %d is outside the vocabulary (%d)", t, s->V);
      return NULL;
    }
  }
  int max_tokens = params->max_tokens < 0 ? s->max_model_len - n_prompt : params->max_tokens;
  if (n_gen >= max_tokens && max_tokens > 0) {
    pd_err_set(e, PD_EINVAL, "%d tokens were already generated of max_tokens %d", n_gen,
               max_tokens);
    return NULL;
  }
  if (n_prompt + (max_tokens > 0 ? max_tokens : 1) > s->max_model_len) {
    pd_err_set(e, PD_ERANGE,
               "this request needs %d tokens (%d of prompt + %d to generate), over the "
               "context length of %d",
               n_prompt + max_tokens, n_prompt, max_tokens, s->max_model_len);
    return NULL;
  }
  /* Any one sequence must be able to finish alone, or preemption could never make room. */
  int need = pd_kv_pool_blocks_for_tokens(s->pool, n_prompt + max_tokens);
  if (need > pd_kv_pool_num_blocks(s->pool)) {
    pd_err_set(e, PD_ERANGE, "this request needs %d KV blocks but the cache holds only %d",
               need, pd_kv_pool_num_blocks(s->pool));
    return NULL;
  }
  sreq *r = calloc(1, sizeof *r);
  int32_t *ctx = malloc((size_t)n_ctx * sizeof *ctx);
  if (!r || !ctx) goto oom;
  memcpy(ctx, in->prompt, (size_t)n_prompt * sizeof *ctx);
  if (n_gen) memcpy(ctx + n_prompt, in->generated, (size_t)n_gen * sizeof *ctx);
  r->id = in->id;
  r->n = params->n > 0 ? params->n : 1;
  r->n_prompt = n_prompt;
  r->n_generated = n_gen;
  r->max_tokens = max_tokens;
  r->sample_base = in->sample_index;
  r->reserved = reserve;
  r->p = *params;
  r->p.max_tokens = max_tokens;
  r->seqs = calloc((size_t)r->n, sizeof *r->seqs);
  if (!r->seqs) goto oom;
  if (params->n_logit_bias) {
    r->lb = malloc(params->n_logit_bias * sizeof *r->lb);
    if (!r->lb) goto oom;
    memcpy(r->lb, params->logit_bias, params->n_logit_bias * sizeof *r->lb);
    r->p.logit_bias = r->lb;
  }
  if (params->n_stop_token_ids) {
    r->stop_ids = malloc(params->n_stop_token_ids * sizeof *r->stop_ids);
    if (!r->stop_ids) goto oom;
    memcpy(r->stop_ids, params->stop_token_ids, params->n_stop_token_ids * sizeof(int32_t));
    r->p.stop_token_ids = r->stop_ids;
  }
  if (params->prompt_logprobs >= 0 && n_prompt > 1) {
    r->prompt_lp = calloc((size_t)n_prompt - 1, sizeof *r->prompt_lp);
    if (!r->prompt_lp) goto oom;
  }
  /* Prompt logprobs need every prompt position computed, and a reservation's blocks are
   * written by the transfer: such requests get a cache salt of their own, so they never take
   * prefix-cache hits. */
  r->cache_salt = (params->prompt_logprobs >= 0 || reserve) ? (1ull << 63) | ++s->salt_counter
                                                             : in->cache_salt;
  pd_kv_seq *kv = pd_kv_seq_create(s->pool, ctx, n_ctx, r->cache_salt, e);
  free(ctx);
  ctx = NULL;
  if (!kv) {
    req_free(r);
    return NULL;
  }
  sseq *q = seq_new(s, r, 0, kv, e);
  if (!q) {
    pd_kv_seq_free(kv);
    req_free(r);
    return NULL;
  }
  r->seqs[0] = q;
  r->n_alive = 1;
  if (s->n_reqs == s->cap_reqs) {
    int cap = s->cap_reqs ? 2 * s->cap_reqs : 64;
    sreq **v = realloc(s->reqs, (size_t)cap * sizeof *v);
    if (!v) goto oom;
    s->reqs = v;
    s->cap_reqs = cap;
  }
  return r;
oom:
  free(ctx);
  req_free(r);
  pd_err_set(e, PD_ENOMEM, "out of memory");
  return NULL;
}

pd_status pd_sched_add_req(pd_sched *s, const pd_sched_req *in, pd_err *e) {
  sreq *r = req_build(s, in, false, e);
  if (!r) return e && e->code ? e->code : PD_EINVAL;
  if (!list_insert(&s->waiting, s->waiting.n, r->seqs[0])) {
    req_free(r);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  s->reqs[s->n_reqs++] = r;
  return PD_OK;
}

pd_status pd_sched_add(pd_sched *s, uint64_t id, const int32_t *prompt, int n_prompt,
                       const pd_sampling_params *params, pd_err *e) {
  pd_sched_req r = {.id = id, .prompt = prompt, .n_prompt = n_prompt, .params = params};
  return pd_sched_add_req(s, &r, e);
}

pd_status pd_sched_reserve(pd_sched *s, const pd_sched_req *in, int32_t *block_ids, int cap,
                           int *n_blocks, pd_err *e) {
  int n_ctx = in->n_prompt + in->n_generated;
  if (n_ctx > s->max_model_len)
    return pd_err_set(e, PD_ERANGE, "%d context tokens exceed the context length %d", n_ctx,
                      s->max_model_len);
  sreq *r = req_build(s, in, true, e);
  if (!r) return e && e->code ? e->code : PD_EINVAL;
  sseq *q = r->seqs[0];
  int need = pd_kv_seq_blocks_needed(q->kv, n_ctx);
  if (need < 0 || pd_kv_pool_blocks_for_tokens(s->pool, n_ctx) > cap) {
    req_free(r);
    return pd_err_set(e, PD_EINVAL, "block id buffer too small");
  }
  int32_t *slots = malloc((size_t)n_ctx * sizeof *slots);
  if (!slots) {
    req_free(r);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  pd_status st = need > pd_kv_pool_num_available(s->pool)
                     ? pd_err_set(e, PD_EFULL, "not enough free KV blocks")
                     : pd_kv_seq_allocate(q->kv, n_ctx, slots, e);
  free(slots);
  if (st == PD_OK && !list_insert(&s->reserved, s->reserved.n, q))
    st = pd_err_set(e, PD_ENOMEM, "out of memory");
  if (st != PD_OK) {
    req_free(r);
    return st;
  }
  *n_blocks = pd_kv_seq_num_blocks(q->kv);
  memcpy(block_ids, pd_kv_seq_block_table(q->kv), (size_t)*n_blocks * sizeof *block_ids);
  s->reqs[s->n_reqs++] = r;
  return PD_OK;
}

/* The reserved sequence of request id, or NULL (error set). */
static sseq *reserved_seq(pd_sched *s, uint64_t id, pd_err *e) {
  int k = find_req(s, id);
  if (k < 0) {
    pd_err_set(e, PD_ENOTFOUND, "no reservation %llu", (unsigned long long)id);
    return NULL;
  }
  sreq *r = s->reqs[k];
  if (!r->reserved || !r->seqs[0]) {
    pd_err_set(e, PD_EINVAL, "request %llu is not reserved", (unsigned long long)id);
    return NULL;
  }
  return r->seqs[0];
}

pd_status pd_sched_reserve_draft(pd_sched *s, uint64_t id, int32_t *block_ids, int cap,
                                 int *n_blocks, pd_err *e) {
  if (s->spec.method != PD_SPEC_DRAFT || !s->spec.draft_pool)
    return pd_err_set(e, PD_EINVAL, "no draft model");
  sseq *q = reserved_seq(s, id, e);
  if (!q) return e && e->code ? e->code : PD_ENOTFOUND;
  if (q->dkv) return pd_err_set(e, PD_EINVAL, "draft blocks are reserved already");
  pd_kv_pool *dp = s->spec.draft_pool;
  const int n_ctx = q->req->n_prompt + q->req->n_generated;
  if (pd_kv_pool_blocks_for_tokens(dp, n_ctx) > cap)
    return pd_err_set(e, PD_EINVAL, "block id buffer too small");
  /* (the reservation's own cache salt: no prefix hits, the transfer writes every block) */
  pd_kv_seq *d = pd_kv_seq_create(dp, pd_kv_seq_tokens(q->kv), n_ctx, q->req->cache_salt, e);
  if (!d) return e && e->code ? e->code : PD_ENOMEM;
  int32_t *slots = malloc((size_t)(n_ctx > 0 ? n_ctx : 1) * sizeof *slots);
  pd_status st = !slots ? pd_err_set(e, PD_ENOMEM, "out of memory")
                 : pd_kv_seq_blocks_needed(d, n_ctx) > pd_kv_pool_num_available(dp)
                     ? pd_err_set(e, PD_EFULL, "not enough free draft KV blocks")
                     : pd_kv_seq_allocate(d, n_ctx, slots, e);
  free(slots);
  if (st != PD_OK) {
    pd_kv_seq_free(d);
    return st;
  }
  q->dkv = d;
  q->dkv_landed = false;
  *n_blocks = pd_kv_seq_num_blocks(d);
  memcpy(block_ids, pd_kv_seq_block_table(d), (size_t)*n_blocks * sizeof *block_ids);
  return PD_OK;
}

pd_status pd_sched_draft_landed(pd_sched *s, uint64_t id, pd_err *e) {
  sseq *q = reserved_seq(s, id, e);
  if (!q) return e && e->code ? e->code : PD_ENOTFOUND;
  if (!q->dkv) return pd_err_set(e, PD_EINVAL, "no draft blocks are reserved");
  q->dkv_landed = true;
  return PD_OK;
}

pd_status pd_sched_activate(pd_sched *s, uint64_t id, int32_t next_token, pd_err *e) {
  sseq *q = reserved_seq(s, id, e);
  if (!q) return e && e->code ? e->code : PD_ENOTFOUND;
  sreq *r = q->req;
  if (next_token < 0 || next_token >= s->V)
    return pd_err_set(e, PD_EINVAL, "token %d is outside the vocabulary", next_token);
  int n_ctx = r->n_prompt + r->n_generated;
  pd_status st = pd_kv_seq_commit(q->kv, n_ctx, e);
  if (st == PD_OK && q->dkv) {
    if (q->dkv_landed) {
      st = pd_kv_seq_commit(q->dkv, n_ctx, e);
    } else { /* no draft KV came: the draft computes the context when it first proposes */
      pd_kv_seq_free(q->dkv);
      q->dkv = NULL;
    }
  }
  pd_finish_reason fin = PD_FINISH_NONE;
  if (st == PD_OK) st = pd_sampler_accept(q->smp, next_token, &fin, e);
  if (st != PD_OK) return st;
  list_remove(&s->reserved, q);
  r->reserved = false;
  r->first_sent = true;
  if (fin != PD_FINISH_NONE || n_ctx + 1 >= s->max_model_len) { /* nothing left to decode */
    drop_req(s, r);
    return PD_OK;
  }
  st = pd_kv_seq_append_tokens(q->kv, &next_token, 1, e);
  int at = s->running.n;
  while (st == PD_OK && at > 0 && s->running.v[at - 1]->order > q->order) at--;
  if (st == PD_OK && !list_insert(&s->running, at, q)) st = pd_err_set(e, PD_ENOMEM, "out of memory");
  if (st != PD_OK) drop_req(s, r);
  return st;
}

pd_status pd_sched_abort(pd_sched *s, uint64_t id) {
  int k = find_req(s, id);
  if (k < 0 || s->reqs[k]->aborted) return PD_ENOTFOUND;
  if (s->in_step) {
    /* called from an event callback: the step still holds pointers to its sequences */
    s->reqs[k]->aborted = true;
    return PD_OK;
  }
  drop_req(s, s->reqs[k]);
  return PD_OK;
}

/* Reserved requests wait for their KV outside the scheduler: they are no work for a step. */
bool pd_sched_has_work(const pd_sched *s) { return s->running.n + s->waiting.n > 0; }

void pd_sched_get_stats(const pd_sched *s, pd_sched_stats *out) {
  *out = s->st;
  out->running = s->running.n;
  out->waiting = s->waiting.n;
}

/* ---- one step ---- */

/* Ends sequence q (finished or failed): events already sent; frees its blocks. */
static void seq_end(pd_sched *s, sseq *q) {
  sreq *r = q->req;
  if (!list_remove(&s->running, q)) list_remove(&s->waiting, q);
  r->seqs[q->index] = NULL;
  seq_free(q);
  if (--r->n_alive == 0) drop_req(s, r);
}

/* Takes q's unverified proposals back out of its tokens. */
static void drop_drafts(sseq *q) {
  if (!q->n_draft) return;
  pd_status st = pd_kv_seq_truncate(q->kv, pd_kv_seq_num_tokens(q->kv) - q->n_draft, NULL);
  PD_ASSERT(st == PD_OK);
  (void)st;
  q->n_draft = 0;
}

static void preempt(pd_sched *s, sseq *q) {
  list_remove(&s->running, q);
  drop_drafts(q);
  pd_kv_seq_release(q->kv);
  if (q->dkv) pd_kv_seq_release(q->dkv);
  /* back to the front, keeping admission order among the preempted */
  int at = 0;
  while (at < s->waiting.n && s->waiting.v[at]->order < q->order) at++;
  if (!list_insert(&s->waiting, at, q)) PD_ASSERT(!"waiting list insert failed");
  s->st.preemptions++;
}

/* Tokens q wants this step: the rest of its known tokens (prompt chunk) or 1 (decode), plus
 * its proposals when it speculates. */
static int want(const sseq *q) {
  return pd_kv_seq_num_tokens(q->kv) - pd_kv_seq_num_computed(q->kv);
}

/* q decodes (one known token to compute, besides proposals). */
static bool decoding(const sseq *q) { return want(q) - q->n_draft == 1; }

static pd_status schedule(pd_sched *s, int *n_sched, int *n_tok, pd_err *e) {
  int budget = s->max_batch_tokens, ns = 0, nt = 0;
  bool preempted = false;
  /* prompt tokens this step may take: capped while sequences decode (decode_prefill_tokens) */
  int pbudget = INT_MAX;
  if (s->decode_prefill_tokens > 0)
    for (int i = 0; i < s->running.n; i++)
      if (decoding(s->running.v[i])) {
        pbudget = s->decode_prefill_tokens;
        break;
      }
  for (int i = 0; i < s->running.n; i++) s->running.v[i]->n_new = 0;
  for (int i = 0; i < s->running.n && budget > 0 && ns < s->max_seqs;) {
    sseq *q = s->running.v[i];
    int n = want(q);
    const bool prompt = !decoding(q);
    if (prompt && pbudget <= 0) { /* its next chunk waits for a later step */
      i++;
      continue;
    }
    if (n > budget) n = budget;
    if (prompt && n > pbudget) n = pbudget;
    PD_ASSERT(n > 0);
    if (q->n_draft > n - 1) { /* the budget cuts its proposals */
      pd_status st = pd_kv_seq_truncate(q->kv, pd_kv_seq_num_tokens(q->kv) - (q->n_draft - (n - 1)), e);
      if (st != PD_OK) return st;
      q->n_draft = n - 1;
    }
    bool scheduled = false;
    for (;;) {
      pd_status st = pd_kv_seq_allocate(q->kv, n, s->slots + nt, e);
      if (st == PD_OK) {
        scheduled = true;
        break;
      }
      if (st != PD_EFULL) return st;
      sseq *victim = s->running.v[s->running.n - 1];
      preempt(s, victim);
      preempted = true;
      if (victim == q) break;
    }
    if (!scheduled) break; /* q was the newest: nothing after it is left */
    q->n_new = n;
    s->sched[ns++] = q;
    nt += n;
    budget -= n;
    if (prompt) pbudget -= n;
    i++;
  }
  while (!preempted && s->waiting.n > 0 && budget > 0 && pbudget > 0 && ns < s->max_seqs &&
         s->running.n < s->max_seqs) {
    sseq *q = s->waiting.v[0];
    int hit = pd_kv_seq_prefix_hit(q->kv);
    int n = pd_kv_seq_num_tokens(q->kv) - hit;
    if (n > budget) n = budget;
    if (n > pbudget) n = pbudget;
    int need = pd_kv_seq_blocks_needed(q->kv, n);
    if (need < 0 || need > pd_kv_pool_num_available(s->pool)) break;
    pd_status st = pd_kv_seq_allocate(q->kv, n, s->slots + nt, e);
    if (st == PD_EFULL) break;
    if (st != PD_OK) return st;
    list_remove_at(&s->waiting, 0);
    int at = s->running.n;
    while (at > 0 && s->running.v[at - 1]->order > q->order) at--;
    if (!list_insert(&s->running, at, q)) return pd_err_set(e, PD_ENOMEM, "out of memory");
    if (!q->req->counted) {
      q->req->counted = true;
      q->req->num_cached = pd_kv_seq_num_computed(q->kv);
      s->st.prompt_tokens += (uint64_t)q->req->n_prompt;
      s->st.cached_prompt_tokens += (uint64_t)q->req->num_cached;
    }
    q->n_new = n;
    s->sched[ns++] = q;
    nt += n;
    budget -= n;
    if (pbudget != INT_MAX) pbudget -= n;
  }
  /* proposals of sequences left out of this step wait for no one */
  for (int i = 0; i < s->running.n; i++)
    if (s->running.v[i]->n_new == 0) drop_drafts(s->running.v[i]);
  *n_sched = ns;
  *n_tok = nt;
  return PD_OK;
}

/* Forks the remaining n - 1 samples of q's request off q (end of prompt). */
static pd_status fork_samples(pd_sched *s, sseq *q, sseq **forks, pd_err *e) {
  sreq *r = q->req;
  r->forked = true;
  for (int i = 1; i < r->n; i++) {
    pd_kv_seq *kv = pd_kv_seq_fork(q->kv, e);
    if (!kv) return e ? e->code : PD_ENOMEM;
    sseq *c = seq_new(s, r, i, kv, e);
    if (!c) {
      pd_kv_seq_free(kv);
      return e ? e->code : PD_ENOMEM;
    }
    r->seqs[i] = c;
    r->n_alive++;
    if (!list_insert(&s->running, s->running.n, c)) return pd_err_set(e, PD_ENOMEM, "out of memory");
    forks[i - 1] = c;
    s->st.forks++;
  }
  return PD_OK;
}

/* Reports q's next token tok (accepted by its sampler already, and in its tokens unless it
 * finishes); ends q when fin says so. */
static void report(pd_sched *s, sseq *q, int32_t tok, const pd_logprobs *lp,
                   pd_finish_reason fin) {
  sreq *r = q->req;
  bool want_lp = r->p.logprobs >= 0;
  pd_sched_event ev = {.id = r->id, .index = q->index, .token = tok,
                       .logprobs = want_lp ? lp : NULL, .finish = fin,
                       .num_cached_tokens = r->num_cached,
                       .block_table = pd_kv_seq_block_table(q->kv),
                       .n_blocks = pd_kv_seq_num_blocks(q->kv),
                       .n_kv_tokens = pd_kv_seq_num_computed(q->kv)};
  if (q->dkv) {
    ev.draft_block_table = pd_kv_seq_block_table(q->dkv);
    ev.n_draft_blocks = pd_kv_seq_num_blocks(q->dkv);
    ev.n_draft_kv_tokens = pd_kv_seq_num_computed(q->dkv);
  }
  if (!r->first_sent && q->index == 0) {
    r->first_sent = true;
    if (r->prompt_lp) {
      ev.prompt_logprobs = r->prompt_lp;
      ev.n_prompt_logprobs = r->n_prompt - 1;
    }
  }
  s->st.generated_tokens++;
  if (s->on_event) s->on_event(s->user, &ev);
  if (fin != PD_FINISH_NONE) seq_end(s, q);
}

/* Records and reports q's next token (sampled already, with its logprobs when asked). */
static pd_status emit_token(pd_sched *s, sseq *q, int32_t tok, const pd_logprobs *lp,
                            pd_err *e) {
  pd_finish_reason fin = PD_FINISH_NONE;
  pd_status st = pd_sampler_accept(q->smp, tok, &fin, e);
  if (st != PD_OK) return st;
  if (fin == PD_FINISH_NONE && pd_kv_seq_num_tokens(q->kv) + 1 >= s->max_model_len)
    fin = PD_FINISH_LENGTH;
  if (fin == PD_FINISH_NONE) {
    st = pd_kv_seq_append_tokens(q->kv, &tok, 1, e);
    if (st != PD_OK) return st;
  }
  report(s, q, tok, lp, fin);
  return PD_OK;
}

static void dev_logprobs(const pd_dev_sample_out *o, pd_logprobs *lp) {
  memset(lp, 0, sizeof *lp);
  lp->token = o->token;
  lp->logprob = o->logprob;
  lp->rank = o->rank;
  lp->n_top = o->n_top;
  for (int i = 0; i < o->n_top && i < PD_SAMPLE_MAX_LOGPROBS; i++) {
    lp->top[i].id = o->top_id[i];
    lp->top[i].logprob = o->top_logprob[i];
  }
}

static pd_status spec_finish(pd_sched *s, sseq *q, const int32_t *out, int n_out,
                             const pd_logprobs *lp, pd_finish_reason fin, pd_err *e);

/* Verifies q's proposals against its target rows [1 + n_draft][V] and reports the tokens
 * that come out (1 .. n_draft + 1); only their KV is committed, the rest rolled back. */
static pd_status emit_spec(pd_sched *s, sseq *q, float *rows, pd_err *e) {
  sreq *r = q->req;
  const int k = q->n_draft;
  int32_t out[PD_SPEC_MAX_K + 1];
  int32_t n_out = 0;
  pd_logprobs lp[PD_SPEC_MAX_K + 1];
  const bool want_lp = r->p.logprobs >= 0;
  pd_finish_reason fin = PD_FINISH_NONE;
  const float *dq = q->dq_off >= 0 ? s->dq + q->dq_off : NULL;
  pd_status st = pd_spec_verify(q->smp, s->ws, rows, q->draft, dq, k, out, &n_out,
                                want_lp ? lp : NULL, &fin, e);
  if (st != PD_OK) return st;
  return spec_finish(s, q, out, n_out, want_lp ? lp : NULL, fin, e);
}

/* Greedy verification from the device's argmax of each of q's rows (rows dev_row ..
 * dev_row + n_draft, each processed with the penalties of the proposals before it): the
 * proposals are kept while they equal it, then its token follows, as pd_spec_verify does. */
static pd_status emit_spec_dev(pd_sched *s, sseq *q, const pd_dev_sample_out *o, pd_err *e) {
  const int k = q->n_draft;
  int32_t out[PD_SPEC_MAX_K + 1];
  int n_out = 0;
  pd_logprobs lp[PD_SPEC_MAX_K + 1];
  const bool want_lp = q->req->p.logprobs >= 0;
  pd_finish_reason fin = PD_FINISH_NONE;
  for (int j = 0; j <= k; j++) {
    int32_t tok = o[j].token;
    if (tok < 0)
      return pd_err_set(e, PD_EINVAL, "sampler: no token has a finite logit (or one is +inf)");
    pd_status st = pd_sampler_accept(q->smp, tok, &fin, e);
    if (st != PD_OK) return st;
    if (want_lp) dev_logprobs(&o[j], &lp[n_out]);
    out[n_out++] = tok;
    if (fin != PD_FINISH_NONE || (j < k && tok != q->draft[j])) break;
  }
  return spec_finish(s, q, out, n_out, want_lp ? lp : NULL, fin, e);
}

/* The tail of a verification: out[0 .. n_out) came out (accepted by the sampler already). */
static pd_status spec_finish(pd_sched *s, sseq *q, const int32_t *out, int n_out,
                             const pd_logprobs *lp, pd_finish_reason fin, pd_err *e) {
  sreq *r = q->req;
  const int k = q->n_draft;
  pd_status st;
  PD_ASSERT(n_out >= 1 && n_out <= k + 1);
  int acc = 0;
  while (acc < k && acc < n_out && out[acc] == q->draft[acc]) acc++;
  /* context whose KV this step computed and that stays: the last token and the accepted
   * proposals before the final emitted token */
  int keep = 1 + (acc < n_out - 1 ? acc : n_out - 1);
  st = pd_kv_seq_commit(q->kv, keep, e);
  if (st == PD_OK) st = pd_kv_seq_truncate(q->kv, q->c0 + keep, e);
  if (st != PD_OK) return st;
  q->n_draft = 0;
  q->spec_dev = false;
  s->st.spec_verified++;
  s->st.spec_proposed += (uint64_t)k;
  s->st.spec_accepted += (uint64_t)acc;
  s->st.spec_emitted_hist[n_out]++;
  q->acc_a = 0.8f * q->acc_a + (float)acc;
  q->acc_r = 0.8f * q->acc_r + (acc < k ? 1.0f : 0.0f);
  s->acc_a = 0.98 * s->acc_a + acc;
  s->acc_r = 0.98 * s->acc_r + (acc < k ? 1.0 : 0.0);
  for (int j = 0; j < n_out; j++) {
    if (r->aborted) break; /* a stop string in the run: the rest is not wanted */
    bool last = j == n_out - 1;
    pd_finish_reason f = last ? fin : PD_FINISH_NONE;
    /* the tokens before this one: c0 + 1 + j */
    if (f == PD_FINISH_NONE && q->c0 + 1 + j + 1 >= s->max_model_len) f = PD_FINISH_LENGTH;
    if (last && f == PD_FINISH_NONE) {
      st = pd_kv_seq_append_tokens(q->kv, &out[j], 1, e);
      if (st != PD_OK) return st;
    }
    report(s, q, out[j], lp ? &lp[j] : NULL, f); /* may free q */
    if (f != PD_FINISH_NONE) break;
  }
  return PD_OK;
}

/* Samples q's next token on the host from logits row `row_logits`, then emit_token. */
static pd_status emit(pd_sched *s, sseq *q, const float *row_logits, pd_err *e) {
  float *row = (float *)row_logits; /* pd_sample_token restores it bit for bit */
  int32_t tok;
  pd_logprobs lp;
  bool want_lp = q->req->p.logprobs >= 0;
  pd_status st = pd_sample_token(q->smp, s->ws, row, &tok, want_lp ? &lp : NULL, e);
  if (st != PD_OK) return st;
  return emit_token(s, q, tok, want_lp ? &lp : NULL, e);
}

/* Emits q's token from its device-sampling result. */
static pd_status emit_dev(pd_sched *s, sseq *q, const pd_dev_sample_out *o, pd_err *e) {
  if (o->token < 0)
    return pd_err_set(e, PD_EINVAL, "sampler: no token has a finite logit (or one is +inf)");
  pd_logprobs lp;
  bool want_lp = q->req->p.logprobs >= 0;
  if (want_lp) dev_logprobs(o, &lp);
  return emit_token(s, q, o->token, want_lp ? &lp : NULL, e);
}

/* Appends q's device-sampling spec and edits for this step. */
static pd_status add_dev_spec_to(pd_sched *s, sseq *q, pd_dev_sample_spec *specs, int idx,
                                 int32_t *n_edits, pd_err *e) {
  for (;;) {
    int32_t room = s->edits_cap - *n_edits;
    int32_t need = pd_sampler_dev_spec(q->smp, &specs[idx], s->edits + *n_edits, room);
    if (need <= room) {
      specs[idx].edit_begin = *n_edits;
      specs[idx].edit_count = need;
      *n_edits += need;
      return PD_OK;
    }
    int32_t cap = s->edits_cap ? s->edits_cap : 1024;
    while (cap - *n_edits < need) cap *= 2;
    pd_dev_sample_edit *p = realloc(s->edits, (size_t)cap * sizeof *p);
    if (!p) return pd_err_set(e, PD_ENOMEM, "out of memory");
    s->edits = p;
    s->edits_cap = cap;
  }
}

static pd_status add_dev_spec(pd_sched *s, sseq *q, int idx, int32_t *n_edits, pd_err *e) {
  return add_dev_spec_to(s, q, s->specs, idx, n_edits, e);
}

/* Runs the pool's pending copy-on-write block copies on the engine. */
static pd_status apply_copies(pd_kv_pool *pool, pd_engine *eng, pd_err *e) {
  const pd_kv_copy *cp;
  int ncp = pd_kv_pool_copies(pool, &cp);
  if (ncp > 0) {
    int32_t *src = malloc((size_t)ncp * 2 * sizeof *src);
    if (!src) return pd_err_set(e, PD_ENOMEM, "out of memory");
    for (int i = 0; i < ncp; i++) {
      src[i] = cp[i].src;
      src[ncp + i] = cp[i].dst;
    }
    pd_status st = pd_engine_copy_blocks(eng, src, src + ncp, ncp, e);
    free(src);
    if (st != PD_OK) return st;
  }
  pd_kv_pool_copies_done(pool);
  return PD_OK;
}

/* ---- speculative decoding: proposals ---- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The sequence's acceptance estimate: its decayed accepted / (accepted + rejected) counts,
 * with two pseudo-counts at the acceptance of all sequences (itself with a uniform prior). */
static double acceptance(const pd_sched *s, const sseq *q) {
  double g = (s->acc_a + 1.0) / (s->acc_a + s->acc_r + 2.0);
  return (q->acc_a + 2.0 * g) / (q->acc_a + q->acc_r + 2.0);
}

/* Proposals a sequence makes at most under the step's k: while the chance that the j-th one
 * is reached and accepted (acceptance^j) stays at or above 0.2. */
static int seq_cap(const pd_sched *s, const sseq *q, int k) {
  double a = acceptance(s, q), p = 1;
  int j = 0;
  while (j < k) {
    p *= a;
    if (p < 0.2 && j > 0) break;
    j++;
  }
  return j;
}

/* Sequence j of the draft's batch: n tokens of q's draft context from its computed count, at
 * row nt; d_idx[j] = idx (the candidate; negative for a chunk without a logits row). Returns
 * its draft block count. */
static int d_put(pd_sched *s, const sseq *q, int j, int nt, int n, int idx) {
  const int c = pd_kv_seq_num_computed(q->dkv);
  memcpy(s->d_tokens + nt, pd_kv_seq_tokens(q->dkv) + c, (size_t)n * sizeof(int32_t));
  for (int k = 0; k < n; k++) s->d_pos[nt + k] = c + k;
  s->d_qstart[j] = nt;
  s->d_ctx[j] = c + n;
  s->d_idx[j] = idx;
  return pd_kv_seq_num_blocks(q->dkv);
}

/* The draft batch's ns block tables, mb wide (candidate cand[d_idx[j]], or -1 - d_idx[j]). */
static void d_tables(pd_sched *s, int ns, int mb) {
  for (int j = 0; j < ns; j++) {
    const int i = s->d_idx[j] >= 0 ? s->d_idx[j] : -1 - s->d_idx[j];
    const pd_kv_seq *kv = s->cand[i]->dkv;
    const int nb = pd_kv_seq_num_blocks(kv);
    int32_t *bt = s->d_bt + (size_t)j * mb;
    memcpy(bt, pd_kv_seq_block_table(kv), (size_t)nb * sizeof *bt);
    for (int b = nb; b < mb; b++) bt[b] = 0;
  }
}

/* The draft model proposes: for each candidate i up to plan[i] tokens, the candidates
 * together, one draft forward per token (the first also computes the draft KV of context it
 * has not seen). Proposals are drawn as the target's sampler would (penalties, bias,
 * temperature; greedy = argmax), their distributions kept for verification when sampling. */
static pd_status draft_propose(pd_sched *s, int nc, pd_err *e) {
  pd_engine *de = s->spec.draft;
  pd_kv_pool *dp = s->spec.draft_pool;
  const int V = s->V;
  for (int i = 0; i < nc; i++) {
    sseq *q = s->cand[i];
    const int32_t *T = pd_kv_seq_tokens(q->kv);
    int N = pd_kv_seq_num_tokens(q->kv);
    q->n_draft = 0;
    q->dq_off = -1;
    if (!q->dkv) {
      q->dkv = pd_kv_seq_create(dp, T, N, q->req->cache_salt, e);
      if (!q->dkv) return e ? e->code : PD_ENOMEM;
    } else { /* keep the common prefix with the target's tokens, then the rest */
      const int32_t *D = pd_kv_seq_tokens(q->dkv);
      int nd = pd_kv_seq_num_tokens(q->dkv), l = 0, m = nd < N ? nd : N;
      while (l < m && D[l] == T[l]) l++;
      pd_status st = l < nd ? pd_kv_seq_truncate(q->dkv, l, e) : PD_OK;
      if (st == PD_OK && l < N) st = pd_kv_seq_append_tokens(q->dkv, T + l, N - l, e);
      if (st != PD_OK) return st;
    }
    if (pd_sampler_params(q->smp)->temperature > 0) { /* sampling: keep q for verification */
      size_t need = s->dq_used + (size_t)s->plan[i] * (size_t)V;
      if (need > s->dq_cap) {
        size_t cap = s->dq_cap ? s->dq_cap : (size_t)V * 16;
        while (cap < need) cap *= 2;
        float *p = realloc(s->dq, cap * sizeof *p);
        if (!p) return pd_err_set(e, PD_ENOMEM, "out of memory");
        s->dq = p;
        s->dq_cap = cap;
      }
      q->dq_off = (long)s->dq_used;
      s->dq_used = need;
    }
  }
  pd_status st = PD_OK;
  for (;;) {
    int ns = 0, nt = 0, n_rows = 0, mb = 1, budget = s->d_max_batch_tokens;
    for (int i = 0; i < nc && budget > 0; i++) {
      sseq *q = s->cand[i];
      if (q->n_draft >= s->plan[i]) continue;
      int need = pd_kv_seq_num_tokens(q->dkv) - pd_kv_seq_num_computed(q->dkv) -
                 pd_kv_seq_prefix_hit(q->dkv);
      int n = need < budget ? need : budget;
      st = pd_kv_seq_allocate(q->dkv, n, s->d_slots + nt, e);
      if (st == PD_EFULL) { /* no draft blocks for it now: it does not speculate */
        pd_kv_seq_release(q->dkv);
        s->plan[i] = q->n_draft;
        st = PD_OK;
        continue;
      }
      if (st != PD_OK) goto out;
      /* (a chunk of catch-up that does not end it has no row) */
      int nb = d_put(s, q, ns, nt, n, n == need ? i : -1 - i);
      if (nb > mb) mb = nb;
      nt += n;
      budget -= n;
      ns++;
    }
    if (ns == 0) break;
    s->d_qstart[ns] = nt;
    d_tables(s, ns, mb);
    /* (the draft pool shares blocks only through its prefix cache) */
    if ((st = apply_copies(dp, de, e)) != PD_OK) goto out;
    /* a row per sequence whose catch-up is complete: greedy ones drawn on the device where the
     * draft engine samples there (its argmax with the sequence's edits; nothing comes back but
     * the token), the others' logits to the host (their distribution is needed) */
    int n_dev = 0;
    int32_t n_edits = 0;
    for (int j = 0; j < ns; j++) {
      s->d_hrow[j] = s->d_drow[j] = -1;
      if (s->d_idx[j] < 0) continue;
      if (s->d_dev && pd_sampling_params_is_greedy(&s->cand[s->d_idx[j]]->req->p))
        s->d_drow[j] = n_dev++;
      else
        s->d_hrow[j] = n_rows++;
    }
    for (int j = 0; j < ns; j++) {
      if (s->d_hrow[j] >= 0) s->d_rows[s->d_hrow[j]] = s->d_qstart[j + 1] - 1;
      if (s->d_drow[j] < 0) continue;
      s->d_rows[n_rows + s->d_drow[j]] = s->d_qstart[j + 1] - 1;
      st = add_dev_spec_to(s, s->cand[s->d_idx[j]], s->d_specs, s->d_drow[j], &n_edits, e);
      if (st != PD_OK) goto out;
    }
    pd_batch b = {.n_tokens = nt, .tokens = s->d_tokens, .positions = s->d_pos,
                  .slots = s->d_slots, .n_seqs = ns, .q_start = s->d_qstart, .ctx_len = s->d_ctx,
                  .block_tables = s->d_bt, .max_blocks = mb, .n_logits = n_rows + n_dev,
                  .logit_rows = s->d_rows, .n_sample = n_dev, .sample = s->d_specs,
                  .edits = s->edits, .n_edits = n_edits, .sample_out = s->d_outs};
    st = pd_engine_forward(de, &b, s->d_logits, e);
    if (st != PD_OK) goto out;
    s->st.spec_draft_steps++;
    for (int j = 0; j < ns; j++) {
      bool has_row = s->d_idx[j] >= 0;
      int i = has_row ? s->d_idx[j] : -1 - s->d_idx[j];
      sseq *q = s->cand[i];
      st = pd_kv_seq_commit(q->dkv, s->d_qstart[j + 1] - s->d_qstart[j], e);
      if (st != PD_OK) goto out;
      if (!has_row) continue;
      int32_t tok;
      pd_finish_reason fin = PD_FINISH_NONE;
      if (s->d_drow[j] >= 0) {
        tok = s->d_outs[s->d_drow[j]].token;
        if (tok < 0) st = pd_err_set(e, PD_EINVAL, "draft: no token has a finite logit");
      } else {
        float *lg = s->d_logits + (size_t)s->d_hrow[j] * V;
        float *qd = q->dq_off >= 0 ? s->dq + q->dq_off + (size_t)q->n_draft * V : NULL;
        st = pd_spec_draft_token(q->smp, s->ws, lg, qd, &tok, e);
      }
      /* accepted tentatively, so the next proposal sees its penalties; rolled back below */
      if (st == PD_OK) st = pd_sampler_accept(q->smp, tok, &fin, e);
      if (st == PD_OK) {
        q->draft[q->n_draft++] = tok;
        st = pd_kv_seq_append_tokens(q->dkv, &tok, 1, e);
      }
      if (st != PD_OK) goto out;
      if (fin != PD_FINISH_NONE) s->plan[i] = q->n_draft; /* a stop token ends the run */
    }
  }
out:
  for (int i = 0; i < nc; i++) {
    sseq *q = s->cand[i];
    pd_status r2 = pd_sampler_rollback(q->smp, q->n_draft, NULL);
    PD_ASSERT(r2 == PD_OK);
    (void)r2;
    if (st != PD_OK) q->n_draft = 0;
  }
  return st;
}

/* draft_prefill: the draft model computes the context tokens the step computes in the model,
 * up to the same length (from its own prefix-cache hit), the sequences together in forwards of
 * up to its token budget and without logits. A sequence whose draft finds no blocks gets no
 * draft KV (its event then has none: nothing of the draft is shipped). */
static pd_status draft_prefill(pd_sched *s, pd_err *e) {
  pd_engine *de = s->spec.draft;
  pd_kv_pool *dp = s->spec.draft_pool;
  int nc = 0;
  for (int j = 0; j < s->n_sched; j++) {
    sseq *q = s->sched[j];
    const int n_ctx = q->req->n_prompt + q->req->n_generated, upto = q->c0 + q->n_new;
    if (q->n_draft > 0 || upto > n_ctx) continue; /* it decodes: nothing of its context */
    if (!q->dkv) {
      q->dkv = pd_kv_seq_create(dp, pd_kv_seq_tokens(q->kv), n_ctx, q->req->cache_salt, e);
      if (!q->dkv) return e && e->code ? e->code : PD_ENOMEM;
    }
    s->cand[nc] = q;
    s->plan[nc++] = upto;
  }
  pd_status st = PD_OK;
  while (nc > 0) {
    int ns = 0, nt = 0, mb = 1, budget = s->d_max_batch_tokens;
    for (int i = 0; i < nc && budget > 0; i++) {
      sseq *q = s->cand[i];
      if (!q->dkv) continue;
      int need = s->plan[i] - pd_kv_seq_num_computed(q->dkv) - pd_kv_seq_prefix_hit(q->dkv);
      if (need <= 0) continue;
      int n = need < budget ? need : budget;
      st = pd_kv_seq_allocate(q->dkv, n, s->d_slots + nt, e);
      if (st == PD_EFULL) { /* no draft blocks for it now: it ships no draft KV */
        pd_kv_seq_free(q->dkv);
        q->dkv = NULL;
        st = PD_OK;
        continue;
      }
      if (st != PD_OK) return st;
      int nb = d_put(s, q, ns, nt, n, i);
      if (nb > mb) mb = nb;
      nt += n;
      budget -= n;
      ns++;
    }
    if (ns == 0) break;
    s->d_qstart[ns] = nt;
    d_tables(s, ns, mb);
    if ((st = apply_copies(dp, de, e)) != PD_OK) return st;
    pd_batch b = {.n_tokens = nt, .tokens = s->d_tokens, .positions = s->d_pos,
                  .slots = s->d_slots, .n_seqs = ns, .q_start = s->d_qstart, .ctx_len = s->d_ctx,
                  .block_tables = s->d_bt, .max_blocks = mb};
    if ((st = pd_engine_forward(de, &b, NULL, e)) != PD_OK) return st;
    s->st.spec_draft_steps++;
    for (int j = 0; j < ns; j++) {
      st = pd_kv_seq_commit(s->cand[s->d_idx[j]]->dkv, s->d_qstart[j + 1] - s->d_qstart[j], e);
      if (st != PD_OK) return st;
    }
  }
  return PD_OK;
}

/* A probe of speculation where plain decoding has been best: only sequences whose draft KV is
 * nearly current take part (at most 2 windows of tokens behind), and at least an eighth of
 * them (the least behind): catching every sequence's draft up on all it generated while
 * plain is what makes a probe costly, and it pays only if speculation wins. */
static int cmp_lag(const void *a, const void *b) {
  const int *x = a, *y = b;
  return (x[0] > y[0]) - (x[0] < y[0]);
}

static void probe_subset(pd_sched *s, int nc) {
  int (*lag)[2] = malloc((size_t)nc * sizeof *lag);
  if (!lag) return;
  for (int i = 0; i < nc; i++) {
    const sseq *q = s->cand[i];
    lag[i][0] = pd_kv_seq_num_tokens(q->kv) - (q->dkv ? pd_kv_seq_num_computed(q->dkv) : 0);
    lag[i][1] = i;
  }
  qsort(lag, (size_t)nc, sizeof *lag, cmp_lag);
  int quota = nc / 8 > 1 ? nc / 8 : 1;
  for (int j = 0; j < nc; j++)
    if (j >= quota && lag[j][0] > 2 * PD_SPEC_WINDOW) s->plan[lag[j][1]] = 0;
  free(lag);
}

/* Proposals for this step's decoding sequences, appended to their tokens (n_draft). */
static pd_status propose(pd_sched *s, pd_err *e) {
  s->dq_used = 0;
  s->propose_s = 0;
  s->policy_step = false;
  int nc = 0, n_decode = 0;
  for (int i = 0; i < s->running.n; i++) {
    sseq *q = s->running.v[i];
    q->n_draft = 0;
    q->dq_off = -1;
    if (want(q) == 1 && !q->req->aborted) n_decode++;
  }
  s->step_decoding = n_decode;
  s->policy_step = !s->spec.fixed && n_decode > 0;
  /* k first: where the policy keeps speculation off nothing is looked up (an n-gram lookup
   * over a long context is microseconds a sequence, a real share of a small model's GPU step) */
  int k = s->spec.fixed ? s->spec.num_tokens
                        : n_decode > 0 ? pd_spec_policy_choose(&s->policy, n_decode) : 0;
  if (k <= 0) return PD_OK;
  for (int i = 0; i < s->running.n; i++) {
    sseq *q = s->running.v[i];
    if (want(q) != 1 || q->req->aborted) continue;
    int n = pd_kv_seq_num_tokens(q->kv);
    int cap = s->spec.num_tokens;
    int room = s->max_model_len - 1 - n; /* positions stay inside the context */
    int left = q->req->max_tokens - pd_sampler_n_generated(q->smp) - 1;
    if (room < cap) cap = room;
    if (left < cap) cap = left;
    if (cap <= 0) continue;
    if (s->spec.method == PD_SPEC_NGRAM) {
      cap = pd_spec_ngram_propose(pd_kv_seq_tokens(q->kv), n, s->spec.ngram_min,
                                  s->spec.ngram_max, cap, q->draft);
      if (cap <= 0) continue;
    }
    s->cand[nc] = q;
    s->plan[nc++] = cap;
  }
  if (nc == 0) return PD_OK;
  for (int i = 0; i < nc; i++) {
    int cap = s->spec.fixed ? k : seq_cap(s, s->cand[i], k);
    if (s->plan[i] > cap) s->plan[i] = cap;
  }
  if (s->spec.method == PD_SPEC_DRAFT && !s->spec.fixed && pd_spec_policy_probing(&s->policy))
    probe_subset(s, nc);
  double t0 = now_s();
  if (s->spec.method == PD_SPEC_DRAFT) {
    pd_status st = draft_propose(s, nc, e);
    if (st != PD_OK) return st;
  } else {
    for (int i = 0; i < nc; i++) s->cand[i]->n_draft = s->plan[i];
  }
  s->propose_s = now_s() - t0;
  s->st.spec_draft_seconds += s->propose_s;
  for (int i = 0; i < nc; i++) {
    sseq *q = s->cand[i];
    if (q->n_draft <= 0) continue;
    pd_status st = pd_kv_seq_append_tokens(q->kv, q->draft, q->n_draft, e);
    if (st != PD_OK) {
      q->n_draft = 0;
      return st;
    }
  }
  return PD_OK;
}

static pd_status step_begin(pd_sched *s, bool *started, pd_err *e);
static pd_status step_end(pd_sched *s, pd_err *e);

/* Drops the requests aborted while a step held pointers to their sequences. */
static void drop_aborted(pd_sched *s) {
  for (int i = 0; i < s->n_reqs;) {
    if (s->reqs[i]->aborted) {
      drop_req(s, s->reqs[i]);
    } else {
      i++;
    }
  }
}

pd_status pd_sched_step_begin(pd_sched *s, bool *started, pd_err *e) {
  *started = false;
  PD_ASSERT(!s->in_flight && "pd_sched_step_begin: the previous step has not ended");
  if (!pd_sched_has_work(s)) {
    s->step_t0 = 0; /* an idle gap is no step's time */
    return PD_OK;
  }
  s->in_step = true;
  pd_status st = step_begin(s, started, e);
  if (st == PD_OK && *started) {
    s->in_flight = true;
    return PD_OK;
  }
  *started = false;
  s->in_step = false;
  s->step_t0 = 0;
  s->policy_step = false;
  drop_aborted(s);
  return st;
}

pd_status pd_sched_step_end(pd_sched *s, pd_err *e) {
  PD_ASSERT(s->in_flight && "pd_sched_step_end: no step was begun");
  s->in_flight = false;
  pd_status st = step_end(s, e);
  s->in_step = false;
  drop_aborted(s);
  return st;
}

bool pd_sched_step_in_flight(const pd_sched *s) { return s->in_flight; }

pd_status pd_sched_step(pd_sched *s, pd_err *e) {
  bool started;
  pd_status st = pd_sched_step_begin(s, &started, e);
  return st != PD_OK || !started ? st : pd_sched_step_end(s, e);
}

static pd_status step_begin(pd_sched *s, bool *started, pd_err *e) {
  int ns = 0, nt = 0;
  pd_status st = PD_OK;
  if (s->spec.method != PD_SPEC_NONE) {
    /* the policy learns from whole cycles: this step's start is the last one's end, so the
     * host's work (sampling, verification, the caller's loop) counts as well */
    double t = now_s();
    if (s->policy_step && s->step_t0 > 0)
      pd_spec_policy_observe(&s->policy, s->step_tokens, t - s->step_t0, s->step_measured);
    s->policy_step = false;
    s->step_t0 = t;
    s->step_tokens = 0;
  }
  if (s->spec.method != PD_SPEC_NONE && (st = propose(s, e)) != PD_OK) {
    for (int i = 0; i < s->running.n; i++) drop_drafts(s->running.v[i]);
    return st;
  }
  st = schedule(s, &ns, &nt, e);
  if (st != PD_OK) return st;
  if (ns == 0) {
    /* Blocks are held only by running sequences; with none scheduled and none running,
     * the head of the queue cannot be admitted at all, which admission control rules out. */
    return s->running.n ? PD_OK : pd_err_set(e, PD_EFULL, "no request fits in the KV cache");
  }
  /* copy-on-write copies first */
  if ((st = apply_copies(s->pool, s->eng, e)) != PD_OK) return st;

  /* the ragged batch; block tables as wide as the longest one of the step */
  int off = 0, n_rows = 0, mb = 1;
  for (int j = 0; j < ns; j++) {
    int nb = pd_kv_seq_num_blocks(s->sched[j]->kv);
    if (nb > mb) mb = nb;
  }
  s->qstart[0] = 0;
  for (int j = 0; j < ns; j++) {
    sseq *q = s->sched[j];
    sreq *r = q->req;
    int c = pd_kv_seq_num_computed(q->kv), n = q->n_new;
    const int32_t *toks = pd_kv_seq_tokens(q->kv);
    memcpy(s->tokens + off, toks + c, (size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) s->pos[off + i] = c + i;
    s->qstart[j + 1] = off + n;
    s->ctx[j] = c + n;
    int nb = pd_kv_seq_num_blocks(q->kv);
    int32_t *bt = s->bt + (size_t)j * mb;
    memcpy(bt, pd_kv_seq_block_table(q->kv), (size_t)nb * sizeof *bt);
    for (int i = nb; i < mb; i++) bt[i] = 0;
    /* prompt logprobs: position p's logits score prompt token p + 1 */
    q->lp_row0 = -1;
    q->lp_count = 0;
    if (r->prompt_lp && q->index == 0) {
      int p0 = c > r->prompt_lp_done ? c : r->prompt_lp_done;
      int p1 = c + n < r->n_prompt - 1 ? c + n : r->n_prompt - 1;
      if (p1 > p0) {
        q->lp_row0 = n_rows;
        q->lp_pos0 = p0;
        q->lp_count = p1 - p0;
        for (int p = p0; p < p1; p++) s->rows[n_rows++] = off + (p - c);
      }
    }
    q->sample_row = -1;
    q->dev_row = -1;
    q->c0 = c;
    q->spec_dev = false;
    if (q->n_draft > 0 && s->dev_sample && pd_sampling_params_is_greedy(&r->p)) {
      q->spec_dev = true; /* greedy verification: every row's argmax on the device */
      q->dev_row = 0;
    } else if (q->n_draft > 0) { /* verification: every row to the host */
      q->sample_row = n_rows;
      for (int i = 0; i < n; i++) s->rows[n_rows++] = off + i;
    } else if (c + n == pd_kv_seq_num_tokens(q->kv)) {
      /* On the device unless the row also feeds the forks of n > 1 (sampled on the host). */
      if (s->dev_sample && !(r->n > 1 && !r->forked)) {
        q->dev_row = 0; /* numbered below, after the host rows */
      } else {
        q->sample_row = n_rows;
        s->rows[n_rows++] = off + n - 1;
      }
    }
    off += n;
  }
  /* device-sampled rows come last (pd_batch) */
  int n_dev = 0;
  int32_t n_edits = 0;
  for (int j = 0, o = 0; j < ns; j++) {
    sseq *q = s->sched[j];
    o += q->n_new;
    if (q->dev_row < 0) continue;
    q->dev_row = n_dev;
    if (q->spec_dev) { /* row i sees the penalties of the proposals before it */
      const int n = q->n_new;
      for (int i = 0; i < n && st == PD_OK; i++) {
        if (i > 0) st = pd_sampler_accept(q->smp, q->draft[i - 1], NULL, e);
        if (st != PD_OK) break;
        s->rows[n_rows + n_dev] = o - n + i;
        st = add_dev_spec(s, q, n_dev, &n_edits, e);
        n_dev++;
      }
      pd_status r2 = pd_sampler_rollback(q->smp, n - 1, NULL);
      PD_ASSERT(r2 == PD_OK);
      (void)r2;
      if (st != PD_OK) return st;
      continue;
    }
    s->rows[n_rows + n_dev] = o - 1;
    st = add_dev_spec(s, q, n_dev, &n_edits, e);
    if (st != PD_OK) return st;
    n_dev++;
  }
  s->batch = (pd_batch){.n_tokens = nt, .tokens = s->tokens, .positions = s->pos,
                        .slots = s->slots, .n_seqs = ns, .q_start = s->qstart,
                        .ctx_len = s->ctx, .block_tables = s->bt, .max_blocks = mb,
                        .n_logits = n_rows + n_dev, .logit_rows = s->rows, .n_sample = n_dev,
                        .sample = s->specs, .edits = s->edits, .n_edits = n_edits,
                        .sample_out = s->outs};
  s->n_sched = ns;
  s->step_verifies = false;
  int prompt_tokens = 0;
  for (int j = 0; j < ns; j++) {
    if (s->sched[j]->n_draft > 0) s->step_verifies = true;
    if (!decoding(s->sched[j])) prompt_tokens += s->sched[j]->n_new;
  }
  /* the policy learns from steps that mostly decode: a prefill chunk's time is no one's */
  s->step_measured = prompt_tokens <= s->step_decoding;
  s->eng_t0 = pd_engine_forward_seconds(s->eng);
  st = pd_engine_submit(s->eng, &s->batch, e);
  if (st != PD_OK) return st;
  /* the draft's share of the prompts, while the device computes the model's (a GPU draft has a
   * stream of its own) */
  if (s->draft_prefill && prompt_tokens > 0 && (st = draft_prefill(s, e)) != PD_OK) {
    pd_err fe = {0}; /* the model's pass was queued: wait for it before the step is dropped */
    pd_engine_finish(s->eng, &s->batch, s->logits, &fe);
    return st;
  }
  *started = true;
  return PD_OK;
}

/* The second half of a step: waits for its forward pass, then commits and emits. */
static pd_status step_end(pd_sched *s, pd_err *e) {
  const int ns = s->n_sched;
  pd_status st = pd_engine_finish(s->eng, &s->batch, s->logits, e);
  if (st != PD_OK) return st;
  s->st.steps++;
  s->st.batched_tokens += (uint64_t)s->batch.n_tokens;
  if (s->step_verifies) {
    s->st.spec_verify_seconds += pd_engine_forward_seconds(s->eng) - s->eng_t0;
    s->st.spec_verify_steps++;
  }
  s->step_gen0 = s->st.generated_tokens;

  /* commit, then sample. Forks happen before their parent's token is appended. */
  for (int j = 0; j < ns; j++) {
    sseq *q = s->sched[j];
    if (q->n_draft > 0) continue; /* committed as far as verified, in emit_spec */
    st = pd_kv_seq_commit(q->kv, q->n_new, e);
    if (st != PD_OK) return st;
    sreq *r = q->req;
    for (int i = 0; i < q->lp_count; i++) {
      int p = q->lp_pos0 + i;
      const float *row = s->logits + (size_t)(q->lp_row0 + i) * s->V;
      st = pd_logprobs_compute(row, s->V, pd_kv_seq_tokens(q->kv)[p + 1], r->p.prompt_logprobs,
                               &r->prompt_lp[p], e);
      if (st != PD_OK) return st;
      r->prompt_lp_done = p + 1;
    }
  }
  for (int j = 0; j < ns; j++) {
    sseq *q = s->sched[j];
    if (q->req->aborted) continue;
    if (q->n_draft > 0) {
      st = q->spec_dev ? emit_spec_dev(s, q, &s->outs[q->dev_row], e)
                       : emit_spec(s, q, s->logits + (size_t)q->sample_row * s->V, e);
      /* (either may free q) */
      if (st != PD_OK) return st;
      continue;
    }
    if (q->dev_row >= 0) {
      st = emit_dev(s, q, &s->outs[q->dev_row], e); /* may free q */
      if (st != PD_OK) return st;
      continue;
    }
    if (q->sample_row < 0) continue;
    const float *row = s->logits + (size_t)q->sample_row * s->V;
    sreq *r = q->req;
    sseq *forks[PD_SAMPLE_MAX_N];
    int n_forks = 0;
    if (r->n > 1 && !r->forked) {
      st = fork_samples(s, q, forks, e);
      if (st != PD_OK) return st;
      n_forks = r->n - 1;
    }
    st = emit(s, q, row, e); /* may free q (and r, when it was the last) */
    if (st != PD_OK) return st;
    for (int i = 0; i < n_forks; i++) {
      if (forks[i]->req->aborted) break;
      st = emit(s, forks[i], row, e);
      if (st != PD_OK) return st;
    }
  }
  s->step_tokens = (int)(s->st.generated_tokens - s->step_gen0);
  return PD_OK;
}
