/* One choice's path through the cluster (router.h, docs/protocol.md "One request").
 *
 *   QUEUED --Reserve--> RESERVING --ReserveReply ok, Prefill(dest)--> PREFILLING
 *          --FirstToken--> DECODING --TokenStream ... finish--> DONE
 *   QUEUED --Prefill(no dest)--> PREFILLING --FirstToken--> DONE        (one token to make)
 *   QUEUED --Prefill(decode_here) to a unified node--> PREFILLING --FirstToken--> DECODING ...
 *                                                     (local prefill: the node decodes it too)
 *
 * Every attempt has its own wire id "<request>.<choice>.<attempt>", where <request> is 128
 * random bits in hex (nobody can guess another request's id), so a late message of an
 * abandoned attempt is recognised as stale (and answered with Abort) instead of mixing in.
 * Failures of an attempt (a node died, a reservation expired, a node reported an error) send the
 * choice back to the front of the queue with the tokens it already has: the next attempt
 * reserves and prefills prompt + generated tokens elsewhere (migration), with the same seed and
 * sample index, so a seeded stream continues as it would have. After MAX_ATTEMPTS, or when no
 * node of the needed role is left, the choice ends with an error. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router.h"

#define MAX_ATTEMPTS 4
#define NO_NODE_GRACE_MS 5000 /* a request (or its retry) waits this long for a node to (re)appear */

void route_init(router *r) {
  pd_map_init(&r->subs_by_wire, 0, PD_MAP_COPY_KEYS);
  r->q_head = r->q_tail = NULL;
  r->q_len = 0;
}

void route_free(router *r) { pd_map_free(&r->subs_by_wire); }

int route_queue_length(router *r) { return r->q_len; }
int route_active_subs(router *r) { return r->n_active_subs; }

/* ---- the queue ---- */

static void q_remove(router *r, rsub *s) {
  if (!s->in_queue) return;
  if (s->qprev) s->qprev->qnext = s->qnext;
  else r->q_head = s->qnext;
  if (s->qnext) s->qnext->qprev = s->qprev;
  else r->q_tail = s->qprev;
  s->qprev = s->qnext = NULL;
  s->in_queue = false;
  r->q_len--;
}

static void q_push(router *r, rsub *s, bool front) {
  q_remove(r, s);
  s->in_queue = true;
  r->q_len++;
  if (front) {
    s->qprev = NULL;
    s->qnext = r->q_head;
    if (r->q_head) r->q_head->qprev = s;
    else r->q_tail = s;
    r->q_head = s;
  } else {
    s->qnext = NULL;
    s->qprev = r->q_tail;
    if (r->q_tail) r->q_tail->qnext = s;
    else r->q_head = s;
    r->q_tail = s;
  }
}

/* ---- helpers ---- */

static void set_wire_id(router *r, rsub *s) {
  if (s->wire_id[0]) pd_map_cstr_del(&r->subs_by_wire, s->wire_id);
  snprintf(s->wire_id, sizeof s->wire_id, "%s.%d.%d", s->req->wire, s->index, s->attempt);
  if (!pd_map_cstr_put(&r->subs_by_wire, s->wire_id, (uintptr_t)s))
    PD_ASSERT(!"out of memory in the id map");
}

static const prompt *sub_prompt(const rsub *s) { return &s->req->prompts[s->prompt_i]; }

static int max_tokens_of(const rsub *s) { return s->req->op.p.max_tokens; }

/* Whether the next attempt needs a decode node (more than one token still to make). */
static bool needs_decode(const rsub *s) { return max_tokens_of(s) - s->n_gen > 1; }

static void send_abort(router *r, rnode *n, const char *id, Pd__ErrorCode code,
                       const char *why) {
  if (!n || n->dead) return;
  Pd__Abort a;
  pd__abort__init(&a);
  a.request_id = (char *)id;
  a.code = code;
  a.reason = (char *)why;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_ABORT;
  env.abort = &a;
  router_send_node(r, n, &env);
}

static void drop_node(rsub *s, rnode **slot) {
  if (*slot) {
    (*slot)->n_subs--;
    *slot = NULL;
  }
}

static void stash_clear(rsub *s) {
  for (int i = 0; i < s->n_stash; i++) {
    free(s->stash[i].ids);
    free(s->stash[i].lps);
  }
  s->n_stash = 0;
}

/* Lets go of the current attempt: aborts it on its nodes (abort), forgets the nodes, the
 * reservation and the wire id. The choice itself stays as it is. */
static void release_attempt(router *r, rsub *s, bool abort, Pd__ErrorCode code,
                            const char *why) {
  if (abort) {
    if (s->prefill && s->state == SUB_PREFILLING) send_abort(r, s->prefill, s->wire_id, code, why);
    if (s->decode && s->state >= SUB_RESERVING && s->state <= SUB_DECODING)
      send_abort(r, s->decode, s->wire_id, code, why);
  }
  drop_node(s, &s->prefill);
  drop_node(s, &s->decode);
  free(s->blocks);
  s->blocks = NULL;
  free(s->draft_blocks);
  s->draft_blocks = NULL;
  s->nb = 0;
  s->reservation_id = 0;
  memset(s->reservation_token, 0, sizeof s->reservation_token);
  s->got_first = false;
  s->n_from_decode = 0;
  stash_clear(s);
  q_remove(r, s);
}

static void sub_close(router *r, rsub *s, bool abort, Pd__ErrorCode code, const char *why) {
  if (s->state == SUB_DONE) return;
  release_attempt(r, s, abort, code, why);
  if (s->wire_id[0]) pd_map_cstr_del(&r->subs_by_wire, s->wire_id);
  s->wire_id[0] = 0;
  s->state = SUB_DONE;
  r->n_active_subs--;
}

void route_sub_stop(router *r, rsub *s) {
  sub_close(r, s, true, PD__ERROR_CODE__ERROR_CODE_ABORTED, "stopped by the router");
}

void route_sub_fail(router *r, rsub *s, Pd__ErrorCode code, const char *fmt, ...) {
  if (s->finished) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->err_msg, sizeof s->err_msg, fmt, ap);
  va_end(ap);
  s->err_code = code;
  sub_close(r, s, true, code, s->err_msg);
  s->finished = true;
  s->finish_reason = "error";
  pd_log(PD_LOG_WARN, "%s choice %d failed: %s", s->req->id, s->index, s->err_msg);
  rmetrics_error(r, api_error_code_str(code));
  out_sub_done(r, s);
}

/* The current attempt failed but the choice may succeed elsewhere: back to the queue's front
 * with a new wire id (and the tokens it has, so the next attempt is a migration). */
static void retry(router *r, rsub *s, const char *why) {
  if (s->state == SUB_DONE) return;
  release_attempt(r, s, true, PD__ERROR_CODE__ERROR_CODE_NODE_FAILED, why);
  if (s->attempt + 1 >= MAX_ATTEMPTS) {
    route_sub_fail(r, s, PD__ERROR_CODE__ERROR_CODE_NODE_FAILED,
                   "gave up after %d attempts; last: %s", s->attempt + 1, why);
    return;
  }
  s->attempt++;
  pd_metric_add(s->n_gen > 0 ? r->m.migrations : r->m.retries, 1);
  pd_log(PD_LOG_INFO, "%s choice %d: %s; %s with %d tokens generated", s->req->id, s->index, why,
         s->n_gen > 0 ? "migrating" : "retrying", s->n_gen);
  set_wire_id(r, s);
  s->state = SUB_QUEUED;
  s->t_enqueued = pd_now_ms(); /* its wait for a node counts from here */
  q_push(r, s, true);
}

/* ---- submission and dispatch ---- */

void route_submit(router *r, rreq *q) {
  int64_t now = pd_now_ms();
  pd_log(PD_LOG_DEBUG, "%s: wire ids %s.<choice>.<attempt>", q->id, q->wire);
  for (int i = 0; i < q->n_subs; i++) {
    rsub *s = &q->subs[i];
    s->state = SUB_QUEUED;
    s->t_enqueued = now;
    s->stop_token = -1;
    set_wire_id(r, s);
    q_push(r, s, false);
    r->n_active_subs++;
  }
  route_dispatch(r);
}

static void fill_sampling_ids(Pd__SamplingParams **sp, rsub *s) { *sp = s->req->wire_sp; }

static bool send_reserve(router *r, rsub *s, rnode *d) {
  const prompt *p = sub_prompt(s);
  Pd__Reserve rs;
  pd__reserve__init(&rs);
  rs.request_id = s->wire_id;
  rs.n_tokens = (uint32_t)(p->n + s->n_gen);
  rs.max_new_tokens = (uint32_t)(max_tokens_of(s) - s->n_gen);
  rs.ttl_ms = (uint32_t)r->o.kv_ttl_ms;
  rs.n_prompt_token_ids = (size_t)p->n;
  rs.prompt_token_ids = p->ids;
  rs.n_generated_token_ids = (size_t)s->n_gen;
  rs.generated_token_ids = s->gen;
  fill_sampling_ids(&rs.sampling, s);
  rs.sample_index = s->sample_index;
  rs.cache_salt = s->req->cache_salt_str;
  /* draft blocks too where a prefill node can fill them */
  rs.with_draft = registry_draft_prefill_for(r, d);
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_RESERVE;
  env.reserve = &rs;
  return router_send_node(r, d, &env) == PD_OK;
}

/* A Prefill of choice s's prompt and generated tokens, its sampling and wire id. */
static void prefill_init(Pd__Prefill *pf, rsub *s) {
  const prompt *pr = sub_prompt(s);
  pd__prefill__init(pf);
  pf->request_id = s->wire_id;
  pf->n_prompt_token_ids = (size_t)pr->n;
  pf->prompt_token_ids = pr->ids;
  pf->n_generated_token_ids = (size_t)s->n_gen;
  pf->generated_token_ids = s->gen;
  fill_sampling_ids(&pf->sampling, s);
  pf->sample_index = s->sample_index;
  pf->cache_salt = s->req->cache_salt_str;
}

static bool send_prefill(router *r, rsub *s, rnode *p, rnode *d) {
  const prompt *pr = sub_prompt(s);
  Pd__Prefill pf;
  prefill_init(&pf, s);
  Pd__KvDestination dest;
  Pd__KvGeometry g, dg;
  if (d) {
    pd__kv_destination__init(&dest);
    dest.node_id = d->id;
    dest.endpoint = d->kv_endpoint;
    if (d->kv_curve) {
      dest.curve_public_key.data = d->kv_key;
      dest.curve_public_key.len = PD_CURVE_KEY_BYTES;
    }
    dest.reservation_id = s->reservation_id;
    dest.reservation_token.data = s->reservation_token;
    dest.reservation_token.len = sizeof s->reservation_token;
    dest.n_block_ids = (size_t)s->nb;
    dest.block_ids = s->blocks;
    pd__kv_geometry__init(&g);
    g.num_layers = d->num_layers;
    g.num_kv_heads = d->num_kv_heads;
    g.head_dim = d->head_dim;
    g.block_size = d->block_size;
    g.dtype = d->dtype;
    g.total_blocks = d->total_blocks;
    g.kv_head_begin = d->kv_head_begin;
    g.kv_head_end = d->kv_head_end;
    dest.kv = &g;
    if (s->draft_blocks && registry_same_draft(p, d)) {
      dest.n_draft_block_ids = (size_t)s->nb;
      dest.draft_block_ids = s->draft_blocks;
      pd__kv_geometry__init(&dg);
      dg.num_layers = d->draft_num_layers;
      dg.num_kv_heads = d->draft_num_kv_heads;
      dg.head_dim = d->draft_head_dim;
      dg.block_size = d->block_size;
      dg.dtype = d->dtype;
      dg.total_blocks = d->draft_total_blocks;
      dg.kv_head_begin = 0;
      dg.kv_head_end = d->draft_num_kv_heads;
      dest.draft_kv = &dg;
    }
    pf.dest = &dest;
  }
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_PREFILL;
  env.prefill = &pf;
  if (router_send_node(r, p, &env) != PD_OK) return false;
  registry_note_prefill(r, p, pr->ids, pr->n, s->req->cache_salt);
  s->prefill = p;
  p->n_subs++;
  s->state = SUB_PREFILLING;
  pd_metric_add(r->m.prefill_remote, 1);
  return true;
}

/* Local prefill: the whole choice to unified node u, which prefills it in its own batch and
 * decodes it (no reservation, no KV transfer). */
static bool send_local(router *r, rsub *s, rnode *u) {
  const prompt *pr = sub_prompt(s);
  Pd__Prefill pf;
  prefill_init(&pf, s);
  pf.decode_here = true;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_PREFILL;
  env.prefill = &pf;
  if (router_send_node(r, u, &env) != PD_OK) {
    u->est_free_blocks = 0; /* unreachable for now: the next heartbeat restores it */
    return false;
  }
  registry_note_prefill(r, u, pr->ids, pr->n, s->req->cache_salt);
  const int n_ctx = pr->n + s->n_gen, bs = u->block_size > 0 ? (int)u->block_size : 16;
  u->est_free_blocks -= (n_ctx + bs - 1) / bs;
  s->prefill = u;
  s->decode = u;
  u->n_subs += 2;
  s->state = SUB_PREFILLING;
  pd_metric_add(r->m.prefill_local, 1);
  return true;
}

/* Conditional disaggregation: whether a choice with n_ctx tokens of context, hit of them
 * expected in the chosen unified node's cache, is prefilled there rather than on a prefill
 * node: when no prefill node is up, when what is left to compute is short (a transfer would
 * cost more than it saves), or when every prefill node is backed up. */
static bool prefill_locally(router *r, int n_ctx, int hit) {
  const int64_t q = registry_min_prefill_queue(r);
  if (q < 0) return true;
  if (n_ctx - hit < r->o.remote_prefill_min_tokens) return true;
  return q > r->o.remote_prefill_max_queue;
}

/* 1: dispatched, 0: no capacity now, -1: the choice ended (no node at all). */
static int dispatch_one(router *r, rsub *s) {
  const prompt *p = sub_prompt(s);
  int64_t now = pd_now_ms();
  bool need_d = needs_decode(s);
  const int n_unified = registry_count_unified(r);
  bool have_p = registry_count(r, PD__ROLE__ROLE_PREFILL, true) > 0 || n_unified > 0;
  bool have_d = !need_d || registry_count(r, PD__ROLE__ROLE_DECODE, true) > 0;
  if (!have_p || !have_d) {
    const char *missing = !have_p ? "prefill" : "decode";
    /* A retry or migration waits as a new request does: the node that failed it is often
     * coming back (a restart registers again within a second) */
    if (now - s->t_enqueued > NO_NODE_GRACE_MS) {
      if (s->attempt > 0 || s->n_gen > 0)
        route_sub_fail(r, s, PD__ERROR_CODE__ERROR_CODE_NODE_FAILED,
                       "no %s node is left to continue the request", missing);
      else
        route_sub_fail(r, s, PD__ERROR_CODE__ERROR_CODE_OVERLOADED, "no %s node is available",
                       missing);
      return -1;
    }
    return 0;
  }
  if (n_unified > 0) {
    int hit = 0;
    rnode *u = registry_choose_unified(r, p->n + s->n_gen, p->ids, p->n, s->req->cache_salt,
                                       &hit);
    if (u && prefill_locally(r, p->n + s->n_gen, hit)) {
      q_remove(r, s);
      if (!send_local(r, s, u)) {
        q_push(r, s, true);
        return 0;
      }
      return 1;
    }
    if (registry_count(r, PD__ROLE__ROLE_PREFILL, true) == 0) return 0; /* wait for room */
  }
  if (!need_d) {
    rnode *pn = registry_choose_prefill(r, NULL, p->ids, p->n, s->req->cache_salt);
    if (!pn) return 0;
    q_remove(r, s);
    if (!send_prefill(r, s, pn, NULL)) {
      q_push(r, s, true);
      return 0;
    }
    return 1;
  }
  int n_ctx = p->n + s->n_gen;
  /* blocks: the context, plus room for a little output so decode does not preempt at once */
  int bs = 0;
  for (int i = 0; i < r->n_nodes && !bs; i++)
    if (!r->nodes[i]->dead && r->nodes[i]->role == PD__ROLE__ROLE_DECODE)
      bs = (int)r->nodes[i]->block_size;
  if (bs < 1) bs = 16;
  int need = (n_ctx + bs - 1) / bs;
  rnode *d = registry_choose_decode(r, need, NULL);
  if (!d) return 0;
  need = (n_ctx + (int)d->block_size - 1) / (int)d->block_size;
  q_remove(r, s);
  if (!send_reserve(r, s, d)) {
    q_push(r, s, true);
    d->est_free_blocks = 0; /* unreachable for now: the next heartbeat restores it */
    return 0;
  }
  s->decode = d;
  d->n_subs++;
  d->est_free_blocks -= need;
  s->state = SUB_RESERVING;
  return 1;
}

void route_dispatch(router *r) {
  static bool busy;
  if (busy) return; /* a failure inside may call back here */
  busy = true;
  for (rsub *s = r->q_head; s;) {
    rsub *next = s->qnext;
    if (s->req->cancelled || s->finished) {
      q_remove(r, s);
      s = next;
      continue;
    }
    int rc = dispatch_one(r, s);
    if (rc == 0) break; /* first come, first served: later choices wait their turn */
    s = next;
    if (rc < 0) s = r->q_head; /* the queue may have changed under a failure */
  }
  busy = false;
  pd_metric_set(r->m.queue_len, r->q_len);
}

/* ---- messages from nodes ---- */

static void lp_from_wire(const Pd__TokenLogprob *w, pd_logprobs *out) {
  memset(out, 0, sizeof *out);
  out->token = w->token_id;
  out->logprob = w->logprob;
  out->rank = (int32_t)w->rank;
  int k = (int)(w->n_top < PD_SAMPLE_MAX_LOGPROBS ? w->n_top : PD_SAMPLE_MAX_LOGPROBS);
  for (int i = 0; i < k; i++) {
    out->top[i].id = w->top[i]->token_id;
    out->top[i].logprob = w->top[i]->logprob;
  }
  out->n_top = k;
}

/* Tokens for the client: recorded (for a later migration), timed, handed to the output. */
static void deliver(router *r, rsub *s, const int32_t *ids, const pd_logprobs *lps, int n,
                    Pd__FinishReason fin) {
  int64_t now = pd_now_ms();
  if (n > 0) {
    if (s->n_gen + n > s->cap_gen) {
      int cap = s->cap_gen ? s->cap_gen : 64;
      while (cap < s->n_gen + n) cap *= 2;
      int32_t *g = realloc(s->gen, (size_t)cap * sizeof *g);
      if (!g) {
        route_sub_fail(r, s, PD__ERROR_CODE__ERROR_CODE_INTERNAL, "out of memory");
        return;
      }
      s->gen = g;
      s->cap_gen = cap;
    }
    memcpy(s->gen + s->n_gen, ids, (size_t)n * sizeof *ids);
    if (s->n_gen == 0) {
      s->t_first = now;
      pd_metric_observe(r->m.ttft, (double)(now - s->req->t_start) / 1000.0);
    } else if (s->t_last) {
      double gap = (double)(now - s->t_last) / 1000.0 / n;
      for (int i = 0; i < n; i++) pd_metric_observe(r->m.itl, gap);
    }
    s->t_last = now;
    s->n_gen += n;
    pd_metric_add(r->m.gen_tokens, n);
  }
  Pd__FinishReason eff = fin;
  if (eff == PD__FINISH_REASON__FINISH_REASON_NONE && max_tokens_of(s) > 0 &&
      s->n_gen >= max_tokens_of(s))
    eff = PD__FINISH_REASON__FINISH_REASON_LENGTH;
  out_tokens(r, s, ids, lps, n, eff); /* may finish s (stop string) */
  if (s->finished || s->state == SUB_DONE) return;
  if (eff != PD__FINISH_REASON__FINISH_REASON_NONE) {
    /* the node ended it and dropped the sequence; a reservation the first token made
     * unnecessary (or a sequence the router ends itself) is aborted. finish_reason was set
     * by out_tokens. */
    bool abort = fin == PD__FINISH_REASON__FINISH_REASON_NONE || s->state == SUB_PREFILLING;
    sub_close(r, s, abort, PD__ERROR_CODE__ERROR_CODE_ABORTED, "finished");
    s->finished = true;
    if (!s->finish_reason) s->finish_reason = "length";
    out_sub_done(r, s);
  }
}

static bool from(const pd_net_msg *m, const rnode *n) {
  return n && m->routing_id_len == n->rid_len && !memcmp(m->routing_id, n->rid, n->rid_len);
}

static void on_reserve_reply(router *r, rnode *n, const Pd__ReserveReply *rr) {
  rsub *s = pd_map_ptr(pd_map_cstr_find(&r->subs_by_wire, rr->request_id));
  if (!s || s->state != SUB_RESERVING || s->decode != n) {
    if (rr->ok) send_abort(r, n, rr->request_id, PD__ERROR_CODE__ERROR_CODE_ABORTED, "stale");
    return;
  }
  pd_err e = {0};
  if (pd_wire_validate_reserve_reply(rr, &n->lim, &e) != PD_OK) {
    retry(r, s, e.msg);
    return;
  }
  if (!rr->ok) {
    Pd__ErrorCode code = rr->error ? rr->error->code : PD__ERROR_CODE__ERROR_CODE_OVERLOADED;
    const char *msg = rr->error && rr->error->message ? rr->error->message : "refused";
    if (code == PD__ERROR_CODE__ERROR_CODE_OVERLOADED) {
      /* backpressure: wait in the queue (front) until a heartbeat shows room */
      n->est_free_blocks = 0;
      release_attempt(r, s, false, 0, NULL);
      s->state = SUB_QUEUED;
      q_push(r, s, true);
      return;
    }
    if (rr->error && rr->error->retryable) retry(r, s, msg);
    else route_sub_fail(r, s, code, "%s", msg);
    return;
  }
  const prompt *p = sub_prompt(s);
  int need = (p->n + s->n_gen + (int)n->block_size - 1) / (int)n->block_size;
  if ((int)rr->n_block_ids != need) {
    retry(r, s, "the decode node reserved a wrong number of blocks");
    return;
  }
  s->blocks = malloc(rr->n_block_ids * sizeof *s->blocks);
  if (!s->blocks) {
    route_sub_fail(r, s, PD__ERROR_CODE__ERROR_CODE_INTERNAL, "out of memory");
    return;
  }
  memcpy(s->blocks, rr->block_ids, rr->n_block_ids * sizeof *s->blocks);
  s->nb = (int)rr->n_block_ids;
  free(s->draft_blocks);
  s->draft_blocks = NULL;
  if (rr->n_draft_block_ids == rr->n_block_ids && n->has_draft &&
      (s->draft_blocks = malloc(rr->n_draft_block_ids * sizeof *s->draft_blocks)))
    memcpy(s->draft_blocks, rr->draft_block_ids, rr->n_draft_block_ids * sizeof *s->draft_blocks);
  s->reservation_id = rr->reservation_id;
  memcpy(s->reservation_token, rr->reservation_token.data, sizeof s->reservation_token);
  rnode *pn = registry_choose_prefill(r, n, p->ids, p->n, s->req->cache_salt);
  if (!pn || !send_prefill(r, s, pn, n)) {
    /* no prefill node can take it now: give the blocks back and wait in the queue */
    send_abort(r, n, s->wire_id, PD__ERROR_CODE__ERROR_CODE_ABORTED, "no prefill node");
    release_attempt(r, s, false, 0, NULL);
    s->attempt++;
    set_wire_id(r, s);
    s->state = SUB_QUEUED;
    q_push(r, s, true);
    return;
  }
}

static void replay_stash(router *r, rsub *s);

static void on_first_token(router *r, rnode *n, const Pd__FirstToken *ft) {
  rsub *s = pd_map_ptr(pd_map_cstr_find(&r->subs_by_wire, ft->request_id));
  if (!s || s->state != SUB_PREFILLING || s->prefill != n || s->got_first) {
    send_abort(r, n, ft->request_id, PD__ERROR_CODE__ERROR_CODE_ABORTED, "stale");
    return;
  }
  s->got_first = true;
  if (s->n_gen == 0) {
    s->cached_tokens = ft->cached_tokens;
    pd_metric_add(r->m.cached_tokens, ft->cached_tokens);
  }
  if (ft->n_prompt_logprobs && !s->prompt_lp && s->req->want_prompt_lp)
    s->prompt_lp = prompt_lp_json(r, s, ft->prompt_logprobs, (int)ft->n_prompt_logprobs);
  pd_logprobs lp;
  if (ft->logprob) lp_from_wire(ft->logprob, &lp);
  Pd__FinishReason fin = ft->finish_reason;
  if (fin == PD__FINISH_REASON__FINISH_REASON_NONE && !s->decode)
    fin = PD__FINISH_REASON__FINISH_REASON_LENGTH; /* max_tokens reached: one token wanted */
  if (fin != PD__FINISH_REASON__FINISH_REASON_NONE) {
    /* no decode stage: the reservation (if any) is not needed */
    deliver(r, s, &ft->token_id, ft->logprob ? &lp : NULL, 1, fin);
    return;
  }
  s->state = SUB_DECODING;
  deliver(r, s, &ft->token_id, ft->logprob ? &lp : NULL, 1, fin);
  if (!s->finished && s->state == SUB_DECODING) replay_stash(r, s);
}

static void on_stream(router *r, rsub *s, const int32_t *ids, const pd_logprobs *lps, int n,
                      uint32_t n_generated, Pd__FinishReason fin) {
  uint32_t before = n_generated - (uint32_t)n;
  if (before != (uint32_t)s->n_gen) {
    if (before < (uint32_t)s->n_gen) return; /* already delivered */
    retry(r, s, "tokens were lost between the decode node and the router");
    return;
  }
  if (s->n_from_decode == 0) drop_node(s, &s->prefill); /* the KV has landed */
  s->n_from_decode += n;
  deliver(r, s, ids, lps, n, fin);
}

static void replay_stash(router *r, rsub *s) {
  int k = s->n_stash;
  stash_msg st[4];
  memcpy(st, s->stash, sizeof st);
  s->n_stash = 0;
  for (int i = 0; i < k; i++) {
    if (!s->finished && s->state == SUB_DECODING)
      on_stream(r, s, st[i].ids, st[i].lps, st[i].n, st[i].n_generated, st[i].finish);
    free(st[i].ids);
    free(st[i].lps);
  }
}

static void on_token_stream(router *r, rnode *n, const Pd__TokenStream *ts) {
  rsub *s = pd_map_ptr(pd_map_cstr_find(&r->subs_by_wire, ts->request_id));
  if (!s || s->decode != n || (s->state != SUB_DECODING && s->state != SUB_PREFILLING)) {
    send_abort(r, n, ts->request_id, PD__ERROR_CODE__ERROR_CODE_ABORTED, "stale");
    return;
  }
  int cnt = (int)ts->n_token_ids;
  pd_logprobs *lps = NULL;
  if (ts->n_logprobs == ts->n_token_ids && cnt > 0) {
    lps = malloc((size_t)cnt * sizeof *lps);
    if (lps)
      for (int i = 0; i < cnt; i++) lp_from_wire(ts->logprobs[i], &lps[i]);
  }
  if (s->state == SUB_PREFILLING) {
    /* overtook the FirstToken (another connection): keep it until that arrives */
    if (s->n_stash == 4) {
      free(lps);
      retry(r, s, "the first token did not arrive");
      return;
    }
    stash_msg *m = &s->stash[s->n_stash];
    m->ids = malloc((size_t)(cnt ? cnt : 1) * sizeof *m->ids);
    if (!m->ids) {
      free(lps);
      route_sub_fail(r, s, PD__ERROR_CODE__ERROR_CODE_INTERNAL, "out of memory");
      return;
    }
    memcpy(m->ids, ts->token_ids, (size_t)cnt * sizeof *m->ids);
    m->lps = lps;
    m->n = cnt;
    m->n_generated = ts->n_generated;
    m->finish = ts->finish_reason;
    s->n_stash++;
    return;
  }
  on_stream(r, s, ts->token_ids, lps, cnt, ts->n_generated, ts->finish_reason);
  free(lps);
}

static void on_error(router *r, rnode *n, const Pd__Error *err) {
  const char *msg = err->message && *err->message ? err->message : "(no message)";
  if (!err->request_id || !*err->request_id) {
    pd_log(PD_LOG_WARN, "node %s reports: %s", n->id, msg);
    return;
  }
  rsub *s = pd_map_ptr(pd_map_cstr_find(&r->subs_by_wire, err->request_id));
  if (!s || (s->prefill != n && s->decode != n)) return;
  char why[700];
  snprintf(why, sizeof why, "node %s: %s", n->id, msg);
  switch (err->code) {
    case PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST:
    case PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG:
    case PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED:
      if (!err->retryable) {
        route_sub_fail(r, s, err->code, "%s", why);
        break;
      }
      /* fall through */
    default:
      retry(r, s, why);
      break;
  }
}

void route_on_message(router *r, rnode *n, const pd_net_msg *m) {
  if (!from(m, n)) return;
  const Pd__Envelope *env = m->wire.env;
  switch (env->body_case) {
    case PD__ENVELOPE__BODY_RESERVE_REPLY:
      on_reserve_reply(r, n, env->reserve_reply);
      break;
    case PD__ENVELOPE__BODY_FIRST_TOKEN:
      on_first_token(r, n, env->first_token);
      break;
    case PD__ENVELOPE__BODY_TOKEN_STREAM:
      on_token_stream(r, n, env->token_stream);
      break;
    case PD__ENVELOPE__BODY_ERROR:
      on_error(r, n, env->error);
      break;
    default:
      pd_log(PD_LOG_WARN, "unexpected %s from node %s", pd_wire_body_name(env->body_case), n->id);
      break;
  }
}

void route_node_failed(router *r, rnode *n, const char *why) {
  char msg[400];
  snprintf(msg, sizeof msg, "node %s failed (%s)", n->id, why);
  for (rreq *q = r->all; q; q = q->next_all) {
    if (q->finished) continue;
    for (int i = 0; i < q->n_subs; i++) {
      rsub *s = &q->subs[i];
      if (s->state == SUB_DONE || s->state == SUB_QUEUED) continue;
      if (s->decode == n) {
        s->decode->n_subs--;
        s->decode = NULL; /* nothing to abort there */
        retry(r, s, msg);
      } else if (s->prefill == n) {
        /* before the first token, or before the decode node has streamed anything (the KV
         * may not have landed): redo the attempt */
        s->prefill->n_subs--;
        s->prefill = NULL;
        retry(r, s, msg);
      }
    }
  }
  route_dispatch(r);
}

void route_tick(router *r) {
  int64_t now = pd_now_ms();
  for (rreq *q = r->all; q; q = q->next_all) {
    if (q->finished || now < q->deadline) continue;
    for (int i = 0; i < q->n_subs; i++)
      if (!q->subs[i].finished)
        route_sub_fail(r, &q->subs[i], PD__ERROR_CODE__ERROR_CODE_TIMEOUT,
                       "the request did not finish within its deadline");
  }
  route_dispatch(r);
}
