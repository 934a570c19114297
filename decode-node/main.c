/* pd-decode: holds sequences and decodes them in a continuous batch (docs/cluster.md).
 *
 * A request's life here:
 *   Reserve (router)        -> pd_sched_reserve: blocks for prompt + generated tokens, held
 *                              until the KV lands or the reservation's ttl passes
 *   KvTransferHeader (KV)   -> checked against the reservation (its 128-bit token, the same
 *                              block ids, the same geometry, CRC) and unpacked into the engine's cache: on a GPU copied
 *                              (with the CRC, over --kv-crc-threads) into a page-locked
 *                              buffer and unpacked from it in one DMA, else frame by frame
 *   KvTransferDone (KV)     -> every (layer, head) received: pd_sched_activate with the token
 *                              the prefill node sampled; KvTransferAck to the prefill node
 *   scheduler events        -> TokenStream to the router, one message per request per step
 *                              (all the tokens that step produced)
 *   Abort (router)          -> pd_sched_abort (reservation or running sequence)
 * A reservation whose KV does not complete in time is freed and the router is told (Error
 * TIMEOUT), so a stalled transfer never holds blocks for long.
 *
 * One thread polls the router socket and the KV socket and runs scheduler steps. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "node.h"
#include "pd/crc32.h"
#include "pd/kvpack.h"

enum { D_RESERVED = 0, D_ACTIVE };

typedef struct dreq {
  char id[PD_WIRE_ID_MAX_BYTES + 1];
  uint64_t sid, reservation_id;
  uint8_t token[PD_WIRE_TOKEN_BYTES]; /* random: every KV message must carry it */
  int state;
  int n_prompt, n_gen_base, n_ctx;
  int32_t *blocks;
  int nb;
  int32_t *draft_blocks; /* the draft's blocks for the same tokens (dnb 0: none reserved) */
  int dnb;
  uint8_t *draft_coverage; /* [draft layers * draft kv heads], as coverage */
  int64_t deadline_ms;
  double t_first_kv; /* pd_mono_s of its first KV message (0: none yet) */
  uint8_t *coverage; /* [num_layers * num_kv_heads]: 1 where that layer's head has landed */
  uint64_t bytes;
  uint8_t prefill_rid[PD_NET_ROUTING_ID_MAX];
  size_t prefill_rid_len;
  pd_sampling_params p; /* for the stop check at activation; stop_token_ids owned */
  int32_t *stop_ids;
  /* tokens produced since the last TokenStream */
  int32_t *pend;
  pd_logprobs *pend_lp;
  int n_pend, cap_pend;
  bool want_lp, finished;
  pd_finish_reason fin;
  uint32_t n_generated;
  /* a unified node's own prefill (Prefill with decode_here): its first token goes to the router
   * as a FirstToken, the rest as TokenStream */
  bool local, first_sent;
} dreq;

typedef struct decode {
  pd_node node;
  void *kv_sock;
  pd_hs_watch *kv_watch; /* KV-port handshakes that failed before ZAP (no keys, wrong key) */
  double last_step_s; /* the last step's wall time */
  dreq **reqs;
  int n_reqs, cap_reqs;
  uint64_t next_sid, next_reservation;
  int max_model_len;
  pd_metric *m_kv_check_s, *m_kv_unpack_s; /* the loop thread's time on received KV pages */
  pd_metric *m_requests, *m_kv_bytes, *m_kv_transfers, *m_kv_seconds, *m_res_refused,
      *m_res_expired, *m_errors_kv, *m_errors_internal, *m_errors_invalid, *m_itl, *m_reserved,
      *m_local_prefills, *m_draft_kv_landed, *m_draft_kv_missing;
} decode;

static decode g;

/* ---- requests ---- */

static dreq *find_by_id(const char *id) {
  for (int i = 0; i < g.n_reqs; i++)
    if (!strcmp(g.reqs[i]->id, id)) return g.reqs[i];
  return NULL;
}

static dreq *find_by_sid(uint64_t sid) {
  for (int i = 0; i < g.n_reqs; i++)
    if (g.reqs[i]->sid == sid) return g.reqs[i];
  return NULL;
}

/* Room for one more request; false when out of memory. */
static bool grow_reqs(void) {
  int c2 = g.cap_reqs ? 2 * g.cap_reqs : 64;
  dreq **v = realloc(g.reqs, (size_t)c2 * sizeof *v);
  if (!v) return false;
  g.reqs = v;
  g.cap_reqs = c2;
  return true;
}

static void remove_req(dreq *r) {
  for (int i = 0; i < g.n_reqs; i++)
    if (g.reqs[i] == r) {
      g.reqs[i] = g.reqs[--g.n_reqs];
      break;
    }
  free(r->blocks);
  free(r->coverage);
  free(r->draft_blocks);
  free(r->draft_coverage);
  free(r->stop_ids);
  free(r->pend);
  free(r->pend_lp);
  free(r);
}

static void fill_load(pd_node *n, Pd__Load *l) {
  pd_sched_stats s;
  pd_sched_get_stats(n->rt.sched, &s);
  uint32_t reserved = 0, landing = 0;
  uint64_t queued = 0; /* a unified node's prompts not prefilled yet */
  for (int i = 0; i < g.n_reqs; i++) {
    if (g.reqs[i]->state == D_RESERVED) {
      reserved += (uint32_t)g.reqs[i]->nb;
      landing++;
    }
    if (g.reqs[i]->local && !g.reqs[i]->first_sent)
      queued += (uint64_t)(g.reqs[i]->n_prompt + g.reqs[i]->n_gen_base);
  }
  l->queued_prompt_tokens = queued;
  l->total_blocks = (uint32_t)pd_kv_pool_num_blocks(n->rt.pool);
  l->free_blocks = (uint32_t)pd_kv_pool_num_available(n->rt.pool);
  l->reserved_blocks = reserved < l->total_blocks ? reserved : l->total_blocks;
  l->running_seqs = (uint32_t)s.running;
  l->waiting_seqs = (uint32_t)s.waiting + landing;
  if (s.spec_verified) { /* tokens per verification since start */
    double emitted = 0;
    for (int j = 0; j < PD_SPEC_MAX_K + 2; j++) emitted += (double)j * s.spec_emitted_hist[j];
    l->spec_acceptance = (float)(emitted / (double)s.spec_verified);
  }
  pd_metric_set(g.m_reserved, reserved);
}

/* ---- replies ---- */

static void send_reserve_refusal(const char *id, Pd__ErrorCode code, bool retryable,
                                 const char *msg) {
  Pd__Error err;
  pd__error__init(&err);
  err.code = code;
  err.message = (char *)msg;
  err.request_id = (char *)id;
  err.retryable = retryable;
  Pd__ReserveReply rr;
  pd__reserve_reply__init(&rr);
  rr.request_id = (char *)id;
  rr.ok = false;
  rr.error = &err;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_RESERVE_REPLY;
  env.reserve_reply = &rr;
  pd_node_send(&g.node, &env);
}

static void send_kv_ack(const uint8_t *rid, size_t rid_len, const char *id, uint64_t res, bool ok,
                        Pd__ErrorCode code, const char *msg) {
  if (!rid_len) return;
  Pd__KvTransferAck a;
  pd__kv_transfer_ack__init(&a);
  a.request_id = (char *)id;
  a.reservation_id = res;
  a.ok = ok;
  Pd__Error err;
  if (!ok) {
    pd__error__init(&err);
    err.code = code;
    err.message = (char *)msg;
    err.request_id = (char *)id;
    a.error = &err;
  }
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_KV_ACK;
  env.kv_ack = &a;
  env.sender = g.node.node_id;
  pd_err e = {0};
  pd_status st = pd_net_send(g.kv_sock, rid, rid_len, &env, NULL, 0, &e);
  if (st != PD_OK && st != PD_ENOTFOUND) pd_log(PD_LOG_WARN, "KV ack for %s: %s", id, e.msg);
}

/* Ends r with an error: the prefill node (if it started sending) and the router are told, the
 * scheduler lets go of its blocks. */
static void fail_req(dreq *r, Pd__ErrorCode code, const char *msg) {
  pd_log(PD_LOG_WARN, "%s: %s", r->id, msg);
  if (r->state == D_RESERVED) send_kv_ack(r->prefill_rid, r->prefill_rid_len, r->id,
                                          r->reservation_id, false, code, msg);
  pd_node_send_error(&g.node, code, r->id, true, "%s", msg);
  pd_sched_abort(g.node.rt.sched, r->sid);
  remove_req(r);
}

/* Sends the tokens r produced since the last call (and its finish), if any. */
static void flush_tokens(dreq *r) {
  if (!r->n_pend && !r->finished) return;
  Pd__TokenStream ts;
  pd__token_stream__init(&ts);
  ts.request_id = r->id;
  ts.n_token_ids = (size_t)r->n_pend;
  ts.token_ids = r->pend;
  Pd__TokenLogprob *lp = NULL, **lpp = NULL;
  Pd__TopLogprob *top = NULL, **topp = NULL;
  if (r->want_lp && r->n_pend) {
    lp = calloc((size_t)r->n_pend, sizeof *lp);
    lpp = calloc((size_t)r->n_pend, sizeof *lpp);
    top = calloc((size_t)r->n_pend * PD_SAMPLE_MAX_LOGPROBS, sizeof *top);
    topp = calloc((size_t)r->n_pend * PD_SAMPLE_MAX_LOGPROBS, sizeof *topp);
    if (lp && lpp && top && topp) {
      for (int i = 0; i < r->n_pend; i++) {
        pd_node_logprob(&r->pend_lp[i], &lp[i], topp + i * PD_SAMPLE_MAX_LOGPROBS,
                        top + i * PD_SAMPLE_MAX_LOGPROBS);
        lpp[i] = &lp[i];
      }
      ts.n_logprobs = (size_t)r->n_pend;
      ts.logprobs = lpp;
    }
  }
  ts.finish_reason = !r->finished                 ? PD__FINISH_REASON__FINISH_REASON_NONE
                     : r->fin == PD_FINISH_STOP   ? PD__FINISH_REASON__FINISH_REASON_STOP
                                                  : PD__FINISH_REASON__FINISH_REASON_LENGTH;
  ts.n_generated = r->n_generated;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_TOKEN_STREAM;
  env.token_stream = &ts;
  pd_node_send(&g.node, &env);
  free(lp);
  free(lpp);
  free(top);
  free(topp);
  r->n_pend = 0;
}

/* ---- scheduler events ---- */

static void on_event(void *user, const pd_sched_event *ev) {
  (void)user;
  dreq *r = find_by_sid(ev->id);
  if (!r) {
    pd_sched_abort(g.node.rt.sched, ev->id);
    return;
  }
  if (r->local && !r->first_sent && ev->token >= 0) {
    /* the prompt is in: its first token as a prefill node sends it */
    Pd__TokenLogprob lp;
    Pd__TopLogprob *top_p[PD_SAMPLE_MAX_LOGPROBS], top_s[PD_SAMPLE_MAX_LOGPROBS];
    pd_node_send_first_token(&g.node, r->id, ev, r->n_prompt, &lp, top_p, top_s);
    r->first_sent = true;
    r->n_generated++;
    if (ev->finish != PD_FINISH_NONE) remove_req(r); /* the FirstToken said so */
    return;
  }
  if (ev->token >= 0) {
    if (r->n_pend == r->cap_pend) {
      int cap = r->cap_pend ? 2 * r->cap_pend : 8;
      int32_t *t = realloc(r->pend, (size_t)cap * sizeof *t);
      if (t) r->pend = t;
      pd_logprobs *l = r->want_lp ? realloc(r->pend_lp, (size_t)cap * sizeof *l) : r->pend_lp;
      if (l) r->pend_lp = l;
      if (!t || (r->want_lp && !l)) {
        fail_req(r, PD__ERROR_CODE__ERROR_CODE_INTERNAL, "out of memory");
        return;
      }
      r->cap_pend = cap;
    }
    if (r->want_lp && ev->logprobs) r->pend_lp[r->n_pend] = *ev->logprobs;
    else if (r->want_lp) memset(&r->pend_lp[r->n_pend], 0, sizeof r->pend_lp[0]);
    r->pend[r->n_pend++] = ev->token;
    r->n_generated++;
  }
  if (ev->finish != PD_FINISH_NONE) {
    r->finished = true;
    r->fin = ev->finish;
  }
}

/* ---- router messages ---- */

static void on_reserve(const Pd__Reserve *m) {
  pd_node *n = &g.node;
  pd_err e = {0};
  if (find_by_id(m->request_id)) {
    send_reserve_refusal(m->request_id, PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST, false,
                         "request id is already in use on this node");
    return;
  }
  size_t nbias = m->sampling ? m->sampling->n_logit_bias : 0;
  pd_logit_bias *bias = calloc(nbias ? nbias : 1, sizeof *bias);
  dreq *r = calloc(1, sizeof *r);
  int n_ctx = (int)m->n_tokens;
  int cap = (n_ctx + n->pages.block_size - 1) / n->pages.block_size;
  if (r) {
    r->blocks = malloc((size_t)cap * sizeof *r->blocks);
    r->coverage = calloc((size_t)n->pages.num_layers * (size_t)n->pages.num_kv_heads, 1);
  }
  if (!bias || !r || !r->blocks || !r->coverage) {
    free(bias);
    if (r) {
      free(r->blocks);
      free(r->coverage);
      free(r);
    }
    send_reserve_refusal(m->request_id, PD__ERROR_CODE__ERROR_CODE_INTERNAL, true,
                         "out of memory");
    return;
  }
  Pd__SamplingParams defaults = PD__SAMPLING_PARAMS__INIT;
  pd_sampling_params p;
  if (pd_wire_sampling_params(m->sampling ? m->sampling : &defaults, &p, bias, nbias ? nbias : 1,
                              &e) != PD_OK) {
    free(bias);
    free(r->blocks);
    free(r->coverage);
    free(r);
    pd_metric_add(g.m_errors_invalid, 1);
    send_reserve_refusal(m->request_id, PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST, false, e.msg);
    return;
  }
  p.n = 1;
  snprintf(r->id, sizeof r->id, "%s", m->request_id);
  r->sid = ++g.next_sid;
  r->n_prompt = (int)m->n_prompt_token_ids;
  r->n_gen_base = (int)m->n_generated_token_ids;
  r->n_ctx = n_ctx;
  r->want_lp = p.logprobs >= 0;
  pd_sched_req sr = {.id = r->sid, .prompt = m->prompt_token_ids, .n_prompt = r->n_prompt,
                     .generated = m->generated_token_ids, .n_generated = r->n_gen_base,
                     .params = &p, .sample_index = m->sample_index,
                     .cache_salt = pd_kv_cache_salt(m->cache_salt)};
  pd_status st = pd_sched_reserve(n->rt.sched, &sr, r->blocks, cap, &r->nb, &e);
  if (st == PD_OK && r->nb != cap) {
    pd_sched_abort(n->rt.sched, r->sid);
    st = pd_err_set(&e, PD_EINVAL, "reserved %d blocks for %d tokens", r->nb, n_ctx);
  }
  /* the stop check at activation needs the parameters (stop ids owned, no logit bias) */
  r->p = p;
  r->p.logit_bias = NULL;
  r->p.n_logit_bias = 0;
  if (st == PD_OK && p.n_stop_token_ids) {
    r->stop_ids = malloc(p.n_stop_token_ids * sizeof *r->stop_ids);
    if (!r->stop_ids) {
      pd_sched_abort(n->rt.sched, r->sid);
      st = pd_err_set(&e, PD_ENOMEM, "out of memory");
    } else {
      memcpy(r->stop_ids, p.stop_token_ids, p.n_stop_token_ids * sizeof *r->stop_ids);
    }
  }
  r->p.stop_token_ids = r->stop_ids;
  if (r->p.max_tokens < 0) r->p.max_tokens = g.max_model_len - r->n_prompt;
  free(bias);
  if (st == PD_OK && g.n_reqs == g.cap_reqs && !grow_reqs()) {
    pd_sched_abort(n->rt.sched, r->sid);
    st = pd_err_set(&e, PD_ENOMEM, "out of memory");
  }
  if (st != PD_OK) {
    if (st == PD_EFULL) {
      pd_metric_add(g.m_res_refused, 1);
      send_reserve_refusal(m->request_id, PD__ERROR_CODE__ERROR_CODE_OVERLOADED, true,
                           "not enough free KV blocks on this decode node");
    } else {
      pd_metric_add(g.m_errors_invalid, 1);
      send_reserve_refusal(m->request_id,
                           st == PD_ERANGE ? PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG
                           : st == PD_ENOMEM ? PD__ERROR_CODE__ERROR_CODE_INTERNAL
                                             : PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST,
                           st == PD_ENOMEM, e.msg);
    }
    free(r->blocks);
    free(r->coverage);
    free(r->stop_ids);
    free(r);
    return;
  }
  r->reservation_id = ++g.next_reservation;
  if (pd_wire_random(r->token, sizeof r->token, &e) != PD_OK) {
    pd_sched_abort(n->rt.sched, r->sid);
    pd_metric_add(g.m_errors_internal, 1);
    send_reserve_refusal(m->request_id, PD__ERROR_CODE__ERROR_CODE_INTERNAL, true, e.msg);
    free(r->blocks);
    free(r->coverage);
    free(r->stop_ids);
    free(r);
    return;
  }
  r->state = D_RESERVED;
  r->deadline_ms = pd_now_ms() + (m->ttl_ms ? m->ttl_ms : 30000);
  g.reqs[g.n_reqs++] = r;
  pd_metric_add(g.m_requests, 1);
  /* the draft's blocks for the same tokens, when the prefill side computes the draft's KV too;
   * without them (no draft here, or none free) the draft computes that context itself */
  if (m->with_draft && n->draft_pages.num_layers) {
    r->draft_blocks = malloc((size_t)cap * sizeof *r->draft_blocks);
    r->draft_coverage = calloc((size_t)n->draft_pages.num_layers *
                                   (size_t)n->draft_pages.num_kv_heads, 1);
    pd_err de = {0};
    if (!r->draft_blocks || !r->draft_coverage ||
        pd_sched_reserve_draft(n->rt.sched, r->sid, r->draft_blocks, cap, &r->dnb, &de) !=
            PD_OK ||
        r->dnb != r->nb) {
      if (de.code && de.code != PD_EFULL) pd_log(PD_LOG_WARN, "%s: draft blocks: %s", r->id, de.msg);
      free(r->draft_blocks);
      free(r->draft_coverage);
      r->draft_blocks = NULL;
      r->draft_coverage = NULL;
      r->dnb = 0;
    }
  }

  Pd__ReserveReply rr;
  pd__reserve_reply__init(&rr);
  rr.request_id = r->id;
  rr.ok = true;
  rr.reservation_id = r->reservation_id;
  rr.reservation_token.data = r->token;
  rr.reservation_token.len = sizeof r->token;
  rr.n_block_ids = (size_t)r->nb;
  rr.block_ids = r->blocks;
  rr.n_draft_block_ids = (size_t)r->dnb;
  rr.draft_block_ids = r->draft_blocks;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_RESERVE_REPLY;
  env.reserve_reply = &rr;
  pd_node_send(n, &env);
  pd_log(PD_LOG_DEBUG, "%s: reserved %d blocks (%d of the draft) for %d tokens (reservation %llu)",
         r->id, r->nb, r->dnb, n_ctx, (unsigned long long)r->reservation_id);
}

/* A unified node's whole request: prefilled in this node's batch (chunked with the running
 * sequences' decode steps), then decoded here; no reservation, no KV transfer. */
static void on_local_prefill(const Pd__Prefill *m) {
  pd_node *n = &g.node;
  if (!n->o.unified || !m->decode_here) {
    pd_metric_add(g.m_errors_invalid, 1);
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED, m->request_id, false,
                       "this decode node is not a unified node: it prefills nothing itself");
    return;
  }
  if (find_by_id(m->request_id)) {
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST, m->request_id, false,
                       "request id is already in use on this node");
    return;
  }
  pd_sampling_params p;
  pd_logit_bias *bias = NULL;
  pd_status st = pd_node_sampling(n, m->request_id, m->sampling, &p, &bias);
  if (st != PD_OK) {
    if (st != PD_ENOMEM) pd_metric_add(g.m_errors_invalid, 1);
    return;
  }
  dreq *r = calloc(1, sizeof *r);
  if (!r || (g.n_reqs == g.cap_reqs && !grow_reqs())) {
    free(bias);
    free(r);
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INTERNAL, m->request_id, true,
                       "out of memory");
    return;
  }
  snprintf(r->id, sizeof r->id, "%s", m->request_id);
  r->sid = ++g.next_sid;
  r->local = true;
  r->state = D_ACTIVE;
  r->n_prompt = (int)m->n_prompt_token_ids;
  r->n_gen_base = (int)m->n_generated_token_ids;
  r->n_ctx = r->n_prompt + r->n_gen_base;
  r->n_generated = (uint32_t)r->n_gen_base;
  r->want_lp = p.logprobs >= 0;
  st = pd_node_sched_prefill(n, m, r->sid, &p);
  free(bias);
  if (st != PD_OK) {
    pd_metric_add(g.m_errors_invalid, 1);
    free(r);
    return;
  }
  g.reqs[g.n_reqs++] = r;
  pd_metric_add(g.m_requests, 1);
  pd_metric_add(g.m_local_prefills, 1);
  pd_log(PD_LOG_DEBUG, "%s: local prefill of %d + %d tokens", r->id, r->n_prompt, r->n_gen_base);
}

static void on_router_msg(pd_node *n, const Pd__Envelope *env) {
  switch (env->body_case) {
    case PD__ENVELOPE__BODY_RESERVE:
      on_reserve(env->reserve);
      break;
    case PD__ENVELOPE__BODY_PREFILL:
      on_local_prefill(env->prefill);
      break;
    case PD__ENVELOPE__BODY_ABORT: {
      dreq *r = find_by_id(env->abort->request_id);
      if (r) {
        if (r->state == D_RESERVED)
          send_kv_ack(r->prefill_rid, r->prefill_rid_len, r->id, r->reservation_id, false,
                      PD__ERROR_CODE__ERROR_CODE_ABORTED, "aborted");
        pd_sched_abort(n->rt.sched, r->sid);
        pd_log(PD_LOG_DEBUG, "%s: aborted", r->id);
        remove_req(r);
      }
      break;
    }
    case PD__ENVELOPE__BODY_ERROR:
      pd_log(PD_LOG_WARN, "router: error %d: %s", (int)env->error->code,
             env->error->message ? env->error->message : "");
      break;
    default:
      pd_log(PD_LOG_WARN, "unexpected %s from the router", pd_wire_body_name(env->body_case));
      break;
  }
}

static void on_router_reset(pd_node *n) {
  while (g.n_reqs > 0) {
    dreq *r = g.reqs[g.n_reqs - 1];
    pd_sched_abort(n->rt.sched, r->sid);
    remove_req(r);
  }
}

/* ---- the KV port ---- */

/* The reservation a KV message names, when it names one fully: request id, reservation id and
 * token (compared in constant time). The sender learns nothing from a refusal: every mismatch
 * is "no such reservation". */
static dreq *kv_reservation(const char *request_id, uint64_t reservation_id,
                            ProtobufCBinaryData token) {
  static const uint8_t none[PD_WIRE_TOKEN_BYTES];
  dreq *r = find_by_id(request_id);
  bool token_ok = pd_wire_token_eq(token, r ? r->token : none);
  return r && token_ok && r->state == D_RESERVED && r->reservation_id == reservation_id ? r
                                                                                        : NULL;
}

static void on_kv_header(const pd_net_msg *m, const Pd__KvTransferHeader *h) {
  pd_node *n = &g.node;
  dreq *r = kv_reservation(h->request_id, h->reservation_id, h->reservation_token);
  if (!r) {
    send_kv_ack(m->routing_id, m->routing_id_len, h->request_id, h->reservation_id, false,
                PD__ERROR_CODE__ERROR_CODE_NOT_FOUND, "no such reservation");
    return;
  }
  memcpy(r->prefill_rid, m->routing_id, m->routing_id_len);
  r->prefill_rid_len = m->routing_id_len;
  if (!r->t_first_kv) r->t_first_kv = pd_mono_s();
  if (h->draft && !r->dnb) {
    pd_metric_add(g.m_errors_kv, 1);
    fail_req(r, PD__ERROR_CODE__ERROR_CODE_PROTOCOL,
             "draft KV for a reservation without draft blocks");
    return;
  }
  const int32_t *want_ids = h->draft ? r->draft_blocks : r->blocks;
  const int want_nb = h->draft ? r->dnb : r->nb;
  if (h->n_block_ids != (size_t)want_nb ||
      memcmp(h->block_ids, want_ids, (size_t)want_nb * sizeof *want_ids) != 0) {
    pd_metric_add(g.m_errors_kv, 1);
    fail_req(r, PD__ERROR_CODE__ERROR_CODE_PROTOCOL,
             "KV header block ids differ from the reservation");
    return;
  }
  /* On a GPU (a backend with host_alloc) the frames, in ZeroMQ's pageable memory, are first
   * copied into the node's page-locked receive buffer, the copy fused with the CRC and spread
   * over the CRC pool's threads, so the unpack is ONE direct DMA of the whole message instead
   * of a memcpy per frame through the backend's bounce chunks on this thread. Otherwise (CPU
   * backend, over --kv-pinned-mb, host_alloc refused) the frames are unpacked where they are. */
  size_t total = 0;
  for (int i = 0; i < m->n_payload; i++) total += m->payload_len[i];
  void *rx = pd_node_kv_rx_buf(n, total);
  const bool has_crc = h->checksum_opt_case == PD__KV_TRANSFER_HEADER__CHECKSUM_OPT_CRC32;
  double t0 = pd_mono_s();
  if (has_crc || rx) {
    /* every frame of the message in one call, spread over --kv-crc-threads threads; with rx
     * this is also the copy into it (counted as work="checksum": one pass does both; without a
     * CRC in the header the result is just not checked) */
    const void *const *bufs = (const void *const *)m->payload;
    const uint32_t crc =
        rx ? pd_crcpool_copy_crc32v(n->kv_crc, 0, rx, bufs, m->payload_len, m->n_payload)
           : pd_crcpool_crc32v(n->kv_crc, 0, bufs, m->payload_len, m->n_payload);
    const double t1 = pd_mono_s();
    pd_metric_add(g.m_kv_check_s, t1 - t0);
    t0 = t1;
    if (has_crc && crc != h->crc32) {
      pd_metric_add(g.m_errors_kv, 1);
      fail_req(r, PD__ERROR_CODE__ERROR_CODE_PROTOCOL, "KV payload CRC-32 mismatch");
      return;
    }
  }
  pd_kv_slice s = {(int)h->layer_begin, (int)h->layer_end, (int)h->head_begin, (int)h->head_end};
  size_t off = 0;
  pd_err e = {0};
  const int n_bufs = rx ? 1 : m->n_payload; /* rx: the whole message as one range */
  for (int i = 0; i < n_bufs; i++) {
    const void *buf = rx ? rx : m->payload[i];
    const size_t len = rx ? total : m->payload_len[i];
    /* host pages: memcpy; device pages: kv_scatter from buf (pd_node_kv_unpack) */
    pd_status st = h->draft ? pd_node_draft_kv_unpack(n, &s, want_ids, want_nb, off, buf, len, &e)
                            : pd_node_kv_unpack(n, &s, want_ids, want_nb, off, buf, len, &e);
    if (st == PD_EBACKEND) { /* the device failed, not the message */
      pd_metric_add(g.m_errors_internal, 1);
      if (!pd_node_check_device(n)) fail_req(r, PD__ERROR_CODE__ERROR_CODE_INTERNAL, e.msg);
      return;
    }
    if (st != PD_OK) {
      pd_metric_add(g.m_errors_kv, 1);
      fail_req(r, PD__ERROR_CODE__ERROR_CODE_PROTOCOL, e.msg);
      return;
    }
    off += len;
  }
  pd_metric_add(g.m_kv_unpack_s, pd_mono_s() - t0);
  const pd_kv_pages *pg = h->draft ? &n->draft_pages : &n->pages;
  uint8_t *cov = h->draft ? r->draft_coverage : r->coverage;
  int H = pg->num_kv_heads, h0 = pg->head_offset;
  for (int l = s.layer_begin; l < s.layer_end; l++)
    for (int hh = s.head_begin; hh < s.head_end; hh++)
      if (hh >= h0 && hh < h0 + H) cov[(size_t)l * (size_t)H + (size_t)(hh - h0)] = 1;
  r->bytes += off;
  pd_metric_add(g.m_kv_bytes, (double)off);
}

static void on_kv_done(const pd_net_msg *m, const Pd__KvTransferDone *d) {
  pd_node *n = &g.node;
  dreq *r = kv_reservation(d->request_id, d->reservation_id, d->reservation_token);
  if (!r) {
    send_kv_ack(m->routing_id, m->routing_id_len, d->request_id, d->reservation_id, false,
                PD__ERROR_CODE__ERROR_CODE_NOT_FOUND, "no such reservation");
    return;
  }
  memcpy(r->prefill_rid, m->routing_id, m->routing_id_len);
  r->prefill_rid_len = m->routing_id_len;
  size_t cells = (size_t)n->pages.num_layers * (size_t)n->pages.num_kv_heads;
  for (size_t i = 0; i < cells; i++)
    if (!r->coverage[i]) {
      pd_metric_add(g.m_errors_kv, 1);
      fail_req(r, PD__ERROR_CODE__ERROR_CODE_PROTOCOL,
               "KV transfer done before every layer and head arrived");
      return;
    }
  if (d->n_tokens != (uint32_t)r->n_ctx) {
    pd_metric_add(g.m_errors_kv, 1);
    fail_req(r, PD__ERROR_CODE__ERROR_CODE_PROTOCOL, "KV transfer covers another token count");
    return;
  }
  pd_err e = {0};
  if (r->dnb) { /* the draft's pages too, when every layer and head of them came */
    size_t dcells = (size_t)n->draft_pages.num_layers * (size_t)n->draft_pages.num_kv_heads;
    bool all = true;
    for (size_t i = 0; i < dcells && all; i++) all = r->draft_coverage[i];
    if (all && pd_sched_draft_landed(n->rt.sched, r->sid, &e) != PD_OK) {
      pd_metric_add(g.m_errors_internal, 1);
      fail_req(r, PD__ERROR_CODE__ERROR_CODE_INTERNAL, e.msg);
      return;
    }
    pd_metric_add(all ? g.m_draft_kv_landed : g.m_draft_kv_missing, 1);
  }
  if (pd_sched_activate(n->rt.sched, r->sid, d->first_token_id, &e) != PD_OK) {
    pd_metric_add(g.m_errors_internal, 1);
    fail_req(r, PD__ERROR_CODE__ERROR_CODE_INTERNAL, e.msg);
    return;
  }
  send_kv_ack(r->prefill_rid, r->prefill_rid_len, r->id, r->reservation_id, true, 0, NULL);
  pd_metric_add(g.m_kv_transfers, 1);
  pd_metric_observe(g.m_kv_seconds, pd_mono_s() - r->t_first_kv);
  r->state = D_ACTIVE;
  r->n_generated = (uint32_t)r->n_gen_base + 1; /* the prefill node's token counts */
  /* pd_sched_activate drops a sequence that has nothing left to decode without an event
   * (the first token was a stop, or it reached max_tokens or the context): report it here */
  pd_finish_reason fin = pd_sampling_check_stop(&r->p, n->rt.eos, (size_t)n->rt.n_eos,
                                                d->first_token_id, (int32_t)r->n_generated);
  if (fin == PD_FINISH_NONE && r->n_ctx + 1 >= g.max_model_len) fin = PD_FINISH_LENGTH;
  if (fin != PD_FINISH_NONE) {
    r->finished = true;
    r->fin = fin;
    flush_tokens(r);
    remove_req(r);
    return;
  }
  pd_log(PD_LOG_DEBUG, "%s: KV landed (%llu bytes), decoding", r->id,
         (unsigned long long)r->bytes);
}

/* Reads the KV socket: everything queued, or, with budget_s > 0, until that much time has gone
 * into it (the rest stays queued for the next turn of the loop). */
static void kv_drain(double budget_s) {
  pd_net_msg m;
  pd_net_msg_init(&m);
  const double t0 = pd_mono_s();
  for (int k = 0; k < 10000; k++) {
    if (budget_s > 0 && k > 0 && pd_mono_s() - t0 > budget_s) break;
    bool got = false;
    pd_err e = {0};
    pd_status st = pd_net_recv(g.kv_sock, 0, &g.node.lim, &m, &got, &e);
    if (!got) {
      if (st != PD_OK) pd_log(PD_LOG_ERROR, "KV socket: %s", e.msg);
      break;
    }
    if (st != PD_OK) {
      pd_metric_add(g.m_errors_kv, 1);
      pd_log(PD_LOG_WARN, "malformed KV message: %s", e.msg);
      pd_net_send_error(g.kv_sock, m.routing_id, m.routing_id_len, pd_wire_error_code(st), NULL,
                        false, e.msg, NULL);
      continue;
    }
    const Pd__Envelope *env = m.wire.env;
    if (env->body_case == PD__ENVELOPE__BODY_KV_HEADER) on_kv_header(&m, env->kv_header);
    else if (env->body_case == PD__ENVELOPE__BODY_KV_DONE) on_kv_done(&m, env->kv_done);
    else pd_log(PD_LOG_WARN, "unexpected %s on the KV port", pd_wire_body_name(env->body_case));
  }
  pd_net_msg_clear(&m);
}

/* Reservations past their ttl: the transfer stalled (or the prefill node died). */
static void sweep_reservations(void) {
  int64_t now = pd_now_ms();
  for (int i = 0; i < g.n_reqs;) {
    dreq *r = g.reqs[i];
    if (r->state == D_RESERVED && now >= r->deadline_ms) {
      pd_metric_add(g.m_res_expired, 1);
      fail_req(r, PD__ERROR_CODE__ERROR_CODE_TIMEOUT,
               "the KV transfer did not complete before the reservation expired");
      continue; /* fail_req moved another entry to i */
    }
    i++;
  }
}

static void flush_all(void) {
  for (int i = 0; i < g.n_reqs;) {
    dreq *r = g.reqs[i];
    if (r->state == D_ACTIVE) {
      flush_tokens(r);
      if (r->finished) {
        remove_req(r);
        continue;
      }
    }
    i++;
  }
}

static void fail_active(const char *why) {
  pd_metric_add(g.m_errors_internal, 1);
  for (int i = 0; i < g.n_reqs;) {
    dreq *r = g.reqs[i];
    if (r->state == D_ACTIVE) {
      char msg[600];
      snprintf(msg, sizeof msg, "decode step failed: %s", why);
      fail_req(r, PD__ERROR_CODE__ERROR_CODE_INTERNAL, msg);
      continue;
    }
    i++;
  }
}

/* Ends the step in flight (begun at t0): waits for the device, reports its tokens. */
static void end_step(pd_node *n, double t0) {
  pd_err e = {0};
  if (pd_sched_step_end(n->rt.sched, &e) != PD_OK) {
    pd_log(PD_LOG_ERROR, "step failed: %s", e.msg);
    /* a failed device takes the node out of the cluster: the router moves its requests */
    if (!pd_node_check_device(n)) fail_active(e.msg);
  } else {
    pd_node_check_device(n);
  }
  g.last_step_s = pd_mono_s() - t0;
  pd_metric_observe(n->m_step_seconds, g.last_step_s);
  pd_node_update_metrics(n); /* O(1): scrapes see every step */
}

int main(int argc, char **argv) {
  pd_node_opts o;
  int rc = pd_node_opts_parse(&o, PD__ROLE__ROLE_DECODE, argc, argv);
  if (rc) return rc == 2 ? 0 : 1;
  pd_log_init("pd-decode", o.verbose);
  pd_node_install_signals();
  pd_node_tune_malloc(); /* KV frames stay on the heap (no page faults per frame) */
  pd_node_hooks hooks = {.fill_load = fill_load, .on_router_msg = on_router_msg,
                         .on_router_reset = on_router_reset};
  pd_err e = {0};
  pd_node *n = &g.node;
  if (pd_node_open(n, &o, PD__ROLE__ROLE_DECODE, on_event, NULL, &hooks, &e) != PD_OK) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    pd_node_close(n);
    return 1;
  }
  g.max_model_len = pd_engine_get_opts(n->rt.eng)->max_model_len;
  pd_metrics *m = n->metrics;
  g.m_requests = pd_metrics_counter(m, "pd_node_requests_total", "Reservations granted.", NULL);
  g.m_kv_bytes = pd_metrics_counter(m, "pd_node_kv_transfer_bytes_total",
                                    "KV page bytes received from prefill nodes.",
                                    "direction=\"received\"");
  g.m_kv_transfers = pd_metrics_counter(m, "pd_node_kv_transfers_total",
                                        "KV transfers completed.", "direction=\"received\"");
  g.m_kv_check_s = pd_metrics_counter(m, "pd_node_kv_loop_seconds_total",
                                      "Time the node's loop thread spent on KV pages.",
                                      "direction=\"received\",work=\"checksum\"");
  g.m_kv_unpack_s = pd_metrics_counter(m, "pd_node_kv_loop_seconds_total",
                                       "Time the node's loop thread spent on KV pages.",
                                       "direction=\"received\",work=\"unpack\"");
  g.m_kv_seconds = pd_metrics_histogram(m, "pd_node_kv_transfer_seconds",
                                        "From a request's first KV chunk to its KvTransferDone.",
                                        NULL, pd_metrics_fine_buckets,
                                        pd_metrics_fine_buckets_n);
  g.m_draft_kv_landed = pd_metrics_counter(
      m, "pd_node_draft_kv_transfers_total",
      "Transfers into reserved draft blocks, by whether the draft's KV came whole.",
      "outcome=\"landed\"");
  g.m_draft_kv_missing = pd_metrics_counter(
      m, "pd_node_draft_kv_transfers_total",
      "Transfers into reserved draft blocks, by whether the draft's KV came whole.",
      "outcome=\"missing\"");
  g.m_local_prefills = pd_metrics_counter(m, "pd_node_local_prefills_total",
                                          "Requests this unified node prefilled itself.", NULL);
  g.m_reserved = pd_metrics_gauge(m, "pd_node_kv_blocks_reserved",
                                  "KV blocks held by reservations whose pages have not landed.",
                                  NULL);
  g.m_res_refused = pd_metrics_counter(m, "pd_node_reservations_refused_total",
                                       "Reservations refused for lack of KV blocks.", NULL);
  g.m_res_expired = pd_metrics_counter(m, "pd_node_reservations_expired_total",
                                       "Reservations freed because their KV did not arrive.",
                                       NULL);
  g.m_errors_kv = pd_metrics_counter(m, "pd_node_errors_total", "Errors by kind.",
                                     "kind=\"kv_transfer\"");
  g.m_errors_internal = pd_metrics_counter(m, "pd_node_errors_total", "Errors by kind.",
                                           "kind=\"internal\"");
  g.m_errors_invalid = pd_metrics_counter(m, "pd_node_errors_total", "Errors by kind.",
                                          "kind=\"invalid_request\"");

  /* the KV port: CURVE server when this node has a keypair */
  pd_net_sock_opts so;
  pd_net_sock_opts_init(&so, ZMQ_ROUTER);
  so.rcvhwm = 100000;
  if (n->have_keys) {
    so.curve_keys = &n->keys;
    so.curve_server = true;
    so.zap_domain = n->auth ? "KV" : NULL; /* listed keys only (--curve-allow-file) */
    n->kv_curve = pd_curve_key_parse(n->keys.public_z85, n->kv_public_key, NULL, &e) == PD_OK;
  }
  g.kv_sock = pd_net_socket(n->zctx, &so, &e);
  char ep[256], bound[256];
  snprintf(ep, sizeof ep, "tcp://%s:%d", o.bind, o.kv_port);
  if (!g.kv_sock || pd_net_bind(g.kv_sock, ep, bound, sizeof bound, &e) != PD_OK ||
      (n->have_keys && !(g.kv_watch = pd_hs_watch_start(n->zctx, g.kv_sock, "KV", &e)))) {
    pd_log(PD_LOG_ERROR, "KV port %s: %s", ep, e.msg);
    pd_net_close(g.kv_sock);
    pd_node_close(n);
    return 1;
  }
  const char *colon = strrchr(bound, ':');
  const char *adv = o.advertise ? o.advertise
                    : (!strcmp(o.bind, "0.0.0.0") || !strcmp(o.bind, "*") || !strcmp(o.bind, "::"))
                        ? "127.0.0.1"
                        : o.bind;
  snprintf(n->kv_endpoint, sizeof n->kv_endpoint, "tcp://%s:%s", adv, colon ? colon + 1 : "0");
  pd_log(PD_LOG_INFO,
         "decode node %s: model %s (%d blocks of %d tokens), KV port %s, router %s, metrics %d",
         n->node_id, n->model_name, n->pages.num_blocks, n->pages.block_size, n->kv_endpoint,
         o.router_ep, pd_metrics_server_port(n->metrics_srv));

  /* A step is begun (scheduled, its forward pass queued on the device), the sockets are read
   * while the device computes (requests, aborts, KV pages), and the step is ended (waited for,
   * its tokens sent) on the next turn of the loop, before the next one is begun. */
  /* While sequences decode, a turn of the loop spends at most about one step's time (2-20 ms)
   * on received KV pages (checksums, copies into the cache), so that a burst of finished
   * prefills lands over several steps instead of stalling every running sequence until all of
   * it is in. --kv-budget-ms N sets N ms instead; 0 takes everything queued each turn. */
  const double kv_budget_fixed = o.kv_budget_ms >= 0.0 ? o.kv_budget_ms / 1000.0 : -1.0;
  pd_sched *sched = n->rt.sched;
  int64_t next_metrics = 0;
  double step_t0 = 0;
  while (!pd_node_stop_flag) {
    int64_t wait = pd_node_tick(n);
    if (pd_sched_has_work(sched) || pd_sched_step_in_flight(sched)) wait = 0;
    if (wait > 50) wait = 50;
    zmq_pollitem_t items[2] = {{n->router_sock, 0, ZMQ_POLLIN, 0}, {g.kv_sock, 0, ZMQ_POLLIN, 0}};
    zmq_poll(items, 2, (long)wait);
    pd_node_drain_router(n);
    double kv_budget = 0.0; /* everything queued */
    if (pd_sched_step_in_flight(sched) || pd_sched_has_work(sched)) {
      kv_budget = g.last_step_s < 0.002 ? 0.002 : g.last_step_s > 0.02 ? 0.02 : g.last_step_s;
      if (kv_budget_fixed >= 0.0) kv_budget = kv_budget_fixed;
    }
    kv_drain(kv_budget);
    sweep_reservations();
    bool acted = false;
    if (pd_sched_step_in_flight(sched)) {
      end_step(n, step_t0);
      flush_all(); /* its tokens go out before the next step is begun */
      pd_outbox_flush(&n->router);
      acted = true;
    }
    if (pd_sched_has_work(sched)) {
      bool started = false;
      step_t0 = pd_mono_s();
      if (pd_sched_step_begin(sched, &started, &e) != PD_OK) {
        pd_log(PD_LOG_ERROR, "step failed: %s", e.msg);
        if (!pd_node_check_device(n)) fail_active(e.msg);
      }
      acted = true;
    }
    if (acted) { /* (the failures of a step that could not begin, or a whole step's tokens) */
      flush_all();
      pd_outbox_flush(&n->router);
    }
    if (pd_now_ms() >= next_metrics) {
      pd_node_update_metrics(n);
      pd_hs_watch_drain(g.kv_watch, &n->deny_log);
      next_metrics = pd_now_ms() + 250;
    }
  }
  const bool dead = n->device_failed; /* deregistered already; nothing it computes counts */
  if (!dead && pd_sched_step_in_flight(sched)) {
    end_step(n, step_t0);
    flush_all();
    pd_outbox_flush(&n->router);
  }
  pd_log(PD_LOG_INFO, "shutting down");
  if (!dead) pd_node_deregister(n, "shutdown", 500);
  on_router_reset(n);
  free(g.reqs);
  pd_hs_watch_stop(g.kv_watch);
  pd_net_close(g.kv_sock);
  pd_node_close(n);
  return dead ? PD_NODE_EXIT_DEVICE : 0;
}
