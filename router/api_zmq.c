/* The router's ZeroMQ client API (docs/api.md, proto GenerateRequest / GenerateChunk /
 * CancelRequest): clients connect a DEALER to the client port and send GenerateRequests; the
 * router answers with GenerateChunks on the same connection (a stream of deltas, or one chunk
 * per choice when stream = false; usage on the request's last chunk). A client that goes away
 * is noticed when a send to it fails (the ROUTER socket refuses unknown peers), or by the
 * request deadline; CancelRequest ends a request at once (only the connection's own requests).
 * With an API key (--api-key) every GenerateRequest must carry it (api_key): without it the
 * request is refused with UNAUTHORIZED before anything else of it is looked at. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router.h"

static void zkey(const uint8_t *rid, size_t n, const char *id, char *out, size_t cap) {
  size_t j = 0;
  static const char hx[] = "0123456789abcdef";
  for (size_t i = 0; i < n && j + 3 < cap; i++) {
    out[j++] = hx[rid[i] >> 4];
    out[j++] = hx[rid[i] & 15];
  }
  snprintf(out + j, cap - j, "/%s", id);
}

static void send_chunk(router *r, rreq *q, Pd__GenerateChunk *c) {
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_CHUNK;
  env.chunk = c;
  env.sender = "router";
  env.seq = ++r->seq;
  pd_err e = {0};
  pd_status st = pd_net_send(r->client_sock, q->zrid, q->zrid_len, &env, NULL, 0, &e);
  router_after_send(r);
  if (st != PD_OK && !q->cancelled) {
    /* the client is gone (or not reading): end the request at the next safe point */
    pd_log(PD_LOG_INFO, "%s: client unreachable (%s): cancelling", q->id, e.msg);
    q->cancelled = true;
  }
}

static void refuse(router *r, const uint8_t *rid, size_t rid_len, const char *id,
                   Pd__ErrorCode code, const char *msg) {
  Pd__Error err;
  pd__error__init(&err);
  err.code = code;
  err.message = (char *)msg;
  err.request_id = (char *)(pd_wire_id_ok(id) ? id : "");
  Pd__GenerateChunk c;
  pd__generate_chunk__init(&c);
  c.request_id = (char *)(pd_wire_id_ok(id) ? id : "unknown");
  c.finish_reason = PD__FINISH_REASON__FINISH_REASON_ERROR;
  c.error = &err;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_CHUNK;
  env.chunk = &c;
  env.sender = "router";
  pd_err e = {0};
  pd_net_send(r->client_sock, rid, rid_len, &env, NULL, 0, &e);
  router_after_send(r);
  rmetrics_request(r, "zmq", api_http_status(code));
  rmetrics_error(r, api_error_code_str(code));
}

/* Deep copy of the sampling parameters into q->op (the message is freed after this call). */
static bool copy_params(rreq *q, const pd_sampling_params *p) {
  q->op.p = *p;
  if (p->n_logit_bias) {
    q->op.logit_bias = malloc(p->n_logit_bias * sizeof *q->op.logit_bias);
    if (!q->op.logit_bias) return false;
    memcpy(q->op.logit_bias, p->logit_bias, p->n_logit_bias * sizeof *q->op.logit_bias);
    q->op.p.logit_bias = q->op.logit_bias;
  }
  if (p->n_stop_token_ids) {
    q->op.stop_token_ids = malloc(p->n_stop_token_ids * sizeof *q->op.stop_token_ids);
    if (!q->op.stop_token_ids) return false;
    memcpy(q->op.stop_token_ids, p->stop_token_ids,
           p->n_stop_token_ids * sizeof *q->op.stop_token_ids);
    q->op.p.stop_token_ids = q->op.stop_token_ids;
  }
  return true;
}

/* The error code for a refusal with HTTP status st. */
static Pd__ErrorCode refusal_code(int st, const char *code) {
  if (code && !strcmp(code, "context_length_exceeded")) return PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG;
  switch (st) {
    case 404: return PD__ERROR_CODE__ERROR_CODE_NOT_FOUND;
    case 429:
    case 503: return PD__ERROR_CODE__ERROR_CODE_OVERLOADED;
    case 500: return PD__ERROR_CODE__ERROR_CODE_INTERNAL;
    default: return PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST;
  }
}

/* Refuses q (registered or not) and lets it go. */
static void refuse_req(router *r, rreq *q, int st, const char *msg, const char *code) {
  refuse(r, q->zrid, q->zrid_len, q->client_id, refusal_code(st, code),
         msg[0] ? msg : "out of memory");
  q->finished = true;
  router_retire(r, q);
}

/* The prompt into p: text (copied: the message is freed after this call), token ids or chat
 * messages. 0 or an HTTP status with msg. */
static int prompt_input(api_prep *p, const Pd__GenerateRequest *g, char *msg, size_t cap) {
  if (g->prompt && *g->prompt) {
    size_t n = strlen(g->prompt);
    const char *t = api_prep_keep(p, g->prompt, n);
    return t && api_prep_text(p, t, n, false) ? 0 : 500;
  }
  if (g->n_prompt_token_ids) {
    int32_t *ids = malloc(g->n_prompt_token_ids * sizeof *ids);
    if (!ids) return 500;
    memcpy(ids, g->prompt_token_ids, g->n_prompt_token_ids * sizeof *ids);
    return api_prep_ids(p, ids, (int)g->n_prompt_token_ids) ? 0 : 500;
  }
  pd_chat_msg *msgs = calloc(g->n_messages ? g->n_messages : 1, sizeof *msgs);
  if (!msgs) return 500;
  for (size_t i = 0; i < g->n_messages; i++) {
    const char *role = g->messages[i]->role, *content = g->messages[i]->content;
    msgs[i].role = api_prep_keep(p, role, strlen(role));
    msgs[i].content = api_prep_keep(p, content, strlen(content));
    if (!msgs[i].role || !msgs[i].content) {
      free(msgs);
      return 500;
    }
  }
  return api_prep_chat(p, msgs, (int)g->n_messages, true, g->continue_final_message, false, msg,
                       cap);
}

static void on_generate(router *r, const pd_net_msg *m, const Pd__GenerateRequest *g) {
  char id[PD_WIRE_ID_MAX_BYTES + 1];
  if (!api_key_ok(r, g->api_key)) { /* before anything else is looked at */
    refuse(r, m->routing_id, m->routing_id_len, g->request_id,
           PD__ERROR_CODE__ERROR_CODE_UNAUTHORIZED, "Invalid or missing API key");
    return;
  }
  rreq *q = api_req_new(r, API_ZMQ);
  if (!q) {
    refuse(r, m->routing_id, m->routing_id_len, g->request_id,
           PD__ERROR_CODE__ERROR_CODE_INTERNAL, "out of memory");
    return;
  }
  snprintf(id, sizeof id, "%s", g->request_id && *g->request_id ? g->request_id : q->id);
  memcpy(q->zrid, m->routing_id, m->routing_id_len);
  q->zrid_len = m->routing_id_len;
  snprintf(q->client_id, sizeof q->client_id, "%s", id);
  char key[2 * PD_NET_ROUTING_ID_MAX + PD_WIRE_ID_MAX_BYTES + 4];
  zkey(m->routing_id, m->routing_id_len, id, key, sizeof key);
  char err[1024] = "";
  const char *code = NULL;
  int st = 0;
  if (pd_map_ptr(pd_map_cstr_find(&r->zreqs, key))) {
    snprintf(err, sizeof err, "request id %s is already in use on this connection", id);
    st = 400;
  }
  if (!st && g->model && *g->model && strcmp(g->model, r->model_name)) {
    snprintf(err, sizeof err, "The model `%.200s` does not exist.", g->model);
    st = 404;
  }
  pd_logit_bias *bias = NULL;
  if (!st) {
    size_t nb = g->sampling ? g->sampling->n_logit_bias : 0;
    bias = calloc(nb ? nb : 1, sizeof *bias);
    pd_sampling_params p;
    pd_err e = {0};
    Pd__SamplingParams defaults = PD__SAMPLING_PARAMS__INIT;
    if (!bias) {
      st = 500;
    } else if (pd_wire_sampling_params(g->sampling ? g->sampling : &defaults, &p, bias,
                                       nb ? nb : 1, &e) != PD_OK) {
      snprintf(err, sizeof err, "%s", e.msg);
      st = 400;
    } else {
      const Pd__SamplingParams *sp = g->sampling;
      /* the same refusals as over HTTP (vLLM's): alternatives without logprobs asked for are
       * a mistake worth saying, not something to ignore */
      if (p.n > r->o.max_n) {
        snprintf(err, sizeof err, "n must be at most %d (--max-n)", r->o.max_n);
        st = 400;
      } else if (sp && sp->top_logprobs && !sp->logprobs) {
        snprintf(err, sizeof err, "when using top_logprobs, logprobs must be set to true");
        st = 400;
      } else if (sp && sp->prompt_top_logprobs && !sp->prompt_logprobs) {
        snprintf(err, sizeof err,
                 "when using prompt_top_logprobs, prompt_logprobs must be set to true");
        st = 400;
      } else if (!copy_params(q, &p)) {
        st = 500;
      }
    }
  }
  free(bias);
  if (!st && g->sampling) {
    const Pd__SamplingParams *sp = g->sampling;
    q->stop = calloc(sp->n_stop ? sp->n_stop : 1, sizeof *q->stop);
    if (!q->stop) st = 500;
    for (size_t i = 0; !st && i < sp->n_stop; i++) {
      if (!sp->stop[i][0]) {
        snprintf(err, sizeof err, "stop strings must not be empty");
        st = 400;
        break;
      }
      q->stop[q->n_stop++] = strdup(sp->stop[i]);
    }
    q->include_stop_str = sp->include_stop_str_in_output;
  }
  api_prep *p = NULL;
  if (!st) {
    q->stream = g->stream;
    q->include_usage = g->include_usage || !g->stream;
    q->skip_special = !g->keep_special_tokens;
    q->lp_top = q->op.p.logprobs;
    q->want_prompt_lp = q->op.p.prompt_logprobs >= 0;
    q->timeout_ms = g->timeout_ms;
    if (g->cache_salt && *g->cache_salt) {
      snprintf(q->cache_salt_str, sizeof q->cache_salt_str, "%s", g->cache_salt);
      q->cache_salt = pd_kv_cache_salt(g->cache_salt);
    }
    p = api_prep_new(r, q, refuse_req);
    st = p ? prompt_input(p, g, err, sizeof err) : 500;
  }
  /* registered before the prompt is made, so that a CancelRequest finds it meanwhile */
  if (!st && !pd_map_cstr_put(&r->zreqs, key, (uintptr_t)q)) st = 500;
  if (!st) {
    st = api_prep_submit(p, err, sizeof err, &code);
    if (!st) return; /* it goes on from the pool (perhaps already did) */
    p = NULL;
  }
  api_prep_free(p);
  refuse_req(r, q, st, err, code);
}

void zapi_forget(router *r, rreq *q) {
  char key[2 * PD_NET_ROUTING_ID_MAX + PD_WIRE_ID_MAX_BYTES + 4];
  zkey(q->zrid, q->zrid_len, q->client_id, key, sizeof key);
  if (pd_map_ptr(pd_map_cstr_find(&r->zreqs, key)) == q) pd_map_cstr_del(&r->zreqs, key);
}

static void on_cancel(router *r, const pd_net_msg *m, const Pd__CancelRequest *c) {
  char key[2 * PD_NET_ROUTING_ID_MAX + PD_WIRE_ID_MAX_BYTES + 4];
  zkey(m->routing_id, m->routing_id_len, c->request_id, key, sizeof key);
  rreq *q = pd_map_ptr(pd_map_cstr_find(&r->zreqs, key));
  if (!q || q->finished) return;
  /* the client gets a last chunk per unfinished choice (ABORT), then the request is gone; a
   * request whose prompt is still being made has no choices yet: one chunk for index 0 */
  for (int i = 0; i < q->n_subs || (i == 0 && q->prep); i++) {
    if (q->n_subs && q->subs[i].finished) continue;
    Pd__GenerateChunk ch;
    pd__generate_chunk__init(&ch);
    ch.request_id = q->client_id;
    ch.index = (uint32_t)i;
    ch.finish_reason = PD__FINISH_REASON__FINISH_REASON_ABORT;
    Pd__Error err;
    pd__error__init(&err);
    err.code = PD__ERROR_CODE__ERROR_CODE_ABORTED;
    err.message = "cancelled by the client";
    err.request_id = q->client_id;
    ch.error = &err;
    send_chunk(r, q, &ch);
  }
  zapi_forget(r, q);
  api_cancel(r, q);
}

void zapi_on_message(router *r, const pd_net_msg *m) {
  const Pd__Envelope *env = m->wire.env;
  if (env->body_case == PD__ENVELOPE__BODY_GENERATE) on_generate(r, m, env->generate);
  else if (env->body_case == PD__ENVELOPE__BODY_CANCEL) on_cancel(r, m, env->cancel);
  else
    pd_net_send_error(r->client_sock, m->routing_id, m->routing_id_len,
                      PD__ERROR_CODE__ERROR_CODE_PROTOCOL, NULL, false,
                      "the client port takes GenerateRequest and CancelRequest only", NULL);
  router_after_send(r);
}

/* Logprobs with token bytes, for a chunk. */
typedef struct lp_buf {
  Pd__TokenLogprob *lp;
  Pd__TokenLogprob **lpp;
  Pd__TopLogprob *top;
  Pd__TopLogprob **topp;
  char **strs;
  int n_strs;
} lp_buf;

static void lp_fill(router *r, const pd_logprobs *lps, int n, lp_buf *b, int top_max) {
  memset(b, 0, sizeof *b);
  if (!lps || n <= 0) return;
  b->lp = calloc((size_t)n, sizeof *b->lp);
  b->lpp = calloc((size_t)n, sizeof *b->lpp);
  b->top = calloc((size_t)n * PD_SAMPLE_MAX_LOGPROBS, sizeof *b->top);
  b->topp = calloc((size_t)n * PD_SAMPLE_MAX_LOGPROBS, sizeof *b->topp);
  b->strs = calloc((size_t)n * (PD_SAMPLE_MAX_LOGPROBS + 1), sizeof *b->strs);
  if (!b->lp || !b->lpp || !b->top || !b->topp || !b->strs) return;
  for (int i = 0; i < n; i++) {
    Pd__TokenLogprob *l = &b->lp[i];
    pd__token_logprob__init(l);
    l->token_id = lps[i].token;
    l->logprob = lps[i].logprob;
    l->rank = (uint32_t)(lps[i].rank > 0 ? lps[i].rank : 1);
    char *t = token_str(r, lps[i].token);
    b->strs[b->n_strs++] = t;
    l->token_bytes.data = (uint8_t *)t;
    l->token_bytes.len = t ? strlen(t) : 0;
    int k = lps[i].n_top < top_max ? lps[i].n_top : top_max;
    for (int j = 0; j < k; j++) {
      Pd__TopLogprob *tp = &b->top[i * PD_SAMPLE_MAX_LOGPROBS + j];
      pd__top_logprob__init(tp);
      tp->token_id = lps[i].top[j].id;
      tp->logprob = lps[i].top[j].logprob;
      char *tt = token_str(r, lps[i].top[j].id);
      b->strs[b->n_strs++] = tt;
      tp->token_bytes.data = (uint8_t *)tt;
      tp->token_bytes.len = tt ? strlen(tt) : 0;
      b->topp[i * PD_SAMPLE_MAX_LOGPROBS + j] = tp;
    }
    l->n_top = (size_t)k;
    l->top = k ? &b->topp[i * PD_SAMPLE_MAX_LOGPROBS] : NULL;
    b->lpp[i] = l;
  }
}

static void lp_buf_free(lp_buf *b) {
  for (int i = 0; i < b->n_strs; i++) free(b->strs[i]);
  free(b->strs);
  free(b->lp);
  free(b->lpp);
  free(b->top);
  free(b->topp);
}

static Pd__Usage *usage_of(rreq *q, Pd__Usage *u) {
  pd__usage__init(u);
  for (int i = 0; i < q->n_prompts; i++) {
    u->prompt_tokens += (uint32_t)q->prompts[i].n;
    u->cached_tokens += q->subs[i * q->n_per_prompt].cached_tokens;
  }
  for (int i = 0; i < q->n_subs; i++) u->completion_tokens += (uint32_t)q->subs[i].n_out_tokens;
  return u;
}

void zapi_tokens(router *r, rsub *s, size_t off, size_t len, const int32_t *ids,
                 const pd_logprobs *lps, int n) {
  rreq *q = s->req;
  if (!q->stream) {
    if (q->lp_top >= 0 && lps && n > 0) {
      if (s->n_lp_store + n > s->cap_lp_store) {
        int cap = s->cap_lp_store ? s->cap_lp_store : 64;
        while (cap < s->n_lp_store + n) cap *= 2;
        pd_logprobs *v = realloc(s->lp_store, (size_t)cap * sizeof *v);
        if (!v) return;
        s->lp_store = v;
        s->cap_lp_store = cap;
      }
      memcpy(s->lp_store + s->n_lp_store, lps, (size_t)n * sizeof *lps);
      s->n_lp_store += n;
    }
    return;
  }
  if (!n && !len) return;
  Pd__GenerateChunk c;
  pd__generate_chunk__init(&c);
  c.request_id = q->client_id;
  c.index = (uint32_t)s->index;
  c.n_token_ids = (size_t)n;
  c.token_ids = (int32_t *)ids;
  char *t = malloc(len + 1);
  if (t) {
    memcpy(t, s->text + off, len);
    t[len] = 0;
  }
  c.text = t ? t : "";
  lp_buf b;
  lp_fill(r, q->lp_top >= 0 ? lps : NULL, n, &b, q->lp_top);
  if (b.lpp && q->lp_top >= 0 && lps && n > 0) {
    c.n_logprobs = (size_t)n;
    c.logprobs = b.lpp;
  }
  send_chunk(r, q, &c);
  lp_buf_free(&b);
  free(t);
}

void zapi_sub_done(router *r, rsub *s) {
  rreq *q = s->req;
  Pd__GenerateChunk c;
  pd__generate_chunk__init(&c);
  c.request_id = q->client_id;
  c.index = (uint32_t)s->index;
  lp_buf b;
  memset(&b, 0, sizeof b);
  if (!q->stream) { /* everything in one chunk */
    c.n_token_ids = (size_t)s->n_out_tokens;
    c.token_ids = s->gen;
    c.text = s->text ? s->text : "";
    if (q->lp_top >= 0 && s->n_lp_store) {
      int n = s->n_lp_store < s->n_out_tokens ? s->n_lp_store : s->n_out_tokens;
      lp_fill(r, s->lp_store, n, &b, q->lp_top);
      if (b.lpp && n == s->n_out_tokens) {
        c.n_logprobs = (size_t)n;
        c.logprobs = b.lpp;
      }
    }
  }
  const char *f = s->finish_reason ? s->finish_reason : "length";
  Pd__Error err;
  if (!strcmp(f, "error")) {
    c.finish_reason = PD__FINISH_REASON__FINISH_REASON_ERROR;
    pd__error__init(&err);
    err.code = s->err_code;
    err.message = s->err_msg;
    err.request_id = q->client_id;
    c.error = &err;
  } else if (!strcmp(f, "stop")) {
    c.finish_reason = PD__FINISH_REASON__FINISH_REASON_STOP;
    if (s->stop_string) {
      c.stop_reason_case = PD__GENERATE_CHUNK__STOP_REASON_STOP_STRING;
      c.stop_string = s->stop_string;
    } else if (s->stop_token >= 0) {
      c.stop_reason_case = PD__GENERATE_CHUNK__STOP_REASON_STOP_TOKEN_ID;
      c.stop_token_id = s->stop_token;
    }
  } else if (!strcmp(f, "abort")) {
    c.finish_reason = PD__FINISH_REASON__FINISH_REASON_ABORT;
  } else {
    c.finish_reason = PD__FINISH_REASON__FINISH_REASON_LENGTH;
  }
  Pd__Usage u;
  if (q->include_usage && q->n_done == q->n_subs) c.usage = usage_of(q, &u);
  send_chunk(r, q, &c);
  lp_buf_free(&b);
}

void zapi_req_done(router *r, rreq *q) {
  int status = 200;
  for (int i = 0; i < q->n_subs; i++)
    if (q->subs[i].err_code) status = api_http_status(q->subs[i].err_code);
  rmetrics_request(r, "zmq", status);
  zapi_forget(r, q);
}
