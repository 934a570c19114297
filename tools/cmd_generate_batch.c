/* pdctl generate --model DIR --input prompts.jsonl --output out.jsonl: offline batch inference.
 *
 * Every line of the input is one request: "prompt" (text, no special tokens added),
 * "prompt_ids" (token ids) or "messages" (a chat, through the chat template), plus any sampling
 * field (max_tokens, temperature, top_p, top_k, min_p, seed, n, logprobs, prompt_logprobs,
 * penalties, logit_bias, stop_token_ids, ignore_eos, min_tokens). All lines go through the
 * continuous-batching scheduler together; the output has one JSON object per input line, in
 * input order. A malformed line gets {"index": i, "error": {...}} and the others still run. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd/json.h"
#include "pd/oai.h"
#include "pd/runtime.h"
#include "pdctl.h"

typedef struct choice {
  int32_t *ids;
  int n, cap;
  pd_finish_reason finish;
  cJSON *logprobs; /* array or NULL */
} choice;

typedef struct item {
  cJSON *error; /* set for lines that failed */
  int n_prompt, n_choices, cached;
  choice *ch;
  cJSON *prompt_logprobs;
  int done; /* finished choices */
} item;

typedef struct batch {
  item *items;
  int n_items;
  uint64_t generated;
  int finished;
} batch;

static cJSON *lp_json(const pd_logprobs *lp) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "token", lp->token);
  cJSON_AddNumberToObject(o, "logprob", lp->logprob);
  cJSON_AddNumberToObject(o, "rank", lp->rank);
  cJSON *top = cJSON_AddArrayToObject(o, "top_logprobs");
  for (int i = 0; i < lp->n_top; i++) {
    cJSON *t = cJSON_CreateObject();
    cJSON_AddNumberToObject(t, "token", lp->top[i].id);
    cJSON_AddNumberToObject(t, "logprob", lp->top[i].logprob);
    cJSON_AddItemToArray(top, t);
  }
  return o;
}

static void on_event(void *user, const pd_sched_event *ev) {
  batch *b = user;
  item *it = &b->items[ev->id];
  choice *c = &it->ch[ev->index];
  if (ev->prompt_logprobs) {
    it->prompt_logprobs = cJSON_CreateArray();
    cJSON_AddItemToArray(it->prompt_logprobs, cJSON_CreateNull());
    for (int i = 0; i < ev->n_prompt_logprobs; i++)
      cJSON_AddItemToArray(it->prompt_logprobs, lp_json(&ev->prompt_logprobs[i]));
  }
  it->cached = ev->num_cached_tokens;
  if (ev->token >= 0) {
    if (c->n == c->cap) {
      int cap = c->cap ? 2 * c->cap : 64;
      int32_t *t = realloc(c->ids, (size_t)cap * sizeof *t);
      PD_ASSERT(t);
      c->ids = t;
      c->cap = cap;
    }
    c->ids[c->n++] = ev->token;
    b->generated++;
    if (ev->logprobs) {
      if (!c->logprobs) c->logprobs = cJSON_CreateArray();
      cJSON_AddItemToArray(c->logprobs, lp_json(ev->logprobs));
    }
  }
  if (ev->finish != PD_FINISH_NONE) {
    c->finish = ev->finish;
    if (++it->done == it->n_choices) b->finished++;
  }
}

static cJSON *line_error(const char *msg) {
  return pd_oai_error(msg, "invalid_request_error", 400);
}

/* Tokenizes one request line; fills ids or returns an error object. */
static cJSON *line_prompt(const pd_runtime *rt, const cJSON *obj, int32_t **ids, size_t *n) {
  const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(obj, "prompt");
  const cJSON *pids = cJSON_GetObjectItemCaseSensitive(obj, "prompt_ids");
  const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(obj, "messages");
  pd_err e = {0};
  if (!!prompt + !!pids + !!msgs != 1)
    return line_error("give exactly one of 'prompt', 'prompt_ids', 'messages'");
  if (prompt) {
    if (!cJSON_IsString(prompt)) return line_error("'prompt' must be a string");
    if (pd_tokenizer_encode(rt->tok, prompt->valuestring, strlen(prompt->valuestring), false,
                            ids, n, &e) != PD_OK)
      return line_error(e.msg);
    return NULL;
  }
  if (pids) {
    if (!cJSON_IsArray(pids)) return line_error("'prompt_ids' must be a list of token ids");
    int k = cJSON_GetArraySize(pids);
    *ids = malloc((size_t)(k ? k : 1) * sizeof **ids);
    if (!*ids) return line_error("out of memory");
    *n = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, pids) {
      if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 2147483647.0 ||
          v->valuedouble != (double)(int32_t)v->valuedouble) {
        free(*ids);
        *ids = NULL;
        return line_error("'prompt_ids' must hold non-negative integer token ids");
      }
      (*ids)[(*n)++] = (int32_t)v->valuedouble;
    }
    return NULL;
  }
  if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
    return line_error("'messages' must be a non-empty list");
  int k = cJSON_GetArraySize(msgs), i = 0;
  pd_chat_msg *m = calloc((size_t)k, sizeof *m);
  if (!m) return line_error("out of memory");
  const cJSON *v;
  cJSON_ArrayForEach(v, msgs) {
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(v, "role");
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!cJSON_IsString(role) || !cJSON_IsString(content)) {
      free(m);
      return line_error("each message needs string 'role' and 'content'");
    }
    m[i++] = (pd_chat_msg){role->valuestring, content->valuestring};
  }
  char *text = NULL;
  cJSON *err = NULL;
  if (pd_tokenizer_apply_chat(rt->tok, m, (size_t)k, true, &text, &e) != PD_OK ||
      pd_tokenizer_encode(rt->tok, text, strlen(text), false, ids, n, &e) != PD_OK)
    err = line_error(e.msg);
  free(text);
  free(m);
  return err;
}

static void progress(const batch *b, double t0, bool final) {
  double dt = pdctl_now() - t0;
  int w = 30, fill = b->n_items ? (int)((double)w * b->finished / b->n_items) : w;
  char bar[64];
  for (int i = 0; i < w; i++) bar[i] = i < fill ? '#' : '.';
  bar[w] = 0;
  fprintf(stderr, "\r[%s] %d/%d requests, %llu tokens, %.0f tok/s%s", bar, b->finished,
          b->n_items, (unsigned long long)b->generated, dt > 0 ? b->generated / dt : 0.0,
          final ? "\n" : "");
}

int cmd_generate_batch(int argc, char **argv) {
  pd_runtime_opts ro;
  pd_runtime_opts_default(&ro);
  const char *input = NULL, *output = NULL, *model = NULL;
  bool help = false, quiet = false;
  int default_max = 256;
  pd_opt opts[64] = {
      {"model", PD_OPT_STR, &model, "DIR", "Hugging Face model folder", NULL},
      {"input", PD_OPT_STR, &input, "FILE", "requests, one JSON object per line", NULL},
      {"output", PD_OPT_STR, &output, "FILE", "results, one JSON object per line (- = stdout)",
       NULL},
      {"max-tokens", PD_OPT_INT, &default_max, "N", "default max_tokens of a line (256)", NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "no progress bar", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
  };
  int n0 = 0;
  while (opts[n0].name) n0++;
  if (pd_runtime_opts_table(&ro, opts + n0, 64 - n0) < 0) return pdctl_fail("option table");
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl generate --model DIR --input FILE --output FILE [options]\n", stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!model || !input || !output)
    return pdctl_fail("batch mode needs --model, --input and --output");
  ro.model_dir = model;
  FILE *in = strcmp(input, "-") ? fopen(input, "r") : stdin;
  if (!in) return pdctl_fail("cannot read %s", input);

  batch b = {0};
  pd_runtime rt;
  if (pd_runtime_open(&rt, &ro, on_event, &b, &e) != PD_OK) {
    if (in != stdin) fclose(in);
    return pdctl_fail("%s", e.msg);
  }
  int cap = 0, rc = 0;
  char *line = NULL;
  size_t lcap = 0;
  ssize_t len;
  while ((len = getline(&line, &lcap, in)) >= 0) {
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
    if (len == 0) continue; /* blank lines are not requests */
    if (b.n_items == cap) {
      cap = cap ? 2 * cap : 64;
      item *t = realloc(b.items, (size_t)cap * sizeof *t);
      if (!t) return pdctl_fail("out of memory");
      b.items = t;
    }
    int idx = b.n_items++;
    item *it = &b.items[idx];
    memset(it, 0, sizeof *it);
    pd_json_error je;
    cJSON *obj = pd_json_parse(line, (size_t)len, &je);
    if (!obj || !cJSON_IsObject(obj)) {
      char why[512];
      snprintf(why, sizeof why, "the line is not a JSON object%s%s%s%s", obj ? "" : ": ",
               obj ? "" : je.msg, obj || !je.param[0] ? "" : " at ", obj ? "" : je.param);
      it->error = line_error(why);
      cJSON_Delete(obj);
      continue;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    it->error = line_prompt(&rt, obj, &ids, &n);
    pd_oai_params op;
    if (!it->error) {
      if (pd_oai_params_parse(obj, default_max, &op, NULL, &e) != PD_OK) {
        it->error = line_error(e.msg);
      } else {
        it->n_prompt = (int)n;
        it->n_choices = op.p.n > 0 ? op.p.n : 1;
        it->ch = calloc((size_t)it->n_choices, sizeof *it->ch);
        if (!it->ch) return pdctl_fail("out of memory");
        if (pd_sched_add(rt.sched, (uint64_t)idx, ids, (int)n, &op.p, &e) != PD_OK)
          it->error = line_error(e.msg);
        pd_oai_params_free(&op);
      }
    }
    free(ids);
    cJSON_Delete(obj);
    if (it->error) b.finished++;
  }
  free(line);
  if (in != stdin) fclose(in);

  bool tty = !quiet && isatty(2);
  double t0 = pdctl_now(), last = 0;
  while (pd_sched_has_work(rt.sched)) {
    if (pd_sched_step(rt.sched, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
      break;
    }
    if (tty && pdctl_now() - last > 0.1) {
      progress(&b, t0, false);
      last = pdctl_now();
    }
  }
  if (tty) progress(&b, t0, true);

  FILE *out = strcmp(output, "-") ? fopen(output, "w") : stdout;
  if (!out) {
    rc = pdctl_fail("cannot write %s", output);
  }
  for (int i = 0; i < b.n_items && out; i++) {
    item *it = &b.items[i];
    cJSON *o = it->error ? it->error : cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", i);
    if (!it->error) {
      cJSON *chs = cJSON_AddArrayToObject(o, "choices");
      int total = 0;
      for (int k = 0; k < it->n_choices; k++) {
        choice *c = &it->ch[k];
        cJSON *co = cJSON_CreateObject();
        cJSON_AddNumberToObject(co, "index", k);
        cJSON *ids = cJSON_AddArrayToObject(co, "output_ids");
        for (int t = 0; t < c->n; t++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(c->ids[t]));
        char *text = NULL;
        size_t tl = 0;
        if (pd_tokenizer_decode(rt.tok, c->ids, (size_t)c->n, true, &text, &tl, &e) != PD_OK)
          text = NULL;
        cJSON_AddStringToObject(co, "text", text ? text : "");
        free(text);
        const char *fr = pd_finish_reason_str(c->finish);
        if (fr) cJSON_AddStringToObject(co, "finish_reason", fr);
        else cJSON_AddNullToObject(co, "finish_reason");
        if (c->logprobs) {
          cJSON_AddItemToObject(co, "logprobs", c->logprobs);
          c->logprobs = NULL;
        }
        total += c->n;
        cJSON_AddItemToArray(chs, co);
      }
      /* the first choice's fields at the top level, for the common n = 1 case */
      cJSON *c0 = cJSON_GetArrayItem(chs, 0);
      cJSON_AddItemToObject(o, "output_ids", cJSON_Duplicate(cJSON_GetObjectItem(c0, "output_ids"), 1));
      cJSON_AddItemToObject(o, "text", cJSON_Duplicate(cJSON_GetObjectItem(c0, "text"), 1));
      cJSON_AddItemToObject(o, "finish_reason",
                            cJSON_Duplicate(cJSON_GetObjectItem(c0, "finish_reason"), 1));
      if (it->prompt_logprobs) {
        cJSON_AddItemToObject(o, "prompt_logprobs", it->prompt_logprobs);
        it->prompt_logprobs = NULL;
      }
      cJSON *u = cJSON_AddObjectToObject(o, "usage");
      cJSON_AddNumberToObject(u, "prompt_tokens", it->n_prompt);
      cJSON_AddNumberToObject(u, "completion_tokens", total);
      cJSON_AddNumberToObject(u, "cached_tokens", it->cached);
    }
    char *s = cJSON_PrintUnformatted(o);
    fputs(s, out);
    fputc('\n', out);
    free(s);
    cJSON_Delete(o);
  }
  if (out && out != stdout && fclose(out) != 0) rc = pdctl_fail("cannot write %s", output);
  for (int i = 0; i < b.n_items; i++) {
    for (int k = 0; k < b.items[i].n_choices; k++) {
      free(b.items[i].ch[k].ids);
      cJSON_Delete(b.items[i].ch[k].logprobs);
    }
    free(b.items[i].ch);
    cJSON_Delete(b.items[i].prompt_logprobs);
  }
  free(b.items);
  pd_sched_stats ss;
  pd_sched_get_stats(rt.sched, &ss);
  if (!quiet)
    fprintf(stderr,
            "pdctl: %d requests, %llu prompt tokens (%llu from the prefix cache), %llu generated "
            "in %.2f s (%.0f tok/s), %llu steps, %llu preemptions\n",
            b.n_items, (unsigned long long)ss.prompt_tokens,
            (unsigned long long)ss.cached_prompt_tokens, (unsigned long long)ss.generated_tokens,
            pdctl_now() - t0, (pdctl_now() - t0) > 0 ? ss.generated_tokens / (pdctl_now() - t0) : 0.0,
            (unsigned long long)ss.steps, (unsigned long long)ss.preemptions);
  if (!quiet && rt.spec.method != PD_SPEC_NONE)
    pdctl_print_spec_stats(stderr, &ss, rt.spec.method);
  pd_runtime_close(&rt);
  return rc;
}
