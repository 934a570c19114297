/* The router's HTTP API (docs/api.md): OpenAI completions and chat completions (streamed as
 * Server-Sent Events or not), vLLM's legacy POST /generate, /tokenize, /detokenize and
 * /version, GET /v1/models[/{id}], /health, /metrics, /cluster/nodes. Bodies are parsed by the
 * strict JSON parser (pd/json.h) and validated here, tokenized (chat template for messages),
 * fanned out into choices (route.c) and answered from the output hooks below. A refusal names
 * the parameter at fault in the error's "param", as OpenAI's API does. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "pd/json.h"
#include "router.h"

/* ---- errors ---- */

int api_http_status(Pd__ErrorCode c) {
  switch (c) {
    case PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST:
    case PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG:
    case PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED: return 400;
    case PD__ERROR_CODE__ERROR_CODE_NOT_FOUND: return 404;
    case PD__ERROR_CODE__ERROR_CODE_OVERLOADED: return 503;
    case PD__ERROR_CODE__ERROR_CODE_TIMEOUT: return 504;
    case PD__ERROR_CODE__ERROR_CODE_NODE_FAILED: return 502;
    case PD__ERROR_CODE__ERROR_CODE_ABORTED: return 499;
    case PD__ERROR_CODE__ERROR_CODE_UNAUTHORIZED: return 401;
    default: return 500;
  }
}

const char *api_error_code_str(Pd__ErrorCode c) {
  switch (c) {
    case PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST: return "invalid_request";
    case PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG: return "context_length_exceeded";
    case PD__ERROR_CODE__ERROR_CODE_NOT_FOUND: return "not_found";
    case PD__ERROR_CODE__ERROR_CODE_OVERLOADED: return "overloaded";
    case PD__ERROR_CODE__ERROR_CODE_TIMEOUT: return "timeout";
    case PD__ERROR_CODE__ERROR_CODE_NODE_FAILED: return "node_failed";
    case PD__ERROR_CODE__ERROR_CODE_ABORTED: return "aborted";
    case PD__ERROR_CODE__ERROR_CODE_PROTOCOL: return "protocol";
    case PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED: return "unsupported";
    case PD__ERROR_CODE__ERROR_CODE_UNAUTHORIZED: return "invalid_api_key";
    default: return "internal";
  }
}

static const char *api_name(api_kind k) {
  switch (k) {
    case API_COMPLETIONS: return "completions";
    case API_CHAT: return "chat";
    case API_GENERATE: return "generate";
    case API_TOKENIZE: return "tokenize";
    case API_DETOKENIZE: return "detokenize";
    default: return "zmq";
  }
}

static void respond_json(pd_http_req *req, int status, cJSON *o, const char *rid) {
  char *text = cJSON_PrintUnformatted(o);
  pd_http_header h[1] = {{"X-Request-Id", rid ? rid : ""}};
  if (text) pd_http_respond(req, status, "application/json", h, rid ? 1 : 0, text, strlen(text), NULL);
  else pd_http_respond_error(req, 500, "out of memory", NULL, NULL, NULL);
  free(text);
}

/* An OpenAI-style error answer; param (NULL or "": null) names the request field at fault. */
static void respond_err(router *r, pd_http_req *req, api_kind kind, int status, const char *msg,
                        const char *code, const char *param) {
  char *body = pd_http_error_json(msg, pd_http_error_type(status), code, param);
  if (body) pd_http_respond(req, status, "application/json", NULL, 0, body, strlen(body), NULL);
  else pd_http_respond_error(req, 500, "out of memory", NULL, NULL, NULL);
  free(body);
  rmetrics_request(r, api_name(kind), status);
  if (status >= 400) rmetrics_error(r, status == 400   ? "invalid_request"
                                       : status == 401 ? "auth"
                                       : status == 404 ? "not_found"
                                       : status == 429 ? "queue_full"
                                       : status == 503 ? "overloaded"
                                                       : "internal");
}

/* 405 with the Allow header RFC 9110 asks for (what Starlette answers for a route that exists
 * with other methods). */
static void respond_405(pd_http_req *req, const char *allow) {
  char *body = pd_http_error_json("Method Not Allowed", pd_http_error_type(405), NULL, NULL);
  pd_http_header h[1] = {{"Allow", allow}};
  pd_http_respond(req, 405, "application/json", h, 1, body ? body : "", body ? strlen(body) : 0,
                  NULL);
  free(body);
}

/* Fills a refusal of q: its message and the parameter at fault; returns status. */
__attribute__((format(printf, 6, 7))) static int refuse_param(rreq *q, char *msg, size_t cap,
                                                              int status, const char *param,
                                                              const char *fmt, ...) {
  snprintf(q->err_param, sizeof q->err_param, "%s", param ? param : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, cap, fmt, ap);
  va_end(ap);
  return status;
}

/* ---- request objects ---- */

rreq *api_req_new(router *r, api_kind kind) {
  rreq *q = calloc(1, sizeof *q);
  if (!q) return NULL;
  pd_err e = {0};
  if (pd_wire_random_hex(q->wire, &e) != PD_OK) { /* the nodes' name for it: unguessable */
    pd_log(PD_LOG_ERROR, "a new request's id: %s", e.msg);
    free(q);
    return NULL;
  }
  q->r = r;
  q->kind = kind;
  q->num = ++r->next_req;
  q->lp_top = -1;
  q->skip_special = true;
  q->t_start = pd_now_ms();
  q->created = floor(pd_wall_s());
  uint64_t rnd = 0;
  if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd) rnd = (uint64_t)q->t_start * 2654435761u;
  snprintf(q->id, sizeof q->id, "%s-%016llx%04llx",
           kind == API_CHAT ? "chatcmpl" : kind == API_ZMQ ? "gen" : "cmpl",
           (unsigned long long)rnd, (unsigned long long)(q->num & 0xffff));
  q->next_all = r->all;
  if (r->all) r->all->prev_all = q;
  r->all = q;
  r->n_live++;
  return q;
}

void api_req_free(router *r, rreq *q) {
  api_prep_detach(q);
  if (q->kind == API_ZMQ) zapi_forget(r, q);
  if (q->prev_all) q->prev_all->next_all = q->next_all;
  else if (r->all == q) r->all = q->next_all;
  if (q->next_all) q->next_all->prev_all = q->prev_all;
  for (int i = 0; i < q->n_subs; i++) {
    rsub *s = &q->subs[i];
    if (s->state != SUB_DONE) route_sub_stop(r, s);
    text_free(s);
    free(s->gen);
    free(s->blocks);
    free(s->draft_blocks);
  }
  free(q->subs);
  for (int i = 0; i < q->n_prompts; i++) {
    free(q->prompts[i].ids);
    free(q->prompts[i].text);
  }
  free(q->prompts);
  for (int i = 0; i < q->n_stop; i++) free(q->stop[i]);
  free(q->stop);
  if (q->wire_sp) {
    for (size_t i = 0; i < q->wire_sp->n_logit_bias; i++) free(q->wire_sp->logit_bias[i]);
    free(q->wire_sp->logit_bias);
    free(q->wire_sp);
  }
  pd_oai_params_free(&q->op);
  api_http_release(q);
  r->n_live--;
  free(q);
}

void api_http_release(rreq *q) {
  if (!q->http) return;
  pd_http_req_on_cancel(q->http, NULL, NULL);
  pd_http_req_unref(q->http);
  q->http = NULL;
}

void api_cancel(router *r, rreq *q) {
  if (q->finished) return;
  q->cancelled = true;
  for (int i = 0; i < q->n_subs; i++) {
    rsub *s = &q->subs[i];
    if (s->finished) continue;
    route_sub_stop(r, s);
    s->finished = true;
    s->finish_reason = "abort";
  }
  q->finished = true;
  rmetrics_request(r, api_name(q->kind), 499);
  rmetrics_error(r, "aborted");
  router_retire(r, q);
}

static Pd__SamplingParams *wire_params(const pd_sampling_params *p) {
  Pd__SamplingParams *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  pd__sampling_params__init(w);
  w->temperature_opt_case = PD__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE;
  w->temperature = p->temperature;
  w->top_p = p->top_p;
  w->top_k = p->top_k;
  w->min_p = p->min_p;
  w->seed_opt_case = PD__SAMPLING_PARAMS__SEED_OPT_SEED;
  w->seed = p->seed;
  w->max_tokens = p->max_tokens > 0 ? (uint32_t)p->max_tokens : 0;
  w->min_tokens = p->min_tokens > 0 ? (uint32_t)p->min_tokens : 0;
  w->n_stop_token_ids = p->n_stop_token_ids;
  w->stop_token_ids = (int32_t *)p->stop_token_ids;
  w->n = 1;
  w->logprobs = p->logprobs >= 0;
  w->top_logprobs = p->logprobs > 0 ? (uint32_t)p->logprobs : 0;
  w->prompt_logprobs = p->prompt_logprobs >= 0;
  w->prompt_top_logprobs = p->prompt_logprobs > 0 ? (uint32_t)p->prompt_logprobs : 0;
  w->presence_penalty = p->presence_penalty;
  w->frequency_penalty = p->frequency_penalty;
  w->repetition_penalty = p->repetition_penalty;
  w->ignore_eos = p->ignore_eos;
  if (p->n_logit_bias) {
    w->logit_bias = calloc(p->n_logit_bias, sizeof *w->logit_bias);
    if (!w->logit_bias) {
      free(w);
      return NULL;
    }
    for (size_t i = 0; i < p->n_logit_bias; i++) {
      Pd__SamplingParams__LogitBiasEntry *e = calloc(1, sizeof *e);
      if (!e) {
        w->n_logit_bias = i;
        return w; /* partial; freed with the request */
      }
      pd__sampling_params__logit_bias_entry__init(e);
      e->key = p->logit_bias[i].id;
      e->value = p->logit_bias[i].bias;
      w->logit_bias[i] = e;
      w->n_logit_bias = i + 1;
    }
  }
  return w;
}

int api_req_prepare(router *r, rreq *q, char *msg, size_t cap, const char **code) {
  *code = NULL;
  int ctx = registry_max_model_len(r);
  pd_sampling_params *p = &q->op.p;
  const char *input = q->kind == API_CHAT ? "messages" : "prompt";
  if (q->n_prompts < 1) return refuse_param(q, msg, cap, 400, input, "the prompt must not be empty");
  int longest = 0;
  for (int i = 0; i < q->n_prompts; i++) {
    if (q->prompts[i].n < 1)
      return refuse_param(q, msg, cap, 400, input, "the prompt must not be empty (it has no tokens)");
    for (int k = 0; k < q->prompts[i].n; k++)
      if (q->prompts[i].ids[k] < 0 || q->prompts[i].ids[k] >= r->vocab_size)
        return refuse_param(q, msg, cap, 400, input,
                            "token id %d is outside the vocabulary [0, %d)", q->prompts[i].ids[k],
                            r->vocab_size);
    if (q->prompts[i].n > longest) longest = q->prompts[i].n;
  }
  if (p->max_tokens < 0) p->max_tokens = ctx - longest;
  if (p->max_tokens < 1 || longest + p->max_tokens > ctx) {
    *code = "context_length_exceeded";
    return refuse_param(
        q, msg, cap, 400, input,
        "This model's maximum context length is %d tokens. However, you requested %d tokens "
        "(%d in the prompt, %d in the completion). Please reduce the length of the prompt "
        "or completion.",
        ctx, longest + (p->max_tokens > 0 ? p->max_tokens : 0), longest,
        p->max_tokens > 0 ? p->max_tokens : 0);
  }
  /* (max_tokens decided here from the context: min_tokens must fit it, as when it is given) */
  if (p->min_tokens > p->max_tokens)
    return refuse_param(q, msg, cap, 400, "min_tokens",
                        "min_tokens must be less than or equal to max_tokens=%d, got %d",
                        p->max_tokens, p->min_tokens);
  /* echo of a prompt given as token ids: its text, decoded once */
  for (int i = 0; q->echo && i < q->n_prompts; i++) {
    prompt *pr = &q->prompts[i];
    pd_err de = {0};
    if (!pr->text &&
        pd_tokenizer_decode(r->tok, pr->ids, (size_t)pr->n, false, &pr->text, &pr->text_len,
                            &de) != PD_OK)
      return refuse_param(q, msg, cap, 400, input, "cannot decode the prompt: %s", de.msg);
  }
  if (!p->has_seed) {
    if (getrandom(&p->seed, sizeof p->seed, 0) != sizeof p->seed)
      p->seed = (uint64_t)pd_now_ms() * 0x9e3779b97f4a7c15ull;
    p->has_seed = true;
  }
  pd_err e = {0};
  int n = p->n > 0 ? p->n : 1;
  int saved_n = p->n;
  p->n = 1;
  const char *param;
  pd_status st = pd_oai_params_validate(p, r->vocab_size, &param, &e);
  p->n = saved_n;
  if (st != PD_OK) return refuse_param(q, msg, cap, 400, param, "%s", e.msg);
  q->wire_sp = wire_params(p);
  q->n_per_prompt = n;
  q->n_subs = q->n_prompts * n;
  q->subs = calloc((size_t)q->n_subs, sizeof *q->subs);
  if (!q->wire_sp || !q->subs) {
    snprintf(msg, cap, "out of memory");
    return 500;
  }
  for (int i = 0; i < q->n_subs; i++) {
    rsub *s = &q->subs[i];
    s->req = q;
    s->index = i;
    s->prompt_i = i / n;
    s->sample_index = (uint32_t)(i % n);
    s->stop_token = -1;
    s->state = SUB_DONE; /* route_submit queues it */
  }
  q->deadline = q->t_start + (q->timeout_ms ? (int64_t)q->timeout_ms
                                            : (int64_t)r->o.request_timeout_s * 1000);
  return 0;
}

int api_req_admit(router *r, rreq *q, char *msg, size_t cap) {
  if (q->n_subs > r->o.max_queue) /* api_prep_submit refuses these before tokenizing */
    return refuse_param(q, msg, cap, 400, "n",
                        "%d choices can never fit this server's queue of %d (--max-queue)",
                        q->n_subs, r->o.max_queue);
  /* the queue is full for now: retrying later can succeed */
  if (route_queue_length(r) + q->n_subs > r->o.max_queue) {
    snprintf(msg, cap, "too many requests are waiting (%d); retry later", route_queue_length(r));
    return 429;
  }
  /* unified nodes prefill too */
  int n_prefill = registry_count(r, PD__ROLE__ROLE_PREFILL, false) + registry_count_unified(r);
  if (n_prefill == 0 ||
      (q->op.p.max_tokens > 1 && registry_count(r, PD__ROLE__ROLE_DECODE, false) == 0)) {
    snprintf(msg, cap, "no %s node is available", n_prefill == 0 ? "prefill" : "decode");
    return 503;
  }
  return 0;
}

/* ---- parsing helpers ---- */

static const cJSON *field(const cJSON *o, const char *name) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
  return it && !cJSON_IsNull(it) ? it : NULL;
}

/* Boolean field: absent keeps *out; a wrong type is a refusal of q naming param (the field's
 * path). */
static bool get_bool(rreq *q, const cJSON *o, const char *name, const char *param, bool *out,
                     char *msg, size_t cap) {
  const cJSON *it = field(o, name);
  if (!it) return true;
  if (!cJSON_IsBool(it)) {
    refuse_param(q, msg, cap, 400, param, "'%s' must be a boolean", param);
    return false;
  }
  *out = cJSON_IsTrue(it);
  return true;
}

/* Token ids from the JSON array a (the field param of q) into *ids (malloc'ed): 0, or 400 /
 * 500 with the refusal filled in. */
static int ids_from_json(rreq *q, const char *param, const cJSON *a, int32_t **ids, int *n,
                         char *msg, size_t cap) {
  int k = cJSON_GetArraySize(a), i = 0;
  *ids = malloc((size_t)(k ? k : 1) * sizeof **ids);
  if (!*ids) return refuse_param(q, msg, cap, 500, NULL, "out of memory");
  const cJSON *v;
  cJSON_ArrayForEach(v, a) {
    int64_t id;
    if (!pd_json_int64(v, &id) || id < 0 || id > INT32_MAX) {
      free(*ids);
      *ids = NULL;
      return refuse_param(q, msg, cap, 400, param,
                          "'%s' must hold token ids: integers in [0, 2147483647]", param);
    }
    (*ids)[i++] = (int32_t)id;
  }
  *n = i;
  return 0;
}

/* The request body as a strict JSON object (pd/json.h), or NULL with the refusal filled in. */
static cJSON *parse_body(const pd_http_request *msg, char *err, size_t cap, char *param,
                         size_t pcap) {
  param[0] = 0;
  if (!msg->body_len) {
    snprintf(err, cap, "the request body is empty");
    return NULL;
  }
  pd_json_error je;
  cJSON *body = pd_json_parse(msg->body, msg->body_len, &je);
  if (!body) {
    if (je.code == PD_ENOMEM) snprintf(err, cap, "out of memory");
    else snprintf(err, cap, "the request body is not valid JSON: %s (at byte %zu)", je.msg, je.offset);
    snprintf(param, pcap, "%s", je.param);
    return NULL;
  }
  if (!cJSON_IsObject(body)) {
    cJSON_Delete(body);
    snprintf(err, cap, "the request body must be a JSON object");
    return NULL;
  }
  return body;
}

/* The optional "model": the served name, or a 404 naming it. */
static int check_model(router *r, rreq *q, const cJSON *body, char *msg, size_t cap,
                       const char **code) {
  const cJSON *model = field(body, "model");
  if (!model) return 0;
  if (!cJSON_IsString(model)) return refuse_param(q, msg, cap, 400, "model", "'model' must be a string");
  if (strcmp(model->valuestring, r->model_name)) {
    *code = "model_not_found";
    return refuse_param(q, msg, cap, 404, "model", "The model `%.200s` does not exist.",
                        model->valuestring);
  }
  return 0;
}

/* Fields common to completions, chat and /generate. Returns 0 or an HTTP status (q->err_param
 * names the field). */
static int parse_common(router *r, rreq *q, const cJSON *body, int default_max, char *msg,
                        size_t cap) {
  pd_err e = {0};
  const char *param = NULL;
  if (pd_oai_params_parse(body, default_max, &q->op, &param, &e) != PD_OK)
    return refuse_param(q, msg, cap, e.code == PD_ENOMEM ? 500 : 400, param, "%s", e.msg);
  if (q->op.p.n > r->o.max_n) /* never fits: a 400, not a 429 */
    return refuse_param(q, msg, cap, 400, "n", "'n' must be an integer in [1, %d] (--max-n)",
                        r->o.max_n);
  /* ranges now, so a bad value is refused before its prompt is tokenized (and again after,
   * when max_tokens is known: api_req_prepare) */
  pd_sampling_params one = q->op.p;
  one.n = 1;
  if (pd_oai_params_validate(&one, r->vocab_size, &param, &e) != PD_OK)
    return refuse_param(q, msg, cap, 400, param, "%s", e.msg);
  const cJSON *best_of = field(body, "best_of");
  int64_t bo;
  if (best_of && (!pd_json_int64(best_of, &bo) || bo != (q->op.p.n > 0 ? q->op.p.n : 1)))
    return refuse_param(q, msg, cap, 400, "best_of", "'best_of' other than n is not supported");
  if (!get_bool(q, body, "stream", "stream", &q->stream, msg, cap) ||
      !get_bool(q, body, "skip_special_tokens", "skip_special_tokens", &q->skip_special, msg,
                cap) ||
      !get_bool(q, body, "include_stop_str_in_output", "include_stop_str_in_output",
                &q->include_stop_str, msg, cap))
    return 400;
  const cJSON *so = field(body, "stream_options");
  if (so) {
    if (!cJSON_IsObject(so))
      return refuse_param(q, msg, cap, 400, "stream_options", "'stream_options' must be an object");
    /* vLLM: options for a stream that is not one are a mistake worth saying (an empty
     * object passes, as there) */
    if (so->child && !q->stream)
      return refuse_param(q, msg, cap, 400, "stream_options",
                          "Stream options can only be defined when `stream=True`.");
    if (!get_bool(q, so, "include_usage", "stream_options.include_usage", &q->include_usage, msg,
                  cap) ||
        !get_bool(q, so, "continuous_usage_stats", "stream_options.continuous_usage_stats",
                  &q->continuous_usage, msg, cap))
      return 400;
  }
  const cJSON *stop = field(body, "stop");
  if (stop) {
    int k = cJSON_IsString(stop) ? 1 : cJSON_IsArray(stop) ? cJSON_GetArraySize(stop) : -1;
    if (k < 0 || k > 16)
      return refuse_param(q, msg, cap, 400, "stop",
                          "'stop' must be a string or a list of at most 16 strings");
    q->stop = calloc((size_t)(k ? k : 1), sizeof *q->stop);
    if (!q->stop) return 500;
    const cJSON *v = cJSON_IsString(stop) ? stop : stop->child;
    for (int i = 0; i < k; i++, v = v->next) {
      if (!cJSON_IsString(v) || !v->valuestring[0] || strlen(v->valuestring) > 256)
        return refuse_param(q, msg, cap, 400, "stop",
                            "'stop' strings must be non-empty strings of at most 256 bytes");
      if (!(q->stop[q->n_stop++] = strdup(v->valuestring))) return 500;
    }
  }
  const cJSON *salt = field(body, "cache_salt");
  if (salt) {
    if (!cJSON_IsString(salt) || strlen(salt->valuestring) > 256)
      return refuse_param(q, msg, cap, 400, "cache_salt",
                          "'cache_salt' must be a string of at most 256 bytes");
    snprintf(q->cache_salt_str, sizeof q->cache_salt_str, "%s", salt->valuestring);
    q->cache_salt = pd_kv_cache_salt(salt->valuestring);
  }
  const cJSON *tools = field(body, "tools");
  if (tools && cJSON_IsArray(tools) && cJSON_GetArraySize(tools) > 0)
    return refuse_param(q, msg, cap, 400, "tools", "tools are not supported by this server");
  const cJSON *rf = field(body, "response_format");
  if (rf) {
    const cJSON *t = cJSON_IsObject(rf) ? field(rf, "type") : NULL;
    if (!t || !cJSON_IsString(t) || strcmp(t->valuestring, "text"))
      return refuse_param(q, msg, cap, 400, "response_format",
                          "only response_format {\"type\": \"text\"} is supported");
  }
  /* vLLM: prompt logprobs are not streamed, and asking for them in a stream is refused */
  if (q->stream && q->op.p.prompt_logprobs > 0)
    return refuse_param(q, msg, cap, 400, "prompt_logprobs",
                        "`prompt_logprobs` are not available when `stream=True`.");
  q->lp_top = q->op.p.logprobs;
  q->want_prompt_lp = q->op.p.prompt_logprobs >= 0;
  return 0;
}

/* The prompt(s) of a completion: strings to tokenize or token ids, in order, into p. */
static int parse_completion_prompt(rreq *q, api_prep *p, const cJSON *body, char *msg,
                                   size_t cap) {
  const cJSON *pr = field(body, "prompt");
  bool add_special = true;
  if (!get_bool(q, body, "add_special_tokens", "add_special_tokens", &add_special, msg, cap))
    return 400;
  if (!pr) return refuse_param(q, msg, cap, 400, "prompt", "'prompt' is required");
  if (cJSON_IsString(pr)) {
    if (!pr->valuestring[0])
      return refuse_param(q, msg, cap, 400, "prompt", "the prompt must not be empty");
    return api_prep_text(p, pr->valuestring, strlen(pr->valuestring), add_special) ? 0 : 500;
  }
  if (!cJSON_IsArray(pr) || cJSON_GetArraySize(pr) == 0)
    return refuse_param(q, msg, cap, 400, "prompt",
                        "'prompt' must be a string, a list of strings, a list of token ids or a "
                        "list of lists of token ids, and not empty");
  const cJSON *first = pr->child;
  if (cJSON_IsNumber(first)) { /* one prompt of token ids */
    int n, st;
    int32_t *ids;
    if ((st = ids_from_json(q, "prompt", pr, &ids, &n, msg, cap))) return st;
    return api_prep_ids(p, ids, n) ? 0 : 500;
  }
  if (cJSON_GetArraySize(pr) > 64)
    return refuse_param(q, msg, cap, 400, "prompt", "at most 64 prompts per request");
  const cJSON *v;
  cJSON_ArrayForEach(v, pr) {
    if (cJSON_IsString(v)) {
      if (!v->valuestring[0])
        return refuse_param(q, msg, cap, 400, "prompt", "the prompt must not be empty");
      if (!api_prep_text(p, v->valuestring, strlen(v->valuestring), add_special)) return 500;
    } else if (cJSON_IsArray(v)) {
      int n = 0, st;
      int32_t *ids;
      if ((st = ids_from_json(q, "prompt", v, &ids, &n, msg, cap))) return st;
      if (!api_prep_ids(p, ids, n)) return 500;
    } else {
      return refuse_param(q, msg, cap, 400, "prompt",
                          "'prompt' list entries must be strings or lists of token ids");
    }
  }
  return 0;
}

/* The messages of a chat request into p (their strings stay in the parsed body, which p owns
 * by then; joined content parts are adopted by p). add_special: tokens the tokenizer adds on
 * top of the template's (/tokenize only). */
static int parse_chat_messages(rreq *q, api_prep *p, const cJSON *body, bool add_special,
                               char *msg, size_t cap) {
  const cJSON *ms = field(body, "messages");
  if (!ms || !cJSON_IsArray(ms) || cJSON_GetArraySize(ms) == 0)
    return refuse_param(q, msg, cap, 400, "messages", "'messages' must be a non-empty list");
  int k = cJSON_GetArraySize(ms), i = 0;
  if (k > 4096) return refuse_param(q, msg, cap, 400, "messages", "at most 4096 messages");
  pd_chat_msg *m = calloc((size_t)k, sizeof *m);
  if (!m) return 500;
  int st = 0;
  char where[64];
  const cJSON *v;
  cJSON_ArrayForEach(v, ms) {
    const cJSON *role = cJSON_IsObject(v) ? field(v, "role") : NULL;
    const cJSON *content = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    if (!role || !cJSON_IsString(role)) {
      snprintf(where, sizeof where, "messages.[%d].role", i);
      st = refuse_param(q, msg, cap, 400, where, "messages[%d]: 'role' must be a string", i);
      break;
    }
    m[i].role = role->valuestring;
    snprintf(where, sizeof where, "messages.[%d].content", i);
    if (!content || cJSON_IsNull(content)) {
      m[i].content = "";
    } else if (cJSON_IsString(content)) {
      m[i].content = content->valuestring;
    } else if (cJSON_IsArray(content)) {
      /* content parts: only text parts, joined with newlines */
      size_t tot = 1;
      const cJSON *part;
      cJSON_ArrayForEach(part, content) {
        const cJSON *t = cJSON_IsObject(part) ? field(part, "type") : NULL;
        const cJSON *tx = cJSON_IsObject(part) ? field(part, "text") : NULL;
        if (!t || !cJSON_IsString(t) || strcmp(t->valuestring, "text") || !tx ||
            !cJSON_IsString(tx)) {
          st = refuse_param(q, msg, cap, 400, where,
                            "messages[%d]: only text content parts are supported", i);
          break;
        }
        tot += strlen(tx->valuestring) + 1;
      }
      if (st) break;
      char *joined = calloc(tot, 1);
      if (!joined || !api_prep_adopt(p, joined)) {
        st = 500;
        break;
      }
      size_t o = 0;
      cJSON_ArrayForEach(part, content) {
        const char *tx = field(part, "text")->valuestring;
        size_t l = strlen(tx);
        if (o) joined[o++] = '\n';
        memcpy(joined + o, tx, l);
        o += l;
      }
      joined[o] = 0;
      m[i].content = joined;
    } else {
      st = refuse_param(q, msg, cap, 400, where,
                        "messages[%d]: 'content' must be a string or a list of parts", i);
      break;
    }
    i++;
  }
  bool add_gen = true, cont = false;
  if (!st && (!get_bool(q, body, "add_generation_prompt", "add_generation_prompt", &add_gen, msg,
                        cap) ||
              !get_bool(q, body, "continue_final_message", "continue_final_message", &cont, msg,
                        cap)))
    st = 400;
  if (!st && add_gen && cont && field(body, "add_generation_prompt"))
    st = refuse_param(q, msg, cap, 400, "continue_final_message",
                      "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                      "True.");
  if (st) {
    free(m);
    return st;
  }
  st = api_prep_chat(p, m, k, add_gen, cont, add_special, msg, cap);
  if (st) snprintf(q->err_param, sizeof q->err_param, "messages");
  return st;
}

/* ---- the OpenAI output shapes ---- */

static cJSON *chunk_base(router *r, rreq *q) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", q->id);
  cJSON_AddStringToObject(o, "object",
                          q->kind == API_CHAT ? "chat.completion.chunk" : "text_completion");
  cJSON_AddNumberToObject(o, "created", q->created);
  cJSON_AddStringToObject(o, "model", r->model_name);
  return o;
}

static cJSON *usage_json(rreq *q) {
  int pt = 0, ct = 0, cached = 0;
  for (int i = 0; i < q->n_prompts; i++) {
    pt += q->prompts[i].n;
    cached += (int)q->subs[i * q->n_per_prompt].cached_tokens;
  }
  for (int i = 0; i < q->n_subs; i++) ct += q->subs[i].n_out_tokens;
  cJSON *u = cJSON_CreateObject();
  cJSON_AddNumberToObject(u, "prompt_tokens", pt);
  cJSON_AddNumberToObject(u, "completion_tokens", ct);
  cJSON_AddNumberToObject(u, "total_tokens", pt + ct);
  cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
  cJSON_AddNumberToObject(d, "cached_tokens", cached);
  return u;
}

static void add_finish(cJSON *c, const rsub *s) {
  if (s->finish_reason) cJSON_AddStringToObject(c, "finish_reason", s->finish_reason);
  else cJSON_AddNullToObject(c, "finish_reason");
  if (s->stop_string) cJSON_AddStringToObject(c, "stop_reason", s->stop_string);
  else if (s->stop_token >= 0) cJSON_AddNumberToObject(c, "stop_reason", s->stop_token);
  else cJSON_AddNullToObject(c, "stop_reason");
}

static bool stream_begin(router *r, rreq *q) {
  if (q->started) return true;
  pd_http_header h[1] = {{"X-Request-Id", q->id}};
  pd_status st = q->kind == API_GENERATE
                     ? pd_http_stream_begin(q->http, 200, "application/json", h, 1, NULL)
                     : pd_http_sse_begin(q->http, h, 1, NULL);
  if (st != PD_OK) return false;
  q->started = true;
  rmetrics_request(r, api_name(q->kind), 200);
  return true;
}

static void sse_json(rreq *q, cJSON *o) {
  char *t = cJSON_PrintUnformatted(o);
  if (t) pd_http_sse_event(q->http, NULL, t, NULL);
  free(t);
  cJSON_Delete(o);
}

/* A streamed error: an SSE event {"error": ...}, or for /generate a NUL-terminated JSON object. */
static void stream_error(rreq *q, const rsub *s) {
  q->error_sent = true;
  cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
  cJSON_AddStringToObject(e, "message", s->err_msg);
  cJSON_AddStringToObject(e, "type", pd_http_error_type(api_http_status(s->err_code)));
  cJSON_AddNullToObject(e, "param");
  cJSON_AddNumberToObject(e, "code", api_http_status(s->err_code));
  if (q->kind != API_GENERATE) {
    sse_json(q, o);
    return;
  }
  char *t = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (t) pd_http_stream_write(q->http, t, strlen(t) + 1, NULL);
  free(t);
}

/* /generate streaming: the full text of every choice so far, NUL-terminated (vLLM's
 * api_server). */
static void generate_stream_update(router *r, rreq *q) {
  if (!stream_begin(r, q)) return;
  cJSON *o = cJSON_CreateObject();
  cJSON *a = cJSON_AddArrayToObject(o, "text");
  for (int i = 0; i < q->n_subs; i++) {
    rsub *s = &q->subs[i];
    const prompt *p = &q->prompts[s->prompt_i];
    size_t n = p->text_len + s->n_text;
    char *t = malloc(n + 1);
    if (!t) continue;
    memcpy(t, p->text ? p->text : "", p->text_len);
    memcpy(t + p->text_len, s->text ? s->text : "", s->n_text);
    t[n] = 0;
    cJSON_AddItemToArray(a, cJSON_CreateString(t));
    free(t);
  }
  char *txt = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (txt) {
    size_t n = strlen(txt);
    txt[n] = 0;
    pd_http_stream_write(q->http, txt, n + 1, NULL); /* the NUL is the delimiter */
  }
  free(txt);
}

/* One streamed chunk for choice s: text delta, logprobs (taken over; NULL: none) and, when
 * final, finish_reason and stop_reason on that same chunk, as vLLM sends them (the last
 * token's chunk carries the finish; no empty chunk follows). */
static void stream_chunk(router *r, rsub *s, const char *text, size_t len, cJSON *lp, bool final) {
  rreq *q = s->req;
  if (!stream_begin(r, q)) {
    cJSON_Delete(lp);
    return;
  }
  if (q->kind == API_CHAT && !s->role_sent) {
    s->role_sent = true;
    cJSON *o = chunk_base(r, q);
    cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", s->index);
    cJSON *d = cJSON_AddObjectToObject(c, "delta");
    cJSON_AddStringToObject(d, "role", "assistant");
    cJSON_AddStringToObject(d, "content", "");
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(ch, c);
    sse_json(q, o);
  }
  if (final) s->finish_sent = true;
  cJSON *o = chunk_base(r, q);
  cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
  cJSON_AddNumberToObject(c, "index", s->index);
  char *t = malloc(len + 1);
  if (t) {
    if (len) memcpy(t, text, len);
    t[len] = 0;
  }
  if (q->kind == API_CHAT) {
    cJSON *d = cJSON_AddObjectToObject(c, "delta");
    if (len || !final) cJSON_AddStringToObject(d, "content", t ? t : "");
  } else {
    cJSON_AddStringToObject(c, "text", t ? t : "");
  }
  free(t);
  if (lp) cJSON_AddItemToObject(c, "logprobs", lp);
  else cJSON_AddNullToObject(c, "logprobs");
  if (final) {
    add_finish(c, s);
  } else {
    cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddNullToObject(c, "stop_reason");
  }
  cJSON_AddItemToArray(ch, c);
  sse_json(q, o);
}

/* New text and tokens of choice s. out_tokens sets s->finish_reason before it hands over a
 * choice's last tokens, so the finish rides on their chunk. With echo the prompt (and, with
 * logprobs, its tokens' logprobs) goes before the first tokens, in the same chunk (vLLM). */
void api_http_tokens(router *r, rsub *s, size_t off, size_t len, const pd_logprobs *lps, int n) {
  rreq *q = s->req;
  if (!q->http) return;
  const prompt *p = &q->prompts[s->prompt_i];
  size_t echo_len = q->echo && p->text ? p->text_len : 0;
  bool final = s->finish_reason != NULL;
  if (q->kind == API_GENERATE) {
    if (q->stream && (len || n)) generate_stream_update(r, q);
    return;
  }
  if (!q->stream) {
    if (q->lp_top >= 0) {
      if (!s->lp_acc && q->echo) s->lp_acc = echo_lp_json(r, s);
      s->lp_acc = lp_append(r, q, s->lp_acc, lps, n, echo_len + off);
    }
    return;
  }
  const char *text = s->text + off;
  char *joined = NULL;
  cJSON *lp = NULL;
  if (q->echo && !s->echo_sent) {
    s->echo_sent = true;
    joined = malloc(echo_len + len + 1);
    if (joined) {
      memcpy(joined, p->text, echo_len);
      memcpy(joined + echo_len, text, len);
      text = joined;
      len += echo_len;
    }
    if (q->lp_top >= 0) lp = echo_lp_json(r, s);
  }
  if (q->lp_top >= 0 && n) lp = lp_append(r, q, lp, lps, n, echo_len + off);
  if (len || n || lp || final) stream_chunk(r, s, text, len, lp, final);
  free(joined);
}

void api_http_sub_done(router *r, rsub *s) {
  rreq *q = s->req;
  if (!q->http || !q->stream) return;
  if (s->err_code && s->finish_reason && !strcmp(s->finish_reason, "error")) {
    if (!q->started || q->error_sent) return; /* answered as a whole at the end */
    stream_error(q, s);
    return;
  }
  if (q->kind == API_GENERATE) return;
  /* a choice that ended without new tokens (cancelled, or its last tokens went out before the
   * end was known) still gets its finish */
  if (!s->finish_sent) stream_chunk(r, s, "", 0, NULL, true);
}

/* The prompt logprobs of s in vLLM's shape (taken over). A one-token prompt has none to give
 * but the first position's null. */
static cJSON *take_prompt_lp(rsub *s) {
  cJSON *pl = s->prompt_lp;
  s->prompt_lp = NULL;
  if (!pl && (pl = cJSON_CreateArray())) cJSON_AddItemToArray(pl, cJSON_CreateNull());
  return pl;
}

static int first_error(rreq *q) {
  for (int i = 0; i < q->n_subs; i++)
    if (q->subs[i].err_code) return i;
  return -1;
}


void api_http_req_done(router *r, rreq *q) {
  if (!q->http) return;
  int fe = first_error(q);
  if (q->stream && q->started) {
    if (fe >= 0 && !q->error_sent) stream_error(q, &q->subs[fe]); /* failed before it began */
    if (q->kind != API_GENERATE) {
      if (q->include_usage) {
        cJSON *o = chunk_base(r, q);
        cJSON_AddArrayToObject(o, "choices");
        cJSON_AddItemToObject(o, "usage", usage_json(q));
        sse_json(q, o);
      }
      pd_http_sse_event(q->http, NULL, "[DONE]", NULL);
    } else if (fe < 0) {
      generate_stream_update(r, q);
    }
    pd_http_stream_end(q->http, NULL);
    api_http_release(q);
    return;
  }
  if (fe >= 0) {
    rsub *s = &q->subs[fe];
    int status = api_http_status(s->err_code);
    respond_err(r, q->http, q->kind, status, s->err_msg, api_error_code_str(s->err_code), NULL);
    api_http_release(q);
    return;
  }
  if (q->stream) { /* nothing was streamed: an empty stream that ends properly */
    if (stream_begin(r, q)) {
      for (int i = 0; i < q->n_subs && q->kind != API_GENERATE; i++)
        if (!q->subs[i].finish_sent) stream_chunk(r, &q->subs[i], "", 0, NULL, true);
      if (q->kind == API_GENERATE) generate_stream_update(r, q);
      else pd_http_sse_event(q->http, NULL, "[DONE]", NULL);
      pd_http_stream_end(q->http, NULL);
    }
    api_http_release(q);
    return;
  }
  cJSON *o;
  if (q->kind == API_GENERATE) {
    o = cJSON_CreateObject();
    cJSON *a = cJSON_AddArrayToObject(o, "text");
    for (int i = 0; i < q->n_subs; i++) {
      rsub *s = &q->subs[i];
      const prompt *p = &q->prompts[s->prompt_i];
      size_t n = p->text_len + s->n_text;
      char *t = malloc(n + 1);
      if (!t) continue;
      memcpy(t, p->text ? p->text : "", p->text_len);
      memcpy(t + p->text_len, s->text ? s->text : "", s->n_text);
      t[n] = 0;
      cJSON_AddItemToArray(a, cJSON_CreateString(t));
      free(t);
    }
  } else {
    o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", q->id);
    cJSON_AddStringToObject(o, "object", q->kind == API_CHAT ? "chat.completion" : "text_completion");
    cJSON_AddNumberToObject(o, "created", q->created);
    cJSON_AddStringToObject(o, "model", r->model_name);
    cJSON *ch = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < q->n_subs; i++) {
      rsub *s = &q->subs[i];
      cJSON *c = cJSON_CreateObject();
      cJSON_AddNumberToObject(c, "index", s->index);
      if (q->kind == API_CHAT) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", s->text ? s->text : "");
      } else {
        const prompt *p = &q->prompts[s->prompt_i];
        if (q->echo && p->text) {
          size_t n = p->text_len + s->n_text;
          char *t = malloc(n + 1);
          if (t) {
            memcpy(t, p->text, p->text_len);
            memcpy(t + p->text_len, s->text ? s->text : "", s->n_text);
            t[n] = 0;
            cJSON_AddStringToObject(c, "text", t);
            free(t);
          }
        } else {
          cJSON_AddStringToObject(c, "text", s->text ? s->text : "");
        }
      }
      if (!s->lp_acc && q->lp_top >= 0 && q->echo) s->lp_acc = echo_lp_json(r, s);
      if (s->lp_acc) {
        cJSON_AddItemToObject(c, "logprobs", s->lp_acc);
        s->lp_acc = NULL;
      } else if (q->lp_top >= 0 && q->kind == API_CHAT) {
        cJSON *l = cJSON_AddObjectToObject(c, "logprobs");
        cJSON_AddArrayToObject(l, "content");
      } else {
        cJSON_AddNullToObject(c, "logprobs");
      }
      add_finish(c, s);
      /* vLLM: every completion choice carries its prompt's logprobs; chat has them once,
       * beside the choices */
      if (q->want_prompt_lp && q->kind != API_CHAT)
        cJSON_AddItemToObject(c, "prompt_logprobs", take_prompt_lp(s));
      cJSON_AddItemToArray(ch, c);
    }
    if (q->want_prompt_lp && q->kind == API_CHAT)
      cJSON_AddItemToObject(o, "prompt_logprobs", take_prompt_lp(&q->subs[0]));
    cJSON_AddItemToObject(o, "usage", usage_json(q));
  }
  respond_json(q->http, 200, o, q->id);
  rmetrics_request(r, api_name(q->kind), 200);
  cJSON_Delete(o);
  api_http_release(q);
}

/* ---- handlers ---- */

static void on_cancel(pd_http_req *req, void *ud) {
  (void)req;
  rreq *q = ud;
  router *r = q->r;
  if (!q->finished) {
    pd_log(PD_LOG_DEBUG, "%s: client went away", q->id);
    api_cancel(r, q);
  }
  api_http_release(q);
  route_dispatch(r);
  router_gc(r);
}

/* The request's hold on its HTTP exchange: one reference and the cancel callback, taken and
 * dropped together (api_http_release). Whatever ends the exchange first (the response ended,
 * the client gone, the request freed) drops both, so the server never calls back into a freed
 * request. PD_EIO when the client is already gone (nothing is held then). */
static pd_status api_http_hold(rreq *q, pd_http_req *req) {
  if (pd_http_req_on_cancel(req, on_cancel, q) != PD_OK) return PD_EIO;
  q->http = pd_http_req_ref(req);
  return PD_OK;
}

/* A request refused once its hold is taken: the answer goes out through the hold, naming the
 * parameter at fault (q->err_param). */
static void http_refuse(router *r, rreq *q, int status, const char *msg, const char *code) {
  respond_err(r, q->http, q->kind, status, msg[0] ? msg : "out of memory", code, q->err_param);
  api_http_release(q);
  q->finished = true;
  router_retire(r, q);
}

void api_http_reply(router *r, rreq *q, const char *json, size_t len) {
  if (q->http) {
    pd_http_header h[1] = {{"X-Request-Id", q->id}};
    pd_http_respond(q->http, 200, "application/json", h, 1, json, len, NULL);
    rmetrics_request(r, api_name(q->kind), 200);
  }
  api_http_release(q);
  q->finished = true;
  router_retire(r, q);
}

/* One HTTP API call being taken in: its request, its strict JSON body, the job its input goes
 * into, and its refusal so far (st: 0 or an HTTP status, with err and code). */
typedef struct http_call {
  rreq *q;
  cJSON *body;
  api_prep *p;
  int st;
  const char *code;
  char err[1024];
} http_call;

/* Parses req's body and makes the request that holds req and its job, and checks the body's
 * "model". false when req was answered already (a refused body, or the client gone). */
static bool call_begin(router *r, pd_http_req *req, const pd_http_request *msg, api_kind kind,
                       http_call *h) {
  char param[128];
  memset(h, 0, sizeof *h);
  if (!(h->body = parse_body(msg, h->err, sizeof h->err, param, sizeof param))) {
    respond_err(r, req, kind, strcmp(h->err, "out of memory") ? 400 : 500, h->err, NULL, param);
    return false;
  }
  if (!(h->q = api_req_new(r, kind))) {
    respond_err(r, req, kind, 500, "out of memory", NULL, NULL);
  } else if (api_http_hold(h->q, req) != PD_OK) {
    api_cancel(r, h->q);
    h->q = NULL;
  }
  if (!h->q) {
    cJSON_Delete(h->body);
    return false;
  }
  h->p = api_prep_new(r, h->q, http_refuse);
  h->st = h->p ? check_model(r, h->q, h->body, h->err, sizeof h->err, &h->code) : 500;
  return true;
}

/* The job takes over the body (the prompts and messages point into it); returns it. */
static const cJSON *call_own_body(http_call *h) {
  const cJSON *b = h->body;
  api_prep_own_json(h->p, h->body);
  h->body = NULL;
  return b;
}

/* Submits the job, or refuses the request with h's status. */
static void call_end(router *r, http_call *h) {
  cJSON_Delete(h->body);
  if (!h->st) {
    h->st = api_prep_submit(h->p, h->err, sizeof h->err, &h->code);
    if (!h->st) return; /* it goes on from the pool (perhaps already did) */
    h->p = NULL;
  }
  api_prep_free(h->p);
  http_refuse(r, h->q, h->st, h->err, h->code);
}

int api_parse_generation(router *r, rreq *q, api_prep *p, const cJSON *body, char *msg,
                         size_t cap) {
  int default_max = q->kind == API_CHAT ? -1 : r->o.default_max_tokens;
  int st = parse_common(r, q, body, default_max, msg, cap);
  if (!st && q->kind == API_COMPLETIONS) {
    if (!get_bool(q, body, "echo", "echo", &q->echo, msg, cap)) st = 400;
    const cJSON *suffix = field(body, "suffix");
    if (!st && suffix && (!cJSON_IsString(suffix) || suffix->valuestring[0]))
      st = refuse_param(q, msg, cap, 400, "suffix", "'suffix' is not supported");
    /* vLLM: echo with logprobs gives the prompt's tokens their logprobs too, so the prefill
     * node computes them (and the choices carry prompt_logprobs, as there) */
    if (!st && q->echo && q->lp_top >= 0 && q->op.p.prompt_logprobs < 0) {
      q->op.p.prompt_logprobs = q->lp_top;
      q->want_prompt_lp = true;
    }
  }
  if (st) return st;
  if (q->kind == API_CHAT) return parse_chat_messages(q, p, body, false, msg, cap);
  if (q->kind == API_GENERATE && !cJSON_IsString(field(body, "prompt")))
    return refuse_param(q, msg, cap, 400, "prompt", "'prompt' must be a string");
  return parse_completion_prompt(q, p, body, msg, cap);
}

/* Validates and parses the body here (about 3 ms per MB), then hands the prompts to the worker
 * pool: tokenizing and chat templates cost about 0.2 s per MB and would stall every client. */
static void handle_generation(router *r, pd_http_req *req, const pd_http_request *msg,
                              api_kind kind) {
  http_call h;
  if (!call_begin(r, req, msg, kind, &h)) return;
  if (!h.st) h.st = api_parse_generation(r, h.q, h.p, call_own_body(&h), h.err, sizeof h.err);
  call_end(r, &h);
}

/* POST /tokenize (vLLM): {"prompt"} or {"messages"} into {"count", "max_model_len", "tokens"}
 * (and "token_strs" with return_token_strs), tokenized in the worker pool like any prompt. */
static void handle_tokenize(router *r, pd_http_req *req, const pd_http_request *msg) {
  http_call h;
  if (!call_begin(r, req, msg, API_TOKENIZE, &h)) return;
  rreq *q = h.q;
  bool chat = field(h.body, "messages") != NULL, strs = false;
  bool add_special = !chat; /* vLLM's defaults: the chat template writes its own */
  if (!h.st && (!get_bool(q, h.body, "return_token_strs", "return_token_strs", &strs, h.err,
                          sizeof h.err) ||
                !get_bool(q, h.body, "add_special_tokens", "add_special_tokens", &add_special,
                          h.err, sizeof h.err)))
    h.st = 400;
  if (!h.st) {
    const cJSON *b = call_own_body(&h), *pr = field(b, "prompt");
    if (chat)
      h.st = parse_chat_messages(q, h.p, b, add_special, h.err, sizeof h.err);
    else if (!cJSON_IsString(pr))
      h.st = refuse_param(q, h.err, sizeof h.err, 400, "prompt",
                          "'prompt' must be a string (or give 'messages')");
    else if (!api_prep_text(h.p, pr->valuestring, strlen(pr->valuestring), add_special))
      h.st = 500;
  }
  if (!h.st) api_prep_reply(h.p, strs, registry_max_model_len(r));
  call_end(r, &h);
}

/* POST /detokenize (vLLM): {"tokens": [ids]} into {"prompt": text}, decoded in the pool. */
static void handle_detokenize(router *r, pd_http_req *req, const pd_http_request *msg) {
  http_call h;
  if (!call_begin(r, req, msg, API_DETOKENIZE, &h)) return;
  rreq *q = h.q;
  const cJSON *toks = field(h.body, "tokens");
  int32_t *ids = NULL;
  int n = 0;
  if (!h.st && !cJSON_IsArray(toks))
    h.st = refuse_param(q, h.err, sizeof h.err, 400, "tokens", "'tokens' must be a list of token ids");
  if (!h.st) h.st = ids_from_json(q, "tokens", toks, &ids, &n, h.err, sizeof h.err);
  for (int i = 0; !h.st && i < n; i++)
    if (ids[i] >= r->vocab_size)
      h.st = refuse_param(q, h.err, sizeof h.err, 400, "tokens",
                          "token id %d is outside the vocabulary [0, %d)", ids[i], r->vocab_size);
  if (!h.st) {
    api_prep_reply(h.p, false, 0);
    if (!api_prep_ids(h.p, ids, n)) h.st = 500;
    ids = NULL;
  }
  free(ids);
  call_end(r, &h);
}

bool api_key_ok(router *r, const char *given) {
  const char *want = r->o.api_key;
  if (!want || !*want) return true;
  if (!given) given = "";
  /* constant time in the key: every byte of want is compared whatever differs */
  size_t lw = strlen(want), lg = strlen(given);
  unsigned char d = (unsigned char)(lw != lg);
  for (size_t i = 0; i < lw; i++) d |= (unsigned char)(want[i] ^ (i < lg ? given[i] : 0));
  return d == 0;
}

static bool auth_ok(router *r, const pd_http_request *msg) {
  if (!r->o.api_key) return true;
  const char *h = pd_http_header_get(msg, "Authorization");
  const char *given = "";
  if (h && !strncasecmp(h, "Bearer ", 7)) {
    given = h + 7;
    while (*given == ' ') given++;
  }
  return api_key_ok(r, given);
}

/* The served model as OpenAI's model object, with vLLM's extra fields. */
static cJSON *model_card(router *r) {
  cJSON *m = cJSON_CreateObject();
  cJSON_AddStringToObject(m, "id", r->model_name);
  cJSON_AddStringToObject(m, "object", "model");
  cJSON_AddNumberToObject(m, "created", floor(pd_wall_s()));
  cJSON_AddStringToObject(m, "owned_by", "pdserve");
  cJSON_AddStringToObject(m, "root", r->model_name);
  cJSON_AddNullToObject(m, "parent");
  cJSON_AddNumberToObject(m, "max_model_len", registry_max_model_len(r));
  cJSON_AddArrayToObject(m, "permission");
  return m;
}

static void handle_models(router *r, pd_http_req *req) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "object", "list");
  cJSON *a = cJSON_AddArrayToObject(o, "data");
  cJSON_AddItemToArray(a, model_card(r));
  respond_json(req, 200, o, NULL);
  cJSON_Delete(o);
}

/* GET /v1/models/{id} (client.models.retrieve): the model object, or OpenAI's 404. The id is
 * the rest of the path, percent-decoded (ids may hold a '/'). */
static void handle_model(router *r, pd_http_req *req, const char *enc, size_t len) {
  char id[512];
  bool decoded = pd_http_percent_decode(enc, len, id, sizeof id, NULL, false) == PD_OK;
  if (decoded && !strcmp(id, r->model_name)) {
    cJSON *m = model_card(r);
    respond_json(req, 200, m, NULL);
    cJSON_Delete(m);
    return;
  }
  for (const char *c = id; decoded && *c; c++) /* the message shows the id as sent otherwise */
    decoded = *c >= 0x20 && *c < 0x7f;
  char msg[700];
  if (decoded) snprintf(msg, sizeof msg, "The model `%.400s` does not exist.", id);
  else snprintf(msg, sizeof msg, "The model `%.*s` does not exist.", (int)(len < 400 ? len : 400), enc);
  char *body = pd_http_error_json(msg, pd_http_error_type(404), "model_not_found", "model");
  pd_http_respond(req, 404, "application/json", NULL, 0, body ? body : "", body ? strlen(body) : 0,
                  NULL);
  free(body);
  rmetrics_error(r, "not_found");
}

static void handle_health(router *r, pd_http_req *req) {
  int p = registry_count(r, PD__ROLE__ROLE_PREFILL, true);
  int d = registry_count(r, PD__ROLE__ROLE_DECODE, true);
  int u = registry_count_unified(r);
  bool ok = (p > 0 || u > 0) && d > 0;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "status", ok ? "ok" : "unavailable");
  cJSON_AddNumberToObject(o, "prefill_nodes", p);
  cJSON_AddNumberToObject(o, "decode_nodes", d);
  cJSON_AddNumberToObject(o, "unified_nodes", u);
  respond_json(req, ok ? 200 : 503, o, NULL);
  cJSON_Delete(o);
}

static void handle_metrics(router *r, pd_http_req *req) {
  size_t len = 0;
  char *text = pd_metrics_render(r->m.reg, &len);
  if (!text) {
    pd_http_respond_error(req, 500, "out of memory", NULL, NULL, NULL);
    return;
  }
  pd_http_respond(req, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, 0, text, len, NULL);
  free(text);
}

void api_http_handler(pd_http_req *req, const pd_http_request *msg, void *ud) {
  router *r = ud;
  const char *path = msg->path, *m = msg->method;
  bool get = !strcmp(m, "GET") || !strcmp(m, "HEAD"), post = !strcmp(m, "POST");
  size_t pl = strlen(path);
  while (pl > 1 && path[pl - 1] == '/') pl--; /* "/v1/models/" is "/v1/models" */
  char p[128];
  memcpy(p, path, pl < sizeof p ? pl : sizeof p - 1);
  p[pl < sizeof p ? pl : sizeof p - 1] = 0;
  /* open endpoints: liveness, readiness, metrics, version */
  if (!strcmp(p, "/live") || !strcmp(p, "/health") || !strcmp(p, "/metrics") ||
      !strcmp(p, "/version")) {
    if (!get) {
      respond_405(req, "GET, HEAD");
    } else if (!strcmp(p, "/live")) { /* answered by the one event loop, so it runs */
      static const char ok[] = "{\"status\":\"ok\"}";
      pd_http_respond(req, 200, "application/json", NULL, 0, ok, sizeof ok - 1, NULL);
    } else if (!strcmp(p, "/health")) {
      handle_health(r, req);
    } else if (!strcmp(p, "/metrics")) {
      handle_metrics(r, req);
    } else {
      static const char v[] = "{\"version\":\"" PD_VERSION "\"}";
      pd_http_respond(req, 200, "application/json", NULL, 0, v, sizeof v - 1, NULL);
    }
    goto out;
  }
  bool model_id = pl > 11 && !strncmp(path, "/v1/models/", 11);
  bool get_path = model_id || !strcmp(p, "/v1/models") || !strcmp(p, "/cluster/nodes");
  bool post_path = !strcmp(p, "/v1/completions") || !strcmp(p, "/v1/chat/completions") ||
                   !strcmp(p, "/generate") || !strcmp(p, "/tokenize") ||
                   !strcmp(p, "/detokenize");
  if (!get_path && !post_path) {
    pd_http_respond_error(req, 404, "Not Found", NULL, NULL, NULL);
    rmetrics_error(r, "not_found");
    goto out;
  }
  /* OPTIONS passes without a key (a browser's preflight never has one; the HTTP server answers
   * those when --allowed-origins is set): any other OPTIONS is a 405 below, as in vLLM */
  if (strcmp(m, "OPTIONS") && !auth_ok(r, msg)) {
    pd_http_header h[1] = {{"WWW-Authenticate", "Bearer"}};
    char *body = router_error_json(401, "Invalid or missing API key", "invalid_api_key");
    pd_http_respond(req, 401, "application/json", h, 1, body, body ? strlen(body) : 0, NULL);
    free(body);
    rmetrics_error(r, "auth");
    goto out;
  }
  if (get_path ? !get : !post) {
    respond_405(req, get_path ? "GET, HEAD" : "POST");
  } else if (model_id) {
    handle_model(r, req, path + 11, pl - 11);
  } else if (!strcmp(p, "/v1/models")) {
    handle_models(r, req);
  } else if (!strcmp(p, "/cluster/nodes")) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "nodes", registry_json(r));
    cJSON_AddNumberToObject(o, "queue_length", route_queue_length(r));
    cJSON_AddNumberToObject(o, "running", route_active_subs(r));
    cJSON *pf = cJSON_AddObjectToObject(o, "prefills"); /* where prompts were prefilled */
    if (pf) {
      cJSON_AddNumberToObject(pf, "local", pd_metric_value(r->m.prefill_local));
      cJSON_AddNumberToObject(pf, "remote", pd_metric_value(r->m.prefill_remote));
    }
    respond_json(req, 200, o, NULL);
    cJSON_Delete(o);
  } else if (!strcmp(p, "/v1/completions")) {
    handle_generation(r, req, msg, API_COMPLETIONS);
  } else if (!strcmp(p, "/v1/chat/completions")) {
    handle_generation(r, req, msg, API_CHAT);
  } else if (!strcmp(p, "/generate")) {
    handle_generation(r, req, msg, API_GENERATE);
  } else if (!strcmp(p, "/tokenize")) {
    handle_tokenize(r, req, msg);
  } else {
    handle_detokenize(r, req, msg);
  }
out:
  router_gc(r);
}
