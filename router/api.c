/* The router's HTTP API (docs/api.md): OpenAI completions and chat completions (streamed as
 * Server-Sent Events or not), vLLM's legacy POST /generate, GET /v1/models, /health, /metrics,
 * /cluster/nodes. Requests are validated here, tokenized (chat template for messages), fanned out
 * into choices (route.c) and answered from the output hooks below. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

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

static void respond_err(router *r, pd_http_req *req, api_kind kind, int status, const char *msg,
                        const char *code) {
  pd_http_respond_error(req, status, msg, NULL, code, NULL);
  rmetrics_request(r, api_name(kind), status);
  if (status >= 400) rmetrics_error(r, status == 400   ? "invalid_request"
                                       : status == 401 ? "auth"
                                       : status == 404 ? "not_found"
                                       : status == 429 ? "queue_full"
                                       : status == 503 ? "overloaded"
                                                       : "internal");
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
  if (q->n_prompts < 1) {
    snprintf(msg, cap, "the prompt must not be empty");
    return 400;
  }
  int longest = 0;
  for (int i = 0; i < q->n_prompts; i++) {
    if (q->prompts[i].n < 1) {
      snprintf(msg, cap, "the prompt must not be empty (it has no tokens)");
      return 400;
    }
    for (int k = 0; k < q->prompts[i].n; k++)
      if (q->prompts[i].ids[k] < 0 || q->prompts[i].ids[k] >= r->vocab_size) {
        snprintf(msg, cap, "token id %d is outside the vocabulary [0, %d)", q->prompts[i].ids[k],
                 r->vocab_size);
        return 400;
      }
    if (q->prompts[i].n > longest) longest = q->prompts[i].n;
  }
  if (p->max_tokens < 0) p->max_tokens = ctx - longest;
  if (p->max_tokens < 1 || longest + p->max_tokens > ctx) {
    snprintf(msg, cap,
             "This model's maximum context length is %d tokens. However, you requested %d tokens "
             "(%d in the prompt, %d in the completion). Please reduce the length of the prompt "
             "or completion.",
             ctx, longest + (p->max_tokens > 0 ? p->max_tokens : 0), longest,
             p->max_tokens > 0 ? p->max_tokens : 0);
    *code = "context_length_exceeded";
    return 400;
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
  pd_status st = pd_sampling_params_validate(p, r->vocab_size, &e);
  p->n = saved_n;
  if (st != PD_OK) {
    snprintf(msg, cap, "%s", e.msg);
    return 400;
  }
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
  if (route_queue_length(r) + q->n_subs > r->o.max_queue) {
    snprintf(msg, cap, "too many requests are waiting (%d); retry later", route_queue_length(r));
    return 429;
  }
  int n_prefill = registry_count(r, PD__ROLE__ROLE_PREFILL, false);
  if (n_prefill == 0 ||
      (q->op.p.max_tokens > 1 && registry_count(r, PD__ROLE__ROLE_DECODE, false) == 0)) {
    snprintf(msg, cap, "no %s node is available", n_prefill == 0 ? "prefill" : "decode");
    return 503;
  }
  return 0;
}

/* ---- parsing helpers ---- */

/* Whether body (JSON text) holds a \u0000 escape inside a string (C strings cannot carry it). */
static bool has_nul_escape(const char *b, size_t n) {
  bool in = false;
  for (size_t i = 0; i < n; i++) {
    if (!in) {
      if (b[i] == '"') in = true;
      continue;
    }
    if (b[i] == '"') in = false;
    else if (b[i] == '\\' && i + 1 < n) {
      if (b[i + 1] == 'u' && i + 5 < n && !strncmp(b + i + 2, "0000", 4)) return true;
      i++;
    }
  }
  return false;
}

/* Strict UTF-8 (no overlongs, surrogates or code points over U+10FFFF). */
static bool utf8_valid(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    int k;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) k = 1, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef) k = 2, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4) k = 3, cp = c & 0x07;
    else return false;
    if (i + (size_t)k >= n) return false;
    for (int j = 1; j <= k; j++) {
      if ((s[i + (size_t)j] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (s[i + (size_t)j] & 0x3f);
    }
    if ((k == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
        (k == 3 && (cp < 0x10000 || cp > 0x10ffff)))
      return false;
    i += (size_t)k + 1;
  }
  return true;
}

static const cJSON *field(const cJSON *o, const char *name) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
  return it && !cJSON_IsNull(it) ? it : NULL;
}

/* Boolean field: absent keeps *out; wrong type is an error. */
static bool get_bool(const cJSON *o, const char *name, bool *out, char *msg, size_t cap) {
  const cJSON *it = field(o, name);
  if (!it) return true;
  if (!cJSON_IsBool(it)) {
    snprintf(msg, cap, "'%s' must be a boolean", name);
    return false;
  }
  *out = cJSON_IsTrue(it);
  return true;
}

static bool is_int(const cJSON *v) {
  return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble);
}

/* Token ids from a JSON array; NULL with msg on error. */
static int32_t *ids_from_json(const cJSON *a, int *n, char *msg, size_t cap) {
  int k = cJSON_GetArraySize(a), i = 0;
  int32_t *ids = malloc((size_t)(k ? k : 1) * sizeof *ids);
  if (!ids) {
    snprintf(msg, cap, "out of memory");
    return NULL;
  }
  const cJSON *v;
  cJSON_ArrayForEach(v, a) {
    if (!is_int(v) || v->valuedouble < 0 || v->valuedouble > 2147483647.0) {
      snprintf(msg, cap, "'prompt' token ids must be non-negative integers");
      free(ids);
      return NULL;
    }
    ids[i++] = (int32_t)v->valuedouble;
  }
  *n = i;
  return ids;
}

/* Fields common to completions, chat and /generate. Returns 0 or an HTTP status. */
static int parse_common(router *r, rreq *q, const cJSON *body, int default_max, char *msg,
                        size_t cap, const char **code) {
  const cJSON *model = field(body, "model");
  if (model) {
    if (!cJSON_IsString(model)) {
      snprintf(msg, cap, "'model' must be a string");
      return 400;
    }
    if (strcmp(model->valuestring, r->model_name)) {
      snprintf(msg, cap, "The model `%.200s` does not exist.", model->valuestring);
      *code = "model_not_found";
      return 404;
    }
  }
  pd_err e = {0};
  const cJSON *mt = field(body, "max_tokens");
  if (!mt) mt = field(body, "max_completion_tokens");
  if (mt && (!is_int(mt) || mt->valuedouble < 1)) {
    snprintf(msg, cap, "'max_tokens' must be a positive integer");
    return 400;
  }
  if (pd_oai_params_parse(body, default_max, &q->op, &e) != PD_OK) {
    snprintf(msg, cap, "%s", e.msg);
    return 400;
  }
  const cJSON *nf = field(body, "n");
  if (nf && (!is_int(nf) || nf->valuedouble < 1 || nf->valuedouble > r->o.max_n)) {
    snprintf(msg, cap, "'n' must be an integer in [1, %d]", r->o.max_n);
    return 400;
  }
  const cJSON *best_of = field(body, "best_of");
  if (best_of && (!is_int(best_of) || best_of->valuedouble != (q->op.p.n > 0 ? q->op.p.n : 1))) {
    snprintf(msg, cap, "'best_of' other than n is not supported");
    return 400;
  }
  if (!get_bool(body, "stream", &q->stream, msg, cap) ||
      !get_bool(body, "skip_special_tokens", &q->skip_special, msg, cap) ||
      !get_bool(body, "include_stop_str_in_output", &q->include_stop_str, msg, cap))
    return 400;
  const cJSON *so = field(body, "stream_options");
  if (so) {
    if (!cJSON_IsObject(so)) {
      snprintf(msg, cap, "'stream_options' must be an object");
      return 400;
    }
    if (!get_bool(so, "include_usage", &q->include_usage, msg, cap) ||
        !get_bool(so, "continuous_usage_stats", &q->continuous_usage, msg, cap))
      return 400;
  }
  const cJSON *stop = field(body, "stop");
  if (stop) {
    int k = cJSON_IsString(stop) ? 1 : cJSON_IsArray(stop) ? cJSON_GetArraySize(stop) : -1;
    if (k < 0 || k > 16) {
      snprintf(msg, cap, "'stop' must be a string or a list of at most 16 strings");
      return 400;
    }
    q->stop = calloc((size_t)(k ? k : 1), sizeof *q->stop);
    if (!q->stop) return 500;
    const cJSON *v = cJSON_IsString(stop) ? stop : stop->child;
    for (int i = 0; i < k; i++, v = v->next) {
      if (!cJSON_IsString(v) || !v->valuestring[0] || strlen(v->valuestring) > 256) {
        snprintf(msg, cap, "'stop' strings must be non-empty strings of at most 256 bytes");
        return 400;
      }
      q->stop[q->n_stop++] = strdup(v->valuestring);
    }
  }
  const cJSON *salt = field(body, "cache_salt");
  if (salt) {
    if (!cJSON_IsString(salt) || strlen(salt->valuestring) > 256) {
      snprintf(msg, cap, "'cache_salt' must be a string of at most 256 bytes");
      return 400;
    }
    snprintf(q->cache_salt_str, sizeof q->cache_salt_str, "%s", salt->valuestring);
    q->cache_salt = pd_node_cache_salt(salt->valuestring);
  }
  const cJSON *tools = field(body, "tools");
  if (tools && cJSON_IsArray(tools) && cJSON_GetArraySize(tools) > 0) {
    snprintf(msg, cap, "tools are not supported by this server");
    return 400;
  }
  const cJSON *rf = field(body, "response_format");
  if (rf) {
    const cJSON *t = cJSON_IsObject(rf) ? field(rf, "type") : NULL;
    if (!t || !cJSON_IsString(t) || strcmp(t->valuestring, "text")) {
      snprintf(msg, cap, "only response_format {\"type\": \"text\"} is supported");
      return 400;
    }
  }
  q->lp_top = q->op.p.logprobs;
  q->want_prompt_lp = q->op.p.prompt_logprobs >= 0;
  if (q->lp_top > PD_SAMPLE_MAX_LOGPROBS || q->op.p.prompt_logprobs > PD_SAMPLE_MAX_LOGPROBS) {
    snprintf(msg, cap, "logprobs must be at most %d", PD_SAMPLE_MAX_LOGPROBS);
    return 400;
  }
  return 0;
}

/* The prompt(s) of a completion: strings to tokenize or token ids, in order, into p. */
static int parse_completion_prompt(api_prep *p, const cJSON *body, char *msg, size_t cap) {
  const cJSON *pr = field(body, "prompt");
  bool add_special = true;
  if (!get_bool(body, "add_special_tokens", &add_special, msg, cap)) return 400;
  if (!pr) {
    snprintf(msg, cap, "'prompt' is required");
    return 400;
  }
  if (cJSON_IsString(pr)) {
    if (!pr->valuestring[0]) {
      snprintf(msg, cap, "the prompt must not be empty");
      return 400;
    }
    return api_prep_text(p, pr->valuestring, strlen(pr->valuestring), add_special) ? 0 : 500;
  }
  if (!cJSON_IsArray(pr) || cJSON_GetArraySize(pr) == 0) {
    snprintf(msg, cap, "'prompt' must be a string, a list of strings, a list of token ids or a "
             "list of lists of token ids, and not empty");
    return 400;
  }
  const cJSON *first = pr->child;
  if (cJSON_IsNumber(first)) { /* one prompt of token ids */
    int n;
    int32_t *ids = ids_from_json(pr, &n, msg, cap);
    if (!ids) return 400;
    return api_prep_ids(p, ids, n) ? 0 : 500;
  }
  if (cJSON_GetArraySize(pr) > 64) {
    snprintf(msg, cap, "at most 64 prompts per request");
    return 400;
  }
  const cJSON *v;
  cJSON_ArrayForEach(v, pr) {
    if (cJSON_IsString(v)) {
      if (!v->valuestring[0]) {
        snprintf(msg, cap, "the prompt must not be empty");
        return 400;
      }
      if (!api_prep_text(p, v->valuestring, strlen(v->valuestring), add_special)) return 500;
    } else if (cJSON_IsArray(v)) {
      int n = 0;
      int32_t *ids = ids_from_json(v, &n, msg, cap);
      if (!ids) return 400;
      if (!api_prep_ids(p, ids, n)) return 500;
    } else {
      snprintf(msg, cap, "'prompt' list entries must be strings or lists of token ids");
      return 400;
    }
  }
  return 0;
}

/* The messages of a chat request into p (their strings stay in the parsed body, which p owns
 * by then; joined content parts are adopted by p). */
static int parse_chat_messages(api_prep *p, const cJSON *body, char *msg, size_t cap) {
  const cJSON *ms = field(body, "messages");
  if (!ms || !cJSON_IsArray(ms) || cJSON_GetArraySize(ms) == 0) {
    snprintf(msg, cap, "'messages' must be a non-empty list");
    return 400;
  }
  int k = cJSON_GetArraySize(ms), i = 0;
  if (k > 4096) {
    snprintf(msg, cap, "at most 4096 messages");
    return 400;
  }
  pd_chat_msg *m = calloc((size_t)k, sizeof *m);
  if (!m) return 500;
  int st = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, ms) {
    const cJSON *role = cJSON_IsObject(v) ? field(v, "role") : NULL;
    const cJSON *content = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    if (!role || !cJSON_IsString(role)) {
      snprintf(msg, cap, "messages[%d]: 'role' must be a string", i);
      st = 400;
      break;
    }
    m[i].role = role->valuestring;
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
          snprintf(msg, cap, "messages[%d]: only text content parts are supported", i);
          st = 400;
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
      snprintf(msg, cap, "messages[%d]: 'content' must be a string or a list of parts", i);
      st = 400;
      break;
    }
    i++;
  }
  bool add_gen = true, cont = false;
  if (!st && (!get_bool(body, "add_generation_prompt", &add_gen, msg, cap) ||
              !get_bool(body, "continue_final_message", &cont, msg, cap)))
    st = 400;
  if (!st && add_gen && cont && field(body, "add_generation_prompt")) {
    snprintf(msg, cap, "add_generation_prompt and continue_final_message cannot both be true");
    st = 400;
  }
  if (st) {
    free(m);
    return st;
  }
  return api_prep_chat(p, m, k, add_gen, cont, msg, cap);
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

/* One streamed chunk for choice s: text delta, logprobs, finish. */
static void stream_chunk(router *r, rsub *s, const char *text, size_t len, const pd_logprobs *lps,
                         int n, size_t lp_off, bool final) {
  rreq *q = s->req;
  if (!stream_begin(r, q)) return;
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
  if (!len && !n && !final) return;
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
  cJSON *lp = q->lp_top >= 0 && n ? lp_append(r, q, NULL, lps, n, lp_off) : NULL;
  if (lp) cJSON_AddItemToObject(c, "logprobs", lp);
  else cJSON_AddNullToObject(c, "logprobs");
  if (final) add_finish(c, s);
  else cJSON_AddNullToObject(c, "finish_reason");
  cJSON_AddItemToArray(ch, c);
  sse_json(q, o);
}

void api_http_tokens(router *r, rsub *s, size_t off, size_t len, const pd_logprobs *lps, int n) {
  rreq *q = s->req;
  if (!q->http) return;
  size_t echo_len = q->echo && q->prompts[s->prompt_i].text ? q->prompts[s->prompt_i].text_len : 0;
  if (q->kind == API_GENERATE) {
    if (q->stream && (len || n)) generate_stream_update(r, q);
    return;
  }
  if (!q->stream) {
    if (q->lp_top >= 0) s->lp_acc = lp_append(r, q, s->lp_acc, lps, n, echo_len + off);
    return;
  }
  if (q->echo && !s->echo_sent) {
    s->echo_sent = true;
    const prompt *p = &q->prompts[s->prompt_i];
    if (p->text) stream_chunk(r, s, p->text, p->text_len, NULL, 0, 0, false);
  }
  stream_chunk(r, s, s->text + off, len, lps, n, echo_len + off, false);
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
  stream_chunk(r, s, "", 0, NULL, 0, 0, true);
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
    respond_err(r, q->http, q->kind, status, s->err_msg, api_error_code_str(s->err_code));
    api_http_release(q);
    return;
  }
  if (q->stream) { /* nothing was streamed: an empty stream that ends properly */
    if (stream_begin(r, q)) {
      for (int i = 0; i < q->n_subs && q->kind != API_GENERATE; i++)
        stream_chunk(r, &q->subs[i], "", 0, NULL, 0, 0, true);
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
      if (s->index % q->n_per_prompt == 0 && q->subs[i].prompt_lp) {
        cJSON_AddItemToObject(c, "prompt_logprobs", s->prompt_lp);
        s->prompt_lp = NULL;
      }
      cJSON_AddItemToArray(ch, c);
    }
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

/* A request refused once its hold is taken: the answer goes out through the hold. */
static void http_refuse(router *r, rreq *q, int status, const char *msg, const char *code) {
  respond_err(r, q->http, q->kind, status, msg[0] ? msg : "out of memory", code);
  api_http_release(q);
  q->finished = true;
  router_retire(r, q);
}

/* Validates and parses the body here (about 3 ms per MB), then hands the prompts to the worker
 * pool: tokenizing and chat templates cost about 0.2 s per MB and would stall every client. */
static void handle_generation(router *r, pd_http_req *req, const pd_http_request *msg,
                              api_kind kind) {
  char err[1024] = "";
  const char *code = NULL;
  if (!utf8_valid((const unsigned char *)msg->body, msg->body_len)) {
    respond_err(r, req, kind, 400, "the request body is not valid UTF-8", NULL);
    return;
  }
  if (has_nul_escape(msg->body, msg->body_len)) {
    respond_err(r, req, kind, 400, "NUL characters (\\u0000) are not supported in strings", NULL);
    return;
  }
  cJSON *body = cJSON_ParseWithLength(msg->body, msg->body_len);
  if (!body || !cJSON_IsObject(body)) {
    cJSON_Delete(body);
    respond_err(r, req, kind, 400,
                msg->body_len ? "the request body is not a JSON object" : "the request body is empty",
                NULL);
    return;
  }
  rreq *q = api_req_new(r, kind);
  if (!q) {
    cJSON_Delete(body);
    respond_err(r, req, kind, 500, "out of memory", NULL);
    return;
  }
  if (api_http_hold(q, req) != PD_OK) {
    cJSON_Delete(body);
    api_cancel(r, q);
    return;
  }
  api_prep *p = api_prep_new(r, q, http_refuse);
  int default_max = kind == API_CHAT ? -1 : r->o.default_max_tokens;
  int st = p ? parse_common(r, q, body, default_max, err, sizeof err, &code) : 500;
  if (!st && kind == API_COMPLETIONS) {
    if (!get_bool(body, "echo", &q->echo, err, sizeof err)) st = 400;
    const cJSON *suffix = field(body, "suffix");
    if (!st && suffix && (!cJSON_IsString(suffix) || suffix->valuestring[0])) {
      snprintf(err, sizeof err, "'suffix' is not supported");
      st = 400;
    }
  }
  if (!st) {
    const cJSON *b = body;
    api_prep_own_json(p, body); /* the prompts and messages point into it */
    body = NULL;
    if (kind == API_CHAT) {
      st = parse_chat_messages(p, b, err, sizeof err);
    } else if (kind == API_GENERATE && !cJSON_IsString(field(b, "prompt"))) {
      snprintf(err, sizeof err, "'prompt' must be a string");
      st = 400;
    } else {
      st = parse_completion_prompt(p, b, err, sizeof err);
    }
  }
  cJSON_Delete(body);
  if (!st) {
    st = api_prep_submit(p, err, sizeof err, &code);
    if (!st) return; /* it goes on from the pool (perhaps already did) */
    p = NULL;
  }
  api_prep_free(p);
  http_refuse(r, q, st, err, code);
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

static void handle_models(router *r, pd_http_req *req) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "object", "list");
  cJSON *a = cJSON_AddArrayToObject(o, "data"), *m = cJSON_CreateObject();
  cJSON_AddStringToObject(m, "id", r->model_name);
  cJSON_AddStringToObject(m, "object", "model");
  cJSON_AddNumberToObject(m, "created", floor(pd_wall_s()));
  cJSON_AddStringToObject(m, "owned_by", "pdserve");
  cJSON_AddStringToObject(m, "root", r->model_name);
  cJSON_AddNullToObject(m, "parent");
  cJSON_AddNumberToObject(m, "max_model_len", registry_max_model_len(r));
  cJSON_AddArrayToObject(m, "permission");
  cJSON_AddItemToArray(a, m);
  respond_json(req, 200, o, NULL);
  cJSON_Delete(o);
}

static void handle_health(router *r, pd_http_req *req) {
  int p = registry_count(r, PD__ROLE__ROLE_PREFILL, true);
  int d = registry_count(r, PD__ROLE__ROLE_DECODE, true);
  bool ok = p > 0 && d > 0;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "status", ok ? "ok" : "unavailable");
  cJSON_AddNumberToObject(o, "prefill_nodes", p);
  cJSON_AddNumberToObject(o, "decode_nodes", d);
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
  if (pl >= sizeof p) pl = sizeof p - 1;
  memcpy(p, path, pl);
  p[pl] = 0;
  if (!strcmp(p, "/live")) { /* liveness: answered by the one event loop, so it runs */
    static const char ok[] = "{\"status\":\"ok\"}";
    if (!get) pd_http_respond_error(req, 405, "use GET", NULL, NULL, NULL);
    else pd_http_respond(req, 200, "application/json", NULL, 0, ok, sizeof ok - 1, NULL);
    goto out;
  }
  if (!strcmp(p, "/health")) {
    if (!get) pd_http_respond_error(req, 405, "use GET", NULL, NULL, NULL);
    else handle_health(r, req);
    goto out;
  }
  if (!strcmp(p, "/metrics")) {
    if (!get) pd_http_respond_error(req, 405, "use GET", NULL, NULL, NULL);
    else handle_metrics(r, req);
    goto out;
  }
  bool known = !strcmp(p, "/v1/models") || !strcmp(p, "/v1/completions") ||
               !strcmp(p, "/v1/chat/completions") || !strcmp(p, "/generate") ||
               !strcmp(p, "/cluster/nodes");
  if (!known) {
    pd_http_respond_error(req, 404, "Not Found", NULL, NULL, NULL);
    rmetrics_error(r, "not_found");
    goto out;
  }
  if (!auth_ok(r, msg)) {
    pd_http_header h[1] = {{"WWW-Authenticate", "Bearer"}};
    char *body = router_error_json(401, "Invalid or missing API key", "invalid_api_key");
    pd_http_respond(req, 401, "application/json", h, 1, body, body ? strlen(body) : 0, NULL);
    free(body);
    rmetrics_error(r, "auth");
    goto out;
  }
  if (!strcmp(p, "/v1/models")) {
    if (!get) pd_http_respond_error(req, 405, "use GET", NULL, NULL, NULL);
    else handle_models(r, req);
  } else if (!strcmp(p, "/cluster/nodes")) {
    if (!get) {
      pd_http_respond_error(req, 405, "use GET", NULL, NULL, NULL);
    } else {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddItemToObject(o, "nodes", registry_json(r));
      cJSON_AddNumberToObject(o, "queue_length", route_queue_length(r));
      cJSON_AddNumberToObject(o, "running", route_active_subs(r));
      respond_json(req, 200, o, NULL);
      cJSON_Delete(o);
    }
  } else if (!post) {
    pd_http_respond_error(req, 405, "use POST", NULL, NULL, NULL);
  } else if (!strcmp(p, "/v1/completions")) {
    handle_generation(r, req, msg, API_COMPLETIONS);
  } else if (!strcmp(p, "/v1/chat/completions")) {
    handle_generation(r, req, msg, API_CHAT);
  } else {
    handle_generation(r, req, msg, API_GENERATE);
  }
out:
  router_gc(r);
}
