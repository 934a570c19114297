/* Preparing a request's prompts off the event loop: tokenization and chat-template rendering
 * run in the router's worker pool (router/workpool.h), for the HTTP APIs and the ZeroMQ client
 * API alike. See "preparing prompts" in router.h for the ownership rules. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router.h"

/* Prompts above this many bytes take the pool's big lane (at most threads - 1 workers), so a
 * request of ordinary size never waits for several multi-megabyte ones: 64 KiB tokenizes in
 * about 15 ms. */
#define PREP_BIG_BYTES ((size_t)64 << 10)

typedef struct prep_in {
  const char *text; /* a prompt to tokenize (owned by the job), or NULL: ids given */
  size_t len;
  bool add_special;
  int32_t *ids; /* given token ids (owned by the job until they become a prompt) */
  int n;
} prep_in;

struct api_prep {
  pd_work w;
  router *r;
  rreq *q; /* the request; NULL once it was freed (loop thread only) */
  api_kind kind; /* q's, for the worker (which never reads q) */
  api_refuse_fn refuse;
  /* input: read by the worker, owned by the job */
  cJSON *json;   /* the parsed HTTP body the strings point into */
  void **owned;  /* other blocks the strings live in */
  int n_owned;
  prep_in *in;
  int n_in;
  pd_chat_msg *msgs; /* chat: rendered with the template into one prompt */
  int n_msgs;
  bool chat, add_gen, cont, chat_special;
  /* /tokenize and /detokenize: the job renders the answer */
  bool token_strs;
  int max_model_len;
  char *reply;
  size_t reply_len;
  size_t in_bytes; /* prompt texts, or roles and contents of the messages */
  /* output: written by the worker */
  prompt *prompts;
  int n_prompts;
  int status;
  char err[1024];
};

api_prep *api_prep_new(router *r, rreq *q, api_refuse_fn refuse) {
  api_prep *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->r = r;
  p->q = q;
  p->kind = q->kind;
  p->refuse = refuse;
  return p;
}

static void free_prompts(prompt *v, int n) {
  for (int i = 0; i < n; i++) {
    free(v[i].ids);
    free(v[i].text);
  }
  free(v);
}

void api_prep_free(api_prep *p) {
  if (!p) return;
  cJSON_Delete(p->json);
  for (int i = 0; i < p->n_owned; i++) free(p->owned[i]);
  free(p->owned);
  for (int i = 0; i < p->n_in; i++) free(p->in[i].ids);
  free(p->in);
  free(p->msgs);
  free_prompts(p->prompts, p->n_prompts);
  free(p->reply);
  free(p);
}

void api_prep_own_json(api_prep *p, cJSON *json) {
  PD_ASSERT(!p->json);
  p->json = json;
}

bool api_prep_adopt(api_prep *p, void *mem) {
  void **v = realloc(p->owned, (size_t)(p->n_owned + 1) * sizeof *v);
  if (!v) {
    free(mem);
    return false;
  }
  p->owned = v;
  p->owned[p->n_owned++] = mem;
  return true;
}

const char *api_prep_keep(api_prep *p, const char *s, size_t n) {
  char *c = malloc(n + 1);
  if (!c) return NULL;
  memcpy(c, s, n);
  c[n] = 0;
  return api_prep_adopt(p, c) ? c : NULL;
}

static prep_in *add_in(api_prep *p) {
  prep_in *v = realloc(p->in, (size_t)(p->n_in + 1) * sizeof *v);
  if (!v) return NULL;
  p->in = v;
  prep_in *x = &p->in[p->n_in++];
  memset(x, 0, sizeof *x);
  return x;
}

bool api_prep_text(api_prep *p, const char *text, size_t len, bool add_special) {
  prep_in *x = add_in(p);
  if (!x) return false;
  x->text = text;
  x->len = len;
  x->add_special = add_special;
  p->in_bytes += len;
  return true;
}

bool api_prep_ids(api_prep *p, int32_t *ids, int n) {
  prep_in *x = add_in(p);
  if (!x) {
    free(ids);
    return false;
  }
  x->ids = ids;
  x->n = n;
  return true;
}

int api_prep_chat(api_prep *p, pd_chat_msg *msgs, int n, bool add_gen, bool cont,
                  bool add_special, char *msg, size_t cap) {
  if (!pd_tokenizer_has_chat_template(p->r->tok)) {
    free(msgs);
    snprintf(msg, cap, "this model has no chat template: use /v1/completions");
    return 400;
  }
  PD_ASSERT(!p->chat && !p->n_in);
  p->chat = true;
  p->msgs = msgs;
  p->n_msgs = n;
  p->add_gen = add_gen;
  p->cont = cont;
  p->chat_special = add_special;
  for (int i = 0; i < n; i++) p->in_bytes += strlen(msgs[i].role) + strlen(msgs[i].content);
  return 0;
}

void api_prep_reply(api_prep *p, bool token_strs, int max_model_len) {
  p->token_strs = token_strs;
  p->max_model_len = max_model_len;
}

/* ---- the worker's side: only the job's own fields ---- */

static bool out_prompt(api_prep *p, int32_t *ids, int n, const char *text, size_t text_len) {
  prompt *v = realloc(p->prompts, (size_t)(p->n_prompts + 1) * sizeof *v);
  if (!v) {
    free(ids);
    return false;
  }
  p->prompts = v;
  prompt *x = &p->prompts[p->n_prompts++];
  memset(x, 0, sizeof *x);
  x->ids = ids;
  x->n = n;
  if (text) { /* kept for echo and /generate */
    x->text = malloc(text_len + 1);
    if (!x->text) return false;
    memcpy(x->text, text, text_len);
    x->text[text_len] = 0;
    x->text_len = text_len;
  }
  return true;
}

static int tokenize(api_prep *p, const char *text, size_t len, bool add_special, int32_t **ids,
                    int *n) {
  size_t nn = 0;
  pd_err e = {0};
  if (pd_tokenizer_encode(p->r->tok, text, len, add_special, ids, &nn, &e) != PD_OK) {
    snprintf(p->err, sizeof p->err, "cannot tokenize the prompt: %s", e.msg);
    return e.code == PD_ENOMEM ? 500 : 400;
  }
  *n = (int)nn;
  return 0;
}

/* Renders the messages through the chat template and tokenizes the result (no special tokens:
 * the template writes them). */
static int run_chat(api_prep *p) {
  char *text = NULL;
  pd_err e = {0};
  if (pd_tokenizer_apply_chat(p->r->tok, p->msgs, (size_t)p->n_msgs, p->add_gen && !p->cont,
                              &text, &e) != PD_OK) {
    snprintf(p->err, sizeof p->err, "cannot apply the chat template: %s", e.msg);
    return e.code == PD_ENOMEM ? 500 : 400;
  }
  size_t len = strlen(text);
  const pd_chat_msg *last = p->n_msgs > 0 ? &p->msgs[p->n_msgs - 1] : NULL;
  if (p->cont && last && last->content[0]) {
    /* continue the last message: cut what the template adds after its content (vLLM) */
    const char *c = last->content, *at = NULL;
    for (const char *s = strstr(text, c); s; s = strstr(s + 1, c)) at = s;
    if (at) len = (size_t)(at - text) + strlen(c);
  }
  int32_t *ids;
  int k;
  int st = tokenize(p, text, len, p->chat_special, &ids, &k);
  free(text);
  if (!st && !out_prompt(p, ids, k, NULL, 0)) st = 500;
  return st;
}

/* The answer of a /tokenize (vLLM's TokenizeResponse) or /detokenize (DetokenizeResponse)
 * request, from the job's one prompt. */
static int render_reply(api_prep *p) {
  const prompt *x = &p->prompts[0];
  cJSON *o = cJSON_CreateObject();
  if (!o) return 500;
  if (p->kind == API_TOKENIZE) {
    cJSON_AddNumberToObject(o, "count", x->n);
    cJSON_AddNumberToObject(o, "max_model_len", p->max_model_len);
    cJSON *t = cJSON_AddArrayToObject(o, "tokens"), *strs = NULL;
    if (p->token_strs) strs = cJSON_AddArrayToObject(o, "token_strs");
    else cJSON_AddNullToObject(o, "token_strs");
    for (int i = 0; i < x->n; i++) {
      cJSON_AddItemToArray(t, cJSON_CreateNumber(x->ids[i]));
      const char *s = strs ? pd_tokenizer_id_to_token(p->r->tok, x->ids[i]) : NULL;
      if (strs) cJSON_AddItemToArray(strs, cJSON_CreateString(s ? s : ""));
    }
  } else {
    cJSON_AddStringToObject(o, "prompt", x->text ? x->text : "");
  }
  p->reply = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (!p->reply) return 500;
  p->reply_len = strlen(p->reply);
  return 0;
}

static void prep_run(pd_work *w) {
  api_prep *p = (api_prep *)w;
  int st = 0;
  if (p->kind == API_DETOKENIZE) { /* one list of ids (checked against the vocabulary) */
    char *text = NULL;
    size_t len = 0;
    pd_err e = {0};
    if (pd_tokenizer_decode(p->r->tok, p->in[0].ids, (size_t)p->in[0].n, false, &text, &len,
                            &e) != PD_OK) {
      snprintf(p->err, sizeof p->err, "cannot decode the tokens: %s", e.msg);
      st = e.code == PD_ENOMEM ? 500 : 400;
    } else if (!out_prompt(p, NULL, 0, text, len)) {
      st = 500;
    }
    free(text);
  } else if (p->chat) {
    st = run_chat(p);
  } else {
    for (int i = 0; i < p->n_in && !st; i++) {
      prep_in *x = &p->in[i];
      if (!x->text) {
        int32_t *ids = x->ids;
        x->ids = NULL;
        if (!out_prompt(p, ids, x->n, NULL, 0)) st = 500;
        continue;
      }
      int32_t *ids;
      int n;
      st = tokenize(p, x->text, x->len, x->add_special, &ids, &n);
      if (!st && !out_prompt(p, ids, n, x->text, x->len)) st = 500;
    }
  }
  if (!st && (p->kind == API_TOKENIZE || p->kind == API_DETOKENIZE)) st = render_reply(p);
  if (st == 500 && !p->err[0]) snprintf(p->err, sizeof p->err, "out of memory");
  p->status = st;
}

/* ---- back on the loop ---- */

/* Hands the result to the request, if it still wants it, and frees the job: the request goes
 * on (context check, admission, route) or is refused. */
static void prep_finish(api_prep *p) {
  router *r = p->r;
  rreq *q = p->q;
  if (q) q->prep = NULL;
  if (!p->w.ran && !p->status) {
    p->status = 503;
    snprintf(p->err, sizeof p->err, "the server is shutting down");
  }
  if (q && !q->finished && !p->status && p->reply) {
    api_http_reply(r, q, p->reply, p->reply_len);
  } else if (q && !q->finished) {
    int st = p->status;
    const char *code = NULL;
    if (st == 400) /* the job could not tokenize, render or decode the input */
      snprintf(q->err_param, sizeof q->err_param, "%s",
               p->kind == API_DETOKENIZE ? "tokens" : p->chat ? "messages" : "prompt");
    if (!st) {
      PD_ASSERT(!q->prompts);
      q->prompts = p->prompts;
      q->n_prompts = p->n_prompts;
      p->prompts = NULL;
      p->n_prompts = 0;
      st = api_req_prepare(r, q, p->err, sizeof p->err, &code);
    }
    if (!st) st = api_req_admit(r, q, p->err, sizeof p->err);
    if (st) {
      p->refuse(r, q, st, p->err, code);
    } else {
      for (int i = 0; i < q->n_prompts; i++) pd_metric_add(r->m.prompt_tokens, q->prompts[i].n);
      pd_log(PD_LOG_DEBUG, "%s: %d prompt(s), %d choice(s), max_tokens %d%s", q->id, q->n_prompts,
             q->n_subs, q->op.p.max_tokens, q->stream ? ", stream" : "");
      route_submit(r, q);
    }
  }
  api_prep_free(p);
}

static void prep_done(pd_work *w) {
  router *r = ((api_prep *)w)->r;
  prep_finish((api_prep *)w);
  router_gc(r); /* a top-level callback: a safe point */
}

int api_prep_submit(api_prep *p, char *msg, size_t cap, const char **code) {
  router *r = p->r;
  rreq *q = p->q;
  int st = 0;
  size_t limit = (size_t)r->o.max_prompt_mb << 20;
  /* choices this request will make: more than the queue holds can never be admitted */
  bool generates = p->kind != API_TOKENIZE && p->kind != API_DETOKENIZE;
  long choices = (long)(p->chat ? 1 : p->n_in) * (q->op.p.n > 0 ? q->op.p.n : 1);
  q->err_param[0] = 0;
  if (p->in_bytes > limit) {
    snprintf(msg, cap,
             "the prompt is %zu bytes, over this server's limit of %zu bytes per request "
             "(--max-prompt-mb %d)",
             p->in_bytes, limit, r->o.max_prompt_mb);
    snprintf(q->err_param, sizeof q->err_param, "%s", p->chat ? "messages" : "prompt");
    *code = "string_above_max_length";
    st = 400;
  } else if (generates && choices > r->o.max_queue) {
    snprintf(msg, cap,
             "n x prompts = %ld choices can never fit this server's queue of %d (--max-queue)",
             choices, r->o.max_queue);
    snprintf(q->err_param, sizeof q->err_param, "n");
    st = 400;
  } else if (pd_workpool_pending(r->pool) >= (size_t)r->o.max_queue) {
    snprintf(msg, cap, "too many requests are waiting to be tokenized (%zu); retry later",
             pd_workpool_pending(r->pool));
    st = 429;
  }
  if (st) {
    api_prep_free(p);
    return st;
  }
  p->w.run = prep_run;
  p->w.done = prep_done;
  p->w.big = p->in_bytes > PREP_BIG_BYTES;
  bool work = p->chat || p->kind == API_DETOKENIZE;
  for (int i = 0; i < p->n_in && !work; i++) work = p->in[i].text != NULL;
  if (!work) { /* token ids only: nothing worth a thread hop */
    prep_run(&p->w);
    p->w.ran = true;
    prep_finish(p);
    return 0;
  }
  q->prep = p;
  pd_workpool_submit(r->pool, &p->w, NULL); /* cannot fail: run and done are set */
  return 0;
}

void api_prep_detach(rreq *q) {
  if (q->prep) q->prep->q = NULL;
  q->prep = NULL;
}

int api_prep_in_flight(router *r) { return r->pool ? (int)pd_workpool_pending(r->pool) : 0; }
