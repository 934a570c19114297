/* Output text of a choice: incremental detokenization, stop strings, logprobs in the OpenAI
 * shapes, and the hand-off from the routing layer to the HTTP or ZeroMQ frontend.
 *
 * Stop strings. Decoded text first goes to a hold buffer. After every token the hold buffer is
 * searched for the earliest complete stop string: the text before it is emitted (with the stop
 * string too when include_stop_str_in_output), and the choice ends; the tokens after the one
 * that completed the match are discarded. Otherwise everything is emitted except the longest
 * suffix that is a prefix of some stop string (it may still grow into one). Emitted text never
 * contains a complete stop string and never ends inside a stop string's prefix, so a match
 * always starts inside the hold buffer. The detokenizer never splits a UTF-8 sequence and a
 * stop string starts on a character boundary, so emitted deltas are whole characters. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router.h"

static bool grow(char **buf, size_t *cap, size_t need) {
  if (need <= *cap) return true;
  size_t c = *cap ? *cap : 256;
  while (c < need) c *= 2;
  char *b = realloc(*buf, c);
  if (!b) return false;
  *buf = b;
  *cap = c;
  return true;
}

static bool hold_append(rsub *s, const char *t, size_t n) {
  if (!n) return true;
  if (!grow(&s->hold, &s->cap_hold, s->n_hold + n + 1)) return false;
  memcpy(s->hold + s->n_hold, t, n);
  s->n_hold += n;
  s->hold[s->n_hold] = 0;
  return true;
}

/* Moves the first n bytes of hold to text. */
static bool emit(rsub *s, size_t n) {
  if (!n) return true;
  if (!grow(&s->text, &s->cap_text, s->n_text + n + 1)) return false;
  memcpy(s->text + s->n_text, s->hold, n);
  s->n_text += n;
  s->text[s->n_text] = 0;
  memmove(s->hold, s->hold + n, s->n_hold - n);
  s->n_hold -= n;
  if (s->hold) s->hold[s->n_hold] = 0;
  return true;
}

static bool emit_str(rsub *s, const char *t, size_t n) {
  if (!grow(&s->text, &s->cap_text, s->n_text + n + 1)) return false;
  memcpy(s->text + s->n_text, t, n);
  s->n_text += n;
  s->text[s->n_text] = 0;
  return true;
}

/* Earliest complete stop string in hold: its position, and which one (longest on ties). */
static bool find_stop(const rreq *q, const rsub *s, size_t *pos, int *which) {
  bool found = false;
  for (int k = 0; k < q->n_stop; k++) {
    const char *m = s->n_hold ? memmem(s->hold, s->n_hold, q->stop[k], strlen(q->stop[k])) : NULL;
    if (!m) continue;
    size_t p = (size_t)(m - s->hold);
    if (!found || p < *pos || (p == *pos && strlen(q->stop[k]) > strlen(q->stop[*which]))) {
      *pos = p;
      *which = k;
      found = true;
    }
  }
  return found;
}

/* Length of the longest suffix of hold that is a proper prefix of some stop string. */
static size_t partial_stop(const rreq *q, const rsub *s) {
  size_t best = 0;
  for (int k = 0; k < q->n_stop; k++) {
    size_t ls = strlen(q->stop[k]);
    size_t max = ls - 1 < s->n_hold ? ls - 1 : s->n_hold;
    for (size_t l = max; l > best; l--)
      if (!memcmp(s->hold + s->n_hold - l, q->stop[k], l)) {
        best = l;
        break;
      }
  }
  return best;
}

static bool stop_check(rreq *q, rsub *s) {
  size_t pos = 0;
  int k = 0;
  if (!q->n_stop || !find_stop(q, s, &pos, &k)) return false;
  emit(s, pos);
  if (q->include_stop_str) emit_str(s, q->stop[k], strlen(q->stop[k]));
  s->n_hold = 0;
  free(s->stop_string);
  s->stop_string = strdup(q->stop[k]);
  return true;
}

void text_feed(router *r, rsub *s, const int32_t *ids, int n, bool final, size_t *delta_off,
               size_t *delta_len, bool *stopped, int *used) {
  rreq *q = s->req;
  *delta_off = s->n_text;
  *stopped = false;
  *used = 0;
  if (!s->detok) s->detok = pd_detok_new(r->tok, q->skip_special);
  for (int i = 0; i < n; i++) {
    *used = i + 1;
    const char *out = NULL;
    size_t len = 0;
    pd_err e = {0};
    if (s->detok && pd_detok_push(s->detok, ids[i], &out, &len, &e) == PD_OK) hold_append(s, out, len);
    if (stop_check(q, s)) {
      *stopped = true;
      break;
    }
  }
  if (!*stopped) {
    if (final) {
      const char *out = NULL;
      size_t len = 0;
      pd_err e = {0};
      if (s->detok && pd_detok_flush(s->detok, &out, &len, &e) == PD_OK) hold_append(s, out, len);
      if (stop_check(q, s)) *stopped = true;
      else emit(s, s->n_hold);
    } else {
      emit(s, s->n_hold - partial_stop(q, s));
    }
  }
  *delta_len = s->n_text - *delta_off;
}

void text_free(rsub *s) {
  pd_detok_free(s->detok);
  s->detok = NULL;
  free(s->hold);
  free(s->text);
  free(s->stop_string);
  free(s->lp_store);
  s->hold = s->text = s->stop_string = NULL;
  s->lp_store = NULL;
  cJSON_Delete(s->lp_acc);
  cJSON_Delete(s->prompt_lp);
  s->lp_acc = s->prompt_lp = NULL;
}

/* ---- logprobs ---- */

char *token_str(router *r, int32_t id) {
  char *t = NULL;
  size_t len = 0;
  pd_err e = {0};
  if (pd_tokenizer_decode(r->tok, &id, 1, false, &t, &len, &e) != PD_OK) return strdup("");
  return t;
}

static double lp_val(float v) { return isfinite(v) ? (double)v : -9999.0; }

static cJSON *bytes_json(const char *s) {
  cJSON *a = cJSON_CreateArray();
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    cJSON_AddItemToArray(a, cJSON_CreateNumber(*p));
  return a;
}

static cJSON *completions_lp_new(void) {
  cJSON *acc = cJSON_CreateObject();
  cJSON_AddArrayToObject(acc, "tokens");
  cJSON_AddArrayToObject(acc, "token_logprobs");
  cJSON_AddArrayToObject(acc, "top_logprobs");
  cJSON_AddArrayToObject(acc, "text_offset");
  return acc;
}

/* d[token] = logprob; a token string seen before keeps its place and takes the new value, as
 * a Python dict does in vLLM. */
static void top_put(cJSON *d, const char *token, float logprob) {
  cJSON *v = cJSON_CreateNumber(lp_val(logprob));
  if (cJSON_GetObjectItemCaseSensitive(d, token)) cJSON_ReplaceItemInObjectCaseSensitive(d, token, v);
  else cJSON_AddItemToObject(d, token, v);
}

cJSON *lp_append(router *r, rreq *q, cJSON *acc, const pd_logprobs *lps, int n, size_t offset0) {
  if (!lps || n <= 0) return acc;
  if (q->kind == API_CHAT) {
    if (!acc) {
      acc = cJSON_CreateObject();
      cJSON_AddArrayToObject(acc, "content");
    }
    cJSON *content = cJSON_GetObjectItem(acc, "content");
    for (int i = 0; i < n; i++) {
      char *t = token_str(r, lps[i].token);
      cJSON *o = cJSON_CreateObject();
      cJSON_AddStringToObject(o, "token", t);
      cJSON_AddNumberToObject(o, "logprob", lp_val(lps[i].logprob));
      cJSON_AddItemToObject(o, "bytes", bytes_json(t));
      cJSON *top = cJSON_AddArrayToObject(o, "top_logprobs");
      for (int k = 0; k < lps[i].n_top && k < q->lp_top; k++) {
        char *tt = token_str(r, lps[i].top[k].id);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "token", tt);
        cJSON_AddNumberToObject(e, "logprob", lp_val(lps[i].top[k].logprob));
        cJSON_AddItemToObject(e, "bytes", bytes_json(tt));
        cJSON_AddItemToArray(top, e);
        free(tt);
      }
      cJSON_AddItemToArray(content, o);
      free(t);
    }
    return acc;
  }
  if (!acc) acc = completions_lp_new();
  cJSON *toks = cJSON_GetObjectItem(acc, "tokens"), *tlp = cJSON_GetObjectItem(acc, "token_logprobs");
  cJSON *top = cJSON_GetObjectItem(acc, "top_logprobs"), *off = cJSON_GetObjectItem(acc, "text_offset");
  size_t o = offset0;
  for (int i = 0; i < n; i++) {
    char *t = token_str(r, lps[i].token);
    cJSON_AddItemToArray(toks, cJSON_CreateString(t));
    cJSON_AddItemToArray(tlp, cJSON_CreateNumber(lp_val(lps[i].logprob)));
    /* vLLM: the chosen token, then the others by likelihood, logprobs + 1 entries at most */
    cJSON *d = cJSON_CreateObject();
    top_put(d, t, lps[i].logprob);
    for (int k = 0, taken = 1; k < lps[i].n_top && taken <= q->lp_top; k++) {
      if (lps[i].top[k].id == lps[i].token) continue;
      char *tt = token_str(r, lps[i].top[k].id);
      top_put(d, tt, lps[i].top[k].logprob);
      free(tt);
      taken++;
    }
    cJSON_AddItemToArray(top, d);
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)o));
    o += strlen(t);
    free(t);
  }
  return acc;
}

cJSON *echo_lp_json(router *r, rsub *s) {
  rreq *q = s->req;
  const prompt *p = &q->prompts[s->prompt_i];
  cJSON *acc = completions_lp_new();
  cJSON *toks = cJSON_GetObjectItem(acc, "tokens"), *tlp = cJSON_GetObjectItem(acc, "token_logprobs");
  cJSON *top = cJSON_GetObjectItem(acc, "top_logprobs"), *off = cJSON_GetObjectItem(acc, "text_offset");
  /* s->prompt_lp: [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...], the prompt token
   * first in each position, then its alternatives */
  const cJSON *pos = s->prompt_lp ? s->prompt_lp->child : NULL;
  size_t o = 0;
  for (int j = 0; j < p->n; j++, pos = pos ? pos->next : NULL) {
    char *t = token_str(r, p->ids[j]);
    cJSON_AddItemToArray(toks, cJSON_CreateString(t));
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)o));
    o += strlen(t);
    free(t);
    char key[16];
    snprintf(key, sizeof key, "%d", p->ids[j]);
    const cJSON *own = cJSON_IsObject(pos) ? cJSON_GetObjectItemCaseSensitive(pos, key) : NULL;
    if (!own) { /* the first token: nothing before it to predict it */
      cJSON_AddItemToArray(tlp, cJSON_CreateNull());
      cJSON_AddItemToArray(top, cJSON_CreateNull());
      continue;
    }
    cJSON_AddItemToArray(tlp, cJSON_CreateNumber(cJSON_GetObjectItem(own, "logprob")->valuedouble));
    cJSON *d = cJSON_CreateObject();
    int taken = 0;
    for (const cJSON *e = pos->child; e && taken <= q->lp_top; e = e->next, taken++) {
      const cJSON *dt = cJSON_GetObjectItem(e, "decoded_token");
      top_put(d, cJSON_IsString(dt) ? dt->valuestring : "",
              (float)cJSON_GetObjectItem(e, "logprob")->valuedouble);
    }
    cJSON_AddItemToArray(top, d);
  }
  return acc;
}

cJSON *prompt_lp_json(router *r, rsub *s, Pd__TokenLogprob *const *lps, int n) {
  (void)s;
  cJSON *a = cJSON_CreateArray();
  cJSON_AddItemToArray(a, cJSON_CreateNull());
  for (int i = 0; i < n; i++) {
    const Pd__TokenLogprob *w = lps[i];
    cJSON *pos = cJSON_CreateObject();
    char key[16], *t = token_str(r, w->token_id);
    snprintf(key, sizeof key, "%d", w->token_id);
    cJSON *o = cJSON_AddObjectToObject(pos, key);
    cJSON_AddNumberToObject(o, "logprob", lp_val(w->logprob));
    cJSON_AddNumberToObject(o, "rank", w->rank);
    cJSON_AddStringToObject(o, "decoded_token", t);
    free(t);
    for (size_t k = 0; k < w->n_top; k++) {
      snprintf(key, sizeof key, "%d", w->top[k]->token_id);
      if (cJSON_GetObjectItemCaseSensitive(pos, key)) continue;
      char *tt = token_str(r, w->top[k]->token_id);
      cJSON *e = cJSON_AddObjectToObject(pos, key);
      cJSON_AddNumberToObject(e, "logprob", lp_val(w->top[k]->logprob));
      cJSON_AddNumberToObject(e, "rank", (double)(k + 1));
      cJSON_AddStringToObject(e, "decoded_token", tt);
      free(tt);
    }
    cJSON_AddItemToArray(a, pos);
  }
  return a;
}

/* ---- from the routing layer ---- */

void out_tokens(router *r, rsub *s, const int32_t *ids, const pd_logprobs *lps, int n,
                Pd__FinishReason node_finish) {
  rreq *q = s->req;
  size_t off = 0, len = 0;
  bool stopped = false;
  int used = 0;
  text_feed(r, s, ids, n, node_finish != PD__FINISH_REASON__FINISH_REASON_NONE, &off, &len,
            &stopped, &used);
  s->n_out_tokens += used;
  /* set before the output hooks run, so that a stream's last chunk carries it */
  if (stopped) {
    s->finish_reason = "stop";
  } else if (node_finish == PD__FINISH_REASON__FINISH_REASON_STOP) {
    s->finish_reason = "stop";
    if (n > 0) s->stop_token = ids[n - 1];
  } else if (node_finish != PD__FINISH_REASON__FINISH_REASON_NONE) {
    s->finish_reason = "length";
  }
  if (!q->cancelled) {
    if (q->kind == API_ZMQ) zapi_tokens(r, s, off, len, ids, lps, used);
    else api_http_tokens(r, s, off, len, lps, used);
  }
  if (stopped && !s->finished) {
    route_sub_stop(r, s);
    s->finished = true;
    out_sub_done(r, s);
  }
}

void out_sub_done(router *r, rsub *s) {
  rreq *q = s->req;
  q->n_done++;
  if (!q->cancelled) {
    if (q->kind == API_ZMQ) zapi_sub_done(r, s);
    else api_http_sub_done(r, s);
  }
  if (q->n_done == q->n_subs && !q->finished) {
    q->finished = true;
    pd_metric_observe(r->m.e2e, (double)(pd_now_ms() - q->t_start) / 1000.0);
    if (!q->cancelled) {
      if (q->kind == API_ZMQ) zapi_req_done(r, q);
      else api_http_req_done(r, q);
    }
    router_retire(r, q);
  }
}
